// Element loops of the quantised all-reduce (comm/allreduce/): scans for APS and the
// non-finite check, decoding of packed codes through a lookup table, statistics of a quantised
// span. Single-threaded over contiguous spans; the caller splits the work. Internal to comm/.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/grid.h"
#include "kernels/quantize_cpu.h"

namespace cpd::comm::internal {

// Over x[0, n): the largest |x| as float32 bits (with the sign cleared, NaN > Inf > every finite
// value, so a result >= 0x7f800000 means a non-finite element) and the number of nonzero elements
// (NaN and Inf included). Both are merged into the outputs (max, +=).
void ScanAbs(const float* x, std::size_t n, std::uint32_t* max_bits, std::uint64_t* nonzero);

// Float32 arithmetic between roundings of the all-reduce (the scaled formats' sums, Kahan's
// steps): out[i] = a[i] + b[i] (kAdd) or a[i] - b[i] (kSubtract); host and device back ends.
enum class ElementOp { kAdd, kSubtract };

// Rounds x[i] * scale (scale a power of two: the APS shift) onto grid g with p's rounding mode
// (nearest, stochastic or toward zero; the random stream as kernels::QuantizeFloatGrid's) and
// stores the codes, one per byte (EncodeCodes8, grids of <= 8 bits) or per uint16 (EncodeCodes16,
// <= 16 bits): the same codes as kernels::QuantizeFloatGrid(x, ..., shift = -log2(scale)).
// With stats non-null (two counters), also adds to stats[0] the nonzero x whose code has
// magnitude 0 (flushed) and to stats[1] those with |x * scale| above the largest finite value
// (saturated), as cpd::QuantStats counts them. finite = true promises that every x * scale is
// finite, which lets nearest-even rounding skip the Inf/NaN handling (about twice as fast).
void EncodeCodes8(const float* x, std::size_t n, float scale, const kernels::FloatGrid& g,
                  const kernels::LoopParams& p, std::uint8_t* codes, std::uint64_t* stats,
                  bool finite = false);
void EncodeCodes16(const float* x, std::size_t n, float scale, const kernels::FloatGrid& g,
                   const kernels::LoopParams& p, std::uint16_t* codes, std::uint64_t* stats,
                   bool finite = false);
// Packs n codes of `bits` bits (one per byte / uint16 as above) into dst, cpd::PackCodes' layout.
void PackSmallCodes(const std::uint8_t* codes, std::size_t n, int bits, std::uint8_t* dst);
void PackSmallCodes(const std::uint16_t* codes, std::size_t n, int bits, std::uint8_t* dst);

// How to turn a code of a fixed float grid back into its value with integer arithmetic (no table
// lookups: they do not vectorise, and gathers are slow). Equal to kernels::DecodeFloatGrid for
// every code (tests/comm/reduce_kernels_test.cc checks all of them).
struct CodeDecoder {
  int bits = 8;             // code width, 1..16
  std::uint32_t mbits = 3;  // mantissa bits
  std::uint32_t mag_mask = 0;
  std::uint32_t mant_mask = 0;
  std::uint32_t sign_shift = 0;  // ebits + mbits
  std::uint32_t exp_add = 0;     // (emin + 126) << 23: the float32 exponent of exponent code 0
  std::uint32_t top_exp = 0;     // exponent code of Inf/NaN (IEEE style)
  float quantum = 0;             // value of magnitude code 1 (the subnormal step)
  bool ieee = false;             // the top exponent code is Inf/NaN
  bool nan_only = false;         // only the all-ones magnitude is NaN (OCP E4M3)
};
CodeDecoder MakeCodeDecoder(const kernels::FloatGrid& g);

// Packed codes of `bits` bits (cpd::PackCodes' bit order) at src:
void DecodeCodes(const std::uint8_t* src, std::size_t n, const CodeDecoder& d, float* out);
void DecodeCodesAdd(const std::uint8_t* src, std::size_t n, const CodeDecoder& d,
                    float* acc);  // acc[i] += value
// out[i] = value * scale (scale a power of two: the APS shift undone)
void DecodeCodesScaled(const std::uint8_t* src, std::size_t n, const CodeDecoder& d, float scale,
                       float* out);

// Codes of a blocked format (MX, bfp): each block of `block` codes (a multiple of 8 elements; the
// last may be shorter) is scaled by 2^shift, shift from meta[b] (E8M0: meta - 127, else int8).
// out[i] = (value * 2^shift) * post, or out[i] += that with add.
void DecodeBlockCodes(const std::uint8_t* src, std::size_t n, const CodeDecoder& d,
                      const std::uint8_t* meta, std::size_t block, bool e8m0, float post, bool add,
                      float* out);
// Statistics of a blocked quantisation of y (= x * 2^s) with per-block shifts: flushed += nonzero
// x with code magnitude 0, saturated += |y| above max * 2^shift (cpd::QuantStats' definitions).
void CountBlockStats(const float* x, const float* y, const std::uint32_t* codes, std::size_t n,
                     std::size_t block, const std::int32_t* shifts, std::uint32_t max_bits,
                     std::uint32_t mag_mask, std::uint64_t* stats);

}  // namespace cpd::comm::internal
