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
  t->send_blocks_.resize(std::size_t(ctx->setup.world_size));
  t->recv_blocks_.resize(std::size_t(ctx->setup.world_size));
  return t;
}

std::size_t CodeTransport::SlotBytes(const BucketPlan& b) const {
  return internal::SlotBytes(PackedCodeBytes(setup_.format, b.max_chunk));
}

std::size_t CodeTransport::PieceOffset(const BucketPlan& b, const Piece& pc) const {
  return (pc.begin - b.chunk_begin(pc.chunk)) * std::size_t(bits_) / 8;
}

int CodeTransport::Rounds(const BucketPlan& b) const {
  // Pipelining needs the communicator's nonblocking exchange (a capability, not an error later).
  if (setup_.options.pipeline_kb == 0 || setup_.world_size == 1 ||
      !setup_.comm->has_nonblocking_exchange()) {
    return 0;
  }
  const std::size_t round_bytes = std::size_t(setup_.options.pipeline_kb) * 1024;
  const std::size_t codes = PackedCodeBytes(setup_.format, b.max_chunk);
  std::size_t most_pieces = 0;
  for (int d = 0; d < setup_.world_size; ++d) {
    most_pieces = std::max(most_pieces, b.pieces_of(d).size());
  }
  return int(std::clamp<std::size_t>((codes + round_bytes - 1) / round_bytes, 1,
                                     std::max<std::size_t>(most_pieces, 1)));
}

std::span<const Piece> CodeTransport::RoundPieces(const BucketPlan& b, int d, int j,
                                                  int rounds) const {
  const std::span<const Piece> all = b.pieces_of(d);
  const std::size_t lo = all.size() * std::size_t(j) / std::size_t(rounds);
  const std::size_t hi = all.size() * std::size_t(j + 1) / std::size_t(rounds);
  return all.subspan(lo, hi - lo);
}

std::pair<std::size_t, std::size_t> CodeTransport::RoundBytes(const BucketPlan& b, int d, int j,
                                                              int rounds) const {
  const std::span<const Piece> pieces = RoundPieces(b, d, j, rounds);
  if (pieces.empty()) return {0, 0};
  // Pieces start on a byte; the chunk's last one may end inside one.
  return {PieceOffset(b, pieces.front()),
          PackedCodeBytes(setup_.format, pieces.back().end - b.chunk_begin(d))};
}

Status CodeTransport::ReduceBucket(const BucketPlan& b, float* const* inputs, float* output,
                                   std::int64_t step, const OwnChunk& own) {
  const int rounds = Rounds(b);
  if (rounds == 0) return ReduceSequential(b, inputs, output, step, own);
  return ReducePipelined(b, inputs, output, step, own, rounds);
}

Status CodeTransport::ReduceSequential(const BucketPlan& b, float* const* inputs, float* output,
                                       std::int64_t step, const OwnChunk& own) {
  const std::span<const Piece> mine = b.pieces_of(setup_.rank);
  EncodeContributions(b, inputs, step, 0, 1);
  CPD_RETURN_IF_ERROR(
      ctx_.ExchangeContributions(std::size_t(setup_.local_replicas) * SlotBytes(b)));
  own.sum(mine);
  if (own.finish) {
    own.finish();
    own.encode(mine);
  }
  CPD_RETURN_IF_ERROR(ctx_.GatherChunks(ctx_.exchange.gather_send.data(), GatherSlot(b)));
  DecodeResults(b, output, 0, 1);
  return Status::Ok();
}

// Round j's contributions are quantised while round j - 1's travel; a round is summed once it
// has landed. Without `finish` its sums are packed and gathered at once, and the gather of round
// j - 1 lands while round j is summed; with `finish` (aps_sum, whose shifts need the whole
// chunk's sums) the gathers follow the last sum, each overlapping the previous one's decoding.
Status CodeTransport::ReducePipelined(const BucketPlan& b, float* const* inputs, float* output,
                                      std::int64_t step, const OwnChunk& own, int rounds) {
  auto mine = [&](int j) { return RoundPieces(b, setup_.rank, j, rounds); };
  moving_error_ = Status::Ok();
  std::vector<std::vector<Pending>> exchanges(static_cast<std::size_t>(rounds));
  std::vector<std::vector<Pending>> gathers(exchanges.size());
  const bool gather_as_summed = !own.finish;
  for (int j = 0; j <= rounds; ++j) {
    if (j < rounds) {
      EncodeContributions(b, inputs, step, j, rounds);
      CPD_RETURN_IF_ERROR(StartExchange(b, j, rounds, &exchanges[std::size_t(j)]));
    }
    if (j > 0) {
      CPD_RETURN_IF_ERROR(Land(&exchanges[std::size_t(j - 1)]));
      own.sum(mine(j - 1));
      CPD_RETURN_IF_ERROR(moving_error_);
      if (gather_as_summed) {
        CPD_RETURN_IF_ERROR(StartGather(b, j - 1, rounds, &gathers[std::size_t(j - 1)]));
      }
    }
    if (gather_as_summed && j >= 2) {
      CPD_RETURN_IF_ERROR(Land(&gathers[std::size_t(j - 2)]));
      DecodeResults(b, output, j - 2, rounds);
    }
  }
  if (gather_as_summed) {
    CPD_RETURN_IF_ERROR(Land(&gathers[std::size_t(rounds - 1)]));
    DecodeResults(b, output, rounds - 1, rounds);
    return moving_error_;
  }
  own.finish();
  std::vector<Pending> shifts;
  CPD_RETURN_IF_ERROR(StartShiftGather(b, &shifts));
  for (int j = 0; j <= rounds; ++j) {
    if (j < rounds) {
      own.encode(mine(j));
      CPD_RETURN_IF_ERROR(StartGather(b, j, rounds, &gathers[std::size_t(j)]));
    }
    if (j > 0) {
      if (j == 1) CPD_RETURN_IF_ERROR(Land(&shifts));
      CPD_RETURN_IF_ERROR(Land(&gathers[std::size_t(j - 1)]));
      DecodeResults(b, output, j - 1, rounds);
    }
  }
  return moving_error_;
}

Status CodeTransport::StartExchange(const BucketPlan& b, int j, int rounds,
                                    std::vector<Pending>* flight) {
  const int p = setup_.world_size, k_count = setup_.local_replicas;
  const std::size_t slot = SlotBytes(b), block = std::size_t(k_count) * slot;
  const auto [in_lo, in_hi] = RoundBytes(b, setup_.rank, j, rounds);
  for (int k = 0; k < k_count; ++k) {
    for (int d = 0; d < p; ++d) {
      const auto [lo, hi] = RoundBytes(b, d, j, rounds);
      send_blocks_[std::size_t(d)] = {
          ctx_.exchange.send.data() + std::size_t(d) * block + std::size_t(k) * slot + lo, hi - lo};
      // Rank d's replica k is worker d * K + k.
      recv_blocks_[std::size_t(d)] = {
          ctx_.exchange.recv.data() + (std::size_t(d) * k_count + k) * slot + in_lo, in_hi - in_lo};
    }
    CPD_RETURN_IF_ERROR(Start(send_blocks_, recv_blocks_, flight));
  }
  return Status::Ok();
}

Status CodeTransport::StartGather(const BucketPlan& b, int j, int rounds,
                                  std::vector<Pending>* flight) {
  const std::size_t gather = GatherSlot(b);
  const auto [out_lo, out_hi] = RoundBytes(b, setup_.rank, j, rounds);
  for (int d = 0; d < setup_.world_size; ++d) {
    const auto [lo, hi] = RoundBytes(b, d, j, rounds);
    send_blocks_[std::size_t(d)] = {ctx_.exchange.gather_send.data() + out_lo, out_hi - out_lo};
    recv_blocks_[std::size_t(d)] = {ctx_.exchange.gather_recv.data() + std::size_t(d) * gather + lo,
                                    hi - lo};
  }
  return Start(send_blocks_, recv_blocks_, flight);
}

Status CodeTransport::StartShiftGather(const BucketPlan& b, std::vector<Pending>* flight) {
  const std::size_t slot = SlotBytes(b), gather = GatherSlot(b);
  for (int d = 0; d < setup_.world_size; ++d) {
    send_blocks_[std::size_t(d)] = {ctx_.exchange.gather_send.data() + slot,
                                    b.segments_of(setup_.rank).size()};
    recv_blocks_[std::size_t(d)] = {
        ctx_.exchange.gather_recv.data() + std::size_t(d) * gather + slot, b.segments_of(d).size()};
  }
  return Start(send_blocks_, recv_blocks_, flight);
}

Status CodeTransport::Start(std::span<const Communicator::SendBlock> send,
                            std::span<const Communicator::RecvBlock> recv,
                            std::vector<Pending>* flight) {
  CPD_ASSIGN_OR_RETURN(Pending pending, setup_.comm->StartExchangeBytes(send, recv));
  for (int d = 0; d < setup_.world_size; ++d) {
    if (d != setup_.rank) ctx_.bytes_sent += send[std::size_t(d)].bytes;
  }
  in_flight_.push_back(pending.get());
  flight->push_back(std::move(pending));
  return Status::Ok();
}

Status CodeTransport::Land(std::vector<Pending>* flight) {
  for (Pending& pending : *flight) {
    CPD_RETURN_IF_ERROR(pending->Wait());
    in_flight_.erase(std::find(in_flight_.begin(), in_flight_.end(), pending.get()));
  }
  flight->clear();
  return Status::Ok();
}

void CodeTransport::KeepExchangesMoving(long item) {
  if (in_flight_.empty() || item % kPollItems != 0 || omp_get_thread_num() != 0) return;
  for (Communicator::PendingExchange* pending : in_flight_) {
    bool done = false;
    const Status st = pending->Test(&done);
    if (!st.ok() && moving_error_.ok()) moving_error_ = st;
  }
}

void CodeTransport::EncodeContributions(const BucketPlan& b, float* const* inputs,
                                        std::int64_t step, int j, int rounds) {
  const std::size_t slot = SlotBytes(b), block = std::size_t(setup_.local_replicas) * slot;
  const int threads = setup_.threads;
  for (int d = 0; d < setup_.world_size; ++d) {
    const std::span<const Piece> pieces = RoundPieces(b, d, j, rounds);
    const long n = long(pieces.size());
    const long items = n * setup_.local_replicas;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && items > 1)
    for (long it = 0; it < items; ++it) {
      KeepExchangesMoving(it);
      const int k = int(it / n);
      const Piece& pc = pieces[std::size_t(it % n)];
      std::uint8_t* dst = ctx_.exchange.send.data() + std::size_t(d) * block +
                          std::size_t(k) * slot + PieceOffset(b, pc);
      EncodePiece(inputs[k] + pc.begin, b, pc, /*shifted=*/true, nullptr, setup_.round_mode,
                  ContributionStage(setup_.worker(k)), step, dst,
                  ctx_.stats.ThreadCounters(std::size_t(omp_get_thread_num())));
    }
  }
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

int CodeTransport::ResultShift(const BucketPlan& b, int d, std::size_t si) const {
  const int s = ctx_.shifts[std::size_t(b.segments[si].layer)];
  if (!setup_.aps_sum) return s;
  const std::uint8_t* t = ctx_.exchange.gather_recv.data() + std::size_t(d) * GatherSlot(b) +
                          SlotBytes(b) + (si - b.seg_start[std::size_t(d)]);
  return s + int(std::int8_t(*t));
}

void CodeTransport::DecodeResults(const BucketPlan& b, float* output, int j, int rounds) {
  const int threads = setup_.threads;
  for (int d = 0; d < setup_.world_size; ++d) {
    const std::span<const Piece> pieces = RoundPieces(b, d, j, rounds);
    const long n = long(pieces.size());
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n > 1)
    for (long i = 0; i < n; ++i) {
      KeepExchangesMoving(i);
      DecodePiece(b, pieces[std::size_t(i)], output);
    }
  }
}

void CodeTransport::DecodePiece(const BucketPlan& b, const Piece& pc, float* output) const {
  const std::uint8_t* src =
      ctx_.exchange.gather_recv.data() + std::size_t(pc.chunk) * GatherSlot(b) + PieceOffset(b, pc);
  const Segment& first = b.segments[pc.first_segment];
  if (first.end >= pc.end) {
    // One layer: decode and undo its shift in one pass.
    const int sh = ResultShift(b, pc.chunk, pc.first_segment);
    if (sh == 0) {
      DecodeCodes(src, pc.size(), decoder_, output + pc.begin);
    } else {
      DecodeCodesScaled(src, pc.size(), decoder_, kernels::Pow2(-sh), output + pc.begin);
    }
    return;
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
