// cpdctl export (the stored history as CSV) and cpdctl plot (as a PNG, drawn by
// scripts/cpdctl_plot.py on Debian's matplotlib).
#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "launcher/cpdctl/atomic_file.h"
#include "launcher/cpdctl/commands.h"
#include "launcher/cpdctl/output.h"

extern char** environ;

namespace cpd::ctl {
namespace {

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
    const std::string line = head + "," + CsvField(l.layer()) + "," + SiteName(l.site()) + "," +
                             CsvField(l.format()) + "," + std::to_string(l.bits()) + "," +
                             std::to_string(l.aps_shift()) + "," + ShortestDouble(l.max_abs()) +
                             "," + ShortestDouble(l.saturated()) + "," +
                             ShortestDouble(l.flushed()) + "," + opt(l.rel_error()) + "," +
                             std::to_string(l.flips()) + "," + std::to_string(l.nonfinite()) + "\n";
    std::fwrite(line.data(), 1, line.size(), out);
  }
  return size_t(r.layers_size());
}

}  // namespace

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

namespace {

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

// What the script plots: the job's status, its schedules and its reports.
struct PlotData {
  nlohmann::json doc;
  size_t reports = 0;
};

PlotData ReadPlotData(Connection& c, const RangeArgs& a) {
  const v1::JobStatusResponse st = GetStatus(c, a.job);
  const v1::GetScheduleResponse sched = ReadSchedule(c, a.job);
  using nlohmann::json;
  PlotData d;
  d.doc = {{"job", ToJson(st)}, {"schedules", json::array()}, {"reports", json::array()}};
  for (const auto& h : sched.history()) d.doc["schedules"].push_back(ToJson(h));
  if (sched.history().empty()) d.doc["schedules"].push_back(ToJson(sched.schedule()));
  d.reports = ReadHistory(c, a.job, a.from, a.to,
                          [&](const v1::StatsReport& r) { d.doc["reports"].push_back(ToJson(r)); });
  return d;
}

// Writes `doc` into a private temporary file, removed at exit; returns its path.
std::string WritePlotInput(const nlohmann::json& doc) {
  const char* tmpdir = std::getenv("TMPDIR");
  std::string data_path =
      std::string(tmpdir != nullptr && *tmpdir ? tmpdir : "/tmp") + "/cpdctl_plot_XXXXXX.json";
  const int dfd = mkstemps(data_path.data(), 5);
  if (dfd < 0) Fail("plot: cannot create a temporary file: " + std::string(std::strerror(errno)));
  AddTempFile(data_path);
  const std::string text = doc.dump();
  FILE* f = fdopen(dfd, "w");
  if (f == nullptr || std::fwrite(text.data(), 1, text.size(), f) != text.size() ||
      std::fclose(f) != 0) {
    Fail("plot: writing " + data_path + ": " + std::strerror(errno));
  }
  return data_path;
}

// The environment of the script: ours, with matplotlib's non-interactive backend.
std::vector<std::string> PlotEnvironment() {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "MPLBACKEND=", 11) != 0) env.emplace_back(*e);
  }
  env.emplace_back("MPLBACKEND=Agg");
  return env;
}

std::vector<char*> Pointers(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

void CheckSpawnSetup(int rc) {
  if (rc != 0) Fail(std::string("plot: cannot prepare to run the script: ") + std::strerror(rc));
}

// Runs `args` (args[0] is the interpreter) with stdin and stdout on /dev/null and stderr into
// `err_path`; returns its wait status.
int RunScript(std::vector<std::string> args, const std::string& err_path) {
  std::vector<std::string> env = PlotEnvironment();
  const std::vector<char*> argv = Pointers(args);
  const std::vector<char*> envp = Pointers(env);
  posix_spawn_file_actions_t fa;
  CheckSpawnSetup(posix_spawn_file_actions_init(&fa));
  CheckSpawnSetup(posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, "/dev/null", O_RDONLY, 0));
  CheckSpawnSetup(posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, "/dev/null", O_WRONLY, 0));
  CheckSpawnSetup(posix_spawn_file_actions_addopen(&fa, STDERR_FILENO, err_path.c_str(),
                                                   O_WRONLY | O_CREAT | O_TRUNC, 0600));
  pid_t pid = -1;
  const int rc = posix_spawnp(&pid, args[0].c_str(), &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    Fail("plot: cannot run " + args[0] + ": " + std::strerror(rc) +
         " (it needs python3 and python3-matplotlib: scripts/install_deps.sh)");
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) Fail("plot: waiting for " + args[0] + ": " + std::strerror(errno));
  }
  return status;
}

std::string Trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

// Fails with why the script failed: the last line it wrote (a missing matplotlib, a bad input).
[[noreturn]] void ScriptFailed(const std::string& python, const std::string& script,
                               const std::string& err_path, int status) {
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

}  // namespace

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
  const PlotData data = ReadPlotData(c, a);
  const std::string data_path = WritePlotInput(data.doc);
  const std::string err_path = data_path.substr(0, data_path.size() - 5) + ".err";
  AddTempFile(err_path);

  AtomicFile png(a.out, ".png");
  const int status =
      RunScript({python, script, "--in", data_path, "--out", png.temp_path()}, err_path);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    ScriptFailed(python, script, err_path, status);
  }
  png.Commit();
  if (g.json) {
    PrintJson({{"file", a.out}, {"reports", data.reports}});
  } else {
    Print("wrote " + a.out + " (" + std::to_string(data.reports) + " reports)\n");
    FlushStdout();
  }
  return 0;
}

}  // namespace cpd::ctl
