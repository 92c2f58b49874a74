// Kernels of comm/reduce_kernels_cuda.h. Layout: element helpers, kernels (names end in _kernel),
// launch helpers, the API.
//
// Bit-exactness with the CPU reducer:
//  * decoding is kernels::DecodeFloatGrid, which the CPU's CodeDecoder equals for every code
//    (tests/comm/reduce_kernels_test.cc); rounding is kernels::RoundToFloatGrid, as in
//    EncodeCodes8/16 and kernels::QuantizeFloatGrid;
//  * additions are __fadd_rn/__fsub_rn in the CPU's order, built with -fmad=false (no
//    contraction) and without flush-to-zero, as x86 SSE computes them;
//  * a NaN's payload may differ between the CPU's and the GPU's arithmetic, but every value that
//    leaves a kernel went through RoundToFloatGrid, which maps every NaN to the one NaN code;
//  * stochastic rounding draws RandomBits(key, flat index) with the keys of
//    comm/allreduce/streams.h, computed here from the same seed, stage and step.
#include <cuda_runtime.h>

#include <string>

#include "comm/allreduce/streams.h"
#include "comm/reduce_kernels_cuda.h"
#include "kernels/pack.h"

namespace cpd::comm::internal {
namespace {

using kernels::BitsFloat;
using kernels::FloatBits;
using kernels::FloatGrid;
using kernels::RoundMode;

constexpr int kThreads = 256;
constexpr unsigned kFullMask = 0xffffffffu;
// Grid-stride kernels: enough blocks to fill any current GPU, few enough that the per-warp
// atomics of the scan stay negligible.
constexpr std::uint64_t kMaxBlocks = 4096;

Status CudaError(cudaError_t err, const char* file, int line, const char* expr) {
  return Status::Internal(std::string(file) + ":" + std::to_string(line) + ": " + expr + ": " +
                          cudaGetErrorString(err));
}

#define CPD_REDUCE_CUDA_CHECK(expr)                          \
  do {                                                       \
    const cudaError_t cpd_err_ = (expr);                     \
    if (cpd_err_ != cudaSuccess) {                           \
      return CudaError(cpd_err_, __FILE__, __LINE__, #expr); \
    }                                                        \
  } while (0)

int BlocksFor(std::uint64_t work) {
  const std::uint64_t b = (work + kThreads - 1) / kThreads;
  return int(b < 1 ? 1 : b > kMaxBlocks ? kMaxBlocks : b);
}

bool Aligned4(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 3u) == 0; }

// ---- Element helpers ----------------------------------------------------------------------------

// x rounded onto g with the stream `key` at flat index `index` (kernels::QuantizeFloatGrid's
// element, shift 0).
template <RoundMode kMode>
__device__ __forceinline__ float RoundOnGrid(float x, const FloatGrid& g, std::uint64_t key,
                                             std::uint64_t index) {
  const std::uint32_t rnd = kMode == RoundMode::kStochastic ? kernels::RandomBits(key, index) : 0u;
  return BitsFloat(kernels::RoundToFloatGrid<kMode>(x, g, rnd, nullptr));
}

// The key of emulate's rounding of worker w's addition (op: KahanOp, 0 for the plain sum).
__device__ __forceinline__ std::uint64_t AdditionKey(std::uint64_t seed, std::int64_t step,
                                                     int workers, int w, int op) {
  return kernels::MakeRandomKey(RoundingSeed(seed, AdditionStage(workers, w, op)),
                                std::uint64_t(step));
}

// The layer of flat element i: the l with offsets[l] <= i < offsets[l + 1] (binary search; empty
// layers are skipped). REQUIRED: offsets[0] <= i < offsets[layers].
__device__ __forceinline__ int LayerOf(const DeviceLayers& L, std::uint64_t i) {
  int lo = 0, hi = L.layers - 1;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (L.offsets[mid + 1] <= i) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// x * scale (a power of two) with a NaN keeping its bits, as the CPU's x86 multiply keeps them
// (the GPU's would return its canonical NaN).
__device__ __forceinline__ float ScaleKeepNaN(float x, float scale) {
  return (FloatBits(x) & 0x7fffffffu) > 0x7f800000u ? x : __fmul_rn(x, scale);
}

// ---- Kernels ------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads)
    scan_abs_kernel(const float* x, std::uint64_t n, std::uint32_t* max_bits,
                    unsigned long long* nonzero) {
  std::uint32_t m = 0;
  unsigned long long nz = 0;
  const std::uint64_t stride = std::uint64_t(gridDim.x) * blockDim.x;
  for (std::uint64_t i = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const std::uint32_t a = FloatBits(x[i]) & 0x7fffffffu;
    m = a > m ? a : m;
    nz += a != 0;
  }
  m = __reduce_max_sync(kFullMask, m);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) nz += __shfl_down_sync(kFullMask, nz, off);
  if (threadIdx.x % 32 == 0) {
    if (m != 0) atomicMax(max_bits, m);
    if (nz != 0) atomicAdd(nonzero, nz);
  }
}

__global__ void __launch_bounds__(kThreads) scale_kernel(float* x, std::uint64_t n, float scale) {
  const std::uint64_t stride = std::uint64_t(gridDim.x) * blockDim.x;
  for (std::uint64_t i = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = x[i];
    // The GPU's multiply turns a NaN operand into its canonical NaN; x86 keeps the operand.
    x[i] = (FloatBits(v) & 0x7fffffffu) > 0x7f800000u ? v : __fmul_rn(v, scale);
  }
}

template <ElementOp kOp>
__global__ void __launch_bounds__(kThreads)
    combine_kernel(const float* a, const float* b, float* out, std::uint64_t n) {
  const std::uint64_t stride = std::uint64_t(gridDim.x) * blockDim.x;
  for (std::uint64_t i = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = kOp == ElementOp::kAdd ? __fadd_rn(a[i], b[i]) : __fsub_rn(a[i], b[i]);
  }
}

// One thread per unit of kUnitCodes elements: scale by the layer's 2^s, round, pack. The loop
// runs whole warps together (its condition is the warp's first unit), so that the flushed and
// saturated counts of a warp whose units lie in one layer are summed by the warp and added with
// one atomic per counter; units across a layer boundary add their other layer's counts alone.
template <RoundMode kMode, bool kStats>
__global__ void __launch_bounds__(kThreads)
    encode_contribution_kernel(const float* x, std::uint64_t n, std::uint64_t index_base,
                               const DeviceLayers layers, const FloatGrid g, std::uint64_t key,
                               int bits, bool words, std::uint8_t* dst,
                               unsigned long long* counters) {
  constexpr int kU = kernels::kUnitCodes;
  const std::uint32_t mask = kernels::CodeMask(bits);
  const std::uint32_t mag_mask = (1u << (g.ebits + g.mbits)) - 1u;
  const std::uint64_t units = (n + kU - 1) / kU;
  const std::uint64_t lane = threadIdx.x % 32;
  const std::uint64_t stride = std::uint64_t(gridDim.x) * blockDim.x;
  for (std::uint64_t u = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; u - lane < units;
       u += stride) {
    const bool active = u < units;
    int first_layer = 0;
    unsigned flushed = 0, saturated = 0;
    if (active) {
      const std::uint64_t first = u * kU;
      const int len = n - first < std::uint64_t(kU) ? int(n - first) : kU;
      const std::uint64_t i0 = index_base + first;
      first_layer = LayerOf(layers, i0);
      int l = first_layer;
      std::uint64_t layer_end = layers.offsets[l + 1];
      float scale = kernels::Pow2(layers.shifts[l]);
      std::uint32_t codes[kU];
#pragma unroll
      for (int k = 0; k < kU; ++k) {
        codes[k] = 0;
        if (k < len) {
          const std::uint64_t i = i0 + k;
          while (i >= layer_end) {
            ++l;
            layer_end = layers.offsets[l + 1];
            scale = kernels::Pow2(layers.shifts[l]);
          }
          const float xv = x[first + k];
          const float y = __fmul_rn(xv, scale);
          const std::uint32_t rnd =
              kMode == RoundMode::kStochastic ? kernels::RandomBits(key, i) : 0u;
          std::uint32_t code = 0;
          kernels::RoundToFloatGrid<kMode>(y, g, rnd, &code);
          codes[k] = code & mask;
          if constexpr (kStats) {
            const unsigned f = (FloatBits(xv) & 0x7fffffffu) != 0 && (code & mag_mask) == 0;
            const unsigned s = (FloatBits(y) & 0x7fffffffu) > g.max_bits;
            if (l == first_layer) {
              flushed += f;
              saturated += s;
            } else {
              if (f != 0) atomicAdd(&counters[2 * l], 1ull);
              if (s != 0) atomicAdd(&counters[2 * l + 1], 1ull);
            }
          }
        }
      }
      kernels::StoreCodeUnit(codes, len, bits, words, dst + u * std::uint64_t(bits));
    }
    if constexpr (kStats) {
      // Lane 0's unit exists whenever the loop runs, so its layer is a valid index.
      const int l0 = __shfl_sync(kFullMask, first_layer, 0);
      if (__all_sync(kFullMask, !active || first_layer == l0)) {
        const unsigned f = __reduce_add_sync(kFullMask, flushed);
        const unsigned s = __reduce_add_sync(kFullMask, saturated);
        if (lane == 0 && f != 0) atomicAdd(&counters[2 * l0], (unsigned long long)f);
        if (lane == 0 && s != 0) atomicAdd(&counters[2 * l0 + 1], (unsigned long long)s);
      } else {
        if (flushed != 0) atomicAdd(&counters[2 * first_layer], (unsigned long long)flushed);
        if (saturated != 0) {
          atomicAdd(&counters[2 * first_layer + 1], (unsigned long long)saturated);
        }
      }
    }
  }
}

// One thread per unit: unpack, decode, times 2^-s of each element's layer.
__global__ void __launch_bounds__(kThreads)
    decode_unshift_kernel(const std::uint8_t* src, std::uint64_t n, std::uint64_t index_base,
                          const DeviceLayers layers, const FloatGrid g, int bits, bool words,
                          float* out) {
  constexpr int kU = kernels::kUnitCodes;
  const std::uint64_t units = (n + kU - 1) / kU;
  const std::uint64_t stride = std::uint64_t(gridDim.x) * blockDim.x;
  for (std::uint64_t u = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < units;
       u += stride) {
    const std::uint64_t first = u * kU;
    const int len = n - first < std::uint64_t(kU) ? int(n - first) : kU;
    std::uint32_t codes[kU];
    kernels::LoadCodeUnit(src + u * std::uint64_t(bits), len, bits, words, codes);
    const std::uint64_t i0 = index_base + first;
    int l = LayerOf(layers, i0);
    std::uint64_t layer_end = layers.offsets[l + 1];
    float up = kernels::Pow2(-layers.shifts[l]);
#pragma unroll
    for (int k = 0; k < kU; ++k) {
      if (k < len) {
        while (i0 + k >= layer_end) {
          ++l;
          layer_end = layers.offsets[l + 1];
          up = kernels::Pow2(-layers.shifts[l]);
        }
        out[first + k] = ScaleKeepNaN(kernels::DecodeFloatGrid(codes[k], g), up);
      }
    }
  }
}

// How a chunk's contributions are combined: packed's float32 sum rounded once at the end (or,
// kFloat, stored unrounded), or emulate's sum rounded after every addition, plain or
// Kahan-compensated.
enum class SumKind { kRequantize, kFloat, kRounded, kKahan };

struct SumArgs {
  const std::uint8_t* codes;
  std::uint64_t stride;
  int workers;
  std::uint64_t n;
  int bits;
  bool words;  // every unit of codes and of dst is whole aligned 32-bit words (kernels/pack.h)
  FloatGrid g;
  std::uint64_t key;   // kRequantize: the stream of the one rounding
  std::uint64_t seed;  // emulate: options.seed and the step of the addition streams
  std::int64_t step;
  std::uint64_t index_base;
  std::uint8_t* dst;
  float* sum_out;  // kFloat
};

// One thread per unit of kUnitCodes elements (a whole number of bytes of every contribution and
// of dst, so no two threads share a byte): unpack and decode worker 0's codes, fold in the other
// workers' in order, round, pack.
template <RoundMode kMode, SumKind kKind>
__global__ void __launch_bounds__(kThreads) sum_codes_kernel(const SumArgs a) {
  constexpr int kU = kernels::kUnitCodes;
  const FloatGrid g = a.g;
  const std::uint32_t mask = kernels::CodeMask(a.bits);
  const std::uint64_t units = (a.n + kU - 1) / kU;
  const std::uint64_t stride = std::uint64_t(gridDim.x) * blockDim.x;
  for (std::uint64_t u = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < units;
       u += stride) {
    const std::uint64_t first = u * kU;
    const int len = a.n - first < std::uint64_t(kU) ? int(a.n - first) : kU;
    const std::uint64_t unit_offset = u * std::uint64_t(a.bits);
    std::uint32_t codes[kU];
    float sum[kU], comp[kU];
    kernels::LoadCodeUnit(a.codes + unit_offset, len, a.bits, a.words, codes);
#pragma unroll
    for (int k = 0; k < kU; ++k) {
      sum[k] = kernels::DecodeFloatGrid(codes[k], g);
      comp[k] = 0.0f;
    }
    for (int w = 1; w < a.workers; ++w) {
      kernels::LoadCodeUnit(a.codes + std::uint64_t(w) * a.stride + unit_offset, len, a.bits,
                            a.words, codes);
      if constexpr (kKind == SumKind::kRequantize || kKind == SumKind::kFloat) {
#pragma unroll
        for (int k = 0; k < kU; ++k)
          sum[k] = __fadd_rn(sum[k], kernels::DecodeFloatGrid(codes[k], g));
      } else if constexpr (kKind == SumKind::kRounded) {
        const std::uint64_t key = AdditionKey(a.seed, a.step, a.workers, w, 0);
#pragma unroll
        for (int k = 0; k < kU; ++k) {
          const float q = kernels::DecodeFloatGrid(codes[k], g);
          sum[k] = RoundOnGrid<kMode>(__fadd_rn(sum[k], q), g, key, a.index_base + first + k);
        }
      } else {
        const std::uint64_t ky = AdditionKey(a.seed, a.step, a.workers, w, kKahanY);
        const std::uint64_t kt = AdditionKey(a.seed, a.step, a.workers, w, kKahanT);
        const std::uint64_t kh = AdditionKey(a.seed, a.step, a.workers, w, kKahanHigh);
        const std::uint64_t kc = AdditionKey(a.seed, a.step, a.workers, w, kKahanC);
#pragma unroll
        for (int k = 0; k < kU; ++k) {
          const std::uint64_t i = a.index_base + first + k;
          const float q = kernels::DecodeFloatGrid(codes[k], g);
          const float y = RoundOnGrid<kMode>(__fsub_rn(q, comp[k]), g, ky, i);
          const float t = RoundOnGrid<kMode>(__fadd_rn(sum[k], y), g, kt, i);
          const float high = RoundOnGrid<kMode>(__fsub_rn(t, sum[k]), g, kh, i);
          comp[k] = RoundOnGrid<kMode>(__fsub_rn(high, y), g, kc, i);
          sum[k] = t;
        }
      }
    }
    if constexpr (kKind == SumKind::kFloat) {
#pragma unroll
      for (int k = 0; k < kU; ++k) {
        if (k < len) a.sum_out[first + k] = sum[k];
      }
    } else {
#pragma unroll
      for (int k = 0; k < kU; ++k) {
        std::uint32_t code = 0;
        if constexpr (kKind == SumKind::kRequantize) {
          const std::uint32_t rnd = kMode == RoundMode::kStochastic
                                        ? kernels::RandomBits(a.key, a.index_base + first + k)
                                        : 0u;
          kernels::RoundToFloatGrid<kMode>(sum[k], g, rnd, &code);
        } else {
          // emulate's sum is on the grid already: rounding it to nearest only yields its code.
          kernels::RoundToFloatGrid<RoundMode::kNearestEven>(sum[k], g, 0u, &code);
        }
        codes[k] = k < len ? code & mask : 0u;
      }
      kernels::StoreCodeUnit(codes, len, a.bits, a.words, a.dst + unit_offset);
    }
  }
}

// ---- Launch helpers -----------------------------------------------------------------------------

template <RoundMode kMode, SumKind kKind>
Status LaunchSum(const SumArgs& a, cudaStream_t stream) {
  const std::uint64_t units = (a.n + kernels::kUnitCodes - 1) / kernels::kUnitCodes;
  sum_codes_kernel<kMode, kKind><<<BlocksFor(units), kThreads, 0, stream>>>(a);
  CPD_REDUCE_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

template <SumKind kKind>
Status LaunchSumForMode(RoundMode mode, const SumArgs& a, cudaStream_t stream) {
  switch (mode) {
    case RoundMode::kStochastic:
      return LaunchSum<RoundMode::kStochastic, kKind>(a, stream);
    case RoundMode::kTowardZero:
      return LaunchSum<RoundMode::kTowardZero, kKind>(a, stream);
    default:
      return LaunchSum<RoundMode::kNearestEven, kKind>(a, stream);
  }
}

Status CheckContributions(const ContributionCodes& in, std::size_t n, const FloatGrid& g,
                          const std::uint8_t* dst, const char* what) {
  const int bits = 1 + g.ebits + g.mbits;
  const std::size_t bytes = (n * std::size_t(bits) + 7) / 8;
  if (bits > 16) {
    return Status::InvalidArgument(std::string(what) + ": codes of at most 16 bits, not " +
                                   std::to_string(bits));
  }
  if (in.workers < 1) return Status::InvalidArgument(std::string(what) + ": no contributions");
  if (in.codes == nullptr || dst == nullptr) {
    return Status::InvalidArgument(std::string(what) + ": null buffer");
  }
  if (in.workers > 1 && in.stride < bytes) {
    return Status::InvalidArgument(std::string(what) + ": contributions of " +
                                   std::to_string(bytes) + " bytes overlap at stride " +
                                   std::to_string(in.stride));
  }
  return Status::Ok();
}

SumArgs MakeSumArgs(const ContributionCodes& in, std::size_t n, const FloatGrid& g,
                    std::uint8_t* dst) {
  SumArgs a{};
  a.codes = in.codes;
  a.stride = in.stride;
  a.workers = in.workers;
  a.n = n;
  a.bits = 1 + g.ebits + g.mbits;
  a.words = a.bits % 4 == 0 && Aligned4(in.codes) && in.stride % 4 == 0 && Aligned4(dst);
  a.g = g;
  a.dst = dst;
  return a;
}

Status CheckLayers(const DeviceLayers& layers, const FloatGrid& g, const char* what) {
  if (layers.offsets == nullptr || layers.shifts == nullptr || layers.layers < 1) {
    return Status::InvalidArgument(std::string(what) + ": no layers");
  }
  if (1 + g.ebits + g.mbits > 16) {
    return Status::InvalidArgument(std::string(what) + ": codes of at most 16 bits, not " +
                                   std::to_string(1 + g.ebits + g.mbits));
  }
  return Status::Ok();
}

template <bool kStats>
Status LaunchEncodeContribution(RoundMode mode, const float* x, std::uint64_t n,
                                std::uint64_t index_base, const DeviceLayers& layers,
                                const FloatGrid& g, std::uint64_t key, int bits, bool words,
                                std::uint8_t* dst, unsigned long long* counters, cudaStream_t s) {
  const int blocks = BlocksFor((n + kernels::kUnitCodes - 1) / kernels::kUnitCodes);
  switch (mode) {
    case RoundMode::kStochastic:
      encode_contribution_kernel<RoundMode::kStochastic, kStats><<<blocks, kThreads, 0, s>>>(
          x, n, index_base, layers, g, key, bits, words, dst, counters);
      break;
    case RoundMode::kTowardZero:
      encode_contribution_kernel<RoundMode::kTowardZero, kStats><<<blocks, kThreads, 0, s>>>(
          x, n, index_base, layers, g, key, bits, words, dst, counters);
      break;
    default:
      encode_contribution_kernel<RoundMode::kNearestEven, kStats><<<blocks, kThreads, 0, s>>>(
          x, n, index_base, layers, g, key, bits, words, dst, counters);
      break;
  }
  CPD_REDUCE_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace

Status EncodeContributionCuda(const float* d_x, std::size_t n, std::uint64_t index_base,
                              const DeviceLayers& layers, const FloatGrid& g, RoundMode mode,
                              std::uint64_t key, std::uint8_t* d_dst, std::uint64_t* d_counters,
                              void* stream) {
  if (n == 0) return Status::Ok();
  CPD_RETURN_IF_ERROR(CheckLayers(layers, g, "EncodeContributionCuda"));
  if (d_x == nullptr || d_dst == nullptr) {
    return Status::InvalidArgument("EncodeContributionCuda: null buffer");
  }
  const int bits = 1 + g.ebits + g.mbits;
  const bool words = bits % 4 == 0 && Aligned4(d_dst);
  auto* counters = reinterpret_cast<unsigned long long*>(d_counters);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (d_counters != nullptr) {
    return LaunchEncodeContribution<true>(mode, d_x, n, index_base, layers, g, key, bits, words,
                                          d_dst, counters, s);
  }
  return LaunchEncodeContribution<false>(mode, d_x, n, index_base, layers, g, key, bits, words,
                                         d_dst, counters, s);
}

Status DecodeUnshiftCuda(const std::uint8_t* d_src, std::size_t n, std::uint64_t index_base,
                         const DeviceLayers& layers, const FloatGrid& g, float* d_out,
                         void* stream) {
  if (n == 0) return Status::Ok();
  CPD_RETURN_IF_ERROR(CheckLayers(layers, g, "DecodeUnshiftCuda"));
  if (d_src == nullptr || d_out == nullptr) {
    return Status::InvalidArgument("DecodeUnshiftCuda: null buffer");
  }
  const int bits = 1 + g.ebits + g.mbits;
  const bool words = bits % 4 == 0 && Aligned4(d_src);
  const int blocks = BlocksFor((n + kernels::kUnitCodes - 1) / kernels::kUnitCodes);
  decode_unshift_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      d_src, n, index_base, layers, g, bits, words, d_out);
  CPD_REDUCE_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status ScanAbsCuda(const float* d_x, std::size_t n, std::uint32_t* d_max_bits,
                   std::uint64_t* d_nonzero, void* stream) {
  if (n == 0) return Status::Ok();
  if (d_x == nullptr || d_max_bits == nullptr || d_nonzero == nullptr) {
    return Status::InvalidArgument("ScanAbsCuda: null buffer");
  }
  static_assert(sizeof(unsigned long long) == sizeof(std::uint64_t));
  scan_abs_kernel<<<BlocksFor(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      d_x, n, d_max_bits, reinterpret_cast<unsigned long long*>(d_nonzero));
  CPD_REDUCE_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status ScaleCuda(float* d_x, std::size_t n, float scale, void* stream) {
  if (n == 0) return Status::Ok();
  if (d_x == nullptr) return Status::InvalidArgument("ScaleCuda: null buffer");
  scale_kernel<<<BlocksFor(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(d_x, n, scale);
  CPD_REDUCE_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status CombineCuda(const float* d_a, const float* d_b, float* d_out, std::size_t n, ElementOp op,
                   void* stream) {
  if (n == 0) return Status::Ok();
  if (d_a == nullptr || d_b == nullptr || d_out == nullptr) {
    return Status::InvalidArgument("CombineCuda: null buffer");
  }
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (op == ElementOp::kAdd) {
    combine_kernel<ElementOp::kAdd><<<BlocksFor(n), kThreads, 0, s>>>(d_a, d_b, d_out, n);
  } else {
    combine_kernel<ElementOp::kSubtract><<<BlocksFor(n), kThreads, 0, s>>>(d_a, d_b, d_out, n);
  }
  CPD_REDUCE_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status SumRequantizeCodesCuda(const ContributionCodes& in, std::size_t n, const FloatGrid& g,
                              const kernels::LoopParams& p, std::uint8_t* d_dst, void* stream) {
  if (n == 0) return Status::Ok();
  CPD_RETURN_IF_ERROR(CheckContributions(in, n, g, d_dst, "SumRequantizeCodesCuda"));
  SumArgs a = MakeSumArgs(in, n, g, d_dst);
  a.key = p.rng_key;
  a.index_base = p.index_base;
  return LaunchSumForMode<SumKind::kRequantize>(p.mode, a, static_cast<cudaStream_t>(stream));
}

Status SumCodesCuda(const ContributionCodes& in, std::size_t n, const FloatGrid& g, float* d_sum,
                    void* stream) {
  if (n == 0) return Status::Ok();
  // d_sum stands in for the codes' destination in the checks (non-null).
  CPD_RETURN_IF_ERROR(
      CheckContributions(in, n, g, reinterpret_cast<const std::uint8_t*>(d_sum), "SumCodesCuda"));
  SumArgs a = MakeSumArgs(in, n, g, nullptr);
  a.words = a.bits % 4 == 0 && Aligned4(in.codes) && in.stride % 4 == 0;
  a.sum_out = d_sum;
  return LaunchSum<RoundMode::kNearestEven, SumKind::kFloat>(a, static_cast<cudaStream_t>(stream));
}

Status SumRoundedCodesCuda(const ContributionCodes& in, std::size_t n, const FloatGrid& g,
                           const EmulateRounding& r, std::uint8_t* d_dst, void* stream) {
  if (n == 0) return Status::Ok();
  CPD_RETURN_IF_ERROR(CheckContributions(in, n, g, d_dst, "SumRoundedCodesCuda"));
  if (r.mode != RoundMode::kNearestEven && r.mode != RoundMode::kStochastic &&
      r.mode != RoundMode::kTowardZero) {
    return Status::InvalidArgument(
        "SumRoundedCodesCuda: rounding must be nearest-even, stochastic or toward zero");
  }
  SumArgs a = MakeSumArgs(in, n, g, d_dst);
  a.seed = r.seed;
  a.step = r.step;
  a.index_base = r.index_base;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (r.kahan) return LaunchSumForMode<SumKind::kKahan>(r.mode, a, s);
  return LaunchSumForMode<SumKind::kRounded>(r.mode, a, s);
}

}  // namespace cpd::comm::internal
