// The CPU math of the recurrent layers (runtime/nn/recurrent.h): the LSTM cell's gates forward and
// backward, the per-timestep products of the recurrence, and the batch-first / time-major
// transposes around them. runtime/engine/cuda_recurrent.h has the same functions over device
// pointers, which share the cell's per-element formulas (runtime/engine/lm_elementwise.h).
//
// Threading and determinism: results do not depend on the thread count. The elementwise passes
// compute each element on its own; the products split their output columns into blocks of a
// fixed width (not one per thread), each computed by one single-threaded sgemm, so every
// element is summed in the same order whatever the team; column sums run on one thread per
// column block, in row order. Outputs are written, not accumulated, unless stated otherwise, and
// must not alias inputs.
#pragma once

#include <cstdint>

namespace cpd::runtime::cpu {

// y [b1, b0, c] = x [b0, b1, c] with its two leading dimensions swapped (batch-first [B, T, C] to
// time-major [T, B, C] with b0 = B, b1 = T; the adjoint swaps back with b0 = T, b1 = B).
void SwapLeadingDims(int64_t b0, int64_t b1, int64_t c, const float* x, float* y);

// C [m, n] = alpha * op(A) op(B) + beta * C, op(A) = A^T for A [k, m] (trans_a) or A [m, k], op(B)
// = B^T for B [n, k] (trans_b) or B [k, n]; row-major with leading dimensions lda, ldb, ldc. The
// columns of C are split into blocks of a fixed width, spread over the OpenMP team (one
// single-threaded sgemm each), so that a product with few rows (one timestep of a batch) still runs
// in parallel, and bit for bit the same for every thread count. Small products run on the calling
// thread.
void ColumnBlockedSgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                        const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                        float* c, int64_t ldc);

// y [rows, cols] = row [cols] copied into every row (the bias a product then accumulates onto).
void BroadcastRows(int64_t rows, int64_t cols, const float* row, float* y);

// out [cols] = sum over the rows of x [rows, cols], in row order (the bias gradient of a product
// over every timestep).
void SumRows(int64_t rows, int64_t cols, const float* x, float* out);

// One timestep of the LSTM cell for a batch of b rows with h hidden units (PyTorch's nn.LSTM;
// Hochreiter and Schmidhuber 1997, with the forget gate of Gers et al. 2000):
//   z = gx + gh (the pre-activations, gates i, f, g, o in blocks of h along each row of 4h),
//   i = sigmoid(z_i), f = sigmoid(z_f), g = tanh(z_g), o = sigmoid(z_o),
//   c = f * c_prev + i * g,  h_out = o * tanh(c).
// gx [b, 4h] (input projection with its bias), gh [b, 4h] (recurrent projection with its bias),
// c_prev [b, h]. Writes the activated gates [b, 4h] (i, f, g, o) to `gates` for the backward, the
// cell state c [b, h] and h_out [b, h].
void LstmCellForward(int64_t b, int64_t h, const float* gx, const float* gh, const float* c_prev,
                     float* gates, float* c, float* h_out);

// The cell's backward at one timestep, from the saved gates [b, 4h], c_prev and c [b, h]. dL/dh_t
// is dy + dh_rec: dy [b, h] the gradient of the layer's output at t, dh_rec [b, h] the one that
// came back through the recurrence from step t + 1 (null at the last step: zero). dc [b, h] is
// read as dL/dc_t through c_{t+1} (zeros at the last step) and overwritten with dL/dc_{t-1}.
// Writes dz [b, 4h], the gradient of the pre-activations z (gates i, f, g, o); with
// dh = dy + dh_rec:
//   dc_t = dc + dh * o * (1 - tanh(c)^2);  dz_i = dc_t * g * i (1 - i);
//   dz_f = dc_t * c_prev * f (1 - f);  dz_g = dc_t * i * (1 - g^2);  dz_o = dh * tanh(c) o (1 - o);
//   dc_{t-1} = dc_t * f.
void LstmCellBackward(int64_t b, int64_t h, const float* gates, const float* c_prev, const float* c,
                      const float* dy, const float* dh_rec, float* dc, float* dz);

}  // namespace cpd::runtime::cpu
