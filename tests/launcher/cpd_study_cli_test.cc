// cpd-study as a user runs it (CPD_STUDY_PATH; cpd-train next to it): every study-file error is
// one line and exit 2 with nothing written; the plan's names, exclusions and stability; real
// runs under mpirun (2 ranks) and directly (1 rank) with their files; re-running skips finished
// runs, resumes an interrupted one from its checkpoints and retries a failed one only when asked;
// status; the report against statistics computed by hand from metrics written here; the plots.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/subprocess.h"
#include "tests/temp_dir.h"

#if !defined(CPD_STUDY_PATH) || !defined(CPD_PLOT_PYTHON)
#error "CPD_STUDY_PATH and CPD_PLOT_PYTHON must be defined"
#endif

namespace cpd::test {
namespace {

bool Exists(const std::string& p) { return access(p.c_str(), F_OK) == 0; }

void Write(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << text;
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

RunResult Study(std::vector<std::string> args) {
  return RunProgram(BuiltProgram(CPD_STUDY_PATH), args);
}

bool HaveMpirun() { return std::system("command -v mpirun > /dev/null 2>&1") == 0; }

// A CSV as rows of name -> cell.
std::vector<std::map<std::string, std::string>> ReadCsv(const std::string& path) {
  std::vector<std::map<std::string, std::string>> rows;
  std::vector<std::string> header;
  for (const std::string& line : Lines(ReadFile(path))) {
    std::vector<std::string> cells;
    std::stringstream s(line);
    for (std::string c; std::getline(s, c, ',');) cells.push_back(c);
    if (line.back() == ',') cells.push_back("");
    if (header.empty()) {
      header = cells;
      continue;
    }
    std::map<std::string, std::string> row;
    for (size_t i = 0; i < header.size() && i < cells.size(); ++i) row[header[i]] = cells[i];
    rows.push_back(row);
  }
  return rows;
}

nlohmann::json State(const std::string& out, const std::string& run) {
  return nlohmann::json::parse(ReadFile(out + "/runs/" + run + "/state.json"));
}

// A run's lock held as the run-one that runs it holds it (an OFD lock on <run>/.lock), for as
// long as this object lives: to the tool, another process runs the run.
class HeldLock {
 public:
  explicit HeldLock(const std::string& run_dir) {
    std::filesystem::create_directories(run_dir);
    fd_ = open((run_dir + "/.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    struct flock l {};
    l.l_type = F_WRLCK;
    l.l_whence = SEEK_SET;
    held_ = fd_ >= 0 && fcntl(fd_, F_OFD_SETLK, &l) == 0;
  }
  ~HeldLock() {
    if (fd_ >= 0) close(fd_);
  }
  bool held() const { return held_; }

 private:
  int fd_ = -1;
  bool held_ = false;
};

// A tiny training run: an MLP on the synthetic data set, a few steps.
const char* kTinyBase = R"(base:
  arch: mlp
  dataset: synthetic
  epochs: 1
  threads: 1
  allreduce: emulate
  stats-every: 1
)";

TEST(CpdStudyCli, EveryStudyFileErrorIsOneLineAndExitTwo) {
  TempDir dir("cpd_study_errors");
  const std::string grid = "grid:\n  lr: [0.1]\n";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"name: s\ngrids:\n  lr: [0.1]\n", "unknown key 'grids'"},
      {"name: 'a b'\n" + grid, "name:"},
      {grid, "name:"},
      {"name: s\n", "grid: missing"},
      {"name: s\nranks: 0\n" + grid, "ranks"},
      {"name: s\nbase:\n  archh: mlp\n" + grid, "--archh"},
      {"name: s\ngrid:\n  bogus: [1]\n", "'bogus'"},
      {"name: s\ngrid: {}\n", "grid:"},
      {"name: s\ngrid:\n  lr: []\n", "grid: 'lr'"},
      {"name: s\nbase:\n  metrics-out: m.jsonl\n" + grid, "cpd-study sets --metrics-out"},
      {"name: s\ngrid:\n  resume: [auto]\n", "cpd-study sets --resume"},
      {"name: s\ngrid:\n  seed: [1, 2]\n", "seeds:"},
      {"name: s\nbase:\n  lr: 0.1\n" + grid, "also in base"},
      {"name: s\ngrid:\n  optimizer: [sgd, adam]\n", "run optimizer_adam.seed_1"},
      {"name: s\ngrid:\n  epochs: [1, abc]\n", "key 'epochs'"},
      {"name: s\ngrid:\n  aps: [maybe]\n", "true or false"},
      {"name: s\nbase:\n  lr: {a: 1}\n" + grid,
       "base: 'lr': expected a scalar or a list of scalars"},
      {"name: s\ngrid:\n  cyclic-bits: [[3, [8]]]\n", "expected a scalar or a list of scalars"},
      {"name: s\nbase:\n  lr: []\n" + grid, "base: 'lr': an empty list"},
      {"name: s\nranks: 2\ngrid:\n  workers: [3]\n", "do not divide over ranks 2"},
      {"name: s\nranks: 2\ngrid:\n  global-batch: [100]\n  workers: [8]\n",
       "global-batch 100 does not split evenly over 8 workers"},
      {"name: s\ngrid:\n  workers: [2]\n  emulate-ranks: [1]\n", "exclude each other"},
      {"name: s\ngrid:\n  keep-fp32: ['a/b', 'a:b']\n", "repeats a value"},
      {"name: s\n" + grid + "seeds: [1, 1]\n", "listed twice"},
      {"name: s\n" + grid + "seeds: []\n", "seeds:"},
      {"name: s\n" + grid + "exclude:\n  - {momentum: 0.9}\n", "not an axis"},
      {"name: s\n" + grid + "exclude:\n  - {lr: 0.2}\n", "not one of its values"},
      {"name: s\n" + grid + "exclude:\n  - {lr: 0.1}\n", "every run"},
      {"name: s\ngrid: [unclosed\n", "study.yaml"},
      // Issue 26 items 2 and 9: plan refuses what the run would (cpd-train's checks of values,
      // which used to run only after MPI started), and bounds threads as cpd-train does.
      {"name: s\nbase:\n  lr: -1\ngrid:\n  momentum: [0.9]\n", "--lr -1 is not accepted"},
      {"name: s\nbase:\n  momentum: -5\n" + grid, "--momentum -5 is not accepted"},
      {"name: s\nbase:\n  bucket-mb: 0\n" + grid, "--bucket-mb 0 is not accepted"},
      {"name: s\ngrid:\n  threads: [2, 99999]\n",
       "run threads_99999.seed_1: key 'threads': --threads"},
      // Issue 26 item 4: a name is one folder of its own, never "." or ".." (the runs and the
      // report would land in an existing folder).
      {"name: ..\n" + grid, "name: '..' is not a folder name of its own"},
      {"name: .\n" + grid, "name: '.' is not a folder name of its own"},
      {"name: a/b\n" + grid, "name:"},
      {"name: ''\n" + grid, "name:"},
      {"name: \"a\\tb\"\n" + grid, "name:"},
      // Item 6: a key repeated in any mapping is named with its line, never resolved silently.
      {"name: s\ngrid:\n  lr: [0.1]\n  lr: [0.2]\n",
       "line 4: key 'lr' is repeated (first at line 3)"},
      {"name: s\nbase:\n  arch: mlp\n  arch: lenet5\n" + grid,
       "line 4: key 'arch' is repeated (first at line 3)"},
      {"name: s\n" + grid + "name: t\n", "line 4: key 'name' is repeated (first at line 1)"},
      {"name: s\n" + grid + "exclude:\n  - {lr: 0.1, lr: 0.1}\n",
       "line 5: key 'lr' is repeated (first at line 5)"},
      {"name: s\ngrid:\n  lr: [0.1]\ngrid:\n  lr: [0.2]\n", "key 'grid' is repeated"},
      // The parser's message quotes the bad byte: escaped, one line (found by study_file_fuzz).
      {std::string("name: \"a\\\x01") + "z\"\n" + grid, "unknown escape character: \\x01"},
      // Item 9: a run that trains nothing would end "done" with 0 epochs.
      {"name: s\nbase:\n  print-model: true\n" + grid, "'print-model': cpd-train --print-model"},
      {"name: s\ngrid:\n  print-model: [false, true]\n", "trains nothing"},
  };
  const std::string study = dir.File("study.yaml"), out = dir.File("out");
  for (const auto& [yaml, needle] : cases) {
    Write(study, yaml);
    for (const char* cmd : {"plan", "run", "status", "report"}) {
      const RunResult r = Study({cmd, study, "--out", out});
      EXPECT_EQ(r.exit_code, 2) << cmd << "\n" << yaml << r.err;
      EXPECT_NE(r.err.find(needle), std::string::npos) << yaml << r.err;
      EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    }
  }
  const RunResult missing = Study({"plan", dir.File("nope.yaml")});
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_NE(missing.err.find("nope.yaml"), std::string::npos) << missing.err;
  EXPECT_FALSE(Exists(out)) << "nothing may be written for a bad study";
}

const char* kPaperStudy = R"(name: aps-large-batch
ranks: 2
base:
  arch: lenet5
  epochs: 10
  optimizer: lars
  allreduce: emulate
grid:
  global-batch: [512, 2048, 8192]
  workers: [8, 32, 64]
  allreduce-format: [fp32, e5m2, e4m3, e3m0]
  aps: [false, true]
seeds: [1, 2, 3]
exclude:
  - {allreduce-format: fp32, aps: true}
)";

std::map<std::string, std::string> PlanLines(const std::string& out) {
  std::map<std::string, std::string> m;
  for (const std::string& l : Lines(out)) m[l.substr(0, l.find('\t'))] = l.substr(l.find('\t') + 1);
  return m;
}

// Issue 17's APS study: the all-reduce's APS scaling is an axis like any cpd-train flag, and a
// value cpd-train would refuse (sum with emulate, an unknown name) is refused at plan time.
TEST(CpdStudyCli, ApsScalingIsAnAxis) {
  TempDir dir("cpd_study_aps");
  Write(dir.File("s.yaml"), R"(name: aps-packed
ranks: 1
base:
  arch: lenet5
  allreduce: packed
  aps: true
grid:
  workers: [8, 64]
  allreduce-format: [e3m0, e2m1, e4m3]
  aps-scaling: [paper, sum]
seeds: [1, 2]
)");
  const RunResult r = Study({"plan", dir.File("s.yaml"), "--out", dir.File("o")});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto plan = PlanLines(r.out);
  EXPECT_EQ(plan.size(), 2u * 3 * 2 * 2);
  const std::string name = "workers_64.allreduce-format_e3m0.aps-scaling_sum.seed_2";
  ASSERT_TRUE(plan.count(name)) << r.out.substr(0, 400);
  EXPECT_NE(plan.at(name).find("--aps-scaling sum"), std::string::npos) << plan.at(name);
  EXPECT_NE(plan.at("workers_8.allreduce-format_e2m1.aps-scaling_paper.seed_1")
                .find("--aps-scaling paper"),
            std::string::npos);
  for (const char* bad : {"[paper, headroom]", "[sum]\nbase:\n  allreduce: emulate"}) {
    SCOPED_TRACE(bad);
    std::string yaml = std::string("name: b\ngrid:\n  aps-scaling: ") + bad + "\n";
    Write(dir.File("b.yaml"), yaml);
    const RunResult e = Study({"plan", dir.File("b.yaml"), "--out", dir.File("o")});
    EXPECT_EQ(e.exit_code, 2) << e.out;
    EXPECT_NE(e.err.find("--aps-scaling"), std::string::npos) << e.err;
    EXPECT_EQ(std::count(e.err.begin(), e.err.end(), '\n'), 1) << e.err;
  }
}

TEST(CpdStudyCli, PlanExpandsTheGridWithStableNamesAndExclusions) {
  TempDir dir("cpd_study_plan");
  Write(dir.File("s.yaml"), kPaperStudy);
  const RunResult r = Study({"plan", dir.File("s.yaml"), "--out", dir.File("o")});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto plan = PlanLines(r.out);
  EXPECT_EQ(plan.size(), 3u * 3 * 4 * 2 * 3 - 3 * 3 * 3);  // the fp32 x APS runs are excluded
  EXPECT_EQ(Lines(r.out).size(), plan.size()) << "names are unique";
  const std::string name = "global-batch_2048.workers_32.allreduce-format_e4m3.aps_on.seed_2";
  ASSERT_TRUE(plan.count(name)) << r.out.substr(0, 400);
  const std::string& cmd = plan.at(name);
  for (const char* part :
       {"mpirun -np 2 ", "--emulate-ranks 16", " --aps ", "--seed 2", "--global-batch 2048",
        "--allreduce-format e4m3", "--optimizer lars", "--resume auto", "--metrics-out"}) {
    EXPECT_NE(cmd.find(part), std::string::npos) << part << " in " << cmd;
  }
  EXPECT_NE(cmd.find("--checkpoint-dir " + dir.File("o") + "/runs/" + name + "/checkpoints"),
            std::string::npos);
  EXPECT_EQ(
      plan.at("global-batch_512.workers_8.allreduce-format_e4m3.aps_off.seed_1").find("--aps"),
      std::string::npos);
  for (const auto& [n, c] : plan) {
    EXPECT_EQ(n.find("allreduce-format_fp32.aps_on"), std::string::npos) << n;
    EXPECT_EQ(
        n.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-"),
        std::string::npos);
  }

  // More values and seeds: every existing run keeps its name and its command.
  std::string more = kPaperStudy;
  more.replace(more.find("[512, 2048, 8192]"), 17, "[256, 512, 2048, 8192]");
  more.replace(more.find("[1, 2, 3]"), 9, "[1, 2, 3, 4]");
  Write(dir.File("more.yaml"), more);
  const RunResult r2 = Study({"plan", dir.File("more.yaml"), "--out", dir.File("o")});
  ASSERT_EQ(r2.exit_code, 0) << r2.err;
  const auto plan2 = PlanLines(r2.out);
  EXPECT_EQ(plan2.size(), 4u * 3 * 7 * 4);
  for (const auto& [n, c] : plan) {
    ASSERT_TRUE(plan2.count(n)) << n;
    EXPECT_EQ(plan2.at(n), c);
  }

  const RunResult j = Study({"plan", dir.File("s.yaml"), "--json", "--out", dir.File("o")});
  ASSERT_EQ(j.exit_code, 0) << j.err;
  const auto doc = nlohmann::json::parse(j.out);
  ASSERT_EQ(doc.size(), plan.size());
  EXPECT_EQ(doc[0]["index"], 0);
  EXPECT_EQ(doc[0]["name"], "global-batch_512.workers_8.allreduce-format_fp32.aps_off.seed_1");
  EXPECT_EQ(doc[0]["axes"]["workers"], "8");
  EXPECT_EQ(doc[0]["flags"]["emulate-ranks"], "4");
  EXPECT_EQ(doc[1]["seed"], 2);
  EXPECT_FALSE(Exists(dir.File("o"))) << "plan writes nothing";
}

TEST(CpdStudyCli, PlansATenThousandRunGrid) {
  TempDir dir("cpd_study_big");
  Write(dir.File("s.yaml"),
        "name: big\nbase:\n  arch: mlp\ngrid:\n"
        "  lr: [0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09, 0.1]\n"
        "  momentum: [0.8, 0.81, 0.82, 0.83, 0.84, 0.85, 0.86, 0.87, 0.88, 0.89]\n"
        "  batch-size: [8, 16, 24, 32, 40, 48, 56, 64, 72, 80]\n"
        "  allreduce-format: [e4m3, e5m2, e3m4, e2m5, e3m2, e2m3, e4m2, e2m1, e3m0, fp32]\n"
        "seeds: [7]\n");
  const RunResult r = Study({"plan", dir.File("s.yaml")});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(Lines(r.out).size(), 10000u);
  EXPECT_EQ(PlanLines(r.out).size(), 10000u);
}

TEST(CpdStudyCli, RunsUnderMpirunThenSkipsFinishedRunsAndReports) {
  if (!HaveMpirun()) GTEST_SKIP() << "no mpirun";
  TempDir dir("cpd_study_run");
  const std::string out = dir.File("out");
  Write(dir.File("s.yaml"), std::string("name: tiny\nranks: 2\n") + kTinyBase +
                                "  max-steps: 4\ngrid:\n  global-batch: [32, 64]\n"
                                "  aps: [false, true]\n");
  const RunResult r = Study({"run", dir.File("s.yaml"), "--out", out, "--parallel", "2"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("4 of 4 runs done, 0 failed"), std::string::npos) << r.out;
  size_t starts = 0;
  for (const auto& l : Lines(r.out)) starts += l.find("] start ") != std::string::npos;
  EXPECT_EQ(starts, 4u);
  const std::string run = "global-batch_64.aps_on.seed_1", rd = out + "/runs/" + run;
  for (const char* f : {"cmd.txt", "config.yaml", "metrics.jsonl", "log.txt", "state.json"}) {
    EXPECT_TRUE(Exists(rd + "/" + f)) << f;
  }
  EXPECT_FALSE(std::filesystem::is_empty(rd + "/checkpoints"));
  const std::string cmd = ReadFile(rd + "/cmd.txt");
  EXPECT_EQ(cmd.rfind("mpirun -np 2 ", 0), 0u) << cmd;
  EXPECT_NE(cmd.find("--config " + rd + "/config.yaml"), std::string::npos) << cmd;
  EXPECT_NE(ReadFile(rd + "/config.yaml").find("aps: \"true\""), std::string::npos);
  EXPECT_NE(ReadFile(rd + "/log.txt").find("2 rank(s) x 1 worker(s)"), std::string::npos);
  // Logs for people and for grep: cpd-train under mpirun writes to a pseudo-terminal that Open
  // MPI opens, and its progress must still be plain lines (at most 10 an epoch), no '\r'.
  EXPECT_EQ(r.out.find('\r'), std::string::npos) << r.out;
  const std::string run_log = ReadFile(rd + "/log.txt");
  EXPECT_EQ(run_log.find('\r'), std::string::npos) << run_log;
  size_t progress_lines = 0;
  for (const auto& l : Lines(run_log)) progress_lines += l.rfind("  epoch 1/", 0) == 0;
  EXPECT_LE(progress_lines, 10u) << run_log;
  const auto st = State(out, run);
  EXPECT_EQ(st["state"], "done");
  EXPECT_EQ(st["exit_code"], 0);
  EXPECT_EQ(st["attempts"], 1);
  EXPECT_GT(st["wall_s"].get<double>(), 0);

  // Again: nothing runs, nothing a finished run wrote changes.
  const std::string metrics = ReadFile(rd + "/metrics.jsonl"), state = ReadFile(rd + "/state.json");
  const RunResult again = Study({"run", dir.File("s.yaml"), "--out", out});
  ASSERT_EQ(again.exit_code, 0) << again.out << again.err;
  EXPECT_NE(again.out.find("4 done, 0 diverged, 0 failed (not retried), 0 running elsewhere, 0 "
                           "unreadable, 0 to run"),
            std::string::npos)
      << again.out;
  EXPECT_EQ(ReadFile(rd + "/metrics.jsonl"), metrics);
  EXPECT_EQ(ReadFile(rd + "/state.json"), state);
  const RunResult one = Study({"run-one", dir.File("s.yaml"), "--index", "3", "--out", out});
  EXPECT_EQ(one.exit_code, 0) << one.err;
  EXPECT_NE(one.out.find("already done"), std::string::npos);
  EXPECT_EQ(ReadFile(rd + "/state.json"), state);

  const RunResult status = Study({"status", dir.File("s.yaml"), "--out", out});
  EXPECT_EQ(status.exit_code, 0);
  EXPECT_NE(status.out.find("4 runs: 4 done, 0 diverged, 0 running, 0 failed, 0 interrupted, 0 "
                            "pending"),
            std::string::npos)
      << status.out;

  const RunResult rep = Study({"report", dir.File("s.yaml"), "--out", out, "--no-plot"});
  ASSERT_EQ(rep.exit_code, 0) << rep.err;
  const auto rows = ReadCsv(out + "/report/runs.csv");
  ASSERT_EQ(rows.size(), 4u);
  for (const auto& row : rows) {
    EXPECT_EQ(row.at("state"), "done");
    EXPECT_FALSE(row.at("final_test_accuracy").empty());
    EXPECT_FALSE(row.at("mean_allreduce_flushed").empty()) << "2 workers: all-reduce statistics";
  }
  EXPECT_EQ(rows[3].at("aps"), "on");
  EXPECT_GT(std::stod(rows[3].at("mean_aps_shift")), 0) << "APS shifts the gradients up";
  EXPECT_EQ(std::stod(rows[2].at("mean_aps_shift")), 0);
  const auto layers = ReadCsv(out + "/report/layers.csv");
  ASSERT_EQ(layers.size() % 4, 0u) << "every run has its layers";
  EXPECT_GE(layers.size(), 4u * 2);
  EXPECT_EQ(layers[0].at("layer"), "fc1");
}

// The process `args` started in a new process group (so that the test can kill it and all its
// children at once, like a node going away).
pid_t StartGroup(const std::vector<std::string>& args, const std::string& log) {
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    FILE* f = freopen(log.c_str(), "w", stdout);
    (void)f;
    std::vector<std::string> copy = args;
    std::vector<char*> argv;
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  setpgid(pid, pid);
  return pid;
}

// `run --progress off`: no line per start or end, a failure still shown, the summary always;
// no bar is offered (the lines are already one per event).
TEST(CpdStudyCli, ProgressOffKeepsFailuresAndTheSummary) {
  TempDir dir("cpd_study_progress");
  const std::string out = dir.File("out");
  // Two runs: synthetic data (done), and MNIST from a folder that does not exist (failed).
  Write(dir.File("s.yaml"),
        "name: quiet\nbase:\n  arch: mlp\n  epochs: 1\n  threads: 1\n  max-steps: 2\n"
        "  data-dir: " +
            dir.File("no-data") + "\ngrid:\n  dataset: [synthetic, mnist]\n");
  const RunResult r = Study({"run", dir.File("s.yaml"), "--out", out, "--progress", "off"});
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;  // the mnist run finds no data
  size_t starts = 0, dones = 0, failed = 0;
  for (const auto& l : Lines(r.out)) {
    starts += l.find("] start ") != std::string::npos;
    dones += l.find("] done  ") != std::string::npos;
    failed += l.find("] FAILED ") != std::string::npos;
  }
  EXPECT_EQ(starts, 0u) << r.out;
  EXPECT_EQ(dones, 0u) << r.out;
  EXPECT_EQ(failed, 1u) << r.out;
  EXPECT_NE(r.out.find("quiet: 1 of 2 runs done, 1 failed"), std::string::npos) << r.out;
  const RunResult bar = Study({"run", dir.File("s.yaml"), "--out", out, "--progress", "bar"});
  EXPECT_EQ(bar.exit_code, 2) << bar.err;
  EXPECT_NE(bar.err.find("--progress"), std::string::npos) << bar.err;
}

TEST(CpdStudyCli, AnInterruptedRunResumesFromItsCheckpoints) {
  TempDir dir("cpd_study_resume");
  const std::string out = dir.File("out"), run = "max-steps_40.seed_1";
  const std::string rd = out + "/runs/" + run;
  Write(dir.File("s.yaml"), std::string("name: resume\n") + kTinyBase +
                                "  checkpoint-every: 4\n  debug-step-sleep-ms: 60\n"
                                "grid:\n  max-steps: [40]\n");
  const pid_t pid =
      StartGroup({BuiltProgram(CPD_STUDY_PATH), "run", dir.File("s.yaml"), "--out", out},
                 dir.File("driver.log"));
  // Killed once it has checkpointed at least step 8, long before step 40.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!Exists(rd + "/checkpoints/ckpt-000000000008.cpd") &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(Exists(rd + "/checkpoints/ckpt-000000000008.cpd")) << ReadFile(rd + "/log.txt");
  kill(-pid, SIGKILL);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_EQ(State(out, run)["state"], "running");
  const RunResult st = Study({"status", dir.File("s.yaml"), "--out", out});
  EXPECT_NE(st.out.find("interrupted"), std::string::npos) << st.out;
  EXPECT_NE(st.out.find("1 interrupted"), std::string::npos) << st.out;

  const RunResult r = Study({"run", dir.File("s.yaml"), "--out", out});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err << ReadFile(rd + "/log.txt");
  const auto s = State(out, run);
  EXPECT_EQ(s["state"], "done");
  EXPECT_EQ(s["attempts"], 2);
  // Issue 26 item 14: the killed attempt's time counts too (it ran 8 steps of 60 ms at least,
  // until its last write), not only the second attempt's.
  EXPECT_GT(s["total_wall_s"].get<double>(), s["wall_s"].get<double>() + 0.4) << s.dump();
  EXPECT_NE(ReadFile(rd + "/log.txt").find("resumed from " + rd + "/checkpoints/ckpt-"),
            std::string::npos);
  // The second attempt continued from a checkpoint of step >= 8: every step 0..39 is in the
  // metrics, and none before that checkpoint was trained twice.
  const std::string log = ReadFile(rd + "/log.txt");
  const size_t at = log.find(" at step ", log.find("resumed from "));
  ASSERT_NE(at, std::string::npos) << log;
  const long long resumed = std::stoll(log.substr(at + 9));
  EXPECT_GE(resumed, 8);
  EXPECT_LT(resumed, 40);
  std::map<long long, int> seen;
  for (const auto& l : Lines(ReadFile(rd + "/metrics.jsonl"))) {
    const auto j = nlohmann::json::parse(l, nullptr, false);
    if (!j.is_discarded() && j.value("type", "") == "step") ++seen[j["step"].get<long long>()];
  }
  ASSERT_EQ(seen.size(), 40u);
  EXPECT_EQ(seen.begin()->first, 0);
  EXPECT_EQ(seen.rbegin()->first, 39);
  for (const auto& [step, n] : seen) {
    if (step < resumed) {
      EXPECT_EQ(n, 1) << "step " << step << " trained again";
    }
  }
}

TEST(CpdStudyCli, StatusAndAFailedRunRetriedOnlyWhenAsked) {
  TempDir dir("cpd_study_status");
  const std::string out = dir.File("out");
  // Runs that fail: their data folder does not exist (cpd-train exit 1).
  Write(dir.File("s.yaml"),
        "name: st\nbase:\n  arch: mlp\n  dataset: fashion-mnist\n"
        "  data-dir: " +
            dir.File("no-data") +
            "\n  epochs: 1\n  threads: 1\n"
            "grid:\n  lr: [0.1, 0.2, 0.3, 0.4, 0.5]\n");
  auto name = [](const char* d) {
    const std::map<std::string, std::string> lr = {
        {"a", "0.1"}, {"b", "0.2"}, {"c", "0.3"}, {"d", "0.4"}, {"e", "0.5"}};
    return "lr_" + lr.at(d) + ".seed_1";
  };
  const RunResult r = Study({"run-one", dir.File("s.yaml"), "--out", out, "--index", "0"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(State(out, name("a"))["state"], "failed");
  // b: done; c: running (its lock held, as the run-one that runs it holds it); d: interrupted
  // although its state names a live process (this test: a pid alone proves nothing, issue 26
  // item 14); e: pending.
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  auto state = [&](const char* d, const std::string& s, long pid) {
    Write(out + "/runs/" + name(d) + "/state.json",
          nlohmann::json({{"state", s},
                          {"exit_code", s == "done" ? 0 : -1},
                          {"host", host},
                          {"pid", pid},
                          {"attempts", 1},
                          {"total_wall_s", 2.5}})
              .dump());
  };
  state("b", "done", 0);
  state("c", "running", long(getpid()));
  state("d", "running", long(getpid()));
  auto c_lock = std::make_unique<HeldLock>(out + "/runs/" + name("c"));
  ASSERT_TRUE(c_lock->held());
  const RunResult st = Study({"status", dir.File("s.yaml"), "--out", out});
  ASSERT_EQ(st.exit_code, 0) << st.err;
  const auto lines = Lines(st.out);
  ASSERT_EQ(lines.size(), 6u) << st.out;
  EXPECT_EQ(lines[0].rfind("failed", 0), 0u) << lines[0];
  EXPECT_NE(lines[0].find("exit 1: "), std::string::npos) << lines[0];
  EXPECT_EQ(lines[1].rfind("done", 0), 0u) << lines[1];
  EXPECT_EQ(lines[2].rfind("running", 0), 0u) << lines[2];
  EXPECT_NE(lines[2].find("pid " + std::to_string(getpid())), std::string::npos) << lines[2];
  EXPECT_EQ(lines[3].rfind("interrupted", 0), 0u) << lines[3];
  EXPECT_EQ(lines[4].rfind("pending", 0), 0u) << lines[4];
  EXPECT_EQ(lines[5],
            "st: 5 runs: 1 done, 0 diverged, 1 running, 1 failed, 1 interrupted, 1 pending");

  // run: the failed run is not retried, the running one is left alone; d (resumed: never
  // blocked by the live pid) and e run (and fail).
  const RunResult run = Study({"run", dir.File("s.yaml"), "--out", out});
  EXPECT_EQ(run.exit_code, 1) << run.out;
  EXPECT_NE(run.out.find("1 done, 0 diverged, 1 failed (not retried), 1 running elsewhere, "
                         "0 unreadable, 2 to run"),
            std::string::npos)
      << run.out;
  EXPECT_NE(run.out.find("FAILED " + name("d") + " (exit 1)"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("FAILED " + name("e") + " (exit 1)"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("--retry-failed runs them again"), std::string::npos) << run.out;
  EXPECT_EQ(State(out, name("a"))["attempts"], 1);
  EXPECT_EQ(State(out, name("d"))["attempts"], 2);
  c_lock.reset();
  state("c", "done", 0);
  const RunResult retry = Study({"run", dir.File("s.yaml"), "--out", out, "--retry-failed"});
  EXPECT_EQ(retry.exit_code, 1);
  EXPECT_NE(retry.out.find("3 to run"), std::string::npos) << retry.out;
  EXPECT_EQ(State(out, name("a"))["attempts"], 2);
}

// Issue 26 item 14: a corrupt state file is the same one line (the file, "unreadable", what to
// do) for run, status and report, never the JSON library's text; it stops only its own run.
TEST(CpdStudyCli, ACorruptStateFileIsOneLineEverywhere) {
  TempDir dir("cpd_study_corrupt");
  const std::string out = dir.File("out");
  Write(dir.File("s.yaml"),
        std::string("name: c\n") + kTinyBase + "  max-steps: 2\ngrid:\n  lr: [0.1, 0.2]\n");
  const std::string bad = out + "/runs/lr_0.1.seed_1/state.json";
  Write(bad, "{\"state\": \"runn\x01ing\", garbage");
  const std::string line = bad +
                           ": unreadable state file (not a JSON object); remove it to run "
                           "the run again (it resumes from its checkpoints)";
  const RunResult run = Study({"run", dir.File("s.yaml"), "--out", out});
  EXPECT_EQ(run.exit_code, 1) << run.out << run.err;
  EXPECT_NE(run.err.find("cpd-study: " + line + "\n"), std::string::npos) << run.err;
  EXPECT_NE(run.out.find("1 of 2 runs done"), std::string::npos) << run.out;
  EXPECT_EQ(State(out, "lr_0.2.seed_1")["state"], "done");
  const RunResult st = Study({"status", dir.File("s.yaml"), "--out", out});
  EXPECT_EQ(st.exit_code, 1);
  EXPECT_EQ(st.err, "cpd-study: " + line + "\n");
  EXPECT_NE(st.out.find("unreadable  lr_0.1.seed_1"), std::string::npos) << st.out;
  const RunResult rep = Study({"report", dir.File("s.yaml"), "--out", out, "--no-plot"});
  EXPECT_EQ(rep.exit_code, 0) << rep.err;
  EXPECT_EQ(rep.err, "cpd-study: warning: " + line + "\n");
  EXPECT_EQ(ReadCsv(out + "/report/runs.csv")[0].at("state"), "unreadable");
  for (const RunResult* r : {&run, &st, &rep}) {
    EXPECT_EQ(r->err.find("json.exception"), std::string::npos) << r->err;
    EXPECT_EQ(r->err.find("parse"), std::string::npos) << r->err;
    EXPECT_EQ(r->err.find('\x01'), std::string::npos) << r->err;
  }
}

// Issue 26 item 14: two drivers on one --out. The one that finds a run's lock held (the other
// runs it) skips it: no FAILED line, no exit 1.
TEST(CpdStudyCli, ARunAnotherDriverOwnsIsSkippedNotFailed) {
  TempDir dir("cpd_study_two_drivers");
  const std::string out = dir.File("out");
  Write(dir.File("s.yaml"),
        std::string("name: two\n") + kTinyBase + "  max-steps: 2\ngrid:\n  lr: [0.1, 0.2]\n");
  // The other driver's run-one has taken run 0's lock and not yet written its state.
  HeldLock other(out + "/runs/lr_0.1.seed_1");
  ASSERT_TRUE(other.held());
  const RunResult run = Study({"run", dir.File("s.yaml"), "--out", out});
  EXPECT_EQ(run.exit_code, 0) << run.out << run.err;
  EXPECT_NE(run.out.find("skip  lr_0.1.seed_1: another cpd-study process runs it"),
            std::string::npos)
      << run.out;
  EXPECT_EQ(run.out.find("FAILED"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("1 of 2 runs done, 0 failed, 0 diverged, 1 running elsewhere"),
            std::string::npos)
      << run.out;
  EXPECT_FALSE(Exists(out + "/runs/lr_0.1.seed_1/state.json")) << "the other driver's run";
  EXPECT_EQ(State(out, "lr_0.2.seed_1")["state"], "done");
}

// Issue 26 item 4: cpd-study writes only into a folder it created (marked by .cpd-study), so a
// user's own ./report/runs.csv is never replaced.
TEST(CpdStudyCli, OutputsNeverReplaceAFileTheToolDidNotCreate) {
  TempDir dir("cpd_study_own");
  Write(dir.File("s.yaml"),
        std::string("name: own\n") + kTinyBase + "  max-steps: 2\ngrid:\n  lr: [0.1]\n");
  const std::string mine = dir.File("mine");
  Write(mine + "/report/runs.csv", "my,own,table\n");
  Write(mine + "/notes.txt", "mine\n");
  for (const char* cmd : {"report", "run", "run-one"}) {
    std::vector<std::string> args = {cmd, dir.File("s.yaml"), "--out", mine, "--no-plot"};
    if (std::string(cmd) != "report") args.pop_back();
    if (std::string(cmd) == "run-one") args.insert(args.end(), {"--index", "0"});
    const RunResult r = Study(args);
    EXPECT_EQ(r.exit_code, 2) << cmd << r.out << r.err;
    EXPECT_NE(r.err.find("--out " + mine +
                         ": the folder exists, is not empty and was not "
                         "created by cpd-study (no .cpd-study in it)"),
              std::string::npos)
        << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
  EXPECT_EQ(ReadFile(mine + "/report/runs.csv"), "my,own,table\n");
  EXPECT_FALSE(Exists(mine + "/runs"));
  EXPECT_FALSE(Exists(mine + "/.cpd-study"));
  // A new folder, and an empty one, become cpd-study's; it then writes there again and again.
  const std::string empty = dir.File("empty");
  std::filesystem::create_directories(empty);
  for (const std::string& o : {dir.File("new"), empty}) {
    const RunResult r = Study({"run", dir.File("s.yaml"), "--out", o});
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_TRUE(Exists(o + "/.cpd-study"));
    EXPECT_EQ(Study({"report", dir.File("s.yaml"), "--out", o, "--no-plot"}).exit_code, 0);
    EXPECT_EQ(Study({"report", dir.File("s.yaml"), "--out", o, "--no-plot"}).exit_code, 0);
  }
  // A file where the folder should be.
  Write(dir.File("file"), "x");
  const RunResult f = Study({"report", dir.File("s.yaml"), "--out", dir.File("file")});
  EXPECT_EQ(f.exit_code, 2);
  EXPECT_NE(f.err.find("exists and is not a folder"), std::string::npos) << f.err;
}

bool HaveMatplotlib() {
  return std::system(
             (std::string(CPD_PLOT_PYTHON) + " -c 'import matplotlib' 2>/dev/null").c_str()) == 0;
}

// Issue 26's acceptance: a study with a diverging setting, two axes and one worker per run
// finishes with exit 0, a readable report and plots (items 11, 12, 13, 14).
TEST(CpdStudyCli, ADivergingStudyWithOneWorkerPerRunFinishesWithAReport) {
  TempDir dir("cpd_study_diverge");
  const std::string out = dir.File("out");
  // Epochs of 4 steps. lr 300 sends the MLP's loss to 1e20 in the first epoch and to NaN at step
  // 4 (one epoch logged); lr 1e4 to NaN at step 3, before any epoch: both exit 3.
  Write(dir.File("s.yaml"),
        "name: div\nbase:\n  arch: mlp\n  dataset: synthetic\n  threads: 1\n  epochs: 2\n"
        "  batch-size: 2048\n  max-steps: 8\ngrid:\n  lr: [0.5, 300, 10000]\n"
        "  momentum: [0, 0.9]\nseeds: [1, 2]\n");
  const RunResult run = Study({"run", dir.File("s.yaml"), "--out", out, "--parallel", "2"});
  EXPECT_EQ(run.exit_code, 0) << run.out << run.err;
  EXPECT_EQ(run.out.find("FAILED"), std::string::npos) << run.out;
  EXPECT_EQ(run.out.find("--retry-failed"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("4 of 12 runs done, 0 failed, 8 diverged"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("] diverged lr_10000.momentum_0.seed_1 at step 3 (loss nan)"),
            std::string::npos)
      << run.out;
  const auto st = State(out, "lr_300.momentum_0.9.seed_2");
  EXPECT_EQ(st["state"], "diverged") << st.dump();
  EXPECT_EQ(st["exit_code"], 3);
  EXPECT_EQ(st.value("diverged_step", -1), 4) << st.dump();
  EXPECT_EQ(st.value("diverged_reason", ""), "the loss is NaN") << st.dump();

  // A diverged run is a result: run again (even with --retry-failed) runs nothing.
  const RunResult again = Study({"run", dir.File("s.yaml"), "--out", out, "--retry-failed"});
  EXPECT_EQ(again.exit_code, 0) << again.out << again.err;
  EXPECT_NE(again.out.find("4 done, 8 diverged, 0 failed (not retried)"), std::string::npos)
      << again.out;
  EXPECT_NE(again.out.find(", 0 to run"), std::string::npos) << again.out;
  EXPECT_EQ(State(out, "lr_300.momentum_0.9.seed_2")["attempts"], 1);
  const RunResult status = Study({"status", dir.File("s.yaml"), "--out", out});
  EXPECT_EQ(status.exit_code, 0) << status.err;
  EXPECT_NE(status.out.find("div: 12 runs: 4 done, 8 diverged, 0 running, 0 failed"),
            std::string::npos)
      << status.out;
  EXPECT_NE(status.out.find("diverged    lr_10000.momentum_0.seed_2  at step 3 (loss nan): the "
                            "loss is NaN"),
            std::string::npos)
      << status.out;

  const bool plots = HaveMatplotlib();
  std::vector<std::string> args = {"report", dir.File("s.yaml"), "--out", out};
  if (!plots) args.push_back("--no-plot");
  const RunResult rep = Study(args);
  ASSERT_EQ(rep.exit_code, 0) << rep.err;
  EXPECT_EQ(rep.err, "") << "every plot drawn, no warning";
  const auto rows = ReadCsv(out + "/report/runs.csv");
  ASSERT_EQ(rows.size(), 12u);
  EXPECT_EQ(rows[0].count("mean_allreduce_flushed"), 0u) << "no all-reduce ran: no column";
  for (const auto& row : rows) {
    const bool diverges = row.at("lr") != "0.5";
    EXPECT_EQ(row.at("state"), diverges ? "diverged" : "done") << row.at("run");
    EXPECT_EQ(row.at("collapsed"), diverges ? "1" : "0") << row.at("run");
    EXPECT_EQ(row.at("diverged_step"), row.at("lr") == "300"     ? "4"
                                       : row.at("lr") == "10000" ? "3"
                                                                 : "")
        << row.at("run");
    EXPECT_EQ(row.at("epochs"), row.at("lr") == "10000" ? "0"
                                : row.at("lr") == "300" ? "1"
                                                        : "2")
        << row.at("run");
  }
  // Every seed of a diverging setting is a result and collapsed, those that diverged before
  // their first epoch too (item 12: "seeds 1, collapsed 1" where all had collapsed).
  const auto sum = ReadCsv(out + "/report/summary.csv");
  ASSERT_EQ(sum.size(), 6u);
  for (const auto& g : sum) {
    EXPECT_EQ(g.at("n_seeds"), "2") << g.at("lr");
    EXPECT_EQ(g.at("n_collapsed"), g.at("lr") == "0.5" ? "0" : "2") << g.at("lr");
    EXPECT_EQ(g.count("allreduce_flushed_mean"), 0u);
  }
  const std::string md = ReadFile(out + "/report/summary.md");
  EXPECT_NE(md.find("| 10000 | 0.9 | 2 | 2 | - | - |"), std::string::npos) << md;
  EXPECT_NE(md.find("| 300 | 0 | 2 | 2 |"), std::string::npos) << md;
  EXPECT_EQ(md.find("flushed %"), std::string::npos) << md;
  const std::string curves = ReadFile(out + "/report/curves.csv");
  EXPECT_NE(curves.find(",diverged\n"), std::string::npos) << curves.substr(0, 200);
  if (!plots) GTEST_SKIP() << "no matplotlib for " << CPD_PLOT_PYTHON << ": tables only";
  // The accuracy plot is named for its x axis (no global-batch here: the first axis).
  for (const char* png : {"accuracy_vs_lr.png", "loss_curves.png", "layer_flushed.png"}) {
    const std::string data = ReadFile(out + "/report/" + png);
    EXPECT_EQ(data.substr(0, 4), "\x89PNG") << png;
    EXPECT_NE(rep.out.find(std::string("wrote ") + out + "/report/" + png), std::string::npos);
  }
  EXPECT_FALSE(Exists(out + "/report/accuracy_vs_batch.png"));
  // Item 13: the loss curves are on a log scale, and the diverged settings say so. The plot
  // function is run with its save replaced by one that reports the figure.
  const std::string script =
      std::filesystem::path(BuiltProgram(CPD_STUDY_PATH)).parent_path().string();
  Write(dir.File("probe.py"), "import sys\nsys.path.insert(0, '" + script +
                                  "')\nimport study_plot as sp\n"
                                  "def save(fig, path):\n"
                                  "    for ax in fig.axes:\n"
                                  "        print('scale', ax.get_yscale())\n"
                                  "    for t in fig.legends[0].get_texts():\n"
                                  "        print('label', t.get_text())\n"
                                  "sp.save = save\n"
                                  "sp.loss_curves('" +
                                  out + "/report', ['lr', 'momentum'], 'x.png')\n");
  const RunResult probe = RunProgram(CPD_PLOT_PYTHON, {dir.File("probe.py")});
  ASSERT_EQ(probe.exit_code, 0) << probe.err;
  EXPECT_NE(probe.out.find("scale log"), std::string::npos) << probe.out;
  EXPECT_EQ(probe.out.find("scale linear"), std::string::npos) << probe.out;
  EXPECT_NE(probe.out.find("label momentum=0 (2 diverged)"), std::string::npos) << probe.out;
}

// Metrics of one run written by hand: epochs (test accuracy, loss), and the all-reduce's
// statistics of some steps.
std::string Epoch(int epoch, double acc, const std::string& loss, int skipped = 0,
                  double cost = 0) {
  return R"({"type":"epoch","epoch":)" + std::to_string(epoch) + R"(,"step":)" +
         std::to_string(10 * epoch) + R"(,"loss":)" + loss + R"(,"train_accuracy":0.5,)" +
         R"("test_accuracy":)" + std::to_string(acc) + R"(,"test_loss":1.0,"images_per_s":100,)" +
         R"("relative_cost":)" + std::to_string(cost) + R"(,"skipped_steps":)" +
         std::to_string(skipped) + "}\n";
}
std::string Step(int step, double shift0, double flushed0, double flushed1) {
  return R"({"bits":0,"comm":[{"flushed":)" + std::to_string(flushed0) +
         R"(,"layer":"fc1","max_abs":1.0,"saturated":0,"shift":)" + std::to_string(shift0) +
         R"(},{"flushed":)" + std::to_string(flushed1) +
         R"(,"layer":"fc2","max_abs":1.0,"saturated":0,"shift":0}],"epoch":0,)" +
         R"("layers":[{"layer":"fc1","site":"A","flushed":0.9}],"loss":1.0,"lr":0.1,)" +
         R"("skipped":false,"step":)" + std::to_string(step) + R"(,"type":"step"})" + "\n";
}

// A step at which fc1 flushed 0.25 with shift 1.5 and fc2's gradient was all zero (max_abs 0,
// reported as flushed 0, shift 0).
std::string ZeroFc2Step(int step) {
  return R"({"comm":[{"flushed":0.25,"layer":"fc1","max_abs":1.0,"saturated":0,"shift":1.5},)"
         R"({"flushed":0,"layer":"fc2","max_abs":0,"saturated":0,"shift":0}],"step":)" +
         std::to_string(step) + R"(,"type":"step"})" + "\n";
}

// Mean and sample standard deviation (n - 1) of `v`.
std::pair<double, double> MeanAndStd(const std::vector<double>& v) {
  double sum = 0, sq = 0;
  for (double x : v) sum += x;
  const double mean = sum / double(v.size());
  for (double x : v) sq += (x - mean) * (x - mean);
  return {mean, v.size() > 1 ? std::sqrt(sq / double(v.size() - 1)) : std::nan("")};
}

// The cells of summary.md's row whose first cell is `first`, trimmed ("" cells for none).
std::vector<std::string> MdRow(const std::string& md, const std::string& first) {
  for (const std::string& line : Lines(md)) {
    if (line.rfind("| " + first + " |", 0) != 0) continue;
    std::vector<std::string> cells;
    std::stringstream s(line.substr(1));
    for (std::string c; std::getline(s, c, '|');) cells.push_back(c.substr(1, c.size() - 2));
    return cells;
  }
  return {};
}

// "39.71 ± 0.18" as {39.71, 0.18}; "+0.00" as {0, NaN}.
std::pair<double, double> PlusMinusCell(const std::string& cell) {
  const size_t pm = cell.find(" ± ");
  return {std::stod(cell), pm == std::string::npos ? std::nan("") : std::stod(cell.substr(pm + 4))};
}

double Cell(const std::map<std::string, std::string>& row, const std::string& column) {
  auto it = row.find(column);
  EXPECT_TRUE(it != row.end()) << "no column " << column;
  return it == row.end() || it->second.empty() ? std::nan("") : std::stod(it->second);
}

// A real study of language models (a tiny GPT on byte-level text, 2 settings x 2 seeds x 2
// epochs): the report's tables carry validation perplexity and bits per byte where accuracy is,
// its summary's means, sample stds and differences to --reference are those of runs.csv, and
// the accuracy plot gives way to the validation per epoch. (The image studies' tables have no
// such column: the tests above pin them.)
TEST(CpdStudyCli, LanguageModelStudyReportsPerplexityAndBitsPerByte) {
  TempDir dir("cpd_study_lm");
  const std::string out = dir.File("out");
  std::string text;
  for (int i = 0; i < 3000; ++i)
    text += (i % 3 == 0 ? "the cat " : i % 3 == 1 ? "sat on " : "a mat\n");
  Write(dir.File("corpus.txt"), text);
  Write(dir.File("s.yaml"),
        "name: lm\nbase:\n  arch: gpt\n  dataset: text\n  data-dir: " + dir.File("corpus.txt") +
            "\n  n-layer: 1\n  n-head: 2\n  n-embd: 16\n  block-size: 16\n  threads: 1\n"
            "  epochs: 2\n  batch-size: 8\n  tokens-per-epoch: 256\ngrid:\n  lr: [0.05, 0.1]\n"
            "seeds: [1, 2]\n");
  const RunResult run = Study({"run", dir.File("s.yaml"), "--out", out, "--parallel", "2"});
  ASSERT_EQ(run.exit_code, 0) << run.out << run.err;
  const bool plots = HaveMatplotlib();
  std::vector<std::string> args = {"report", dir.File("s.yaml"), "--out",
                                   out,      "--reference",      "lr_0.05.*"};
  if (!plots) args.push_back("--no-plot");
  const RunResult rep = Study(args);
  ASSERT_EQ(rep.exit_code, 0) << rep.err;
  EXPECT_EQ(rep.err, "") << "every plot drawn, no warning";
  const auto rows = ReadCsv(out + "/report/runs.csv");
  const auto curves = ReadCsv(out + "/report/curves.csv");
  ASSERT_EQ(rows.size(), 4u);
  ASSERT_EQ(curves.size(), 8u);
  EXPECT_FALSE(curves[0].at("test_bits_per_byte").empty());
  std::map<std::string, std::vector<double>> final_ppl, best_ppl, final_bpb, best_bpb, loss;
  for (const auto& row : rows) {
    const double l = Cell(row, "final_test_loss");
    EXPECT_NEAR(Cell(row, "final_test_perplexity"), std::exp(l), 1e-5 * std::exp(l))
        << row.at("run");
    EXPECT_NEAR(Cell(row, "final_test_bits_per_byte"), l / std::log(2.0), 1e-5) << row.at("run");
    EXPECT_EQ(row.at("classes"), "256");
    // Best: the epoch with the lowest perplexity, among this run's curves.
    double lowest = INFINITY, lowest_bpb = INFINITY;
    for (const auto& c : curves) {
      if (c.at("run") != row.at("run")) continue;
      lowest = std::min(lowest, Cell(c, "test_perplexity"));
      lowest_bpb = std::min(lowest_bpb, Cell(c, "test_bits_per_byte"));
    }
    EXPECT_EQ(Cell(row, "best_test_perplexity"), lowest) << row.at("run");
    EXPECT_EQ(Cell(row, "best_test_bits_per_byte"), lowest_bpb) << row.at("run");
    const std::string lr = row.at("lr");
    final_ppl[lr].push_back(Cell(row, "final_test_perplexity"));
    best_ppl[lr].push_back(Cell(row, "best_test_perplexity"));
    final_bpb[lr].push_back(Cell(row, "final_test_bits_per_byte"));
    best_bpb[lr].push_back(Cell(row, "best_test_bits_per_byte"));
    loss[lr].push_back(l);
  }
  const double ref_ppl = MeanAndStd(final_ppl["0.05"]).first;
  const double ref_bpb = MeanAndStd(final_bpb["0.05"]).first;
  for (const auto& row : rows) {
    EXPECT_NEAR(Cell(row, "perplexity_vs_reference"), Cell(row, "final_test_perplexity") - ref_ppl,
                1e-3)
        << row.at("run");
    EXPECT_NEAR(Cell(row, "bits_per_byte_vs_reference"),
                Cell(row, "final_test_bits_per_byte") - ref_bpb, 1e-4)
        << row.at("run");
  }

  // summary.csv: per setting, mean ± sample std over the seeds of what runs.csv says.
  const auto sum = ReadCsv(out + "/report/summary.csv");
  ASSERT_EQ(sum.size(), 2u);
  const std::string md = ReadFile(out + "/report/summary.md");
  for (const auto& g : sum) {
    const std::string lr = g.at("lr");
    EXPECT_EQ(g.at("n_seeds"), "2");
    for (const auto& [column, values] : std::vector<std::pair<std::string, std::vector<double>>>{
             {"final_test_perplexity", final_ppl[lr]},
             {"best_test_perplexity", best_ppl[lr]},
             {"final_test_bits_per_byte", final_bpb[lr]},
             {"best_test_bits_per_byte", best_bpb[lr]},
             {"final_test_loss", loss[lr]}}) {
      const auto [mean, sd] = MeanAndStd(values);
      EXPECT_NEAR(Cell(g, column + "_mean"), mean, 1e-5 * std::abs(mean)) << lr << " " << column;
      EXPECT_NEAR(Cell(g, column + "_std"), sd, 1e-5 * std::abs(mean)) << lr << " " << column;
    }
    const double vs_ppl = MeanAndStd(final_ppl[lr]).first - ref_ppl;
    const double vs_bpb = MeanAndStd(final_bpb[lr]).first - ref_bpb;
    EXPECT_NEAR(Cell(g, "perplexity_vs_reference_mean"), vs_ppl, 1e-3) << lr;
    EXPECT_NEAR(Cell(g, "bits_per_byte_vs_reference_mean"), vs_bpb, 1e-4) << lr;
    // summary.md: the same numbers, rounded to its decimals (2 for perplexity, 3 for bits per
    // byte, 4 for the loss).
    const std::vector<std::string> cells = MdRow(md, lr);
    ASSERT_EQ(cells.size(), 15u) << md;
    EXPECT_EQ(cells[1] + " " + cells[2], "2 0") << md;
    const std::vector<std::pair<std::vector<double>*, double>> shown = {{&final_ppl[lr], 0.006},
                                                                        {&best_ppl[lr], 0.006},
                                                                        {&final_bpb[lr], 6e-4},
                                                                        {&best_bpb[lr], 6e-4},
                                                                        {&loss[lr], 6e-5}};
    for (size_t i = 0; i < shown.size(); ++i) {
      const auto [mean, sd] = MeanAndStd(*shown[i].first);
      const auto [m, s] = PlusMinusCell(cells[3 + i]);
      EXPECT_NEAR(m, mean, shown[i].second) << lr << " cell " << 3 + i << ": " << cells[3 + i];
      EXPECT_NEAR(s, sd, shown[i].second) << lr << " cell " << 3 + i << ": " << cells[3 + i];
    }
    EXPECT_NEAR(std::stod(cells[8]), vs_ppl, 0.006) << cells[8];
    EXPECT_NEAR(std::stod(cells[9]), vs_bpb, 6e-4) << cells[9];
  }
  EXPECT_EQ(Cell(sum[0], "perplexity_vs_reference_mean"), 0) << "the reference's own setting";
  EXPECT_NE(
      md.find("| lr | seeds | collapsed | final val ppl | best val ppl | final bpb | best bpb "
              "| final val loss | vs ref | vs ref bpb | final loss |"),
      std::string::npos)
      << md;
  EXPECT_EQ(md.find("test acc"), std::string::npos) << md;
  if (!plots) GTEST_SKIP() << "no matplotlib for " << CPD_PLOT_PYTHON << ": tables only";
  for (const char* png : {"perplexity_curves.png", "loss_curves.png", "layer_flushed.png"}) {
    EXPECT_EQ(ReadFile(out + "/report/" + png).substr(0, 4), "\x89PNG") << png;
  }
  EXPECT_FALSE(Exists(out + "/report/accuracy_vs_lr.png"));
}

TEST(CpdStudyCli, ReportMatchesStatisticsComputedByHand) {
  TempDir dir("cpd_study_report");
  const std::string out = dir.File("out");
  Write(dir.File("s.yaml"), std::string("name: rep\n") + kTinyBase +
                                "grid:\n  allreduce-format: [e4m3, e5m2]\nseeds: [1, 2, 3]\n");
  auto metrics = [&](const char* fmt, int seed, const std::string& text) {
    Write(
        out + "/runs/allreduce-format_" + fmt + ".seed_" + std::to_string(seed) + "/metrics.jsonl",
        text);
  };
  // e4m3: final accuracies 0.80, 0.70, 0.90 (seed 1 resumed: its epoch 2 logged twice, the last
  // wins; its step 2 logged twice, counted once; at its step 3 fc2's gradient is all zero, which
  // leaves fc2 out of that step's means).
  metrics("e4m3", 1,
          Epoch(1, 0.5, "1.5") + Step(1, 2, 0.1, 0.3) + Step(2, 4, 0.2, 0.4) +
              Epoch(2, 0.6, "1.2") + Step(2, 9, 0.9, 0.9) + Epoch(2, 0.8, "1.0") + ZeroFc2Step(3) +
              "{\"type\":\"epo");
  metrics("e4m3", 2, Epoch(1, 0.75, "1.1") + Epoch(2, 0.7, "0.9"));
  metrics("e4m3", 3, Epoch(1, 0.9, "0.5", 0, -0.3));
  // e5m2: seed 1 a 100-class run near chance (collapsed: 0.014 <= 1.5 / 100), seed 2 a NaN loss
  // (nlohmann writes null), seed 3 diverged (a stop record) at 0.6.
  metrics("e5m2", 1, "{\"type\":\"run\",\"classes\":100,\"workers\":2}\n" + Epoch(1, 0.014, "4.6"));
  metrics("e5m2", 2, Epoch(1, 0.3, "null", 5));
  metrics("e5m2", 3, Epoch(1, 0.6, "2.0") + "{\"type\":\"stop\",\"step\":12,\"reason\":\"x\"}\n");
  const RunResult r = Study({"report", dir.File("s.yaml"), "--out", out, "--no-plot", "--reference",
                             "allreduce-format_e4m3.*"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto rows = ReadCsv(out + "/report/runs.csv");
  ASSERT_EQ(rows.size(), 6u);
  const auto& a = rows[0];
  EXPECT_EQ(a.at("run"), "allreduce-format_e4m3.seed_1");
  EXPECT_EQ(a.at("allreduce-format"), "e4m3");
  EXPECT_EQ(a.at("state"), "pending");
  EXPECT_EQ(a.at("epochs"), "2");
  EXPECT_DOUBLE_EQ(std::stod(a.at("final_test_accuracy")), 0.8);
  EXPECT_DOUBLE_EQ(std::stod(a.at("best_test_accuracy")), 0.8);
  EXPECT_DOUBLE_EQ(std::stod(a.at("final_loss")), 1.0);
  EXPECT_DOUBLE_EQ(std::stod(a.at("mean_aps_shift")), (2 + 0 + 4 + 0 + 1.5) / 5.0);
  EXPECT_DOUBLE_EQ(std::stod(a.at("mean_allreduce_flushed")), (0.1 + 0.3 + 0.2 + 0.4 + 0.25) / 5.0);
  EXPECT_EQ(a.at("collapsed"), "0");
  EXPECT_NEAR(std::stod(a.at("accuracy_vs_reference")), 0.8 - 0.8, 1e-12);
  EXPECT_DOUBLE_EQ(std::stod(rows[1].at("best_test_accuracy")), 0.75);
  EXPECT_EQ(rows[3].at("classes"), "100");
  for (int i = 3; i < 6; ++i) EXPECT_EQ(rows[size_t(i)].at("collapsed"), "1") << i;
  EXPECT_EQ(rows[4].at("final_loss"), "");
  EXPECT_EQ(rows[4].at("skipped_steps"), "5");

  const auto sum = ReadCsv(out + "/report/summary.csv");
  ASSERT_EQ(sum.size(), 2u);
  const double m = (0.8 + 0.7 + 0.9) / 3;
  const double sd =
      std::sqrt(((0.8 - m) * (0.8 - m) + (0.7 - m) * (0.7 - m) + (0.9 - m) * (0.9 - m)) /
                2);  // sample std: n - 1
  EXPECT_EQ(sum[0].at("n_seeds"), "3");
  EXPECT_EQ(sum[0].at("n_collapsed"), "0");
  EXPECT_NEAR(std::stod(sum[0].at("final_test_accuracy_mean")), m, 1e-6);
  EXPECT_NEAR(std::stod(sum[0].at("final_test_accuracy_std")), sd, 1e-6);
  const double bm = (0.8 + 0.75 + 0.9) / 3;
  EXPECT_NEAR(std::stod(sum[0].at("best_test_accuracy_mean")), bm, 1e-6);
  EXPECT_NEAR(std::stod(sum[0].at("final_loss_mean")), (1.0 + 0.9 + 0.5) / 3, 1e-6);
  // Only seed 1 logged all-reduce statistics: the group's means are its means.
  EXPECT_DOUBLE_EQ(std::stod(sum[0].at("allreduce_flushed_mean")), 0.25);
  EXPECT_DOUBLE_EQ(std::stod(sum[0].at("aps_shift_mean")), 1.5);
  EXPECT_EQ(sum[1].at("allreduce_flushed_mean"), "");
  EXPECT_EQ(sum[1].at("n_collapsed"), "3");
  EXPECT_EQ(sum[0].at("skipped_steps"), "0");
  EXPECT_EQ(sum[1].at("skipped_steps"), "5");
  EXPECT_DOUBLE_EQ(std::stod(sum[0].at("images_per_s_mean")), 100);
  EXPECT_EQ(sum[0].at("wall_s_mean"), "");  // no state file: never run by the driver
  EXPECT_NEAR(std::stod(sum[0].at("relative_cost_mean")), -0.1, 1e-12);
  EXPECT_EQ(sum[0].at("cost_reference"), "cpt-max-bits");  // metrics without cost_reference
  const std::string md = ReadFile(out + "/report/summary.md");
  char cell[64];
  std::snprintf(cell, sizeof cell, "| e4m3 | 3 | 0 | %.2f ± %.2f |", 100 * m, 100 * sd);
  EXPECT_NE(md.find(cell), std::string::npos) << md;
  EXPECT_NE(md.find("| 25.00 | 1.5 | 0 | 100 | - | -10.00 % vs cpt-max-bits |"), std::string::npos)
      << md;
  // Issue 26 item 14: --reference's difference is in summary.md too, as docs/cpd-study.md says:
  // e4m3 is the reference (+0.00), e5m2's mean (0.014 + 0.3 + 0.6) / 3 is 49.53 points below it.
  EXPECT_NE(md.find("| vs ref |"), std::string::npos) << md;
  EXPECT_NE(md.find(" | +0.00 | "), std::string::npos) << md;
  EXPECT_NE(md.find(" | -49.53 | "), std::string::npos) << md;
  const auto layers = ReadCsv(out + "/report/layers.csv");
  ASSERT_EQ(layers.size(), 2u);
  EXPECT_EQ(layers[1].at("layer"), "fc2");
  EXPECT_DOUBLE_EQ(std::stod(layers[1].at("mean_flushed")), 0.35);
  EXPECT_EQ(layers[0].at("steps"), "3");
  EXPECT_EQ(layers[1].at("steps"), "2");  // not step 3, where its gradient was all zero
  EXPECT_EQ(ReadCsv(out + "/report/curves.csv").size(), 2u + 2 + 1 + 1 + 1 + 1);

  const RunResult bad =
      Study({"report", dir.File("s.yaml"), "--out", out, "--no-plot", "--reference", "nothing*"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("--reference 'nothing*' matches no run"), std::string::npos) << bad.err;
}

// A language model's epoch written by hand: its validation perplexity, bits per byte (none when
// `bpb` is negative: token-level data) and loss per token; the next-token accuracy 0.3.
std::string LmEpoch(int epoch, double ppl, double bpb, double loss) {
  std::string e = R"({"type":"epoch","epoch":)" + std::to_string(epoch) + R"(,"step":)" +
                  std::to_string(10 * epoch) +
                  R"(,"loss":2.5,"train_accuracy":0.3,"test_accuracy":0.3,"test_loss":)" +
                  std::to_string(loss) + R"(,"images_per_s":100,"relative_cost":0,)" +
                  R"("skipped_steps":0,"test_perplexity":)" + std::to_string(ppl);
  if (bpb >= 0) e += R"(,"test_bits_per_byte":)" + std::to_string(bpb);
  return e + "}\n";
}

// summary.csv and summary.md of a language-model study against numbers computed by hand: best is
// the lowest perplexity (not the last epoch), mean ± sample std over the seeds, and --reference
// in perplexity and bits per byte; without bits per byte (token-level data) their columns leave
// summary.md and the plot draws the perplexity on a log scale.
TEST(CpdStudyCli, LanguageModelReportMatchesStatisticsComputedByHand) {
  TempDir dir("cpd_study_lm_report");
  const std::string out = dir.File("out");
  Write(dir.File("s.yaml"),
        "name: lmrep\nbase:\n  arch: gpt\n  dataset: text\n  n-embd: 16\n  block-size: 16\n"
        "grid:\n  lr: [0.1, 0.2]\nseeds: [1, 2, 3]\n");
  // {perplexity, bits per byte, loss} per epoch of each seed.
  using Epochs = std::vector<std::array<double, 3>>;
  const std::map<std::string, std::vector<Epochs>> runs = {
      {"0.1",
       {{{10, 3.3, 2.3}, {8, 3.0, 2.1}, {9, 3.2, 2.2}},
        {{12, 3.6, 2.5}, {11, 3.5, 2.4}},
        {{7, 2.8, 1.9}}}},
      {"0.2",
       {{{20, 4.3, 3.0}, {16, 4.0, 2.77}},
        {{18, 4.17, 2.89}},
        {{14, 3.8, 2.64}, {15, 3.9, 2.71}}}}};
  auto write = [&](bool with_bpb) {
    for (const auto& [lr, seeds] : runs) {
      for (size_t s = 0; s < seeds.size(); ++s) {
        std::string m = R"({"type":"run","classes":256,"vocab":256,"block_size":16})"
                        "\n";
        for (size_t e = 0; e < seeds[s].size(); ++e) {
          const auto& [ppl, bpb, loss] = seeds[s][e];
          m += LmEpoch(int(e) + 1, ppl, with_bpb ? bpb : -1, loss);
        }
        Write(out + "/runs/lr_" + lr + ".seed_" + std::to_string(s + 1) + "/metrics.jsonl", m);
      }
    }
  };
  write(true);
  const bool plots = HaveMatplotlib();
  std::vector<std::string> args = {"report", dir.File("s.yaml"), "--out",
                                   out,      "--reference",      "lr_0.1.*"};
  if (!plots) args.push_back("--no-plot");
  RunResult r = Study(args);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto rows = ReadCsv(out + "/report/runs.csv");
  ASSERT_EQ(rows.size(), 6u);
  EXPECT_DOUBLE_EQ(Cell(rows[0], "final_test_perplexity"), 9);
  EXPECT_DOUBLE_EQ(Cell(rows[0], "best_test_perplexity"), 8);  // epoch 2, not the last
  EXPECT_DOUBLE_EQ(Cell(rows[0], "best_test_bits_per_byte"), 3.0);
  EXPECT_DOUBLE_EQ(Cell(rows[0], "final_test_loss"), 2.2);
  EXPECT_EQ(rows[0].at("collapsed"), "0");
  EXPECT_DOUBLE_EQ(Cell(rows[3], "perplexity_vs_reference"), 16 - 9.0);  // the mean of 9, 11, 7
  EXPECT_NEAR(Cell(rows[5], "bits_per_byte_vs_reference"), 3.9 - (3.2 + 3.5 + 2.8) / 3, 1e-6);

  const auto sum = ReadCsv(out + "/report/summary.csv");
  ASSERT_EQ(sum.size(), 2u);
  const auto expect = [&](const std::map<std::string, std::string>& g, const std::string& col,
                          const std::vector<double>& v) {
    const auto [mean, sd] = MeanAndStd(v);
    EXPECT_NEAR(Cell(g, col + "_mean"), mean, 1e-5 * mean) << g.at("lr") << " " << col;
    EXPECT_NEAR(Cell(g, col + "_std"), sd, 1e-5 * mean) << g.at("lr") << " " << col;
  };
  expect(sum[0], "final_test_perplexity", {9, 11, 7});
  expect(sum[0], "best_test_perplexity", {8, 11, 7});
  expect(sum[0], "final_test_bits_per_byte", {3.2, 3.5, 2.8});
  expect(sum[0], "best_test_bits_per_byte", {3.0, 3.5, 2.8});
  expect(sum[0], "final_test_loss", {2.2, 2.4, 1.9});
  expect(sum[1], "final_test_perplexity", {16, 18, 15});
  expect(sum[1], "best_test_perplexity", {16, 18, 14});
  expect(sum[1], "final_test_bits_per_byte", {4.0, 4.17, 3.9});
  EXPECT_EQ(Cell(sum[0], "perplexity_vs_reference_mean"), 0);
  EXPECT_NEAR(Cell(sum[1], "perplexity_vs_reference_mean"), 49.0 / 3 - 9, 1e-5);
  EXPECT_NEAR(Cell(sum[1], "bits_per_byte_vs_reference_mean"),
              (4.0 + 4.17 + 3.9) / 3 - (3.2 + 3.5 + 2.8) / 3, 1e-5);
  EXPECT_NEAR(Cell(sum[0], "final_test_accuracy_mean"), 0.3, 1e-12);  // the next-token accuracy

  std::string md = ReadFile(out + "/report/summary.md");
  // best {8, 11, 7}: 8.67 ± 2.08; bits per byte {3.2, 3.5, 2.8}: 3.167 ± 0.351.
  EXPECT_NE(md.find("| 0.1 | 3 | 0 | 9.00 ± 2.00 | 8.67 ± 2.08 | 3.167 ± 0.351 | 3.100 ± 0.361 | "
                    "2.1667 ± 0.2517 | +0.00 | +0.000 | 2.5000 ± 0.0000 |"),
            std::string::npos)
      << md;
  EXPECT_NE(md.find("| 0.2 | 3 | 0 | 16.33 ± 1.53 | 16.00 ± 2.00 | 4.023 ± 0.137 | 3.990 ± 0.185 | "
                    "2.7900 ± 0.0917 | +7.33 | +0.857 |"),
            std::string::npos)
      << md;
  EXPECT_NE(md.find("best: the epoch with the lowest perplexity"), std::string::npos) << md;
  if (plots) {
    EXPECT_TRUE(Exists(out + "/report/perplexity_curves.png"));
    EXPECT_FALSE(Exists(out + "/report/accuracy_vs_lr.png"));
  }

  // Token-level data: no bits per byte, so summary.md has no bpb columns.
  write(false);
  args.push_back("--no-plot");
  r = Study(args);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  md = ReadFile(out + "/report/summary.md");
  EXPECT_NE(md.find("| lr | seeds | collapsed | final val ppl | best val ppl | final val loss | "
                    "vs ref | final loss |"),
            std::string::npos)
      << md;
  EXPECT_NE(md.find("| 0.1 | 3 | 0 | 9.00 ± 2.00 | 8.67 ± 2.08 | 2.1667 ± 0.2517 | +0.00 |"),
            std::string::npos)
      << md;
  EXPECT_EQ(ReadCsv(out + "/report/summary.csv")[0].at("final_test_bits_per_byte_mean"), "");
  if (!plots) GTEST_SKIP() << "no matplotlib for " << CPD_PLOT_PYTHON << ": tables only";
  // The plot draws bits per byte where every run has them, else the perplexity on a log scale.
  const std::string script =
      std::filesystem::path(BuiltProgram(CPD_STUDY_PATH)).parent_path().string();
  Write(dir.File("probe.py"), "import sys\nsys.path.insert(0, '" + script +
                                  "')\nimport study_plot as sp\n"
                                  "def save(fig, path):\n"
                                  "    ax = fig.axes[0]\n"
                                  "    print(ax.get_yscale(), '|', ax.get_ylabel())\n"
                                  "sp.save = save\n"
                                  "sp.perplexity_curves('" +
                                  out + "/report', ['lr'], 'x.png')\n");
  RunResult probe = RunProgram(CPD_PLOT_PYTHON, {dir.File("probe.py")});
  ASSERT_EQ(probe.exit_code, 0) << probe.err;
  EXPECT_EQ(probe.out, "log | validation perplexity (mean over seeds, log scale)\n");
  write(true);
  r = Study(args);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  probe = RunProgram(CPD_PLOT_PYTHON, {dir.File("probe.py")});
  ASSERT_EQ(probe.exit_code, 0) << probe.err;
  EXPECT_EQ(probe.out, "linear | validation bits per byte (mean over seeds)\n");
}

TEST(CpdStudyCli, TheReportDrawsItsPlots) {
  if (!HaveMatplotlib()) GTEST_SKIP() << "no matplotlib for " << CPD_PLOT_PYTHON;
  TempDir dir("cpd_study_plots");
  const std::string out = dir.File("out");
  Write(dir.File("s.yaml"), std::string("name: p\n") + kTinyBase +
                                "grid:\n  global-batch: [32, 64]\n  aps: [false, true]\n"
                                "seeds: [1, 2]\n");
  int k = 0;
  for (const char* gb : {"32", "64"}) {
    for (const char* aps : {"off", "on"}) {
      for (int seed : {1, 2}) {
        Write(out + "/runs/global-batch_" + gb + ".aps_" + aps + ".seed_" + std::to_string(seed) +
                  "/metrics.jsonl",
              Step(1, 3, 0.1 * (k % 3), 0.2) + Epoch(1, 0.5 + 0.01 * k, "1.5") +
                  Epoch(2, 0.6 + 0.01 * k, "1.2"));
        ++k;
      }
    }
  }
  const RunResult r = Study({"report", dir.File("s.yaml"), "--out", out});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* png : {"accuracy_vs_global-batch.png", "loss_curves.png", "layer_flushed.png"}) {
    const std::string data = ReadFile(out + "/report/" + png);
    EXPECT_GT(data.size(), 1000u) << png;
    EXPECT_EQ(data.substr(0, 4), "\x89PNG") << png;
  }
  for (const auto& e : std::filesystem::directory_iterator(out + "/report")) {
    EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos) << e.path();
  }
}

}  // namespace
}  // namespace cpd::test
