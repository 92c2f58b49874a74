// bench_conv: every CPU convolution path on every convolution shape of the cpd-train models,
// the measurements behind cpu::Conv2dPath's choice (runtime/engine/cpu_ops.cc, DnnlConvPreferred).
//
//   bench_conv [--models resnet20,lenet5] [--batch 128] [--threads 2] [--steps 15]
//              [--shapes C:H:W:OC:K:STRIDE:PAD[:b],...]
//
// Per distinct shape (count: how many layers of the model have it) and per path that can run it
// here (im2col + OpenBLAS; direct AVX-512; oneDNN), the median time of cpu::Conv2dForward, of
// cpu::Conv2dBackward without the input gradient (weights + bias: "bwd_w") and with it ("bwd"),
// after two warm-up calls, on one fixed random batch; every re-layout (oneDNN's reorders
// between NCHW and its blocked formats, the direct kernel's weight packing) is inside the
// timed calls. "x im2col" is the path's fwd + bwd time over im2col's, measured in the same
// run; "auto" marks the path Conv2dPath picks. --shapes adds a table ("shapes") of other
// convolutions (":b" with a bias). The last lines sum count x (fwd + bwd) per path
// over each model's convolutions, and for the automatic choice.
#include <omp.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "benchmarks/bench_util.h"
#include "runtime/engine/cpu_ops.h"
#include "runtime/engine/dnnl_conv.h"
#include "runtime/nn/layers.h"
#include "runtime/nn/models.h"

namespace {

using cpd::bench::Median;
using cpd::bench::SplitList;
using cpd::runtime::Tensor;
namespace cpu = cpd::runtime::cpu;
using Clock = std::chrono::steady_clock;

struct ConvKey {
  cpu::ConvShape s;
  bool bias;
  bool operator<(const ConvKey& o) const {
    auto t = [](const ConvKey& k) {
      return std::tuple(k.s.c, k.s.h, k.s.w, k.s.oc, k.s.k, k.s.stride, k.s.pad, k.bias);
    };
    return t(*this) < t(o);
  }
};

Tensor Random(std::vector<int64_t> shape, uint64_t seed) {
  Tensor t(std::move(shape));
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> normal;
  for (size_t i = 0; i < t.numel(); ++i) t.data()[i] = normal(gen);
  return t;
}

template <class F>
double TimeMs(int steps, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < steps + 2; ++i) {
    const auto a = Clock::now();
    f();
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - a).count();
    if (i >= 2) t.push_back(ms);
  }
  return Median(t);
}

struct PathTime {
  double fwd = 0, bwd_w = 0, bwd = 0;
};

PathTime Measure(const cpu::ConvShape& s, bool bias, cpu::ConvPath path, int steps) {
  const Tensor x = Random({s.n, s.c, s.h, s.w}, 1), w = Random({s.oc, s.c, s.k, s.k}, 2),
               b = Random({s.oc}, 3), dy = Random({s.n, s.oc, s.oh, s.ow}, 4);
  Tensor y({s.n, s.oc, s.oh, s.ow}), dx({s.n, s.c, s.h, s.w}), dw({s.oc, s.c, s.k, s.k}),
      db({s.oc});
  cpu::ConvWorkspace ws;
  cpu::OverrideConvPath(path);
  PathTime t;
  const float* bp = bias ? b.data() : nullptr;
  float* dbp = bias ? db.data() : nullptr;
  t.fwd = TimeMs(steps, [&] { cpu::Conv2dForward(s, x.data(), w.data(), bp, y.data(), &ws); });
  // As in training: each backward follows its forward (the oneDNN path reuses the forward's
  // blocked x), so time forward + backward and subtract the forward.
  const double fb_w = TimeMs(steps, [&] {
    cpu::Conv2dForward(s, x.data(), w.data(), bp, y.data(), &ws);
    cpu::Conv2dBackward(s, x.data(), w.data(), dy.data(), nullptr, dw.data(), dbp, &ws);
  });
  const double fb = TimeMs(steps, [&] {
    cpu::Conv2dForward(s, x.data(), w.data(), bp, y.data(), &ws);
    cpu::Conv2dBackward(s, x.data(), w.data(), dy.data(), dx.data(), dw.data(), dbp, &ws);
  });
  cpu::OverrideConvPath(std::nullopt);
  t.bwd_w = fb_w - t.fwd;
  t.bwd = fb - t.fwd;
  return t;
}

std::string ShapeName(const cpu::ConvShape& s, bool bias) {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "%ldx%ldx%ld->%ld k%ld s%ld p%ld%s", long(s.c), long(s.h),
                long(s.w), long(s.oc), long(s.k), long(s.stride), long(s.pad), bias ? " b" : "");
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"CPU convolution paths on the cpd-train models' shapes"};
  std::string models = "resnet20,lenet5";
  int batch = 128, threads = 2, steps = 15;
  app.add_option("--models", models, "comma-separated architectures");
  app.add_option("--batch", batch, "batch size")->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "OpenMP threads")->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "timed calls (median)")->check(CLI::PositiveNumber);
  std::string extra;
  app.add_option("--shapes", extra, "more shapes: C:H:W:OC:K:STRIDE:PAD[:b],...");
  CLI11_PARSE(app, argc, argv);
  cpd::bench::WarnIfUnoptimised();
  omp_set_num_threads(threads);
  const cpu::ConvPath paths[] = {cpu::ConvPath::kIm2col, cpu::ConvPath::kDirect,
                                 cpu::ConvPath::kDnnl};
  std::printf("# batch %d, %d threads, median of %d\n", batch, threads, steps);
  std::printf("%-9s %-26s %5s %-7s %8s %8s %8s %8s %9s %5s\n", "model", "shape", "count", "path",
              "fwd ms", "bwd_w ms", "bwd ms", "total", "x im2col", "auto");
  std::vector<std::pair<std::string, std::map<ConvKey, int>>> tables;
  for (const std::string& arch : SplitList(models)) {
    const bool mnist = arch == "lenet5" || arch == "mlp";
    const int ch = mnist ? 1 : 3, size = mnist ? 28 : 32;
    auto built = cpd::runtime::BuildModel(arch, ch, size, 10, 1);
    if (!built.ok()) {
      std::fprintf(stderr, "bench_conv: %s\n", built.status().ToString().c_str());
      return 1;
    }
    std::vector<cpd::runtime::LayerShapeRecord> records;
    built.value()->TraceShapes({batch, ch, size, size}, &records);
    std::map<ConvKey, int> count;
    for (const auto& r : records) {
      auto* conv = dynamic_cast<cpd::runtime::Conv2d*>(r.layer);
      if (conv == nullptr) continue;
      cpu::ConvShape s{.n = r.input[0],
                       .c = r.input[1],
                       .h = r.input[2],
                       .w = r.input[3],
                       .oc = conv->out_channels(),
                       .k = conv->kernel(),
                       .stride = conv->stride(),
                       .pad = conv->padding()};
      s.ComputeOutput();
      ++count[{s, conv->bias() != nullptr}];
    }
    tables.emplace_back(arch, std::move(count));
  }
  if (!extra.empty()) {
    std::map<ConvKey, int> count;
    for (const std::string& spec : SplitList(extra)) {
      long v[7];
      char b = 0;
      const int got = std::sscanf(spec.c_str(), "%ld:%ld:%ld:%ld:%ld:%ld:%ld:%c", &v[0], &v[1],
                                  &v[2], &v[3], &v[4], &v[5], &v[6], &b);
      cpu::ConvShape s{.n = batch,
                       .c = v[0],
                       .h = v[1],
                       .w = v[2],
                       .oc = v[3],
                       .k = v[4],
                       .stride = v[5],
                       .pad = v[6]};
      if (got < 7 || (got == 8 && b != 'b') || v[0] < 1 || v[3] < 1 || !s.ComputeOutput()) {
        std::fprintf(stderr, "bench_conv: --shapes: bad shape '%s' (C:H:W:OC:K:STRIDE:PAD[:b])\n",
                     spec.c_str());
        return 2;
      }
      ++count[{s, got == 8}];
    }
    tables.emplace_back("shapes", std::move(count));
  }
  for (const auto& [arch, count] : tables) {
    std::map<cpu::ConvPath, double> sum;
    std::map<cpu::ConvPath, size_t> shapes_run;
    double sum_auto = 0;
    for (const auto& [key, n] : count) {
      const cpu::ConvPath chosen = cpu::Conv2dPath(key.s);
      double im2col = 0;
      for (cpu::ConvPath p : paths) {
        if (!cpu::ConvPathRuns(p, key.s)) continue;
        const PathTime t = Measure(key.s, key.bias, p, steps);
        const double total = t.fwd + t.bwd;
        if (p == cpu::ConvPath::kIm2col) im2col = total;
        sum[p] += n * total;
        ++shapes_run[p];
        if (p == chosen) sum_auto += n * total;
        std::printf("%-9s %-26s %5d %-7s %8.3f %8.3f %8.3f %8.3f %8.2fx %5s\n", arch.c_str(),
                    ShapeName(key.s, key.bias).c_str(), n, cpu::ConvPathName(p), t.fwd, t.bwd_w,
                    t.bwd, total, total / im2col, p == chosen ? "*" : "");
        std::fflush(stdout);
      }
      if (cpu::ConvPathRuns(cpu::ConvPath::kDnnl, key.s)) {
        std::printf("%-9s %-26s       oneDNN: %s\n", arch.c_str(), "",
                    cpu::onednn::Describe(key.s, key.bias).c_str());
      }
    }
    for (cpu::ConvPath p : paths) {
      if (shapes_run[p] != count.size()) continue;  // a path that runs only some shapes
      std::printf("%-9s %-26s %5s %-7s %35.3f %8.2fx\n", arch.c_str(), "all convolutions", "",
                  cpu::ConvPathName(p), sum[p], sum[p] / sum[cpu::ConvPath::kIm2col]);
    }
    std::printf("%-9s %-26s %5s %-7s %35.3f %8.2fx\n", arch.c_str(), "all convolutions", "", "auto",
                sum_auto, sum_auto / sum[cpu::ConvPath::kIm2col]);
  }
  return 0;
}
