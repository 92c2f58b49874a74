// cpd-train: quantised training of one model, on one process or data-parallel under mpirun /
// srun (one rank per process, MPI found from the launcher's environment). Every flag can also be
// set in --config FILE.yaml under the same name without the leading dashes; flags on the command
// line win.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "cpd/config.h"
#include "cpd/format.h"
#include "launcher/cli.h"
#include "launcher/common.h"
#include "launcher/train_flags.h"
#include "runtime/train/trainer.h"
#if CPD_WITH_MPI
#include "comm/mpi_communicator.h"
#endif

namespace {

using cpd::launcher::kUsageError;
constexpr int kDiverged = 3;  // the run stopped because it could not recover

[[noreturn]] void Fail(const std::string& msg, int code = kUsageError) {
  cpd::launcher::FailWith("cpd-train", msg, code);
}

// Whether a parallel launcher (Open MPI's mpirun, Slurm's srun with PMIx or PMI-2) started us.
bool LaunchedByMpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"}) {
    if (std::getenv(var) != nullptr) return true;
  }
  return false;
}

// --comm: MPI when asked for or started by a parallel launcher, else this process alone.
std::unique_ptr<cpd::comm::Communicator> MakeCommunicator(const std::string& comm_kind) {
  std::unique_ptr<cpd::comm::Communicator> comm;
  if (comm_kind == "mpi" || (comm_kind == "auto" && LaunchedByMpi())) {
#if CPD_WITH_MPI
    auto c = cpd::comm::MpiCommunicator::Create();
    if (!c.ok()) Fail("--comm mpi: " + c.status().message(), 1);
    comm = std::move(c.value());
#else
    if (comm_kind == "mpi") Fail("--comm mpi: this build has no MPI (CPD_WITH_MPI=OFF)");
#endif
  } else if (comm_kind != "auto" && comm_kind != "self") {
    Fail("--comm '" + comm_kind + "' (accepted: auto, self, mpi)");
  }
  if (comm == nullptr) comm = std::make_unique<cpd::comm::SelfCommunicator>();
  return comm;
}

// The exit code of a failed run, after saying why: 2 for options, 3 for a run that diverged,
// 1 for anything else.
int TrainingFailed(const cpd::Status& s, std::unique_ptr<cpd::comm::Communicator> comm) {
  const bool usage = s.code() == cpd::Status::Code::kInvalidArgument;
  const bool diverged = s.code() == cpd::Status::Code::kOutOfRange;
  const int code = usage ? kUsageError : diverged ? kDiverged : 1;
  if (comm->size() == 1) Fail(s.message(), code);
  // Option errors and divergence are found alike by every rank: rank 0 reports them and all
  // exit. Any other failure may be one rank's alone, and its peers would wait forever: abort the
  // job.
  if (usage || diverged) {
    if (comm->rank() == 0) std::fprintf(stderr, "cpd-train: %s\n", s.message().c_str());
    comm.reset();
    return code;
  }
  std::fprintf(stderr, "cpd-train: rank %d: %s\n", comm->rank(), s.message().c_str());
#if CPD_WITH_MPI
  if (auto* mpi = dynamic_cast<cpd::comm::MpiCommunicator*>(comm.get())) {
    MPI_Abort(mpi->mpi_comm(), 1);
  }
#endif
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  cpd::runtime::TrainOptions o;
  cpd::launcher::TrainFlags f;
  CLI::App app{
      "cpd-train: train a model with every data flow held in a CPD number format.\n"
      "Quantisation sites of each Linear/Conv2d layer: W weights, A input activations, "
      "E errors (output gradients), G weight gradients.\n" +
      std::string(cpd::FormatSpecHelp())};
  app.set_version_flag("--version", std::string("cpd-train ") + CPD_VERSION);
  app.footer(
      "Exit codes: 0 done; 1 failure (data, checkpoint, I/O, MPI); 2 usage error (bad flag or "
      "value, a checkpoint of another run); 3 training diverged (NaN/Inf loss or parameter, or "
      "--max-skipped-steps consecutive skipped steps).");
  cpd::launcher::AddTrainOptions(&app, &o, &f);

  if (const int code = cpd::launcher::ParseArgs(app, argc, argv, "cpd-train"); code >= 0) {
    return code;
  }
  if (!f.config_path.empty()) {
    if (const cpd::Status s = cpd::launcher::ApplyConfigFile(app, f.config_path); !s.ok()) {
      Fail(s.message());
    }
  }
  if (const cpd::Status s = cpd::launcher::ApplyTrainFlags(app, &f, &o); !s.ok()) {
    Fail(s.message());
  }
  std::unique_ptr<cpd::comm::Communicator> comm = MakeCommunicator(f.comm_kind);
  auto result = cpd::runtime::Train(o, comm.get());
  if (!result.ok()) return TrainingFailed(result.status(), std::move(comm));
  return 0;
}
