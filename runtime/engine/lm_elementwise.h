// The per-element and per-row formulas of the language-model layers, written once and compiled
// twice: into the CPU loops (runtime/engine/cpu_transformer.cc, cpu_recurrent.cc) and into the
// CUDA kernels (cuda_kernels_transformer.cu, cuda_kernels_recurrent.cu), so that the CPU stays
// the reference of the GPU (the pattern of kernels/grid.h, whose CPD_HD marks a function
// __host__ __device__ under nvcc).
//
// Agreement between the two compilations: the same float and double operations in the same
// order (both sides are built without FMA contraction: -ffp-contract=off, -fmad=false), so that
// whatever uses only + - * / and sqrt gives the same bits on both. The transcendental functions
// (erff, expf, tanhf) come from each side's own library: glibc's on the CPU, CUDA's on the GPU
// (at most 2 ulp from the true value each, CUDA Programming Guide, "Mathematical Functions"), so
// GELU, the softmax's exponentials and the LSTM's gates agree to a few ulp, not bit for bit.
//
// On the CPU these are the calls the loops always made (std::erf(float) is erff, and so on), so
// moving the formulas here changed no CPU result.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/grid.h"  // CPD_HD

namespace cpd::runtime::lm {

// ---- GELU, the exact form (Hendrycks and Gimpel 2016) ----------------------------------------

// y = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2)).
CPD_HD float GeluValue(float x) {
  constexpr float kRsqrt2 = 0.70710678118654752f;
  return 0.5f * x * (1.f + erff(x * kRsqrt2));
}

// dx = dy (Phi(x) + x phi(x)), phi the standard normal density.
CPD_HD float GeluGrad(float x, float dy) {
  constexpr float kRsqrt2 = 0.70710678118654752f;
  constexpr float kRsqrt2Pi = 0.39894228040143268f;  // 1 / sqrt(2 pi)
  const float cdf = 0.5f * (1.f + erff(x * kRsqrt2));
  const float pdf = expf(-0.5f * x * x) * kRsqrt2Pi;
  return dy * (cdf + x * pdf);
}

// ---- Layer normalisation over one row of c values ----------------------------------------------

// The row's mean and rstd = 1 / sqrt(var + eps) with the biased variance, accumulated in double
// in index order, two passes (no cancellation for rows with a large mean).
CPD_HD void LayerNormRowStats(int64_t c, const float* xr, float eps, float* mean, float* rstd) {
  double s = 0;
  for (int64_t j = 0; j < c; ++j) s += xr[j];
  const double mu = s / double(c);
  double v = 0;
  for (int64_t j = 0; j < c; ++j) v += (xr[j] - mu) * (xr[j] - mu);
  *mean = float(mu);
  *rstd = float(1.0 / sqrt(v / double(c) + double(eps)));
}

// y = (x - mean) * rstd * gamma + beta.
CPD_HD float LayerNormValue(float x, float mean, float rstd, float gamma, float beta) {
  return (x - mean) * rstd * gamma + beta;
}

// The backward's row means mean(g) and mean(g * xhat), g = dy * gamma, xhat the normalised x,
// accumulated in double in index order.
CPD_HD void LayerNormRowGradMeans(int64_t c, const float* xr, const float* dyr, const float* gamma,
                                  float mean, float rstd, float* mg, float* mgx) {
  double sg = 0, sgx = 0;
  for (int64_t j = 0; j < c; ++j) {
    const double g = double(dyr[j]) * gamma[j];
    sg += g;
    sgx += g * double((xr[j] - mean) * rstd);
  }
  *mg = float(sg / double(c));
  *mgx = float(sgx / double(c));
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma.
CPD_HD float LayerNormInputGrad(float x, float dy, float gamma, float mean, float rstd, float mg,
                                float mgx) {
  return rstd * (dy * gamma - mg - (x - mean) * rstd * mgx);
}

// One row's term of dgamma (summed over the rows in double, in row order): dy * xhat.
CPD_HD double LayerNormGammaTerm(float x, float dy, float mean, float rstd) {
  return double(dy) * double((x - mean) * rstd);
}

// ---- The causal softmax ----------------------------------------------------------------------

// exp(s - row max), before the row's normalisation.
CPD_HD float SoftmaxExp(float s, float row_max) { return expf(s - row_max); }

// ds = p * (dp - sum_s(dp * p)), the row's dot product rounded to float first.
CPD_HD float SoftmaxGrad(float p, float dp, float dot) { return p * (dp - dot); }

// ---- The LSTM cell (PyTorch's nn.LSTM; see runtime/engine/cpu_recurrent.h) ----------------------

CPD_HD float Sigmoid(float z) { return 1.f / (1.f + expf(-z)); }

// Element j of one row of h hidden units, forward: zx, zh the row's two pre-activation halves
// [4h] (gates i, f, g, o in blocks of h), c_prev the previous cell state. Writes the activated
// gates act[j], act[h + j], act[2h + j], act[3h + j], the cell state *c and the output *h_out.
CPD_HD void LstmCellElement(int64_t h, int64_t j, const float* zx, const float* zh, float c_prev,
                            float* act, float* c, float* h_out) {
  const float i = Sigmoid(zx[j] + zh[j]);
  const float f = Sigmoid(zx[h + j] + zh[h + j]);
  const float g = tanhf(zx[2 * h + j] + zh[2 * h + j]);
  const float o = Sigmoid(zx[3 * h + j] + zh[3 * h + j]);
  const float cell = f * c_prev + i * g;
  act[j] = i;
  act[h + j] = f;
  act[2 * h + j] = g;
  act[3 * h + j] = o;
  *c = cell;
  *h_out = o * tanhf(cell);
}

// Element j of one row, backward: act the row's saved gates [4h], c_prev and c the cell states,
// dh = dL/dh_t, *dc read as dL/dc_t through c_{t+1} and overwritten with dL/dc_{t-1}; writes the
// gradient of the pre-activations d[j], d[h + j], d[2h + j], d[3h + j].
CPD_HD void LstmCellGradElement(int64_t h, int64_t j, const float* act, float c_prev, float c,
                                float dh, float* dc, float* d) {
  const float i = act[j], f = act[h + j], g = act[2 * h + j], o = act[3 * h + j];
  const float tc = tanhf(c);
  const float dct = *dc + dh * o * (1.f - tc * tc);
  d[j] = dct * g * i * (1.f - i);
  d[h + j] = dct * c_prev * f * (1.f - f);
  d[2 * h + j] = dct * i * (1.f - g * g);
  d[3 * h + j] = dh * tc * o * (1.f - o);
  *dc = dct * f;
}

}  // namespace cpd::runtime::lm
