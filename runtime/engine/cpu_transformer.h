// The CPU math of the Transformer layers (runtime/nn/embedding.h, normalization.h, attention.h):
// embedding gather and scatter-add, layer normalisation, the exact GELU, head split/merge, the
// causal softmax and the batched products of attention. runtime/engine/cuda_transformer.h has the
// same functions over device pointers, which share the per-element formulas
// (runtime/engine/lm_elementwise.h): the CPU is the reference of the GPU.
//
// Threading and determinism as in cpu_ops.h: OpenMP over rows (or over (batch, head) pairs,
// each calling OpenBLAS single-threaded); every reduction here (the gradients of tables and of
// gamma/beta, the row statistics) runs in a fixed order on one thread per output element, so
// results do not depend on the thread count. Outputs are written, not accumulated, unless
// stated otherwise, and must not alias inputs.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cpd::runtime::cpu {

// ---- Embeddings -------------------------------------------------------------------------------
// y [n, c] = table[ids[i]] row by row (ids already checked to lie in [0, rows of table)).
void EmbeddingForward(int64_t n, int64_t c, const int32_t* ids, const float* table, float* y);
// dtable [vocab, c] = sum over i with ids[i] = v of dy[i] (every row written: zeros where no id
// occurs). Each column block is owned by one thread and summed in token order.
void EmbeddingBackward(int64_t n, int64_t c, int64_t vocab, const int32_t* ids, const float* dy,
                       float* dtable);
// y [b, t, c] = x + table[0:t] (the table broadcast over the batch).
void PositionAddForward(int64_t b, int64_t t, int64_t c, const float* x, const float* table,
                        float* y);
// dtable [t, c] = sum over the batch of dy [b, t, c], in batch order.
void PositionAddBackward(int64_t b, int64_t t, int64_t c, const float* dy, float* dtable);

// ---- Layer normalisation over the last dimension ----------------------------------------------
// x [rows, c]; y = (x - mean) * rstd * gamma + beta with the biased variance and
// rstd = 1 / sqrt(var + eps) (statistics accumulated in double, as torch.nn.LayerNorm's
// definition; writes mean and rstd per row for the backward).
void LayerNormForward(int64_t rows, int64_t c, const float* x, const float* gamma,
                      const float* beta, float eps, float* y, float* mean, float* rstd);
// dx [rows, c], dgamma [c] and dbeta [c] (written, not accumulated).
void LayerNormBackward(int64_t rows, int64_t c, const float* x, const float* dy, const float* gamma,
                       const float* mean, const float* rstd, float* dx, float* dgamma,
                       float* dbeta);

// ---- GELU, the exact form: y = x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)) -------------------------
void GeluForward(size_t n, const float* x, float* y);
// dx = dy * (Phi(x) + x phi(x)), phi the standard normal density.
void GeluBackward(size_t n, const float* x, const float* dy, float* dx);

// ---- Attention ----------------------------------------------------------------------------------
// qkv [b, t, 3 * h * d] (the c_attn output: q, k, v one after another along the last dimension,
// each split into h heads of d) -> q, k, v [b, h, t, d].
void SplitHeads(int64_t b, int64_t t, int64_t h, int64_t d, const float* qkv, float* q, float* k,
                float* v);
// The adjoint: dq, dk, dv [b, h, t, d] -> dqkv [b, t, 3 * h * d].
void SplitHeadsBackward(int64_t b, int64_t t, int64_t h, int64_t d, const float* dq,
                        const float* dk, const float* dv, float* dqkv);
// o [b, h, t, d] -> y [b, t, h * d], and its adjoint.
void MergeHeads(int64_t b, int64_t t, int64_t h, int64_t d, const float* o, float* y);
void MergeHeadsBackward(int64_t b, int64_t t, int64_t h, int64_t d, const float* dy, float* dout);

// For each of `batch` matrices [t, t]: p = softmax over s <= r of row r of s (the causal mask:
// p[r, s > r] = 0). Row maxima are subtracted first.
void CausalSoftmaxForward(int64_t batch, int64_t t, const float* s, float* p);
// One row of it: p[0..r] = softmax of s[0..r], p[r + 1 .. n) = 0 (p may be s). Writes the row
// maximum and the reciprocal of the sum of exponentials (summed in double), from which
// p[j] = lm::SoftmaxExp(s[j], *row_max) * *row_inv is recomputed bit for bit.
void CausalSoftmaxRow(const float* s, int64_t r, int64_t n, float* p, float* row_max,
                      float* row_inv);
// ds = p * (dp - sum_s(dp * p)) per row (0 above the diagonal).
void CausalSoftmaxBackward(int64_t batch, int64_t t, const float* p, const float* dp, float* ds);

// For each of `batch` pairs: c [m, n] = alpha * a [m, k] op(b), op(b) = b^T for b [n, k] when
// trans_b, else b [k, n]. One single-threaded sgemm per batch entry, OpenMP over the batch.
void BatchedMatmul(int64_t batch, int64_t m, int64_t n, int64_t k, bool trans_b, float alpha,
                   const float* a, const float* b, float* c);
// Its backward from dc [batch, m, n]: da = alpha * dc op(b)^T, db = alpha * (dc^T a when
// trans_b, else a^T dc).
void BatchedMatmulBackward(int64_t batch, int64_t m, int64_t n, int64_t k, bool trans_b,
                           float alpha, const float* a, const float* b, const float* dc, float* da,
                           float* db);

}  // namespace cpd::runtime::cpu
