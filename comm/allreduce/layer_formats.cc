// Hybrid precision: GradientAllReduceOptions::layer_formats resolved over the layout into one
// format (and APS emax) per layer. The algorithms look a segment's format up with
// ReducerSetup::FormatOf; nothing else in comm/ knows that formats can differ per layer.
#include <string>

#include "comm/allreduce/internal.h"

namespace cpd::comm::internal {
namespace {

// "a, b, c" (at most `max` names, then "...") for a message that lists what is accepted.
std::string SomeNames(const std::vector<std::string>& names, std::size_t max) {
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < max; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > max) out += ", ...";
  return out;
}

}  // namespace

Status ResolveLayerFormats(ReducerSetup* setup) {
  const std::map<std::string, std::string>& named = setup->options.layer_formats;
  if (named.empty()) return Status::Ok();
  const std::vector<std::string>& names = setup->layout.layer_names;
  std::vector<Format> formats(names.size(), setup->format);
  bool mixed = false;
  for (const auto& [layer, spec] : named) {
    std::size_t l = 0;
    while (l < names.size() && names[l] != layer) ++l;
    if (l == names.size()) {
      return Status::InvalidArgument(
          "GradientAllReducer: layer_formats names layer '" + layer +
          "', which the gradient layout does not have (layers: " + SomeNames(names, 8) + ")");
    }
    CPD_ASSIGN_OR_RETURN(formats[l], Format::Parse(spec));
    mixed |= formats[l].spec() != setup->format.spec();
  }
  if (!mixed) return Status::Ok();
  setup->layer_formats = std::move(formats);
  setup->layer_emax.clear();
  for (const Format& f : setup->layer_formats) {
    setup->layer_emax.push_back(f.family() == FormatFamily::kFloat32 ? 0 : ApsEmax(f));
  }
  return Status::Ok();
}

std::vector<LayerCommStats> NewLayerStats(const ReducerSetup& setup) {
  std::vector<LayerCommStats> stats(setup.layers());
  for (std::size_t l = 0; l < stats.size(); ++l) {
    stats[l].layer = setup.layout.layer_names[l];
    stats[l].format = setup.FormatOf(int(l)).spec();
  }
  return stats;
}

}  // namespace cpd::comm::internal
