// The gradient all-reduce on device memory (GradientAllReduceOptions::gradients = kDevice): the
// host path's plan (comm/allreduce/plan.h), setup, rounding streams, APS shifts and statistics,
// with the element loops as CUDA kernels (comm/reduce_kernels_cuda.h) and the payloads moved by
// a DeviceTransport (comm/allreduce/device_transport.h). A bucket's stages mirror
// comm/allreduce/codes.h: encode the contributions (shift, round, pack), all-to-all, sum this
// rank's chunk (packed: decode + float32 sum + one rounding; emulate: rounded after every
// addition, or Kahan) and pack it, all-gather, decode and unshift. Internal to comm/.
#pragma once

#include <memory>

#include "comm/allreduce/internal.h"
#include "comm/gradient_allreduce.h"
#include "cpd/status.h"

namespace cpd::comm::internal {

// Ok when the device path implements setup's algorithm and format (fp32, or a fixed float grid
// of <= 16 bits); else InvalidArgument naming the format and what is supported.
Status CheckDeviceSupport(const ReducerSetup& setup);

// The reducer for device gradients: Unavailable in a build without CUDA; else allocates its
// device buffers and transport on the current device.
Result<std::unique_ptr<GradientAllReducer>> CreateDeviceReducer(ReducerSetup setup);

}  // namespace cpd::comm::internal
