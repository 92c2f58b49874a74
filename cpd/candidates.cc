#include "cpd/candidates.h"

#include <algorithm>
#include <charconv>
#include <cstddef>

#include "cpd/format.h"
#include "kernels/grid.h"

namespace cpd {
namespace {

// The list p (a times), p-1 (c times), p-2, ..., 0; for p = 0, a zeros.
std::vector<int> Shape(int p, int a, int c) {
  std::vector<int> m(size_t(a), p);
  if (p == 0) return m;
  m.insert(m.end(), size_t(c), p - 1);
  for (int t = p - 2; t >= 0; --t) m.push_back(t);
  return m;
}

std::string ListText(const std::vector<int>& mbits) {
  std::string s;
  for (int m : mbits) s += (s.empty() ? "" : ",") + std::to_string(m);
  return s;
}

// "fixed8", "fp134", "log8"; hybrids keep their canonical list ("5,4x5,3,2,1,0").
std::string Name(const std::string& spec, const std::string& family, int bits, int p, int a) {
  if (family == "fixed") return "fixed" + std::to_string(bits);
  if (family == "log") return "log" + std::to_string(bits);
  if (family == "float") {
    int e = 0;
    while ((1 << e) - 1 < a) ++e;  // a = 2^e - 1 under the code budget
    return "fp1" + std::to_string(e) + std::to_string(p);
  }
  return spec.substr(spec.find(':') + 1);
}

}  // namespace

std::string BinadeFamily(const std::vector<int>& m) {
  if (m.empty()) return "binades";
  const int p = m.front();
  size_t i = 0;
  while (i < m.size() && m[i] == p) ++i;
  if (p == 0) return "log";
  // The tail must run p-1 (once or more), then p-2, ..., 0, one binade each.
  size_t step = 0;
  while (i < m.size() && m[i] == p - 1) ++i, ++step;
  if (step == 0) return "binades";
  for (int t = p - 2; t >= 0; --t, ++i) {
    if (i >= m.size() || m[i] != t) return "binades";
  }
  if (i != m.size()) return "binades";
  const size_t plateau = m.size() - step - size_t(p - 1);
  if (step > 1) return "hybrid";
  return plateau == 1 ? "fixed" : "float";
}

Result<std::vector<BinadeCandidate>> EnumerateBinadeCandidates(int bits) {
  if (bits < 2 || bits > 16) {
    return Status::InvalidArgument("candidate bit width " + std::to_string(bits) +
                                   " is outside 2..16");
  }
  std::vector<BinadeCandidate> out;
  for (int p = bits - 2; p >= 0; --p) {
    const int room = 1 << (bits - p);  // 2a + c + 1 (p > 0), or a + 1 (p = 0)
    const int max_a = p == 0 ? room / 2 - 1 : (room - 2) / 2;
    const int min_a = p == 0 ? max_a : 1;
    for (int a = min_a; a <= max_a; ++a) {
      const int c = room - 1 - 2 * a;
      const std::vector<int> mbits = Shape(p, a, c);
      if (mbits.size() > size_t(kernels::kMaxBinades)) continue;
      auto format = Format::Parse("binades:" + ListText(mbits));
      if (!format.ok()) return format.status();  // a rule above is wrong: say so
      BinadeCandidate cand;
      cand.spec = format->spec();
      cand.bits = bits;
      cand.family = BinadeFamily(mbits);
      cand.name = Name(cand.spec, cand.family, bits, p, a);
      cand.mbits = mbits;
      out.push_back(std::move(cand));
    }
  }
  return out;
}

Result<std::vector<BinadeCandidate>> EnumerateBinadeCandidates(std::string_view widths) {
  std::vector<BinadeCandidate> all;
  size_t start = 0;
  while (start <= widths.size()) {
    const size_t comma = std::min(widths.find(',', start), widths.size());
    const std::string_view w = widths.substr(start, comma - start);
    int bits = 0;
    const auto [end, ec] = std::from_chars(w.data(), w.data() + w.size(), bits);
    if (w.empty() || ec == std::errc::invalid_argument || end != w.data() + w.size()) {
      return Status::InvalidArgument("'" + std::string(w) + "' is not a whole number");
    }
    if (ec == std::errc::result_out_of_range) bits = -1;  // reported as outside 2..16
    CPD_ASSIGN_OR_RETURN(std::vector<BinadeCandidate> list, EnumerateBinadeCandidates(bits));
    all.insert(all.end(), list.begin(), list.end());
    start = comma + 1;
  }
  if (all.empty()) return Status::InvalidArgument("no bit width given");
  return all;
}

}  // namespace cpd
