// The CPU GEMM under an emulated accumulation precision (kernels/accumulate.h).
#pragma once

#include <cstdint>

#include "kernels/accumulate.h"

namespace cpd::kernels {

// C[m, n] = op(A) op(B) + beta * C, row-major (op(A) is m x k, op(B) is k x n), each output's k
// products summed in ascending order as `acc` says. On the calling thread; results do not depend
// on how a caller splits the rows.
void AccumulatedGemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a,
                     int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc,
                     const Accumulation& acc);

}  // namespace cpd::kernels
