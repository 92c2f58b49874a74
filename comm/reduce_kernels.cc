#include "comm/reduce_kernels.h"

#include <algorithm>
#include <cstring>

#include "cpd/quantize.h"

// Multi-versioned like kernels/quantize_cpu.cc: the loader picks AVX-512, AVX2 or baseline.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CPD_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define CPD_CLONES
#endif
#define CPD_INLINE inline __attribute__((always_inline))

namespace cpd::comm::internal {
namespace {

CPD_INLINE std::uint32_t Bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// One loop per code width GCC can vectorise (table lookups become gathers); `fn(i, value)`.
template <typename Fn>
CPD_INLINE void ForEachDecoded(const std::uint8_t* src, std::size_t n, int bits, const float* lut,
                               Fn&& fn) {
  if (bits == 8) {
    for (std::size_t i = 0; i < n; ++i) fn(i, lut[src[i]]);
  } else if (bits == 4) {
    const std::size_t pairs = n / 2;
    for (std::size_t j = 0; j < pairs; ++j) {
      const std::uint8_t b = src[j];
      fn(2 * j, lut[b & 0xfu]);
      fn(2 * j + 1, lut[b >> 4]);
    }
    if (n % 2 != 0) fn(n - 1, lut[src[pairs] & 0xfu]);
  } else if (bits == 16) {
    for (std::size_t i = 0; i < n; ++i) {
      fn(i, lut[std::uint32_t(src[2 * i]) | (std::uint32_t(src[2 * i + 1]) << 8)]);
    }
  } else {
    // Other widths through a small buffer of unpacked codes.
    constexpr std::size_t kStep = 256;  // a multiple of 8: every step starts on a byte
    std::uint32_t codes[kStep];
    for (std::size_t s = 0; s < n; s += kStep) {
      const std::size_t len = std::min(kStep, n - s);
      UnpackCodes(src + s * std::size_t(bits) / 8, len, bits, codes);
      for (std::size_t i = 0; i < len; ++i) fn(s + i, lut[codes[i]]);
    }
  }
}

}  // namespace

CPD_CLONES
void ScanAbs(const float* x, std::size_t n, std::uint32_t* max_bits, std::uint64_t* nonzero) {
  std::uint32_t m = *max_bits;
  std::uint64_t nz = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t a = Bits(x[i]) & 0x7fffffffu;
    m = std::max(m, a);
    nz += a != 0;
  }
  *max_bits = m;
  *nonzero += nz;
}

CPD_CLONES
void CountFlushedSaturated(const float* x, const std::uint32_t* codes, std::size_t n, float scale,
                           std::uint32_t max_bits, std::uint32_t mag_mask, std::uint64_t* flushed,
                           std::uint64_t* saturated) {
  std::uint64_t fl = 0, sat = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t a = Bits(x[i]) & 0x7fffffffu;
    fl += a != 0 && (codes[i] & mag_mask) == 0;
    sat += (Bits(x[i] * scale) & 0x7fffffffu) > max_bits;
  }
  *flushed += fl;
  *saturated += sat;
}

CPD_CLONES
void DecodeLut(const std::uint8_t* src, std::size_t n, int bits, const float* lut, float* out) {
  ForEachDecoded(
      src, n, bits,
      lut, [out](std::size_t i, float v) __attribute__((always_inline)) { out[i] = v; });
}

CPD_CLONES
void DecodeLutAdd(const std::uint8_t* src, std::size_t n, int bits, const float* lut, float* acc) {
  ForEachDecoded(
      src, n, bits,
      lut, [acc](std::size_t i, float v) __attribute__((always_inline)) { acc[i] += v; });
}

}  // namespace cpd::comm::internal
