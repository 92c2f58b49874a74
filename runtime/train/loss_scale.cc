#include "runtime/train/loss_scale.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "cpd/message.h"

namespace cpd::runtime {

Result<LossScaleOptions> ParseLossScale(const std::string& text, double init,
                                        int64_t growth_interval) {
  LossScaleOptions o;
  const std::string range =
      NumberText(LossScaler::kMinScale) + " to " + NumberText(LossScaler::kMaxScale);
  if (!(init >= LossScaler::kMinScale && init <= LossScaler::kMaxScale)) {
    return Status::InvalidArgument("--loss-scale-init " + NumberText(init) +
                                   " is not accepted: a number from " + range);
  }
  if (growth_interval < 1) {
    return Status::InvalidArgument("--loss-scale-growth-interval " +
                                   std::to_string(growth_interval) +
                                   " is not accepted: a whole number >= 1");
  }
  o.growth_interval = growth_interval;
  if (text == "off") return o;
  if (text == "dynamic") {
    o.mode = LossScaleOptions::Mode::kDynamic;
    o.scale = init;
    return o;
  }
  char* end = nullptr;
  const double s = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() ||
      !(s >= LossScaler::kMinScale && s <= LossScaler::kMaxScale)) {
    return Status::InvalidArgument("--loss-scale '" + text.substr(0, 40) +
                                   "' is not accepted: off, dynamic, or a static scale from " +
                                   range);
  }
  o.mode = LossScaleOptions::Mode::kStatic;
  o.scale = s;
  return o;
}

std::string DescribeLossScale(const LossScaleOptions& o) {
  switch (o.mode) {
    case LossScaleOptions::Mode::kOff:
      return "off";
    case LossScaleOptions::Mode::kStatic:
      return "static " + NumberText(o.scale);
    case LossScaleOptions::Mode::kDynamic:
      return "dynamic from " + NumberText(o.scale) + " (x2 after " +
             std::to_string(o.growth_interval) + " finite steps, x0.5 on overflow)";
  }
  return "off";
}

LossScaler::LossScaler(const LossScaleOptions& o)
    : o_(o), scale_(o.mode == LossScaleOptions::Mode::kOff ? 1.0 : o.scale) {}

void LossScaler::AfterStep(bool overflow) {
  if (o_.mode != LossScaleOptions::Mode::kDynamic) return;
  if (overflow) {
    scale_ = std::max(kMinScale, scale_ * kBackoff);
    finite_in_a_row_ = 0;
    ++backoffs_;
    return;
  }
  if (++finite_in_a_row_ >= o_.growth_interval) {
    scale_ = std::min(kMaxScale, scale_ * kGrowth);
    finite_in_a_row_ = 0;
  }
}

Status LossScaler::Restore(const State& s) {
  if (!(s.scale >= kMinScale && s.scale <= kMaxScale) || s.finite_in_a_row < 0 ||
      s.finite_in_a_row >= o_.growth_interval) {
    return Status::InvalidArgument("loss scale " + NumberText(s.scale) + " after " +
                                   std::to_string(s.finite_in_a_row) + " finite steps");
  }
  if (o_.mode == LossScaleOptions::Mode::kDynamic) {
    scale_ = s.scale;
    finite_in_a_row_ = s.finite_in_a_row;
  }
  return Status::Ok();
}

}  // namespace cpd::runtime
