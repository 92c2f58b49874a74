// Transforms applied to both operands of a matrix product before they are quantised (issue 29):
// block Hadamard transforms with random or fixed signs. See kernels/hadamard.h for the maths.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "cpd/status.h"

namespace cpd {

struct HadamardOptions {
  uint32_t block = 16;       // k: a power of two, 16..256
  bool random_signs = true;  // D from CPD's stream (seed, step); false: D = I
  uint64_t seed = 0;
  uint64_t step = 0;
  int threads = 0;  // 0 = all cores
};

// "rht16" (random signs, block 16) ... "rht256", "had16" ... "had256" (deterministic).
Result<HadamardOptions> ParseHadamard(std::string_view spec);
std::string HadamardSpec(const HadamardOptions& opts);

// Transforms the row-major rows x cols matrix x in place: each group of `block` consecutive
// rows, down every column. Rows beyond the last whole group are left as they are (the identity
// on them keeps the transform orthogonal). Results do not depend on the thread count.
Status HadamardAlongRows(const HadamardOptions& opts, float* x, size_t rows, size_t cols);

}  // namespace cpd
