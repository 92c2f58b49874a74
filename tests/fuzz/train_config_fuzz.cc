// cpd-train's --config YAML: the input is the file's text, applied to every cpd-train flag as
// cpd-train applies it (launcher/train_flags.h), then turned into options and checked as
// cpd-train checks them before training. Nothing may crash, throw or exit; every refusal is an
// InvalidArgument that names where it comes from (the config or a flag).
#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "launcher/train_flags.h"
#include "runtime/train/train_options.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  cpd::runtime::TrainOptions o;
  cpd::launcher::TrainFlags f;
  CLI::App app{"cpd-train"};
  cpd::launcher::AddTrainOptions(&app, &o, &f);
  char name[] = "cpd-train";
  char* argv[] = {name, nullptr};
  app.parse(1, argv);
  const std::string yaml(reinterpret_cast<const char*>(data), size);
  cpd::Status s = cpd::launcher::ApplyConfigText(app, yaml, "--config fuzz.yaml");
  if (!s.ok()) {
    CPD_FUZZ_CHECK(s.code() == cpd::Status::Code::kInvalidArgument, s.message());
    CPD_FUZZ_CHECK(s.message().rfind("--config fuzz.yaml: ", 0) == 0, s.message());
    return 0;
  }
  // Files the config names (tokens, certificates) are read here: keep the fuzzer off the disk.
  if (!f.token_file.empty() || !f.tls_ca.empty() || !f.config_path.empty()) return 0;
  s = cpd::launcher::ApplyTrainFlags(app, &f, &o);
  if (!s.ok()) {
    CPD_FUZZ_CHECK(s.code() == cpd::Status::Code::kInvalidArgument, s.message());
    return 0;
  }
  if (!o.resume.empty() && o.resume != "auto") return 0;  // would probe a path
  s = cpd::runtime::ValidateTrainOptions(o);
  CPD_FUZZ_CHECK(s.ok() || s.code() == cpd::Status::Code::kInvalidArgument, s.message());
  return 0;
}
