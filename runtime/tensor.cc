#include "runtime/tensor.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>

#include "cpd/config.h"
#if CPD_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace cpd::runtime {

namespace {

std::shared_ptr<float> Allocate(size_t n, Device device) {
  if (n == 0) return nullptr;
  if (device == Device::kCpu) {
    const size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, bytes);
    if (p == nullptr) throw std::bad_alloc();
    std::memset(p, 0, bytes);
    return std::shared_ptr<float>(static_cast<float*>(p), [](float* q) { std::free(q); });
  }
#if CPD_WITH_CUDA
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, n * sizeof(float));
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("cudaMalloc(") + std::to_string(n * sizeof(float)) +
                             " bytes): " + cudaGetErrorString(err));
  }
  cudaMemset(p, 0, n * sizeof(float));
  return std::shared_ptr<float>(static_cast<float*>(p), [](float* q) { cudaFree(q); });
#else
  throw std::runtime_error("a CUDA tensor was requested, but this build has no CUDA");
#endif
}

}  // namespace

const char* DeviceName(Device d) { return d == Device::kCpu ? "cpu" : "cuda"; }

size_t NumelOf(const std::vector<int64_t>& shape) {
  size_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) throw std::invalid_argument("negative tensor dimension");
    n *= size_t(d);
  }
  return n;
}

Tensor::Tensor(std::vector<int64_t> shape, Device device)
    : shape_(std::move(shape)), numel_(NumelOf(shape_)), device_(device) {
  storage_ = Allocate(numel_, device_);
  data_ = storage_.get();
}

Tensor Tensor::Reshaped(std::vector<int64_t> shape) const {
  if (NumelOf(shape) != numel_) {
    throw std::invalid_argument("cannot reshape " + ShapeString() + " to a different size");
  }
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

void Tensor::Resize(std::vector<int64_t> shape) {
  const size_t n = NumelOf(shape);
  if (n != numel_ || storage_ == nullptr) {
    storage_ = Allocate(n, device_);
    data_ = storage_.get();
    numel_ = n;
  }
  shape_ = std::move(shape);
}

void Tensor::Zero() {
  if (numel_ == 0) return;
  if (device_ == Device::kCpu) {
    std::memset(data_, 0, numel_ * sizeof(float));
    return;
  }
#if CPD_WITH_CUDA
  cudaMemset(data_, 0, numel_ * sizeof(float));
#endif
}

void Tensor::Fill(float v) {
  if (device_ == Device::kCpu) {
    for (size_t i = 0; i < numel_; ++i) data_[i] = v;
    return;
  }
  Tensor host(shape_, Device::kCpu);
  host.Fill(v);
  CopyFrom(host);
}

Tensor Tensor::Clone() const {
  Tensor t(shape_, device_);
  t.CopyFrom(*this);
  return t;
}

void Tensor::CopyFrom(const Tensor& src) {
  if (src.numel_ != numel_) {
    throw std::invalid_argument("CopyFrom: " + src.ShapeString() + " into " + ShapeString());
  }
  if (numel_ == 0) return;
  if (device_ == Device::kCpu && src.device_ == Device::kCpu) {
    std::memcpy(data_, src.data_, numel_ * sizeof(float));
    return;
  }
#if CPD_WITH_CUDA
  const cudaMemcpyKind kind = src.device_ == Device::kCpu
                                  ? (device_ == Device::kCpu ? cudaMemcpyHostToHost
                                                             : cudaMemcpyHostToDevice)
                                  : (device_ == Device::kCpu ? cudaMemcpyDeviceToHost
                                                             : cudaMemcpyDeviceToDevice);
  const cudaError_t err = cudaMemcpy(data_, src.data_, numel_ * sizeof(float), kind);
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("cudaMemcpy: ") + cudaGetErrorString(err));
  }
#else
  throw std::runtime_error("CUDA tensors need a CUDA build");
#endif
}

Tensor Tensor::To(Device device) const {
  Tensor t(shape_, device);
  t.CopyFrom(*this);
  return t;
}

std::string Tensor::ShapeString() const {
  std::string s = "[";
  for (size_t i = 0; i < shape_.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape_[i]);
  }
  return s + "]";
}

}  // namespace cpd::runtime
