#include "cpd/transform.h"

#include <omp.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <vector>

#include "kernels/clones.h"
#include "kernels/hadamard.h"

namespace cpd {

namespace {

bool ValidBlock(uint32_t k) { return k >= 16 && k <= 256 && (k & (k - 1)) == 0; }

// Where one pass over the group reads its rows and where it writes them: row r at
// base + r * stride. The first pass may read x and the last write it while the others work in a
// packed tile.
struct Rows {
  float* base;
  size_t stride;
  float* row(uint32_t r) const { return base + size_t(r) * stride; }
};

// One butterfly stage h on rows r and r + h, w columns: signs (sa, sb) at the first stage, 1
// (exact) at the others, the scale at the last. The same per-element operations as the CUDA
// kernel (kernels/cuda/hadamard.cu).
inline __attribute__((always_inline)) void Stage2(Rows in, Rows out, uint32_t r, uint32_t h,
                                                  size_t w, float sa, float sb, bool last,
                                                  float scale) {
  const float *ia = in.row(r), *ib = in.row(r + h);
  float *oa = out.row(r), *ob = out.row(r + h);
#pragma omp simd
  for (size_t c = 0; c < w; ++c) {
    float a = ia[c], b = ib[c];
    if (last) {
      kernels::HadamardScaledButterfly(&a, &b, scale);
    } else {
      kernels::HadamardSignedButterfly(&a, &b, sa, sb);
    }
    oa[c] = a;
    ob[c] = b;
  }
}

// Stages h and 2h at once on rows r, r + h, r + 2h, r + 3h (r & 3h == 0): each element meets the
// operations of the two separate stages in their order, in registers, so the tile goes through
// L1 half as often. s[4] are the four rows' signs (1 unless stage h is the first).
inline __attribute__((always_inline)) void Stage4(Rows in, Rows out, uint32_t r, uint32_t h,
                                                  size_t w, const float (&s)[4], bool last,
                                                  float scale) {
  const float *i0 = in.row(r), *i1 = in.row(r + h), *i2 = in.row(r + 2 * h),
              *i3 = in.row(r + 3 * h);
  float *o0 = out.row(r), *o1 = out.row(r + h), *o2 = out.row(r + 2 * h), *o3 = out.row(r + 3 * h);
#pragma omp simd
  for (size_t c = 0; c < w; ++c) {
    float a = i0[c], b = i1[c], d = i2[c], e = i3[c];
    kernels::HadamardSignedButterfly(&a, &b, s[0], s[1]);  // stage h
    kernels::HadamardSignedButterfly(&d, &e, s[2], s[3]);
    if (last) {  // stage 2h
      kernels::HadamardScaledButterfly(&a, &d, scale);
      kernels::HadamardScaledButterfly(&b, &e, scale);
    } else {
      kernels::HadamardSignedButterfly(&a, &d, 1.0f, 1.0f);
      kernels::HadamardSignedButterfly(&b, &e, 1.0f, 1.0f);
    }
    o0[c] = a;
    o1[c] = b;
    o2[c] = d;
    o3[c] = e;
  }
}

// One group of k rows of x (rows `cols` apart), columns [c0, c1): the butterflies stage by stage,
// two at a time where two remain, each pass over rows vectorising along the columns. The signs
// ride on the first stage and the scale on the last (both exact or rounded once, as separate
// passes would be). Between the first pass (which reads x) and the last (which writes it) the
// rows live in a packed tile of w = c1 - c0 columns: in place, rows a power-of-two multiple of
// 4 KiB apart (a tensor of 4096 columns) fall into the same few L1 sets and evict each other
// between passes. Compiled per ISA (CPD_CLONES): these loops are the transform's whole cost.
CPD_CLONES void TransformGroup(float* x, size_t cols, size_t c0, size_t c1, uint32_t k,
                               const float* signs, float scale, float* tile) {
  const size_t w = c1 - c0;
  const Rows outer{x + c0, cols}, packed{tile, w};
  for (uint32_t h = 1; h < k;) {
    const bool first = h == 1;
    const uint32_t next = 4 * h <= k ? 4 * h : 2 * h;
    const bool last = next == k;
    const Rows in = first ? outer : packed, out = last ? outer : packed;
    if (next == 4 * h) {
      for (uint32_t r = 0; r < k; ++r) {
        if ((r & (3 * h)) != 0) continue;
        const float s[4] = {first ? signs[r] : 1.0f, first ? signs[r + h] : 1.0f,
                            first ? signs[r + 2 * h] : 1.0f, first ? signs[r + 3 * h] : 1.0f};
        Stage4(in, out, r, h, w, s, last, scale);
      }
    } else {
      for (uint32_t r = 0; r < k; ++r) {
        if ((r & h) != 0) continue;
        Stage2(in, out, r, h, w, first ? signs[r] : 1.0f, first ? signs[r + h] : 1.0f, last, scale);
      }
    }
    h = next;
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
  const size_t kTile = std::clamp<size_t>(16384 / k, 64, 256);
  const size_t tiles = (cols + kTile - 1) / kTile;
  const size_t items = groups * tiles;
  const int max_threads = opts.threads > 0 ? opts.threads : omp_get_max_threads();
  const int threads = int(std::max<size_t>(1, std::min<size_t>(size_t(max_threads), items)));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> tile(k * kTile);
#pragma omp for schedule(static)
    for (size_t it = 0; it < items; ++it) {
      const size_t g = it / tiles, t = it % tiles;
      const size_t c0 = t * kTile, c1 = std::min(cols, c0 + kTile);
      TransformGroup(x + g * k * cols, cols, c0, c1, k, signs.data(), scale, tile.data());
    }
  }
  return Status::Ok();
}

}  // namespace cpd
