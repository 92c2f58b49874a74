// The format search (runtime/search/format_search.h) under mpirun at world sizes 1-3: a
// candidate's angles do not depend on how many ranks share the candidates or how they are
// grouped, and a resumed search finishes with the results of one that never stopped.
#include "runtime/search/format_search.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "runtime/nn/models.h"
#include "tests/mpi_test_main.h"
#include "tests/temp_dir.h"

namespace cpd::runtime {
namespace {

using test::World;

struct Trained {
  std::unique_ptr<Sequential> model;
  Dataset train;
};

Trained Make() {
  Trained s;
  s.train = MakeSynthetic(128, 1, 28, 28, 10, 11).value();
  Normalize(&s.train, ComputeChannelStats(s.train));
  s.model = BuildModel("lenet5", 1, 28, 10, 2).value();
  return s;
}

FormatSearchOptions Options() {
  FormatSearchOptions o;
  o.candidates = {"e4m3", "e5m2", "int8", "int4", "fp134", "e3m2"};
  o.batches = 3;
  o.batch_size = 16;
  o.group = 2;
  o.progress = false;
  o.indicator.e_rounding = Rounding::kStochastic;
  o.indicator.seed = 5;
  o.settings = R"({"test":1})";
  return o;
}

void ExpectSame(const std::vector<CandidateResult>& a, const std::vector<CandidateResult>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t c = 0; c < a.size(); ++c) {
    EXPECT_EQ(a[c].spec, b[c].spec);
    for (int s = 0; s < kNumSiteSets; ++s) {
      EXPECT_EQ(a[c].mean[s], b[c].mean[s]) << a[c].spec << " site " << s;
      EXPECT_EQ(a[c].std[s], b[c].std[s]) << a[c].spec << " site " << s;
      EXPECT_EQ(a[c].layer_mean[s], b[c].layer_mean[s]) << a[c].spec << " site " << s;
    }
  }
}

// Rank 0's temporary directory, named on every rank.
std::string SharedDir(const test::TempDir& mine) {
  std::string path = mine.path();
  uint64_t len = path.size();
  EXPECT_TRUE(World()->BroadcastBytes(reinterpret_cast<uint8_t*>(&len), sizeof len, 0).ok());
  path.resize(len);
  EXPECT_TRUE(World()->BroadcastBytes(reinterpret_cast<uint8_t*>(path.data()), len, 0).ok());
  return path;
}

TEST(FormatSearch, ResultsDoNotDependOnTheRanksOrTheGrouping) {
  Trained s = Make();
  const FormatSearchOptions o = Options();
  auto spread = RunFormatSearch(s.model.get(), Device::kCpu, s.train, World(), o);
  ASSERT_TRUE(spread.ok()) << spread.status().ToString();
  if (World()->rank() != 0) {
    EXPECT_TRUE(spread->empty());
    return;
  }
  ASSERT_EQ(spread->size(), o.candidates.size());
  comm::SelfCommunicator self;
  FormatSearchOptions alone = o;
  alone.group = 5;
  auto single = RunFormatSearch(s.model.get(), Device::kCpu, s.train, &self, alone);
  ASSERT_TRUE(single.ok()) << single.status().ToString();
  ExpectSame(*spread, *single);
  for (const auto& r : *spread) EXPECT_GT(r.mean[int(SiteSet::kAE)], 0.0) << r.spec;
}

TEST(FormatSearch, AResumedSearchEndsWithTheResultsOfAnUninterruptedOne) {
  Trained s = Make();
  test::TempDir temp("cpd_format_search_test");
  const std::string dir = SharedDir(temp);
  FormatSearchOptions o = Options();
  auto straight = RunFormatSearch(s.model.get(), Device::kCpu, s.train, World(), o);
  ASSERT_TRUE(straight.ok());

  // A first run, cut back to what a run killed while appending its second round leaves: the
  // settings, the header, the first round's rows and part of a row.
  FormatSearchOptions first = o;
  first.partial_path = dir + "/search.partial.csv";
  ASSERT_TRUE(RunFormatSearch(s.model.get(), Device::kCpu, s.train, World(), first).ok());
  if (World()->rank() == 0) {
    std::ifstream in(first.partial_path);
    std::string kept, line;
    for (int i = 0; i < 4 && std::getline(in, line); ++i) kept += line + "\n";
    std::getline(in, line);
    kept += line.substr(0, line.size() / 2);
    std::ofstream(first.partial_path, std::ios::trunc) << kept;
  }
  EXPECT_TRUE(World()->Barrier().ok());
  // Without --resume the file is not touched.
  FormatSearchOptions again = o;
  again.partial_path = first.partial_path;
  const auto refused = RunFormatSearch(s.model.get(), Device::kCpu, s.train, World(), again);
  EXPECT_EQ(refused.status().code(), Status::Code::kInvalidArgument);
  // Resumed: the remaining candidates are evaluated, the finished ones read back.
  again.resume = true;
  auto resumed = RunFormatSearch(s.model.get(), Device::kCpu, s.train, World(), again);
  ASSERT_TRUE(resumed.ok()) << resumed.status().ToString();
  if (World()->rank() == 0) ExpectSame(*straight, *resumed);
  // The torn row was cut off before the rows that followed it: the file reads back whole.
  auto twice = RunFormatSearch(s.model.get(), Device::kCpu, s.train, World(), again);
  ASSERT_TRUE(twice.ok()) << twice.status().ToString();
  if (World()->rank() == 0) ExpectSame(*straight, *twice);
  // Another search's file is refused on every rank.
  FormatSearchOptions other = again;
  other.settings = R"({"test":2})";
  EXPECT_EQ(RunFormatSearch(s.model.get(), Device::kCpu, s.train, World(), other).status().code(),
            Status::Code::kInvalidArgument);
  EXPECT_TRUE(World()->Barrier().ok());
}

TEST(FormatSearch, BadOptionsAreRefusedBeforeAnyWork) {
  FormatSearchOptions o = Options();
  o.candidates.push_back("e9m9");
  EXPECT_EQ(CheckFormatSearch(o).code(), Status::Code::kInvalidArgument);
  o = Options();
  o.candidates.push_back("e4m3");
  EXPECT_NE(CheckFormatSearch(o).message().find("twice"), std::string::npos);
  o = Options();
  o.batches = 0;
  EXPECT_NE(CheckFormatSearch(o).message().find("--batches"), std::string::npos);
  o = Options();
  o.candidates.clear();
  EXPECT_FALSE(CheckFormatSearch(o).ok());
  o = Options();
  o.settings = "not json";
  EXPECT_FALSE(CheckFormatSearch(o).ok());
}

TEST(FormatSearch, CsvRowsReadBackExactly) {
  CandidateResult r;
  r.spec = "binades:4,4,3,2,1,0";
  r.bits = Format::Parse(r.spec).value().bits();
  r.family = "float";
  const std::vector<SiteSet> sites = {SiteSet::kE, SiteSet::kAE};
  for (SiteSet s : sites) {
    r.has[int(s)] = true;
    r.mean[int(s)] = 1.0 / 3.0 + int(s);
    r.std[int(s)] = 0.1;
    r.layer_mean[int(s)] = {0.5, 2.0 / 7.0};
    r.layer_std[int(s)] = {0.0, 1e-9};
  }
  const std::string row = ResultCsvRow(r, sites);
  const std::vector<std::string> layers = {"fc1", "fc2"};
  auto back = ParseResultRow(row, layers, sites);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ExpectSame({r}, {*back});
  EXPECT_EQ(back->spec, r.spec);
  EXPECT_FALSE(ParseResultRow(row.substr(0, row.size() / 2), layers, sites).ok());
}

}  // namespace
}  // namespace cpd::runtime
