// bench_train_step: one training step of a cpd-train model (forward + cross-entropy + backward
// + SGD), on one fixed random batch, median over --steps after --warmup, for several precision
// configurations. The side-by-side script bench_train_vs_torch.sh runs PyTorch's step in the
// same run and prints the ratios.
//
//   bench_train_step --arch lenet5 --batch 128 --threads 2 [--steps 30] [--configs fp32,cpt8,...]
//                    [--device cpu|cuda] [--block-size 128]
//
// Language models (--arch gpt | lstm): cpd-train's default shape (4 layers, 4 heads, width
// 128, byte-level vocabulary 256) on --batch windows of --block-size random tokens, per-token
// cross-entropy, AdamW (lr 1e-3, weight decay 0.1) instead of SGD.
//
// One line per configuration: `cpd <arch> <config> <batch> <threads> <ms/step>` (`cpd-cuda` with
// --device cuda, where a step is timed until the GPU has finished it). Without a usable GPU,
// --device cuda prints one line starting with "SKIP:" and exits 0.
//
// Configurations: fp32; cpt8 (CPT at 8/8 bits: uint8:minmax W per channel and A, E uint8
// stochastic); fp134e (FP134 errors); fp134ae (FP134 activations and errors); lee2022 (log4 W
// with hysteresis, FP134 A and E); deepseek (cpd-train --preset deepseek-fp8, meant for --arch
// gpt) and deepseek-acc (the same with --accumulate e8m13:every=128: the emulation's cost).
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <sstream>

#include "cpd/config.h"
#include "runtime/nn/layers.h"
#include "runtime/nn/models.h"
#include "runtime/nn/optimizer.h"
#include "runtime/nn/quant_sites.h"
#if CPD_WITH_CUDA
#include "benchmarks/bench_util.h"
#include "runtime/engine/cuda_ops.h"
#endif

extern "C" void openblas_set_num_threads(int num_threads);

namespace {

using namespace cpd::runtime;

cpd::Result<PrecisionConfig> ConfigFor(const std::string& name) {
  PrecisionConfig pc;
  if (name == "fp32") return pc;
  if (name == "cpt8") {
    cpd::CyclicPrecision c;
    c.min_bits = 8;
    c.max_bits = 8;
    c.periods = 1;
    c.total_iters = 1000;
    pc.cpt = c;
    pc.grad_bits = 8;
    pc.keep_fp32 = {"last"};
    return pc;
  }
  if (name == "fp134e") {
    pc.global[int(Site::kError)].spec = "fp134";
    return pc;
  }
  if (name == "fp134ae") {
    pc.global[int(Site::kActivation)].spec = "fp134";
    pc.global[int(Site::kError)].spec = "fp134";
    return pc;
  }
  if (name == "lee2022") {
    pc.global[int(Site::kWeight)].spec = "log4";
    pc.global[int(Site::kActivation)].spec = "fp134";
    pc.global[int(Site::kError)].spec = "fp134";
    pc.hysteresis = true;
    pc.keep_fp32 = {"first", "last"};
    return pc;
  }
  if (name == "deepseek" || name == "deepseek-acc") {  // cpd-train --preset deepseek-fp8
    pc.global[int(Site::kWeight)].spec = "e4m3:block=128x128";
    pc.global[int(Site::kActivation)].spec = "e4m3:block=1x128";
    pc.global[int(Site::kError)].spec = "e4m3:block=1x128";
    pc.keep_fp32 = {"embeddings", "attention", "last"};
    if (name == "deepseek-acc") pc.accumulate = "e8m13:every=128";
    return pc;
  }
  return cpd::Status::InvalidArgument(
      "unknown config '" + name +
      "' (accepted: fp32, cpt8, fp134e, fp134ae, lee2022, deepseek, deepseek-acc)");
}

bool IsLanguageModel(const std::string& arch) { return arch == "gpt" || arch == "lstm"; }

// One fixed random batch: images [batch, ch, size, size] with labels in [0, 10), or token
// windows [batch, block] with next-token labels in [0, 256) per position.
struct Batch {
  Tensor x;
  std::vector<int32_t> y;
};

Batch RandomBatch(const std::string& arch, int batch, int block, Device device) {
  std::mt19937 rng(0);
  Batch b;
  if (IsLanguageModel(arch)) {
    b.x = Tensor({batch, block});
    for (size_t i = 0; i < b.x.numel(); ++i) b.x.data()[i] = float(rng() % 256);
    b.y.resize(b.x.numel());
    for (auto& v : b.y) v = int32_t(rng() % 256);
  } else {
    const bool cifar = arch.rfind("resnet", 0) == 0;
    const int ch = cifar ? 3 : 1, size = cifar ? 32 : 28;
    b.x = Tensor({batch, ch, size, size});
    std::normal_distribution<float> nd;
    for (size_t i = 0; i < b.x.numel(); ++i) b.x.data()[i] = nd(rng);
    b.y.resize(size_t(batch));
    for (auto& v : b.y) v = int32_t(rng() % 10);
  }
  if (device != Device::kCpu) b.x = b.x.To(device);
  return b;
}

cpd::Result<std::unique_ptr<Sequential>> Model(const std::string& arch, int block) {
  if (!IsLanguageModel(arch)) {
    const bool cifar = arch.rfind("resnet", 0) == 0;
    return BuildModel(arch, cifar ? 3 : 1, cifar ? 32 : 28, 10, 1);
  }
  LanguageModelShape shape;  // cpd-train's defaults
  shape.vocab = 256;
  shape.block_size = block;
  shape.n_layer = 4;
  shape.n_head = 4;
  shape.n_embd = 128;
  return BuildLanguageModel(arch, shape, 1);
}

// SGD with momentum for the image models, AdamW (nanoGPT's decay) for the language models.
OptimizerOptions OptimizerFor(const std::string& arch, int threads) {
  OptimizerOptions oo;
  oo.threads = threads;
  if (IsLanguageModel(arch)) {
    oo.kind = OptimizerKind::kAdamW;
    oo.weight_decay = 0.1;
  } else {
    oo.momentum = 0.9;
    oo.weight_decay = 5e-4;
  }
  return oo;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_train_step: ms per training step of a cpd-train model"};
  std::string arch = "lenet5", configs = "fp32,cpt8,fp134e,lee2022", device_name = "cpu";
  int batch = 128, threads = 2, steps = 30, warmup = 5, block = 128;
  app.add_option("--arch", arch)->capture_default_str();
  app.add_option("--batch", batch)->capture_default_str();
  app.add_option("--threads", threads)->capture_default_str();
  app.add_option("--steps", steps)->capture_default_str();
  app.add_option("--warmup", warmup)->capture_default_str();
  app.add_option("--configs", configs)->capture_default_str();
  app.add_option("--device", device_name, "cpu | cuda")->capture_default_str();
  app.add_option("--block-size", block, "tokens per window (gpt, lstm)")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  CLI11_PARSE(app, argc, argv);
  Device device = Device::kCpu;
  if (device_name == "cuda") {
    std::string why;
    if (!CudaAvailable(&why)) {
      std::printf("SKIP: bench_train_step --device cuda: no usable GPU (%s)\n", why.c_str());
      return 0;
    }
    device = Device::kCuda;
  } else if (device_name != "cpu") {
    std::fprintf(stderr, "bench_train_step: --device '%s' (accepted: cpu, cuda)\n",
                 device_name.c_str());
    return 2;
  }
  cpd::bench::WarnIfUnoptimised();
  omp_set_num_threads(threads);
  openblas_set_num_threads(threads);

  const Batch data = RandomBatch(arch, batch, block, device);
  const double lr = IsLanguageModel(arch) ? 1e-3 : 0.05;

  std::stringstream ss(configs);
  std::string name;
  while (std::getline(ss, name, ',')) {
    auto pc = ConfigFor(name);
    if (!pc.ok()) {
      std::fprintf(stderr, "bench_train_step: %s\n", pc.status().message().c_str());
      return 2;
    }
    auto model = Model(arch, block);
    if (!model.ok()) {
      std::fprintf(stderr, "bench_train_step: %s\n", model.status().message().c_str());
      return 2;
    }
    MoveToDevice(model->get(), device);
    std::vector<Layer*> qlayers;
    for (Layer* l : (*model)->Flatten()) {
      if (l->Quantizable()) qlayers.push_back(l);
    }
    auto quant = SiteQuantizer::Create(*pc, qlayers);
    if (!quant.ok()) {
      std::fprintf(stderr, "bench_train_step: %s\n", quant.status().message().c_str());
      return 2;
    }
    for (Layer* l : qlayers) {
      l->SetQuantHooks((*quant)->Quantizes(l->name()) ? quant->get() : nullptr);
    }
    Optimizer opt((*model)->Params(), OptimizerFor(arch, threads));
    SoftmaxCrossEntropy ce;
    Tensor dlogits;
    std::vector<double> times;
    for (int i = 0; i < warmup + steps; ++i) {
      (*quant)->SetStep(i);
      const auto t0 = std::chrono::steady_clock::now();
      opt.ZeroGrad();
      const Tensor logits = (*model)->Forward(data.x, true);
      const int64_t classes = logits.dim(-1);
      ce.Forward(logits.Reshaped({int64_t(logits.numel()) / classes, classes}), data.y, &dlogits);
      (*model)->Backward(dlogits.Reshaped(logits.shape()));
      opt.Step(lr);
#if CPD_WITH_CUDA
      if (device == Device::kCuda) cuda::Synchronize();  // the step is done when the GPU is
#endif
      const auto t1 = std::chrono::steady_clock::now();
      if (i >= warmup) times.push_back(std::chrono::duration<double>(t1 - t0).count() * 1e3);
    }
    std::sort(times.begin(), times.end());
    std::printf("%s %s %s %d %d %.3f\n", device == Device::kCpu ? "cpd" : "cpd-cuda", arch.c_str(),
                name.c_str(), batch, threads, times[times.size() / 2]);
    std::fflush(stdout);
  }
  return 0;
}
