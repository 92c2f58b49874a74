// Limited-precision accumulation of matrix products, the numeric core shared by the CPU GEMM
// (kernels/accumulate_cpu.cc) and the CUDA one (kernels/cuda/accumulate.cu).
//
// DeepSeek-V3 (2024, section 3.3.2) measured that the H800's FP8 tensor cores keep about 14 bits
// of a running sum, and promoted partial sums to float32 CUDA cores every 128 products. CPD
// emulates that: each product a * b is rounded to float32, added to the partial sum in float32,
// and the sum rounded onto the accumulation grid; every `every` products the partial sum is added
// to a float32 total and starts again from zero. The order is fixed (k ascending), so that the
// CPU and the GPU give the same bits.
#pragma once

#include <cstdint>

#include "kernels/grid.h"

namespace cpd::kernels {

struct Accumulation {
  FloatGrid grid;            // the partial sum's grid (e8m13: about DeepSeek's 14 bits)
  int64_t every = 0;         // products per partial sum; 0: one partial sum (never promoted)
  bool toward_zero = false;  // truncate the partial sum (an aligning adder drops the low bits)
                             // rather than round it to nearest even
};

// Rounding onto a grid with float32's exponent range (emin = -126, so that eXmY with X = 8):
// there every float32, subnormal or not, rounds by clearing its low 23 - M bits (ties to even
// carrying into the exponent), which is what RoundToFloatGrid computes for such grids in fewer
// operations. The accumulation's hot loop runs this one.
template <RoundMode kMode>
CPD_HD float RoundToWideFloatGrid(float y, const FloatGrid& g) {
  static_assert(kMode == RoundMode::kNearestEven || kMode == RoundMode::kTowardZero);
  const uint32_t u = FloatBits(y);
  const uint32_t sign = u & 0x80000000u;
  const uint32_t a = u & 0x7fffffffu;
  const uint32_t r0 = uint32_t(23 - g.mbits);
  const uint32_t low = (1u << r0) - 1u;
  uint32_t res = a & ~low;
  if constexpr (kMode == RoundMode::kNearestEven) {
    const uint32_t lsb = r0 > 0 ? (a >> r0) & 1u : 0u;  // M = 23 rounds nothing
    res = (a + (low >> 1) + lsb) & ~low;
  }
  // Finite values that round past the largest take the grid's overflow (toward zero: the
  // largest); NaN takes the grid's NaN value. As in RoundToFloatGrid, what a NaN becomes, and
  // any NaN result, carries no sign.
  const uint32_t over =
      kMode == RoundMode::kTowardZero && a < 0x7f800000u ? g.max_bits : g.overflow_bits;
  res = res > g.max_bits ? over : res;
  res = a > 0x7f800000u ? g.nan_bits : res;
  const bool unsigned_result = a > 0x7f800000u || res > 0x7f800000u;
  return BitsFloat(res | (unsigned_result ? 0u : sign));
}

// Whether RoundToWideFloatGrid may stand for RoundToFloatGrid on g.
inline bool IsWideFloatGrid(const FloatGrid& g) { return g.emin == -126 && g.subnormals; }

// partial + a * b, both operations in float32 without fusing, rounded onto the grid (kWide:
// IsWideFloatGrid(g), through RoundToWideFloatGrid).
template <bool kTowardZero, bool kWide>
CPD_HD float AccumulateProduct(float partial, float a, float b, const FloatGrid& g) {
  constexpr RoundMode kMode = kTowardZero ? RoundMode::kTowardZero : RoundMode::kNearestEven;
  const float sum = AddAsX86(partial, MulAsX86(a, b));
  if constexpr (kWide) return RoundToWideFloatGrid<kMode>(sum, g);
  return BitsFloat(RoundToFloatGrid<kMode>(sum, g, 0u, nullptr));
}

// The promotion: the partial sum joins the float32 total.
CPD_HD float PromotePartial(float total, float partial) { return AddAsX86(total, partial); }

// True after product k (0-based) of `depth` when the partial sum is promoted.
CPD_HD bool PromotesAfter(int64_t k, int64_t depth, int64_t every) {
  return k + 1 == depth || (every > 0 && (k + 1) % every == 0);
}

// What the GEMM stores: total + beta * c (beta 0: c is not read, so it may hold NaN).
CPD_HD float AccumulatedOutput(float total, float beta, float c) {
  return beta == 0.f ? total : AddAsX86(MulAsX86(beta, c), total);
}

}  // namespace cpd::kernels
