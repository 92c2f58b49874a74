#include "comm/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace cpd::comm {
namespace {

std::string Where(const char* file, int line, const char* expr, int rank) {
  return std::string(file) + ":" + std::to_string(line) + ": " + expr + " failed on rank " +
         std::to_string(rank) + ": ";
}

// Every CUDA and NCCL call goes through these: a failure becomes a Status naming the call, the
// rank and the library's own error text.
#define CPD_CUDA_CHECK(rank, call)                                       \
  do {                                                                   \
    const cudaError_t _cpd_cuda_err = (call);                            \
    if (_cpd_cuda_err != cudaSuccess) {                                  \
      return Status::Internal(Where(__FILE__, __LINE__, #call, (rank)) + \
                              cudaGetErrorString(_cpd_cuda_err));        \
    }                                                                    \
  } while (0)

#define CPD_NCCL_CHECK(rank, call)                                       \
  do {                                                                   \
    const ncclResult_t _cpd_nccl_err = (call);                           \
    if (_cpd_nccl_err != ncclSuccess) {                                  \
      return Status::Internal(Where(__FILE__, __LINE__, #call, (rank)) + \
                              ncclGetErrorString(_cpd_nccl_err));        \
    }                                                                    \
  } while (0)

ncclRedOp_t ToNccl(ReduceOp op) { return op == ReduceOp::kMax ? ncclMax : ncclSum; }

}  // namespace

Result<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(Communicator* bootstrap,
                                                                   int device) {
  if (bootstrap == nullptr || bootstrap->memory() != MemorySpace::kHost) {
    return Status::InvalidArgument(
        "NcclCommunicator::Create: needs a host-memory bootstrap communicator (e.g. "
        "MpiCommunicator) to share the ncclUniqueId");
  }
  const int rank = bootstrap->rank();
  const int size = bootstrap->size();
  int devices = 0;
  const cudaError_t count_err = cudaGetDeviceCount(&devices);
  if (count_err != cudaSuccess || devices == 0) {
    return Status::Unavailable("NcclCommunicator::Create on rank " + std::to_string(rank) +
                               ": no CUDA device (" + cudaGetErrorString(count_err) + ")");
  }
  if (device < 0) {
    const int local = LocalRankFromEnv();
    device = (local >= 0 ? local : rank) % devices;
  }
  if (device >= devices) {
    return Status::InvalidArgument("NcclCommunicator::Create on rank " + std::to_string(rank) +
                                   ": device " + std::to_string(device) + " out of range; " +
                                   std::to_string(devices) + " device(s) present");
  }
  CPD_CUDA_CHECK(rank, cudaSetDevice(device));

  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (rank == 0) CPD_NCCL_CHECK(rank, ncclGetUniqueId(&id));
  CPD_RETURN_IF_ERROR(
      bootstrap->BroadcastBytes(reinterpret_cast<std::uint8_t*>(&id), sizeof(id), 0));

  ncclComm_t comm = nullptr;
  CPD_NCCL_CHECK(rank, ncclCommInitRank(&comm, size, id, rank));
  cudaStream_t stream = nullptr;
  const cudaError_t stream_err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (stream_err != cudaSuccess) {
    ncclCommDestroy(comm);
    return Status::Internal(Where(__FILE__, __LINE__, "cudaStreamCreateWithFlags", rank) +
                            cudaGetErrorString(stream_err));
  }
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator(comm, stream, rank, size, device));
  CPD_CUDA_CHECK(rank, cudaMalloc(&c->barrier_word_, sizeof(int)));
  return c;
}

NcclCommunicator::~NcclCommunicator() {
  // Destructors cannot report; failures here are ignored on purpose.
  cudaSetDevice(device_);
  if (barrier_word_ != nullptr) cudaFree(barrier_word_);
  if (comm_ != nullptr) {
    ncclCommFinalize(comm_);
    ncclCommDestroy(comm_);
  }
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

Status NcclCommunicator::CheckDevice(const void* p, std::size_t count, const char* what) const {
  if (count == 0) return Status::Ok();
  if (p == nullptr) {
    return Status::InvalidArgument(std::string(what) + " on rank " + std::to_string(rank_) +
                                   ": null buffer with count " + std::to_string(count));
  }
  cudaPointerAttributes attr;
  CPD_CUDA_CHECK(rank_, cudaPointerGetAttributes(&attr, p));
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    return Status::InvalidArgument(std::string(what) + " on rank " + std::to_string(rank_) +
                                   ": NcclCommunicator buffers must be device memory (got a host "
                                   "pointer)");
  }
  return Status::Ok();
}

Status NcclCommunicator::Sync(const char* what) {
  const cudaError_t err = cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  ncclResult_t async = ncclSuccess;
  CPD_NCCL_CHECK(rank_, ncclCommGetAsyncError(comm_, &async));
  if (async != ncclSuccess) {
    return Status::Internal(std::string(what) + " on rank " + std::to_string(rank_) +
                            ": asynchronous NCCL error: " + ncclGetErrorString(async));
  }
  CPD_CUDA_CHECK(rank_, err);
  return Status::Ok();
}

Status NcclCommunicator::AllReduceImpl(void* data, std::size_t count, int type, ReduceOp op,
                                       const char* what) {
  CPD_RETURN_IF_ERROR(CheckDevice(data, count, what));
  if (count == 0) return Status::Ok();
  CPD_CUDA_CHECK(rank_, cudaSetDevice(device_));
  CPD_NCCL_CHECK(rank_, ncclAllReduce(data, data, count, static_cast<ncclDataType_t>(type),
                                      ToNccl(op), comm_, static_cast<cudaStream_t>(stream_)));
  return Sync(what);
}

Status NcclCommunicator::AllReduce(float* data, std::size_t count, ReduceOp op) {
  return AllReduceImpl(data, count, ncclFloat32, op, "AllReduce");
}
Status NcclCommunicator::AllReduce(std::int32_t* data, std::size_t count, ReduceOp op) {
  return AllReduceImpl(data, count, ncclInt32, op, "AllReduce");
}
Status NcclCommunicator::AllReduce(std::uint64_t* data, std::size_t count, ReduceOp op) {
  return AllReduceImpl(data, count, ncclUint64, op, "AllReduce");
}

Status NcclCommunicator::ReduceScatter(const float* in, float* out, std::size_t count) {
  if (count % static_cast<std::size_t>(size_) != 0) {
    return Status::InvalidArgument("ReduceScatter on rank " + std::to_string(rank_) + ": count " +
                                   std::to_string(count) + " is not divisible by the world size " +
                                   std::to_string(size_) + "; pad the buffer");
  }
  const std::size_t block = count / static_cast<std::size_t>(size_);
  CPD_RETURN_IF_ERROR(CheckDevice(in, count, "ReduceScatter"));
  CPD_RETURN_IF_ERROR(CheckDevice(out, block, "ReduceScatter"));
  if (block == 0) return Status::Ok();
  CPD_CUDA_CHECK(rank_, cudaSetDevice(device_));
  CPD_NCCL_CHECK(rank_, ncclReduceScatter(in, out, block, ncclFloat32, ncclSum, comm_,
                                          static_cast<cudaStream_t>(stream_)));
  return Sync("ReduceScatter");
}

Status NcclCommunicator::AllGatherImpl(const void* in, void* out, std::size_t count, int type,
                                       const char* what) {
  CPD_RETURN_IF_ERROR(CheckDevice(in, count, what));
  CPD_RETURN_IF_ERROR(CheckDevice(out, count * static_cast<std::size_t>(size_), what));
  if (count == 0) return Status::Ok();
  CPD_CUDA_CHECK(rank_, cudaSetDevice(device_));
  CPD_NCCL_CHECK(rank_, ncclAllGather(in, out, count, static_cast<ncclDataType_t>(type), comm_,
                                      static_cast<cudaStream_t>(stream_)));
  return Sync(what);
}

Status NcclCommunicator::AllToAllImpl(const void* in, void* out, std::size_t block, int type,
                                      std::size_t elem_bytes, const char* what) {
  const std::size_t total = block * static_cast<std::size_t>(size_);
  CPD_RETURN_IF_ERROR(CheckDevice(in, total, what));
  CPD_RETURN_IF_ERROR(CheckDevice(out, total, what));
  if (block == 0) return Status::Ok();
  CPD_CUDA_CHECK(rank_, cudaSetDevice(device_));
  // Point-to-point pairs in one group: NCCL runs them concurrently (what ncclAlltoAll does too,
  // which older NCCL versions lack).
  const auto* src = static_cast<const std::uint8_t*>(in);
  auto* dst = static_cast<std::uint8_t*>(out);
  const std::size_t stride = block * elem_bytes;
  const auto t = static_cast<ncclDataType_t>(type);
  CPD_NCCL_CHECK(rank_, ncclGroupStart());
  for (int peer = 0; peer < size_; ++peer) {
    const std::size_t off = static_cast<std::size_t>(peer) * stride;
    const ncclResult_t s =
        ncclSend(src + off, block, t, peer, comm_, static_cast<cudaStream_t>(stream_));
    const ncclResult_t r =
        ncclRecv(dst + off, block, t, peer, comm_, static_cast<cudaStream_t>(stream_));
    if (s != ncclSuccess || r != ncclSuccess) {
      ncclGroupEnd();
      return Status::Internal(Where(__FILE__, __LINE__, "ncclSend/ncclRecv", rank_) +
                              ncclGetErrorString(s != ncclSuccess ? s : r));
    }
  }
  CPD_NCCL_CHECK(rank_, ncclGroupEnd());
  return Sync(what);
}

Status NcclCommunicator::BroadcastImpl(void* data, std::size_t count, int type, int root,
                                       const char* what) {
  if (root < 0 || root >= size_) {
    return Status::InvalidArgument(std::string(what) + " on rank " + std::to_string(rank_) +
                                   ": root " + std::to_string(root) +
                                   " out of range; must be in [0, " + std::to_string(size_) + ")");
  }
  CPD_RETURN_IF_ERROR(CheckDevice(data, count, what));
  if (count == 0) return Status::Ok();
  CPD_CUDA_CHECK(rank_, cudaSetDevice(device_));
  CPD_NCCL_CHECK(rank_, ncclBroadcast(data, data, count, static_cast<ncclDataType_t>(type), root,
                                      comm_, static_cast<cudaStream_t>(stream_)));
  return Sync(what);
}

Status NcclCommunicator::AllGather(const float* in, float* out, std::size_t count) {
  return AllGatherImpl(in, out, count, ncclFloat32, "AllGather");
}
Status NcclCommunicator::AllToAll(const float* in, float* out, std::size_t block_count) {
  return AllToAllImpl(in, out, block_count, ncclFloat32, sizeof(float), "AllToAll");
}
Status NcclCommunicator::Broadcast(float* data, std::size_t count, int root) {
  return BroadcastImpl(data, count, ncclFloat32, root, "Broadcast");
}
Status NcclCommunicator::AllToAllBytes(const std::uint8_t* in, std::uint8_t* out,
                                       std::size_t block_bytes) {
  return AllToAllImpl(in, out, block_bytes, ncclUint8, 1, "AllToAllBytes");
}
Status NcclCommunicator::AllGatherBytes(const std::uint8_t* in, std::uint8_t* out,
                                        std::size_t block_bytes) {
  return AllGatherImpl(in, out, block_bytes, ncclUint8, "AllGatherBytes");
}
Status NcclCommunicator::BroadcastBytes(std::uint8_t* data, std::size_t count, int root) {
  return BroadcastImpl(data, count, ncclUint8, root, "BroadcastBytes");
}

Status NcclCommunicator::Barrier() {
  // NCCL has no barrier: a one-element all-reduce, waited for, is one.
  CPD_CUDA_CHECK(rank_, cudaSetDevice(device_));
  CPD_NCCL_CHECK(rank_, ncclAllReduce(barrier_word_, barrier_word_, 1, ncclInt32, ncclSum, comm_,
                                      static_cast<cudaStream_t>(stream_)));
  return Sync("Barrier");
}

#undef CPD_CUDA_CHECK
#undef CPD_NCCL_CHECK

}  // namespace cpd::comm
