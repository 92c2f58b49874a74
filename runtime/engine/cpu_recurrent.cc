#include "runtime/engine/cpu_recurrent.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "runtime/engine/cpu_gemm.h"
#include "runtime/engine/cpu_internal.h"
#include "runtime/engine/lm_elementwise.h"

namespace cpd::runtime::cpu {

using internal::kParallelElements;
using internal::kParallelMacs;
using internal::TeamSize;

namespace {

// Threads for a pass over `work` elements: one below kParallelElements.
int TeamFor(double work) { return work < double(kParallelElements) ? 1 : TeamSize(); }

// The column blocks of ColumnBlockedSgemm and SumRows: a width fixed by the code, never by the
// team, so that the same blocks (and the same sgemm calls) run whatever the thread count.
constexpr int64_t kColumnBlock = 64;

}  // namespace

void SwapLeadingDims(int64_t b0, int64_t b1, int64_t c, const float* x, float* y) {
#pragma omp parallel for num_threads(TeamFor(double(b0 * b1) * double(c))) schedule(static)
  for (int64_t j = 0; j < b1; ++j) {
    for (int64_t i = 0; i < b0; ++i) std::copy_n(x + (i * b1 + j) * c, c, y + (j * b0 + i) * c);
  }
}

void ColumnBlockedSgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                        const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                        float* c, int64_t ldc) {
  UseSingleThreadedBlas();
  const int64_t blocks = (n + kColumnBlock - 1) / kColumnBlock;
  const double macs = double(m) * double(n) * double(k);
  const int team = macs < kParallelMacs ? 1 : int(std::min<int64_t>(TeamSize(), blocks));
#pragma omp parallel for num_threads(std::max(team, 1)) schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t n0 = blk * kColumnBlock, cols = std::min(kColumnBlock, n - n0);
    // Columns n0.. of op(B): rows of B when it is transposed, else its columns.
    const float* b_blk = trans_b ? b + n0 * ldb : b + n0;
    Sgemm(trans_a, trans_b, m, cols, k, alpha, a, lda, b_blk, ldb, beta, c + n0, ldc);
  }
}

void BroadcastRows(int64_t rows, int64_t cols, const float* row, float* y) {
  for (int64_t r = 0; r < rows; ++r) std::copy_n(row, cols, y + r * cols);
}

void SumRows(int64_t rows, int64_t cols, const float* x, float* out) {
  const int64_t blocks = (cols + kColumnBlock - 1) / kColumnBlock;
  const int team = int(std::min<int64_t>(TeamFor(double(rows) * double(cols)), blocks));
#pragma omp parallel for num_threads(std::max(team, 1)) schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t c0 = blk * kColumnBlock, c1 = std::min(cols, c0 + kColumnBlock);
    std::fill(out + c0, out + c1, 0.f);
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = x + r * cols;
#pragma omp simd
      for (int64_t j = c0; j < c1; ++j) out[j] += row[j];
    }
  }
}

void LstmCellForward(int64_t b, int64_t h, const float* gx, const float* gh, const float* c_prev,
                     float* gates, float* c, float* h_out) {
#pragma omp parallel for num_threads(TeamFor(double(b) * double(4 * h))) schedule(static)
  for (int64_t r = 0; r < b; ++r) {
    const float* zx = gx + r * 4 * h;
    const float* zh = gh + r * 4 * h;
    float* act = gates + r * 4 * h;
    for (int64_t j = 0; j < h; ++j) {
      lm::LstmCellElement(h, j, zx, zh, c_prev[r * h + j], act, c + r * h + j, h_out + r * h + j);
    }
  }
}

void LstmCellBackward(int64_t b, int64_t h, const float* gates, const float* c_prev, const float* c,
                      const float* dy, const float* dh_rec, float* dc, float* dz) {
#pragma omp parallel for num_threads(TeamFor(double(b) * double(4 * h))) schedule(static)
  for (int64_t r = 0; r < b; ++r) {
    const float* act = gates + r * 4 * h;
    float* d = dz + r * 4 * h;
    for (int64_t j = 0; j < h; ++j) {
      const int64_t e = r * h + j;
      const float dh = dh_rec != nullptr ? dy[e] + dh_rec[e] : dy[e];
      lm::LstmCellGradElement(h, j, act, c_prev[e], c[e], dh, dc + e, d);
    }
  }
}

}  // namespace cpd::runtime::cpu
