#include "comm/reduce_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpd/quantize.h"
#include "kernels/quantize_cpu.h"

// Multi-versioned like kernels/quantize_cpu.cc: the loader picks AVX-512, AVX2 or baseline.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CPD_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define CPD_CLONES
#endif
#define CPD_INLINE inline __attribute__((always_inline))
#define CPD_LAMBDA_INLINE __attribute__((always_inline))

namespace cpd::comm::internal {
namespace {

CPD_INLINE std::uint32_t Bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

CPD_INLINE float DecodeOne(std::uint32_t c, const CodeDecoder& d) {
  const std::uint32_t mag = c & d.mag_mask;
  const std::uint32_t exp_code = mag >> d.mbits;
  const std::uint32_t normal = (mag << (23 - d.mbits)) + d.exp_add;
  const std::uint32_t sub = Bits(float(std::int32_t(mag)) * d.quantum);
  std::uint32_t b = exp_code == 0 ? sub : normal;
  const std::uint32_t special = (mag & d.mant_mask) == 0 ? 0x7f800000u : 0x7fc00000u;
  b = d.ieee && exp_code == d.top_exp ? special : b;
  b = d.nan_only && mag == d.mag_mask ? 0x7fc00000u : b;
  b |= b > 0x7f800000u ? 0u : (c >> d.sign_shift) << 31;  // NaN stays the canonical one
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// One loop per common code width, so that GCC vectorises the widening loads; `fn(i, value)`.
template <typename Fn>
CPD_INLINE void ForEachDecoded(const std::uint8_t* src, std::size_t n, const CodeDecoder& d,
                               Fn&& fn) {
  if (d.bits == 8) {
    for (std::size_t i = 0; i < n; ++i) fn(i, DecodeOne(src[i], d));
  } else if (d.bits == 4) {
    const std::size_t pairs = n / 2;
    for (std::size_t j = 0; j < pairs; ++j) {
      const std::uint32_t b = src[j];
      fn(2 * j, DecodeOne(b & 0xfu, d));
      fn(2 * j + 1, DecodeOne(b >> 4, d));
    }
    if (n % 2 != 0) fn(n - 1, DecodeOne(src[pairs] & 0xfu, d));
  } else if (d.bits == 16) {
    std::uint16_t h[256];
    for (std::size_t s = 0; s < n; s += 256) {
      const std::size_t len = std::min<std::size_t>(256, n - s);
      std::memcpy(h, src + 2 * s, 2 * len);  // little-endian, as PackCodes writes them
      for (std::size_t i = 0; i < len; ++i) fn(s + i, DecodeOne(h[i], d));
    }
  } else {
    // Other widths through a small buffer of unpacked codes.
    constexpr std::size_t kStep = 256;  // a multiple of 8: every step starts on a byte
    std::uint32_t codes[kStep];
    for (std::size_t s = 0; s < n; s += kStep) {
      const std::size_t len = std::min(kStep, n - s);
      UnpackCodes(src + s * std::size_t(d.bits) / 8, len, d.bits, codes);
      for (std::size_t i = 0; i < len; ++i) fn(s + i, DecodeOne(codes[i], d));
    }
  }
}

}  // namespace

CPD_CLONES
void ScanAbs(const float* x, std::size_t n, std::uint32_t* max_bits, std::uint64_t* nonzero) {
  std::uint32_t m = *max_bits;
  constexpr std::size_t kBlock = std::size_t(1) << 16;  // 32-bit counters vectorise better
  for (std::size_t s = 0; s < n; s += kBlock) {
    const std::size_t e = std::min(n, s + kBlock);
    std::uint32_t nz = 0;
    for (std::size_t i = s; i < e; ++i) {
      const std::uint32_t a = Bits(x[i]) & 0x7fffffffu;
      m = std::max(m, a);
      nz += a != 0;
    }
    *nonzero += nz;
  }
  *max_bits = m;
}

namespace {

// The nearest-even code of a finite y, as kernels::RoundToFloatGrid<kNearestEven> computes it,
// without the Inf/NaN handling the general path carries: about half the operations. Codes order
// like magnitudes, so overflow and flushing are comparisons of codes.
struct NearestConsts {
  std::uint32_t r0;           // float32 mantissa bits below the grid's
  std::uint32_t half_m1;      // 2^(r0 - 1) - 1
  std::uint32_t code_offset;  // (emin_field - 1) << mbits
  std::uint32_t emin_bits;    // float32 bits of 2^emin: the normal region starts here
  std::uint32_t flush_below;  // codes below this become 0 (first normal code without subnormals)
  std::uint32_t sign_shift;
};

CPD_INLINE NearestConsts MakeNearestConsts(const kernels::FloatGrid& g) {
  NearestConsts c;
  const std::uint32_t emin_field = std::uint32_t(g.emin + 127);
  c.r0 = std::uint32_t(23 - g.mbits);
  c.half_m1 = (1u << (c.r0 - 1)) - 1u;
  c.code_offset = (emin_field - 1) << g.mbits;
  c.emin_bits = emin_field << 23;
  c.flush_below = g.subnormals ? 0u : 1u << g.mbits;
  c.sign_shift = std::uint32_t(g.ebits + g.mbits);
  return c;
}

CPD_INLINE std::uint32_t NearestCodeFinite(float y, const kernels::FloatGrid& g,
                                           const NearestConsts& c) {
  const std::uint32_t u = Bits(y);
  const std::uint32_t a = u & 0x7fffffffu;
  const std::uint32_t mag_n = ((a + c.half_m1 + ((a >> c.r0) & 1u)) >> c.r0) - c.code_offset;
  float t;
  std::memcpy(&t, &a, 4);
  const std::uint32_t mag_s = Bits(t + g.rne_magic) - Bits(g.rne_magic);
  std::uint32_t mag = a >= c.emin_bits ? mag_n : mag_s;
  mag = mag > g.max_code ? g.overflow_code : mag;
  mag = mag < c.flush_below ? 0u : mag;
  return mag | ((u >> 31) << c.sign_shift);
}

template <kernels::RoundMode kMode, bool kStats, bool kFinite, typename Code>
CPD_INLINE void EncodeLoop(const float* x, std::size_t n, float scale,
                           const kernels::FloatGrid& grid, const kernels::LoopParams& p,
                           Code* codes, std::uint64_t* stats) {
  const kernels::FloatGrid g = grid;
  const NearestConsts nc = MakeNearestConsts(g);
  const std::uint32_t mag_mask = (1u << (g.ebits + g.mbits)) - 1u;
  // 32-bit lane counters vectorise better than 64-bit ones; flushed into `stats` every 2^16.
  constexpr std::size_t kBlock = std::size_t(1) << 16;
  // Stochastic rounding's random bits come an L1-sized piece at a time from FillRandomBits
  // (two elements per hash, vectorised) rather than one RandomBits call per element.
  constexpr std::size_t kPiece =
      kMode == kernels::RoundMode::kStochastic ? kernels::kL1Piece : kBlock;
  std::uint32_t rnd[kMode == kernels::RoundMode::kStochastic ? kPiece : 1] = {};
  for (std::size_t s = 0; s < n; s += kBlock) {
    const std::size_t e = std::min(n, s + kBlock);
    std::uint32_t fl = 0, sat = 0;
    for (std::size_t ps = s; ps < e; ps += kPiece) {
      const std::size_t pe = std::min(e, ps + kPiece);
      if constexpr (kMode == kernels::RoundMode::kStochastic) {
        kernels::FillRandomBits(p.rng_key, p.index_base + ps, pe - ps, rnd);
      }
      for (std::size_t i = ps; i < pe; ++i) {
        const float y = x[i] * scale;
        const std::uint32_t r = kMode == kernels::RoundMode::kStochastic ? rnd[i - ps] : 0u;
        std::uint32_t code;
        if constexpr (kFinite && kMode == kernels::RoundMode::kNearestEven) {
          code = NearestCodeFinite(y, g, nc);
        } else {
          kernels::RoundToFloatGrid<kMode>(y, g, r, &code);
        }
        codes[i] = Code(code);
        if (kStats) {
          fl += (Bits(x[i]) & 0x7fffffffu) != 0 && (code & mag_mask) == 0;
          sat += (Bits(y) & 0x7fffffffu) > g.max_bits;
        }
      }
    }
    if (kStats) {
      stats[0] += fl;
      stats[1] += sat;
    }
  }
}

template <typename Code>
CPD_INLINE void EncodeDispatch(const float* x, std::size_t n, float scale,
                               const kernels::FloatGrid& g, const kernels::LoopParams& p,
                               Code* codes, std::uint64_t* stats, bool finite) {
  using kernels::RoundMode;
  const bool st = stats != nullptr;
  if (finite && p.mode == RoundMode::kNearestEven && g.mbits < 23) {
    if (st) {
      EncodeLoop<RoundMode::kNearestEven, true, true>(x, n, scale, g, p, codes, stats);
    } else {
      EncodeLoop<RoundMode::kNearestEven, false, true>(x, n, scale, g, p, codes, stats);
    }
    return;
  }
  switch (p.mode) {
    case RoundMode::kStochastic:
      if (st) {
        EncodeLoop<RoundMode::kStochastic, true, false>(x, n, scale, g, p, codes, stats);
      } else {
        EncodeLoop<RoundMode::kStochastic, false, false>(x, n, scale, g, p, codes, stats);
      }
      break;
    case RoundMode::kTowardZero:
      if (st) {
        EncodeLoop<RoundMode::kTowardZero, true, false>(x, n, scale, g, p, codes, stats);
      } else {
        EncodeLoop<RoundMode::kTowardZero, false, false>(x, n, scale, g, p, codes, stats);
      }
      break;
    default:
      if (st) {
        EncodeLoop<RoundMode::kNearestEven, true, false>(x, n, scale, g, p, codes, stats);
      } else {
        EncodeLoop<RoundMode::kNearestEven, false, false>(x, n, scale, g, p, codes, stats);
      }
      break;
  }
}

template <typename Code>
CPD_INLINE void PackSmall(const Code* codes, std::size_t n, int bits, std::uint8_t* dst) {
  if (bits == 8 * int(sizeof(Code))) {
    std::memcpy(dst, codes, n * sizeof(Code));  // little-endian, as PackCodes writes them
    return;
  }
  if (bits == 4) {
    const std::size_t pairs = n / 2;
    for (std::size_t j = 0; j < pairs; ++j) {
      dst[j] = std::uint8_t(codes[2 * j] | (codes[2 * j + 1] << 4));
    }
    if (n % 2 != 0) dst[pairs] = std::uint8_t(codes[n - 1]);
    return;
  }
  constexpr std::size_t kStep = 256;  // a multiple of 8: every step starts on a byte
  std::uint32_t wide[kStep];
  for (std::size_t s = 0; s < n; s += kStep) {
    const std::size_t len = std::min(kStep, n - s);
    for (std::size_t i = 0; i < len; ++i) wide[i] = codes[s + i];
    PackCodes(wide, len, bits, dst + s * std::size_t(bits) / 8);
  }
}

}  // namespace

CPD_CLONES
void EncodeCodes8(const float* x, std::size_t n, float scale, const kernels::FloatGrid& g,
                  const kernels::LoopParams& p, std::uint8_t* codes, std::uint64_t* stats,
                  bool finite) {
  EncodeDispatch(x, n, scale, g, p, codes, stats, finite);
}

CPD_CLONES
void EncodeCodes16(const float* x, std::size_t n, float scale, const kernels::FloatGrid& g,
                   const kernels::LoopParams& p, std::uint16_t* codes, std::uint64_t* stats,
                   bool finite) {
  EncodeDispatch(x, n, scale, g, p, codes, stats, finite);
}

CPD_CLONES
void PackSmallCodes(const std::uint8_t* codes, std::size_t n, int bits, std::uint8_t* dst) {
  PackSmall(codes, n, bits, dst);
}

CPD_CLONES
void PackSmallCodes(const std::uint16_t* codes, std::size_t n, int bits, std::uint8_t* dst) {
  PackSmall(codes, n, bits, dst);
}

CodeDecoder MakeCodeDecoder(const kernels::FloatGrid& g) {
  CodeDecoder d;
  d.bits = 1 + g.ebits + g.mbits;
  d.mbits = std::uint32_t(g.mbits);
  d.mag_mask = (1u << (g.ebits + g.mbits)) - 1u;
  d.mant_mask = (1u << g.mbits) - 1u;
  d.sign_shift = std::uint32_t(g.ebits + g.mbits);
  d.exp_add = std::uint32_t(g.emin + 127 - 1) << 23;
  d.top_exp = (1u << g.ebits) - 1u;
  d.quantum = g.quantum;
  d.ieee = g.style == kernels::NonFiniteStyle::kIeee;
  d.nan_only = g.style == kernels::NonFiniteStyle::kNanOnly;
  return d;
}

CPD_CLONES
void DecodeCodes(const std::uint8_t* src, std::size_t n, const CodeDecoder& d, float* out) {
  ForEachDecoded(src, n, d, [out](std::size_t i, float v) CPD_LAMBDA_INLINE { out[i] = v; });
}

CPD_CLONES
void DecodeCodesAdd(const std::uint8_t* src, std::size_t n, const CodeDecoder& d, float* acc) {
  ForEachDecoded(src, n, d, [acc](std::size_t i, float v) CPD_LAMBDA_INLINE { acc[i] += v; });
}

CPD_CLONES
void DecodeCodesScaled(const std::uint8_t* src, std::size_t n, const CodeDecoder& d, float scale,
                       float* out) {
  ForEachDecoded(src, n, d,
                 [out, scale](std::size_t i, float v) CPD_LAMBDA_INLINE { out[i] = v * scale; });
}

CPD_CLONES
void DecodeBlockCodes(const std::uint8_t* src, std::size_t n, const CodeDecoder& d,
                      const std::uint8_t* meta, std::size_t block, bool e8m0, float post, bool add,
                      float* out) {
  for (std::size_t b = 0, s = 0; s < n; ++b, s += block) {
    const std::size_t len = std::min(block, n - s);
    const int shift = e8m0 ? int(meta[b]) - 127 : int(std::int8_t(meta[b]));
    const float f = kernels::Pow2(shift);
    const std::uint8_t* codes = src + s * std::size_t(d.bits) / 8;
    float* o = out + s;
    if (add) {
      ForEachDecoded(codes, len, d, [o, f, post](std::size_t i, float v) CPD_LAMBDA_INLINE {
        o[i] += v * f * post;
      });
    } else {
      ForEachDecoded(codes, len, d, [o, f, post](std::size_t i, float v) CPD_LAMBDA_INLINE {
        o[i] = v * f * post;
      });
    }
  }
}

CPD_CLONES
void CountBlockStats(const float* x, const float* y, const std::uint32_t* codes, std::size_t n,
                     std::size_t block, const std::int32_t* shifts, std::uint32_t max_bits,
                     std::uint32_t mag_mask, std::uint64_t* stats) {
  std::uint64_t fl = 0, sat = 0;
  float max_f;
  std::memcpy(&max_f, &max_bits, 4);
  for (std::size_t b = 0, s = 0; s < n; ++b, s += block) {
    const std::size_t e = std::min(n, s + block);
    const float hi = max_f * kernels::Pow2(shifts[b]);
    std::uint32_t f = 0, t = 0;
    for (std::size_t i = s; i < e; ++i) {
      f += (Bits(x[i]) & 0x7fffffffu) != 0 && (codes[i] & mag_mask) == 0;
      t += std::fabs(y[i]) > hi;
    }
    fl += f;
    sat += t;
  }
  stats[0] += fl;
  stats[1] += sat;
}

}  // namespace cpd::comm::internal
