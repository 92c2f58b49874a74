// The packed-code transport of the gradient all-reduce, shared by emulate and packed when the
// gradient format is a fixed float grid of <= 16 bits: contributions and reduced chunks travel as
// densely packed codes (exact for such grids), processed piece by piece (kPiece elements, in L1).
// A bucket's stages (ReduceBucket), in order:
//   encode      quantise every local contribution after its layer's shift, and pack
//   exchange    all-to-all: this rank receives the W contributions of its chunk
//   own chunk   the algorithm decodes and sums them piece by piece (Contribution), then packs its
//               chunk's result (EncodeResult)
//   gather      all-gather of the reduced chunks
//   decode      decode every chunk and undo each layer's shift
// Sequentially (pipeline_kb = 0, or one rank) with blocking collectives; else pipelined over
// rounds, slices of every chunk, with the communicator's nonblocking exchange: round j is
// encoded while round j - 1 is on the wire and summed as it lands, and round j's all-gather
// overlaps round j - 1's decoding (comm/gradient_allreduce.h, "Pipelining").
// With APS sum scaling (packed, ReducerSetup::aps_sum) the algorithm writes each segment's
// re-quantisation shift t to SumShifts() once the whole chunk is summed (OwnChunk::finish), then
// EncodeResult rounds sum * 2^t; the shifts travel after the codes in the all-gather's slot, and
// decoding undoes 2^(s + t).
// Internal to comm/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <utility>
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

  // The algorithm's part: what happens to this rank's chunk between the exchange and the
  // all-gather. Each function gets pieces of the chunk (every piece once per bucket, in order),
  // loops over them on setup.threads threads and calls KeepExchangesMoving(i) for item i.
  struct OwnChunk {
    // Sums the W contributions of the pieces (Contribution) and, without `finish`, packs the
    // sums (EncodeResult).
    std::function<void(std::span<const Piece>)> sum;
    // When set, called once every piece of the chunk is summed (aps_sum: fills SumShifts());
    // then `encode` packs the pieces' sums.
    std::function<void()> finish;
    std::function<void(std::span<const Piece>)> encode;
  };
  // The sum over all workers of bucket b into output[b's range] (see the header comment).
  Status ReduceBucket(const BucketPlan& b, float* const* inputs, float* output, std::int64_t step,
                      const OwnChunk& own);
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
  // For item `item` of an element loop: every kPollItems items, thread 0 tests the exchanges in
  // flight, because the MPI backend moves bytes only inside its calls.
  void KeepExchangesMoving(long item);

 private:
  using Pending = std::unique_ptr<Communicator::PendingExchange>;
  static constexpr long kPollItems = 8;

  explicit CodeTransport(StepContext* ctx);
  std::size_t SlotBytes(const BucketPlan& b) const;
  std::size_t GatherSlot(const BucketPlan& b) const {
    return GatherSlotBytes(setup_, b, SlotBytes(b));
  }
  // The rounds of b's pipelined schedule; 0 for the sequential one.
  int Rounds(const BucketPlan& b) const;
  // Chunk d's pieces in round j of `rounds` (rounds = 1: all of them).
  std::span<const Piece> RoundPieces(const BucketPlan& b, int d, int j, int rounds) const;
  // Where those pieces' codes lie in the chunk's slot: [first, second).
  std::pair<std::size_t, std::size_t> RoundBytes(const BucketPlan& b, int d, int j,
                                                 int rounds) const;
  // The shift to undo on segment si of chunk d after the all-gather: its layer's s, plus t with
  // aps_sum.
  int ResultShift(const BucketPlan& b, int d, std::size_t si) const;
  // Where piece pc's codes start in its chunk's slot.
  std::size_t PieceOffset(const BucketPlan& b, const Piece& pc) const;

  Status ReduceSequential(const BucketPlan& b, float* const* inputs, float* output,
                          std::int64_t step, const OwnChunk& own);
  Status ReducePipelined(const BucketPlan& b, float* const* inputs, float* output,
                         std::int64_t step, const OwnChunk& own, int rounds);
  // The stages for the pieces of round j of `rounds`.
  void EncodeContributions(const BucketPlan& b, float* const* inputs, std::int64_t step, int j,
                           int rounds);
  void DecodeResults(const BucketPlan& b, float* output, int j, int rounds);
  void DecodePiece(const BucketPlan& b, const Piece& pc, float* output) const;
  // Nonblocking exchanges: round j's contributions (one per local replica), round j's codes of
  // the reduced chunks, the shifts t (aps_sum); each counted in the step's bytes sent.
  Status StartExchange(const BucketPlan& b, int j, int rounds, std::vector<Pending>* flight);
  Status StartGather(const BucketPlan& b, int j, int rounds, std::vector<Pending>* flight);
  Status StartShiftGather(const BucketPlan& b, std::vector<Pending>* flight);
  Status Start(std::span<const Communicator::SendBlock> send,
               std::span<const Communicator::RecvBlock> recv, std::vector<Pending>* flight);
  // Waits for a flight; it then leaves in_flight_.
  Status Land(std::vector<Pending>* flight);
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
  // Pipelined: every exchange of the bucket still in flight, and the first error of a Test.
  std::vector<Communicator::PendingExchange*> in_flight_;
  Status moving_error_;
  std::vector<Communicator::SendBlock> send_blocks_;
  std::vector<Communicator::RecvBlock> recv_blocks_;
};

}  // namespace cpd::comm::internal
