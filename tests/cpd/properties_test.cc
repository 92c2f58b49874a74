// Properties every format must have: idempotence, monotonicity within a scale group, odd
// symmetry, the number of distinct outputs, unbiased stochastic rounding, rounding toward zero
// never growing a value, and results (statistics included) that do not depend on the thread
// count.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cpd/format.h"
#include "cpd/quantize.h"
#include "tests/cpd/format_test_util.h"

namespace cpd::test {
namespace {

// Every family: fixed floats, shared-exponent, log, integer, MX and block floating point.
const std::vector<std::string>& AllSpecs() {
  static const std::vector<std::string> specs = {"fp32",         "bf16",
                                                 "fp16",         "e4m3",
                                                 "e4m3:inf",     "e4m3:ieee",
                                                 "e5m2",         "e5m2:inf",
                                                 "e3m2",         "e2m3",
                                                 "e2m1",         "e3m0",
                                                 "e2m5:nosub",   "e8m1",
                                                 "fp134",        "fp143",
                                                 "fp152",        "fp134:ch",
                                                 "fp143:room=3", "fp152:room=0:ch",
                                                 "log4",         "log8:ch",
                                                 "int8",         "int4:ch",
                                                 "uint4:minmax", "uint8:minmax:ch",
                                                 "mxfp8",        "mxfp6",
                                                 "mxfp4",        "bfp8:16",
                                                 "bfp4:7"};
  return specs;
}

// Per-binade lists (binades:M0,M1,...): a float, fixed point per channel, a 9-bit hybrid, a list
// with a gap to zero and room 2, and log4's grid.
const std::vector<std::string>& BinadeSpecs() {
  static const std::vector<std::string> specs = {"binades:4x7,3,2,1,0", "binades:6,5,4,3,2,1,0:ch",
                                                 "binades:5,5,4x5,3,2,1,0:room=0",
                                                 "binades:3,3,3:room=2", "binades:0x7:room=0:ch"};
  return specs;
}

std::string TestName(const ::testing::TestParamInfo<std::string>& info) {
  std::string name = info.param;
  for (char& ch : name) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return name;
}

bool IsFixed(const Format& f) { return f.scope() == ScaleScope::kNone; }

// Channels used for :ch formats.
constexpr size_t kChannels = 4;

// Element counts: multiples of kChannels and of no block size (7, 16, 32), so the last block
// is partial. kSmallN spans several groups of every scope; kLargeN several 65536-element work
// chunks (> 2^18).
constexpr size_t kSmallN = 4 * (7 * 16 * 33 + 5);
constexpr size_t kLargeN = 4 * 65573;
static_assert(kSmallN % 7 != 0 && kSmallN % 16 != 0 && kSmallN % 32 != 0);
static_assert(kLargeN % 7 != 0 && kLargeN % 16 != 0 && kLargeN % 32 != 0);

// The index ranges [begin, end) that share one scale for n elements.
std::vector<std::pair<size_t, size_t>> ScaleGroups(const Format& f, size_t n) {
  std::vector<std::pair<size_t, size_t>> g;
  switch (f.scope()) {
    case ScaleScope::kNone:
    case ScaleScope::kTensor:
      g.push_back({0, n});
      break;
    case ScaleScope::kChannel:
      for (size_t c = 0; c < kChannels; ++c)
        g.push_back({c * n / kChannels, (c + 1) * n / kChannels});
      break;
    case ScaleScope::kBlock:
      for (size_t s = 0; s < n; s += f.block_size())
        g.push_back({s, std::min(n, s + f.block_size())});
      break;
  }
  return g;
}

QuantizeOptions OptionsFor(const Format& f) {
  QuantizeOptions o;
  o.channels = f.scope() == ScaleScope::kChannel ? kChannels : 1;
  return o;
}

// Finite inputs spread over a range that fits the format (for the fixed formats: from below the
// smallest subnormal to beyond the largest value), n a multiple of kChannels and of no block size.
std::vector<float> SpreadInputs(const Format& f, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const FormatInfo info = f.Info();
  int lo_exp = -20, hi_exp = 4;
  if (f.is_float_grid() && IsFixed(f)) {
    const double smallest = info.min_subnormal > 0 ? info.min_subnormal : info.min_normal;
    lo_exp = std::max(-149, int(std::floor(std::log2(smallest))) - 3);
    hi_exp = std::min(127, int(std::floor(std::log2(info.max_finite))) + 2);
  }
  std::uniform_int_distribution<int> e(lo_exp, hi_exp);
  std::uniform_real_distribution<float> m(1.0f, 2.0f);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) {
    x[i] = std::ldexp(m(rng), e(rng)) * ((rng() & 1) ? -1.0f : 1.0f);
    if (rng() % 50 == 0) x[i] = 0.0f;
  }
  return x;
}

// A value on the grid of every scaled format at scale 2^k (the anchor that fixes a group's
// scale): 1.5 * 2^k for float grids with a mantissa, 2^k for log<b>, 127 * 2^k for int8 ...
float Anchor(const Format& f, int k) {
  switch (f.family()) {
    case FormatFamily::kIntSymmetric:
      return float((1 << (f.bits() - 1)) - 1) * std::ldexp(1.0f, k);
    case FormatFamily::kUintMinMax:
      return float((1 << f.bits()) - 1) * std::ldexp(1.0f, k);
    case FormatFamily::kBinades:
      return std::ldexp(1.0f, k);  // the first value of binade `room` at shift k + room
    default:
      return f.grid().mbits == 0 ? std::ldexp(1.0f, k) : 1.5f * std::ldexp(1.0f, k);
  }
}

// Inputs whose group scales are exact powers of two that quantisation does not move: each group
// holds an anchor (its largest magnitude, on the grid) and, for uint minmax, a minimum at 0.
std::vector<float> AnchoredInputs(const Format& f, size_t n, uint64_t seed) {
  std::vector<float> x = SpreadInputs(f, n, seed);
  if (IsFixed(f)) return x;
  std::mt19937_64 rng(seed + 1);
  for (const auto& [b, e] : ScaleGroups(f, n)) {
    const int k = int(rng() % 9) - 4;
    const float anchor = Anchor(f, k);
    const float limit =
        f.family() == FormatFamily::kUintMinMax || f.family() == FormatFamily::kIntSymmetric
            ? anchor
            : std::ldexp(1.0f, k);
    for (size_t i = b; i < e; ++i) {
      // Keep every other element strictly below the anchor's magnitude.
      x[i] = std::fmod(x[i], limit);
      if (f.family() == FormatFamily::kUintMinMax) x[i] = std::fabs(x[i]);
    }
    x[b] = (f.family() != FormatFamily::kUintMinMax && (rng() & 1)) ? -anchor : anchor;
    if (f.family() == FormatFamily::kUintMinMax && e - b > 1) x[b + 1] = 0.0f;
  }
  return x;
}

// The scale metadata of every group, from Encode.
std::vector<uint8_t> Meta(const Format& f, const std::vector<float>& x, const QuantizeOptions& o) {
  PackedTensor p;
  EXPECT_TRUE(Encode(f, x.data(), x.size(), o, &p).ok());
  return std::vector<uint8_t>(p.bytes.begin() + long(PackedCodeBytes(f, x.size())), p.bytes.end());
}

class PropertyTest : public ::testing::TestWithParam<std::string> {};

TEST_P(PropertyTest, Idempotent) {
  const Format f = MustParse(GetParam());
  const QuantizeOptions o = OptionsFor(f);
  const size_t n = kSmallN;
  std::vector<float> x = AnchoredInputs(f, n, 11);
  if (IsFixed(f)) {
    // All of float32 but NaN (NaN inputs: see NanResultIsAFixedPoint), Inf included.
    x = Concat(x, RandomInputs(200000, 12, -150, 128, float(f.Info().max_finite)));
    x.erase(std::remove_if(x.begin(), x.end(), [](float v) { return std::isnan(v); }), x.end());
  }
  const std::vector<float> q = Q(f, x, o);
  const std::vector<float> qq = Q(f, q, o);
  if (!IsFixed(f)) {
    // The anchors fix the scales: quantising again must not change any of them.
    ASSERT_EQ(Meta(f, x, o), Meta(f, q, o)) << "the scale changed";
  }
  MismatchCounter bad(GetParam() + " Q(Q(x)) != Q(x)");
  for (size_t i = 0; i < x.size(); ++i) {
    if (!SameResult(q[i], qq[i])) {
      bad.Add() << "i = " << i << ", x = " << Show(x[i]) << ": Q(x) = " << Show(q[i])
                << ", Q(Q(x)) = " << Show(qq[i]);
    }
  }
}

// What a NaN input becomes (NaN, or +max / +Inf where the format has no NaN code) quantises to
// itself again.
class NanTest : public ::testing::TestWithParam<std::string> {};

TEST_P(NanTest, NanResultIsAFixedPoint) {
  const Format f = MustParse(GetParam());
  const std::vector<float> x = {FromBits(0x7fc00000u), FromBits(0xffc00000u), FromBits(0x7f800001u),
                                FromBits(0xff812345u)};
  const std::vector<float> q = Q(f, x);
  const std::vector<float> qq = Q(f, q);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_TRUE(SameResult(qq[i], q[i]))
        << "NaN " << Hex(Bits(x[i])) << ": Q(x) = " << Show(q[i]) << ", Q(Q(x)) = " << Show(qq[i]);
    EXPECT_TRUE(SameResult(q[i], q[0])) << "every NaN gives the same result";
  }
}

INSTANTIATE_TEST_SUITE_P(FixedFormats, NanTest,
                         ::testing::Values("fp32", "bf16", "fp16", "fp16:inf", "e4m3", "e4m3:inf",
                                           "e4m3:ieee", "e5m2", "e5m2:inf", "e3m2", "e2m3", "e2m1",
                                           "e3m0", "e3m0:inf", "e2m5:nosub", "e8m1"),
                         TestName);

// NaN comes out as the one canonical NaN 0x7fc00000 whatever made it (a NaN input of either sign
// or payload, or an overflow that becomes NaN, as -1000 does in e4m3:inf), from Quantize and
// from Decode(Encode(x)) alike, so that quantising a result again changes no bit.
TEST_P(PropertyTest, NanIsCanonicalAndQuantisingTwiceChangesNoBit) {
  const Format f = MustParse(GetParam());
  const QuantizeOptions o = OptionsFor(f);
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> x = {-1000.0f,
                          1000.0f,
                          -1e30f,
                          1e30f,
                          -inf,
                          inf,
                          -3.0e38f,
                          1.0f,
                          -0.5f,
                          FromBits(0xffc00000u),
                          FromBits(0x7fc00000u),
                          FromBits(0xff812345u),
                          FromBits(0x7f800001u),
                          FromBits(0xffffffffu),
                          0.0f,
                          -0.0f};
  x.resize(kChannels * 4, -2000.0f);
  const std::vector<float> q = Q(f, x, o);
  const std::vector<float> qq = Q(f, q, o);
  PackedTensor packed;
  ASSERT_TRUE(Encode(f, x.data(), x.size(), o, &packed).ok());
  std::vector<float> decoded(x.size());
  ASSERT_TRUE(Decode(f, packed, decoded.data()).ok());
  // A binades list without a NaN code makes NaN +max, in the top binade that room >= 1 keeps
  // empty; quantised again, that value moves the shift up one binade, and where the next binade
  // has fewer mantissa bits (fixed point, some hybrids) the values change by a step. A documented
  // property of such lists (docs/formats.md), not of the other formats: only they skip the second check.
  const std::vector<int> m = f.binade_mbits();
  const bool nan_moves_shift = f.family() == FormatFamily::kBinades && f.shift_rule().offset >= 1 &&
                               m.size() > 1 && m[0] > m[1];
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(q[i])) {
      EXPECT_EQ(Bits(q[i]), 0x7fc00000u) << "x = " << Show(x[i]) << ": Q(x) = " << Show(q[i]);
    }
    if (!nan_moves_shift) {
      EXPECT_EQ(Bits(qq[i]), Bits(q[i]))
          << "x = " << Show(x[i]) << ": Q(x) = " << Show(q[i]) << ", Q(Q(x)) = " << Show(qq[i]);
    }
    EXPECT_EQ(Bits(decoded[i]), Bits(q[i])) << "x = " << Show(x[i]) << ": Q(x) = " << Show(q[i])
                                            << ", Decode(Encode(x)) = " << Show(decoded[i]);
  }
}

// Every NaN code, positive or negative, decodes to the canonical NaN.
TEST(CanonicalNan, EveryNanCodeDecodesToTheCanonicalNan) {
  for (const char* spec : {"e4m3", "e4m3:inf", "e5m2", "fp16", "bf16", "e3m1", "e2m5:nosub"}) {
    const Format f = MustParse(spec);
    const size_t n = size_t(1) << f.bits();
    std::vector<uint32_t> codes(n);
    std::iota(codes.begin(), codes.end(), 0u);
    PackedTensor packed;
    packed.count = n;
    packed.bytes.assign(PackedSize(f, n, 1), 0);
    PackCodes(codes.data(), n, f.bits(), packed.bytes.data());
    std::vector<float> out(n);
    ASSERT_TRUE(Decode(f, packed, out.data()).ok()) << spec;
    size_t nans = 0;
    for (size_t c = 0; c < n; ++c) {
      if (!std::isnan(out[c])) continue;
      ++nans;
      EXPECT_EQ(Bits(out[c]), 0x7fc00000u) << spec << " code " << Hex(uint32_t(c));
    }
    EXPECT_GT(nans, 1u) << spec << " has NaN codes of both signs";
  }
}

TEST_P(PropertyTest, MonotoneWithinEachScaleGroup) {
  const Format f = MustParse(GetParam());
  const QuantizeOptions o = OptionsFor(f);
  const size_t n = kSmallN;
  std::vector<float> x = AnchoredInputs(f, n, 21);
  if (IsFixed(f)) {
    x = Concat(x, RandomInputs(100000, 22, -150, 128, float(f.Info().max_finite)));
    x.erase(std::remove_if(x.begin(), x.end(), [](float v) { return std::isnan(v); }), x.end());
    x.resize(x.size() / 4 * 4);
  }
  // Sorting within a group keeps its max and min, so the scales stay as they were.
  const auto groups = ScaleGroups(f, x.size());
  for (const auto& [b, e] : groups) std::sort(x.begin() + long(b), x.begin() + long(e));
  const std::vector<float> q = Q(f, x, o);
  MismatchCounter bad(GetParam() + " not monotone");
  size_t compared = 0;
  for (const auto& [b, e] : groups) {
    // NaN results (overflow with ':inf' in a format without Inf) are unordered: skipped.
    size_t last = e;
    for (size_t i = b; i < e; ++i) {
      if (std::isnan(q[i])) continue;
      if (last != e) {
        ++compared;
        if (!(q[last] <= q[i])) {
          bad.Add() << "x " << Show(x[last]) << " <= " << Show(x[i]) << " but Q " << Show(q[last])
                    << " > " << Show(q[i]);
        }
      }
      last = i;
    }
  }
  EXPECT_GT(compared, x.size() / 2);
}

TEST_P(PropertyTest, OddSymmetric) {
  const Format f = MustParse(GetParam());
  if (f.family() == FormatFamily::kUintMinMax) {
    // Not symmetric: the range is [min, max] of the data.
    const std::vector<float> x = {-1.0f, 0.3f, 2.0f};
    const std::vector<float> neg = {1.0f, -0.3f, -2.0f};
    EXPECT_NE(Q(f, neg)[1], -Q(f, x)[1]);
    return;
  }
  const QuantizeOptions o = OptionsFor(f);
  std::vector<float> x = SpreadInputs(f, kSmallN, 31);
  if (IsFixed(f)) {
    const float inf = std::numeric_limits<float>::infinity();
    x = Concat(x, {inf, 0.0f, std::numeric_limits<float>::max(), 1e-45f});
  }
  std::vector<float> neg(x.size());
  for (size_t i = 0; i < x.size(); ++i) neg[i] = -x[i];
  const std::vector<float> q = Q(f, x, o), qn = Q(f, neg, o);
  const bool linear = f.family() == FormatFamily::kIntSymmetric;
  MismatchCounter bad(GetParam() + " Q(-x) != -Q(x)");
  for (size_t i = 0; i < x.size(); ++i) {
    // Float grids keep the sign of zero; an integer level 0 is +0 either way; NaN (an overflow
    // in e4m3:inf) is the canonical NaN on both sides.
    const bool ok = linear ? qn[i] == -q[i] : Bits(qn[i]) == Bits(std::isnan(q[i]) ? q[i] : -q[i]);
    if (!ok)
      bad.Add() << "x = " << Show(x[i]) << ": Q(x) " << Show(q[i]) << ", Q(-x) " << Show(qn[i]);
  }
}

// Rounding toward zero never increases a magnitude, including beyond the largest value.
TEST_P(PropertyTest, TowardZeroNeverGrowsMagnitude) {
  const Format f = MustParse(GetParam());
  QuantizeOptions o = OptionsFor(f);
  o.rounding = Rounding::kZero;
  std::vector<float> x = AnchoredInputs(f, kSmallN, 41);
  if (IsFixed(f)) {
    x = Concat(x, RandomInputs(100000, 42, -150, 128, float(f.Info().max_finite)));
    x.erase(std::remove_if(x.begin(), x.end(), [](float v) { return !std::isfinite(v); }), x.end());
    x.resize(x.size() / 4 * 4);
  }
  const std::vector<float> q = Q(f, x, o);
  MismatchCounter bad(GetParam() + " |Q_zero(x)| > |x|");
  for (size_t i = 0; i < x.size(); ++i) {
    if (!(std::fabs(q[i]) <= std::fabs(x[i]))) {
      bad.Add() << "x = " << Show(x[i]) << " -> " << Show(q[i]);
    }
  }
}

// Identical results and statistics for 1 and 2 threads, over several 65536-element work chunks.
TEST_P(PropertyTest, ThreadCountDoesNotChangeResults) {
  const Format f = MustParse(GetParam());
  const size_t n = kLargeN;
  std::vector<float> x = SpreadInputs(f, n, 51);
  for (size_t i = 0; i < n; i += 1001) x[i] = (i % 3 == 0) ? NAN : INFINITY;
  for (Rounding r : {Rounding::kNearest, Rounding::kZero, Rounding::kStochastic}) {
    QuantizeOptions o = OptionsFor(f);
    o.rounding = r;
    o.seed = 5;
    o.step = 17;
    o.index_offset = 1000;
    QuantStats s1, s2;
    o.threads = 1;
    const std::vector<float> q1 = Q(f, x, o, &s1);
    o.threads = 2;
    const std::vector<float> q2 = Q(f, x, o, &s2);
    const std::vector<float> q2n = Q(f, x, o);  // without statistics
    MismatchCounter bad(GetParam() + "/" + RoundingName(r) + " 1 vs 2 threads");
    for (size_t i = 0; i < n; ++i) {
      if (Bits(q1[i]) != Bits(q2[i]) || Bits(q1[i]) != Bits(q2n[i])) {
        bad.Add() << "i = " << i << ": " << Show(q1[i]) << " vs " << Show(q2[i]) << " / "
                  << Show(q2n[i]);
      }
    }
    EXPECT_EQ(s1.count, n);
    EXPECT_EQ(s2.count, n);
    EXPECT_EQ(Bits(s1.max_abs), Bits(s2.max_abs));
    EXPECT_EQ(s1.saturated, s2.saturated);
    EXPECT_EQ(s1.flushed, s2.flushed);
    EXPECT_EQ(s1.nonfinite, s2.nonfinite);
    EXPECT_EQ(s1.nonfinite, (n + 1000) / 1001);
    EXPECT_EQ(std::memcmp(&s1.sq_error, &s2.sq_error, sizeof(double)), 0)
        << s1.sq_error << " vs " << s2.sq_error;
    EXPECT_EQ(std::memcmp(&s1.sq_input, &s2.sq_input, sizeof(double)), 0)
        << s1.sq_input << " vs " << s2.sq_input;
    // Encode too.
    PackedTensor p1, p2;
    o.threads = 1;
    ASSERT_TRUE(Encode(f, x.data(), n, o, &p1).ok());
    o.threads = 2;
    ASSERT_TRUE(Encode(f, x.data(), n, o, &p2).ok());
    EXPECT_TRUE(p1.bytes == p2.bytes);
  }
}

// Quantising in place (out == in) gives the same values and the same statistics, which are
// over the inputs, not the outputs.
TEST_P(PropertyTest, InPlaceGivesTheSameResultsAndStatistics) {
  const Format f = MustParse(GetParam());
  const size_t n = kLargeN;
  std::vector<float> x = SpreadInputs(f, n, 71);
  for (size_t i = 0; i < n; i += 997) x[i] = (i % 2 == 0) ? NAN : -INFINITY;
  for (Rounding r : {Rounding::kNearest, Rounding::kZero, Rounding::kStochastic}) {
    QuantizeOptions o = OptionsFor(f);
    o.rounding = r;
    o.seed = 3;
    QuantStats a, b;
    const std::vector<float> q = Q(f, x, o, &a);
    std::vector<float> y = x;
    ASSERT_TRUE(Quantize(f, y.data(), y.data(), n, o, &b).ok());
    MismatchCounter bad(GetParam() + "/" + RoundingName(r) + " in place");
    for (size_t i = 0; i < n; ++i) {
      if (!SameResult(q[i], y[i]))
        bad.Add() << "i = " << i << ": " << Show(q[i]) << " vs " << Show(y[i]);
    }
    EXPECT_EQ(Bits(a.max_abs), Bits(b.max_abs)) << RoundingName(r);
    EXPECT_EQ(a.saturated, b.saturated) << RoundingName(r);
    EXPECT_EQ(a.flushed, b.flushed) << RoundingName(r);
    EXPECT_EQ(a.nonfinite, b.nonfinite) << RoundingName(r);
    EXPECT_EQ(a.sq_error, b.sq_error) << RoundingName(r);
    EXPECT_EQ(a.sq_input, b.sq_input) << RoundingName(r);
  }
}

// Statistics are what they say: counts of saturated, flushed and non-finite inputs, max |x|
// and the squared errors, checked against a direct computation.
TEST_P(PropertyTest, StatisticsMatchADirectCount) {
  const Format f = MustParse(GetParam());
  const QuantizeOptions o = OptionsFor(f);
  std::vector<float> x = SpreadInputs(f, kSmallN, 61);
  x[5] = NAN;
  x[6] = -INFINITY;
  x[7] = 1e-42f;
  QuantStats st;
  const std::vector<float> q = Q(f, x, o, &st);
  uint64_t flushed = 0, nonfinite = 0;
  double sq_error = 0, sq_input = 0;
  float max_abs = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isnan(x[i])) max_abs = std::max(max_abs, std::fabs(x[i]));
    if (!std::isfinite(x[i])) {
      ++nonfinite;
      continue;
    }
    if (x[i] != 0 && q[i] == 0) ++flushed;
    if (std::isfinite(q[i])) {
      sq_error += (double(q[i]) - double(x[i])) * (double(q[i]) - double(x[i]));
      sq_input += double(x[i]) * double(x[i]);
    }
  }
  EXPECT_EQ(st.count, x.size());
  EXPECT_EQ(st.max_abs, max_abs);
  EXPECT_EQ(st.nonfinite, nonfinite);
  EXPECT_EQ(st.flushed, flushed);
  EXPECT_GE(st.saturated, 1u);  // the -Inf input at least
  EXPECT_NEAR(st.sq_error, sq_error, 1e-9 * sq_error + 1e-300);
  EXPECT_NEAR(st.sq_input, sq_input, 1e-9 * sq_input);
  EXPECT_NEAR(st.relative_error(), std::sqrt(sq_error / sq_input), 1e-9);
}

INSTANTIATE_TEST_SUITE_P(AllFamilies, PropertyTest, ::testing::ValuesIn(AllSpecs()), TestName);
INSTANTIATE_TEST_SUITE_P(Binades, PropertyTest, ::testing::ValuesIn(BinadeSpecs()), TestName);

// ---- The set of outputs is exactly the format's values ---------------------------------------
class DistinctValuesTest : public ::testing::TestWithParam<std::string> {};

TEST_P(DistinctValuesTest, DenseSweepHitsExactlyTheValues) {
  const Format f = MustParse(GetParam());
  ASSERT_LE(f.bits(), 8);
  const FormatInfo info = f.Info();
  // Every float32 with its top 12 mantissa bits stepped (and the last pattern of each step)
  // in every binade from far below the smallest value to far above the largest: this passes
  // through every grid point and every interval between neighbours (M <= 7 here).
  const double smallest = info.min_subnormal > 0 ? info.min_subnormal : info.min_normal;
  const int lo = std::max(0, int(std::floor(std::log2(smallest))) + 127 - 4);
  const int hi = std::min(254, int(std::floor(std::log2(info.max_finite))) + 127 + 4);
  std::vector<float> x = {0.0f, -0.0f, std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()};
  for (int e = lo; e <= hi; ++e) {
    for (uint32_t m = 0; m < (1u << 23); m += (1u << 11)) {
      for (uint32_t tail : {0u, (1u << 11) - 1u}) {
        const uint32_t u = (uint32_t(e) << 23) | m | tail;
        x.push_back(FromBits(u));
        x.push_back(FromBits(u | 0x80000000u));
      }
    }
  }
  for (Rounding r : {Rounding::kNearest, Rounding::kZero}) {
    QuantizeOptions o;
    o.rounding = r;
    const std::vector<float> q = Q(f, x, o);
    std::set<float> seen;
    for (float v : q) {
      if (std::isfinite(v)) seen.insert(v == 0 ? 0.0f : v);
    }
    Result<std::vector<float>> values = f.Values();
    ASSERT_TRUE(values.ok());
    EXPECT_EQ(std::vector<float>(seen.begin(), seen.end()), *values) << RoundingName(r);
    EXPECT_EQ(seen.size(), info.distinct_finite) << RoundingName(r);
  }
}

INSTANTIATE_TEST_SUITE_P(FixedFormats, DistinctValuesTest,
                         ::testing::Values("e4m3", "e4m3:inf", "e4m3:ieee", "e5m2", "e5m2:inf",
                                           "e3m2", "e2m3", "e2m1", "e3m0", "e2m0", "e4m0", "e7m0",
                                           "e3m4", "e1m3", "e1m6", "e2m5:nosub", "e3m3:nosub:inf",
                                           "e6m1"),
                         TestName);

// ---- Stochastic rounding is unbiased ---------------------------------------------------------
struct SrCase {
  std::string spec;
  float x;
  float lo, hi;  // the grid neighbours of x
  float anchor;  // 0, or a value placed every `period` elements to fix the scale
  size_t period;
  float anchor2 = 0;  // uint minmax: the minimum
};

void PrintTo(const SrCase& c, std::ostream* os) { *os << c.spec << " x=" << c.x; }

class StochasticTest : public ::testing::TestWithParam<SrCase> {};

TEST_P(StochasticTest, UnbiasedOverDraws) {
  const SrCase& c = GetParam();
  const Format f = MustParse(c.spec);
  // 1000 seeds x 1000 indices = 10^6 draws of the same x.
  constexpr size_t kPerCall = 1000;
  constexpr int kSeeds = 1000;
  std::vector<float> x(kPerCall, c.x);
  std::vector<bool> is_anchor(kPerCall, false);
  if (c.period > 0) {
    for (size_t i = 0; i < kPerCall; i += c.period) {
      x[i] = c.anchor;
      is_anchor[i] = true;
      if (c.anchor2 != 0 || f.family() == FormatFamily::kUintMinMax) {
        x[i + 1] = c.anchor2;
        is_anchor[i + 1] = true;
      }
    }
  }
  // The neighbours are what toward-zero rounding and one step up give.
  QuantizeOptions zero;
  zero.rounding = Rounding::kZero;
  const std::vector<float> qz = Q(f, x, zero);
  ASSERT_EQ(qz[kPerCall - 1], std::fabs(c.lo) < std::fabs(c.hi) ? c.lo : c.hi);
  double sum = 0;
  size_t count = 0, ups = 0;
  MismatchCounter bad(c.spec + " stochastic outcomes");
  for (int seed = 0; seed < kSeeds; ++seed) {
    QuantizeOptions o;
    o.rounding = Rounding::kStochastic;
    o.seed = uint64_t(seed) * 7919 + 1;
    o.index_offset = uint64_t(seed) * 1000003;
    const std::vector<float> q = Q(f, x, o);
    for (size_t i = 0; i < kPerCall; ++i) {
      if (is_anchor[i]) {
        if (q[i] != x[i]) bad.Add() << "anchor " << Show(x[i]) << " -> " << Show(q[i]);
        continue;
      }
      if (q[i] != c.lo && q[i] != c.hi) bad.Add() << "x = " << Show(c.x) << " -> " << Show(q[i]);
      sum += double(q[i]);
      ups += q[i] == c.hi;
      ++count;
    }
  }
  const double p = (double(c.x) - c.lo) / (double(c.hi) - c.lo);
  const double sigma = std::fabs(double(c.hi) - c.lo) * std::sqrt(p * (1 - p) / double(count));
  const double mean = sum / double(count);
  EXPECT_LE(std::fabs(mean - double(c.x)), 4 * sigma + 1e-12 * std::fabs(c.x))
      << "mean " << mean << " for x " << c.x << " (p " << p << ", ups " << ups << " of " << count
      << ", sigma " << sigma << ")";
  EXPECT_GE(count, 800000u);
}

const float kE4m3Sub = std::ldexp(1.0f, -9);  // the e4m3 subnormal step

INSTANTIATE_TEST_SUITE_P(
    Formats, StochasticTest,
    ::testing::Values(
        SrCase{"e4m3", 1.3f, 1.25f, 1.375f, 0, 0}, SrCase{"e4m3", -0.3f, -0.28125f, -0.3125f, 0, 0},
        SrCase{"e4m3", 0.01f, 5 * kE4m3Sub, 6 * kE4m3Sub, 0, 0},          // subnormal range
        SrCase{"e4m3", 3 * std::ldexp(1.0f, -25), 0.0f, kE4m3Sub, 0, 0},  // far below a step
        SrCase{"e4m3", -1e-4f, -0.0f, -kE4m3Sub, 0, 0},
        SrCase{"e4m3", 440.0f, 416.0f, 448.0f, 0, 0}, SrCase{"e2m1", 2.4f, 2.0f, 3.0f, 0, 0},
        SrCase{"e2m1", 0.1f, 0.0f, 0.5f, 0, 0},
        SrCase{"e5m2", 1.5f * std::ldexp(1.0f, -18), 0.0f, std::ldexp(1.0f, -16), 0, 0},
        SrCase{"bf16", 1.005859375f, 1.0f, 1.0078125f, 0, 0},
        SrCase{"fp16", 1e-6f, 16 * std::ldexp(1.0f, -24), 17 * std::ldexp(1.0f, -24), 0, 0},
        SrCase{"int8", 0.3f, 19.0f / 64, 20.0f / 64, 127.0f / 64, 1000},
        SrCase{"int4:ch", -0.7f, -0.5f, -0.75f, 7.0f / 4, 1000},
        SrCase{"uint4:minmax", 7.3f, 7.0f, 8.0f, 15.0f, 1000, 0.0f},
        SrCase{"mxfp4", 2.4f, 2.0f, 3.0f, 6.0f, 32}, SrCase{"bfp4:7", 0.6f, 0.5f, 0.75f, 1.0f, 7},
        SrCase{"log4", 0.3f, 0.25f, 0.5f, 1.0f, 1000},
        SrCase{"fp134", 0.3f, 0.296875f, 0.3125f, 1.5f, 1000},
        SrCase{"binades:3,3,3:room=0", 0.3f, 0.28125f, 0.3125f, 1.5f, 1000},
        SrCase{"binades:3,3,3:room=0", 0.1f, 0.0f, 0.25f, 1.5f, 1000},  // in the gap to zero
        SrCase{"binades:6,5,4,3,2,1,0", -0.3f, -0.28125f, -0.3125f, 1.5f, 1000}),
    [](const ::testing::TestParamInfo<SrCase>& info) {
      return "Case" + std::to_string(info.index);
    });

}  // namespace
}  // namespace cpd::test
