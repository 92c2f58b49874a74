// The NCCL backend of Communicator (built only when CPD_WITH_NCCL is on): collectives on GPU
// buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "comm/communicator.h"
#include "cpd/status.h"

// NCCL's and CUDA's handle types, declared as nccl.h and cuda_runtime.h do, so that this header
// needs neither.
struct ncclComm;
struct CUstream_st;

namespace cpd::comm {

// Collectives over one NCCL communicator with one GPU per rank.
//
// MEMORY: every buffer passed to a collective is DEVICE memory of this rank's GPU
// (cudaMalloc'd, or managed); memory() returns MemorySpace::kDevice. A host pointer is rejected
// with InvalidArgument. The GradientAllReducer takes this communicator for gradients in device
// memory (GradientAllReduceOptions::gradients = kDevice) and refuses it for host gradients.
//
// Semantics are Communicator's: every call is blocking (the collective runs on the
// communicator's own stream, which is synchronised before the call returns) and must be made by
// every rank in the same order. Counts are size_t (NCCL has no int limit). Every CUDA and NCCL
// call is checked; a failure becomes Status::Internal naming file:line, the call, the rank and
// cudaGetErrorString / ncclGetErrorString.
//
// Thread-safety: not thread-safe; call it from one thread. The calling thread's current device
// is set to this communicator's device by Create() and by every collective.
class NcclCommunicator final : public Communicator {
 public:
  // Collective over `bootstrap` (any host-memory communicator, e.g. MpiCommunicator, which must
  // stay usable during the call): rank 0 creates the ncclUniqueId and broadcasts it with
  // BroadcastBytes. The NCCL ranks equal the bootstrap's. `device` < 0 picks the node-local rank
  // (OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID or MPI_LOCALRANKID; else the bootstrap rank)
  // modulo the number of GPUs. Unavailable when the machine has no CUDA device.
  static Result<std::unique_ptr<NcclCommunicator>> Create(Communicator* bootstrap, int device = -1);

  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  MemorySpace memory() const override { return MemorySpace::kDevice; }
  int device() const { return device_; }

  Status AllReduce(float* data, std::size_t count, ReduceOp op) override;
  Status AllReduce(std::int32_t* data, std::size_t count, ReduceOp op) override;
  Status AllReduce(std::uint64_t* data, std::size_t count, ReduceOp op) override;
  Status ReduceScatter(const float* in, float* out, std::size_t count) override;
  Status AllGather(const float* in, float* out, std::size_t count) override;
  Status AllToAll(const float* in, float* out, std::size_t block_count) override;
  Status Broadcast(float* data, std::size_t count, int root) override;
  Status AllToAllBytes(const std::uint8_t* in, std::uint8_t* out, std::size_t block_bytes) override;
  Status AllGatherBytes(const std::uint8_t* in, std::uint8_t* out,
                        std::size_t block_bytes) override;
  Status BroadcastBytes(std::uint8_t* data, std::size_t count, int root) override;
  Status Barrier() override;

 private:
  NcclCommunicator(ncclComm* comm, CUstream_st* stream, int rank, int size, int device)
      : comm_(comm), stream_(stream), rank_(rank), size_(size), device_(device) {}

  // The validating paths: argument checks, device pointers, then the collective and a sync.
  Status CheckDevice(const void* p, std::size_t count, const char* what) const;
  Status AllReduceImpl(void* data, std::size_t count, int type, ReduceOp op, const char* what);
  Status AllGatherImpl(const void* in, void* out, std::size_t count, int type, const char* what);
  Status AllToAllImpl(const void* in, void* out, std::size_t block, int type,
                      std::size_t elem_bytes, const char* what);
  Status BroadcastImpl(void* data, std::size_t count, int type, int root, const char* what);
  // Waits for the stream and reports asynchronous NCCL errors.
  Status Sync(const char* what);

  ncclComm* comm_;
  CUstream_st* stream_;
  int rank_;
  int size_;
  int device_;
  void* barrier_word_ = nullptr;  // one device int for Barrier()
};

}  // namespace cpd::comm
