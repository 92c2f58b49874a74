#include "runtime/nn/optimizer.h"

#include <omp.h>

#include "cpd/config.h"
#if CPD_WITH_CUDA
#include "runtime/engine/cuda_ops.h"
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>
#include <stdexcept>
#include <utility>

namespace cpd::runtime {

namespace {

// Work unit of Step: fixed, so LARS's norm partial sums do not depend on the thread count.
constexpr size_t kChunk = size_t(1) << 14;
// Below this many elements in all, Step stays on the calling thread (fork/join costs more).
constexpr size_t kParallelMin = size_t(1) << 15;

std::string Str(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

struct Coeffs {
  float lr;  // Optimizer::ParamLr
  float wd;  // 0 for params without weight decay
  float m;
};

// The update rules of optimizer.h, one instantiation per case so the loop body has no branches.
template <bool kLars, bool kDecay, bool kMomentum, bool kNesterov>
void Update(float* __restrict w, const float* __restrict g, float* __restrict buf, size_t n,
            Coeffs c) {
  for (size_t i = 0; i < n; ++i) {
    float d = g[i];
    if constexpr (kDecay) d = d + c.wd * w[i];
    if constexpr (!kMomentum) {
      w[i] = w[i] - c.lr * d;
    } else if constexpr (!kLars) {
      const float b = c.m * buf[i] + d;
      buf[i] = b;
      w[i] = w[i] - c.lr * (kNesterov ? d + c.m * b : b);
    } else {
      const float s = c.lr * d;
      const float v = c.m * buf[i] + s;
      buf[i] = v;
      w[i] = w[i] - (kNesterov ? c.m * v + s : v);
    }
  }
}

using UpdateFn = void (*)(float*, const float*, float*, size_t, Coeffs);

template <int kIndex>
constexpr UpdateFn UpdateFor() {
  return &Update<(kIndex & 8) != 0, (kIndex & 4) != 0, (kIndex & 2) != 0, (kIndex & 1) != 0>;
}

template <int... kI>
constexpr std::array<UpdateFn, sizeof...(kI)> MakeTable(std::integer_sequence<int, kI...>) {
  return {UpdateFor<kI>()...};
}

constexpr auto kUpdates = MakeTable(std::make_integer_sequence<int, 16>());

UpdateFn Select(bool lars, bool decay, bool momentum, bool nesterov) {
  return kUpdates[(lars ? 8 : 0) | (decay ? 4 : 0) | (momentum ? 2 : 0) | (nesterov ? 1 : 0)];
}

// One AdamW step's scalars, formed in double and rounded once (cuda::AdamWCoeffs likewise).
struct AdamCoeffs {
  float decay;  // 1 - lr * wd, for params that decay
  float b1, one_minus_b1, b2, one_minus_b2;
  float bc2_sqrt;   // sqrt(1 - beta2^t)
  float step_size;  // lr / (1 - beta1^t)
  float eps;
};

// AdamW as optimizer.h writes it, in torch.optim.AdamW's order of operations (its single-tensor
// path: mul_, mul_().add_(alpha), mul_().addcmul_(value), sqrt() / bc2_sqrt + eps, addcdiv_).
template <bool kDecay>
void AdamWUpdate(float* __restrict w, const float* __restrict g, float* __restrict m,
                 float* __restrict v, size_t n, const AdamCoeffs& c) {
  for (size_t i = 0; i < n; ++i) {
    float x = w[i];
    if constexpr (kDecay) x = x * c.decay;
    const float gi = g[i];
    const float mi = c.b1 * m[i] + c.one_minus_b1 * gi;
    const float vi = c.b2 * v[i] + (c.one_minus_b2 * gi) * gi;
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi) / c.bc2_sqrt + c.eps;
    w[i] = x - (c.step_size * mi) / denom;
  }
}

AdamCoeffs MakeAdamCoeffs(const OptimizerOptions& o, double lr, int64_t t) {
  AdamCoeffs c;
  c.decay = float(1.0 - lr * o.weight_decay);
  c.b1 = float(o.beta1);
  c.one_minus_b1 = float(1.0 - o.beta1);
  c.b2 = float(o.beta2);
  c.one_minus_b2 = float(1.0 - o.beta2);
  c.bc2_sqrt = float(std::sqrt(1.0 - std::pow(o.beta2, double(t))));
  c.step_size = float(lr / (1.0 - std::pow(o.beta1, double(t))));
  c.eps = float(o.eps);
  return c;
}

// AdamW's step count in two floats that hold it exactly (optimizer.h: "adamw_step").
constexpr double kStepSplit = 16777216.0;  // 2^24

// Sum of x^2: float partial sums over 64-element blocks (8 interleaved lanes, which GCC
// vectorises without -ffast-math), blocks added in double, all in a fixed order, so one input
// gives one answer. Relative error ~1e-6, ample for a trust ratio (MLPerf's LARS uses fp32 norms).
double SumSquares(const float* __restrict x, size_t n) {
  double total = 0;
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < 64; k += 8) {
      for (int j = 0; j < 8; ++j) a[j] += x[i + k + j] * x[i + k + j];
    }
    total += double(((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])));
  }
  for (; i < n; ++i) total += double(x[i]) * double(x[i]);
  return total;
}

int ThreadCount(int requested, size_t work) {
  const int t = requested > 0 ? requested : omp_get_max_threads();
  return work >= kParallelMin && t > 1 ? t : 1;
}

}  // namespace

Result<OptimizerKind> ParseOptimizerKind(std::string_view name) {
  if (name == "sgd") return OptimizerKind::kSgd;
  if (name == "lars") return OptimizerKind::kLars;
  if (name == "adamw") return OptimizerKind::kAdamW;
  return Status::InvalidArgument("optimizer '" + std::string(name) +
                                 "' (accepted: sgd, lars, adamw)");
}

const char* OptimizerKindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kLars:
      return "lars";
    case OptimizerKind::kAdamW:
      return "adamw";
    case OptimizerKind::kSgd:
      break;
  }
  return "sgd";
}

Result<LarsExclude> ParseLarsExclude(std::string_view name) {
  if (name == "bias-bn") return LarsExclude::kBiasBn;
  if (name == "none") return LarsExclude::kNone;
  return Status::InvalidArgument("lars-exclude '" + std::string(name) +
                                 "' (accepted: bias-bn, none)");
}

const char* LarsExcludeName(LarsExclude exclude) {
  return exclude == LarsExclude::kNone ? "none" : "bias-bn";
}

Status OptimizerOptions::Validate() const {
  auto bad = [](const std::string& m) { return Status::InvalidArgument("optimizer: " + m); };
  if (!(momentum >= 0) || !std::isfinite(momentum)) {
    return bad("momentum " + Str(momentum) + " must be a finite number >= 0");
  }
  if (!(weight_decay >= 0) || !std::isfinite(weight_decay)) {
    return bad("weight decay " + Str(weight_decay) + " must be a finite number >= 0");
  }
  if (nesterov && momentum == 0) return bad("Nesterov momentum needs momentum > 0");
  if (nesterov && kind == OptimizerKind::kAdamW) {
    return bad("Nesterov momentum applies to sgd and lars, not adamw");
  }
  for (const auto& [name, beta] : {std::pair{"beta1", beta1}, std::pair{"beta2", beta2}}) {
    if (!(beta >= 0 && beta < 1)) {
      return bad(std::string("AdamW ") + name + " " + Str(beta) + " must be a number in [0, 1)");
    }
  }
  if (!(eps > 0) || !std::isfinite(eps)) {
    return bad("AdamW eps " + Str(eps) + " must be a positive number");
  }
  if (!(lars_eta > 0) || !std::isfinite(lars_eta)) {
    return bad("LARS eta " + Str(lars_eta) + " must be a positive number");
  }
  if (!(lars_excluded_lr_ratio > 0) || !std::isfinite(lars_excluded_lr_ratio)) {
    return bad("LARS excluded-param lr ratio " + Str(lars_excluded_lr_ratio) +
               " must be a positive number");
  }
  if (threads < 0) return bad("threads " + std::to_string(threads) + " must be >= 0");
  return Status::Ok();
}

Status Optimizer::Check(const std::vector<Param*>& params, const OptimizerOptions& options) {
  CPD_RETURN_IF_ERROR(options.Validate());
  std::set<std::string> names;
  for (size_t i = 0; i < params.size(); ++i) {
    const Param* p = params[i];
    if (p == nullptr) {
      return Status::InvalidArgument("optimizer: param #" + std::to_string(i) + " is null");
    }
    if (p->name.empty()) {
      return Status::InvalidArgument("optimizer: param #" + std::to_string(i) +
                                     " has no name (state is keyed by name)");
    }
    if (!names.insert(p->name).second) {
      return Status::InvalidArgument("optimizer: two params are named '" + p->name + "'");
    }
    const Device d = params[0]->value.device();
    if (p->value.device() != d || p->grad.device() != d) {
      return Status::InvalidArgument(
          "optimizer: param '" + p->name + "' has its value on " + DeviceName(p->value.device()) +
          " and its gradient on " + DeviceName(p->grad.device()) + ", but '" + params[0]->name +
          "' is on " + DeviceName(d) + "; every param and gradient must be on one device");
    }
    if (p->grad.numel() != p->value.numel()) {
      return Status::InvalidArgument("optimizer: param '" + p->name + "' has value " +
                                     p->value.ShapeString() + " but grad " + p->grad.ShapeString());
    }
  }
  return Status::Ok();
}

Result<std::unique_ptr<Optimizer>> Optimizer::Create(std::vector<Param*> params,
                                                     const OptimizerOptions& options) {
  CPD_RETURN_IF_ERROR(Check(params, options));
  return std::make_unique<Optimizer>(std::move(params), options);
}

Optimizer::Optimizer(std::vector<Param*> params, OptimizerOptions options)
    : params_(std::move(params)), options_(options) {
  const Status s = Check(params_, options_);
  if (!s.ok()) throw std::invalid_argument(s.message());
  trust_.assign(params_.size(), 1.0);
  if (adamw()) {
    for (Param* p : params_) {
      adam_m_.emplace_back(p->value.shape(), p->value.device());
      adam_v_.emplace_back(p->value.shape(), p->value.device());
    }
    adam_step_state_ = Tensor({2});
  } else if (options_.momentum != 0) {
    momentum_.reserve(params_.size());
    for (Param* p : params_) momentum_.emplace_back(p->value.shape(), p->value.device());
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const size_t n = params_[i]->value.numel();
    total_elements_ += n;
    for (size_t b = 0; b < n; b += kChunk) chunks_.push_back({i, b, std::min(n, b + kChunk)});
  }
  partial_.assign(2 * chunks_.size(), 0.0);
}

std::vector<std::pair<std::string, Tensor*>> Optimizer::Slots() {
  std::vector<std::pair<std::string, Tensor*>> out;
  for (size_t i = 0; i < momentum_.size(); ++i) {
    out.emplace_back((lars() ? "lars_momentum/" : "momentum/") + params_[i]->name, &momentum_[i]);
  }
  for (size_t i = 0; i < adam_m_.size(); ++i) {
    out.emplace_back("adamw_m/" + params_[i]->name, &adam_m_[i]);
    out.emplace_back("adamw_v/" + params_[i]->name, &adam_v_[i]);
  }
  if (adamw()) out.emplace_back("adamw_step", &adam_step_state_);
  return out;
}

#if CPD_WITH_CUDA
struct Optimizer::CudaState {
  std::vector<cuda::OptimizerChunk> chunks;  // host copy of the table on the device
  RawBuffer d_chunks, d_coeffs, d_partial;
  std::vector<cuda::OptimizerCoeffs> coeffs;
};
#else
struct Optimizer::CudaState {};
#endif

Optimizer::~Optimizer() = default;

void Optimizer::ComputeTrustRatios(int threads) {
  const int64_t nc = int64_t(chunks_.size());
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t c = 0; c < nc; ++c) {
    const Chunk& ch = chunks_[size_t(c)];
    const float* w = params_[ch.param]->value.data();
    const float* g = params_[ch.param]->grad.data();
    partial_[2 * size_t(c)] = SumSquares(w + ch.begin, ch.end - ch.begin);
    partial_[2 * size_t(c) + 1] = SumSquares(g + ch.begin, ch.end - ch.begin);
  }
  TrustFromPartials();
}

void Optimizer::TrustFromPartials() {
  std::vector<double> ww(params_.size(), 0.0), gg(params_.size(), 0.0);
  for (size_t c = 0; c < chunks_.size(); ++c) {  // in chunk order: deterministic
    ww[chunks_[c].param] += partial_[2 * c];
    gg[chunks_[c].param] += partial_[2 * c + 1];
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    trust_[i] = 1.0;
    if (Excluded(i)) continue;
    const double wn = std::sqrt(ww[i]), gn = std::sqrt(gg[i]);
    const double wd = params_[i]->weight_decay ? options_.weight_decay : 0.0;
    if (wn > 0 && gn > 0) {
      // LARS (You et al., 2017): eta * ||w|| / (||g|| + wd * ||w||).
      trust_[i] = options_.lars_eta * wn / (gn + wd * wn);
    }
  }
}

bool Optimizer::Excluded(size_t i) const {
  return options_.lars_exclude == LarsExclude::kBiasBn && !params_[i]->weight_decay;
}

double Optimizer::ParamLr(size_t i, double lr) const {
  if (!lars()) return lr;
  return Excluded(i) ? lr * options_.lars_excluded_lr_ratio : lr * trust_[i];
}

void Optimizer::Step(double lr) {
  if (adamw()) {
    StepAdamW(lr);
    return;
  }
  if (!params_.empty() && params_[0]->value.device() != Device::kCpu) {
    StepCuda(lr);
    return;
  }
  const int threads = ThreadCount(options_.threads, total_elements_);
  if (lars()) ComputeTrustRatios(threads);
  const bool momentum = options_.momentum != 0;
  const int64_t nc = int64_t(chunks_.size());
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t c = 0; c < nc; ++c) {
    const Chunk& ch = chunks_[size_t(c)];
    Param* p = params_[ch.param];
    const bool decay = p->weight_decay && options_.weight_decay != 0;
    Coeffs k;
    k.lr = float(ParamLr(ch.param, lr));
    k.wd = decay ? float(options_.weight_decay) : 0.0f;
    k.m = float(options_.momentum);
    float* buf = momentum ? momentum_[ch.param].data() + ch.begin : nullptr;
    Select(lars(), decay, momentum, options_.nesterov)(
        p->value.data() + ch.begin, p->grad.data() + ch.begin, buf, ch.end - ch.begin, k);
  }
}

void Optimizer::StepAdamW(double lr) {
  ++adam_steps_;
  adam_step_state_.data()[0] = float(std::floor(double(adam_steps_) / kStepSplit));
  adam_step_state_.data()[1] = float(std::fmod(double(adam_steps_), kStepSplit));
  if (!params_.empty() && params_[0]->value.device() != Device::kCpu) {
    StepAdamWCuda(lr);
    return;
  }
  const AdamCoeffs k = MakeAdamCoeffs(options_, lr, adam_steps_);
  const int threads = ThreadCount(options_.threads, total_elements_);
  const int64_t nc = int64_t(chunks_.size());
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t c = 0; c < nc; ++c) {
    const Chunk& ch = chunks_[size_t(c)];
    Param* p = params_[ch.param];
    const bool decay = p->weight_decay && options_.weight_decay != 0;
    auto* update = decay ? &AdamWUpdate<true> : &AdamWUpdate<false>;
    update(p->value.data() + ch.begin, p->grad.data() + ch.begin,
           adam_m_[ch.param].data() + ch.begin, adam_v_[ch.param].data() + ch.begin,
           ch.end - ch.begin, k);
  }
}

double Optimizer::ClipGradNorm(double max_norm) {
  if (!(max_norm >= 0)) throw std::invalid_argument("optimizer: clip max_norm must be >= 0");
  GradPartials();
  double sum = 0.0;
  for (size_t c = 0; c < chunks_.size(); ++c) sum += partial_[2 * c + 1];  // in chunk order
  const double norm = std::sqrt(sum);
  if (max_norm > 0 && std::isfinite(norm)) {
    // torch.nn.utils.clip_grad_norm_: the coefficient clamped at 1, which multiplies nothing.
    const double coef = max_norm / (norm + 1e-6);
    if (coef < 1.0) ScaleGrads(float(coef));
  }
  return norm;
}

void Optimizer::GradPartials() {
  if (!params_.empty() && params_[0]->value.device() != Device::kCpu) {
#if CPD_WITH_CUDA
    SyncCudaChunks();
    CudaState& cs = *cuda_;
    const size_t bytes = partial_.size() * sizeof(double);
    cs.d_partial.Reserve(bytes, params_[0]->value.device());
    cuda::ChunkSumSquares(static_cast<const cuda::OptimizerChunk*>(cs.d_chunks.data()),
                          chunks_.size(), static_cast<double*>(cs.d_partial.data()),
                          /*grads_only=*/true);
    cs.d_partial.CopyToHost(partial_.data(), bytes);
    return;
#else
    throw std::logic_error("optimizer: CUDA params in a build without CUDA");
#endif
  }
  const int threads = ThreadCount(options_.threads, total_elements_);
  const int64_t nc = int64_t(chunks_.size());
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t c = 0; c < nc; ++c) {
    const Chunk& ch = chunks_[size_t(c)];
    const float* g = params_[ch.param]->grad.data();
    partial_[2 * size_t(c) + 1] = SumSquares(g + ch.begin, ch.end - ch.begin);
  }
}

void Optimizer::ScaleGrads(float factor) {
  if (!params_.empty() && params_[0]->value.device() != Device::kCpu) {
#if CPD_WITH_CUDA
    for (Param* p : params_) cuda::Scale(p->grad.numel(), factor, p->grad.data(), p->grad.data());
    return;
#else
    throw std::logic_error("optimizer: CUDA params in a build without CUDA");
#endif
  }
  const int threads = ThreadCount(options_.threads, total_elements_);
  const int64_t nc = int64_t(chunks_.size());
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t c = 0; c < nc; ++c) {
    const Chunk& ch = chunks_[size_t(c)];
    float* g = params_[ch.param]->grad.data();
    for (size_t i = ch.begin; i < ch.end; ++i) g[i] = g[i] * factor;
  }
}

void Optimizer::SyncCudaChunks() {
#if CPD_WITH_CUDA
  if (cuda_ == nullptr) cuda_ = std::make_unique<CudaState>();
  CudaState& cs = *cuda_;
  const Device dev = params_[0]->value.device();
  const bool momentum = !momentum_.empty();
  // The chunk table holds raw pointers: it is rebuilt when a param's storage has changed (a
  // checkpoint load keeps it; MoveToDevice or new gradient views replace it).
  std::vector<cuda::OptimizerChunk> table(chunks_.size());
  for (size_t c = 0; c < chunks_.size(); ++c) {
    const Chunk& ch = chunks_[c];
    Param* p = params_[ch.param];
    if (p->value.device() != dev || p->grad.device() != dev ||
        (momentum && momentum_[ch.param].device() != dev) ||
        (adamw() && (adam_m_[ch.param].device() != dev || adam_v_[ch.param].device() != dev))) {
      throw std::invalid_argument("optimizer: param '" + p->name +
                                  "' or its state is no longer on " + DeviceName(dev));
    }
    table[c].w = p->value.data() + ch.begin;
    table[c].g = p->grad.data() + ch.begin;
    table[c].buf = momentum  ? momentum_[ch.param].data() + ch.begin
                   : adamw() ? adam_m_[ch.param].data() + ch.begin
                             : nullptr;
    table[c].buf2 = adamw() ? adam_v_[ch.param].data() + ch.begin : nullptr;
    table[c].len = uint32_t(ch.end - ch.begin);
    table[c].param = uint32_t(ch.param);
  }
  const auto same = [](const cuda::OptimizerChunk& a, const cuda::OptimizerChunk& b) {
    return a.w == b.w && a.g == b.g && a.buf == b.buf && a.buf2 == b.buf2 && a.len == b.len &&
           a.param == b.param;
  };
  const size_t table_bytes = table.size() * sizeof(cuda::OptimizerChunk);
  if (cs.chunks.size() != table.size() ||
      !std::equal(table.begin(), table.end(), cs.chunks.begin(), same)) {
    cs.d_chunks.Reserve(table_bytes, dev);
    cs.d_chunks.CopyFromHost(table.data(), table_bytes);
    cs.chunks = std::move(table);
  }
#endif
}

#if CPD_WITH_CUDA
namespace {

// Per param: lr and decay (SGD, LARS) or the decay factor (AdamW), to the device.
void UploadCoeffs(std::vector<cuda::OptimizerCoeffs>* coeffs, RawBuffer* d_coeffs, Device dev) {
  const size_t bytes = coeffs->size() * sizeof(cuda::OptimizerCoeffs);
  d_coeffs->Reserve(bytes, dev);
  d_coeffs->CopyFromHost(coeffs->data(), bytes);
}

}  // namespace
#endif

void Optimizer::StepCuda(double lr) {
#if CPD_WITH_CUDA
  SyncCudaChunks();
  CudaState& cs = *cuda_;
  const Device dev = params_[0]->value.device();
  const bool momentum = options_.momentum != 0;
  const auto* d_chunks = static_cast<const cuda::OptimizerChunk*>(cs.d_chunks.data());
  if (lars()) {
    // The norms in the CPU's summation order, per chunk on the GPU; the trust ratios on the
    // host from the same partial sums, so they equal the CPU's.
    const size_t bytes = partial_.size() * sizeof(double);
    cs.d_partial.Reserve(bytes, dev);
    cuda::ChunkSumSquares(d_chunks, chunks_.size(), static_cast<double*>(cs.d_partial.data()));
    cs.d_partial.CopyToHost(partial_.data(), bytes);
    TrustFromPartials();
  }
  cs.coeffs.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const bool decay = params_[i]->weight_decay && options_.weight_decay != 0;
    cuda::OptimizerCoeffs& k = cs.coeffs[i];
    k.lr = float(ParamLr(i, lr));
    k.wd = decay ? float(options_.weight_decay) : 0.0f;
    k.decay = decay ? 1 : 0;
    k.pad = 0;
  }
  UploadCoeffs(&cs.coeffs, &cs.d_coeffs, dev);
  cuda::SgdUpdate(d_chunks, chunks_.size(),
                  static_cast<const cuda::OptimizerCoeffs*>(cs.d_coeffs.data()),
                  float(options_.momentum), lars(), momentum, options_.nesterov);
#else
  (void)lr;
  throw std::logic_error("optimizer: CUDA params in a build without CUDA");
#endif
}

void Optimizer::StepAdamWCuda(double lr) {
#if CPD_WITH_CUDA
  SyncCudaChunks();
  CudaState& cs = *cuda_;
  const AdamCoeffs a = MakeAdamCoeffs(options_, lr, adam_steps_);
  cs.coeffs.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const bool decay = params_[i]->weight_decay && options_.weight_decay != 0;
    cuda::OptimizerCoeffs& k = cs.coeffs[i];
    k.lr = float(lr);
    k.wd = decay ? a.decay : 1.0f;
    k.decay = decay ? 1 : 0;
    k.pad = 0;
  }
  UploadCoeffs(&cs.coeffs, &cs.d_coeffs, params_[0]->value.device());
  const cuda::AdamWCoeffs c{a.b1,       a.one_minus_b1, a.b2, a.one_minus_b2,
                            a.bc2_sqrt, a.step_size,    a.eps};
  cuda::AdamWUpdate(static_cast<const cuda::OptimizerChunk*>(cs.d_chunks.data()), chunks_.size(),
                    static_cast<const cuda::OptimizerCoeffs*>(cs.d_coeffs.data()), c);
#else
  (void)lr;
  throw std::logic_error("optimizer: CUDA params in a build without CUDA");
#endif
}

void Optimizer::ZeroGrad() {
  for (Param* p : params_) p->grad.Zero();
}

std::vector<std::pair<std::string, const Tensor*>> Optimizer::State() const {
  std::vector<std::pair<std::string, const Tensor*>> out;
  for (const auto& [key, t] : const_cast<Optimizer*>(this)->Slots()) out.emplace_back(key, t);
  return out;
}

namespace {

// The --optimizer whose state a key is ("" if none), for a message that says why it does not fit.
std::string WriterOf(const std::string& key) {
  if (key.rfind("lars_momentum/", 0) == 0) return "lars";
  if (key.rfind("momentum/", 0) == 0) return "sgd";
  if (key.rfind("adamw_", 0) == 0) return "adamw";
  return "";
}

}  // namespace

Status Optimizer::LoadState(const std::map<std::string, std::vector<float>>& state) {
  const std::vector<std::pair<std::string, Tensor*>> slots = Slots();
  std::map<std::string, Tensor*> expected(slots.begin(), slots.end());
  const std::string kind = OptimizerKindName(options_.kind);
  for (const auto& [key, values] : state) {
    auto it = expected.find(key);
    if (it == expected.end()) {
      const std::string writer = WriterOf(key);
      return Status::InvalidArgument(
          "optimizer state: unexpected entry '" + key + "'" +
          (writer.empty() || writer == kind ? "" : " (state of --optimizer " + writer + ")") +
          " for --optimizer " + kind + (adamw() ? "" : " with momentum " + Str(options_.momentum)) +
          (slots.empty() ? " (which keeps no state)"
                         : " (expected '" + slots[0].first + "' and the like)"));
    }
    if (values.size() != it->second->numel()) {
      return Status::InvalidArgument("optimizer state: '" + key + "' has " +
                                     std::to_string(values.size()) + " values; expected " +
                                     std::to_string(it->second->numel()));
    }
  }
  for (const auto& [key, t] : slots) {
    if (state.find(key) == state.end()) {
      return Status::InvalidArgument("optimizer state: missing '" + key + "'");
    }
  }
  int64_t steps = 0;
  if (adamw()) {
    const std::vector<float>& t = state.at("adamw_step");
    const double hi = t[0], lo = t[1];
    if (!(hi >= 0 && hi < kStepSplit && hi == std::floor(hi) && lo >= 0 && lo < kStepSplit &&
          lo == std::floor(lo))) {
      return Status::InvalidArgument("optimizer state: 'adamw_step' [" + Str(hi) + ", " + Str(lo) +
                                     "] is not a step count (two integers in [0, 2^24))");
    }
    steps = int64_t(hi) * int64_t(kStepSplit) + int64_t(lo);
  }
  for (const auto& [key, t] : slots) t->CopyFromHost(state.at(key).data());  // any device
  adam_steps_ = steps;
  return Status::Ok();
}

}  // namespace cpd::runtime
