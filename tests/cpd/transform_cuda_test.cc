// cpd::HadamardAlongRowsCuda against the CPU's HadamardAlongRows, bit for bit (skips without a
// GPU): every block size, random and deterministic signs, seeds and steps, rows with a remainder
// past the last whole group, odd and tiny column counts, several columns tiles, values over many
// binades, infinities and NaNs.
#include "cpd/transform_cuda.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpd/quantize_cuda.h"
#include "cpd/transform.h"

namespace {

using cpd::HadamardOptions;

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

#define CPD_REQUIRE_GPU() \
  if (!cpd::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device"

// Normal values times 2^-20..2^20, so that the butterflies round.
std::vector<float> MakeInput(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = std::ldexp(normal(rng), int(rng() % 41) - 20);
  return v;
}

// Runs both transforms on x and compares: bit for bit, NaN payloads included unless
// `any_nan` (then a NaN matches any NaN).
void ExpectMatchesCpu(const HadamardOptions& o, std::vector<float> x, size_t rows, size_t cols,
                      bool any_nan = false) {
  ASSERT_EQ(x.size(), rows * cols);
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, std::max<size_t>(1, x.size()) * sizeof(float)), cudaSuccess);
  if (!x.empty()) {
    ASSERT_EQ(cudaMemcpy(d, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  const cpd::Status s = cpd::HadamardAlongRowsCuda(o, d, rows, cols, nullptr);
  ASSERT_TRUE(s.ok()) << s.message();
  std::vector<float> gpu(x.size());
  if (!x.empty()) {
    ASSERT_EQ(cudaMemcpy(gpu.data(), d, x.size() * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
  }
  cudaFree(d);
  ASSERT_TRUE(cpd::HadamardAlongRows(o, x.data(), rows, cols).ok());
  size_t bad = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const bool same = any_nan && std::isnan(x[i]) ? std::isnan(gpu[i]) : Bits(x[i]) == Bits(gpu[i]);
    if (!same && ++bad <= 5) {
      ADD_FAILURE() << cpd::HadamardSpec(o) << " rows " << rows << " cols " << cols << ": element "
                    << i << " (row " << i / cols << ", col " << i % cols << ") cpu " << x[i]
                    << " (0x" << std::hex << Bits(x[i]) << ") gpu " << gpu[i] << " (0x"
                    << Bits(gpu[i]) << std::dec << ")";
    }
  }
  EXPECT_EQ(bad, 0u) << cpd::HadamardSpec(o) << " rows " << rows << " cols " << cols;
}

TEST(HadamardCuda, MatchesCpuBitForBit) {
  CPD_REQUIRE_GPU();
  uint32_t seed = 1;
  for (uint32_t k : {16u, 32u, 64u, 128u, 256u}) {
    for (bool random_signs : {true, false}) {
      // Columns: one, odd and below a tile, a tile and one more, several tiles and a partial one.
      for (size_t cols : {size_t(1), size_t(7), size_t(33), size_t(100), size_t(257)}) {
        // Rows: one group, several with a remainder, fewer than a group (untouched).
        for (size_t rows : {size_t(k), size_t(3 * k + 5), size_t(k - 1)}) {
          HadamardOptions o;
          o.block = k;
          o.random_signs = random_signs;
          o.seed = 42;
          o.step = seed;
          ExpectMatchesCpu(o, MakeInput(rows * cols, seed++), rows, cols);
        }
      }
    }
  }
}

TEST(HadamardCuda, SignsFollowSeedAndStep) {
  CPD_REQUIRE_GPU();
  const size_t rows = 64 * 5 + 3, cols = 45;
  const std::vector<float> x = MakeInput(rows * cols, 7);
  for (uint64_t seed : {uint64_t(0), uint64_t(1), uint64_t(0x9e3779b97f4a7c15ull)}) {
    for (uint64_t step : {uint64_t(0), uint64_t(1), uint64_t(123456789)}) {
      HadamardOptions o;
      o.block = 64;
      o.seed = seed;
      o.step = step;
      ExpectMatchesCpu(o, x, rows, cols);
    }
  }
}

// Many groups (more (group, tile) items than the launch has blocks: the grid-stride loop).
TEST(HadamardCuda, ManyGroups) {
  CPD_REQUIRE_GPU();
  HadamardOptions o;
  o.block = 16;
  const size_t rows = 16 * 70000 + 9, cols = 3;
  ExpectMatchesCpu(o, MakeInput(rows * cols, 11), rows, cols);
}

// Infinities make Inf - Inf NaNs in later stages; a NaN input spreads through its group's
// column. The GPU reproduces x86's NaNs (kernels::AddAsX86), so the bits match; a NaN meeting
// another NaN may take either payload on the CPU's vector loop, hence the second, looser check.
TEST(HadamardCuda, NonFinite) {
  CPD_REQUIRE_GPU();
  const size_t rows = 32 * 3, cols = 37;
  std::vector<float> x = MakeInput(rows * cols, 5);
  x[0] = std::numeric_limits<float>::infinity();
  x[cols * 5 + 2] = -std::numeric_limits<float>::infinity();
  x[cols * 40 + 3] = std::numeric_limits<float>::infinity();
  x[cols * 41 + 3] = std::numeric_limits<float>::infinity();
  HadamardOptions o;
  o.block = 32;
  ExpectMatchesCpu(o, x, rows, cols);
  x[cols * 70 + 9] = std::numeric_limits<float>::quiet_NaN();
  x[cols * 90 + 9] = -std::numeric_limits<float>::quiet_NaN();
  ExpectMatchesCpu(o, x, rows, cols, /*any_nan=*/true);
}

TEST(HadamardCuda, EmptyAndErrors) {
  CPD_REQUIRE_GPU();
  HadamardOptions o;
  EXPECT_TRUE(cpd::HadamardAlongRowsCuda(o, nullptr, 0, 5).ok());
  EXPECT_TRUE(cpd::HadamardAlongRowsCuda(o, nullptr, 5, 0).ok());
  EXPECT_FALSE(cpd::HadamardAlongRowsCuda(o, nullptr, 16, 5).ok());
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 16 * sizeof(float)), cudaSuccess);
  o.block = 24;
  EXPECT_FALSE(cpd::HadamardAlongRowsCuda(o, d, 16, 1).ok());
  o.block = 512;
  EXPECT_FALSE(cpd::HadamardAlongRowsCuda(o, d, 512, 1).ok());
  cudaFree(d);
}

}  // namespace
