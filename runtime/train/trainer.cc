#include "runtime/train/trainer.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <memory>
#include <thread>

#include "cpd/config.h"
#include "kernels/grid.h"
#include "runtime/control/job_control.h"
#include "runtime/nn/layers.h"
#include "runtime/nn/models.h"
#include "runtime/train/allreduce_layers.h"
#include "runtime/train/checkpoint.h"
#include "runtime/train/checkpointer.h"
#include "runtime/train/cost_plan.h"
#include "runtime/train/data.h"
#include "runtime/train/evaluate.h"
#include "runtime/train/gradient_buffers.h"
#include "runtime/train/replicas.h"
#include "runtime/train/reporter.h"
#include "runtime/train/workers.h"
#if CPD_WITH_CUDA
#include "runtime/engine/cuda_ops.h"
#endif
#if CPD_WITH_NCCL
#include "comm/nccl_communicator.h"
#endif

extern "C" void openblas_set_num_threads(int num_threads);

namespace cpd::runtime {

namespace {

using Clock = std::chrono::steady_clock;

// Whether every parameter value is finite (parameters on a GPU are copied to the host).
bool ParamsFinite(const std::vector<Param*>& params) {
  for (const Param* p : params) {
    const Tensor h = OnHost(p->value);
    const float* v = h.data();
    bool finite = true;
    for (size_t i = 0; i < h.numel(); ++i) finite &= std::isfinite(v[i]);
    if (!finite) return false;
  }
  return true;
}

// "<arch>-<dataset>-<UTC yyyymmdd-hhmmss>": a job name when the user gives none.
std::string DefaultJobName(const TrainOptions& o) {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char when[32];
  std::strftime(when, sizeof when, "%Y%m%d-%H%M%S", &tm);
  return o.arch + "-" + o.dataset + "-" + when;
}

// Groups the params into the all-reducer's layers: consecutive params whose names share the
// prefix before the last '.' ("conv1.weight", "conv1.bias") form one layer (one APS shift).
comm::GradientLayout LayoutOf(const std::vector<Param*>& params) {
  comm::GradientLayout layout;
  layout.offsets.push_back(0);
  size_t offset = 0;
  for (const Param* p : params) {
    const size_t dot = p->name.rfind('.');
    const std::string layer = dot == std::string::npos ? p->name : p->name.substr(0, dot);
    if (layout.layer_names.empty() || layout.layer_names.back() != layer) {
      if (!layout.layer_names.empty()) layout.offsets.push_back(offset);
      layout.layer_names.push_back(layer);
    }
    offset += p->grad.numel();
  }
  if (!layout.layer_names.empty()) layout.offsets.push_back(offset);
  return layout;
}

std::string AllReduceDescription(const comm::GradientAllReduceOptions& ar) {
  std::string out = comm::AllReduceAlgoName(ar.algo);
  if (ar.algo != comm::AllReduceAlgo::kFp32) {
    const char* aps = !ar.aps ? "" : comm::UsesApsSumScaling(ar) ? " +APS(sum)" : " +APS";
    out += " " + ar.format + aps + (ar.kahan ? " +Kahan" : "");
  }
  return out;
}

// "text: 2,254,431 train / 250,481 val tokens (byte-level, vocab 256), block 128, 17612
// windows per epoch, 843,392 parameters; unigram baseline 4.62 bits/byte": the language model's
// data, and the entropy that a model knowing only the token frequencies would reach.
std::string DescribeTokens(const Dataset& train, const Dataset& val, Sequential* model) {
  char line[384];
  const std::string name = train.name.substr(0, train.name.find('/'));
  std::snprintf(line, sizeof line,
                "%s: %lld train / %lld val tokens (%s, vocab %d), block %lld, %lld windows per "
                "epoch, %lld parameters; unigram baseline %.3f bits/%s",
                name.c_str(), static_cast<long long>(train.tokens.size()),
                static_cast<long long>(val.tokens.size()),
                train.byte_level ? "byte-level" : "GPT-2 BPE", train.classes,
                static_cast<long long>(train.block_size), static_cast<long long>(train.count),
                static_cast<long long>(CountParams(*model)), train.unigram_bits,
                train.byte_level ? "byte" : "token");
  return line;
}

// One training run: set up in Create (one short phase per part), then Run: epochs of steps.
class Trainer {
 public:
  static Result<std::unique_ptr<Trainer>> Create(const TrainOptions& o, comm::Communicator* comm);
  Result<TrainResult> Run();

 private:
  Trainer(const TrainOptions& o, comm::Communicator* comm)
      : o_(o), comm_(comm != nullptr ? comm : &self_), replicas_(comm_) {}

  // Set-up, in this order.
  Status CheckOptions();
  Status PlaceWorkers();
  Status LoadData();
  Status BuildNetwork();
  Status PlaceNetwork();
  Status BuildIterator();
  Status BuildPrecision();
  Status BuildOptimizer();
  Status BuildLrSchedule();
  Status BuildReducer();
  Result<comm::GradientAllReduceOptions> ReducerOptionsFor(const PrecisionConfig& pc) const;
  Status RebuildReducerIfChanged();
  Result<comm::Communicator*> AllReduceCommunicator();
  Result<bool> RanksShareAGpu();
  Status BuildOutputs();
  Status ResumeOrStart();
  Status StartControl();
  void Announce();
  std::string DescribeLr() const;

  // The loop.
  Status RunEpoch(int epoch);
  Status Step(int epoch, const Tensor& x, const std::vector<int32_t>& y);
  Status ApplyDueSchedule();
  Status StopIfUnrecoverable(double loss, bool skipped);
  Status EndEpoch(int epoch);
  Result<TrainResult> Finish();

  const TrainOptions& o_;
  comm::SelfCommunicator self_;
  comm::Communicator* comm_;
  Replicas replicas_;
  Device device_ = Device::kCpu;
  int threads_ = 1;
  WorkerGroup group_;
  int64_t global_batch_ = 0, batches_per_epoch_ = 0, total_steps_ = 0;
  CoordinatorOptions coordinator_;
  Dataset train_, test_;
  std::unique_ptr<Sequential> model_;
  std::vector<Layer*> quant_layers_;
  std::unique_ptr<GradientBuffers> gradients_;  // every Param::grad, and the reducer's inputs
  std::unique_ptr<BatchIterator> iterator_;
  PrecisionConfig precision_;  // the policy in force
  std::unique_ptr<SiteQuantizer> quant_;
  std::unique_ptr<Optimizer> optimizer_;
  LrSchedule lr_;
  comm::GradientAllReduceOptions allreduce_;  // in force, with the per-layer formats
  comm::Communicator* reduce_comm_ = nullptr;
  comm::GradientLayout layout_;  // the all-reducer's layers
  std::vector<std::string> batchnorm_layers_;
  std::vector<std::pair<std::string, std::string>> reducer_rules_;  // what the reducer was built
                                                                    // with
  std::unique_ptr<comm::Communicator> nccl_;  // the all-reduce's, when it runs over NCCL
  std::unique_ptr<comm::GradientAllReducer> reducer_;
  std::unique_ptr<LocalWorkers> workers_;
  LossScaler scaler_{LossScaleOptions{}};  // --loss-scale, set in BuildOutputs
  std::unique_ptr<Reporter> reporter_;
  std::unique_ptr<Checkpointer> checkpointer_;
  std::unique_ptr<CostPlan> cost_;
  std::unique_ptr<JobControl> control_;
  std::string resumed_schedule_;  // the schedule a checkpoint recorded ("" if none)
  EpochSums resumed_sums_;        // the resumed epoch's sums before the checkpoint
  int64_t step_ = 0;
  int start_epoch_ = 0;
  int64_t steps_this_run_ = 0;
  int64_t skipped_in_a_row_ = 0;
  bool stop_ = false;
  TrainResult result_;
};

Result<std::unique_ptr<Trainer>> Trainer::Create(const TrainOptions& o, comm::Communicator* comm) {
  std::unique_ptr<Trainer> t(new Trainer(o, comm));
  CPD_RETURN_IF_ERROR(t->CheckOptions());
  CPD_RETURN_IF_ERROR(t->PlaceWorkers());
  CPD_RETURN_IF_ERROR(t->LoadData());
  CPD_RETURN_IF_ERROR(t->BuildNetwork());
  if (o.print_model) return t;
  CPD_RETURN_IF_ERROR(t->BuildIterator());
  CPD_RETURN_IF_ERROR(t->BuildPrecision());
  CPD_RETURN_IF_ERROR(t->BuildOptimizer());
  CPD_RETURN_IF_ERROR(t->BuildReducer());
  CPD_RETURN_IF_ERROR(t->BuildOutputs());
  CPD_RETURN_IF_ERROR(t->ResumeOrStart());
  // Identical replicas from the start: rank 0's parameters and buffers everywhere.
  CPD_RETURN_IF_ERROR(t->replicas_.BroadcastFromRank0(t->model_->Params(), t->model_->Buffers()));
  t->Announce();
  CPD_RETURN_IF_ERROR(t->StartControl());
  return t;
}

Status Trainer::CheckOptions() {
  CPD_RETURN_IF_ERROR(ValidateTrainOptions(o_));
  coordinator_ = o_.coordinator;
  if (!coordinator_.address.empty()) {
    if (coordinator_.job_name.empty()) coordinator_.job_name = DefaultJobName(o_);
    CPD_RETURN_IF_ERROR(CheckCoordinatorOptions(coordinator_));
    if (!(o_.report_interval_s > 0)) {
      return Status::InvalidArgument("--report-interval must be a positive number of seconds");
    }
  }
  CPD_ASSIGN_OR_RETURN(device_, ResolveDevice(o_.device));
  return Status::Ok();
}

// Ranks, workers, batch sizes, threads, the GPU of this rank and its convolution algorithms.
Status Trainer::PlaceWorkers() {
  if (device_ == Device::kCuda && comm_->size() > 1) {
    // The ranks of a node take its GPUs in turn (before any CUDA tensor exists).
    const int local = comm::LocalRankFromEnv();
    SelectCudaDevice(local >= 0 ? local : comm_->rank());
  }
#if CPD_WITH_CUDA
  // Set on every run, since the setting is the process's and an earlier run may have changed it.
  if (device_ == Device::kCuda) {
    cuda::SetConvAlgoPolicy(o_.fast_conv_algos ? cuda::ConvAlgoPolicy::kFast
                                               : cuda::ConvAlgoPolicy::kExact);
  }
#endif
  threads_ = o_.threads > 0 ? o_.threads : omp_get_num_procs();
  omp_set_num_threads(threads_);
  openblas_set_num_threads(threads_);
  group_.rank = comm_->rank();
  group_.local_workers = o_.emulate_ranks;
  group_.workers = comm_->size() * group_.local_workers;
  int64_t worker_batch = o_.batch_size;
  if (o_.global_batch > 0) {
    CPD_RETURN_IF_ERROR(CheckGlobalBatchSplit(o_.global_batch, comm_->size(), o_.emulate_ranks));
    worker_batch = o_.global_batch / group_.workers;
  }
  global_batch_ = worker_batch * group_.workers;
  return Status::Ok();
}

Status Trainer::LoadData() {
  const TokenWindows windows{o_.lm.block_size, o_.lm.tokens_per_epoch};
  auto data = LoadDatasetPair(o_.dataset, o_.data_dir, o_.seed, windows);
  if (!data.ok() && data.status().code() == Status::Code::kCorruption &&
      IsTokenDataset(o_.dataset)) {
    // A malformed token file is the user's input, like a bad flag (issue 28: exit 2); the image
    // sets keep their data failure (exit 1).
    return Status::InvalidArgument(data.status().message());
  }
  if (!data.ok()) return data.status();
  train_ = std::move(data->first);
  test_ = std::move(data->second);
  if (train_.is_tokens()) return Status::Ok();  // token ids are not normalised
  const ChannelStats norm = ComputeChannelStats(train_);
  Normalize(&train_, norm);
  Normalize(&test_, norm);
  return Status::Ok();
}

// The model for the dataset's shapes, on its device, and its quantisable layers.
Status Trainer::BuildNetwork() {
  if (train_.is_tokens()) {
    LanguageModelShape shape;
    shape.vocab = train_.classes;
    shape.block_size = train_.block_size;
    shape.n_layer = o_.lm.n_layer;
    shape.n_head = o_.lm.n_head;
    shape.n_embd = o_.lm.n_embd;
    shape.dropout = o_.lm.dropout;
    shape.tied_head = o_.lm.tied_head;
    CPD_ASSIGN_OR_RETURN(model_, BuildLanguageModel(o_.arch, shape, o_.seed));
    return PlaceNetwork();
  }
  const int in_ch = o_.in_channels > 0 ? o_.in_channels : train_.channels;
  const int size = o_.image_size > 0 ? o_.image_size : train_.height;
  const int classes = o_.classes > 0 ? o_.classes : train_.classes;
  if (in_ch != train_.channels || size != train_.height || classes < train_.classes) {
    return Status::InvalidArgument(
        "--in-channels/--image-size/--classes (" + std::to_string(in_ch) + ", " +
        std::to_string(size) + ", " + std::to_string(classes) + ") do not fit dataset '" +
        o_.dataset + "' (" + std::to_string(train_.channels) + ", " +
        std::to_string(train_.height) + ", " + std::to_string(train_.classes) + ")");
  }
  CPD_ASSIGN_OR_RETURN(model_, BuildModel(o_.arch, in_ch, size, classes, o_.seed));
  return PlaceNetwork();
}

// The model on its device, its gradient buffers, and its quantisable layers.
Status Trainer::PlaceNetwork() {
  if (!o_.print_model) {
    if (device_ != Device::kCpu) MoveToDevice(model_.get(), device_);
    gradients_ = std::make_unique<GradientBuffers>(model_->Params(), device_);
  }
  for (Layer* l : model_->Flatten()) {
    if (l->Quantizable()) quant_layers_.push_back(l);
  }
  return Status::Ok();
}

// One iterator per rank over the shared permutation: a step takes a global batch, this rank
// gets its K workers' slices in one piece. Several workers drop the last partial batch, so that
// every worker's gradient is a mean over the same number of samples.
Status Trainer::BuildIterator() {
  const bool augment =
      !train_.is_tokens() && (o_.augment_set ? o_.augment : o_.dataset.rfind("cifar", 0) == 0);
  iterator_ = std::make_unique<BatchIterator>(train_, global_batch_ / comm_->size(),
                                              /*shuffle=*/true, augment, o_.seed,
                                              /*drop_last=*/group_.workers > 1);
  CPD_RETURN_IF_ERROR(iterator_->SetShard(comm_->rank(), comm_->size()));
  batches_per_epoch_ = iterator_->batches_per_epoch();
  if (batches_per_epoch_ < 1) {
    // A language model's samples are its windows of --block-size tokens (token_data.h).
    return Status::InvalidArgument(
        "global batch " + std::to_string(global_batch_) + " exceeds the " +
        std::to_string(train_.count) +
        (train_.is_tokens() ? " training windows of an epoch (--tokens-per-epoch / --block-size)"
                            : " training samples"));
  }
  total_steps_ = batches_per_epoch_ * o_.epochs;
  return Status::Ok();
}

Status Trainer::BuildPrecision() {
  precision_ = o_.precision;
  if (precision_.cpt) {
    precision_.cpt->total_iters = total_steps_;
    CPD_RETURN_IF_ERROR(precision_.cpt->Validate());
  }
  precision_.seed = kernels::SplitMix64(o_.seed ^ 0x51u);
  CPD_ASSIGN_OR_RETURN(quant_, SiteQuantizer::Create(precision_, quant_layers_));
  quant_->InstallHooks(quant_layers_);
  return Status::Ok();
}

Status Trainer::BuildOptimizer() {
  OptimizerOptions oo;
  oo.momentum = o_.momentum;
  oo.weight_decay = o_.weight_decay;
  oo.nesterov = o_.nesterov;
  oo.kind = o_.optimizer;
  oo.lars_eta = o_.lars_eta;
  oo.lars_exclude = o_.lars_exclude;
  oo.lars_excluded_lr_ratio = o_.lars_excluded_lr_ratio;
  oo.beta1 = o_.beta1;
  oo.beta2 = o_.beta2;
  oo.eps = o_.adam_eps;
  oo.threads = threads_;
  CPD_RETURN_IF_ERROR(oo.Validate());
  optimizer_ = std::make_unique<Optimizer>(model_->Params(), oo);
  return BuildLrSchedule();
}

// The schedule from the scaled base lr and the warm-up in steps: pure functions of the options
// and the global batch, so a resumed run (same global batch) continues with the same lrs.
Status Trainer::BuildLrSchedule() {
  result_.lr_effective = ScaleLr(o_.lr, o_.lr_scaling, global_batch_, o_.lr_base_batch);
  result_.warmup_steps = o_.warmup_steps;
  if (o_.warmup_epochs > 0) {
    result_.warmup_steps = std::llround(o_.warmup_epochs * double(batches_per_epoch_));
    if (result_.warmup_steps > total_steps_) {
      char line[160];
      std::snprintf(line, sizeof line,
                    "--warmup-epochs %g (%lld steps) is longer than the run (%d epochs = %lld "
                    "steps)",
                    o_.warmup_epochs, static_cast<long long>(result_.warmup_steps), o_.epochs,
                    static_cast<long long>(total_steps_));
      return Status::InvalidArgument(line);
    }
  }
  std::vector<int64_t> milestones;
  for (int64_t e : o_.lr_milestones) milestones.push_back(e * batches_per_epoch_);
  CPD_ASSIGN_OR_RETURN(lr_, MakeLrSchedule(o_.lr_schedule, result_.lr_effective, total_steps_,
                                           result_.warmup_steps, milestones, o_.lr_gamma));
  return Status::Ok();
}

// "lr 0.1 x sqrt(8192/256) = 0.566 (cosine), warm-up 2 epochs = 94 steps[, LARS biases/BN at
// lr x 0.024]": how the lr of the first steps came about.
std::string Trainer::DescribeLr() const {
  char buf[256];
  std::string out;
  std::snprintf(buf, sizeof buf, "lr %g", o_.lr);
  out = buf;
  if (o_.lr_scaling != LrScaling::kNone) {
    const bool sqrt = o_.lr_scaling == LrScaling::kSqrt;
    std::snprintf(buf, sizeof buf, " x %s%lld/%lld%s = %.3g", sqrt ? "sqrt(" : "",
                  static_cast<long long>(global_batch_), static_cast<long long>(o_.lr_base_batch),
                  sqrt ? ")" : "", result_.lr_effective);
    out += buf;
  }
  out += std::string(" (") + LrScheduleName(o_.lr_schedule) + ")";
  if (o_.warmup_epochs > 0) {
    std::snprintf(buf, sizeof buf, ", warm-up %g epochs = %lld steps", o_.warmup_epochs,
                  static_cast<long long>(result_.warmup_steps));
    out += buf;
  } else if (result_.warmup_steps > 0) {
    out += ", warm-up " + std::to_string(result_.warmup_steps) + " steps";
  } else {
    out += ", no warm-up";
  }
  if (o_.optimizer == OptimizerKind::kAdamW) {
    std::snprintf(buf, sizeof buf, ", AdamW betas (%g, %g) eps %g, decoupled weight decay %g",
                  o_.beta1, o_.beta2, o_.adam_eps, o_.weight_decay);
    out += buf;
  }
  if (o_.clip_grad_norm > 0) {
    std::snprintf(buf, sizeof buf, ", gradients clipped to norm %g", o_.clip_grad_norm);
    out += buf;
  }
  if (o_.optimizer == OptimizerKind::kLars) {
    if (o_.lars_exclude == LarsExclude::kBiasBn) {
      std::snprintf(buf, sizeof buf, ", LARS biases/BatchNorm at lr x %g",
                    o_.lars_excluded_lr_ratio);
      out += buf;
    } else {
      out += ", LARS trust ratio on every param";
    }
  }
  return out;
}

// The gradient all-reducer over the flat gradients of the K local workers: on a GPU they stay
// in device memory where the reducer supports the options (the same bits as staging them).
Status Trainer::BuildReducer() {
  allreduce_ = o_.allreduce;
  allreduce_.seed = kernels::SplitMix64(o_.seed ^ 0xA11u);
  allreduce_.threads = threads_;
  const bool device_gradients =
      device_ == Device::kCuda && o_.device_gradients && comm::DeviceGradientsSupported();
  allreduce_.gradients = device_gradients ? comm::MemorySpace::kDevice : comm::MemorySpace::kHost;
  gradients_->PlaceReducerInputs(allreduce_.gradients, group_.local_workers);
  CPD_ASSIGN_OR_RETURN(reduce_comm_, AllReduceCommunicator());
  layout_ = LayoutOf(model_->Params());
  for (Layer* l : model_->Flatten()) {
    if (std::string(l->kind()) == "BatchNorm") batchnorm_layers_.push_back(l->name());
  }
  CPD_ASSIGN_OR_RETURN(allreduce_, ReducerOptionsFor(precision_));
  CPD_ASSIGN_OR_RETURN(reducer_, comm::GradientAllReducer::Create(reduce_comm_, allreduce_, layout_,
                                                                  group_.local_workers));
  reducer_rules_ = precision_.allreduce_layers;
  workers_ =
      std::make_unique<LocalWorkers>(model_.get(), quant_.get(), device_, group_, gradients_.get(),
                                     o_.debug_nan_step, o_.debug_nan_steps);
  return Status::Ok();
}

// The all-reducer's options with pc's per-layer formats (hybrid precision) resolved against its
// layers; InvalidArgument for rules it cannot take (the same on every rank, so that a pushed
// schedule is refused everywhere alike).
Result<comm::GradientAllReduceOptions> Trainer::ReducerOptionsFor(const PrecisionConfig& pc) const {
  comm::GradientAllReduceOptions ar = allreduce_;
  CPD_ASSIGN_OR_RETURN(ar.layer_formats,
                       ResolveAllReduceLayers(pc.allreduce_layers, layout_, batchnorm_layers_));
  if (!ar.layer_formats.empty() && ar.algo == comm::AllReduceAlgo::kFp32) {
    return Status::InvalidArgument(
        "--allreduce-layer-format needs --allreduce emulate or packed (fp32 sends every layer "
        "in fp32 already)");
  }
  CPD_RETURN_IF_ERROR(ar.Validate());
  const bool mixed = std::any_of(ar.layer_formats.begin(), ar.layer_formats.end(),
                                 [&](const auto& e) { return e.second != ar.format; });
  if (mixed && ar.gradients == comm::MemorySpace::kDevice) {
    return Status::InvalidArgument(
        "--allreduce-layer-format: per-layer all-reduce formats need the gradients in host "
        "memory; add --gradients host");
  }
  return ar;
}

// After a schedule switch: a new all-reducer when the per-layer formats changed (every rank at
// the same step boundary; the plan and the buffers are rebuilt, nothing else is kept).
Status Trainer::RebuildReducerIfChanged() {
  if (precision_.allreduce_layers == reducer_rules_) return Status::Ok();
  CPD_ASSIGN_OR_RETURN(comm::GradientAllReduceOptions ar, ReducerOptionsFor(precision_));
  CPD_ASSIGN_OR_RETURN(
      reducer_, comm::GradientAllReducer::Create(reduce_comm_, ar, layout_, group_.local_workers));
  allreduce_ = std::move(ar);
  reducer_rules_ = precision_.allreduce_layers;
  reporter_->set_reducer(reducer_.get());
  return Status::Ok();
}

// Whether two ranks train on the same GPU (by UUID, so across nodes too). Collective; REQUIRED:
// every rank on a GPU.
Result<bool> Trainer::RanksShareAGpu() {
  const std::string uuid = CudaDeviceUuid();
  std::string all(uuid.size() * size_t(comm_->size()), '\0');
  CPD_RETURN_IF_ERROR(comm_->AllGatherBytes(reinterpret_cast<const uint8_t*>(uuid.data()),
                                            reinterpret_cast<uint8_t*>(all.data()), uuid.size()));
  std::vector<std::string> uuids;
  for (size_t r = 0; r < size_t(comm_->size()); ++r)
    uuids.push_back(all.substr(r * uuid.size(), uuid.size()));
  std::sort(uuids.begin(), uuids.end());
  return std::adjacent_find(uuids.begin(), uuids.end()) != uuids.end();
}

// The run's own communicator, or NCCL (AllReduceComm). Collective: whether every rank keeps its
// gradients on a GPU is agreed on, so that all ranks choose alike.
Result<comm::Communicator*> Trainer::AllReduceCommunicator() {
  if (o_.allreduce_comm == AllReduceComm::kWorld) return comm_;
  const bool want = o_.allreduce_comm == AllReduceComm::kNccl;
  int32_t host_somewhere = gradients_->reducer_memory() == comm::MemorySpace::kHost ? 1 : 0;
  CPD_RETURN_IF_ERROR(comm_->AllReduce(&host_somewhere, 1, comm::ReduceOp::kMax));
  if (!CPD_WITH_NCCL || host_somewhere != 0) {
    if (!want) return comm_;
    return Status::InvalidArgument(std::string("--comm nccl needs ") +
                                   (!CPD_WITH_NCCL
                                        ? "a build with NCCL (CPD_WITH_NCCL=ON)"
                                        : "--device cuda with --gradients device on every rank") +
                                   "; use --comm auto");
  }
  if (!want && comm_->size() == 1) return comm_;
  // NCCL needs a GPU per rank: ranks sharing one (several processes per GPU) keep the run's own.
  CPD_ASSIGN_OR_RETURN(const bool shared, RanksShareAGpu());
  if (shared) {
    if (!want) return comm_;
    return Status::InvalidArgument(
        "--comm nccl needs a GPU per rank, but some ranks share one; use --comm auto");
  }
#if CPD_WITH_NCCL
  // Device -1: the node-local rank modulo the GPUs, the GPU PlaceWorkers chose for this rank.
  CPD_ASSIGN_OR_RETURN(nccl_, comm::NcclCommunicator::Create(comm_, -1));
  return nccl_.get();
#else
  return comm_;
#endif
}

// The options the reporter reads: each the TrainOptions field of the same name.
ReporterOptions ReporterOptionsOf(const TrainOptions& o) {
  ReporterOptions r;
  r.metrics_out = o.metrics_out;
  r.quiet = o.quiet;
  r.progress = o.progress;
  r.progress_interval_s = o.progress_interval_s;
  r.arch = o.arch;
  r.dataset = o.dataset;
  r.epochs = o.epochs;
  r.max_steps = o.max_steps;
  r.seed = o.seed;
  r.optimizer = o.optimizer;
  r.lr = o.lr;
  r.momentum = o.momentum;
  r.weight_decay = o.weight_decay;
  r.lr_scaling = o.lr_scaling;
  r.lr_base_batch = o.lr_base_batch;
  r.lr_schedule = o.lr_schedule;
  r.lars_eta = o.lars_eta;
  r.lars_exclude = o.lars_exclude;
  r.lars_excluded_lr_ratio = o.lars_excluded_lr_ratio;
  r.beta1 = o.beta1;
  r.beta2 = o.beta2;
  r.adam_eps = o.adam_eps;
  r.clip_grad_norm = o.clip_grad_norm;
  r.allreduce = o.allreduce;
  r.loss_scale = o.loss_scale;
  r.cost_reference = o.cost_reference;
  return r;
}

// The options the checkpointer reads: each the TrainOptions field of the same name.
CheckpointOptions CheckpointOptionsOf(const TrainOptions& o) {
  CheckpointOptions c;
  c.checkpoint_dir = o.checkpoint_dir;
  c.checkpoint_every = o.checkpoint_every;
  c.arch = o.arch;
  c.dataset = o.dataset;
  c.seed = o.seed;
  c.epochs = o.epochs;
  c.labels_per_sample = IsTokenDataset(o.dataset) ? o.lm.block_size : 1;
  return c;
}

// The reporter (console, metrics, coordinator reports), checkpoints and the cost model.
Status Trainer::BuildOutputs() {
  ReporterSetup rs;
  rs.rank = comm_->rank();
  rs.world = comm_->size();
  rs.workers = group_.workers;
  rs.global_batch = global_batch_;
  rs.batches_per_epoch = batches_per_epoch_;
  rs.labels_per_sample = train_.labels_per_sample();
  rs.language_model = train_.is_tokens();
  rs.byte_level = train_.byte_level;
  rs.quant = quant_.get();
  rs.replicas = &replicas_;
  rs.reducer = reducer_.get();
  CPD_ASSIGN_OR_RETURN(reporter_, Reporter::Create(ReporterOptionsOf(o_), rs));
  scaler_ = LossScaler(o_.loss_scale);
  TrainingState state;
  state.scaler = &scaler_;
  state.model = model_.get();
  state.optimizer = optimizer_.get();
  state.quant = quant_.get();
  state.iterator = iterator_.get();
  checkpointer_ = std::make_unique<Checkpointer>(CheckpointOptionsOf(o_), global_batch_,
                                                 batches_per_epoch_, state, &replicas_);
  CPD_RETURN_IF_ERROR(checkpointer_->CheckDirectory());
  cost_ = std::make_unique<CostPlan>(total_steps_, precision_, o_.cost_reference);
  return Status::Ok();
}

Status Trainer::ResumeOrStart() {
  const std::string path = o_.resume == "auto" ? LatestCheckpoint(o_.checkpoint_dir) : o_.resume;
  if (path.empty()) {
    iterator_->StartEpoch(0);
    return Status::Ok();
  }
  CPD_ASSIGN_OR_RETURN(const ResumePoint point, checkpointer_->Restore(path));
  step_ = point.step;
  quant_->SetStep(step_);
  resumed_schedule_ = point.schedule_json;
  resumed_sums_ = point.epoch_sums;
  start_epoch_ = point.epoch;
  // A checkpoint taken after the last batch of an epoch continues with the next epoch.
  const IteratorState it = iterator_->state();
  if (it.epoch == start_epoch_ && it.next_batch >= batches_per_epoch_) ++start_epoch_;
  if (!reporter_->quiet()) {
    std::printf("resumed from %s at step %lld (epoch %d)\n", path.c_str(),
                static_cast<long long>(step_), start_epoch_ + 1);
  }
  if (point.random_stream != kernels::kRandomStreamVersion) {
    // Not an error: the run goes on correctly, only not in the same bits as the original would.
    std::fprintf(stderr,
                 "cpd-train: note: %s was written with random stream version %d; this build "
                 "draws version %d, so stochastic rounding, dropout and augmentation after step "
                 "%lld differ from an uninterrupted run of the old build\n",
                 path.c_str(), point.random_stream, kernels::kRandomStreamVersion,
                 static_cast<long long>(step_));
  }
  return Status::Ok();
}

// The header and the lr on the console; the "run" record in the metrics.
void Trainer::Announce() {
  std::string parallel;
  if (group_.workers > 1) {
    parallel = ", " + std::to_string(comm_->size()) + " rank(s) x " +
               std::to_string(group_.local_workers) + " worker(s), all-reduce " +
               AllReduceDescription(allreduce_);
  }
  const bool fast_conv = device_ == Device::kCuda && o_.fast_conv_algos;
  char line[512];
  std::snprintf(line, sizeof line,
                "cpd-train: %s on %s (%lld train / %lld %s), %s%s, %d threads, batch %lld (%lld "
                "per worker)%s, %d epochs x %lld steps",
                o_.arch.c_str(), o_.dataset.c_str(), static_cast<long long>(train_.count),
                static_cast<long long>(test_.count), train_.is_tokens() ? "val windows" : "test",
                DeviceName(device_), fast_conv ? " (fast conv algorithms)" : "", threads_,
                static_cast<long long>(global_batch_),
                static_cast<long long>(global_batch_ / group_.workers), parallel.c_str(), o_.epochs,
                static_cast<long long>(batches_per_epoch_));
  reporter_->Say(line);
  if (train_.is_tokens()) reporter_->Say(DescribeTokens(train_, test_, model_.get()));
  reporter_->Say(DescribeLr());
  if (scaler_.enabled()) reporter_->Say("loss scale " + DescribeLossScale(o_.loss_scale));
  RunStart run;
  run.step = step_;
  run.classes = train_.classes;
  if (train_.is_tokens()) {
    run.block_size = train_.block_size;
    run.unigram_bits = train_.unigram_bits;
    run.params = CountParams(*model_);
  }
  run.total_steps = total_steps_;
  run.lr_effective = result_.lr_effective;
  run.warmup_steps = result_.warmup_steps;
  run.precision = DescribePrecision(precision_);
  run.device = DeviceName(device_);
  if (device_ == Device::kCuda) run.conv_algos = o_.fast_conv_algos ? "fast" : "exact";
  reporter_->Started(run);
}

// The control plane: the coordinator's schedules (same step on every rank) and reports.
Status Trainer::StartControl() {
  result_.world_size = comm_->size();
  result_.workers = group_.workers;
  result_.relative_cost = cost_->relative_cost();
  if (coordinator_.address.empty()) return Status::Ok();
  JobControl::Setup cs;
  cs.comm = comm_;
  cs.quant = quant_.get();
  cs.quant_layers = quant_layers_;
  cs.total_steps = total_steps_;
  cs.seed = precision_.seed;
  cs.report_interval_s = o_.report_interval_s;
  cs.check = [this](const PrecisionConfig& pc) { return ReducerOptionsFor(pc).status(); };
  cs.log = [this](const nlohmann::json& record) { reporter_->Log(record); };
  JobDescription job;
  job.arch = o_.arch;
  job.dataset = o_.dataset;
  job.allreduce = AllReduceDescription(allreduce_);
  job.world_size = comm_->size();
  job.emulate_ranks = group_.local_workers;
  job.epochs = o_.epochs;
  job.total_steps = total_steps_;
  job.start_step = step_;
  job.layers = LayerInfos(model_->Flatten());
  job.schedule.precision = precision_;
  job.schedule.set_by = "command line";
  CPD_ASSIGN_OR_RETURN(control_,
                       JobControl::Start(coordinator_, cs, std::move(job), 1, resumed_schedule_));
  reporter_->set_control(control_.get());
  checkpointer_->set_control(control_.get());
  if (!resumed_schedule_.empty()) {
    precision_ = quant_->config();
    CPD_RETURN_IF_ERROR(RebuildReducerIfChanged());
    cost_->Replan(step_, precision_);
    result_.relative_cost = cost_->relative_cost();
  }
  char line[256];
  std::snprintf(line, sizeof line,
                "coordinator %s: job '%s' (reports every %lld steps and at least every %.1f s)",
                coordinator_.address.c_str(), coordinator_.job_name.c_str(),
                static_cast<long long>(o_.stats_every), o_.report_interval_s);
  reporter_->Say(line);
  return Status::Ok();
}

Result<TrainResult> Trainer::Run() {
  if (o_.print_model) {
    if (comm_->rank() == 0) std::printf("%s", DescribeModel(*model_).c_str());
    return TrainResult{};
  }
  const auto start = Clock::now();
  for (int epoch = start_epoch_; epoch < o_.epochs && !stop_; ++epoch) {
    CPD_RETURN_IF_ERROR(RunEpoch(epoch));
  }
  CPD_RETURN_IF_ERROR(checkpointer_->AtEnd(step_, reporter_->Sums()));
  if (control_) control_->Finish(/*max_wait_ms=*/3000);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  result_.ms_per_step = steps_this_run_ > 0 ? 1e3 * seconds / double(steps_this_run_) : 0.0;
  return Finish();
}

Status Trainer::RunEpoch(int epoch) {
  if (iterator_->state().epoch != epoch) iterator_->StartEpoch(epoch);
  // The epoch a checkpoint resumed mid-way carries the sums of its steps before the resume.
  reporter_->BeginEpoch(epoch == start_epoch_ ? resumed_sums_ : EpochSums{});
  Tensor x;
  std::vector<int32_t> y;
  while (!stop_ && iterator_->Next(&x, &y)) CPD_RETURN_IF_ERROR(Step(epoch, x, y));
  return EndEpoch(epoch);
}

// One training step, the whole algorithm: every phase is one call.
Status Trainer::Step(int epoch, const Tensor& x, const std::vector<int32_t>& y) {
  CPD_RETURN_IF_ERROR(ApplyDueSchedule());  // the coordinator's, at the same step everywhere
  quant_->SetStep(step_);
  const bool collect = o_.stats_every > 0 && step_ % o_.stats_every == 0;
  const bool measure = o_.measure_error_every > 0 && step_ % o_.measure_error_every == 0;
  workers_->set_loss_scale(scaler_.scale());
  const BatchTotals local = workers_->ForwardBackward(x, y, step_, collect);
  CPD_RETURN_IF_ERROR(reducer_->Reduce(gradients_->inputs(), gradients_->sum(), step_, measure));
  const double lr = lr_.At(step_);
  bool skipped = reducer_->last_nonfinite();  // NaN/Inf on some rank: skip everywhere
  const float scale = scaler_.scale();
  double grad_norm = std::nan("");
  if (!skipped) {
    gradients_->LoadAverage(group_.workers, scale);
    // Clipping sees the unscaled average, bit-identical on every rank, so every rank clips alike
    // and skips alike when the norm overflows.
    if (o_.clip_grad_norm > 0) {
      grad_norm = optimizer_->ClipGradNorm(o_.clip_grad_norm);
      skipped = !std::isfinite(grad_norm);
    }
  }
  scaler_.AfterStep(skipped);  // dynamic loss scaling: halve after an overflow, grow after a run
  if (skipped) {
    ++result_.skipped_steps;
    reporter_->StepSkipped(step_, scale, scaler_.scale());
  } else {
    optimizer_->Step(lr);
  }
  if (workers_->averages_buffers()) {
    CPD_RETURN_IF_ERROR(replicas_.AverageBuffers(workers_->buffers_after(), group_.local_workers,
                                                 group_.workers, workers_->buffers()));
  }
  CPD_ASSIGN_OR_RETURN(const GlobalBatch batch, replicas_.Combine(local));
  result_.step_losses.push_back(batch.loss);
  ++step_;
  ++steps_this_run_;
  CPD_RETURN_IF_ERROR(reporter_->AfterStep({epoch + 1, step_ - 1, batch, lr, skipped,
                                            collect || measure, iterator_->state().next_batch,
                                            result_.skipped_steps, scale, grad_norm}));
  CPD_RETURN_IF_ERROR(StopIfUnrecoverable(batch.loss, skipped));
  if (o_.debug_step_sleep_ms > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(o_.debug_step_sleep_ms));
  }
  CPD_RETURN_IF_ERROR(checkpointer_->AfterStep(step_, epoch, reporter_->Sums()));
  if (o_.max_steps > 0 && step_ >= o_.max_steps) stop_ = true;
  return Status::Ok();
}

// A run that cannot recover stops, after its metrics: a non-finite loss or parameter, or
// --max-skipped-steps consecutive skipped steps. Every rank decides alike (the loss is the
// global batch's, the replicas are identical, a skip is everyone's), so all stop together.
Status Trainer::StopIfUnrecoverable(double loss, bool skipped) {
  skipped_in_a_row_ = skipped ? skipped_in_a_row_ + 1 : 0;
  std::string why;
  if (!std::isfinite(loss)) {
    why = "the loss is " + std::string(std::isnan(loss) ? "NaN" : "infinite");
  } else if (!skipped && !ParamsFinite(model_->Params())) {
    why = "a parameter became NaN or infinite";
  } else if (o_.max_skipped_steps > 0 && skipped_in_a_row_ >= o_.max_skipped_steps) {
    why = std::to_string(skipped_in_a_row_) +
          " consecutive steps were skipped for NaN/Inf gradients (--max-skipped-steps " +
          std::to_string(o_.max_skipped_steps) + ")";
  }
  if (why.empty()) return Status::Ok();
  const int64_t step = step_ - 1;
  reporter_->Stopped(step, why);
  return Status::OutOfRange("training diverged at step " + std::to_string(step) + ": " + why +
                            "; stopping (lower --lr, or use a wider format)");
}

// A schedule the coordinator pushed that is due now takes effect on every rank (a collective).
Status Trainer::ApplyDueSchedule() {
  if (!control_) return Status::Ok();
  bool switched = false;
  std::vector<std::string> messages;
  CPD_RETURN_IF_ERROR(control_->BeforeStep(step_, &switched, &messages));
  for (const std::string& m : messages) reporter_->Say(m);
  if (switched) {
    precision_ = quant_->config();
    CPD_RETURN_IF_ERROR(RebuildReducerIfChanged());
    result_.schedule_switches.emplace_back(step_, control_->version());
    cost_->Replan(step_, precision_);
    result_.relative_cost = cost_->relative_cost();
  }
  return Status::Ok();
}

Status Trainer::EndEpoch(int epoch) {
  const EpochTotals totals = reporter_->Totals();
  const bool complete = iterator_->state().next_batch >= batches_per_epoch_;
  Evaluation eval;
  const bool evaluate = o_.eval_each_epoch || epoch + 1 == o_.epochs || stop_;
  if (evaluate) {
    CPD_ASSIGN_OR_RETURN(eval,
                         Evaluate(model_.get(), quant_.get(), test_, device_, replicas_, o_.seed));
  }
  EpochDone done;
  done.epoch = epoch + 1;
  done.step = step_;
  done.totals = totals;
  done.test_accuracy = eval.accuracy;
  done.test_loss = eval.loss;
  done.evaluated = evaluate;
  done.precision = &precision_;
  done.relative_cost = result_.relative_cost;
  done.skipped_steps = result_.skipped_steps;
  done.lr = lr_.At(std::max<int64_t>(step_ - 1, 0));
  done.loss_scale = scaler_.scale();
  done.finished = stop_ || epoch + 1 == o_.epochs;
  reporter_->AfterEpoch(done);
  result_.final_loss = totals.train_loss;
  result_.train_accuracy = totals.train_accuracy;
  result_.test_accuracy = eval.accuracy;
  if (!complete) return Status::Ok();
  result_.epochs_done = epoch + 1;
  return checkpointer_->AfterEpoch(step_, epoch + 1);
}

// Replicas must have stayed bit-identical: the ranks compare their parameter hashes.
Result<TrainResult> Trainer::Finish() {
  result_.steps = step_;
  result_.loss_scale = scaler_.scale();
  result_.param_hash = Replicas::HashParams(model_->Params());
  CPD_RETURN_IF_ERROR(replicas_.CheckIdentical(result_.param_hash));
  if (group_.workers > 1) {
    reporter_->Say("replicas bit-identical on " + std::to_string(comm_->size()) + " rank(s); " +
                   std::to_string(result_.skipped_steps) + " step(s) skipped for NaN/Inf");
  }
  return result_;
}

}  // namespace

Result<TrainResult> Train(const TrainOptions& o, comm::Communicator* comm) {
  // The layers report CUDA failures (and misuse) by exceptions; the trainer's callers get them
  // as a Status, like every other failure.
  try {
    CPD_ASSIGN_OR_RETURN(auto trainer, Trainer::Create(o, comm));
    return trainer->Run();
  } catch (const std::exception& e) {
    return Status::Internal(std::string("training failed: ") + e.what());
  }
}

}  // namespace cpd::runtime
