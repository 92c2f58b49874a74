#include "runtime/engine/cpu_transformer.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "runtime/engine/cpu_gemm.h"
#include "runtime/engine/cpu_internal.h"
#include "runtime/engine/lm_elementwise.h"

namespace cpd::runtime::cpu {

using internal::kParallelElements;
using internal::TeamSize;

namespace {

// Threads for a pass over `work` elements: one below kParallelElements.
int TeamFor(double work) { return work < double(kParallelElements) ? 1 : TeamSize(); }

// Column blocks of a [rows, c] reduction over rows: each block belongs to one thread, which sums
// its columns in row order, so the result does not depend on the thread count.
int64_t ColumnBlock(int64_t c) { return std::min<int64_t>(c, 64); }

}  // namespace

// ---- Embeddings -------------------------------------------------------------------------------

void EmbeddingForward(int64_t n, int64_t c, const int32_t* ids, const float* table, float* y) {
#pragma omp parallel for num_threads(TeamFor(double(n) * double(c))) schedule(static)
  for (int64_t i = 0; i < n; ++i) std::copy_n(table + int64_t(ids[i]) * c, c, y + i * c);
}

void EmbeddingBackward(int64_t n, int64_t c, int64_t vocab, const int32_t* ids, const float* dy,
                       float* dtable) {
  const int64_t blk = ColumnBlock(c);
  const int64_t blocks = (c + blk - 1) / blk;
#pragma omp parallel for num_threads(TeamFor(double(n + vocab) * double(c))) schedule(static)
  for (int64_t cb = 0; cb < blocks; ++cb) {
    const int64_t c0 = cb * blk, c1 = std::min(c, c0 + blk);
    for (int64_t v = 0; v < vocab; ++v) std::fill(dtable + v * c + c0, dtable + v * c + c1, 0.f);
    for (int64_t i = 0; i < n; ++i) {
      float* dst = dtable + int64_t(ids[i]) * c;
      const float* src = dy + i * c;
#pragma omp simd
      for (int64_t j = c0; j < c1; ++j) dst[j] += src[j];
    }
  }
}

void PositionAddForward(int64_t b, int64_t t, int64_t c, const float* x, const float* table,
                        float* y) {
#pragma omp parallel for num_threads(TeamFor(double(b * t) * double(c))) schedule(static)
  for (int64_t r = 0; r < b * t; ++r) {
    const float* pos = table + (r % t) * c;
#pragma omp simd
    for (int64_t j = 0; j < c; ++j) y[r * c + j] = x[r * c + j] + pos[j];
  }
}

void PositionAddBackward(int64_t b, int64_t t, int64_t c, const float* dy, float* dtable) {
#pragma omp parallel for num_threads(TeamFor(double(b * t) * double(c))) schedule(static)
  for (int64_t p = 0; p < t; ++p) {
    float* dst = dtable + p * c;
    std::fill(dst, dst + c, 0.f);
    for (int64_t i = 0; i < b; ++i) {
      const float* src = dy + (i * t + p) * c;
#pragma omp simd
      for (int64_t j = 0; j < c; ++j) dst[j] += src[j];
    }
  }
}

// ---- Layer normalisation ----------------------------------------------------------------------

void LayerNormForward(int64_t rows, int64_t c, const float* x, const float* gamma,
                      const float* beta, float eps, float* y, float* mean, float* rstd) {
#pragma omp parallel for num_threads(TeamFor(double(rows) * double(c))) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * c;
    float m, rs;
    lm::LayerNormRowStats(c, xr, eps, &m, &rs);
    float* yr = y + r * c;
#pragma omp simd
    for (int64_t j = 0; j < c; ++j) yr[j] = lm::LayerNormValue(xr[j], m, rs, gamma[j], beta[j]);
    mean[r] = m;
    rstd[r] = rs;
  }
}

void LayerNormBackward(int64_t rows, int64_t c, const float* x, const float* dy, const float* gamma,
                       const float* mean, const float* rstd, float* dx, float* dgamma,
                       float* dbeta) {
  // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma, xhat the normalised x.
  const int team = TeamFor(double(rows) * double(c));
#pragma omp parallel for num_threads(team) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * c;
    const float* dyr = dy + r * c;
    const float m = mean[r], rs = rstd[r];
    float mg, mgx;
    lm::LayerNormRowGradMeans(c, xr, dyr, gamma, m, rs, &mg, &mgx);
    float* dxr = dx + r * c;
#pragma omp simd
    for (int64_t j = 0; j < c; ++j) {
      dxr[j] = lm::LayerNormInputGrad(xr[j], dyr[j], gamma[j], m, rs, mg, mgx);
    }
  }
  const int64_t blk = ColumnBlock(c);
  const int64_t blocks = (c + blk - 1) / blk;
#pragma omp parallel for num_threads(team) schedule(static)
  for (int64_t cb = 0; cb < blocks; ++cb) {
    const int64_t c0 = cb * blk, c1 = std::min(c, c0 + blk);
    std::vector<double> g(size_t(c1 - c0), 0.0), b(size_t(c1 - c0), 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      const float m = mean[r], rs = rstd[r];
      for (int64_t j = c0; j < c1; ++j) {
        const float d = dy[r * c + j];
        g[size_t(j - c0)] += lm::LayerNormGammaTerm(x[r * c + j], d, m, rs);
        b[size_t(j - c0)] += d;
      }
    }
    for (int64_t j = c0; j < c1; ++j) {
      dgamma[j] = float(g[size_t(j - c0)]);
      dbeta[j] = float(b[size_t(j - c0)]);
    }
  }
}

// ---- GELU -------------------------------------------------------------------------------------

void GeluForward(size_t n, const float* x, float* y) {
#pragma omp parallel for num_threads(TeamFor(double(n) * 8)) schedule(static)
  for (size_t i = 0; i < n; ++i) y[i] = lm::GeluValue(x[i]);
}

void GeluBackward(size_t n, const float* x, const float* dy, float* dx) {
#pragma omp parallel for num_threads(TeamFor(double(n) * 8)) schedule(static)
  for (size_t i = 0; i < n; ++i) dx[i] = lm::GeluGrad(x[i], dy[i]);
}

// ---- Attention --------------------------------------------------------------------------------

void SplitHeads(int64_t b, int64_t t, int64_t h, int64_t d, const float* qkv, float* q, float* k,
                float* v) {
  const int64_t c = h * d;
  float* out[3] = {q, k, v};
#pragma omp parallel for num_threads(TeamFor(double(b * t) * double(3 * c))) schedule(static)
  for (int64_t r = 0; r < b * t; ++r) {
    const int64_t bi = r / t, ti = r % t;
    for (int part = 0; part < 3; ++part) {
      for (int64_t hi = 0; hi < h; ++hi) {
        std::copy_n(qkv + r * 3 * c + part * c + hi * d, d,
                    out[part] + ((bi * h + hi) * t + ti) * d);
      }
    }
  }
}

void SplitHeadsBackward(int64_t b, int64_t t, int64_t h, int64_t d, const float* dq,
                        const float* dk, const float* dv, float* dqkv) {
  const int64_t c = h * d;
  const float* in[3] = {dq, dk, dv};
#pragma omp parallel for num_threads(TeamFor(double(b * t) * double(3 * c))) schedule(static)
  for (int64_t r = 0; r < b * t; ++r) {
    const int64_t bi = r / t, ti = r % t;
    for (int part = 0; part < 3; ++part) {
      for (int64_t hi = 0; hi < h; ++hi) {
        std::copy_n(in[part] + ((bi * h + hi) * t + ti) * d, d,
                    dqkv + r * 3 * c + part * c + hi * d);
      }
    }
  }
}

void MergeHeads(int64_t b, int64_t t, int64_t h, int64_t d, const float* o, float* y) {
#pragma omp parallel for num_threads(TeamFor(double(b * t) * double(h * d))) schedule(static)
  for (int64_t r = 0; r < b * t; ++r) {
    const int64_t bi = r / t, ti = r % t;
    for (int64_t hi = 0; hi < h; ++hi) {
      std::copy_n(o + ((bi * h + hi) * t + ti) * d, d, y + r * h * d + hi * d);
    }
  }
}

void MergeHeadsBackward(int64_t b, int64_t t, int64_t h, int64_t d, const float* dy, float* dout) {
#pragma omp parallel for num_threads(TeamFor(double(b * t) * double(h * d))) schedule(static)
  for (int64_t r = 0; r < b * t; ++r) {
    const int64_t bi = r / t, ti = r % t;
    for (int64_t hi = 0; hi < h; ++hi) {
      std::copy_n(dy + r * h * d + hi * d, d, dout + ((bi * h + hi) * t + ti) * d);
    }
  }
}

void CausalSoftmaxForward(int64_t batch, int64_t t, const float* s, float* p) {
#pragma omp parallel for num_threads(TeamFor(double(batch * t) * double(t))) schedule(static)
  for (int64_t row = 0; row < batch * t; ++row) {
    float mx, inv;  // the query position row % t sees keys 0 .. row % t
    CausalSoftmaxRow(s + row * t, row % t, t, p + row * t, &mx, &inv);
  }
}

void CausalSoftmaxRow(const float* s, int64_t r, int64_t n, float* p, float* row_max,
                      float* row_inv) {
  float mx = s[0];
  for (int64_t j = 1; j <= r; ++j) mx = std::max(mx, s[j]);
  double sum = 0;
  for (int64_t j = 0; j <= r; ++j) {
    p[j] = lm::SoftmaxExp(s[j], mx);
    sum += p[j];
  }
  const float inv = float(1.0 / sum);
  for (int64_t j = 0; j <= r; ++j) p[j] *= inv;
  std::fill(p + r + 1, p + n, 0.f);
  *row_max = mx;
  *row_inv = inv;
}

void CausalSoftmaxBackward(int64_t batch, int64_t t, const float* p, const float* dp, float* ds) {
#pragma omp parallel for num_threads(TeamFor(double(batch * t) * double(t))) schedule(static)
  for (int64_t row = 0; row < batch * t; ++row) {
    const int64_t r = row % t;
    const float* pr = p + row * t;
    const float* dpr = dp + row * t;
    float* dsr = ds + row * t;
    double dot = 0;
    for (int64_t j = 0; j <= r; ++j) dot += double(dpr[j]) * pr[j];
    const float fd = float(dot);
    for (int64_t j = 0; j <= r; ++j) dsr[j] = lm::SoftmaxGrad(pr[j], dpr[j], fd);
    std::fill(dsr + r + 1, dsr + t, 0.f);
  }
}

// The products parallelise over the batch (batch * heads) only: enough for a training batch of
// several sequences, not for one long sequence (a tiled path would split rows too).
void BatchedMatmul(int64_t batch, int64_t m, int64_t n, int64_t k, bool trans_b, float alpha,
                   const float* a, const float* b, float* c) {
  UseSingleThreadedBlas();
  const int team = std::max<int64_t>(1, std::min<int64_t>(TeamSize(), batch));
#pragma omp parallel for num_threads(team) schedule(static)
  for (int64_t i = 0; i < batch; ++i) {
    const float* ai = a + i * m * k;
    const float* bi = b + i * n * k;
    float* ci = c + i * m * n;
    if (trans_b) {
      Sgemm(false, true, m, n, k, alpha, ai, k, bi, k, 0.f, ci, n);
    } else {
      Sgemm(false, false, m, n, k, alpha, ai, k, bi, n, 0.f, ci, n);
    }
  }
}

void BatchedMatmulBackward(int64_t batch, int64_t m, int64_t n, int64_t k, bool trans_b,
                           float alpha, const float* a, const float* b, const float* dc, float* da,
                           float* db) {
  UseSingleThreadedBlas();
  const int team = std::max<int64_t>(1, std::min<int64_t>(TeamSize(), batch));
#pragma omp parallel for num_threads(team) schedule(static)
  for (int64_t i = 0; i < batch; ++i) {
    const float* ai = a + i * m * k;
    const float* bi = b + i * n * k;
    const float* dci = dc + i * m * n;
    float* dai = da + i * m * k;
    float* dbi = db + i * n * k;
    if (trans_b) {  // c = alpha a b^T, b [n, k]
      Sgemm(false, false, m, k, n, alpha, dci, n, bi, k, 0.f, dai, k);
      Sgemm(true, false, n, k, m, alpha, dci, n, ai, k, 0.f, dbi, k);
    } else {  // c = alpha a b, b [k, n]
      Sgemm(false, true, m, k, n, alpha, dci, n, bi, n, 0.f, dai, k);
      Sgemm(true, false, k, n, m, alpha, ai, k, dci, n, 0.f, dbi, n);
    }
  }
}

}  // namespace cpd::runtime::cpu
