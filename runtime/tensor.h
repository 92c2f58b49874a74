// A dense float32 tensor (row-major; images are NCHW) in CPU or CUDA memory.
//
// Copying a Tensor copies the handle, not the data (like a shared_ptr); use Clone() for a deep
// copy. Storage is 64-byte aligned on the CPU. Not thread-safe for concurrent mutation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace cpd::runtime {

enum class Device { kCpu, kCuda };
const char* DeviceName(Device d);

class Tensor {
 public:
  Tensor() = default;
  // Zero-filled tensor of the given shape. Throws std::bad_alloc on exhaustion; a kCuda tensor
  // in a build without CUDA throws std::runtime_error.
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
  // Reallocates only when the element count changes; contents are unspecified afterwards.
  void Resize(std::vector<int64_t> shape);
  void Zero();
  void Fill(float v);
  Tensor Clone() const;
  // Copies values from `src` (same numel; any devices).
  void CopyFrom(const Tensor& src);
  Tensor To(Device device) const;

  std::string ShapeString() const;  // "[128, 1, 28, 28]"

 private:
  std::vector<int64_t> shape_;
  size_t numel_ = 0;
  Device device_ = Device::kCpu;
  std::shared_ptr<float> storage_;
  float* data_ = nullptr;
};

size_t NumelOf(const std::vector<int64_t>& shape);

}  // namespace cpd::runtime
