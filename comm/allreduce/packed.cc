// packed, the bandwidth-saving mode: values travel as densely packed b-bit codes with their scale
// metadata. All-to-all of the packed contributions (reduce-scatter), decode and sum the W
// contributions of a chunk in float32, one re-quantisation of the sum, all-gather of the packed
// result. Fixed float grids of <= 16 bits use the piece schedule of comm/allreduce/codes.h; other
// formats cpd::Encode each segment (its scale group) with its metadata. With APS sum scaling
// (ReducerSetup::aps_sum) each segment's sum is re-quantised after its own shift t, which travels
// with the all-gather (comm/gradient_allreduce.h, "APS scaling of packed"). Each stage runs on the
// step's back end (comm/allreduce/backend.h).
#include <algorithm>
#include <utility>

#include "comm/allreduce/codes.h"
#include "comm/allreduce/internal.h"

namespace cpd::comm::internal {
namespace {

// Fixed float grids: packed codes, run of pieces by run of pieces.
class PackedCodes final : public BucketAlgorithm {
 public:
  PackedCodes(StepContext* ctx, std::unique_ptr<CodeTransport> codes)
      : BucketAlgorithm(ctx), codes_(std::move(codes)) {}

  Status Allocate() {
    if (!setup_.aps_sum) return Status::Ok();
    CPD_ASSIGN_OR_RETURN(chunk_sums_, ctx_.backend.Allocate(ctx_.plan.max_chunk() * sizeof(float)));
    return Status::Ok();
  }

 protected:
  Status ReduceBucket(std::size_t, const BucketPlan& b, float* const* inputs, float* output,
                      std::int64_t step) override {
    CodeTransport::OwnChunk own;
    Backend& be = ctx_.backend;
    if (!setup_.aps_sum) {
      // Each run of pieces summed and rounded once to the format, packed for the all-gather.
      own.sum = [&](std::span<const Piece> pieces) {
        return be.SumRequantizeCodes(b, pieces, codes_->Received(b), step, codes_->ResultSlot());
      };
    } else {
      // The chunk's float32 sums are kept, with each segment's max|sum| (its shift t needs the
      // whole segment), and rounded once t is known.
      const std::size_t c0 = b.chunk_begin(setup_.rank);
      own.sum = [&, c0](std::span<const Piece> pieces) {
        return be.SumCodes(b, pieces, codes_->Received(b), chunk_sums_.floats(), c0);
      };
      own.finish = [&, c0] { return SetSumShifts(b, c0); };
      own.encode = [&, c0](std::span<const Piece> pieces) {
        return be.EncodeCodes(b, pieces, chunk_sums_.floats(), c0, Shifts::kSums, setup_.round_mode,
                              RequantizeStage(setup_.workers), step, codes_->ResultSlot(),
                              /*count=*/false);
      };
    }
    return codes_->ReduceBucket(b, inputs, output, step, own);
  }

 private:
  // aps_sum, once the chunk is summed: each segment's t from the maxima of its sums.
  Status SetSumShifts(const BucketPlan& b, std::size_t c0) {
    CPD_RETURN_IF_ERROR(ctx_.backend.SegmentMaxima(b, chunk_sums_.floats(), c0, &max_bits_));
    const std::span<const Segment> own = b.segments_of(setup_.rank);
    t_.resize(own.size());
    for (std::size_t j = 0; j < own.size(); ++j) {
      t_[j] =
          std::int8_t(SumShift(max_bits_[j], ctx_.shifts[std::size_t(own[j].layer)], setup_.emax));
    }
    return codes_->WriteSumShifts(b, t_);
  }

  std::unique_ptr<CodeTransport> codes_;
  Memory chunk_sums_;  // aps_sum: the float32 sums of a chunk
  std::vector<std::uint32_t> max_bits_;
  std::vector<std::int8_t> t_;
};

// Scaled formats: cpd::Encode per segment, codes and scale metadata.
class PackedSegments final : public BucketAlgorithm {
 public:
  explicit PackedSegments(StepContext* ctx) : BucketAlgorithm(ctx) {}

  // Lays out every bucket's slots and allocates the buffers.
  Status Allocate();

 protected:
  Status ReduceBucket(std::size_t index, const BucketPlan& b, float* const* inputs, float* output,
                      std::int64_t step) override {
    const Slots& slots = slots_[index];
    CPD_RETURN_IF_ERROR(ctx_.ApplyShift(b, inputs));
    CPD_RETURN_IF_ERROR(EncodeContributions(b, slots, inputs, step));
    CPD_RETURN_IF_ERROR(
        ctx_.ExchangeContributions(std::size_t(setup_.local_replicas) * slots.bytes));
    CPD_RETURN_IF_ERROR(SumAndRequantizeOwnChunk(b, slots, step));
    CPD_RETURN_IF_ERROR(ctx_.GatherChunks(ctx_.exchange.gather_send.data(),
                                          GatherSlotBytes(setup_, b, slots.bytes)));
    return DecodeResults(b, slots, output);
  }

 private:
  using Slots = SegmentSlots;

  Status EncodeContributions(const BucketPlan& b, const Slots& slots, float* const* inputs,
                             std::int64_t step);
  Status SumAndRequantizeOwnChunk(const BucketPlan& b, const Slots& slots, std::int64_t step);
  Status DecodeResults(const BucketPlan& b, const Slots& slots, float* output);

  std::vector<Slots> slots_;  // per bucket
  Memory sum_, tmp_;          // a chunk each
  std::vector<std::uint32_t> max_bits_;
  std::vector<std::int8_t> t_, gathered_;  // aps_sum: shifts t of a chunk's segments
};

Status PackedSegments::Allocate() {
  std::size_t slot = 0, gather = 0, segment = 0, segments = 0;
  slots_ = LayOutSegmentSlots(setup_, ctx_.plan, &segment);
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    const BucketPlan& b = ctx_.plan.buckets()[i];
    slot = std::max(slot, slots_[i].bytes);
    gather = std::max(gather, GatherSlotBytes(setup_, b, slots_[i].bytes));
    segments = std::max(segments, b.segments.size());
  }
  CPD_RETURN_IF_ERROR(ctx_.exchange.Allocate(setup_, &ctx_.backend, slot, gather));
  const std::size_t chunk = ctx_.plan.max_chunk() * sizeof(float);
  CPD_ASSIGN_OR_RETURN(sum_, ctx_.backend.Allocate(chunk));
  CPD_ASSIGN_OR_RETURN(tmp_, ctx_.backend.Allocate(chunk));
  t_.assign(segments, 0);
  gathered_.assign(segments, 0);
  return Status::Ok();
}

Status PackedSegments::EncodeContributions(const BucketPlan& b, const Slots& slots,
                                           float* const* inputs, std::int64_t step) {
  const std::size_t block = std::size_t(setup_.local_replicas) * slots.bytes;
  for (int d = 0; d < setup_.world_size; ++d) {
    for (int k = 0; k < setup_.local_replicas; ++k) {
      std::uint8_t* dst =
          ctx_.exchange.send.data() + std::size_t(d) * block + std::size_t(k) * slots.bytes;
      for (std::size_t si = b.seg_start[std::size_t(d)]; si < b.seg_start[std::size_t(d) + 1];
           ++si) {
        const Segment& s = b.segments[si];
        QuantStats qs;
        CPD_RETURN_IF_ERROR(ctx_.backend.Encode(
            setup_.FormatOf(s.layer), inputs[k] + s.begin, s.size(),
            setup_.QuantizeAt(ContributionStage(setup_.worker(k)), step, s.begin),
            dst + slots.offset[si], &qs));
        ctx_.stats.AddQuantStats(s.layer, qs);
      }
    }
  }
  return Status::Ok();
}

Status PackedSegments::SumAndRequantizeOwnChunk(const BucketPlan& b, const Slots& slots,
                                                std::int64_t step) {
  const int rank = setup_.rank;
  const std::size_t c0 = b.chunk_begin(rank), seg0 = b.seg_start[std::size_t(rank)];
  const std::span<const Segment> own = b.segments_of(rank);
  Backend& be = ctx_.backend;
  for (const Segment& s : own) {
    float* sum = sum_.floats() + (s.begin - c0);
    float* tmp = tmp_.floats() + (s.begin - c0);
    const std::size_t si = seg0 + std::size_t(&s - own.data());
    for (int w = 0; w < setup_.workers; ++w) {
      const std::uint8_t* src =
          ctx_.exchange.recv.data() + std::size_t(w) * slots.bytes + slots.offset[si];
      CPD_RETURN_IF_ERROR(be.Decode(setup_.FormatOf(s.layer), src, s.size(), w == 0 ? sum : tmp));
      if (w > 0) CPD_RETURN_IF_ERROR(be.Combine(sum, tmp, sum, s.size(), ElementOp::kAdd));
    }
  }
  if (setup_.aps_sum) {
    // Each segment's shift t (after the codes of the gather slot), applied before the rounding;
    // 0 for an fp32 layer of a hybrid plan, which travels exact and unshifted.
    CPD_RETURN_IF_ERROR(be.SegmentMaxima(b, sum_.floats(), c0, &max_bits_));
    for (std::size_t j = 0; j < own.size(); ++j) {
      const Segment& s = own[j];
      const bool fp32 = setup_.FormatOf(s.layer).family() == FormatFamily::kFloat32;
      t_[j] = std::int8_t(
          fp32 ? 0
               : SumShift(max_bits_[j], ctx_.shifts[std::size_t(s.layer)], setup_.EmaxOf(s.layer)));
    }
    if (!own.empty()) {
      CPD_RETURN_IF_ERROR(
          be.FromHost(ctx_.exchange.gather_send.data() + slots.bytes, t_.data(), own.size()));
    }
  }
  for (std::size_t j = 0; j < own.size(); ++j) {
    const Segment& s = own[j];
    float* sum = sum_.floats() + (s.begin - c0);
    if (setup_.aps_sum && t_[j] != 0) {
      CPD_RETURN_IF_ERROR(be.Scale(sum, sum, s.size(), kernels::Pow2(t_[j])));
    }
    CPD_RETURN_IF_ERROR(be.Encode(setup_.FormatOf(s.layer), sum, s.size(),
                                  setup_.QuantizeAt(RequantizeStage(setup_.workers), step, s.begin),
                                  ctx_.exchange.gather_send.data() + slots.offset[seg0 + j],
                                  nullptr));
  }
  return Status::Ok();
}

Status PackedSegments::DecodeResults(const BucketPlan& b, const Slots& slots, float* output) {
  const std::size_t gather = GatherSlotBytes(setup_, b, slots.bytes);
  Backend& be = ctx_.backend;
  for (int d = 0; d < setup_.world_size; ++d) {
    const std::uint8_t* chunk = ctx_.exchange.gather_recv.data() + std::size_t(d) * gather;
    const std::size_t s0 = b.seg_start[std::size_t(d)];
    const std::span<const Segment> segments = b.segments_of(d);
    if (setup_.aps_sum && !segments.empty()) {
      CPD_RETURN_IF_ERROR(be.ToHost(chunk + slots.bytes, segments.size(), gathered_.data()));
    }
    for (std::size_t j = 0; j < segments.size(); ++j) {
      const Segment& s = segments[j];
      CPD_RETURN_IF_ERROR(be.Decode(setup_.FormatOf(s.layer), chunk + slots.offset[s0 + j],
                                    s.size(), output + s.begin));
      // One multiply by 2^-(s + t): exact, |s + t| <= 126 (t = 0 without the sum scaling).
      const int sh = ctx_.shifts[std::size_t(s.layer)] + (setup_.aps_sum ? gathered_[j] : 0);
      if (sh == 0) continue;
      float* out = output + s.begin;
      CPD_RETURN_IF_ERROR(be.Scale(out, out, s.size(), kernels::Pow2(-sh)));
    }
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<Algorithm>> MakePacked(StepContext* ctx) {
  // A hybrid plan's segments differ in format and size: the per-segment path carries them.
  if (!ctx->setup.mixed() && CodeTransport::Supports(ctx->setup.format)) {
    CPD_ASSIGN_OR_RETURN(std::unique_ptr<CodeTransport> codes, CodeTransport::Create(ctx));
    auto packed = std::make_unique<PackedCodes>(ctx, std::move(codes));
    CPD_RETURN_IF_ERROR(packed->Allocate());
    return std::unique_ptr<Algorithm>(std::move(packed));
  }
  auto segments = std::make_unique<PackedSegments>(ctx);
  CPD_RETURN_IF_ERROR(segments->Allocate());
  return std::unique_ptr<Algorithm>(std::move(segments));
}

}  // namespace cpd::comm::internal
