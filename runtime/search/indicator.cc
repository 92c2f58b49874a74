#include "runtime/search/indicator.h"

#include <algorithm>
#include <cmath>

namespace cpd::runtime {

const char* SiteSetName(SiteSet s) {
  switch (s) {
    case SiteSet::kA:
      return "A";
    case SiteSet::kE:
      return "E";
    case SiteSet::kAE:
      return "A+E";
  }
  return "?";
}

Result<std::vector<SiteSet>> ParseSiteSets(const std::string& list) {
  std::vector<SiteSet> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = list.find(',', start);
    const std::string item =
        list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    SiteSet s;
    if (item == "A") {
      s = SiteSet::kA;
    } else if (item == "E") {
      s = SiteSet::kE;
    } else if (item == "A+E" || item == "AE") {
      s = SiteSet::kAE;
    } else {
      return Status::InvalidArgument("site set '" + item + "' (accepted: A, E, A+E)");
    }
    if (std::find(out.begin(), out.end(), s) != out.end()) {
      return Status::InvalidArgument("site set '" + item + "' given twice");
    }
    out.push_back(s);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

Result<std::unique_ptr<GradientAngleIndicator>> GradientAngleIndicator::Create(
    Sequential* model, IndicatorOptions options) {
  if (options.sites.empty()) return Status::InvalidArgument("no site set to evaluate");
  std::unique_ptr<GradientAngleIndicator> ind(new GradientAngleIndicator());
  ind->model_ = model;
  ind->options_ = std::move(options);
  for (Layer* l : model->Flatten()) {
    if (!l->Quantizable()) continue;
    ind->quant_layers_.push_back(l);
    for (Param* p : l->Params()) {
      if (p->name == l->name() + ".weight") {
        ind->weights_.push_back(p);
        ind->layer_names_.push_back(l->name());
      }
    }
  }
  if (ind->weights_.empty()) return Status::InvalidArgument("the model has no Linear/Conv2d layer");
  PrecisionConfig fp32;
  fp32.keep_fp32 = ind->options_.keep_fp32;
  fp32.seed = ind->options_.seed;
  CPD_ASSIGN_OR_RETURN(ind->quant_, SiteQuantizer::Create(fp32, ind->quant_layers_));
  ind->pass_ = std::make_unique<GradientPass>(model);
  return ind;
}

GradientAngleIndicator::~GradientAngleIndicator() {
  // The hooks point at the quantiser, which goes now.
  for (Layer* l : quant_layers_) l->SetQuantHooks(nullptr);
}

// A (and E) quantised to the given formats (null: fp32), everything else fp32, the random
// streams of the current batch.
Status GradientAngleIndicator::Configure(const Format* a, const Format* e) {
  PrecisionConfig pc;
  pc.global[int(Site::kActivation)] = {a != nullptr ? a->spec() : "fp32", options_.a_rounding};
  pc.global[int(Site::kError)] = {e != nullptr ? e->spec() : "fp32", options_.e_rounding};
  pc.keep_fp32 = options_.keep_fp32;
  pc.seed = options_.seed;
  CPD_RETURN_IF_ERROR(quant_->Reconfigure(std::move(pc)));
  quant_->InstallHooks(quant_layers_);
  quant_->SetStep(index_);
  quant_->SetWorker(0);
  return Status::Ok();
}

std::vector<std::vector<float>> GradientAngleIndicator::WeightGradients() const {
  std::vector<std::vector<float>> g(weights_.size());
  for (size_t i = 0; i < weights_.size(); ++i) {
    g[i].resize(weights_[i]->grad.numel());
    weights_[i]->grad.CopyToHost(g[i].data());
  }
  return g;
}

namespace {

double Dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * double(b[i]);
  return s;
}

// |a/na - b/nb|^2 and |a/na + b/nb|^2, added to *diff2 and *sum2.
void DiffSum(const std::vector<float>& a, double na, const std::vector<float>& b, double nb,
             double* diff2, double* sum2) {
  for (size_t i = 0; i < a.size(); ++i) {
    const double u = double(a[i]) / na, v = double(b[i]) / nb;
    *diff2 += (u - v) * (u - v);
    *sum2 += (u + v) * (u + v);
  }
}

double Degrees(double diff2, double sum2) {
  return 2.0 * std::atan2(std::sqrt(diff2), std::sqrt(sum2)) * (180.0 / M_PI);
}

// The angle when a norm is zero or not finite. A gradient holding Inf or NaN (a format that
// overflowed) keeps no direction: 180 degrees, the worst angle, ranks its format last, where the
// arithmetic would give NaN or even 0 (NaN fails every comparison) and every angle stays in
// [0, 180], which a resumed search checks.
double SpecialCase(double norm_a, double norm_b) {
  if (!std::isfinite(norm_a) || !std::isfinite(norm_b)) return 180.0;
  return norm_a == norm_b ? 0.0 : 90.0;
}

bool Special(double norm_a, double norm_b) {
  return norm_a == 0 || norm_b == 0 || !std::isfinite(norm_a) || !std::isfinite(norm_b);
}

}  // namespace

double GradientAngle(const std::vector<std::vector<float>>& a,
                     const std::vector<std::vector<float>>& b, std::vector<double>* per_layer) {
  const size_t layers = a.size();
  std::vector<double> na(layers), nb(layers);
  double total_a = 0, total_b = 0;
  for (size_t l = 0; l < layers; ++l) {
    const double a2 = Dot(a[l], a[l]), b2 = Dot(b[l], b[l]);
    na[l] = std::sqrt(a2);
    nb[l] = std::sqrt(b2);
    total_a += a2;
    total_b += b2;
  }
  const double net_a = std::sqrt(total_a), net_b = std::sqrt(total_b);
  per_layer->assign(layers, 0.0);
  double net_diff = 0, net_sum = 0;
  for (size_t l = 0; l < layers; ++l) {
    if (Special(na[l], nb[l])) {
      (*per_layer)[l] = SpecialCase(na[l], nb[l]);
    } else {
      double diff = 0, sum = 0;
      DiffSum(a[l], na[l], b[l], nb[l], &diff, &sum);
      (*per_layer)[l] = Degrees(diff, sum);
    }
    if (!Special(net_a, net_b)) DiffSum(a[l], net_a, b[l], net_b, &net_diff, &net_sum);
  }
  if (Special(net_a, net_b)) return SpecialCase(net_a, net_b);
  return Degrees(net_diff, net_sum);
}

Status GradientAngleIndicator::BeginBatch(const Tensor& x, const std::vector<int32_t>& y,
                                          int64_t index) {
  x_ = x;
  y_ = y;
  index_ = index;
  model_->SetStep(uint64_t(index));
  CPD_RETURN_IF_ERROR(Configure(nullptr, nullptr));
  pass_->Forward(x_, y_);
  fp32_forward_ = true;
  pass_->Backward();
  reference_ = WeightGradients();
  return Status::Ok();
}

Result<std::vector<BatchAngles>> GradientAngleIndicator::Evaluate(
    const std::vector<Format>& candidates) {
  auto wants = [this](SiteSet s) {
    return std::find(options_.sites.begin(), options_.sites.end(), s) != options_.sites.end();
  };
  std::vector<BatchAngles> out(candidates.size());
  auto record = [&](size_t c, SiteSet s) {
    out[c].network[int(s)] = GradientAngle(reference_, WeightGradients(), &out[c].layer[int(s)]);
  };
  // E alone first: every candidate's backward reuses the fp32 forward pass of BeginBatch (run
  // again only when an earlier Evaluate on this batch left a quantised one in the layers).
  if (wants(SiteSet::kE)) {
    if (!fp32_forward_) {
      CPD_RETURN_IF_ERROR(Configure(nullptr, nullptr));
      pass_->Forward(x_, y_);
      fp32_forward_ = true;
    }
    for (size_t c = 0; c < candidates.size(); ++c) {
      CPD_RETURN_IF_ERROR(Configure(nullptr, &candidates[c]));
      pass_->Backward();
      record(c, SiteSet::kE);
    }
  }
  if (wants(SiteSet::kA) || wants(SiteSet::kAE)) {
    for (size_t c = 0; c < candidates.size(); ++c) {
      CPD_RETURN_IF_ERROR(Configure(&candidates[c], nullptr));
      pass_->Forward(x_, y_);
      fp32_forward_ = false;
      if (wants(SiteSet::kA)) {
        pass_->Backward();
        record(c, SiteSet::kA);
      }
      if (wants(SiteSet::kAE)) {
        // The forward pass is the same (quantised activations); only the errors change.
        CPD_RETURN_IF_ERROR(Configure(&candidates[c], &candidates[c]));
        pass_->Backward();
        record(c, SiteSet::kAE);
      }
    }
  }
  return out;
}

}  // namespace cpd::runtime
