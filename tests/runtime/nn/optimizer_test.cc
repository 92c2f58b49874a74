// SGD (torch.optim.SGD semantics), Nesterov, coupled weight decay and LARS, against values worked
// out by hand from the formulas in runtime/nn/optimizer.h; AdamW's float32 rule and which params
// it decays, gradient clipping by global norm (optimizer_torch_test.py compares both with
// PyTorch); state export/import for bit-identical resume; determinism across thread counts.
#include "runtime/nn/optimizer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "runtime/nn/models.h"
#include "runtime/nn/recurrent.h"
#include "runtime/nn/transformer.h"

namespace cpd::runtime {
namespace {

std::unique_ptr<Param> MakeParam(const std::string& name, std::vector<float> values,
                                 bool weight_decay = true) {
  auto p = std::make_unique<Param>();
  p->name = name;
  p->value = Tensor({int64_t(values.size())});
  p->grad = Tensor({int64_t(values.size())});
  for (size_t i = 0; i < values.size(); ++i) p->value.data()[i] = values[i];
  p->weight_decay = weight_decay;
  return p;
}

void SetGrad(Param* p, std::vector<float> g) {
  ASSERT_EQ(g.size(), p->grad.numel());
  for (size_t i = 0; i < g.size(); ++i) p->grad.data()[i] = g[i];
}

// float32 arithmetic against exact decimal values: a few ulps.
void ExpectClose(float actual, double expected, const std::string& what) {
  EXPECT_NEAR(actual, expected, 4e-7 * std::max(1.0, std::abs(expected))) << what;
}

OptimizerOptions Sgd(double momentum, double wd, bool nesterov) {
  OptimizerOptions o;
  o.momentum = momentum;
  o.weight_decay = wd;
  o.nesterov = nesterov;
  return o;
}

// w0 = 1, gradient 0.5 at every step, lr 0.1, momentum 0.9. Expected (w, buf) after steps 1..3,
// from torch.optim.SGD's rule: d = g + wd w; buf = m buf + d (buf = d at step 1);
// d = nesterov ? d + m buf : buf; w -= lr d.
struct Trajectory {
  const char* name;
  double wd;
  bool nesterov;
  bool decay_flag;
  double w[3], buf[3];
};

TEST(Sgd, ThreeStepsMatchTorchSemantics) {
  const Trajectory cases[] = {
      // buf: 0.5, 0.9*0.5+0.5 = 0.95, 0.9*0.95+0.5 = 1.355; w: 1-0.05, 0.95-0.095, 0.855-0.1355
      {"momentum", 0.0, false, true, {0.95, 0.855, 0.7195}, {0.5, 0.95, 1.355}},
      // d = 0.5 + 0.9 buf: 0.95, 1.355, 1.7195; w: 1-0.095, 0.905-0.1355, 0.7695-0.17195
      {"nesterov", 0.0, true, true, {0.905, 0.7695, 0.59755}, {0.5, 0.95, 1.355}},
      // d = 0.5 + 0.1 w: 0.6, 0.594, 0.58266; buf: 0.6, 1.134, 1.60326;
      // w: 1-0.06 = 0.94, 0.94-0.1134 = 0.8266, 0.8266-0.160326 = 0.666274
      {"weight decay", 0.1, false, true, {0.94, 0.8266, 0.666274}, {0.6, 1.134, 1.60326}},
      // d: 0.6, 0.5886, 0.5725566; buf: 0.6, 1.1286, 1.5882966;
      // step d: 1.14, 1.60434, 2.00202354; w: 0.886, 0.725566, 0.525363646
      {"nesterov + weight decay",
       0.1,
       true,
       true,
       {0.886, 0.725566, 0.525363646},
       {0.6, 1.1286, 1.5882966}},
      // weight_decay = false on the param: no decay term, so the plain momentum trajectory.
      {"decay flag off", 0.1, false, false, {0.95, 0.855, 0.7195}, {0.5, 0.95, 1.355}},
  };
  for (const Trajectory& c : cases) {
    auto p = MakeParam("w", {1.0f}, c.decay_flag);
    Optimizer opt({p.get()}, Sgd(0.9, c.wd, c.nesterov));
    ASSERT_EQ(opt.State().size(), 1u);
    EXPECT_EQ(opt.State()[0].first, "momentum/w");
    for (int s = 0; s < 3; ++s) {
      SetGrad(p.get(), {0.5f});
      opt.Step(0.1);
      ExpectClose(p->value.data()[0], c.w[s], std::string(c.name) + " w step " + std::to_string(s));
      ExpectClose(opt.State()[0].second->data()[0], c.buf[s],
                  std::string(c.name) + " buf step " + std::to_string(s));
    }
  }
}

TEST(Sgd, NoMomentumKeepsNoState) {
  // d = 0.5 + 0.1 w, w -= 0.1 d: 1 - 0.06 = 0.94; 0.94 - 0.0594 = 0.8806; 0.8806 - 0.058806.
  auto p = MakeParam("w", {1.0f});
  Optimizer opt({p.get()}, Sgd(0.0, 0.1, false));
  EXPECT_TRUE(opt.State().empty());
  const double expected[] = {0.94, 0.8806, 0.821794};
  for (int s = 0; s < 3; ++s) {
    SetGrad(p.get(), {0.5f});
    opt.Step(0.1);
    ExpectClose(p->value.data()[0], expected[s], "step " + std::to_string(s));
  }
  EXPECT_TRUE(opt.LoadState({}).ok());
  EXPECT_FALSE(opt.LoadState({{"momentum/w", {0.0f}}}).ok());
}

TEST(Sgd, ElementwiseOnVectorsAndZeroGrad) {
  // Two elements with different gradients follow independent trajectories; a bias without decay.
  auto w = MakeParam("fc.weight", {1.0f, -2.0f});
  auto b = MakeParam("fc.bias", {0.5f}, /*weight_decay=*/false);
  Optimizer opt({w.get(), b.get()}, Sgd(0.9, 0.1, false));
  SetGrad(w.get(), {0.5f, 0.0f});
  SetGrad(b.get(), {-1.0f});
  opt.Step(0.1);
  ExpectClose(w->value.data()[0], 0.94, "w0");  // as the weight-decay trajectory
  // d = 0 + 0.1 * -2 = -0.2; buf = -0.2; w = -2 + 0.02 = -1.98
  ExpectClose(w->value.data()[1], -1.98, "w1");
  ExpectClose(b->value.data()[0], 0.6, "bias");  // 0.5 - 0.1 * -1
  opt.ZeroGrad();
  EXPECT_EQ(w->grad.data()[0], 0.0f);
  EXPECT_EQ(b->grad.data()[0], 0.0f);
  // With zero gradients momentum still carries: w1: d = -0.198, buf = -0.18 - 0.198 = -0.378,
  // w = -1.98 + 0.0378 = -1.9422. bias: buf = 0.9 * -1 = -0.9, w = 0.6 + 0.09 = 0.69.
  opt.Step(0.1);
  ExpectClose(w->value.data()[1], -1.9422, "w1 step 2");
  ExpectClose(b->value.data()[0], 0.69, "bias step 2");
}

// ---- LARS ------------------------------------------------------------------------------------

TEST(Lars, TrustRatioAndThreeSteps) {
  // w = [3, 4] (||w|| = 5), g = [0.3, 0.4] (||g|| = 0.5) at every step, wd 0.01, eta 0.001,
  // lr 1, momentum 0.9. Step 1: trust = 0.001 * 5 / (0.5 + 0.05) = 1/110;
  // d = g + 0.01 w = [0.33, 0.44] = 0.55 [0.6, 0.8]; v = trust d = [0.003, 0.004];
  // w = [2.997, 3.996] = 0.999 [3, 4].
  // Step 2: ||w|| = 4.995, trust = 0.004995 / 0.54995; d = 0.54995 [0.6, 0.8];
  // trust d = [0.002997, 0.003996]; v = 0.9 [0.003, 0.004] + that = [0.005697, 0.007596];
  // w = [2.991303, 3.988404] = 0.997101 [3, 4].
  // Step 3: ||w|| = 4.985505, trust = 0.004985505 / 0.54985505; trust d = [0.002991303,
  // 0.003988404]; v = [0.008118603, 0.010824804]; w = [2.983184397, 3.977579196].
  auto w = MakeParam("conv.weight", {3.0f, 4.0f});
  auto b = MakeParam("conv.bias", {1.0f}, /*weight_decay=*/false);
  auto z = MakeParam("zero.weight", {0.0f, 0.0f});
  OptimizerOptions o = Sgd(0.9, 0.01, false);
  o.kind = OptimizerKind::kLars;
  o.lars_eta = 0.001;
  Optimizer opt({w.get(), b.get(), z.get()}, o);
  ASSERT_EQ(opt.State().size(), 3u);
  EXPECT_EQ(opt.State()[0].first, "lars_momentum/conv.weight");

  const double trust[] = {1.0 / 110.0, 0.004995 / 0.54995, 0.004985505 / 0.54985505};
  const double v[3][2] = {{0.003, 0.004}, {0.005697, 0.007596}, {0.008118603, 0.010824804}};
  const double wv[3][2] = {{2.997, 3.996}, {2.991303, 3.988404}, {2.983184397, 3.977579196}};
  // The bias (no weight decay) skips the trust ratio (lars_exclude bias-bn, the default): plain
  // momentum at lr 1 x 0.024 with g = -0.5: v = -0.012, -0.0228, -0.03252;
  // w = 1.012, 1.0348, 1.06732.
  const double bias_w[] = {1.012, 1.0348, 1.06732};
  for (int s = 0; s < 3; ++s) {
    SetGrad(w.get(), {0.3f, 0.4f});
    SetGrad(b.get(), {-0.5f});
    SetGrad(z.get(), {0.25f, -0.5f});
    opt.Step(1.0);
    const std::string at = " step " + std::to_string(s);
    EXPECT_NEAR(opt.last_trust_ratios()[0], trust[s], 1e-6 * trust[s]) << at;
    EXPECT_EQ(opt.last_trust_ratios()[1], 1.0) << at;
    for (int i = 0; i < 2; ++i) {
      ExpectClose(w->value.data()[i], wv[s][i], "w" + at);
      EXPECT_NEAR(opt.State()[0].second->data()[i], v[s][i], 2e-6 * v[s][i]) << "v" << at;
    }
    ExpectClose(b->value.data()[0], bias_w[s], "bias" + at);
    if (s == 0) {
      // ||w|| = 0 for the zero tensor: trust 1, so w = -lr (g + wd * 0) = [-0.25, 0.5].
      EXPECT_EQ(opt.last_trust_ratios()[2], 1.0);
      ExpectClose(z->value.data()[0], -0.25, "zero tensor");
      ExpectClose(z->value.data()[1], 0.5, "zero tensor");
    }
  }
}

TEST(Lars, NesterovAndZeroGradient) {
  // Nesterov LARS, step 1: v = trust d = [0.003, 0.004], w -= m v + trust d = 1.9 v:
  // w = [3 - 0.0057, 4 - 0.0076].
  auto w = MakeParam("w", {3.0f, 4.0f});
  OptimizerOptions o = Sgd(0.9, 0.01, true);
  o.kind = OptimizerKind::kLars;
  Optimizer opt({w.get()}, o);
  SetGrad(w.get(), {0.3f, 0.4f});
  opt.Step(1.0);
  ExpectClose(w->value.data()[0], 2.9943, "w0");
  ExpectClose(w->value.data()[1], 3.9924, "w1");
  // A zero gradient gives trust 1 (skipped); d = 0.01 w is then applied at the full lr 0.1:
  // v = 0.9 [0.003, 0.004] + 0.1 * 0.01 * [2.9943, 3.9924] = [0.0056943, 0.0075924]
  // w -= 0.9 v + 0.1 * 0.01 * w.
  opt.ZeroGrad();
  opt.Step(0.1);
  EXPECT_EQ(opt.last_trust_ratios()[0], 1.0);
  ExpectClose(w->value.data()[0], 2.9943 - (0.9 * 0.0056943 + 0.0029943), "w0 step 2");
  ExpectClose(w->value.data()[1], 3.9924 - (0.9 * 0.0075924 + 0.0039924), "w1 step 2");
}

// Params w (decayed), b (a bias) and the same w and b under `o`, one step at lr 1 with
// momentum 0 from w = [3, 4], g = [0.3, 0.4] and b = [3, 4], g = [0.3, 0.4] as well.
struct ExcludeCase {
  std::unique_ptr<Param> w = MakeParam("fc.weight", {3.0f, 4.0f});
  std::unique_ptr<Param> b = MakeParam("fc.bias", {3.0f, 4.0f}, /*weight_decay=*/false);
  std::vector<double> trust;
  explicit ExcludeCase(OptimizerOptions o) {
    Optimizer opt({w.get(), b.get()}, o);
    SetGrad(w.get(), {0.3f, 0.4f});
    SetGrad(b.get(), {0.3f, 0.4f});
    opt.Step(1.0);
    trust = opt.last_trust_ratios();
  }
};

OptimizerOptions LarsNoMomentum(double wd) {
  OptimizerOptions o = Sgd(0.0, wd, false);
  o.kind = OptimizerKind::kLars;
  o.lars_eta = 0.001;
  return o;
}

TEST(Lars, ExcludedRatioChangesOnlyBiasesAndBatchNorm) {
  // wd 0.01: the weight's trust = 0.001 * 5 / (0.5 + 0.05) = 1/110, d = 0.55 [0.6, 0.8],
  // w = [3, 4] - [0.003, 0.004] whatever the ratio. The bias: w = b - ratio * g.
  OptimizerOptions half = LarsNoMomentum(0.01), quarter = LarsNoMomentum(0.01);
  half.lars_excluded_lr_ratio = 0.5;
  quarter.lars_excluded_lr_ratio = 0.25;
  ExcludeCase a(half), b(quarter);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(a.w->value.data()[i], b.w->value.data()[i]) << "the weight must not see the ratio";
  }
  ExpectClose(a.w->value.data()[0], 2.997, "weight");
  ExpectClose(a.w->value.data()[1], 3.996, "weight");
  // Exact in float: 3 - 0.5 * 0.3f etc.
  EXPECT_EQ(a.b->value.data()[0], 3.0f - 0.5f * 0.3f);
  EXPECT_EQ(a.b->value.data()[1], 4.0f - 0.5f * 0.4f);
  EXPECT_EQ(b.b->value.data()[0], 3.0f - 0.25f * 0.3f);
  EXPECT_EQ(b.b->value.data()[1], 4.0f - 0.25f * 0.4f);
  EXPECT_EQ(a.trust[1], 1.0);
  EXPECT_NEAR(a.trust[0], 1.0 / 110.0, 1e-8);
}

TEST(Lars, ExcludeNoneGivesEveryParamATrustRatioButNoDecay) {
  // The bias now takes trust = 0.001 * 5 / (0.5 + 0 * 5) = 0.01 (no decay for it, though the
  // optimiser has wd 0.01): w = [3, 4] - 0.01 [0.3, 0.4] = [2.997, 3.996]. The weight is as
  // under bias-bn; the ratio is unused.
  OptimizerOptions none = LarsNoMomentum(0.01), bias_bn = LarsNoMomentum(0.01);
  none.lars_exclude = LarsExclude::kNone;
  none.lars_excluded_lr_ratio = 0.5;
  ExcludeCase a(none), b(bias_bn);
  EXPECT_NEAR(a.trust[1], 0.01, 1e-8);  // norms of float inputs
  ExpectClose(a.b->value.data()[0], 2.997, "bias");
  ExpectClose(a.b->value.data()[1], 3.996, "bias");
  for (int i = 0; i < 2; ++i) EXPECT_EQ(a.w->value.data()[i], b.w->value.data()[i]);
  EXPECT_EQ(a.trust[0], b.trust[0]);
}

TEST(Sgd, LarsExcludeOptionsDoNotChangeSgd) {
  OptimizerOptions plain = Sgd(0.0, 0.01, false), odd = Sgd(0.0, 0.01, false);
  odd.lars_exclude = LarsExclude::kNone;
  odd.lars_excluded_lr_ratio = 0.5;
  ExcludeCase a(plain), b(odd);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(a.w->value.data()[i], b.w->value.data()[i]);
    EXPECT_EQ(a.b->value.data()[i], b.b->value.data()[i]);
  }
  // Plain SGD at lr 1: the bias w = b - g, exactly.
  EXPECT_EQ(a.b->value.data()[0], 3.0f - 0.3f);
  EXPECT_EQ(a.trust, (std::vector<double>{1.0, 1.0}));
}

TEST(Lars, ExcludeNamesParse) {
  EXPECT_EQ(*ParseLarsExclude("bias-bn"), LarsExclude::kBiasBn);
  EXPECT_EQ(*ParseLarsExclude("none"), LarsExclude::kNone);
  EXPECT_STREQ(LarsExcludeName(LarsExclude::kNone), "none");
  const auto bad = ParseLarsExclude("biases");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "lars-exclude 'biases' (accepted: bias-bn, none)");
}

// ---- State, determinism, validation ----------------------------------------------------------

// A small model: a big weight (several chunks, parallel path), a small one, a bias.
struct Model {
  std::vector<std::unique_ptr<Param>> params;
  std::vector<Param*> Ptrs() {
    std::vector<Param*> out;
    for (auto& p : params) out.push_back(p.get());
    return out;
  }
};

Model MakeModel(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Model m;
  const size_t sizes[] = {100003, 257, 16};
  const char* names[] = {"l1.weight", "l2.weight", "l2.bias"};
  for (int i = 0; i < 3; ++i) {
    std::vector<float> v(sizes[i]);
    for (float& x : v) x = nd(rng);
    m.params.push_back(MakeParam(names[i], v, /*weight_decay=*/i < 2));
  }
  return m;
}

void RandomGrads(Model* m, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.1f);
  for (auto& p : m->params) {
    for (size_t i = 0; i < p->grad.numel(); ++i) p->grad.data()[i] = nd(rng);
  }
}

bool SameBits(const Model& a, const Model& b) {
  for (size_t i = 0; i < a.params.size(); ++i) {
    const Tensor& x = a.params[i]->value;
    const Tensor& y = b.params[i]->value;
    if (x.numel() != y.numel() || std::memcmp(x.data(), y.data(), x.numel() * 4) != 0) {
      return false;
    }
  }
  return true;
}

class StateRoundTrip : public ::testing::TestWithParam<OptimizerKind> {};

TEST_P(StateRoundTrip, ResumedRunIsBitIdentical) {
  OptimizerOptions o = Sgd(0.9, 5e-4, /*nesterov=*/GetParam() != OptimizerKind::kAdamW);
  o.kind = GetParam();
  if (o.kind == OptimizerKind::kAdamW) o.weight_decay = 0.1;
  // Uninterrupted: 6 steps.
  Model a = MakeModel(1);
  Optimizer oa(a.Ptrs(), o);
  for (int s = 0; s < 6; ++s) {
    RandomGrads(&a, 100 + s);
    oa.Step(0.05 * (s + 1));
  }
  // Interrupted after 3: export, then a fresh model + optimiser loaded from the copies.
  Model b = MakeModel(1);
  Optimizer ob(b.Ptrs(), o);
  for (int s = 0; s < 3; ++s) {
    RandomGrads(&b, 100 + s);
    ob.Step(0.05 * (s + 1));
  }
  std::map<std::string, std::vector<float>> saved;
  for (const auto& [key, t] : ob.State()) saved[key].assign(t->data(), t->data() + t->numel());
  // AdamW: m and v per param, and the step count.
  EXPECT_EQ(saved.size(), o.kind == OptimizerKind::kAdamW ? 7u : 3u);
  Model c = MakeModel(999);
  for (size_t i = 0; i < c.params.size(); ++i) c.params[i]->value.CopyFrom(b.params[i]->value);
  Optimizer oc(c.Ptrs(), o);
  ASSERT_TRUE(oc.LoadState(saved).ok());
  for (int s = 3; s < 6; ++s) {
    RandomGrads(&c, 100 + s);
    oc.Step(0.05 * (s + 1));
  }
  EXPECT_TRUE(SameBits(a, c));
  EXPECT_EQ(oc.adam_steps(), oa.adam_steps());
  for (size_t i = 0; i < oa.State().size(); ++i) {
    const Tensor* x = oa.State()[i].second;
    const Tensor* y = oc.State()[i].second;
    EXPECT_EQ(std::memcmp(x->data(), y->data(), x->numel() * 4), 0) << oa.State()[i].first;
  }
}

INSTANTIATE_TEST_SUITE_P(EveryKind, StateRoundTrip,
                         ::testing::Values(OptimizerKind::kSgd, OptimizerKind::kLars,
                                           OptimizerKind::kAdamW),
                         [](const auto& info) { return OptimizerKindName(info.param); });

TEST(OptimizerState, LoadStateRejectsMismatchesAndChangesNothing) {
  auto w = MakeParam("w", {1.0f, 2.0f});
  auto b = MakeParam("b", {3.0f}, false);
  Optimizer opt({w.get(), b.get()}, Sgd(0.9, 0, false));
  const std::map<std::string, std::vector<float>> good{{"momentum/w", {1, 2}}, {"momentum/b", {3}}};
  auto expect = [&](const std::map<std::string, std::vector<float>>& s, const std::string& part) {
    const Status st = opt.LoadState(s);
    EXPECT_EQ(st.code(), Status::Code::kInvalidArgument) << part;
    EXPECT_NE(st.message().find(part), std::string::npos) << st.message();
    EXPECT_EQ(opt.State()[0].second->data()[0], 0.0f);  // untouched
  };
  expect({{"momentum/w", {1, 2}}}, "missing 'momentum/b'");
  expect({{"momentum/w", {1}}, {"momentum/b", {3}}}, "'momentum/w' has 1 values");
  auto extra = good;
  extra["momentum/c"] = {0};
  expect(extra, "unexpected entry 'momentum/c'");
  expect({{"lars_momentum/w", {1, 2}}, {"momentum/b", {3}}}, "unexpected entry 'lars_momentum/w'");
  ASSERT_TRUE(opt.LoadState(good).ok());
  EXPECT_EQ(opt.State()[0].second->data()[1], 2.0f);
  EXPECT_EQ(opt.State()[1].second->data()[0], 3.0f);
}

TEST(Optimizer, ResultsDoNotDependOnTheThreadCount) {
  for (bool lars : {false, true}) {
    OptimizerOptions o = Sgd(0.9, 1e-3, false);
    o.kind = lars ? OptimizerKind::kLars : OptimizerKind::kSgd;
    for (int threads : {2, 3, 8}) {
      Model m = MakeModel(7);
      o.threads = threads;
      Optimizer many(m.Ptrs(), o);
      Model r = MakeModel(7);
      OptimizerOptions o1 = o;
      o1.threads = 1;
      Optimizer single(r.Ptrs(), o1);
      for (int s = 0; s < 3; ++s) {
        RandomGrads(&m, s);
        RandomGrads(&r, s);
        many.Step(0.1);
        single.Step(0.1);
      }
      EXPECT_TRUE(SameBits(m, r)) << "lars=" << lars << " threads=" << threads;
    }
  }
}

TEST(Optimizer, ParallelPathMatchesAScalarReference) {
  // The big tensor runs on OpenMP chunks; each element must follow the float32 rule exactly.
  Model m = MakeModel(3);
  std::vector<float> w(m.params[0]->value.data(),
                       m.params[0]->value.data() + m.params[0]->value.numel());
  std::vector<float> buf(w.size(), 0.0f);
  Optimizer opt(m.Ptrs(), Sgd(0.9, 5e-4, true));
  const float lr = 0.1f, wd = 5e-4f, mom = 0.9f;
  for (int s = 0; s < 3; ++s) {
    RandomGrads(&m, 50 + s);
    const float* g = m.params[0]->grad.data();
    for (size_t i = 0; i < w.size(); ++i) {
      const float d = g[i] + wd * w[i];
      buf[i] = mom * buf[i] + d;
      w[i] = w[i] - lr * (d + mom * buf[i]);
    }
    opt.Step(0.1);
  }
  EXPECT_EQ(std::memcmp(w.data(), m.params[0]->value.data(), w.size() * 4), 0);
}

TEST(Optimizer, ValidationNamesTheProblem) {
  auto w = MakeParam("w", {1.0f});
  auto w2 = MakeParam("w", {1.0f});
  auto bad_grad = MakeParam("g", {1.0f, 2.0f});
  bad_grad->grad = Tensor({3});
  auto expect = [](Result<std::unique_ptr<Optimizer>> r, const std::string& part) {
    ASSERT_FALSE(r.ok()) << part;
    EXPECT_NE(r.status().message().find(part), std::string::npos) << r.status().message();
  };
  expect(Optimizer::Create({w.get(), w2.get()}, {}), "two params are named 'w'");
  expect(Optimizer::Create({bad_grad.get()}, {}), "has value [2] but grad [3]");
  expect(Optimizer::Create({nullptr}, {}), "param #0 is null");
  expect(Optimizer::Create({w.get()}, Sgd(0.0, 0, true)), "Nesterov momentum needs momentum > 0");
  expect(Optimizer::Create({w.get()}, Sgd(-0.1, 0, false)), "momentum -0.1");
  expect(Optimizer::Create({w.get()}, Sgd(0.9, -1, false)), "weight decay -1");
  OptimizerOptions o;
  o.lars_eta = 0;
  expect(Optimizer::Create({w.get()}, o), "LARS eta 0");
  o = OptimizerOptions{};
  o.lars_excluded_lr_ratio = -0.1;
  expect(Optimizer::Create({w.get()}, o), "excluded-param lr ratio -0.1");
  o.lars_excluded_lr_ratio = std::nan("");
  expect(Optimizer::Create({w.get()}, o), "excluded-param lr ratio nan");
  EXPECT_THROW(Optimizer({w.get(), w2.get()}, OptimizerOptions{}), std::invalid_argument);
  EXPECT_TRUE(Optimizer::Create({w.get()}, {}).ok());
}

// ---- AdamW ----------------------------------------------------------------------------------

OptimizerOptions AdamW(double wd) {
  OptimizerOptions o;
  o.kind = OptimizerKind::kAdamW;
  o.weight_decay = wd;
  return o;
}

// Every element of the big, chunked tensor follows optimizer.h's float32 rule exactly, with the
// scalars formed in double and rounded once, as the rule says.
TEST(AdamW, ParallelPathMatchesAScalarReference) {
  Model m = MakeModel(3);
  OptimizerOptions o = AdamW(0.1);
  o.beta2 = 0.95;
  o.eps = 1e-6;
  o.threads = 3;
  std::vector<float> w(m.params[0]->value.data(),
                       m.params[0]->value.data() + m.params[0]->value.numel());
  std::vector<float> mm(w.size(), 0.0f), vv(w.size(), 0.0f);
  Optimizer opt(m.Ptrs(), o);
  for (int t = 1; t <= 4; ++t) {
    const double lr = 0.01 * t;
    RandomGrads(&m, 70 + uint64_t(t));
    const float* g = m.params[0]->grad.data();
    const float decay = float(1 - lr * 0.1), b1 = 0.9f, c1 = float(1 - 0.9), b2 = 0.95f,
                c2 = float(1 - 0.95), eps = 1e-6f;
    const float bc2 = float(std::sqrt(1 - std::pow(0.95, t)));
    const float step = float(lr / (1 - std::pow(0.9, t)));
    for (size_t i = 0; i < w.size(); ++i) {
      mm[i] = b1 * mm[i] + c1 * g[i];
      vv[i] = b2 * vv[i] + (c2 * g[i]) * g[i];
      w[i] = w[i] * decay - (step * mm[i]) / (std::sqrt(vv[i]) / bc2 + eps);
    }
    opt.Step(lr);
    EXPECT_EQ(opt.adam_steps(), t);
  }
  EXPECT_EQ(std::memcmp(w.data(), m.params[0]->value.data(), w.size() * 4), 0);
  EXPECT_EQ(std::memcmp(mm.data(), opt.State()[0].second->data(), w.size() * 4), 0);
  EXPECT_EQ(std::memcmp(vv.data(), opt.State()[1].second->data(), w.size() * 4), 0);
}

TEST(AdamW, ResultsDoNotDependOnTheThreadCount) {
  for (int threads : {2, 3, 8}) {
    Model m = MakeModel(7), r = MakeModel(7);
    OptimizerOptions o = AdamW(0.05);
    o.threads = threads;
    Optimizer many(m.Ptrs(), o);
    o.threads = 1;
    Optimizer single(r.Ptrs(), o);
    for (int s = 0; s < 3; ++s) {
      RandomGrads(&m, s);
      RandomGrads(&r, s);
      EXPECT_EQ(many.ClipGradNorm(1.0), single.ClipGradNorm(1.0));
      many.Step(0.01);
      single.Step(0.01);
    }
    EXPECT_TRUE(SameBits(m, r)) << "threads=" << threads;
  }
}

// Which params decay, for every model: nanoGPT's rule (every param of two or more dimensions:
// weights, convolution kernels, embeddings; no bias, LayerNorm or BatchNorm), through
// Param::weight_decay. With zero gradients an AdamW step moves nothing but the decay, so the
// decayed params are multiplied by exactly float(1 - lr wd) and the others keep their bits.
TEST(AdamW, DecaysExactlyTheParamsOfTwoOrMoreDimensions) {
  std::vector<std::pair<std::string, std::unique_ptr<Sequential>>> models;
  for (const char* arch : {"mlp", "lenet5", "resnet8"}) {
    auto m = BuildModel(arch, 3, 32, 10, 1);
    ASSERT_TRUE(m.ok()) << arch;
    models.emplace_back(arch, std::move(m).value());
  }
  GptOptions gpt;
  gpt.vocab = 40;
  gpt.block_size = 8;
  gpt.transformer.embed = 16;
  gpt.transformer.heads = 2;
  gpt.transformer.layers = 2;
  models.emplace_back("gpt", BuildGpt(gpt, 1));
  LstmLmOptions lstm;
  lstm.vocab = 40;
  lstm.embed = 16;
  lstm.layers = 2;
  lstm.tied_head = false;
  models.emplace_back("lstm", BuildLstm(lstm, 1));
  const double lr = 0.5, wd = 0.1;
  const float decay = float(1 - lr * wd);
  for (auto& [arch, model] : models) {
    const std::vector<Param*> params = model->Params();
    std::vector<Tensor> before;
    int decayed = 0;
    for (Param* p : params) {
      EXPECT_EQ(p->weight_decay, p->value.ndim() >= 2) << arch << " " << p->name;
      decayed += p->weight_decay;
      before.push_back(p->value.Clone());
    }
    EXPECT_GT(decayed, 0) << arch;
    EXPECT_LT(decayed, int(params.size())) << arch;
    Optimizer opt(params, AdamW(wd));
    opt.ZeroGrad();
    opt.Step(lr);
    for (size_t i = 0; i < params.size(); ++i) {
      const float* a = before[i].data();
      const float* b = params[i]->value.data();
      for (size_t k = 0; k < before[i].numel(); ++k) {
        ASSERT_EQ(b[k], params[i]->weight_decay ? a[k] * decay : a[k])
            << arch << " " << params[i]->name << "[" << k << "]";
      }
    }
  }
}

TEST(AdamW, OptionsAndStateAreChecked) {
  auto w = MakeParam("w", {1.0f, 2.0f});
  auto expect = [&](const OptimizerOptions& o, const std::string& part) {
    auto r = Optimizer::Create({w.get()}, o);
    ASSERT_FALSE(r.ok()) << part;
    EXPECT_NE(r.status().message().find(part), std::string::npos) << r.status().message();
  };
  OptimizerOptions o = AdamW(0.1);
  o.beta1 = 1;
  expect(o, "AdamW beta1 1 must be a number in [0, 1)");
  o.beta1 = std::nan("");
  expect(o, "AdamW beta1 nan");
  o = AdamW(0.1);
  o.beta2 = -0.5;
  expect(o, "AdamW beta2 -0.5");
  o = AdamW(0.1);
  o.eps = 0;
  expect(o, "AdamW eps 0 must be a positive number");
  o = AdamW(0.1);
  o.nesterov = true;
  expect(o, "Nesterov momentum applies to sgd and lars, not adamw");
  EXPECT_EQ(ParseOptimizerKind("adamw").value(), OptimizerKind::kAdamW);
  EXPECT_NE(ParseOptimizerKind("adam").status().message().find("accepted: sgd, lars, adamw"),
            std::string::npos);

  Optimizer opt({w.get()}, AdamW(0.1));
  const auto status = [&](const std::map<std::string, std::vector<float>>& s) {
    return opt.LoadState(s).message();
  };
  // SGD's state names its optimiser; a step count must be two integers below 2^24.
  EXPECT_NE(
      status({{"momentum/w", {0, 0}}}).find("(state of --optimizer sgd) for --optimizer adamw"),
      std::string::npos)
      << status({{"momentum/w", {0, 0}}});
  std::map<std::string, std::vector<float>> good{
      {"adamw_m/w", {1, 2}}, {"adamw_v/w", {3, 4}}, {"adamw_step", {1, 5}}};
  auto bad = good;
  bad["adamw_step"] = {0, 2.5f};
  EXPECT_NE(status(bad).find("'adamw_step' [0, 2.5] is not a step count"), std::string::npos);
  bad["adamw_step"] = {-1, 0};
  EXPECT_NE(status(bad).find("is not a step count"), std::string::npos);
  EXPECT_EQ(opt.adam_steps(), 0);
  EXPECT_EQ(opt.State()[0].second->data()[0], 0.0f);  // untouched
  ASSERT_TRUE(opt.LoadState(good).ok());
  EXPECT_EQ(opt.adam_steps(), (int64_t(1) << 24) + 5);
  EXPECT_EQ(opt.State()[1].second->data()[1], 4.0f);
}

// ---- Gradient clipping ----------------------------------------------------------------------

// The norm against a double-precision sum, the scale exactly float(max / (norm + 1e-6)) on every
// gradient, and clipping at a max_norm above the norm a no-op, bit for bit.
TEST(ClipGradNorm, ScalesByTorchsCoefficientAndOnlyAboveTheMax) {
  Model m = MakeModel(11);
  RandomGrads(&m, 12);
  Optimizer opt(m.Ptrs(), Sgd(0.9, 0, false));
  double exact = 0;
  std::vector<std::vector<float>> before;
  for (auto& p : m.params) {
    before.emplace_back(p->grad.data(), p->grad.data() + p->grad.numel());
    for (float g : before.back()) exact += double(g) * double(g);
  }
  exact = std::sqrt(exact);  // ~ 0.1 sqrt(100276) = 31.7
  for (double huge : {1e30, exact * 2, 0.0}) {
    EXPECT_NEAR(opt.ClipGradNorm(huge), exact, 1e-6 * exact) << huge;
    for (size_t i = 0; i < m.params.size(); ++i) {
      ASSERT_EQ(std::memcmp(before[i].data(), m.params[i]->grad.data(), before[i].size() * 4), 0)
          << huge << " " << m.params[i]->name;
    }
  }
  const double norm = opt.ClipGradNorm(1.0);
  const float coef = float(1.0 / (norm + 1e-6));
  for (size_t i = 0; i < m.params.size(); ++i) {
    for (size_t k = 0; k < before[i].size(); ++k) {
      ASSERT_EQ(m.params[i]->grad.data()[k], before[i][k] * coef) << m.params[i]->name << k;
    }
  }
  EXPECT_NEAR(opt.ClipGradNorm(0.0), 1.0, 1e-6);
}

TEST(ClipGradNorm, NonFiniteGradientsGiveANonFiniteNormAndAreLeftAlone) {
  auto w = MakeParam("w", {1.0f, 2.0f, 3.0f});
  Optimizer opt({w.get()}, AdamW(0));
  SetGrad(w.get(), {3.0f, std::numeric_limits<float>::infinity(), 4.0f});
  EXPECT_TRUE(std::isinf(opt.ClipGradNorm(1.0)));
  EXPECT_EQ(w->grad.data()[0], 3.0f);
  SetGrad(w.get(), {3.0f, std::nanf(""), 4.0f});
  EXPECT_TRUE(std::isnan(opt.ClipGradNorm(1.0)));
  EXPECT_EQ(w->grad.data()[2], 4.0f);
  // Finite gradients whose squares overflow the float sums of a 64-element block: the norm is
  // Inf (the trainer skips the step) and they stay as they are.
  auto big = MakeParam("big", std::vector<float>(64, 1.0f));
  Optimizer big_opt({big.get()}, AdamW(0));
  SetGrad(big.get(), std::vector<float>(64, 3e20f));
  EXPECT_TRUE(std::isinf(big_opt.ClipGradNorm(1.0)));
  EXPECT_EQ(big->grad.data()[63], 3e20f);
  SetGrad(w.get(), {3.0f, 0.0f, 4.0f});
  EXPECT_EQ(opt.ClipGradNorm(10.0), 5.0);
  Optimizer none(std::vector<Param*>{}, AdamW(0));
  EXPECT_EQ(none.ClipGradNorm(1.0), 0.0);
}

}  // namespace
}  // namespace cpd::runtime
