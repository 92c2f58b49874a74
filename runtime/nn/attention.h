// Causal multi-head self-attention (GPT-2; nanoGPT's CausalSelfAttention) and the attention
// products as quantisation sites. Contracts as in runtime/nn/layers.h (on the CPU, or on a GPU
// through runtime/engine/cuda_transformer.h: each layer computes where its parameters live, an
// AttentionProduct where its first operand lives, and refuses tensors on another device).
//
// Quantisation sites: besides its two Linear layers (NAME.c_attn, NAME.c_proj: W/A/E/G as every
// Linear), each of the two batched products of attention is a quantisable child layer of its
// own, so that the precision policy and per-layer overrides address it by name:
//   NAME.qk  S = Q K^T / sqrt(d)   A quantises both operands Q and K, E the gradient dL/dS;
//   NAME.pv  O = P V               A quantises both operands P (after attention dropout) and V,
//                                  E the gradient dL/dO.
// They have no weights, so no W and no G site; e.g. --layer-format h0.attn.qk.A=e4m3. Each
// operand is quantised by its own call of the A hook (its own per-tensor scale), and the
// backward uses the quantised operands, as Linear's does.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/engine/cpu_attention.h"
#include "runtime/nn/layers.h"

namespace cpd::runtime {

// The shape of a Transformer (GPT-2's hyper-parameters), shared by its layers.
struct TransformerOptions {
  int64_t embed = 0;   // C, the width of the residual stream; REQUIRED: heads divide it
  int64_t heads = 1;   // H; each head has d = C / H channels
  int64_t layers = 1;  // n_layer: the c_proj weights start with std 0.02 / sqrt(2 n_layer)
  double dropout = 0;  // attention, residual and MLP dropout probability, in [0, 1)
  bool bias = true;    // whether the Linear layers have biases (LayerNorm always has)
};

// GPT-2's initialisation of a Linear: weight ~ N(0, std^2) (FillNormal over
// std::mt19937_64(seed)), bias 0.
void InitGpt2Linear(Linear* layer, float std, uint64_t seed);

// One batched product of attention as a quantisation site: for each leading index (batch and
// head), c [m, n] = alpha * a [m, k] op(b), op(b) = b^T for b [n, k] (trans_b) or b [k, n]. It
// has two operands, so its parent drives it through Multiply and MultiplyBackward; the
// one-input Forward and Backward of Layer throw std::logic_error. Quantizable, with sites A
// (each operand, forward) and E (dc, backward) only.
class AttentionProduct : public Layer {
 public:
  AttentionProduct(std::string name, bool trans_b, float alpha);

  const char* kind() const override { return "AttentionProduct"; }
  std::string Describe() const override;
  Tensor Forward(const Tensor& x, bool train) override;
  Tensor Backward(const Tensor& dy) override;
  bool Quantizable() const override { return true; }

  // a [..., m, k], b [..., n, k] or [..., k, n] with the same leading dimensions; returns
  // c [..., m, n] (the layer's workspace). Keeps handles to the operands as used (quantised
  // copies with hooks) for the backward when train.
  Tensor Multiply(const Tensor& a, const Tensor& b, bool train);
  // dL/da and dL/db from dL/dc (workspaces of the layer).
  std::pair<Tensor, Tensor> MultiplyBackward(const Tensor& dc);
  // The output shape and the multiply-accumulates of a product of operands shaped a and b.
  std::vector<int64_t> OutputShape(const std::vector<int64_t>& a,
                                   const std::vector<int64_t>& b) const;
  double Macs(const std::vector<int64_t>& a, const std::vector<int64_t>& b) const;

 private:
  bool trans_b_;
  float alpha_;
  bool ready_ = false;
  Tensor a_saved_, b_saved_;
  Tensor a_q_, b_q_, dc_q_;
  Tensor c_, da_, db_;
};

// x [B, T, C] -> y [B, T, C]: qkv = c_attn(x) (C -> 3C), split into H heads of d = C / H;
// S = Q K^T / sqrt(d); P = softmax over the keys s <= t of each query t (the causal mask);
// P' = attn_dropout(P); O = P' V; merge the heads; y = resid_dropout(c_proj(O)) (C -> C).
// Children, in Flatten order: NAME.c_attn, NAME.qk, NAME.attn_dropout, NAME.pv, NAME.c_proj,
// NAME.resid_dropout (nanoGPT's names). Initialisation: GPT-2's (InitGpt2Linear, std 0.02; c_proj
// 0.02 / sqrt(2 * options.layers)), each child from LayerSeed(seed, its name).
//
// Two paths compute the same function:
//  * fused (runtime/engine/cpu_attention.h), on the CPU when neither NAME.qk nor NAME.pv has
//    quantisation hooks: the scores and probabilities are formed per block of queries and never
//    stored; the backward recomputes them. Memory O(threads * 64 * T) floats beyond Q, K, V and O.
//  * materialised, when either product is a quantisation site, and on a GPU (which has no fused
//    path yet): S and P (and their gradients) are stored, O(B H T^2) floats, because a per-tensor
//    quantiser (CPT's min/max range, a scaled format's per-tensor scale) needs all of P before it
//    can round any of it.
// Both use the same dropout mask; their results agree to float32 rounding (cpu_attention.h).
class CausalSelfAttention : public ShapedLayer {
 public:
  CausalSelfAttention(std::string name, const TransformerOptions& options, uint64_t seed);

  const char* kind() const override { return "CausalSelfAttention"; }
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

  Linear& c_attn() { return *c_attn_; }
  Linear& c_proj() { return *c_proj_; }
  AttentionProduct& qk() { return *qk_; }
  AttentionProduct& pv() { return *pv_; }

 private:
  std::vector<Layer*> Children() const;
  // Q, K, V -> O [B, H, T, D] and back, on either path (the class comment).
  const Tensor& Attend(bool train);
  void AttendBackward();

  int64_t embed_, heads_, head_dim_;
  float alpha_;  // 1 / sqrt(head_dim_), the scale of the scores
  std::unique_ptr<Linear> c_attn_, c_proj_;
  std::unique_ptr<AttentionProduct> qk_, pv_;
  std::unique_ptr<Dropout> attn_drop_, resid_drop_;
  bool ready_ = false;
  bool fused_ = false;                   // the last training forward took the fused path
  cpu::AttentionDropout fused_dropout_;  // and the dropout mask it drew
  int64_t b_ = 0, t_ = 0;                // the last training forward's batch and sequence length
  Tensor q_, k_, v_, p_, o_, row_max_, row_inv_, merged_;
  Tensor ds_, do_, dq_, dk_, dv_, dqkv_;
};

}  // namespace cpd::runtime
