// The bound on a thread count a user gives (--threads of every tool, a study's `threads:`).
// Far more OpenMP threads than cores only slows a run down, and past a few thousand libgomp
// fails to create them or the process runs out of stack (--threads 99999 crashed cpd-train):
// the bound refuses such a count before any thread exists. It is 4 x the cores here, and at
// least 64 so that a study planned on a small login node still accepts its compute nodes'
// counts.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <string>

namespace cpd {

inline int MaxThreads() {
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  return static_cast<int>(std::max<long>(64, 4 * std::max<long>(1, cores)));
}

// What MaxThreads accepts, in words for error messages.
inline std::string ThreadsAccepted() {
  return "0 (all cores) or 1.." + std::to_string(MaxThreads()) +
         " (4 x this machine's cores, at least 64)";
}

}  // namespace cpd
