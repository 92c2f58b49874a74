// GEMM wrappers over OpenBLAS (part of runtime/engine/cpu_ops.h, which includes it), and the
// OpenBLAS threading rule of the CPU layers. Threading and layout as in runtime/cpu_ops.h.
#pragma once

#include <cstdint>

#include "kernels/accumulate.h"

namespace cpd::runtime::cpu {

// The layers parallelise with OpenMP and call OpenBLAS from inside their parallel regions, so
// OpenBLAS must run single-threaded there (its own pthread pool would oversubscribe the cores).
// Every function below that calls BLAS first calls this, which sets openblas_set_num_threads(1)
// if it is not 1 already, and leaves it so: a process that runs these layers uses OpenBLAS
// single-threaded. (Setting it back and forth around each call wakes OpenBLAS's idle workers,
// which then spin in sched_yield for a while and steal cycles from the OpenMP team.)
void UseSingleThreadedBlas();

// C[m, n] = alpha * op(A) op(B) + beta * C (row-major; op(A) is m x k, op(B) is k x n), one
// cblas_sgemm call on the calling thread with OpenBLAS's current thread setting. With `acc`
// (cpd-train --accumulate) the products are summed as kernels/accumulate.h emulates instead, on
// the calling thread; alpha must then be 1.
void Sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc,
           const kernels::Accumulation* acc = nullptr);

// The same product with the rows of C split across the OpenMP threads, each block computed by
// a single-threaded sgemm. Small products run on the calling thread.
void ParallelSgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                   const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                   int64_t ldc, const kernels::Accumulation* acc = nullptr);

}  // namespace cpd::runtime::cpu
