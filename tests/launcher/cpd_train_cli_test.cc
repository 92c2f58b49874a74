// The cpd-train command line, run as a subprocess (CPD_TRAIN_PATH is the built binary): help,
// the error contract (exit 2, one line on stderr), --config YAML with flags winning, presets,
// --print-model, and a short real training run that writes metrics.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/subprocess.h"

#ifndef CPD_TRAIN_PATH
#error "CPD_TRAIN_PATH must name the cpd-train binary"
#endif

namespace cpd::test {
namespace {

RunResult Train(const std::vector<std::string>& args) {
  return RunProgram(cpd::test::BuiltProgram(CPD_TRAIN_PATH), args);
}

size_t Lines(const std::string& s) { return size_t(std::count(s.begin(), s.end(), '\n')); }

void ExpectUsageError(const RunResult& r, const std::string& needle) {
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(Lines(r.err), 1u) << r.err;
  EXPECT_EQ(r.err.rfind("cpd-train: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
}

std::string WriteTemp(const std::string& name, const std::string& text) {
  const std::string path = "/tmp/cpd_train_cli_" + std::to_string(getpid()) + "_" + name;
  std::ofstream(path) << text;
  return path;
}

// The number of "step" records in a metrics file, and its last epoch record.
int CountSteps(const std::string& path, nlohmann::json* last_epoch) {
  std::ifstream in(path);
  std::string line;
  int steps = 0;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["type"] == "step") ++steps;
    if (j["type"] == "epoch") *last_epoch = j;
  }
  return steps;
}

TEST(CpdTrainCli, HelpDocumentsEveryGroupOfOptions) {
  const RunResult r = Train({"--help"});
  EXPECT_EQ(r.exit_code, 0);
  for (const char* flag :
       {"--arch",        "--dataset",        "--w-format",       "--a-format",
        "--e-format",    "--g-format",       "--layer-format",   "--keep-fp32",
        "--cyclic-bits", "--cyclic-periods", "--grad-bits",      "--hysteresis",
        "--stats-every", "--metrics-out",    "--checkpoint-dir", "--checkpoint-every",
        "--resume",      "--device",         "--config",         "--print-model",
        "--optimizer"}) {
    EXPECT_NE(r.out.find(flag), std::string::npos) << flag;
  }
}

TEST(CpdTrainCli, BadInputIsOneLineAndExitTwo) {
  ExpectUsageError(Train({"--epochs", "0"}), "--epochs");
  ExpectUsageError(Train({"--no-such-flag"}), "--no-such-flag");
  ExpectUsageError(Train({"--w-format", "e9m1"}), "e9m1");
  ExpectUsageError(Train({"--layer-format", "conv1.X=e4m3"}), "conv1.X=e4m3");
  ExpectUsageError(Train({"--preset", "fast"}), "fast");
  ExpectUsageError(Train({"--arch", "resnet21"}), "resnet21");
  ExpectUsageError(Train({"--keep-fp32", "conv7"}), "conv7");
  const std::string bad_key = WriteTemp("bad.yaml", "epoch: 3\n");
  ExpectUsageError(Train({"--config", bad_key}), "'epoch'");
  std::remove(bad_key.c_str());
}

TEST(CpdTrainCli, PrintModelListsQuantisableLayers) {
  const RunResult r = Train({"--arch", "lenet5", "--print-model"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  for (const char* name : {"conv1", "conv2", "fc1", "fc2", "fc3", "61,706"}) {
    EXPECT_NE(r.out.find(name), std::string::npos) << name;
  }
}

TEST(CpdTrainCli, ConfigFileWithFlagsWinning) {
  const std::string metrics = WriteTemp("m.jsonl", "");
  const std::string cfg =
      WriteTemp("run.yaml",
                "dataset: synthetic\narch: mlp\nmax-steps: 9\nstats-every: 1\nquiet: true\n"
                "metrics-out: " +
                    metrics + "\nw-format: e4m3\n");
  // The flag says 4 steps; the file says 9.
  const RunResult r = Train({"--config", cfg, "--max-steps", "4"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.out.empty()) << "quiet from the config file: " << r.out;
  nlohmann::json epoch;
  EXPECT_EQ(CountSteps(metrics, &epoch), 4);
  EXPECT_EQ(epoch["step"].get<int>(), 4);
  std::remove(cfg.c_str());
  std::remove(metrics.c_str());
}

TEST(CpdTrainCli, CptPresetTrainsAndReportsBitsAndCost) {
  const RunResult r = Train({"--dataset", "synthetic", "--arch", "lenet5", "--preset", "cpt",
                             "--epochs", "1", "--no-progress"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("bits 3-8/8"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("cost -"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("epoch 1/1"), std::string::npos) << r.out;
}

// Runs cpd-train with every GPU hidden from the CUDA runtime (CUDA_VISIBLE_DEVICES=""), so that
// the behaviour without a GPU is tested on GPU machines too (and in builds without CUDA).
RunResult TrainWithoutGpu(const std::vector<std::string>& args) {
  const char* old = std::getenv("CUDA_VISIBLE_DEVICES");
  const std::string saved = old != nullptr ? old : "";
  setenv("CUDA_VISIBLE_DEVICES", "", 1);
  RunResult r = Train(args);
  if (old != nullptr) {
    setenv("CUDA_VISIBLE_DEVICES", saved.c_str(), 1);
  } else {
    unsetenv("CUDA_VISIBLE_DEVICES");
  }
  return r;
}

TEST(CpdTrainCli, DeviceCudaWithoutAGpuIsAOneLineError) {
  const RunResult r =
      TrainWithoutGpu({"--device", "cuda", "--dataset", "synthetic", "--max-steps", "1"});
  EXPECT_EQ(r.exit_code, 1) << r.err;  // an environment error, not a usage error; no crash
  EXPECT_EQ(Lines(r.err), 1u) << r.err;
  EXPECT_EQ(r.err.rfind("cpd-train: --device cuda: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find("use --device cpu"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
}

TEST(CpdTrainCli, DeviceAutoWithoutAGpuTrainsOnTheCpu) {
  const RunResult r = TrainWithoutGpu({"--dataset", "synthetic", "--arch", "mlp", "--max-steps",
                                       "2", "--epochs", "1", "--no-progress"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find(", cpu, "), std::string::npos) << r.out;
}

TEST(CpdTrainCli, BadDeviceNamesTheFlag) {
  ExpectUsageError(Train({"--device", "tpu"}), "--device 'tpu'");
}

}  // namespace
}  // namespace cpd::test
