// The coordinator's one validating path: every request field a client sends is checked here
// before anything is stored or pushed. Errors are Status::InvalidArgument whose message names
// the field ("schedule.formats[1].spec: ...") and what would be accepted.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_set>

#include "cpd/status.h"
#include "cpd/tag.h"
#include "proto/cpd/v1/coordinator.pb.h"

namespace cpd::coordinator {

// Bounds on what one request may carry. The defaults are the documented limits of cpd.v1.
struct Limits {
  size_t max_name = kMaxJobNameLength;     // job_name: cpd/tag.h's rule, 1..max_name characters
  size_t max_study = kMaxStudyNameLength;  // study: the same rule, 0..max_study (empty = none)
  size_t max_string = 256;                 // layer names, hosts, arch, dataset, specs, ...
  int32_t max_world_size = 65536;          // world_size and emulated_workers_per_rank
  size_t max_layers_per_job = 10000;       // RegisterJobRequest.layers
  size_t max_layers_per_report = 4096;     // StatsReport.layers
  size_t max_overrides = 40000;            // PrecisionSchedule.overrides (10000 layers x 4 sites)
  int32_t max_layer_stats_limit = 10000;   // LayerStatsRequest.limit cap
  // Steps and counts (step, skipped_steps, dropped_reports, flips, nonfinite, schedule
  // versions): at most 2^53, exact in a double as cpdctl computes and prints them. A uint64
  // count above it is a negative number sent unsigned.
  int64_t max_count = int64_t(1) << 53;
  int64_t max_time_ms = 253402300799999;  // time_ms: 9999-12-31T23:59:59.999Z
};

// Layer names a job registered; empty = not known, so names in a schedule are not checked.
using LayerNames = std::unordered_set<std::string>;

Status ValidateJobName(std::string_view name, const Limits& limits);
// A study tag: empty (none) or [A-Za-z0-9._-]{1,max_study}; errors name `field`.
Status ValidateStudy(std::string_view study, std::string_view field, const Limits& limits);
Status ValidateListJobsRequest(const v1::ListJobsRequest& r, const Limits& limits);

// `ref` names exactly one of job_id (> 0) and job_name.
Status ValidateJobRef(const v1::JobRef& ref, std::string_view field, const Limits& limits);

// A schedule as a client sends it (version, set_at_ms and set_by are ignored): sites known and
// not repeated, specs parse (cpd::Format::Parse), roundings known, CPT bits 2..16 with
// min <= max and periods >= 1, grad_bits 0 or 2..16, override/keep_fp32 layers among `layers`
// when the job registered any; allreduce_layers: specs parse, layers "first", "last", "bn" or
// among `layers`.
Status ValidateSchedule(const v1::PrecisionSchedule& s, std::string_view field,
                        const LayerNames& layers, const Limits& limits);

// Everything in a RegisterJobRequest that does not need the coordinator's state.
Status ValidateRegister(const v1::RegisterJobRequest& r, const Limits& limits);

// The parts of a report that do not depend on the job: job_id > 0, step, epoch, time and the
// counts in 0..limits (max_count, max_time_ms), fractions in [0, 1], layer rows bounded and
// well formed. A non-finite loss, lr, max_abs or rel_error is a fact and is accepted as is.
Status ValidateReport(const v1::StatsReport& r, const Limits& limits);

// The parts of a report that depend on its job (`job`: what it registered; `label` names it in
// the message): rank below world_size, ranks_alive at most world_size, and when the job
// registered total_steps, step below it (steps count from 0) and skipped_steps at most it.
Status ValidateReportForJob(const v1::StatsReport& r, const v1::RegisterJobRequest& job,
                            const std::string& label);

Status ValidateLayerStatsRequest(const v1::LayerStatsRequest& r, const Limits& limits);
Status ValidateJobHistoryRequest(const v1::JobHistoryRequest& r, const Limits& limits);

}  // namespace cpd::coordinator
