// Quantising float32 spans to a Format, on the CPU (and, in a CUDA build, on the GPU:
// cpd/quantize_cuda.h), with fused statistics; encoding to densely packed codes and back.
//
// Thread-safety: every function here is re-entrant. Results, statistics included, depend only
// on the inputs and options, never on the thread count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "cpd/format.h"
#include "cpd/status.h"

namespace cpd {

enum class Rounding {
  kNearest,     // to nearest, ties to even (default)
  kStochastic,  // up with probability proportional to the distance from the lower neighbour
  kZero,        // toward zero (truncate)
};

Result<Rounding> ParseRounding(std::string_view name);  // "nearest" | "stochastic" | "zero"
const char* RoundingName(Rounding r);

struct QuantizeOptions {
  Rounding rounding = Rounding::kNearest;
  // Stochastic rounding draws from a counter-based stream: the random bits of element i depend
  // only on (seed, step, index_offset + i).
  uint64_t seed = 0;
  uint64_t step = 0;
  uint64_t index_offset = 0;
  // The span is viewed as `channels` contiguous rows of equal length (e.g. the output channels of
  // a weight tensor). Used by :ch formats (log<b>:ch too); n must be a multiple of it. Default 1.
  size_t channels = 1;
  // Block-scaled formats (nvfp4, FLOAT:block=RxC) view the span as a row-major matrix with rows
  // of `columns` elements (a tensor's last dimension); 0: n / channels (a weight's fan-in).
  // n must be a multiple of it. Blocks at the matrix's right and bottom edges are partial (as if
  // zero-padded: padding never changes a block's max |x|).
  size_t columns = 0;
  // Worker threads; 0 = all available cores.
  int threads = 0;
};

// Statistics of one quantisation, all over the input elements.
struct QuantStats {
  uint64_t count = 0;
  float max_abs = 0.0f;    // largest |x| over non-NaN inputs
  uint64_t saturated = 0;  // beyond the largest finite value (clamped, or Inf/NaN with :inf),
                           // +-Inf inputs included
  uint64_t flushed = 0;    // nonzero finite inputs that became zero
  uint64_t nonfinite = 0;  // NaN or Inf inputs
  double sq_error = 0.0;   // sum of (q - x)^2 over finite inputs with finite outputs
  double sq_input = 0.0;   // sum of x^2 over the same elements
  double relative_error() const;  // sqrt(sq_error / sq_input), 0 for an all-zero input
};

// Quantises n floats. `out` may equal `in` (in place). `stats` may be null.
Status Quantize(const Format& format, const float* in, float* out, size_t n,
                const QuantizeOptions& opts = {}, QuantStats* stats = nullptr);

// Hysteresis rounding for weights (Lee et al., ICLR 2022): with q holding the previous quantised
// weights Q_{t-1}, sets q[i] = ceil_grid(w[i]) if w[i] < q[i], else floor_grid(w[i]), so a value
// moves only after the weight crosses a full grid step. The grid (scales) is chosen from w as in
// Quantize. opts.rounding is ignored. `flips` (may be null) receives how many q[i] changed.
// For the first step, initialise q with Quantize().
Status QuantizeHysteresis(const Format& format, const float* w, float* q, size_t n,
                          const QuantizeOptions& opts = {}, QuantStats* stats = nullptr,
                          uint64_t* flips = nullptr);

// Weight flips of a quantisation without hysteresis: how many of q[i] differ from prev[i] (the
// same weights quantised at the step before), bit for bit, as QuantizeHysteresis counts them.
// InvalidArgument for a null buffer with n > 0.
Result<uint64_t> CountFlips(const float* prev, const float* q, size_t n);

// A quantised tensor as it travels: densely packed `bits`-bit codes, little-endian bit order
// (code i occupies bits [i*bits, (i+1)*bits) of the byte stream), followed by the scale
// metadata of each group (Format::meta_bytes_per_group() bytes each, in group order).
// Block-scaled formats put their per-block metadata in block order (row-major over the blocks),
// then the tensor level (float32) if the format has one.
struct PackedTensor {
  size_t count = 0;
  size_t channels = 1;
  size_t columns = 0;  // as QuantizeOptions::columns
  std::vector<uint8_t> bytes;
};

size_t PackedCodeBytes(const Format& format, size_t n);
size_t PackedSize(const Format& format, size_t n, size_t channels, size_t columns = 0);

// Quantises and encodes in one pass. Decode(Encode(x)) equals Quantize(x) bit for bit.
Status Encode(const Format& format, const float* in, size_t n, const QuantizeOptions& opts,
              PackedTensor* out, QuantStats* stats = nullptr);
// Decodes into out[0..packed.count). Fails on a size that does not match the format.
Status Decode(const Format& format, const PackedTensor& packed, float* out, int threads = 0);

// Bit packing of codes (each < 2^bits, 1 <= bits <= 32) into/out of a byte stream.
void PackCodes(const uint32_t* codes, size_t n, int bits, uint8_t* dst);
void UnpackCodes(const uint8_t* src, size_t n, int bits, uint32_t* codes);

}  // namespace cpd
