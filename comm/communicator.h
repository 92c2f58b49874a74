// The communicator interface: collectives on contiguous buffers, one implementation per backend
// (world size 1, MPI: host memory; NCCL: device memory), chosen at run time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "cpd/status.h"

namespace cpd::comm {

enum class ReduceOp { kSum, kMax };

// Where a communicator's buffers live. Host buffers for SelfCommunicator and MpiCommunicator;
// device (GPU) buffers for NcclCommunicator.
enum class MemorySpace { kHost, kDevice };

// Contract, for every implementation:
// - Collectives are blocking and must be called by every rank of the communicator in the same
//   order with the same counts (and the same root / op); the library cannot detect a mismatch.
// - `count` is a number of elements, not bytes. A count of 0 is valid and does nothing useful
//   (but still synchronises where the backend does). Buffers may be null when their size is 0.
// - Buffers are contiguous, in the memory space memory() names (host unless the implementation
//   says otherwise), and must not overlap unless a method says so.
// - Every method returns a Status; after a failure the communicator's state is unspecified and
//   the caller should stop using it.
// Thread-safety: a Communicator is NOT thread-safe. Call it from one thread at a time (the
// MPI backend is initialised with MPI_THREAD_FUNNELED when it initialises MPI itself).
class Communicator {
 public:
  virtual ~Communicator() = default;

  // This process's rank in [0, size()) and the number of ranks (>= 1).
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Where the buffers passed to the collectives must live.
  virtual MemorySpace memory() const { return MemorySpace::kHost; }

  // In place: on return every rank's `data[0, count)` holds op over all ranks' inputs.
  // Float sums are reduced in a backend-defined order; they are exact when the inputs are
  // (e.g. small integers).
  virtual Status AllReduce(float* data, std::size_t count, ReduceOp op) = 0;
  virtual Status AllReduce(std::int32_t* data, std::size_t count, ReduceOp op) = 0;
  virtual Status AllReduce(std::uint64_t* data, std::size_t count, ReduceOp op) = 0;

  // Sum-reduce `in[0, count)` over all ranks, then give rank r block r:
  // out[0, count/size()) = sum over ranks of in[r*count/size(), (r+1)*count/size()).
  // REQUIRED: count % size() == 0 (else InvalidArgument); `out` holds count/size() elements.
  virtual Status ReduceScatter(const float* in, float* out, std::size_t count) = 0;

  // Every rank contributes `in[0, count)`; on return out[r*count, (r+1)*count) holds rank r's
  // input on every rank. `out` holds count*size() elements.
  virtual Status AllGather(const float* in, float* out, std::size_t count) = 0;

  // Equal blocks of `block_count` elements: rank r sends in[d*block_count, (d+1)*block_count)
  // to rank d, which stores it at out[r*block_count, (r+1)*block_count). Both buffers hold
  // block_count*size() elements.
  virtual Status AllToAll(const float* in, float* out, std::size_t block_count) = 0;

  // In place: on return every rank's data[0, count) equals `root`'s. REQUIRED: 0 <= root < size().
  virtual Status Broadcast(float* data, std::size_t count, int root) = 0;

  // Byte collectives, for packed payloads (quantised codes with their scale metadata) and
  // serialised messages. Counts are bytes. Blocks are equal on every rank: a caller with
  // variable-length payloads pads them to the largest.
  //
  // Equal blocks of `block_bytes` bytes: rank r sends in[d*block_bytes, (d+1)*block_bytes) to
  // rank d, which stores it at out[r*block_bytes, (r+1)*block_bytes). Both buffers hold
  // block_bytes*size() bytes.
  virtual Status AllToAllBytes(const std::uint8_t* in, std::uint8_t* out,
                               std::size_t block_bytes) = 0;
  // Every rank contributes in[0, block_bytes); on return out[r*block_bytes, (r+1)*block_bytes)
  // holds rank r's bytes on every rank. `out` holds block_bytes*size() bytes.
  virtual Status AllGatherBytes(const std::uint8_t* in, std::uint8_t* out,
                                std::size_t block_bytes) = 0;
  // In place: on return every rank's data[0, count) equals `root`'s. REQUIRED: 0 <= root < size().
  virtual Status BroadcastBytes(std::uint8_t* data, std::size_t count, int root) = 0;

  // Returns once every rank has entered Barrier.
  virtual Status Barrier() = 0;

  // ---- Nonblocking exchange, for pipelined algorithms ----
  // A byte block of one peer: what is sent to it, or where what it sends is received.
  struct SendBlock {
    const std::uint8_t* data = nullptr;
    std::size_t bytes = 0;
  };
  struct RecvBlock {
    std::uint8_t* data = nullptr;
    std::size_t bytes = 0;
  };
  // An exchange in flight. The MPI backend moves bytes only inside its calls: a caller that
  // computes meanwhile calls Test now and then, which never blocks.
  class PendingExchange {
   public:
    virtual ~PendingExchange() = default;
    // *done = true once the exchange is complete (then Test and Wait return at once).
    virtual Status Test(bool* done) = 0;
    virtual Status Wait() = 0;
  };
  // Starts a personalised exchange and returns without waiting: this rank sends send[d] to every
  // rank d and receives rank q's block into recv[q] (send[rank()] goes to recv[rank()] by copy).
  // An all-to-all with blocks of any size; with one block sent to every rank, an all-gather.
  // Both spans hold size() blocks; recv[q].bytes on rank r must equal send[r].bytes on rank q.
  // Exchanges complete in any order but must be started in the same order on every rank; the
  // buffers stay valid, the sent ones unmodified and the received ones unread, until the
  // exchange completes (Wait, or Test says done); destroying an incomplete one waits for it.
  // Blocking collectives may be called while exchanges are in flight. InvalidArgument for spans
  // of the wrong size, null data with bytes > 0 or blocks beyond the backend's message limit;
  // Unavailable where the backend has no nonblocking exchange (has_nonblocking_exchange()).
  virtual Result<std::unique_ptr<PendingExchange>> StartExchangeBytes(
      std::span<const SendBlock> send, std::span<const RecvBlock> recv);
  // Whether StartExchangeBytes works: a capability that algorithms ask for before they pick a
  // pipelined schedule (comm/allreduce/codes.h), false unless an implementation says so. MPI and
  // world size 1 have it; NCCL does not.
  virtual bool has_nonblocking_exchange() const { return false; }
};

// This process's rank among the ranks on its node, from the launcher's environment (Open MPI's
// OMPI_COMM_WORLD_LOCAL_RANK, Slurm's SLURM_LOCALID, MPICH's MPI_LOCALRANKID), or -1 when no
// launcher says. Used to give each rank of a node its own GPU.
int LocalRankFromEnv();

// What every StartExchangeBytes checks (its InvalidArgument cases but the backend's limit).
Status CheckExchangeBlocks(std::span<const Communicator::SendBlock> send,
                           std::span<const Communicator::RecvBlock> recv, int size, int rank);

// World size 1: reductions and broadcasts are no-ops, gathers and scatters are copies. Useful for
// single-process training and as a reference.
class SelfCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }

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
  Status Barrier() override { return Status::Ok(); }
  // Copies the one block and returns a completed exchange.
  Result<std::unique_ptr<PendingExchange>> StartExchangeBytes(
      std::span<const SendBlock> send, std::span<const RecvBlock> recv) override;
  bool has_nonblocking_exchange() const override { return true; }
};

}  // namespace cpd::comm
