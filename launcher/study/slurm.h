// The Slurm launcher of cpd-study: the runs that are not done become one job array of
// scripts/slurm/cpd_study_array.sbatch. Array task I runs `cpd-study run-one STUDY --index I
// --launcher slurm`, which starts run I's ranks with `srun --mpi=pmix` inside the task's
// allocation (--ntasks = the study's ranks). Everything else (run directories, state files,
// resume from checkpoints, never touching a finished run) is run-one's, as with the local
// launcher; so a requeued task (--requeue) resumes its run.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "launcher/study/plan.h"
#include "launcher/study/runner.h"
#include "launcher/study/study_file.h"

namespace cpd::launcher::study {

struct SlurmOptions {
  RunOptions run;
  int parallel = 0;        // array tasks at a time (sbatch --array=...%K); 0: as Slurm schedules
  bool wait = false;       // sbatch --wait: return when every task has ended
  std::string self;        // this cpd-study (exported to the tasks as CPD_STUDY)
  std::string study_path;  // the study file the tasks read
  std::string script;      // the batch script
  std::vector<std::string> sbatch_args;  // site options (--partition, --gpus-per-task, ...)
};

// Slurm's array syntax for ascending indices: {0,1,2,5,7,8} -> "0-2,5,7-8".
std::string ArraySpec(const std::vector<size_t>& indices);

// The sbatch command that submits `indices` of the plan as one array.
std::vector<std::string> SbatchCommand(const Study& study, const std::vector<size_t>& indices,
                                       const SlurmOptions& o);

// `cpd-study run --launcher slurm`: checks that Slurm answers (sinfo, 20 s), submits every run
// that is neither done nor failed (failed too with retry_failed) nor running, and says the job
// id. With `wait`, returns when the array has ended and prints the study's totals. Returns 0
// when the submission worked (and, with wait, every run is done); 1 otherwise, said in one line.
int RunSlurm(const Study& study, const std::vector<PlannedRun>& runs, const SlurmOptions& o);

// run-one inside a Slurm allocation: InvalidArgument when SLURM_NTASKS is set and differs from
// the study's ranks (the task was submitted with the wrong --ntasks).
Status CheckSlurmTask(const Study& study);

}  // namespace cpd::launcher::study
