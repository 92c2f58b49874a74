// cpd-format-search --resume: the partial-results file (runtime/search/search_files.h), read as
// the search reads it. The first byte picks the site sets (bits 1-3), the layer count (bits 4-5)
// and whether the settings line and header of this search come first (bit 0: so that the fuzzer
// reaches the rows without having to find a CRC), or, with bit 6, the text is a
// --candidates-file instead. Nothing may crash; a refusal is one InvalidArgument line naming the
// file, and short; an accepted file holds only rows a search could have written (candidates of
// the search, once each, bits and family of the spec, every angle finite in [0, 180]), which
// written again read back the same.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/search/search_files.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using namespace cpd::runtime;

constexpr char kPath[] = "search.partial.csv";

// A refusal: InvalidArgument, one line that starts with `name`, short even for a huge input.
void CheckRefusal(const cpd::Status& s, const std::string& name) {
  CPD_FUZZ_CHECK(s.code() == cpd::Status::Code::kInvalidArgument, s.message());
  CPD_FUZZ_CHECK(s.message().find('\n') == std::string::npos, s.message());
  CPD_FUZZ_CHECK(s.message().rfind(name, 0) == 0, s.message());
  CPD_FUZZ_CHECK(s.message().size() < 800, s.message());
}

void Candidates(const std::string& text) {
  const auto r = ParseCandidateList("c.txt", text);
  if (!r.ok()) return CheckRefusal(r.status(), "c.txt");
  CPD_FUZZ_CHECK(!r->empty(), "an accepted list names a format");
  int line = 0;
  for (const CandidateLine& c : *r) {
    CPD_FUZZ_CHECK(c.line > line, "lines in order");
    line = c.line;
    CPD_FUZZ_CHECK(!c.spec.empty() && c.spec.find('#') == std::string::npos, c.spec);
    CPD_FUZZ_CHECK(c.spec.front() != ' ' && c.spec.back() != ' ', c.spec);
    for (char ch : c.spec) CPD_FUZZ_CHECK(ch != '\n' && ch != '\0', c.spec);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  cpd::fuzz::Input in(data, size);
  const uint8_t mode = in.Take<uint8_t>();
  const std::string rest = in.Rest();
  if (mode & 0x40) {
    Candidates(rest);
    return 0;
  }
  FormatSearchOptions o;
  o.candidates = {"int8", "e4m3", "binades:4x7,3,2,1,0", "fp32", "bfp8:16"};
  o.indicator.sites.clear();
  const SiteSet all[] = {SiteSet::kA, SiteSet::kE, SiteSet::kAE};
  for (int s = 0; s < 3; ++s) {
    if (mode & (2 << s)) o.indicator.sites.push_back(all[s]);
  }
  if (o.indicator.sites.empty()) o.indicator.sites = {SiteSet::kA};
  o.settings = R"({"batches":2,"checkpoint_crc32":"0x01020304","seed":1})";
  const std::vector<std::string> names = {"fc1", "conv2", "fc3"};
  const std::vector<std::string> layers(names.begin(), names.begin() + ((mode >> 4) & 3));
  std::string text = rest;
  if (mode & 1) {
    text =
        PartialSettingsLine(o) + "\n" + ResultsCsvHeader(layers, o.indicator.sites) + "\n" + rest;
  }
  const auto r = ParsePartialResults(kPath, text, o, layers);
  if (!r.ok()) {
    CheckRefusal(r.status(), kPath);
    return 0;
  }
  CPD_FUZZ_CHECK(r->complete_bytes <= text.size(), "within the text");
  CPD_FUZZ_CHECK(r->complete_bytes > 0 && text[r->complete_bytes - 1] == '\n',
                 "the complete rows end with a newline");
  std::string again =
      PartialSettingsLine(o) + "\n" + ResultsCsvHeader(layers, o.indicator.sites) + "\n";
  for (const CandidateResult& row : r->rows) {
    const auto f = cpd::Format::Parse(row.spec);
    CPD_FUZZ_CHECK(f.ok() && f->spec() == row.spec, row.spec);
    CPD_FUZZ_CHECK(row.bits == f->bits() && row.family == CandidateFamily(*f), row.spec);
    for (SiteSet s : o.indicator.sites) {
      std::vector<double> values = {row.mean[int(s)], row.std[int(s)]};
      values.insert(values.end(), row.layer_mean[int(s)].begin(), row.layer_mean[int(s)].end());
      values.insert(values.end(), row.layer_std[int(s)].begin(), row.layer_std[int(s)].end());
      CPD_FUZZ_CHECK(row.layer_mean[int(s)].size() == layers.size(), row.spec);
      for (double v : values) CPD_FUZZ_CHECK(v >= 0.0 && v <= 180.0, std::to_string(v));
    }
    again += ResultCsvRow(row, o.indicator.sites) + "\n";
  }
  const auto back = ParsePartialResults(kPath, again, o, layers);
  CPD_FUZZ_CHECK(back.ok(), back.status().ToString());
  CPD_FUZZ_CHECK(back->rows.size() == r->rows.size(), "the same rows");
  for (size_t i = 0; i < r->rows.size(); ++i) {
    const CandidateResult &a = r->rows[i], &b = back->rows[i];
    CPD_FUZZ_CHECK(a.spec == b.spec && a.bits == b.bits && a.family == b.family, a.spec);
    for (SiteSet s : o.indicator.sites) {
      CPD_FUZZ_CHECK(a.mean[int(s)] == b.mean[int(s)] && a.std[int(s)] == b.std[int(s)], a.spec);
      CPD_FUZZ_CHECK(a.layer_mean[int(s)] == b.layer_mean[int(s)], a.spec);
      CPD_FUZZ_CHECK(a.layer_std[int(s)] == b.layer_std[int(s)], a.spec);
    }
  }
  return 0;
}
