// Writes the language-model layers' forward and backward on fixed inputs to a JSON file, for
// torch_reference_test.py to recompute in PyTorch from the same weights and inputs:
//
//   transformer_reference_dump OUT.json
//
// Cases: LayerNorm, GELU, CausalSelfAttention, TransformerBlock and a two-layer LSTM on x [B, T, C]
// with an output gradient dy (their output, dL/dx and every parameter gradient of
// L = sum(y * dy)), two two-block GPTs with the per-token cross-entropy (the loss and every
// parameter gradient): one at GPT-2's initialisation with a tied head, one untied at O(1) weights,
// and two two-layer LSTM language models likewise (tied at their initialisation, untied with O(1)
// token vectors). Dropout is 0.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "runtime/nn/recurrent.h"
#include "runtime/nn/transformer.h"

namespace cpd::runtime {
namespace {

using nlohmann::json;

json ToJson(const Tensor& t) {
  return {{"shape", t.shape()}, {"data", std::vector<float>(t.data(), t.data() + t.numel())}};
}

Tensor Normal(std::vector<int64_t> shape, float std, uint64_t seed) {
  Tensor t(std::move(shape));
  std::mt19937_64 g(seed);
  FillNormal(&t, std, &g);
  return t;
}

json ParamsJson(Layer& layer, bool grads) {
  json out = json::object();
  for (Param* p : layer.Params()) out[p->name] = ToJson(grads ? p->grad : p->value);
  return out;
}

// Non-trivial LayerNorm parameters and biases (they start at 1 and 0).
void PerturbVectors(Layer& layer, uint64_t seed) {
  std::mt19937_64 g(seed);
  for (Param* p : layer.Params()) {
    if (p->value.ndim() != 1) continue;
    Tensor d = p->value.Clone();
    FillNormal(&d, 0.1f, &g);
    for (size_t i = 0; i < d.numel(); ++i) p->value.data()[i] += d.data()[i];
  }
}

json LayerCase(const std::string& kind, Layer& layer, const json& config, const Tensor& x) {
  PerturbVectors(layer, 5);
  json c = {{"kind", kind}, {"config", config}, {"params", ParamsJson(layer, false)}};
  const Tensor y = layer.Forward(x, true).Clone();
  const Tensor dy = Normal(y.shape(), 1.f, 7);
  for (Param* p : layer.Params()) p->grad.Zero();
  const Tensor dx = layer.Backward(dy);
  c["x"] = ToJson(x);
  c["dy"] = ToJson(dy);
  c["y"] = ToJson(y);
  c["dx"] = ToJson(dx);
  c["grads"] = ParamsJson(layer, true);
  return c;
}

// A language model's case: the per-token cross-entropy of `model` on fixed ids and labels [3, t],
// its logits, loss and every parameter gradient, added to `c` (kind, config, params).
json LmCase(Sequential& model, json c, int64_t vocab, int64_t t) {
  const int64_t b = 3;
  Tensor ids({b, t});
  std::vector<int32_t> labels(size_t(b * t));
  std::mt19937_64 g(17);
  for (size_t i = 0; i < labels.size(); ++i) {
    ids.data()[i] = float(g() % uint64_t(vocab));
    labels[i] = int32_t(g() % uint64_t(vocab));
  }
  for (Param* p : model.Params()) p->grad.Zero();
  const Tensor logits = model.Forward(ids, true).Clone();
  SoftmaxCrossEntropy ce;
  Tensor dlogits;
  const float loss = ce.Forward(logits.Reshaped({b * t, vocab}), labels, &dlogits);
  model.Backward(dlogits.Reshaped(logits.shape()));
  c["ids"] = ToJson(ids);
  c["labels"] = labels;
  c["logits"] = ToJson(logits);
  c["loss"] = loss;
  c["grads"] = ParamsJson(model, true);
  return c;
}

json GptCase(const GptOptions& o, bool unit_scale) {
  auto gpt = BuildGpt(o, 3);
  if (unit_scale) {  // O(1) activations everywhere, as in transformer_layers_test.cc
    std::mt19937_64 g(11);
    for (Param* p : gpt->Params()) {
      const bool table = p->name == "wte.weight" || p->name == "wpe.weight";
      if (p->value.ndim() == 2) {
        FillNormal(&p->value, table ? 1.f : float(1 / std::sqrt(double(p->value.dim(1)))), &g);
      }
    }
    PerturbVectors(*gpt, 13);
  }
  json c = {{"kind", "gpt"},
            {"config",
             {{"vocab", o.vocab},
              {"block_size", o.block_size},
              {"embed", o.transformer.embed},
              {"heads", o.transformer.heads},
              {"layers", o.transformer.layers},
              {"tied", o.tied_head}}},
            {"params", ParamsJson(*gpt, false)}};
  return LmCase(*gpt, c, o.vocab, o.block_size);
}

json LstmLmCase(const LstmLmOptions& o, int64_t t, bool unit_scale) {
  auto lm = BuildLstm(o, 3);
  if (unit_scale) {  // O(1) token vectors: the gates leave their linear range
    std::mt19937_64 g(11);
    FillNormal(&lm->Params()[0]->value, 1.f, &g);
  }
  json c = {{"kind", "lstm_lm"},
            {"config",
             {{"vocab", o.vocab},
              {"input", o.embed},
              {"hidden", o.hidden == 0 ? o.embed : o.hidden},
              {"layers", o.layers},
              {"tied", o.tied_head}}},
            {"params", ParamsJson(*lm, false)}};
  return LmCase(*lm, c, o.vocab, t);
}

int Main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: transformer_reference_dump OUT.json\n";
    return 2;
  }
  TransformerOptions o;
  o.embed = 32;
  o.heads = 4;
  o.layers = 2;
  const json cfg = {{"embed", o.embed}, {"heads", o.heads}};
  const Tensor x = Normal({3, 16, o.embed}, 1.f, 1);
  json cases = json::array();
  LayerNorm ln("ln", o.embed);
  cases.push_back(LayerCase("layernorm", ln, cfg, x));
  GELU gelu("gelu");
  cases.push_back(LayerCase("gelu", gelu, cfg, Normal({3, 16, o.embed}, 2.f, 2)));
  CausalSelfAttention attn("attn", o, 1);
  cases.push_back(LayerCase("attention", attn, cfg, x));
  TransformerBlock block("h0", o, 2);
  cases.push_back(LayerCase("block", block, cfg, x));
  GptOptions g;
  g.vocab = 50;
  g.block_size = 16;
  g.transformer = o;
  cases.push_back(GptCase(g, false));
  g.tied_head = false;
  cases.push_back(GptCase(g, true));
  Lstm lstm("lstm", LstmOptions{.input = o.embed, .hidden = 24, .layers = 2}, 4);
  cases.push_back(LayerCase("lstm", lstm, {{"input", o.embed}, {"hidden", 24}, {"layers", 2}}, x));
  cases.push_back(LstmLmCase({.vocab = 50, .embed = 24, .layers = 2}, 16, false));
  cases.push_back(LstmLmCase(
      {.vocab = 50, .embed = 24, .hidden = 20, .layers = 2, .tied_head = false}, 16, true));
  std::ofstream out(argv[1]);
  out << json{{"cases", cases}}.dump();
  if (!out) {
    std::cerr << "transformer_reference_dump: cannot write " << argv[1] << "\n";
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace cpd::runtime

int main(int argc, char** argv) { return cpd::runtime::Main(argc, argv); }
