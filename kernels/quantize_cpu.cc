#include "kernels/quantize_cpu.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>

#include "kernels/clones.h"

// The loop templates are forced inline into each clone so they are compiled for its ISA.
#define CPD_INLINE inline __attribute__((always_inline))
#define CPD_LAMBDA_INLINE __attribute__((always_inline))

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

// The statistics of one span, reduced inside `omp simd` loops so that they stay vectorised.
// The order of the floating-point sums is fixed for a given instruction set, so results do not
// depend on the thread count (work items are fixed-size chunks merged in order).
struct SpanAcc {
  uint32_t max_bits = 0;
  uint64_t saturated = 0, flushed = 0, nonfinite = 0;
  double sq_error = 0.0, sq_input = 0.0;
  void MergeInto(ElementStats* s) const {
    ElementStats t;
    t.max_abs = BitsFloat(max_bits);
    t.saturated = saturated;
    t.flushed = flushed;
    t.nonfinite = nonfinite;
    t.sq_error = sq_error;
    t.sq_input = sq_input;
    s->Merge(t);
  }
};

// Runs fn(begin, end, k) over the parts of a run of n elements of one matrix row, from column
// col0 on, that lie in one block of C columns each; k counts blocks from col0's (an index into
// the run's block scales).
template <typename Fn>
CPD_INLINE void ForEachRowBlock(size_t n, size_t col0, size_t C, const Fn& fn) {
  const size_t block0 = col0 / C;
  for (size_t a = 0; a < n;) {
    const size_t block = (col0 + a) / C;
    const size_t b = std::min(n, (block + 1) * C - col0);
    fn(a, b, block - block0);
    a = b;
  }
}

// What a RoundFn returns for one element.
struct Rounded {
  float value;
  uint32_t code;
};

// A span rounder rounds n elements whose random-stream index starts at `first`, writing out and
// codes as kOut/kCodes ask. ElementSpan wraps a per-element round(x, random bits) -> Rounded;
// with kRandom the bits of each L1-sized piece are generated first, in one vectorised pass.
template <bool kRandom, typename RoundFn>
struct ElementSpan {
  const RoundFn& round;
  uint64_t key;

  template <bool kOut, bool kCodes>
  CPD_INLINE void Run(const float* in, float* out, uint32_t* codes, size_t n,
                      uint64_t first) const {
    if constexpr (!kRandom) {
      for (size_t i = 0; i < n; ++i) Store<kOut, kCodes>(round(in[i], 0u), out, codes, i);
    } else {
      uint32_t rnd[kL1Piece];
      for (size_t s = 0; s < n; s += kL1Piece) {
        const size_t len = std::min(kL1Piece, n - s);
        FillRandomBits(key, first + s, len, rnd);
        for (size_t i = 0; i < len; ++i) {
          Store<kOut, kCodes>(round(in[s + i], rnd[i]), out, codes, s + i);
        }
      }
    }
  }

  template <bool kOut, bool kCodes>
  static CPD_INLINE void Store(const Rounded& r, float* out, uint32_t* codes, size_t i) {
    if (kOut) out[i] = r.value;
    if (kCodes) codes[i] = r.code;
  }
};

template <bool kRandom, typename RoundFn>
ElementSpan<kRandom, RoundFn> MakeElementSpan(const RoundFn& round, uint64_t key) {
  return {round, key};
}

// Statistics of a quantised span from (input, output) pairs, in a separate pass over data
// still in L1: this loop is pure arithmetic, so `omp simd` vectorises its reductions (the
// rounding loop cannot carry them: GCC lowers its address-taken locals to per-lane arrays).
// range: the finite values of the grid in force (kernels::StatOf's saturation bounds).
CPD_INLINE void AccumulateStats(const float* in, const float* out, size_t n, const GridRange& range,
                                SpanAcc* acc) {
  const float lo = range.lo, hi = range.hi;
  uint32_t mx = acc->max_bits;
  uint32_t sat = 0, fl = 0, nf = 0;  // a piece has at most 2^32 - 1 elements
  double se = 0.0, si = 0.0;
#pragma omp simd reduction(max : mx) reduction(+ : sat, fl, nf, se, si)
  for (size_t i = 0; i < n; ++i) {
    const float x = in[i], z = out[i];
    mx = std::max(mx, StatAbsBits(x));
    sat += StatSaturated(x, lo, hi);
    fl += StatFlushed(x, z);
    nf += StatNonfinite(x);
    se += StatSqError(x, z);
    si += StatSqInput(x, z);
  }
  acc->max_bits = mx;
  acc->saturated += sat;
  acc->flushed += fl;
  acc->nonfinite += nf;
  acc->sq_error += se;
  acc->sq_input += si;
}

// Runs the span rounder for the outputs asked for; with statistics, works in L1-sized pieces
// (through a scratch buffer when the caller wants no floats).
template <typename Span>
CPD_INLINE void DispatchOutputs(const Span& span, const float* in, float* out, uint32_t* codes,
                                size_t n, uint64_t first, const GridRange& range,
                                ElementStats* stats) {
  if (stats == nullptr) {
    if (out != nullptr && codes != nullptr) {
      span.template Run<true, true>(in, out, codes, n, first);
    } else if (out != nullptr) {
      span.template Run<true, false>(in, out, codes, n, first);
    } else if (codes != nullptr) {
      span.template Run<false, true>(in, out, codes, n, first);
    }
    return;
  }
  // The statistics need each piece's input and output. Where `out` overlaps `in` (in place) or
  // is absent, a piece is rounded into scratch first and copied out (a 4 KiB copy per piece,
  // about a sixth of the time); otherwise straight into `out`, read back from L1.
  constexpr size_t kPiece = kL1Piece;
  float scratch[kPiece];
  const uintptr_t in_begin = reinterpret_cast<uintptr_t>(in),
                  out_begin = reinterpret_cast<uintptr_t>(out), bytes = n * sizeof(float);
  const bool direct =
      out != nullptr && (out_begin + bytes <= in_begin || in_begin + bytes <= out_begin);
  SpanAcc acc;
  for (size_t s = 0; s < n; s += kPiece) {
    const size_t len = std::min(kPiece, n - s);
    float* const dst = direct ? out + s : scratch;
    if (codes != nullptr) {
      span.template Run<true, true>(in + s, dst, codes + s, len, first + s);
    } else {
      span.template Run<true, false>(in + s, dst, nullptr, len, first + s);
    }
    AccumulateStats(in + s, dst, len, range, &acc);
    if (!direct && out != nullptr) std::memcpy(out + s, scratch, len * sizeof(float));
  }
  acc.MergeInto(stats);
}

// ---- Stochastic rounding, a vector register at a time -----------------------------------------
// kernels/stochastic_lanes.inc restates RoundToFloatGrid / RoundToLinearGrid<kStochastic> and
// RandomBits on GCC vector extensions. Vector-extension code must be compiled for its
// instruction set from the start (target_clones would lower it to scalar code first), so the
// file is included once per instruction set under `#pragma GCC target`, and the spans pick one
// by the CPU they run on.

// The entry points of one instruction set's lanes (out and codes may each be null).
struct StochasticLanes {
  void (*float_grid)(const float* in, float* out, uint32_t* codes, size_t n,
                     const StochasticGridConsts& c, float down, float up, uint64_t key,
                     uint64_t first);
  void (*linear_grid)(const float* in, float* out, uint32_t* codes, size_t n, const LinearGrid& g,
                      uint64_t key, uint64_t first);
};

}  // namespace

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CPD_HAVE_STOCHASTIC_LANES 1
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
namespace avx512 {
#define CPD_LANE_BYTES 64
#include "kernels/stochastic_lanes.inc"
#undef CPD_LANE_BYTES
}  // namespace avx512
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
namespace avx2 {
#define CPD_LANE_BYTES 32
#include "kernels/stochastic_lanes.inc"
#undef CPD_LANE_BYTES
}  // namespace avx2
#pragma GCC pop_options
#endif

namespace {

// The lanes of `set`, or null for the scalar loops.
const StochasticLanes* LanesOf(StochasticLaneSet set) {
#ifdef CPD_HAVE_STOCHASTIC_LANES
  static constexpr StochasticLanes kAvx512{&avx512::StochasticFloatGridLanes,
                                           &avx512::StochasticLinearGridLanes};
  static constexpr StochasticLanes kAvx2{&avx2::StochasticFloatGridLanes,
                                         &avx2::StochasticLinearGridLanes};
  if (set == StochasticLaneSet::kAvx512) return &kAvx512;
  if (set == StochasticLaneSet::kAvx2) return &kAvx2;
#endif
  (void)set;
  return nullptr;
}

bool CpuRuns(StochasticLaneSet set) {
#ifdef CPD_HAVE_STOCHASTIC_LANES
  __builtin_cpu_init();
  if (set == StochasticLaneSet::kAvx512) return __builtin_cpu_supports("x86-64-v4");
  if (set == StochasticLaneSet::kAvx2) return __builtin_cpu_supports("x86-64-v3");
#endif
  return set == StochasticLaneSet::kNone;
}

StochasticLaneSet BestLaneSet() {
  for (StochasticLaneSet set : {StochasticLaneSet::kAvx512, StochasticLaneSet::kAvx2}) {
    if (CpuRuns(set)) return set;
  }
  // Baseline x86-64 has no per-lane shifts and other architectures are not tuned: the scalar
  // loop is the better choice there.
  return StochasticLaneSet::kNone;
}

std::atomic<StochasticLaneSet>& LaneSetInUse() {
  static std::atomic<StochasticLaneSet> set{BestLaneSet()};
  return set;
}

const StochasticLanes* LanesInUse() {
  return LanesOf(LaneSetInUse().load(std::memory_order_relaxed));
}

// Span rounders (see ElementSpan) for stochastic rounding with the lanes.
struct FloatGridLanesSpan {
  const StochasticLanes* lanes;
  StochasticGridConsts consts;
  float down, up;
  uint64_t key;

  template <bool kOut, bool kCodes>
  CPD_INLINE void Run(const float* in, float* out, uint32_t* codes, size_t n,
                      uint64_t first) const {
    lanes->float_grid(in, kOut ? out : nullptr, kCodes ? codes : nullptr, n, consts, down, up, key,
                      first);
  }
};

struct LinearGridLanesSpan {
  const StochasticLanes* lanes;
  LinearGrid grid;
  uint64_t key;

  template <bool kOut, bool kCodes>
  CPD_INLINE void Run(const float* in, float* out, uint32_t* codes, size_t n,
                      uint64_t first) const {
    lanes->linear_grid(in, kOut ? out : nullptr, kCodes ? codes : nullptr, n, grid, key, first);
  }
};

template <RoundMode kMode>
CPD_INLINE void FloatGridDispatch(const float* in, float* out, uint32_t* codes, size_t n,
                                  const FloatGrid& grid, int shift, const LoopParams& p,
                                  ElementStats* stats) {
  const FloatGrid g = grid;
  const float down = Pow2(-shift), up = Pow2(shift);
  const GridRange range = ShiftedGridRange(g.max_bits, up);
  if constexpr (kMode == RoundMode::kStochastic) {
    if (const StochasticLanes* lanes = LanesInUse()) {
      const FloatGridLanesSpan span{lanes, StochasticGridConsts(g), down, up, p.rng_key};
      DispatchOutputs(span, in, out, codes, n, p.index_base, range, stats);
      return;
    }
  }
  auto round = [&g, down, up](float x, uint32_t rnd) CPD_LAMBDA_INLINE {
    Rounded r;
    r.value = BitsFloat(RoundToFloatGrid<kMode>(x * down, g, rnd, &r.code)) * up;
    return r;
  };
  DispatchOutputs(MakeElementSpan<kMode == RoundMode::kStochastic>(round, p.rng_key), in, out,
                  codes, n, p.index_base, range, stats);
}

template <RoundMode kMode>
CPD_INLINE void BinadeGridDispatch(const float* in, float* out, uint32_t* codes, size_t n,
                                   const BinadeGrid& grid, int shift, const LoopParams& p,
                                   ElementStats* stats) {
  const BinadeGrid g = grid;  // a local copy: the table cannot alias out or codes
  const float down = Pow2(-shift), up = Pow2(shift);
  auto round = [&g, down, up](float x, uint32_t rnd) CPD_LAMBDA_INLINE {
    Rounded r;
    r.value = BitsFloat(RoundToBinadeGrid<kMode>(x * down, g, rnd, &r.code)) * up;
    return r;
  };
  DispatchOutputs(MakeElementSpan<kMode == RoundMode::kStochastic>(round, p.rng_key), in, out,
                  codes, n, p.index_base, ShiftedGridRange(g.max_bits, up), stats);
}

// A run of one matrix row under per-block scales, a block of C columns at a time: the loops of
// a block have its scale as a constant, so they vectorise as the unscaled loops do, and a row of
// 16-element blocks costs one call, not one per block. Rounded in L1-sized pieces into scratch,
// whose statistics are taken block by block (each block's saturation bound is its own).
// With `piece_rule` (QuantizeScaledFloatGridRowFused) the scales are not read from `scales` but
// computed for each piece from its blocks, which it then holds whole.
template <RoundMode kMode, bool kCodes>
CPD_INLINE void ScaledRowDispatch(const float* in, float* out, uint32_t* codes, size_t n,
                                  size_t col0, size_t C, const FloatGrid& grid,
                                  const BlockScale* scales, const LoopParams& p,
                                  ElementStats* stats, const PieceScaleRule* piece_rule = nullptr) {
  const FloatGrid g = grid;
  constexpr bool kRandom = kMode == RoundMode::kStochastic;
  uint32_t rnd[kRandom ? kL1Piece : 1];
  float scratch[kL1Piece];
  SpanAcc acc;
  const size_t block0 = col0 / C;
  // Straight into `out` unless it overlaps `in` (the statistics read the input back) or is
  // absent; else through scratch.
  const uintptr_t in_begin = reinterpret_cast<uintptr_t>(in),
                  out_begin = reinterpret_cast<uintptr_t>(out), bytes = n * sizeof(float);
  const bool direct =
      out != nullptr && (out_begin + bytes <= in_begin || in_begin + bytes <= out_begin);
  for (size_t s = 0; s < n; s += kL1Piece) {
    const size_t len = std::min(kL1Piece, n - s);
    if constexpr (kRandom) FillRandomBits(p.rng_key, p.index_base + s, len, rnd);
    float* const dst = direct ? out + s : scratch;
    const float* const x = in + s;
    // The piece's first block, then one block after another: no division per block (for
    // NVFP4's 16 elements the division cost as much as the rounding).
    size_t block = (col0 + s) / C;
    size_t end = (block + 1) * C - col0 - s;  // where the current block ends, from s
    // Scale of block b: piece_scales[b - first_block].
    const BlockScale* piece_scales = scales;
    size_t first_block = block0;
    BlockScale computed[kL1Piece];
    if (piece_rule != nullptr) {
      float amax[kL1Piece];
      uint32_t scale_codes[kL1Piece];  // written, not used: Quantize keeps no codes
      const size_t blocks = len / C;
      std::fill(amax, amax + blocks, 0.0f);
      MaxAbsPerBlock(x, len, 0, C, amax);
      BlockScalesFromMax(amax, blocks, piece_rule->rule, piece_rule->scale_grid,
                         piece_rule->tensor_enc, piece_rule->elem_max, computed, scale_codes);
      piece_scales = computed;
      first_block = block;
    }
    for (size_t a = 0; a < len; ++block, end += C) {
      const size_t b = std::min(len, end);
      const BlockScale sc = piece_scales[block - first_block];
      auto round = [&](size_t i) CPD_LAMBDA_INLINE {
        uint32_t code;
        dst[i] = BitsFloat(RoundScaled<kMode>(x[i], g, sc, kRandom ? rnd[i] : 0u, &code));
        if constexpr (kCodes) codes[s + i] = code;
      };
      if (b - a == 16) {  // NVFP4's and the 16-wide blocks': one vector with a fixed count
        for (size_t i = a; i < a + 16; ++i) round(i);
      } else {
        for (size_t i = a; i < b; ++i) round(i);
      }
      if (stats != nullptr) {
        AccumulateStats(x + a, dst + a, b - a, ScaledGridRange(g.max_bits, sc), &acc);
      }
      a = b;
    }
    if (!direct && out != nullptr) std::memcpy(out + s, scratch, len * sizeof(float));
  }
  if (stats != nullptr) acc.MergeInto(stats);
}

template <RoundMode kMode>
CPD_INLINE void LinearGridDispatch(const float* in, float* out, uint32_t* codes, size_t n,
                                   const LinearGrid& grid, const LoopParams& p,
                                   ElementStats* stats) {
  const LinearGrid g = grid;
  const GridRange range = LinearGridRange(g);
  if constexpr (kMode == RoundMode::kStochastic) {
    if (const StochasticLanes* lanes = LanesInUse()) {
      const LinearGridLanesSpan span{lanes, g, p.rng_key};
      DispatchOutputs(span, in, out, codes, n, p.index_base, range, stats);
      return;
    }
  }
  auto round = [&g](float x, uint32_t rnd) CPD_LAMBDA_INLINE {
    int32_t q;
    Rounded r;
    r.value = RoundToLinearGrid<kMode>(x, g, rnd, &q);
    r.code = uint32_t(q - g.qmin);
    return r;
  };
  DispatchOutputs(MakeElementSpan<kMode == RoundMode::kStochastic>(round, p.rng_key), in, out,
                  codes, n, p.index_base, range, stats);
}

CPD_INLINE uint32_t MaxAbsBits(const float* x, size_t n) {
  // Non-negative floats order like their bits: an unsigned max reduction, which vectorises.
  uint32_t m = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t a = FloatBits(x[i]) & 0x7fffffffu;
    // Masking, not a select: GCC turns a select here into a conditional (scalar) reduction.
    m = std::max(m, a & (0u - uint32_t(a < 0x7f800000u)));
  }
  return m;
}

}  // namespace

StochasticLaneSet ActiveStochasticLanes() { return LaneSetInUse().load(); }

bool ForceStochasticLanesForTesting(StochasticLaneSet set) {
  if (!CpuRuns(set)) return false;
  LaneSetInUse().store(set);
  return true;
}

CPD_CLONES
void FillRandomBits(uint64_t key, uint64_t first, size_t n, uint32_t* out) {
  size_t i = 0;
  if ((first & 1u) != 0 && n > 0) out[i++] = RandomBits(key, first);
  // Pairs of elements from one hash each; little-endian stores put the low half first.
  const uint64_t pair0 = (first + i) / 2;
  const size_t pairs = (n - i) / 2;
  uint32_t* const o = out + i;
  for (size_t j = 0; j < pairs; ++j) {
    const uint64_t z = Mix64(key + (pair0 + j) * kGolden64);
    o[2 * j] = uint32_t(z);
    o[2 * j + 1] = uint32_t(z >> 32);
  }
  for (i += 2 * pairs; i < n; ++i) out[i] = RandomBits(key, first + i);
}

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
void QuantizeBinadeGrid(const float* in, float* out, uint32_t* codes, size_t n, const BinadeGrid& g,
                        int shift, const LoopParams& p, ElementStats* stats) {
  switch (p.mode) {
    case RoundMode::kNearestEven:
      BinadeGridDispatch<RoundMode::kNearestEven>(in, out, codes, n, g, shift, p, stats);
      break;
    case RoundMode::kStochastic:
      BinadeGridDispatch<RoundMode::kStochastic>(in, out, codes, n, g, shift, p, stats);
      break;
    case RoundMode::kTowardZero:
      BinadeGridDispatch<RoundMode::kTowardZero>(in, out, codes, n, g, shift, p, stats);
      break;
    case RoundMode::kDown:
      BinadeGridDispatch<RoundMode::kDown>(in, out, codes, n, g, shift, p, stats);
      break;
    case RoundMode::kUp:
      BinadeGridDispatch<RoundMode::kUp>(in, out, codes, n, g, shift, p, stats);
      break;
  }
}

CPD_CLONES
void QuantizeScaledFloatGridRow(const float* in, float* out, uint32_t* codes, size_t n, size_t col0,
                                size_t block_cols, const FloatGrid& g, const BlockScale* scales,
                                const LoopParams& p, ElementStats* stats) {
#define CPD_SCALED_ROW(mode)                                                                     \
  (codes != nullptr                                                                              \
       ? ScaledRowDispatch<mode, true>(in, out, codes, n, col0, block_cols, g, scales, p, stats) \
       : ScaledRowDispatch<mode, false>(in, out, codes, n, col0, block_cols, g, scales, p, stats))
  switch (p.mode) {
    case RoundMode::kNearestEven:
      CPD_SCALED_ROW(RoundMode::kNearestEven);
      break;
    case RoundMode::kStochastic:
      CPD_SCALED_ROW(RoundMode::kStochastic);
      break;
    case RoundMode::kTowardZero:
      CPD_SCALED_ROW(RoundMode::kTowardZero);
      break;
    case RoundMode::kDown:
      CPD_SCALED_ROW(RoundMode::kDown);
      break;
    case RoundMode::kUp:
      CPD_SCALED_ROW(RoundMode::kUp);
      break;
  }
#undef CPD_SCALED_ROW
}

CPD_CLONES
void QuantizeScaledFloatGridRowFused(const float* in, float* out, size_t n, size_t block_cols,
                                     const FloatGrid& g, const PieceScaleRule& scales,
                                     const LoopParams& p, ElementStats* stats) {
  switch (p.mode) {
    case RoundMode::kNearestEven:
      ScaledRowDispatch<RoundMode::kNearestEven, false>(in, out, nullptr, n, 0, block_cols, g,
                                                        nullptr, p, stats, &scales);
      break;
    case RoundMode::kStochastic:
      ScaledRowDispatch<RoundMode::kStochastic, false>(in, out, nullptr, n, 0, block_cols, g,
                                                       nullptr, p, stats, &scales);
      break;
    case RoundMode::kTowardZero:
      ScaledRowDispatch<RoundMode::kTowardZero, false>(in, out, nullptr, n, 0, block_cols, g,
                                                       nullptr, p, stats, &scales);
      break;
    case RoundMode::kDown:
      ScaledRowDispatch<RoundMode::kDown, false>(in, out, nullptr, n, 0, block_cols, g, nullptr, p,
                                                 stats, &scales);
      break;
    case RoundMode::kUp:
      ScaledRowDispatch<RoundMode::kUp, false>(in, out, nullptr, n, 0, block_cols, g, nullptr, p,
                                               stats, &scales);
      break;
  }
}

// The scales of many blocks from their amaxes, in one vectorised loop (a block of 16 elements
// cannot afford a scalar pass of its own: three divisions and a rounding per block).
CPD_CLONES
void BlockScalesFromMax(const float* amax, size_t n, ScaleRule rule, const FloatGrid& scale_grid,
                        float tensor_enc, float elem_max, BlockScale* scales,
                        uint32_t* scale_codes) {
  const FloatGrid sg = scale_grid;
  if (rule == ScaleRule::kFloat32) {
#pragma omp simd
    for (size_t k = 0; k < n; ++k) scales[k] = Float32BlockScale(amax[k], elem_max);
    return;
  }
#pragma omp simd
  for (size_t k = 0; k < n; ++k) {
    uint32_t code;
    const float sb = BitsFloat(BlockScaleBits(amax[k], tensor_enc, elem_max, sg, &code));
    scales[k] = GridBlockScale(sb, tensor_enc);
    scale_codes[k] = code;
  }
}

namespace {
// Whole blocks of a compile-time width from the start of x: fixed trip counts vectorise fully.
template <size_t kCols>
CPD_INLINE size_t MaxAbsFixedBlocks(const float* x, size_t n, float* amax) {
  const size_t blocks = n / kCols;
  for (size_t k = 0; k < blocks; ++k) {
    amax[k] = std::max(amax[k], BitsFloat(MaxAbsBits(x + k * kCols, kCols)));
  }
  return blocks * kCols;
}
}  // namespace

CPD_CLONES
void MaxAbsPerBlock(const float* x, size_t n, size_t col0, size_t block_cols, float* amax) {
  const size_t block0 = col0 / block_cols;
  size_t a = 0;
  if (col0 % block_cols == 0) {  // NVFP4's and MX's widths, from a block's start
    if (block_cols == 16) a = MaxAbsFixedBlocks<16>(x, n, amax);
    if (block_cols == 32) a = MaxAbsFixedBlocks<32>(x, n, amax);
  }
  while (a < n) {
    const size_t block = (col0 + a) / block_cols;
    const size_t b = std::min(n, (block + 1) * block_cols - col0);
    float& m = amax[block - block0];
    m = std::max(m, BitsFloat(MaxAbsBits(x + a, b - a)));
    a = b;
  }
}

namespace {

// Whole blocks of a compile-time size: the max and the rounding loops have fixed trip counts,
// so they vectorise without peeling. Returns how many elements it handled.
template <size_t kBlock, RoundMode kMode, bool kOut, bool kCodes>
CPD_INLINE size_t FixedBlocks(const float* in, float* out, uint32_t* codes, size_t n,
                              const FloatGrid& grid, const ShiftRule& rule, const LoopParams& p,
                              int32_t* shifts) {
  const FloatGrid g = grid;
  const size_t full = n / kBlock;
  for (size_t b = 0; b < full; ++b) {
    const size_t s = b * kBlock;
    const int32_t shift = ShiftForMax(BitsFloat(MaxAbsBits(in + s, kBlock)), rule);
    shifts[b] = shift;
    const float down = Pow2(-shift), up = Pow2(shift);
    uint32_t rnd[kBlock] = {};
    if (kMode == RoundMode::kStochastic) FillRandomBits(p.rng_key, p.index_base + s, kBlock, rnd);
    for (size_t j = 0; j < kBlock; ++j) {
      uint32_t code;
      const float z = BitsFloat(RoundToFloatGrid<kMode>(in[s + j] * down, g, rnd[j], &code));
      if (kOut) out[s + j] = z * up;
      if (kCodes) codes[s + j] = code;
    }
  }
  return full * kBlock;
}

template <size_t kBlock, RoundMode kMode>
CPD_INLINE size_t FixedBlocksDispatch(const float* in, float* out, uint32_t* codes, size_t n,
                                      const FloatGrid& g, const ShiftRule& rule,
                                      const LoopParams& p, int32_t* shifts) {
  if (out != nullptr && codes != nullptr) {
    return FixedBlocks<kBlock, kMode, true, true>(in, out, codes, n, g, rule, p, shifts);
  } else if (out != nullptr) {
    return FixedBlocks<kBlock, kMode, true, false>(in, out, codes, n, g, rule, p, shifts);
  }
  return FixedBlocks<kBlock, kMode, false, true>(in, out, codes, n, g, rule, p, shifts);
}

template <size_t kBlock>
CPD_INLINE size_t FixedBlocksMode(const float* in, float* out, uint32_t* codes, size_t n,
                                  const FloatGrid& g, const ShiftRule& rule, const LoopParams& p,
                                  int32_t* shifts) {
  switch (p.mode) {
    case RoundMode::kNearestEven:
      return FixedBlocksDispatch<kBlock, RoundMode::kNearestEven>(in, out, codes, n, g, rule, p,
                                                                  shifts);
    case RoundMode::kStochastic:
      return FixedBlocksDispatch<kBlock, RoundMode::kStochastic>(in, out, codes, n, g, rule, p,
                                                                 shifts);
    default:
      return 0;  // the generic path below handles the rarer modes
  }
}

}  // namespace

CPD_CLONES
void QuantizeFloatGridBlocks(const float* in, float* out, uint32_t* codes, size_t n, size_t block,
                             const FloatGrid& g, const ShiftRule& rule, const LoopParams& p,
                             ElementStats* stats, int32_t* shifts) {
  size_t done = 0;
  if (stats == nullptr && (out != nullptr || codes != nullptr)) {
    if (block == 32) done = FixedBlocksMode<32>(in, out, codes, n, g, rule, p, shifts);
    if (block == 16) done = FixedBlocksMode<16>(in, out, codes, n, g, rule, p, shifts);
  }
  for (size_t b = done / block, s = done; s < n; ++b, s += block) {
    const size_t len = std::min(block, n - s);
    const int32_t shift = ShiftForMax(BitsFloat(MaxAbsBits(in + s, len)), rule);
    shifts[b] = shift;
    LoopParams bp = p;
    bp.index_base = p.index_base + s;
    float* o = out != nullptr ? out + s : nullptr;
    uint32_t* c = codes != nullptr ? codes + s : nullptr;
    switch (p.mode) {
      case RoundMode::kNearestEven:
        FloatGridDispatch<RoundMode::kNearestEven>(in + s, o, c, len, g, shift, bp, stats);
        break;
      case RoundMode::kStochastic:
        FloatGridDispatch<RoundMode::kStochastic>(in + s, o, c, len, g, shift, bp, stats);
        break;
      case RoundMode::kTowardZero:
        FloatGridDispatch<RoundMode::kTowardZero>(in + s, o, c, len, g, shift, bp, stats);
        break;
      default:
        QuantizeFloatGrid(in + s, o, c, len, g, shift, bp, stats);
        break;
    }
  }
}

CPD_CLONES
void QuantizeLinearGrid(const float* in, float* out, uint32_t* codes, size_t n, const LinearGrid& g,
                        const LoopParams& p, ElementStats* stats) {
  switch (p.mode) {
    case RoundMode::kNearestEven:
      LinearGridDispatch<RoundMode::kNearestEven>(in, out, codes, n, g, p, stats);
      break;
    case RoundMode::kStochastic:
      LinearGridDispatch<RoundMode::kStochastic>(in, out, codes, n, g, p, stats);
      break;
    case RoundMode::kTowardZero:
      LinearGridDispatch<RoundMode::kTowardZero>(in, out, codes, n, g, p, stats);
      break;
    case RoundMode::kDown:
      LinearGridDispatch<RoundMode::kDown>(in, out, codes, n, g, p, stats);
      break;
    case RoundMode::kUp:
      LinearGridDispatch<RoundMode::kUp>(in, out, codes, n, g, p, stats);
      break;
  }
}

uint64_t CountChangedBits(const float* a, const float* b, size_t n) {
  uint64_t changed = 0;
  for (size_t i = 0; i < n; ++i) changed += FloatBits(a[i]) != FloatBits(b[i]);
  return changed;
}

namespace {

// Hysteresis is applied to weights once per step: a plain scalar loop is fast enough.
// round(x, up) rounds x onto the grid toward +inf (up) or -inf and returns the value.
template <typename RoundFn>
uint64_t HysteresisLoop(const float* w, float* q, size_t n, const RoundFn& round,
                        const GridRange& range, ElementStats* stats) {
  uint64_t flips = 0;
  SpanAcc acc;
  for (size_t i = 0; i < n; ++i) {
    const float x = w[i];
    const float prev = q[i];
    const float z = round(x, x < prev);
    flips += FloatBits(z) != FloatBits(prev);
    q[i] = z;
    const ElementStat e = StatOf(x, z, range);
    acc.max_bits = std::max(acc.max_bits, e.abs_bits);
    acc.saturated += e.saturated;
    acc.flushed += e.flushed;
    acc.nonfinite += e.nonfinite;
    acc.sq_error += e.sq_error;
    acc.sq_input += e.sq_input;
  }
  if (stats != nullptr) acc.MergeInto(stats);
  return flips;
}

}  // namespace

uint64_t HysteresisFloatGrid(const float* w, float* q, size_t n, const FloatGrid& g, int shift,
                             ElementStats* stats) {
  const float down = Pow2(-shift), up = Pow2(shift);
  auto round = [&](float x, bool up_dir) CPD_LAMBDA_INLINE {
    const float y = x * down;
    const uint32_t zb = up_dir ? RoundToFloatGrid<RoundMode::kUp>(y, g, 0, nullptr)
                               : RoundToFloatGrid<RoundMode::kDown>(y, g, 0, nullptr);
    return BitsFloat(zb) * up;
  };
  return HysteresisLoop(w, q, n, round, ShiftedGridRange(g.max_bits, up), stats);
}

uint64_t HysteresisBinadeGrid(const float* w, float* q, size_t n, const BinadeGrid& g, int shift,
                              ElementStats* stats) {
  const float down = Pow2(-shift), up = Pow2(shift);
  auto round = [&](float x, bool up_dir) CPD_LAMBDA_INLINE {
    const float y = x * down;
    const uint32_t zb = up_dir ? RoundToBinadeGrid<RoundMode::kUp>(y, g, 0, nullptr)
                               : RoundToBinadeGrid<RoundMode::kDown>(y, g, 0, nullptr);
    return BitsFloat(zb) * up;
  };
  return HysteresisLoop(w, q, n, round, ShiftedGridRange(g.max_bits, up), stats);
}

uint64_t HysteresisScaledFloatGridRow(const float* w, float* q, size_t n, size_t col0,
                                      size_t block_cols, const FloatGrid& g,
                                      const BlockScale* scales, ElementStats* stats) {
  uint64_t flips = 0;
  // A loop per block, each merging its statistics as a call per block did (the same sums).
  ForEachRowBlock(n, col0, block_cols, [&](size_t a, size_t b, size_t k) CPD_LAMBDA_INLINE {
    const BlockScale sc = scales[k];
    auto round = [&g, sc](float x, bool up_dir) CPD_LAMBDA_INLINE {
      return BitsFloat(up_dir ? RoundScaled<RoundMode::kUp>(x, g, sc, 0, nullptr)
                              : RoundScaled<RoundMode::kDown>(x, g, sc, 0, nullptr));
    };
    flips += HysteresisLoop(w + a, q + a, b - a, round, ScaledGridRange(g.max_bits, sc), stats);
  });
  return flips;
}

uint64_t HysteresisLinearGrid(const float* w, float* q, size_t n, const LinearGrid& g,
                              ElementStats* stats) {
  auto round = [&](float x, bool up_dir) CPD_LAMBDA_INLINE {
    return up_dir ? RoundToLinearGrid<RoundMode::kUp>(x, g, 0, nullptr)
                  : RoundToLinearGrid<RoundMode::kDown>(x, g, 0, nullptr);
  };
  return HysteresisLoop(w, q, n, round, LinearGridRange(g), stats);
}

CPD_CLONES
float MaxAbsFinite(const float* x, size_t n) { return BitsFloat(MaxAbsBits(x, n)); }

namespace {
// A key whose unsigned order is the float order (negative floats reversed below positives).
inline uint32_t OrderKey(uint32_t u) { return (u & 0x80000000u) ? ~u : u | 0x80000000u; }
inline uint32_t KeyBits(uint32_t k) { return (k & 0x80000000u) ? k & 0x7fffffffu : ~k; }
}  // namespace

CPD_CLONES
void MinMaxFinite(const float* x, size_t n, float* min_out, float* max_out) {
  uint32_t lo = 0xffffffffu, hi = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t u = FloatBits(x[i]);
    const uint32_t finite_mask = 0u - uint32_t((u & 0x7fffffffu) < 0x7f800000u);
    const uint32_t k = OrderKey(u);
    lo = std::min(lo, k | ~finite_mask);
    hi = std::max(hi, k & finite_mask);
  }
  // No finite element: report +Inf / -Inf (min > max), which callers treat as empty.
  *min_out = lo == 0xffffffffu ? INFINITY : BitsFloat(KeyBits(lo));
  *max_out = hi == 0u ? -INFINITY : BitsFloat(KeyBits(hi));
}

void DecodeFloatGridSpan(const uint32_t* codes, float* out, size_t n, const FloatGrid& g,
                         int shift) {
  const float up = Pow2(shift);
  for (size_t i = 0; i < n; ++i) out[i] = DecodeFloatGrid(codes[i], g) * up;
}

CPD_CLONES
void DecodeScaledFloatGridRow(const uint32_t* codes, float* out, size_t n, size_t col0,
                              size_t block_cols, const FloatGrid& grid, const BlockScale* scales) {
  const FloatGrid g = grid;
  ForEachRowBlock(n, col0, block_cols, [&](size_t a, size_t b, size_t k) CPD_LAMBDA_INLINE {
    const BlockScale sc = scales[k];
    for (size_t i = a; i < b; ++i) out[i] = ScaledValue(DecodeFloatGrid(codes[i], g), sc);
  });
}

CPD_CLONES
void DecodeBinadeGridSpan(const uint32_t* codes, float* out, size_t n, const BinadeGrid& grid,
                          int shift) {
  const BinadeGrid g = grid;
  const float up = Pow2(shift);
  for (size_t i = 0; i < n; ++i) out[i] = DecodeBinadeGrid(codes[i], g) * up;
}

}  // namespace cpd::kernels
