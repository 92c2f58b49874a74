// The emulated accumulation of matrix products (cpd/accumulate.h, kernels/accumulate*.h): the
// spec language, the wide-grid rounding against RoundToFloatGrid, and the CPU GEMM against an
// independent restatement of the rule (rounding in double with ldexp/nearbyint, not the grid's
// bit arithmetic) on every transpose combination, ragged shapes, promotion intervals and grids.
#include "cpd/accumulate.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/accumulate_cpu.h"

namespace {

using cpd::ParseAccumulation;
using cpd::kernels::Accumulation;
using cpd::kernels::RoundMode;

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

Accumulation Parse(const std::string& spec) {
  auto a = ParseAccumulation(spec);
  EXPECT_TRUE(a.ok()) << spec << ": " << a.status().message();
  return a.ok() ? *a : Accumulation{};
}

TEST(AccumulationSpec, ParsesFormatIntervalAndRounding) {
  const Accumulation d = Parse("e8m13:every=128");
  EXPECT_EQ(d.grid.ebits, 8);
  EXPECT_EQ(d.grid.mbits, 13);
  EXPECT_EQ(d.every, 128);
  EXPECT_FALSE(d.toward_zero);
  const Accumulation never = Parse("e8m13");
  EXPECT_EQ(never.every, 0);
  const Accumulation half = Parse("fp16:round=toward-zero:every=32");
  EXPECT_EQ(half.grid.mbits, 10);
  EXPECT_EQ(half.every, 32);
  EXPECT_TRUE(half.toward_zero);
  // A format whose own spelling holds a colon.
  const Accumulation inf = Parse("e5m2:inf:every=4");
  EXPECT_EQ(inf.grid.overflow_bits, 0x7f800000u);
  EXPECT_EQ(inf.every, 4);
  EXPECT_EQ(Parse("fp32").grid.mbits, 23);
  EXPECT_FALSE(Parse("fp32:nosub").grid.subnormals);
}

TEST(AccumulationSpec, RefusesWhatItCannotEmulate) {
  for (const char* bad : {"", "every=128", "e8m13:every=0", "e8m13:every=-1", "e8m13:every=1x",
                          "e8m13:every=2000000000", "e8m13:round=up", "int8", "mxfp8", "nvfp4",
                          "fp134", "e9m2", "e8m13:every=4:every=8"}) {
    auto a = ParseAccumulation(bad);
    ASSERT_FALSE(a.ok()) << bad;
    EXPECT_NE(a.status().message().find("bad accumulation"), std::string::npos)
        << a.status().message();
  }
}

// RoundToWideFloatGrid stands for RoundToFloatGrid on every grid with float32's exponent range.
TEST(AccumulationRounding, WideGridRoundingEqualsTheGeneralRule) {
  std::mt19937 rng(7);
  std::vector<float> specials = {0.f,
                                 -0.f,
                                 std::numeric_limits<float>::infinity(),
                                 -std::numeric_limits<float>::infinity(),
                                 std::numeric_limits<float>::quiet_NaN(),
                                 std::numeric_limits<float>::denorm_min(),
                                 std::numeric_limits<float>::min(),
                                 std::numeric_limits<float>::max(),
                                 -std::numeric_limits<float>::max()};
  for (int m = 0; m <= 23; ++m) {
    for (const char* mod : {"", ":inf"}) {
      const std::string spec = "e8m" + std::to_string(m) + mod;
      const Accumulation acc = Parse(spec);
      ASSERT_TRUE(cpd::kernels::IsWideFloatGrid(acc.grid)) << spec;
      std::vector<float> xs = specials;
      for (int i = 0; i < 20000; ++i) {
        const uint32_t u = rng();
        float f;
        std::memcpy(&f, &u, 4);
        xs.push_back(f);
      }
      for (float x : xs) {
        using cpd::kernels::RoundToFloatGrid;
        using cpd::kernels::RoundToWideFloatGrid;
        ASSERT_EQ(Bits(RoundToWideFloatGrid<RoundMode::kNearestEven>(x, acc.grid)),
                  RoundToFloatGrid<RoundMode::kNearestEven>(x, acc.grid, 0, nullptr))
            << spec << " nearest " << Bits(x);
        ASSERT_EQ(Bits(RoundToWideFloatGrid<RoundMode::kTowardZero>(x, acc.grid)),
                  RoundToFloatGrid<RoundMode::kTowardZero>(x, acc.grid, 0, nullptr))
            << spec << " toward zero " << Bits(x);
      }
    }
  }
  EXPECT_FALSE(cpd::kernels::IsWideFloatGrid(Parse("fp16").grid));
  EXPECT_FALSE(cpd::kernels::IsWideFloatGrid(Parse("fp32:nosub").grid));
}

// The reference: IEEE-style floats of E exponent and M mantissa bits, overflow saturating (CPD's
// default), rounded in double where every step is exact.
float ReferenceRound(float x, int ebits, int mbits, bool toward_zero) {
  if (std::isnan(x)) return std::numeric_limits<float>::quiet_NaN();
  if (x == 0.f) return x;
  const int emax = (1 << (ebits - 1)) - 1, emin = 1 - emax;
  const double max_finite = std::ldexp(2.0 - std::ldexp(1.0, -mbits), emax);
  const int e = std::max(std::ilogb(double(x)), emin);
  const double quantum = std::ldexp(1.0, e - mbits);
  const double steps = double(x) / quantum;
  double r = (toward_zero ? std::trunc(steps) : std::nearbyint(steps)) * quantum;
  if (std::fabs(r) > max_finite) r = std::copysign(max_finite, double(x));
  return float(r);
}

struct ReferenceGrid {
  int ebits, mbits;
};

// C = op(A) op(B) + beta C by the rule, one output at a time.
std::vector<float> ReferenceGemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                                 const std::vector<float>& a, int64_t lda,
                                 const std::vector<float>& b, int64_t ldb, float beta,
                                 std::vector<float> c, int64_t ldc, ReferenceGrid g, int64_t every,
                                 bool toward_zero) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float total = 0.f, partial = 0.f;
      for (int64_t kk = 0; kk < k; ++kk) {
        const float x = ta ? a[kk * lda + i] : a[i * lda + kk];
        const float y = tb ? b[j * ldb + kk] : b[kk * ldb + j];
        const float product = x * y;
        const float sum = partial + product;
        partial = ReferenceRound(sum, g.ebits, g.mbits, toward_zero);
        if (kk + 1 == k || (every > 0 && (kk + 1) % every == 0)) {
          total = total + partial;
          partial = 0.f;
        }
      }
      float& out = c[i * ldc + j];
      out = beta == 0.f ? total : beta * out + total;
    }
  }
  return c;
}

std::vector<float> Random(size_t n, std::mt19937* rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = std::ldexp(normal(*rng), int((*rng)() % 9) - 4);
  return v;
}

TEST(AccumulatedGemm, MatchesTheReferenceBitForBit) {
  std::mt19937 rng(11);
  struct Grid {
    const char* spec;
    ReferenceGrid ref;
  };
  const Grid grids[] = {{"e8m13", {8, 13}}, {"fp16", {5, 10}}, {"e8m3", {8, 3}},
                        {"bf16", {8, 7}},   {"fp32", {8, 23}}, {"e4m6", {4, 6}}};
  const int64_t shapes[][3] = {{1, 1, 1}, {7, 70, 5}, {4, 64, 300}, {9, 131, 129}, {3, 5, 0}};
  for (const Grid& g : grids) {
    for (const char* interval : {"", ":every=1", ":every=3", ":every=128"}) {
      for (const char* round : {"", ":round=toward-zero"}) {
        const std::string spec = std::string(g.spec) + interval + round;
        const Accumulation acc = Parse(spec);
        for (const auto& shape : shapes) {
          const int64_t m = shape[0], n = shape[1], k = shape[2];
          for (int t = 0; t < 4; ++t) {
            const bool ta = t & 1, tb = t & 2;
            // Leading dimensions wider than the matrices, as a sub-matrix of a larger one.
            const int64_t lda = (ta ? m : k) + 2, ldb = (tb ? k : n) + 1, ldc = n + 3;
            const std::vector<float> a = Random(size_t((ta ? k : m) * lda + 1), &rng);
            const std::vector<float> b = Random(size_t((tb ? n : k) * ldb + 1), &rng);
            for (const float beta : {0.f, 1.f, 0.5f}) {
              std::vector<float> c = Random(size_t(m * ldc), &rng);
              const std::vector<float> want = ReferenceGemm(
                  ta, tb, m, n, k, a, lda, b, ldb, beta, c, ldc, g.ref, acc.every, acc.toward_zero);
              cpd::kernels::AccumulatedGemm(ta, tb, m, n, k, a.data(), lda, b.data(), ldb, beta,
                                            c.data(), ldc, acc);
              for (size_t i = 0; i < c.size(); ++i) {
                ASSERT_EQ(Bits(c[i]), Bits(want[i]))
                    << spec << " m=" << m << " n=" << n << " k=" << k << " ta=" << ta
                    << " tb=" << tb << " beta=" << beta << " at " << i << ": " << c[i] << " vs "
                    << want[i];
              }
            }
          }
        }
      }
    }
  }
}

// Why DeepSeek-V3 promotes: a 4-bit running sum of ones stops at 16 (16 + 1 is a tie that rounds
// back to 16), while partial sums of 8 promoted to float32 add up exactly.
TEST(AccumulatedGemm, PromotionRescuesASwampedSum) {
  const int64_t k = 4096;
  const std::vector<float> ones(size_t(k), 1.f);
  float c = -1.f;
  cpd::kernels::AccumulatedGemm(false, false, 1, 1, k, ones.data(), k, ones.data(), 1, 0.f, &c, 1,
                                Parse("e8m3"));
  EXPECT_EQ(c, 16.f);
  cpd::kernels::AccumulatedGemm(false, false, 1, 1, k, ones.data(), k, ones.data(), 1, 0.f, &c, 1,
                                Parse("e8m3:every=8"));
  EXPECT_EQ(c, float(k));
  // Truncation stalls at the same place: 16 + 1 = 17 truncates to 16.
  cpd::kernels::AccumulatedGemm(false, false, 1, 1, k, ones.data(), k, ones.data(), 1, 0.f, &c, 1,
                                Parse("e8m3:round=toward-zero"));
  EXPECT_EQ(c, 16.f);
}

// With a float32 grid and no promotion the emulation is the plain sequential float32 sum.
TEST(AccumulatedGemm, Float32GridIsTheSequentialSum) {
  std::mt19937 rng(3);
  const int64_t m = 5, n = 67, k = 333;
  const std::vector<float> a = Random(size_t(m * k), &rng), b = Random(size_t(k * n), &rng);
  std::vector<float> c(size_t(m * n));
  cpd::kernels::AccumulatedGemm(false, false, m, n, k, a.data(), k, b.data(), n, 0.f, c.data(), n,
                                Parse("fp32"));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float s = 0.f;
      for (int64_t kk = 0; kk < k; ++kk) s = s + a[i * k + kk] * b[kk * n + j];
      ASSERT_EQ(Bits(c[i * n + j]), Bits(s)) << i << "," << j;
    }
  }
}

}  // namespace
