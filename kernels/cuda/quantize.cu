// CUDA kernels of the quantiser (see kernels/cuda/quantize.h). Layout, after llm.c: helpers,
// then the kernels (names end in _kernel), then the launchers, which check their arguments,
// size the grid with CEIL_DIV, launch on the caller's stream and check cudaGetLastError().
//
// Bit-exactness with the CPU path (kernels/quantize_cpu.cc, cpd/quantize.cc):
//  * the per-element math is kernels/grid.h, compiled here with -fmad=false (no FMA
//    contraction) and without fast-math (IEEE division, denormals kept);
//  * scales are chosen from the same reductions: bit-max of |finite x| (order-free) for shifts
//    and int<b>, and for uint<b>:minmax the finite min/max, where the CPU's choice between +0
//    and -0 as the minimum (which decides the output sign of a zero-scale group) is reproduced
//    by ranking zeros in the CPU's lane order;
//  * stochastic rounding draws RandomBits(key, index_base + i) for element i, as the CPU does
//    (RandomBitsRun: one hash per pair of elements), and rounds onto float grids with
//    RoundToFloatGridStochastic, RoundToFloatGrid<kStochastic> on precomputed constants;
//  * x * 2^-s and z * 2^s are single multiplications by powers of two; a NaN result is stored
//    with the bits the CPU's x86 multiply would keep (the GPU would canonicalise its payload);
//  * block-scaled formats take each block's max |finite x| (the same bit max), derive its scale
//    with the CPU's grid.h functions (ShiftForMax, Float32BlockScale, TensorEncodeScale,
//    BlockScaleBits, GridBlockScale) and round with RoundScaled, the CPU loops' element
//    function, whose products keep x86's NaN bits on the GPU too (MulAsX86).
// Statistics: counts and max are exact; the double sums are accumulated per thread, reduced
// per block and summed over blocks in block order (deterministic for a given device, but a
// different order from the CPU's lane-wise sums, so they agree to rounding, not bit for bit).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/quantize.h"

namespace cpd::kernels::cuda {

namespace {

constexpr uint64_t kReduceSegment = 2048;  // elements one warp reduces before its atomic
static_assert(65536 % kReduceSegment == 0, "segments must not straddle the CPU's chunks");

// ---------------------------------------------------------------------------------------------
// Device helpers

// An order-preserving map of float bits to unsigned integers (for atomicMin/atomicMax).
CPD_HD uint32_t OrderedBits(uint32_t u) { return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u); }
CPD_HD uint32_t UnorderedBits(uint32_t o) {
  return (o & 0x80000000u) != 0 ? (o & 0x7fffffffu) : ~o;
}

// kernels::HysteresisFloatGrid: up onto the grid if w < q_prev, else down.
struct FloatHysteresisOp {
  static constexpr bool kReadsOut = true;
  static constexpr bool kRandom = false;
  FloatGrid g;
  const int32_t* shifts;
  uint64_t group_len;
  int32_t shift0;

  __device__ __forceinline__ void Init() { shift0 = shifts != nullptr ? shifts[0] : 0; }
  __device__ __forceinline__ float Apply(float x, float prev, uint64_t i, uint32_t /*rnd*/,
                                         uint32_t* /*code*/, GridRange* range) const {
    const int32_t s = group_len == 0 ? shift0 : shifts[GroupOf(i, group_len)];
    const float y = __fmul_rn(x, Pow2(-s));
    if (range != nullptr) *range = ShiftedGridRange(g.max_bits, Pow2(s));
    const uint32_t zb = x < prev ? RoundToFloatGrid<RoundMode::kUp>(y, g, 0u, nullptr)
                                 : RoundToFloatGrid<RoundMode::kDown>(y, g, 0u, nullptr);
    return ScaleBack(zb, Pow2(s));
  }
};

// kernels::HysteresisBinadeGrid.
struct BinadeHysteresisOp {
  static constexpr bool kReadsOut = true;
  static constexpr bool kRandom = false;
  const BinadeGrid* g;
  const int32_t* shifts;
  uint64_t group_len;
  int32_t shift0;

  __device__ __forceinline__ void Init() { shift0 = shifts[0]; }
  __device__ __forceinline__ float Apply(float x, float prev, uint64_t i, uint32_t /*rnd*/,
                                         uint32_t* /*code*/, GridRange* range) const {
    const int32_t s = group_len == 0 ? shift0 : shifts[GroupOf(i, group_len)];
    const float y = __fmul_rn(x, Pow2(-s));
    if (range != nullptr) *range = ShiftedGridRange(g->max_bits, Pow2(s));
    const uint32_t zb = x < prev ? RoundToBinadeGrid<RoundMode::kUp>(y, *g, 0u, nullptr)
                                 : RoundToBinadeGrid<RoundMode::kDown>(y, *g, 0u, nullptr);
    return ScaleBack(zb, Pow2(s));
  }
};

struct LinearHysteresisOp {
  static constexpr bool kReadsOut = true;
  static constexpr bool kRandom = false;
  const LinearGrid* grids;
  uint64_t group_len;
  LinearGrid grid0;

  __device__ __forceinline__ void Init() { grid0 = grids[0]; }
  __device__ __forceinline__ float Apply(float x, float prev, uint64_t i, uint32_t /*rnd*/,
                                         uint32_t* /*code*/, GridRange* range) const {
    const LinearGrid lg = group_len == 0 ? grid0 : grids[GroupOf(i, group_len)];
    if (range != nullptr) *range = LinearGridRange(lg);
    return x < prev ? RoundToLinearGrid<RoundMode::kUp>(x, lg, 0u, nullptr)
                    : RoundToLinearGrid<RoundMode::kDown>(x, lg, 0u, nullptr);
  }
};

// kernels::HysteresisScaledFloatGridRow (and HysteresisFloatGrid for power-of-two block scales,
// which RoundScaled under Pow2BlockScale equals).
struct BlockScaledHysteresisOp {
  static constexpr bool kReadsOut = true;
  static constexpr bool kRandom = false;
  FloatGrid g;
  const BlockScale* scales;
  MatrixBlocks blocks;

  __device__ __forceinline__ void Init() {}
  __device__ __forceinline__ float Apply(float x, float prev, uint64_t i, uint32_t /*rnd*/,
                                         uint32_t* /*code*/, GridRange* range) const {
    const BlockScale s = scales[BlockOf(i, blocks)];
    if (range != nullptr) *range = ScaledGridRange(g.max_bits, s);
    return BitsFloat(x < prev ? RoundScaled<RoundMode::kUp>(x, g, s, 0u, nullptr)
                              : RoundScaled<RoundMode::kDown>(x, g, s, 0u, nullptr));
  }
};

template <class Op, bool kStats>
__device__ __forceinline__ float ApplyOne(const Op& op, float x, float prev, uint64_t i,
                                          uint32_t rnd, Acc<kStats>& acc) {
  GridRange range;
  const float z = op.Apply(x, prev, i, rnd, /*code=*/nullptr, kStats ? &range : nullptr);
  if constexpr (kStats) {
    acc.Add(x, z, range);
    if (Op::kReadsOut) acc.Flip(FloatBits(z) != FloatBits(prev));
  }
  return z;
}

// Elements i..i+3, whose random bits come from one run (two or three hashes, not four).
template <class Op, bool kStats>
__device__ __forceinline__ float4 ApplyFour(const Op& op, float4 x, float4 p, uint64_t i,
                                            Acc<kStats>& acc) {
  uint32_t rnd[4];
  RandomRun(op, i, rnd);
  float4 z;
  z.x = ApplyOne<Op, kStats>(op, x.x, p.x, i, rnd[0], acc);
  z.y = ApplyOne<Op, kStats>(op, x.y, p.y, i + 1, rnd[1], acc);
  z.z = ApplyOne<Op, kStats>(op, x.z, p.z, i + 2, rnd[2], acc);
  z.w = ApplyOne<Op, kStats>(op, x.w, p.w, i + 3, rnd[3], acc);
  return z;
}

// ---------------------------------------------------------------------------------------------
// Kernels

// Work item w of the reductions: segment w % segs_per_group (at most kReduceSegment elements)
// of group w / segs_per_group.
struct Segment {
  uint64_t group, begin, end;
};
__device__ __forceinline__ Segment SegmentOf(uint64_t w, uint64_t n, uint64_t group_len,
                                             uint64_t segs_per_group) {
  const uint64_t g = w / segs_per_group, seg = w % segs_per_group;
  const uint64_t group_begin = g * group_len;
  const uint64_t group_end = group_begin + group_len < n ? group_begin + group_len : n;
  const uint64_t begin = group_begin + seg * kReduceSegment;
  return {g, begin, begin + kReduceSegment < group_end ? begin + kReduceSegment : group_end};
}

// The job of a scale reduction (LaunchScalesFromData), as kernel parameters. The reduction
// buffers (max_bits, or lo_keys and hi_ord) are zero when no element was seen: lo_keys holds the
// complement of the smallest key (atomicMax of ~key), so that every buffer starts from zero.
struct ScaleJob {
  ScaleKind kind;
  ShiftRule shift;
  int32_t qmax;
  uint64_t num_groups;
  uint32_t* max_bits;           // kShift, kIntGrid
  unsigned long long* lo_keys;  // kUintGrid: ~(smallest key)
  uint32_t* hi_ord;             // kUintGrid: OrderedBits(largest finite x)
  ScaleOutput out;
  unsigned int* ticket;  // null: derive_scales_kernel derives them (many groups)
};

// Group g's scale (and metadata) from its reduced values, which are cleared for the next call
// on the stream. Atomic exchanges: the values come from other blocks' atomics, held in L2.
__device__ __forceinline__ void DeriveScale(const ScaleJob& job, uint64_t g) {
  const ScaleOutput& out = job.out;
  if (job.kind == ScaleKind::kUintGrid) {
    const unsigned long long key = ~atomicExch(&job.lo_keys[g], 0ull);
    const uint32_t hi_ord = atomicExch(&job.hi_ord[g], 0u);
    float lo = INFINITY, hi = -INFINITY;  // no finite element
    if (key != ~0ull) {
      lo = BitsFloat(UnorderedBits(uint32_t(key >> 32)));
      if (lo == 0.0f) lo = (key & 1u) != 0 ? 0.0f : -0.0f;  // the zero the CPU picks
      hi = BitsFloat(UnorderedBits(hi_ord));
    }
    // uint<b>:minmax: MinMaxGrid (grid.h), as cpd/quantize.cc.
    const LinearGrid grid = MinMaxGrid(lo, hi, job.qmax);
    out.grids[g] = grid;
    if (out.meta != nullptr) StoreLinearMeta(grid, out.minmax, out.meta + g * (out.minmax ? 8 : 4));
    return;
  }
  const float max_abs = BitsFloat(atomicExch(&job.max_bits[g], 0u));
  if (job.kind == ScaleKind::kShift) {
    const int32_t s = ShiftForMax(max_abs, job.shift);
    out.shifts[g] = s;
    if (out.meta != nullptr) out.meta[g] = ShiftMetaByte(s, out.e8m0);
    return;
  }
  // int<b>: SymmetricIntGrid (grid.h), as cpd/quantize.cc.
  const LinearGrid grid = SymmetricIntGrid(max_abs, job.qmax);
  out.grids[g] = grid;
  if (out.meta != nullptr) StoreLinearMeta(grid, out.minmax, out.meta + g * (out.minmax ? 8 : 4));
}

// The end of every reduction kernel: the last block to finish derives every group's scale,
// unless derive_scales_kernel does (job.ticket null, the same for every block).
__device__ __forceinline__ void DeriveInLastBlock(const ScaleJob& job) {
  if (job.ticket == nullptr || !LastBlockDone(job.ticket)) return;
  for (uint64_t g = threadIdx.x; g < job.num_groups; g += blockDim.x) DeriveScale(job, g);
}

// Spans with more than kLastBlockGroups groups: one thread per group.
__global__ void derive_scales_kernel(ScaleJob job) {
  const uint64_t g = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g < job.num_groups) DeriveScale(job, g);
}

// The running finite minimum key and maximum of a min/max reduction. Key: OrderedBits(x, zeros
// as +0) << 32 | (for a zero: chunk << 1 | 1 for +0, 0 for -0). kernels::MinMaxFinite orders -0
// below +0 within a span; the CPU combines its 65536-element chunks with std::min, which keeps
// the earlier chunk on a tie. So among zeros the earliest chunk wins, and within it -0 wins.
struct MinMax {
  unsigned long long lo = ~0ull;
  uint32_t hi = 0;  // 0: no finite element (every finite x maps to a nonzero OrderedBits)

  __device__ __forceinline__ void Add(float x, unsigned long long zero_rank) {
    uint32_t u = FloatBits(x);
    if ((u & 0x7fffffffu) >= 0x7f800000u) return;  // NaN and Inf are ignored
    unsigned long long low = 0;
    if ((u & 0x7fffffffu) == 0) {
      low = zero_rank | (u >> 31 ? 0u : 1u);
      u = 0;
    }
    const uint32_t o = OrderedBits(u);
    const unsigned long long key = (static_cast<unsigned long long>(o) << 32) | low;
    lo = key < lo ? key : lo;
    hi = o > hi ? o : hi;
  }
  __device__ __forceinline__ void Merge(unsigned long long olo, uint32_t ohi) {
    lo = olo < lo ? olo : lo;
    hi = ohi > hi ? ohi : hi;
  }
  __device__ __forceinline__ void WarpReduce() {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      Merge(__shfl_xor_sync(kFullMask, lo, off), __shfl_xor_sync(kFullMask, hi, off));
    }
  }
  // Into the reduction buffers of group g (one lane).
  __device__ __forceinline__ void Publish(const ScaleJob& job, uint64_t g) const {
    if (hi == 0) return;
    atomicMax(&job.lo_keys[g], ~lo);
    atomicMax(&job.hi_ord[g], hi);
  }
};

// The zero rank of a chunk (see MinMax).
__device__ __forceinline__ unsigned long long ZeroRank(uint64_t chunk) {
  return (chunk < 0x7fffffffu ? chunk : 0x7fffffffu) << 1;
}

__device__ __forceinline__ uint32_t WarpMax(uint32_t m) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const uint32_t o = __shfl_xor_sync(kFullMask, m, off);
    m = o > m ? o : m;
  }
  return m;
}

// Max of |finite x| per group of a grouped span. One warp per work item (a segment of at most
// kReduceSegment elements of one group), grid-stride over work items; one atomicMax per item.
__global__ void __launch_bounds__(kThreads)
    max_abs_groups_kernel(const float* in, uint64_t n, uint64_t group_len, uint64_t segs_per_group,
                          uint64_t items, ScaleJob job) {
  const int lane = threadIdx.x % 32;
  const uint64_t warp = (uint64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const uint64_t warps = uint64_t(gridDim.x) * blockDim.x / 32;
  for (uint64_t w = warp; w < items; w += warps) {
    // Last item first, so the element pass finds the start of the span in L2.
    const Segment sg = SegmentOf(items - 1 - w, n, group_len, segs_per_group);
    const uint64_t g = sg.group, begin = sg.begin, end = sg.end;
    uint32_t m0 = 0, m1 = 0;
    uint64_t i = begin + lane;
    for (; i + 32 < end; i += 64) {  // two independent loads in flight
      const uint32_t a = FiniteAbsBits(in[i]), b = FiniteAbsBits(in[i + 32]);
      m0 = a > m0 ? a : m0;
      m1 = b > m1 ? b : m1;
    }
    if (i < end) {
      const uint32_t a = FiniteAbsBits(in[i]);
      m0 = a > m0 ? a : m0;
    }
    const uint32_t m = WarpMax(m0 > m1 ? m0 : m1);
    if (lane == 0 && m != 0) atomicMax(&job.max_bits[g], m);
  }
  DeriveInLastBlock(job);
}

// Finite min (with the CPU's choice of zero) and max per group of a grouped span; the work split
// of max_abs_groups_kernel. A segment never straddles a 65536-element chunk (kReduceSegment
// divides 65536), so its zeros share one chunk.
__global__ void __launch_bounds__(kThreads)
    min_max_groups_kernel(const float* in, uint64_t n, uint64_t group_len, uint64_t segs_per_group,
                          uint64_t items, bool chunked, ScaleJob job) {
  const int lane = threadIdx.x % 32;
  const uint64_t warp = (uint64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const uint64_t warps = uint64_t(gridDim.x) * blockDim.x / 32;
  for (uint64_t w = warp; w < items; w += warps) {
    const Segment sg = SegmentOf(items - 1 - w, n, group_len, segs_per_group);  // last first
    const uint64_t g = sg.group, begin = sg.begin, end = sg.end;
    const unsigned long long zero_rank = ZeroRank(chunked ? (begin - g * group_len) >> 16 : 0);
    MinMax mm;
    for (uint64_t i = begin + lane; i < end; i += 32) mm.Add(in[i], zero_rank);
    mm.WarpReduce();
    if (lane == 0) mm.Publish(job, g);
  }
  DeriveInLastBlock(job);
}

// One group (a per-tensor scale, the large activations and errors): grid-stride over 16-byte
// vectors (in + head is 16-byte aligned; [0, head) and the tail element by element), kUnroll
// loads in flight per thread, then a block reduction and one atomic per block. The segment
// kernels above give a 2 Mi-element tensor only 1024 warps with one load in flight each.
__global__ void __launch_bounds__(kThreads)
    max_abs_one_group_kernel(const float* in, uint64_t n, uint64_t head, uint64_t nvec,
                             ScaleJob job) {
  const uint64_t tid = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  uint32_t m = 0;
  for (uint64_t i = tid; i < head; i += stride) {
    const uint32_t a = FiniteAbsBits(in[i]);
    m = a > m ? a : m;
  }
  // Backwards (vector nvec - 1 - v): the element pass that follows reads forwards, so it first
  // meets what this pass read last, which is still in L2 (tens of MB on an H100/H200).
  const float4* in4 = reinterpret_cast<const float4*>(in + head);
  for (uint64_t v0 = tid; v0 < nvec; v0 += kUnroll * stride) {
    float4 x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t v = v0 + u * stride;
      x[u] = v < nvec ? in4[nvec - 1 - v] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);  // 0: no max
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t abcd = MaxFiniteAbsBits(x[u]);
      m = abcd > m ? abcd : m;
    }
  }
  for (uint64_t i = head + 4 * nvec + tid; i < n; i += stride) {
    const uint32_t a = FiniteAbsBits(in[i]);
    m = a > m ? a : m;
  }
  __shared__ uint32_t warp_max[kWarpsPerBlock];
  m = WarpMax(m);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarpsPerBlock; ++w) m = warp_max[w] > m ? warp_max[w] : m;
    if (m != 0) atomicMax(&job.max_bits[0], m);
  }
  DeriveInLastBlock(job);
}

// The same split for the finite min and max of one group; a zero's chunk is its index >> 16
// when the CPU reduced the span in chunks.
__global__ void __launch_bounds__(kThreads)
    min_max_one_group_kernel(const float* in, uint64_t n, uint64_t head, uint64_t nvec,
                             bool chunked, ScaleJob job) {
  const uint64_t tid = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  MinMax mm;
  for (uint64_t i = tid; i < head; i += stride) mm.Add(in[i], ZeroRank(chunked ? i >> 16 : 0));
  // Backwards, as max_abs_one_group_kernel (L2 reuse by the element pass).
  const float4* in4 = reinterpret_cast<const float4*>(in + head);
  for (uint64_t v0 = tid; v0 < nvec; v0 += kUnroll * stride) {
    float4 x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t v = v0 + u * stride;
      if (v < nvec) x[u] = in4[nvec - 1 - v];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t v = v0 + u * stride;
      if (v >= nvec) break;
      // Each element its own chunk: with head = 1..3 a vector may straddle a chunk boundary.
      const uint64_t i = head + 4 * (nvec - 1 - v);
      mm.Add(x[u].x, ZeroRank(chunked ? i >> 16 : 0));
      mm.Add(x[u].y, ZeroRank(chunked ? (i + 1) >> 16 : 0));
      mm.Add(x[u].z, ZeroRank(chunked ? (i + 2) >> 16 : 0));
      mm.Add(x[u].w, ZeroRank(chunked ? (i + 3) >> 16 : 0));
    }
  }
  for (uint64_t i = head + 4 * nvec + tid; i < n; i += stride) {
    mm.Add(in[i], ZeroRank(chunked ? i >> 16 : 0));
  }
  __shared__ unsigned long long warp_lo[kWarpsPerBlock];
  __shared__ uint32_t warp_hi[kWarpsPerBlock];
  mm.WarpReduce();
  if (threadIdx.x % 32 == 0) {
    warp_lo[threadIdx.x / 32] = mm.lo;
    warp_hi[threadIdx.x / 32] = mm.hi;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarpsPerBlock; ++w) mm.Merge(warp_lo[w], warp_hi[w]);
    mm.Publish(job, 0);
  }
  DeriveInLastBlock(job);
}

// The job of a block scale reduction (LaunchBlockScalesFromData), as kernel parameters.
struct BlockScaleJob {
  BlockScaleRule rule;
  MatrixBlocks blocks;
  uint32_t* amax_bits;    // per block, zero when no finite element was seen
  uint32_t* tensor_bits;  // the tensor's (rule.tensor_level)
  BlockScale* scales;
  float* tensor_enc;     // T, for the derivation and the decoder's kernels
  uint8_t* meta;         // the encoder's metadata, or null
  unsigned int* ticket;  // null: no last-block work (many blocks, no tensor level)
  bool derive_here;      // the last block derives the scales (else derive_block_scales_kernel)
};

// Block g's scale (and metadata) from its max |x|, which is cleared for the next call on the
// stream; cpd/quantize.cc ComputeBlockScales and WriteBlockScales, with the same grid.h functions.
__device__ __forceinline__ void DeriveBlockScale(const BlockScaleJob& job, uint64_t g) {
  const BlockScaleRule& r = job.rule;
  const float amax = BitsFloat(atomicExch(&job.amax_bits[g], 0u));
  uint8_t* meta = job.meta != nullptr ? job.meta + g * uint64_t(r.meta_bytes) : nullptr;
  BlockScale s;
  switch (r.kind) {
    case BlockScaleKind::kPow2: {
      const int32_t shift = ShiftForMax(amax, r.shift);
      s = Pow2BlockScale(shift);
      if (meta != nullptr) meta[0] = ShiftMetaByte(shift, /*e8m0=*/true);
      break;
    }
    case BlockScaleKind::kFloat32:
      s = Float32BlockScale(amax, r.elem_max);
      if (meta != nullptr) StoreFloatMeta(s.dec, meta);
      break;
    case BlockScaleKind::kFloatGrid: {
      const float t = r.tensor_level ? *job.tensor_enc : 1.0f;
      uint32_t code = 0;
      const float sb = BitsFloat(BlockScaleBits(amax, t, r.elem_max, r.scale_grid, &code));
      s = GridBlockScale(sb, t);
      if (meta != nullptr) StoreCodeMeta(code, r.meta_bytes, meta);
      break;
    }
  }
  job.scales[g] = s;
}

// The end of the block reduction: the last block to finish turns the tensor's max |x| into T
// (thread 0), then derives every block's scale unless derive_block_scales_kernel does.
__device__ __forceinline__ void FinishBlockScales(const BlockScaleJob& job) {
  if (job.ticket == nullptr || !LastBlockDone(job.ticket)) return;
  const BlockScaleRule& r = job.rule;
  if (r.tensor_level && threadIdx.x == 0) {
    const float amax = BitsFloat(atomicExch(job.tensor_bits, 0u));
    const float t = TensorEncodeScale(amax, BitsFloat(r.scale_grid.max_bits), r.elem_max);
    *job.tensor_enc = t;
    if (job.meta != nullptr) {
      StoreFloatMeta(t, job.meta + job.blocks.num_blocks * uint64_t(r.meta_bytes));
    }
  }
  __syncthreads();  // T before the derivation reads it
  if (!job.derive_here) return;
  for (uint64_t g = threadIdx.x; g < job.blocks.num_blocks; g += blockDim.x) {
    DeriveBlockScale(job, g);
  }
}

// Spans with more than kLastBlockGroups blocks: one thread per block.
__global__ void derive_block_scales_kernel(BlockScaleJob job) {
  const uint64_t g = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g < job.blocks.num_blocks) DeriveBlockScale(job, g);
}

// Max of |finite x| per block of the matrix view (exactly kernels::MaxAbsFinite's, an
// order-free bit max), and the tensor's. A warp takes 32 consecutive elements at a time (kUnroll
// such chunks in flight), which may span several blocks and rows: lanes of equal block merge by
// a segmented shuffle reduction, and the first lane of each run of one block publishes its max
// with one atomic (a block's lanes are contiguous within a row, so the run's first lane sees
// them all). Chunks are taken last first, so that the element pass finds the start in L2.
__global__ void __launch_bounds__(kThreads)
    block_max_abs_kernel(const float* in, uint64_t n, BlockScaleJob job) {
  const int lane = threadIdx.x % 32;
  const uint64_t warp = (uint64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const uint64_t warps = uint64_t(gridDim.x) * blockDim.x / 32;
  const uint64_t chunks = CEIL_DIV(n, uint64_t(32));
  uint32_t tensor_max = 0;
  for (uint64_t w0 = warp; w0 < chunks; w0 += kUnroll * warps) {
    float x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t w = w0 + u * warps;
      const uint64_t i = (chunks - 1 - w) * 32 + lane;
      x[u] = w < chunks && i < n ? in[i] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t w = w0 + u * warps;
      if (w >= chunks) break;  // warp-uniform
      const uint64_t i = (chunks - 1 - w) * 32 + lane;
      uint32_t m = FiniteAbsBits(x[u]);
      const uint64_t b = i < n ? BlockOf(i, job.blocks) : ~uint64_t(0);
      tensor_max = m > tensor_max ? m : tensor_max;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const uint32_t om = __shfl_down_sync(kFullMask, m, off);
        const uint64_t ob = __shfl_down_sync(kFullMask, b, off);
        if (lane + off < 32 && ob == b) m = om > m ? om : m;
      }
      const uint64_t before = __shfl_up_sync(kFullMask, b, 1);
      if (i < n && (lane == 0 || before != b) && m != 0) atomicMax(&job.amax_bits[b], m);
    }
  }
  if (job.rule.tensor_level) {
    __shared__ uint32_t warp_max[kWarpsPerBlock];
    tensor_max = WarpMax(tensor_max);
    if (lane == 0) warp_max[threadIdx.x / 32] = tensor_max;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < kWarpsPerBlock; ++w) {
        tensor_max = warp_max[w] > tensor_max ? warp_max[w] : tensor_max;
      }
      if (tensor_max != 0) atomicMax(job.tensor_bits, tensor_max);
    }
  }
  FinishBlockScales(job);
}

// The element-wise pass. [0, head) and [head + 4 * nvec, n) are done element by element;
// the middle as 16-byte vectors (in, out, prev and keep + head are 16-byte aligned), kUnroll
// independent loads per thread before any store. Ops that read a previous value (hysteresis)
// read it from `prev` and also store their result to `keep` when it is non-null. in, out, prev
// and keep may alias as the launcher allows: every element is read and then written by the
// same thread only.
template <class Op, bool kStats>
__global__ void __launch_bounds__(kThreads)
    quantize_elementwise_kernel(const Op op, const float* in, const float* prev, float* out,
                                float* keep, uint64_t n, uint64_t head, uint64_t nvec,
                                StatsArgs stats) {
  Op o = op;
  o.Init();
  Acc<kStats> acc;
  const uint64_t tid = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = tid; i < head; i += stride) {
    const float p = Op::kReadsOut ? prev[i] : 0.0f;
    const float z = ApplyOne<Op, kStats>(o, in[i], p, i, RandomOne(o, i), acc);
    out[i] = z;
    if constexpr (Op::kReadsOut) {
      if (keep != nullptr) keep[i] = z;
    }
  }
  const float4* in4 = reinterpret_cast<const float4*>(in + head);
  const float4* prev4 = reinterpret_cast<const float4*>(prev + head);
  float4* out4 = reinterpret_cast<float4*>(out + head);
  float4* keep4 = keep != nullptr ? reinterpret_cast<float4*>(keep + head) : nullptr;
  for (uint64_t v0 = tid; v0 < nvec; v0 += kUnroll * stride) {
    float4 x[kUnroll], p[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t v = v0 + u * stride;
      if (v < nvec) {
        x[u] = in4[v];
        if (Op::kReadsOut) p[u] = prev4[v];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t v = v0 + u * stride;
      if (v < nvec) {
        if (!Op::kReadsOut) p[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        const float4 z = ApplyFour<Op, kStats>(o, x[u], p[u], head + 4 * v, acc);
        out4[v] = z;
        if constexpr (Op::kReadsOut) {
          if (keep != nullptr) keep4[v] = z;
        }
      }
    }
  }
  for (uint64_t i = head + 4 * nvec + tid; i < n; i += stride) {
    const float p = Op::kReadsOut ? prev[i] : 0.0f;
    const float z = ApplyOne<Op, kStats>(o, in[i], p, i, RandomOne(o, i), acc);
    out[i] = z;
    if constexpr (Op::kReadsOut) {
      if (keep != nullptr) keep[i] = z;
    }
  }
  if constexpr (kStats) FinishStats(acc, stats, n);
}

// Block formats in one pass (block_size = 4 * lanes_per_block, a power of two <= 128). A warp
// takes 128 consecutive elements (a tile), 4 per lane: one 16-byte load and one 16-byte store
// per lane, 512 contiguous bytes per warp, kUnroll tiles in flight. A block is lanes_per_block
// adjacent lanes, whose max is found by xor shuffles, so the shift is known without a second
// read. Tiles are distributed grid-stride over warps (warp-uniform, so every shuffle is full).
template <RoundMode kMode, bool kStats>
__global__ void __launch_bounds__(kThreads)
    quantize_blocks_fused_kernel(const float* in, float* out, uint64_t n,
                                 const StochasticGridConsts c, ShiftRule rule, int lanes_per_block,
                                 bool vec_in, bool vec_out, uint64_t key, uint64_t index_base,
                                 StatsArgs stats) {
  Acc<kStats> acc;
  const int lane = threadIdx.x % 32;
  const uint64_t warp = (uint64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const uint64_t warps = uint64_t(gridDim.x) * blockDim.x / 32;
  const uint64_t tiles = CEIL_DIV(n, uint64_t(128));
  for (uint64_t t0 = warp; t0 < tiles; t0 += kUnroll * warps) {
    float4 x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t t = t0 + u * warps;
      const uint64_t e = t * 128 + 4 * lane;
      if (t < tiles) {
        if (vec_in && e + 4 <= n) {
          x[u] = *reinterpret_cast<const float4*>(in + e);
        } else {
          x[u].x = e < n ? in[e] : 0.0f;
          x[u].y = e + 1 < n ? in[e + 1] : 0.0f;
          x[u].z = e + 2 < n ? in[e + 2] : 0.0f;
          x[u].w = e + 3 < n ? in[e + 3] : 0.0f;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t t = t0 + u * warps;
      if (t >= tiles) break;  // warp-uniform
      const uint64_t e = t * 128 + 4 * lane;
      uint32_t m = MaxFiniteAbsBits(x[u]);
      // Unrolled, with a uniform condition per step: a loop over lanes_per_block cost a
      // compare and a branch per step of every tile.
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        if (off < lanes_per_block) {
          const uint32_t other = __shfl_xor_sync(kFullMask, m, off);
          m = other > m ? other : m;
        }
      }
      const int32_t s = ShiftForMax(BitsFloat(m), rule);
      const float down = Pow2(-s), up = Pow2(s);
      uint32_t rnd[4] = {0u, 0u, 0u, 0u};
      if constexpr (kMode == RoundMode::kStochastic) RandomBitsRun<4>(key, index_base + e, rnd);
      float z[4];
      const float xs[4] = {x[u].x, x[u].y, x[u].z, x[u].w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t zb = RoundFloat<kMode>(__fmul_rn(xs[k], down), c, rnd[k], nullptr);
        z[k] = ScaleBack(zb, up);
        if constexpr (kStats) {
          if (e + k < n) acc.Add(xs[k], z[k], ShiftedGridRange(c.max_bits, up));
        }
      }
      if (vec_out && e + 4 <= n) {
        *reinterpret_cast<float4*>(out + e) = make_float4(z[0], z[1], z[2], z[3]);
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if (e + k < n) out[e + k] = z[k];
        }
      }
    }
  }
  if constexpr (kStats) FinishStats(acc, stats, n);
}

// One thread copies the grid from the kernel's parameter space to device memory.
__global__ void store_binade_grid_kernel(const BinadeGrid g, BinadeGrid* dst) { *dst = g; }

// Grid-stride count of differing bit patterns (and the copy of b, when asked); one atomic per
// warp.
__global__ void count_changed_bits_kernel(const float* a, const float* b, uint64_t n,
                                          float* copy_to, unsigned long long* count) {
  unsigned long long c = 0;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float bi = b[i];
    c += FloatBits(a[i]) != FloatBits(bi);
    if (copy_to != nullptr) copy_to[i] = bi;  // after this thread's read of a[i]
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) c += __shfl_down_sync(kFullMask, c, off);
  if (threadIdx.x % 32 == 0 && c > 0) atomicAdd(count, c);
}

// ---------------------------------------------------------------------------------------------
// Launch helpers

// Splits [0, n) into a scalar head, 16-byte vectors and a scalar tail (see the kernel).
void VectorSplit(const float* in, const float* out, uint64_t n, uint64_t* head, uint64_t* nvec) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(in), b = reinterpret_cast<uintptr_t>(out);
  if ((a & 15u) != (b & 15u) || (a & 3u) != 0) {  // no common 16-byte alignment
    *head = n;
    *nvec = 0;
    return;
  }
  uint64_t h = ((16u - (a & 15u)) & 15u) / 4u;
  h = h < n ? h : n;
  *head = h;
  *nvec = (n - h) / 4;
}

// Whether [a, a + n) and [b, b + n) share memory.
bool Overlap(const float* a, const float* b, uint64_t n) {
  const uintptr_t x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x < y + n * sizeof(float) && y < x + n * sizeof(float);
}

// `prev` and `keep`: Op::kReadsOut ops only (hysteresis); prev null means out (in place).
template <class Op>
CudaResult LaunchElementwise(const Op& op, const float* in, float* out, uint64_t n,
                             const StatsTarget& stats, cudaStream_t stream,
                             const float* prev = nullptr, float* keep = nullptr) {
  if (n == 0) return CudaResult{};
  CPD_LAUNCH_REQUIRE(in != nullptr && out != nullptr, "null buffer");
  CudaResult checked = CheckStats(stats);
  if (!checked.ok()) return checked;
  if (prev == nullptr) prev = out;
  // keep may be prev itself (the state updated in place) but no other view of prev or out.
  CPD_LAUNCH_REQUIRE(
      keep == nullptr || ((keep == prev || !Overlap(keep, prev, n)) && !Overlap(keep, out, n)),
      "the kept copy must be the previous values or apart from them and the output");
  CPD_LAUNCH_REQUIRE(prev == out || !Overlap(prev, out, n),
                     "the previous values must be the output or apart from it");
  uint64_t head = 0, nvec = 0;
  VectorSplit(in, out, n, &head, &nvec);
  const uintptr_t a = reinterpret_cast<uintptr_t>(in) & 15u;
  if ((reinterpret_cast<uintptr_t>(prev) & 15u) != a ||
      (keep != nullptr && (reinterpret_cast<uintptr_t>(keep) & 15u) != a)) {
    head = n;  // no common 16-byte alignment: element by element
    nvec = 0;
  }
  // Work in threads: each handles kUnroll vectors, or one element outside the vector part.
  const uint64_t work = CEIL_DIV(nvec, uint64_t(kUnroll)) + (n - 4 * nvec);
  int blocks = 0;
  if (stats.wanted()) {
    CudaResult r = GridBlocks<quantize_elementwise_kernel<Op, true>>(work, kThreads, true, &blocks);
    if (!r.ok()) return r;
    quantize_elementwise_kernel<Op, true>
        <<<blocks, kThreads, 0, stream>>>(op, in, prev, out, keep, n, head, nvec, ArgsOf(stats));
    CPD_CUDA_CHECK(cudaGetLastError());
    return CudaResult{};
  }
  CudaResult r = GridBlocks<quantize_elementwise_kernel<Op, false>>(work, kThreads, false, &blocks);
  if (!r.ok()) return r;
  quantize_elementwise_kernel<Op, false>
      <<<blocks, kThreads, 0, stream>>>(op, in, prev, out, keep, n, head, nvec, StatsArgs{});
  CPD_CUDA_CHECK(cudaGetLastError());
  return CudaResult{};
}

template <template <RoundMode> class OpT, class... Args>
CudaResult DispatchMode(RoundMode mode, const float* in, float* out, uint64_t n,
                        const StatsTarget& stats, cudaStream_t stream, Args... args) {
  switch (mode) {
    case RoundMode::kNearestEven:
      return LaunchElementwise(OpT<RoundMode::kNearestEven>{args...}, in, out, n, stats, stream);
    case RoundMode::kStochastic:
      return LaunchElementwise(OpT<RoundMode::kStochastic>{args...}, in, out, n, stats, stream);
    case RoundMode::kTowardZero:
      return LaunchElementwise(OpT<RoundMode::kTowardZero>{args...}, in, out, n, stats, stream);
    default:
      break;
  }
  CPD_LAUNCH_REQUIRE(false, "rounding mode must be nearest-even, stochastic or toward zero");
  return CudaResult{};
}

template <RoundMode kMode>
CudaResult LaunchFused(const float* in, float* out, uint64_t n, const FloatGrid& g, ShiftRule rule,
                       int lanes_per_block, const RandomParams& rng, const StatsTarget& stats,
                       cudaStream_t stream) {
  const StochasticGridConsts c(g);
  const bool vec_in = (reinterpret_cast<uintptr_t>(in) & 15u) == 0;
  const bool vec_out = (reinterpret_cast<uintptr_t>(out) & 15u) == 0;
  const uint64_t tiles = CEIL_DIV(n, uint64_t(128));
  const uint64_t work = CEIL_DIV(tiles, uint64_t(kUnroll));  // in warps
  int blocks = 0;
  if (stats.wanted()) {
    CudaResult r =
        GridBlocks<quantize_blocks_fused_kernel<kMode, true>>(work, kWarpsPerBlock, true, &blocks);
    if (!r.ok()) return r;
    quantize_blocks_fused_kernel<kMode, true>
        <<<blocks, kThreads, 0, stream>>>(in, out, n, c, rule, lanes_per_block, vec_in, vec_out,
                                          rng.key, rng.index_base, ArgsOf(stats));
    CPD_CUDA_CHECK(cudaGetLastError());
    return CudaResult{};
  }
  CudaResult r =
      GridBlocks<quantize_blocks_fused_kernel<kMode, false>>(work, kWarpsPerBlock, false, &blocks);
  if (!r.ok()) return r;
  quantize_blocks_fused_kernel<kMode, false><<<blocks, kThreads, 0, stream>>>(
      in, out, n, c, rule, lanes_per_block, vec_in, vec_out, rng.key, rng.index_base, StatsArgs{});
  CPD_CUDA_CHECK(cudaGetLastError());
  return CudaResult{};
}

// Work items of the group reductions: (group, segment) pairs.
void ReduceItems(uint64_t n, const GroupLayout& groups, uint64_t* len, uint64_t* segs,
                 uint64_t* items) {
  *len = groups.group_len == 0 ? n : groups.group_len;
  const uint64_t num = groups.group_len == 0 ? 1 : CEIL_DIV(n, groups.group_len);
  *segs = CEIL_DIV(*len, kReduceSegment);
  *items = num * *segs;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers

size_t ScaleReduceBytes(ScaleKind kind, size_t num_groups) {
  return kind == ScaleKind::kUintGrid
             ? num_groups * (sizeof(unsigned long long) + sizeof(uint32_t))  // lo_keys, hi_ord
             : num_groups * sizeof(uint32_t);                                // max_bits
}

CudaResult LaunchScalesFromData(const float* in, size_t n, GroupLayout groups,
                                const ScaleRule& rule, ScaleScratch scratch, ScaleOutput out,
                                void* stream) {
  CPD_LAUNCH_REQUIRE(n == 0 || in != nullptr, "null buffer");
  CPD_LAUNCH_REQUIRE(scratch.reduce != nullptr && scratch.ticket != nullptr,
                     "scale reductions need their zeroed scratch and ticket");
  CPD_LAUNCH_REQUIRE((reinterpret_cast<uintptr_t>(scratch.reduce) & 7u) == 0,
                     "the reduction scratch must be 8-byte aligned");
  CPD_LAUNCH_REQUIRE(groups.num_groups >= 1, "no group");
  CPD_LAUNCH_REQUIRE(groups.group_len == 0 || groups.num_groups >= CEIL_DIV(n, groups.group_len),
                     "fewer groups than the span needs");
  const bool shifts = rule.kind == ScaleKind::kShift;
  CPD_LAUNCH_REQUIRE(shifts ? out.shifts != nullptr : out.grids != nullptr, "no output");
  ScaleJob job{};
  job.kind = rule.kind;
  job.shift = rule.shift;
  job.num_groups = groups.num_groups;
  job.out = out;
  const uint64_t num = groups.num_groups;
  if (rule.kind == ScaleKind::kUintGrid) {
    CPD_LAUNCH_REQUIRE(rule.bits >= 1 && rule.bits <= 30, "uint<b> needs 1 <= b <= 30");
    job.qmax = (1 << rule.bits) - 1;
    job.lo_keys = static_cast<unsigned long long*>(scratch.reduce);
    job.hi_ord = reinterpret_cast<uint32_t*>(job.lo_keys + num);
  } else {
    if (rule.kind == ScaleKind::kIntGrid) {
      CPD_LAUNCH_REQUIRE(rule.bits >= 2 && rule.bits <= 31, "int<b> needs 2 <= b <= 31");
      job.qmax = (1 << (rule.bits - 1)) - 1;
    }
    job.max_bits = static_cast<uint32_t*>(scratch.reduce);
  }
  const bool derive_here = num <= kLastBlockGroups;
  job.ticket = derive_here ? scratch.ticket : nullptr;
  const cudaStream_t s = AsStream(stream);
  int blocks = 0;
  if (groups.group_len == 0 || n <= groups.group_len) {  // one group touched (n == 0 too)
    uint64_t head = 0, nvec = 0;
    VectorSplit(in, in, n, &head, &nvec);
    const uint64_t work = CEIL_DIV(nvec, uint64_t(kUnroll)) + (n - 4 * nvec);
    if (rule.kind == ScaleKind::kUintGrid) {
      const bool chunked = rule.chunked;
      CudaResult r = GridBlocks<min_max_one_group_kernel>(work, kThreads, false, &blocks);
      if (!r.ok()) return r;
      min_max_one_group_kernel<<<blocks, kThreads, 0, s>>>(in, n, head, nvec, chunked, job);
    } else {
      CudaResult r = GridBlocks<max_abs_one_group_kernel>(work, kThreads, false, &blocks);
      if (!r.ok()) return r;
      max_abs_one_group_kernel<<<blocks, kThreads, 0, s>>>(in, n, head, nvec, job);
    }
  } else {
    uint64_t len = 0, segs = 0, items = 0;
    ReduceItems(n, groups, &len, &segs, &items);
    if (rule.kind == ScaleKind::kUintGrid) {
      CudaResult r = GridBlocks<min_max_groups_kernel>(items, kWarpsPerBlock, false, &blocks);
      if (!r.ok()) return r;
      min_max_groups_kernel<<<blocks, kThreads, 0, s>>>(in, n, len, segs, items, rule.chunked, job);
    } else {
      CudaResult r = GridBlocks<max_abs_groups_kernel>(items, kWarpsPerBlock, false, &blocks);
      if (!r.ok()) return r;
      max_abs_groups_kernel<<<blocks, kThreads, 0, s>>>(in, n, len, segs, items, job);
    }
  }
  CPD_CUDA_CHECK(cudaGetLastError());
  if (derive_here) return CudaResult{};
  const uint64_t derive_blocks = CEIL_DIV(num, uint64_t(kThreads));
  CPD_LAUNCH_REQUIRE(derive_blocks <= 0x7fffffffu, "too many groups");
  derive_scales_kernel<<<unsigned(derive_blocks), kThreads, 0, s>>>(job);
  CPD_CUDA_CHECK(cudaGetLastError());
  return CudaResult{};
}

CudaResult LaunchQuantizeFloatGrid(const float* in, float* out, size_t n, const FloatGrid& g,
                                   const int32_t* shifts, GroupLayout groups, RoundMode mode,
                                   RandomParams rng, StatsTarget stats, void* stream) {
  CudaResult r = CheckGroups(n, groups, shifts != nullptr);
  if (!r.ok()) return r;
  if (shifts == nullptr) {
    return DispatchMode<FixedFloatGridOp>(mode, in, out, n, stats, AsStream(stream),
                                          StochasticGridConsts(g), rng.key, rng.index_base);
  }
  return DispatchMode<FloatGridOp>(mode, in, out, n, stats, AsStream(stream),
                                   StochasticGridConsts(g), shifts, groups.group_len, rng.key,
                                   rng.index_base, 0.0f, 0.0f);
}

CudaResult LaunchQuantizeLinearGrid(const float* in, float* out, size_t n, const LinearGrid* grids,
                                    GroupLayout groups, RoundMode mode, RandomParams rng,
                                    StatsTarget stats, void* stream) {
  CPD_LAUNCH_REQUIRE(n == 0 || grids != nullptr, "linear grids are required");
  CudaResult r = CheckGroups(n, groups, true);
  if (!r.ok()) return r;
  return DispatchMode<LinearGridOp>(mode, in, out, n, stats, AsStream(stream), grids,
                                    groups.group_len, rng.key, rng.index_base, LinearGrid{});
}

bool FusedBlockSupported(size_t block_size) {
  return block_size >= 4 && block_size <= 128 && (block_size & (block_size - 1)) == 0;
}

CudaResult LaunchQuantizeFloatBlocksFused(const float* in, float* out, size_t n, const FloatGrid& g,
                                          ShiftRule rule, size_t block_size, RoundMode mode,
                                          RandomParams rng, StatsTarget stats, void* stream) {
  if (n == 0) return CudaResult{};
  CPD_LAUNCH_REQUIRE(in != nullptr && out != nullptr, "null buffer");
  CPD_LAUNCH_REQUIRE(FusedBlockSupported(block_size),
                     "fused block quantisation needs a power-of-two block of 4..128");
  CPD_LAUNCH_REQUIRE(
      (reinterpret_cast<uintptr_t>(in) & 3u) == 0 && (reinterpret_cast<uintptr_t>(out) & 3u) == 0,
      "buffers must be 4-byte aligned");
  CudaResult checked = CheckStats(stats);
  if (!checked.ok()) return checked;
  const int lanes = int(block_size / 4);
  const cudaStream_t s = AsStream(stream);
  switch (mode) {
    case RoundMode::kNearestEven:
      return LaunchFused<RoundMode::kNearestEven>(in, out, n, g, rule, lanes, rng, stats, s);
    case RoundMode::kStochastic:
      return LaunchFused<RoundMode::kStochastic>(in, out, n, g, rule, lanes, rng, stats, s);
    case RoundMode::kTowardZero:
      return LaunchFused<RoundMode::kTowardZero>(in, out, n, g, rule, lanes, rng, stats, s);
    default:
      break;
  }
  CPD_LAUNCH_REQUIRE(false, "rounding mode must be nearest-even, stochastic or toward zero");
  return CudaResult{};
}

CudaResult LaunchHysteresisFloatGrid(const float* w, const float* prev, float* q, float* keep,
                                     size_t n, const FloatGrid& g, const int32_t* shifts,
                                     GroupLayout groups, StatsTarget stats, void* stream) {
  CudaResult r = CheckGroups(n, groups, shifts != nullptr);
  if (!r.ok()) return r;
  return LaunchElementwise(FloatHysteresisOp{g, shifts, groups.group_len, 0}, w, q, n, stats,
                           AsStream(stream), prev, keep);
}

CudaResult LaunchHysteresisLinearGrid(const float* w, const float* prev, float* q, float* keep,
                                      size_t n, const LinearGrid* grids, GroupLayout groups,
                                      StatsTarget stats, void* stream) {
  CPD_LAUNCH_REQUIRE(n == 0 || grids != nullptr, "linear grids are required");
  CudaResult r = CheckGroups(n, groups, true);
  if (!r.ok()) return r;
  return LaunchElementwise(LinearHysteresisOp{grids, groups.group_len, LinearGrid{}}, w, q, n,
                           stats, AsStream(stream), prev, keep);
}

size_t BlockScaleReduceBytes(size_t num_blocks) { return (num_blocks + 1) * sizeof(uint32_t); }

CudaResult LaunchBlockScalesFromData(const float* in, size_t n, const MatrixBlocks& blocks,
                                     const BlockScaleRule& rule, ScaleScratch scratch,
                                     BlockScale* scales, float* tensor_enc, uint8_t* meta,
                                     void* stream) {
  CPD_LAUNCH_REQUIRE(n == 0 || in != nullptr, "null buffer");
  CPD_LAUNCH_REQUIRE(scratch.reduce != nullptr && scratch.ticket != nullptr,
                     "scale reductions need their zeroed scratch and ticket");
  CPD_LAUNCH_REQUIRE(blocks.num_blocks == 0 || scales != nullptr, "no output");
  CPD_LAUNCH_REQUIRE(!rule.tensor_level || tensor_enc != nullptr, "no tensor level output");
  CPD_LAUNCH_REQUIRE(n == 0 || (blocks.cols > 0 && n % blocks.cols == 0 &&
                                blocks.rows_per_block > 0 && blocks.cols_per_block > 0),
                     "the span must be whole rows of the matrix");
  CPD_LAUNCH_REQUIRE(rule.meta_bytes >= 1 && rule.meta_bytes <= 4, "metadata of 1 to 4 bytes");
  BlockScaleJob job{};
  job.rule = rule;
  job.blocks = blocks;
  job.amax_bits = static_cast<uint32_t*>(scratch.reduce);
  job.tensor_bits = job.amax_bits + blocks.num_blocks;
  job.scales = scales;
  job.tensor_enc = tensor_enc;
  job.meta = meta;
  job.derive_here = blocks.num_blocks <= kLastBlockGroups;
  job.ticket = job.derive_here || rule.tensor_level ? scratch.ticket : nullptr;
  const cudaStream_t s = AsStream(stream);
  const uint64_t chunks = CEIL_DIV(uint64_t(n), uint64_t(32));
  int grid = 0;
  CudaResult r = GridBlocks<block_max_abs_kernel>(CEIL_DIV(chunks, uint64_t(kUnroll)),
                                                  kWarpsPerBlock, false, &grid);
  if (!r.ok()) return r;
  block_max_abs_kernel<<<grid, kThreads, 0, s>>>(in, n, job);
  CPD_CUDA_CHECK(cudaGetLastError());
  if (job.derive_here) return CudaResult{};
  const uint64_t derive_blocks = CEIL_DIV(blocks.num_blocks, uint64_t(kThreads));
  CPD_LAUNCH_REQUIRE(derive_blocks <= 0x7fffffffu, "too many blocks");
  derive_block_scales_kernel<<<unsigned(derive_blocks), kThreads, 0, s>>>(job);
  CPD_CUDA_CHECK(cudaGetLastError());
  return CudaResult{};
}

CudaResult LaunchQuantizeBlockScaled(const float* in, float* out, size_t n, const FloatGrid& g,
                                     const BlockScale* scales, const MatrixBlocks& blocks,
                                     RoundMode mode, RandomParams rng, StatsTarget stats,
                                     void* stream) {
  CPD_LAUNCH_REQUIRE(n == 0 || scales != nullptr, "block scales are required");
  return DispatchMode<BlockScaledOp>(mode, in, out, n, stats, AsStream(stream), g, scales, blocks,
                                     rng.key, rng.index_base);
}

CudaResult LaunchHysteresisBlockScaled(const float* w, const float* prev, float* q, float* keep,
                                       size_t n, const FloatGrid& g, const BlockScale* scales,
                                       const MatrixBlocks& blocks, StatsTarget stats,
                                       void* stream) {
  CPD_LAUNCH_REQUIRE(n == 0 || scales != nullptr, "block scales are required");
  return LaunchElementwise(BlockScaledHysteresisOp{g, scales, blocks}, w, q, n, stats,
                           AsStream(stream), prev, keep);
}

CudaResult LaunchStoreBinadeGrid(const BinadeGrid& g, BinadeGrid* d_grid, void* stream) {
  CPD_LAUNCH_REQUIRE(d_grid != nullptr, "null buffer");
  store_binade_grid_kernel<<<1, 1, 0, AsStream(stream)>>>(g, d_grid);
  CPD_CUDA_CHECK(cudaGetLastError());
  return CudaResult{};
}

CudaResult LaunchQuantizeBinadeGrid(const float* in, float* out, size_t n, const BinadeGrid* d_grid,
                                    const int32_t* shifts, GroupLayout groups, RoundMode mode,
                                    RandomParams rng, StatsTarget stats, void* stream) {
  CPD_LAUNCH_REQUIRE(n == 0 || (d_grid != nullptr && shifts != nullptr),
                     "binade grids need the grid and the shifts");
  CudaResult r = CheckGroups(n, groups, true);
  if (!r.ok()) return r;
  return DispatchMode<BinadeGridOp>(mode, in, out, n, stats, AsStream(stream), d_grid, shifts,
                                    groups.group_len, rng.key, rng.index_base, 0.0f, 0.0f);
}

CudaResult LaunchHysteresisBinadeGrid(const float* w, const float* prev, float* q, float* keep,
                                      size_t n, const BinadeGrid* d_grid, const int32_t* shifts,
                                      GroupLayout groups, StatsTarget stats, void* stream) {
  CPD_LAUNCH_REQUIRE(n == 0 || (d_grid != nullptr && shifts != nullptr),
                     "binade grids need the grid and the shifts");
  CudaResult r = CheckGroups(n, groups, true);
  if (!r.ok()) return r;
  return LaunchElementwise(BinadeHysteresisOp{d_grid, shifts, groups.group_len, 0}, w, q, n, stats,
                           AsStream(stream), prev, keep);
}

CudaResult LaunchCountChangedBits(const float* a, const float* b, size_t n, float* copy_to,
                                  unsigned long long* count, void* stream) {
  if (n == 0) return CudaResult{};
  CPD_LAUNCH_REQUIRE(a != nullptr && b != nullptr && count != nullptr, "null buffer");
  CPD_LAUNCH_REQUIRE(copy_to == nullptr || copy_to + n <= b || b + n <= copy_to,
                     "the copy must not overlap its source");
  int blocks = 0;
  CudaResult r = GridBlocks<count_changed_bits_kernel>(n, kThreads, false, &blocks);
  if (!r.ok()) return r;
  count_changed_bits_kernel<<<blocks, kThreads, 0, AsStream(stream)>>>(a, b, n, copy_to, count);
  CPD_CUDA_CHECK(cudaGetLastError());
  return CudaResult{};
}

}  // namespace cpd::kernels::cuda
