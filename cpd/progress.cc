#include "cpd/progress.h"

#include <unistd.h>

#include <cstdlib>
#include <string>

#include "cpd/message.h"

namespace cpd {

Result<ProgressMode> ParseProgressMode(std::string_view text) {
  for (ProgressMode m :
       {ProgressMode::kAuto, ProgressMode::kBar, ProgressMode::kLines, ProgressMode::kOff}) {
    if (text == ProgressModeName(m)) return m;
  }
  return Status::InvalidArgument("progress " + QuoteForMessage(text) +
                                 " (accepted: auto, bar, lines, off)");
}

const char* ProgressModeName(ProgressMode mode) {
  switch (mode) {
    case ProgressMode::kAuto:
      return "auto";
    case ProgressMode::kBar:
      return "bar";
    case ProgressMode::kLines:
      return "lines";
    case ProgressMode::kOff:
      return "off";
  }
  return "auto";
}

bool LaunchedByProcessManager() {
  // Open MPI, PMIx (Open MPI 4+, Slurm's --mpi=pmix), PMI-1/2 (MPICH, Slurm's --mpi=pmi2), and
  // srun itself, which sets SLURM_STEP_ID in every task of a job step whatever --mpi says.
  for (const char* var :
       {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "SLURM_STEP_ID"}) {
    if (std::getenv(var) != nullptr) return true;
  }
  return false;
}

ProgressMode ResolveProgressMode(ProgressMode mode) {
  if (mode != ProgressMode::kAuto) return mode;
  return isatty(STDOUT_FILENO) != 0 && !LaunchedByProcessManager() ? ProgressMode::kBar
                                                                   : ProgressMode::kLines;
}

ProgressLineRate::ProgressLineRate(double interval_s, Clock::time_point start)
    : interval_s_(interval_s), last_time_(start) {}

bool ProgressLineRate::Due(int64_t done, int64_t total, Clock::time_point now) {
  if (done <= last_done_) last_done_ = 0;  // a new pass
  // A tenth of the pass, rounded up: at most 9 lines before the last unit's.
  const int64_t min_units = (total + kMaxLinesPerPass - 1) / kMaxLinesPerPass;
  const bool due =
      done >= total || (done - last_done_ >= min_units &&
                        std::chrono::duration<double>(now - last_time_).count() >= interval_s_);
  if (due) {
    last_time_ = now;
    last_done_ = done >= total ? 0 : done;
  }
  return due;
}

}  // namespace cpd
