#include "runtime/engine/cpu_ops.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/grid.h"
#include "runtime/engine/cpu_internal.h"

namespace cpd::runtime::cpu {

using internal::HasAvx512;
using internal::kParallelElements;
using internal::SumF;
using internal::TeamSize;

// ---- Fully connected --------------------------------------------------------------------------

void LinearForward(int64_t n, int64_t in, int64_t out, const float* x, const float* w,
                   const float* bias, float* y, const kernels::Accumulation* acc) {
  ParallelSgemm(false, true, n, out, in, 1.f, x, in, w, in, 0.f, y, out, acc);
  if (bias == nullptr) return;
  for (int64_t i = 0; i < n; ++i) {
    float* row = y + i * out;
#pragma omp simd
    for (int64_t o = 0; o < out; ++o) row[o] += bias[o];
  }
}

void LinearBackward(int64_t n, int64_t in, int64_t out, const float* x, const float* w,
                    const float* dy, float* dx, float* dw, float* db,
                    const kernels::Accumulation* acc) {
  if (dw != nullptr) ParallelSgemm(true, false, out, in, n, 1.f, dy, out, x, in, 0.f, dw, in, acc);
  if (db != nullptr) {
    std::fill(db, db + out, 0.f);
    for (int64_t i = 0; i < n; ++i) {
      const float* row = dy + i * out;
#pragma omp simd
      for (int64_t o = 0; o < out; ++o) db[o] += row[o];
    }
  }
  if (dx != nullptr) ParallelSgemm(false, false, n, in, out, 1.f, dy, out, w, in, 0.f, dx, in, acc);
}

// ---- Batch normalisation ----------------------------------------------------------------------

namespace {

// Shifted sums of one channel segment: sum(x - k) and sum((x - k)^2).
CPD_CLONES void ShiftedSums(const float* x, int64_t n, float k, float* s1, float* s2) {
  float a = 0.f, b = 0.f;
#pragma omp simd reduction(+ : a, b)
  for (int64_t i = 0; i < n; ++i) {
    const float d = x[i] - k;
    a += d;
    b += d * d;
  }
  *s1 = a;
  *s2 = b;
}

// y = (x - m) * scale + b (not x * scale + (b - m * scale), which cancels when |m| >> std).
CPD_CLONES void ScaleShift(const float* x, int64_t n, float m, float scale, float b, bool relu,
                           float* y) {
  if (relu) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float v = (x[i] - m) * scale + b;
      y[i] = v < 0.f ? 0.f : v;
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - m) * scale + b;
  }
}

}  // namespace

void BatchNormTrainForward(int64_t n, int64_t c, int64_t hw, const float* x, const float* gamma,
                           const float* beta, float eps, bool relu, float* y, float* mean,
                           float* var, float* invstd) {
  const double count = double(n) * double(hw);
  const bool parallel = size_t(n * c * hw) >= kParallelElements && c > 1;
  // One channel per iteration: its n * hw values (at most a few hundred KiB in the models
  // here) stay in L2 between the statistics and the normalisation pass. The statistics take
  // one pass, as sums of x - k and (x - k)^2 with k = the channel's first value: shifting by a
  // sample keeps E[(x-k)^2] - E[x-k]^2 from cancelling when |mean| >> std.
#pragma omp parallel for schedule(static) if (parallel) num_threads(TeamSize())
  for (int64_t ch = 0; ch < c; ++ch) {
    const float k = x[ch * hw];
    double s1 = 0, s2 = 0;
    for (int64_t i = 0; i < n; ++i) {
      float a, b;
      ShiftedSums(x + (i * c + ch) * hw, hw, k, &a, &b);
      s1 += a;
      s2 += b;
    }
    const double d = s1 / count;
    const double v = std::max(s2 / count - d * d, 0.0);
    const float m = float(double(k) + d);
    const float is = float(1.0 / std::sqrt(v + double(eps)));
    mean[ch] = m;
    var[ch] = float(v);
    invstd[ch] = is;
    const float scale = gamma[ch] * is;
    for (int64_t i = 0; i < n; ++i) {
      ScaleShift(x + (i * c + ch) * hw, hw, m, scale, beta[ch], relu, y + (i * c + ch) * hw);
    }
  }
}

void BatchNormEvalForward(int64_t n, int64_t c, int64_t hw, const float* x, const float* gamma,
                          const float* beta, const float* mean, const float* var, float eps,
                          bool relu, float* y) {
  const bool parallel = size_t(n * c * hw) >= kParallelElements;
#pragma omp parallel for schedule(static) if (parallel) num_threads(TeamSize())
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t ch = 0; ch < c; ++ch) {
      const float scale = gamma[ch] * float(1.0 / std::sqrt(double(var[ch]) + double(eps)));
      ScaleShift(x + (i * c + ch) * hw, hw, mean[ch], scale, beta[ch], relu, y + (i * c + ch) * hw);
    }
  }
}

namespace {

// sum(g) and sum(g * (x - m)) of one segment, g = dy (masked by y > 0 when y is non-null).
CPD_CLONES void BackwardSums(const float* x, const float* dy, const float* y, int64_t n, float m,
                             float* s1, float* s2) {
  float a = 0.f, b = 0.f;
  if (y != nullptr) {
#pragma omp simd reduction(+ : a, b)
    for (int64_t i = 0; i < n; ++i) {
      const float g0 = dy[i];
      const float g = y[i] > 0.f ? g0 : 0.f;
      a += g;
      b += g * (x[i] - m);
    }
  } else {
#pragma omp simd reduction(+ : a, b)
    for (int64_t i = 0; i < n; ++i) {
      a += dy[i];
      b += dy[i] * (x[i] - m);
    }
  }
  *s1 = a;
  *s2 = b;
}

CPD_CLONES void BackwardApply(const float* x, const float* dy, const float* y, int64_t n, float m,
                              float k1, float k2, float k3, float* dx) {
  if (y != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float g0 = dy[i];
      const float g = y[i] > 0.f ? g0 : 0.f;
      dx[i] = k1 * g - k2 * (x[i] - m) - k3;
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dx[i] = k1 * dy[i] - k2 * (x[i] - m) - k3;
  }
}

}  // namespace

void BatchNormBackward(int64_t n, int64_t c, int64_t hw, const float* x, const float* dy,
                       const float* relu_y, const float* gamma, const float* mean,
                       const float* invstd, float* dx, float* dgamma, float* dbeta) {
  const double count = double(n) * double(hw);
  const bool parallel = size_t(n * c * hw) >= kParallelElements && c > 1;
#pragma omp parallel for schedule(static) if (parallel) num_threads(TeamSize())
  for (int64_t ch = 0; ch < c; ++ch) {
    const float m = mean[ch];
    double sum_dy = 0, sum_dy_xc = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t off = (i * c + ch) * hw;
      float a, b;
      BackwardSums(x + off, dy + off, relu_y == nullptr ? nullptr : relu_y + off, hw, m, &a, &b);
      sum_dy += a;
      sum_dy_xc += b;
    }
    const double is = invstd[ch];
    dbeta[ch] = float(sum_dy);
    dgamma[ch] = float(sum_dy_xc * is);
    // dx = gamma * invstd * (dy - mean(dy) - xhat * mean(dy * xhat)), with xhat = (x - m) * is:
    // dx = k1 * dy - k2 * (x - m) - k3.
    const double k1 = double(gamma[ch]) * is;
    const float k2 = float(k1 * is * is * sum_dy_xc / count);
    const float k3 = float(k1 * sum_dy / count);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t off = (i * c + ch) * hw;
      BackwardApply(x + off, dy + off, relu_y == nullptr ? nullptr : relu_y + off, hw, m, float(k1),
                    k2, k3, dx + off);
    }
  }
}

// ---- Pooling ----------------------------------------------------------------------------------

// The common 2x2 / stride-2 window without branches, so that the compiler vectorises across
// output columns. Same semantics as the general loop: the first maximum in (row, column) order
// wins, and a NaN wins over any number and stays.
CPD_CLONES void MaxPool2x2Forward(int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow,
                                  const float* x, float* y, int32_t* argmax, bool parallel) {
#pragma omp parallel for schedule(static) if (parallel) num_threads(TeamSize())
  for (int64_t pl = 0; pl < planes; ++pl) {
    const float* xp = x + pl * h * w;
    for (int64_t oy = 0; oy < oh; ++oy) {
      const float* r0 = xp + 2 * oy * w;
      const float* r1 = r0 + w;
      float* yr = y + (pl * oh + oy) * ow;
      int32_t* ar = argmax + (pl * oh + oy) * ow;
      const int32_t row0 = int32_t(2 * oy * w), row1 = int32_t((2 * oy + 1) * w);
#pragma omp simd
      for (int64_t ox = 0; ox < ow; ++ox) {
        const float a = r0[2 * ox], b = r0[2 * ox + 1], c = r1[2 * ox], d = r1[2 * ox + 1];
        float bv = a;
        int32_t bi = row0 + int32_t(2 * ox);
        bool up = (b > bv) | ((b != b) & (bv == bv));
        bv = up ? b : bv;
        bi = up ? row0 + int32_t(2 * ox + 1) : bi;
        up = (c > bv) | ((c != c) & (bv == bv));
        bv = up ? c : bv;
        bi = up ? row1 + int32_t(2 * ox) : bi;
        up = (d > bv) | ((d != d) & (bv == bv));
        bv = up ? d : bv;
        bi = up ? row1 + int32_t(2 * ox + 1) : bi;
        yr[ox] = bv;
        ar[ox] = bi;
      }
    }
  }
}

#if CPD_DIRECT_CONV
// The 2x2 / stride-2 window with AVX-512: 16 output columns per step, each input row pair
// de-interleaved into even and odd columns; the same compare chain as MaxPool2x2Forward, so
// the results (argmax included) are identical. Tails use masked loads and stores.
CPD_AVX512 void MaxPool2x2ForwardAvx512(int64_t planes, int64_t h, int64_t w, int64_t oh,
                                        int64_t ow, const float* x, float* y, int32_t* argmax,
                                        bool parallel) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
#pragma omp parallel for schedule(static) if (parallel) num_threads(TeamSize())
  for (int64_t pl = 0; pl < planes; ++pl) {
    const float* xp = x + pl * h * w;
    for (int64_t oy = 0; oy < oh; ++oy) {
      const float* r0 = xp + 2 * oy * w;
      const float* r1 = r0 + w;
      float* yr = y + (pl * oh + oy) * ow;
      int32_t* ar = argmax + (pl * oh + oy) * ow;
      const __m512i row0 = _mm512_set1_epi32(int32_t(2 * oy * w));
      const __m512i row1 = _mm512_set1_epi32(int32_t((2 * oy + 1) * w));
      for (int64_t ox = 0; ox < ow; ox += 16) {
        const int64_t n = std::min<int64_t>(16, ow - ox);  // output columns in this step
        const __mmask16 out_mask = __mmask16((1u << n) - 1u);
        const int64_t in_n = 2 * n;  // input floats per row
        const __mmask16 lo_mask = __mmask16(in_n >= 16 ? 0xFFFFu : (1u << in_n) - 1u);
        const __mmask16 hi_mask = __mmask16(in_n >= 32  ? 0xFFFFu
                                            : in_n > 16 ? (1u << (in_n - 16)) - 1u
                                                        : 0u);
        const float* p0 = r0 + 2 * ox;
        const float* p1 = r1 + 2 * ox;
        const __m512 l0 = _mm512_maskz_loadu_ps(lo_mask, p0),
                     h0 = _mm512_maskz_loadu_ps(hi_mask, p0 + 16);
        const __m512 l1 = _mm512_maskz_loadu_ps(lo_mask, p1),
                     h1 = _mm512_maskz_loadu_ps(hi_mask, p1 + 16);
        const __m512 a = _mm512_permutex2var_ps(l0, even, h0),
                     b = _mm512_permutex2var_ps(l0, odd, h0);
        const __m512 c = _mm512_permutex2var_ps(l1, even, h1),
                     d = _mm512_permutex2var_ps(l1, odd, h1);
        const __m512i col = _mm512_add_epi32(_mm512_set1_epi32(int32_t(2 * ox)), even);
        __m512 bv = a;
        __m512i bi = _mm512_add_epi32(row0, col);
        auto step = [&](__m512 v, __m512i idx) CPD_AVX512_LAMBDA {
          const __mmask16 up =
              _mm512_cmp_ps_mask(v, bv, _CMP_GT_OQ) |
              (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) & _mm512_cmp_ps_mask(bv, bv, _CMP_ORD_Q));
          bv = _mm512_mask_blend_ps(up, bv, v);
          bi = _mm512_mask_blend_epi32(up, bi, idx);
        };
        const __m512i one = _mm512_set1_epi32(1);
        step(b, _mm512_add_epi32(_mm512_add_epi32(row0, col), one));
        step(c, _mm512_add_epi32(row1, col));
        step(d, _mm512_add_epi32(_mm512_add_epi32(row1, col), one));
        _mm512_mask_storeu_ps(yr + ox, out_mask, bv);
        _mm512_mask_storeu_epi32(ar + ox, out_mask, bi);
      }
    }
  }
}
#endif

void MaxPool2dForward(int64_t planes, int64_t h, int64_t w, int64_t k, int64_t stride, int64_t oh,
                      int64_t ow, const float* x, float* y, int32_t* argmax) {
  const bool parallel = size_t(planes * h * w) >= kParallelElements;
  if (k == 2 && stride == 2) {
#if CPD_DIRECT_CONV
    if (HasAvx512()) {
      MaxPool2x2ForwardAvx512(planes, h, w, oh, ow, x, y, argmax, parallel);
      return;
    }
#endif
    MaxPool2x2Forward(planes, h, w, oh, ow, x, y, argmax, parallel);
    return;
  }
#pragma omp parallel for schedule(static) if (parallel) num_threads(TeamSize())
  for (int64_t pl = 0; pl < planes; ++pl) {
    const float* xp = x + pl * h * w;
    float* yp = y + pl * oh * ow;
    int32_t* ap = argmax + pl * oh * ow;
    for (int64_t oy = 0; oy < oh; ++oy) {
      for (int64_t ox = 0; ox < ow; ++ox) {
        int64_t best = oy * stride * w + ox * stride;
        float bv = xp[best];
        for (int64_t ki = 0; ki < k; ++ki) {
          for (int64_t kj = 0; kj < k; ++kj) {
            const int64_t idx = (oy * stride + ki) * w + ox * stride + kj;
            // NaN wins (and stays), as in PyTorch: a NaN input must not vanish silently.
            if (xp[idx] > bv || (std::isnan(xp[idx]) && !std::isnan(bv))) {
              bv = xp[idx];
              best = idx;
            }
          }
        }
        yp[oy * ow + ox] = bv;
        ap[oy * ow + ox] = int32_t(best);
      }
    }
  }
}

void MaxPool2dBackward(int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow,
                       const float* dy, const int32_t* argmax, float* dx) {
  const bool parallel = size_t(planes * h * w) >= kParallelElements;
#pragma omp parallel for schedule(static) if (parallel) num_threads(TeamSize())
  for (int64_t pl = 0; pl < planes; ++pl) {
    float* dp = dx + pl * h * w;
    std::memset(dp, 0, size_t(h * w) * sizeof(float));
    const float* gp = dy + pl * oh * ow;
    const int32_t* ap = argmax + pl * oh * ow;
    for (int64_t j = 0; j < oh * ow; ++j) dp[ap[j]] += gp[j];
  }
}

void AvgPool2dForward(int64_t planes, int64_t h, int64_t w, int64_t k, int64_t stride, int64_t oh,
                      int64_t ow, const float* x, float* y) {
  const float inv = 1.f / float(k * k);
  const bool parallel = size_t(planes * h * w) >= kParallelElements;
#pragma omp parallel for schedule(static) if (parallel) num_threads(TeamSize())
  for (int64_t pl = 0; pl < planes; ++pl) {
    const float* xp = x + pl * h * w;
    float* yp = y + pl * oh * ow;
    for (int64_t oy = 0; oy < oh; ++oy) {
      for (int64_t ox = 0; ox < ow; ++ox) {
        float s = 0.f;
        for (int64_t ki = 0; ki < k; ++ki) {
          const float* row = xp + (oy * stride + ki) * w + ox * stride;
          for (int64_t kj = 0; kj < k; ++kj) s += row[kj];
        }
        yp[oy * ow + ox] = s * inv;
      }
    }
  }
}

void AvgPool2dBackward(int64_t planes, int64_t h, int64_t w, int64_t k, int64_t stride, int64_t oh,
                       int64_t ow, const float* dy, float* dx) {
  const float inv = 1.f / float(k * k);
  const bool parallel = size_t(planes * h * w) >= kParallelElements;
#pragma omp parallel for schedule(static) if (parallel) num_threads(TeamSize())
  for (int64_t pl = 0; pl < planes; ++pl) {
    float* dp = dx + pl * h * w;
    std::memset(dp, 0, size_t(h * w) * sizeof(float));
    const float* gp = dy + pl * oh * ow;
    for (int64_t oy = 0; oy < oh; ++oy) {
      for (int64_t ox = 0; ox < ow; ++ox) {
        const float g = gp[oy * ow + ox] * inv;
        for (int64_t ki = 0; ki < k; ++ki) {
          float* row = dp + (oy * stride + ki) * w + ox * stride;
          for (int64_t kj = 0; kj < k; ++kj) row[kj] += g;
        }
      }
    }
  }
}

void GlobalAvgPoolForward(int64_t planes, int64_t hw, const float* x, float* y) {
  const bool parallel = size_t(planes * hw) >= kParallelElements;
#pragma omp parallel for schedule(static) if (parallel) num_threads(TeamSize())
  for (int64_t pl = 0; pl < planes; ++pl) {
    y[pl] = float(double(SumF(x + pl * hw, hw)) / double(hw));
  }
}

void GlobalAvgPoolBackward(int64_t planes, int64_t hw, const float* dy, float* dx) {
  const float inv = 1.f / float(hw);
  const bool parallel = size_t(planes * hw) >= kParallelElements;
#pragma omp parallel for schedule(static) if (parallel) num_threads(TeamSize())
  for (int64_t pl = 0; pl < planes; ++pl) {
    const float g = dy[pl] * inv;
    float* dp = dx + pl * hw;
#pragma omp simd
    for (int64_t p = 0; p < hw; ++p) dp[p] = g;
  }
}

// ---- Elementwise ------------------------------------------------------------------------------

void Relu(size_t n, const float* x, float* y) {
  // `x < 0 ? 0 : x` keeps NaN (std::max(x, 0.f) would too, but not max(0.f, x)).
#pragma omp parallel for simd schedule(static) if (n >= kParallelElements) num_threads(TeamSize())
  for (size_t i = 0; i < n; ++i) y[i] = x[i] < 0.f ? 0.f : x[i];
}

void ReluBackward(size_t n, const float* y, const float* dy, float* dx) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelElements) num_threads(TeamSize())
  for (size_t i = 0; i < n; ++i) {
    // Both loads unconditional, so that the select vectorises (a conditional load does not).
    const float g = dy[i];
    dx[i] = y[i] > 0.f ? g : 0.f;
  }
}

void AddRelu(size_t n, const float* a, const float* b, float* y) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelElements) num_threads(TeamSize())
  for (size_t i = 0; i < n; ++i) {
    const float s = a[i] + b[i];
    y[i] = s < 0.f ? 0.f : s;
  }
}

void Add(size_t n, const float* a, const float* b, float* y) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelElements) num_threads(TeamSize())
  for (size_t i = 0; i < n; ++i) y[i] = a[i] + b[i];
}

void AddInPlace(size_t n, const float* x, float* y) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelElements) num_threads(TeamSize())
  for (size_t i = 0; i < n; ++i) y[i] += x[i];
}

void DropoutApply(size_t n, uint64_t key, uint32_t threshold, float scale, const float* x,
                  float* y) {
#pragma omp parallel for schedule(static) if (n >= kParallelElements) num_threads(TeamSize())
  for (size_t i = 0; i < n; ++i) {
    const float v = x[i] * scale;
    y[i] = kernels::RandomBits(key, uint64_t(i)) >= threshold ? v : 0.f;
  }
}

// ---- Loss -------------------------------------------------------------------------------------

double SoftmaxCrossEntropy(int64_t n, int64_t k, const float* logits, const int32_t* labels,
                           float* dlogits) {
  double total = 0;
  const double inv_n = 1.0 / double(n);
  for (int64_t i = 0; i < n; ++i) {
    const float* row = logits + i * k;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < k; ++j) mx = std::max(mx, row[j]);
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += std::exp(double(row[j]) - double(mx));
    const double log_sum = std::log(sum);
    total += log_sum - (double(row[labels[i]]) - double(mx));
    if (dlogits != nullptr) {
      float* d = dlogits + i * k;
      for (int64_t j = 0; j < k; ++j) {
        const double p = std::exp(double(row[j]) - double(mx) - log_sum);
        d[j] = float((p - (j == labels[i] ? 1.0 : 0.0)) * inv_n);
      }
    }
  }
  return total * inv_n;
}

}  // namespace cpd::runtime::cpu
