// kernels::cuda::LaunchAccumulatedGemm against the CPU's kernels::AccumulatedGemm, bit for bit
// (skips without a GPU): every transpose combination, ragged shapes across several 16 x 16 tiles,
// promotion intervals, nearest and truncating rounding, wide and narrow grids, beta 0 and 1, and
// operands holding infinities and NaNs (whose payloads the GPU reproduces as x86 makes them).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpd/accumulate.h"
#include "cpd/quantize_cuda.h"
#include "kernels/accumulate_cpu.h"
#include "kernels/cuda/accumulate.h"

namespace {

using cpd::kernels::Accumulation;

#define CPD_REQUIRE_GPU() \
  if (!cpd::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device"

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

std::vector<float> Random(size_t n, std::mt19937* rng, bool specials) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = std::ldexp(normal(*rng), int((*rng)() % 13) - 6);
  if (specials && n > 8) {
    v[(*rng)() % n] = std::numeric_limits<float>::infinity();
    v[(*rng)() % n] = -std::numeric_limits<float>::infinity();
    v[(*rng)() % n] = std::numeric_limits<float>::quiet_NaN();
    v[(*rng)() % n] = 0.f;
  }
  return v;
}

// Device copy of v (at least one element, so that an empty operand still has an address).
float* ToDevice(const std::vector<float>& v) {
  float* d = nullptr;
  if (cudaMalloc(&d, std::max<size_t>(1, v.size()) * sizeof(float)) != cudaSuccess) return nullptr;
  if (!v.empty()) cudaMemcpy(d, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice);
  return d;
}

void ExpectMatchesCpu(const std::string& spec, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                      float beta, bool specials, std::mt19937* rng) {
  auto parsed = cpd::ParseAccumulation(spec);
  ASSERT_TRUE(parsed.ok()) << parsed.status().message();
  const Accumulation acc = *parsed;
  const int64_t lda = (ta ? m : k) + 1, ldb = (tb ? k : n) + 2, ldc = n + 1;
  const std::vector<float> a = Random(size_t((ta ? k : m) * lda), rng, specials);
  const std::vector<float> b = Random(size_t((tb ? n : k) * ldb), rng, specials);
  std::vector<float> cpu = Random(size_t(m * ldc), rng, false);
  float *da = ToDevice(a), *db = ToDevice(b), *dc = ToDevice(cpu);
  ASSERT_TRUE(da != nullptr && db != nullptr && dc != nullptr);
  const auto r = cpd::kernels::cuda::LaunchAccumulatedGemm(ta, tb, m, n, k, da, lda, db, ldb, beta,
                                                           dc, ldc, acc, nullptr);
  ASSERT_TRUE(r.ok()) << (r.message ? r.message : "?");
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> gpu(cpu.size());
  ASSERT_EQ(cudaMemcpy(gpu.data(), dc, gpu.size() * sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  cudaFree(da);
  cudaFree(db);
  cudaFree(dc);
  cpd::kernels::AccumulatedGemm(ta, tb, m, n, k, a.data(), lda, b.data(), ldb, beta, cpu.data(),
                                ldc, acc);
  for (size_t i = 0; i < cpu.size(); ++i) {
    ASSERT_EQ(Bits(gpu[i]), Bits(cpu[i]))
        << spec << " ta=" << ta << " tb=" << tb << " m=" << m << " n=" << n << " k=" << k
        << " beta=" << beta << " at " << i << ": " << gpu[i] << " vs " << cpu[i];
  }
}

TEST(AccumulatedGemmCuda, MatchesTheCpuBitForBit) {
  CPD_REQUIRE_GPU();
  std::mt19937 rng(5);
  const int64_t shapes[][3] = {{1, 1, 1}, {17, 33, 15}, {40, 70, 300}, {5, 3, 0}, {64, 64, 129}};
  for (const char* spec : {"e8m13:every=128", "e8m13", "e8m13:every=3:round=toward-zero", "fp16",
                           "bf16:every=16", "e4m6:every=5", "fp32", "e8m3:round=toward-zero"}) {
    for (const auto& s : shapes) {
      for (int t = 0; t < 4; ++t) {
        for (const float beta : {0.f, 1.f}) {
          ExpectMatchesCpu(spec, t & 1, t & 2, s[0], s[1], s[2], beta, false, &rng);
        }
      }
    }
  }
}

TEST(AccumulatedGemmCuda, NonFiniteOperandsMatchTheCpu) {
  CPD_REQUIRE_GPU();
  std::mt19937 rng(9);
  for (const char* spec : {"e8m13:every=128", "fp16:every=4", "e5m2:inf"}) {
    for (int t = 0; t < 4; ++t) ExpectMatchesCpu(spec, t & 1, t & 2, 19, 23, 40, 0.f, true, &rng);
  }
}

}  // namespace
