// The CPU math of the layers in runtime/layers.h: GEMM wrappers over OpenBLAS, im2col/col2im,
// convolution (im2col + OpenBLAS, direct AVX-512 kernels, or oneDNN: see Conv2dPath), batch
// normalisation, pooling, elementwise and loss kernels on raw float arrays.
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
#include <memory>
#include <optional>

#include "runtime/tensor.h"

namespace cpd::runtime::cpu {

// The layers parallelise with OpenMP and call OpenBLAS from inside their parallel regions, so
// OpenBLAS must run single-threaded there (its own pthread pool would oversubscribe the cores).
// Every function below that calls BLAS first calls this, which sets openblas_set_num_threads(1)
// if it is not 1 already, and leaves it so: a process that runs these layers uses OpenBLAS
// single-threaded. (Setting it back and forth around each call wakes OpenBLAS's idle workers,
// which then spin in sched_yield for a while and steal cycles from the OpenMP team.)
void UseSingleThreadedBlas();

// ---- GEMM ---------------------------------------------------------------------------------
// C[m, n] = alpha * op(A) op(B) + beta * C (row-major; op(A) is m x k, op(B) is k x n), one
// cblas_sgemm call on the calling thread with OpenBLAS's current thread setting.
void Sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// The same product with the rows of C split across the OpenMP threads, each block computed by
// a single-threaded sgemm. Small products run on the calling thread.
void ParallelSgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                   const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                   int64_t ldc);

// ---- Convolution ----------------------------------------------------------------------------
// A 2-D convolution of a batch: input [n, c, h, w], weight [oc, c, k, k], output
// [n, oc, oh, ow] with oh = (h + 2 pad - k) / stride + 1 (the same for ow).
struct ConvShape {
  int64_t n = 0, c = 0, h = 0, w = 0;  // input
  int64_t oc = 0, k = 1, stride = 1, pad = 0;
  int64_t oh = 0, ow = 0;  // output (see ComputeOutput)

  // Fills oh and ow; false if the (padded) input is smaller than the kernel.
  bool ComputeOutput();
  int64_t ckk() const { return c * k * k; }  // rows of the column matrix
  int64_t ohw() const { return oh * ow; }    // columns of the column matrix
  // A 1x1, stride-1, unpadded convolution is a plain GEMM on the input (no im2col).
  bool pointwise() const { return k == 1 && stride == 1 && pad == 0; }
};

// One image [c, h, w] -> its column matrix [c * k * k, oh * ow] (zeros where the kernel
// overlaps the padding).
void Im2Col(const ConvShape& s, const float* x, float* col);
// The adjoint of Im2Col: sums a column matrix into one image gradient [c, h, w] (written, not
// accumulated). `col` is scratch: entries that fall into the padding may be overwritten.
void Col2Im(const ConvShape& s, float* col, float* dx);
// The same for output rows [oy0, oy0 + rows) only: a column tile [c * k * k, rows * ow].
// Col2ImRows ADDS into dx (tiles overlap in the input), and may overwrite `col` as Col2Im.
void Im2ColRows(const ConvShape& s, const float* x, int64_t oy0, int64_t rows, float* col);
void Col2ImRows(const ConvShape& s, float* col, int64_t oy0, int64_t rows, float* dx);

struct DnnlConv;  // oneDNN primitives and buffers of one convolution (runtime/dnnl_conv.h)

// Scratch memory reused across calls by the convolution kernels (grown on demand), and the
// oneDNN path's state for the shape it last ran (rebuilt when the shape or thread count
// changes). One per convolution layer.
struct ConvWorkspace {
  Tensor col;      // per thread: a column tile and its gradient
  Tensor partial;  // per thread: weight and bias gradient partial sums
  Tensor packed;   // weights re-laid out for the direct kernel
  std::shared_ptr<DnnlConv> dnnl;
};

// How Conv2dForward/Backward compute a shape. Which one is chosen (Conv2dPath) depends only on
// the shape, the CPU, the build, the thread count and the SetConvPathAllowed switches, never on
// timings, so that a run repeats bit for bit. The paths sum in different orders, so results
// differ between them in the last bits.
enum class ConvPath {
  kIm2col,  // im2col in row tiles + OpenBLAS GEMMs (every shape, every CPU)
  kDirect,  // CPD's direct AVX-512 3x3 kernels (see Conv2dPath)
  kDnnl,    // oneDNN's convolution primitives (builds with CPD_WITH_DNNL; see Conv2dPath)
};
const char* ConvPathName(ConvPath p);  // "im2col", "direct", "onednn"

// The path Conv2dForward and Conv2dBackward take for `s` with omp_get_max_threads() threads:
//  * direct: 3x3, stride 1, padding 1, width 8 or a multiple of 16, channel counts divisible by
//    the register tile, on a CPU with AVX-512F and FMA;
//  * onednn: otherwise, in a build with oneDNN, outside an OpenMP parallel region, for the
//    shapes where it measured faster than im2col (the rule and its measurements:
//    DnnlConvPreferred in cpu_ops.cc, benchmarks/RESULTS.md);
//  * im2col: everything else (and where oneDNN has only its reference code for a shape).
ConvPath Conv2dPath(const ConvShape& s);
// Whether `p` can compute `s` here (CPU, build, shape; onednn also needs n >= 1 and a call from
// outside a parallel region), whatever Conv2dPath would choose.
bool ConvPathRuns(ConvPath p, const ConvShape& s);
// For tests and benchmarks that compare the paths on one machine: with a path, Conv2dPath
// returns it for every shape it can run (im2col for the others) instead of its own choice;
// with nullopt (the default) it chooses again. Thread-safe; takes effect at the next call.
void OverrideConvPath(std::optional<ConvPath> p);

// y = conv(x, w) + bias (bias may be null). The path of Conv2dPath: direct and im2col run the
// images in parallel (per image the direct kernel, or im2col in row tiles + OpenBLAS GEMMs);
// oneDNN parallelises inside its primitives.
void Conv2dForward(const ConvShape& s, const float* x, const float* w, const float* bias, float* y,
                   ConvWorkspace* ws);

// Given dy [n, oc, oh, ow]: writes dw [oc, c, k, k] and, when non-null, db [oc] (the batch's
// gradients, not accumulated) and dx [n, c, h, w] (computed with `w`).
// REQUIRED: when x and w are the pointers of this workspace's last Conv2dForward (same shape),
// their contents must not have changed since: the oneDNN path then reuses the copy of x it
// re-laid out in that forward. (Conv2d calls it so: its Backward uses the tensors of its last
// training forward, which must stay unchanged.)
void Conv2dBackward(const ConvShape& s, const float* x, const float* w, const float* dy, float* dx,
                    float* dw, float* db, ConvWorkspace* ws);

// ---- Fully connected ------------------------------------------------------------------------
// y [n, out] = x [n, in] w^T + bias (bias may be null); w is [out, in].
void LinearForward(int64_t n, int64_t in, int64_t out, const float* x, const float* w,
                   const float* bias, float* y);
// dw [out, in] = dy^T x and db [out] = column sums of dy (written, not accumulated; db may be
// null); dx [n, in] = dy w when dx is non-null.
void LinearBackward(int64_t n, int64_t in, int64_t out, const float* x, const float* w,
                    const float* dy, float* dx, float* dw, float* db);

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
