// Number formats named by spec strings, e.g. "e4m3", "e5m2:inf", "bf16", "int8:ch",
// "uint4:minmax", "fp134:room=2", "log4", "log4:ch", "mxfp4", "bfp8:16", "binades:5,5,4x5,3,2,1,0".
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

class Format {
 public:
  // Parses a spec; errors name the bad part and list what is accepted.
  static Result<Format> Parse(std::string_view spec);

  const std::string& spec() const { return spec_; }  // canonical spelling
  FormatFamily family() const { return family_; }
  ScaleScope scope() const { return scope_; }
  // True for a log<b> spec without :ch or :tensor, whose grouping a training run's precision
  // policy picks per layer (runtime/nn/quant_sites.h, after Lee et al., ICLR 2022: per output
  // channel for convolutions, per tensor otherwise). scope() is then kTensor, what the format
  // means where no layer is known (cpd-quant, the all-reduce).
  bool scope_by_layer() const { return scope_by_layer_; }
  int bits() const { return bits_; }
  size_t block_size() const { return block_size_; }
  bool is_float_grid() const {
    return family_ == FormatFamily::kFloat32 || family_ == FormatFamily::kFloat ||
           family_ == FormatFamily::kSharedShift;
  }
  // The element grid of float formats (unscaled; fp32 is the e8m23 identity grid).
  const kernels::FloatGrid& grid() const { return grid_; }
  // The grid of kBinades formats (unscaled: top binade [1, 2)); an empty grid (count 0) for
  // the other families.
  const kernels::BinadeGrid& binade_grid() const;
  // Mantissa bits per binade of kBinades formats, from the top binade down (empty otherwise).
  std::vector<int> binade_mbits() const;
  // How kSharedShift and kBinades formats choose their shift from a group's max |x|.
  const kernels::ShiftRule& shift_rule() const { return shift_rule_; }
  bool flush_subnormals() const { return flush_subnormals_; }  // kFloat32 with :nosub

  // Bytes of scale metadata per group (0 for fixed formats).
  size_t meta_bytes_per_group() const;
  // Number of scale groups for a span of n elements viewed as `channels` rows.
  size_t num_groups(size_t n, size_t channels) const;

  FormatInfo Info() const;
  // Every distinct finite value at unit scale, ascending (-0 omitted). Formats of <= 16 bits.
  Result<std::vector<float>> Values() const;

 private:
  std::string spec_;
  FormatFamily family_ = FormatFamily::kFloat32;
  ScaleScope scope_ = ScaleScope::kNone;
  int bits_ = 32;
  size_t block_size_ = 0;
  kernels::FloatGrid grid_{};
  kernels::ShiftRule shift_rule_{0, 0, 0};
  bool flush_subnormals_ = false;
  bool scope_by_layer_ = false;
  // Shared, so that a Format stays cheap to copy (the table is half a kilobyte).
  std::shared_ptr<const kernels::BinadeGrid> binade_grid_;
};

// One paragraph listing every accepted spec, for --help and error messages.
const char* FormatSpecHelp();

// Splits a comma-separated list of specs. A binades list holds commas itself, so a piece that
// starts with a digit continues the spec before it: "fp134,binades:4x7,3,2,1,0,e4m3" is three
// specs. Empty pieces are dropped; the specs are not checked.
std::vector<std::string> SplitFormatList(std::string_view list);

}  // namespace cpd
