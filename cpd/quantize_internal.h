// Pieces shared by the CPU (quantize.cc) and CUDA (quantize_cuda.cc) drivers. Not public API.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>

#include "cpd/format.h"
#include "cpd/quantize.h"
#include "kernels/grid.h"

namespace cpd::internal {

inline kernels::RoundMode RoundModeFor(Rounding r) {
  switch (r) {
    case Rounding::kNearest:
      return kernels::RoundMode::kNearestEven;
    case Rounding::kStochastic:
      return kernels::RoundMode::kStochastic;
    case Rounding::kZero:
      return kernels::RoundMode::kTowardZero;
  }
  return kernels::RoundMode::kNearestEven;
}

// The argument checks every quantiser applies before any work.
inline Status ValidateSpan(const Format& format, size_t n, const QuantizeOptions& opts) {
  if (opts.channels == 0) return Status::InvalidArgument("channels must be >= 1");
  // Per-channel storage is sized by the channel count: every channel holds at least one
  // element, so it never exceeds the data (an empty span is one empty channel).
  if (format.scope() == ScaleScope::kChannel && opts.channels > std::max<size_t>(n, 1)) {
    return Status::InvalidArgument("format '" + format.spec() + "' scales per channel, but " +
                                   std::to_string(opts.channels) + " channels exceed the " +
                                   std::to_string(n) +
                                   " elements (accepted: 1 up to the element count)");
  }
  if (format.family() == FormatFamily::kBlockScaled) {
    const size_t cols = opts.columns > 0 ? opts.columns : n / opts.channels;
    if (n > 0 && (cols == 0 || n % cols != 0 || (opts.columns == 0 && n % opts.channels != 0))) {
      return Status::InvalidArgument(
          "format '" + format.spec() + "' scales blocks of a matrix, but " + std::to_string(n) +
          " elements are not whole rows of " +
          (opts.columns > 0 ? std::to_string(opts.columns) + " columns"
                            : std::to_string(opts.channels) + " equal channels"));
    }
  }
  if (format.scope() == ScaleScope::kChannel && n % opts.channels != 0) {
    return Status::InvalidArgument("format '" + format.spec() + "' scales per channel, but " +
                                   std::to_string(n) + " elements do not split into " +
                                   std::to_string(opts.channels) + " equal channels");
  }
  return Status::Ok();
}

// Elements per scale group (the last block may be shorter).
inline size_t GroupLength(const Format& format, size_t n, size_t channels) {
  switch (format.scope()) {
    case ScaleScope::kNone:
    case ScaleScope::kTensor:
      return n;
    case ScaleScope::kChannel:
      return n / channels;
    case ScaleScope::kBlock:
      return format.block_size();
  }
  return n;
}

// Whether a shifted format's metadata byte is MX's E8M0 scale (kernels::ShiftMetaByte): MX is
// the one block format whose shifts reach down to -127.
inline bool ShiftMetaIsE8M0(const Format& format) {
  return format.scope() == ScaleScope::kBlock && format.shift_rule().lo == -127;
}

// Whether a linear format's metadata holds an offset too (kernels::StoreLinearMeta).
inline bool LinearMetaHasOffset(const Format& format) {
  return format.family() == FormatFamily::kUintMinMax;
}

}  // namespace cpd::internal
