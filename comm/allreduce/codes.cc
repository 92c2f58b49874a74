#include "comm/allreduce/codes.h"

#include <omp.h>

#include <algorithm>

namespace cpd::comm::internal {

bool CodeTransport::Supports(const Format& format) {
  return format.family() == FormatFamily::kFloat && format.bits() <= 16;
}

CodeTransport::CodeTransport(StepContext* ctx)
    : ctx_(*ctx),
      setup_(ctx->setup),
      bits_(ctx->setup.format.bits()),
      decoder_(MakeCodeDecoder(ctx->setup.format.grid())) {}

Result<std::unique_ptr<CodeTransport>> CodeTransport::Create(StepContext* ctx) {
  std::unique_ptr<CodeTransport> t(new CodeTransport(ctx));
  std::size_t slot = 0, gather = 0;
  for (const BucketPlan& b : ctx->plan.buckets()) {
    slot = std::max(slot, t->SlotBytes(b));
    gather = std::max(gather, t->GatherSlot(b));
  }
  CPD_RETURN_IF_ERROR(ctx->exchange.Allocate(ctx->setup, slot, gather));
  t->thread_codes_.assign(std::size_t(ctx->setup.threads) * kPiece, 0);
  return t;
}

std::size_t CodeTransport::SlotBytes(const BucketPlan& b) const {
  return internal::SlotBytes(PackedCodeBytes(setup_.format, b.max_chunk));
}

std::size_t CodeTransport::PieceOffset(const BucketPlan& b, const Piece& pc) const {
  return (pc.begin - b.chunk_begin(pc.chunk)) * std::size_t(bits_) / 8;
}

void CodeTransport::EncodeContributions(const BucketPlan& b, float* const* inputs,
                                        std::int64_t step) {
  const std::size_t slot = SlotBytes(b), block = std::size_t(setup_.local_replicas) * slot;
  const int threads = setup_.threads;
  const long pieces = long(b.pieces.size());
  const long items = pieces * setup_.local_replicas;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && items > 1)
  for (long it = 0; it < items; ++it) {
    const int k = int(it / pieces);
    const Piece& pc = b.pieces[std::size_t(it % pieces)];
    std::uint8_t* dst = ctx_.exchange.send.data() + std::size_t(pc.chunk) * block +
                        std::size_t(k) * slot + PieceOffset(b, pc);
    EncodePiece(inputs[k] + pc.begin, b, pc, /*shifted=*/true, nullptr, setup_.round_mode,
                ContributionStage(setup_.worker(k)), step, dst,
                ctx_.stats.ThreadCounters(std::size_t(omp_get_thread_num())));
  }
}

Status CodeTransport::ExchangeContributions(const BucketPlan& b) {
  return ctx_.ExchangeContributions(std::size_t(setup_.local_replicas) * SlotBytes(b));
}

const std::uint8_t* CodeTransport::Contribution(const BucketPlan& b, const Piece& pc, int w) const {
  return ctx_.exchange.recv.data() + std::size_t(w) * SlotBytes(b) + PieceOffset(b, pc);
}

void CodeTransport::EncodeResult(const float* sum, const BucketPlan& b, const Piece& pc,
                                 kernels::RoundMode mode, std::int64_t stage, std::int64_t step) {
  EncodePiece(sum, b, pc, /*shifted=*/false, setup_.aps_sum ? SumShifts(b) : nullptr, mode, stage,
              step, ctx_.exchange.gather_send.data() + PieceOffset(b, pc), nullptr);
}

std::int8_t* CodeTransport::SumShifts(const BucketPlan& b) {
  return reinterpret_cast<std::int8_t*>(ctx_.exchange.gather_send.data() + SlotBytes(b));
}

Status CodeTransport::GatherResults(const BucketPlan& b) {
  return ctx_.GatherChunks(ctx_.exchange.gather_send.data(), GatherSlot(b));
}

int CodeTransport::ResultShift(const BucketPlan& b, int d, std::size_t si) const {
  const int s = ctx_.shifts[std::size_t(b.segments[si].layer)];
  if (!setup_.aps_sum) return s;
  const std::uint8_t* t = ctx_.exchange.gather_recv.data() + std::size_t(d) * GatherSlot(b) +
                          SlotBytes(b) + (si - b.seg_start[std::size_t(d)]);
  return s + int(std::int8_t(*t));
}

void CodeTransport::DecodeResults(const BucketPlan& b, float* output) const {
  const std::size_t slot = GatherSlot(b);
  const int threads = setup_.threads;
  const long all = long(b.pieces.size());
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && all > 1)
  for (long pi = 0; pi < all; ++pi) {
    const Piece& pc = b.pieces[std::size_t(pi)];
    const std::uint8_t* src =
        ctx_.exchange.gather_recv.data() + std::size_t(pc.chunk) * slot + PieceOffset(b, pc);
    const Segment& first = b.segments[pc.first_segment];
    if (first.end >= pc.end) {
      // One layer: decode and undo its shift in one pass.
      const int sh = ResultShift(b, pc.chunk, pc.first_segment);
      if (sh == 0) {
        DecodeCodes(src, pc.size(), decoder_, output + pc.begin);
      } else {
        DecodeCodesScaled(src, pc.size(), decoder_, kernels::Pow2(-sh), output + pc.begin);
      }
      continue;
    }
    DecodeCodes(src, pc.size(), decoder_, output + pc.begin);
    for (std::size_t si = pc.first_segment; si < b.segments.size() && b.segments[si].begin < pc.end;
         ++si) {
      const Segment& s = b.segments[si];
      const int sh = ResultShift(b, pc.chunk, si);
      if (sh == 0) continue;
      const float up = kernels::Pow2(-sh);
      const std::size_t lo = std::max(s.begin, pc.begin), hi = std::min(s.end, pc.end);
      for (std::size_t i = lo; i < hi; ++i) output[i] *= up;
    }
  }
}

void CodeTransport::EncodePiece(const float* x, const BucketPlan& b, const Piece& pc, bool shifted,
                                const std::int8_t* sum_shifts, kernels::RoundMode mode,
                                std::int64_t stage, std::int64_t step, std::uint8_t* dst,
                                std::uint64_t* counters) {
  const kernels::FloatGrid& g = setup_.format.grid();
  // 8-bit codes go straight to dst; other widths through an L1 buffer, packed at the end.
  std::uint16_t* c16 = &thread_codes_[std::size_t(omp_get_thread_num()) * kPiece];
  std::uint8_t* c8 = bits_ == 8 ? dst : reinterpret_cast<std::uint8_t*>(c16);
  auto encode = [&](std::size_t lo, std::size_t hi, int shift, std::uint64_t* st) {
    const kernels::LoopParams p = setup_.LoopAt(mode, stage, step, lo);
    const float scale = kernels::Pow2(shift);
    if (bits_ <= 8) {
      EncodeCodes8(x + (lo - pc.begin), hi - lo, scale, g, p, c8 + (lo - pc.begin), st, shifted);
    } else {
      EncodeCodes16(x + (lo - pc.begin), hi - lo, scale, g, p, c16 + (lo - pc.begin), st, shifted);
    }
  };
  if (!shifted && sum_shifts == nullptr) {
    encode(pc.begin, pc.end, 0, nullptr);
  } else {
    for (std::size_t si = pc.first_segment; si < b.segments.size() && b.segments[si].begin < pc.end;
         ++si) {
      const Segment& s = b.segments[si];
      const int shift = shifted ? ctx_.shifts[std::size_t(s.layer)]
                                : sum_shifts[si - b.seg_start[std::size_t(pc.chunk)]];
      encode(std::max(s.begin, pc.begin), std::min(s.end, pc.end), shift,
             counters != nullptr ? counters + 2 * std::size_t(s.layer) : nullptr);
    }
  }
  if (bits_ < 8) PackSmallCodes(c8, pc.size(), bits_, dst);
  if (bits_ > 8) PackSmallCodes(c16, pc.size(), bits_, dst);
}

}  // namespace cpd::comm::internal
