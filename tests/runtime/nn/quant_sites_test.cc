// The precision policy mid-run: SiteQuantizer::Reconfigure (what a schedule pushed by the
// coordinator does to the hooks) and the policy's JSON form (how rank 0 hands it to every rank
// and how checkpoints record it).
#include "runtime/nn/quant_sites.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "runtime/control/job_control.h"
#include "runtime/nn/layers.h"

namespace cpd::runtime {
namespace {

class SiteQuantizerTest : public ::testing::Test {
 protected:
  SiteQuantizerTest()
      : fc1_("fc1", 8, 16, true, 1), fc2_("fc2", 16, 16, true, 2), fc3_("fc3", 16, 4, true, 3) {}
  std::vector<Layer*> Layers() { return {&fc1_, &fc2_, &fc3_}; }
  Linear fc1_, fc2_, fc3_;
};

TEST_F(SiteQuantizerTest, ReconfigureChangesFormatsBitsAndKeptLayers) {
  PrecisionConfig c;
  c.global[int(Site::kWeight)].spec = "e4m3";
  auto q = SiteQuantizer::Create(c, Layers());
  ASSERT_TRUE(q.ok()) << q.status().message();
  EXPECT_EQ((*q)->SpecFor("fc2", Site::kWeight), "e4m3");
  EXPECT_EQ((*q)->CurrentBits(), 0);

  PrecisionConfig cpt;
  cpt.cpt = CyclicPrecision{3, 8, 2, 100};
  cpt.grad_bits = 6;
  cpt.keep_fp32 = {"last"};
  cpt.overrides["fc1"][Site::kActivation] = "fp16";
  ASSERT_TRUE((*q)->Reconfigure(cpt).ok());
  (*q)->SetStep(0);
  EXPECT_EQ((*q)->CurrentBits(), 3);
  EXPECT_EQ((*q)->SpecFor("fc2", Site::kWeight), "uint3:minmax:ch");
  EXPECT_EQ((*q)->SpecFor("fc2", Site::kError), "uint6:minmax");
  EXPECT_EQ((*q)->SpecFor("fc1", Site::kActivation), "fp16");
  EXPECT_EQ((*q)->SpecFor("fc3", Site::kWeight), "fp32");  // "last" is kept fp32
  EXPECT_FALSE((*q)->Quantizes("fc3"));
  (*q)->SetStep(49);  // the last step of the first cycle (T = 50): the top of the cosine
  EXPECT_EQ((*q)->CurrentBits(), 8);

  // Back to fp32 everywhere: no layer needs hooks any more.
  ASSERT_TRUE((*q)->Reconfigure(PrecisionConfig{}).ok());
  for (const char* name : {"fc1", "fc2", "fc3"}) EXPECT_FALSE((*q)->Quantizes(name)) << name;
}

TEST_F(SiteQuantizerTest, RefusedReconfigureKeepsThePolicyInForce) {
  PrecisionConfig c;
  c.global[int(Site::kError)].spec = "e5m2";
  auto q = SiteQuantizer::Create(c, Layers());
  ASSERT_TRUE(q.ok());
  PrecisionConfig bad_layer;
  bad_layer.overrides["conv9"][Site::kWeight] = "e4m3";
  Status s = (*q)->Reconfigure(bad_layer);
  EXPECT_EQ(s.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(s.message().find("conv9"), std::string::npos) << s.message();
  PrecisionConfig bad_keep;
  bad_keep.keep_fp32 = {"fc7"};
  EXPECT_FALSE((*q)->Reconfigure(bad_keep).ok());
  PrecisionConfig bad_spec;
  bad_spec.global[int(Site::kWeight)].spec = "e9m9";
  EXPECT_FALSE((*q)->Reconfigure(bad_spec).ok());
  PrecisionConfig bad_cpt;
  bad_cpt.cpt = CyclicPrecision{8, 3, 2, 100};
  EXPECT_FALSE((*q)->Reconfigure(bad_cpt).ok());
  EXPECT_EQ((*q)->SpecFor("fc1", Site::kError), "e5m2");
  EXPECT_EQ((*q)->SpecFor("fc1", Site::kWeight), "fp32");
}

TEST(PrecisionConfigJson, RoundTripsEveryField) {
  PrecisionConfig c;
  c.global[int(Site::kWeight)] = {"log4", Rounding::kNearest};
  c.global[int(Site::kActivation)] = {"fp134", Rounding::kZero};
  c.global[int(Site::kError)] = {"e5m2", Rounding::kStochastic};
  c.overrides["conv1"][Site::kWeight] = "fp32";
  c.overrides["layer1.0.conv2"][Site::kWeightGrad] = "int8";
  c.keep_fp32 = {"first", "fc"};
  c.cpt = CyclicPrecision{4, 6, 16, 3000};
  c.grad_bits = 7;
  c.hysteresis = true;
  c.seed = 0xDEADBEEFCAFEull;
  auto back = PrecisionConfigFromJson(PrecisionConfigToJson(c));
  ASSERT_TRUE(back.ok()) << back.status().message();
  for (int i = 0; i < kNumSites; ++i) {
    EXPECT_EQ(back->global[i].spec, c.global[i].spec) << i;
    EXPECT_EQ(back->global[i].rounding, c.global[i].rounding) << i;
  }
  EXPECT_EQ(back->overrides, c.overrides);
  EXPECT_EQ(back->keep_fp32, c.keep_fp32);
  ASSERT_TRUE(back->cpt.has_value());
  EXPECT_EQ(back->cpt->min_bits, 4);
  EXPECT_EQ(back->cpt->max_bits, 6);
  EXPECT_EQ(back->cpt->periods, 16);
  EXPECT_EQ(back->cpt->total_iters, 3000);
  EXPECT_EQ(back->grad_bits, 7);
  EXPECT_TRUE(back->hysteresis);
  EXPECT_EQ(back->seed, c.seed);

  auto plain = PrecisionConfigFromJson(PrecisionConfigToJson(PrecisionConfig{}));
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain->cpt.has_value());
  EXPECT_EQ(plain->global[0].spec, "fp32");
}

TEST(PrecisionConfigJson, RefusesMalformedInput) {
  for (const char* text :
       {"", "[]", "{}", R"({"sites":{"W":{"spec":"e4m3","rounding":"nearest"}}})",
        R"({"sites":{"Q":{"spec":"e4m3","rounding":"nearest"}},"overrides":{},"keep_fp32":[],
            "grad_bits":8,"hysteresis":false,"seed":0})",
        R"({"sites":{"W":{"spec":"e4m4x","rounding":"nearest"}},"overrides":{},"keep_fp32":[],
            "grad_bits":8,"hysteresis":false,"seed":0})",
        R"({"sites":{},"overrides":{},"keep_fp32":[],"grad_bits":8,"hysteresis":false,"seed":0,
            "cpt":{"min_bits":9,"max_bits":3,"periods":1,"total_iters":10}})"}) {
    auto c = PrecisionConfigFromJson(text);
    EXPECT_FALSE(c.ok()) << text;
  }
}

TEST(DescribePrecision, NamesWhatIsInForce) {
  EXPECT_EQ(DescribePrecision(PrecisionConfig{}), "fp32");
  PrecisionConfig c;
  c.cpt = CyclicPrecision{3, 8, 32, 1000};
  c.global[int(Site::kError)] = {"e5m2", Rounding::kStochastic};
  c.overrides["fc1"][Site::kWeight] = "fp32";
  c.keep_fp32 = {"last"};
  c.hysteresis = true;
  EXPECT_EQ(DescribePrecision(c),
            "CPT 3-8/8 x32, E=e5m2/stochastic, 1 layer override(s), fp32: last, hysteresis");
}

}  // namespace
}  // namespace cpd::runtime
