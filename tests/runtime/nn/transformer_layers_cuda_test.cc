// The language-model layers' CUDA path against their CPU path (issue 28): every function of
// runtime/engine/cuda_transformer.h and cuda_recurrent.h against its CPU twin on the same inputs,
// then every layer (embeddings, LayerNorm, GELU, the attention products, CausalSelfAttention,
// TransformerBlock, the LSTM) built twice from the same seed, one copy moved to the GPU, forward
// and backward compared, and a GPT and an LSTM language model end to end with their loss.
//
// The rule of layers_cuda_test.cc: bit for bit where the CPU defines the result exactly (the
// gathers and the table's gradient, the position add, LayerNorm, head split and merge, the
// LSTM's transposes and column sums, and the quantisation sites given the same operands), to a
// few ulp where CUDA's erff, expf and tanhf stand in for glibc's in the shared formulas (GELU,
// the causal softmax, the LSTM cell), to float32 reassociation for the GEMMs, and ten times that
// for stacks of layers (as layers_cuda_test's composites). Also: mixed devices refused with the
// layer's name, token ids checked before any device work, and a GPU run repeated bit for bit.
// Every test skips without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "runtime/engine/cpu_ops.h"
#include "runtime/engine/cpu_recurrent.h"
#include "runtime/engine/cpu_transformer.h"
#include "runtime/engine/cuda_recurrent.h"
#include "runtime/engine/cuda_transformer.h"
#include "runtime/nn/attention.h"
#include "runtime/nn/embedding.h"
#include "runtime/nn/layers.h"
#include "runtime/nn/normalization.h"
#include "runtime/nn/quant_sites.h"
#include "runtime/nn/recurrent.h"
#include "runtime/nn/transformer.h"
#include "tests/cuda_test_util.h"
#include "tests/runtime/nn/cuda_twin.h"

namespace cpd::runtime::test {
namespace {

// CUDA's erff, expf and tanhf against glibc's, at most 2 ulp each: a few ulp per element, and
// relative to the largest value where a result is a small difference (GELU's tail).
constexpr Tol kFewUlp{1e-5, 2e-7};
// The same after a cancellation (the softmax's and the LSTM cell's backward).
constexpr Tol kFewUlpCancelled{1e-5, 1e-6};
// Stacks of layers (attention, a block, a model): ten times kReassoc.
constexpr Tol kStack{1e-3, 1e-4};
constexpr TwinTols kAllExact{kExact, kExact, kExact, kExact};
constexpr TwinTols kStackTols{kStack, kStack, kStack, kStack};

Tensor Dev(const Tensor& t) { return t.To(Device::kCuda); }

// n int32 ids in [0, vocab) with repeats (every id drawn from at most n / 3 + 1 values), or all
// equal to `same` when it is >= 0.
std::vector<int32_t> IntIds(int64_t n, int64_t vocab, uint64_t seed, int32_t same = -1) {
  std::vector<int32_t> ids(size_t(n), same);
  if (same >= 0) return ids;
  std::mt19937_64 gen(seed);
  const uint64_t distinct = uint64_t(std::min<int64_t>(vocab, n / 3 + 1));
  for (auto& id : ids) id = int32_t((gen() % distinct) * uint64_t(vocab) / distinct);
  return ids;
}

// The ids [b, t] as the layers take them: floats holding exact integers.
Tensor FloatIds(int64_t b, int64_t t, int64_t vocab, uint64_t seed) {
  const std::vector<int32_t> ids = IntIds(b * t, vocab, seed);
  Tensor out({b, t});
  for (size_t i = 0; i < ids.size(); ++i) out.data()[i] = float(ids[i]);
  return out;
}

// int32 values in device memory.
struct DeviceInts {
  explicit DeviceInts(const std::vector<int32_t>& v) {
    buf.Reserve(std::max<size_t>(v.size(), 1) * sizeof(int32_t), Device::kCuda);
    buf.CopyFromHost(v.data(), v.size() * sizeof(int32_t));
  }
  const int32_t* data() const { return static_cast<const int32_t*>(buf.data()); }
  RawBuffer buf;
};

// Inputs with a few non-finite values, signed zeros and exact ties among finite ones.
Tensor WithSpecials(Tensor t, uint64_t seed) {
  std::mt19937_64 gen(seed);
  for (size_t i = 0; i < t.numel(); ++i) {
    switch (gen() % 64) {
      case 0:
        t.data()[i] = std::numeric_limits<float>::quiet_NaN();
        break;
      case 1:
        t.data()[i] = (gen() & 1) ? std::numeric_limits<float>::infinity()
                                  : -std::numeric_limits<float>::infinity();
        break;
      case 2:
        t.data()[i] = (gen() & 1) ? 0.f : -0.f;
        break;
      case 3:
        t.data()[i] = 0.5f;
        break;
      default:
        break;
    }
  }
  return t;
}

// ||gpu - cpu|| / ||cpu|| over all elements (both finite).
double RelativeError(const Tensor& cpu, const Tensor& gpu) {
  const std::vector<float> a = Host(cpu), b = Host(gpu);
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(b[i]) - a[i]) * (double(b[i]) - a[i]);
    den += double(a[i]) * a[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

std::vector<Layer*> QuantisableLayers(Layer& model) {
  std::vector<Layer*> out;
  for (Layer* l : model.Flatten()) {
    if (l->Quantizable()) out.push_back(l);
  }
  return out;
}

// ---- Ops: embeddings ------------------------------------------------------------------------

struct EmbeddingCase {
  int64_t n, c, vocab;
  int32_t same;  // >= 0: every token has this id (one table row sums all of dy)
};

TEST(CudaLmOps, EmbeddingGatherAndTableGradientAreExact) {
  CPD_REQUIRE_CUDA();
  for (const EmbeddingCase& k : {EmbeddingCase{1, 1, 1, -1}, EmbeddingCase{37, 33, 7, -1},
                                 EmbeddingCase{100, 300, 1000, -1}, EmbeddingCase{64, 1, 50000, -1},
                                 EmbeddingCase{200, 70, 9, 4}, EmbeddingCase{5, 257, 3, -1}}) {
    const std::string tag = "n " + std::to_string(k.n) + " c " + std::to_string(k.c) + " vocab " +
                            std::to_string(k.vocab);
    const std::vector<int32_t> ids = IntIds(k.n, k.vocab, uint64_t(k.n * 31 + k.c), k.same);
    const DeviceInts ids_d(ids);
    const Tensor table = Random({k.vocab, k.c}, 1), dy = Random({k.n, k.c}, 2, -3.f, 3.f);
    Tensor y({k.n, k.c}), dtable({k.vocab, k.c});
    cpu::EmbeddingForward(k.n, k.c, ids.data(), table.data(), y.data());
    cpu::EmbeddingBackward(k.n, k.c, k.vocab, ids.data(), dy.data(), dtable.data());
    const Tensor table_d = Dev(table), dy_d = Dev(dy);
    Tensor y_d({k.n, k.c}, Device::kCuda),
        dtable_d = Dev(Random({k.vocab, k.c}, 3));  // overwritten
    cuda::EmbeddingForward(k.n, k.c, ids_d.data(), table_d.data(), y_d.data());
    cuda::EmbeddingBackward(k.n, k.c, k.vocab, ids_d.data(), dy_d.data(), dtable_d.data());
    ExpectMatch(tag + " gather", y, y_d, kExact);
    ExpectMatch(tag + " table gradient", dtable, dtable_d, kExact);
  }
  // No tokens: the whole table gradient is zero.
  Tensor dtable_d = Dev(Random({4, 6}, 4));
  cuda::EmbeddingBackward(0, 6, 4, nullptr, nullptr, dtable_d.data());
  for (float f : Host(dtable_d)) ASSERT_EQ(Bits(f), 0u);
}

TEST(CudaLmOps, PositionAddIsExact) {
  CPD_REQUIRE_CUDA();
  for (const auto& [b, t, c] :
       {std::tuple<int64_t, int64_t, int64_t>{3, 5, 7}, {1, 1, 1}, {4, 33, 257}}) {
    const std::string tag = std::to_string(b) + "x" + std::to_string(t) + "x" + std::to_string(c);
    const Tensor x = Random({b, t, c}, 1), table = Random({t, c}, 2), dy = Random({b, t, c}, 3);
    Tensor y({b, t, c}), dtable({t, c});
    cpu::PositionAddForward(b, t, c, x.data(), table.data(), y.data());
    cpu::PositionAddBackward(b, t, c, dy.data(), dtable.data());
    const Tensor x_d = Dev(x), table_d = Dev(table), dy_d = Dev(dy);
    Tensor y_d({b, t, c}, Device::kCuda), dtable_d({t, c}, Device::kCuda);
    cuda::PositionAddForward(b, t, c, x_d.data(), table_d.data(), y_d.data());
    cuda::PositionAddBackward(b, t, c, dy_d.data(), dtable_d.data());
    ExpectMatch(tag + " position add", y, y_d, kExact);
    ExpectMatch(tag + " position table gradient", dtable, dtable_d, kExact);
  }
}

// ---- Ops: LayerNorm and GELU --------------------------------------------------------------------

TEST(CudaLmOps, LayerNormIsExact) {
  CPD_REQUIRE_CUDA();
  for (const auto& [rows, c, offset] : {std::tuple<int64_t, int64_t, float>{1, 1, 0.f},
                                        {7, 33, 0.f},
                                        {64, 257, 0.f},
                                        {3, 768, 0.f},
                                        {9, 48, 1e4f}}) {
    const std::string tag =
        std::to_string(rows) + "x" + std::to_string(c) + " mean " + std::to_string(int(offset));
    Tensor x = Random({rows, c}, 1, -2.f, 3.f);
    for (size_t i = 0; i < x.numel(); ++i) x.data()[i] += offset;
    const Tensor gamma = Random({c}, 2, 0.5f, 1.5f), beta = Random({c}, 3);
    const Tensor dy = Random({rows, c}, 4);
    Tensor y({rows, c}), mean({rows}), rstd({rows}), dx({rows, c}), dgamma({c}), dbeta({c});
    cpu::LayerNormForward(rows, c, x.data(), gamma.data(), beta.data(), 1e-5f, y.data(),
                          mean.data(), rstd.data());
    cpu::LayerNormBackward(rows, c, x.data(), dy.data(), gamma.data(), mean.data(), rstd.data(),
                           dx.data(), dgamma.data(), dbeta.data());
    const Tensor x_d = Dev(x), gamma_d = Dev(gamma), beta_d = Dev(beta), dy_d = Dev(dy);
    Tensor y_d({rows, c}, Device::kCuda), mean_d({rows}, Device::kCuda),
        rstd_d({rows}, Device::kCuda), dx_d({rows, c}, Device::kCuda), dgamma_d({c}, Device::kCuda),
        dbeta_d({c}, Device::kCuda);
    cuda::LayerNormForward(rows, c, x_d.data(), gamma_d.data(), beta_d.data(), 1e-5f, y_d.data(),
                           mean_d.data(), rstd_d.data());
    cuda::LayerNormBackward(rows, c, x_d.data(), dy_d.data(), gamma_d.data(), mean_d.data(),
                            rstd_d.data(), dx_d.data(), dgamma_d.data(), dbeta_d.data());
    ExpectMatch(tag + " y", y, y_d, kExact);
    ExpectMatch(tag + " mean", mean, mean_d, kExact);
    ExpectMatch(tag + " rstd", rstd, rstd_d, kExact);
    ExpectMatch(tag + " dx", dx, dx_d, kExact);
    ExpectMatch(tag + " dgamma", dgamma, dgamma_d, kExact);
    ExpectMatch(tag + " dbeta", dbeta, dbeta_d, kExact);
  }
}

TEST(CudaLmOps, GeluMatchesToAFewUlp) {
  CPD_REQUIRE_CUDA();
  const int64_t n = 100003;
  const Tensor x = WithSpecials(Random({n}, 1, -6.f, 6.f), 2), dy = Random({n}, 3, -2.f, 2.f);
  Tensor y({n}), dx({n});
  cpu::GeluForward(size_t(n), x.data(), y.data());
  cpu::GeluBackward(size_t(n), x.data(), dy.data(), dx.data());
  const Tensor x_d = Dev(x), dy_d = Dev(dy);
  Tensor y_d({n}, Device::kCuda), dx_d({n}, Device::kCuda);
  cuda::GeluForward(size_t(n), x_d.data(), y_d.data());
  cuda::GeluBackward(size_t(n), x_d.data(), dy_d.data(), dx_d.data());
  ExpectMatch("GELU", y, y_d, kFewUlp);
  ExpectMatch("GELU backward", dx, dx_d, kFewUlp);
}

// ---- Ops: attention ---------------------------------------------------------------------------

TEST(CudaLmOps, HeadsSplitAndMergeAreExact) {
  CPD_REQUIRE_CUDA();
  for (const auto& [b, t, h, d] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t>{2, 5, 3, 4}, {1, 1, 1, 1}, {3, 7, 2, 33}}) {
    const std::string tag = std::to_string(b) + "x" + std::to_string(t) + " h " +
                            std::to_string(h) + " d " + std::to_string(d);
    const int64_t c = h * d;
    const Tensor qkv = Random({b, t, 3 * c}, 1);
    Tensor q({b, h, t, d}), k({b, h, t, d}), v({b, h, t, d}), dqkv({b, t, 3 * c}), y({b, t, c}),
        dout({b, h, t, d});
    cpu::SplitHeads(b, t, h, d, qkv.data(), q.data(), k.data(), v.data());
    cpu::SplitHeadsBackward(b, t, h, d, q.data(), k.data(), v.data(), dqkv.data());
    cpu::MergeHeads(b, t, h, d, v.data(), y.data());
    cpu::MergeHeadsBackward(b, t, h, d, y.data(), dout.data());
    const Tensor qkv_d = Dev(qkv);
    Tensor q_d({b, h, t, d}, Device::kCuda), k_d({b, h, t, d}, Device::kCuda),
        v_d({b, h, t, d}, Device::kCuda), dqkv_d({b, t, 3 * c}, Device::kCuda),
        y_d({b, t, c}, Device::kCuda), dout_d({b, h, t, d}, Device::kCuda);
    cuda::SplitHeads(b, t, h, d, qkv_d.data(), q_d.data(), k_d.data(), v_d.data());
    cuda::SplitHeadsBackward(b, t, h, d, q_d.data(), k_d.data(), v_d.data(), dqkv_d.data());
    cuda::MergeHeads(b, t, h, d, v_d.data(), y_d.data());
    cuda::MergeHeadsBackward(b, t, h, d, y_d.data(), dout_d.data());
    ExpectMatch(tag + " q", q, q_d, kExact);
    ExpectMatch(tag + " k", k, k_d, kExact);
    ExpectMatch(tag + " v", v, v_d, kExact);
    ExpectMatch(tag + " split backward", dqkv, dqkv_d, kExact);
    ExpectMatch(tag + " merge", y, y_d, kExact);
    ExpectMatch(tag + " merge backward", dout, dout_d, kExact);
    ExpectMatch(tag + " split then its adjoint is the identity", qkv, dqkv_d, kExact);
  }
}

TEST(CudaLmOps, CausalSoftmaxMatchesToAFewUlp) {
  CPD_REQUIRE_CUDA();
  for (const auto& [batch, t] : {std::pair<int64_t, int64_t>{1, 1}, {6, 7}, {3, 33}, {2, 70}}) {
    const std::string tag = std::to_string(batch) + "x" + std::to_string(t);
    Tensor s = Random({batch, t, t}, 1, -8.f, 8.f);
    for (int64_t j = 0; j < t; ++j) s.data()[(t - 1) * t + j] = 1.5f;  // a row of ties
    const Tensor dp = Random({batch, t, t}, 2, -2.f, 2.f);
    Tensor p({batch, t, t}), ds({batch, t, t});
    cpu::CausalSoftmaxForward(batch, t, s.data(), p.data());
    cpu::CausalSoftmaxBackward(batch, t, p.data(), dp.data(), ds.data());
    const Tensor s_d = Dev(s), dp_d = Dev(dp);
    Tensor p_d = Dev(Random({batch, t, t}, 3)), ds_d = Dev(Random({batch, t, t}, 4));
    cuda::CausalSoftmaxForward(batch, t, s_d.data(), p_d.data());
    ExpectMatch(tag + " softmax", p, p_d, kFewUlp);
    // The backward from the CPU's p, so that it is compared alone.
    const Tensor p_cpu_d = Dev(p);
    cuda::CausalSoftmaxBackward(batch, t, p_cpu_d.data(), dp_d.data(), ds_d.data());
    ExpectMatch(tag + " softmax backward", ds, ds_d, kFewUlpCancelled);
    // The mask: exact zeros above the diagonal in both.
    const std::vector<float> ph = Host(p_d), dh = Host(ds_d);
    for (int64_t row = 0; row < batch * t; ++row) {
      for (int64_t j = row % t + 1; j < t; ++j) {
        ASSERT_EQ(Bits(ph[size_t(row * t + j)]), 0u) << tag << " row " << row << " key " << j;
        ASSERT_EQ(Bits(dh[size_t(row * t + j)]), 0u) << tag << " row " << row << " key " << j;
      }
    }
  }
}

TEST(CudaLmOps, BatchedProductsMatchToReassociation) {
  CPD_REQUIRE_CUDA();
  for (const auto& [batch, m, n, k] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{1, 1, 1, 1},
                                       {6, 5, 7, 9},
                                       {4, 33, 17, 65}}) {
    for (bool trans_b : {true, false}) {
      const std::string tag = std::to_string(batch) + " x [" + std::to_string(m) + ", " +
                              std::to_string(k) + "] x " + std::to_string(n) +
                              (trans_b ? " (b^T)" : " (b)");
      const float alpha = 0.35f;
      const Tensor a = Random({batch, m, k}, 1), dc = Random({batch, m, n}, 3);
      const Tensor b = trans_b ? Random({batch, n, k}, 2) : Random({batch, k, n}, 2);
      Tensor c({batch, m, n}), da(a.shape()), db(b.shape());
      cpu::BatchedMatmul(batch, m, n, k, trans_b, alpha, a.data(), b.data(), c.data());
      cpu::BatchedMatmulBackward(batch, m, n, k, trans_b, alpha, a.data(), b.data(), dc.data(),
                                 da.data(), db.data());
      const Tensor a_d = Dev(a), b_d = Dev(b), dc_d = Dev(dc);
      Tensor c_d(c.shape(), Device::kCuda), da_d(a.shape(), Device::kCuda),
          db_d(b.shape(), Device::kCuda);
      cuda::BatchedMatmul(batch, m, n, k, trans_b, alpha, a_d.data(), b_d.data(), c_d.data());
      cuda::BatchedMatmulBackward(batch, m, n, k, trans_b, alpha, a_d.data(), b_d.data(),
                                  dc_d.data(), da_d.data(), db_d.data());
      ExpectMatch(tag + " c", c, c_d, kReassoc);
      ExpectMatch(tag + " da", da, da_d, kReassoc);
      ExpectMatch(tag + " db", db, db_d, kReassoc);
    }
  }
}

// ---- Ops: the LSTM ------------------------------------------------------------------------------

TEST(CudaLmOps, RecurrentPlumbingIsExact) {
  CPD_REQUIRE_CUDA();
  for (const auto& [b0, b1, c] :
       {std::tuple<int64_t, int64_t, int64_t>{3, 5, 7}, {1, 4, 1}, {6, 1, 33}}) {
    const std::string tag = std::to_string(b0) + "x" + std::to_string(b1) + "x" + std::to_string(c);
    const Tensor x = Random({b0, b1, c}, 1);
    Tensor y({b1, b0, c}), y_d({b1, b0, c}, Device::kCuda);
    cpu::SwapLeadingDims(b0, b1, c, x.data(), y.data());
    const Tensor x_d = Dev(x);
    cuda::SwapLeadingDims(b0, b1, c, x_d.data(), y_d.data());
    ExpectMatch(tag + " SwapLeadingDims", y, y_d, kExact);
  }
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {37, 300}, {5, 9}}) {
    const std::string tag = std::to_string(rows) + "x" + std::to_string(cols);
    const Tensor row = Random({cols}, 1), x = Random({rows, cols}, 2, -3.f, 3.f);
    Tensor y({rows, cols}), sum({cols});
    cpu::BroadcastRows(rows, cols, row.data(), y.data());
    cpu::SumRows(rows, cols, x.data(), sum.data());
    const Tensor row_d = Dev(row), x_d = Dev(x);
    Tensor y_d({rows, cols}, Device::kCuda), sum_d({cols}, Device::kCuda);
    cuda::BroadcastRows(rows, cols, row_d.data(), y_d.data());
    cuda::SumRows(rows, cols, x_d.data(), sum_d.data());
    ExpectMatch(tag + " BroadcastRows", y, y_d, kExact);
    ExpectMatch(tag + " SumRows", sum, sum_d, kExact);
  }
}

TEST(CudaLmOps, ColumnBlockedSgemmMatchesToReassociation) {
  CPD_REQUIRE_CUDA();
  // More than one column block (64) and not a multiple of it; padded leading dimensions.
  const int64_t m = 5, n = 130, k = 17, pad = 3;
  for (bool trans_a : {false, true}) {
    for (bool trans_b : {false, true}) {
      for (float beta : {0.f, 1.f}) {
        const std::string tag = std::string("op(A) ") + (trans_a ? "A^T" : "A") + ", op(B) " +
                                (trans_b ? "B^T" : "B") + ", beta " + std::to_string(int(beta));
        const int64_t lda = (trans_a ? m : k) + pad, ldb = (trans_b ? k : n) + pad, ldc = n + pad;
        const Tensor a = Random({trans_a ? k : m, lda}, 1), b = Random({trans_b ? n : k, ldb}, 2);
        Tensor c = Random({m, ldc}, 3);
        Tensor c_d = Dev(c);
        const Tensor a_d = Dev(a), b_d = Dev(b);
        cpu::ColumnBlockedSgemm(trans_a, trans_b, m, n, k, 0.5f, a.data(), lda, b.data(), ldb, beta,
                                c.data(), ldc);
        cuda::ColumnBlockedSgemm(trans_a, trans_b, m, n, k, 0.5f, a_d.data(), lda, b_d.data(), ldb,
                                 beta, c_d.data(), ldc);
        // The padding columns of C are not written: they keep their (equal) values.
        ExpectMatch(tag, c, c_d, kReassoc);
      }
    }
  }
}

TEST(CudaLmOps, LstmCellMatchesToAFewUlp) {
  CPD_REQUIRE_CUDA();
  for (const auto& [b, h] : {std::pair<int64_t, int64_t>{3, 5}, {1, 33}, {16, 65}}) {
    const std::string tag = std::to_string(b) + "x" + std::to_string(h);
    const Tensor gx = Random({b, 4 * h}, 1, -3.f, 3.f), gh = Random({b, 4 * h}, 2, -3.f, 3.f);
    const Tensor c_prev = Random({b, h}, 3, -2.f, 2.f), dy = Random({b, h}, 4);
    const Tensor dh_rec = Random({b, h}, 5), dc_in = Random({b, h}, 6);
    Tensor gates({b, 4 * h}), c({b, h}), h_out({b, h});
    cpu::LstmCellForward(b, h, gx.data(), gh.data(), c_prev.data(), gates.data(), c.data(),
                         h_out.data());
    const Tensor gx_d = Dev(gx), gh_d = Dev(gh), c_prev_d = Dev(c_prev);
    Tensor gates_d({b, 4 * h}, Device::kCuda), c_d({b, h}, Device::kCuda),
        h_d({b, h}, Device::kCuda);
    cuda::LstmCellForward(b, h, gx_d.data(), gh_d.data(), c_prev_d.data(), gates_d.data(),
                          c_d.data(), h_d.data());
    ExpectMatch(tag + " gates", gates, gates_d, kFewUlp);
    ExpectMatch(tag + " cell", c, c_d, kFewUlp);
    ExpectMatch(tag + " h", h_out, h_d, kFewUlp);
    for (bool recurrent : {false, true}) {
      // From the CPU's gates and cells, so that the backward is compared alone.
      const std::string where = tag + (recurrent ? " with dh_rec" : " last step");
      Tensor dc = dc_in.Clone(), dz({b, 4 * h});
      cpu::LstmCellBackward(b, h, gates.data(), c_prev.data(), c.data(), dy.data(),
                            recurrent ? dh_rec.data() : nullptr, dc.data(), dz.data());
      const Tensor gates_c = Dev(gates), c_c = Dev(c), dy_d = Dev(dy), dh_d = Dev(dh_rec);
      Tensor dc_d = Dev(dc_in), dz_d({b, 4 * h}, Device::kCuda);
      cuda::LstmCellBackward(b, h, gates_c.data(), c_prev_d.data(), c_c.data(), dy_d.data(),
                             recurrent ? dh_d.data() : nullptr, dc_d.data(), dz_d.data());
      ExpectMatch(where + " dz", dz, dz_d, kFewUlpCancelled);
      ExpectMatch(where + " dc", dc, dc_d, kFewUlpCancelled);
    }
  }
}

// ---- Layers -------------------------------------------------------------------------------------

TEST(CudaLmLayers, EmbeddingsAreExact) {
  CPD_REQUIRE_CUDA();
  for (const auto& [b, t] : {std::pair<int64_t, int64_t>{3, 7}, {1, 1}, {4, 33}}) {
    const std::string tag = std::to_string(b) + "x" + std::to_string(t);
    CompareOnBothDevices(
        "TokenEmbedding " + tag, [] { return std::make_unique<TokenEmbedding>("wte", 50, 33, 5); },
        FloatIds(b, t, 50, uint64_t(b * t)), kAllExact);
    // T below the block: the table's rows from T on get no gradient.
    CompareOnBothDevices(
        "PositionEmbedding " + tag,
        [] { return std::make_unique<PositionEmbedding>("wpe", 40, 12, 6); },
        Random({b, t, 12}, uint64_t(b + t)), kAllExact);
  }
}

TEST(CudaLmLayers, LayerNormIsExact) {
  CPD_REQUIRE_CUDA();
  CompareOnBothDevices(
      "LayerNorm [4, 6, 48]", [] { return std::make_unique<LayerNorm>("ln", 48); },
      Random({4, 6, 48}, 1, -2.f, 2.f), kAllExact);
  CompareOnBothDevices(
      "LayerNorm [5, 1, 7]", [] { return std::make_unique<LayerNorm>("ln", 7); },
      Random({5, 1, 7}, 2), kAllExact);
}

TEST(CudaLmLayers, GeluMatchesToAFewUlp) {
  CPD_REQUIRE_CUDA();
  CompareOnBothDevices(
      "GELU", [] { return std::make_unique<GELU>("gelu"); }, Random({4, 9, 33}, 1, -5.f, 5.f),
      TwinTols{kFewUlp, kFewUlp, kExact, kExact});
}

TEST(CudaLmLayers, AttentionProductsMatchToReassociation) {
  CPD_REQUIRE_CUDA();
  for (bool trans_b : {true, false}) {
    const std::string tag = trans_b ? "qk" : "pv";
    AttentionProduct cpu(tag, trans_b, trans_b ? 0.25f : 1.f),
        gpu(tag, trans_b, trans_b ? 0.25f : 1.f);
    const Tensor a = Random({2, 3, 7, 5}, 1);
    const Tensor b = trans_b ? Random({2, 3, 7, 5}, 2) : Random({2, 3, 5, 6}, 2);
    const Tensor ca = cpu.Multiply(a, b, true), cb = gpu.Multiply(Dev(a), Dev(b), true);
    ExpectMatch(tag + " product", ca, cb, kReassoc);
    const Tensor dc = Random(ca.shape(), 3);
    const auto [da, db] = cpu.MultiplyBackward(dc);
    const auto [da_d, db_d] = gpu.MultiplyBackward(Dev(dc));
    ExpectMatch(tag + " da", da, da_d, kReassoc);
    ExpectMatch(tag + " db", db, db_d, kReassoc);
  }
}

TransformerOptions SmallTransformer(double dropout) {
  TransformerOptions o;
  o.embed = 24;
  o.heads = 3;
  o.layers = 2;
  o.dropout = dropout;
  return o;
}

TEST(CudaLmLayers, CausalSelfAttentionMatchesTheCpu) {
  CPD_REQUIRE_CUDA();
  for (double dropout : {0.0, 0.2}) {
    for (const auto& [b, t] : {std::pair<int64_t, int64_t>{2, 7}, {1, 1}, {3, 33}}) {
      CompareOnBothDevices(
          "attention dropout " + std::to_string(dropout) + " " + std::to_string(b) + "x" +
              std::to_string(t),
          [&] {
            return std::make_unique<CausalSelfAttention>("h0.attn", SmallTransformer(dropout), 3);
          },
          Random({b, t, 24}, 4), kStackTols);
    }
  }
}

TEST(CudaLmLayers, TransformerBlockMatchesTheCpu) {
  CPD_REQUIRE_CUDA();
  for (double dropout : {0.0, 0.1}) {
    CompareOnBothDevices(
        "block dropout " + std::to_string(dropout),
        [&] { return std::make_unique<TransformerBlock>("h0", SmallTransformer(dropout), 5); },
        Random({3, 9, 24}, 6), kStackTols);
  }
}

LstmOptions SmallLstm(int64_t layers, double dropout) {
  LstmOptions o;
  o.input = 5;
  o.hidden = 7;
  o.layers = layers;
  o.dropout = dropout;
  return o;
}

TEST(CudaLmLayers, TwoLayerLstmMatchesTheCpu) {
  CPD_REQUIRE_CUDA();
  for (const auto& [b, t] : {std::pair<int64_t, int64_t>{3, 7}, {2, 1}, {1, 20}}) {
    CompareOnBothDevices(
        "LSTM " + std::to_string(b) + "x" + std::to_string(t),
        [] { return std::make_unique<Lstm>("lstm", SmallLstm(2, 0.3), 7); },
        Random({b, t, 5}, uint64_t(8 + t)), kStackTols);
  }
  CompareOnBothDevices(
      "one-layer LSTM", [] { return std::make_unique<Lstm>("lstm", SmallLstm(1, 0.0), 8); },
      Random({4, 6, 5}, 9), kStackTols);
}

// ---- Language models end to end -----------------------------------------------------------------

// Builds the model twice, moves one to the GPU, and runs forward, the per-token loss and backward
// on both: logits, loss and every parameter gradient compared; the GPU's run again gives the same
// bits.
void CompareLanguageModel(const std::string& tag,
                          const std::function<std::unique_ptr<Sequential>()>& make,
                          const Tensor& ids, int64_t vocab) {
  std::unique_ptr<Sequential> cpu = make(), gpu = make();
  MoveToDevice(gpu.get(), Device::kCuda);
  const int64_t n = int64_t(ids.numel());
  std::vector<int32_t> labels(static_cast<size_t>(n));
  for (size_t i = 0; i < labels.size(); ++i) labels[i] = int32_t((i * 7 + 3) % size_t(vocab));
  const Tensor ids_d = Dev(ids);
  auto run = [&](Sequential& model, const Tensor& x, float* loss) {
    for (Param* p : model.Params()) p->grad.Zero();
    const Tensor logits = model.Forward(x, true);
    SoftmaxCrossEntropy ce;
    Tensor dlogits;
    *loss = ce.Forward(logits.Reshaped({n, vocab}), labels, &dlogits);
    const Tensor dx = model.Backward(dlogits.Reshaped(logits.shape()));
    return std::make_pair(logits, dx);
  };
  float la = 0, lb = 0;
  const auto [ya, dxa] = run(*cpu, ids, &la);
  const auto [yb, dxb] = run(*gpu, ids_d, &lb);
  ASSERT_EQ(yb.device(), Device::kCuda) << tag;
  ExpectMatch(tag + " logits", ya, yb, kStack);
  EXPECT_NEAR(lb, la, 1e-5 * std::fabs(la)) << tag << " loss";
  ExpectMatch(tag + " ids gradient (zero)", dxa, dxb, kExact);
  const std::vector<Param*> pa = cpu->Params(), pb = gpu->Params();
  ASSERT_EQ(pa.size(), pb.size());
  std::vector<std::vector<float>> first;
  for (size_t i = 0; i < pa.size(); ++i) {
    ExpectMatch(tag + " " + pa[i]->name + " gradient", pa[i]->grad, pb[i]->grad, kStack);
    first.push_back(Host(pb[i]->grad));
  }
  // Deterministic: the same step on the GPU again, the same bits.
  const std::vector<float> logits_first = Host(yb);
  float lb2 = 0;
  const auto [yb2, dxb2] = run(*gpu, ids_d, &lb2);
  EXPECT_EQ(Bits(lb2), Bits(lb)) << tag;
  EXPECT_EQ(Host(yb2), logits_first) << tag << " logits of a second run";
  for (size_t i = 0; i < pb.size(); ++i) {
    const std::vector<float> again = Host(pb[i]->grad);
    ASSERT_EQ(again.size(), first[i].size());
    size_t differ = 0;
    for (size_t j = 0; j < again.size(); ++j) differ += Bits(again[j]) != Bits(first[i][j]);
    EXPECT_EQ(differ, 0u) << tag << " " << pb[i]->name << " gradient of a second run";
  }
}

GptOptions SmallGpt(bool tied) {
  GptOptions g;
  g.vocab = 29;
  g.block_size = 12;
  g.transformer = SmallTransformer(0.1);
  g.tied_head = tied;
  return g;
}

TEST(CudaLmModels, GptMatchesTheCpu) {
  CPD_REQUIRE_CUDA();
  for (bool tied : {true, false}) {
    for (const auto& [b, t] : {std::pair<int64_t, int64_t>{3, 12}, {2, 5}, {4, 1}}) {
      CompareLanguageModel(
          std::string(tied ? "tied" : "untied") + " GPT " + std::to_string(b) + "x" +
              std::to_string(t),
          [&] { return BuildGpt(SmallGpt(tied), 11); }, FloatIds(b, t, 29, uint64_t(b * t)), 29);
    }
  }
}

TEST(CudaLmModels, LstmLanguageModelMatchesTheCpu) {
  CPD_REQUIRE_CUDA();
  for (bool tied : {true, false}) {
    LstmLmOptions o;
    o.vocab = 23;
    o.embed = 8;
    o.hidden = tied ? 0 : 6;
    o.layers = 2;
    o.dropout = 0.2;
    o.tied_head = tied;
    CompareLanguageModel(
        std::string(tied ? "tied" : "untied") + " LSTM LM", [&] { return BuildLstm(o, 12); },
        FloatIds(3, 9, 23, 13), 23);
  }
}

// ---- Devices and ids ------------------------------------------------------------------------

// Runs `f`, which must throw std::invalid_argument naming `who` and `device`.
void ExpectRefused(const std::function<void()>& f, const std::string& who,
                   const std::string& device) {
  try {
    f();
    ADD_FAILURE() << "expected std::invalid_argument naming " << who;
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(who), std::string::npos) << what;
    EXPECT_NE(what.find(device), std::string::npos) << what;
  }
}

TEST(CudaLmLayers, MixingDevicesIsRefusedWithTheLayerName) {
  CPD_REQUIRE_CUDA();
  auto gpt = BuildGpt(SmallGpt(true), 1);
  MoveToDevice(gpt.get(), Device::kCuda);
  ExpectRefused([&] { gpt->Forward(FloatIds(1, 3, 29, 1), true); }, "wte (TokenEmbedding)", "cpu");
  Lstm lstm("lstm", SmallLstm(2, 0.0), 1);
  MoveToDevice(&lstm, Device::kCuda);
  ExpectRefused([&] { lstm.Forward(Random({1, 2, 5}, 1), true); }, "lstm (LSTM)", "cpu");
  LayerNorm ln("ln", 4);
  MoveToDevice(&ln, Device::kCuda);
  ExpectRefused([&] { ln.Forward(Random({2, 4}, 2), true); }, "ln (LayerNorm)", "cpu");
  // A CPU layer given GPU tensors, and a CPU gradient after a GPU forward.
  TransformerBlock block("h0", SmallTransformer(0.0), 2);
  ExpectRefused(
      [&] {
        block.Forward(Dev(Random({1, 2, 24}, 3)), true);
      },
      "h0 (TransformerBlock)", "cuda");
  AttentionProduct pv("h0.attn.pv", false, 1.f);
  ExpectRefused(
      [&] {
        pv.Multiply(Dev(Random({1, 2, 3}, 4)), Random({1, 3, 2}, 5), true);
      },
      "h0.attn.pv (AttentionProduct)", "cpu");
  GELU gelu("gelu");
  gelu.Forward(Dev(Random({2, 3}, 6)), true);
  EXPECT_THROW(gelu.Backward(Random({2, 3}, 7)), std::invalid_argument);
}

TEST(CudaLmLayers, TokenIdsAreCheckedBeforeTheGpuReadsThem) {
  CPD_REQUIRE_CUDA();
  TokenEmbedding wte("wte", 13, 4, 1);
  MoveToDevice(&wte, Device::kCuda);
  for (float bad : {13.f, -1.f, 2.5f, std::numeric_limits<float>::quiet_NaN()}) {
    Tensor ids = FloatIds(2, 3, 13, 2);
    ids.data()[4] = bad;
    try {
      wte.Forward(Dev(ids), true);
      ADD_FAILURE() << "id " << bad << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("wte (TokenEmbedding): token id"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("at position 4"), std::string::npos) << e.what();
    }
  }
  // The layer (and the device) still work after a refusal.
  const Tensor ids = FloatIds(2, 3, 13, 3);
  TokenEmbedding ref("wte", 13, 4, 1);
  ExpectMatch("after a refused id", ref.Forward(ids, false), wte.Forward(Dev(ids), false), kExact);
}

// ---- Quantisation sites on the GPU --------------------------------------------------------------

// A quantiser of `config` installed on every quantisable layer of `layer`; kept alive by `keep`.
std::unique_ptr<Layer> Hooked(std::unique_ptr<Layer> layer, const PrecisionConfig& config,
                              std::vector<std::unique_ptr<SiteQuantizer>>* keep) {
  const std::vector<Layer*> layers = QuantisableLayers(*layer);
  auto q = SiteQuantizer::Create(config, layers);
  EXPECT_TRUE(q.ok()) << q.status().message();
  (*q)->InstallHooks(layers);
  keep->push_back(std::move(q).value());
  return layer;
}

TEST(CudaLmQuantSites, HookedLayersOnTheGpuMatchTheCpu) {
  CPD_REQUIRE_CUDA();
  std::vector<std::unique_ptr<SiteQuantizer>> keep;
  // The embeddings' W and G sites quantise the same table and the same exact gradient on both
  // devices: everything stays bit for bit.
  PrecisionConfig wg;
  wg.global[int(Site::kWeight)].spec = "e4m3";
  wg.global[int(Site::kWeightGrad)].spec = "e5m2";
  CompareOnBothDevices(
      "hooked TokenEmbedding",
      [&] { return Hooked(std::make_unique<TokenEmbedding>("wte", 30, 9, 2), wg, &keep); },
      FloatIds(3, 8, 30, 4), kAllExact);
  CompareOnBothDevices(
      "hooked PositionEmbedding",
      [&] { return Hooked(std::make_unique<PositionEmbedding>("wpe", 8, 9, 3), wg, &keep); },
      Random({3, 8, 9}, 5), kAllExact);
  // A products and E errors of attention, and W/A/E of an LSTM input projection, on operands
  // that are the same on both devices (as layers_cuda_test's hooked convolution): only the
  // products' reassociation differs.
  PrecisionConfig ae;
  ae.global[int(Site::kWeight)].spec = "e4m3";
  ae.global[int(Site::kActivation)].spec = "e4m3";
  ae.global[int(Site::kError)].spec = "fp134";
  for (bool trans_b : {true, false}) {
    AttentionProduct a("h0.attn.qk", trans_b, 0.5f), b("h0.attn.qk", trans_b, 0.5f);
    auto qa = SiteQuantizer::Create(ae, {&a});
    auto qb = SiteQuantizer::Create(ae, {&b});
    ASSERT_TRUE(qa.ok() && qb.ok());
    a.SetQuantHooks(qa->get());
    b.SetQuantHooks(qb->get());
    const Tensor x = Random({2, 2, 6, 5}, 6, -3.f, 3.f);
    const Tensor y = trans_b ? Random({2, 2, 6, 5}, 7, -3.f, 3.f) : Random({2, 2, 5, 4}, 7);
    const Tensor ca = a.Multiply(x, y, true), cb = b.Multiply(Dev(x), Dev(y), true);
    ExpectMatch("hooked product", ca, cb, kReassoc);
    const Tensor dc = Random(ca.shape(), 8, -1e-2f, 1e-2f);
    const auto [dxa, dya] = a.MultiplyBackward(dc);
    const auto [dxb, dyb] = b.MultiplyBackward(Dev(dc));
    ExpectMatch("hooked product da", dxa, dxb, kReassoc);
    ExpectMatch("hooked product db", dya, dyb, kReassoc);
  }
  CompareOnBothDevices(
      "hooked InputProjection",
      [&] {
        auto ih = std::make_unique<InputProjection>("lstm.l0.ih", 6, 20, "lstm.weight_ih_l0",
                                                    "lstm.bias_ih_l0");
        std::mt19937_64 gen(9);
        FillUniform(&ih->weight().value, 0.4f, &gen);
        FillUniform(&ih->bias().value, 0.4f, &gen);
        return Hooked(std::move(ih), ae, &keep);
      },
      Random({4, 3, 6}, 10, -2.f, 2.f), TwinTols{kReassoc, kReassoc, Tol{1e-4, 5e-5}, kExact});
}

TEST(CudaLmQuantSites, AQuantisedGptOnTheGpuFollowsTheCpu) {
  CPD_REQUIRE_CUDA();
  // Every site of every quantisable layer (embeddings, Linear layers, both attention products).
  // Layers after the first see inputs that differ by the products' reassociation, and a value
  // that close to a rounding boundary can round to the neighbouring code on one device only, so
  // the comparison is norm-wise.
  PrecisionConfig pc;
  pc.global[int(Site::kWeight)].spec = "e4m3";
  pc.global[int(Site::kActivation)].spec = "e4m3";
  pc.global[int(Site::kError)].spec = "fp134";
  pc.global[int(Site::kWeightGrad)].spec = "bf16";
  auto cpu = BuildGpt(SmallGpt(true), 21), gpu = BuildGpt(SmallGpt(true), 21);
  const std::vector<Layer*> lc = QuantisableLayers(*cpu), lg = QuantisableLayers(*gpu);
  auto qc = SiteQuantizer::Create(pc, lc);
  auto qg = SiteQuantizer::Create(pc, lg);
  ASSERT_TRUE(qc.ok() && qg.ok());
  (*qc)->InstallHooks(lc);
  (*qg)->InstallHooks(lg);
  MoveToDevice(gpu.get(), Device::kCuda);
  const Tensor ids = FloatIds(2, 10, 29, 22);
  std::vector<int32_t> labels(20);
  for (size_t i = 0; i < labels.size(); ++i) labels[i] = int32_t((i * 5 + 1) % 29);
  const Tensor ya = cpu->Forward(ids, true), yb = gpu->Forward(Dev(ids), true);
  EXPECT_LT(RelativeError(ya, yb), 1e-2) << "logits";
  SoftmaxCrossEntropy ce;
  Tensor da, db;
  const float la = ce.Forward(ya.Reshaped({20, 29}), labels, &da);
  const float lb = ce.Forward(yb.Reshaped({20, 29}), labels, &db);
  EXPECT_NEAR(lb, la, 1e-3 * std::fabs(la));
  cpu->Backward(da.Reshaped(ya.shape()));
  gpu->Backward(db.Reshaped(yb.shape()));
  const std::vector<Param*> pa = cpu->Params(), pb = gpu->Params();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_LT(RelativeError(pa[i]->grad, pb[i]->grad), 2e-2) << pa[i]->name;
  }
}

}  // namespace
}  // namespace cpd::runtime::test
