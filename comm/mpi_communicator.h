// The MPI backend of Communicator (built only when CPD_WITH_MPI is on).
#pragma once

#include <mpi.h>

#include <memory>

#include "comm/communicator.h"
#include "cpd/status.h"

namespace cpd::comm {

// Collectives over a private duplicate of MPI_COMM_WORLD, so that our traffic never matches
// another library's messages. The duplicate uses MPI_ERRORS_RETURN: every failing MPI call
// becomes a Status naming the call, file:line, the rank and MPI's own error string, instead of
// aborting the job.
//
// Lifetime: Create() calls MPI_Init_thread(MPI_THREAD_FUNNELED) if MPI is not initialised yet;
// the communicator that initialised MPI calls MPI_Finalize in its destructor, so it must be
// destroyed last, after every other MPI user (including other MpiCommunicators). When MPI was
// already initialised by the caller, the caller keeps the duty to finalise it.
//
// Thread-safety: not thread-safe; see Communicator. All calls must come from the thread that
// created it (MPI_THREAD_FUNNELED).
//
// Limits: MPI counts are int, so a per-rank element count (or block count) above INT_MAX is
// rejected with InvalidArgument before any buffer is touched; BroadcastBytes alone sends larger
// buffers in pieces of at most INT_MAX bytes.
class MpiCommunicator final : public Communicator {
 public:
  // Fails with Unavailable when MPI was already finalised, Internal when an MPI call fails.
  static Result<std::unique_ptr<MpiCommunicator>> Create();

  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }

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
  // Point-to-point MPI_Irecv / MPI_Isend of every block; Test is MPI_Testall.
  Result<std::unique_ptr<PendingExchange>> StartExchangeBytes(
      std::span<const SendBlock> send, std::span<const RecvBlock> recv) override;
  bool has_nonblocking_exchange() const override { return true; }

  // The duplicated communicator, for code that needs to call MPI directly.
  MPI_Comm mpi_comm() const { return comm_; }

 private:
  MpiCommunicator(MPI_Comm comm, int rank, int size, bool owns_mpi)
      : comm_(comm), rank_(rank), size_(size), owns_mpi_(owns_mpi) {}

  // The one validating path for all-reduce: count range, null buffers, then MPI_Allreduce.
  Status AllReduceImpl(void* data, std::size_t count, MPI_Datatype type, ReduceOp op);
  // Likewise for all-to-all, all-gather and broadcast of any element type.
  Status AllToAllImpl(const void* in, void* out, std::size_t block, MPI_Datatype type,
                      const char* what);
  Status AllGatherImpl(const void* in, void* out, std::size_t count, MPI_Datatype type,
                       const char* what);
  Status CheckRoot(int root, const char* what) const;

  MPI_Comm comm_;
  int rank_;
  int size_;
  bool owns_mpi_;
};

}  // namespace cpd::comm
