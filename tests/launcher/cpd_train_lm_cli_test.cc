// cpd-train's language models on the command line (issue 28): --arch gpt and its flags, the
// text and tokens datasets, every bad value and bad file as one line and exit 2, a short run that
// reports validation loss, perplexity and bits per byte (console and metrics), GPT-2 token files
// of nanoGPT and llm.c, a resume that ends where an uninterrupted run ends, and two ranks under
// mpirun whose replicas agree and whose losses equal two emulated workers in one process.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/subprocess.h"
#include "tests/temp_dir.h"

#ifndef CPD_TRAIN_PATH
#error "CPD_TRAIN_PATH must name the cpd-train binary"
#endif

namespace cpd::test {
namespace {

RunResult Train(const std::vector<std::string>& args) {
  return RunProgram(BuiltProgram(CPD_TRAIN_PATH), args);
}

size_t Lines(const std::string& s) { return size_t(std::count(s.begin(), s.end(), '\n')); }

void ExpectUsageError(const RunResult& r, const std::string& needle) {
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(Lines(r.err), 1u) << r.err;
  EXPECT_EQ(r.err.rfind("cpd-train: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
}

// About 40 KB of text from a fixed generator: enough windows for a few steps of a tiny GPT.
std::string Corpus() {
  const char* words[] = {"the ", "cat ", "sat ", "on ", "a ", "mat. ", "dogs ", "run\n"};
  std::string text;
  uint64_t x = 7;
  for (int i = 0; i < 10000; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    text += words[(x >> 33) % 8];
  }
  return text;
}

// A tiny GPT on `data` (a text file, or a folder of .bin files with --dataset tokens) for `steps`
// steps on 2 threads, plus `extra`; `arch` and `dataset` as given.
std::vector<std::string> TinyGpt(const std::string& data, const std::string& steps,
                                 std::vector<std::string> extra = {},
                                 const std::string& dataset = "text",
                                 const std::string& arch = "gpt") {
  std::vector<std::string> a = {"--arch",
                                arch,
                                "--dataset",
                                dataset,
                                "--data-dir",
                                data,
                                "--n-layer",
                                "1",
                                "--n-head",
                                "2",
                                "--n-embd",
                                "16",
                                "--block-size",
                                "16",
                                "--batch-size",
                                "8",
                                "--max-steps",
                                steps,
                                "--no-progress",
                                "--threads",
                                "2",
                                "--lr",
                                "0.1"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// TinyGpt's arguments without --n-head (which the LSTM refuses).
void DropNHead(std::vector<std::string>* args) {
  const auto at = std::find(args->begin(), args->end(), "--n-head");
  if (at != args->end()) args->erase(at, at + 2);
}

// TinyGpt's --lr (0.1, for SGD) set to `lr`.
void WithLr(std::vector<std::string>* args, const std::string& lr) {
  *(std::find(args->begin(), args->end(), "--lr") + 1) = lr;
}

class LmCli : public ::testing::Test {
 protected:
  void SetUp() override {
    text_ = dir_.File("corpus.txt");
    std::ofstream(text_) << Corpus();
  }
  TempDir dir_{"cpd_train_lm_cli"};
  std::string text_;
};

TEST_F(LmCli, EveryNewFlagAndItsBadValues) {
  const RunResult help = Train({"--help"});
  for (const char* flag : {"--n-layer", "--n-head", "--n-embd", "--block-size", "--dropout",
                           "--untied-head", "--tokens-per-epoch", "text", "tokens", "gpt"}) {
    EXPECT_NE(help.out.find(flag), std::string::npos) << flag;
  }
  const std::vector<std::string> gpt = {"--arch", "gpt", "--dataset", "text", "--check"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = gpt;
    a.insert(a.end(), extra.begin(), extra.end());
    return Train(a);
  };
  EXPECT_EQ(with({}).exit_code, 0) << with({}).err;
  EXPECT_EQ(with({"--n-layer", "6", "--n-head", "6", "--n-embd", "384", "--block-size", "256",
                  "--dropout", "0.2", "--untied-head", "--tokens-per-epoch", "100000"})
                .exit_code,
            0);
  ExpectUsageError(with({"--n-layer", "0"}), "--n-layer 0 is not accepted: 1..256");
  ExpectUsageError(with({"--n-layer", "257"}), "--n-layer 257");
  ExpectUsageError(with({"--n-layer", "x"}), "--n-layer");
  ExpectUsageError(with({"--n-head", "0"}), "--n-head 0");
  ExpectUsageError(with({"--n-head", "3"}), "--n-embd 128 is not a multiple of --n-head 3");
  ExpectUsageError(with({"--n-embd", "0"}), "--n-embd 0");
  ExpectUsageError(with({"--n-embd", "20000"}), "--n-embd 20000");
  ExpectUsageError(with({"--block-size", "0"}), "--block-size 0");
  ExpectUsageError(with({"--block-size", "70000"}), "--block-size 70000");
  ExpectUsageError(with({"--dropout", "1"}), "--dropout 1 is not accepted");
  ExpectUsageError(with({"--dropout", "-0.1"}), "--dropout");
  ExpectUsageError(with({"--tokens-per-epoch", "-1"}), "--tokens-per-epoch must be >= 0");
  ExpectUsageError(with({"--n-layer", "256", "--n-embd", "16384"}), "parameters, more than");
  // Language-model flags and data belong to language models, and the reverse.
  ExpectUsageError(Train({"--arch", "lenet5", "--n-layer", "2", "--check"}),
                   "--n-layer applies to language models (--arch gpt or lstm), not --arch lenet5");
  ExpectUsageError(Train({"--arch", "mlp", "--untied-head", "--check"}), "--untied-head");
  ExpectUsageError(Train({"--arch", "gpt", "--check"}),
                   "--arch gpt is a language model: it needs --dataset text or tokens");
  ExpectUsageError(Train({"--dataset", "text", "--arch", "mlp", "--check"}),
                   "--dataset text is a token stream: it needs --arch gpt or lstm");
  // --device cuda takes a language model to the GPU as any other; without one (hidden here, so
  // that a GPU machine tests this too) it is the one-line environment error of every model.
  for (const std::string arch : {"gpt", "lstm"}) {
    std::vector<std::string> args = TinyGpt(text_, "1", {"--device", "cuda"}, "text", arch);
    if (arch == "lstm") DropNHead(&args);
    const RunResult r = RunProgramWithoutGpu(BuiltProgram(CPD_TRAIN_PATH), args);
    EXPECT_EQ(r.exit_code, 1) << arch << ": " << r.err;
    EXPECT_EQ(Lines(r.err), 1u) << r.err;
    EXPECT_EQ(r.err.rfind("cpd-train: --device cuda: ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find("use --device cpu"), std::string::npos) << r.err;
  }
  // The LSTM takes the same flags but --n-head.
  EXPECT_EQ(Train({"--arch", "lstm", "--dataset", "text", "--n-layer", "2", "--n-embd", "650",
                   "--dropout", "0.5", "--block-size", "35", "--check"})
                .exit_code,
            0);
  ExpectUsageError(Train({"--arch", "lstm", "--dataset", "text", "--n-head", "2", "--check"}),
                   "--n-head applies to --arch gpt");
}

// --preset nvfp4, deepseek-fp8 and mxfp4-rht on a GPT: the run record's precision names each recipe's
// formats, rounding, transform and the layers kept in fp32; a flag given on the command line
// still wins over the preset's.
TEST_F(LmCli, RecipePresetsSetTheirPrecision) {
  struct Case {
    std::string preset;
    std::vector<std::string> extra;
    std::string want;
  };
  const std::vector<Case> cases = {
      {"nvfp4",
       {},
       "W=nvfp4:2d A=nvfp4 E=nvfp4/stochastic, fp32: embeddings,attention,last,tail=15%, "
       "weight-gradient rht16"},
      {"nvfp4",
       {"--wgrad-transform", "had32", "--keep-fp32", "last"},
       "W=nvfp4:2d A=nvfp4 E=nvfp4/stochastic, fp32: last, weight-gradient had32"},
      {"nvfp4",
       {"--wgrad-transform", "none"},
       "W=nvfp4:2d A=nvfp4 E=nvfp4/stochastic, fp32: embeddings,attention,last,tail=15%"},
      {"deepseek-fp8",
       {},
       "W=e4m3:block=128x128:scale=fp32 A=e4m3:block=1x128:scale=fp32 "
       "E=e4m3:block=1x128:scale=fp32, fp32: embeddings,attention,last"},
      {"deepseek-fp8",
       {"--accumulate", "e8m13:every=128"},
       "W=e4m3:block=128x128:scale=fp32 A=e4m3:block=1x128:scale=fp32 "
       "E=e4m3:block=1x128:scale=fp32, fp32: embeddings,attention,last, "
       "accumulate e8m13:every=128"},
      {"mxfp4-rht",
       {},
       "W=bf16 A=bf16 E=mxfp4/stochastic, fp32: embeddings,attention,last, weight-gradient "
       "rht64"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const std::string metrics = dir_.File("m" + std::to_string(i) + ".jsonl");
    std::vector<std::string> extra = {"--preset", c.preset, "--metrics-out", metrics};
    extra.insert(extra.end(), c.extra.begin(), c.extra.end());
    const RunResult r = Train(TinyGpt(text_, "2", extra));
    ASSERT_EQ(r.exit_code, 0) << c.preset << ": " << r.err;
    std::ifstream in(metrics);
    std::string first;
    std::getline(in, first);
    EXPECT_NE(first.find("\"precision\":\"" + c.want + "\""), std::string::npos)
        << c.preset << ": " << first;
  }
  ExpectUsageError(Train({"--preset", "nvfp5", "--check"}),
                   "(accepted: cpt, lee2022, nvfp4, deepseek-fp8, mxfp4-rht)");
}

TEST_F(LmCli, BadDataIsOneLineNamingTheFile) {
  // A missing file is a data failure (exit 1), in one line naming it.
  const RunResult none = Train(TinyGpt(dir_.File("none.txt"), "1"));
  EXPECT_EQ(none.exit_code, 1) << none.err;
  EXPECT_EQ(Lines(none.err), 1u) << none.err;
  EXPECT_NE(none.err.find(dir_.File("none.txt")), std::string::npos) << none.err;
  const std::string binary = dir_.File("binary.txt");
  std::ofstream(binary, std::ios::binary) << std::string("abc\0def", 7);
  ExpectUsageError(Train(TinyGpt(binary, "1")), binary + ": holds a NUL byte");
  const std::string tiny = dir_.File("tiny.txt");
  std::ofstream(tiny) << "hello";
  ExpectUsageError(Train(TinyGpt(tiny, "1")), "fewer than --block-size 16 + 1");

  // GPT-2 token files: missing, odd-sized and truncated llm.c files.
  const std::string bins = dir_.File("bins");
  std::filesystem::create_directories(bins);
  const std::vector<std::string> args = TinyGpt(bins, "1", {}, "tokens");
  ExpectUsageError(Train({"--arch", "gpt", "--dataset", "tokens"}), "--data-dir");
  const RunResult missing = Train(args);
  EXPECT_EQ(missing.exit_code, 1) << missing.err;
  EXPECT_NE(missing.err.find(bins + "/train.bin"), std::string::npos) << missing.err;
  std::ofstream(bins + "/train.bin", std::ios::binary) << "abc";
  ExpectUsageError(Train(args), bins + "/train.bin: odd size 3 bytes");
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = 1;
  header[2] = 1000;
  std::ofstream(bins + "/train.bin", std::ios::binary)
      << std::string(reinterpret_cast<const char*>(header.data()), 1024) << std::string(100, 'x');
  ExpectUsageError(Train(args), bins + "/train.bin: truncated: the llm.c header says 1000");
}

// nanoGPT's raw train.bin and llm.c's val.bin (with its header) train a GPT-2-vocabulary model.
TEST_F(LmCli, TrainsOnNanoGptAndLlmcTokenFiles) {
  const std::string bins = dir_.File("bins");
  std::filesystem::create_directories(bins);
  std::vector<uint16_t> tokens(3000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = uint16_t((i * 7919) % 50257);
  std::ofstream(bins + "/train.bin", std::ios::binary)
      << std::string(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = 1;
  header[2] = 500;
  std::ofstream(bins + "/val.bin", std::ios::binary)
      << std::string(reinterpret_cast<const char*>(header.data()), 1024)
      << std::string(reinterpret_cast<const char*>(tokens.data()), 1000);
  const RunResult r = Train(TinyGpt(bins, "2", {}, "tokens"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("3000 train / 500 val tokens (GPT-2 BPE, vocab 50257)"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find(" ppl "), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find(" bpb "), std::string::npos) << "bits per byte only for bytes: " << r.out;
}

// An epoch of fewer windows than the global batch: the one line says windows, and how an
// epoch's count is set, where it said "training samples".
TEST_F(LmCli, AGlobalBatchOverAnEpochsWindowsNamesWindows) {
  // 4 windows; two workers drop the last partial batch, so no whole batch of 16 is left.
  const RunResult r =
      Train(TinyGpt(text_, "6", {"--tokens-per-epoch", "64", "--emulate-ranks", "2"}));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.err.find("global batch 16 exceeds the 4 training windows of an epoch "
                       "(--tokens-per-epoch / --block-size)"),
            std::string::npos)
      << r.err;
}

TEST_F(LmCli, ShortRunReportsValidationLossPerplexityAndBitsPerByte) {
  const std::string metrics = dir_.File("m.jsonl");
  const RunResult r = Train(TinyGpt(
      text_, "6", {"--metrics-out", metrics, "--tokens-per-epoch", "384", "--epochs", "2"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("(byte-level, vocab 256), block 16, 24 windows per epoch"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("unigram baseline "), std::string::npos) << r.out;
  for (const char* epoch : {"epoch 1/2 loss ", "epoch 2/2 loss "}) {
    EXPECT_NE(r.out.find(epoch), std::string::npos) << r.out;
  }
  for (const char* column : {" val loss ", " ppl ", " bpb ", " tok/s "}) {
    EXPECT_NE(r.out.find(column), std::string::npos) << column << "\n" << r.out;
  }
  std::ifstream in(metrics);
  std::string line;
  nlohmann::json run, epoch;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j["type"] == "run") run = j;
    if (j["type"] == "epoch") epoch = j;
  }
  EXPECT_EQ(run["vocab"], 256) << run;
  EXPECT_EQ(run["block_size"], 16) << run;
  EXPECT_GT(run["unigram_bits"].get<double>(), 1.0) << run;
  EXPECT_EQ(epoch["epoch"], 2) << epoch;
  const double loss = epoch["test_loss"].get<double>();
  EXPECT_NEAR(epoch["test_perplexity"].get<double>(), std::exp(loss), 1e-9 * std::exp(loss));
  EXPECT_NEAR(epoch["test_bits_per_byte"].get<double>(), loss / std::log(2.0), 1e-12);
  EXPECT_NEAR(epoch["tokens_per_s"].get<double>(), 16 * epoch["images_per_s"].get<double>(),
              1e-6 * epoch["tokens_per_s"].get<double>());
}

// The LSTM language model trains through the same path and reports the same columns.
TEST_F(LmCli, LstmTrainsAndReportsBitsPerByte) {
  std::vector<std::string> a = TinyGpt(text_, "3", {}, "text", "lstm");
  DropNHead(&a);
  const RunResult r = Train(a);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("cpd-train: lstm on text"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" bpb "), std::string::npos) << r.out;
}

// A run checkpointed at step 3 and resumed ends with the loss of an uninterrupted run.
TEST_F(LmCli, ResumeEndsBitIdenticalToAnUninterruptedRun) {
  auto last_loss = [](const std::string& path) {
    std::ifstream in(path);
    std::string line, loss;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line);
      if (j["type"] == "step") loss = j["loss"].dump();
    }
    return loss;
  };
  const std::vector<std::string> common = {"--stats-every", "1", "--dropout", "0.1"};
  const std::string whole = dir_.File("whole.jsonl"), part = dir_.File("part.jsonl");
  std::vector<std::string> extra = common;
  extra.insert(extra.end(), {"--metrics-out", whole});
  ASSERT_EQ(Train(TinyGpt(text_, "6", extra)).exit_code, 0);
  const std::string ckpt = dir_.File("ckpt");
  extra = common;
  extra.insert(extra.end(),
               {"--metrics-out", part, "--checkpoint-dir", ckpt, "--checkpoint-every", "3"});
  ASSERT_EQ(Train(TinyGpt(text_, "3", extra)).exit_code, 0);
  extra.insert(extra.end(), {"--resume", "auto"});
  const RunResult resumed = Train(TinyGpt(text_, "6", extra));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_NE(resumed.out.find("resumed from"), std::string::npos) << resumed.out;
  EXPECT_FALSE(last_loss(whole).empty());
  EXPECT_EQ(last_loss(part), last_loss(whole));
}

// AdamW with warm-up, cosine decay and clipping trains both language models (the loss falls over
// 24 steps, every step record carries the pre-clip norm), and a GPT run resumed from its step-12
// checkpoint (m, v and the step count) ends with the uninterrupted run's loss.
TEST_F(LmCli, AdamWWithClippingTrainsAndResumesBitIdentically) {
  for (const std::string arch : {"gpt", "lstm"}) {
    const std::string metrics = dir_.File(arch + "-adamw.jsonl");
    std::vector<std::string> a = TinyGpt(
        text_, "24",
        {"--optimizer", "adamw", "--weight-decay", "0.1", "--beta2", "0.95", "--warmup-steps", "4",
         "--clip-grad-norm", "1", "--stats-every", "1", "--metrics-out", metrics},
        "text", arch);
    WithLr(&a, "0.01");
    if (arch == "lstm") DropNHead(&a);
    const RunResult r = Train(a);
    ASSERT_EQ(r.exit_code, 0) << arch << ": " << r.err;
    std::ifstream in(metrics);
    std::string line;
    std::vector<double> losses;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line);
      if (j["type"] != "step") continue;
      ASSERT_TRUE(j["grad_norm"].is_number()) << arch << ": " << line;
      losses.push_back(j["loss"].get<double>());
    }
    ASSERT_EQ(losses.size(), 24u) << arch;
    const double first = (losses[0] + losses[1] + losses[2]) / 3;
    const double last = (losses[21] + losses[22] + losses[23]) / 3;
    EXPECT_LT(last, 0.8 * first) << arch << ": " << first << " -> " << last;
  }
  auto last_loss = [](const std::string& path) {
    std::ifstream in(path);
    std::string line, loss;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line);
      if (j["type"] == "step") loss = j["loss"].dump();
    }
    return loss;
  };
  const std::vector<std::string> common = {"--optimizer", "adamw",         "--clip-grad-norm",
                                           "0.5",         "--stats-every", "1"};
  auto adamw = [&](const std::string& steps, const std::vector<std::string>& extra) {
    std::vector<std::string> a = TinyGpt(text_, steps, extra);
    WithLr(&a, "0.01");
    return a;
  };
  const std::string whole = dir_.File("adamw-whole.jsonl"), part = dir_.File("adamw-part.jsonl");
  std::vector<std::string> extra = common;
  extra.insert(extra.end(), {"--metrics-out", whole});
  ASSERT_EQ(Train(adamw("20", extra)).exit_code, 0);
  const std::string ckpt = dir_.File("adamw-ckpt");
  extra = common;
  extra.insert(extra.end(),
               {"--metrics-out", part, "--checkpoint-dir", ckpt, "--checkpoint-every", "12"});
  ASSERT_EQ(Train(adamw("12", extra)).exit_code, 0);
  extra.insert(extra.end(), {"--resume", "auto"});
  const RunResult resumed = Train(adamw("20", extra));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_FALSE(last_loss(whole).empty());
  EXPECT_EQ(last_loss(part), last_loss(whole));
}

#ifdef CPD_MPIEXEC
// Two ranks: the end-of-run check finds the replicas bit-identical, and the step losses equal
// those of one process with two emulated workers (the packed all-reduce with APS).
TEST_F(LmCli, TwoRanksMatchTwoEmulatedWorkers) {
  auto losses = [](const std::string& path) {
    std::ifstream in(path);
    std::string line;
    std::vector<std::string> out;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line);
      if (j["type"] == "step") out.push_back(j["loss"].dump());
    }
    return out;
  };
  const std::vector<std::string> ar = {"--allreduce", "packed",        "--allreduce-format",
                                       "e4m3",        "--aps",         "--aps-scaling",
                                       "paper",       "--stats-every", "1"};
  const std::string ranks = dir_.File("ranks.jsonl"), one = dir_.File("one.jsonl");
  std::vector<std::string> args = {"-np", "2"};
  if (getuid() == 0) args.push_back("--allow-run-as-root");
  for (const char* a : {"--oversubscribe", "-q", "--bind-to", "none"}) args.push_back(a);
  args.push_back(BuiltProgram(CPD_TRAIN_PATH));
  std::vector<std::string> extra = ar;
  extra.insert(extra.end(), {"--metrics-out", ranks});
  for (const std::string& a : TinyGpt(text_, "4", extra)) args.push_back(a);
  const RunResult r = RunProgram(CPD_MPIEXEC, args);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("replicas bit-identical on 2 rank(s)"), std::string::npos) << r.out;
  extra = ar;
  extra.insert(extra.end(), {"--metrics-out", one, "--emulate-ranks", "2"});
  ASSERT_EQ(Train(TinyGpt(text_, "4", extra)).exit_code, 0);
  EXPECT_EQ(losses(ranks).size(), 4u);
  EXPECT_EQ(losses(ranks), losses(one));
}
#endif

}  // namespace
}  // namespace cpd::test
