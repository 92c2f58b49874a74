// The CPU loops against the per-element functions they vectorise: random stream version 2
// (FillRandomBits, and the 16-lane stream of the stochastic lanes) and stochastic rounding onto
// float grids by every lane set this CPU runs, bit for bit, codes and statistics included.
#include "kernels/quantize_cpu.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/grid.h"

namespace cpd::kernels {
namespace {

TEST(RandomStream, IsSplitMix64TwoElementsPerOutput) {
  // The SplitMix64 generator seeded with 0 first returns 0xe220a8397b1dcdaf = Mix64(0 + golden);
  // elements 2 and 3 of key 0 are its low and high halves.
  EXPECT_EQ(RandomBits(0, 2), 0x7b1dcdafu);
  EXPECT_EQ(RandomBits(0, 3), 0xe220a839u);
  EXPECT_EQ(kRandomStreamVersion, 2);
  const uint64_t key = MakeRandomKey(7, 3);
  for (uint64_t pair : {uint64_t(0), uint64_t(1) << 40, ~uint64_t(0) >> 1}) {
    const uint64_t z = Mix64(key + pair * kGolden64);
    EXPECT_EQ(RandomBits(key, 2 * pair), uint32_t(z));
    EXPECT_EQ(RandomBits(key, 2 * pair + 1), uint32_t(z >> 32));
  }
}

TEST(RandomStream, FillMatchesElementwiseAtAnyStartAndLength) {
  const uint64_t key = MakeRandomKey(11, 5);
  for (uint64_t first : {uint64_t(0), uint64_t(1), uint64_t(0xfffffff0), uint64_t(0xffffffff),
                         ~uint64_t(0) - 2001}) {  // an index never wraps past 2^64
    for (size_t n : {size_t(0), size_t(1), size_t(2), size_t(17), size_t(1000)}) {
      std::vector<uint32_t> out(n + 1, 0xdeadbeefu);
      FillRandomBits(key, first, n, out.data());
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(out[i], RandomBits(key, first + i)) << "first " << first << " i " << i;
      }
      EXPECT_EQ(out[n], 0xdeadbeefu) << "wrote past n";
    }
  }
}

struct GridCase {
  const char* name;
  int ebits, mbits, bias;
  NonFiniteStyle style;
  bool subnormals, overflow_to_nonfinite;
};

const GridCase kGrids[] = {
    {"e4m3 (OCP)", 4, 3, 7, NonFiniteStyle::kNanOnly, true, false},
    {"e4m3:inf", 4, 3, 7, NonFiniteStyle::kNanOnly, true, true},
    {"e5m2", 5, 2, 15, NonFiniteStyle::kIeee, true, true},
    {"e5m2 saturating", 5, 2, 15, NonFiniteStyle::kIeee, true, false},
    {"bf16 (quantum 2^-133)", 8, 7, 127, NonFiniteStyle::kIeee, true, true},
    {"fp16", 5, 10, 15, NonFiniteStyle::kIeee, true, true},
    {"e2m1", 2, 1, 1, NonFiniteStyle::kAllFinite, true, false},
    {"e3m0 without subnormals", 3, 0, 3, NonFiniteStyle::kAllFinite, false, false},
    {"e8m0", 8, 0, 127, NonFiniteStyle::kAllFinite, true, false},
    {"e8m22", 8, 22, 127, NonFiniteStyle::kIeee, true, true},
    {"e6m9 bias 40", 6, 9, 40, NonFiniteStyle::kIeee, false, true},
};

// Inputs around the grid's range under `shift`: random bit patterns with exponents from far
// below the smallest subnormal to above the largest value, and the special values.
std::vector<float> Inputs(const FloatGrid& g, int shift, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> x(n);
  const float specials[] = {0.0f,      -0.0f,   INFINITY,
                            -INFINITY, NAN,     -NAN,
                            1e-45f,    -3e-39f, BitsFloat(g.max_bits) * Pow2(shift),
                            1e38f,     -2.5f,   0.75f};
  for (size_t i = 0; i < n; ++i) {
    const uint64_t r = rng();
    uint32_t u = uint32_t(r);
    if (r % 16 == 0) {
      x[i] = specials[(r >> 8) % (sizeof specials / sizeof specials[0])];
      continue;
    }
    if ((r >> 32) % 4 != 0) {
      int e = int((r >> 40) % 70) + 127 + g.emin - 40 + shift;
      e = e < 0 ? 0 : (e > 254 ? 254 : e);
      u = (u & 0x807fffffu) | (uint32_t(e) << 23);
    }
    std::memcpy(&x[i], &u, 4);
  }
  return x;
}

class StochasticLanesTest : public ::testing::TestWithParam<StochasticLaneSet> {
 protected:
  void SetUp() override {
    saved_ = ActiveStochasticLanes();
    if (!ForceStochasticLanesForTesting(GetParam())) GTEST_SKIP() << "this CPU lacks the lanes";
  }
  void TearDown() override { ForceStochasticLanesForTesting(saved_); }
  StochasticLaneSet saved_ = StochasticLaneSet::kNone;
};

TEST_P(StochasticLanesTest, MatchesTheScalarFunctionBitForBit) {
  uint64_t seed = 1;
  for (const GridCase& gc : kGrids) {
    const FloatGrid g = MakeFloatGrid(gc.ebits, gc.mbits, gc.bias, gc.style, gc.subnormals,
                                      gc.overflow_to_nonfinite);
    for (int shift : {0, -7, 12}) {
      for (size_t n : {size_t(1), size_t(15), size_t(16), size_t(33), size_t(2500)}) {
        for (uint64_t base : {uint64_t(0), uint64_t(5), uint64_t(0xfffffffbull)}) {
          const std::vector<float> in = Inputs(g, shift, n, ++seed);
          LoopParams p;
          p.mode = RoundMode::kStochastic;
          p.rng_key = MakeRandomKey(seed, 9);
          p.index_base = base;
          std::vector<float> out(n), out_only(n);
          std::vector<uint32_t> codes(n), codes_only(n);
          ElementStats st;
          QuantizeFloatGrid(in.data(), out.data(), codes.data(), n, g, shift, p, &st);
          QuantizeFloatGrid(in.data(), out_only.data(), nullptr, n, g, shift, p, nullptr);
          QuantizeFloatGrid(in.data(), nullptr, codes_only.data(), n, g, shift, p, nullptr);
          const float down = Pow2(-shift), up = Pow2(shift);
          for (size_t i = 0; i < n; ++i) {
            uint32_t code;
            const uint32_t bits = RoundToFloatGrid<RoundMode::kStochastic>(
                in[i] * down, g, RandomBits(p.rng_key, base + i), &code);
            const uint32_t want = FloatBits(BitsFloat(bits) * up);
            const std::string where = std::string(gc.name) + " shift " + std::to_string(shift) +
                                      " n " + std::to_string(n) + " base " + std::to_string(base) +
                                      " i " + std::to_string(i) + " x bits " +
                                      std::to_string(FloatBits(in[i]));
            ASSERT_EQ(FloatBits(out[i]), want) << where;
            ASSERT_EQ(FloatBits(out_only[i]), want) << where;
            ASSERT_EQ(codes[i], code) << where;
            ASSERT_EQ(codes_only[i], code) << where;
          }
        }
      }
    }
  }
}

// Statistics of the lanes equal those of the scalar loop (the same pass runs after both).
TEST_P(StochasticLanesTest, StatisticsMatchTheScalarLoop) {
  const FloatGrid g = MakeFloatGrid(4, 3, 7, NonFiniteStyle::kNanOnly, true, false);
  const std::vector<float> in = Inputs(g, 0, 5000, 3);
  LoopParams p;
  p.mode = RoundMode::kStochastic;
  p.rng_key = MakeRandomKey(1, 2);
  p.index_base = 3;
  std::vector<float> out(in.size());
  ElementStats lanes, scalar;
  QuantizeFloatGrid(in.data(), out.data(), nullptr, in.size(), g, 0, p, &lanes);
  ASSERT_TRUE(ForceStochasticLanesForTesting(StochasticLaneSet::kNone));
  QuantizeFloatGrid(in.data(), out.data(), nullptr, in.size(), g, 0, p, &scalar);
  EXPECT_EQ(FloatBits(lanes.max_abs), FloatBits(scalar.max_abs));
  EXPECT_EQ(lanes.flushed, scalar.flushed);
  EXPECT_EQ(lanes.saturated, scalar.saturated);
  EXPECT_EQ(lanes.nonfinite, scalar.nonfinite);
  EXPECT_EQ(lanes.sq_error, scalar.sq_error);
  EXPECT_EQ(lanes.sq_input, scalar.sq_input);
  EXPECT_GT(lanes.flushed, 0u);
}

// The same for linear grids (int<b>, uint<b>:minmax, a constant tensor), inputs beyond the range,
// non-finite ones included, with statistics.
TEST_P(StochasticLanesTest, LinearGridsMatchTheScalarFunctionBitForBit) {
  const LinearGrid grids[] = {SymmetricIntGrid(3.5f, 127), SymmetricIntGrid(1e-30f, 7),
                              MinMaxGrid(-0.75f, 2.0f, 15), MinMaxGrid(-1e30f, 3e30f, 255),
                              MinMaxGrid(0.5f, 0.5f, 15)};
  uint64_t seed = 100;
  for (const LinearGrid& g : grids) {
    for (size_t n : {size_t(1), size_t(16), size_t(41), size_t(3000)}) {
      for (uint64_t base : {uint64_t(0), uint64_t(7)}) {
        std::mt19937_64 rng(++seed);
        std::vector<float> in(n);
        const float specials[] = {NAN, INFINITY, -INFINITY, 0.0f, -4.0f, 1e35f, 0.5f};
        std::uniform_real_distribution<float> u(-4.0f, 4.0f);
        for (size_t i = 0; i < n; ++i) in[i] = rng() % 9 == 0 ? specials[rng() % 7] : u(rng);
        LoopParams p;
        p.mode = RoundMode::kStochastic;
        p.rng_key = MakeRandomKey(seed, 2);
        p.index_base = base;
        std::vector<float> out(n);
        std::vector<uint32_t> codes(n);
        ElementStats st;
        QuantizeLinearGrid(in.data(), out.data(), codes.data(), n, g, p, &st);
        for (size_t i = 0; i < n; ++i) {
          int32_t q;
          const float want = RoundToLinearGrid<RoundMode::kStochastic>(
              in[i], g, RandomBits(p.rng_key, base + i), &q);
          ASSERT_EQ(FloatBits(out[i]), FloatBits(want))
              << "scale " << g.scale << " n " << n << " i " << i << " x " << in[i];
          ASSERT_EQ(codes[i], uint32_t(q - g.qmin)) << "i " << i;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(LaneSets, StochasticLanesTest,
                         ::testing::Values(StochasticLaneSet::kNone, StochasticLaneSet::kAvx2,
                                           StochasticLaneSet::kAvx512),
                         [](const auto& info) {
                           switch (info.param) {
                             case StochasticLaneSet::kAvx2:
                               return std::string("Avx2");
                             case StochasticLaneSet::kAvx512:
                               return std::string("Avx512");
                             default:
                               return std::string("Scalar");
                           }
                         });

}  // namespace
}  // namespace cpd::kernels
