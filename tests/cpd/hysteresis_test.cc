// Hysteresis rounding (Lee et al., ICLR 2022): a quantised weight holds its value until the
// weight crosses a full grid step; QuantizeHysteresis reports the number of flips.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cpd/format.h"
#include "cpd/quantize.h"
#include "tests/cpd/format_test_util.h"

namespace cpd::test {
namespace {

// A sorted grid with floor/ceil lookups.
class Grid {
 public:
  explicit Grid(std::vector<double> v) : v_(std::move(v)) { std::sort(v_.begin(), v_.end()); }
  double Floor(double w) const { return *(std::upper_bound(v_.begin(), v_.end(), w) - 1); }
  double Ceil(double w) const { return *std::lower_bound(v_.begin(), v_.end(), w); }
  // Whether a grid point lies in [a, b] (a <= b).
  bool AnyIn(double a, double b) const {
    auto it = std::lower_bound(v_.begin(), v_.end(), a);
    return it != v_.end() && *it <= b;
  }
  double Nearest(double w) const {
    const double lo = Floor(w), hi = Ceil(w);
    return w - lo < hi - w ? lo : hi;
  }

 private:
  std::vector<double> v_;
};

Grid GridOf(const Format& f, double scale) {
  Result<std::vector<float>> values = f.Values();
  EXPECT_TRUE(values.ok());
  std::vector<double> v;
  for (float x : *values) v.push_back(double(x) * scale);
  return Grid(v);
}

// A piecewise-linear walk through `stops` in steps of `delta`.
std::vector<double> Walk(const std::vector<double>& stops, double delta) {
  std::vector<double> w = {stops[0]};
  for (size_t s = 1; s < stops.size(); ++s) {
    const double dir = stops[s] > stops[s - 1] ? delta : -delta;
    const int steps = int(std::lround(std::fabs(stops[s] - stops[s - 1]) / delta));
    for (int i = 1; i <= steps; ++i) w.push_back(stops[s - 1] + dir * i);
  }
  return w;
}

struct WalkCase {
  std::string spec;
  double scale;  // grid scale the anchor fixes
  float anchor;  // 0: none (fixed format); else element 0 holds it throughout
  std::vector<double> stops;
  double delta;
  int walkers;  // weights walking with phase offsets delta * j / walkers
};

void PrintTo(const WalkCase& c, std::ostream* os) { *os << c.spec; }

class HysteresisWalkTest : public ::testing::TestWithParam<WalkCase> {};

TEST_P(HysteresisWalkTest, HoldsUntilAFullGridStepIsCrossed) {
  const WalkCase& c = GetParam();
  const Format f = MustParse(c.spec);
  const Grid grid = GridOf(f, c.scale);
  const std::vector<double> path = Walk(c.stops, c.delta);
  const size_t first = c.anchor != 0 ? 1 : 0;
  const size_t n = first + size_t(c.walkers);
  auto weights = [&](size_t t) {
    std::vector<float> w(n);
    if (first) w[0] = c.anchor;
    for (int j = 0; j < c.walkers; ++j) {
      w[first + j] = float(path[t] + c.delta * j / c.walkers);
    }
    return w;
  };
  std::vector<float> w = weights(0);
  std::vector<float> q = Q(f, w);  // the first step: plain quantisation
  std::vector<double> ref(q.begin(), q.end());
  uint64_t total_flips = 0, expected_total = 0, held_where_nearest_moves = 0;
  for (size_t t = 1; t < path.size(); ++t) {
    const std::vector<float> prev_w = w;
    w = weights(t);
    const std::vector<float> prev_q = q;
    uint64_t flips = 12345;
    QuantStats stats;
    ASSERT_TRUE(QuantizeHysteresis(f, w.data(), q.data(), n, {}, &stats, &flips).ok());
    EXPECT_EQ(stats.count, n);
    uint64_t changed = 0;
    for (size_t i = 0; i < n; ++i) {
      const double wi = w[i];
      // Reference rule: ceil onto the grid when the weight is below the held value, else floor.
      const double expect = wi < ref[i] ? grid.Ceil(wi) : grid.Floor(wi);
      expected_total += expect != ref[i];
      ASSERT_EQ(double(q[i]), expect)
          << c.spec << " step " << t << " element " << i << ": w " << wi << ", held " << ref[i];
      // The value is always a grid neighbour of the weight ...
      EXPECT_TRUE(q[i] == grid.Floor(wi) || q[i] == grid.Ceil(wi));
      // ... and moves only when the weight reaches a grid point on its way.
      if (q[i] != prev_q[i]) {
        ++changed;
        const double lo = std::min<double>(prev_w[i], wi), hi = std::max<double>(prev_w[i], wi);
        EXPECT_TRUE(grid.AnyIn(lo, hi))
            << "flip without crossing a grid point: w " << prev_w[i] << " -> " << wi;
        EXPECT_TRUE(q[i] >= lo && q[i] <= hi) << "new value " << q[i] << " not crossed";
      } else if (grid.Nearest(wi) != q[i]) {
        ++held_where_nearest_moves;
      }
      ref[i] = expect;
    }
    EXPECT_EQ(flips, changed) << "step " << t;
    total_flips += flips;
  }
  EXPECT_EQ(total_flips, expected_total);
  // The walk crosses several grid points each way, and the lag is visible: plain rounding
  // to nearest would have moved where hysteresis held.
  EXPECT_GE(total_flips, uint64_t(6 * c.walkers));
  EXPECT_GT(held_where_nearest_moves, 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Formats, HysteresisWalkTest,
    ::testing::Values(
        // e4m3: grid step 0.125 in [1, 2), 0.25 in [2, 4), 0.0625 in [0.5, 1).
        WalkCase{"e4m3", 1.0, 0.0f, {1.0, 2.6, 0.4, 1.3, -0.7, 0.2}, 1.0 / 64, 5},
        // int8 with a constant max element: scale 1/16 stays fixed.
        WalkCase{"int8", 1.0 / 16, 127.0f / 16, {-1.0, 1.0, -0.5, 0.3}, 1.0 / 128, 4},
        // log4 with a max element 1 (shift 0): grid 0, 2^-6 .. 2^-1, 1.
        WalkCase{"log4", 1.0, 1.0f, {0.05, 0.9, 0.02, 0.6}, 1.0 / 256, 3},
        // A shared-exponent format with a fixed anchor: fp134, shift 1.
        WalkCase{"fp134", 2.0, 1.5f, {0.2, 1.2, -0.3, 0.5}, 1.0 / 512, 3},
        // A gapped per-binade grid at shift 0: 0, then 0.25 .. 1.875 in steps of 2^-5..2^-3.
        WalkCase{"binades:3,3,3:room=0", 1.0, 1.5f, {0.05, 0.9, 0.02, 0.6}, 1.0 / 256, 3}));

// Explicit numbers for e4m3: from 2.6 (held 2.5) the value stays 2.5 down to just above 2.25,
// where rounding to nearest would already give 2.25, and flips to 2.25 at 2.25.
TEST(Hysteresis, E4m3ExplicitSteps) {
  const Format f = MustParse("e4m3");
  float w = 2.6f, q = 2.5f;
  uint64_t flips = 99;
  ASSERT_TRUE(QuantizeHysteresis(f, &w, &q, 1, {}, nullptr, &flips).ok());
  EXPECT_EQ(q, 2.5f);
  EXPECT_EQ(flips, 0u);
  for (float x : {2.45f, 2.4f, 2.3f, 2.26f}) {
    w = x;
    ASSERT_TRUE(QuantizeHysteresis(f, &w, &q, 1, {}, nullptr, &flips).ok());
    EXPECT_EQ(q, 2.5f) << "w = " << x;
    EXPECT_EQ(flips, 0u);
  }
  w = 2.25f;
  ASSERT_TRUE(QuantizeHysteresis(f, &w, &q, 1, {}, nullptr, &flips).ok());
  EXPECT_EQ(q, 2.25f);
  EXPECT_EQ(flips, 1u);
  // Back up: holds 2.25 until 2.5 is reached.
  for (float x : {2.3f, 2.4f, 2.49f}) {
    w = x;
    ASSERT_TRUE(QuantizeHysteresis(f, &w, &q, 1, {}, nullptr, &flips).ok());
    EXPECT_EQ(q, 2.25f) << "w = " << x;
    EXPECT_EQ(flips, 0u);
  }
  w = 2.5f;
  ASSERT_TRUE(QuantizeHysteresis(f, &w, &q, 1, {}, nullptr, &flips).ok());
  EXPECT_EQ(q, 2.5f);
  EXPECT_EQ(flips, 1u);
  // A jump over several grid points lands on the neighbour on the far side.
  w = 0.3f;
  ASSERT_TRUE(QuantizeHysteresis(f, &w, &q, 1, {}, nullptr, &flips).ok());
  EXPECT_EQ(q, 0.3125f);  // ceil: the weight is below the held value
  EXPECT_EQ(flips, 1u);
}

// The flip count over a large tensor equals the number of elements that changed, for 1 and 2
// threads alike, and the results do not depend on the thread count.
TEST(Hysteresis, FlipCountAndThreadsOnLargeTensors) {
  for (const char* spec :
       {"e4m3", "int8", "log4", "mxfp4", "bfp4:7", "uint4:minmax", "binades:5,5,4x5,3,2,1,0"}) {
    const Format f = MustParse(spec);
    const size_t n = 3 * 65536 + 77;
    std::mt19937_64 rng(3);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> w(n);
    for (float& v : w) v = normal(rng);
    QuantizeOptions o;
    std::vector<float> q0 = Q(f, w, o);
    for (float& v : w) v += 0.05f * normal(rng);
    uint64_t flips[2];
    std::vector<float> q[2] = {q0, q0};
    QuantStats st[2];
    for (int k = 0; k < 2; ++k) {
      o.threads = k + 1;
      ASSERT_TRUE(QuantizeHysteresis(f, w.data(), q[k].data(), n, o, &st[k], &flips[k]).ok());
    }
    uint64_t changed = 0;
    for (size_t i = 0; i < n; ++i) changed += Bits(q[0][i]) != Bits(q0[i]);
    EXPECT_EQ(flips[0], changed) << spec;
    EXPECT_EQ(flips[1], changed) << spec;
    EXPECT_GT(changed, 0u) << spec;
    if (f.scope() == ScaleScope::kNone) {
      EXPECT_LT(changed, n / 2) << spec;  // most hold
    }
    EXPECT_TRUE(q[0] == q[1]) << spec;
    EXPECT_EQ(st[0].sq_error, st[1].sq_error) << spec;
    EXPECT_EQ(st[0].saturated, st[1].saturated) << spec;
    EXPECT_EQ(Bits(st[0].max_abs), Bits(st[1].max_abs)) << spec;
    // Hysteresis with q = Quantize(w) changes nothing for fixed formats ... and a null flips
    // pointer is allowed.
    if (f.scope() == ScaleScope::kNone) {
      std::vector<float> qw = Q(f, w, o);
      std::vector<float> again = qw;
      ASSERT_TRUE(QuantizeHysteresis(f, w.data(), again.data(), n, o).ok());
      EXPECT_TRUE(again == qw) << spec;
    }
  }
}

// The statistics of QuantizeHysteresis and Quantize follow one definition (kernels::StatOf), on
// the input and the final output: a nonzero x that comes out 0 is flushed even where x * 2^-s
// underflows under a near-FLT_MAX outlier's shift, and an x beyond the scaled grid's largest
// value is saturated. Counted here from the inputs and outputs themselves.
TEST(Hysteresis, StatisticsCountInputsAndFinalOutputs) {
  const float big = 0.9f * std::numeric_limits<float>::max();
  const float sub = std::numeric_limits<float>::denorm_min();
  const std::vector<float> w = {big,    1e-38f,  3 * sub, -sub, 0.0f,   1.0f,       -2.5e-30f,
                                7e-39f, -1e-44f, 1e-20f,  -big, 6e-45f, 0.5f * big, 2e-42f};
  for (const char* spec : {"fp134", "fp152:room=2", "log4", "binades:4x7,3,2,1,0", "int8",
                           "uint4:minmax", "e4m3", "e5m2:nosub", "bf16"}) {
    const Format f = MustParse(spec);
    QuantizeOptions o;
    std::vector<float> quantized(w.size());
    QuantStats qs;
    ASSERT_TRUE(Quantize(f, w.data(), quantized.data(), w.size(), o, &qs).ok()) << spec;
    for (const bool from_zero : {true, false}) {
      // From all-zero previous weights every w > 0 rounds down and every w < 0 up; from the
      // quantised weights some hold.
      std::vector<float> q = from_zero ? std::vector<float>(w.size(), 0.0f) : quantized;
      QuantStats hs;
      ASSERT_TRUE(QuantizeHysteresis(f, w.data(), q.data(), w.size(), o, &hs).ok()) << spec;
      for (const auto& [out, st, what] :
           {std::tuple{&quantized, &qs, "Quantize"}, std::tuple{&q, &hs, "QuantizeHysteresis"}}) {
        uint64_t flushed = 0, nonfinite = 0;
        for (size_t i = 0; i < w.size(); ++i) {
          flushed += w[i] != 0.0f && (*out)[i] == 0.0f;
          nonfinite += !std::isfinite(w[i]);
        }
        EXPECT_EQ(st->flushed, flushed) << spec << " " << what;
        EXPECT_EQ(st->nonfinite, nonfinite) << spec << " " << what;
        EXPECT_EQ(Bits(st->max_abs), Bits(big)) << spec << " " << what;
      }
      EXPECT_EQ(hs.saturated, qs.saturated) << spec;
    }
    if (std::string(spec) == "fp134") {
      EXPECT_GE(qs.flushed, 8u) << "the tiny elements flush under the outlier's shift";
    }
  }
}

}  // namespace
}  // namespace cpd::test
