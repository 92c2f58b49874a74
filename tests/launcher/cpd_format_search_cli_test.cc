// cpd-format-search as a user runs it (CPD_FORMAT_SEARCH_PATH, with cpd-train making the
// checkpoint): bad input is one line and exit 2 before any work, with nothing written; a search
// ranks its candidates and writes the CSV, the JSON and the PNG, and removes its partial file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tests/subprocess.h"
#include "tests/temp_dir.h"

#if !defined(CPD_FORMAT_SEARCH_PATH) || !defined(CPD_TRAIN_PATH)
#error "CPD_FORMAT_SEARCH_PATH and CPD_TRAIN_PATH must name the built binaries"
#endif

namespace cpd::test {
namespace {

bool Exists(const std::string& p) { return access(p.c_str(), F_OK) == 0; }

class CpdFormatSearchCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir("cpd_format_search_cli");
    const RunResult r =
        RunProgram(BuiltProgram(CPD_TRAIN_PATH),
                   {"--dataset", "synthetic", "--arch", "mlp", "--epochs", "1", "--max-steps", "6",
                    "--checkpoint-dir", dir_->File("ck"), "--quiet", "--no-progress"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    checkpoint_ = new std::string(dir_->File("ck/ckpt-000000000006.cpd"));
    ASSERT_TRUE(Exists(*checkpoint_));
    // Another model of the same architecture, for a checkpoint swapped under the same name.
    const RunResult other = RunProgram(
        BuiltProgram(CPD_TRAIN_PATH),
        {"--dataset", "synthetic", "--arch", "mlp", "--epochs", "1", "--max-steps", "3", "--seed",
         "2", "--checkpoint-dir", dir_->File("ck2"), "--quiet", "--no-progress"});
    ASSERT_EQ(other.exit_code, 0) << other.err;
    other_checkpoint_ = new std::string(dir_->File("ck2/ckpt-000000000003.cpd"));
    ASSERT_TRUE(Exists(*other_checkpoint_));
  }
  static void TearDownTestSuite() {
    delete checkpoint_;
    delete other_checkpoint_;
    delete dir_;
  }
  static RunResult Search(std::vector<std::string> args) {
    return SearchOn(*checkpoint_, std::move(args));
  }
  static RunResult SearchOn(const std::string& checkpoint, std::vector<std::string> args) {
    std::vector<std::string> all = {"--checkpoint",  checkpoint,  "--dataset",
                                    "synthetic",     "--arch",    "mlp",
                                    "--no-progress", "--threads", "1"};
    all.insert(all.end(), args.begin(), args.end());
    return RunProgram(BuiltProgram(CPD_FORMAT_SEARCH_PATH), all);
  }
  static void ExpectUsage(const RunResult& r, const std::string& needle) {
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
  static inline TempDir* dir_ = nullptr;
  static inline std::string* checkpoint_ = nullptr;
  static inline std::string* other_checkpoint_ = nullptr;
};

TEST_F(CpdFormatSearchCli, BadInputIsOneLineAndExitTwoBeforeAnyWork) {
  const std::string out = dir_->File("bad");
  ExpectUsage(Search({"--format", "e9m9", "--out", out}), "e9m9");
  ExpectUsage(Search({"--format", "e4m3", "--batches", "0", "--out", out}), "--batches");
  ExpectUsage(Search({"--format", "e4m3", "--sites", "A,W", "--out", out}), "--sites");
  ExpectUsage(Search({"--bits", "1", "--out", out}), "--bits");
  ExpectUsage(Search({"--bits", "8x", "--out", out}), "'8x' is not a whole number");
  // The checkpoint of another model or data set.
  ExpectUsage(RunProgram(BuiltProgram(CPD_FORMAT_SEARCH_PATH),
                         {"--checkpoint", *checkpoint_, "--dataset", "synthetic", "--arch",
                          "lenet5", "--format", "e4m3", "--out", out}),
              "--arch mlp");
  ExpectUsage(RunProgram(BuiltProgram(CPD_FORMAT_SEARCH_PATH),
                         {"--checkpoint", dir_->File("nope.cpd"), "--dataset", "synthetic",
                          "--arch", "mlp", "--format", "e4m3", "--out", out}),
              "nope.cpd");
  for (const char* ext : {".csv", ".json", ".png", ".partial.csv"}) {
    EXPECT_FALSE(Exists(out + ext)) << ext;
  }
}

// A search's log (stdout a file): a progress line at most every tenth of the rounds and the
// last round's, never a '\r'; no bar is offered.
TEST_F(CpdFormatSearchCli, ProgressLinesAreATenthOfTheRoundsAtMost) {
  const std::string out = dir_->File("progress");
  std::vector<std::string> args = {"--checkpoint",
                                   *checkpoint_,
                                   "--dataset",
                                   "synthetic",
                                   "--arch",
                                   "mlp",
                                   "--threads",
                                   "1",
                                   "--bits",
                                   "6",
                                   "--group",
                                   "1",
                                   "--batches",
                                   "1",
                                   "--batch-size",
                                   "8",
                                   "--no-plot",
                                   "--progress",
                                   "lines",
                                   "--progress-interval",
                                   "0",
                                   "--out",
                                   out};
  const RunResult r = RunProgram(BuiltProgram(CPD_FORMAT_SEARCH_PATH), args);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  size_t lines = 0, rounds = 0;
  std::istringstream in(r.out);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("  round ", 0) != 0) continue;
    ++lines;
    rounds = std::stoul(line.substr(line.find('/') + 1));
  }
  ASSERT_GT(rounds, 10u) << r.out;         // enough rounds for the bound to matter
  const size_t tenth = (rounds + 9) / 10;  // a line every `tenth` rounds, and the last
  EXPECT_EQ(lines, (rounds + tenth - 1) / tenth) << r.out;
  EXPECT_LE(lines, 10u) << r.out;
  EXPECT_NE(r.out.find("  round " + std::to_string(rounds) + "/" + std::to_string(rounds) + ":"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find('\r'), std::string::npos) << r.out;

  args.back() = dir_->File("progress_bar");
  args[args.size() - 5] = "bar";
  ExpectUsage(RunProgram(BuiltProgram(CPD_FORMAT_SEARCH_PATH), args), "--progress bar");
}

TEST_F(CpdFormatSearchCli, RanksTheCandidatesAndWritesItsFiles) {
  const std::string out = dir_->File("s");
  const RunResult r =
      Search({"--format", "int4", "--format", "fp134", "--format", "e4m3", "--format", "int8",
              "--batches", "2", "--batch-size", "32", "--group", "3", "--out", out});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("wrote " + out + ".csv"), std::string::npos) << r.out;
  EXPECT_FALSE(Exists(out + ".partial.csv"));
  EXPECT_TRUE(Exists(out + ".png")) << r.out;
  std::ifstream csv(out + ".csv");
  std::string line;
  std::getline(csv, line);
  EXPECT_EQ(line.rfind("rank,spec,bits,family,A_deg,A_std,E_deg,E_std,A+E_deg,A+E_std", 0), 0u)
      << line;
  int rows = 0;
  while (std::getline(csv, line)) ++rows;
  EXPECT_EQ(rows, 4);
  std::ifstream js(out + ".json");
  const nlohmann::json doc = nlohmann::json::parse(js);
  ASSERT_EQ(doc["candidates"].size(), 4u);
  double previous = -1;
  for (const auto& c : doc["candidates"]) {
    const double a = c["angles"]["A+E"]["mean_deg"].get<double>();
    EXPECT_GE(a, previous) << "ranked by the A+E angle";
    previous = a;
  }
  EXPECT_EQ(doc["layers"].size(), 3u);  // fc1, fc2, fc3
  // A second search with the same prefix while a partial file exists needs --resume.
  { std::ofstream(out + "2.partial.csv") << "# another search\n"; }
  ExpectUsage(Search({"--format", "e4m3", "--out", out + "2"}), "--resume");
  ExpectUsage(Search({"--format", "e4m3", "--out", out + "2", "--resume"}),
              "not a cpd-format-search partial file");
}

// Issue 26 items 2 and 15: an empty --out wrote a hidden ./.csv; outputs never replace a file
// the tool did not write (a second search over its own files still does); threads and seeds
// are bounded.
TEST_F(CpdFormatSearchCli, OutputsNeverReplaceAUsersFile) {
  ExpectUsage(Search({"--format", "e4m3", "--out", ""}), "--out '' is not accepted");
  ExpectUsage(Search({"--format", "e4m3", "--out", dir_->path()}), "is not accepted: a path");
  ExpectUsage(Search({"--format", "e4m3", "--out", dir_->File("x") + "/"}), "is not accepted");
  ExpectUsage(Search({"--format", "e4m3", "--threads", "99999", "--out", dir_->File("t")}),
              "--threads");
  ExpectUsage(Search({"--format", "e4m3", "--seed", "-1", "--out", dir_->File("t")}), "--seed");
  const std::string mine = dir_->File("mine");
  { std::ofstream(mine + ".csv") << "my,own,table\n1,2,3\n"; }
  ExpectUsage(Search({"--format", "e4m3", "--batches", "1", "--out", mine}),
              "mine.csv' exists and was not written by cpd-format-search");
  std::ifstream kept(mine + ".csv");
  std::string line;
  std::getline(kept, line);
  EXPECT_EQ(line, "my,own,table");
  const std::string again = dir_->File("again");
  for (int i = 0; i < 2; ++i) {
    const RunResult r = Search(
        {"--format", "e4m3", "--batches", "1", "--batch-size", "16", "--no-plot", "--out", again});
    EXPECT_EQ(r.exit_code, 0) << r.err;
  }
}

// Issue 26 item 8: a candidate list that names nothing, or a file that is no list, is refused;
// the default search (--bits 8) runs only when no candidate flag is given at all. (The small
// --batches keeps a search that wrongly runs short, so that the test fails fast.)
TEST_F(CpdFormatSearchCli, CandidateListsThatNameNothingAreRefused) {
  const std::string out = dir_->File("none");
  const std::vector<std::string> quick = {"--sites", "A",         "--batches", "1", "--batch-size",
                                          "8",       "--no-plot", "--out",     out};
  auto with = [&](std::vector<std::string> args) {
    args.insert(args.end(), quick.begin(), quick.end());
    return Search(args);
  };
  const std::string empty = dir_->File("empty.txt"), comments = dir_->File("comments.txt");
  const std::string binary = dir_->File("binary.txt"), big = dir_->File("big.txt");
  std::ofstream{empty};
  std::ofstream(comments) << "# no format here\n\n   # nor here\n";
  std::ofstream(binary) << std::string("e4m3\nint8\0\x01\x02", 12);
  {
    std::ofstream b(big);
    for (int i = 0; i < 300000; ++i) b << "e4m3\n";
  }
  ExpectUsage(with({"--candidates-file", empty}), "names no format (it is empty");
  ExpectUsage(with({"--candidates-file", comments}), "names no format");
  ExpectUsage(with({"--candidates-file", dir_->path()}), "is a directory");
  ExpectUsage(with({"--candidates-file", "/dev/zero"}), "'/dev/zero' is not a regular file");
  ExpectUsage(with({"--candidates-file", binary}), "binary.txt':2: byte '\\0' at column 5");
  ExpectUsage(with({"--candidates-file", big}), "is 1500000 bytes; at most 1048576 are read");
  ExpectUsage(with({"--candidates-file", ""}), "--candidates-file '': cannot open it");
  ExpectUsage(with({"--bits", ""}), "--bits is empty");
  ExpectUsage(with({"--bits", std::string("8\x01") + std::string(500, '9')}), "--bits '8\\x01999");
  ExpectUsage(with({"--format", std::string(5000, 'z')}), "'zzzz");
  for (const char* ext : {".csv", ".json", ".partial.csv"}) {
    EXPECT_FALSE(Exists(out + ext)) << ext;
  }
}

// Issue 26 item 7: --resume checks every row of the partial file, and the file is bound to the
// checkpoint's contents and the search's settings.
TEST_F(CpdFormatSearchCli, ResumeChecksEveryRowAndTheCheckpointsContents) {
  namespace fs = std::filesystem;
  const std::string ck = dir_->File("resume.cpd"), out = dir_->File("r");
  fs::copy_file(*checkpoint_, ck);
  const std::vector<std::string> args = {
      "--format", "int8",         "--format", "e4m3",      "--sites", "A", "--batches",
      "1",        "--batch-size", "16",       "--no-plot", "--out",   out};
  auto search = [&](std::vector<std::string> more) {
    std::vector<std::string> all = args;
    all.insert(all.end(), more.begin(), more.end());
    return SearchOn(ck, all);
  };
  // A search that stops after its last row, as a killed one does: its JSON cannot be written (a
  // directory holds the name), so the partial file stays.
  fs::create_directory(out + ".json");
  const RunResult stopped = search({});
  ASSERT_EQ(stopped.exit_code, 1) << stopped.err;
  fs::remove(out + ".json");
  const std::string partial = out + ".partial.csv";
  const std::string good = ReadFile(partial);
  ASSERT_EQ(std::count(good.begin(), good.end(), '\n'), 4) << good;
  const size_t row3 = good.find("\"int8\"");
  ASSERT_NE(row3, std::string::npos) << good;
  auto edited = [&](const std::string& from, const std::string& to) {
    std::string text = good;
    const size_t at = text.find(from, row3);
    EXPECT_NE(at, std::string::npos) << from;
    text.replace(at, from.size(), to);
    return text;
  };
  const size_t a_deg = good.find(",int,", row3) + 4;  // the comma after the family
  const std::string angle = good.substr(a_deg, good.find(',', a_deg + 1) - a_deg + 1);
  const std::vector<std::pair<std::string, std::string>> bad_rows = {
      {edited(angle, ",-1,"), "r.partial.csv:3: A_deg is '-1': an angle lies in [0, 180]"},
      {edited(angle, ",nan,"), ":3: A_deg is 'nan'"},
      {edited(angle, ",500,"), ":3: A_deg is '500'"},
      {edited(",8,int,", ",4,int,"), ":3: bits 4 do not match int8"},
      {edited(",8,int,", ",8,zebra,"), ":3: family 'zebra' is unknown"},
      {good + good.substr(row3, good.find('\n', row3) + 1 - row3),
       ":5: 'int8' has a row on line 3"},
  };
  for (const auto& [text, needle] : bad_rows) {
    { std::ofstream(partial, std::ios::trunc) << text; }
    ExpectUsage(search({"--resume"}), needle);
  }
  { std::ofstream(partial, std::ios::trunc) << good; }
  // Other settings, other candidates: named, with both values.
  ExpectUsage(search({"--resume", "--seed", "7"}), "seed 1 there, 7 here");
  ExpectUsage(search({"--resume", "--format", "e5m2"}), "the candidates (candidates) 2 there, 3");
  // Another model under the checkpoint's name.
  fs::copy_file(*other_checkpoint_, ck, fs::copy_options::overwrite_existing);
  ExpectUsage(search({"--resume"}), "the checkpoint's contents (checkpoint_");
  fs::copy_file(*checkpoint_, ck, fs::copy_options::overwrite_existing);
  // A partial file of the cpd-format-search before the binding (the checkpoint by path only).
  {
    std::ofstream(partial, std::ios::trunc)
        << "# cpd-format-search: {\"a_rounding\":\"nearest\",\"arch\":\"mlp\",\"batch_size\":16,"
           "\"batches\":1,\"checkpoint\":\""
        << ck << "\"}\n"
        << good.substr(good.find('\n') + 1);
  }
  ExpectUsage(search({"--resume"}), "older cpd-format-search");
  // The good file, with its last row torn by a crash: that candidate runs again.
  { std::ofstream(partial, std::ios::trunc) << good.substr(0, good.size() - 10); }
  const RunResult resumed = search({"--resume"});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  std::ifstream csv(out + ".csv");
  std::string line;
  int rows = 0;
  while (std::getline(csv, line)) ++rows;
  EXPECT_EQ(rows, 1 + 2);
  EXPECT_FALSE(Exists(partial));
}

// --bits enumerates cpd-quant's candidates; a candidates file takes binades lists (commas and
// all) one per line; the families come out in the CSV.
TEST_F(CpdFormatSearchCli, EnumeratedAndFileCandidates) {
  const std::string out = dir_->File("bits6");
  const RunResult r = Search({"--bits", "6", "--sites", "A+E", "--batches", "1", "--batch-size",
                              "16", "--no-plot", "--out", out});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::ifstream csv(out + ".csv");
  std::string line;
  std::getline(csv, line);
  std::map<std::string, int> families;
  int rows = 0;
  while (std::getline(csv, line)) {
    ++rows;
    // rank,spec,bits,family,...: a binades spec is quoted (it holds commas).
    const size_t close = line.find("\",", 0);
    ASSERT_NE(close, std::string::npos) << line;
    const size_t bits_end = line.find(',', close + 2);
    families[line.substr(bits_end + 1, line.find(',', bits_end + 1) - bits_end - 1)]++;
  }
  EXPECT_EQ(rows, 27);
  EXPECT_EQ(families["fixed"], 1);
  EXPECT_EQ(families["float"], 3);  // fp123, fp132, fp141
  EXPECT_EQ(families["log"], 1);
  EXPECT_EQ(families["hybrid"], 22);

  const std::string file = dir_->File("candidates.txt");
  std::ofstream(file) << "# two lists and a named format\nbinades:4x7,3,2,1,0\n"
                         "  binades:5,4x5,3,2,1,0  # a hybrid\n\ne4m3\nfp134:room=1\n";
  const RunResult f = Search({"--candidates-file", file, "--sites", "A", "--batches", "1",
                              "--batch-size", "16", "--no-plot", "--out", out + "f"});
  ASSERT_EQ(f.exit_code, 0) << f.err;
  std::ifstream fcsv(out + "f.csv");
  rows = 0;
  while (std::getline(fcsv, line)) ++rows;
  EXPECT_EQ(rows, 1 + 4);  // the header; fp134 and fp134:room=1 are one format
}

// A language model (issue 28): the search takes cpd-train's shape flags, reads the token
// windows of --dataset text and ranks formats over every quantisable layer of a GPT, the
// attention products included. Shape flags are refused with an image model, a shape that does
// not match the checkpoint names it, and bad sizes are one line before any work.
TEST_F(CpdFormatSearchCli, RanksFormatsForALanguageModel) {
  const std::vector<std::string> shape = {"--arch",    "gpt", "--dataset",    "text",
                                          "--n-layer", "1",   "--n-head",     "2",
                                          "--n-embd",  "16",  "--block-size", "16"};
  std::vector<std::string> train = shape;
  for (const char* a : {"--tokens-per-epoch", "4096", "--batch-size", "16", "--epochs", "1",
                        "--optimizer", "adamw", "--quiet", "--no-progress", "--threads", "1"}) {
    train.push_back(a);
  }
  train.insert(train.end(), {"--checkpoint-dir", dir_->File("lm_ck")});
  const RunResult trained = RunProgram(BuiltProgram(CPD_TRAIN_PATH), train);
  ASSERT_EQ(trained.exit_code, 0) << trained.err;
  const std::string ck = dir_->File("lm_ck/ckpt-000000000016.cpd");
  ASSERT_TRUE(Exists(ck));

  const std::string out = dir_->File("lm");
  std::vector<std::string> args = shape;
  for (const char* a : {"--format", "e4m3", "--format", "e5m2", "--format", "bf16", "--batches",
                        "2", "--batch-size", "4", "--threads", "1", "--no-progress", "--no-plot"}) {
    args.push_back(a);
  }
  args.insert(args.end(), {"--checkpoint", ck, "--out", out});
  const RunResult r = RunProgram(BuiltProgram(CPD_FORMAT_SEARCH_PATH), args);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::ifstream js(out + ".json");
  const nlohmann::json doc = nlohmann::json::parse(js);
  ASSERT_EQ(doc["candidates"].size(), 3u);
  std::set<std::string> layers;
  for (const auto& l : doc["layers"]) layers.insert(l.get<std::string>());
  for (const char* l : {"h0.attn.c_attn", "h0.attn.qk", "h0.attn.pv", "h0.mlp.c_fc"}) {
    EXPECT_TRUE(layers.count(l)) << l;
  }
  EXPECT_EQ(doc["settings"]["lm"]["n_embd"], 16) << doc["settings"].dump();
  for (const auto& c : doc["candidates"]) {
    const double a = c["angles"]["A+E"]["mean_deg"].get<double>();
    EXPECT_TRUE(a >= 0 && a <= 90) << c.dump();
  }
  // bf16 keeps 8 bits of mantissa and fp32's range: the smallest angle of the three.
  EXPECT_EQ(doc["candidates"][0]["spec"], "bf16") << doc["candidates"].dump();

  // A shape that is not the checkpoint's.
  std::vector<std::string> wrong = args;
  wrong[std::find(wrong.begin(), wrong.end(), "--n-embd") - wrong.begin() + 1] = "32";
  wrong.back() = dir_->File("lm_wrong");
  const RunResult mismatch = RunProgram(BuiltProgram(CPD_FORMAT_SEARCH_PATH), wrong);
  EXPECT_NE(mismatch.exit_code, 0);
  EXPECT_NE(mismatch.err.find(ck), std::string::npos) << mismatch.err;
  // Shape flags with an image model, heads on an LSTM, sizes out of bounds.
  ExpectUsage(Search({"--n-layer", "2", "--format", "e4m3", "--out", dir_->File("x")}),
              "--n-layer applies to language models");
  ExpectUsage(RunProgram(BuiltProgram(CPD_FORMAT_SEARCH_PATH),
                         {"--checkpoint", ck, "--arch", "lstm", "--dataset", "text", "--n-head",
                          "2", "--format", "e4m3", "--out", dir_->File("x")}),
              "--n-head applies to --arch gpt");
  ExpectUsage(RunProgram(BuiltProgram(CPD_FORMAT_SEARCH_PATH),
                         {"--checkpoint", ck, "--arch", "gpt", "--dataset", "text", "--n-embd",
                          "100000", "--format", "e4m3", "--out", dir_->File("x")}),
              "--n-embd 100000");
  ExpectUsage(RunProgram(BuiltProgram(CPD_FORMAT_SEARCH_PATH),
                         {"--checkpoint", ck, "--arch", "gpt", "--dataset", "fashion-mnist",
                          "--format", "e4m3", "--out", dir_->File("x")}),
              "needs --dataset text or tokens");
}

}  // namespace
}  // namespace cpd::test
