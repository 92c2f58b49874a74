// The cpd-quant command-line tool, run as a subprocess (CPD_QUANT_PATH is the built binary):
// `info`, `info --list`, `quantize` on raw float32 from stdin, `--stats`, and the error contract
// (exit code 2, exactly one line on stderr, nothing on stdout).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cpd/format.h"
#include "cpd/quantize.h"
#include "tests/cpd/format_test_util.h"
#include "tests/subprocess.h"

#ifndef CPD_QUANT_PATH
#error "CPD_QUANT_PATH must name the cpd-quant binary"
#endif

namespace cpd::test {
namespace {

// Runs cpd-quant with `args`, feeding `input` on stdin.
RunResult RunCli(const std::vector<std::string>& args, const std::string& input = "") {
  return RunProgram(cpd::test::BuiltProgram(CPD_QUANT_PATH), args, input);
}

std::string ToBytes(const std::vector<float>& x) {
  return std::string(reinterpret_cast<const char*>(x.data()), x.size() * 4);
}

std::vector<float> FromBytes(const std::string& s) {
  std::vector<float> x(s.size() / 4);
  std::memcpy(x.data(), s.data(), x.size() * 4);
  return x;
}

size_t Lines(const std::string& s) { return size_t(std::count(s.begin(), s.end(), '\n')); }

// The error contract: exit 2, one line on stderr starting with the tool's name, empty stdout.
void ExpectUsageError(const RunResult& r, const std::string& what) {
  EXPECT_EQ(r.exit_code, 2) << what << "\nstderr: " << r.err;
  EXPECT_EQ(Lines(r.err), 1u) << what << "\nstderr: " << r.err;
  EXPECT_FALSE(r.err.empty() || r.err.back() != '\n') << what;
  EXPECT_EQ(r.err.rfind("cpd-quant: ", 0), 0u) << what << "\nstderr: " << r.err;
  EXPECT_TRUE(r.out.empty()) << what << "\nstdout: " << r.out;
}

// The value printed on a line "key   value".
std::string Field(const std::string& out, const std::string& key) {
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) {
      const size_t v = line.find_first_not_of(' ', key.size());
      return v == std::string::npos ? "" : line.substr(v);
    }
  }
  return "<missing>";
}

TEST(CpdQuantInfo, E4m3) {
  const RunResult r = RunCli({"info", "e4m3"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.err.empty()) << r.err;
  EXPECT_EQ(Field(r.out, "format"), "e4m3");
  EXPECT_EQ(Field(r.out, "bits"), "8");
  EXPECT_EQ(Field(r.out, "max finite"), "448");
  EXPECT_EQ(Field(r.out, "min normal"), "0.015625 (2^-6)");
  EXPECT_EQ(Field(r.out, "min subnormal"), "0.001953125 (2^-9)");
  EXPECT_EQ(Field(r.out, "distinct finite"), "253");
  EXPECT_EQ(r.out.find("values:"), std::string::npos);
}

TEST(CpdQuantInfo, OtherFormats) {
  struct Case {
    const char* spec;
    const char* max;
    const char* distinct;
  };
  for (const Case& c : {Case{"e5m2", "57344", "247"}, Case{"fp16", "65504", "63487"},
                        Case{"bf16", "3.38953139e+38", "65279"}, Case{"e3m0", "8 (2^3)", "13"},
                        Case{"int8", "127", "255"}, Case{"fp134", "1.9375", "255"}}) {
    const RunResult r = RunCli({"info", c.spec});
    ASSERT_EQ(r.exit_code, 0) << c.spec << ": " << r.err;
    EXPECT_EQ(Field(r.out, "max finite"), c.max) << c.spec;
    EXPECT_EQ(Field(r.out, "distinct finite"), c.distinct) << c.spec;
  }
  const RunResult mx = RunCli({"info", "mxfp4"});
  ASSERT_EQ(mx.exit_code, 0);
  EXPECT_EQ(Field(mx.out, "block"), "32");
  EXPECT_NE(Field(mx.out, "scale"), "<missing>");
  // A canonical spelling is printed.
  EXPECT_EQ(Field(RunCli({"info", "fp143:ch:room=2"}).out, "format"), "fp143:room=2:ch");
}

TEST(CpdQuantInfo, E2m1ListPrintsTheFifteenValues) {
  const RunResult r = RunCli({"info", "e2m1", "--list"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const size_t at = r.out.find("values:\n");
  ASSERT_NE(at, std::string::npos) << r.out;
  std::istringstream in(r.out.substr(at + 8));
  std::vector<float> values;
  std::string line;
  while (std::getline(in, line)) values.push_back(std::stof(line));
  const std::vector<float> expected = {-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6};
  EXPECT_EQ(values, expected);
}

TEST(CpdQuantInfo, ListOfEveryOcpFormatMatchesValues) {
  for (const char* spec : {"e4m3", "e5m2", "e3m2", "e2m3", "log4", "int4"}) {
    const RunResult r = RunCli({"info", spec, "--list"});
    ASSERT_EQ(r.exit_code, 0) << spec << ": " << r.err;
    std::istringstream in(r.out.substr(r.out.find("values:\n") + 8));
    std::vector<float> values;
    std::string line;
    while (std::getline(in, line)) values.push_back(std::stof(line));
    EXPECT_EQ(values, *MustParse(spec).Values()) << spec;
  }
}

TEST(CpdQuantQuantize, SameFloatsAsTheLibrary) {
  const std::vector<float> x = Concat(RandomInputs(100000, 8, -12, 10, 448.0f),
                                      {0.0f, -0.0f, 1e30f, -1e30f, 464.0f, 0.0009765625f});
  for (const char* spec : {"e4m3", "e2m1", "bf16", "int8", "mxfp4", "fp134"}) {
    const RunResult r = RunCli({"quantize", "--format", spec}, ToBytes(x));
    ASSERT_EQ(r.exit_code, 0) << spec << ": " << r.err;
    EXPECT_TRUE(r.err.empty()) << r.err;
    ASSERT_EQ(r.out.size(), x.size() * 4) << spec;
    const std::vector<float> got = FromBytes(r.out);
    const std::vector<float> want = Q(MustParse(spec), x);
    MismatchCounter bad(std::string("cpd-quant --format ") + spec);
    for (size_t i = 0; i < x.size(); ++i) {
      if (Bits(got[i]) != Bits(want[i])) {
        bad.Add() << "x = " << Show(x[i]) << ": cli " << Show(got[i]) << ", library "
                  << Show(want[i]);
      }
    }
  }
}

// Per-binade specs: info in canonical spelling, --list equal to Values(), quantize equal to the
// library (and, for fp134's list, to fp134).
TEST(CpdQuantBinades, InfoListAndQuantize) {
  const RunResult info = RunCli({"info", "binades:4,4,4,4,4,4,4,3,2,1,0:ch"});
  ASSERT_EQ(info.exit_code, 0) << info.err;
  EXPECT_EQ(Field(info.out, "format"), "binades:4x7,3,2,1,0:ch");
  EXPECT_EQ(Field(info.out, "bits"), "8");
  EXPECT_EQ(Field(info.out, "max finite"), "1.9375");
  EXPECT_EQ(Field(info.out, "min normal"), "0.015625 (2^-6)");
  EXPECT_EQ(Field(info.out, "min subnormal"), "0.0009765625 (2^-10)");
  EXPECT_EQ(Field(info.out, "distinct finite"), "255");
  EXPECT_NE(Field(info.out, "scale").find("channel"), std::string::npos);
  const RunResult hybrid = RunCli({"info", "binades:5,5,4x5,3,2,1,0"});
  ASSERT_EQ(hybrid.exit_code, 0) << hybrid.err;
  EXPECT_EQ(Field(hybrid.out, "bits"), "9");
  EXPECT_EQ(Field(hybrid.out, "distinct finite"), "319");

  const RunResult list = RunCli({"info", "binades:3,3,3:room=0", "--list"});
  ASSERT_EQ(list.exit_code, 0) << list.err;
  std::istringstream in(list.out.substr(list.out.find("values:\n") + 8));
  std::vector<float> values;
  std::string line;
  while (std::getline(in, line)) values.push_back(std::stof(line));
  EXPECT_EQ(values, *MustParse("binades:3,3,3").Values());
  EXPECT_EQ(values.size(), 49u);

  const std::vector<float> x = Concat(RandomInputs(100000, 9, -20, 3, 1.9375f),
                                      {0.0f, -0.0f, 1e30f, -1e30f, 0.0009765625f, NAN});
  for (const char* rounding : {"nearest", "stochastic"}) {
    const RunResult a = RunCli({"quantize", "--format", "binades:4x7,3,2,1,0:room=0", "--rounding",
                                rounding, "--seed", "4"},
                               ToBytes(x));
    const RunResult b =
        RunCli({"quantize", "--format", "fp134:room=0", "--rounding", rounding, "--seed", "4"},
               ToBytes(x));
    ASSERT_EQ(a.exit_code, 0) << a.err;
    ASSERT_EQ(b.exit_code, 0) << b.err;
    EXPECT_TRUE(a.out == b.out) << rounding << ": binades and fp134 differ";
    QuantizeOptions o;
    o.rounding = *ParseRounding(rounding);
    o.seed = 4;
    const std::vector<float> want = Q(MustParse("binades:4x7,3,2,1,0:room=0"), x, o);
    EXPECT_TRUE(a.out == ToBytes(want)) << rounding << ": cli and library differ";
  }
  const RunResult bad = RunCli({"info", "binades:4,23"});
  ExpectUsageError(bad, "info binades:4,23");
  EXPECT_NE(bad.err.find("mantissa bits must be 0..22"), std::string::npos) << bad.err;
}

// candidates: the enumerator's lists, as a table and as specs that parse back to themselves.
TEST(CpdQuantCandidates, TableAndSpecs) {
  const RunResult table = RunCli({"candidates", "--bits", "8,6"});
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_NE(table.out.find("148 candidates"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("fp134"), std::string::npos);
  EXPECT_NE(table.out.find("binades:4x7,3,2,1,0"), std::string::npos);
  const RunResult specs = RunCli({"candidates", "--bits", "7", "--specs"});
  ASSERT_EQ(specs.exit_code, 0) << specs.err;
  std::istringstream in(specs.out);
  int n = 0;
  for (std::string line; std::getline(in, line); ++n) {
    EXPECT_EQ(MustParse(line).spec(), line);
    EXPECT_EQ(MustParse(line).bits(), 7) << line;
  }
  EXPECT_EQ(n, 58);
  ExpectUsageError(RunCli({"candidates", "--bits", "8,x"}), "candidates --bits 8,x");
  ExpectUsageError(RunCli({"candidates", "--bits", "17"}), "candidates --bits 17");
}

TEST(CpdQuantQuantize, RoundingSeedStepAndChannelsArePassedOn) {
  std::vector<float> x(4096);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (float& v : x) v = normal(rng);
  QuantizeOptions o;
  o.rounding = Rounding::kStochastic;
  o.seed = 77;
  o.step = 5;
  o.channels = 8;
  const RunResult r = RunCli({"quantize", "--format", "int4:ch", "--rounding", "stochastic",
                              "--seed", "77", "--step", "5", "--channels", "8", "--threads", "2"},
                             ToBytes(x));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(FromBytes(r.out) == Q(MustParse("int4:ch"), x, o));
  const RunResult z = RunCli({"quantize", "--format", "e3m2", "--rounding", "zero"}, ToBytes(x));
  ASSERT_EQ(z.exit_code, 0) << z.err;
  o = {};
  o.rounding = Rounding::kZero;
  EXPECT_TRUE(FromBytes(z.out) == Q(MustParse("e3m2"), x, o));
}

TEST(CpdQuantQuantize, EmptyInputGivesEmptyOutput) {
  const RunResult r = RunCli({"quantize", "--format", "e4m3"}, "");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.out.empty());
}

TEST(CpdQuantQuantize, StatsGoToStderr) {
  const std::vector<float> x = {1.0f, 1000.0f, -1e6f, 1e-9f, 0.3f, NAN, INFINITY};
  const RunResult r = RunCli({"quantize", "--format", "e4m3", "--stats"}, ToBytes(x));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // stdout carries only the data.
  ASSERT_EQ(r.out.size(), x.size() * 4);
  const std::vector<float> got = FromBytes(r.out);
  const std::vector<float> want = Q(MustParse("e4m3"), x);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_TRUE(SameResult(got[i], want[i])) << i;
  QuantStats st;
  Q(MustParse("e4m3"), x, {}, &st);
  ASSERT_EQ(st.saturated, 3u);  // 1000, -1e6, Inf
  ASSERT_EQ(st.flushed, 1u);
  ASSERT_EQ(st.nonfinite, 2u);
  EXPECT_EQ(Lines(r.err), 1u) << r.err;
  for (const char* part : {"format e4m3", "rounding nearest", "count 7", "saturated 3", "flushed 1",
                           "nonfinite 2", "max_abs inf", "rel_error"}) {
    EXPECT_NE(r.err.find(part), std::string::npos) << "'" << part << "' missing from: " << r.err;
  }
  // Without --stats, stderr stays empty.
  EXPECT_TRUE(RunCli({"quantize", "--format", "e4m3"}, ToBytes(x)).err.empty());
}

TEST(CpdQuantErrors, BadSpec) {
  for (const char* spec : {"e9m2", "foo", "uint8", "e4m3:bogus", ""}) {
    const std::vector<float> x = {1.0f, 2.0f};
    const RunResult q = RunCli({"quantize", "--format", spec}, ToBytes(x));
    ExpectUsageError(q, std::string("quantize --format '") + spec + "'");
    EXPECT_NE(q.err.find(std::string("'") + spec + "'"), std::string::npos) << q.err;
    ExpectUsageError(RunCli({"info", spec}), std::string("info '") + spec + "'");
  }
}

TEST(CpdQuantErrors, TruncatedInput) {
  for (size_t bytes : {1, 2, 3, 5, 4099}) {
    const RunResult r = RunCli({"quantize", "--format", "e4m3"}, std::string(bytes, '\x3f'));
    ExpectUsageError(r, std::to_string(bytes) + " bytes");
    EXPECT_NE(r.err.find(std::to_string(bytes)), std::string::npos) << r.err;
  }
}

TEST(CpdQuantErrors, BadRounding) {
  const RunResult r = RunCli({"quantize", "--format", "e4m3", "--rounding", "up"}, ToBytes({1.0f}));
  ExpectUsageError(r, "--rounding up");
  EXPECT_NE(r.err.find("'up'"), std::string::npos) << r.err;
}

// Block-scaled formats: --columns sets the row length of the matrix view; info names the block.
TEST(CpdQuantBlockScales, ColumnsArePassedOnAndInfoNamesTheBlock) {
  std::vector<float> x(40 * 24);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (size_t i = 0; i < x.size(); ++i) x[i] = normal(rng) * float(1 + i / 24 % 5 * 100);
  for (const char* spec : {"nvfp4", "nvfp4:2d", "e4m3:block=1x128", "e4m3:block=128x128"}) {
    QuantizeOptions o;
    o.columns = 24;
    const RunResult r = RunCli({"quantize", "--format", spec, "--columns", "24"}, ToBytes(x));
    ASSERT_EQ(r.exit_code, 0) << spec << ": " << r.err;
    EXPECT_TRUE(FromBytes(r.out) == Q(MustParse(spec), x, o)) << spec;
  }
  const RunResult info = RunCli({"info", "e2m1:block=16x16:scale=e4m3:tensor"});
  ASSERT_EQ(info.exit_code, 0) << info.err;
  EXPECT_EQ(Field(info.out, "format"), "nvfp4:2d");
  EXPECT_EQ(Field(info.out, "bits"), "4");
  EXPECT_EQ(Field(info.out, "block"), "16x16");
  EXPECT_NE(Field(info.out, "scale").find("float32 tensor scale"), std::string::npos) << info.out;
}

TEST(CpdQuantErrors, BlockScaledSpecsAndColumns) {
  for (const char* spec : {"e4m3:block=0x16", "e4m3:block=16x", "int8:block=16",
                           "e2m1:block=16:scale=int4", "e2m1:block=16:tensor", "nvfp4:3d"}) {
    ExpectUsageError(RunCli({"quantize", "--format", spec}, ToBytes({1.0f, 2.0f})), spec);
    ExpectUsageError(RunCli({"info", spec}), spec);
  }
  // 6 values are not whole rows of 4.
  const RunResult r = RunCli({"quantize", "--format", "nvfp4", "--columns", "4"},
                             ToBytes({1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f}));
  ExpectUsageError(r, "--columns 4 with 6 values");
  EXPECT_NE(r.err.find("not whole rows of 4 columns"), std::string::npos) << r.err;
  ExpectUsageError(RunCli({"quantize", "--format", "nvfp4", "--columns", "-1"}, ToBytes({1.0f})),
                   "--columns -1");
}

TEST(CpdQuantErrors, ChannelsThatDoNotDivideTheInput) {
  const RunResult r = RunCli({"quantize", "--format", "int8:ch", "--channels", "3"},
                             ToBytes({1.0f, 2.0f, 3.0f, 4.0f}));
  ExpectUsageError(r, "--channels 3 with 4 values");
}

TEST(CpdQuantErrors, BadArguments) {
  ExpectUsageError(RunCli({}), "no subcommand");
  ExpectUsageError(RunCli({"quantize"}), "no --format");
  ExpectUsageError(RunCli({"quantize", "--format", "e4m3", "--bogus"}), "unknown option");
  const RunResult zero = RunCli({"quantize", "--format", "e4m3", "--channels", "0"});
  ExpectUsageError(zero, "--channels 0");
  // In words, in a short line (it was CLI11's "Value 0 not in range 0.000000 to 17976...").
  EXPECT_NE(zero.err.find("--channels: '0' is not accepted: a whole number >= 1"),
            std::string::npos)
      << zero.err;
  EXPECT_LT(zero.err.size(), 100u) << zero.err;
  ExpectUsageError(RunCli({"frobnicate"}), "unknown subcommand");
}

// Channel counts beyond the input are refused with one line (they used to be allocated first:
// exit 134 with std::length_error or std::bad_alloc).
TEST(CpdQuantErrors, ChannelsBeyondTheInputAreRefused) {
  for (const auto& [spec, channels] : std::vector<std::pair<std::string, std::string>>{
           {"int8:ch", "4611686018427387904"}, {"log4:ch", "1000000000000"}, {"int8:ch", "8"}}) {
    const RunResult r = RunCli({"quantize", "--format", spec, "--channels", channels},
                               channels == "8" ? ToBytes({1.0f, 2.0f}) : "");
    ExpectUsageError(r, spec + " --channels " + channels);
    EXPECT_NE(r.err.find("channels"), std::string::npos) << r.err;
  }
}

// --list is for formats of <= 8 bits; asking for more is an error like any other: one line on
// stderr and nothing on stdout (not the info block followed by an error).
TEST(CpdQuantErrors, ListOfAWideFormat) {
  ExpectUsageError(RunCli({"info", "fp16", "--list"}), "info fp16 --list");
}

TEST(CpdQuantHelp, HelpExitsZero) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--help"}, {"-h"}, {"quantize", "--help"}, {"info", "--help"}}) {
    const RunResult r = RunCli(args);
    EXPECT_EQ(r.exit_code, 0) << args[0];
    EXPECT_NE(r.out.find("Usage"), std::string::npos) << r.out;
  }
  const RunResult r = RunCli({"--help"});
  EXPECT_NE(r.out.find("quantize"), std::string::npos);
  EXPECT_NE(r.out.find("mxfp4"), std::string::npos);  // the format grammar is part of the help
}

}  // namespace
}  // namespace cpd::test
