// Device twins of the quantised all-reduce's element loops (comm/reduce_kernels.h and the
// per-chunk arithmetic of comm/allreduce/{packed,emulate}.cc), for gradients in device memory
// (only in a CUDA build: CPD_WITH_CUDA). Each function computes, bit for bit, what the CPU
// reducer computes for the same span: the same per-element math (kernels/grid.h), the same order
// of additions (worker order), the same stochastic-rounding streams (comm/allreduce/streams.h,
// counter-based: element i of a stream draws RandomBits(key, i) wherever it runs). The plan
// (buckets, chunks, segments, pieces) stays the CPU reducer's; these are its kernels.
//
// Pointers are device pointers (or memory the device can access) on the current device. Work is
// queued on `stream` (a cudaStream_t; nullptr = the legacy default stream); nothing waits and
// nothing is allocated. Invalid arguments are InvalidArgument before any work is queued; CUDA
// launch failures are Internal. Internal to comm/.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpd/config.h"

#if CPD_WITH_CUDA

#include "comm/reduce_kernels.h"
#include "cpd/status.h"
#include "kernels/grid.h"
#include "kernels/quantize_cpu.h"

namespace cpd::comm::internal {

// ---- APS: the scan and the shift ----------------------------------------------------------------

// ScanAbs on the device: merges into *d_max_bits (max) the largest |x| over d_x[0, n) as float32
// bits with the sign cleared (NaN > Inf > every finite value, so a result >= 0x7f800000 means a
// non-finite element) and adds to *d_nonzero the number of nonzero elements (NaN and Inf
// included). Integer max and sum do not depend on the order of the merges, so the result is
// ScanAbs's exactly. Call once per layer with that layer's counters.
Status ScanAbsCuda(const float* d_x, std::size_t n, std::uint32_t* d_max_bits,
                   std::uint64_t* d_nonzero, void* stream);

// d_x[i] *= scale over [0, n): a layer's APS shift (scale = 2^s, StepContext::ApplyShift) or its
// inverse (2^-s, Unshift). A NaN keeps its bits, as the CPU's multiply keeps them.
Status ScaleCuda(float* d_x, std::size_t n, float scale, void* stream);

// ---- Contributions in, results out: codes of spans that cross layers -------------------------

// The layers of the flat gradient buffer on the device, for kernels whose spans cross layer
// boundaries (a chunk holds several layers' segments): element i (a flat index) belongs to the
// layer l with offsets[l] <= i < offsets[l + 1] (GradientLayout::offsets, uploaded), whose APS
// shift is shifts[l] (0 without APS).
struct DeviceLayers {
  const std::uint64_t* offsets = nullptr;  // layers + 1 entries
  const std::int32_t* shifts = nullptr;    // layers entries
  int layers = 0;
};

// One contribution's span of n elements (d_x[0, n), flat indices index_base...), each times
// 2^shift of its layer, rounded onto g with `mode` (kNearestEven, kStochastic, kTowardZero) and
// the stream `key` at its flat index, packed to d_dst (cpd::PackCodes' layout; index_base and
// d_dst as a chunk starts: the span's codes start on a byte). What CodeTransport's
// EncodeContributions writes to the all-to-all's send slot, bit for bit. With d_counters
// non-null (2 per layer, device memory), adds per layer the flushed (nonzero x whose code has
// magnitude 0) and saturated (|x * 2^s| above the largest finite value) elements, as
// EncodeCodes8/16 count them: integer atomics, so the counts are exact.
Status EncodeContributionCuda(const float* d_x, std::size_t n, std::uint64_t index_base,
                              const DeviceLayers& layers, const kernels::FloatGrid& g,
                              kernels::RoundMode mode, std::uint64_t key, std::uint8_t* d_dst,
                              std::uint64_t* d_counters, void* stream);

// The inverse for a reduced chunk: d_out[j] = value of code j times 2^-shift of its layer (a NaN
// keeps the decoded canonical NaN's bits, as the CPU's multiply does), what CodeTransport's
// DecodeResults writes.
Status DecodeUnshiftCuda(const std::uint8_t* d_src, std::size_t n, std::uint64_t index_base,
                         const DeviceLayers& layers, const kernels::FloatGrid& g, float* d_out,
                         void* stream);

// ---- The reduction of a chunk from its W packed contributions ---------------------------------

// The W contributions to one span of a chunk after the all-to-all: worker w's n packed codes
// (cpd::PackCodes' layout, 1 + ebits + mbits bits each) start at codes + w * stride. Spans start
// on a code that is a multiple of 8 (pieces and chunks do), so on a byte.
struct ContributionCodes {
  const std::uint8_t* codes = nullptr;
  std::size_t stride = 0;  // bytes from one worker's codes to the next (the exchange slot)
  int workers = 0;         // W >= 1
};

// packed: decodes the W contributions of n elements, sums them in float32 in worker order
// (sum = q_0, then sum += q_w), rounds the sum once onto g with p (mode, key = the stream of
// RequantizeStage(W), index_base = the flat index of element 0) and packs the codes to d_dst:
// what PackedCodes::SumAndRequantizeOwnChunk writes to the all-gather's send slot. Modes as
// EncodeCodes8/16: kStochastic, kTowardZero, anything else nearest-even.
Status SumRequantizeCodesCuda(const ContributionCodes& in, std::size_t n,
                              const kernels::FloatGrid& g, const kernels::LoopParams& p,
                              std::uint8_t* d_dst, void* stream);

// packed with APS sum scaling: the same float32 sums in worker order, not rounded, stored to
// d_sum[0, n) (what PackedCodes' sum scaling sums before it picks each segment's shift; the
// rounding of sum * 2^t is then EncodeContributionCuda with the segments as its "layers").
Status SumCodesCuda(const ContributionCodes& in, std::size_t n, const kernels::FloatGrid& g,
                    float* d_sum, void* stream);

// emulate: the W contributions of n elements summed in worker order with the sum rounded onto g
// after every addition (sum = Q(sum + q_w)), or, with kahan, Kahan's compensated sum with every
// operation rounded (y = Q(q_w - c), t = Q(sum + y), c = Q(Q(t - sum) - y), sum = t); the
// rounding of worker w's addition uses `mode` and the stream of AdditionStage(W, w[, op]) under
// (seed = options.seed, step), counted from index_base, the flat index of element 0. The codes
// of the final sum (which is on the grid) are packed to d_dst: what EmulateCodes::SumOwnChunk
// writes to the all-gather's send slot. Modes: kNearestEven, kStochastic, kTowardZero.
struct EmulateRounding {
  kernels::RoundMode mode = kernels::RoundMode::kNearestEven;
  bool kahan = false;
  std::uint64_t seed = 0;  // GradientAllReduceOptions::seed
  std::int64_t step = 0;
  std::uint64_t index_base = 0;
};
Status SumRoundedCodesCuda(const ContributionCodes& in, std::size_t n, const kernels::FloatGrid& g,
                           const EmulateRounding& r, std::uint8_t* d_dst, void* stream);

// ---- Element-wise arithmetic of the scaled formats (MX, int, bfp)
// --------------------------------

// Formats other than fixed float grids travel as cpd::Encode'd segments (packed) or quantised
// float32 values (emulate); their roundings are cpd::QuantizeCuda / EncodeCuda of whole segments
// and only the float32 arithmetic between them is the reducer's own: out[i] = a[i] + b[i]
// (kAdd) or a[i] - b[i] (kSubtract), as the loops of PackedSegments and EmulateFloats compute
// them. Equal to the CPU's for every result that is not NaN; a NaN stays a NaN (its payload may
// differ from x86's), and every rounding that follows maps it to the format's one NaN. out may
// equal a or b.
Status CombineCuda(const float* d_a, const float* d_b, float* d_out, std::size_t n, ElementOp op,
                   void* stream);

}  // namespace cpd::comm::internal

#endif  // CPD_WITH_CUDA
