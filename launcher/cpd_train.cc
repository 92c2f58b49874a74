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
#include "launcher/world.h"
#include "runtime/train/trainer.h"

namespace {

using cpd::launcher::kUsageError;

// Before MPI starts every rank finds the same error: rank 0 says it.
[[noreturn]] void Fail(const std::string& msg, int code = kUsageError) {
  cpd::launcher::FailBeforeWorld("cpd-train", msg, code);
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
  if (f.check) return 0;
  std::unique_ptr<cpd::comm::Communicator> comm =
      cpd::launcher::MakeWorldOrExit("cpd-train", cpd::launcher::WorldKind(f));
  auto result = cpd::runtime::Train(o, comm.get());
  if (!result.ok()) {
    return cpd::launcher::EndFailedJob("cpd-train", result.status(), std::move(comm));
  }
  return 0;
}
