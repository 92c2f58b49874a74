// Block Hadamard transforms (issue 29: the random Hadamard transforms of NVFP4 and MXFP4
// training): within each group of k = 2^m consecutive rows of a row-major matrix, every column
// x becomes (1/sqrt(k)) H_k D x, H_k the Sylvester Hadamard matrix and D a diagonal of signs.
// (1/sqrt(k)) H_k D is orthogonal, so transforming both operands of a product over the rows,
// A^T B = (Q A)^T (Q B), changes the product only by rounding, while the quantisation of Q A and
// Q B sees outliers spread over k values. Host/device, so that the CUDA kernels share the sign
// stream and the butterfly's order of operations with the CPU loop.
#pragma once

#include <cstdint>

#include "kernels/grid.h"

namespace cpd::kernels {

// The sign of row i of a group (0 <= i < k): bit 0 of CPD's counter-based stream at (key, i),
// the same for every group and both operands, so that D cancels in the product; key =
// MakeRandomKey(seed, step). Deterministic transforms use +1 throughout.
CPD_HD float HadamardSign(uint64_t key, uint32_t i) {
  return (RandomBits(key, i) & 1u) != 0 ? -1.0f : 1.0f;
}

// One butterfly of the fast Walsh-Hadamard transform on a pair of rows: (a, b) -> (a + b, a - b).
// The stages run h = 1, 2, 4, ..., k/2, pairs (r, r + h) with r & h == 0: every implementation
// takes this order, so that CPU and GPU round alike.
// Each output is one correctly rounded float32 add or subtract (on the GPU too, NaNs as x86
// gives them: AddAsX86), so CPU and GPU agree bit for bit.
CPD_HD void HadamardButterfly(float* a, float* b) {
  const float x = *a, y = *b;
  *a = AddAsX86(x, y);
  *b = SubAsX86(x, y);
}

// The first stage's butterfly, with the signs of its two rows multiplied in first (exact:
// sa, sb = +-1): (a, b) -> (a sa + b sb, a sa - b sb).
CPD_HD void HadamardSignedButterfly(float* a, float* b, float sa, float sb) {
  *a = MulAsX86(*a, sa);
  *b = MulAsX86(*b, sb);
  HadamardButterfly(a, b);
}

// The last stage's butterfly, both outputs then multiplied by the scale (HadamardScale(k)):
// (a, b) -> ((a + b) s, (a - b) s), each product rounded once.
CPD_HD void HadamardScaledButterfly(float* a, float* b, float scale) {
  HadamardButterfly(a, b);
  *a = MulAsX86(*a, scale);
  *b = MulAsX86(*b, scale);
}

// 1/sqrt(k) for k = 2^m, as float32: exact for even m, correctly rounded for odd m.
CPD_HD float HadamardScale(uint32_t k) {
  uint32_t m = 0;
  while ((1u << m) < k) ++m;
  const float half = Pow2(-int32_t(m / 2));
  return (m & 1u) != 0 ? half * 0.70710678118654752440f : half;
}

}  // namespace cpd::kernels
