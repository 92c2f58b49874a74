// A dense float32 tensor (row-major; images are NCHW) in CPU or CUDA memory.
//
// Copying a Tensor copies the handle, not the data (like a shared_ptr); use Clone() for a deep
// copy. Storage is 64-byte aligned on the CPU. Not thread-safe for concurrent mutation.
//
// CUDA tensors (Device::kCuda, only in a CUDA build) live on the current device. Their copies
// (CopyFrom, To, CopyToHost, CopyFromHost, Fill) run on the legacy default stream and return
// when the data has arrived; Zero is queued on that stream. The runtime's kernels run on a
// blocking stream (runtime/engine/cuda_ops.h), which the legacy default stream orders against, so a
// copy sees every kernel queued before it and vice versa. CUDA failures throw
// std::runtime_error naming the call and the CUDA error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cpd/status.h"

namespace cpd::runtime {

enum class Device { kCpu, kCuda };
const char* DeviceName(Device d);

// What a user asks for: a device, or the best one present.
enum class DeviceChoice { kAuto, kCpu, kCuda };
// "auto" | "cpu" | "cuda"; else InvalidArgument "device 'NAME' (accepted: auto, cpu, cuda)".
Result<DeviceChoice> ParseDeviceChoice(std::string_view name);
const char* DeviceChoiceName(DeviceChoice choice);
// kAuto: CUDA when CudaAvailable(), else the CPU. kCuda without a usable GPU: Unavailable,
// naming the reason.
Result<Device> ResolveDevice(DeviceChoice choice);

// Whether CUDA tensors can be made here: the build has CUDA and cudaGetDeviceCount finds a
// device. When false, `why` (may be null) receives a one-line reason ("this build has no CUDA",
// "cudaGetDeviceCount: no CUDA-capable device is detected", ...).
bool CudaAvailable(std::string* why = nullptr);
// Makes GPU (hint mod device count) this process's device, so that the ranks of a node spread
// over its GPUs. Call before the first CUDA tensor. Returns the device chosen; throws
// std::runtime_error when CUDA is unavailable or cudaSetDevice fails.
int SelectCudaDevice(int hint);
// The 16-byte UUID of this process's current GPU (cudaDeviceProp::uuid), which tells whether
// ranks share a GPU. Throws std::runtime_error when CUDA is unavailable.
std::string CudaDeviceUuid();

class Tensor {
 public:
  Tensor() = default;
  // Zero-filled tensor of the given shape. Throws std::bad_alloc on exhaustion; a kCuda tensor
  // in a build without CUDA, or a failed cudaMalloc, throws std::runtime_error.
  explicit Tensor(std::vector<int64_t> shape, Device device = Device::kCpu);

  const std::vector<int64_t>& shape() const { return shape_; }
  int ndim() const { return int(shape_.size()); }
  int64_t dim(int i) const { return shape_.at(size_t(i < 0 ? i + ndim() : i)); }
  size_t numel() const { return numel_; }
  bool empty() const { return numel_ == 0; }
  Device device() const { return device_; }
  float* data() { return data_; }
  const float* data() const { return data_; }

  // Same data, new shape with the same number of elements.
  Tensor Reshaped(std::vector<int64_t> shape) const;
  // A view of NumelOf(shape) elements starting `offset` elements in (same storage, same
  // device). Throws std::invalid_argument when the view does not fit.
  Tensor Slice(size_t offset, std::vector<int64_t> shape) const;
  // Reallocates only when the element count changes; contents are unspecified afterwards.
  void Resize(std::vector<int64_t> shape);
  void Zero();
  void Fill(float v);
  Tensor Clone() const;
  // Copies values from `src` (same numel; any devices).
  void CopyFrom(const Tensor& src);
  Tensor To(Device device) const;
  // numel() floats to / from host memory (any device; a CPU tensor copies with memcpy).
  void CopyToHost(float* dst) const;
  void CopyFromHost(const float* src);

  std::string ShapeString() const;  // "[128, 1, 28, 28]"

 private:
  std::vector<int64_t> shape_;
  size_t numel_ = 0;
  Device device_ = Device::kCpu;
  std::shared_ptr<float> storage_;
  float* data_ = nullptr;
};

size_t NumelOf(const std::vector<int64_t>& shape);

// `t` itself when it is in host memory, else a host copy (for code that reads values on the CPU:
// checkpoints, hashes, collectives over host memory).
Tensor OnHost(const Tensor& t);
// `x` itself on the CPU; else `x` copied into *staging on `device` (reshaped there as needed, so
// a caller that keeps `staging` reuses its memory from call to call).
Tensor StagedOn(const Tensor& x, Device device, Tensor* staging);
// "[128, 1, 28, 28]" (Tensor::ShapeString, and the layers' shape messages).
std::string ShapeString(const std::vector<int64_t>& shape);

// Shapes `t` as `shape` on `device`: like Resize, but a tensor on another device is replaced
// by a new (zero-filled) one there. The layers keep their workspaces with it, so that a model
// moved between devices takes its scratch memory along on the next call.
void ResizeOn(Tensor* t, const std::vector<int64_t>& shape, Device device);

// Untyped memory on a device, grown on demand (index arrays and small tables that sit next to
// float tensors, e.g. MaxPool's argmax on the GPU). Contents are unspecified after a Reserve
// that grows. Copying shares the memory.
class RawBuffer {
 public:
  RawBuffer() = default;
  // Ensures at least `bytes` bytes on `device` (reallocating when smaller or elsewhere).
  void Reserve(size_t bytes, Device device);
  void* data() const { return data_.get(); }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  // `bytes` (<= bytes()) from / to host memory, as Tensor's copies do.
  void CopyFromHost(const void* src, size_t bytes);
  void CopyToHost(void* dst, size_t bytes) const;

 private:
  std::shared_ptr<float> data_;
  size_t bytes_ = 0;
  Device device_ = Device::kCpu;
};

}  // namespace cpd::runtime
