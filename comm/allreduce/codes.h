// The packed-code transport of the gradient all-reduce, shared by emulate and packed when the
// gradient format is a fixed float grid of <= 16 bits: contributions and reduced chunks travel as
// densely packed codes (exact for such grids), processed piece by piece (kPiece elements, in L1).
// A bucket's stages, in order:
//   EncodeContributions    quantise every local contribution after its layer's shift, and pack
//   ExchangeContributions  all-to-all: this rank receives the W contributions of its chunk
//   (the algorithm)        decodes and sums them piece by piece (Contribution), then packs its
//                          chunk's result (EncodeResult)
//   GatherResults          all-gather of the reduced chunks
//   DecodeResults          decode every chunk and undo each layer's shift
// With APS sum scaling (packed, ReducerSetup::aps_sum) the algorithm writes each segment's
// re-quantisation shift t to SumShifts() before EncodeResult, which rounds sum * 2^t; the shifts
// travel after the codes in the all-gather's slot, and DecodeResults undoes 2^(s + t).
// Internal to comm/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/allreduce/internal.h"
#include "comm/reduce_kernels.h"

namespace cpd::comm::internal {

class CodeTransport {
 public:
  // Whether contributions in `format` can travel as codes.
  static bool Supports(const Format& format);
  // Allocates the exchange buffers of ctx and the per-thread code buffers. REQUIRED: Supports().
  static Result<std::unique_ptr<CodeTransport>> Create(StepContext* ctx);

  const CodeDecoder& decoder() const { return decoder_; }

  void EncodeContributions(const BucketPlan& b, float* const* inputs, std::int64_t step);
  Status ExchangeContributions(const BucketPlan& b);
  // Worker w's codes of piece pc (of this rank's chunk), after the exchange.
  const std::uint8_t* Contribution(const BucketPlan& b, const Piece& pc, int w) const;
  // Packs sum[0, pc.size()), a piece of this rank's reduced chunk, rounded with `mode` and the
  // stream of `stage` (aps_sum: each segment's elements times 2^t from SumShifts()), into the
  // all-gather's send slot. Called from the algorithm's threads.
  void EncodeResult(const float* sum, const BucketPlan& b, const Piece& pc, kernels::RoundMode mode,
                    std::int64_t stage, std::int64_t step);
  // aps_sum: the shifts t of this rank's segments of b (index si - b.seg_start[rank]), in the
  // all-gather's send slot (GatherSlotBytes).
  std::int8_t* SumShifts(const BucketPlan& b);
  Status GatherResults(const BucketPlan& b);
  void DecodeResults(const BucketPlan& b, float* output) const;

 private:
  explicit CodeTransport(StepContext* ctx);
  std::size_t SlotBytes(const BucketPlan& b) const;
  std::size_t GatherSlot(const BucketPlan& b) const {
    return GatherSlotBytes(setup_, b, SlotBytes(b));
  }
  // The shift to undo on segment si of chunk d after the all-gather: its layer's s, plus t with
  // aps_sum.
  int ResultShift(const BucketPlan& b, int d, std::size_t si) const;
  // Where piece pc's codes start in its chunk's slot.
  std::size_t PieceOffset(const BucketPlan& b, const Piece& pc) const;
  // Codes of x[0, pc.size()) (times 2^s of each segment's layer when `shifted`, else times 2^t
  // of each segment from sum_shifts when non-null), rounded with `mode` and the stream of
  // `stage`, packed to dst. counters (2 per layer, or null): flushed, saturated. `shifted` is used
  // for the contributions, which the scan found finite and the shift keeps finite
  // (max * 2^s <= 2^emax); the sums may not be.
  void EncodePiece(const float* x, const BucketPlan& b, const Piece& pc, bool shifted,
                   const std::int8_t* sum_shifts, kernels::RoundMode mode, std::int64_t stage,
                   std::int64_t step, std::uint8_t* dst, std::uint64_t* counters);

  StepContext& ctx_;
  const ReducerSetup& setup_;
  const int bits_;
  CodeDecoder decoder_;
  std::vector<std::uint16_t> thread_codes_;  // kPiece per thread
};

}  // namespace cpd::comm::internal
