#include "runtime/train/cost_plan.h"

#include <algorithm>

#include "cpd/format.h"

namespace cpd::runtime {

namespace {

// Storage bits per element of a site's global format (32 for fp32 or a spec that does not parse,
// which Create() has already refused).
int SiteBits(const PrecisionConfig& precision, Site site) {
  const auto f = Format::Parse(precision.global[int(site)].spec);
  return f.ok() ? f->bits() : 32;
}

}  // namespace

StepBits PlannedStepBits(const PrecisionConfig& precision, int64_t step) {
  if (precision.cpt) return {precision.cpt->BitsAt(step), precision.grad_bits};
  return {std::max(SiteBits(precision, Site::kWeight), SiteBits(precision, Site::kActivation)),
          SiteBits(precision, Site::kError)};
}

CostPlan::CostPlan(int64_t total_steps, const PrecisionConfig& precision, StepBits reference)
    : planned_(size_t(std::max<int64_t>(0, total_steps))), reference_(reference) {
  Replan(0, precision);
}

void CostPlan::Replan(int64_t from, const PrecisionConfig& precision) {
  // Parsing once per replan: the static formats give every step the same bits.
  const StepBits fixed = precision.cpt ? StepBits{} : PlannedStepBits(precision, 0);
  for (int64_t t = std::max<int64_t>(0, from); t < int64_t(planned_.size()); ++t) {
    planned_[size_t(t)] = precision.cpt ? PlannedStepBits(precision, t) : fixed;
  }
  relative_cost_ = RelativeCost(planned_, reference_);
}

}  // namespace cpd::runtime
