// Layer normalisation and the GELU activation of a Transformer block (GPT-2; nanoGPT's
// nn.LayerNorm and nn.GELU()). Contracts as in runtime/nn/layers.h (on the CPU, or on a GPU
// through runtime/engine/cuda_transformer.h: LayerNorm where its parameters live, GELU where its
// input lives). Neither is a quantisation site.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/nn/layers.h"

namespace cpd::runtime {

// Normalises each vector along the last dimension (size `features`) of an input [..., features]
// with its mean and biased variance, y = (x - mean) / sqrt(var + eps) * gamma + beta, as
// torch.nn.LayerNorm(features, eps) does (eps 1e-5 by default, as PyTorch's). Params "NAME.weight"
// (gamma, 1) and "NAME.bias" (beta, 0), named as nanoGPT's so that weights map one to one, both
// without weight decay. No running statistics: training and evaluation compute the same.
class LayerNorm : public ShapedLayer {
 public:
  LayerNorm(std::string name, int64_t features, float eps = 1e-5f);

  const char* kind() const override { return "LayerNorm"; }
  std::string Describe() const override;
  Tensor Forward(const Tensor& x, bool train) override;
  Tensor Backward(const Tensor& dy) override;
  std::vector<Param*> Params() override { return {&gamma_, &beta_}; }
  std::vector<int64_t> OutputShape(const std::vector<int64_t>& in) const override;

  int64_t features() const { return c_; }
  Param& gamma() { return gamma_; }
  Param& beta() { return beta_; }

 private:
  int64_t c_;
  float eps_;
  Param gamma_, beta_;
  bool ready_ = false;
  Tensor x_saved_;
  Tensor mean_, rstd_;  // per row, from the last forward
  Tensor y_, dx_, dgamma_, dbeta_;
};

// y = x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)), the exact GELU (Hendrycks and Gimpel, "Gaussian
// Error Linear Units", 2016), which is torch.nn.GELU()'s default (approximate='none'), not the
// tanh approximation. Any input shape.
class GELU : public ShapedLayer {
 public:
  explicit GELU(std::string name) : ShapedLayer(std::move(name)) {}
  const char* kind() const override { return "GELU"; }
  std::string Describe() const override { return "GELU (erf)"; }
  Tensor Forward(const Tensor& x, bool train) override;
  Tensor Backward(const Tensor& dy) override;
  std::vector<int64_t> OutputShape(const std::vector<int64_t>& in) const override { return in; }

 private:
  bool ready_ = false;
  Tensor x_saved_;
  Tensor y_, dx_;
};

}  // namespace cpd::runtime
