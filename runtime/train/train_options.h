// The options of a training run (cpd-train's command line, a study's runs, the tests) and their
// one check. Apart from the trainer (runtime/train/trainer.h), so that what only builds and
// checks options (launcher/train_flags.*, cpd-study) needs this header and the option types it
// names, not the trainer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/gradient_allreduce.h"
#include "cpd/progress.h"
#include "cpd/schedule.h"
#include "cpd/status.h"
#include "runtime/control/coordinator_client.h"
#include "runtime/engine/tensor.h"
#include "runtime/nn/optimizer.h"
#include "runtime/nn/quant_sites.h"
#include "runtime/train/loss_scale.h"

namespace cpd::runtime {

// Which communicator carries the gradient all-reduce (--comm):
//   kWorld  the run's own (one process, or MPI);
//   kNccl   NCCL between the ranks' GPUs (REQUIRED: a build with NCCL, --device cuda with
//           device gradients on every rank and a GPU per rank; else InvalidArgument naming
//           --comm nccl);
//   kAuto   NCCL when the build has it, there are several ranks and every rank keeps its
//           gradients on a GPU of its own; else the run's own.
// The run's own communicator carries everything else (start-up broadcast, BatchNorm averages,
// metrics, the end-of-run replica check) in every case.
enum class AllReduceComm { kAuto, kWorld, kNccl };

// A language model's shape and data windows (--arch gpt or lstm, --dataset text or tokens; see
// docs/language-models.md). The defaults are a GPT of about 0.84 M parameters that learns
// byte-level English visibly within minutes on two cores.
struct LanguageModelOptions {
  int n_layer = 4;               // Transformer blocks (LSTM layers), 1..kMaxLayers
  int n_head = 4;                // attention heads, 1..kMaxHeads; divides n_embd (gpt only)
  int n_embd = 128;              // the residual stream's (LSTM's) width, 1..kMaxEmbd
  int block_size = 128;          // tokens per window (the context), 1..kMaxBlock
  double dropout = 0;            // attention, residual and MLP dropout, [0, 1)
  bool tied_head = true;         // lm_head uses wte's table (GPT-2), else a table of its own
  int64_t tokens_per_epoch = 0;  // training windows per epoch x block_size; 0: the train tokens

  static constexpr int kMaxLayers = 256, kMaxHeads = 256, kMaxEmbd = 16384, kMaxBlock = 65536;
  // The most parameters a model may have (checked before anything is allocated).
  static constexpr int64_t kMaxParams = int64_t(4) << 30;
};

// Whether `dataset` is a token stream (text, tokens) and `arch` a language model (gpt, lstm).
bool IsTokenDataset(const std::string& dataset);
bool IsLanguageModel(const std::string& arch);

struct TrainOptions {
  // Data and model.
  // fashion-mnist | mnist | cifar10 | cifar100 | synthetic | text | tokens
  std::string dataset = "fashion-mnist";
  std::string data_dir;         // default per dataset (see runtime/train/data.h)
  std::string arch = "lenet5";  // mlp | lenet5 | resnet<6n+2> | gpt | lstm
  LanguageModelOptions lm;      // gpt's shape and the token windows
  int in_channels = 0, image_size = 0, classes = 0;  // 0: from the dataset
  bool augment = false;                              // random crop + flip (default on for CIFAR)
  bool augment_set = false;
  // Optimisation.
  int epochs = 10;
  int64_t max_steps = 0;  // stop after this many steps in total (0: run all epochs)
  // A run that cannot recover stops with OutOfRange ("training diverged ..."), after its
  // metrics: when the loss or a parameter becomes NaN/Inf, or after this many consecutive steps
  // skipped for a non-finite gradient (0: never for skips).
  int64_t max_skipped_steps = 10;
  int batch_size = 128;   // per logical worker, unless global_batch is set
  int global_batch = 0;   // > 0: split evenly over the W workers (must divide)
  int emulate_ranks = 1;  // K logical workers in this process (CPD's --emulate_node)
  OptimizerKind optimizer = OptimizerKind::kSgd;
  double lr = 0.05, momentum = 0.9, weight_decay = 5e-4;
  bool nesterov = false;
  double lars_eta = 0.001;
  // LARS: biases and BatchNorm out of the trust ratio at lr x ratio, or every param in it
  // (runtime/nn/optimizer.h).
  LarsExclude lars_exclude = LarsExclude::kBiasBn;
  double lars_excluded_lr_ratio = kLarsExcludedLrRatio;
  // AdamW (runtime/nn/optimizer.h): the moments' rates, each in [0, 1), and eps (> 0).
  double beta1 = kAdamBeta1, beta2 = kAdamBeta2, adam_eps = kAdamEps;
  // > 0: every step scales the averaged gradients to at most this global L2 norm
  // (Optimizer::ClipGradNorm) and reports the norm; a non-finite norm skips the step. 0: off.
  double clip_grad_norm = 0;
  LrSchedule::Kind lr_schedule = LrSchedule::kCosine;
  // The schedule's base lr is ScaleLr(lr, lr_scaling, global batch, lr_base_batch)
  // (cpd/schedule.h); the global batch is the real one (per-worker batch x workers).
  LrScaling lr_scaling = LrScaling::kNone;
  int64_t lr_base_batch = 256;  // >= 1
  // Linear warm-up, in steps or in epochs (x steps per epoch, rounded to the nearest step);
  // at most one of the two may be > 0.
  int64_t warmup_steps = 0;
  double warmup_epochs = 0;
  std::vector<int64_t> lr_milestones;  // epochs, for "step"
  double lr_gamma = 0.1;
  uint64_t seed = 1;
  int threads = 0;  // 0: all cores
  // Precision.
  PrecisionConfig precision;
  // Loss scaling of the backward pass (runtime/train/loss_scale.h); off by default.
  LossScaleOptions loss_scale;
  // --cost-reference: the static forward/backward bits that relative costs are measured
  // against (runtime/train/cost_plan.h).
  StepBits cost_reference{8, 8};
  // Gradient all-reduce (see comm/gradient_allreduce.h).
  comm::GradientAllReduceOptions allreduce;
  AllReduceComm allreduce_comm = AllReduceComm::kAuto;
  // On a GPU the all-reducer takes the gradients in device memory, so that they stay on the GPU
  // from backward to the optimiser; false stages them through the host (the results are the same
  // bits either way).
  bool device_gradients = true;
  int64_t measure_error_every = 0;  // all-reduce error vs exact fp32 every N steps (0: never)
  int64_t debug_nan_step = -1;      // testing aid: rank 0 worker 0 puts a NaN into its gradient
  int64_t debug_nan_steps = 1;      // ... at this many consecutive steps from debug_nan_step
  int debug_step_sleep_ms = 0;      // testing aid: every rank sleeps this long after each step
  // Output.
  int64_t stats_every = 100;  // per-layer statistics every N steps (0: never)
  std::string metrics_out;    // JSONL; rank 0 only, unless the path contains "{rank}"
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;  // steps (0: only at the end of each epoch when a dir is set)
  std::string resume;            // "" | "auto" | a checkpoint path
  DeviceChoice device = DeviceChoice::kAuto;
  // On a GPU, let cuDNN run any convolution algorithm it ranks (Winograd, FFT, TF32 tensor
  // cores: cuda::ConvAlgoPolicy::kFast, runtime/engine/conv_algos.h) instead of only the
  // GEMM-like ones in float32 arithmetic, the default, whose results differ from the CPU's only by
  // summation order. Refused with DeviceChoice::kCpu; no effect when kAuto resolves to the CPU.
  bool fast_conv_algos = false;
  // Control plane: with coordinator.address set, rank 0 registers the job with the coordinator
  // (job_name default: <arch>-<dataset>-<UTC time>), applies the schedules it pushes on every
  // rank at the same step, and reports per-layer statistics (every stats_every steps, at each
  // epoch's end, and a summary at least every report_interval_s seconds). Without it, the
  // command line's schedule holds for the whole run.
  CoordinatorOptions coordinator;
  double report_interval_s = 1.0;
  bool print_model = false;
  // The console's progress (cpd/progress.h): auto is a bar on an interactive terminal, plain
  // lines in a log (a file, a pipe, any rank launched by mpirun or srun).
  ProgressMode progress = ProgressMode::kAuto;
  // Plain progress lines at least this many seconds and a tenth of an epoch apart, plus each
  // epoch's last batch; >= 0.
  double progress_interval_s = 30;
  bool quiet = false;
  bool eval_each_epoch = true;
};

// OK, or InvalidArgument naming the flag, its value and what is accepted (ranges of the numeric
// options, the CPT bits, --resume's file, option combinations). Train() calls it first.
Status ValidateTrainOptions(const TrainOptions& options);
// Its language-model part (cpd-format-search's check too): the pairing of a language model
// with a token dataset, each shape flag within its bounds, heads dividing the width, the
// dropout and the parameter count; OK for an image model on image data.
Status ValidateLanguageModel(const TrainOptions& options);

// OK when `global_batch` (> 0) splits evenly over ranks x emulate_ranks workers; else
// InvalidArgument "--global-batch N does not split evenly over W workers (R ranks x K
// emulated)". Train() checks it at start-up; a launcher can check it before starting anything.
Status CheckGlobalBatchSplit(int64_t global_batch, int ranks, int emulate_ranks);

}  // namespace cpd::runtime
