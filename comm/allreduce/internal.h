// What the algorithms of the gradient all-reduce (comm/allreduce/{fp32,emulate,packed}.cc) share:
// the setup fixed at Create, the per-step state (the APS shifts, the per-layer statistics, the
// payload collectives and their buffers) over a Backend (comm/allreduce/backend.h: host or
// device), and the Algorithm interface that comm/gradient_allreduce.cc dispatches to.
// Internal to comm/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/allreduce/backend.h"
#include "comm/allreduce/plan.h"
#include "comm/allreduce/streams.h"
#include "comm/communicator.h"
#include "comm/gradient_allreduce.h"
#include "cpd/format.h"
#include "cpd/quantize.h"
#include "cpd/status.h"
#include "kernels/grid.h"
#include "kernels/quantize_cpu.h"

namespace cpd::comm::internal {

// Elements per work item of the packed-code pipeline: small enough that a piece's codes, its
// decoded floats and the partial sums stay in L1; a multiple of 8, so pieces start on a byte.
inline constexpr std::size_t kPiece = 2048;

// ---- Fixed at Create ----------------------------------------------------------------------------
struct ReducerSetup {
  Communicator* comm = nullptr;
  GradientAllReduceOptions options;
  GradientLayout layout;
  Format format;           // the gradient format; fp32 for the fp32 algorithm
  int local_replicas = 1;  // K
  int world_size = 1;      // P
  int rank = 0;
  int workers = 1;  // W = P * K; rank r's replica k is worker r * K + k
  int threads = 1;  // OpenMP threads of the element loops
  int emax = 0;     // ApsEmax(format); 0 for fp32
  // packed with APS and aps_scaling sum (or auto): contributions shifted to the top of the format,
  // each segment's sum re-quantised with its own shift t (SumShift), sent with the all-gather.
  bool aps_sum = false;
  kernels::RoundMode round_mode = kernels::RoundMode::kNearestEven;  // options.rounding
  // Hybrid precision (comm/allreduce/layer_formats.cc): each layer's format and emax, or empty
  // when every layer uses `format` (the uniform plan keeps its fast paths).
  std::vector<Format> layer_formats;
  std::vector<int> layer_emax;

  bool mixed() const { return !layer_formats.empty(); }
  // The format and APS emax of layer l: the one lookup of per-layer formats.
  const Format& FormatOf(int l) const { return mixed() ? layer_formats[std::size_t(l)] : format; }
  int EmaxOf(int l) const { return mixed() ? layer_emax[std::size_t(l)] : emax; }

  std::size_t layers() const { return layout.layers(); }
  std::size_t layer_size(std::size_t l) const { return layout.offsets[l + 1] - layout.offsets[l]; }
  std::int64_t worker(int replica) const { return std::int64_t(rank) * local_replicas + replica; }
  // cpd::Quantize / cpd::Encode options of the rounding at `stage` for elements from flat `index`;
  // one channel: a segment is one scale group.
  QuantizeOptions QuantizeAt(std::int64_t stage, std::int64_t step, std::size_t index) const;
  // The same stream for the kernels' loops, with rounding `mode`.
  kernels::LoopParams LoopAt(kernels::RoundMode mode, std::int64_t stage, std::int64_t step,
                             std::size_t index) const;
};

// ---- Per-layer formats (comm/allreduce/layer_formats.cc) ----------------------------------------
// Resolves setup->options.layer_formats over the layout into layer_formats / layer_emax (left
// empty when every layer gets setup->format). InvalidArgument naming an unknown layer (and a few
// known ones) or a bad spec. REQUIRED: setup->format, emax and layout set.
Status ResolveLayerFormats(ReducerSetup* setup);
// One entry per layer, named, with its format spec: the reducers' last_stats() before any step.
std::vector<LayerCommStats> NewLayerStats(const ReducerSetup& setup);

// ---- What every implementation of Reduce() checks and computes alike ----------------------------
// InvalidArgument (naming the rank) for null inputs or output where the layout is not empty.
Status CheckReduceBuffers(const ReducerSetup& setup, float* const* inputs, const float* output);
// Every layer's statistics back to "nothing measured" at the start of a step.
void ResetLayerStats(std::vector<LayerCommStats>* stats);
// A layer's local max|g| as float32 bits (ScanAbs's), as it enters the MAX all-reduce: a
// non-finite element travels as +Inf (NaN would not order).
float MaxAbsForAllReduce(std::uint32_t max_bits);
// After the all-reduce of the maxima: each layer's APS shift (0 without APS or for fp32); false
// when some maximum is not finite (the step is skipped).
bool ShiftsFromMaxima(const ReducerSetup& setup, const std::vector<float>& max_abs,
                      std::vector<int>* shifts);

// APS sum scaling (comm/gradient_allreduce.h, "APS scaling of packed"): a layer's contribution
// shift, the max reaching the top of the format and the float32 sum of the W contributions kept
// finite: min(ApsShift(max_abs, 1, emax), ApsShift(max_abs, workers, 127)).
int SumContributionShift(float max_abs, int workers, int emax);
// The re-quantisation shift t of a segment of layer shift s whose float32 sum (in units of 2^-s)
// has largest |value| max_sum_bits (float32 bits, finite): ApsShift(max, 1, emax), 0 for an
// all-zero sum, clamped so that |s + t| <= 126 (2^-(s + t) is a normal float; t fits an int8).
int SumShift(std::uint32_t max_sum_bits, int s, int emax);
// Where the shifts t travel: one int8 per segment of a chunk, in segment order, right after the
// chunk's codes in the all-gather's slot (at offset slot_bytes, the exchange's slot). The gather
// slot: slot_bytes without aps_sum, else SlotBytes(slot_bytes + the most segments of a chunk).
std::size_t GatherSlotBytes(const ReducerSetup& setup, const BucketPlan& b, std::size_t slot_bytes);

// ---- Per-layer statistics -----------------------------------------------------------------------
// The flushed and saturated fractions of every layer from the global counts, 3 per layer
// (flushed, saturated, nonzero contribution elements), as every implementation reports them.
void SetCountFractions(const ReducerSetup& setup, const std::vector<std::uint64_t>& counts,
                       std::vector<LayerCommStats>* stats);

// measure_error, what every implementation computes alike: adds to error[2 l] the squared error
// of this rank's chunk of the result (output_chunk, from the chunk's start) against the float32
// reference of the chunk (reference, likewise) and to error[2 l + 1] the squared reference, per
// layer l of the chunk's segments; then, from every rank's pairs (rank by rank, summed in rank
// order so that every rank gets the same bits), each layer's rel_error.
void AddChunkErrors(const BucketPlan& b, int rank, const float* output_chunk,
                    const float* reference, std::vector<double>* error);
void SetRelErrors(const ReducerSetup& setup, const std::vector<double>& error_all_ranks,
                  std::vector<LayerCommStats>* stats);

// The per-layer statistics of a step: the flushed / saturated counters of the quantised
// contributions (cpd::QuantStats of per-segment stages, the back end's code counters) and, with
// measure_error, the error against a float32 reduce-scatter of the same inputs.
class LayerStatistics {
 public:
  LayerStatistics(const ReducerSetup& setup, Backend* backend, std::size_t max_chunk);

  void Reset();  // at the start of every step
  void SetNonzero(std::size_t layer, std::uint64_t nonzero) { counts_[3 * layer + 2] = nonzero; }
  void AddQuantStats(int layer, const QuantStats& qs);

  // measure_error: the float32 reduce-scatter of count local buffers over bucket b (before the
  // inputs are used as scratch; collective), then the error of this rank's chunk of the output.
  Status ReduceReference(const BucketPlan& b, const float* const* src, int count);
  Status AccumulateError(const BucketPlan& b, const float* output);

  // Collective: the counters of all ranks give flushed and saturated (quantised algorithms), the
  // errors rel_error (with measure_error).
  Status Finish(bool measure_error, std::vector<LayerCommStats>* stats);

 private:
  const ReducerSetup& setup_;
  Backend& backend_;
  const std::size_t max_chunk_;
  std::vector<std::uint64_t> counts_;  // flushed, saturated, nonzero per layer (local, then global)
  std::vector<double> error_;          // squared error, squared reference per layer
  std::vector<double> error_all_ranks_;  // error_ of every rank
  // measure_error (allocated on first use): the reference's send buffer (every chunk padded to
  // the longest) and this rank's chunk of it, in the back end's memory; host copies of that chunk
  // and of the result's.
  Memory reference_send_, reference_;
  std::vector<float> host_reference_, host_output_;
};

// ---- Payload buffers ----------------------------------------------------------------------------
// The buffers of a quantised algorithm's two payload collectives, for its largest slot (one
// contribution's share of a chunk). The all-to-all sends this rank's K slots for chunk d as block
// d and receives worker w's slot at w * slot; the all-gather collects every rank's reduced chunk.
// InvalidArgument when a block of K slots exceeds MPI's int count (a smaller bucket_mb helps).
Status CheckBlockBytes(const ReducerSetup& setup, std::size_t slot_bytes);

struct ExchangeBuffers {
  Memory send, recv;                // P blocks of K slots
  Memory gather_send, gather_recv;  // 1 and P gather slots
  // CheckBlockBytes, then the allocation in the back end's memory (marked for the nonblocking
  // exchange); gather slots of gather_slot_bytes (0: slot_bytes).
  Status Allocate(const ReducerSetup& setup, Backend* backend, std::size_t slot_bytes,
                  std::size_t gather_slot_bytes = 0);
};

// ---- The state of a step ------------------------------------------------------------------------
// What the algorithms share during Reduce(): owned by the reducer, reset at every step.
struct StepContext {
  StepContext(const ReducerSetup& setup, const AllReducePlan& plan, Backend* backend);

  const ReducerSetup& setup;
  const AllReducePlan& plan;
  Backend& backend;
  std::vector<float> max_abs;  // per layer, global max |g| (ScanAndShift)
  std::vector<int> shifts;     // per layer, the APS shift (0 without APS)
  LayerStatistics stats;
  ExchangeBuffers exchange;
  std::uint64_t bytes_sent = 0;

  void Reset();
  // The scan of max|g| and of non-finite elements over the inputs (the back end's), one small MAX
  // all-reduce that gives every rank the per-layer maxima (a NaN/Inf travels as +Inf), and the
  // APS shifts, handed to the back end. *finite = false when some rank holds NaN/Inf. Collective.
  Status ScanAndShift(float* const* inputs, bool* finite);
  // The payload collectives, counted as a bandwidth-optimal implementation sends them: all-to-all
  // and all-gather (P - 1) blocks, all-reduce 2(P - 1)/P of the buffer.
  Status ExchangeContributions(std::size_t block_bytes);  // exchange.send -> exchange.recv
  Status GatherChunks(const std::uint8_t* chunk, std::size_t slot_bytes);  // -> gather_recv
  Status AllReduceSum(float* data, std::size_t count);
  // APS: x *= 2^s of each segment's layer, over every segment of b (the K inputs).
  Status ApplyShift(const BucketPlan& b, float* const* inputs);
};

// ---- Algorithms ---------------------------------------------------------------------------------
class Algorithm {
 public:
  virtual ~Algorithm() = default;
  // The sum over all workers into output (GradientAllReducer::Reduce's contract), after the scan
  // found every input finite; adds to the step's statistics and bytes sent.
  virtual Status Reduce(float* const* inputs, float* output, std::int64_t step,
                        bool measure_error) = 0;
};

// Each allocates its scratch for the plan's largest bucket. ctx outlives the algorithm.
Result<std::unique_ptr<Algorithm>> MakeFp32(StepContext* ctx);
Result<std::unique_ptr<Algorithm>> MakeEmulate(StepContext* ctx);
Result<std::unique_ptr<Algorithm>> MakePacked(StepContext* ctx);

// The quantised algorithms reduce bucket by bucket, in plan order; with measure_error, a bucket's
// reference is taken from the inputs before they serve as scratch, and its error after.
class BucketAlgorithm : public Algorithm {
 public:
  Status Reduce(float* const* inputs, float* output, std::int64_t step, bool measure_error) final;

 protected:
  explicit BucketAlgorithm(StepContext* ctx) : ctx_(*ctx), setup_(ctx->setup) {}
  // Bucket `index` of the plan, b.
  virtual Status ReduceBucket(std::size_t index, const BucketPlan& b, float* const* inputs,
                              float* output, std::int64_t step) = 0;

  StepContext& ctx_;
  const ReducerSetup& setup_;
};

// Bytes a bandwidth-optimal implementation of each payload collective sends from one of p ranks:
// all-to-all and all-gather (p - 1) blocks, all-reduce 2(p - 1)/p of the buffer.
inline std::uint64_t SentByExchange(int p, std::size_t block_bytes) {
  return std::uint64_t(p - 1) * block_bytes;
}
inline std::uint64_t SentByAllReduce(int p, std::size_t bytes) {
  return 2 * (std::uint64_t(p) - 1) * bytes / std::uint64_t(p);
}

// The slot of a chunk's worth of payload starts on a cache line.
inline std::size_t SlotBytes(std::size_t bytes) { return (bytes + 63) / 64 * 64; }

// The transport layout of a bucket whose contributions travel as cpd::Encode'd segments (packed
// with formats other than fixed float grids): one contribution's slot holds its chunk's segments
// packed one after the other (offset[i] for the bucket's segment i), padded to the longest
// chunk's and to a cache line.
struct SegmentSlots {
  std::size_t bytes = 0;
  std::vector<std::size_t> offset;
};
// Every bucket's layout; *largest_segment receives the bytes of the largest packed segment.
std::vector<SegmentSlots> LayOutSegmentSlots(const ReducerSetup& setup, const AllReducePlan& plan,
                                             std::size_t* largest_segment);
// Elements per slot of emulate's float32 contributions (formats other than fixed float grids).
inline std::size_t FloatSlotElems(const BucketPlan& b) {
  return SlotBytes(b.max_chunk * sizeof(float)) / sizeof(float);
}

}  // namespace cpd::comm::internal
