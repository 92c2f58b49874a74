// The trainer end to end on small real runs: bit-identical resume, checkpoint integrity,
// statistics and metrics, the precision presets, and ResNet training.
#include "runtime/train/trainer.h"

#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "kernels/grid.h"
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
  o.progress = cpd::ProgressMode::kOff;
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
  // The last epoch's training loss and accuracy cover all of its steps, those before the
  // resume included.
  EXPECT_EQ(straight->final_loss, part2->final_loss);
  EXPECT_EQ(straight->train_accuracy, part2->train_accuracy);
}

TEST(TrainerResume, Fp32MidEpochIsBitIdentical) {
  // 8192 / 64 = 128 steps per epoch: resume at 50, run to 180 (across the epoch boundary).
  ExpectBitIdenticalResume(SmallRun(), 50, 180);
}

// Issue 26 item 5: an epoch resumed mid-way reported only the steps after the resume (0.1611 /
// 94.60 % against 0.9601 / 75.11 % uninterrupted). Resume at 50 of 128 and end with the epoch.
TEST(TrainerResume, MidEpochResumeReportsTheWholeEpoch) {
  ExpectBitIdenticalResume(SmallRun(), 50, 128);
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

// Large-batch lr rules and a warm-up in epochs with LARS: still a pure function of the options.
TEST(TrainerResume, LrScalingWarmupEpochsAndLarsAreBitIdentical) {
  TrainOptions o = SmallRun();
  o.optimizer = OptimizerKind::kLars;
  o.lr = 0.5;
  o.lr_scaling = LrScaling::kSqrt;
  o.warmup_epochs = 0.5;
  ExpectBitIdenticalResume(o, 30, 80);
}

// AdamW's m, v and step count, warm-up, clipping (every step of this run clips at 0.5) and
// dynamic loss scaling: the resumed run continues bit for bit.
TEST(TrainerResume, AdamWWithClippingIsBitIdentical) {
  TrainOptions o = SmallRun();
  o.optimizer = OptimizerKind::kAdamW;
  o.lr = 0.002;
  o.weight_decay = 0.1;
  o.beta2 = 0.95;
  o.warmup_steps = 20;
  o.clip_grad_norm = 0.5;
  o.loss_scale.mode = LossScaleOptions::Mode::kDynamic;
  ExpectBitIdenticalResume(o, 30, 80);
}

// A checkpoint of another optimiser is refused in one line naming both.
TEST(TrainerCheckpoint, AnotherOptimizersCheckpointIsRefused) {
  TempDir dir;
  TrainOptions o = SmallRun();
  o.checkpoint_dir = dir.path();
  o.checkpoint_every = 5;
  o.max_steps = 5;
  ASSERT_TRUE(Train(o).ok());
  o.optimizer = OptimizerKind::kAdamW;
  o.resume = "auto";
  o.max_steps = 10;
  auto r = Train(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Status::Code::kInvalidArgument);
  EXPECT_NE(r.status().message().find(
                "was written by a run with --optimizer sgd; this run has --optimizer adamw"),
            std::string::npos)
      << r.status().message();
  EXPECT_EQ(r.status().message().find('\n'), std::string::npos);
}

// With clipping on, a NaN gradient still skips the step before any norm is taken, and the run
// goes on from the next step.
TEST(TrainerDivergence, ClippingKeepsTheSkipOfANonFiniteGradient) {
  TrainOptions o = SmallRun();
  o.optimizer = OptimizerKind::kAdamW;
  o.lr = 0.001;
  o.max_steps = 6;
  o.clip_grad_norm = 1;
  o.debug_nan_step = 2;
  auto r = Train(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->skipped_steps, 1);
  EXPECT_EQ(r->steps, 6);
}

// ---- Learning-rate rules -------------------------------------------------------------------

// Runs `o` for 12 steps and returns the result (which must be OK).
TrainResult RunTwelve(TrainOptions o) {
  o.max_steps = 12;
  auto r = Train(o);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? *r : TrainResult{};
}

// A scaled lr trains exactly like the same lr given directly: global batch 64, base batch 32
// (linear: x2) or 256 (sqrt: x0.5), all exact in binary.
TEST(TrainerLr, ScalingRulesSetTheScheduleBaseLr) {
  TrainOptions plain = SmallRun();
  plain.lr = 0.05;
  const TrainResult want = RunTwelve(plain);
  EXPECT_EQ(want.lr_effective, 0.05);

  TrainOptions linear = SmallRun();
  linear.lr = 0.025;
  linear.lr_scaling = LrScaling::kLinear;
  linear.lr_base_batch = 32;
  TrainOptions sqrt = SmallRun();
  sqrt.lr = 0.1;
  sqrt.lr_scaling = LrScaling::kSqrt;
  for (const TrainOptions& o : {linear, sqrt}) {
    const TrainResult got = RunTwelve(o);
    EXPECT_EQ(got.lr_effective, 0.05) << LrScalingName(o.lr_scaling);
    EXPECT_EQ(got.step_losses, want.step_losses) << LrScalingName(o.lr_scaling);
    EXPECT_EQ(got.param_hash, want.param_hash) << LrScalingName(o.lr_scaling);
  }
}

// The global batch of the rule is the real one: per-worker batch x workers without
// --global-batch.
TEST(TrainerLr, ScalingUsesTheGlobalBatchOfAllWorkers) {
  TrainOptions o = SmallRun();
  o.batch_size = 32;
  o.emulate_ranks = 4;  // 128 in all
  o.lr = 0.01;
  o.lr_scaling = LrScaling::kLinear;
  o.lr_base_batch = 32;
  EXPECT_EQ(RunTwelve(o).lr_effective, 0.04);
}

// 0.5 epochs of 128 steps = 64 steps, the same schedule as --warmup-steps 64.
TEST(TrainerLr, WarmupEpochsAreStepsPerEpochTimesEpochs) {
  TrainOptions steps = SmallRun();
  steps.warmup_steps = 64;
  TrainOptions epochs = SmallRun();
  epochs.warmup_epochs = 0.5;
  const TrainResult a = RunTwelve(steps), b = RunTwelve(epochs);
  EXPECT_EQ(b.warmup_steps, 64);
  EXPECT_EQ(a.step_losses, b.step_losses);
  EXPECT_EQ(a.param_hash, b.param_hash);
}

TEST(TrainerLr, BadWarmupAndScalingOptionsNameTheFlags) {
  auto refused = [](TrainOptions o, const std::string& part) {
    auto r = Train(o);
    ASSERT_FALSE(r.ok()) << part;
    EXPECT_NE(r.status().message().find(part), std::string::npos) << r.status().message();
  };
  TrainOptions o = SmallRun();
  o.warmup_steps = 10;
  o.warmup_epochs = 1;
  refused(o, "--warmup-steps and --warmup-epochs exclude each other");
  o = SmallRun();
  o.warmup_epochs = 3;  // 2 epochs in the run
  refused(o, "--warmup-epochs 3 (384 steps) is longer than the run (2 epochs = 256 steps)");
  o = SmallRun();
  o.warmup_epochs = std::numeric_limits<double>::quiet_NaN();
  refused(o, "--warmup-epochs must be a number >= 0, got nan");
  o = SmallRun();
  o.lr_base_batch = 0;
  refused(o, "--lr-base-batch must be >= 1");
  o = SmallRun();
  o.optimizer = OptimizerKind::kLars;
  o.lars_excluded_lr_ratio = 0;
  refused(o, "--lars-excluded-lr-ratio");
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

// Rewrites a checkpoint with `edit` applied to its header and `values_edit` to its tensors, and
// a valid CRC: what a writer with a bug (or a hand) could leave behind.
void RewriteCheckpoint(
    const std::string& path, const std::function<void(nlohmann::json*)>& edit,
    const std::function<void(std::string*, size_t payload_start)>& payload_edit = nullptr) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 20u);
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data() + 8, 8);
  nlohmann::json header = nlohmann::json::parse(bytes.substr(16, header_len));
  std::string payload = bytes.substr(16 + header_len, bytes.size() - 4 - 16 - header_len);
  edit(&header);
  if (payload_edit) payload_edit(&payload, 0);
  const std::string text = header.dump();
  std::string out = bytes.substr(0, 8);
  const uint64_t n = text.size();
  out.append(reinterpret_cast<const char*>(&n), 8);
  out += text;
  out += payload;
  const uint32_t crc =
      uint32_t(crc32(0L, reinterpret_cast<const Bytef*>(out.data()), uInt(out.size())));
  out.append(reinterpret_cast<const char*>(&crc), 4);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << out;
}

// A 10-step checkpoint of SmallRun in `dir`; returns its path.
std::string TenStepCheckpoint(const TempDir& dir) {
  TrainOptions o = SmallRun();
  o.checkpoint_dir = dir.path();
  o.checkpoint_every = 10;
  o.max_steps = 10;
  EXPECT_TRUE(Train(o).ok());
  return CheckpointPath(dir.path(), 10);
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Resuming from `path` fails with the one "checkpoint FILE is corrupt: ...; refusing it" line,
// mentioning `why`.
void ExpectRefusedAsCorrupt(const std::string& path, const std::string& why) {
  TrainOptions o = SmallRun();
  o.resume = path;
  o.max_steps = 20;
  auto r = Train(o);
  ASSERT_FALSE(r.ok()) << why;
  const std::string& m = r.status().message();
  EXPECT_EQ(r.status().code(), Status::Code::kCorruption) << m;
  EXPECT_EQ(m.rfind("checkpoint " + path + " is corrupt: ", 0), 0u) << m;
  EXPECT_NE(m.find("; refusing it"), std::string::npos) << m;
  EXPECT_NE(m.find(why), std::string::npos) << m;
  EXPECT_EQ(m.find("json.exception"), std::string::npos) << m;
}

// Wrongly typed fields under a valid CRC are refused by name, not thrown as json::type_error.
TEST(TrainerCheckpoint, WronglyTypedFieldsAreRefusedAsCorrupt) {
  TempDir dir;
  const std::string path = TenStepCheckpoint(dir);
  const std::string good = ReadBytes(path);
  RewriteCheckpoint(path, [](nlohmann::json* h) { (*h)["tensors"][0]["count"] = {1, 2}; });
  const Result<Checkpoint> read = ReadCheckpoint(path);
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.status().code(), Status::Code::kCorruption);
  ExpectRefusedAsCorrupt(path, "'count'");
  for (const auto& [edit, why] :
       std::vector<std::pair<std::function<void(nlohmann::json*)>, std::string>>{
           {[](nlohmann::json* h) { (*h)["meta"]["iterator"] = "soon"; }, "meta.iterator"},
           {[](nlohmann::json* h) { (*h)["meta"]["step"] = "ten"; }, "meta.step"},
           {[](nlohmann::json* h) { (*h)["meta"]["arch"] = 5; }, "meta.arch"},
           {[](nlohmann::json* h) { (*h)["tensors"][1]["shape"] = "wide"; }, "'shape'"},
           {[](nlohmann::json* h) { (*h)["tensors"][0]["name"] = nullptr; }, "'name'"},
           {[](nlohmann::json* h) { (*h)["tensors"] = 3; }, "'tensors'"},
           {[](nlohmann::json* h) {
              (*h)["meta"] = {1, 2};
            },
            "'meta'"}}) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << good;
    RewriteCheckpoint(path, edit);
    ExpectRefusedAsCorrupt(path, why);
  }
}

// A valid CRC is not trusted: every field is checked against the model and the run.
TEST(TrainerCheckpoint, FieldsOutOfRangeOrNonFiniteAreRefused) {
  TempDir dir;
  const std::string path = TenStepCheckpoint(dir);
  const std::string good = ReadBytes(path);
  auto restore = [&] { std::ofstream(path, std::ios::binary | std::ios::trunc) << good; };
  RewriteCheckpoint(path, [](nlohmann::json* h) { (*h)["meta"]["step"] = -5; });
  ExpectRefusedAsCorrupt(path, "meta.step -5");
  restore();
  RewriteCheckpoint(path, [](nlohmann::json* h) { (*h)["meta"]["step"] = 900; });
  ExpectRefusedAsCorrupt(path, "meta.step 900");
  restore();
  RewriteCheckpoint(path, [](nlohmann::json* h) { (*h)["meta"]["iterator"]["next_batch"] = 4000; });
  ExpectRefusedAsCorrupt(path, "next_batch");
  restore();
  // A NaN in the first parameter (every step would be skipped).
  RewriteCheckpoint(
      path, [](nlohmann::json*) {},
      [](std::string* payload, size_t) {
        const float nan = std::numeric_limits<float>::quiet_NaN();
        std::memcpy(payload->data() + 8, &nan, 4);
      });
  ExpectRefusedAsCorrupt(path, "non-finite");
  restore();
  // A tensor of the right size and another shape.
  RewriteCheckpoint(path, [](nlohmann::json* h) {
    auto& shape = (*h)["tensors"][0]["shape"];
    const uint64_t a = shape[0], b = shape[1];
    shape = {b, a};
  });
  ExpectRefusedAsCorrupt(path, "has shape");
  restore();
  RewriteCheckpoint(path, [](nlohmann::json* h) { (*h)["meta"]["version"] = 7; });
  ExpectRefusedAsCorrupt(path, "version 7");
  restore();
  RewriteCheckpoint(path, [](nlohmann::json* h) { (*h)["meta"]["random_stream"] = "two"; });
  ExpectRefusedAsCorrupt(path, "random_stream");
}

// A checkpoint records the random stream it was drawn with. One from before versions were
// recorded (stream 1) still resumes, with a note that the bits after it differ.
TEST(TrainerCheckpoint, RecordsTheRandomStreamAndNotesAnOlderOne) {
  TempDir dir;
  const std::string path = TenStepCheckpoint(dir);
  nlohmann::json recorded;
  RewriteCheckpoint(path, [&](nlohmann::json* h) {
    recorded = (*h)["meta"]["random_stream"];
    (*h)["meta"].erase("random_stream");
  });
  EXPECT_EQ(recorded, kernels::kRandomStreamVersion);
  TrainOptions o = SmallRun();
  o.checkpoint_dir = dir.path();
  o.resume = path;
  o.max_steps = 12;
  ::testing::internal::CaptureStderr();
  const auto r = Train(o);
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_NE(err.find("written with random stream version 1; this build draws version 2"),
            std::string::npos)
      << err;
}

// "epoch": 1000000 used to end the run at once with exit 0 and overwrite the checkpoint it came
// from with other metadata. Now it is refused, and that file is left as it was.
TEST(TrainerCheckpoint, AnEpochBeyondTheRunIsRefusedAndNothingIsOverwritten) {
  TempDir dir;
  const std::string path = TenStepCheckpoint(dir);
  RewriteCheckpoint(path, [](nlohmann::json* h) { (*h)["meta"]["epoch"] = 1000000; });
  const std::string before = ReadBytes(path);
  TrainOptions o = SmallRun();
  o.checkpoint_dir = dir.path();
  o.resume = "auto";
  auto r = Train(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("1000000"), std::string::npos) << r.status().message();
  EXPECT_EQ(ReadBytes(path), before) << "the checkpoint was rewritten";
}

// A run that resumes from the end of a finished run has nothing to train and writes nothing.
TEST(TrainerCheckpoint, ResumingAFinishedRunRewritesNothing) {
  TempDir dir;
  TrainOptions o = SmallRun();
  o.epochs = 1;
  o.checkpoint_dir = dir.path();
  ASSERT_TRUE(Train(o).ok());
  const std::string path = LatestCheckpoint(dir.path());
  ASSERT_FALSE(path.empty());
  const std::string before = ReadBytes(path);
  const auto mtime = fs::last_write_time(path);
  o.resume = "auto";
  auto r = Train(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->steps, 128);
  EXPECT_EQ(ReadBytes(path), before);
  EXPECT_EQ(fs::last_write_time(path), mtime);
}

// A checkpoint file of the same name with other contents is never replaced; the same bytes
// again are no error.
TEST(TrainerCheckpoint, ACheckpointOfAnotherRunIsNeverOverwritten) {
  TempDir dir;
  Checkpoint ck;
  ck.meta_json = R"({"step": 10})";
  const float v[3] = {1, 2, 3};
  ck.Put("param/x", {3}, v, 3);
  const std::string path = CheckpointPath(dir.path(), 10);
  ASSERT_TRUE(WriteCheckpoint(path, ck).ok());
  EXPECT_TRUE(WriteCheckpoint(path, ck).ok()) << "the same bytes again";
  const std::string before = ReadBytes(path);
  ck.meta_json = R"({"step": 10, "epoch": 3})";
  const Status s = WriteCheckpoint(path, ck);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("refusing to overwrite"), std::string::npos) << s.message();
  EXPECT_EQ(ReadBytes(path), before);

  // A run whose checkpoint would land on another run's file stops instead of replacing it.
  TrainOptions o = SmallRun();
  o.checkpoint_dir = dir.path();
  o.checkpoint_every = 10;
  o.max_steps = 10;
  auto r = Train(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("refusing to overwrite"), std::string::npos)
      << r.status().message();
  EXPECT_EQ(ReadBytes(path), before);
}

// An unwritable --checkpoint-dir is found at start-up, before any step.
TEST(TrainerCheckpoint, UnwritableDirectoryFailsAtStartUp) {
  TempDir dir;
  const std::string file = dir.File("a-file");
  std::ofstream(file) << "x";
  TrainOptions o = SmallRun();
  o.checkpoint_dir = file + "/checkpoints";  // below a file: nobody, root included, can create it
  o.checkpoint_every = 2;
  o.max_steps = 3;
  o.stats_every = 1;  // every step that runs leaves a "step" record
  o.metrics_out = dir.File("m.jsonl");
  auto r = Train(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--checkpoint-dir"), std::string::npos)
      << r.status().message();
  EXPECT_EQ(ReadBytes(o.metrics_out).find("\"step\""), std::string::npos) << "a step ran";
}

// ---- Runs that cannot recover stop
// ---------------------------------------------------------------

// --lr 1e30: the first step blows the parameters up; the run stops with OutOfRange after writing
// its metrics (it used to skip every later step and end "successfully" with loss NaN).
TEST(TrainerDivergence, NonFiniteLossOrParametersStopTheRun) {
  TempDir dir;
  TrainOptions o = SmallRun();
  o.lr = 1e30;
  o.max_steps = 40;
  o.metrics_out = dir.File("m.jsonl");
  auto r = Train(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Status::Code::kOutOfRange) << r.status().message();
  EXPECT_NE(r.status().message().find("training diverged at step"), std::string::npos)
      << r.status().message();
  const std::string metrics = ReadBytes(o.metrics_out);
  EXPECT_NE(metrics.find("\"type\":\"stop\""), std::string::npos) << metrics;
}

// K consecutive skipped steps stop the run; fewer do not.
TEST(TrainerDivergence, ConsecutiveSkippedStepsStopTheRun) {
  TrainOptions o = SmallRun();
  o.max_steps = 30;
  o.debug_nan_step = 3;
  o.debug_nan_steps = 4;
  o.max_skipped_steps = 5;
  auto r = Train(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->skipped_steps, 4);
  o.debug_nan_steps = 100;
  r = Train(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Status::Code::kOutOfRange);
  EXPECT_NE(r.status().message().find("at step 7: 5 consecutive steps were skipped"),
            std::string::npos)
      << r.status().message();
  o.max_skipped_steps = 0;  // never
  o.max_steps = 20;
  r = Train(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->skipped_steps, 17);
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
      // W e4m3, A e4m3, E e5m2: 8/8, as the default reference.
      EXPECT_EQ(j["cost_reference"], "8/8");
      EXPECT_EQ(j["relative_cost"].get<double>(), 0.0);
      // Nearest-rounded W counts flips too: every quantised layer has an entry.
      EXPECT_EQ(j["flips"].size(), 5u) << line;
      uint64_t flips = 0;
      for (const auto& [layer, f] : j["flips"].items()) flips += f.get<uint64_t>();
      EXPECT_GT(flips, 0u) << line;
    }
  }
  EXPECT_EQ(step_lines, 3);  // steps 0, 5, 10
  EXPECT_EQ(epoch_lines, 1);
}

TEST(TrainerMetrics, Fp32RunCostsAgainstTheReferenceAndHasNoFlips) {
  TempDir dir;
  TrainOptions o = SmallRun();
  o.max_steps = 2;
  o.epochs = 1;
  o.metrics_out = dir.path() + "/m.jsonl";
  o.cost_reference = {4, 4};  // c = 16 + 32 = 48; fp32: 3072 / 48 - 1 = 63
  auto r = Train(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_DOUBLE_EQ(r->relative_cost, 63.0);
  std::ifstream in(o.metrics_out);
  std::string line;
  int epoch_lines = 0;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["type"] != "epoch") continue;
    ++epoch_lines;
    EXPECT_EQ(j["cost_reference"], "4/4");
    EXPECT_DOUBLE_EQ(j["relative_cost"].get<double>(), 63.0);
    EXPECT_TRUE(j["flips"].empty()) << line;
  }
  EXPECT_EQ(epoch_lines, 1);
}

std::vector<nlohmann::json> ReadRecords(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> out;
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

// The "run" record opens the metrics file with what a report needs without any other source,
// and opens each resumed part again at its start step.
TEST(TrainerMetrics, RunRecordComesFirstAndAgainOnResume) {
  TempDir dir;
  TrainOptions o = SmallRun();
  o.metrics_out = dir.File("m.jsonl");
  o.checkpoint_dir = dir.File("ck");
  o.checkpoint_every = 10;
  o.max_steps = 10;
  o.stats_every = 4;
  o.emulate_ranks = 2;
  o.global_batch = 128;  // 8192 / 128 = 64 steps per epoch
  o.optimizer = OptimizerKind::kLars;
  o.lr = 0.1;
  o.lr_scaling = LrScaling::kLinear;
  o.warmup_epochs = 0.25;
  o.allreduce.algo = comm::AllReduceAlgo::kEmulate;
  o.allreduce.format = "e5m2";
  o.allreduce.aps = true;
  o.precision.global[int(Site::kActivation)].spec = "e4m3";
  ASSERT_TRUE(Train(o).ok());
  o.resume = "auto";
  o.max_steps = 14;
  ASSERT_TRUE(Train(o).ok());

  const std::vector<nlohmann::json> records = ReadRecords(o.metrics_out);
  std::vector<size_t> runs;
  for (size_t i = 0; i < records.size(); ++i) {
    if (records[i]["type"] == "run") runs.push_back(i);
  }
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0], 0u) << "the run record must be the first line";
  const nlohmann::json& run = records[0];
  EXPECT_EQ(run["step"], 0);
  EXPECT_EQ(run["arch"], "mlp");
  EXPECT_EQ(run["dataset"], "synthetic");
  EXPECT_EQ(run["classes"], 10);
  EXPECT_EQ(run["ranks"], 1);
  EXPECT_EQ(run["workers"], 2);
  EXPECT_EQ(run["global_batch"], 128);
  EXPECT_EQ(run["epochs"], 2);
  EXPECT_EQ(run["steps_per_epoch"], 64);
  EXPECT_EQ(run["total_steps"], 128);
  EXPECT_EQ(run["seed"], 1);
  EXPECT_EQ(run["optimizer"], "lars");
  EXPECT_EQ(run["lr"], 0.1);
  EXPECT_EQ(run["lr_effective"], 0.1 * 128 / 256);
  EXPECT_EQ(run["warmup_steps"], 16);
  EXPECT_EQ(run["lars_exclude"], "bias-bn");
  EXPECT_EQ(run["lars_excluded_lr_ratio"], kLarsExcludedLrRatio);
  EXPECT_EQ(run["allreduce"], "emulate");
  EXPECT_EQ(run["allreduce_format"], "e5m2");
  EXPECT_EQ(run["aps"], true);
  EXPECT_EQ(run["precision"], DescribePrecision(o.precision));
  EXPECT_NE(run["precision"].get<std::string>().find("A=e4m3"), std::string::npos) << run;
  EXPECT_EQ(run["device"], "cpu");
  EXPECT_FALSE(run.contains("conv_algos")) << run;  // a GPU run's record only
  // The resumed part's record differs only in its start step.
  nlohmann::json resumed = records[runs[1]];
  EXPECT_EQ(resumed["step"], 10);
  EXPECT_EQ(resumed["max_steps"], 14);
  resumed["step"] = 0;
  resumed["max_steps"] = 10;
  EXPECT_EQ(resumed, run);
  // Every record after it belongs to the resumed part.
  for (size_t i = runs[1] + 1; i < records.size(); ++i) {
    EXPECT_GE(records[i]["step"].get<int64_t>(), 10) << records[i];
  }
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
  o = SmallRun();  // --device cpu
  o.fast_conv_algos = true;
  r = Train(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Status::Code::kInvalidArgument);
  EXPECT_NE(r.status().message().find("--fast-conv-algos"), std::string::npos);
  EXPECT_NE(r.status().message().find("--device cpu"), std::string::npos);
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

// Loss scaling (issue 26 item 16). In float32 a power-of-two scale multiplies every gradient
// exactly and GradientBuffers::LoadAverage divides it out exactly: the run is the unscaled one,
// bit for bit (the scale reaches every layer, and nothing but the division removes it).
TEST(TrainerLossScale, PowerOfTwoScaleInFp32IsBitIdenticalToNone) {
  TrainOptions o = SmallRun();
  o.max_steps = 30;
  auto plain = Train(o);
  ASSERT_TRUE(plain.ok()) << plain.status().message();
  o.loss_scale = *ParseLossScale("1024", 65536, 2000);
  auto scaled = Train(o);
  ASSERT_TRUE(scaled.ok()) << scaled.status().message();
  EXPECT_EQ(plain->step_losses, scaled->step_losses);
  EXPECT_EQ(plain->param_hash, scaled->param_hash);
  EXPECT_EQ(scaled->loss_scale, 1024);
}

// E in e4m3 (no scale of its own): with a batch of 1024 the errors (dL/dlogits is divided by
// the batch) are below its smallest subnormal (2^-9) and flush, so the model barely learns;
// x1024 brings them into its range.
TEST(TrainerLossScale, StaticScaleLetsE4m3ErrorsTrain) {
  TrainOptions o = SmallRun();
  o.batch_size = 1024;
  o.epochs = 8;
  o.max_steps = 60;
  o.precision.global[int(Site::kError)] = SiteFormat{"e4m3", Rounding::kNearest};
  auto mean = [](const std::vector<double>& l, size_t from) {
    double s = 0;
    for (size_t i = from; i < from + 10; ++i) s += l[i];
    return s / 10;
  };
  auto plain = Train(o);
  ASSERT_TRUE(plain.ok()) << plain.status().message();
  o.loss_scale = *ParseLossScale("1024", 65536, 2000);
  auto scaled = Train(o);
  ASSERT_TRUE(scaled.ok()) << scaled.status().message();
  const double plain_drop = mean(plain->step_losses, 50) / mean(plain->step_losses, 0);
  const double scaled_drop = mean(scaled->step_losses, 50) / mean(scaled->step_losses, 0);
  EXPECT_LT(scaled_drop, 0.6) << "with x1024: last 10 / first 10 steps' loss";
  EXPECT_GT(plain_drop, 0.9) << "without: last 10 / first 10 steps' loss";
}

// Dynamic scaling: an overflow (here the testing aid's NaN at steps 5 and 6) skips the step and
// halves the scale; four finite steps in a row double it. A checkpoint keeps the scale and its
// count, so a resume across the back-off is bit-identical.
TEST(TrainerLossScale, DynamicBacksOffOnOverflowAndResumesBitIdentically) {
  TrainOptions o = SmallRun();
  o.loss_scale = *ParseLossScale("dynamic", 1024, 4);
  o.debug_nan_step = 5;
  o.debug_nan_steps = 2;
  o.max_steps = 20;
  auto r = Train(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->skipped_steps, 2);
  LossScaler expected(o.loss_scale);
  for (int64_t step = 0; step < 20; ++step) expected.AfterStep(step == 5 || step == 6);
  EXPECT_EQ(r->loss_scale, expected.scale());
  ExpectBitIdenticalResume(o, 6, 20);
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
