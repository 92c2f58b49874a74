// Fused causal attention on the CPU: O = dropout(softmax_causal(alpha Q K^T)) V for each
// (batch, head) pair, without materialising the [T, T] scores and probabilities of all pairs.
// Each thread takes whole (batch, head) pairs and walks their queries in blocks of
// kAttentionQueryBlock rows: the block's scores against the keys it may see (0 .. its last
// row) live in a per-thread buffer of kAttentionQueryBlock x T floats, are turned into
// probabilities and multiplied into O at once. The forward keeps two floats per query row (the
// row maximum and the reciprocal of the sum of exponentials); the backward recomputes the
// scores and probabilities block by block from Q, K and them (FlashAttention-2's recomputation,
// Dao 2023, with whole key rows per block rather than an online softmax: a row of T floats fits
// a CPU cache). Memory: O(threads * block * T) floats instead of the O(B H T^2) of the
// materialised path.
//
// The probabilities are the materialised path's bit for bit (cpu::CausalSoftmaxForward's
// formula: p = exp(s - max) * float(1 / sum), the sum in double), and so is the dropout mask
// (element (pair, r, s) of the [pairs, T, T] probabilities kept iff
// kernels::RandomBits(key, (pair T + r) T + s) >= threshold, as Dropout draws it). The
// products are blocked differently, so O and the gradients agree with the materialised path to
// float32 rounding, not bit for bit. Deterministic: a pair's results come from one thread in a
// fixed order whatever the thread count.
#pragma once

#include <cstdint>

namespace cpd::runtime::cpu {

inline constexpr int64_t kAttentionQueryBlock = 64;

// Attention dropout on the probabilities (Dropout's mask and scale); threshold 0: none.
struct AttentionDropout {
  uint64_t key = 0;
  uint32_t threshold = 0;
  float scale = 1.f;
};

// q, k, v, o [pairs, t, d]; row_max and row_inv [pairs, t] (written, for the backward).
void FusedCausalAttentionForward(int64_t pairs, int64_t t, int64_t d, float alpha, const float* q,
                                 const float* k, const float* v, const AttentionDropout& dropout,
                                 float* o, float* row_max, float* row_inv);

// dq, dk, dv [pairs, t, d] from do_ [pairs, t, d], given the forward's inputs, output o and
// row statistics (written, not accumulated).
void FusedCausalAttentionBackward(int64_t pairs, int64_t t, int64_t d, float alpha, const float* q,
                                  const float* k, const float* v, const float* o,
                                  const float* row_max, const float* row_inv,
                                  const AttentionDropout& dropout, const float* do_, float* dq,
                                  float* dk, float* dv);

}  // namespace cpd::runtime::cpu
