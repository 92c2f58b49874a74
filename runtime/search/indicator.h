// The gradient-angle indicator of Lee, Park and Jeon ("Toward Efficient Low-Precision Training:
// Data Format Optimization and Hysteresis Quantization", ICLR 2022, §2.3): how far quantising a
// network's data flow to a candidate format turns its weight gradients. For a trained model and
// one mini-batch, g is the fp32 weight gradient of every Linear/Conv2d layer; g_F is the same
// gradient with the activations (A), the errors (E), or both, quantised to F. The indicator is
// the angle arccos(cos(g, g_F)) in degrees, per layer and for the whole network (all layers'
// weight gradients concatenated), averaged over mini-batches. A smaller angle predicts better
// training in F; the paper ranks candidate formats by it.
//
// The quantisation is exactly cpd-train's: the SiteQuantizer's A and E sites, with their
// formats, rounding, scale groups and random streams, at the step of the batch, propagated
// through the network as in training (a quantised activation changes every later layer's
// forward; a quantised error every earlier layer's backward). Weights and weight gradients stay
// fp32: the paper separates data-flow quantisation from weight quantisation.
//
// Cost, per batch: one fp32 forward and backward shared by every candidate evaluated on the
// batch; per candidate, E needs one backward (reusing the fp32 forward), A one forward and one
// backward, and A+E one more backward (reusing A's forward).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cpd/format.h"
#include "cpd/quantize.h"
#include "cpd/status.h"
#include "runtime/nn/layers.h"
#include "runtime/nn/quant_sites.h"
#include "runtime/train/gradients.h"

namespace cpd::runtime {

// Which data flows are quantised to the candidate.
enum class SiteSet { kA = 0, kE = 1, kAE = 2 };
constexpr int kNumSiteSets = 3;
const char* SiteSetName(SiteSet s);                                   // "A", "E", "A+E"
Result<std::vector<SiteSet>> ParseSiteSets(const std::string& list);  // "A,E,A+E" (or "AE")

struct IndicatorOptions {
  std::vector<SiteSet> sites = {SiteSet::kA, SiteSet::kE, SiteSet::kAE};
  Rounding a_rounding = Rounding::kNearest;
  Rounding e_rounding = Rounding::kNearest;
  // Layers left in fp32 at every site, as cpd-train's --keep-fp32 ("first", "last", names).
  std::vector<std::string> keep_fp32;
  uint64_t seed = 0;  // the stochastic-rounding stream (as cpd-train derives it from --seed)
};

// The angle, in degrees, between two sets of per-layer gradients `a` and `b` (same shapes), per
// layer and for all layers concatenated. Computed as 2 atan2(|a' - b'|, |a' + b'|) with a', b'
// the unit vectors (Kahan's formula): exactly 0 for equal gradients and accurate for small
// angles, where arccos of a rounded cosine is not. A zero gradient against a nonzero one is 90
// degrees, two zeros 0; a gradient holding Inf or NaN (a format that overflowed) 180, the worst
// angle. Every angle lies in [0, 180].
double GradientAngle(const std::vector<std::vector<float>>& a,
                     const std::vector<std::vector<float>>& b, std::vector<double>* per_layer);

// Angles of one candidate on one batch, in degrees.
struct BatchAngles {
  // [site set][layer]; layers in the order of GradientAngleIndicator::layers(). Only the site
  // sets asked for are filled.
  std::vector<double> layer[kNumSiteSets];
  double network[kNumSiteSets] = {0, 0, 0};
};

class GradientAngleIndicator {
 public:
  // `model` (REQUIRED, outlives the indicator) must be the trained model, on its device. Fails
  // on an empty site list or keep_fp32 naming no layer of the model.
  static Result<std::unique_ptr<GradientAngleIndicator>> Create(Sequential* model,
                                                                IndicatorOptions options);
  ~GradientAngleIndicator();

  // The Linear/Conv2d layers whose weight gradients are compared, in model order.
  const std::vector<std::string>& layers() const { return layer_names_; }

  // The fp32 forward and backward of batch `index` (x on the model's device), kept for the
  // candidates that follow.
  Status BeginBatch(const Tensor& x, const std::vector<int32_t>& y, int64_t index);
  // The angles of each candidate on the current batch (the candidates' order is kept). A
  // candidate the model cannot take (a spec that does not parse) is an InvalidArgument.
  Result<std::vector<BatchAngles>> Evaluate(const std::vector<Format>& candidates);

 private:
  GradientAngleIndicator() = default;
  Status Configure(const Format* a, const Format* e);
  std::vector<std::vector<float>> WeightGradients() const;

  Sequential* model_ = nullptr;
  IndicatorOptions options_;
  std::vector<Layer*> quant_layers_;
  std::vector<Param*> weights_;  // the .weight of every Linear/Conv2d layer
  std::vector<std::string> layer_names_;
  std::unique_ptr<SiteQuantizer> quant_;
  std::unique_ptr<GradientPass> pass_;
  Tensor x_;
  std::vector<int32_t> y_;
  int64_t index_ = 0;
  bool fp32_forward_ = false;                  // the layers hold the fp32 forward pass of the batch
  std::vector<std::vector<float>> reference_;  // the fp32 weight gradients of the batch
};

}  // namespace cpd::runtime
