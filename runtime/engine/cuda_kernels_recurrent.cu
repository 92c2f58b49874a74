// The recurrent layers' kernels of runtime/engine/cuda_recurrent.h: the batch-first / time-major
// transposes, the bias rows and column sums around the products, the LSTM cell forward and
// backward (the CPU's per-element formulas, runtime/engine/lm_elementwise.h), and the products
// (cuBLAS, through cuda_context.cc). Layout and rules as cuda_kernels_transformer.cu.
#include <cuda_runtime.h>

#include <cstdint>

#include "runtime/engine/cuda_internal.h"
#include "runtime/engine/cuda_kernels.cuh"
#include "runtime/engine/cuda_recurrent.h"
#include "runtime/engine/lm_elementwise.h"

namespace cpd::runtime::cuda {

using internal::BlocksFor;
using internal::kThreads;
using internal::RequireIndex32;
using internal::StreamHandle;

namespace {

// y [b1, b0, c] = x [b0, b1, c], over the elements of y.
__global__ void swap_leading_dims_kernel(int32_t total, int32_t b0, int32_t b1, int32_t c,
                                         const float* __restrict__ x, float* __restrict__ y) {
  CPD_GRID_STRIDE_32(e, total) {
    const int32_t rest = e / c, k = e - rest * c;
    const int32_t j = rest / b0, i = rest - j * b0;  // y's row (j, i)
    y[e] = x[(i * b1 + j) * c + k];
  }
}

__global__ void broadcast_rows_kernel(int32_t total, int32_t cols, const float* __restrict__ row,
                                      float* __restrict__ y) {
  CPD_GRID_STRIDE_32(e, total) y[e] = row[e % cols];
}

// out [j] = sum over the rows of x [r, j], r ascending, from 0 (the CPU's order).
__global__ void sum_rows_kernel(int32_t rows, int32_t cols, const float* __restrict__ x,
                                float* __restrict__ out) {
  CPD_GRID_STRIDE_32(j, cols) {
    float s = 0.f;
    for (int32_t r = 0; r < rows; ++r) s += x[size_t(r) * size_t(cols) + size_t(j)];
    out[j] = s;
  }
}

// One thread per (row r, hidden unit j) of b rows of h units.
__global__ void lstm_cell_kernel(int32_t total, int32_t h, const float* __restrict__ gx,
                                 const float* __restrict__ gh, const float* __restrict__ c_prev,
                                 float* __restrict__ gates, float* __restrict__ c,
                                 float* __restrict__ h_out) {
  CPD_GRID_STRIDE_32(e, total) {
    const int32_t r = e / h, j = e - r * h;
    const size_t row = size_t(r) * 4 * size_t(h);
    lm::LstmCellElement(h, j, gx + row, gh + row, c_prev[e], gates + row, c + e, h_out + e);
  }
}

__global__ void lstm_cell_backward_kernel(int32_t total, int32_t h, const float* __restrict__ gates,
                                          const float* __restrict__ c_prev,
                                          const float* __restrict__ c, const float* __restrict__ dy,
                                          const float* __restrict__ dh_rec, float* __restrict__ dc,
                                          float* __restrict__ dz) {
  CPD_GRID_STRIDE_32(e, total) {
    const int32_t r = e / h, j = e - r * h;
    const size_t row = size_t(r) * 4 * size_t(h);
    const float dh = dh_rec != nullptr ? dy[e] + dh_rec[e] : dy[e];
    lm::LstmCellGradElement(h, j, gates + row, c_prev[e], c[e], dh, dc + e, dz + row);
  }
}

}  // namespace

void SwapLeadingDims(int64_t b0, int64_t b1, int64_t c, const float* x, float* y) {
  const int64_t total = b0 * b1 * c;
  if (total == 0) return;
  RequireIndex32("SwapLeadingDims", total);
  swap_leading_dims_kernel<<<BlocksFor(size_t(total)), kThreads, 0, StreamHandle()>>>(
      int32_t(total), int32_t(b0), int32_t(b1), int32_t(c), x, y);
  CPD_CHECK_LAUNCH();
}

void ColumnBlockedSgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                        const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                        float* c, int64_t ldc) {
  internal::GemmRowMajor(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void BroadcastRows(int64_t rows, int64_t cols, const float* row, float* y) {
  const int64_t total = rows * cols;
  if (total == 0) return;
  RequireIndex32("BroadcastRows", total);
  broadcast_rows_kernel<<<BlocksFor(size_t(total)), kThreads, 0, StreamHandle()>>>(
      int32_t(total), int32_t(cols), row, y);
  CPD_CHECK_LAUNCH();
}

void SumRows(int64_t rows, int64_t cols, const float* x, float* out) {
  if (cols == 0) return;
  RequireIndex32("SumRows", rows * cols);
  sum_rows_kernel<<<BlocksFor(size_t(cols)), kThreads, 0, StreamHandle()>>>(int32_t(rows),
                                                                            int32_t(cols), x, out);
  CPD_CHECK_LAUNCH();
}

void LstmCellForward(int64_t b, int64_t h, const float* gx, const float* gh, const float* c_prev,
                     float* gates, float* c, float* h_out) {
  const int64_t total = b * h;
  if (total == 0) return;
  RequireIndex32("LstmCellForward", 4 * total);
  lstm_cell_kernel<<<BlocksFor(size_t(total)), kThreads, 0, StreamHandle()>>>(
      int32_t(total), int32_t(h), gx, gh, c_prev, gates, c, h_out);
  CPD_CHECK_LAUNCH();
}

void LstmCellBackward(int64_t b, int64_t h, const float* gates, const float* c_prev, const float* c,
                      const float* dy, const float* dh_rec, float* dc, float* dz) {
  const int64_t total = b * h;
  if (total == 0) return;
  RequireIndex32("LstmCellBackward", 4 * total);
  lstm_cell_backward_kernel<<<BlocksFor(size_t(total)), kThreads, 0, StreamHandle()>>>(
      int32_t(total), int32_t(h), gates, c_prev, c, dy, dh_rec, dc, dz);
  CPD_CHECK_LAUNCH();
}

}  // namespace cpd::runtime::cuda
