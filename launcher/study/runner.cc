#include "launcher/study/runner.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>

#include "launcher/common.h"
#include "launcher/files.h"
#include "launcher/study/run_state.h"

namespace cpd::launcher::study {

namespace {

void Say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

void Complain(const std::string& line) { std::fprintf(stderr, "cpd-study: %s\n", line.c_str()); }

std::string Clock() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::localtime_r(&t, &tm);
  char buf[16];
  std::strftime(buf, sizeof buf, "%H:%M:%S", &tm);
  return buf;
}

// The files of a new attempt: the config, the exact command, the state "running".
Status BeginAttempt(const Study& study, const PlannedRun& run, const RunPaths& p,
                    const std::vector<std::string>& argv, RunState* s) {
  // A state still "running" here (this process holds the lock) is an attempt that was killed:
  // its time counts too, up to its last write, before this attempt's files touch anything.
  s->total_wall_s += InterruptedSeconds(*s, p);
  std::error_code ec;
  std::filesystem::create_directories(p.checkpoints, ec);
  if (ec) return Status::IoError("cannot create " + p.checkpoints + ": " + ec.message());
  CPD_RETURN_IF_ERROR(WriteFileAtomically(p.config, ConfigYaml(study, run)));
  CPD_RETURN_IF_ERROR(WriteFileAtomically(p.cmd, ShellLine(argv) + "\n"));
  s->state = "running";
  s->exit_code = -1;
  s->start_ms = NowMs();
  s->end_ms = 0;
  s->wall_s = 0;
  s->host = HostName();
  s->pid = long(::getpid());
  s->diverged_step = -1;
  s->diverged_loss = std::nan("");
  s->diverged_reason.clear();
  ++s->attempts;
  return WriteState(p.state, *s);
}

}  // namespace

// Starts argv (execvp: a bare name is looked up on $PATH) with stdout and stderr on the given
// descriptors (-1: inherited) and stdin on /dev/null. The child gets SIGTERM when its parent
// dies, so a killed driver leaves no training behind (mpirun passes SIGTERM on to its ranks).
pid_t SpawnProcess(const std::vector<std::string>& args, int out_fd, int err_fd) {
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid != 0) return pid;  // the parent, or -1
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (::getppid() != parent) ::_exit(1);  // the parent died before prctl
  const int null_fd = ::open("/dev/null", O_RDWR);
  if (null_fd >= 0) ::dup2(null_fd, STDIN_FILENO);
  if (out_fd >= 0) ::dup2(out_fd, STDOUT_FILENO);
  if (err_fd >= 0) ::dup2(err_fd, STDERR_FILENO);
  ::execvp(argv[0], argv.data());
  std::fprintf(stderr, "cpd-study: cannot run %s: %s\n", argv[0], std::strerror(errno));
  ::_exit(127);
}

namespace {

// The exit code of a finished child: its status, or 128 + the signal that ended it.
int ExitCode(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace

int WaitForExit(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return 1;
  }
  return ExitCode(status);
}

std::string FindOnPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::string all = path ? path : "";
  size_t start = 0;
  while (start <= all.size()) {
    const size_t colon = std::min(all.find(':', start), all.size());
    const std::string dir = all.substr(start, colon - start);
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    start = colon + 1;
  }
  return "";
}

int RunOne(const Study& study, const PlannedRun& run, const RunOptions& o) {
  const RunPaths p = PathsOf(o.launch.out_dir, run.name);
  std::error_code ec;
  std::filesystem::create_directories(p.dir, ec);
  if (ec) {
    Complain("run " + run.name + ": cannot create " + p.dir + ": " + ec.message());
    return 1;
  }
  const RunLock lock(p.lock);
  if (!lock.held()) {
    Complain("run " + run.name + ": another cpd-study process runs it (it holds " + p.lock +
             "); skipped");
    return kRunOwnedElsewhere;
  }
  auto read = ReadState(p.state);
  if (!read.ok()) {
    Complain(read.status().message());
    return 1;
  }
  RunState s = *read;
  if (s.state == "done") {
    Say("run " + run.name + ": already done");
    return 0;
  }
  if (IsDiverged(s)) {
    Say("run " + run.name + ": diverged " + DivergenceText(s) +
        " before; that is its result, it is not run again");
    return 0;
  }
  if (s.state == "failed" && !o.retry_failed) {
    Complain("run " + run.name + ": failed before (exit " + std::to_string(s.exit_code) +
             "); --retry-failed runs it again");
    return 1;
  }
  const std::vector<std::string> argv = RunCommand(study, run, o.launch, false);
  if (Status b = BeginAttempt(study, run, p, argv, &s); !b.ok()) {
    Complain("run " + run.name + ": " + b.message());
    return 1;
  }
  const int log = ::open(p.log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log < 0) {
    Complain("run " + run.name + ": cannot open " + p.log + ": " + std::strerror(errno));
    return 1;
  }
  const std::string header = "=== cpd-study " + study.name + " run " + run.name + " attempt " +
                             std::to_string(s.attempts) + " on " + s.host + ": " + ShellLine(argv) +
                             "\n";
  if (::write(log, header.data(), header.size()) < 0) {
    Complain("run " + run.name + ": cannot write " + p.log + ": " + std::strerror(errno));
  }
  const pid_t pid = SpawnProcess(argv, log, log);
  const int code = pid < 0 ? 1 : WaitForExit(pid);
  ::close(log);
  s.end_ms = NowMs();
  s.wall_s = double(s.end_ms - s.start_ms) / 1e3;
  s.total_wall_s += s.wall_s;
  s.exit_code = code;
  s.state = code == 0 ? "done" : code == kDivergedExit ? "diverged" : "failed";
  s.pid = 0;
  if (s.state == "diverged") ReadDivergence(p, &s);
  if (Status w = WriteState(p.state, s); !w.ok()) {
    Complain("run " + run.name + ": " + w.message());
    return code == 0 ? 1 : code;
  }
  if (s.state == "diverged") {
    Say("run " + run.name + ": diverged " + DivergenceText(s) +
        (s.diverged_reason.empty() ? "" : ": " + s.diverged_reason));
    return 0;
  }
  return code;
}

namespace {

struct Progress {
  size_t total = 0, done = 0, diverged = 0, failed = 0, elsewhere = 0, running = 0, started = 0,
         to_run = 0;
  double wall_sum = 0;  // of the runs finished by this launcher
  size_t finished_here = 0;
  int parallel = 1;

  std::string Counts() const {
    char buf[160];
    std::snprintf(buf, sizeof buf,
                  "done %zu, diverged %zu, failed %zu, running %zu, left %zu of %zu", done,
                  diverged, failed, running, to_run - started, total);
    std::string out = buf;
    if (finished_here == 0) return out + ", eta ?";
    const double per_run = wall_sum / double(finished_here);
    const double eta = per_run * double(to_run - started + running) / double(parallel);
    std::snprintf(buf, sizeof buf, ", eta %.0f s", eta);
    return out + buf;
  }
};

std::vector<std::string> RunOneCommand(const LocalOptions& o, size_t index) {
  std::vector<std::string> argv = {o.self,
                                   "run-one",
                                   o.study_path,
                                   "--index",
                                   std::to_string(index),
                                   "--out",
                                   o.run.launch.out_dir,
                                   "--cpd-train",
                                   o.run.launch.cpd_train};
  if (!o.run.launch.coordinator.empty()) {
    argv.insert(argv.end(), {"--coordinator", o.run.launch.coordinator});
  }
  if (o.run.retry_failed) argv.push_back("--retry-failed");
  return argv;
}

}  // namespace

RunTally TallyRuns(const std::vector<PlannedRun>& runs, const std::string& out_dir,
                   bool retry_failed) {
  RunTally t;
  for (const PlannedRun& r : runs) {
    const RunPaths p = PathsOf(out_dir, r.name);
    const auto s = ReadState(p.state);
    if (!s.ok()) {
      t.unreadable.push_back(s.status().message());
      continue;
    }
    const std::string what = Classify(*s, p);
    if (what == "done") {
      ++t.done;
    } else if (what == "diverged") {
      ++t.diverged;
    } else if (what == "failed" && !retry_failed) {
      ++t.failed;
    } else if (what == "running") {
      ++t.running;
    } else {
      t.to_run.push_back(r.index);
    }
  }
  return t;
}

int RunLocal(const Study& study, const std::vector<PlannedRun>& runs, const LocalOptions& o) {
  Progress pr;
  pr.total = runs.size();
  pr.parallel = o.parallel;
  const RunTally tally = TallyRuns(runs, o.run.launch.out_dir, o.run.retry_failed);
  // A state file that cannot be used stops only its own run: the others go on.
  for (const std::string& line : tally.unreadable) Complain(line);
  const std::vector<size_t>& todo = tally.to_run;
  pr.done = tally.done;
  pr.diverged = tally.diverged;
  pr.failed = tally.failed;
  pr.elsewhere = tally.running;
  pr.to_run = todo.size();
  char head[320];
  std::snprintf(head, sizeof head,
                "%s: %zu runs: %zu done, %zu diverged, %zu failed (not retried), %zu running "
                "elsewhere, %zu unreadable, %zu to run, %d at a time",
                study.name.c_str(), runs.size(), pr.done, pr.diverged, pr.failed, pr.elsewhere,
                tally.unreadable.size(), todo.size(), o.parallel);
  Say(head);
  const int null_fd = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
  std::map<pid_t, std::pair<size_t, int64_t>> active;  // pid -> run index, start
  size_t next = 0;
  while (next < todo.size() || !active.empty()) {
    while (next < todo.size() && active.size() < size_t(o.parallel)) {
      const PlannedRun& r = runs[todo[next]];
      const pid_t pid = SpawnProcess(RunOneCommand(o, r.index), null_fd, -1);
      ++next;
      ++pr.started;
      if (pid < 0) {
        Complain("run " + r.name + ": cannot start: " + std::strerror(errno));
        ++pr.failed;
        continue;
      }
      active[pid] = {r.index, NowMs()};
      ++pr.running;
      if (o.progress) Say("[" + Clock() + "] start " + r.name + " (" + pr.Counts() + ")");
    }
    if (active.empty()) break;
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    auto it = active.find(pid);
    if (it == active.end()) continue;
    const PlannedRun& r = runs[it->second.first];
    const double wall = double(NowMs() - it->second.second) / 1e3;
    active.erase(it);
    --pr.running;
    const int code = ExitCode(status);
    char secs[32];
    std::snprintf(secs, sizeof secs, " in %.1f s", wall);
    bool show = o.progress;
    std::string line = "[" + Clock() + "] ";
    const RunPaths p = PathsOf(o.run.launch.out_dir, r.name);
    // What the run is now, from its state file: run-one's exit code alone cannot tell a run
    // another driver took (it owns the lock) or one that diverged from one that failed.
    const auto after = ReadState(p.state);
    const std::string what = code == kRunOwnedElsewhere ? "elsewhere"
                             : !after.ok()              ? "unreadable"
                                                        : Classify(*after, p);
    if (what == "elsewhere") {
      ++pr.elsewhere;
      line += "skip  " + r.name + ": another cpd-study process runs it";
    } else if (code == 0 && what == "done") {
      ++pr.done;
      pr.wall_sum += wall;
      ++pr.finished_here;
      line += "done  " + r.name + secs;
    } else if (code == 0 && what == "diverged") {
      ++pr.diverged;
      pr.wall_sum += wall;
      ++pr.finished_here;
      line += "diverged " + r.name + " " + DivergenceText(*after) + secs +
              " (a result: counted "
              "as collapsed)";
    } else {
      ++pr.failed;
      pr.wall_sum += wall;
      ++pr.finished_here;
      show = true;  // a failure is news, not progress
      line += "FAILED " + r.name + " (exit " + std::to_string(code) + ")" + secs;
      const std::string why =
          after.ok() ? LastErrorLine(p.log) : std::string(after.status().message());
      if (!why.empty()) line += ": " + why;
    }
    if (show) Say(line + " (" + pr.Counts() + ")");
  }
  if (null_fd >= 0) ::close(null_fd);
  Say(study.name + ": " + std::to_string(pr.done) + " of " + std::to_string(runs.size()) +
      " runs done, " + std::to_string(pr.failed) + " failed, " + std::to_string(pr.diverged) +
      " diverged, " + std::to_string(pr.elsewhere) + " running elsewhere" +
      (pr.failed > 0 ? " (cpd-study status shows why; --retry-failed runs them again)" : ""));
  return pr.failed == 0 && tally.unreadable.empty() ? 0 : 1;
}

}  // namespace cpd::launcher::study
