// A run's state file (<run>/state.json): the input is the file's bytes, read as cpd-study's run,
// status and report read it (ReadState). A refusal is a Corruption, one line of printable ASCII
// that names the file and never quotes the file's bytes; an accepted state is one cpd-study
// knows, with times and counts it can add up, and writing it back (WriteState) and reading it
// again gives the same state.
#include <cmath>
#include <cstdint>
#include <string>

#include "launcher/study/run_state.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

bool SameReal(double a, double b) { return a == b || (std::isnan(a) && std::isnan(b)); }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace study = cpd::launcher::study;
  const std::string path = cpd::fuzz::ScratchDir() + "/state.json";
  const std::string again = cpd::fuzz::ScratchDir() + "/again.json";
  cpd::fuzz::WriteFile(path, std::string(reinterpret_cast<const char*>(data), size));
  auto read = study::ReadState(path);
  if (!read.ok()) {
    const std::string& m = read.status().message();
    CPD_FUZZ_CHECK(read.status().code() == cpd::Status::Code::kCorruption, m);
    CPD_FUZZ_CHECK(m.rfind(path + ": unreadable state file (", 0) == 0, m);
    for (unsigned char c : m) CPD_FUZZ_CHECK(c >= 0x20 && c < 0x7f, m);
    return 0;
  }
  const study::RunState& s = *read;
  CPD_FUZZ_CHECK(
      s.state == "running" || s.state == "done" || s.state == "diverged" || s.state == "failed",
      s.state);
  CPD_FUZZ_CHECK(std::isfinite(s.total_wall_s) && s.total_wall_s >= 0, s.state);
  CPD_FUZZ_CHECK(std::isfinite(s.wall_s) && s.wall_s >= 0 && s.attempts >= 0, s.state);
  CPD_FUZZ_CHECK(study::WriteState(again, s).ok(), again);
  auto back = study::ReadState(again);
  CPD_FUZZ_CHECK(back.ok(), back.status().message());
  const study::RunState& b = *back;
  CPD_FUZZ_CHECK(b.state == s.state && b.exit_code == s.exit_code && b.start_ms == s.start_ms &&
                     b.end_ms == s.end_ms && b.attempts == s.attempts && b.host == s.host &&
                     b.pid == s.pid && b.wall_s == s.wall_s && b.total_wall_s == s.total_wall_s,
                 s.state);
  if (s.state == "diverged") {
    CPD_FUZZ_CHECK(b.diverged_step == s.diverged_step && b.diverged_reason == s.diverged_reason,
                   s.diverged_reason);
    CPD_FUZZ_CHECK(
        SameReal(b.diverged_loss, std::isfinite(s.diverged_loss) ? s.diverged_loss : std::nan("")),
        s.state);
  }
  return 0;
}
