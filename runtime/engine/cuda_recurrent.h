// The CUDA math of the recurrent layers (only in a CUDA build: CPD_WITH_CUDA): every function of
// runtime/engine/cpu_recurrent.h, with the same name, arguments, layouts and contracts, over device
// pointers of the current device. The LSTM's layers (runtime/nn/recurrent.h) call these when their
// tensors are Device::kCuda tensors. Kernels in runtime/engine/cuda_kernels_recurrent.cu; the
// products through cuBLAS (float32 math, never TF32).
//
// Agreement with the CPU functions of the same name (the CPU is the reference):
//  * bit for bit: SwapLeadingDims, BroadcastRows, SumRows (one thread per column, in row order);
//  * to a few ulp: LstmCellForward/Backward (the CPU's per-element formulas,
//    runtime/engine/lm_elementwise.h, with CUDA's expf/tanhf instead of glibc's);
//  * to float32 rounding: ColumnBlockedSgemm, which is one cuBLAS GEMM here (the column blocks
//    exist to make the CPU's result independent of its thread count; a GEMM on the GPU is
//    deterministic without them).
// Execution, errors and thread-safety as in runtime/engine/cuda_ops.h.
#pragma once

#include "cpd/config.h"

#if CPD_WITH_CUDA

#include <cstdint>

namespace cpd::runtime::cuda {

void SwapLeadingDims(int64_t b0, int64_t b1, int64_t c, const float* x, float* y);
void ColumnBlockedSgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                        const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                        float* c, int64_t ldc);
void BroadcastRows(int64_t rows, int64_t cols, const float* row, float* y);
void SumRows(int64_t rows, int64_t cols, const float* x, float* out);
void LstmCellForward(int64_t b, int64_t h, const float* gx, const float* gh, const float* c_prev,
                     float* gates, float* c, float* h_out);
void LstmCellBackward(int64_t b, int64_t h, const float* gates, const float* c_prev, const float* c,
                      const float* dy, const float* dh_rec, float* dc, float* dz);

}  // namespace cpd::runtime::cuda

#endif  // CPD_WITH_CUDA
