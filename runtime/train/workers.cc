#include "runtime/train/workers.h"

#include <algorithm>

namespace cpd::runtime {

namespace {

// Rows [begin, end) of a batch tensor, as a new tensor.
Tensor SliceRows(const Tensor& x, int64_t begin, int64_t end) {
  std::vector<int64_t> shape = x.shape();
  shape[0] = end - begin;
  Tensor out(shape);
  const size_t row = x.numel() / size_t(x.dim(0));
  std::copy(x.data() + size_t(begin) * row, x.data() + size_t(end) * row, out.data());
  return out;
}

void SnapshotBuffers(const NamedBuffers& buffers, float* out) {
  for (const auto& b : buffers) {
    b.second->CopyToHost(out);
    out += b.second->numel();
  }
}

void RestoreBuffers(const float* in, const NamedBuffers& buffers) {
  for (const auto& b : buffers) {
    b.second->CopyFromHost(in);
    in += b.second->numel();
  }
}

}  // namespace

LocalWorkers::LocalWorkers(Sequential* model, SiteQuantizer* quant, Device device,
                           WorkerGroup group, GradientBuffers* gradients, int64_t debug_nan_step,
                           int64_t debug_nan_steps)
    : model_(model),
      quant_(quant),
      device_(device),
      group_(group),
      gradients_(gradients),
      debug_nan_step_(debug_nan_step),
      debug_nan_steps_(debug_nan_steps),
      pass_(model),
      buffers_(model->Buffers()) {
  for (const auto& b : buffers_) buffer_floats_ += b.second->numel();
  average_buffers_ = group_.workers > 1 && buffer_floats_ > 0;
  buffers_before_.resize(average_buffers_ ? buffer_floats_ : 0);
}

BatchTotals LocalWorkers::ForwardBackward(const Tensor& x, const std::vector<int32_t>& y,
                                          int64_t step, bool collect_stats) {
  const int K = group_.local_workers;
  if (average_buffers_) {
    SnapshotBuffers(buffers_, buffers_before_.data());
    buffers_after_.assign(buffer_floats_ * size_t(K), 0.0f);
  }
  // Rows of x are samples; a language model's sample has a label per token.
  const int64_t n = x.ndim() > 0 ? x.dim(0) : 0;
  const int64_t labels = n > 0 ? int64_t(y.size()) / n : 1;
  BatchTotals totals;
  for (int k = 0; k < K; ++k) {
    const uint64_t worker = uint64_t(group_.rank) * uint64_t(K) + uint64_t(k);
    const int64_t begin = n * k / K, end = n * (k + 1) / K;
    const Tensor xk = StagedOn(K == 1 ? x : SliceRows(x, begin, end), device_, &x_device_);
    const std::vector<int32_t> yk(y.begin() + begin * labels, y.begin() + end * labels);
    quant_->SetWorker(worker);
    // Dropout masks: a stream per (step, worker); worker 0 of a 1-worker run keeps `step`.
    model_->SetStep(uint64_t(step) * uint64_t(group_.workers) + worker);
    quant_->SetCollectStats(collect_stats && k == 0);
    if (average_buffers_ && k > 0) RestoreBuffers(buffers_before_.data(), buffers_);
    const BatchTotals t = pass_.Run(xk, yk);
    totals.loss_sum += t.loss_sum;
    totals.correct += t.correct;
    totals.count += t.count;
    gradients_->KeepWorkerGradients(k);
    if (debug_nan_step_ >= 0 && step >= debug_nan_step_ &&
        step - debug_nan_step_ < debug_nan_steps_ && worker == 0) {
      gradients_->PutNaNIntoInput(k);
    }
    if (average_buffers_) {
      SnapshotBuffers(buffers_, buffers_after_.data() + buffer_floats_ * size_t(k));
    }
  }
  quant_->SetWorker(0);
  return totals;
}

}  // namespace cpd::runtime
