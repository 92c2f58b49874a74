// The all-reduce performance model (comm/perf_model.h): each prediction against the header's
// formulas worked by hand, the orderings the schedules imply, the pipeline's rounds as the
// algorithm chooses them, and the measurement of the element loops' cost.
#include "comm/perf_model.h"

#include <gtest/gtest.h>

#include <cmath>

namespace cpd::comm::perf {
namespace {

// 10 us start-up, 1 GB/s; loops at 1 ns per element on one thread (float32 add 0.5 ns).
constexpr Link kLink{10e-6, 1e9};
constexpr CodecCost kCost{1e-9, 1e-9, 1e-9, 1e-9, 0.5e-9};
constexpr Host kSpareCore{1, 2, 1};  // overlaps
constexpr Host kCrowded{4, 2, 1};    // half a core per rank, no overlap

TEST(PerfModelTest, HostParallelism) {
  EXPECT_DOUBLE_EQ(kSpareCore.Parallelism(), 1.0);
  EXPECT_TRUE(kSpareCore.Overlaps());
  EXPECT_DOUBLE_EQ(kCrowded.Parallelism(), 0.5);
  EXPECT_FALSE(kCrowded.Overlaps());
  EXPECT_DOUBLE_EQ((Host{2, 16, 4}).Parallelism(), 4.0);
  EXPECT_DOUBLE_EQ((Host{2, 16, 16}).Parallelism(), 8.0);
}

TEST(PerfModelTest, Fp32RingByHand) {
  const Case c{4, 1'000'000, 32, false, false, 0};
  // wire 2 * 3 * (10 us + 4e6 / 4 / 1e9 s) = 6.06 ms; compute 3/4 * 1e6 * 0.5 ns = 0.375 ms.
  const Prediction p = PredictFp32Ring(c, kLink, kCost, kSpareCore);
  EXPECT_NEAR(p.wire, 6.06e-3, 1e-12);
  EXPECT_NEAR(p.compute, 0.375e-3, 1e-12);
  EXPECT_NEAR(p.total, 6.06e-3, 1e-12);  // overlapped
  const Prediction crowded = PredictFp32Ring(c, kLink, kCost, kCrowded);
  EXPECT_NEAR(crowded.compute, 0.75e-3, 1e-12);  // half a core
  EXPECT_NEAR(crowded.total, 6.06e-3 + 0.75e-3, 1e-12);
  EXPECT_EQ(PredictFp32Ring({1, 1000, 32, false, false, 0}, kLink, kCost, kSpareCore).total, 0.0);
}

TEST(PerfModelTest, PackedSequentialByHand) {
  const Case c{4, 1'000'000, 8, true, false, 0};
  // compute: scan 1 ms + encode 1 + decode-add 1 + re-encode 0.25 + decode 1 = 4.25 ms;
  // wire: shifts 2 * ceil(log2 4) * 10 us = 40 us, and two exchanges of 3 * (10 us + 250 us).
  const Prediction p = PredictPacked(c, kLink, kCost, kSpareCore);
  EXPECT_NEAR(p.compute, 4.25e-3, 1e-12);
  EXPECT_NEAR(p.wire, 40e-6 + 2 * 3 * 260e-6, 1e-12);
  EXPECT_NEAR(p.total, p.compute + p.wire, 1e-12);
  // Four bits halve the payload's bandwidth term, not its start-ups.
  const Prediction p4 = PredictPacked({4, 1'000'000, 4, true, false, 0}, kLink, kCost, kSpareCore);
  EXPECT_NEAR(p4.wire, 40e-6 + 2 * 3 * 135e-6, 1e-12);
  // Without APS: no scan, no shifts.
  const Prediction plain =
      PredictPacked({4, 1'000'000, 8, false, false, 0}, kLink, kCost, kSpareCore);
  EXPECT_NEAR(plain.compute, 3.25e-3, 1e-12);
  EXPECT_NEAR(plain.wire, 2 * 3 * 260e-6, 1e-12);
}

TEST(PerfModelTest, PackedPipelinedByHand) {
  // 8 rounds: each exchange is 8 * 3 * (10 us + 31.25 us) = 0.99 ms.
  const double exchange = 8 * 3 * (10e-6 + 31.25e-6);
  const Case paper{4, 1'000'000, 8, true, false, 8};
  const Prediction p = PredictPacked(paper, kLink, kCost, kSpareCore);
  // scan 1 ms + shifts 40 us + 7/8 max(3.25 ms, 1.98 ms) + (3.25 ms + 1.98 ms) / 8.
  EXPECT_NEAR(p.total, 1e-3 + 40e-6 + 3.25e-3 * 7 / 8 + (3.25e-3 + 2 * exchange) / 8, 1e-12);
  const Case sum{4, 1'000'000, 8, true, true, 8};
  const Prediction s = PredictPacked(sum, kLink, kCost, kSpareCore);
  // Two overlaps: (encode + decode-add 2 ms, all-to-all), (re-encode + decode 1.25 ms, gather).
  EXPECT_NEAR(s.total,
              1e-3 + 40e-6 + (2e-3 * 7 / 8 + (2e-3 + exchange) / 8) +
                  (1.25e-3 * 7 / 8 + (1.25e-3 + exchange) / 8),
              1e-12);
  // One round overlaps nothing.
  const Prediction one = PredictPacked({4, 1'000'000, 8, true, true, 1}, kLink, kCost, kSpareCore);
  EXPECT_NEAR(one.total, one.compute + one.wire, 1e-12);
  // The schedules' order: pipelined paper <= pipelined sum <= sequential.
  const Prediction seq = PredictPacked({4, 1'000'000, 8, true, true, 0}, kLink, kCost, kSpareCore);
  EXPECT_LE(p.total, s.total + 1e-15);  // equal where compute bounds both
  EXPECT_LE(s.total, seq.total);
  // A crowded host cannot overlap: compute (at half a core) plus wire.
  const Prediction crowded = PredictPacked(sum, kLink, kCost, kCrowded);
  EXPECT_NEAR(crowded.total, crowded.compute + crowded.wire, 1e-12);
  EXPECT_NEAR(crowded.compute, 2 * 4.25e-3, 1e-12);
}

TEST(PerfModelTest, PipelineRoundsFollowTheAlgorithm) {
  // 64 MiB of float32 over 4 ranks in e4m3: 4 MiB of codes per chunk, 256 KiB a round.
  EXPECT_EQ(PipelineRounds(std::size_t(16) << 20, 4, 8, 256), 16);
  EXPECT_EQ(PipelineRounds(std::size_t(16) << 20, 4, 4, 256), 8);
  EXPECT_EQ(PipelineRounds(10000, 2, 8, 256), 1);
  // At most one round per piece of 2048 elements: 2 pieces of a 4096-element chunk.
  EXPECT_EQ(PipelineRounds(8192, 2, 8, 1), 2);
  EXPECT_EQ(PipelineRounds(std::size_t(16) << 20, 4, 8, 0), 0);  // sequential
  EXPECT_EQ(PipelineRounds(std::size_t(16) << 20, 1, 8, 256), 0);
}

TEST(PerfModelTest, MemoryBoundCostAndStepSpeedup) {
  const CodecCost c = MemoryBoundCost(8, 1e9);
  EXPECT_DOUBLE_EQ(c.scan, 4e-9);
  EXPECT_DOUBLE_EQ(c.encode, 5e-9);
  EXPECT_DOUBLE_EQ(c.decode_add, 9e-9);
  EXPECT_DOUBLE_EQ(c.decode, 5e-9);
  EXPECT_DOUBLE_EQ(c.add, 12e-9);
  EXPECT_DOUBLE_EQ(MemoryBoundCost(4, 1e9).encode, 4.5e-9);
  // 100 ms of compute, all-reduce 50 ms -> 10 ms: 150 / 110.
  EXPECT_DOUBLE_EQ(StepSpeedup(0.1, 0.05, 0.01), 0.15 / 0.11);
}

TEST(PerfModelTest, MeasuredCodecCostIsPositiveAndFinite) {
  for (const char* f : {"e4m3", "e3m0", "bf16"}) {
    auto cost = MeasureCodecCost(f, 1 << 16, 3);
    ASSERT_TRUE(cost.ok()) << f << ": " << cost.status().ToString();
    for (double v : {cost->scan, cost->encode, cost->decode_add, cost->decode, cost->add}) {
      EXPECT_TRUE(std::isfinite(v) && v > 0.0) << f << " " << v;
    }
  }
}

TEST(PerfModelTest, MeasureCodecCostRefusesFormatsWithoutPackedCodes) {
  for (const char* f : {"int8", "fp134", "mxfp8", "fp32"}) {
    auto cost = MeasureCodecCost(f, 1024, 1);
    ASSERT_FALSE(cost.ok()) << f;
    EXPECT_NE(cost.status().message().find("fixed float grid"), std::string::npos)
        << cost.status().ToString();
  }
  EXPECT_FALSE(MeasureCodecCost("e4m3", 0, 1).ok());
  EXPECT_FALSE(MeasureCodecCost("e9m9", 1024, 1).ok());  // does not parse
}

}  // namespace
}  // namespace cpd::comm::perf
