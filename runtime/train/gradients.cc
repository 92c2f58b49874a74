#include "runtime/train/gradients.h"

#include "cpd/config.h"
#if CPD_WITH_CUDA
#include "runtime/engine/cuda_ops.h"
#endif

namespace cpd::runtime {

namespace {

// t *= s, element by element, on the tensor's device.
void ScaleInPlace(Tensor* t, float s) {
  if (t->device() == Device::kCpu) {
    float* v = t->data();
    for (size_t i = 0; i < t->numel(); ++i) v[i] *= s;
    return;
  }
#if CPD_WITH_CUDA
  cuda::Scale(t->numel(), s, t->data(), t->data());
#endif
}

}  // namespace

Tensor LossRows(const Tensor& logits) {
  if (logits.ndim() <= 2) return logits;
  const int64_t classes = logits.dim(-1);
  return logits.Reshaped({int64_t(logits.numel()) / classes, classes});
}

GradientPass::GradientPass(Sequential* model) : model_(model), params_(model->Params()) {}

BatchTotals GradientPass::Run(const Tensor& x, const std::vector<int32_t>& y) {
  const BatchTotals t = Forward(x, y);
  Backward();
  return t;
}

BatchTotals GradientPass::Forward(const Tensor& x, const std::vector<int32_t>& y) {
  const Tensor out = model_->Forward(x, /*train=*/true);
  const Tensor logits = LossRows(out);
  const float loss = loss_.Forward(logits, y, &dlogits_);
  // The backward starts from the model's own output shape.
  if (out.ndim() > 2) dlogits_ = dlogits_.Reshaped(out.shape());
  if (loss_scale_ != 1) ScaleInPlace(&dlogits_, loss_scale_);
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
