#include "launcher/cpdctl/client.h"

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cpd/tag.h"
#include "launcher/cli.h"
#include "launcher/common.h"
#include "launcher/cpdctl/output.h"

namespace cpd::ctl {

void Usage(const std::string& msg) {
  cpd::launcher::FailWith(kTool, msg, cpd::launcher::kUsageError);
}
void Fail(const std::string& msg) { cpd::launcher::FailWith(kTool, msg, kFailure); }

std::string OneLine(std::string s) {
  for (char& c : s) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

void Print(const std::string& s) { std::fwrite(s.data(), 1, s.size(), stdout); }

void FlushStdout() {
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    Fail(std::string("writing to stdout: ") + std::strerror(errno));
  }
}

void PrintJson(const nlohmann::json& j) {
  Print(j.dump(2) + "\n");
  FlushStdout();
}

namespace {

const char* CodeName(grpc::StatusCode c) {
  switch (c) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    default:
      return "UNKNOWN_CODE";
  }
}

}  // namespace

void AddGlobals(CLI::App* app, Globals* g) {
  app->add_option("--coordinator", g->coordinator,
                  "Coordinator address HOST:PORT (default: $CPD_COORDINATOR, else " +
                      std::string(kDefaultCoordinator) + ")");
  app->add_option("--token-file", g->token_file,
                  "File whose first line is the coordinator's token, sent as 'authorization: "
                  "Bearer <token>' (default: $CPD_TOKEN_FILE; none: no token)");
  app->add_option("--tls-ca", g->tls_ca,
                  "Use TLS and trust the server certificate issued by this PEM file (default: "
                  "plain TCP)");
  app->add_flag("--json", g->json, "Machine-readable output: one JSON document on stdout");
  app->add_option("--timeout", g->timeout_s,
                  "Deadline of each call in seconds; the history streams of export and plot "
                  "have none unless --timeout is given, the watch stream never has one")
      ->check(cpd::launcher::PositiveNumber())
      ->capture_default_str();
}

Connection::Connection(const Globals& g) : g_(g) {
  if (g_.coordinator.empty()) {
    const char* env = std::getenv("CPD_COORDINATOR");
    g_.coordinator = (env != nullptr && *env != '\0') ? env : kDefaultCoordinator;
  }
  {
    std::string host;
    int port = 0;
    if (!cpd::launcher::SplitHostPort(g_.coordinator, &host, &port)) {
      Usage("--coordinator " + cpd::launcher::QuoteForMessage(g_.coordinator) +
            ": expected HOST:PORT, e.g. 127.0.0.1:50051");
    }
  }
  if (g_.token_file.empty()) {
    const char* env = std::getenv("CPD_TOKEN_FILE");
    if (env != nullptr && *env != '\0') {
      g_.token_file = env;
      token_flag_ = "--token-file (CPD_TOKEN_FILE)";
    }
  }
  if (!g_.token_file.empty()) {
    token_ = cpd::launcher::ReadTokenFileOrExit(kTool, token_flag_, g_.token_file,
                                                cpd::launcher::kUsageError);
  }
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (!g_.tls_ca.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = cpd::launcher::ReadPemFileOrExit(
        kTool, "--tls-ca", g_.tls_ca, "CERTIFICATE", cpd::launcher::kUsageError);
    creds = grpc::SslCredentials(ssl);
  } else {
    creds = grpc::InsecureChannelCredentials();
  }
  // The coordinator sizes its answers by its own cap; do not refuse one for ours (4 MiB).
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);
  channel_ = grpc::CreateCustomChannel(g_.coordinator, creds, args);
  ops_ = v1::OperatorService::NewStub(channel_);
}

void Connection::Prepare(grpc::ClientContext* ctx, bool with_deadline) const {
  if (!token_.empty()) ctx->AddMetadata("authorization", "Bearer " + token_);
  if (with_deadline) {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::microseconds(int64_t(g_.timeout_s * 1e6)));
  }
}

std::string Connection::Explain(const grpc::Status& s, const std::string& rpc,
                                const std::string& job) const {
  const std::string msg = OneLine(s.error_message());
  const std::string& addr = g_.coordinator;
  switch (s.error_code()) {
    case grpc::StatusCode::UNAVAILABLE:
      return "cannot reach the coordinator at " + addr + ": " + msg;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "the coordinator at " + addr + " did not answer " + rpc + " within " +
             FormatG(g_.timeout_s, 6) + " s (--timeout)";
    case grpc::StatusCode::NOT_FOUND:
      if (!job.empty()) return "no job " + cpd::launcher::QuoteForMessage(job) + " on " + addr;
      break;
    case grpc::StatusCode::UNAUTHENTICATED:
      if (token_.empty()) {
        return "the coordinator at " + addr +
               " requires a token and none was sent: pass --token-file FILE (or set "
               "CPD_TOKEN_FILE)";
      }
      return "the coordinator at " + addr + " refused the token in " + token_flag_ + " " +
             g_.token_file + " (" + msg + ")";
    default:
      break;
  }
  return rpc + " on " + addr + ": " + CodeName(s.error_code()) + ": " + msg;
}

v1::JobRef MakeRef(const std::string& job) {
  v1::JobRef ref;
  const bool digits = !job.empty() && job.find_first_not_of("0123456789") == std::string::npos;
  if (digits) {
    errno = 0;
    char* end = nullptr;
    const long long id = std::strtoll(job.c_str(), &end, 10);
    if (errno == ERANGE || id <= 0) {
      Usage("JOB " + cpd::launcher::QuoteForMessage(job) + ": a job id is a positive integer");
    }
    ref.set_job_id(id);
    return ref;
  }
  if (!IsTag(job, kMaxJobNameLength)) {
    Usage("JOB " + cpd::launcher::QuoteForMessage(job) + ": expected a job name (1 to " +
          std::to_string(kMaxJobNameLength) + " of " + kTagCharacters + ") or a numeric id");
  }
  ref.set_job_name(job);
  return ref;
}

v1::JobStatusResponse GetStatus(Connection& c, const std::string& job) {
  grpc::ClientContext ctx;
  c.Prepare(&ctx);
  v1::JobStatusResponse st;
  const grpc::Status s = c.ops().JobStatus(&ctx, MakeRef(job), &st);
  if (!s.ok()) c.FailCall(s, "JobStatus", job);
  return st;
}

v1::GetScheduleResponse ReadSchedule(Connection& c, const std::string& job) {
  v1::GetScheduleRequest req;
  *req.mutable_job() = MakeRef(job);
  grpc::ClientContext ctx;
  c.Prepare(&ctx);
  v1::GetScheduleResponse resp;
  const grpc::Status s = c.ops().GetSchedule(&ctx, req, &resp);
  if (!s.ok()) c.FailCall(s, "GetSchedule", job);
  return resp;
}

}  // namespace cpd::ctl
