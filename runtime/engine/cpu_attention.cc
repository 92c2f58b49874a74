#include "runtime/engine/cpu_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/grid.h"
#include "runtime/engine/cpu_gemm.h"
#include "runtime/engine/cpu_internal.h"
#include "runtime/engine/cpu_transformer.h"
#include "runtime/engine/lm_elementwise.h"

namespace cpd::runtime::cpu {

using internal::TeamSize;

namespace {

// One (batch, head) pair's matrices and its place in the [pairs, t, t] probability layout.
struct Pair {
  int64_t index, t, d;
  const float *q, *k, *v;
};

Pair PairAt(int64_t i, int64_t t, int64_t d, const float* q, const float* k, const float* v) {
  const int64_t off = i * t * d;
  return {i, t, d, q + off, k + off, v + off};
}

int TeamForPairs(int64_t pairs) {
  return int(std::max<int64_t>(1, std::min<int64_t>(TeamSize(), pairs)));
}

// s [rows, n] = alpha Q[r0 : r0 + rows] K[0 : n]^T: the scores of a query block against the
// keys its last row may see.
void BlockScores(const Pair& p, int64_t r0, int64_t rows, int64_t n, float alpha, float* s) {
  Sgemm(false, true, rows, n, p.d, alpha, p.q + r0 * p.d, p.d, p.k, p.d, 0.f, s, n);
}

// Row rr of a block (query r = r0 + rr) in place: scores -> the forward's probabilities again,
// from its row statistics (cpu::CausalSoftmaxRow's formula; 0 beyond the diagonal).
void RowProbabilities(float* row, int64_t r, int64_t n, float mx, float inv) {
  for (int64_t j = 0; j <= r; ++j) row[j] = lm::SoftmaxExp(row[j], mx) * inv;
  std::fill(row + r + 1, row + n, 0.f);
}

// dst = the dropped-out probabilities of row r (src scaled and masked), 0 beyond the diagonal.
void RowDropout(const AttentionDropout& drop, const Pair& p, int64_t r, int64_t n, const float* src,
                float* dst) {
  const uint64_t first = uint64_t((p.index * p.t + r) * p.t);
  for (int64_t j = 0; j < n; ++j) {
    const bool keep = kernels::RandomBits(drop.key, first + uint64_t(j)) >= drop.threshold;
    dst[j] = keep ? src[j] * drop.scale : 0.f;
  }
}

void ForwardPair(const Pair& p, float alpha, const AttentionDropout& drop, float* o, float* row_max,
                 float* row_inv, std::vector<float>* scratch) {
  const int64_t t = p.t, blk = kAttentionQueryBlock;
  scratch->resize(size_t(2 * blk * t));
  float* s = scratch->data();
  float* dropped = s + blk * t;
  for (int64_t r0 = 0; r0 < t; r0 += blk) {
    const int64_t rows = std::min(blk, t - r0), n = r0 + rows;
    BlockScores(p, r0, rows, n, alpha, s);
    for (int64_t rr = 0; rr < rows; ++rr) {
      const int64_t r = r0 + rr;
      float* row = s + rr * n;
      CausalSoftmaxRow(row, r, n, row, &row_max[r], &row_inv[r]);
      if (drop.threshold != 0) RowDropout(drop, p, r, n, row, dropped + rr * n);
    }
    const float* used = drop.threshold != 0 ? dropped : s;
    Sgemm(false, false, rows, p.d, n, 1.f, used, n, p.v, p.d, 0.f, o + r0 * p.d, p.d);
  }
}

// Per block: P recomputed; dV += P'^T dO; dP' = dO V^T; dP = dropout'(dP');
// dS = P (dP - D) with D = rowsum(dO o O); dQ = alpha dS K; dK += alpha dS^T Q.
void BackwardPair(const Pair& p, float alpha, const float* o, const float* row_max,
                  const float* row_inv, const AttentionDropout& drop, const float* dout, float* dq,
                  float* dk, float* dv, std::vector<float>* scratch) {
  const int64_t t = p.t, d = p.d, blk = kAttentionQueryBlock;
  scratch->resize(size_t(3 * blk * t));
  float* s = scratch->data();
  float* dropped = s + blk * t;
  float* ds = dropped + blk * t;
  std::fill(dk, dk + t * d, 0.f);
  std::fill(dv, dv + t * d, 0.f);
  for (int64_t r0 = 0; r0 < t; r0 += blk) {
    const int64_t rows = std::min(blk, t - r0), n = r0 + rows;
    BlockScores(p, r0, rows, n, alpha, s);
    for (int64_t rr = 0; rr < rows; ++rr) {
      const int64_t r = r0 + rr;
      RowProbabilities(s + rr * n, r, n, row_max[r], row_inv[r]);
      if (drop.threshold != 0) RowDropout(drop, p, r, n, s + rr * n, dropped + rr * n);
    }
    const float* used = drop.threshold != 0 ? dropped : s;
    Sgemm(true, false, n, d, rows, 1.f, used, n, dout + r0 * d, d, 1.f, dv, d);
    Sgemm(false, true, rows, n, d, 1.f, dout + r0 * d, d, p.v, d, 0.f, ds, n);
    for (int64_t rr = 0; rr < rows; ++rr) {
      const int64_t r = r0 + rr;
      float* dsr = ds + rr * n;
      if (drop.threshold != 0) {  // dP = dP' through the same mask and scale
        RowDropout(drop, p, r, n, dsr, dsr);
      }
      double dot = 0;
      for (int64_t c = 0; c < d; ++c) dot += double(dout[r * d + c]) * o[r * d + c];
      const float fd = float(dot);
      const float* pr = s + rr * n;
      for (int64_t j = 0; j <= r; ++j) dsr[j] = lm::SoftmaxGrad(pr[j], dsr[j], fd);
      std::fill(dsr + r + 1, dsr + n, 0.f);
    }
    Sgemm(false, false, rows, d, n, alpha, ds, n, p.k, d, 0.f, dq + r0 * d, d);
    Sgemm(true, false, n, d, rows, alpha, ds, n, p.q + r0 * d, d, 1.f, dk, d);
  }
}

}  // namespace

void FusedCausalAttentionForward(int64_t pairs, int64_t t, int64_t d, float alpha, const float* q,
                                 const float* k, const float* v, const AttentionDropout& dropout,
                                 float* o, float* row_max, float* row_inv) {
  UseSingleThreadedBlas();
#pragma omp parallel num_threads(TeamForPairs(pairs))
  {
    std::vector<float> scratch;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < pairs; ++i) {
      ForwardPair(PairAt(i, t, d, q, k, v), alpha, dropout, o + i * t * d, row_max + i * t,
                  row_inv + i * t, &scratch);
    }
  }
}

void FusedCausalAttentionBackward(int64_t pairs, int64_t t, int64_t d, float alpha, const float* q,
                                  const float* k, const float* v, const float* o,
                                  const float* row_max, const float* row_inv,
                                  const AttentionDropout& dropout, const float* do_, float* dq,
                                  float* dk, float* dv) {
  UseSingleThreadedBlas();
#pragma omp parallel num_threads(TeamForPairs(pairs))
  {
    std::vector<float> scratch;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < pairs; ++i) {
      const int64_t off = i * t * d;
      BackwardPair(PairAt(i, t, d, q, k, v), alpha, o + off, row_max + i * t, row_inv + i * t,
                   dropout, do_ + off, dq + off, dk + off, dv + off, &scratch);
    }
  }
}

}  // namespace cpd::runtime::cpu
