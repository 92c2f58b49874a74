// The shared helpers of the layer tests (tests/runtime/nn): random tensors and finite-difference
// gradient checks in float, with difference quotients formed in double.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "runtime/engine/tensor.h"
#include "runtime/nn/layer.h"
#include "runtime/nn/layers.h"

namespace cpd::runtime::gradcheck {

inline Tensor Random(std::vector<int64_t> shape, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  Tensor t(std::move(shape));
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  for (size_t i = 0; i < t.numel(); ++i) t.data()[i] = u(gen);
  return t;
}

// Values bounded away from 0 (ReLU kinks) by more than any finite-difference step used here.
inline Tensor AwayFromZero(std::vector<int64_t> shape, uint64_t seed) {
  Tensor t = Random(std::move(shape), seed, 0.05f, 1.f);
  std::mt19937_64 gen(seed + 1);
  for (size_t i = 0; i < t.numel(); ++i) {
    if (gen() & 1) t.data()[i] = -t.data()[i];
  }
  return t;
}

// Distinct values at least 0.03 apart, shuffled (max pooling: no ties a step of 0.01 can flip).
inline Tensor Distinct(std::vector<int64_t> shape, uint64_t seed) {
  Tensor t(std::move(shape));
  std::vector<float> v(t.numel());
  for (size_t i = 0; i < v.size(); ++i) v[i] = -1.f + 0.03f * float(i);
  std::mt19937_64 gen(seed);
  std::shuffle(v.begin(), v.end(), gen);
  std::copy(v.begin(), v.end(), t.data());
  return t;
}

inline double WeightedSum(const Tensor& y, const Tensor& r) {
  double s = 0;
  for (size_t i = 0; i < y.numel(); ++i) s += double(y.data()[i]) * double(r.data()[i]);
  return s;
}

inline std::vector<size_t> SampleIndices(size_t n, size_t max_count, uint64_t seed) {
  std::vector<size_t> idx(n);
  std::iota(idx.begin(), idx.end(), size_t(0));
  if (n <= max_count) return idx;
  std::mt19937_64 gen(seed);
  std::shuffle(idx.begin(), idx.end(), gen);
  idx.resize(max_count);
  return idx;
}

struct GradCheck {
  double eps = 1e-2;
  double tol = 1e-2;         // norm-wise relative error bound over the sampled elements
  double elem_tol = 2e-2;    // per element: |num - ana| <= elem_tol * (|ana| + scale / 10)
  size_t max_elements = 64;  // sampled elements per tensor
  double dir_tol = 1e-2;     // directional derivative along a random direction, relative
  // Piecewise-linear layers inside (ReLU after BatchNorm): a finite-difference step can move a
  // pre-activation across 0, which spoils that one difference quotient. With kinks = true each
  // quotient is taken at steps eps, eps/4 and eps/16 and the one closest to the analytic value
  // counts: an analytic error shows at every step, a kink crossing at one.
  bool kinks = false;
  bool input = true;  // check dL/dx too (false: the input is not differentiable, e.g. token ids)
};

constexpr GradCheck kWithKinks = {.eps = 4e-3, .max_elements = 48, .kinks = true};

// Compares the analytic gradient `grad` of eval() with respect to tensor *t (the point it holds
// now) with difference quotients: along a random direction through the whole tensor, and per
// sampled element (each and norm-wise over the sample). *t is restored afterwards.
inline void CheckTensorGradient(const std::string& what, Tensor* t, const Tensor& grad,
                                const std::function<double()>& eval, uint64_t seed,
                                const GradCheck& opt = {}) {
  // The difference quotient of eval() when `set(h)` moves the point by h along some direction.
  auto quotient = [&](const std::function<void(double)>& set, double ana) {
    double best = 0;
    const int steps = opt.kinks ? 3 : 1;
    for (int k = 0; k < steps; ++k) {
      const double h = opt.eps / double(1 << (2 * k));
      set(h);
      const double lp = eval();
      set(-h);
      const double lm = eval();
      set(0);
      const double q = (lp - lm) / (2 * h);
      if (k == 0 || std::abs(q - ana) < std::abs(best - ana)) best = q;
    }
    return best;
  };
  auto compare = [&](const std::vector<double>& num, const std::vector<double>& ana) {
    double diff = 0, nn = 0, na = 0, scale = 0;
    for (size_t i = 0; i < num.size(); ++i) {
      diff += (num[i] - ana[i]) * (num[i] - ana[i]);
      nn += num[i] * num[i];
      na += ana[i] * ana[i];
      scale = std::max(scale, std::abs(ana[i]));
    }
    const double rel = std::sqrt(diff) / std::max({std::sqrt(nn), std::sqrt(na), 1e-4});
    EXPECT_LT(rel, opt.tol) << what << ": norm-wise relative error";
    for (size_t i = 0; i < num.size(); ++i) {
      EXPECT_LE(std::abs(num[i] - ana[i]), opt.elem_tol * (std::abs(ana[i]) + 0.1 * scale + 1e-4))
          << what << "[" << i << "]: numerical " << num[i] << " analytic " << ana[i];
    }
  };
  const Tensor t0 = t->Clone();
  // Moves *t to t0 + h * dir.
  auto mover = [t, &t0](const Tensor& dir) {
    return [t, &t0, &dir](double h) {
      for (size_t i = 0; i < t->numel(); ++i) {
        t->data()[i] = float(double(t0.data()[i]) + h * double(dir.data()[i]));
      }
    };
  };
  // Directional derivative along a random v: <grad, v>.
  const Tensor v = Random(t->shape(), 1234 + seed);
  const double ana_dir = WeightedSum(grad, v);
  const double num_dir = quotient(mover(v), ana_dir);
  EXPECT_NEAR(num_dir, ana_dir, opt.dir_tol * (std::abs(ana_dir) + 1e-3))
      << what << ": directional derivative";
  // Sampled coordinates.
  std::vector<double> num, ana;
  for (size_t i : SampleIndices(t->numel(), opt.max_elements, seed)) {
    Tensor e(t->shape());
    e.data()[i] = 1.f;
    ana.push_back(grad.data()[i]);
    num.push_back(quotient(mover(e), ana.back()));
  }
  t->CopyFrom(t0);
  compare(num, ana);
}

// Compares numerical and analytic derivatives of L = sum(r * layer(x)) (train mode) for the
// input (unless opt.input is false) and for every parameter of `layer`: per sampled element,
// norm-wise over the sample, and along a random direction through the whole tensor.
inline void CheckGradients(Layer& layer, const Tensor& x, const GradCheck& opt = {}) {
  SCOPED_TRACE(layer.name());
  const Tensor y0 = layer.Forward(x, true).Clone();
  const Tensor r = Random(y0.shape(), 99);
  for (Param* p : layer.Params()) p->grad.Zero();
  const Tensor dx = layer.Backward(r).Clone();
  ASSERT_EQ(dx.shape(), x.shape());
  auto loss = [&](const Tensor& in) { return WeightedSum(layer.Forward(in, true), r); };
  Tensor xv = x.Clone();
  if (opt.input)
    CheckTensorGradient(
        "dx", &xv, dx, [&] { return loss(xv); }, 1, opt);
  uint64_t seed = 2;
  for (Param* p : layer.Params()) {
    CheckTensorGradient(
        p->name, &p->value, p->grad, [&] { return loss(x); }, seed++, opt);
  }
}

// Whether two tensors have the same shape and the same bits.
inline bool SameBits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && std::memcmp(a.data(), b.data(), a.numel() * sizeof(float)) == 0;
}

// Every element of `got` within tol * (1 + |want|) of a double-precision reference.
inline void ExpectClose(const Tensor& got, const std::vector<double>& want, double tol,
                        const std::string& what) {
  ASSERT_EQ(got.numel(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(got.data()[i], want[i], tol * (1.0 + std::abs(want[i]))) << what << "[" << i << "]";
  }
}

// Token ids [b, t] as floats, each in [0, vocab).
inline Tensor Ids(int64_t b, int64_t t, int64_t vocab, uint64_t seed) {
  Tensor ids({b, t});
  std::mt19937_64 gen(seed);
  for (size_t i = 0; i < ids.numel(); ++i) ids.data()[i] = float(gen() % uint64_t(vocab));
  return ids;
}

// A language model's mean per-token cross-entropy (logits [B, T, V] against B * T labels),
// with the gradient of the logits in *dlogits when it is given (the layer's float loss), else
// in double for the difference quotients (the layer rounds it to float).
inline double LanguageModelLoss(Sequential& lm, const Tensor& ids,
                                const std::vector<int32_t>& labels, Tensor* dlogits) {
  const Tensor logits = lm.Forward(ids, true);
  const int64_t n = int64_t(labels.size()), v = logits.dim(-1);
  if (dlogits != nullptr) {
    SoftmaxCrossEntropy ce;
    return ce.Forward(logits.Reshaped({n, v}), labels, dlogits);
  }
  return cpu::SoftmaxCrossEntropy(n, v, logits.data(), labels.data(), nullptr);
}

// Every parameter gradient of a language model over `vocab` tokens (ids [2, 5], labels
// (7i + 3) mod vocab) against difference quotients of LanguageModelLoss, and the shape of the
// input gradient.
inline void CheckLanguageModelGradients(Sequential& lm, int64_t vocab) {
  const Tensor ids = Ids(2, 5, vocab, 1);
  std::vector<int32_t> labels(10);
  for (size_t i = 0; i < labels.size(); ++i) labels[i] = int32_t((i * 7 + 3) % size_t(vocab));
  for (Param* p : lm.Params()) p->grad.Zero();
  Tensor dlogits;
  LanguageModelLoss(lm, ids, labels, &dlogits);
  const Tensor dx = lm.Backward(dlogits.Reshaped({2, 5, vocab}));
  EXPECT_EQ(dx.shape(), ids.shape());
  GradCheck opt{.max_elements = 24};
  uint64_t seed = 2;
  for (Param* p : lm.Params()) {
    const Tensor grad = p->grad.Clone();
    CheckTensorGradient(
        p->name, &p->value, grad, [&] { return LanguageModelLoss(lm, ids, labels, nullptr); },
        seed++, opt);
  }
}

}  // namespace cpd::runtime::gradcheck
