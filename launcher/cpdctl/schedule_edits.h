// The edits of `cpdctl schedule set`: checked locally (format specs through cpd::Format::Parse,
// rounding modes, sites, bit ranges) before any RPC, then applied to the schedule read from the
// coordinator, which cpdctl writes back whole with expected_version.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cpd/status.h"
#include "proto/cpd/v1/coordinator.pb.h"

namespace cpd::ctl {

// As given on the command line; an unset optional / empty list leaves that part unchanged.
struct ScheduleEdits {
  std::optional<std::pair<int, int>> cyclic_bits;  // --cyclic-bits MIN MAX
  std::optional<int> cyclic_periods;               // --cyclic-periods N
  std::optional<int> grad_bits;                    // --grad-bits B
  bool make_static = false;                        // --static: drop CPT (cyclic and grad bits)
  std::vector<std::string> formats;                // --format SITE=SPEC | LAYER.SITE=SPEC
  std::vector<std::string> roundings;              // --rounding SITE=MODE
  std::vector<std::string> drop_overrides;         // --drop-override LAYER.SITE
  std::optional<std::string> keep_fp32;            // --keep-fp32 a,b,c ("none": keep nothing)
  std::optional<std::string> hysteresis;           // --hysteresis on|off
  // --allreduce-layer-format NAME=SPEC (set NAME's all-reduce format; SPEC "default" drops it),
  // or "none" (drop every per-layer all-reduce format). NAME: a layer, first, last or bn.
  std::vector<std::string> allreduce_layers;
  std::optional<int64_t> from_step;  // --from-step N (unset: the next step)

  bool empty() const {
    return !cyclic_bits && !cyclic_periods && !grad_bits && !make_static && formats.empty() &&
           roundings.empty() && drop_overrides.empty() && !keep_fp32 && !hysteresis &&
           allreduce_layers.empty();
  }
};

// Checks everything that can be checked without the coordinator. The message names the flag and
// the value, and for a bad spec carries the format library's message.
Status ValidateScheduleEdits(const ScheduleEdits& edits);

// Applies the edits to `schedule` (the one read from the coordinator). `layers`, when not null,
// are the job's layers: layer names in overrides and --keep-fp32 must be among them. Clears the
// coordinator's bookkeeping (version, set_at_ms, set_by); sets effective_from_step to
// --from-step, or 0 (a step already passed: "from the next step") when it is not given.
Status ApplyScheduleEdits(const ScheduleEdits& edits,
                          const google::protobuf::RepeatedPtrField<cpd::v1::LayerInfo>* layers,
                          cpd::v1::PrecisionSchedule* schedule);

}  // namespace cpd::ctl
