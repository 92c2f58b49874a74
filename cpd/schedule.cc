#include "cpd/schedule.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numbers>
#include <string>

namespace cpd {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// 3 * 1024 * c(b, g): an integer, so sums over schedules are exact.
int64_t MacCostUnits(int b, int g) { return int64_t(b) * b + 2 * int64_t(b) * g; }

double Relative(int64_t units_sum, int64_t iters, int grad_bits, int static_bits) {
  if (iters == 0) return 0.0;
  const double static_units = double(MacCostUnits(static_bits, grad_bits));
  return double(units_sum) / (double(iters) * static_units) - 1.0;
}

std::string Str(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

}  // namespace

// ---- CPT cyclic precision ------------------------------------------------------------------

int64_t CyclicPrecision::CycleLength() const {
  const int64_t t = periods > 0 ? total_iters / periods : total_iters;
  return std::max<int64_t>(1, t);
}

int CyclicPrecision::BitsAt(int64_t t) const {
  const int64_t T = CycleLength();
  int64_t r = t % T;
  if (r < 0) r += T;
  // The official expression, operation for operation, so ties round as numpy's do.
  const double phase = std::numbers::pi * (double(r) / double(T)) + std::numbers::pi;
  const double b = double(min_bits) + 0.5 * double(max_bits - min_bits) * (1.0 + std::cos(phase));
  return int(std::nearbyint(b));  // default FE_TONEAREST: half to even, as np.rint
}

Status CyclicPrecision::Validate() const {
  auto bad = [](const std::string& m) { return Status::InvalidArgument("cyclic precision: " + m); };
  if (min_bits < 1 || min_bits > 32) {
    return bad("min_bits " + std::to_string(min_bits) + " is outside 1..32");
  }
  if (max_bits < 1 || max_bits > 32) {
    return bad("max_bits " + std::to_string(max_bits) + " is outside 1..32");
  }
  if (min_bits > max_bits) {
    return bad("min_bits " + std::to_string(min_bits) + " exceeds max_bits " +
               std::to_string(max_bits) + " (give MIN <= MAX)");
  }
  if (periods < 1) return bad("periods " + std::to_string(periods) + " must be at least 1");
  if (total_iters < 1) {
    return bad("total_iters " + std::to_string(total_iters) + " must be at least 1");
  }
  return Status::Ok();
}

// ---- CPT training-cost model ---------------------------------------------------------------

double MacCost(int fwd_bits, int grad_bits) {
  return double(MacCostUnits(fwd_bits, grad_bits)) / (3.0 * 1024.0);
}

double TrainingCost(const std::vector<int>& bits_per_iter, int grad_bits,
                    const std::vector<double>& layer_macs) {
  if (bits_per_iter.empty()) return 0.0;
  int64_t units = 0;
  for (int b : bits_per_iter) units += MacCostUnits(b, grad_bits);
  double macs = 1.0;
  if (!layer_macs.empty()) {
    macs = 0.0;
    for (double m : layer_macs) macs += m;
  }
  return macs * (double(units) / (3.0 * 1024.0)) / double(bits_per_iter.size());
}

double RelativeCost(const std::vector<int>& bits_per_iter, int grad_bits, int static_bits) {
  if (static_bits < 1 || grad_bits < 0) return kNaN;
  int64_t units = 0;
  for (int b : bits_per_iter) units += MacCostUnits(b, grad_bits);
  return Relative(units, int64_t(bits_per_iter.size()), grad_bits, static_bits);
}

double CptRelativeCost(const CyclicPrecision& cpt, int grad_bits, int static_bits) {
  if (!cpt.Validate().ok() || static_bits < 1 || grad_bits < 0) return kNaN;
  const int64_t T = cpt.CycleLength();
  const int64_t full = cpt.total_iters / T, rest = cpt.total_iters % T;
  int64_t cycle = 0, partial = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t u = MacCostUnits(cpt.BitsAt(t), grad_bits);
    cycle += u;
    if (t < rest) partial += u;
  }
  return Relative(full * cycle + partial, cpt.total_iters, grad_bits, static_bits);
}

std::string StepBitsText(StepBits bits) {
  return std::to_string(bits.fwd) + "/" + std::to_string(bits.grad);
}

Result<StepBits> ParseStepBits(std::string_view text) {
  auto bits = [](std::string_view s, int* out) {
    if (s.empty() || s.size() > 2 || s[0] == '0') return false;
    int v = 0;
    for (char c : s) {
      if (c < '0' || c > '9') return false;
      v = v * 10 + (c - '0');
    }
    *out = v;
    return v >= 1 && v <= 32;
  };
  const size_t slash = text.find('/');
  StepBits b;
  if (slash == std::string_view::npos || !bits(text.substr(0, slash), &b.fwd) ||
      !bits(text.substr(slash + 1), &b.grad)) {
    return Status::InvalidArgument("'" + std::string(text) +
                                   "' is not FWD/BWD bits (expected two integers in 1..32, e.g. "
                                   "8/8)");
  }
  return b;
}

double RelativeCost(const std::vector<StepBits>& steps, StepBits reference) {
  if (reference.fwd < 1 || reference.grad < 0) return kNaN;
  int64_t units = 0;
  for (const StepBits& s : steps) {
    if (s.fwd < 0 || s.grad < 0) return kNaN;
    units += MacCostUnits(s.fwd, s.grad);
  }
  return Relative(units, int64_t(steps.size()), reference.grad, reference.fwd);
}

// ---- Learning-rate schedules ---------------------------------------------------------------

double LrSchedule::At(int64_t step) const {
  const int64_t s = std::max<int64_t>(0, step);
  double lr = base_lr;
  switch (kind) {
    case kConstant:
      break;
    case kStep: {
      const auto k = std::upper_bound(milestones.begin(), milestones.end(), s) - milestones.begin();
      for (int64_t i = 0; i < k; ++i) lr *= gamma;
      break;
    }
    case kCosine: {
      // PyTorch CosineAnnealingLR (closed form): eta_min + (base - eta_min)(1 + cos(pi t/T))/2.
      const int64_t T = std::max<int64_t>(1, total_steps - warmup_steps);
      const int64_t t = std::clamp<int64_t>(s - warmup_steps, 0, T);
      lr = min_lr +
           (base_lr - min_lr) * (1.0 + std::cos(std::numbers::pi * double(t) / double(T))) / 2.0;
      break;
    }
  }
  if (s < warmup_steps) lr *= double(s + 1) / double(warmup_steps);
  return lr;
}

Status LrSchedule::Validate() const {
  auto bad = [](const std::string& m) { return Status::InvalidArgument("lr schedule: " + m); };
  if (kind != kConstant && kind != kStep && kind != kCosine) {
    return bad("unknown kind " + std::to_string(int(kind)));
  }
  if (!(base_lr > 0) || !std::isfinite(base_lr)) {
    return bad("base lr " + Str(base_lr) + " must be a positive number");
  }
  if (total_steps < 1) {
    return bad("total steps " + std::to_string(total_steps) + " must be at least 1");
  }
  if (warmup_steps < 0 || warmup_steps > total_steps) {
    return bad("warm-up steps " + std::to_string(warmup_steps) + " must be in 0.." +
               std::to_string(total_steps) + " (the total steps)");
  }
  if (!(min_lr >= 0) || !(min_lr <= base_lr)) {
    return bad("min lr " + Str(min_lr) + " must be in [0, base lr " + Str(base_lr) + "]");
  }
  if (!(gamma > 0) || !std::isfinite(gamma)) {
    return bad("gamma " + Str(gamma) + " must be a positive number");
  }
  for (size_t i = 0; i < milestones.size(); ++i) {
    if (milestones[i] < 0) {
      return bad("milestone " + std::to_string(milestones[i]) + " is negative");
    }
    if (i > 0 && milestones[i] <= milestones[i - 1]) {
      return bad("milestones must be strictly increasing (" + std::to_string(milestones[i - 1]) +
                 " then " + std::to_string(milestones[i]) + ")");
    }
  }
  if (kind == kStep && milestones.empty()) {
    return bad("'step' needs at least one milestone (or use 'constant')");
  }
  return Status::Ok();
}

const char* LrScheduleName(LrSchedule::Kind kind) {
  switch (kind) {
    case LrSchedule::kConstant:
      return "constant";
    case LrSchedule::kStep:
      return "step";
    case LrSchedule::kCosine:
      return "cosine";
  }
  return "?";
}

Result<LrSchedule::Kind> ParseLrScheduleKind(std::string_view name) {
  if (name == "constant") return LrSchedule::kConstant;
  if (name == "step") return LrSchedule::kStep;
  if (name == "cosine") return LrSchedule::kCosine;
  return Status::InvalidArgument("unknown lr schedule '" + std::string(name) +
                                 "' (accepted: constant, step, cosine)");
}

Result<LrSchedule> ParseLrSchedule(std::string_view name, double base_lr, int64_t total_steps,
                                   int64_t warmup_steps, std::vector<int64_t> milestones,
                                   double gamma, double min_lr) {
  CPD_ASSIGN_OR_RETURN(const LrSchedule::Kind kind, ParseLrScheduleKind(name));
  return MakeLrSchedule(kind, base_lr, total_steps, warmup_steps, std::move(milestones), gamma,
                        min_lr);
}

Result<LrSchedule> MakeLrSchedule(LrSchedule::Kind kind, double base_lr, int64_t total_steps,
                                  int64_t warmup_steps, std::vector<int64_t> milestones,
                                  double gamma, double min_lr) {
  LrSchedule s;
  s.kind = kind;
  s.base_lr = base_lr;
  s.total_steps = total_steps;
  s.warmup_steps = warmup_steps;
  s.milestones = std::move(milestones);
  s.gamma = gamma;
  s.min_lr = min_lr;
  CPD_RETURN_IF_ERROR(s.Validate());
  return s;
}

// ---- Large-batch learning-rate scaling -----------------------------------------------------

const char* LrScalingName(LrScaling rule) {
  switch (rule) {
    case LrScaling::kLinear:
      return "linear";
    case LrScaling::kSqrt:
      return "sqrt";
    case LrScaling::kNone:
      break;
  }
  return "none";
}

Result<LrScaling> ParseLrScaling(std::string_view name) {
  if (name == "none") return LrScaling::kNone;
  if (name == "linear") return LrScaling::kLinear;
  if (name == "sqrt") return LrScaling::kSqrt;
  return Status::InvalidArgument("lr-scaling '" + std::string(name) +
                                 "' (accepted: none, linear, sqrt)");
}

double ScaleLr(double lr, LrScaling rule, int64_t global_batch, int64_t base_batch) {
  const double ratio = double(global_batch) / double(base_batch);
  switch (rule) {
    case LrScaling::kLinear:
      return lr * ratio;  // Goyal et al. 2017
    case LrScaling::kSqrt:
      return lr * std::sqrt(ratio);  // Krizhevsky 2014; Hoffer et al. 2017
    case LrScaling::kNone:
      break;
  }
  return lr;
}

}  // namespace cpd
