// The CUDA math of the Transformer layers (only in a CUDA build: CPD_WITH_CUDA): every function of
// runtime/engine/cpu_transformer.h, with the same name, arguments, layouts and contracts, over
// device pointers of the current device. The layers (runtime/nn/embedding.h, normalization.h,
// attention.h) call these when their tensors are Device::kCuda tensors. Kernels in
// runtime/engine/cuda_kernels_transformer.cu; the batched products through cuBLAS
// (cublasSgemmStridedBatched on the context's handle: float32 math, never TF32).
//
// Agreement with the CPU functions of the same name (the CPU is the reference):
//  * bit for bit: EmbeddingForward, EmbeddingBackward (each table element summed by one thread in
//    token order, as the CPU's column-block loop sums it), PositionAddForward/Backward,
//    LayerNormForward/Backward (one thread per row runs the CPU's double sums in index order,
//    one thread per column sums dgamma/dbeta in row order; the per-element formulas are the
//    CPU's, runtime/engine/lm_elementwise.h), SplitHeads, MergeHeads and their backwards;
//  * to a few ulp: GeluForward/Backward (the CPU's formulas, with CUDA's erff/expf instead of
//    glibc's), CausalSoftmaxForward/Backward (CUDA's expf; the row sums in double, reduced over a
//    warp instead of in index order, so that float(sum) may differ in its last bit);
//  * to float32 rounding (another summation order): BatchedMatmul, BatchedMatmulBackward.
// Nothing uses atomics; the same inputs give the same bits on the same GPU and build.
//
// Execution, errors and thread-safety as in runtime/engine/cuda_ops.h: queued on Stream(),
// returning without waiting; every call checked (std::runtime_error naming the file, line and
// CUDA's error); sizes that the kernels' 32-bit indexing cannot reach throw
// std::invalid_argument. `ids` are device arrays of int32 already checked to lie in [0, vocab):
// an id outside it is undefined behaviour here, so the layers check ids on the host.
#pragma once

#include "cpd/config.h"

#if CPD_WITH_CUDA

#include <cstddef>
#include <cstdint>

namespace cpd::runtime::cuda {

// ---- Embeddings -------------------------------------------------------------------------------
void EmbeddingForward(int64_t n, int64_t c, const int32_t* ids, const float* table, float* y);
void EmbeddingBackward(int64_t n, int64_t c, int64_t vocab, const int32_t* ids, const float* dy,
                       float* dtable);
void PositionAddForward(int64_t b, int64_t t, int64_t c, const float* x, const float* table,
                        float* y);
void PositionAddBackward(int64_t b, int64_t t, int64_t c, const float* dy, float* dtable);

// ---- Layer normalisation over the last dimension ----------------------------------------------
void LayerNormForward(int64_t rows, int64_t c, const float* x, const float* gamma,
                      const float* beta, float eps, float* y, float* mean, float* rstd);
void LayerNormBackward(int64_t rows, int64_t c, const float* x, const float* dy, const float* gamma,
                       const float* mean, const float* rstd, float* dx, float* dgamma,
                       float* dbeta);

// ---- GELU, the exact form ---------------------------------------------------------------------
void GeluForward(size_t n, const float* x, float* y);
void GeluBackward(size_t n, const float* x, const float* dy, float* dx);

// ---- Attention ----------------------------------------------------------------------------------
void SplitHeads(int64_t b, int64_t t, int64_t h, int64_t d, const float* qkv, float* q, float* k,
                float* v);
void SplitHeadsBackward(int64_t b, int64_t t, int64_t h, int64_t d, const float* dq,
                        const float* dk, const float* dv, float* dqkv);
void MergeHeads(int64_t b, int64_t t, int64_t h, int64_t d, const float* o, float* y);
void MergeHeadsBackward(int64_t b, int64_t t, int64_t h, int64_t d, const float* dy, float* dout);
void CausalSoftmaxForward(int64_t batch, int64_t t, const float* s, float* p);
void CausalSoftmaxBackward(int64_t batch, int64_t t, const float* p, const float* dp, float* ds);
void BatchedMatmul(int64_t batch, int64_t m, int64_t n, int64_t k, bool trans_b, float alpha,
                   const float* a, const float* b, float* c);
void BatchedMatmulBackward(int64_t batch, int64_t m, int64_t n, int64_t k, bool trans_b,
                           float alpha, const float* a, const float* b, const float* dc, float* da,
                           float* db);

}  // namespace cpd::runtime::cuda

#endif  // CPD_WITH_CUDA
