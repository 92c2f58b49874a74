// CUDA kernels of the codec: quantise-and-pack (encode) and unpack-and-dequantise (decode) of the
// packed tensor layout of cpd::PackedTensor (cpd/quantize.h), plus the scale metadata. Launchers
// callable from plain C++, in the style of kernels/cuda/quantize.h (whose CudaResult,
// GroupLayout, RandomParams and StatsTarget they take): each checks its sizes, launches on
// `stream` (a cudaStream_t; nullptr = the legacy default stream), never synchronises and never
// aborts. The cpd layer (cpd/quantize_cuda.cc) computes the scales with the quantiser's
// reductions and turns results into cpd::Status.
//
// Layout, as the CPU's PackCodes: code i occupies bits [i*bits, (i+1)*bits) of the byte stream,
// little-endian; the last byte's unused high bits are zero. One thread packs 8 consecutive codes,
// which fill exactly `bits` whole bytes, so threads never share a byte and no atomics are needed.
// Four codes of 4, 8, 16 or 32 bits fill whole bytes: between a 16-byte aligned float buffer and
// codes aligned to four of them, a thread takes four elements, one 16-byte float access and one
// 2- to 16-byte code access, so each warp's accesses are contiguous.
// The rounding is the quantiser's element operations (kernels/cuda/common.cuh), so a code's value
// is what QuantizeCuda writes for the element, bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/quantize.h"
#include "kernels/grid.h"

namespace cpd::kernels::cuda {

// Widest code a packed tensor holds (fp32's).
constexpr int kMaxCodeBits = 32;

// ---- Encode: codes of n elements into dst[0, (n * bits + 7) / 8) -------------------------------

// Float grids under a shift per group (shifts null: shift 0 everywhere, fixed formats); codes as
// kernels::RoundToFloatGrid writes them. Modes: kNearestEven, kStochastic, kTowardZero.
CudaResult LaunchEncodeFloatGrid(const float* in, size_t n, int bits, const FloatGrid& g,
                                 const int32_t* shifts, GroupLayout groups, RoundMode mode,
                                 RandomParams rng, StatsTarget stats, uint8_t* dst, void* stream);

// Per-binade grids (d_grid in device memory, LaunchStoreBinadeGrid) under a shift per group.
CudaResult LaunchEncodeBinadeGrid(const float* in, size_t n, int bits, const BinadeGrid* d_grid,
                                  const int32_t* shifts, GroupLayout groups, RoundMode mode,
                                  RandomParams rng, StatsTarget stats, uint8_t* dst, void* stream);

// Linear grids (int<b>, uint<b>:minmax): code = q - qmin.
CudaResult LaunchEncodeLinearGrid(const float* in, size_t n, int bits, const LinearGrid* grids,
                                  GroupLayout groups, RoundMode mode, RandomParams rng,
                                  StatsTarget stats, uint8_t* dst, void* stream);

// Block-scaled formats (quantize.h MatrixBlocks): codes as kernels::QuantizeScaledFloatGridRow
// writes them, under the scales of LaunchBlockScalesFromData (which writes the metadata).
CudaResult LaunchEncodeBlockScaled(const float* in, size_t n, int bits, const FloatGrid& g,
                                   const BlockScale* scales, const MatrixBlocks& blocks,
                                   RoundMode mode, RandomParams rng, StatsTarget stats,
                                   uint8_t* dst, void* stream);

// ---- Decode: n elements from the codes at src
// ----------------------------------------------------

// out[i] = DecodeFloatGrid(code i) * 2^shift (shifts null: shift 0), NaN kept as decoded.
CudaResult LaunchDecodeFloatGrid(const uint8_t* src, size_t n, int bits, const FloatGrid& g,
                                 const int32_t* shifts, GroupLayout groups, float* out,
                                 void* stream);
CudaResult LaunchDecodeBinadeGrid(const uint8_t* src, size_t n, int bits, const BinadeGrid* d_grid,
                                  const int32_t* shifts, GroupLayout groups, float* out,
                                  void* stream);
// out[i] = LinearValue(code i + qmin, grid of i).
CudaResult LaunchDecodeLinearGrid(const uint8_t* src, size_t n, int bits, const LinearGrid* grids,
                                  GroupLayout groups, float* out, void* stream);

// out[i] = ScaledValue(DecodeFloatGrid(code i), scales[block of i]).
CudaResult LaunchDecodeBlockScaled(const uint8_t* src, size_t n, int bits, const FloatGrid& g,
                                   const BlockScale* scales, const MatrixBlocks& blocks, float* out,
                                   void* stream);

// ---- Scale metadata (kernels::ShiftMetaByte, StoreLinearMeta; any alignment of dst/src) -------
// The encoder's metadata is written with the scales themselves (LaunchScalesFromData's
// ScaleOutput::meta); the decoder reads it back here.

// shifts[g] = ShiftFromMetaByte(src[g], e8m0).
CudaResult LaunchReadShiftMeta(const uint8_t* src, size_t num_groups, bool e8m0, int32_t* shifts,
                               void* stream);
// grids[g] = LoadLinearMeta(src + g * (minmax ? 8 : 4), minmax, bits).
CudaResult LaunchReadLinearMeta(const uint8_t* src, size_t num_groups, bool minmax, int bits,
                                LinearGrid* grids, void* stream);

// scales[b] from a block-scaled tensor's metadata at src (rule.meta_bytes per block, then T as
// float32 with a tensor level: StoreFloatMeta / StoreCodeMeta's layout).
CudaResult LaunchReadBlockScaleMeta(const uint8_t* src, size_t num_blocks,
                                    const BlockScaleRule& rule, BlockScale* scales, void* stream);

}  // namespace cpd::kernels::cuda
