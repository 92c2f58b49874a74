// Internal to the CPU kernels of runtime/engine/cpu_ops.h (cpu_ops.cc, cpu_gemm.cc, cpu_conv.cc,
// cpu_conv_direct.cc): the thresholds and team sizes of their parallel regions, scratch growth,
// small shared loops, and the macros that compile hot loops for several instruction sets. Not
// part of the public interface.
#pragma once

#include <omp.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cstddef>
#include <cstdint>

#include "kernels/clones.h"  // CPD_CLONES: hot loops for baseline x86-64, AVX2 and AVX-512
#include "runtime/engine/tensor.h"

// The hand-written AVX-512 kernels (the direct convolution of cpu_conv_direct.cc, 2x2 max
// pooling in cpu_ops.cc) are compiled with GCC on x86-64 only, and run where HasAvx512().
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CPD_DIRECT_CONV 1
#define CPD_AVX512 __attribute__((target("avx512f,fma")))
#define CPD_AVX512_LAMBDA __attribute__((target("avx512f,fma"), always_inline))
#else
#define CPD_DIRECT_CONV 0
#endif

namespace cpd::runtime::cpu::internal {

// Below this many elements an elementwise pass costs less than waking the thread team (a few
// microseconds on an idle machine; up to a scheduler time slice on a loaded one, where a team
// member may be descheduled).
inline constexpr size_t kParallelElements = size_t(1) << 17;
// Below this many multiply-adds a GEMM or convolution is not worth splitting across threads.
inline constexpr double kParallelMacs = double(1 << 22);

// Threads for a parallel region started here: 1 when already inside one (nested regions would
// oversubscribe the cores).
inline int TeamSize() { return omp_in_parallel() ? 1 : omp_get_max_threads(); }

// Grows `t` to hold at least `n` floats; keeps the storage when it is already large enough.
inline float* Reserve(Tensor* t, size_t n) {
  if (t->numel() < n || t->device() != Device::kCpu) *t = Tensor({int64_t(n)});
  return t->data();
}

inline float SumF(const float* x, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i];
  return s;
}

// y [oc, ohw] += bias [oc] per row: the bias of a convolution's output image.
inline void AddBias(const float* bias, int64_t oc, int64_t ohw, float* y) {
  for (int64_t o = 0; o < oc; ++o) {
    const float bo = bias[o];
    float* row = y + o * ohw;
#pragma omp simd
    for (int64_t q = 0; q < ohw; ++q) row[q] += bo;
  }
}

inline bool HasAvx512() {
#if CPD_DIRECT_CONV
  static const bool has = [] {
    __builtin_cpu_init();  // may run before libgcc's constructor has
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  }();
  return has;
#else
  return false;
#endif
}

}  // namespace cpd::runtime::cpu::internal
