// The parameter-free layers of runtime/nn/layers.h (ReLU, pooling, Flatten, Dropout) and the
// softmax cross-entropy loss.
#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "cpd/config.h"
#include "kernels/grid.h"
#include "runtime/nn/layers.h"
#include "runtime/nn/layers_internal.h"

namespace cpd::runtime {

using internal::FormatFloat;
using internal::Misfit;
using internal::RequireReady;
using internal::RequireShape;
using internal::Where;

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

uint64_t Dropout::MaskKey() const { return kernels::MakeRandomKey(seed_, step_); }

Tensor Dropout::Forward(const Tensor& x, bool train) {
  ready_ = train;
  identity_ = !train || threshold_ == 0;
  if (identity_) return x;
  key_ = MaskKey();
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
