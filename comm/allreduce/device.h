// The gradient all-reduce on device memory (GradientAllReduceOptions::gradients = kDevice): the
// host path's plan (comm/allreduce/plan.h), setup, rounding streams, APS shifts and statistics,
// with the element loops as CUDA kernels (comm/reduce_kernels_cuda.h) and the payloads moved by
// a DeviceTransport (comm/allreduce/device_transport.h). A bucket's stages mirror
// comm/allreduce/codes.h: encode the contributions (shift, round, pack), all-to-all, sum this
// rank's chunk (packed: decode + float32 sum + one rounding; emulate: rounded after every
// addition, or Kahan) and pack it, all-gather, decode and unshift. Formats other than fixed float
// grids of <= 16 bits take the host path's other stages (packed.cc's PackedSegments, emulate.cc's
// EmulateFloats) with cpd::EncodeCuda / DecodeCuda / QuantizeCuda per segment. Internal to comm/.
#pragma once

#include <memory>

#include "comm/allreduce/internal.h"
#include "comm/gradient_allreduce.h"
#include "cpd/status.h"

namespace cpd::comm::internal {

// The reducer for device gradients: Unavailable in a build without CUDA; else allocates its
// device buffers and transport on the current device.
Result<std::unique_ptr<GradientAllReducer>> CreateDeviceReducer(ReducerSetup setup);

}  // namespace cpd::comm::internal
