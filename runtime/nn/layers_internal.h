// Internal to the layers of runtime/nn (layers.h, the Transformer layers of embedding.h,
// normalization.h, attention.h, transformer.h, and the LSTM of recurrent.h): the dispatch between
// the CPU and CUDA math, and the checks and messages the layers share, and the quantisation sites.
// Not part of the public interface.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cpd/config.h"
#include "runtime/engine/tensor.h"
#include "runtime/nn/layer.h"
#include "runtime/nn/layers.h"
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

// The quantisation sites (runtime/nn/layer.h's QuantHooks). Without hooks each returns its
// input untouched; with hooks, A, W and E fill the layer's workspace (x_q, w_q, dy_q) and return
// it, G rewrites dw in place. A hook that changes a shape or device throws std::logic_error.
Tensor ActivationSite(const Layer& layer, QuantHooks* hooks, const Tensor& x, Tensor* x_q);
Tensor WeightSite(const Layer& layer, QuantHooks* hooks, const Tensor& w_master, Tensor* w_q);
// A, then W (the order Linear and Conv2d call them in).
std::pair<Tensor, Tensor> ForwardSites(const Layer& layer, QuantHooks* hooks, const Tensor& x,
                                       const Tensor& w_master, Tensor* x_q, Tensor* w_q);
Tensor ErrorSite(const Layer& layer, QuantHooks* hooks, const Tensor& dy, Tensor* dy_q);
void WeightGradSite(const Layer& layer, QuantHooks* hooks, Tensor* dw);
// The hooks' accumulation of the layer's products (null without hooks or without --accumulate).
const kernels::Accumulation* ProductAccumulation(QuantHooks* hooks, const Layer& layer);
// Throws std::runtime_error, naming the layer and `what`, where the hooks ask for an emulated
// accumulation that these products cannot do.
void RefuseAccumulation(QuantHooks* hooks, const Layer& layer, const char* what);

// A zero-filled parameter "name" of the given shape with its gradient.
Param MakeParam(const std::string& name, std::vector<int64_t> shape, bool weight_decay);

// A leaf layer's row of a shape trace (ShapedLayer::TraceShapes).
std::vector<int64_t> TraceLeaf(ShapedLayer* layer, const std::vector<int64_t>& in,
                               std::vector<LayerShapeRecord>* out);

}  // namespace cpd::runtime::internal
