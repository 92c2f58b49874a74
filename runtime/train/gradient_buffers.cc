#include "runtime/train/gradient_buffers.h"

#include <limits>
#include <stdexcept>

#include "cpd/config.h"
#if CPD_WITH_CUDA
#include "runtime/engine/cuda_ops.h"
#endif

namespace cpd::runtime {

GradientBuffers::GradientBuffers(const std::vector<Param*>& params, Device device)
    : device_(device) {
  size_t total = 0;
  for (const Param* p : params) total += p->grad.numel();
  flat_ = Tensor({int64_t(total)}, device_);
  size_t offset = 0;
  for (Param* p : params) {
    p->grad = flat_.Slice(offset, p->grad.shape());
    offset += p->grad.numel();
  }
}

void GradientBuffers::PlaceReducerInputs(comm::MemorySpace memory, int local_workers) {
  if (memory == comm::MemorySpace::kDevice && device_ == Device::kCpu) {
    throw std::invalid_argument("GradientBuffers: device-memory all-reduce inputs need a GPU");
  }
  memory_ = memory;
  copies_.clear();
  input_ptrs_.clear();
  const bool flat_in_memory = (device_ == Device::kCpu) == (memory_ == comm::MemorySpace::kHost);
  if (local_workers == 1 && flat_in_memory) {
    input_ptrs_.push_back(flat_.data());
    return;
  }
  const Device where = memory_ == comm::MemorySpace::kHost ? Device::kCpu : device_;
  for (int k = 0; k < local_workers; ++k) {
    copies_.emplace_back(flat_.shape(), where);
    input_ptrs_.push_back(copies_.back().data());
  }
}

void GradientBuffers::KeepWorkerGradients(int k) {
  if (!copies_.empty()) copies_[size_t(k)].CopyFrom(flat_);  // every gradient in one copy
}

void GradientBuffers::PutNaNIntoInput(int k) {
  Tensor& input = copies_.empty() ? flat_ : copies_[size_t(k)];
  if (input.numel() > 0) input.Slice(0, {1}).Fill(std::numeric_limits<float>::quiet_NaN());
}

void GradientBuffers::LoadAverage(int workers, float loss_scale) {
  const float factor = 1.0f / float(workers) / loss_scale;
  const size_t n = flat_.numel();
  float* sum = input_ptrs_[0];
  if (memory_ == comm::MemorySpace::kDevice) {
#if CPD_WITH_CUDA
    cuda::Scale(n, factor, sum, flat_.data());  // the CPU's float products, on the device
#endif
    return;
  }
  // On a GPU with host inputs: the products in the host sum, then one copy to the device.
  float* out = device_ == Device::kCpu ? flat_.data() : sum;
  for (size_t i = 0; i < n; ++i) out[i] = sum[i] * factor;
  if (device_ != Device::kCpu) flat_.CopyFromHost(sum);
}

}  // namespace cpd::runtime
