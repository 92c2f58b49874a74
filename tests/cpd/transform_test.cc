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
