// Internal to the CPU convolution (cpu_conv.cc): the direct AVX-512 3x3 path of
// cpu_conv_direct.cc, which Conv2dForward/Backward run where Conv2dPath chooses it.
#pragma once

#include <cstdint>

#include "runtime/engine/conv_shape.h"

namespace cpd::runtime::cpu::internal {

// Whether the direct kernels can compute `s` on this CPU (ConvPathRuns(kDirect, s)).
bool DirectEligible(const ConvShape& s);

// Conv2dForward on the direct path, on `team` threads. REQUIRED: DirectEligible(s).
void DirectConv2dForward(const ConvShape& s, const float* x, const float* w, const float* bias,
                         float* y, ConvWorkspace* ws, int team);

// Conv2dBackward's dx (when non-null) and dw on the direct path, on `team` threads. Thread t
// accumulates into parts + t * part (zeroed by the caller): its weight-gradient lanes
// [oc, c * 9, 16], then the bias-gradient sums [oc] of its images, which the caller adds up.
// REQUIRED: DirectEligible(s).
void DirectConv2dBackward(const ConvShape& s, const float* x, const float* w, const float* dy,
                          float* dx, float* dw, int team, float* parts, int64_t part,
                          ConvWorkspace* ws);

}  // namespace cpd::runtime::cpu::internal
