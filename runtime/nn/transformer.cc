#include "runtime/nn/transformer.h"

#include <cmath>
#include <stdexcept>

#include "runtime/engine/cpu_ops.h"
#include "runtime/nn/layers_internal.h"

namespace cpd::runtime {

using internal::Misfit;
using internal::RequireDevice;
using internal::RequireReady;
using internal::RequireShape;

namespace {

constexpr float kGpt2Std = 0.02f;  // GPT-2's initial weight scale (see attention.cc)

}  // namespace

// ---- TransformerBlock -------------------------------------------------------------------------

TransformerBlock::TransformerBlock(std::string name, const TransformerOptions& o, uint64_t seed)
    : ShapedLayer(std::move(name)), embed_(o.embed) {
  const std::string& n = this->name();
  ln_1_ = std::make_unique<LayerNorm>(n + ".ln_1", embed_);
  attn_ = std::make_unique<CausalSelfAttention>(n + ".attn", o, seed);
  ln_2_ = std::make_unique<LayerNorm>(n + ".ln_2", embed_);
  mlp_ = std::make_unique<Sequential>(n + ".mlp");
  const std::string m = n + ".mlp";
  auto* fc = mlp_->Emplace<Linear>(m + ".c_fc", embed_, 4 * embed_, o.bias);
  InitGpt2Linear(fc, kGpt2Std, LayerSeed(seed, m + ".c_fc"));
  mlp_->Emplace<GELU>(m + ".gelu");
  auto* proj = mlp_->Emplace<Linear>(m + ".c_proj", 4 * embed_, embed_, o.bias);
  InitGpt2Linear(proj, float(kGpt2Std / std::sqrt(2.0 * double(o.layers))),
                 LayerSeed(seed, m + ".c_proj"));
  mlp_->Emplace<Dropout>(m + ".dropout", o.dropout, LayerSeed(seed, m + ".dropout"));
}

std::string TransformerBlock::Describe() const {
  return "TransformerBlock(embed " + std::to_string(embed_) + ", pre-LayerNorm)";
}

std::vector<ShapedLayer*> TransformerBlock::Children() const {
  return {ln_1_.get(), attn_.get(), ln_2_.get(), mlp_.get()};
}

std::vector<Param*> TransformerBlock::Params() {
  std::vector<Param*> out;
  for (ShapedLayer* c : Children()) {
    for (Param* p : c->Params()) out.push_back(p);
  }
  return out;
}

void TransformerBlock::SetQuantHooks(QuantHooks* hooks) {
  hooks_ = hooks;
  for (ShapedLayer* c : Children()) c->SetQuantHooks(hooks);
}

std::vector<Layer*> TransformerBlock::Flatten() {
  std::vector<Layer*> out = {this};
  for (ShapedLayer* c : Children()) {
    for (Layer* l : c->Flatten()) out.push_back(l);
  }
  return out;
}

void TransformerBlock::SetStep(uint64_t step) {
  for (ShapedLayer* c : Children()) c->SetStep(step);
}

std::vector<int64_t> TransformerBlock::OutputShape(const std::vector<int64_t>& in) const {
  if (in.size() != 3 || in[2] != embed_)
    Misfit(*this, in, "[B, T, " + std::to_string(embed_) + "]");
  return in;
}

std::vector<int64_t> TransformerBlock::TraceShapes(const std::vector<int64_t>& in,
                                                   std::vector<LayerShapeRecord>* out) {
  OutputShape(in);
  const size_t self = out->size();
  out->push_back({this, in, in, 0});
  for (ShapedLayer* c : Children()) c->TraceShapes(in, out);
  for (size_t i = self + 1; i < out->size(); ++i) {
    if (out->at(i).layer->Quantizable()) (*out)[self].macs += (*out)[i].macs;
  }
  return in;
}

Tensor TransformerBlock::Forward(const Tensor& x, bool train) {
  const Device dev = ln_1_->gamma().value.device();
  RequireDevice(*this, x, "the input", dev);
  OutputShape(x.shape());
  const Tensor a = attn_->Forward(ln_1_->Forward(x, train), train);
  ResizeOn(&h_, x.shape(), dev);
  CPD_DISPATCH(dev, Add(x.numel(), x.data(), a.data(), h_.data()));
  const Tensor m = mlp_->Forward(ln_2_->Forward(h_, train), train);
  ResizeOn(&y_, x.shape(), dev);
  CPD_DISPATCH(dev, Add(x.numel(), h_.data(), m.data(), y_.data()));
  ready_ = train;
  return y_;
}

Tensor TransformerBlock::Backward(const Tensor& dy) {
  RequireReady(*this, ready_);
  const Device dev = y_.device();
  RequireShape(*this, dy, y_.shape(), dev);
  // Each residual join passes its gradient both ways: dh = dy + d(mlp branch), dx = dh +
  // d(attention branch).
  const Tensor dm = ln_2_->Backward(mlp_->Backward(dy));
  ResizeOn(&dh_, dy.shape(), dev);
  CPD_DISPATCH(dev, Add(dy.numel(), dy.data(), dm.data(), dh_.data()));
  const Tensor da = ln_1_->Backward(attn_->Backward(dh_));
  ResizeOn(&dx_, dy.shape(), dev);
  CPD_DISPATCH(dev, Add(dy.numel(), dh_.data(), da.data(), dx_.data()));
  return dx_;
}

// ---- BuildGpt ---------------------------------------------------------------------------------

std::unique_ptr<Sequential> BuildGpt(const GptOptions& o, uint64_t seed) {
  const TransformerOptions& t = o.transformer;
  if (o.vocab < 1 || o.block_size < 1 || t.layers < 1) {
    throw std::invalid_argument("gpt: needs vocab, block_size and layers >= 1, got " +
                                std::to_string(o.vocab) + ", " + std::to_string(o.block_size) +
                                ", " + std::to_string(t.layers));
  }
  auto m = std::make_unique<Sequential>("gpt");
  auto* wte = m->Emplace<TokenEmbedding>("wte", o.vocab, t.embed, LayerSeed(seed, "wte"));
  m->Emplace<PositionEmbedding>("wpe", o.block_size, t.embed, LayerSeed(seed, "wpe"));
  m->Emplace<Dropout>("drop", t.dropout, LayerSeed(seed, "drop"));
  for (int64_t i = 0; i < t.layers; ++i) {
    m->Emplace<TransformerBlock>("h" + std::to_string(i), t, seed);
  }
  m->Emplace<LayerNorm>("ln_f", t.embed);
  if (o.tied_head) {
    m->Emplace<Linear>("lm_head", &wte->weight());
  } else {
    auto* head = m->Emplace<Linear>("lm_head", t.embed, o.vocab, false);
    InitGpt2Linear(head, kGpt2Std, LayerSeed(seed, "lm_head"));
  }
  m->set_input_shape({o.block_size});
  return m;
}

}  // namespace cpd::runtime
