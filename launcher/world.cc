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

Result<std::unique_ptr<comm::Communicator>> MakeWorld(const std::string& kind) {
  if (kind != "auto" && kind != "self" && kind != "mpi") {
    return Status::InvalidArgument("--comm '" + kind + "' (accepted: auto, self, mpi)");
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

std::unique_ptr<comm::Communicator> MakeWorldOrExit(const char* tool, const std::string& kind) {
  auto world = MakeWorld(kind);
  if (!world.ok()) {
    FailWith(tool, world.status().message(),
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
