// Bit-exact comparison of the IEEE-style formats against independent oracles:
//  * fp16 against GCC's _Float16 conversion,
//  * bf16 against the standard round-to-nearest-even bit trick,
//  * generic eXmY against a scalar reference written here from the format definition (finite
//    values enumerated in double from the formula, round to the nearest value, ties to the even
//    code), which does not use kernels/grid.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "cpd/format.h"
#include "cpd/quantize.h"
#include "tests/cpd/format_test_util.h"

namespace cpd::test {
namespace {

const float kInf = std::numeric_limits<float>::infinity();

// All non-negative finite values of a 16-bit format whose bits are the top half of a float32
// (bf16) or whose bits a _Float16 holds (fp16).
std::vector<double> Fp16Grid() {
  std::vector<double> g;
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    _Float16 f;
    const uint16_t b = uint16_t(h);
    std::memcpy(&f, &b, 2);
    g.push_back(double(f));
  }
  return g;
}

std::vector<double> Bf16Grid() {
  std::vector<double> g;
  for (uint32_t h = 0; h < 0x7f80; ++h) g.push_back(double(FromBits(h << 16)));
  return g;
}

// ---- fp16 vs _Float16 ---------------------------------------------------------------------
uint16_t HalfBits(float x) {
  const _Float16 h = static_cast<_Float16>(x);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

// saturate: the format saturates overflow (the default); otherwise IEEE overflow to Inf.
void CheckFp16(const std::string& spec, bool saturate, const std::vector<float>& x) {
  const Format f = MustParse(spec);
  ASSERT_EQ(f.bits(), 16);
  const std::vector<float> q = Q(f, x);
  const std::vector<uint32_t> codes = Codes(f, x);
  MismatchCounter bad_value(spec + " values vs _Float16");
  MismatchCounter bad_code(spec + " codes vs _Float16 bits");
  for (size_t i = 0; i < x.size(); ++i) {
    uint16_t ref_bits = HalfBits(x[i]);
    if (saturate && !std::isnan(x[i]) && (ref_bits & 0x7fffu) == 0x7c00u) {
      ref_bits = uint16_t((ref_bits & 0x8000u) | 0x7bffu);  // +-65504
    }
    _Float16 h;
    std::memcpy(&h, &ref_bits, 2);
    const float ref = float(h);
    if (!SameResult(q[i], ref)) {
      bad_value.Add() << "x = " << Show(x[i]) << ": cpd " << Show(q[i]) << ", oracle " << Show(ref);
    }
    if (std::isnan(x[i])) {
      // Our convention: the positive NaN code (exponent all ones, mantissa nonzero, sign 0).
      if ((codes[i] & 0xfc00u) != 0x7c00u || (codes[i] & 0x3ffu) == 0 || codes[i] > 0xffffu) {
        bad_code.Add() << "NaN input " << Hex(Bits(x[i])) << " gave code " << Hex(codes[i]);
      }
    } else if (codes[i] != ref_bits) {
      bad_code.Add() << "x = " << Show(x[i]) << ": cpd code " << Hex(codes[i]) << ", oracle "
                     << Hex(ref_bits);
    }
  }
}

TEST(Fp16Oracle, GridProbes) {
  const std::vector<float> x = GridProbes(Fp16Grid());
  CheckFp16("fp16", true, x);
  CheckFp16("fp16:inf", false, x);
  CheckFp16("e5m10:inf", false, x);
}

TEST(Fp16Oracle, TenMillionRandomInputs) {
  const std::vector<float> x = RandomInputs(10'000'000, 16, -30, 20, 65504.0f);
  CheckFp16("fp16", true, x);
  CheckFp16("fp16:inf", false, x);
}

// ---- bf16 vs the RNE bit trick ----------------------------------------------------------------
uint32_t Bf16Rne(float x) {  // 16-bit result; NaN handled by the caller
  const uint32_t u = Bits(x);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

void CheckBf16(const std::string& spec, bool saturate, const std::vector<float>& x) {
  const Format f = MustParse(spec);
  ASSERT_EQ(f.bits(), 16);
  const std::vector<float> q = Q(f, x);
  const std::vector<uint32_t> codes = Codes(f, x);
  MismatchCounter bad_value(spec + " values vs RNE bf16");
  MismatchCounter bad_code(spec + " codes vs RNE bf16");
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i])) {
      if (!std::isnan(q[i])) bad_value.Add() << "NaN input gave " << Show(q[i]);
      if ((codes[i] & 0xff80u) != 0x7f80u || (codes[i] & 0x7fu) == 0 || codes[i] > 0xffffu) {
        bad_code.Add() << "NaN input " << Hex(Bits(x[i])) << " gave code " << Hex(codes[i]);
      }
      continue;
    }
    uint32_t r = Bf16Rne(x[i]);
    if (saturate && (r & 0x7fffu) == 0x7f80u) r = (r & 0x8000u) | 0x7f7fu;
    const float ref = FromBits(r << 16);
    if (!SameResult(q[i], ref)) {
      bad_value.Add() << "x = " << Show(x[i]) << ": cpd " << Show(q[i]) << ", oracle " << Show(ref);
    }
    if (codes[i] != r) {
      bad_code.Add() << "x = " << Show(x[i]) << ": cpd code " << Hex(codes[i]) << ", oracle "
                     << Hex(r);
    }
  }
}

TEST(Bf16Oracle, GridProbes) {
  const std::vector<float> x = GridProbes(Bf16Grid());
  CheckBf16("bf16", true, x);
  CheckBf16("bf16:inf", false, x);
  CheckBf16("e8m7:inf", false, x);
}

TEST(Bf16Oracle, TenMillionRandomInputs) {
  const std::vector<float> x = RandomInputs(10'000'000, 1616, -140, 127, 3.3895313892515355e38f);
  CheckBf16("bf16", true, x);
  CheckBf16("bf16:inf", false, x);
}

// ---- generic eXmY vs a scalar reference
// ---------------------------------------------------------- The IEEE-style eXmY format from its
// definition: bias 2^(X-1)-1, exponent field 0 subnormal, the top exponent field reserved for Inf
// (mantissa 0) and NaN. Saturating unless `inf`; `nosub` flushes results below the smallest normal
// to +-0 after rounding.
class RefFormat {
 public:
  RefFormat(int x, int m, bool inf, bool nosub) : x_(x), m_(m), inf_(inf), nosub_(nosub) {
    const int bias = (1 << (x - 1)) - 1;
    emin_ = 1 - bias;
    const uint32_t top = (1u << x) - 1u;
    inf_code_ = top << m;
    max_code_ = inf_code_ - 1u;  // exponent top-1, mantissa all ones
    for (uint32_t c = 0; c <= max_code_; ++c) {
      const int e = int(c >> m);
      const double mant = double(c & ((1u << m) - 1u));
      values_.push_back(e == 0 ? std::ldexp(mant, emin_ - m)
                               : std::ldexp(std::ldexp(1.0, m) + mant, e - bias - m));
    }
    // The value the next code would have with an unbounded exponent range (overflow boundary).
    next_above_max_ = values_.back() + std::ldexp(1.0, int(max_code_ >> m) - bias - m);
  }

  int bits() const { return 1 + x_ + m_; }
  double max() const { return values_.back(); }
  double min_positive() const { return nosub_ ? std::ldexp(1.0, emin_) : values_[1]; }
  // Every non-negative finite value of the encoding (subnormals included): the probe points.
  const std::vector<double>& AllValues() const { return values_; }
  // Non-negative values the format can produce (the :nosub subnormals excluded).
  std::vector<double> Grid() const {
    std::vector<double> g;
    for (double v : values_) {
      if (!nosub_ || v == 0 || v >= std::ldexp(1.0, emin_)) g.push_back(v);
    }
    return g;
  }

  // Rounds x; returns the value and writes the code (sign bit at X + M).
  float Round(float xf, Rounding mode, uint32_t* code) const {
    const uint32_t sign_bit = 1u << (x_ + m_);
    if (std::isnan(xf)) {
      // Convention: the positive NaN code (all ones). With M = 0 there is none: NaN becomes
      // what overflow becomes (+Inf with ':inf', +max when saturating), so Q(Q(x)) == Q(x).
      if (m_ > 0) {
        *code = inf_code_ | ((1u << m_) - 1u);
        return std::numeric_limits<float>::quiet_NaN();
      }
      *code = inf_ ? inf_code_ : max_code_;
      return inf_ ? kInf : float(max());
    }
    const bool neg = std::signbit(xf);
    const double a = std::fabs(double(xf));
    uint32_t mag;
    bool overflow = false;
    if (std::isinf(a)) {
      overflow = true;
      mag = 0;
    } else {
      // lo: the largest value <= a (max_code_ + 1 stands for the value above max).
      const size_t idx =
          size_t(std::upper_bound(values_.begin(), values_.end(), a) - values_.begin()) - 1;
      const uint32_t lo = uint32_t(idx);
      const double vlo = values_[idx];
      const double vhi = lo == max_code_ ? next_above_max_ : values_[idx + 1];
      if (a == vlo || mode == Rounding::kZero) {
        mag = lo;
      } else {
        const double mid = 0.5 * (vlo + vhi);
        mag = a < mid ? lo : a > mid ? lo + 1 : ((lo & 1u) == 0 ? lo : lo + 1);
      }
      overflow = mag > max_code_;
    }
    double v;
    if (overflow) {
      // Saturating: +-max; ':inf': IEEE overflow to Inf (an Inf input stays Inf).
      if (inf_ && (mode == Rounding::kNearest || std::isinf(a))) {
        mag = inf_code_;
        v = std::numeric_limits<double>::infinity();
      } else {
        mag = max_code_;
        v = max();
      }
    } else {
      v = values_[mag];
      if (nosub_ && v < std::ldexp(1.0, emin_)) {
        mag = 0;
        v = 0;
      }
    }
    *code = mag | (neg ? sign_bit : 0u);
    const float r = float(v);
    return neg ? -r : r;
  }

 private:
  int x_, m_;
  bool inf_, nosub_;
  int emin_;
  uint32_t inf_code_, max_code_;
  std::vector<double> values_;
  double next_above_max_;
};

struct GenericCase {
  std::string spec;
  int x, m;
  bool inf, nosub;
};

void PrintTo(const GenericCase& c, std::ostream* os) { *os << c.spec; }

void CheckGeneric(const GenericCase& c, Rounding mode, const std::vector<float>& x,
                  const std::string& what) {
  const RefFormat ref(c.x, c.m, c.inf, c.nosub);
  const Format f = MustParse(c.spec);
  ASSERT_EQ(f.bits(), ref.bits());
  QuantizeOptions opts;
  opts.rounding = mode;
  const std::vector<float> q = Q(f, x, opts);
  const std::vector<uint32_t> codes = Codes(f, x, opts);
  const std::string tag = c.spec + "/" + RoundingName(mode) + " on " + what;
  MismatchCounter bad_value(tag + " values");
  MismatchCounter bad_code(tag + " codes");
  for (size_t i = 0; i < x.size(); ++i) {
    uint32_t rc;
    const float r = ref.Round(x[i], mode, &rc);
    if (!SameResult(q[i], r)) {
      bad_value.Add() << "x = " << Show(x[i]) << ": cpd " << Show(q[i]) << ", reference "
                      << Show(r);
    }
    if (codes[i] != rc) {
      bad_code.Add() << "x = " << Show(x[i]) << ": cpd code " << Hex(codes[i]) << ", reference "
                     << Hex(rc);
    }
  }
}

std::vector<GenericCase> GenericCases() {
  return {
      {"e3m0", 3, 0, false, false},         {"e2m0", 2, 0, false, false},
      {"e4m0", 4, 0, false, false},         {"e5m2", 5, 2, false, false},
      {"e5m2:ieee", 5, 2, false, false},    {"e5m2:ieee:inf", 5, 2, true, false},
      {"e3m4", 3, 4, false, false},         {"e3m4:inf", 3, 4, true, false},
      {"e4m3:ieee", 4, 3, false, false},    {"e4m3:ieee:inf", 4, 3, true, false},
      {"e6m9", 6, 9, false, false},         {"e8m1", 8, 1, false, false},
      {"e1m3", 1, 3, false, false},         {"e2m5:nosub", 2, 5, false, true},
      {"e3m3:nosub:inf", 3, 3, true, true}, {"e5m10", 5, 10, false, false},
      {"e7m2", 7, 2, false, false},         {"e8m0", 8, 0, false, false},
      {"e4m0:inf", 4, 0, true, false},
  };
}

class GenericReferenceTest : public ::testing::TestWithParam<GenericCase> {};

TEST_P(GenericReferenceTest, NearestOnGridProbes) {
  const GenericCase& c = GetParam();
  const RefFormat ref(c.x, c.m, c.inf, c.nosub);
  CheckGeneric(c, Rounding::kNearest, GridProbes(ref.AllValues()), "grid probes");
}

TEST_P(GenericReferenceTest, NearestOnRandomInputs) {
  const GenericCase& c = GetParam();
  const RefFormat ref(c.x, c.m, c.inf, c.nosub);
  const int lo = int(std::floor(std::log2(ref.min_positive()))) - 4;
  const int hi = int(std::floor(std::log2(ref.max()))) + 3;
  CheckGeneric(c, Rounding::kNearest,
               RandomInputs(1'000'000, 77 + c.x * 32 + c.m, lo, hi, float(ref.max())),
               "random inputs");
}

TEST_P(GenericReferenceTest, TowardZeroOnGridProbes) {
  const GenericCase& c = GetParam();
  const RefFormat ref(c.x, c.m, c.inf, c.nosub);
  CheckGeneric(c, Rounding::kZero, GridProbes(ref.AllValues()), "grid probes");
}

TEST_P(GenericReferenceTest, FormatMatchesReference) {
  // The values the library lists and its Info() agree with the reference grid.
  const GenericCase& c = GetParam();
  const RefFormat ref(c.x, c.m, c.inf, c.nosub);
  const Format f = MustParse(c.spec);
  const FormatInfo info = f.Info();
  EXPECT_EQ(info.bits, ref.bits());
  EXPECT_EQ(info.max_finite, ref.max());
  const std::vector<double> grid = ref.Grid();
  EXPECT_EQ(info.distinct_finite, 2 * grid.size() - 1);
  if (ref.bits() <= 16) {
    Result<std::vector<float>> values = f.Values();
    ASSERT_TRUE(values.ok());
    std::vector<double> expected;
    for (auto it = grid.rbegin(); it != grid.rend(); ++it) {
      if (*it != 0) expected.push_back(-*it);
    }
    for (double v : grid) expected.push_back(v);
    EXPECT_EQ(std::vector<double>(values->begin(), values->end()), expected);
  }
}

INSTANTIATE_TEST_SUITE_P(EXmY, GenericReferenceTest, ::testing::ValuesIn(GenericCases()),
                         [](const ::testing::TestParamInfo<GenericCase>& info) {
                           std::string name = info.param.spec;
                           for (char& ch : name) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace cpd::test
