#include "cpd/transform.h"

#include <omp.h>

#include <algorithm>
#include <charconv>
#include <vector>

#include "kernels/hadamard.h"

namespace cpd {

namespace {

bool ValidBlock(uint32_t k) { return k >= 16 && k <= 256 && (k & (k - 1)) == 0; }

// One group of k rows, columns [c0, c1): the butterflies stage by stage, each stage a pass over
// rows that vectorises along the columns. The signs ride on the first stage and the scale on the
// last (both exact or rounded once, as separate passes would be), which saves two passes.
void TransformGroup(float* x, size_t cols, size_t c0, size_t c1, uint32_t k, const float* signs,
                    float scale) {
  for (uint32_t h = 1; h < k; h *= 2) {
    const bool first = h == 1, last = 2 * h == k;
    for (uint32_t r = 0; r < k; ++r) {
      if ((r & h) != 0) continue;
      float* a = x + size_t(r) * cols;
      float* b = x + size_t(r + h) * cols;
      const float sa = first ? signs[r] : 1.0f, sb = first ? signs[r + h] : 1.0f;
      // The same per-element operations as the CUDA kernel (kernels/cuda/hadamard.cu).
      if (last) {
#pragma omp simd
        for (size_t c = c0; c < c1; ++c) kernels::HadamardScaledButterfly(a + c, b + c, scale);
      } else {
#pragma omp simd
        for (size_t c = c0; c < c1; ++c) kernels::HadamardSignedButterfly(a + c, b + c, sa, sb);
      }
    }
  }
}

}  // namespace

Result<HadamardOptions> ParseHadamard(std::string_view spec) {
  HadamardOptions o;
  std::string_view digits;
  if (spec.substr(0, 3) == "rht") {
    o.random_signs = true;
    digits = spec.substr(3);
  } else if (spec.substr(0, 3) == "had") {
    o.random_signs = false;
    digits = spec.substr(3);
  }
  uint32_t k = 0;
  const auto [p, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), k);
  // Leading zeros refused, as in format specs: one spelling per transform.
  if (digits.empty() || digits[0] == '0' || ec != std::errc() ||
      p != digits.data() + digits.size() || !ValidBlock(k)) {
    return Status::InvalidArgument("bad transform '" + std::string(spec) +
                                   "' (accepted: rht<k> random-sign or had<k> deterministic "
                                   "block Hadamard, k a power of two 16..256, e.g. rht16)");
  }
  o.block = k;
  return o;
}

std::string HadamardSpec(const HadamardOptions& opts) {
  return (opts.random_signs ? "rht" : "had") + std::to_string(opts.block);
}

Status HadamardAlongRows(const HadamardOptions& opts, float* x, size_t rows, size_t cols) {
  if (!ValidBlock(opts.block)) {
    return Status::InvalidArgument("Hadamard block " + std::to_string(opts.block) +
                                   " is not a power of two in 16..256");
  }
  if (rows * cols > 0 && x == nullptr) return Status::InvalidArgument("Hadamard: null buffer");
  const uint32_t k = opts.block;
  std::vector<float> signs(k, 1.0f);
  if (opts.random_signs) {
    const uint64_t key = kernels::MakeRandomKey(opts.seed, opts.step);
    for (uint32_t i = 0; i < k; ++i) signs[i] = kernels::HadamardSign(key, i);
  }
  const float scale = kernels::HadamardScale(k);
  const size_t groups = rows / k;
  // Work items: (group, column tile); each touches its own elements, so the result is the same
  // for any thread count.
  // A tile of k rows stays in L1 (32 KiB) through its log2(k) butterfly stages.
  const size_t kTile = std::clamp<size_t>(8192 / k, 64, 256);
  const size_t tiles = (cols + kTile - 1) / kTile;
  const size_t items = groups * tiles;
  const int max_threads = opts.threads > 0 ? opts.threads : omp_get_max_threads();
  const int threads = int(std::max<size_t>(1, std::min<size_t>(size_t(max_threads), items)));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (size_t it = 0; it < items; ++it) {
    const size_t g = it / tiles, t = it % tiles;
    const size_t c0 = t * kTile, c1 = std::min(cols, c0 + kTile);
    TransformGroup(x + g * k * cols, cols, c0, c1, k, signs.data(), scale);
  }
  return Status::Ok();
}

}  // namespace cpd
