// The files a format search reads (runtime/search/search_files.h), issue 26 items 7 and 8: a
// candidates file that names no format, is no text or no regular file is refused; every row of a
// partial file is checked (numbers whole, finite, in [0, 180] degrees; bits and family those of
// the spec; a known candidate, once), and the file is bound to the search's settings and
// candidates. Every refusal is one line naming the file and the line.
#include "runtime/search/search_files.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>
#include <string>
#include <vector>

#include "tests/temp_dir.h"

namespace cpd::runtime {
namespace {

FormatSearchOptions Options() {
  FormatSearchOptions o;
  o.candidates = {"int8", "e4m3", "binades:4x7,3,2,1,0"};
  o.indicator.sites = {SiteSet::kA, SiteSet::kAE};
  o.settings = R"({"batches":2,"checkpoint_crc32":"0x01020304","seed":1})";
  return o;
}

const std::vector<std::string> kLayers = {"fc1", "fc2"};

CandidateResult Made(const std::string& spec, int bits, const std::string& family, double deg) {
  CandidateResult r;
  r.spec = spec;
  r.bits = bits;
  r.family = family;
  for (SiteSet s : {SiteSet::kA, SiteSet::kAE}) {
    r.has[int(s)] = true;
    r.mean[int(s)] = deg;
    r.std[int(s)] = 0.25;
    r.layer_mean[int(s)] = {deg / 2, 1.0 / 3.0};
    r.layer_std[int(s)] = {0.0, 1e-9};
  }
  return r;
}

std::string Row(const CandidateResult& r) {
  return ResultCsvRow(r, {SiteSet::kA, SiteSet::kAE}) + "\n";
}

// A partial file as a search with Options() writes it, with two finished candidates.
std::string GoodFile() {
  const FormatSearchOptions o = Options();
  return PartialSettingsLine(o) + "\n" + ResultsCsvHeader(kLayers, o.indicator.sites) + "\n" +
         Row(Made("int8", 8, "int", 1.5)) + Row(Made("binades:4x7,3,2,1,0", 8, "float", 2.5));
}

// `text` with the first `from` after `after` replaced by `to`.
std::string Replace(std::string text, const std::string& from, const std::string& to,
                    size_t after = 0) {
  const size_t at = text.find(from, after);
  EXPECT_NE(at, std::string::npos) << from;
  return text.replace(at, from.size(), to);
}

void ExpectRefused(const std::string& text, const std::string& needle) {
  const auto r = ParsePartialResults("s.partial.csv", text, Options(), kLayers);
  ASSERT_FALSE(r.ok()) << needle;
  EXPECT_EQ(r.status().code(), Status::Code::kInvalidArgument);
  EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  EXPECT_EQ(r.status().message().find('\n'), std::string::npos) << r.status().message();
}

TEST(PartialResults, AFileOfThisSearchReadsBack) {
  const std::string text = GoodFile();
  const auto r = ParsePartialResults("s.partial.csv", text, Options(), kLayers);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->rows.size(), 2u);
  EXPECT_EQ(r->rows[0].spec, "int8");
  EXPECT_EQ(r->rows[1].mean[int(SiteSet::kAE)], 2.5);
  EXPECT_EQ(r->rows[1].layer_mean[int(SiteSet::kA)][1], 1.0 / 3.0);
  EXPECT_EQ(r->complete_bytes, text.size());
  // The order of the candidates does not matter.
  FormatSearchOptions o = Options();
  o.candidates = {"binades:4x7,3,2,1,0", "e4m3", "int8"};
  EXPECT_TRUE(ParsePartialResults("p", text, o, kLayers).ok());
}

// A crash can cut the last row short (rows are appended whole, but a disk may keep part of one):
// that row is left out, and where the complete rows end is reported so that it can be cut off.
TEST(PartialResults, ATornLastRowIsLeftOut) {
  const std::string text = GoodFile();
  const size_t last = text.rfind('\n', text.size() - 2) + 1;
  const std::string torn = text.substr(0, last + (text.size() - last) / 2);
  const auto r = ParsePartialResults("s.partial.csv", torn, Options(), kLayers);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->rows.size(), 1u);
  EXPECT_EQ(r->complete_bytes, last);
  // A complete last row (ended by its newline) with a bad value is not torn: refused.
  ExpectRefused(torn + "\n", "s.partial.csv:4: ");
}

TEST(PartialResults, ImpossibleValuesAreRefusedWithTheLine) {
  const std::string text = GoodFile();
  const size_t row3 = text.find("\"int8\"");
  ExpectRefused(Replace(text, ",1.5,", ",-1,", row3), "s.partial.csv:3: A_deg is '-1'");
  ExpectRefused(Replace(text, ",1.5,", ",-45,", row3), "[0, 180] degrees");
  ExpectRefused(Replace(text, ",1.5,", ",500,", row3), "A_deg is '500'");
  ExpectRefused(Replace(text, ",1.5,", ",nan,", row3), "A_deg is 'nan'");
  ExpectRefused(Replace(text, ",1.5,", ",inf,", row3), "A_deg is 'inf'");
  ExpectRefused(Replace(text, ",0.25,", ",-0.5,", row3), "A_std is '-0.5'");
  ExpectRefused(Replace(text, ",0.75,", ",180.5,", row3), "fc1:A_deg is '180.5'");
  ExpectRefused(Replace(text, ",1.5,", ",1.5x,", row3), "A_deg '1.5x' is not a number");
  ExpectRefused(Replace(text, ",1.5,", ", 1.5,", row3), "is not a number");
  ExpectRefused(Replace(text, ",1.5,", ",,", row3), "A_deg '' is not a number");
  ExpectRefused(Replace(text, ",1.5,", ",\x01\xff,", row3), "'\\x01\\xff' is not a number");
  ExpectRefused(Replace(text, ",8,int,", ",7,int,"), ":3: bits 7 do not match int8");
  ExpectRefused(Replace(text, ",8,int,", ",8x,int,"), "bits '8x' is not a whole number");
  ExpectRefused(Replace(text, ",8,int,", ",99999999999,int,"), "is not a whole number");
  ExpectRefused(Replace(text, ",8,int,", ",8,bogus,"), "family 'bogus' is unknown");
  ExpectRefused(Replace(text, ",8,int,", ",8,float,"), "family float does not match int8");
  ExpectRefused(Replace(text, "\"int8\"", "\"e9m9\""), ":3: spec 'e9m9' is not a format spec");
  ExpectRefused(Replace(text, "\"int8\"", "\"int4\""), "bits 8 do not match int4");
  ExpectRefused(Replace(text, ",8,int,", ",8,int,1,"), ":3: a row of");
}

TEST(PartialResults, ACandidateHasOneRowAndBelongsToTheSearch) {
  const std::string text = GoodFile();
  ExpectRefused(text + Row(Made("int8", 8, "int", 3.0)),
                "s.partial.csv:5: 'int8' has a row on line 3 already");
  ExpectRefused(text + Row(Made("int4", 4, "int", 3.0)),
                "s.partial.csv:5: 'int4' is not a candidate of this search");
}

TEST(PartialResults, AFileOfAnotherSearchOrAnOlderToolIsRefused) {
  const std::string text = GoodFile();
  // The checkpoint's contents, a setting, the candidates: each named, with both values.
  ExpectRefused(Replace(text, "0x01020304", "0x0a0b0c0d"),
                "the checkpoint's contents (checkpoint_crc32) '0x0a0b0c0d' there, '0x01020304' "
                "here");
  ExpectRefused(Replace(text, "\"batches\":2", "\"batches\":3"), "batches 3 there, 2 here");
  FormatSearchOptions more = Options();
  more.candidates.push_back("e5m2");
  const auto r = ParsePartialResults("s.partial.csv", text, more, kLayers);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("the candidates (candidates) 3 there, 4 here"),
            std::string::npos)
      << r.status().message();
  FormatSearchOptions other = Options();
  other.candidates[1] = "e5m2";
  const auto r2 = ParsePartialResults("s.partial.csv", text, other, kLayers);
  ASSERT_FALSE(r2.ok());
  EXPECT_NE(r2.status().message().find("candidates_crc32"), std::string::npos);
  // A partial file of the cpd-format-search before issue 26: its settings named the checkpoint
  // by path only.
  const std::string old =
      "# cpd-format-search: {\"batches\":2,\"checkpoint\":\"ck.cpd\",\"seed\":1}\n" +
      text.substr(text.find('\n') + 1);
  ExpectRefused(old, "written by an older cpd-format-search");
  ExpectRefused(old, "rerun without --resume");
  ExpectRefused("# another search\n", "s.partial.csv:1: not a cpd-format-search partial file");
  ExpectRefused(std::string("\0\x01\x02", 3), "(its first line is '\\0\\x01\\x02')");
  ExpectRefused(std::string(100000, 'x'), "'xxxxxxxx");
  ExpectRefused("# cpd-format-search: [1]\n", ":1: the settings line is not a JSON object");
  ExpectRefused("", "is empty or ends before its column header");
  ExpectRefused(text.substr(0, text.find('\n') + 1), "ends before its column header");
  ExpectRefused(Replace(text, "fc2:A_deg", "fc9:A_deg"), ":2: the column header is not this");
}

TEST(CandidateList, SpecsWithTheirLinesAndNothingElse) {
  const auto r = ParseCandidateList(
      "c.txt", "# two lists and a named format\nbinades:4x7,3,2,1,0\n\n  e4m3 # fp8\r\n\tint8");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->size(), 3u);
  EXPECT_EQ((*r)[0].spec, "binades:4x7,3,2,1,0");
  EXPECT_EQ((*r)[0].line, 2);
  EXPECT_EQ((*r)[1].spec, "e4m3");
  EXPECT_EQ((*r)[1].line, 4);
  EXPECT_EQ((*r)[2].spec, "int8");
  for (const std::string text : {"", "\n\n", "# nothing\n  # here\n", "   \t\r\n"}) {
    const auto e = ParseCandidateList("c.txt", text);
    ASSERT_FALSE(e.ok()) << text;
    EXPECT_NE(e.status().message().find("c.txt names no format"), std::string::npos);
  }
  const auto bin = ParseCandidateList("c.txt", std::string("e4m3\nint8\0\x7f", 11));
  ASSERT_FALSE(bin.ok());
  EXPECT_EQ(bin.status().message(),
            "c.txt:2: byte '\\0' at column 5: not a text file of format specs");
}

TEST(ReadBoundedFile, OnlyRegularFilesUpToTheLimit) {
  test::TempDir dir("search_files_test");
  const std::string file = dir.File("c.txt");
  std::ofstream(file) << "e4m3\n";
  EXPECT_EQ(ReadBoundedFile(file, 100, "f").value(), "e4m3\n");
  EXPECT_EQ(ReadBoundedFile(file, 5, "f").value(), "e4m3\n");
  auto expect = [](const Result<std::string>& r, const std::string& needle) {
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), Status::Code::kInvalidArgument);
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  };
  expect(ReadBoundedFile(file, 4, "--candidates-file 'c.txt'"),
         "--candidates-file 'c.txt' is 5 bytes; at most 4 are read");
  expect(ReadBoundedFile(dir.path(), 100, "f"), "f is a directory");
  expect(ReadBoundedFile("/dev/zero", 100, "f"), "f is not a regular file");
  expect(ReadBoundedFile(dir.File("none"), 100, "f"), "f: cannot open it");
  const std::string fifo = dir.File("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect(ReadBoundedFile(fifo, 100, "f"), "f is not a regular file");  // without blocking
}

}  // namespace
}  // namespace cpd::runtime
