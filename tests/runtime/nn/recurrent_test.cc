// Tests of the LSTM (runtime/nn/recurrent.h): the forward pass against a double-precision
// reference of nn.LSTM's equations, finite-difference checks of the input and every parameter
// gradient (one and two layers, with and without dropout between them, and the language model
// with its per-token cross-entropy, tied and untied), the recurrent product as a quantisation
// site against a hand computation, override names, thread-count independence, names,
// initialisation and errors. PyTorch as a second reference: torch_reference_test.py.
#include "runtime/nn/recurrent.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpd/format.h"
#include "cpd/quantize.h"
#include "runtime/engine/cpu_ops.h"
#include "runtime/nn/models.h"
#include "runtime/nn/quant_sites.h"
#include "tests/runtime/nn/grad_check.h"

namespace cpd::runtime {
namespace {

using namespace gradcheck;  // NOLINT: the shared helpers of the layer tests

double MaxAbsDiff(const Tensor& a, const Tensor& b) {
  double d = 0;
  for (size_t i = 0; i < a.numel(); ++i) {
    d = std::max(d, std::abs(double(a.data()[i]) - double(b.data()[i])));
  }
  return d;
}

Tensor QuantizedCopy(const Tensor& t, const std::string& spec) {
  auto f = Format::Parse(spec);
  EXPECT_TRUE(f.ok());
  Tensor q(t.shape());
  EXPECT_TRUE(Quantize(*f, t.data(), q.data(), t.numel()).ok());
  return q;
}

// A float vector quantised to `spec` ("" or "fp32": unchanged), as the sites do.
std::vector<float> QuantizedVector(std::vector<float> v, const std::string& spec) {
  if (spec.empty() || spec == "fp32") return v;
  Tensor t({int64_t(v.size())});
  std::copy(v.begin(), v.end(), t.data());
  const Tensor q = QuantizedCopy(t, spec);
  return std::vector<float>(q.data(), q.data() + q.numel());
}

LstmOptions Small(int64_t layers, double dropout = 0) {
  return LstmOptions{.input = 5, .hidden = 4, .layers = layers, .dropout = dropout};
}

// nn.LSTM's equations in double for x [b, t, c], from the layer's weights. The operands of the
// recurrent product of layer 0 can be quantised as the sites would (w_spec for W_hh, a_spec for
// each h_{t-1}, rounded to float first); other layers in fp32.
std::vector<double> NaiveLstm(Lstm& lstm, const Tensor& x, const std::string& w_spec = "",
                              const std::string& a_spec = "") {
  const int64_t b = x.dim(0), t = x.dim(1), hd = lstm.options().hidden;
  std::vector<double> in(x.data(), x.data() + x.numel());
  int64_t c = x.dim(2);
  auto sigmoid = [](double z) { return 1 / (1 + std::exp(-z)); };
  for (int64_t k = 0; k < lstm.options().layers; ++k) {
    const float* wi = lstm.ih(k).weight().value.data();
    const float* bi = lstm.ih(k).bias().value.data();
    const Tensor& whh = lstm.hh(k).weight().value;
    const std::vector<float> wh = QuantizedVector(
        std::vector<float>(whh.data(), whh.data() + whh.numel()), k == 0 ? w_spec : "");
    const float* bh = lstm.hh(k).bias().value.data();
    std::vector<double> out(size_t(b * t * hd));
    for (int64_t n = 0; n < b; ++n) {
      std::vector<double> h(size_t(hd), 0.0), cell(size_t(hd), 0.0);
      for (int64_t s = 0; s < t; ++s) {
        std::vector<float> hf(h.begin(), h.end());
        hf = QuantizedVector(hf, k == 0 ? a_spec : "");
        std::vector<double> z(size_t(4 * hd));
        for (int64_t r = 0; r < 4 * hd; ++r) {
          double sum = double(bi[r]) + double(bh[r]);
          for (int64_t i = 0; i < c; ++i)
            sum += double(wi[r * c + i]) * in[size_t((n * t + s) * c + i)];
          for (int64_t i = 0; i < hd; ++i)
            sum += double(wh[size_t(r * hd + i)]) * double(hf[size_t(i)]);
          z[size_t(r)] = sum;
        }
        for (int64_t j = 0; j < hd; ++j) {
          const double ig = sigmoid(z[size_t(j)]), fg = sigmoid(z[size_t(hd + j)]);
          const double gg = std::tanh(z[size_t(2 * hd + j)]), og = sigmoid(z[size_t(3 * hd + j)]);
          cell[size_t(j)] = fg * cell[size_t(j)] + ig * gg;
          h[size_t(j)] = og * std::tanh(cell[size_t(j)]);
          out[size_t((n * t + s) * hd + j)] = h[size_t(j)];
        }
      }
    }
    in = out;
    c = hd;
  }
  return in;
}

// ---- Forward, gradients, names -----------------------------------------------------------------

TEST(Lstm, ForwardMatchesTheEquationsInDouble) {
  for (int64_t layers : {1, 2, 3}) {
    SCOPED_TRACE(layers);
    Lstm lstm("lstm", Small(layers), 7);
    const Tensor x = Random({3, 6, 5}, 1, -2, 2);
    const Tensor y = lstm.Forward(x, false).Clone();
    ASSERT_EQ(y.shape(), (std::vector<int64_t>{3, 6, 4}));
    ExpectClose(y, NaiveLstm(lstm, x), 1e-6, "lstm");
    // Training mode without dropout computes the same, bit for bit.
    EXPECT_TRUE(SameBits(y, lstm.Forward(x, true)));
  }
}

TEST(Lstm, SequencesAreIndependentAndCausal) {
  Lstm lstm("lstm", Small(2), 7);
  Tensor x = Random({2, 5, 5}, 1);
  const Tensor y = lstm.Forward(x, false).Clone();
  x.data()[(0 * 5 + 3) * 5 + 1] += 1.f;  // sequence 0, timestep 3
  const Tensor y2 = lstm.Forward(x, false);
  EXPECT_EQ(0, std::memcmp(y.data(), y2.data(), 3 * 4 * sizeof(float)));  // steps 0..2
  EXPECT_NE(0, std::memcmp(y.data() + 12, y2.data() + 12, 4 * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(y.data() + 20, y2.data() + 20, 20 * sizeof(float)));  // sequence 1
}

TEST(Lstm, GradientsOneLayer) {
  Lstm lstm("lstm", Small(1), 3);
  CheckGradients(lstm, Random({2, 5, 5}, 1, -2, 2));
}

TEST(Lstm, GradientsTwoLayers) {
  Lstm lstm("lstm", Small(2), 3);
  CheckGradients(lstm, Random({3, 4, 5}, 2, -2, 2));
}

TEST(Lstm, GradientsTwoLayersWithDropout) {
  Lstm lstm("lstm", Small(2, 0.3), 3);
  lstm.SetStep(5);  // the masks depend on (seed, step) only, so every forward draws the same
  const Tensor x = Random({3, 4, 5}, 2, -2, 2);
  // The dropout is active: the output differs from evaluation's.
  const Tensor y_eval = lstm.Forward(x, false).Clone();
  EXPECT_FALSE(SameBits(y_eval, lstm.Forward(x, true)));
  CheckGradients(lstm, x);
}

TEST(Lstm, GradientsAccumulate) {
  Lstm lstm("lstm", Small(2), 3);
  const Tensor x = Random({2, 3, 5}, 1), dy = Random({2, 3, 4}, 2);
  for (Param* p : lstm.Params()) p->grad.Zero();
  lstm.Forward(x, true);
  lstm.Backward(dy);
  std::vector<Tensor> once;
  for (Param* p : lstm.Params()) once.push_back(p->grad.Clone());
  lstm.Backward(dy);
  size_t i = 0;
  for (Param* p : lstm.Params()) {
    for (size_t j = 0; j < p->grad.numel(); ++j) {
      ASSERT_EQ(p->grad.data()[j], 2 * once[i].data()[j]) << p->name;
    }
    ++i;
  }
}

TEST(Lstm, NamesFollowPyTorch) {
  Lstm lstm("lstm", Small(2, 0.1), 3);
  std::vector<std::string> layers, params;
  for (Layer* l : lstm.Flatten()) layers.push_back(l->name());
  EXPECT_EQ(layers, (std::vector<std::string>{"lstm", "lstm.l0.ih", "lstm.l0.hh", "lstm.l0.dropout",
                                              "lstm.l1.ih", "lstm.l1.hh"}));
  std::vector<std::vector<int64_t>> shapes;
  for (Param* p : lstm.Params()) {
    params.push_back(p->name);
    shapes.push_back(p->value.shape());
  }
  EXPECT_EQ(params,
            (std::vector<std::string>{"lstm.weight_ih_l0", "lstm.weight_hh_l0", "lstm.bias_ih_l0",
                                      "lstm.bias_hh_l0", "lstm.weight_ih_l1", "lstm.weight_hh_l1",
                                      "lstm.bias_ih_l1", "lstm.bias_hh_l1"}));
  EXPECT_EQ(shapes, (std::vector<std::vector<int64_t>>{
                        {16, 5}, {16, 4}, {16}, {16}, {16, 4}, {16, 4}, {16}, {16}}));
  EXPECT_TRUE(lstm.ih(0).Quantizable());
  EXPECT_TRUE(lstm.hh(1).Quantizable());
  EXPECT_FALSE(lstm.Quantizable());
  // The shape trace: ih over every timestep, hh per step, both as products of B T rows.
  std::vector<LayerShapeRecord> trace;
  EXPECT_EQ(lstm.TraceShapes({2, 3, 5}, &trace), (std::vector<int64_t>{2, 3, 4}));
  ASSERT_EQ(trace.size(), layers.size());
  EXPECT_EQ(trace[1].macs, 2.0 * 3 * 5 * 16);
  EXPECT_EQ(trace[2].macs, 2.0 * 3 * 4 * 16);
  EXPECT_EQ(trace[2].output, (std::vector<int64_t>{2, 3, 16}));
  EXPECT_EQ(trace[0].macs, 2.0 * 3 * (5 * 16 + 4 * 16 + 4 * 16 + 4 * 16));
}

TEST(Lstm, InitialisationIsPyTorchsUniformAndDeterministic) {
  LstmOptions o{.input = 30, .hidden = 64, .layers = 2};
  Lstm lstm("lstm", o, 9), again("lstm", o, 9), other("lstm", o, 10);
  const double bound = 1 / 8.0;
  for (size_t i = 0; i < lstm.Params().size(); ++i) {
    const Tensor& v = lstm.Params()[i]->value;
    double lo = 1, hi = -1, s2 = 0;
    for (size_t j = 0; j < v.numel(); ++j) {
      lo = std::min(lo, double(v.data()[j]));
      hi = std::max(hi, double(v.data()[j]));
      s2 += double(v.data()[j]) * v.data()[j];
    }
    EXPECT_GE(lo, -bound);
    EXPECT_LT(hi, bound);
    // Uniform on [-a, a] has variance a^2 / 3; the smallest tensor has 256 values.
    EXPECT_NEAR(std::sqrt(s2 / double(v.numel())), bound / std::sqrt(3.0), 0.2 * bound);
    EXPECT_TRUE(SameBits(v, again.Params()[i]->value));
    EXPECT_FALSE(SameBits(v, other.Params()[i]->value));
  }
  // The first value of weight_ih_l0 is the first uniform draw of its child's seed.
  std::mt19937_64 g(LayerSeed(9, "lstm.l0.ih"));
  const double u = double(g() >> 40) * 0x1p-24;
  EXPECT_EQ(lstm.ih(0).weight().value.data()[0], float((2 * u - 1) * double(float(bound))));
}

TEST(Lstm, ErrorsNameTheLayer) {
  EXPECT_THROW(Lstm("l", LstmOptions{.input = 0, .hidden = 4}, 1), std::invalid_argument);
  EXPECT_THROW(Lstm("l", LstmOptions{.input = 3, .hidden = 4, .layers = 0}, 1),
               std::invalid_argument);
  EXPECT_THROW(Lstm("l", LstmOptions{.input = 3, .hidden = 4, .dropout = 1}, 1),
               std::invalid_argument);
  Lstm lstm("lstm", Small(1), 1);
  try {
    lstm.Forward(Random({2, 3, 6}, 1), true);
    ADD_FAILURE() << "a misfit was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("lstm (LSTM)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(lstm.Forward(Random({2, 0, 5}, 1), true), std::invalid_argument);
  lstm.Forward(Random({2, 3, 5}, 1), false);
  EXPECT_THROW(lstm.Backward(Random({2, 3, 4}, 1)), std::logic_error);
  lstm.Forward(Random({2, 3, 5}, 1), true);
  EXPECT_THROW(lstm.Backward(Random({2, 4, 4}, 1)), std::invalid_argument);
  EXPECT_THROW(lstm.hh(0).Forward(Random({2, 4}, 1), true), std::logic_error);
  EXPECT_THROW(lstm.hh(0).Backward(Random({2, 16}, 1)), std::logic_error);
}

TEST(Lstm, ResultsDoNotDependOnThreadCount) {
  // Large enough that every pass runs in parallel: the per-step products (B 4H H >= 2^22 MACs),
  // the gates (B 4H >= 2^17 elements), the input projection and the bias sums.
  Lstm lstm("lstm", LstmOptions{.input = 48, .hidden = 256, .layers = 2}, 5);
  const Tensor x = Random({128, 3, 48}, 1), dy = Random({128, 3, 256}, 2);
  Tensor y[2], dx[2];
  std::vector<Tensor> grads[2];
  const int threads = omp_get_max_threads();
  for (int i = 0; i < 2; ++i) {
    omp_set_num_threads(i == 0 ? 1 : 2);
    for (Param* p : lstm.Params()) p->grad.Zero();
    y[i] = lstm.Forward(x, true).Clone();
    dx[i] = lstm.Backward(dy).Clone();
    for (Param* p : lstm.Params()) grads[i].push_back(p->grad.Clone());
  }
  omp_set_num_threads(threads);
  EXPECT_TRUE(SameBits(y[0], y[1]));
  EXPECT_TRUE(SameBits(dx[0], dx[1]));
  for (size_t i = 0; i < grads[0].size(); ++i) {
    EXPECT_TRUE(SameBits(grads[0][i], grads[1][i])) << lstm.Params()[i]->name;
  }
}

// ---- The language model -----------------------------------------------------------------------

LstmLmOptions TinyLm(bool tied) {
  return LstmLmOptions{
      .vocab = 11, .embed = 6, .hidden = tied ? 0 : 5, .layers = 2, .tied_head = tied};
}

TEST(LstmLm, NamesShapesAndTiedHead) {
  LstmLmOptions o = TinyLm(true);
  o.block_size = 7;
  auto lm = BuildLstm(o, 1);
  std::vector<std::string> names;
  for (Layer* l : lm->Flatten()) names.push_back(l->name());
  EXPECT_EQ(names, (std::vector<std::string>{"lstm_lm", "wte", "drop", "lstm", "lstm.l0.ih",
                                             "lstm.l0.hh", "lstm.l0.dropout", "lstm.l1.ih",
                                             "lstm.l1.hh", "lstm_drop", "lm_head"}));
  EXPECT_EQ(lm->input_shape(), (std::vector<int64_t>{7}));
  std::set<std::string> params;
  for (Param* p : lm->Params()) EXPECT_TRUE(params.insert(p->name).second) << p->name;
  EXPECT_EQ(params.count("lm_head.weight"), 0u);
  auto* head = dynamic_cast<Linear*>(lm->Flatten().back());
  ASSERT_NE(head, nullptr);
  EXPECT_TRUE(head->tied());
  EXPECT_EQ(&head->weight(), lm->Params()[0]);
  const Tensor logits = lm->Forward(Ids(3, 4, 11, 1), false);
  EXPECT_EQ(logits.shape(), (std::vector<int64_t>{3, 4, 11}));
  std::vector<LayerShapeRecord> trace;
  EXPECT_EQ(lm->TraceShapes({3, 4}, &trace), (std::vector<int64_t>{3, 4, 11}));
  // --print-model's table traces the model for one sequence of block_size tokens.
  const std::string table = DescribeModel(*lm);
  EXPECT_NE(table.find("lstm.l0.hh"), std::string::npos) << table;
  EXPECT_NE(table.find("[1, 7, 24]"), std::string::npos) << table;
  EXPECT_EQ(table.find("unavailable"), std::string::npos) << table;
  const auto macs = LayerMacs(*lm, {3, 4});
  ASSERT_EQ(macs.size(), 6u);  // wte, two products per layer, lm_head
  EXPECT_EQ(macs[2].first, "lstm.l0.hh");
  EXPECT_EQ(macs[2].second, 3.0 * 4 * 6 * 24);
  // Untied: the head has its own weight [vocab, hidden]; tied with hidden != embed is refused.
  auto untied = BuildLstm(TinyLm(false), 1);
  EXPECT_EQ(untied->Params().back()->name, "lm_head.weight");
  EXPECT_EQ(untied->Params().back()->value.shape(), (std::vector<int64_t>{11, 5}));
  LstmLmOptions bad = TinyLm(false);
  bad.tied_head = true;
  EXPECT_THROW(BuildLstm(bad, 1), std::invalid_argument);
  // The medium PTB shape builds: 2 x 650 over 10000 words, tied.
  auto medium = BuildLstm({.vocab = 10000, .embed = 650, .layers = 2, .dropout = 0.5}, 1);
  EXPECT_EQ(CountParams(*medium), 10000 * 650 + 2 * (4 * 650 * (650 + 650) + 2 * 4 * 650));
}

void CheckLmGradients(bool tied, double dropout) {
  SCOPED_TRACE(std::string(tied ? "tied head" : "untied head") + ", dropout " +
               std::to_string(dropout));
  LstmLmOptions o = TinyLm(tied);
  o.dropout = dropout;
  auto lm = BuildLstm(o, 4);
  lm->SetStep(3);
  // O(1) tables, so that the head's logits and their gradients are not tiny.
  std::mt19937_64 g(11);
  FillNormal(&lm->Params()[0]->value, 1.f, &g);
  CheckLanguageModelGradients(*lm, 11);
}

TEST(LstmLm, CrossEntropyGradientsTiedHead) { CheckLmGradients(true, 0); }
TEST(LstmLm, CrossEntropyGradientsUntiedHead) { CheckLmGradients(false, 0); }
TEST(LstmLm, CrossEntropyGradientsWithDropout) { CheckLmGradients(true, 0.25); }

// ---- The products as quantisation sites -------------------------------------------------------

std::vector<Layer*> QuantisableLayers(Layer& model) {
  std::vector<Layer*> out;
  for (Layer* l : model.Flatten()) {
    if (l->Quantizable()) out.push_back(l);
  }
  return out;
}

TEST(LstmQuantisation, OverridesByNameResolve) {
  auto lm = BuildLstm(TinyLm(true), 1);
  const std::vector<Layer*> layers = QuantisableLayers(*lm);
  std::vector<std::string> names;
  for (Layer* l : layers) names.push_back(l->name());
  EXPECT_EQ(names, (std::vector<std::string>{"wte", "lstm.l0.ih", "lstm.l0.hh", "lstm.l1.ih",
                                             "lstm.l1.hh", "lm_head"}));
  PrecisionConfig pc;
  ASSERT_TRUE(AddLayerOverride("lstm.l0.hh.W=e4m3", &pc).ok());
  ASSERT_TRUE(AddLayerOverride("lstm.l1.ih.E=e5m2", &pc).ok());
  pc.keep_fp32 = {"lstm.l1.hh"};
  auto q = SiteQuantizer::Create(pc, layers);
  ASSERT_TRUE(q.ok()) << q.status().message();
  EXPECT_EQ((*q)->SpecFor("lstm.l0.hh", Site::kWeight), "e4m3");
  EXPECT_EQ((*q)->SpecFor("lstm.l1.ih", Site::kError), "e5m2");
  EXPECT_EQ((*q)->SpecFor("lstm.l0.ih", Site::kWeight), "fp32");
  EXPECT_TRUE((*q)->Quantizes("lstm.l0.hh"));
  EXPECT_FALSE((*q)->Quantizes("lstm.l0.ih"));
  for (const char* bad : {"lstm.l0.hx.W=e4m3", "lstm.l2.hh.W=e4m3", "lstm.W=e4m3"}) {
    PrecisionConfig b;
    ASSERT_TRUE(AddLayerOverride(bad, &b).ok());
    EXPECT_FALSE(SiteQuantizer::Create(b, layers).ok()) << bad;
  }
}

// A quantiser for `layer` with the overrides `specs` ("NAME.SITE=SPEC"), installed on `layers`.
std::unique_ptr<SiteQuantizer> Quantiser(const std::vector<std::string>& specs,
                                         const std::vector<Layer*>& layers) {
  PrecisionConfig pc;
  for (const std::string& s : specs) EXPECT_TRUE(AddLayerOverride(s, &pc).ok()) << s;
  auto q = SiteQuantizer::Create(pc, layers);
  EXPECT_TRUE(q.ok());
  (*q)->InstallHooks(layers);
  return std::move(q).value();
}

TEST(LstmQuantisation, RecurrentWeightsAsUsedAreQuantised) {
  Lstm lstm("lstm", Small(2), 3);
  const Tensor x = Random({2, 5, 5}, 1, -2, 2);
  const Tensor y32 = lstm.Forward(x, false).Clone();
  auto q = Quantiser({"lstm.l0.hh.W=e4m3"}, QuantisableLayers(lstm));
  (*q).SetCollectStats(true);
  const Tensor yq = lstm.Forward(x, false).Clone();
  EXPECT_GT(MaxAbsDiff(y32, yq), 1e-4) << "e4m3 recurrent weights must change the output";
  // The same as the equations with W_hh of layer 0 rounded to e4m3 (and nothing else).
  ExpectClose(yq, NaiveLstm(lstm, x, "e4m3"), 1e-6, "quantised W_hh");
  // And bit for bit the same as an unhooked layer whose master W_hh is the quantised one.
  Lstm copy("lstm", Small(2), 3);
  copy.hh(0).weight().value.CopyFrom(QuantizedCopy(lstm.hh(0).weight().value, "e4m3"));
  EXPECT_TRUE(SameBits(yq, copy.Forward(x, false)));
  // One W site per forward, on lstm.l0.hh only; the master weights stay as they were.
  const std::vector<SiteRecord> records = q->TakeRecords();
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0].layer, "lstm.l0.hh");
  EXPECT_EQ(records[0].site, Site::kWeight);
  EXPECT_FALSE(SameBits(copy.hh(0).weight().value, lstm.hh(0).weight().value));
  lstm.SetQuantHooks(nullptr);
  EXPECT_TRUE(SameBits(y32, lstm.Forward(x, false)));
}

TEST(LstmQuantisation, RecurrentActivationsArePerStep) {
  Lstm lstm("lstm", Small(1), 3);
  const Tensor x = Random({2, 4, 5}, 1, -2, 2);
  auto q = Quantiser({"lstm.l0.hh.A=e3m2"}, QuantisableLayers(lstm));
  q->SetCollectStats(true);
  const Tensor yq = lstm.Forward(x, false).Clone();
  ExpectClose(yq, NaiveLstm(lstm, x, "", "e3m2"), 1e-6, "quantised h_{t-1}");
  const std::vector<SiteRecord> records = q->TakeRecords();
  ASSERT_EQ(records.size(), 4u);  // one per timestep
  for (const SiteRecord& r : records) {
    EXPECT_EQ(r.layer, "lstm.l0.hh");
    EXPECT_EQ(r.site, Site::kActivation);
  }
}

// The recurrent product on its own, every site quantised, against a hand computation: forward
// gh_t = Qa(h_{t-1}) Qw(W)^T + b, backward dh_{t-1} = Qe(dz_t) Qw(W),
// dW = Qg(sum_t Qe(dz_t)^T Qa(h_{t-1})), db = sum_t Qe(dz_t).
TEST(LstmQuantisation, RecurrentProductSitesByHand) {
  const int64_t t = 3, b = 2, h = 2;
  RecurrentProduct hh("lstm.l0.hh", h, "w", "b");
  std::mt19937_64 g(3);
  FillNormal(&hh.weight().value, 1.f, &g);
  FillNormal(&hh.bias().value, 1.f, &g);
  auto q = Quantiser(
      {"lstm.l0.hh.W=e4m3", "lstm.l0.hh.A=e3m2", "lstm.l0.hh.E=e2m3", "lstm.l0.hh.G=e5m2"}, {&hh});
  const Tensor hs = Random({t, b, h}, 1, -2, 2), dz = Random({t, b, 4 * h}, 2, -2, 2);
  const Tensor wq = QuantizedCopy(hh.weight().value, "e4m3");
  const Tensor aq = QuantizedCopy(hs, "e3m2"), eq = QuantizedCopy(dz, "e2m3");
  const float* bias = hh.bias().value.data();
  hh.ForwardBegin(hs, true);
  for (int64_t s = 0; s < t; ++s) {
    const Tensor gh = hh.ForwardStep(s);
    std::vector<double> want;
    for (int64_t r = 0; r < b; ++r) {
      for (int64_t o = 0; o < 4 * h; ++o) {
        double sum = bias[o];
        for (int64_t i = 0; i < h; ++i) {
          sum += double(aq.data()[(s * b + r) * h + i]) * wq.data()[o * h + i];
        }
        want.push_back(sum);
      }
    }
    ExpectClose(gh, want, 1e-6, "gh_" + std::to_string(s));
  }
  hh.weight().grad.Zero();
  hh.bias().grad.Zero();
  hh.BackwardBegin(dz);
  for (int64_t s = t - 1; s >= 0; --s) {
    const Tensor dh = hh.BackwardStep(s, s > 0);
    if (s == 0) {
      EXPECT_TRUE(dh.empty());
      continue;
    }
    std::vector<double> want;
    for (int64_t r = 0; r < b; ++r) {
      for (int64_t i = 0; i < h; ++i) {
        double sum = 0;
        for (int64_t o = 0; o < 4 * h; ++o) {
          sum += double(eq.data()[(s * b + r) * 4 * h + o]) * wq.data()[o * h + i];
        }
        want.push_back(sum);
      }
    }
    ExpectClose(dh, want, 1e-6, "dh_" + std::to_string(s - 1));
  }
  hh.BackwardEnd();
  Tensor dw({4 * h, h});
  std::vector<double> want_db(size_t(4 * h), 0.0);
  for (int64_t o = 0; o < 4 * h; ++o) {
    for (int64_t i = 0; i < h; ++i) {
      double sum = 0;
      for (int64_t r = 0; r < t * b; ++r)
        sum += double(eq.data()[r * 4 * h + o]) * aq.data()[r * h + i];
      dw.data()[o * h + i] = float(sum);
    }
    for (int64_t r = 0; r < t * b; ++r) want_db[size_t(o)] += eq.data()[r * 4 * h + o];
  }
  // G rounds to e5m2 (2 mantissa bits): the float sums may round differently only at a tie.
  const Tensor dwq = QuantizedCopy(dw, "e5m2");
  ExpectClose(hh.weight().grad, std::vector<double>(dwq.data(), dwq.data() + dwq.numel()), 1e-6,
              "dW_hh");
  ExpectClose(hh.bias().grad, want_db, 1e-6, "db_hh");
}

// The input projection with every site quantised, against a hand computation over all rows:
// z = Qa(x) Qw(W)^T + b, dx = Qe(dz) Qw(W), dW = Qg(Qe(dz)^T Qa(x)), db = sum Qe(dz).
TEST(LstmQuantisation, InputProjectionSitesByHand) {
  const int64_t rows = 6, in = 3, out = 4;
  InputProjection ih("lstm.l0.ih", in, out, "w", "b");
  std::mt19937_64 g(5);
  FillNormal(&ih.weight().value, 1.f, &g);
  FillNormal(&ih.bias().value, 1.f, &g);
  auto q = Quantiser(
      {"lstm.l0.ih.W=e4m3", "lstm.l0.ih.A=e3m2", "lstm.l0.ih.E=e2m3", "lstm.l0.ih.G=e5m2"}, {&ih});
  const Tensor x = Random({3, 2, in}, 1, -2, 2), dz = Random({3, 2, out}, 2, -2, 2);
  const Tensor wq = QuantizedCopy(ih.weight().value, "e4m3");
  const Tensor xq = QuantizedCopy(x, "e3m2"), eq = QuantizedCopy(dz, "e2m3");
  const Tensor z = ih.Forward(x, true);
  EXPECT_EQ(z.shape(), (std::vector<int64_t>{3, 2, out}));
  std::vector<double> want_z, want_dx;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double sum = ih.bias().value.data()[o];
      for (int64_t i = 0; i < in; ++i) sum += double(xq.data()[r * in + i]) * wq.data()[o * in + i];
      want_z.push_back(sum);
    }
    for (int64_t i = 0; i < in; ++i) {
      double sum = 0;
      for (int64_t o = 0; o < out; ++o)
        sum += double(eq.data()[r * out + o]) * wq.data()[o * in + i];
      want_dx.push_back(sum);
    }
  }
  ExpectClose(z, want_z, 1e-6, "z");
  ih.weight().grad.Zero();
  ih.bias().grad.Zero();
  ExpectClose(ih.Backward(dz), want_dx, 1e-6, "dx");
  Tensor dw({out, in});
  std::vector<double> want_db(size_t(out), 0.0);
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) {
      double sum = 0;
      for (int64_t r = 0; r < rows; ++r)
        sum += double(eq.data()[r * out + o]) * xq.data()[r * in + i];
      dw.data()[o * in + i] = float(sum);
    }
    for (int64_t r = 0; r < rows; ++r) want_db[size_t(o)] += eq.data()[r * out + o];
  }
  const Tensor dwq = QuantizedCopy(dw, "e5m2");
  ExpectClose(ih.weight().grad, std::vector<double>(dwq.data(), dwq.data() + dwq.numel()), 1e-6,
              "dW_ih");
  ExpectClose(ih.bias().grad, want_db, 1e-6, "db_ih");
}

TEST(LstmQuantisation, ErrorSiteOfTheRecurrenceChangesTheInputGradient) {
  Lstm lstm("lstm", Small(1), 3);
  const Tensor x = Random({2, 4, 5}, 1, -2, 2), dy = Random({2, 4, 4}, 2);
  lstm.Forward(x, true);
  const Tensor dx32 = lstm.Backward(dy).Clone();
  auto q = Quantiser({"lstm.l0.hh.E=e2m1"}, QuantisableLayers(lstm));
  q->SetCollectStats(true);
  lstm.Forward(x, true);
  const Tensor dxq = lstm.Backward(dy).Clone();
  EXPECT_GT(MaxAbsDiff(dx32, dxq), 1e-4);
  const std::vector<SiteRecord> records = q->TakeRecords();
  ASSERT_EQ(records.size(), 4u);  // one E per timestep, in the backward
  for (const SiteRecord& r : records) EXPECT_EQ(r.site, Site::kError);
}

}  // namespace
}  // namespace cpd::runtime
