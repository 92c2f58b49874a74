// LossScaler (runtime/train/loss_scale.h): the flag's values, the dynamic schedule (halve after
// an overflow, double after a run of finite steps, within bounds) and the state a checkpoint
// restores.
#include "runtime/train/loss_scale.h"

#include <gtest/gtest.h>

#include <string>

namespace cpd::runtime {
namespace {

using Mode = LossScaleOptions::Mode;

TEST(LossScale, ParsesOffDynamicAndStatic) {
  auto off = ParseLossScale("off", 65536, 2000);
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(off->mode, Mode::kOff);
  auto dynamic = ParseLossScale("dynamic", 1024, 10);
  ASSERT_TRUE(dynamic.ok());
  EXPECT_EQ(dynamic->mode, Mode::kDynamic);
  EXPECT_EQ(dynamic->scale, 1024);
  EXPECT_EQ(dynamic->growth_interval, 10);
  EXPECT_EQ(DescribeLossScale(*dynamic),
            "dynamic from 1024 (x2 after 10 finite steps, x0.5 on overflow)");
  auto fixed = ParseLossScale("4096", 65536, 2000);
  ASSERT_TRUE(fixed.ok());
  EXPECT_EQ(fixed->mode, Mode::kStatic);
  EXPECT_EQ(DescribeLossScale(*fixed), "static 4096");
}

TEST(LossScale, RefusesWhatNoScaleCanBe) {
  for (const char* bad : {"", "0", "-8", "nan", "inf", "1e300", "8x", "dynamic2", "on"}) {
    auto r = ParseLossScale(bad, 65536, 2000);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("--loss-scale '"), std::string::npos)
        << r.status().message();
  }
  EXPECT_NE(ParseLossScale("dynamic", 0, 2000).status().message().find("--loss-scale-init 0"),
            std::string::npos);
  EXPECT_NE(
      ParseLossScale("dynamic", 8, 0).status().message().find("--loss-scale-growth-interval 0"),
      std::string::npos);
}

TEST(LossScale, DynamicHalvesOnOverflowAndDoublesAfterARunOfFiniteSteps) {
  LossScaler s(*ParseLossScale("dynamic", 1024, 3));
  EXPECT_EQ(s.scale(), 1024);
  s.AfterStep(false);
  s.AfterStep(false);
  EXPECT_EQ(s.scale(), 1024);
  s.AfterStep(false);  // the third finite step in a row
  EXPECT_EQ(s.scale(), 2048);
  s.AfterStep(false);
  s.AfterStep(true);  // an overflow halves it and restarts the count
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_EQ(s.backoffs(), 1);
  s.AfterStep(false);
  s.AfterStep(false);
  EXPECT_EQ(s.scale(), 1024);
  s.AfterStep(false);
  EXPECT_EQ(s.scale(), 2048);
  for (int i = 0; i < 200; ++i) s.AfterStep(true);
  EXPECT_EQ(s.scale(), float(LossScaler::kMinScale));
}

TEST(LossScale, StaticAndOffNeverMove) {
  LossScaler fixed(*ParseLossScale("256", 65536, 1));
  LossScaler off(*ParseLossScale("off", 65536, 1));
  for (bool overflow : {true, false, false, true}) {
    fixed.AfterStep(overflow);
    off.AfterStep(overflow);
  }
  EXPECT_EQ(fixed.scale(), 256);
  EXPECT_TRUE(fixed.enabled());
  EXPECT_EQ(off.scale(), 1);
  EXPECT_FALSE(off.enabled());
}

TEST(LossScale, RestoreTakesWhatAScalerCanReachAndRefusesTheRest) {
  LossScaler s(*ParseLossScale("dynamic", 1024, 4));
  EXPECT_TRUE(s.Restore({512, 3}).ok());
  EXPECT_EQ(s.scale(), 512);
  s.AfterStep(false);  // the fourth finite step in a row
  EXPECT_EQ(s.scale(), 1024);
  for (const LossScaler::State bad :
       {LossScaler::State{0, 0}, LossScaler::State{-1, 0}, LossScaler::State{1e300, 0},
        LossScaler::State{8, -1}, LossScaler::State{8, 4}}) {
    EXPECT_FALSE(s.Restore(bad).ok()) << bad.scale << " " << bad.finite_in_a_row;
  }
}

}  // namespace
}  // namespace cpd::runtime
