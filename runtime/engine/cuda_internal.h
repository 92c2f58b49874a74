// Internal to the runtime's CUDA back end (runtime/engine/cuda_ops.cu, runtime/cuda_kernels_*.cu,
// runtime/engine/cuda_context.cc, and Tensor's CUDA memory in runtime/engine/tensor.cc): the
// error-check macro, the stream, the reusable scratch memory of the process-wide context and its
// GEMMs. Not part of the public interface (see runtime/engine/cuda_ops.h).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace cpd::runtime::cuda::internal {

// Throws std::runtime_error "CUDA error at FILE:LINE: EXPR: TEXT (CODE)".
[[noreturn]] void ThrowError(const char* file, int line, const char* expr, const char* text,
                             int code);

// Every CUDA runtime call of the back end goes through this.
#define CPD_CUDA_CHECK(expr)                                                                 \
  do {                                                                                       \
    const cudaError_t cpd_cuda_err_ = (expr);                                                \
    if (cpd_cuda_err_ != cudaSuccess) {                                                      \
      ::cpd::runtime::cuda::internal::ThrowError(                                            \
          __FILE__, __LINE__, #expr, cudaGetErrorString(cpd_cuda_err_), int(cpd_cuda_err_)); \
    }                                                                                        \
  } while (0)

// The runtime's stream (creates the context on first use).
cudaStream_t StreamHandle();

// Scratch memory of the context, one region per use so that an operation can hold several at
// once. A region grows on demand (cudaFree waits for the device, so a region is never freed
// under a running kernel) and is reused in stream order: whatever a call queues into it is done
// before a later call's kernels, on the same stream, write it again.
enum class Scratch { kCudnnWorkspace = 0, kPartials = 1, kCoefficients = 2, kLabels = 3, kCount };
void* ScratchMemory(Scratch which, size_t bytes);

// cuBLAS GEMMs on row-major matrices (cuda_context.cc), on the context's handle and stream at
// float32 math (never TF32): C [m, n] = alpha op(A) op(B) + beta C, op(A) = A^T for A [k, m]
// (trans_a) or A [m, k], op(B) = B^T for B [n, k] (trans_b) or B [k, n], leading dimensions lda,
// ldb, ldc. k = 0 supports beta 0 (C = 0) and 1 (C unchanged). Dimensions above 2^31 - 1 throw
// std::invalid_argument.
void GemmRowMajor(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                  const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                  int64_t ldc);
// `batch` such products, the i-th on a + i stride_a, b + i stride_b, c + i stride_c (elements):
// one cublasSgemmStridedBatched.
void GemmRowMajorStridedBatched(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                                float alpha, const float* a, int64_t lda, int64_t stride_a,
                                const float* b, int64_t ldb, int64_t stride_b, float beta, float* c,
                                int64_t ldc, int64_t stride_c, int64_t batch);

// Bias kernels the library-backed operations (cuda_context.cc) need from cuda_ops.cu.
// y [n, out] += bias [out] per row (the CPU's `row[o] += bias[o]`).
void AddRowBias(int64_t n, int64_t out, const float* bias, float* y);
// db [out] = sum over the n rows of dy [n, out], row by row in float (the CPU's order).
void ColumnSums(int64_t n, int64_t out, const float* dy, float* db);
// y [n, c, hw] += bias [c].
void AddChannelBias(int64_t n, int64_t c, int64_t hw, const float* bias, float* y);
// db [c] = sum of dy [n, c, hw] over n and hw (accumulated in double).
void ChannelSums(int64_t n, int64_t c, int64_t hw, const float* dy, float* db);

}  // namespace cpd::runtime::cuda::internal
