// GradientBuffers (runtime/train/gradient_buffers.h): every Param::grad a view of one flat
// buffer (on the CPU as on a GPU), the all-reducer's inputs in host or device memory, the copy
// after each worker, the NaN of --debug-nan-step, and the average's float products; on a GPU,
// every placement gives the CPU's bits (skipped without one).
#include "runtime/train/gradient_buffers.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/nn/layers.h"
#include "tests/cuda_test_util.h"

namespace cpd::runtime {
namespace {

using test::Bits;
using test::Host;

// Params of the given shapes with their values and (zero) gradients on `device`.
struct Params {
  explicit Params(const std::vector<std::vector<int64_t>>& shapes, Device device = Device::kCpu) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      auto p = std::make_unique<Param>();
      p->name = "p" + std::to_string(i);
      p->value = Tensor(shapes[i], device);
      p->grad = Tensor(shapes[i], device);
      owned.push_back(std::move(p));
      ptrs.push_back(owned.back().get());
    }
  }
  std::vector<std::unique_ptr<Param>> owned;
  std::vector<Param*> ptrs;
};

const std::vector<std::vector<int64_t>> kShapes = {{2, 3}, {3}, {0}, {4}};  // 13 floats

// What a worker's backward leaves: distinct, inexact values per worker (x / 7 is rarely a float).
std::vector<float> WorkerGradients(int k, size_t n) {
  std::vector<float> g(n);
  for (size_t i = 0; i < n; ++i) g[i] = (float(i) + 1.0f + 100.0f * float(k)) / 7.0f;
  return g;
}

void WriteThroughGrads(const std::vector<Param*>& params, const std::vector<float>& values) {
  const float* v = values.data();
  for (Param* p : params) {
    p->grad.CopyFromHost(v);
    v += p->grad.numel();
  }
}

std::vector<float> ReadThroughGrads(const std::vector<Param*>& params) {
  std::vector<float> out;
  for (const Param* p : params) {
    const std::vector<float> g = Host(p->grad);
    out.insert(out.end(), g.begin(), g.end());
  }
  return out;
}

// Bit for bit, any NaN matching any NaN (a GPU's arithmetic returns its canonical NaN).
void ExpectSameBits(const std::vector<float>& want, const std::vector<float>& got,
                    const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(want[i])) {
      EXPECT_TRUE(std::isnan(got[i])) << what << " [" << i << "]: " << got[i];
    } else {
      EXPECT_EQ(Bits(want[i]), Bits(got[i]))
          << what << " [" << i << "]: " << want[i] << " vs " << got[i];
    }
  }
}

TEST(GradientBuffers, EveryGradIsAViewOfTheFlatBufferInParamOrder) {
  Params params(kShapes);
  GradientBuffers buffers(params.ptrs, Device::kCpu);
  ASSERT_EQ(buffers.flat().numel(), 13u);
  size_t offset = 0;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    const Param* p = params.ptrs[i];
    EXPECT_EQ(p->grad.shape(), kShapes[i]) << p->name;
    if (p->grad.numel() > 0) {
      EXPECT_EQ(p->grad.data(), buffers.flat().data() + offset) << p->name;
    }
    offset += p->grad.numel();
  }
  const std::vector<float> g = WorkerGradients(0, 13);
  WriteThroughGrads(params.ptrs, g);
  ExpectSameBits(g, Host(buffers.flat()), "flat after writing every Param::grad");
}

// The float products of the average, and a check that the inputs tell them from a division by
// W x S (so the comparisons below could fail).
std::vector<float> Averaged(const std::vector<float>& sum, int workers, float loss_scale) {
  const float factor = 1.0f / float(workers) / loss_scale;
  std::vector<float> out(sum.size());
  bool differs_from_division = false;
  for (size_t i = 0; i < sum.size(); ++i) {
    out[i] = sum[i] * factor;
    differs_from_division |= out[i] != sum[i] / (float(workers) * loss_scale);
  }
  EXPECT_TRUE(differs_from_division);
  return out;
}

TEST(GradientBuffers, OneWorkerOnTheCpuReducesTheFlatBufferItself) {
  Params params(kShapes);
  GradientBuffers buffers(params.ptrs, Device::kCpu);
  buffers.PlaceReducerInputs(comm::MemorySpace::kHost, 1);
  EXPECT_EQ(buffers.reducer_memory(), comm::MemorySpace::kHost);
  EXPECT_EQ(buffers.inputs()[0], buffers.flat().data());
  EXPECT_EQ(buffers.sum(), buffers.flat().data());
  const std::vector<float> g = WorkerGradients(0, 13);
  WriteThroughGrads(params.ptrs, g);
  buffers.KeepWorkerGradients(0);
  ExpectSameBits(g, std::vector<float>(buffers.inputs()[0], buffers.inputs()[0] + 13), "input 0");
  // The all-reducer's sum lands in input 0, which every Param::grad views.
  const std::vector<float> sum = WorkerGradients(5, 13);
  std::memcpy(buffers.sum(), sum.data(), sum.size() * sizeof(float));
  buffers.LoadAverage(3, 8.0f);
  ExpectSameBits(Averaged(sum, 3, 8.0f), ReadThroughGrads(params.ptrs), "average");
}

TEST(GradientBuffers, SeveralWorkersKeepACopyEachAndTheNaNGoesIntoOne) {
  Params params(kShapes);
  GradientBuffers buffers(params.ptrs, Device::kCpu);
  buffers.PlaceReducerInputs(comm::MemorySpace::kHost, 3);
  for (int k = 0; k < 3; ++k) {
    EXPECT_NE(buffers.inputs()[k], buffers.flat().data()) << k;
    WriteThroughGrads(params.ptrs, WorkerGradients(k, 13));  // worker k's backward
    buffers.KeepWorkerGradients(k);
  }
  buffers.PutNaNIntoInput(1);
  for (int k = 0; k < 3; ++k) {
    std::vector<float> want = WorkerGradients(k, 13);
    if (k == 1) want[0] = std::numeric_limits<float>::quiet_NaN();
    ExpectSameBits(want, std::vector<float>(buffers.inputs()[k], buffers.inputs()[k] + 13),
                   "input " + std::to_string(k));
  }
  ExpectSameBits(WorkerGradients(2, 13), Host(buffers.flat()), "flat (the last worker's)");
  EXPECT_EQ(buffers.sum(), buffers.inputs()[0]);
  const std::vector<float> sum = WorkerGradients(7, 13);
  std::memcpy(buffers.sum(), sum.data(), sum.size() * sizeof(float));
  buffers.LoadAverage(6, 1.0f);
  ExpectSameBits(Averaged(sum, 6, 1.0f), ReadThroughGrads(params.ptrs), "average");
}

TEST(GradientBuffers, BackwardWritesStraightIntoTheFlatBuffer) {
  // Two identical layers, one with its own gradient tensors: the same forward and backward
  // leave the same bits, the one in the flat buffer (backward keeps Param::grad's storage).
  Linear plain("fc", 5, 3, /*bias=*/true, /*seed=*/11), viewed("fc", 5, 3, true, 11);
  GradientBuffers buffers(viewed.Params(), Device::kCpu);
  const Tensor x = test::Random({4, 5}, 1), dy = test::Random({4, 3}, 2);
  for (Linear* l : {&plain, &viewed}) {
    l->Forward(x, /*train=*/true);
    l->Backward(dy);
  }
  const std::vector<float> want = ReadThroughGrads(plain.Params());
  ASSERT_EQ(want.size(), 18u);
  for (float v : want) ASSERT_TRUE(std::isfinite(v));
  ExpectSameBits(want, Host(buffers.flat()), "flat after backward");
}

TEST(GradientBuffers, NoGradientsAtAllIsFine) {
  Params params(std::vector<std::vector<int64_t>>{{0}});
  GradientBuffers buffers(params.ptrs, Device::kCpu);
  buffers.PlaceReducerInputs(comm::MemorySpace::kHost, 2);
  buffers.KeepWorkerGradients(0);
  buffers.PutNaNIntoInput(0);
  buffers.LoadAverage(2, 1.0f);
  EXPECT_EQ(buffers.flat().numel(), 0u);
}

TEST(GradientBuffers, DeviceMemoryInputsNeedAGpu) {
  Params params(kShapes);
  GradientBuffers buffers(params.ptrs, Device::kCpu);
  EXPECT_THROW(buffers.PlaceReducerInputs(comm::MemorySpace::kDevice, 1), std::invalid_argument);
}

// One step's data path without the all-reduce (the sum is input 0, worker 0's gradients): on a
// GPU, with the inputs in host or device memory, K = 1 or 2, the CPU's bits, NaN included.
std::vector<float> AverageOfWorkerZero(Device device, comm::MemorySpace memory, int workers) {
  Params params(kShapes, device);
  GradientBuffers buffers(params.ptrs, device);
  buffers.PlaceReducerInputs(memory, workers);
  for (int k = 0; k < workers; ++k) {
    WriteThroughGrads(params.ptrs, WorkerGradients(k, 13));
    buffers.KeepWorkerGradients(k);
  }
  buffers.PutNaNIntoInput(0);
  buffers.LoadAverage(3, 1024.0f);
  return ReadThroughGrads(params.ptrs);
}

TEST(GradientBuffersCuda, EveryPlacementAveragesToTheCpuBits) {
  CPD_REQUIRE_CUDA();
  for (int k : {1, 2}) {
    const std::vector<float> cpu = AverageOfWorkerZero(Device::kCpu, comm::MemorySpace::kHost, k);
    EXPECT_TRUE(std::isnan(cpu[0]));
    std::vector<float> want = WorkerGradients(0, 13);
    want[0] = std::numeric_limits<float>::quiet_NaN();
    for (float& v : want) v = v * (1.0f / 3.0f / 1024.0f);
    ExpectSameBits(want, cpu, "cpu K=" + std::to_string(k));
    for (comm::MemorySpace memory : {comm::MemorySpace::kHost, comm::MemorySpace::kDevice}) {
      const std::string tag = std::string(memory == comm::MemorySpace::kHost ? "host" : "device") +
                              " inputs, K=" + std::to_string(k);
      ExpectSameBits(cpu, AverageOfWorkerZero(Device::kCuda, memory, k), tag);
    }
  }
}

}  // namespace
}  // namespace cpd::runtime
