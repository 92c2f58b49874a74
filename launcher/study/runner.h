// Running a study's runs. RunOne is the per-run task: it runs one planned run to its end in the
// run's directory (state file, config, command, log, checkpoints, metrics) and is what every
// launcher executes for a run (`cpd-study run-one STUDY --index I`: the local launcher below
// starts it K at a time; a Slurm array task runs it with its array index). A launcher only
// decides which runs start where and when.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "launcher/study/plan.h"
#include "launcher/study/study_file.h"

namespace cpd::launcher::study {

struct RunOptions {
  LaunchSpec launch;
  bool retry_failed = false;  // run a failed run again (it resumes from its checkpoints)
};

// RunOne's exit code when another process holds the run's lock (it runs the run): nothing was
// done, and a launcher counts the run as running elsewhere, not as failed (EX_TEMPFAIL).
inline constexpr int kRunOwnedElsewhere = 75;

// Runs `run` unless it is done or diverged (nothing is touched), failed without retry_failed,
// or being run by another process (its directory's lock is held). An interrupted run resumes
// from its checkpoints (cpd-train --resume auto). A run whose cpd-train exits 3 (diverged) is
// finished: its state is "diverged", with the step and loss its metrics or log give. Returns 0
// when the run is done or diverged (now or before), kRunOwnedElsewhere, cpd-train's exit code
// when it failed, or 1 when it was not run or cpd-study itself failed (said on stderr).
int RunOne(const Study& study, const PlannedRun& run, const RunOptions& options);

// Where a study's runs stand before a launcher starts any: done, diverged, failed (not to be
// retried), running elsewhere, unreadable (their lines), and the plan indices to run (pending,
// interrupted, and failed ones when retry_failed), in plan order. Diverged runs are results and
// never run again, --retry-failed or not.
struct RunTally {
  size_t done = 0, diverged = 0, failed = 0, running = 0;
  std::vector<std::string> unreadable;  // one line per state file that cannot be used
  std::vector<size_t> to_run;
};
RunTally TallyRuns(const std::vector<PlannedRun>& runs, const std::string& out_dir,
                   bool retry_failed);

struct LocalOptions {
  RunOptions run;
  int parallel = 1;        // runs at a time
  bool progress = true;    // a line per start and end (failures and the summary regardless)
  std::string self;        // this executable (run-one is started through it)
  std::string study_path;  // the study file run-one is given
};

// `cpd-study run --launcher local`: every run that is not done or diverged (and not failed,
// unless retry_failed) in plan order, `parallel` at a time, with a progress line per start and
// end (with `progress`); a run another process turns out to run is skipped with a line. Returns 0
// when no run failed and every state file could be read (every run done, diverged or running
// elsewhere), 1 otherwise (after running the rest).
int RunLocal(const Study& study, const std::vector<PlannedRun>& runs, const LocalOptions& o);

// Starts argv (execvp: a bare name is looked up on $PATH) with stdout and stderr on the given
// descriptors (-1: inherited) and stdin on /dev/null; the child gets SIGTERM when this process
// dies. Returns its pid, or -1.
pid_t SpawnProcess(const std::vector<std::string>& argv, int out_fd, int err_fd);
// Waits for a child: its exit status, or 128 + the signal that ended it.
int WaitForExit(pid_t pid);

// The first executable called `name` on $PATH ("" if none).
std::string FindOnPath(const std::string& name);

}  // namespace cpd::launcher::study
