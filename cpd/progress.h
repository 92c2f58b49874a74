// How a long command shows its progress (--progress auto|bar|lines|off) and how often a plain
// progress line may be written: the one home of that policy for cpd-train and
// cpd-format-search.
//
// Batch jobs are CPD's main users, and their output ends in a file: sbatch's .out, a redirect,
// or mpirun's, whose ranks write to a pseudo-terminal that Open MPI opens even when the job's
// own output is a file (so isatty says yes). A bar redrawn with '\r' there becomes one unreadable
// line per epoch. So `auto` draws the bar only on a terminal that no process manager (mpirun,
// srun) launched, and plain lines come at a bounded rate: a few per epoch, not one per step.
#pragma once

#include <chrono>
#include <cstdint>
#include <string_view>

#include "cpd/status.h"

namespace cpd {

enum class ProgressMode {
  kAuto,   // kBar on an interactive terminal, kLines otherwise (ResolveProgressMode)
  kBar,    // one line redrawn in place with '\r'
  kLines,  // plain lines at a bounded rate (ProgressLineRate), never a '\r'
  kOff,    // nothing
};

// "auto", "bar", "lines" or "off"; InvalidArgument naming the accepted values otherwise.
Result<ProgressMode> ParseProgressMode(std::string_view text);
const char* ProgressModeName(ProgressMode mode);

// Whether this process was started by mpirun/mpiexec (Open MPI, MPICH, PMIx) or by Slurm's srun:
// its stdout may be a pseudo-terminal while the output goes to a file.
bool LaunchedByProcessManager();

// kAuto made concrete for this process's stdout: kBar when stdout is a terminal and no process
// manager launched the process, else kLines. Other modes are returned as they are.
ProgressMode ResolveProgressMode(ProgressMode mode);

// When a plain progress line is due over a pass of `total` units (an epoch's batches, a search's
// rounds): at the pass's last unit always; otherwise only when at least `interval_s` seconds
// AND at least a tenth of the pass have gone by since the last line (whichever is rarer), so a
// pass writes at most 10 lines however fast or slow its units are.
class ProgressLineRate {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr int kMaxLinesPerPass = 10;

  // `start`: the time the first interval counts from.
  ProgressLineRate(double interval_s, Clock::time_point start);

  // Unit `done` (1-based) of `total` is finished at `now`: whether to write a line. A `done` at
  // or below the last line's starts a new pass (the next epoch).
  bool Due(int64_t done, int64_t total, Clock::time_point now);

 private:
  double interval_s_;
  Clock::time_point last_time_;
  int64_t last_done_ = 0;
};

}  // namespace cpd
