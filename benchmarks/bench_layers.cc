// bench_layers: CPU training-step time of the cpd-train models (runtime/nn/layers.h).
//
//   bench_layers [--models lenet5,resnet20] [--batch 128] [--threads 2] [--steps 20]
//                [--profile] [--baseline] [--paths auto,im2col,onednn,direct]
//
// One fixed random batch per model; each step is forward (train mode) + softmax cross-entropy
// + backward, and "step" adds ZeroGrad and an SGD update (momentum 0.9, weight decay 5e-4: the
// step of benchmarks/torch_step.py, PyTorch's reference). Medians over --steps after two
// warm-up steps. --profile adds a per-layer table (top-level children; median ms forward and
// backward). --paths runs each model once per convolution path: auto (cpu::Conv2dPath's
// choice per shape), or im2col / direct / onednn forced wherever that path can run (im2col
// elsewhere); each row after the first gives the first row's speed-up over it, measured in the
// same run. --baseline is --paths auto,im2col.
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "benchmarks/bench_util.h"
#include "runtime/engine/cpu_ops.h"
#include "runtime/nn/layers.h"
#include "runtime/nn/models.h"
#include "runtime/nn/optimizer.h"

namespace {

using cpd::bench::Median;
using cpd::bench::SplitList;

using Clock = std::chrono::steady_clock;
using cpd::runtime::Tensor;

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

struct Timing {
  double fwd = 0, bwd = 0, fwd_bwd = 0, step = 0;
};

int Run(const std::string& arch, int batch, int steps, bool profile, Timing* t) {
  const bool mnist = arch == "lenet5" || arch == "mlp";
  const int ch = mnist ? 1 : 3, size = mnist ? 28 : 32;
  auto built = cpd::runtime::BuildModel(arch, ch, size, 10, 1);
  if (!built.ok()) {
    std::fprintf(stderr, "bench_layers: %s\n", built.status().ToString().c_str());
    return 1;
  }
  auto& model = *built.value();
  Tensor x({batch, ch, size, size});
  std::mt19937_64 gen(7);
  std::normal_distribution<float> normal;
  for (size_t i = 0; i < x.numel(); ++i) x.data()[i] = normal(gen);
  std::vector<int32_t> y(static_cast<size_t>(batch));
  for (auto& l : y) l = int32_t(gen() % 10);

  cpd::runtime::OptimizerOptions oo;
  oo.momentum = 0.9;
  oo.weight_decay = 5e-4;
  cpd::runtime::Optimizer opt(model.Params(), oo);
  cpd::runtime::SoftmaxCrossEntropy ce;
  Tensor dlogits;

  std::vector<double> fwd, bwd, fb, full;
  std::map<std::string, std::vector<double>> layer_f, layer_b;
  for (int s = 0; s < steps + 2; ++s) {
    const auto t0 = Clock::now();
    opt.ZeroGrad();
    const auto t1 = Clock::now();
    Tensor logits = model.Forward(x, true);
    ce.Forward(logits, y, &dlogits);
    const auto t2 = Clock::now();
    model.Backward(dlogits);
    const auto t3 = Clock::now();
    opt.Step(0.01);
    const auto t4 = Clock::now();
    if (s >= 2) {
      fwd.push_back(Ms(t1, t2));
      bwd.push_back(Ms(t2, t3));
      fb.push_back(Ms(t1, t3));
      full.push_back(Ms(t0, t4));
    }
    if (profile && s >= 2) {
      // Per child, outside the timed step above.
      std::vector<Tensor> inputs;
      Tensor h = x;
      for (size_t i = 0; i < model.size(); ++i) {
        inputs.push_back(h);
        const auto a = Clock::now();
        h = model.child(i)->Forward(h, true);
        layer_f[model.child(i)->name()].push_back(Ms(a, Clock::now()));
      }
      ce.Forward(h, y, &dlogits);
      Tensor g = dlogits;
      for (size_t i = model.size(); i-- > 0;) {
        const auto a = Clock::now();
        g = model.child(i)->Backward(g);
        layer_b[model.child(i)->name()].push_back(Ms(a, Clock::now()));
      }
    }
  }
  t->fwd = Median(fwd);
  t->bwd = Median(bwd);
  t->fwd_bwd = Median(fb);
  t->step = Median(full);
  if (profile) {
    std::printf("  %-12s %10s %10s\n", "layer", "fwd ms", "bwd ms");
    for (size_t i = 0; i < model.size(); ++i) {
      const std::string& n = model.child(i)->name();
      std::printf("  %-12s %10.3f %10.3f\n", n.c_str(), Median(layer_f[n]), Median(layer_b[n]));
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"CPU training-step time of the cpd-train models"};
  std::string models = "lenet5,resnet20", paths = "auto";
  int batch = 128, threads = 2, steps = 20;
  bool profile = false, baseline = false;
  app.add_option("--models", models, "comma-separated architectures");
  app.add_option("--batch", batch, "batch size")->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "OpenMP threads")->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "timed steps (median)")->check(CLI::PositiveNumber);
  app.add_flag("--profile", profile, "per-layer forward/backward table (first path)");
  app.add_option("--paths", paths, "convolution paths: auto, im2col, direct, onednn");
  app.add_flag("--baseline", baseline, "same as --paths auto,im2col");
  CLI11_PARSE(app, argc, argv);
  if (baseline) paths = "auto,im2col";
  namespace cpu = cpd::runtime::cpu;
  std::vector<std::pair<std::string, std::optional<cpu::ConvPath>>> runs;
  for (const std::string& p : SplitList(paths)) {
    if (p == "auto") {
      runs.emplace_back(p, std::nullopt);
    } else if (p == "im2col" || p == "direct" || p == "onednn") {
      runs.emplace_back(p, p == "im2col"   ? cpu::ConvPath::kIm2col
                           : p == "direct" ? cpu::ConvPath::kDirect
                                           : cpu::ConvPath::kDnnl);
    } else {
      std::fprintf(stderr,
                   "bench_layers: --paths: unknown path '%s' (auto, im2col, direct, "
                   "onednn)\n",
                   p.c_str());
      return 2;
    }
  }
  cpd::bench::WarnIfUnoptimised();
  omp_set_num_threads(threads);
  std::printf("%-16s %6s %8s %10s %10s %10s %10s %8s\n", "model", "batch", "threads", "fwd ms",
              "bwd ms", "fwd+bwd ms", "step ms", "speedup");
  for (const std::string& arch : SplitList(models)) {
    double first = 0;
    for (size_t r = 0; r < runs.size(); ++r) {
      cpu::OverrideConvPath(runs[r].second);
      Timing t;
      const int rc = Run(arch, batch, steps, profile && r == 0, &t);
      cpu::OverrideConvPath(std::nullopt);
      if (rc != 0) return 1;
      const std::string label = runs.size() == 1 ? arch : arch + " " + runs[r].first;
      std::printf("%-16s %6d %8d %10.2f %10.2f %10.2f %10.2f", label.c_str(), batch, threads, t.fwd,
                  t.bwd, t.fwd_bwd, t.step);
      if (r == 0) {
        first = t.step;
        std::printf("\n");
      } else {
        std::printf(" %7.2fx\n", t.step / first);
      }
      std::fflush(stdout);
    }
  }
  return 0;
}
