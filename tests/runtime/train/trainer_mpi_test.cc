// Data-parallel training under a real mpirun: replicas stay bit-identical with every all-reduce
// algorithm, P ranks compute exactly what P emulated workers in one process compute, a
// NaN on one rank skips the step on all of them, and a checkpoint written once by rank 0 resumes
// at another world size.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "runtime/train/trainer.h"
#include "tests/mpi_test_main.h"

namespace cpd::runtime {
namespace {

namespace fs = std::filesystem;

using test::World;

TrainOptions SmallRun(const std::string& arch) {
  TrainOptions o;
  o.dataset = "synthetic";
  o.arch = arch;
  o.epochs = 1;
  o.max_steps = 10;
  o.global_batch = 48;  // splits over 1..4 ranks and 1..4 emulated workers
  o.lr = 0.05;
  o.quiet = true;
  o.progress = cpd::ProgressMode::kOff;
  o.eval_each_epoch = false;
  o.stats_every = 0;
  o.threads = 1;
  o.device = DeviceChoice::kCpu;  // the CPU path on every machine (tests/cuda cover --device cuda)
  return o;
}

// FNV-1a of the bit patterns of a loss curve.
uint64_t HashLosses(const std::vector<double>& losses) {
  uint64_t h = 1469598103934665603ull;
  for (double l : losses) {
    uint64_t bits;
    std::memcpy(&bits, &l, 8);
    h = (h ^ bits) * 1099511628211ull;
  }
  return h;
}

// The same value on every rank (max and min agree).
bool SameOnAllRanks(uint64_t v) {
  uint64_t hi = v, lo = ~v;
  EXPECT_TRUE(World()->AllReduce(&hi, 1, comm::ReduceOp::kMax).ok());
  EXPECT_TRUE(World()->AllReduce(&lo, 1, comm::ReduceOp::kMax).ok());
  return hi == v && lo == ~v;
}

struct AlgoCase {
  const char* name;
  comm::AllReduceAlgo algo;
  const char* format;
  bool aps;
};

const AlgoCase kAlgos[] = {
    {"fp32", comm::AllReduceAlgo::kFp32, "e4m3", false},
    {"emulate e4m3 APS", comm::AllReduceAlgo::kEmulate, "e4m3", true},
    {"emulate e5m2", comm::AllReduceAlgo::kEmulate, "e5m2", false},
    {"packed e4m3 APS", comm::AllReduceAlgo::kPacked, "e4m3", true},
    {"packed int8", comm::AllReduceAlgo::kPacked, "int8", false},
};

TEST(TrainerMpi, ReplicasStayBitIdentical) {
  for (const AlgoCase& c : kAlgos) {
    for (int k : {1, 2}) {
      TrainOptions o = SmallRun("mlp");
      o.emulate_ranks = k;
      o.allreduce.algo = c.algo;
      o.allreduce.format = c.format;
      o.allreduce.aps = c.aps;
      auto r = Train(o, World());
      ASSERT_TRUE(r.ok()) << c.name << " K=" << k << ": " << r.status().message();
      EXPECT_TRUE(r->replicas_identical) << c.name;
      EXPECT_EQ(r->world_size, World()->size());
      EXPECT_EQ(r->workers, World()->size() * k);
      EXPECT_EQ(r->steps, 10);
      EXPECT_TRUE(SameOnAllRanks(r->param_hash)) << c.name << " K=" << k;
      EXPECT_TRUE(SameOnAllRanks(HashLosses(r->step_losses))) << c.name << " K=" << k;
    }
  }
}

// AdamW with clipping: every rank clips the same averaged gradients by the same norm, so the
// replicas stay bit-identical (the end-of-run check), under the fp32 and the quantised all-reduce.
TEST(TrainerMpi, AdamWWithClippingReplicasStayBitIdentical) {
  for (const AlgoCase& c : {kAlgos[0], kAlgos[3]}) {
    TrainOptions o = SmallRun("mlp");
    o.optimizer = OptimizerKind::kAdamW;
    o.lr = 0.002;
    o.weight_decay = 0.1;
    o.warmup_steps = 3;
    o.clip_grad_norm = 0.5;
    o.allreduce.algo = c.algo;
    o.allreduce.format = c.format;
    o.allreduce.aps = c.aps;
    auto r = Train(o, World());
    ASSERT_TRUE(r.ok()) << c.name << ": " << r.status().message();
    EXPECT_TRUE(r->replicas_identical) << c.name;
    EXPECT_EQ(r->steps, 10);
    EXPECT_EQ(r->skipped_steps, 0);
    EXPECT_TRUE(SameOnAllRanks(r->param_hash)) << c.name;
    EXPECT_TRUE(SameOnAllRanks(HashLosses(r->step_losses))) << c.name;
  }
}

// P ranks x 1 worker and 1 process x P emulated workers are the same computation: the same data
// slices, the same stochastic-rounding streams per worker, the same quantised sum in worker order
// and the same BatchNorm statistics averaging (ResNet-8 has BatchNorm). Bit for bit.
TEST(TrainerMpi, RanksMatchEmulatedWorkersInOneProcess) {
  const int p = World()->size();
  for (const AlgoCase& c : kAlgos) {
    if (c.algo == comm::AllReduceAlgo::kFp32 && p > 2) continue;  // MPI's fp32 order is its own
    if (std::string(c.format) == "int8") continue;  // per-chunk scales depend on the rank count
    TrainOptions o = SmallRun("resnet8");
    o.max_steps = 5;
    o.allreduce.algo = c.algo;
    o.allreduce.format = c.format;
    o.allreduce.aps = c.aps;
    // packed's default APS scaling (sum) picks a shift per chunk, so its bits depend on the rank
    // count too; the paper's does not.
    o.allreduce.aps_scaling = comm::ApsScaling::kPaper;
    auto ranks = Train(o, World());
    ASSERT_TRUE(ranks.ok()) << c.name << ": " << ranks.status().message();
    if (World()->rank() == 0) {
      TrainOptions one = o;
      one.emulate_ranks = p;
      auto emulated = Train(one);
      ASSERT_TRUE(emulated.ok()) << c.name << ": " << emulated.status().message();
      EXPECT_EQ(emulated->param_hash, ranks->param_hash) << c.name;
      ASSERT_EQ(emulated->step_losses.size(), ranks->step_losses.size());
      for (size_t i = 0; i < ranks->step_losses.size(); ++i) {
        EXPECT_EQ(emulated->step_losses[i], ranks->step_losses[i]) << c.name << " step " << i;
      }
    }
    ASSERT_TRUE(World()->Barrier().ok());
  }
}

TEST(TrainerMpi, NanOnOneRankSkipsTheStepEverywhere) {
  TrainOptions o = SmallRun("mlp");
  o.debug_nan_step = 3;  // rank 0's worker 0 only
  o.allreduce.algo = comm::AllReduceAlgo::kPacked;
  o.allreduce.format = "e4m3";
  o.allreduce.aps = true;
  auto r = Train(o, World());
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->skipped_steps, 1) << "rank " << World()->rank();
  EXPECT_TRUE(r->replicas_identical);
  EXPECT_TRUE(SameOnAllRanks(r->param_hash));
}

// Rank 0 alone writes checkpoints; a run that stops at step 6 and resumes in ONE process with P
// emulated workers ends bit-identical to an uninterrupted P-rank run.
TEST(TrainerMpi, CheckpointWrittenOnceResumesAtAnotherWorldSize) {
  int32_t pid = World()->rank() == 0 ? int32_t(getpid()) : 0;
  ASSERT_TRUE(World()->AllReduce(&pid, 1, comm::ReduceOp::kMax).ok());
  const std::string dir = "/tmp/cpd_trainer_mpi_test." + std::to_string(pid);
  if (World()->rank() == 0) fs::remove_all(dir);
  ASSERT_TRUE(World()->Barrier().ok());

  TrainOptions full = SmallRun("mlp");
  full.max_steps = 12;
  full.allreduce.algo = comm::AllReduceAlgo::kEmulate;
  full.allreduce.format = "e4m3";
  full.allreduce.aps = true;
  auto uninterrupted = Train(full, World());
  ASSERT_TRUE(uninterrupted.ok()) << uninterrupted.status().message();

  TrainOptions first = full;
  first.max_steps = 6;
  first.checkpoint_dir = dir;
  first.checkpoint_every = 3;
  auto part = Train(first, World());
  ASSERT_TRUE(part.ok()) << part.status().message();
  ASSERT_TRUE(World()->Barrier().ok());
  if (World()->rank() == 0) {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename());
    std::sort(names.begin(), names.end());
    EXPECT_EQ(names, (std::vector<std::string>{"ckpt-000000000003.cpd", "ckpt-000000000006.cpd"}));

    TrainOptions rest = full;
    rest.emulate_ranks = World()->size();
    rest.checkpoint_dir = dir;
    rest.resume = "auto";
    auto resumed = Train(rest);
    ASSERT_TRUE(resumed.ok()) << resumed.status().message();
    EXPECT_EQ(resumed->steps, 12);
    EXPECT_EQ(resumed->param_hash, uninterrupted->param_hash);
    fs::remove_all(dir);
  }
  ASSERT_TRUE(World()->Barrier().ok());
}

// A small GPT on byte-level text that rank 0 writes (the same path on every rank).
class LanguageModelRun {
 public:
  LanguageModelRun() {
    int32_t pid = World()->rank() == 0 ? int32_t(getpid()) : 0;
    EXPECT_TRUE(World()->AllReduce(&pid, 1, comm::ReduceOp::kMax).ok());
    dir_ = "/tmp/cpd_trainer_mpi_lm." + std::to_string(pid);
    if (World()->rank() == 0) {
      fs::remove_all(dir_);
      fs::create_directories(dir_);
      std::ofstream out(dir_ + "/corpus.txt");
      const char* words[] = {"the ", "cat ", "sat ", "on ", "a ", "mat. ", "dogs ", "run\n"};
      uint64_t x = 1;
      for (int i = 0; i < 6000; ++i) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        out << words[(x >> 33) % 8];
      }
    }
    EXPECT_TRUE(World()->Barrier().ok());
  }
  ~LanguageModelRun() {
    EXPECT_TRUE(World()->Barrier().ok());
    if (World()->rank() == 0) fs::remove_all(dir_);
  }
  TrainOptions Options(const std::string& arch = "gpt") const {
    TrainOptions o = SmallRun(arch);
    o.dataset = "text";
    o.data_dir = dir_ + "/corpus.txt";
    o.lm.n_layer = 1;
    o.lm.n_head = 2;
    o.lm.n_embd = 16;
    o.lm.block_size = 16;
    o.lm.dropout = 0.1;  // the masks are drawn per (step, worker): the same for ranks and workers
    o.max_steps = 6;
    return o;
  }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
};

// Language models over ranks (the GPT and the LSTM): replicas bit-identical with every
// all-reduce, P ranks equal to P emulated workers in one process, and (the GPT) a checkpoint
// resumed at another world size equal to the uninterrupted run.
TEST(TrainerMpi, LanguageModelIsDataParallelAndResumable) {
  LanguageModelRun lm;
  const int p = World()->size();
  for (const AlgoCase& c : kAlgos) {
    for (const char* arch : {"gpt", "lstm"}) {
      TrainOptions o = lm.Options(arch);
      o.allreduce.algo = c.algo;
      o.allreduce.format = c.format;
      o.allreduce.aps = c.aps;
      o.allreduce.aps_scaling = comm::ApsScaling::kPaper;
      auto ranks = Train(o, World());
      ASSERT_TRUE(ranks.ok()) << c.name << " " << arch << ": " << ranks.status().message();
      EXPECT_TRUE(ranks->replicas_identical) << c.name << " " << arch;
      EXPECT_TRUE(SameOnAllRanks(ranks->param_hash)) << c.name << " " << arch;
      const bool comparable =
          !(c.algo == comm::AllReduceAlgo::kFp32 && p > 2) && std::string(c.format) != "int8";
      if (comparable && World()->rank() == 0) {
        TrainOptions one = o;
        one.emulate_ranks = p;
        auto emulated = Train(one);
        ASSERT_TRUE(emulated.ok()) << c.name << ": " << emulated.status().message();
        EXPECT_EQ(emulated->param_hash, ranks->param_hash) << c.name << " " << arch;
        EXPECT_EQ(emulated->step_losses, ranks->step_losses) << c.name << " " << arch;
      }
      ASSERT_TRUE(World()->Barrier().ok());
    }
  }

  TrainOptions full = lm.Options();
  full.max_steps = 8;
  full.allreduce.algo = comm::AllReduceAlgo::kEmulate;
  full.allreduce.aps = true;
  auto uninterrupted = Train(full, World());
  ASSERT_TRUE(uninterrupted.ok()) << uninterrupted.status().message();
  TrainOptions first = full;
  first.max_steps = 5;
  first.checkpoint_dir = lm.dir() + "/ckpt";
  first.checkpoint_every = 5;
  ASSERT_TRUE(Train(first, World()).ok());
  ASSERT_TRUE(World()->Barrier().ok());
  if (World()->rank() == 0) {
    TrainOptions rest = full;
    rest.emulate_ranks = p;
    rest.checkpoint_dir = first.checkpoint_dir;
    rest.resume = "auto";
    auto resumed = Train(rest);
    ASSERT_TRUE(resumed.ok()) << resumed.status().message();
    EXPECT_EQ(resumed->steps, 8);
    EXPECT_EQ(resumed->param_hash, uninterrupted->param_hash);
  }
}

}  // namespace
}  // namespace cpd::runtime
