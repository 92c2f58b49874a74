// The relative cost of every run against a stated reference (runtime/train/cost_plan.h): CPT's
// cost model for static formats too, with the backward bits in both the run and the reference.
#include "runtime/train/cost_plan.h"

#include <gtest/gtest.h>

#include <cmath>

namespace cpd::runtime {
namespace {

PrecisionConfig Static(const char* w, const char* a, const char* e) {
  PrecisionConfig c;
  c.global[int(Site::kWeight)].spec = w;
  c.global[int(Site::kActivation)].spec = a;
  c.global[int(Site::kError)].spec = e;
  return c;
}

PrecisionConfig Cpt(int min_bits, int max_bits, int grad_bits, int64_t steps) {
  PrecisionConfig c;
  c.cpt = CyclicPrecision{min_bits, max_bits, 32, steps};
  c.grad_bits = grad_bits;
  return c;
}

constexpr StepBits k88{8, 8};

TEST(PlannedStepBits, StorageBitsOfTheFormatsOrCpt) {
  EXPECT_EQ(PlannedStepBits(PrecisionConfig{}, 0), (StepBits{32, 32}));
  EXPECT_EQ(PlannedStepBits(Static("int4", "int4", "e4m3"), 7), (StepBits{4, 8}));
  // The larger of W and A; E alone sets the backward bits (G is not in CPT's model).
  EXPECT_EQ(PlannedStepBits(Static("int4", "bf16", "e5m2"), 0), (StepBits{16, 8}));
  EXPECT_EQ(PlannedStepBits(Static("log4", "fp134", "fp32"), 0), (StepBits{8, 32}));
  EXPECT_EQ(PlannedStepBits(Static("uint3:minmax", "e2m1", "int6"), 0), (StepBits{4, 6}));
  // CPT's bits replace the formats; its grad bits the E format's.
  PrecisionConfig cpt = Cpt(3, 8, 6, 64000);
  cpt.global[int(Site::kError)].spec = "fp32";
  EXPECT_EQ(PlannedStepBits(cpt, 0), (StepBits{3, 6}));
  EXPECT_EQ(PlannedStepBits(cpt, 1999), (StepBits{cpt.cpt->BitsAt(1999), 6}));
}

TEST(CostPlan, StaticRunsAgainstEightEight) {
  // 4/8: (16 + 64) / (64 + 128) - 1; 3/8: (9 + 48) / 192 - 1.
  const double four = CostPlan(100, Static("int4", "int4", "int8"), k88).relative_cost();
  EXPECT_LT(four, 0.0);
  EXPECT_DOUBLE_EQ(four, 80.0 / 192.0 - 1.0);
  const double three =
      CostPlan(100, Static("uint3:minmax", "uint3:minmax", "e4m3"), k88).relative_cost();
  EXPECT_DOUBLE_EQ(three, 57.0 / 192.0 - 1.0);
  EXPECT_LT(three, four);
  EXPECT_EQ(CostPlan(100, Static("e4m3", "e4m3", "e5m2"), k88).relative_cost(), 0.0);
  // fp32 everywhere: (1024 + 2048) / 192 - 1 = 15.
  EXPECT_DOUBLE_EQ(CostPlan(100, PrecisionConfig{}, k88).relative_cost(), 15.0);
  // Another reference: 4/8 against itself costs nothing, 8/8 against 4/8 more.
  EXPECT_EQ(CostPlan(10, Static("int4", "int4", "int8"), {4, 8}).relative_cost(), 0.0);
  EXPECT_GT(CostPlan(10, Static("e4m3", "e4m3", "e4m3"), {4, 8}).relative_cost(), 0.0);
}

TEST(CostPlan, CptThreeToEightIsUnchanged) {
  // CIFAR's 64000 steps in 32 periods (T = 2000): the documented -36.67 %.
  const CostPlan plan(64000, Cpt(3, 8, 8, 64000), k88);
  EXPECT_NEAR(plan.relative_cost(), CptRelativeCost(CyclicPrecision{3, 8, 32, 64000}, 8, 8), 1e-12);
  EXPECT_EQ(std::round(100 * 100 * plan.relative_cost()) / 100, -36.67);
  EXPECT_EQ(plan.reference(), k88);
}

TEST(CostPlan, ReplanCostsTheRestUnderTheNewPolicy) {
  CostPlan plan(100, Static("int4", "int4", "int8"), k88);
  plan.Replan(50, Static("e4m3", "e4m3", "e4m3"));  // half at 4/8, half at 8/8
  EXPECT_DOUBLE_EQ(plan.relative_cost(), 0.5 * (80.0 / 192.0 - 1.0));
  plan.Replan(0, PrecisionConfig{});
  EXPECT_DOUBLE_EQ(plan.relative_cost(), 15.0);
}

}  // namespace
}  // namespace cpd::runtime
