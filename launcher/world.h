// The processes of a job, for the tools that run on several ranks (cpd-train,
// cpd-format-search): the communicator they share and how a failed job ends.
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.h"
#include "cpd/status.h"

namespace cpd::launcher {

// Whether a parallel launcher (Open MPI's mpirun, Slurm's srun with PMIx or PMI-2) started us.
bool LaunchedByMpi();

// This process's rank and the number of processes, as the launcher's environment says before
// MPI starts (0 and 1 without a launcher, or where it does not say): so that an error found
// before MPI is printed once, by rank 0, and a one-process communicator is refused under a
// parallel launch.
int LaunchRank();
int LaunchSize();

// `kind`: "auto" (MPI when a launcher started us, else one process), "self" or "mpi".
// InvalidArgument for another kind, "mpi" in a build without MPI, or "self" when a launcher
// started several processes; Unavailable when MPI cannot start.
Result<std::unique_ptr<comm::Communicator>> MakeWorld(const std::string& kind);
// Exits `code` after "<tool>: msg" on stderr, printed by rank 0 only: every rank of a launch
// finds the same error in its flags, and one line says it.
[[noreturn]] void FailBeforeWorld(const char* tool, const std::string& msg, int code);

// MakeWorld, or exit with "<tool>: message" (rank 0): 2 for a bad kind, 1 when MPI cannot start.
std::unique_ptr<comm::Communicator> MakeWorldOrExit(const char* tool, const std::string& kind);

// The exit code of a run that diverged (a Status of code OutOfRange from training).
constexpr int kDivergedRun = 3;

// Ends a job after `s` (not OK) and returns the exit code. One process: "<tool>: message".
// Several: an option error (InvalidArgument, exit 2) or a divergence (OutOfRange, exit 3), both
// found alike by every rank, is reported once by rank 0 and every rank exits; any other failure
// may be one rank's alone, and its peers would wait forever in the next collective, so the rank
// reports it and aborts the whole job.
int EndFailedJob(const char* tool, const Status& s, std::unique_ptr<comm::Communicator> comm);

}  // namespace cpd::launcher
