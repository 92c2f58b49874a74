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
  return Status::InvalidArgument("optimizer '" + std::string(name) + "' (accepted: sgd, lars)");
}

const char* OptimizerKindName(OptimizerKind kind) {
  return kind == OptimizerKind::kLars ? "lars" : "sgd";
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
  if (options_.momentum != 0) {
    momentum_.reserve(params_.size());
    for (Param* p : params_) momentum_.emplace_back(p->value.shape(), p->value.device());
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const size_t n = params_[i]->value.numel();
    total_elements_ += n;
    for (size_t b = 0; b < n; b += kChunk) chunks_.push_back({i, b, std::min(n, b + kChunk)});
  }
  if (lars()) partial_.assign(2 * chunks_.size(), 0.0);
}

std::string Optimizer::StateKey(size_t i) const {
  return (lars() ? "lars_momentum/" : "momentum/") + params_[i]->name;
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

void Optimizer::StepCuda(double lr) {
#if CPD_WITH_CUDA
  if (cuda_ == nullptr) cuda_ = std::make_unique<CudaState>();
  CudaState& cs = *cuda_;
  const Device dev = params_[0]->value.device();
  const bool momentum = options_.momentum != 0;
  // The chunk table holds raw pointers: it is rebuilt when a param's storage has changed (a
  // checkpoint load keeps it; MoveToDevice or new gradient views replace it).
  std::vector<cuda::OptimizerChunk> table(chunks_.size());
  for (size_t c = 0; c < chunks_.size(); ++c) {
    const Chunk& ch = chunks_[c];
    Param* p = params_[ch.param];
    if (p->value.device() != dev || p->grad.device() != dev ||
        (momentum && momentum_[ch.param].device() != dev)) {
      throw std::invalid_argument("optimizer: param '" + p->name +
                                  "' or its state is no longer on " + DeviceName(dev));
    }
    table[c].w = p->value.data() + ch.begin;
    table[c].g = p->grad.data() + ch.begin;
    table[c].buf = momentum ? momentum_[ch.param].data() + ch.begin : nullptr;
    table[c].len = uint32_t(ch.end - ch.begin);
    table[c].param = uint32_t(ch.param);
  }
  const auto same = [](const cuda::OptimizerChunk& a, const cuda::OptimizerChunk& b) {
    return a.w == b.w && a.g == b.g && a.buf == b.buf && a.len == b.len && a.param == b.param;
  };
  const size_t table_bytes = table.size() * sizeof(cuda::OptimizerChunk);
  if (cs.chunks.size() != table.size() ||
      !std::equal(table.begin(), table.end(), cs.chunks.begin(), same)) {
    cs.d_chunks.Reserve(table_bytes, dev);
    cs.d_chunks.CopyFromHost(table.data(), table_bytes);
    cs.chunks = std::move(table);
  }
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
  const size_t coeff_bytes = cs.coeffs.size() * sizeof(cuda::OptimizerCoeffs);
  cs.d_coeffs.Reserve(coeff_bytes, dev);
  cs.d_coeffs.CopyFromHost(cs.coeffs.data(), coeff_bytes);
  cuda::SgdUpdate(d_chunks, chunks_.size(),
                  static_cast<const cuda::OptimizerCoeffs*>(cs.d_coeffs.data()),
                  float(options_.momentum), lars(), momentum, options_.nesterov);
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
  for (size_t i = 0; i < momentum_.size(); ++i) out.emplace_back(StateKey(i), &momentum_[i]);
  return out;
}

Status Optimizer::LoadState(const std::map<std::string, std::vector<float>>& state) {
  const char* kind = lars() ? "LARS" : "SGD";
  std::map<std::string, size_t> expected;  // key -> param index
  for (size_t i = 0; i < momentum_.size(); ++i) expected.emplace(StateKey(i), i);
  for (const auto& [key, values] : state) {
    auto it = expected.find(key);
    if (it == expected.end()) {
      return Status::InvalidArgument("optimizer state: unexpected entry '" + key + "' for " + kind +
                                     " with momentum " + Str(options_.momentum) +
                                     (momentum_.empty()
                                          ? " (which keeps no state)"
                                          : " (expected '" + StateKey(0) + "' and the like)"));
    }
    if (values.size() != momentum_[it->second].numel()) {
      return Status::InvalidArgument("optimizer state: '" + key + "' has " +
                                     std::to_string(values.size()) + " values; the param has " +
                                     std::to_string(momentum_[it->second].numel()));
    }
  }
  for (const auto& [key, i] : expected) {
    if (state.find(key) == state.end()) {
      return Status::InvalidArgument("optimizer state: missing '" + key + "'");
    }
  }
  for (const auto& [key, i] : expected) {
    momentum_[i].CopyFromHost(state.at(key).data());  // any device
  }
  return Status::Ok();
}

}  // namespace cpd::runtime
