// Bit-exact comparison of the OCP FP8/FP6/FP4 formats against the CUDA toolkit's host-callable
// conversions (cuda_fp8.h, cuda_fp6.h, cuda_fp4.h), compiled here with the host compiler: the
// codes from cpd::Encode must equal the CUDA storage bytes and the values from cpd::Quantize the
// CUDA-decoded values, for every representable value, every tie and its float neighbours, and
// 10^7 random inputs.
#include <cuda_fp4.h>
#include <cuda_fp6.h>
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "cpd/format.h"
#include "cpd/quantize.h"
#include "tests/cpd/format_test_util.h"

namespace cpd::test {
namespace {

// The oracle of one format: float -> storage code, code -> value.
struct Oracle {
  std::string spec;
  Rounding rounding;
  int bits;
  std::function<uint32_t(float)> encode;
  std::function<float(uint32_t)> decode;
};

void PrintTo(const Oracle& o, std::ostream* os) {
  *os << o.spec << " " << RoundingName(o.rounding);
}

float HalfRawToFloat(__half_raw h) {
  _Float16 f;
  std::memcpy(&f, &h.x, 2);
  return float(f);
}

Oracle Fp8(const char* spec, __nv_saturation_t sat, __nv_fp8_interpretation_t kind) {
  return {spec, Rounding::kNearest, 8,
          [=](float x) { return uint32_t(__nv_cvt_float_to_fp8(x, sat, kind)); },
          [=](uint32_t c) {
            return HalfRawToFloat(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(c), kind));
          }};
}

Oracle Fp6(const char* spec, Rounding r, __nv_fp6_interpretation_t kind) {
  const cudaRoundMode mode = r == Rounding::kNearest ? cudaRoundNearest : cudaRoundZero;
  return {spec, r, 6,
          [=](float x) { return uint32_t(__nv_cvt_float_to_fp6(x, kind, mode)) & 0x3fu; },
          [=](uint32_t c) {
            return HalfRawToFloat(__nv_cvt_fp6_to_halfraw(__nv_fp6_storage_t(c), kind));
          }};
}

Oracle Fp4(const char* spec, Rounding r) {
  const cudaRoundMode mode = r == Rounding::kNearest ? cudaRoundNearest : cudaRoundZero;
  return {spec, r, 4,
          [=](float x) { return uint32_t(__nv_cvt_float_to_fp4(x, __NV_E2M1, mode)) & 0xfu; },
          [=](uint32_t c) {
            return HalfRawToFloat(__nv_cvt_fp4_to_halfraw(__nv_fp4_storage_t(c), __NV_E2M1));
          }};
}

std::vector<Oracle> AllOracles() {
  return {
      Fp8("e4m3", __NV_SATFINITE, __NV_E4M3),
      Fp8("e4m3:inf", __NV_NOSAT, __NV_E4M3),
      Fp8("e5m2", __NV_SATFINITE, __NV_E5M2),
      Fp8("e5m2:inf", __NV_NOSAT, __NV_E5M2),
      Fp6("e3m2", Rounding::kNearest, __NV_E3M2),
      Fp6("e3m2", Rounding::kZero, __NV_E3M2),
      Fp6("e2m3", Rounding::kNearest, __NV_E2M3),
      Fp6("e2m3", Rounding::kZero, __NV_E2M3),
      Fp4("e2m1", Rounding::kNearest),
      Fp4("e2m1", Rounding::kZero),
  };
}

// The non-negative finite values of the format according to the CUDA decoder.
std::vector<double> OracleGrid(const Oracle& o) {
  std::set<double> values;
  for (uint32_t c = 0; c < (1u << o.bits); ++c) {
    const float v = o.decode(c);
    if (std::isfinite(v) && v >= 0) values.insert(v);
  }
  return {values.begin(), values.end()};
}

// Compares codes and values of cpd against the oracle on `x`.
void CheckAgainstOracle(const Oracle& o, const std::vector<float>& x, const std::string& what) {
  const Format f = MustParse(o.spec);
  ASSERT_EQ(f.bits(), o.bits);
  QuantizeOptions opts;
  opts.rounding = o.rounding;
  const std::vector<float> q = Q(f, x, opts);
  const std::vector<uint32_t> codes = Codes(f, x, opts);
  const uint32_t mask = (1u << o.bits) - 1u;
  MismatchCounter code_bad(o.spec + "/" + RoundingName(o.rounding) + " codes on " + what);
  MismatchCounter value_bad(o.spec + "/" + RoundingName(o.rounding) + " values on " + what);
  for (size_t i = 0; i < x.size(); ++i) {
    const uint32_t ref_code = o.encode(x[i]) & mask;
    if (codes[i] != ref_code) {
      code_bad.Add() << "x = " << Show(x[i]) << ": cpd code " << Hex(codes[i]) << ", CUDA "
                     << Hex(ref_code);
    }
    const float ref = o.decode(ref_code);
    if (!SameResult(q[i], ref)) {
      value_bad.Add() << "x = " << Show(x[i]) << ": cpd " << Show(q[i]) << ", CUDA " << Show(ref);
    }
  }
}

class CudaOracleTest : public ::testing::TestWithParam<Oracle> {};

TEST_P(CudaOracleTest, GridValuesTiesAndNeighbours) {
  const Oracle& o = GetParam();
  const std::vector<double> grid = OracleGrid(o);
  // The CUDA grid is the format's grid: same values as Format::Values() (both signs).
  const Format f = MustParse(o.spec);
  Result<std::vector<float>> values = f.Values();
  ASSERT_TRUE(values.ok());
  std::set<double> ours;
  for (float v : *values) ours.insert(std::fabs(double(v)));
  EXPECT_EQ(std::vector<double>(ours.begin(), ours.end()), grid) << o.spec;
  CheckAgainstOracle(o, GridProbes(grid), "grid probes");
}

TEST_P(CudaOracleTest, TenMillionRandomInputs) {
  const Oracle& o = GetParam();
  const std::vector<double> grid = OracleGrid(o);
  const int lo = int(std::floor(std::log2(grid[1]))) - 4;
  const int hi = int(std::floor(std::log2(grid.back()))) + 4;
  CheckAgainstOracle(o, RandomInputs(10'000'000, 0x5eed0000 + o.bits, lo, hi, grid.back()),
                     "random inputs");
}

TEST_P(CudaOracleTest, EveryCodeDecodesAsCuda) {
  // Every storage code: cpd decodes the CUDA code of a grid value to that value, and
  // re-encoding the CUDA-decoded value gives the code back (the zero and NaN codes aside).
  const Oracle& o = GetParam();
  const Format f = MustParse(o.spec);
  MismatchCounter bad(o.spec + " code round trip");
  for (uint32_t c = 0; c < (1u << o.bits); ++c) {
    const float v = o.decode(c);
    PackedTensor p;
    p.count = 1;
    p.bytes.assign(PackedSize(f, 1, 1), 0);
    PackCodes(&c, 1, f.bits(), p.bytes.data());
    float got = 0;
    ASSERT_TRUE(Decode(f, p, &got).ok());
    if (!SameResult(got, v))
      bad.Add() << "code " << Hex(c) << ": cpd " << Show(got) << ", CUDA " << Show(v);
  }
}

INSTANTIATE_TEST_SUITE_P(Ocp, CudaOracleTest, ::testing::ValuesIn(AllOracles()),
                         [](const ::testing::TestParamInfo<Oracle>& info) {
                           std::string name =
                               info.param.spec + "_" + RoundingName(info.param.rounding);
                           for (char& c : name) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return name;
                         });

// The NaN convention: canonical positive NaN code for e4m3/e5m2, +max for the formats without
// NaN, whatever the sign or payload of the NaN; and CUDA agrees.
TEST(CudaOracleNan, NanInputsGiveCanonicalCodes) {
  const std::vector<float> nans = {FromBits(0x7fc00000u), FromBits(0xffc00000u),
                                   FromBits(0x7f800001u), FromBits(0xffbfffffu)};
  struct Case {
    const char* spec;
    uint32_t code;
    float value;  // NaN: any NaN
  };
  const Case cases[] = {{"e4m3", 0x7f, NAN},     {"e4m3:inf", 0x7f, NAN}, {"e5m2", 0x7f, NAN},
                        {"e5m2:inf", 0x7f, NAN}, {"e3m2", 0x1f, 28.0f},   {"e2m3", 0x1f, 7.5f},
                        {"e2m1", 0x7, 6.0f}};
  for (const Case& c : cases) {
    const Format f = MustParse(c.spec);
    const std::vector<float> q = Q(f, nans);
    const std::vector<uint32_t> codes = Codes(f, nans);
    for (size_t i = 0; i < nans.size(); ++i) {
      EXPECT_EQ(codes[i], c.code) << c.spec << " NaN " << Hex(Bits(nans[i]));
      EXPECT_TRUE(SameResult(q[i], c.value)) << c.spec << " NaN -> " << Show(q[i]);
      if (!std::isnan(c.value)) {
        EXPECT_EQ(Bits(q[i]), Bits(c.value)) << c.spec;
      }
    }
  }
  for (float x : nans) {
    EXPECT_EQ(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3), 0x7f);
    EXPECT_EQ(__nv_cvt_float_to_fp8(x, __NV_NOSAT, __NV_E4M3), 0x7f);
    EXPECT_EQ(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2), 0x7f);
    EXPECT_EQ(__nv_cvt_float_to_fp8(x, __NV_NOSAT, __NV_E5M2), 0x7f);
    EXPECT_EQ(__nv_cvt_float_to_fp6(x, __NV_E3M2, cudaRoundNearest) & 0x3f, 0x1f);
    EXPECT_EQ(__nv_cvt_float_to_fp6(x, __NV_E2M3, cudaRoundZero) & 0x3f, 0x1f);
    EXPECT_EQ(__nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest) & 0xf, 0x7);
  }
}

// Overflow: saturating formats clamp to +-max (Inf included), ':inf' gives NaN (e4m3) or Inf.
TEST(CudaOracleNan, OverflowConventions) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> x = {1e6f, -1e6f, inf, -inf};
  EXPECT_EQ(Codes(MustParse("e4m3"), x), (std::vector<uint32_t>{0x7e, 0xfe, 0x7e, 0xfe}));
  EXPECT_EQ(Codes(MustParse("e4m3:inf"), x), (std::vector<uint32_t>{0x7f, 0xff, 0x7f, 0xff}));
  EXPECT_EQ(Codes(MustParse("e5m2"), x), (std::vector<uint32_t>{0x7b, 0xfb, 0x7b, 0xfb}));
  EXPECT_EQ(Codes(MustParse("e5m2:inf"), x), (std::vector<uint32_t>{0x7c, 0xfc, 0x7c, 0xfc}));
  const std::vector<float> q = Q(MustParse("e5m2:inf"), x);
  EXPECT_EQ(q[0], inf);
  EXPECT_EQ(q[1], -inf);
  const std::vector<float> s = Q(MustParse("e4m3"), x);
  EXPECT_EQ(s, (std::vector<float>{448.0f, -448.0f, 448.0f, -448.0f}));
}

}  // namespace
}  // namespace cpd::test
