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
//  * stochastic rounding draws RandomBits(key, index_base + i) for element i, as the CPU does;
//  * x * 2^-s and z * 2^s are single multiplications by powers of two; a NaN result is stored
//    with the bits the CPU's x86 multiply would keep (the GPU would canonicalise its payload).
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
  FloatGrid g;
  const int32_t* shifts;
  uint64_t group_len;
  int32_t shift0;

  __device__ __forceinline__ void Init() { shift0 = shifts != nullptr ? shifts[0] : 0; }
  __device__ __forceinline__ float Apply(float x, float prev, uint64_t i, uint32_t* /*code*/,
                                         GridRange* range) const {
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
  const BinadeGrid* g;
  const int32_t* shifts;
  uint64_t group_len;
  int32_t shift0;

  __device__ __forceinline__ void Init() { shift0 = shifts[0]; }
  __device__ __forceinline__ float Apply(float x, float prev, uint64_t i, uint32_t* /*code*/,
                                         GridRange* range) const {
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
  const LinearGrid* grids;
  uint64_t group_len;
  LinearGrid grid0;

  __device__ __forceinline__ void Init() { grid0 = grids[0]; }
  __device__ __forceinline__ float Apply(float x, float prev, uint64_t i, uint32_t* /*code*/,
                                         GridRange* range) const {
    const LinearGrid lg = group_len == 0 ? grid0 : grids[GroupOf(i, group_len)];
    if (range != nullptr) *range = LinearGridRange(lg);
    return x < prev ? RoundToLinearGrid<RoundMode::kUp>(x, lg, 0u, nullptr)
                    : RoundToLinearGrid<RoundMode::kDown>(x, lg, 0u, nullptr);
  }
};

template <class Op, bool kStats>
__device__ __forceinline__ float ApplyOne(const Op& op, float x, float prev, uint64_t i,
                                          Acc<kStats>& acc) {
  GridRange range;
  const float z = op.Apply(x, prev, i, /*code=*/nullptr, kStats ? &range : nullptr);
  if constexpr (kStats) {
    acc.Add(x, z, range);
    if (Op::kReadsOut) acc.Flip(FloatBits(z) != FloatBits(prev));
  }
  return z;
}

template <class Op, bool kStats>
__device__ __forceinline__ float4 ApplyFour(const Op& op, float4 x, float4 p, uint64_t i,
                                            Acc<kStats>& acc) {
  float4 z;
  z.x = ApplyOne<Op, kStats>(op, x.x, p.x, i, acc);
  z.y = ApplyOne<Op, kStats>(op, x.y, p.y, i + 1, acc);
  z.z = ApplyOne<Op, kStats>(op, x.z, p.z, i + 2, acc);
  z.w = ApplyOne<Op, kStats>(op, x.w, p.w, i + 3, acc);
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

// Max of |finite x| per group. One warp per work item (a segment of at most kReduceSegment
// elements of one group), grid-stride over work items; one atomicMax per work item.
__global__ void __launch_bounds__(kThreads)
    group_max_abs_kernel(const float* in, uint64_t n, uint64_t group_len, uint64_t segs_per_group,
                         uint64_t items, uint32_t* max_bits) {
  const int lane = threadIdx.x % 32;
  const uint64_t warp = (uint64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const uint64_t warps = uint64_t(gridDim.x) * blockDim.x / 32;
  for (uint64_t w = warp; w < items; w += warps) {
    const Segment sg = SegmentOf(w, n, group_len, segs_per_group);
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
    uint32_t m = m0 > m1 ? m0 : m1;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const uint32_t o = __shfl_xor_sync(kFullMask, m, off);
      m = o > m ? o : m;
    }
    if (lane == 0 && m != 0) atomicMax(&max_bits[g], m);
  }
}

// Finite min (with the CPU's choice of zero) and max per group; same work split as above.
// lo key: OrderedBits(min, zeros as +0) << 32 | (for a zero: chunk << 1 | 1 for +0, 0 for -0).
// A segment never straddles a 65536-element chunk (kReduceSegment divides 65536).
__global__ void __launch_bounds__(kThreads)
    group_min_max_kernel(const float* in, uint64_t n, uint64_t group_len, uint64_t segs_per_group,
                         uint64_t items, bool chunked, unsigned long long* lo_keys,
                         uint32_t* hi_ord) {
  const int lane = threadIdx.x % 32;
  const uint64_t warp = (uint64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const uint64_t warps = uint64_t(gridDim.x) * blockDim.x / 32;
  for (uint64_t w = warp; w < items; w += warps) {
    const Segment sg = SegmentOf(w, n, group_len, segs_per_group);
    const uint64_t g = sg.group, begin = sg.begin, end = sg.end;
    unsigned long long lo = ~0ull;
    uint32_t hi = 0;
    // kernels::MinMaxFinite orders -0 below +0 within a span; the CPU combines chunks with
    // std::min, which keeps the earlier chunk on a tie. So among zeros, the earliest chunk
    // wins, and within it -0 wins.
    const uint64_t chunk = chunked ? (begin - g * group_len) >> 16 : 0;
    const unsigned long long zero_rank = (chunk < 0x7fffffffu ? chunk : 0x7fffffffu) << 1;
    for (uint64_t i = begin + lane; i < end; i += 32) {
      uint32_t u = FloatBits(in[i]);
      if ((u & 0x7fffffffu) >= 0x7f800000u) continue;  // NaN and Inf are ignored
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
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const unsigned long long ol = __shfl_xor_sync(kFullMask, lo, off);
      const uint32_t oh = __shfl_xor_sync(kFullMask, hi, off);
      lo = ol < lo ? ol : lo;
      hi = oh > hi ? oh : hi;
    }
    if (lane == 0 && hi != 0) {
      atomicMin(&lo_keys[g], lo);
      atomicMax(&hi_ord[g], hi);
    }
  }
}

__global__ void shifts_from_max_abs_kernel(const uint32_t* max_bits, uint64_t num, ShiftRule rule,
                                           int32_t* shifts) {
  const uint64_t g = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g < num) shifts[g] = ShiftForMax(BitsFloat(max_bits[g]), rule);
}

// int<b>: SymmetricIntGrid (grid.h), as cpd/quantize.cc.
__global__ void int_grids_from_max_abs_kernel(const uint32_t* max_bits, uint64_t num, int qmax,
                                              LinearGrid* grids) {
  const uint64_t g = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= num) return;
  grids[g] = SymmetricIntGrid(BitsFloat(max_bits[g]), qmax);
}

// uint<b>:minmax: MinMaxGrid (grid.h), as cpd/quantize.cc.
__global__ void uint_grids_from_min_max_kernel(const unsigned long long* lo_keys,
                                               const uint32_t* hi_ord, uint64_t num, int qmax,
                                               LinearGrid* grids) {
  const uint64_t g = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= num) return;
  const unsigned long long key = lo_keys[g];
  float lo = INFINITY, hi = -INFINITY;  // no finite element
  if (key != ~0ull) {
    lo = BitsFloat(UnorderedBits(uint32_t(key >> 32)));
    if (lo == 0.0f) lo = (key & 1u) != 0 ? 0.0f : -0.0f;  // the zero the CPU picks
    hi = BitsFloat(UnorderedBits(hi_ord[g]));
  }
  grids[g] = MinMaxGrid(lo, hi, qmax);
}

// The element-wise pass. [0, head) and [head + 4 * nvec, n) are done element by element;
// the middle as 16-byte vectors (in + head and out + head are 16-byte aligned), kUnroll
// independent loads per thread before any store. in and out may alias: every element is read
// and then written by the same thread only.
template <class Op, bool kStats>
__global__ void __launch_bounds__(kThreads)
    quantize_elementwise_kernel(const Op op, const float* in, float* out, uint64_t n, uint64_t head,
                                uint64_t nvec, DeviceStats* partials) {
  Op o = op;
  o.Init();
  Acc<kStats> acc;
  const uint64_t tid = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = tid; i < head; i += stride) {
    const float prev = Op::kReadsOut ? out[i] : 0.0f;
    out[i] = ApplyOne<Op, kStats>(o, in[i], prev, i, acc);
  }
  const float4* in4 = reinterpret_cast<const float4*>(in + head);
  float4* out4 = reinterpret_cast<float4*>(out + head);
  for (uint64_t v0 = tid; v0 < nvec; v0 += kUnroll * stride) {
    float4 x[kUnroll], p[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t v = v0 + u * stride;
      if (v < nvec) {
        x[u] = in4[v];
        if (Op::kReadsOut) p[u] = out4[v];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t v = v0 + u * stride;
      if (v < nvec) {
        if (!Op::kReadsOut) p[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        out4[v] = ApplyFour<Op, kStats>(o, x[u], p[u], head + 4 * v, acc);
      }
    }
  }
  for (uint64_t i = head + 4 * nvec + tid; i < n; i += stride) {
    const float prev = Op::kReadsOut ? out[i] : 0.0f;
    out[i] = ApplyOne<Op, kStats>(o, in[i], prev, i, acc);
  }
  if constexpr (kStats) BlockStatsToPartial(acc, partials);
}

// Block formats in one pass (block_size = 4 * lanes_per_block, a power of two <= 128). A warp
// takes 128 consecutive elements (a tile), 4 per lane; a block is lanes_per_block adjacent
// lanes, whose max is found by xor shuffles, so the shift is known without a second read.
// Tiles are distributed grid-stride over warps (warp-uniform, so every shuffle is full).
template <RoundMode kMode, bool kStats>
__global__ void __launch_bounds__(kThreads)
    quantize_blocks_fused_kernel(const float* in, float* out, uint64_t n, const FloatGrid g,
                                 ShiftRule rule, int lanes_per_block, bool vec_in, bool vec_out,
                                 uint64_t key, uint64_t index_base, DeviceStats* partials) {
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
      const uint32_t a0 = FiniteAbsBits(x[u].x), a1 = FiniteAbsBits(x[u].y);
      const uint32_t a2 = FiniteAbsBits(x[u].z), a3 = FiniteAbsBits(x[u].w);
      uint32_t m = a0 > a1 ? a0 : a1;
      m = a2 > m ? a2 : m;
      m = a3 > m ? a3 : m;
      for (int off = lanes_per_block / 2; off > 0; off >>= 1) {
        const uint32_t other = __shfl_xor_sync(kFullMask, m, off);
        m = other > m ? other : m;
      }
      const int32_t s = ShiftForMax(BitsFloat(m), rule);
      const float down = Pow2(-s), up = Pow2(s);
      float z[4];
      const float xs[4] = {x[u].x, x[u].y, x[u].z, x[u].w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const uint64_t i = e + c;
        const uint32_t rnd = kMode == RoundMode::kStochastic ? RandomBits(key, index_base + i) : 0u;
        const uint32_t zb = RoundToFloatGrid<kMode>(__fmul_rn(xs[c], down), g, rnd, nullptr);
        z[c] = ScaleBack(zb, up);
        if constexpr (kStats) {
          if (i < n) acc.Add(xs[c], z[c], ShiftedGridRange(g.max_bits, up));
        }
      }
      if (vec_out && e + 4 <= n) {
        *reinterpret_cast<float4*>(out + e) = make_float4(z[0], z[1], z[2], z[3]);
      } else {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          if (e + c < n) out[e + c] = z[c];
        }
      }
    }
  }
  if constexpr (kStats) BlockStatsToPartial(acc, partials);
}

// One thread copies the grid from the kernel's parameter space to device memory.
__global__ void store_binade_grid_kernel(const BinadeGrid g, BinadeGrid* dst) { *dst = g; }

// Delivers the per-block partials of a launch (DeliverStats). One warp.
__global__ void stats_finalize_kernel(const DeviceStats* partials, int blocks, uint64_t count,
                                      StatsSinks sinks) {
  DeliverStats(partials, blocks, count, sinks);
}

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

template <class Op>
CudaResult LaunchElementwise(const Op& op, const float* in, float* out, uint64_t n,
                             const StatsTarget& stats, cudaStream_t stream) {
  if (n == 0) return CudaResult{};
  CPD_LAUNCH_REQUIRE(in != nullptr && out != nullptr, "null buffer");
  CPD_LAUNCH_REQUIRE(!stats.wanted() || stats.scratch != nullptr,
                     "statistics need a scratch buffer");
  uint64_t head = 0, nvec = 0;
  VectorSplit(in, out, n, &head, &nvec);
  // Work in threads: each handles kUnroll vectors, or one element outside the vector part.
  const uint64_t work = CEIL_DIV(nvec, uint64_t(kUnroll)) + (n - 4 * nvec);
  int blocks = 0;
  if (stats.wanted()) {
    CudaResult r = GridBlocks<quantize_elementwise_kernel<Op, true>>(work, kThreads, true, &blocks);
    if (!r.ok()) return r;
    quantize_elementwise_kernel<Op, true>
        <<<blocks, kThreads, 0, stream>>>(op, in, out, n, head, nvec, stats.scratch);
    CPD_CUDA_CHECK(cudaGetLastError());
    return FinalizeStats(stats, blocks, n, stream);
  }
  CudaResult r = GridBlocks<quantize_elementwise_kernel<Op, false>>(work, kThreads, false, &blocks);
  if (!r.ok()) return r;
  quantize_elementwise_kernel<Op, false>
      <<<blocks, kThreads, 0, stream>>>(op, in, out, n, head, nvec, nullptr);
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
        <<<blocks, kThreads, 0, stream>>>(in, out, n, g, rule, lanes_per_block, vec_in, vec_out,
                                          rng.key, rng.index_base, stats.scratch);
    CPD_CUDA_CHECK(cudaGetLastError());
    return FinalizeStats(stats, blocks, n, stream);
  }
  CudaResult r =
      GridBlocks<quantize_blocks_fused_kernel<kMode, false>>(work, kWarpsPerBlock, false, &blocks);
  if (!r.ok()) return r;
  quantize_blocks_fused_kernel<kMode, false><<<blocks, kThreads, 0, stream>>>(
      in, out, n, g, rule, lanes_per_block, vec_in, vec_out, rng.key, rng.index_base, nullptr);
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

CudaResult FinalizeStats(const StatsTarget& stats, int blocks, uint64_t count,
                         cudaStream_t stream) {
  stats_finalize_kernel<<<1, 32, 0, stream>>>(stats.scratch, blocks, count, SinksOf(stats));
  CPD_CUDA_CHECK(cudaGetLastError());
  return CudaResult{};
}

// ---------------------------------------------------------------------------------------------
// Launchers

CudaResult LaunchGroupMaxAbs(const float* in, size_t n, GroupLayout groups, uint32_t* max_bits,
                             void* stream) {
  if (n == 0) return CudaResult{};
  CPD_LAUNCH_REQUIRE(in != nullptr && max_bits != nullptr, "null buffer");
  CPD_LAUNCH_REQUIRE(groups.group_len == 0 || groups.num_groups >= CEIL_DIV(n, groups.group_len),
                     "fewer groups than the span needs");
  uint64_t len = 0, segs = 0, items = 0;
  ReduceItems(n, groups, &len, &segs, &items);
  int blocks = 0;
  CudaResult r = GridBlocks<group_max_abs_kernel>(items, kWarpsPerBlock, false, &blocks);
  if (!r.ok()) return r;
  group_max_abs_kernel<<<blocks, kThreads, 0, AsStream(stream)>>>(in, n, len, segs, items,
                                                                  max_bits);
  CPD_CUDA_CHECK(cudaGetLastError());
  return CudaResult{};
}

CudaResult LaunchGroupMinMax(const float* in, size_t n, GroupLayout groups, bool chunked,
                             uint64_t* lo_keys, uint32_t* hi_ord, void* stream) {
  if (n == 0) return CudaResult{};
  CPD_LAUNCH_REQUIRE(in != nullptr && lo_keys != nullptr && hi_ord != nullptr, "null buffer");
  CPD_LAUNCH_REQUIRE(groups.group_len == 0 || groups.num_groups >= CEIL_DIV(n, groups.group_len),
                     "fewer groups than the span needs");
  uint64_t len = 0, segs = 0, items = 0;
  ReduceItems(n, groups, &len, &segs, &items);
  int blocks = 0;
  CudaResult r = GridBlocks<group_min_max_kernel>(items, kWarpsPerBlock, false, &blocks);
  if (!r.ok()) return r;
  static_assert(sizeof(unsigned long long) == sizeof(uint64_t));
  group_min_max_kernel<<<blocks, kThreads, 0, AsStream(stream)>>>(
      in, n, len, segs, items, chunked, reinterpret_cast<unsigned long long*>(lo_keys), hi_ord);
  CPD_CUDA_CHECK(cudaGetLastError());
  return CudaResult{};
}

CudaResult LaunchShiftsFromMaxAbs(const uint32_t* max_bits, size_t num_groups, ShiftRule rule,
                                  int32_t* shifts, void* stream) {
  if (num_groups == 0) return CudaResult{};
  CPD_LAUNCH_REQUIRE(max_bits != nullptr && shifts != nullptr, "null buffer");
  const uint64_t blocks = CEIL_DIV(uint64_t(num_groups), uint64_t(kThreads));
  CPD_LAUNCH_REQUIRE(blocks <= 0x7fffffffu, "too many groups");
  shifts_from_max_abs_kernel<<<unsigned(blocks), kThreads, 0, AsStream(stream)>>>(
      max_bits, num_groups, rule, shifts);
  CPD_CUDA_CHECK(cudaGetLastError());
  return CudaResult{};
}

CudaResult LaunchIntGridsFromMaxAbs(const uint32_t* max_bits, size_t num_groups, int bits,
                                    LinearGrid* grids, void* stream) {
  if (num_groups == 0) return CudaResult{};
  CPD_LAUNCH_REQUIRE(max_bits != nullptr && grids != nullptr, "null buffer");
  CPD_LAUNCH_REQUIRE(bits >= 2 && bits <= 31, "int<b> needs 2 <= b <= 31");
  const uint64_t blocks = CEIL_DIV(uint64_t(num_groups), uint64_t(kThreads));
  CPD_LAUNCH_REQUIRE(blocks <= 0x7fffffffu, "too many groups");
  int_grids_from_max_abs_kernel<<<unsigned(blocks), kThreads, 0, AsStream(stream)>>>(
      max_bits, num_groups, (1 << (bits - 1)) - 1, grids);
  CPD_CUDA_CHECK(cudaGetLastError());
  return CudaResult{};
}

CudaResult LaunchUintGridsFromMinMax(const uint64_t* lo_keys, const uint32_t* hi_ord,
                                     size_t num_groups, int bits, LinearGrid* grids, void* stream) {
  if (num_groups == 0) return CudaResult{};
  CPD_LAUNCH_REQUIRE(lo_keys != nullptr && hi_ord != nullptr && grids != nullptr, "null buffer");
  CPD_LAUNCH_REQUIRE(bits >= 1 && bits <= 30, "uint<b> needs 1 <= b <= 30");
  const uint64_t blocks = CEIL_DIV(uint64_t(num_groups), uint64_t(kThreads));
  CPD_LAUNCH_REQUIRE(blocks <= 0x7fffffffu, "too many groups");
  uint_grids_from_min_max_kernel<<<unsigned(blocks), kThreads, 0, AsStream(stream)>>>(
      reinterpret_cast<const unsigned long long*>(lo_keys), hi_ord, num_groups, (1 << bits) - 1,
      grids);
  CPD_CUDA_CHECK(cudaGetLastError());
  return CudaResult{};
}

CudaResult LaunchQuantizeFloatGrid(const float* in, float* out, size_t n, const FloatGrid& g,
                                   const int32_t* shifts, GroupLayout groups, RoundMode mode,
                                   RandomParams rng, StatsTarget stats, void* stream) {
  CudaResult r = CheckGroups(n, groups, shifts != nullptr);
  if (!r.ok()) return r;
  if (shifts == nullptr) {
    return DispatchMode<FixedFloatGridOp>(mode, in, out, n, stats, AsStream(stream), g, rng.key,
                                          rng.index_base);
  }
  return DispatchMode<FloatGridOp>(mode, in, out, n, stats, AsStream(stream), g, shifts,
                                   groups.group_len, rng.key, rng.index_base, 0.0f, 0.0f);
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
  CPD_LAUNCH_REQUIRE(!stats.wanted() || stats.scratch != nullptr,
                     "statistics need a scratch buffer");
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

CudaResult LaunchHysteresisFloatGrid(const float* w, float* q, size_t n, const FloatGrid& g,
                                     const int32_t* shifts, GroupLayout groups, StatsTarget stats,
                                     void* stream) {
  CudaResult r = CheckGroups(n, groups, shifts != nullptr);
  if (!r.ok()) return r;
  return LaunchElementwise(FloatHysteresisOp{g, shifts, groups.group_len, 0}, w, q, n, stats,
                           AsStream(stream));
}

CudaResult LaunchHysteresisLinearGrid(const float* w, float* q, size_t n, const LinearGrid* grids,
                                      GroupLayout groups, StatsTarget stats, void* stream) {
  CPD_LAUNCH_REQUIRE(n == 0 || grids != nullptr, "linear grids are required");
  CudaResult r = CheckGroups(n, groups, true);
  if (!r.ok()) return r;
  return LaunchElementwise(LinearHysteresisOp{grids, groups.group_len, LinearGrid{}}, w, q, n,
                           stats, AsStream(stream));
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

CudaResult LaunchHysteresisBinadeGrid(const float* w, float* q, size_t n, const BinadeGrid* d_grid,
                                      const int32_t* shifts, GroupLayout groups, StatsTarget stats,
                                      void* stream) {
  CPD_LAUNCH_REQUIRE(n == 0 || (d_grid != nullptr && shifts != nullptr),
                     "binade grids need the grid and the shifts");
  CudaResult r = CheckGroups(n, groups, true);
  if (!r.ok()) return r;
  return LaunchElementwise(BinadeHysteresisOp{d_grid, shifts, groups.group_len, 0}, w, q, n, stats,
                           AsStream(stream));
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
