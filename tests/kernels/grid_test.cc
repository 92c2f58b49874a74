// The restatements in kernels/grid.h that the CUDA kernels run for speed, against the functions
// they restate, bit for bit: RandomBitsRun (one hash per pair) against RandomBits, and
// RoundToFloatGridStochastic (precomputed constants) against RoundToFloatGrid<kStochastic>,
// codes included. Being host/device code, they are checked here without a GPU.
#include "kernels/grid.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>

namespace cpd::kernels {
namespace {

template <int kCount>
void ExpectRunMatches(uint64_t key, uint64_t first) {
  uint32_t out[kCount];
  RandomBitsRun<kCount>(key, first, out);
  for (int k = 0; k < kCount; ++k) {
    ASSERT_EQ(out[k], RandomBits(key, first + uint64_t(k)))
        << "run of " << kCount << " from " << first << ", element " << k;
  }
}

TEST(RandomBitsRun, EqualsRandomBitsFromEvenAndOddStarts) {
  const uint64_t key = MakeRandomKey(42, 7);
  for (uint64_t first :
       {uint64_t(0), uint64_t(1), uint64_t(2), uint64_t(3), uint64_t(1000003), uint64_t(0xfffffffe),
        uint64_t(0xffffffff), (uint64_t(1) << 33) + 1, ~uint64_t(0) - 20}) {
    ExpectRunMatches<2>(key, first);
    ExpectRunMatches<4>(key, first);
    ExpectRunMatches<8>(key, first);
  }
}

struct GridCase {
  const char* name;
  int ebits, mbits, bias;
  NonFiniteStyle style;
  bool subnormals, overflow_to_nonfinite;
};

// Every kind of grid: OCP FP8/FP6/FP4, IEEE-style with and without Inf and subnormals, a quantum
// below float32's normal range (bf16, e8m0), float32 itself, and the shared-shift elements.
const GridCase kGrids[] = {
    {"e4m3", 4, 3, 7, NonFiniteStyle::kNanOnly, true, false},
    {"e4m3:inf", 4, 3, 7, NonFiniteStyle::kNanOnly, true, true},
    {"e5m2", 5, 2, 15, NonFiniteStyle::kIeee, true, true},
    {"e5m2 saturating", 5, 2, 15, NonFiniteStyle::kIeee, true, false},
    {"e3m2", 3, 2, 3, NonFiniteStyle::kAllFinite, true, false},
    {"e2m3", 2, 3, 1, NonFiniteStyle::kAllFinite, true, false},
    {"e2m1", 2, 1, 1, NonFiniteStyle::kAllFinite, true, false},
    {"e3m0 without subnormals", 3, 0, 3, NonFiniteStyle::kAllFinite, false, false},
    {"fp134 element", 3, 4, 7, NonFiniteStyle::kAllFinite, true, false},
    {"bf16", 8, 7, 127, NonFiniteStyle::kIeee, true, true},
    {"fp16", 5, 10, 15, NonFiniteStyle::kIeee, true, true},
    {"e8m0", 8, 0, 127, NonFiniteStyle::kAllFinite, true, false},
    {"e8m22", 8, 22, 127, NonFiniteStyle::kIeee, true, true},
    {"fp32", 8, 23, 127, NonFiniteStyle::kIeee, true, true},
    {"fp32 without subnormals", 8, 23, 127, NonFiniteStyle::kIeee, false, true},
    {"e6m9 bias 40 without subnormals", 6, 9, 40, NonFiniteStyle::kIeee, false, true},
    {"e4m3 without subnormals", 4, 3, 7, NonFiniteStyle::kNanOnly, false, false},
};

// Every exponent field (so every region: deep below the grid, its subnormals, its binades,
// overflow, Inf and NaN), both signs, mantissas at the rounding boundaries and at random, and
// random bits at both ends of their range and at random.
TEST(RoundToFloatGridStochastic, EqualsTheGeneralFunctionBitForBit) {
  std::mt19937 rng(20261127);
  for (const GridCase& gc : kGrids) {
    const FloatGrid g = MakeFloatGrid(gc.ebits, gc.mbits, gc.bias, gc.style, gc.subnormals,
                                      gc.overflow_to_nonfinite);
    const StochasticGridConsts c(g);
    size_t bad = 0;
    for (uint32_t field = 0; field < 256; ++field) {
      for (int k = 0; k < 48; ++k) {
        uint32_t mant;
        if (k < 8) {
          const uint32_t fixed[8] = {0u,        1u,        0x7fffffu, 0x400000u,
                                     0x3fffffu, 0x100000u, 0x0fffffu, 0x000010u};
          mant = fixed[k];
        } else {
          mant = rng() & 0x7fffffu;
        }
        for (uint32_t sign : {0u, 0x80000000u}) {
          const float y = BitsFloat(sign | (field << 23) | mant);
          for (int j = 0; j < 8; ++j) {
            const uint32_t fixed_rnd[4] = {0u, 1u, 0x7fffffffu, 0xffffffffu};
            const uint32_t rnd = j < 4 ? fixed_rnd[j] : rng();
            uint32_t want_code = 0, got_code = 0;
            const uint32_t want = RoundToFloatGrid<RoundMode::kStochastic>(y, g, rnd, &want_code);
            const uint32_t got = RoundToFloatGridStochastic(y, c, rnd, &got_code);
            const uint32_t got_no_code = RoundToFloatGridStochastic(y, c, rnd, nullptr);
            if ((want != got || want_code != got_code || got_no_code != got) && ++bad <= 8) {
              ADD_FAILURE() << gc.name << ": y bits " << FloatBits(y) << " rnd " << rnd << ": want "
                            << want << " code " << want_code << ", got " << got << " code "
                            << got_code;
            }
          }
        }
      }
    }
    EXPECT_EQ(bad, 0u) << gc.name;
  }
}

}  // namespace
}  // namespace cpd::kernels
