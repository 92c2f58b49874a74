// The runtime's own CUDA kernels (see runtime/engine/cuda_ops.h): elementwise ops, dropout, biases and
// the loss here; batch normalisation, pooling and the optimiser in cuda_kernels_batchnorm.cu,
// cuda_kernels_pooling.cu and cuda_kernels_optimizer.cu; what they share in cuda_kernels.cuh.
// Layout of each file, after llm.c: the kernels (names end in _kernel), then the launchers,
// which check their sizes, size the grid with CEIL_DIV, launch on the runtime's stream and
// check cudaGetLastError().
//
// Bit-exactness with the CPU kernels (runtime/engine/cpu_ops.h): these files are built with
// -fmad=false (no FMA contraction, as the CPU code's -ffp-contract=off) and without fast math,
// and where the CPU result is defined by a fixed order of float operations (elementwise ops,
// pooling, dropout, the optimiser, LARS's norms) the kernels perform the same operations in
// the same order.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "kernels/grid.h"
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

__global__ void scale_kernel(size_t n, float s, const float* x, float* y) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    y[i] = __fmul_rn(x[i], s);
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

void Scale(size_t n, float s, const float* x, float* y) {
  if (n == 0) return;
  scale_kernel<<<BlocksFor(n), kThreads, 0, StreamHandle()>>>(n, s, x, y);
  CPD_CHECK_LAUNCH();
}

void DropoutApply(size_t n, uint64_t key, uint32_t threshold, float scale, const float* x,
                  float* y) {
  if (n == 0) return;
  dropout_kernel<<<BlocksFor(n), kThreads, 0, StreamHandle()>>>(n, key, threshold, scale, x, y);
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

}  // namespace cpd::runtime::cuda
