#include "comm/mpi_communicator.h"

#include <algorithm>
#include <climits>
#include <string>
#include <vector>

namespace cpd::comm {
namespace {

Status MpiError(const char* expr, int code, int rank, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) len = 0;
  return Status::Internal(std::string(file) + ":" + std::to_string(line) + ": " + expr +
                          " failed on rank " + std::to_string(rank) + ": " +
                          (len > 0 ? std::string(text, len) : "error " + std::to_string(code)));
}

// Every MPI call goes through this: a failure becomes a Status naming the call and the rank.
#define CPD_MPI_CHECK(rank, call)                                       \
  do {                                                                  \
    const int _cpd_mpi_err = (call);                                    \
    if (_cpd_mpi_err != MPI_SUCCESS) {                                  \
      return MpiError(#call, _cpd_mpi_err, (rank), __FILE__, __LINE__); \
    }                                                                   \
  } while (0)

Status CheckCount(std::size_t count, const char* what, int rank) {
  if (count > static_cast<std::size_t>(INT_MAX)) {
    return Status::InvalidArgument(std::string(what) + " on rank " + std::to_string(rank) +
                                   ": count " + std::to_string(count) + " exceeds MPI's limit of " +
                                   std::to_string(INT_MAX) +
                                   " elements per call; split the buffer");
  }
  return Status::Ok();
}

Status CheckBuffers(const void* a, const void* b, std::size_t count, const char* what, int rank) {
  if (count > 0 && (a == nullptr || b == nullptr)) {
    return Status::InvalidArgument(std::string(what) + " on rank " + std::to_string(rank) +
                                   ": null buffer with count " + std::to_string(count));
  }
  return Status::Ok();
}

MPI_Op ToMpi(ReduceOp op) { return op == ReduceOp::kMax ? MPI_MAX : MPI_SUM; }

}  // namespace

Result<std::unique_ptr<MpiCommunicator>> MpiCommunicator::Create() {
  int finalized = 0;
  CPD_MPI_CHECK(-1, MPI_Finalized(&finalized));
  if (finalized) {
    return Status::Unavailable("MpiCommunicator::Create: MPI has already been finalised");
  }
  int initialized = 0;
  CPD_MPI_CHECK(-1, MPI_Initialized(&initialized));
  bool owns_mpi = false;
  if (!initialized) {
    int provided = 0;
    CPD_MPI_CHECK(-1, MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided));
    owns_mpi = true;
  }
  MPI_Comm comm = MPI_COMM_NULL;
  // Until the duplicate exists, errors on MPI_COMM_WORLD would abort; make them return too.
  CPD_MPI_CHECK(-1, MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  CPD_MPI_CHECK(-1, MPI_Comm_dup(MPI_COMM_WORLD, &comm));
  CPD_MPI_CHECK(-1, MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
  int rank = 0;
  int size = 0;
  CPD_MPI_CHECK(-1, MPI_Comm_rank(comm, &rank));
  CPD_MPI_CHECK(rank, MPI_Comm_size(comm, &size));
  return std::unique_ptr<MpiCommunicator>(new MpiCommunicator(comm, rank, size, owns_mpi));
}

MpiCommunicator::~MpiCommunicator() {
  // Destructors cannot report; failures here are ignored on purpose.
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  if (owns_mpi_) MPI_Finalize();
}

Status MpiCommunicator::AllReduceImpl(void* data, std::size_t count, MPI_Datatype type,
                                      ReduceOp op) {
  CPD_RETURN_IF_ERROR(CheckCount(count, "AllReduce", rank_));
  CPD_RETURN_IF_ERROR(CheckBuffers(data, data, count, "AllReduce", rank_));
  CPD_MPI_CHECK(rank_,
                MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(count), type, ToMpi(op), comm_));
  return Status::Ok();
}

Status MpiCommunicator::AllReduce(float* data, std::size_t count, ReduceOp op) {
  return AllReduceImpl(data, count, MPI_FLOAT, op);
}
Status MpiCommunicator::AllReduce(std::int32_t* data, std::size_t count, ReduceOp op) {
  return AllReduceImpl(data, count, MPI_INT32_T, op);
}
Status MpiCommunicator::AllReduce(std::uint64_t* data, std::size_t count, ReduceOp op) {
  return AllReduceImpl(data, count, MPI_UINT64_T, op);
}

Status MpiCommunicator::ReduceScatter(const float* in, float* out, std::size_t count) {
  if (count % static_cast<std::size_t>(size_) != 0) {
    return Status::InvalidArgument("ReduceScatter on rank " + std::to_string(rank_) + ": count " +
                                   std::to_string(count) + " is not divisible by the world size " +
                                   std::to_string(size_) + "; pad the buffer");
  }
  const std::size_t block = count / static_cast<std::size_t>(size_);
  CPD_RETURN_IF_ERROR(CheckCount(block, "ReduceScatter", rank_));
  CPD_RETURN_IF_ERROR(CheckBuffers(in, out, block, "ReduceScatter", rank_));
  CPD_MPI_CHECK(
      rank_, MPI_Reduce_scatter_block(in, out, static_cast<int>(block), MPI_FLOAT, MPI_SUM, comm_));
  return Status::Ok();
}

Status MpiCommunicator::AllGatherImpl(const void* in, void* out, std::size_t count,
                                      MPI_Datatype type, const char* what) {
  CPD_RETURN_IF_ERROR(CheckCount(count, what, rank_));
  CPD_RETURN_IF_ERROR(CheckBuffers(in, out, count, what, rank_));
  const int n = static_cast<int>(count);
  CPD_MPI_CHECK(rank_, MPI_Allgather(in, n, type, out, n, type, comm_));
  return Status::Ok();
}

Status MpiCommunicator::AllToAllImpl(const void* in, void* out, std::size_t block,
                                     MPI_Datatype type, const char* what) {
  CPD_RETURN_IF_ERROR(CheckCount(block, what, rank_));
  CPD_RETURN_IF_ERROR(CheckBuffers(in, out, block, what, rank_));
  const int n = static_cast<int>(block);
  CPD_MPI_CHECK(rank_, MPI_Alltoall(in, n, type, out, n, type, comm_));
  return Status::Ok();
}

Status MpiCommunicator::CheckRoot(int root, const char* what) const {
  if (root < 0 || root >= size_) {
    return Status::InvalidArgument(std::string(what) + " on rank " + std::to_string(rank_) +
                                   ": root " + std::to_string(root) +
                                   " out of range; must be in [0, " + std::to_string(size_) + ")");
  }
  return Status::Ok();
}

Status MpiCommunicator::AllGather(const float* in, float* out, std::size_t count) {
  return AllGatherImpl(in, out, count, MPI_FLOAT, "AllGather");
}

Status MpiCommunicator::AllToAll(const float* in, float* out, std::size_t block_count) {
  return AllToAllImpl(in, out, block_count, MPI_FLOAT, "AllToAll");
}

Status MpiCommunicator::AllGatherBytes(const std::uint8_t* in, std::uint8_t* out,
                                       std::size_t block_bytes) {
  return AllGatherImpl(in, out, block_bytes, MPI_BYTE, "AllGatherBytes");
}

Status MpiCommunicator::AllToAllBytes(const std::uint8_t* in, std::uint8_t* out,
                                      std::size_t block_bytes) {
  return AllToAllImpl(in, out, block_bytes, MPI_BYTE, "AllToAllBytes");
}

Status MpiCommunicator::Broadcast(float* data, std::size_t count, int root) {
  CPD_RETURN_IF_ERROR(CheckRoot(root, "Broadcast"));
  CPD_RETURN_IF_ERROR(CheckCount(count, "Broadcast", rank_));
  CPD_RETURN_IF_ERROR(CheckBuffers(data, data, count, "Broadcast", rank_));
  CPD_MPI_CHECK(rank_, MPI_Bcast(data, static_cast<int>(count), MPI_FLOAT, root, comm_));
  return Status::Ok();
}

Status MpiCommunicator::BroadcastBytes(std::uint8_t* data, std::size_t count, int root) {
  CPD_RETURN_IF_ERROR(CheckRoot(root, "BroadcastBytes"));
  CPD_RETURN_IF_ERROR(CheckBuffers(data, data, count, "BroadcastBytes", rank_));
  // Broadcast needs no layout on the receiving side, so a buffer beyond MPI's int count simply
  // travels in pieces (every rank computes the same pieces from the same count).
  constexpr std::size_t kPiece = static_cast<std::size_t>(INT_MAX);
  for (std::size_t off = 0; off < count; off += kPiece) {
    const int n = static_cast<int>(std::min(kPiece, count - off));
    CPD_MPI_CHECK(rank_, MPI_Bcast(data + off, n, MPI_BYTE, root, comm_));
  }
  return Status::Ok();
}

Status MpiCommunicator::Barrier() {
  CPD_MPI_CHECK(rank_, MPI_Barrier(comm_));
  return Status::Ok();
}

namespace {

// The point-to-point messages of StartExchangeBytes on the duplicated communicator, which carries
// no other point-to-point traffic: messages between two ranks match in the order they were
// posted, so exchanges started in the same order on every rank pair up.
constexpr int kExchangeTag = 0x4350;

class MpiPendingExchange final : public Communicator::PendingExchange {
 public:
  explicit MpiPendingExchange(int rank) : rank_(rank) {}
  ~MpiPendingExchange() override {
    if (!requests_.empty()) (void)Wait();
  }

  std::vector<MPI_Request>& requests() { return requests_; }

  Status Test(bool* done) override {
    int flag = 1;
    if (!requests_.empty()) {
      CPD_MPI_CHECK(
          rank_, MPI_Testall(int(requests_.size()), requests_.data(), &flag, MPI_STATUSES_IGNORE));
    }
    if (flag) requests_.clear();
    *done = flag != 0;
    return Status::Ok();
  }
  Status Wait() override {
    if (requests_.empty()) return Status::Ok();
    const int err = MPI_Waitall(int(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE);
    requests_.clear();
    if (err != MPI_SUCCESS) return MpiError("MPI_Waitall", err, rank_, __FILE__, __LINE__);
    return Status::Ok();
  }

 private:
  int rank_;
  std::vector<MPI_Request> requests_;
};

}  // namespace

Result<std::unique_ptr<Communicator::PendingExchange>> MpiCommunicator::StartExchangeBytes(
    std::span<const SendBlock> send, std::span<const RecvBlock> recv) {
  CPD_RETURN_IF_ERROR(CheckExchangeBlocks(send, recv, size_, rank_));
  for (int d = 0; d < size_; ++d) {
    CPD_RETURN_IF_ERROR(CheckCount(send[std::size_t(d)].bytes, "StartExchangeBytes", rank_));
    CPD_RETURN_IF_ERROR(CheckCount(recv[std::size_t(d)].bytes, "StartExchangeBytes", rank_));
  }
  auto pending = std::make_unique<MpiPendingExchange>(rank_);
  std::vector<MPI_Request>& requests = pending->requests();
  requests.reserve(2 * std::size_t(size_));
  // Receives first, so that the peers' sends find them posted.
  for (int q = 0; q < size_; ++q) {
    const RecvBlock& r = recv[std::size_t(q)];
    if (q == rank_ || r.bytes == 0) continue;
    requests.emplace_back();
    CPD_MPI_CHECK(
        rank_, MPI_Irecv(r.data, int(r.bytes), MPI_BYTE, q, kExchangeTag, comm_, &requests.back()));
  }
  for (int d = 0; d < size_; ++d) {
    const SendBlock& b = send[std::size_t(d)];
    if (d == rank_ || b.bytes == 0) continue;
    requests.emplace_back();
    CPD_MPI_CHECK(
        rank_, MPI_Isend(b.data, int(b.bytes), MPI_BYTE, d, kExchangeTag, comm_, &requests.back()));
  }
  const SendBlock& self = send[std::size_t(rank_)];
  if (self.bytes > 0) std::copy_n(self.data, self.bytes, recv[std::size_t(rank_)].data);
  return std::unique_ptr<PendingExchange>(std::move(pending));
}

#undef CPD_MPI_CHECK

}  // namespace cpd::comm
