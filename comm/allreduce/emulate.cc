// emulate, faithful to CPD: every contribution quantised to the gradient format (after the APS
// shift), the W contributions of a chunk summed in worker order with rounding to the format after
// every addition (kahan: a compensated sum, every operation rounded), the chunks all-gathered.
// Fixed float grids of <= 16 bits travel as packed codes (comm/allreduce/codes.h), other formats
// as quantised float32 values; the result is the same bits either way. Each stage runs on the
// step's back end (comm/allreduce/backend.h).
#include <algorithm>
#include <utility>

#include "comm/allreduce/codes.h"
#include "comm/allreduce/internal.h"

namespace cpd::comm::internal {
namespace {

// Packed codes: the back end sums each run of pieces and packs the sum (on the grid) at once.
class EmulateCodes final : public BucketAlgorithm {
 public:
  EmulateCodes(StepContext* ctx, std::unique_ptr<CodeTransport> codes)
      : BucketAlgorithm(ctx), codes_(std::move(codes)) {}

 protected:
  Status ReduceBucket(std::size_t, const BucketPlan& b, float* const* inputs, float* output,
                      std::int64_t step) override {
    CodeTransport::OwnChunk own;
    own.sum = [&](std::span<const Piece> pieces) {
      return ctx_.backend.SumRoundedCodes(b, pieces, codes_->Received(b), step,
                                          codes_->ResultSlot());
    };
    return codes_->ReduceBucket(b, inputs, output, step, own);
  }

 private:
  std::unique_ptr<CodeTransport> codes_;
};

// Scaled formats: the quantised values travel as float32, segment by segment.
class EmulateFloats final : public BucketAlgorithm {
 public:
  explicit EmulateFloats(StepContext* ctx) : BucketAlgorithm(ctx) {}

  Status Allocate() {
    std::size_t slot = 0;
    for (const BucketPlan& b : ctx_.plan.buckets()) slot = std::max(slot, SlotBytes(b));
    CPD_RETURN_IF_ERROR(ctx_.exchange.Allocate(setup_, &ctx_.backend, slot));
    const std::size_t chunk = ctx_.plan.max_chunk() * sizeof(float);
    // The sum is also the all-gather's send slot.
    CPD_ASSIGN_OR_RETURN(sum_, ctx_.backend.Allocate(std::max(chunk, slot)));
    CPD_ASSIGN_OR_RETURN(tmp_, ctx_.backend.Allocate(chunk));
    if (setup_.options.kahan) {
      for (Memory* m : {&comp_, &y_, &high_, &t_}) {
        CPD_ASSIGN_OR_RETURN(*m, ctx_.backend.Allocate(chunk));
      }
    }
    return Status::Ok();
  }

 protected:
  Status ReduceBucket(std::size_t, const BucketPlan& b, float* const* inputs, float* output,
                      std::int64_t step) override {
    CPD_RETURN_IF_ERROR(ctx_.ApplyShift(b, inputs));
    CPD_RETURN_IF_ERROR(QuantizeContributions(b, inputs, step));
    CPD_RETURN_IF_ERROR(
        ctx_.ExchangeContributions(std::size_t(setup_.local_replicas) * SlotBytes(b)));
    CPD_RETURN_IF_ERROR(SumOwnChunk(b, step));
    CPD_RETURN_IF_ERROR(ctx_.GatherChunks(sum_.data(), SlotBytes(b)));
    return UnshiftResults(b, output);
  }

 private:
  std::size_t SlotBytes(const BucketPlan& b) const { return FloatSlotElems(b) * sizeof(float); }

  // Every local contribution (already shifted), quantised into its destination's block.
  Status QuantizeContributions(const BucketPlan& b, float* const* inputs, std::int64_t step) {
    const std::size_t slot = SlotBytes(b) / sizeof(float);
    const std::size_t block = std::size_t(setup_.local_replicas) * slot;
    float* send = ctx_.exchange.send.floats();
    for (int d = 0; d < setup_.world_size; ++d) {
      for (int k = 0; k < setup_.local_replicas; ++k) {
        float* dst = send + std::size_t(d) * block + std::size_t(k) * slot;
        for (const Segment& s : b.segments_of(d)) {
          QuantStats qs;
          CPD_RETURN_IF_ERROR(ctx_.backend.Quantize(
              setup_.FormatOf(s.layer), inputs[k] + s.begin, dst + (s.begin - b.chunk_begin(d)),
              s.size(), setup_.QuantizeAt(ContributionStage(setup_.worker(k)), step, s.begin),
              &qs));
          ctx_.stats.AddQuantStats(s.layer, qs);
        }
      }
    }
    return Status::Ok();
  }

  // This rank's chunk, segment by segment: the W contributions summed in worker order into sum_.
  Status SumOwnChunk(const BucketPlan& b, std::int64_t step) {
    const std::size_t slot = SlotBytes(b) / sizeof(float);
    const float* recv = ctx_.exchange.recv.floats();
    const std::size_t c0 = b.chunk_begin(setup_.rank);
    for (const Segment& s : b.segments_of(setup_.rank)) {
      const std::size_t rel = s.begin - c0;
      auto q = [&](int w) { return recv + std::size_t(w) * slot + rel; };
      CPD_RETURN_IF_ERROR(ctx_.backend.Copy(sum_.floats() + rel, q(0), s.size() * sizeof(float)));
      if (setup_.options.kahan) {
        CPD_RETURN_IF_ERROR(ctx_.backend.Zero(comp_.floats() + rel, s.size() * sizeof(float)));
      }
      for (int w = 1; w < setup_.workers; ++w) {
        const std::int64_t stage = AdditionStage(setup_.workers, w);
        CPD_RETURN_IF_ERROR(setup_.options.kahan ? AddKahan(q(w), s, rel, stage, step)
                                                 : AddRounded(q(w), s, rel, stage, step));
      }
    }
    return Status::Ok();
  }

  // sum = Q(sum + q_w) over segment s (at rel in the chunk).
  Status AddRounded(const float* qw, const Segment& s, std::size_t rel, std::int64_t stage,
                    std::int64_t step) {
    float* acc = sum_.floats() + rel;
    float* tmp = tmp_.floats() + rel;
    CPD_RETURN_IF_ERROR(ctx_.backend.Combine(acc, qw, tmp, s.size(), ElementOp::kAdd));
    return ctx_.backend.Quantize(setup_.FormatOf(s.layer), tmp, acc, s.size(),
                                 setup_.QuantizeAt(stage, step, s.begin), nullptr);
  }

  // One step of Kahan's compensated sum (compensation c), every operation rounded.
  Status AddKahan(const float* qw, const Segment& s, std::size_t rel, std::int64_t stage,
                  std::int64_t step) {
    const std::size_t n = s.size();
    float *acc = sum_.floats() + rel, *tmp = tmp_.floats() + rel, *c = comp_.floats() + rel,
          *y = y_.floats() + rel, *high = high_.floats() + rel, *t = t_.floats() + rel;
    Backend& be = ctx_.backend;
    auto round = [&](float* out, int op) {
      return be.Quantize(setup_.FormatOf(s.layer), tmp, out, n,
                         setup_.QuantizeAt(stage + op, step, s.begin), nullptr);
    };
    CPD_RETURN_IF_ERROR(be.Combine(qw, c, tmp, n, ElementOp::kSubtract));
    CPD_RETURN_IF_ERROR(round(y, kKahanY));
    CPD_RETURN_IF_ERROR(be.Combine(acc, y, tmp, n, ElementOp::kAdd));
    CPD_RETURN_IF_ERROR(round(t, kKahanT));
    CPD_RETURN_IF_ERROR(be.Combine(t, acc, tmp, n, ElementOp::kSubtract));
    CPD_RETURN_IF_ERROR(round(high, kKahanHigh));
    CPD_RETURN_IF_ERROR(be.Combine(high, y, tmp, n, ElementOp::kSubtract));
    CPD_RETURN_IF_ERROR(round(c, kKahanC));
    return be.Copy(acc, t, n * sizeof(float));
  }

  // Every chunk's result, times 2^-s of its layer (also for s = 0: x * 1 is x, NaN included).
  Status UnshiftResults(const BucketPlan& b, float* output) {
    const std::size_t slot = SlotBytes(b) / sizeof(float);
    const float* gathered = ctx_.exchange.gather_recv.floats();
    for (int d = 0; d < setup_.world_size; ++d) {
      for (const Segment& s : b.segments_of(d)) {
        const float up = kernels::Pow2(-ctx_.shifts[std::size_t(s.layer)]);
        const float* src = gathered + std::size_t(d) * slot + (s.begin - b.chunk_begin(d));
        CPD_RETURN_IF_ERROR(ctx_.backend.Scale(src, output + s.begin, s.size(), up));
      }
    }
    return Status::Ok();
  }

  Memory sum_, tmp_, comp_, y_, high_, t_;  // a chunk each
};

}  // namespace

Result<std::unique_ptr<Algorithm>> MakeEmulate(StepContext* ctx) {
  // A hybrid plan rounds each segment to its layer's format: the per-segment path.
  if (!ctx->setup.mixed() && CodeTransport::Supports(ctx->setup.format)) {
    CPD_ASSIGN_OR_RETURN(std::unique_ptr<CodeTransport> codes, CodeTransport::Create(ctx));
    return std::unique_ptr<Algorithm>(new EmulateCodes(ctx, std::move(codes)));
  }
  auto floats = std::make_unique<EmulateFloats>(ctx);
  CPD_RETURN_IF_ERROR(floats->Allocate());
  return std::unique_ptr<Algorithm>(std::move(floats));
}

}  // namespace cpd::comm::internal
