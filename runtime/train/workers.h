// The K logical workers of one rank (--emulate-ranks K; K = 1 without it). Worker w = rank * K + k
// takes rows [n*k/K, n*(k+1)/K) of this rank's part of the global batch, computes its gradients
// with the shared GradientPass, and leaves them in its own flat buffer: the inputs of the
// gradient all-reducer. BatchNorm running statistics: every worker starts the step from the same
// buffers, and the buffers each worker leaves are kept for the replicas' average
// (Replicas::AverageBuffers).
//
// On a GPU the parameters' gradients are views of one flat device buffer. When the all-reducer
// takes device memory (GradientAllReduceOptions::gradients = kDevice), the gradients stay on the
// GPU: with one worker that buffer itself is the all-reducer's input and output; with K workers
// each worker's gradient is copied into a device buffer of its own. Otherwise they are staged
// through the host, one copy each way per step.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/engine/tensor.h"
#include "runtime/nn/layers.h"
#include "runtime/nn/quant_sites.h"
#include "runtime/train/gradients.h"
#include "runtime/train/replicas.h"

namespace cpd::runtime {

// Makes every parameter's gradient of a model on a GPU a view of one flat device buffer, which
// it returns. Call after MoveToDevice and before an Optimizer is built over the parameters.
Tensor UseFlatGradients(Sequential* model, Device device);

struct WorkerGroup {
  int rank = 0;
  int local_workers = 1;  // K
  int workers = 1;        // W, over all ranks
};

class LocalWorkers {
 public:
  // `model` and `quant` (REQUIRED) must outlive this object. `flat_gradients`: the device
  // buffer of UseFlatGradients (empty on the CPU). `device_gradients`: the all-reducer's buffers
  // are device memory (REQUIRED: a GPU device). From step `debug_nan_step` on, for
  // `debug_nan_steps` steps, worker 0 puts a NaN into its gradient (a testing aid; -1: never).
  LocalWorkers(Sequential* model, SiteQuantizer* quant, Device device, WorkerGroup group,
               Tensor flat_gradients, bool device_gradients, int64_t debug_nan_step,
               int64_t debug_nan_steps = 1);

  // Every local worker, in order, on its rows of (x, y) at `step`; statistics are recorded for
  // worker 0 when `collect_stats`. Returns the totals over this rank's workers.
  BatchTotals ForwardBackward(const Tensor& x, const std::vector<int32_t>& y, int64_t step,
                              bool collect_stats);

  // The K flat gradient buffers (the all-reducer's inputs, in worker order; device pointers
  // with device_gradients) and where the all-reducer leaves the sum over all workers (the first
  // of them).
  float* const* gradients() { return gradient_ptrs_.data(); }
  float* sum() { return gradient_ptrs_[0]; }
  // Divides the sum by W (and by the loss scale) and puts it into every Param::grad (or the
  // device buffer).
  void LoadAveragedGradients();
  // Loss scaling (runtime/train/loss_scale.h): the next ForwardBackward's gradients are
  // `scale` times the batch's, and LoadAveragedGradients divides it out again.
  void set_loss_scale(float scale) {
    loss_scale_ = scale;
    pass_.set_loss_scale(scale);
  }

  // Whether BatchNorm buffers need averaging (several workers and some buffers), and the
  // buffers each worker left in the last ForwardBackward (K x every buffer, in order).
  bool averages_buffers() const { return average_buffers_; }
  const std::vector<float>& buffers_after() const { return buffers_after_; }
  const NamedBuffers& buffers() const { return buffers_; }

 private:
  void CopyGradientsOut(int k);
  void PutNaNIntoGradient();

  Sequential* model_;
  SiteQuantizer* quant_;
  Device device_;
  WorkerGroup group_;
  Tensor flat_gradients_;  // on the GPU: every gradient, as views
  bool device_gradients_;
  int64_t debug_nan_step_, debug_nan_steps_;
  std::vector<Param*> params_;
  GradientPass pass_;
  float loss_scale_ = 1;
  std::vector<std::vector<float>> gradients_;  // per local worker, layout.total() floats
  std::vector<Tensor> device_copies_;          // device_gradients with K > 1: per local worker
  std::vector<float*> gradient_ptrs_;
  NamedBuffers buffers_;
  size_t buffer_floats_ = 0;
  bool average_buffers_ = false;
  std::vector<float> buffers_before_, buffers_after_;
  Tensor x_device_;  // the micro-batch's staging copy on the GPU
};

}  // namespace cpd::runtime
