// The runtime's own CUDA kernels (see runtime/cuda_ops.h). Layout, after llm.c: device helpers,
// then the kernels (names end in _kernel), then the launchers, which check their sizes, size the
// grid with CEIL_DIV, launch on the runtime's stream and check cudaGetLastError().
//
// Bit-exactness with runtime/cpu_ops.cc: this file is built with -fmad=false (no FMA
// contraction, as the CPU code's -ffp-contract=off) and without fast math, and where the CPU
// result is defined by a fixed order of float operations (elementwise ops, pooling, dropout,
// the optimiser, LARS's norms) the kernels perform the same operations in the same order.
// Pooling gradients are gathered per input element (each thread sums the outputs that chose or
// cover it, in output order) instead of scattered with atomics, which would make the order of
// the additions, and so the result, vary from run to run.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/grid.h"
#include "runtime/cuda_internal.h"
#include "runtime/cuda_ops.h"

namespace cpd::runtime::cuda {

namespace {

#define CEIL_DIV(a, b) (((a) + (b)-1) / (b))

constexpr int kThreads = 256;
constexpr size_t kMaxBlocks = size_t(1) << 16;  // grid-stride loops beyond this
constexpr int64_t kMaxIndex32 = int64_t(0x7fffffff);

using internal::Scratch;
using internal::StreamHandle;

// Blocks for a grid-stride loop over n elements.
unsigned BlocksFor(size_t n) {
  const size_t b = CEIL_DIV(n, size_t(kThreads));
  return unsigned(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

// Kernels that index with 32-bit integers (per-element channel or window arithmetic) need every
// index to fit; larger tensors are refused with a message rather than mis-indexed.
void RequireIndex32(const char* op, int64_t count) {
  if (count < 0 || count > kMaxIndex32) {
    throw std::invalid_argument(std::string("cuda ") + op + ": " + std::to_string(count) +
                                " elements exceed this kernel's 32-bit indexing (2^31 - 1)");
  }
}

#define CPD_CHECK_LAUNCH() CPD_CUDA_CHECK(cudaGetLastError())

// ---------------------------------------------------------------------------------------------
// Device helpers

// Sums (a, b) over the block; the result is valid in thread 0. blockDim.x == kThreads.
__device__ void BlockSum2(double* a, double* b) {
  __shared__ double sa[kThreads / 32], sb[kThreads / 32];
  double x = *a, y = *b;
  for (int off = 16; off > 0; off >>= 1) {
    x += __shfl_down_sync(0xffffffffu, x, off);
    y += __shfl_down_sync(0xffffffffu, y, off);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sa[warp] = x;
    sb[warp] = y;
  }
  __syncthreads();
  if (warp == 0) {
    x = lane < kThreads / 32 ? sa[lane] : 0.0;
    y = lane < kThreads / 32 ? sb[lane] : 0.0;
    for (int off = 16; off > 0; off >>= 1) {
      x += __shfl_down_sync(0xffffffffu, x, off);
      y += __shfl_down_sync(0xffffffffu, y, off);
    }
  }
  *a = x;
  *b = y;
}

// ---------------------------------------------------------------------------------------------
// Kernels: elementwise

__global__ void relu_kernel(size_t n, const float* __restrict__ x, float* __restrict__ y) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const float v = x[i];
    y[i] = v < 0.f ? 0.f : v;  // NaN and -0 stay, as on the CPU
  }
}

__global__ void relu_backward_kernel(size_t n, const float* __restrict__ y,
                                     const float* __restrict__ dy, float* __restrict__ dx) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const float g = dy[i];
    dx[i] = y[i] > 0.f ? g : 0.f;
  }
}

__global__ void add_relu_kernel(size_t n, const float* __restrict__ a, const float* __restrict__ b,
                                float* __restrict__ y) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const float s = a[i] + b[i];
    y[i] = s < 0.f ? 0.f : s;
  }
}

__global__ void add_kernel(size_t n, const float* __restrict__ a, const float* __restrict__ b,
                           float* __restrict__ y) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    y[i] = a[i] + b[i];
  }
}

__global__ void add_inplace_kernel(size_t n, const float* __restrict__ x, float* __restrict__ y) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    y[i] += x[i];
  }
}

__global__ void dropout_kernel(size_t n, uint64_t key, uint32_t threshold, float scale,
                               const float* __restrict__ x, float* __restrict__ y) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const float v = x[i] * scale;
    y[i] = kernels::RandomBits(key, uint64_t(i)) >= threshold ? v : 0.f;
  }
}

// ---------------------------------------------------------------------------------------------
// Kernels: biases

// y [n, out] += bias [out].
__global__ void add_row_bias_kernel(int32_t total, int32_t out, const float* __restrict__ bias,
                                    float* __restrict__ y) {
  for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    y[i] += bias[i % out];
  }
}

// db [o] = sum_i dy [i, o], i ascending, in float from 0 (the CPU's loop).
__global__ void column_sums_kernel(int32_t n, int32_t out, const float* __restrict__ dy,
                                   float* __restrict__ db) {
  const int32_t o = blockIdx.x * blockDim.x + threadIdx.x;
  if (o >= out) return;
  float s = 0.f;
  for (int32_t i = 0; i < n; ++i) s += dy[size_t(i) * size_t(out) + size_t(o)];
  db[o] = s;
}

// y [n, c, hw] += bias [c].
__global__ void add_channel_bias_kernel(int32_t total, int32_t c, int32_t hw,
                                        const float* __restrict__ bias, float* __restrict__ y) {
  for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    y[i] += bias[(i / hw) % c];
  }
}

// One block per channel: db [ch] = sum over n and hw, in double.
__global__ void channel_sums_kernel(int32_t n, int32_t c, int32_t hw, const float* __restrict__ dy,
                                    float* __restrict__ db) {
  const int32_t ch = blockIdx.x;
  const int32_t count = n * hw;
  double s = 0.0, unused = 0.0;
  for (int32_t e = threadIdx.x; e < count; e += blockDim.x) {
    const int32_t i = e / hw, p = e - i * hw;
    s += double(dy[(size_t(i) * size_t(c) + size_t(ch)) * size_t(hw) + size_t(p)]);
  }
  BlockSum2(&s, &unused);
  if (threadIdx.x == 0) db[ch] = float(s);
}

// ---------------------------------------------------------------------------------------------
// Kernels: batch normalisation
//
// Statistics in two steps: blocks (channel, split) accumulate partial double sums over a range
// of the channel's n * hw values, then one thread per channel adds its splits in order (so the
// result does not depend on scheduling) and derives what the CPU derives, with the CPU's
// formulas: shifted sums around k = the channel's first value, biased variance, invstd.

// partial [ch][split] = {sum (x - k), sum (x - k)^2}.
__global__ void bn_stats_partial_kernel(int32_t n, int32_t c, int32_t hw, int32_t per,
                                        const float* __restrict__ x, double* __restrict__ partial) {
  const int32_t ch = blockIdx.y, split = blockIdx.x;
  const int32_t count = n * hw;
  const int32_t begin = split * per;
  const int32_t end = begin + per < count ? begin + per : count;
  const float k = x[size_t(ch) * size_t(hw)];
  double s1 = 0.0, s2 = 0.0;
  for (int32_t e = begin + int32_t(threadIdx.x); e < end; e += blockDim.x) {
    const int32_t i = e / hw, p = e - i * hw;
    const float d = x[(size_t(i) * size_t(c) + size_t(ch)) * size_t(hw) + size_t(p)] - k;
    s1 += double(d);
    s2 += double(d) * double(d);
  }
  BlockSum2(&s1, &s2);
  if (threadIdx.x == 0) {
    const size_t at = (size_t(ch) * gridDim.x + split) * 2;
    partial[at] = s1;
    partial[at + 1] = s2;
  }
}

__global__ void bn_stats_finalize_kernel(int32_t c, int32_t hw, int32_t splits, double count,
                                         float eps, const float* __restrict__ x,
                                         const double* __restrict__ partial,
                                         float* __restrict__ mean, float* __restrict__ var,
                                         float* __restrict__ invstd) {
  const int32_t ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= c) return;
  double s1 = 0.0, s2 = 0.0;
  for (int32_t s = 0; s < splits; ++s) {
    s1 += partial[(size_t(ch) * splits + s) * 2];
    s2 += partial[(size_t(ch) * splits + s) * 2 + 1];
  }
  const float k = x[size_t(ch) * size_t(hw)];
  const double d = s1 / count;
  const double a = s2 / count - d * d;
  const double v = a < 0.0 ? 0.0 : a;  // std::max(a, 0.0), NaN kept as the CPU keeps it
  mean[ch] = float(double(k) + d);
  var[ch] = float(v);
  invstd[ch] = float(1.0 / sqrt(v + double(eps)));
}

// y = (x - mean) * (gamma * invstd) + beta, optionally through a ReLU.
__global__ void bn_apply_kernel(int32_t total, int32_t c, int32_t hw, const float* __restrict__ x,
                                const float* __restrict__ gamma, const float* __restrict__ beta,
                                const float* __restrict__ mean, const float* __restrict__ invstd,
                                bool relu, float* __restrict__ y) {
  for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const int32_t ch = (i / hw) % c;
    const float scale = gamma[ch] * invstd[ch];
    const float v = (x[i] - mean[ch]) * scale + beta[ch];
    y[i] = relu && v < 0.f ? 0.f : v;
  }
}

// Evaluation: scale from the running variance, in double as the CPU computes it.
__global__ void bn_eval_kernel(int32_t total, int32_t c, int32_t hw, const float* __restrict__ x,
                               const float* __restrict__ gamma, const float* __restrict__ beta,
                               const float* __restrict__ mean, const float* __restrict__ var,
                               float eps, bool relu, float* __restrict__ y) {
  for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const int32_t ch = (i / hw) % c;
    const float scale = gamma[ch] * float(1.0 / sqrt(double(var[ch]) + double(eps)));
    const float v = (x[i] - mean[ch]) * scale + beta[ch];
    y[i] = relu && v < 0.f ? 0.f : v;
  }
}

__global__ void bn_update_running_kernel(int32_t c, const float* __restrict__ mean,
                                         const float* __restrict__ var, float momentum,
                                         double unbias, float* __restrict__ rm,
                                         float* __restrict__ rv) {
  const int32_t ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= c) return;
  rm[ch] = (1.f - momentum) * rm[ch] + momentum * mean[ch];
  rv[ch] = (1.f - momentum) * rv[ch] + momentum * float(double(var[ch]) * unbias);
}

// partial [ch][split] = {sum g, sum g * (x - mean)}, g = dy (0 where relu_y <= 0, if given).
__global__ void bn_backward_partial_kernel(int32_t n, int32_t c, int32_t hw, int32_t per,
                                           const float* __restrict__ x,
                                           const float* __restrict__ dy,
                                           const float* __restrict__ relu_y,
                                           const float* __restrict__ mean,
                                           double* __restrict__ partial) {
  const int32_t ch = blockIdx.y, split = blockIdx.x;
  const int32_t count = n * hw;
  const int32_t begin = split * per;
  const int32_t end = begin + per < count ? begin + per : count;
  const float m = mean[ch];
  double s1 = 0.0, s2 = 0.0;
  for (int32_t e = begin + int32_t(threadIdx.x); e < end; e += blockDim.x) {
    const int32_t i = e / hw, p = e - i * hw;
    const size_t at = (size_t(i) * size_t(c) + size_t(ch)) * size_t(hw) + size_t(p);
    const float g0 = dy[at];
    const float g = relu_y != nullptr ? (relu_y[at] > 0.f ? g0 : 0.f) : g0;
    s1 += double(g);
    s2 += double(g) * double(x[at] - m);
  }
  BlockSum2(&s1, &s2);
  if (threadIdx.x == 0) {
    const size_t at = (size_t(ch) * gridDim.x + split) * 2;
    partial[at] = s1;
    partial[at + 1] = s2;
  }
}

// dbeta, dgamma and the coefficients of dx = k1 * g - k2 * (x - mean) - k3 (the CPU's).
__global__ void bn_backward_finalize_kernel(int32_t c, int32_t splits, double count,
                                            const double* __restrict__ partial,
                                            const float* __restrict__ gamma,
                                            const float* __restrict__ invstd,
                                            float* __restrict__ coef, float* __restrict__ dgamma,
                                            float* __restrict__ dbeta) {
  const int32_t ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= c) return;
  double sum_dy = 0.0, sum_dy_xc = 0.0;
  for (int32_t s = 0; s < splits; ++s) {
    sum_dy += partial[(size_t(ch) * splits + s) * 2];
    sum_dy_xc += partial[(size_t(ch) * splits + s) * 2 + 1];
  }
  const double is = invstd[ch];
  dbeta[ch] = float(sum_dy);
  dgamma[ch] = float(sum_dy_xc * is);
  const double k1 = double(gamma[ch]) * is;
  coef[3 * ch] = float(k1);
  coef[3 * ch + 1] = float(k1 * is * is * sum_dy_xc / count);
  coef[3 * ch + 2] = float(k1 * sum_dy / count);
}

__global__ void bn_backward_apply_kernel(int32_t total, int32_t c, int32_t hw,
                                         const float* __restrict__ x, const float* __restrict__ dy,
                                         const float* __restrict__ relu_y,
                                         const float* __restrict__ mean,
                                         const float* __restrict__ coef, float* __restrict__ dx) {
  for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const int32_t ch = (i / hw) % c;
    const float g0 = dy[i];
    const float g = relu_y != nullptr ? (relu_y[i] > 0.f ? g0 : 0.f) : g0;
    dx[i] = coef[3 * ch] * g - coef[3 * ch + 1] * (x[i] - mean[ch]) - coef[3 * ch + 2];
  }
}

// ---------------------------------------------------------------------------------------------
// Kernels: pooling (planes of h x w, windows k x k at `stride`, no padding)

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

// ---------------------------------------------------------------------------------------------
// Kernels: loss

// One thread per row: the CPU's numerically stable softmax cross-entropy, in double.
__global__ void softmax_xent_kernel(int32_t n, int32_t k, const float* __restrict__ logits,
                                    const int32_t* __restrict__ labels, double inv_n,
                                    double* __restrict__ row_loss, float* __restrict__ dlogits) {
  const int32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float* row = logits + size_t(i) * size_t(k);
  float mx = -INFINITY;
  for (int32_t j = 0; j < k; ++j) mx = mx < row[j] ? row[j] : mx;  // std::max(mx, row[j])
  double sum = 0.0;
  for (int32_t j = 0; j < k; ++j) sum += exp(double(row[j]) - double(mx));
  const double log_sum = log(sum);
  const int32_t label = labels[i];
  row_loss[i] = log_sum - (double(row[label]) - double(mx));
  if (dlogits != nullptr) {
    float* d = dlogits + size_t(i) * size_t(k);
    for (int32_t j = 0; j < k; ++j) {
      const double p = exp(double(row[j]) - double(mx) - log_sum);
      d[j] = float((p - (j == label ? 1.0 : 0.0)) * inv_n);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Kernels: optimiser (one block per chunk)

template <bool kLars, bool kMomentum, bool kNesterov>
__global__ void sgd_update_kernel(const OptimizerChunk* __restrict__ chunks,
                                  const OptimizerCoeffs* __restrict__ coeffs, float m) {
  const OptimizerChunk ch = chunks[blockIdx.x];
  const OptimizerCoeffs c = coeffs[ch.param];
  float* __restrict__ w = ch.w;
  const float* __restrict__ g = ch.g;
  float* __restrict__ buf = ch.buf;
  for (uint32_t i = threadIdx.x; i < ch.len; i += blockDim.x) {
    float d = g[i];
    if (c.decay) d = d + c.wd * w[i];
    if constexpr (!kMomentum) {
      w[i] = w[i] - c.lr * d;
    } else if constexpr (!kLars) {
      const float b = m * buf[i] + d;
      buf[i] = b;
      w[i] = w[i] - c.lr * (kNesterov ? d + m * b : b);
    } else {
      const float s = c.lr * d;
      const float v = m * buf[i] + s;
      buf[i] = v;
      w[i] = w[i] - (kNesterov ? m * v + s : v);
    }
  }
}

// Block 2c sums w^2 of chunk c, block 2c + 1 its g^2: thread t folds the 64-element block t in
// the CPU's 8 float lanes, then thread 0 adds the blocks and the tail in double, in order.
__global__ void chunk_sum_squares_kernel(const OptimizerChunk* __restrict__ chunks,
                                         double* __restrict__ partial) {
  __shared__ double block_sums[kThreads];
  const OptimizerChunk ch = chunks[blockIdx.x / 2];
  const float* __restrict__ x = (blockIdx.x & 1) != 0 ? ch.g : ch.w;
  const uint32_t blocks = ch.len / 64;  // <= kThreads (len <= 16384)
  const uint32_t t = threadIdx.x;
  if (t < blocks) {
    float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    const float* b = x + size_t(t) * 64;
    for (int k = 0; k < 64; k += 8) {
      for (int j = 0; j < 8; ++j) a[j] += b[k + j] * b[k + j];
    }
    block_sums[t] = double(((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])));
  }
  __syncthreads();
  if (t == 0) {
    double total = 0.0;
    for (uint32_t i = 0; i < blocks; ++i) total += block_sums[i];
    for (uint32_t i = blocks * 64; i < ch.len; ++i) total += double(x[i]) * double(x[i]);
    partial[blockIdx.x] = total;
  }
}

// Splits of a channel's count values for the batch-norm reductions: about 4096 values per
// block, at most 1024 splits.
int32_t SplitsFor(int32_t count) {
  const int32_t s = int32_t(CEIL_DIV(int64_t(count), int64_t(4096)));
  return s < 1 ? 1 : (s > 1024 ? 1024 : s);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers

namespace internal {

void AddRowBias(int64_t n, int64_t out, const float* bias, float* y) {
  const int64_t total = n * out;
  if (total == 0) return;
  RequireIndex32("Linear bias", total);
  add_row_bias_kernel<<<BlocksFor(size_t(total)), kThreads, 0, StreamHandle()>>>(
      int32_t(total), int32_t(out), bias, y);
  CPD_CHECK_LAUNCH();
}

void ColumnSums(int64_t n, int64_t out, const float* dy, float* db) {
  if (out == 0) return;
  RequireIndex32("Linear bias gradient", n * out);
  column_sums_kernel<<<unsigned(CEIL_DIV(out, int64_t(kThreads))), kThreads, 0, StreamHandle()>>>(
      int32_t(n), int32_t(out), dy, db);
  CPD_CHECK_LAUNCH();
}

void AddChannelBias(int64_t n, int64_t c, int64_t hw, const float* bias, float* y) {
  const int64_t total = n * c * hw;
  if (total == 0) return;
  RequireIndex32("Conv2d bias", total);
  add_channel_bias_kernel<<<BlocksFor(size_t(total)), kThreads, 0, StreamHandle()>>>(
      int32_t(total), int32_t(c), int32_t(hw), bias, y);
  CPD_CHECK_LAUNCH();
}

void ChannelSums(int64_t n, int64_t c, int64_t hw, const float* dy, float* db) {
  if (c == 0) return;
  RequireIndex32("Conv2d bias gradient", n * c * hw);
  channel_sums_kernel<<<unsigned(c), kThreads, 0, StreamHandle()>>>(int32_t(n), int32_t(c),
                                                                    int32_t(hw), dy, db);
  CPD_CHECK_LAUNCH();
}

}  // namespace internal

void Relu(size_t n, const float* x, float* y) {
  if (n == 0) return;
  relu_kernel<<<BlocksFor(n), kThreads, 0, StreamHandle()>>>(n, x, y);
  CPD_CHECK_LAUNCH();
}

void ReluBackward(size_t n, const float* y, const float* dy, float* dx) {
  if (n == 0) return;
  relu_backward_kernel<<<BlocksFor(n), kThreads, 0, StreamHandle()>>>(n, y, dy, dx);
  CPD_CHECK_LAUNCH();
}

void AddRelu(size_t n, const float* a, const float* b, float* y) {
  if (n == 0) return;
  add_relu_kernel<<<BlocksFor(n), kThreads, 0, StreamHandle()>>>(n, a, b, y);
  CPD_CHECK_LAUNCH();
}

void Add(size_t n, const float* a, const float* b, float* y) {
  if (n == 0) return;
  add_kernel<<<BlocksFor(n), kThreads, 0, StreamHandle()>>>(n, a, b, y);
  CPD_CHECK_LAUNCH();
}

void AddInPlace(size_t n, const float* x, float* y) {
  if (n == 0) return;
  add_inplace_kernel<<<BlocksFor(n), kThreads, 0, StreamHandle()>>>(n, x, y);
  CPD_CHECK_LAUNCH();
}

void DropoutApply(size_t n, uint64_t key, uint32_t threshold, float scale, const float* x,
                  float* y) {
  if (n == 0) return;
  dropout_kernel<<<BlocksFor(n), kThreads, 0, StreamHandle()>>>(n, key, threshold, scale, x, y);
  CPD_CHECK_LAUNCH();
}

// ---- Batch normalisation ------------------------------------------------------------------------

void BatchNormTrainForward(int64_t n, int64_t c, int64_t hw, const float* x, const float* gamma,
                           const float* beta, float eps, bool relu, float* y, float* mean,
                           float* var, float* invstd) {
  const int64_t total = n * c * hw;
  if (c == 0) return;
  if (n * hw < 1) throw std::invalid_argument("cuda BatchNormTrainForward: no values per channel");
  RequireIndex32("BatchNorm", total);
  if (c > 65535) throw std::invalid_argument("cuda BatchNorm: more than 65535 channels");
  cudaStream_t stream = StreamHandle();
  const int32_t count = int32_t(n * hw);
  const int32_t splits = SplitsFor(count);
  const int32_t per = int32_t(CEIL_DIV(int64_t(count), int64_t(splits)));
  auto* partial = static_cast<double*>(
      internal::ScratchMemory(Scratch::kPartials, size_t(c) * size_t(splits) * 2 * sizeof(double)));
  bn_stats_partial_kernel<<<dim3(unsigned(splits), unsigned(c)), kThreads, 0, stream>>>(
      int32_t(n), int32_t(c), int32_t(hw), per, x, partial);
  CPD_CHECK_LAUNCH();
  bn_stats_finalize_kernel<<<unsigned(CEIL_DIV(c, int64_t(kThreads))), kThreads, 0, stream>>>(
      int32_t(c), int32_t(hw), splits, double(count), eps, x, partial, mean, var, invstd);
  CPD_CHECK_LAUNCH();
  bn_apply_kernel<<<BlocksFor(size_t(total)), kThreads, 0, stream>>>(
      int32_t(total), int32_t(c), int32_t(hw), x, gamma, beta, mean, invstd, relu, y);
  CPD_CHECK_LAUNCH();
}

void BatchNormEvalForward(int64_t n, int64_t c, int64_t hw, const float* x, const float* gamma,
                          const float* beta, const float* mean, const float* var, float eps,
                          bool relu, float* y) {
  const int64_t total = n * c * hw;
  if (total == 0) return;
  RequireIndex32("BatchNorm", total);
  bn_eval_kernel<<<BlocksFor(size_t(total)), kThreads, 0, StreamHandle()>>>(
      int32_t(total), int32_t(c), int32_t(hw), x, gamma, beta, mean, var, eps, relu, y);
  CPD_CHECK_LAUNCH();
}

void BatchNormUpdateRunning(int64_t c, const float* mean, const float* var, float momentum,
                            double unbias, float* running_mean, float* running_var) {
  if (c == 0) return;
  RequireIndex32("BatchNorm", c);
  bn_update_running_kernel<<<unsigned(CEIL_DIV(c, int64_t(kThreads))), kThreads, 0,
                             StreamHandle()>>>(int32_t(c), mean, var, momentum, unbias,
                                               running_mean, running_var);
  CPD_CHECK_LAUNCH();
}

void BatchNormBackward(int64_t n, int64_t c, int64_t hw, const float* x, const float* dy,
                       const float* relu_y, const float* gamma, const float* mean,
                       const float* invstd, float* dx, float* dgamma, float* dbeta) {
  const int64_t total = n * c * hw;
  if (c == 0) return;
  if (n * hw < 1) throw std::invalid_argument("cuda BatchNormBackward: no values per channel");
  RequireIndex32("BatchNorm", total);
  if (c > 65535) throw std::invalid_argument("cuda BatchNorm: more than 65535 channels");
  cudaStream_t stream = StreamHandle();
  const int32_t count = int32_t(n * hw);
  const int32_t splits = SplitsFor(count);
  const int32_t per = int32_t(CEIL_DIV(int64_t(count), int64_t(splits)));
  auto* partial = static_cast<double*>(
      internal::ScratchMemory(Scratch::kPartials, size_t(c) * size_t(splits) * 2 * sizeof(double)));
  auto* coef = static_cast<float*>(
      internal::ScratchMemory(Scratch::kCoefficients, size_t(c) * 3 * sizeof(float)));
  bn_backward_partial_kernel<<<dim3(unsigned(splits), unsigned(c)), kThreads, 0, stream>>>(
      int32_t(n), int32_t(c), int32_t(hw), per, x, dy, relu_y, mean, partial);
  CPD_CHECK_LAUNCH();
  bn_backward_finalize_kernel<<<unsigned(CEIL_DIV(c, int64_t(kThreads))), kThreads, 0, stream>>>(
      int32_t(c), splits, double(count), partial, gamma, invstd, coef, dgamma, dbeta);
  CPD_CHECK_LAUNCH();
  bn_backward_apply_kernel<<<BlocksFor(size_t(total)), kThreads, 0, stream>>>(
      int32_t(total), int32_t(c), int32_t(hw), x, dy, relu_y, mean, coef, dx);
  CPD_CHECK_LAUNCH();
}

// ---- Pooling ------------------------------------------------------------------------------------

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

// ---- Loss ---------------------------------------------------------------------------------------

double SoftmaxCrossEntropy(int64_t n, int64_t k, const float* logits, const int32_t* labels,
                           float* dlogits) {
  if (n < 1 || k < 1) throw std::invalid_argument("cuda SoftmaxCrossEntropy: empty logits");
  RequireIndex32("SoftmaxCrossEntropy", n * k);
  cudaStream_t stream = StreamHandle();
  // Scratch: the labels (n int32, rounded up to whole doubles), then the row losses.
  const size_t label_bytes = CEIL_DIV(size_t(n) * sizeof(int32_t), sizeof(double)) * sizeof(double);
  char* base = static_cast<char*>(
      internal::ScratchMemory(Scratch::kLabels, label_bytes + size_t(n) * sizeof(double)));
  auto* d_labels = reinterpret_cast<int32_t*>(base);
  auto* d_loss = reinterpret_cast<double*>(base + label_bytes);
  CPD_CUDA_CHECK(cudaMemcpyAsync(d_labels, labels, size_t(n) * sizeof(int32_t),
                                 cudaMemcpyHostToDevice, stream));
  softmax_xent_kernel<<<unsigned(CEIL_DIV(n, int64_t(kThreads))), kThreads, 0, stream>>>(
      int32_t(n), int32_t(k), logits, d_labels, 1.0 / double(n), d_loss, dlogits);
  CPD_CHECK_LAUNCH();
  std::vector<double> rows(static_cast<size_t>(n));
  CPD_CUDA_CHECK(cudaMemcpyAsync(rows.data(), d_loss, size_t(n) * sizeof(double),
                                 cudaMemcpyDeviceToHost, stream));
  CPD_CUDA_CHECK(cudaStreamSynchronize(stream));
  double total = 0;  // rows in order, as the CPU adds them
  for (double r : rows) total += r;
  return total * (1.0 / double(n));
}

// ---- Optimiser ----------------------------------------------------------------------------------

void SgdUpdate(const OptimizerChunk* chunks, size_t num_chunks, const OptimizerCoeffs* coeffs,
               float momentum, bool lars, bool use_momentum, bool nesterov) {
  if (num_chunks == 0) return;
  if (num_chunks > size_t(kMaxIndex32)) {
    throw std::invalid_argument("cuda SgdUpdate: too many chunks");
  }
  cudaStream_t stream = StreamHandle();
  const unsigned blocks = unsigned(num_chunks);
  if (!use_momentum) {
    // Nesterov needs momentum (OptimizerOptions::Validate); LARS without momentum is SGD's rule.
    sgd_update_kernel<false, false, false>
        <<<blocks, kThreads, 0, stream>>>(chunks, coeffs, momentum);
  } else if (!lars) {
    if (nesterov) {
      sgd_update_kernel<false, true, true>
          <<<blocks, kThreads, 0, stream>>>(chunks, coeffs, momentum);
    } else {
      sgd_update_kernel<false, true, false>
          <<<blocks, kThreads, 0, stream>>>(chunks, coeffs, momentum);
    }
  } else if (nesterov) {
    sgd_update_kernel<true, true, true><<<blocks, kThreads, 0, stream>>>(chunks, coeffs, momentum);
  } else {
    sgd_update_kernel<true, true, false><<<blocks, kThreads, 0, stream>>>(chunks, coeffs, momentum);
  }
  CPD_CHECK_LAUNCH();
}

void ChunkSumSquares(const OptimizerChunk* chunks, size_t num_chunks, double* partial) {
  if (num_chunks == 0) return;
  if (2 * num_chunks > size_t(kMaxIndex32)) {
    throw std::invalid_argument("cuda ChunkSumSquares: too many chunks");
  }
  chunk_sum_squares_kernel<<<unsigned(2 * num_chunks), kThreads, 0, StreamHandle()>>>(chunks,
                                                                                      partial);
  CPD_CHECK_LAUNCH();
}

}  // namespace cpd::runtime::cuda
