// The per-binade format family binades:M0,M1,... (Lee, Park, Jeon, ICLR 2022):
//  * fp134/fp143/fp152 and log<b> equal the binades specs of their lists bit for bit (values,
//    codes, statistics, packed bytes; nearest, stochastic and toward-zero rounding, hysteresis),
//    per element through the kernels at many shifts and through cpd::Quantize/Encode/Decode/
//    QuantizeHysteresis on 10^6+ inputs;
//  * an independent scalar reference, written from the definition (the sorted grid values, the
//    neighbours of the input, distances, ties to the even code, the stochastic draw from the
//    probability), agrees bit for bit with the fast path for hand-picked lists;
//  * hand-checked ties where the even code is not float-bit RNE's choice; parsing, canonical
//    spellings and bit counts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cpd/format.h"
#include "cpd/quantize.h"
#include "kernels/grid.h"
#include "kernels/quantize_cpu.h"
#include "tests/cpd/format_test_util.h"

namespace cpd::test {
namespace {

using kernels::BinadeGrid;
using kernels::ElementStats;
using kernels::FloatGrid;
using kernels::LoopParams;
using kernels::RoundMode;

constexpr float kInf = std::numeric_limits<float>::infinity();

std::string Name(std::string s) {
  for (char& ch : s) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return s;
}

// The non-negative values of a format at unit scale, ascending, 0 first (from Values()).
std::vector<double> NonNegativeValues(const Format& f) {
  const Result<std::vector<float>> values = f.Values();
  EXPECT_TRUE(values.ok()) << f.spec();
  std::vector<double> v;
  for (float x : *values) {
    if (x >= 0) v.push_back(double(x));
  }
  return v;
}

// Inputs around every value and midpoint of `grid` (non-negative, ascending) scaled by 2^s,
// both signs, plus non-finite values: GridProbes at scale 2^s.
std::vector<float> ScaledProbes(const std::vector<double>& grid, int s) {
  std::vector<double> g;
  for (double v : grid) g.push_back(std::ldexp(v, s));
  return GridProbes(g);
}

// Inputs of one scale group whose shift is known: `anchor_exp` = floor(log2 max |x|). Keeps the
// probes below 2^(anchor_exp + 1) and adds the anchor 2^anchor_exp; non-finite probes stay (the
// scale ignores them).
std::vector<float> AnchoredProbes(const std::vector<float>& probes, int anchor_exp) {
  std::vector<float> out;
  const double limit = std::ldexp(1.0, anchor_exp + 1);
  for (float p : probes) {
    if (!std::isfinite(p) || std::fabs(double(p)) < limit) out.push_back(p);
  }
  out.push_back(std::ldexp(1.0f, anchor_exp));
  return out;
}

// n inputs of one scale group with floor(log2 max|finite x|) = top: mostly values with random
// sign and mantissa and an exponent in [top - span, top], some zeros, float32 subnormals,
// +-Inf and NaNs, and random bit patterns below 2^(top+1).
std::vector<float> GroupInputs(size_t n, int top, int span, std::mt19937_64& rng) {
  std::vector<float> x(n);
  const uint32_t top_field = uint32_t(std::clamp(top + 127, 1, 254));
  for (size_t i = 0; i < n; ++i) {
    const uint64_t r = rng();
    const uint32_t kind = uint32_t(r >> 56);
    const uint32_t bits = uint32_t(r);
    if (kind < 200) {
      const int e = std::max(-149, top - int((r >> 32) % uint64_t(span + 1)));
      const float v = std::ldexp(1.0f + float(bits & 0x7fffffu) * 0x1p-23f, e);
      x[i] = (bits >> 31) != 0 ? -v : v;
    } else if (kind < 210) {
      x[i] = (bits & 1) != 0 ? -0.0f : 0.0f;
    } else if (kind < 220) {
      x[i] = FromBits((bits & 0x807fffffu) | 1u);  // a float32 subnormal
    } else if (kind < 226) {
      const uint32_t special[] = {0x7f800000u, 0xff800000u, 0x7fc00000u,
                                  0xffc00000u, 0x7f800001u, 0xff812345u};
      x[i] = FromBits(special[bits % 6]);
    } else {
      // Any pattern whose exponent field is at most the top's.
      const uint32_t field = (bits >> 23 & 0xffu) % (top_field + 1);
      x[i] = FromBits((bits & 0x807fffffu) | (field << 23));
    }
  }
  // The anchor: max |finite x| in [2^top, 2^(top+1)).
  x[n / 2] = std::ldexp(1.75f, top);
  return x;
}

// ---- 1. fp134/fp143/fp152 and log<b> are binades lists ---------------------------------------

struct ListPair {
  std::string named;    // fp134, log4, ...
  std::string binades;  // the same grid as a binades spec
};

void PrintTo(const ListPair& p, std::ostream* os) { *os << p.named << " = " << p.binades; }

const std::vector<ListPair>& FloatLists() {
  static const std::vector<ListPair> pairs = {
      {"fp134", "binades:4,4,4,4,4,4,4,3,2,1,0"},
      {"fp143", "binades:3x15,2,1,0"},
      {"fp152", "binades:2x31,1,0"},
  };
  return pairs;
}

// Kernel level: every element of the probes at several shifts, and 10^6 random float32 bit
// patterns, rounded by QuantizeFloatGrid on the fp1xy grid and by QuantizeBinadeGrid on the
// list, in every rounding mode: the same floats, codes and statistics. Hysteresis and decoding
// of every code likewise.
class KernelEquality : public ::testing::TestWithParam<ListPair> {};

TEST_P(KernelEquality, SameValuesCodesAndStatisticsAtEveryShift) {
  const Format named = MustParse(GetParam().named);
  const Format bin = MustParse(GetParam().binades);
  ASSERT_EQ(bin.bits(), named.bits());
  const FloatGrid& fg = named.grid();
  const BinadeGrid& bg = bin.binade_grid();
  const std::vector<double> grid = NonNegativeValues(named);
  ASSERT_EQ(grid, NonNegativeValues(bin));
  const std::vector<float> random = RandomInputs(1 << 20, 17, -160, 128, 2.0f);
  size_t compared = 0;
  for (int shift : {0, 1, -3, 7, 60, -100, 127, -126}) {
    std::vector<float> x = Concat(ScaledProbes(grid, shift), random);
    const size_t n = x.size();
    for (RoundMode mode : {RoundMode::kNearestEven, RoundMode::kStochastic, RoundMode::kTowardZero,
                           RoundMode::kDown, RoundMode::kUp}) {
      LoopParams p;
      p.mode = mode;
      p.rng_key = kernels::MakeRandomKey(uint64_t(shift + 1000), 5);
      p.index_base = 12345;
      std::vector<float> out_f(n), out_b(n);
      std::vector<uint32_t> code_f(n), code_b(n);
      ElementStats st_f, st_b;
      kernels::QuantizeFloatGrid(x.data(), out_f.data(), code_f.data(), n, fg, shift, p, &st_f);
      kernels::QuantizeBinadeGrid(x.data(), out_b.data(), code_b.data(), n, bg, shift, p, &st_b);
      MismatchCounter bad(GetParam().binades + " shift " + std::to_string(shift) + " mode " +
                          std::to_string(int(mode)));
      for (size_t i = 0; i < n; ++i) {
        if (Bits(out_f[i]) != Bits(out_b[i]) || code_f[i] != code_b[i]) {
          bad.Add() << "x = " << Show(x[i]) << ": " << GetParam().named << " " << Show(out_f[i])
                    << " code " << code_f[i] << ", binades " << Show(out_b[i]) << " code "
                    << code_b[i];
        }
      }
      EXPECT_EQ(Bits(st_f.max_abs), Bits(st_b.max_abs));
      EXPECT_EQ(st_f.saturated, st_b.saturated);
      EXPECT_EQ(st_f.flushed, st_b.flushed);
      EXPECT_EQ(st_f.nonfinite, st_b.nonfinite);
      EXPECT_EQ(std::memcmp(&st_f.sq_error, &st_b.sq_error, 8), 0);
      EXPECT_EQ(std::memcmp(&st_f.sq_input, &st_b.sq_input, 8), 0);
      compared += n;
    }
    // Hysteresis from a previous state: the values rounded to nearest of shuffled inputs.
    std::vector<float> prev(n);
    std::vector<float> shuffled = x;
    std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937_64(uint64_t(shift) + 3));
    LoopParams nearest;
    kernels::QuantizeFloatGrid(shuffled.data(), prev.data(), nullptr, n, fg, shift, nearest,
                               nullptr);
    std::vector<float> q_f = prev, q_b = prev;
    ElementStats hs_f, hs_b;
    const uint64_t flips_f =
        kernels::HysteresisFloatGrid(x.data(), q_f.data(), n, fg, shift, &hs_f);
    const uint64_t flips_b =
        kernels::HysteresisBinadeGrid(x.data(), q_b.data(), n, bg, shift, &hs_b);
    EXPECT_EQ(flips_f, flips_b);
    EXPECT_GT(flips_f, 0u);
    MismatchCounter bad_h(GetParam().binades + " hysteresis shift " + std::to_string(shift));
    for (size_t i = 0; i < n; ++i) {
      if (!SameResult(q_f[i], q_b[i])) {
        bad_h.Add() << "w = " << Show(x[i]) << ", held " << Show(prev[i]) << ": " << Show(q_f[i])
                    << " vs " << Show(q_b[i]);
      }
    }
    EXPECT_EQ(hs_f.saturated, hs_b.saturated);
    EXPECT_EQ(hs_f.flushed, hs_b.flushed);
    EXPECT_EQ(hs_f.sq_error, hs_b.sq_error);
    // Every code decodes to the same value.
    std::vector<uint32_t> all(size_t(1) << named.bits());
    for (uint32_t c = 0; c < all.size(); ++c) all[c] = c;
    std::vector<float> d_f(all.size()), d_b(all.size());
    kernels::DecodeFloatGridSpan(all.data(), d_f.data(), all.size(), fg, shift);
    kernels::DecodeBinadeGridSpan(all.data(), d_b.data(), all.size(), bg, shift);
    for (size_t c = 0; c < all.size(); ++c) {
      EXPECT_EQ(Bits(d_f[c]), Bits(d_b[c])) << "code " << c << " shift " << shift;
    }
  }
  EXPECT_GT(compared, size_t(40'000'000));
}

INSTANTIATE_TEST_SUITE_P(Lists, KernelEquality,
                         ::testing::Values(FloatLists()[0], FloatLists()[1], FloatLists()[2],
                                           ListPair{"log4", "binades:0x7"},
                                           ListPair{"log8", "binades:0x127"}),
                         [](const ::testing::TestParamInfo<ListPair>& i) { return i.param.named; });

// Library level: cpd::Quantize (nearest, stochastic with two seeds, toward zero, with
// statistics), Encode (packed codes and shift bytes), Decode and QuantizeHysteresis give the
// same bits for the named format and its binades spec with the same room and scope.
std::vector<ListPair> LibraryCases() {
  std::vector<ListPair> cases;
  for (const ListPair& p : FloatLists()) {
    for (const char* s :
         {"", ":room=0", ":room=2", ":room=-1", ":ch", ":room=0:ch", ":room=2:ch"}) {
      cases.push_back({p.named + s, p.binades + s});
    }
  }
  // log<b> has room 0: the zero-bit lists with :room=0, per tensor (the policy's per-layer
  // default outside training, and :tensor) or per channel (:ch).
  for (const auto& [log, list] :
       std::vector<std::pair<std::string, std::string>>{{"log2", "binades:0"},
                                                        {"log4", "binades:0x7"},
                                                        {"log5", "binades:0x15"},
                                                        {"log8", "binades:0x127"}}) {
    cases.push_back({log, list + ":room=0"});
    cases.push_back({log + ":tensor", list + ":room=0"});
    cases.push_back({log + ":ch", list + ":room=0:ch"});
  }
  return cases;
}

void ExpectSameStats(const QuantStats& a, const QuantStats& b, const std::string& what) {
  EXPECT_EQ(a.count, b.count) << what;
  EXPECT_EQ(Bits(a.max_abs), Bits(b.max_abs)) << what;
  EXPECT_EQ(a.saturated, b.saturated) << what;
  EXPECT_EQ(a.flushed, b.flushed) << what;
  EXPECT_EQ(a.nonfinite, b.nonfinite) << what;
  EXPECT_EQ(std::memcmp(&a.sq_error, &b.sq_error, 8), 0) << what;
  EXPECT_EQ(std::memcmp(&a.sq_input, &b.sq_input, 8), 0) << what;
}

void ExpectSameFloats(const std::vector<float>& a, const std::vector<float>& b,
                      const std::vector<float>& x, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  MismatchCounter bad(what);
  for (size_t i = 0; i < a.size(); ++i) {
    if (Bits(a[i]) != Bits(b[i])) {
      bad.Add() << "i = " << i << ", x = " << Show(x[i]) << ": " << Show(a[i]) << " vs "
                << Show(b[i]);
    }
  }
}

class LibraryEquality : public ::testing::TestWithParam<ListPair> {};

TEST_P(LibraryEquality, SameBitsValuesStatisticsAndPackedBytes) {
  const Format named = MustParse(GetParam().named);
  const Format bin = MustParse(GetParam().binades);
  ASSERT_EQ(named.scope(), bin.scope());
  ASSERT_EQ(named.bits(), bin.bits());
  ASSERT_EQ(named.shift_rule().offset, bin.shift_rule().offset);
  const std::vector<double> grid = NonNegativeValues(named);
  const int room = named.shift_rule().offset;
  // Four groups (channels, or four tensors one after the other for per-tensor scope), each
  // with its own scale: random inputs over 40 binades below the anchor, and the probes of the
  // grid at the shift in force.
  const size_t channels = named.scope() == ScaleScope::kChannel ? 4 : 1;
  std::mt19937_64 rng(99);
  const int tops[4] = {0, 13, -37, 100};
  std::vector<std::vector<float>> groups;
  size_t longest = 0;
  for (int g = 0; g < 4; ++g) {
    std::vector<float> x = GroupInputs(270000, tops[g], 45, rng);
    x = Concat(x, AnchoredProbes(ScaledProbes(grid, tops[g] + room), tops[g]));
    longest = std::max(longest, x.size());
    groups.push_back(std::move(x));
  }
  std::vector<std::vector<float>> tensors;
  if (channels == 4) {
    std::vector<float> all;
    for (auto& x : groups) {
      x.resize(longest, 0.0f);
      all = Concat(all, x);
    }
    tensors.push_back(std::move(all));
  } else {
    tensors = groups;
  }
  size_t inputs = 0;
  for (const std::vector<float>& x : tensors) {
    const size_t n = x.size();
    inputs += n;
    QuantizeOptions base;
    base.channels = channels;
    base.index_offset = 7;
    struct Run {
      Rounding r;
      uint64_t seed;
    };
    for (const Run run : {Run{Rounding::kNearest, 0}, Run{Rounding::kStochastic, 1},
                          Run{Rounding::kStochastic, 2}, Run{Rounding::kZero, 0}}) {
      QuantizeOptions o = base;
      o.rounding = run.r;
      o.seed = run.seed;
      o.step = 11;
      const std::string what =
          bin.spec() + " " + RoundingName(run.r) + " seed " + std::to_string(run.seed);
      QuantStats sn, sb;
      const std::vector<float> qn = Q(named, x, o, &sn), qb = Q(bin, x, o, &sb);
      ExpectSameFloats(qn, qb, x, what);
      ExpectSameStats(sn, sb, what);
      PackedTensor pn, pb;
      ASSERT_TRUE(Encode(named, x.data(), n, o, &pn).ok());
      ASSERT_TRUE(Encode(bin, x.data(), n, o, &pb).ok());
      EXPECT_TRUE(pn.bytes == pb.bytes) << what << ": packed codes or shift bytes differ";
      std::vector<float> dn(n), db(n);
      ASSERT_TRUE(Decode(named, pn, dn.data()).ok());
      ASSERT_TRUE(Decode(bin, pb, db.data()).ok());
      ExpectSameFloats(dn, db, x, what + " decode");
      ExpectSameFloats(qb, db, x, what + " Decode(Encode) vs Quantize");
    }
    // Hysteresis: weights moved from x, held values Quantize(x).
    std::vector<float> w = x;
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& v : w) {
      if (std::isfinite(v)) v += v * 0.1f * normal(rng);
    }
    std::vector<float> hn = Q(named, x, base), hb = hn;
    QuantStats sn, sb;
    uint64_t fn = 0, fb = 0;
    ASSERT_TRUE(QuantizeHysteresis(named, w.data(), hn.data(), n, base, &sn, &fn).ok());
    ASSERT_TRUE(QuantizeHysteresis(bin, w.data(), hb.data(), n, base, &sb, &fb).ok());
    ExpectSameFloats(hn, hb, w, bin.spec() + " hysteresis");
    ExpectSameStats(sn, sb, bin.spec() + " hysteresis");
    EXPECT_EQ(fn, fb);
    EXPECT_GT(fn, 0u);
  }
  EXPECT_GT(inputs, size_t(1'000'000));
}

INSTANTIATE_TEST_SUITE_P(Lists, LibraryEquality, ::testing::ValuesIn(LibraryCases()),
                         [](const ::testing::TestParamInfo<ListPair>& i) {
                           return Name(i.param.named);
                         });

// ---- 2. An independent reference, from the definition ---------------------------------------

// The grid of a list: every value (1 + k / 2^M_i) * 2^-i, sorted, zero first; a value's index is
// its magnitude code.
struct RefFormat {
  std::vector<double> values;
  int bits = 0;
  int room = 1;
  bool per_channel = false;
};

RefFormat MakeRef(const std::vector<int>& mbits, int room, bool per_channel) {
  RefFormat f;
  f.values.push_back(0.0);
  for (size_t i = 0; i < mbits.size(); ++i) {
    for (int k = 0; k < (1 << mbits[i]); ++k) {
      f.values.push_back((1.0 + std::ldexp(double(k), -mbits[i])) * std::ldexp(1.0, -int(i)));
    }
  }
  std::sort(f.values.begin(), f.values.end());
  int mag_bits = 0;
  while ((size_t(1) << mag_bits) < f.values.size()) ++mag_bits;
  f.bits = 1 + mag_bits;
  f.room = room;
  f.per_channel = per_channel;
  return f;
}

struct RefResult {
  float value;
  uint32_t code;
  bool saturated, flushed, nonfinite;
};

// Rounds the (already scaled) float y onto the unscaled grid.
// Stochastic rounding (the contract of the fast path, written as a probability): with lo <= |y|
// < hi the neighbours, the draw rounds up with probability p = (|y| - lo) / (hi - lo). The
// random bits give a uniform U in [0, 1): when the step hi - lo is at most 2^31 units of |y|'s
// float32 spacing (r = log2 of that ratio, an integer), U is the top r bits of rnd >> 1 read as a
// binary fraction and the value rounds up iff U >= 1 - p (p * 2^r is then an integer, so this is
// exact); for a coarser step (r >= 32), U = rnd / 2^32 and it rounds up iff U < p (at 2^-32
// resolution: rnd < floor(p * 2^32)).
RefResult RefRound(float y, const RefFormat& f, RoundMode mode, uint32_t rnd) {
  const std::vector<double>& v = f.values;
  const uint32_t sign_bit = 1u << (f.bits - 1);
  const uint32_t max_code = uint32_t(v.size() - 1);
  RefResult out{};
  if (std::isnan(y)) {
    out.value = float(v.back());
    out.code = max_code;
    out.nonfinite = true;
    return out;
  }
  const bool neg = std::signbit(y);
  const double a = std::fabs(double(y));
  out.nonfinite = std::isinf(y);
  size_t code;
  if (a > v.back()) {
    code = max_code;  // all codes are finite: saturate in every mode
    out.saturated = true;
  } else {
    const size_t hi = size_t(std::lower_bound(v.begin(), v.end(), a) - v.begin());
    if (v[hi] == a) {
      code = hi;
    } else {
      const size_t lo = hi - 1;
      bool up = false;
      switch (mode) {
        case RoundMode::kNearestEven: {
          const double twice = 2 * a, sum = v[lo] + v[hi];  // exact: neighbours differ by <= 2x
          up = twice > sum || (twice == sum && hi % 2 == 0);
          break;
        }
        case RoundMode::kTowardZero:
          up = false;
          break;
        case RoundMode::kDown:
          up = neg;
          break;
        case RoundMode::kUp:
          up = !neg;
          break;
        case RoundMode::kStochastic: {
          const double step = v[hi] - v[lo];
          const double p = (a - v[lo]) / step;  // exact: a power-of-two step
          const double spacing = a >= 0x1p-126 ? std::ldexp(1.0, std::ilogb(a) - 23) : 0x1p-149;
          const int r = std::ilogb(step / spacing);
          if (r <= 31) {
            const double u = std::ldexp(double((rnd >> 1) >> (31 - r)), -r);
            up = u >= 1.0 - p;
          } else {
            up = double(rnd) < std::floor(std::ldexp(p, 32));
          }
          break;
        }
      }
      code = up ? hi : lo;
    }
  }
  out.value = float(v[code]);
  if (neg) out.value = -out.value;
  out.code = uint32_t(code) | (neg ? sign_bit : 0u);
  out.flushed = a != 0 && std::isfinite(y) && code == 0;
  return out;
}

// cpd::Quantize by the reference: the shift of each group from its largest finite |x|, each
// element scaled by 2^-s, rounded, scaled back (float32 products, as every scaled format).
struct RefTensor {
  std::vector<float> values;
  std::vector<uint32_t> codes;
  std::vector<int> shifts;
  uint64_t saturated = 0, flushed = 0, nonfinite = 0;
};

int RefShift(const std::vector<float>& x, size_t b, size_t e, int room) {
  double mx = 0;
  for (size_t i = b; i < e; ++i) {
    if (std::isfinite(x[i])) mx = std::max(mx, std::fabs(double(x[i])));
  }
  if (mx == 0) return -126;
  return std::clamp(std::ilogb(mx) + room, -126, 127);
}

// mode kDown/kUp with `held` non-null: hysteresis (up if w < held, else down).
RefTensor RefQuantize(const RefFormat& f, const std::vector<float>& x, size_t channels,
                      RoundMode mode, const QuantizeOptions& o,
                      const std::vector<float>* held = nullptr) {
  RefTensor t;
  const size_t n = x.size();
  const size_t groups = f.per_channel ? channels : 1;
  const size_t len = n / groups;
  const uint64_t key = kernels::MakeRandomKey(o.seed, o.step);
  t.values.resize(n);
  t.codes.resize(n);
  for (size_t g = 0; g < groups; ++g) {
    const int s = RefShift(x, g * len, (g + 1) * len, f.room);
    t.shifts.push_back(s);
    const float down = std::ldexp(1.0f, -s), up = std::ldexp(1.0f, s);
    for (size_t i = g * len; i < (g + 1) * len; ++i) {
      RoundMode m = mode;
      if (held != nullptr) m = x[i] < (*held)[i] ? RoundMode::kUp : RoundMode::kDown;
      const uint32_t rnd = kernels::RandomBits(key, o.index_offset + i);
      const RefResult r = RefRound(x[i] * down, f, m, rnd);
      t.values[i] = r.value * up;
      t.codes[i] = r.code;
      t.saturated += r.saturated;
      t.flushed += std::isfinite(x[i]) && x[i] != 0 && t.values[i] == 0;
      t.nonfinite += r.nonfinite;
    }
  }
  return t;
}

struct RefCase {
  std::string spec;
  std::vector<int> mbits;
};

void PrintTo(const RefCase& c, std::ostream* os) { *os << c.spec; }

class ReferenceTest : public ::testing::TestWithParam<RefCase> {};

TEST_P(ReferenceTest, FastPathEqualsTheReference) {
  const RefCase& c = GetParam();
  for (const char* suffix : {"", ":room=0", ":room=-1:ch", ":room=3"}) {
    const Format f = MustParse(c.spec + suffix);
    const RefFormat ref =
        MakeRef(c.mbits, f.shift_rule().offset, f.scope() == ScaleScope::kChannel);
    ASSERT_EQ(f.bits(), ref.bits) << f.spec();
    // The values are the reference's, and their count is 2 * sum 2^M_i + 1.
    uint64_t sum = 0;
    for (int m : c.mbits) sum += uint64_t(1) << m;
    EXPECT_EQ(f.Info().distinct_finite, 2 * sum + 1) << f.spec();
    ASSERT_EQ(NonNegativeValues(f), ref.values) << f.spec();
    // Three groups: probes of the grid at the shift in force and random inputs over every
    // binade and far below; per-tensor formats see them one group at a time.
    std::mt19937_64 rng(5);
    const int span = int(c.mbits.size()) + 40;
    std::vector<std::vector<float>> groups;
    size_t longest = 0;
    for (int top : {0, 21, -60}) {
      std::vector<float> x = GroupInputs(60000, top, span, rng);
      x = Concat(x, AnchoredProbes(ScaledProbes(ref.values, top + ref.room), top));
      longest = std::max(longest, x.size());
      groups.push_back(std::move(x));
    }
    std::vector<std::vector<float>> tensors;
    size_t channels = 1;
    if (ref.per_channel) {
      std::vector<float> all;
      for (auto& x : groups) {
        x.resize(longest, 0.0f);
        all = Concat(all, x);
      }
      tensors.push_back(std::move(all));
      channels = groups.size();
    } else {
      tensors = groups;
    }
    for (const std::vector<float>& x : tensors) {
      QuantizeOptions o;
      o.channels = channels;
      o.seed = 42;
      o.step = 3;
      o.index_offset = 1000;
      for (Rounding r : {Rounding::kNearest, Rounding::kStochastic, Rounding::kZero}) {
        o.rounding = r;
        const RoundMode mode = r == Rounding::kNearest      ? RoundMode::kNearestEven
                               : r == Rounding::kStochastic ? RoundMode::kStochastic
                                                            : RoundMode::kTowardZero;
        const RefTensor want = RefQuantize(ref, x, channels, mode, o);
        QuantStats st;
        const std::vector<float> got = Q(f, x, o, &st);
        const std::vector<uint32_t> codes = Codes(f, x, o);
        MismatchCounter bad(f.spec() + " " + RoundingName(r) + " vs reference");
        for (size_t i = 0; i < x.size(); ++i) {
          if (Bits(got[i]) != Bits(want.values[i]) || codes[i] != want.codes[i]) {
            bad.Add() << "x = " << Show(x[i]) << ": fast " << Show(got[i]) << " code " << codes[i]
                      << ", reference " << Show(want.values[i]) << " code " << want.codes[i];
          }
        }
        EXPECT_EQ(st.saturated, want.saturated) << f.spec() << " " << RoundingName(r);
        EXPECT_EQ(st.flushed, want.flushed) << f.spec() << " " << RoundingName(r);
        EXPECT_EQ(st.nonfinite, want.nonfinite) << f.spec() << " " << RoundingName(r);
        // The shift bytes are the reference's shifts.
        PackedTensor p;
        ASSERT_TRUE(Encode(f, x.data(), x.size(), o, &p).ok());
        const size_t meta = PackedCodeBytes(f, x.size());
        ASSERT_EQ(p.bytes.size(), meta + want.shifts.size());
        for (size_t g = 0; g < want.shifts.size(); ++g) {
          EXPECT_EQ(int(int8_t(p.bytes[meta + g])), want.shifts[g]) << f.spec();
        }
      }
      // Hysteresis: up onto the grid where the weight is below the held value, else down.
      std::vector<float> w = x;
      std::normal_distribution<float> normal(0.0f, 1.0f);
      for (float& v : w) {
        if (std::isfinite(v)) v += v * 0.2f * normal(rng);
      }
      o.rounding = Rounding::kNearest;
      std::vector<float> q = Q(f, x, o);
      const std::vector<float> held = q;
      const RefTensor want = RefQuantize(ref, w, channels, RoundMode::kDown, o, &held);
      uint64_t flips = 0;
      ASSERT_TRUE(QuantizeHysteresis(f, w.data(), q.data(), w.size(), o, nullptr, &flips).ok());
      uint64_t want_flips = 0;
      MismatchCounter bad(f.spec() + " hysteresis vs reference");
      for (size_t i = 0; i < w.size(); ++i) {
        want_flips += Bits(want.values[i]) != Bits(held[i]);
        if (Bits(q[i]) != Bits(want.values[i])) {
          bad.Add() << "w = " << Show(w[i]) << ", held " << Show(held[i]) << ": fast " << Show(q[i])
                    << ", reference " << Show(want.values[i]);
        }
      }
      EXPECT_EQ(flips, want_flips) << f.spec();
    }
    // Every code decodes to the reference's value (codes above the largest decode to NaN).
    const size_t ncodes = size_t(1) << f.bits();
    std::vector<uint32_t> all(ncodes);
    for (uint32_t k = 0; k < ncodes; ++k) all[k] = k;
    const int shift = 5;
    PackedTensor p;
    p.count = ncodes;
    p.channels = 1;
    p.bytes.resize(PackedSize(f, ncodes, 1));
    PackCodes(all.data(), ncodes, f.bits(), p.bytes.data());
    p.bytes.back() = uint8_t(int8_t(shift));
    std::vector<float> d(ncodes);
    ASSERT_TRUE(Decode(f, p, d.data()).ok());
    const uint32_t half = uint32_t(ncodes / 2);
    for (uint32_t k = 0; k < ncodes; ++k) {
      const uint32_t mag = k % half;
      if (mag >= ref.values.size()) {
        EXPECT_TRUE(std::isnan(d[k])) << f.spec() << " code " << k;
        continue;
      }
      const float want = float(std::ldexp(ref.values[mag], shift)) * (k >= half ? -1.0f : 1.0f);
      EXPECT_EQ(Bits(d[k]), Bits(want)) << f.spec() << " code " << k;
    }
  }
}

std::vector<int> Repeat(int m, int k) { return std::vector<int>(size_t(k), m); }

INSTANTIATE_TEST_SUITE_P(
    Lists, ReferenceTest,
    ::testing::Values(
        // Fixed point, 8 bits with sign: 127 non-zero magnitudes, the step 2^-6 throughout.
        RefCase{"binades:6,5,4,3,2,1,0", {6, 5, 4, 3, 2, 1, 0}},
        // A float-fix hybrid (9 bits: 159 non-zero magnitudes).
        RefCase{"binades:5,5,4,4,4,4,4,3,2,1,0", {5, 5, 4, 4, 4, 4, 4, 3, 2, 1, 0}},
        // A gap to zero below 2^-2; first codes 1, 9, 17 (odd: ties are not float-bit RNE).
        RefCase{"binades:3,3,3", {3, 3, 3}},
        // One binade of one value: 0 and 1.
        RefCase{"binades:0", {0}},
        // Zero-bit binades: log<b>'s grid (compared with log4/log8 in LibraryEquality).
        RefCase{"binades:0x7", Repeat(0, 7)}, RefCase{"binades:0x127", Repeat(0, 127)},
        // Not monotone, and the widest mantissa the bit limit allows (16 bits).
        RefCase{"binades:2,4,0,3,1", {2, 4, 0, 3, 1}}, RefCase{"binades:14,13", {14, 13}}),
    [](const ::testing::TestParamInfo<RefCase>& i) { return Name(i.param.spec); });

// ---- 3. Hand-checked numbers ------------------------------------------------------------------

// Ties go to the even code. binades:3,3,3 (shift 0 via the anchor 1.5 and room 0): binade 2
// holds codes 1..8 (0.25 .. 0.46875), binade 1 codes 9..16 (0.5 .. 0.9375).
TEST(Binades, TiesGoToTheEvenCodeNotTheEvenMantissa) {
  const Format f = MustParse("binades:3,3,3:room=0");
  const std::vector<float> x = {1.5f, 0.484375f, 0.53125f, 0.125f, 0.1875f, -0.53125f, 0.75f};
  const std::vector<float> q = Q(f, x);
  EXPECT_EQ(q[0], 1.5f);
  // Between 0.46875 (code 8) and 0.5 (code 9): down to code 8, where float-bit RNE (mantissa
  // 111 is odd) would go up to 0.5.
  EXPECT_EQ(q[1], 0.46875f);
  // Between 0.5 (code 9) and 0.5625 (code 10): up to code 10, where RNE would keep 0.5.
  EXPECT_EQ(q[2], 0.5625f);
  // The gap: 0.125 is halfway between 0 (code 0) and 0.25 (code 1); 0.1875 is above it.
  EXPECT_EQ(Bits(q[3]), Bits(0.0f));
  EXPECT_EQ(q[4], 0.25f);
  EXPECT_EQ(q[5], -0.5625f);
  EXPECT_EQ(q[6], 0.75f);
  const std::vector<uint32_t> codes = Codes(f, x);
  EXPECT_EQ(codes[1], 8u);
  EXPECT_EQ(codes[2], 10u);
  EXPECT_EQ(codes[5], 10u | 32u);  // 25 magnitude codes: 5 bits, the sign at bit 5
  EXPECT_EQ(f.bits(), 6);
}

// Values, bits and the code layout of the lists in the issue.
TEST(Binades, InfoOfTheIssueLists) {
  const Format fix = MustParse("binades:6,5,4,3,2,1,0");
  EXPECT_EQ(fix.bits(), 8);
  EXPECT_EQ(fix.Info().distinct_finite, 255u);
  EXPECT_EQ(fix.Info().max_finite, 2 - 0x1p-6);
  EXPECT_EQ(fix.Info().min_subnormal, 0x1p-6);
  // The fixed point's values are the multiples of 2^-6 in [0, 2).
  const std::vector<double> v = NonNegativeValues(fix);
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(v[i], std::ldexp(double(i), -6));
  const Format fp = MustParse("binades:4,4,4,4,4,4,4,3,2,1,0");
  EXPECT_EQ(fp.bits(), 8);
  EXPECT_EQ(fp.spec(), "binades:4x7,3,2,1,0");
  // 160 magnitude codes: more than 8 bits hold.
  EXPECT_EQ(MustParse("binades:5,5,4,4,4,4,4,3,2,1,0").bits(), 9);
  EXPECT_EQ(MustParse("binades:0").bits(), 2);
  EXPECT_EQ(MustParse("binades:0x127").bits(), 8);
  EXPECT_EQ(MustParse("binades:14,13").bits(), 16);
}

// Every code is finite: NaN becomes +max (a non-finite input, not a saturated one), +-Inf and
// overflow saturate, and quantising the result again changes nothing.
TEST(Binades, NanInfAndOverflowSaturate) {
  const Format f = MustParse("binades:3,3,3:room=0");  // shift 0: max|finite x| = 1.9
  const std::vector<float> x = {1.0f, FromBits(0xffc00000u), kInf, -kInf, -1.9f};
  QuantStats st;
  const std::vector<float> q = Q(f, x, {}, &st);
  EXPECT_EQ(q[0], 1.0f);
  EXPECT_EQ(Bits(q[1]), Bits(1.875f));
  EXPECT_EQ(q[2], 1.875f);
  EXPECT_EQ(q[3], -1.875f);
  EXPECT_EQ(q[4], -1.875f);
  EXPECT_EQ(st.nonfinite, 3u);
  EXPECT_EQ(st.saturated, 3u);  // +-Inf and -1.9
  const std::vector<uint32_t> codes = Codes(f, x);
  EXPECT_EQ(codes[1], 24u);  // the largest magnitude code, sign cleared
  EXPECT_EQ(codes[3], 24u | 32u);
  EXPECT_TRUE(Q(f, q) == q);
}

}  // namespace
}  // namespace cpd::test
