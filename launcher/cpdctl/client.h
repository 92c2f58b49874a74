// cpdctl's plumbing, shared by every command: exit codes and their messages, stdout, the options
// every command takes, the connection to the coordinator and the calls several commands make.
#pragma once

#include <grpcpp/grpcpp.h>

#include <CLI/CLI.hpp>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "proto/cpd/v1/coordinator.grpc.pb.h"

namespace cpd::ctl {

constexpr char kTool[] = "cpdctl";
constexpr int kFailure = 1;
constexpr char kDefaultCoordinator[] = "127.0.0.1:50051";

constexpr char kExitCodes[] =
    "Exit codes: 0 success; 1 the coordinator was unreachable or refused the call (a wrong or "
    "missing token too), unknown job, file not written; 2 usage error (bad option, bad format "
    "spec, a token or --tls-ca file that cannot be read or is malformed).";

// "cpdctl: <msg>" on stderr, then exit 2 (Usage) or 1 (Fail).
[[noreturn]] void Usage(const std::string& msg);
[[noreturn]] void Fail(const std::string& msg);

// A message from elsewhere (the server, a script) on one line.
std::string OneLine(std::string s);

void Print(const std::string& s);
// Flushes stdout; a failed write (a full disk, a closed pipe) is an error, not silence.
void FlushStdout();
void PrintJson(const nlohmann::json& j);

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
void AddGlobals(CLI::App* app, Globals* g);

// ---- The connection to the coordinator ---------------------------------------------------------

class Connection {
 public:
  // Resolves the defaults from the environment, reads and checks the token and the CA (Usage
  // when they cannot be read or are malformed, before gRPC sees them) and opens the channel.
  explicit Connection(const Globals& g);

  const std::string& address() const { return g_.coordinator; }
  bool timeout_given() const { return g_.timeout_given; }
  v1::OperatorService::Stub& ops() { return *ops_; }

  // The token and, when `with_deadline`, --timeout from now.
  void Prepare(grpc::ClientContext* ctx, bool with_deadline = true) const;

  // The line for a failed call `rpc` about `job` (empty: not about one job).
  std::string Explain(const grpc::Status& s, const std::string& rpc,
                      const std::string& job = "") const;

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

// JOB on the command line: a numeric id when all digits, else a name (Usage when neither).
v1::JobRef MakeRef(const std::string& job);

// The calls more than one command makes; Fail when the coordinator refuses them.
v1::JobStatusResponse GetStatus(Connection& c, const std::string& job);
v1::GetScheduleResponse ReadSchedule(Connection& c, const std::string& job);

}  // namespace cpd::ctl
