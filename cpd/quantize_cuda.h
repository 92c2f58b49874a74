// Quantising float32 spans that live on a CUDA device (only in a CUDA build: CPD_WITH_CUDA).
// Same semantics as cpd::Quantize / cpd::QuantizeHysteresis (cpd/quantize.h), and bit-identical
// outputs for every format family and rounding mode: the same per-element math
// (kernels/grid.h), the same per-group scales (computed on the device with the same formulas),
// and the same counter-based random stream for stochastic rounding.
//
// Buffers are device pointers (or managed / mapped host memory the device can access), on the
// current device. Work is queued on `stream` (a cudaStream_t; nullptr = the legacy default
// stream) and the call returns without waiting, unless `stats` (or `flips`) is requested: then
// it waits for the stream. Scratch memory comes from the stream-ordered allocator.
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

}  // namespace cpd

#endif  // CPD_WITH_CUDA
