// The cpd-train command line, run as a subprocess (CPD_TRAIN_PATH is the built binary): help,
// the error contract (exit 2, one line on stderr), --config YAML with flags winning, presets,
// --print-model, and a short real training run that writes metrics.
#include <gtest/gtest.h>
#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "cpd/config.h"
#include "tests/launcher/bad_token_files.h"
#include "tests/subprocess.h"
#include "tests/temp_dir.h"

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

// The number of "step" records in a metrics file, and its last epoch record. A file with records
// must open with the "run" record.
int CountSteps(const std::string& path, nlohmann::json* last_epoch) {
  std::ifstream in(path);
  std::string line;
  int steps = 0;
  bool first = true;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (first) {
      EXPECT_EQ(j["type"], "run") << line;
    }
    first = false;
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
        "--optimizer",   "--cost-reference"}) {
    EXPECT_NE(r.out.find(flag), std::string::npos) << flag;
  }
  for (const char* flag : {"--lr-scaling", "--lr-base-batch", "--warmup-epochs", "--lars-exclude",
                           "--lars-excluded-lr-ratio", "--progress-interval", "--beta1", "--beta2",
                           "--eps", "--clip-grad-norm", "adamw"}) {
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
  ExpectUsageError(Train({"--a-format", "e4m3:block=0x16"}), "':block=0x16' needs RxC");
  ExpectUsageError(Train({"--w-format", "nvfp4:3d"}), "nvfp4 takes only ':2d'");
  ExpectUsageError(Train({"--wgrad-transform", "rht12"}), "--wgrad-transform: bad transform");
  ExpectUsageError(Train({"--accumulate", "e8m13:every=0"}),
                   "--accumulate: bad accumulation \"e8m13:every=0\": every must be");
  ExpectUsageError(Train({"--accumulate", "mxfp8"}), "mxfp8 is not a fixed float format");
  // The transform runs on both devices; a bad one is refused on either.
  ExpectUsageError(Train({"--wgrad-transform", "had512", "--device", "cuda"}),
                   "--wgrad-transform: bad transform");
  for (const char* ref : {"8", "8/0", "8/8/8", "x/8", "8-8", "33/8", ""}) {
    ExpectUsageError(Train({"--cost-reference", ref}), "--cost-reference");
  }
  const std::string bad_key = WriteTemp("bad.yaml", "epoch: 3\n");
  ExpectUsageError(Train({"--config", bad_key}), "'epoch'");
  std::remove(bad_key.c_str());
  // A repeated key was resolved to its first value without a word (issue 26 item 6).
  const std::string twice = WriteTemp("twice.yaml", "epochs: 3\nlr: 0.1\n# again\nepochs: 5\n");
  ExpectUsageError(Train({"--config", twice}), "line 4: key 'epochs' is given twice");
  std::remove(twice.c_str());
  const std::string nested = WriteTemp("nested.yaml", "epochs: {a: 1}\nlr: [0.1, [0.2]]\n");
  ExpectUsageError(Train({"--config", nested}),
                   "key 'epochs': expected a scalar or a list of scalars");
  std::remove(nested.c_str());
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
  std::ifstream in(metrics);
  std::string first;
  std::getline(in, first);
  const nlohmann::json run = nlohmann::json::parse(first);
  EXPECT_EQ(run["arch"], "mlp") << first;
  EXPECT_EQ(run["precision"], "W=e4m3") << first;
  EXPECT_EQ(run["total_steps"], 640) << first;  // the schedule's horizon: 10 epochs x 64 steps
  EXPECT_EQ(run["max_steps"], 4) << first;
  std::remove(cfg.c_str());
  std::remove(metrics.c_str());
}

TEST(CpdTrainCli, CptPresetTrainsAndReportsBitsAndCost) {
  const RunResult r = Train({"--dataset", "synthetic", "--arch", "lenet5", "--preset", "cpt",
                             "--epochs", "1", "--no-progress"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("bits 3-8/8"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("cost -"), std::string::npos) << r.out;  // T = 2 steps: not -36.67 %
  EXPECT_NE(r.out.find("% vs 8/8"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("epoch 1/1"), std::string::npos) << r.out;
}

// A static run has a cost too, against the reference given; a quantised W shows its flips.
TEST(CpdTrainCli, StaticRunReportsCostAgainstTheReferenceAndFlips) {
  const RunResult r = Train({"--dataset", "synthetic", "--arch", "mlp", "--w-format", "int4",
                             "--a-format", "int4", "--e-format", "int8", "--cost-reference", "8/8",
                             "--max-steps", "3", "--epochs", "1", "--no-progress"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("cost -58.33% vs 8/8"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" flips "), std::string::npos) << r.out;
}

// Runs cpd-train with every GPU hidden (RunProgramWithoutGpu).
RunResult TrainWithoutGpu(const std::vector<std::string>& args) {
  return cpd::test::RunProgramWithoutGpu(cpd::test::BuiltProgram(CPD_TRAIN_PATH), args);
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

// Out-of-range values are refused by name before any work (they used to be accepted silently;
// --coordinator without a port only drew a gRPC warning).
TEST(CpdTrainCli, OutOfRangeFlagsAreRefused) {
  for (const auto& [flag, value] :
       std::vector<std::pair<std::string, std::string>>{{"--threads", "-1"},
                                                        {"--max-steps", "-4"},
                                                        {"--image-size", "-28"},
                                                        {"--classes", "0"},
                                                        {"--in-channels", "0"},
                                                        {"--max-skipped-steps", "-1"},
                                                        {"--lr-scaling", "cube"},
                                                        {"--lr-base-batch", "0"},
                                                        {"--warmup-epochs", "-1"},
                                                        {"--lars-exclude", "all"},
                                                        {"--lars-excluded-lr-ratio", "0"},
                                                        {"--coordinator", "nohostport"}}) {
    const RunResult r = Train({"--dataset", "synthetic", "--arch", "mlp", flag, value});
    ExpectUsageError(r, flag);
    EXPECT_TRUE(r.out.empty()) << flag << " " << value << ": " << r.out;
  }
}

// AdamW's and clipping's values out of range are refused by name, in one line.
TEST(CpdTrainCli, AdamWAndClippingValuesAreChecked) {
  for (const auto& [flag, value] :
       std::vector<std::pair<std::string, std::string>>{{"--beta1", "1"},
                                                        {"--beta1", "-0.1"},
                                                        {"--beta1", "nan"},
                                                        {"--beta2", "1.5"},
                                                        {"--beta2", "NaN"},
                                                        {"--eps", "0"},
                                                        {"--eps", "-1e-8"},
                                                        {"--eps", "inf"},
                                                        {"--clip-grad-norm", "-1"},
                                                        {"--clip-grad-norm", "nan"},
                                                        {"--clip-grad-norm", "inf"}}) {
    const RunResult r =
        Train({"--dataset", "synthetic", "--arch", "mlp", "--optimizer", "adamw", flag, value});
    ExpectUsageError(r, flag);
    EXPECT_TRUE(r.out.empty()) << flag << " " << value << ": " << r.out;
  }
  ExpectUsageError(Train({"--optimizer", "adam"}),
                   "--optimizer 'adam' (accepted: sgd, lars, adamw)");
  ExpectUsageError(Train({"--optimizer", "adamw", "--nesterov"}),
                   "--nesterov applies to --optimizer sgd and lars, not adamw");
  EXPECT_EQ(Train({"--optimizer", "adamw", "--beta2", "0.95", "--eps", "1e-6", "--clip-grad-norm",
                   "1", "--check"})
                .exit_code,
            0);
}

// AdamW with clipping trains: the loss falls, every step record carries the pre-clip norm, the
// run record the optimiser's settings.
TEST(CpdTrainCli, AdamWWithClippingTrainsAndReportsTheGradNorm) {
  const std::string metrics = WriteTemp("adamw.jsonl", "");
  const RunResult r = Train({"--dataset",        "synthetic", "--arch",         "mlp",
                             "--optimizer",      "adamw",     "--lr",           "0.001",
                             "--weight-decay",   "0.1",       "--warmup-steps", "5",
                             "--clip-grad-norm", "1",         "--epochs",       "1",
                             "--max-steps",      "30",        "--stats-every",  "1",
                             "--threads",        "2",         "--metrics-out",  metrics,
                             "--no-progress"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("AdamW betas (0.9, 0.999) eps 1e-08, decoupled weight decay 0.1, "
                       "gradients clipped to norm 1"),
            std::string::npos)
      << r.out;
  std::ifstream in(metrics);
  std::string line;
  std::vector<double> losses;
  int clipped = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j["type"] == "run") {
      EXPECT_EQ(j["optimizer"], "adamw");
      EXPECT_EQ(j["beta2"], 0.999);
      EXPECT_EQ(j["clip_grad_norm"], 1.0);
    }
    if (j["type"] != "step") continue;
    ASSERT_TRUE(j.contains("grad_norm") && j["grad_norm"].is_number()) << line;
    EXPECT_GT(j["grad_norm"].get<double>(), 0.0);
    clipped += j["grad_norm"].get<double>() > 1.0;
    losses.push_back(j["loss"].get<double>());
  }
  std::remove(metrics.c_str());
  ASSERT_EQ(losses.size(), 30u);
  EXPECT_GT(clipped, 0);  // the norms reach ~1.1 on this run: some steps clip
  EXPECT_LT(losses.back(), 0.5 * losses.front()) << losses.front() << " -> " << losses.back();
}

// Issue 26: sizes and seeds a user gives are bounded before anything is allocated or started
// (--threads 99999 crashed, 50000 ended in libgomp errors), and seeds outside 0..2^64-1 are
// refused rather than wrapped into one stream (-1, 2^64 and 1e23 all gave 2^64-1).
TEST(CpdTrainCli, ThreadCountsSeedsAndBucketsAreBounded) {
  for (const char* threads : {"99999", "50000", "2147483647", "2147483648"}) {
    ExpectUsageError(Train({"--threads", threads}), "--threads");
  }
  const RunResult r = Train({"--threads", "99999"});
  EXPECT_NE(r.err.find("is not accepted: 0 (all cores) or 1.."), std::string::npos) << r.err;
  for (const char* seed : {"-1", "18446744073709551616", "1e23", "100000000000000000000000", ""}) {
    ExpectUsageError(Train({"--seed", seed}), "--seed");
  }
  EXPECT_EQ(Train({"--seed", "18446744073709551615", "--check"}).exit_code, 0);
  ExpectUsageError(Train({"--bucket-mb", "0"}), "--bucket-mb 0 is not accepted");
  ExpectUsageError(Train({"--bucket-mb", "1e30"}), "--bucket-mb 1e+30 is not accepted");
  ExpectUsageError(Train({"--pipeline-kb", "2000000"}), "--pipeline-kb 2000000 is not accepted");
}

// --loss-scale: off, dynamic or a number, one line otherwise; a run says the scale it trains at
// in its header and epoch line.
TEST(CpdTrainCli, LossScaleFlag) {
  ExpectUsageError(Train({"--loss-scale", "-4"}), "--loss-scale '-4' is not accepted");
  ExpectUsageError(Train({"--loss-scale", "dynamic", "--loss-scale-init", "0"}),
                   "--loss-scale-init 0 is not accepted");
  const RunResult r =
      Train({"--dataset", "synthetic", "--arch", "mlp", "--max-steps", "2", "--no-progress",
             "--loss-scale", "dynamic", "--loss-scale-init", "256"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("\nloss scale dynamic from 256 (x2 after 2000 finite steps, x0.5 on "
                       "overflow)\n"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find(" loss-scale 256\n"), std::string::npos) << r.out;
}

// --check runs every check of a run's options (those of ValidateTrainOptions included, which
// used to run only after MPI started) and exits: silent 0 or the one line.
TEST(CpdTrainCli, CheckValidatesWithoutTraining) {
  RunResult r = Train({"--check", "--epochs", "3"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_TRUE(r.err.empty()) << r.err;
  ExpectUsageError(Train({"--check", "--lr", "-1"}), "--lr -1 is not accepted: a number > 0");
  ExpectUsageError(Train({"--check", "--momentum", "-5"}), "--momentum -5 is not accepted");
  ExpectUsageError(Train({"--check", "--weight-decay", "nan"}), "--weight-decay nan");
}

#ifdef CPD_MPIEXEC
// --comm self under a parallel launcher: every process would train alone into the same
// checkpoint folder and metrics file (records doubled). Refused once, by rank 0.
TEST(CpdTrainCli, CommSelfUnderAParallelLaunchIsRefused) {
  const std::string metrics = "/tmp/cpd_train_cli_" + std::to_string(getpid()) + "_self.jsonl";
  std::vector<std::string> args = {"-np", "2"};
  if (getuid() == 0) args.push_back("--allow-run-as-root");
  for (const char* a : {"--oversubscribe", "-q"}) args.push_back(a);
  args.push_back(cpd::test::BuiltProgram(CPD_TRAIN_PATH));
  for (const char* a : {"--comm", "self", "--dataset", "synthetic", "--arch", "mlp", "--max-steps",
                        "1", "--no-progress"}) {
    args.push_back(a);
  }
  args.insert(args.end(), {"--metrics-out", metrics});
  const RunResult r = RunProgram(CPD_MPIEXEC, args);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(Lines(r.err), 1u) << r.err;
  EXPECT_NE(r.err.find("--comm self, but a launcher started 2 processes"), std::string::npos)
      << r.err;
  EXPECT_FALSE(std::filesystem::exists(metrics));
  std::remove(metrics.c_str());
}
#endif

// Hybrid precision: a bad --allreduce-layer-format (no '=', a bad spec, a layer the model does
// not have, bn in a model without BatchNorm, the fp32 all-reduce) is one line naming the flag,
// exit 2; a good one trains and reports each layer's all-reduce format.
TEST(CpdTrainCli, AllReduceLayerFormatErrorsAndPerLayerStatistics) {
  const std::vector<std::string> base = {"--dataset",   "synthetic", "--arch",    "lenet5",
                                         "--max-steps", "2",         "--threads", "1"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = base;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const std::vector<std::string> packed = {"--allreduce", "packed", "--emulate-ranks", "2"};
  auto bad = [&](const std::string& value, const std::string& needle) {
    std::vector<std::string> extra = packed;
    extra.insert(extra.end(), {"--allreduce-layer-format", value});
    ExpectUsageError(Train(with(extra)), needle);
  };
  bad("conv1", "expected NAME=SPEC");
  bad("conv1=e9m9", "'conv1=e9m9'");
  bad("conv9=fp32", "'conv9'");
  bad("bn=fp32", "BatchNorm");
  ExpectUsageError(Train(with({"--emulate-ranks", "2", "--allreduce-layer-format", "first=fp32"})),
                   "--allreduce emulate or packed");

  const std::string metrics = WriteTemp("hybrid.jsonl", "");
  std::vector<std::string> extra = packed;
  extra.insert(extra.end(), {"--allreduce-format", "e3m0", "--aps", "--allreduce-layer-format",
                             "first=fp32", "--allreduce-layer-format", "fc2=e4m3", "--stats-every",
                             "1", "--metrics-out", metrics, "--quiet"});
  const RunResult r = Train(with(extra));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::ifstream in(metrics);
  std::string line;
  int comm_records = 0;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (!j.contains("comm")) continue;
    ++comm_records;
    std::map<std::string, std::string> formats;
    for (const auto& c : j["comm"]) formats[c["layer"]] = c["format"];
    EXPECT_EQ(formats, (std::map<std::string, std::string>{{"conv1", "fp32"},
                                                           {"conv2", "e3m0"},
                                                           {"fc1", "e3m0"},
                                                           {"fc2", "e4m3"},
                                                           {"fc3", "e3m0"}}));
    EXPECT_EQ(j["comm"][0]["shift"], 0);  // fp32: never shifted
  }
  EXPECT_EQ(comm_records, 2);
  std::remove(metrics.c_str());
}

// --study is a coordinator tag: without --coordinator, or malformed, it is one line naming it.
TEST(CpdTrainCli, StudyNeedsACoordinatorAndAValidName) {
  ExpectUsageError(Train({"--dataset", "synthetic", "--arch", "mlp", "--study", "s1"}), "--study");
#if !CPD_WITH_GRPC
  GTEST_SKIP() << "this build has no gRPC: --coordinator is refused before the names are read";
#endif
  const RunResult r = Train({"--dataset", "synthetic", "--arch", "mlp", "--max-steps", "1",
                             "--coordinator", "127.0.0.1:1", "--study", "bad name"});
  EXPECT_NE(r.exit_code, 0) << r.err;
  EXPECT_EQ(Lines(r.err), 1u) << r.err;
  EXPECT_NE(r.err.find("--study 'bad name'"), std::string::npos) << r.err;
}

// A token gRPC refuses as a metadata value aborted cpd-train (SIGABRT, "Bearer <token>" in
// gRPC's log line) even with no coordinator listening: one line naming the file, exit 2.
TEST(CpdTrainCli, TokenFileWithBytesGrpcRefusesIsOneLineWithoutTheToken) {
#if !CPD_WITH_GRPC
  GTEST_SKIP() << "this build has no gRPC: --coordinator is refused before the token is read";
#endif
  TempDir dir("cpd_train_token");
  const std::vector<BadTokenFile> cases = BadTokenFiles();
  const std::vector<std::string> paths = WriteBadTokenFiles(dir.path());
  for (size_t i = 0; i < cases.size(); ++i) {
    // Port 1 on loopback: nothing listens there.
    const RunResult r =
        Train({"--dataset", "synthetic", "--arch", "mlp", "--max-steps", "1", "--threads", "1",
               "--coordinator", "127.0.0.1:1", "--token-file", paths[i]});
    ExpectTokenRefused(r, "cpd-train", paths[i], cases[i]);
  }
}

// A --tls-ca that is not a PEM certificate reached gRPC, which logged several lines per
// connection attempt; it is checked with the flags: one line, exit 2.
TEST(CpdTrainCli, BadTlsCaIsOneLineBeforeGrpcSeesIt) {
#if !CPD_WITH_GRPC
  GTEST_SKIP() << "this build has no gRPC: --coordinator is refused before the CA is read";
#endif
  TempDir dir("cpd_train_tls_ca");
  const std::string text = dir.File("text.pem");
  std::ofstream(text) << "not a certificate\n";
  for (const std::string& path : {text, dir.path()}) {
    const RunResult r = Train({"--dataset", "synthetic", "--arch", "mlp", "--max-steps", "1",
                               "--threads", "1", "--coordinator", "127.0.0.1:1", "--tls-ca", path});
    ExpectUsageError(r, "--tls-ca: " + path + ": ");
  }
}

// The usual quick run on synthetic data, plus `extra`.
RunResult QuickRun(std::vector<std::string> extra) {
  std::vector<std::string> args = {"--dataset", "synthetic",     "--arch",    "mlp", "--epochs",
                                   "1",         "--no-progress", "--threads", "2"};
  args.insert(args.end(), extra.begin(), extra.end());
  return Train(args);
}

// --comm nccl names the gradient all-reduce's transport: where the gradients cannot stay on a GPU
// it is one line naming it; an unknown --comm lists nccl among the kinds.
TEST(CpdTrainCli, CommNcclNeedsGradientsOnAGpu) {
  ExpectUsageError(QuickRun({"--device", "cpu", "--comm", "nccl", "--max-steps", "1"}),
                   "--comm nccl needs");
  ExpectUsageError(Train({"--comm", "gloo"}), "accepted: auto, self, mpi, nccl");
  ExpectUsageError(Train({"--gradients", "gpu"}), "--gradients 'gpu' (accepted: device, host)");
  // host staging has no NCCL all-reduce either
  ExpectUsageError(QuickRun({"--gradients", "host", "--comm", "nccl", "--max-steps", "1"}),
                   "--comm nccl needs");
}

// --fast-conv-algos (issue 25, item 1.4) is documented, off by default, refused with --device cpu
// (from the command line and from a config file alike), and harmless where auto finds no GPU.
TEST(CpdTrainCli, FastConvAlgosIsAGpuFlag) {
  EXPECT_NE(Train({"--help"}).out.find("--fast-conv-algos"), std::string::npos);
  ExpectUsageError(QuickRun({"--device", "cpu", "--fast-conv-algos", "--max-steps", "1"}),
                   "--fast-conv-algos");
  const std::string config = WriteTemp("fast.yaml", "fast-conv-algos: true\ndevice: cpu\n");
  ExpectUsageError(QuickRun({"--config", config, "--max-steps", "1"}), "got --device cpu");
  std::remove(config.c_str());
  const RunResult r =
      TrainWithoutGpu({"--dataset", "synthetic", "--arch", "lenet5", "--fast-conv-algos",
                       "--max-steps", "2", "--epochs", "1", "--no-progress"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find(", cpu, "), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("fast conv"), std::string::npos) << r.out;
}

// Rank 0 says once how the lr came about: the rule, the global batch, the warm-up in epochs and
// steps, and LARS's ratio for biases and BatchNorm.
TEST(CpdTrainCli, EffectiveLrIsOneLineAtStart) {
  // 8192 samples / 1024 = 8 steps per epoch; half an epoch = 4 steps.
  const RunResult r =
      QuickRun({"--global-batch", "1024", "--emulate-ranks", "4", "--lr", "0.05", "--lr-scaling",
                "sqrt", "--warmup-epochs", "0.5", "--optimizer", "lars", "--max-steps", "1"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("\nlr 0.05 x sqrt(1024/256) = 0.1 (cosine), warm-up 0.5 epochs = 4 steps, "
                       "LARS biases/BatchNorm at lr x 0.024\n"),
            std::string::npos)
      << r.out;
}

// --aps-scaling: a name or one clear line; sum with emulate refused; the same key from --config
// (the flag winning), and the run's header names the scaling it got (auto: sum for packed).
TEST(CpdTrainCli, ApsScalingFlagAndConfigKey) {
  ExpectUsageError(Train({"--aps-scaling", "headroom"}),
                   "--aps-scaling: unknown APS scaling 'headroom' (accepted: auto, paper, sum)");
  ExpectUsageError(Train({"--allreduce", "emulate", "--aps", "--aps-scaling", "sum"}),
                   "--aps-scaling sum applies to --allreduce packed only");
  ExpectUsageError(Train({"--pipeline-kb", "-1"}), "--pipeline-kb -1 is not accepted");
  const std::vector<std::string> packed = {
      "--emulate-ranks", "4", "--allreduce", "packed", "--allreduce-format", "e3m0", "--aps",
      "--max-steps",     "1"};
  auto header = [](const RunResult& r) {
    const std::size_t at = r.out.find("all-reduce ");
    return at == std::string::npos ? std::string() : r.out.substr(at, r.out.find('\n', at) - at);
  };
  RunResult r = QuickRun(packed);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(header(r).rfind("all-reduce packed e3m0 +APS(sum)", 0), 0u) << r.out;
  const std::string cfg = WriteTemp("aps.yaml", "aps-scaling: paper\n");
  std::vector<std::string> with_config = packed;
  with_config.insert(with_config.end(), {"--config", cfg});
  r = QuickRun(with_config);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(header(r).rfind("all-reduce packed e3m0 +APS", 0), 0u) << r.out;
  EXPECT_EQ(header(r).find("(sum)"), std::string::npos) << r.out;
  with_config.insert(with_config.end(), {"--aps-scaling", "sum"});
  r = QuickRun(with_config);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(header(r).rfind("all-reduce packed e3m0 +APS(sum)", 0), 0u) << r.out;
  std::remove(cfg.c_str());
}

TEST(CpdTrainCli, WarmupStepsAndEpochsExcludeEachOther) {
  ExpectUsageError(QuickRun({"--warmup-steps", "0", "--warmup-epochs", "1"}),
                   "--warmup-steps and --warmup-epochs exclude each other");
}

// stdout a pipe (a cluster job's log): plain progress lines, never a '\r', at most one a tenth
// of the epoch. Interval 0 gives one line per tenth (here each of the 8 steps); a long interval
// only the epoch's last batch.
TEST(CpdTrainCli, ProgressLinesInAPipeAreTimed) {
  auto run = [](const std::string& interval, std::vector<std::string> more = {}) {
    std::vector<std::string> args = {
        "--dataset", "synthetic",           "--arch", "mlp", "--epochs", "1", "--threads",
        "2",         "--progress-interval", interval};
    if (std::find(more.begin(), more.end(), "--global-batch") == more.end()) {
      more.insert(more.end(), {"--global-batch", "1024"});
    }
    args.insert(args.end(), more.begin(), more.end());
    return RunProgram(BuiltProgram(CPD_TRAIN_PATH), args, "", StdoutTo::kPipe);
  };
  auto progress_lines = [](const std::string& out) {
    size_t n = 0;
    for (size_t at = 0; (at = out.find("  epoch 1/1 step ", at)) != std::string::npos; ++at) ++n;
    return n;
  };
  RunResult r = run("0");  // 8192 / 1024 = 8 steps
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(progress_lines(r.out), 8u) << r.out;
  EXPECT_NE(r.out.find("  epoch 1/1 step 1/8 "), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find('\r'), std::string::npos) << r.out;

  r = run("3600");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(progress_lines(r.out), 1u) << r.out;
  EXPECT_NE(r.out.find("  epoch 1/1 step 8/8 "), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find('\r'), std::string::npos) << r.out;

  ExpectUsageError(run("-1"), "--progress-interval");

  // 64 steps at interval 0: a line at every 7th step (a tenth, rounded up) and the last.
  r = run("0", {"--global-batch", "128", "--progress", "lines"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(progress_lines(r.out), 10u) << r.out;
  EXPECT_NE(r.out.find("  epoch 1/1 step 7/64 "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  epoch 1/1 step 64/64 "), std::string::npos) << r.out;
}

// --progress: the bar only where asked for or on an interactive terminal; off is silent;
// --no-progress is off, and contradicting it is a usage error.
TEST(CpdTrainCli, ProgressModes) {
  auto run = [](std::vector<std::string> more) {
    std::vector<std::string> args = {"--dataset",      "synthetic", "--arch",    "mlp",
                                     "--epochs",       "1",         "--threads", "2",
                                     "--global-batch", "1024"};
    args.insert(args.end(), more.begin(), more.end());
    return RunProgram(BuiltProgram(CPD_TRAIN_PATH), args, "", StdoutTo::kPipe);
  };
  RunResult r = run({"--progress", "bar"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("\r  epoch 1/1 ["), std::string::npos) << r.out;
  for (const auto& quiet :
       {std::vector<std::string>{"--progress", "off"}, std::vector<std::string>{"--no-progress"},
        std::vector<std::string>{"--no-progress", "--progress", "off"}}) {
    r = run(quiet);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.out.find("  epoch 1/1 step "), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find('\r'), std::string::npos) << r.out;
  }
  ExpectUsageError(run({"--progress", "Bar"}),
                   "--progress 'Bar' (accepted: auto, bar, lines, off)");
  ExpectUsageError(run({"--no-progress", "--progress", "lines"}),
                   "--no-progress and --progress lines exclude each other");
}

// An unwritable --checkpoint-dir is found at start-up (exit 1), before any step; it used to fail
// at the first checkpoint.
TEST(CpdTrainCli, UnwritableCheckpointDirFailsBeforeTraining) {
  const std::string file = WriteTemp("not-a-dir", "x");
  const std::string metrics = WriteTemp("unwritable.jsonl", "");
  const RunResult r =
      QuickRun({"--checkpoint-dir", file + "/ck", "--checkpoint-every", "2", "--max-steps", "3",
                "--stats-every", "1", "--metrics-out", metrics});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(Lines(r.err), 1u) << r.err;
  EXPECT_NE(r.err.find("--checkpoint-dir"), std::string::npos) << r.err;
  nlohmann::json epoch;
  EXPECT_EQ(CountSteps(metrics, &epoch), 0) << "steps ran before the directory was checked";
  std::remove(file.c_str());
  std::remove(metrics.c_str());
}

// A checkpoint with a valid CRC and a wrongly typed field is refused with the documented line
// "checkpoint FILE is corrupt: ...; refusing it" (it was "training failed:
// [json.exception.type_error.306] ..." without the file).
TEST(CpdTrainCli, WronglyTypedCheckpointFieldIsTheOneCorruptLine) {
  const std::string dir = WriteTemp("ckdir", "");
  std::remove(dir.c_str());
  RunResult r =
      QuickRun({"--checkpoint-dir", dir, "--checkpoint-every", "3", "--max-steps", "3", "--quiet"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string path = dir + "/ckpt-000000000003.cpd";
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 20u);
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data() + 8, 8);
  nlohmann::json header = nlohmann::json::parse(bytes.substr(16, header_len));
  header["meta"]["iterator"] = "soon";
  const std::string text = header.dump();
  std::string out = bytes.substr(0, 8);
  const uint64_t n = text.size();
  out.append(reinterpret_cast<const char*>(&n), 8);
  out += text + bytes.substr(16 + header_len, bytes.size() - 20 - header_len);
  const uint32_t crc =
      uint32_t(crc32(0L, reinterpret_cast<const Bytef*>(out.data()), uInt(out.size())));
  out.append(reinterpret_cast<const char*>(&crc), 4);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << out;

  r = QuickRun({"--resume", path, "--max-steps", "6"});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(Lines(r.err), 1u) << r.err;
  EXPECT_EQ(r.err.rfind("cpd-train: checkpoint " + path + " is corrupt: meta.iterator", 0), 0u)
      << r.err;
  EXPECT_NE(r.err.find("; refusing it"), std::string::npos) << r.err;
  std::filesystem::remove_all(dir);
}

// --lr 1e30 used to skip every step after the first, one console line each, and exit 0 with loss
// NaN. The run now stops with exit 3 after writing its metrics.
TEST(CpdTrainCli, ADivergingRunStopsWithExitThree) {
  const std::string metrics = WriteTemp("diverge.jsonl", "");
  const RunResult r = QuickRun({"--lr", "1e30", "--max-steps", "60", "--metrics-out", metrics});
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_EQ(Lines(r.err), 1u) << r.err;
  EXPECT_EQ(r.err.rfind("cpd-train: training diverged at step ", 0), 0u) << r.err;
  std::ifstream in(metrics);
  std::string line, last;
  while (std::getline(in, line)) last = line;
  EXPECT_EQ(nlohmann::json::parse(last)["type"], "stop") << last;
  std::remove(metrics.c_str());
}

// Skipped steps: --max-skipped-steps in a row stop the run (exit 3); the console shows the first
// few skips and then every 100th, not one line per step.
TEST(CpdTrainCli, SkippedStepsAreRateLimitedAndBoundedByMaxSkippedSteps) {
  RunResult r = QuickRun({"--debug-nan-step", "0", "--debug-nan-steps", "1000",
                          "--max-skipped-steps", "0", "--max-steps", "120", "--batch-size", "32"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  size_t skip_lines = 0;
  for (size_t at = 0; (at = r.out.find("step skipped on all ranks", at)) != std::string::npos;
       ++at) {
    ++skip_lines;
  }
  EXPECT_EQ(skip_lines, 6u) << r.out;  // skips 1-5 and the 100th
  EXPECT_NE(r.out.find("(100 skipped so far)"), std::string::npos) << r.out;

  r = QuickRun({"--debug-nan-step", "2", "--debug-nan-steps", "1000", "--max-steps", "120"});
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_NE(r.err.find("10 consecutive steps were skipped for NaN/Inf gradients "
                       "(--max-skipped-steps 10)"),
            std::string::npos)
      << r.err;
}

}  // namespace
}  // namespace cpd::test
