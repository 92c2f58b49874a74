// Training on the GPU against training on the CPU (runtime/train/trainer.h, --device cuda vs cpu):
// 100 steps of LeNet-5 and of ResNet-8 on the synthetic task from the same seed, in fp32 and
// with quantisation (a CPT-like configuration; FP134 errors), and 60 steps of a GPT and an LSTM
// language model on a text corpus, compared step by step; GPU runs
// repeat bit for bit; a checkpointed GPU run resumes bit-identically (hysteresis state
// included); emulated data-parallel workers match the CPU, and keeping their gradients on the
// GPU for the all-reduce gives the bits of staging them through the host. Skips without a CUDA
// device.
//
// Tolerances: the two devices sum in different orders (cuBLAS/cuDNN vs OpenBLAS/im2col, batch
// statistics in double vs float lanes), so their losses differ at float32 rounding at step 0 and
// drift apart slowly as training amplifies the differences. In fp32: |loss_gpu - loss_cpu| <=
// 1e-5 (1 + |loss|) at step 0 and <= 2e-3 (1 + |loss|) at every step. With low-bit quantisation a
// last-bit difference can move a value across a rounding boundary (a whole grid step at 3 bits),
// so the quantised curves get 2e-3 at step 0, 5e-2 at any step and 1e-2 on average. Both curves
// must also fall (so that agreement is not agreement of two broken runs).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "runtime/train/trainer.h"
#include "tests/cuda_test_util.h"
#include "tests/temp_dir.h"

namespace cpd::runtime::test {
namespace {

namespace fs = std::filesystem;
using cpd::test::TempDir;

TrainOptions Options(const std::string& arch, DeviceChoice device = DeviceChoice::kAuto) {
  TrainOptions o;
  o.dataset = "synthetic";
  o.arch = arch;
  o.epochs = 1;
  o.max_steps = 100;
  o.batch_size = arch == "lenet5" ? 32 : 16;
  o.lr = 0.05;
  o.quiet = true;
  o.progress = cpd::ProgressMode::kOff;
  o.eval_each_epoch = false;
  o.stats_every = 0;
  o.threads = 0;
  o.device = device;
  return o;
}

TrainResult MustTrain(const TrainOptions& o) {
  auto r = Train(o);
  EXPECT_TRUE(r.ok()) << DeviceChoiceName(o.device) << " " << o.arch << ": "
                      << r.status().message();
  return r.ok() ? *r : TrainResult{};
}

double Mean(const std::vector<double>& v, size_t begin, size_t end) {
  return std::accumulate(v.begin() + long(begin), v.begin() + long(end), 0.0) / double(end - begin);
}

struct CurveTols {
  double first;  // step 0, relative to (1 + |loss|)
  double any;    // every step, relative to (1 + |loss|)
  double mean;   // mean absolute difference over the run
};

void ExpectSameCurve(const std::string& tag, const TrainOptions& base, CurveTols tol) {
  TrainOptions oc = base, og = base;
  oc.device = DeviceChoice::kCpu;
  og.device = DeviceChoice::kCuda;
  const TrainResult rc = MustTrain(oc), rg = MustTrain(og);
  ASSERT_EQ(rc.step_losses.size(), size_t(base.max_steps)) << tag;
  ASSERT_EQ(rg.step_losses.size(), rc.step_losses.size()) << tag;
  const std::vector<double>& a = rc.step_losses;
  const std::vector<double>& b = rg.step_losses;
  double worst = 0, sum = 0;
  size_t worst_at = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(std::isfinite(b[i])) << tag << ": GPU loss at step " << i << " is " << b[i];
    const double d = std::fabs(a[i] - b[i]);
    sum += d;
    if (d / (1 + std::fabs(a[i])) > worst) {
      worst = d / (1 + std::fabs(a[i]));
      worst_at = i;
    }
  }
  EXPECT_LE(std::fabs(a[0] - b[0]), tol.first * (1 + std::fabs(a[0])))
      << tag << ": step 0 loss cpu " << a[0] << " gpu " << b[0];
  EXPECT_LE(worst, tol.any) << tag << ": largest difference at step " << worst_at << ": cpu "
                            << a[worst_at] << " gpu " << b[worst_at];
  EXPECT_LE(sum / double(a.size()), tol.mean) << tag << ": mean |loss_gpu - loss_cpu|";
  // Both learn: the last 20 steps' mean loss is below the first 20 steps'.
  EXPECT_LT(Mean(a, a.size() - 20, a.size()), Mean(a, 0, 20)) << tag << " (cpu)";
  EXPECT_LT(Mean(b, b.size() - 20, b.size()), Mean(b, 0, 20)) << tag << " (gpu)";
}

constexpr CurveTols kFp32{1e-5, 2e-3, 2e-3};
constexpr CurveTols kQuantised{2e-3, 5e-2, 1e-2};

void UseCpt(TrainOptions* o) {  // the cpt preset of cpd-train
  CyclicPrecision c;
  c.min_bits = 3;
  c.max_bits = 8;
  c.periods = 32;
  c.total_iters = 1;  // set by the trainer
  o->precision.cpt = c;
  o->precision.grad_bits = 8;
  o->precision.keep_fp32 = {"last"};
}

void UseFp134Errors(TrainOptions* o) { o->precision.global[int(Site::kError)].spec = "fp134"; }

TEST(CudaTraining, LeNet5Fp32LossCurveMatchesCpu) {
  CPD_REQUIRE_CUDA();
  ExpectSameCurve("lenet5 fp32", Options("lenet5"), kFp32);
}

TEST(CudaTraining, ResNet8Fp32LossCurveMatchesCpu) {
  CPD_REQUIRE_CUDA();
  ExpectSameCurve("resnet8 fp32", Options("resnet8"), kFp32);
}

// AdamW with warm-up and clipping on the GPU: its kernels give the CPU's bits for the same
// gradients, so the curves differ only as the fp32 forward and backward do.
TEST(CudaTraining, AdamWWithClippingLossCurveMatchesCpu) {
  CPD_REQUIRE_CUDA();
  TrainOptions o = Options("lenet5");
  o.optimizer = OptimizerKind::kAdamW;
  o.lr = 0.002;
  o.weight_decay = 0.1;
  o.warmup_steps = 10;
  o.clip_grad_norm = 1;
  ExpectSameCurve("lenet5 adamw clipped", o, kFp32);
}

TEST(CudaTraining, LeNet5CptLossCurveMatchesCpu) {
  CPD_REQUIRE_CUDA();
  TrainOptions o = Options("lenet5");
  UseCpt(&o);
  ExpectSameCurve("lenet5 cpt", o, kQuantised);
}

TEST(CudaTraining, ResNet8CptLossCurveMatchesCpu) {
  CPD_REQUIRE_CUDA();
  TrainOptions o = Options("resnet8");
  UseCpt(&o);
  ExpectSameCurve("resnet8 cpt", o, kQuantised);
}

TEST(CudaTraining, LeNet5Fp134ErrorsLossCurveMatchesCpu) {
  CPD_REQUIRE_CUDA();
  TrainOptions o = Options("lenet5");
  UseFp134Errors(&o);
  ExpectSameCurve("lenet5 fp134 E", o, kQuantised);
}

TEST(CudaTraining, ResNet8Fp134ErrorsLossCurveMatchesCpu) {
  CPD_REQUIRE_CUDA();
  TrainOptions o = Options("resnet8");
  UseFp134Errors(&o);
  ExpectSameCurve("resnet8 fp134 E", o, kQuantised);
}

TEST(CudaTraining, GpuRunsRepeatBitForBit) {
  CPD_REQUIRE_CUDA();
  // Deterministic cuDNN algorithms, no atomics in the reductions: the same run twice gives the
  // same bits, stochastic rounding and hysteresis included.
  for (const char* arch : {"lenet5", "resnet8"}) {
    TrainOptions o = Options(arch, DeviceChoice::kCuda);
    o.max_steps = 30;
    o.precision.global[int(Site::kError)].spec = "e5m2";
    o.precision.global[int(Site::kError)].rounding = Rounding::kStochastic;
    o.precision.global[int(Site::kWeight)].spec = "log4";
    o.precision.hysteresis = true;
    const TrainResult a = MustTrain(o), b = MustTrain(o);
    EXPECT_EQ(a.step_losses, b.step_losses) << arch;
    EXPECT_EQ(a.param_hash, b.param_hash) << arch;
  }
}

// The language models (issue 28): a small GPT and a two-layer LSTM on a byte-level text corpus,
// 60 steps from the same seed on each device, with dropout; fp32 curves as the image models',
// and a GPU run repeats bit for bit (the embedding gradient, LayerNorm and the softmax sum
// without atomics).
class CudaLanguageModels : public ::testing::Test {
 protected:
  void SetUp() override {
    std::ofstream out(dir_.File("corpus.txt"));
    const char* words[] = {"the ", "cat ", "sat ", "on ", "a ", "mat. ", "dogs ", "run\n"};
    uint64_t x = 7;
    for (int i = 0; i < 6000; ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      out << words[(x >> 33) % 8];
    }
  }
  TrainOptions LmOptions(const std::string& arch, DeviceChoice device = DeviceChoice::kAuto) {
    TrainOptions o = Options(arch, device);
    o.dataset = "text";
    o.data_dir = dir_.File("corpus.txt");
    o.lm.n_layer = 2;
    o.lm.n_head = 2;
    o.lm.n_embd = 16;
    o.lm.block_size = 16;
    o.lm.dropout = 0.1;
    o.batch_size = 16;
    o.lr = 0.1;
    o.max_steps = 60;  // of 82 per epoch
    return o;
  }
  TempDir dir_;
};

TEST_F(CudaLanguageModels, LossCurvesMatchTheCpuAndRepeat) {
  CPD_REQUIRE_CUDA();
  for (const char* arch : {"gpt", "lstm"}) {
    ExpectSameCurve(std::string(arch) + " fp32", LmOptions(arch), kFp32);
    TrainOptions o = LmOptions(arch, DeviceChoice::kCuda);
    o.max_steps = 20;
    const TrainResult a = MustTrain(o), b = MustTrain(o);
    EXPECT_EQ(a.step_losses, b.step_losses) << arch;
    EXPECT_EQ(a.param_hash, b.param_hash) << arch;
  }
}

TEST(CudaTraining, CheckpointedRunResumesBitIdentically) {
  CPD_REQUIRE_CUDA();
  // Parameters, BatchNorm buffers, momentum and hysteresis state go to the host and back.
  TrainOptions o = Options("resnet8", DeviceChoice::kCuda);
  o.precision.global[int(Site::kWeight)].spec = "log4";
  o.precision.global[int(Site::kActivation)].spec = "fp134";
  o.precision.hysteresis = true;
  TempDir straight_dir, resumed_dir;
  o.max_steps = 24;
  o.checkpoint_dir = straight_dir.path();
  o.checkpoint_every = 12;
  const TrainResult straight = MustTrain(o);
  o.checkpoint_dir = resumed_dir.path();
  o.max_steps = 12;
  const TrainResult part1 = MustTrain(o);
  o.max_steps = 24;
  o.resume = "auto";
  const TrainResult part2 = MustTrain(o);
  ASSERT_EQ(part2.steps, 24);
  EXPECT_EQ(part2.param_hash, straight.param_hash);
  ASSERT_EQ(part2.step_losses.size(), 12u);
  for (size_t i = 0; i < 12; ++i) {
    EXPECT_EQ(part2.step_losses[i], straight.step_losses[12 + i]) << "step " << 12 + i;
  }
  EXPECT_EQ(part1.step_losses,
            std::vector<double>(straight.step_losses.begin(), straight.step_losses.begin() + 12));
}

// AdamW's moments (on the device) and step count (on the host) go to the checkpoint and back.
TEST(CudaTraining, AdamWResumesBitIdentically) {
  CPD_REQUIRE_CUDA();
  TrainOptions o = Options("resnet8", DeviceChoice::kCuda);
  o.optimizer = OptimizerKind::kAdamW;
  o.lr = 0.002;
  o.clip_grad_norm = 0.5;
  TempDir straight_dir, resumed_dir;
  o.max_steps = 16;
  o.checkpoint_dir = straight_dir.path();
  o.checkpoint_every = 8;
  const TrainResult straight = MustTrain(o);
  o.checkpoint_dir = resumed_dir.path();
  o.max_steps = 8;
  MustTrain(o);
  o.max_steps = 16;
  o.resume = "auto";
  const TrainResult part2 = MustTrain(o);
  ASSERT_EQ(part2.steps, 16);
  EXPECT_EQ(part2.param_hash, straight.param_hash);
  ASSERT_EQ(part2.step_losses.size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(part2.step_losses[i], straight.step_losses[8 + i]) << "step " << 8 + i;
  }
}

TEST(CudaTraining, CpuCheckpointContinuesOnTheGpu) {
  CPD_REQUIRE_CUDA();
  // A checkpoint is device-independent: written by a CPU run, resumed on the GPU.
  TrainOptions o = Options("lenet5", DeviceChoice::kCpu);
  TempDir dir;
  o.checkpoint_dir = dir.path();
  o.max_steps = 10;
  ASSERT_TRUE(Train(o).ok());
  o.device = DeviceChoice::kCuda;
  o.max_steps = 20;
  o.resume = "auto";
  const TrainResult r = MustTrain(o);
  EXPECT_EQ(r.steps, 20);
  ASSERT_EQ(r.step_losses.size(), 10u);
  for (double l : r.step_losses) EXPECT_TRUE(std::isfinite(l));
}

TEST(CudaTraining, EmulatedWorkersMatchTheCpu) {
  CPD_REQUIRE_CUDA();
  // Two logical workers: their gradients summed by the all-reduce (on the GPU), BatchNorm
  // statistics averaged through the host.
  TrainOptions o = Options("resnet8");
  o.emulate_ranks = 2;
  o.global_batch = 32;
  o.max_steps = 60;
  ExpectSameCurve("resnet8 2 workers", o, kFp32);
  o.allreduce.algo = comm::AllReduceAlgo::kEmulate;
  o.allreduce.format = "e4m3";
  o.allreduce.aps = true;
  ExpectSameCurve("resnet8 2 workers e4m3+APS", o, kQuantised);
}

TEST(CudaTraining, GradientsOnTheGpuGiveTheBitsOfStagingThemThroughTheHost) {
  CPD_REQUIRE_CUDA();
  // The all-reducer on device memory (one worker: backward's own buffer is its input and
  // output; two: a device copy each) against the same run staging every gradient through the
  // host: the same losses and parameters, bit for bit, and the same skipped step for a NaN.
  struct Setting {
    comm::AllReduceAlgo algo;
    const char* format;
    bool aps, kahan;
    Rounding rounding;
  };
  for (const Setting& st :
       {Setting{comm::AllReduceAlgo::kFp32, "e4m3", false, false, Rounding::kNearest},
        Setting{comm::AllReduceAlgo::kPacked, "e4m3", true, false, Rounding::kStochastic},
        Setting{comm::AllReduceAlgo::kEmulate, "e3m0", true, true, Rounding::kNearest}}) {
    for (int k : {1, 2}) {
      TrainOptions o = Options("resnet8", DeviceChoice::kCuda);
      o.emulate_ranks = k;
      o.global_batch = 32;
      o.max_steps = 20;
      o.debug_nan_step = 7;
      o.allreduce.algo = st.algo;
      o.allreduce.format = st.format;
      o.allreduce.aps = st.aps;
      o.allreduce.kahan = st.kahan;
      o.allreduce.rounding = st.rounding;
      TrainOptions staged = o;
      staged.device_gradients = false;
      const TrainResult on_gpu = MustTrain(o), via_host = MustTrain(staged);
      const std::string tag = std::string(comm::AllReduceAlgoName(st.algo)) + " " + st.format +
                              " K=" + std::to_string(k);
      EXPECT_EQ(on_gpu.step_losses, via_host.step_losses) << tag;
      EXPECT_EQ(on_gpu.param_hash, via_host.param_hash) << tag;
      EXPECT_EQ(on_gpu.skipped_steps, 1) << tag;
      EXPECT_EQ(via_host.skipped_steps, 1) << tag;
    }
  }
}

TEST(CudaTraining, EvaluationRunsOnTheGpu) {
  CPD_REQUIRE_CUDA();
  TrainOptions o = Options("lenet5");
  o.max_steps = 50;
  o.eval_each_epoch = true;
  TrainOptions oc = o, og = o;
  oc.device = DeviceChoice::kCpu;
  og.device = DeviceChoice::kCuda;
  const TrainResult rc = MustTrain(oc), rg = MustTrain(og);
  // 2048 test images: a few predictions may flip between devices near a tie.
  EXPECT_NEAR(rg.test_accuracy, rc.test_accuracy, 0.01);
  EXPECT_GT(rg.test_accuracy, 0.2);  // chance is 0.1
}

// --fast-conv-algos (issue 25, item 1.4): the run trains, repeats bit for bit (the fast policy
// still takes deterministic algorithms only) and says so in its "run" record; a default run
// after it in the same process is back on the exact algorithms, the CPU's curve.
TEST(CudaTraining, FastConvAlgosTrainRepeatAndAreRecorded) {
  CPD_REQUIRE_CUDA();
  TempDir dir;
  TrainOptions o = Options("lenet5", DeviceChoice::kCuda);
  o.fast_conv_algos = true;
  o.metrics_out = dir.File("fast.jsonl");
  const TrainResult a = MustTrain(o);
  o.metrics_out.clear();
  const TrainResult b = MustTrain(o);
  ASSERT_EQ(a.step_losses.size(), size_t(o.max_steps));
  EXPECT_EQ(a.param_hash, b.param_hash);
  EXPECT_LT(Mean(a.step_losses, a.step_losses.size() - 20, a.step_losses.size()),
            Mean(a.step_losses, 0, 20));
  std::ifstream in(dir.File("fast.jsonl"));
  std::string first;
  std::getline(in, first);
  EXPECT_NE(first.find("\"conv_algos\":\"fast\""), std::string::npos) << first;
  ExpectSameCurve("lenet5 fp32 after a fast run", Options("lenet5"), kFp32);
}

}  // namespace
}  // namespace cpd::runtime::test
