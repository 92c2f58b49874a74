// Internal to the layers of runtime/nn/layers.h (layers.cc, layers_parameter_free.cc,
// layers_composite.cc): the dispatch between the CPU and CUDA math, and the checks and messages
// the layers share. Not part of the public interface.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cpd/config.h"
#include "runtime/nn/layer.h"
#include "runtime/engine/tensor.h"
#if CPD_WITH_CUDA
#include "runtime/engine/cuda_ops.h"
#endif

// Runs cpu::CALL, or cuda::CALL (the same function over device pointers, runtime/engine/cuda_ops.h)
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

namespace cpd::runtime::internal {

// "NAME (KIND)", how messages name a layer.
std::string Where(const Layer& layer);

// A layer computes where its parameters live: `t` must be on the same device.
void RequireDevice(const Layer& layer, const Tensor& t, const char* what, Device device);

// Throws std::invalid_argument: the input shape `in` does not fit, `expected` says what would.
[[noreturn]] void Misfit(const Layer& layer, const std::vector<int64_t>& in,
                         const std::string& expected);

// Backward needs the state of a training forward (`ready`).
void RequireReady(const Layer& layer, bool ready);

// dy must match the last training forward's output: its shape and its device.
void RequireShape(const Layer& layer, const Tensor& dy, const std::vector<int64_t>& expected,
                  Device device);

// printf's %g, for hyper-parameters in messages and Describe().
std::string FormatFloat(double v);

}  // namespace cpd::runtime::internal
