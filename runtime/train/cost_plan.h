// CPT's relative training cost of a run (the cost model of cpd/schedule.h, Fu et al. 2021)
// over the forward bits planned for every step, against static training at CPT's MAX bits. A
// schedule pushed mid-run (by the coordinator) replans the steps from where it takes effect.
// Runs without CPT cost 0 (nothing to compare against yet).
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/nn/quant_sites.h"

namespace cpd::runtime {

class CostPlan {
 public:
  // Plans all `total_steps` under `precision` (its CPT schedule, if any).
  CostPlan(int64_t total_steps, const PrecisionConfig& precision);
  // The steps from `from` on run under `precision` from now on.
  void Replan(int64_t from, const PrecisionConfig& precision);
  // (mean cost per step) / (cost of static training at the reference bits) - 1.
  double relative_cost() const { return relative_cost_; }

 private:
  std::vector<int> planned_bits_;  // per step; 0: not CPT (counts as the reference bits)
  int reference_bits_ = 0;         // the first CPT schedule's MAX bits (0: none seen yet)
  double relative_cost_ = 0;
};

}  // namespace cpd::runtime
