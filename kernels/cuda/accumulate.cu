// The accumulation-emulating GEMM on the device (kernels/cuda/accumulate.h).
//
// Layout: one thread per element of C, blocks of 16 x 16 threads over a 16 x 16 tile of C. The
// k dimension goes through in tiles of 16: the block loads a 16 x 16 tile of op(A) and one of
// op(B) into shared memory, then every thread walks its 16 products in ascending k, rounding the
// partial sum after each and promoting it where the CPU does (PromotesAfter). The emulation's
// rounding, not memory, bounds its speed, so the tiles stay simple.
#include <cuda_runtime.h>

#include "kernels/cuda/accumulate.h"
#include "kernels/cuda/common.cuh"

namespace cpd::kernels::cuda {

namespace {

constexpr int kTile = 16;

template <bool kTowardZero, bool kWide>
__global__ void __launch_bounds__(kTile* kTile)
    AccumulatedGemmKernel(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                          const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                          float* c, int64_t ldc, Accumulation acc) {
  __shared__ float tile_a[kTile][kTile + 1];  // [row of C][k]
  __shared__ float tile_b[kTile][kTile + 1];  // [k][column of C]
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t row = int64_t(blockIdx.y) * kTile + ty;
  const int64_t col = int64_t(blockIdx.x) * kTile + tx;
  float partial = 0.0f, total = 0.0f;
  for (int64_t k0 = 0; k0 < k; k0 += kTile) {
    // Thread (tx, ty) loads op(A)[row0 + ty][k0 + tx] and op(B)[k0 + ty][col0 + tx].
    const int64_t ar = int64_t(blockIdx.y) * kTile + ty, ak = k0 + tx;
    const int64_t bk = k0 + ty, bc = int64_t(blockIdx.x) * kTile + tx;
    float av = 0.0f, bv = 0.0f;
    if (ar < m && ak < k) av = trans_a ? a[ak * lda + ar] : a[ar * lda + ak];
    if (bk < k && bc < n) bv = trans_b ? b[bc * ldb + bk] : b[bk * ldb + bc];
    tile_a[ty][tx] = av;
    tile_b[ty][tx] = bv;
    __syncthreads();
    const int64_t steps = k - k0 < kTile ? k - k0 : kTile;
    for (int64_t s = 0; s < steps; ++s) {
      partial =
          AccumulateProduct<kTowardZero, kWide>(partial, tile_a[ty][s], tile_b[s][tx], acc.grid);
      if (PromotesAfter(k0 + s, k, acc.every)) {
        total = PromotePartial(total, partial);
        partial = 0.0f;
      }
    }
    __syncthreads();
  }
  if (row < m && col < n) {
    float* out = c + row * ldc + col;
    *out = AccumulatedOutput(total, beta, beta == 0.0f ? 0.0f : *out);
  }
}

}  // namespace

CudaResult LaunchAccumulatedGemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                                 const float* a, int64_t lda, const float* b, int64_t ldb,
                                 float beta, float* c, int64_t ldc, const Accumulation& acc,
                                 void* stream) {
  if (m <= 0 || n <= 0) return CudaResult{};
  CPD_LAUNCH_REQUIRE(k >= 0, "negative GEMM depth");
  CPD_LAUNCH_REQUIRE(c != nullptr && (k == 0 || (a != nullptr && b != nullptr)), "null buffer");
  const int64_t grid_x = CEIL_DIV(n, int64_t(kTile)), grid_y = CEIL_DIV(m, int64_t(kTile));
  CPD_LAUNCH_REQUIRE(grid_y <= 65535 && grid_x <= 2147483647, "GEMM too large for one launch");
  const dim3 grid{unsigned(grid_x), unsigned(grid_y)}, block{kTile, kTile};
  const bool wide = IsWideFloatGrid(acc.grid);
  auto kernel =
      acc.toward_zero
          ? (wide ? AccumulatedGemmKernel<true, true> : AccumulatedGemmKernel<true, false>)
          : (wide ? AccumulatedGemmKernel<false, true> : AccumulatedGemmKernel<false, false>);
  kernel<<<grid, block, 0, AsStream(stream)>>>(trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c,
                                               ldc, acc);
  CPD_CUDA_CHECK(cudaGetLastError());
  return CudaResult{};
}

}  // namespace cpd::kernels::cuda
