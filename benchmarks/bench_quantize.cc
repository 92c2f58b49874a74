// bench_quantize: CPU quantisation throughput against memcpy of the same buffer, in one run.
//
//   bench_quantize [--mib 64] [--reps 15] [--threads 1,2] [--formats e4m3,bf16,...]
//                  [--lanes auto|avx512|avx2|scalar]
//
// --lanes picks the code that rounds stochastically onto float grids (kernels/stochastic_lanes.inc)
// where the CPU runs it, so that an AVX-512 machine also measures the AVX2 lanes.
//
// GB/s counts bytes read + written (8 bytes per element out of place; memcpy likewise). The
// ratio column divides by memcpy measured with the same thread count in this run. Medians of
// --reps runs after one warm-up.
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "benchmarks/bench_util.h"
#include "cpd/format.h"
#include "cpd/quantize.h"
#include "cpd/transform.h"
#include "kernels/quantize_cpu.h"

namespace {

using cpd::bench::SplitList;

template <typename Fn>
double MedianSeconds(int reps, Fn&& fn) {
  fn();  // warm-up: page faults, caches, ifunc resolution
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto a = std::chrono::steady_clock::now();
    fn();
    const auto b = std::chrono::steady_clock::now();
    t.push_back(std::chrono::duration<double>(b - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// memcpy split across `threads` threads, each copying a contiguous slice.
void ParallelMemcpy(float* dst, const float* src, size_t n, int threads) {
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const size_t s = n * t / nt, e = n * (t + 1) / nt;
    std::memcpy(dst + s, src + s, (e - s) * sizeof(float));
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_quantize: CPU quantisation GB/s and ratio to memcpy in the same run"};
  double mib = 64;
  int reps = 15;
  std::string threads_list = "1,2";
  std::string formats_list =
      "e4m3,e5m2,bf16,fp16,e2m1,e3m0,fp134,log4,mxfp8,mxfp4,bfp8:16,int8,uint4:minmax,nvfp4,"
      "nvfp4:2d,e4m3:block=1x128,e4m3:block=128x128";
  std::string stochastic_list = "e4m3,e5m2,bf16,e2m1,int8,nvfp4";
  size_t columns = 4096;
  bool with_stats = true;
  app.add_option("--mib", mib, "Buffer size in MiB of float32")->capture_default_str();
  app.add_option("--reps", reps, "Timed repetitions (median reported)")->capture_default_str();
  app.add_option("--threads", threads_list, "Comma-separated thread counts")->capture_default_str();
  app.add_option("--formats", formats_list, "Formats timed with nearest rounding")
      ->capture_default_str();
  app.add_option("--stochastic", stochastic_list, "Formats also timed with stochastic rounding")
      ->capture_default_str();
  app.add_option("--columns", columns,
                 "Row length of the matrix view of block-scaled formats (nvfp4, FLOAT:block=RxC)")
      ->capture_default_str();
  app.add_flag("!--no-stats", with_stats, "Skip the rows with fused statistics and encoding");
  std::string lanes = "auto";
  app.add_option("--lanes", lanes, "Stochastic float-grid lanes: auto | avx512 | avx2 | scalar")
      ->check(CLI::IsMember({"auto", "avx512", "avx2", "scalar"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  using cpd::kernels::StochasticLaneSet;
  if (lanes != "auto") {
    const StochasticLaneSet set = lanes == "avx512" ? StochasticLaneSet::kAvx512
                                  : lanes == "avx2" ? StochasticLaneSet::kAvx2
                                                    : StochasticLaneSet::kNone;
    if (!cpd::kernels::ForceStochasticLanesForTesting(set)) {
      std::fprintf(stderr, "bench_quantize: --lanes %s: this CPU cannot run them\n", lanes.c_str());
      return 2;
    }
  }
  const char* const lane_names[] = {"scalar", "avx2", "avx512"};

  cpd::bench::WarnIfUnoptimised();

  const size_t n = size_t(mib * 1024 * 1024 / sizeof(float));
  // `out` is offset by 1 KiB + 64 B from `in` within a page: same-offset buffers suffer 4K
  // aliasing between loads and stores, which memcpy avoids and real tensors rarely hit.
  std::vector<float> in(n), out_storage(n + 272);
  float* const out_ptr = out_storage.data() + 272;
  std::mt19937 rng(1234);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (auto& v : in) v = dist(rng);
  ParallelMemcpy(out_ptr, in.data(), n, 1);  // touch every page of `out`

  const double bytes = 2.0 * n * sizeof(float);
  std::printf(
      "# bench_quantize: %zu float32 (%.0f MiB), out of place, median of %d, "
      "stochastic float-grid lanes: %s, block-scaled rows of %zu\n",
      n, mib, reps, lane_names[int(cpd::kernels::ActiveStochasticLanes())], columns);
  std::printf("%-16s %-11s %-9s %7s %10s %9s %8s\n", "format", "rounding", "mode", "threads",
              "time(ms)", "GB/s", "x_memcpy");

  for (const std::string& ts : SplitList(threads_list)) {
    const int threads = std::stoi(ts);
    const double t_copy =
        MedianSeconds(reps, [&] { ParallelMemcpy(out_ptr, in.data(), n, threads); });
    const double copy_gbs = bytes / t_copy / 1e9;
    std::printf("%-16s %-11s %-9s %7d %10.3f %9.2f %8.3f\n", "memcpy", "-", "copy", threads,
                t_copy * 1e3, copy_gbs, 1.0);

    auto row = [&](const std::string& spec, cpd::Rounding r, const char* mode) {
      auto f = cpd::Format::Parse(spec);
      if (!f.ok()) {
        std::fprintf(stderr, "bench_quantize: %s\n", f.status().message().c_str());
        std::exit(2);
      }
      cpd::QuantizeOptions opts;
      opts.rounding = r;
      opts.threads = threads;
      opts.seed = 7;
      opts.columns = columns;
      cpd::QuantStats st;
      cpd::PackedTensor packed;
      const std::string m = mode;
      const double t = MedianSeconds(reps, [&] {
        cpd::Status s;
        if (m == "quantize") {
          s = cpd::Quantize(*f, in.data(), out_ptr, n, opts);
        } else if (m == "+stats") {
          s = cpd::Quantize(*f, in.data(), out_ptr, n, opts, &st);
        } else {
          s = cpd::Encode(*f, in.data(), n, opts, &packed);
        }
        if (!s.ok()) {
          std::fprintf(stderr, "bench_quantize: %s\n", s.message().c_str());
          std::exit(1);
        }
      });
      // Encode writes bits/32 of what it reads; count the bytes it really moves.
      const double moved =
          m == "encode" ? n * sizeof(float) + double(cpd::PackedCodeBytes(*f, n)) : bytes;
      const double gbs = moved / t / 1e9;
      std::printf("%-16s %-11s %-9s %7d %10.3f %9.2f %8.3f\n", spec.c_str(), cpd::RoundingName(r),
                  mode, threads, t * 1e3, gbs, gbs / copy_gbs);
      std::fflush(stdout);
    };
    for (const auto& spec : SplitList(formats_list)) row(spec, cpd::Rounding::kNearest, "quantize");
    for (const auto& spec : SplitList(stochastic_list)) {
      row(spec, cpd::Rounding::kStochastic, "quantize");
    }
    if (with_stats) {
      row("e4m3", cpd::Rounding::kNearest, "+stats");
      row("e4m3", cpd::Rounding::kNearest, "encode");
      row("mxfp4", cpd::Rounding::kNearest, "encode");
      row("nvfp4", cpd::Rounding::kNearest, "encode");
    }
    // Block Hadamard transforms (cpd/transform.h) down the rows of the [n / columns, columns]
    // matrix, in place: read and write every element once per row pass of the butterflies.
    for (const char* spec : {"rht16", "rht128"}) {
      const cpd::HadamardOptions h = *cpd::ParseHadamard(spec);
      cpd::HadamardOptions o = h;
      o.threads = threads;
      const double t = MedianSeconds(reps, [&] {
        if (!cpd::HadamardAlongRows(o, out_ptr, n / columns, columns).ok()) std::exit(1);
      });
      const double gbs = bytes / t / 1e9;
      std::printf("%-16s %-11s %-9s %7d %10.3f %9.2f %8.3f\n", spec, "-", "transform", threads,
                  t * 1e3, gbs, gbs / copy_gbs);
      std::fflush(stdout);
    }
  }
  return 0;
}
