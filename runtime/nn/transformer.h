// The pre-LayerNorm Transformer block of GPT-2 and a GPT stack built from it (nanoGPT's Block
// and GPT), on the layers of runtime/nn/embedding.h, normalization.h and attention.h. Contracts
// as in runtime/nn/layers.h, on the CPU or a GPU (MoveToDevice moves the whole model; the token
// ids then go to the GPU too).
//
// Names follow nanoGPT's, so that weights map one to one (its "transformer." prefix dropped):
// wte, wpe, drop, h<i>.ln_1, h<i>.attn.{c_attn, qk, attn_dropout, pv, c_proj, resid_dropout},
// h<i>.ln_2, h<i>.mlp.{c_fc, gelu, c_proj, dropout}, ln_f, lm_head. Quantisation sites: wte and
// wpe (W, G), every Linear (W, A, E, G: c_attn, c_proj, c_fc, lm_head), and the attention
// products h<i>.attn.qk and h<i>.attn.pv (A, E); see attention.h and
// docs/language-model-layers.md.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/nn/attention.h"
#include "runtime/nn/embedding.h"
#include "runtime/nn/layers.h"
#include "runtime/nn/normalization.h"

namespace cpd::runtime {

// y = h + mlp(ln_2(h)) with h = x + attn(ln_1(x)), for x [B, T, C]; mlp = c_fc (C -> 4C),
// GELU, c_proj (4C -> C), dropout. Children, in Flatten order (each subtree pre-order):
// NAME.ln_1, NAME.attn (CausalSelfAttention), NAME.ln_2, NAME.mlp (a Sequential of NAME.mlp.c_fc,
// NAME.mlp.gelu, NAME.mlp.c_proj, NAME.mlp.dropout). Initialisation: GPT-2's (c_fc std 0.02,
// c_proj 0.02 / sqrt(2 * options.layers), biases 0, LayerNorm 1 and 0), each child from
// LayerSeed(seed, its name).
class TransformerBlock : public ShapedLayer {
 public:
  TransformerBlock(std::string name, const TransformerOptions& options, uint64_t seed);

  const char* kind() const override { return "TransformerBlock"; }
  std::string Describe() const override;
  Tensor Forward(const Tensor& x, bool train) override;
  Tensor Backward(const Tensor& dy) override;
  std::vector<Param*> Params() override;
  void SetQuantHooks(QuantHooks* hooks) override;
  std::vector<Layer*> Flatten() override;
  void SetStep(uint64_t step) override;
  std::vector<int64_t> OutputShape(const std::vector<int64_t>& in) const override;
  std::vector<int64_t> TraceShapes(const std::vector<int64_t>& in,
                                   std::vector<LayerShapeRecord>* out) override;

  LayerNorm& ln_1() { return *ln_1_; }
  LayerNorm& ln_2() { return *ln_2_; }
  CausalSelfAttention& attn() { return *attn_; }
  Sequential& mlp() { return *mlp_; }

 private:
  std::vector<ShapedLayer*> Children() const;

  int64_t embed_;
  std::unique_ptr<LayerNorm> ln_1_, ln_2_;
  std::unique_ptr<CausalSelfAttention> attn_;
  std::unique_ptr<Sequential> mlp_;
  bool ready_ = false;
  Tensor h_, y_, dh_, dx_;
};

// A GPT language model's hyper-parameters (nanoGPT's GPTConfig).
struct GptOptions {
  int64_t vocab = 0;               // REQUIRED: >= 1
  int64_t block_size = 0;          // the longest sequence, REQUIRED: >= 1
  TransformerOptions transformer;  // embed, heads, layers (the number of blocks), dropout, bias
  bool tied_head = true;           // lm_head uses wte's table (as GPT-2 and nanoGPT), else its own
};

// wte, wpe, drop (the embedding dropout), h0 ... h<layers - 1>, ln_f, lm_head (no bias): a
// Sequential named "gpt" mapping token ids [B, T] (floats, see TokenEmbedding) to logits
// [B, T, vocab]; SoftmaxCrossEntropy on logits.Reshaped({B * T, vocab}) is the per-token loss.
// Throws std::invalid_argument on options that do not fit.
std::unique_ptr<Sequential> BuildGpt(const GptOptions& options, uint64_t seed);

}  // namespace cpd::runtime
