// The packing unit of the device codec (kernels/cuda/codec.cu): 8 codes of `bits` bits, which
// fill exactly `bits` whole bytes of the packed stream, in cpd::PackCodes' layout (code i at
// bits [i*bits, (i+1)*bits), little-endian; the last byte's spare bits zero). One GPU thread
// packs or unpacks one unit, so threads never share a byte. Host/device, so that the CPU tests
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

}  // namespace cpd::kernels
