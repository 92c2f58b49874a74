// A host communicator of size > 1 in one process, for tests that need no MPI (tests/comm/).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "comm/communicator.h"

namespace cpd::test {

// Rank 0 of a world of `size` ranks that all hold this process's inputs: every collective
// returns what it would if the other ranks were copies of this one. Not a world a run can have
// (their stochastic roundings would differ), but a host communicator of size > 1 in one process:
// the reducer over it must sum every rank's copy, and host and device reducers over it must
// agree (the device one stages its payloads at chunk offsets of several ranks, which a GPU
// machine without MPI can test no other way). It has no nonblocking exchange, so the reducers
// must not pick a schedule that needs one.
class MirrorCommunicator final : public comm::Communicator {
 public:
  explicit MirrorCommunicator(int size) : size_(size) {}
  int rank() const override { return 0; }
  int size() const override { return size_; }

  Status AllReduce(float* data, std::size_t count, comm::ReduceOp op) override {
    return Reduce(data, count, op);
  }
  Status AllReduce(std::int32_t* data, std::size_t count, comm::ReduceOp op) override {
    return Reduce(data, count, op);
  }
  Status AllReduce(std::uint64_t* data, std::size_t count, comm::ReduceOp op) override {
    return Reduce(data, count, op);
  }
  Status ReduceScatter(const float* in, float* out, std::size_t count) override {
    const std::size_t block = count / std::size_t(size_);
    std::copy(in, in + block, out);  // rank 0's block, from every rank
    return Reduce(out, block, comm::ReduceOp::kSum);
  }
  Status AllGather(const float* in, float* out, std::size_t count) override {
    return Replicate(in, out, count * sizeof(float));
  }
  Status AllToAll(const float* in, float* out, std::size_t block_count) override {
    return Replicate(in, out, block_count * sizeof(float));  // every rank's block 0
  }
  Status Broadcast(float*, std::size_t, int) override { return Status::Ok(); }
  Status AllToAllBytes(const std::uint8_t* in, std::uint8_t* out, std::size_t block) override {
    return Replicate(in, out, block);
  }
  Status AllGatherBytes(const std::uint8_t* in, std::uint8_t* out, std::size_t block) override {
    return Replicate(in, out, block);
  }
  Status BroadcastBytes(std::uint8_t*, std::size_t, int) override { return Status::Ok(); }
  Status Barrier() override { return Status::Ok(); }

 private:
  // op over `size_` copies of each value, added one by one as a real reduction would.
  template <typename T>
  Status Reduce(T* data, std::size_t count, comm::ReduceOp op) {
    if (op == comm::ReduceOp::kMax) return Status::Ok();
    for (std::size_t i = 0; i < count; ++i) {
      T acc = data[i];
      for (int r = 1; r < size_; ++r) acc += data[i];
      data[i] = acc;
    }
    return Status::Ok();
  }
  // out holds `size_` copies of in[0, bytes).
  Status Replicate(const void* in, void* out, std::size_t bytes) {
    for (int r = 0; r < size_; ++r) {
      if (bytes > 0)
        std::memcpy(static_cast<std::uint8_t*>(out) + std::size_t(r) * bytes, in, bytes);
    }
    return Status::Ok();
  }
  int size_;
};

}  // namespace cpd::test
