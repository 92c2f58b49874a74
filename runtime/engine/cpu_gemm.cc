#include "runtime/engine/cpu_gemm.h"

#include <cblas.h>

#include <algorithm>
#include <stdexcept>

#include "kernels/accumulate_cpu.h"
#include "runtime/engine/cpu_internal.h"

namespace cpd::runtime::cpu {

using internal::kParallelMacs;
using internal::TeamSize;

void UseSingleThreadedBlas() {
  if (openblas_get_num_threads() != 1) openblas_set_num_threads(1);
}

void Sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc,
           const kernels::Accumulation* acc) {
  if (m <= 0 || n <= 0) return;
  if (acc != nullptr) {
    if (alpha != 1.f) throw std::logic_error("Sgemm: an emulated accumulation needs alpha = 1");
    kernels::AccumulatedGemm(trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc, *acc);
    return;
  }
  if (k <= 0) {
    // BLAS leaves C untouched only for beta = 1; make the empty sum explicit.
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.f ? 0.f : beta * c[i * ldc + j];
    }
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, blasint(m), blasint(n), blasint(k), alpha, a,
              blasint(lda), b, blasint(ldb), beta, c, blasint(ldc));
}

void ParallelSgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                   const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                   int64_t ldc, const kernels::Accumulation* acc) {
  const int team = TeamSize();
  const double macs = double(m) * double(n) * double(k);
  if (team <= 1 || macs < kParallelMacs || m < 2 * 16) {
    UseSingleThreadedBlas();
    Sgemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, acc);
    return;
  }
  UseSingleThreadedBlas();
  // Row blocks in multiples of 16 (the micro-kernel height), as even as that allows.
  const int64_t blocks = std::min<int64_t>(team, m / 16);
  const int64_t per = ((m + blocks - 1) / blocks + 15) / 16 * 16;
#pragma omp parallel for num_threads(int(blocks)) schedule(static, 1)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t r0 = blk * per;
    const int64_t rows = std::min(per, m - r0);
    if (rows <= 0) continue;
    // Rows r0.. of op(A): rows of A, or columns of A when it is transposed.
    const float* a_blk = trans_a ? a + r0 : a + r0 * lda;
    Sgemm(trans_a, trans_b, rows, n, k, alpha, a_blk, lda, b, ldb, beta, c + r0 * ldc, ldc, acc);
  }
}

}  // namespace cpd::runtime::cpu
