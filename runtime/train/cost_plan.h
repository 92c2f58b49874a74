// The relative training cost of a run (the cost model of cpd/schedule.h, Fu et al. 2021) over
// the bits planned for every step, against static training at a stated reference (--cost-reference,
// default 8/8). Every policy has a cost: a step's forward bits are CPT's bits where CPT is on,
// else the larger storage bits of the global W and A formats (fp32 32, bf16 16, e4m3 8, int4 4);
// its backward bits are CPT's grad bits, else the storage bits of the global E format. Per-layer
// overrides and fp32 layers are not weighed in (the model's ratio assumes every quantised layer
// follows one schedule). A schedule pushed mid-run (by the coordinator) replans the steps from
// where it takes effect.
#pragma once

#include <cstdint>
#include <vector>

#include "cpd/schedule.h"
#include "runtime/nn/quant_sites.h"

namespace cpd::runtime {

// The forward and backward bits of step `step` under `precision`, as described above.
StepBits PlannedStepBits(const PrecisionConfig& precision, int64_t step);

class CostPlan {
 public:
  // Plans all `total_steps` under `precision`; costs are relative to `reference`.
  CostPlan(int64_t total_steps, const PrecisionConfig& precision, StepBits reference);
  // The steps from `from` on run under `precision` from now on.
  void Replan(int64_t from, const PrecisionConfig& precision);
  // (mean cost per step) / (cost of static training at the reference) - 1; negative = cheaper.
  double relative_cost() const { return relative_cost_; }
  StepBits reference() const { return reference_; }

 private:
  std::vector<StepBits> planned_;  // per step
  StepBits reference_;
  double relative_cost_ = 0;
};

}  // namespace cpd::runtime
