// The Transformer layers' kernels of runtime/engine/cuda_transformer.h: embeddings, layer
// normalisation, GELU, head split/merge, the causal softmax, and the batched products of
// attention (cuBLAS, through cuda_context.cc). Layout as cuda_ops.cu: kernels (names end in
// _kernel), then the launchers, which check their sizes, size the grid with CEIL_DIV, launch on
// the runtime's stream and check cudaGetLastError().
//
// Where the CPU defines a result by a fixed order of operations, a kernel performs the same
// operations in the same order: the per-element and per-row formulas are the CPU's own
// (runtime/engine/lm_elementwise.h), and each reduction the CPU runs in a fixed order on one
// thread (a table gradient's column in token order, a LayerNorm row's statistics in index order,
// dgamma/dbeta in row order) runs on one GPU thread in that order. Built with -fmad=false, as
// the rest of the runtime's kernels.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "runtime/engine/cuda_internal.h"
#include "runtime/engine/cuda_kernels.cuh"
#include "runtime/engine/cuda_transformer.h"
#include "runtime/engine/lm_elementwise.h"

namespace cpd::runtime::cuda {

using internal::BlocksFor;
using internal::kThreads;
using internal::RequireIndex32;
using internal::Scratch;
using internal::StreamHandle;

namespace {

// ---------------------------------------------------------------------------------------------
// Kernels: embeddings

__global__ void embedding_forward_kernel(int32_t total, int32_t c, const int32_t* __restrict__ ids,
                                         const float* __restrict__ table, float* __restrict__ y) {
  CPD_GRID_STRIDE_32(e, total) {
    const int32_t i = e / c, j = e - i * c;
    y[e] = table[size_t(ids[i]) * size_t(c) + size_t(j)];
  }
}

// dtable rows [v0, v1) of column j, for the block's range of the vocabulary (blockIdx.y) and
// columns (blockIdx.x): zeroed, then every token whose id falls in the range adds its dy in token
// order. Each element is summed by exactly one thread, from 0, in token order: the CPU's sum.
// The ids are read by all threads at once (one broadcast load per token).
__global__ void embedding_backward_kernel(int32_t n, int32_t c, int32_t vocab, int32_t range_rows,
                                          const int32_t* __restrict__ ids,
                                          const float* __restrict__ dy,
                                          float* __restrict__ dtable) {
  const int32_t j = int32_t(blockIdx.x * blockDim.x + threadIdx.x);
  if (j >= c) return;
  const int32_t v0 = int32_t(blockIdx.y) * range_rows;
  const int32_t v1 = v0 + range_rows < vocab ? v0 + range_rows : vocab;
  for (int32_t v = v0; v < v1; ++v) dtable[size_t(v) * size_t(c) + size_t(j)] = 0.f;
  for (int32_t i = 0; i < n; ++i) {
    const int32_t id = ids[i];
    if (id >= v0 && id < v1) {
      dtable[size_t(id) * size_t(c) + size_t(j)] += dy[size_t(i) * size_t(c) + size_t(j)];
    }
  }
}

// y = x + table[position], the table broadcast over the batch (tc = t * c).
__global__ void position_add_kernel(int32_t total, int32_t tc, const float* __restrict__ x,
                                    const float* __restrict__ table, float* __restrict__ y) {
  CPD_GRID_STRIDE_32(e, total) y[e] = x[e] + table[e % tc];
}

// dtable [p, j] = sum over the batch of dy [i, p, j], i ascending, from 0 (the CPU's order).
__global__ void position_add_backward_kernel(int32_t b, int32_t tc, const float* __restrict__ dy,
                                             float* __restrict__ dtable) {
  CPD_GRID_STRIDE_32(e, tc) {
    float s = 0.f;
    for (int32_t i = 0; i < b; ++i) s += dy[size_t(i) * size_t(tc) + size_t(e)];
    dtable[e] = s;
  }
}

// ---------------------------------------------------------------------------------------------
// Kernels: layer normalisation

// One thread per row: the CPU's row statistics (the same double sums in the same order).
__global__ void layernorm_stats_kernel(int32_t rows, int32_t c, const float* __restrict__ x,
                                       float eps, float* __restrict__ mean,
                                       float* __restrict__ rstd) {
  CPD_GRID_STRIDE_32(r, rows) {
    lm::LayerNormRowStats(c, x + size_t(r) * size_t(c), eps, mean + r, rstd + r);
  }
}

__global__ void layernorm_apply_kernel(int32_t total, int32_t c, const float* __restrict__ x,
                                       const float* __restrict__ gamma,
                                       const float* __restrict__ beta,
                                       const float* __restrict__ mean,
                                       const float* __restrict__ rstd, float* __restrict__ y) {
  CPD_GRID_STRIDE_32(e, total) {
    const int32_t r = e / c, j = e - r * c;
    y[e] = lm::LayerNormValue(x[e], mean[r], rstd[r], gamma[j], beta[j]);
  }
}

// One thread per row: the CPU's mean(g) and mean(g * xhat), into means [rows, 2].
__global__ void layernorm_grad_means_kernel(int32_t rows, int32_t c, const float* __restrict__ x,
                                            const float* __restrict__ dy,
                                            const float* __restrict__ gamma,
                                            const float* __restrict__ mean,
                                            const float* __restrict__ rstd,
                                            float* __restrict__ means) {
  CPD_GRID_STRIDE_32(r, rows) {
    const size_t at = size_t(r) * size_t(c);
    lm::LayerNormRowGradMeans(c, x + at, dy + at, gamma, mean[r], rstd[r], means + 2 * r,
                              means + 2 * r + 1);
  }
}

__global__ void layernorm_input_grad_kernel(
    int32_t total, int32_t c, const float* __restrict__ x, const float* __restrict__ dy,
    const float* __restrict__ gamma, const float* __restrict__ mean, const float* __restrict__ rstd,
    const float* __restrict__ means, float* __restrict__ dx) {
  CPD_GRID_STRIDE_32(e, total) {
    const int32_t r = e / c, j = e - r * c;
    dx[e] = lm::LayerNormInputGrad(x[e], dy[e], gamma[j], mean[r], rstd[r], means[2 * r],
                                   means[2 * r + 1]);
  }
}

// One thread per column: dgamma and dbeta summed in double over the rows in row order (the CPU's
// column-block loop).
__global__ void layernorm_param_grad_kernel(int32_t rows, int32_t c, const float* __restrict__ x,
                                            const float* __restrict__ dy,
                                            const float* __restrict__ mean,
                                            const float* __restrict__ rstd,
                                            float* __restrict__ dgamma, float* __restrict__ dbeta) {
  CPD_GRID_STRIDE_32(j, c) {
    double g = 0.0, b = 0.0;
    for (int32_t r = 0; r < rows; ++r) {
      const size_t e = size_t(r) * size_t(c) + size_t(j);
      const float d = dy[e];
      g += lm::LayerNormGammaTerm(x[e], d, mean[r], rstd[r]);
      b += d;
    }
    dgamma[j] = float(g);
    dbeta[j] = float(b);
  }
}

// ---------------------------------------------------------------------------------------------
// Kernels: GELU

__global__ void gelu_kernel(size_t n, const float* __restrict__ x, float* __restrict__ y) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    y[i] = lm::GeluValue(x[i]);
  }
}

__global__ void gelu_backward_kernel(size_t n, const float* __restrict__ x,
                                     const float* __restrict__ dy, float* __restrict__ dx) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    dx[i] = lm::GeluGrad(x[i], dy[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// Kernels: heads. Element e of qkv [b, t, 3, h, d] (or of y [b, t, h, d]) and its place in the
// per-head layout [b, h, t, d].

struct HeadIndex {
  int32_t part;  // q, k or v (0 for a merge)
  int32_t head;  // flat index into [b, h, t, d]
};

__device__ __forceinline__ HeadIndex HeadOf(int32_t e, int32_t t, int32_t h, int32_t d,
                                            int32_t parts) {
  const int32_t c = h * d;
  const int32_t row = e / (parts * c), rem = e - row * (parts * c);
  const int32_t part = rem / c, hc = rem - part * c;
  const int32_t hi = hc / d, di = hc - hi * d;
  const int32_t bi = row / t, ti = row - bi * t;
  return {part, ((bi * h + hi) * t + ti) * d + di};
}

__global__ void split_heads_kernel(int32_t total, int32_t t, int32_t h, int32_t d,
                                   const float* __restrict__ qkv, float* __restrict__ q,
                                   float* __restrict__ k, float* __restrict__ v) {
  CPD_GRID_STRIDE_32(e, total) {
    const HeadIndex at = HeadOf(e, t, h, d, 3);
    float* out = at.part == 0 ? q : (at.part == 1 ? k : v);
    out[at.head] = qkv[e];
  }
}

__global__ void split_heads_backward_kernel(int32_t total, int32_t t, int32_t h, int32_t d,
                                            const float* __restrict__ dq,
                                            const float* __restrict__ dk,
                                            const float* __restrict__ dv,
                                            float* __restrict__ dqkv) {
  CPD_GRID_STRIDE_32(e, total) {
    const HeadIndex at = HeadOf(e, t, h, d, 3);
    const float* in = at.part == 0 ? dq : (at.part == 1 ? dk : dv);
    dqkv[e] = in[at.head];
  }
}

__global__ void merge_heads_kernel(int32_t total, int32_t t, int32_t h, int32_t d,
                                   const float* __restrict__ o, float* __restrict__ y) {
  CPD_GRID_STRIDE_32(e, total) y[e] = o[HeadOf(e, t, h, d, 1).head];
}

__global__ void merge_heads_backward_kernel(int32_t total, int32_t t, int32_t h, int32_t d,
                                            const float* __restrict__ dy,
                                            float* __restrict__ dout) {
  CPD_GRID_STRIDE_32(e, total) dout[HeadOf(e, t, h, d, 1).head] = dy[e];
}

// ---------------------------------------------------------------------------------------------
// Kernels: the causal softmax, one warp per row of `rows` rows [t] (row % t is the query
// position; keys 0..r are visible). The lanes take the columns in turn; the row's maximum (as
// std::max's left fold: exact in any order but for which NaN or zero sign survives, which the
// result does not see) and its double sum are reduced over the warp in a fixed order.

constexpr int kWarpsPerBlock = kThreads / 32;

__device__ __forceinline__ double WarpSum(double s) {
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  return s;
}

__global__ void causal_softmax_kernel(int32_t rows, int32_t t, const float* __restrict__ s,
                                      float* __restrict__ p) {
  const int32_t lane = int32_t(threadIdx.x & 31);
  const int32_t row = int32_t(blockIdx.x) * kWarpsPerBlock + int32_t(threadIdx.x >> 5);
  if (row >= rows) return;  // the whole warp leaves together
  const int32_t r = row % t;
  const float* sr = s + size_t(row) * size_t(t);
  float* pr = p + size_t(row) * size_t(t);
  float mx = sr[0];
  for (int32_t j = lane; j <= r; j += 32) mx = mx < sr[j] ? sr[j] : mx;
  for (int off = 16; off > 0; off >>= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, mx, off);
    mx = mx < other ? other : mx;
  }
  double sum = 0.0;
  for (int32_t j = lane; j <= r; j += 32) {
    const float e = lm::SoftmaxExp(sr[j], mx);
    pr[j] = e;
    sum += e;
  }
  const float inv = float(1.0 / WarpSum(sum));
  for (int32_t j = lane; j < t; j += 32) pr[j] = j <= r ? pr[j] * inv : 0.f;
}

__global__ void causal_softmax_backward_kernel(int32_t rows, int32_t t, const float* __restrict__ p,
                                               const float* __restrict__ dp,
                                               float* __restrict__ ds) {
  const int32_t lane = int32_t(threadIdx.x & 31);
  const int32_t row = int32_t(blockIdx.x) * kWarpsPerBlock + int32_t(threadIdx.x >> 5);
  if (row >= rows) return;
  const int32_t r = row % t;
  const size_t at = size_t(row) * size_t(t);
  double dot = 0.0;
  for (int32_t j = lane; j <= r; j += 32) dot += double(dp[at + j]) * p[at + j];
  const float fd = float(WarpSum(dot));
  for (int32_t j = lane; j < t; j += 32) {
    ds[at + j] = j <= r ? lm::SoftmaxGrad(p[at + j], dp[at + j], fd) : 0.f;
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers

// ---- Embeddings -------------------------------------------------------------------------------

void EmbeddingForward(int64_t n, int64_t c, const int32_t* ids, const float* table, float* y) {
  const int64_t total = n * c;
  if (total == 0) return;
  RequireIndex32("EmbeddingForward", total);
  embedding_forward_kernel<<<BlocksFor(size_t(total)), kThreads, 0, StreamHandle()>>>(
      int32_t(total), int32_t(c), ids, table, y);
  CPD_CHECK_LAUNCH();
}

void EmbeddingBackward(int64_t n, int64_t c, int64_t vocab, const int32_t* ids, const float* dy,
                       float* dtable) {
  if (c == 0 || vocab == 0) return;
  RequireIndex32("EmbeddingBackward", n * c);
  RequireIndex32("EmbeddingBackward", vocab * c);
  // Blocks of columns times ranges of the vocabulary, about 512 blocks in all (enough to fill
  // a GPU; every block reads all n ids). Which thread sums an element changes with the ranges,
  // the order of its sum does not.
  const int64_t column_blocks = CEIL_DIV(c, int64_t(kThreads));
  int64_t ranges = CEIL_DIV(int64_t(512), column_blocks);
  ranges = ranges < vocab ? ranges : vocab;
  ranges = ranges < 65535 ? ranges : 65535;  // gridDim.y's limit
  const int64_t range_rows = CEIL_DIV(vocab, ranges);
  ranges = CEIL_DIV(vocab, range_rows);
  const dim3 grid{unsigned(column_blocks), unsigned(ranges)};
  embedding_backward_kernel<<<grid, kThreads, 0, StreamHandle()>>>(
      int32_t(n), int32_t(c), int32_t(vocab), int32_t(range_rows), ids, dy, dtable);
  CPD_CHECK_LAUNCH();
}

void PositionAddForward(int64_t b, int64_t t, int64_t c, const float* x, const float* table,
                        float* y) {
  const int64_t total = b * t * c;
  if (total == 0) return;
  RequireIndex32("PositionAddForward", total);
  position_add_kernel<<<BlocksFor(size_t(total)), kThreads, 0, StreamHandle()>>>(
      int32_t(total), int32_t(t * c), x, table, y);
  CPD_CHECK_LAUNCH();
}

void PositionAddBackward(int64_t b, int64_t t, int64_t c, const float* dy, float* dtable) {
  const int64_t tc = t * c;
  if (tc == 0) return;
  RequireIndex32("PositionAddBackward", b * tc);
  position_add_backward_kernel<<<BlocksFor(size_t(tc)), kThreads, 0, StreamHandle()>>>(
      int32_t(b), int32_t(tc), dy, dtable);
  CPD_CHECK_LAUNCH();
}

// ---- Layer normalisation ----------------------------------------------------------------------

void LayerNormForward(int64_t rows, int64_t c, const float* x, const float* gamma,
                      const float* beta, float eps, float* y, float* mean, float* rstd) {
  const int64_t total = rows * c;
  if (rows == 0) return;
  RequireIndex32("LayerNormForward", total);
  cudaStream_t stream = StreamHandle();
  layernorm_stats_kernel<<<BlocksFor(size_t(rows)), kThreads, 0, stream>>>(
      int32_t(rows), int32_t(c), x, eps, mean, rstd);
  CPD_CHECK_LAUNCH();
  layernorm_apply_kernel<<<BlocksFor(size_t(total)), kThreads, 0, stream>>>(
      int32_t(total), int32_t(c), x, gamma, beta, mean, rstd, y);
  CPD_CHECK_LAUNCH();
}

void LayerNormBackward(int64_t rows, int64_t c, const float* x, const float* dy, const float* gamma,
                       const float* mean, const float* rstd, float* dx, float* dgamma,
                       float* dbeta) {
  const int64_t total = rows * c;
  if (c == 0) return;
  RequireIndex32("LayerNormBackward", total);
  RequireIndex32("LayerNormBackward", 2 * rows);
  cudaStream_t stream = StreamHandle();
  if (rows > 0) {
    auto* means = static_cast<float*>(
        internal::ScratchMemory(Scratch::kPartials, size_t(rows) * 2 * sizeof(float)));
    layernorm_grad_means_kernel<<<BlocksFor(size_t(rows)), kThreads, 0, stream>>>(
        int32_t(rows), int32_t(c), x, dy, gamma, mean, rstd, means);
    CPD_CHECK_LAUNCH();
    layernorm_input_grad_kernel<<<BlocksFor(size_t(total)), kThreads, 0, stream>>>(
        int32_t(total), int32_t(c), x, dy, gamma, mean, rstd, means, dx);
    CPD_CHECK_LAUNCH();
  }
  layernorm_param_grad_kernel<<<BlocksFor(size_t(c)), kThreads, 0, stream>>>(
      int32_t(rows), int32_t(c), x, dy, mean, rstd, dgamma, dbeta);
  CPD_CHECK_LAUNCH();
}

// ---- GELU -------------------------------------------------------------------------------------

void GeluForward(size_t n, const float* x, float* y) {
  if (n == 0) return;
  gelu_kernel<<<BlocksFor(n), kThreads, 0, StreamHandle()>>>(n, x, y);
  CPD_CHECK_LAUNCH();
}

void GeluBackward(size_t n, const float* x, const float* dy, float* dx) {
  if (n == 0) return;
  gelu_backward_kernel<<<BlocksFor(n), kThreads, 0, StreamHandle()>>>(n, x, dy, dx);
  CPD_CHECK_LAUNCH();
}

// ---- Attention --------------------------------------------------------------------------------

void SplitHeads(int64_t b, int64_t t, int64_t h, int64_t d, const float* qkv, float* q, float* k,
                float* v) {
  const int64_t total = b * t * 3 * h * d;
  if (total == 0) return;
  RequireIndex32("SplitHeads", total);
  split_heads_kernel<<<BlocksFor(size_t(total)), kThreads, 0, StreamHandle()>>>(
      int32_t(total), int32_t(t), int32_t(h), int32_t(d), qkv, q, k, v);
  CPD_CHECK_LAUNCH();
}

void SplitHeadsBackward(int64_t b, int64_t t, int64_t h, int64_t d, const float* dq,
                        const float* dk, const float* dv, float* dqkv) {
  const int64_t total = b * t * 3 * h * d;
  if (total == 0) return;
  RequireIndex32("SplitHeadsBackward", total);
  split_heads_backward_kernel<<<BlocksFor(size_t(total)), kThreads, 0, StreamHandle()>>>(
      int32_t(total), int32_t(t), int32_t(h), int32_t(d), dq, dk, dv, dqkv);
  CPD_CHECK_LAUNCH();
}

void MergeHeads(int64_t b, int64_t t, int64_t h, int64_t d, const float* o, float* y) {
  const int64_t total = b * t * h * d;
  if (total == 0) return;
  RequireIndex32("MergeHeads", total);
  merge_heads_kernel<<<BlocksFor(size_t(total)), kThreads, 0, StreamHandle()>>>(
      int32_t(total), int32_t(t), int32_t(h), int32_t(d), o, y);
  CPD_CHECK_LAUNCH();
}

void MergeHeadsBackward(int64_t b, int64_t t, int64_t h, int64_t d, const float* dy, float* dout) {
  const int64_t total = b * t * h * d;
  if (total == 0) return;
  RequireIndex32("MergeHeadsBackward", total);
  merge_heads_backward_kernel<<<BlocksFor(size_t(total)), kThreads, 0, StreamHandle()>>>(
      int32_t(total), int32_t(t), int32_t(h), int32_t(d), dy, dout);
  CPD_CHECK_LAUNCH();
}

void CausalSoftmaxForward(int64_t batch, int64_t t, const float* s, float* p) {
  const int64_t rows = batch * t;
  if (rows == 0) return;
  RequireIndex32("CausalSoftmaxForward", rows * t);
  causal_softmax_kernel<<<unsigned(CEIL_DIV(rows, int64_t(kWarpsPerBlock))), kThreads, 0,
                          StreamHandle()>>>(int32_t(rows), int32_t(t), s, p);
  CPD_CHECK_LAUNCH();
}

void CausalSoftmaxBackward(int64_t batch, int64_t t, const float* p, const float* dp, float* ds) {
  const int64_t rows = batch * t;
  if (rows == 0) return;
  RequireIndex32("CausalSoftmaxBackward", rows * t);
  causal_softmax_backward_kernel<<<unsigned(CEIL_DIV(rows, int64_t(kWarpsPerBlock))), kThreads, 0,
                                   StreamHandle()>>>(int32_t(rows), int32_t(t), p, dp, ds);
  CPD_CHECK_LAUNCH();
}

// The products: one strided-batched GEMM per product, the CPU's Sgemm calls with the batch as
// cuBLAS's batch.
void BatchedMatmul(int64_t batch, int64_t m, int64_t n, int64_t k, bool trans_b, float alpha,
                   const float* a, const float* b, float* c) {
  // a [m, k]; b [n, k] (trans_b) or [k, n]; c [m, n].
  internal::GemmRowMajorStridedBatched(false, trans_b, m, n, k, alpha, a, k, m * k, b,
                                       trans_b ? k : n, n * k, 0.f, c, n, m * n, batch);
}

void BatchedMatmulBackward(int64_t batch, int64_t m, int64_t n, int64_t k, bool trans_b,
                           float alpha, const float* a, const float* b, const float* dc, float* da,
                           float* db) {
  if (trans_b) {  // c = alpha a b^T, b [n, k]: da = alpha dc b, db = alpha dc^T a
    internal::GemmRowMajorStridedBatched(false, false, m, k, n, alpha, dc, n, m * n, b, k, n * k,
                                         0.f, da, k, m * k, batch);
    internal::GemmRowMajorStridedBatched(true, false, n, k, m, alpha, dc, n, m * n, a, k, m * k,
                                         0.f, db, k, n * k, batch);
  } else {  // c = alpha a b, b [k, n]: da = alpha dc b^T, db = alpha a^T dc
    internal::GemmRowMajorStridedBatched(false, true, m, k, n, alpha, dc, n, m * n, b, n, n * k,
                                         0.f, da, k, m * k, batch);
    internal::GemmRowMajorStridedBatched(true, false, k, n, m, alpha, a, k, m * k, dc, n, m * n,
                                         0.f, db, n, n * k, batch);
  }
}

}  // namespace cpd::runtime::cuda
