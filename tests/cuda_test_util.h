// Helpers of the CUDA runtime tests: skipping without a GPU, host copies, and comparisons of a
// CUDA result against the CPU's that report where and by how much they differ.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/engine/tensor.h"

namespace cpd::runtime::test {

// Skips the test (cleanly, with the reason) when no CUDA device can be used.
#define CPD_REQUIRE_CUDA()                            \
  do {                                                \
    std::string cpd_why_;                             \
    if (!::cpd::runtime::CudaAvailable(&cpd_why_)) {  \
      GTEST_SKIP() << "no CUDA device: " << cpd_why_; \
    }                                                 \
  } while (0)

inline std::vector<float> Host(const Tensor& t) {
  std::vector<float> v(t.numel());
  t.CopyToHost(v.data());
  return v;
}

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline Tensor Random(std::vector<int64_t> shape, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  Tensor t(std::move(shape));
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  for (size_t i = 0; i < t.numel(); ++i) t.data()[i] = u(gen);
  return t;
}

// How far a GPU result may be from the CPU's: |gpu - cpu| <= rtol |cpu| + atol_rel max|cpu|
// per element. {0, 0} means bit for bit (NaN matching any NaN).
struct Tol {
  double rtol = 0;
  double atol_rel = 0;
  bool exact() const { return rtol == 0 && atol_rel == 0; }
};
inline constexpr Tol kExact{0, 0};
// float32 GEMM / convolution / reduction reassociation.
inline constexpr Tol kReassoc{1e-4, 2e-5};

// Compares a CUDA tensor (or any tensor) with the CPU reference; reports the first mismatches
// with their flat index and values, and the largest absolute error relative to max|cpu|.
inline void ExpectMatch(const std::string& what, const Tensor& cpu, const Tensor& gpu, Tol tol) {
  ASSERT_EQ(cpu.shape(), gpu.shape())
      << what << ": shapes " << cpu.ShapeString() << " vs " << gpu.ShapeString();
  const std::vector<float> a = Host(cpu), b = Host(gpu);
  double max_ref = 0;
  for (float v : a) {
    if (std::isfinite(v)) max_ref = std::max(max_ref, double(std::fabs(v)));
  }
  size_t bad = 0;
  double worst = 0;
  size_t worst_at = 0;
  std::ostringstream first;
  for (size_t i = 0; i < a.size(); ++i) {
    bool ok;
    if (tol.exact() || !std::isfinite(a[i])) {
      ok = std::isnan(a[i]) ? std::isnan(b[i]) : Bits(a[i]) == Bits(b[i]);
    } else {
      const double d = std::fabs(double(a[i]) - double(b[i]));
      ok = d <= tol.rtol * std::fabs(double(a[i])) + tol.atol_rel * max_ref;
      if (max_ref > 0 && d / max_ref > worst) {
        worst = d / max_ref;
        worst_at = i;
      }
    }
    if (!ok) {
      if (bad < 5) {
        first.precision(9);
        first << "\n  [" << i << "] cpu " << a[i] << " (0x" << std::hex << Bits(a[i]) << ") gpu "
              << std::dec << b[i] << " (0x" << std::hex << Bits(b[i]) << std::dec << ")";
      }
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << a.size() << " elements differ "
                     << (tol.exact() ? "(bit for bit)" : "beyond the tolerance") << "; max|cpu| "
                     << max_ref << ", largest |gpu - cpu| / max|cpu| " << worst << " at ["
                     << worst_at << "]" << first.str();
}

}  // namespace cpd::runtime::test
