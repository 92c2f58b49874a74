// Collectives under mpirun (world sizes 1-4): inputs whose reduced results are exact, so every
// element is compared bit for bit and the wrong ones are counted (after gloo's allreduce_test and
// nccl-tests' verifiable inputs). Run as `mpirun -np N comm_mpi_test`; only rank 0 prints.
#include "comm/mpi_communicator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "tests/mpi_test_main.h"

namespace cpd::comm {
namespace {

const std::vector<std::size_t> kCounts = {0, 1, 7, 1023, std::size_t{1} << 20};

// Small integers: exact in float32 and after summing over a few ranks.
float Pattern(std::size_t i) { return static_cast<float>(i % 4096); }

TEST(MpiCommunicatorTest, RankAndSize) {
  ASSERT_NE(test::MpiWorld(), nullptr);
  EXPECT_GE(test::MpiWorld()->size(), 1);
  EXPECT_GE(test::MpiWorld()->rank(), 0);
  EXPECT_LT(test::MpiWorld()->rank(), test::MpiWorld()->size());
  // Every rank sees the same size and a distinct rank: sum of ranks is n(n-1)/2.
  std::int32_t v[2] = {test::MpiWorld()->rank(), 1};
  ASSERT_TRUE(test::MpiWorld()->AllReduce(v, 2, ReduceOp::kSum).ok());
  const int n = test::MpiWorld()->size();
  EXPECT_EQ(v[0], n * (n - 1) / 2);
  EXPECT_EQ(v[1], n);
}

TEST(MpiCommunicatorTest, AllReduceSumFloat) {
  const int n = test::MpiWorld()->size();
  const int r = test::MpiWorld()->rank();
  for (std::size_t count : kCounts) {
    std::vector<float> data(count);
    for (std::size_t i = 0; i < count; ++i) data[i] = Pattern(i) + static_cast<float>(r);
    Status s = test::MpiWorld()->AllReduce(data.data(), count, ReduceOp::kSum);
    ASSERT_TRUE(s.ok()) << s.ToString();
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < count; ++i) {
      const float expected =
          static_cast<float>(n) * Pattern(i) + static_cast<float>(n * (n - 1) / 2);
      wrong += data[i] != expected;
    }
    EXPECT_EQ(wrong, 0u) << "count " << count;
  }
}

TEST(MpiCommunicatorTest, AllReduceMaxFloat) {
  const int n = test::MpiWorld()->size();
  const int r = test::MpiWorld()->rank();
  auto value = [](std::size_t i, int rank) {
    return static_cast<float>((i * 7 + static_cast<std::size_t>(rank) * 13) % 101) - 50.0f;
  };
  for (std::size_t count : kCounts) {
    std::vector<float> data(count);
    for (std::size_t i = 0; i < count; ++i) data[i] = value(i, r);
    ASSERT_TRUE(test::MpiWorld()->AllReduce(data.data(), count, ReduceOp::kMax).ok());
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < count; ++i) {
      float expected = value(i, 0);
      for (int q = 1; q < n; ++q) expected = std::max(expected, value(i, q));
      wrong += data[i] != expected;
    }
    EXPECT_EQ(wrong, 0u) << "count " << count;
  }
}

TEST(MpiCommunicatorTest, AllReduceIntegers) {
  const int n = test::MpiWorld()->size();
  const int r = test::MpiWorld()->rank();
  for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{9}}) {
    std::vector<std::int32_t> a(count);
    std::vector<std::uint64_t> b(count);
    std::vector<std::int32_t> m(count);
    for (std::size_t i = 0; i < count; ++i) {
      a[i] = static_cast<std::int32_t>(i) - r;
      b[i] = (std::uint64_t{1} << 40) + static_cast<std::uint64_t>(i) * 3 + r;
      m[i] = r == n - 1 ? static_cast<std::int32_t>(i) + 100 : -static_cast<std::int32_t>(i);
    }
    ASSERT_TRUE(test::MpiWorld()->AllReduce(a.data(), count, ReduceOp::kSum).ok());
    ASSERT_TRUE(test::MpiWorld()->AllReduce(b.data(), count, ReduceOp::kSum).ok());
    ASSERT_TRUE(test::MpiWorld()->AllReduce(m.data(), count, ReduceOp::kMax).ok());
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < count; ++i) {
      wrong += a[i] != n * static_cast<std::int32_t>(i) - n * (n - 1) / 2;
      wrong += b[i] != static_cast<std::uint64_t>(n) * ((std::uint64_t{1} << 40) + i * 3) +
                           static_cast<std::uint64_t>(n * (n - 1) / 2);
      wrong += m[i] != static_cast<std::int32_t>(i) + 100;
    }
    EXPECT_EQ(wrong, 0u) << "count " << count;
  }
}

TEST(MpiCommunicatorTest, ReduceScatterBlocks) {
  const int n = test::MpiWorld()->size();
  const int r = test::MpiWorld()->rank();
  for (std::size_t block : {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{1} << 18}) {
    const std::size_t count = block * static_cast<std::size_t>(n);
    std::vector<float> in(count);
    for (std::size_t j = 0; j < count; ++j) in[j] = Pattern(j) + static_cast<float>(r);
    std::vector<float> out(block, -1.0f);
    Status s = test::MpiWorld()->ReduceScatter(in.data(), out.data(), count);
    ASSERT_TRUE(s.ok()) << s.ToString();
    std::size_t wrong = 0;
    for (std::size_t k = 0; k < block; ++k) {
      const std::size_t j = static_cast<std::size_t>(r) * block + k;
      const float expected =
          static_cast<float>(n) * Pattern(j) + static_cast<float>(n * (n - 1) / 2);
      wrong += out[k] != expected;
    }
    EXPECT_EQ(wrong, 0u) << "block " << block;
  }
}

TEST(MpiCommunicatorTest, ReduceScatterRejectsIndivisibleCount) {
  const int n = test::MpiWorld()->size();
  if (n == 1) GTEST_SKIP() << "every count is divisible by 1";
  std::vector<float> in(static_cast<std::size_t>(n) + 1, 1.0f);
  std::vector<float> out(2);
  Status s = test::MpiWorld()->ReduceScatter(in.data(), out.data(), in.size());
  EXPECT_EQ(s.code(), Status::Code::kInvalidArgument) << s.ToString();
}

TEST(MpiCommunicatorTest, AllGatherPlacesBlocksByRank) {
  const int n = test::MpiWorld()->size();
  const int r = test::MpiWorld()->rank();
  for (std::size_t count : kCounts) {
    std::vector<float> in(count);
    for (std::size_t k = 0; k < count; ++k) in[k] = static_cast<float>(r * 4096) + Pattern(k);
    std::vector<float> out(count * static_cast<std::size_t>(n), -1.0f);
    ASSERT_TRUE(test::MpiWorld()->AllGather(in.data(), out.data(), count).ok());
    std::size_t wrong = 0;
    for (int s = 0; s < n; ++s) {
      for (std::size_t k = 0; k < count; ++k) {
        wrong += out[static_cast<std::size_t>(s) * count + k] !=
                 static_cast<float>(s * 4096) + Pattern(k);
      }
    }
    EXPECT_EQ(wrong, 0u) << "count " << count;
  }
}

TEST(MpiCommunicatorTest, AllToAllRoutesBlocks) {
  const int n = test::MpiWorld()->size();
  const int r = test::MpiWorld()->rank();
  // Element k of the block from rank src to rank dst.
  auto value = [n](int src, int dst, std::size_t k) {
    return static_cast<float>((src * n + dst) * 4096) + Pattern(k);
  };
  for (std::size_t block : kCounts) {
    const std::size_t total = block * static_cast<std::size_t>(n);
    std::vector<float> in(total);
    for (int d = 0; d < n; ++d) {
      for (std::size_t k = 0; k < block; ++k)
        in[static_cast<std::size_t>(d) * block + k] = value(r, d, k);
    }
    std::vector<float> out(total, -1.0f);
    ASSERT_TRUE(test::MpiWorld()->AllToAll(in.data(), out.data(), block).ok());
    std::size_t wrong = 0;
    for (int s = 0; s < n; ++s) {
      for (std::size_t k = 0; k < block; ++k) {
        wrong += out[static_cast<std::size_t>(s) * block + k] != value(s, r, k);
      }
    }
    EXPECT_EQ(wrong, 0u) << "block " << block;
  }
}

TEST(MpiCommunicatorTest, BroadcastFromEveryRoot) {
  const int n = test::MpiWorld()->size();
  const int r = test::MpiWorld()->rank();
  // The last root is non-zero whenever n > 1.
  for (int root = 0; root < n; ++root) {
    for (std::size_t count : kCounts) {
      std::vector<float> data(count);
      for (std::size_t i = 0; i < count; ++i) {
        data[i] = r == root ? Pattern(i) + 0.5f + static_cast<float>(root) : -1.0f;
      }
      ASSERT_TRUE(test::MpiWorld()->Broadcast(data.data(), count, root).ok());
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < count; ++i) {
        wrong += data[i] != Pattern(i) + 0.5f + static_cast<float>(root);
      }
      EXPECT_EQ(wrong, 0u) << "root " << root << " count " << count;
    }
  }
}

// A byte that depends on every coordinate, so a misrouted or shifted block is caught.
std::uint8_t ByteOf(int src, int dst, std::size_t k) {
  return static_cast<std::uint8_t>((static_cast<std::size_t>(src) * 131 +
                                    static_cast<std::size_t>(dst) * 29 + k * 7 + (k >> 8)) &
                                   0xffu);
}

TEST(MpiCommunicatorTest, AllToAllBytesRoutesBlocks) {
  const int n = test::MpiWorld()->size();
  const int r = test::MpiWorld()->rank();
  for (std::size_t block : kCounts) {
    const std::size_t total = block * static_cast<std::size_t>(n);
    std::vector<std::uint8_t> in(total);
    for (int d = 0; d < n; ++d) {
      for (std::size_t k = 0; k < block; ++k)
        in[static_cast<std::size_t>(d) * block + k] = ByteOf(r, d, k);
    }
    std::vector<std::uint8_t> out(total, 0xee);
    Status s = test::MpiWorld()->AllToAllBytes(in.data(), out.data(), block);
    ASSERT_TRUE(s.ok()) << s.ToString();
    std::size_t wrong = 0;
    for (int src = 0; src < n; ++src) {
      for (std::size_t k = 0; k < block; ++k)
        wrong += out[static_cast<std::size_t>(src) * block + k] != ByteOf(src, r, k);
    }
    EXPECT_EQ(wrong, 0u) << "block " << block;
  }
}

TEST(MpiCommunicatorTest, AllGatherBytesPlacesBlocksByRank) {
  const int n = test::MpiWorld()->size();
  const int r = test::MpiWorld()->rank();
  for (std::size_t block : kCounts) {
    std::vector<std::uint8_t> in(block);
    for (std::size_t k = 0; k < block; ++k) in[k] = ByteOf(r, 0, k);
    std::vector<std::uint8_t> out(block * static_cast<std::size_t>(n), 0xee);
    Status s = test::MpiWorld()->AllGatherBytes(in.data(), out.data(), block);
    ASSERT_TRUE(s.ok()) << s.ToString();
    std::size_t wrong = 0;
    for (int src = 0; src < n; ++src) {
      for (std::size_t k = 0; k < block; ++k)
        wrong += out[static_cast<std::size_t>(src) * block + k] != ByteOf(src, 0, k);
    }
    EXPECT_EQ(wrong, 0u) << "block " << block;
  }
}

TEST(MpiCommunicatorTest, BroadcastBytesFromEveryRoot) {
  const int n = test::MpiWorld()->size();
  const int r = test::MpiWorld()->rank();
  for (int root = 0; root < n; ++root) {
    for (std::size_t count : kCounts) {
      std::vector<std::uint8_t> data(count);
      for (std::size_t k = 0; k < count; ++k) data[k] = r == root ? ByteOf(root, 1, k) : 0xee;
      ASSERT_TRUE(test::MpiWorld()->BroadcastBytes(data.data(), count, root).ok());
      std::size_t wrong = 0;
      for (std::size_t k = 0; k < count; ++k) wrong += data[k] != ByteOf(root, 1, k);
      EXPECT_EQ(wrong, 0u) << "root " << root << " count " << count;
    }
  }
}

// Beyond MPI's int count the broadcast travels in pieces; the last root and the bytes on both
// sides of the 2^31 boundary are checked. 2 GiB per rank, so only at world sizes 1 and 2.
TEST(MpiCommunicatorTest, BroadcastBytesBeyondIntMax) {
  const int n = test::MpiWorld()->size();
  if (n > 2) GTEST_SKIP() << "needs 2 GiB per rank; run at world size 1 or 2";
  const int r = test::MpiWorld()->rank();
  const int root = n - 1;
  const std::size_t count = static_cast<std::size_t>(INT_MAX) + 7;
  std::vector<std::uint8_t> data(count, r == root ? 0x5a : 0x00);
  if (r == root) {
    for (std::size_t k = count - 64; k < count; ++k) data[k] = ByteOf(root, 2, k);
    data[0] = 0x11;
  }
  ASSERT_TRUE(test::MpiWorld()->BroadcastBytes(data.data(), count, root).ok());
  std::size_t wrong = data[0] != 0x11;
  for (std::size_t k = 1; k < count - 64; k += 4093) wrong += data[k] != 0x5a;
  for (std::size_t k = count - 64; k < count; ++k) wrong += data[k] != ByteOf(root, 2, k);
  EXPECT_EQ(wrong, 0u);
}

TEST(MpiCommunicatorTest, ByteCollectivesRejectBadArguments) {
  std::uint8_t a[4] = {1, 2, 3, 4};
  std::uint8_t b[16] = {};
  const std::size_t too_many = static_cast<std::size_t>(INT_MAX) + 1;
  // Rejected before MPI sees the (small) buffers.
  Status s = test::MpiWorld()->AllToAllBytes(a, b, too_many);
  EXPECT_EQ(s.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(s.message().find("AllToAllBytes"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("rank " + std::to_string(test::MpiWorld()->rank())), std::string::npos)
      << s.ToString();
  EXPECT_EQ(test::MpiWorld()->AllGatherBytes(a, b, too_many).code(),
            Status::Code::kInvalidArgument);
  EXPECT_EQ(test::MpiWorld()->AllGatherBytes(nullptr, b, 1).code(), Status::Code::kInvalidArgument);
  EXPECT_EQ(test::MpiWorld()->AllToAllBytes(a, nullptr, 1).code(), Status::Code::kInvalidArgument);
  EXPECT_EQ(test::MpiWorld()->BroadcastBytes(a, 4, test::MpiWorld()->size()).code(),
            Status::Code::kInvalidArgument);
  EXPECT_EQ(test::MpiWorld()->BroadcastBytes(a, 4, -1).code(), Status::Code::kInvalidArgument);
  EXPECT_EQ(test::MpiWorld()->BroadcastBytes(nullptr, 4, 0).code(), Status::Code::kInvalidArgument);
  EXPECT_TRUE(test::MpiWorld()->BroadcastBytes(nullptr, 0, 0).ok());
  EXPECT_TRUE(test::MpiWorld()->Barrier().ok());
}

TEST(MpiCommunicatorTest, InvalidArgumentsAreRejectedBeforeMpi) {
  float x = 0.0f;
  EXPECT_EQ(test::MpiWorld()->Broadcast(&x, 1, test::MpiWorld()->size()).code(),
            Status::Code::kInvalidArgument);
  EXPECT_EQ(test::MpiWorld()->Broadcast(&x, 1, -1).code(), Status::Code::kInvalidArgument);
  EXPECT_EQ(test::MpiWorld()->AllReduce(static_cast<float*>(nullptr), 4, ReduceOp::kSum).code(),
            Status::Code::kInvalidArgument);
  // Null buffers are fine with a count of 0.
  EXPECT_TRUE(test::MpiWorld()->AllReduce(static_cast<float*>(nullptr), 0, ReduceOp::kSum).ok());
  EXPECT_TRUE(test::MpiWorld()->Barrier().ok());
}

// The byte rank q sends to rank d at position i of exchange e: every block is distinct.
std::uint8_t ExchangeByte(int e, int q, int d, std::size_t i) {
  return static_cast<std::uint8_t>(e * 131 + q * 29 + d * 7 + int(i % 251));
}
// Block sizes that differ by sender, receiver and exchange, zero included.
std::size_t ExchangeBytes(int e, int q, int d) {
  return std::size_t((e * 5 + q * 3 + d) % 4) * 1000 + std::size_t(q == d ? 0 : (e + d) % 3);
}

// Three exchanges started back to back with blocks of different sizes (some empty), completed
// out of order (the last one waited for first, the first one polled with Test), with a blocking
// collective in between: every block lands where its sender put it.
TEST(MpiCommunicatorTest, StartExchangeBytesRoutesBlocksOfAnySize) {
  Communicator* w = test::MpiWorld();
  const int n = w->size(), r = w->rank();
  constexpr int kExchanges = 3;
  std::vector<std::vector<std::vector<std::uint8_t>>> out(kExchanges), in(kExchanges);
  std::vector<std::unique_ptr<Communicator::PendingExchange>> pending;
  for (int e = 0; e < kExchanges; ++e) {
    std::vector<Communicator::SendBlock> send(static_cast<std::size_t>(n));
    std::vector<Communicator::RecvBlock> recv(static_cast<std::size_t>(n));
    out[e].resize(std::size_t(n));
    in[e].resize(std::size_t(n));
    for (int d = 0; d < n; ++d) {
      auto& o = out[e][std::size_t(d)];
      o.resize(ExchangeBytes(e, r, d));
      for (std::size_t i = 0; i < o.size(); ++i) o[i] = ExchangeByte(e, r, d, i);
      send[std::size_t(d)] = {o.data(), o.size()};
      auto& b = in[e][std::size_t(d)];
      b.assign(ExchangeBytes(e, d, r), 0);
      recv[std::size_t(d)] = {b.data(), b.size()};
    }
    auto started = w->StartExchangeBytes(send, recv);
    ASSERT_TRUE(started.ok()) << started.status().ToString();
    pending.push_back(std::move(started).value());
  }
  std::int32_t one = 1;
  ASSERT_TRUE(w->AllReduce(&one, 1, ReduceOp::kSum).ok());
  EXPECT_EQ(one, n);
  ASSERT_TRUE(pending[2]->Wait().ok());
  bool done = false;
  for (int polls = 0; !done; ++polls) {
    ASSERT_TRUE(pending[0]->Test(&done).ok());
    ASSERT_LT(polls, 100000000) << "exchange 0 never completed";
  }
  ASSERT_TRUE(pending[1]->Wait().ok());
  ASSERT_TRUE(pending[0]->Wait().ok());  // completed: returns at once
  ASSERT_TRUE(pending[0]->Test(&done).ok());
  EXPECT_TRUE(done);
  std::size_t wrong = 0;
  for (int e = 0; e < kExchanges; ++e) {
    for (int q = 0; q < n; ++q) {
      const auto& b = in[e][std::size_t(q)];
      for (std::size_t i = 0; i < b.size(); ++i) wrong += b[i] != ExchangeByte(e, q, r, i);
    }
  }
  EXPECT_EQ(wrong, 0u);
}

// Destroying an exchange in flight waits for it, and the next exchange still pairs up.
TEST(MpiCommunicatorTest, StartExchangeBytesDestroyedInFlightCompletes) {
  Communicator* w = test::MpiWorld();
  const int n = w->size(), r = w->rank();
  std::vector<std::uint8_t> out(std::size_t(n) * 64), in(std::size_t(n) * 64, 0);
  for (int round = 0; round < 2; ++round) {
    std::vector<Communicator::SendBlock> send(static_cast<std::size_t>(n));
    std::vector<Communicator::RecvBlock> recv(static_cast<std::size_t>(n));
    for (int d = 0; d < n; ++d) {
      for (std::size_t i = 0; i < 64; ++i) {
        out[std::size_t(d) * 64 + i] = ExchangeByte(round, r, d, i);
      }
      send[std::size_t(d)] = {out.data() + std::size_t(d) * 64, 64};
      recv[std::size_t(d)] = {in.data() + std::size_t(d) * 64, 64};
    }
    {
      auto started = w->StartExchangeBytes(send, recv);
      ASSERT_TRUE(started.ok()) << started.status().ToString();
    }  // destroyed here
    std::size_t wrong = 0;
    for (int q = 0; q < n; ++q) {
      for (std::size_t i = 0; i < 64; ++i) {
        wrong += in[std::size_t(q) * 64 + i] != ExchangeByte(round, q, r, i);
      }
    }
    EXPECT_EQ(wrong, 0u) << "round " << round;
  }
}

TEST(MpiCommunicatorTest, StartExchangeBytesRejectsBadBlocks) {
  Communicator* w = test::MpiWorld();
  const int n = w->size(), r = w->rank();
  std::vector<std::uint8_t> buf(16);
  std::vector<Communicator::SendBlock> send(std::size_t(n), {buf.data(), 4});
  std::vector<Communicator::RecvBlock> recv(std::size_t(n), {buf.data() + 8, 4});
  auto expect_invalid = [&](std::span<const Communicator::SendBlock> s,
                            std::span<const Communicator::RecvBlock> rv, const char* what) {
    auto started = w->StartExchangeBytes(s, rv);
    ASSERT_FALSE(started.ok()) << what;
    EXPECT_EQ(started.status().code(), Status::Code::kInvalidArgument) << what;
    EXPECT_NE(started.status().message().find("StartExchangeBytes"), std::string::npos)
        << started.status().ToString();
  };
  expect_invalid(std::span(send).first(std::size_t(n - 1)), recv, "too few send blocks");
  std::vector<Communicator::SendBlock> null_send = send;
  null_send[std::size_t(r)] = {nullptr, 4};
  expect_invalid(null_send, recv, "null data");
  std::vector<Communicator::RecvBlock> self_mismatch = recv;
  self_mismatch[std::size_t(r)].bytes = 3;
  expect_invalid(send, self_mismatch, "block to itself of another size");
}

TEST(MpiCommunicatorTest, CreateAgainSharesTheInitialisedMpi) {
  // MPI is already initialised: a second communicator must not finalise it.
  auto second = MpiCommunicator::Create();
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  std::unique_ptr<MpiCommunicator> c = std::move(second).value();
  EXPECT_EQ(c->size(), test::MpiWorld()->size());
  EXPECT_EQ(c->rank(), test::MpiWorld()->rank());
  float v = 1.0f;
  ASSERT_TRUE(c->AllReduce(&v, 1, ReduceOp::kSum).ok());
  EXPECT_EQ(v, static_cast<float>(c->size()));
  c.reset();
  EXPECT_TRUE(test::MpiWorld()->Barrier().ok());
}

TEST(SelfCommunicatorTest, WorldOfOne) {
  SelfCommunicator self;
  EXPECT_EQ(self.rank(), 0);
  EXPECT_EQ(self.size(), 1);
  for (std::size_t count : kCounts) {
    std::vector<float> a(count);
    for (std::size_t i = 0; i < count; ++i) a[i] = Pattern(i) - 7.0f;
    const std::vector<float> orig = a;
    ASSERT_TRUE(self.AllReduce(a.data(), count, ReduceOp::kSum).ok());
    ASSERT_TRUE(self.AllReduce(a.data(), count, ReduceOp::kMax).ok());
    ASSERT_TRUE(self.Broadcast(a.data(), count, 0).ok());
    EXPECT_EQ(a, orig);
    std::vector<float> out(count, -1.0f);
    ASSERT_TRUE(self.ReduceScatter(a.data(), out.data(), count).ok());
    EXPECT_EQ(out, orig);
    std::fill(out.begin(), out.end(), -1.0f);
    ASSERT_TRUE(self.AllGather(a.data(), out.data(), count).ok());
    EXPECT_EQ(out, orig);
    std::fill(out.begin(), out.end(), -1.0f);
    ASSERT_TRUE(self.AllToAll(a.data(), out.data(), count).ok());
    EXPECT_EQ(out, orig);
    std::vector<std::uint8_t> bytes(count), bout(count, 0xee);
    for (std::size_t i = 0; i < count; ++i) bytes[i] = ByteOf(0, 0, i);
    ASSERT_TRUE(self.AllToAllBytes(bytes.data(), bout.data(), count).ok());
    EXPECT_EQ(bout, bytes);
    std::fill(bout.begin(), bout.end(), 0xee);
    ASSERT_TRUE(self.AllGatherBytes(bytes.data(), bout.data(), count).ok());
    EXPECT_EQ(bout, bytes);
    const std::vector<std::uint8_t> borig = bytes;
    ASSERT_TRUE(self.BroadcastBytes(bytes.data(), count, 0).ok());
    EXPECT_EQ(bytes, borig);
  }
  std::int32_t i32[2] = {3, -4};
  std::uint64_t u64[1] = {std::uint64_t{1} << 50};
  ASSERT_TRUE(self.AllReduce(i32, 2, ReduceOp::kSum).ok());
  ASSERT_TRUE(self.AllReduce(u64, 1, ReduceOp::kMax).ok());
  EXPECT_EQ(i32[0], 3);
  EXPECT_EQ(i32[1], -4);
  EXPECT_EQ(u64[0], std::uint64_t{1} << 50);
  float x = 1.0f;
  EXPECT_EQ(self.Broadcast(&x, 1, 1).code(), Status::Code::kInvalidArgument);
  EXPECT_EQ(self.AllGather(nullptr, &x, 1).code(), Status::Code::kInvalidArgument);
  EXPECT_TRUE(self.AllGather(nullptr, nullptr, 0).ok());
  std::uint8_t byte = 1;
  EXPECT_EQ(self.BroadcastBytes(&byte, 1, 1).code(), Status::Code::kInvalidArgument);
  EXPECT_EQ(self.AllToAllBytes(nullptr, &byte, 1).code(), Status::Code::kInvalidArgument);
  EXPECT_TRUE(self.AllGatherBytes(nullptr, nullptr, 0).ok());
  EXPECT_TRUE(self.Barrier().ok());
}

}  // namespace
}  // namespace cpd::comm
