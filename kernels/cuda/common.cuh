// Pieces shared by the CUDA kernels of the quantiser (quantize.cu) and of the codec (codec.cu):
// the check macros, the launch geometry, per-thread statistics and the element operations.
// Private to kernels/cuda/: include it only from .cu files there (it defines macros).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "kernels/cuda/quantize.h"
#include "kernels/grid.h"

namespace cpd::kernels::cuda {

#define CEIL_DIV(a, b) (((a) + (b)-1) / (b))

// Wraps a CUDA runtime call: on failure, returns a CudaResult naming the call and the error.
#define CPD_CUDA_CHECK(expr)                                           \
  do {                                                                 \
    const cudaError_t cpd_cuda_err_ = (expr);                          \
    if (cpd_cuda_err_ != cudaSuccess) {                                \
      return CudaResult{int(cpd_cuda_err_), __FILE__, __LINE__, #expr, \
                        cudaGetErrorString(cpd_cuda_err_)};            \
    }                                                                  \
  } while (0)

// A launcher's own argument check.
#define CPD_LAUNCH_REQUIRE(cond, msg)                                                \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      return CudaResult{int(cudaErrorInvalidValue), __FILE__, __LINE__, #cond, msg}; \
    }                                                                                \
  } while (0)

constexpr int kThreads = 256;  // threads per block of every kernel
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kUnroll = 4;  // independent 16-byte loads in flight per thread
constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------------------------------------
// Device helpers

// Group of element i; 32-bit division when both fit (the common case, much cheaper).
__device__ __forceinline__ uint64_t GroupOf(uint64_t i, uint64_t len) {
  if (((i | len) >> 32) == 0) return uint32_t(i) / uint32_t(len);
  return i / len;
}

// z * 2^s for the float bits zb of a grid value; NaN bits are kept as they are, which is what
// the CPU's multiply does with a quiet NaN operand (the GPU would return the canonical NaN).
__device__ __forceinline__ float ScaleBack(uint32_t zb, float up) {
  return (zb & 0x7fffffffu) > 0x7f800000u ? BitsFloat(zb) : __fmul_rn(BitsFloat(zb), up);
}

// |x| bits for the max-abs reductions: finite elements only (kernels::MaxAbsFinite).
__device__ __forceinline__ uint32_t FiniteAbsBits(float x) {
  const uint32_t a = FloatBits(x) & 0x7fffffffu;
  return a < 0x7f800000u ? a : 0u;
}

// The largest FiniteAbsBits of four elements. fmaxf of the magnitudes (the absolute value is an
// operand modifier, so one instruction per element instead of three) orders non-negative floats
// as their bits do and drops a NaN operand; only an Inf, or four NaNs, makes the result
// non-finite, and then the exact per-element form decides.
__device__ __forceinline__ uint32_t MaxFiniteAbsBits(const float4& v) {
  const float m = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
  if (FloatBits(m) < 0x7f800000u) return FloatBits(m);
  const uint32_t a = FiniteAbsBits(v.x), b = FiniteAbsBits(v.y);
  const uint32_t c = FiniteAbsBits(v.z), d = FiniteAbsBits(v.w);
  const uint32_t ab = a > b ? a : b, cd = c > d ? c : d;
  return ab > cd ? ab : cd;
}

// The per-element statistics (kernels::StatOf, the CPU loops' definition), per thread.
template <bool kStats>
struct Acc {
  __device__ __forceinline__ void Add(float, float, const GridRange&) {}
  __device__ __forceinline__ void Flip(bool) {}
};

template <>
struct Acc<true> {
  unsigned long long saturated = 0, flushed = 0, nonfinite = 0, flips = 0;
  double sq_error = 0.0, sq_input = 0.0;
  uint32_t max_bits = 0;

  __device__ __forceinline__ void Add(float in, float out, const GridRange& range) {
    const ElementStat e = StatOf(in, out, range);
    max_bits = e.abs_bits > max_bits ? e.abs_bits : max_bits;
    saturated += e.saturated;
    flushed += e.flushed;
    nonfinite += e.nonfinite;
    sq_error += e.sq_error;
    sq_input += e.sq_input;
  }
  __device__ __forceinline__ void Flip(bool changed) { flips += changed; }
};

__device__ __forceinline__ void WarpSum(DeviceStats& s) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    s.saturated += __shfl_down_sync(kFullMask, (unsigned long long)s.saturated, off);
    s.flushed += __shfl_down_sync(kFullMask, (unsigned long long)s.flushed, off);
    s.nonfinite += __shfl_down_sync(kFullMask, (unsigned long long)s.nonfinite, off);
    s.flips += __shfl_down_sync(kFullMask, (unsigned long long)s.flips, off);
    s.sq_error += __shfl_down_sync(kFullMask, s.sq_error, off);
    s.sq_input += __shfl_down_sync(kFullMask, s.sq_input, off);
    const uint32_t m = __shfl_down_sync(kFullMask, s.max_bits, off);
    s.max_bits = m > s.max_bits ? m : s.max_bits;
  }
}

__device__ __forceinline__ void Accumulate(DeviceStats& s, const DeviceStats& o) {
  s.saturated += o.saturated;
  s.flushed += o.flushed;
  s.nonfinite += o.nonfinite;
  s.flips += o.flips;
  s.sq_error += o.sq_error;
  s.sq_input += o.sq_input;
  s.max_bits = o.max_bits > s.max_bits ? o.max_bits : s.max_bits;
}

// Reduces every thread's Acc in a fixed order and writes the block's sum to partials[block].
// Must be reached by all threads of the block.
__device__ __forceinline__ void BlockStatsToPartial(const Acc<true>& acc, DeviceStats* partials) {
  __shared__ DeviceStats warp_sums[kWarpsPerBlock];
  DeviceStats s{acc.saturated, acc.flushed,  acc.nonfinite, acc.flips,
                acc.sq_error,  acc.sq_input, acc.max_bits,  0u};
  WarpSum(s);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    DeviceStats t = warp_sums[0];
    for (int w = 1; w < kWarpsPerBlock; ++w) Accumulate(t, warp_sums[w]);
    partials[blockIdx.x] = t;
  }
}

// The destinations of a StatsTarget (quantize.h), as kernel parameters.
struct StatsSinks {
  DeviceStats* result;
  DeviceStats* add_to;
  unsigned long long* add_flips;
};

inline StatsSinks SinksOf(const StatsTarget& t) {
  return StatsSinks{t.result, t.add_to, t.add_flips};
}

// A partial written by another block of the same launch: read from L2 (ld.cg), as the L1 of this
// SM is not coherent with the other SMs' stores.
__device__ __forceinline__ DeviceStats LoadPartial(const DeviceStats* p) {
  DeviceStats s;
  s.saturated = __ldcg(reinterpret_cast<const unsigned long long*>(&p->saturated));
  s.flushed = __ldcg(reinterpret_cast<const unsigned long long*>(&p->flushed));
  s.nonfinite = __ldcg(reinterpret_cast<const unsigned long long*>(&p->nonfinite));
  s.flips = __ldcg(reinterpret_cast<const unsigned long long*>(&p->flips));
  s.sq_error = __ldcg(&p->sq_error);
  s.sq_input = __ldcg(&p->sq_input);
  s.max_bits = __ldcg(&p->max_bits);
  s.pad = 0;
  s.count = 0;
  return s;
}

// Merges one launch's statistics into a slot: counts and sums added, the largest max_bits (|x|
// bits order as the floats do), flips left out (they have their own destination).
__device__ __forceinline__ void MergeIntoSlot(DeviceStats* slot, const DeviceStats& s) {
  atomicAdd(reinterpret_cast<unsigned long long*>(&slot->saturated), s.saturated);
  atomicAdd(reinterpret_cast<unsigned long long*>(&slot->flushed), s.flushed);
  atomicAdd(reinterpret_cast<unsigned long long*>(&slot->nonfinite), s.nonfinite);
  atomicAdd(reinterpret_cast<unsigned long long*>(&slot->count), s.count);
  atomicAdd(&slot->sq_error, s.sq_error);
  atomicAdd(&slot->sq_input, s.sq_input);
  atomicMax(&slot->max_bits, s.max_bits);
}

// Sums `blocks` per-block partials in block order (lane l takes blocks l, l + 32, ...; then a
// fixed shuffle tree, so the double sums do not depend on timing) and delivers the launch's
// statistics of `count` elements to the sinks. Must be reached by all 32 lanes of one warp.
__device__ __forceinline__ void DeliverStats(const DeviceStats* partials, int blocks,
                                             uint64_t count, const StatsSinks& sinks) {
  DeviceStats s{0, 0, 0, 0, 0.0, 0.0, 0u, 0u, 0};
  for (int b = int(threadIdx.x % 32); b < blocks; b += 32) Accumulate(s, LoadPartial(partials + b));
  WarpSum(s);
  if (threadIdx.x % 32 != 0) return;
  s.count = count;
  if (sinks.result != nullptr) *sinks.result = s;
  if (sinks.add_to != nullptr) MergeIntoSlot(sinks.add_to, s);
  if (sinks.add_flips != nullptr && s.flips != 0) atomicAdd(sinks.add_flips, s.flips);
}

// The last block of a launch (threadFenceReduction in the CUDA samples; the fences as in
// cooperative groups' grid sync): every thread fences its global stores and atomics, the
// block's thread 0 fences again after the barrier (cumulatively covering the whole block's
// writes) and takes a ticket; the block that takes the last ticket fences before its threads
// read the other blocks' results (from L2: atomics or ld.cg), and resets the ticket for the next
// launch on the stream. Must be reached by all threads of every block; all threads of a block
// get the same answer. Why: a site's quantisation was three launches (reduction, scale kernel,
// element pass) plus a finalize kernel for statistics; the small tail work now runs at the end
// of the big launch.
__device__ __forceinline__ bool LastBlockDone(unsigned int* ticket) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    if (last) {
      atomicExch(ticket, 0u);
      __threadfence();
    }
  }
  __syncthreads();
  return last;
}

// The statistics part of an element-wise kernel's parameters (StatsTarget, device side).
struct StatsArgs {
  DeviceStats* partials;
  unsigned int* ticket;
  StatsSinks sinks;
};

inline StatsArgs ArgsOf(const StatsTarget& t) { return StatsArgs{t.scratch, t.ticket, SinksOf(t)}; }

// The end of a statistics-keeping kernel over `count` elements: the block's partial, then, in
// the last block, the delivery of the launch's statistics (DeliverStats sums the partials in
// block order, as the separate finalize kernel did). All threads of every block.
__device__ __forceinline__ void FinishStats(const Acc<true>& acc, const StatsArgs& args,
                                            uint64_t count) {
  BlockStatsToPartial(acc, args.partials);
  if (!LastBlockDone(args.ticket)) return;
  if (threadIdx.x < 32) DeliverStats(args.partials, int(gridDim.x), count, args.sinks);
}

// ---------------------------------------------------------------------------------------------
// Element operations: what one element becomes. Init() runs once per thread (caches the scale
// of a single-group span in registers); Apply() maps x (and, for hysteresis, the previous
// quantised value) of global element i to its output and, when `code` is non-null (the
// encoder), writes its code as the CPU loops do (kernels/quantize_cpu.cc); when `range` is
// non-null (statistics), the finite range of the element's grid after its scaling, the bounds
// kernels::StatOf counts saturation against. Shared by quantize.cu and codec.cu, so that
// QuantizeCuda and EncodeCuda round with the same code.
//
// Ops whose kRandom is true (stochastic rounding) take the element's random bits as `rnd`,
// RandomBits(key, index_base + i): the kernels draw them for a run of elements at once
// (RandomBitsRun, one hash per pair of the stream), which halves the hashing. Other ops ignore
// rnd. The float grids round stochastically with RoundToFloatGridStochastic on constants the
// launcher derives once (StochasticGridConsts, held in the kernel's parameters).

template <RoundMode kMode>
__device__ __forceinline__ uint32_t RoundFloat(float y, const StochasticGridConsts& c, uint32_t rnd,
                                               uint32_t* code) {
  if constexpr (kMode == RoundMode::kStochastic) {
    return RoundToFloatGridStochastic(y, c, rnd, code);
  } else {
    return RoundToFloatGrid<kMode>(y, c.grid, rnd, code);
  }
}

// A fixed float grid (shift 0): x * 2^0 and z * 2^0 are identities, so they are left out.
template <RoundMode kMode>
struct FixedFloatGridOp {
  static constexpr bool kReadsOut = false;
  static constexpr bool kRandom = kMode == RoundMode::kStochastic;
  StochasticGridConsts c;
  uint64_t key, index_base;

  __device__ __forceinline__ void Init() {}
  __device__ __forceinline__ float Apply(float x, float, uint64_t, uint32_t rnd, uint32_t* code,
                                         GridRange* range) const {
    if (range != nullptr) *range = ShiftedGridRange(c.max_bits, 1.0f);
    return BitsFloat(RoundFloat<kMode>(x, c, rnd, code));
  }
};

// A float grid under a power-of-two shift per group.
template <RoundMode kMode>
struct FloatGridOp {
  static constexpr bool kReadsOut = false;
  static constexpr bool kRandom = kMode == RoundMode::kStochastic;
  StochasticGridConsts c;
  const int32_t* shifts;
  uint64_t group_len;  // 0: one group
  uint64_t key, index_base;
  float down0, up0;  // the scale factors of a single group

  __device__ __forceinline__ void Init() {
    down0 = Pow2(-shifts[0]);
    up0 = Pow2(shifts[0]);
  }
  __device__ __forceinline__ float Apply(float x, float, uint64_t i, uint32_t rnd, uint32_t* code,
                                         GridRange* range) const {
    float down = down0, up = up0;
    if (group_len != 0) {
      const int32_t s = shifts[GroupOf(i, group_len)];
      down = Pow2(-s);
      up = Pow2(s);
    }
    if (range != nullptr) *range = ShiftedGridRange(c.max_bits, up);
    const uint32_t zb = RoundFloat<kMode>(__fmul_rn(x, down), c, rnd, code);
    return ScaleBack(zb, up);
  }
};

// A per-binade grid (table in device memory) under a power-of-two shift per group.
template <RoundMode kMode>
struct BinadeGridOp {
  static constexpr bool kReadsOut = false;
  static constexpr bool kRandom = kMode == RoundMode::kStochastic;
  const BinadeGrid* g;
  const int32_t* shifts;
  uint64_t group_len;  // 0: one group
  uint64_t key, index_base;
  float down0, up0;

  __device__ __forceinline__ void Init() {
    down0 = Pow2(-shifts[0]);
    up0 = Pow2(shifts[0]);
  }
  __device__ __forceinline__ float Apply(float x, float, uint64_t i, uint32_t rnd, uint32_t* code,
                                         GridRange* range) const {
    float down = down0, up = up0;
    if (group_len != 0) {
      const int32_t s = shifts[GroupOf(i, group_len)];
      down = Pow2(-s);
      up = Pow2(s);
    }
    if (range != nullptr) *range = ShiftedGridRange(g->max_bits, up);
    const uint32_t zb = RoundToBinadeGrid<kMode>(__fmul_rn(x, down), *g, rnd, code);
    return ScaleBack(zb, up);
  }
};

template <RoundMode kMode>
struct LinearGridOp {
  static constexpr bool kReadsOut = false;
  static constexpr bool kRandom = kMode == RoundMode::kStochastic;
  const LinearGrid* grids;
  uint64_t group_len;
  uint64_t key, index_base;
  LinearGrid grid0;

  __device__ __forceinline__ void Init() { grid0 = grids[0]; }
  __device__ __forceinline__ float Apply(float x, float, uint64_t i, uint32_t rnd, uint32_t* code,
                                         GridRange* range) const {
    const LinearGrid lg = group_len == 0 ? grid0 : grids[GroupOf(i, group_len)];
    if (range != nullptr) *range = LinearGridRange(lg);
    int32_t q;
    const float value = RoundToLinearGrid<kMode>(x, lg, rnd, &q);
    if (code != nullptr) *code = uint32_t(q - lg.qmin);  // kernels::QuantizeLinearGrid's codes
    return value;
  }
};

// The block of element i of a block-scaled span (MatrixBlocks).
__device__ __forceinline__ uint64_t BlockOf(uint64_t i, const MatrixBlocks& b) {
  if (b.run != 0) return GroupOf(i, b.run);
  const uint64_t r = GroupOf(i, b.cols);
  const uint64_t c = i - r * b.cols;
  return GroupOf(r, b.rows_per_block) * b.blocks_per_row + GroupOf(c, b.cols_per_block);
}

// A float grid under a scale per block of the matrix view (kernels::QuantizeScaledFloatGridRow).
template <RoundMode kMode>
struct BlockScaledOp {
  static constexpr bool kReadsOut = false;
  static constexpr bool kRandom = kMode == RoundMode::kStochastic;
  FloatGrid g;
  const BlockScale* scales;
  MatrixBlocks blocks;
  uint64_t key, index_base;

  __device__ __forceinline__ void Init() {}
  __device__ __forceinline__ float Apply(float x, float, uint64_t i, uint32_t rnd, uint32_t* code,
                                         GridRange* range) const {
    const BlockScale s = scales[BlockOf(i, blocks)];
    if (range != nullptr) *range = ScaledGridRange(g.max_bits, s);
    return BitsFloat(RoundScaled<kMode>(x, g, s, rnd, code));
  }
};

// The random bits of elements [i, i + kCount) of an op's span (zeros for ops without kRandom).
template <class Op, int kCount>
__device__ __forceinline__ void RandomRun(const Op& op, uint64_t i, uint32_t (&rnd)[kCount]) {
  if constexpr (Op::kRandom) {
    RandomBitsRun<kCount>(op.key, op.index_base + i, rnd);
  } else {
#pragma unroll
    for (int k = 0; k < kCount; ++k) rnd[k] = 0u;
  }
}

// The random bits of element i alone.
template <class Op>
__device__ __forceinline__ uint32_t RandomOne(const Op& op, uint64_t i) {
  if constexpr (Op::kRandom) {
    return RandomBits(op.key, op.index_base + i);
  } else {
    return 0u;
  }
}

// ---------------------------------------------------------------------------------------------
// Launch helpers

inline cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

// How many blocks of kKernel (kThreads threads, no dynamic shared memory) the current device
// holds at once: SMs x resident blocks per SM. The attribute and occupancy queries cost
// microseconds each and a training step launches hundreds of kernels, so they run once per
// kernel and device; cudaGetDevice stays per launch because it is what keeps the cache right
// when a thread switches devices, and it only reads the runtime's thread-local state.
template <auto kKernel>
CudaResult ResidentBlocks(int* cap) {
  constexpr int kCachedDevices = 64;
  static std::atomic<int> cache[kCachedDevices];  // 0: not known yet
  int device = 0;
  CPD_CUDA_CHECK(cudaGetDevice(&device));
  const bool cached = device >= 0 && device < kCachedDevices;
  if (cached) {
    const int known = cache[device].load(std::memory_order_relaxed);
    if (known > 0) {
      *cap = known;
      return CudaResult{};
    }
  }
  int sms = 0, per_sm = 0;
  CPD_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  CPD_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kThreads, 0));
  *cap = (sms > 0 ? sms : 1) * (per_sm > 0 ? per_sm : 1);
  // Racing threads store the same value.
  if (cached) cache[device].store(*cap, std::memory_order_relaxed);
  return CudaResult{};
}

// Blocks for a grid-stride kernel: enough for `work` items of `per_block` each, at most the
// number that fit on the device at once (and kMaxStatsBlocks when per-block stats are kept).
template <auto kKernel>
CudaResult GridBlocks(uint64_t work, uint64_t per_block, bool stats, int* blocks) {
  int resident = 0;
  CudaResult r = ResidentBlocks<kKernel>(&resident);
  if (!r.ok()) return r;
  uint64_t cap = uint64_t(resident);
  if (stats && cap > kMaxStatsBlocks) cap = kMaxStatsBlocks;
  uint64_t b = CEIL_DIV(work, per_block);
  b = b < cap ? b : cap;
  *blocks = int(b > 0 ? b : 1);
  return CudaResult{};
}

// The scales of a grouped span: present, and one for each group the span touches.
inline CudaResult CheckGroups(uint64_t n, const GroupLayout& groups, bool has_params) {
  CPD_LAUNCH_REQUIRE(groups.group_len == 0 || has_params, "grouped span without scales");
  CPD_LAUNCH_REQUIRE(groups.group_len == 0 || groups.num_groups >= CEIL_DIV(n, groups.group_len),
                     "fewer groups than the span needs");
  return CudaResult{};
}

// The checks of a statistics-keeping launch.
inline CudaResult CheckStats(const StatsTarget& stats) {
  CPD_LAUNCH_REQUIRE(!stats.wanted() || (stats.scratch != nullptr && stats.ticket != nullptr),
                     "statistics need a scratch buffer and a ticket");
  return CudaResult{};
}

}  // namespace cpd::kernels::cuda
