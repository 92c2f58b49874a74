// Small helpers shared by the benchmark programs.
#pragma once

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

namespace cpd::bench {

// leveldb's db_bench habit: say so when the timings come from an unoptimised build.
inline void WarnIfUnoptimised() {
#if !defined(__OPTIMIZE__) || !defined(NDEBUG)
  std::printf("WARNING: built without optimisation or with assertions; timings are not valid\n");
#endif
}

// The median of `v` (0 for an empty vector).
inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// "a,b,,c" -> {"a", "b", "c"}.
inline std::vector<std::string> SplitList(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t pos = s.find(',', start);
    const std::string item = s.substr(start, pos == std::string::npos ? pos : pos - start);
    if (!item.empty()) out.push_back(item);
    if (pos == std::string::npos) break;
    start = pos + 1;
  }
  return out;
}

}  // namespace cpd::bench
