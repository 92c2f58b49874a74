// packed, the bandwidth-saving mode: values travel as densely packed b-bit codes with their scale
// metadata. All-to-all of the packed contributions (reduce-scatter), decode and sum the W
// contributions of a chunk in float32, one re-quantisation of the sum, all-gather of the packed
// result. Fixed float grids of <= 16 bits use the piece pipeline of comm/allreduce/codes.h; other
// formats cpd::Encode each segment (its scale group) with its metadata. With APS sum scaling
// (ReducerSetup::aps_sum) each segment's sum is re-quantised after its own shift t, which travels
// with the all-gather (comm/gradient_allreduce.h, "APS scaling of packed").
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "comm/allreduce/codes.h"
#include "comm/allreduce/internal.h"

namespace cpd::comm::internal {
namespace {

// Fixed float grids: packed codes, piece by piece.
class PackedCodes final : public BucketAlgorithm {
 public:
  PackedCodes(StepContext* ctx, std::unique_ptr<CodeTransport> codes)
      : BucketAlgorithm(ctx), codes_(std::move(codes)) {
    thread_sums_.assign(std::size_t(setup_.threads) * kPiece, 0.0f);
    if (setup_.aps_sum) {
      std::size_t segments = 0;
      for (const BucketPlan& b : ctx_.plan.buckets()) {
        for (int d = 0; d < setup_.world_size; ++d) {
          segments = std::max(segments, b.segments_of(d).size());
        }
      }
      chunk_sums_.assign(ctx_.plan.max_chunk(), 0.0f);
      thread_max_.assign(std::size_t(setup_.threads) * segments, 0u);
    }
  }

 protected:
  Status ReduceBucket(std::size_t, const BucketPlan& b, float* const* inputs, float* output,
                      std::int64_t step) override {
    CodeTransport::OwnChunk own;
    if (!setup_.aps_sum) {
      own.sum = [&](std::span<const Piece> pieces) { SumAndRequantize(b, pieces, step); };
    } else {
      std::fill(thread_max_.begin(), thread_max_.end(), 0u);
      own.sum = [&](std::span<const Piece> pieces) { SumAndFindMaxima(b, pieces); };
      own.finish = [&] { SetSumShifts(b); };
      own.encode = [&](std::span<const Piece> pieces) { RequantizeSums(b, pieces, step); };
    }
    return codes_->ReduceBucket(b, inputs, output, step, own);
  }

 private:
  // The W contributions of each piece decoded and summed in float32 (into sum).
  void SumPiece(const BucketPlan& b, const Piece& pc, float* sum) const {
    const CodeDecoder& dec = codes_->decoder();
    DecodeCodes(codes_->Contribution(b, pc, 0), pc.size(), dec, sum);
    for (int w = 1; w < setup_.workers; ++w) {
      DecodeCodesAdd(codes_->Contribution(b, pc, w), pc.size(), dec, sum);
    }
  }

  // Pieces of this rank's chunk: the sums, then one rounding of each to the format, packed for
  // the all-gather.
  void SumAndRequantize(const BucketPlan& b, std::span<const Piece> pieces, std::int64_t step) {
    const int threads = setup_.threads;
    const long n = long(pieces.size());
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n > 1)
    for (long i = 0; i < n; ++i) {
      codes_->KeepExchangesMoving(i);
      const Piece& pc = pieces[std::size_t(i)];
      float* sum = &thread_sums_[std::size_t(omp_get_thread_num()) * kPiece];
      SumPiece(b, pc, sum);
      codes_->EncodeResult(sum, b, pc, setup_.round_mode, RequantizeStage(setup_.workers), step);
    }
  }

  // aps_sum: the chunk's float32 sums are kept, with each segment's max|sum| (its shift t needs
  // the whole segment), and rounded once t is known (RequantizeSums).
  void SumAndFindMaxima(const BucketPlan& b, std::span<const Piece> pieces) {
    const int rank = setup_.rank;
    const std::size_t c0 = b.chunk_begin(rank), seg0 = b.seg_start[std::size_t(rank)];
    const std::size_t segments = b.segments_of(rank).size();
    const int threads = setup_.threads;
    const long n = long(pieces.size());
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n > 1)
    for (long i = 0; i < n; ++i) {
      codes_->KeepExchangesMoving(i);
      const Piece& pc = pieces[std::size_t(i)];
      float* sum = chunk_sums_.data() + (pc.begin - c0);
      SumPiece(b, pc, sum);
      std::uint32_t* max_bits = &thread_max_[std::size_t(omp_get_thread_num()) * segments];
      for (std::size_t si = pc.first_segment;
           si < b.segments.size() && b.segments[si].begin < pc.end; ++si) {
        const std::size_t lo = std::max(b.segments[si].begin, pc.begin);
        const std::size_t hi = std::min(b.segments[si].end, pc.end);
        std::uint64_t nonzero = 0;
        ScanAbs(sum + (lo - pc.begin), hi - lo, &max_bits[si - seg0], &nonzero);
      }
    }
  }

  // aps_sum, once the chunk is summed: each segment's t from the threads' maxima.
  void SetSumShifts(const BucketPlan& b) {
    const int rank = setup_.rank, threads = setup_.threads;
    const std::size_t seg0 = b.seg_start[std::size_t(rank)];
    const std::size_t segments = b.segments_of(rank).size();
    std::int8_t* t = codes_->SumShifts(b);
    for (std::size_t j = 0; j < segments; ++j) {
      std::uint32_t m = 0;
      for (int th = 0; th < threads; ++th) {
        m = std::max(m, thread_max_[std::size_t(th) * segments + j]);
      }
      t[j] = std::int8_t(
          SumShift(m, ctx_.shifts[std::size_t(b.segments[seg0 + j].layer)], setup_.emax));
    }
  }

  void RequantizeSums(const BucketPlan& b, std::span<const Piece> pieces, std::int64_t step) {
    const std::size_t c0 = b.chunk_begin(setup_.rank);
    const int threads = setup_.threads;
    const long n = long(pieces.size());
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n > 1)
    for (long i = 0; i < n; ++i) {
      codes_->KeepExchangesMoving(i);
      const Piece& pc = pieces[std::size_t(i)];
      codes_->EncodeResult(chunk_sums_.data() + (pc.begin - c0), b, pc, setup_.round_mode,
                           RequantizeStage(setup_.workers), step);
    }
  }

  std::unique_ptr<CodeTransport> codes_;
  std::vector<float> thread_sums_;  // kPiece per thread
  // aps_sum: the float32 sums of a chunk; per thread, max|sum| bits of each segment of a chunk.
  std::vector<float> chunk_sums_;
  std::vector<std::uint32_t> thread_max_;
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
    ctx_.ApplyShift(b, inputs);
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

  std::size_t SegmentBytes(const Segment& s) const {
    return PackedSize(setup_.FormatOf(s.layer), s.size(), 1);
  }

  Status EncodeContributions(const BucketPlan& b, const Slots& slots, float* const* inputs,
                             std::int64_t step);
  Status SumAndRequantizeOwnChunk(const BucketPlan& b, const Slots& slots, std::int64_t step);
  Status DecodeResults(const BucketPlan& b, const Slots& slots, float* output);
  // Decodes the packed segment s at src into out.
  Status DecodeSegment(const Segment& s, const std::uint8_t* src, float* out);

  std::vector<Slots> slots_;      // per bucket
  std::vector<float> sum_, tmp_;  // a chunk each
  PackedTensor packed_;           // one segment, the largest reserved
};

Status PackedSegments::Allocate() {
  std::size_t slot = 0, gather = 0, segment = 0;
  slots_ = LayOutSegmentSlots(setup_, ctx_.plan, &segment);
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    slot = std::max(slot, slots_[i].bytes);
    gather = std::max(gather, GatherSlotBytes(setup_, ctx_.plan.buckets()[i], slots_[i].bytes));
  }
  CPD_RETURN_IF_ERROR(ctx_.exchange.Allocate(setup_, slot, gather));
  const std::size_t chunk = ctx_.plan.max_chunk();
  sum_.assign(chunk, 0.0f);
  tmp_.assign(chunk, 0.0f);
  packed_.bytes.reserve(segment);
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
        CPD_RETURN_IF_ERROR(Encode(
            setup_.FormatOf(s.layer), inputs[k] + s.begin, s.size(),
            setup_.QuantizeAt(ContributionStage(setup_.worker(k)), step, s.begin), &packed_, &qs));
        std::memcpy(dst + slots.offset[si], packed_.bytes.data(), packed_.bytes.size());
        ctx_.stats.AddQuantStats(s.layer, qs);
      }
    }
  }
  return Status::Ok();
}

Status PackedSegments::SumAndRequantizeOwnChunk(const BucketPlan& b, const Slots& slots,
                                                std::int64_t step) {
  const int rank = setup_.rank;
  const std::size_t c0 = b.chunk_begin(rank);
  for (std::size_t si = b.seg_start[std::size_t(rank)]; si < b.seg_start[std::size_t(rank) + 1];
       ++si) {
    const Segment& s = b.segments[si];
    float* sum = sum_.data() + (s.begin - c0);
    float* tmp = tmp_.data() + (s.begin - c0);
    for (int w = 0; w < setup_.workers; ++w) {
      const std::uint8_t* src =
          ctx_.exchange.recv.data() + std::size_t(w) * slots.bytes + slots.offset[si];
      CPD_RETURN_IF_ERROR(DecodeSegment(s, src, w == 0 ? sum : tmp));
      if (w > 0) {
        for (std::size_t i = 0; i < s.size(); ++i) sum[i] += tmp[i];
      }
    }
    const Format& format = setup_.FormatOf(s.layer);
    if (setup_.aps_sum) {
      // The segment's shift t (after the codes of the gather slot), applied before the rounding;
      // 0 for an fp32 layer of a hybrid plan, which travels exact and unshifted.
      int t = 0;
      if (format.family() != FormatFamily::kFloat32) {
        std::uint32_t max_bits = 0;
        std::uint64_t nonzero = 0;
        ScanAbs(sum, s.size(), &max_bits, &nonzero);
        t = SumShift(max_bits, ctx_.shifts[std::size_t(s.layer)], setup_.EmaxOf(s.layer));
      }
      ctx_.exchange.gather_send[slots.bytes + (si - b.seg_start[std::size_t(rank)])] =
          std::uint8_t(std::int8_t(t));
      if (t != 0) {
        const float scale = kernels::Pow2(t);
        for (std::size_t i = 0; i < s.size(); ++i) sum[i] *= scale;
      }
    }
    CPD_RETURN_IF_ERROR(Encode(format, sum, s.size(),
                               setup_.QuantizeAt(RequantizeStage(setup_.workers), step, s.begin),
                               &packed_, nullptr));
    std::memcpy(ctx_.exchange.gather_send.data() + slots.offset[si], packed_.bytes.data(),
                packed_.bytes.size());
  }
  return Status::Ok();
}

Status PackedSegments::DecodeResults(const BucketPlan& b, const Slots& slots, float* output) {
  const std::size_t gather = GatherSlotBytes(setup_, b, slots.bytes);
  for (int d = 0; d < setup_.world_size; ++d) {
    const std::uint8_t* chunk = ctx_.exchange.gather_recv.data() + std::size_t(d) * gather;
    for (std::size_t si = b.seg_start[std::size_t(d)]; si < b.seg_start[std::size_t(d) + 1]; ++si) {
      const Segment& s = b.segments[si];
      CPD_RETURN_IF_ERROR(DecodeSegment(s, chunk + slots.offset[si], output + s.begin));
      if (setup_.aps_sum) {
        // One multiply by 2^-(s + t): exact, |s + t| <= 126.
        const int t = std::int8_t(chunk[slots.bytes + (si - b.seg_start[std::size_t(d)])]);
        const int sh = ctx_.shifts[std::size_t(s.layer)] + t;
        if (sh == 0) continue;
        const float up = kernels::Pow2(-sh);
        for (std::size_t i = s.begin; i < s.end; ++i) output[i] *= up;
      }
    }
    if (!setup_.aps_sum) ctx_.Unshift(b, d, output);
  }
  return Status::Ok();
}

Status PackedSegments::DecodeSegment(const Segment& s, const std::uint8_t* src, float* out) {
  packed_.count = s.size();
  packed_.channels = 1;
  packed_.bytes.assign(src, src + SegmentBytes(s));
  return Decode(setup_.FormatOf(s.layer), packed_, out, setup_.threads);
}

}  // namespace

Result<std::unique_ptr<Algorithm>> MakePacked(StepContext* ctx) {
  // A hybrid plan's segments differ in format and size: the per-segment path carries them.
  if (!ctx->setup.mixed() && CodeTransport::Supports(ctx->setup.format)) {
    CPD_ASSIGN_OR_RETURN(std::unique_ptr<CodeTransport> codes, CodeTransport::Create(ctx));
    return std::unique_ptr<Algorithm>(new PackedCodes(ctx, std::move(codes)));
  }
  auto segments = std::make_unique<PackedSegments>(ctx);
  CPD_RETURN_IF_ERROR(segments->Allocate());
  return std::unique_ptr<Algorithm>(std::move(segments));
}

}  // namespace cpd::comm::internal
