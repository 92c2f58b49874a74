// Block Hadamard transforms (cpd/transform.h): orthogonal, so a product over the transformed
// rows equals the plain product to float32 rounding; the Sylvester matrix's known values; signs
// from CPD's stream, reproducible by (seed, step) and shared by both operands; the rows after the
// last whole group untouched; results independent of the thread count; specs and their errors.
#include "cpd/transform.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/hadamard.h"

namespace cpd {
namespace {

std::vector<float> Random(size_t n, uint64_t seed, bool heavy_tails) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng);
  if (heavy_tails) {
    for (size_t i = 0; i < n; i += 97) x[i] *= 1000.0f;  // outliers, as activations have
  }
  return x;
}

// C = A^T B for row-major A [n, p] and B [n, q], in double.
std::vector<double> ProductOverRows(const std::vector<float>& a, const std::vector<float>& b,
                                    size_t n, size_t p, size_t q) {
  std::vector<double> c(p * q, 0.0);
  for (size_t r = 0; r < n; ++r) {
    for (size_t i = 0; i < p; ++i) {
      for (size_t j = 0; j < q; ++j) c[i * q + j] += double(a[r * p + i]) * double(b[r * q + j]);
    }
  }
  return c;
}

TEST(Hadamard, TheProductOverTransformedRowsIsThePlainProduct) {
  for (uint32_t k : {16u, 32u, 64u, 128u, 256u}) {
    for (bool random : {true, false}) {
      const size_t n = 2 * k + 5, p = 7, q = 9;  // 5 rows past the last whole group
      std::vector<float> a = Random(n * p, k, true), b = Random(n * q, k + 1, false);
      const std::vector<double> plain = ProductOverRows(a, b, n, p, q);
      HadamardOptions o;
      o.block = k;
      o.random_signs = random;
      o.seed = 3;
      o.step = 11;
      ASSERT_TRUE(HadamardAlongRows(o, a.data(), n, p).ok());
      ASSERT_TRUE(HadamardAlongRows(o, b.data(), n, q).ok());
      const std::vector<double> transformed = ProductOverRows(a, b, n, p, q);
      double err = 0.0, norm = 0.0;
      for (size_t i = 0; i < plain.size(); ++i) {
        err = std::max(err, std::fabs(transformed[i] - plain[i]));
        norm = std::max(norm, std::fabs(plain[i]));
      }
      // log2(k) butterflies and a scale per value: a few float32 ulps of the largest term.
      EXPECT_LT(err / norm, 1e-5) << "k " << k << (random ? " random" : " deterministic");
    }
  }
}

TEST(Hadamard, SylvesterValuesAndTheRowsPastTheLastGroup) {
  // Column e_0 of 16 rows becomes (1/4, ..., 1/4); e_1 alternates +-1/4; row 16 is left alone.
  std::vector<float> x(17 * 2, 0.0f);
  x[0] = 1.0f;          // row 0, column 0
  x[1 * 2 + 1] = 1.0f;  // row 1, column 1
  x[16 * 2] = 5.0f;
  HadamardOptions o;
  o.random_signs = false;
  ASSERT_TRUE(HadamardAlongRows(o, x.data(), 17, 2).ok());
  for (size_t r = 0; r < 16; ++r) {
    EXPECT_EQ(x[r * 2], 0.25f) << r;
    EXPECT_EQ(x[r * 2 + 1], (r % 2 == 0 ? 0.25f : -0.25f)) << r;
  }
  EXPECT_EQ(x[32], 5.0f);
  EXPECT_EQ(x[33], 0.0f);
}

TEST(Hadamard, SpreadsAnOutlierOverTheGroup) {
  std::vector<float> x(32, 0.01f);
  x[5] = 100.0f;
  HadamardOptions o;
  o.block = 32;
  ASSERT_TRUE(HadamardAlongRows(o, x.data(), 32, 1).ok());
  float max_abs = 0.0f;
  for (float v : x) max_abs = std::max(max_abs, std::fabs(v));
  EXPECT_LT(max_abs, 100.0f / std::sqrt(32.0f) + 1.0f);  // was 100
}

TEST(Hadamard, SignsFollowSeedAndStepAndNotTheThreadCount) {
  const size_t n = 64 * 3, cols = 600;
  const std::vector<float> x = Random(n * cols, 1, false);
  auto run = [&](uint64_t seed, uint64_t step, int threads) {
    std::vector<float> y = x;
    HadamardOptions o;
    o.block = 64;
    o.seed = seed;
    o.step = step;
    o.threads = threads;
    EXPECT_TRUE(HadamardAlongRows(o, y.data(), n, cols).ok());
    return y;
  };
  const std::vector<float> base = run(1, 2, 1);
  EXPECT_EQ(0, std::memcmp(base.data(), run(1, 2, 4).data(), base.size() * 4));
  EXPECT_NE(0, std::memcmp(base.data(), run(1, 3, 1).data(), base.size() * 4));
  EXPECT_NE(0, std::memcmp(base.data(), run(2, 2, 1).data(), base.size() * 4));
}

// The order every implementation follows (and the CUDA kernel relies on): stage h = 1, 2, ...,
// k/2 one after another, each pair (r, r + h) with r & h == 0 through kernels/hadamard.h's
// butterflies, the signs at the first stage and the scale at the last. Restated here one element
// and one stage at a time; the library (which fuses stages in registers) must give the same bits,
// infinities included, for every block size. A NaN matches any NaN: the compiler may turn a
// product by -1 into a negation, which flips a NaN's sign (transform_cuda_test allows the same).
TEST(Hadamard, EqualsTheStageByStageOrderBitForBit) {
  for (uint32_t k = 16; k <= 256; k *= 2) {
    const size_t rows = 2 * k + 3, cols = 37;
    std::vector<float> x = Random(rows * cols, k, true);
    x[5] = INFINITY;
    x[cols + 9] = -INFINITY;
    x[2 * cols + 1] = NAN;
    for (const bool random : {true, false}) {
      HadamardOptions o;
      o.block = k;
      o.random_signs = random;
      o.seed = 3;
      o.step = 11;
      std::vector<float> got = x, want = x;
      ASSERT_TRUE(HadamardAlongRows(o, got.data(), rows, cols).ok());
      const uint64_t key = kernels::MakeRandomKey(o.seed, o.step);
      const float scale = kernels::HadamardScale(k);
      for (size_t g = 0; g + k <= rows; g += k) {
        for (uint32_t h = 1; h < k; h *= 2) {
          for (uint32_t r = 0; r < k; ++r) {
            if ((r & h) != 0) continue;
            for (size_t c = 0; c < cols; ++c) {
              float* a = &want[(g + r) * cols + c];
              float* b = &want[(g + r + h) * cols + c];
              if (2 * h == k) {
                kernels::HadamardScaledButterfly(a, b, scale);
              } else {
                const bool first = h == 1;
                kernels::HadamardSignedButterfly(
                    a, b, first && random ? kernels::HadamardSign(key, r) : 1.0f,
                    first && random ? kernels::HadamardSign(key, r + h) : 1.0f);
              }
            }
          }
        }
      }
      for (size_t i = 0; i < got.size(); ++i) {
        uint32_t gu, wu;
        std::memcpy(&gu, &got[i], 4);
        std::memcpy(&wu, &want[i], 4);
        if (std::isnan(got[i]) && std::isnan(want[i])) continue;  // x86 leaves NaN signs open
        ASSERT_EQ(gu, wu) << "k " << k << (random ? " random" : " deterministic") << " at row "
                          << i / cols << " column " << i % cols << ": " << got[i] << " vs "
                          << want[i];
      }
    }
  }
}

TEST(Hadamard, SpecsAndErrors) {
  auto r = ParseHadamard("rht16");
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->random_signs);
  EXPECT_EQ(r->block, 16u);
  r = ParseHadamard("had256");
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->random_signs);
  EXPECT_EQ(HadamardSpec(*r), "had256");
  for (const char* bad : {"rht", "rht8", "rht24", "rht512", "hadamard", "rht16x", "", "rht016"}) {
    auto b = ParseHadamard(bad);
    ASSERT_FALSE(b.ok()) << bad;
    EXPECT_NE(b.status().message().find("accepted: rht<k>"), std::string::npos)
        << b.status().message();
  }
  HadamardOptions o;
  o.block = 48;
  float x[48] = {};
  EXPECT_FALSE(HadamardAlongRows(o, x, 48, 1).ok());
}

}  // namespace
}  // namespace cpd
