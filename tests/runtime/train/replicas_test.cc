// Replica consistency (runtime/train/replicas.h) under mpirun, world sizes 1-4: every rank computes
// the expected result from the inputs of all ranks (which are functions of the rank) and checks
// its own result bit for bit, so a rank that combined in another order, or skipped a rank, fails.
#include "runtime/train/replicas.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "tests/mpi_test_main.h"

namespace cpd::runtime {
namespace {

using test::World;

// Values whose float sum depends on the order of the additions.
float Value(int rank, size_t i) {
  const float big = (rank % 2 == 0) ? 1e8f : -1e8f;
  return i % 3 == 0 ? big * float(rank + 1) : 0.1f * float(rank + 1) + float(i);
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

TEST(Replicas, SumInRankOrderIsTheRankOrderSumEverywhere) {
  const Replicas replicas(World());
  const int p = replicas.size();
  for (size_t n : {size_t(0), size_t(1), size_t(7), size_t(1000)}) {
    std::vector<float> mine(n);
    for (size_t i = 0; i < n; ++i) mine[i] = Value(replicas.rank(), i);
    auto sum = replicas.SumInRankOrder(mine);
    ASSERT_TRUE(sum.ok()) << sum.status().ToString();
    ASSERT_EQ(sum->size(), n);
    size_t wrong = 0;
    for (size_t i = 0; i < n; ++i) {
      float expected = 0.0f;
      for (int r = 0; r < p; ++r) expected += Value(r, i);
      wrong += Bits((*sum)[i]) != Bits(expected);
    }
    EXPECT_EQ(wrong, 0u) << "n = " << n;
  }
}

TEST(Replicas, BroadcastFromRank0MakesParametersAndBuffersEqual) {
  const Replicas replicas(World());
  Param w{"fc.weight", Tensor({3, 4}), Tensor({3, 4})};
  Param b{"fc.bias", Tensor({3}), Tensor({3})};
  Tensor running({5});
  for (size_t i = 0; i < 12; ++i) w.value.data()[i] = Value(replicas.rank(), i);
  for (size_t i = 0; i < 3; ++i) b.value.data()[i] = float(replicas.rank() * 10 + int(i));
  running.Fill(float(replicas.rank()) + 0.5f);
  ASSERT_TRUE(replicas.BroadcastFromRank0({&w, &b}, {{"bn.running_mean", &running}}).ok());
  for (size_t i = 0; i < 12; ++i) EXPECT_EQ(Bits(w.value.data()[i]), Bits(Value(0, i)));
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(b.value.data()[i], float(i));
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(running.data()[i], 0.5f);
}

TEST(Replicas, AverageBuffersIsTheMeanOverAllWorkersInWorkerOrder) {
  const Replicas replicas(World());
  const int p = replicas.size(), local = 3, workers = p * local;
  Tensor mean({4}), var({2});
  const NamedBuffers buffers = {{"bn.running_mean", &mean}, {"bn.running_var", &var}};
  // Worker w's snapshot of buffer element i: the six floats of both buffers, in order.
  auto snapshot = [](int worker, size_t i) { return Value(worker, i) / 3.0f; };
  std::vector<float> mine(size_t(local) * 6);
  for (int k = 0; k < local; ++k) {
    for (size_t i = 0; i < 6; ++i)
      mine[size_t(k) * 6 + i] = snapshot(replicas.rank() * local + k, i);
  }
  ASSERT_TRUE(replicas.AverageBuffers(mine, local, workers, buffers).ok());
  for (size_t i = 0; i < 6; ++i) {
    // This rank's workers first, then the ranks in order.
    float total = 0.0f;
    for (int r = 0; r < p; ++r) {
      float rank_sum = 0.0f;
      for (int k = 0; k < local; ++k) rank_sum += snapshot(r * local + k, i);
      total += rank_sum;
    }
    const float got = i < 4 ? mean.data()[i] : var.data()[i - 4];
    EXPECT_EQ(Bits(got), Bits(total / float(workers))) << "element " << i;
  }
}

TEST(Replicas, CombineGivesTheGlobalBatchEverywhere) {
  const Replicas replicas(World());
  const int p = replicas.size(), r = replicas.rank();
  BatchTotals local{2.5f * float(r + 1), r + 1, 10};
  auto g = replicas.Combine(local);
  ASSERT_TRUE(g.ok());
  float loss_sum = 0.0f;
  for (int q = 0; q < p; ++q) loss_sum += 2.5f * float(q + 1);
  EXPECT_EQ(g->count, 10 * p);
  EXPECT_EQ(g->correct, p * (p + 1) / 2);
  EXPECT_EQ(Bits(g->loss), Bits(loss_sum / float(10 * p)));
}

TEST(Replicas, SiteRecordsAreSummedAndMaximisedOverTheRanks) {
  const Replicas replicas(World());
  const int p = replicas.size(), r = replicas.rank();
  SiteRecord rec;
  rec.layer = "conv1";
  rec.site = Site::kActivation;
  rec.format = "e4m3";
  rec.stats.count = 100;
  rec.stats.saturated = uint64_t(r);
  rec.stats.flushed = 2;
  rec.stats.nonfinite = r == p - 1 ? 1 : 0;
  rec.stats.max_abs = float(r) * 1.5f;
  rec.stats.sq_error = 0.25 * (r + 1);
  rec.stats.sq_input = 4.0;
  std::vector<SiteRecord> records = {rec};
  ASSERT_TRUE(replicas.ReduceSiteRecords(&records).ok());
  const QuantStats& st = records[0].stats;
  EXPECT_EQ(st.count, uint64_t(100 * p));
  EXPECT_EQ(st.saturated, uint64_t(p * (p - 1) / 2));
  EXPECT_EQ(st.flushed, uint64_t(2 * p));
  EXPECT_EQ(st.nonfinite, 1u);
  EXPECT_EQ(st.max_abs, float(p - 1) * 1.5f);
  EXPECT_EQ(st.sq_input, 4.0 * p);
}

TEST(Replicas, AgreeOnSharesRankZerosFailureWithEveryRank) {
  const Replicas replicas(World());
  EXPECT_TRUE(replicas.AgreeOn(Status::Ok(), "unused").ok());
  const Status local = replicas.lead() ? Status::IoError("disk full") : Status::Ok();
  const Status s = replicas.AgreeOn(local, "writing failed on rank 0");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), Status::Code::kIoError);
  EXPECT_EQ(s.message(), replicas.lead() ? "disk full" : "writing failed on rank 0");
}

TEST(Replicas, CheckIdenticalFindsOneDivergentRank) {
  const Replicas replicas(World());
  EXPECT_TRUE(replicas.CheckIdentical(0x0123456789abcdefull).ok());
  if (replicas.size() == 1) GTEST_SKIP() << "one rank cannot diverge";
  const uint64_t hash = replicas.rank() == replicas.size() - 1 ? 7 : 9;
  const Status s = replicas.CheckIdentical(hash);
  EXPECT_EQ(s.code(), Status::Code::kInternal) << "rank " << replicas.rank();
}

TEST(Replicas, HashParamsSeesEveryBit) {
  Param a{"a", Tensor({8}), Tensor({8})};
  a.value.Fill(1.0f);
  const uint64_t h1 = Replicas::HashParams({&a});
  EXPECT_EQ(h1, Replicas::HashParams({&a}));
  a.value.data()[5] = std::nextafter(1.0f, 2.0f);
  EXPECT_NE(h1, Replicas::HashParams({&a}));
}

}  // namespace
}  // namespace cpd::runtime
