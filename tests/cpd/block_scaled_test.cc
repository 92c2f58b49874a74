// Block-scaled formats (nvfp4, FLOAT:block=RxC[:scale=S][:tensor]): the spec language and its
// errors; the scales against a per-element restatement of the rules written here from NVIDIA's
// documented NVFP4 quantisation and DeepSeek-V3's float32 tile scales (the independent oracle is
// block_scaled_oracle.py, on ml_dtypes); MX as an instance (e2m1:block=32:scale=e8m0 equals
// mxfp4 on one row); the codec; hysteresis; results independent of the thread count.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "cpd/format.h"
#include "cpd/quantize.h"
#include "kernels/grid.h"
#include "tests/cpd/format_test_util.h"

namespace cpd::test {
namespace {

// Rows whose blocks have magnitudes spread over many binades, with a block of zeros, a block of
// values so small that an E4M3 scale under the tensor level underflows, and (optionally) NaN
// and Inf.
std::vector<float> MatrixInputs(size_t rows, size_t cols, uint64_t seed, bool nonfinite) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0), e(-12.0, 12.0);
  std::vector<float> x(rows * cols);
  for (size_t r = 0; r < rows; ++r) {
    const double row_scale = std::exp2(e(rng));
    for (size_t c = 0; c < cols; ++c) {
      const double block_scale = std::exp2(std::floor(e(rng) / 4));
      x[r * cols + c] = float(u(rng) * row_scale * block_scale);
    }
  }
  for (size_t c = 0; c < std::min<size_t>(cols, 16); ++c) x[c] = 0.0f;  // a zero block
  if (rows > 1) {
    for (size_t c = 0; c < std::min<size_t>(cols, 16); ++c) x[cols + c] = float(1e-30 * (c + 1));
  }
  if (nonfinite && x.size() > 40) {
    x[37] = NAN;
    x[39] = INFINITY;
  }
  return x;
}

// Compares results elementwise (NaN matches NaN), reporting the first few mismatches.
void ExpectSame(const std::string& what, const std::vector<float>& x,
                const std::vector<float>& want, const std::vector<float>& got) {
  MismatchCounter bad(what);
  for (size_t i = 0; i < x.size(); ++i) {
    if (!SameResult(want[i], got[i])) {
      bad.Add() << "x[" << i << "] = " << Show(x[i]) << ": want " << Show(want[i]) << ", got "
                << Show(got[i]);
    }
  }
}

TEST(BlockScaledSpec, NamesAndCanonicalSpellings) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"nvfp4", "nvfp4"},
      {"nvfp4:2d", "nvfp4:2d"},
      {"e2m1:block=1x16:scale=e4m3:tensor", "nvfp4"},
      {"e2m1:tensor:scale=e4m3:block=16x16", "nvfp4:2d"},
      {"e4m3:block=1x128", "e4m3:block=1x128:scale=fp32"},
      {"e4m3:block=128", "e4m3:block=1x128:scale=fp32"},
      {"e4m3:block=128x128:scale=fp32", "e4m3:block=128x128:scale=fp32"},
      {"e2m1:block=32:scale=e8m0", "e2m1:block=1x32:scale=e8m0"},
      {"e4m3:block=1x16:scale=e4m3", "e4m3:block=1x16:scale=e4m3"},
      {"e2m1:block=8x4:scale=e5m2:tensor", "e2m1:block=8x4:scale=e5m2:tensor"},
      {"e5m2:inf:block=4x4", "e5m2:inf:block=4x4:scale=fp32"},
      {"e4m3:block=tensor", "e4m3:block=tensor:scale=fp32"},
      {"e2m1:block=tensor:scale=e4m3", "e2m1:block=tensor:scale=e4m3"},
  };
  for (const auto& [spec, canon] : cases) {
    const Format f = MustParse(spec);
    EXPECT_EQ(f.spec(), canon) << spec;
    EXPECT_EQ(f.family(), FormatFamily::kBlockScaled) << spec;
    EXPECT_EQ(MustParse(f.spec()).spec(), canon) << "canonical spelling reparses: " << spec;
  }
  const Format nv = MustParse("nvfp4:2d");
  EXPECT_EQ(nv.bits(), 4);
  EXPECT_EQ(nv.block_rows(), 16u);
  EXPECT_EQ(nv.block_cols(), 16u);
  EXPECT_EQ(nv.scale_type(), BlockScaleType::kFloatGrid);
  EXPECT_TRUE(nv.tensor_level());
  EXPECT_EQ(nv.meta_bytes_per_group(), 1u);
  EXPECT_EQ(nv.meta_bytes_per_tensor(), 4u);
  EXPECT_EQ(MustParse("e4m3:block=128x128").meta_bytes_per_group(), 4u);
  EXPECT_EQ(MustParse("e2m1:block=32:scale=e8m0").meta_bytes_per_group(), 1u);
  EXPECT_EQ(MustParse("e2m1:block=2x2:scale=bf16").meta_bytes_per_group(), 2u);
}

// ':block=tensor' is one block over the matrix view, whatever its shape: the same result as a
// block of exactly that shape.
TEST(BlockScaledQuantize, ATensorBlockIsTheWholeMatrix) {
  const Format tensor = MustParse("e4m3:block=tensor");
  EXPECT_TRUE(tensor.whole_tensor_block());
  EXPECT_EQ(tensor.num_groups(40 * 160, 1, 160), 1u);
  const std::vector<float> x = MatrixInputs(40, 160, 3, false);
  QuantizeOptions opts;
  opts.columns = 160;
  std::vector<float> a(x.size()), b(x.size());
  ASSERT_TRUE(Quantize(tensor, x.data(), a.data(), x.size(), opts).ok());
  ASSERT_TRUE(Quantize(MustParse("e4m3:block=40x160"), x.data(), b.data(), x.size(), opts).ok());
  ExpectSame("e4m3:block=tensor against e4m3:block=40x160", x, b, a);
  const Format mx = MustParse("e2m1:block=tensor:scale=e8m0");
  ASSERT_TRUE(Quantize(mx, x.data(), a.data(), x.size(), opts).ok());
  ASSERT_TRUE(
      Quantize(MustParse("e2m1:block=40x160:scale=e8m0"), x.data(), b.data(), x.size(), opts).ok());
  ExpectSame("e2m1:block=tensor:scale=e8m0 against a 40x160 block", x, b, a);
}

TEST(BlockScaledSpec, ErrorsNameTheProblem) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"e4m3:block=0x16", "':block=0x16' needs RxC"},
      {"e4m3:block=16x", "':block=16x' needs RxC"},
      {"e4m3:block=abc", "':block=abc' needs RxC"},
      {"e4m3:block=65537", "':block=65537' needs RxC"},
      {"e4m3:block=2048x2048", "at most 2^20 elements"},
      {"e4m3:block=", "':block=' needs RxC"},
      {"int8:block=1x16", "block scales apply to a float element format"},
      {"fp134:block=1x16", "block scales apply to a float element format"},
      {"mxfp4:block=1x16", "block scales apply to a float element format"},
      {"e2m1:block=16:scale=int8", "':scale=int8' needs fp32, e8m0"},
      {"e2m1:block=16:scale=mxfp8", "':scale=mxfp8' needs fp32, e8m0"},
      {"e2m1:block=16:tensor", "':tensor' (a float32 tensor level) needs block scales on a float"},
      {"e2m1:block=16:scale=e8m0:tensor", "':tensor' (a float32 tensor level) needs"},
      {"e2m1:block=16:block=32", "modifier ':block' given twice"},
      {"nvfp4:3d", "nvfp4 takes only ':2d'"},
      {"nvfp4:2d:2d", "modifier ':2d' given twice"},
      {"e2m1:block=16:scale=e4m3:foo", "unknown modifier ':foo'"},
  };
  for (const auto& [spec, want] : cases) {
    auto f = Format::Parse(spec);
    ASSERT_FALSE(f.ok()) << spec;
    EXPECT_NE(f.status().message().find(want), std::string::npos)
        << spec << ": " << f.status().message();
  }
}

TEST(BlockScaledSpec, ASpanThatIsNotWholeRowsIsRefused) {
  const Format f = MustParse("nvfp4");
  std::vector<float> x(100, 1.0f);
  QuantizeOptions opts;
  opts.columns = 16;  // 100 is not whole rows of 16
  const Status s = Quantize(f, x.data(), x.data(), x.size(), opts);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("not whole rows of 16 columns"), std::string::npos) << s.message();
  opts.columns = 0;
  opts.channels = 3;
  EXPECT_FALSE(Quantize(f, x.data(), x.data(), x.size(), opts).ok());
  opts.channels = 4;  // rows of 25: partial blocks, accepted
  EXPECT_TRUE(Quantize(f, x.data(), x.data(), x.size(), opts).ok());
}

// The rules restated per element, in the order NVIDIA documents NVFP4 (and DeepSeek-V3's float32
// scales): amax per block over the matrix view, then the scale, then each element, rounded in
// mode kMode.
template <kernels::RoundMode kMode = kernels::RoundMode::kNearestEven>
std::vector<float> Restated(const Format& f, const std::vector<float>& x, size_t cols) {
  using namespace kernels;
  const size_t rows = x.size() / cols, R = f.block_rows(), C = f.block_cols();
  const size_t nbr = (rows + R - 1) / R, nbc = (cols + C - 1) / C;
  std::vector<float> amax(nbr * nbc, 0.0f);
  float amax_tensor = 0.0f;
  for (size_t i = 0; i < x.size(); ++i) {
    const float a = std::fabs(x[i]);
    if (!std::isfinite(a)) continue;
    float& m = amax[(i / cols / R) * nbc + (i % cols) / C];
    m = std::max(m, a);
    amax_tensor = std::max(amax_tensor, a);
  }
  const FloatGrid& g = f.grid();
  const float elem_max = BitsFloat(g.max_bits);
  float t_enc = 1.0f;
  if (f.tensor_level() && amax_tensor > 0.0f) {
    t_enc = std::min(BitsFloat(f.scale_grid().max_bits) * elem_max / amax_tensor, kFloat32Max);
    if (t_enc == 0.0f) t_enc = 1.0f;
  }
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const float a = amax[(i / cols / R) * nbc + (i % cols) / C];
    float enc, dec, dec2 = 1.0f;
    if (f.scale_type() == BlockScaleType::kFloat32) {
      enc = a > 0.0f ? std::min(elem_max / a, kFloat32Max) : 1.0f;
      dec = a > 0.0f ? 1.0f / enc : 1.0f;
    } else {
      const float one_over_max = 1.0f / elem_max;
      const float sb = BitsFloat(RoundToFloatGrid<RoundMode::kNearestEven>(
          a * (t_enc * one_over_max), f.scale_grid(), 0, nullptr));
      dec2 = 1.0f / t_enc;
      enc = std::min(1.0f / (sb * dec2), kFloat32Max);
      dec = sb;
    }
    const float q = BitsFloat(RoundToFloatGrid<kMode>(x[i] * enc, g, 0, nullptr));
    out[i] = (q * dec) * dec2;
  }
  return out;
}

TEST(BlockScaledQuantize, MatchesTheRulesRestatedPerElement) {
  struct Case {
    std::string spec;
    size_t rows, cols;
  };
  const std::vector<Case> cases = {
      {"nvfp4", 32, 64},
      {"nvfp4", 9, 40},
      {"nvfp4:2d", 48, 40},
      {"nvfp4:2d", 33, 17},
      {"e4m3:block=1x128", 8, 300},
      {"e4m3:block=128x128", 200, 130},
      {"e4m3:block=1x16:scale=e4m3", 16, 48},
      {"e2m1:block=4x8:scale=e5m2:tensor", 13, 27},
      {"e5m2:block=3x5:scale=bf16", 10, 10},
      {"e4m3:block=tensor", 13, 27},
      {"e4m3:block=tensor", 1, 5000},
      {"e2m1:block=tensor:scale=e4m3", 40, 33},
  };
  for (const Case& c : cases) {
    const Format f = MustParse(c.spec);
    const std::vector<float> x = MatrixInputs(c.rows, c.cols, 7 + c.rows, false);
    std::vector<float> got(x.size());
    QuantizeOptions opts;
    opts.columns = c.cols;
    ASSERT_TRUE(Quantize(f, x.data(), got.data(), x.size(), opts).ok()) << c.spec;
    ExpectSame(c.spec, x, Restated(f, x, c.cols), got);
  }
}

TEST(BlockScaledQuantize, TheTensorLevelKeepsTheLargestBlockAtTheScaleFormatsTop) {
  // NVFP4: the block holding the tensor's max |x| gets the scale 448 (E4M3's max), so its max
  // element lands on 6 exactly; a block whose scale underflows E4M3 becomes zeros.
  const Format f = MustParse("nvfp4");
  std::vector<float> x(32, 0.0f);
  x[3] = -1000.0f;
  x[16] = 1e-30f;
  std::vector<float> got(x.size());
  QuantizeOptions opts;
  opts.columns = 32;
  ASSERT_TRUE(Quantize(f, x.data(), got.data(), x.size(), opts).ok());
  EXPECT_EQ(got[3], -1000.0f);
  EXPECT_EQ(got[16], 0.0f);
  PackedTensor packed;
  ASSERT_TRUE(Encode(f, x.data(), x.size(), opts, &packed).ok());
  // 32 codes of 4 bits, 2 scale bytes, the float32 tensor scale 2688 / 1000.
  ASSERT_EQ(packed.bytes.size(), 16u + 2u + 4u);
  EXPECT_EQ(packed.bytes[16], 0x7e);  // E4M3 448: exponent 15, mantissa 6
  EXPECT_EQ(packed.bytes[17], 0x00);
  float t;
  std::memcpy(&t, packed.bytes.data() + 18, 4);
  EXPECT_EQ(t, 2688.0f / 1000.0f);
}

TEST(BlockScaledQuantize, MxIsAnInstance) {
  // On one row (columns 0, channels 1) the 1x32 E8M0 blocks are MX's blocks of 32.
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"e2m1:block=32:scale=e8m0", "mxfp4"},
      {"e2m3:block=32:scale=e8m0", "mxfp6"},
      {"e4m3:block=32:scale=e8m0", "mxfp8"},
  };
  const std::vector<float> x = MatrixInputs(1, 32 * 1000 + 7, 3, true);
  for (const auto& [spec, mx] : pairs) {
    for (Rounding r : {Rounding::kNearest, Rounding::kStochastic, Rounding::kZero}) {
      QuantizeOptions opts;
      opts.rounding = r;
      opts.seed = 11;
      std::vector<float> a(x.size()), b(x.size());
      QuantStats sa, sb;
      ASSERT_TRUE(Quantize(MustParse(spec), x.data(), a.data(), x.size(), opts, &sa).ok());
      ASSERT_TRUE(Quantize(MustParse(mx), x.data(), b.data(), x.size(), opts, &sb).ok());
      ExpectSame(spec + " vs " + mx + " " + RoundingName(r), x, b, a);
      EXPECT_EQ(sa.saturated, sb.saturated);
      EXPECT_EQ(sa.flushed, sb.flushed);
      EXPECT_EQ(sa.sq_error, sb.sq_error);
    }
  }
}

TEST(BlockScaledQuantize, StochasticRoundingStaysOnTheBlocksGridAndIsUnbiased) {
  // Every result is one of the two grid neighbours of x * enc, scaled back (the restated rules
  // rounded down and up); the mean over many draws approaches x.
  const Format f = MustParse("nvfp4");
  const size_t cols = 16;
  std::vector<float> x(cols * 4096);
  for (size_t i = 0; i < x.size(); ++i) x[i] = (i % cols == 0) ? 6.0f : 1.3f;
  std::vector<float> got(x.size());
  QuantizeOptions opts;
  opts.rounding = Rounding::kStochastic;
  opts.columns = cols;
  opts.seed = 5;
  ASSERT_TRUE(Quantize(f, x.data(), got.data(), x.size(), opts).ok());
  const std::vector<float> down = Restated<kernels::RoundMode::kDown>(f, x, cols);
  const std::vector<float> up = Restated<kernels::RoundMode::kUp>(f, x, cols);
  double sum = 0.0;
  size_t count = 0, ups = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_TRUE(got[i] == down[i] || got[i] == up[i]) << i << " " << got[i];
    if (i % cols == 0) continue;
    sum += got[i];
    ups += got[i] == up[i];
    ++count;
  }
  EXPECT_NE(down[1], up[1]);
  EXPECT_NEAR(sum / double(count), 1.3, 0.01);
  EXPECT_GT(ups, count / 2);  // 1.3 is nearer 1.5 than 1: up with probability 0.6
}

TEST(BlockScaledQuantize, ResultsDoNotDependOnTheThreadCount) {
  for (const std::string spec : {"nvfp4", "nvfp4:2d", "e4m3:block=128x128"}) {
    const Format f = MustParse(spec);
    const size_t cols = 272;
    const std::vector<float> x = MatrixInputs(700, cols, 17, true);  // > one 64 Ki chunk
    std::vector<float> a(x.size()), b(x.size());
    QuantStats sa, sb;
    QuantizeOptions opts;
    opts.columns = cols;
    opts.rounding = Rounding::kStochastic;
    opts.threads = 1;
    ASSERT_TRUE(Quantize(f, x.data(), a.data(), x.size(), opts, &sa).ok());
    opts.threads = 4;
    ASSERT_TRUE(Quantize(f, x.data(), b.data(), x.size(), opts, &sb).ok());
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << spec;
    EXPECT_EQ(sa.sq_error, sb.sq_error) << spec;
    EXPECT_EQ(sa.saturated, sb.saturated) << spec;
    EXPECT_EQ(sa.nonfinite, 2u) << spec;
  }
}

TEST(BlockScaledCodec, DecodeOfEncodeIsQuantize) {
  for (const std::string spec :
       {"nvfp4", "nvfp4:2d", "e4m3:block=1x128", "e4m3:block=128x128", "e2m1:block=32:scale=e8m0",
        "e2m1:block=4x8:scale=e5m2:tensor", "e5m2:block=3x5:scale=bf16",
        "e4m3:block=1x16:scale=e4m3", "e4m3:block=tensor"}) {
    const Format f = MustParse(spec);
    for (size_t cols : {size_t(40), size_t(129)}) {
      const std::vector<float> x = MatrixInputs(600, cols, cols, true);
      QuantizeOptions opts;
      opts.columns = cols;
      std::vector<float> q(x.size()), d(x.size());
      ASSERT_TRUE(Quantize(f, x.data(), q.data(), x.size(), opts).ok());
      PackedTensor packed;
      ASSERT_TRUE(Encode(f, x.data(), x.size(), opts, &packed).ok());
      EXPECT_EQ(packed.bytes.size(), PackedSize(f, x.size(), 1, cols));
      ASSERT_TRUE(Decode(f, packed, d.data()).ok());
      ExpectSame(spec + " codec, columns " + std::to_string(cols), x, q, d);
      packed.bytes.pop_back();
      EXPECT_FALSE(Decode(f, packed, d.data()).ok());
    }
  }
}

// Quantize computes 1 x C block scales piece by piece in L1 where it can (the row holds whole
// blocks, C divides the piece); Encode takes the two-pass path (every scale first). Values and
// statistics agree bit for bit, nearest and stochastic, across chunks of 64 Ki and threads.
TEST(BlockScaledQuantize, TheOnePassPathEqualsTheTwoPassPath) {
  for (const std::string spec : {"nvfp4", "e4m3:block=1x128", "e2m1:block=1x32:scale=e4m3"}) {
    for (const Rounding r : {Rounding::kNearest, Rounding::kStochastic}) {
      const std::vector<float> x = MatrixInputs(300, 512, 5, true);
      QuantizeOptions opts;
      opts.columns = 512;
      opts.rounding = r;
      opts.seed = 9;
      opts.threads = 2;
      const Format f = MustParse(spec);
      std::vector<float> q(x.size()), d(x.size());
      QuantStats sq, se;
      ASSERT_TRUE(Quantize(f, x.data(), q.data(), x.size(), opts, &sq).ok());
      PackedTensor packed;
      ASSERT_TRUE(Encode(f, x.data(), x.size(), opts, &packed, &se).ok());
      ASSERT_TRUE(Decode(f, packed, d.data()).ok());
      ExpectSame(spec + " one pass against two", x, d, q);
      EXPECT_EQ(sq.sq_error, se.sq_error) << spec;
      EXPECT_EQ(sq.sq_input, se.sq_input) << spec;
      EXPECT_EQ(sq.saturated, se.saturated) << spec;
      EXPECT_EQ(sq.flushed, se.flushed) << spec;
      EXPECT_EQ(sq.nonfinite, se.nonfinite) << spec;
    }
  }
}

TEST(BlockScaledHysteresis, RoundsTowardThePreviousValueUnderEachBlocksScale) {
  // Q_t = ceil(w) where w < Q_{t-1}, else floor(w), on each block's grid (Lee et al.).
  using kernels::RoundMode;
  struct Case {
    std::string spec;
    size_t rows, cols;
  };
  // Rows that end in a partial block (129 and 27 columns) or a partial 1x128 tile (160), 2D
  // blocks over a partial last block row (530 = 33 * 16 + 2), and a matrix of more than one
  // 64 Ki chunk, whose chunk boundary falls inside a row and inside a block.
  for (const Case& c : std::vector<Case>{{"nvfp4:2d", 40, 160},
                                         {"e4m3:block=1x128", 40, 160},
                                         {"nvfp4", 530, 129},
                                         {"nvfp4:2d", 530, 129},
                                         {"e2m1:block=4x8:scale=e5m2:tensor", 13, 27}}) {
    const std::string spec = c.spec + " " + std::to_string(c.rows) + "x" + std::to_string(c.cols);
    const Format f = MustParse(c.spec);
    const size_t cols = c.cols;
    const std::vector<float> w = MatrixInputs(c.rows, cols, 23, false);
    QuantizeOptions opts;
    opts.columns = cols;
    std::vector<float> prev(w.size());
    ASSERT_TRUE(Quantize(f, w.data(), prev.data(), w.size(), opts).ok());
    std::vector<float> w2 = w;
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> jitter(0.9f, 1.1f);
    for (float& v : w2) v *= jitter(rng);
    std::vector<float> q = prev;
    uint64_t flips = 0;
    QuantStats stats;
    ASSERT_TRUE(QuantizeHysteresis(f, w2.data(), q.data(), w2.size(), opts, &stats, &flips).ok());
    const std::vector<float> up = Restated<RoundMode::kUp>(f, w2, cols);
    const std::vector<float> down = Restated<RoundMode::kDown>(f, w2, cols);
    std::vector<float> want(w2.size());
    uint64_t want_flips = 0;
    double want_sq_error = 0.0;
    for (size_t i = 0; i < w2.size(); ++i) {
      want[i] = w2[i] < prev[i] ? up[i] : down[i];
      want_flips += Bits(want[i]) != Bits(prev[i]);
      want_sq_error += (double(want[i]) - w2[i]) * (double(want[i]) - w2[i]);
    }
    ExpectSame(spec + " hysteresis", w2, want, q);
    EXPECT_EQ(flips, want_flips) << spec;
    EXPECT_GT(flips, 0u) << spec;
    EXPECT_EQ(stats.count, w2.size()) << spec;
    EXPECT_NEAR(stats.sq_error, want_sq_error, 1e-9 * want_sq_error) << spec;
  }
}

}  // namespace
}  // namespace cpd::test
