// Format spec parsing: accepted specs give the right bits, range, value count, scope and
// canonical spelling; bad specs fail with a message that quotes the spec and names the problem.
#include "cpd/format.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "cpd/quantize.h"
#include "tests/cpd/format_test_util.h"

namespace cpd::test {
namespace {

struct InfoCase {
  std::string spec;
  std::string canonical;
  FormatFamily family;
  ScaleScope scope;
  int bits;
  double max_finite;
  double min_normal;
  double min_subnormal;
  uint64_t distinct;
  size_t block;
};

void PrintTo(const InfoCase& c, std::ostream* os) { *os << c.spec; }

// 2^e.
double P2(int e) { return std::ldexp(1.0, e); }

std::vector<InfoCase> InfoCases() {
  using F = FormatFamily;
  using S = ScaleScope;
  return {
      // Fixed floats.
      {"e4m3", "e4m3", F::kFloat, S::kNone, 8, 448, P2(-6), P2(-9), 253, 0},
      {"e4m3:sat", "e4m3", F::kFloat, S::kNone, 8, 448, P2(-6), P2(-9), 253, 0},
      {"e4m3:inf", "e4m3:inf", F::kFloat, S::kNone, 8, 448, P2(-6), P2(-9), 253, 0},
      {"e4m3:ieee", "e4m3:ieee", F::kFloat, S::kNone, 8, 240, P2(-6), P2(-9), 239, 0},
      {"e5m2", "e5m2", F::kFloat, S::kNone, 8, 57344, P2(-14), P2(-16), 247, 0},
      {"e5m2:inf", "e5m2:inf", F::kFloat, S::kNone, 8, 57344, P2(-14), P2(-16), 247, 0},
      {"e3m2", "e3m2", F::kFloat, S::kNone, 6, 28, 0.25, 0.0625, 63, 0},
      {"e2m3", "e2m3", F::kFloat, S::kNone, 6, 7.5, 1, 0.125, 63, 0},
      {"e2m1", "e2m1", F::kFloat, S::kNone, 4, 6, 1, 0.5, 15, 0},
      {"fp16", "fp16", F::kFloat, S::kNone, 16, 65504, P2(-14), P2(-24), 63487, 0},
      {"fp16:inf", "fp16:inf", F::kFloat, S::kNone, 16, 65504, P2(-14), P2(-24), 63487, 0},
      {"bf16", "bf16", F::kFloat, S::kNone, 16, 3.3895313892515355e38, P2(-126), P2(-133), 65279,
       0},
      {"fp32", "fp32", F::kFloat32, S::kNone, 32, 3.4028234663852886e38, P2(-126), P2(-149),
       (uint64_t(1) << 32) - (uint64_t(1) << 24) - 1, 0},
      {"fp32:nosub", "fp32:nosub", F::kFloat32, S::kNone, 32, 3.4028234663852886e38, P2(-126), 0,
       (uint64_t(1) << 32) - (uint64_t(1) << 24) - 1 - 2 * ((uint64_t(1) << 23) - 1), 0},
      {"e3m0", "e3m0", F::kFloat, S::kNone, 4, 8, 0.25, 0, 13, 0},
      {"e2m0", "e2m0", F::kFloat, S::kNone, 3, 2, 1, 0, 5, 0},
      {"e5m10", "e5m10", F::kFloat, S::kNone, 16, 65504, P2(-14), P2(-24), 63487, 0},
      {"e8m7", "e8m7", F::kFloat, S::kNone, 16, 3.3895313892515355e38, P2(-126), P2(-133), 65279,
       0},
      {"e1m3", "e1m3", F::kFloat, S::kNone, 5, 1.75, 0, 0.25, 15, 0},
      {"e2m5:nosub", "e2m5:nosub", F::kFloat, S::kNone, 8, 3.9375, 1, 0, 129, 0},
      {"e3m3:nosub:inf", "e3m3:inf:nosub", F::kFloat, S::kNone, 7, 15, 0.25, 0, 97, 0},
      {"e8m0", "e8m0", F::kFloat, S::kNone, 9, P2(127), P2(-126), 0, 509, 0},
      {"e8m23", "e8m23", F::kFloat, S::kNone, 32, 3.4028234663852886e38, P2(-126), P2(-149),
       (uint64_t(1) << 32) - (uint64_t(1) << 24) - 1, 0},
      // Shared-exponent 8-bit floats: unit-scale grids with the top binade [1, 2).
      {"fp134", "fp134", F::kSharedShift, S::kTensor, 8, 1.9375, P2(-6), P2(-10), 255, 0},
      {"fp143", "fp143", F::kSharedShift, S::kTensor, 8, 1.875, P2(-14), P2(-17), 255, 0},
      {"fp152", "fp152", F::kSharedShift, S::kTensor, 8, 1.75, P2(-30), P2(-32), 255, 0},
      {"fp134:ch", "fp134:ch", F::kSharedShift, S::kChannel, 8, 1.9375, P2(-6), P2(-10), 255, 0},
      {"fp143:ch:room=2", "fp143:room=2:ch", F::kSharedShift, S::kChannel, 8, 1.875, P2(-14),
       P2(-17), 255, 0},
      {"fp152:room=-3", "fp152:room=-3", F::kSharedShift, S::kTensor, 8, 1.75, P2(-30), P2(-32),
       255, 0},
      {"fp134:room=1", "fp134", F::kSharedShift, S::kTensor, 8, 1.9375, P2(-6), P2(-10), 255, 0},
      // Logarithmic: powers of two 2^(-L+1)..1, L = 2^(b-1)-1, and zero. Per tensor where no
      // layer picks the grouping; :ch and :tensor are explicit.
      {"log2", "log2", F::kSharedShift, S::kTensor, 2, 1, 1, 0, 3, 0},
      {"log4", "log4", F::kSharedShift, S::kTensor, 4, 1, P2(-6), 0, 15, 0},
      {"log5", "log5", F::kSharedShift, S::kTensor, 5, 1, P2(-14), 0, 31, 0},
      {"log8", "log8", F::kSharedShift, S::kTensor, 8, 1, P2(-126), 0, 255, 0},
      {"log4:ch", "log4:ch", F::kSharedShift, S::kChannel, 4, 1, P2(-6), 0, 15, 0},
      {"log4:tensor", "log4:tensor", F::kSharedShift, S::kTensor, 4, 1, P2(-6), 0, 15, 0},
      // Integers.
      {"int8", "int8", F::kIntSymmetric, S::kTensor, 8, 127, 1, 0, 255, 0},
      {"int4:ch", "int4:ch", F::kIntSymmetric, S::kChannel, 4, 7, 1, 0, 15, 0},
      {"int2", "int2", F::kIntSymmetric, S::kTensor, 2, 1, 1, 0, 3, 0},
      {"int16", "int16", F::kIntSymmetric, S::kTensor, 16, 32767, 1, 0, 65535, 0},
      {"uint4:minmax", "uint4:minmax", F::kUintMinMax, S::kTensor, 4, 15, 1, 0, 16, 0},
      {"uint8:minmax:ch", "uint8:minmax:ch", F::kUintMinMax, S::kChannel, 8, 255, 1, 0, 256, 0},
      {"uint8:ch:minmax", "uint8:minmax:ch", F::kUintMinMax, S::kChannel, 8, 255, 1, 0, 256, 0},
      {"uint16:minmax", "uint16:minmax", F::kUintMinMax, S::kTensor, 16, 65535, 1, 0, 65536, 0},
      // MX (OCP v1.0) and block floating point.
      {"mxfp8", "mxfp8", F::kSharedShift, S::kBlock, 8, 448, P2(-6), P2(-9), 253, 32},
      {"mxfp6", "mxfp6", F::kSharedShift, S::kBlock, 6, 7.5, 1, 0.125, 63, 32},
      {"mxfp4", "mxfp4", F::kSharedShift, S::kBlock, 4, 6, 1, 0.5, 15, 32},
      {"bfp8:16", "bfp8:16", F::kSharedShift, S::kBlock, 8, 1.984375, 1, P2(-6), 255, 16},
      {"bfp4:7", "bfp4:7", F::kSharedShift, S::kBlock, 4, 1.75, 1, 0.25, 15, 7},
      {"bfp3:5", "bfp3:5", F::kSharedShift, S::kBlock, 3, 1.5, 1, 0.5, 7, 5},
      {"bfp16:1", "bfp16:1", F::kSharedShift, S::kBlock, 16, 2 - P2(-14), 1, P2(-14), 65535, 1},
      {"bfp8:65536", "bfp8:65536", F::kSharedShift, S::kBlock, 8, 1.984375, 1, P2(-6), 255, 65536},
      // Per-binade lists, top binade [1, 2): 2 * sum 2^M_i + 1 values; "normal" is the top run
      // of binades with the top's mantissa bits, "subnormal" anything below it.
      {"binades:4,4,4,4,4,4,4,3,2,1,0", "binades:4x7,3,2,1,0", F::kBinades, S::kTensor, 8, 1.9375,
       P2(-6), P2(-10), 255, 0},
      {"binades:4x7,3,2,1,0:room=1", "binades:4x7,3,2,1,0", F::kBinades, S::kTensor, 8, 1.9375,
       P2(-6), P2(-10), 255, 0},
      {"binades:4x7,3,2,1,0:ch:room=2", "binades:4x7,3,2,1,0:room=2:ch", F::kBinades, S::kChannel,
       8, 1.9375, P2(-6), P2(-10), 255, 0},
      {"binades:3x15,2,1,0", "binades:3x15,2,1,0", F::kBinades, S::kTensor, 8, 1.875, P2(-14),
       P2(-17), 255, 0},
      {"binades:2x31,1,0:room=-3", "binades:2x31,1,0:room=-3", F::kBinades, S::kTensor, 8, 1.75,
       P2(-30), P2(-32), 255, 0},
      {"binades:6,5,4,3,2,1,0", "binades:6,5,4,3,2,1,0", F::kBinades, S::kTensor, 8, 2 - P2(-6), 1,
       P2(-6), 255, 0},
      {"binades:5,5,4x5,3,2,1,0:room=0", "binades:5,5,4x5,3,2,1,0:room=0", F::kBinades, S::kTensor,
       9, 2 - P2(-5), 0.5, P2(-10), 319, 0},
      {"binades:3,3,3", "binades:3x3", F::kBinades, S::kTensor, 6, 1.875, 0.25, 0, 49, 0},
      {"binades:0", "binades:0", F::kBinades, S::kTensor, 2, 1, 1, 0, 3, 0},
      {"binades:0,0,0,0,0,0,0:room=0:ch", "binades:0x7:room=0:ch", F::kBinades, S::kChannel, 4, 1,
       P2(-6), 0, 15, 0},
      {"binades:0x127", "binades:0x127", F::kBinades, S::kTensor, 8, 1, P2(-126), 0, 255, 0},
      {"binades:1,1x3,0x2,0", "binades:1x4,0x3", F::kBinades, S::kTensor, 5, 1.5, P2(-3), P2(-6),
       23, 0},
      {"binades:14,13", "binades:14,13", F::kBinades, S::kTensor, 16, 2 - P2(-14), 1, P2(-1), 49153,
       0},
  };
}

class FormatInfoTest : public ::testing::TestWithParam<InfoCase> {};

TEST_P(FormatInfoTest, ParsesWithTheRightInfo) {
  const InfoCase& c = GetParam();
  Result<Format> r = Format::Parse(c.spec);
  ASSERT_TRUE(r.ok()) << r.status().message();
  const Format& f = *r;
  EXPECT_EQ(f.spec(), c.canonical);
  EXPECT_EQ(f.family(), c.family);
  EXPECT_EQ(f.scope(), c.scope);
  EXPECT_EQ(f.bits(), c.bits);
  EXPECT_EQ(f.block_size(), c.block);
  const FormatInfo info = f.Info();
  EXPECT_EQ(info.bits, c.bits);
  EXPECT_EQ(info.max_finite, c.max_finite);
  EXPECT_EQ(info.min_normal, c.min_normal);
  EXPECT_EQ(info.min_subnormal, c.min_subnormal);
  EXPECT_EQ(info.distinct_finite, c.distinct);
  EXPECT_EQ(info.scale_note.empty(), c.scope == ScaleScope::kNone);
  // The canonical spelling parses to the same format.
  Result<Format> again = Format::Parse(f.spec());
  ASSERT_TRUE(again.ok()) << again.status().message();
  EXPECT_EQ(again->spec(), f.spec());
  EXPECT_EQ(again->bits(), f.bits());
  EXPECT_EQ(again->Info().max_finite, info.max_finite);
  EXPECT_EQ(again->Info().distinct_finite, info.distinct_finite);
  // Metadata: shared shifts (binades too) one byte, int<b> a float scale, uint<b> min and scale.
  const size_t meta = c.family == FormatFamily::kSharedShift || c.family == FormatFamily::kBinades
                          ? 1
                      : c.family == FormatFamily::kIntSymmetric ? 4
                      : c.family == FormatFamily::kUintMinMax   ? 8
                                                                : 0;
  EXPECT_EQ(f.meta_bytes_per_group(), meta);
}

TEST_P(FormatInfoTest, ValuesAgreeWithInfo) {
  const InfoCase& c = GetParam();
  const Format f = MustParse(c.spec);
  Result<std::vector<float>> values = f.Values();
  if (c.bits > 16) {
    EXPECT_FALSE(values.ok());
    return;
  }
  ASSERT_TRUE(values.ok()) << values.status().message();
  const std::vector<float>& v = *values;
  ASSERT_EQ(v.size(), c.distinct);
  EXPECT_TRUE(std::is_sorted(v.begin(), v.end()));
  EXPECT_TRUE(std::adjacent_find(v.begin(), v.end()) == v.end()) << "duplicates";
  EXPECT_EQ(v.back(), c.max_finite);
  if (c.family != FormatFamily::kUintMinMax) {
    EXPECT_EQ(v.front(), -c.max_finite);
    // Symmetric: the negation of every value is a value.
    for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(v[i], -v[v.size() - 1 - i]);
  } else {
    EXPECT_EQ(v.front(), 0.0f);
  }
  // The smallest positive value.
  const auto pos = std::upper_bound(v.begin(), v.end(), 0.0f);
  ASSERT_NE(pos, v.end());
  const double smallest = c.min_subnormal > 0 ? c.min_subnormal : c.min_normal;
  if (smallest > 0) {
    EXPECT_EQ(*pos, smallest);
  }
}

INSTANTIATE_TEST_SUITE_P(Specs, FormatInfoTest, ::testing::ValuesIn(InfoCases()),
                         [](const ::testing::TestParamInfo<InfoCase>& info) {
                           std::string name = info.param.spec;
                           for (char& ch : name) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return name + "_" + std::to_string(info.index);
                         });

// The headline numbers from the format descriptions.
TEST(FormatParse, HeadlineNumbers) {
  EXPECT_EQ(MustParse("e4m3").Info().max_finite, 448.0);
  EXPECT_EQ(MustParse("e4m3").Info().distinct_finite, 253u);
  EXPECT_EQ(MustParse("e5m2").Info().max_finite, 57344.0);
  EXPECT_EQ(MustParse("e2m1").Info().max_finite, 6.0);
  EXPECT_EQ(MustParse("fp16").Info().max_finite, 65504.0);
  EXPECT_EQ(float(MustParse("bf16").Info().max_finite), 3.3895314e38f);
  EXPECT_EQ(MustParse("e3m0").Info().max_finite, 8.0);
  EXPECT_EQ(MustParse("fp134").Info().max_finite, 1.9375);
  EXPECT_EQ(MustParse("mxfp4").block_size(), 32u);
  EXPECT_EQ(MustParse("mxfp8").block_size(), 32u);
  EXPECT_EQ(MustParse("mxfp6").block_size(), 32u);
}

struct BadCase {
  std::string spec;
  std::string problem;  // a phrase the message must contain
};

void PrintTo(const BadCase& c, std::ostream* os) { *os << "'" << c.spec << "'"; }

class BadSpecTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadSpecTest, FailsNamingSpecAndProblem) {
  const BadCase& c = GetParam();
  Result<Format> r = Format::Parse(c.spec);
  ASSERT_FALSE(r.ok()) << "'" << c.spec << "' was accepted as " << r->spec();
  EXPECT_EQ(r.status().code(), Status::Code::kInvalidArgument);
  const std::string& msg = r.status().message();
  EXPECT_NE(msg.find("'" + c.spec + "'"), std::string::npos) << msg;
  EXPECT_NE(msg.find(c.problem), std::string::npos) << "expected '" << c.problem << "' in: " << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line: " << msg;
}

INSTANTIATE_TEST_SUITE_P(
    Specs, BadSpecTest,
    ::testing::Values(
        BadCase{"e9m2", "exponent bits X must be 1..8"},
        BadCase{"e4m24", "mantissa bits Y must be 0..23"},
        BadCase{"e0m3", "exponent bits X must be 1..8"},
        BadCase{"int1", "int<b> needs 2 <= b <= 16"}, BadCase{"int17", "int<b> needs 2 <= b <= 16"},
        BadCase{"uint8", "needs ':minmax'"}, BadCase{"uint1:minmax", "uint<b> needs 2 <= b <= 16"},
        BadCase{"uint17:minmax", "uint<b> needs 2 <= b <= 16"},
        BadCase{"log9", "log<b> needs 2 <= b <= 8"}, BadCase{"log1", "log<b> needs 2 <= b <= 8"},
        BadCase{"bfp8", "block size"}, BadCase{"bfp8:0", "block size"},
        BadCase{"bfp8:65537", "block size"}, BadCase{"bfp1:4", "bfp<b> needs 2 <= b <= 16"},
        BadCase{"bfp17:4", "bfp<b> needs 2 <= b <= 16"}, BadCase{"e2m1:inf", "':inf' cannot apply"},
        BadCase{"e3m2:inf", "':inf' cannot apply"},
        BadCase{"e4m3:sat:inf", ":sat and :inf exclude each other"},
        BadCase{"e4m3:inf:inf", "given twice"}, BadCase{"foo", "unknown format name 'foo'"},
        BadCase{"", "empty format name"}, BadCase{":inf", "empty format name"},
        BadCase{"e4m3:bogus", "unknown modifier ':bogus'"}, BadCase{"e4m3:", "unknown modifier"},
        BadCase{"fp134:room=9", "room"}, BadCase{"fp134:room=x", "room"},
        BadCase{"fp134:inf", "does not apply"}, BadCase{"int8:minmax", "does not apply"},
        BadCase{"mxfp4:ch", "does not apply"}, BadCase{"log4:room=2", "does not apply"},
        BadCase{"log4:ch:tensor", ":ch and :tensor exclude each other"},
        BadCase{"int8:tensor", "does not apply"}, BadCase{"log4:tensor:tensor", "given twice"},
        BadCase{"e1m0", "no nonzero finite value"},
        BadCase{"e1m2:nosub", "no nonzero finite value"}, BadCase{"E4M3", "unknown format name"},
        BadCase{"e4m3 ", "unknown format name"},
        // binades:M0,M1,...
        BadCase{"binades", "needs a list of mantissa bits"},
        BadCase{"binades:", "needs a list of mantissa bits"},
        BadCase{"binades:room=2", "binades entry 'room=2' is not M"},
        BadCase{"binades:4,,3", "binades entry '' is not M"},
        BadCase{"binades:4,a", "binades entry 'a' is not M"},
        BadCase{"binades:04", "binades entry '04' is not M"},
        BadCase{"binades:4x", "binades entry '4x' is not M"},
        BadCase{"binades:x4", "binades entry 'x4' is not M"},
        BadCase{"binades:23", "mantissa bits must be 0..22"},
        BadCase{"binades:-1", "mantissa bits must be 0..22"},
        BadCase{"binades:0x0", "repeat count K must be 1..127"},
        BadCase{"binades:0x128", "repeat count K must be 1..127"},
        BadCase{"binades:0x100,0x28", "1..127 binades"}, BadCase{"binades:15", "needs 17 bits"},
        BadCase{"binades:3x9,22", "needs 24 bits"}, BadCase{"binades:4:inf", "does not apply"},
        BadCase{"binades:4:16", "does not apply"}, BadCase{"binades:4:room=9", "room"},
        BadCase{"binades:4:ch:ch", "given twice"}, BadCase{"Binades:4", "unknown format name"}),
    [](const ::testing::TestParamInfo<BadCase>& info) {
      return "Bad" + std::to_string(info.index);
    });

// The help text lists every family.
TEST(FormatParse, HelpMentionsEveryFamily) {
  const std::string help = FormatSpecHelp();
  for (const char* word :
       {"fp32",  "bf16",   "fp16",           "eXmY",  "e4m3",   "e5m2",  "e3m2",    "e2m3",
        "e2m1",  "int<b>", "uint<b>:minmax", "fp134", "fp143",  "fp152", "log<b>",  "mxfp8",
        "mxfp6", "mxfp4",  "bfp<b>",         ":inf",  ":nosub", ":sat",  "binades:"}) {
    EXPECT_NE(help.find(word), std::string::npos) << word;
  }
}

// Lists of specs split at commas, except inside a binades list.
TEST(FormatParse, SplitFormatList) {
  using V = std::vector<std::string>;
  EXPECT_EQ(SplitFormatList("fp134,binades:4x7,3,2,1,0,e4m3"),
            (V{"fp134", "binades:4x7,3,2,1,0", "e4m3"}));
  EXPECT_EQ(SplitFormatList("binades:6,5,4,3,2,1,0:ch,binades:3,3,3:room=0,bfp8:16"),
            (V{"binades:6,5,4,3,2,1,0:ch", "binades:3,3,3:room=0", "bfp8:16"}));
  EXPECT_EQ(SplitFormatList(",e4m3,,int8,"), (V{"e4m3", "int8"}));
  EXPECT_EQ(SplitFormatList(""), V{});
  for (const std::string& s : SplitFormatList("binades:4x7,3,2,1,0:room=2,log4")) {
    EXPECT_TRUE(Format::Parse(s).ok()) << s;
  }
}

// Per-channel and per-block group counts, which fix the metadata size.
TEST(FormatParse, NumGroups) {
  EXPECT_EQ(MustParse("e4m3").num_groups(100, 1), 0u);
  EXPECT_EQ(MustParse("int8").num_groups(100, 4), 1u);
  EXPECT_EQ(MustParse("int8:ch").num_groups(100, 4), 4u);
  EXPECT_EQ(MustParse("log4").num_groups(100, 5), 1u);
  EXPECT_EQ(MustParse("log4:tensor").num_groups(100, 5), 1u);
  EXPECT_EQ(MustParse("log4:ch").num_groups(100, 5), 5u);
  EXPECT_EQ(MustParse("mxfp4").num_groups(64, 1), 2u);
  EXPECT_EQ(MustParse("mxfp4").num_groups(65, 1), 3u);
  EXPECT_EQ(MustParse("bfp4:7").num_groups(15, 1), 3u);
  EXPECT_EQ(MustParse("bfp4:7").num_groups(0, 1), 0u);
  EXPECT_EQ(MustParse("binades:3,3,3").num_groups(100, 5), 1u);
  EXPECT_EQ(MustParse("binades:3,3,3:ch").num_groups(100, 5), 5u);
}

// A number written with leading zeros is the same number: "e04m3" is either rejected or the
// same format as "e4m3" (OCP, max 448), never a different one. (It parsed as the IEEE-style
// e4m3:ieee, max 240, under the spelling "e04m3".)
TEST(FormatParse, LeadingZerosDoNotChangeTheFormat) {
  const std::pair<const char*, const char*> aliases[] = {
      {"e04m3", "e4m3"}, {"e4m03", "e4m3"}, {"e02m1", "e2m1"},      {"e3m02", "e3m2"},
      {"e05m2", "e5m2"}, {"int08", "int8"}, {"bfp08:16", "bfp8:16"}};
  for (const auto& [alias, plain] : aliases) {
    Result<Format> r = Format::Parse(alias);
    if (!r.ok()) continue;  // rejecting the spelling is fine
    const Format p = MustParse(plain);
    EXPECT_EQ(r->spec(), p.spec()) << "'" << alias << "' is not spelled canonically";
    EXPECT_EQ(r->Info().max_finite, p.Info().max_finite)
        << "'" << alias << "' is a different format from '" << plain << "'";
    EXPECT_EQ(r->Info().distinct_finite, p.Info().distinct_finite) << alias;
  }
}

// Every family's spellings and refusals, pinned to what Parse gave before it became a table of
// family parsers (issue 27): accepted specs by their canonical spelling, refused ones by their
// whole message. Specs with two faults pin which one is reported (the checks' order).
TEST(FormatParse, CanonicalSpellingsArePinned) {
  const std::pair<const char*, const char*> cases[] = {
      {"fp32", "fp32"},
      {"fp32:sat", "fp32"},
      {"fp32:inf", "fp32:inf"},
      {"fp32:nosub:inf", "fp32:inf:nosub"},
      {"bf16", "bf16"},
      {"bf16:sat:nosub", "bf16:nosub"},
      {"fp16:inf", "fp16:inf"},
      {"e4m3", "e4m3"},
      {"e4m3:ieee", "e4m3:ieee"},
      {"e4m3:inf:ieee", "e4m3:ieee:inf"},
      {"e5m2:sat", "e5m2"},
      {"e3m2:ieee", "e3m2:ieee"},
      {"e2m3:ieee:inf", "e2m3:ieee:inf"},
      {"e2m1:ieee", "e2m1:ieee"},
      {"e1m1", "e1m1"},
      {"e8m23:nosub", "e8m23:nosub"},
      {"e3m3:nosub:inf", "e3m3:inf:nosub"},
      {"fp134:room=1", "fp134"},
      {"fp143:ch:room=2", "fp143:room=2:ch"},
      {"fp152:room=-8", "fp152:room=-8"},
      {"fp134:room=8:ch", "fp134:room=8:ch"},
      {"binades:4,4,4,4,4,4,4,3,2,1,0:room=1", "binades:4x7,3,2,1,0"},
      {"binades:1,1,0:ch", "binades:1,1,0:ch"},
      {"binades:2x2,2:room=-1", "binades:2x3:room=-1"},
      {"binades:3x1,3x1,3x1", "binades:3x3"},
      {"log2", "log2"},
      {"log8:ch", "log8:ch"},
      {"log4:tensor", "log4:tensor"},
      {"mxfp8", "mxfp8"},
      {"mxfp6", "mxfp6"},
      {"mxfp4", "mxfp4"},
      {"bfp2:1", "bfp2:1"},
      {"bfp16:65536", "bfp16:65536"},
      {"int2:ch", "int2:ch"},
      {"int16", "int16"},
      {"uint2:minmax", "uint2:minmax"},
      {"uint16:ch:minmax", "uint16:minmax:ch"},
  };
  for (const auto& [spec, canonical] : cases) {
    Result<Format> r = Format::Parse(spec);
    ASSERT_TRUE(r.ok()) << spec << ": " << r.status().ToString();
    EXPECT_EQ(r->spec(), canonical) << spec;
  }
}

TEST(FormatParse, RefusalMessagesArePinned) {
  // What every message ends with, in parentheses.
  const std::string accepted =
      "accepted: fp32, bf16, fp16, eXmY (1<=X<=8, 0<=Y<=23), e4m3, e5m2, e3m2, e2m3, e2m1, "
      "int<b>[:ch], uint<b>:minmax[:ch] (2<=b<=16), fp134|fp143|fp152[:room=N][:ch], "
      "log<b>[:ch|:tensor] (2<=b<=8), mxfp8|mxfp6|mxfp4, bfp<b>:<block> (2<=b<=16), "
      "binades:M0,M1,...[:room=N][:ch] (mantissa bits 0..22 per binade from the top, MxK for K "
      "binades of M bits, 1..127 binades, at most 16 bits); float modifiers :sat (default) :inf "
      ":nosub :ieee; block scales: nvfp4[:2d], "
      "FLOAT:block=RxC|tensor[:scale=fp32|e8m0|FLOAT][:tensor]";
  const std::pair<const char*, const char*> cases[] = {
      {"", "empty format name"},
      {":ch", "empty format name"},
      {"e4m3:", "unknown modifier ':'"},
      {"foo:bogus", "unknown modifier ':bogus'"},
      {"foo:ch", "unknown format name 'foo'"},
      {"fp135", "unknown format name 'fp135'"},
      {"mxfp5", "unknown format name 'mxfp5'"},
      {"E4M3", "unknown format name 'E4M3'"},
      {"e4m3:sat:inf:bogus", "unknown modifier ':bogus'"},
      {"e4m3:inf:inf", "modifier ':inf' given twice"},
      {"e4m3:tensor:ch", ":ch and :tensor exclude each other"},
      {"e4m3:sat:inf", ":sat and :inf exclude each other"},
      {"e9m2:ch", "exponent bits X must be 1..8"},
      {"e-1m3", "exponent bits X must be 1..8"},
      {"e04m3", "unknown format name 'e04m3'"},
      {"e4m24", "mantissa bits Y must be 0..23"},
      {"e4m3:ch", "modifier ':ch' does not apply to 'e4m3'"},
      {"e2m1:inf", "'e2m1' has no Inf or NaN code, so ':inf' cannot apply"},
      {"e2m1:inf:ch", "modifier ':ch' does not apply to 'e2m1'"},
      {"e1m0", "this format has no nonzero finite value"},
      {"e1m2:nosub", "with :nosub this format has no nonzero finite value"},
      {"fp32:ieee", "modifier ':ieee' does not apply to 'fp32'"},
      {"fp134:room=9", "':room=9' needs an integer room in -8..8"},
      {"fp134:room=02", "':room=02' needs an integer room in -8..8"},
      {"fp134:16", "modifier ':<block>' does not apply to 'fp134'"},
      {"fp134:room=2:room=3", "modifier ':room' given twice"},
      {"fp143:inf", "modifier ':inf' does not apply to 'fp143'"},
      {"binades",
       "binades needs a list of mantissa bits per binade, top binade first, e.g. "
       "binades:4x7,3,2,1,0"},
      {"binades:15:bogus",
       "binades list needs 17 bits (sign + ceil(log2(1 + sum 2^Mi))), at most 16 are accepted"},
      {"binades:4x0", "binades entry '4x0': the repeat count K must be 1..127"},
      {"binades:0x100,0x28", "binades takes 1..127 binades, this list has more"},
      {"binades:15",
       "binades list needs 17 bits (sign + ceil(log2(1 + sum 2^Mi))), at most 16 are accepted"},
      {"binades:4:tensor", "modifier ':tensor' does not apply to 'binades'"},
      {"log9:room=2", "modifier ':room' does not apply to 'log9'"},
      {"log9", "log<b> needs 2 <= b <= 8"},
      {"log-2", "log<b> needs 2 <= b <= 8"},
      {"log4:ch:tensor", ":ch and :tensor exclude each other"},
      {"mxfp4:ch", "modifier ':ch' does not apply to 'mxfp4'"},
      {"bfp8", "bfp<b> needs a block size ':N' with 1 <= N <= 65536"},
      {"bfp1", "bfp<b> needs 2 <= b <= 16"},
      {"bfp1:4", "bfp<b> needs 2 <= b <= 16"},
      {"bfp8:ch", "modifier ':ch' does not apply to 'bfp8'"},
      {"bfp8:65537", "bfp<b> needs a block size ':N' with 1 <= N <= 65536"},
      {"uint8", "uint<b> needs ':minmax'"},
      {"uint1", "uint<b> needs ':minmax'"},
      {"uint17:minmax", "uint<b> needs 2 <= b <= 16"},
      {"int8:minmax", "modifier ':minmax' does not apply to 'int8'"},
      {"int1", "int<b> needs 2 <= b <= 16"},
      {"int08", "unknown format name 'int08'"},
  };
  for (const auto& [spec, why] : cases) {
    Result<Format> r = Format::Parse(spec);
    ASSERT_FALSE(r.ok()) << "'" << spec << "' was accepted as " << r->spec();
    EXPECT_EQ(r.status().code(), Status::Code::kInvalidArgument) << spec;
    EXPECT_EQ(r.status().message(),
              "bad format spec '" + std::string(spec) + "': " + why + " (" + accepted + ")");
  }
}

}  // namespace
}  // namespace cpd::test
