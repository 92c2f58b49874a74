// CUDA GEMM under an emulated accumulation precision (kernels/accumulate.h): a launcher callable
// from plain C++, in the style of kernels/cuda/quantize.h (whose CudaResult it returns). It
// checks its arguments, launches on `stream` (a cudaStream_t; nullptr = the legacy default
// stream), never synchronises and never aborts.
//
// Bit for bit kernels::AccumulatedGemm (the CPU loop): each output element's products go through
// the same correctly rounded float32 operations in the same order (kernels/accumulate.h's
// functions, built with -fmad=false).
#pragma once

#include <cstdint>

#include "kernels/accumulate.h"
#include "kernels/cuda/quantize.h"

namespace cpd::kernels::cuda {

// C[m, n] = op(A) op(B) + beta * C in device memory, row-major, as kernels::AccumulatedGemm.
CudaResult LaunchAccumulatedGemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                                 const float* a, int64_t lda, const float* b, int64_t ldb,
                                 float beta, float* c, int64_t ldc, const Accumulation& acc,
                                 void* stream);

}  // namespace cpd::kernels::cuda
