// The batch-normalisation kernels of runtime/engine/cuda_ops.h (see cuda_ops.cu for the layout and
// the bit-exactness rules).
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "runtime/engine/cuda_internal.h"
#include "runtime/engine/cuda_kernels.cuh"
#include "runtime/engine/cuda_ops.h"

namespace cpd::runtime::cuda {

using internal::BlocksFor;
using internal::BlockSum2;
using internal::kThreads;
using internal::RequireIndex32;
using internal::Scratch;
using internal::StreamHandle;

namespace {

// ---------------------------------------------------------------------------------------------
// Kernels
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

// Splits of a channel's count values for the batch-norm reductions: about 4096 values per
// block, at most 1024 splits.
int32_t SplitsFor(int32_t count) {
  const int32_t s = int32_t(CEIL_DIV(int64_t(count), int64_t(4096)));
  return s < 1 ? 1 : (s > 1024 ? 1024 : s);
}

// The two-step reduction of BatchNormTrainForward and BatchNormBackward over each channel's
// count = n * hw values: `splits` blocks of `per` values, and scratch for their partial sums.
// Checks the sizes first; `op` names the caller in the messages.
struct ChannelReduction {
  int32_t count, splits, per;
  double* partial;
};

ChannelReduction PlanChannelReduction(const char* op, int64_t n, int64_t c, int64_t hw) {
  if (n * hw < 1) {
    throw std::invalid_argument(std::string("cuda ") + op + ": no values per channel");
  }
  RequireIndex32("BatchNorm", n * c * hw);
  if (c > 65535) throw std::invalid_argument("cuda BatchNorm: more than 65535 channels");
  ChannelReduction r;
  r.count = int32_t(n * hw);
  r.splits = SplitsFor(r.count);
  r.per = int32_t(CEIL_DIV(int64_t(r.count), int64_t(r.splits)));
  r.partial = static_cast<double*>(internal::ScratchMemory(
      Scratch::kPartials, size_t(c) * size_t(r.splits) * 2 * sizeof(double)));
  return r;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers

void BatchNormTrainForward(int64_t n, int64_t c, int64_t hw, const float* x, const float* gamma,
                           const float* beta, float eps, bool relu, float* y, float* mean,
                           float* var, float* invstd) {
  const int64_t total = n * c * hw;
  if (c == 0) return;
  const ChannelReduction r = PlanChannelReduction("BatchNormTrainForward", n, c, hw);
  cudaStream_t stream = StreamHandle();
  bn_stats_partial_kernel<<<dim3(unsigned(r.splits), unsigned(c)), kThreads, 0, stream>>>(
      int32_t(n), int32_t(c), int32_t(hw), r.per, x, r.partial);
  CPD_CHECK_LAUNCH();
  bn_stats_finalize_kernel<<<unsigned(CEIL_DIV(c, int64_t(kThreads))), kThreads, 0, stream>>>(
      int32_t(c), int32_t(hw), r.splits, double(r.count), eps, x, r.partial, mean, var, invstd);
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
  const ChannelReduction r = PlanChannelReduction("BatchNormBackward", n, c, hw);
  cudaStream_t stream = StreamHandle();
  auto* coef = static_cast<float*>(
      internal::ScratchMemory(Scratch::kCoefficients, size_t(c) * 3 * sizeof(float)));
  bn_backward_partial_kernel<<<dim3(unsigned(r.splits), unsigned(c)), kThreads, 0, stream>>>(
      int32_t(n), int32_t(c), int32_t(hw), r.per, x, dy, relu_y, mean, r.partial);
  CPD_CHECK_LAUNCH();
  bn_backward_finalize_kernel<<<unsigned(CEIL_DIV(c, int64_t(kThreads))), kThreads, 0, stream>>>(
      int32_t(c), r.splits, double(r.count), r.partial, gamma, invstd, coef, dgamma, dbeta);
  CPD_CHECK_LAUNCH();
  bn_backward_apply_kernel<<<BlocksFor(size_t(total)), kThreads, 0, stream>>>(
      int32_t(total), int32_t(c), int32_t(hw), x, dy, relu_y, mean, coef, dx);
  CPD_CHECK_LAUNCH();
}

}  // namespace cpd::runtime::cuda
