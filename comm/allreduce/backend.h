// Where the gradient all-reduce's element work runs and its payloads live. An algorithm
// (comm/allreduce/fp32.cc, emulate.cc, packed.cc, with codes.h's schedule for fixed float grids)
// owns its stages once and calls a Backend for each:
//   host    CPU loops (comm/reduce_kernels.h, cpd::Encode/Quantize) on OpenMP threads, buffers in
//           host memory, the communicator's collectives as they are (host_backend.cc);
//   device  CUDA kernels on the reducer's stream (comm/reduce_kernels_cuda.h, cpd::EncodeCuda),
//           buffers in device memory, payload collectives direct over NCCL or staged through
//           pinned memory over MPI/Self (device_backend.cc; CUDA builds only).
// Every back end computes the same bits for the same stage (the device kernels are the CPU
// loops' twins), so the CPU tests of the algorithms, their schedules, offsets and byte counts
// cover the device path too; only the stages themselves differ. After gloo's algorithms over
// workspaces (gloo/allreduce_ring.h vs gloo/cuda_allreduce_ring.h). Internal to comm/.
//
// Conventions of every stage:
// - Pointers point into the back end's memory (Allocate), except the caller's gradients (inputs,
//   output: host or device memory as options.gradients says) and arguments named host_*.
// - Work is done in order: the host back end returns when it is done, the device back end queues
//   it on the reducer's stream; the *Host / ToHost / Read* calls wait for what they read.
// - A stage over `pieces` takes a contiguous run of one chunk's pieces of a bucket (a round of
//   codes.h's schedule, or the whole chunk); codes of piece pc start at
//   slot + PieceCodeOffset(b, pc, bits) of the chunk's slot.
// - Flat arrays (`x`, `out`) are indexed by flat element index minus their `base`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "comm/allreduce/plan.h"
#include "comm/communicator.h"
#include "comm/reduce_kernels.h"
#include "cpd/format.h"
#include "cpd/quantize.h"
#include "cpd/status.h"
#include "kernels/grid.h"

namespace cpd::comm::internal {

struct ReducerSetup;

// Bytes from a chunk's start to piece pc's codes (pieces start a multiple of 8 elements from it).
inline std::size_t PieceCodeOffset(const BucketPlan& b, const Piece& pc, int bits) {
  return (pc.begin - b.chunk_begin(pc.chunk)) * std::size_t(bits) / 8;
}

// An allocation in a back end's memory, zero-filled, freed with its owner.
class Memory {
 public:
  using Free = void (*)(void*);
  Memory() = default;
  Memory(void* data, std::size_t bytes, Free free) : data_(data), bytes_(bytes), free_(free) {}
  ~Memory() { Reset(); }
  Memory(Memory&& o) noexcept { *this = std::move(o); }
  Memory& operator=(Memory&& o) noexcept {
    if (this != &o) {
      Reset();
      data_ = o.data_;
      bytes_ = o.bytes_;
      free_ = o.free_;
      o.data_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  Memory(const Memory&) = delete;
  Memory& operator=(const Memory&) = delete;

  std::uint8_t* data() const { return static_cast<std::uint8_t*>(data_); }
  float* floats() const { return static_cast<float*>(data_); }
  std::size_t bytes() const { return bytes_; }

 private:
  void Reset() {
    if (data_ != nullptr && free_ != nullptr) free_(data_);
    data_ = nullptr;
    bytes_ = 0;
  }
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  Free free_ = nullptr;
};

// Which power-of-two shift a stage applies to the element at flat index i of a bucket:
enum class Shifts {
  kNone,    // none
  kLayers,  // that of i's layer, SetLayerShifts' (the step's APS shifts s)
  // That of i's segment of the bucket, SetSegmentShifts' (packed's sum scaling): the shifts t of
  // this rank's sums (kSums), the shifts s + t of every chunk's result (kResults). Two tables,
  // because a pipelined schedule encodes a round's sums between decodings of results.
  kSums,
  kResults,
};

// The W contributions to a run of pieces of this rank's chunk, after the exchange: worker w's
// codes of piece pc at codes + w * stride + PieceCodeOffset(b, pc, bits).
struct Contributions {
  const std::uint8_t* codes = nullptr;
  std::size_t stride = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // ---- Memory ---------------------------------------------------------------------------------
  // `bytes` zero bytes. `exchanged`: the buffer's blocks travel by StartExchangeBytes (the staged
  // device back end keeps a pinned mirror of it).
  virtual Result<Memory> Allocate(std::size_t bytes, bool exchanged = false) = 0;
  virtual Status Copy(void* dst, const void* src, std::size_t bytes) = 0;
  virtual Status Zero(void* dst, std::size_t bytes) = 0;
  // host_dst[0, bytes) = src[0, bytes), once everything queued before has run (waits).
  virtual Status ToHost(const void* src, std::size_t bytes, void* host_dst) = 0;
  // dst[0, bytes) = host_src[0, bytes); host_src may be reused on return.
  virtual Status FromHost(void* dst, const void* host_src, std::size_t bytes) = 0;
  // At the start of every step: InvalidArgument unless the K inputs and the output are in this
  // back end's memory space (where that can be told); the device back end makes its device current.
  virtual Status BeginStep(float* const* inputs, const float* output) = 0;
  // At the end of every step that wrote the output: returns once the sum is complete (the device
  // back end waits for its stream, so that a caller on another stream may read it).
  virtual Status EndStep() = 0;

  // ---- The step's scan and shifts
  // ----------------------------------------------------------------- Per layer over the K inputs:
  // the largest |x| as float32 bits (comm::internal::ScanAbs's, a result >= 0x7f800000 meaning a
  // non-finite element) and the nonzero elements, on the host.
  virtual Status ScanLayers(float* const* inputs, std::vector<std::uint32_t>* host_max_bits,
                            std::vector<std::uint64_t>* host_nonzero) = 0;
  // The shifts of Shifts::kLayers, one per layer, for the stages that follow.
  virtual Status SetLayerShifts(const std::vector<int>& shifts) = 0;
  // The shifts of table kSums or kResults, one per segment of bucket b (index into b.segments).
  virtual Status SetSegmentShifts(const BucketPlan& b, Shifts table,
                                  const std::vector<int>& shifts) = 0;

  // ---- Float32 arithmetic
  // -------------------------------------------------------------------------- out[i - begin] =
  // in[0][i] + in[1][i] + ... (count buffers, in order) for begin <= i < end.
  virtual Status SumBuffers(const float* const* in, int count, std::size_t begin, std::size_t end,
                            float* out) = 0;
  // out[i] = x[i] * scale (a power of two; out may equal x). A NaN keeps its bits.
  virtual Status Scale(const float* x, float* out, std::size_t n, float scale) = 0;
  // out[i] = a[i] + b[i] or a[i] - b[i] (out may equal a or b).
  virtual Status Combine(const float* a, const float* b, float* out, std::size_t n,
                         ElementOp op) = 0;
  // Per segment j of this rank's chunk of b (b.segments_of(rank)): the largest |sums[i -
  // sums_base]| over the segment as float32 bits (ScanAbs's), on the host (packed's sum scaling).
  virtual Status SegmentMaxima(const BucketPlan& b, const float* sums, std::size_t sums_base,
                               std::vector<std::uint32_t>* host_max_bits) = 0;

  // ---- Any format, one scale group (a segment) at a time
  // ------------------------------------------ cpd::Encode / Decode / Quantize of n elements with
  // one channel: PackedSize(f, n, 1) bytes at dst or src. `stats` (host, may be null) as
  // cpd::QuantStats.
  virtual Status Encode(const Format& f, const float* x, std::size_t n, const QuantizeOptions& o,
                        std::uint8_t* dst, QuantStats* stats) = 0;
  virtual Status Decode(const Format& f, const std::uint8_t* src, std::size_t n, float* out) = 0;
  virtual Status Quantize(const Format& f, const float* in, float* out, std::size_t n,
                          const QuantizeOptions& o, QuantStats* stats) = 0;

  // ---- Packed codes of the gradient format (a fixed float grid of <= 16 bits) -------------------
  // Codes of x[pc.begin - x_base, pc.end - x_base) times 2^shift (`shifts`), rounded with `mode`
  // and the stream of `stage` at `step`, packed into the chunk's slot at `slot`. Shifts::kLayers
  // marks the contributions, which the scan found finite and the shift keeps finite; with
  // `count`, their flushed and saturated elements are added to the layer counters
  // (ReadCodeCounters).
  virtual Status EncodeCodes(const BucketPlan& b, std::span<const Piece> pieces, const float* x,
                             std::size_t x_base, Shifts shifts, kernels::RoundMode mode,
                             std::int64_t stage, std::int64_t step, std::uint8_t* slot,
                             bool count) = 0;
  // out[i] = value of each piece's codes (from the chunk's slot at `slot`) times 2^-shift.
  virtual Status DecodeCodes(const BucketPlan& b, std::span<const Piece> pieces,
                             const std::uint8_t* slot, Shifts shifts, float* out) = 0;
  // packed: each piece's W contributions decoded and summed in float32 in worker order, rounded
  // once (mode, the stream of RequantizeStage(W) at step) and packed into the slot.
  virtual Status SumRequantizeCodes(const BucketPlan& b, std::span<const Piece> pieces,
                                    const Contributions& in, std::int64_t step,
                                    std::uint8_t* slot) = 0;
  // packed with the sum scaling: the float32 sums alone, into sums[i - sums_base].
  virtual Status SumCodes(const BucketPlan& b, std::span<const Piece> pieces,
                          const Contributions& in, float* sums, std::size_t sums_base) = 0;
  // emulate: each piece's W contributions summed in worker order, rounded to the format after
  // every addition (or Kahan's compensated sum, every operation rounded: options.kahan), with
  // the streams of AdditionStage(W, w[, op]) at step; the sum's codes packed into the slot.
  virtual Status SumRoundedCodes(const BucketPlan& b, std::span<const Piece> pieces,
                                 const Contributions& in, std::int64_t step,
                                 std::uint8_t* slot) = 0;
  // Adds this rank's flushed and saturated contribution elements per layer since the last
  // call (EncodeCodes with count) to host_counts[3 l] and host_counts[3 l + 1].
  virtual Status ReadCodeCounters(std::vector<std::uint64_t>* host_counts) = 0;

  // ---- Payload collectives, on the back end's memory (Communicator's contracts) -----------------
  virtual Status AllToAllBytes(const std::uint8_t* in, std::uint8_t* out,
                               std::size_t block_bytes) = 0;
  virtual Status AllGatherBytes(const std::uint8_t* in, std::uint8_t* out,
                                std::size_t block_bytes) = 0;
  virtual Status AllReduceSum(float* data, std::size_t count) = 0;
  virtual Status ReduceScatterSum(const float* in, float* out, std::size_t count) = 0;
  // Whether StartExchangeBytes works here (pipelined schedules ask).
  virtual bool has_nonblocking_exchange() const = 0;
  // Communicator::StartExchangeBytes on blocks of buffers allocated with `exchanged`; the
  // received blocks are in the back end's memory, in order, once the exchange is complete.
  // Tracked until Land: the element stages keep the exchanges in flight moving.
  Status StartExchange(std::span<const Communicator::SendBlock> send,
                       std::span<const Communicator::RecvBlock> recv,
                       std::vector<std::unique_ptr<Communicator::PendingExchange>>* flight);
  // Waits for every exchange of a flight, which then leaves the tracked ones.
  Status Land(std::vector<std::unique_ptr<Communicator::PendingExchange>>* flight);
  // The first error a tracked exchange reported while the stages moved it (Ok if none).
  Status moving_error() const { return moving_error_; }
  void ClearMovingError() { moving_error_ = Status::Ok(); }

  // ---- Small host arrays (per-layer maxima, counters, errors)
  // -------------------------------------
  virtual Status AllReduceHost(float* data, std::size_t count, ReduceOp op) = 0;
  virtual Status AllReduceHost(std::uint64_t* data, std::size_t count, ReduceOp op) = 0;
  virtual Status AllGatherHost(const std::uint8_t* in, std::uint8_t* out,
                               std::size_t block_bytes) = 0;

 protected:
  // Starts the exchange on the communicator (the device back end stages it).
  virtual Result<std::unique_ptr<Communicator::PendingExchange>> StartExchangeBytes(
      std::span<const Communicator::SendBlock> send,
      std::span<const Communicator::RecvBlock> recv) = 0;
  // Tests every tracked exchange (never blocks): the MPI backend moves bytes only inside its
  // calls, so stages that compute while exchanges are in flight call this now and then.
  void KeepExchangesMoving();
  bool exchanges_in_flight() const { return !in_flight_.empty(); }

 private:
  std::vector<Communicator::PendingExchange*> in_flight_;
  Status moving_error_;
};

// The host back end (host_backend.cc) and the device back end (device_backend.cc: Unavailable
// in a build without CUDA). `setup` and `plan` outlive the back end.
Result<std::unique_ptr<Backend>> MakeHostBackend(const ReducerSetup& setup,
                                                 const AllReducePlan& plan);
Result<std::unique_ptr<Backend>> MakeDeviceBackend(const ReducerSetup& setup,
                                                   const AllReducePlan& plan);

}  // namespace cpd::comm::internal
