// The single-process trainer behind cpd-train: data, model, precision policy, optimiser,
// schedules, statistics, metrics, checkpoints and bit-identical resume.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "cpd/status.h"
#include "runtime/quant_sites.h"

namespace cpd::runtime {

struct TrainOptions {
  // Data and model.
  std::string dataset = "fashion-mnist";  // fashion-mnist | mnist | cifar10 | cifar100 | synthetic
  std::string data_dir;                   // default per dataset (see runtime/data.h)
  std::string arch = "lenet5";            // mlp | lenet5 | resnet<6n+2>
  int in_channels = 0, image_size = 0, classes = 0;  // 0: from the dataset
  bool augment = false;                              // random crop + flip (default on for CIFAR)
  bool augment_set = false;
  // Optimisation.
  int epochs = 10;
  int64_t max_steps = 0;  // stop after this many steps in total (0: run all epochs)
  int batch_size = 128;
  std::string optimizer = "sgd";  // sgd | lars
  double lr = 0.05, momentum = 0.9, weight_decay = 5e-4;
  bool nesterov = false;
  double lars_eta = 0.001;
  std::string lr_schedule = "cosine";  // constant | step | cosine
  int64_t warmup_steps = 0;
  std::vector<int64_t> lr_milestones;  // epochs, for "step"
  double lr_gamma = 0.1;
  uint64_t seed = 1;
  int threads = 0;  // 0: all cores
  // Precision.
  PrecisionConfig precision;
  // Output.
  int64_t stats_every = 100;  // per-layer statistics every N steps (0: never)
  std::string metrics_out;    // JSONL
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;  // steps (0: only at the end of each epoch when a dir is set)
  std::string resume;            // "" | "auto" | a checkpoint path
  std::string device = "auto";   // auto | cpu | cuda
  bool print_model = false;
  bool progress = true;  // a bar on a terminal; plain lines otherwise
  bool quiet = false;
  bool eval_each_epoch = true;
};

// The outcome of a run (for tests and callers).
struct TrainResult {
  int64_t steps = 0;
  int epochs_done = 0;
  double final_loss = 0;
  double train_accuracy = 0;
  double test_accuracy = 0;
  double ms_per_step = 0;
  std::vector<double> step_losses;  // every step's training loss, in order
  double relative_cost = 0;         // CPT cost model vs static max bits (0 without CPT)
};

// Validates options (clear messages naming the flag); then trains. Prints to stdout unless
// quiet. Writes metrics/checkpoints when asked.
Result<TrainResult> Train(const TrainOptions& opts);

}  // namespace cpd::runtime
