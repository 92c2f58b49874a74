#include "cpd/quantize.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpd/quantize_internal.h"
#include "kernels/quantize_cpu.h"

namespace cpd {

namespace {

using internal::GroupLength;
using internal::ValidateSpan;
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

// The shared driver of Quantize and Encode: chunks in parallel, statistics merged in order.
Status Run(const Format& format, const float* in, float* out, uint8_t* packed, size_t n,
           const QuantizeOptions& opts, QuantStats* stats) {
  CPD_RETURN_IF_ERROR(ValidateSpan(format, n, opts));
  // Blocks that never straddle a chunk are scaled inside the chunk loop, in one pass.
  const bool fused_blocks =
      format.scope() == ScaleScope::kBlock && kChunk % format.block_size() == 0;
  Groups groups;
  if (fused_blocks) {
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
      } else {
        QuantizeChunk(format, groups, in, out, c, s, e, base, st);
      }
      if (packed != nullptr) PackCodes(codes.data(), e - s, bits, packed + s * bits / 8);
    }
  }
  if (packed != nullptr) WriteMeta(format, groups, packed + PackedCodeBytes(format, n));
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
  const Groups groups = ComputeGroups(format, w, n, opts);
  const size_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<ElementStats> chunk_stats(chunks);
  std::vector<uint64_t> chunk_flips(chunks, 0);
#pragma omp parallel for num_threads(ThreadCount(opts, chunks)) schedule(static)
  for (size_t c = 0; c < chunks; ++c) {
    const size_t s = c * kChunk, e = std::min(n, s + kChunk);
    ElementStats* st = stats != nullptr ? &chunk_stats[c] : nullptr;
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

size_t PackedSize(const Format& format, size_t n, size_t channels) {
  return PackedCodeBytes(format, n) +
         format.num_groups(n, channels) * format.meta_bytes_per_group();
}

Status Encode(const Format& format, const float* in, size_t n, const QuantizeOptions& opts,
              PackedTensor* out, QuantStats* stats) {
  if (out == nullptr || (n > 0 && in == nullptr)) {
    return Status::InvalidArgument("Encode: null buffer");
  }
  CPD_RETURN_IF_ERROR(ValidateSpan(format, n, opts));
  out->count = n;
  out->channels = opts.channels;
  out->bytes.assign(PackedSize(format, n, opts.channels), 0);
  return Run(format, in, nullptr, out->bytes.data(), n, opts, stats);
}

Status Decode(const Format& format, const PackedTensor& packed, float* out, int threads) {
  const size_t n = packed.count;
  QuantizeOptions opts;
  opts.channels = packed.channels;
  opts.threads = threads;
  CPD_RETURN_IF_ERROR(ValidateSpan(format, n, opts));
  const size_t expected = PackedSize(format, n, packed.channels);
  if (packed.bytes.size() != expected) {
    return Status::Corruption("packed tensor of " + std::to_string(n) + " '" + format.spec() +
                              "' values must be " + std::to_string(expected) + " bytes, got " +
                              std::to_string(packed.bytes.size()));
  }
  if (n > 0 && out == nullptr) return Status::InvalidArgument("Decode: null buffer");
  const Groups groups =
      ReadMeta(format, n, packed.channels, packed.bytes.data() + PackedCodeBytes(format, n));
  const size_t chunks = (n + kChunk - 1) / kChunk;
  const int bits = format.bits();
#pragma omp parallel num_threads(ThreadCount(opts, chunks))
  {
    std::vector<uint32_t> codes(kChunk);
#pragma omp for schedule(static)
    for (size_t c = 0; c < chunks; ++c) {
      const size_t s = c * kChunk, e = std::min(n, s + kChunk);
      UnpackCodes(packed.bytes.data() + s * bits / 8, e - s, bits, codes.data());
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
