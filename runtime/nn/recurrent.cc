#include "runtime/nn/recurrent.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>

#include "runtime/engine/cpu_ops.h"
#include "runtime/engine/cpu_recurrent.h"
#include "runtime/engine/cuda_recurrent.h"
#include "runtime/nn/embedding.h"
#include "runtime/nn/layers_internal.h"

namespace cpd::runtime {

using internal::ActivationSite;
using internal::ErrorSite;
using internal::FormatFloat;
using internal::ForwardSites;
using internal::MakeParam;
using internal::Misfit;
using internal::RefuseAccumulation;
using internal::RequireDevice;
using internal::RequireReady;
using internal::RequireShape;
using internal::WeightGradSite;
using internal::WeightSite;
using internal::Where;

namespace {

// A per-step site's copy belongs in `slot`, a view of the sequence buffer that the weight
// gradient's product reads. The site writes into the workspace it is given (slot); should a hook
// hand back other storage, its values are copied there.
Tensor KeepInSlot(const Tensor& used, Tensor* slot) {
  if (used.data() != slot->data()) slot->CopyFrom(used);
  return *slot;
}

}  // namespace

// ---- InputProjection --------------------------------------------------------------------------

InputProjection::InputProjection(std::string name, int64_t in, int64_t out,
                                 const std::string& weight_name, const std::string& bias_name)
    : ShapedLayer(std::move(name)), in_(in), out_(out) {
  if (in < 1 || out < 1) {
    throw std::invalid_argument(this->name() + " (InputProjection): in and out must be >= 1, got " +
                                std::to_string(in) + " and " + std::to_string(out));
  }
  weight_ = MakeParam(weight_name, {out, in}, true);
  bias_ = MakeParam(bias_name, {out}, false);
}

std::string InputProjection::Describe() const {
  return "InputProjection(x W_ih^T + b_ih, " + std::to_string(in_) + " -> " + std::to_string(out_) +
         ", all timesteps)";
}

std::vector<int64_t> InputProjection::OutputShape(const std::vector<int64_t>& in) const {
  if (in.size() < 2 || in.back() != in_) {
    Misfit(*this, in, "[..., " + std::to_string(in_) + "]");
  }
  std::vector<int64_t> out = in;
  out.back() = out_;
  return out;
}

double InputProjection::ForwardMacs(const std::vector<int64_t>& in) const {
  return double(NumelOf(in) / size_t(in_)) * double(in_) * double(out_);
}

Tensor InputProjection::Forward(const Tensor& x, bool train) {
  const Device dev = weight_.value.device();
  RequireDevice(*this, x, "the input", dev);
  const std::vector<int64_t> out_shape = OutputShape(x.shape());
  RefuseAccumulation(hooks_, *this, "the LSTM's products");
  const auto [xin, w] = ForwardSites(*this, hooks_, x, weight_.value, &x_q_, &w_q_);
  const int64_t rows = int64_t(x.numel() / size_t(in_));
  ResizeOn(&y_, out_shape, dev);
  float* y = y_.data();
  CPD_DISPATCH(dev, BroadcastRows(rows, out_, bias_.value.data(), y));
  CPD_DISPATCH(dev, ColumnBlockedSgemm(false, true, rows, out_, in_, 1.f, xin.data(), in_, w.data(),
                                       in_, 1.f, y, out_));
  ready_ = train;
  x_saved_ = train ? xin : Tensor();
  w_saved_ = train ? w : Tensor();
  return y_;
}

Tensor InputProjection::Backward(const Tensor& dy) {
  RequireReady(*this, ready_);
  const Device dev = x_saved_.device();
  RequireShape(*this, dy, OutputShape(x_saved_.shape()), dev);
  const int64_t rows = int64_t(x_saved_.numel() / size_t(in_));
  const Tensor g = ErrorSite(*this, hooks_, dy, &dy_q_);
  ResizeOn(&dw_, {out_, in_}, dev);
  ResizeOn(&db_, {out_}, dev);
  ResizeOn(&dx_, x_saved_.shape(), dev);
  // dW [out, in] = E^T X over all rows; dx = E W.
  CPD_DISPATCH(dev, ColumnBlockedSgemm(true, false, out_, in_, rows, 1.f, g.data(), out_,
                                       x_saved_.data(), in_, 0.f, dw_.data(), in_));
  CPD_DISPATCH(dev, SumRows(rows, out_, g.data(), db_.data()));
  CPD_DISPATCH(dev, ColumnBlockedSgemm(false, false, rows, in_, out_, 1.f, g.data(), out_,
                                       w_saved_.data(), in_, 0.f, dx_.data(), in_));
  WeightGradSite(*this, hooks_, &dw_);
  RequireDevice(*this, weight_.grad, "the weight gradient", dev);
  CPD_DISPATCH(dev, AddInPlace(dw_.numel(), dw_.data(), weight_.grad.data()));
  CPD_DISPATCH(dev, AddInPlace(db_.numel(), db_.data(), bias_.grad.data()));
  return dx_;
}

// ---- RecurrentProduct -------------------------------------------------------------------------

RecurrentProduct::RecurrentProduct(std::string name, int64_t hidden, const std::string& weight_name,
                                   const std::string& bias_name)
    : Layer(std::move(name)), hidden_(hidden) {
  if (hidden < 1) {
    throw std::invalid_argument(this->name() + " (RecurrentProduct): hidden must be >= 1, got " +
                                std::to_string(hidden));
  }
  weight_ = MakeParam(weight_name, {4 * hidden, hidden}, true);
  bias_ = MakeParam(bias_name, {4 * hidden}, false);
}

std::string RecurrentProduct::Describe() const {
  return "RecurrentProduct(h_{t-1} W_hh^T + b_hh, " + std::to_string(hidden_) + " -> " +
         std::to_string(4 * hidden_) + ", per timestep)";
}

Tensor RecurrentProduct::Forward(const Tensor&, bool) {
  throw std::logic_error(Where(*this) +
                         ": one product per timestep, driven by its parent through ForwardStep");
}

Tensor RecurrentProduct::Backward(const Tensor&) {
  throw std::logic_error(Where(*this) +
                         ": one product per timestep, driven by its parent through BackwardStep");
}

void RecurrentProduct::ForwardBegin(const Tensor& h, bool train) {
  const Device dev = weight_.value.device();
  RequireDevice(*this, h, "the operand sequence", dev);
  if (h.ndim() != 3 || h.dim(2) != hidden_ || h.dim(0) < 1 || h.dim(1) < 1) {
    Misfit(*this, h.shape(), "[T, B, " + std::to_string(hidden_) + "] operands");
  }
  steps_ = h.dim(0);
  batch_ = h.dim(1);
  h_ = h;
  train_ = train;
  ready_ = false;
  RefuseAccumulation(hooks_, *this, "the LSTM's products");
  // W once per forward: every step, and the backward, use the same quantised weights.
  w_used_ = WeightSite(*this, hooks_, weight_.value, &w_q_);
  hooked_a_ = hooks_ != nullptr;
  if (hooked_a_) ResizeOn(&hq_, h.shape(), dev);
  ResizeOn(&gh_, {batch_, 4 * hidden_}, dev);
}

Tensor RecurrentProduct::ForwardStep(int64_t t) {
  if (h_.empty() || t < 0 || t >= steps_) {
    throw std::logic_error(Where(*this) + ": ForwardStep(" + std::to_string(t) +
                           ") outside the sequence begun by ForwardBegin");
  }
  const int64_t b = batch_, h = hidden_, block = b * h;
  Tensor a = h_.Slice(size_t(t * block), {b, h});
  if (hooked_a_) {
    Tensor slot = hq_.Slice(size_t(t * block), {b, h});
    a = KeepInSlot(ActivationSite(*this, hooks_, a, &slot), &slot);
  }
  const Device dev = h_.device();
  float* out = gh_.data();
  CPD_DISPATCH(dev, BroadcastRows(b, 4 * h, bias_.value.data(), out));
  CPD_DISPATCH(dev, ColumnBlockedSgemm(false, true, b, 4 * h, h, 1.f, a.data(), h, w_used_.data(),
                                       h, 1.f, out, 4 * h));
  if (t == steps_ - 1) ready_ = train_;
  return gh_;
}

void RecurrentProduct::BackwardBegin(const Tensor& dz) {
  RequireReady(*this, ready_);
  const Device dev = h_.device();
  RequireShape(*this, dz, {steps_, batch_, 4 * hidden_}, dev);
  dz_ = dz;
  hooked_e_ = hooks_ != nullptr;
  if (hooked_e_) ResizeOn(&dzq_, dz.shape(), dev);
  ResizeOn(&dh_, {batch_, hidden_}, dev);
}

Tensor RecurrentProduct::BackwardStep(int64_t t, bool want_dh) {
  if (dz_.empty() || t < 0 || t >= steps_) {
    throw std::logic_error(Where(*this) + ": BackwardStep(" + std::to_string(t) +
                           ") outside the sequence begun by BackwardBegin");
  }
  const int64_t b = batch_, h = hidden_, block = b * 4 * h;
  Tensor e = dz_.Slice(size_t(t * block), {b, 4 * h});
  if (hooked_e_) {
    Tensor slot = dzq_.Slice(size_t(t * block), {b, 4 * h});
    e = KeepInSlot(ErrorSite(*this, hooks_, e, &slot), &slot);
  }
  if (!want_dh) return Tensor();
  CPD_DISPATCH(h_.device(), ColumnBlockedSgemm(false, false, b, h, 4 * h, 1.f, e.data(), 4 * h,
                                               w_used_.data(), h, 0.f, dh_.data(), h));
  return dh_;
}

void RecurrentProduct::BackwardEnd() {
  if (dz_.empty()) throw std::logic_error(Where(*this) + ": BackwardEnd without BackwardBegin");
  const int64_t rows = steps_ * batch_, h = hidden_;
  // The operands as the steps used them: quantised copies where the sites ran.
  const Tensor& e = hooked_e_ ? dzq_ : dz_;
  const Tensor& a = hooked_a_ ? hq_ : h_;
  const Device dev = h_.device();
  ResizeOn(&dw_, {4 * h, h}, dev);
  ResizeOn(&db_, {4 * h}, dev);
  // dW_hh [4H, H] = E^T [4H, T B] A [T B, H]: every timestep in one product.
  CPD_DISPATCH(dev, ColumnBlockedSgemm(true, false, 4 * h, h, rows, 1.f, e.data(), 4 * h, a.data(),
                                       h, 0.f, dw_.data(), h));
  CPD_DISPATCH(dev, SumRows(rows, 4 * h, e.data(), db_.data()));
  WeightGradSite(*this, hooks_, &dw_);
  RequireDevice(*this, weight_.grad, "the weight gradient", dev);
  CPD_DISPATCH(dev, AddInPlace(dw_.numel(), dw_.data(), weight_.grad.data()));
  CPD_DISPATCH(dev, AddInPlace(db_.numel(), db_.data(), bias_.grad.data()));
  dz_ = Tensor();
}

// ---- Lstm -------------------------------------------------------------------------------------

struct Lstm::Stage {
  std::unique_ptr<InputProjection> ih;
  std::unique_ptr<RecurrentProduct> hh;
  std::unique_ptr<Dropout> drop;  // on this layer's output; none after the last layer
  // Forward: the activated gates [T, B, 4H]; the cell states and outputs [T + 1, B, H], block 0
  // the zero initial state and block t + 1 step t's. Backward: dL/dz [T, B, 4H], dL/dc [B, H].
  Tensor gates, cs, hs;
  Tensor dz, dc;
};

Lstm::Lstm(std::string name, const LstmOptions& o, uint64_t seed)
    : ShapedLayer(std::move(name)), options_(o) {
  if (o.input < 1 || o.hidden < 1 || o.layers < 1 || !(o.dropout >= 0 && o.dropout < 1)) {
    throw std::invalid_argument(this->name() +
                                " (LSTM): needs input, hidden and layers >= 1 and dropout in "
                                "[0, 1), got input " +
                                std::to_string(o.input) + ", hidden " + std::to_string(o.hidden) +
                                ", layers " + std::to_string(o.layers) + ", dropout " +
                                FormatFloat(o.dropout));
  }
  const std::string& n = this->name();
  const int64_t h = o.hidden;
  const float bound = float(1.0 / std::sqrt(double(h)));
  for (int64_t k = 0; k < o.layers; ++k) {
    auto s = std::make_unique<Stage>();
    const std::string l = n + ".l" + std::to_string(k), suffix = "_l" + std::to_string(k);
    s->ih = std::make_unique<InputProjection>(l + ".ih", k == 0 ? o.input : h, 4 * h,
                                              n + ".weight_ih" + suffix, n + ".bias_ih" + suffix);
    std::mt19937_64 gen_ih(LayerSeed(seed, l + ".ih"));
    FillUniform(&s->ih->weight().value, bound, &gen_ih);
    FillUniform(&s->ih->bias().value, bound, &gen_ih);
    s->hh = std::make_unique<RecurrentProduct>(l + ".hh", h, n + ".weight_hh" + suffix,
                                               n + ".bias_hh" + suffix);
    std::mt19937_64 gen_hh(LayerSeed(seed, l + ".hh"));
    FillUniform(&s->hh->weight().value, bound, &gen_hh);
    FillUniform(&s->hh->bias().value, bound, &gen_hh);
    if (k + 1 < o.layers) {
      s->drop =
          std::make_unique<Dropout>(l + ".dropout", o.dropout, LayerSeed(seed, l + ".dropout"));
    }
    stages_.push_back(std::move(s));
  }
}

Lstm::~Lstm() = default;

std::string Lstm::Describe() const {
  return "LSTM(input " + std::to_string(options_.input) + ", hidden " +
         std::to_string(options_.hidden) + ", layers " + std::to_string(options_.layers) +
         (options_.dropout > 0 ? ", dropout " + FormatFloat(options_.dropout) : "") +
         ", batch-first, zero initial state)";
}

InputProjection& Lstm::ih(int64_t layer) { return *stages_.at(size_t(layer))->ih; }
RecurrentProduct& Lstm::hh(int64_t layer) { return *stages_.at(size_t(layer))->hh; }

std::vector<Layer*> Lstm::Children() const {
  std::vector<Layer*> out;
  for (const auto& s : stages_) {
    out.push_back(s->ih.get());
    out.push_back(s->hh.get());
    if (s->drop != nullptr) out.push_back(s->drop.get());
  }
  return out;
}

std::vector<Param*> Lstm::Params() {
  std::vector<Param*> out;
  for (const auto& s : stages_) {  // PyTorch's order: weight_ih, weight_hh, bias_ih, bias_hh
    out.push_back(&s->ih->weight());
    out.push_back(&s->hh->weight());
    out.push_back(&s->ih->bias());
    out.push_back(&s->hh->bias());
  }
  return out;
}

void Lstm::SetQuantHooks(QuantHooks* hooks) {
  hooks_ = hooks;
  for (Layer* c : Children()) c->SetQuantHooks(hooks);
}

std::vector<Layer*> Lstm::Flatten() {
  std::vector<Layer*> out = {this};
  for (Layer* c : Children()) out.push_back(c);
  return out;
}

void Lstm::SetStep(uint64_t step) {
  for (Layer* c : Children()) c->SetStep(step);
}

std::vector<int64_t> Lstm::OutputShape(const std::vector<int64_t>& in) const {
  if (in.size() != 3 || in[0] < 1 || in[1] < 1 || in[2] != options_.input) {
    Misfit(*this, in, "[B, T, " + std::to_string(options_.input) + "] with B, T >= 1");
  }
  return {in[0], in[1], options_.hidden};
}

std::vector<int64_t> Lstm::TraceShapes(const std::vector<int64_t>& in,
                                       std::vector<LayerShapeRecord>* out) {
  const std::vector<int64_t> y = OutputShape(in);
  const size_t self = out->size();
  out->push_back({this, in, y, 0});
  const int64_t b = in[0], t = in[1], h = options_.hidden;
  std::vector<int64_t> x = in;
  for (const auto& s : stages_) {
    s->ih->TraceShapes(x, out);
    const std::vector<int64_t> hs = {b, t, h}, gates = {b, t, 4 * h};
    out->push_back({s->hh.get(), hs, gates, double(b * t) * double(h) * double(4 * h)});
    if (s->drop != nullptr) s->drop->TraceShapes(hs, out);
    x = hs;
  }
  for (size_t i = self + 1; i < out->size(); ++i) (*out)[self].macs += (*out)[i].macs;
  return y;
}

Tensor Lstm::StageForward(Stage& s, const Tensor& x, bool train) {
  const int64_t t = x.dim(0), b = x.dim(1), h = options_.hidden;
  const Device dev = x.device();
  const Tensor gx = s.ih->Forward(x, train);  // every timestep's input projection at once
  ResizeOn(&s.gates, {t, b, 4 * h}, dev);
  ResizeOn(&s.cs, {t + 1, b, h}, dev);
  ResizeOn(&s.hs, {t + 1, b, h}, dev);
  s.cs.Slice(0, {b, h}).Zero();  // the zero initial state
  s.hs.Slice(0, {b, h}).Zero();
  s.hh->ForwardBegin(s.hs.Slice(0, {t, b, h}), train);
  for (int64_t i = 0; i < t; ++i) {
    const Tensor gh = s.hh->ForwardStep(i);
    CPD_DISPATCH(
        dev, LstmCellForward(b, h, gx.data() + i * b * 4 * h, gh.data(), s.cs.data() + i * b * h,
                             s.gates.data() + i * b * 4 * h, s.cs.data() + (i + 1) * b * h,
                             s.hs.data() + (i + 1) * b * h));
  }
  return s.hs.Slice(size_t(b * h), {t, b, h});
}

Tensor Lstm::StageBackward(Stage& s, const Tensor& dy) {
  const int64_t t = dy.dim(0), b = dy.dim(1), h = options_.hidden;
  const Device dev = dy.device();
  ResizeOn(&s.dz, {t, b, 4 * h}, dev);
  ResizeOn(&s.dc, {b, h}, dev);
  s.dc.Zero();
  s.hh->BackwardBegin(s.dz);
  Tensor dh_rec;  // dL/dh_t through h_{t+1}: none at the last step
  for (int64_t i = t - 1; i >= 0; --i) {
    CPD_DISPATCH(dev,
                 LstmCellBackward(b, h, s.gates.data() + i * b * 4 * h, s.cs.data() + i * b * h,
                                  s.cs.data() + (i + 1) * b * h, dy.data() + i * b * h,
                                  dh_rec.empty() ? nullptr : dh_rec.data(), s.dc.data(),
                                  s.dz.data() + i * b * 4 * h));
    dh_rec = s.hh->BackwardStep(i, /*want_dh=*/i > 0);
  }
  s.hh->BackwardEnd();
  return s.ih->Backward(s.dz);  // dL/dx of every timestep at once
}

Tensor Lstm::Forward(const Tensor& x, bool train) {
  const Device dev = stages_.front()->ih->weight().value.device();
  RequireDevice(*this, x, "the input", dev);
  const std::vector<int64_t> y_shape = OutputShape(x.shape());
  const int64_t b = x.dim(0), t = x.dim(1), c = x.dim(2), h = options_.hidden;
  ResizeOn(&x_tm_, {t, b, c}, dev);
  CPD_DISPATCH(dev, SwapLeadingDims(b, t, c, x.data(), x_tm_.data()));
  Tensor cur = x_tm_;
  for (const auto& s : stages_) {
    cur = StageForward(*s, cur, train);
    if (s->drop != nullptr) cur = s->drop->Forward(cur, train);
  }
  ResizeOn(&y_, y_shape, dev);
  CPD_DISPATCH(dev, SwapLeadingDims(t, b, h, cur.data(), y_.data()));
  ready_ = train;
  b_ = b;
  t_ = t;
  return y_;
}

Tensor Lstm::Backward(const Tensor& dy) {
  RequireReady(*this, ready_);
  const Device dev = y_.device();
  const int64_t h = options_.hidden;
  RequireShape(*this, dy, {b_, t_, h}, dev);
  ResizeOn(&dy_tm_, {t_, b_, h}, dev);
  CPD_DISPATCH(dev, SwapLeadingDims(b_, t_, h, dy.data(), dy_tm_.data()));
  Tensor cur = dy_tm_;
  for (size_t k = stages_.size(); k-- > 0;) {
    Stage& s = *stages_[k];
    if (s.drop != nullptr) cur = s.drop->Backward(cur);
    cur = StageBackward(s, cur);
  }
  ResizeOn(&dx_, {b_, t_, options_.input}, dev);
  CPD_DISPATCH(dev, SwapLeadingDims(t_, b_, options_.input, cur.data(), dx_.data()));
  return dx_;
}

// ---- BuildLstm --------------------------------------------------------------------------------

namespace {

// PyTorch's word_language_model example initialises its encoder and decoder with U(-0.1, 0.1).
constexpr float kTableInitRange = 0.1f;

}  // namespace

std::unique_ptr<Sequential> BuildLstm(const LstmLmOptions& o, uint64_t seed) {
  const int64_t hidden = o.hidden == 0 ? o.embed : o.hidden;
  if (o.vocab < 1 || o.embed < 1 || hidden < 1 || o.layers < 1 || o.block_size < 0) {
    throw std::invalid_argument("lstm_lm: needs vocab, embed, hidden and layers >= 1, got " +
                                std::to_string(o.vocab) + ", " + std::to_string(o.embed) + ", " +
                                std::to_string(hidden) + ", " + std::to_string(o.layers));
  }
  if (o.tied_head && hidden != o.embed) {
    throw std::invalid_argument("lstm_lm: a tied head needs hidden = embed, got hidden " +
                                std::to_string(hidden) + " and embed " + std::to_string(o.embed) +
                                " (untie the head, or make them equal)");
  }
  auto m = std::make_unique<Sequential>("lstm_lm");
  auto* wte = m->Emplace<TokenEmbedding>("wte", o.vocab, o.embed);
  std::mt19937_64 gen_wte(LayerSeed(seed, "wte"));
  FillUniform(&wte->weight().value, kTableInitRange, &gen_wte);
  m->Emplace<Dropout>("drop", o.dropout, LayerSeed(seed, "drop"));
  m->Emplace<Lstm>("lstm", LstmOptions{o.embed, hidden, o.layers, o.dropout}, seed);
  m->Emplace<Dropout>("lstm_drop", o.dropout, LayerSeed(seed, "lstm_drop"));
  if (o.tied_head) {
    m->Emplace<Linear>("lm_head", &wte->weight());
  } else {
    auto* head = m->Emplace<Linear>("lm_head", hidden, o.vocab, false);
    std::mt19937_64 gen_head(LayerSeed(seed, "lm_head"));
    FillUniform(&head->weight().value, kTableInitRange, &gen_head);
  }
  if (o.block_size > 0) m->set_input_shape({o.block_size});
  return m;
}

}  // namespace cpd::runtime
