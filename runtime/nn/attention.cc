#include "runtime/nn/attention.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>
#include <tuple>

#include "runtime/engine/cpu_transformer.h"
#include "runtime/engine/cuda_transformer.h"
#include "runtime/nn/layers_internal.h"

namespace cpd::runtime {

using internal::ActivationSite;
using internal::ErrorSite;
using internal::FormatFloat;
using internal::Misfit;
using internal::RefuseAccumulation;
using internal::RequireDevice;
using internal::RequireReady;
using internal::RequireShape;
using internal::Where;

void InitGpt2Linear(Linear* layer, float std, uint64_t seed) {
  std::mt19937_64 gen(seed);
  FillNormal(&layer->weight().value, std, &gen);
  if (layer->bias() != nullptr) layer->bias()->value.Zero();
}

// ---- AttentionProduct -------------------------------------------------------------------------

AttentionProduct::AttentionProduct(std::string name, bool trans_b, float alpha)
    : Layer(std::move(name)), trans_b_(trans_b), alpha_(alpha) {}

std::string AttentionProduct::Describe() const {
  return std::string(trans_b_ ? "a b^T" : "a b") +
         (alpha_ == 1.f ? "" : " * " + FormatFloat(alpha_)) + ", per batch and head";
}

Tensor AttentionProduct::Forward(const Tensor&, bool) {
  throw std::logic_error(Where(*this) +
                         ": a product of two operands, driven by its parent through Multiply");
}

Tensor AttentionProduct::Backward(const Tensor&) {
  throw std::logic_error(Where(*this) +
                         ": a product of two operands, driven by its parent through "
                         "MultiplyBackward");
}

std::vector<int64_t> AttentionProduct::OutputShape(const std::vector<int64_t>& a,
                                                   const std::vector<int64_t>& b) const {
  const size_t r = a.size();
  bool fits = r >= 3 && b.size() == r && std::equal(a.begin(), a.end() - 2, b.begin());
  // a [.., m, k]; b [.., n, k] (trans_b) or [.., k, n].
  if (fits) fits = trans_b_ ? b[r - 1] == a[r - 1] : b[r - 2] == a[r - 1];
  if (!fits) {
    Misfit(*this, a,
           std::string("operands [..., m, k] and ") + (trans_b_ ? "[..., n, k]" : "[..., k, n]") +
               " with equal leading dimensions (b is " + ShapeString(b) + ")");
  }
  std::vector<int64_t> c(a.begin(), a.end() - 1);
  c.push_back(trans_b_ ? b[r - 2] : b[r - 1]);
  return c;
}

double AttentionProduct::Macs(const std::vector<int64_t>& a, const std::vector<int64_t>& b) const {
  return double(NumelOf(OutputShape(a, b))) * double(a.back());
}

Tensor AttentionProduct::Multiply(const Tensor& a, const Tensor& b, bool train) {
  const Device dev = a.device();
  RequireDevice(*this, b, "the second operand", dev);
  const std::vector<int64_t> c_shape = OutputShape(a.shape(), b.shape());
  const int64_t m = a.dim(-2), k = a.dim(-1), n = c_shape.back();
  const int64_t batch = int64_t(a.numel() / size_t(m * k));
  RefuseAccumulation(hooks_, *this, "attention products");
  const Tensor aq = ActivationSite(*this, hooks_, a, &a_q_);
  const Tensor bq = ActivationSite(*this, hooks_, b, &b_q_);
  ResizeOn(&c_, c_shape, dev);
  CPD_DISPATCH(dev,
               BatchedMatmul(batch, m, n, k, trans_b_, alpha_, aq.data(), bq.data(), c_.data()));
  ready_ = train;
  a_saved_ = train ? aq : Tensor();
  b_saved_ = train ? bq : Tensor();
  return c_;
}

std::pair<Tensor, Tensor> AttentionProduct::MultiplyBackward(const Tensor& dc) {
  RequireReady(*this, ready_);
  const Device dev = a_saved_.device();
  RequireShape(*this, dc, OutputShape(a_saved_.shape(), b_saved_.shape()), dev);
  const int64_t m = a_saved_.dim(-2), k = a_saved_.dim(-1), n = dc.dim(-1);
  const int64_t batch = int64_t(a_saved_.numel() / size_t(m * k));
  const Tensor g = ErrorSite(*this, hooks_, dc, &dc_q_);
  ResizeOn(&da_, a_saved_.shape(), dev);
  ResizeOn(&db_, b_saved_.shape(), dev);
  CPD_DISPATCH(dev, BatchedMatmulBackward(batch, m, n, k, trans_b_, alpha_, a_saved_.data(),
                                          b_saved_.data(), g.data(), da_.data(), db_.data()));
  return {da_, db_};
}

// ---- CausalSelfAttention ----------------------------------------------------------------------

namespace {

// The steps of attention between its products, on the CPU or the GPU (where `dev` says).
void SplitHeadsOn(Device dev, int64_t b, int64_t t, int64_t h, int64_t d, const Tensor& qkv,
                  Tensor* q, Tensor* k, Tensor* v) {
  CPD_DISPATCH(dev, SplitHeads(b, t, h, d, qkv.data(), q->data(), k->data(), v->data()));
}

void SplitHeadsBackwardOn(Device dev, int64_t b, int64_t t, int64_t h, int64_t d, const Tensor& dq,
                          const Tensor& dk, const Tensor& dv, Tensor* dqkv) {
  CPD_DISPATCH(dev, SplitHeadsBackward(b, t, h, d, dq.data(), dk.data(), dv.data(), dqkv->data()));
}

void MergeHeadsOn(Device dev, int64_t b, int64_t t, int64_t h, int64_t d, const Tensor& o,
                  Tensor* y) {
  CPD_DISPATCH(dev, MergeHeads(b, t, h, d, o.data(), y->data()));
}

void MergeHeadsBackwardOn(Device dev, int64_t b, int64_t t, int64_t h, int64_t d, const Tensor& dy,
                          Tensor* dout) {
  CPD_DISPATCH(dev, MergeHeadsBackward(b, t, h, d, dy.data(), dout->data()));
}

void CausalSoftmaxOn(Device dev, int64_t batch, int64_t t, const Tensor& s, Tensor* p) {
  CPD_DISPATCH(dev, CausalSoftmaxForward(batch, t, s.data(), p->data()));
}

void CausalSoftmaxBackwardOn(Device dev, int64_t batch, int64_t t, const Tensor& p,
                             const Tensor& dp, Tensor* ds) {
  CPD_DISPATCH(dev, CausalSoftmaxBackward(batch, t, p.data(), dp.data(), ds->data()));
}

// GPT-2's initial standard deviation of weights, and of the residual projections scaled by
// 1 / sqrt(2 n_layer) (two residual additions per block; Radford et al., "Language Models are
// Unsupervised Multitask Learners", 2019, section 2.3).
constexpr float kGpt2Std = 0.02f;

}  // namespace

CausalSelfAttention::CausalSelfAttention(std::string name, const TransformerOptions& o,
                                         uint64_t seed)
    : ShapedLayer(std::move(name)), embed_(o.embed), heads_(o.heads) {
  if (embed_ < 1 || heads_ < 1 || embed_ % heads_ != 0 || o.layers < 1) {
    throw std::invalid_argument(this->name() +
                                " (CausalSelfAttention): needs embed >= 1 divisible by heads >= 1 "
                                "and layers >= 1, got embed " +
                                std::to_string(embed_) + ", heads " + std::to_string(heads_) +
                                ", layers " + std::to_string(o.layers));
  }
  head_dim_ = embed_ / heads_;
  alpha_ = float(1.0 / std::sqrt(double(head_dim_)));
  const std::string& n = this->name();
  c_attn_ = std::make_unique<Linear>(n + ".c_attn", embed_, 3 * embed_, o.bias);
  InitGpt2Linear(c_attn_.get(), kGpt2Std, LayerSeed(seed, n + ".c_attn"));
  qk_ = std::make_unique<AttentionProduct>(n + ".qk", true, alpha_);
  attn_drop_ = std::make_unique<Dropout>(n + ".attn_dropout", o.dropout,
                                         LayerSeed(seed, n + ".attn_dropout"));
  pv_ = std::make_unique<AttentionProduct>(n + ".pv", false, 1.f);
  c_proj_ = std::make_unique<Linear>(n + ".c_proj", embed_, embed_, o.bias);
  InitGpt2Linear(c_proj_.get(), float(kGpt2Std / std::sqrt(2.0 * double(o.layers))),
                 LayerSeed(seed, n + ".c_proj"));
  resid_drop_ = std::make_unique<Dropout>(n + ".resid_dropout", o.dropout,
                                          LayerSeed(seed, n + ".resid_dropout"));
}

std::string CausalSelfAttention::Describe() const {
  return "CausalSelfAttention(embed " + std::to_string(embed_) + ", heads " +
         std::to_string(heads_) + ")";
}

std::vector<Layer*> CausalSelfAttention::Children() const {
  return {c_attn_.get(), qk_.get(), attn_drop_.get(), pv_.get(), c_proj_.get(), resid_drop_.get()};
}

std::vector<Param*> CausalSelfAttention::Params() {
  std::vector<Param*> out = c_attn_->Params();
  for (Param* p : c_proj_->Params()) out.push_back(p);
  return out;
}

void CausalSelfAttention::SetQuantHooks(QuantHooks* hooks) {
  hooks_ = hooks;
  for (Layer* c : Children()) c->SetQuantHooks(hooks);
}

std::vector<Layer*> CausalSelfAttention::Flatten() {
  std::vector<Layer*> out = {this};
  for (Layer* c : Children()) out.push_back(c);
  return out;
}

void CausalSelfAttention::SetStep(uint64_t step) {
  for (Layer* c : Children()) c->SetStep(step);
}

std::vector<int64_t> CausalSelfAttention::OutputShape(const std::vector<int64_t>& in) const {
  if (in.size() != 3 || in[2] != embed_)
    Misfit(*this, in, "[B, T, " + std::to_string(embed_) + "]");
  return in;
}

std::vector<int64_t> CausalSelfAttention::TraceShapes(const std::vector<int64_t>& in,
                                                      std::vector<LayerShapeRecord>* out) {
  OutputShape(in);
  const size_t self = out->size();
  out->push_back({this, in, in, 0});
  c_attn_->TraceShapes(in, out);
  const std::vector<int64_t> q = {in[0], heads_, in[1], head_dim_};
  const std::vector<int64_t> s = qk_->OutputShape(q, q);
  out->push_back({qk_.get(), q, s, qk_->Macs(q, q)});
  out->push_back({attn_drop_.get(), s, s, 0});
  out->push_back({pv_.get(), s, q, pv_->Macs(s, q)});
  c_proj_->TraceShapes(in, out);
  resid_drop_->TraceShapes(in, out);
  for (size_t i = self + 1; i < out->size(); ++i) (*out)[self].macs += (*out)[i].macs;
  return in;
}

Tensor CausalSelfAttention::Forward(const Tensor& x, bool train) {
  const Device dev = c_attn_->weight().value.device();
  RequireDevice(*this, x, "the input", dev);
  OutputShape(x.shape());
  const int64_t b = x.dim(0), t = x.dim(1), h = heads_, d = head_dim_;
  const Tensor qkv = c_attn_->Forward(x, train);
  for (Tensor* w : {&q_, &k_, &v_}) ResizeOn(w, {b, h, t, d}, dev);
  SplitHeadsOn(dev, b, t, h, d, qkv, &q_, &k_, &v_);
  const Tensor& o = Attend(train);
  ResizeOn(&merged_, x.shape(), dev);
  MergeHeadsOn(dev, b, t, h, d, o, &merged_);
  const Tensor y = resid_drop_->Forward(c_proj_->Forward(merged_, train), train);
  ready_ = train;
  b_ = b;
  t_ = t;
  return y;
}

const Tensor& CausalSelfAttention::Attend(bool train) {
  // The fused path is the CPU's; a GPU takes the materialised one.
  const Device dev = q_.device();
  fused_ = dev == Device::kCpu && !qk_->HasQuantHooks() && !pv_->HasQuantHooks();
  if (!fused_) {
    const Tensor s = qk_->Multiply(q_, k_, train);
    ResizeOn(&p_, s.shape(), dev);
    CausalSoftmaxOn(dev, q_.dim(0) * heads_, q_.dim(2), s, &p_);
    o_ = pv_->Multiply(attn_drop_->Forward(p_, train), v_, train);
    return o_;
  }
  const int64_t pairs = q_.dim(0) * heads_, t = q_.dim(2);
  ResizeOn(&o_, q_.shape(), Device::kCpu);
  for (Tensor* w : {&row_max_, &row_inv_}) ResizeOn(w, {pairs, t}, Device::kCpu);
  fused_dropout_ = {};
  if (train && attn_drop_->threshold() != 0) {
    fused_dropout_ = {attn_drop_->MaskKey(), attn_drop_->threshold(), attn_drop_->scale()};
  }
  cpu::FusedCausalAttentionForward(pairs, t, head_dim_, alpha_, q_.data(), k_.data(), v_.data(),
                                   fused_dropout_, o_.data(), row_max_.data(), row_inv_.data());
  p_ = Tensor();  // a materialised forward's probabilities are not needed any more
  return o_;
}

Tensor CausalSelfAttention::Backward(const Tensor& dy) {
  RequireReady(*this, ready_);
  const Device dev = q_.device();
  RequireShape(*this, dy, {b_, t_, embed_}, dev);
  const int64_t b = b_, t = t_, h = heads_, d = head_dim_;
  const Tensor dmerged = c_proj_->Backward(resid_drop_->Backward(dy));
  ResizeOn(&do_, {b, h, t, d}, dev);
  MergeHeadsBackwardOn(dev, b, t, h, d, dmerged, &do_);
  AttendBackward();
  ResizeOn(&dqkv_, {b, t, 3 * embed_}, dev);
  SplitHeadsBackwardOn(dev, b, t, h, d, dq_, dk_, dv_, &dqkv_);
  return c_attn_->Backward(dqkv_);
}

void CausalSelfAttention::AttendBackward() {
  if (!fused_) {
    const auto [dp_dropped, dv] = pv_->MultiplyBackward(do_);
    const Tensor dp = attn_drop_->Backward(dp_dropped);
    ResizeOn(&ds_, p_.shape(), p_.device());
    // The softmax's derivative is taken at the exact P; only the pv product sees P quantised.
    CausalSoftmaxBackwardOn(p_.device(), b_ * heads_, t_, p_, dp, &ds_);
    std::tie(dq_, dk_) = qk_->MultiplyBackward(ds_);
    dv_ = dv;
    return;
  }
  for (Tensor* w : {&dq_, &dk_, &dv_}) ResizeOn(w, q_.shape(), Device::kCpu);
  cpu::FusedCausalAttentionBackward(b_ * heads_, t_, head_dim_, alpha_, q_.data(), k_.data(),
                                    v_.data(), o_.data(), row_max_.data(), row_inv_.data(),
                                    fused_dropout_, do_.data(), dq_.data(), dk_.data(), dv_.data());
}

}  // namespace cpd::runtime
