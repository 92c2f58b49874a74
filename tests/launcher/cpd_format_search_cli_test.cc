// cpd-format-search as a user runs it (CPD_FORMAT_SEARCH_PATH, with cpd-train making the
// checkpoint): bad input is one line and exit 2 before any work, with nothing written; a search
// ranks its candidates and writes the CSV, the JSON and the PNG, and removes its partial file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
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
    const RunResult r = RunProgram(
        BuiltProgram(CPD_TRAIN_PATH),
        {"--dataset", "synthetic", "--arch", "mlp", "--epochs", "1", "--max-steps", "6",
         "--checkpoint-dir", dir_->File("ck"), "--quiet", "--no-progress"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    checkpoint_ = new std::string(dir_->File("ck/ckpt-000000000006.cpd"));
    ASSERT_TRUE(Exists(*checkpoint_));
  }
  static void TearDownTestSuite() {
    delete checkpoint_;
    delete dir_;
  }
  static RunResult Search(std::vector<std::string> args) {
    std::vector<std::string> all = {"--checkpoint", *checkpoint_, "--dataset", "synthetic",
                                    "--arch", "mlp", "--no-progress", "--threads", "1"};
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
};

TEST_F(CpdFormatSearchCli, BadInputIsOneLineAndExitTwoBeforeAnyWork) {
  const std::string out = dir_->File("bad");
  ExpectUsage(Search({"--format", "e9m9", "--out", out}), "e9m9");
  ExpectUsage(Search({"--format", "e4m3", "--batches", "0", "--out", out}), "--batches");
  ExpectUsage(Search({"--format", "e4m3", "--sites", "A,W", "--out", out}), "--sites");
  ExpectUsage(Search({"--bits", "1", "--out", out}), "--bits");
  ExpectUsage(Search({"--bits", "8x", "--out", out}), "'8x' is not a whole number");
  // The checkpoint of another model or data set.
  ExpectUsage(
      RunProgram(BuiltProgram(CPD_FORMAT_SEARCH_PATH),
                 {"--checkpoint", *checkpoint_, "--dataset", "synthetic", "--arch", "lenet5",
                  "--format", "e4m3", "--out", out}),
      "--arch mlp");
  ExpectUsage(RunProgram(BuiltProgram(CPD_FORMAT_SEARCH_PATH),
                         {"--checkpoint", dir_->File("nope.cpd"), "--dataset", "synthetic",
                          "--arch", "mlp", "--format", "e4m3", "--out", out}),
              "nope.cpd");
  for (const char* ext : {".csv", ".json", ".png", ".partial.csv"}) {
    EXPECT_FALSE(Exists(out + ext)) << ext;
  }
}

TEST_F(CpdFormatSearchCli, RanksTheCandidatesAndWritesItsFiles) {
  const std::string out = dir_->File("s");
  const RunResult r = Search({"--format", "int4", "--format", "fp134", "--format", "e4m3",
                              "--format", "int8", "--batches", "2", "--batch-size", "32",
                              "--group", "3", "--out", out});
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
  ExpectUsage(Search({"--format", "e4m3", "--out", out + "2", "--resume"}), "other settings");
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

}  // namespace
}  // namespace cpd::test
