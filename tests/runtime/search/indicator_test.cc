// The gradient-angle indicator (runtime/search/indicator.h): its shortcuts (one fp32 forward
// reused by every E-only backward, one quantised forward shared by A and A+E) give exactly the
// gradients of the plain definition (a full forward and backward under the policy), the angle
// of an unquantised candidate is 0, and coarser formats turn the gradient further.
#include "runtime/search/indicator.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "runtime/nn/models.h"
#include "runtime/train/data.h"

namespace cpd::runtime {
namespace {

struct Fixture {
  std::unique_ptr<Sequential> model;
  Dataset data;
  Tensor x;
  std::vector<int32_t> y;
};

Fixture Make(const std::string& arch) {
  Fixture f;
  f.data = MakeSynthetic(64, 1, 28, 28, 10, 7).value();
  Normalize(&f.data, ComputeChannelStats(f.data));
  f.model = BuildModel(arch, 1, 28, 10, 3).value();
  BatchIterator it(f.data, 32, /*shuffle=*/true, /*augment=*/false, 5, /*drop_last=*/true);
  it.StartEpoch(0);
  EXPECT_TRUE(it.Next(&f.x, &f.y));
  return f;
}

std::vector<Format> Formats(const std::vector<std::string>& specs) {
  std::vector<Format> out;
  for (const auto& s : specs) out.push_back(Format::Parse(s).value());
  return out;
}

// The weight gradients of every Linear/Conv2d layer after a full forward and backward with A
// and E quantised as given (null: fp32): the indicator's definition, without its shortcuts.
std::vector<std::vector<float>> PlainGradients(Fixture& f, const Format* a, const Format* e,
                                               const IndicatorOptions& o, int64_t step) {
  std::vector<Layer*> layers;
  for (Layer* l : f.model->Flatten()) {
    if (l->Quantizable()) layers.push_back(l);
  }
  PrecisionConfig pc;
  pc.global[int(Site::kActivation)] = {a ? a->spec() : "fp32", o.a_rounding};
  pc.global[int(Site::kError)] = {e ? e->spec() : "fp32", o.e_rounding};
  pc.seed = o.seed;
  auto q = SiteQuantizer::Create(pc, layers).value();
  q->InstallHooks(layers);
  q->SetStep(step);
  f.model->SetStep(uint64_t(step));
  GradientPass pass(f.model.get());
  pass.Run(f.x, f.y);
  std::vector<std::vector<float>> g;
  for (Layer* l : layers) {
    for (Param* p : l->Params()) {
      if (p->name != l->name() + ".weight") continue;
      g.emplace_back(p->grad.numel());
      p->grad.CopyToHost(g.back().data());
    }
  }
  for (Layer* l : layers) l->SetQuantHooks(nullptr);
  return g;
}

double NetworkAngle(const std::vector<std::vector<float>>& a,
                    const std::vector<std::vector<float>>& b) {
  std::vector<double> per_layer;
  return GradientAngle(a, b, &per_layer);
}

TEST(GradientAngleIndicator, ShortcutsEqualThePlainDefinition) {
  Fixture f = Make("lenet5");
  IndicatorOptions o;
  o.e_rounding = Rounding::kStochastic;  // the random streams must match too
  o.seed = 99;
  auto ind = GradientAngleIndicator::Create(f.model.get(), o).value();
  ASSERT_TRUE(ind->BeginBatch(f.x, f.y, 4).ok());
  const std::vector<Format> cands = Formats({"e4m3", "fp134", "int8"});
  const std::vector<BatchAngles> got = ind->Evaluate(cands).value();
  ind.reset();  // the indicator's hooks off the layers
  for (size_t c = 0; c < cands.size(); ++c) {
    const auto ref = PlainGradients(f, nullptr, nullptr, o, 4);
    const Format& F = cands[c];
    EXPECT_EQ(got[c].network[int(SiteSet::kA)],
              NetworkAngle(ref, PlainGradients(f, &F, nullptr, o, 4)))
        << F.spec();
    EXPECT_EQ(got[c].network[int(SiteSet::kE)],
              NetworkAngle(ref, PlainGradients(f, nullptr, &F, o, 4)))
        << F.spec();
    EXPECT_EQ(got[c].network[int(SiteSet::kAE)], NetworkAngle(ref, PlainGradients(f, &F, &F, o, 4)))
        << F.spec();
    EXPECT_GT(got[c].network[int(SiteSet::kAE)], 0.0) << F.spec();
  }
}

TEST(GradientAngleIndicator, Fp32CandidateHasAngleZeroEverywhere) {
  Fixture f = Make("mlp");
  auto ind = GradientAngleIndicator::Create(f.model.get(), IndicatorOptions{}).value();
  ASSERT_TRUE(ind->BeginBatch(f.x, f.y, 0).ok());
  const BatchAngles a = ind->Evaluate(Formats({"fp32"})).value()[0];
  for (int s = 0; s < kNumSiteSets; ++s) {
    EXPECT_EQ(a.network[s], 0.0) << s;
    ASSERT_EQ(a.layer[s].size(), ind->layers().size());
    for (double l : a.layer[s]) EXPECT_EQ(l, 0.0);
  }
}

TEST(GradientAngleIndicator, EvaluatingTwiceOnABatchGivesTheSameAngles) {
  Fixture f = Make("lenet5");
  auto ind = GradientAngleIndicator::Create(f.model.get(), IndicatorOptions{}).value();
  ASSERT_TRUE(ind->BeginBatch(f.x, f.y, 1).ok());
  const auto first = ind->Evaluate(Formats({"e5m2", "int4"})).value();
  const auto again = ind->Evaluate(Formats({"int4", "e5m2"})).value();  // E needs fp32 again
  for (int s = 0; s < kNumSiteSets; ++s) {
    EXPECT_EQ(first[0].network[s], again[1].network[s]) << s;
    EXPECT_EQ(first[1].network[s], again[0].network[s]) << s;
    EXPECT_EQ(first[1].layer[s], again[0].layer[s]) << s;
  }
}

TEST(GradientAngleIndicator, CoarserFormatsTurnTheGradientFurther) {
  Fixture f = Make("lenet5");
  auto ind = GradientAngleIndicator::Create(f.model.get(), IndicatorOptions{}).value();
  ASSERT_TRUE(ind->BeginBatch(f.x, f.y, 2).ok());
  const auto a = ind->Evaluate(Formats({"fp16", "int8", "int4", "int2"})).value();
  for (int s = 0; s < kNumSiteSets; ++s) {
    EXPECT_LT(a[0].network[s], a[1].network[s]) << s;
    EXPECT_LT(a[1].network[s], a[2].network[s]) << s;
    EXPECT_LT(a[2].network[s], a[3].network[s]) << s;
  }
}

TEST(GradientAngleIndicator, OnlyTheSiteSetsAskedForAreFilled) {
  Fixture f = Make("mlp");
  IndicatorOptions o;
  o.sites = {SiteSet::kE};
  auto ind = GradientAngleIndicator::Create(f.model.get(), o).value();
  ASSERT_TRUE(ind->BeginBatch(f.x, f.y, 0).ok());
  const BatchAngles a = ind->Evaluate(Formats({"int4"})).value()[0];
  EXPECT_GT(a.network[int(SiteSet::kE)], 0.0);
  EXPECT_TRUE(a.layer[int(SiteSet::kA)].empty());
  EXPECT_TRUE(a.layer[int(SiteSet::kAE)].empty());
}

TEST(GradientAngle, MatchesTheDefinitionAndIsExactForEqualGradients) {
  const std::vector<std::vector<float>> a = {{3, 0}, {0, 0, 1}};
  std::vector<double> per_layer;
  EXPECT_EQ(GradientAngle(a, a, &per_layer), 0.0);
  EXPECT_EQ(per_layer, (std::vector<double>{0.0, 0.0}));
  // Layer 0 turned by 90 degrees, layer 1 reversed; the network angle from the whole vectors.
  const std::vector<std::vector<float>> b = {{0, 3}, {0, 0, -1}};
  const double net = GradientAngle(a, b, &per_layer);
  EXPECT_NEAR(per_layer[0], 90.0, 1e-12);
  EXPECT_NEAR(per_layer[1], 180.0, 1e-12);
  EXPECT_NEAR(net, std::acos(-1.0 / 10.0) * 180.0 / M_PI, 1e-12);  // cos = (0 - 1) / 10
  // A small angle keeps its precision: 1e-7 rad.
  const std::vector<std::vector<float>> c = {{1, 0}}, d = {{1, 1e-7f}};
  EXPECT_NEAR(GradientAngle(c, d, &per_layer), double(1e-7f) * 180.0 / M_PI, 1e-15);
  // Zero gradients.
  const std::vector<std::vector<float>> z = {{0, 0}}, n = {{1, 0}};
  EXPECT_EQ(GradientAngle(z, z, &per_layer), 0.0);
  EXPECT_EQ(GradientAngle(z, n, &per_layer), 90.0);
  // A gradient that overflowed (a format with Inf) keeps no direction: the worst angle, never NaN,
  // so that every angle a search writes lies in [0, 180] (issue 26 item 7).
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<std::vector<float>> o = {{inf, 1}, {0, 0, 1}}, q = {{NAN, 1}, {0, 0, 1}};
  EXPECT_EQ(GradientAngle(a, o, &per_layer), 180.0);
  EXPECT_EQ(per_layer[0], 180.0);
  EXPECT_EQ(per_layer[1], 0.0);
  EXPECT_EQ(GradientAngle(q, a, &per_layer), 180.0);
}

TEST(GradientAngleIndicator, RejectsBadOptions) {
  Fixture f = Make("mlp");
  IndicatorOptions none;
  none.sites.clear();
  EXPECT_FALSE(GradientAngleIndicator::Create(f.model.get(), none).ok());
  IndicatorOptions bad_layer;
  bad_layer.keep_fp32 = {"conv9"};
  EXPECT_EQ(GradientAngleIndicator::Create(f.model.get(), bad_layer).status().code(),
            Status::Code::kInvalidArgument);
  EXPECT_FALSE(ParseSiteSets("A,X").ok());
  EXPECT_FALSE(ParseSiteSets("A,A").ok());
  EXPECT_EQ(ParseSiteSets("E,AE").value(), (std::vector<SiteSet>{SiteSet::kE, SiteSet::kAE}));
}

}  // namespace
}  // namespace cpd::runtime
