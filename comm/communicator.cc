#include "comm/communicator.h"

#include <algorithm>
#include <cstdlib>
#include <string>

namespace cpd::comm {
namespace {

Status CheckBuffers(const void* in, const void* out, std::size_t count, const char* what) {
  if (count > 0 && (in == nullptr || out == nullptr)) {
    return Status::InvalidArgument(std::string(what) + ": null buffer with count " +
                                   std::to_string(count));
  }
  return Status::Ok();
}

template <typename T>
Status Copy(const T* in, T* out, std::size_t count, const char* what) {
  CPD_RETURN_IF_ERROR(CheckBuffers(in, out, count, what));
  if (count > 0 && in != out) std::copy_n(in, count, out);
  return Status::Ok();
}

Status CheckRoot(int root, const char* what) {
  if (root != 0) {
    return Status::InvalidArgument(std::string(what) + ": root " + std::to_string(root) +
                                   " out of range; world size is 1, so root must be 0");
  }
  return Status::Ok();
}

// Nothing left to move.
class CompletedExchange final : public Communicator::PendingExchange {
 public:
  Status Test(bool* done) override {
    *done = true;
    return Status::Ok();
  }
  Status Wait() override { return Status::Ok(); }
};

}  // namespace

Result<std::unique_ptr<Communicator::PendingExchange>> Communicator::StartExchangeBytes(
    std::span<const SendBlock>, std::span<const RecvBlock>) {
  return Status::Unavailable(
      "StartExchangeBytes: this communicator's backend has no nonblocking exchange");
}

Status CheckExchangeBlocks(std::span<const Communicator::SendBlock> send,
                           std::span<const Communicator::RecvBlock> recv, int size, int rank) {
  const std::string where = "StartExchangeBytes on rank " + std::to_string(rank) + ": ";
  if (send.size() != std::size_t(size) || recv.size() != std::size_t(size)) {
    return Status::InvalidArgument(where + std::to_string(send.size()) + " send and " +
                                   std::to_string(recv.size()) + " receive blocks for " +
                                   std::to_string(size) + " ranks");
  }
  for (int d = 0; d < size; ++d) {
    const auto& s = send[std::size_t(d)];
    const auto& r = recv[std::size_t(d)];
    if ((s.bytes > 0 && s.data == nullptr) || (r.bytes > 0 && r.data == nullptr)) {
      return Status::InvalidArgument(where + "null buffer for rank " + std::to_string(d));
    }
  }
  if (send[std::size_t(rank)].bytes != recv[std::size_t(rank)].bytes) {
    return Status::InvalidArgument(where + "the block to itself is " +
                                   std::to_string(send[std::size_t(rank)].bytes) + " bytes but " +
                                   std::to_string(recv[std::size_t(rank)].bytes) + " are expected");
  }
  return Status::Ok();
}

Result<std::unique_ptr<Communicator::PendingExchange>> SelfCommunicator::StartExchangeBytes(
    std::span<const SendBlock> send, std::span<const RecvBlock> recv) {
  CPD_RETURN_IF_ERROR(CheckExchangeBlocks(send, recv, 1, 0));
  if (send[0].bytes > 0) std::copy_n(send[0].data, send[0].bytes, recv[0].data);
  return std::unique_ptr<PendingExchange>(new CompletedExchange());
}

Status SelfCommunicator::AllReduce(float* data, std::size_t count, ReduceOp) {
  return CheckBuffers(data, data, count, "AllReduce");
}
Status SelfCommunicator::AllReduce(std::int32_t* data, std::size_t count, ReduceOp) {
  return CheckBuffers(data, data, count, "AllReduce");
}
Status SelfCommunicator::AllReduce(std::uint64_t* data, std::size_t count, ReduceOp) {
  return CheckBuffers(data, data, count, "AllReduce");
}
Status SelfCommunicator::ReduceScatter(const float* in, float* out, std::size_t count) {
  return Copy(in, out, count, "ReduceScatter");
}
Status SelfCommunicator::AllGather(const float* in, float* out, std::size_t count) {
  return Copy(in, out, count, "AllGather");
}
Status SelfCommunicator::AllToAll(const float* in, float* out, std::size_t block_count) {
  return Copy(in, out, block_count, "AllToAll");
}
Status SelfCommunicator::Broadcast(float* data, std::size_t count, int root) {
  CPD_RETURN_IF_ERROR(CheckRoot(root, "Broadcast"));
  return CheckBuffers(data, data, count, "Broadcast");
}
Status SelfCommunicator::AllToAllBytes(const std::uint8_t* in, std::uint8_t* out,
                                       std::size_t block_bytes) {
  return Copy(in, out, block_bytes, "AllToAllBytes");
}
Status SelfCommunicator::AllGatherBytes(const std::uint8_t* in, std::uint8_t* out,
                                        std::size_t block_bytes) {
  return Copy(in, out, block_bytes, "AllGatherBytes");
}
Status SelfCommunicator::BroadcastBytes(std::uint8_t* data, std::size_t count, int root) {
  CPD_RETURN_IF_ERROR(CheckRoot(root, "BroadcastBytes"));
  return CheckBuffers(data, data, count, "BroadcastBytes");
}

int LocalRankFromEnv() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && *v != '\0') return std::atoi(v);
  }
  return -1;
}

}  // namespace cpd::comm
