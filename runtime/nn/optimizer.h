// First-order optimisers over fp32 master weights: SGD with (Nesterov) momentum and coupled
// weight decay, LARS for large batches, and AdamW (decoupled weight decay); and the clipping of
// the gradients by their global norm that precedes an update. The update reads Param::grad and
// writes Param::value in place; gradients stay as they are until ZeroGrad() (ClipGradNorm scales
// them).
//
// Determinism: every element is updated by the same fixed sequence of float operations (the
// build forbids FMA contraction), and the norms of LARS and of ClipGradNorm are summed in a fixed
// order (float within 64-element blocks, double across blocks and across fixed 16 Ki-element
// chunks, chunks merged in order), so results are bit-identical for any thread count and across
// runs. Thread-safety: one Optimizer must not be used from two threads at once; Step itself runs
// on OpenMP threads when there is enough work.
//
// Devices: all params must be on one device. On the GPU (CUDA build), Step runs the same update
// rules in CUDA kernels (runtime/engine/cuda_ops.h: one launch over all params, in the CPU's 16 Ki
// chunks) with the same float operations (AdamW's sqrt and division are IEEE-rounded on both)
// and the same summation order of the norms, so a GPU step equals a CPU step bit for bit; LARS
// and ClipGradNorm copy their per-chunk sums to the host (one wait each). Momentum buffers and
// AdamW's moments live with the params (AdamW's step count on the host); State() points at them
// there (copy a CUDA buffer to the host before reading it: Tensor::To/CopyToHost); LoadState
// copies in.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cpd/status.h"
#include "runtime/engine/tensor.h"
#include "runtime/nn/layer.h"

namespace cpd::runtime {

// The update rule (below).
enum class OptimizerKind { kSgd, kLars, kAdamW };
// "sgd" | "lars" | "adamw"; else InvalidArgument "optimizer 'NAME' (accepted: sgd, lars, adamw)".
Result<OptimizerKind> ParseOptimizerKind(std::string_view name);
const char* OptimizerKindName(OptimizerKind kind);

// Which params LARS leaves out of its trust ratio (below).
enum class LarsExclude { kBiasBn, kNone };
// "bias-bn" | "none"; else InvalidArgument "lars-exclude 'NAME' (accepted: bias-bn, none)".
Result<LarsExclude> ParseLarsExclude(std::string_view name);
const char* LarsExcludeName(LarsExclude exclude);

// The bias/BatchNorm learning rate as a fraction of the weights' under LARS: 0.0048 / 0.2 from
// Barlow Twins (Zbontar et al., "Barlow Twins: Self-Supervised Learning via Redundancy
// Reduction", 2021; the official code's --learning-rate-biases 0.0048 and
// --learning-rate-weights 0.2, with LARS excluding biases and BatchNorm from adaptation).
constexpr double kLarsExcludedLrRatio = 0.024;  // = 0.0048 / 0.2

// AdamW's defaults: torch.optim.AdamW's (Loshchilov & Hutter, "Decoupled Weight Decay
// Regularization", 2019). nanoGPT trains GPT-2 with beta2 0.95 instead, which forgets a burst of
// large gradients sooner; that is a recipe's choice, given explicitly (docs/cpd-train.md).
constexpr double kAdamBeta1 = 0.9;
constexpr double kAdamBeta2 = 0.999;
constexpr double kAdamEps = 1e-8;

struct OptimizerOptions {
  double momentum = 0.9;  // >= 0; 0 keeps no momentum buffers (SGD, LARS; AdamW ignores it)
  // >= 0, only for params with Param::weight_decay: coupled L2 (SGD, LARS), decoupled (AdamW)
  double weight_decay = 0.0;
  bool nesterov = false;  // REQUIRES momentum > 0 (as torch.optim.SGD) and not AdamW
  OptimizerKind kind = OptimizerKind::kSgd;
  double lars_eta = 0.001;  // LARS trust coefficient, > 0
  // LARS only: kBiasBn leaves params with weight_decay == false (biases, BatchNorm) out of the
  // trust ratio and runs them at lr * lars_excluded_lr_ratio (finite, > 0); kNone applies the
  // trust ratio to every param (the ratio is then unused).
  LarsExclude lars_exclude = LarsExclude::kBiasBn;
  double lars_excluded_lr_ratio = kLarsExcludedLrRatio;
  // AdamW: the moments' decay rates, each in [0, 1), and the denominator's eps (finite, > 0).
  double beta1 = kAdamBeta1, beta2 = kAdamBeta2, eps = kAdamEps;
  int threads = 0;  // OpenMP threads for Step; 0 = the OpenMP default

  // OK, or InvalidArgument naming the field, its value and what is accepted.
  Status Validate() const;
};

// Update rules, per parameter tensor w with gradient g, learning rate lr (the argument of Step),
// momentum m, weight decay wd (wd = 0 for params with weight_decay == false):
//
// SGD, exactly torch.optim.SGD (dampening 0), in float32:
//   d = g + wd * w
//   buf = m * buf + d            (buf starts at 0, so the first step gives buf = d as in torch)
//   d = nesterov ? d + m * buf : buf
//   w = w - lr * d
// With m = 0 there is no buffer: w = w - lr * (g + wd * w).
//
// LARS (You, Gitman, Ginsburg, "Large Batch Training of Convolutional Networks", 2017,
// Algorithm 1, in the form of the MLPerf reference LARS optimiser):
//   trust = eta * ||w|| / (||g|| + wd * ||w||)     (per tensor; L2 norms, ratio in double)
//   trust = 1 when ||w|| = 0 or ||g|| = 0 (plain momentum SGD at lr for that step)
//   excluded params (lars_exclude kBiasBn: those with weight_decay == false, i.e. biases and
//           BatchNorm) take no trust ratio: plain momentum SGD at lr * lars_excluded_lr_ratio.
//           Without the ratio they would run at the raw base lr, which for large-batch LRs
//           (e.g. 16) throws the network to chance level within a few steps.
//   with kNone every param takes the trust ratio (You et al.'s original); a zero-initialised
//           bias then runs its first step at the raw lr (||w|| = 0)
//   d = g + wd * w                 (wd = 0 for params with weight_decay == false, in every mode)
//   v = m * v + (lr * f) * d       (f = trust, or the excluded ratio; v includes the lr)
//   w = w - (nesterov ? m * v + (lr * f) * d : v)
//
// Optimiser state (for checkpoints) is one buffer per param, shaped like it, under the key
// "momentum/<param name>" (SGD) or "lars_momentum/<param name>" (LARS, whose buffer includes lr):
// the two are not interchangeable. With momentum 0 there is no state.
class Optimizer {
 public:
  // Validates the options and the params: non-null, unique non-empty names, values and
  // gradients all on one device, grad.numel() == value.numel().
  static Result<std::unique_ptr<Optimizer>> Create(std::vector<Param*> params,
                                                   const OptimizerOptions& options);
  // As Create; throws std::invalid_argument with the same message where Create fails.
  // The Params must outlive the Optimizer and keep their element counts.
  Optimizer(std::vector<Param*> params, OptimizerOptions options);
  ~Optimizer();

  // One update of every param from its current gradient at learning rate lr (REQUIRES finite,
  // >= 0). Cost: one pass over value, grad and buffer (20 bytes per element; AdamW 28); LARS
  // adds a read pass over value and grad for the norms. Runs on OpenMP threads from 32 Ki
  // elements in all.
  void Step(double lr);
  // The global L2 norm of every gradient (in double, summed in the fixed order above), and,
  // when max_norm > 0 and the norm is finite and above max_norm, every gradient scaled as
  // clip_grad_norm_ does (above). Returns the norm before clipping: NaN or Inf when a gradient
  // is, or when float block sums overflow (|g| beyond ~1e18), which leaves the gradients as they
  // are. max_norm REQUIRES >= 0 (0: only the norm). One read pass over the gradients, and a write
  // pass when it clips.
  double ClipGradNorm(double max_norm);
  // Sets every gradient to zero.
  void ZeroGrad();

  // (key, buffer) for every piece of state, in param order; the pointers stay valid while the
  // Optimizer lives and see later steps.
  std::vector<std::pair<std::string, const Tensor*>> State() const;
  // Restores what State() exported (key -> values). Every key must be present with the right
  // element count and no other key may appear; otherwise returns InvalidArgument naming the key
  // and changes nothing. After it, Step continues bit-identically to the saved optimiser.
  Status LoadState(const std::map<std::string, std::vector<float>>& state);

  const OptimizerOptions& options() const { return options_; }
  const std::vector<Param*>& params() const { return params_; }
  // AdamW: the steps taken (t of the last Step); 0 for SGD and LARS.
  int64_t adam_steps() const { return adam_steps_; }
  // Per param, the LARS trust ratio used by the last Step (1 for SGD and for params that took
  // none: excluded, ||w|| = 0 or ||g|| = 0).
  const std::vector<double>& last_trust_ratios() const { return trust_; }
  // The learning rate param i gets from Step(lr): lr * trust, lr * the excluded ratio, or lr.
  // The one formula of the CPU and the GPU paths, so their coefficients are identical.
  double ParamLr(size_t i, double lr) const;

 private:
  struct Chunk {
    size_t param;
    size_t begin, end;
  };
  bool lars() const { return options_.kind == OptimizerKind::kLars; }
  bool adamw() const { return options_.kind == OptimizerKind::kAdamW; }
  // LARS leaves param i out of the trust ratio (lars_exclude kBiasBn and no weight decay).
  bool Excluded(size_t i) const;
  static Status Check(const std::vector<Param*>& params, const OptimizerOptions& options);
  // Every state tensor under its key, in param order (AdamW: m, v per param, then the step).
  std::vector<std::pair<std::string, Tensor*>> Slots();
  void StepAdamW(double lr);
  // The per-chunk sums of g^2 (in partial_[2c + 1]) on the params' device.
  void GradPartials();
  void ScaleGrads(float factor);
  void ComputeTrustRatios(int threads);
  // Derives trust_ from per-chunk sums of squares (partial_), as ComputeTrustRatios does.
  void TrustFromPartials();
  void StepCuda(double lr);
  void StepAdamWCuda(double lr);
  // The GPU's chunk table, rebuilt when a param's storage has moved.
  void SyncCudaChunks();

  struct CudaState;  // the GPU's chunk table and coefficients (optimizer.cc)
  std::unique_ptr<CudaState> cuda_;

  std::vector<Param*> params_;
  OptimizerOptions options_;
  std::vector<Tensor> momentum_;         // per param; empty when options_.momentum == 0 or AdamW
  std::vector<Tensor> adam_m_, adam_v_;  // AdamW: per param; empty otherwise
  Tensor adam_step_state_;               // AdamW: [t / 2^24, t mod 2^24] on the host
  int64_t adam_steps_ = 0;
  std::vector<Chunk> chunks_;    // every param cut into <= kChunk-element pieces
  std::vector<double> partial_;  // per chunk, sum w^2 (LARS) and sum g^2 (LARS, clipping)
  std::vector<double> trust_;
  size_t total_elements_ = 0;
};

}  // namespace cpd::runtime
