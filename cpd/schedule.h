// Training schedules: CPT's cyclic forward precision and its training-cost model (Fu et al.,
// "CPT: Efficient Deep Neural Network Training via Cyclic Precision", ICLR 2021), and the
// per-step learning-rate schedules of the trainer.
//
// Everything here is a pure function of its arguments: no state, no threads, no allocation
// beyond the returned values. Safe to call from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cpd/status.h"

namespace cpd {

// ---- CPT cyclic precision ------------------------------------------------------------------

// The forward (weight and activation) bit-width of CPT, cycling `periods` times over a run of
// `total_iters` iterations between min_bits and max_bits along a cosine. Iteration t of a run
// uses BitsAt(t) bits; the backward precision stays fixed (CPT's "grad bits").
//
// Aggregate; the defaults are CPT's CIFAR setting (3-8 bits, 32 periods) with total_iters to be
// filled in by the caller. REQUIRED before use: Validate().ok().
struct CyclicPrecision {
  int min_bits = 3;
  int max_bits = 8;
  int periods = 32;         // cycles over the run (CPT's --num_cyclic_period)
  int64_t total_iters = 1;  // iterations of the whole run

  // Iterations per cycle: T = total_iters / periods (integer division, as the official code's
  // int(iters / num_cyclic_period)), at least 1. Iterations past periods * T start a further,
  // partial cycle.
  int64_t CycleLength() const;

  // Bits at iteration t >= 0 (negative t is treated as t mod T):
  //   b_t = rint(MIN + 0.5 * (MAX - MIN) * (1 - cos(pi * (t mod T) / T)))
  // rint (round half to even), not ceil: this is what CPT's official code computes
  // (np.rint(min + 0.5*(max-min)*(1 + cos(pi*((t % T)/T) + pi)))), which the paper's
  // ceil-formula does not match. Always in [min_bits, max_bits] for a valid schedule.
  int BitsAt(int64_t t) const;

  // OK, or InvalidArgument naming the bad field, its value and what is accepted: bits in
  // 1..32, min_bits <= max_bits, periods >= 1, total_iters >= 1.
  Status Validate() const;
};

// ---- CPT training-cost model ---------------------------------------------------------------
//
// CPT (Fu et al., ICLR 2021; official train.py) charges one quantised layer, per iteration and
// per multiply-accumulate, with forward bits b and backward bits g:
//   forward  b*b/1024,   error gradient  b*g/1024,   weight gradient  b*g/1024
// (1024 = 32*32, so a full-precision MAC costs 1), averaged over the three computations:
//   c(b, g) = (b^2 + 2*b*g) / (3 * 1024).
// A layer with M MACs costs M * c(b, g); a network costs the sum over its quantised layers.
//
// Relative cost of a schedule b_0..b_{N-1} against static training at s forward bits, same g:
//   RelativeCost = (1/N * sum_t c(b_t, g)) / c(s, g) - 1
// (negative = cheaper). When every quantised layer follows the same schedule, the MAC weights
// cancel in this ratio, so it needs no layer sizes; TrainingCost gives the absolute, MAC-weighted
// figure.
//
// What the CPT numbers mean by "T": the cycle length (iterations per cycle). The average is
// taken over whole cycles, so it depends only on T, not on how many cycles the run has: CPT 3-8
// forward bits, g = 8, against static 8 bits gives
//   T =  2000: -36.6729% (e.g. CIFAR: 64000 iterations / 32 periods; or 1 period of 2000)
//   T = 10000: -36.6617% (e.g. 320000 iterations / 32 periods; or 1 period of 10000)
// i.e. -36.67% and -36.66% to two decimals. (With ceil instead of rint the same schedules give
// about -29.9%, so these numbers also pin the rounding.)

// c(b, g) above: the cost of one MAC at forward bits b and backward bits g, in units of a
// 32-bit MAC. REQUIRES b >= 0, g >= 0.
double MacCost(int fwd_bits, int grad_bits);

// Average over the iterations of sum_l layer_macs[l] * c(b_t, g). With no layer sizes, one layer
// of one MAC (i.e. the per-MAC average). 0 for an empty schedule.
double TrainingCost(const std::vector<int>& bits_per_iter, int grad_bits,
                    const std::vector<double>& layer_macs = {});

// RelativeCost above for an explicit schedule (one entry per iteration). 0 for an empty or a
// static schedule at static_bits. REQUIRES static_bits >= 1, grad_bits >= 0; NaN otherwise.
double RelativeCost(const std::vector<int>& bits_per_iter, int grad_bits, int static_bits);

// RelativeCost of the whole cyclic schedule (iterations 0..total_iters-1), without building it:
// O(T) time. NaN when cpt.Validate() fails or static_bits < 1 or grad_bits < 0.
double CptRelativeCost(const CyclicPrecision& cpt, int grad_bits, int static_bits);

// The cost model's two precisions of one iteration: forward bits b (weights and activations)
// and backward bits g (errors; CPT's "grad bits"). Used for the schedule of any run and for the
// static reference it is compared with ("8/8": b = 8, g = 8).
struct StepBits {
  int fwd = 8;
  int grad = 8;
  bool operator==(const StepBits&) const = default;
};

// "FWD/BWD", e.g. "8/8".
std::string StepBitsText(StepBits bits);
// Parses "FWD/BWD", two integers in 1..32 (nothing else, no spaces); InvalidArgument quoting the
// text and saying what is accepted otherwise.
Result<StepBits> ParseStepBits(std::string_view text);

// RelativeCost of a schedule whose backward bits may change too, against static training at
// `reference` (the forward and the backward bits of the reference both enter its cost):
//   (1/N * sum_t c(b_t, g_t)) / c(reference.fwd, reference.grad) - 1.
// With g_t = reference.grad = g this is RelativeCost(b, g, reference.fwd). 0 for an empty
// schedule. NaN when reference.fwd < 1, reference.grad < 0 or some b_t, g_t < 0.
double RelativeCost(const std::vector<StepBits>& steps, StepBits reference);

// ---- Learning-rate schedules ---------------------------------------------------------------

// The learning rate of each optimiser step, a pure function of the step index (so a resumed
// run continues exactly). Steps count from 0; step s is the s-th call of Optimizer::Step.
//
//   warm-up (warmup_steps = W > 0): the main schedule times min(1, (s + 1) / W), a linear ramp
//     from base/W at step 0 to the full value at step W - 1 (gradual warm-up, Goyal et al.,
//     2017; starting at base/W rather than 0 so that no step runs at lr 0).
//   kConstant: base_lr.
//   kStep:     base_lr * gamma^k, k = number of milestones <= s (PyTorch MultiStepLR);
//              milestones are absolute step indices, warm-up included.
//   kCosine:   PyTorch CosineAnnealingLR, evaluated per step after the warm-up:
//                eta_min + (base_lr - eta_min) * (1 + cos(pi * t / T)) / 2,
//              t = s - W, T = total_steps - W (at least 1), eta_min = min_lr; t is clamped to
//              [0, T], so steps past total_steps stay at min_lr (PyTorch would rise again).
//
// REQUIRED before use: Validate().ok() (ParseLrSchedule validates).
struct LrSchedule {
  enum Kind { kConstant, kStep, kCosine };
  Kind kind = kConstant;
  double base_lr = 0.1;
  int64_t total_steps = 1;          // steps of the whole run, warm-up included (cosine's horizon)
  int64_t warmup_steps = 0;         // linear warm-up; 0 = none
  std::vector<int64_t> milestones;  // kStep: strictly increasing step indices
  double gamma = 0.1;               // kStep: factor per milestone
  double min_lr = 0.0;              // kCosine: eta_min

  double At(int64_t step) const;
  // OK, or InvalidArgument naming the field: base_lr > 0 and finite, total_steps >= 1,
  // 0 <= warmup_steps <= total_steps, 0 <= min_lr <= base_lr, gamma > 0 and finite, milestones
  // >= 0 and strictly increasing, and at least one milestone for kStep.
  Status Validate() const;
};

const char* LrScheduleName(LrSchedule::Kind kind);  // "constant" | "step" | "cosine"
// The kind named `name`; InvalidArgument naming the value and listing what is accepted.
Result<LrSchedule::Kind> ParseLrScheduleKind(std::string_view name);

// Builds and validates a schedule of a given kind (fields a kind does not use are stored but
// ignored).
Result<LrSchedule> MakeLrSchedule(LrSchedule::Kind kind, double base_lr, int64_t total_steps,
                                  int64_t warmup_steps = 0, std::vector<int64_t> milestones = {},
                                  double gamma = 0.1, double min_lr = 0.0);

// Builds and validates a schedule from its name ("constant", "step", "cosine"); errors name the
// bad value and list what is accepted. Fields a kind does not use are stored but ignored.
Result<LrSchedule> ParseLrSchedule(std::string_view name, double base_lr, int64_t total_steps,
                                   int64_t warmup_steps = 0, std::vector<int64_t> milestones = {},
                                   double gamma = 0.1, double min_lr = 0.0);

// ---- Large-batch learning-rate scaling -----------------------------------------------------

// The base learning rate of a run at global batch B, from an lr tuned at batch B0:
//   kNone:   lr
//   kLinear: lr * B / B0          (Goyal et al., "Accurate, Large Minibatch SGD: Training
//                                  ImageNet in 1 Hour", 2017)
//   kSqrt:   lr * sqrt(B / B0)    (Krizhevsky, "One weird trick for parallelizing
//                                  convolutional neural networks", 2014; Hoffer, Hubara, Soudry,
//                                  "Train longer, generalize better", 2017)
// A pure function of its arguments, so a resumed run gets the same lr.
enum class LrScaling { kNone, kLinear, kSqrt };
const char* LrScalingName(LrScaling rule);  // "none" | "linear" | "sqrt"
// The rule named `name`; InvalidArgument "lr-scaling 'NAME' (accepted: none, linear, sqrt)".
Result<LrScaling> ParseLrScaling(std::string_view name);
// REQUIRES global_batch >= 1 and base_batch >= 1.
double ScaleLr(double lr, LrScaling rule, int64_t global_batch, int64_t base_batch);

}  // namespace cpd
