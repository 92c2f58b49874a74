// The K logical workers of one rank (--emulate-ranks K; K = 1 without it). Worker w = rank * K + k
// takes rows [n*k/K, n*(k+1)/K) of this rank's part of the global batch, computes its gradients
// with the shared GradientPass into the flat gradient buffer, and hands them to GradientBuffers
// as the all-reducer's input k (runtime/train/gradient_buffers.h says where that input lives and
// when it is a copy). BatchNorm running statistics: every worker starts the step from the same
// buffers, and the buffers each worker leaves are kept for the replicas' average
// (Replicas::AverageBuffers).
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/engine/tensor.h"
#include "runtime/nn/layers.h"
#include "runtime/nn/quant_sites.h"
#include "runtime/train/gradient_buffers.h"
#include "runtime/train/gradients.h"
#include "runtime/train/replicas.h"

namespace cpd::runtime {

struct WorkerGroup {
  int rank = 0;
  int local_workers = 1;  // K
  int workers = 1;        // W, over all ranks
};

class LocalWorkers {
 public:
  // `model`, `quant` and `gradients` (REQUIRED; the model's, with its reducer inputs placed
  // for group.local_workers workers) must outlive this object. From step `debug_nan_step` on,
  // for `debug_nan_steps` steps, worker 0 puts a NaN into its gradient (a testing aid; -1:
  // never).
  LocalWorkers(Sequential* model, SiteQuantizer* quant, Device device, WorkerGroup group,
               GradientBuffers* gradients, int64_t debug_nan_step, int64_t debug_nan_steps = 1);

  // Every local worker, in order, on its rows of (x, y) at `step`, each leaving its gradients
  // as its all-reducer input (GradientBuffers::KeepWorkerGradients); statistics are recorded for
  // worker 0 when `collect_stats`. Returns the totals over this rank's workers.
  BatchTotals ForwardBackward(const Tensor& x, const std::vector<int32_t>& y, int64_t step,
                              bool collect_stats);

  // Loss scaling (runtime/train/loss_scale.h): the next ForwardBackward's gradients are
  // `scale` times the batch's (GradientBuffers::LoadAverage divides it out again).
  void set_loss_scale(float scale) { pass_.set_loss_scale(scale); }

  // Whether BatchNorm buffers need averaging (several workers and some buffers), and the
  // buffers each worker left in the last ForwardBackward (K x every buffer, in order).
  bool averages_buffers() const { return average_buffers_; }
  const std::vector<float>& buffers_after() const { return buffers_after_; }
  const NamedBuffers& buffers() const { return buffers_; }

 private:
  Sequential* model_;
  SiteQuantizer* quant_;
  Device device_;
  WorkerGroup group_;
  GradientBuffers* gradients_;
  int64_t debug_nan_step_, debug_nan_steps_;
  GradientPass pass_;
  NamedBuffers buffers_;
  size_t buffer_floats_ = 0;
  bool average_buffers_ = false;
  std::vector<float> buffers_before_, buffers_after_;
  Tensor x_device_;  // the micro-batch's staging copy on the GPU
};

}  // namespace cpd::runtime
