#include "runtime/train/gradients.h"

namespace cpd::runtime {

GradientPass::GradientPass(Sequential* model) : model_(model), params_(model->Params()) {}

BatchTotals GradientPass::Run(const Tensor& x, const std::vector<int32_t>& y) {
  const BatchTotals t = Forward(x, y);
  Backward();
  return t;
}

BatchTotals GradientPass::Forward(const Tensor& x, const std::vector<int32_t>& y) {
  const Tensor logits = model_->Forward(x, /*train=*/true);
  const float loss = loss_.Forward(logits, y, &dlogits_);
  BatchTotals t;
  t.loss_sum = loss * float(y.size());
  t.correct = SoftmaxCrossEntropy::CountCorrect(logits, y);
  t.count = int64_t(y.size());
  return t;
}

void GradientPass::Backward() {
  for (Param* p : params_) p->grad.Zero();
  model_->Backward(dlogits_);
}

}  // namespace cpd::runtime
