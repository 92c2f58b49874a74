// GradientAllReducer under mpirun (world sizes 1-4) with K = 1-3 local replicas: every rank
// regenerates every worker's gradients from a seed, so each rank computes the expected result
// on its own, sequentially, with cpd::Quantize and the paper's formulas, and compares bit for bit
// (emulate, packed) or exactly (fp32 on small integers). Run as `mpirun -np N
// comm_gradient_allreduce_test`; only rank 0 prints.
#include "comm/gradient_allreduce.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "comm/allreduce/internal.h"
#include "comm/communicator.h"
#include "comm/mpi_communicator.h"
#include "cpd/config.h"
#include "cpd/format.h"
#include "cpd/quantize.h"
#include "tests/comm/mirror_communicator.h"
#include "tests/mpi_test_main.h"

namespace cpd::comm {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// FNV-1a over the bytes of a float buffer.
uint64_t Hash(const std::vector<float>& v) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = reinterpret_cast<const uint8_t*>(v.data());
  for (size_t i = 0; i < v.size() * sizeof(float); ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

// True when every rank holds the same 64-bit value.
bool SameOnAllRanks(uint64_t h) {
  const int n = test::MpiWorld()->size();
  std::vector<uint64_t> all(static_cast<size_t>(n));
  const Status s = test::MpiWorld()->AllGatherBytes(
      reinterpret_cast<const uint8_t*>(&h), reinterpret_cast<uint8_t*>(all.data()), sizeof(h));
  EXPECT_TRUE(s.ok()) << s.ToString();
  return std::all_of(all.begin(), all.end(), [h](uint64_t x) { return x == h; });
}

GradientLayout MakeLayout(const std::vector<size_t>& sizes) {
  GradientLayout layout;
  layout.offsets.push_back(0);
  for (size_t i = 0; i < sizes.size(); ++i) {
    layout.layer_names.push_back("layer" + std::to_string(i));
    layout.offsets.push_back(layout.offsets.back() + sizes[i]);
  }
  return layout;
}

// Worker w's gradient: per layer a different magnitude (2^(3l - 6)) times N(0, 1), so APS has
// something to do; a few exact zeros. Any rank can regenerate any worker's input. With
// spread > 0, worker w is scaled by a further 2^(spread * (w % 4)), so that float32 sums of the
// contributions round and their order shows.
std::vector<float> WorkerInput(const GradientLayout& layout, uint64_t seed, int worker,
                               int spread = 0) {
  std::vector<float> x(layout.total());
  std::mt19937_64 rng(seed * 1000003u + static_cast<uint64_t>(worker));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t l = 0; l < layout.layers(); ++l) {
    const float scale = std::ldexp(1.0f, 3 * static_cast<int>(l) - 6 + spread * (worker % 4));
    for (size_t i = layout.offsets[l]; i < layout.offsets[l + 1]; ++i) {
      x[i] = (i % 97 == 5) ? 0.0f : normal(rng) * scale;
    }
  }
  return x;
}

// emax of the formats these tests use (the exponent of the largest finite value).
int EmaxOf(const std::string& spec) {
  if (spec == "e4m3") return 8;    // 448
  if (spec == "e5m2") return 15;   // 57344
  if (spec == "e3m0") return 3;    // 8
  if (spec == "e2m1") return 2;    // 6
  if (spec == "fp16") return 15;   // 65504
  if (spec == "bf16") return 127;  // 3.39e38
  if (spec == "int8") return 6;    // 127 levels
  if (spec == "mxfp8") return 8;   // e4m3 elements
  if (spec == "mxfp4") return 2;   // e2m1 elements, 6
  if (spec == "nvfp4") return 2;   // e2m1 elements under E4M3 block and float32 tensor scales
  if (spec == "e4m3:block=1x128:scale=fp32") return 8;  // DeepSeek-V3's tiles: float32 scales
  if (spec == "fp32") return 0;  // hybrid plans: fp32 layers are never shifted
  ADD_FAILURE() << "no emax for " << spec;
  return 0;
}

// APS (Han/Demmel/You), written out again: s = emax - ceil(log2(max * W)), clamped.
int ExpectedShift(float max_abs, int workers, int emax) {
  if (!(max_abs > 0.0f)) return 0;
  const int e = static_cast<int>(std::ceil(std::log2(static_cast<double>(max_abs) * workers)));
  return std::clamp(emax - e, -126, 126);
}

// APS sum scaling (packed), written out again: the contribution shift puts max|g| at the top,
// capped so that the float32 sum of W contributions stays finite; a segment's sum shift t puts
// its max|sum| at the top, clamped so that |s + t| <= 126.
int ExpectedSumScalingShift(float max_abs, int workers, int emax) {
  return std::min(ExpectedShift(max_abs, 1, emax), ExpectedShift(max_abs, workers, 127));
}
int ExpectedSegmentShift(float max_sum, int s, int emax) {
  return std::clamp(ExpectedShift(max_sum, 1, emax), -126 - s, 126 - s);
}

struct Case {
  AllReduceAlgo algo;
  std::string format;
  bool aps;
  bool kahan;
  Rounding rounding;
  // The existing cases pin today's (the paper's) scaling: its results must not change.
  ApsScaling scaling = ApsScaling::kPaper;
  std::map<std::string, std::string> layer_formats = {};  // hybrid precision
  // Layer l's format spec.
  std::string FormatOf(const GradientLayout& layout, size_t l) const {
    const auto it = layer_formats.find(layout.layer_names[l]);
    return it == layer_formats.end() ? format : it->second;
  }
};

std::string Name(const Case& c, int k) {
  std::string hybrid;
  for (const auto& [layer, spec] : c.layer_formats) hybrid += "/" + layer + "=" + spec;
  return std::string(AllReduceAlgoName(c.algo)) + "/" + c.format + hybrid +
         (c.aps ? std::string("/aps-") + ApsScalingName(c.scaling) : "") +
         (c.kahan ? "/kahan" : "") + "/" + RoundingName(c.rounding) + "/K=" + std::to_string(k);
}

// The sequential reference: for each segment (a layer's part of one rank's chunk; the scale
// group of per-tensor-scaled formats), each worker's contribution quantised after 2^s, summed in
// worker order as the algorithm prescribes, shifted back by 2^-s; each layer in its own format
// (hybrid precision: fp32 layers unshifted). packed with the sum scaling: the float32 sum times
// 2^t of its segment before the rounding (t = 0 for fp32 layers), shifted back by 2^-(s + t).
std::vector<float> Reference(const Case& c, const GradientLayout& layout,
                             const std::vector<GradientBucket>& buckets,
                             const std::vector<std::vector<float>>& x, uint64_t seed, int64_t step,
                             std::vector<int>* shifts) {
  const int workers = static_cast<int>(x.size());
  const size_t layers = layout.layers();
  const bool sum_scaling =
      c.aps && c.algo == AllReduceAlgo::kPacked && c.scaling != ApsScaling::kPaper;
  shifts->assign(layers, 0);
  for (size_t l = 0; l < layers; ++l) {
    float mx = 0.0f;
    for (const auto& xw : x) {
      for (size_t i = layout.offsets[l]; i < layout.offsets[l + 1]; ++i)
        mx = std::max(mx, std::fabs(xw[i]));
    }
    const std::string spec = c.FormatOf(layout, l);
    if (c.aps && spec != "fp32") {
      (*shifts)[l] = sum_scaling ? ExpectedSumScalingShift(mx, workers, EmaxOf(spec))
                                 : ExpectedShift(mx, workers, EmaxOf(spec));
    }
  }
  std::vector<float> out(layout.total(), 0.0f);
  Format format;
  auto q = [&](const float* in, float* o, size_t n, int64_t stage, size_t index) {
    QuantizeOptions qo;
    qo.rounding = c.rounding;
    qo.seed = internal::RoundingSeed(seed, stage);
    qo.step = static_cast<uint64_t>(step);
    qo.index_offset = index;
    ASSERT_TRUE(Quantize(format, in, o, n, qo).ok());
  };
  for (const auto& b : buckets) {
    for (size_t d = 0; d + 1 < b.chunk_bounds.size(); ++d) {
      const size_t c0 = b.chunk_bounds[d], c1 = b.chunk_bounds[d + 1];
      for (size_t l = 0; l < layers; ++l) {
        const size_t s0 = std::max(c0, layout.offsets[l]), s1 = std::min(c1, layout.offsets[l + 1]);
        if (s1 <= s0) continue;
        const size_t n = s1 - s0;
        const int sh = (*shifts)[l];
        format = Format::Parse(c.FormatOf(layout, l)).value();
        std::vector<std::vector<float>> qw(static_cast<size_t>(workers), std::vector<float>(n));
        std::vector<float> y(n);
        for (int w = 0; w < workers; ++w) {
          for (size_t i = 0; i < n; ++i) y[i] = std::ldexp(x[static_cast<size_t>(w)][s0 + i], sh);
          q(y.data(), qw[static_cast<size_t>(w)].data(), n, w, s0);
        }
        std::vector<float> acc = qw[0], tmp(n), comp(n, 0.0f), yy(n), t(n), u(n);
        for (int w = 1; w < workers; ++w) {
          const std::vector<float>& v = qw[static_cast<size_t>(w)];
          const int64_t st = workers + 4 * int64_t{w - 1};
          if (c.algo == AllReduceAlgo::kPacked) {
            for (size_t i = 0; i < n; ++i) acc[i] += v[i];
          } else if (!c.kahan) {
            for (size_t i = 0; i < n; ++i) tmp[i] = acc[i] + v[i];
            q(tmp.data(), acc.data(), n, st, s0);
          } else {
            for (size_t i = 0; i < n; ++i) tmp[i] = v[i] - comp[i];
            q(tmp.data(), yy.data(), n, st, s0);
            for (size_t i = 0; i < n; ++i) tmp[i] = acc[i] + yy[i];
            q(tmp.data(), t.data(), n, st + 1, s0);
            for (size_t i = 0; i < n; ++i) tmp[i] = t[i] - acc[i];
            q(tmp.data(), u.data(), n, st + 2, s0);
            for (size_t i = 0; i < n; ++i) tmp[i] = u[i] - yy[i];
            q(tmp.data(), comp.data(), n, st + 3, s0);
            acc = t;
          }
        }
        int seg_shift = 0;  // t
        if (sum_scaling && c.FormatOf(layout, l) != "fp32") {
          float max_sum = 0.0f;
          for (float v : acc) max_sum = std::max(max_sum, std::fabs(v));
          seg_shift = ExpectedSegmentShift(max_sum, sh, EmaxOf(c.FormatOf(layout, l)));
          for (float& v : acc) v = std::ldexp(v, seg_shift);
        }
        if (c.algo == AllReduceAlgo::kPacked)
          q(acc.data(), acc.data(), n, 5 * int64_t{workers}, s0);
        for (size_t i = 0; i < n; ++i) out[s0 + i] = std::ldexp(acc[i], -(sh + seg_shift));
      }
    }
  }
  return out;
}

// Runs one case on this rank's K replicas and checks it against the reference. pipeline_kb < 0
// keeps the options' default.
void RunCase(const Case& c, int k, const std::vector<size_t>& sizes, double bucket_mb,
             uint64_t seed, int spread = 0, int pipeline_kb = -1) {
  SCOPED_TRACE(Name(c, k));
  const int p = test::MpiWorld()->size();
  const int r = test::MpiWorld()->rank();
  const int workers = p * k;
  const GradientLayout layout = MakeLayout(sizes);
  GradientAllReduceOptions opts;
  opts.algo = c.algo;
  opts.format = c.format;
  opts.aps = c.aps;
  opts.aps_scaling = c.scaling;
  opts.kahan = c.kahan;
  opts.rounding = c.rounding;
  opts.layer_formats = c.layer_formats;
  opts.bucket_mb = bucket_mb;
  opts.seed = seed;
  opts.threads = k == 2 ? 2 : 1;  // results must not depend on it
  if (pipeline_kb >= 0) opts.pipeline_kb = pipeline_kb;
  auto created = GradientAllReducer::Create(test::MpiWorld(), opts, layout, k);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  std::unique_ptr<GradientAllReducer> red = std::move(created).value();

  std::vector<std::vector<float>> x;
  for (int w = 0; w < workers; ++w) x.push_back(WorkerInput(layout, seed, w, spread));
  const int64_t step = 17;
  std::vector<int> shifts;
  const std::vector<float> expected = Reference(c, layout, red->buckets(), x, seed, step, &shifts);

  // The reducer may use its inputs as scratch: give it copies. Replica 0 doubles as the output.
  std::vector<std::vector<float>> local;
  for (int j = 0; j < k; ++j) local.push_back(x[static_cast<size_t>(r * k + j)]);
  std::vector<float*> ptrs;
  for (auto& v : local) ptrs.push_back(v.data());
  Status s = red->Reduce(ptrs.data(), ptrs[0], step, /*measure_error=*/true);
  ASSERT_TRUE(s.ok()) << s.ToString();
  ASSERT_FALSE(red->last_nonfinite());
  const std::vector<float>& out = local[0];
  size_t wrong = 0, first_wrong = out.size();
  for (size_t i = 0; i < out.size(); ++i) {
    const bool bad = Bits(out[i]) != Bits(expected[i]);
    if (bad && first_wrong == out.size()) first_wrong = i;
    wrong += bad;
  }
  EXPECT_EQ(wrong, 0u) << "of " << out.size() << "; first at " << first_wrong << ": got "
                       << (first_wrong < out.size() ? out[first_wrong] : 0.0f) << " expected "
                       << (first_wrong < out.size() ? expected[first_wrong] : 0.0f);
  EXPECT_TRUE(SameOnAllRanks(Hash(out)));

  ASSERT_EQ(red->last_stats().size(), layout.layers());
  for (size_t l = 0; l < layout.layers(); ++l) {
    const LayerCommStats& st = red->last_stats()[l];
    EXPECT_EQ(st.layer, layout.layer_names[l]);
    EXPECT_EQ(st.format, c.FormatOf(layout, l)) << "layer " << l;
    EXPECT_EQ(st.shift, shifts[l]) << "layer " << l;
    EXPECT_GE(st.rel_error, 0.0) << "layer " << l;
    EXPECT_GE(st.flushed, 0.0);
    EXPECT_LE(st.flushed, 1.0);
    EXPECT_GE(st.saturated, 0.0);
    EXPECT_LE(st.saturated, 1.0);
  }
  if (p == 1) {
    EXPECT_EQ(red->last_bytes_sent(), 0u);
  } else if (layout.total() > 0) {
    EXPECT_GT(red->last_bytes_sent(), 0u);
  }
}

// Layer sizes: empty, 1, odd, one larger than a bucket (split), a few ordinary ones.
const std::vector<size_t> kSizes = {0, 1, 7, 1001, 64, 3000, 129, 0, 513};
// 1048 floats per bucket: kSizes spans several buckets and splits the 3000-element layer.
constexpr double kSmallBucketMb = 1048.0 * 4.0 / (1 << 20);

TEST(GradientAllReduceTest, Fp32IsExactOnSmallIntegers) {
  const int p = test::MpiWorld()->size();
  const int r = test::MpiWorld()->rank();
  for (int k : {1, 2, 3}) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{5001}}) {
      const GradientLayout layout = MakeLayout({n / 3, n - n / 3});
      GradientAllReduceOptions opts;
      opts.bucket_mb = kSmallBucketMb;
      auto red = GradientAllReducer::Create(test::MpiWorld(), opts, layout, k);
      ASSERT_TRUE(red.ok()) << red.status().ToString();
      auto value = [](size_t i, int w) {
        return static_cast<float>(static_cast<int>((i * 7 + static_cast<size_t>(w) * 3) % 17) - 8);
      };
      std::vector<std::vector<float>> in(static_cast<size_t>(k), std::vector<float>(n));
      std::vector<float*> ptrs;
      for (int j = 0; j < k; ++j) {
        for (size_t i = 0; i < n; ++i) in[static_cast<size_t>(j)][i] = value(i, r * k + j);
        ptrs.push_back(in[static_cast<size_t>(j)].data());
      }
      std::vector<float> out(n, -1.0f);
      Status s = red.value()->Reduce(ptrs.data(), out.data(), 3, /*measure_error=*/true);
      ASSERT_TRUE(s.ok()) << s.ToString();
      size_t wrong = 0;
      for (size_t i = 0; i < n; ++i) {
        float e = 0.0f;
        for (int w = 0; w < p * k; ++w) e += value(i, w);
        wrong += out[i] != e;
      }
      EXPECT_EQ(wrong, 0u) << "n " << n << " K " << k;
      for (const auto& st : red.value()->last_stats()) EXPECT_EQ(st.rel_error, 0.0);
    }
  }
}

TEST(GradientAllReduceTest, Fp32GivesIdenticalBitsOnEveryRank) {
  // Non-integer inputs: a backend summing in a different order on different ranks would show.
  const int r = test::MpiWorld()->rank();
  for (int k : {1, 3}) {
    const GradientLayout layout = MakeLayout({100003, 17});
    GradientAllReduceOptions opts;
    opts.bucket_mb = 0.1;
    auto red = GradientAllReducer::Create(test::MpiWorld(), opts, layout, k);
    ASSERT_TRUE(red.ok());
    std::vector<std::vector<float>> in;
    std::vector<float*> ptrs;
    for (int j = 0; j < k; ++j) in.push_back(WorkerInput(layout, 5, r * k + j));
    for (auto& v : in) ptrs.push_back(v.data());
    ASSERT_TRUE(red.value()->Reduce(ptrs.data(), ptrs[0], 0).ok());
    EXPECT_TRUE(SameOnAllRanks(Hash(in[0])));
  }
}

TEST(GradientAllReduceTest, EmulateMatchesSequentialReferenceBitForBit) {
  for (const char* f : {"e4m3", "e5m2", "e3m0", "fp16", "bf16", "int8", "mxfp8", "mxfp4", "nvfp4",
                        "e4m3:block=1x128:scale=fp32"}) {
    for (bool aps : {false, true}) {
      for (bool kahan : {false, true}) {
        for (int k : {1, 2, 3}) {
          if (kahan && k == 2) continue;  // keeps the run short; K = 1 and 3 cover it
          RunCase({AllReduceAlgo::kEmulate, f, aps, kahan, Rounding::kNearest}, k, kSizes,
                  kSmallBucketMb, 11);
        }
      }
    }
  }
}

TEST(GradientAllReduceTest, EmulateStochasticRoundingIsReproducible) {
  for (const char* f : {"e4m3", "int8"}) {
    for (bool kahan : {false, true}) {
      RunCase({AllReduceAlgo::kEmulate, f, true, kahan, Rounding::kStochastic}, 2, kSizes,
              kSmallBucketMb, 23);
    }
  }
}

TEST(GradientAllReduceTest, PackedMatchesSequentialReferenceBitForBit) {
  for (const char* f : {"e4m3", "e5m2", "e3m0", "fp16", "bf16", "int8", "mxfp8", "mxfp4", "nvfp4",
                        "e4m3:block=1x128:scale=fp32"}) {
    for (bool aps : {false, true}) {
      for (int k : {1, 2, 3}) {
        RunCase({AllReduceAlgo::kPacked, f, aps, false, Rounding::kNearest}, k, kSizes,
                kSmallBucketMb, 7);
      }
    }
  }
  RunCase({AllReduceAlgo::kPacked, "e4m3", true, false, Rounding::kStochastic}, 2, kSizes,
          kSmallBucketMb, 9);
  // A bucket the size of a real model's (12 MiB), holding a 2.5 Mi-element layer between two
  // small ones.
  RunCase({AllReduceAlgo::kPacked, "e4m3", true, false, Rounding::kNearest}, 2,
          {5, (size_t(5) << 19) + 3, 77}, 12.0, 17);
  // Contributions 2^9 apart: the float32 sum rounds, so only worker order gives these bits.
  for (const char* f : {"bf16", "fp16", "int8"}) {
    RunCase({AllReduceAlgo::kPacked, f, true, false, Rounding::kNearest}, 3, kSizes, kSmallBucketMb,
            13, /*spread=*/9);
  }
}

// The pipelined schedule (rounds of a few KiB of codes, so that every chunk takes several rounds,
// and ranks whose chunks have fewer pieces than the rounds) against the sequential reference, bit
// for bit, and the sequential schedule (pipeline_kb = 0) too: every fixed float grid width (4, 8
// and 16 bits), without APS and with both scalings, nearest and stochastic rounding, K = 1 and 2;
// emulate takes the same transport.
TEST(GradientAllReduceTest, PipelinedMatchesSequentialReferenceBitForBit) {
  // 0.25 MiB buckets: the 70001-element layer is split, chunks hold several 2048-element pieces.
  const std::vector<size_t> sizes = {5, 70001, 3, 20000, 0, 9000};
  const double bucket_mb = 0.25;
  for (int kb : {1, 3, 0}) {
    for (const char* f : {"e4m3", "e3m0", "e2m1", "bf16"}) {
      for (int k : {1, 2}) {
        RunCase({AllReduceAlgo::kPacked, f, false, false, Rounding::kNearest}, k, sizes, bucket_mb,
                21, 0, kb);
        RunCase({AllReduceAlgo::kPacked, f, true, false, Rounding::kNearest}, k, sizes, bucket_mb,
                22, 0, kb);
        RunCase({AllReduceAlgo::kPacked, f, true, false, Rounding::kNearest, ApsScaling::kSum}, k,
                sizes, bucket_mb, 23, 0, kb);
      }
    }
    RunCase({AllReduceAlgo::kPacked, "e4m3", true, false, Rounding::kStochastic, ApsScaling::kSum},
            2, sizes, bucket_mb, 24, 0, kb);
    RunCase({AllReduceAlgo::kPacked, "e3m0", true, false, Rounding::kStochastic}, 1, sizes,
            bucket_mb, 25, 0, kb);
    RunCase({AllReduceAlgo::kEmulate, "e4m3", true, false, Rounding::kNearest}, 2, sizes, bucket_mb,
            26, 0, kb);
    RunCase({AllReduceAlgo::kEmulate, "e5m2", true, true, Rounding::kStochastic}, 1, sizes,
            bucket_mb, 27, 0, kb);
  }
}

// The sum scaling against the reference: every segment's t, the rounding of sum * 2^t and the
// 2^-(s + t) after the all-gather, bit for bit, for the piece pipeline (float grids) and the
// cpd::Encode'd segments (int8, MX), K = 1-3 on every world size.
TEST(GradientAllReduceTest, PackedSumScalingMatchesSequentialReferenceBitForBit) {
  const ApsScaling sum = ApsScaling::kSum;
  for (const char* f : {"e4m3", "e5m2", "e3m0", "e2m1", "fp16", "bf16", "int8", "mxfp8", "mxfp4"}) {
    for (int k : {1, 2, 3}) {
      RunCase({AllReduceAlgo::kPacked, f, true, false, Rounding::kNearest, sum}, k, kSizes,
              kSmallBucketMb, 7);
    }
  }
  for (const char* f : {"e4m3", "e3m0", "int8"}) {
    RunCase({AllReduceAlgo::kPacked, f, true, false, Rounding::kStochastic, sum}, 2, kSizes,
            kSmallBucketMb, 9);
  }
  RunCase({AllReduceAlgo::kPacked, "e4m3", true, false, Rounding::kNearest, sum}, 2,
          {5, (size_t(5) << 19) + 3, 77}, 12.0, 17);
  // Sums that round in float32 (only worker order gives these bits) and bf16, whose top
  // (2^127) is float32's: the cap on the contribution shift keeps the sums finite.
  for (const char* f : {"bf16", "fp16", "int8", "e3m0"}) {
    RunCase({AllReduceAlgo::kPacked, f, true, false, Rounding::kNearest, sum}, 3, kSizes,
            kSmallBucketMb, 13, /*spread=*/9);
  }
}

// auto is the sum scaling for packed and the paper's for emulate, bit for bit.
TEST(GradientAllReduceTest, AutoScalingIsSumForPackedAndPaperForEmulate) {
  const int r = test::MpiWorld()->rank();
  const GradientLayout layout = MakeLayout({1000, 3, 517});
  auto run = [&](AllReduceAlgo algo, ApsScaling scaling) {
    GradientAllReduceOptions o;
    o.algo = algo;
    o.format = "e3m0";
    o.aps = true;
    o.aps_scaling = scaling;
    o.bucket_mb = 0.002;
    auto red = GradientAllReducer::Create(test::MpiWorld(), o, layout, 2);
    EXPECT_TRUE(red.ok()) << red.status().ToString();
    std::vector<float> a = WorkerInput(layout, 8, 2 * r), b = WorkerInput(layout, 8, 2 * r + 1);
    float* ptrs[2] = {a.data(), b.data()};
    std::vector<float> out(layout.total());
    EXPECT_TRUE(red.value()->Reduce(ptrs, out.data(), 3).ok());
    return out;
  };
  const auto bits = [](const std::vector<float>& v) { return Hash(v); };
  EXPECT_EQ(bits(run(AllReduceAlgo::kPacked, ApsScaling::kAuto)),
            bits(run(AllReduceAlgo::kPacked, ApsScaling::kSum)));
  EXPECT_NE(bits(run(AllReduceAlgo::kPacked, ApsScaling::kAuto)),
            bits(run(AllReduceAlgo::kPacked, ApsScaling::kPaper)));
  EXPECT_EQ(bits(run(AllReduceAlgo::kEmulate, ApsScaling::kAuto)),
            bits(run(AllReduceAlgo::kEmulate, ApsScaling::kPaper)));
  const auto options = [](AllReduceAlgo algo, bool aps) {
    GradientAllReduceOptions o;
    o.algo = algo;
    o.aps = aps;
    return o;
  };
  EXPECT_TRUE(UsesApsSumScaling(options(AllReduceAlgo::kPacked, true)));
  EXPECT_FALSE(UsesApsSumScaling(options(AllReduceAlgo::kPacked, false)));
  EXPECT_FALSE(UsesApsSumScaling(options(AllReduceAlgo::kEmulate, true)));
}

// Hand-computed, e3m0 (values 0.25 ... 8, no subnormals), K = 4, so W = 4P: layer 0 gives 4 on
// every worker in chunk 0, and in every other chunk +0.25 on workers 0 and 1 and +-0.25
// alternating on the rest (sum 0.5); layer 1 is all zero. s = 3 - ceil(log2 4) = 1, so the
// contributions are 8 and 0.5 (exact). Chunk 0's sum 8W gets t = -ceil(log2 W) and rounds to
// e3m0 (exact where W is a power of two); every other chunk's sum 1 gets t = 3 -> 8, exactly 0.5
// after 2^-(1 + 3). One shift for the whole layer (chunk 0's) would flush those sums (1 * 2^-3 <
// 0.125), and so does the paper's scaling (s = 3 - ceil(log2 4W): the 0.25s become <= 2^-4).
// The all-zero layer has t = 0 and stays zero.
TEST(GradientAllReduceTest, SumScalingShiftsEachSegmentOfALayer) {
  const int p = test::MpiWorld()->size();
  const int r = test::MpiWorld()->rank();
  const int k = 4, workers = 4 * p;
  const GradientLayout layout = MakeLayout({size_t(512) * size_t(p), 256});
  for (ApsScaling scaling : {ApsScaling::kSum, ApsScaling::kPaper}) {
    SCOPED_TRACE(ApsScalingName(scaling));
    GradientAllReduceOptions o;
    o.algo = AllReduceAlgo::kPacked;
    o.format = "e3m0";
    o.aps = true;
    o.aps_scaling = scaling;
    auto created = GradientAllReducer::Create(test::MpiWorld(), o, layout, k);
    ASSERT_TRUE(created.ok()) << created.status().ToString();
    auto& red = *created.value();
    ASSERT_EQ(red.buckets().size(), 1u);
    const std::vector<size_t>& bounds = red.buckets()[0].chunk_bounds;
    const size_t n0 = layout.offsets[1];
    auto input = [&](int w, size_t i) -> float {
      if (i >= n0) return 0.0f;
      if (i < bounds[1]) return 4.0f;
      return w < 2 || w % 2 == 0 ? 0.25f : -0.25f;
    };
    std::vector<std::vector<float>> x(size_t(k), std::vector<float>(layout.total()));
    std::vector<float*> ptrs;
    for (int j = 0; j < k; ++j) {
      for (size_t i = 0; i < layout.total(); ++i) x[size_t(j)][i] = input(r * k + j, i);
      ptrs.push_back(x[size_t(j)].data());
    }
    std::vector<float> out(layout.total(), -1.0f);
    ASSERT_TRUE(red.Reduce(ptrs.data(), out.data(), 0).ok());
    const int s = red.last_stats()[0].shift;
    EXPECT_EQ(s, scaling == ApsScaling::kSum ? 1 : ExpectedShift(4.0f, workers, 3));
    EXPECT_EQ(red.last_stats()[1].shift, 0);
    size_t wrong_rest = 0, wrong_zero = 0, wrong_first = 0;
    const bool power_of_two = (workers & (workers - 1)) == 0;
    for (size_t i = 0; i < layout.total(); ++i) {
      if (i >= n0) {
        wrong_zero += Bits(out[i]) != 0u;
      } else if (i < bounds[1]) {
        // 4W to e3m0 (relative error <= 1/3); exact for W a power of two.
        const double e = 4.0 * workers;
        wrong_first += power_of_two ? out[i] != float(e) : std::fabs(out[i] - e) > e / 3;
      } else if (scaling == ApsScaling::kSum) {
        wrong_rest += out[i] != 0.5f;
      } else {
        wrong_rest += out[i] != 0.0f;  // the paper's shift flushes every 0.25
      }
    }
    EXPECT_EQ(wrong_first, 0u);
    EXPECT_EQ(wrong_rest, 0u);
    EXPECT_EQ(wrong_zero, 0u);
    if (scaling == ApsScaling::kPaper) {
      // Every contribution outside chunk 0 (the 0.25s) is flushed.
      const size_t first = std::min(bounds[1], n0);
      EXPECT_EQ(red.last_stats()[0].flushed, double(n0 - first) / double(n0));
    } else {
      EXPECT_EQ(red.last_stats()[0].flushed, 0.0);
    }
  }
}

// The outside study's failure: e3m0 at W >= 64 with the paper's APS flushes every contribution
// (max|g| * W at 8 leaves every |g| * 2^s <= 8 / 64, below half of e3m0's smallest value 0.25);
// the sum scaling keeps max|g| at 8 and flushes only the small tail of N(0, 1).
TEST(GradientAllReduceTest, SumScalingKeepsE3m0AliveAtW64) {
  const int p = test::MpiWorld()->size();
  const int r = test::MpiWorld()->rank();
  const int k = (64 + p - 1) / p;
  const GradientLayout layout = MakeLayout({3000, 700});
  for (ApsScaling scaling : {ApsScaling::kPaper, ApsScaling::kSum}) {
    SCOPED_TRACE(ApsScalingName(scaling));
    GradientAllReduceOptions o;
    o.algo = AllReduceAlgo::kPacked;
    o.format = "e3m0";
    o.aps = true;
    o.aps_scaling = scaling;
    auto red = GradientAllReducer::Create(test::MpiWorld(), o, layout, k);
    ASSERT_TRUE(red.ok()) << red.status().ToString();
    std::vector<std::vector<float>> x;
    std::vector<float*> ptrs;
    for (int j = 0; j < k; ++j) x.push_back(WorkerInput(layout, 64, r * k + j));
    for (auto& v : x) ptrs.push_back(v.data());
    ASSERT_TRUE(red.value()->Reduce(ptrs.data(), ptrs[0], 0, /*measure_error=*/true).ok());
    for (const LayerCommStats& st : red.value()->last_stats()) {
      SCOPED_TRACE(st.layer);
      if (scaling == ApsScaling::kPaper) {
        EXPECT_EQ(st.flushed, 1.0);
        EXPECT_EQ(st.rel_error, 1.0);
      } else {
        EXPECT_LT(st.flushed, 0.25);
        EXPECT_LT(st.rel_error, 0.5);
      }
    }
  }
}

// Hybrid precision: fp32, fixed float grids and scaled formats side by side in one plan (layers
// split across chunks and buckets), each bit for bit as the sequential reference in its own
// format, with each layer's own APS emax.
const std::map<std::string, std::string> kHybrid = {{"layer2", "fp32"},
                                                    {"layer3", "fp32"},
                                                    {"layer5", "e3m0"},
                                                    {"layer6", "int8"},
                                                    {"layer8", "mxfp4"}};

TEST(GradientAllReduceTest, HybridMatchesSequentialReferenceBitForBit) {
  const ApsScaling paper = ApsScaling::kPaper, sum = ApsScaling::kSum;
  for (AllReduceAlgo algo : {AllReduceAlgo::kEmulate, AllReduceAlgo::kPacked}) {
    for (bool aps : {false, true}) {
      for (int k : {1, 2}) {
        RunCase({algo, "e4m3", aps, false, Rounding::kNearest, paper, kHybrid}, k, kSizes,
                kSmallBucketMb, 21);
      }
    }
  }
  RunCase({AllReduceAlgo::kEmulate, "e4m3", true, true, Rounding::kStochastic, paper, kHybrid}, 2,
          kSizes, kSmallBucketMb, 23);
  RunCase({AllReduceAlgo::kPacked, "e5m2", true, false, Rounding::kStochastic, paper, kHybrid}, 3,
          kSizes, kSmallBucketMb, 25, /*spread=*/9);
  // packed's sum scaling in a hybrid plan: each quantised segment's own t, fp32 layers t = 0.
  for (int k : {1, 2}) {
    RunCase({AllReduceAlgo::kPacked, "e4m3", true, false, Rounding::kNearest, sum, kHybrid}, k,
            kSizes, kSmallBucketMb, 29);
  }
  RunCase({AllReduceAlgo::kPacked, "e3m0", true, false, Rounding::kStochastic, sum, kHybrid}, 3,
          kSizes, kSmallBucketMb, 31, /*spread=*/9);
  // A map that gives layers the global format changes nothing (the uniform fast path).
  RunCase({AllReduceAlgo::kPacked,
           "e4m3",
           true,
           false,
           Rounding::kNearest,
           paper,
           {{"layer3", "e4m3"}}},
          2, kSizes, kSmallBucketMb, 27);
}

// A layer given fp32 comes back exact (inputs whose float32 sum is exact) while a layer in e3m0
// next to it is quantised; APS shifts only the quantised one.
TEST(GradientAllReduceTest, HybridFp32LayerIsExactWhileOthersAreQuantised) {
  const int p = test::MpiWorld()->size();
  const int r = test::MpiWorld()->rank();
  const int k = 2, workers = p * k;
  const GradientLayout layout = MakeLayout({4096, 4096});
  // Integers below 2^11 times 2^-20 with many significant bits: e3m0 (one per binade) cannot
  // hold them, float32 sums of 8 of them are exact.
  auto value = [](int w, size_t i) {
    return std::ldexp(
        static_cast<float>(static_cast<int>((i * 7919 + size_t(w) * 104729) % 2001) - 1000), -20);
  };
  for (AllReduceAlgo algo : {AllReduceAlgo::kEmulate, AllReduceAlgo::kPacked}) {
    SCOPED_TRACE(AllReduceAlgoName(algo));
    GradientAllReduceOptions o;
    o.algo = algo;
    o.format = "e3m0";
    o.aps = true;
    o.aps_scaling = ApsScaling::kPaper;  // the shift checked below is the paper's
    o.layer_formats = {{"layer0", "fp32"}};
    auto red = GradientAllReducer::Create(test::MpiWorld(), o, layout, k);
    ASSERT_TRUE(red.ok()) << red.status().ToString();
    std::vector<std::vector<float>> in(size_t(k), std::vector<float>(layout.total()));
    std::vector<float*> ptrs;
    for (int j = 0; j < k; ++j) {
      for (size_t i = 0; i < layout.total(); ++i) in[size_t(j)][i] = value(r * k + j, i);
      ptrs.push_back(in[size_t(j)].data());
    }
    ASSERT_TRUE(red.value()->Reduce(ptrs.data(), ptrs[0], 3, /*measure_error=*/true).ok());
    size_t wrong_fp32 = 0, exact_e3m0 = 0;
    for (size_t i = 0; i < layout.total(); ++i) {
      double exact = 0;
      for (int w = 0; w < workers; ++w) exact += value(w, i);
      const bool same = static_cast<double>(ptrs[0][i]) == exact;
      if (i < 4096) wrong_fp32 += !same;
      if (i >= 4096) exact_e3m0 += same;
    }
    EXPECT_EQ(wrong_fp32, 0u);
    EXPECT_LT(exact_e3m0, 4096u / 2);
    const auto& st = red.value()->last_stats();
    EXPECT_EQ(st[0].format, "fp32");
    EXPECT_EQ(st[1].format, "e3m0");
    EXPECT_EQ(st[0].shift, 0);
    EXPECT_EQ(st[1].shift, ExpectedShift(st[1].max_abs, workers, EmaxOf("e3m0")));
    EXPECT_NE(st[1].shift, 0);
    EXPECT_EQ(st[0].rel_error, 0.0);
    EXPECT_EQ(st[0].flushed, 0.0);
    EXPECT_EQ(st[0].saturated, 0.0);
    EXPECT_GT(st[1].rel_error, 0.01);
  }
}

// packed moves each segment in its own format: the bytes sent are those of per-format segment
// sizes (cpd::PackedSize, fp32 4 bytes an element), slots padded to the longest chunk's and to
// 64 bytes, as for the all-to-all (K slots per block) and the all-gather (one slot).
TEST(GradientAllReduceTest, HybridBytesMatchPerFormatSizes) {
  const int p = test::MpiWorld()->size();
  if (p == 1) GTEST_SKIP() << "nothing is sent at world size 1";
  const GradientLayout layout = MakeLayout({3000, 2000, 1500, 700});
  const std::map<std::string, std::string> formats = {
      {"layer0", "fp32"}, {"layer2", "int8"}, {"layer3", "e3m0"}};
  for (int k : {1, 2}) {
    GradientAllReduceOptions o;
    o.algo = AllReduceAlgo::kPacked;
    o.format = "e4m3";
    o.layer_formats = formats;
    o.bucket_mb = 2500.0 * 4 / (1 << 20);  // several buckets, layer 0 split
    auto red = GradientAllReducer::Create(test::MpiWorld(), o, layout, k);
    ASSERT_TRUE(red.ok()) << red.status().ToString();
    uint64_t expected = 0;
    for (const GradientBucket& b : red.value()->buckets()) {
      size_t slot = 0;
      for (int d = 0; d < p; ++d) {
        size_t bytes = 0;
        for (size_t l = 0; l < layout.layers(); ++l) {
          const size_t s0 = std::max(b.chunk_bounds[size_t(d)], layout.offsets[l]);
          const size_t s1 = std::min(b.chunk_bounds[size_t(d) + 1], layout.offsets[l + 1]);
          if (s1 <= s0) continue;
          const auto it = formats.find(layout.layer_names[l]);
          const Format f = Format::Parse(it == formats.end() ? "e4m3" : it->second).value();
          bytes += PackedSize(f, s1 - s0, 1);
        }
        slot = std::max(slot, bytes);
      }
      slot = (slot + 63) / 64 * 64;
      expected += uint64_t(p - 1) * (uint64_t(k) * slot + slot);
    }
    std::vector<std::vector<float>> in(static_cast<size_t>(k));
    std::vector<float*> ptrs;
    for (int j = 0; j < k; ++j) {
      in[size_t(j)] = WorkerInput(layout, 5, test::MpiWorld()->rank() * k + j);
      ptrs.push_back(in[size_t(j)].data());
    }
    ASSERT_TRUE(red.value()->Reduce(ptrs.data(), ptrs[0], 0).ok());
    EXPECT_EQ(red.value()->last_bytes_sent(), expected) << "K = " << k;
  }
}

// APS in a hybrid plan: each layer's shift from its own format's emax; fp32 layers unshifted.
TEST(GradientAllReduceTest, HybridApsUsesEachLayersEmax) {
  const int p = test::MpiWorld()->size();
  const int r = test::MpiWorld()->rank();
  const int k = 2, workers = p * k;
  const std::vector<std::string> specs = {"e4m3", "e3m0", "int8", "fp32", "e5m2"};
  const std::vector<float> maxima = {3.0f, 2.0e-3f, 0.75f, 5e4f, 1e-30f};
  const GradientLayout layout = MakeLayout(std::vector<size_t>(specs.size(), 9));
  const std::pair<AllReduceAlgo, ApsScaling> kRuns[] = {
      {AllReduceAlgo::kEmulate, ApsScaling::kPaper},
      {AllReduceAlgo::kPacked, ApsScaling::kPaper},
      {AllReduceAlgo::kPacked, ApsScaling::kSum}};
  for (const auto& [algo, scaling] : kRuns) {
    SCOPED_TRACE(std::string(AllReduceAlgoName(algo)) + " " + ApsScalingName(scaling));
    GradientAllReduceOptions o;
    o.algo = algo;
    o.format = "e4m3";
    o.aps = true;
    o.aps_scaling = scaling;
    for (size_t l = 1; l < specs.size(); ++l) o.layer_formats[layout.layer_names[l]] = specs[l];
    auto red = GradientAllReducer::Create(test::MpiWorld(), o, layout, k);
    ASSERT_TRUE(red.ok()) << red.status().ToString();
    std::vector<std::vector<float>> in(size_t(k), std::vector<float>(layout.total()));
    std::vector<float*> ptrs;
    for (int j = 0; j < k; ++j) {
      const int w = r * k + j;
      for (size_t l = 0; l < maxima.size(); ++l) {
        for (size_t i = 0; i < 9; ++i) {
          const float v = maxima[l] * (w == workers - 1 && i == 4 ? 1.0f : 0.25f);
          in[size_t(j)][layout.offsets[l] + i] = (i % 2 ? -v : v);
        }
      }
      ptrs.push_back(in[size_t(j)].data());
    }
    ASSERT_TRUE(red.value()->Reduce(ptrs.data(), ptrs[0], 0).ok());
    for (size_t l = 0; l < specs.size(); ++l) {
      const LayerCommStats& st = red.value()->last_stats()[l];
      EXPECT_EQ(st.format, specs[l]);
      EXPECT_EQ(st.max_abs, maxima[l]) << "layer " << l;
      const int want = specs[l] == "fp32" ? 0
                       : scaling == ApsScaling::kSum
                           ? ExpectedSumScalingShift(maxima[l], workers, EmaxOf(specs[l]))
                           : ExpectedShift(maxima[l], workers, EmaxOf(specs[l]));
      EXPECT_EQ(st.shift, want) << "layer " << l;
    }
    // The fp32 layer's sum is exact: 0.25 * max on W - 1 workers plus max once, per element.
    const float fp32_sum = ptrs[0][layout.offsets[3] + 4];
    EXPECT_EQ(fp32_sum, maxima[3] * (0.25f * float(workers - 1) + 1.0f));
  }
}

// packed against the exact (double) sum: each of the W contributions and the one re-quantised
// sum are off by at most half a step of the format (relative 2^-(M+1) for normal values, half
// the smallest subnormal below), plus float32 rounding of the sum.
TEST(GradientAllReduceTest, PackedIsWithinTheFormatsErrorBound) {
  const int p = test::MpiWorld()->size();
  const int r = test::MpiWorld()->rank();
  for (const char* f : {"e4m3", "e5m2", "fp16", "bf16"}) {
    for (int k : {1, 3}) {
      for (ApsScaling scaling : {ApsScaling::kPaper, ApsScaling::kSum}) {
        SCOPED_TRACE(std::string(f) + " K=" + std::to_string(k) + " " + ApsScalingName(scaling));
        const int workers = p * k;
        const GradientLayout layout = MakeLayout({4097, 33, 1});
        GradientAllReduceOptions opts;
        opts.algo = AllReduceAlgo::kPacked;
        opts.format = f;
        opts.aps = true;
        opts.aps_scaling = scaling;
        opts.bucket_mb = kSmallBucketMb;
        auto red = GradientAllReducer::Create(test::MpiWorld(), opts, layout, k);
        ASSERT_TRUE(red.ok());
        std::vector<std::vector<float>> x;
        for (int w = 0; w < workers; ++w) x.push_back(WorkerInput(layout, 3, w));
        std::vector<std::vector<float>> local;
        std::vector<float*> ptrs;
        for (int j = 0; j < k; ++j) local.push_back(x[static_cast<size_t>(r * k + j)]);
        for (auto& v : local) ptrs.push_back(v.data());
        std::vector<float> out(layout.total());
        ASSERT_TRUE(red.value()->Reduce(ptrs.data(), out.data(), 0).ok());
        const Format fmt = Format::Parse(f).value();
        const double u = std::ldexp(1.0, -(fmt.grid().mbits + 1));
        size_t wrong = 0;
        for (size_t l = 0; l < layout.layers(); ++l) {
          const int sh = red.value()->last_stats()[l].shift;
          const double half_sub = std::ldexp(1.0, fmt.grid().emin - fmt.grid().mbits - 1 - sh);
          for (size_t i = layout.offsets[l]; i < layout.offsets[l + 1]; ++i) {
            double exact = 0.0, abs_sum = 0.0;
            for (const auto& xw : x) {
              exact += xw[i];
              abs_sum += std::fabs(xw[i]);
            }
            const double contrib = u * abs_sum + workers * half_sub;
            const double bound = contrib + u * (std::fabs(exact) + contrib) + half_sub +
                                 4.0 * workers * std::ldexp(abs_sum, -24);
            wrong += std::fabs(out[i] - exact) > bound;
          }
        }
        EXPECT_EQ(wrong, 0u);
        EXPECT_TRUE(SameOnAllRanks(Hash(out)));
      }
    }
  }
}

TEST(GradientAllReduceTest, ApsShiftFollowsTheFormula) {
  const int p = test::MpiWorld()->size();
  const int r = test::MpiWorld()->rank();
  const int k = 2;
  const int workers = p * k;
  // Per layer, the largest |g| sits on the last worker; the others hold smaller values.
  const std::vector<float> maxima = {3.0f, 2.0f, 0.0f, 1e-30f, 1e-40f, 5e4f, 0.75f};
  const GradientLayout layout = MakeLayout(std::vector<size_t>(maxima.size(), 9));
  for (const char* f : {"e4m3", "e5m2", "e3m0", "int8", "mxfp4"}) {
    for (ApsScaling scaling : {ApsScaling::kPaper, ApsScaling::kSum}) {
      SCOPED_TRACE(std::string(f) + " " + ApsScalingName(scaling));
      GradientAllReduceOptions opts;
      opts.algo = AllReduceAlgo::kPacked;
      opts.format = f;
      opts.aps = true;
      opts.aps_scaling = scaling;
      auto red = GradientAllReducer::Create(test::MpiWorld(), opts, layout, k);
      ASSERT_TRUE(red.ok()) << red.status().ToString();
      std::vector<std::vector<float>> in(static_cast<size_t>(k),
                                         std::vector<float>(layout.total()));
      std::vector<float*> ptrs;
      for (int j = 0; j < k; ++j) {
        const int w = r * k + j;
        for (size_t l = 0; l < maxima.size(); ++l) {
          for (size_t i = 0; i < 9; ++i) {
            const float v = maxima[l] * (w == workers - 1 && i == 4 ? 1.0f : 0.25f);
            in[static_cast<size_t>(j)][layout.offsets[l] + i] = (i % 2 ? -v : v);
          }
        }
        ptrs.push_back(in[static_cast<size_t>(j)].data());
      }
      ASSERT_TRUE(red.value()->Reduce(ptrs.data(), ptrs[0], 0).ok());
      for (size_t l = 0; l < maxima.size(); ++l) {
        const LayerCommStats& st = red.value()->last_stats()[l];
        EXPECT_EQ(st.max_abs, maxima[l]) << "layer " << l;
        if (scaling == ApsScaling::kPaper) {
          EXPECT_EQ(st.shift, ExpectedShift(maxima[l], workers, EmaxOf(f))) << "layer " << l;
          EXPECT_EQ(ApsShift(maxima[l], workers, EmaxOf(f)), st.shift);
        } else {
          EXPECT_EQ(st.shift, ExpectedSumScalingShift(maxima[l], workers, EmaxOf(f)))
              << "layer " << l;
          EXPECT_EQ(internal::SumContributionShift(maxima[l], workers, EmaxOf(f)), st.shift);
        }
      }
      EXPECT_EQ(ApsEmax(Format::Parse(f).value()), EmaxOf(f));
    }
  }
  // The sum scaling's shifts by hand: e4m3, max 3 -> 6 whatever W; bf16 (emax 127) at its top,
  // W = 4: capped at 127 - ceil(log2(2^127 * 4)) = -2 so that the float32 sum stays finite; a
  // segment's t: max|sum| 100 -> 8 - 7 = 1, zero -> 0, clamped so that |s + t| <= 126.
  EXPECT_EQ(internal::SumContributionShift(3.0f, 64, 8), 6);
  EXPECT_EQ(internal::SumContributionShift(std::ldexp(1.0f, 127), 4, 127), -2);
  EXPECT_EQ(internal::SumShift(Bits(100.0f), 6, 8), 1);
  EXPECT_EQ(internal::SumShift(Bits(-100.0f), 6, 8), 1);
  EXPECT_EQ(internal::SumShift(0u, 6, 8), 0);
  EXPECT_EQ(internal::SumShift(Bits(1e-30f), 100, 8), 26);
  EXPECT_EQ(internal::SumShift(Bits(3e38f), -120, 3), -6);
  // Hand-computed values: e4m3 (emax 8), W = 1: max 3 -> ceil(log2 3) = 2 -> 6; a power of two
  // needs no rounding up: max 2, W = 2 -> log2 4 = 2 -> 6; zero -> 0; clamped at +-126.
  EXPECT_EQ(ApsShift(3.0f, 1, 8), 6);
  EXPECT_EQ(ApsShift(2.0f, 2, 8), 6);
  EXPECT_EQ(ApsShift(2.0f, 3, 8), 5);
  EXPECT_EQ(ApsShift(0.0f, 4, 8), 0);
  EXPECT_EQ(ApsShift(448.0f, 1, 8), -1);
  EXPECT_EQ(ApsShift(1e-40f, 1, 8), 126);
  EXPECT_EQ(ApsShift(3e38f, 64, 3), -126);
  EXPECT_EQ(ApsShift(std::numeric_limits<float>::infinity(), 1, 8), 0);
}

// The failure APS exists for: e4m3 (normal range 2^-6..448, subnormals to 2^-9) without a shift
// flushes a layer of tiny gradients to zero and saturates a layer of huge ones; with APS both
// come through with e4m3's usual relative error.
TEST(GradientAllReduceTest, ApsFixesUnderflowAndOverflowOfE4m3) {
  const int p = test::MpiWorld()->size();
  const int r = test::MpiWorld()->rank();
  const GradientLayout layout = MakeLayout({4000, 4000});
  for (AllReduceAlgo algo : {AllReduceAlgo::kEmulate, AllReduceAlgo::kPacked}) {
    for (bool aps : {false, true}) {
      SCOPED_TRACE(std::string(AllReduceAlgoName(algo)) + (aps ? " aps" : " no aps"));
      GradientAllReduceOptions opts;
      opts.algo = algo;
      opts.format = "e4m3";
      opts.aps = aps;
      auto red = GradientAllReducer::Create(test::MpiWorld(), opts, layout, 1);
      ASSERT_TRUE(red.ok());
      std::vector<float> x = WorkerInput(layout, 99, r);
      for (size_t i = 0; i < 4000; ++i) x[i] *= 1e-5f;    // |g| ~ 1e-5 << 2^-9
      for (size_t i = 4000; i < 8000; ++i) x[i] *= 4e3f;  // layer 1 was N(0, 1/64): now ~500
      float* ptrs[1] = {x.data()};
      ASSERT_TRUE(red.value()->Reduce(ptrs, x.data(), 0, /*measure_error=*/true).ok());
      const auto& st = red.value()->last_stats();
      if (!aps) {
        EXPECT_GT(st[0].flushed, 0.99) << "tiny layer";
        EXPECT_GT(st[0].rel_error, 0.99);
        EXPECT_GT(st[1].saturated, 0.1) << "huge layer";
        EXPECT_GT(st[1].rel_error, 0.2);
      } else {
        for (int l = 0; l < 2; ++l) {
          EXPECT_LT(st[static_cast<size_t>(l)].flushed, 0.01) << "layer " << l;
          EXPECT_EQ(st[static_cast<size_t>(l)].saturated, 0.0) << "layer " << l;
          EXPECT_LT(st[static_cast<size_t>(l)].rel_error, 0.15) << "layer " << l;
        }
        EXPECT_GT(st[0].shift, 0);
        EXPECT_LT(st[1].shift, 0);
      }
      (void)p;
    }
  }
}

TEST(GradientAllReduceTest, NonFiniteOnOneRankIsFlaggedEverywhere) {
  const int p = test::MpiWorld()->size();
  const int r = test::MpiWorld()->rank();
  const GradientLayout layout = MakeLayout({1000, 300});
  for (AllReduceAlgo algo :
       {AllReduceAlgo::kFp32, AllReduceAlgo::kEmulate, AllReduceAlgo::kPacked}) {
    for (float bad :
         {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
      SCOPED_TRACE(AllReduceAlgoName(algo));
      GradientAllReduceOptions opts;
      opts.algo = algo;
      opts.aps = true;
      opts.bucket_mb = 0.001;
      auto red = GradientAllReducer::Create(test::MpiWorld(), opts, layout, 2);
      ASSERT_TRUE(red.ok());
      std::vector<float> a = WorkerInput(layout, 1, 2 * r), b = WorkerInput(layout, 1, 2 * r + 1);
      if (r == p - 1) b[1100] = bad;  // the last rank's second replica, second layer
      float* ptrs[2] = {a.data(), b.data()};
      std::vector<float> out(layout.total(), 42.0f);
      ASSERT_TRUE(red.value()->Reduce(ptrs, out.data(), 0).ok());
      EXPECT_TRUE(red.value()->last_nonfinite());
      EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == 42.0f; }));
      // The next step is clean again.
      // (copied into the same buffers: ptrs still point at them)
      const std::vector<float> a2 = WorkerInput(layout, 1, 2 * r),
                               b2 = WorkerInput(layout, 1, 2 * r + 1);
      std::copy(a2.begin(), a2.end(), a.begin());
      std::copy(b2.begin(), b2.end(), b.begin());
      ASSERT_TRUE(red.value()->Reduce(ptrs, out.data(), 1).ok());
      EXPECT_FALSE(red.value()->last_nonfinite());
      EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return std::isfinite(v); }));
    }
  }
}

TEST(GradientAllReduceTest, BucketsCoverTheBufferAndKeepLayersWhole) {
  const int p = test::MpiWorld()->size();
  const GradientLayout layout = MakeLayout(kSizes);
  GradientAllReduceOptions opts;
  opts.algo = AllReduceAlgo::kPacked;
  opts.format = "mxfp4";
  opts.bucket_mb = kSmallBucketMb;
  auto red = GradientAllReducer::Create(test::MpiWorld(), opts, layout, 1);
  ASSERT_TRUE(red.ok());
  const auto& buckets = red.value()->buckets();
  ASSERT_FALSE(buckets.empty());
  size_t pos = 0;
  for (const auto& b : buckets) {
    EXPECT_EQ(b.begin, pos);
    EXPECT_GT(b.end, b.begin);
    EXPECT_LE(b.end - b.begin, 1048u);
    ASSERT_EQ(b.chunk_bounds.size(), static_cast<size_t>(p) + 1);
    EXPECT_EQ(b.chunk_bounds.front(), b.begin);
    EXPECT_EQ(b.chunk_bounds.back(), b.end);
    EXPECT_TRUE(std::is_sorted(b.chunk_bounds.begin(), b.chunk_bounds.end()));
    pos = b.end;
  }
  EXPECT_EQ(pos, layout.total());
  for (size_t l = 0; l < layout.layers(); ++l) {
    const size_t lb = layout.offsets[l], le = layout.offsets[l + 1];
    if (le - lb == 0 || le - lb > 1048) continue;
    // A layer that fits a bucket lies in one bucket, and chunk boundaries inside it fall on
    // multiples of 64 from its start.
    int holders = 0;
    for (const auto& b : buckets) {
      if (b.begin < le && lb < b.end) {
        ++holders;
        for (size_t c : b.chunk_bounds) {
          if (c > lb && c < le) {
            EXPECT_EQ((c - lb) % 64, 0u) << "layer " << l;
          }
        }
      }
    }
    EXPECT_EQ(holders, 1) << "layer " << l;
  }
  // The 3000-element layer is split into buckets at multiples of 64 from its start.
  for (const auto& b : buckets) {
    if (b.begin > layout.offsets[5] && b.begin < layout.offsets[6]) {
      EXPECT_EQ((b.begin - layout.offsets[5]) % 64, 0u);
    }
  }
}

TEST(GradientAllReduceTest, PackedSendsFewerBytesThanFp32) {
  const int p = test::MpiWorld()->size();
  if (p == 1) GTEST_SKIP() << "nothing is sent at world size 1";
  const GradientLayout layout = MakeLayout({1 << 16});
  const int r = test::MpiWorld()->rank();
  uint64_t bytes[5] = {}, codes[5] = {};
  const char* formats[5] = {"e4m3", "e4m3", "e3m0", "e4m3", "e3m0"};
  const AllReduceAlgo algos[5] = {AllReduceAlgo::kFp32, AllReduceAlgo::kPacked,
                                  AllReduceAlgo::kPacked, AllReduceAlgo::kPacked,
                                  AllReduceAlgo::kPacked};
  const int pipeline_kb[5] = {256, 256, 256, 0, 0};
  for (int j = 0; j < 5; ++j) {
    GradientAllReduceOptions opts;
    opts.algo = algos[j];
    opts.format = formats[j];
    opts.pipeline_kb = pipeline_kb[j];
    auto red = GradientAllReducer::Create(test::MpiWorld(), opts, layout, 1);
    ASSERT_TRUE(red.ok());
    std::vector<float> x = WorkerInput(layout, 2, r);
    float* ptrs[1] = {x.data()};
    ASSERT_TRUE(red.value()->Reduce(ptrs, x.data(), 0).ok());
    bytes[j] = red.value()->last_bytes_sent();
    // The codes of one contribution to every other rank's chunk (all-to-all) and of this rank's
    // reduced chunk to every other rank (all-gather).
    const int bits = j == 0 ? 32 : Format::Parse(formats[j]).value().bits();
    for (const GradientBucket& b : red.value()->buckets()) {
      for (int d = 0; d < p; ++d) {
        const uint64_t len = b.chunk_bounds[size_t(d) + 1] - b.chunk_bounds[size_t(d)];
        const uint64_t chunk_codes = (len * uint64_t(bits) + 7) / 8;
        if (d != r) codes[j] += chunk_codes;
        if (d == r) codes[j] += uint64_t(p - 1) * chunk_codes;
      }
    }
  }
  // fp32: 2(P-1)/P * 4 bytes per element. Pipelined packed: exactly the codes (e4m3 about a
  // quarter of fp32's bytes, e3m0 an eighth); the sequential schedule sends padded slots.
  const double n = 1 << 16;
  EXPECT_EQ(bytes[0], static_cast<uint64_t>(2.0 * (p - 1) / p * 4 * n));
  EXPECT_EQ(bytes[1], codes[1]);
  EXPECT_EQ(bytes[2], codes[2]);
  EXPECT_LT(bytes[1], bytes[0] / 4 + 256u * p);
  EXPECT_LT(bytes[2], bytes[0] / 8 + 256u * p);
  EXPECT_GE(bytes[3], codes[3]);
  EXPECT_LT(bytes[3], codes[3] + 2 * 64u * p);
  EXPECT_GE(bytes[4], codes[4]);
  EXPECT_LT(bytes[4], codes[4] + 2 * 64u * p);
}

// A world of P > 1 copies of this process (tests/comm/mirror_communicator.h: no nonblocking
// exchange) with default options, pipelining included: the reducer must pick a schedule the
// communicator can run. Rank 0 reduces chunk 0 of every bucket from the P copies, which must sum
// the P * K contributions exactly (small integers times a power of two per layer, exact in every
// format here and in every partial sum); the mirror's all-gather hands it chunk 0 again for the
// other ranks' chunks, so only fp32's all-reduce gives the whole buffer.
TEST(GradientAllReduceTest, MirroredWorldWithDefaultOptionsSumsEveryCopy) {
  const GradientLayout layout = MakeLayout({0, 1, 7, 1001, 64, 3000, 129, 513});
  struct Case {
    AllReduceAlgo algo;
    const char* format;
    bool aps;
  };
  const Case cases[] = {
      {AllReduceAlgo::kFp32, "e4m3", false},    {AllReduceAlgo::kPacked, "e4m3", false},
      {AllReduceAlgo::kPacked, "e4m3", true},   {AllReduceAlgo::kPacked, "e5m2", true},
      {AllReduceAlgo::kPacked, "bf16", false},  {AllReduceAlgo::kPacked, "mxfp8", true},
      {AllReduceAlgo::kEmulate, "e4m3", false}, {AllReduceAlgo::kEmulate, "e4m3", true},
      {AllReduceAlgo::kEmulate, "bf16", true}};
  for (int p : {2, 3}) {
    test::MirrorCommunicator mirror(p);
    for (int k : {1, 2}) {
      for (const Case& c : cases) {
        GradientAllReduceOptions opts;  // default bucket_mb and pipeline_kb
        opts.algo = c.algo;
        opts.format = c.format;
        opts.aps = c.aps;
        ASSERT_GT(opts.pipeline_kb, 0);
        const std::string what = std::string(AllReduceAlgoName(c.algo)) + "/" + c.format +
                                 (c.aps ? "/aps" : "") + " P=" + std::to_string(p) +
                                 " K=" + std::to_string(k);
        auto red = GradientAllReducer::Create(&mirror, opts, layout, k);
        ASSERT_TRUE(red.ok()) << what << ": " << red.status().ToString();
        std::vector<std::vector<float>> in(static_cast<size_t>(k),
                                           std::vector<float>(layout.total()));
        std::vector<float> want(layout.total(), 0.0f);
        std::vector<float*> ptrs;
        for (int j = 0; j < k; ++j) {
          for (size_t l = 0; l < layout.layers(); ++l) {
            for (size_t i = layout.offsets[l]; i < layout.offsets[l + 1]; ++i) {
              const float v = std::ldexp(float(int((i * 7 + size_t(j) * 5) % 5) - 2), int(l) - 3);
              in[size_t(j)][i] = v;
              want[i] += float(p) * v;
            }
          }
          ptrs.push_back(in[size_t(j)].data());
        }
        std::vector<float> out(layout.total(), -1.0f);
        const Status st = red.value()->Reduce(ptrs.data(), out.data(), 5);
        ASSERT_TRUE(st.ok()) << what << ": " << st.ToString();
        size_t wrong = 0, checked = 0;
        for (const GradientBucket& b : red.value()->buckets()) {
          const bool whole = c.algo == AllReduceAlgo::kFp32;
          for (size_t i = b.begin; i < (whole ? b.end : b.chunk_bounds[1]); ++i, ++checked) {
            wrong += Bits(out[i]) != Bits(want[i] + 0.0f);
          }
        }
        EXPECT_EQ(wrong, 0u) << what << ", of " << checked;
        EXPECT_GT(checked, layout.total() / size_t(p) / 2) << what;
        for (const LayerCommStats& ls : red.value()->last_stats()) {
          EXPECT_EQ(ls.flushed, 0.0) << what << " " << ls.layer;
          EXPECT_EQ(ls.saturated, 0.0) << what << " " << ls.layer;
        }
        EXPECT_GT(red.value()->last_bytes_sent(), 0u) << what;
      }
    }
  }
}

TEST(GradientAllReduceTest, BadOptionsGiveClearStatus) {
  const GradientLayout layout = MakeLayout({10, 20});
  auto expect_invalid = [&](const GradientAllReduceOptions& o, const GradientLayout& lay, int k,
                            const std::string& needle) {
    auto red = GradientAllReducer::Create(test::MpiWorld(), o, lay, k);
    ASSERT_FALSE(red.ok()) << needle;
    EXPECT_EQ(red.status().code(), Status::Code::kInvalidArgument);
    EXPECT_NE(red.status().message().find(needle), std::string::npos) << red.status().ToString();
  };
  auto algo = ParseAllReduceAlgo("ring");
  ASSERT_FALSE(algo.ok());
  EXPECT_NE(algo.status().message().find("fp32, emulate, packed"), std::string::npos);
  EXPECT_EQ(ParseAllReduceAlgo("packed").value(), AllReduceAlgo::kPacked);

  GradientAllReduceOptions o;
  o.algo = AllReduceAlgo::kPacked;
  o.format = "e9m3";
  expect_invalid(o, layout, 1, "e9m3");
  o.format = "e4m3";
  o.bucket_mb = 0;
  expect_invalid(o, layout, 1, "--bucket-mb 0 is not accepted");
  o.bucket_mb = -1;
  expect_invalid(o, layout, 1, "--bucket-mb -1 is not accepted");
  o.bucket_mb = std::numeric_limits<double>::quiet_NaN();
  expect_invalid(o, layout, 1, "--bucket-mb nan is not accepted");
  o.bucket_mb = 1e30;  // bounded before a bucket is allocated
  expect_invalid(o, layout, 1, "--bucket-mb 1e+30 is not accepted");
  o.bucket_mb = 25;
  o.pipeline_kb = -1;
  expect_invalid(o, layout, 1, "--pipeline-kb -1 is not accepted");
  o.pipeline_kb = kMaxPipelineKb + 1;
  expect_invalid(o, layout, 1, "is not accepted: 0 (sequential) or 1..1048576");
  o.pipeline_kb = 256;
  o.kahan = true;
  expect_invalid(o, layout, 1, "kahan");
  o.kahan = false;
  o.algo = AllReduceAlgo::kEmulate;
  o.aps_scaling = ApsScaling::kSum;
  expect_invalid(o, layout, 1, "aps_scaling sum applies to all-reduce packed only");
  o.aps_scaling = ApsScaling::kPaper;
  EXPECT_TRUE(GradientAllReducer::Create(test::MpiWorld(), o, layout, 1).ok());
  o.algo = AllReduceAlgo::kPacked;
  o.aps_scaling = ApsScaling::kAuto;
  auto scaling = ParseApsScaling("headroom");
  ASSERT_FALSE(scaling.ok());
  EXPECT_NE(scaling.status().message().find("auto, paper, sum"), std::string::npos);
  EXPECT_EQ(ParseApsScaling("sum").value(), ApsScaling::kSum);
  EXPECT_EQ(ParseApsScaling("paper").value(), ApsScaling::kPaper);
  EXPECT_EQ(std::string(ApsScalingName(ApsScaling::kAuto)), "auto");
  o.threads = -2;
  expect_invalid(o, layout, 1, "threads");
  o.threads = 0;
  expect_invalid(o, layout, 0, "local_replicas");
  GradientLayout bad = layout;
  bad.offsets.pop_back();
  expect_invalid(o, bad, 1, "offsets");
  bad = layout;
  bad.offsets[0] = 1;
  expect_invalid(o, bad, 1, "offsets[0]");
  bad = layout;
  bad.offsets[1] = 40;
  expect_invalid(o, bad, 1, "decrease");
  // fp32 ignores the format.
  GradientAllReduceOptions f;
  f.format = "nonsense";
  EXPECT_TRUE(GradientAllReducer::Create(test::MpiWorld(), f, layout, 1).ok());
  // Hybrid precision: a layer the layout does not have, a spec that does not parse, the fp32
  // algorithm.
  o.layer_formats = {{"layer9", "fp32"}};
  expect_invalid(o, layout, 1, "'layer9'");
  o.layer_formats = {{"layer1", "e9m9"}};
  expect_invalid(o, layout, 1, "e9m9");
  o.layer_formats = {{"layer1", "fp32"}};
  f.layer_formats = o.layer_formats;
  expect_invalid(f, layout, 1, "emulate and packed");
  o.layer_formats.clear();
  auto none = GradientAllReducer::Create(nullptr, GradientAllReduceOptions{}, layout, 1);
  EXPECT_EQ(none.status().code(), Status::Code::kInvalidArgument);
}

// Gradients in device memory need a CUDA build (tests/comm/gradient_allreduce_cuda_test.cc tests
// them); without one they are refused, naming what is missing.
TEST(GradientAllReduceTest, DeviceGradientsNeedACudaBuild) {
  EXPECT_EQ(DeviceGradientsSupported(), bool(CPD_WITH_CUDA));
  if (CPD_WITH_CUDA) GTEST_SKIP() << "a CUDA build: gradient_allreduce_cuda_test covers them";
  const GradientLayout layout = MakeLayout({10, 20});
  GradientAllReduceOptions o;
  o.gradients = MemorySpace::kDevice;
  o.algo = AllReduceAlgo::kPacked;
  auto red = GradientAllReducer::Create(test::MpiWorld(), o, layout, 1);
  ASSERT_FALSE(red.ok());
  EXPECT_EQ(red.status().code(), Status::Code::kInvalidArgument);
  EXPECT_NE(red.status().message().find("CPD_WITH_CUDA"), std::string::npos)
      << red.status().ToString();
}

TEST(GradientAllReduceTest, EmptyLayoutAndSelfCommunicator) {
  // Collective on every rank: an empty buffer still runs the per-step collectives.
  GradientAllReduceOptions o;
  o.algo = AllReduceAlgo::kEmulate;
  auto red = GradientAllReducer::Create(test::MpiWorld(), o, MakeLayout({0, 0}), 1);
  ASSERT_TRUE(red.ok());
  ASSERT_TRUE(red.value()->Reduce(nullptr, nullptr, 0).ok());
  EXPECT_FALSE(red.value()->last_nonfinite());
  EXPECT_EQ(red.value()->last_stats().size(), 2u);
  EXPECT_TRUE(red.value()->buckets().empty());

  // World size 1 through SelfCommunicator: K = 3 workers, emulate e4m3 with APS.
  SelfCommunicator self;
  const GradientLayout layout = MakeLayout({33, 5});
  o.aps = true;
  o.format = "e4m3";
  auto one = GradientAllReducer::Create(&self, o, layout, 3);
  ASSERT_TRUE(one.ok());
  std::vector<std::vector<float>> x;
  for (int w = 0; w < 3; ++w) x.push_back(WorkerInput(layout, 4, w));
  std::vector<int> shifts;
  const std::vector<float> expected =
      Reference({AllReduceAlgo::kEmulate, "e4m3", true, false, Rounding::kNearest}, layout,
                one.value()->buckets(), x, 0, 5, &shifts);
  std::vector<float*> ptrs = {x[0].data(), x[1].data(), x[2].data()};
  std::vector<float> out(layout.total());
  ASSERT_TRUE(one.value()->Reduce(ptrs.data(), out.data(), 5).ok());
  for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(Bits(out[i]), Bits(expected[i])) << i;
}

}  // namespace
}  // namespace cpd::comm
