// Element loops of the quantised all-reduce (comm/gradient_allreduce.cc): scans for APS and the
// non-finite check, decoding of packed codes through a lookup table, statistics of a quantised
// span. Single-threaded over contiguous spans; the caller splits the work. Internal to comm/.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cpd::comm::internal {

// Over x[0, n): the largest |x| as float32 bits (with the sign cleared, NaN > Inf > every finite
// value, so a result >= 0x7f800000 means a non-finite element) and the number of nonzero elements
// (NaN and Inf included). Both are merged into the outputs (max, +=).
void ScanAbs(const float* x, std::size_t n, std::uint32_t* max_bits, std::uint64_t* nonzero);

// Statistics of x[0, n) quantised to `codes` of a float grid after scaling by `scale`:
// flushed += nonzero x whose code has magnitude 0; saturated += |x * scale| above the grid's
// largest finite value (max_bits, float32 bits). mag_mask selects a code's magnitude bits.
void CountFlushedSaturated(const float* x, const std::uint32_t* codes, std::size_t n, float scale,
                           std::uint32_t max_bits, std::uint32_t mag_mask, std::uint64_t* flushed,
                           std::uint64_t* saturated);

// Packed codes of `bits` bits (1..16, cpd::PackCodes' bit order) at src, decoded through
// lut[code] (2^bits entries):
void DecodeLut(const std::uint8_t* src, std::size_t n, int bits, const float* lut, float* out);
void DecodeLutAdd(const std::uint8_t* src, std::size_t n, int bits, const float* lut,
                  float* acc);  // acc[i] += value

}  // namespace cpd::comm::internal
