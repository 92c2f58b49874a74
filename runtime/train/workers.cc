#include "runtime/train/workers.h"

#include <algorithm>
#include <limits>

#include "cpd/config.h"
#if CPD_WITH_CUDA
#include "runtime/engine/cuda_ops.h"
#endif

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

Tensor UseFlatGradients(Sequential* model, Device device) {
  size_t total = 0;
  for (Param* p : model->Params()) total += p->grad.numel();
  Tensor flat({int64_t(total)}, device);
  size_t offset = 0;
  for (Param* p : model->Params()) {
    p->grad = flat.Slice(offset, p->grad.shape());
    offset += p->grad.numel();
  }
  return flat;
}

LocalWorkers::LocalWorkers(Sequential* model, SiteQuantizer* quant, Device device,
                           WorkerGroup group, Tensor flat_gradients, bool device_gradients,
                           int64_t debug_nan_step, int64_t debug_nan_steps)
    : model_(model),
      quant_(quant),
      device_(device),
      group_(group),
      flat_gradients_(std::move(flat_gradients)),
      device_gradients_(device_gradients && device != Device::kCpu),
      debug_nan_step_(debug_nan_step),
      debug_nan_steps_(debug_nan_steps),
      params_(model->Params()),
      pass_(model),
      buffers_(model->Buffers()) {
  size_t total = 0;
  for (const Param* p : params_) total += p->grad.numel();
  if (!device_gradients_) {
    gradients_.assign(size_t(group_.local_workers), std::vector<float>(total));
    for (auto& g : gradients_) gradient_ptrs_.push_back(g.data());
  } else if (group_.local_workers == 1) {
    gradient_ptrs_.push_back(flat_gradients_.data());  // backward's buffer is the input
  } else {
    for (int k = 0; k < group_.local_workers; ++k) {
      device_copies_.emplace_back(std::vector<int64_t>{int64_t(total)}, device_);
      gradient_ptrs_.push_back(device_copies_.back().data());
    }
  }
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
  const int64_t n = int64_t(y.size());
  BatchTotals totals;
  for (int k = 0; k < K; ++k) {
    const uint64_t worker = uint64_t(group_.rank) * uint64_t(K) + uint64_t(k);
    const int64_t begin = n * k / K, end = n * (k + 1) / K;
    const Tensor xk = StagedOn(K == 1 ? x : SliceRows(x, begin, end), device_, &x_device_);
    const std::vector<int32_t> yk(y.begin() + begin, y.begin() + end);
    quant_->SetWorker(worker);
    // Dropout masks: a stream per (step, worker); worker 0 of a 1-worker run keeps `step`.
    model_->SetStep(uint64_t(step) * uint64_t(group_.workers) + worker);
    quant_->SetCollectStats(collect_stats && k == 0);
    if (average_buffers_ && k > 0) RestoreBuffers(buffers_before_.data(), buffers_);
    const BatchTotals t = pass_.Run(xk, yk);
    totals.loss_sum += t.loss_sum;
    totals.correct += t.correct;
    totals.count += t.count;
    CopyGradientsOut(k);
    if (debug_nan_step_ >= 0 && step >= debug_nan_step_ &&
        step - debug_nan_step_ < debug_nan_steps_ && worker == 0) {
      PutNaNIntoGradient();
    }
    if (average_buffers_) {
      SnapshotBuffers(buffers_, buffers_after_.data() + buffer_floats_ * size_t(k));
    }
  }
  quant_->SetWorker(0);
  return totals;
}

void LocalWorkers::CopyGradientsOut(int k) {
  if (device_gradients_) {
    if (!device_copies_.empty()) device_copies_[size_t(k)].CopyFrom(flat_gradients_);
    return;
  }
  float* out = gradients_[size_t(k)].data();
  if (device_ != Device::kCpu) {
    flat_gradients_.CopyToHost(out);  // every gradient in one copy
    return;
  }
  for (const Param* p : params_) {
    std::copy(p->grad.data(), p->grad.data() + p->grad.numel(), out);
    out += p->grad.numel();
  }
}

void LocalWorkers::PutNaNIntoGradient() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  if (!device_gradients_) {
    if (!gradients_[0].empty()) gradients_[0][0] = nan;
    return;
  }
  Tensor& g = device_copies_.empty() ? flat_gradients_ : device_copies_[0];
  if (g.numel() > 0) g.Slice(0, {1}).Fill(nan);
}

void LocalWorkers::LoadAveragedGradients() {
  // 1 / (W x S): with a power-of-two S the same product as 1 / W, then an exact halving.
  const float factor = 1.0f / float(group_.workers) / loss_scale_;
  if (device_gradients_) {
#if CPD_WITH_CUDA
    // The CPU's float products, on the device, into the gradient views.
    cuda::Scale(flat_gradients_.numel(), factor, gradient_ptrs_[0], flat_gradients_.data());
#endif
    return;
  }
  float* sum = gradients_[0].data();
  if (device_ != Device::kCpu) {
    // The same float products as on the CPU, then one copy into the gradient views.
    for (size_t i = 0; i < gradients_[0].size(); ++i) sum[i] = sum[i] * factor;
    flat_gradients_.CopyFromHost(sum);
    return;
  }
  for (Param* p : params_) {
    float* g = p->grad.data();
    for (size_t i = 0; i < p->grad.numel(); ++i) g[i] = sum[i] * factor;
    sum += p->grad.numel();
  }
}

}  // namespace cpd::runtime
