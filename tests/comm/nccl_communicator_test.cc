// NcclCommunicator on GPUs: one rank (and more under mpirun when the machine has a GPU per
// rank). Inputs whose reduced results are exact, compared element by element on the host. Every
// test skips (GTEST_SKIP) when cudaGetDeviceCount reports no device, so CPU machines pass.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "comm/gradient_allreduce.h"
#include "comm/nccl_communicator.h"
#include "cpd/config.h"
#include "tests/mpi_test_main.h"

namespace cpd::comm {
namespace {

// The NCCL communicator shared by the tests, or null (with the reason) when this machine cannot
// run one: no device, or fewer devices than ranks. Every rank decides the same way.
NcclCommunicator* Nccl(std::string* why) {
  static std::unique_ptr<NcclCommunicator> comm;
  static bool tried = false;
  static std::string reason;
  if (!tried) {
    tried = true;
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      reason = "no CUDA device";
    } else if (devices < test::World()->size()) {
      reason = "fewer GPUs than ranks";
    } else {
      auto created = NcclCommunicator::Create(test::World());
      if (created.ok()) {
        comm = std::move(created).value();
      } else {
        reason = created.status().ToString();
        ADD_FAILURE() << reason;
      }
    }
  }
  *why = reason;
  return comm.get();
}

#define NCCL_OR_SKIP(var)              \
  std::string why_;                    \
  NcclCommunicator* var = Nccl(&why_); \
  if (var == nullptr) GTEST_SKIP() << why_;

// A device buffer of T.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (n > 0) {
      EXPECT_EQ(cudaMalloc(&p_, n * sizeof(T)), cudaSuccess);
    }
  }
  ~DeviceBuffer() {
    if (p_ != nullptr) cudaFree(p_);
  }
  T* get() { return p_; }
  void Upload(const std::vector<T>& v) {
    if (n_ > 0) {
      ASSERT_EQ(cudaMemcpy(p_, v.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  std::vector<T> Download() {
    std::vector<T> v(n_);
    if (n_ > 0) {
      EXPECT_EQ(cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return v;
  }

 private:
  T* p_ = nullptr;
  size_t n_;
};

const std::vector<size_t> kCounts = {0, 1, 7, 1023, size_t{1} << 20};
float Pattern(size_t i) { return static_cast<float>(i % 4096); }

TEST(NcclCommunicatorTest, DeviceMemoryAndRanks) {
  NCCL_OR_SKIP(c);
  EXPECT_EQ(c->memory(), MemorySpace::kDevice);
  EXPECT_EQ(c->size(), test::World()->size());
  EXPECT_EQ(c->rank(), test::World()->rank());
  EXPECT_TRUE(c->Barrier().ok());
}

TEST(NcclCommunicatorTest, AllReduceSumAndMax) {
  NCCL_OR_SKIP(c);
  const int n = c->size(), r = c->rank();
  for (size_t count : kCounts) {
    std::vector<float> h(count);
    for (size_t i = 0; i < count; ++i) h[i] = Pattern(i) + static_cast<float>(r);
    DeviceBuffer<float> d(count);
    d.Upload(h);
    ASSERT_TRUE(c->AllReduce(d.get(), count, ReduceOp::kSum).ok());
    std::vector<float> got = d.Download();
    size_t wrong = 0;
    for (size_t i = 0; i < count; ++i)
      wrong += got[i] != n * Pattern(i) + static_cast<float>(n * (n - 1) / 2);
    EXPECT_EQ(wrong, 0u) << "count " << count;
    d.Upload(h);
    ASSERT_TRUE(c->AllReduce(d.get(), count, ReduceOp::kMax).ok());
    got = d.Download();
    wrong = 0;
    for (size_t i = 0; i < count; ++i) wrong += got[i] != Pattern(i) + static_cast<float>(n - 1);
    EXPECT_EQ(wrong, 0u) << "count " << count;
  }
  std::vector<std::int32_t> a = {r, -r, 7};
  std::vector<std::uint64_t> b = {std::uint64_t{1} << 40, static_cast<std::uint64_t>(r)};
  DeviceBuffer<std::int32_t> da(3);
  DeviceBuffer<std::uint64_t> db(2);
  da.Upload(a);
  db.Upload(b);
  ASSERT_TRUE(c->AllReduce(da.get(), 3, ReduceOp::kSum).ok());
  ASSERT_TRUE(c->AllReduce(db.get(), 2, ReduceOp::kMax).ok());
  EXPECT_EQ(da.Download(), (std::vector<std::int32_t>{n * (n - 1) / 2, -n * (n - 1) / 2, 7 * n}));
  EXPECT_EQ(db.Download(), (std::vector<std::uint64_t>{std::uint64_t{1} << 40,
                                                       static_cast<std::uint64_t>(n - 1)}));
}

TEST(NcclCommunicatorTest, ReduceScatterAllGatherAllToAll) {
  NCCL_OR_SKIP(c);
  const int n = c->size(), r = c->rank();
  for (size_t block : kCounts) {
    const size_t total = block * static_cast<size_t>(n);
    std::vector<float> h(total);
    for (size_t j = 0; j < total; ++j) h[j] = Pattern(j) + static_cast<float>(r);
    DeviceBuffer<float> in(total), out(total);
    in.Upload(h);
    ASSERT_TRUE(c->ReduceScatter(in.get(), out.get(), total).ok());
    std::vector<float> got = out.Download();
    size_t wrong = 0;
    for (size_t k = 0; k < block; ++k) {
      const size_t j = static_cast<size_t>(r) * block + k;
      wrong += got[k] != n * Pattern(j) + static_cast<float>(n * (n - 1) / 2);
    }
    EXPECT_EQ(wrong, 0u) << "reduce-scatter block " << block;

    ASSERT_TRUE(c->AllGather(in.get(), out.get(), block).ok());
    got = out.Download();
    wrong = 0;
    for (int s = 0; s < n; ++s)
      for (size_t k = 0; k < block; ++k)
        wrong += got[static_cast<size_t>(s) * block + k] != Pattern(k) + static_cast<float>(s);
    EXPECT_EQ(wrong, 0u) << "all-gather block " << block;

    ASSERT_TRUE(c->AllToAll(in.get(), out.get(), block).ok());
    got = out.Download();
    wrong = 0;
    for (int s = 0; s < n; ++s)
      for (size_t k = 0; k < block; ++k) {
        const size_t j = static_cast<size_t>(r) * block + k;  // what s sent to r
        wrong += got[static_cast<size_t>(s) * block + k] != Pattern(j) + static_cast<float>(s);
      }
    EXPECT_EQ(wrong, 0u) << "all-to-all block " << block;
  }
}

TEST(NcclCommunicatorTest, BytesAndBroadcast) {
  NCCL_OR_SKIP(c);
  const int n = c->size(), r = c->rank();
  for (size_t block : kCounts) {
    const size_t total = block * static_cast<size_t>(n);
    std::vector<std::uint8_t> h(total);
    for (size_t j = 0; j < total; ++j) h[j] = static_cast<std::uint8_t>(j * 7 + r * 31);
    DeviceBuffer<std::uint8_t> in(total), out(total);
    in.Upload(h);
    ASSERT_TRUE(c->AllToAllBytes(in.get(), out.get(), block).ok());
    std::vector<std::uint8_t> got = out.Download();
    size_t wrong = 0;
    for (int s = 0; s < n; ++s)
      for (size_t k = 0; k < block; ++k) {
        const size_t j = static_cast<size_t>(r) * block + k;
        wrong +=
            got[static_cast<size_t>(s) * block + k] != static_cast<std::uint8_t>(j * 7 + s * 31);
      }
    EXPECT_EQ(wrong, 0u) << "block " << block;
    ASSERT_TRUE(c->AllGatherBytes(in.get(), out.get(), block).ok());
    got = out.Download();
    wrong = 0;
    for (int s = 0; s < n; ++s)
      for (size_t k = 0; k < block; ++k)
        wrong +=
            got[static_cast<size_t>(s) * block + k] != static_cast<std::uint8_t>(k * 7 + s * 31);
    EXPECT_EQ(wrong, 0u) << "block " << block;
    for (int root = 0; root < n; ++root) {
      std::vector<float> f(block, r == root ? 2.5f : -1.0f);
      DeviceBuffer<float> df(block);
      df.Upload(f);
      ASSERT_TRUE(c->Broadcast(df.get(), block, root).ok());
      for (float v : df.Download()) ASSERT_EQ(v, 2.5f);
      in.Upload(h);
      ASSERT_TRUE(c->BroadcastBytes(in.get(), block, root).ok());
      got = in.Download();
      for (size_t j = 0; j < block; ++j)
        ASSERT_EQ(got[j], static_cast<std::uint8_t>(j * 7 + root * 31));
    }
  }
}

TEST(NcclCommunicatorTest, RejectsHostPointersAndBadArguments) {
  NCCL_OR_SKIP(c);
  std::vector<float> host(8, 1.0f);
  Status s = c->AllReduce(host.data(), host.size(), ReduceOp::kSum);
  EXPECT_EQ(s.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(s.message().find("device memory"), std::string::npos) << s.ToString();
  DeviceBuffer<float> d(8);
  EXPECT_EQ(c->Broadcast(d.get(), 8, c->size()).code(), Status::Code::kInvalidArgument);
  if (c->size() > 1) {
    EXPECT_EQ(c->ReduceScatter(d.get(), d.get(), static_cast<size_t>(c->size()) + 1).code(),
              Status::Code::kInvalidArgument);
  }
  EXPECT_EQ(c->AllReduce(static_cast<float*>(nullptr), 4, ReduceOp::kSum).code(),
            Status::Code::kInvalidArgument);
  EXPECT_TRUE(c->AllReduce(static_cast<float*>(nullptr), 0, ReduceOp::kSum).ok());
}

TEST(NcclCommunicatorTest, GradientAllReducerRefusesDeviceMemory) {
  NCCL_OR_SKIP(c);
  GradientLayout layout;
  layout.layer_names = {"w"};
  layout.offsets = {0, 16};
  auto red = GradientAllReducer::Create(c, GradientAllReduceOptions{}, layout, 1);
  ASSERT_FALSE(red.ok());
  EXPECT_EQ(red.status().code(), Status::Code::kInvalidArgument);
  EXPECT_NE(red.status().message().find("device memory"), std::string::npos);
}

TEST(NcclCommunicatorTest, CreateWithoutADeviceIsUnavailable) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) {
    GTEST_SKIP() << "this machine has a GPU";
  }
  auto c = NcclCommunicator::Create(test::World());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), Status::Code::kUnavailable) << c.status().ToString();
}

}  // namespace
}  // namespace cpd::comm
