// The public functions of the gradient all-reduce and the dispatch of one Reduce() step. The plan
// is in comm/allreduce/plan.h, what the algorithms share in comm/allreduce/internal.h, and each
// algorithm in its own file under comm/allreduce/.
#include "comm/gradient_allreduce.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>

#include "comm/allreduce/backend.h"
#include "comm/allreduce/internal.h"
#include "comm/allreduce/plan.h"
#include "cpd/config.h"
#include "cpd/message.h"
#include "kernels/grid.h"

namespace cpd::comm {
namespace {

constexpr int kMaxShift = 126;

using internal::Algorithm;
using internal::AllReducePlan;
using internal::ReducerSetup;
using internal::StepContext;

kernels::RoundMode ToRoundMode(Rounding r) {
  switch (r) {
    case Rounding::kStochastic:
      return kernels::RoundMode::kStochastic;
    case Rounding::kZero:
      return kernels::RoundMode::kTowardZero;
    default:
      return kernels::RoundMode::kNearestEven;
  }
}

// One reducer for host and device gradients: the plan, the step's state and the algorithm are
// the same; the back end (comm/allreduce/backend.h) runs the stages where the gradients live.
class Reducer final : public GradientAllReducer {
 public:
  explicit Reducer(ReducerSetup setup)
      : setup_(std::move(setup)),
        plan_(setup_.layout, setup_.world_size, setup_.options.bucket_mb, internal::kPiece) {
    for (const internal::BucketPlan& b : plan_.buckets()) buckets_.push_back(b.bounds);
    stats_ = internal::NewLayerStats(setup_);
  }

  // Makes the back end and the step's state, then picks the algorithm, which allocates its
  // scratch.
  Status Init() {
    if (setup_.options.gradients == MemorySpace::kDevice) {
      CPD_ASSIGN_OR_RETURN(backend_, internal::MakeDeviceBackend(setup_, plan_));
    } else {
      CPD_ASSIGN_OR_RETURN(backend_, internal::MakeHostBackend(setup_, plan_));
    }
    context_ = std::make_unique<StepContext>(setup_, plan_, backend_.get());
    switch (setup_.options.algo) {
      case AllReduceAlgo::kFp32: {
        CPD_ASSIGN_OR_RETURN(algorithm_, internal::MakeFp32(context_.get()));
        break;
      }
      case AllReduceAlgo::kEmulate: {
        CPD_ASSIGN_OR_RETURN(algorithm_, internal::MakeEmulate(context_.get()));
        break;
      }
      case AllReduceAlgo::kPacked: {
        CPD_ASSIGN_OR_RETURN(algorithm_, internal::MakePacked(context_.get()));
        break;
      }
    }
    return Status::Ok();
  }

  Status Reduce(float* const* inputs, float* output, int64_t step, bool measure_error) override;
  bool last_nonfinite() const override { return nonfinite_; }
  const std::vector<LayerCommStats>& last_stats() const override { return stats_; }
  uint64_t last_bytes_sent() const override { return context_->bytes_sent; }
  const std::vector<GradientBucket>& buckets() const override { return buckets_; }

 private:
  void BeginStep();

  const ReducerSetup setup_;
  const AllReducePlan plan_;
  std::unique_ptr<internal::Backend> backend_;
  std::unique_ptr<StepContext> context_;
  std::unique_ptr<Algorithm> algorithm_;
  std::vector<GradientBucket> buckets_;
  std::vector<LayerCommStats> stats_;
  bool nonfinite_ = false;
};

Status Reducer::Reduce(float* const* inputs, float* output, int64_t step, bool measure_error) {
  CPD_RETURN_IF_ERROR(internal::CheckReduceBuffers(setup_, inputs, output));
  CPD_RETURN_IF_ERROR(backend_->BeginStep(inputs, output));
  BeginStep();
  bool finite = true;
  CPD_RETURN_IF_ERROR(context_->ScanAndShift(inputs, &finite));
  for (size_t l = 0; l < stats_.size(); ++l) {
    stats_[l].max_abs = context_->max_abs[l];
    stats_[l].shift = context_->shifts[l];
  }
  if (!finite) {
    nonfinite_ = true;
    return Status::Ok();
  }
  CPD_RETURN_IF_ERROR(algorithm_->Reduce(inputs, output, step, measure_error));
  CPD_RETURN_IF_ERROR(context_->stats.Finish(measure_error, &stats_));
  return backend_->EndStep();
}

void Reducer::BeginStep() {
  nonfinite_ = false;
  context_->Reset();
  internal::ResetLayerStats(&stats_);
}

// InvalidArgument unless offsets are layers() + 1 non-decreasing values from 0 (or both empty).
Status ValidateLayout(const GradientLayout& layout) {
  const size_t layers = layout.layer_names.size();
  if (layers == 0 && layout.offsets.empty()) return Status::Ok();
  if (layout.offsets.size() != layers + 1) {
    return Status::InvalidArgument("GradientAllReducer: layout has " + std::to_string(layers) +
                                   " layer names but " + std::to_string(layout.offsets.size()) +
                                   " offsets; need layers + 1 = " + std::to_string(layers + 1));
  }
  if (layout.offsets[0] != 0) {
    return Status::InvalidArgument("GradientAllReducer: layout offsets[0] must be 0, got " +
                                   std::to_string(layout.offsets[0]));
  }
  for (size_t l = 0; l < layers; ++l) {
    if (layout.offsets[l + 1] < layout.offsets[l]) {
      return Status::InvalidArgument(
          "GradientAllReducer: layout offsets must not decrease; layer " + std::to_string(l) +
          " ('" + layout.layer_names[l] + "') ends at " + std::to_string(layout.offsets[l + 1]) +
          " before it starts at " + std::to_string(layout.offsets[l]));
    }
  }
  return Status::Ok();
}

}  // namespace

Result<AllReduceAlgo> ParseAllReduceAlgo(const std::string& name) {
  if (name == "fp32") return AllReduceAlgo::kFp32;
  if (name == "emulate") return AllReduceAlgo::kEmulate;
  if (name == "packed") return AllReduceAlgo::kPacked;
  return Status::InvalidArgument("unknown all-reduce algorithm '" + name +
                                 "' (accepted: fp32, emulate, packed)");
}

const char* AllReduceAlgoName(AllReduceAlgo a) {
  switch (a) {
    case AllReduceAlgo::kFp32:
      return "fp32";
    case AllReduceAlgo::kEmulate:
      return "emulate";
    case AllReduceAlgo::kPacked:
      return "packed";
  }
  return "?";
}

Result<ApsScaling> ParseApsScaling(const std::string& name) {
  if (name == "auto") return ApsScaling::kAuto;
  if (name == "paper") return ApsScaling::kPaper;
  if (name == "sum") return ApsScaling::kSum;
  return Status::InvalidArgument("unknown APS scaling '" + name + "' (accepted: auto, paper, sum)");
}

const char* ApsScalingName(ApsScaling s) {
  switch (s) {
    case ApsScaling::kAuto:
      return "auto";
    case ApsScaling::kPaper:
      return "paper";
    case ApsScaling::kSum:
      return "sum";
  }
  return "?";
}

bool UsesApsSumScaling(const GradientAllReduceOptions& o) {
  return o.aps && o.algo == AllReduceAlgo::kPacked && o.aps_scaling != ApsScaling::kPaper;
}

Status GradientAllReduceOptions::Validate() const {
  if (algo != AllReduceAlgo::kFp32) {
    Result<Format> f = Format::Parse(format);
    if (!f.ok()) {
      return Status::InvalidArgument("gradient format '" + format + "' for all-reduce " +
                                     AllReduceAlgoName(algo) + ": " + f.status().message());
    }
  }
  if (!(bucket_mb > 0.0) || !(bucket_mb <= kMaxBucketMb)) {
    return Status::InvalidArgument(
        "--bucket-mb " + NumberText(bucket_mb) +
        " is not accepted: a number of MiB > 0 and <= " + NumberText(kMaxBucketMb));
  }
  if (threads < 0) {
    return Status::InvalidArgument("threads must be >= 0 (0 = all cores), got " +
                                   std::to_string(threads));
  }
  if (pipeline_kb < 0 || pipeline_kb > kMaxPipelineKb) {
    return Status::InvalidArgument("--pipeline-kb " + std::to_string(pipeline_kb) +
                                   " is not accepted: 0 (sequential) or 1.." +
                                   std::to_string(kMaxPipelineKb) + " KiB of codes per round");
  }
  if (kahan && algo != AllReduceAlgo::kEmulate) {
    return Status::InvalidArgument(std::string("kahan summation applies to all-reduce emulate "
                                               "only, not ") +
                                   AllReduceAlgoName(algo));
  }
  if (aps_scaling == ApsScaling::kSum && algo == AllReduceAlgo::kEmulate) {
    return Status::InvalidArgument(
        "aps_scaling sum applies to all-reduce packed only; emulate sums in the format and "
        "keeps the paper's scaling (accepted: auto, paper)");
  }
  if (!layer_formats.empty() && algo == AllReduceAlgo::kFp32) {
    return Status::InvalidArgument(
        "per-layer all-reduce formats (layer_formats) apply to all-reduce emulate and packed, "
        "not fp32");
  }
  for (const auto& [layer, spec] : layer_formats) {
    Result<Format> f = Format::Parse(spec);
    if (!f.ok()) {
      return Status::InvalidArgument("all-reduce format '" + spec + "' of layer '" + layer +
                                     "': " + f.status().message());
    }
  }
  return Status::Ok();
}

bool DeviceGradientsSupported() { return CPD_WITH_CUDA; }

int ApsShift(float max_abs, int workers, int emax) {
  if (!(max_abs > 0.0f) || !std::isfinite(max_abs) || workers < 1) return 0;
  // max_abs * workers is exact in double (24-bit significand times an int below 2^29).
  const double v = double(max_abs) * double(workers);
  int e = 0;
  const double m = std::frexp(v, &e);  // v = m * 2^e, 0.5 <= m < 1
  const int ceil_log2 = m == 0.5 ? e - 1 : e;
  return std::clamp(emax - ceil_log2, -kMaxShift, kMaxShift);
}

int ApsEmax(const Format& format) {
  switch (format.family()) {
    case FormatFamily::kIntSymmetric:
      return kernels::FloorLog2(float((1 << (format.bits() - 1)) - 1));
    case FormatFamily::kUintMinMax:
      return kernels::FloorLog2(float((1u << format.bits()) - 1u));
    case FormatFamily::kBinades:
      return kernels::FloorLog2(kernels::BitsFloat(format.binade_grid().max_bits));
    default:
      return kernels::FloorLog2(kernels::BitsFloat(format.grid().max_bits));
  }
}

Result<std::unique_ptr<GradientAllReducer>> GradientAllReducer::Create(
    Communicator* comm, const GradientAllReduceOptions& opts, GradientLayout layout,
    int local_replicas) {
  if (comm == nullptr) {
    return Status::InvalidArgument("GradientAllReducer: null communicator");
  }
  if (comm->memory() != MemorySpace::kHost && opts.gradients != MemorySpace::kDevice) {
    return Status::InvalidArgument(
        "GradientAllReducer: the communicator works on device memory; host gradients need a "
        "host-memory one (SelfCommunicator or MpiCommunicator), or set gradients = kDevice");
  }
  CPD_RETURN_IF_ERROR(opts.Validate());
  if (local_replicas < 1) {
    return Status::InvalidArgument("GradientAllReducer: local_replicas (K) must be >= 1, got " +
                                   std::to_string(local_replicas));
  }
  CPD_RETURN_IF_ERROR(ValidateLayout(layout));
  const bool fp32 = opts.algo == AllReduceAlgo::kFp32;
  ReducerSetup setup;
  CPD_ASSIGN_OR_RETURN(setup.format, Format::Parse(fp32 ? std::string("fp32") : opts.format));
  setup.comm = comm;
  setup.options = opts;
  setup.layout = std::move(layout);
  setup.local_replicas = local_replicas;
  setup.world_size = comm->size();
  setup.rank = comm->rank();
  setup.workers = comm->size() * local_replicas;
  setup.threads = opts.threads > 0 ? opts.threads : std::max(1, omp_get_max_threads());
  setup.emax = fp32 ? 0 : ApsEmax(setup.format);
  setup.aps_sum = UsesApsSumScaling(opts);
  setup.round_mode = ToRoundMode(opts.rounding);
  CPD_RETURN_IF_ERROR(internal::ResolveLayerFormats(&setup));
  auto reducer = std::make_unique<Reducer>(std::move(setup));
  CPD_RETURN_IF_ERROR(reducer->Init());
  return std::unique_ptr<GradientAllReducer>(std::move(reducer));
}

}  // namespace cpd::comm
