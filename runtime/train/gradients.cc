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

GradientPass::GradientPass(Sequential* model) : model_(model), params_(model->Params()) {}

BatchTotals GradientPass::Run(const Tensor& x, const std::vector<int32_t>& y) {
  const BatchTotals t = Forward(x, y);
  Backward();
  return t;
}

BatchTotals GradientPass::Forward(const Tensor& x, const std::vector<int32_t>& y) {
  const Tensor logits = model_->Forward(x, /*train=*/true);
  const float loss = loss_.Forward(logits, y, &dlogits_);
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
