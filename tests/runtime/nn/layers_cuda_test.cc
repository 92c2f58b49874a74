// The engine's CUDA path against its CPU path, layer by layer: each layer is built twice from
// the same seed, one copy moved to the GPU, and both run forward and backward on the same random
// inputs. Outputs, input gradients, parameter gradients and buffers must agree bit for bit where
// the CPU defines the result exactly (ReLU, pooling, dropout, residual adds, evaluation-mode
// BatchNorm, the optimiser) and to float32 reassociation elsewhere (GEMMs, convolutions, batch
// statistics, the loss). Also: tensors across devices, device-mismatch errors, the optimiser
// (SGD, Nesterov, LARS) and the quantisation sites on device tensors. Every test skips without
// a CUDA device.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cpd/quantize.h"
#include "kernels/grid.h"
#include "runtime/engine/cuda_ops.h"
#include "runtime/nn/layers.h"
#include "runtime/nn/models.h"
#include "runtime/nn/optimizer.h"
#include "runtime/nn/quant_sites.h"
#include "tests/cuda_test_util.h"
#include "tests/runtime/nn/cuda_twin.h"

namespace cpd::runtime::test {
namespace {

// ---- Tensors ----------------------------------------------------------------------------------

TEST(CudaTensor, CopiesAcrossDevicesAreExact) {
  CPD_REQUIRE_CUDA();
  Tensor h = Random({3, 5, 7}, 1);
  h.data()[0] = std::numeric_limits<float>::quiet_NaN();
  h.data()[1] = -0.0f;
  h.data()[2] = std::numeric_limits<float>::infinity();
  h.data()[3] = 1e-42f;  // subnormal
  const Tensor d = h.To(Device::kCuda);
  EXPECT_EQ(d.device(), Device::kCuda);
  EXPECT_EQ(d.shape(), h.shape());
  ExpectMatch("To(kCuda) and back", h, d, kExact);
  Tensor d2({3, 5, 7}, Device::kCuda);
  d2.CopyFrom(d);  // device to device
  ExpectMatch("device to device", h, d2, kExact);
  std::vector<float> v(h.numel());
  d2.CopyToHost(v.data());
  EXPECT_EQ(0, std::memcmp(v.data(), h.data(), v.size() * sizeof(float)));
  Tensor d3({105}, Device::kCuda);
  d3.CopyFromHost(h.data());
  ExpectMatch("CopyFromHost", h.Reshaped({105}), d3, kExact);
  // A slice of a device tensor is a view: writing through it changes the parent.
  Tensor s = d3.Slice(10, {5});
  EXPECT_EQ(s.device(), Device::kCuda);
  s.Fill(2.5f);
  const std::vector<float> back = Host(d3);
  for (size_t i = 0; i < back.size(); ++i) {
    if (i >= 10 && i < 15) {
      EXPECT_EQ(back[i], 2.5f) << i;
    } else if (!std::isnan(h.data()[i])) {
      EXPECT_EQ(Bits(back[i]), Bits(h.data()[i])) << i;
    }
  }
  d3.Zero();
  for (float f : Host(d3)) EXPECT_EQ(Bits(f), 0u);
  EXPECT_THROW(d3.Slice(100, {6}), std::invalid_argument);
}

TEST(CudaTensor, ResizeOnFollowsTheDevice) {
  CPD_REQUIRE_CUDA();
  Tensor t({4, 4});
  ResizeOn(&t, {2, 8}, Device::kCuda);
  EXPECT_EQ(t.device(), Device::kCuda);
  EXPECT_EQ(t.shape(), (std::vector<int64_t>{2, 8}));
  ResizeOn(&t, {16}, Device::kCpu);
  EXPECT_EQ(t.device(), Device::kCpu);
}

TEST(CudaLayers, MixingDevicesIsRefusedWithTheLayerName) {
  CPD_REQUIRE_CUDA();
  Conv2d conv("conv1", 3, 4, 3, 1, 1);
  MoveToDevice(&conv, Device::kCuda);
  try {
    conv.Forward(Random({2, 3, 8, 8}, 1), true);  // a CPU input to a GPU layer
    ADD_FAILURE() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("conv1 (Conv2d)"), std::string::npos) << what;
    EXPECT_NE(what.find("cpu"), std::string::npos) << what;
  }
  // A CPU gradient after a GPU forward.
  ReLU relu("relu");
  relu.Forward(Random({2, 3}, 2).To(Device::kCuda), true);
  EXPECT_THROW(relu.Backward(Random({2, 3}, 3)), std::invalid_argument);
}

// ---- Linear -----------------------------------------------------------------------------------

struct LinearCase {
  int64_t n, in, out;
  bool bias;
};

class CudaLinearTest : public ::testing::TestWithParam<LinearCase> {};

TEST_P(CudaLinearTest, MatchesCpu) {
  CPD_REQUIRE_CUDA();
  const LinearCase c = GetParam();
  TwinTols tol;
  // The bias gradient is a column sum in the CPU's order: exact. (Checked separately below;
  // here the param gradients share kReassoc.)
  CompareOnBothDevices(
      "Linear " + std::to_string(c.in) + "->" + std::to_string(c.out),
      [&] { return std::make_unique<Linear>("fc", c.in, c.out, c.bias, 11); },
      Random({c.n, c.in}, 3), tol);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaLinearTest,
                         ::testing::Values(LinearCase{64, 784, 256, true},
                                           LinearCase{128, 400, 120, true},
                                           LinearCase{7, 13, 5, false}, LinearCase{1, 84, 10, true},
                                           LinearCase{33, 1, 1, true}));

TEST(CudaLinear, BiasGradientIsExact) {
  CPD_REQUIRE_CUDA();
  const int64_t n = 37, out = 19;
  const Tensor dy = Random({n, out}, 5, -3.f, 3.f);
  Tensor db_cpu({out});
  std::fill(db_cpu.data(), db_cpu.data() + out, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t o = 0; o < out; ++o) db_cpu.data()[o] += dy.data()[i * out + o];
  }
  Linear fc("fc", 4, out, true, 1);
  MoveToDevice(&fc, Device::kCuda);
  fc.Forward(Random({n, 4}, 6).To(Device::kCuda), true);
  fc.Backward(dy.To(Device::kCuda));
  ExpectMatch("bias gradient", db_cpu, fc.bias()->grad, kExact);
}

TEST(CudaLinear, GradientsAccumulateAcrossBackwardCalls) {
  CPD_REQUIRE_CUDA();
  Linear fc("fc", 6, 3, true, 2);
  MoveToDevice(&fc, Device::kCuda);
  const Tensor x = Random({4, 6}, 1).To(Device::kCuda), dy = Random({4, 3}, 2).To(Device::kCuda);
  fc.Forward(x, true);
  fc.Backward(dy);
  const std::vector<float> once = Host(fc.weight().grad);
  fc.Forward(x, true);
  fc.Backward(dy);
  const std::vector<float> twice = Host(fc.weight().grad);
  for (size_t i = 0; i < once.size(); ++i) EXPECT_EQ(twice[i], once[i] + once[i]) << i;
}

// ---- Conv2d -----------------------------------------------------------------------------------

struct ConvCase {
  const char* name;
  int64_t n, c, h, w, oc, k, stride, pad;
  bool bias;
};

class CudaConvTest : public ::testing::TestWithParam<ConvCase> {};

TEST_P(CudaConvTest, MatchesCpu) {
  CPD_REQUIRE_CUDA();
  const ConvCase c = GetParam();
  // cuDNN may pick FFT or Winograd algorithms (deterministic ones), whose rounding differs a
  // little more from the CPU's direct sums than a GEMM's; weight gradients sum n * oh * ow
  // products.
  TwinTols tol;
  tol.forward = Tol{1e-4, 5e-5};
  tol.input_grad = Tol{1e-4, 5e-5};
  tol.param_grad = Tol{1e-4, 1e-4};
  CompareOnBothDevices(
      c.name,
      [&] { return std::make_unique<Conv2d>("conv", c.c, c.oc, c.k, c.stride, c.pad, c.bias, 21); },
      Random({c.n, c.c, c.h, c.w}, 4), tol);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaConvTest,
    ::testing::Values(ConvCase{"lenet_conv1", 16, 1, 28, 28, 6, 5, 1, 2, true},
                      ConvCase{"lenet_conv2", 16, 6, 14, 14, 16, 5, 1, 0, true},
                      ConvCase{"resnet_3x3", 8, 16, 32, 32, 16, 3, 1, 1, false},
                      ConvCase{"resnet_3x3_stride2", 8, 16, 32, 32, 32, 3, 2, 1, false},
                      ConvCase{"resnet_projection_1x1", 8, 16, 32, 32, 32, 1, 2, 0, false},
                      ConvCase{"pointwise", 4, 8, 9, 9, 12, 1, 1, 0, true},
                      ConvCase{"odd", 3, 3, 9, 11, 5, 3, 2, 0, true},
                      ConvCase{"kernel_larger_than_image", 2, 2, 3, 3, 4, 5, 1, 2, true}),
    [](const ::testing::TestParamInfo<ConvCase>& i) { return std::string(i.param.name); });

// ---- BatchNorm --------------------------------------------------------------------------------

TEST(CudaBatchNorm, TrainingMatchesCpu4D) {
  CPD_REQUIRE_CUDA();
  for (bool relu : {false, true}) {
    CompareOnBothDevices(
        relu ? "BatchNorm2d+ReLU" : "BatchNorm2d",
        [&] {
          auto bn = std::make_unique<BatchNorm>("bn", 6);
          bn->set_fused_relu(relu);
          return bn;
        },
        Random({8, 6, 5, 7}, 9, -2.f, 3.f), TwinTols{});
  }
}

TEST(CudaBatchNorm, TrainingMatchesCpuOnAResNetActivation) {
  CPD_REQUIRE_CUDA();
  CompareOnBothDevices(
      "BatchNorm 128x16x32x32", [] { return std::make_unique<BatchNorm>("bn", 16); },
      Random({128, 16, 32, 32}, 10, -1.f, 2.f), TwinTols{});
}

TEST(CudaBatchNorm, TrainingMatchesCpu2D) {
  CPD_REQUIRE_CUDA();
  CompareOnBothDevices(
      "BatchNorm1d", [] { return std::make_unique<BatchNorm>("bn", 10); }, Random({32, 10}, 11),
      TwinTols{});
}

TEST(CudaBatchNorm, LargeMeanKeepsItsVariance) {
  CPD_REQUIRE_CUDA();
  // |mean| >> std: the shifted sums must not cancel on either device.
  Tensor x = Random({16, 3, 6, 6}, 12, -1.f, 1.f);
  for (size_t i = 0; i < x.numel(); ++i) x.data()[i] += 1e4f;
  CompareOnBothDevices(
      "BatchNorm mean 1e4", [] { return std::make_unique<BatchNorm>("bn", 3); }, x,
      TwinTols{Tol{1e-3, 1e-4}, Tol{1e-3, 1e-4}, Tol{1e-3, 1e-4}, kReassoc});
}

TEST(CudaBatchNorm, EvaluationIsExactGivenTheSameStatistics) {
  CPD_REQUIRE_CUDA();
  BatchNorm cpu("bn", 5), gpu("bn", 5);
  cpu.set_fused_relu(true);
  gpu.set_fused_relu(true);
  const Tensor rm = Random({5}, 1, -0.5f, 0.5f), rv = Random({5}, 2, 0.1f, 2.f);
  const Tensor g = Random({5}, 3, 0.5f, 1.5f), b = Random({5}, 4);
  cpu.running_mean().CopyFrom(rm);
  cpu.running_var().CopyFrom(rv);
  cpu.gamma().value.CopyFrom(g);
  cpu.beta().value.CopyFrom(b);
  gpu.running_mean().CopyFrom(rm);
  gpu.running_var().CopyFrom(rv);
  gpu.gamma().value.CopyFrom(g);
  gpu.beta().value.CopyFrom(b);
  MoveToDevice(&gpu, Device::kCuda);
  const Tensor x = Random({4, 5, 3, 3}, 5, -2.f, 2.f);
  ExpectMatch("BatchNorm eval", cpu.Forward(x, false), gpu.Forward(x.To(Device::kCuda), false),
              kExact);
}

TEST(CudaBatchNorm, RunningStatisticsUpdateIsExactGivenTheSameBatchStatistics) {
  CPD_REQUIRE_CUDA();
  const int64_t c = 33;
  const float momentum = 0.1f;
  const double unbias = 512.0 / 511.0;
  const Tensor mean = Random({c}, 1), var = Random({c}, 2, 0.f, 3.f);
  Tensor rm = Random({c}, 3), rv = Random({c}, 4, 0.5f, 1.5f);
  Tensor rm_d = rm.To(Device::kCuda), rv_d = rv.To(Device::kCuda);
  cuda::BatchNormUpdateRunning(c, mean.To(Device::kCuda).data(), var.To(Device::kCuda).data(),
                               momentum, unbias, rm_d.data(), rv_d.data());
  // The CPU layer's loop (runtime/nn/layers.cc, BatchNorm::Forward).
  for (int64_t ch = 0; ch < c; ++ch) {
    rm.data()[ch] = (1.f - momentum) * rm.data()[ch] + momentum * mean.data()[ch];
    rv.data()[ch] =
        (1.f - momentum) * rv.data()[ch] + momentum * float(double(var.data()[ch]) * unbias);
  }
  ExpectMatch("running mean", rm, rm_d, kExact);
  ExpectMatch("running var", rv, rv_d, kExact);
}

// ---- Elementwise, pooling, dropout ------------------------------------------------------------

// Inputs with NaN, infinities, signed zeros and exact ties.
Tensor Awkward(std::vector<int64_t> shape, uint64_t seed) {
  Tensor t = Random(std::move(shape), seed, -2.f, 2.f);
  std::mt19937_64 gen(seed ^ 0x5a5a);
  for (size_t i = 0; i < t.numel(); ++i) {
    switch (gen() % 16) {
      case 0:
        t.data()[i] = std::numeric_limits<float>::quiet_NaN();
        break;
      case 1:
        t.data()[i] = -0.0f;
        break;
      case 2:
        t.data()[i] = 0.0f;
        break;
      case 3:
        t.data()[i] = 0.5f;  // ties inside pooling windows
        break;
      case 4:
        t.data()[i] = (gen() & 1) ? std::numeric_limits<float>::infinity()
                                  : -std::numeric_limits<float>::infinity();
        break;
      default:
        break;
    }
  }
  return t;
}

TEST(CudaElementwise, ReluIsExact) {
  CPD_REQUIRE_CUDA();
  TwinTols exact{kExact, kExact, kExact, kExact};
  CompareOnBothDevices(
      "ReLU", [] { return std::make_unique<ReLU>("relu"); }, Awkward({5, 7, 11}, 1), exact);
}

TEST(CudaElementwise, ResidualAddsAreExact) {
  CPD_REQUIRE_CUDA();
  const size_t n = 100003;
  const Tensor a = Awkward({int64_t(n)}, 2), b = Random({int64_t(n)}, 3, -2.f, 2.f);
  Tensor y_cpu({int64_t(n)}), r_cpu({int64_t(n)}), acc_cpu = a.Clone();
  cpu::Add(n, a.data(), b.data(), y_cpu.data());
  cpu::AddRelu(n, a.data(), b.data(), r_cpu.data());
  cpu::AddInPlace(n, b.data(), acc_cpu.data());
  const Tensor ad = a.To(Device::kCuda), bd = b.To(Device::kCuda);
  Tensor y_gpu({int64_t(n)}, Device::kCuda), r_gpu({int64_t(n)}, Device::kCuda);
  Tensor acc_gpu = a.To(Device::kCuda);
  cuda::Add(n, ad.data(), bd.data(), y_gpu.data());
  cuda::AddRelu(n, ad.data(), bd.data(), r_gpu.data());
  cuda::AddInPlace(n, bd.data(), acc_gpu.data());
  ExpectMatch("Add", y_cpu, y_gpu, kExact);
  ExpectMatch("AddRelu", r_cpu, r_gpu, kExact);
  ExpectMatch("AddInPlace", acc_cpu, acc_gpu, kExact);
}

struct PoolCase {
  const char* name;
  int64_t n, c, h, w, k, stride;
};

class CudaPoolTest : public ::testing::TestWithParam<PoolCase> {};

TEST_P(CudaPoolTest, MaxPoolIsExact) {
  CPD_REQUIRE_CUDA();
  const PoolCase p = GetParam();
  TwinTols exact{kExact, kExact, kExact, kExact};
  CompareOnBothDevices(
      std::string("MaxPool ") + p.name,
      [&] { return std::make_unique<MaxPool2d>("pool", p.k, p.stride); },
      Awkward({p.n, p.c, p.h, p.w}, 5), exact);
}

TEST_P(CudaPoolTest, AvgPoolIsExact) {
  CPD_REQUIRE_CUDA();
  const PoolCase p = GetParam();
  TwinTols exact{kExact, kExact, kExact, kExact};
  CompareOnBothDevices(
      std::string("AvgPool ") + p.name,
      [&] { return std::make_unique<AvgPool2d>("pool", p.k, p.stride); },
      Random({p.n, p.c, p.h, p.w}, 6, -2.f, 2.f), exact);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaPoolTest,
                         ::testing::Values(PoolCase{"2x2", 4, 6, 28, 28, 2, 2},
                                           PoolCase{"2x2_odd", 3, 2, 7, 9, 2, 2},
                                           PoolCase{"3x3_stride2_overlap", 2, 3, 11, 10, 3, 2},
                                           PoolCase{"3x3_stride1", 2, 2, 6, 7, 3, 1},
                                           PoolCase{"4x4_stride3", 1, 2, 13, 13, 4, 3}),
                         [](const ::testing::TestParamInfo<PoolCase>& i) {
                           return std::string(i.param.name);
                         });

TEST(CudaPooling, GlobalAvgPool) {
  CPD_REQUIRE_CUDA();
  // Forward: a mean in double on the GPU, a float sum on the CPU; backward: exact.
  CompareOnBothDevices(
      "GlobalAvgPool", [] { return std::make_unique<GlobalAvgPool>("gap"); },
      Random({16, 64, 8, 8}, 7), TwinTols{Tol{1e-5, 1e-6}, kExact, kExact, kExact});
}

TEST(CudaFlatten, IsAViewOnTheDevice) {
  CPD_REQUIRE_CUDA();
  CompareOnBothDevices(
      "Flatten", [] { return std::make_unique<Flatten>("flatten"); }, Random({4, 3, 5, 5}, 8),
      TwinTols{kExact, kExact, kExact, kExact});
}

TEST(CudaDropout, MasksAreTheCpusBitForBit) {
  CPD_REQUIRE_CUDA();
  for (double p : {0.0, 0.3, 0.5, 0.9}) {
    for (uint64_t step : {0u, 1u, 977u}) {
      CompareOnBothDevices(
          "Dropout p " + std::to_string(p) + " step " + std::to_string(step),
          [&] {
            auto d = std::make_unique<Dropout>("drop", p, 1234);
            d->SetStep(step);
            return d;
          },
          Random({3, 1000, 7}, 9), TwinTols{kExact, kExact, kExact, kExact});
    }
  }
}

// ---- Composites and the loss --------------------------------------------------------------------

TEST(CudaBasicBlock, IdentityAndProjectionShortcuts) {
  CPD_REQUIRE_CUDA();
  // conv -> BN -> conv -> BN: normalisation divides by small standard deviations, so allow
  // ten times the single-op tolerance.
  const TwinTols tol{Tol{1e-3, 1e-4}, Tol{1e-3, 1e-4}, Tol{1e-3, 1e-4}, Tol{1e-4, 1e-5}};
  CompareOnBothDevices(
      "BasicBlock identity", [] { return std::make_unique<BasicBlock>("layer1.0", 16, 16, 1, 3); },
      Random({8, 16, 16, 16}, 10), tol);
  CompareOnBothDevices(
      "BasicBlock projection",
      [] { return std::make_unique<BasicBlock>("layer2.0", 16, 32, 2, 3); },
      Random({8, 16, 16, 16}, 11), tol);
}

TEST(CudaModels, LeNet5ForwardAndBackward) {
  CPD_REQUIRE_CUDA();
  const TwinTols tol{Tol{1e-3, 1e-4}, Tol{1e-3, 1e-4}, Tol{1e-3, 1e-4}, kReassoc};
  CompareOnBothDevices(
      "lenet5", [] { return std::move(BuildModel("lenet5", 1, 28, 10, 5).value()); },
      Random({32, 1, 28, 28}, 12), tol);
}

TEST(CudaModels, ResNet8ForwardAndBackward) {
  CPD_REQUIRE_CUDA();
  const TwinTols tol{Tol{2e-3, 2e-4}, Tol{2e-3, 2e-4}, Tol{2e-3, 2e-4}, Tol{1e-4, 1e-5}};
  CompareOnBothDevices(
      "resnet8", [] { return std::move(BuildModel("resnet8", 3, 32, 10, 5).value()); },
      Random({16, 3, 32, 32}, 13), tol);
}

TEST(CudaLoss, SoftmaxCrossEntropyMatchesCpu) {
  CPD_REQUIRE_CUDA();
  for (float offset : {0.f, 1e4f}) {
    Tensor logits = Random({67, 10}, 14, -5.f, 5.f);
    for (size_t i = 0; i < logits.numel(); ++i) logits.data()[i] += offset;
    std::vector<int32_t> labels(67);
    for (size_t i = 0; i < labels.size(); ++i) labels[i] = int32_t((i * 7) % 10);
    SoftmaxCrossEntropy ce;
    Tensor d_cpu, d_gpu;
    const Tensor lg = logits.To(Device::kCuda);
    const float l_cpu = ce.Forward(logits, labels, &d_cpu);
    const float l_gpu = ce.Forward(lg, labels, &d_gpu);
    EXPECT_EQ(d_gpu.device(), Device::kCuda);
    EXPECT_NEAR(l_gpu, l_cpu, 1e-6 * std::fabs(l_cpu)) << "offset " << offset;
    ExpectMatch("dlogits, offset " + std::to_string(offset), d_cpu, d_gpu, Tol{1e-5, 1e-6});
    EXPECT_EQ(SoftmaxCrossEntropy::CountCorrect(lg, labels),
              SoftmaxCrossEntropy::CountCorrect(logits, labels));
    // Without the gradient.
    EXPECT_NEAR(ce.Forward(lg, labels, nullptr), l_cpu, 1e-6 * std::fabs(l_cpu));
  }
  SoftmaxCrossEntropy ce;
  Tensor d;
  EXPECT_THROW(ce.Forward(Random({2, 3}, 1).To(Device::kCuda), {0, 3}, &d), std::invalid_argument);
}

// ---- Optimiser ----------------------------------------------------------------------------------

// Params of several sizes (one spans several 16 Ki chunks, some have no weight decay).
std::vector<Param> MakeParams(Device device) {
  std::vector<Param> ps;
  const std::vector<std::pair<std::string, int64_t>> spec = {
      {"conv.weight", 40000}, {"conv.bias", 7}, {"fc.weight", 16384}, {"bn.gamma", 64}};
  uint64_t seed = 100;
  for (const auto& [name, n] : spec) {
    Param p;
    p.name = name;
    p.value = Random({n}, seed++).To(device);
    p.grad = Tensor({n}, device);
    p.weight_decay = name.find("weight") != std::string::npos;
    ps.push_back(std::move(p));
  }
  return ps;
}

// max_norm > 0: each step clips the gradients by their global norm first (norms ~14: it clips).
void CompareOptimizerSteps(const OptimizerOptions& oo, const std::string& tag,
                           double max_norm = 0) {
  std::vector<Param> pc = MakeParams(Device::kCpu), pg = MakeParams(Device::kCuda);
  std::vector<Param*> rc, rg;
  for (auto& p : pc) rc.push_back(&p);
  for (auto& p : pg) rg.push_back(&p);
  Optimizer oc(rc, oo), og(rg, oo);
  for (int step = 0; step < 5; ++step) {
    for (size_t i = 0; i < pc.size(); ++i) {
      const Tensor g = Random(pc[i].grad.shape(), 1000 + 10 * uint64_t(step) + i, -0.1f, 0.1f);
      pc[i].grad.CopyFrom(g);
      pg[i].grad.CopyFrom(g);
    }
    const double lr = 0.1 / (1 + step);
    if (max_norm > 0) {
      // The same per-chunk sums in the same order: the same double, and the same scaled bits.
      ASSERT_EQ(oc.ClipGradNorm(max_norm), og.ClipGradNorm(max_norm)) << tag << " step " << step;
      for (size_t i = 0; i < pc.size(); ++i) {
        ExpectMatch(tag + " clipped step " + std::to_string(step) + " " + pc[i].name, pc[i].grad,
                    pg[i].grad, kExact);
      }
    }
    oc.Step(lr);
    og.Step(lr);
    for (size_t i = 0; i < pc.size(); ++i) {
      ExpectMatch(tag + " step " + std::to_string(step) + " " + pc[i].name, pc[i].value,
                  pg[i].value, kExact);
    }
    ASSERT_EQ(oc.last_trust_ratios(), og.last_trust_ratios()) << tag << " step " << step;
  }
  const auto sc = oc.State(), sg = og.State();
  ASSERT_EQ(sc.size(), sg.size());
  for (size_t i = 0; i < sc.size(); ++i) {
    EXPECT_EQ(sc[i].first, sg[i].first);
    ExpectMatch(tag + " " + sc[i].first, *sc[i].second, *sg[i].second, kExact);
  }
  og.ZeroGrad();
  for (const auto& p : pg) {
    for (float f : Host(p.grad)) ASSERT_EQ(f, 0.f);
  }
}

TEST(CudaOptimizer, SgdMomentumNesterovAndDecayAreExact) {
  CPD_REQUIRE_CUDA();
  OptimizerOptions oo;
  oo.momentum = 0.9;
  oo.weight_decay = 5e-4;
  CompareOptimizerSteps(oo, "sgd");
  oo.nesterov = true;
  CompareOptimizerSteps(oo, "nesterov");
  oo.nesterov = false;
  oo.momentum = 0;
  CompareOptimizerSteps(oo, "plain sgd");
}

TEST(CudaOptimizer, LarsIsExactTrustRatiosIncluded) {
  CPD_REQUIRE_CUDA();
  OptimizerOptions oo;
  oo.kind = OptimizerKind::kLars;
  oo.momentum = 0.9;
  oo.weight_decay = 1e-4;
  oo.lars_eta = 0.02;
  CompareOptimizerSteps(oo, "lars");
  oo.nesterov = true;
  CompareOptimizerSteps(oo, "lars nesterov");
  // Biases (the params without "weight") at another ratio, and in the trust ratio.
  oo.nesterov = false;
  oo.lars_excluded_lr_ratio = 0.1;
  CompareOptimizerSteps(oo, "lars excluded ratio 0.1");
  oo.lars_exclude = LarsExclude::kNone;
  CompareOptimizerSteps(oo, "lars exclude none");
}

TEST(CudaOptimizer, AdamWAndGradientClippingAreExact) {
  CPD_REQUIRE_CUDA();
  OptimizerOptions oo;
  oo.kind = OptimizerKind::kAdamW;
  oo.weight_decay = 0.1;
  CompareOptimizerSteps(oo, "adamw");
  oo.beta2 = 0.95;
  oo.eps = 1e-6;
  CompareOptimizerSteps(oo, "adamw clipped", /*max_norm=*/1.0);
  OptimizerOptions sgd;
  sgd.momentum = 0.9;
  CompareOptimizerSteps(sgd, "sgd clipped", /*max_norm=*/1.0);
  // A max_norm above the norm leaves the gradients alone on the device too.
  CompareOptimizerSteps(sgd, "sgd not clipped", /*max_norm=*/1e30);
}

TEST(CudaOptimizer, LoadStateOnTheDevice) {
  CPD_REQUIRE_CUDA();
  std::vector<Param> pg = MakeParams(Device::kCuda);
  std::vector<Param*> rg;
  for (auto& p : pg) rg.push_back(&p);
  OptimizerOptions oo;
  Optimizer og(rg, oo);
  std::map<std::string, std::vector<float>> state;
  for (const auto& [key, t] : og.State()) state[key] = std::vector<float>(t->numel(), 0.25f);
  ASSERT_TRUE(og.LoadState(state).ok());
  for (const auto& [key, t] : og.State()) {
    EXPECT_EQ(t->device(), Device::kCuda);
    for (float f : Host(*t)) ASSERT_EQ(f, 0.25f) << key;
  }
}

// ---- Quantisation sites -------------------------------------------------------------------------

// Runs the four hooks on CPU and CUDA tensors of the same values for a few steps and compares
// the outputs bit for bit, the statistics' counts exactly, and hysteresis flips. The GPU's
// statistics and flips stay on the device until TakeRecords / Flips read them; step 1 collects
// no statistics, so the device's record slots must skip it.
void CompareSites(PrecisionConfig pc, const std::string& tag) {
  Linear fc1("fc1", 24, 16), fc2("fc2", 16, 8);
  const std::vector<Layer*> layers = {&fc1, &fc2};
  auto qc = SiteQuantizer::Create(pc, layers);
  auto qg = SiteQuantizer::Create(pc, layers);
  ASSERT_TRUE(qc.ok() && qg.ok());
  for (int64_t step = 0; step < 4; ++step) {
    for (auto* q : {qc->get(), qg->get()}) {
      q->SetStep(step);
      q->SetCollectStats(step != 1);
    }
    for (Layer* l : layers) {
      const std::string where = tag + " step " + std::to_string(step) + " " + l->name();
      auto& lin = *static_cast<Linear*>(l);
      // Weights that drift a little each step, so that hysteresis has something to hold.
      Tensor w = Random(lin.weight().value.shape(), 50 + uint64_t(step) * 0, -1.f, 1.f);
      for (size_t i = 0; i < w.numel(); ++i) w.data()[i] += 0.01f * float(step) * float(i % 3);
      const Tensor x = Random({32, lin.in_features()}, 60 + uint64_t(step), -3.f, 3.f);
      const Tensor dy = Random({32, lin.out_features()}, 70 + uint64_t(step), -1e-3f, 1e-3f);
      const Tensor wg = w.To(Device::kCuda), xg = x.To(Device::kCuda), dyg = dy.To(Device::kCuda);
      Tensor wc_used(w.shape()), wg_used(w.shape(), Device::kCuda);
      (*qc)->QuantizeWeight(*l, w, &wc_used);
      (*qg)->QuantizeWeight(*l, wg, &wg_used);
      ExpectMatch(where + " W", wc_used, wg_used, kExact);
      Tensor xc_used(x.shape()), xg_used(x.shape(), Device::kCuda);
      (*qc)->QuantizeActivation(*l, x, &xc_used);
      (*qg)->QuantizeActivation(*l, xg, &xg_used);
      ExpectMatch(where + " A", xc_used, xg_used, kExact);
      Tensor ec(dy.shape()), eg(dy.shape(), Device::kCuda);
      (*qc)->QuantizeError(*l, dy, &ec);
      (*qg)->QuantizeError(*l, dyg, &eg);
      ExpectMatch(where + " E", ec, eg, kExact);
      Tensor gc = Random(w.shape(), 80 + uint64_t(step), -1e-2f, 1e-2f);
      Tensor gd = gc.To(Device::kCuda);
      (*qc)->QuantizeWeightGrad(*l, &gc);
      (*qg)->QuantizeWeightGrad(*l, &gd);
      ExpectMatch(where + " G", gc, gd, kExact);
    }
    const auto rc = (*qc)->TakeRecords(), rg = (*qg)->TakeRecords();
    ASSERT_EQ(rc.size(), rg.size()) << tag;
    if (step == 1) {
      EXPECT_TRUE(rg.empty()) << tag;
    }
    EXPECT_EQ((*qc)->Flips(), (*qg)->Flips()) << tag << " step " << step;
    for (size_t i = 0; i < rc.size(); ++i) {
      const std::string where =
          tag + " step " + std::to_string(step) + " " + rc[i].layer + "." + SiteName(rc[i].site);
      EXPECT_EQ(rc[i].layer, rg[i].layer);
      EXPECT_EQ(rc[i].format, rg[i].format) << where;
      EXPECT_EQ(rc[i].stats.count, rg[i].stats.count) << where;
      EXPECT_EQ(rc[i].stats.max_abs, rg[i].stats.max_abs) << where;
      EXPECT_EQ(rc[i].stats.saturated, rg[i].stats.saturated) << where;
      EXPECT_EQ(rc[i].stats.flushed, rg[i].stats.flushed) << where;
      EXPECT_EQ(rc[i].stats.nonfinite, rg[i].stats.nonfinite) << where;
      EXPECT_NEAR(rc[i].stats.relative_error(), rg[i].stats.relative_error(),
                  1e-9 * (1 + rc[i].stats.relative_error()))
          << where;
    }
  }
  EXPECT_EQ((*qc)->TakeFlips(), (*qg)->TakeFlips()) << tag;
  for (const auto& [name, flips] : (*qg)->Flips()) EXPECT_EQ(flips, 0u) << tag << " " << name;
  // Hysteresis state comes back to the host for checkpoints, equal to the CPU's.
  const auto hc = (*qc)->HysteresisState(), hg = (*qg)->HysteresisState();
  ASSERT_EQ(hc.size(), hg.size()) << tag;
  for (const auto& [name, v] : hc) {
    ASSERT_TRUE(hg.count(name)) << name;
    EXPECT_EQ(*v, *hg.at(name)) << tag << " hysteresis state of " << name;
  }
}

TEST(CudaQuantSites, FloatFormatsWithStochasticErrors) {
  CPD_REQUIRE_CUDA();
  PrecisionConfig pc;
  pc.global[int(Site::kWeight)].spec = "e4m3";
  pc.global[int(Site::kActivation)].spec = "e5m2";
  pc.global[int(Site::kError)].spec = "e5m2";
  pc.global[int(Site::kError)].rounding = Rounding::kStochastic;
  pc.global[int(Site::kWeightGrad)].spec = "bf16";
  pc.seed = 99;
  CompareSites(pc, "e4m3/e5m2/bf16");
}

TEST(CudaQuantSites, CptPreset) {
  CPD_REQUIRE_CUDA();
  PrecisionConfig pc;
  CyclicPrecision c;
  c.min_bits = 3;
  c.max_bits = 8;
  c.periods = 2;
  c.total_iters = 4;
  pc.cpt = c;
  pc.grad_bits = 8;
  pc.keep_fp32 = {"last"};
  pc.seed = 5;
  CompareSites(pc, "cpt");
}

TEST(CudaQuantSites, Lee2022WithHysteresis) {
  CPD_REQUIRE_CUDA();
  PrecisionConfig pc;
  pc.global[int(Site::kWeight)].spec = "log4";
  pc.global[int(Site::kActivation)].spec = "fp134";
  pc.global[int(Site::kError)].spec = "fp134";
  pc.hysteresis = true;
  pc.seed = 6;
  CompareSites(pc, "lee2022");
}

TEST(CudaQuantSites, ScaledAndBlockFormats) {
  CPD_REQUIRE_CUDA();
  PrecisionConfig pc;
  pc.global[int(Site::kWeight)].spec = "int4:ch";
  pc.global[int(Site::kActivation)].spec = "mxfp8";
  pc.global[int(Site::kError)].spec = "fp134";
  pc.global[int(Site::kWeightGrad)].spec = "uint8:minmax";
  CompareSites(pc, "int4:ch/mxfp8/fp134/uint8:minmax");
}

TEST(CudaQuantSites, HookedLayersOnTheGpuMatchTheCpu) {
  CPD_REQUIRE_CUDA();
  // The hooks inside a layer's forward and backward: FP134 errors on a quantised conv.
  PrecisionConfig pc;
  pc.global[int(Site::kError)].spec = "fp134";
  pc.global[int(Site::kActivation)].spec = "e4m3";
  Conv2d a("conv", 3, 8, 3, 1, 1, true, 4), b("conv", 3, 8, 3, 1, 1, true, 4);
  auto qa = SiteQuantizer::Create(pc, {&a});
  auto qb = SiteQuantizer::Create(pc, {&b});
  ASSERT_TRUE(qa.ok() && qb.ok());
  a.SetQuantHooks(qa->get());
  b.SetQuantHooks(qb->get());
  MoveToDevice(&b, Device::kCuda);
  const Tensor x = Random({4, 3, 10, 10}, 1);
  ExpectMatch("hooked conv forward", a.Forward(x, true), b.Forward(x.To(Device::kCuda), true),
              kReassoc);
  const Tensor dy = Random({4, 8, 10, 10}, 2);
  ExpectMatch("hooked conv input gradient", a.Backward(dy), b.Backward(dy.To(Device::kCuda)),
              kReassoc);
  ExpectMatch("hooked conv weight gradient", a.weight().grad, b.weight().grad, Tol{1e-4, 5e-5});
}

// Hooks that pass every call on to a SiteQuantizer and keep a host copy of each A and E operand
// it returns, in call order.
class RecordingHooks : public QuantHooks {
 public:
  explicit RecordingHooks(QuantHooks* inner) : inner_(inner) {}
  void QuantizeWeight(const Layer& l, const Tensor& w, Tensor* w_used) override {
    inner_->QuantizeWeight(l, w, w_used);
  }
  void QuantizeActivation(const Layer& l, const Tensor& x, Tensor* x_used) override {
    inner_->QuantizeActivation(l, x, x_used);
    a.push_back(x_used->To(Device::kCpu));
  }
  void QuantizeError(const Layer& l, const Tensor& dy, Tensor* dy_used) override {
    inner_->QuantizeError(l, dy, dy_used);
    e.push_back(dy_used->To(Device::kCpu));
  }
  void QuantizeWeightGrad(const Layer& l, Tensor* dw) override {
    inner_->QuantizeWeightGrad(l, dw);
  }
  std::optional<HadamardOptions> WeightGradTransform(const Layer& l) const override {
    return inner_->WeightGradTransform(l);
  }
  std::vector<Tensor> a, e;

 private:
  QuantHooks* inner_;
};

// --wgrad-transform on the GPU: a Linear's transformed, quantised weight-gradient operands
// Q_A(T x) and Q_E(T dy) are the CPU's bit for bit (HadamardAlongRowsCuda, then the sites), so
// its dW is exactly the device product of the CPU's operands, and the CPU's dW to float32
// reassociation; dx and the bias gradient are the untransformed ones. Rows with a remainder past
// the last whole group, columns that fill no tile.
TEST(CudaQuantSites, LinearWeightGradTransformMatchesTheCpu) {
  CPD_REQUIRE_CUDA();
  const int64_t n = 53, in = 37, out = 13;
  for (const char* transform : {"rht16", "had32"}) {
    SCOPED_TRACE(transform);
    PrecisionConfig pc;
    pc.global[int(Site::kWeight)].spec = "bf16";
    pc.global[int(Site::kActivation)].spec = "e4m3:block=1x16:scale=e4m3";
    pc.global[int(Site::kError)].spec = "e5m2";
    pc.wgrad_transform = transform;
    pc.seed = 9;
    Linear a("fc", in, out, true, 4), b("fc", in, out, true, 4);
    auto qa = SiteQuantizer::Create(pc, {&a});
    auto qb = SiteQuantizer::Create(pc, {&b});
    ASSERT_TRUE(qa.ok() && qb.ok());
    (*qa)->SetStep(3);
    (*qb)->SetStep(3);
    RecordingHooks ra(qa->get()), rb(qb->get());
    a.SetQuantHooks(&ra);
    b.SetQuantHooks(&rb);
    MoveToDevice(&b, Device::kCuda);
    for (Param* p : a.Params()) p->grad.Fill(0.0f);
    for (Param* p : b.Params()) p->grad.Fill(0.0f);
    Tensor x = Random({n, in}, 1, -2.f, 2.f);
    x.data()[5] = 250.f;  // an outlier for the transform to spread
    const Tensor dy = Random({n, out}, 2);
    ExpectMatch("forward", a.Forward(x, true), b.Forward(x.To(Device::kCuda), true), kReassoc);
    ExpectMatch("input gradient", a.Backward(dy), b.Backward(dy.To(Device::kCuda)), kReassoc);
    ExpectMatch("bias gradient", a.bias()->grad, b.bias()->grad, kExact);
    // A: the forward's Q_A(x), then Q_A(T x); E: Q_E(dy), then Q_E(T dy).
    ASSERT_EQ(ra.a.size(), 2u);
    ASSERT_EQ(rb.a.size(), 2u);
    ASSERT_EQ(ra.e.size(), 2u);
    ASSERT_EQ(rb.e.size(), 2u);
    ExpectMatch("Q_A(x)", ra.a[0], rb.a[0], kExact);
    ExpectMatch("Q_E(dy)", ra.e[0], rb.e[0], kExact);
    ExpectMatch("Q_A(T x)", ra.a[1], rb.a[1], kExact);
    ExpectMatch("Q_E(T dy)", ra.e[1], rb.e[1], kExact);
    EXPECT_NE(Host(ra.a[1]), Host(ra.a[0])) << "no transform was applied";
    // The device product of the CPU's operands is the layer's dW exactly (added once to a zero
    // gradient: -0 entries become +0, so values are compared, not bits).
    const Tensor xt = ra.a[1].To(Device::kCuda), dyt = ra.e[1].To(Device::kCuda);
    Tensor dw({out, in}, Device::kCuda);
    cuda::LinearBackward(n, in, out, xt.data(), nullptr, dyt.data(), nullptr, dw.data(), nullptr);
    const std::vector<float> want = Host(dw), got = Host(b.weight().grad);
    ASSERT_EQ(want.size(), got.size());
    size_t bad = 0;
    for (size_t i = 0; i < want.size(); ++i) bad += !(want[i] == got[i]);
    EXPECT_EQ(bad, 0u) << "dW differs from the device product of the CPU's operands";
    ExpectMatch("weight gradient", a.weight().grad, b.weight().grad, Tol{1e-4, 5e-5});
  }
}

}  // namespace
}  // namespace cpd::runtime::test
