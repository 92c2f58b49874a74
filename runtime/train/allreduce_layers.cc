#include "runtime/train/allreduce_layers.h"

#include <algorithm>

namespace cpd::runtime {
namespace {

bool Contains(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

Status UnknownLayer(const std::string& name, const comm::GradientLayout& layout) {
  std::string known;
  for (size_t i = 0; i < layout.layer_names.size() && i < 8; ++i) {
    known += (i ? ", " : "") + layout.layer_names[i];
  }
  if (layout.layer_names.size() > 8) known += ", ...";
  return Status::InvalidArgument("--allreduce-layer-format: no layer with gradients named '" +
                                 name + "' (accepted: first, last, bn or a layer name: " + known +
                                 "; see --print-model)");
}

}  // namespace

Result<std::map<std::string, std::string>> ResolveAllReduceLayers(
    const std::vector<std::pair<std::string, std::string>>& rules,
    const comm::GradientLayout& layout, const std::vector<std::string>& batchnorm_layers) {
  std::map<std::string, std::string> out;
  const std::vector<std::string>& names = layout.layer_names;
  for (const auto& [rule, spec] : rules) {
    std::vector<std::string> targets;
    if ((rule == "first" || rule == "last") && !names.empty()) {
      targets.push_back(rule == "first" ? names.front() : names.back());
    } else if (rule == "bn") {
      for (const std::string& n : names) {
        if (Contains(batchnorm_layers, n)) targets.push_back(n);
      }
      if (targets.empty()) {
        return Status::InvalidArgument(
            "--allreduce-layer-format: 'bn' names the BatchNorm layers, and this model has none");
      }
    } else if (Contains(names, rule)) {
      targets.push_back(rule);
    } else {
      return UnknownLayer(rule, layout);
    }
    for (const std::string& t : targets) out[t] = spec;
  }
  return out;
}

}  // namespace cpd::runtime
