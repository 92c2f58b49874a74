// cpd-train's command line as a library: every flag, --config YAML, the presets and the checks
// that turn flags into TrainOptions. cpd-train's main uses it, and so does the fuzz target of
// the YAML config (tests/fuzz/train_config_fuzz.cc), which is why nothing here exits or throws:
// every problem is an InvalidArgument naming the flag (or the config key) and what is accepted.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "cpd/status.h"
#include "runtime/train/train_options.h"

namespace YAML {
class Node;
}  // namespace YAML

namespace cpd::launcher {

// The flags that are not fields of TrainOptions, as parsed; ApplyTrainFlags turns them into
// options.
struct TrainFlags {
  std::string config_path, preset;
  bool augment = false, no_augment = false;
  bool untied_head = false;  // --untied-head
  std::string wf = "fp32", af = "fp32", ef = "fp32", gf = "fp32";
  std::string wr = "nearest", ar = "nearest", er = "nearest", gr = "nearest";
  std::vector<std::string> layer_formats;
  std::string keep_fp32;
  std::vector<int> cyclic_bits;
  int cyclic_periods = 32;
  std::string cost_reference = "8/8";
  std::string gradients = "device";
  std::string comm_kind = "auto", algo = "fp32", ar_format = "e4m3", ar_rounding = "nearest";
  std::string aps_scaling = "auto";
  std::vector<std::string> ar_layer_formats;  // --allreduce-layer-format NAME=SPEC
  std::string token_file, tls_ca;
  std::string progress = "auto";
  bool no_progress = false;  // the older spelling of --progress off
  bool check = false;        // --check: validate and exit
  std::string optimizer = "sgd", lr_schedule = "cosine", device = "auto";
  std::string lars_exclude = "bias-bn", lr_scaling = "none";
  std::string loss_scale = "off";
  double loss_scale_init = 65536;
  int64_t loss_scale_growth_interval = 2000;
};

// Adds every cpd-train flag to `app`, bound to *o and *f (which must outlive it).
void AddTrainOptions(CLI::App* app, runtime::TrainOptions* o, TrainFlags* f);

// One key of a config: a long flag name without dashes and its values (a scalar is one value).
struct ConfigEntry {
  std::string key;
  std::vector<std::string> values;
};

// The values a YAML node gives a flag: a scalar is one value, a list of scalars one per item (an
// empty list none). Anything else is InvalidArgument "expected a scalar or a list of scalars".
// The one reading of config values for --config files and cpd-study's study files.
Result<std::vector<std::string>> FlagValuesOf(const YAML::Node& node);

// Applies `entries` in order to the options the command line did not give, as if each value had
// been given to the flag: the one path from config keys to options (the YAML loader below and
// cpd-study's check of every planned run use it). Errors name `origin` and the key.
Status ApplyConfigEntries(CLI::App& app, const std::vector<ConfigEntry>& entries,
                          const std::string& origin);

// Applies the keys of a YAML mapping (`yaml`, called `origin` in messages) to the options the
// command line did not give. Keys are the long flag names without dashes; values are scalars or
// lists of scalars.
Status ApplyConfigText(CLI::App& app, const std::string& yaml, const std::string& origin);
// The same for the file at `path` ("--config PATH" in messages).
Status ApplyConfigFile(CLI::App& app, const std::string& path);

// Everything the flags say beyond the options they set directly: presets, formats, enums, the
// coordinator's address, token and certificates (read here); then the whole of the options
// through runtime::ValidateTrainOptions, so that a bad value is found before MPI starts and
// cpd-study's plan refuses what the run would.
Status ApplyTrainFlags(const CLI::App& app, TrainFlags* f, runtime::TrainOptions* o);

// The kind of the run's own communicator for launcher/world.h's MakeWorld: --comm, with nccl
// (which names the gradient all-reduce's transport) starting the processes as auto does.
std::string WorldKind(const TrainFlags& f);

}  // namespace cpd::launcher
