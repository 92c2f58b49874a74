#include "runtime/nn/normalization.h"

#include <stdexcept>

#include "runtime/engine/cpu_ops.h"
#include "runtime/engine/cpu_transformer.h"
#include "runtime/engine/cuda_transformer.h"
#include "runtime/nn/layers_internal.h"

namespace cpd::runtime {

using internal::FormatFloat;
using internal::MakeParam;
using internal::Misfit;
using internal::RequireDevice;
using internal::RequireReady;
using internal::RequireShape;

// ---- LayerNorm --------------------------------------------------------------------------------

LayerNorm::LayerNorm(std::string name, int64_t features, float eps)
    : ShapedLayer(std::move(name)), c_(features), eps_(eps) {
  if (c_ < 1 || !(eps_ > 0)) {
    throw std::invalid_argument(this->name() +
                                " (LayerNorm): needs features >= 1 and eps > 0, got " +
                                std::to_string(c_) + " and " + FormatFloat(eps_));
  }
  gamma_ = MakeParam(this->name() + ".weight", {c_}, false);
  gamma_.value.Fill(1.f);
  beta_ = MakeParam(this->name() + ".bias", {c_}, false);
}

std::string LayerNorm::Describe() const {
  return "LayerNorm(" + std::to_string(c_) + ", eps " + FormatFloat(eps_) + ")";
}

std::vector<int64_t> LayerNorm::OutputShape(const std::vector<int64_t>& in) const {
  if (in.empty() || in.back() != c_) Misfit(*this, in, "[..., " + std::to_string(c_) + "]");
  return in;
}

Tensor LayerNorm::Forward(const Tensor& x, bool train) {
  const Device dev = gamma_.value.device();
  RequireDevice(*this, x, "the input", dev);
  OutputShape(x.shape());
  const int64_t rows = int64_t(x.numel() / size_t(c_));
  ResizeOn(&y_, x.shape(), dev);
  ResizeOn(&mean_, {rows}, dev);
  ResizeOn(&rstd_, {rows}, dev);
  CPD_DISPATCH(dev, LayerNormForward(rows, c_, x.data(), gamma_.value.data(), beta_.value.data(),
                                     eps_, y_.data(), mean_.data(), rstd_.data()));
  ready_ = train;
  x_saved_ = train ? x : Tensor();
  return y_;
}

Tensor LayerNorm::Backward(const Tensor& dy) {
  RequireReady(*this, ready_);
  const Device dev = x_saved_.device();
  RequireShape(*this, dy, x_saved_.shape(), dev);
  const int64_t rows = int64_t(x_saved_.numel() / size_t(c_));
  ResizeOn(&dx_, x_saved_.shape(), dev);
  ResizeOn(&dgamma_, {c_}, dev);
  ResizeOn(&dbeta_, {c_}, dev);
  CPD_DISPATCH(dev, LayerNormBackward(rows, c_, x_saved_.data(), dy.data(), gamma_.value.data(),
                                      mean_.data(), rstd_.data(), dx_.data(), dgamma_.data(),
                                      dbeta_.data()));
  RequireDevice(*this, gamma_.grad, "the weight gradient", dev);
  CPD_DISPATCH(dev, AddInPlace(size_t(c_), dgamma_.data(), gamma_.grad.data()));
  CPD_DISPATCH(dev, AddInPlace(size_t(c_), dbeta_.data(), beta_.grad.data()));
  return dx_;
}

// ---- GELU -------------------------------------------------------------------------------------

Tensor GELU::Forward(const Tensor& x, bool train) {
  const Device dev = x.device();
  ResizeOn(&y_, x.shape(), dev);
  CPD_DISPATCH(dev, GeluForward(x.numel(), x.data(), y_.data()));
  ready_ = train;
  x_saved_ = train ? x : Tensor();
  return y_;
}

Tensor GELU::Backward(const Tensor& dy) {
  RequireReady(*this, ready_);
  const Device dev = x_saved_.device();
  RequireShape(*this, dy, x_saved_.shape(), dev);
  ResizeOn(&dx_, dy.shape(), dev);
  CPD_DISPATCH(dev, GeluBackward(dy.numel(), x_saved_.data(), dy.data(), dx_.data()));
  return dx_;
}

}  // namespace cpd::runtime
