// The geometry of a 2-D convolution and the CPU's per-layer convolution workspace: what the
// convolution front end (runtime/engine/cpu_conv.h), its oneDNN back end (runtime/engine/dnnl_conv.h) and the
// CUDA back end (runtime/engine/cuda_ops.h) share. Depends on nothing else of the engine but Tensor.
#pragma once

#include <cstdint>
#include <memory>

#include "runtime/engine/tensor.h"

namespace cpd::runtime::cpu {

// A 2-D convolution of a batch: input [n, c, h, w], weight [oc, c, k, k], output
// [n, oc, oh, ow] with oh = (h + 2 pad - k) / stride + 1 (the same for ow).
struct ConvShape {
  int64_t n = 0, c = 0, h = 0, w = 0;  // input
  int64_t oc = 0, k = 1, stride = 1, pad = 0;
  int64_t oh = 0, ow = 0;  // output (see ComputeOutput)

  // Fills oh and ow; false if the (padded) input is smaller than the kernel.
  bool ComputeOutput() {
    if (k < 1 || stride < 1 || pad < 0 || h + 2 * pad < k || w + 2 * pad < k) return false;
    oh = (h + 2 * pad - k) / stride + 1;
    ow = (w + 2 * pad - k) / stride + 1;
    return true;
  }
  int64_t ckk() const { return c * k * k; }  // rows of the column matrix
  int64_t ohw() const { return oh * ow; }    // columns of the column matrix
  // A 1x1, stride-1, unpadded convolution is a plain GEMM on the input (no im2col).
  bool pointwise() const { return k == 1 && stride == 1 && pad == 0; }
};

struct DnnlConv;  // oneDNN primitives and buffers of one convolution (runtime/engine/dnnl_conv.h)

// Scratch memory reused across calls by the convolution kernels (grown on demand), and the
// oneDNN path's state for the shape it last ran (rebuilt when the shape or thread count
// changes). One per convolution layer.
struct ConvWorkspace {
  Tensor col;      // per thread: a column tile and its gradient
  Tensor partial;  // per thread: weight and bias gradient partial sums
  Tensor packed;   // weights re-laid out for the direct kernel
  std::shared_ptr<DnnlConv> dnnl;
};

}  // namespace cpd::runtime::cpu
