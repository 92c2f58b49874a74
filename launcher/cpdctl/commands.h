// The commands of cpdctl, one file per group (jobs_status.cc, study.cc, layers.cc, schedule.cc,
// watch.cc, export_plot.cc); main.cc declares their options and calls the one the command line
// names. Each returns the exit code, or exits through Usage()/Fail().
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "launcher/cpdctl/client.h"
#include "launcher/cpdctl/output.h"
#include "launcher/cpdctl/schedule_edits.h"

namespace cpd::ctl {

int RunJobs(const Globals& g);
int RunStatus(const Globals& g, const std::string& job);
// `cpdctl study NAME`: the study's runs and their states; `cpdctl study` (empty NAME): the
// studies known.
int RunStudy(const Globals& g, const std::string& study);

struct LayersArgs {
  std::string job;
  int64_t step = -1, from = -1, to = -1;
  std::string sort;
  std::string site;
  int top = 0;
  int limit = 0;
};
int RunLayers(const Globals& g, const LayersArgs& a);

int RunScheduleGet(const Globals& g, const std::string& job, bool history);
int RunScheduleSet(const Globals& g, const std::string& job, const ScheduleEdits& e,
                   uint64_t expect_version);

struct WatchArgs {
  std::string job;
  bool layers = false;
  int count = 0;
  double interval_s = 1;
};
int RunWatch(const Globals& g, const WatchArgs& a);

// export and plot: a range of the stored history into a file.
struct RangeArgs {
  std::string job;
  std::string out;
  int64_t from = -1, to = -1;
};
int RunExport(const Globals& g, const RangeArgs& a);
int RunPlot(const Globals& g, const RangeArgs& a);

// ---- Pieces that two command groups share -------------------------------------------------------

// The status block of `status` and `watch`; `age_ms` is the last report's age (-1: none).
std::string StatusBlock(const v1::JobStatusResponse& st, int64_t age_ms);
// "a / b", "a / ?" when b is unknown.
std::string Ratio(int64_t a, int64_t b);
// Steps a job has done: a report's step is the index of the step just done (steps count from
// 0), so one more; before any report, the summary's step is where the run starts.
int64_t StepsDone(const v1::JobSummary& j);
// "12.3 s ago" from the coordinator's last_report_ms and this machine's clock; "-" for none.
std::string ReportAge(const v1::JobSummary& j, int64_t now_ms);
// The layer rows of `resp` at `site` (empty: all), sorted, at most `top` per report (0: all).
std::vector<LayerRow> SelectRows(const v1::LayerStatsResponse& resp, const std::string& site,
                                 const std::string& sort, int top);
// The line above a one-report layer table.
std::string ReportHeadline(const std::string& job, const v1::StatsReport& r);

}  // namespace cpd::ctl
