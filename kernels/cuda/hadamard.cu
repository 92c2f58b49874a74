// The block Hadamard transform on the device (kernels/cuda/hadamard.h).
//
// Layout: a block of 32 x 8 threads takes one group of k rows and a tile of 32 columns at a
// time (grid-stride over the (group, tile) items). The tile's k x 32 floats go to shared memory
// (32 KiB at k = 256) with coalesced loads, one warp per row of 32 consecutive columns; the
// log2(k) butterfly stages then run in shared memory, each thread taking the pairs p = ty,
// ty + 8, ... of its column, a barrier between stages; the tile goes back with coalesced stores.
// Lane tx always touches column tx of a row, so the accesses are free of bank conflicts. Every
// element sees the CPU's operations in the CPU's order (the order in which pairs of one stage
// run does not matter: each pair's outputs depend only on its inputs).
#include <cuda_runtime.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/hadamard.h"
#include "kernels/hadamard.h"

namespace cpd::kernels::cuda {

namespace {

constexpr int kTileCols = 32;
constexpr int kRowThreads = kThreads / kTileCols;  // 8

__global__ void __launch_bounds__(kThreads)
    HadamardAlongRowsKernel(float* x, uint64_t cols, uint64_t tiles, uint64_t items, uint32_t k,
                            uint32_t log_k, bool random_signs, uint64_t key, float scale) {
  extern __shared__ float smem[];
  float* signs = smem;     // [k]
  float* tile = smem + k;  // [k][kTileCols]
  const uint32_t tx = threadIdx.x, ty = threadIdx.y;
  for (uint32_t i = ty * kTileCols + tx; i < k; i += kThreads) {
    signs[i] = random_signs ? HadamardSign(key, i) : 1.0f;
  }
  for (uint64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const uint64_t g = item / tiles, t = item - g * tiles;
    const uint64_t c = t * kTileCols + tx;
    const bool inside = c < cols;
    float* base = x + g * k * cols + c;
    for (uint32_t r = ty; r < k; r += kRowThreads) {
      tile[r * kTileCols + tx] = inside ? base[r * cols] : 0.0f;
    }
    __syncthreads();  // also publishes the signs
    for (uint32_t s = 0; s < log_k; ++s) {
      const uint32_t h = 1u << s;
      const bool first = s == 0, last = s + 1 == log_k;
      for (uint32_t p = ty; p < k / 2; p += kRowThreads) {
        const uint32_t r = ((p >> s) << (s + 1)) | (p & (h - 1));  // the p-th row with r & h == 0
        float* a = tile + r * kTileCols + tx;
        float* b = a + h * kTileCols;
        if (last) {
          HadamardScaledButterfly(a, b, scale);
        } else {
          // As the CPU loop: the signs at the first stage, 1 (an identity) at the others.
          HadamardSignedButterfly(a, b, first ? signs[r] : 1.0f, first ? signs[r + h] : 1.0f);
        }
      }
      __syncthreads();
    }
    if (inside) {
      for (uint32_t r = ty; r < k; r += kRowThreads) base[r * cols] = tile[r * kTileCols + tx];
    }
    __syncthreads();  // the next item reuses the tile
  }
}

}  // namespace

CudaResult LaunchHadamardAlongRows(float* x, size_t groups, size_t cols, uint32_t k,
                                   bool random_signs, uint64_t key, void* stream) {
  CPD_LAUNCH_REQUIRE(k >= 16 && k <= 256 && (k & (k - 1)) == 0,
                     "Hadamard block must be a power of two in 16..256");
  const uint64_t tiles = CEIL_DIV(uint64_t(cols), uint64_t(kTileCols));
  const uint64_t items = uint64_t(groups) * tiles;
  if (items == 0) return CudaResult{};
  CPD_LAUNCH_REQUIRE(x != nullptr, "null buffer");
  uint32_t log_k = 0;
  while ((1u << log_k) < k) ++log_k;
  // Grid-stride over the items; enough blocks to fill any current GPU many times over.
  constexpr uint64_t kMaxBlocks = uint64_t(1) << 16;
  const int blocks = int(items < kMaxBlocks ? items : kMaxBlocks);
  const size_t shared = size_t(k) * (1 + kTileCols) * sizeof(float);  // <= 33 KiB
  HadamardAlongRowsKernel<<<blocks, dim3(kTileCols, kRowThreads), shared, AsStream(stream)>>>(
      x, cols, tiles, items, k, log_k, random_signs, key, HadamardScale(k));
  CPD_CUDA_CHECK(cudaGetLastError());
  return CudaResult{};
}

}  // namespace cpd::kernels::cuda
