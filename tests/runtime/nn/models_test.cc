// Tests of runtime/nn/models.h: architectures, parameter counts against closed forms, layer
// names, builder errors, determinism, MAC counts, DescribeModel, and end-to-end gradients and
// training of whole models.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "runtime/nn/models.h"

namespace cpd::runtime {
namespace {

Tensor Random(std::vector<int64_t> shape, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  Tensor t(std::move(shape));
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  for (size_t i = 0; i < t.numel(); ++i) t.data()[i] = u(gen);
  return t;
}

std::unique_ptr<Sequential> Build(const std::string& arch, int in, int size, int classes,
                                  uint64_t seed = 1) {
  auto m = BuildModel(arch, in, size, classes, seed);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return m.ok() ? std::move(m.value()) : nullptr;
}

// He et al.'s CIFAR ResNet with projection shortcuts (option B), closed form: one stage of n
// blocks from cin to cout channels (3x3 convs without bias, BatchNorm 2 params per channel).
int64_t StageParams(int64_t cin, int64_t cout, int64_t n) {
  const int64_t first =
      cin * cout * 9 + cout * cout * 9 + 4 * cout + (cin != cout ? cin * cout + 2 * cout : 0);
  return first + (n - 1) * (2 * cout * cout * 9 + 4 * cout);
}

int64_t ResNetParams(int64_t depth, int64_t in, int64_t classes) {
  const int64_t n = (depth - 2) / 6;
  return in * 16 * 9 + 2 * 16 + StageParams(16, 16, n) + StageParams(16, 32, n) +
         StageParams(32, 64, n) + 64 * classes + classes;
}

// Forward MACs of the same network on s x s images (s divisible by 4).
double ResNetMacs(int64_t depth, int64_t in, int64_t s, int64_t classes) {
  const int64_t n = (depth - 2) / 6;
  double macs = double(16 * s * s * in * 9);
  int64_t cin = 16, size = s;
  for (int64_t cout : {16, 32, 64}) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t stride = cout != 16 && i == 0 ? 2 : 1;
      const int64_t out = size / stride;
      macs += double(cout * out * out * cin * 9) + double(cout * out * out * cout * 9);
      if (cin != cout) macs += double(cout * out * out * cin);  // 1x1 projection
      cin = cout;
      size = out;
    }
  }
  return macs + double(64 * classes);
}

TEST(Models, LeNet5HasTheClassicParameterCount) {
  auto m = Build("lenet5", 1, 28, 10);
  EXPECT_EQ(CountParams(*m), 61706);
  // conv1 156 + conv2 2416 + fc1 48120 + fc2 10164 + fc3 850.
  EXPECT_EQ(CountParams(*m), (1 * 6 * 25 + 6) + (6 * 16 * 25 + 16) + (400 * 120 + 120) +
                                 (120 * 84 + 84) + (84 * 10 + 10));
  auto cifar = Build("lenet5", 3, 32, 10);
  EXPECT_EQ(CountParams(*cifar), 61706 + 2 * 6 * 25);  // 3 input channels, no padding
  const Tensor y = cifar->Forward(Random({2, 3, 32, 32}, 1), false);
  EXPECT_EQ(y.shape(), (std::vector<int64_t>{2, 10}));
}

TEST(Models, ResNetParameterCountsMatchTheClosedForm) {
  auto r20 = Build("resnet20", 3, 32, 10);
  EXPECT_EQ(CountParams(*r20), 272474);
  EXPECT_EQ(ResNetParams(20, 3, 10), 272474);
  for (int depth : {8, 14, 32, 56, 110}) {
    auto m = Build("resnet" + std::to_string(depth), 3, 32, 100);
    EXPECT_EQ(CountParams(*m), ResNetParams(depth, 3, 100)) << depth;
  }
}

TEST(Models, MlpShapeAndParameters) {
  auto m = Build("mlp", 1, 28, 10);
  EXPECT_EQ(CountParams(*m), (784 * 256 + 256) + (256 * 256 + 256) + (256 * 10 + 10));
  const Tensor y = m->Forward(Random({3, 1, 28, 28}, 1), true);
  EXPECT_EQ(y.shape(), (std::vector<int64_t>{3, 10}));
}

TEST(Models, LayerNamesAreStableAndReadable) {
  auto m = Build("resnet20", 3, 32, 10);
  std::vector<std::string> quant;
  std::set<std::string> all;
  for (Layer* l : m->Flatten()) {
    EXPECT_TRUE(all.insert(l->name()).second) << "duplicate layer name " << l->name();
    if (l->Quantizable()) quant.push_back(l->name());
  }
  for (const char* n :
       {"resnet20", "conv1", "bn1", "relu", "layer1.0", "layer1.0.conv1", "layer1.0.bn1",
        "layer1.2.conv2", "layer2.0.shortcut.conv", "layer2.0.shortcut.bn",
        "layer3.0.shortcut.conv", "layer3.2.bn2", "avgpool", "fc"}) {
    EXPECT_TRUE(all.count(n)) << n;
  }
  EXPECT_FALSE(all.count("layer1.0.shortcut.conv")) << "identity shortcut in stage 1";
  ASSERT_EQ(quant.size(), 22u);  // conv1, 18 block convs, 2 projections, fc
  EXPECT_EQ(quant.front(), "conv1");
  EXPECT_EQ(quant.back(), "fc");
  std::set<std::string> params;
  for (Param* p : m->Params()) EXPECT_TRUE(params.insert(p->name).second) << p->name;
  EXPECT_TRUE(params.count("layer2.0.shortcut.conv.weight"));
  EXPECT_TRUE(params.count("fc.bias"));
  EXPECT_FALSE(params.count("conv1.bias")) << "ResNet convolutions have no bias";
  std::set<std::string> buffers;
  for (auto& [name, t] : m->Buffers()) buffers.insert(name);
  EXPECT_TRUE(buffers.count("layer3.0.shortcut.bn.running_var"));
  EXPECT_EQ(buffers.size(), size_t(2 * (1 + 18 + 2)));

  auto lenet = Build("lenet5", 1, 28, 10);
  std::vector<std::string> names;
  for (Layer* l : lenet->Flatten()) {
    if (l->Quantizable()) names.push_back(l->name());
  }
  EXPECT_EQ(names, (std::vector<std::string>{"conv1", "conv2", "fc1", "fc2", "fc3"}));
}

TEST(Models, BuilderErrorsNameTheValueAndTheAlternatives) {
  for (const char* bad : {"resnet21", "resnet2", "resnet", "resnetX", "resnet-4"}) {
    auto m = BuildModel(bad, 3, 32, 10, 1);
    ASSERT_FALSE(m.ok()) << bad;
    EXPECT_EQ(m.status().code(), Status::Code::kInvalidArgument);
    EXPECT_NE(m.status().message().find(bad), std::string::npos) << m.status().message();
    EXPECT_NE(m.status().message().find("6n + 2"), std::string::npos) << m.status().message();
  }
  auto unknown = BuildModel("vgg16", 3, 32, 10, 1);
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("vgg16"), std::string::npos);
  EXPECT_NE(unknown.status().message().find("lenet5"), std::string::npos);
  EXPECT_NE(unknown.status().message().find("resnet20"), std::string::npos);
  EXPECT_FALSE(BuildModel("lenet5", 1, 8, 10, 1).ok());
  EXPECT_FALSE(BuildModel("mlp", 1, 28, 0, 1).ok());
  EXPECT_FALSE(BuildModel("mlp", 0, 28, 10, 1).ok());
}

TEST(Models, InitialisationIsDeterministicPerSeedAndName) {
  auto a = Build("resnet8", 3, 16, 10, 5), b = Build("resnet8", 3, 16, 10, 5);
  auto c = Build("resnet8", 3, 16, 10, 6);
  const auto pa = a->Params(), pb = b->Params(), pc = c->Params();
  ASSERT_EQ(pa.size(), pb.size());
  bool any_diff = false;
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(0, std::memcmp(pa[i]->value.data(), pb[i]->value.data(),
                             pa[i]->value.numel() * sizeof(float)))
        << pa[i]->name;
    any_diff |= std::memcmp(pa[i]->value.data(), pc[i]->value.data(),
                            pa[i]->value.numel() * sizeof(float)) != 0;
  }
  EXPECT_TRUE(any_diff);
  // A layer's weights depend on its name, not its position: fc of resnet8 and resnet14 agree.
  auto d = Build("resnet14", 3, 16, 10, 5);
  const Param* fa = a->Params().end()[-2];
  const Param* fd = d->Params().end()[-2];
  ASSERT_EQ(fa->name, "fc.weight");
  EXPECT_EQ(0, std::memcmp(fa->value.data(), fd->value.data(), fa->value.numel() * 4));
}

TEST(Models, LayerMacsMatchClosedForms) {
  auto lenet = Build("lenet5", 1, 28, 10);
  const auto macs = LayerMacs(*lenet, {1, 1, 28, 28});
  ASSERT_EQ(macs.size(), 5u);
  EXPECT_EQ(macs[0].first, "conv1");
  EXPECT_DOUBLE_EQ(macs[0].second, 6.0 * 28 * 28 * 25);
  EXPECT_DOUBLE_EQ(macs[1].second, 16.0 * 10 * 10 * 150);
  EXPECT_DOUBLE_EQ(macs[2].second, 400.0 * 120);
  EXPECT_DOUBLE_EQ(macs[4].second, 84.0 * 10);
  EXPECT_DOUBLE_EQ(LayerMacs(*lenet, {8, 1, 28, 28})[1].second, 8 * 16.0 * 10 * 10 * 150);

  auto r20 = Build("resnet20", 3, 32, 10);
  double total = 0;
  for (const auto& [name, m] : LayerMacs(*r20, {1, 3, 32, 32})) total += m;
  EXPECT_DOUBLE_EQ(total, ResNetMacs(20, 3, 32, 10));
  EXPECT_DOUBLE_EQ(total, 40813184.0);
  EXPECT_THROW(LayerMacs(*r20, {1, 1, 32, 32}), std::invalid_argument);
}

TEST(Models, DescribeModelListsLayersShapesAndTotal) {
  auto m = Build("resnet20", 3, 32, 10);
  const std::string d = DescribeModel(*m);
  EXPECT_NE(d.find("total parameters: 272,474"), std::string::npos) << d;
  EXPECT_NE(d.find("layer2.0.shortcut.conv"), std::string::npos);
  EXPECT_NE(d.find("[1, 32, 16, 16]"), std::string::npos) << "output shapes";
  EXPECT_NE(d.find("Conv2d(16 -> 32, kernel 3, stride 2, padding 1, no bias)"), std::string::npos);
  size_t lines = 0;
  for (char c : d) lines += c == '\n';
  EXPECT_EQ(lines, m->Flatten().size() + 2);  // header, one per layer, total
  auto lenet = Build("lenet5", 1, 28, 10);
  EXPECT_NE(DescribeModel(*lenet).find("total parameters: 61,706"), std::string::npos);
}

TEST(Models, EndToEndGradientsThroughTheLoss) {
  // For every parameter tensor p: d/dt L(p + t u) at t = 0, with u = grad_p / |grad_p|, must be
  // |grad_p| (the analytic gradient's own direction avoids the cancellation of a random one).
  // This checks each layer's backward in place, through BatchNorm, ReLU, pooling and the loss.
  for (const char* arch : {"resnet8", "lenet5"}) {
    SCOPED_TRACE(arch);
    const bool lenet = std::string(arch) == "lenet5";
    const int ch = lenet ? 1 : 3, size = lenet ? 28 : 16;
    auto m = Build(arch, ch, size, 5, 3);
    const Tensor x = Random({8, ch, size, size}, 2);
    const std::vector<int32_t> y = {0, 3, 1, 4, 2, 2, 0, 1};
    SoftmaxCrossEntropy ce;
    Tensor d;
    for (Param* p : m->Params()) p->grad.Zero();
    ce.Forward(m->Forward(x, true), y, &d);
    m->Backward(d);
    for (Param* p : m->Params()) {
      double norm = 0;
      for (size_t i = 0; i < p->grad.numel(); ++i)
        norm += double(p->grad.data()[i]) * p->grad.data()[i];
      norm = std::sqrt(norm);
      if (norm == 0) continue;
      const Tensor v0 = p->value.Clone();
      auto loss_at = [&](double t) {
        for (size_t i = 0; i < v0.numel(); ++i) {
          p->value.data()[i] = float(v0.data()[i] + t * p->grad.data()[i] / norm);
        }
        const double l = ce.Forward(m->Forward(x, true), y, nullptr);
        p->value.CopyFrom(v0);
        return l;
      };
      // ReLU and max pooling make L piecewise smooth; of two step sizes the closer quotient
      // counts (an analytic error would show at both).
      double numeric = 0;
      for (double t : {1e-3, 2.5e-4}) {
        const double q = (loss_at(t) - loss_at(-t)) / (2 * t);
        if (t == 1e-3 || std::abs(q - norm) < std::abs(numeric - norm)) numeric = q;
      }
      EXPECT_NEAR(numeric, norm, 0.02 * norm + 1e-3) << p->name;
    }
  }
}

TEST(Models, SgdReducesTheLossOfASeparableProblem) {
  // Two classes told apart by the mean brightness of the left half of an 8x8 image.
  auto m = Build("resnet8", 1, 8, 2, 4);
  std::mt19937_64 gen(1);
  std::uniform_real_distribution<float> u(-1, 1);
  Tensor x({32, 1, 8, 8});
  std::vector<int32_t> y(32);
  for (int i = 0; i < 32; ++i) {
    y[size_t(i)] = i % 2;
    for (int p = 0; p < 64; ++p) {
      x.data()[i * 64 + p] = u(gen) + ((p % 8) < 4 ? (i % 2 ? 1.f : -1.f) : 0.f);
    }
  }
  SoftmaxCrossEntropy ce;
  Tensor d;
  float first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    for (Param* p : m->Params()) p->grad.Zero();
    const float loss = ce.Forward(m->Forward(x, true), y, &d);
    if (step == 0) first = loss;
    last = loss;
    m->Backward(d);
    for (Param* p : m->Params()) {
      for (size_t i = 0; i < p->value.numel(); ++i) p->value.data()[i] -= 0.1f * p->grad.data()[i];
    }
  }
  EXPECT_LT(last, 0.3f * first) << "first " << first << " last " << last;
  const Tensor logits = m->Forward(x, false);
  EXPECT_GE(SoftmaxCrossEntropy::CountCorrect(logits, y), 30);
}

}  // namespace
}  // namespace cpd::runtime
