// cpdctl study: a study's runs (the jobs a study driver registered with --study), or the studies
// the coordinator knows. One ListJobs call either way.
#include <string>
#include <utility>
#include <vector>

#include "cpd/tag.h"
#include "launcher/common.h"
#include "launcher/cpdctl/commands.h"
#include "launcher/cpdctl/output.h"

namespace cpd::ctl {
namespace {

// STUDY on the command line: the coordinator's rule for tags, checked before any call.
void CheckStudyName(const std::string& study) {
  if (!IsTag(study, kMaxStudyNameLength)) {
    Usage("STUDY " + cpd::launcher::QuoteForMessage(study) + ": expected a study name (1 to " +
          std::to_string(kMaxStudyNameLength) + " of " + kTagCharacters + ")");
  }
}

v1::ListJobsResponse ListJobs(Connection& c, const std::string& study) {
  grpc::ClientContext ctx;
  c.Prepare(&ctx);
  v1::ListJobsRequest req;
  req.set_study(study);
  v1::ListJobsResponse resp;
  const grpc::Status s = c.ops().ListJobs(&ctx, req, &resp);
  if (!s.ok()) c.FailCall(s, "ListJobs");
  // A coordinator older than studies ignores the filter and sends every job.
  v1::ListJobsResponse runs;
  for (auto& j : *resp.mutable_jobs()) {
    if (study.empty() || j.study() == study) *runs.add_jobs() = std::move(j);
  }
  return runs;
}

nlohmann::json TallyJson(const StudyTally& t) {
  return {{"study", t.study},
          {"runs", t.runs},
          {"running", t.running},
          {"stale", t.stale},
          {"finished", t.finished}};
}

// "3 runs: 1 running, 1 stale, 1 finished"
std::string CountsLine(const StudyTally& t) {
  return std::to_string(t.runs) + (t.runs == 1 ? " run: " : " runs: ") + std::to_string(t.running) +
         " running, " + std::to_string(t.stale) + " stale, " + std::to_string(t.finished) +
         " finished\n";
}

int ListStudies(Connection& c, bool json) {
  const std::vector<StudyTally> studies = TallyStudies(ListJobs(c, ""));
  if (json) {
    nlohmann::json arr = nlohmann::json::array();
    for (const StudyTally& t : studies) arr.push_back(TallyJson(t));
    PrintJson({{"studies", std::move(arr)}});
    return 0;
  }
  if (studies.empty()) {
    Print("no studies on " + c.address() + " (cpd-train --study NAME tags a run)\n");
    FlushStdout();
    return 0;
  }
  using A = Table::Align;
  Table t({{"STUDY", A::kLeft},
           {"RUNS", A::kRight},
           {"RUNNING", A::kRight},
           {"STALE", A::kRight},
           {"FINISHED", A::kRight}});
  for (const StudyTally& s : studies) {
    t.AddRow({s.study, std::to_string(s.runs), std::to_string(s.running), std::to_string(s.stale),
              std::to_string(s.finished)});
  }
  Print(t.Render());
  FlushStdout();
  return 0;
}

// The runs' table: a language model's validation perplexity and bits per byte where a vision
// model's test accuracy is (both when a study has both kinds of runs).
Table RunsTable(const v1::ListJobsResponse& runs) {
  bool lm = false, vision = false;
  for (const auto& j : runs.jobs()) {
    lm = lm || Measured(j.test_perplexity());
    vision = vision || (!Measured(j.test_perplexity()) && j.test_accuracy() >= 0);
  }
  using A = Table::Align;
  std::vector<Table::Column> cols = {
      {"RUN", A::kLeft}, {"STATE", A::kLeft}, {"STEP", A::kRight}, {"EPOCH", A::kRight}};
  if (vision || !lm) cols.push_back({"TEST ACC", A::kRight});
  if (lm) cols.insert(cols.end(), {{"VAL PPL", A::kRight}, {"BPB", A::kRight}});
  cols.insert(cols.end(), {{"LOSS", A::kRight}, {"LAST REPORT", A::kRight}});
  Table t(std::move(cols));
  const int64_t now = cpd::launcher::NowMs();
  for (const auto& j : runs.jobs()) {
    std::vector<std::string> cells = {j.job_name(), j.state(), Ratio(StepsDone(j), j.total_steps()),
                                      Ratio(j.epoch(), j.epochs())};
    if (vision || !lm) {
      cells.push_back(Measured(j.test_perplexity()) ? "-" : FormatAccuracy(j.test_accuracy()));
    }
    if (lm) {
      cells.push_back(FormatMeasured(j.test_perplexity(), 2));
      cells.push_back(FormatMeasured(j.test_bits_per_byte(), 3));
    }
    cells.push_back(j.last_report_ms() > 0 ? FormatG(j.loss(), 4) : "-");
    cells.push_back(ReportAge(j, now));
    t.AddRow(std::move(cells));
  }
  return t;
}

int ShowStudy(Connection& c, const std::string& study, bool json) {
  const v1::ListJobsResponse runs = ListJobs(c, study);
  const std::vector<StudyTally> tally = TallyStudies(runs);
  StudyTally counts = tally.empty() ? StudyTally{study} : tally[0];
  if (json) {
    nlohmann::json j = ToJson(runs);
    j["study"] = study;
    j["counts"] = TallyJson(counts);
    PrintJson(j);
    return 0;
  }
  if (runs.jobs().empty()) {
    Print("no runs in study '" + study + "' on " + c.address() +
          " (cpdctl study lists the studies)\n");
    FlushStdout();
    return 0;
  }
  Print(RunsTable(runs).Render() + CountsLine(counts));
  FlushStdout();
  return 0;
}

}  // namespace

int RunStudy(const Globals& g, const std::string& study) {
  if (!study.empty()) CheckStudyName(study);
  Connection c(g);
  return study.empty() ? ListStudies(c, g.json) : ShowStudy(c, study, g.json);
}

}  // namespace cpd::ctl
