// CPT's cyclic precision and cost model (Fu et al., ICLR 2021) and the learning-rate schedules.
// Expected values come from the formulas in cpd/schedule.h, worked out by hand.
#include "cpd/schedule.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <numbers>
#include <vector>

namespace cpd {
namespace {

// The schedule as written in the header, with the 1 - cos form: away from exact .5 ties
// (none occur for the ranges below) it must agree with the official 1 + cos(x + pi) form.
int FormulaBits(int lo, int hi, int64_t t, int64_t T) {
  return int(std::rint(lo + 0.5 * (hi - lo) *
                                (1 - std::cos(std::numbers::pi * double(t % T) / double(T)))));
}

TEST(CyclicPrecision, FirstAndLastIterationsOfACycle) {
  // CPT's CIFAR setting: 3-8 bits, 32 periods over 64000 iterations -> T = 2000.
  const CyclicPrecision c{3, 8, 32, 64000};
  ASSERT_TRUE(c.Validate().ok());
  EXPECT_EQ(c.CycleLength(), 2000);
  EXPECT_EQ(c.BitsAt(0), 3);
  // t = 1: 3 + 2.5 * (1 - cos(pi / 2000)) = 3.0000031: rint gives 3 where ceil would give 4.
  EXPECT_EQ(c.BitsAt(1), 3);
  // Mid-cycle: 3 + 2.5 = 5.5 exactly (up to the last bit of cos): half to even -> 6.
  EXPECT_EQ(c.BitsAt(1000), 6);
  EXPECT_EQ(c.BitsAt(999), 5);   // 3 + 2.5 * (1 - cos(0.4995 pi)) = 5.4961
  EXPECT_EQ(c.BitsAt(1999), 8);  // 3 + 2.5 * (1 + cos(pi / 2000)) = 7.99999
  EXPECT_EQ(c.BitsAt(2000), 3);  // the next cycle starts at MIN again
  EXPECT_EQ(c.BitsAt(2001), 3);
  EXPECT_EQ(c.BitsAt(63999), 8);                // last iteration of the run
  EXPECT_EQ(c.BitsAt(7 * 2000 + 1000), 6);      // the middle of cycle 8
  EXPECT_EQ(c.BitsAt(64000 + 5), c.BitsAt(5));  // past the run: keeps cycling
  EXPECT_EQ(c.BitsAt(-1), c.BitsAt(1999));      // negative t: t mod T
}

TEST(CyclicPrecision, IterationsAtEachBitWidthPerCycle) {
  // Over one cycle of T = 2000 the thresholds of rint fall where
  // 3 + 2.5 (1 - cos(pi t / T)) crosses 3.5, 4.5, ...: t = T/pi * acos(1 - 2 k / 5).
  // acos(0.8) = 0.6435 -> t < 409.7 gives 3 bits (410 iterations), acos(0.4) = 1.1593 -> t < 738.0
  // (329 at 4 bits), acos(0) -> t < 1000 with 1000 itself a tie rounding to 6 (261 at 5),
  // acos(-0.4) -> t < 1262.0 (262 at 6), acos(-0.8) -> t < 1590.3 (329 at 7), the rest 409 at 8.
  const CyclicPrecision c{3, 8, 1, 2000};
  std::map<int, int> count;
  for (int64_t t = 0; t < 2000; ++t) ++count[c.BitsAt(t)];
  const std::map<int, int> expected{{3, 410}, {4, 329}, {5, 261}, {6, 262}, {7, 329}, {8, 409}};
  EXPECT_EQ(count, expected);
}

TEST(CyclicPrecision, MatchesTheFormulaAndStaysInRange) {
  struct Case {
    int lo, hi, periods;
    int64_t total;
  };
  for (const Case k : {Case{3, 8, 32, 64000}, Case{3, 8, 32, 1000}, Case{2, 8, 4, 37 * 4},
                       Case{4, 4, 8, 800}, Case{1, 32, 3, 999}, Case{6, 8, 1, 7}}) {
    const CyclicPrecision c{k.lo, k.hi, k.periods, k.total};
    ASSERT_TRUE(c.Validate().ok());
    const int64_t T = k.total / k.periods;
    EXPECT_EQ(c.CycleLength(), T);
    for (int64_t t = 0; t < k.total + T; ++t) {
      const int b = c.BitsAt(t);
      ASSERT_GE(b, k.lo) << "t=" << t;
      ASSERT_LE(b, k.hi) << "t=" << t;
      if ((k.hi - k.lo) % 2 == 1 && 2 * (t % T) == T) continue;  // the exact .5 tie
      ASSERT_EQ(b, FormulaBits(k.lo, k.hi, t, T)) << "t=" << t << " T=" << T;
    }
  }
}

TEST(CyclicPrecision, ShortRunsGuardTheCycleLength) {
  // 10 iterations over 32 periods: T = 10 / 32 = 0 -> 1, so every iteration is a cycle start.
  const CyclicPrecision c{3, 8, 32, 10};
  EXPECT_EQ(c.CycleLength(), 1);
  for (int64_t t = 0; t < 10; ++t) EXPECT_EQ(c.BitsAt(t), 3);
  // 1000 / 32 = 31 (integer division), the last 8 iterations start a 33rd, partial cycle.
  const CyclicPrecision d{3, 8, 32, 1000};
  EXPECT_EQ(d.CycleLength(), 31);
  EXPECT_EQ(d.BitsAt(31 * 32), 3);
  EXPECT_EQ(d.BitsAt(30), 8);  // 3 + 2.5 (1 - cos(30 pi / 31)) = 7.987
}

TEST(CyclicPrecision, ValidationNamesTheProblem) {
  EXPECT_TRUE((CyclicPrecision{3, 8, 32, 64000}.Validate().ok()));
  EXPECT_TRUE((CyclicPrecision{1, 32, 1, 1}.Validate().ok()));
  const Status min_gt_max = CyclicPrecision{8, 3, 32, 100}.Validate();
  EXPECT_EQ(min_gt_max.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(min_gt_max.message().find("min_bits 8 exceeds max_bits 3"), std::string::npos)
      << min_gt_max.message();
  const Status zero = CyclicPrecision{0, 8, 32, 100}.Validate();
  EXPECT_NE(zero.message().find("min_bits 0 is outside 1..32"), std::string::npos);
  const Status big = CyclicPrecision{3, 33, 32, 100}.Validate();
  EXPECT_NE(big.message().find("max_bits 33 is outside 1..32"), std::string::npos);
  const Status periods = CyclicPrecision{3, 8, 0, 100}.Validate();
  EXPECT_NE(periods.message().find("periods 0 must be at least 1"), std::string::npos);
  const Status iters = CyclicPrecision{3, 8, 32, 0}.Validate();
  EXPECT_NE(iters.message().find("total_iters 0 must be at least 1"), std::string::npos);
}

// ---- Cost model ----------------------------------------------------------------------------

TEST(CptCost, MacCost) {
  EXPECT_DOUBLE_EQ(MacCost(32, 32), 1.0);                             // (1024 + 2048) / 3072
  EXPECT_DOUBLE_EQ(MacCost(8, 8), 192.0 / 3072.0);                    // 64 + 128
  EXPECT_DOUBLE_EQ(MacCost(3, 8), (9.0 + 48.0) / 3072.0);             // 57
  EXPECT_DOUBLE_EQ(MacCost(4, 8), (16.0 + 64.0) / 3072.0);            // 80
  EXPECT_DOUBLE_EQ(TrainingCost({8, 8}, 8), 192.0 / 3072.0);          // per-MAC average
  EXPECT_DOUBLE_EQ(TrainingCost({3, 4}, 8), (57.0 + 80.0) / 6144.0);  // mean of the two
  // MAC-weighted: two layers of 100 and 300 MACs.
  EXPECT_DOUBLE_EQ(TrainingCost({3, 4}, 8, {100.0, 300.0}), 400.0 * (57.0 + 80.0) / 6144.0);
  EXPECT_EQ(TrainingCost({}, 8), 0.0);
}

// The issue's numbers: CPT 3-8 forward, 8-bit backward, against static 8 bits. "T" is the cycle
// length; the average over whole cycles depends only on it.
//   T = 2000: per cycle 410*57 + 329*80 + 261*105 + 262*132 + 329*161 + 409*192 = 243176
//             -> 243176 / (2000 * 192) - 1 = -0.36672917 (-36.67%)
//   T = 10000: -0.36661667 (-36.66%)
TEST(CptCost, IssueNumbersAtT2000AndT10000) {
  const double r2000 = CptRelativeCost(CyclicPrecision{3, 8, 1, 2000}, 8, 8);
  EXPECT_NEAR(r2000, 243176.0 / 384000.0 - 1.0, 1e-12);
  EXPECT_NEAR(100 * r2000, -36.67, 0.005);
  EXPECT_EQ(std::round(100 * 100 * r2000) / 100, -36.67);

  const double r10000 = CptRelativeCost(CyclicPrecision{3, 8, 1, 10000}, 8, 8);
  EXPECT_NEAR(r10000, -0.3666166666666667, 1e-12);
  EXPECT_NEAR(100 * r10000, -36.66, 0.005);
  EXPECT_EQ(std::round(100 * 100 * r10000) / 100, -36.66);

  // The same cycle lengths reached through total_iters / periods (CIFAR: 64000 / 32 = 2000).
  EXPECT_NEAR(CptRelativeCost(CyclicPrecision{3, 8, 32, 64000}, 8, 8), r2000, 1e-12);
  EXPECT_NEAR(CptRelativeCost(CyclicPrecision{3, 8, 5, 10000}, 8, 8), r2000, 1e-12);
  EXPECT_NEAR(CptRelativeCost(CyclicPrecision{3, 8, 32, 320000}, 8, 8), r10000, 1e-12);
  // Whereas 10000 iterations in 32 periods (T = 312) is a different schedule.
  EXPECT_GT(std::abs(CptRelativeCost(CyclicPrecision{3, 8, 32, 10000}, 8, 8) - r10000), 1e-3);
}

TEST(CptCost, CyclicEqualsExplicitSchedule) {
  for (const CyclicPrecision c : {CyclicPrecision{3, 8, 32, 64000}, CyclicPrecision{3, 8, 32, 1000},
                                  CyclicPrecision{2, 6, 3, 1001}, CyclicPrecision{4, 8, 1, 77}}) {
    std::vector<int> bits;
    for (int64_t t = 0; t < c.total_iters; ++t) bits.push_back(c.BitsAt(t));
    for (int g : {4, 8}) {
      EXPECT_NEAR(CptRelativeCost(c, g, c.max_bits), RelativeCost(bits, g, c.max_bits), 1e-12);
    }
  }
}

TEST(CptCost, StaticScheduleCostsNothingExtra) {
  EXPECT_EQ(RelativeCost(std::vector<int>(1000, 8), 8, 8), 0.0);
  EXPECT_EQ(RelativeCost(std::vector<int>(7, 5), 6, 5), 0.0);
  EXPECT_EQ(RelativeCost({}, 8, 8), 0.0);
  EXPECT_EQ(CptRelativeCost(CyclicPrecision{6, 6, 4, 100}, 8, 6), 0.0);
  // Static 4 bits against static 8, g = 8: (16 + 64) / 192 - 1.
  EXPECT_DOUBLE_EQ(RelativeCost(std::vector<int>(10, 4), 8, 8), 80.0 / 192.0 - 1.0);
  EXPECT_TRUE(std::isnan(RelativeCost({8}, 8, 0)));
  EXPECT_TRUE(std::isnan(CptRelativeCost(CyclicPrecision{8, 3, 1, 10}, 8, 8)));
}

// Backward bits enter both sides of the ratio: c(b, g) = b^2 + 2bg (in units of 1/3072).
TEST(CptCost, StepBitsAgainstAReference) {
  const StepBits ref{8, 8};  // c = 64 + 128 = 192
  EXPECT_EQ(RelativeCost(std::vector<StepBits>(5, {8, 8}), ref), 0.0);
  EXPECT_EQ(RelativeCost({}, ref), 0.0);
  // Static 4/8: (16 + 64) / 192 - 1 < 0; 3/8: (9 + 48) / 192 - 1.
  EXPECT_DOUBLE_EQ(RelativeCost(std::vector<StepBits>(3, {4, 8}), ref), 80.0 / 192.0 - 1.0);
  EXPECT_DOUBLE_EQ(RelativeCost({{3, 8}}, ref), 57.0 / 192.0 - 1.0);
  // fp32 everywhere: (1024 + 2048) / 192 - 1 = 15.
  EXPECT_DOUBLE_EQ(RelativeCost({{32, 32}}, ref), 15.0);
  // A backward precision of its own: 8/4 = 64 + 64 against 8/8.
  EXPECT_DOUBLE_EQ(RelativeCost({{8, 4}}, ref), 128.0 / 192.0 - 1.0);
  // Against another reference: 8/8 vs 4/4 (16 + 32 = 48).
  EXPECT_DOUBLE_EQ(RelativeCost({{8, 8}}, StepBits{4, 4}), 192.0 / 48.0 - 1.0);
  // Same g on both sides: the int overload's answer.
  const std::vector<int> bits = {3, 5, 8, 8, 4};
  std::vector<StepBits> steps;
  for (int b : bits) steps.push_back({b, 6});
  EXPECT_NEAR(RelativeCost(steps, StepBits{8, 6}), RelativeCost(bits, 6, 8), 1e-15);
  EXPECT_TRUE(std::isnan(RelativeCost({{8, 8}}, StepBits{0, 8})));
  EXPECT_TRUE(std::isnan(RelativeCost({{-1, 8}}, ref)));
}

TEST(CptCost, ParseStepBits) {
  auto ok = ParseStepBits("8/8");
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, (StepBits{8, 8}));
  EXPECT_EQ(*ParseStepBits("32/16"), (StepBits{32, 16}));
  EXPECT_EQ(*ParseStepBits("1/1"), (StepBits{1, 1}));
  EXPECT_EQ(StepBitsText({4, 8}), "4/8");
  for (const char* bad : {"", "8", "8/", "/8", "8/8/8", "0/8", "8/33", "08/8", " 8/8", "8/8 ",
                          "8-8", "a/b", "8/-1", "100/8"}) {
    const auto r = ParseStepBits(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("FWD/BWD"), std::string::npos) << r.status().message();
    EXPECT_EQ(r.status().message().find('\n'), std::string::npos);
  }
}

// ---- Learning-rate schedules ---------------------------------------------------------------

LrSchedule MustParse(std::string_view name, double lr, int64_t total, int64_t warmup = 0,
                     std::vector<int64_t> milestones = {}, double gamma = 0.1,
                     double min_lr = 0.0) {
  auto s = ParseLrSchedule(name, lr, total, warmup, std::move(milestones), gamma, min_lr);
  EXPECT_TRUE(s.ok()) << s.status().message();
  return s.ok() ? *s : LrSchedule{};
}

TEST(LrSchedule, Constant) {
  const LrSchedule s = MustParse("constant", 0.05, 100);
  EXPECT_EQ(s.kind, LrSchedule::kConstant);
  for (int64_t t : {0, 1, 50, 99, 100, 1000}) EXPECT_EQ(s.At(t), 0.05);
}

TEST(LrSchedule, CosineAtStartMiddleEnd) {
  const LrSchedule s = MustParse("cosine", 0.1, 100);
  EXPECT_DOUBLE_EQ(s.At(0), 0.1);
  EXPECT_NEAR(s.At(25), 0.05 * (1 + std::sqrt(0.5)), 1e-15);  // 0.0853553
  EXPECT_NEAR(s.At(50), 0.05, 1e-15);
  EXPECT_NEAR(s.At(75), 0.05 * (1 - std::sqrt(0.5)), 1e-15);  // 0.0146447
  EXPECT_NEAR(s.At(100), 0.0, 1e-15);
  EXPECT_NEAR(s.At(150), 0.0, 1e-15);  // stays at eta_min after the horizon

  const LrSchedule m = MustParse("cosine", 0.1, 100, 0, {}, 0.1, 0.001);
  EXPECT_DOUBLE_EQ(m.At(0), 0.1);
  EXPECT_NEAR(m.At(50), 0.001 + 0.099 * 0.5, 1e-15);  // 0.0505
  EXPECT_NEAR(m.At(100), 0.001, 1e-15);
}

TEST(LrSchedule, CosineWithWarmup) {
  // 10 warm-up steps, then a cosine over the remaining 100.
  const LrSchedule s = MustParse("cosine", 0.1, 110, 10);
  EXPECT_NEAR(s.At(0), 0.01, 1e-15);  // base / W
  EXPECT_NEAR(s.At(4), 0.05, 1e-15);  // base * 5 / 10
  EXPECT_NEAR(s.At(9), 0.1, 1e-15);
  EXPECT_NEAR(s.At(10), 0.1, 1e-15);   // cosine t = 0
  EXPECT_NEAR(s.At(60), 0.05, 1e-15);  // cosine t = 50 of 100
  EXPECT_NEAR(s.At(110), 0.0, 1e-15);
}

TEST(LrSchedule, StepAtMilestones) {
  const LrSchedule s = MustParse("step", 0.1, 100, 0, {30, 60}, 0.1);
  EXPECT_EQ(s.At(0), 0.1);
  EXPECT_EQ(s.At(29), 0.1);
  EXPECT_NEAR(s.At(30), 0.01, 1e-17);
  EXPECT_NEAR(s.At(59), 0.01, 1e-17);
  EXPECT_NEAR(s.At(60), 0.001, 1e-18);
  EXPECT_NEAR(s.At(99), 0.001, 1e-18);

  const LrSchedule w = MustParse("step", 0.2, 100, 4, {50}, 0.5);
  EXPECT_NEAR(w.At(0), 0.05, 1e-16);  // 0.2 * 1/4
  EXPECT_NEAR(w.At(2), 0.15, 1e-16);  // 0.2 * 3/4
  EXPECT_EQ(w.At(3), 0.2);
  EXPECT_EQ(w.At(49), 0.2);
  EXPECT_EQ(w.At(50), 0.1);
}

TEST(LrSchedule, ConstantWithWarmup) {
  const LrSchedule s = MustParse("constant", 0.4, 1000, 8);
  EXPECT_NEAR(s.At(0), 0.05, 1e-16);
  EXPECT_NEAR(s.At(3), 0.2, 1e-16);
  EXPECT_EQ(s.At(7), 0.4);
  EXPECT_EQ(s.At(8), 0.4);
}

TEST(LrScaling, LinearAndSqrtRules) {
  EXPECT_EQ(ScaleLr(0.1, LrScaling::kNone, 8192, 256), 0.1);
  EXPECT_EQ(ScaleLr(0.1, LrScaling::kLinear, 8192, 256), 0.1 * 32.0);
  EXPECT_EQ(ScaleLr(0.1, LrScaling::kSqrt, 8192, 256), 0.1 * std::sqrt(32.0));
  EXPECT_NEAR(ScaleLr(0.1, LrScaling::kSqrt, 8192, 256), 0.5657, 1e-4);
  // Smaller than the base batch scales down.
  EXPECT_EQ(ScaleLr(0.2, LrScaling::kLinear, 64, 256), 0.05);
  EXPECT_EQ(ScaleLr(0.2, LrScaling::kSqrt, 64, 256), 0.1);
  EXPECT_EQ(ScaleLr(0.2, LrScaling::kSqrt, 256, 256), 0.2);
}

TEST(LrScaling, NamesParse) {
  for (LrScaling r : {LrScaling::kNone, LrScaling::kLinear, LrScaling::kSqrt}) {
    auto parsed = ParseLrScaling(LrScalingName(r));
    ASSERT_TRUE(parsed.ok()) << LrScalingName(r);
    EXPECT_EQ(*parsed, r);
  }
  const auto bad = ParseLrScaling("square");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "lr-scaling 'square' (accepted: none, linear, sqrt)");
}

TEST(LrSchedule, ParseErrorsNameTheProblem) {
  auto unknown = ParseLrSchedule("linear", 0.1, 100);
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().message(),
            "unknown lr schedule 'linear' (accepted: constant, step, cosine)");
  auto expect_error = [](Result<LrSchedule> r, const std::string& part) {
    ASSERT_FALSE(r.ok()) << part;
    EXPECT_EQ(r.status().code(), Status::Code::kInvalidArgument);
    EXPECT_NE(r.status().message().find(part), std::string::npos) << r.status().message();
  };
  expect_error(ParseLrSchedule("step", 0.1, 100), "needs at least one milestone");
  expect_error(ParseLrSchedule("step", 0.1, 100, 0, {60, 30}), "strictly increasing");
  expect_error(ParseLrSchedule("step", 0.1, 100, 0, {-1}), "negative");
  expect_error(ParseLrSchedule("step", 0.1, 100, 0, {30}, 0.0), "gamma 0");
  expect_error(ParseLrSchedule("cosine", 0.0, 100), "base lr 0");
  expect_error(ParseLrSchedule("cosine", NAN, 100), "base lr");
  expect_error(ParseLrSchedule("cosine", 0.1, 0), "total steps 0");
  expect_error(ParseLrSchedule("cosine", 0.1, 100, 101), "warm-up steps 101");
  expect_error(ParseLrSchedule("cosine", 0.1, 100, -1), "warm-up steps -1");
  expect_error(ParseLrSchedule("cosine", 0.1, 100, 0, {}, 0.1, 0.2), "min lr 0.2");
  EXPECT_STREQ(LrScheduleName(LrSchedule::kCosine), "cosine");
}

}  // namespace
}  // namespace cpd
