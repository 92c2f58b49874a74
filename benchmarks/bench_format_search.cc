// bench_format_search: what the gradient-angle indicator (runtime/search/indicator.h) costs per
// candidate format and batch, as a ratio to a plain fp32 forward + backward of the same batch
// measured in the same run (the target: at most 1.5x).
//
//   bench_format_search --arch lenet5 --batch 128 --threads 2 [--reps 15] [--format fp134]
//                       [--group 8]
//
// Rows: the baseline (GradientPass::Run in fp32), then each site selection the search can be
// asked for (A+E; E; A; all three), timed as Evaluate() on `group` candidates after one
// BeginBatch: "per candidate" is (BeginBatch + Evaluate) / group, the cost a search pays per
// candidate and batch when its rank evaluates `group` candidates per round; "marginal" leaves
// the shared fp32 pass out. Medians of --reps runs after 2 warm-ups, on a random batch of the
// synthetic data set with a randomly initialised model.
#include <omp.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <vector>

#include "benchmarks/bench_util.h"
#include "runtime/nn/models.h"
#include "runtime/search/indicator.h"
#include "runtime/train/data.h"

extern "C" void openblas_set_num_threads(int num_threads);

namespace {

using namespace cpd::runtime;
using Clock = std::chrono::steady_clock;

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_format_search: the indicator's cost per candidate vs fp32 fwd+bwd"};
  std::string arch = "lenet5", format = "fp134";
  int batch = 128, threads = 2, reps = 15, group = 8;
  app.add_option("--arch", arch)->capture_default_str();
  app.add_option("--batch", batch)->capture_default_str();
  app.add_option("--threads", threads)->capture_default_str();
  app.add_option("--reps", reps)->capture_default_str();
  app.add_option("--format", format, "The candidate evaluated")->capture_default_str();
  app.add_option("--group", group, "Candidates per BeginBatch")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  cpd::bench::WarnIfUnoptimised();
  if (batch < 1 || threads < 1 || reps < 1 || group < 1) {
    std::fprintf(stderr, "bench_format_search: --batch, --threads, --reps, --group must be >= 1\n");
    return 2;
  }
  omp_set_num_threads(threads);
  openblas_set_num_threads(threads);
  auto fmt = cpd::Format::Parse(format);
  if (!fmt.ok()) {
    std::fprintf(stderr, "bench_format_search: %s\n", fmt.status().message().c_str());
    return 2;
  }
  Dataset data = MakeSynthetic(int64_t(batch) * 2, 1, 28, 28, 10, 1).value();
  Normalize(&data, ComputeChannelStats(data));
  auto model = BuildModel(arch, 1, 28, 10, 1);
  if (!model.ok()) {
    std::fprintf(stderr, "bench_format_search: %s\n", model.status().message().c_str());
    return 2;
  }
  BatchIterator it(data, batch, /*shuffle=*/false, /*augment=*/false, 1, /*drop_last=*/true);
  it.StartEpoch(0);
  Tensor x;
  std::vector<int32_t> y;
  it.Next(&x, &y);

  // The baseline: a plain fp32 forward + backward.
  GradientPass pass(model->get());
  std::vector<double> base;
  for (int r = 0; r < reps + 2; ++r) {
    const auto t0 = Clock::now();
    pass.Run(x, y);
    if (r >= 2) base.push_back(Ms(t0, Clock::now()));
  }
  const double base_ms = cpd::bench::Median(base);
  std::printf(
      "# bench_format_search: %s, batch %d, %d thread(s), candidate %s, group %d, "
      "median of %d\n",
      arch.c_str(), batch, threads, fmt->spec().c_str(), group, reps);
  std::printf("%-12s %14s %14s %14s %12s\n", "sites", "begin ms", "eval ms/cand", "ms/cand",
              "x fp32 f+b");
  std::printf("%-12s %14s %14s %14.3f %12.3f\n", "fp32 f+b", "-", "-", base_ms, 1.0);
  const std::vector<cpd::Format> cands(size_t(group), *fmt);
  const std::vector<std::pair<const char*, std::vector<SiteSet>>> selections = {
      {"A+E", {SiteSet::kAE}},
      {"E", {SiteSet::kE}},
      {"A", {SiteSet::kA}},
      {"A,E,A+E", {SiteSet::kA, SiteSet::kE, SiteSet::kAE}}};
  for (const auto& [name, sites] : selections) {
    IndicatorOptions o;
    o.sites = sites;
    auto ind = GradientAngleIndicator::Create(model->get(), o).value();
    std::vector<double> begin, eval;
    for (int r = 0; r < reps + 2; ++r) {
      const auto t0 = Clock::now();
      if (!ind->BeginBatch(x, y, r).ok()) return 1;
      const auto t1 = Clock::now();
      if (!ind->Evaluate(cands).ok()) return 1;
      const auto t2 = Clock::now();
      if (r >= 2) {
        begin.push_back(Ms(t0, t1));
        eval.push_back(Ms(t1, t2) / group);
      }
    }
    const double b = cpd::bench::Median(begin), e = cpd::bench::Median(eval);
    const double per = b / group + e;
    std::printf("%-12s %14.3f %14.3f %14.3f %12.3f\n", name, b, e, per, per / base_ms);
  }
  return 0;
}
