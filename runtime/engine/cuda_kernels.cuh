// Internal to the runtime's CUDA kernels (runtime/engine/cuda_ops.cu and
// runtime/engine/cuda_kernels_*.cu): launch geometry, size checks, the grid-stride loop and the
// block reduction they share. Not part of the public interface (see runtime/engine/cuda_ops.h).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "runtime/engine/cuda_internal.h"

#define CEIL_DIV(a, b) (((a) + (b)-1) / (b))

#define CPD_CHECK_LAUNCH() CPD_CUDA_CHECK(cudaGetLastError())

// A grid-stride loop of a kernel over the 32-bit element indices i = 0 .. total - 1 (whose
// launcher has checked total with RequireIndex32).
#define CPD_GRID_STRIDE_32(i, total)                                            \
  for (int32_t i = int32_t(blockIdx.x * blockDim.x + threadIdx.x); i < (total); \
       i += int32_t(gridDim.x * blockDim.x))

namespace cpd::runtime::cuda::internal {

inline constexpr int kThreads = 256;
inline constexpr size_t kMaxBlocks = size_t(1) << 16;  // grid-stride loops beyond this
inline constexpr int64_t kMaxIndex32 = int64_t(0x7fffffff);

// Blocks for a grid-stride loop over n elements.
inline unsigned BlocksFor(size_t n) {
  const size_t b = CEIL_DIV(n, size_t(kThreads));
  return unsigned(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

// Kernels that index with 32-bit integers (per-element channel or window arithmetic) need every
// index to fit; larger tensors are refused with a message rather than mis-indexed.
inline void RequireIndex32(const char* op, int64_t count) {
  if (count < 0 || count > kMaxIndex32) {
    throw std::invalid_argument(std::string("cuda ") + op + ": " + std::to_string(count) +
                                " elements exceed this kernel's 32-bit indexing (2^31 - 1)");
  }
}

// Sums (a, b) over the block; the result is valid in thread 0. blockDim.x == kThreads.
inline __device__ void BlockSum2(double* a, double* b) {
  __shared__ double sa[kThreads / 32], sb[kThreads / 32];
  double x = *a, y = *b;
  for (int off = 16; off > 0; off >>= 1) {
    x += __shfl_down_sync(0xffffffffu, x, off);
    y += __shfl_down_sync(0xffffffffu, y, off);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sa[warp] = x;
    sb[warp] = y;
  }
  __syncthreads();
  if (warp == 0) {
    x = lane < kThreads / 32 ? sa[lane] : 0.0;
    y = lane < kThreads / 32 ? sb[lane] : 0.0;
    for (int off = 16; off > 0; off >>= 1) {
      x += __shfl_down_sync(0xffffffffu, x, off);
      y += __shfl_down_sync(0xffffffffu, y, off);
    }
  }
  *a = x;
  *b = y;
}

}  // namespace cpd::runtime::cuda::internal
