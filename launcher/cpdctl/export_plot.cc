// cpdctl export (the stored history as CSV) and cpdctl plot (as a PNG, drawn by
// scripts/cpdctl_plot.py on Debian's matplotlib).
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

#include "launcher/common.h"
#include "launcher/cpdctl/atomic_file.h"
#include "launcher/cpdctl/commands.h"
#include "launcher/cpdctl/output.h"
#include "launcher/files.h"

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

// A language model's export (`language_model`) has its validation loss, perplexity and bits per
// byte after the accuracies; a vision model's columns are those it always had.
std::string CsvHeader(bool language_model) {
  return std::string(
             "step,rank,epoch,time_ms,loss,lr,bits,schedule_version,images_per_s,ranks_alive,"
             "skipped_steps,dropped_reports,train_accuracy,test_accuracy,") +
         (language_model ? "test_loss,test_perplexity,test_bits_per_byte," : "") +
         "finished,layer,site,format,format_bits,aps_shift,max_abs,saturated,flushed,rel_error,"
         "flips,nonfinite\n";
}

// One CSV row per layer row of the report, or one for the report alone when it has none.
size_t CsvRows(const v1::StatsReport& r, bool language_model, FILE* out) {
  auto opt = [](double v) { return v < 0 ? std::string() : ShortestDouble(v); };
  auto measured = [](double v) { return Measured(v) ? ShortestDouble(v) : std::string(); };
  const std::string head =
      std::to_string(r.step()) + "," + std::to_string(r.rank()) + "," + std::to_string(r.epoch()) +
      "," + std::to_string(r.time_ms()) + "," + ShortestDouble(r.loss()) + "," +
      ShortestDouble(r.lr()) + "," + std::to_string(r.bits()) + "," +
      std::to_string(r.schedule_version()) + "," + ShortestDouble(r.images_per_s()) + "," +
      std::to_string(r.ranks_alive()) + "," + std::to_string(r.skipped_steps()) + "," +
      std::to_string(r.dropped_reports()) + "," + opt(r.train_accuracy()) + "," +
      opt(r.test_accuracy()) + "," +
      (language_model ? measured(r.test_loss()) + "," + measured(r.test_perplexity()) + "," +
                            measured(r.test_bits_per_byte()) + ","
                      : "") +
      (r.finished() ? "1" : "0");
  if (r.layers().empty()) {
    const std::string line = head + ",,,,,,,,,,,\n";
    std::fwrite(line.data(), 1, line.size(), out);
    return 1;
  }
  for (const auto& l : r.layers()) {
    const std::string line = head + "," + launcher::CsvField(l.layer()) + "," + SiteName(l.site()) +
                             "," + launcher::CsvField(l.format()) + "," + std::to_string(l.bits()) +
                             "," + std::to_string(l.aps_shift()) + "," +
                             ShortestDouble(l.max_abs()) + "," + ShortestDouble(l.saturated()) +
                             "," + ShortestDouble(l.flushed()) + "," + opt(l.rel_error()) + "," +
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
  // A language model (a job with a measured perplexity) gets its validation columns; the
  // header is written before the history streams.
  const bool language_model = Measured(GetStatus(c, a.job).test_perplexity());
  const bool to_stdout = a.out == "-";
  std::unique_ptr<AtomicFile> file;
  if (!to_stdout) file = std::make_unique<AtomicFile>(a.out);
  FILE* out = to_stdout ? stdout : file->stream();
  const std::string header = CsvHeader(language_model);
  std::fwrite(header.data(), 1, header.size(), out);
  size_t rows = 0;
  const size_t reports = ReadHistory(c, a.job, a.from, a.to, [&](const v1::StatsReport& r) {
    rows += CsvRows(r, language_model, out);
  });
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

// The plot script: $CPD_PLOT_SCRIPT, the source tree's (compiled in), next to the executable.
std::string FindPlotScript() {
  auto script =
      launcher::FindScript("cpdctl_plot.py", "CPD_PLOT_SCRIPT",
                           {CPDCTL_PLOT_SCRIPT, launcher::ExecutableDir() + "/cpdctl_plot.py",
                            launcher::ExecutableDir() + "/../share/cpd/cpdctl_plot.py"});
  if (!script.ok()) Fail("plot: " + script.status().message());
  return *script;
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
  AtomicFile png(a.out, ".png");
  const Status plotted =
      launcher::RunPythonScript(python, script, {"--in", data_path, "--out", png.temp_path()});
  if (!plotted.ok()) Fail("plot: " + plotted.message());
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
