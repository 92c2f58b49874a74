#include "runtime/engine/tensor.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>

#include "cpd/config.h"
#if CPD_WITH_CUDA
#include <cuda_runtime.h>

#include "runtime/engine/cuda_internal.h"
#endif

namespace cpd::runtime {

namespace {

#if !CPD_WITH_CUDA
[[noreturn]] void NoCuda() {
  throw std::runtime_error("a CUDA tensor was requested, but this build has no CUDA");
}
#endif

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
    (void)cudaGetLastError();  // an allocation failure is not sticky; clear it
    throw std::runtime_error(std::string("cudaMalloc(") + std::to_string(n * sizeof(float)) +
                             " bytes): " + cudaGetErrorString(err));
  }
  std::shared_ptr<float> owned(static_cast<float*>(p), [](float* q) { cudaFree(q); });
  CPD_CUDA_CHECK(cudaMemset(p, 0, n * sizeof(float)));
  return owned;
#else
  NoCuda();
#endif
}

}  // namespace

const char* DeviceName(Device d) { return d == Device::kCpu ? "cpu" : "cuda"; }

Result<DeviceChoice> ParseDeviceChoice(std::string_view name) {
  if (name == "auto") return DeviceChoice::kAuto;
  if (name == "cpu") return DeviceChoice::kCpu;
  if (name == "cuda") return DeviceChoice::kCuda;
  return Status::InvalidArgument("device '" + std::string(name) + "' (accepted: auto, cpu, cuda)");
}

const char* DeviceChoiceName(DeviceChoice choice) {
  switch (choice) {
    case DeviceChoice::kAuto:
      return "auto";
    case DeviceChoice::kCpu:
      return "cpu";
    case DeviceChoice::kCuda:
      return "cuda";
  }
  return "?";
}

Result<Device> ResolveDevice(DeviceChoice choice) {
  if (choice == DeviceChoice::kCpu) return Device::kCpu;
  std::string why;
  const bool cuda = CudaAvailable(&why);
  if (choice == DeviceChoice::kAuto) return cuda ? Device::kCuda : Device::kCpu;
  if (!cuda) {
    return Status::Unavailable("--device cuda: no usable GPU (" + why + "); use --device cpu");
  }
  return Device::kCuda;
}

bool CudaAvailable(std::string* why) {
#if CPD_WITH_CUDA
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    if (why != nullptr) *why = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err);
    return false;
  }
  if (count < 1) {
    if (why != nullptr) *why = "cudaGetDeviceCount found no CUDA device";
    return false;
  }
  return true;
#else
  if (why != nullptr) *why = "this build has no CUDA (CPD_WITH_CUDA=OFF)";
  return false;
#endif
}

int SelectCudaDevice(int hint) {
#if CPD_WITH_CUDA
  int count = 0;
  CPD_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (count < 1) throw std::runtime_error("SelectCudaDevice: no CUDA device");
  const int device = (hint < 0 ? 0 : hint) % count;
  CPD_CUDA_CHECK(cudaSetDevice(device));
  return device;
#else
  (void)hint;
  NoCuda();
#endif
}

std::string CudaDeviceUuid() {
#if CPD_WITH_CUDA
  int device = 0;
  CPD_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop;
  CPD_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return std::string(prop.uuid.bytes, sizeof(prop.uuid.bytes));
#else
  NoCuda();
#endif
}

Tensor OnHost(const Tensor& t) { return t.device() == Device::kCpu ? t : t.To(Device::kCpu); }

Tensor StagedOn(const Tensor& x, Device device, Tensor* staging) {
  if (device == Device::kCpu) return x;
  ResizeOn(staging, x.shape(), device);
  staging->CopyFrom(x);
  return *staging;
}

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

Tensor Tensor::Slice(size_t offset, std::vector<int64_t> shape) const {
  const size_t n = NumelOf(shape);
  if (offset > numel_ || n > numel_ - offset) {
    throw std::invalid_argument("Slice: " + std::to_string(n) + " elements at offset " +
                                std::to_string(offset) + " do not fit in " + ShapeString());
  }
  Tensor t;
  t.shape_ = std::move(shape);
  t.numel_ = n;
  t.device_ = device_;
  t.storage_ = storage_;
  t.data_ = n == 0 ? nullptr : data_ + offset;
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
  CPD_CUDA_CHECK(cudaMemset(data_, 0, numel_ * sizeof(float)));
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
  const cudaMemcpyKind kind =
      src.device_ == Device::kCpu
          ? (device_ == Device::kCpu ? cudaMemcpyHostToHost : cudaMemcpyHostToDevice)
          : (device_ == Device::kCpu ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice);
  CPD_CUDA_CHECK(cudaMemcpy(data_, src.data_, numel_ * sizeof(float), kind));
#else
  throw std::runtime_error("CUDA tensors need a CUDA build");
#endif
}

Tensor Tensor::To(Device device) const {
  Tensor t(shape_, device);
  t.CopyFrom(*this);
  return t;
}

void Tensor::CopyToHost(float* dst) const {
  if (numel_ == 0) return;
  if (device_ == Device::kCpu) {
    std::memcpy(dst, data_, numel_ * sizeof(float));
    return;
  }
#if CPD_WITH_CUDA
  CPD_CUDA_CHECK(cudaMemcpy(dst, data_, numel_ * sizeof(float), cudaMemcpyDeviceToHost));
#endif
}

void Tensor::CopyFromHost(const float* src) {
  if (numel_ == 0) return;
  if (device_ == Device::kCpu) {
    std::memcpy(data_, src, numel_ * sizeof(float));
    return;
  }
#if CPD_WITH_CUDA
  CPD_CUDA_CHECK(cudaMemcpy(data_, src, numel_ * sizeof(float), cudaMemcpyHostToDevice));
#endif
}

std::string Tensor::ShapeString() const { return runtime::ShapeString(shape_); }

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

void ResizeOn(Tensor* t, const std::vector<int64_t>& shape, Device device) {
  if (t->device() != device) {
    *t = Tensor(shape, device);
  } else {
    t->Resize(shape);
  }
}

void RawBuffer::Reserve(size_t bytes, Device device) {
  if (bytes <= bytes_ && device == device_ && data_ != nullptr) return;
  const size_t floats = (bytes + sizeof(float) - 1) / sizeof(float);
  data_ = Allocate(floats, device);
  bytes_ = floats * sizeof(float);
  device_ = device;
}

void RawBuffer::CopyFromHost(const void* src, size_t bytes) {
  if (bytes > bytes_) throw std::invalid_argument("RawBuffer::CopyFromHost: more than reserved");
  if (bytes == 0) return;
  if (device_ == Device::kCpu) {
    std::memcpy(data_.get(), src, bytes);
    return;
  }
#if CPD_WITH_CUDA
  CPD_CUDA_CHECK(cudaMemcpy(data_.get(), src, bytes, cudaMemcpyHostToDevice));
#endif
}

void RawBuffer::CopyToHost(void* dst, size_t bytes) const {
  if (bytes > bytes_) throw std::invalid_argument("RawBuffer::CopyToHost: more than reserved");
  if (bytes == 0) return;
  if (device_ == Device::kCpu) {
    std::memcpy(dst, data_.get(), bytes);
    return;
  }
#if CPD_WITH_CUDA
  CPD_CUDA_CHECK(cudaMemcpy(dst, data_.get(), bytes, cudaMemcpyDeviceToHost));
#endif
}

}  // namespace cpd::runtime
