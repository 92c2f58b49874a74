// cpdctl jobs, cpdctl status.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "launcher/common.h"
#include "launcher/cpdctl/commands.h"
#include "launcher/cpdctl/output.h"

namespace cpd::ctl {
namespace {

// "NAME (id N)": how the status block names a job.
std::string NameAndId(const v1::JobSummary& j) {
  return j.job_name() + " (id " + std::to_string(j.job_id()) + ")";
}

}  // namespace

int64_t StepsDone(const v1::JobSummary& j) {
  return j.last_report_ms() > 0 ? j.step() + 1 : j.step();
}

std::string ReportAge(const v1::JobSummary& j, int64_t now_ms) {
  return j.last_report_ms() > 0 ? FormatDuration(now_ms - j.last_report_ms()) + " ago" : "-";
}

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
  // The study column only when some job has one (most coordinators run no studies).
  const bool studies = std::any_of(resp.jobs().begin(), resp.jobs().end(),
                                   [](const v1::JobSummary& j) { return !j.study().empty(); });
  std::vector<Table::Column> cols = {{"ID", A::kRight}, {"NAME", A::kLeft}};
  if (studies) cols.push_back({"STUDY", A::kLeft});
  for (Table::Column c : std::initializer_list<Table::Column>{{"STATE", A::kLeft},
                                                              {"STEP", A::kRight},
                                                              {"TOTAL", A::kRight},
                                                              {"DONE", A::kRight},
                                                              {"RANKS", A::kRight},
                                                              {"ARCH", A::kLeft},
                                                              {"DATASET", A::kLeft},
                                                              {"REGISTERED", A::kLeft},
                                                              {"LAST REPORT", A::kRight}}) {
    cols.push_back(std::move(c));
  }
  Table t(std::move(cols));
  const int64_t now = cpd::launcher::NowMs();
  for (const auto& j : resp.jobs()) {
    std::vector<std::string> cells = {std::to_string(j.job_id()), j.job_name()};
    if (studies) cells.push_back(j.study().empty() ? "-" : j.study());
    for (std::string c :
         {j.state(), std::to_string(j.step()),
          j.total_steps() > 0 ? std::to_string(j.total_steps()) : std::string("-"),
          j.total_steps() > 0 ? FormatPercent(double(StepsDone(j)) / j.total_steps())
                              : std::string("-"),
          std::to_string(j.world_size()), j.arch().empty() ? std::string("-") : j.arch(),
          j.dataset().empty() ? std::string("-") : j.dataset(), FormatTime(j.registered_ms()),
          ReportAge(j, now)}) {
      cells.push_back(std::move(c));
    }
    t.AddRow(std::move(cells));
  }
  Print(t.Render());
  FlushStdout();
  return 0;
}

std::string Ratio(int64_t a, int64_t b) {
  return std::to_string(a) + " / " + (b > 0 ? std::to_string(b) : std::string("?"));
}

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
            FormatPercent(double(StepsDone(j)) / double(j.total_steps())) + ")";
  }
  kv.emplace_back("step", step);
  kv.emplace_back("epoch", Ratio(st.epoch(), st.epochs()));
  kv.emplace_back("bits", st.bits() > 0 ? std::to_string(st.bits()) + " (CPT forward)" : "-");
  const auto& sch = st.schedule();
  kv.emplace_back("schedule", "v" + std::to_string(sch.version()) + " from step " +
                                  std::to_string(sch.effective_from_step()) + ": " +
                                  ScheduleSummary(sch));
  kv.emplace_back("ranks", std::to_string(st.ranks_alive()) + " / " +
                               std::to_string(j.world_size()) + " alive");
  kv.emplace_back("last report", age_ms < 0 ? "none yet" : FormatDuration(age_ms) + " ago");
  kv.emplace_back("loss", age_ms < 0 ? "-" : FormatG(st.loss(), 5));
  std::string accuracy = "train " + FormatAccuracy(st.train_accuracy()) + ", test " +
                         FormatAccuracy(st.test_accuracy());
  if (Measured(st.test_perplexity())) {
    // A language model: its perplexity where a vision model's accuracy is.
    kv.emplace_back("perplexity", ValidationSummary(st.test_perplexity(), st.test_bits_per_byte(),
                                                    st.test_loss()));
    accuracy += " (next token)";
  }
  kv.emplace_back("accuracy", accuracy);
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
  return KeyValues(kv);
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

}  // namespace cpd::ctl
