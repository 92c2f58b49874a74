// The packing unit of the device codec (kernels/cuda/codec.cu): 8 codes of `bits` bits, which
// fill exactly `bits` whole bytes of the packed stream, in cpd::PackCodes' layout (code i at
// bits [i*bits, (i+1)*bits), little-endian; the last byte's spare bits zero). One GPU thread
// packs or unpacks one unit, so threads never share a byte; codes of 4, 8, 16 or 32 bits also go
// four to a lane (StoreCodeQuad, LoadCodeQuad, below). Host/device, so that the CPU tests
// (tests/cpd/codec_test.cc) check these very functions against PackCodes / UnpackCodes on a
// machine without a GPU.
#pragma once

#include <cstdint>

#include "kernels/grid.h"

namespace cpd::kernels {

constexpr int kUnitCodes = 8;

// One aligned 32-bit word of the stream: a single store on the device; memcpy on the host,
// where the buffer's objects are bytes (strict aliasing).
CPD_HD void StoreStreamWord(uint8_t* dst, uint32_t w) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint32_t*>(dst) = w;
#else
  memcpy(dst, &w, 4);
#endif
}
CPD_HD uint32_t LoadStreamWord(const uint8_t* src) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const uint32_t*>(src);
#else
  uint32_t w;
  memcpy(&w, src, 4);
  return w;
#endif
}

CPD_HD uint32_t CodeMask(int bits) { return bits >= 32 ? 0xffffffffu : (1u << bits) - 1u; }

// Writes the first `len` (1..8) codes of a unit, each < 2^bits (1 <= bits <= 32), to
// dst[0, ceil(len * bits / 8)). `words`: dst is 4-byte aligned and bits % 4 == 0, so a full
// unit is bits / 4 whole 32-bit words and is stored as such (the stream's bytes are the same
// on a little-endian machine). The accumulator never holds more than 63 bits.
CPD_HD void StoreCodeUnit(const uint32_t (&codes)[kUnitCodes], int len, int bits, bool words,
                          uint8_t* dst) {
  uint64_t acc = 0;
  int filled = 0;
  if (words && len == kUnitCodes) {
    CPD_UNROLL
    for (int k = 0; k < kUnitCodes; ++k) {
      acc |= uint64_t(codes[k]) << filled;
      filled += bits;
      if (filled >= 32) {
        StoreStreamWord(dst, uint32_t(acc));
        dst += 4;
        acc >>= 32;
        filled -= 32;
      }
    }
    return;
  }
  CPD_UNROLL
  for (int k = 0; k < kUnitCodes; ++k) {
    if (k < len) {
      acc |= uint64_t(codes[k]) << filled;
      filled += bits;
      while (filled >= 8) {
        *dst++ = uint8_t(acc);
        acc >>= 8;
        filled -= 8;
      }
    }
  }
  if (filled > 0) *dst = uint8_t(acc);  // the spare high bits are zero
}

// Reads the first `len` codes of a unit from src, never past its ceil(len * bits / 8) bytes;
// codes[k] = 0 for k >= len. `words` as in StoreCodeUnit.
CPD_HD void LoadCodeUnit(const uint8_t* src, int len, int bits, bool words,
                         uint32_t (&codes)[kUnitCodes]) {
  const uint32_t mask = CodeMask(bits);
  uint64_t acc = 0;
  int filled = 0;
  if (words && len == kUnitCodes) {
    CPD_UNROLL
    for (int k = 0; k < kUnitCodes; ++k) {
      if (filled < bits) {
        acc |= uint64_t(LoadStreamWord(src)) << filled;
        src += 4;
        filled += 32;
      }
      codes[k] = uint32_t(acc) & mask;
      acc >>= bits;
      filled -= bits;
    }
    return;
  }
  CPD_UNROLL
  for (int k = 0; k < kUnitCodes; ++k) {
    codes[k] = 0;
    if (k < len) {
      while (filled < bits) {
        acc |= uint64_t(*src++) << filled;
        filled += 8;
      }
      codes[k] = uint32_t(acc) & mask;
      acc >>= bits;
      filled -= bits;
    }
  }
}

// Four codes of 4, 8, 16 or 32 bits fill quad_bytes = bits / 2 whole bytes of the stream, so
// the device codec's quad kernels give each lane four consecutive codes: quad q at byte
// q * quad_bytes. `dst` / `src` REQUIRED aligned to quad_bytes (one 2-, 4-, 8- or 16-byte access
// on the device); codes each < 2^bits.
CPD_HD int QuadCodeBits(int quad_bytes) { return 2 * quad_bytes; }

CPD_HD void StoreCodeQuad(const uint32_t (&c)[4], int quad_bytes, uint8_t* dst) {
  uint32_t w[4] = {c[0], c[1], c[2], c[3]};  // quad_bytes 16: the codes themselves
  if (quad_bytes == 2) {
    w[0] = c[0] | c[1] << 4 | c[2] << 8 | c[3] << 12;
  } else if (quad_bytes == 4) {
    w[0] = c[0] | c[1] << 8 | c[2] << 16 | c[3] << 24;
  } else if (quad_bytes == 8) {
    w[0] = c[0] | c[1] << 16;
    w[1] = c[2] | c[3] << 16;
  }
#if defined(__CUDA_ARCH__)
  if (quad_bytes == 2) {
    *reinterpret_cast<uint16_t*>(dst) = uint16_t(w[0]);
  } else if (quad_bytes == 4) {
    *reinterpret_cast<uint32_t*>(dst) = w[0];
  } else if (quad_bytes == 8) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  } else {
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
  }
#else
  memcpy(dst, w, size_t(quad_bytes));  // little-endian, as the stream
#endif
}

CPD_HD void LoadCodeQuad(const uint8_t* src, int quad_bytes, uint32_t (&c)[4]) {
  uint32_t w[4] = {0u, 0u, 0u, 0u};
#if defined(__CUDA_ARCH__)
  if (quad_bytes == 2) {
    w[0] = *reinterpret_cast<const uint16_t*>(src);
  } else if (quad_bytes == 4) {
    w[0] = *reinterpret_cast<const uint32_t*>(src);
  } else if (quad_bytes == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    w[0] = v.x, w[1] = v.y;
  } else {
    const uint4 v = *reinterpret_cast<const uint4*>(src);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  }
#else
  memcpy(w, src, size_t(quad_bytes));
#endif
  if (quad_bytes == 2) {
    c[0] = w[0] & 0xfu, c[1] = (w[0] >> 4) & 0xfu, c[2] = (w[0] >> 8) & 0xfu, c[3] = w[0] >> 12;
  } else if (quad_bytes == 4) {
    c[0] = w[0] & 0xffu, c[1] = (w[0] >> 8) & 0xffu, c[2] = (w[0] >> 16) & 0xffu;
    c[3] = w[0] >> 24;
  } else if (quad_bytes == 8) {
    c[0] = w[0] & 0xffffu, c[1] = w[0] >> 16, c[2] = w[1] & 0xffffu, c[3] = w[1] >> 16;
  } else {
    c[0] = w[0], c[1] = w[1], c[2] = w[2], c[3] = w[3];
  }
}

}  // namespace cpd::kernels
