#include "cpd/accumulate.h"

#include <charconv>
#include <vector>

#include "cpd/format.h"

namespace cpd {

namespace {

Status Bad(std::string_view spec, const std::string& why) {
  return Status::InvalidArgument("bad accumulation \"" + std::string(spec) + "\": " + why +
                                 " (FORMAT[:every=N][:round=nearest|toward-zero], FORMAT a fixed "
                                 "float format such as e8m13, fp16, bf16)");
}

}  // namespace

Result<kernels::Accumulation> ParseAccumulation(std::string_view spec) {
  // The options sit at the end; what comes before them is the format (whose own spelling may
  // hold colons, as e5m2:inf does).
  std::vector<std::string_view> parts;
  for (size_t start = 0;;) {
    const size_t colon = spec.find(':', start);
    parts.push_back(spec.substr(start, colon - start));
    if (colon == std::string_view::npos) break;
    start = colon + 1;
  }
  kernels::Accumulation acc;
  bool has_every = false, has_round = false;
  while (parts.size() > 1) {
    const std::string_view opt = parts.back();
    if (opt.substr(0, 6) == "every=" && !has_every) {
      const std::string_view num = opt.substr(6);
      int64_t every = 0;
      const auto [end, ec] = std::from_chars(num.data(), num.data() + num.size(), every);
      if (ec != std::errc() || end != num.data() + num.size() || num.empty() || every < 1 ||
          every > kMaxAccumulateEvery) {
        return Bad(spec, "every must be an integer in 1.." + std::to_string(kMaxAccumulateEvery));
      }
      acc.every = every;
      has_every = true;
    } else if (opt.substr(0, 6) == "round=" && !has_round) {
      const std::string_view mode = opt.substr(6);
      if (mode != "nearest" && mode != "toward-zero") {
        return Bad(spec, "round must be nearest or toward-zero");
      }
      acc.toward_zero = mode == "toward-zero";
      has_round = true;
    } else {
      break;
    }
    parts.pop_back();
  }
  const std::string_view format_spec =
      spec.substr(0, size_t(parts.back().data() + parts.back().size() - spec.data()));
  if (format_spec.empty()) return Bad(spec, "no format");
  auto format = Format::Parse(format_spec);
  if (!format.ok()) return Bad(spec, format.status().message());
  if (format->family() != FormatFamily::kFloat && format->family() != FormatFamily::kFloat32) {
    return Bad(spec, format->spec() + " is not a fixed float format");
  }
  acc.grid = format->grid();
  if (format->flush_subnormals()) acc.grid.subnormals = false;  // fp32:nosub
  return acc;
}

}  // namespace cpd
