// Quantising float32 spans that live on a CUDA device (only in a CUDA build: CPD_WITH_CUDA), and
// encoding them to packed codes and back (EncodeCuda / DecodeCuda, cpd::Encode / Decode's bytes).
// Same semantics as cpd::Quantize / cpd::QuantizeHysteresis (cpd/quantize.h), and bit-identical
// outputs for every format family and rounding mode: the same per-element math
// (kernels/grid.h), the same per-group scales (computed on the device with the same formulas),
// and the same counter-based random stream for stochastic rounding.
//
// Buffers are device pointers (or managed / mapped host memory the device can access), on the
// current device. Work is queued on `stream` (a cudaStream_t; nullptr = the legacy default
// stream) and the call returns without waiting, unless `stats` (or `flips`) is requested as host
// values: then it waits for the stream (the overloads that take a CudaStatsTarget keep them in
// device memory instead, and never wait). Scratch memory (statistics partials, per-group scales) is
// kept per device and stream across calls and grown when a call needs more (the first call on a
// stream, or one with more groups than any before, allocates and waits for the stream once); calls
// on one stream from several host threads take turns queueing their work.
//
// Statistics: count, max_abs, saturated, flushed, nonfinite (and flips) equal the CPU's exactly;
// sq_error and sq_input are double sums in a different order from the CPU's (per thread, per
// block, then blocks in order), so they agree to a relative ~1e-12, not bit for bit. They are
// deterministic for a given device and launch configuration.
//
// Errors: invalid arguments (null or host-only pointers, channels that do not divide n) are
// returned as InvalidArgument before any work is queued; CUDA failures come back as Internal
// with the file:line, the failing expression and cudaGetErrorString. Nothing aborts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "cpd/config.h"

#if CPD_WITH_CUDA

#include "cpd/format.h"
#include "cpd/quantize.h"
#include "cpd/status.h"

namespace cpd {

// True when the CUDA runtime finds at least one device (false without a driver or GPU).
bool CudaDeviceAvailable();

// Quantises n floats on the device. d_out may equal d_in. opts.threads is ignored.
Status QuantizeCuda(const Format& format, const float* d_in, float* d_out, size_t n,
                    const QuantizeOptions& opts, QuantStats* stats = nullptr,
                    void* stream = nullptr);

// cpd::QuantizeHysteresis on the device: d_q holds the previous quantised weights on entry and
// the new ones on return. `flips` (may be null) receives how many changed; asking for it (or
// for stats) waits for the stream.
Status QuantizeHysteresisCuda(const Format& format, const float* d_w, float* d_q, size_t n,
                              const QuantizeOptions& opts, QuantStats* stats = nullptr,
                              uint64_t* flips = nullptr, void* stream = nullptr);

// cpd::CountFlips on the device: how many of d_q[i] differ from d_prev[i], bit for bit. Queued on
// `stream`; waits for it to return the count.
Result<uint64_t> CountFlipsCuda(const float* d_prev, const float* d_q, size_t n,
                                void* stream = nullptr);

// ---- Statistics that stay on the device -------------------------------------------------------
//
// Asking the calls above for QuantStats (or flips) waits for the stream, once per call. A training
// step quantises tens of sites and counts the flips of every quantised weight, while its reports
// need the values only every few steps: with CudaStatsSlots the statistics of each call are added
// into device memory as its work runs, and a report reads all of them with one copy and one wait.

// The value of one slot: the QuantStats of the calls that named it, merged (count, saturated,
// flushed and nonfinite added; max_abs the largest; sq_error and sq_input added in the order the
// calls ran, so a slot named by one call holds exactly that call's statistics, as the waiting
// overloads return them), and the flips added by the calls that named it for flips.
struct CudaSlotStats {
  QuantStats stats;
  uint64_t flips = 0;
};

// An array of statistics slots in device memory on the device current at Create, owned by the
// caller. Slots start at zero and only Clear zeroes them again. Not thread-safe. The calls that
// update one slot should be queued on one stream: updates are atomic, so none is lost, but from
// several streams at once the double sums are added in an unspecified order.
class CudaStatsSlots {
 public:
  static Result<std::unique_ptr<CudaStatsSlots>> Create(size_t capacity);
  ~CudaStatsSlots();
  CudaStatsSlots(const CudaStatsSlots&) = delete;
  CudaStatsSlots& operator=(const CudaStatsSlots&) = delete;

  size_t capacity() const { return capacity_; }
  // Grows to at least `capacity` slots, keeping every slot's value (new slots are zero). Growing
  // waits for `stream` (work queued there may still update the old memory): reserve before the
  // work, not between its calls.
  Status Reserve(size_t capacity, void* stream);
  // Zeroes slots [first, first + count), queued on `stream` (no wait).
  Status Clear(size_t first, size_t count, void* stream);
  // Slots [first, first + count) once the work queued on `stream` so far has run: one
  // device-to-host copy and one wait for `stream` (none when count is 0).
  Result<std::vector<CudaSlotStats>> Read(size_t first, size_t count, void* stream) const;

  // Device memory of the slots (for the drivers in quantize_cuda.cc).
  void* device_data() const { return data_; }

 private:
  CudaStatsSlots() = default;
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

// Where a call's statistics go on the device: slot `stats` of `slots` receives the call's
// QuantStats and slot `flips` (may be the same or another slot) the flips it counts; kNone for
// either: not collected. A slot index must be below slots->capacity() (else InvalidArgument).
struct CudaStatsTarget {
  static constexpr size_t kNone = ~size_t(0);
  CudaStatsSlots* slots = nullptr;
  size_t stats = kNone;
  size_t flips = kNone;
};

// QuantizeCuda with its statistics added into slot target.stats on the device: never waits.
// target.flips is ignored (a plain quantisation counts no flips).
Status QuantizeCuda(const Format& format, const float* d_in, float* d_out, size_t n,
                    const QuantizeOptions& opts, const CudaStatsTarget& target, void* stream);

// QuantizeHysteresisCuda with its statistics added into slot target.stats and its flips into slot
// target.flips, on the device: never waits.
Status QuantizeHysteresisCuda(const Format& format, const float* d_w, float* d_q, size_t n,
                              const QuantizeOptions& opts, const CudaStatsTarget& target,
                              void* stream);

// QuantizeHysteresisCuda with the previous weights kept apart, as a training step holds them:
// Q_{t-1} is read from d_prev, and Q_t is written to d_q and over d_prev in the same pass (the
// state of the next step), so the caller copies nothing before or after the call. Statistics
// and flips as the overload above; never waits. d_prev and d_q must not overlap.
Status QuantizeHysteresisKeepCuda(const Format& format, const float* d_w, float* d_prev, float* d_q,
                                  size_t n, const QuantizeOptions& opts,
                                  const CudaStatsTarget& target, void* stream);

// CountFlipsCuda without waiting, fused with keeping the newest weights: adds to slot
// target.flips how many of d_q[i] differ from d_prev[i], bit for bit, and copies d_q over d_prev
// in the same pass (the previous weights of the next comparison). d_prev and d_q must not overlap.
Status CountFlipsAndKeepCuda(float* d_prev, const float* d_q, size_t n,
                             const CudaStatsTarget& target, void* stream);

// ---- Packed tensors on the device ------------------------------------------------------------

// A packed tensor in device memory: exactly cpd::PackedTensor's bytes (cpd/quantize.h: the
// `bits`-bit codes, little-endian bit order, then each group's scale metadata), in a buffer the
// caller owns. Why this representation:
//  * a view, not an owning buffer: the all-reduce packs the segments of many tensors into one
//    send buffer and receives into another, so packed tensors are slices of the caller's
//    buffers, and the codec allocates nothing for them (only the small per-stream scratch);
//  * the CPU's byte layout, at any alignment: one cudaMemcpy of `size` bytes moves a packed
//    tensor to or from PackedTensor::bytes (MPI staged through host memory, tests), and CPU and
//    GPU ranks put the same bytes on the wire.
struct PackedTensorCuda {
  size_t count = 0;          // elements
  size_t channels = 1;       // rows of the span, as QuantizeOptions::channels
  size_t columns = 0;        // block-scaled formats' matrix view, as QuantizeOptions::columns
  uint8_t* bytes = nullptr;  // device memory (or memory the device can access); not owned
  size_t size = 0;           // bytes at `bytes`: PackedSize(format, count, channels, columns)
};

// cpd::Encode on the device: quantises n floats at d_in and packs them into out->bytes, whose
// size out->size is REQUIRED on entry and must equal PackedSize(format, n, opts.channels,
// opts.columns) (else InvalidArgument); sets out->count, out->channels and out->columns. The bytes
// equal cpd::Encode's for the same input and options, bit for bit, every family and rounding mode
// included; the values they decode to are QuantizeCuda's. `stats` as QuantizeCuda's (asking for
// them waits for the stream). opts.threads is ignored. An empty span of a per-tensor format still
// writes its one metadata group, as cpd::Encode does.
Status EncodeCuda(const Format& format, const float* d_in, size_t n, const QuantizeOptions& opts,
                  PackedTensorCuda* out, QuantStats* stats = nullptr, void* stream = nullptr);

// cpd::Decode on the device: writes packed.count floats to d_out, bit for bit cpd::Decode's
// values. A size that does not match the format is Corruption, as in cpd::Decode.
Status DecodeCuda(const Format& format, const PackedTensorCuda& packed, float* d_out,
                  void* stream = nullptr);

}  // namespace cpd

#endif  // CPD_WITH_CUDA
