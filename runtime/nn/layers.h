// The CPU layers of the training engine: Linear, Conv2d, BatchNorm, ReLU, pooling, Flatten,
// Dropout, the Sequential and BasicBlock composites, and the softmax cross-entropy loss.
//
// Contracts shared by every layer here:
//  * Devices: a layer computes where its tensors are, on the CPU (runtime/engine/cpu_ops.h) or, in
//  a
//    CUDA build, on the GPU (runtime/engine/cuda_ops.h: cuBLAS, cuDNN and own kernels). Parameters
//    and buffers start on the CPU; MoveToDevice moves a model. An input (or output gradient) on
//    another device than the layer's parameters, or than its last forward, throws
//    std::invalid_argument naming the layer and both devices; the layers' workspaces follow the
//    device on their own. Shapes that do not fit throw std::invalid_argument as well. CUDA
//    errors throw std::runtime_error (runtime/engine/cuda_ops.h). CUDA layers queue their work on
//    the runtime's stream and return without waiting (SoftmaxCrossEntropy::Forward waits, as it
//    returns the loss).
//  * Inputs are never modified. Forward(x, train = true) keeps a handle to x (not a copy, unless
//    quantisation hooks are installed), so x must stay unchanged until Backward has run.
//  * The tensor returned by Forward (and by Backward) is the layer's own workspace, reused to
//    avoid allocations in the training loop: it stays valid until the next Forward (Backward)
//    call on the same layer. Clone() it to keep it longer. Layers that pass data through
//    (Flatten, Dropout in evaluation) return a handle to their input instead.
//  * Backward needs the state of the last Forward(train = true); after Forward(train = false),
//    Backward throws std::logic_error until the next training forward.
//  * Backward accumulates (+=) into Param::grad; the optimiser zeroes the gradients.
//  * Not thread-safe: one thread drives a model; the CPU layers parallelise internally with
//    OpenMP (omp_get_max_threads()) and call OpenBLAS single-threaded from their parallel
//    regions (oneDNN's convolutions use the same OpenMP threads). Results are deterministic for a
//    fixed thread count (on the GPU: for a given GPU and build). CPU and GPU agree bit for bit
//    where the result is defined exactly (ReLU, pooling, dropout masks, residual adds, the
//    quantisation sites) and to float32 rounding where a sum's order differs (GEMMs, convolutions,
//    batch statistics, the loss).
//
// Initialisation follows PyTorch's defaults in distribution (Linear and Conv2d weights and
// biases ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)), i.e. kaiming_uniform(a = sqrt(5)); BatchNorm
// gamma = 1, beta = 0) and is a pure function of the layer's seed: std::mt19937_64 (whose
// output sequence the C++ standard fixes) feeds a uniform draw implemented here (not
// std::uniform_real_distribution, whose algorithm varies between standard libraries), so the
// same seed gives bit-identical weights on every machine and run of the same build.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "runtime/engine/cpu_ops.h"
#include "runtime/engine/tensor.h"
#include "runtime/nn/layer.h"

namespace cpd::runtime {

class ShapedLayer;

// One row of a model's static shape trace (see ShapedLayer::TraceShapes).
struct LayerShapeRecord {
  Layer* layer = nullptr;
  std::vector<int64_t> input, output;  // batch dimension included
  double macs = 0;                     // multiply-accumulates of one forward pass
};

// The base of every layer in this file: a Layer that can also compute its output shape and
// forward cost without running. (An addition next to Layer rather than inside it, so that
// runtime/nn/layer.h stays as it is.)
class ShapedLayer : public Layer {
 public:
  using Layer::Layer;
  // Output shape for an input of shape `in`; throws std::invalid_argument naming the layer
  // and the shapes when `in` does not fit.
  virtual std::vector<int64_t> OutputShape(const std::vector<int64_t>& in) const = 0;
  // Multiply-accumulates of one forward pass on an input of shape `in` (0 without a GEMM).
  virtual double ForwardMacs(const std::vector<int64_t>& /*in*/) const { return 0; }
  // Appends one record per layer of this subtree, in Flatten() order, and returns the output
  // shape. Composites override (a composite's own record sums its descendants' MACs).
  virtual std::vector<int64_t> TraceShapes(const std::vector<int64_t>& in,
                                           std::vector<LayerShapeRecord>* out);
};

// y = x W^T + b for x [N, in], W [out, in], b [out]; an input of higher rank [N, ..., in] is
// the matrix [N * ..., in] (output [N, ..., out]), as torch.nn.Linear. Quantisable: with hooks
// installed, the forward uses A = QuantizeActivation(x into a workspace) and
// W = QuantizeWeight(master), the backward E = QuantizeError(dy into a workspace), W for dx, and
// G = QuantizeWeightGrad(dW) before dW is added to weight.grad (the bias gradient is not
// quantised).
class Linear : public ShapedLayer {
 public:
  Linear(std::string name, int64_t in, int64_t out, bool bias = true, uint64_t seed = 0);
  // A Linear without bias whose weight is another layer's parameter (a language model's output
  // head tied to the token embedding, [vocab, embed]): Params() is empty (the owner lists the
  // parameter, and MoveToDevice moves it), the backward accumulates into tied_weight->grad.
  // REQUIRED: tied_weight is a matrix [out, in] and outlives this layer.
  Linear(std::string name, Param* tied_weight);

  const char* kind() const override { return "Linear"; }
  std::string Describe() const override;
  Tensor Forward(const Tensor& x, bool train) override;
  Tensor Backward(const Tensor& dy) override;
  std::vector<Param*> Params() override;
  bool Quantizable() const override { return true; }
  std::vector<int64_t> OutputShape(const std::vector<int64_t>& in) const override;
  double ForwardMacs(const std::vector<int64_t>& in) const override;

  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  Param& weight() { return tied_ != nullptr ? *tied_ : weight_; }
  Param* bias() { return has_bias_ ? &bias_ : nullptr; }
  bool tied() const { return tied_ != nullptr; }

 private:
  int64_t in_, out_;
  bool has_bias_;
  Param weight_, bias_;
  Param* tied_ = nullptr;  // the weight in use when tied (not owned)
  bool ready_ = false;
  // dw_ from the weight-gradient product's operands transformed (QuantHooks::
  // WeightGradTransform): T x (x_raw_, the input before A) and T dy, each then quantised.
  void TransformedWeightGrad(const HadamardOptions& t, int64_t n, const Tensor& dy);

  Tensor x_saved_, w_saved_;  // what the last training forward used (handles)
  Tensor x_raw_;              // the input before A, kept while a weight-gradient transform is on
  Tensor x_q_, w_q_, dy_q_;   // hook copies
  Tensor xt_, dyt_;           // the transformed operands of the weight gradient
  Tensor y_, dx_, dw_, db_;   // workspaces
};

// 2-D convolution, NCHW: x [N, in, H, W], W [out, in, k, k], b [out], square kernel, equal
// stride and zero padding in both dimensions. On the CPU each shape takes one of three paths
// (cpu::Conv2dPath): CPD's direct AVX-512 kernels (3x3, stride 1, padding 1 on suitable widths
// and CPUs), oneDNN's primitives (builds with CPD_WITH_DNNL, where they measured faster), or
// im2col + OpenBLAS GEMMs. Quantisable, with the hook sites of Linear.
class Conv2d : public ShapedLayer {
 public:
  Conv2d(std::string name, int64_t in_channels, int64_t out_channels, int64_t kernel,
         int64_t stride = 1, int64_t padding = 0, bool bias = true, uint64_t seed = 0);

  const char* kind() const override { return "Conv2d"; }
  std::string Describe() const override;
  Tensor Forward(const Tensor& x, bool train) override;
  Tensor Backward(const Tensor& dy) override;
  std::vector<Param*> Params() override;
  bool Quantizable() const override { return true; }
  std::vector<int64_t> OutputShape(const std::vector<int64_t>& in) const override;
  double ForwardMacs(const std::vector<int64_t>& in) const override;

  int64_t in_channels() const { return in_; }
  int64_t out_channels() const { return out_; }
  int64_t kernel() const { return k_; }
  int64_t stride() const { return stride_; }
  int64_t padding() const { return pad_; }
  Param& weight() { return weight_; }
  Param* bias() { return has_bias_ ? &bias_ : nullptr; }

 private:
  cpu::ConvShape ShapeFor(const std::vector<int64_t>& in) const;  // throws on a misfit

  int64_t in_, out_, k_, stride_, pad_;
  bool has_bias_;
  Param weight_, bias_;
  bool ready_ = false;
  cpu::ConvShape saved_shape_;
  Tensor x_saved_, w_saved_;
  Tensor x_q_, w_q_, dy_q_;
  Tensor y_, dx_, dw_, db_;
  cpu::ConvWorkspace ws_;
};

// Batch normalisation over the channel dimension of [N, C, H, W] (per channel over N, H, W)
// or [N, C] inputs (per feature over N). Training: normalises with the batch mean and biased
// variance and updates running_mean/running_var with `momentum` (the running variance takes
// the unbiased batch variance), as torch.nn.BatchNorm2d/1d do. Evaluation: normalises with
// the running statistics. Params gamma (1) and beta (0) carry weight_decay = false; Buffers
// running_mean (0) and running_var (1). Training needs more than one value per channel.
class BatchNorm : public ShapedLayer {
 public:
  BatchNorm(std::string name, int64_t channels, float eps = 1e-5f, float momentum = 0.1f);

  const char* kind() const override { return "BatchNorm"; }
  std::string Describe() const override;
  Tensor Forward(const Tensor& x, bool train) override;
  Tensor Backward(const Tensor& dy) override;
  std::vector<Param*> Params() override;
  std::vector<std::pair<std::string, Tensor*>> Buffers() override;
  std::vector<int64_t> OutputShape(const std::vector<int64_t>& in) const override;

  // With fused_relu, the layer computes relu(batchnorm(x)) in one pass (and the matching
  // backward); BasicBlock uses this for bn1. Off by default.
  void set_fused_relu(bool on) { fused_relu_ = on; }
  bool fused_relu() const { return fused_relu_; }

  int64_t channels() const { return c_; }
  Param& gamma() { return gamma_; }
  Param& beta() { return beta_; }
  Tensor& running_mean() { return running_mean_; }
  Tensor& running_var() { return running_var_; }

 private:
  int64_t c_;
  float eps_, momentum_;
  bool fused_relu_ = false;
  Param gamma_, beta_;
  Tensor running_mean_, running_var_;
  bool ready_ = false;
  Tensor x_saved_;
  Tensor mean_, var_, invstd_;  // batch statistics of the last training forward
  Tensor y_, dx_, dgamma_, dbeta_;
};

// y = max(x, 0) (NaN propagates); the backward passes dy where y > 0.
class ReLU : public ShapedLayer {
 public:
  explicit ReLU(std::string name) : ShapedLayer(std::move(name)) {}
  const char* kind() const override { return "ReLU"; }
  std::string Describe() const override { return "ReLU"; }
  Tensor Forward(const Tensor& x, bool train) override;
  Tensor Backward(const Tensor& dy) override;
  std::vector<int64_t> OutputShape(const std::vector<int64_t>& in) const override;

 private:
  bool ready_ = false;
  Tensor y_, dx_;
};

// What max and average pooling share: k x k windows with the given stride (default k), no
// padding, NCHW; output size (H - k) / stride + 1.
class Pool2d : public ShapedLayer {
 public:
  std::string Describe() const override;
  std::vector<int64_t> OutputShape(const std::vector<int64_t>& in) const override;

 protected:
  Pool2d(std::string name, const char* kind, int64_t kernel, int64_t stride);  // stride 0: = k

  int64_t k_, stride_;
  bool ready_ = false;
  std::vector<int64_t> in_shape_;
  Tensor y_, dx_;
};

// Max pooling. The gradient goes to the first maximum of each window.
class MaxPool2d : public Pool2d {
 public:
  MaxPool2d(std::string name, int64_t kernel, int64_t stride = 0);  // stride 0: = kernel
  const char* kind() const override { return "MaxPool2d"; }
  Tensor Forward(const Tensor& x, bool train) override;
  Tensor Backward(const Tensor& dy) override;

 private:
  std::vector<int32_t> argmax_;  // CPU: index within its input plane of each output's maximum
  RawBuffer argmax_dev_;         // the same on the GPU (int32)
};

// Average pooling.
class AvgPool2d : public Pool2d {
 public:
  AvgPool2d(std::string name, int64_t kernel, int64_t stride = 0);  // stride 0: = kernel
  const char* kind() const override { return "AvgPool2d"; }
  Tensor Forward(const Tensor& x, bool train) override;
  Tensor Backward(const Tensor& dy) override;
};

// Mean over the spatial positions: [N, C, H, W] -> [N, C].
class GlobalAvgPool : public ShapedLayer {
 public:
  explicit GlobalAvgPool(std::string name) : ShapedLayer(std::move(name)) {}
  const char* kind() const override { return "GlobalAvgPool"; }
  std::string Describe() const override { return "GlobalAvgPool"; }
  Tensor Forward(const Tensor& x, bool train) override;
  Tensor Backward(const Tensor& dy) override;
  std::vector<int64_t> OutputShape(const std::vector<int64_t>& in) const override;

 private:
  bool ready_ = false;
  std::vector<int64_t> in_shape_;
  Tensor y_, dx_;
};

// [N, d1, d2, ...] -> [N, d1 * d2 * ...] (a view: no copy in either direction).
class Flatten : public ShapedLayer {
 public:
  explicit Flatten(std::string name) : ShapedLayer(std::move(name)) {}
  const char* kind() const override { return "Flatten"; }
  std::string Describe() const override { return "Flatten"; }
  Tensor Forward(const Tensor& x, bool train) override;
  Tensor Backward(const Tensor& dy) override;
  std::vector<int64_t> OutputShape(const std::vector<int64_t>& in) const override;

 private:
  bool ready_ = false;
  std::vector<int64_t> in_shape_;
};

// Inverted dropout with probability p in [0, 1). In training, element i (flat index in the
// input) is kept iff kernels::RandomBits(kernels::MakeRandomKey(seed, step), i) >= p * 2^32,
// and kept elements are scaled by 1 / (1 - p); `step` is the last SetStep value, so a run
// resumed at the same step draws the same masks. Identity in evaluation.
class Dropout : public ShapedLayer {
 public:
  Dropout(std::string name, double p, uint64_t seed);
  const char* kind() const override { return "Dropout"; }
  std::string Describe() const override;
  Tensor Forward(const Tensor& x, bool train) override;
  Tensor Backward(const Tensor& dy) override;
  void SetStep(uint64_t step) override { step_ = step; }
  std::vector<int64_t> OutputShape(const std::vector<int64_t>& in) const override { return in; }

  // The keep threshold: elements with RandomBits >= threshold() are kept.
  uint32_t threshold() const { return threshold_; }
  // The mask key a training Forward draws at the current step (element i is kept iff
  // kernels::RandomBits(MaskKey(), i) >= threshold()) and the scale 1 / (1 - p) of the kept
  // elements: for a fused caller that applies this layer's mask itself.
  uint64_t MaskKey() const;
  float scale() const { return scale_; }

 private:
  double p_;
  uint64_t seed_;
  uint32_t threshold_;
  float scale_;
  uint64_t step_ = 0;
  bool ready_ = false;
  bool identity_ = false;  // the last training forward passed x through (p = 0)
  uint64_t key_ = 0;       // the mask key of the last training forward
  Tensor y_, dx_;
};

// Children run in order; Backward in reverse. Params, Buffers, Flatten (pre-order: itself,
// then each child's subtree), SetStep and SetQuantHooks recurse. Quantizable() is false: a
// composite is not itself a quantisation site (SetQuantHooks installs the hooks on every
// quantisable descendant).
class Sequential : public ShapedLayer {
 public:
  explicit Sequential(std::string name) : ShapedLayer(std::move(name)) {}

  // Appends a child and returns it. REQUIRED: non-null.
  Layer* Add(std::unique_ptr<Layer> layer);
  template <typename T, typename... Args>
  T* Emplace(Args&&... args) {
    return static_cast<T*>(Add(std::make_unique<T>(std::forward<Args>(args)...)));
  }
  size_t size() const { return children_.size(); }
  Layer* child(size_t i) const { return children_.at(i).get(); }

  // The shape of one example ([C, H, W] or [features]) that the model was built for, if known
  // (BuildModel records it); DescribeModel uses it to print output shapes.
  void set_input_shape(std::vector<int64_t> shape) { input_shape_ = std::move(shape); }
  const std::vector<int64_t>& input_shape() const { return input_shape_; }

  const char* kind() const override { return "Sequential"; }
  std::string Describe() const override;
  Tensor Forward(const Tensor& x, bool train) override;
  Tensor Backward(const Tensor& dy) override;
  std::vector<Param*> Params() override;
  std::vector<std::pair<std::string, Tensor*>> Buffers() override;
  void SetQuantHooks(QuantHooks* hooks) override;
  std::vector<Layer*> Flatten() override;
  void SetStep(uint64_t step) override;
  // Throws std::invalid_argument if a child is not a ShapedLayer.
  std::vector<int64_t> OutputShape(const std::vector<int64_t>& in) const override;
  std::vector<int64_t> TraceShapes(const std::vector<int64_t>& in,
                                   std::vector<LayerShapeRecord>* out) override;

 private:
  std::vector<std::unique_ptr<Layer>> children_;
  std::vector<int64_t> input_shape_;
};

// The basic residual block of the CIFAR ResNets (He et al., "Deep Residual Learning for Image
// Recognition", CVPR 2016, section 4.2):
//   out = relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)),
// conv1 3x3 with the block's stride, conv2 3x3 stride 1 (both padding 1, no bias); bn1 runs
// with its ReLU fused (BatchNorm::set_fused_relu). The
// shortcut is the identity when stride = 1 and in = out channels, else a projection
// (1x1 conv with the stride, no bias, then BatchNorm: He et al.'s option B). Children are
// named <name>.conv1, .bn1, .conv2, .bn2, .shortcut.conv, .shortcut.bn; Flatten returns the
// block, then them in that order. Child X is initialised with LayerSeed(seed, X's name), so a
// block built with the model's seed initialises its convolutions as top-level layers would.
class BasicBlock : public ShapedLayer {
 public:
  BasicBlock(std::string name, int64_t in_channels, int64_t out_channels, int64_t stride,
             uint64_t seed);

  const char* kind() const override { return "BasicBlock"; }
  std::string Describe() const override;
  Tensor Forward(const Tensor& x, bool train) override;
  Tensor Backward(const Tensor& dy) override;
  std::vector<Param*> Params() override;
  std::vector<std::pair<std::string, Tensor*>> Buffers() override;
  void SetQuantHooks(QuantHooks* hooks) override;
  std::vector<Layer*> Flatten() override;
  std::vector<int64_t> OutputShape(const std::vector<int64_t>& in) const override;
  std::vector<int64_t> TraceShapes(const std::vector<int64_t>& in,
                                   std::vector<LayerShapeRecord>* out) override;

  bool has_projection() const { return sc_conv_ != nullptr; }
  Conv2d& conv1() { return *conv1_; }
  Conv2d& conv2() { return *conv2_; }
  BatchNorm& bn1() { return *bn1_; }
  BatchNorm& bn2() { return *bn2_; }
  Conv2d* shortcut_conv() { return sc_conv_.get(); }
  BatchNorm* shortcut_bn() { return sc_bn_.get(); }

 private:
  std::vector<ShapedLayer*> Children() const;

  int64_t in_, out_, stride_;
  std::unique_ptr<Conv2d> conv1_, conv2_, sc_conv_;
  std::unique_ptr<BatchNorm> bn1_, bn2_, sc_bn_;
  bool ready_ = false;
  Tensor y_, g_, dx_;  // the block output, the gradient at the residual join, dL/dx
};

// Mean softmax cross-entropy over a batch of logits [N, classes] with integer labels in
// [0, classes). Not a Layer: it ends the forward pass and starts the backward pass.
class SoftmaxCrossEntropy {
 public:
  // Returns the mean loss and, when dlogits is non-null, resizes it to the logits' shape on the
  // logits' device and writes dL/dlogits = (softmax - onehot) / N. The labels are host memory
  // whatever the logits' device. Throws std::invalid_argument on a label outside [0, classes)
  // or a label count other than N.
  float Forward(const Tensor& logits, const std::vector<int32_t>& labels, Tensor* dlogits);
  // The number of rows whose argmax (first on ties) equals the label (CUDA logits are copied
  // to the host for it).
  static int64_t CountCorrect(const Tensor& logits, const std::vector<int32_t>& labels);
};

// A normal draw N(0, std^2) per element from `gen` by the Box-Muller transform over the same
// 24-bit uniform draw: for each pair, u1 = ((gen() >> 40) + 1) / 2^24 in (0, 1] and
// u2 = (gen() >> 40) / 2^24, r = sqrt(-2 ln u1), values r cos(2 pi u2) and r sin(2 pi u2) (an odd
// count drops the last sine), each times std and rounded once to float. Used for GPT-2's
// initialisation; machine-independent, unlike std::normal_distribution.
void FillNormal(Tensor* t, float std, std::mt19937_64* gen);

// The uniform initialisation of Linear and Conv2d: fills `t` with U(-bound, bound), one draw
// per element from `gen`: u = (gen() >> 40) / 2^24 in [0, 1), value = (2u - 1) * bound,
// rounded once to float (machine-independent, unlike std::uniform_real_distribution).
void FillUniform(Tensor* t, float bound, std::mt19937_64* gen);

// Moves every parameter (value and gradient) and buffer of `model` (its whole subtree) to
// `device`, leaving those already there untouched. Workspaces follow on the next call. The
// pointers Params() and Buffers() return stay valid; the tensors they point to are new.
// Throws std::runtime_error where the device cannot be used (a CUDA device in a build without
// CUDA, a failed allocation).
void MoveToDevice(Layer* model, Device device);

// The initialisation seed of the layer called `name` in a model built with `seed`: a hash of
// both, so that a layer's initial weights depend on its name only, not on its position.
uint64_t LayerSeed(uint64_t seed, const std::string& name);

}  // namespace cpd::runtime
