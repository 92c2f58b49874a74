// The runs a study expands to, in plan order (the first axis outermost, seeds innermost), each
// with a stable name and the cpd-train flags it runs with; and the commands that run them.
#pragma once

#include <string>
#include <vector>

#include "cpd/status.h"
#include "launcher/study/study_file.h"

namespace cpd::launcher::study {

struct PlannedRun {
  size_t index = 0;                 // position in the plan (run-one --index)
  std::string name;                 // e.g. global-batch_512.aps_on.seed_1
  std::vector<std::string> labels;  // per axis: the value as the name spells it
  long long seed = 0;
  // The run's cpd-train flags: base, then the axes, then emulate-ranks (from workers) and seed.
  // Boolean flags appear only when true (value "true").
  std::vector<ConfigEntry> flags;
  std::vector<bool> boolean;  // per flag: a boolean flag (given bare on a command line)
};

// Expands the grid (minus the exclusions) and checks every run as cpd-train would: the flags
// through cpd-train's own parser and checks, the global batch against the workers, unique names.
// An error is one line naming the run and the flag; a grid of more than 100,000 runs is refused.
//
// Names: "<axis>_<value>" per axis in file order, then "seed_<n>", joined with '.'; values as
// ValueLabel spells them. They depend only on the run's own values, so adding a value or a seed
// to the study never renames an existing run.
Result<std::vector<PlannedRun>> ExpandPlan(const Study& study);

// Where and with what a run's cpd-train is started.
struct LaunchSpec {
  std::string cpd_train;    // the executable
  std::string out_dir;      // the study's output directory
  std::string coordinator;  // HOST:PORT, or "" for none
  bool srun = false;        // inside a Slurm allocation: the ranks start with srun, not mpirun
};

// The files of a run under <out>/runs/<name>/.
struct RunPaths {
  std::string dir, config, cmd, metrics, log, checkpoints, state;
  std::string lock;  // held (fcntl) by the process that runs it, for as long as it runs
};
RunPaths PathsOf(const std::string& out_dir, const std::string& run_name);

// The command that runs `run`: "srun --mpi=pmix -n R" (launch.srun), else "mpirun -np R
// [--allow-run-as-root --oversubscribe]" (as root) unless R is 1; then cpd-train, then either
// --config <run>/config.yaml (`inline_flags` false: what `run` executes) or the flags themselves
// (what `plan` shows), then the flags cpd-study owns:
// --resume auto --checkpoint-dir --metrics-out [--coordinator --job-name --study]. (Progress
// stays on: without a terminal it is a plain line every few seconds, which log.txt keeps.)
std::vector<std::string> RunCommand(const Study& study, const PlannedRun& run,
                                    const LaunchSpec& launch, bool inline_flags);

// The run's flags as the YAML of --config.
std::string ConfigYaml(const Study& study, const PlannedRun& run);

// argv as one shell-quoted line.
std::string ShellLine(const std::vector<std::string>& argv);

}  // namespace cpd::launcher::study
