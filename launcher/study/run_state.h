// A run's state file (<run>/state.json), written atomically by whoever runs it, the run
// directory's lock, and what `cpd-study status` makes of them.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cpd/status.h"
#include "launcher/study/plan.h"

namespace cpd::launcher::study {

// cpd-train's exit code for a run that diverged (NaN/Inf loss or parameter, or too many skipped
// steps in a row): a result of the run, not a failure of it.
inline constexpr int kDivergedExit = 3;

struct RunState {
  // pending (no file) | running | done | diverged | failed. A file of an earlier cpd-study may
  // say failed with exit code 3: Classify reads that as diverged.
  std::string state = "pending";
  int exit_code = -1;                // of the last attempt (done: 0, diverged: 3)
  int64_t start_ms = 0, end_ms = 0;  // the last attempt, Unix epoch milliseconds
  double wall_s = 0;                 // the last attempt
  // Every attempt's, summed; an attempt that was killed counts until the last line it wrote
  // (InterruptedSeconds), added when the run is next started.
  double total_wall_s = 0;
  int attempts = 0;
  std::string host;  // where the last attempt ran
  long pid = 0;      // of the process that runs it (cpd-study run-one), while running
  // diverged: the step it stopped at, the loss logged there (NaN when it was NaN or not logged)
  // and cpd-train's reason; -1 / NaN / "" otherwise or when the metrics do not say.
  int64_t diverged_step = -1;
  double diverged_loss = std::numeric_limits<double>::quiet_NaN();
  std::string diverged_reason;
};

// The state in `path`; "pending" when there is no file. A file that cannot be used is a
// Corruption whose message is the one line every command shows for it (UnreadableStateLine).
Result<RunState> ReadState(const std::string& path);
Status WriteState(const std::string& path, const RunState& s);

std::string HostName();

// What a run is now: done, diverged, failed, running, interrupted, pending. A state "running"
// on this host is running only while the run directory's lock is held (by the run-one that runs
// it); otherwise its process is gone, whatever now has its pid, and it is interrupted (`run`
// resumes it from its checkpoints). On another host it cannot be checked and stays running.
std::string Classify(const RunState& s, const RunPaths& p);

// Whether a diverged run's state: "diverged", or "failed" with exit code 3 (an earlier cpd-study).
bool IsDiverged(const RunState& s);

// Whether a process holds the run directory's lock: 1 yes, 0 no, -1 cannot be told (the lock
// file cannot be opened). Only asks (F_OFD_GETLK): it never takes the lock, so it cannot make a
// run-one that starts at this moment believe that someone else runs its run.
int LockState(const std::string& lock_path);

// Holds the run directory's lock (an open-file-description lock on <run>/.lock, released when
// the process ends, however it ends) so that two launchers never run the same run at once, and
// so that Classify can tell a live run from a dead one without trusting a pid. An OFD lock
// rather than a classic fcntl lock: closing any other descriptor of the file (LockState in the
// same process) would silently drop a classic one.
class RunLock {
 public:
  explicit RunLock(const std::string& lock_path);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;
  bool held() const { return held_; }

 private:
  int fd_ = -1;
  bool held_ = false;
};

// The seconds an attempt that was killed ran (state "running", its process gone): from its
// start to the last write to the run's log, metrics or state; 0 when those say nothing later.
double InterruptedSeconds(const RunState& s, const RunPaths& p);

// Where a run that diverged stopped, from its metrics (the "stop" record's step and reason, the
// loss of a "step" record of that very step) or, without a stop record, its log ("training
// diverged at step N: why"). Without a step record of that step the loss is what the reason
// says (NaN, infinite), else unknown (NaN). Fills the diverged_* fields it finds.
void ReadDivergence(const RunPaths& p, RunState* s);

// "at step 12 (loss 7.6e+10)", "at step 12 (loss nan)", "at step 12" when the loss is unknown,
// "" when the step is.
std::string DivergenceText(const RunState& s);

// The line of a failed run's log that says why: the last line cpd-train wrote about an error
// ("cpd-train: ...", "error"), else the last non-empty line; read from the end of the file only.
std::string LastErrorLine(const std::string& log_path);

// `cpd-study status`: one line per run, then the totals. Returns 0, or 1 when a state file
// cannot be read (its line on stderr, the run counted as unreadable).
int PrintStatus(const Study& study, const std::vector<PlannedRun>& runs, const std::string& out);

}  // namespace cpd::launcher::study
