// Per-element rounding of float32 onto a number grid: the numeric core shared by the CPU loops
// (kernels/quantize_cpu.cc) and the CUDA kernels (kernels/cuda/quantize.cu). Everything here is
// header-only, branch-free and host/device, so that both paths produce bit-identical results.
//
// Three kinds of grid:
//  * FloatGrid: sign, X exponent bits, M mantissa bits (IEEE-like, gradual underflow). Covers
//    eXmY, bf16/fp16, OCP FP8/FP6/FP4, and, after a power-of-two shift chosen per tensor, channel
//    or block, the fp134 family, log<b> (M = 0), MX elements and bfp<b> (X = 1).
//  * LinearGrid: q = clamp(round((x - offset) / scale)), value = q * scale + offset: int<b> and
//    the min/max range quantiser of CPT.
//  * BinadeGrid: any number of mantissa bits in each binade (binades:M0,M1,...), under a shift:
//    fixed point, floats and float-fix hybrids as one family (Lee, Park, Jeon 2022).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define CPD_HD __host__ __device__ __forceinline__
#define CPD_UNROLL _Pragma("unroll")
#else
#define CPD_HD inline __attribute__((always_inline))
#define CPD_UNROLL _Pragma("GCC unroll 8")
#endif

namespace cpd::kernels {

// How a value between two grid points is resolved.
enum class RoundMode : uint8_t {
  kNearestEven = 0,  // ties to the even code
  kStochastic = 1,   // up with probability (x - lo) / (hi - lo); needs 32 random bits
  kTowardZero = 2,
  kDown = 3,  // toward -inf (floor onto the grid): hysteresis
  kUp = 4,    // toward +inf (ceil onto the grid): hysteresis
};

// Which codes of a float grid are not finite numbers.
enum class NonFiniteStyle : uint8_t {
  kAllFinite = 0,  // every code is a number (OCP E3M2/E2M3/E2M1, fp134, log, MX/bfp elements)
  kIeee = 1,       // the top exponent code is Inf (mantissa 0) or NaN (IEEE, CPD's eXmY, E5M2)
  kNanOnly = 2,    // only S.1..1.1..1 is NaN, no Inf (OCP E4M3)
};

// An unscaled floating-point grid. Values: +-m * 2^(emin - mbits) for 0 <= m < 2^mbits
// (subnormals) and +-(1 + m / 2^mbits) * 2^e for emin <= e, capped at the largest finite code.
// Requires -126 <= emin and max <= FLT_MAX so that every grid point is a float32.
// Build with MakeFloatGrid.
struct FloatGrid {
  int32_t ebits;           // exponent field width X (1..8)
  int32_t mbits;           // mantissa field width M (0..23)
  int32_t emin;            // unbiased exponent of the smallest normal binade (1 - bias)
  float quantum;           // 2^(emin - mbits): the subnormal step
  float rne_magic;         // 2^(emin - mbits + 23): |y| + rne_magic rounds |y| to quanta
  uint32_t max_bits;       // float32 bits of the largest finite magnitude
  uint32_t max_code;       // its magnitude code
  uint32_t overflow_bits;  // magnitude that overflow and +-Inf inputs become (max, Inf or NaN)
  uint32_t overflow_code;
  uint32_t nan_bits;  // what a NaN input becomes (sign cleared): NaN, or +Inf / +max where the
  uint32_t nan_code;  // format has no NaN code (CUDA's FP6/FP4 conversions also give +max)
  NonFiniteStyle style;
  bool subnormals;  // false: results below 2^emin flush to +-0 (after rounding)
};

// q = clamp(round((x - offset) / scale), qmin, qmax); value = q * scale + offset.
// Codes are q - qmin (unsigned, fits in `bits`).
struct LinearGrid {
  float scale;   // > 0, or 0 for a constant tensor (then every value becomes `offset`)
  float offset;  // 0 for symmetric int<b>, min for uint<b>:minmax
  int32_t qmin;
  int32_t qmax;
};

CPD_HD uint32_t FloatBits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
CPD_HD float BitsFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

CPD_HD bool IsFinite(float f) { return (FloatBits(f) & 0x7fffffffu) < 0x7f800000u; }

// 2^e as a float32 for -149 <= e <= 127 (subnormal powers included).
CPD_HD float Pow2(int32_t e) {
  return e >= -126 ? BitsFloat(uint32_t(e + 127) << 23) : BitsFloat(1u << (e + 149));
}

// ---------------------------------------------------------------------------------------------
// The per-element statistics of a quantisation (cpd::QuantStats), one definition for every CPU
// loop (kernels/quantize_cpu.cc: quantise, blocks, hysteresis) and every CUDA kernel
// (kernels/cuda/): they are taken on the input x and the final output z, after any 2^s scaling,
// never on the scaled value x * 2^-s. (Taken on the scaled value, a nonzero x whose x * 2^-s
// underflows to 0, next to a huge outlier's shift, was flushed on the CPU and not on the GPU.)

// The finite values a grid gives after its scaling: [lo, hi]. Inputs outside are saturated.
struct GridRange {
  float lo;
  float hi;
};

// A float or per-binade grid whose largest finite magnitude has float32 bits max_bits, scaled
// by up = 2^s: hi = max * 2^s, the largest value the output can hold (Inf where that overflows).
CPD_HD GridRange ShiftedGridRange(uint32_t max_bits, float up) {
  const float hi = BitsFloat(max_bits) * up;
  return GridRange{-hi, hi};
}

// The definition, one predicate per statistic (scalars, so that the CPU's `omp simd` statistics
// pass vectorises them; a struct local there would become a per-lane array in memory):
// |x| as float32 bits for the max_abs reduction, NaN as 0 (Inf kept);
CPD_HD uint32_t StatAbsBits(float x) {
  const uint32_t a = FloatBits(x) & 0x7fffffffu;
  return a & (0u - uint32_t(a <= 0x7f800000u));
}
// x is NaN or +-Inf;
CPD_HD bool StatNonfinite(float x) { return (FloatBits(x) & 0x7fffffffu) >= 0x7f800000u; }
// x is +-Inf, or finite and outside the grid's range [lo, hi];
CPD_HD bool StatSaturated(float x, float lo, float hi) {
  const uint32_t a = FloatBits(x) & 0x7fffffffu;
  return a == 0x7f800000u || (a < 0x7f800000u && (x > hi || x < lo));
}
// x is finite and nonzero, z is zero;
CPD_HD bool StatFlushed(float x, float z) {
  const uint32_t a = FloatBits(x) & 0x7fffffffu;
  return a < 0x7f800000u && a != 0 && z == 0.0f;
}
// the squared error (z - x)^2 and the squared input x^2, in double, where x and z are finite
// (else 0).
CPD_HD bool StatMeasured(float x, float z) {
  return (FloatBits(x) & 0x7fffffffu) < 0x7f800000u && (FloatBits(z) & 0x7fffffffu) < 0x7f800000u;
}
CPD_HD double StatSqError(float x, float z) {
  const double d = StatMeasured(x, z) ? double(z) - double(x) : 0.0;
  return d * d;
}
CPD_HD double StatSqInput(float x, float z) {
  const double xd = StatMeasured(x, z) ? double(x) : 0.0;
  return xd * xd;
}

// All of them for one element: kernels::ElementStats' and cpd::QuantStats' fields.
struct ElementStat {
  uint32_t abs_bits;
  bool saturated, flushed, nonfinite;
  double sq_error, sq_input;
};

CPD_HD ElementStat StatOf(float x, float z, const GridRange& range) {
  return ElementStat{StatAbsBits(x),    StatSaturated(x, range.lo, range.hi),
                     StatFlushed(x, z), StatNonfinite(x),
                     StatSqError(x, z), StatSqInput(x, z)};
}

// ---------------------------------------------------------------------------------------------
// Counter-based random bits: a function of (key, index) only, so stochastic rounding gives the
// same result for any thread count, chunking, or CPU vs GPU. key = MakeRandomKey(seed, step).
//
// Stream version 2 (issue 17): element i takes 32-bit half (i & 1), low half first, of
// Mix64(key + (i >> 1) * kGolden64), i.e. of output i/2 + 1 of the SplitMix64 generator seeded
// with key. One 64-bit hash serves two elements, and a vector of 8 hashes fills 16 lanes in
// order, so the CPU loops generate the stream at memory speed (kernels/quantize_cpu.cc).
// Version 1 (two rounds of Wellons' lowbias32 per element) cost four 32-bit multiplies per
// element and held stochastic rounding to about a third of memcpy's speed. A checkpoint records
// the version it was written with.
constexpr int kRandomStreamVersion = 2;
constexpr uint64_t kGolden64 = 0x9e3779b97f4a7c15ull;  // SplitMix64's increment

// SplitMix64's output function (Steele, Lea, Flood 2014): a bijection with full avalanche.
CPD_HD uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

CPD_HD uint64_t SplitMix64(uint64_t z) { return Mix64(z + kGolden64); }

CPD_HD uint64_t MakeRandomKey(uint64_t seed, uint64_t step) {
  return SplitMix64(SplitMix64(seed) ^ step);
}

// The 64 random bits of pair p: elements 2p (low half) and 2p + 1 (high half). Kernels that
// round both elements of a pair hash once (the hash is most of stochastic rounding's work).
CPD_HD uint64_t RandomPairBits(uint64_t key, uint64_t pair) {
  return Mix64(key + pair * kGolden64);
}

CPD_HD uint32_t RandomBits(uint64_t key, uint64_t index) {
  const uint64_t z = RandomPairBits(key, index >> 1);
  return uint32_t(z >> ((index & 1u) * 32u));
}

// out[k] = RandomBits(key, first + k) for a run of kCount (even) elements, hashing each pair the
// run touches once: kCount / 2 hashes from an even `first`, kCount / 2 + 1 from an odd one (its
// first and last elements are halves of pairs it shares with its neighbours). Successive pairs'
// counters differ by kGolden64, so one multiply serves the run.
template <int kCount>
CPD_HD void RandomBitsRun(uint64_t key, uint64_t first, uint32_t (&out)[kCount]) {
  static_assert(kCount >= 2 && kCount % 2 == 0, "runs of whole pairs");
  uint64_t counter = key + (first >> 1) * kGolden64;
  if ((first & 1u) == 0) {
    CPD_UNROLL
    for (int k = 0; k < kCount; k += 2) {
      const uint64_t z = Mix64(counter);
      out[k] = uint32_t(z);
      out[k + 1] = uint32_t(z >> 32);
      counter += kGolden64;
    }
    return;
  }
  uint64_t z = Mix64(counter);
  out[0] = uint32_t(z >> 32);
  CPD_UNROLL
  for (int k = 1; k + 1 < kCount; k += 2) {
    counter += kGolden64;
    z = Mix64(counter);
    out[k] = uint32_t(z);
    out[k + 1] = uint32_t(z >> 32);
  }
  out[kCount - 1] = uint32_t(Mix64(counter + kGolden64));
}

// ---------------------------------------------------------------------------------------------
// Rounds y onto grid g. Returns the float32 bits of the result and writes its code
// (sign | magnitude code, sign at bit ebits + mbits) when `code` is non-null.
// `rnd` is used only by kStochastic.
template <RoundMode kMode>
CPD_HD uint32_t RoundToFloatGrid(float y, const FloatGrid& g, uint32_t rnd, uint32_t* code) {
  const uint32_t u = FloatBits(y);
  const uint32_t sign = u & 0x80000000u;
  const uint32_t a = u & 0x7fffffffu;
  const int32_t exp_field = int32_t(a >> 23);
  const int32_t exp_eff = exp_field > 0 ? exp_field : 1;
  const int32_t emin_field = g.emin + 127;  // >= 1
  const int32_t m = g.mbits;
  const bool normal_region = exp_field >= emin_field;
  const int32_t r0 = 23 - m;  // float32 mantissa bits below the grid's in the normal region
  uint32_t res, kq;
  if constexpr (kMode == RoundMode::kNearestEven) {
    // The hot path, without per-lane variable shifts. Normal region: round the float bits
    // (ties to even; a carry walks into the exponent). Subnormal region: the hardware rounds
    // |y| + C to a multiple of ulp(C) = 2^(emin - m), ties to even; k quanta = bits - bits(C).
    const uint32_t lsb = r0 > 0 ? (a >> r0) & 1u : 0u;
    const uint32_t half_m1 = r0 > 0 ? (1u << (r0 - 1)) - 1u : 0u;
    const uint32_t res_n = (a + half_m1 + lsb) & ~((1u << r0) - 1u);
    const uint32_t sum_bits = FloatBits(BitsFloat(a) + g.rne_magic);
    const uint32_t res_s = FloatBits(BitsFloat(sum_bits) - g.rne_magic);
    kq = sum_bits - FloatBits(g.rne_magic);
    res = normal_region ? res_n : res_s;
  } else {
    // Other modes round an integer: the float bits in the normal region, the significand in
    // the subnormal region. r = bits of it below the grid's quantum at |y|.
    const int32_t r = normal_region ? 23 - m : 23 - m + emin_field - exp_eff;
    const int32_t rc = r < 31 ? r : 31;
    const uint32_t sig = (a & 0x7fffffu) | (exp_field > 0 ? 0x800000u : 0u);
    const uint32_t v = normal_region ? a : sig;
    const uint32_t mask = (1u << rc) - 1u;

    bool toward_zero;
    if (kMode == RoundMode::kDown) {
      toward_zero = sign == 0;
    } else if (kMode == RoundMode::kUp) {
      toward_zero = sign != 0;
    } else {
      toward_zero = kMode == RoundMode::kTowardZero;
    }

    uint32_t inc;
    if (kMode == RoundMode::kStochastic) {
      inc = (rnd >> 1) >> (31 - rc);  // the top rc random bits
    } else {
      inc = toward_zero ? 0u : mask;
    }
    const uint32_t vr = (v + inc) & ~mask;

    kq = vr >> rc;  // subnormal region: number of quanta
    if (kMode == RoundMode::kStochastic) {
      // Far below the smallest quantum (r >= 32): round up with probability v / 2^r.
      const int32_t s = r - 32 < 31 ? r - 32 : 31;
      const uint32_t far_kq = rnd < (v >> (s > 0 ? s : 0)) ? 1u : 0u;
      kq = r >= 32 ? far_kq : kq;
    }
    const float sub_value = float(int32_t(kq)) * g.quantum;
    res = normal_region ? vr : FloatBits(sub_value);
  }

  // Codes, computed from the rounded magnitude before overflow/flush adjustments.
  const int32_t code_offset = (emin_field - 1) << m;
  uint32_t mag_code = normal_region ? uint32_t(int32_t(res >> r0) - code_offset) : kq;

  // Everything below is selects, not branches, so that the loops vectorise. Predicates are
  // taken from the rounded value before any replacement (a flushed value never overflows).
  const uint32_t flush_below = g.subnormals ? 0u : uint32_t(emin_field) << 23;
  const bool flush = res < flush_below;
  const bool overflow = res > g.max_bits;  // includes a carry into the float32 Inf pattern
  const bool is_nan = a > 0x7f800000u;
  res = flush ? 0u : res;
  mag_code = flush ? 0u : mag_code;
  // IEEE directed rounding: a finite value rounded toward zero never overflows to Inf.
  bool toward_zero_here = false;
  if constexpr (kMode == RoundMode::kTowardZero) toward_zero_here = true;
  if constexpr (kMode == RoundMode::kDown) toward_zero_here = sign == 0;
  if constexpr (kMode == RoundMode::kUp) toward_zero_here = sign != 0;
  const bool to_max = toward_zero_here && a < 0x7f800000u;
  res = overflow ? (to_max ? g.max_bits : g.overflow_bits) : res;  // NaN and Inf land here too
  mag_code = overflow ? (to_max ? g.max_code : g.overflow_code) : mag_code;
  res = is_nan ? g.nan_bits : res;
  mag_code = is_nan ? g.nan_code : mag_code;
  // What a NaN input becomes carries no sign. A NaN value is the one canonical NaN whatever made
  // it, an overflow that becomes NaN (e4m3:inf) too: -1000 must not give a negative NaN that,
  // quantised again, gives a positive one. Its code keeps the sign, as OCP's (and CUDA's)
  // conversions write it; every NaN code decodes to the canonical NaN.
  const uint32_t code_sign = is_nan ? 0u : sign;
  const uint32_t out_sign = res > 0x7f800000u ? 0u : code_sign;
  if (code != nullptr) *code = mag_code | (code_sign >> 31 << (g.ebits + m));
  return res | out_sign;
}

// Value of a code on grid g (the inverse of RoundToFloatGrid's code). Every NaN code, of either
// sign, decodes to the canonical quiet NaN 0x7fc00000.
CPD_HD float DecodeFloatGrid(uint32_t code, const FloatGrid& g) {
  const int32_t m = g.mbits;
  const uint32_t sign = (code >> (g.ebits + m)) & 1u;
  const uint32_t mag = code & ((1u << (g.ebits + m)) - 1u);
  const uint32_t exp_code = mag >> m;
  const uint32_t top_exp = (1u << g.ebits) - 1u;
  uint32_t bits;
  if (g.style == NonFiniteStyle::kIeee && exp_code == top_exp) {
    bits = (mag & ((1u << m) - 1u)) == 0 ? 0x7f800000u : 0x7fc00000u;
  } else if (g.style == NonFiniteStyle::kNanOnly && mag == (1u << (g.ebits + m)) - 1u) {
    bits = 0x7fc00000u;
  } else if (exp_code == 0) {
    bits = FloatBits(float(int32_t(mag)) * g.quantum);
  } else {
    bits = (mag << (23 - m)) + (uint32_t(g.emin + 127 - 1) << 23);
  }
  return BitsFloat(bits > 0x7f800000u ? bits : bits | (sign << 31));
}

// RoundToFloatGrid<kStochastic>'s per-grid quantities, derived once: the CPU's vector lanes
// (kernels/stochastic_lanes.inc) and the CUDA kernels round with these instead of deriving them
// per element.
struct StochasticGridConsts {
  FloatGrid grid;  // for the elements before and after whole vectors
  int32_t r0, emin_field, inc_shift, code_offset, sign_shift;
  uint32_t keep_mask, flush_below, max_bits, overflow_bits, nan_bits, overflow_code, nan_code;
  uint32_t quantum_exp_bits;  // (emin - mbits) << 23: multiplies a float by the quantum
  uint32_t subnormal_shift;   // emin - mbits + 149: kq << it = bits of kq quanta below 2^-126
  uint32_t normal_from_kq;    // the least kq >= 1 whose kq quanta are a normal float32
  uint32_t overflow_sign;     // the sign bit's mask on an overflow: 0 where it becomes NaN

  StochasticGridConsts() = default;
  CPD_HD explicit StochasticGridConsts(const FloatGrid& g)
      : grid(g),
        r0(23 - g.mbits),
        emin_field(g.emin + 127),
        inc_shift(31 - r0),
        code_offset((emin_field - 1) << g.mbits),
        sign_shift(g.ebits + g.mbits),
        keep_mask(~((1u << r0) - 1u)),
        flush_below(g.subnormals ? 0u : uint32_t(emin_field) << 23),
        max_bits(g.max_bits),
        overflow_bits(g.overflow_bits),
        nan_bits(g.nan_bits),
        overflow_code(g.overflow_code),
        nan_code(g.nan_code),
        quantum_exp_bits(uint32_t(g.emin - g.mbits) << 23),
        subnormal_shift(uint32_t(g.emin - g.mbits + 149)),
        normal_from_kq(g.emin - g.mbits >= -126 ? 1u : 1u << (-126 - (g.emin - g.mbits))),
        overflow_sign(g.overflow_bits > 0x7f800000u ? 0u : 0x80000000u) {}
};

// The top k bits of x as an integer, x >> (32 - k), for 0 <= k <= 31 (0 for k = 0): one funnel
// shift on a GPU.
CPD_HD uint32_t TopBits(uint32_t x, uint32_t k) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_l(x, 0u, k);
#else
  return uint32_t((uint64_t(x) << k) >> 32);
#endif
}

// RoundToFloatGrid<kStochastic>(y, c.grid, rnd, code), bit for bit, for the CUDA kernels, whose
// stochastic rounding is bound by the GPU's half-rate integer pipe: the vector lanes' form
// (stochastic_lanes.inc says why each step is exact) with its integer instructions counted. The
// normal region adds the top r0 random bits and clears them with one mask; the subnormal
// region's kq quanta are kq's float times the quantum, as in the general function (a float-pipe
// multiply, exact: a multiple of 2^-149 below 2^24 quanta; the lanes build those bits with
// integers because x86 takes a microcode assist per subnormal product); the sign is or'ed in
// once. About 26 integer instructions per element in an sm_90 loop where the general function
// takes about 39. tests/kernels/grid_test.cc holds this to the general function.
CPD_HD uint32_t RoundToFloatGridStochastic(float y, const StochasticGridConsts& c, uint32_t rnd,
                                           uint32_t* code) {
  const uint32_t u = FloatBits(y);
  const uint32_t a = u & 0x7fffffffu;
  const uint32_t sign = u ^ a;
  const int32_t exp_field = int32_t(a >> 23);
  const bool normal = exp_field >= c.emin_field;
  // The top k bits of rnd >> 1 are the top k bits of rnd: (rnd >> 1) >> (31 - k).
  const uint32_t res_normal = (a + TopBits(rnd, uint32_t(c.r0))) & c.keep_mask;
  const int32_t exp_eff = exp_field > 1 ? exp_field : 1;
  const int32_t r = c.r0 + c.emin_field - exp_eff;
  // r >= 0 wherever kq is used (the subnormal region); a normal element's negative r clamps to
  // 31 as an unsigned count, which keeps its unused shifts in range.
  const uint32_t rc = uint32_t(r) < 31u ? uint32_t(r) : 31u;
  // The significand with its implicit bit, a - (exp_eff - 1) * 2^23: a multiply-add and an add
  // where the mask, or and select took three integer instructions and a compare.
  const uint32_t sig = a - (uint32_t(exp_eff - 1) << 23);
  const uint32_t kq_near = (sig + TopBits(rnd, rc)) >> rc;
  const uint32_t beyond_32 = uint32_t(r - 32);  // wraps to a huge count where r < 32
  const uint32_t far_shift = beyond_32 < 31u ? beyond_32 : 31u;
  const uint32_t kq_far = rnd < (sig >> far_shift) ? 1u : 0u;
  const uint32_t kq = r >= 32 ? kq_far : kq_near;
  const uint32_t res_sub = FloatBits(float(int32_t(kq)) * c.grid.quantum);
  const uint32_t res = normal ? res_normal : res_sub;
  const bool flush = res < c.flush_below;
  const bool overflow = res > c.max_bits;
  const bool is_nan = a > 0x7f800000u;
  if (code != nullptr) {
    uint32_t mag = normal ? uint32_t(int32_t(res >> c.r0) - c.code_offset) : kq;
    mag = flush ? 0u : mag;
    mag = overflow ? c.overflow_code : mag;
    mag = is_nan ? c.nan_code : mag;
    *code = mag | ((is_nan ? 0u : sign) >> 31 << c.sign_shift);
  }
  // The sign goes with every result but a NaN: a NaN input's (nan_bits, unsigned even where it is
  // a number) and an overflow that becomes NaN. A rounded or flushed value is finite.
  uint32_t out = flush ? sign : (res | sign);
  out = overflow ? (c.overflow_bits | (sign & c.overflow_sign)) : out;
  return is_nan ? c.nan_bits : out;
}

// Builds a grid of 1 sign, `ebits` exponent and `mbits` mantissa bits with exponent bias `bias`.
// overflow_to_nonfinite: overflow (and +-Inf) become Inf, or NaN where the style has no Inf
// (only meaningful for kIeee and kNanOnly); otherwise they saturate to +-max.
inline FloatGrid MakeFloatGrid(int32_t ebits, int32_t mbits, int32_t bias, NonFiniteStyle style,
                               bool subnormals, bool overflow_to_nonfinite) {
  FloatGrid g{};
  g.ebits = ebits;
  g.mbits = mbits;
  g.emin = 1 - bias;
  g.quantum = Pow2(g.emin - mbits);
  g.rne_magic = Pow2(g.emin - mbits + 23);
  g.style = style;
  g.subnormals = subnormals;
  const uint32_t all_ones = (1u << (ebits + mbits)) - 1u;
  const uint32_t mant_ones = (1u << mbits) - 1u;
  switch (style) {
    case NonFiniteStyle::kAllFinite:
      g.max_code = all_ones;
      break;
    case NonFiniteStyle::kIeee:
      g.max_code = (((1u << ebits) - 2u) << mbits) | mant_ones;
      break;
    case NonFiniteStyle::kNanOnly:
      g.max_code = all_ones - 1u;
      break;
  }
  g.max_bits = FloatBits(DecodeFloatGrid(g.max_code, g));
  g.overflow_bits = g.max_bits;
  g.overflow_code = g.max_code;
  g.nan_bits = g.max_bits;
  g.nan_code = g.max_code;
  if (style == NonFiniteStyle::kIeee) {
    const uint32_t inf_code = ((1u << ebits) - 1u) << mbits;
    if (overflow_to_nonfinite) {
      g.overflow_bits = 0x7f800000u;
      g.overflow_code = inf_code;
    }
    // Without a mantissa bit there is no NaN code: NaN becomes what overflow becomes (+Inf with
    // :inf, +max when saturating), so that quantising twice changes nothing.
    g.nan_bits = mbits > 0 ? 0x7fc00000u : g.overflow_bits;
    g.nan_code = mbits > 0 ? all_ones : g.overflow_code;
  } else if (style == NonFiniteStyle::kNanOnly) {
    if (overflow_to_nonfinite) {
      g.overflow_bits = 0x7fc00000u;
      g.overflow_code = all_ones;
    }
    g.nan_bits = 0x7fc00000u;
    g.nan_code = all_ones;
  }
  return g;
}

// How a shared power-of-two shift is chosen from a group's largest finite magnitude:
// shift = clamp(floor(log2 max_abs) + offset, lo, hi); a group of zeros gets lo.
struct ShiftRule {
  int32_t offset;
  int32_t lo;
  int32_t hi;
};

CPD_HD int32_t FloorLog2(float x) {  // x > 0 and finite
  const uint32_t a = FloatBits(x) & 0x7fffffffu;
  if (a >= 0x00800000u) return int32_t(a >> 23) - 127;
  int32_t e = -127;
  for (uint32_t m = a; m >= 2u; m >>= 1) ++e;  // subnormal: position of the top bit
  return e - 22;
}

CPD_HD int32_t ShiftForMax(float max_abs, const ShiftRule& r) {
  if (!(max_abs > 0.0f)) return r.lo;
  int32_t s = FloorLog2(max_abs) + r.offset;
  s = s < r.lo ? r.lo : s;
  return s > r.hi ? r.hi : s;
}

// ---------------------------------------------------------------------------------------------
// Block scales that are not powers of two (cpd::FormatFamily::kBlockScaled): each block of a
// float element grid has an encode factor `enc` and decode factors `dec`, `dec2`; an element
// becomes code q = round(x * enc) on the grid and value (q * dec) * dec2. Products are float32,
// correctly rounded, never fused (-ffp-contract=off; __fmul_rn on the GPU).
//  * float32 scales (DeepSeek-V3's tiles and blocks): enc = elem_max / amax, dec = 1 / enc,
//    dec2 = 1; a block of zeros (amax 0) gets enc = dec = 1.
//  * scales on a float grid S (NVFP4: E4M3), optionally under a float32 tensor level, as NVIDIA
//    documents NVFP4's quantisation (Transformer Engine's reference kernels): the tensor's encode
//    scale T = min(S_max * elem_max / amax_tensor, FLT_MAX) (1 where that is 0 or amax_tensor is
//    0; T = 1 without a tensor level); the block's scale sb = S(amax_b * (T * (1 / elem_max))),
//    rounded to nearest and saturating; enc = min(1 / (sb * (1 / T)), FLT_MAX), dec = sb,
//    dec2 = 1 / T. A scale that underflows to 0 makes enc = FLT_MAX and the block's values 0.
// (Power-of-two scales are shifts: ShiftRule above, MX's E8M0.)
struct BlockScale {
  float enc;
  float dec;
  float dec2;
};

constexpr float kFloat32Max = 3.40282346638528859812e38f;

CPD_HD float MinFloat(float a, float b) { return b < a ? b : a; }

CPD_HD BlockScale Float32BlockScale(float amax, float elem_max) {
  if (!(amax > 0.0f)) return BlockScale{1.0f, 1.0f, 1.0f};
  const float enc = MinFloat(elem_max / amax, kFloat32Max);
  return BlockScale{enc, 1.0f / enc, 1.0f};
}

// The tensor level's encode scale T (1 without a tensor level: pass amax_tensor = 0).
CPD_HD float TensorEncodeScale(float amax_tensor, float scale_max, float elem_max) {
  if (!(amax_tensor > 0.0f)) return 1.0f;
  const float t = MinFloat(scale_max * elem_max / amax_tensor, kFloat32Max);
  return t == 0.0f ? 1.0f : t;
}

// The float32 bits of a block's scale sb on grid `sg` (its code in *code).
CPD_HD uint32_t BlockScaleBits(float amax, float tensor_enc, float elem_max, const FloatGrid& sg,
                               uint32_t* code) {
  const float inv_elem_max = 1.0f / elem_max;
  return RoundToFloatGrid<RoundMode::kNearestEven>(amax * (tensor_enc * inv_elem_max), sg, 0u,
                                                   code);
}

CPD_HD BlockScale GridBlockScale(float sb, float tensor_enc) {
  const float tensor_dec = 1.0f / tensor_enc;
  return BlockScale{MinFloat(1.0f / (sb * tensor_dec), kFloat32Max), sb, tensor_dec};
}

// A power-of-two scale 2^shift (MX's E8M0) as a BlockScale, for code that handles every block
// scale alike (the CUDA kernels): x * 2^-shift and q * 2^shift are the shift path's products,
// and dec2 = 1 changes no value, so RoundScaled under it equals the shift path bit for bit.
CPD_HD BlockScale Pow2BlockScale(int32_t shift) {
  return BlockScale{Pow2(-shift), Pow2(shift), 1.0f};
}

#if defined(__CUDA_ARCH__)
// r, or where r is NaN the NaN x86 gives for the operands a, b: a NaN operand quieted (a's
// first), else (Inf * 0, Inf - Inf) the default NaN 0xffc00000.
CPD_HD float NanAsX86(float r, float a, float b) {
  if ((FloatBits(r) & 0x7fffffffu) <= 0x7f800000u) return r;
  const uint32_t ua = FloatBits(a), ub = FloatBits(b);
  if ((ua & 0x7fffffffu) > 0x7f800000u) return BitsFloat(ua | 0x00400000u);
  if ((ub & 0x7fffffffu) > 0x7f800000u) return BitsFloat(ub | 0x00400000u);
  return BitsFloat(0xffc00000u);
}
#endif

// a * b, with the NaN that the CPU's x86 multiply gives on the GPU too: a NaN operand comes back
// quieted (a's first) and Inf * 0 is x86's default NaN 0xffc00000, where the GPU's multiply
// returns its one canonical NaN. A block's decode factor may be 0 (a scale that underflowed)
// under an element grid with Inf, and a NaN code decodes to a NaN that the factors multiply.
CPD_HD float MulAsX86(float a, float b) {
#if defined(__CUDA_ARCH__)
  return NanAsX86(__fmul_rn(a, b), a, b);
#else
  return a * b;
#endif
}

// a + b and a - b with the NaN of the CPU's x86 add and subtract on the GPU too (MulAsX86's
// rules): a NaN operand comes back quieted (a's first), and Inf - Inf is x86's default NaN
// 0xffc00000, where the GPU returns its one canonical NaN. Both correctly rounded, never fused.
CPD_HD float AddAsX86(float a, float b) {
#if defined(__CUDA_ARCH__)
  return NanAsX86(__fadd_rn(a, b), a, b);
#else
  return a + b;
#endif
}

CPD_HD float SubAsX86(float a, float b) {
#if defined(__CUDA_ARCH__)
  return NanAsX86(__fsub_rn(a, b), a, b);
#else
  return a - b;
#endif
}

// The value of grid value v (a code decoded) under block scale s: (v * dec) * dec2.
CPD_HD float ScaledValue(float v, const BlockScale& s) {
  return MulAsX86(MulAsX86(v, s.dec), s.dec2);
}

// The float32 bits of round(x * enc) on grid g, scaled back (ScaledValue); its code in *code.
template <RoundMode kMode>
CPD_HD uint32_t RoundScaled(float x, const FloatGrid& g, const BlockScale& s, uint32_t rnd,
                            uint32_t* code) {
  const uint32_t q = RoundToFloatGrid<kMode>(x * s.enc, g, rnd, code);
  return FloatBits(ScaledValue(BitsFloat(q), s));
}

// The statistics' range of a block: the grid's largest value, scaled back.
CPD_HD GridRange ScaledGridRange(uint32_t max_bits, const BlockScale& s) {
  const float hi = ScaledValue(BitsFloat(max_bits), s);
  return GridRange{-hi, hi};
}

// ---------------------------------------------------------------------------------------------
// Linear grids. Division, not multiplication by a reciprocal, so the quotient is correctly
// rounded on both CPU and GPU; products and sums are never contracted into FMAs (the build
// passes -ffp-contract=off, the CUDA code uses __fmul_rn/__fadd_rn).
// floor(v) for |v| < 2^31, as a conversion (which vectorises) rather than floorf.
CPD_HD float FloorSmall(float v) {
  const float tr = float(int32_t(v));
  return tr > v ? tr - 1.0f : tr;
}

// The grids of the integer formats, chosen from a group's data (both CPU and GPU use these).
// int<b>: q in [-qmax, qmax], scale = max|x| / qmax (a correctly rounded division).
CPD_HD LinearGrid SymmetricIntGrid(float max_abs, int32_t qmax) {
  return LinearGrid{max_abs / float(qmax), 0.0f, -qmax, qmax};
}

// uint<b>:minmax (CPT): q in [0, qmax], scale = (hi - lo) / qmax, offset lo. A group with no
// finite element (lo > hi) becomes the constant 0; a range too wide for float32 arithmetic
// is divided in double.
CPD_HD LinearGrid MinMaxGrid(float lo, float hi, int32_t qmax) {
  if (!(lo <= hi)) lo = hi = 0.0f;
  float scale = (hi - lo) / float(qmax);
  if (!IsFinite(scale)) scale = float((double(hi) - double(lo)) / double(qmax));
  return LinearGrid{scale, lo, 0, qmax};
}

// The value of level q; a constant tensor (scale 0) maps everything to its offset.
CPD_HD float LinearValue(int32_t q, const LinearGrid& g) {
#if defined(__CUDA_ARCH__)
  return g.scale == 0.0f ? g.offset : __fadd_rn(__fmul_rn(float(q), g.scale), g.offset);
#else
  return g.scale == 0.0f ? g.offset : float(q) * g.scale + g.offset;
#endif
}

// The statistics' range of a linear grid: its lowest and highest levels.
CPD_HD GridRange LinearGridRange(const LinearGrid& g) {
  return GridRange{LinearValue(g.qmin, g), LinearValue(g.qmax, g)};
}

template <RoundMode kMode>
CPD_HD float RoundToLinearGrid(float x, const LinearGrid& g, uint32_t rnd, int32_t* q_out) {
  const uint32_t a = FloatBits(x) & 0x7fffffffu;
  const bool is_nan = a > 0x7f800000u;
  const float fmin = float(g.qmin), fmax = float(g.qmax);
  // Branch-free for the vectoriser: a NaN input is swapped for the offset up front (and replaced
  // by +max below), the division is unconditional (by 1 for a constant tensor), and t is
  // clamped (a no-op for the result, which is clamped anyway) so that it fits an int32 and
  // floor/ceil/trunc become conversions.
  const float xs = is_nan ? g.offset : x;
  const float divisor = g.scale > 0.0f ? g.scale : 1.0f;
  float t = (xs - g.offset) / divisor;
  t = g.scale > 0.0f ? t : 0.0f;
  t = t < fmin - 1.0f ? fmin - 1.0f : t;
  t = t > fmax + 1.0f ? fmax + 1.0f : t;
  float rq;
  if constexpr (kMode == RoundMode::kNearestEven) {
    rq = rintf(t);  // default rounding mode: ties to even
  } else if constexpr (kMode == RoundMode::kStochastic) {
    // floor(t + u), u uniform in [0, 1) at 24-bit resolution: up with probability frac(t).
    const float v = t + float(int32_t(rnd >> 8)) * 5.9604644775390625e-8f;  // 2^-24
    rq = FloorSmall(v);
  } else if constexpr (kMode == RoundMode::kTowardZero) {
    rq = float(int32_t(t));
  } else if constexpr (kMode == RoundMode::kDown) {
    rq = FloorSmall(t);
  } else {
    rq = -FloorSmall(-t);
  }
  // rq is finite and within [qmin - 2, qmax + 2]: clamp as integers (vectorises cleanly).
  int32_t q = int32_t(rq);
  q = q < g.qmin ? g.qmin : q;
  q = q > g.qmax ? g.qmax : q;
  q = is_nan ? g.qmax : q;  // no NaN code: NaN becomes +max, as CUDA's FP6/FP4 conversions do
  if (q_out != nullptr) *q_out = q;
  return LinearValue(q, g);
}

// ---------------------------------------------------------------------------------------------
// Scale metadata of packed tensors (cpd::PackedTensor), one home for the CPU codec
// (cpd/quantize.cc) and the CUDA one (kernels/cuda/codec.cu), so that their bytes agree.
// Shifted formats store one byte per group: MX the E8M0 scale byte (the scale is
// 2^(byte - 127), OCP MX v1.0), every other format the shift as a two's-complement int8 (every
// ShiftRule keeps shifts in -127..127). Linear grids store little-endian float32s at any
// alignment: int<b> its scale, uint<b>:minmax its offset (the minimum) and then its scale.
CPD_HD uint8_t ShiftMetaByte(int32_t shift, bool e8m0) {
  return e8m0 ? uint8_t(shift + 127) : uint8_t(int8_t(shift));
}
CPD_HD int32_t ShiftFromMetaByte(uint8_t byte, bool e8m0) {
  return e8m0 ? int32_t(byte) - 127 : int32_t(int8_t(byte));
}

CPD_HD void StoreLinearMeta(const LinearGrid& g, bool minmax, uint8_t* dst) {
  if (minmax) {
    memcpy(dst, &g.offset, 4);
    memcpy(dst + 4, &g.scale, 4);
  } else {
    memcpy(dst, &g.scale, 4);
  }
}

// The grid of a group of int<bits> (minmax false) or uint<bits>:minmax.
CPD_HD LinearGrid LoadLinearMeta(const uint8_t* src, bool minmax, int32_t bits) {
  LinearGrid g{0.0f, 0.0f, 0, 0};
  if (minmax) {
    memcpy(&g.offset, src, 4);
    memcpy(&g.scale, src + 4, 4);
    g.qmax = (1 << bits) - 1;
  } else {
    memcpy(&g.scale, src, 4);
    g.qmax = (1 << (bits - 1)) - 1;
    g.qmin = -g.qmax;
  }
  return g;
}

// Block-scaled formats (cpd::FormatFamily::kBlockScaled) store, per block in block order, the
// E8M0 byte of a power-of-two scale (ShiftMetaByte), the float32 decode scale (scale=fp32) or
// the little-endian code of a scale on a float grid (`bytes` of them), and then, with a tensor
// level, its float32 encode scale; float32s little-endian at any alignment, as above.
CPD_HD void StoreFloatMeta(float v, uint8_t* dst) { memcpy(dst, &v, 4); }
CPD_HD float LoadFloatMeta(const uint8_t* src) {
  float v;
  memcpy(&v, src, 4);
  return v;
}
CPD_HD void StoreCodeMeta(uint32_t code, int32_t bytes, uint8_t* dst) {
  for (int32_t k = 0; k < bytes; ++k) dst[k] = uint8_t(code >> (8 * k));
}
CPD_HD uint32_t LoadCodeMeta(const uint8_t* src, int32_t bytes) {
  uint32_t code = 0;
  for (int32_t k = 0; k < bytes; ++k) code |= uint32_t(src[k]) << (8 * k);
  return code;
}

// ---------------------------------------------------------------------------------------------
// Per-binade grids (Lee, Park, Jeon, ICLR 2022, whose candidate formats the authors' code
// describes this way): M_i mantissa bits in binade i, i = 0..L-1 from the top down. Unscaled,
// binade i is [2^-i, 2^(1-i)) with the 2^M_i values (1 + k / 2^M_i) * 2^-i, k < 2^M_i; below
// the lowest binade there is only 0, so a list ending in 0 has gradual underflow (its lowest
// value is the one step above zero) and a list ending in M > 0 has a gap to zero.
// Magnitude codes: 0 is zero, then the values in ascending order, so the first value of binade
// i has code first_i = 1 + sum_{j > i} 2^M_j and the largest code is sum_i 2^M_i.
// A float with gradual underflow is the list (M x (2^E - 1), M-1, ..., 1, 0): fp134 is
// 4x7,3,2,1,0 with the same values and codes.
constexpr int32_t kMaxBinades = 127;  // keeps every binade's values normal float32 numbers

struct BinadeGrid {
  int32_t count;       // L, 1..kMaxBinades
  int32_t sign_shift;  // the sign's bit in a code: bits - 1
  uint32_t max_bits;   // float32 bits of the largest value, 2 - 2^-M_0
  uint32_t max_code;   // its magnitude code, sum 2^M_i
  float quantum;       // 2^-(L-1): the lowest value, the one step above zero
  // Binade i: M_i in bits 0..7, first_i in bits 8..31 (one 32-bit gather per element).
  uint32_t binade[kMaxBinades];
};

CPD_HD uint32_t BinadeMbits(const BinadeGrid& g, int32_t i) { return g.binade[i] & 0xffu; }
CPD_HD uint32_t BinadeFirstCode(const BinadeGrid& g, int32_t i) { return g.binade[i] >> 8; }

// Sign bit plus enough bits for codes 0..sum 2^M_i: 1 + ceil(log2(1 + sum_i 2^M_i)); fp134's
// list (sum 127) gives 8. `mbits` may hold up to 127 entries of 0..22 (so the sum fits).
inline int32_t BinadeBits(const int32_t* mbits, int32_t count) {
  uint64_t codes = 1;  // zero
  for (int32_t i = 0; i < count; ++i) codes += uint64_t(1) << mbits[i];
  int32_t mag_bits = 0;
  while ((uint64_t(1) << mag_bits) < codes) ++mag_bits;
  return 1 + mag_bits;
}

// The grid of a list the caller has checked: 1 <= count <= kMaxBinades, 0 <= mbits[i] <= 22,
// BinadeBits(mbits, count) <= 16.
inline BinadeGrid MakeBinadeGrid(const int32_t* mbits, int32_t count) {
  BinadeGrid g{};
  g.count = count;
  g.sign_shift = BinadeBits(mbits, count) - 1;
  uint32_t first = 1;
  for (int32_t i = count - 1; i >= 0; --i) {
    g.binade[i] = uint32_t(mbits[i]) | (first << 8);
    first += 1u << mbits[i];
  }
  g.max_code = first - 1;
  g.max_bits = (127u << 23) | (((1u << mbits[0]) - 1u) << (23 - mbits[0]));
  g.quantum = Pow2(1 - count);
  return g;
}

// Rounds y onto grid g: RoundToFloatGrid's contract (float32 bits returned, sign | magnitude
// code in *code with the sign at bit g.sign_shift) for a grid whose codes are
// all finite: overflow, +-Inf and every directed mode saturate to +-max; NaN becomes +max and
// counts as non-finite.
//
// Each mode rounds the significand sig of |y| as RoundToFloatGrid does, with r = the bits of
// sig below the grid's step at |y|. Inside binade i (exponent field 127 - i) r = 23 - M_i, and a
// carry out of the mantissa lands on the next binade's first value (or on 2, which overflows).
// Below the lowest binade (exponent field < 128 - L) r = 23 + (128 - L) - max(exponent field, 1):
// FloatGrid's subnormal region with quantum 2^-(L-1) and M = 0, so fp134/fp143/fp152 round
// identically, stochastic bits included (up iff the low r bits of sig plus the top r bits of
// rnd >> 1 carry; for r >= 32, up iff rnd < sig / 2^(r-32)).
// Ties go to the even *code* (code_lo's parity), not to float-bit RNE's even last kept bit: in
// a 0-bit binade that bit is the exponent's LSB, and elsewhere the mantissa's LSB is the code's
// parity only when first_i is even (binades:3,3,3 has first_1 = 9; fp143's lowest binade has an
// even exponent field and code 1).
// Written with masks rather than selects on the region, which GCC would turn into branches (and
// then not vectorise); the one table lookup per element is a gather.
template <RoundMode kMode>
CPD_HD uint32_t RoundToBinadeGrid(float y, const BinadeGrid& g, uint32_t rnd, uint32_t* code) {
  const uint32_t u = FloatBits(y);
  const uint32_t sign = u & 0x80000000u;
  const uint32_t a = u & 0x7fffffffu;
  const int32_t exp_field = int32_t(a >> 23);
  const int32_t low_field = 128 - g.count;  // the lowest binade's exponent field, >= 1
  // All ones inside the binades and above them (where everything overflows), zero below.
  const uint32_t in_mask = 0u - uint32_t(exp_field >= low_field);
  int32_t i = 127 - exp_field;
  i = i < 0 ? 0 : i;
  i = i > g.count - 1 ? g.count - 1 : i;
  const uint32_t entry = g.binade[i] & in_mask;  // below: M = 0, first code 0
  const int32_t exp_eff = exp_field > 0 ? exp_field : 1;
  const int32_t below = low_field - exp_eff;  // > 0 only below the lowest binade
  const int32_t r = 23 - int32_t(entry & 0xffu) + (below > 0 ? below : 0);  // >= 1
  const int32_t rc = r < 31 ? r : 31;
  const uint32_t mant = a & 0x7fffffu;
  const uint32_t sig = mant | (exp_field > 0 ? 0x800000u : 0u);
  const uint32_t mask = (1u << rc) - 1u;
  // Code of |y| truncated onto the grid (below the lowest binade 0: rc >= 24 clears mant).
  const uint32_t code_lo = (entry >> 8) + (mant >> rc);

  bool toward_zero;
  if (kMode == RoundMode::kDown) {
    toward_zero = sign == 0;
  } else if (kMode == RoundMode::kUp) {
    toward_zero = sign != 0;
  } else {
    toward_zero = kMode == RoundMode::kTowardZero;
  }
  uint32_t inc;
  if (kMode == RoundMode::kNearestEven) {
    inc = (mask >> 1) + (code_lo & 1u);  // half - 1, plus 1 when the lower code is odd
  } else if (kMode == RoundMode::kStochastic) {
    inc = (rnd >> 1) >> (31 - rc);  // the top rc random bits, as RoundToFloatGrid
  } else {
    inc = toward_zero ? 0u : mask;
  }
  uint32_t up = ((sig & mask) + inc) >> rc;  // the carry: 0 or 1
  if (kMode == RoundMode::kStochastic) {
    // Far below the smallest step (r >= 32): up with probability sig / 2^r.
    const int32_t s = r - 32 < 31 ? r - 32 : 31;
    const uint32_t far_up = rnd < (sig >> (s > 0 ? s : 0)) ? 1u : 0u;
    up = r >= 32 ? far_up : up;
  }
  const uint32_t res_in = (a & ~mask) + (up << rc);  // a carry walks into the exponent
  const uint32_t res_below = FloatBits(g.quantum) & (0u - up);
  uint32_t res = (res_in & in_mask) | (res_below & ~in_mask);
  uint32_t mag_code = code_lo + up;

  // As RoundToFloatGrid for an all-finite grid. The value below the lowest binade never
  // overflows; +-Inf and NaN inputs do (NaN's sign is cleared below).
  const bool overflow = res > g.max_bits;
  const bool is_nan = a > 0x7f800000u;
  res = overflow ? g.max_bits : res;
  mag_code = overflow ? g.max_code : mag_code;
  const uint32_t out_sign = is_nan ? 0u : sign;
  if (code != nullptr) *code = mag_code | (out_sign >> 31 << g.sign_shift);
  return res | out_sign;
}

// Value of a code on grid g (the inverse of RoundToBinadeGrid's code). Magnitude codes above
// max_code, which no rounding produces, decode to NaN so that corrupt input shows.
CPD_HD float DecodeBinadeGrid(uint32_t code, const BinadeGrid& g) {
  const uint32_t sign = (code >> g.sign_shift) & 1u;
  const uint32_t mag = code & ((1u << g.sign_shift) - 1u);
  // First codes fall as i grows: c = the number of binades whose first code is above mag, so
  // mag lies in binade c (c = L: mag is 0). Seven halving steps cover L <= 127.
  int32_t c = 0;
  for (int32_t step = 64; step > 0; step >>= 1) {
    const int32_t j = c + step;
    c = j <= g.count && BinadeFirstCode(g, j - 1) > mag ? j : c;
  }
  const int32_t i = c < g.count ? c : g.count - 1;
  const uint32_t m = BinadeMbits(g, i);
  const uint32_t bits = (uint32_t(127 - i) << 23) + ((mag - BinadeFirstCode(g, i)) << (23 - m));
  uint32_t out = c < g.count ? bits : 0u;
  out = mag > g.max_code ? 0x7fc00000u : out;
  return BitsFloat(out | (sign << 31));
}

}  // namespace cpd::kernels
