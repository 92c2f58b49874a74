// Layers with explicit forward and backward passes, the parameters they own, and the hooks
// through which the trainer quantises the four data flows of a layer (Lee et al., ICLR 2022):
// W (weights as used in forward), A (the layer's input activation), E (error: gradient w.r.t.
// the layer's output) and G (weight gradient).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cpd/transform.h"
#include "kernels/accumulate.h"
#include "runtime/engine/tensor.h"

namespace cpd::runtime {

// A trainable tensor: the fp32 master value and its gradient (same shape).
struct Param {
  std::string name;  // "<layer>.weight", "<layer>.bias", "<bn>.gamma", "<bn>.beta"
  Tensor value;
  Tensor grad;
  bool weight_decay = true;  // false for biases and BatchNorm parameters
};

class Layer;

// Called by quantisable layers (Linear, Conv2d) at the four sites. A and E are quantised out of
// place (into the layer's workspace, in one pass); W fills a workspace from the master; G is
// rewritten in place. The trainer installs one per layer; null means fp32 everywhere.
class QuantHooks {
 public:
  virtual ~QuantHooks() = default;
  // W: fill `w_used` (already shaped like the master) from the fp32 master weight; forward and
  // the input gradient use w_used.
  virtual void QuantizeWeight(const Layer& layer, const Tensor& w_master, Tensor* w_used) = 0;
  // A: fill `x_used` (already shaped like x) from the layer's input x; forward uses x_used
  // and keeps it for backward. x itself is never modified.
  virtual void QuantizeActivation(const Layer& layer, const Tensor& x, Tensor* x_used) = 0;
  // E: fill `dy_used` (shaped like dy) from the incoming gradient dy; backward uses dy_used.
  virtual void QuantizeError(const Layer& layer, const Tensor& dy, Tensor* dy_used) = 0;
  // G: the weight gradient computed by this backward call, before it is added to Param::grad.
  virtual void QuantizeWeightGrad(const Layer& layer, Tensor* dw) = 0;
  // The transform of the weight-gradient product's two operands, if any: a Linear then computes
  // dW from QuantizeError(T dy) and QuantizeActivation(T x), T applied down the rows (the
  // product's sum), with x the input before its A quantisation; dx and the bias gradient keep
  // the untransformed operands.
  virtual std::optional<HadamardOptions> WeightGradTransform(const Layer& layer) const {
    (void)layer;
    return std::nullopt;
  }
  // How the layer's matrix products accumulate (cpd-train --accumulate, kernels/accumulate.h),
  // or null for float32 GEMMs. Layers whose products cannot emulate it refuse a non-null one.
  virtual const kernels::Accumulation* ProductAccumulation(const Layer& layer) const {
    (void)layer;
    return nullptr;
  }
};

class Layer {
 public:
  explicit Layer(std::string name) : name_(std::move(name)) {}
  virtual ~Layer() = default;
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  const std::string& name() const { return name_; }
  virtual const char* kind() const = 0;  // "Linear", "Conv2d", ...
  // One line for --print-model: kind, name, shapes/hyper-parameters.
  virtual std::string Describe() const = 0;

  // Forward on a batch. With train = true, keeps what Backward needs.
  virtual Tensor Forward(const Tensor& x, bool train) = 0;
  // Given dL/dy of the last Forward(train = true), accumulates parameter gradients into
  // Param::grad and returns dL/dx.
  virtual Tensor Backward(const Tensor& dy) = 0;

  // Parameters and non-trainable state (BatchNorm running statistics) for optimisers and
  // checkpoints, in a fixed order. Composite layers return their children's, in order.
  virtual std::vector<Param*> Params() { return {}; }
  virtual std::vector<std::pair<std::string, Tensor*>> Buffers() { return {}; }
  // Layers that take quantisation hooks (Linear, Conv2d) return true; composites recurse.
  virtual bool Quantizable() const { return false; }
  virtual void SetQuantHooks(QuantHooks* hooks) { hooks_ = hooks; }
  // Whether hooks are installed on this layer (SiteQuantizer installs them only on the layers
  // it quantises).
  bool HasQuantHooks() const { return hooks_ != nullptr; }
  // All layers in this subtree, pre-order (itself first). Composites override.
  virtual std::vector<Layer*> Flatten() { return {this}; }
  // The training step about to run: layers that draw random numbers (Dropout) derive them from
  // (seed, step, element index) so that a resumed run repeats them exactly. Composites forward.
  virtual void SetStep(uint64_t /*step*/) {}

 protected:
  QuantHooks* hooks_ = nullptr;

 private:
  std::string name_;
};

}  // namespace cpd::runtime
