// CUDA kernels of the quantiser: launchers callable from plain C++ (no CUDA types here; streams
// are passed as void*, i.e. a cudaStream_t, nullptr for the legacy default stream). Each
// launcher checks its sizes, launches on the given stream and checks the launch; it never
// synchronises and never aborts: failures come back as a CudaResult naming the file, line and
// expression, which the cpd layer (cpd/quantize_cuda.cc) turns into a cpd::Status.
//
// The per-element math is kernels/grid.h, shared with the CPU loops (kernels/quantize_cpu.cc),
// and the kernels are built with -fmad=false, so every output equals the CPU path bit for bit.
// Pointers are device pointers (or host memory the device can access). `out` may equal `in`.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/grid.h"

namespace cpd::kernels::cuda {

// The outcome of one launcher: code is a cudaError_t (0 = cudaSuccess).
struct CudaResult {
  int code = 0;
  const char* file = nullptr;  // where the failing call is
  int line = 0;
  const char* expr = nullptr;     // the failing expression, as written
  const char* message = nullptr;  // cudaGetErrorString(code), or a launcher's own message
  bool ok() const { return code == 0; }
};

// Device-side statistics of one launch (see ElementStats in kernels/quantize_cpu.h for the
// meaning of each field). Partial sums are per block and are summed in block order, so the
// result is deterministic for a given device, but the double sums may differ from the CPU in
// the last bits (a different summation order). Also the layout of a statistics slot
// (cpd::CudaStatsSlots), which merges launches: counts and sums added, max_bits the largest.
struct DeviceStats {
  uint64_t saturated;
  uint64_t flushed;
  uint64_t nonfinite;
  uint64_t flips;  // hysteresis: elements whose quantised value changed
  double sq_error;
  double sq_input;
  uint32_t max_bits;  // float32 bits of the largest |x| over non-NaN inputs (Inf included)
  uint32_t pad;
  uint64_t count;  // elements (0 in per-block partials)
};

// Scratch a stats-producing launcher needs: one DeviceStats per block of the main kernel.
constexpr size_t kMaxStatsBlocks = 2048;
constexpr size_t kStatsScratchBytes = kMaxStatsBlocks * sizeof(DeviceStats);

// Optional statistics of an element-wise launch, to any of three destinations in device memory,
// written by the launch's last block to finish: `result` is overwritten with the launch's
// DeviceStats; `add_to` (a statistics slot) has them merged in, flips excluded; `add_flips` has
// the flips added. The merges are atomic, so no launch's contribution is lost, but launches that
// update one slot concurrently (from different streams) add their double sums in an unspecified
// order. When any destination is set, `scratch` must hold kStatsScratchBytes of device memory
// and `ticket` one unsigned int that is zero on entry (the launch leaves it zero).
struct StatsTarget {
  DeviceStats* result = nullptr;
  DeviceStats* add_to = nullptr;
  unsigned long long* add_flips = nullptr;
  DeviceStats* scratch = nullptr;
  unsigned int* ticket = nullptr;
  bool wanted() const { return result != nullptr || add_to != nullptr || add_flips != nullptr; }
};

// Where the scale of element i comes from. group_len == 0: one group (index 0) for the whole
// span; otherwise element i belongs to group i / group_len.
struct GroupLayout {
  uint64_t group_len = 0;
  uint64_t num_groups = 1;
};

// ---- Scales from the data (two-pass formats: per tensor, per channel, bfp blocks) ------------
//
// One launch reduces every group of the span and, in its last block to finish, turns each
// group's result into its scale (a second launch does that when the span has more than
// kLastBlockGroups groups), where a memset, a reduction and a scale kernel ran before. The
// reductions: the float32 bits of max |x| over finite elements (exactly kernels::MaxAbsFinite),
// or the finite minimum and maximum, where the minimum also records which zero the CPU picks
// (+0 or -0) when it is zero, so that MinMaxGrid sees the same `lo`: kernels::MinMaxFinite
// prefers -0, and `chunked` (cpd/quantize.cc reduced the single group in 65536-element chunks,
// num == 1 && n > 65536) the earliest chunk's zero. The scales: ShiftForMax, SymmetricIntGrid
// or MinMaxGrid (grid.h), the CPU's formulas. An empty span (n == 0) gets the scales of
// all-zero groups (the encoder still writes a per-tensor span's metadata).

constexpr size_t kLastBlockGroups = 2048;

enum class ScaleKind {
  kShift,     // shifts[g] = ShiftForMax(max |x|, shift_rule)
  kIntGrid,   // int<bits>: grids[g] = SymmetricIntGrid(max |x|, 2^(bits-1) - 1)
  kUintGrid,  // uint<bits>:minmax: grids[g] = MinMaxGrid(min, max, 2^bits - 1)
};

struct ScaleRule {
  ScaleKind kind = ScaleKind::kShift;
  ShiftRule shift{};     // kShift
  int bits = 0;          // kIntGrid: 2..31; kUintGrid: 1..30
  bool chunked = false;  // kUintGrid: see above
};

// Where the scales go: shifts (kShift) or grids (the others), one per group; and, when `meta`
// is non-null (the encoder), the packed tensor's scale metadata too: ShiftMetaByte(shift, e8m0)
// per group, or StoreLinearMeta(grid, minmax) at meta + g * (minmax ? 8 : 4).
struct ScaleOutput {
  int32_t* shifts = nullptr;
  LinearGrid* grids = nullptr;
  uint8_t* meta = nullptr;
  bool e8m0 = false;
  bool minmax = false;
};

// Scratch a caller keeps between calls (cpd/quantize_cuda.cc keeps it per stream): `reduce`
// holds ScaleReduceBytes(kind, num_groups) bytes and `ticket` one unsigned int, both REQUIRED
// to be all zero on entry; the launch leaves them all zero again (the derivation reads and
// clears each group), so no memset is needed between calls. Calls queued on one stream never
// overlap, so one scratch serves all of them.
struct ScaleScratch {
  void* reduce = nullptr;
  unsigned int* ticket = nullptr;
};

size_t ScaleReduceBytes(ScaleKind kind, size_t num_groups);

CudaResult LaunchScalesFromData(const float* in, size_t n, GroupLayout groups,
                                const ScaleRule& rule, ScaleScratch scratch, ScaleOutput out,
                                void* stream);

// ---- Element-wise quantisation ---------------------------------------------------------------

struct RandomParams {
  uint64_t key = 0;         // MakeRandomKey(seed, step); used by kStochastic
  uint64_t index_base = 0;  // the stream counter of in[0]
};

// out[i] = round(in[i] * 2^-s) * 2^s on grid g, s = shifts[group of i] (s = 0 when shifts is
// null). Modes: kNearestEven, kStochastic, kTowardZero.
CudaResult LaunchQuantizeFloatGrid(const float* in, float* out, size_t n, const FloatGrid& g,
                                   const int32_t* shifts, GroupLayout groups, RoundMode mode,
                                   RandomParams rng, StatsTarget stats, void* stream);

// out[i] = RoundToLinearGrid(in[i], grids[group of i]).
CudaResult LaunchQuantizeLinearGrid(const float* in, float* out, size_t n, const LinearGrid* grids,
                                    GroupLayout groups, RoundMode mode, RandomParams rng,
                                    StatsTarget stats, void* stream);

// Block formats with a power-of-two block size in [4, 128] (MX: 32) in one pass: each block's
// shift = ShiftForMax(max |finite x| of the block, rule) is found by a warp shuffle reduction
// and applied at once. The last block may be shorter.
bool FusedBlockSupported(size_t block_size);
CudaResult LaunchQuantizeFloatBlocksFused(const float* in, float* out, size_t n, const FloatGrid& g,
                                          ShiftRule rule, size_t block_size, RoundMode mode,
                                          RandomParams rng, StatsTarget stats, void* stream);

// Hysteresis (kernels::HysteresisFloatGrid / HysteresisLinearGrid): q receives the new
// quantised values, decided against the previous ones in `prev` (which may be q itself: in
// place); flips are counted in the statistics (against prev). `keep` (may be null) receives the
// new values too: it may be prev itself, so that a caller's state for the next step is updated
// in the same pass, but no other view of prev or q.
CudaResult LaunchHysteresisFloatGrid(const float* w, const float* prev, float* q, float* keep,
                                     size_t n, const FloatGrid& g, const int32_t* shifts,
                                     GroupLayout groups, StatsTarget stats, void* stream);
CudaResult LaunchHysteresisLinearGrid(const float* w, const float* prev, float* q, float* keep,
                                      size_t n, const LinearGrid* grids, GroupLayout groups,
                                      StatsTarget stats, void* stream);

// ---- Block-scaled formats (cpd::FormatFamily::kBlockScaled) ---------------------------------
//
// The span is a row-major matrix of `cols` columns cut into blocks of rows_per_block x
// cols_per_block elements, numbered row-major over the blocks; blocks at the right and bottom
// edges are partial (cpd::BlockGridOf). Each block has a kernels::BlockScale (grid.h; a
// power-of-two scale as Pow2BlockScale), and element i is RoundScaled under its block's, with
// the random bits RandomBits(key, index_base + i) of its flat index, as the CPU draws them.
struct MatrixBlocks {
  uint64_t cols = 0;            // of the matrix
  uint64_t rows_per_block = 1;  // R
  uint64_t cols_per_block = 1;  // C
  uint64_t blocks_per_row = 0;  // ceil(cols / C)
  uint64_t num_blocks = 0;      // ceil(rows / R) * blocks_per_row
  // Where every block is one contiguous run of the span (R = 1 and C divides cols, or a single
  // block column), its length, so that element i's block is i / run; else 0.
  uint64_t run = 0;
};

// How block scales are chosen from each block's max |finite x| (cpd/quantize.cc
// ComputeBlockScales), and how the packed tensor stores them (WriteBlockScales).
enum class BlockScaleKind {
  kPow2,       // Pow2BlockScale(ShiftForMax(amax, shift)); metadata ShiftMetaByte(shift, e8m0)
  kFloat32,    // Float32BlockScale(amax, elem_max); metadata its dec as float32
  kFloatGrid,  // GridBlockScale(BlockScaleBits(amax, T, elem_max, scale_grid)); metadata the code
};

struct BlockScaleRule {
  BlockScaleKind kind = BlockScaleKind::kPow2;
  ShiftRule shift{};          // kPow2
  float elem_max = 0.0f;      // the element grid's largest value
  FloatGrid scale_grid{};     // kFloatGrid
  bool tensor_level = false;  // kFloatGrid: T = TensorEncodeScale(max |x| of the tensor), else 1
  int meta_bytes = 0;         // of one block's metadata (cpd::Format::meta_bytes_per_group)
};

// Scratch of LaunchBlockScalesFromData, all zero on entry and on return (ScaleScratch's
// contract): the bits of each block's max |x| and of the tensor's.
size_t BlockScaleReduceBytes(size_t num_blocks);

// scales[b] for every block b, from the data: one launch reduces every block's max |finite x|
// (and the tensor's: the largest of them) and, in its last block to finish, derives the scales,
// or a second launch does when there are more than kLastBlockGroups blocks. `tensor_enc` (one
// float of device memory) receives T (kFloatGrid with a tensor level only). When `meta` is
// non-null (the encoder), the packed tensor's metadata too: rule.meta_bytes per block, then T
// as float32 with a tensor level; an empty span (n == 0) still writes T.
CudaResult LaunchBlockScalesFromData(const float* in, size_t n, const MatrixBlocks& blocks,
                                     const BlockScaleRule& rule, ScaleScratch scratch,
                                     BlockScale* scales, float* tensor_enc, uint8_t* meta,
                                     void* stream);

// out[i] = RoundScaled(in[i]) on grid g under scales[block of i]. Modes: kNearestEven,
// kStochastic, kTowardZero.
CudaResult LaunchQuantizeBlockScaled(const float* in, float* out, size_t n, const FloatGrid& g,
                                     const BlockScale* scales, const MatrixBlocks& blocks,
                                     RoundMode mode, RandomParams rng, StatsTarget stats,
                                     void* stream);

// Hysteresis (kernels::HysteresisScaledFloatGridRow) under the block scales; prev, q and keep
// as in LaunchHysteresisFloatGrid.
CudaResult LaunchHysteresisBlockScaled(const float* w, const float* prev, float* q, float* keep,
                                       size_t n, const FloatGrid& g, const BlockScale* scales,
                                       const MatrixBlocks& blocks, StatsTarget stats, void* stream);

// ---- Per-binade grids (binades:M0,M1,...) --------------------------------------------------

// The element kernels read a BinadeGrid's table from device memory: this copies g, passed as a
// kernel parameter (so no host buffer has to outlive the call), to d_grid in stream order.
CudaResult LaunchStoreBinadeGrid(const BinadeGrid& g, BinadeGrid* d_grid, void* stream);

// out[i] = RoundToBinadeGrid(in[i] * 2^-s) * 2^s, s = shifts[group of i] (shifts required).
// Modes: kNearestEven, kStochastic, kTowardZero.
CudaResult LaunchQuantizeBinadeGrid(const float* in, float* out, size_t n, const BinadeGrid* d_grid,
                                    const int32_t* shifts, GroupLayout groups, RoundMode mode,
                                    RandomParams rng, StatsTarget stats, void* stream);

// kernels::HysteresisBinadeGrid; prev, q and keep as in LaunchHysteresisFloatGrid.
CudaResult LaunchHysteresisBinadeGrid(const float* w, const float* prev, float* q, float* keep,
                                      size_t n, const BinadeGrid* d_grid, const int32_t* shifts,
                                      GroupLayout groups, StatsTarget stats, void* stream);

// kernels::CountChangedBits on the device: adds to *count (device memory) how many of a[i] and
// b[i] differ in their float32 bits. Integer atomics, so the count is exact and independent of
// the launch geometry. When `copy_to` is non-null, copy_to[i] = b[i] in the same pass (copy_to
// may be a, not an overlap of b): the caller keeps the newest values for the next comparison
// without a second pass.
CudaResult LaunchCountChangedBits(const float* a, const float* b, size_t n, float* copy_to,
                                  unsigned long long* count, void* stream);

}  // namespace cpd::kernels::cuda
