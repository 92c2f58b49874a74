// QuantizeCuda / QuantizeHysteresisCuda against the CPU path (cpd::Quantize,
// cpd::QuantizeHysteresis): outputs bit for bit (NaN by NaN-ness), statistics counts exactly,
// the double sums to a relative 1e-9. Every test skips when no CUDA device is present.
#include "cpd/quantize_cuda.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cpd/format.h"
#include "cpd/quantize.h"
#include "tests/cpd/format_test_util.h"

namespace {

using cpd::Format;
using cpd::QuantizeOptions;
using cpd::QuantStats;
using cpd::Rounding;

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A device buffer of n floats (plus `pad` spare floats in front, for misaligned views).
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    EXPECT_EQ(cudaMalloc(&ptr_, (n + 4) * sizeof(float)), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  // A view starting `offset` floats in (0..3).
  float* at(size_t offset = 0) const { return static_cast<float*>(ptr_) + offset; }
  void Upload(const std::vector<float>& h, size_t offset = 0) const {
    ASSERT_LE(h.size() + offset, n_ + 4);
    if (h.empty()) return;
    ASSERT_EQ(cudaMemcpy(at(offset), h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  std::vector<float> Download(size_t count, size_t offset = 0) const {
    std::vector<float> h(count);
    if (count == 0) return h;
    EXPECT_EQ(cudaMemcpy(h.data(), at(offset), count * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return h;
  }

 private:
  void* ptr_ = nullptr;
  size_t n_;
};

// Random inputs with everything the quantiser must handle: NaN (both signs, several payloads),
// +-Inf, +-0, float32 subnormals, ties of small grids, values near FLT_MAX, and magnitudes that
// vary per block of 32 (so shared shifts differ from block to block); plus runs of signed zeros
// and of NaN, so that some groups are all zero or have no finite element.
std::vector<float> MakeInput(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> block_exp(-40, 40);
  std::vector<float> x(n);
  int e = 0;
  for (size_t i = 0; i < n; ++i) {
    if (i % 32 == 0) e = block_exp(rng);
    const float r = uni(rng);
    const float sign = uni(rng) < 0.5f ? -1.0f : 1.0f;
    float v;
    if (r < 0.02f) {
      v = FromBits((uni(rng) < 0.5f ? 0x7f800001u : 0xffc00000u) | (rng() & 0x3fffffu));
    } else if (r < 0.03f) {
      v = sign * INFINITY;
    } else if (r < 0.06f) {
      v = sign * 0.0f;
    } else if (r < 0.09f) {
      v = FromBits((rng() & 0x807fffffu));  // subnormal (or zero)
    } else if (r < 0.15f) {
      v = sign * (float(int(uni(rng) * 64.0f)) + 0.5f) * std::ldexp(1.0f, int(rng() % 12) - 8);
    } else if (r < 0.17f) {
      v = sign * FromBits(0x7e000000u | (rng() & 0x00ffffffu));  // up to ~FLT_MAX
    } else {
      v = normal(rng) * std::ldexp(1.0f, e);
    }
    x[i] = v;
  }
  // Runs that make some groups degenerate.
  if (n >= 400) {
    for (size_t i = 100; i < 164; ++i) x[i] = (i % 3 == 0) ? -0.0f : 0.0f;
    for (size_t i = 200; i < 264; ++i) x[i] = FromBits(0x7fc00000u);
    for (size_t i = 300; i < 332; ++i) x[i] = std::ldexp(1.0f, -140) * float(i % 4);
  }
  return x;
}

std::string Hex(float f) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%08x", Bits(f));
  return buf;
}

void ExpectSameFloats(const std::vector<float>& want, const std::vector<float>& got,
                      const std::vector<float>& in, const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  size_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const bool same = (std::isnan(want[i]) && std::isnan(got[i])) || Bits(want[i]) == Bits(got[i]);
    if (!same && ++bad <= 8) {
      ADD_FAILURE() << what << ": element " << i << " (input " << Hex(in[i]) << " = " << in[i]
                    << "): cpu " << Hex(want[i]) << " gpu " << Hex(got[i]);
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": mismatching elements";
}

void ExpectNear(double want, double got, const std::string& what) {
  const double tol = 1e-9 * std::max(std::fabs(want), std::fabs(got));
  EXPECT_LE(std::fabs(want - got), tol) << what << ": cpu " << want << " gpu " << got;
}

void ExpectSameStats(const QuantStats& want, const QuantStats& got, const std::string& what) {
  EXPECT_EQ(want.count, got.count) << what;
  EXPECT_EQ(Bits(want.max_abs), Bits(got.max_abs)) << what << ": max_abs";
  EXPECT_EQ(want.saturated, got.saturated) << what << ": saturated";
  EXPECT_EQ(want.flushed, got.flushed) << what << ": flushed";
  EXPECT_EQ(want.nonfinite, got.nonfinite) << what << ": nonfinite";
  ExpectNear(want.sq_error, got.sq_error, what + ": sq_error");
  ExpectNear(want.sq_input, got.sq_input, what + ": sq_input");
}

const char* const kFormats[] = {
    "e4m3",         "e5m2:inf",   "e2m1",    "bf16",         "fp16",
    "e3m0",         "fp32:nosub", "fp32",    "fp134",        "fp143:ch",
    "log4",         "int8",       "int4:ch", "uint4:minmax", "uint8:minmax:ch",
    "mxfp8",        "mxfp6",      "mxfp4",   "bfp8:16",      "bfp6:24",
    "fp152:room=2", "e4m3:inf",   "log4:ch",
};

// Per-binade lists (the table in device memory, shifts per tensor or channel).
const char* const kBinadeFormats[] = {"binades:4x7,3,2,1,0", "binades:5,5,4x5,3,2,1,0:room=0:ch",
                                      "binades:3,3,3:room=2"};

const size_t kSizes[] = {0, 1, 1000, (size_t(1) << 20) + 3};

using Param = cpd::test::FormatRounding;

// The rounding of a test over n elements: a fixed seed and step, and odd and even starts of the
// random stream (the kernels hash once per pair of elements, and from an odd start every vector
// of elements straddles pairs).
void SetRounding(Rounding rounding, size_t n, QuantizeOptions* opts) {
  opts->rounding = rounding;
  opts->seed = 42;
  opts->step = 7;
  opts->index_offset = 1000003 + n % 2;
}

// QuantizeCuda of `in` against cpd::Quantize: out of place, in place, and through views 4 bytes
// off 16-byte alignment (the same offset for input and output, and different offsets, which
// disables the vectorised path), with statistics; then without (a different kernel
// instantiation), asynchronous on a stream.
void ExpectQuantizeMatchesCpu(const Format& format, const std::vector<float>& in,
                              const QuantizeOptions& opts, const std::string& base) {
  const size_t n = in.size();
  std::vector<float> want(n);
  QuantStats want_stats;
  ASSERT_TRUE(cpd::Quantize(format, in.data(), want.data(), n, opts, &want_stats).ok()) << base;

  DeviceBuffer a(n), b(n);
  struct Case {
    const char* name;
    size_t in_off, out_off;
    bool in_place;
  };
  const Case cases[] = {{"out-of-place", 0, 0, false},
                        {"in-place", 0, 0, true},
                        {"misaligned in-place", 1, 1, true},
                        {"misaligned out-of-place", 1, 2, false}};
  for (const Case& c : cases) {
    const std::string what = base + " " + c.name;
    a.Upload(in, c.in_off);
    float* d_in = a.at(c.in_off);
    float* d_out = c.in_place ? d_in : b.at(c.out_off);
    QuantStats got_stats;
    const cpd::Status s = cpd::QuantizeCuda(format, d_in, d_out, n, opts, &got_stats);
    ASSERT_TRUE(s.ok()) << what << ": " << s.ToString();
    const std::vector<float> got = c.in_place ? a.Download(n, c.in_off) : b.Download(n, c.out_off);
    ExpectSameFloats(want, got, in, what);
    ExpectSameStats(want_stats, got_stats, what);
  }
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  a.Upload(in);
  ASSERT_TRUE(cpd::QuantizeCuda(format, a.at(), b.at(), n, opts, nullptr, stream).ok()) << base;
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  ExpectSameFloats(want, b.Download(n), in, base + " no stats");
}

class QuantizeCudaTest : public ::testing::TestWithParam<Param> {};

TEST_P(QuantizeCudaTest, MatchesCpu) {
  if (!cpd::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const std::string spec = std::get<0>(GetParam());
  const Rounding rounding = std::get<1>(GetParam());
  auto format = Format::Parse(spec);
  ASSERT_TRUE(format.ok()) << format.status().ToString();
  for (size_t n : kSizes) {
    QuantizeOptions opts;
    opts.channels = cpd::test::ChannelsFor(*format, n, {8, 7, 5, 3});
    SetRounding(rounding, n, &opts);
    ExpectQuantizeMatchesCpu(*format, MakeInput(n, 1234u + uint32_t(n)), opts,
                             spec + " " + cpd::RoundingName(rounding) + " n=" + std::to_string(n));
  }
}

// The "cuda" prefix makes every test name match `ctest -R cuda`.
INSTANTIATE_TEST_SUITE_P(cuda, QuantizeCudaTest, cpd::test::EveryRoundingOf(kFormats),
                         cpd::test::FormatRoundingName);
INSTANTIATE_TEST_SUITE_P(cuda_binades, QuantizeCudaTest, cpd::test::EveryRoundingOf(kBinadeFormats),
                         cpd::test::FormatRoundingName);

// Block-scaled formats over matrix views (cpd::test::kBlockScaledShapes: partial edge blocks,
// contiguous blocks, few and many blocks, columns given or by channels).
class QuantizeCudaBlockScaledTest : public ::testing::TestWithParam<Param> {};

TEST_P(QuantizeCudaBlockScaledTest, MatchesCpu) {
  if (!cpd::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const std::string spec = std::get<0>(GetParam());
  const Rounding rounding = std::get<1>(GetParam());
  const Format format = cpd::test::MustParse(spec);
  for (const cpd::test::MatrixShape& shape : cpd::test::kBlockScaledShapes) {
    const size_t n = shape.rows * shape.cols;
    QuantizeOptions opts = cpd::test::ShapeOptions(shape);
    SetRounding(rounding, n, &opts);
    ExpectQuantizeMatchesCpu(
        format, MakeInput(n, 1234u + uint32_t(n)), opts,
        spec + " " + cpd::RoundingName(rounding) + " " + cpd::test::ShapeName(shape));
  }
}

INSTANTIATE_TEST_SUITE_P(cuda_block_scaled, QuantizeCudaBlockScaledTest,
                         cpd::test::EveryRoundingOf(cpd::test::kBlockScaledFormats),
                         cpd::test::FormatRoundingName);

// Groups whose scale comes from degenerate data: all zeros of both signs (uint minmax takes the
// zero the CPU picks as its offset, and a zero scale maps everything to it), no finite element,
// a range that underflows the scale, and one large tensor (reduced by the CPU in 65536-element
// chunks) of signed zeros.
class QuantizeCudaDegenerateTest : public ::testing::TestWithParam<const char*> {};

TEST_P(QuantizeCudaDegenerateTest, MatchesCpu) {
  if (!cpd::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const char* spec = GetParam();
  const size_t n = 8 * 128;
  std::vector<float> in(n);
  std::mt19937 rng(7);
  for (size_t i = 0; i < n; ++i) {
    const size_t ch = i / 128, k = i % 128;
    // Channel 0: signed zeros; 1: mostly -0; 2: NaN only; 3: Inf only; 4: zeros and one
    // subnormal (the uint scale underflows to 0); 5: NaN and -0; 6: a constant; 7: a ramp.
    const float zero = (rng() & 1) ? -0.0f : 0.0f;
    const float values[8] = {zero,
                             k % 5 == 0 ? 0.0f : -0.0f,
                             FromBits(0x7fc00000u),
                             k % 2 ? INFINITY : -INFINITY,
                             k == 17 ? FromBits(1) : (k % 3 ? -0.0f : 0.0f),
                             k % 4 == 0 ? NAN : -0.0f,
                             3.0f,
                             float(int(k) - 64) * 0.25f};
    in[i] = values[ch];
  }
  std::vector<float> big(300000);
  for (size_t i = 0; i < big.size(); ++i) {
    // Chunk 0: NaN only; chunk 1: +0 after some NaN; chunks 2..: zeros of both signs. The CPU
    // keeps the earliest chunk's zero (+0) as the uint minmax offset.
    big[i] = i < 70000    ? FromBits(0x7fc00000u)
             : i < 131072 ? 0.0f
                          : (((i * 2654435761u) >> 7) % 2 ? -0.0f : 0.0f);
  }
  auto format = Format::Parse(spec);
  ASSERT_TRUE(format.ok());
  for (const std::vector<float>* data : {&in, &big}) {
    const size_t m = data->size();
    QuantizeOptions opts;
    opts.channels = m == n ? 8 : 1;
    std::vector<float> want(m);
    QuantStats want_stats;
    ASSERT_TRUE(cpd::Quantize(*format, data->data(), want.data(), m, opts, &want_stats).ok());
    DeviceBuffer d(m);
    d.Upload(*data);
    QuantStats got_stats;
    ASSERT_TRUE(cpd::QuantizeCuda(*format, d.at(), d.at(), m, opts, &got_stats).ok());
    const std::string what = std::string(spec) + " n=" + std::to_string(m);
    // Signed zeros must match exactly here: compare bits, NaN aside.
    ExpectSameFloats(want, d.Download(m), *data, what);
    ExpectSameStats(want_stats, got_stats, what);
  }
}

std::string SpecName(const ::testing::TestParamInfo<const char*>& info) {
  std::string name = info.param;
  for (char& ch : name) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(cuda, QuantizeCudaDegenerateTest,
                         ::testing::Values("uint4:minmax", "uint4:minmax:ch", "uint8:minmax",
                                           "int8:ch", "fp134:ch", "log4:ch", "bfp8:16", "bfp6:24",
                                           "mxfp4"),
                         SpecName);
// Block-scaled formats view the small span as 8 rows of 128 (columns 0, 8 channels).
INSTANTIATE_TEST_SUITE_P(cuda_block_scaled, QuantizeCudaDegenerateTest,
                         ::testing::Values("nvfp4", "nvfp4:2d", "e4m3:block=128x128",
                                           "e2m1:block=4x8:scale=e5m2:tensor",
                                           "e5m2:inf:block=1x32:scale=e4m3", "e4m3:block=tensor"),
                         SpecName);
INSTANTIATE_TEST_SUITE_P(cuda_binades, QuantizeCudaDegenerateTest,
                         ::testing::Values("binades:3,3,3:ch", "binades:0x7:room=0:ch"), SpecName);

// Hysteresis of weights w under `opts`: q starts from a quantisation of a perturbed copy of w,
// then both paths update it, in place (statistics and flips returned) and with the previous
// weights kept apart (QuantizeHysteresisKeepCuda, statistics and flips in slots).
void ExpectHysteresisMatchesCpu(const Format& format, const std::vector<float>& w,
                                const QuantizeOptions& opts, const std::string& what) {
  const size_t n = w.size();
  std::vector<float> w0 = w;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> jitter(0.9f, 1.1f);
  for (float& v : w0) v *= jitter(rng);
  std::vector<float> q(n);
  ASSERT_TRUE(cpd::Quantize(format, w0.data(), q.data(), n, opts).ok()) << what;

  DeviceBuffer dw(n), dq(n);
  dw.Upload(w);
  dq.Upload(q);
  std::vector<float> want = q;
  QuantStats want_stats, got_stats;
  uint64_t want_flips = 0, got_flips = 0;
  ASSERT_TRUE(
      cpd::QuantizeHysteresis(format, w.data(), want.data(), n, opts, &want_stats, &want_flips)
          .ok())
      << what;
  const cpd::Status s =
      cpd::QuantizeHysteresisCuda(format, dw.at(), dq.at(), n, opts, &got_stats, &got_flips);
  ASSERT_TRUE(s.ok()) << what << ": " << s.ToString();
  ExpectSameFloats(want, dq.Download(n), w, what);
  ExpectSameStats(want_stats, got_stats, what);
  EXPECT_EQ(want_flips, got_flips) << what;

  // The same step with the previous weights kept apart: read from dprev, the new ones written
  // to dq2 and over dprev, statistics and flips into slots, no wait until the read.
  DeviceBuffer dprev(n), dq2(n);
  dprev.Upload(q);
  auto slots = cpd::CudaStatsSlots::Create(2);
  ASSERT_TRUE(slots.ok());
  cpd::CudaStatsTarget target;
  target.slots = slots->get();
  target.stats = 0;
  target.flips = 1;
  const cpd::Status k = cpd::QuantizeHysteresisKeepCuda(format, dw.at(), dprev.at(), dq2.at(), n,
                                                        opts, target, nullptr);
  ASSERT_TRUE(k.ok()) << what << " keep: " << k.ToString();
  const auto read = (*slots)->Read(0, 2, nullptr);
  ASSERT_TRUE(read.ok());
  ExpectSameFloats(want, dq2.Download(n), w, what + " keep: output");
  ExpectSameFloats(want, dprev.Download(n), w, what + " keep: kept state");
  if (n > 0) ExpectSameStats(want_stats, (*read)[0].stats, what + " keep");
  EXPECT_EQ(want_flips, (*read)[1].flips) << what << " keep";
  EXPECT_EQ(
      cpd::QuantizeHysteresisKeepCuda(format, dw.at(), dq2.at(), dq2.at(), n, opts, target, nullptr)
          .code(),
      n > 0 ? cpd::Status::Code::kInvalidArgument : cpd::Status::Code::kOk)
      << what << ": overlapping previous and new weights";
}

class QuantizeHysteresisCudaTest : public ::testing::TestWithParam<const char*> {};

TEST_P(QuantizeHysteresisCudaTest, MatchesCpu) {
  if (!cpd::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const char* spec = GetParam();
  const Format format = cpd::test::MustParse(spec);
  for (size_t n : kSizes) {
    QuantizeOptions opts;
    opts.channels = cpd::test::ChannelsFor(format, n, {8, 7, 5, 3});
    ExpectHysteresisMatchesCpu(format, MakeInput(n, 99u + uint32_t(n)), opts,
                               std::string(spec) + " hysteresis n=" + std::to_string(n));
  }
}

// Block-scaled formats over the matrix views of QuantizeCudaBlockScaledTest.
class QuantizeHysteresisCudaBlockScaledTest : public ::testing::TestWithParam<const char*> {};

TEST_P(QuantizeHysteresisCudaBlockScaledTest, MatchesCpu) {
  if (!cpd::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const char* spec = GetParam();
  const Format format = cpd::test::MustParse(spec);
  for (const cpd::test::MatrixShape& shape : cpd::test::kBlockScaledShapes) {
    const size_t n = shape.rows * shape.cols;
    ExpectHysteresisMatchesCpu(format, MakeInput(n, 99u + uint32_t(n)),
                               cpd::test::ShapeOptions(shape),
                               std::string(spec) + " hysteresis " + cpd::test::ShapeName(shape));
  }
}

// Flips of nearest rounding: the GPU's count of changed bit patterns equals the CPU's, with
// -0 against +0 counted as a change (bits, not values, are compared).
TEST(CountFlipsCuda, MatchesCpu) {
  if (!cpd::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const Format f = *Format::Parse("e4m3");
  for (size_t n : kSizes) {
    const std::vector<float> w = MakeInput(n, 7u + uint32_t(n));
    std::vector<float> w2 = w;
    std::mt19937 rng(11);
    std::uniform_real_distribution<float> jitter(0.97f, 1.03f);
    for (float& v : w2) v *= jitter(rng);
    std::vector<float> prev(n), q(n);
    ASSERT_TRUE(cpd::Quantize(f, w.data(), prev.data(), n).ok());
    ASSERT_TRUE(cpd::Quantize(f, w2.data(), q.data(), n).ok());
    if (n > 2) {
      prev[0] = 0.0f;
      q[0] = -0.0f;
    }
    const auto want = cpd::CountFlips(prev.data(), q.data(), n);
    ASSERT_TRUE(want.ok());
    DeviceBuffer dprev(n), dq(n);
    dprev.Upload(prev);
    dq.Upload(q);
    const auto got = cpd::CountFlipsCuda(dprev.at(), dq.at(), n);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, *want) << "n=" << n;
    if (n > 100) {
      EXPECT_GT(*want, 0u) << "n=" << n;
    }
  }
  EXPECT_EQ(*cpd::CountFlipsCuda(nullptr, nullptr, 0), 0u);
  EXPECT_FALSE(cpd::CountFlipsCuda(nullptr, nullptr, 4).ok());
}

INSTANTIATE_TEST_SUITE_P(cuda, QuantizeHysteresisCudaTest,
                         ::testing::Values("e4m3", "bf16", "fp134", "fp143:ch", "log4", "log4:ch",
                                           "int8", "int4:ch", "uint4:minmax", "mxfp8", "bfp8:16",
                                           "e2m1"),
                         SpecName);
INSTANTIATE_TEST_SUITE_P(cuda_binades, QuantizeHysteresisCudaTest,
                         ::testing::Values("binades:5,5,4x5,3,2,1,0:ch", "binades:3,3,3:room=2"),
                         SpecName);
INSTANTIATE_TEST_SUITE_P(cuda_block_scaled, QuantizeHysteresisCudaBlockScaledTest,
                         ::testing::ValuesIn(cpd::test::kBlockScaledFormats), SpecName);

// The scale reductions keep their buffers and the block ticket in per-stream scratch that stays
// zero between calls (the kernels clear what they use): formats of every reduction (max |x| for
// shifts and int grids, min/max for uint grids), with few groups (derived by the reduction's last
// block) and many (a second launch), one after another on one stream, with and without
// statistics (which take the ticket too), twice round. Any state left behind would change the
// next call's scales.
TEST(QuantizeCuda, ReductionScratchIsClearedForTheNextCall) {
  if (!cpd::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  struct Case {
    const char* spec;
    size_t n, channels;
  };
  const Case cases[] = {
      {"uint8:minmax", 200003, 1},
      {"int8:ch", 4000, 8},
      {"fp134", 70001, 1},
      {"bfp8:24", 24 * 5000, 1},
      {"uint4:minmax:ch", 9216, 64},
      {"log4:ch", 3000, 3000},
      {"uint8:minmax", 1000, 1},
      {"int4", 333, 1},
      {"bfp6:24", 24 * 3, 1},
      // Block scales: many blocks under a tensor level (a second launch derives them, after the
      // reduction's last block took the tensor's max), few blocks, and 2-D blocks by channels.
      {"nvfp4", 200000, 1},
      {"e4m3:block=1x128", 1000, 1},
      {"nvfp4:2d", 4000, 8},
  };
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  for (int round = 0; round < 2; ++round) {
    for (const Case& c : cases) {
      const std::string what =
          std::string(c.spec) + " n=" + std::to_string(c.n) + " round " + std::to_string(round);
      const Format f = *Format::Parse(c.spec);
      const std::vector<float> in = MakeInput(c.n, 77u + uint32_t(c.n) + uint32_t(round));
      QuantizeOptions opts;
      opts.channels = c.channels;
      std::vector<float> want(c.n);
      QuantStats want_stats;
      ASSERT_TRUE(cpd::Quantize(f, in.data(), want.data(), c.n, opts, &want_stats).ok()) << what;
      DeviceBuffer d_in(c.n), d_out(c.n);
      d_in.Upload(in);
      QuantStats got_stats;
      QuantStats* sp = (round == 0) == (c.n % 2 == 0) ? &got_stats : nullptr;
      const cpd::Status s = cpd::QuantizeCuda(f, d_in.at(), d_out.at(), c.n, opts, sp, stream);
      ASSERT_TRUE(s.ok()) << what << ": " << s.ToString();
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      ExpectSameFloats(want, d_out.Download(c.n), in, what);
      if (sp != nullptr) ExpectSameStats(want_stats, got_stats, what);
    }
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// ---- Statistics slots on the device ---------------------------------------------------------

// QuantStats merged as CudaStatsSlots merges them: counts and sums added, the largest max_abs.
void Merge(QuantStats* into, const QuantStats& s) {
  into->count += s.count;
  into->max_abs = std::max(into->max_abs, s.max_abs);
  into->saturated += s.saturated;
  into->flushed += s.flushed;
  into->nonfinite += s.nonfinite;
  into->sq_error += s.sq_error;
  into->sq_input += s.sq_input;
}

// Several sites (plain, per channel, min/max, fused blocks, stochastic, hysteresis with flips,
// nearest with CountFlipsAndKeepCuda) over several steps, queued without a wait: slot `site`
// accumulates the site over the steps, one slot per (step, site) holds each call alone, and
// both equal the CPU's QuantStats (merged over the steps for the first) after ONE read.
TEST(CudaStatsSlots, AccumulateSitesAndStepsAsTheCpu) {
  if (!cpd::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  struct SiteCase {
    const char* spec;
    Rounding rounding;
    size_t n, channels;
    bool hysteresis;
  };
  const SiteCase sites[] = {
      {"e4m3", Rounding::kNearest, 5000, 1, false},
      {"uint8:minmax:ch", Rounding::kNearest, 64 * 9 * 16, 64, false},
      {"uint8:minmax", Rounding::kStochastic, 100003, 1, false},
      {"fp134", Rounding::kNearest, 70001, 1, false},
      {"mxfp8", Rounding::kNearest, 4096, 1, false},
      {"int8:ch", Rounding::kNearest, 3000, 8, false},
      {"log4:ch", Rounding::kNearest, 16 * 27, 16, true},
  };
  constexpr size_t kSites = sizeof(sites) / sizeof(sites[0]);
  constexpr int kSteps = 3;
  // Slots: [0, kSites) per site over the steps; then kSites per step; then the flips of the
  // hysteresis site and of the nearest-rounded site 0 (CountFlipsAndKeepCuda).
  const size_t flips_hyst = kSites * (kSteps + 1), flips_keep = flips_hyst + 1;
  auto slots = cpd::CudaStatsSlots::Create(flips_keep + 1);
  ASSERT_TRUE(slots.ok()) << slots.status().ToString();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);

  std::vector<QuantStats> want_site(kSites), want_call(kSites * kSteps);
  uint64_t want_hyst_flips = 0, want_keep_flips = 0;
  std::vector<std::unique_ptr<DeviceBuffer>> d_in, d_out, d_prev;
  std::vector<std::vector<float>> cpu_q(kSites), cpu_prev(kSites), want_out(kSites * kSteps);
  for (size_t i = 0; i < kSites; ++i) {
    d_in.push_back(std::make_unique<DeviceBuffer>(sites[i].n));
    d_out.push_back(std::make_unique<DeviceBuffer>(sites[i].n));
    d_prev.push_back(std::make_unique<DeviceBuffer>(sites[i].n));
  }
  std::vector<std::vector<float>> got_out(kSites * kSteps);
  for (int step = 0; step < kSteps; ++step) {
    for (size_t i = 0; i < kSites; ++i) {
      const SiteCase& c = sites[i];
      const std::string what = std::string(c.spec) + " step " + std::to_string(step);
      const Format f = *Format::Parse(c.spec);
      std::vector<float> in = MakeInput(c.n, 500u + uint32_t(step * 31 + i));
      if (c.hysteresis) {
        for (float& v : in) v = std::isfinite(v) ? std::clamp(v, -4.0f, 4.0f) : 0.5f;
      }
      QuantizeOptions opts;
      opts.rounding = c.rounding;
      opts.seed = 9 + i;
      opts.step = uint64_t(step);
      opts.channels = c.channels;
      QuantStats want;
      std::vector<float>& q = cpu_q[i];
      d_in[i]->Upload(in);
      cpd::CudaStatsTarget target;
      target.slots = slots->get();
      target.stats = i;  // accumulated over the steps
      if (c.hysteresis && step > 0) {
        uint64_t flips = 0;
        ASSERT_TRUE(cpd::QuantizeHysteresis(f, in.data(), q.data(), c.n, opts, &want, &flips).ok());
        want_hyst_flips += flips;
        target.flips = flips_hyst;
        ASSERT_TRUE(
            cpd::QuantizeHysteresisCuda(f, d_in[i]->at(), d_out[i]->at(), c.n, opts, target, stream)
                .ok())
            << what;
        // (No per-call slot: the call updates d_out in place, so it cannot run twice.)
      } else {
        q.resize(c.n);
        ASSERT_TRUE(cpd::Quantize(f, in.data(), q.data(), c.n, opts, &want).ok());
        ASSERT_TRUE(
            cpd::QuantizeCuda(f, d_in[i]->at(), d_out[i]->at(), c.n, opts, target, stream).ok())
            << what;
        target.stats = kSites * size_t(step + 1) + i;  // the same call alone
        ASSERT_TRUE(
            cpd::QuantizeCuda(f, d_in[i]->at(), d_out[i]->at(), c.n, opts, target, stream).ok())
            << what;
      }
      want_out[size_t(step) * kSites + i] = q;
      Merge(&want_site[i], want);
      want_call[size_t(step) * kSites + i] = want;
      if (i == 0) {  // flips of nearest rounding, counted against the previous step's weights
        if (step > 0) {
          want_keep_flips += *cpd::CountFlips(cpu_prev[i].data(), q.data(), c.n);
          cpd::CudaStatsTarget keep;
          keep.slots = slots->get();
          keep.flips = flips_keep;
          ASSERT_TRUE(
              cpd::CountFlipsAndKeepCuda(d_prev[i]->at(), d_out[i]->at(), c.n, keep, stream).ok());
        } else {
          ASSERT_EQ(cudaMemcpyAsync(d_prev[i]->at(), d_out[i]->at(), c.n * sizeof(float),
                                    cudaMemcpyDeviceToDevice, stream),
                    cudaSuccess);
        }
        cpu_prev[i] = q;
      }
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);  // for the downloads only
      got_out[size_t(step) * kSites + i] = d_out[i]->Download(c.n);
      if (i == 0) {
        ExpectSameFloats(q, d_prev[i]->Download(c.n), in, what + ": kept weights");
      }
    }
  }
  const auto read = (*slots)->Read(0, flips_keep + 1, stream);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  for (size_t i = 0; i < kSites; ++i) {
    const std::string site = sites[i].spec;
    ExpectSameStats(want_site[i], (*read)[i].stats, site + " over the steps");
    for (int step = 0; step < kSteps; ++step) {
      const size_t k = size_t(step) * kSites + i;
      const std::string what = site + " step " + std::to_string(step);
      ExpectSameFloats(want_out[k], got_out[k], want_out[k], what);
      if (sites[i].hysteresis && step > 0) continue;  // only the accumulated slot
      ExpectSameStats(want_call[k], (*read)[kSites * size_t(step + 1) + i].stats, what);
    }
  }
  EXPECT_EQ((*read)[flips_hyst].flips, want_hyst_flips);
  EXPECT_GT(want_hyst_flips + want_keep_flips, 0u);
  EXPECT_EQ((*read)[flips_keep].flips, want_keep_flips);
  EXPECT_EQ((*read)[flips_hyst].stats.count, 0u);  // a flips slot receives flips only

  // Growing keeps every value; Clear zeroes a range and nothing else.
  ASSERT_TRUE((*slots)->Reserve(3 * (flips_keep + 1), stream).ok());
  ASSERT_TRUE((*slots)->Clear(1, 2, stream).ok());
  const auto after = (*slots)->Read(0, 3 * (flips_keep + 1), stream);
  ASSERT_TRUE(after.ok());
  ExpectSameStats(want_site[0], (*after)[0].stats, "slot 0 after Reserve");
  EXPECT_EQ((*after)[1].stats.count, 0u);
  EXPECT_EQ((*after)[2].stats.sq_error, 0.0);
  ExpectSameStats(want_site[3], (*after)[3].stats, "slot 3 after Clear(1, 2)");
  EXPECT_EQ((*after)[flips_keep].flips, want_keep_flips);
  EXPECT_EQ((*after)[flips_keep + 1].stats.count, 0u);

  // Slots that do not exist are refused before any work is queued.
  cpd::CudaStatsTarget bad;
  bad.slots = slots->get();
  bad.stats = (*slots)->capacity();
  const Format e4m3 = *Format::Parse("e4m3");
  EXPECT_EQ(cpd::QuantizeCuda(e4m3, d_in[0]->at(), d_out[0]->at(), 16, {}, bad, stream).code(),
            cpd::Status::Code::kInvalidArgument);
  bad.slots = nullptr;
  bad.stats = 0;
  EXPECT_EQ(cpd::QuantizeCuda(e4m3, d_in[0]->at(), d_out[0]->at(), 16, {}, bad, stream).code(),
            cpd::Status::Code::kInvalidArgument);
  EXPECT_EQ((*slots)->Read(0, (*slots)->capacity() + 1, stream).status().code(),
            cpd::Status::Code::kInvalidArgument);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

class QuantizeCudaArgumentsTest : public ::testing::TestWithParam<const char*> {};

TEST_P(QuantizeCudaArgumentsTest, RejectsBadArguments) {
  if (!cpd::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  auto format = Format::Parse(GetParam());
  ASSERT_TRUE(format.ok());
  DeviceBuffer d(16);
  QuantizeOptions opts;
  EXPECT_EQ(cpd::QuantizeCuda(*format, nullptr, d.at(), 16, opts).code(),
            cpd::Status::Code::kInvalidArgument);
  opts.channels = 3;  // 16 elements do not split into 3 channels
  EXPECT_EQ(cpd::QuantizeCuda(*format, d.at(), d.at(), 16, opts).code(),
            cpd::Status::Code::kInvalidArgument);
  opts.channels = 0;
  EXPECT_EQ(cpd::QuantizeCuda(*format, d.at(), d.at(), 16, opts).code(),
            cpd::Status::Code::kInvalidArgument);
  // Ordinary host memory, unless the device can read pageable memory (HMM/ATS systems).
  int device = 0, pageable = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, device),
            cudaSuccess);
  std::vector<float> host(16, 1.0f);
  opts.channels = 1;
  const cpd::Status s = cpd::QuantizeCuda(*format, host.data(), host.data(), 16, opts);
  if (pageable == 0) {
    EXPECT_EQ(s.code(), cpd::Status::Code::kInvalidArgument) << s.ToString();
  } else {
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  // The device is still usable afterwards.
  QuantStats stats;
  EXPECT_TRUE(cpd::QuantizeCuda(*format, d.at(), d.at(), 16, opts, &stats).ok());
}

INSTANTIATE_TEST_SUITE_P(cuda, QuantizeCudaArgumentsTest, ::testing::Values("int8:ch", "fp143:ch"),
                         SpecName);

}  // namespace
