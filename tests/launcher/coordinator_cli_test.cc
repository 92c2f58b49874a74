// The cpd-coordinator binary (CPD_COORDINATOR_PATH): --help, usage errors (exit 2, one line on
// stderr), --port-file, the "listening on" line, a token file, and SIGTERM: a clean exit after
// every acknowledged report is stored (checked by restarting on the same database).
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sqlite3.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tests/launcher/bad_token_files.h"
#include "tests/launcher/coordinator_test_util.h"
#include "tests/subprocess.h"

#ifndef CPD_COORDINATOR_PATH
#error "CPD_COORDINATOR_PATH must name the cpd-coordinator binary"
#endif

namespace cpd::test {
namespace {

size_t Lines(const std::string& s) { return size_t(std::count(s.begin(), s.end(), '\n')); }

void ExpectUsageError(const RunResult& r, const std::string& what, const std::string& mention) {
  EXPECT_EQ(r.exit_code, 2) << what << "\nstderr: " << r.err;
  EXPECT_EQ(Lines(r.err), 1u) << what << "\nstderr: " << r.err;
  EXPECT_EQ(r.err.rfind("cpd-coordinator: ", 0), 0u) << what << "\nstderr: " << r.err;
  EXPECT_NE(r.err.find(mention), std::string::npos) << what << "\nstderr: " << r.err;
  EXPECT_TRUE(r.out.empty()) << what << "\nstdout: " << r.out;
}

TEST(CoordinatorCli, HelpDocumentsEveryFlag) {
  RunResult r = RunProgram(CPD_COORDINATOR_PATH, {"--help"});
  EXPECT_EQ(r.exit_code, 0);
  for (const char* flag : {"--listen", "--db", "--token-file", "--tls-cert", "--tls-key",
                           "--port-file", "--max-message-mib", "--stale-after", "--keep-full",
                           "--thin-every", "--max-reports-per-job", "--retention-every",
                           "--queue-mib", "--watch-buffer", "--version", "127.0.0.1:50051"}) {
    EXPECT_NE(r.out.find(flag), std::string::npos) << flag << " is not in --help";
  }
  r = RunProgram(CPD_COORDINATOR_PATH, {"--version"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.out.rfind("cpd-coordinator ", 0), 0u) << r.out;
}

TEST(CoordinatorCli, UsageErrorsExitTwoWithOneLine) {
  TempDir dir;
  const std::string db = dir.File("u.db"), empty = dir.File("empty"), cert = dir.File("c.pem");
  { std::ofstream(empty) << "  \n"; }
  { std::ofstream(cert) << "not pem\n"; }
  ExpectUsageError(RunProgram(CPD_COORDINATOR_PATH, {"--bogus"}), "unknown flag", "--bogus");
  ExpectUsageError(RunProgram(CPD_COORDINATOR_PATH, {"--listen", "nowhere", "--db", db}),
                   "listen without port", "--listen");
  ExpectUsageError(RunProgram(CPD_COORDINATOR_PATH, {"--listen", "127.0.0.1:99999", "--db", db}),
                   "port out of range", "--listen");
  ExpectUsageError(RunProgram(CPD_COORDINATOR_PATH, {"--token-file", empty, "--db", db}),
                   "empty token", "--token-file");
  ExpectUsageError(RunProgram(CPD_COORDINATOR_PATH, {"--token-file", dir.File("nope")}),
                   "missing token file", "--token-file");
  ExpectUsageError(RunProgram(CPD_COORDINATOR_PATH, {"--tls-cert", cert, "--db", db}),
                   "cert without key", "--tls-key");
  ExpectUsageError(
      RunProgram(CPD_COORDINATOR_PATH, {"--tls-cert", cert, "--tls-key", cert, "--db", db}),
      "not PEM", "PEM");
  // Garbage comes back quoted and escaped, on one line.
  ExpectUsageError(RunProgram(CPD_COORDINATOR_PATH, {"--listen", "host\n\x01:x", "--db", db}),
                   "garbage listen", "--listen 'host\\n\\x01:x': expected HOST:PORT");
  {
    std::ofstream(dir.File("garbage.pem"))
        << "-----BEGIN CERTIFICATE-----\n!!\n-----END CERTIFICATE-----\n";
    ExpectUsageError(RunProgram(CPD_COORDINATOR_PATH, {"--tls-cert", dir.File("garbage.pem"),
                                                       "--tls-key", cert, "--db", db}),
                     "garbage certificate", "not base64");
  }
  ExpectUsageError(RunProgram(CPD_COORDINATOR_PATH, {"--keep-full", "-3"}), "negative",
                   "--keep-full");
  ExpectUsageError(RunProgram(CPD_COORDINATOR_PATH, {"--max-message-mib", "0"}), "zero",
                   "--max-message-mib");
  // A database that cannot be opened is not a usage error: exit 1, one line naming it.
  RunResult r = RunProgram(CPD_COORDINATOR_PATH,
                           {"--listen", "127.0.0.1:0", "--db", dir.File("no/such/dir.db")});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(Lines(r.err), 1u) << r.err;
  EXPECT_NE(r.err.find("no/such/dir.db"), std::string::npos) << r.err;
}

// Range errors say in words what is accepted, in a short line (CLI11's own printed both bounds
// of a double: "Value -1 not in range 0.000000 to 1797693134862...", 373 characters).
// A token gRPC refuses as a metadata value: the coordinator started with it, and then every
// client aborted (SIGABRT) when it sent it. It is refused at start, exit 2, one line.
TEST(CoordinatorCli, TokenFileWithBytesGrpcRefusesIsOneLineWithoutTheToken) {
  TempDir dir;
  const std::vector<BadTokenFile> cases = BadTokenFiles();
  const std::vector<std::string> paths = WriteBadTokenFiles(dir.path());
  for (size_t i = 0; i < cases.size(); ++i) {
    // Under timeout(1): a coordinator that accepts the token serves until killed (exit 124).
    const RunResult r =
        RunProgram("/usr/bin/timeout", {"20", CPD_COORDINATOR_PATH, "--listen", "127.0.0.1:0",
                                        "--db", dir.File("t.db"), "--token-file", paths[i]});
    ExpectTokenRefused(r, "cpd-coordinator", paths[i], cases[i]);
  }
  EXPECT_FALSE(std::filesystem::exists(dir.File("t.db")));
}

TEST(CoordinatorCli, RangeErrorsSayWhatIsAccepted) {
  const std::string bin = BuiltProgram(CPD_COORDINATOR_PATH);
  for (const auto& [flag, value, accepted] : std::vector<std::array<std::string, 3>>{
           {"--stale-after", "-1", "a number > 0"},
           {"--retention-every", "0", "a number > 0"},
           {"--max-message-mib", "0", "a whole number from 1 to 1024"},
           {"--thin-every", "0", "a whole number >= 1"},
           {"--keep-full", "-3", "a whole number >= 0"}}) {
    const RunResult r = RunProgram(bin, {flag, value});
    ExpectUsageError(r, flag + " " + value, flag);
    EXPECT_NE(r.err.find(accepted), std::string::npos) << r.err;
    EXPECT_LT(r.err.size(), 100u) << r.err;
  }
}

// Serving a non-loopback address without a token is refused unless --allow-unauthenticated
// says it is meant; then it is loudly warned about. It used to start silently.
TEST(CoordinatorCli, NonLoopbackWithoutTokenIsRefusedUnlessAllowed) {
  TempDir dir;
  const std::string bin = BuiltProgram(CPD_COORDINATOR_PATH);
  for (const char* listen : {"0.0.0.0:0", "[::]:0"}) {
    // timeout(1) ends a coordinator that would serve (exit 124).
    const RunResult r =
        RunProgram("/usr/bin/timeout", {"5", bin, "--listen", listen, "--db", dir.File("open.db")});
    ExpectUsageError(r, listen, "--token-file");
    EXPECT_NE(r.err.find("--allow-unauthenticated"), std::string::npos) << r.err;
  }
  const RunResult allowed = RunProgram(
      "/usr/bin/timeout",
      {"2", bin, "--listen", "0.0.0.0:0", "--db", dir.File("open.db"), "--allow-unauthenticated"});
  EXPECT_EQ(allowed.exit_code, 124) << "it serves until stopped\n" << allowed.err;
  EXPECT_NE(allowed.err.find("WARNING: serving 0.0.0.0:0 WITHOUT AUTHENTICATION"),
            std::string::npos)
      << allowed.err;
  EXPECT_NE(allowed.out.find("listening on"), std::string::npos) << allowed.out;
  // Loopback needs neither.
  const RunResult loopback = RunProgram(
      "/usr/bin/timeout", {"2", bin, "--listen", "127.0.0.1:0", "--db", dir.File("open.db")});
  EXPECT_EQ(loopback.exit_code, 124) << loopback.err;
  EXPECT_EQ(loopback.err.find("WARNING"), std::string::npos) << loopback.err;
}

// A cpd-coordinator running in the background; stopped with SIGTERM (or killed) at the end.
class Coordinator {
 public:
  Coordinator(const TempDir& dir, std::vector<std::string> extra) : dir_(dir) {
    port_file_ = dir.File("port");
    std::remove(port_file_.c_str());
    std::vector<std::string> args = {CPD_COORDINATOR_PATH, "--listen",    "127.0.0.1:0", "--db",
                                     dir.File("coord.db"), "--port-file", port_file_};
    args.insert(args.end(), extra.begin(), extra.end());
    out_ = dir.File("stdout");
    err_ = dir.File("stderr");
    pid_ = fork();
    if (pid_ == 0) {
      const int o = open(out_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      const int e = open(err_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      dup2(o, 1);
      dup2(e, 2);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
  }
  ~Coordinator() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  // Waits (bounded) for the port file; 0 when it did not appear.
  int WaitForPort() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < deadline) {
      std::ifstream in(port_file_);
      int port = 0;
      if (in >> port && port > 0) return port;
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        ADD_FAILURE() << "cpd-coordinator exited early: " << ReadFile(err_);
        return 0;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return 0;
  }
  // `sig`, then the exit code (-1: did not exit within the deadline, or not normally).
  int Terminate(int sig = SIGTERM) {
    kill(pid_, sig);
    return WaitExit();
  }
  void Signal(int sig) { kill(pid_, sig); }
  bool Running() { return pid_ > 0 && waitpid(pid_, nullptr, WNOHANG) == 0; }
  int WaitExit() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }
  std::string out() const { return ReadFile(out_); }
  std::string err() const { return ReadFile(err_); }

 private:
  const TempDir& dir_;
  std::string port_file_, out_, err_;
  pid_t pid_ = -1;
};

TEST(CoordinatorCli, ServesOnThePortFileAndStoresEverythingOnSigterm) {
  TempDir dir;
  const std::string token_file = dir.File("token");
  { std::ofstream(token_file) << "  tok-123 \nignored second line\n"; }
  int64_t job_id = 0;
  std::atomic<int> acked{0};
  {
    Coordinator c(dir, {"--token-file", token_file});
    const int port = c.WaitForPort();
    ASSERT_GT(port, 0);
    EXPECT_EQ(c.out(), "cpd-coordinator: listening on 127.0.0.1:" + std::to_string(port) + " (db " +
                           dir.File("coord.db") + ")\n");
    auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                       grpc::InsecureChannelCredentials());
    auto worker = v1::WorkerService::NewStub(channel);
    v1::RegisterJobResponse reg;
    EXPECT_EQ(worker->RegisterJob(Ctx().get(), LenetJob("cli-job", 1), &reg).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    ASSERT_TRUE(worker->RegisterJob(Ctx(10, "tok-123").get(), LenetJob("cli-job", 1), &reg).ok());
    job_id = reg.job_id();
    // Another connection holds the database's write lock, so the acknowledged reports wait in
    // the coordinator's queue when SIGTERM arrives; they must be stored before it exits.
    sqlite3* blocker = nullptr;
    ASSERT_EQ(sqlite3_open(dir.File("coord.db").c_str(), &blocker), SQLITE_OK);
    ASSERT_EQ(sqlite3_exec(blocker, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr), SQLITE_OK);
    constexpr int kReports = 3000;
    std::mutex mu;
    std::condition_variable cv;
    int done = 0;
    std::vector<std::unique_ptr<grpc::ClientContext>> ctxs(kReports);
    std::vector<v1::StatsReport> reqs(kReports);
    std::vector<v1::ReportStatsResponse> resps(kReports);
    for (int i = 0; i < kReports; ++i) {
      ctxs[size_t(i)] = Ctx(30, "tok-123");
      reqs[size_t(i)] = Report(job_id, i, 0, 20);
      worker->async()->ReportStats(ctxs[size_t(i)].get(), &reqs[size_t(i)], &resps[size_t(i)],
                                   [&](grpc::Status s) {
                                     if (s.ok()) acked.fetch_add(1);
                                     std::lock_guard<std::mutex> l(mu);
                                     ++done;
                                     cv.notify_one();
                                   });
    }
    {
      std::unique_lock<std::mutex> l(mu);
      ASSERT_TRUE(cv.wait_for(l, std::chrono::seconds(60), [&] { return done == kReports; }));
    }
    EXPECT_EQ(acked.load(), kReports);
    c.Signal(SIGTERM);
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    EXPECT_TRUE(c.Running()) << "exited while reports were waiting for the disk: " << c.err();
    sqlite3_exec(blocker, "ROLLBACK", nullptr, nullptr, nullptr);
    sqlite3_close(blocker);
    EXPECT_EQ(c.WaitExit(), 0) << c.err();
    const std::string err = c.err();
    EXPECT_NE(err.find("SIGTERM received"), std::string::npos) << err;
    EXPECT_NE(err.find("stopped; " + std::to_string(kReports) + " reports stored this run"),
              std::string::npos)
        << err;
  }
  // Restarted on the same database: the job and every acknowledged report are there.
  Coordinator c(dir, {"--token-file", token_file});
  const int port = c.WaitForPort();
  ASSERT_GT(port, 0);
  auto op = v1::OperatorService::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  v1::JobRef ref;
  ref.set_job_name("cli-job");
  v1::JobStatusResponse st;
  grpc::Status s = op->JobStatus(Ctx(10, "tok-123").get(), ref, &st);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(st.job().job_id(), job_id);
  EXPECT_EQ(st.reports_stored(), uint64_t(acked.load()));
  EXPECT_EQ(st.job().step(), acked.load() - 1);
  EXPECT_EQ(c.Terminate(), 0) << c.err();
}

TEST(CoordinatorCli, SigintAlsoStopsCleanly) {
  TempDir dir;
  Coordinator c(dir, {});
  const int port = c.WaitForPort();
  ASSERT_GT(port, 0);
  // A second coordinator on the same port is refused (exit 1, one line), not started beside
  // the first (gRPC's default SO_REUSEPORT would allow that).
  RunResult busy =
      RunProgram(CPD_COORDINATOR_PATH,
                 {"--listen", "127.0.0.1:" + std::to_string(port), "--db", dir.File("other.db")});
  EXPECT_EQ(busy.exit_code, 1) << busy.err;
  EXPECT_EQ(Lines(busy.err), 1u) << busy.err;
  EXPECT_NE(busy.err.find("Address already in use"), std::string::npos) << busy.err;
  // A second coordinator on the same database is refused (exit 1, one line).
  RunResult second =
      RunProgram(CPD_COORDINATOR_PATH, {"--listen", "127.0.0.1:0", "--db", dir.File("coord.db")});
  EXPECT_EQ(second.exit_code, 1) << second.err;
  EXPECT_EQ(Lines(second.err), 1u) << second.err;
  EXPECT_NE(second.err.find("in use by another cpd-coordinator"), std::string::npos) << second.err;
  EXPECT_EQ(c.Terminate(SIGINT), 0) << c.err();
  EXPECT_NE(c.err().find("SIGINT received"), std::string::npos) << c.err();
  // The port file was written atomically: no temporary left beside it.
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
  }
}

}  // namespace
}  // namespace cpd::test
