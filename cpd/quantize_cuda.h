// Quantising float32 spans that live on a CUDA device (only in a CUDA build: CPD_WITH_CUDA), and
// encoding them to packed codes and back (EncodeCuda / DecodeCuda, cpd::Encode / Decode's bytes).
// Same semantics as cpd::Quantize / cpd::QuantizeHysteresis (cpd/quantize.h), and bit-identical
// outputs for every format family and rounding mode: the same per-element math
// (kernels/grid.h), the same per-group scales (computed on the device with the same formulas),
// and the same counter-based random stream for stochastic rounding.
//
// Buffers are device pointers (or managed / mapped host memory the device can access), on the
// current device. Work is queued on `stream` (a cudaStream_t; nullptr = the legacy default
// stream) and the call returns without waiting, unless `stats` (or `flips`) is requested: then
// it waits for the stream. Scratch memory (statistics partials, per-group scales) is kept per
// device and stream across calls and grown when a call needs more (the first call on a stream,
// or one with more groups than any before, allocates and waits for the stream once); calls on
// one stream from several host threads take turns queueing their work.
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
  uint8_t* bytes = nullptr;  // device memory (or memory the device can access); not owned
  size_t size = 0;           // bytes at `bytes`: PackedSize(format, count, channels)
};

// cpd::Encode on the device: quantises n floats at d_in and packs them into out->bytes, whose
// size out->size is REQUIRED on entry and must equal PackedSize(format, n, opts.channels) (else
// InvalidArgument); sets out->count and out->channels. The bytes equal cpd::Encode's for the
// same input and options, bit for bit, every family and rounding mode included; the values
// they decode to are QuantizeCuda's. `stats` as QuantizeCuda's (asking for them waits for the
// stream). opts.threads is ignored. An empty span of a per-tensor format still writes its one
// metadata group, as cpd::Encode does.
Status EncodeCuda(const Format& format, const float* d_in, size_t n, const QuantizeOptions& opts,
                  PackedTensorCuda* out, QuantStats* stats = nullptr, void* stream = nullptr);

// cpd::Decode on the device: writes packed.count floats to d_out, bit for bit cpd::Decode's
// values. A size that does not match the format is Corruption, as in cpd::Decode.
Status DecodeCuda(const Format& format, const PackedTensorCuda& packed, float* d_out,
                  void* stream = nullptr);

}  // namespace cpd

#endif  // CPD_WITH_CUDA
