// Where a rank's gradients live during a training step, and the copies between those places.
//
// Every parameter's gradient (Param::grad) is a view of one flat buffer on the model's device,
// in parameter order, as llm.c keeps its gradients: backward writes straight into it, the
// all-reducer's layout (comm::GradientLayout) indexes it, and the optimiser reads the average
// from it. The all-reducer takes K inputs, one per local worker (--emulate-ranks K), in host or
// device memory (comm::GradientAllReduceOptions::gradients):
//   * K = 1 with the flat buffer already in that memory (the CPU and host memory, a GPU and
//     device memory): the flat buffer itself is input 0 and receives the sum (the reducer's
//     output may alias input 0), so a step copies no gradient at all;
//   * otherwise each worker's gradients are copied into an input of their own in that memory
//     (on a GPU with host memory: one device-to-host copy per worker, one host-to-device copy
//     of the average).
// The average is the sum times 1 / W / S (W workers over all ranks, S the loss scale), the same
// float products on the CPU and on the GPU, so every placement gives the same bits.
//
// Not thread-safe; the trainer's thread calls it, between backward passes and optimiser steps.
#pragma once

#include <vector>

#include "comm/communicator.h"
#include "runtime/engine/tensor.h"
#include "runtime/nn/layer.h"

namespace cpd::runtime {

class GradientBuffers {
 public:
  // Makes every Param::grad of `params` a view of one zero-filled flat buffer on `device`
  // (REQUIRED: the device the params' values are on). Call before an Optimizer is built over
  // the params (it reads Param::grad's storage). The params must outlive this object.
  GradientBuffers(const std::vector<Param*>& params, Device device);

  // Where the all-reducer's `local_workers` (>= 1) inputs live; call once, before the first
  // KeepWorkerGradients. kDevice REQUIRES a GPU device (std::invalid_argument otherwise).
  void PlaceReducerInputs(comm::MemorySpace memory, int local_workers);
  comm::MemorySpace reducer_memory() const { return memory_; }

  // After local worker k's backward pass: its gradients become the all-reducer's input k (a
  // copy, unless the flat buffer itself is that input).
  void KeepWorkerGradients(int k);
  // A testing aid (--debug-nan-step): a quiet NaN into the first element of input k, after
  // KeepWorkerGradients(k). Nothing when there are no gradients.
  void PutNaNIntoInput(int k);

  // The all-reducer's inputs, in worker order (host or device pointers, as reducer_memory()
  // says), and where it leaves the sum over all workers: input 0.
  float* const* inputs() const { return input_ptrs_.data(); }
  float* sum() const { return input_ptrs_[0]; }

  // Every Param::grad = sum x factor, factor = 1 / `workers` / `loss_scale` in float, one
  // product per element on the CPU and the GPU alike. With a power-of-two loss scale the factor
  // is 1 / W times an exact power of two, so a scaled run averages to the bits of an unscaled
  // one (unless a product falls below float's normal range).
  void LoadAverage(int workers, float loss_scale);

  // The flat buffer every Param::grad views, in parameter order.
  const Tensor& flat() const { return flat_; }

 private:
  Device device_;
  Tensor flat_;
  comm::MemorySpace memory_ = comm::MemorySpace::kHost;
  std::vector<Tensor> copies_;  // one per local worker, unless flat_ is the only input
  std::vector<float*> input_ptrs_;
};

}  // namespace cpd::runtime
