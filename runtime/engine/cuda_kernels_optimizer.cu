// The optimiser's update kernels of runtime/engine/cuda_ops.h (see cuda_ops.cu for the layout and
// the bit-exactness rules).
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>

#include "runtime/engine/cuda_internal.h"
#include "runtime/engine/cuda_kernels.cuh"
#include "runtime/engine/cuda_ops.h"

namespace cpd::runtime::cuda {

using internal::kMaxIndex32;
using internal::kThreads;
using internal::StreamHandle;

namespace {

// ---------------------------------------------------------------------------------------------
// Kernels (one block per chunk)

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

// The CPU's AdamW loop (runtime/nn/optimizer.cc) element by element: sqrtf and '/' are IEEE
// round-to-nearest without --use_fast_math, and -fmad=false keeps every product rounded.
__global__ void adamw_update_kernel(const OptimizerChunk* __restrict__ chunks,
                                    const OptimizerCoeffs* __restrict__ coeffs, AdamWCoeffs c) {
  const OptimizerChunk ch = chunks[blockIdx.x];
  const OptimizerCoeffs k = coeffs[ch.param];
  float* __restrict__ w = ch.w;
  const float* __restrict__ g = ch.g;
  float* __restrict__ m = ch.buf;
  float* __restrict__ v = ch.buf2;
  for (uint32_t i = threadIdx.x; i < ch.len; i += blockDim.x) {
    float x = w[i];
    if (k.decay) x = x * k.wd;
    const float gi = g[i];
    const float mi = c.b1 * m[i] + c.one_minus_b1 * gi;
    const float vi = c.b2 * v[i] + (c.one_minus_b2 * gi) * gi;
    m[i] = mi;
    v[i] = vi;
    const float denom = sqrtf(vi) / c.bc2_sqrt + c.eps;
    w[i] = x - (c.step_size * mi) / denom;
  }
}

// Block 2c sums w^2 of chunk c, block 2c + 1 its g^2 (kGradsOnly: block c sums g^2 of chunk c
// into partial[2c + 1]): thread t folds the 64-element block t in the CPU's 8 float lanes, then
// thread 0 adds the blocks and the tail in double, in order.
template <bool kGradsOnly>
__global__ void chunk_sum_squares_kernel(const OptimizerChunk* __restrict__ chunks,
                                         double* __restrict__ partial) {
  __shared__ double block_sums[kThreads];
  const OptimizerChunk ch = chunks[kGradsOnly ? blockIdx.x : blockIdx.x / 2];
  const bool grads = kGradsOnly || (blockIdx.x & 1) != 0;
  const float* __restrict__ x = grads ? ch.g : ch.w;
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
    partial[kGradsOnly ? 2 * blockIdx.x + 1 : blockIdx.x] = total;
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers

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

void AdamWUpdate(const OptimizerChunk* chunks, size_t num_chunks, const OptimizerCoeffs* coeffs,
                 const AdamWCoeffs& c) {
  if (num_chunks == 0) return;
  if (num_chunks > size_t(kMaxIndex32)) {
    throw std::invalid_argument("cuda AdamWUpdate: too many chunks");
  }
  adamw_update_kernel<<<unsigned(num_chunks), kThreads, 0, StreamHandle()>>>(chunks, coeffs, c);
  CPD_CHECK_LAUNCH();
}

void ChunkSumSquares(const OptimizerChunk* chunks, size_t num_chunks, double* partial,
                     bool grads_only) {
  if (num_chunks == 0) return;
  if (2 * num_chunks > size_t(kMaxIndex32)) {
    throw std::invalid_argument("cuda ChunkSumSquares: too many chunks");
  }
  cudaStream_t stream = StreamHandle();
  if (grads_only) {
    chunk_sum_squares_kernel<true><<<unsigned(num_chunks), kThreads, 0, stream>>>(chunks, partial);
  } else {
    chunk_sum_squares_kernel<false>
        <<<unsigned(2 * num_chunks), kThreads, 0, stream>>>(chunks, partial);
  }
  CPD_CHECK_LAUNCH();
}

}  // namespace cpd::runtime::cuda
