#include "launcher/coordinator/validate.h"

#include <cmath>
#include <set>

#include "cpd/format.h"
#include "cpd/quantize.h"
#include "cpd/tag.h"
#include "launcher/common.h"

namespace cpd::coordinator {
namespace {

std::string Field(std::string_view prefix, std::string_view name) {
  std::string f(prefix);
  if (!f.empty()) f += '.';
  f += name;
  return f;
}

std::string Indexed(std::string_view prefix, std::string_view name, int i) {
  return Field(prefix, name) + "[" + std::to_string(i) + "]";
}

Status Bad(const std::string& field, const std::string& what) {
  return Status::InvalidArgument(field + ": " + what);
}

// A client's string in an error message (it may be long or binary): the launcher's one quoting
// helper.
std::string Quote(std::string_view s) { return launcher::QuoteForMessage(s); }

Status CheckString(std::string_view s, const std::string& field, const Limits& limits,
                   bool required) {
  if (required && s.empty()) return Bad(field, "must not be empty");
  if (s.size() > limits.max_string) {
    return Bad(field, "is " + std::to_string(s.size()) + " bytes; at most " +
                          std::to_string(limits.max_string) + " are accepted");
  }
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7f) {
      return Bad(field, Quote(s) + " contains a control character");
    }
  }
  return Status::Ok();
}

Status CheckRange(int64_t v, int64_t lo, int64_t hi, const std::string& field) {
  if (v < lo || v > hi) {
    return Bad(field, std::to_string(v) + " is out of range; accepted: " + std::to_string(lo) +
                          ".." + std::to_string(hi));
  }
  return Status::Ok();
}

Status CheckNonNegative(int64_t v, const std::string& field) {
  if (v < 0) return Bad(field, std::to_string(v) + " is negative; accepted: >= 0");
  return Status::Ok();
}

Status CheckFraction(double v, const std::string& field) {
  if (!(v >= 0.0 && v <= 1.0)) {
    return Bad(field, std::to_string(v) + " is not a fraction in [0, 1]");
  }
  return Status::Ok();
}

// Accuracies: negative = not measured; otherwise a fraction.
Status CheckAccuracy(double v, const std::string& field) {
  if (std::isnan(v) || v > 1.0 || std::isinf(v)) {
    return Bad(field, std::to_string(v) + " is not an accuracy in [0, 1] (negative: not measured)");
  }
  return Status::Ok();
}

// A perplexity exp(loss) is at least 1; negative or 0 is "not measured", and NaN or +inf (a
// model that diverged) is kept as it is, like a loss.
Status CheckPerplexity(double v, const std::string& field) {
  if (v > 0 && v < 1) {
    return Bad(field, std::to_string(v) +
                          " is not a perplexity (>= 1, the exponential of a loss; negative: not "
                          "measured)");
  }
  return Status::Ok();
}

bool SiteKnown(int site) { return v1::Site_IsValid(site) && site != v1::SITE_UNSPECIFIED; }

// Sites a schedule may set formats for: W, A, E, G (SITE_COMM carries statistics only).
Status CheckScheduleSite(int site, const std::string& field) {
  if (site == v1::SITE_COMM) {
    return Bad(field,
               "SITE_COMM carries statistics only; a schedule sets SITE_W, SITE_A, "
               "SITE_E or SITE_G (the all-reduce format is the job's --allreduce-format)");
  }
  if (!SiteKnown(site)) {
    return Bad(field, std::to_string(site) +
                          " is not a site; accepted: SITE_W, SITE_A, SITE_E, "
                          "SITE_G");
  }
  return Status::Ok();
}

Status CheckSpec(std::string_view spec, const std::string& field, const Limits& limits) {
  CPD_RETURN_IF_ERROR(CheckString(spec, field, limits, /*required=*/true));
  auto f = cpd::Format::Parse(spec);
  if (!f.ok()) return Bad(field, f.status().message());
  return Status::Ok();
}

Status CheckLayerName(std::string_view name, const std::string& field, const LayerNames& layers,
                      const Limits& limits) {
  CPD_RETURN_IF_ERROR(CheckString(name, field, limits, /*required=*/true));
  if (!layers.empty() && layers.count(std::string(name)) == 0) {
    return Bad(field, Quote(name) + " is not a layer of this job (see JobStatus.layers)");
  }
  return Status::Ok();
}

bool StringOk(std::string_view s, const Limits& limits, bool required) {
  if ((required && s.empty()) || s.size() > limits.max_string) return false;
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7f) return false;
  }
  return true;
}

// Every check ValidateReport makes of a layer row, without building a message.
// The spec in force is informational here (schedules are where specs are parsed): parsing 100
// specs per report at 5000 reports/s would cost more than storing them.
bool LayerStatOk(const v1::LayerStat& l, const Limits& limits) {
  const uint64_t max_count = uint64_t(limits.max_count);
  return StringOk(l.layer(), limits, true) && SiteKnown(l.site()) &&
         StringOk(l.format(), limits, false) && l.bits() >= 0 && l.bits() <= 64 &&
         l.aps_shift() >= -1100 && l.aps_shift() <= 1100 && !(l.max_abs() < 0) &&
         l.saturated() >= 0 && l.saturated() <= 1 && l.flushed() >= 0 && l.flushed() <= 1 &&
         l.flips() <= max_count && l.nonfinite() <= max_count;
}

// A uint64 count: at most limits.max_count (a larger one is a negative number sent unsigned).
Status CheckCount(uint64_t v, const std::string& field, const Limits& limits) {
  if (v > uint64_t(limits.max_count)) {
    return Bad(field, std::to_string(v) + " is not a count; accepted: 0.." +
                          std::to_string(limits.max_count) +
                          (v >= (uint64_t(1) << 63) ? " (a negative number sent as uint64?)" : ""));
  }
  return Status::Ok();
}

// A name a client chooses (job names, study tags): cpd/tag.h's rule, with at most `max`
// characters; the message says which part of the rule is broken.
Status CheckTag(std::string_view name, const std::string& field, size_t max) {
  if (name.size() > max) {
    return Bad(field, "is " + std::to_string(name.size()) + " characters; at most " +
                          std::to_string(max) + " are accepted");
  }
  if (!HasOnlyTagCharacters(name)) {
    return Bad(field, Quote(name) + " may contain only " + kTagCharacters);
  }
  return Status::Ok();
}

}  // namespace

Status ValidateJobName(std::string_view name, const Limits& limits) {
  if (name.empty()) return Bad("job_name", "must not be empty");
  return CheckTag(name, "job_name", limits.max_name);
}

Status ValidateStudy(std::string_view study, std::string_view field, const Limits& limits) {
  if (study.empty()) return Status::Ok();
  return CheckTag(study, std::string(field), limits.max_study);
}

Status ValidateListJobsRequest(const v1::ListJobsRequest& r, const Limits& limits) {
  return ValidateStudy(r.study(), "study", limits);
}

Status ValidateJobRef(const v1::JobRef& ref, std::string_view field, const Limits& limits) {
  const bool has_id = ref.job_id() != 0, has_name = !ref.job_name().empty();
  if (has_id == has_name) {
    return Bad(std::string(field), has_id ? "set both job_id and job_name; set exactly one"
                                          : "set job_id or job_name (exactly one)");
  }
  if (has_id && ref.job_id() < 0) {
    return Bad(Field(field, "job_id"), std::to_string(ref.job_id()) + " is not a job id (> 0)");
  }
  if (has_name) {
    Status s = ValidateJobName(ref.job_name(), limits);
    if (!s.ok()) return Status::InvalidArgument(Field(field, s.message()));
  }
  return Status::Ok();
}

Status ValidateSchedule(const v1::PrecisionSchedule& s, std::string_view field,
                        const LayerNames& layers, const Limits& limits) {
  CPD_RETURN_IF_ERROR(
      CheckNonNegative(s.effective_from_step(), Field(field, "effective_from_step")));
  std::set<int> sites;
  for (int i = 0; i < s.formats_size(); ++i) {
    const v1::SiteFormat& f = s.formats(i);
    const std::string fi = Indexed(field, "formats", i);
    CPD_RETURN_IF_ERROR(CheckScheduleSite(f.site(), fi + ".site"));
    if (!sites.insert(f.site()).second) {
      return Bad(fi + ".site", v1::Site_Name(f.site()) + " is listed twice; one format per site");
    }
    CPD_RETURN_IF_ERROR(CheckSpec(f.spec(), fi + ".spec", limits));
    if (!f.rounding().empty()) {
      auto r = cpd::ParseRounding(f.rounding());
      if (!r.ok()) {
        return Bad(fi + ".rounding", Quote(f.rounding()) +
                                         " is not a rounding; accepted: nearest, stochastic, zero "
                                         "(empty = nearest)");
      }
    }
  }
  if (s.has_cyclic()) {
    const v1::CyclicPrecision& c = s.cyclic();
    CPD_RETURN_IF_ERROR(CheckRange(c.min_bits(), 2, 16, Field(field, "cyclic.min_bits")));
    CPD_RETURN_IF_ERROR(
        CheckRange(c.max_bits(), c.min_bits(), 16, Field(field, "cyclic.max_bits")));
    CPD_RETURN_IF_ERROR(CheckRange(c.periods(), 1, 1 << 30, Field(field, "cyclic.periods")));
  }
  if (s.grad_bits() != 0) {
    CPD_RETURN_IF_ERROR(
        CheckRange(s.grad_bits(), 2, 16, Field(field, "grad_bits") + " (0 = default)"));
  }
  if (size_t(s.overrides_size()) > limits.max_overrides) {
    return Bad(Field(field, "overrides"), std::to_string(s.overrides_size()) +
                                              " overrides; at most " +
                                              std::to_string(limits.max_overrides));
  }
  std::set<std::pair<std::string, int>> seen;
  for (int i = 0; i < s.overrides_size(); ++i) {
    const v1::LayerOverride& o = s.overrides(i);
    const std::string fi = Indexed(field, "overrides", i);
    CPD_RETURN_IF_ERROR(CheckLayerName(o.layer(), fi + ".layer", layers, limits));
    CPD_RETURN_IF_ERROR(CheckScheduleSite(o.site(), fi + ".site"));
    if (!seen.emplace(o.layer(), o.site()).second) {
      return Bad(fi, Quote(o.layer()) + " at " + v1::Site_Name(o.site()) +
                         " is overridden twice; one override per layer and site");
    }
    CPD_RETURN_IF_ERROR(CheckSpec(o.spec(), fi + ".spec", limits));
  }
  if (size_t(s.keep_fp32_size()) > limits.max_layers_per_job + 2) {
    return Bad(Field(field, "keep_fp32"),
               std::to_string(s.keep_fp32_size()) + " entries; at most one per layer");
  }
  for (int i = 0; i < s.keep_fp32_size(); ++i) {
    const std::string& k = s.keep_fp32(i);
    if (k == "first" || k == "last") continue;
    CPD_RETURN_IF_ERROR(CheckLayerName(k, Indexed(field, "keep_fp32", i), layers, limits));
  }
  if (size_t(s.allreduce_layers_size()) > limits.max_layers_per_job + 3) {
    return Bad(Field(field, "allreduce_layers"),
               std::to_string(s.allreduce_layers_size()) + " entries; at most one per layer");
  }
  for (int i = 0; i < s.allreduce_layers_size(); ++i) {
    const v1::AllReduceLayerFormat& a = s.allreduce_layers(i);
    const std::string fi = Indexed(field, "allreduce_layers", i);
    if (a.layer() != "first" && a.layer() != "last" && a.layer() != "bn") {
      CPD_RETURN_IF_ERROR(CheckLayerName(a.layer(), fi + ".layer", layers, limits));
    }
    CPD_RETURN_IF_ERROR(CheckSpec(a.spec(), fi + ".spec", limits));
  }
  return Status::Ok();
}

Status ValidateRegister(const v1::RegisterJobRequest& r, const Limits& limits) {
  CPD_RETURN_IF_ERROR(ValidateJobName(r.job_name(), limits));
  CPD_RETURN_IF_ERROR(ValidateStudy(r.study(), "study", limits));
  CPD_RETURN_IF_ERROR(CheckRange(r.world_size(), 1, limits.max_world_size, "world_size"));
  // proto3 cannot tell 0 from unset: 0 means the default, one worker per rank.
  CPD_RETURN_IF_ERROR(CheckRange(r.emulated_workers_per_rank(), 0, limits.max_world_size,
                                 "emulated_workers_per_rank (0 = 1)"));
  if (r.workers_size() > r.world_size()) {
    return Bad("workers", std::to_string(r.workers_size()) + " workers for world_size " +
                              std::to_string(r.world_size()));
  }
  std::set<int32_t> ranks;
  for (int i = 0; i < r.workers_size(); ++i) {
    const v1::WorkerInfo& w = r.workers(i);
    const std::string fi = "workers[" + std::to_string(i) + "]";
    CPD_RETURN_IF_ERROR(CheckRange(w.rank(), 0, r.world_size() - 1, fi + ".rank"));
    if (!ranks.insert(w.rank()).second) {
      return Bad(fi + ".rank", std::to_string(w.rank()) + " is listed twice");
    }
    CPD_RETURN_IF_ERROR(CheckString(w.host(), fi + ".host", limits, false));
    CPD_RETURN_IF_ERROR(CheckNonNegative(w.pid(), fi + ".pid"));
  }
  if (size_t(r.layers_size()) > limits.max_layers_per_job) {
    return Bad("layers", std::to_string(r.layers_size()) + " layers; at most " +
                             std::to_string(limits.max_layers_per_job) + " per job");
  }
  LayerNames names;
  for (int i = 0; i < r.layers_size(); ++i) {
    const v1::LayerInfo& l = r.layers(i);
    const std::string fi = "layers[" + std::to_string(i) + "]";
    CPD_RETURN_IF_ERROR(CheckString(l.name(), fi + ".name", limits, true));
    if (!names.insert(l.name()).second) {
      return Bad(fi + ".name", Quote(l.name()) + " is listed twice");
    }
    CPD_RETURN_IF_ERROR(CheckString(l.kind(), fi + ".kind", limits, false));
    CPD_RETURN_IF_ERROR(CheckNonNegative(l.params(), fi + ".params"));
  }
  CPD_RETURN_IF_ERROR(ValidateSchedule(r.schedule(), "schedule", names, limits));
  CPD_RETURN_IF_ERROR(CheckString(r.arch(), "arch", limits, false));
  CPD_RETURN_IF_ERROR(CheckString(r.dataset(), "dataset", limits, false));
  CPD_RETURN_IF_ERROR(CheckString(r.allreduce(), "allreduce", limits, false));
  CPD_RETURN_IF_ERROR(CheckNonNegative(r.total_steps(), "total_steps"));
  CPD_RETURN_IF_ERROR(CheckNonNegative(r.epochs(), "epochs"));
  CPD_RETURN_IF_ERROR(CheckNonNegative(r.start_step(), "start_step"));
  return Status::Ok();
}

Status ValidateReport(const v1::StatsReport& r, const Limits& limits) {
  if (r.job_id() <= 0) {
    return Bad("job_id", std::to_string(r.job_id()) + " is not a job id (RegisterJob returns one)");
  }
  CPD_RETURN_IF_ERROR(CheckNonNegative(r.rank(), "rank"));
  CPD_RETURN_IF_ERROR(CheckRange(r.step(), 0, limits.max_count, "step"));
  CPD_RETURN_IF_ERROR(CheckNonNegative(r.epoch(), "epoch"));
  CPD_RETURN_IF_ERROR(CheckRange(r.bits(), 0, 64, "bits"));
  CPD_RETURN_IF_ERROR(CheckCount(r.schedule_version(), "schedule_version", limits));
  CPD_RETURN_IF_ERROR(CheckNonNegative(r.ranks_alive(), "ranks_alive"));
  CPD_RETURN_IF_ERROR(CheckCount(r.skipped_steps(), "skipped_steps", limits));
  CPD_RETURN_IF_ERROR(CheckCount(r.dropped_reports(), "dropped_reports", limits));
  CPD_RETURN_IF_ERROR(CheckRange(r.time_ms(), 0, limits.max_time_ms, "time_ms"));
  if (!(r.images_per_s() >= 0.0)) {
    return Bad("images_per_s", std::to_string(r.images_per_s()) + " is not a rate (>= 0)");
  }
  CPD_RETURN_IF_ERROR(CheckAccuracy(r.train_accuracy(), "train_accuracy"));
  CPD_RETURN_IF_ERROR(CheckAccuracy(r.test_accuracy(), "test_accuracy"));
  CPD_RETURN_IF_ERROR(CheckPerplexity(r.test_perplexity(), "test_perplexity"));
  if (size_t(r.layers_size()) > limits.max_layers_per_report) {
    return Bad("layers", std::to_string(r.layers_size()) + " layer rows; at most " +
                             std::to_string(limits.max_layers_per_report) + " per report");
  }
  for (int i = 0; i < r.layers_size(); ++i) {
    const v1::LayerStat& l = r.layers(i);
    // The hot path (100 rows per report, thousands of reports per second) allocates nothing;
    // a row that fails is described by the checks below, which name the field.
    if (LayerStatOk(l, limits)) continue;
    const std::string fi = "layers[" + std::to_string(i) + "]";
    CPD_RETURN_IF_ERROR(CheckString(l.layer(), fi + ".layer", limits, true));
    if (!SiteKnown(l.site())) {
      return Bad(fi + ".site", std::to_string(l.site()) +
                                   " is not a site; accepted: SITE_W, SITE_A, SITE_E, SITE_G, "
                                   "SITE_COMM");
    }
    CPD_RETURN_IF_ERROR(CheckString(l.format(), fi + ".format", limits, false));
    CPD_RETURN_IF_ERROR(CheckRange(l.bits(), 0, 64, fi + ".bits"));
    CPD_RETURN_IF_ERROR(CheckRange(l.aps_shift(), -1100, 1100, fi + ".aps_shift"));
    if (l.max_abs() < 0) {
      return Bad(fi + ".max_abs", std::to_string(l.max_abs()) + " is negative");
    }
    CPD_RETURN_IF_ERROR(CheckFraction(l.saturated(), fi + ".saturated"));
    CPD_RETURN_IF_ERROR(CheckFraction(l.flushed(), fi + ".flushed"));
    CPD_RETURN_IF_ERROR(CheckCount(l.flips(), fi + ".flips", limits));
    CPD_RETURN_IF_ERROR(CheckCount(l.nonfinite(), fi + ".nonfinite", limits));
    return Status::Internal(fi + ": rejected by the fast check but by no described one");
  }
  return Status::Ok();
}

Status ValidateReportForJob(const v1::StatsReport& r, const v1::RegisterJobRequest& job,
                            const std::string& label) {
  const int32_t world = job.world_size();
  if (r.rank() >= world) {
    return Bad("rank", std::to_string(r.rank()) + " is out of range for " + label +
                           " of world_size " + std::to_string(world) + "; accepted: 0.." +
                           std::to_string(world - 1));
  }
  if (r.ranks_alive() > world) {
    return Bad("ranks_alive", std::to_string(r.ranks_alive()) + " exceeds world_size " +
                                  std::to_string(world) + " of " + label);
  }
  // cpdctl shows progress as (step + 1) / total_steps: a step past the end is a wrong report,
  // not progress beyond 100 %.
  if (job.total_steps() > 0) {
    if (r.step() >= job.total_steps()) {
      return Bad("step", std::to_string(r.step()) + " is beyond the " +
                             std::to_string(job.total_steps()) + " steps of " + label +
                             "; accepted: 0.." + std::to_string(job.total_steps() - 1));
    }
    if (r.skipped_steps() > uint64_t(job.total_steps())) {
      return Bad("skipped_steps", std::to_string(r.skipped_steps()) + " exceeds the " +
                                      std::to_string(job.total_steps()) + " steps of " + label);
    }
  }
  return Status::Ok();
}

Status ValidateLayerStatsRequest(const v1::LayerStatsRequest& r, const Limits& limits) {
  CPD_RETURN_IF_ERROR(ValidateJobRef(r.job(), "job", limits));
  if (r.latest()) {
    if (r.from_step() != 0 || r.to_step() != 0) {
      return Bad("latest", "is set together with from_step/to_step; use one or the other");
    }
  } else {
    CPD_RETURN_IF_ERROR(CheckNonNegative(r.from_step(), "from_step"));
    if (r.to_step() < r.from_step()) {
      return Bad("to_step", std::to_string(r.to_step()) + " is before from_step " +
                                std::to_string(r.from_step()));
    }
  }
  CPD_RETURN_IF_ERROR(CheckRange(r.limit(), 0, limits.max_layer_stats_limit, "limit (0 = cap)"));
  return Status::Ok();
}

Status ValidateJobHistoryRequest(const v1::JobHistoryRequest& r, const Limits& limits) {
  CPD_RETURN_IF_ERROR(ValidateJobRef(r.job(), "job", limits));
  CPD_RETURN_IF_ERROR(CheckNonNegative(r.from_step(), "from_step"));
  if (r.to_step() != 0 && r.to_step() < r.from_step()) {
    return Bad("to_step", std::to_string(r.to_step()) + " is before from_step " +
                              std::to_string(r.from_step()) + " (0 = to the end)");
  }
  return Status::Ok();
}

}  // namespace cpd::coordinator
