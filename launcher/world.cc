#include "launcher/world.h"

#include <cstdio>
#include <cstdlib>

#include "cpd/config.h"
#include "launcher/cli.h"
#if CPD_WITH_MPI
#include "comm/mpi_communicator.h"
#endif

namespace cpd::launcher {

bool LaunchedByMpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"}) {
    if (std::getenv(var) != nullptr) return true;
  }
  return false;
}

namespace {

// A whole number from the environment variable `name`, or -1 when unset or not a number.
long EnvNumber(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return -1;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  return *end == '\0' && n >= 0 ? n : -1;
}

}  // namespace

int LaunchRank() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}) {
    if (const long r = EnvNumber(var); r >= 0) return int(r);
  }
  return 0;
}

int LaunchSize() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
    if (const long n = EnvNumber(var); n >= 1) return int(n);
  }
  // srun --mpi=pmix sets no size of its own; the step's task count is it (only inside a step
  // that a launcher started: a batch script's own shell has SLURM_NTASKS but is one process).
  if (std::getenv("PMIX_RANK") != nullptr) {
    if (const long n = EnvNumber("SLURM_STEP_NUM_TASKS"); n >= 1) return int(n);
  }
  return 1;
}

Result<std::unique_ptr<comm::Communicator>> MakeWorld(const std::string& kind) {
  if (kind != "auto" && kind != "self" && kind != "mpi") {
    return Status::InvalidArgument("--comm '" + kind + "' (accepted: auto, self, mpi)");
  }
  // Every process of the launch would train alone, into the same checkpoint folder and metrics
  // file (each record written once per process): refused rather than run.
  if (kind == "self" && LaunchSize() > 1) {
    return Status::InvalidArgument(
        "--comm self, but a launcher started " + std::to_string(LaunchSize()) +
        " processes: each would train alone and write the same checkpoints and metrics; use "
        "--comm auto or mpi (one data-parallel job), or start one process");
  }
  if (kind == "mpi" || (kind == "auto" && LaunchedByMpi())) {
#if CPD_WITH_MPI
    auto c = comm::MpiCommunicator::Create();
    if (!c.ok()) return Status::Unavailable("--comm mpi: " + c.status().message());
    return std::unique_ptr<comm::Communicator>(std::move(c).value());
#else
    if (kind == "mpi") {
      return Status::InvalidArgument("--comm mpi: this build has no MPI (CPD_WITH_MPI=OFF)");
    }
#endif
  }
  return std::unique_ptr<comm::Communicator>(std::make_unique<comm::SelfCommunicator>());
}

void FailBeforeWorld(const char* tool, const std::string& msg, int code) {
  if (LaunchRank() != 0) std::exit(code);
  FailWith(tool, msg, code);
}

std::unique_ptr<comm::Communicator> MakeWorldOrExit(const char* tool, const std::string& kind) {
  auto world = MakeWorld(kind);
  if (!world.ok()) {
    FailBeforeWorld(tool, world.status().message(),
                    world.status().code() == Status::Code::kInvalidArgument ? kUsageError : 1);
  }
  return std::move(world).value();
}

int EndFailedJob(const char* tool, const Status& s, std::unique_ptr<comm::Communicator> comm) {
  const bool usage = s.code() == Status::Code::kInvalidArgument;
  const bool diverged = s.code() == Status::Code::kOutOfRange;
  const int code = usage ? kUsageError : diverged ? kDivergedRun : 1;
  if (comm == nullptr || comm->size() == 1) {
    std::fprintf(stderr, "%s: %s\n", tool, s.message().c_str());
    return code;
  }
  if (usage || diverged) {
    if (comm->rank() == 0) std::fprintf(stderr, "%s: %s\n", tool, s.message().c_str());
    comm.reset();
    return code;
  }
  std::fprintf(stderr, "%s: rank %d: %s\n", tool, comm->rank(), s.message().c_str());
#if CPD_WITH_MPI
  if (auto* mpi = dynamic_cast<comm::MpiCommunicator*>(comm.get())) MPI_Abort(mpi->mpi_comm(), 1);
#endif
  return 1;
}

}  // namespace cpd::launcher
