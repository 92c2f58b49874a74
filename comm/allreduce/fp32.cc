// fp32: the K local replicas summed in float32 in replica order, then the backend's own
// all-reduce, bucket by bucket.
#include "comm/allreduce/internal.h"

namespace cpd::comm::internal {
namespace {

class Fp32 final : public Algorithm {
 public:
  explicit Fp32(StepContext* ctx) : ctx_(*ctx), setup_(ctx->setup) {}

  Status Reduce(float* const* inputs, float* output, std::int64_t /*step*/,
                bool measure_error) override {
    if (setup_.local_replicas > 1 || output != inputs[0]) {
      CPD_RETURN_IF_ERROR(
          ctx_.backend.SumBuffers(inputs, setup_.local_replicas, 0, setup_.layout.total(), output));
    }
    for (const BucketPlan& b : ctx_.plan.buckets()) {
      if (measure_error) {
        // `output` holds this rank's sum of its replicas now, before the all-reduce.
        const float* local[1] = {output};
        CPD_RETURN_IF_ERROR(ctx_.stats.ReduceReference(b, local, 1));
      }
      CPD_RETURN_IF_ERROR(ctx_.AllReduceSum(output + b.bounds.begin, b.size()));
      if (measure_error) CPD_RETURN_IF_ERROR(ctx_.stats.AccumulateError(b, output));
    }
    return Status::Ok();
  }

 private:
  StepContext& ctx_;
  const ReducerSetup& setup_;
};

}  // namespace

Result<std::unique_ptr<Algorithm>> MakeFp32(StepContext* ctx) {
  return std::unique_ptr<Algorithm>(new Fp32(ctx));
}

}  // namespace cpd::comm::internal
