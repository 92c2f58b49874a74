#include "kernels/accumulate_cpu.h"

#include <algorithm>
#include <vector>

#include "kernels/clones.h"

namespace cpd::kernels {

namespace {

// Columns of C per panel: four AVX-512 vectors. op(B) is packed into panels of kPanel columns
// ([k][kPanel], zero past n), so that every panel is whole.
constexpr int64_t kPanel = 64;

// Rows [i0, i0 + kRows) of C, columns [j0, j0 + kPanel) of one panel: the rows' partial sums
// stay in registers while the products walk down k, each panel row of B loaded once for kRows
// rows of A. a(i, kk) is op(A)'s element.
// Inlined into PanelProductsFor's clones, so that each is compiled for the clone's ISA.
#define CPD_INLINE inline __attribute__((always_inline))

template <bool kTowardZero, bool kWide, int kRows>
CPD_INLINE void PanelRows(const float* a, int64_t a_row_step, int64_t a_k_step, const float* panel,
                          int64_t k, const Accumulation& acc, float (&total)[kRows][kPanel]) {
  const FloatGrid g = acc.grid;
  for (int r = 0; r < kRows; ++r) std::fill(total[r], total[r] + kPanel, 0.f);
  const int64_t chunk = acc.every > 0 ? acc.every : std::max<int64_t>(k, 1);
  for (int64_t k0 = 0; k0 < k; k0 += chunk) {
    const int64_t k1 = std::min(k, k0 + chunk);
    float partial[kRows][kPanel] = {};
    for (int64_t kk = k0; kk < k1; ++kk) {
      const float* brow = panel + kk * kPanel;
      CPD_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const float ar = a[r * a_row_step + kk * a_k_step];
#pragma omp simd
        for (int64_t j = 0; j < kPanel; ++j) {
          partial[r][j] = AccumulateProduct<kTowardZero, kWide>(partial[r][j], ar, brow[j], g);
        }
      }
    }
    for (int r = 0; r < kRows; ++r) {
#pragma omp simd
      for (int64_t j = 0; j < kPanel; ++j) total[r][j] = PromotePartial(total[r][j], partial[r][j]);
    }
  }
}

template <bool kTowardZero, bool kWide>
CPD_INLINE void PanelProducts(bool trans_a, int64_t m, int64_t width, int64_t k, const float* a,
                              int64_t lda, const float* panel, float beta, float* c, int64_t ldc,
                              const Accumulation& acc) {
  // op(A)(i, kk): A[i][kk], or A[kk][i] when transposed.
  const int64_t row_step = trans_a ? 1 : lda, k_step = trans_a ? lda : 1;
  constexpr int kRows = 4;
  int64_t i = 0;
  auto store = [&](const float* total, int64_t row) {
    float* c_row = c + row * ldc;
    for (int64_t j = 0; j < width; ++j) c_row[j] = AccumulatedOutput(total[j], beta, c_row[j]);
  };
  for (; i + kRows <= m; i += kRows) {
    float total[kRows][kPanel];
    PanelRows<kTowardZero, kWide, kRows>(a + i * row_step, row_step, k_step, panel, k, acc, total);
    for (int r = 0; r < kRows; ++r) store(total[r], i + r);
  }
  for (; i < m; ++i) {
    float total[1][kPanel];
    PanelRows<kTowardZero, kWide, 1>(a + i * row_step, row_step, k_step, panel, k, acc, total);
    store(total[0], i);
  }
}

// One panel of C, each ISA's clone holding the four rounding variants.
CPD_CLONES void PanelProductsFor(bool trans_a, int64_t m, int64_t width, int64_t k, const float* a,
                                 int64_t lda, const float* panel, float beta, float* c, int64_t ldc,
                                 const Accumulation& acc) {
  const bool wide = IsWideFloatGrid(acc.grid);
  if (acc.toward_zero) {
    if (wide) {
      PanelProducts<true, true>(trans_a, m, width, k, a, lda, panel, beta, c, ldc, acc);
    } else {
      PanelProducts<true, false>(trans_a, m, width, k, a, lda, panel, beta, c, ldc, acc);
    }
  } else if (wide) {
    PanelProducts<false, true>(trans_a, m, width, k, a, lda, panel, beta, c, ldc, acc);
  } else {
    PanelProducts<false, false>(trans_a, m, width, k, a, lda, panel, beta, c, ldc, acc);
  }
}

}  // namespace

void AccumulatedGemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a,
                     int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc,
                     const Accumulation& acc) {
  if (m <= 0 || n <= 0) return;
  thread_local std::vector<float> panel_store;
  panel_store.resize(size_t(std::max<int64_t>(k, 1) * kPanel));
  float* const panel = panel_store.data();
  for (int64_t j0 = 0; j0 < n; j0 += kPanel) {
    const int64_t width = std::min(kPanel, n - j0);
    // op(B)[kk][j0 + j]: B[kk][j0 + j], or B[j0 + j][kk] when transposed.
    for (int64_t kk = 0; kk < k; ++kk) {
      float* row = panel + kk * kPanel;
      for (int64_t j = 0; j < width; ++j) {
        row[j] = trans_b ? b[(j0 + j) * ldb + kk] : b[kk * ldb + j0 + j];
      }
      std::fill(row + width, row + kPanel, 0.f);
    }
    PanelProductsFor(trans_a, m, width, k, a, lda, panel, beta, c + j0, ldc, acc);
  }
}

}  // namespace cpd::kernels
