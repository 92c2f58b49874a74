// Single-threaded CPU loops over contiguous float32 spans, built on kernels/grid.h. The caller
// (cpd/quantize.cc) splits work into chunks across threads and merges the statistics in chunk
// order, so every result, statistics included, is independent of the thread count.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/grid.h"

namespace cpd::kernels {

// Sums over one span; Merge() is associative but the caller merges in a fixed order.
struct ElementStats {
  float max_abs = 0.0f;    // over non-NaN inputs (Inf included)
  uint64_t saturated = 0;  // inputs beyond the grid's largest finite value, Inf included
  uint64_t flushed = 0;    // nonzero finite inputs that became zero
  uint64_t nonfinite = 0;  // NaN or Inf inputs
  double sq_error = 0.0;   // sum (out - in)^2 over finite inputs with finite outputs
  double sq_input = 0.0;   // sum in^2 over the same elements
  void Merge(const ElementStats& o);
};

struct LoopParams {
  RoundMode mode = RoundMode::kNearestEven;
  uint64_t rng_key = 0;     // MakeRandomKey(seed, step); used by kStochastic
  uint64_t index_base = 0;  // global index of in[0], the counter of the random stream
};

// Elements of the L1-sized pieces the element loops work in: a piece's random bits (stochastic
// rounding, kernels::FillRandomBits) or its rounded values are made in one pass and used in the
// next while they are still in L1 (4 KiB of uint32 / float32).
inline constexpr size_t kL1Piece = 1024;

// out[i] = round(in[i] * 2^-shift) * 2^shift on grid g; codes[i] = its code. `out` may equal
// `in`; `out`, `codes` and `stats` may each be null. -127 <= shift <= 127.
void QuantizeFloatGrid(const float* in, float* out, uint32_t* codes, size_t n, const FloatGrid& g,
                       int shift, const LoopParams& p, ElementStats* stats);

// Blocked shared-exponent formats (MX, bfp) in one pass: for each block of `block` elements
// (the last may be shorter), shifts[b] = ShiftForMax(max|block|, rule), then the block is
// quantised as QuantizeFloatGrid does with that shift.
void QuantizeFloatGridBlocks(const float* in, float* out, uint32_t* codes, size_t n, size_t block,
                             const FloatGrid& g, const ShiftRule& rule, const LoopParams& p,
                             ElementStats* stats, int32_t* shifts);

// Block scales that are not powers of two (kernels/grid.h, BlockScale), over a run of one matrix
// row that may cross blocks of `block_cols` columns: element i is column col0 + i, its scale is
// s = scales[(col0 + i) / block_cols - col0 / block_cols], out[i] = (round(in[i] * s.enc) *
// s.dec) * s.dec2 on grid g (RoundScaled) and codes[i] its code; otherwise the conventions of
// QuantizeFloatGrid.
void QuantizeScaledFloatGridRow(const float* in, float* out, uint32_t* codes, size_t n, size_t col0,
                                size_t block_cols, const FloatGrid& g, const BlockScale* scales,
                                const LoopParams& p, ElementStats* stats);
// Scales of n blocks from their max |x| (kernels/grid.h): float32 (Float32BlockScale), or on a
// float grid under the tensor level's encode scale (BlockScaleBits, GridBlockScale; the
// scales' codes in scale_codes).
enum class ScaleRule : uint8_t { kFloat32, kFloatGrid };
void BlockScalesFromMax(const float* amax, size_t n, ScaleRule rule, const FloatGrid& scale_grid,
                        float tensor_enc, float elem_max, BlockScale* scales,
                        uint32_t* scale_codes);
// amax[(col0 + i) / block_cols - col0 / block_cols] = max(itself, |x[i]|) over finite x[i].
void MaxAbsPerBlock(const float* x, size_t n, size_t col0, size_t block_cols, float* amax);
// QuantizeScaledFloatGridRow without codes for blocks of one row (1 x block_cols) that the run
// holds whole (col0 and n multiples of block_cols, block_cols dividing kL1Piece): each L1 piece's
// block scales are computed in the piece (MaxAbsPerBlock, then BlockScalesFromMax with `rule`,
// `scale_grid`, `tensor_enc` and `elem_max`) just before it is rounded, so the input is read
// from memory once. The same results, statistics included, as computing the scales first.
struct PieceScaleRule {
  ScaleRule rule;
  FloatGrid scale_grid;
  float tensor_enc;
  float elem_max;
};
void QuantizeScaledFloatGridRowFused(const float* in, float* out, size_t n, size_t block_cols,
                                     const FloatGrid& g, const PieceScaleRule& scales,
                                     const LoopParams& p, ElementStats* stats);
// HysteresisFloatGrid on a run of one matrix row under its blocks' scales (the conventions of
// QuantizeScaledFloatGridRow): element i rounds toward q[i] under its block's scale, and the
// statistics count saturation against that block's range.
uint64_t HysteresisScaledFloatGridRow(const float* w, float* q, size_t n, size_t col0,
                                      size_t block_cols, const FloatGrid& g,
                                      const BlockScale* scales, ElementStats* stats);
// out[i] = ScaledValue(DecodeFloatGrid(codes[i], g), s) under element i's block scale s (the
// conventions of QuantizeScaledFloatGridRow).
void DecodeScaledFloatGridRow(const uint32_t* codes, float* out, size_t n, size_t col0,
                              size_t block_cols, const FloatGrid& g, const BlockScale* scales);

// Same as QuantizeFloatGrid for a linear grid; codes[i] = q - qmin.
void QuantizeLinearGrid(const float* in, float* out, uint32_t* codes, size_t n, const LinearGrid& g,
                        const LoopParams& p, ElementStats* stats);

// Hysteresis (Lee et al., ICLR 2022): q[i] = ceil_grid(w[i]) if w[i] < q[i] else floor_grid(w[i]),
// with q holding the previous quantised weights on entry and the new ones on return.
// Returns the number of elements whose quantised value changed.
uint64_t HysteresisFloatGrid(const float* w, float* q, size_t n, const FloatGrid& g, int shift,
                             ElementStats* stats);
uint64_t HysteresisLinearGrid(const float* w, float* q, size_t n, const LinearGrid& g,
                              ElementStats* stats);

// How many of a[i] and b[i] differ in their float32 bits (weight flips: the quantised weights of
// one step against those of the step before, counted as the hysteresis loops count them).
uint64_t CountChangedBits(const float* a, const float* b, size_t n);

// Per-binade grids (binades:M0,M1,...): QuantizeFloatGrid, HysteresisFloatGrid and
// DecodeFloatGridSpan on a BinadeGrid, with the same shift convention.
void QuantizeBinadeGrid(const float* in, float* out, uint32_t* codes, size_t n, const BinadeGrid& g,
                        int shift, const LoopParams& p, ElementStats* stats);
uint64_t HysteresisBinadeGrid(const float* w, float* q, size_t n, const BinadeGrid& g, int shift,
                              ElementStats* stats);
void DecodeBinadeGridSpan(const uint32_t* codes, float* out, size_t n, const BinadeGrid& g,
                          int shift);

// out[i] = RandomBits(key, first + i) for i < n: the random stream of stochastic rounding and
// dropout, generated two elements per hash.
void FillRandomBits(uint64_t key, uint64_t first, size_t n, uint32_t* out);

// Which vector code rounds stochastically onto a float grid (kernels/stochastic_lanes.inc):
// AVX-512 or AVX2 lanes, or the scalar loop. Each gives the same bits.
enum class StochasticLaneSet : uint8_t { kNone, kAvx2, kAvx512 };
// The set in use: the best this CPU runs.
StochasticLaneSet ActiveStochasticLanes();
// Test hook: makes every thread use `set` from now on. False (and nothing changes) if this CPU
// cannot run it.
bool ForceStochasticLanesForTesting(StochasticLaneSet set);

// Reductions used to choose scales. NaN is ignored; Inf is ignored by the *Finite variants.
float MaxAbsFinite(const float* x, size_t n);
void MinMaxFinite(const float* x, size_t n, float* min_out, float* max_out);

// Decodes codes of grid g (any bit width) into floats.
void DecodeFloatGridSpan(const uint32_t* codes, float* out, size_t n, const FloatGrid& g,
                         int shift);

}  // namespace cpd::kernels
