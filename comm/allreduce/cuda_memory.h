// What the host code of the device-memory all-reduce (comm/allreduce/device*.cc) shares: the
// check of every CUDA runtime call (a failure becomes Status::Internal naming file:line, the call
// and cudaGetErrorString) and owning buffers of device and pinned host memory. Only in a CUDA
// build. Internal to comm/.
#pragma once

#include "cpd/config.h"

#if CPD_WITH_CUDA

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "cpd/status.h"

namespace cpd::comm::internal {

inline Status CudaCallStatus(cudaError_t err, const char* file, int line, const char* expr) {
  return Status::Internal(std::string(file) + ":" + std::to_string(line) + ": " + expr + ": " +
                          cudaGetErrorString(err));
}

#define CPD_COMM_CUDA_CHECK(expr)                                                             \
  do {                                                                                        \
    const cudaError_t cpd_comm_err_ = (expr);                                                 \
    if (cpd_comm_err_ != cudaSuccess) {                                                       \
      return ::cpd::comm::internal::CudaCallStatus(cpd_comm_err_, __FILE__, __LINE__, #expr); \
    }                                                                                         \
  } while (0)

// `count` elements of T in device memory (cudaMalloc) or pinned host memory (cudaMallocHost),
// at least one element's worth so that data() is never null. Freed by the destructor (whose
// errors cannot be reported and are ignored).
template <typename T, bool kPinned>
class CudaArray {
 public:
  CudaArray() = default;
  ~CudaArray() { Free(); }
  CudaArray(const CudaArray&) = delete;
  CudaArray& operator=(const CudaArray&) = delete;

  Status Allocate(std::size_t count) {
    Free();
    const std::size_t bytes = (count > 0 ? count : 1) * sizeof(T);
    void* p = nullptr;
    if constexpr (kPinned) {
      CPD_COMM_CUDA_CHECK(cudaMallocHost(&p, bytes));
    } else {
      CPD_COMM_CUDA_CHECK(cudaMalloc(&p, bytes));
    }
    data_ = static_cast<T*>(p);
    count_ = count;
    return Status::Ok();
  }
  T* data() const { return data_; }
  std::size_t count() const { return count_; }
  std::size_t bytes() const { return count_ * sizeof(T); }

 private:
  void Free() {
    if (data_ == nullptr) return;
    if constexpr (kPinned) {
      cudaFreeHost(data_);
    } else {
      cudaFree(data_);
    }
    data_ = nullptr;
    count_ = 0;
  }
  T* data_ = nullptr;
  std::size_t count_ = 0;
};

template <typename T>
using DeviceArray = CudaArray<T, false>;
template <typename T>
using PinnedArray = CudaArray<T, true>;

}  // namespace cpd::comm::internal

#endif  // CPD_WITH_CUDA
