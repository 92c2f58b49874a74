// Small helpers that more than one of the launcher's programs (cpd-train, cpd-coordinator,
// cpdctl) uses; nothing here needs CLI11 or gRPC.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace cpd::launcher {

// Milliseconds since the Unix epoch (the wall clock, comparable across machines).
int64_t NowMs();

// The non-empty items of a comma-separated list: "a,,b" -> {"a", "b"}.
std::vector<std::string> SplitCommas(const std::string& s);

}  // namespace cpd::launcher
