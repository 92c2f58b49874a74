// cpd-study's study file: the input is the YAML text, parsed and checked as every cpd-study
// command does (ParseStudy: shape, repeated keys, the name, every key a cpd-train flag) and,
// when accepted, expanded into its runs (ExpandPlan: every run through cpd-train's own parser and
// checks). Nothing may crash, throw or exit; every refusal is an InvalidArgument, one line that
// starts with the file's name; an accepted plan has unique run names a folder can hold.
#include <cstdint>
#include <set>
#include <string>

#include "cpd/tag.h"
#include "launcher/study/plan.h"
#include "launcher/study/study_file.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

void CheckRefusal(const cpd::Status& s) {
  CPD_FUZZ_CHECK(s.code() == cpd::Status::Code::kInvalidArgument, s.message());
  CPD_FUZZ_CHECK(s.message().rfind("fuzz.yaml: ", 0) == 0, s.message());
  CPD_FUZZ_CHECK(s.message().find('\n') == std::string::npos, s.message());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace study = cpd::launcher::study;
  const std::string yaml(reinterpret_cast<const char*>(data), size);
  auto parsed = study::ParseStudy(yaml, "fuzz.yaml");
  if (!parsed.ok()) {
    CheckRefusal(parsed.status());
    return 0;
  }
  const study::Study& s = *parsed;
  CPD_FUZZ_CHECK(cpd::IsTag(s.name, cpd::kMaxStudyNameLength) && s.name != "." && s.name != "..",
                 s.name);
  // Flags whose value names a file cpd-train's checks read (tokens, certificates): keep the
  // fuzzer off the disk (a path such as /dev/zero would read forever).
  size_t runs = s.seeds.size();
  for (const auto& a : s.axes) runs *= a.values.size();
  for (const auto& e : s.base) {
    if (e.key.find("token") != std::string::npos || e.key.rfind("tls", 0) == 0) return 0;
  }
  for (const auto& a : s.axes) {
    if (a.name.find("token") != std::string::npos || a.name.rfind("tls", 0) == 0) return 0;
  }
  // Large grids are the planner's own test (PlansATenThousandRunGrid); here they would only
  // slow the search down.
  if (runs > 4096) return 0;
  auto plan = study::ExpandPlan(s);
  if (!plan.ok()) {
    CheckRefusal(plan.status());
    return 0;
  }
  std::set<std::string> names;
  for (size_t i = 0; i < plan->size(); ++i) {
    const study::PlannedRun& r = (*plan)[i];
    CPD_FUZZ_CHECK(r.index == i, r.name);
    CPD_FUZZ_CHECK(cpd::IsTag(r.name, 120), r.name);
    CPD_FUZZ_CHECK(names.insert(r.name).second, r.name);
    CPD_FUZZ_CHECK(r.flags.size() == r.boolean.size(), r.name);
    CPD_FUZZ_CHECK(!r.flags.empty() && r.flags.back().key == "seed", r.name);
  }
  return 0;
}
