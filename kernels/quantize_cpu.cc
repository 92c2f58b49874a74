#include "kernels/quantize_cpu.h"

#include <algorithm>
#include <cmath>

// Each hot loop is compiled for baseline x86-64, AVX2 and AVX-512; the loader picks the best
// one for the machine (GCC function multi-versioning). Loops are written branch-free so that
// GCC vectorises them; -ffp-contract=off keeps CPU results identical to the CUDA kernels.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CPD_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define CPD_CLONES
#endif

namespace cpd::kernels {

void ElementStats::Merge(const ElementStats& o) {
  max_abs = std::max(max_abs, o.max_abs);
  saturated += o.saturated;
  flushed += o.flushed;
  nonfinite += o.nonfinite;
  sq_error += o.sq_error;
  sq_input += o.sq_input;
}

namespace {

constexpr int kLanes = 16;  // statistics accumulate lane-wise so the loops stay vectorised

// Lane-wise statistics accumulator, summed in a fixed order at the end.
struct LaneStats {
  uint32_t max_bits[kLanes] = {};
  uint32_t saturated[kLanes] = {};
  uint32_t flushed[kLanes] = {};
  uint32_t nonfinite[kLanes] = {};
  double sq_error[kLanes] = {};
  double sq_input[kLanes] = {};

  inline void Add(int lane, float in, float out, const ElementFlags& f) {
    const uint32_t a = FloatBits(in) & 0x7fffffffu;
    const uint32_t abits = a > 0x7f800000u ? 0u : a;
    max_bits[lane] = std::max(max_bits[lane], abits);
    saturated[lane] += f.saturated;
    flushed[lane] += f.flushed;
    nonfinite[lane] += f.nonfinite;
    const bool finite = a < 0x7f800000u && (FloatBits(out) & 0x7fffffffu) < 0x7f800000u;
    const double d = finite ? double(out) - double(in) : 0.0;
    const double x = finite ? double(in) : 0.0;
    sq_error[lane] += d * d;
    sq_input[lane] += x * x;
  }

  void Flush(ElementStats* s) const {
    ElementStats t;
    uint32_t mb = 0;
    for (int j = 0; j < kLanes; ++j) {
      mb = std::max(mb, max_bits[j]);
      t.saturated += saturated[j];
      t.flushed += flushed[j];
      t.nonfinite += nonfinite[j];
      t.sq_error += sq_error[j];
      t.sq_input += sq_input[j];
    }
    t.max_abs = BitsFloat(mb);
    s->Merge(t);
  }
};

// Counters are 32-bit per lane; spans longer than this are processed in pieces.
constexpr size_t kMaxStatsSpan = size_t(1) << 30;

template <RoundMode kMode, bool kOut, bool kCodes>
inline void FloatGridLoop(const float* __restrict in, float* out, uint32_t* __restrict codes,
                          size_t n, const FloatGrid& grid, int shift, const LoopParams& p) {
  const FloatGrid g = grid;
  const float down = Pow2(-shift), up = Pow2(shift);
  const uint64_t key = p.rng_key, base = p.index_base;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t rnd = kMode == RoundMode::kStochastic ? RandomBits(key, base + i) : 0u;
    uint32_t code;
    const float y = in[i] * down;
    const float z = BitsFloat(RoundToFloatGrid<kMode>(y, g, rnd, &code, nullptr));
    if (kOut) out[i] = z * up;
    if (kCodes) codes[i] = code;
  }
}

template <RoundMode kMode>
inline void FloatGridLoopStats(const float* in, float* out, uint32_t* codes, size_t n,
                               const FloatGrid& grid, int shift, const LoopParams& p,
                               ElementStats* stats) {
  const FloatGrid g = grid;
  const float down = Pow2(-shift), up = Pow2(shift);
  for (size_t start = 0; start < n; start += kMaxStatsSpan) {
    const size_t end = std::min(n, start + kMaxStatsSpan);
    LaneStats ls;
    for (size_t i0 = start; i0 < end; i0 += kLanes) {
      const int lanes = int(std::min<size_t>(kLanes, end - i0));
      for (int j = 0; j < lanes; ++j) {
        const size_t i = i0 + j;
        const uint32_t rnd =
            kMode == RoundMode::kStochastic ? RandomBits(p.rng_key, p.index_base + i) : 0u;
        uint32_t code;
        ElementFlags f;
        const float x = in[i];
        const float z = BitsFloat(RoundToFloatGrid<kMode>(x * down, g, rnd, &code, &f)) * up;
        ls.Add(j, x, z, f);
        if (out != nullptr) out[i] = z;
        if (codes != nullptr) codes[i] = code;
      }
    }
    ls.Flush(stats);
  }
}

template <RoundMode kMode>
void FloatGridDispatch(const float* in, float* out, uint32_t* codes, size_t n, const FloatGrid& g,
                       int shift, const LoopParams& p, ElementStats* stats) {
  if (stats != nullptr) {
    FloatGridLoopStats<kMode>(in, out, codes, n, g, shift, p, stats);
  } else if (out != nullptr && codes != nullptr) {
    FloatGridLoop<kMode, true, true>(in, out, codes, n, g, shift, p);
  } else if (out != nullptr) {
    FloatGridLoop<kMode, true, false>(in, out, codes, n, g, shift, p);
  } else if (codes != nullptr) {
    FloatGridLoop<kMode, false, true>(in, out, codes, n, g, shift, p);
  }
}

template <RoundMode kMode>
inline void LinearGridLoop(const float* in, float* out, uint32_t* codes, size_t n,
                           const LinearGrid& grid, const LoopParams& p, ElementStats* stats) {
  const LinearGrid g = grid;
  for (size_t start = 0; start < n; start += kMaxStatsSpan) {
    const size_t end = std::min(n, start + kMaxStatsSpan);
    LaneStats ls;
    for (size_t i0 = start; i0 < end; i0 += kLanes) {
      const int lanes = int(std::min<size_t>(kLanes, end - i0));
      for (int j = 0; j < lanes; ++j) {
        const size_t i = i0 + j;
        const uint32_t rnd =
            kMode == RoundMode::kStochastic ? RandomBits(p.rng_key, p.index_base + i) : 0u;
        int32_t q;
        ElementFlags f;
        const float x = in[i];
        const float z = RoundToLinearGrid<kMode>(x, g, rnd, &q, &f);
        if (stats != nullptr) ls.Add(j, x, z, f);
        if (out != nullptr) out[i] = z;
        if (codes != nullptr) codes[i] = uint32_t(q - g.qmin);
      }
    }
    if (stats != nullptr) ls.Flush(stats);
  }
}

}  // namespace

CPD_CLONES
void QuantizeFloatGrid(const float* in, float* out, uint32_t* codes, size_t n, const FloatGrid& g,
                       int shift, const LoopParams& p, ElementStats* stats) {
  switch (p.mode) {
    case RoundMode::kNearestEven:
      FloatGridDispatch<RoundMode::kNearestEven>(in, out, codes, n, g, shift, p, stats);
      break;
    case RoundMode::kStochastic:
      FloatGridDispatch<RoundMode::kStochastic>(in, out, codes, n, g, shift, p, stats);
      break;
    case RoundMode::kTowardZero:
      FloatGridDispatch<RoundMode::kTowardZero>(in, out, codes, n, g, shift, p, stats);
      break;
    case RoundMode::kDown:
      FloatGridDispatch<RoundMode::kDown>(in, out, codes, n, g, shift, p, stats);
      break;
    case RoundMode::kUp:
      FloatGridDispatch<RoundMode::kUp>(in, out, codes, n, g, shift, p, stats);
      break;
  }
}

CPD_CLONES
void QuantizeLinearGrid(const float* in, float* out, uint32_t* codes, size_t n,
                        const LinearGrid& g, const LoopParams& p, ElementStats* stats) {
  switch (p.mode) {
    case RoundMode::kNearestEven:
      LinearGridLoop<RoundMode::kNearestEven>(in, out, codes, n, g, p, stats);
      break;
    case RoundMode::kStochastic:
      LinearGridLoop<RoundMode::kStochastic>(in, out, codes, n, g, p, stats);
      break;
    case RoundMode::kTowardZero:
      LinearGridLoop<RoundMode::kTowardZero>(in, out, codes, n, g, p, stats);
      break;
    case RoundMode::kDown:
      LinearGridLoop<RoundMode::kDown>(in, out, codes, n, g, p, stats);
      break;
    case RoundMode::kUp:
      LinearGridLoop<RoundMode::kUp>(in, out, codes, n, g, p, stats);
      break;
  }
}

uint64_t HysteresisFloatGrid(const float* w, float* q, size_t n, const FloatGrid& g, int shift,
                             ElementStats* stats) {
  const float down = Pow2(-shift), up = Pow2(shift);
  uint64_t flips = 0;
  LaneStats ls;
  for (size_t i = 0; i < n; ++i) {
    const float x = w[i];
    const float prev = q[i];
    ElementFlags f;
    const float y = x * down;
    const uint32_t zb = x < prev ? RoundToFloatGrid<RoundMode::kUp>(y, g, 0, nullptr, &f)
                                 : RoundToFloatGrid<RoundMode::kDown>(y, g, 0, nullptr, &f);
    const float z = BitsFloat(zb) * up;
    flips += FloatBits(z) != FloatBits(prev);
    if (stats != nullptr) ls.Add(int(i % kLanes), x, z, f);
    q[i] = z;
  }
  if (stats != nullptr) ls.Flush(stats);
  return flips;
}

uint64_t HysteresisLinearGrid(const float* w, float* q, size_t n, const LinearGrid& g,
                              ElementStats* stats) {
  uint64_t flips = 0;
  LaneStats ls;
  for (size_t i = 0; i < n; ++i) {
    const float x = w[i];
    const float prev = q[i];
    ElementFlags f;
    const float z = x < prev ? RoundToLinearGrid<RoundMode::kUp>(x, g, 0, nullptr, &f)
                             : RoundToLinearGrid<RoundMode::kDown>(x, g, 0, nullptr, &f);
    flips += FloatBits(z) != FloatBits(prev);
    if (stats != nullptr) ls.Add(int(i % kLanes), x, z, f);
    q[i] = z;
  }
  if (stats != nullptr) ls.Flush(stats);
  return flips;
}

CPD_CLONES
float MaxAbsFinite(const float* x, size_t n) {
  uint32_t lanes[kLanes] = {};
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const uint32_t a = FloatBits(x[i + j]) & 0x7fffffffu;
      lanes[j] = std::max(lanes[j], a < 0x7f800000u ? a : 0u);
    }
  }
  for (; i < n; ++i) {
    const uint32_t a = FloatBits(x[i]) & 0x7fffffffu;
    lanes[0] = std::max(lanes[0], a < 0x7f800000u ? a : 0u);
  }
  uint32_t m = 0;
  for (int j = 0; j < kLanes; ++j) m = std::max(m, lanes[j]);
  return BitsFloat(m);
}

CPD_CLONES
void MinMaxFinite(const float* x, size_t n, float* min_out, float* max_out) {
  float lo[kLanes], hi[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    lo[j] = INFINITY;
    hi[j] = -INFINITY;
  }
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float v = x[i + j];
      const bool finite = (FloatBits(v) & 0x7fffffffu) < 0x7f800000u;
      lo[j] = finite && v < lo[j] ? v : lo[j];
      hi[j] = finite && v > hi[j] ? v : hi[j];
    }
  }
  for (; i < n; ++i) {
    const float v = x[i];
    if ((FloatBits(v) & 0x7fffffffu) < 0x7f800000u) {
      lo[0] = std::min(lo[0], v);
      hi[0] = std::max(hi[0], v);
    }
  }
  float a = INFINITY, b = -INFINITY;
  for (int j = 0; j < kLanes; ++j) {
    a = std::min(a, lo[j]);
    b = std::max(b, hi[j]);
  }
  *min_out = a;
  *max_out = b;
}

void DecodeFloatGridSpan(const uint32_t* codes, float* out, size_t n, const FloatGrid& g,
                         int shift) {
  const float up = Pow2(shift);
  for (size_t i = 0; i < n; ++i) out[i] = DecodeFloatGrid(codes[i], g) * up;
}

}  // namespace cpd::kernels
