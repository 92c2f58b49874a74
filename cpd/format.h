// Number formats named by spec strings, e.g. "e4m3", "e5m2:inf", "bf16", "int8:ch",
// "uint4:minmax", "fp134:room=2", "log4", "log4:ch", "mxfp4", "bfp8:16", "binades:5,5,4x5,3,2,1,0",
// "nvfp4", "e4m3:block=1x128", "e2m1:block=16x16:scale=e4m3:tensor".
// See FormatSpecHelp() for the grammar. A Format is an immutable value, cheap to copy and safe to
// share between threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cpd/status.h"
#include "kernels/grid.h"

namespace cpd {

enum class FormatFamily {
  kFloat32,       // identity (optionally flushing subnormals)
  kFloat,         // a fixed float grid: fp16, bf16, eXmY, OCP e4m3/e5m2/e3m2/e2m3/e2m1
  kSharedShift,   // a float grid under a power-of-two shift per tensor, channel or block:
                  // fp134/fp143/fp152, log<b>, mxfp8/6/4, bfp<b>
  kIntSymmetric,  // int<b>: q in [-(2^(b-1)-1), 2^(b-1)-1], scale = max|x| / (2^(b-1)-1)
  kUintMinMax,    // uint<b>:minmax (CPT): q in [0, 2^b-1], scale = (max-min)/(2^b-1)
  kBinades,       // binades:M0,M1,...: M_i mantissa bits in binade i from the top, under a
                  // power-of-two shift per tensor or channel (kernels::BinadeGrid)
  kBlockScaled,   // ELEMENT:block=RxC[:scale=S][:tensor]: a float element grid under a scale per
                  // R x C block of the tensor viewed as a row-major matrix (QuantizeOptions::
                  // columns), the scale float32, a power of two (E8M0) or on a float grid (E4M3),
                  // optionally under a float32 tensor level: nvfp4, DeepSeek-V3's FP8 tiles
};

// How a kBlockScaled format's block scales are chosen and stored (kernels/grid.h, BlockScale).
enum class BlockScaleType {
  kPow2,       // scale=e8m0: 2^(floor(log2 amax) - emax of the element), OCP MX's rule and byte
  kFloat32,    // scale=fp32: elem_max / amax exactly, stored as float32 (DeepSeek-V3)
  kFloatGrid,  // scale=e4m3 (or another float format): amax / elem_max rounded onto its grid,
               // under the tensor level with :tensor (NVFP4)
};

// Which elements share one scale.
enum class ScaleScope {
  kNone,     // fixed formats
  kTensor,   // the whole span
  kChannel,  // each of QuantizeOptions::channels equal, contiguous rows (output channels)
  kBlock,    // consecutive blocks of block_size() elements (the last may be shorter)
};

// What `cpd-quant info` prints. For scaled formats the values are at unit scale (shift 0 or
// scale 1) and `scale_note` says how they scale.
struct FormatInfo {
  int bits = 0;  // bits per element code
  double max_finite = 0;
  double min_normal = 0;         // smallest positive normal (0 if none)
  double min_subnormal = 0;      // smallest positive subnormal (0 if none)
  uint64_t distinct_finite = 0;  // distinct finite values, +0 and -0 counted once
  std::string scale_note;        // empty for fixed formats
};

// The block side of ':block=tensor', larger than any matrix view CPD quantises (a span has fewer
// than 2^31 rows and columns), so that the whole view is one block.
inline constexpr size_t kWholeTensorBlock = size_t(1) << 31;

// What a spec decides about its Format, the spelling aside: the family parsers in format.cc fill
// one, and a Format keeps it whole (Format::Parse is the only way to make one), so a new property
// is a member here and an accessor in Format. Read a Format's accessors, not this.
struct FormatFields {
  FormatFamily family = FormatFamily::kFloat32;
  ScaleScope scope = ScaleScope::kNone;
  int bits = 32;
  size_t block_size = 0;
  kernels::FloatGrid grid{};
  kernels::ShiftRule shift_rule{0, 0, 0};
  bool flush_subnormals = false;
  bool scope_by_layer = false;
  // Shared, so that a Format stays cheap to copy (the table is half a kilobyte).
  std::shared_ptr<const kernels::BinadeGrid> binade_grid;
  size_t block_rows = 0, block_cols = 0;
  BlockScaleType scale_type = BlockScaleType::kPow2;
  kernels::FloatGrid scale_grid{};
  int scale_bits = 0;
  bool tensor_level = false;
};

class Format {
 public:
  // Parses a spec; errors name the bad part and list what is accepted.
  static Result<Format> Parse(std::string_view spec);

  const std::string& spec() const { return spec_; }  // canonical spelling
  FormatFamily family() const { return fields_.family; }
  ScaleScope scope() const { return fields_.scope; }
  // True for a log<b> spec without :ch or :tensor, whose grouping a training run's precision
  // policy picks per layer (runtime/nn/quant_sites.h, after Lee et al., ICLR 2022: per output
  // channel for convolutions, per tensor otherwise). scope() is then kTensor, what the format
  // means where no layer is known (cpd-quant, the all-reduce).
  bool scope_by_layer() const { return fields_.scope_by_layer; }
  int bits() const { return fields_.bits; }
  // Elements per block: kBlock formats; R * C for kBlockScaled.
  size_t block_size() const { return fields_.block_size; }
  // kBlockScaled: the block shape (rows x columns of the matrix view), how scales are chosen,
  // the scale's grid (kFloatGrid) and code bits, and whether a float32 tensor level sits above.
  size_t block_rows() const { return fields_.block_rows; }
  size_t block_cols() const { return fields_.block_cols; }
  // ':block=tensor': one block over the whole matrix view (a per-tensor scale, as FP8 training
  // with per-tensor scaling uses): both sides kWholeTensorBlock.
  bool whole_tensor_block() const { return fields_.block_rows == kWholeTensorBlock; }
  BlockScaleType scale_type() const { return fields_.scale_type; }
  const kernels::FloatGrid& scale_grid() const { return fields_.scale_grid; }
  int scale_bits() const { return fields_.scale_bits; }
  bool tensor_level() const { return fields_.tensor_level; }
  bool is_float_grid() const {
    return family() == FormatFamily::kFloat32 || family() == FormatFamily::kFloat ||
           family() == FormatFamily::kSharedShift;
  }
  // The element grid of float formats (unscaled; fp32 is the e8m23 identity grid).
  const kernels::FloatGrid& grid() const { return fields_.grid; }
  // The grid of kBinades formats (unscaled: top binade [1, 2)); an empty grid (count 0) for
  // the other families.
  const kernels::BinadeGrid& binade_grid() const;
  // Mantissa bits per binade of kBinades formats, from the top binade down (empty otherwise).
  std::vector<int> binade_mbits() const;
  // How kSharedShift and kBinades formats choose their shift from a group's max |x|.
  const kernels::ShiftRule& shift_rule() const { return fields_.shift_rule; }
  bool flush_subnormals() const { return fields_.flush_subnormals; }  // kFloat32 with :nosub

  // Bytes of scale metadata per group (0 for fixed formats), and per tensor (the float32 tensor
  // level of a kBlockScaled format with :tensor; 0 otherwise).
  size_t meta_bytes_per_group() const;
  size_t meta_bytes_per_tensor() const { return tensor_level() ? 4 : 0; }
  // Number of scale groups for a span of n elements viewed as `channels` rows; kBlockScaled
  // views it as rows of `columns` elements (0: n / channels) and counts its R x C blocks.
  size_t num_groups(size_t n, size_t channels, size_t columns = 0) const;

  FormatInfo Info() const;
  // Every distinct finite value at unit scale, ascending (-0 omitted). Formats of <= 16 bits.
  Result<std::vector<float>> Values() const;

 private:
  std::string spec_;
  FormatFields fields_;
};

// The matrix view of a kBlockScaled format's span: rows of `columns` elements (0: n / channels).
struct BlockGridShape {
  size_t rows = 0, cols = 0;              // of the matrix
  size_t block_rows = 0, block_cols = 0;  // blocks along each
};
BlockGridShape BlockGridOf(const Format& format, size_t n, size_t channels, size_t columns);

// One paragraph listing every accepted spec, for --help and error messages.
const char* FormatSpecHelp();

// Splits a comma-separated list of specs. A binades list holds commas itself, so a piece that
// starts with a digit continues the spec before it: "fp134,binades:4x7,3,2,1,0,e4m3" is three
// specs. Empty pieces are dropped; the specs are not checked.
std::vector<std::string> SplitFormatList(std::string_view list);

}  // namespace cpd
