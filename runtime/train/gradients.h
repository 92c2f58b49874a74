// The gradients of one batch under a precision policy: the one forward/backward entry point,
// shared by training (each worker's part of a step) and by tools that need gradients without an
// optimiser step (the format-quality search of Lee et al.).
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/engine/tensor.h"
#include "runtime/nn/layers.h"
#include "runtime/train/replicas.h"

namespace cpd::runtime {

// The logits as the loss takes them: one row per label. An image model's [N, classes] as they
// are; a language model's [N, T, vocab] as [N * T, vocab] (the same storage), so that the
// cross-entropy is the mean over every token of the batch, as nanoGPT's F.cross_entropy.
Tensor LossRows(const Tensor& logits);

class GradientPass {
 public:
  // `model` (REQUIRED) must outlive the pass; its parameter list is taken now.
  explicit GradientPass(Sequential* model);

  // Zeroes every Param::grad, runs the training forward pass on `x` (on the model's device),
  // softmax cross-entropy against `y` and the backward pass: afterwards each Param::grad holds
  // the gradient of the batch's mean loss, computed through whatever quantisation hooks are
  // installed on the layers (a SiteQuantizer's policy at its current step and worker).
  // Returns the batch's loss sum (mean x labels), correct predictions and label count (a
  // language model has a label per token).
  BatchTotals Run(const Tensor& x, const std::vector<int32_t>& y);

  // Run() in two halves, for callers that reuse one forward pass under several backward
  // policies: Forward runs the training forward pass and the loss and keeps dL/dlogits;
  // Backward zeroes the gradients and runs the backward pass from them. The layers keep what
  // their backward needs from the last training forward, and their backward only reads it, so
  // Backward may run several times after one Forward, each time through the hooks installed
  // then (the error and weight-gradient sites; the activation site acts in Forward).
  BatchTotals Forward(const Tensor& x, const std::vector<int32_t>& y);
  void Backward();

  // The backward pass starts from `scale` x dL/dlogits (loss scaling, runtime/train/loss_scale.h;
  // 1: none), so every gradient it computes is `scale` times the batch's.
  void set_loss_scale(float scale) { loss_scale_ = scale; }

 private:
  Sequential* model_;
  std::vector<Param*> params_;
  SoftmaxCrossEntropy loss_;
  Tensor dlogits_;
  float loss_scale_ = 1;
};

}  // namespace cpd::runtime
