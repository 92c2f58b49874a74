// fp32: the K local replicas summed in float32 in replica order, then the backend's own
// all-reduce, bucket by bucket.
#include <algorithm>
#include <cstring>

#include "comm/allreduce/internal.h"

namespace cpd::comm::internal {
namespace {

// Elements per work item of the replica sum.
constexpr std::size_t kSumBlock = std::size_t(1) << 16;

class Fp32 final : public Algorithm {
 public:
  explicit Fp32(StepContext* ctx) : ctx_(*ctx), setup_(ctx->setup) {}

  Status Reduce(float* const* inputs, float* output, std::int64_t /*step*/,
                bool measure_error) override {
    SumLocalReplicas(inputs, output);
    for (const BucketPlan& b : ctx_.plan.buckets()) {
      if (measure_error) {
        // `output` holds this rank's sum of its replicas now, before the all-reduce.
        const float* local[1] = {output};
        CPD_RETURN_IF_ERROR(ctx_.stats.ReduceReference(b, local, 1));
      }
      CPD_RETURN_IF_ERROR(ctx_.AllReduceSum(output + b.bounds.begin, b.size()));
      if (measure_error) ctx_.stats.AccumulateError(b, output);
    }
    return Status::Ok();
  }

 private:
  void SumLocalReplicas(float* const* inputs, float* output) const {
    const int replicas = setup_.local_replicas;
    if (replicas == 1 && output == inputs[0]) return;
    const std::size_t total = setup_.layout.total();
    const int threads = setup_.threads;
    const long blocks = long((total + kSumBlock - 1) / kSumBlock);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && blocks > 1)
    for (long bi = 0; bi < blocks; ++bi) {
      const std::size_t s = std::size_t(bi) * kSumBlock, e = std::min(total, s + kSumBlock);
      if (replicas == 1) {
        std::memcpy(output + s, inputs[0] + s, (e - s) * sizeof(float));
        continue;
      }
      for (std::size_t i = s; i < e; ++i) {
        float acc = inputs[0][i];
        for (int k = 1; k < replicas; ++k) acc += inputs[k][i];
        output[i] = acc;
      }
    }
  }

  StepContext& ctx_;
  const ReducerSetup& setup_;
};

}  // namespace

Result<std::unique_ptr<Algorithm>> MakeFp32(StepContext* ctx) {
  return std::unique_ptr<Algorithm>(new Fp32(ctx));
}

}  // namespace cpd::comm::internal
