// cpdctl: the operator's command line for cpd-coordinator (OperatorService of cpd.v1). Lists
// jobs, shows a job's status and per-layer statistics, follows it live, reads and changes its
// precision schedule (read, edit, write back with expected_version, so concurrent edits are
// refused rather than lost), exports its history as CSV and plots it (scripts/cpdctl_plot.py on
// Debian's matplotlib).
//
// Exit codes: 0 success; 1 the coordinator could not be reached or refused the call, an unknown
// job, a file that could not be written; 2 a usage error (including a bad format spec, which is
// checked locally before any call).
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <pthread.h>
#include <pwd.h>
#include <signal.h>
#include <spawn.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cpd/config.h"
#include "launcher/cli.h"
#include "launcher/common.h"
#include "launcher/cpdctl_output.h"
#include "launcher/cpdctl_schedule.h"
#include "proto/cpd/v1/coordinator.grpc.pb.h"

extern char** environ;

namespace {

namespace v1 = cpd::v1;
using cpd::ctl::FormatAccuracy;
using cpd::ctl::FormatDuration;
using cpd::ctl::FormatG;
using cpd::ctl::Table;
using cpd::ctl::ToJson;
using cpd::launcher::kUsageError;
using nlohmann::json;

constexpr char kTool[] = "cpdctl";
constexpr int kFailure = 1;
constexpr char kDefaultCoordinator[] = "127.0.0.1:50051";

[[noreturn]] void Usage(const std::string& msg) {
  cpd::launcher::FailWith(kTool, msg, kUsageError);
}
[[noreturn]] void Fail(const std::string& msg) { cpd::launcher::FailWith(kTool, msg, kFailure); }

// A message from elsewhere (the server, a script) on one line.
std::string OneLine(std::string s) {
  for (char& c : s) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

std::string Trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

void Print(const std::string& s) { std::fwrite(s.data(), 1, s.size(), stdout); }

// Flushes stdout; a failed write (a full disk, a closed pipe) is an error, not silence.
void FlushStdout() {
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    Fail(std::string("writing to stdout: ") + std::strerror(errno));
  }
}

void PrintJson(const json& j) {
  Print(j.dump(2) + "\n");
  FlushStdout();
}

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

// ---- Options shared by every command ----------------------------------------------------------

struct Globals {
  std::string coordinator;  // empty: $CPD_COORDINATOR, else kDefaultCoordinator
  std::string token_file;   // empty: $CPD_TOKEN_FILE, else no token
  std::string tls_ca;
  bool json = false;
  double timeout_s = 10;
  bool timeout_given = false;  // --timeout on the command line (history streams then use it)
};

// The same options on the tool and on every command, so that they may come before or after the
// command's name and every --help lists them.
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
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
}

constexpr char kExitCodes[] =
    "Exit codes: 0 success; 1 the coordinator was unreachable or refused the call, unknown job, "
    "bad or missing token, file not written; 2 usage error (bad option, bad format spec).";

// ---- The connection to the coordinator ---------------------------------------------------------

class Connection {
 public:
  explicit Connection(const Globals& g) : g_(g) {
    if (g_.coordinator.empty()) {
      const char* env = std::getenv("CPD_COORDINATOR");
      g_.coordinator = (env != nullptr && *env != '\0') ? env : kDefaultCoordinator;
    }
    if (g_.token_file.empty()) {
      const char* env = std::getenv("CPD_TOKEN_FILE");
      if (env != nullptr && *env != '\0') {
        g_.token_file = env;
        token_flag_ = "--token-file (CPD_TOKEN_FILE)";
      }
    }
    if (!g_.token_file.empty()) {
      token_ = cpd::launcher::ReadTokenFileOrExit(kTool, token_flag_, g_.token_file, kFailure);
    }
    std::shared_ptr<grpc::ChannelCredentials> creds;
    if (!g_.tls_ca.empty()) {
      grpc::SslCredentialsOptions ssl;
      ssl.pem_root_certs = cpd::launcher::ReadFileOrExit(kTool, "--tls-ca", g_.tls_ca, kFailure);
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

  const std::string& address() const { return g_.coordinator; }
  bool timeout_given() const { return g_.timeout_given; }
  v1::OperatorService::Stub& ops() { return *ops_; }

  // The token and, when `with_deadline`, --timeout from now.
  void Prepare(grpc::ClientContext* ctx, bool with_deadline = true) const {
    if (!token_.empty()) ctx->AddMetadata("authorization", "Bearer " + token_);
    if (with_deadline) {
      ctx->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::microseconds(int64_t(g_.timeout_s * 1e6)));
    }
  }

  // The line for a failed call `rpc` about `job` (empty: not about one job).
  std::string Explain(const grpc::Status& s, const std::string& rpc,
                      const std::string& job = "") const {
    const std::string msg = OneLine(s.error_message());
    const std::string& addr = g_.coordinator;
    switch (s.error_code()) {
      case grpc::StatusCode::UNAVAILABLE:
        return "cannot reach the coordinator at " + addr + ": " + msg;
      case grpc::StatusCode::DEADLINE_EXCEEDED:
        return "the coordinator at " + addr + " did not answer " + rpc + " within " +
               FormatG(g_.timeout_s, 6) + " s (--timeout)";
      case grpc::StatusCode::NOT_FOUND:
        if (!job.empty()) return "no job '" + job + "' on " + addr;
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

  [[noreturn]] void FailCall(const grpc::Status& s, const std::string& rpc,
                             const std::string& job = "") const {
    Fail(Explain(s, rpc, job));
  }

 private:
  Globals g_;
  std::string token_;
  std::string token_flag_ = "--token-file";  // where the token file was named
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::OperatorService::Stub> ops_;
};

// JOB on the command line: a numeric id when all digits, else a name.
v1::JobRef MakeRef(const std::string& job) {
  v1::JobRef ref;
  const bool digits = !job.empty() && job.find_first_not_of("0123456789") == std::string::npos;
  if (digits) {
    errno = 0;
    char* end = nullptr;
    const long long id = std::strtoll(job.c_str(), &end, 10);
    if (errno == ERANGE || id <= 0) Usage("JOB '" + job + "': a job id is a positive integer");
    ref.set_job_id(id);
    return ref;
  }
  if (job.empty() || job.size() > 128 ||
      job.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-") !=
          std::string::npos) {
    Usage("JOB '" + job + "': expected a job name ([A-Za-z0-9._-]{1,128}) or a numeric id");
  }
  ref.set_job_name(job);
  return ref;
}

// "NAME (id N)": how the status block names a job.
std::string NameAndId(const v1::JobSummary& j) {
  return j.job_name() + " (id " + std::to_string(j.job_id()) + ")";
}

v1::JobStatusResponse GetStatus(Connection& c, const std::string& job) {
  grpc::ClientContext ctx;
  c.Prepare(&ctx);
  v1::JobStatusResponse st;
  const grpc::Status s = c.ops().JobStatus(&ctx, MakeRef(job), &st);
  if (!s.ok()) c.FailCall(s, "JobStatus", job);
  return st;
}

// ---- Files written atomically ----------------------------------------------------------------

// Temporary files to remove when cpdctl exits, also through Fail() (std::exit runs no
// destructors). Single-threaded use: the watch threads create no files.
std::vector<std::string>& TempFiles() {
  static std::vector<std::string> files;
  return files;
}
void RemoveTempFiles() {
  for (const auto& f : TempFiles()) unlink(f.c_str());
  TempFiles().clear();
}
void AddTempFile(const std::string& path) {
  // The list exists before the handler is registered, so it is destroyed after the handler ran.
  std::vector<std::string>& files = TempFiles();
  static const bool registered = std::atexit(RemoveTempFiles) == 0;
  (void)registered;
  files.push_back(path);
}
void ForgetTempFile(const std::string& path) {
  auto& v = TempFiles();
  v.erase(std::remove(v.begin(), v.end(), path), v.end());
}

// A file created as a temporary in the target's directory and renamed over the target only when
// complete (after fsync), so a reader sees the old file or the whole new one.
class AtomicFile {
 public:
  // `suffix` is kept at the end of the temporary's name (matplotlib reads the format from it).
  explicit AtomicFile(const std::string& path, const std::string& suffix = "") : path_(path) {
    const size_t slash = path.rfind('/');
    dir_ = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
    const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
    tmp_ = dir_ + "/." + base + ".tmp.XXXXXX" + suffix;
    fd_ = mkstemps(tmp_.data(), int(suffix.size()));
    if (fd_ < 0) Fail("cannot create a file in " + dir_ + ": " + std::strerror(errno));
    AddTempFile(tmp_);
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile() {
    if (file_ != nullptr) std::fclose(file_);
    if (fd_ >= 0 && file_ == nullptr) close(fd_);
    if (!committed_) unlink(tmp_.c_str());
    ForgetTempFile(tmp_);
  }

  const std::string& temp_path() const { return tmp_; }
  FILE* stream() {
    if (file_ == nullptr) file_ = fdopen(fd_, "w");
    if (file_ == nullptr) Fail("cannot open " + tmp_ + ": " + std::strerror(errno));
    return file_;
  }

  // fsync, rename over the target, fsync the directory.
  void Commit() {
    if (file_ != nullptr) {
      if (std::fflush(file_) != 0 || std::ferror(file_)) WriteFailed();
    }
    // Another process (the plot script) may have written the temporary: sync it by name.
    const int fd = open(tmp_.c_str(), O_RDONLY);
    if (fd < 0 || fsync(fd) != 0) WriteFailed();
    close(fd);
    if (file_ != nullptr) {
      std::fclose(file_);
      file_ = nullptr;
    } else {
      close(fd_);
    }
    fd_ = -1;
    // mkstemp makes the file 0600; give it the permissions a new file would get.
    const mode_t mask = umask(0);
    umask(mask);
    chmod(tmp_.c_str(), 0666 & ~mask);
    if (std::rename(tmp_.c_str(), path_.c_str()) != 0) {
      Fail("cannot rename " + tmp_ + " to " + path_ + ": " + std::strerror(errno));
    }
    committed_ = true;
    ForgetTempFile(tmp_);
    const int dfd = open(dir_.c_str(), O_RDONLY | O_DIRECTORY);
    if (dfd >= 0) {
      fsync(dfd);
      close(dfd);
    }
  }

 private:
  [[noreturn]] void WriteFailed() { Fail("writing " + path_ + ": " + std::strerror(errno)); }

  std::string path_, dir_, tmp_;
  int fd_ = -1;
  FILE* file_ = nullptr;
  bool committed_ = false;
};

// Steps a job has done: a report's step is the index of the step just done (steps count from
// 0), so one more; before any report, the summary's step is where the run starts.
int64_t StepsDone(const v1::JobSummary& j) {
  return j.last_report_ms() > 0 ? j.step() + 1 : j.step();
}

// ---- jobs ------------------------------------------------------------------------------------

int RunJobs(const Globals& g) {
  Connection c(g);
  grpc::ClientContext ctx;
  c.Prepare(&ctx);
  v1::ListJobsResponse resp;
  const grpc::Status s = c.ops().ListJobs(&ctx, v1::ListJobsRequest(), &resp);
  if (!s.ok()) c.FailCall(s, "ListJobs");
  if (g.json) {
    PrintJson(ToJson(resp));
    return 0;
  }
  if (resp.jobs().empty()) {
    Print("no jobs on " + c.address() + "\n");
    FlushStdout();
    return 0;
  }
  using A = Table::Align;
  Table t({{"ID", A::kRight},
           {"NAME", A::kLeft},
           {"STATE", A::kLeft},
           {"STEP", A::kRight},
           {"TOTAL", A::kRight},
           {"DONE", A::kRight},
           {"RANKS", A::kRight},
           {"ARCH", A::kLeft},
           {"DATASET", A::kLeft},
           {"REGISTERED", A::kLeft},
           {"LAST REPORT", A::kRight}});
  const int64_t now = cpd::launcher::NowMs();
  for (const auto& j : resp.jobs()) {
    t.AddRow({std::to_string(j.job_id()), j.job_name(), j.state(), std::to_string(j.step()),
              j.total_steps() > 0 ? std::to_string(j.total_steps()) : "-",
              j.total_steps() > 0 ? cpd::ctl::FormatPercent(double(StepsDone(j)) / j.total_steps())
                                  : "-",
              std::to_string(j.world_size()), j.arch().empty() ? "-" : j.arch(),
              j.dataset().empty() ? "-" : j.dataset(), cpd::ctl::FormatTime(j.registered_ms()),
              j.last_report_ms() > 0 ? FormatDuration(now - j.last_report_ms()) + " ago" : "-"});
  }
  Print(t.Render());
  FlushStdout();
  return 0;
}

// ---- status ----------------------------------------------------------------------------------

std::string Ratio(int64_t a, int64_t b) {
  return std::to_string(a) + " / " + (b > 0 ? std::to_string(b) : std::string("?"));
}

// The status block of `status` and `watch`; `age_ms` is the last report's age (-1: none).
std::string StatusBlock(const v1::JobStatusResponse& st, int64_t age_ms) {
  const v1::JobSummary& j = st.job();
  std::vector<std::pair<std::string, std::string>> kv;
  kv.emplace_back("job", NameAndId(j) + ", " + j.state());
  std::string model =
      (j.arch().empty() ? "?" : j.arch()) + " on " + (j.dataset().empty() ? "?" : j.dataset());
  if (!st.allreduce().empty()) model += ", all-reduce " + st.allreduce();
  kv.emplace_back("model", model);
  std::string step = std::to_string(j.step());
  if (j.total_steps() > 0) {
    step += " (" + Ratio(StepsDone(j), j.total_steps()) + " done, " +
            cpd::ctl::FormatPercent(double(StepsDone(j)) / double(j.total_steps())) + ")";
  }
  kv.emplace_back("step", step);
  kv.emplace_back("epoch", Ratio(st.epoch(), st.epochs()));
  kv.emplace_back("bits", st.bits() > 0 ? std::to_string(st.bits()) + " (CPT forward)" : "-");
  const auto& sch = st.schedule();
  kv.emplace_back("schedule", "v" + std::to_string(sch.version()) + " from step " +
                                  std::to_string(sch.effective_from_step()) + ": " +
                                  cpd::ctl::ScheduleSummary(sch));
  kv.emplace_back("ranks", std::to_string(st.ranks_alive()) + " / " +
                               std::to_string(j.world_size()) + " alive");
  kv.emplace_back("last report", age_ms < 0 ? "none yet" : FormatDuration(age_ms) + " ago");
  kv.emplace_back("loss", age_ms < 0 ? "-" : FormatG(st.loss(), 5));
  kv.emplace_back("accuracy", "train " + FormatAccuracy(st.train_accuracy()) + ", test " +
                                  FormatAccuracy(st.test_accuracy()));
  kv.emplace_back("images/s", age_ms < 0 ? "-" : FormatG(st.images_per_s(), 4));
  kv.emplace_back("reports", std::to_string(st.reports_stored()) + " stored, " +
                                 std::to_string(st.dropped_reports()) + " dropped by the workers");
  kv.emplace_back("skipped", std::to_string(st.skipped_steps()) + " steps (NaN/Inf gradients)");
  if (!st.layers().empty()) {
    int quantizable = 0;
    for (const auto& l : st.layers()) quantizable += l.quantizable() ? 1 : 0;
    kv.emplace_back("layers", std::to_string(st.layers_size()) + " (" +
                                  std::to_string(quantizable) + " with W/A/E/G sites)");
  }
  if (!st.workers().empty()) {
    std::string w;
    for (const auto& wk : st.workers()) {
      if (!w.empty()) w += ", ";
      w += std::to_string(wk.rank()) + ":" + wk.host() + "/" + std::to_string(wk.pid());
    }
    kv.emplace_back("workers", w);
  }
  return cpd::ctl::KeyValues(kv);
}

int RunStatus(const Globals& g, const std::string& job) {
  Connection c(g);
  const v1::JobStatusResponse st = GetStatus(c, job);
  if (g.json) {
    PrintJson(ToJson(st));
    return 0;
  }
  Print(StatusBlock(st, st.last_report_age_ms()));
  FlushStdout();
  return 0;
}

// ---- layers ----------------------------------------------------------------------------------

struct LayersArgs {
  std::string job;
  int64_t step = -1, from = -1, to = -1;
  std::string sort;
  std::string site;
  int top = 0;
  int limit = 0;
};

// The rows of `reports` at `site` (empty: all), sorted, at most `top` per report (0: all).
std::vector<cpd::ctl::LayerRow> SelectRows(const v1::LayerStatsResponse& resp,
                                           const std::string& site, const std::string& sort,
                                           int top) {
  std::optional<v1::Site> want;
  if (!site.empty()) want = cpd::ctl::ParseSite(site);
  std::vector<cpd::ctl::LayerRow> rows;
  size_t order = 0;
  for (const auto& r : resp.reports()) {
    for (const auto& l : r.layers()) {
      if (want && l.site() != *want) continue;
      rows.push_back({&r, &l, order++});
    }
  }
  if (!sort.empty()) {
    const cpd::Status s = cpd::ctl::SortLayerRows(&rows, sort);
    if (!s.ok()) Usage(s.message());
  }
  if (top > 0) {
    std::vector<cpd::ctl::LayerRow> kept;
    const v1::StatsReport* cur = nullptr;
    int n = 0;
    for (const auto& row : rows) {
      if (row.report != cur) {
        cur = row.report;
        n = 0;
      }
      if (n++ < top) kept.push_back(row);
    }
    rows = std::move(kept);
  }
  return rows;
}

std::string ReportHeadline(const std::string& job, const v1::StatsReport& r) {
  std::string h = "job " + job + "  step " + std::to_string(r.step()) + "  epoch " +
                  std::to_string(r.epoch()) + "  loss " + FormatG(r.loss(), 5) + "  schedule v" +
                  std::to_string(r.schedule_version());
  if (r.bits() > 0) h += "  bits " + std::to_string(r.bits());
  return h + "\n";
}

int RunLayers(const Globals& g, const LayersArgs& a) {
  if (a.step >= 0 && (a.from >= 0 || a.to >= 0)) Usage("--step excludes --from/--to");
  if (a.from >= 0 && a.to >= 0 && a.to < a.from) {
    Usage("--from " + std::to_string(a.from) + " --to " + std::to_string(a.to) +
          ": an empty range");
  }
  const v1::JobRef ref = MakeRef(a.job);
  Connection c(g);
  v1::LayerStatsRequest req;
  *req.mutable_job() = ref;
  req.set_limit(a.limit);
  const bool latest = a.step < 0 && a.from < 0 && a.to < 0;
  if (latest) {
    req.set_latest(true);
  } else if (a.step >= 0) {
    req.set_from_step(a.step);
    req.set_to_step(a.step);
  } else {
    req.set_from_step(std::max<int64_t>(a.from, 0));
    req.set_to_step(a.to >= 0 ? a.to : std::numeric_limits<int64_t>::max());
  }
  // The coordinator caps one answer's size; a range is read in pages, each starting again at
  // the last step received (whose reports may have been cut) and skipping what was already read.
  v1::LayerStatsResponse resp;
  for (;;) {
    grpc::ClientContext ctx;
    c.Prepare(&ctx);
    v1::LayerStatsResponse page;
    const grpc::Status s = c.ops().LayerStats(&ctx, req, &page);
    if (!s.ok()) c.FailCall(s, "LayerStats", a.job);
    if (latest || a.step >= 0) {
      resp = std::move(page);
      break;
    }
    int skip = 0;  // reports at the first step of this page that the previous pages hold
    if (resp.reports_size() > 0) {
      const int64_t last = resp.reports(resp.reports_size() - 1).step();
      for (const auto& r : resp.reports()) skip += r.step() == last ? 1 : 0;
    }
    int added = 0;
    for (auto& r : *page.mutable_reports()) {
      if (skip > 0 && resp.reports_size() > 0 &&
          r.step() == resp.reports(resp.reports_size() - 1).step()) {
        --skip;
        continue;
      }
      *resp.add_reports() = std::move(r);
      ++added;
    }
    if (added == 0 || (a.limit > 0 && resp.reports_size() >= a.limit)) break;
    const int64_t last = resp.reports(resp.reports_size() - 1).step();
    req.set_from_step(last);
    if (a.limit > 0) {
      // The page repeats the reports at `last` that are already here.
      int again = 0;
      for (const auto& r : resp.reports()) again += r.step() == last ? 1 : 0;
      req.set_limit(std::min(a.limit - resp.reports_size() + again, 10000));
    }
  }
  if (a.limit > 0 && resp.reports_size() > a.limit) {
    resp.mutable_reports()->DeleteSubrange(a.limit, resp.reports_size() - a.limit);
  }
  const auto rows = SelectRows(resp, a.site, a.sort, a.top);

  if (g.json) {
    json out = {{"job", a.job}, {"reports", json::array()}};
    for (const auto& r : resp.reports()) {
      json jr = ToJson(r);
      jr["layers"] = json::array();
      for (const auto& row : rows) {
        if (row.report == &r) jr["layers"].push_back(ToJson(*row.stat));
      }
      out["reports"].push_back(std::move(jr));
    }
    PrintJson(out);
    return 0;
  }
  if (resp.reports().empty()) {
    if (latest) {
      Print("job " + a.job + " has no layer statistics yet\n");
      FlushStdout();
      return 0;
    }
    Fail("job " + a.job + " has no layer statistics " +
         (a.step >= 0 ? "at step " + std::to_string(a.step)
                      : "in steps " + std::to_string(std::max<int64_t>(a.from, 0)) + ".." +
                            (a.to >= 0 ? std::to_string(a.to) : std::string("end"))));
  }
  const bool many = resp.reports_size() > 1;
  if (many) {
    Print("job " + a.job + "  steps " + std::to_string(resp.reports(0).step()) + ".." +
          std::to_string(resp.reports(resp.reports_size() - 1).step()) + "  (" +
          std::to_string(resp.reports_size()) + " reports)\n");
  } else {
    Print(ReportHeadline(a.job, resp.reports(0)));
  }
  Print(cpd::ctl::LayerTable(rows, many).Render());
  FlushStdout();
  return 0;
}

// ---- schedule get / set ----------------------------------------------------------------------

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

int RunScheduleGet(const Globals& g, const std::string& job, bool history) {
  MakeRef(job);
  Connection c(g);
  const v1::GetScheduleResponse resp = ReadSchedule(c, job);
  if (g.json) {
    PrintJson(ToJson(resp));
    return 0;
  }
  Print("job " + job + "\n" + cpd::ctl::ScheduleDetails(resp.schedule()));
  if (history) {
    using A = Table::Align;
    Table t({{"VERSION", A::kRight},
             {"FROM STEP", A::kRight},
             {"SET BY", A::kLeft},
             {"SET AT", A::kLeft},
             {"SCHEDULE", A::kLeft}});
    for (const auto& h : resp.history()) {
      t.AddRow({std::to_string(h.version()), std::to_string(h.effective_from_step()),
                h.set_by().empty() ? "-" : h.set_by(), cpd::ctl::FormatTime(h.set_at_ms()),
                cpd::ctl::ScheduleSummary(h)});
    }
    Print("\n" + t.Render());
  }
  FlushStdout();
  return 0;
}

// "cpdctl USER@HOST" for the schedule's set_by; the account from the password database when
// $USER is unset (as under sudo or in containers).
std::string WhoAmI() {
  std::string user;
  if (const char* env = std::getenv("USER"); env != nullptr && *env) user = env;
  if (user.empty()) {
    if (const passwd* pw = getpwuid(geteuid()); pw != nullptr && pw->pw_name != nullptr) {
      user = pw->pw_name;
    }
  }
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  return "cpdctl " + (user.empty() ? std::string("?") : user) + "@" + (host[0] ? host : "?");
}

int RunScheduleSet(const Globals& g, const std::string& job, const cpd::ctl::ScheduleEdits& e,
                   uint64_t expect_version) {
  // Everything checkable without the coordinator fails here, before any call.
  if (const cpd::Status s = cpd::ctl::ValidateScheduleEdits(e); !s.ok()) Usage(s.message());
  const v1::JobRef ref = MakeRef(job);
  Connection c(g);
  // Layer names in overrides and --keep-fp32 are checked against the job's layers.
  const bool names_layers = !e.keep_fp32
                                ? std::any_of(e.formats.begin(), e.formats.end(),
                                              [](const std::string& f) {
                                                const std::string lhs = f.substr(0, f.find('='));
                                                return !cpd::ctl::ParseSite(lhs);
                                              })
                                : true;
  v1::JobStatusResponse st;
  if (names_layers) st = GetStatus(c, job);
  const v1::GetScheduleResponse cur = ReadSchedule(c, job);
  v1::PrecisionSchedule next = cur.schedule();
  if (const cpd::Status s =
          cpd::ctl::ApplyScheduleEdits(e, names_layers ? &st.layers() : nullptr, &next);
      !s.ok()) {
    Usage(s.message());
  }
  v1::SetScheduleRequest req;
  *req.mutable_job() = ref;
  *req.mutable_schedule() = next;
  const uint64_t expected = expect_version > 0 ? expect_version : cur.schedule().version();
  req.set_expected_version(expected);
  req.set_set_by(WhoAmI());
  grpc::ClientContext ctx;
  c.Prepare(&ctx);
  v1::SetScheduleResponse resp;
  const grpc::Status s = c.ops().SetSchedule(&ctx, req, &resp);
  if (s.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
    Fail("the schedule of job '" + job + "' is no longer version " + std::to_string(expected) +
         " (changed by someone else); nothing was written: run the command again (" +
         OneLine(s.error_message()) + ")");
  }
  if (!s.ok()) c.FailCall(s, "SetSchedule", job);
  if (g.json) {
    PrintJson(ToJson(resp));
    return 0;
  }
  Print("job " + job + ": schedule version " + std::to_string(cur.schedule().version()) + " -> " +
        std::to_string(resp.schedule().version()) + ", effective from step " +
        std::to_string(resp.schedule().effective_from_step()) + "\n" +
        cpd::ctl::ScheduleDetails(resp.schedule()));
  FlushStdout();
  return 0;
}

// ---- watch -----------------------------------------------------------------------------------

struct WatchArgs {
  std::string job;
  bool layers = false;
  int count = 0;
  double interval_s = 1;
};

// The reports of a WatchJob stream, handed from the reading thread to the drawing one.
struct WatchQueue {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<v1::StatsReport> reports;
  bool ended = false;  // the stream is over (status below)
  bool interrupted = false;
  grpc::Status status;
};

// SIGINT/SIGTERM/SIGHUP are taken by a thread (sigwait) that cancels the stream; they must be
// blocked before gRPC starts its threads, which inherit the mask.
sigset_t StopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGHUP);
  sigaddset(&set, SIGUSR1);  // ends the signal thread
  return set;
}

// A one-line summary of a report (the non-TTY output of watch).
std::string ReportLine(const v1::StatsReport& r, const v1::JobStatusResponse& st) {
  std::string l = "step " + Ratio(r.step(), st.job().total_steps()) + " epoch " +
                  Ratio(r.epoch(), st.epochs()) + " loss " + FormatG(r.loss(), 5) + " lr " +
                  FormatG(r.lr(), 4);
  // Ratio() spaces its slash for the status block; lines are denser.
  for (size_t p; (p = l.find(" / ")) != std::string::npos;) l.replace(p, 3, "/");
  if (r.bits() > 0) l += " bits " + std::to_string(r.bits());
  l += " schedule v" + std::to_string(r.schedule_version()) + " ranks " +
       std::to_string(r.ranks_alive()) + "/" + std::to_string(st.job().world_size()) + " " +
       FormatG(r.images_per_s(), 4) + " img/s";
  if (r.train_accuracy() >= 0) l += " train " + FormatAccuracy(r.train_accuracy());
  if (r.test_accuracy() >= 0) l += " test " + FormatAccuracy(r.test_accuracy());
  if (r.skipped_steps() > 0) l += " skipped " + std::to_string(r.skipped_steps());
  if (r.layers_size() > 0) l += " layers " + std::to_string(r.layers_size());
  if (r.finished()) l += " finished";
  return l + "\n";
}

// Folds a report into the status block's fields (reports_stored stays as JobStatus said: the
// coordinator stores reports asynchronously).
void Absorb(const v1::StatsReport& r, v1::JobStatusResponse* st) {
  st->mutable_job()->set_step(r.step());
  st->mutable_job()->set_last_report_ms(r.time_ms());
  if (r.finished()) st->mutable_job()->set_state("finished");
  st->set_epoch(r.epoch());
  st->set_bits(r.bits());
  st->set_loss(r.loss());
  if (r.train_accuracy() >= 0) st->set_train_accuracy(r.train_accuracy());
  if (r.test_accuracy() >= 0) st->set_test_accuracy(r.test_accuracy());
  st->set_ranks_alive(r.ranks_alive());
  st->set_images_per_s(r.images_per_s());
  st->set_dropped_reports(r.dropped_reports());
  st->set_skipped_steps(r.skipped_steps());
  st->mutable_schedule()->set_version(std::max(st->schedule().version(), r.schedule_version()));
}

int TerminalRows() {
  winsize ws{};
  if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_row > 0) return ws.ws_row;
  return 40;
}

int RunWatch(const Globals& g, const WatchArgs& a) {
  const v1::JobRef ref = MakeRef(a.job);
  const sigset_t stop = StopSignals();
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  Connection c(g);
  v1::JobStatusResponse st = GetStatus(c, a.job);  // checks the job and the connection first
  const bool tty = isatty(STDOUT_FILENO) && !g.json;

  grpc::ClientContext ctx;
  c.Prepare(&ctx, /*with_deadline=*/false);
  v1::WatchJobRequest req;
  *req.mutable_job() = ref;
  req.set_with_layers(a.layers);
  WatchQueue q;

  std::thread signals([&] {
    int sig = 0;
    while (sigwait(&stop, &sig) == 0) {
      if (sig == SIGUSR1) return;
      {
        std::lock_guard<std::mutex> lock(q.mu);
        q.interrupted = true;
      }
      ctx.TryCancel();
      q.cv.notify_all();
    }
  });
  std::unique_ptr<grpc::ClientReader<v1::StatsReport>> reader = c.ops().WatchJob(&ctx, req);
  std::thread reading([&] {
    v1::StatsReport r;
    while (reader->Read(&r)) {
      std::lock_guard<std::mutex> lock(q.mu);
      q.reports.push_back(r);
      q.cv.notify_all();
    }
    grpc::Status s = reader->Finish();
    std::lock_guard<std::mutex> lock(q.mu);
    q.status = std::move(s);
    q.ended = true;
    q.cv.notify_all();
  });

  using Clock = std::chrono::steady_clock;
  const auto started = Clock::now();
  const int64_t age_at_start = st.last_report_age_ms();
  std::optional<Clock::time_point> last_arrival;
  v1::StatsReport with_layers;  // the latest report that carried layer rows
  bool have_layers = false, finished = false, dirty = true;
  if (a.layers && tty) {
    // The table starts from the latest stored layer rows, not empty until the next such report.
    v1::LayerStatsRequest lreq;
    *lreq.mutable_job() = ref;
    lreq.set_latest(true);
    grpc::ClientContext lctx;
    c.Prepare(&lctx);
    v1::LayerStatsResponse lresp;
    const grpc::Status ls = c.ops().LayerStats(&lctx, lreq, &lresp);
    if (ls.ok() && lresp.reports_size() > 0) {
      with_layers = lresp.reports(lresp.reports_size() - 1);
      have_layers = true;
    }
  }
  int received = 0;
  auto interval = std::chrono::microseconds(int64_t(a.interval_s * 1e6));
  auto last_draw = Clock::now() - interval;

  auto draw = [&] {
    int64_t age = -1;
    if (last_arrival) {
      age = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - *last_arrival)
                .count();
    } else if (age_at_start >= 0) {
      age = age_at_start +
            std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - started).count();
    }
    std::string screen = "\x1b[H\x1b[2J";
    screen += "cpdctl watch " + a.job + " on " + c.address() + "  " +
              cpd::ctl::FormatTime(cpd::launcher::NowMs()) + "  (Ctrl-C stops)\n\n";
    const std::string block =
        StatusBlock(st, age) + std::to_string(received) + " reports received by this watch\n";
    screen += block;
    if (a.layers) {
      screen += "\n";
      if (!have_layers) {
        screen += "no layer statistics yet\n";
      } else {
        v1::LayerStatsResponse one;
        *one.add_reports() = with_layers;
        const auto rows = SelectRows(one, "", "", 0);
        screen += ReportHeadline(a.job, with_layers);
        const Table t = cpd::ctl::LayerTable(rows, false);
        const long used = 3 + long(std::count(block.begin(), block.end(), '\n')) + 3;
        const long room = std::max(1L, long(TerminalRows()) - used - 1);
        screen += t.Render(room);
        if (long(t.rows()) > room) {
          screen += "... " + std::to_string(t.rows() - size_t(room)) + " more rows\n";
        }
      }
    }
    Print(screen);
    FlushStdout();
    last_draw = Clock::now();
    dirty = false;
  };

  bool by_count = false, interrupted = false, ended = false;
  grpc::Status end_status;
  for (;;) {
    std::deque<v1::StatsReport> batch;
    {
      std::unique_lock<std::mutex> lock(q.mu);
      q.cv.wait_for(lock, tty ? interval : std::chrono::microseconds(3'600'000'000LL),
                    [&] { return !q.reports.empty() || q.ended || q.interrupted; });
      batch.swap(q.reports);
      interrupted = q.interrupted;
      ended = q.ended;
      end_status = q.status;
    }
    for (const auto& r : batch) {
      if (by_count) break;
      // The stream starts with the latest report, which JobStatus already dated.
      const bool known = received == 0 && age_at_start >= 0 && r.step() == st.job().step();
      ++received;
      if (!known) last_arrival = Clock::now();
      Absorb(r, &st);
      if (r.layers_size() > 0) {
        with_layers = r;
        have_layers = true;
      }
      finished = finished || r.finished();
      dirty = true;
      if (g.json) {
        Print(ToJson(r).dump() + "\n");
        FlushStdout();
      } else if (!tty) {
        Print(ReportLine(r, st));
        FlushStdout();
      }
      if (a.count > 0 && received >= a.count) by_count = true;
    }
    if (tty && (dirty || Clock::now() - last_draw >= interval || by_count || ended)) draw();
    if (by_count || interrupted || ended || finished) break;
  }
  ctx.TryCancel();
  reading.join();
  pthread_kill(signals.native_handle(), SIGUSR1);
  signals.join();
  {
    std::lock_guard<std::mutex> lock(q.mu);
    end_status = q.status;
  }
  if (by_count || interrupted || finished) return 0;
  if (end_status.ok()) return 0;  // the coordinator ended the stream: the job is over
  c.FailCall(end_status, "WatchJob", a.job);
}

// ---- export / plot: the stored history ------------------------------------------------------

// Streams the job's stored reports (with layer rows) into `sink`; returns how many.
template <typename Sink>
size_t ReadHistory(Connection& c, const std::string& job, int64_t from, int64_t to, Sink sink) {
  v1::JobHistoryRequest req;
  *req.mutable_job() = MakeRef(job);
  req.set_from_step(std::max<int64_t>(from, 0));
  req.set_to_step(std::max<int64_t>(to, 0));
  req.set_with_layers(true);
  grpc::ClientContext ctx;
  // A long job's history may take longer than one call's default deadline to stream.
  c.Prepare(&ctx, c.timeout_given());
  auto reader = c.ops().JobHistory(&ctx, req);
  v1::StatsReport r;
  size_t n = 0;
  while (reader->Read(&r)) {
    if (to >= 0 && r.step() > to) continue;  // to_step 0 means "to the end" on the wire
    sink(r);
    ++n;
  }
  const grpc::Status s = reader->Finish();
  if (!s.ok()) c.FailCall(s, "JobHistory", job);
  return n;
}

std::string CsvHeader() {
  return "step,rank,epoch,time_ms,loss,lr,bits,schedule_version,images_per_s,ranks_alive,"
         "skipped_steps,dropped_reports,train_accuracy,test_accuracy,finished,layer,site,format,"
         "format_bits,aps_shift,max_abs,saturated,flushed,rel_error,flips,nonfinite\n";
}

// One CSV row per layer row of the report, or one for the report alone when it has none.
size_t CsvRows(const v1::StatsReport& r, FILE* out) {
  using cpd::ctl::CsvField;
  using cpd::ctl::ShortestDouble;
  auto opt = [](double v) { return v < 0 ? std::string() : ShortestDouble(v); };
  const std::string head =
      std::to_string(r.step()) + "," + std::to_string(r.rank()) + "," + std::to_string(r.epoch()) +
      "," + std::to_string(r.time_ms()) + "," + ShortestDouble(r.loss()) + "," +
      ShortestDouble(r.lr()) + "," + std::to_string(r.bits()) + "," +
      std::to_string(r.schedule_version()) + "," + ShortestDouble(r.images_per_s()) + "," +
      std::to_string(r.ranks_alive()) + "," + std::to_string(r.skipped_steps()) + "," +
      std::to_string(r.dropped_reports()) + "," + opt(r.train_accuracy()) + "," +
      opt(r.test_accuracy()) + "," + (r.finished() ? "1" : "0");
  if (r.layers().empty()) {
    const std::string line = head + ",,,,,,,,,,,\n";
    std::fwrite(line.data(), 1, line.size(), out);
    return 1;
  }
  for (const auto& l : r.layers()) {
    const std::string line = head + "," + CsvField(l.layer()) + "," + cpd::ctl::SiteName(l.site()) +
                             "," + CsvField(l.format()) + "," + std::to_string(l.bits()) + "," +
                             std::to_string(l.aps_shift()) + "," + ShortestDouble(l.max_abs()) +
                             "," + ShortestDouble(l.saturated()) + "," +
                             ShortestDouble(l.flushed()) + "," + opt(l.rel_error()) + "," +
                             std::to_string(l.flips()) + "," + std::to_string(l.nonfinite()) + "\n";
    std::fwrite(line.data(), 1, line.size(), out);
  }
  return size_t(r.layers_size());
}

struct RangeArgs {
  std::string job;
  std::string out;
  int64_t from = -1, to = -1;
};

int RunExport(const Globals& g, const RangeArgs& a) {
  MakeRef(a.job);
  if (a.from >= 0 && a.to >= 0 && a.to < a.from) Usage("--from/--to: an empty range");
  Connection c(g);
  const bool to_stdout = a.out == "-";
  std::unique_ptr<AtomicFile> file;
  if (!to_stdout) file = std::make_unique<AtomicFile>(a.out);
  FILE* out = to_stdout ? stdout : file->stream();
  const std::string header = CsvHeader();
  std::fwrite(header.data(), 1, header.size(), out);
  size_t rows = 0;
  const size_t reports = ReadHistory(c, a.job, a.from, a.to,
                                     [&](const v1::StatsReport& r) { rows += CsvRows(r, out); });
  if (to_stdout) {
    FlushStdout();
    return 0;
  }
  file->Commit();
  if (g.json) {
    PrintJson({{"file", a.out}, {"rows", rows}, {"reports", reports}});
  } else {
    Print("wrote " + std::to_string(rows) + " rows (" + std::to_string(reports) + " reports) to " +
          a.out + "\n");
    FlushStdout();
  }
  return 0;
}

bool IsFile(const std::string& p) {
  struct stat sb;
  return stat(p.c_str(), &sb) == 0 && S_ISREG(sb.st_mode);
}

std::string ExecutableDir() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  std::string p(buf, size_t(n));
  return p.substr(0, p.rfind('/'));
}

// The plot script: $CPD_PLOT_SCRIPT, the source tree's (compiled in), next to the executable.
std::string FindPlotScript() {
  std::vector<std::string> tried;
  if (const char* env = std::getenv("CPD_PLOT_SCRIPT"); env != nullptr && *env) {
    if (IsFile(env)) return env;
    Fail(std::string("plot: CPD_PLOT_SCRIPT=") + env + " is not a file");
  }
  for (const std::string& p : {std::string(CPDCTL_PLOT_SCRIPT), ExecutableDir() + "/cpdctl_plot.py",
                               ExecutableDir() + "/../share/cpd/cpdctl_plot.py"}) {
    if (IsFile(p)) return p;
    tried.push_back(p);
  }
  std::string list;
  for (const auto& t : tried) list += (list.empty() ? "" : ", ") + t;
  Fail("plot: cannot find cpdctl_plot.py (looked at " + list + "; or set CPD_PLOT_SCRIPT)");
}

int RunPlot(const Globals& g, const RangeArgs& a) {
  MakeRef(a.job);
  if (a.from >= 0 && a.to >= 0 && a.to < a.from) Usage("--from/--to: an empty range");
  const size_t dot = a.out.rfind('.');
  if (dot == std::string::npos || a.out.substr(dot) != ".png") {
    Usage("--out " + a.out + ": the plot is a PNG file; name it FILE.png");
  }
  const std::string script = FindPlotScript();
  const char* py_env = std::getenv("CPD_PYTHON");
  const std::string python = (py_env != nullptr && *py_env) ? py_env : CPDCTL_PYTHON;

  Connection c(g);
  const v1::JobStatusResponse st = GetStatus(c, a.job);
  const v1::GetScheduleResponse sched = ReadSchedule(c, a.job);
  json doc = {{"job", ToJson(st)}, {"schedules", json::array()}, {"reports", json::array()}};
  for (const auto& h : sched.history()) doc["schedules"].push_back(ToJson(h));
  if (sched.history().empty()) doc["schedules"].push_back(ToJson(sched.schedule()));
  const size_t reports = ReadHistory(c, a.job, a.from, a.to, [&](const v1::StatsReport& r) {
    doc["reports"].push_back(ToJson(r));
  });

  // The data for the script, in a private temporary file.
  const char* tmpdir = std::getenv("TMPDIR");
  std::string data_path =
      std::string(tmpdir != nullptr && *tmpdir ? tmpdir : "/tmp") + "/cpdctl_plot_XXXXXX.json";
  const int dfd = mkstemps(data_path.data(), 5);
  if (dfd < 0) Fail("plot: cannot create a temporary file: " + std::string(std::strerror(errno)));
  AddTempFile(data_path);
  const std::string err_path = data_path.substr(0, data_path.size() - 5) + ".err";
  AddTempFile(err_path);
  {
    const std::string text = doc.dump();
    FILE* f = fdopen(dfd, "w");
    if (f == nullptr || std::fwrite(text.data(), 1, text.size(), f) != text.size() ||
        std::fclose(f) != 0) {
      Fail("plot: writing " + data_path + ": " + std::strerror(errno));
    }
  }

  AtomicFile png(a.out, ".png");
  std::vector<std::string> args = {python, script, "--in", data_path, "--out", png.temp_path()};
  std::vector<char*> argv;
  for (auto& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_s;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "MPLBACKEND=", 11) != 0) env_s.emplace_back(*e);
  }
  env_s.emplace_back("MPLBACKEND=Agg");
  std::vector<char*> envp;
  for (auto& s : env_s) envp.push_back(s.data());
  envp.push_back(nullptr);

  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&fa, STDERR_FILENO, err_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0600);
  pid_t pid = -1;
  const int rc = posix_spawnp(&pid, python.c_str(), &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    Fail("plot: cannot run " + python + ": " + std::strerror(rc) +
         " (it needs python3 and python3-matplotlib: scripts/install_deps.sh)");
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    // The script's last line says why (a missing matplotlib, a bad input).
    std::ifstream in(err_path);
    std::string line, last;
    while (std::getline(in, line)) {
      if (!Trim(line).empty()) last = Trim(line);
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == 127) {
      Fail("plot: cannot run " + python + " (it needs python3 and python3-matplotlib)");
    }
    Fail("plot: " + script + " failed" +
         (WIFEXITED(status) ? " (exit " + std::to_string(WEXITSTATUS(status)) + ")"
                            : std::string(" (killed by a signal)")) +
         (last.empty() ? "" : ": " + last));
  }
  png.Commit();
  if (g.json) {
    PrintJson({{"file", a.out}, {"reports", reports}});
  } else {
    Print("wrote " + a.out + " (" + std::to_string(reports) + " reports)\n");
    FlushStdout();
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "cpdctl: the operator's command line for cpd-coordinator: jobs, status, per-layer "
      "statistics, live watch, precision schedules, CSV export and plots.\nJOB is a job name or "
      "its numeric id."};
  app.set_version_flag("--version", std::string("cpdctl ") + CPD_VERSION);
  Globals g;
  AddGlobals(&app, &g);

  auto* jobs = app.add_subcommand("jobs", "List the coordinator's jobs");

  std::string job;
  auto* status = app.add_subcommand(
      "status",
      "A job's step/total, epoch, bits in force, schedule, ranks alive, last report age, loss, "
      "accuracies, images/s, reports stored and dropped, skipped steps");
  status->add_option("JOB", job, "Job name or id")->required();

  LayersArgs la;
  auto* layers = app.add_subcommand(
      "layers",
      "Per-layer, per-site statistics of one report: format, bits, APS shift (COMM rows), "
      "max|x|, saturated and flushed fractions, relative error, hysteresis flips (W), "
      "non-finite count");
  layers->add_option("JOB", la.job, "Job name or id")->required();
  auto* step_opt = layers->add_option("--step", la.step,
                                      "The report at this step (default: the "
                                      "latest with layer statistics)");
  auto* from_opt = layers->add_option("--from", la.from,
                                      "First step of a range (one table, a "
                                      "STEP column)");
  auto* to_opt = layers->add_option("--to", la.to, "Last step of a range (default: the end)");
  step_opt->excludes(from_opt)->excludes(to_opt);
  step_opt->check(CLI::NonNegativeNumber);
  from_opt->check(CLI::NonNegativeNumber);
  to_opt->check(CLI::NonNegativeNumber);
  layers
      ->add_option("--sort", la.sort,
                   "Order rows by: layer (name, then site), site, or largest first: max, "
                   "saturated, flushed, error, shift (default: the model's order)")
      ->check(CLI::IsMember(cpd::ctl::LayerSortKeys()));
  layers->add_option("--site", la.site, "Only this site: W, A, E, G or COMM")
      ->check([](const std::string& s) {
        return cpd::ctl::ParseSite(s) ? std::string() : "expected W, A, E, G or COMM";
      });
  layers->add_option("--top", la.top, "At most K rows per report (after --sort)")
      ->check(CLI::PositiveNumber);
  layers
      ->add_option("--limit", la.limit,
                   "At most this many reports of a range (default: the coordinator's cap)")
      ->check(CLI::PositiveNumber);

  WatchArgs wa;
  auto* watch = app.add_subcommand(
      "watch",
      "Follow a job live: on a terminal the status block (and --layers table) is redrawn in "
      "place; otherwise one line per report (--json: one JSON object per line). Stops on "
      "Ctrl-C, after --count reports, or when the job finishes");
  watch->add_option("JOB", wa.job, "Job name or id")->required();
  watch->add_flag("--layers", wa.layers, "Also receive and show the per-layer table");
  watch->add_option("--count", wa.count, "Stop after N reports (default: never)")
      ->check(CLI::PositiveNumber);
  watch
      ->add_option("--interval", wa.interval_s,
                   "On a terminal, redraw at least every S seconds (the report age ticks)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();

  auto* schedule = app.add_subcommand("schedule", "Read or change a job's precision schedule");
  bool history = false;
  auto* sget = schedule->add_subcommand("get", "The schedule in force (and --history)");
  sget->add_option("JOB", job, "Job name or id")->required();
  sget->add_flag("--history", history, "Also list every version, oldest first");

  cpd::ctl::ScheduleEdits edits;
  std::vector<int> cyclic_bits;
  int cyclic_periods = 0, grad_bits = 0;
  std::string keep_fp32, hysteresis;
  int64_t from_step = 0;
  uint64_t expect_version = 0;
  auto* sset = schedule->add_subcommand(
      "set",
      "Change the schedule: read it, apply these edits, write it back as a new version "
      "(refused if someone changed it in between). Format specs are checked before any call");
  sset->add_option("JOB", job, "Job name or id")->required();
  auto* cb = sset->add_option("--cyclic-bits", cyclic_bits,
                              "CPT: MIN MAX forward bits (W, A as uint<b>:minmax), 2..16")
                 ->expected(2);
  auto* cp = sset->add_option("--cyclic-periods", cyclic_periods,
                              "CPT: cosine cycles over the run (default when CPT is new: 32)");
  auto* gb = sset->add_option("--grad-bits", grad_bits, "CPT: backward (E) bits, 2..16");
  auto* st = sset->add_flag("--static", edits.make_static, "Drop CPT (cyclic bits and grad bits)");
  st->excludes(cb)->excludes(cp)->excludes(gb);
  sset->add_option("--format", edits.formats,
                   "SITE=SPEC (SITE W, A, E or G: that site's global format) or LAYER.SITE=SPEC "
                   "(a per-layer override; LAYER may contain dots). Repeatable. Specs: see "
                   "cpd-quant --help")
      ->allow_extra_args(false);
  sset->add_option("--rounding", edits.roundings,
                   "SITE=MODE: rounding of a site's global format (nearest, stochastic, zero). "
                   "Repeatable")
      ->allow_extra_args(false);
  sset->add_option("--drop-override", edits.drop_overrides,
                   "LAYER.SITE: remove a per-layer override. Repeatable")
      ->allow_extra_args(false);
  auto* kf = sset->add_option("--keep-fp32", keep_fp32,
                              "Comma-separated layers kept fp32 at every site: first, last or "
                              "names; 'none' keeps none (replaces the list)");
  auto* hy = sset->add_option("--hysteresis", hysteresis, "on | off: hysteresis rounding of W")
                 ->check(CLI::IsMember({"on", "off"}));
  auto* fs = sset->add_option("--from-step", from_step,
                              "First step of the new schedule (default: the next step)")
                 ->check(CLI::NonNegativeNumber);
  sset->add_option("--expect-version", expect_version,
                   "Refuse unless the job's schedule is at this version (default: the version "
                   "just read)")
      ->check(CLI::PositiveNumber);

  RangeArgs ea;
  auto* exp = app.add_subcommand(
      "export",
      "Write the job's stored reports as CSV: one row per report and layer/site (a report "
      "without layer rows: one row), with a header; written atomically");
  exp->add_option("JOB", ea.job, "Job name or id")->required();
  exp->add_option("--csv", ea.out, "Output file ('-': stdout)")->required();
  exp->add_option("--from", ea.from, "First step (default: 0)")->check(CLI::NonNegativeNumber);
  exp->add_option("--to", ea.to, "Last step (default: the end)")->check(CLI::NonNegativeNumber);

  RangeArgs pa;
  auto* plot = app.add_subcommand(
      "plot",
      "Plot the job's history to a PNG (Debian's python3-matplotlib): forward bits and schedule "
      "version, loss, per-layer APS shift and per-layer flushed (underflow) fraction over steps");
  plot->add_option("JOB", pa.job, "Job name or id")->required();
  plot->add_option("--out", pa.out, "Output FILE.png (written atomically)")->required();
  plot->add_option("--from", pa.from, "First step (default: 0)")->check(CLI::NonNegativeNumber);
  plot->add_option("--to", pa.to, "Last step (default: the end)")->check(CLI::NonNegativeNumber);

  for (CLI::App* sub : {jobs, status, layers, watch, schedule, sget, sset, exp, plot}) {
    AddGlobals(sub, &g);
    sub->footer(kExitCodes);
  }
  schedule->require_subcommand(1);
  app.require_subcommand(1);
  app.footer(std::string(kExitCodes) +
             "\nEnvironment: CPD_COORDINATOR, CPD_TOKEN_FILE (defaults of --coordinator, "
             "--token-file); CPD_PYTHON, CPD_PLOT_SCRIPT (plot). Each command has --help.");

  // CLI11 would call an unknown command a missing one; name it instead.
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--coordinator" || arg == "--token-file" || arg == "--tls-ca" ||
        arg == "--timeout") {
      ++i;  // its value
      continue;
    }
    if (arg.empty() || arg[0] == '-') continue;
    try {
      app.get_subcommand_ptr(arg);
    } catch (const CLI::OptionNotFound&) {
      Usage("unknown command '" + arg +
            "' (commands: jobs, status, layers, watch, schedule, export, plot)");
    }
    break;
  }
  if (const int code = cpd::launcher::ParseArgs(app, argc, argv, kTool); code >= 0) return code;
  for (CLI::App* a : {&app, jobs, status, layers, watch, schedule, sget, sset, exp, plot}) {
    g.timeout_given = g.timeout_given || a->get_option("--timeout")->count() > 0;
  }

  if (*jobs) return RunJobs(g);
  if (*status) return RunStatus(g, job);
  if (*layers) return RunLayers(g, la);
  if (*watch) return RunWatch(g, wa);
  if (*sget) return RunScheduleGet(g, job, history);
  if (*sset) {
    if (cb->count() > 0) edits.cyclic_bits = std::pair<int, int>{cyclic_bits[0], cyclic_bits[1]};
    if (cp->count() > 0) edits.cyclic_periods = cyclic_periods;
    if (gb->count() > 0) edits.grad_bits = grad_bits;
    if (kf->count() > 0) edits.keep_fp32 = keep_fp32;
    if (hy->count() > 0) edits.hysteresis = hysteresis;
    if (fs->count() > 0) edits.from_step = from_step;
    return RunScheduleSet(g, job, edits, expect_version);
  }
  if (*exp) return RunExport(g, ea);
  if (*plot) return RunPlot(g, pa);
  Usage("no command (try --help)");
}
