// cpdctl against the real cpd-coordinator: each test starts the coordinator on an ephemeral
// loopback port with a fresh database in a temporary directory, registers a job and reports
// statistics through the real WorkerService (the worker client below is a plain gRPC client of
// the server), and runs the built cpdctl as a subprocess. Every wait is bounded.
#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "proto/cpd/v1/coordinator.grpc.pb.h"
#include "tests/launcher/bad_token_files.h"
#include "tests/subprocess.h"
#include "tests/temp_dir.h"

#if !defined(CPDCTL_PATH) || !defined(CPD_COORDINATOR_PATH) || !defined(CPDCTL_PYTHON)
#error "CPDCTL_PATH, CPD_COORDINATOR_PATH and CPDCTL_PYTHON must be defined"
#endif

extern char** environ;

namespace cpd::test {
namespace {

namespace v1 = cpd::v1;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr int kRunTimeoutS = 60;  // no cpdctl call here takes more than a few seconds

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

size_t Lines(const std::string& s) { return size_t(std::count(s.begin(), s.end(), '\n')); }

std::vector<std::string> SplitLines(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string line;
  while (std::getline(ss, line)) out.push_back(line);
  return out;
}

std::vector<std::string> Words(const std::string& line) {
  std::vector<std::string> out;
  std::stringstream ss(line);
  std::string w;
  while (ss >> w) out.push_back(w);
  return out;
}

// ---- Subprocesses ----------------------------------------------------------------------------

// The environment of the child: ours without cpdctl's variables, plus `extra` ("K=V").
std::vector<std::string> ChildEnv(const std::vector<std::string>& extra) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    if (kv.rfind("CPD_COORDINATOR=", 0) == 0 || kv.rfind("CPD_TOKEN_FILE=", 0) == 0) continue;
    env.push_back(kv);
  }
  env.insert(env.end(), extra.begin(), extra.end());
  return env;
}

// A started child whose stdout is a pipe (read line by line) and whose stderr goes to a file.
class Child {
 public:
  Child(const std::string& binary, const std::vector<std::string>& args,
        const std::vector<std::string>& env_extra, const std::string& err_path)
      : err_path_(err_path) {
    int fds[2];
    EXPECT_EQ(pipe(fds), 0);
    std::vector<std::string> argv_s = {binary};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_s = ChildEnv(env_extra);
    std::vector<char*> envp;
    for (auto& e : env_s) envp.push_back(e.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
    posix_spawn_file_actions_addopen(&fa, 2, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_addclose(&fa, fds[0]);
    posix_spawn_file_actions_addclose(&fa, fds[1]);
    const int rc = posix_spawn(&pid_, binary.c_str(), &fa, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&fa);
    close(fds[1]);
    out_fd_ = fds[0];
    EXPECT_EQ(rc, 0) << binary << ": " << std::strerror(rc);
    if (rc != 0) pid_ = -1;
  }
  ~Child() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_fd_ >= 0) close(out_fd_);
  }

  // The next line of stdout (without '\n'), or false at EOF or after `timeout_s`.
  bool ReadLine(std::string* line, double timeout_s) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(int64_t(timeout_s * 1000));
    for (;;) {
      const size_t nl = buf_.find('\n');
      if (nl != std::string::npos) {
        *line = buf_.substr(0, nl);
        all_ += buf_.substr(0, nl + 1);
        buf_.erase(0, nl + 1);
        return true;
      }
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0 || out_fd_ < 0) return false;
      pollfd p{out_fd_, POLLIN, 0};
      if (poll(&p, 1, int(left)) <= 0) continue;
      char tmp[4096];
      const ssize_t n = read(out_fd_, tmp, sizeof(tmp));
      if (n <= 0) {
        close(out_fd_);
        out_fd_ = -1;
        if (!buf_.empty()) {
          *line = buf_;
          all_ += buf_;
          buf_.clear();
          return true;
        }
        return false;
      }
      buf_.append(tmp, size_t(n));
    }
  }

  // Reads stdout to EOF and waits for the exit; -1 (and the child killed) after `timeout_s`.
  int Wait(double timeout_s) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(int64_t(timeout_s * 1000));
    std::string line;
    while (Clock::now() < deadline && ReadLine(&line, 0.2)) {
    }
    while (Clock::now() < deadline) {
      int status = 0;
      const pid_t r = waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        std::string rest;
        while (ReadLine(&rest, 0.1)) {
        }
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      ReadLine(&line, 0.05);
    }
    return -1;
  }

  pid_t pid() const { return pid_; }
  const std::string& out() const { return all_; }  // every line read so far
  std::string err() const { return ReadAll(err_path_); }

 private:
  pid_t pid_ = -1;
  int out_fd_ = -1;
  std::string buf_, all_, err_path_;
};

struct RunResult {
  int exit_code = -1;
  std::string out, err;
};

// ---- The coordinator and a worker ------------------------------------------------------------

struct Layer {
  const char* name;
  const char* kind;
  bool quantizable;
};
constexpr Layer kLayers[] = {{"conv1", "Conv2d", true},
                             {"bn1", "BatchNorm2d", false},
                             {"block1.conv1", "Conv2d", true},
                             {"fc", "Linear", true}};
constexpr v1::Site kSites[] = {v1::SITE_W, v1::SITE_A, v1::SITE_E, v1::SITE_G, v1::SITE_COMM};
constexpr const char* kSiteNames[] = {"W", "A", "E", "G", "COMM"};
constexpr const char* kJob = "ctl-test";
constexpr int kQuantLayers = 3, kRowsPerReport = kQuantLayers * 5;

// The statistics a worker reports for quantisable layer `li` (0..2) at site `si` (0..4).
v1::LayerStat MakeStat(int64_t step, int li, int si) {
  static const char* names[] = {"conv1", "block1.conv1", "fc"};
  v1::LayerStat l;
  l.set_layer(names[li]);
  l.set_site(kSites[si]);
  l.set_format(si == 4 ? "e4m3" : (si == 0 ? "uint6:minmax:ch" : "e5m2"));
  l.set_bits(si == 0 ? 6 : 8);
  l.set_aps_shift(si == 4 ? int(10 - 3 * li + step) : 0);
  l.set_max_abs((li + 1) * std::pow(10.0, si - 2) * (1 + double(step) / 100));
  l.set_saturated(0.001 * (si + 1) * (li + 1));
  l.set_flushed(double((li * 5 + si) % 7) / 7.0 / 3.0);
  l.set_rel_error(si == 1 ? -1.0 : 0.01 * (li + 1) + 0.001 * si);
  l.set_flips(si == 0 ? uint64_t(li * 3 + step) : 0);
  return l;
}

v1::StatsReport MakeReport(int64_t job_id, int64_t step, bool with_layers, bool finished = false) {
  v1::StatsReport r;
  r.set_job_id(job_id);
  r.set_rank(0);
  r.set_step(step);
  r.set_epoch(int32_t(step / 5));
  r.set_loss(2.0 / (1.0 + double(step)) + 1e-9);
  r.set_lr(0.1);
  r.set_bits(int32_t(3 + step % 6));
  r.set_schedule_version(1);
  r.set_images_per_s(1000.5 + double(step));
  r.set_ranks_alive(2);
  r.set_train_accuracy(step == 9 ? 0.625 : -1);
  r.set_test_accuracy(step == 9 ? 0.5 : -1);
  r.set_time_ms(1700000000000 + step);
  r.set_finished(finished);
  if (with_layers) {
    for (int li = 0; li < kQuantLayers; ++li) {
      for (int si = 0; si < 5; ++si) *r.add_layers() = MakeStat(step, li, si);
    }
  }
  return r;
}

class CpdctlTest : public testing::Test {
 protected:
  void SetUp() override {
    temp_ = std::make_unique<cpd::test::TempDir>("cpdctl_test");
    dir_ = temp_->path();
    ASSERT_FALSE(dir_.empty());
    port_ = StartCoordinator(&coord_, "", "db.sqlite");
    ASSERT_GT(port_, 0);
    addr_ = "127.0.0.1:" + std::to_string(port_);
    RegisterAndReport(addr_, "");
  }

  void TearDown() override {
    coord_.reset();
    token_coord_.reset();
    temp_.reset();
  }

  // Starts cpd-coordinator (with --token-file when `token_file` is set); returns its port.
  int StartCoordinator(std::unique_ptr<Child>* child, const std::string& token_file,
                       const std::string& db) {
    const std::string port_file = dir_ + "/" + db + ".port";
    std::vector<std::string> args = {"--listen", "127.0.0.1:0",   "--port-file",   port_file,
                                     "--db",     dir_ + "/" + db, "--stale-after", "3600"};
    if (!token_file.empty()) {
      args.push_back("--token-file");
      args.push_back(token_file);
    }
    *child = std::make_unique<Child>(CPD_COORDINATOR_PATH, args, std::vector<std::string>{},
                                     dir_ + "/" + db + ".err");
    std::string line;
    // The "listening" line comes after the port file is written.
    EXPECT_TRUE((*child)->ReadLine(&line, 30)) << (*child)->err();
    EXPECT_NE(line.find("cpd-coordinator: listening on 127.0.0.1:"), std::string::npos) << line;
    return std::atoi(ReadAll(port_file).c_str());
  }

  std::unique_ptr<v1::WorkerService::Stub> Worker(const std::string& addr) {
    return v1::WorkerService::NewStub(
        grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));
  }

  void Prepare(grpc::ClientContext* ctx, const std::string& token) {
    if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  }

  // Registers kJob (4 layers, CPT 3..8 with e4m3 W/A) and reports steps 0..9 (layer rows at
  // steps 0 and 5), then waits until the coordinator has stored all ten.
  void RegisterAndReport(const std::string& addr, const std::string& token) {
    auto w = Worker(addr);
    v1::RegisterJobRequest req;
    req.set_job_name(kJob);
    req.set_world_size(2);
    req.set_emulated_workers_per_rank(1);
    for (int r = 0; r < 2; ++r) {
      auto* wk = req.add_workers();
      wk->set_rank(r);
      wk->set_host("localhost");
      wk->set_pid(1000 + r);
    }
    for (const Layer& l : kLayers) {
      auto* li = req.add_layers();
      li->set_name(l.name);
      li->set_kind(l.kind);
      li->set_quantizable(l.quantizable);
      li->set_params(100);
    }
    auto* s = req.mutable_schedule();
    for (v1::Site site : {v1::SITE_W, v1::SITE_A}) {
      auto* f = s->add_formats();
      f->set_site(site);
      f->set_spec("e4m3");
    }
    s->mutable_cyclic()->set_min_bits(3);
    s->mutable_cyclic()->set_max_bits(8);
    s->mutable_cyclic()->set_periods(4);
    s->set_grad_bits(8);
    req.set_arch("lenet5");
    req.set_dataset("synthetic");
    req.set_total_steps(100);
    req.set_epochs(2);
    req.set_allreduce("packed e4m3 +APS");
    grpc::ClientContext ctx;
    Prepare(&ctx, token);
    v1::RegisterJobResponse resp;
    const grpc::Status st = w->RegisterJob(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    job_id_ = resp.job_id();
    for (int64_t step = 0; step < 10; ++step) {
      Report(addr, token, MakeReport(job_id_, step, step == 0 || step == 5));
    }
    WaitStored(addr, token, 10);
  }

  // Registers a one-rank run `name` of `study` (a study driver's run) and returns its id.
  int64_t RegisterRun(const std::string& name, const std::string& study) {
    v1::RegisterJobRequest req;
    req.set_job_name(name);
    req.set_study(study);
    req.set_world_size(1);
    req.set_total_steps(100);
    req.set_epochs(4);
    grpc::ClientContext ctx;
    Prepare(&ctx, "");
    v1::RegisterJobResponse resp;
    const grpc::Status st = Worker(addr_)->RegisterJob(&ctx, req, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return resp.job_id();
  }

  void Report(const std::string& addr, const std::string& token, const v1::StatsReport& r) {
    auto w = Worker(addr);
    grpc::ClientContext ctx;
    Prepare(&ctx, token);
    v1::ReportStatsResponse resp;
    const grpc::Status st = w->ReportStats(&ctx, r, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }

  // Reports reach the database through the coordinator's writer thread: wait for them.
  void WaitStored(const std::string& addr, const std::string& token, uint64_t n,
                  const std::string& job = kJob) {
    auto ops =
        v1::OperatorService::NewStub(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    uint64_t stored = 0;
    while (Clock::now() < deadline) {
      grpc::ClientContext ctx;
      Prepare(&ctx, token);
      v1::JobRef ref;
      ref.set_job_name(job);
      v1::JobStatusResponse st;
      if (ops->JobStatus(&ctx, ref, &st).ok()) stored = st.reports_stored();
      if (stored >= n) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    FAIL() << "the coordinator stored " << stored << " of " << n << " reports in 30 s";
  }

  RunResult Ctl(std::vector<std::string> args, const std::vector<std::string>& env = {},
                bool with_address = true) {
    if (with_address) {
      args.push_back("--coordinator");
      args.push_back(addr_);
    }
    Child c(CPDCTL_PATH, args, env, dir_ + "/ctl.err");
    RunResult r;
    r.exit_code = c.Wait(kRunTimeoutS);
    EXPECT_NE(r.exit_code, -1) << "cpdctl did not finish in " << kRunTimeoutS << " s";
    r.out = c.out();
    r.err = c.err();
    return r;
  }

  // Exit code, one line on stderr starting "cpdctl: " and holding `needle`, nothing on stdout.
  void ExpectError(const RunResult& r, int code, const std::string& needle) {
    EXPECT_EQ(r.exit_code, code) << r.err;
    EXPECT_EQ(Lines(r.err), 1u) << r.err;
    EXPECT_EQ(r.err.rfind("cpdctl: ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << "want '" << needle << "' in " << r.err;
    EXPECT_EQ(r.out, "");
  }

  json Json(const RunResult& r) {
    EXPECT_EQ(r.exit_code, 0) << r.err;
    try {
      return json::parse(r.out);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not JSON: " << e.what() << "\n" << r.out;
      return json();
    }
  }

  std::unique_ptr<cpd::test::TempDir> temp_;
  std::string dir_, addr_;
  int port_ = 0;
  int64_t job_id_ = 0;
  std::unique_ptr<Child> coord_, token_coord_;
};

// ---- jobs, status ----------------------------------------------------------------------------

TEST_F(CpdctlTest, JobsListsTheJob) {
  const RunResult r = Ctl({"jobs"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto lines = SplitLines(r.out);
  ASSERT_EQ(lines.size(), 2u) << r.out;
  EXPECT_EQ(Words(lines[0])[0], "ID");
  const auto w = Words(lines[1]);
  ASSERT_GE(w.size(), 9u) << lines[1];
  EXPECT_EQ(w[0], std::to_string(job_id_));
  EXPECT_EQ(w[1], kJob);
  EXPECT_EQ(w[2], "running");
  EXPECT_EQ(w[3], "9");
  EXPECT_EQ(w[4], "100");

  const json j = Json(Ctl({"--json", "jobs"}));
  ASSERT_EQ(j["jobs"].size(), 1u) << j.dump();
  EXPECT_EQ(j["jobs"][0]["job_name"], kJob);
  EXPECT_EQ(j["jobs"][0]["job_id"], job_id_);
  EXPECT_EQ(j["jobs"][0]["step"], 9);
  EXPECT_EQ(j["jobs"][0]["total_steps"], 100);
  EXPECT_EQ(j["jobs"][0]["world_size"], 2);
  EXPECT_EQ(j["jobs"][0]["arch"], "lenet5");
}

TEST_F(CpdctlTest, StatusByNameAndById) {
  const RunResult r = Ctl({"status", kJob});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* want :
       {"ctl-test (id 1), running", "lenet5 on synthetic, all-reduce packed e4m3 +APS",
        "9 (10 / 100 done, 10%)", "epoch        1 / 2", "6 (CPT forward)",
        "v1 from step 0: CPT 3-8 bits x4, E 8 bits; W=e4m3 A=e4m3", "2 / 2 alive", " ago",
        "train 62.50%, test 50.00%", "images/s", "10 stored, 0 dropped", "0 steps",
        "0:localhost/1000, 1:localhost/1001", "4 (3 with W/A/E/G sites)"}) {
    EXPECT_NE(r.out.find(want), std::string::npos) << "want '" << want << "' in\n" << r.out;
  }
  // loss of step 9
  EXPECT_NE(r.out.find("loss         0.2"), std::string::npos) << r.out;

  const json j = Json(Ctl({"status", std::to_string(job_id_), "--json"}));
  EXPECT_EQ(j["job"]["job_name"], kJob);
  EXPECT_EQ(j["job"]["step"], 9);
  EXPECT_EQ(j["epoch"], 1);
  EXPECT_EQ(j["bits"], 6);
  EXPECT_EQ(j["ranks_alive"], 2);
  EXPECT_EQ(j["reports_stored"], 10);
  EXPECT_EQ(j["loss"], 2.0 / 10.0 + 1e-9);
  EXPECT_EQ(j["test_accuracy"], 0.5);
  EXPECT_EQ(j["images_per_s"], 1009.5);
  EXPECT_EQ(j["schedule"]["version"], 1);
  EXPECT_EQ(j["schedule"]["cyclic"]["max_bits"], 8);
  EXPECT_EQ(j["layers"].size(), 4u);
  EXPECT_GE(j["last_report_age_ms"].get<int64_t>(), 0);
}

// ---- study -----------------------------------------------------------------------------------

TEST_F(CpdctlTest, StudyListsItsRunsWithStateAndAccuracyAndJobsShowsTheStudy) {
  const int64_t a = RegisterRun("s1.lr-0.1", "s1"), b = RegisterRun("s1.lr-0.2", "s1");
  RegisterRun("s2.only", "s2");
  v1::StatsReport ra = MakeReport(a, 9, false);  // epoch 1, test accuracy 0.5
  ra.set_ranks_alive(1);
  Report(addr_, "", ra);
  v1::StatsReport rb = MakeReport(b, 19, false, /*finished=*/true);
  rb.set_ranks_alive(1);
  rb.set_epoch(3);
  rb.set_test_accuracy(0.8125);
  Report(addr_, "", rb);

  RunResult r = Ctl({"study", "s1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto lines = SplitLines(r.out);
  ASSERT_EQ(lines.size(), 4u) << r.out;
  EXPECT_EQ(Words(lines[0]), (std::vector<std::string>{"RUN", "STATE", "STEP", "EPOCH", "TEST",
                                                       "ACC", "LOSS", "LAST", "REPORT"}))
      << lines[0];
  // RUN STATE STEP / TOTAL EPOCH / EPOCHS ACC LOSS AGE...
  auto w = Words(lines[1]);
  ASSERT_GE(w.size(), 11u) << lines[1];
  EXPECT_EQ(w[0], "s1.lr-0.1");
  EXPECT_EQ(w[1], "running");
  EXPECT_EQ(std::vector<std::string>(w.begin() + 2, w.begin() + 10),
            (std::vector<std::string>{"10", "/", "100", "1", "/", "4", "50.00%", "0.2"}))
      << lines[1];
  EXPECT_NE(lines[1].find(" ago"), std::string::npos) << lines[1];
  w = Words(lines[2]);
  ASSERT_GE(w.size(), 10u) << lines[2];
  EXPECT_EQ(w[0], "s1.lr-0.2");
  EXPECT_EQ(w[1], "finished");
  EXPECT_EQ(std::vector<std::string>(w.begin() + 2, w.begin() + 10),
            (std::vector<std::string>{"20", "/", "100", "3", "/", "4", "81.25%", "0.1"}))
      << lines[2];
  EXPECT_EQ(lines[3], "2 runs: 1 running, 0 stale, 1 finished");

  const json j = Json(Ctl({"--json", "study", "s1"}));
  EXPECT_EQ(j["study"], "s1");
  ASSERT_EQ(j["jobs"].size(), 2u) << j.dump();
  EXPECT_EQ(j["jobs"][1]["job_name"], "s1.lr-0.2");
  EXPECT_EQ(j["jobs"][1]["study"], "s1");
  EXPECT_EQ(j["jobs"][1]["state"], "finished");
  EXPECT_EQ(j["jobs"][1]["test_accuracy"], 0.8125);
  EXPECT_EQ(j["jobs"][1]["epoch"], 3);
  EXPECT_EQ(j["jobs"][1]["epochs"], 4);
  EXPECT_EQ(j["counts"]["runs"], 2);
  EXPECT_EQ(j["counts"]["finished"], 1);

  // Without NAME: the studies, by name; the untagged job is in none.
  r = Ctl({"study"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  lines = SplitLines(r.out);
  ASSERT_EQ(lines.size(), 3u) << r.out;
  EXPECT_EQ(Words(lines[0]),
            (std::vector<std::string>{"STUDY", "RUNS", "RUNNING", "STALE", "FINISHED"}));
  EXPECT_EQ(Words(lines[1]), (std::vector<std::string>{"s1", "2", "1", "0", "1"}));
  EXPECT_EQ(Words(lines[2]), (std::vector<std::string>{"s2", "1", "1", "0", "0"}));
  const json all = Json(Ctl({"study", "--json"}));
  ASSERT_EQ(all["studies"].size(), 2u) << all.dump();
  EXPECT_EQ(all["studies"][0]["study"], "s1");
  EXPECT_EQ(all["studies"][0]["running"], 1);

  // jobs gains a STUDY column once a job has a study ("-" for the untagged one).
  r = Ctl({"jobs"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  lines = SplitLines(r.out);
  ASSERT_EQ(lines.size(), 5u) << r.out;
  EXPECT_EQ(Words(lines[0])[2], "STUDY");
  EXPECT_EQ(Words(lines[1])[1], kJob);
  EXPECT_EQ(Words(lines[1])[2], "-");
  EXPECT_EQ(Words(lines[2])[2], "s1");
  EXPECT_EQ(Words(lines[2])[3], "running");

  // An unknown study is empty, not an error; a malformed name is a usage error before any call.
  r = Ctl({"study", "nope"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "no runs in study 'nope' on " + addr_ + " (cpdctl study lists the studies)\n");
  ExpectError(Ctl({"study", "bad name"}), 2, "STUDY 'bad name'");
  ExpectError(Ctl({"study", std::string(65, 's')}), 2, "1 to 64 of A-Z a-z 0-9 . _ -");
}

TEST_F(CpdctlTest, StudyWithoutStudiesSaysSo) {
  const RunResult r = Ctl({"study"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "no studies on " + addr_ + " (cpd-train --study NAME tags a run)\n");
}

// ---- layers ----------------------------------------------------------------------------------

struct TableRow {
  std::vector<std::string> cells;  // LAYER SITE FORMAT BITS SHIFT MAX SAT FLUSHED ERR FLIPS NF
};

// The rows of a `cpdctl layers` table (after the header line starting with `first_header`).
std::vector<TableRow> ParseTable(const std::string& out, const std::string& first_header) {
  std::vector<TableRow> rows;
  bool in_table = false;
  for (const auto& line : SplitLines(out)) {
    if (!in_table) {
      in_table = line.rfind(first_header, 0) == 0;
      continue;
    }
    rows.push_back({Words(line)});
  }
  return rows;
}

TEST_F(CpdctlTest, LayersShowsEveryLayerAndSiteOfTheLatestReport) {
  const RunResult r = Ctl({"layers", kJob});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("job ctl-test  step 5  epoch 1", 0), 0u) << r.out;
  const auto rows = ParseTable(r.out, "LAYER");
  ASSERT_EQ(rows.size(), size_t(kRowsPerReport)) << r.out;
  std::map<std::string, const TableRow*> seen;
  for (const auto& row : rows) {
    ASSERT_EQ(row.cells.size(), 11u);
    seen[row.cells[0] + "." + row.cells[1]] = &row;
  }
  for (const char* layer : {"conv1", "block1.conv1", "fc"}) {
    for (const char* site : kSiteNames) {
      EXPECT_TRUE(seen.count(std::string(layer) + "." + site)) << layer << "." << site;
    }
  }
  // block1.conv1 (li 1) at step 5: COMM shift 10 - 3 + 5 = 12; W: uint6 6 bits, flips 8;
  // A: rel error not measured.
  const auto& comm = seen.at("block1.conv1.COMM")->cells;
  EXPECT_EQ(comm[2], "e4m3");
  EXPECT_EQ(comm[4], "12");
  EXPECT_EQ(comm[5], "210");  // max|x| = 2 * 10^(4-2) * 1.05
  EXPECT_EQ(comm[9], "-");
  const auto& wrow = seen.at("block1.conv1.W")->cells;
  EXPECT_EQ(wrow[2], "uint6:minmax:ch");
  EXPECT_EQ(wrow[3], "6");
  EXPECT_EQ(wrow[4], "-");
  EXPECT_EQ(wrow[9], "8");
  EXPECT_EQ(seen.at("fc.A")->cells[8], "-");
}

TEST_F(CpdctlTest, LayersSortStepSiteTopAndRange) {
  // --sort max: the MAX|X| column never increases.
  RunResult r = Ctl({"layers", kJob, "--sort", "max"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto rows = ParseTable(r.out, "LAYER");
  ASSERT_EQ(rows.size(), size_t(kRowsPerReport));
  for (size_t i = 1; i < rows.size(); ++i) {
    EXPECT_GE(std::stod(rows[i - 1].cells[5]), std::stod(rows[i].cells[5])) << r.out;
  }
  EXPECT_EQ(rows[0].cells[0] + "." + rows[0].cells[1], "fc.COMM") << r.out;  // 3e2 * 1.05

  // --sort layer: names in order, and W A E G COMM within a layer.
  r = Ctl({"layers", kJob, "--sort", "layer"});
  rows = ParseTable(r.out, "LAYER");
  ASSERT_EQ(rows.size(), size_t(kRowsPerReport));
  for (size_t i = 1; i < rows.size(); ++i) EXPECT_LE(rows[i - 1].cells[0], rows[i].cells[0]);
  EXPECT_EQ(rows[0].cells[0], "block1.conv1");
  for (int si = 0; si < 5; ++si) EXPECT_EQ(rows[size_t(si)].cells[1], kSiteNames[si]);

  // --sort shift: the COMM rows first, largest shift first (conv1 15, block1.conv1 12, fc 9).
  r = Ctl({"layers", kJob, "--sort", "shift"});
  rows = ParseTable(r.out, "LAYER");
  ASSERT_EQ(rows.size(), size_t(kRowsPerReport));
  EXPECT_EQ(rows[0].cells[0] + " " + rows[0].cells[4], "conv1 15");
  EXPECT_EQ(rows[1].cells[0] + " " + rows[1].cells[4], "block1.conv1 12");
  EXPECT_EQ(rows[2].cells[0] + " " + rows[2].cells[4], "fc 9");

  // --sort flushed: percentages, largest first.
  r = Ctl({"layers", kJob, "--sort", "flushed"});
  rows = ParseTable(r.out, "LAYER");
  ASSERT_EQ(rows.size(), size_t(kRowsPerReport));
  for (size_t i = 1; i < rows.size(); ++i) {
    EXPECT_GE(std::stod(rows[i - 1].cells[7]), std::stod(rows[i].cells[7])) << r.out;
  }

  // --step 0 picks that report: conv1's COMM shift there is 10.
  r = Ctl({"layers", kJob, "--step", "0", "--site", "COMM"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("job ctl-test  step 0  epoch 0", 0), 0u) << r.out;
  rows = ParseTable(r.out, "LAYER");
  ASSERT_EQ(rows.size(), 3u) << r.out;
  EXPECT_EQ(rows[0].cells[0] + " " + rows[0].cells[1] + " " + rows[0].cells[4], "conv1 COMM 10");

  // --top 2 after --sort error.
  r = Ctl({"layers", kJob, "--sort", "error", "--top", "2"});
  rows = ParseTable(r.out, "LAYER");
  ASSERT_EQ(rows.size(), 2u) << r.out;
  EXPECT_EQ(rows[0].cells[0] + "." + rows[0].cells[1], "fc.COMM");  // 0.03 + 0.004

  // A range: one table with a STEP column, both reports with layers.
  r = Ctl({"layers", kJob, "--from", "0", "--to", "9"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  rows = ParseTable(r.out, "STEP");
  ASSERT_EQ(rows.size(), size_t(2 * kRowsPerReport)) << r.out;
  EXPECT_EQ(rows.front().cells[0], "0");
  EXPECT_EQ(rows.back().cells[0], "5");

  // A step without layer rows is an error; an unknown sort key a usage error.
  ExpectError(Ctl({"layers", kJob, "--step", "3"}), 1, "no layer statistics at step 3");
  ExpectError(Ctl({"layers", kJob, "--sort", "size"}), 2, "--sort");
}

TEST_F(CpdctlTest, LayersJsonCarriesTheReportedValues) {
  const json j = Json(Ctl({"layers", kJob, "--step", "5", "--json"}));
  ASSERT_EQ(j["reports"].size(), 1u) << j.dump();
  const json& rep = j["reports"][0];
  EXPECT_EQ(rep["step"], 5);
  ASSERT_EQ(rep["layers"].size(), size_t(kRowsPerReport));
  int idx = 0;
  for (int li = 0; li < kQuantLayers; ++li) {
    for (int si = 0; si < 5; ++si, ++idx) {
      const v1::LayerStat want = MakeStat(5, li, si);
      const json& got = rep["layers"][size_t(idx)];
      EXPECT_EQ(got["layer"], want.layer());
      EXPECT_EQ(got["site"], v1::Site_Name(want.site()));
      EXPECT_EQ(got["max_abs"].get<double>(), want.max_abs());
      EXPECT_EQ(got["flushed"].get<double>(), want.flushed());
      EXPECT_EQ(got["rel_error"].get<double>(), want.rel_error());
      EXPECT_EQ(got["aps_shift"], want.aps_shift());
      EXPECT_EQ(got["flips"].get<uint64_t>(), want.flips());
    }
  }
}

TEST_F(CpdctlTest, LayersRangeIsReadInPagesUnderTheAnswerCap) {
  // A coordinator whose answers stop at 1 MiB, and 12 reports of 4000 layer rows (~2 MiB).
  std::unique_ptr<Child> small;
  const std::string port_file = dir_ + "/small.port";
  small = std::make_unique<Child>(
      CPD_COORDINATOR_PATH,
      std::vector<std::string>{"--listen", "127.0.0.1:0", "--port-file", port_file, "--db",
                               dir_ + "/small.sqlite", "--max-message-mib", "1"},
      std::vector<std::string>{}, dir_ + "/small.err");
  std::string line;
  ASSERT_TRUE(small->ReadLine(&line, 30)) << small->err();
  const std::string addr = "127.0.0.1:" + std::to_string(std::atoi(ReadAll(port_file).c_str()));
  auto w = Worker(addr);
  v1::RegisterJobRequest req;
  req.set_job_name("big");
  req.set_world_size(1);
  grpc::ClientContext ctx;
  Prepare(&ctx, "");
  v1::RegisterJobResponse resp;
  ASSERT_TRUE(w->RegisterJob(&ctx, req, &resp).ok());
  constexpr int kReports = 12, kRows = 4000;
  for (int step = 0; step < kReports; ++step) {
    v1::StatsReport r;
    r.set_job_id(resp.job_id());
    r.set_step(step);
    r.set_ranks_alive(1);
    for (int i = 0; i < kRows; ++i) {
      v1::LayerStat* l = r.add_layers();
      l->set_layer("stage" + std::to_string(i / 100) + ".block" + std::to_string(i) + ".conv");
      l->set_site(v1::SITE_COMM);
      l->set_format("e4m3");
      l->set_max_abs(step + i * 1e-3);
    }
    Report(addr, "", r);
  }
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  json j;
  while (Clock::now() < deadline) {
    j = Json(Ctl({"status", "big", "--json", "--coordinator", addr}, {}, false));
    if (j["reports_stored"] == kReports) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(j["reports_stored"], kReports);
  j = Json(Ctl({"layers", "big", "--from", "0", "--json", "--coordinator", addr}, {}, false));
  ASSERT_EQ(j["reports"].size(), size_t(kReports));
  for (int step = 0; step < kReports; ++step) {
    EXPECT_EQ(j["reports"][size_t(step)]["step"], step);
    EXPECT_EQ(j["reports"][size_t(step)]["layers"].size(), size_t(kRows));
  }
  j = Json(Ctl({"layers", "big", "--from", "2", "--limit", "7", "--json", "--coordinator", addr},
               {}, false));
  ASSERT_EQ(j["reports"].size(), 7u);
  EXPECT_EQ(j["reports"][0]["step"], 2);
  EXPECT_EQ(j["reports"][6]["step"], 8);
}

// ---- schedule --------------------------------------------------------------------------------

TEST_F(CpdctlTest, ScheduleGetSetRoundTripsAndReachesTheWorkers) {
  RunResult r = Ctl({"schedule", "get", kJob});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("version         1\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("3-8 bits, 4 periods"), std::string::npos) << r.out;

  r = Ctl({"schedule",
           "set",
           kJob,
           "--cyclic-bits",
           "4",
           "6",
           "--cyclic-periods",
           "8",
           "--grad-bits",
           "6",
           "--format",
           "A=fp134",
           "--format",
           "block1.conv1.W=fp32",
           "--rounding",
           "A=stochastic",
           "--keep-fp32",
           "last",
           "--hysteresis",
           "on",
           "--from-step",
           "20"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("schedule version 1 -> 2, effective from step 20"), std::string::npos)
      << r.out;

  json j = Json(Ctl({"schedule", "get", kJob, "--json"}));
  const json& s = j["schedule"];
  EXPECT_EQ(s["version"], 2);
  EXPECT_EQ(s["effective_from_step"], 20);
  EXPECT_EQ(s["cyclic"]["min_bits"], 4);
  EXPECT_EQ(s["cyclic"]["max_bits"], 6);
  EXPECT_EQ(s["cyclic"]["periods"], 8);
  EXPECT_EQ(s["grad_bits"], 6);
  ASSERT_EQ(s["formats"].size(), 2u) << s.dump();
  EXPECT_EQ(s["formats"][0]["site"], "SITE_W");
  EXPECT_EQ(s["formats"][0]["spec"], "e4m3");  // not edited: kept
  EXPECT_EQ(s["formats"][1]["site"], "SITE_A");
  EXPECT_EQ(s["formats"][1]["spec"], "fp134");
  EXPECT_EQ(s["formats"][1]["rounding"], "stochastic");
  ASSERT_EQ(s["overrides"].size(), 1u);
  EXPECT_EQ(s["overrides"][0]["layer"], "block1.conv1");
  EXPECT_EQ(s["overrides"][0]["site"], "SITE_W");
  EXPECT_EQ(s["overrides"][0]["spec"], "fp32");
  EXPECT_EQ(s["keep_fp32"], json::array({"last"}));
  EXPECT_EQ(s["hysteresis"], true);
  EXPECT_EQ(s["set_by"].get<std::string>().rfind("cpdctl", 0), 0u) << s["set_by"];
  ASSERT_EQ(j["history"].size(), 2u);
  EXPECT_EQ(j["history"][0]["version"], 1);
  EXPECT_EQ(j["history"][0]["set_by"], "register");

  // The worker's WatchSchedule delivers version 2.
  {
    auto w = Worker(addr_);
    grpc::ClientContext ctx;
    Prepare(&ctx, "");
    v1::WatchScheduleRequest req;
    req.set_job_id(job_id_);
    req.set_after_version(1);
    auto reader = w->WatchSchedule(&ctx, req);
    v1::PrecisionSchedule got;
    ASSERT_TRUE(reader->Read(&got));
    EXPECT_EQ(got.version(), 2u);
    EXPECT_EQ(got.cyclic().max_bits(), 6);
    ctx.TryCancel();
    reader->Finish();
  }

  // --static drops CPT; --json prints the new schedule.
  j = Json(Ctl({"schedule", "set", kJob, "--static", "--json"}));
  EXPECT_EQ(j["schedule"]["version"], 3);
  EXPECT_EQ(j["schedule"]["cyclic"]["periods"], 0);
  EXPECT_EQ(j["schedule"]["grad_bits"], 0);
  EXPECT_EQ(j["schedule"]["effective_from_step"], 0);  // no --from-step: the next step
  EXPECT_EQ(j["schedule"]["overrides"].size(), 1u);
  r = Ctl({"schedule", "get", kJob, "--history"});
  EXPECT_NE(r.out.find("cyclic          off"), std::string::npos) << r.out;
  const auto hist = ParseTable(r.out, "VERSION");
  ASSERT_EQ(hist.size(), 3u) << r.out;
  EXPECT_EQ(hist[2].cells[0], "3");
}

TEST_F(CpdctlTest, ScheduleSetRefusesBadSpecsLocallyAndStaleVersions) {
  // A bad spec fails before any call: the same answer with no coordinator at all.
  RunResult r = Ctl({"schedule", "set", kJob, "--format", "W=e9m1"});
  ExpectError(r, 2, "--format 'W=e9m1': bad format spec 'e9m1'");
  r = Ctl(
      {"schedule", "set", kJob, "--format", "conv1.W=e4m3:bogus", "--coordinator", "127.0.0.1:1"},
      {}, /*with_address=*/false);
  ExpectError(r, 2, "e4m3:bogus");
  ExpectError(Ctl({"schedule", "set", kJob, "--rounding", "W=upward"}), 2, "upward");
  ExpectError(Ctl({"schedule", "set", kJob, "--cyclic-bits", "1", "8"}), 2, "--cyclic-bits");
  ExpectError(Ctl({"schedule", "set", kJob}), 2, "nothing to change");
  // Layer names are checked against the job's.
  ExpectError(Ctl({"schedule", "set", kJob, "--format", "conv9.W=e4m3"}), 2, "no layer 'conv9'");

  // A stale expected version is refused and nothing is written.
  ASSERT_EQ(Ctl({"schedule", "set", kJob, "--grad-bits", "7"}).exit_code, 0);
  ExpectError(Ctl({"schedule", "set", kJob, "--grad-bits", "5", "--expect-version", "1"}), 1,
              "no longer version 1");
  const json j = Json(Ctl({"schedule", "get", kJob, "--json"}));
  EXPECT_EQ(j["schedule"]["version"], 2);
  EXPECT_EQ(j["schedule"]["grad_bits"], 7);
  // The current version passes.
  EXPECT_EQ(Ctl({"schedule", "set", kJob, "--grad-bits", "5", "--expect-version", "2"}).exit_code,
            0);
}

// Edits the job can never use (issue 26 item 15): a --from-step at or past its total steps was
// stored and never took effect; refused with the accepted range, exit 2, and by the coordinator
// itself for any client. A layer the job lacks is named with a bounded list of its layers.
TEST_F(CpdctlTest, ScheduleSetRefusesAStartBeyondTheJobsSteps) {
  ExpectError(Ctl({"schedule", "set", kJob, "--grad-bits", "6", "--from-step", "100"}), 2,
              "--from-step 100 is beyond the 100 steps of job 'ctl-test'; accepted: 0..99");
  ExpectError(Ctl({"schedule", "set", kJob, "--grad-bits", "6", "--from-step", "99999999999"}), 2,
              "accepted: 0..99");
  EXPECT_EQ(Json(Ctl({"schedule", "get", kJob, "--json"}))["schedule"]["version"], 1);
  ASSERT_EQ(Ctl({"schedule", "set", kJob, "--grad-bits", "6", "--from-step", "99"}).exit_code, 0);

  // The coordinator refuses it from any client.
  auto ops =
      v1::OperatorService::NewStub(grpc::CreateChannel(addr_, grpc::InsecureChannelCredentials()));
  v1::SetScheduleRequest req;
  req.mutable_job()->set_job_name(kJob);
  req.mutable_schedule()->set_effective_from_step(100);
  grpc::ClientContext ctx;
  Prepare(&ctx, "");
  v1::SetScheduleResponse resp;
  const grpc::Status st = ops->SetSchedule(&ctx, req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_NE(st.error_message().find("schedule.effective_from_step: 100 is beyond the 100 steps"),
            std::string::npos)
      << st.error_message();
}

// What the user typed comes back quoted, shortened and escaped (issue 26 item 15: garbage
// echoed raw, a 400 KB one-line error): one short line, exit 2.
TEST_F(CpdctlTest, BadArgumentsAreQuotedShortAndEscaped) {
  // 100 KB: below Linux's limit on one argument (128 KiB).
  const std::string big(100000, 'z');
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"status", big},
           {"status", "bad\x01name\xff"},
           {"frob\tnicate"},
           {"schedule", "set", kJob, "--format", "W=" + big},
           {"schedule", "set", kJob, "--format", big + ".W=e4m3"},
           {"schedule", "set", kJob, "--format", "W=e4m3\x1b[2J"},
           {"schedule", "set", kJob, "--rounding", "W=" + big},
           {"schedule", "set", kJob, "--hysteresis", big},
           {"schedule", "set", kJob, "--allreduce-layer-format", big},
           {"layers", kJob, "--top", big},
           {"jobs", "--timeout", big}}) {
    const RunResult r = Ctl(args);
    SCOPED_TRACE(args[0] + " " + (args.size() > 1 ? args[1].substr(0, 20) : ""));
    EXPECT_EQ(r.exit_code, 2) << r.err.substr(0, 300);
    EXPECT_EQ(Lines(r.err), 1u) << r.err.substr(0, 300);
    EXPECT_LT(r.err.size(), 1000u) << r.err.substr(0, 300);
    for (char c : r.err.substr(0, r.err.size() - 1)) {
      EXPECT_TRUE(c >= 0x20 && c < 0x7f) << "byte " << int(c) << " in " << r.err.substr(0, 300);
    }
  }
  ExpectError(Ctl({"status", "bad\x01name"}), 2, "JOB 'bad\\x01name'");
  ExpectError(Ctl({"frob\tnicate"}), 2, "unknown command 'frob\\tnicate'");
  // A layer the job lacks: its name quoted, the job's layers listed.
  const std::string del_in_name = std::string("conv") + '\x7f' + "9.W=e4m3";
  ExpectError(Ctl({"schedule", "set", kJob, "--format", del_in_name}), 2,
              "no layer 'conv\\x7f9' (layers: conv1, block1.conv1, fc)");
}

// Hybrid precision: per-layer all-reduce formats set, replaced, dropped and cleared through the
// real coordinator, checked against the job's layers and the format library first.
TEST_F(CpdctlTest, ScheduleSetPerLayerAllReduceFormatsRoundTrips) {
  RunResult r =
      Ctl({"schedule", "set", kJob, "--allreduce-layer-format", "first=fp32",
           "--allreduce-layer-format", "block1.conv1=e5m2", "--allreduce-layer-format", "bn=fp32"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json j = Json(Ctl({"schedule", "get", kJob, "--json"}));
  json s = j["schedule"];
  EXPECT_EQ(s["version"], 2);
  ASSERT_EQ(s["allreduce_layers"].size(), 3u) << s.dump();
  EXPECT_EQ(s["allreduce_layers"][0]["layer"], "first");
  EXPECT_EQ(s["allreduce_layers"][0]["spec"], "fp32");
  EXPECT_EQ(s["allreduce_layers"][1]["layer"], "block1.conv1");
  EXPECT_EQ(s["allreduce_layers"][1]["spec"], "e5m2");
  EXPECT_EQ(s["allreduce_layers"][2]["layer"], "bn");
  r = Ctl({"schedule", "get", kJob});
  EXPECT_NE(r.out.find("all-reduce layer  block1.conv1=e5m2"), std::string::npos) << r.out;

  // NAME=SPEC replaces NAME's entry in place; NAME=default drops it.
  ASSERT_EQ(Ctl({"schedule", "set", kJob, "--allreduce-layer-format", "block1.conv1=int8",
                 "--allreduce-layer-format", "first=default"})
                .exit_code,
            0);
  s = Json(Ctl({"schedule", "get", kJob, "--json"}))["schedule"];
  ASSERT_EQ(s["allreduce_layers"].size(), 2u) << s.dump();
  EXPECT_EQ(s["allreduce_layers"][0]["layer"], "block1.conv1");
  EXPECT_EQ(s["allreduce_layers"][0]["spec"], "int8");
  EXPECT_EQ(s["allreduce_layers"][1]["layer"], "bn");
  // The other parts of the schedule are kept.
  EXPECT_EQ(s["formats"][0]["spec"], "e4m3");

  // Refused before the coordinator writes anything: unknown layer, bad spec, no '='.
  ExpectError(Ctl({"schedule", "set", kJob, "--allreduce-layer-format", "conv9=fp32"}), 2,
              "no layer 'conv9'");
  ExpectError(Ctl({"schedule", "set", kJob, "--allreduce-layer-format", "fc=e9m9"}), 2, "e9m9");
  ExpectError(Ctl({"schedule", "set", kJob, "--allreduce-layer-format", "fc"}), 2,
              "expected NAME=SPEC");
  EXPECT_EQ(Json(Ctl({"schedule", "get", kJob, "--json"}))["schedule"]["version"], 3);

  // none clears them all.
  ASSERT_EQ(Ctl({"schedule", "set", kJob, "--allreduce-layer-format", "none"}).exit_code, 0);
  s = Json(Ctl({"schedule", "get", kJob, "--json"}))["schedule"];
  EXPECT_EQ(s["version"], 4);
  EXPECT_TRUE(!s.contains("allreduce_layers") || s["allreduce_layers"].empty()) << s.dump();
}

// ---- watch -----------------------------------------------------------------------------------

TEST_F(CpdctlTest, WatchReceivesReportsPushedWhileItRuns) {
  Child w(CPDCTL_PATH, {"watch", kJob, "--count", "3", "--coordinator", addr_}, {},
          dir_ + "/watch.err");
  std::string line;
  // The latest report first: the stream is open once it is printed.
  ASSERT_TRUE(w.ReadLine(&line, 30)) << w.err();
  EXPECT_EQ(line.rfind("step 9/100 epoch 1/2 loss 0.2 ", 0), 0u) << line;
  EXPECT_NE(line.find("test 50.00%"), std::string::npos) << line;
  Report(addr_, "", MakeReport(job_id_, 10, false));
  Report(addr_, "", MakeReport(job_id_, 11, true));
  EXPECT_EQ(w.Wait(30), 0) << w.err();
  const auto lines = SplitLines(w.out());
  ASSERT_EQ(lines.size(), 3u) << w.out();
  EXPECT_EQ(lines[1].rfind("step 10/100 epoch 2/2 ", 0), 0u) << lines[1];
  EXPECT_EQ(lines[2].rfind("step 11/100 epoch 2/2 ", 0), 0u) << lines[2];
  EXPECT_EQ(lines[2].find("layers"), std::string::npos) << "no --layers: " << lines[2];
  EXPECT_EQ(w.err(), "");
}

TEST_F(CpdctlTest, WatchJsonWithLayersAndTheEndOfTheJob) {
  Child w(CPDCTL_PATH, {"watch", kJob, "--layers", "--json", "--coordinator", addr_}, {},
          dir_ + "/watch.err");
  std::string line;
  ASSERT_TRUE(w.ReadLine(&line, 30)) << w.err();
  EXPECT_EQ(json::parse(line)["step"], 9);
  Report(addr_, "", MakeReport(job_id_, 10, true));
  Report(addr_, "", MakeReport(job_id_, 11, false, /*finished=*/true));
  // It stops by itself when the job finishes.
  EXPECT_EQ(w.Wait(30), 0) << w.err();
  const auto lines = SplitLines(w.out());
  ASSERT_EQ(lines.size(), 3u) << w.out();
  const json r10 = json::parse(lines[1]);
  EXPECT_EQ(r10["step"], 10);
  ASSERT_EQ(r10["layers"].size(), size_t(kRowsPerReport));
  EXPECT_EQ(r10["layers"][4]["aps_shift"], 20);  // conv1 COMM: 10 + 10
  const json r11 = json::parse(lines[2]);
  EXPECT_EQ(r11["finished"], true);
}

TEST_F(CpdctlTest, WatchStopsCleanlyOnSigint) {
  Child w(CPDCTL_PATH, {"watch", kJob, "--coordinator", addr_}, {}, dir_ + "/watch.err");
  std::string line;
  ASSERT_TRUE(w.ReadLine(&line, 30)) << w.err();
  ASSERT_EQ(kill(w.pid(), SIGINT), 0);
  EXPECT_EQ(w.Wait(10), 0) << w.err();
  EXPECT_EQ(w.err(), "");
}

TEST_F(CpdctlTest, WatchRedrawsInPlaceOnATerminal) {
  int master = -1;
  const pid_t pid = forkpty(&master, nullptr, nullptr, nullptr);
  ASSERT_GE(pid, 0) << std::strerror(errno);
  if (pid == 0) {
    execl(CPDCTL_PATH, CPDCTL_PATH, "watch", kJob, "--layers", "--count", "2", "--coordinator",
          addr_.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  // Everything the terminal receives until the child exits (bounded).
  std::string screen;
  bool reported = false;
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  while (Clock::now() < deadline) {
    pollfd p{master, POLLIN, 0};
    if (poll(&p, 1, 100) > 0) {
      char buf[4096];
      const ssize_t n = read(master, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;  // EIO: the child closed the terminal
      screen.append(buf, size_t(n));
    }
    // The first drawing (step 9, the table of step 5) is up: push a report with layer rows.
    if (!reported && screen.find("job ctl-test  step 5") != std::string::npos) {
      Report(addr_, "", MakeReport(job_id_, 10, true));
      reported = true;
    }
  }
  close(master);
  int status = 0;
  pid_t done = 0;
  while ((done = waitpid(pid, &status, WNOHANG)) == 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (done != pid) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    FAIL() << "watch did not stop after --count 2 on a terminal:\n" << screen;
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << screen;
  // Each redraw homes the cursor and clears the screen, then draws the block and the table.
  const std::string clear = "\x1b[H\x1b[2J";
  size_t draws = 0;
  for (size_t p = screen.find(clear); p != std::string::npos; p = screen.find(clear, p + 1)) {
    ++draws;
  }
  EXPECT_GE(draws, 2u) << screen;
  const std::string last = screen.substr(screen.rfind(clear));
  for (const char* want :
       {"cpdctl watch ctl-test on ", "step         10 (11 / 100 done, 11%)", "LAYER",
        "block1.conv1", "COMM", "job ctl-test  step 10", "2 reports received by this watch"}) {
    EXPECT_NE(last.find(want), std::string::npos) << want << " in\n" << last;
  }
}

// ---- export ----------------------------------------------------------------------------------

std::vector<std::vector<std::string>> ParseCsv(const std::string& text) {
  std::vector<std::vector<std::string>> rows;
  for (const auto& line : SplitLines(text)) {
    std::vector<std::string> cells;
    std::stringstream ss(line);
    std::string cell;
    while (std::getline(ss, cell, ',')) cells.push_back(cell);
    if (!line.empty() && line.back() == ',') cells.push_back("");
    rows.push_back(cells);
  }
  return rows;
}

TEST_F(CpdctlTest, ExportCsvHasARowPerReportAndLayerWithTheReportedValues) {
  const std::string path = dir_ + "/out/history.csv";
  mkdir((dir_ + "/out").c_str(), 0755);
  RunResult r = Ctl({"export", kJob, "--csv", path});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // 2 reports x 15 layer rows + 8 summaries.
  EXPECT_EQ(r.out, "wrote 38 rows (10 reports) to " + path + "\n");
  const std::string text = ReadAll(path);
  const auto rows = ParseCsv(text);
  ASSERT_EQ(rows.size(), 39u) << text;
  const auto& h = rows[0];
  ASSERT_EQ(h.size(), 26u);
  std::map<std::string, size_t> col;
  for (size_t i = 0; i < h.size(); ++i) col[h[i]] = i;
  for (const char* c : {"step", "rank", "epoch", "loss", "lr", "bits", "schedule_version", "layer",
                        "site", "format", "format_bits", "aps_shift", "max_abs", "saturated",
                        "flushed", "rel_error", "flips"}) {
    EXPECT_TRUE(col.count(c)) << c;
  }
  size_t layer_rows = 0, summary_rows = 0;
  for (size_t i = 1; i < rows.size(); ++i) {
    const auto& row = rows[i];
    ASSERT_EQ(row.size(), h.size()) << i;
    const int64_t step = std::stoll(row[col["step"]]);
    const v1::StatsReport rep = MakeReport(job_id_, step, false);
    EXPECT_EQ(std::strtod(row[col["loss"]].c_str(), nullptr), rep.loss()) << i;
    EXPECT_EQ(std::stoi(row[col["bits"]]), rep.bits());
    if (row[col["layer"]].empty()) {
      ++summary_rows;
      EXPECT_TRUE(step != 0 && step != 5) << step;
      continue;
    }
    ++layer_rows;
    // Find the (layer, site) the worker reported and compare every number exactly.
    bool found = false;
    for (int li = 0; li < kQuantLayers; ++li) {
      for (int si = 0; si < 5; ++si) {
        const v1::LayerStat want = MakeStat(step, li, si);
        if (want.layer() != row[col["layer"]] || kSiteNames[si] != row[col["site"]]) continue;
        found = true;
        EXPECT_EQ(row[col["format"]], want.format());
        EXPECT_EQ(std::stoi(row[col["format_bits"]]), want.bits());
        EXPECT_EQ(std::stoi(row[col["aps_shift"]]), want.aps_shift());
        EXPECT_EQ(std::strtod(row[col["max_abs"]].c_str(), nullptr), want.max_abs());
        EXPECT_EQ(std::strtod(row[col["saturated"]].c_str(), nullptr), want.saturated());
        EXPECT_EQ(std::strtod(row[col["flushed"]].c_str(), nullptr), want.flushed());
        if (want.rel_error() < 0) {
          EXPECT_EQ(row[col["rel_error"]], "");
        } else {
          EXPECT_EQ(std::strtod(row[col["rel_error"]].c_str(), nullptr), want.rel_error());
        }
        EXPECT_EQ(std::stoull(row[col["flips"]]), want.flips());
      }
    }
    EXPECT_TRUE(found) << row[col["layer"]] << "." << row[col["site"]];
  }
  EXPECT_EQ(layer_rows, 30u);
  EXPECT_EQ(summary_rows, 8u);
  // Written atomically: no temporary left beside it.
  EXPECT_EQ(std::system(("test $(ls -A '" + dir_ + "/out' | wc -l) -eq 1").c_str()), 0);

  // A range, to stdout: steps 2..6 are 4 summaries and step 5's 15 rows.
  r = Ctl({"export", kJob, "--csv", "-", "--from", "2", "--to", "6"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto part = ParseCsv(r.out);
  ASSERT_EQ(part.size(), 1u + 4u + 15u) << r.out;
  EXPECT_EQ(part[0], h);
  EXPECT_EQ(part[1][0], "2");
  EXPECT_EQ(part.back()[0], "6");
}

// ---- plot ------------------------------------------------------------------------------------

TEST_F(CpdctlTest, PlotWritesAPng) {
  if (std::system((std::string(CPDCTL_PYTHON) + " -c 'import matplotlib' 2>/dev/null").c_str()) !=
      0) {
    GTEST_SKIP() << CPDCTL_PYTHON << " has no matplotlib (python3-matplotlib)";
  }
  Report(addr_, "", MakeReport(job_id_, 10, true));
  ASSERT_EQ(Ctl({"schedule", "set", kJob, "--cyclic-bits", "4", "8"}).exit_code, 0);
  Report(addr_, "", MakeReport(job_id_, 15, true));
  WaitStored(addr_, "", 12);
  const std::string png = dir_ + "/plot.png";
  const RunResult r = Ctl({"plot", kJob, "--out", png});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "wrote " + png + " (12 reports)\n");
  const std::string data = ReadAll(png);
  EXPECT_EQ(data.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_GT(data.size(), 20000u);  // four panels with lines, not an empty canvas

  // Without a usable Python: one line, exit 1, no file.
  const std::string png2 = dir_ + "/plot2.png";
  ExpectError(Ctl({"plot", kJob, "--out", png2}, {"CPD_PYTHON=/nonexistent/python3"}), 1,
              "cannot run /nonexistent/python3");
  EXPECT_EQ(access(png2.c_str(), F_OK), -1);
  ExpectError(Ctl({"plot", kJob, "--out", dir_ + "/plot.jpg"}), 2, "FILE.png");
}

// ---- language models ---------------------------------------------------------------------------

// A language model's report at `step` of a one-rank run: epochs end at steps 4 (validation loss
// 2.5) and 9 (1.75) with the next-token accuracies, the perplexity exp(loss) and the bits per
// byte loss / ln 2, as cpd-train --arch gpt --dataset text sends them; layer rows at step 5.
v1::StatsReport MakeLmReport(int64_t job_id, int64_t step) {
  v1::StatsReport r = MakeReport(job_id, step, step == 5);
  r.set_ranks_alive(1);
  r.set_train_accuracy(-1);
  r.set_test_accuracy(-1);
  r.set_test_loss(-1);
  r.set_test_perplexity(-1);
  r.set_test_bits_per_byte(-1);
  if (step == 4 || step == 9) {
    const double loss = step == 4 ? 2.5 : 1.75;
    r.set_epoch(step == 4 ? 1 : 2);
    r.set_train_accuracy(0.25);
    r.set_test_accuracy(0.125);
    r.set_test_loss(loss);
    r.set_test_perplexity(std::exp(loss));
    r.set_test_bits_per_byte(loss / std::log(2.0));
  }
  return r;
}

// status, study, watch, export and plot show a language model's validation perplexity and bits
// per byte where they show a vision model's accuracy (the vision job's output is pinned by the
// tests above: no such line or column there).
TEST_F(CpdctlTest, LanguageModelShowsPerplexityWhereAccuracyIs) {
  const int64_t gpt = RegisterRun("lm.gpt", "lm");
  RegisterRun("lm.lstm", "lm");  // no report yet
  for (int64_t step = 0; step < 10; ++step) Report(addr_, "", MakeLmReport(gpt, step));
  WaitStored(addr_, "", 10, "lm.gpt");

  RunResult r = Ctl({"status", "lm.gpt"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("\nperplexity   5.75 (validation; 2.525 bits/byte, loss 1.7500)\n"
                       "accuracy     train 25.00%, test 12.50% (next token)\n"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("epoch        2 / 4"), std::string::npos) << r.out;
  const json j = Json(Ctl({"--json", "status", "lm.gpt"}));
  EXPECT_EQ(j["test_loss"], 1.75);
  EXPECT_EQ(j["test_perplexity"], std::exp(1.75));
  EXPECT_EQ(j["test_bits_per_byte"], 1.75 / std::log(2.0));
  EXPECT_EQ(j["job"]["test_perplexity"], std::exp(1.75));
  const RunResult vision = Ctl({"status", kJob});
  EXPECT_EQ(vision.out.find("perplexity"), std::string::npos) << vision.out;
  EXPECT_EQ(vision.out.find("next token"), std::string::npos) << vision.out;

  // The study's table: VAL PPL and BPB in place of TEST ACC.
  r = Ctl({"study", "lm"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto lines = SplitLines(r.out);
  ASSERT_EQ(lines.size(), 4u) << r.out;
  EXPECT_EQ(Words(lines[0]), (std::vector<std::string>{"RUN", "STATE", "STEP", "EPOCH", "VAL",
                                                       "PPL", "BPB", "LOSS", "LAST", "REPORT"}))
      << lines[0];
  auto w = Words(lines[1]);
  ASSERT_GE(w.size(), 11u) << lines[1];
  EXPECT_EQ(std::vector<std::string>(w.begin(), w.begin() + 11),
            (std::vector<std::string>{"lm.gpt", "running", "10", "/", "100", "2", "/", "4", "5.75",
                                      "2.525", "0.2"}))
      << lines[1];
  EXPECT_EQ(Words(lines[2]), (std::vector<std::string>{"lm.lstm", "running", "0", "/", "100", "0",
                                                       "/", "4", "-", "-", "-", "-"}))
      << lines[2];

  // watch: the epoch's line has the validation figures instead of the accuracies.
  Child wt(CPDCTL_PATH, {"watch", "lm.gpt", "--count", "2", "--coordinator", addr_}, {},
           dir_ + "/watch.err");
  std::string line;
  ASSERT_TRUE(wt.ReadLine(&line, 30)) << wt.err();
  EXPECT_EQ(line.rfind("step 9/100 epoch 2/4 loss 0.2 ", 0), 0u) << line;
  EXPECT_NE(line.find(" img/s val loss 1.7500 ppl 5.75 bpb 2.525"), std::string::npos) << line;
  EXPECT_EQ(line.find(" train "), std::string::npos) << line;
  Report(addr_, "", MakeLmReport(gpt, 10));
  EXPECT_EQ(wt.Wait(30), 0) << wt.err();
  const auto watched = SplitLines(wt.out());
  ASSERT_EQ(watched.size(), 2u) << wt.out();
  EXPECT_EQ(watched[1].find("ppl"), std::string::npos) << watched[1];

  // export: test_loss, test_perplexity and test_bits_per_byte after the accuracies, filled at
  // the epochs' ends, exactly as sent.
  WaitStored(addr_, "", 11, "lm.gpt");
  r = Ctl({"export", "lm.gpt", "--csv", "-"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto rows = ParseCsv(r.out);
  ASSERT_EQ(rows.size(), 1u + 10u + 15u) << r.out;  // 10 summaries and step 5's 15 rows
  const auto& h = rows[0];
  ASSERT_EQ(h.size(), 29u);
  EXPECT_EQ(std::vector<std::string>(h.begin() + 12, h.begin() + 18),
            (std::vector<std::string>{"train_accuracy", "test_accuracy", "test_loss",
                                      "test_perplexity", "test_bits_per_byte", "finished"}));
  for (size_t i = 1; i < rows.size(); ++i) {
    ASSERT_EQ(rows[i].size(), h.size()) << i;
    const v1::StatsReport want = MakeLmReport(gpt, std::stoll(rows[i][0]));
    if (want.test_perplexity() < 0) {
      EXPECT_EQ(rows[i][14] + rows[i][15] + rows[i][16], "") << i;
      continue;
    }
    EXPECT_EQ(std::strtod(rows[i][14].c_str(), nullptr), want.test_loss()) << i;
    EXPECT_EQ(std::strtod(rows[i][15].c_str(), nullptr), want.test_perplexity()) << i;
    EXPECT_EQ(std::strtod(rows[i][16].c_str(), nullptr), want.test_bits_per_byte()) << i;
  }

  // plot: the loss panel's second axis is the validation perplexity.
  if (std::system((std::string(CPDCTL_PYTHON) + " -c 'import matplotlib' 2>/dev/null").c_str()) !=
      0) {
    GTEST_SKIP() << CPDCTL_PYTHON << " has no matplotlib (python3-matplotlib)";
  }
  const std::string png = dir_ + "/lm.png";
  r = Ctl({"plot", "lm.gpt", "--out", png});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(ReadAll(png).substr(0, 4), "\x89PNG");
}

// ---- errors ----------------------------------------------------------------------------------

// A loopback port with nothing listening: bound, read and closed.
int ClosedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    close(fd);
    return 1;
  }
  close(fd);
  return ntohs(a.sin_port);
}

TEST_F(CpdctlTest, UnreachableCoordinatorAndUnknownJob) {
  const std::string dead = "127.0.0.1:" + std::to_string(ClosedPort());
  for (std::vector<std::string> args : {std::vector<std::string>{"jobs"},
                                        {"study"},
                                        {"study", "s1"},
                                        {"status", kJob},
                                        {"layers", kJob},
                                        {"watch", kJob},
                                        {"schedule", "get", kJob},
                                        {"schedule", "set", kJob, "--grad-bits", "6"},
                                        {"export", kJob, "--csv", dir_ + "/x.csv"},
                                        {"plot", kJob, "--out", dir_ + "/x.png"}}) {
    std::vector<std::string> a = args;
    a.insert(a.end(), {"--coordinator", dead, "--timeout", "5"});
    ExpectError(Ctl(a, {}, false), 1, "cannot reach the coordinator at " + dead);
    if (args[0] != "jobs" && args[0] != "study") {
      std::vector<std::string> b = args;
      std::replace(b.begin(), b.end(), std::string(kJob), std::string("nope"));
      ExpectError(Ctl(b), 1, "no job 'nope' on " + addr_);
    }
  }
  EXPECT_EQ(access((dir_ + "/x.csv").c_str(), F_OK), -1);
  // The address may also come from the environment.
  ExpectError(Ctl({"jobs"}, {"CPD_COORDINATOR=" + dead}, false), 1, dead);
  EXPECT_EQ(Ctl({"jobs"}, {"CPD_COORDINATOR=" + addr_}, false).exit_code, 0);
  ExpectError(Ctl({"status", "bad name!"}), 2, "JOB 'bad name!'");
  ExpectError(Ctl({"frobnicate"}), 2, "unknown command 'frobnicate'");
}

TEST_F(CpdctlTest, TokenMissingWrongAndRight) {
  const std::string token = dir_ + "/token", wrong = dir_ + "/wrong";
  std::ofstream(token) << "  s3cret-token \nsecond line ignored\n";
  std::ofstream(wrong) << "not-it\n";
  const int port = StartCoordinator(&token_coord_, token, "token.sqlite");
  ASSERT_GT(port, 0);
  const std::string addr = "127.0.0.1:" + std::to_string(port);
  for (std::vector<std::string> args :
       {std::vector<std::string>{"jobs"}, {"status", kJob}, {"schedule", "get", kJob}}) {
    std::vector<std::string> a = args;
    a.insert(a.end(), {"--coordinator", addr});
    ExpectError(Ctl(a, {}, false), 1, "requires a token and none was sent: pass --token-file");
    std::vector<std::string> b = a;
    b.insert(b.end(), {"--token-file", wrong});
    ExpectError(Ctl(b, {}, false), 1, "refused the token in --token-file " + wrong);
  }
  // The right token (first line, trimmed), as a flag or from the environment.
  RunResult r = Ctl({"jobs", "--coordinator", addr, "--token-file", token}, {}, false);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "no jobs on " + addr + "\n");
  RegisterAndReport(addr, "s3cret-token");
  r = Ctl({"status", kJob, "--coordinator", addr}, {"CPD_TOKEN_FILE=" + token}, false);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("10 stored"), std::string::npos) << r.out;
  ExpectError(Ctl({"status", kJob, "--coordinator", addr}, {"CPD_TOKEN_FILE=" + wrong}, false), 1,
              "refused the token in --token-file (CPD_TOKEN_FILE) " + wrong);
  // An empty first line is refused before any call.
  const std::string empty = dir_ + "/empty";
  std::ofstream(empty) << "   \ntoken-on-line-2\n";
  ExpectError(Ctl({"jobs", "--coordinator", addr, "--token-file", empty}, {}, false), 2,
              "the first line is empty");
}

TEST_F(CpdctlTest, TlsWithTheServersCa) {
  if (std::system("command -v openssl >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "openssl is not installed (scripts/install_deps.sh installs it)";
  }
  // A self-signed certificate for 127.0.0.1: its own CA.
  const std::string cert = dir_ + "/cert.pem", key = dir_ + "/key.pem";
  const std::string cmd =
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost -keyout '" + key +
      "' -out '" + cert + "' -addext subjectAltName=IP:127.0.0.1,DNS:localhost >/dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const std::string port_file = dir_ + "/tls.port";
  Child tls(CPD_COORDINATOR_PATH,
            {"--listen", "127.0.0.1:0", "--port-file", port_file, "--db", dir_ + "/tls.sqlite",
             "--tls-cert", cert, "--tls-key", key},
            {}, dir_ + "/tls.err");
  std::string line;
  ASSERT_TRUE(tls.ReadLine(&line, 30)) << tls.err();
  const std::string addr = "127.0.0.1:" + std::to_string(std::atoi(ReadAll(port_file).c_str()));
  RunResult r = Ctl({"jobs", "--coordinator", addr, "--tls-ca", cert}, {}, false);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "no jobs on " + addr + "\n");
  // Plain TCP to a TLS server: refused, one line.
  ExpectError(Ctl({"jobs", "--coordinator", addr, "--timeout", "5"}, {}, false), 1,
              "coordinator at " + addr);
  ExpectError(Ctl({"jobs", "--coordinator", addr, "--tls-ca", dir_ + "/none.pem"}, {}, false), 2,
              "--tls-ca " + dir_ + "/none.pem: cannot read");
}

// ---- help ------------------------------------------------------------------------------------

TEST_F(CpdctlTest, HelpDocumentsEveryCommandAndOption) {
  const std::vector<std::string> global = {"--coordinator", "--token-file", "--tls-ca",
                                           "--json",        "--timeout",    "Exit codes"};
  const std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> cases = {
      {{},
       {"jobs", "study", "status", "layers", "watch", "schedule", "export", "plot",
        "CPD_COORDINATOR"}},
      {{"jobs"}, {}},
      {{"study"}, {"NAME", "--study"}},
      {{"status"}, {"JOB"}},
      {{"layers"}, {"--step", "--from", "--to", "--sort", "--site", "--top", "--limit"}},
      {{"watch"}, {"--layers", "--count", "--interval"}},
      {{"schedule"}, {"get", "set"}},
      {{"schedule", "get"}, {"--history"}},
      {{"schedule", "set"},
       {"--cyclic-bits", "--cyclic-periods", "--grad-bits", "--static", "--format", "--rounding",
        "--drop-override", "--keep-fp32", "--hysteresis", "--allreduce-layer-format", "--from-step",
        "--expect-version"}},
      {{"export"}, {"--csv", "--from", "--to"}},
      {{"plot"}, {"--out", "--from", "--to"}}};
  for (const auto& [cmd, words] : cases) {
    std::vector<std::string> args = cmd;
    args.push_back("--help");
    const RunResult r = Ctl(args, {}, false);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    for (const auto& w : global) EXPECT_NE(r.out.find(w), std::string::npos) << w;
    for (const auto& w : words) EXPECT_NE(r.out.find(w), std::string::npos) << w;
  }
  const RunResult v = Ctl({"--version"}, {}, false);
  EXPECT_EQ(v.exit_code, 0);
  EXPECT_EQ(v.out.rfind("cpdctl ", 0), 0u);
}

// Range errors say in words what is accepted, in a short line (they printed CLI11's double
// range, "Value -1 not in range 0.000000 to 1797693134862..."); a --coordinator that is not
// HOST:PORT is a usage error before any call.
TEST(CpdctlUsage, RangeErrorsAndAddressesSayWhatIsAccepted) {
  const std::string bin = BuiltProgram(CPDCTL_PATH);
  for (const auto& [args, accepted] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--timeout", "-1", "jobs"}, "a number > 0"},
           {{"jobs", "--timeout", "0"}, "a number > 0"},
           {{"layers", "j", "--top", "0"}, "a whole number >= 1"},
           {{"layers", "j", "--step", "-2"}, "a whole number >= 0"},
           {{"jobs", "--coordinator", "nohostport"}, "expected HOST:PORT"}}) {
    const cpd::test::RunResult r = cpd::test::RunProgram(bin, args);
    EXPECT_EQ(r.exit_code, 2) << args[0] << " " << args[1] << "\n" << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find(accepted), std::string::npos) << r.err;
    EXPECT_LT(r.err.size(), 100u) << r.err;
  }
}

// A token gRPC refuses as a metadata value (a tab, a control byte, a non-ASCII byte) aborted
// cpdctl with SIGABRT before any connection, gRPC's log line printing "Bearer <token>". It is one
// line naming the file and the column, exit 2, from the flag and from CPD_TOKEN_FILE alike.
TEST(CpdctlUsage, TokenFileWithBytesGrpcRefusesIsOneLineWithoutTheToken) {
  TempDir dir("cpdctl_token");
  const std::string bin = BuiltProgram(CPDCTL_PATH);
  const std::string dead = "127.0.0.1:" + std::to_string(ClosedPort());
  const std::vector<BadTokenFile> cases = BadTokenFiles();
  const std::vector<std::string> paths = WriteBadTokenFiles(dir.path());
  for (size_t i = 0; i < cases.size(); ++i) {
    for (std::vector<std::string> args : {std::vector<std::string>{"jobs"},
                                          {"status", "job1"},
                                          {"schedule", "set", "job1", "--grad-bits", "6"}}) {
      args.insert(args.end(), {"--coordinator", dead, "--timeout", "5", "--token-file", paths[i]});
      ExpectTokenRefused(RunProgram(bin, args), "cpdctl", paths[i], cases[i]);
    }
  }
  ASSERT_EQ(setenv("CPD_TOKEN_FILE", paths[0].c_str(), 1), 0);
  const cpd::test::RunResult r = RunProgram(bin, {"jobs", "--coordinator", dead});
  unsetenv("CPD_TOKEN_FILE");
  ExpectTokenRefused(r, "cpdctl", paths[0], cases[0]);
  EXPECT_NE(r.err.find("CPD_TOKEN_FILE"), std::string::npos) << r.err;
}

// A --tls-ca that is not a PEM certificate went to gRPC, which logged five lines and failed the
// call; it is checked first: one line naming the file and what is expected, exit 2.
TEST(CpdctlUsage, BadTlsCaIsOneLineBeforeGrpcSeesIt) {
  TempDir dir("cpdctl_tls_ca");
  const std::string bin = BuiltProgram(CPDCTL_PATH);
  const std::string dead = "127.0.0.1:" + std::to_string(ClosedPort());
  const std::string text = dir.File("text.pem"), garbage = dir.File("garbage.pem"),
                    key = dir.File("key.pem");
  std::ofstream(text) << "not a certificate\n";
  std::ofstream(garbage) << "-----BEGIN CERTIFICATE-----\n!!garbage!!\n-----END CERTIFICATE-----\n";
  std::ofstream(key) << "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n";
  for (const auto& [path, why] : std::vector<std::pair<std::string, std::string>>{
           {text, "no '-----BEGIN CERTIFICATE-----' line"},
           {garbage, "not base64"},
           {key, "no '-----BEGIN CERTIFICATE-----' line"},
           {dir.path(), "cannot read"},
           {dir.File("missing.pem"), "cannot read"}}) {
    const cpd::test::RunResult r =
        RunProgram(bin, {"jobs", "--coordinator", dead, "--timeout", "5", "--tls-ca", path});
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_EQ(r.err.rfind("cpdctl: --tls-ca " + path + ": ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(why), std::string::npos) << r.err;
  }
}

}  // namespace
}  // namespace cpd::test
