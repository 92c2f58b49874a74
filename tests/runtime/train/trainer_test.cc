// The trainer end to end on small real runs: bit-identical resume, checkpoint integrity,
// statistics and metrics, the precision presets, and ResNet training.
#include "runtime/train/trainer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "runtime/train/checkpoint.h"
#include "tests/temp_dir.h"

namespace cpd::runtime {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

TrainOptions SmallRun() {
  TrainOptions o;
  o.dataset = "synthetic";
  o.arch = "mlp";
  o.epochs = 2;
  o.batch_size = 64;
  o.lr = 0.05;
  o.quiet = true;
  o.progress = false;
  o.eval_each_epoch = false;
  o.stats_every = 0;
  o.threads = 2;
  o.device = DeviceChoice::kCpu;  // the CPU path on every machine (tests/cuda cover --device cuda)
  return o;
}

// Every float of every tensor of two checkpoints, bit for bit.
void ExpectSameTensors(const std::string& a, const std::string& b) {
  auto ca = ReadCheckpoint(a);
  auto cb = ReadCheckpoint(b);
  ASSERT_TRUE(ca.ok()) << ca.status().message();
  ASSERT_TRUE(cb.ok()) << cb.status().message();
  ASSERT_EQ(ca->order, cb->order);
  for (const auto& name : ca->order) {
    const auto& va = ca->data.at(name);
    const auto& vb = cb->data.at(name);
    ASSERT_EQ(va.size(), vb.size()) << name;
    EXPECT_EQ(0, std::memcmp(va.data(), vb.data(), va.size() * sizeof(float))) << name;
  }
}

void ExpectBitIdenticalResume(TrainOptions o, int64_t first, int64_t total) {
  TempDir straight_dir, resumed_dir;
  o.checkpoint_dir = straight_dir.path();
  o.checkpoint_every = first;
  o.max_steps = total;
  auto straight = Train(o);
  ASSERT_TRUE(straight.ok()) << straight.status().message();
  ASSERT_EQ(straight->steps, total);

  o.checkpoint_dir = resumed_dir.path();
  o.max_steps = first;
  auto part1 = Train(o);
  ASSERT_TRUE(part1.ok()) << part1.status().message();
  o.max_steps = total;
  o.resume = "auto";
  auto part2 = Train(o);
  ASSERT_TRUE(part2.ok()) << part2.status().message();
  ASSERT_EQ(part2->steps, total);

  // The losses of the resumed steps equal the uninterrupted run's, bit for bit.
  ASSERT_EQ(part2->step_losses.size(), size_t(total - first));
  for (int64_t i = 0; i < total - first; ++i) {
    EXPECT_EQ(straight->step_losses[size_t(first + i)], part2->step_losses[size_t(i)])
        << "step " << first + i;
  }
  ExpectSameTensors(CheckpointPath(straight_dir.path(), total),
                    CheckpointPath(resumed_dir.path(), total));
}

TEST(TrainerResume, Fp32MidEpochIsBitIdentical) {
  // 8192 / 64 = 128 steps per epoch: resume at 50, run to 180 (across the epoch boundary).
  ExpectBitIdenticalResume(SmallRun(), 50, 180);
}

TEST(TrainerResume, CptWithStochasticErrorsIsBitIdentical) {
  TrainOptions o = SmallRun();
  CyclicPrecision c;
  c.min_bits = 3;
  c.max_bits = 8;
  c.periods = 4;
  c.total_iters = 1;
  o.precision.cpt = c;
  o.precision.grad_bits = 8;
  o.precision.keep_fp32 = {"last"};
  ExpectBitIdenticalResume(o, 40, 100);
}

TEST(TrainerResume, HysteresisLog4IsBitIdentical) {
  TrainOptions o = SmallRun();
  o.arch = "lenet5";
  o.precision.global[int(Site::kWeight)].spec = "log4";
  o.precision.global[int(Site::kError)].spec = "fp134";
  o.precision.global[int(Site::kError)].rounding = Rounding::kStochastic;
  o.precision.hysteresis = true;
  o.precision.keep_fp32 = {"first", "last"};
  ExpectBitIdenticalResume(o, 30, 70);
}

TEST(TrainerResume, ResNet20IsBitIdentical) {
  // Every ResNet-20 convolution shape through the CPU path this machine picks (oneDNN on
  // CPUs without AVX-512 in builds with it), with BatchNorm.
  TrainOptions o = SmallRun();
  o.arch = "resnet20";
  o.batch_size = 16;
  ExpectBitIdenticalResume(o, 4, 10);
}

TEST(TrainerCheckpoint, CorruptCheckpointIsRefused) {
  TempDir dir;
  TrainOptions o = SmallRun();
  o.checkpoint_dir = dir.path();
  o.checkpoint_every = 10;
  o.max_steps = 10;
  ASSERT_TRUE(Train(o).ok());
  const std::string path = CheckpointPath(dir.path(), 10);
  ASSERT_TRUE(ReadCheckpoint(path).ok());
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(200);
    char c;
    f.read(&c, 1);
    c ^= 0x40;
    f.seekp(200);
    f.write(&c, 1);
  }
  auto bad = ReadCheckpoint(path);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("corrupt"), std::string::npos) << bad.status().message();
  o.resume = path;
  o.max_steps = 20;
  auto r = Train(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(path), std::string::npos);
}

TEST(TrainerCheckpoint, TruncatedCheckpointIsRefused) {
  TempDir dir;
  TrainOptions o = SmallRun();
  o.checkpoint_dir = dir.path();
  o.checkpoint_every = 5;
  o.max_steps = 5;
  ASSERT_TRUE(Train(o).ok());
  const std::string path = CheckpointPath(dir.path(), 5);
  fs::resize_file(path, fs::file_size(path) / 2);
  EXPECT_FALSE(ReadCheckpoint(path).ok());
}

TEST(TrainerCheckpoint, MismatchedRunIsRefused) {
  TempDir dir;
  TrainOptions o = SmallRun();
  o.checkpoint_dir = dir.path();
  o.checkpoint_every = 5;
  o.max_steps = 5;
  ASSERT_TRUE(Train(o).ok());
  o.arch = "lenet5";
  o.resume = "auto";
  auto r = Train(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--arch mlp"), std::string::npos) << r.status().message();
}

TEST(TrainerMetrics, StatsCoverEveryLayerAndSite) {
  TempDir dir;
  TrainOptions o = SmallRun();
  o.arch = "lenet5";
  o.max_steps = 12;
  o.stats_every = 5;
  o.metrics_out = dir.path() + "/m.jsonl";
  o.precision.global[int(Site::kWeight)].spec = "e4m3";
  o.precision.global[int(Site::kActivation)].spec = "e4m3";
  o.precision.global[int(Site::kError)].spec = "e5m2";
  o.precision.global[int(Site::kWeightGrad)].spec = "bf16";
  ASSERT_TRUE(Train(o).ok());
  std::ifstream in(o.metrics_out);
  std::string line;
  int step_lines = 0, epoch_lines = 0;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["type"] == "step") {
      ++step_lines;
      EXPECT_EQ(j["step"].get<int>() % 5, 0);
      std::set<std::string> seen;
      for (const auto& l : j["layers"]) {
        seen.insert(l["layer"].get<std::string>() + "." + l["site"].get<std::string>());
        EXPECT_GE(l["rel_error"].get<double>(), 0.0);
        EXPECT_GE(l["max_abs"].get<double>(), 0.0);
      }
      // 5 quantisable layers x 4 sites.
      EXPECT_EQ(seen.size(), 20u) << line;
      EXPECT_TRUE(seen.count("conv1.W") && seen.count("fc3.G"));
    } else if (j["type"] == "epoch") {
      ++epoch_lines;
      EXPECT_GT(j["test_accuracy"].get<double>(), 0.0);
    }
  }
  EXPECT_EQ(step_lines, 3);  // steps 0, 5, 10
  EXPECT_EQ(epoch_lines, 1);
}

TEST(TrainerCpt, RelativeCostOfThreeToEightBits) {
  TrainOptions o = SmallRun();
  o.max_steps = 4;
  CyclicPrecision c;
  c.min_bits = 3;
  c.max_bits = 8;
  c.periods = 2;
  c.total_iters = 1;
  o.precision.cpt = c;
  auto r = Train(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_LT(r->relative_cost, -0.30);
  EXPECT_GT(r->relative_cost, -0.40);
}

TEST(TrainerModels, ResNet20LossFallsOnSynthetic) {
  TrainOptions o = SmallRun();
  o.arch = "resnet20";
  o.batch_size = 32;
  o.max_steps = 40;
  o.lr = 0.05;
  auto r = Train(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_EQ(r->step_losses.size(), 40u);
  double first = 0, last = 0;
  for (int i = 0; i < 8; ++i) {
    first += r->step_losses[size_t(i)];
    last += r->step_losses[size_t(32 + i)];
  }
  EXPECT_LT(last, 0.8 * first) << "first 8 steps " << first / 8 << ", last 8 " << last / 8;
}

TEST(TrainerOptions, BadValuesNameTheFlag) {
  TrainOptions o = SmallRun();
  o.epochs = 0;
  auto r = Train(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--epochs"), std::string::npos);
  o = SmallRun();
  o.arch = "resnet21";
  r = Train(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("resnet21"), std::string::npos);
  o = SmallRun();
  o.dataset = "imagenet";
  r = Train(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("imagenet"), std::string::npos);
  o = SmallRun();
  o.precision.keep_fp32 = {"conv9"};
  r = Train(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("conv9"), std::string::npos);
}

// ---- Data parallelism in one process (--emulate-ranks) -----------------------------------------

// K logical workers with an fp32 all-reduce compute the mean of K micro-batch gradients: the same
// step as one worker on the whole batch up to rounding (the MLP has no BatchNorm).
TEST(TrainerEmulatedRanks, Fp32SumOfWorkersMatchesOneWorker) {
  TrainOptions one = SmallRun();
  one.max_steps = 30;
  one.global_batch = 64;
  TrainOptions four = one;
  four.emulate_ranks = 4;
  auto a = Train(one);
  auto b = Train(four);
  ASSERT_TRUE(a.ok()) << a.status().message();
  ASSERT_TRUE(b.ok()) << b.status().message();
  EXPECT_EQ(b->workers, 4);
  ASSERT_EQ(a->step_losses.size(), b->step_losses.size());
  for (size_t i = 0; i < a->step_losses.size(); ++i) {
    EXPECT_NEAR(a->step_losses[i], b->step_losses[i], 2e-3 * std::max(1.0, a->step_losses[i]))
        << "step " << i;
  }
}

// A NaN in one worker's gradient skips that step (the parameters stay finite and training goes
// on); the step still counts, so schedules stay aligned.
TEST(TrainerEmulatedRanks, NonFiniteGradientSkipsTheStep) {
  TrainOptions o = SmallRun();
  o.max_steps = 12;
  o.emulate_ranks = 2;
  o.global_batch = 64;
  o.debug_nan_step = 5;
  o.allreduce.algo = comm::AllReduceAlgo::kEmulate;
  o.allreduce.format = "e4m3";
  o.allreduce.aps = true;
  auto r = Train(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->skipped_steps, 1);
  EXPECT_EQ(r->steps, 12);
  for (double l : r->step_losses) EXPECT_TRUE(std::isfinite(l));
}

// CPD's study mode learns: 8 emulated workers summing e4m3 gradients with APS.
TEST(TrainerEmulatedRanks, EmulatedE4m3WithApsLearns) {
  TrainOptions o = SmallRun();
  o.max_steps = 60;
  o.emulate_ranks = 8;
  o.global_batch = 128;
  o.allreduce.algo = comm::AllReduceAlgo::kEmulate;
  o.allreduce.format = "e4m3";
  o.allreduce.aps = true;
  auto r = Train(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  double first = 0, last = 0;
  for (int i = 0; i < 10; ++i) {
    first += r->step_losses[size_t(i)];
    last += r->step_losses[size_t(50 + i)];
  }
  EXPECT_LT(last, 0.6 * first) << "first 10 steps " << first / 10 << ", last 10 " << last / 10;
}

TEST(TrainerEmulatedRanks, GlobalBatchMustSplitEvenly) {
  TrainOptions o = SmallRun();
  o.emulate_ranks = 3;
  o.global_batch = 64;
  auto r = Train(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--global-batch 64"), std::string::npos)
      << r.status().message();
  o.emulate_ranks = 0;
  r = Train(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--emulate-ranks"), std::string::npos);
}

}  // namespace
}  // namespace cpd::runtime
