#include "runtime/layers.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>

#include "cpd/config.h"
#include "kernels/grid.h"
#if CPD_WITH_CUDA
#include "runtime/cuda_ops.h"
#endif

namespace cpd::runtime {

namespace {

// Runs cpu::CALL, or cuda::CALL (the same function over device pointers, runtime/cuda_ops.h)
// when `device` is Device::kCuda. A build without CUDA cannot make CUDA tensors, so there it is
// the CPU call alone.
#if CPD_WITH_CUDA
#define CPD_DISPATCH(device, call) \
  do {                             \
    if ((device) == Device::kCuda) \
      cuda::call;                  \
    else                           \
      cpu::call;                   \
  } while (0)
#else
#define CPD_DISPATCH(device, call) cpu::call
#endif

std::string Where(const Layer& layer) { return layer.name() + " (" + layer.kind() + ")"; }

// A layer computes where its parameters live: `t` must be on the same device.
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

// dy must match the last training forward's output: its shape and its device.
void RequireShape(const Layer& layer, const Tensor& dy, const std::vector<int64_t>& expected,
                  Device device) {
  RequireDevice(layer, dy, "the output gradient", device);
  if (dy.shape() != expected) {
    throw std::invalid_argument(Where(layer) + ": output gradient of shape " + dy.ShapeString() +
                                " does not match the forward output " + ShapeString(expected));
  }
}

// A hook may rewrite a tensor's values, not its shape or device.
void CheckHooked(const Layer& layer, const Tensor& t, const std::vector<int64_t>& shape,
                 Device device, const char* site) {
  if (t.shape() != shape || t.device() != device) {
    throw std::logic_error(Where(layer) + ": the " + site +
                           " quantisation hook changed the tensor's shape or device");
  }
}

// The quantisation sites shared by Linear and Conv2d. Without hooks each returns its input.
// A and W: the input and weight forward uses (x_q and w_q are the layer's workspaces).
std::pair<Tensor, Tensor> ForwardSites(const Layer& layer, QuantHooks* hooks, const Tensor& x,
                                       const Tensor& w_master, Tensor* x_q, Tensor* w_q) {
  if (hooks == nullptr) return {x, w_master};
  ResizeOn(x_q, x.shape(), x.device());
  hooks->QuantizeActivation(layer, x, x_q);
  CheckHooked(layer, *x_q, x.shape(), x.device(), "activation");
  ResizeOn(w_q, w_master.shape(), w_master.device());
  hooks->QuantizeWeight(layer, w_master, w_q);
  CheckHooked(layer, *w_q, w_master.shape(), w_master.device(), "weight");
  return {*x_q, *w_q};
}

// E: the error backward uses.
Tensor ErrorSite(const Layer& layer, QuantHooks* hooks, const Tensor& dy, Tensor* dy_q) {
  if (hooks == nullptr) return dy;
  ResizeOn(dy_q, dy.shape(), dy.device());
  hooks->QuantizeError(layer, dy, dy_q);
  CheckHooked(layer, *dy_q, dy.shape(), dy.device(), "error");
  return *dy_q;
}

// G: the freshly computed weight gradient, in place.
void WeightGradSite(const Layer& layer, QuantHooks* hooks, Tensor* dw) {
  if (hooks == nullptr) return;
  const std::vector<int64_t> shape = dw->shape();
  const Device device = dw->device();
  hooks->QuantizeWeightGrad(layer, dw);
  CheckHooked(layer, *dw, shape, device, "weight-gradient");
}

Param MakeParam(const std::string& name, std::vector<int64_t> shape, bool weight_decay) {
  Param p;
  p.name = name;
  p.value = Tensor(shape);
  p.grad = Tensor(std::move(shape));
  p.weight_decay = weight_decay;
  return p;
}

std::string FormatFloat(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

// Leaf layers' records: one row.
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

}  // namespace

void FillUniform(Tensor* t, float bound, std::mt19937_64* gen) {
  float* d = t->data();
  for (size_t i = 0; i < t->numel(); ++i) {
    const double u = double((*gen)() >> 40) * 0x1p-24;  // [0, 1) on a 2^-24 grid
    d[i] = float((2.0 * u - 1.0) * double(bound));
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

std::string Linear::Describe() const {
  return "Linear(" + std::to_string(in_) + " -> " + std::to_string(out_) +
         (has_bias_ ? ", bias)" : ", no bias)");
}

std::vector<int64_t> Linear::OutputShape(const std::vector<int64_t>& in) const {
  if (in.size() != 2 || in[1] != in_) Misfit(*this, in, "[N, " + std::to_string(in_) + "]");
  return {in[0], out_};
}

double Linear::ForwardMacs(const std::vector<int64_t>& in) const {
  return double(OutputShape(in)[0]) * double(in_) * double(out_);
}

std::vector<Param*> Linear::Params() {
  if (has_bias_) return {&weight_, &bias_};
  return {&weight_};
}

Tensor Linear::Forward(const Tensor& x, bool train) {
  const Device dev = weight_.value.device();
  RequireDevice(*this, x, "the input", dev);
  const std::vector<int64_t> out_shape = OutputShape(x.shape());
  const auto [xin, w] = ForwardSites(*this, hooks_, x, weight_.value, &x_q_, &w_q_);
  ResizeOn(&y_, out_shape, dev);
  CPD_DISPATCH(dev, LinearForward(x.dim(0), in_, out_, xin.data(), w.data(),
                                  has_bias_ ? bias_.value.data() : nullptr, y_.data()));
  ready_ = train;
  x_saved_ = train ? xin : Tensor();
  w_saved_ = train ? w : Tensor();
  return y_;
}

Tensor Linear::Backward(const Tensor& dy) {
  RequireReady(*this, ready_);
  const int64_t n = x_saved_.dim(0);
  const Device dev = x_saved_.device();
  RequireShape(*this, dy, {n, out_}, dev);
  const Tensor g = ErrorSite(*this, hooks_, dy, &dy_q_);
  ResizeOn(&dw_, {out_, in_}, dev);
  if (has_bias_) ResizeOn(&db_, {out_}, dev);
  ResizeOn(&dx_, {n, in_}, dev);
  CPD_DISPATCH(dev, LinearBackward(n, in_, out_, x_saved_.data(), w_saved_.data(), g.data(),
                                   dx_.data(), dw_.data(), has_bias_ ? db_.data() : nullptr));
  WeightGradSite(*this, hooks_, &dw_);
  RequireDevice(*this, weight_.grad, "the weight gradient", dev);
  CPD_DISPATCH(dev, AddInPlace(dw_.numel(), dw_.data(), weight_.grad.data()));
  if (has_bias_) CPD_DISPATCH(dev, AddInPlace(db_.numel(), db_.data(), bias_.grad.data()));
  return dx_;
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
#if CPD_WITH_CUDA
  if (dev == Device::kCuda) {
    cuda::Conv2dForward(s, xin.data(), w.data(), bias, y_.data());
  } else {
    cpu::Conv2dForward(s, xin.data(), w.data(), bias, y_.data(), &ws_);
  }
#else
  cpu::Conv2dForward(s, xin.data(), w.data(), bias, y_.data(), &ws_);
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
#if CPD_WITH_CUDA
  if (dev == Device::kCuda) {
    cuda::Conv2dBackward(s, x_saved_.data(), w_saved_.data(), g.data(), dx_.data(), dw_.data(), db);
  } else {
    cpu::Conv2dBackward(s, x_saved_.data(), w_saved_.data(), g.data(), dx_.data(), dw_.data(), db,
                        &ws_);
  }
#else
  cpu::Conv2dBackward(s, x_saved_.data(), w_saved_.data(), g.data(), dx_.data(), dw_.data(), db,
                      &ws_);
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

// ---- ReLU ---------------------------------------------------------------------------------------

std::vector<int64_t> ReLU::OutputShape(const std::vector<int64_t>& in) const { return in; }

Tensor ReLU::Forward(const Tensor& x, bool train) {
  ResizeOn(&y_, x.shape(), x.device());
  CPD_DISPATCH(x.device(), Relu(x.numel(), x.data(), y_.data()));
  ready_ = train;
  return y_;
}

Tensor ReLU::Backward(const Tensor& dy) {
  RequireReady(*this, ready_);
  const Device dev = y_.device();
  RequireShape(*this, dy, y_.shape(), dev);
  ResizeOn(&dx_, dy.shape(), dev);
  CPD_DISPATCH(dev, ReluBackward(dy.numel(), y_.data(), dy.data(), dx_.data()));
  return dx_;
}

// ---- Pooling ------------------------------------------------------------------------------------

Pool2d::Pool2d(std::string name, const char* kind, int64_t kernel, int64_t stride)
    : ShapedLayer(std::move(name)), k_(kernel), stride_(stride == 0 ? kernel : stride) {
  if (k_ < 1 || stride_ < 1) {
    throw std::invalid_argument(this->name() + " (" + kind +
                                "): kernel and stride must be >= 1, got " + std::to_string(k_) +
                                " and " + std::to_string(stride_));
  }
}

std::string Pool2d::Describe() const {
  return std::string(kind()) + "(kernel " + std::to_string(k_) + ", stride " +
         std::to_string(stride_) + ")";
}

std::vector<int64_t> Pool2d::OutputShape(const std::vector<int64_t>& in) const {
  if (in.size() != 4 || in[2] < k_ || in[3] < k_) {
    Misfit(*this, in, "[N, C, H, W] with H, W >= " + std::to_string(k_));
  }
  return {in[0], in[1], (in[2] - k_) / stride_ + 1, (in[3] - k_) / stride_ + 1};
}

MaxPool2d::MaxPool2d(std::string name, int64_t kernel, int64_t stride)
    : Pool2d(std::move(name), "MaxPool2d", kernel, stride) {}

Tensor MaxPool2d::Forward(const Tensor& x, bool train) {
  const std::vector<int64_t> out = OutputShape(x.shape());
  ResizeOn(&y_, out, x.device());
#if CPD_WITH_CUDA
  if (x.device() == Device::kCuda) {
    argmax_dev_.Reserve(y_.numel() * sizeof(int32_t), Device::kCuda);
    cuda::MaxPool2dForward(out[0] * out[1], x.dim(2), x.dim(3), k_, stride_, out[2], out[3],
                           x.data(), y_.data(), static_cast<int32_t*>(argmax_dev_.data()));
    in_shape_ = x.shape();
    ready_ = train;
    return y_;
  }
#endif
  argmax_.resize(y_.numel());
  cpu::MaxPool2dForward(out[0] * out[1], x.dim(2), x.dim(3), k_, stride_, out[2], out[3], x.data(),
                        y_.data(), argmax_.data());
  in_shape_ = x.shape();
  ready_ = train;
  return y_;
}

Tensor MaxPool2d::Backward(const Tensor& dy) {
  RequireReady(*this, ready_);
  const Device dev = y_.device();
  RequireShape(*this, dy, y_.shape(), dev);
  ResizeOn(&dx_, in_shape_, dev);
#if CPD_WITH_CUDA
  if (dev == Device::kCuda) {
    cuda::MaxPool2dBackward(dy.dim(0) * dy.dim(1), in_shape_[2], in_shape_[3], k_, stride_,
                            dy.dim(2), dy.dim(3), dy.data(),
                            static_cast<const int32_t*>(argmax_dev_.data()), dx_.data());
    return dx_;
  }
#endif
  cpu::MaxPool2dBackward(dy.dim(0) * dy.dim(1), in_shape_[2], in_shape_[3], dy.dim(2), dy.dim(3),
                         dy.data(), argmax_.data(), dx_.data());
  return dx_;
}

AvgPool2d::AvgPool2d(std::string name, int64_t kernel, int64_t stride)
    : Pool2d(std::move(name), "AvgPool2d", kernel, stride) {}

Tensor AvgPool2d::Forward(const Tensor& x, bool train) {
  const std::vector<int64_t> out = OutputShape(x.shape());
  ResizeOn(&y_, out, x.device());
  CPD_DISPATCH(x.device(), AvgPool2dForward(out[0] * out[1], x.dim(2), x.dim(3), k_, stride_,
                                            out[2], out[3], x.data(), y_.data()));
  in_shape_ = x.shape();
  ready_ = train;
  return y_;
}

Tensor AvgPool2d::Backward(const Tensor& dy) {
  RequireReady(*this, ready_);
  const Device dev = y_.device();
  RequireShape(*this, dy, y_.shape(), dev);
  ResizeOn(&dx_, in_shape_, dev);
  CPD_DISPATCH(dev, AvgPool2dBackward(dy.dim(0) * dy.dim(1), in_shape_[2], in_shape_[3], k_,
                                      stride_, dy.dim(2), dy.dim(3), dy.data(), dx_.data()));
  return dx_;
}

std::vector<int64_t> GlobalAvgPool::OutputShape(const std::vector<int64_t>& in) const {
  if (in.size() != 4 || in[2] < 1 || in[3] < 1) Misfit(*this, in, "[N, C, H, W]");
  return {in[0], in[1]};
}

Tensor GlobalAvgPool::Forward(const Tensor& x, bool train) {
  ResizeOn(&y_, OutputShape(x.shape()), x.device());
  CPD_DISPATCH(x.device(),
               GlobalAvgPoolForward(x.dim(0) * x.dim(1), x.dim(2) * x.dim(3), x.data(), y_.data()));
  in_shape_ = x.shape();
  ready_ = train;
  return y_;
}

Tensor GlobalAvgPool::Backward(const Tensor& dy) {
  RequireReady(*this, ready_);
  const Device dev = y_.device();
  RequireShape(*this, dy, y_.shape(), dev);
  ResizeOn(&dx_, in_shape_, dev);
  CPD_DISPATCH(
      dev, GlobalAvgPoolBackward(dy.numel(), in_shape_[2] * in_shape_[3], dy.data(), dx_.data()));
  return dx_;
}

// ---- Flatten ------------------------------------------------------------------------------------

std::vector<int64_t> Flatten::OutputShape(const std::vector<int64_t>& in) const {
  if (in.empty()) Misfit(*this, in, "[N, ...]");
  int64_t rest = 1;
  for (size_t i = 1; i < in.size(); ++i) rest *= in[i];
  return {in[0], rest};
}

Tensor Flatten::Forward(const Tensor& x, bool train) {
  in_shape_ = x.shape();
  ready_ = train;
  return x.Reshaped(OutputShape(x.shape()));
}

Tensor Flatten::Backward(const Tensor& dy) {
  RequireReady(*this, ready_);
  if (dy.shape() != OutputShape(in_shape_)) {
    throw std::invalid_argument(Where(*this) + ": output gradient of shape " + dy.ShapeString() +
                                " does not match the forward output " +
                                ShapeString(OutputShape(in_shape_)));
  }
  return dy.Reshaped(in_shape_);
}

// ---- Dropout ------------------------------------------------------------------------------------

Dropout::Dropout(std::string name, double p, uint64_t seed)
    : ShapedLayer(std::move(name)), p_(p), seed_(seed) {
  if (!(p >= 0.0 && p < 1.0)) {
    throw std::invalid_argument(this->name() + " (Dropout): p must be in [0, 1), got " +
                                FormatFloat(p));
  }
  threshold_ = uint32_t(std::min(std::llround(p * 0x1p32), 0xffffffffll));
  scale_ = float(1.0 / (1.0 - p));
}

std::string Dropout::Describe() const { return "Dropout(p " + FormatFloat(p_) + ")"; }

Tensor Dropout::Forward(const Tensor& x, bool train) {
  ready_ = train;
  identity_ = !train || threshold_ == 0;
  if (identity_) return x;
  key_ = kernels::MakeRandomKey(seed_, step_);
  ResizeOn(&y_, x.shape(), x.device());
  CPD_DISPATCH(x.device(), DropoutApply(x.numel(), key_, threshold_, scale_, x.data(), y_.data()));
  return y_;
}

Tensor Dropout::Backward(const Tensor& dy) {
  RequireReady(*this, ready_);
  if (identity_) return dy;
  const Device dev = y_.device();
  RequireShape(*this, dy, y_.shape(), dev);
  ResizeOn(&dx_, dy.shape(), dev);
  CPD_DISPATCH(dev, DropoutApply(dy.numel(), key_, threshold_, scale_, dy.data(), dx_.data()));
  return dx_;
}

// ---- Sequential ---------------------------------------------------------------------------------

Layer* Sequential::Add(std::unique_ptr<Layer> layer) {
  if (layer == nullptr) throw std::invalid_argument(Where(*this) + ": Add(nullptr)");
  layer->SetQuantHooks(hooks_);
  children_.push_back(std::move(layer));
  return children_.back().get();
}

std::string Sequential::Describe() const {
  return "Sequential(" + std::to_string(children_.size()) + " layers)";
}

Tensor Sequential::Forward(const Tensor& x, bool train) {
  Tensor h = x;
  for (auto& c : children_) h = c->Forward(h, train);
  return h;
}

Tensor Sequential::Backward(const Tensor& dy) {
  Tensor g = dy;
  for (auto it = children_.rbegin(); it != children_.rend(); ++it) g = (*it)->Backward(g);
  return g;
}

std::vector<Param*> Sequential::Params() {
  std::vector<Param*> out;
  for (auto& c : children_) {
    for (Param* p : c->Params()) out.push_back(p);
  }
  return out;
}

std::vector<std::pair<std::string, Tensor*>> Sequential::Buffers() {
  std::vector<std::pair<std::string, Tensor*>> out;
  for (auto& c : children_) {
    for (auto& b : c->Buffers()) out.push_back(b);
  }
  return out;
}

void Sequential::SetQuantHooks(QuantHooks* hooks) {
  hooks_ = hooks;
  for (auto& c : children_) c->SetQuantHooks(hooks);
}

std::vector<Layer*> Sequential::Flatten() {
  std::vector<Layer*> out = {this};
  for (auto& c : children_) {
    for (Layer* l : c->Flatten()) out.push_back(l);
  }
  return out;
}

void Sequential::SetStep(uint64_t step) {
  for (auto& c : children_) c->SetStep(step);
}

namespace {

ShapedLayer* AsShaped(const Layer& parent, Layer* child) {
  auto* s = dynamic_cast<ShapedLayer*>(child);
  if (s == nullptr) {
    throw std::invalid_argument(Where(parent) + ": child " + Where(*child) +
                                " cannot infer shapes (not a ShapedLayer)");
  }
  return s;
}

}  // namespace

std::vector<int64_t> Sequential::OutputShape(const std::vector<int64_t>& in) const {
  std::vector<int64_t> shape = in;
  for (const auto& c : children_) shape = AsShaped(*this, c.get())->OutputShape(shape);
  return shape;
}

std::vector<int64_t> Sequential::TraceShapes(const std::vector<int64_t>& in,
                                             std::vector<LayerShapeRecord>* out) {
  const size_t self = out->size();
  out->push_back({this, in, {}, 0});
  std::vector<int64_t> shape = in;
  for (auto& c : children_) shape = AsShaped(*this, c.get())->TraceShapes(shape, out);
  double macs = 0;
  for (size_t i = self + 1; i < out->size(); ++i) {
    if ((*out)[i].layer->Quantizable()) macs += (*out)[i].macs;
  }
  (*out)[self].output = shape;
  (*out)[self].macs = macs;
  return shape;
}

// ---- BasicBlock ---------------------------------------------------------------------------------

BasicBlock::BasicBlock(std::string name, int64_t in_channels, int64_t out_channels, int64_t stride,
                       uint64_t seed)
    : ShapedLayer(std::move(name)), in_(in_channels), out_(out_channels), stride_(stride) {
  const std::string& n = this->name();
  conv1_ = std::make_unique<Conv2d>(n + ".conv1", in_, out_, 3, stride_, 1, false,
                                    LayerSeed(seed, n + ".conv1"));
  bn1_ = std::make_unique<BatchNorm>(n + ".bn1", out_);
  bn1_->set_fused_relu(true);
  conv2_ = std::make_unique<Conv2d>(n + ".conv2", out_, out_, 3, 1, 1, false,
                                    LayerSeed(seed, n + ".conv2"));
  bn2_ = std::make_unique<BatchNorm>(n + ".bn2", out_);
  if (stride_ != 1 || in_ != out_) {
    sc_conv_ = std::make_unique<Conv2d>(n + ".shortcut.conv", in_, out_, 1, stride_, 0, false,
                                        LayerSeed(seed, n + ".shortcut.conv"));
    sc_bn_ = std::make_unique<BatchNorm>(n + ".shortcut.bn", out_);
  }
}

std::string BasicBlock::Describe() const {
  return "BasicBlock(" + std::to_string(in_) + " -> " + std::to_string(out_) + ", stride " +
         std::to_string(stride_) + (sc_conv_ ? ", projection shortcut)" : ", identity shortcut)");
}

std::vector<ShapedLayer*> BasicBlock::Children() const {
  std::vector<ShapedLayer*> c = {conv1_.get(), bn1_.get(), conv2_.get(), bn2_.get()};
  if (sc_conv_) {
    c.push_back(sc_conv_.get());
    c.push_back(sc_bn_.get());
  }
  return c;
}

std::vector<Param*> BasicBlock::Params() {
  std::vector<Param*> out;
  for (ShapedLayer* c : Children()) {
    for (Param* p : c->Params()) out.push_back(p);
  }
  return out;
}

std::vector<std::pair<std::string, Tensor*>> BasicBlock::Buffers() {
  std::vector<std::pair<std::string, Tensor*>> out;
  for (ShapedLayer* c : Children()) {
    for (auto& b : c->Buffers()) out.push_back(b);
  }
  return out;
}

void BasicBlock::SetQuantHooks(QuantHooks* hooks) {
  hooks_ = hooks;
  for (ShapedLayer* c : Children()) c->SetQuantHooks(hooks);
}

std::vector<Layer*> BasicBlock::Flatten() {
  std::vector<Layer*> out = {this};
  for (ShapedLayer* c : Children()) out.push_back(c);
  return out;
}

std::vector<int64_t> BasicBlock::OutputShape(const std::vector<int64_t>& in) const {
  if (in.size() != 4 || in[1] != in_) {
    Misfit(*this, in, "[N, " + std::to_string(in_) + ", H, W]");
  }
  return conv1_->OutputShape(in);
}

std::vector<int64_t> BasicBlock::TraceShapes(const std::vector<int64_t>& in,
                                             std::vector<LayerShapeRecord>* out) {
  const std::vector<int64_t> shape = OutputShape(in);
  const size_t self = out->size();
  out->push_back({this, in, shape, 0});
  std::vector<int64_t> h = conv1_->TraceShapes(in, out);
  h = bn1_->TraceShapes(h, out);
  h = conv2_->TraceShapes(h, out);
  bn2_->TraceShapes(h, out);
  if (sc_conv_) sc_bn_->TraceShapes(sc_conv_->TraceShapes(in, out), out);
  for (size_t i = self + 1; i < out->size(); ++i) (*out)[self].macs += (*out)[i].macs;
  return shape;
}

Tensor BasicBlock::Forward(const Tensor& x, bool train) {
  OutputShape(x.shape());
  const Tensor h = bn1_->Forward(conv1_->Forward(x, train), train);  // ReLU fused in bn1
  const Tensor b = bn2_->Forward(conv2_->Forward(h, train), train);
  const Tensor s = sc_conv_ ? sc_bn_->Forward(sc_conv_->Forward(x, train), train) : x;
  ResizeOn(&y_, b.shape(), b.device());
  CPD_DISPATCH(b.device(), AddRelu(b.numel(), b.data(), s.data(), y_.data()));
  ready_ = train;
  return y_;
}

Tensor BasicBlock::Backward(const Tensor& dy) {
  RequireReady(*this, ready_);
  const Device dev = y_.device();
  RequireShape(*this, dy, y_.shape(), dev);
  ResizeOn(&g_, dy.shape(), dev);
  CPD_DISPATCH(dev, ReluBackward(dy.numel(), y_.data(), dy.data(), g_.data()));
  const Tensor dh = conv2_->Backward(bn2_->Backward(g_));
  const Tensor dx_main = conv1_->Backward(bn1_->Backward(dh));
  const Tensor dx_short = sc_conv_ ? sc_conv_->Backward(sc_bn_->Backward(g_)) : g_;
  ResizeOn(&dx_, dx_main.shape(), dev);
  CPD_DISPATCH(dev, Add(dx_main.numel(), dx_main.data(), dx_short.data(), dx_.data()));
  return dx_;
}

// ---- SoftmaxCrossEntropy ------------------------------------------------------------------------

namespace {

void CheckLogits(const Tensor& logits, const std::vector<int32_t>& labels) {
  if (logits.ndim() != 2 || logits.dim(0) < 1 || logits.dim(1) < 1) {
    throw std::invalid_argument("SoftmaxCrossEntropy: logits must be [N >= 1, classes >= 1], got " +
                                logits.ShapeString());
  }
  if (int64_t(labels.size()) != logits.dim(0)) {
    throw std::invalid_argument("SoftmaxCrossEntropy: " + std::to_string(labels.size()) +
                                " labels for logits " + logits.ShapeString());
  }
}

}  // namespace

float SoftmaxCrossEntropy::Forward(const Tensor& logits, const std::vector<int32_t>& labels,
                                   Tensor* dlogits) {
  CheckLogits(logits, labels);
  const int64_t n = logits.dim(0), k = logits.dim(1);
  for (size_t i = 0; i < labels.size(); ++i) {
    if (labels[i] < 0 || labels[i] >= k) {
      throw std::invalid_argument("SoftmaxCrossEntropy: label " + std::to_string(labels[i]) +
                                  " at row " + std::to_string(i) + " is outside [0, " +
                                  std::to_string(k) + ")");
    }
  }
  float* d = nullptr;
  if (dlogits != nullptr) {
    ResizeOn(dlogits, logits.shape(), logits.device());
    d = dlogits->data();
  }
#if CPD_WITH_CUDA
  if (logits.device() == Device::kCuda) {
    // The labels stay in host memory; the CUDA loss uploads them.
    return float(cuda::SoftmaxCrossEntropy(n, k, logits.data(), labels.data(), d));
  }
#endif
  return float(cpu::SoftmaxCrossEntropy(n, k, logits.data(), labels.data(), d));
}

int64_t SoftmaxCrossEntropy::CountCorrect(const Tensor& logits,
                                          const std::vector<int32_t>& labels) {
  CheckLogits(logits, labels);
  if (logits.device() != Device::kCpu) return CountCorrect(logits.To(Device::kCpu), labels);
  const int64_t n = logits.dim(0), k = logits.dim(1);
  int64_t correct = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float* row = logits.data() + i * k;
    int64_t best = 0;
    for (int64_t j = 1; j < k; ++j) {
      if (row[j] > row[best]) best = j;
    }
    correct += best == labels[size_t(i)];
  }
  return correct;
}

}  // namespace cpd::runtime
