// Emulated accumulation precision of matrix products (cpd-train --accumulate; issue 29):
// FORMAT[:every=N][:round=nearest|toward-zero]. The numeric rule is kernels/accumulate.h's.
#pragma once

#include <string>
#include <string_view>

#include "cpd/status.h"
#include "kernels/accumulate.h"

namespace cpd {

// The largest promotion interval accepted (far beyond any product's depth).
inline constexpr int64_t kMaxAccumulateEvery = int64_t(1) << 30;

// "e8m13:every=128" (DeepSeek-V3's 14 significant bits, promoted every 128 products),
// "e8m13" (never promoted), "fp16:every=32:round=toward-zero". FORMAT is a fixed float format
// (eXmY, fp16, bf16, fp32, OCP FP8); scaled and integer formats are refused.
Result<kernels::Accumulation> ParseAccumulation(std::string_view spec);

}  // namespace cpd
