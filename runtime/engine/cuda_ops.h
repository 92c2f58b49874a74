// The CUDA math of the layers in runtime/nn/layers.h (only in a CUDA build: CPD_WITH_CUDA): the
// functions of runtime/engine/cpu_ops.h over device pointers, plus the optimiser's update kernels.
// Layers dispatch to these when their tensors are Device::kCuda tensors. The language-model
// layers' math has headers of its own: runtime/engine/cuda_transformer.h and cuda_recurrent.h.
//
// Compute: GEMMs through cuBLAS (cublasGemmEx, CUBLAS_COMPUTE_32F: float32 multiply-adds, never
// TF32), convolutions through cuDNN's convolution API (libcudnn_cnn; only algorithms cuDNN
// reports as CUDNN_DETERMINISTIC and, unless SetConvAlgoPolicy(kFast), only GEMM-like ones at
// math type CUDNN_FMA_MATH, so never Winograd, FFT or TF32: runtime/engine/conv_algos.h),
// everything else in own kernels (runtime/engine/cuda_ops.cu and runtime/cuda_kernels_*.cu, built
// with -fmad=false like the CPU code's -ffp-contract=off).
//
// Agreement with the CPU functions of the same name:
//  * bit for bit: Relu, ReluBackward, AddRelu, Add, AddInPlace, DropoutApply (the same
//    counter-based mask), MaxPool2dForward/Backward (argmax and gradient, NaN and ties
//    included), AvgPool2dForward/Backward, GlobalAvgPoolBackward, the bias gradient of
//    LinearBackward, BatchNormEvalForward, BatchNormUpdateRunning given the same batch
//    statistics, and the optimiser updates (SgdUpdate, AdamWUpdate; ChunkSumSquares sums in the
//    CPU's order);
//  * to float32 rounding (a different summation order): LinearForward/Backward's GEMMs,
//    Conv2dForward/Backward (under ConvAlgoPolicy::kExact), the batch statistics of
//    BatchNormTrainForward and the sums of BatchNormBackward (accumulated in double),
//    GlobalAvgPoolForward, SoftmaxCrossEntropy (double, CUDA's exp/log).
// Results are deterministic: the same inputs give the same bits on the same GPU and build.
//
// Execution: work is queued on one process-wide stream (Stream(); created blocking, so it is
// ordered against the legacy default stream that Tensor's copies use) and the calls return
// without waiting, except where a function says it returns a host value. Scratch memory (the
// cuDNN workspace, reduction partials) belongs to the process-wide context and is reused in
// stream order. The context is created on first use on the current device.
//
// Thread-safety: one host thread at a time may call into this file (as one thread drives a
// model); the context is not locked.
//
// Errors: every CUDA, cuBLAS and cuDNN call is checked; a failure throws std::runtime_error
// "CUDA error at FILE:LINE: EXPRESSION: <the library's error text>". Launchers check their sizes
// (they throw std::invalid_argument for sizes the kernels cannot index).
//
// Pointers are device pointers on the current device unless stated; outputs are overwritten
// (not accumulated) and must not alias inputs unless stated. Sizes and layouts are those of the
// CPU function with the same name (runtime/engine/cpu_ops.h).
#pragma once

#include "cpd/config.h"

#if CPD_WITH_CUDA

#include <cstddef>
#include <cstdint>

#include "kernels/accumulate.h"
#include "runtime/engine/conv_algos.h"
#include "runtime/engine/conv_shape.h"

namespace cpd::runtime::cuda {

// ---- Context ----------------------------------------------------------------------------------
// The stream every function here queues its work on, as a cudaStream_t.
void* Stream();
// Waits until everything queued on Stream() has run (for timing; copies to the host wait by
// themselves).
void Synchronize();

// ---- Convolution algorithms -------------------------------------------------------------------
// Which of cuDNN's algorithms Conv2dForward/Backward may use (runtime/engine/conv_algos.h): kExact
// (the default) or kFast (cpd-train --fast-conv-algos). Takes effect from the next convolution:
// plans are cached per shape and policy, so switching back reuses the earlier ones. A plain
// setting: it creates no CUDA state and needs no GPU.
void SetConvAlgoPolicy(ConvAlgoPolicy policy);
ConvAlgoPolicy GetConvAlgoPolicy();
// The algorithm, math type and workspace with which `pass` of the convolution `s` runs under the
// policy in force (plans the shape if it has not run yet; needs a GPU). For tests and reports.
ConvAlgoChoice ChosenConvAlgo(const cpu::ConvShape& s, ConvPass pass);

// ---- Fully connected --------------------------------------------------------------------------
// As cpu::LinearForward / LinearBackward (row-major x [n, in], w [out, in], y [n, out]). With
// `acc` the products are kernels/cuda/accumulate.h's, bit for bit the CPU's.
void LinearForward(int64_t n, int64_t in, int64_t out, const float* x, const float* w,
                   const float* bias, float* y, const kernels::Accumulation* acc = nullptr);
void LinearBackward(int64_t n, int64_t in, int64_t out, const float* x, const float* w,
                    const float* dy, float* dx, float* dw, float* db,
                    const kernels::Accumulation* acc = nullptr);

// ---- Convolution (cuDNN) ----------------------------------------------------------------------
// As cpu::Conv2dForward / Conv2dBackward, without the CPU's workspace argument. The cuDNN
// descriptors and the chosen algorithms are cached per shape.
void Conv2dForward(const cpu::ConvShape& s, const float* x, const float* w, const float* bias,
                   float* y);
void Conv2dBackward(const cpu::ConvShape& s, const float* x, const float* w, const float* dy,
                    float* dx, float* dw, float* db);

// ---- Batch normalisation ------------------------------------------------------------------------
// As the CPU functions; mean/var/invstd are device arrays of c floats.
void BatchNormTrainForward(int64_t n, int64_t c, int64_t hw, const float* x, const float* gamma,
                           const float* beta, float eps, bool relu, float* y, float* mean,
                           float* var, float* invstd);
void BatchNormEvalForward(int64_t n, int64_t c, int64_t hw, const float* x, const float* gamma,
                          const float* beta, const float* mean, const float* var, float eps,
                          bool relu, float* y);
void BatchNormBackward(int64_t n, int64_t c, int64_t hw, const float* x, const float* dy,
                       const float* relu_y, const float* gamma, const float* mean,
                       const float* invstd, float* dx, float* dgamma, float* dbeta);
// torch.nn.BatchNorm's running statistics, in place:
//   running_mean = (1 - momentum) running_mean + momentum mean
//   running_var  = (1 - momentum) running_var + momentum float(double(var) * unbias)
// in the float operations of BatchNorm::Forward's CPU loop (unbias = count / (count - 1)).
void BatchNormUpdateRunning(int64_t c, const float* mean, const float* var, float momentum,
                            double unbias, float* running_mean, float* running_var);

// ---- Pooling ------------------------------------------------------------------------------------
// argmax is a device array of int32 (one per output element).
void MaxPool2dForward(int64_t planes, int64_t h, int64_t w, int64_t k, int64_t stride, int64_t oh,
                      int64_t ow, const float* x, float* y, int32_t* argmax);
// Needs the window geometry (k, stride) to find, per input element, the outputs that may have
// chosen it; sums them in output order, as the CPU's scatter does.
void MaxPool2dBackward(int64_t planes, int64_t h, int64_t w, int64_t k, int64_t stride, int64_t oh,
                       int64_t ow, const float* dy, const int32_t* argmax, float* dx);
void AvgPool2dForward(int64_t planes, int64_t h, int64_t w, int64_t k, int64_t stride, int64_t oh,
                      int64_t ow, const float* x, float* y);
void AvgPool2dBackward(int64_t planes, int64_t h, int64_t w, int64_t k, int64_t stride, int64_t oh,
                       int64_t ow, const float* dy, float* dx);
void GlobalAvgPoolForward(int64_t planes, int64_t hw, const float* x, float* y);
void GlobalAvgPoolBackward(int64_t planes, int64_t hw, const float* dy, float* dx);

// ---- Elementwise --------------------------------------------------------------------------------
void Relu(size_t n, const float* x, float* y);
void ReluBackward(size_t n, const float* y, const float* dy, float* dx);
void AddRelu(size_t n, const float* a, const float* b, float* y);
void Add(size_t n, const float* a, const float* b, float* y);
void AddInPlace(size_t n, const float* x, float* y);
// y[i] = x[i] * s, one float32 multiply (the CPU's `x[i] * s`, bit for bit); y may equal x.
void Scale(size_t n, float s, const float* x, float* y);
void DropoutApply(size_t n, uint64_t key, uint32_t threshold, float scale, const float* x,
                  float* y);

// ---- Loss ---------------------------------------------------------------------------------------
// As cpu::SoftmaxCrossEntropy, except that `labels` is HOST memory (n int32 values, already
// checked to lie in [0, k)). Returns the mean loss, so it waits for the stream.
double SoftmaxCrossEntropy(int64_t n, int64_t k, const float* logits, const int32_t* labels,
                           float* dlogits);

// ---- Optimiser ----------------------------------------------------------------------------------
// One piece (at most 2^31 - 1 elements) of one parameter: the unit of the update kernels, in the
// Optimizer's chunk order (runtime/nn/optimizer.h).
struct OptimizerChunk {
  float* w;        // master value
  const float* g;  // gradient
  float* buf;      // momentum buffer (null without momentum); AdamW: the first moment m
  float* buf2;     // AdamW: the second moment v (null otherwise)
  uint32_t len;    // elements
  uint32_t param;  // index into the coefficient array
};
// Per parameter, the coefficients of one step (Optimizer's Coeffs).
struct OptimizerCoeffs {
  float lr;       // the param's lr (Optimizer::ParamLr: SGD lr; LARS lr * trust or excluded ratio)
  float wd;       // weight decay
  int32_t decay;  // 1: d = g + wd * w; 0: d = g
  int32_t pad;
};
// The update rules of runtime/nn/optimizer.h (SGD with (Nesterov) momentum, LARS' velocity form)
// over `num_chunks` chunks; `chunks` and `coeffs` are device arrays. Bit-identical to the CPU's
// Update<> for the same inputs.
void SgdUpdate(const OptimizerChunk* chunks, size_t num_chunks, const OptimizerCoeffs* coeffs,
               float momentum, bool lars, bool use_momentum, bool nesterov);
// One AdamW step's scalars (Optimizer::StepAdamW forms them in double and rounds each once).
struct AdamWCoeffs {
  float b1, one_minus_b1, b2, one_minus_b2;
  float bc2_sqrt;   // sqrt(1 - beta2^t)
  float step_size;  // lr / (1 - beta1^t)
  float eps;
};
// AdamW of runtime/nn/optimizer.h over `num_chunks` chunks (buf = m, buf2 = v); per param,
// coeffs[param].wd holds the decoupled decay factor 1 - lr * wd, applied where decay is 1.
// Bit-identical to the CPU's loop for the same inputs (IEEE sqrt and division, no FMA).
void AdamWUpdate(const OptimizerChunk* chunks, size_t num_chunks, const OptimizerCoeffs* coeffs,
                 const AdamWCoeffs& c);
// For each chunk c: partial[2c] = sum w^2 and partial[2c + 1] = sum g^2 (device doubles), each in
// the order of the CPU optimiser's SumSquares (float lanes over 64-element blocks, blocks and
// the tail added in double in order), so the LARS norms equal the CPU's bit for bit. With
// grads_only, only partial[2c + 1] is written (the global gradient norm of clipping). REQUIRES
// every chunk's len <= 16384 (the Optimizer's chunk size).
void ChunkSumSquares(const OptimizerChunk* chunks, size_t num_chunks, double* partial,
                     bool grads_only = false);

}  // namespace cpd::runtime::cuda

#endif  // CPD_WITH_CUDA
