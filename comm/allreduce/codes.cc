#include "comm/allreduce/codes.h"

#include <algorithm>

namespace cpd::comm::internal {

bool CodeTransport::Supports(const Format& format) {
  return format.family() == FormatFamily::kFloat && format.bits() <= 16;
}

CodeTransport::CodeTransport(StepContext* ctx)
    : ctx_(*ctx), setup_(ctx->setup), backend_(ctx->backend), bits_(ctx->setup.format.bits()) {}

Result<std::unique_ptr<CodeTransport>> CodeTransport::Create(StepContext* ctx) {
  std::unique_ptr<CodeTransport> t(new CodeTransport(ctx));
  std::size_t slot = 0, gather = 0, segments = 0;
  for (const BucketPlan& b : ctx->plan.buckets()) {
    slot = std::max(slot, t->SlotBytes(b));
    gather = std::max(gather, t->GatherSlot(b));
    segments = std::max(segments, b.segments.size());
  }
  CPD_RETURN_IF_ERROR(ctx->exchange.Allocate(ctx->setup, &ctx->backend, slot, gather));
  t->send_blocks_.resize(std::size_t(ctx->setup.world_size));
  t->recv_blocks_.resize(std::size_t(ctx->setup.world_size));
  t->segment_shifts_.assign(segments, 0);
  t->gathered_.assign(segments, 0);
  return t;
}

std::size_t CodeTransport::SlotBytes(const BucketPlan& b) const {
  return internal::SlotBytes(PackedCodeBytes(setup_.format, b.max_chunk));
}

int CodeTransport::Rounds(const BucketPlan& b) const {
  // Pipelining needs the back end's nonblocking exchange (a capability, not an error later).
  if (setup_.options.pipeline_kb == 0 || setup_.world_size == 1 ||
      !backend_.has_nonblocking_exchange()) {
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
  return {PieceCodeOffset(b, pieces.front(), bits_),
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
  CPD_RETURN_IF_ERROR(EncodeContributions(b, inputs, step, 0, 1));
  CPD_RETURN_IF_ERROR(
      ctx_.ExchangeContributions(std::size_t(setup_.local_replicas) * SlotBytes(b)));
  CPD_RETURN_IF_ERROR(own.sum(mine));
  if (own.finish) {
    CPD_RETURN_IF_ERROR(own.finish());
    CPD_RETURN_IF_ERROR(own.encode(mine));
  }
  CPD_RETURN_IF_ERROR(ctx_.GatherChunks(ResultSlot(), GatherSlot(b)));
  if (setup_.aps_sum) CPD_RETURN_IF_ERROR(SetResultShifts(b));
  return DecodeResults(b, output, 0, 1);
}

// Round j's contributions are quantised while round j - 1's travel; a round is summed once it
// has landed. Without `finish` its sums are packed and gathered at once, and the gather of round
// j - 1 lands while round j is summed; with `finish` (aps_sum, whose shifts need the whole
// chunk's sums) the gathers follow the last sum, each overlapping the previous one's decoding.
Status CodeTransport::ReducePipelined(const BucketPlan& b, float* const* inputs, float* output,
                                      std::int64_t step, const OwnChunk& own, int rounds) {
  auto mine = [&](int j) { return RoundPieces(b, setup_.rank, j, rounds); };
  backend_.ClearMovingError();
  std::vector<std::vector<Pending>> exchanges(static_cast<std::size_t>(rounds));
  std::vector<std::vector<Pending>> gathers(exchanges.size());
  const bool gather_as_summed = !own.finish;
  for (int j = 0; j <= rounds; ++j) {
    if (j < rounds) {
      CPD_RETURN_IF_ERROR(EncodeContributions(b, inputs, step, j, rounds));
      CPD_RETURN_IF_ERROR(StartExchange(b, j, rounds, &exchanges[std::size_t(j)]));
    }
    if (j > 0) {
      CPD_RETURN_IF_ERROR(backend_.Land(&exchanges[std::size_t(j - 1)]));
      CPD_RETURN_IF_ERROR(own.sum(mine(j - 1)));
      CPD_RETURN_IF_ERROR(backend_.moving_error());
      if (gather_as_summed) {
        CPD_RETURN_IF_ERROR(StartGather(b, j - 1, rounds, &gathers[std::size_t(j - 1)]));
      }
    }
    if (gather_as_summed && j >= 2) {
      CPD_RETURN_IF_ERROR(backend_.Land(&gathers[std::size_t(j - 2)]));
      CPD_RETURN_IF_ERROR(DecodeResults(b, output, j - 2, rounds));
    }
  }
  if (gather_as_summed) {
    CPD_RETURN_IF_ERROR(backend_.Land(&gathers[std::size_t(rounds - 1)]));
    CPD_RETURN_IF_ERROR(DecodeResults(b, output, rounds - 1, rounds));
    return backend_.moving_error();
  }
  CPD_RETURN_IF_ERROR(own.finish());
  std::vector<Pending> shifts;
  CPD_RETURN_IF_ERROR(StartShiftGather(b, &shifts));
  for (int j = 0; j <= rounds; ++j) {
    if (j < rounds) {
      CPD_RETURN_IF_ERROR(own.encode(mine(j)));
      CPD_RETURN_IF_ERROR(StartGather(b, j, rounds, &gathers[std::size_t(j)]));
    }
    if (j > 0) {
      if (j == 1) {
        CPD_RETURN_IF_ERROR(backend_.Land(&shifts));
        CPD_RETURN_IF_ERROR(SetResultShifts(b));
      }
      CPD_RETURN_IF_ERROR(backend_.Land(&gathers[std::size_t(j - 1)]));
      CPD_RETURN_IF_ERROR(DecodeResults(b, output, j - 1, rounds));
    }
  }
  return backend_.moving_error();
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
    CPD_RETURN_IF_ERROR(Start(flight));
  }
  return Status::Ok();
}

Status CodeTransport::StartGather(const BucketPlan& b, int j, int rounds,
                                  std::vector<Pending>* flight) {
  const std::size_t gather = GatherSlot(b);
  const auto [out_lo, out_hi] = RoundBytes(b, setup_.rank, j, rounds);
  for (int d = 0; d < setup_.world_size; ++d) {
    const auto [lo, hi] = RoundBytes(b, d, j, rounds);
    send_blocks_[std::size_t(d)] = {ResultSlot() + out_lo, out_hi - out_lo};
    recv_blocks_[std::size_t(d)] = {ctx_.exchange.gather_recv.data() + std::size_t(d) * gather + lo,
                                    hi - lo};
  }
  return Start(flight);
}

Status CodeTransport::StartShiftGather(const BucketPlan& b, std::vector<Pending>* flight) {
  const std::size_t slot = SlotBytes(b), gather = GatherSlot(b);
  for (int d = 0; d < setup_.world_size; ++d) {
    send_blocks_[std::size_t(d)] = {ResultSlot() + slot, b.segments_of(setup_.rank).size()};
    recv_blocks_[std::size_t(d)] = {
        ctx_.exchange.gather_recv.data() + std::size_t(d) * gather + slot, b.segments_of(d).size()};
  }
  return Start(flight);
}

Status CodeTransport::Start(std::vector<Pending>* flight) {
  CPD_RETURN_IF_ERROR(backend_.StartExchange(send_blocks_, recv_blocks_, flight));
  for (int d = 0; d < setup_.world_size; ++d) {
    if (d != setup_.rank) ctx_.bytes_sent += send_blocks_[std::size_t(d)].bytes;
  }
  return Status::Ok();
}

Status CodeTransport::EncodeContributions(const BucketPlan& b, float* const* inputs,
                                          std::int64_t step, int j, int rounds) {
  const std::size_t slot = SlotBytes(b), block = std::size_t(setup_.local_replicas) * slot;
  for (int d = 0; d < setup_.world_size; ++d) {
    const std::span<const Piece> pieces = RoundPieces(b, d, j, rounds);
    if (pieces.empty()) continue;
    for (int k = 0; k < setup_.local_replicas; ++k) {
      std::uint8_t* dst =
          ctx_.exchange.send.data() + std::size_t(d) * block + std::size_t(k) * slot;
      CPD_RETURN_IF_ERROR(backend_.EncodeCodes(b, pieces, inputs[k], 0, Shifts::kLayers,
                                               setup_.round_mode,
                                               ContributionStage(setup_.worker(k)), step, dst,
                                               /*count=*/true));
    }
  }
  return Status::Ok();
}

Contributions CodeTransport::Received(const BucketPlan& b) const {
  return Contributions{ctx_.exchange.recv.data(), SlotBytes(b)};
}

Status CodeTransport::WriteSumShifts(const BucketPlan& b, const std::vector<std::int8_t>& t) {
  const std::size_t seg0 = b.seg_start[std::size_t(setup_.rank)];
  const std::size_t own = b.segments_of(setup_.rank).size();
  std::fill(segment_shifts_.begin(), segment_shifts_.end(), 0);
  for (std::size_t j = 0; j < own; ++j) segment_shifts_[seg0 + j] = t[j];
  if (own > 0) CPD_RETURN_IF_ERROR(backend_.FromHost(ResultSlot() + SlotBytes(b), t.data(), own));
  return backend_.SetSegmentShifts(b, Shifts::kSums, segment_shifts_);
}

Status CodeTransport::SetResultShifts(const BucketPlan& b) {
  const std::size_t gather = GatherSlot(b), slot = SlotBytes(b);
  for (int d = 0; d < setup_.world_size; ++d) {
    const std::size_t s0 = b.seg_start[std::size_t(d)], count = b.segments_of(d).size();
    if (count == 0) continue;
    CPD_RETURN_IF_ERROR(
        backend_.ToHost(ctx_.exchange.gather_recv.data() + std::size_t(d) * gather + slot, count,
                        gathered_.data()));
    for (std::size_t j = 0; j < count; ++j) {
      segment_shifts_[s0 + j] = ctx_.shifts[std::size_t(b.segments[s0 + j].layer)] + gathered_[j];
    }
  }
  return backend_.SetSegmentShifts(b, Shifts::kResults, segment_shifts_);
}

Status CodeTransport::DecodeResults(const BucketPlan& b, float* output, int j, int rounds) {
  const Shifts shifts = setup_.aps_sum ? Shifts::kResults : Shifts::kLayers;
  for (int d = 0; d < setup_.world_size; ++d) {
    const std::span<const Piece> pieces = RoundPieces(b, d, j, rounds);
    if (pieces.empty()) continue;
    CPD_RETURN_IF_ERROR(backend_.DecodeCodes(
        b, pieces, ctx_.exchange.gather_recv.data() + std::size_t(d) * GatherSlot(b), shifts,
        output));
  }
  return Status::Ok();
}

}  // namespace cpd::comm::internal
