#include "comm/allreduce/device_transport.h"

#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "comm/allreduce/cuda_memory.h"

namespace cpd::comm::internal {
namespace {

// A device-memory communicator (NCCL) takes the device buffers; its collectives run on its own
// stream, so each waits for the reducer's stream first. The small host arrays travel through a
// small device buffer.
class DirectTransport final : public DeviceTransport {
 public:
  DirectTransport(Communicator* comm, cudaStream_t stream) : comm_(comm), stream_(stream) {}

  Status Allocate(const TransportSizes& sizes) { return small_.Allocate(sizes.small_count); }

  const char* name() const override { return "nccl"; }

  Status AllToAllBytes(const std::uint8_t* d_in, std::uint8_t* d_out,
                       std::size_t block_bytes) override {
    CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return comm_->AllToAllBytes(d_in, d_out, block_bytes);
  }
  Status AllGatherBytes(const std::uint8_t* d_in, std::uint8_t* d_out,
                        std::size_t block_bytes) override {
    CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return comm_->AllGatherBytes(d_in, d_out, block_bytes);
  }
  Status AllReduceSum(float* d_data, std::size_t count) override {
    CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return comm_->AllReduce(d_data, count, ReduceOp::kSum);
  }
  Status ReduceScatterSum(const float* d_in, float* d_out, std::size_t count) override {
    CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return comm_->ReduceScatter(d_in, d_out, count);
  }
  Status Reserve(std::size_t) override { return Status::Ok(); }  // nothing is staged
  Status AllReduceHost(float* data, std::size_t count, ReduceOp op) override {
    return AllReduceSmall(data, count, op);
  }
  Status AllReduceHost(std::uint64_t* data, std::size_t count, ReduceOp op) override {
    return AllReduceSmall(data, count, op);
  }
  Status AllGatherHost(const std::uint8_t* in, std::uint8_t* out,
                       std::size_t block_bytes) override {
    const std::size_t all = block_bytes * std::size_t(comm_->size());
    if (block_bytes + all > small_.bytes()) {
      return Status::InvalidArgument("DeviceTransport: " + std::to_string(block_bytes + all) +
                                     " small bytes exceed the " + std::to_string(small_.bytes()) +
                                     " allocated");
    }
    auto* d_in = reinterpret_cast<std::uint8_t*>(small_.data());
    std::uint8_t* d_out = d_in + block_bytes;
    CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(d_in, in, block_bytes, cudaMemcpyHostToDevice, stream_));
    CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    CPD_RETURN_IF_ERROR(comm_->AllGatherBytes(d_in, d_out, block_bytes));
    CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(out, d_out, all, cudaMemcpyDeviceToHost, stream_));
    CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return Status::Ok();
  }

 private:
  template <typename T>
  Status AllReduceSmall(T* data, std::size_t count, ReduceOp op) {
    static_assert(sizeof(T) <= sizeof(std::uint64_t));
    if (count > small_.count()) {
      return Status::InvalidArgument("DeviceTransport: " + std::to_string(count) +
                                     " small values exceed the " + std::to_string(small_.count()) +
                                     " allocated");
    }
    T* d = reinterpret_cast<T*>(small_.data());
    CPD_COMM_CUDA_CHECK(
        cudaMemcpyAsync(d, data, count * sizeof(T), cudaMemcpyHostToDevice, stream_));
    CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    CPD_RETURN_IF_ERROR(comm_->AllReduce(d, count, op));
    CPD_COMM_CUDA_CHECK(
        cudaMemcpyAsync(data, d, count * sizeof(T), cudaMemcpyDeviceToHost, stream_));
    CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return Status::Ok();
  }

  Communicator* comm_;
  cudaStream_t stream_;
  DeviceArray<std::uint64_t> small_;
};

// A host-memory communicator (MPI, Self) gets pinned copies: the payload is copied down, the
// collective runs between the pinned buffers, and the result is queued for upload. The upload
// of one call and the download of the next are on the same stream, so `out_` is free again
// when the next call has waited for its download. At world size 1 every payload collective is
// a copy (or nothing), made on the device: nothing crosses PCIe.
class StagedTransport final : public DeviceTransport {
 public:
  StagedTransport(Communicator* comm, cudaStream_t stream)
      : comm_(comm), stream_(stream), alone_(comm->size() == 1) {}

  Status Allocate(const TransportSizes& sizes) {
    if (alone_) return Status::Ok();  // nothing is staged
    CPD_RETURN_IF_ERROR(in_.Allocate(sizes.bytes));
    return out_.Allocate(sizes.bytes);
  }

  const char* name() const override { return "staged"; }

  Status AllToAllBytes(const std::uint8_t* d_in, std::uint8_t* d_out,
                       std::size_t block_bytes) override {
    const std::size_t all = block_bytes * std::size_t(comm_->size());
    if (alone_) return CopyOnDevice(d_in, d_out, all);
    CPD_RETURN_IF_ERROR(Download(d_in, all));
    CPD_RETURN_IF_ERROR(comm_->AllToAllBytes(in_.data(), out_.data(), block_bytes));
    return Upload(d_out, all);
  }
  Status AllGatherBytes(const std::uint8_t* d_in, std::uint8_t* d_out,
                        std::size_t block_bytes) override {
    if (alone_) return CopyOnDevice(d_in, d_out, block_bytes);
    CPD_RETURN_IF_ERROR(Download(d_in, block_bytes));
    CPD_RETURN_IF_ERROR(comm_->AllGatherBytes(in_.data(), out_.data(), block_bytes));
    return Upload(d_out, block_bytes * std::size_t(comm_->size()));
  }
  Status AllReduceSum(float* d_data, std::size_t count) override {
    if (alone_) return Status::Ok();  // the sum of one rank's values is those values
    const std::size_t bytes = count * sizeof(float);
    CPD_RETURN_IF_ERROR(Download(d_data, bytes));
    // In place in the download buffer; the upload comes from it.
    CPD_RETURN_IF_ERROR(
        comm_->AllReduce(reinterpret_cast<float*>(in_.data()), count, ReduceOp::kSum));
    return Upload(d_data, bytes, in_.data());
  }
  Status ReduceScatterSum(const float* d_in, float* d_out, std::size_t count) override {
    if (alone_) return CopyOnDevice(d_in, d_out, count * sizeof(float));
    CPD_RETURN_IF_ERROR(Download(d_in, count * sizeof(float)));
    CPD_RETURN_IF_ERROR(comm_->ReduceScatter(reinterpret_cast<const float*>(in_.data()),
                                             reinterpret_cast<float*>(out_.data()), count));
    return Upload(d_out, count / std::size_t(comm_->size()) * sizeof(float));
  }
  Status Reserve(std::size_t bytes) override {
    if (alone_ || bytes <= in_.count()) return Status::Ok();
    // The previous upload from out_ may still be queued.
    CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    CPD_RETURN_IF_ERROR(in_.Allocate(bytes));
    return out_.Allocate(bytes);
  }
  Status AllReduceHost(float* data, std::size_t count, ReduceOp op) override {
    return comm_->AllReduce(data, count, op);
  }
  Status AllReduceHost(std::uint64_t* data, std::size_t count, ReduceOp op) override {
    return comm_->AllReduce(data, count, op);
  }
  Status AllGatherHost(const std::uint8_t* in, std::uint8_t* out,
                       std::size_t block_bytes) override {
    return comm_->AllGatherBytes(in, out, block_bytes);
  }

 private:
  Status CheckFits(std::size_t bytes) const {
    if (bytes <= in_.count()) return Status::Ok();
    return Status::InvalidArgument("DeviceTransport: a payload of " + std::to_string(bytes) +
                                   " bytes exceeds the " + std::to_string(in_.count()) +
                                   "-byte staging buffers");
  }
  Status CopyOnDevice(const void* d_src, void* d_dst, std::size_t bytes) {
    if (bytes > 0) {
      CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(d_dst, d_src, bytes, cudaMemcpyDeviceToDevice, stream_));
    }
    return Status::Ok();
  }
  // d_src[0, bytes) -> in_, waited for (with everything queued before it).
  Status Download(const void* d_src, std::size_t bytes) {
    CPD_RETURN_IF_ERROR(CheckFits(bytes));
    if (bytes > 0) {
      CPD_COMM_CUDA_CHECK(
          cudaMemcpyAsync(in_.data(), d_src, bytes, cudaMemcpyDeviceToHost, stream_));
    }
    CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return Status::Ok();
  }
  // src (out_ unless given)[0, bytes) -> d_dst, queued on the stream.
  Status Upload(void* d_dst, std::size_t bytes, const std::uint8_t* src = nullptr) {
    if (bytes == 0) return Status::Ok();
    CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(d_dst, src != nullptr ? src : out_.data(), bytes,
                                        cudaMemcpyHostToDevice, stream_));
    return Status::Ok();
  }

  Communicator* comm_;
  cudaStream_t stream_;
  const bool alone_;
  PinnedArray<std::uint8_t> in_, out_;
};

}  // namespace

Result<std::unique_ptr<DeviceTransport>> DeviceTransport::Create(Communicator* comm, void* stream,
                                                                 const TransportSizes& sizes) {
  if (comm == nullptr) return Status::InvalidArgument("DeviceTransport: null communicator");
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (comm->memory() == MemorySpace::kDevice) {
    auto t = std::make_unique<DirectTransport>(comm, s);
    CPD_RETURN_IF_ERROR(t->Allocate(sizes));
    return std::unique_ptr<DeviceTransport>(std::move(t));
  }
  auto t = std::make_unique<StagedTransport>(comm, s);
  CPD_RETURN_IF_ERROR(t->Allocate(sizes));
  return std::unique_ptr<DeviceTransport>(std::move(t));
}

}  // namespace cpd::comm::internal
