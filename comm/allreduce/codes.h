// The packed-code transport of the gradient all-reduce, shared by emulate and packed when the
// gradient format is a fixed float grid of <= 16 bits: contributions and reduced chunks travel as
// densely packed codes (exact for such grids), as stages of the back end (comm/allreduce/backend.h)
// over runs of pieces (kPiece elements; the host back end keeps a piece in L1).
// A bucket's stages (ReduceBucket), in order:
//   encode      quantise every local contribution after its layer's shift, and pack
//   exchange    all-to-all: this rank receives the W contributions of its chunk
//   own chunk   the algorithm decodes and sums them (Received()), then packs its chunk's result
//               into ResultSlot()
//   gather      all-gather of the reduced chunks
//   decode      decode every chunk and undo each layer's shift
// Sequentially (pipeline_kb = 0, or one rank) with blocking collectives; else pipelined over
// rounds, slices of every chunk, with the communicator's nonblocking exchange: round j is
// encoded while round j - 1 is on the wire and summed as it lands, and round j's all-gather
// overlaps round j - 1's decoding (comm/gradient_allreduce.h, "Pipelining").
// The schedule is the same on every back end; it is pipelined only where the back end has a
// nonblocking exchange (Backend::has_nonblocking_exchange: MPI and world size 1 do, NCCL and a
// communicator without StartExchangeBytes do not).
// With APS sum scaling (packed, ReducerSetup::aps_sum) the algorithm writes each segment's
// re-quantisation shift t (WriteSumShifts) once the whole chunk is summed (OwnChunk::finish), then
// rounds sum * 2^t; the shifts travel after the codes in the all-gather's slot, and decoding
// undoes 2^(s + t).
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

namespace cpd::comm::internal {

class CodeTransport {
 public:
  using Pending = std::unique_ptr<Communicator::PendingExchange>;

  // Whether contributions in `format` can travel as codes.
  static bool Supports(const Format& format);
  // Allocates the exchange buffers of ctx. REQUIRED: Supports().
  static Result<std::unique_ptr<CodeTransport>> Create(StepContext* ctx);

  // The algorithm's part: what happens to this rank's chunk between the exchange and the
  // all-gather, each a stage on the back end over a run of the chunk's pieces (every piece once
  // per bucket, in order).
  struct OwnChunk {
    // Sums the W contributions of the pieces (Received()) and, without `finish`, packs the sums
    // into ResultSlot().
    std::function<Status(std::span<const Piece>)> sum;
    // When set, called once every piece of the chunk is summed (aps_sum: the shifts t, written
    // with WriteSumShifts); then `encode` packs the pieces' sums.
    std::function<Status()> finish;
    std::function<Status(std::span<const Piece>)> encode;
  };
  // The sum over all workers of bucket b into output[b's range] (see the header comment).
  Status ReduceBucket(const BucketPlan& b, float* const* inputs, float* output, std::int64_t step,
                      const OwnChunk& own);
  // The W contributions to this rank's chunk, after the exchange.
  Contributions Received(const BucketPlan& b) const;
  // The all-gather's send slot: this rank's reduced chunk's codes.
  std::uint8_t* ResultSlot() const { return ctx_.exchange.gather_send.data(); }
  // aps_sum: this rank's shifts t of b's segments (index si - b.seg_start[rank]), after the codes
  // of the all-gather's send slot (GatherSlotBytes), and as the back end's kSums table.
  Status WriteSumShifts(const BucketPlan& b, const std::vector<std::int8_t>& t);

 private:
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

  Status ReduceSequential(const BucketPlan& b, float* const* inputs, float* output,
                          std::int64_t step, const OwnChunk& own);
  Status ReducePipelined(const BucketPlan& b, float* const* inputs, float* output,
                         std::int64_t step, const OwnChunk& own, int rounds);
  // The stages for the pieces of round j of `rounds`.
  Status EncodeContributions(const BucketPlan& b, float* const* inputs, std::int64_t step, int j,
                             int rounds);
  Status DecodeResults(const BucketPlan& b, float* output, int j, int rounds);
  // aps_sum, after the shifts t have arrived: every segment's s + t as the kResults table.
  Status SetResultShifts(const BucketPlan& b);
  // Nonblocking exchanges: round j's contributions (one per local replica), round j's codes of
  // the reduced chunks, the shifts t (aps_sum); each counted in the step's bytes sent.
  Status StartExchange(const BucketPlan& b, int j, int rounds, std::vector<Pending>* flight);
  Status StartGather(const BucketPlan& b, int j, int rounds, std::vector<Pending>* flight);
  Status StartShiftGather(const BucketPlan& b, std::vector<Pending>* flight);
  Status Start(std::vector<Pending>* flight);

  StepContext& ctx_;
  const ReducerSetup& setup_;
  Backend& backend_;
  const int bits_;
  std::vector<Communicator::SendBlock> send_blocks_;
  std::vector<Communicator::RecvBlock> recv_blocks_;
  std::vector<int> segment_shifts_;    // per segment of a bucket: the shifts handed to the back end
  std::vector<std::int8_t> gathered_;  // aps_sum: the shifts t of a chunk, back on the host
};

}  // namespace cpd::comm::internal
