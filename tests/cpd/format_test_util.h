// Helpers shared by the format-library tests: bit views of floats, probe sets around a grid,
// random float32 bit patterns, and mismatch reporting that stops after a few messages.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "cpd/format.h"
#include "cpd/quantize.h"

namespace cpd::test {

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Equal as results: NaN matches any NaN, everything else bit for bit (the sign of zero too).
inline bool SameResult(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return Bits(a) == Bits(b);
}

inline std::string Hex(uint32_t u) {
  std::ostringstream s;
  s << "0x" << std::hex << u;
  return s.str();
}

// "1.5 (0x3fc00000)": a float with its bit pattern, for failure messages.
inline std::string Show(float f) {
  std::ostringstream s;
  s.precision(9);
  s << f << " (" << Hex(Bits(f)) << ")";
  return s.str();
}

// A channel count for a test tensor of n elements in format f: for a per-channel (`:ch`) format
// the first of `divisors` that divides n, else 1; 1 for every other format and for n = 0, which
// a per-channel format refuses (no channel can be empty).
inline size_t ChannelsFor(const Format& f, size_t n,
                          std::initializer_list<size_t> divisors = {3, 7, 11, 13}) {
  if (f.scope() != ScaleScope::kChannel || n == 0) return 1;
  for (size_t d : divisors) {
    if (n % d == 0) return d;
  }
  return 1;
}

// Parses a spec that the test expects to be valid.
inline Format MustParse(std::string_view spec) {
  Result<Format> r = Format::Parse(spec);
  if (!r.ok()) {
    ADD_FAILURE() << "Format::Parse('" << spec << "') failed: " << r.status().message();
    std::abort();
  }
  return r.value();
}

// Counts mismatches, reporting the first few with ADD_FAILURE.
class MismatchCounter {
 public:
  explicit MismatchCounter(std::string what, int max_reports = 8)
      : what_(std::move(what)), max_reports_(max_reports) {}
  // Returns the stream to describe the mismatch into (discarded beyond the first few).
  std::ostream& Add() {
    ++count_;
    if (count_ <= max_reports_) {
      messages_.emplace_back();
      return messages_.back();
    }
    sink_.str("");
    return sink_;
  }
  ~MismatchCounter() { Report(); }
  void Report() {
    if (reported_) return;
    reported_ = true;
    for (const auto& m : messages_) ADD_FAILURE() << what_ << ": " << m.str();
    EXPECT_EQ(count_, 0) << what_ << ": " << count_ << " mismatches in total";
  }
  int64_t count() const { return count_; }

 private:
  std::string what_;
  int max_reports_;
  int64_t count_ = 0;
  std::vector<std::ostringstream> messages_;
  std::ostringstream sink_;
  bool reported_ = false;
};

// Adds t (a double) if it is a float, else the two floats around it, and in both cases the
// float neighbours just below and above: the inputs that probe a rounding boundary at t.
inline void AddAround(double t, std::vector<float>* out) {
  const float inf = std::numeric_limits<float>::infinity();
  if (std::isnan(t)) return;
  if (std::fabs(t) > double(std::numeric_limits<float>::max())) {
    const float m = std::numeric_limits<float>::max();
    out->push_back(t > 0 ? m : -m);
    out->push_back(t > 0 ? inf : -inf);
    return;
  }
  const float f = float(t);
  if (double(f) == t) {
    out->push_back(f);
    out->push_back(std::nextafter(f, -inf));
    out->push_back(std::nextafter(f, inf));
  } else {
    const float lo = double(f) < t ? f : std::nextafter(f, -inf);
    const float hi = double(f) > t ? f : std::nextafter(f, inf);
    out->push_back(lo);
    out->push_back(hi);
  }
}

// Inputs that probe every value of a grid and every rounding boundary between neighbours:
// `grid` holds the non-negative finite values ascending (0 first). Each value, each midpoint
// (the ties), the floats just below/above both, the overflow boundaries above the largest
// value (max + the last step, 2 max), +-Inf, NaNs and the float32 extremes; all with both signs.
inline std::vector<float> GridProbes(const std::vector<double>& grid) {
  std::vector<float> pos;
  for (size_t i = 0; i < grid.size(); ++i) {
    AddAround(grid[i], &pos);
    if (i + 1 < grid.size()) AddAround(0.5 * (grid[i] + grid[i + 1]), &pos);
  }
  if (grid.size() >= 2) {
    const double mx = grid.back(), step = grid.back() - grid[grid.size() - 2];
    for (double next : {mx + step, 2 * mx}) {
      AddAround(next, &pos);
      AddAround(0.5 * (mx + next), &pos);
    }
    AddAround(4 * mx, &pos);
    AddAround(0.25 * grid[1], &pos);
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (float f : {0.0f, std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min(),
                  std::numeric_limits<float>::max(), inf, 1e-30f, 1e30f}) {
    pos.push_back(f);
  }
  std::vector<float> all;
  all.reserve(2 * pos.size() + 8);
  for (float f : pos) {
    all.push_back(f);
    all.push_back(-f);
  }
  for (uint32_t nan : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0xffffffffu,
                       0x7fa5a5a5u}) {
    all.push_back(FromBits(nan));
  }
  return all;
}

// n random float32 inputs: half uniform over all 2^32 bit patterns; ~40% with a random sign and
// mantissa and an exponent uniform in [lo_exp, hi_exp] (the format's range: subnormals and
// overflow included; exponents below -126 give float32 subnormals); the rest special values
// (+-0, +-Inf, NaNs, +-`max`, float32 extremes).
inline std::vector<float> RandomInputs(size_t n, uint64_t seed, int lo_exp, int hi_exp, float max) {
  std::mt19937_64 rng(seed);
  const float inf = std::numeric_limits<float>::infinity();
  const float specials[] = {0.0f,
                            -0.0f,
                            inf,
                            -inf,
                            FromBits(0x7fc00000u),
                            FromBits(0xffc00000u),
                            FromBits(0x7f800001u),
                            FromBits(0xff812345u),
                            max,
                            -max,
                            std::nextafter(max, inf),
                            -std::nextafter(max, inf),
                            std::numeric_limits<float>::max(),
                            -std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::denorm_min(),
                            -std::numeric_limits<float>::denorm_min()};
  constexpr int kNumSpecials = sizeof(specials) / sizeof(specials[0]);
  lo_exp = std::max(lo_exp, -149);
  hi_exp = std::min(hi_exp, 127);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t r = rng();
    const uint32_t kind = uint32_t(r >> 56);  // 0..255
    const uint32_t bits = uint32_t(r);
    if (kind < 128) {
      out[i] = FromBits(bits);
    } else if (kind < 230) {
      const int e = lo_exp + int((r >> 32) % uint64_t(hi_exp - lo_exp + 1));
      const float mant = 1.0f + float(bits & 0x7fffffu) * 0x1p-23f;  // [1, 2)
      float v = std::ldexp(mant, e);  // correctly rounded into the float32 subnormals
      out[i] = (bits & 0x80000000u) != 0 ? -v : v;
    } else {
      out[i] = specials[(r >> 32) % kNumSpecials];
    }
  }
  return out;
}

inline std::vector<float> Concat(std::vector<float> a, const std::vector<float>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Quantises with the given options, failing the test on an error status.
inline std::vector<float> Q(const Format& f, const std::vector<float>& x,
                            const QuantizeOptions& opts = {}, QuantStats* stats = nullptr) {
  std::vector<float> out(x.size());
  Status s = Quantize(f, x.data(), out.data(), x.size(), opts, stats);
  EXPECT_TRUE(s.ok()) << f.spec() << ": " << s.message();
  return out;
}

// Encodes and unpacks the element codes (the scale metadata is ignored).
inline std::vector<uint32_t> Codes(const Format& f, const std::vector<float>& x,
                                   const QuantizeOptions& opts = {}) {
  PackedTensor p;
  Status s = Encode(f, x.data(), x.size(), opts, &p);
  EXPECT_TRUE(s.ok()) << f.spec() << ": " << s.message();
  std::vector<uint32_t> codes(x.size());
  if (s.ok()) UnpackCodes(p.bytes.data(), x.size(), f.bits(), codes.data());
  return codes;
}

// The parameter of the suites run once per format spec and rounding mode (the CUDA codec and
// quantiser tests), and its test-name suffix: "<spec>_<rounding>" with every character other
// than a letter or digit made '_' (gtest's rule for names).
using FormatRounding = std::tuple<const char*, Rounding>;

inline std::string FormatRoundingName(const ::testing::TestParamInfo<FormatRounding>& info) {
  std::string name =
      std::string(std::get<0>(info.param)) + "_" + RoundingName(std::get<1>(info.param));
  for (char& ch : name) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return name;
}

// Every spec of `specs` with every rounding mode.
template <size_t N>
auto EveryRoundingOf(const char* const (&specs)[N]) {
  return ::testing::Combine(
      ::testing::ValuesIn(specs),
      ::testing::Values(Rounding::kNearest, Rounding::kStochastic, Rounding::kZero));
}

// ---- Block-scaled formats on the device (the CUDA quantiser and codec tests) ------------------

// NVFP4 (1-D and 2-D), DeepSeek-V3's float32 tiles and blocks, MX's E8M0 rule, an E5M2 scale
// under a tensor level; Inf elements under E4M3 scales (a scale that underflows to 0 times Inf);
// odd 3x5 blocks with 2-byte bf16 scales.
inline constexpr const char* kBlockScaledFormats[] = {
    "nvfp4",
    "nvfp4:2d",
    "e4m3:block=1x128",
    "e4m3:block=128x128",
    "e2m1:block=32:scale=e8m0",
    "e2m1:block=4x8:scale=e5m2:tensor",
    "e5m2:inf:block=1x32:scale=e4m3",
    "e5m2:block=3x5:scale=bf16",
};

// A matrix view of a block-scaled span: `rows` x `cols`, given as QuantizeOptions::columns, or
// (by_channels) as `rows` channels with columns 0.
struct MatrixShape {
  size_t rows, cols;
  bool by_channels;
};

// Empty; one element; blocks partial at the right and bottom edges; the same by channels; a
// width that every 1xC block divides (blocks are contiguous runs); a width below 128 (one block
// column of 128-wide blocks); and a large one (more blocks than the reduction's last block
// derives: a second launch).
inline constexpr MatrixShape kBlockScaledShapes[] = {
    {0, 16, false},   {1, 1, false},     {7, 33, false},      {37, 300, true},
    {24, 256, false}, {300, 100, false}, {1000, 1043, false},
};

inline QuantizeOptions ShapeOptions(const MatrixShape& shape) {
  QuantizeOptions opts;
  opts.columns = shape.by_channels ? 0 : shape.cols;
  opts.channels = shape.by_channels ? shape.rows : 1;
  return opts;
}

inline std::string ShapeName(const MatrixShape& shape) {
  return std::to_string(shape.rows) + "x" + std::to_string(shape.cols) +
         (shape.by_channels ? " (channels)" : "");
}

}  // namespace cpd::test
