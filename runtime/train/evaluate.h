// Test-set accuracy and loss of a model in evaluation mode (CPT evaluates at its highest
// precision), the test set sharded over the ranks and the sums combined in rank order.
#pragma once

#include <cstdint>

#include "cpd/status.h"
#include "runtime/train/data.h"
#include "runtime/nn/layers.h"
#include "runtime/nn/quant_sites.h"
#include "runtime/train/replicas.h"

namespace cpd::runtime {

struct Evaluation {
  double accuracy = 0;
  double loss = 0;
};

// A collective over `replicas`' ranks; every rank gets the same numbers. `seed` is the run's.
Result<Evaluation> Evaluate(Sequential* model, SiteQuantizer* quant, const Dataset& test,
                            Device device, const Replicas& replicas, uint64_t seed);

}  // namespace cpd::runtime
