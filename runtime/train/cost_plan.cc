#include "runtime/train/cost_plan.h"

#include "cpd/schedule.h"

namespace cpd::runtime {

CostPlan::CostPlan(int64_t total_steps, const PrecisionConfig& precision)
    : planned_bits_(size_t(total_steps), 0) {
  Replan(0, precision);
}

void CostPlan::Replan(int64_t from, const PrecisionConfig& precision) {
  if (precision.cpt && reference_bits_ == 0) reference_bits_ = precision.cpt->max_bits;
  for (int64_t t = from; t < int64_t(planned_bits_.size()); ++t) {
    planned_bits_[size_t(t)] = precision.cpt ? precision.cpt->BitsAt(t) : 0;
  }
  if (reference_bits_ == 0) return;
  std::vector<int> bits = planned_bits_;
  for (int& b : bits) {
    if (b == 0) b = reference_bits_;  // a step without CPT runs at the reference bits
  }
  relative_cost_ = RelativeCost(bits, precision.grad_bits, reference_bits_);
}

}  // namespace cpd::runtime
