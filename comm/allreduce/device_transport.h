// How the device back end of the gradient all-reduce (comm/allreduce/device_backend.cc) moves the
// payloads of its blocking collectives: the collectives of the host path (all-to-all and
// all-gather of packed bytes, fp32's sum all-reduce, the small per-layer all-reduces) on device
// buffers, over either kind of communicator:
//   direct  a device-memory communicator (NcclCommunicator) gets the device buffers;
//   staged  a host-memory communicator (MPI, Self) gets copies in pinned host memory: only the
//           payload's bytes cross PCIe, one copy each way (at world size 1, none: the
//           collectives are copies on the device).
// A collective first waits for the work queued on the reducer's stream (the communicators are
// blocking and run on their own streams or on the host); a payload result is in device memory
// in stream order when the call returns (its upload may still be queued). Only in a CUDA build.
// Internal to comm/.
#pragma once

#include "cpd/config.h"

#if CPD_WITH_CUDA

#include <cstddef>
#include <cstdint>
#include <memory>

#include "comm/communicator.h"
#include "cpd/status.h"

namespace cpd::comm::internal {

// The largest payloads a transport must carry, fixed at Create.
struct TransportSizes {
  std::size_t bytes = 0;        // the largest all-to-all or all-gather buffer (all blocks)
  std::size_t small_count = 0;  // the longest small host array (per-layer maxima or counters)
};

class DeviceTransport {
 public:
  // `comm` and `stream` (a cudaStream_t) outlive the transport. Allocates the staging buffers.
  static Result<std::unique_ptr<DeviceTransport>> Create(Communicator* comm, void* stream,
                                                         const TransportSizes& sizes);
  virtual ~DeviceTransport() = default;

  // "nccl" (direct, any device-memory communicator) or "staged".
  virtual const char* name() const = 0;

  // Communicator::AllToAllBytes / AllGatherBytes / AllReduce(kSum) on device buffers, ordered
  // after the work queued on the stream. REQUIRED: the buffers fit TransportSizes::bytes.
  virtual Status AllToAllBytes(const std::uint8_t* d_in, std::uint8_t* d_out,
                               std::size_t block_bytes) = 0;
  virtual Status AllGatherBytes(const std::uint8_t* d_in, std::uint8_t* d_out,
                                std::size_t block_bytes) = 0;
  virtual Status AllReduceSum(float* d_data, std::size_t count) = 0;
  // Communicator::ReduceScatter on device buffers (measure_error's float32 reference).
  virtual Status ReduceScatterSum(const float* d_in, float* d_out, std::size_t count) = 0;
  // Makes the payload buffers hold at least `bytes` (measure_error's reference, allocated on
  // first use); TransportSizes::bytes is the initial size.
  virtual Status Reserve(std::size_t bytes) = 0;

  // In place on host arrays of at most TransportSizes::small_count elements.
  virtual Status AllReduceHost(float* data, std::size_t count, ReduceOp op) = 0;
  virtual Status AllReduceHost(std::uint64_t* data, std::size_t count, ReduceOp op) = 0;
  // Communicator::AllGatherBytes on host arrays; (size() + 1) * block_bytes must fit in
  // TransportSizes::small_count 8-byte elements.
  virtual Status AllGatherHost(const std::uint8_t* in, std::uint8_t* out,
                               std::size_t block_bytes) = 0;
};

}  // namespace cpd::comm::internal

#endif  // CPD_WITH_CUDA
