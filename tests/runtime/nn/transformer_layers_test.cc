// Tests of the Transformer layers (runtime/nn/embedding.h, normalization.h, attention.h,
// transformer.h) and of Linear on inputs of rank 3: forward passes against double-precision
// references, finite-difference checks of every input and parameter gradient (up to a two-block
// GPT with its per-token cross-entropy), the attention products as quantisation sites,
// initialisation and errors. PyTorch as a second reference: torch_reference_test.py.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpd/format.h"
#include "cpd/quantize.h"
#include "runtime/engine/cpu_ops.h"
#include "runtime/nn/quant_sites.h"
#include "runtime/nn/transformer.h"
#include "tests/runtime/nn/grad_check.h"

namespace cpd::runtime {
namespace {

using namespace gradcheck;  // NOLINT: the shared helpers of the layer tests

TransformerOptions Small(double dropout = 0) {
  TransformerOptions o;
  o.embed = 8;
  o.heads = 2;
  o.layers = 2;
  o.dropout = dropout;
  return o;
}

// Double-precision causal self-attention of x [b, t, c] with the layer's weights.
std::vector<double> NaiveAttention(CausalSelfAttention& attn, const Tensor& x, int64_t heads) {
  const int64_t b = x.dim(0), t = x.dim(1), c = x.dim(2), d = c / heads;
  const float* wa = attn.c_attn().weight().value.data();
  const float* ba = attn.c_attn().bias()->value.data();
  const float* wp = attn.c_proj().weight().value.data();
  const float* bp = attn.c_proj().bias()->value.data();
  std::vector<double> qkv(size_t(b * t * 3 * c)), o(size_t(b * t * c)), y(size_t(b * t * c));
  for (int64_t r = 0; r < b * t; ++r) {
    for (int64_t j = 0; j < 3 * c; ++j) {
      double s = ba[j];
      for (int64_t i = 0; i < c; ++i) s += double(wa[j * c + i]) * x.data()[r * c + i];
      qkv[size_t(r * 3 * c + j)] = s;
    }
  }
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t q = 0; q < t; ++q) {
        std::vector<double> p(size_t(q + 1));
        double mx = -1e300, sum = 0;
        for (int64_t k = 0; k <= q; ++k) {
          double s = 0;
          for (int64_t j = 0; j < d; ++j) {
            s += qkv[size_t((bi * t + q) * 3 * c + h * d + j)] *
                 qkv[size_t((bi * t + k) * 3 * c + c + h * d + j)];
          }
          p[size_t(k)] = s / std::sqrt(double(d));
          mx = std::max(mx, p[size_t(k)]);
        }
        for (double& v : p) sum += (v = std::exp(v - mx));
        for (int64_t j = 0; j < d; ++j) {
          double s = 0;
          for (int64_t k = 0; k <= q; ++k) {
            s += p[size_t(k)] / sum * qkv[size_t((bi * t + k) * 3 * c + 2 * c + h * d + j)];
          }
          o[size_t((bi * t + q) * c + h * d + j)] = s;
        }
      }
    }
  }
  for (int64_t r = 0; r < b * t; ++r) {
    for (int64_t j = 0; j < c; ++j) {
      double s = bp[j];
      for (int64_t i = 0; i < c; ++i) s += double(wp[j * c + i]) * o[size_t(r * c + i)];
      y[size_t(r * c + j)] = s;
    }
  }
  return y;
}

// ---- Linear on [B, T, C] and the normal draw ------------------------------------------------

TEST(LinearRank3, IsTheFlattenedMatrixProductBitForBit) {
  Linear fc("fc", 5, 3, true, 1);
  const Tensor x = Random({2, 4, 5}, 1);
  EXPECT_EQ(fc.OutputShape({2, 4, 5}), (std::vector<int64_t>{2, 4, 3}));
  EXPECT_EQ(fc.ForwardMacs({2, 4, 5}), 2.0 * 4 * 5 * 3);
  const Tensor y3 = fc.Forward(x, true).Clone();
  const Tensor dy = Random({2, 4, 3}, 2);
  fc.weight().grad.Zero();
  const Tensor dx3 = fc.Backward(dy).Clone();
  const Tensor dw3 = fc.weight().grad.Clone();
  const Tensor y2 = fc.Forward(x.Reshaped({8, 5}), true).Clone();
  fc.weight().grad.Zero();
  const Tensor dx2 = fc.Backward(dy.Reshaped({8, 3})).Clone();
  EXPECT_EQ(y3.shape(), (std::vector<int64_t>{2, 4, 3}));
  EXPECT_EQ(dx3.shape(), x.shape());
  EXPECT_TRUE(SameBits(y3, y2.Reshaped({2, 4, 3})));
  EXPECT_TRUE(SameBits(dx3, dx2.Reshaped({2, 4, 5})));
  EXPECT_TRUE(SameBits(dw3, fc.weight().grad));
  EXPECT_THROW(fc.Forward(Random({2, 4, 6}, 1), true), std::invalid_argument);
  EXPECT_THROW(fc.Forward(Random({5}, 1), true), std::invalid_argument);
  CheckGradients(fc, x);
}

TEST(FillNormal, BoxMullerOverTheUniformDrawIsDeterministic) {
  Tensor a({100001}), b({100001});
  std::mt19937_64 g1(7), g2(7);
  FillNormal(&a, 0.5f, &g1);
  FillNormal(&b, 0.5f, &g2);
  EXPECT_TRUE(SameBits(a, b));
  // The first pair by hand.
  std::mt19937_64 g(7);
  const double u1 = double((g() >> 40) + 1) * 0x1p-24, u2 = double(g() >> 40) * 0x1p-24;
  const double r = std::sqrt(-2 * std::log(u1));
  EXPECT_EQ(a.data()[0], float(r * std::cos(2 * M_PI * u2) * 0.5));
  EXPECT_EQ(a.data()[1], float(r * std::sin(2 * M_PI * u2) * 0.5));
  double s = 0, s2 = 0;
  for (size_t i = 0; i < a.numel(); ++i) {
    s += a.data()[i];
    s2 += double(a.data()[i]) * a.data()[i];
  }
  const double mean = s / double(a.numel()), sd = std::sqrt(s2 / double(a.numel()) - mean * mean);
  EXPECT_NEAR(mean, 0.0, 0.01);  // 5 standard errors (0.5 / sqrt(1e5) = 0.0016)
  EXPECT_NEAR(sd, 0.5, 0.01);
}

// ---- LayerNorm and GELU -----------------------------------------------------------------------

TEST(LayerNorm, ForwardMatchesDefinitionAndGradients) {
  LayerNorm ln("ln", 8);
  Tensor x = Random({2, 3, 8}, 1, -2, 3);
  for (int j = 0; j < 8; ++j) ln.gamma().value.data()[j] = 0.5f + 0.1f * float(j);
  for (int j = 0; j < 8; ++j) ln.beta().value.data()[j] = -0.2f + 0.05f * float(j);
  const Tensor y = ln.Forward(x, true);
  std::vector<double> want;
  for (int r = 0; r < 6; ++r) {
    double m = 0, v = 0;
    for (int j = 0; j < 8; ++j) m += x.data()[r * 8 + j] / 8.0;
    for (int j = 0; j < 8; ++j) v += (x.data()[r * 8 + j] - m) * (x.data()[r * 8 + j] - m) / 8.0;
    for (int j = 0; j < 8; ++j) {
      want.push_back((x.data()[r * 8 + j] - m) / std::sqrt(v + 1e-5) * ln.gamma().value.data()[j] +
                     ln.beta().value.data()[j]);
    }
  }
  ExpectClose(y, want, 1e-5, "layernorm");
  EXPECT_EQ(ln.Params()[0]->name, "ln.weight");
  EXPECT_EQ(ln.Params()[1]->name, "ln.bias");
  EXPECT_FALSE(ln.Params()[0]->weight_decay);
  CheckGradients(ln, x);
  EXPECT_THROW(ln.Forward(Random({2, 7}, 1), true), std::invalid_argument);
}

TEST(LayerNorm, GammaGradientDoesNotDependOnThreadCount) {
  LayerNorm ln("ln", 200);
  const Tensor x = Random({700, 200}, 3), dy = Random({700, 200}, 4);
  Tensor g[2];
  const int threads = omp_get_max_threads();
  for (int i = 0; i < 2; ++i) {
    omp_set_num_threads(i == 0 ? 1 : 3);
    ln.gamma().grad.Zero();
    ln.Forward(x, true);
    ln.Backward(dy);
    g[i] = ln.gamma().grad.Clone();
  }
  omp_set_num_threads(threads);
  EXPECT_TRUE(SameBits(g[0], g[1]));
}

TEST(GELU, ExactErfFormAndGradients) {
  GELU gelu("gelu");
  const Tensor x = Random({3, 5, 4}, 1, -4, 4);
  const Tensor y = gelu.Forward(x, true);
  std::vector<double> want;
  for (size_t i = 0; i < x.numel(); ++i) {
    const double v = x.data()[i];
    want.push_back(0.5 * v * (1 + std::erf(v / std::sqrt(2.0))));
  }
  ExpectClose(y, want, 1e-6, "gelu");
  // Not the tanh approximation: at x = 1 they differ by 1.6e-4.
  Tensor one({1});
  one.data()[0] = 1.f;
  EXPECT_NEAR(gelu.Forward(one, false).data()[0], 0.8413447, 1e-6);
  CheckGradients(gelu, x);
}

// ---- Embeddings -------------------------------------------------------------------------------

TEST(TokenEmbedding, GathersRowsAndScatterAddsGradients) {
  TokenEmbedding wte("wte", 11, 6, 3);
  Tensor ids({2, 3});
  const float v[6] = {4, 0, 4, 10, 4, 7};  // id 4 three times: its gradient rows add up
  std::copy(v, v + 6, ids.data());
  const Tensor y = wte.Forward(ids, true).Clone();
  ASSERT_EQ(y.shape(), (std::vector<int64_t>{2, 3, 6}));
  for (int i = 0; i < 6; ++i) {
    for (int j = 0; j < 6; ++j) {
      EXPECT_EQ(y.data()[i * 6 + j], wte.weight().value.data()[int(v[i]) * 6 + j]);
    }
  }
  CheckGradients(wte, ids, {.input = false});
}

TEST(TokenEmbedding, RejectsIdsThatAreNotIntegersInRange) {
  TokenEmbedding wte("wte", 11, 6, 3);
  for (float bad : {1.5f, -1.f, 11.f, 1e9f, NAN}) {
    Tensor ids({1, 2});
    ids.data()[1] = bad;
    try {
      wte.Forward(ids, true);
      ADD_FAILURE() << "id " << bad << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("wte (TokenEmbedding): token id"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("position 1"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(wte.Forward(Random({2}, 1), true), std::invalid_argument);
  EXPECT_THROW(TokenEmbedding("big", int64_t(1) << 24, 4), std::invalid_argument);
}

TEST(PositionEmbedding, AddsTheTableAndGradients) {
  PositionEmbedding wpe("wpe", 5, 4, 2);
  const Tensor x = Random({2, 3, 4}, 1);
  const Tensor y = wpe.Forward(x, true);
  for (int b = 0; b < 2; ++b) {
    for (int t = 0; t < 3; ++t) {
      for (int j = 0; j < 4; ++j) {
        const int i = (b * 3 + t) * 4 + j;
        EXPECT_EQ(y.data()[i], x.data()[i] + wpe.weight().value.data()[t * 4 + j]);
      }
    }
  }
  CheckGradients(wpe, x);
  EXPECT_THROW(wpe.Forward(Random({1, 6, 4}, 1), true), std::invalid_argument);  // T > block
}

// ---- Attention --------------------------------------------------------------------------------

TEST(CausalSelfAttention, ForwardMatchesNaiveAttentionAndIsCausal) {
  TransformerOptions o = Small();
  CausalSelfAttention attn("attn", o, 5);
  for (Param* p : attn.Params()) {  // non-zero biases, so that they are tested too
    if (p->name.find("bias") != std::string::npos) {
      std::mt19937_64 g(1);
      FillNormal(&p->value, 0.1f, &g);
    }
  }
  Tensor x = Random({2, 5, 8}, 1);
  const Tensor y = attn.Forward(x, false).Clone();
  ExpectClose(y, NaiveAttention(attn, x, 2), 1e-5, "attention");
  // Position 3 of sequence 0 changes: outputs before it do not.
  x.data()[3 * 8 + 2] += 1.f;
  const Tensor y2 = attn.Forward(x, false);
  EXPECT_EQ(0, std::memcmp(y.data(), y2.data(), 3 * 8 * sizeof(float)));
  EXPECT_NE(0, std::memcmp(y.data() + 24, y2.data() + 24, 8 * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(y.data() + 40, y2.data() + 40, 40 * sizeof(float)));  // sequence 1
}

TEST(CausalSelfAttention, Gradients) {
  CausalSelfAttention attn("attn", Small(), 5);
  CheckGradients(attn, Random({2, 5, 8}, 1));
}

TEST(CausalSelfAttention, GradientsWithDropout) {
  CausalSelfAttention attn("attn", Small(0.2), 5);
  attn.SetStep(3);  // the masks depend on (seed, step) only, so every forward draws the same
  CheckGradients(attn, Random({2, 4, 8}, 1));
}

TEST(CausalSelfAttention, NamesAndInitialisation) {
  TransformerOptions o = Small();
  o.embed = 64;
  o.heads = 4;
  o.layers = 8;
  CausalSelfAttention attn("h0.attn", o, 5);
  std::vector<std::string> names;
  for (Layer* l : attn.Flatten()) names.push_back(l->name());
  EXPECT_EQ(names, (std::vector<std::string>{"h0.attn", "h0.attn.c_attn", "h0.attn.qk",
                                             "h0.attn.attn_dropout", "h0.attn.pv", "h0.attn.c_proj",
                                             "h0.attn.resid_dropout"}));
  auto sd = [](const Tensor& t) {
    double s = 0;
    for (size_t i = 0; i < t.numel(); ++i) s += double(t.data()[i]) * t.data()[i];
    return std::sqrt(s / double(t.numel()));
  };
  EXPECT_NEAR(sd(attn.c_attn().weight().value), 0.02, 0.001);
  EXPECT_NEAR(sd(attn.c_proj().weight().value), 0.02 / 4, 0.0005);  // 1 / sqrt(2 * 8)
  EXPECT_EQ(sd(attn.c_attn().bias()->value), 0.0);
  CausalSelfAttention again("h0.attn", o, 5);
  EXPECT_TRUE(SameBits(again.c_proj().weight().value, attn.c_proj().weight().value));
  EXPECT_THROW(CausalSelfAttention("a", TransformerOptions{.embed = 10, .heads = 4}, 1),
               std::invalid_argument);
}

TEST(CausalSelfAttention, ResultsDoNotDependOnThreadCount) {
  CausalSelfAttention attn("attn", Small(), 5);
  const Tensor x = Random({3, 7, 8}, 1), dy = Random({3, 7, 8}, 2);
  Tensor y[2], dx[2], dw[2];
  const int threads = omp_get_max_threads();
  for (int i = 0; i < 2; ++i) {
    omp_set_num_threads(i == 0 ? 1 : 4);
    for (Param* p : attn.Params()) p->grad.Zero();
    y[i] = attn.Forward(x, true).Clone();
    dx[i] = attn.Backward(dy).Clone();
    dw[i] = attn.c_attn().weight().grad.Clone();
  }
  omp_set_num_threads(threads);
  EXPECT_TRUE(SameBits(y[0], y[1]));
  EXPECT_TRUE(SameBits(dx[0], dx[1]));
  EXPECT_TRUE(SameBits(dw[0], dw[1]));
}

// Hooks that use every tensor as it is: installed on NAME.qk and NAME.pv they make the layer
// take its materialised path without changing any value.
class IdentityHooks : public QuantHooks {
 public:
  void QuantizeWeight(const Layer&, const Tensor& w, Tensor* used) override { Copy(w, used); }
  void QuantizeActivation(const Layer&, const Tensor& x, Tensor* used) override { Copy(x, used); }
  void QuantizeError(const Layer&, const Tensor& dy, Tensor* used) override { Copy(dy, used); }
  void QuantizeWeightGrad(const Layer&, Tensor*) override {}

 private:
  static void Copy(const Tensor& from, Tensor* to) {
    std::memcpy(to->data(), from.data(), from.numel() * sizeof(float));
  }
};

// Forward output, input gradient and c_attn's weight gradient of one training step.
struct AttentionStep {
  Tensor y, dx, dw;
};

AttentionStep RunAttention(CausalSelfAttention& attn, const Tensor& x, const Tensor& dy) {
  for (Param* p : attn.Params()) p->grad.Zero();
  AttentionStep r;
  r.y = attn.Forward(x, true).Clone();
  r.dx = attn.Backward(dy).Clone();
  r.dw = attn.c_attn().weight().grad.Clone();
  return r;
}

double MaxRelDiff(const Tensor& a, const Tensor& b) {
  double worst = 0, scale = 0;
  for (size_t i = 0; i < a.numel(); ++i) scale = std::max(scale, double(std::abs(b.data()[i])));
  for (size_t i = 0; i < a.numel(); ++i) {
    worst = std::max(worst, std::abs(double(a.data()[i]) - b.data()[i]) / scale);
  }
  return worst;
}

// The fused path (no hooks on the products) against the materialised one (identity hooks),
// over several query blocks (T = 150 is two full blocks of 64 and a partial one) and with
// attention dropout: the same mask, the same function to float32 rounding.
TEST(CausalSelfAttention, FusedAndMaterialisedPathsAgree) {
  for (double dropout : {0.0, 0.3}) {
    TransformerOptions o = Small(dropout);
    o.embed = 16;
    CausalSelfAttention attn("attn", o, 5);
    attn.SetStep(7);
    const Tensor x = Random({2, 150, 16}, 1), dy = Random({2, 150, 16}, 2);
    const AttentionStep fused = RunAttention(attn, x, dy);
    IdentityHooks identity;
    attn.qk().SetQuantHooks(&identity);
    attn.pv().SetQuantHooks(&identity);
    const AttentionStep materialised = RunAttention(attn, x, dy);
    SCOPED_TRACE("dropout " + std::to_string(dropout));
    EXPECT_LT(MaxRelDiff(fused.y, materialised.y), 1e-5);
    EXPECT_LT(MaxRelDiff(fused.dx, materialised.dx), 1e-5);
    EXPECT_LT(MaxRelDiff(fused.dw, materialised.dw), 1e-5);
  }
}

// Finite differences through the fused path across a query-block boundary (T = 70).
TEST(CausalSelfAttention, FusedGradientsAcrossQueryBlocks) {
  CausalSelfAttention attn("attn", Small(), 5);
  CheckGradients(attn, Random({1, 70, 8}, 1));
}

TEST(CausalSelfAttention, FusedResultsDoNotDependOnThreadCount) {
  CausalSelfAttention attn("attn", Small(0.1), 5);
  const Tensor x = Random({3, 130, 8}, 1), dy = Random({3, 130, 8}, 2);
  AttentionStep r[2];
  const int threads = omp_get_max_threads();
  for (int i = 0; i < 2; ++i) {
    omp_set_num_threads(i == 0 ? 1 : 4);
    r[i] = RunAttention(attn, x, dy);
  }
  omp_set_num_threads(threads);
  EXPECT_TRUE(SameBits(r[0].y, r[1].y));
  EXPECT_TRUE(SameBits(r[0].dx, r[1].dx));
  EXPECT_TRUE(SameBits(r[0].dw, r[1].dw));
}

TEST(AttentionProduct, IsDrivenByItsParentOnly) {
  AttentionProduct qk("qk", true, 0.5f);
  EXPECT_TRUE(qk.Quantizable());
  EXPECT_TRUE(qk.Params().empty());
  EXPECT_THROW(qk.Forward(Random({2, 3, 4}, 1), true), std::logic_error);
  EXPECT_THROW(qk.Multiply(Random({2, 3, 4}, 1), Random({2, 3, 5}, 1), true),
               std::invalid_argument);
}

// ---- The block and the GPT stack --------------------------------------------------------------

TEST(TransformerBlock, ForwardIsItsDefinitionAndGradients) {
  TransformerBlock block("h0", Small(), 9);
  const Tensor x = Random({2, 4, 8}, 1);
  const Tensor y = block.Forward(x, true).Clone();
  // y = h + mlp(ln_2(h)), h = x + attn(ln_1(x)), from the children.
  Tensor h = block.attn().Forward(block.ln_1().Forward(x, false), false).Clone();
  for (size_t i = 0; i < h.numel(); ++i) h.data()[i] += x.data()[i];
  const Tensor m = block.mlp().Forward(block.ln_2().Forward(h, false), false);
  std::vector<double> want;
  for (size_t i = 0; i < h.numel(); ++i) want.push_back(double(h.data()[i]) + m.data()[i]);
  ExpectClose(y, want, 1e-6, "block");
  CheckGradients(block, x);
}

TEST(TransformerBlock, GradientsWithDropout) {
  TransformerBlock block("h0", Small(0.1), 9);
  block.SetStep(2);
  CheckGradients(block, Random({2, 4, 8}, 1));
}

GptOptions TinyGpt(bool tied) {
  GptOptions g;
  g.vocab = 13;
  g.block_size = 6;
  g.transformer = Small();
  g.tied_head = tied;
  return g;
}

TEST(Gpt, NamesFollowNanoGpt) {
  auto gpt = BuildGpt(TinyGpt(true), 1);
  std::vector<std::string> names;
  for (Layer* l : gpt->Flatten()) names.push_back(l->name());
  const std::vector<std::string> want = {"gpt",
                                         "wte",
                                         "wpe",
                                         "drop",
                                         "h0",
                                         "h0.ln_1",
                                         "h0.attn",
                                         "h0.attn.c_attn",
                                         "h0.attn.qk",
                                         "h0.attn.attn_dropout",
                                         "h0.attn.pv",
                                         "h0.attn.c_proj",
                                         "h0.attn.resid_dropout",
                                         "h0.ln_2",
                                         "h0.mlp",
                                         "h0.mlp.c_fc",
                                         "h0.mlp.gelu",
                                         "h0.mlp.c_proj",
                                         "h0.mlp.dropout"};
  ASSERT_GE(names.size(), want.size());
  EXPECT_EQ(std::vector<std::string>(names.begin(), names.begin() + long(want.size())), want);
  EXPECT_EQ(names[names.size() - 2], "ln_f");
  EXPECT_EQ(names.back(), "lm_head");
  // Tied: the table is listed once (by wte) and the head uses it.
  std::set<std::string> params;
  for (Param* p : gpt->Params()) EXPECT_TRUE(params.insert(p->name).second) << p->name;
  EXPECT_EQ(params.count("lm_head.weight"), 0u);
  auto* head = dynamic_cast<Linear*>(gpt->Flatten().back());
  ASSERT_NE(head, nullptr);
  EXPECT_TRUE(head->tied());
  EXPECT_EQ(&head->weight(), gpt->Params()[0]);
  // The shape trace runs through every layer; the products count their MACs.
  std::vector<LayerShapeRecord> trace;
  EXPECT_EQ(gpt->TraceShapes({3, 6}, &trace), (std::vector<int64_t>{3, 6, 13}));
  for (const auto& r : trace) {
    if (r.layer->name() == "h1.attn.qk") {
      EXPECT_EQ(r.output, (std::vector<int64_t>{3, 2, 6, 6}));
      EXPECT_EQ(r.macs, 3.0 * 2 * 6 * 6 * 4);
    }
  }
}

// The loss of the GPT on (ids, labels): the mean per-token cross-entropy.
void CheckGptGradients(bool tied) {
  SCOPED_TRACE(tied ? "tied head" : "untied head");
  auto gpt = BuildGpt(TinyGpt(tied), 4);
  // At GPT-2's initial scale (0.02) the attention and MLP branches are so small that their
  // parameters' gradients (~1e-5) drown in the rounding of the difference quotients: check the
  // gradients at a point of O(1) activations instead (weights 1 / sqrt(fan_in), tables 1,
  // biases 0.1), as a trained model has.
  std::mt19937_64 g(11);
  for (Param* p : gpt->Params()) {
    const bool table = p->name == "wte.weight" || p->name == "wpe.weight";
    if (p->value.ndim() == 2) {
      FillNormal(&p->value, table ? 1.f : float(1 / std::sqrt(double(p->value.dim(1)))), &g);
    } else if (p->name.ends_with(".bias")) {
      FillNormal(&p->value, 0.1f, &g);
    }
  }
  CheckLanguageModelGradients(*gpt, 13);
}

TEST(Gpt, TwoBlockStackWithCrossEntropyGradientsTiedHead) { CheckGptGradients(true); }
TEST(Gpt, TwoBlockStackWithCrossEntropyGradientsUntiedHead) { CheckGptGradients(false); }

// ---- The attention products as quantisation sites ---------------------------------------------

std::vector<Layer*> QuantisableLayers(Layer& model) {
  std::vector<Layer*> out;
  for (Layer* l : model.Flatten()) {
    if (l->Quantizable()) out.push_back(l);
  }
  return out;
}

Tensor QuantizedCopy(const Tensor& t, const std::string& spec) {
  auto f = Format::Parse(spec);
  EXPECT_TRUE(f.ok());
  Tensor q(t.shape());
  EXPECT_TRUE(Quantize(*f, t.data(), q.data(), t.numel()).ok());
  return q;
}

TEST(AttentionQuantisation, OverridesByNameResolve) {
  auto gpt = BuildGpt(TinyGpt(true), 1);
  const std::vector<Layer*> layers = QuantisableLayers(*gpt);
  std::vector<std::string> names;
  for (Layer* l : layers) names.push_back(l->name());
  // Embeddings, every Linear and both products of each block; the tied head too.
  EXPECT_EQ(names.front(), "wte");
  EXPECT_EQ(names.back(), "lm_head");
  EXPECT_EQ(names.size(), 2u + 2 * 6 + 1);
  PrecisionConfig pc;
  ASSERT_TRUE(AddLayerOverride("h0.attn.qk.A=e4m3", &pc).ok());
  ASSERT_TRUE(AddLayerOverride("h1.attn.pv.E=e5m2", &pc).ok());
  auto q = SiteQuantizer::Create(pc, layers);
  ASSERT_TRUE(q.ok()) << q.status().message();
  EXPECT_EQ((*q)->SpecFor("h0.attn.qk", Site::kActivation), "e4m3");
  EXPECT_EQ((*q)->SpecFor("h1.attn.pv", Site::kError), "e5m2");
  EXPECT_EQ((*q)->SpecFor("h0.attn.pv", Site::kActivation), "fp32");
  EXPECT_TRUE((*q)->Quantizes("h0.attn.qk"));
  EXPECT_FALSE((*q)->Quantizes("h0.attn.c_attn"));
  PrecisionConfig bad;
  ASSERT_TRUE(AddLayerOverride("h0.attn.qq.A=e4m3", &bad).ok());
  EXPECT_FALSE(SiteQuantizer::Create(bad, layers).ok());
}

TEST(AttentionQuantisation, QkQuantisesBothOperandsAndItsError) {
  AttentionProduct qk("h0.attn.qk", true, 0.5f);
  PrecisionConfig pc;
  ASSERT_TRUE(AddLayerOverride("h0.attn.qk.A=e4m3", &pc).ok());
  ASSERT_TRUE(AddLayerOverride("h0.attn.qk.E=e3m2", &pc).ok());
  auto q = SiteQuantizer::Create(pc, {&qk});
  ASSERT_TRUE(q.ok());
  (*q)->InstallHooks({&qk});
  const Tensor a = Random({1, 3, 4}, 1, -3, 3), b = Random({1, 3, 4}, 2, -3, 3);
  const Tensor c = qk.Multiply(a, b, true).Clone();
  const Tensor aq = QuantizedCopy(a, "e4m3"), bq = QuantizedCopy(b, "e4m3");
  std::vector<double> want, fp32;
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 3; ++j) {
      double s = 0, s32 = 0;
      for (int k = 0; k < 4; ++k) {
        s += double(aq.data()[i * 4 + k]) * bq.data()[j * 4 + k];
        s32 += double(a.data()[i * 4 + k]) * b.data()[j * 4 + k];
      }
      want.push_back(0.5 * s);
      fp32.push_back(0.5 * s32);
    }
  }
  ExpectClose(c, want, 1e-6, "S from quantised Q and K");
  double diff = 0;
  for (size_t i = 0; i < want.size(); ++i) diff = std::max(diff, std::abs(c.data()[i] - fp32[i]));
  EXPECT_GT(diff, 1e-3) << "e4m3 operands must change the product";
  // Backward: dQ = 0.5 * E(dS) Kq, dK = 0.5 * E(dS)^T Qq.
  const Tensor ds = Random({1, 3, 3}, 3, -2, 2);
  const auto [da, db] = qk.MultiplyBackward(ds);
  const Tensor e = QuantizedCopy(ds, "e3m2");
  std::vector<double> want_da, want_db;
  for (int i = 0; i < 3; ++i) {
    for (int k = 0; k < 4; ++k) {
      double sa = 0, sb = 0;
      for (int j = 0; j < 3; ++j) {
        sa += double(e.data()[i * 3 + j]) * bq.data()[j * 4 + k];
        sb += double(e.data()[j * 3 + i]) * aq.data()[j * 4 + k];
      }
      want_da.push_back(0.5 * sa);
      want_db.push_back(0.5 * sb);
    }
  }
  ExpectClose(da, want_da, 1e-6, "dQ");
  ExpectClose(db, want_db, 1e-6, "dK");
}

TEST(AttentionQuantisation, AnOverrideOnQkChangesTheModelOutputOnly) {
  auto gpt = BuildGpt(TinyGpt(true), 1);
  const Tensor ids = Ids(2, 5, 13, 1);
  const Tensor y32 = gpt->Forward(ids, false).Clone();
  PrecisionConfig pc;
  ASSERT_TRUE(AddLayerOverride("h0.attn.qk.A=e2m1", &pc).ok());
  const std::vector<Layer*> layers = QuantisableLayers(*gpt);
  auto q = SiteQuantizer::Create(pc, layers);
  ASSERT_TRUE(q.ok());
  (*q)->SetCollectStats(true);
  (*q)->InstallHooks(layers);
  const Tensor yq = gpt->Forward(ids, false).Clone();
  EXPECT_FALSE(SameBits(y32, yq));
  std::vector<SiteRecord> records = (*q)->TakeRecords();
  ASSERT_EQ(records.size(), 2u);  // Q, then K
  for (const SiteRecord& r : records) {
    EXPECT_EQ(r.layer, "h0.attn.qk");
    EXPECT_EQ(r.site, Site::kActivation);
  }
  for (Layer* l : layers) l->SetQuantHooks(nullptr);
  EXPECT_TRUE(SameBits(y32, gpt->Forward(ids, false)));
}

}  // namespace
}  // namespace cpd::runtime
