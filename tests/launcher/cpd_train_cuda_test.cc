// cpd-train --device cuda end to end, as a subprocess (CPD_TRAIN_PATH is the built binary): a
// few steps of LeNet-5, of a small GPT and LSTM, and of a quantised ResNet-8 on the GPU, --device
// auto choosing the GPU, and a GPU run's metrics and checkpoint. Skips without a CUDA device.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tests/cuda_test_util.h"
#include "tests/subprocess.h"
#include "tests/temp_dir.h"

#ifndef CPD_TRAIN_PATH
#error "CPD_TRAIN_PATH must name the cpd-train binary"
#endif

namespace cpd::runtime::test {
namespace {

using cpd::test::RunProgram;
using cpd::test::RunResult;

RunResult Train(const std::vector<std::string>& args) {
  return RunProgram(cpd::test::BuiltProgram(CPD_TRAIN_PATH), args);
}

TEST(CpdTrainCuda, LeNet5TrainsOnTheGpu) {
  CPD_REQUIRE_CUDA();
  const RunResult r = Train({"--device", "cuda", "--dataset", "synthetic", "--arch", "lenet5",
                             "--max-steps", "20", "--epochs", "1", "--no-progress"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find(", cuda, "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("epoch 1/1 loss"), std::string::npos) << r.out;
  EXPECT_TRUE(r.err.empty()) << r.err;
}

// The language models (issue 28) on the GPU: a few steps of a small GPT and LSTM on a text file,
// each with its validation loss.
TEST(CpdTrainCuda, LanguageModelsTrainOnTheGpu) {
  CPD_REQUIRE_CUDA();
  cpd::test::TempDir temp("cpd_train_cuda_lm");
  const std::string corpus = temp.File("corpus.txt");
  {
    std::ofstream out(corpus);
    for (int i = 0; i < 2000; ++i) out << (i % 3 == 0 ? "the cat sat. " : "a dog ran\n");
  }
  for (const std::string arch : {"gpt", "lstm"}) {
    std::vector<std::string> args = {
        "--device",    "cuda", "--arch",   arch, "--dataset",    "text", "--data-dir",   corpus,
        "--n-layer",   "2",    "--n-embd", "16", "--block-size", "16",   "--batch-size", "8",
        "--max-steps", "10",   "--epochs", "1",  "--no-progress"};
    if (arch == "gpt") args.insert(args.end(), {"--n-head", "2"});
    const RunResult r = Train(args);
    EXPECT_EQ(r.exit_code, 0) << arch << ": " << r.err;
    EXPECT_NE(r.out.find(", cuda, "), std::string::npos) << arch << ": " << r.out;
    EXPECT_NE(r.out.find("val loss"), std::string::npos) << arch << ": " << r.out;
    EXPECT_TRUE(r.err.empty()) << arch << ": " << r.err;
  }
}

TEST(CpdTrainCuda, AutoPicksTheGpu) {
  CPD_REQUIRE_CUDA();
  const RunResult r = Train({"--dataset", "synthetic", "--arch", "mlp", "--max-steps", "5",
                             "--epochs", "1", "--no-progress"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find(", cuda, "), std::string::npos) << r.out;
}

TEST(CpdTrainCuda, QuantisedResNetWithMetricsAndCheckpoint) {
  CPD_REQUIRE_CUDA();
  cpd::test::TempDir temp("cpd_train_cuda");
  const std::string dir = temp.path();
  const std::string metrics = dir + "/m.jsonl", ck = dir + "/ck";
  const RunResult r = Train(
      {"--device",         "cuda",    "--dataset",     "synthetic", "--arch",        "resnet8",
       "--preset",         "lee2022", "--batch-size",  "32",        "--max-steps",   "6",
       "--epochs",         "1",       "--stats-every", "2",         "--metrics-out", metrics,
       "--checkpoint-dir", ck,        "--no-progress"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("flips"), std::string::npos) << r.out;
  std::ifstream in(metrics);
  std::string line;
  int steps = 0;
  while (std::getline(in, line)) steps += line.find("\"type\":\"step\"") != std::string::npos;
  EXPECT_EQ(steps, 3) << "statistics at steps 0, 2, 4";
  bool found = false;
  for (const auto& e : std::filesystem::directory_iterator(ck)) {
    found |= e.path().filename().string().rfind("ckpt-", 0) == 0;
  }
  EXPECT_TRUE(found) << "no checkpoint in " << ck;
}

}  // namespace
}  // namespace cpd::runtime::test
