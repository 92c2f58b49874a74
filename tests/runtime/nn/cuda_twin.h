// A layer on both devices, for the CUDA layer tests (layers_cuda_test.cc,
// transformer_layers_cuda_test.cc): built twice from the same seed, one copy moved to the GPU,
// both run forward (train) and backward on the same data, and everything compared with
// ExpectMatch (tests/cuda_test_util.h): outputs, input gradients, parameter gradients, buffers,
// then an evaluation forward.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/nn/layers.h"
#include "tests/cuda_test_util.h"

namespace cpd::runtime::test {

struct TwinTols {
  Tol forward = kReassoc;
  Tol input_grad = kReassoc;
  Tol param_grad = kReassoc;
  Tol buffers = kReassoc;
};

// Builds the layer twice, moves one to the GPU, runs Forward(train) + Backward with the same
// data on both and compares everything; then an evaluation forward. `tag` names the case.
inline void CompareOnBothDevices(const std::string& tag,
                                 const std::function<std::unique_ptr<Layer>()>& make,
                                 const Tensor& x, const TwinTols& tol, uint64_t seed = 7) {
  std::unique_ptr<Layer> cpu = make(), gpu = make();
  MoveToDevice(gpu.get(), Device::kCuda);
  for (Param* p : gpu->Params()) {
    ASSERT_EQ(p->value.device(), Device::kCuda) << p->name;
    ASSERT_EQ(p->grad.device(), Device::kCuda) << p->name;
  }
  const Tensor xg = x.To(Device::kCuda);
  const Tensor ya = cpu->Forward(x, true);
  const Tensor yb = gpu->Forward(xg, true);
  ASSERT_EQ(yb.device(), Device::kCuda) << tag;
  ExpectMatch(tag + " forward", ya, yb, tol.forward);
  const Tensor dy = Random(ya.shape(), seed);
  const Tensor dxa = cpu->Backward(dy);
  const Tensor dxb = gpu->Backward(dy.To(Device::kCuda));
  ASSERT_EQ(dxb.device(), Device::kCuda) << tag;
  ExpectMatch(tag + " input gradient", dxa, dxb, tol.input_grad);
  const std::vector<Param*> pa = cpu->Params(), pb = gpu->Params();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    ExpectMatch(tag + " " + pa[i]->name + " gradient", pa[i]->grad, pb[i]->grad, tol.param_grad);
  }
  const auto ba = cpu->Buffers(), bb = gpu->Buffers();
  ASSERT_EQ(ba.size(), bb.size());
  for (size_t i = 0; i < ba.size(); ++i) {
    ExpectMatch(tag + " " + ba[i].first, *ba[i].second, *bb[i].second, tol.buffers);
  }
  const Tensor ea = cpu->Forward(x, false);
  const Tensor eb = gpu->Forward(xg, false);
  ExpectMatch(tag + " evaluation forward", ea, eb, tol.forward);
}

}  // namespace cpd::runtime::test
