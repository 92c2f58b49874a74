// cpd::HadamardAlongRows (cpd/transform.h) on a CUDA device (only in a CUDA build:
// CPD_WITH_CUDA). Bit-identical to the CPU: the same per-element operations in the same order
// (kernels/hadamard.h, shared by both; correctly rounded, never fused), the same sign stream.
// NaN results are NaN in the same places; their payloads match the CPU's x86 arithmetic except
// where both operands of an add are NaN with different payloads (the CPU's vectorised loop may
// take either).
#pragma once

#include <cstddef>

#include "cpd/config.h"

#if CPD_WITH_CUDA

#include "cpd/status.h"
#include "cpd/transform.h"

namespace cpd {

// Transforms the row-major rows x cols matrix at d_x (device memory, or memory the current device
// can access) in place, as HadamardAlongRows. Queued on `stream` (a cudaStream_t; nullptr = the
// legacy default stream); returns without waiting. opts.threads is ignored. Invalid options or a
// null buffer: InvalidArgument before any work; CUDA failures: Internal.
Status HadamardAlongRowsCuda(const HadamardOptions& opts, float* d_x, size_t rows, size_t cols,
                             void* stream = nullptr);

}  // namespace cpd

#endif  // CPD_WITH_CUDA
