// CUDA kernels of the codec (see kernels/cuda/codec.h). Layout as quantize.cu: helpers, kernels
// (names end in _kernel), launchers.
//
// Bit-exactness with the CPU codec (cpd/quantize.cc Encode/Decode, PackCodes/UnpackCodes):
//  * codes come from the quantiser's element operations (common.cuh), i.e. from
//    kernels::RoundToFloatGrid / RoundToBinadeGrid / RoundToLinearGrid, as the CPU loops do;
//  * decoding is kernels::DecodeFloatGrid / DecodeBinadeGrid / LinearValue, and the product by
//    2^shift keeps the decoded NaN's bits as the CPU's x86 multiply does (ScaleBack; ScaledValue
//    under a block scale);
//  * the bit order is PackCodes': code i at bits [i*bits, (i+1)*bits), little-endian, codes
//    masked to `bits`, the last byte's spare bits zero;
//  * scale metadata is written and read with grid.h's ShiftMetaByte / StoreLinearMeta /
//    StoreFloatMeta / StoreCodeMeta and their inverses, the CPU codec's own helpers.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/codec.h"
#include "kernels/cuda/common.cuh"
#include "kernels/pack.h"

namespace cpd::kernels::cuda {

namespace {

// ---------------------------------------------------------------------------------------------
// Decode operations: the value of global element i with code `code`. Init(table) runs once in
// every thread, all threads of the block together: it caches the scale of a single-group span
// and fills the op's table (kTableSize entries of the kernel's shared memory) if it has one.

// Codes of at most 8 bits: a 256-entry table of DecodeFloatGrid's bits in shared memory, filled
// by each block, so an element costs one shared load where the grid's style branches and a
// subnormal code's conversion and multiply took about 20 integer instructions. All threads of
// the block.
__device__ __forceinline__ const uint32_t* FillDecodeTable(const FloatGrid& g, uint32_t* shared) {
  for (uint32_t c = threadIdx.x; c < 256u; c += blockDim.x) {
    shared[c] = FloatBits(DecodeFloatGrid(c, g));
  }
  __syncthreads();
  return shared;
}

// kTable: codes of at most 8 bits, decoded through FillDecodeTable's table.
template <bool kTable>
struct FloatDecodeOp {
  static constexpr int kTableSize = kTable ? 256 : 0;
  FloatGrid g;
  const int32_t* shifts;  // null: shift 0
  uint64_t group_len;     // 0: one group
  float up0;
  const uint32_t* table;

  __device__ __forceinline__ void Init(uint32_t* shared) {
    up0 = shifts != nullptr ? Pow2(shifts[0]) : 1.0f;
    if constexpr (kTable) table = FillDecodeTable(g, shared);
  }
  __device__ __forceinline__ float Decode(uint32_t code, uint64_t i) const {
    const float up = group_len == 0 ? up0 : Pow2(shifts[GroupOf(i, group_len)]);
    if constexpr (kTable) return ScaleBack(table[code], up);  // code < 2^bits <= 256
    return ScaleBack(FloatBits(DecodeFloatGrid(code, g)), up);
  }
};

struct BinadeDecodeOp {
  static constexpr int kTableSize = 0;
  const BinadeGrid* g;
  const int32_t* shifts;
  uint64_t group_len;
  float up0;

  __device__ __forceinline__ void Init(uint32_t*) { up0 = Pow2(shifts[0]); }
  __device__ __forceinline__ float Decode(uint32_t code, uint64_t i) const {
    const float up = group_len == 0 ? up0 : Pow2(shifts[GroupOf(i, group_len)]);
    return ScaleBack(FloatBits(DecodeBinadeGrid(code, *g)), up);
  }
};

// kernels::DecodeScaledFloatGridRow: the grid value scaled back under its block's scale
// (ScaledValue, which keeps a NaN's bits as the CPU does); kTable as FloatDecodeOp.
template <bool kTable>
struct BlockScaledDecodeOp {
  static constexpr int kTableSize = kTable ? 256 : 0;
  FloatGrid g;
  const BlockScale* scales;
  MatrixBlocks blocks;
  const uint32_t* table;

  __device__ __forceinline__ void Init(uint32_t* shared) {
    if constexpr (kTable) table = FillDecodeTable(g, shared);
  }
  __device__ __forceinline__ float Decode(uint32_t code, uint64_t i) const {
    float v;
    if constexpr (kTable) {
      v = BitsFloat(table[code]);  // code < 2^bits <= 256
    } else {
      v = DecodeFloatGrid(code, g);
    }
    return ScaledValue(v, scales[BlockOf(i, blocks)]);
  }
};

struct LinearDecodeOp {
  static constexpr int kTableSize = 0;
  const LinearGrid* grids;
  uint64_t group_len;
  LinearGrid grid0;

  __device__ __forceinline__ void Init(uint32_t*) { grid0 = grids[0]; }
  __device__ __forceinline__ float Decode(uint32_t code, uint64_t i) const {
    const LinearGrid lg = group_len == 0 ? grid0 : grids[GroupOf(i, group_len)];
    return LinearValue(int32_t(code) + lg.qmin, lg);
  }
};

// ---------------------------------------------------------------------------------------------
// Kernels

// Grid-stride over units of kUnitCodes elements: thread-private input (two 16-byte loads when
// `vec_in`: in is 16-byte aligned, so is every full unit), rounding, packing into the unit's
// `bits` bytes at dst + unit * bits. Elements past n are neither rounded nor packed (their group
// may not exist).
template <class Op, bool kStats>
__global__ void __launch_bounds__(kThreads)
    encode_kernel(const Op op, const float* in, uint64_t n, int bits, bool vec_in, bool words,
                  uint8_t* dst, StatsArgs stats) {
  Op o = op;
  o.Init();
  Acc<kStats> acc;
  const uint32_t mask = CodeMask(bits);
  const uint64_t units = CEIL_DIV(n, uint64_t(kUnitCodes));
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t u = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < units; u += stride) {
    const uint64_t first = u * kUnitCodes;
    const int len = n - first < uint64_t(kUnitCodes) ? int(n - first) : kUnitCodes;
    float x[kUnitCodes];
    if (vec_in && len == kUnitCodes) {
      const float4* v = reinterpret_cast<const float4*>(in + first);
      const float4 a = v[0], b = v[1];
      x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
      x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
    } else {
#pragma unroll
      for (int k = 0; k < kUnitCodes; ++k) x[k] = k < len ? in[first + k] : 0.0f;
    }
    uint32_t rnd[kUnitCodes];
    RandomRun(o, first, rnd);  // four or five hashes for the unit's eight elements
    uint32_t codes[kUnitCodes];
#pragma unroll
    for (int k = 0; k < kUnitCodes; ++k) {
      codes[k] = 0;
      if (k < len) {
        GridRange range;
        uint32_t code = 0;
        const float z = o.Apply(x[k], 0.0f, first + k, rnd[k], &code, kStats ? &range : nullptr);
        codes[k] = code & mask;
        if constexpr (kStats) acc.Add(x[k], z, range);
      }
    }
    StoreCodeUnit(codes, len, bits, words, dst + u * uint64_t(bits));
  }
  if constexpr (kStats) FinishStats(acc, stats, n);
}

// The inverse: unpack a unit, decode, store (two 16-byte stores when `vec_out`).
template <class Op>
__global__ void __launch_bounds__(kThreads)
    decode_kernel(const Op op, const uint8_t* src, uint64_t n, int bits, bool words, bool vec_out,
                  float* out) {
  __shared__ uint32_t table[Op::kTableSize > 0 ? Op::kTableSize : 1];
  Op o = op;
  o.Init(table);
  const uint64_t units = CEIL_DIV(n, uint64_t(kUnitCodes));
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t u = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < units; u += stride) {
    const uint64_t first = u * kUnitCodes;
    const int len = n - first < uint64_t(kUnitCodes) ? int(n - first) : kUnitCodes;
    uint32_t codes[kUnitCodes];
    LoadCodeUnit(src + u * uint64_t(bits), len, bits, words, codes);
    float z[kUnitCodes];
#pragma unroll
    for (int k = 0; k < kUnitCodes; ++k) z[k] = k < len ? o.Decode(codes[k], first + k) : 0.0f;
    if (vec_out && len == kUnitCodes) {
      float4* v = reinterpret_cast<float4*>(out + first);
      v[0] = make_float4(z[0], z[1], z[2], z[3]);
      v[1] = make_float4(z[4], z[5], z[6], z[7]);
    } else {
#pragma unroll
      for (int k = 0; k < kUnitCodes; ++k) {
        if (k < len) out[first + k] = z[k];
      }
    }
  }
}

// Codes of 4, 8, 16 or 32 bits: four of them fill bits / 2 whole bytes (quad_bytes), so lane v
// can own elements 4v..4v+3 and bytes [v * quad_bytes, (v + 1) * quad_bytes) of PackCodes'
// stream. Such spans take these kernels, shaped as the quantiser's element pass: grid-stride
// over 4-element vectors with kUnroll loads in flight per thread, each lane's floats one 16-byte
// access and its four codes one 2-, 4-, 8- or 16-byte access, so that a warp moves contiguous
// runs of 512 bytes of floats and 64 to 512 bytes of codes per instruction. (The 8-code units
// put adjacent lanes 32 bytes apart on the float side and pack with shifts by a runtime width.)
// The last n % 4 elements, whose codes may share a byte, are one thread's.
// REQUIRED: the floats 16-byte aligned and the codes aligned to quad_bytes (kernels/pack.h).
template <class Op, bool kStats>
__global__ void __launch_bounds__(kThreads)
    encode_quads_kernel(const Op op, const float* in, uint64_t n, int quad_bytes, uint8_t* dst,
                        StatsArgs stats) {
  Op o = op;
  o.Init();
  Acc<kStats> acc;
  const int bits = QuadCodeBits(quad_bytes);
  const uint32_t mask = CodeMask(bits);
  const uint64_t nvec = n / 4;
  const uint64_t tid = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  const float4* in4 = reinterpret_cast<const float4*>(in);
  for (uint64_t v0 = tid; v0 < nvec; v0 += kUnroll * stride) {
    float4 x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t v = v0 + u * stride;
      if (v < nvec) x[u] = in4[v];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t v = v0 + u * stride;
      if (v >= nvec) break;
      uint32_t rnd[4];
      RandomRun(o, 4 * v, rnd);
      const float xs[4] = {x[u].x, x[u].y, x[u].z, x[u].w};
      uint32_t codes[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        GridRange range;
        uint32_t code = 0;
        const float z = o.Apply(xs[k], 0.0f, 4 * v + k, rnd[k], &code, kStats ? &range : nullptr);
        codes[k] = code & mask;
        if constexpr (kStats) acc.Add(xs[k], z, range);
      }
      StoreCodeQuad(codes, quad_bytes, dst + v * quad_bytes);
    }
  }
  const int len = int(n - 4 * nvec);
  if (tid == 0 && len > 0) {  // the tail's 1..3 codes, then the last byte's spare bits zero
    uint32_t codes[kUnitCodes] = {};
    for (int k = 0; k < len; ++k) {
      const uint64_t i = 4 * nvec + k;
      GridRange range;
      uint32_t code = 0;
      const float z = o.Apply(in[i], 0.0f, i, RandomOne(o, i), &code, kStats ? &range : nullptr);
      codes[k] = code & mask;
      if constexpr (kStats) acc.Add(in[i], z, range);
    }
    StoreCodeUnit(codes, len, bits, /*words=*/false, dst + nvec * quad_bytes);
  }
  if constexpr (kStats) FinishStats(acc, stats, n);
}

template <class Op>
__global__ void __launch_bounds__(kThreads)
    decode_quads_kernel(const Op op, const uint8_t* src, uint64_t n, int quad_bytes, float* out) {
  __shared__ uint32_t table[Op::kTableSize > 0 ? Op::kTableSize : 1];
  Op o = op;
  o.Init(table);
  const uint64_t nvec = n / 4;
  const uint64_t tid = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  float4* out4 = reinterpret_cast<float4*>(out);
  for (uint64_t v0 = tid; v0 < nvec; v0 += kUnroll * stride) {
    uint32_t c[kUnroll][4];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t v = v0 + u * stride;
      if (v < nvec) LoadCodeQuad(src + v * quad_bytes, quad_bytes, c[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t v = v0 + u * stride;
      if (v >= nvec) break;
      const uint64_t i = 4 * v;
      out4[v] = make_float4(o.Decode(c[u][0], i), o.Decode(c[u][1], i + 1),
                            o.Decode(c[u][2], i + 2), o.Decode(c[u][3], i + 3));
    }
  }
  const int len = int(n - 4 * nvec);
  if (tid == 0 && len > 0) {
    uint32_t codes[kUnitCodes];
    LoadCodeUnit(src + nvec * quad_bytes, len, QuadCodeBits(quad_bytes), /*words=*/false, codes);
    for (int k = 0; k < len; ++k) out[4 * nvec + k] = o.Decode(codes[k], 4 * nvec + k);
  }
}

__global__ void read_shift_meta_kernel(const uint8_t* src, uint64_t num, bool e8m0,
                                       int32_t* shifts) {
  const uint64_t g = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g < num) shifts[g] = ShiftFromMetaByte(src[g], e8m0);
}

__global__ void read_linear_meta_kernel(const uint8_t* src, uint64_t num, bool minmax, int bits,
                                        LinearGrid* grids) {
  const uint64_t g = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g < num) grids[g] = LoadLinearMeta(src + g * (minmax ? 8u : 4u), minmax, bits);
}

// cpd/quantize.cc ReadBlockScales: each block's BlockScale from its metadata and T.
__global__ void read_block_scale_meta_kernel(const uint8_t* src, uint64_t num, BlockScaleRule rule,
                                             BlockScale* scales) {
  const uint64_t g = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= num) return;
  const uint8_t* d = src + g * uint64_t(rule.meta_bytes);
  switch (rule.kind) {
    case BlockScaleKind::kPow2:
      scales[g] = Pow2BlockScale(ShiftFromMetaByte(d[0], /*e8m0=*/true));
      break;
    case BlockScaleKind::kFloat32:
      scales[g] = BlockScale{0.0f, LoadFloatMeta(d), 1.0f};
      break;
    case BlockScaleKind::kFloatGrid: {
      const float t =
          rule.tensor_level ? LoadFloatMeta(src + num * uint64_t(rule.meta_bytes)) : 1.0f;
      const float sb = DecodeFloatGrid(LoadCodeMeta(d, rule.meta_bytes), rule.scale_grid);
      scales[g] = GridBlockScale(sb, t);
      break;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launch helpers

// The bytes of four codes (2, 4, 8 or 16) when the codes at p suit the quad kernels (4-, 8-, 16-
// or 32-bit codes, p aligned to four of them), else 0.
int QuadBytes(int bits, const void* p) {
  if (bits != 4 && bits != 8 && bits != 16 && bits != 32) return 0;
  const int quad_bytes = bits / 2;
  return reinterpret_cast<uintptr_t>(p) % uintptr_t(quad_bytes) == 0 ? quad_bytes : 0;
}

// Work in threads of the quad kernels: kUnroll vectors each, and one for the tail.
uint64_t QuadWork(uint64_t n) { return CEIL_DIV(n / 4, uint64_t(kUnroll)) + (n % 4 != 0); }

template <class Op>
CudaResult LaunchEncodeQuads(const Op& op, const float* in, uint64_t n, int quad_bytes,
                             const StatsTarget& stats, uint8_t* dst, cudaStream_t stream) {
  int blocks = 0;
  if (stats.wanted()) {
    CudaResult r = GridBlocks<encode_quads_kernel<Op, true>>(QuadWork(n), kThreads, true, &blocks);
    if (!r.ok()) return r;
    encode_quads_kernel<Op, true>
        <<<blocks, kThreads, 0, stream>>>(op, in, n, quad_bytes, dst, ArgsOf(stats));
    CPD_CUDA_CHECK(cudaGetLastError());
    return CudaResult{};
  }
  CudaResult r = GridBlocks<encode_quads_kernel<Op, false>>(QuadWork(n), kThreads, false, &blocks);
  if (!r.ok()) return r;
  encode_quads_kernel<Op, false>
      <<<blocks, kThreads, 0, stream>>>(op, in, n, quad_bytes, dst, StatsArgs{});
  CPD_CUDA_CHECK(cudaGetLastError());
  return CudaResult{};
}

template <class Op>
CudaResult LaunchEncode(const Op& op, const float* in, uint64_t n, int bits,
                        const StatsTarget& stats, uint8_t* dst, cudaStream_t stream) {
  if (n == 0) return CudaResult{};
  CPD_LAUNCH_REQUIRE(in != nullptr && dst != nullptr, "null buffer");
  CPD_LAUNCH_REQUIRE(bits >= 1 && bits <= kMaxCodeBits, "codes need 1 to 32 bits");
  CPD_LAUNCH_REQUIRE((reinterpret_cast<uintptr_t>(in) & 3u) == 0, "input must be 4-byte aligned");
  CudaResult checked = CheckStats(stats);
  if (!checked.ok()) return checked;
  const bool vec_in = (reinterpret_cast<uintptr_t>(in) & 15u) == 0;
  const bool words = bits % 4 == 0 && (reinterpret_cast<uintptr_t>(dst) & 3u) == 0;
  const int quad_bytes = QuadBytes(bits, dst);
  if (vec_in && quad_bytes != 0) {
    return LaunchEncodeQuads(op, in, n, quad_bytes, stats, dst, stream);
  }
  const uint64_t units = CEIL_DIV(n, uint64_t(kUnitCodes));
  int blocks = 0;
  if (stats.wanted()) {
    CudaResult r = GridBlocks<encode_kernel<Op, true>>(units, kThreads, true, &blocks);
    if (!r.ok()) return r;
    encode_kernel<Op, true>
        <<<blocks, kThreads, 0, stream>>>(op, in, n, bits, vec_in, words, dst, ArgsOf(stats));
    CPD_CUDA_CHECK(cudaGetLastError());
    return CudaResult{};
  }
  CudaResult r = GridBlocks<encode_kernel<Op, false>>(units, kThreads, false, &blocks);
  if (!r.ok()) return r;
  encode_kernel<Op, false>
      <<<blocks, kThreads, 0, stream>>>(op, in, n, bits, vec_in, words, dst, StatsArgs{});
  CPD_CUDA_CHECK(cudaGetLastError());
  return CudaResult{};
}

template <template <RoundMode> class OpT, class... Args>
CudaResult DispatchEncodeMode(RoundMode mode, const float* in, uint64_t n, int bits,
                              const StatsTarget& stats, uint8_t* dst, cudaStream_t stream,
                              Args... args) {
  switch (mode) {
    case RoundMode::kNearestEven:
      return LaunchEncode(OpT<RoundMode::kNearestEven>{args...}, in, n, bits, stats, dst, stream);
    case RoundMode::kStochastic:
      return LaunchEncode(OpT<RoundMode::kStochastic>{args...}, in, n, bits, stats, dst, stream);
    case RoundMode::kTowardZero:
      return LaunchEncode(OpT<RoundMode::kTowardZero>{args...}, in, n, bits, stats, dst, stream);
    default:
      break;
  }
  CPD_LAUNCH_REQUIRE(false, "rounding mode must be nearest-even, stochastic or toward zero");
  return CudaResult{};
}

template <class Op>
CudaResult LaunchDecode(const Op& op, const uint8_t* src, uint64_t n, int bits, float* out,
                        cudaStream_t stream) {
  if (n == 0) return CudaResult{};
  CPD_LAUNCH_REQUIRE(src != nullptr && out != nullptr, "null buffer");
  CPD_LAUNCH_REQUIRE(bits >= 1 && bits <= kMaxCodeBits, "codes need 1 to 32 bits");
  CPD_LAUNCH_REQUIRE((reinterpret_cast<uintptr_t>(out) & 3u) == 0, "output must be 4-byte aligned");
  const bool words = bits % 4 == 0 && (reinterpret_cast<uintptr_t>(src) & 3u) == 0;
  const bool vec_out = (reinterpret_cast<uintptr_t>(out) & 15u) == 0;
  const int quad_bytes = QuadBytes(bits, src);
  int blocks = 0;
  if (vec_out && quad_bytes != 0) {
    CudaResult r = GridBlocks<decode_quads_kernel<Op>>(QuadWork(n), kThreads, false, &blocks);
    if (!r.ok()) return r;
    decode_quads_kernel<Op><<<blocks, kThreads, 0, stream>>>(op, src, n, quad_bytes, out);
    CPD_CUDA_CHECK(cudaGetLastError());
    return CudaResult{};
  }
  const uint64_t units = CEIL_DIV(n, uint64_t(kUnitCodes));
  CudaResult r = GridBlocks<decode_kernel<Op>>(units, kThreads, false, &blocks);
  if (!r.ok()) return r;
  decode_kernel<Op><<<blocks, kThreads, 0, stream>>>(op, src, n, bits, words, vec_out, out);
  CPD_CUDA_CHECK(cudaGetLastError());
  return CudaResult{};
}

// Blocks of a one-thread-per-group kernel.
CudaResult GroupBlocks(size_t num_groups, unsigned* blocks) {
  const uint64_t b = CEIL_DIV(uint64_t(num_groups), uint64_t(kThreads));
  CPD_LAUNCH_REQUIRE(b <= 0x7fffffffu, "too many groups");
  *blocks = unsigned(b);
  return CudaResult{};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers

CudaResult LaunchEncodeFloatGrid(const float* in, size_t n, int bits, const FloatGrid& g,
                                 const int32_t* shifts, GroupLayout groups, RoundMode mode,
                                 RandomParams rng, StatsTarget stats, uint8_t* dst, void* stream) {
  CudaResult r = CheckGroups(n, groups, shifts != nullptr);
  if (!r.ok()) return r;
  if (shifts == nullptr) {
    return DispatchEncodeMode<FixedFloatGridOp>(mode, in, n, bits, stats, dst, AsStream(stream),
                                                StochasticGridConsts(g), rng.key, rng.index_base);
  }
  return DispatchEncodeMode<FloatGridOp>(mode, in, n, bits, stats, dst, AsStream(stream),
                                         StochasticGridConsts(g), shifts, groups.group_len, rng.key,
                                         rng.index_base, 0.0f, 0.0f);
}

CudaResult LaunchEncodeBinadeGrid(const float* in, size_t n, int bits, const BinadeGrid* d_grid,
                                  const int32_t* shifts, GroupLayout groups, RoundMode mode,
                                  RandomParams rng, StatsTarget stats, uint8_t* dst, void* stream) {
  CPD_LAUNCH_REQUIRE(n == 0 || (d_grid != nullptr && shifts != nullptr),
                     "binade grids need the grid and the shifts");
  CudaResult r = CheckGroups(n, groups, true);
  if (!r.ok()) return r;
  return DispatchEncodeMode<BinadeGridOp>(mode, in, n, bits, stats, dst, AsStream(stream), d_grid,
                                          shifts, groups.group_len, rng.key, rng.index_base, 0.0f,
                                          0.0f);
}

CudaResult LaunchEncodeLinearGrid(const float* in, size_t n, int bits, const LinearGrid* grids,
                                  GroupLayout groups, RoundMode mode, RandomParams rng,
                                  StatsTarget stats, uint8_t* dst, void* stream) {
  CPD_LAUNCH_REQUIRE(n == 0 || grids != nullptr, "linear grids are required");
  CudaResult r = CheckGroups(n, groups, true);
  if (!r.ok()) return r;
  return DispatchEncodeMode<LinearGridOp>(mode, in, n, bits, stats, dst, AsStream(stream), grids,
                                          groups.group_len, rng.key, rng.index_base, LinearGrid{});
}

CudaResult LaunchDecodeFloatGrid(const uint8_t* src, size_t n, int bits, const FloatGrid& g,
                                 const int32_t* shifts, GroupLayout groups, float* out,
                                 void* stream) {
  CudaResult r = CheckGroups(n, groups, shifts != nullptr);
  if (!r.ok()) return r;
  if (bits <= 8) {
    return LaunchDecode(FloatDecodeOp<true>{g, shifts, groups.group_len, 1.0f, nullptr}, src, n,
                        bits, out, AsStream(stream));
  }
  return LaunchDecode(FloatDecodeOp<false>{g, shifts, groups.group_len, 1.0f, nullptr}, src, n,
                      bits, out, AsStream(stream));
}

CudaResult LaunchDecodeBinadeGrid(const uint8_t* src, size_t n, int bits, const BinadeGrid* d_grid,
                                  const int32_t* shifts, GroupLayout groups, float* out,
                                  void* stream) {
  CPD_LAUNCH_REQUIRE(n == 0 || (d_grid != nullptr && shifts != nullptr),
                     "binade grids need the grid and the shifts");
  CudaResult r = CheckGroups(n, groups, true);
  if (!r.ok()) return r;
  return LaunchDecode(BinadeDecodeOp{d_grid, shifts, groups.group_len, 1.0f}, src, n, bits, out,
                      AsStream(stream));
}

CudaResult LaunchDecodeLinearGrid(const uint8_t* src, size_t n, int bits, const LinearGrid* grids,
                                  GroupLayout groups, float* out, void* stream) {
  CPD_LAUNCH_REQUIRE(n == 0 || grids != nullptr, "linear grids are required");
  CudaResult r = CheckGroups(n, groups, true);
  if (!r.ok()) return r;
  return LaunchDecode(LinearDecodeOp{grids, groups.group_len, LinearGrid{}}, src, n, bits, out,
                      AsStream(stream));
}

CudaResult LaunchEncodeBlockScaled(const float* in, size_t n, int bits, const FloatGrid& g,
                                   const BlockScale* scales, const MatrixBlocks& blocks,
                                   RoundMode mode, RandomParams rng, StatsTarget stats,
                                   uint8_t* dst, void* stream) {
  CPD_LAUNCH_REQUIRE(n == 0 || scales != nullptr, "block scales are required");
  return DispatchEncodeMode<BlockScaledOp>(mode, in, n, bits, stats, dst, AsStream(stream), g,
                                           scales, blocks, rng.key, rng.index_base);
}

CudaResult LaunchDecodeBlockScaled(const uint8_t* src, size_t n, int bits, const FloatGrid& g,
                                   const BlockScale* scales, const MatrixBlocks& blocks, float* out,
                                   void* stream) {
  CPD_LAUNCH_REQUIRE(n == 0 || scales != nullptr, "block scales are required");
  if (bits <= 8) {
    return LaunchDecode(BlockScaledDecodeOp<true>{g, scales, blocks, nullptr}, src, n, bits, out,
                        AsStream(stream));
  }
  return LaunchDecode(BlockScaledDecodeOp<false>{g, scales, blocks, nullptr}, src, n, bits, out,
                      AsStream(stream));
}

CudaResult LaunchReadBlockScaleMeta(const uint8_t* src, size_t num_blocks,
                                    const BlockScaleRule& rule, BlockScale* scales, void* stream) {
  if (num_blocks == 0) return CudaResult{};
  CPD_LAUNCH_REQUIRE(src != nullptr && scales != nullptr, "null buffer");
  CPD_LAUNCH_REQUIRE(rule.meta_bytes >= 1 && rule.meta_bytes <= 4, "metadata of 1 to 4 bytes");
  unsigned blocks = 0;
  CudaResult r = GroupBlocks(num_blocks, &blocks);
  if (!r.ok()) return r;
  read_block_scale_meta_kernel<<<blocks, kThreads, 0, AsStream(stream)>>>(src, num_blocks, rule,
                                                                          scales);
  CPD_CUDA_CHECK(cudaGetLastError());
  return CudaResult{};
}

CudaResult LaunchReadShiftMeta(const uint8_t* src, size_t num_groups, bool e8m0, int32_t* shifts,
                               void* stream) {
  if (num_groups == 0) return CudaResult{};
  CPD_LAUNCH_REQUIRE(src != nullptr && shifts != nullptr, "null buffer");
  unsigned blocks = 0;
  CudaResult r = GroupBlocks(num_groups, &blocks);
  if (!r.ok()) return r;
  read_shift_meta_kernel<<<blocks, kThreads, 0, AsStream(stream)>>>(src, num_groups, e8m0, shifts);
  CPD_CUDA_CHECK(cudaGetLastError());
  return CudaResult{};
}

CudaResult LaunchReadLinearMeta(const uint8_t* src, size_t num_groups, bool minmax, int bits,
                                LinearGrid* grids, void* stream) {
  if (num_groups == 0) return CudaResult{};
  CPD_LAUNCH_REQUIRE(src != nullptr && grids != nullptr, "null buffer");
  CPD_LAUNCH_REQUIRE(bits >= 1 && bits <= 31, "linear grids need 1 to 31 bits");
  unsigned blocks = 0;
  CudaResult r = GroupBlocks(num_groups, &blocks);
  if (!r.ok()) return r;
  read_linear_meta_kernel<<<blocks, kThreads, 0, AsStream(stream)>>>(src, num_groups, minmax, bits,
                                                                     grids);
  CPD_CUDA_CHECK(cudaGetLastError());
  return CudaResult{};
}

}  // namespace cpd::kernels::cuda
