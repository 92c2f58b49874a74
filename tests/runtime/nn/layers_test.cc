// Tests of runtime/nn/layers.h and runtime/engine/cpu_ops.h: forward passes against
// double-precision references, finite-difference gradient checks of every input and parameter
// gradient, the quantisation hook sites, BatchNorm statistics, dropout masks, initialisation and
// errors.
#include "runtime/nn/layers.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "cpd/config.h"
#include "kernels/grid.h"
#include "runtime/engine/cpu_ops.h"
#include "tests/runtime/nn/grad_check.h"

namespace cpd::runtime {
namespace {

using namespace gradcheck;  // NOLINT: the shared helpers of the layer tests

// Direct double-precision convolution: x [n, c, h, w], w [oc, c, k, k].
std::vector<double> NaiveConv(const Tensor& x, const Tensor& w, const float* bias, int64_t stride,
                              int64_t pad, int64_t* oh_out, int64_t* ow_out) {
  const int64_t n = x.dim(0), c = x.dim(1), h = x.dim(2), wd = x.dim(3);
  const int64_t oc = w.dim(0), k = w.dim(2);
  const int64_t oh = (h + 2 * pad - k) / stride + 1, ow = (wd + 2 * pad - k) / stride + 1;
  std::vector<double> y(size_t(n * oc * oh * ow));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t o = 0; o < oc; ++o) {
      for (int64_t oy = 0; oy < oh; ++oy) {
        for (int64_t ox = 0; ox < ow; ++ox) {
          double s = bias != nullptr ? bias[o] : 0.0;
          for (int64_t ch = 0; ch < c; ++ch) {
            for (int64_t ki = 0; ki < k; ++ki) {
              for (int64_t kj = 0; kj < k; ++kj) {
                const int64_t iy = oy * stride - pad + ki, ix = ox * stride - pad + kj;
                if (iy < 0 || iy >= h || ix < 0 || ix >= wd) continue;
                s += double(w.data()[((o * c + ch) * k + ki) * k + kj]) *
                     double(x.data()[((i * c + ch) * h + iy) * wd + ix]);
              }
            }
          }
          y[size_t(((i * oc + o) * oh + oy) * ow + ox)] = s;
        }
      }
    }
  }
  *oh_out = oh;
  *ow_out = ow;
  return y;
}

void ExpectNear(const Tensor& got, const std::vector<double>& want, double tol,
                const std::string& what) {
  ASSERT_EQ(got.numel(), want.size()) << what;
  size_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::abs(double(got.data()[i]) - want[i]) > tol * (1.0 + std::abs(want[i]))) {
      if (++bad <= 5) {
        ADD_FAILURE() << what << "[" << i << "]: got " << got.data()[i] << ", want " << want[i];
      }
    }
  }
  EXPECT_EQ(bad, 0u) << what;
}

// ---- cpu_ops ------------------------------------------------------------------------------

TEST(CpuOps, Im2ColAndCol2ImAreAdjoint) {
  // <Im2Col(x), c> == <x, Col2Im(c)> for every geometry, including row tiles.
  struct G {
    int64_t c, h, w, k, stride, pad;
  };
  for (const G& g : {G{2, 7, 9, 3, 1, 1}, G{3, 8, 8, 3, 2, 1}, G{1, 6, 5, 5, 1, 2},
                     G{2, 9, 7, 1, 2, 0}, G{2, 10, 10, 5, 1, 0}, G{1, 5, 5, 3, 3, 2}}) {
    cpu::ConvShape s;
    s.n = 1;
    s.c = g.c;
    s.h = g.h;
    s.w = g.w;
    s.oc = 1;
    s.k = g.k;
    s.stride = g.stride;
    s.pad = g.pad;
    ASSERT_TRUE(s.ComputeOutput());
    const Tensor x = Random({g.c, g.h, g.w}, 3);
    const Tensor c = Random({s.ckk(), s.ohw()}, 4);
    Tensor col({s.ckk(), s.ohw()});
    cpu::Im2Col(s, x.data(), col.data());
    // Entry check against the definition.
    for (int64_t ch = 0; ch < g.c; ++ch) {
      for (int64_t ki = 0; ki < g.k; ++ki) {
        for (int64_t kj = 0; kj < g.k; ++kj) {
          for (int64_t oy = 0; oy < s.oh; ++oy) {
            for (int64_t ox = 0; ox < s.ow; ++ox) {
              const int64_t iy = oy * g.stride - g.pad + ki, ix = ox * g.stride - g.pad + kj;
              const float want = iy < 0 || iy >= g.h || ix < 0 || ix >= g.w
                                     ? 0.f
                                     : x.data()[(ch * g.h + iy) * g.w + ix];
              ASSERT_EQ(col.data()[((ch * g.k + ki) * g.k + kj) * s.ohw() + oy * s.ow + ox], want);
            }
          }
        }
      }
    }
    Tensor cc = c.Clone();
    Tensor dx({g.c, g.h, g.w});
    dx.Fill(7.f);  // Col2Im overwrites
    cpu::Col2Im(s, cc.data(), dx.data());
    double lhs = WeightedSum(col, c), rhs = WeightedSum(x, dx);
    EXPECT_NEAR(lhs, rhs, 1e-4 * (1 + std::abs(lhs)));
    // Row tiles of any height give the same column matrix.
    for (int64_t rows = 1; rows <= s.oh; ++rows) {
      for (int64_t oy0 = 0; oy0 < s.oh; oy0 += rows) {
        const int64_t r = std::min(rows, s.oh - oy0);
        std::vector<float> tile(size_t(s.ckk() * r * s.ow));
        cpu::Im2ColRows(s, x.data(), oy0, r, tile.data());
        for (int64_t row = 0; row < s.ckk(); ++row) {
          for (int64_t q = 0; q < r * s.ow; ++q) {
            ASSERT_EQ(tile[size_t(row * r * s.ow + q)], col.data()[row * s.ohw() + oy0 * s.ow + q]);
          }
        }
      }
    }
  }
}

TEST(CpuOps, ParallelSgemmMatchesReference) {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      const int64_t m = 133, n = 47, k = 211;  // m not a multiple of the 16-row blocks
      const Tensor a = Random({ta ? k : m, ta ? m : k}, 5);
      const Tensor b = Random({tb ? n : k, tb ? k : n}, 6);
      Tensor c = Random({m, n}, 7);
      const Tensor c0 = c.Clone();
      cpu::ParallelSgemm(ta, tb, m, n, k, 0.5f, a.data(), ta ? m : k, b.data(), tb ? k : n, 2.f,
                         c.data(), n);
      std::vector<double> want(size_t(m * n));
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          double s = 0;
          for (int64_t l = 0; l < k; ++l) {
            const double av = ta ? a.data()[l * m + i] : a.data()[i * k + l];
            const double bv = tb ? b.data()[j * k + l] : b.data()[l * n + j];
            s += av * bv;
          }
          want[size_t(i * n + j)] = 0.5 * s + 2.0 * c0.data()[i * n + j];
        }
      }
      ExpectNear(c, want, 1e-4, "sgemm");
    }
  }
}

// ---- Linear -------------------------------------------------------------------------------

TEST(Linear, ForwardMatchesReference) {
  Linear fc("fc", 7, 5, true, 11);
  const Tensor x = Random({4, 7}, 1);
  const Tensor y = fc.Forward(x, false);
  ASSERT_EQ(y.shape(), (std::vector<int64_t>{4, 5}));
  std::vector<double> want(20);
  for (int i = 0; i < 4; ++i) {
    for (int o = 0; o < 5; ++o) {
      double s = fc.bias()->value.data()[o];
      for (int j = 0; j < 7; ++j) {
        s += double(fc.weight().value.data()[o * 7 + j]) * x.data()[i * 7 + j];
      }
      want[size_t(i * 5 + o)] = s;
    }
  }
  ExpectNear(y, want, 1e-5, "linear");
}

TEST(Linear, Gradients) {
  Linear fc("fc", 7, 5, true, 11);
  CheckGradients(fc, Random({4, 7}, 1));
  Linear nb("nobias", 6, 3, false, 12);
  EXPECT_EQ(nb.Params().size(), 1u);
  CheckGradients(nb, Random({3, 6}, 2));
  // Large enough for the threaded GEMM path (rows split across threads).
  Linear big("big", 300, 70, true, 13);
  // (A linear map: a large step costs no truncation error and beats float noise in the sum.)
  CheckGradients(big, Random({64, 300}, 3), {.eps = 0.25, .max_elements = 32});
}

TEST(Linear, GradientsAccumulate) {
  Linear fc("fc", 3, 2, true, 1);
  const Tensor x = Random({2, 3}, 1);
  const Tensor dy = Random({2, 2}, 2);
  fc.Forward(x, true);
  fc.Backward(dy);
  const Tensor g1 = fc.weight().grad.Clone();
  fc.Backward(dy);
  for (size_t i = 0; i < g1.numel(); ++i) {
    EXPECT_FLOAT_EQ(fc.weight().grad.data()[i], 2 * g1.data()[i]);
  }
}

TEST(Linear, InitialisationIsPyTorchUniformAndDeterministic) {
  Linear a("a", 400, 120, true, 42), b("b", 400, 120, true, 42), c("c", 400, 120, true, 43);
  const double bound = 1.0 / std::sqrt(400.0);
  double sum = 0, sq = 0;
  const Tensor& w = a.weight().value;
  for (size_t i = 0; i < w.numel(); ++i) {
    const double v = w.data()[i];
    ASSERT_GE(v, -bound);
    ASSERT_LT(v, bound);
    sum += v;
    sq += v * v;
  }
  const double n = double(w.numel());
  EXPECT_NEAR(sum / n, 0.0, 0.02 * bound);
  EXPECT_NEAR(sq / n, bound * bound / 3.0, 0.03 * bound * bound / 3.0);  // var of U(-b, b)
  for (size_t i = 0; i < 120; ++i) {
    EXPECT_LE(std::abs(a.bias()->value.data()[i]), bound);
  }
  EXPECT_EQ(0, std::memcmp(w.data(), b.weight().value.data(), w.numel() * sizeof(float)));
  EXPECT_NE(0, std::memcmp(w.data(), c.weight().value.data(), w.numel() * sizeof(float)));
  EXPECT_FALSE(a.bias()->weight_decay);
  EXPECT_TRUE(a.weight().weight_decay);
  EXPECT_EQ(a.weight().name, "a.weight");
  EXPECT_EQ(a.bias()->name, "a.bias");
  // The draw is pinned down (not std::uniform_real_distribution): the first value from
  // mt19937_64(seed 42), whose sequence the standard fixes.
  std::mt19937_64 gen(42);
  const double u = double(gen() >> 40) * 0x1p-24;
  EXPECT_EQ(w.data()[0], float((2 * u - 1) * double(float(bound))));
}

TEST(Linear, RejectsBadInputs) {
  Linear fc("fc", 4, 2);
  EXPECT_THROW(fc.Forward(Tensor({3, 5}), true), std::invalid_argument);
  EXPECT_THROW(fc.Forward(Tensor({3, 4, 1}), true), std::invalid_argument);
  EXPECT_THROW(fc.Backward(Tensor({3, 2})), std::logic_error);  // no training forward yet
  fc.Forward(Tensor({3, 4}), true);
  EXPECT_THROW(fc.Backward(Tensor({3, 3})), std::invalid_argument);
  fc.Forward(Tensor({3, 4}), false);
  EXPECT_THROW(fc.Backward(Tensor({3, 2})), std::logic_error);  // evaluation forward
  EXPECT_THROW(Linear("bad", 0, 2), std::invalid_argument);
  try {
    fc.Forward(Tensor({3, 5}), true);
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("fc (Linear)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[3, 5]"), std::string::npos) << e.what();
  }
}

TEST(Layers, RejectInputsOnAnotherDeviceThanTheirParameters) {
  Tensor cuda;
  try {
    cuda = Tensor({2, 4}, Device::kCuda);
  } catch (const std::runtime_error&) {
    GTEST_SKIP() << "no CUDA device (or no CUDA in this build): cannot make a CUDA tensor";
  }
  Linear fc("fc", 4, 2);  // parameters on the CPU
  try {
    fc.Forward(cuda, true);
    ADD_FAILURE() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("fc (Linear)"), std::string::npos) << what;
    EXPECT_NE(what.find("cuda"), std::string::npos) << what;
    EXPECT_NE(what.find("cpu"), std::string::npos) << what;
  }
  // The other way round: a CPU input to a layer moved to the GPU.
  MoveToDevice(&fc, Device::kCuda);
  EXPECT_THROW(fc.Forward(Tensor({2, 4}), true), std::invalid_argument);
}

// ---- Conv2d -------------------------------------------------------------------------------

struct ConvCase {
  int64_t n, c, h, w, oc, k, stride, pad;
  bool bias;
};

// Each case runs on every convolution path that can compute it on this machine (im2col
// everywhere; direct on AVX-512 CPUs for its shapes; oneDNN in builds with it).
class ConvTest : public ::testing::TestWithParam<std::tuple<ConvCase, cpu::ConvPath>> {
 protected:
  void SetUp() override {
    const ConvCase p = Case();
    cpu::ConvShape s{.n = p.n,
                     .c = p.c,
                     .h = p.h,
                     .w = p.w,
                     .oc = p.oc,
                     .k = p.k,
                     .stride = p.stride,
                     .pad = p.pad};
    ASSERT_TRUE(s.ComputeOutput());
    if (!cpu::ConvPathRuns(Path(), s)) {
      GTEST_SKIP() << cpu::ConvPathName(Path()) << " cannot compute this shape here";
    }
    cpu::OverrideConvPath(Path());
    ASSERT_EQ(cpu::Conv2dPath(s), Path());
  }
  void TearDown() override { cpu::OverrideConvPath(std::nullopt); }
  static ConvCase Case() { return std::get<0>(GetParam()); }
  static cpu::ConvPath Path() { return std::get<1>(GetParam()); }
};

TEST_P(ConvTest, ForwardMatchesDirectConvolution) {
  const ConvCase p = Case();
  Conv2d conv("conv", p.c, p.oc, p.k, p.stride, p.pad, p.bias, 5);
  const Tensor x = Random({p.n, p.c, p.h, p.w}, 7);
  const Tensor y = conv.Forward(x, false);
  int64_t oh, ow;
  const std::vector<double> want =
      NaiveConv(x, conv.weight().value, p.bias ? conv.bias()->value.data() : nullptr, p.stride,
                p.pad, &oh, &ow);
  ASSERT_EQ(y.shape(), (std::vector<int64_t>{p.n, p.oc, oh, ow}));
  ExpectNear(y, want, 1e-5, "conv");
  EXPECT_EQ(conv.OutputShape(x.shape()), y.shape());
  EXPECT_DOUBLE_EQ(conv.ForwardMacs(x.shape()), double(p.n * p.oc * oh * ow * p.c * p.k * p.k));
}

TEST_P(ConvTest, Gradients) {
  const ConvCase p = Case();
  Conv2d conv("conv", p.c, p.oc, p.k, p.stride, p.pad, p.bias, 5);
  CheckGradients(conv, Random({p.n, p.c, p.h, p.w}, 8), {.eps = 1e-2, .max_elements = 48});
}

INSTANTIATE_TEST_SUITE_P(
    Geometries, ConvTest,
    ::testing::Combine(
        ::testing::Values(ConvCase{2, 3, 8, 8, 4, 3, 1, 1, true},     // same padding (flat path)
                          ConvCase{3, 2, 9, 7, 3, 3, 2, 1, false},    // stride 2, odd sizes
                          ConvCase{2, 4, 6, 6, 5, 1, 1, 0, true},     // pointwise: no im2col
                          ConvCase{2, 4, 7, 7, 3, 1, 2, 0, false},    // projection shortcut
                          ConvCase{2, 1, 12, 12, 3, 5, 1, 2, true},   // LeNet conv1 (28 -> 28)
                          ConvCase{2, 3, 14, 14, 4, 5, 1, 0, true},   // LeNet conv2 (valid)
                          ConvCase{2, 2, 20, 22, 3, 3, 1, 1, false},  // several row tiles
                          ConvCase{1, 2, 5, 5, 2, 3, 3, 2, true},     // stride 3, pad 2
                          ConvCase{5, 2, 4, 4, 2, 3, 1, 0, true},     // batch > threads
                          // Direct AVX-512 kernels (3x3, stride 1, pad 1, width % 16 == 0) with
                          // each register tile: 4 rows x 4 channels, 2 x 8, 1 x 16.
                          ConvCase{2, 4, 4, 16, 8, 3, 1, 1, true},
                          ConvCase{3, 8, 6, 32, 16, 3, 1, 1, false},
                          ConvCase{2, 16, 5, 16, 16, 3, 1, 1, true},
                          // 8-pixel-wide images: two rows per vector, each register tile.
                          ConvCase{2, 8, 8, 8, 12, 3, 1, 1, true},
                          ConvCase{3, 8, 4, 8, 8, 3, 1, 1, false},
                          ConvCase{2, 16, 6, 8, 16, 3, 1, 1, true},
                          // More 8 x 8 images than one weight-gradient group (16).
                          ConvCase{20, 4, 8, 8, 4, 3, 1, 1, false},
                          // Shapes for which oneDNN (AVX2) mixes its JIT kernels with GEMM-based
                          // ones on plain layouts: each operand's layout differs per primitive.
                          ConvCase{2, 2, 3, 3, 4, 5, 1, 2, false},  // kernel larger than image
                          ConvCase{2, 2, 9, 9, 4, 7, 3, 3, true},   // 7x7, stride 3
                          ConvCase{2, 4, 5, 5, 8, 5, 4, 4, false},  // padding 4, stride 4
                          ConvCase{2, 4, 6, 6, 8, 1, 1, 1, true}),  // 1x1 with padding
        ::testing::Values(cpu::ConvPath::kIm2col, cpu::ConvPath::kDirect, cpu::ConvPath::kDnnl)),
    [](const auto& info) {
      return std::to_string(info.index / 3) + "_" + cpu::ConvPathName(std::get<1>(info.param));
    });

// Forward output, input gradient, weight gradient and (with bias) bias gradient of one
// training step of `conv` on the path `path` (nullopt: the automatic choice).
std::vector<Tensor> ConvStep(Conv2d& conv, const Tensor& x, const Tensor& dy,
                             std::optional<cpu::ConvPath> path) {
  cpu::OverrideConvPath(path);
  std::vector<Tensor> out;
  out.push_back(conv.Forward(x, true).Clone());
  for (Param* p : conv.Params()) p->grad.Zero();
  out.push_back(conv.Backward(dy).Clone());
  for (Param* p : conv.Params()) out.push_back(p->grad.Clone());
  cpu::OverrideConvPath(std::nullopt);
  return out;
}

// |a - b| <= tol * max|a| per tensor: the paths sum in different orders (fp32 reassociation).
void ExpectSameUpToRounding(const std::vector<Tensor>& a, const std::vector<Tensor>& b, double tol,
                            const std::vector<std::string>& names = {"y", "dx", "dw", "db"}) {
  ASSERT_EQ(a.size(), b.size());
  ASSERT_LE(a.size(), names.size());
  for (size_t k = 0; k < a.size(); ++k) {
    ASSERT_EQ(a[k].shape(), b[k].shape());
    double scale = 0;
    for (size_t j = 0; j < a[k].numel(); ++j) {
      scale = std::max(scale, double(std::abs(a[k].data()[j])));
    }
    size_t bad = 0;
    for (size_t j = 0; j < a[k].numel(); ++j) {
      if (!(std::abs(double(a[k].data()[j]) - double(b[k].data()[j])) <= tol * scale)) {
        if (bad++ < 3) {
          ADD_FAILURE() << names[k] << "[" << j << "]: " << a[k].data()[j] << " vs "
                        << b[k].data()[j] << " (scale " << scale << ")";
        }
      }
    }
    EXPECT_EQ(bad, 0u) << names[k];
  }
}

bool BitIdentical(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t k = 0; k < a.size(); ++k) {
    if (a[k].shape() != b[k].shape() ||
        std::memcmp(a[k].data(), b[k].data(), a[k].numel() * sizeof(float)) != 0) {
      return false;
    }
  }
  return true;
}

// The convolutions of the models (batch 4) and a few odd ones.
const ConvCase kModelConvs[] = {
    {4, 3, 32, 32, 16, 3, 1, 1, false},   // ResNet conv1
    {4, 16, 32, 32, 16, 3, 1, 1, false},  // ResNet layer1
    {4, 16, 32, 32, 32, 3, 2, 1, false},  // ResNet layer2.0.conv1 (stride 2)
    {4, 16, 32, 32, 32, 1, 2, 0, false},  // ResNet layer2.0 shortcut (1x1, stride 2)
    {4, 32, 16, 16, 32, 3, 1, 1, false},  // ResNet layer2
    {4, 32, 16, 16, 64, 3, 2, 1, false},  // ResNet layer3.0.conv1
    {4, 32, 16, 16, 64, 1, 2, 0, false},  // ResNet layer3.0 shortcut
    {4, 64, 8, 8, 64, 3, 1, 1, false},    // ResNet layer3
    {4, 1, 28, 28, 6, 5, 1, 2, true},     // LeNet conv1
    {4, 6, 14, 14, 16, 5, 1, 0, true},    // LeNet conv2 (padding 0)
    {3, 5, 11, 13, 7, 3, 2, 1, true},     // odd sizes and channels, stride 2
    {3, 6, 9, 7, 10, 1, 1, 0, true},      // 1x1 (a GEMM on the im2col path)
    {2, 4, 10, 10, 8, 3, 1, 0, false},    // 3x3, padding 0
};

TEST(Conv2d, EveryPathAgreesWithIm2colOnModelShapes) {
  // Each other path against im2col + GEMM, forward and backward.
  int compared = 0;
  for (const ConvCase& p : kModelConvs) {
    cpu::ConvShape s{.n = p.n,
                     .c = p.c,
                     .h = p.h,
                     .w = p.w,
                     .oc = p.oc,
                     .k = p.k,
                     .stride = p.stride,
                     .pad = p.pad};
    ASSERT_TRUE(s.ComputeOutput());
    Conv2d conv("conv", p.c, p.oc, p.k, p.stride, p.pad, p.bias, 5);
    const Tensor x = Random({p.n, p.c, p.h, p.w}, 1), dy = Random({p.n, p.oc, s.oh, s.ow}, 2);
    const std::vector<Tensor> ref = ConvStep(conv, x, dy, cpu::ConvPath::kIm2col);
    for (cpu::ConvPath path : {cpu::ConvPath::kDirect, cpu::ConvPath::kDnnl}) {
      if (!cpu::ConvPathRuns(path, s)) continue;
      SCOPED_TRACE(std::string(cpu::ConvPathName(path)) + " c " + std::to_string(p.c) + " oc " +
                   std::to_string(p.oc) + " " + std::to_string(p.h) + "x" + std::to_string(p.w) +
                   " k " + std::to_string(p.k) + " stride " + std::to_string(p.stride) + " pad " +
                   std::to_string(p.pad));
      ExpectSameUpToRounding(ref, ConvStep(conv, x, dy, path), 1e-5);
      ++compared;
    }
  }
  if (compared == 0) GTEST_SKIP() << "only the im2col path exists here";
}

TEST(Conv2d, OneDnnRepeatsBitForBit) {
  // A run must repeat bit for bit for a fixed thread count: oneDNN's primitives (its weight
  // gradient reduces over threads) must not depend on timing. Same layer twice, and a fresh
  // layer (new primitives), at 1, 2 and 3 threads; batch 16 so that every thread has images.
  const int saved = omp_get_max_threads();
  for (const ConvCase& c : kModelConvs) {
    ConvCase p = c;
    p.n = 16;
    cpu::ConvShape s{.n = p.n,
                     .c = p.c,
                     .h = p.h,
                     .w = p.w,
                     .oc = p.oc,
                     .k = p.k,
                     .stride = p.stride,
                     .pad = p.pad};
    ASSERT_TRUE(s.ComputeOutput());
    if (!cpu::ConvPathRuns(cpu::ConvPath::kDnnl, s)) {
      omp_set_num_threads(saved);
      GTEST_SKIP() << "no oneDNN in this build";
    }
    SCOPED_TRACE("c " + std::to_string(p.c) + " oc " + std::to_string(p.oc) + " k " +
                 std::to_string(p.k) + " stride " + std::to_string(p.stride));
    const Tensor x = Random({p.n, p.c, p.h, p.w}, 3), dy = Random({p.n, p.oc, s.oh, s.ow}, 4);
    for (int t : {1, 2, 3}) {
      SCOPED_TRACE(t);
      omp_set_num_threads(t);
      Conv2d a("a", p.c, p.oc, p.k, p.stride, p.pad, p.bias, 6);
      Conv2d b("b", p.c, p.oc, p.k, p.stride, p.pad, p.bias, 6);
      const std::vector<Tensor> first = ConvStep(a, x, dy, cpu::ConvPath::kDnnl);
      EXPECT_TRUE(BitIdentical(first, ConvStep(a, x, dy, cpu::ConvPath::kDnnl)));
      EXPECT_TRUE(BitIdentical(first, ConvStep(b, x, dy, cpu::ConvPath::kDnnl)));
    }
  }
  omp_set_num_threads(saved);
}

TEST(Conv2d, OneDnnBackwardWithoutItsForwardInput) {
  // Backward reuses the blocked x of the forward only for the same x pointer; a copy of x (or
  // no preceding forward) is re-laid out: the same bits either way.
  cpu::ConvShape s{.n = 4, .c = 16, .h = 16, .w = 16, .oc = 32, .k = 3, .stride = 1, .pad = 1};
  ASSERT_TRUE(s.ComputeOutput());
  if (!cpu::ConvPathRuns(cpu::ConvPath::kDnnl, s)) GTEST_SKIP() << "no oneDNN in this build";
  const Tensor x = Random({s.n, s.c, s.h, s.w}, 5), w = Random({s.oc, s.c, 3, 3}, 6),
               dy = Random({s.n, s.oc, s.oh, s.ow}, 7), x2 = x.Clone();
  cpu::OverrideConvPath(cpu::ConvPath::kDnnl);
  cpu::ConvWorkspace ws, fresh;
  Tensor y({s.n, s.oc, s.oh, s.ow});
  std::vector<Tensor> out[3];
  for (auto& o : out) o = {Tensor({s.n, s.c, s.h, s.w}), Tensor({s.oc, s.c, 3, 3}), Tensor({s.oc})};
  cpu::Conv2dForward(s, x.data(), w.data(), nullptr, y.data(), &ws);
  cpu::Conv2dBackward(s, x.data(), w.data(), dy.data(), out[0][0].data(), out[0][1].data(),
                      out[0][2].data(), &ws);
  cpu::Conv2dBackward(s, x2.data(), w.data(), dy.data(), out[1][0].data(), out[1][1].data(),
                      out[1][2].data(), &ws);
  cpu::Conv2dBackward(s, x2.data(), w.data(), dy.data(), out[2][0].data(), out[2][1].data(),
                      out[2][2].data(), &fresh);
  cpu::OverrideConvPath(std::nullopt);
  EXPECT_TRUE(BitIdentical(out[0], out[1]));
  EXPECT_TRUE(BitIdentical(out[0], out[2]));
  // And against im2col, up to rounding.
  cpu::OverrideConvPath(cpu::ConvPath::kIm2col);
  std::vector<Tensor> ref = {Tensor({s.n, s.c, s.h, s.w}), Tensor({s.oc, s.c, 3, 3}),
                             Tensor({s.oc})};
  cpu::ConvWorkspace ws2;
  cpu::Conv2dBackward(s, x.data(), w.data(), dy.data(), ref[0].data(), ref[1].data(), ref[2].data(),
                      &ws2);
  cpu::OverrideConvPath(std::nullopt);
  ExpectSameUpToRounding(ref, out[0], 1e-5, {"dx", "dw", "db"});
}

TEST(Conv2d, PathChoice) {
  // Which path a ResNet shape takes: the direct kernel only exists on AVX-512 CPUs; elsewhere
  // oneDNN where the build has it and the rule prefers it.
  cpu::ConvShape s{.n = 128, .c = 16, .h = 32, .w = 32, .oc = 16, .k = 3, .stride = 1, .pad = 1};
  ASSERT_TRUE(s.ComputeOutput());
#if defined(__x86_64__) && defined(__GNUC__)
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
#else
  const bool avx512 = false;
#endif
  EXPECT_EQ(cpu::ConvPathRuns(cpu::ConvPath::kDirect, s), avx512);
  EXPECT_TRUE(cpu::ConvPathRuns(cpu::ConvPath::kIm2col, s));
  const bool dnnl = cpu::ConvPathRuns(cpu::ConvPath::kDnnl, s);
  EXPECT_EQ(dnnl, bool(CPD_WITH_DNNL));
  EXPECT_EQ(cpu::Conv2dPath(s), avx512 ? cpu::ConvPath::kDirect
                                : dnnl ? cpu::ConvPath::kDnnl
                                       : cpu::ConvPath::kIm2col);
  s.c = s.oc = 64;
  s.h = s.w = 8;  // ResNet stage 3: two rows per vector
  ASSERT_TRUE(s.ComputeOutput());
  EXPECT_EQ(cpu::ConvPathRuns(cpu::ConvPath::kDirect, s), avx512);
  s.h = s.w = 12;  // neither 8 nor a multiple of 16
  ASSERT_TRUE(s.ComputeOutput());
  EXPECT_FALSE(cpu::ConvPathRuns(cpu::ConvPath::kDirect, s));
  s.h = s.w = 32;
  s.stride = 2;
  ASSERT_TRUE(s.ComputeOutput());
  EXPECT_FALSE(cpu::ConvPathRuns(cpu::ConvPath::kDirect, s));
  s.n = 0;  // nothing for oneDNN to do
  EXPECT_FALSE(cpu::ConvPathRuns(cpu::ConvPath::kDnnl, s));
  EXPECT_EQ(cpu::Conv2dPath(s), cpu::ConvPath::kIm2col);
  // Inside a parallel region only im2col runs (on the calling thread).
  s.n = 128;
  bool inside = true;
#pragma omp parallel num_threads(2)
  {
#pragma omp single
    inside = cpu::ConvPathRuns(cpu::ConvPath::kDnnl, s);
  }
  EXPECT_FALSE(inside);
  // The override wins where the path runs and falls back to im2col where it does not.
  cpu::OverrideConvPath(cpu::ConvPath::kDirect);
  EXPECT_EQ(cpu::Conv2dPath(s), cpu::ConvPath::kIm2col);  // stride 2
  cpu::OverrideConvPath(cpu::ConvPath::kIm2col);
  s.stride = 1;
  ASSERT_TRUE(s.ComputeOutput());
  EXPECT_EQ(cpu::Conv2dPath(s), cpu::ConvPath::kIm2col);
  cpu::OverrideConvPath(std::nullopt);
}

TEST(Conv2d, ResultsDoNotDependOnThreadCount) {
  // Large enough (> 4M multiply-adds) for the threaded path: 8 -> 3 and 16 -> 16 channels on
  // 32 x 32, on every path that runs here.
  for (cpu::ConvPath path :
       {cpu::ConvPath::kIm2col, cpu::ConvPath::kDirect, cpu::ConvPath::kDnnl}) {
    for (int64_t oc : {3, 16}) {
      Conv2d conv("conv", 8 * (oc / 3 > 1 ? 2 : 1), oc, 3, 1, 1, true, 3);
      const int64_t c = conv.in_channels();
      cpu::ConvShape s{.n = 16, .c = c, .h = 32, .w = 32, .oc = oc, .k = 3, .stride = 1, .pad = 1};
      ASSERT_TRUE(s.ComputeOutput());
      if (!cpu::ConvPathRuns(path, s)) continue;
      SCOPED_TRACE(std::string(cpu::ConvPathName(path)) + " oc " + std::to_string(oc));
      const Tensor x = Random({16, c, 32, 32}, 1), dy = Random({16, oc, 32, 32}, 2);
      const int saved = omp_get_max_threads();
      std::vector<std::vector<Tensor>> out;
      for (int t : {1, 2, 3}) {
        omp_set_num_threads(t);
        out.push_back(ConvStep(conv, x, dy, path));
      }
      omp_set_num_threads(saved);
      for (size_t i = 1; i < out.size(); ++i) {
        // y and dx per element (each a sum of at most c * 9 products); the weight and bias
        // gradients sum over the batch, split across threads in another order: up to rounding
        // relative to their largest element.
        for (size_t k = 0; k < 2; ++k) {
          const Tensor& a = out[0][k];
          const Tensor& b = out[i][k];
          for (size_t j = 0; j < a.numel(); ++j) {
            ASSERT_NEAR(a.data()[j], b.data()[j], 1e-5 * (1 + std::abs(a.data()[j])))
                << "output " << k << " at " << j;
          }
        }
        ExpectSameUpToRounding({out[0][2], out[0][3]}, {out[i][2], out[i][3]}, 1e-5, {"dw", "db"});
      }
    }
  }
}

TEST(Conv2d, RejectsBadShapes) {
  Conv2d conv("c", 3, 4, 5, 1, 0);
  EXPECT_THROW(conv.Forward(Tensor({1, 2, 8, 8}), true), std::invalid_argument);  // channels
  EXPECT_THROW(conv.Forward(Tensor({1, 3, 4, 8}), true), std::invalid_argument);  // too small
  EXPECT_THROW(conv.Forward(Tensor({3, 8, 8}), true), std::invalid_argument);     // not 4-D
  EXPECT_THROW(Conv2d("bad", 3, 4, 3, 0, 1), std::invalid_argument);
  EXPECT_THROW(Conv2d("bad", 3, 4, 3, 1, -1), std::invalid_argument);
}

TEST(Conv2d, InitialisationBoundUsesFanIn) {
  Conv2d conv("c", 6, 16, 5, 1, 0, true, 9);
  const double bound = 1.0 / std::sqrt(6.0 * 25.0);
  double mx = 0;
  for (size_t i = 0; i < conv.weight().value.numel(); ++i) {
    mx = std::max(mx, double(std::abs(conv.weight().value.data()[i])));
  }
  EXPECT_LE(mx, bound);
  EXPECT_GT(mx, 0.95 * bound);  // 2400 draws reach close to the bound
  EXPECT_EQ(conv.weight().value.shape(), (std::vector<int64_t>{16, 6, 5, 5}));
}

// ---- Quantisation hooks -------------------------------------------------------------------

// Rounds each site onto its own coarse grid and records every call.
class GridHooks : public QuantHooks {
 public:
  struct Call {
    std::string layer;
    char site;
    std::vector<int64_t> shape;
    const float* data;
  };
  static float Round(float v, float step) { return std::nearbyint(v / step) * step; }
  static void RoundAll(Tensor* t, float step) {
    for (size_t i = 0; i < t->numel(); ++i) t->data()[i] = Round(t->data()[i], step);
  }
  static constexpr float kW = 1.f / 16, kA = 1.f / 8, kE = 1.f / 4, kG = 1.f / 2;

  void QuantizeWeight(const Layer& layer, const Tensor& master, Tensor* used) override {
    calls.push_back({layer.name(), 'W', used->shape(), master.data()});
    EXPECT_EQ(used->shape(), master.shape());
    EXPECT_NE(used->data(), master.data());
    for (size_t i = 0; i < master.numel(); ++i) used->data()[i] = Round(master.data()[i], kW);
  }
  void QuantizeActivation(const Layer& layer, const Tensor& x, Tensor* used) override {
    calls.push_back({layer.name(), 'A', used->shape(), used->data()});
    EXPECT_EQ(used->shape(), x.shape());
    EXPECT_NE(used->data(), x.data());
    used->CopyFrom(x);
    RoundAll(used, kA);
  }
  void QuantizeError(const Layer& layer, const Tensor& dy, Tensor* used) override {
    calls.push_back({layer.name(), 'E', used->shape(), used->data()});
    EXPECT_EQ(used->shape(), dy.shape());
    EXPECT_NE(used->data(), dy.data());
    used->CopyFrom(dy);
    RoundAll(used, kE);
  }
  void QuantizeWeightGrad(const Layer& layer, Tensor* dw) override {
    calls.push_back({layer.name(), 'G', dw->shape(), dw->data()});
    RoundAll(dw, kG);
  }
  std::string Sites() const {
    std::string s;
    for (const Call& c : calls) s += c.site;
    return s;
  }
  std::vector<Call> calls;
};

Tensor Rounded(const Tensor& t, float step) {
  Tensor r = t.Clone();
  GridHooks::RoundAll(&r, step);
  return r;
}

TEST(QuantHooks, LinearCallsEachSiteWithTheRightTensors) {
  Linear fc("fc", 6, 4, true, 3);
  GridHooks hooks;
  fc.SetQuantHooks(&hooks);
  const Tensor x = Random({5, 6}, 1, -2, 2), dy = Random({5, 4}, 2, -2, 2);
  const Tensor x_copy = x.Clone(), dy_copy = dy.Clone();
  const Tensor w_master = fc.weight().value.Clone();

  const Tensor y = fc.Forward(x, true).Clone();
  EXPECT_EQ(hooks.Sites(), "AW");
  EXPECT_EQ(hooks.calls[0].shape, x.shape());
  EXPECT_NE(hooks.calls[0].data, x.data()) << "A must be quantised on a copy";
  EXPECT_EQ(hooks.calls[1].data, fc.weight().value.data()) << "W from the master";
  // The caller's input and the master weight are untouched.
  EXPECT_EQ(0, std::memcmp(x.data(), x_copy.data(), x.numel() * sizeof(float)));
  EXPECT_EQ(
      0, std::memcmp(w_master.data(), fc.weight().value.data(), w_master.numel() * sizeof(float)));
  // y = A W^T + b from the hooked tensors.
  const Tensor xa = Rounded(x, GridHooks::kA), wq = Rounded(w_master, GridHooks::kW);
  std::vector<double> want(20);
  for (int i = 0; i < 5; ++i) {
    for (int o = 0; o < 4; ++o) {
      double s = fc.bias()->value.data()[o];
      for (int j = 0; j < 6; ++j) s += double(wq.data()[o * 6 + j]) * xa.data()[i * 6 + j];
      want[size_t(i * 4 + o)] = s;
    }
  }
  ExpectNear(y, want, 1e-6, "hooked forward");

  fc.weight().grad.Zero();
  fc.bias()->grad.Zero();
  const Tensor dx = fc.Backward(dy).Clone();
  EXPECT_EQ(hooks.Sites(), "AWEG");
  EXPECT_NE(hooks.calls[2].data, dy.data()) << "E must be quantised on a copy";
  EXPECT_EQ(hooks.calls[3].shape, fc.weight().value.shape());
  EXPECT_EQ(0, std::memcmp(dy.data(), dy_copy.data(), dy.numel() * sizeof(float)));
  const Tensor e = Rounded(dy, GridHooks::kE);
  std::vector<double> want_dw(24), want_db(4, 0.0), want_dx(30);
  for (int o = 0; o < 4; ++o) {
    for (int j = 0; j < 6; ++j) {
      double s = 0;
      for (int i = 0; i < 5; ++i) s += double(e.data()[i * 4 + o]) * xa.data()[i * 6 + j];
      want_dw[size_t(o * 6 + j)] = GridHooks::Round(float(s), GridHooks::kG);
    }
    for (int i = 0; i < 5; ++i) want_db[size_t(o)] += e.data()[i * 4 + o];  // not G-rounded
  }
  for (int i = 0; i < 5; ++i) {
    for (int j = 0; j < 6; ++j) {
      double s = 0;
      for (int o = 0; o < 4; ++o) s += double(e.data()[i * 4 + o]) * wq.data()[o * 6 + j];
      want_dx[size_t(i * 6 + j)] = s;
    }
  }
  ExpectNear(fc.weight().grad, want_dw, 1e-6, "G-quantised weight grad");
  ExpectNear(fc.bias()->grad, want_db, 1e-6, "bias grad");
  ExpectNear(dx, want_dx, 1e-6, "dx from E and W");
}

TEST(QuantHooks, Conv2dUsesHookedTensorsForwardAndBackward) {
  Conv2d conv("conv", 2, 3, 3, 2, 1, true, 4);
  GridHooks hooks;
  conv.SetQuantHooks(&hooks);
  const Tensor x = Random({2, 2, 7, 7}, 1, -2, 2);
  const Tensor x_copy = x.Clone();
  const Tensor w_master = conv.weight().value.Clone();
  const Tensor y = conv.Forward(x, true).Clone();
  ASSERT_EQ(hooks.Sites(), "AW");
  EXPECT_EQ(0, std::memcmp(x.data(), x_copy.data(), x.numel() * sizeof(float)));
  const Tensor xa = Rounded(x, GridHooks::kA), wq = Rounded(w_master, GridHooks::kW);
  int64_t oh, ow;
  ExpectNear(y, NaiveConv(xa, wq, conv.bias()->value.data(), 2, 1, &oh, &ow), 1e-5,
             "hooked conv forward");

  // Backward: dx equals the gradient of the un-hooked layer with the rounded weights
  // evaluated at the rounded dy; dW equals the G-rounding of that layer's dW.
  const Tensor dy = Random(y.shape(), 2, -2, 2);
  conv.weight().grad.Zero();
  const Tensor dx = conv.Backward(dy).Clone();
  ASSERT_EQ(hooks.Sites(), "AWEG");
  EXPECT_EQ(hooks.calls[3].shape, conv.weight().value.shape());
  Conv2d ref("ref", 2, 3, 3, 2, 1, true, 4);
  ref.weight().value.CopyFrom(wq);
  ref.Forward(xa, true);
  ref.weight().grad.Zero();
  ref.bias()->grad.Zero();
  const Tensor ref_dx = ref.Backward(Rounded(dy, GridHooks::kE));
  std::vector<double> want_dx(ref_dx.data(), ref_dx.data() + ref_dx.numel());
  ExpectNear(dx, want_dx, 1e-6, "dx");
  std::vector<double> want_dw;
  for (size_t i = 0; i < ref.weight().grad.numel(); ++i) {
    want_dw.push_back(GridHooks::Round(ref.weight().grad.data()[i], GridHooks::kG));
  }
  ExpectNear(conv.weight().grad, want_dw, 1e-6, "dW");
  std::vector<double> want_db(ref.bias()->grad.data(), ref.bias()->grad.data() + 3);
  ExpectNear(conv.bias()->grad, want_db, 1e-6, "db");
}

TEST(QuantHooks, EvaluationForwardQuantisesWAndA) {
  Linear fc("fc", 3, 2);
  GridHooks hooks;
  fc.SetQuantHooks(&hooks);
  fc.Forward(Random({2, 3}, 1), false);
  EXPECT_EQ(hooks.Sites(), "AW");
  fc.SetQuantHooks(nullptr);
  fc.Forward(Random({2, 3}, 1), true);
  fc.Backward(Random({2, 2}, 2));
  EXPECT_EQ(hooks.Sites(), "AW") << "no calls once the hooks are removed";
}

TEST(QuantHooks, CompositesInstallOnEveryQuantisableDescendant) {
  Sequential seq("net");
  seq.Emplace<Conv2d>("conv", 2, 4, 3, 1, 1, false, 1);
  seq.Emplace<BasicBlock>("block", 4, 8, 2, 7);
  seq.Emplace<GlobalAvgPool>("pool");
  seq.Emplace<Linear>("fc", 8, 3, true, 2);
  GridHooks hooks;
  seq.SetQuantHooks(&hooks);
  const Tensor y = seq.Forward(Random({2, 2, 6, 6}, 1), true);
  seq.Backward(Random(y.shape(), 2));
  std::set<std::string> seen;
  for (const auto& c : hooks.calls) seen.insert(c.layer + "." + c.site);
  for (const char* l : {"conv", "block.conv1", "block.conv2", "block.shortcut.conv", "fc"}) {
    for (const char* s : {"W", "A", "E", "G"}) {
      EXPECT_TRUE(seen.count(std::string(l) + "." + s)) << l << "." << s;
    }
  }
  EXPECT_EQ(seen.size(), 20u);  // nothing else (BatchNorm, pooling) is a site
  EXPECT_FALSE(seq.Quantizable());
  int quantisable = 0;
  for (Layer* l : seq.Flatten()) quantisable += l->Quantizable();
  EXPECT_EQ(quantisable, 5);
}

// ---- BatchNorm ----------------------------------------------------------------------------

TEST(BatchNorm, TrainForwardNormalisesAndUpdatesRunningStats) {
  BatchNorm bn("bn", 3, 1e-5f, 0.1f);
  const Tensor x = Random({4, 3, 5, 5}, 1, -2, 6);
  const Tensor y = bn.Forward(x, true);
  for (int64_t c = 0; c < 3; ++c) {
    double s = 0, sq = 0;
    const double count = 4 * 25;
    for (int64_t n = 0; n < 4; ++n) {
      for (int64_t p = 0; p < 25; ++p) s += x.data()[(n * 3 + c) * 25 + p];
    }
    const double mean = s / count;
    for (int64_t n = 0; n < 4; ++n) {
      for (int64_t p = 0; p < 25; ++p) {
        const double d = x.data()[(n * 3 + c) * 25 + p] - mean;
        sq += d * d;
      }
    }
    const double var = sq / count;
    double ys = 0, ysq = 0;
    for (int64_t n = 0; n < 4; ++n) {
      for (int64_t p = 0; p < 25; ++p) {
        const double v = y.data()[(n * 3 + c) * 25 + p];
        EXPECT_NEAR(v, (x.data()[(n * 3 + c) * 25 + p] - mean) / std::sqrt(var + 1e-5), 1e-4);
        ys += v;
        ysq += v * v;
      }
    }
    EXPECT_NEAR(ys / count, 0.0, 1e-5);
    EXPECT_NEAR(ysq / count, 1.0, 1e-3);
    // PyTorch: running = 0.9 * running + 0.1 * batch, with the unbiased batch variance.
    EXPECT_NEAR(bn.running_mean().data()[c], 0.1 * mean, 1e-6);
    EXPECT_NEAR(bn.running_var().data()[c], 0.9 + 0.1 * var * count / (count - 1), 1e-5);
  }
  // A second step compounds.
  const float rm1 = bn.running_mean().data()[0];
  bn.Forward(x, true);
  EXPECT_NEAR(bn.running_mean().data()[0], 0.9 * rm1 + 0.1 * (rm1 / 0.1), 1e-5);
}

TEST(BatchNorm, EvalUsesRunningStatistics) {
  BatchNorm bn("bn", 2);
  bn.running_mean().data()[0] = 1.f;
  bn.running_mean().data()[1] = -2.f;
  bn.running_var().data()[0] = 4.f;
  bn.running_var().data()[1] = 0.25f;
  bn.gamma().value.data()[1] = 3.f;
  bn.beta().value.data()[0] = 0.5f;
  const Tensor x = Random({3, 2}, 1, -3, 3);
  const Tensor y = bn.Forward(x, false);
  for (int n = 0; n < 3; ++n) {
    EXPECT_NEAR(y.data()[n * 2], (x.data()[n * 2] - 1) / std::sqrt(4 + 1e-5) + 0.5, 1e-5);
    EXPECT_NEAR(y.data()[n * 2 + 1], 3 * (x.data()[n * 2 + 1] + 2) / std::sqrt(0.25 + 1e-5), 1e-4);
  }
  EXPECT_EQ(bn.running_mean().data()[0], 1.f) << "evaluation leaves the statistics alone";
  EXPECT_THROW(bn.Backward(y), std::logic_error);
}

TEST(BatchNorm, ParamsBuffersAndErrors) {
  BatchNorm bn("bn", 4);
  const auto params = bn.Params();
  ASSERT_EQ(params.size(), 2u);
  EXPECT_EQ(params[0]->name, "bn.gamma");
  EXPECT_EQ(params[1]->name, "bn.beta");
  EXPECT_FALSE(params[0]->weight_decay);
  EXPECT_FALSE(params[1]->weight_decay);
  EXPECT_EQ(params[0]->value.data()[3], 1.f);
  EXPECT_EQ(params[1]->value.data()[3], 0.f);
  const auto buffers = bn.Buffers();
  ASSERT_EQ(buffers.size(), 2u);
  EXPECT_EQ(buffers[0].first, "bn.running_mean");
  EXPECT_EQ(buffers[1].first, "bn.running_var");
  EXPECT_EQ(buffers[1].second->data()[0], 1.f);
  EXPECT_THROW(bn.Forward(Tensor({1, 4}), true), std::invalid_argument);  // one value/channel
  EXPECT_NO_THROW(bn.Forward(Tensor({1, 4}), false));
  EXPECT_THROW(bn.Forward(Tensor({2, 3}), true), std::invalid_argument);
  EXPECT_THROW(bn.Forward(Tensor({2, 4, 3}), true), std::invalid_argument);
}

TEST(BatchNorm, StatisticsSurviveALargeMean) {
  // One-pass statistics must not cancel: mean 10000, std ~0.58 (E[x^2] - E[x]^2 in float would
  // be off by ~10 here).
  BatchNorm bn("bn", 1);
  Tensor x = Random({8, 1, 16, 16}, 3, -1.f, 1.f);
  for (size_t i = 0; i < x.numel(); ++i) x.data()[i] += 10000.f;
  double mean = 0, var = 0;
  for (size_t i = 0; i < x.numel(); ++i) mean += x.data()[i];
  mean /= double(x.numel());
  for (size_t i = 0; i < x.numel(); ++i) var += (x.data()[i] - mean) * (x.data()[i] - mean);
  var /= double(x.numel());
  const Tensor y = bn.Forward(x, true);
  double sq = 0;
  for (size_t i = 0; i < y.numel(); ++i) sq += double(y.data()[i]) * y.data()[i];
  EXPECT_NEAR(sq / double(y.numel()), var / (var + 1e-5), 1e-3);
  EXPECT_NEAR(bn.running_mean().data()[0], 0.1 * mean, 1e-3);
}

TEST(BatchNorm, Gradients4D) {
  BatchNorm bn("bn", 3);
  bn.gamma().value.CopyFrom(Random({3}, 4, 0.5f, 2.f));
  bn.beta().value.CopyFrom(Random({3}, 5));
  CheckGradients(bn, Random({4, 3, 3, 3}, 6, -2, 2), {.eps = 1e-2, .max_elements = 64});
}

TEST(BatchNorm, GradientsThreaded) {
  // > 32 Ki elements: channels split across threads.
  BatchNorm bn("bn", 4);
  bn.gamma().value.CopyFrom(Random({4}, 4, 0.5f, 2.f));
  CheckGradients(bn, Random({16, 4, 24, 24}, 6, -2, 2), {.eps = 1e-2, .max_elements = 24});
}

TEST(BatchNorm, Gradients2D) {
  BatchNorm bn("bn", 5);
  bn.gamma().value.CopyFrom(Random({5}, 4, 0.5f, 2.f));
  CheckGradients(bn, Random({6, 5}, 6, -2, 2));
}

TEST(BatchNorm, FusedReluMatchesBatchNormThenRelu) {
  BatchNorm fused("fused", 3), plain("plain", 3);
  fused.set_fused_relu(true);
  const Tensor x = Random({4, 3, 4, 4}, 1, -2, 2), dy = Random({4, 3, 4, 4}, 2);
  ReLU relu("relu");
  const Tensor yf = fused.Forward(x, true).Clone();
  const Tensor yp = relu.Forward(plain.Forward(x, true), true).Clone();
  for (size_t i = 0; i < yf.numel(); ++i) ASSERT_NEAR(yf.data()[i], yp.data()[i], 1e-6);
  const Tensor dxf = fused.Backward(dy).Clone();
  const Tensor dxp = plain.Backward(relu.Backward(dy)).Clone();
  for (size_t i = 0; i < dxf.numel(); ++i) ASSERT_NEAR(dxf.data()[i], dxp.data()[i], 1e-5);
  for (int c = 0; c < 3; ++c) {
    EXPECT_NEAR(fused.gamma().grad.data()[c], plain.gamma().grad.data()[c], 1e-4);
    EXPECT_NEAR(fused.beta().grad.data()[c], plain.beta().grad.data()[c], 1e-4);
  }
  const Tensor ye = fused.Forward(x, false);
  for (size_t i = 0; i < ye.numel(); ++i) ASSERT_GE(ye.data()[i], 0.f);
}

// ---- Activations, pooling, reshaping --------------------------------------------------------

TEST(ReLU, ForwardAndGradients) {
  ReLU relu("relu");
  const Tensor x = AwayFromZero({3, 4, 5}, 1);
  const Tensor y = relu.Forward(x, true);
  for (size_t i = 0; i < x.numel(); ++i) EXPECT_EQ(y.data()[i], std::max(x.data()[i], 0.f));
  CheckGradients(relu, x);
  Tensor nan({1});
  nan.data()[0] = std::nanf("");
  EXPECT_TRUE(std::isnan(relu.Forward(nan, false).data()[0])) << "NaN must propagate";
}

// The 2x2 / stride-2 fast paths (vectorised, with masked tails) against a plain reference:
// widths around the 16-column vector, odd input sizes (the last row/column dropped), ties
// (first maximum in row-major order wins) and NaNs (a NaN wins and stays).
TEST(Pooling, MaxPool2x2FastPathMatchesReference) {
  std::mt19937 rng(7);
  for (int64_t h : {2, 3, 9, 28}) {
    for (int64_t w : {2, 3, 5, 16, 28, 31, 32, 33, 64, 70}) {
      const int64_t planes = 3, oh = h / 2, ow = w / 2;
      std::vector<float> x(size_t(planes * h * w));
      // Few distinct values, so that ties are common; some NaNs.
      for (float& v : x) v = float(int(rng() % 5) - 2);
      for (size_t i = 0; i < x.size(); i += 37) x[i] = std::nanf("");
      std::vector<float> y(size_t(planes * oh * ow), -99.f);
      std::vector<int32_t> arg(y.size(), -1);
      cpu::MaxPool2dForward(planes, h, w, 2, 2, oh, ow, x.data(), y.data(), arg.data());
      for (int64_t p = 0; p < planes; ++p) {
        for (int64_t oy = 0; oy < oh; ++oy) {
          for (int64_t ox = 0; ox < ow; ++ox) {
            int32_t best = int32_t((2 * oy) * w + 2 * ox);
            const float* xp = x.data() + p * h * w;
            for (int64_t ki = 0; ki < 2; ++ki) {
              for (int64_t kj = 0; kj < 2; ++kj) {
                const int32_t idx = int32_t((2 * oy + ki) * w + 2 * ox + kj);
                if (xp[idx] > xp[best] || (std::isnan(xp[idx]) && !std::isnan(xp[best]))) {
                  best = idx;
                }
              }
            }
            const size_t o = size_t((p * oh + oy) * ow + ox);
            ASSERT_EQ(arg[o], best) << "h " << h << " w " << w << " at " << oy << "," << ox;
            if (std::isnan(xp[best])) {
              ASSERT_TRUE(std::isnan(y[o]));
            } else {
              ASSERT_EQ(y[o], xp[best]);
            }
          }
        }
      }
    }
  }
}

TEST(Pooling, MaxPoolForwardAndGradients) {
  MaxPool2d pool("pool", 2);
  const Tensor x = Distinct({2, 3, 6, 7}, 1);  // odd width: the last column is dropped
  const Tensor y = pool.Forward(x, true);
  ASSERT_EQ(y.shape(), (std::vector<int64_t>{2, 3, 3, 3}));
  for (int64_t p = 0; p < 6; ++p) {
    for (int64_t oy = 0; oy < 3; ++oy) {
      for (int64_t ox = 0; ox < 3; ++ox) {
        float m = -1e30f;
        for (int a = 0; a < 2; ++a) {
          for (int b = 0; b < 2; ++b)
            m = std::max(m, x.data()[p * 42 + (2 * oy + a) * 7 + 2 * ox + b]);
        }
        EXPECT_EQ(y.data()[p * 9 + oy * 3 + ox], m);
      }
    }
  }
  CheckGradients(pool, x);
  MaxPool2d overlapping("overlap", 3, 2);
  CheckGradients(overlapping, Distinct({2, 2, 7, 7}, 2));
}

TEST(Pooling, AvgPoolForwardAndGradients) {
  AvgPool2d pool("avg", 2);
  const Tensor x = Random({2, 2, 4, 6}, 1);
  const Tensor y = pool.Forward(x, true);
  ASSERT_EQ(y.shape(), (std::vector<int64_t>{2, 2, 2, 3}));
  EXPECT_NEAR(y.data()[0], (x.data()[0] + x.data()[1] + x.data()[6] + x.data()[7]) / 4, 1e-6);
  CheckGradients(pool, x);
  AvgPool2d overlapping("avg3", 3, 1);
  CheckGradients(overlapping, Random({1, 2, 5, 5}, 2));
}

TEST(Pooling, GlobalAvgPool) {
  GlobalAvgPool gap("gap");
  const Tensor x = Random({3, 4, 5, 5}, 1);
  const Tensor y = gap.Forward(x, true);
  ASSERT_EQ(y.shape(), (std::vector<int64_t>{3, 4}));
  double s = 0;
  for (int i = 0; i < 25; ++i) s += x.data()[25 + i];
  EXPECT_NEAR(y.data()[1], s / 25, 1e-6);
  CheckGradients(gap, x);
  EXPECT_THROW(gap.Forward(Tensor({3, 4}), true), std::invalid_argument);
}

TEST(Flatten, ReshapesBothWays) {
  Flatten flat("flat");
  const Tensor x = Random({2, 3, 4, 5}, 1);
  const Tensor y = flat.Forward(x, true);
  EXPECT_EQ(y.shape(), (std::vector<int64_t>{2, 60}));
  EXPECT_EQ(y.data(), x.data()) << "a view, not a copy";
  const Tensor dy = Random({2, 60}, 2);
  const Tensor dx = flat.Backward(dy);
  EXPECT_EQ(dx.shape(), x.shape());
  CheckGradients(flat, x);
}

// ---- Dropout ------------------------------------------------------------------------------

TEST(Dropout, MaskIsAFunctionOfSeedStepAndIndex) {
  Dropout d("drop", 0.3, 77);
  Tensor x({64, 100});
  x.Fill(1.f);
  d.SetStep(5);
  const Tensor a = d.Forward(x, true).Clone();
  d.SetStep(5);
  const Tensor b = d.Forward(x, true).Clone();
  d.SetStep(6);
  const Tensor c = d.Forward(x, true).Clone();
  Dropout other("other", 0.3, 78);
  other.SetStep(5);
  const Tensor e = other.Forward(x, true).Clone();
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.numel() * sizeof(float)));
  EXPECT_NE(0, std::memcmp(a.data(), c.data(), a.numel() * sizeof(float)));
  EXPECT_NE(0, std::memcmp(a.data(), e.data(), a.numel() * sizeof(float)));
  const uint64_t key = kernels::MakeRandomKey(77, 5);
  const float scale = float(1.0 / 0.7);
  double sum = 0;
  size_t dropped = 0;
  for (size_t i = 0; i < a.numel(); ++i) {
    const bool keep = kernels::RandomBits(key, i) >= d.threshold();
    ASSERT_EQ(a.data()[i], keep ? scale : 0.f) << i;
    dropped += !keep;
    sum += a.data()[i];
  }
  EXPECT_NEAR(double(dropped) / double(a.numel()), 0.3, 0.02);
  EXPECT_NEAR(sum / double(a.numel()), 1.0, 0.03) << "inverted dropout keeps the mean";
}

TEST(Dropout, BackwardUsesTheForwardMaskAndEvalIsIdentity) {
  Dropout d("drop", 0.5, 3);
  d.SetStep(1);
  const Tensor x = Random({4, 50}, 1);
  CheckGradients(d, x);  // the mask is fixed by (seed, step): a linear map
  d.SetStep(1);
  const Tensor y = d.Forward(x, true).Clone();
  d.SetStep(2);  // a later SetStep does not change the pending backward
  const Tensor dx = d.Backward(x);
  for (size_t i = 0; i < x.numel(); ++i) EXPECT_EQ(dx.data()[i], y.data()[i]);
  const Tensor e = d.Forward(x, false);
  EXPECT_EQ(e.data(), x.data());
  EXPECT_THROW(Dropout("bad", 1.0, 0), std::invalid_argument);
  EXPECT_THROW(Dropout("bad", -0.1, 0), std::invalid_argument);
  Dropout zero("zero", 0.0, 0);
  EXPECT_EQ(zero.Forward(x, true).data(), x.data());
}

TEST(Dropout, SequentialForwardsSetStep) {
  Sequential seq("s");
  auto* d = seq.Emplace<Dropout>("d", 0.5, 9);
  Tensor x({1, 1000});
  x.Fill(1.f);
  seq.SetStep(3);
  const Tensor a = seq.Forward(x, true).Clone();
  d->SetStep(3);
  const Tensor b = d->Forward(x, true);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.numel() * sizeof(float)));
}

// ---- Composites ---------------------------------------------------------------------------

TEST(Sequential, ChainsForwardBackwardAndCollectsParams) {
  Sequential seq("mlp");
  seq.Emplace<Flatten>("flat");
  seq.Emplace<Linear>("fc1", 12, 8, false, 1);  // no bias before BatchNorm: its grad is 0
  seq.Emplace<BatchNorm>("bn", 8);
  seq.Emplace<ReLU>("relu");
  seq.Emplace<Linear>("fc2", 8, 3, true, 2);
  const auto params = seq.Params();
  std::vector<std::string> names;
  for (Param* p : params) names.push_back(p->name);
  EXPECT_EQ(names, (std::vector<std::string>{"fc1.weight", "bn.gamma", "bn.beta", "fc2.weight",
                                             "fc2.bias"}));
  ASSERT_EQ(seq.Buffers().size(), 2u);
  EXPECT_EQ(seq.Flatten().size(), 6u);
  EXPECT_EQ(seq.Flatten()[0], &seq);
  EXPECT_EQ(seq.OutputShape({5, 3, 2, 2}), (std::vector<int64_t>{5, 3}));
  CheckGradients(seq, Random({5, 3, 2, 2}, 3), kWithKinks);
}

TEST(BasicBlock, IdentityShortcutGradients) {
  BasicBlock block("layer1.0", 4, 4, 1, 3);
  EXPECT_FALSE(block.has_projection());
  std::vector<std::string> names;
  for (Layer* l : block.Flatten()) names.push_back(l->name());
  EXPECT_EQ(names, (std::vector<std::string>{"layer1.0", "layer1.0.conv1", "layer1.0.bn1",
                                             "layer1.0.conv2", "layer1.0.bn2"}));
  EXPECT_EQ(block.Params().size(), 6u);  // two convs (no bias), two BatchNorms
  CheckGradients(block, Random({2, 4, 6, 6}, 4), kWithKinks);
}

TEST(BasicBlock, ProjectionShortcutGradients) {
  BasicBlock block("layer2.0", 3, 6, 2, 3);
  ASSERT_TRUE(block.has_projection());
  std::vector<std::string> names;
  for (Layer* l : block.Flatten()) names.push_back(l->name());
  EXPECT_EQ(names, (std::vector<std::string>{"layer2.0", "layer2.0.conv1", "layer2.0.bn1",
                                             "layer2.0.conv2", "layer2.0.bn2",
                                             "layer2.0.shortcut.conv", "layer2.0.shortcut.bn"}));
  EXPECT_EQ(block.shortcut_conv()->stride(), 2);
  EXPECT_EQ(block.shortcut_conv()->kernel(), 1);
  EXPECT_EQ(block.Buffers().size(), 6u);
  EXPECT_EQ(block.OutputShape({2, 3, 7, 7}), (std::vector<int64_t>{2, 6, 4, 4}));
  CheckGradients(block, Random({2, 3, 7, 7}, 4), kWithKinks);
}

TEST(BasicBlock, ForwardMatchesItsDefinition) {
  // relu(bn2(conv2(relu(bn1(conv1 x)))) + bn(conv_s x)) from separately driven layers.
  BasicBlock block("b", 2, 4, 2, 11);
  const Tensor x = Random({3, 2, 6, 6}, 1);
  const Tensor y = block.Forward(x, true).Clone();
  ReLU r1("r1");
  BatchNorm bn1("bn1", 4), bn2("bn2", 4), bns("bns", 4);  // fresh: gamma 1, beta 0 as the block's
  const Tensor h = r1.Forward(bn1.Forward(block.conv1().Forward(x, true), true), true).Clone();
  const Tensor main = bn2.Forward(block.conv2().Forward(h, true), true).Clone();
  const Tensor sc = bns.Forward(block.shortcut_conv()->Forward(x, true), true);
  for (size_t i = 0; i < y.numel(); ++i) {
    ASSERT_NEAR(y.data()[i], std::max(main.data()[i] + sc.data()[i], 0.f), 1e-5) << i;
  }
}

TEST(BasicBlock, EvalAfterTrainingUsesRunningStats) {
  BasicBlock block("b", 3, 3, 1, 2);
  const Tensor x = Random({4, 3, 5, 5}, 1);
  for (int i = 0; i < 3; ++i) block.Forward(x, true);
  const Tensor train_y = block.Forward(x, true).Clone();
  const Tensor eval_y = block.Forward(x, false);
  double diff = 0;
  for (size_t i = 0; i < eval_y.numel(); ++i)
    diff += std::abs(eval_y.data()[i] - train_y.data()[i]);
  EXPECT_GT(diff, 1e-3) << "evaluation must not use the batch statistics";
  EXPECT_THROW(block.Backward(Tensor(eval_y.shape())), std::logic_error);
}

// ---- Loss ---------------------------------------------------------------------------------

TEST(SoftmaxCrossEntropy, ValueGradientAndStability) {
  SoftmaxCrossEntropy ce;
  Tensor logits({2, 3});
  const float v[6] = {1.f, 2.f, 3.f, 1000.f, -1000.f, 0.f};
  std::copy(v, v + 6, logits.data());
  Tensor d;
  const float loss = ce.Forward(logits, {2, 1}, &d);
  const double l0 = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0)) - 3.0;
  const double l1 = 2000.0;  // -log softmax = 1000 - (-1000), stable without overflow
  EXPECT_NEAR(loss, (l0 + l1) / 2, 1e-3);
  ASSERT_EQ(d.shape(), logits.shape());
  const double z = std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  EXPECT_NEAR(d.data()[0], std::exp(1.0) / z / 2, 1e-6);
  EXPECT_NEAR(d.data()[2], (std::exp(3.0) / z - 1) / 2, 1e-6);
  EXPECT_NEAR(d.data()[3], 0.5, 1e-6);
  EXPECT_NEAR(d.data()[4], -0.5, 1e-6);
  for (int i = 0; i < 6; ++i) EXPECT_TRUE(std::isfinite(d.data()[i]));
  EXPECT_EQ(SoftmaxCrossEntropy::CountCorrect(logits, {2, 1}), 1);
  EXPECT_EQ(SoftmaxCrossEntropy::CountCorrect(logits, {2, 0}), 2);
}

TEST(SoftmaxCrossEntropy, FiniteDifferences) {
  SoftmaxCrossEntropy ce;
  const Tensor logits = Random({5, 7}, 3, -3, 3);
  const std::vector<int32_t> labels = {0, 6, 3, 3, 1};
  Tensor d;
  ce.Forward(logits, labels, &d);
  for (size_t i = 0; i < logits.numel(); ++i) {
    Tensor p = logits.Clone(), m = logits.Clone();
    p.data()[i] += 1e-2f;
    m.data()[i] -= 1e-2f;
    const double num =
        (double(ce.Forward(p, labels, nullptr)) - double(ce.Forward(m, labels, nullptr))) /
        (double(p.data()[i]) - double(m.data()[i]));
    EXPECT_NEAR(num, d.data()[i], 2e-3) << i;
  }
}

TEST(SoftmaxCrossEntropy, RejectsBadLabels) {
  SoftmaxCrossEntropy ce;
  Tensor d;
  EXPECT_THROW(ce.Forward(Tensor({2, 3}), {0, 3}, &d), std::invalid_argument);
  EXPECT_THROW(ce.Forward(Tensor({2, 3}), {0, -1}, &d), std::invalid_argument);
  EXPECT_THROW(ce.Forward(Tensor({2, 3}), {0}, &d), std::invalid_argument);
  EXPECT_THROW(ce.Forward(Tensor({6}), {0}, &d), std::invalid_argument);
}

}  // namespace
}  // namespace cpd::runtime
