// The layers of runtime/nn/layers.h that own parameters (Linear, Conv2d, BatchNorm), their
// initialisation and MoveToDevice, and the checks every layer shares
// (runtime/nn/layers_internal.h). The parameter-free layers and the loss are in
// layers_parameter_free.cc, the composites in layers_composite.cc.
#include "runtime/nn/layers.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>

#include "cpd/config.h"
#include "kernels/grid.h"
#include "runtime/nn/layers_internal.h"

#if CPD_WITH_CUDA
#include "cpd/transform_cuda.h"
#endif

namespace cpd::runtime {

namespace internal {

std::string Where(const Layer& layer) { return layer.name() + " (" + layer.kind() + ")"; }

void RequireDevice(const Layer& layer, const Tensor& t, const char* what, Device device) {
  if (t.device() != device) {
    throw std::invalid_argument(Where(layer) + ": " + what + " is a " + DeviceName(t.device()) +
                                " tensor, but the layer computes on " + DeviceName(device) +
                                " (move the model and its inputs to one device: MoveToDevice)");
  }
}

[[noreturn]] void Misfit(const Layer& layer, const std::vector<int64_t>& in,
                         const std::string& expected) {
  throw std::invalid_argument(Where(layer) + ": input of shape " + ShapeString(in) +
                              " does not fit; expected " + expected);
}

void RequireReady(const Layer& layer, bool ready) {
  if (!ready) {
    throw std::logic_error(Where(layer) +
                           ": Backward needs a preceding Forward(train = true) (none since the "
                           "last evaluation forward)");
  }
}

void RequireShape(const Layer& layer, const Tensor& dy, const std::vector<int64_t>& expected,
                  Device device) {
  RequireDevice(layer, dy, "the output gradient", device);
  if (dy.shape() != expected) {
    throw std::invalid_argument(Where(layer) + ": output gradient of shape " + dy.ShapeString() +
                                " does not match the forward output " + ShapeString(expected));
  }
}

std::string FormatFloat(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

// A hook may rewrite a tensor's values, not its shape or device.
void CheckHooked(const Layer& layer, const Tensor& t, const std::vector<int64_t>& shape,
                 Device device, const char* site) {
  if (t.shape() != shape || t.device() != device) {
    throw std::logic_error(Where(layer) + ": the " + site +
                           " quantisation hook changed the tensor's shape or device");
  }
}

Tensor ActivationSite(const Layer& layer, QuantHooks* hooks, const Tensor& x, Tensor* x_q) {
  if (hooks == nullptr) return x;
  ResizeOn(x_q, x.shape(), x.device());
  hooks->QuantizeActivation(layer, x, x_q);
  CheckHooked(layer, *x_q, x.shape(), x.device(), "activation");
  return *x_q;
}

Tensor WeightSite(const Layer& layer, QuantHooks* hooks, const Tensor& w_master, Tensor* w_q) {
  if (hooks == nullptr) return w_master;
  ResizeOn(w_q, w_master.shape(), w_master.device());
  hooks->QuantizeWeight(layer, w_master, w_q);
  CheckHooked(layer, *w_q, w_master.shape(), w_master.device(), "weight");
  return *w_q;
}

std::pair<Tensor, Tensor> ForwardSites(const Layer& layer, QuantHooks* hooks, const Tensor& x,
                                       const Tensor& w_master, Tensor* x_q, Tensor* w_q) {
  const Tensor xin = ActivationSite(layer, hooks, x, x_q);
  return {xin, WeightSite(layer, hooks, w_master, w_q)};
}

Tensor ErrorSite(const Layer& layer, QuantHooks* hooks, const Tensor& dy, Tensor* dy_q) {
  if (hooks == nullptr) return dy;
  ResizeOn(dy_q, dy.shape(), dy.device());
  hooks->QuantizeError(layer, dy, dy_q);
  CheckHooked(layer, *dy_q, dy.shape(), dy.device(), "error");
  return *dy_q;
}

void WeightGradSite(const Layer& layer, QuantHooks* hooks, Tensor* dw) {
  if (hooks == nullptr) return;
  const std::vector<int64_t> shape = dw->shape();
  const Device device = dw->device();
  hooks->QuantizeWeightGrad(layer, dw);
  CheckHooked(layer, *dw, shape, device, "weight-gradient");
}

const kernels::Accumulation* ProductAccumulation(QuantHooks* hooks, const Layer& layer) {
  return hooks == nullptr ? nullptr : hooks->ProductAccumulation(layer);
}

void RefuseAccumulation(QuantHooks* hooks, const Layer& layer, const char* what) {
  if (ProductAccumulation(hooks, layer) == nullptr) return;
  throw std::runtime_error(Where(layer) + ": --accumulate is not implemented for " + what +
                           "; keep the layer in fp32 (--keep-fp32) or drop --accumulate");
}

Param MakeParam(const std::string& name, std::vector<int64_t> shape, bool weight_decay) {
  Param p;
  p.name = name;
  p.value = Tensor(shape);
  p.grad = Tensor(std::move(shape));
  p.weight_decay = weight_decay;
  return p;
}

std::vector<int64_t> TraceLeaf(ShapedLayer* layer, const std::vector<int64_t>& in,
                               std::vector<LayerShapeRecord>* out) {
  LayerShapeRecord r;
  r.layer = layer;
  r.input = in;
  r.output = layer->OutputShape(in);
  r.macs = layer->ForwardMacs(in);
  out->push_back(r);
  return r.output;
}

}  // namespace internal

using internal::ErrorSite;
using internal::FormatFloat;
using internal::ForwardSites;
using internal::MakeParam;
using internal::Misfit;
using internal::ProductAccumulation;
using internal::RefuseAccumulation;
using internal::RequireDevice;
using internal::RequireReady;
using internal::RequireShape;
using internal::TraceLeaf;
using internal::WeightGradSite;
using internal::Where;

void FillUniform(Tensor* t, float bound, std::mt19937_64* gen) {
  float* d = t->data();
  for (size_t i = 0; i < t->numel(); ++i) {
    const double u = double((*gen)() >> 40) * 0x1p-24;  // [0, 1) on a 2^-24 grid
    d[i] = float((2.0 * u - 1.0) * double(bound));
  }
}

void FillNormal(Tensor* t, float std, std::mt19937_64* gen) {
  float* d = t->data();
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  for (size_t i = 0; i < t->numel(); i += 2) {
    const double u1 = double(((*gen)() >> 40) + 1) * 0x1p-24;  // (0, 1]: log is finite
    const double u2 = double((*gen)() >> 40) * 0x1p-24;
    const double r = std::sqrt(-2.0 * std::log(u1));
    d[i] = float(r * std::cos(kTwoPi * u2) * double(std));
    if (i + 1 < t->numel()) d[i + 1] = float(r * std::sin(kTwoPi * u2) * double(std));
  }
}

void MoveToDevice(Layer* model, Device device) {
  for (Param* p : model->Params()) {
    if (p->value.device() != device) p->value = p->value.To(device);
    if (p->grad.device() != device) p->grad = p->grad.To(device);
  }
  for (auto& [name, t] : model->Buffers()) {
    if (t->device() != device) *t = t->To(device);
  }
}

uint64_t LayerSeed(uint64_t seed, const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return kernels::SplitMix64(seed ^ kernels::SplitMix64(h));
}

std::vector<int64_t> ShapedLayer::TraceShapes(const std::vector<int64_t>& in,
                                              std::vector<LayerShapeRecord>* out) {
  return TraceLeaf(this, in, out);
}

// ---- Linear -------------------------------------------------------------------------------------

Linear::Linear(std::string name, int64_t in, int64_t out, bool bias, uint64_t seed)
    : ShapedLayer(std::move(name)), in_(in), out_(out), has_bias_(bias) {
  if (in < 1 || out < 1) {
    throw std::invalid_argument(this->name() + " (Linear): in and out must be >= 1, got " +
                                std::to_string(in) + " and " + std::to_string(out));
  }
  weight_ = MakeParam(this->name() + ".weight", {out, in}, true);
  std::mt19937_64 gen(seed);
  const float bound = float(1.0 / std::sqrt(double(in)));
  FillUniform(&weight_.value, bound, &gen);
  if (has_bias_) {
    bias_ = MakeParam(this->name() + ".bias", {out}, false);
    FillUniform(&bias_.value, bound, &gen);
  }
}

Linear::Linear(std::string name, Param* tied_weight)
    : ShapedLayer(std::move(name)), in_(0), out_(0), has_bias_(false), tied_(tied_weight) {
  if (tied_ == nullptr || tied_->value.ndim() != 2) {
    throw std::invalid_argument(this->name() +
                                " (Linear): a tied weight must be a matrix [out, in]");
  }
  out_ = tied_->value.dim(0);
  in_ = tied_->value.dim(1);
}

std::string Linear::Describe() const {
  return "Linear(" + std::to_string(in_) + " -> " + std::to_string(out_) +
         (tied_ != nullptr ? ", no bias, weight tied to " + tied_->name + ")"
          : has_bias_      ? ", bias)"
                           : ", no bias)");
}

std::vector<int64_t> Linear::OutputShape(const std::vector<int64_t>& in) const {
  if (in.size() < 2 || in.back() != in_) {
    Misfit(*this, in, "[N, " + std::to_string(in_) + "] or [N, ..., " + std::to_string(in_) + "]");
  }
  std::vector<int64_t> out = in;
  out.back() = out_;
  return out;
}

double Linear::ForwardMacs(const std::vector<int64_t>& in) const {
  const std::vector<int64_t> out = OutputShape(in);
  return double(NumelOf(out) / size_t(out_)) * double(in_) * double(out_);
}

std::vector<Param*> Linear::Params() {
  if (tied_ != nullptr) return {};  // the owner of the tied weight lists it
  if (has_bias_) return {&weight_, &bias_};
  return {&weight_};
}

Tensor Linear::Forward(const Tensor& x, bool train) {
  Param& weight = this->weight();
  const Device dev = weight.value.device();
  RequireDevice(*this, x, "the input", dev);
  const std::vector<int64_t> out_shape = OutputShape(x.shape());
  const auto [xin, w] = ForwardSites(*this, hooks_, x, weight.value, &x_q_, &w_q_);
  ResizeOn(&y_, out_shape, dev);
  // Leading dimensions flatten into rows: [B, T, in] is the matrix [B * T, in].
  const int64_t rows = int64_t(x.numel() / size_t(in_));
  CPD_DISPATCH(dev, LinearForward(rows, in_, out_, xin.data(), w.data(),
                                  has_bias_ ? bias_.value.data() : nullptr, y_.data(),
                                  ProductAccumulation(hooks_, *this)));
  ready_ = train;
  x_saved_ = train ? xin : Tensor();
  w_saved_ = train ? w : Tensor();
  // The transformed weight gradient starts from the input before A (a copy: the caller may reuse
  // x's buffer before this layer's backward).
  if (train && hooks_ != nullptr && hooks_->WeightGradTransform(*this)) {
    ResizeOn(&x_raw_, x.shape(), dev);
    x_raw_.CopyFrom(x);
  } else {
    x_raw_ = Tensor();
  }
  return y_;
}

Tensor Linear::Backward(const Tensor& dy) {
  RequireReady(*this, ready_);
  const int64_t n = int64_t(x_saved_.numel() / size_t(in_));
  const Device dev = x_saved_.device();
  RequireShape(*this, dy, OutputShape(x_saved_.shape()), dev);
  const Tensor g = ErrorSite(*this, hooks_, dy, &dy_q_);
  ResizeOn(&dw_, {out_, in_}, dev);
  if (has_bias_) ResizeOn(&db_, {out_}, dev);
  ResizeOn(&dx_, x_saved_.shape(), dev);
  const std::optional<HadamardOptions> transform =
      hooks_ != nullptr ? hooks_->WeightGradTransform(*this) : std::nullopt;
  CPD_DISPATCH(dev,
               LinearBackward(n, in_, out_, x_saved_.data(), w_saved_.data(), g.data(), dx_.data(),
                              transform ? nullptr : dw_.data(), has_bias_ ? db_.data() : nullptr,
                              ProductAccumulation(hooks_, *this)));
  if (transform) TransformedWeightGrad(*transform, n, dy);
  WeightGradSite(*this, hooks_, &dw_);
  Param& weight = this->weight();
  RequireDevice(*this, weight.grad, "the weight gradient", dev);
  CPD_DISPATCH(dev, AddInPlace(dw_.numel(), dw_.data(), weight.grad.data()));
  if (has_bias_) CPD_DISPATCH(dev, AddInPlace(db_.numel(), db_.data(), bias_.grad.data()));
  return dx_;
}

void Linear::TransformedWeightGrad(const HadamardOptions& t, int64_t n, const Tensor& dy) {
  const Device dev = x_saved_.device();
  if (x_raw_.empty()) {
    throw std::logic_error(Where(*this) +
                           ": a weight-gradient transform without the input kept by the "
                           "training forward (the hooks turned it on after the forward)");
  }
  // On the device the transform is queued on the runtime's stream, as the hooks' quantisation
  // and the product that follow (bit for bit the CPU's transform: cpd/transform_cuda.h).
  auto transformed = [&](const Tensor& src, int64_t cols, Tensor* dst) {
    ResizeOn(dst, src.shape(), dev);
    dst->CopyFrom(src);
#if CPD_WITH_CUDA
    const Status s =
        dev == Device::kCuda
            ? HadamardAlongRowsCuda(t, dst->data(), size_t(n), size_t(cols), cuda::Stream())
            : HadamardAlongRows(t, dst->data(), size_t(n), size_t(cols));
#else
    const Status s = HadamardAlongRows(t, dst->data(), size_t(n), size_t(cols));
#endif
    if (!s.ok()) throw std::runtime_error(Where(*this) + ": " + s.message());
  };
  transformed(x_raw_, in_, &xt_);
  hooks_->QuantizeActivation(*this, xt_, &xt_);
  transformed(dy, out_, &dyt_);
  hooks_->QuantizeError(*this, dyt_, &dyt_);
  // dW alone: with dx null, w is not read.
  CPD_DISPATCH(dev, LinearBackward(n, in_, out_, xt_.data(), nullptr, dyt_.data(), nullptr,
                                   dw_.data(), nullptr, ProductAccumulation(hooks_, *this)));
}

// ---- Conv2d -------------------------------------------------------------------------------------

Conv2d::Conv2d(std::string name, int64_t in_channels, int64_t out_channels, int64_t kernel,
               int64_t stride, int64_t padding, bool bias, uint64_t seed)
    : ShapedLayer(std::move(name)),
      in_(in_channels),
      out_(out_channels),
      k_(kernel),
      stride_(stride),
      pad_(padding),
      has_bias_(bias) {
  if (in_ < 1 || out_ < 1 || k_ < 1 || stride_ < 1 || pad_ < 0) {
    throw std::invalid_argument(
        this->name() +
        " (Conv2d): needs channels >= 1, kernel >= 1, stride >= 1, padding >= 0;"
        " got in " +
        std::to_string(in_) + ", out " + std::to_string(out_) + ", kernel " + std::to_string(k_) +
        ", stride " + std::to_string(stride_) + ", padding " + std::to_string(pad_));
  }
  weight_ = MakeParam(this->name() + ".weight", {out_, in_, k_, k_}, true);
  std::mt19937_64 gen(seed);
  const float bound = float(1.0 / std::sqrt(double(in_ * k_ * k_)));
  FillUniform(&weight_.value, bound, &gen);
  if (has_bias_) {
    bias_ = MakeParam(this->name() + ".bias", {out_}, false);
    FillUniform(&bias_.value, bound, &gen);
  }
}

std::string Conv2d::Describe() const {
  return "Conv2d(" + std::to_string(in_) + " -> " + std::to_string(out_) + ", kernel " +
         std::to_string(k_) + ", stride " + std::to_string(stride_) + ", padding " +
         std::to_string(pad_) + (has_bias_ ? ", bias)" : ", no bias)");
}

cpu::ConvShape Conv2d::ShapeFor(const std::vector<int64_t>& in) const {
  const std::string expected = "[N, " + std::to_string(in_) + ", H, W] with H, W + 2 * " +
                               std::to_string(pad_) + " >= " + std::to_string(k_);
  if (in.size() != 4 || in[1] != in_) Misfit(*this, in, expected);
  cpu::ConvShape s;
  s.n = in[0];
  s.c = in[1];
  s.h = in[2];
  s.w = in[3];
  s.oc = out_;
  s.k = k_;
  s.stride = stride_;
  s.pad = pad_;
  if (!s.ComputeOutput()) Misfit(*this, in, expected);
  return s;
}

std::vector<int64_t> Conv2d::OutputShape(const std::vector<int64_t>& in) const {
  const cpu::ConvShape s = ShapeFor(in);
  return {s.n, s.oc, s.oh, s.ow};
}

double Conv2d::ForwardMacs(const std::vector<int64_t>& in) const {
  const cpu::ConvShape s = ShapeFor(in);
  return double(s.n) * double(s.oc) * double(s.ohw()) * double(s.ckk());
}

std::vector<Param*> Conv2d::Params() {
  if (has_bias_) return {&weight_, &bias_};
  return {&weight_};
}

Tensor Conv2d::Forward(const Tensor& x, bool train) {
  const Device dev = weight_.value.device();
  RequireDevice(*this, x, "the input", dev);
  const cpu::ConvShape s = ShapeFor(x.shape());
  const auto [xin, w] = ForwardSites(*this, hooks_, x, weight_.value, &x_q_, &w_q_);
  ResizeOn(&y_, {s.n, s.oc, s.oh, s.ow}, dev);
  const float* bias = has_bias_ ? bias_.value.data() : nullptr;
  const kernels::Accumulation* acc = ProductAccumulation(hooks_, *this);
#if CPD_WITH_CUDA
  if (dev == Device::kCuda) {
    RefuseAccumulation(hooks_, *this, "convolutions on --device cuda (cuDNN)");
    cuda::Conv2dForward(s, xin.data(), w.data(), bias, y_.data());
  } else {
    cpu::Conv2dForward(s, xin.data(), w.data(), bias, y_.data(), &ws_, acc);
  }
#else
  cpu::Conv2dForward(s, xin.data(), w.data(), bias, y_.data(), &ws_, acc);
#endif
  ready_ = train;
  saved_shape_ = s;
  x_saved_ = train ? xin : Tensor();
  w_saved_ = train ? w : Tensor();
  return y_;
}

Tensor Conv2d::Backward(const Tensor& dy) {
  RequireReady(*this, ready_);
  const cpu::ConvShape& s = saved_shape_;
  const Device dev = x_saved_.device();
  RequireShape(*this, dy, {s.n, s.oc, s.oh, s.ow}, dev);
  const Tensor g = ErrorSite(*this, hooks_, dy, &dy_q_);
  ResizeOn(&dw_, weight_.value.shape(), dev);
  if (has_bias_) ResizeOn(&db_, {out_}, dev);
  ResizeOn(&dx_, {s.n, s.c, s.h, s.w}, dev);
  float* db = has_bias_ ? db_.data() : nullptr;
  const kernels::Accumulation* acc = ProductAccumulation(hooks_, *this);
#if CPD_WITH_CUDA
  if (dev == Device::kCuda) {
    RefuseAccumulation(hooks_, *this, "convolutions on --device cuda (cuDNN)");
    cuda::Conv2dBackward(s, x_saved_.data(), w_saved_.data(), g.data(), dx_.data(), dw_.data(), db);
  } else {
    cpu::Conv2dBackward(s, x_saved_.data(), w_saved_.data(), g.data(), dx_.data(), dw_.data(), db,
                        &ws_, acc);
  }
#else
  cpu::Conv2dBackward(s, x_saved_.data(), w_saved_.data(), g.data(), dx_.data(), dw_.data(), db,
                      &ws_, acc);
#endif
  WeightGradSite(*this, hooks_, &dw_);
  RequireDevice(*this, weight_.grad, "the weight gradient", dev);
  CPD_DISPATCH(dev, AddInPlace(dw_.numel(), dw_.data(), weight_.grad.data()));
  if (has_bias_) CPD_DISPATCH(dev, AddInPlace(db_.numel(), db_.data(), bias_.grad.data()));
  return dx_;
}

// ---- BatchNorm ----------------------------------------------------------------------------------

BatchNorm::BatchNorm(std::string name, int64_t channels, float eps, float momentum)
    : ShapedLayer(std::move(name)), c_(channels), eps_(eps), momentum_(momentum) {
  if (c_ < 1 || !(eps_ > 0) || !(momentum_ >= 0 && momentum_ <= 1)) {
    throw std::invalid_argument(this->name() +
                                " (BatchNorm): needs channels >= 1, eps > 0 and momentum in "
                                "[0, 1]; got " +
                                std::to_string(c_) + ", " + FormatFloat(eps_) + ", " +
                                FormatFloat(momentum_));
  }
  gamma_ = MakeParam(this->name() + ".gamma", {c_}, false);
  gamma_.value.Fill(1.f);
  beta_ = MakeParam(this->name() + ".beta", {c_}, false);
  running_mean_ = Tensor({c_});
  running_var_ = Tensor({c_});
  running_var_.Fill(1.f);
}

std::string BatchNorm::Describe() const {
  return "BatchNorm(" + std::to_string(c_) + ", eps " + FormatFloat(eps_) + ", momentum " +
         FormatFloat(momentum_) + (fused_relu_ ? ") + ReLU" : ")");
}

std::vector<int64_t> BatchNorm::OutputShape(const std::vector<int64_t>& in) const {
  if ((in.size() != 2 && in.size() != 4) || in[1] != c_) {
    Misfit(*this, in, "[N, " + std::to_string(c_) + "] or [N, " + std::to_string(c_) + ", H, W]");
  }
  return in;
}

std::vector<Param*> BatchNorm::Params() { return {&gamma_, &beta_}; }

std::vector<std::pair<std::string, Tensor*>> BatchNorm::Buffers() {
  return {{name() + ".running_mean", &running_mean_}, {name() + ".running_var", &running_var_}};
}

Tensor BatchNorm::Forward(const Tensor& x, bool train) {
  const Device dev = gamma_.value.device();
  RequireDevice(*this, x, "the input", dev);
  RequireDevice(*this, running_mean_, "the running mean", dev);
  RequireDevice(*this, running_var_, "the running variance", dev);
  OutputShape(x.shape());
  const int64_t n = x.dim(0);
  const int64_t hw = x.ndim() == 4 ? x.dim(2) * x.dim(3) : 1;
  ResizeOn(&y_, x.shape(), dev);
  if (!train) {
    CPD_DISPATCH(dev, BatchNormEvalForward(n, c_, hw, x.data(), gamma_.value.data(),
                                           beta_.value.data(), running_mean_.data(),
                                           running_var_.data(), eps_, fused_relu_, y_.data()));
    ready_ = false;
    x_saved_ = Tensor();
    return y_;
  }
  const int64_t count = n * hw;
  if (count < 2) {
    throw std::invalid_argument(Where(*this) +
                                ": training needs more than one value per channel, got input " +
                                x.ShapeString());
  }
  ResizeOn(&mean_, {c_}, dev);
  ResizeOn(&var_, {c_}, dev);
  ResizeOn(&invstd_, {c_}, dev);
  CPD_DISPATCH(dev, BatchNormTrainForward(n, c_, hw, x.data(), gamma_.value.data(),
                                          beta_.value.data(), eps_, fused_relu_, y_.data(),
                                          mean_.data(), var_.data(), invstd_.data()));
  // torch.nn.BatchNorm: running = (1 - momentum) running + momentum batch, the variance
  // unbiased (count / (count - 1)).
  const double unbias = double(count) / double(count - 1);
#if CPD_WITH_CUDA
  if (dev == Device::kCuda) {
    cuda::BatchNormUpdateRunning(c_, mean_.data(), var_.data(), momentum_, unbias,
                                 running_mean_.data(), running_var_.data());
    ready_ = true;
    x_saved_ = x;
    return y_;
  }
#endif
  float* rm = running_mean_.data();
  float* rv = running_var_.data();
  for (int64_t ch = 0; ch < c_; ++ch) {
    rm[ch] = (1.f - momentum_) * rm[ch] + momentum_ * mean_.data()[ch];
    rv[ch] = (1.f - momentum_) * rv[ch] + momentum_ * float(double(var_.data()[ch]) * unbias);
  }
  ready_ = true;
  x_saved_ = x;
  return y_;
}

Tensor BatchNorm::Backward(const Tensor& dy) {
  RequireReady(*this, ready_);
  const Device dev = x_saved_.device();
  RequireShape(*this, dy, x_saved_.shape(), dev);
  const int64_t n = x_saved_.dim(0);
  const int64_t hw = x_saved_.ndim() == 4 ? x_saved_.dim(2) * x_saved_.dim(3) : 1;
  ResizeOn(&dx_, x_saved_.shape(), dev);
  ResizeOn(&dgamma_, {c_}, dev);
  ResizeOn(&dbeta_, {c_}, dev);
  CPD_DISPATCH(
      dev, BatchNormBackward(n, c_, hw, x_saved_.data(), dy.data(),
                             fused_relu_ ? y_.data() : nullptr, gamma_.value.data(), mean_.data(),
                             invstd_.data(), dx_.data(), dgamma_.data(), dbeta_.data()));
  RequireDevice(*this, gamma_.grad, "the gamma gradient", dev);
  CPD_DISPATCH(dev, AddInPlace(size_t(c_), dgamma_.data(), gamma_.grad.data()));
  CPD_DISPATCH(dev, AddInPlace(size_t(c_), dbeta_.data(), beta_.grad.data()));
  return dx_;
}

}  // namespace cpd::runtime
