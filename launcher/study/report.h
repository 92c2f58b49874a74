// `cpd-study report`: every run's metrics.jsonl (written by runtime/train/reporter.cc) streamed
// once, line by line, into the tables of <out>/report/: runs.csv, summary.csv, summary.md,
// curves.csv, layers.csv (each written atomically); the plots are drawn from those CSVs by
// scripts/study_plot.py.
//
// Records read: "run" (classes; optional), "epoch" (the last record of an epoch wins: a resumed
// run repeats epochs), "step" with "comm" (per-layer APS shift and flushed fraction of the
// gradient all-reduce; each step counted once), "stop" (the run diverged). A run is COLLAPSED
// when its final test accuracy is <= 1.5 x chance (1 / classes; classes from the "run" record,
// else the run's --classes, else 100 for cifar100 and 10 otherwise), when its final training
// loss is not finite, or when it stopped diverged (a "stop" record, or exit code 3). A run that
// diverged is a result even before its first epoch: it counts as a seed, and as collapsed.
//
// A study with a language model (a "run" record with a block_size) adds the validation
// perplexity and bits per byte to the tables: final and best (the lowest perplexity) per run,
// and per setting their mean ± sample std and the final validation loss's, which summary.md
// shows in place of the accuracies (for a language model the next-token accuracy).
#pragma once

#include <string>
#include <vector>

#include "cpd/status.h"
#include "launcher/study/plan.h"
#include "launcher/study/study_file.h"

namespace cpd::launcher::study {

struct ReportOptions {
  std::string out_dir;
  // Runs whose names match this glob are the reference: every row gets its final test accuracy
  // minus theirs (the mean over the matched runs), and in a study of language models its final
  // validation perplexity and bits per byte minus theirs. "" for none.
  std::string reference_glob;
  // The plot script and its interpreter; no plots when script is "".
  std::string python, script;
};

// The plots of a study's report: what scripts/study_plot.py draws (--plot kind), into which
// file of the report folder, against which axis (accuracy: the global batch when it is an axis,
// else the first axis, e.g. accuracy_vs_lr.png). A study of language models has the validation
// perplexity (bits per byte for byte-level text) per epoch in place of the accuracy plot.
struct PlotSpec {
  std::string kind, file, x_axis;
};
std::vector<PlotSpec> Plots(const Study& study, bool language_model = false);

// Writes the report; returns the paths written. InvalidArgument when --reference matches no
// run; IoError naming the file when a table cannot be written. A plot that cannot be drawn is a
// warning line naming it on stderr, not an error.
Result<std::vector<std::string>> WriteReport(const Study& study,
                                             const std::vector<PlannedRun>& runs,
                                             const ReportOptions& options);

}  // namespace cpd::launcher::study
