// The precision policy mid-run: SiteQuantizer::Reconfigure (what a schedule pushed by the
// coordinator does to the hooks) and the policy's JSON form (how rank 0 hands it to every rank
// and how checkpoints record it).
#include "runtime/nn/quant_sites.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "cpd/accumulate.h"
#include "cpd/format.h"
#include "cpd/quantize.h"
#include "kernels/accumulate_cpu.h"
#include "runtime/control/job_control.h"
#include "runtime/nn/layers.h"
#include "runtime/nn/models.h"
#include "runtime/nn/recurrent.h"

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

// ---- Weight flips ----------------------------------------------------------------------------

// Quantises `w` as the W of `layer` (one forward) and returns the weights as used.
std::vector<float> QuantizeW(SiteQuantizer& q, const Layer& layer, std::vector<int64_t> shape,
                             const std::vector<float>& w) {
  Tensor master(shape), used(shape);
  master.CopyFromHost(w.data());
  q.QuantizeWeight(layer, master, &used);
  std::vector<float> out(used.numel());
  used.CopyToHost(out.data());
  return out;
}

// e4m3 is a fixed grid (spacing 0.25 in [2, 4)), so every quantised value is known: a step whose
// weights move from {1, 2, 3, 4} to {1, 2.01, 3.3, 4} changes one quantised weight (3 -> 3.25),
// and moving 3.3 back to 3.1 changes it back under nearest rounding but not under hysteresis
// (3.1 < 3.25: ceil to the grid keeps 3.25).
TEST_F(SiteQuantizerTest, CountsFlipsOfNearestRoundedWeights) {
  const std::vector<std::vector<float>> steps = {
      {1.0f, 2.0f, 3.0f, 4.0f}, {1.0f, 2.01f, 3.3f, 4.0f}, {1.0f, 2.01f, 3.1f, 4.0f}};
  for (const bool hysteresis : {false, true}) {
    PrecisionConfig c;
    c.global[int(Site::kWeight)].spec = "e4m3";
    c.hysteresis = hysteresis;
    auto q = SiteQuantizer::Create(c, Layers());
    ASSERT_TRUE(q.ok()) << q.status().message();
    EXPECT_TRUE((*q)->QuantizesWeights());
    std::vector<uint64_t> flips;
    for (const auto& w : steps) {
      QuantizeW(**q, fc2_, {2, 2}, w);
      flips.push_back((*q)->TakeFlips().at("fc2"));
    }
    // The first forward has nothing to compare with.
    const std::vector<uint64_t> want =
        hysteresis ? std::vector<uint64_t>{0, 1, 0} : std::vector<uint64_t>{0, 1, 1};
    EXPECT_EQ(flips, want) << (hysteresis ? "hysteresis" : "nearest");
    EXPECT_EQ((*q)->Flips().at("fc1"), 0u);  // no forward
  }
}

TEST_F(SiteQuantizerTest, FlipsRestartWhenTheWeightFormatChangesAndStopAtFp32) {
  PrecisionConfig c;
  c.global[int(Site::kWeight)].spec = "e4m3";
  auto q = SiteQuantizer::Create(c, Layers());
  ASSERT_TRUE(q.ok());
  QuantizeW(**q, fc2_, {4}, {1.0f, 2.0f, 3.0f, 4.0f});
  EXPECT_EQ((*q)->HysteresisState().count("fc2"), 1u);  // kept without hysteresis too
  c.global[int(Site::kWeight)].spec = "e2m1";
  ASSERT_TRUE((*q)->Reconfigure(c).ok());
  QuantizeW(**q, fc2_, {4}, {1.0f, 2.0f, 3.3f, 4.0f});  // another grid: nothing to compare
  EXPECT_EQ((*q)->TakeFlips().at("fc2"), 0u);
  ASSERT_TRUE((*q)->Reconfigure(PrecisionConfig{}).ok());
  EXPECT_FALSE((*q)->QuantizesWeights());
  EXPECT_TRUE((*q)->HysteresisState().empty());  // fp32 W keeps no previous weights
}

// ---- log<b> grouping per layer (Lee et al.) -----------------------------------------------------

// Two output channels of very different magnitudes: one log4 scale for the tensor flushes the
// small channel (its values lie below 2^-7, half the smallest level 2^-6 of a max-1 tensor),
// one scale per channel keeps it.
// E of fc2 rounded stochastically, n times in a row, of the same tensor.
std::vector<Tensor> RoundErrorsRepeatedly(SiteQuantizer& q, const Layer& layer, const Tensor& dy,
                                          int n) {
  std::vector<Tensor> out;
  for (int i = 0; i < n; ++i) {
    out.emplace_back(dy.shape());
    q.QuantizeError(layer, dy, &out.back());
  }
  return out;
}

bool Identical(const Tensor& a, const Tensor& b) {
  return std::memcmp(a.data(), b.data(), a.numel() * sizeof(float)) == 0;
}

// The k-th call of a site within a step (an LSTM's timesteps, an attention product's two
// operands) rounds with its own random bits; the counts restart with the step and the worker,
// so a step replayed (resume) or a worker emulated repeats its streams exactly.
TEST_F(SiteQuantizerTest, EachCallOfASiteWithinAStepDrawsItsOwnStream) {
  PrecisionConfig c;
  c.global[int(Site::kError)] = {"e2m1", Rounding::kStochastic};
  auto q = SiteQuantizer::Create(c, Layers());
  ASSERT_TRUE(q.ok()) << q.status().message();
  Tensor dy({4, 16});
  for (size_t i = 0; i < dy.numel(); ++i) dy.data()[i] = 0.3f + 0.01f * float(i % 7);
  (*q)->SetStep(5);
  const std::vector<Tensor> first = RoundErrorsRepeatedly(**q, fc2_, dy, 3);
  EXPECT_FALSE(Identical(first[0], first[1]));
  EXPECT_FALSE(Identical(first[1], first[2]));
  (*q)->SetStep(5);  // the same step again: the same three streams
  const std::vector<Tensor> again = RoundErrorsRepeatedly(**q, fc2_, dy, 3);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(Identical(first[size_t(i)], again[size_t(i)])) << i;
  (*q)->SetWorker(1);  // another worker: other streams; back to worker 0: the first again
  EXPECT_FALSE(Identical(first[0], RoundErrorsRepeatedly(**q, fc2_, dy, 1)[0]));
  (*q)->SetWorker(0);
  EXPECT_TRUE(Identical(first[0], RoundErrorsRepeatedly(**q, fc2_, dy, 1)[0]));
  // Another layer's first call is not fc2's first call.
  (*q)->SetStep(5);
  Tensor other(dy.shape());
  (*q)->QuantizeError(fc1_, dy, &other);
  EXPECT_FALSE(Identical(first[0], other));
}

TEST(SiteQuantizerLogScope, ConvolutionsPerChannelOtherLayersPerTensor) {
  Linear fc("fc", 2, 2, true, 1);
  Conv2d conv("conv", 2, 2, 1, 1, 0, true, 2);
  const std::vector<float> w = {1.0f, 0.5f, 0.003f, 0.002f};  // [2, 2] or [2, 2, 1, 1]
  auto quantize = [&w](const std::string& spec, size_t channels) {
    std::vector<float> out(w.size());
    QuantizeOptions o;
    o.channels = channels;
    EXPECT_TRUE(Quantize(*Format::Parse(spec), w.data(), out.data(), w.size(), o).ok());
    return out;
  };
  const std::vector<float> per_tensor = quantize("log4:tensor", 2);
  const std::vector<float> per_channel = quantize("log4:ch", 2);
  ASSERT_NE(per_tensor, per_channel);
  EXPECT_EQ(per_tensor[2], 0.0f);
  EXPECT_NE(per_channel[2], 0.0f);

  struct Case {
    std::string spec, fc_want, conv_want;
  };
  for (const Case& k :
       {Case{"log4", "log4:tensor", "log4:ch"}, Case{"log4:ch", "log4:ch", "log4:ch"},
        Case{"log4:tensor", "log4:tensor", "log4:tensor"}}) {
    PrecisionConfig c;
    c.global[int(Site::kWeight)].spec = k.spec;
    c.global[int(Site::kWeightGrad)].spec = k.spec;
    c.global[int(Site::kActivation)].spec = k.spec;
    auto q = SiteQuantizer::Create(c, {&conv, &fc});
    ASSERT_TRUE(q.ok()) << q.status().message();
    EXPECT_EQ((*q)->SpecFor("fc", Site::kWeight), k.fc_want) << k.spec;
    EXPECT_EQ((*q)->SpecFor("fc", Site::kWeightGrad), k.fc_want) << k.spec;
    EXPECT_EQ((*q)->SpecFor("conv", Site::kWeight), k.conv_want) << k.spec;
    EXPECT_EQ((*q)->SpecFor("conv", Site::kWeightGrad), k.conv_want) << k.spec;
    // Activations have no output channels: per tensor unless :ch is asked for.
    EXPECT_EQ((*q)->SpecFor("conv", Site::kActivation),
              k.spec == "log4:ch" ? "log4:ch" : "log4:tensor")
        << k.spec;
    auto want = [&](const std::string& spec) {
      return spec == "log4:ch" ? per_channel : per_tensor;
    };
    EXPECT_EQ(QuantizeW(**q, fc, {2, 2}, w), want(k.fc_want)) << k.spec;
    EXPECT_EQ(QuantizeW(**q, conv, {2, 2, 1, 1}, w), want(k.conv_want)) << k.spec;
    Tensor g({2, 2});  // G as the layer hands it over
    g.CopyFromHost(w.data());
    (*q)->QuantizeWeightGrad(fc, &g);
    std::vector<float> got(4);
    g.CopyToHost(got.data());
    EXPECT_EQ(got, want(k.fc_want)) << k.spec;
  }
}

// Block-scaled formats see activations and errors as rows of their last dimension and weights
// and weight gradients as [output channels, fan-in]: with rows of 20 features, a 1x16 block
// never spans two rows (a flat view of the span would put features of two samples in one).
TEST(SiteQuantizerBlockScales, TileActivationsByRowsAndWeightsByFanIn) {
  Linear fc("fc", 20, 3, true, 1);
  PrecisionConfig c;
  for (Site s : {Site::kWeight, Site::kActivation, Site::kError, Site::kWeightGrad}) {
    c.global[int(s)].spec = "nvfp4";
  }
  auto q = SiteQuantizer::Create(c, {&fc});
  ASSERT_TRUE(q.ok()) << q.status().message();
  auto reference = [](const std::vector<float>& x, size_t columns) {
    std::vector<float> out(x.size());
    QuantizeOptions o;
    o.columns = columns;
    EXPECT_TRUE(Quantize(*Format::Parse("nvfp4"), x.data(), out.data(), x.size(), o).ok());
    return out;
  };
  // Rows of very different magnitudes, so that mixing two rows in a block changes the result.
  std::vector<float> x(4 * 20);
  for (size_t i = 0; i < x.size(); ++i) x[i] = float((i % 7) + 1) * (i / 20 % 2 ? 1e-3f : 10.0f);
  ASSERT_NE(reference(x, 20), reference(x, 0));
  Tensor in({4, 20}), out({4, 20});
  in.CopyFromHost(x.data());
  std::vector<float> got(x.size());
  (*q)->QuantizeActivation(fc, in, &out);
  out.CopyToHost(got.data());
  EXPECT_EQ(got, reference(x, 20));
  (*q)->QuantizeError(fc, in, &out);
  out.CopyToHost(got.data());
  EXPECT_EQ(got, reference(x, 20));
  // W and G of fc: [3, 20], rows of the fan-in 20 (channels 3, columns 0).
  const std::vector<float> w(x.begin(), x.begin() + 60);
  EXPECT_EQ(QuantizeW(**q, fc, {3, 20}, w), reference(w, 20));
  Tensor g({3, 20});
  g.CopyFromHost(w.data());
  (*q)->QuantizeWeightGrad(fc, &g);
  std::vector<float> gw(60);
  g.CopyToHost(gw.data());
  EXPECT_EQ(gw, reference(w, 20));
}

// --wgrad-transform: a Linear's weight gradient from T x and T dy (T orthogonal) equals the plain
// one to float32 rounding when A and E are fp32; dx and the bias gradient are the plain ones, bit
// for bit; with A and E quantised the transform changes dW (the point of it), reproducibly by
// step; layers kept in fp32 are not transformed; a bad transform is refused.
TEST(SiteQuantizerWeightGradTransform, LinearsWeightGradientFromTransformedOperands) {
  const int64_t n = 48, in = 24, out = 10;  // 3 groups of 16 rows
  std::vector<float> x(size_t(n * in)), dy(size_t(n * out));
  std::mt19937 rng(4);
  std::normal_distribution<float> normal;
  for (float& v : x) v = normal(rng);
  for (float& v : dy) v = normal(rng);
  x[5] *= 300.0f;  // an outlier
  struct Grads {
    std::vector<float> dw, db, dx;
  };
  auto run = [&](const std::string& a_e, const std::string& transform, int64_t step, bool keep) {
    Linear fc("fc", in, out, true, 7);
    PrecisionConfig c;
    c.global[int(Site::kWeight)].spec = "bf16";  // some site quantised: the hooks are installed
    c.global[int(Site::kActivation)].spec = a_e;
    c.global[int(Site::kError)].spec = a_e;
    c.wgrad_transform = transform;
    if (keep) c.keep_fp32 = {"fc"};
    auto q = SiteQuantizer::Create(c, {&fc});
    EXPECT_TRUE(q.ok()) << q.status().message();
    (*q)->InstallHooks({&fc});
    (*q)->SetStep(step);
    Tensor xt({n, in}), dyt({n, out});
    xt.CopyFromHost(x.data());
    dyt.CopyFromHost(dy.data());
    for (Param* p : fc.Params()) p->grad.Fill(0.0f);
    fc.Forward(xt, true);
    const Tensor dx = fc.Backward(dyt);
    Grads g{std::vector<float>(size_t(out * in)), std::vector<float>(size_t(out)),
            std::vector<float>(size_t(n * in))};
    fc.weight().grad.CopyToHost(g.dw.data());
    fc.bias()->grad.CopyToHost(g.db.data());
    dx.CopyToHost(g.dx.data());
    return g;
  };
  const Grads plain = run("fp32", "", 1, false);
  for (const char* t : {"rht16", "had16"}) {
    const Grads tr = run("fp32", t, 1, false);
    EXPECT_EQ(tr.dx, plain.dx) << t;
    EXPECT_EQ(tr.db, plain.db) << t;
    double err = 0.0, norm = 0.0;
    for (size_t i = 0; i < plain.dw.size(); ++i) {
      err = std::max(err, double(std::fabs(tr.dw[i] - plain.dw[i])));
      norm = std::max(norm, double(std::fabs(plain.dw[i])));
    }
    EXPECT_LT(err / norm, 1e-5) << t;
    EXPECT_NE(tr.dw, plain.dw) << t << ": no transform was applied";
  }
  // Quantised operands: the transform changes dW; the same step repeats it, another step's signs
  // differ; a layer kept in fp32 is not transformed.
  const Grads q_plain = run("e4m3:block=1x16:scale=e4m3", "", 1, false);
  const Grads q_rht = run("e4m3:block=1x16:scale=e4m3", "rht16", 1, false);
  EXPECT_NE(q_rht.dw, q_plain.dw);
  EXPECT_EQ(q_rht.dw, run("e4m3:block=1x16:scale=e4m3", "rht16", 1, false).dw);
  EXPECT_NE(q_rht.dw, run("e4m3:block=1x16:scale=e4m3", "rht16", 2, false).dw);
  EXPECT_EQ(run("fp32", "rht16", 1, true).dw, run("fp32", "", 1, true).dw);

  Linear fc("fc", in, out, true, 7);
  PrecisionConfig bad;
  bad.wgrad_transform = "rht15";
  auto q = SiteQuantizer::Create(bad, {&fc});
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().message().find("--wgrad-transform"), std::string::npos);
}

// --accumulate: a quantised Linear's three products are kernels::AccumulatedGemm's on the
// operands the sites give (bit for bit); the bias gradient keeps its float32 sums; a layer in
// --keep-fp32 keeps float32 GEMMs; a bad spec is refused by name.
TEST(SiteQuantizerAccumulation, LinearProductsAccumulateAsEmulated) {
  const int64_t n = 37, in = 70, out = 9;
  std::vector<float> x(size_t(n * in)), dy(size_t(n * out));
  std::mt19937 rng(8);
  std::normal_distribution<float> normal;
  for (float& v : x) v = normal(rng);
  for (float& v : dy) v = normal(rng);
  struct Result {
    std::vector<float> y, dx, dw, db, w;
  };
  auto run = [&](const std::string& accumulate, bool keep) {
    Linear fc("fc", in, out, true, 7);
    PrecisionConfig c;
    // A site whose format changes no value here (no subnormal inputs): the hooks are installed,
    // and the products see the fp32 operands.
    c.global[int(Site::kWeight)].spec = "fp32:nosub";
    c.accumulate = accumulate;
    if (keep) c.keep_fp32 = {"fc"};
    auto q = SiteQuantizer::Create(c, {&fc});
    EXPECT_TRUE(q.ok()) << q.status().message();
    (*q)->InstallHooks({&fc});
    Tensor xt({n, in}), dyt({n, out});
    xt.CopyFromHost(x.data());
    dyt.CopyFromHost(dy.data());
    for (Param* p : fc.Params()) p->grad.Fill(0.0f);
    Result r{std::vector<float>(size_t(n * out)), std::vector<float>(size_t(n * in)),
             std::vector<float>(size_t(out * in)), std::vector<float>(size_t(out)),
             std::vector<float>(size_t(out * in))};
    fc.Forward(xt, true).CopyToHost(r.y.data());
    fc.Backward(dyt).CopyToHost(r.dx.data());
    fc.weight().grad.CopyToHost(r.dw.data());
    fc.bias()->grad.CopyToHost(r.db.data());
    fc.weight().value.CopyToHost(r.w.data());
    return r;
  };
  const std::string spec = "e8m6:every=16";
  const Result plain = run("", false), acc = run(spec, false);
  const kernels::Accumulation a = *ParseAccumulation(spec);
  std::vector<float> y(plain.y.size()), dx(plain.dx.size()), dw(plain.dw.size());
  kernels::AccumulatedGemm(false, true, n, out, in, x.data(), in, acc.w.data(), in, 0.f, y.data(),
                           out, a);
  std::vector<float> bias(static_cast<size_t>(out));
  {
    Linear fresh("fc", in, out, true, 7);
    fresh.bias()->value.CopyToHost(bias.data());
  }
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t o = 0; o < out; ++o) y[size_t(i * out + o)] += bias[size_t(o)];
  }
  kernels::AccumulatedGemm(true, false, out, in, n, dy.data(), out, x.data(), in, 0.f, dw.data(),
                           in, a);
  kernels::AccumulatedGemm(false, false, n, in, out, dy.data(), out, acc.w.data(), in, 0.f,
                           dx.data(), in, a);
  EXPECT_EQ(acc.y, y);
  EXPECT_EQ(acc.dw, dw);
  EXPECT_EQ(acc.dx, dx);
  EXPECT_EQ(acc.db, plain.db);
  EXPECT_NE(acc.y, plain.y) << "a 7-bit running sum left every output as float32's";
  const Result kept = run(spec, true);
  EXPECT_EQ(kept.y, plain.y);
  EXPECT_EQ(kept.dw, plain.dw);

  Linear fc("fc", in, out, true, 7);
  PrecisionConfig bad;
  bad.accumulate = "e8m13:every=0";
  auto q = SiteQuantizer::Create(bad, {&fc});
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().message().find("--accumulate"), std::string::npos);
}

// On the CPU a convolution's products accumulate too (on the im2col path): with a float32 grid
// the result is the convolution to float32 rounding, with a coarse one it is not, reproducibly.
TEST(SiteQuantizerAccumulation, ConvolutionProductsAccumulate) {
  const std::vector<int64_t> shape = {2, 3, 9, 9};
  std::vector<float> x(size_t(2 * 3 * 9 * 9)), dy(size_t(2 * 4 * 9 * 9));
  std::mt19937 rng(2);
  std::normal_distribution<float> normal;
  for (float& v : x) v = normal(rng);
  for (float& v : dy) v = normal(rng);
  auto run = [&](const std::string& accumulate) {
    Conv2d conv("conv", 3, 4, 3, 1, 1, true, 5);
    PrecisionConfig c;
    c.global[int(Site::kWeight)].spec = "fp32:nosub";
    c.accumulate = accumulate;
    auto q = SiteQuantizer::Create(c, {&conv});
    EXPECT_TRUE(q.ok()) << q.status().message();
    (*q)->InstallHooks({&conv});
    Tensor xt(shape), dyt({2, 4, 9, 9});
    xt.CopyFromHost(x.data());
    dyt.CopyFromHost(dy.data());
    for (Param* p : conv.Params()) p->grad.Fill(0.0f);
    std::vector<float> y(dy.size()), dx(x.size()), dw(4 * 3 * 3 * 3);
    conv.Forward(xt, true).CopyToHost(y.data());
    conv.Backward(dyt).CopyToHost(dx.data());
    conv.weight().grad.CopyToHost(dw.data());
    y.insert(y.end(), dx.begin(), dx.end());
    y.insert(y.end(), dw.begin(), dw.end());
    return y;
  };
  const std::vector<float> plain = run(""), exact = run("fp32"), coarse = run("e8m4:every=8");
  double err = 0.0, norm = 0.0;
  for (size_t i = 0; i < plain.size(); ++i) {
    err = std::max(err, double(std::fabs(exact[i] - plain[i])));
    norm = std::max(norm, double(std::fabs(plain[i])));
  }
  EXPECT_LT(err / norm, 1e-5);
  EXPECT_NE(coarse, plain);
  EXPECT_EQ(coarse, run("e8m4:every=8"));
}

// Products that cannot emulate the accumulation refuse it with one line naming the layer and
// the way out, rather than run float32 GEMMs under a flag that says otherwise.
TEST(SiteQuantizerAccumulation, LstmProductsRefuseIt) {
  InputProjection proj("proj", 6, 8, "proj.weight", "proj.bias");
  PrecisionConfig c;
  c.global[int(Site::kWeight)].spec = "bf16";
  c.accumulate = "e8m13:every=128";
  auto q = SiteQuantizer::Create(c, {&proj});
  ASSERT_TRUE(q.ok()) << q.status().message();
  (*q)->InstallHooks({&proj});
  Tensor xt({2, 3, 6});
  xt.Fill(0.5f);
  try {
    proj.Forward(xt, true);
    FAIL() << "an LSTM projection ran under --accumulate";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("proj"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--accumulate is not implemented"), std::string::npos)
        << e.what();
  }
}

// --keep-fp32's groups on the default GPT: embeddings (wte, wpe), attention (every block's qk
// and pv), tail=P% (the last P% of the Linear layers, rounded up: 17 Linear layers, 15% -> 3);
// a bad entry names what is accepted.
TEST(SiteQuantizerKeepFp32, GroupsOfAGpt) {
  LanguageModelShape shape;
  shape.vocab = 256;
  shape.block_size = 32;
  shape.n_layer = 4;
  shape.n_head = 4;
  shape.n_embd = 32;
  auto model = BuildLanguageModel("gpt", shape, 1);
  ASSERT_TRUE(model.ok()) << model.status().message();
  std::vector<Layer*> layers;
  for (Layer* l : (*model)->Flatten()) {
    if (l->Quantizable()) layers.push_back(l);
  }
  PrecisionConfig c;
  c.global[int(Site::kActivation)].spec = "e4m3";
  auto kept = [&](const std::string& entry) {
    c.keep_fp32 = {entry};
    auto q = SiteQuantizer::Create(c, layers);
    EXPECT_TRUE(q.ok()) << entry << ": " << q.status().message();
    std::vector<std::string> names;
    for (Layer* l : layers) {
      if ((*q)->SpecFor(l->name(), Site::kActivation) == "fp32") names.push_back(l->name());
    }
    return names;
  };
  EXPECT_EQ(kept("embeddings"), (std::vector<std::string>{"wte", "wpe"}));
  const std::vector<std::string> attention = kept("attention");
  ASSERT_EQ(attention.size(), 8u);
  EXPECT_EQ(attention[0], "h0.attn.qk");
  EXPECT_EQ(attention[7], "h3.attn.pv");
  EXPECT_EQ(kept("tail=15%"),
            (std::vector<std::string>{"h3.mlp.c_fc", "h3.mlp.c_proj", "lm_head"}));
  EXPECT_TRUE(kept("tail=0%").empty());
  EXPECT_EQ(kept("tail=100%").size(), 17u);
  for (const char* bad : {"tail=101%", "tail=x%", "tail=15", "attn"}) {
    c.keep_fp32 = {bad};
    auto q = SiteQuantizer::Create(c, layers);
    ASSERT_FALSE(q.ok()) << bad;
    EXPECT_NE(q.status().message().find("accepted: first, last, embeddings, attention"),
              std::string::npos)
        << q.status().message();
  }
}

// --allreduce-layer-format NAME=SPEC: the spec is checked here, the name by the trainer.
TEST(PrecisionConfig, AllReduceLayerFormatsParseAndRefuseBadInput) {
  PrecisionConfig c;
  ASSERT_TRUE(AddAllReduceLayerFormat("first=fp32", &c).ok());
  ASSERT_TRUE(AddAllReduceLayerFormat("layer1.0.bn1=e4m3:sat", &c).ok());
  ASSERT_EQ(c.allreduce_layers.size(), 2u);
  EXPECT_EQ(c.allreduce_layers[1].first, "layer1.0.bn1");
  for (const char* bad : {"first", "=fp32", "first=", "fc=e9m9"}) {
    const Status s = AddAllReduceLayerFormat(bad, &c);
    EXPECT_EQ(s.code(), Status::Code::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("--allreduce-layer-format"), std::string::npos) << s.message();
  }
  EXPECT_EQ(c.allreduce_layers.size(), 2u);
  EXPECT_NE(DescribePrecision(c).find("all-reduce first=fp32,layer1.0.bn1=e4m3"), std::string::npos)
      << DescribePrecision(c);
  // A config written before the field existed still reads (no allreduce_layers).
  PrecisionConfig plain;
  nlohmann::json j = nlohmann::json::parse(PrecisionConfigToJson(plain));
  EXPECT_FALSE(j.contains("allreduce_layers"));
  auto back = PrecisionConfigFromJson(j.dump());
  ASSERT_TRUE(back.ok());
  EXPECT_TRUE(back->allreduce_layers.empty());
  j["allreduce_layers"] = nlohmann::json::array({nlohmann::json::array({"fc", "e9m9"})});
  EXPECT_FALSE(PrecisionConfigFromJson(j.dump()).ok());
}

TEST(PrecisionConfigJson, RoundTripsEveryField) {
  PrecisionConfig c;
  c.global[int(Site::kWeight)] = {"log4", Rounding::kNearest};
  c.global[int(Site::kActivation)] = {"fp134", Rounding::kZero};
  c.global[int(Site::kError)] = {"e5m2", Rounding::kStochastic};
  c.overrides["conv1"][Site::kWeight] = "fp32";
  c.overrides["layer1.0.conv2"][Site::kWeightGrad] = "int8";
  c.keep_fp32 = {"first", "fc"};
  c.allreduce_layers = {{"first", "fp32"}, {"bn", "e5m2"}, {"first", "int8"}};
  c.cpt = CyclicPrecision{4, 6, 16, 3000};
  c.grad_bits = 7;
  c.hysteresis = true;
  c.wgrad_transform = "rht32";
  c.seed = 0xDEADBEEFCAFEull;
  auto back = PrecisionConfigFromJson(PrecisionConfigToJson(c));
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->wgrad_transform, "rht32");
  EXPECT_NE(DescribePrecision(c).find("weight-gradient rht32"), std::string::npos);
  for (int i = 0; i < kNumSites; ++i) {
    EXPECT_EQ(back->global[i].spec, c.global[i].spec) << i;
    EXPECT_EQ(back->global[i].rounding, c.global[i].rounding) << i;
  }
  EXPECT_EQ(back->overrides, c.overrides);
  EXPECT_EQ(back->keep_fp32, c.keep_fp32);
  EXPECT_EQ(back->allreduce_layers, c.allreduce_layers);  // in order, repeats kept
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
