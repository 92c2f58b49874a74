// Loss scaling (Micikevicius et al., Mixed Precision Training, ICLR 2018): the backward pass
// starts from S x dL/dlogits, so that every error (E) and weight gradient (G) is S times larger
// when it reaches its quantisation site, and the summed gradient is divided by S before the
// optimiser. A format without a scale of its own (e4m3, e2m1, fp16 at E) otherwise flushes the
// typical 1e-3 error to zero; a per-tensor or per-block scale (int8, fp134, mxfp*) needs none.
//
// Static: S fixed. Dynamic (PyTorch's GradScaler): S starts at `init`, halves after a step whose
// gradient holds NaN/Inf on some rank (that step is skipped, as every non-finite step is) and
// doubles after `growth_interval` finite steps in a row. Every rank sees the same skips (the
// all-reduce agrees on them), so S is the same everywhere; checkpoints keep it.
//
// A saturating format (e4m3 and the OCP formats by default) clips an overflowing error to its
// largest value instead of making it Inf, so dynamic scaling cannot see that overflow: with a
// saturating E or G format, use a static scale, or the format's :inf variant.
#pragma once

#include <cstdint>
#include <string>

#include "cpd/status.h"

namespace cpd::runtime {

struct LossScaleOptions {
  enum class Mode { kOff, kStatic, kDynamic };
  Mode mode = Mode::kOff;
  double scale = 1;                // kStatic: S; kDynamic: the initial S
  int64_t growth_interval = 2000;  // kDynamic: finite steps in a row before S doubles
};

// --loss-scale: "off", "dynamic" or a number > 0 (static); `init` and `growth_interval` are the
// dynamic mode's (--loss-scale-init, --loss-scale-growth-interval). InvalidArgument naming the
// flag, the value and what is accepted.
Result<LossScaleOptions> ParseLossScale(const std::string& text, double init,
                                        int64_t growth_interval);
// "off", "static 1024", "dynamic from 65536 (x2 after 2000 finite steps, x0.5 on overflow)".
std::string DescribeLossScale(const LossScaleOptions& o);

class LossScaler {
 public:
  static constexpr double kGrowth = 2, kBackoff = 0.5;
  // The range S stays in: a power of two times the initial value cannot leave float32.
  static constexpr double kMinScale = 0x1p-24, kMaxScale = 0x1p64;

  explicit LossScaler(const LossScaleOptions& o);

  bool enabled() const { return o_.mode != LossScaleOptions::Mode::kOff; }
  float scale() const { return float(scale_); }
  // After a step: `overflow` when its summed gradient held NaN/Inf (the step was skipped).
  void AfterStep(bool overflow);
  int64_t backoffs() const { return backoffs_; }  // in this process's run

  // What a checkpoint keeps, and its restore (InvalidArgument for values no scaler reaches).
  struct State {
    double scale = 1;
    int64_t finite_in_a_row = 0;
  };
  State state() const { return {scale_, finite_in_a_row_}; }
  Status Restore(const State& s);

 private:
  LossScaleOptions o_;
  double scale_;
  int64_t finite_in_a_row_ = 0;
  int64_t backoffs_ = 0;
};

}  // namespace cpd::runtime
