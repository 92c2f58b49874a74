#include "cpd/quantize.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "cpd/quantize_internal.h"
#include "kernels/quantize_cpu.h"

namespace cpd {

namespace {

using internal::GroupLength;
using internal::ValidateSpan;
using kernels::BlockScale;
using kernels::ElementStats;
using kernels::FloatGrid;
using kernels::LinearGrid;
using kernels::LoopParams;

// Elements per work item: a multiple of 8 (so packed chunks start on a byte) and of 32 (MX
// blocks). Work items, not threads, fix the order in which statistics are merged.
constexpr size_t kChunk = size_t(1) << 16;

int ThreadCount(const QuantizeOptions& opts, size_t work_items) {
  const int t = opts.threads > 0 ? opts.threads : omp_get_max_threads();
  return int(std::max<size_t>(1, std::min<size_t>(size_t(t), work_items)));
}

// Per-group scale parameters: a shift for kSharedShift and kBinades, a linear grid for the
// integer formats.
struct Groups {
  size_t group_len = 0;  // elements per group (the last block may be shorter)
  std::vector<int> shifts;
  std::vector<LinearGrid> linear;
  size_t count() const { return std::max(shifts.size(), linear.size()); }
};

LinearGrid LinearGridFor(const Format& format, float lo, float hi, float max_abs) {
  if (format.family() == FormatFamily::kIntSymmetric) {
    return kernels::SymmetricIntGrid(max_abs, (1 << (format.bits() - 1)) - 1);
  }
  return kernels::MinMaxGrid(lo, hi, (1 << format.bits()) - 1);
}

// Chooses the scale of every group from the data.
Groups ComputeGroups(const Format& format, const float* in, size_t n, const QuantizeOptions& opts) {
  Groups groups;
  if (format.scope() == ScaleScope::kNone) return groups;
  const size_t num = format.num_groups(n, opts.channels);
  const size_t len = GroupLength(format, n, opts.channels);
  groups.group_len = len;
  const bool linear = format.family() == FormatFamily::kIntSymmetric ||
                      format.family() == FormatFamily::kUintMinMax;
  const bool minmax = format.family() == FormatFamily::kUintMinMax;
  if (linear) {
    groups.linear.resize(num);
  } else {
    groups.shifts.resize(num);
  }
  auto finish = [&](size_t gi, float lo, float hi, float max_abs) {
    if (linear) {
      groups.linear[gi] = LinearGridFor(format, lo, hi, max_abs);
    } else {
      groups.shifts[gi] = kernels::ShiftForMax(max_abs, format.shift_rule());
    }
  };

  if (num == 1 && n > kChunk) {
    // One large group: reduce chunk by chunk in parallel, then combine.
    const size_t chunks = (n + kChunk - 1) / kChunk;
    std::vector<float> lo(chunks), hi(chunks), mx(chunks);
#pragma omp parallel for num_threads(ThreadCount(opts, chunks)) schedule(static)
    for (size_t c = 0; c < chunks; ++c) {
      const size_t s = c * kChunk, e = std::min(n, s + kChunk);
      if (minmax) {
        kernels::MinMaxFinite(in + s, e - s, &lo[c], &hi[c]);
      } else {
        mx[c] = kernels::MaxAbsFinite(in + s, e - s);
      }
    }
    float l = INFINITY, h = -INFINITY, m = 0.0f;
    for (size_t c = 0; c < chunks; ++c) {
      l = std::min(l, lo[c]);
      h = std::max(h, hi[c]);
      m = std::max(m, mx[c]);
    }
    finish(0, l, h, m);
    return groups;
  }
  const size_t work = std::max<size_t>(1, n / kChunk);
#pragma omp parallel for num_threads(ThreadCount(opts, work)) schedule(static)
  for (size_t gi = 0; gi < num; ++gi) {
    const size_t s = gi * len, e = std::min(n, s + len);
    float lo = 0, hi = 0, m = 0;
    if (minmax) {
      kernels::MinMaxFinite(in + s, e - s, &lo, &hi);
    } else {
      m = kernels::MaxAbsFinite(in + s, e - s);
    }
    finish(gi, lo, hi, m);
  }
  return groups;
}

// Runs `fn(group_index, begin, end)` over the parts of chunk [s, e) that lie in each group.
template <typename Fn>
void ForEachGroupPart(const Groups& groups, size_t s, size_t e, Fn&& fn) {
  if (groups.count() == 0 || groups.group_len == 0) {
    fn(size_t(0), s, e);
    return;
  }
  size_t i = s;
  while (i < e) {
    const size_t gi = i / groups.group_len;
    const size_t end = std::min(e, (gi + 1) * groups.group_len);
    fn(gi, i, end);
    i = end;
  }
}

// Quantises [s, e) of `in`; writes floats to out (may be null) and codes to codes (may be null,
// indexed from s).
void QuantizeChunk(const Format& format, const Groups& groups, const float* in, float* out,
                   uint32_t* codes, size_t s, size_t e, const LoopParams& base, ElementStats* st) {
  ForEachGroupPart(groups, s, e, [&](size_t gi, size_t b, size_t f) {
    LoopParams p = base;
    p.index_base = base.index_base + b;
    uint32_t* c = codes != nullptr ? codes + (b - s) : nullptr;
    float* o = out != nullptr ? out + b : nullptr;
    if (format.is_float_grid()) {
      const int shift = groups.shifts.empty() ? 0 : groups.shifts[gi];
      kernels::QuantizeFloatGrid(in + b, o, c, f - b, format.grid(), shift, p, st);
    } else if (format.family() == FormatFamily::kBinades) {
      kernels::QuantizeBinadeGrid(in + b, o, c, f - b, format.binade_grid(), groups.shifts[gi], p,
                                  st);
    } else {
      kernels::QuantizeLinearGrid(in + b, o, c, f - b, groups.linear[gi], p, st);
    }
  });
}

void WriteMeta(const Format& format, const Groups& groups, uint8_t* dst) {
  const size_t num = groups.count();
  const size_t stride = format.meta_bytes_per_group();
  for (size_t gi = 0; gi < num; ++gi) {
    switch (format.family()) {
      case FormatFamily::kSharedShift:
      case FormatFamily::kBinades:
        dst[gi] = kernels::ShiftMetaByte(groups.shifts[gi], internal::ShiftMetaIsE8M0(format));
        break;
      case FormatFamily::kIntSymmetric:
      case FormatFamily::kUintMinMax:
        kernels::StoreLinearMeta(groups.linear[gi], internal::LinearMetaHasOffset(format),
                                 dst + stride * gi);
        break;
      default:
        break;
    }
  }
}

Groups ReadMeta(const Format& format, size_t n, size_t channels, const uint8_t* src) {
  Groups groups;
  if (format.scope() == ScaleScope::kNone) return groups;
  const size_t num = format.num_groups(n, channels);
  const size_t stride = format.meta_bytes_per_group();
  groups.group_len = GroupLength(format, n, channels);
  for (size_t gi = 0; gi < num; ++gi) {
    switch (format.family()) {
      case FormatFamily::kSharedShift:
      case FormatFamily::kBinades:
        groups.shifts.push_back(
            kernels::ShiftFromMetaByte(src[gi], internal::ShiftMetaIsE8M0(format)));
        break;
      case FormatFamily::kIntSymmetric:
      case FormatFamily::kUintMinMax:
        groups.linear.push_back(kernels::LoadLinearMeta(
            src + stride * gi, internal::LinearMetaHasOffset(format), format.bits()));
        break;
      default:
        break;
    }
  }
  return groups;
}

void FillStats(const ElementStats& e, size_t n, QuantStats* stats) {
  if (stats == nullptr) return;
  stats->count = n;
  stats->max_abs = e.max_abs;
  stats->saturated = e.saturated;
  stats->flushed = e.flushed;
  stats->nonfinite = e.nonfinite;
  stats->sq_error = e.sq_error;
  stats->sq_input = e.sq_input;
}

// ---- Block-scaled formats (FormatFamily::kBlockScaled): one scale per R x C block of the
// matrix view, chosen from the block's max |x| (and the tensor's, with a tensor level), then
// every element rounded under its block's scale.

struct BlockScales {
  BlockGridShape shape;
  float tensor_enc = 1.0f;            // the tensor level's encode scale (1 without)
  std::vector<int32_t> shifts;        // kPow2
  std::vector<BlockScale> scales;     // kFloat32, kFloatGrid
  std::vector<uint32_t> scale_codes;  // kFloatGrid: each block scale's code
  size_t count() const { return shape.block_rows * shape.block_cols; }
};

// max |x| of every block (NaN and Inf ignored), in block order.
void BlockMaxAbs(const Format& format, const float* in, const BlockGridShape& g,
                 const QuantizeOptions& opts, std::vector<float>* amax_out) {
  std::vector<float>& amax = *amax_out;
  amax.assign(g.block_rows * g.block_cols, 0.0f);
  const size_t R = format.block_rows();
  const size_t work = std::max<size_t>(1, g.rows * g.cols / kChunk);
#pragma omp parallel for num_threads(ThreadCount(opts, std::min(work, g.block_rows))) \
    schedule(static)
  for (size_t br = 0; br < g.block_rows; ++br) {
    for (size_t r = br * R; r < std::min(g.rows, (br + 1) * R); ++r) {
      kernels::MaxAbsPerBlock(in + r * g.cols, g.cols, 0, format.block_cols(),
                              amax.data() + br * g.block_cols);
    }
  }
}

// Fills *out (whose vectors keep their capacity from call to call: a tensor of NVFP4 has a
// scale per 16 elements, and fresh pages for them cost a fifth of the quantisation).
void ComputeBlockScales(const Format& format, const float* in, size_t n,
                        const QuantizeOptions& opts, BlockScales* out) {
  BlockScales& bs = *out;
  bs.shape = BlockGridOf(format, n, opts.channels, opts.columns);
  bs.tensor_enc = 1.0f;
  bs.shifts.clear();
  // A reference: inside the parallel loops below, the name of a thread_local would be each
  // worker's own (empty) vector.
  thread_local std::vector<float> amax_storage;
  std::vector<float>& amax = amax_storage;
  BlockMaxAbs(format, in, bs.shape, opts, &amax);
  const float elem_max = kernels::BitsFloat(format.grid().max_bits);
  switch (format.scale_type()) {
    case BlockScaleType::kPow2:
      for (float a : amax) bs.shifts.push_back(kernels::ShiftForMax(a, format.shift_rule()));
      break;
    case BlockScaleType::kFloat32:
    case BlockScaleType::kFloatGrid: {
      const bool on_grid = format.scale_type() == BlockScaleType::kFloatGrid;
      const kernels::FloatGrid& sg = format.scale_grid();
      if (on_grid && format.tensor_level()) {
        // The tensor's max |x| is its blocks' largest.
        const float amax_tensor = amax.empty() ? 0.0f : *std::max_element(amax.begin(), amax.end());
        bs.tensor_enc =
            kernels::TensorEncodeScale(amax_tensor, kernels::BitsFloat(sg.max_bits), elem_max);
      }
      bs.scales.resize(amax.size());
      bs.scale_codes.resize(on_grid ? amax.size() : 0);
      const size_t per_item = 4096;  // blocks a thread takes at a time
      const size_t items = (amax.size() + per_item - 1) / per_item;
#pragma omp parallel for num_threads(ThreadCount(opts, items)) schedule(static)
      for (size_t it = 0; it < items; ++it) {
        const size_t k0 = it * per_item, k1 = std::min(amax.size(), k0 + per_item);
        kernels::BlockScalesFromMax(
            amax.data() + k0, k1 - k0,
            on_grid ? kernels::ScaleRule::kFloatGrid : kernels::ScaleRule::kFloat32, sg,
            bs.tensor_enc, elem_max, bs.scales.data() + k0,
            on_grid ? bs.scale_codes.data() + k0 : nullptr);
      }
      break;
    }
  }
}

// The block scales of a call, in storage reused by the calling thread's next call.
BlockScales& BlockScalesScratch() {
  thread_local BlockScales scratch;
  return scratch;
}

// Runs fn(block, begin, end) over the parts of [s, e) in each block: runs of one row (the kPow2
// scales, whose kernels take one shift per call).
template <typename Fn>
void ForEachBlockPart(const Format& format, const BlockGridShape& g, size_t s, size_t e, Fn&& fn) {
  const size_t R = format.block_rows(), C = format.block_cols();
  size_t i = s;
  while (i < e) {
    const size_t r = i / g.cols, c = i % g.cols;
    const size_t bc = c / C;
    const size_t end = std::min(e, r * g.cols + std::min(g.cols, (bc + 1) * C));
    fn((r / R) * g.block_cols + bc, i, end);
    i = end;
  }
}

// Runs fn(begin, end, row, col0) over the parts of [s, e) in each row of `cols` elements: a part
// is row `row` from column col0.
template <typename Fn>
void ForEachRowSpan(size_t cols, size_t s, size_t e, Fn&& fn) {
  for (size_t i = s; i < e;) {
    const size_t r = i / cols;
    const size_t end = std::min(e, (r + 1) * cols);
    fn(i, end, r, i - r * cols);
    i = end;
  }
}

// Runs fn(begin, end, col0, scales) over the parts of [s, e) in each row of the matrix view
// (ForEachRowSpan), `scales` pointing at the scale of the part's first block (kFloat32 and
// kFloatGrid scales), from which the kernels' *Row functions walk the row's blocks.
template <typename Fn>
void ForEachRowPart(const Format& format, const BlockScales& bs, size_t s, size_t e, Fn&& fn) {
  const BlockGridShape& g = bs.shape;
  ForEachRowSpan(g.cols, s, e, [&](size_t b, size_t f, size_t r, size_t col0) {
    fn(b, f, col0,
       bs.scales.data() + (r / format.block_rows()) * g.block_cols + col0 / format.block_cols());
  });
}

void QuantizeBlockScaledChunk(const Format& format, const BlockScales& bs, const float* in,
                              float* out, uint32_t* codes, size_t s, size_t e,
                              const LoopParams& base, ElementStats* st) {
  if (format.scale_type() == BlockScaleType::kPow2) {
    ForEachBlockPart(format, bs.shape, s, e, [&](size_t bi, size_t b, size_t f) {
      LoopParams p = base;
      p.index_base = base.index_base + b;
      kernels::QuantizeFloatGrid(in + b, out != nullptr ? out + b : nullptr,
                                 codes != nullptr ? codes + (b - s) : nullptr, f - b, format.grid(),
                                 bs.shifts[bi], p, st);
    });
    return;
  }
  ForEachRowPart(format, bs, s, e, [&](size_t b, size_t f, size_t col0, const BlockScale* scales) {
    LoopParams p = base;
    p.index_base = base.index_base + b;
    kernels::QuantizeScaledFloatGridRow(in + b, out != nullptr ? out + b : nullptr,
                                        codes != nullptr ? codes + (b - s) : nullptr, f - b, col0,
                                        format.block_cols(), format.grid(), scales, p, st);
  });
}

// Hysteresis on the elements [s, e) under their block scales; returns the flips.
uint64_t HysteresisBlockScaledChunk(const Format& format, const BlockScales& bs, const float* w,
                                    float* q, size_t s, size_t e, ElementStats* st) {
  uint64_t flips = 0;
  if (format.scale_type() == BlockScaleType::kPow2) {
    ForEachBlockPart(format, bs.shape, s, e, [&](size_t bi, size_t b, size_t f) {
      flips += kernels::HysteresisFloatGrid(w + b, q + b, f - b, format.grid(), bs.shifts[bi], st);
    });
    return flips;
  }
  ForEachRowPart(format, bs, s, e, [&](size_t b, size_t f, size_t col0, const BlockScale* scales) {
    flips += kernels::HysteresisScaledFloatGridRow(w + b, q + b, f - b, col0, format.block_cols(),
                                                   format.grid(), scales, st);
  });
  return flips;
}

// Decodes the elements [s, e), whose codes start at codes[0], under their block scales.
void DecodeBlockScaledChunk(const Format& format, const BlockScales& bs, const uint32_t* codes,
                            float* out, size_t s, size_t e) {
  if (format.scale_type() == BlockScaleType::kPow2) {
    ForEachBlockPart(format, bs.shape, s, e, [&](size_t bi, size_t b, size_t f) {
      kernels::DecodeFloatGridSpan(codes + (b - s), out + b, f - b, format.grid(), bs.shifts[bi]);
    });
    return;
  }
  ForEachRowPart(format, bs, s, e, [&](size_t b, size_t f, size_t col0, const BlockScale* scales) {
    kernels::DecodeScaledFloatGridRow(codes + (b - s), out + b, f - b, col0, format.block_cols(),
                                      format.grid(), scales);
  });
}

// The metadata (kernels/grid.h: StoreFloatMeta, StoreCodeMeta): each block's scale (E8M0 byte,
// float32 decode scale, or the scale's code in little-endian bytes), then the tensor level's
// encode scale as float32.
void WriteBlockScales(const Format& format, const BlockScales& bs, uint8_t* dst) {
  const size_t stride = format.meta_bytes_per_group();
  for (size_t bi = 0; bi < bs.count(); ++bi) {
    uint8_t* d = dst + stride * bi;
    switch (format.scale_type()) {
      case BlockScaleType::kPow2:
        d[0] = kernels::ShiftMetaByte(bs.shifts[bi], /*e8m0=*/true);
        break;
      case BlockScaleType::kFloat32:
        kernels::StoreFloatMeta(bs.scales[bi].dec, d);
        break;
      case BlockScaleType::kFloatGrid:
        kernels::StoreCodeMeta(bs.scale_codes[bi], int32_t(stride), d);
        break;
    }
  }
  if (format.tensor_level()) kernels::StoreFloatMeta(bs.tensor_enc, dst + stride * bs.count());
}

BlockScales ReadBlockScales(const Format& format, size_t n, size_t channels, size_t columns,
                            const uint8_t* src) {
  BlockScales bs;
  bs.shape = BlockGridOf(format, n, channels, columns);
  const size_t stride = format.meta_bytes_per_group();
  if (format.tensor_level()) bs.tensor_enc = kernels::LoadFloatMeta(src + stride * bs.count());
  for (size_t bi = 0; bi < bs.count(); ++bi) {
    const uint8_t* d = src + stride * bi;
    switch (format.scale_type()) {
      case BlockScaleType::kPow2:
        bs.shifts.push_back(kernels::ShiftFromMetaByte(d[0], /*e8m0=*/true));
        break;
      case BlockScaleType::kFloat32:
        bs.scales.push_back(BlockScale{0.0f, kernels::LoadFloatMeta(d), 1.0f});
        break;
      case BlockScaleType::kFloatGrid: {
        const uint32_t code = kernels::LoadCodeMeta(d, int32_t(stride));
        const float sb = kernels::DecodeFloatGrid(code, format.scale_grid());
        bs.scales.push_back(kernels::GridBlockScale(sb, bs.tensor_enc));
        break;
      }
    }
  }
  return bs;
}

// Quantize's one-pass path for block-scaled formats whose blocks are runs of one row that every
// L1 piece holds whole (1 x C blocks, C dividing kernels::kL1Piece and the row length; float
// scales): how the pieces compute their scales, after one read-only pass for the tensor level's
// amax. Nothing (the two-pass path) otherwise. The same results as ComputeBlockScales: the same
// block maxima, the same tensor amax (their largest), the same scale functions.
std::optional<kernels::PieceScaleRule> RowFusedScales(const Format& format, const float* in,
                                                      size_t n, const QuantizeOptions& opts) {
  if (format.family() != FormatFamily::kBlockScaled || format.block_rows() != 1 ||
      format.whole_tensor_block() || format.scale_type() == BlockScaleType::kPow2 ||
      kernels::kL1Piece % format.block_cols() != 0) {
    return std::nullopt;
  }
  const BlockGridShape g = BlockGridOf(format, n, opts.channels, opts.columns);
  if (g.cols == 0 || g.cols % format.block_cols() != 0) return std::nullopt;
  const bool on_grid = format.scale_type() == BlockScaleType::kFloatGrid;
  kernels::PieceScaleRule rule{
      on_grid ? kernels::ScaleRule::kFloatGrid : kernels::ScaleRule::kFloat32, format.scale_grid(),
      1.0f, kernels::BitsFloat(format.grid().max_bits)};
  if (on_grid && format.tensor_level()) {
    const size_t chunks = (n + kChunk - 1) / kChunk;
    std::vector<float> chunk_max(chunks, 0.0f);
#pragma omp parallel for num_threads(ThreadCount(opts, chunks)) schedule(static)
    for (size_t ci = 0; ci < chunks; ++ci) {
      chunk_max[ci] = kernels::MaxAbsFinite(in + ci * kChunk, std::min(kChunk, n - ci * kChunk));
    }
    const float amax =
        chunk_max.empty() ? 0.0f : *std::max_element(chunk_max.begin(), chunk_max.end());
    rule.tensor_enc = kernels::TensorEncodeScale(
        amax, kernels::BitsFloat(format.scale_grid().max_bits), rule.elem_max);
  }
  return rule;
}

// The shared driver of Quantize and Encode: chunks in parallel, statistics merged in order.
Status Run(const Format& format, const float* in, float* out, uint8_t* packed, size_t n,
           const QuantizeOptions& opts, QuantStats* stats) {
  CPD_RETURN_IF_ERROR(ValidateSpan(format, n, opts));
  const bool block_scaled = format.family() == FormatFamily::kBlockScaled;
  // Blocks that never straddle a chunk are scaled inside the chunk loop, in one pass.
  const bool fused_blocks =
      !block_scaled && format.scope() == ScaleScope::kBlock && kChunk % format.block_size() == 0;
  Groups groups;
  BlockScales& block_scales = BlockScalesScratch();
  const std::optional<kernels::PieceScaleRule> row_fused =
      packed == nullptr ? RowFusedScales(format, in, n, opts) : std::nullopt;
  if (row_fused) {
    // Each piece's block scales are computed as the chunk loop reaches it.
  } else if (block_scaled) {
    ComputeBlockScales(format, in, n, opts, &block_scales);
  } else if (fused_blocks) {
    groups.group_len = format.block_size();
    groups.shifts.resize(format.num_groups(n, opts.channels));
  } else {
    groups = ComputeGroups(format, in, n, opts);
  }
  LoopParams base;
  base.mode = internal::RoundModeFor(opts.rounding);
  base.rng_key = kernels::MakeRandomKey(opts.seed, opts.step);
  base.index_base = opts.index_offset;

  const size_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<ElementStats> chunk_stats(stats != nullptr ? chunks : 0);
  const int bits = format.bits();
#pragma omp parallel num_threads(ThreadCount(opts, chunks))
  {
    std::vector<uint32_t> codes(packed != nullptr ? kChunk : 0);
    uint32_t* const c = packed != nullptr ? codes.data() : nullptr;
#pragma omp for schedule(static)
    for (size_t ci = 0; ci < chunks; ++ci) {
      const size_t s = ci * kChunk, e = std::min(n, s + kChunk);
      ElementStats* st = stats != nullptr ? &chunk_stats[ci] : nullptr;
      if (fused_blocks) {
        LoopParams p = base;
        p.index_base = base.index_base + s;
        kernels::QuantizeFloatGridBlocks(in + s, out != nullptr ? out + s : nullptr, c, e - s,
                                         format.block_size(), format.grid(), format.shift_rule(), p,
                                         st, groups.shifts.data() + s / format.block_size());
      } else if (row_fused) {
        // The row parts of QuantizeBlockScaledChunk, each computing its own scales.
        const size_t cols = BlockGridOf(format, n, opts.channels, opts.columns).cols;
        ForEachRowSpan(cols, s, e, [&](size_t b, size_t f, size_t, size_t) {
          LoopParams p = base;
          p.index_base = base.index_base + b;
          kernels::QuantizeScaledFloatGridRowFused(in + b, out + b, f - b, format.block_cols(),
                                                   format.grid(), *row_fused, p, st);
        });
      } else if (block_scaled) {
        QuantizeBlockScaledChunk(format, block_scales, in, out, c, s, e, base, st);
      } else {
        QuantizeChunk(format, groups, in, out, c, s, e, base, st);
      }
      if (packed != nullptr) PackCodes(codes.data(), e - s, bits, packed + s * bits / 8);
    }
  }
  if (packed != nullptr && block_scaled) {
    WriteBlockScales(format, block_scales, packed + PackedCodeBytes(format, n));
  } else if (packed != nullptr) {
    WriteMeta(format, groups, packed + PackedCodeBytes(format, n));
  }
  if (stats != nullptr) {
    ElementStats total;
    for (const auto& cs : chunk_stats) total.Merge(cs);
    FillStats(total, n, stats);
  }
  return Status::Ok();
}

}  // namespace

Result<Rounding> ParseRounding(std::string_view name) {
  if (name == "nearest") return Rounding::kNearest;
  if (name == "stochastic") return Rounding::kStochastic;
  if (name == "zero") return Rounding::kZero;
  return Status::InvalidArgument("bad rounding '" + std::string(name) +
                                 "' (accepted: nearest, stochastic, zero)");
}

const char* RoundingName(Rounding r) {
  switch (r) {
    case Rounding::kNearest:
      return "nearest";
    case Rounding::kStochastic:
      return "stochastic";
    case Rounding::kZero:
      return "zero";
  }
  return "?";
}

double QuantStats::relative_error() const {
  return sq_input > 0.0 ? std::sqrt(sq_error / sq_input) : 0.0;
}

Status Quantize(const Format& format, const float* in, float* out, size_t n,
                const QuantizeOptions& opts, QuantStats* stats) {
  if (n > 0 && (in == nullptr || out == nullptr)) {
    return Status::InvalidArgument("Quantize: null buffer");
  }
  return Run(format, in, out, nullptr, n, opts, stats);
}

Result<uint64_t> CountFlips(const float* prev, const float* q, size_t n) {
  if (n > 0 && (prev == nullptr || q == nullptr)) {
    return Status::InvalidArgument("CountFlips: null buffer");
  }
  return kernels::CountChangedBits(prev, q, n);
}

Status QuantizeHysteresis(const Format& format, const float* w, float* q, size_t n,
                          const QuantizeOptions& opts, QuantStats* stats, uint64_t* flips) {
  if (n > 0 && (w == nullptr || q == nullptr)) {
    return Status::InvalidArgument("QuantizeHysteresis: null buffer");
  }
  CPD_RETURN_IF_ERROR(ValidateSpan(format, n, opts));
  const bool block_scaled = format.family() == FormatFamily::kBlockScaled;
  const Groups groups = block_scaled ? Groups{} : ComputeGroups(format, w, n, opts);
  BlockScales& bs = BlockScalesScratch();
  if (block_scaled) ComputeBlockScales(format, w, n, opts, &bs);
  const size_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<ElementStats> chunk_stats(chunks);
  std::vector<uint64_t> chunk_flips(chunks, 0);
#pragma omp parallel for num_threads(ThreadCount(opts, chunks)) schedule(static)
  for (size_t c = 0; c < chunks; ++c) {
    const size_t s = c * kChunk, e = std::min(n, s + kChunk);
    ElementStats* st = stats != nullptr ? &chunk_stats[c] : nullptr;
    if (block_scaled) {
      chunk_flips[c] = HysteresisBlockScaledChunk(format, bs, w, q, s, e, st);
      continue;
    }
    ForEachGroupPart(groups, s, e, [&](size_t gi, size_t b, size_t f) {
      if (format.is_float_grid()) {
        const int shift = groups.shifts.empty() ? 0 : groups.shifts[gi];
        chunk_flips[c] +=
            kernels::HysteresisFloatGrid(w + b, q + b, f - b, format.grid(), shift, st);
      } else if (format.family() == FormatFamily::kBinades) {
        chunk_flips[c] += kernels::HysteresisBinadeGrid(w + b, q + b, f - b, format.binade_grid(),
                                                        groups.shifts[gi], st);
      } else {
        chunk_flips[c] += kernels::HysteresisLinearGrid(w + b, q + b, f - b, groups.linear[gi], st);
      }
    });
  }
  if (flips != nullptr) {
    *flips = 0;
    for (uint64_t f : chunk_flips) *flips += f;
  }
  if (stats != nullptr) {
    ElementStats total;
    for (const auto& cs : chunk_stats) total.Merge(cs);
    FillStats(total, n, stats);
  }
  return Status::Ok();
}

size_t PackedCodeBytes(const Format& format, size_t n) {
  return (n * size_t(format.bits()) + 7) / 8;
}

size_t PackedSize(const Format& format, size_t n, size_t channels, size_t columns) {
  return PackedCodeBytes(format, n) +
         format.num_groups(n, channels, columns) * format.meta_bytes_per_group() +
         format.meta_bytes_per_tensor();
}

Status Encode(const Format& format, const float* in, size_t n, const QuantizeOptions& opts,
              PackedTensor* out, QuantStats* stats) {
  if (out == nullptr || (n > 0 && in == nullptr)) {
    return Status::InvalidArgument("Encode: null buffer");
  }
  CPD_RETURN_IF_ERROR(ValidateSpan(format, n, opts));
  out->count = n;
  out->channels = opts.channels;
  out->columns = opts.columns;
  out->bytes.assign(PackedSize(format, n, opts.channels, opts.columns), 0);
  return Run(format, in, nullptr, out->bytes.data(), n, opts, stats);
}

Status Decode(const Format& format, const PackedTensor& packed, float* out, int threads) {
  const size_t n = packed.count;
  QuantizeOptions opts;
  opts.channels = packed.channels;
  opts.columns = packed.columns;
  opts.threads = threads;
  CPD_RETURN_IF_ERROR(ValidateSpan(format, n, opts));
  const size_t expected = PackedSize(format, n, packed.channels, packed.columns);
  if (packed.bytes.size() != expected) {
    return Status::Corruption("packed tensor of " + std::to_string(n) + " '" + format.spec() +
                              "' values must be " + std::to_string(expected) + " bytes, got " +
                              std::to_string(packed.bytes.size()));
  }
  if (n > 0 && out == nullptr) return Status::InvalidArgument("Decode: null buffer");
  const uint8_t* meta = packed.bytes.data() + PackedCodeBytes(format, n);
  const bool block_scaled = format.family() == FormatFamily::kBlockScaled;
  const Groups groups = block_scaled ? Groups{} : ReadMeta(format, n, packed.channels, meta);
  const BlockScales bs = block_scaled
                             ? ReadBlockScales(format, n, packed.channels, packed.columns, meta)
                             : BlockScales{};
  const size_t chunks = (n + kChunk - 1) / kChunk;
  const int bits = format.bits();
#pragma omp parallel num_threads(ThreadCount(opts, chunks))
  {
    std::vector<uint32_t> codes(kChunk);
#pragma omp for schedule(static)
    for (size_t c = 0; c < chunks; ++c) {
      const size_t s = c * kChunk, e = std::min(n, s + kChunk);
      UnpackCodes(packed.bytes.data() + s * bits / 8, e - s, bits, codes.data());
      if (block_scaled) {
        DecodeBlockScaledChunk(format, bs, codes.data(), out, s, e);
        continue;
      }
      ForEachGroupPart(groups, s, e, [&](size_t gi, size_t b, size_t f) {
        const uint32_t* cb = codes.data() + (b - s);
        if (format.is_float_grid()) {
          const int shift = groups.shifts.empty() ? 0 : groups.shifts[gi];
          kernels::DecodeFloatGridSpan(cb, out + b, f - b, format.grid(), shift);
        } else if (format.family() == FormatFamily::kBinades) {
          kernels::DecodeBinadeGridSpan(cb, out + b, f - b, format.binade_grid(),
                                        groups.shifts[gi]);
        } else {
          const LinearGrid& g = groups.linear[gi];
          for (size_t i = 0; i < f - b; ++i) {
            out[b + i] = kernels::LinearValue(int32_t(cb[i]) + g.qmin, g);
          }
        }
      });
    }
  }
  return Status::Ok();
}

void PackCodes(const uint32_t* codes, size_t n, int bits, uint8_t* dst) {
  if (bits == 8) {
    for (size_t i = 0; i < n; ++i) dst[i] = uint8_t(codes[i]);
    return;
  }
  if (bits == 4) {
    size_t i = 0;
    for (; i + 1 < n; i += 2) dst[i / 2] = uint8_t(codes[i] | (codes[i + 1] << 4));
    if (i < n) dst[i / 2] = uint8_t(codes[i]);
    return;
  }
  if (bits == 16) {
    for (size_t i = 0; i < n; ++i) {
      dst[2 * i] = uint8_t(codes[i]);
      dst[2 * i + 1] = uint8_t(codes[i] >> 8);
    }
    return;
  }
  // Generic: a 64-bit accumulator, flushed a byte at a time.
  uint64_t acc = 0;
  int filled = 0;
  size_t o = 0;
  const uint64_t mask = bits == 32 ? 0xffffffffull : (uint64_t(1) << bits) - 1;
  for (size_t i = 0; i < n; ++i) {
    acc |= (uint64_t(codes[i]) & mask) << filled;
    filled += bits;
    while (filled >= 8) {
      dst[o++] = uint8_t(acc);
      acc >>= 8;
      filled -= 8;
    }
  }
  if (filled > 0) dst[o] = uint8_t(acc);
}

void UnpackCodes(const uint8_t* src, size_t n, int bits, uint32_t* codes) {
  if (bits == 8) {
    for (size_t i = 0; i < n; ++i) codes[i] = src[i];
    return;
  }
  if (bits == 4) {
    for (size_t i = 0; i < n; ++i) codes[i] = (src[i / 2] >> ((i & 1) * 4)) & 0xfu;
    return;
  }
  if (bits == 16) {
    for (size_t i = 0; i < n; ++i)
      codes[i] = uint32_t(src[2 * i]) | (uint32_t(src[2 * i + 1]) << 8);
    return;
  }
  uint64_t acc = 0;
  int filled = 0;
  size_t o = 0;
  const uint64_t mask = bits == 32 ? 0xffffffffull : (uint64_t(1) << bits) - 1;
  for (size_t i = 0; i < n; ++i) {
    while (filled < bits) {
      acc |= uint64_t(src[o++]) << filled;
      filled += 8;
    }
    codes[i] = uint32_t(acc & mask);
    acc >>= bits;
    filled -= bits;
  }
}

}  // namespace cpd
