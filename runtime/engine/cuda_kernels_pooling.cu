// The pooling kernels of runtime/engine/cuda_ops.h (see cuda_ops.cu for the layout and the
// bit-exactness rules). Pooling gradients are gathered per input element (each thread sums the
// outputs that chose or cover it, in output order) instead of scattered with atomics, which
// would make the order of the additions, and so the result, vary from run to run.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "runtime/engine/cuda_internal.h"
#include "runtime/engine/cuda_kernels.cuh"
#include "runtime/engine/cuda_ops.h"

namespace cpd::runtime::cuda {

using internal::BlocksFor;
using internal::kThreads;
using internal::RequireIndex32;
using internal::StreamHandle;

namespace {

// ---------------------------------------------------------------------------------------------
// Kernels (planes of h x w, windows k x k at `stride`, no padding)

// One thread per output: the first maximum in (row, column) order; a NaN wins and stays.
__global__ void max_pool_forward_kernel(int32_t total, int32_t h, int32_t w, int32_t k,
                                        int32_t stride, int32_t oh, int32_t ow,
                                        const float* __restrict__ x, float* __restrict__ y,
                                        int32_t* __restrict__ argmax) {
  for (int32_t idx = blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += gridDim.x * blockDim.x) {
    const int32_t pl = idx / (oh * ow), r = idx - pl * (oh * ow);
    const int32_t oy = r / ow, ox = r - oy * ow;
    const float* xp = x + size_t(pl) * size_t(h) * size_t(w);
    int32_t best = oy * stride * w + ox * stride;
    float bv = xp[best];
    for (int32_t ki = 0; ki < k; ++ki) {
      for (int32_t kj = 0; kj < k; ++kj) {
        const int32_t id = (oy * stride + ki) * w + ox * stride + kj;
        const float v = xp[id];
        if (v > bv || (isnan(v) && !isnan(bv))) {
          bv = v;
          best = id;
        }
      }
    }
    y[idx] = bv;
    argmax[idx] = best;
  }
}

// The outputs [lo, hi] whose window (start o * stride, length k) covers input position i.
__device__ __forceinline__ void Covering(int32_t i, int32_t k, int32_t stride, int32_t out,
                                         int32_t* lo, int32_t* hi) {
  const int32_t first = i - k + 1;
  *lo = first <= 0 ? 0 : (first + stride - 1) / stride;
  const int32_t last = i / stride;
  *hi = last < out - 1 ? last : out - 1;
}

// One thread per input: the sum of dy over the outputs whose argmax is this input, in output
// order (the CPU scatters dy in that order onto a zeroed plane).
__global__ void max_pool_backward_kernel(int32_t total, int32_t h, int32_t w, int32_t k,
                                         int32_t stride, int32_t oh, int32_t ow,
                                         const float* __restrict__ dy,
                                         const int32_t* __restrict__ argmax,
                                         float* __restrict__ dx) {
  for (int32_t idx = blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += gridDim.x * blockDim.x) {
    const int32_t pl = idx / (h * w), pos = idx - pl * (h * w);
    const int32_t iy = pos / w, ix = pos - iy * w;
    int32_t y0, y1, x0, x1;
    Covering(iy, k, stride, oh, &y0, &y1);
    Covering(ix, k, stride, ow, &x0, &x1);
    float s = 0.f;
    for (int32_t oy = y0; oy <= y1; ++oy) {
      for (int32_t ox = x0; ox <= x1; ++ox) {
        const size_t o = (size_t(pl) * size_t(oh) + size_t(oy)) * size_t(ow) + size_t(ox);
        if (argmax[o] == pos) s += dy[o];
      }
    }
    dx[idx] = s;
  }
}

__global__ void avg_pool_forward_kernel(int32_t total, int32_t h, int32_t w, int32_t k,
                                        int32_t stride, int32_t oh, int32_t ow, float inv,
                                        const float* __restrict__ x, float* __restrict__ y) {
  for (int32_t idx = blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += gridDim.x * blockDim.x) {
    const int32_t pl = idx / (oh * ow), r = idx - pl * (oh * ow);
    const int32_t oy = r / ow, ox = r - oy * ow;
    const float* xp = x + size_t(pl) * size_t(h) * size_t(w);
    float s = 0.f;
    for (int32_t ki = 0; ki < k; ++ki) {
      const float* row = xp + (oy * stride + ki) * w + ox * stride;
      for (int32_t kj = 0; kj < k; ++kj) s += row[kj];
    }
    y[idx] = s * inv;
  }
}

// One thread per input: sum of dy * inv over the covering windows, in output order.
__global__ void avg_pool_backward_kernel(int32_t total, int32_t h, int32_t w, int32_t k,
                                         int32_t stride, int32_t oh, int32_t ow, float inv,
                                         const float* __restrict__ dy, float* __restrict__ dx) {
  for (int32_t idx = blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += gridDim.x * blockDim.x) {
    const int32_t pl = idx / (h * w), pos = idx - pl * (h * w);
    const int32_t iy = pos / w, ix = pos - iy * w;
    int32_t y0, y1, x0, x1;
    Covering(iy, k, stride, oh, &y0, &y1);
    Covering(ix, k, stride, ow, &x0, &x1);
    float s = 0.f;
    for (int32_t oy = y0; oy <= y1; ++oy) {
      for (int32_t ox = x0; ox <= x1; ++ox) {
        s += dy[(size_t(pl) * size_t(oh) + size_t(oy)) * size_t(ow) + size_t(ox)] * inv;
      }
    }
    dx[idx] = s;
  }
}

// One warp per plane, summed in double.
__global__ void global_avg_pool_forward_kernel(int64_t planes, int32_t hw,
                                               const float* __restrict__ x, float* __restrict__ y) {
  const int64_t pl = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (pl >= planes) return;  // whole warps leave together
  const float* xp = x + size_t(pl) * size_t(hw);
  double s = 0.0;
  for (int32_t p = lane; p < hw; p += 32) s += double(xp[p]);
  for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffffu, s, off);
  if (lane == 0) y[pl] = float(s / double(hw));
}

__global__ void global_avg_pool_backward_kernel(size_t total, int32_t hw, float inv,
                                                const float* __restrict__ dy,
                                                float* __restrict__ dx) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += size_t(gridDim.x) * blockDim.x) {
    dx[i] = dy[i / size_t(hw)] * inv;
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers

void MaxPool2dForward(int64_t planes, int64_t h, int64_t w, int64_t k, int64_t stride, int64_t oh,
                      int64_t ow, const float* x, float* y, int32_t* argmax) {
  const int64_t total = planes * oh * ow;
  if (total == 0) return;
  RequireIndex32("MaxPool2d", planes * h * w);
  RequireIndex32("MaxPool2d", total);
  max_pool_forward_kernel<<<BlocksFor(size_t(total)), kThreads, 0, StreamHandle()>>>(
      int32_t(total), int32_t(h), int32_t(w), int32_t(k), int32_t(stride), int32_t(oh), int32_t(ow),
      x, y, argmax);
  CPD_CHECK_LAUNCH();
}

void MaxPool2dBackward(int64_t planes, int64_t h, int64_t w, int64_t k, int64_t stride, int64_t oh,
                       int64_t ow, const float* dy, const int32_t* argmax, float* dx) {
  const int64_t total = planes * h * w;
  if (total == 0) return;
  RequireIndex32("MaxPool2d", total);
  max_pool_backward_kernel<<<BlocksFor(size_t(total)), kThreads, 0, StreamHandle()>>>(
      int32_t(total), int32_t(h), int32_t(w), int32_t(k), int32_t(stride), int32_t(oh), int32_t(ow),
      dy, argmax, dx);
  CPD_CHECK_LAUNCH();
}

void AvgPool2dForward(int64_t planes, int64_t h, int64_t w, int64_t k, int64_t stride, int64_t oh,
                      int64_t ow, const float* x, float* y) {
  const int64_t total = planes * oh * ow;
  if (total == 0) return;
  RequireIndex32("AvgPool2d", planes * h * w);
  RequireIndex32("AvgPool2d", total);
  const float inv = 1.f / float(k * k);
  avg_pool_forward_kernel<<<BlocksFor(size_t(total)), kThreads, 0, StreamHandle()>>>(
      int32_t(total), int32_t(h), int32_t(w), int32_t(k), int32_t(stride), int32_t(oh), int32_t(ow),
      inv, x, y);
  CPD_CHECK_LAUNCH();
}

void AvgPool2dBackward(int64_t planes, int64_t h, int64_t w, int64_t k, int64_t stride, int64_t oh,
                       int64_t ow, const float* dy, float* dx) {
  const int64_t total = planes * h * w;
  if (total == 0) return;
  RequireIndex32("AvgPool2d", total);
  const float inv = 1.f / float(k * k);
  avg_pool_backward_kernel<<<BlocksFor(size_t(total)), kThreads, 0, StreamHandle()>>>(
      int32_t(total), int32_t(h), int32_t(w), int32_t(k), int32_t(stride), int32_t(oh), int32_t(ow),
      inv, dy, dx);
  CPD_CHECK_LAUNCH();
}

void GlobalAvgPoolForward(int64_t planes, int64_t hw, const float* x, float* y) {
  if (planes == 0) return;
  RequireIndex32("GlobalAvgPool", hw);
  constexpr int kWarps = kThreads / 32;
  global_avg_pool_forward_kernel<<<unsigned(CEIL_DIV(planes, int64_t(kWarps))), kThreads, 0,
                                   StreamHandle()>>>(planes, int32_t(hw), x, y);
  CPD_CHECK_LAUNCH();
}

void GlobalAvgPoolBackward(int64_t planes, int64_t hw, const float* dy, float* dx) {
  const size_t total = size_t(planes) * size_t(hw);
  if (total == 0) return;
  RequireIndex32("GlobalAvgPool", hw);
  const float inv = 1.f / float(hw);
  global_avg_pool_backward_kernel<<<BlocksFor(total), kThreads, 0, StreamHandle()>>>(
      total, int32_t(hw), inv, dy, dx);
  CPD_CHECK_LAUNCH();
}

}  // namespace cpd::runtime::cuda
