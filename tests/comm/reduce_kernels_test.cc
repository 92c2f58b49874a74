// The element loops of the quantised all-reduce (comm/reduce_kernels.h) against scalar
// references: decoding of every code of every fixed float grid against kernels::DecodeFloatGrid
// bit for bit, the scan that feeds APS and the non-finite check, and the statistics counts.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "comm/reduce_kernels.h"
#include "cpd/format.h"
#include "cpd/quantize.h"
#include "kernels/grid.h"
#include "kernels/quantize_cpu.h"

namespace cpd::comm::internal {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

TEST(ReduceKernelsTest, DecodeMatchesDecodeFloatGridForEveryCode) {
  for (const char* spec :
       {"e4m3", "e4m3:inf", "e5m2", "e5m2:inf", "e3m0", "e3m0:inf", "e2m1", "e3m2", "e2m3",
        "e3m2:ieee", "fp16", "bf16", "e5m3", "e4m3:nosub", "e2m0", "e6m9"}) {
    SCOPED_TRACE(spec);
    const Format f = Format::Parse(spec).value();
    const CodeDecoder d = MakeCodeDecoder(f.grid());
    ASSERT_EQ(d.bits, f.bits());
    // Every code, then a few more so that 4-bit and odd widths end mid-byte; the span starts at
    // a code offset that is a multiple of 8, as the all-reduce's pieces do.
    const uint32_t codes_total = 1u << f.bits();
    for (size_t n : {size_t{codes_total}, size_t{codes_total} + 3, size_t{1}}) {
      std::vector<uint32_t> codes(n);
      for (size_t i = 0; i < n; ++i) codes[i] = uint32_t((i * 2654435761u) % codes_total);
      std::vector<uint8_t> packed((n * size_t(f.bits()) + 7) / 8 + 8, 0);
      PackCodes(codes.data(), n, f.bits(), packed.data());
      std::vector<float> out(n), acc(n, 1.5f), scaled(n);
      DecodeCodes(packed.data(), n, d, out.data());
      DecodeCodesAdd(packed.data(), n, d, acc.data());
      DecodeCodesScaled(packed.data(), n, d, 0.25f, scaled.data());
      size_t wrong = 0;
      for (size_t i = 0; i < n; ++i) {
        const float v = kernels::DecodeFloatGrid(codes[i], f.grid());
        wrong += Bits(out[i]) != Bits(v);
        const float a = 1.5f + v, s = v * 0.25f;
        wrong += std::isnan(a) ? !std::isnan(acc[i]) : Bits(acc[i]) != Bits(a);
        wrong += std::isnan(s) ? !std::isnan(scaled[i]) : Bits(scaled[i]) != Bits(s);
      }
      EXPECT_EQ(wrong, 0u) << "n " << n;
    }
  }
}

TEST(ReduceKernelsTest, ScanFindsMaxNonzeroAndNonFinite) {
  std::vector<float> x = {0.0f, -0.0f, 1.5f, -7.25f, 3.0f, 0.0f, 1e-40f};
  uint32_t m = 0;
  uint64_t nz = 0;
  ScanAbs(x.data(), x.size(), &m, &nz);
  EXPECT_EQ(m, Bits(7.25f));
  EXPECT_EQ(nz, 4u);
  // Merges into what is there already.
  ScanAbs(x.data(), 3, &m, &nz);
  EXPECT_EQ(m, Bits(7.25f));
  EXPECT_EQ(nz, 5u);
  x.push_back(std::numeric_limits<float>::infinity());
  m = 0;
  ScanAbs(x.data(), x.size(), &m, &nz);
  EXPECT_EQ(m, 0x7f800000u);
  x.back() = -std::numeric_limits<float>::quiet_NaN();
  m = 0;
  ScanAbs(x.data(), x.size(), &m, &nz);
  EXPECT_GT(m, 0x7f800000u);
  m = 0;
  ScanAbs(nullptr, 0, &m, &nz);
  EXPECT_EQ(m, 0u);
}

// EncodeCodes8/16 + PackSmallCodes against kernels::QuantizeFloatGrid + cpd::PackCodes (the codes
// cpd::Encode packs), and their statistics against cpd::Quantize's on the scaled input.
TEST(ReduceKernelsTest, EncodeMatchesQuantizeFloatGridAndItsStatistics) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const size_t n = 5003;  // odd: 4-bit codes end mid-byte
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) {
    x[i] = i % 50 == 0 ? 0.0f : std::ldexp(normal(rng), int(i % 40) - 20);
    if (i % 97 == 3) x[i] = std::ldexp(normal(rng), -135);  // float32 subnormal range (bf16)
  }
  for (const char* spec : {"e4m3", "e5m2:inf", "e3m0", "e3m0:inf", "e2m1", "e3m2", "fp16", "bf16",
                           "e5m3", "e4m3:nosub", "e4m3:inf", "e5m2:ieee:nosub", "e2m3"}) {
    const Format f = Format::Parse(spec).value();
    for (Rounding r : {Rounding::kNearest, Rounding::kStochastic, Rounding::kZero}) {
      for (int shift : {0, 5, -3}) {
        SCOPED_TRACE(std::string(spec) + " " + RoundingName(r) + " shift " + std::to_string(shift));
        kernels::LoopParams p;
        p.mode = r == Rounding::kNearest      ? kernels::RoundMode::kNearestEven
                 : r == Rounding::kStochastic ? kernels::RoundMode::kStochastic
                                              : kernels::RoundMode::kTowardZero;
        p.rng_key = kernels::MakeRandomKey(77, 3);
        p.index_base = 1000;
        std::vector<uint32_t> want(n);
        kernels::QuantizeFloatGrid(x.data(), nullptr, want.data(), n, f.grid(), -shift, p, nullptr);
        std::vector<uint8_t> want_packed(PackedCodeBytes(f, n) + 4, 0xee);
        PackCodes(want.data(), n, f.bits(), want_packed.data());

        uint64_t stats[2] = {0, 0};
        std::vector<uint8_t> packed(want_packed.size(), 0xee);
        if (f.bits() <= 8) {
          std::vector<uint8_t> codes(n);
          EncodeCodes8(x.data(), n, kernels::Pow2(shift), f.grid(), p, codes.data(), stats);
          size_t wrong = 0;
          for (size_t i = 0; i < n; ++i) wrong += codes[i] != want[i];
          EXPECT_EQ(wrong, 0u);
          PackSmallCodes(codes.data(), n, f.bits(), packed.data());
        } else {
          std::vector<uint16_t> codes(n);
          EncodeCodes16(x.data(), n, kernels::Pow2(shift), f.grid(), p, codes.data(), stats);
          size_t wrong = 0;
          for (size_t i = 0; i < n; ++i) wrong += codes[i] != want[i];
          EXPECT_EQ(wrong, 0u);
          PackSmallCodes(codes.data(), n, f.bits(), packed.data());
        }
        EXPECT_EQ(packed, want_packed);

        std::vector<float> y(n), q(n);
        for (size_t i = 0; i < n; ++i) y[i] = std::ldexp(x[i], shift);
        QuantizeOptions qo;
        qo.rounding = r;
        qo.seed = 77;
        qo.step = 3;
        qo.index_offset = 1000;
        QuantStats st;
        ASSERT_TRUE(Quantize(f, y.data(), q.data(), n, qo, &st).ok());
        EXPECT_EQ(stats[0], st.flushed);
        EXPECT_EQ(stats[1], st.saturated);
        if (std::string(spec) == "e4m3") {  // the input spans 2^-20..2^20: both happen
          EXPECT_GT(stats[0], 0u);
          EXPECT_GT(stats[1], 0u);
        }
        // Without statistics, and on the path for finite inputs, the codes are the same.
        for (bool finite : {false, true}) {
          std::vector<uint16_t> again(n);
          EncodeCodes16(x.data(), n, kernels::Pow2(shift), f.grid(), p, again.data(), nullptr,
                        finite);
          std::vector<uint8_t> again8(n);
          if (f.bits() <= 8) {
            uint64_t st8[2] = {0, 0};
            EncodeCodes8(x.data(), n, kernels::Pow2(shift), f.grid(), p, again8.data(), st8,
                         finite);
            EXPECT_EQ(st8[0], st.flushed);
            EXPECT_EQ(st8[1], st.saturated);
          }
          size_t differ = 0;
          for (size_t i = 0; i < n; ++i) {
            differ += again[i] != want[i];
            differ += f.bits() <= 8 && again8[i] != want[i];
          }
          EXPECT_EQ(differ, 0u) << "finite " << finite;
        }
      }
    }
  }
}

}  // namespace
}  // namespace cpd::comm::internal
