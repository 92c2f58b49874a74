// Hybrid precision of the gradient all-reduce (the APS paper's remedy): the rules of
// PrecisionConfig::allreduce_layers (cpd-train --allreduce-layer-format, cpdctl schedule set)
// resolved against the all-reducer's layers, as --keep-fp32 resolves its sites.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "comm/gradient_allreduce.h"
#include "cpd/status.h"

namespace cpd::runtime {

// Each rule NAME=SPEC, in order (later rules win for a layer they share): NAME "first" / "last"
// is the first / last layer of `layout` (the layers with gradients, in parameter order), "bn"
// every layer listed in `batchnorm_layers` that has gradients, anything else a layout layer
// name. Returns layer name -> spec for GradientAllReduceOptions::layer_formats.
// InvalidArgument naming --allreduce-layer-format, the name and the layers it could be, for a
// name that is no layer with gradients (or "bn" in a model without BatchNorm).
Result<std::map<std::string, std::string>> ResolveAllReduceLayers(
    const std::vector<std::pair<std::string, std::string>>& rules,
    const comm::GradientLayout& layout, const std::vector<std::string>& batchnorm_layers);

}  // namespace cpd::runtime
