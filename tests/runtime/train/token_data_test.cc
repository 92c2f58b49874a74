// Token streams (runtime/train/token_data.h): the text reader and its 90/10 split, the GPT-2
// token files of nanoGPT and llm.c (and every way one can be malformed), and the windows the
// BatchIterator draws: deterministic, identical for any world size, emulated workers and
// resumption, each label the next token of its window.
#include "runtime/train/token_data.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "runtime/train/data.h"
#include "tests/temp_dir.h"

namespace cpd::runtime {
namespace {

using test::TempDir;

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string Uint16s(const std::vector<uint16_t>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 2);
}

// llm.c's layout: a 256-int32 header (magic, version, count: the tokens' unless given; its
// low 32 bits are written), then the tokens.
std::string LlmcFile(const std::vector<uint16_t>& tokens, int32_t version = 1, int64_t count = -1) {
  std::vector<int32_t> header(256, 0);
  header[0] = kLlmcMagic;
  header[1] = version;
  header[2] = count >= 0 ? int32_t(count) : int32_t(tokens.size());
  return std::string(reinterpret_cast<const char*>(header.data()), 1024) + Uint16s(tokens);
}

std::vector<uint16_t> Ramp(size_t n, uint16_t modulo) {
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = uint16_t((i * 7 + 3) % modulo);
  return v;
}

// One line, starting with the file's path, holding `what`.
void ExpectRefused(const Result<std::vector<uint16_t>>& r, const std::string& path,
                   const std::string& what) {
  ASSERT_FALSE(r.ok()) << path;
  const std::string& m = r.status().message();
  EXPECT_EQ(m.rfind(path + ": ", 0), 0u) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  EXPECT_NE(m.find(what), std::string::npos) << m;
}

TEST(TokenFileTest, ReadsNanoGptAndLlmcFiles) {
  TempDir dir("token_data_test");
  const std::vector<uint16_t> tokens = {0, 1, 50256, 198, 464, 3290};
  WriteBytes(dir.File("nano.bin"), Uint16s(tokens));
  WriteBytes(dir.File("llmc.bin"), LlmcFile(tokens));
  auto nano = ReadTokenFile(dir.File("nano.bin"));
  ASSERT_TRUE(nano.ok()) << nano.status().ToString();
  EXPECT_EQ(*nano, tokens);
  auto llmc = ReadTokenFile(dir.File("llmc.bin"));
  ASSERT_TRUE(llmc.ok()) << llmc.status().ToString();
  EXPECT_EQ(*llmc, tokens);
}

TEST(TokenFileTest, RefusesMalformedFilesInOneLineNamingTheFile) {
  TempDir dir("token_data_test");
  const std::vector<uint16_t> tokens = Ramp(100, 50257);
  const std::string full = LlmcFile(tokens);
  struct Case {
    const char* name;
    std::string bytes;
    const char* what;
  };
  const Case cases[] = {
      {"empty", "", "empty"},
      {"odd", Uint16s(tokens) + "x", "odd size 201 bytes"},
      {"version", LlmcFile(tokens, 2), "version 2: only version 1"},
      {"short_header", full.substr(0, 600), "truncated: llm.c's header is 1024 bytes"},
      {"truncated", full.substr(0, full.size() - 2), "truncated: the llm.c header says 100"},
      {"trailing", full + "zz", "trailing data"},
      {"negative", LlmcFile(tokens, 1, 0xfffffffbll).substr(0, 1024), "negative token count"},
      {"range", Uint16s({1, 2, 50257, 4}), "token 50257 at position 2"},
  };
  for (const Case& c : cases) {
    const std::string path = dir.File(std::string(c.name) + ".bin");
    WriteBytes(path, c.bytes);
    const auto r = ReadTokenFile(path);
    ExpectRefused(r, path, c.what);
    if (!r.ok()) EXPECT_EQ(r.status().code(), Status::Code::kCorruption) << c.name;
  }
  const auto missing = ReadTokenFile(dir.File("none.bin"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), Status::Code::kNotFound);
  EXPECT_NE(missing.status().message().find(dir.File("none.bin")), std::string::npos);
}

TEST(TokenFileTest, TrainAndValPairFromAFolder) {
  TempDir dir("token_data_test");
  WriteBytes(dir.File("train.bin"), Uint16s(Ramp(1000, 50257)));
  WriteBytes(dir.File("val.bin"), LlmcFile(Ramp(200, 50257)));
  auto pair = LoadDatasetPair("tokens", dir.path(), 1, TokenWindows{16, 0});
  ASSERT_TRUE(pair.ok()) << pair.status().ToString();
  EXPECT_EQ(pair->first.classes, kGpt2Vocab);
  EXPECT_FALSE(pair->first.byte_level);
  EXPECT_EQ(pair->first.count, 1000 / 16);
  EXPECT_EQ(pair->second.count, 199 / 16);
  // Without a folder, or without the block size, the dataset says what it needs.
  EXPECT_NE(LoadDatasetPair("tokens", "", 1, TokenWindows{16, 0})
                .status()
                .message()
                .find("train.bin and val.bin"),
            std::string::npos);
  EXPECT_FALSE(LoadDatasetPair("tokens", dir.path(), 1).ok());
  // A validation stream shorter than a window is refused.
  WriteBytes(dir.File("val.bin"), Uint16s(Ramp(16, 50257)));
  const auto small = LoadDatasetPair("tokens", dir.path(), 1, TokenWindows{16, 0});
  ASSERT_FALSE(small.ok());
  EXPECT_NE(small.status().message().find("the val stream has 16 tokens"), std::string::npos)
      << small.status().message();
}

TEST(TextDataTest, SplitsEachFileNinetyTenAndSkipsBinaryFiles) {
  TempDir dir("token_data_test");
  const std::string a(100, 'a'), b = std::string(45, 'b') + std::string(5, 'c');
  WriteBytes(dir.File("b.txt"), b);
  WriteBytes(dir.File("a.txt"), a);
  WriteBytes(dir.File("a.dat"), std::string("\x00\x00\x00\x02", 4));  // a fortune index
  WriteBytes(dir.File(".hidden"), "zzzzzzzz");
  std::filesystem::create_symlink(dir.File("a.txt"), dir.File("a.u8"));
  auto files = TextFiles(dir.path());
  ASSERT_TRUE(files.ok()) << files.status().ToString();
  EXPECT_EQ(*files, (std::vector<std::string>{dir.File("a.txt"), dir.File("b.txt")}));

  auto pair = LoadTextPair(dir.path(), TokenWindows{4, 0});
  ASSERT_TRUE(pair.ok()) << pair.status().ToString();
  const Dataset& train = pair->first;
  const Dataset& val = pair->second;
  // a.txt: 90 train + 10 val; b.txt: 45 train + 5 val (its 'c's).
  ASSERT_EQ(train.tokens.size(), 135u);
  ASSERT_EQ(val.tokens.size(), 15u);
  EXPECT_EQ(train.tokens[89], 'a');
  EXPECT_EQ(train.tokens[90], 'b');
  EXPECT_EQ(val.tokens[9], 'a');
  EXPECT_EQ(val.tokens[10], 'c');
  EXPECT_EQ(train.classes, 256);
  EXPECT_TRUE(train.byte_level);
  EXPECT_EQ(train.count, 135 / 4);
  EXPECT_EQ(val.count, 14 / 4);
  // 90 a and 45 b: entropy of (2/3, 1/3).
  EXPECT_NEAR(train.unigram_bits, -(2.0 / 3) * std::log2(2.0 / 3) - (1.0 / 3) * std::log2(1.0 / 3),
              1e-12);
}

TEST(TextDataTest, RefusesWhatIsNotText) {
  TempDir dir("token_data_test");
  EXPECT_EQ(TextFiles(dir.File("none")).status().code(), Status::Code::kNotFound);
  const auto empty = TextFiles(dir.path());
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.status().message().find("no text file"), std::string::npos);
  WriteBytes(dir.File("bin"), std::string("ab\0cd", 5));
  const auto binary = TextFiles(dir.File("bin"));
  ASSERT_FALSE(binary.ok());
  EXPECT_EQ(binary.status().message().rfind(dir.File("bin") + ": holds a NUL byte", 0), 0u);
  WriteBytes(dir.File("short.txt"), "hello world");
  const auto small = LoadTextPair(dir.File("short.txt"), TokenWindows{8, 0});
  ASSERT_FALSE(small.ok());
  EXPECT_NE(small.status().message().find("fewer than --block-size 8 + 1"), std::string::npos)
      << small.status().message();
}

// A stream whose token at position p is p mod 251: a window's first token gives its offset.
std::pair<Dataset, Dataset> RampPair(int64_t block, int64_t tokens_per_epoch) {
  std::vector<uint16_t> train(5000), val(700);
  for (size_t i = 0; i < train.size(); ++i) train[i] = uint16_t(i % 251);
  for (size_t i = 0; i < val.size(); ++i) val[i] = uint16_t(i % 251);
  auto pair = MakeTokenPair("ramp", std::move(train), std::move(val), 256, true,
                            TokenWindows{block, tokens_per_epoch});
  EXPECT_TRUE(pair.ok());
  return std::move(pair).value();
}

// Every batch of an epoch, as (x values, labels), for rank `rank` of `world`.
std::vector<std::pair<std::vector<float>, std::vector<int32_t>>> Epoch(const Dataset& d,
                                                                       int64_t batch, int rank,
                                                                       int world, int64_t epoch,
                                                                       uint64_t seed) {
  BatchIterator it(d, batch, true, false, seed, true);
  EXPECT_TRUE(it.SetShard(rank, world).ok());
  it.StartEpoch(epoch);
  std::vector<std::pair<std::vector<float>, std::vector<int32_t>>> out;
  Tensor x;
  std::vector<int32_t> y;
  while (it.Next(&x, &y)) out.emplace_back(std::vector<float>(x.data(), x.data() + x.numel()), y);
  return out;
}

TEST(TokenWindowsTest, EachLabelIsTheNextTokenOfItsWindow) {
  const auto [train, val] = RampPair(16, 0);
  EXPECT_EQ(train.count, 5000 / 16);
  BatchIterator it(train, 8, true, false, 7, false);
  it.StartEpoch(0);
  Tensor x;
  std::vector<int32_t> y;
  ASSERT_TRUE(it.Next(&x, &y));
  ASSERT_EQ(x.shape(), (std::vector<int64_t>{8, 16}));
  ASSERT_EQ(y.size(), 8u * 16u);
  for (int64_t i = 0; i < 8; ++i) {
    for (int64_t t = 0; t < 16; ++t) {
      const float v = x.data()[i * 16 + t];
      EXPECT_EQ(v, float(int(x.data()[i * 16] + t) % 251)) << i << " " << t;
      EXPECT_EQ(y[size_t(i * 16 + t)], (int(v) + 1) % 251) << i << " " << t;
    }
  }
  // Offsets cover the valid range: [0, 5000 - 16).
  int64_t lo = 1 << 30, hi = -1;
  for (int64_t s = 0; s < 2000; ++s) {
    const int64_t o = WindowOffset(train, 7, 3, s);
    lo = std::min(lo, o);
    hi = std::max(hi, o);
  }
  EXPECT_GE(lo, 0);
  EXPECT_LT(hi, 5000 - 16);
  EXPECT_GT(hi, 4900);
  EXPECT_LT(lo, 100);
  // Validation: disjoint windows in order.
  EXPECT_EQ(val.count, 699 / 16);
  for (int64_t s = 0; s < val.count; ++s) EXPECT_EQ(WindowOffset(val, 7, 5, s), s * 16);
}

TEST(TokenWindowsTest, DeterministicAndSeededByEpoch) {
  const auto [train, val] = RampPair(8, 1600);
  EXPECT_EQ(train.count, 200);
  const auto a = Epoch(train, 10, 0, 1, 2, 99);
  EXPECT_EQ(a, Epoch(train, 10, 0, 1, 2, 99));
  EXPECT_NE(a, Epoch(train, 10, 0, 1, 3, 99));
  EXPECT_NE(a, Epoch(train, 10, 0, 1, 2, 98));
}

// The global batch of every step is the same windows whatever the world size: rank r's part
// is the slice of the one-process batch (and emulated workers slice a rank's batch likewise).
TEST(TokenWindowsTest, IdenticalAcrossWorldSizes) {
  const auto [train, val] = RampPair(8, 0);
  const int64_t global = 12;
  const auto one = Epoch(train, global, 0, 1, 1, 5);
  for (int world : {2, 3}) {
    std::vector<std::vector<std::pair<std::vector<float>, std::vector<int32_t>>>> ranks;
    for (int r = 0; r < world; ++r) ranks.push_back(Epoch(train, global / world, r, world, 1, 5));
    for (size_t step = 0; step < one.size(); ++step) {
      std::vector<float> x;
      std::vector<int32_t> y;
      for (int r = 0; r < world; ++r) {
        ASSERT_LT(step, ranks[size_t(r)].size());
        x.insert(x.end(), ranks[size_t(r)][step].first.begin(), ranks[size_t(r)][step].first.end());
        y.insert(y.end(), ranks[size_t(r)][step].second.begin(),
                 ranks[size_t(r)][step].second.end());
      }
      EXPECT_EQ(x, one[step].first) << "world " << world << " step " << step;
      EXPECT_EQ(y, one[step].second) << "world " << world << " step " << step;
    }
  }
}

TEST(TokenWindowsTest, ResumeMidEpochGivesTheSameBatches) {
  const auto [train, val] = RampPair(8, 0);
  BatchIterator it(train, 6, true, false, 11, true);
  it.StartEpoch(1);
  Tensor x;
  std::vector<int32_t> y;
  for (int i = 0; i < 7; ++i) ASSERT_TRUE(it.Next(&x, &y));
  const IteratorState saved = it.state();
  BatchIterator resumed(train, 6, true, false, 11, true);
  ASSERT_TRUE(resumed.Restore(saved).ok());
  Tensor x2;
  std::vector<int32_t> y2;
  while (it.Next(&x, &y)) {
    ASSERT_TRUE(resumed.Next(&x2, &y2));
    EXPECT_EQ(std::vector<float>(x.data(), x.data() + x.numel()),
              std::vector<float>(x2.data(), x2.data() + x2.numel()));
    EXPECT_EQ(y, y2);
  }
  EXPECT_FALSE(resumed.Next(&x2, &y2));
}

}  // namespace
}  // namespace cpd::runtime
