// The CPU math of the layers in runtime/nn/layers.h: GEMM wrappers over OpenBLAS
// (runtime/engine/cpu_gemm.h), im2col/col2im and convolution (im2col + OpenBLAS, direct AVX-512
// kernels, or oneDNN: see Conv2dPath in runtime/engine/cpu_conv.h), batch normalisation, pooling,
// elementwise and loss kernels on raw float arrays.
//
// This is the seam for a device back end: layers check shapes and devices, own their
// workspaces, call the quantisation hooks, and hand raw pointers to these functions; a CUDA
// back end provides the same functions over device pointers.
//
// Threading: every function here that takes more than a few microseconds parallelises itself
// with OpenMP (omp_get_max_threads() threads) and calls OpenBLAS single-threaded from inside
// its parallel regions; oneDNN's convolutions run on the same OpenMP runtime and thread count.
// Call them from one thread at a time, outside any parallel region (they also work inside one,
// but then run on the calling thread only, through im2col). For a fixed thread count results
// are deterministic; the order of floating-point sums (and so the last bits of gradients) may
// change with the thread count.
//
// Layout: images are NCHW, matrices row-major. Unless stated otherwise, outputs are overwritten
// (not accumulated) and must not alias inputs.
#pragma once

#include <cstddef>
#include <cstdint>

#include "runtime/engine/cpu_conv.h"
#include "runtime/engine/cpu_gemm.h"

namespace cpd::runtime::cpu {

// ---- Fully connected ------------------------------------------------------------------------
// y [n, out] = x [n, in] w^T + bias (bias may be null); w is [out, in]. With `acc` the
// products (not the bias sums) are accumulated as kernels/accumulate.h emulates.
void LinearForward(int64_t n, int64_t in, int64_t out, const float* x, const float* w,
                   const float* bias, float* y, const kernels::Accumulation* acc = nullptr);
// dw [out, in] = dy^T x and db [out] = column sums of dy (written, not accumulated; dw and db
// may each be null); dx [n, in] = dy w when dx is non-null.
void LinearBackward(int64_t n, int64_t in, int64_t out, const float* x, const float* w,
                    const float* dy, float* dx, float* dw, float* db,
                    const kernels::Accumulation* acc = nullptr);

// ---- Batch normalisation (per channel over n and the spatial positions) ---------------------
// x is [n, c, hw] (a 2-D input [n, c] is hw = 1). Training mode: normalises with the biased
// batch variance and writes the batch mean, the biased variance and invstd = 1/sqrt(var + eps)
// per channel (sums accumulated in double). Requires n * hw >= 1. With relu = true the output
// is max(normalised, 0) (BatchNorm followed by ReLU in one pass).
void BatchNormTrainForward(int64_t n, int64_t c, int64_t hw, const float* x, const float* gamma,
                           const float* beta, float eps, bool relu, float* y, float* mean,
                           float* var, float* invstd);
// Evaluation mode: normalises with the given (running) statistics.
void BatchNormEvalForward(int64_t n, int64_t c, int64_t hw, const float* x, const float* gamma,
                          const float* beta, const float* mean, const float* var, float eps,
                          bool relu, float* y);
// Backward of the training-mode forward: dx (written), dgamma and dbeta (written, not
// accumulated). relu_y: the forward output when it was computed with relu = true (dy is then
// taken as 0 where relu_y <= 0), else null.
void BatchNormBackward(int64_t n, int64_t c, int64_t hw, const float* x, const float* dy,
                       const float* relu_y, const float* gamma, const float* mean,
                       const float* invstd, float* dx, float* dgamma, float* dbeta);

// ---- Pooling (no padding) ---------------------------------------------------------------------
// Planes: x is [planes, h, w] (planes = n * c), y is [planes, oh, ow].
// argmax receives, per output element, the index within its input plane of the maximum (the
// first one on ties).
void MaxPool2dForward(int64_t planes, int64_t h, int64_t w, int64_t k, int64_t stride, int64_t oh,
                      int64_t ow, const float* x, float* y, int32_t* argmax);
void MaxPool2dBackward(int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow,
                       const float* dy, const int32_t* argmax, float* dx);
void AvgPool2dForward(int64_t planes, int64_t h, int64_t w, int64_t k, int64_t stride, int64_t oh,
                      int64_t ow, const float* x, float* y);
void AvgPool2dBackward(int64_t planes, int64_t h, int64_t w, int64_t k, int64_t stride, int64_t oh,
                       int64_t ow, const float* dy, float* dx);
// Mean over each plane: x [planes, hw] -> y [planes], and its backward.
void GlobalAvgPoolForward(int64_t planes, int64_t hw, const float* x, float* y);
void GlobalAvgPoolBackward(int64_t planes, int64_t hw, const float* dy, float* dx);

// ---- Elementwise ------------------------------------------------------------------------------
void Relu(size_t n, const float* x, float* y);
// dx = y > 0 ? dy : 0, from the forward output y.
void ReluBackward(size_t n, const float* y, const float* dy, float* dx);
// y = max(a + b, 0): the residual join of a ResNet block.
void AddRelu(size_t n, const float* a, const float* b, float* y);
// y = a + b.
void Add(size_t n, const float* a, const float* b, float* y);
// y += x.
void AddInPlace(size_t n, const float* x, float* y);

// Dropout: element i is kept iff kernels::RandomBits(key, i) >= threshold, and then scaled by
// `scale`; dropped elements become 0. The backward applies the same mask to dy.
void DropoutApply(size_t n, uint64_t key, uint32_t threshold, float scale, const float* x,
                  float* y);

// ---- Loss -------------------------------------------------------------------------------------
// Mean softmax cross-entropy of logits [n, k] against labels (each in [0, k)), computed in a
// numerically stable way (log-sum-exp around the row maximum); writes dlogits
// = (softmax - onehot) / n when non-null.
double SoftmaxCrossEntropy(int64_t n, int64_t k, const float* logits, const int32_t* labels,
                           float* dlogits);

}  // namespace cpd::runtime::cpu
