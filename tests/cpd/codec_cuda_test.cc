// EncodeCuda / DecodeCuda against the CPU codec (cpd::Encode / cpd::Decode): the packed bytes
// equal Encode's byte for byte (codes, padding bits and scale metadata), DecodeCuda of those
// bytes equals Decode's values (and so Quantize's), for every format family the gradient
// all-reduce accepts, every rounding mode, counts 0, 1, odd and large, edge inputs, per-channel
// variants, and buffers at every alignment. Every test skips when no CUDA device is present.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cpd/format.h"
#include "cpd/quantize.h"
#include "cpd/quantize_cuda.h"
#include "tests/cpd/format_test_util.h"

namespace cpd::test {
namespace {

// Device memory of `bytes` bytes plus 64 guard bytes, filled with kGuard so that writes outside
// a packed tensor show.
constexpr uint8_t kGuard = 0xab;

class DeviceBytes {
 public:
  explicit DeviceBytes(size_t bytes) : bytes_(bytes + 64) {
    EXPECT_EQ(cudaMalloc(&ptr_, bytes_), cudaSuccess);
    Fill();
  }
  ~DeviceBytes() { cudaFree(ptr_); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;

  uint8_t* at(size_t offset = 0) const { return static_cast<uint8_t*>(ptr_) + offset; }
  float* floats(size_t offset_floats = 0) const {
    return reinterpret_cast<float*>(ptr_) + offset_floats;
  }
  void Fill() const { EXPECT_EQ(cudaMemset(ptr_, kGuard, bytes_), cudaSuccess); }
  void Upload(const void* src, size_t bytes, size_t offset = 0) const {
    ASSERT_LE(offset + bytes, bytes_);
    if (bytes == 0) return;
    ASSERT_EQ(cudaMemcpy(at(offset), src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<uint8_t> Download(size_t bytes, size_t offset = 0) const {
    std::vector<uint8_t> h(bytes);
    EXPECT_LE(offset + bytes, bytes_);
    if (bytes > 0) {
      EXPECT_EQ(cudaMemcpy(h.data(), at(offset), bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return h;
  }
  std::vector<float> DownloadFloats(size_t n, size_t offset_floats) const {
    const std::vector<uint8_t> b = Download(n * sizeof(float), offset_floats * sizeof(float));
    std::vector<float> f(n);
    if (n > 0) std::memcpy(f.data(), b.data(), b.size());
    return f;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

// Inputs with everything a codec must carry: first a run of edge values (NaN of both signs and
// several payloads, +-Inf, +-0, the float32 subnormal extremes, FLT_MIN, +-FLT_MAX, ties and
// overflow thresholds of small grids), then random values whose magnitude changes every 32
// elements (so shared shifts differ per block and channel) mixed with more of the same; plus
// runs of signed zeros, of NaN and of tiny values, so some groups are degenerate.
std::vector<float> MakeInput(size_t n, uint32_t seed) {
  const float edges[] = {FromBits(0x7fc00000u),
                         FromBits(0xffc00000u),
                         FromBits(0x7f800001u),
                         FromBits(0xff812345u),
                         INFINITY,
                         -INFINITY,
                         0.0f,
                         -0.0f,
                         FromBits(1u),
                         -FromBits(1u),
                         FromBits(0x007fffffu),
                         -FromBits(0x007fffffu),
                         FLT_MIN,
                         -FLT_MIN,
                         FLT_MAX,
                         -FLT_MAX,
                         448.0f,
                         464.0f,
                         -57344.0f,
                         61440.0f,
                         65504.0f,
                         65520.0f,
                         6.0f,
                         -6.5f,
                         0.25f,
                         -0.375f,
                         1.0f / 3.0f,
                         1e-30f,
                         -1e30f,
                         1.5f};
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> block_exp(-40, 40);
  std::vector<float> x(n);
  int e = 0;
  for (size_t i = 0; i < n; ++i) {
    if (i < sizeof(edges) / sizeof(edges[0])) {
      x[i] = edges[i];
      continue;
    }
    if (i % 32 == 0) e = block_exp(rng);
    const float r = uni(rng);
    const float sign = uni(rng) < 0.5f ? -1.0f : 1.0f;
    if (r < 0.02f) {
      x[i] = FromBits((uni(rng) < 0.5f ? 0x7f800001u : 0xffc00000u) | (rng() & 0x3fffffu));
    } else if (r < 0.03f) {
      x[i] = sign * INFINITY;
    } else if (r < 0.06f) {
      x[i] = sign * 0.0f;
    } else if (r < 0.09f) {
      x[i] = FromBits(rng() & 0x807fffffu);  // subnormal (or zero)
    } else if (r < 0.15f) {
      x[i] = sign * (float(int(uni(rng) * 64.0f)) + 0.5f) * std::ldexp(1.0f, int(rng() % 12) - 8);
    } else if (r < 0.17f) {
      x[i] = sign * FromBits(0x7e000000u | (rng() & 0x00ffffffu));  // up to ~FLT_MAX
    } else {
      x[i] = normal(rng) * std::ldexp(1.0f, e);
    }
  }
  if (n >= 400) {
    for (size_t i = 100; i < 164; ++i) x[i] = (i % 3 == 0) ? -0.0f : 0.0f;
    for (size_t i = 200; i < 264; ++i) x[i] = FromBits(0x7fc00000u);
    for (size_t i = 300; i < 332; ++i) x[i] = std::ldexp(1.0f, -140) * float(i % 4);
  }
  return x;
}

// Every family the gradient all-reduce accepts: fixed float grids (eXmY, OCP FP8/FP6/FP4, fp16,
// bf16, fp32), int<b>[:ch], uint<b>:minmax[:ch], MX, bfp (power-of-two, odd and 1-element
// blocks), the shared-shift fp134/fp143/fp152 and log<b>, at widths 2..32 bits.
const char* const kFormats[] = {
    "e4m3",         "e4m3:inf",     "e5m2",   "e5m2:inf",     "e3m2",
    "e2m3",         "e2m1",         "e3m0",   "bf16",         "fp16:inf",
    "fp32",         "fp32:nosub",   "e8m1",   "e2m5:nosub",   "fp134",
    "fp143:ch",     "fp152:room=2", "log4",   "log8",         "int8",
    "int4:ch",      "int2",         "int16",  "uint4:minmax", "uint8:minmax:ch",
    "uint5:minmax", "mxfp8",        "mxfp6",  "mxfp4",        "bfp8:16",
    "bfp6:24",      "bfp3:5",       "bfp5:1", "log4:ch",
};

// Per-binade lists: fp134's list, a gapped per-channel list (9 bits), a small-range one, the
// 2-bit list and a 16-bit one.
const char* const kBinadeFormats[] = {"binades:4x7,3,2,1,0", "binades:5,5,4x5,3,2,1,0:room=0:ch",
                                      "binades:3,3,3:room=2", "binades:0", "binades:14,13:room=3"};

const size_t kSizes[] = {0, 1, 7, 33, 34, 1000, 65536 + 13, (size_t(1) << 20) + 3};

std::string ShowBytes(const std::vector<uint8_t>& b, size_t i) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "0x%02x", unsigned(b[i]));
  return buf;
}

// The device bytes equal the CPU's, and nothing was written around them.
void ExpectSameBytes(const PackedTensor& want, const Format& format,
                     const std::vector<uint8_t>& got_with_guard, size_t guard_front,
                     const std::string& what) {
  const size_t size = want.bytes.size();
  const size_t code_bytes = PackedCodeBytes(format, want.count);
  MismatchCounter bad(what + ": packed bytes");
  for (size_t i = 0; i < size; ++i) {
    const uint8_t got = got_with_guard[guard_front + i];
    if (got != want.bytes[i]) {
      bad.Add() << (i < code_bytes ? "code byte " : "metadata byte ")
                << (i < code_bytes ? i : i - code_bytes) << ": cpu " << ShowBytes(want.bytes, i)
                << " gpu " << ShowBytes(got_with_guard, guard_front + i);
    }
  }
  for (size_t i = 0; i < got_with_guard.size(); ++i) {
    if (i >= guard_front && i < guard_front + size) continue;
    if (got_with_guard[i] != kGuard) {
      bad.Add() << "wrote outside the packed tensor, at offset " << int64_t(i - guard_front);
    }
  }
}

void ExpectSameValues(const std::vector<float>& want, const std::vector<float>& got,
                      const std::vector<float>& in, const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  MismatchCounter bad(what);
  for (size_t i = 0; i < want.size(); ++i) {
    if (!SameResult(want[i], got[i])) {
      bad.Add() << "element " << i << " (input " << Show(in[i]) << "): cpu " << Show(want[i])
                << " gpu " << Show(got[i]);
    }
  }
}

void ExpectSameStats(const QuantStats& want, const QuantStats& got, const std::string& what) {
  EXPECT_EQ(want.count, got.count) << what;
  EXPECT_EQ(Bits(want.max_abs), Bits(got.max_abs)) << what << ": max_abs";
  EXPECT_EQ(want.saturated, got.saturated) << what << ": saturated";
  EXPECT_EQ(want.flushed, got.flushed) << what << ": flushed";
  EXPECT_EQ(want.nonfinite, got.nonfinite) << what << ": nonfinite";
  // Double sums in a different order (cpd/quantize_cuda.h).
  const auto near = [](double a, double b) {
    return std::fabs(a - b) <= 1e-9 * std::max(std::fabs(a), std::fabs(b));
  };
  EXPECT_TRUE(near(want.sq_error, got.sq_error)) << what << ": sq_error";
  EXPECT_TRUE(near(want.sq_input, got.sq_input)) << what << ": sq_input";
}

using Param = FormatRounding;

// The rounding of a test over n elements: a fixed seed and step, and odd and even starts of the
// random stream (the kernels hash once per pair of elements, and from an odd start every vector
// of elements straddles pairs).
void SetRounding(Rounding rounding, size_t n, QuantizeOptions* opts) {
  opts->rounding = rounding;
  opts->seed = 42;
  opts->step = 7;
  opts->index_offset = 1000003 + n % 2;
}

// EncodeCuda and DecodeCuda of `in` against the CPU codec, through buffers at several
// alignments: input 16-byte aligned or one float off (the scalar load path), packed bytes 4-byte
// aligned or one byte off (the byte store/load path instead of 32-bit words), output aligned or
// one float off. Codes of 4, 8, 16 or 32 bits between aligned buffers take the
// 4-codes-per-lane kernels (encode in "aligned", decode in "aligned" and "mixed"), the others
// the 8-code units. Then without statistics (another kernel instantiation), on a stream, encode
// then decode device to device.
void ExpectCodecMatchesCpu(const Format& format, const std::vector<float>& in,
                           const QuantizeOptions& opts, const std::string& base) {
  const size_t n = in.size();
  // The reference: Encode, Decode(Encode) and Quantize on the CPU.
  PackedTensor want;
  QuantStats want_stats;
  ASSERT_TRUE(Encode(format, in.data(), n, opts, &want, &want_stats).ok()) << base;
  std::vector<float> want_values(n), quantized(n);
  ASSERT_TRUE(Decode(format, want, want_values.data()).ok()) << base;
  ASSERT_TRUE(Quantize(format, in.data(), quantized.data(), n, opts).ok()) << base;
  ExpectSameValues(quantized, want_values, in, base + ": cpu Decode(Encode) vs Quantize");
  const size_t size = want.bytes.size();
  ASSERT_EQ(size, PackedSize(format, n, opts.channels, opts.columns)) << base;

  DeviceBytes d_in((n + 1) * sizeof(float)), d_packed(size + 1), d_out((n + 1) * sizeof(float));
  struct Case {
    const char* name;
    size_t in_off, packed_off, out_off;  // floats, bytes, floats
  };
  const Case cases[] = {{"aligned", 0, 0, 0}, {"misaligned", 1, 1, 1}, {"mixed", 1, 0, 0}};
  for (const Case& c : cases) {
    const std::string what = base + " " + c.name;
    d_in.Upload(in.data(), n * sizeof(float), c.in_off * sizeof(float));
    d_packed.Fill();
    PackedTensorCuda packed;
    packed.bytes = d_packed.at(c.packed_off);
    packed.size = size;
    QuantStats got_stats;
    Status s = EncodeCuda(format, d_in.floats(c.in_off), n, opts, &packed, &got_stats);
    ASSERT_TRUE(s.ok()) << what << ": " << s.ToString();
    EXPECT_EQ(packed.count, n) << what;
    EXPECT_EQ(packed.channels, opts.channels) << what;
    EXPECT_EQ(packed.columns, opts.columns) << what;
    ExpectSameBytes(want, format, d_packed.Download(size + 1 + 64), c.packed_off, what);
    ExpectSameStats(want_stats, got_stats, what);

    // Decode the CPU's bytes, so a decode failure shows apart from an encode one.
    d_packed.Upload(want.bytes.data(), size, c.packed_off);
    d_out.Fill();
    s = DecodeCuda(format, packed, d_out.floats(c.out_off));
    ASSERT_TRUE(s.ok()) << what << ": " << s.ToString();
    ExpectSameValues(want_values, d_out.DownloadFloats(n, c.out_off), in, what + ": decode");
    if (n > 0) {
      // Nothing written past the last float.
      const std::vector<uint8_t> after = d_out.Download(4, (c.out_off + n) * sizeof(float));
      for (uint8_t b : after) EXPECT_EQ(b, kGuard) << what << ": decode wrote past the end";
    }
  }

  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  d_in.Upload(in.data(), n * sizeof(float));
  d_packed.Fill();
  PackedTensorCuda packed;
  packed.bytes = d_packed.at();
  packed.size = size;
  ASSERT_TRUE(EncodeCuda(format, d_in.floats(), n, opts, &packed, nullptr, stream).ok()) << base;
  ASSERT_TRUE(DecodeCuda(format, packed, d_out.floats(), stream).ok()) << base;
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  ExpectSameBytes(want, format, d_packed.Download(size + 64), 0, base + " stream");
  ExpectSameValues(quantized, d_out.DownloadFloats(n, 0), in,
                   base + " stream: DecodeCuda(EncodeCuda) vs Quantize");
}

class CodecCudaTest : public ::testing::TestWithParam<Param> {};

// The sizes leave every remainder mod 4 for the 4-codes-per-lane kernels' tail.
TEST_P(CodecCudaTest, MatchesCpuCodec) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const std::string spec = std::get<0>(GetParam());
  const Rounding rounding = std::get<1>(GetParam());
  const Format format = MustParse(spec);
  for (size_t n : kSizes) {
    QuantizeOptions opts;
    opts.channels = ChannelsFor(format, n, {8, 7, 5, 3});
    SetRounding(rounding, n, &opts);
    ExpectCodecMatchesCpu(format, MakeInput(n, 4321u + uint32_t(n)), opts,
                          spec + " " + RoundingName(rounding) + " n=" + std::to_string(n));
  }
}

// The "cuda" prefix makes every test name match `ctest -R cuda`.
INSTANTIATE_TEST_SUITE_P(cuda, CodecCudaTest, EveryRoundingOf(kFormats), FormatRoundingName);
INSTANTIATE_TEST_SUITE_P(cuda_binades, CodecCudaTest, EveryRoundingOf(kBinadeFormats),
                         FormatRoundingName);

// Block-scaled formats over matrix views (kBlockScaledShapes: partial edge blocks, contiguous
// blocks, few and many blocks, columns given or by channels); the bytes hold each block's scale
// metadata in block order, then the tensor level (an empty span's too).
class CodecCudaBlockScaledTest : public ::testing::TestWithParam<Param> {};

TEST_P(CodecCudaBlockScaledTest, MatchesCpuCodec) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const std::string spec = std::get<0>(GetParam());
  const Rounding rounding = std::get<1>(GetParam());
  const Format format = MustParse(spec);
  for (const MatrixShape& shape : kBlockScaledShapes) {
    const size_t n = shape.rows * shape.cols;
    QuantizeOptions opts = ShapeOptions(shape);
    SetRounding(rounding, n, &opts);
    ExpectCodecMatchesCpu(format, MakeInput(n, 4321u + uint32_t(n)), opts,
                          spec + " " + RoundingName(rounding) + " " + ShapeName(shape));
  }
}

INSTANTIATE_TEST_SUITE_P(cuda_block_scaled, CodecCudaBlockScaledTest,
                         EveryRoundingOf(kBlockScaledFormats), FormatRoundingName);

// Groups whose metadata comes from degenerate data (the scale step is QuantizeCuda's; here its
// result must also land in the bytes): per channel, signed zeros, NaN only, Inf only, a
// subnormal among zeros, a constant; and one large tensor of NaN then signed zeros, whose
// uint<b>:minmax offset is the zero the CPU's chunked reduction keeps.
class CodecCudaDegenerateTest : public ::testing::TestWithParam<const char*> {};

TEST_P(CodecCudaDegenerateTest, MatchesCpuCodec) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const Format format = MustParse(GetParam());
  const size_t n = 8 * 128;
  std::vector<float> small(n);
  std::mt19937 rng(7);
  for (size_t i = 0; i < n; ++i) {
    const size_t ch = i / 128, k = i % 128;
    const float zero = (rng() & 1) ? -0.0f : 0.0f;
    const float values[8] = {zero,
                             k % 5 == 0 ? 0.0f : -0.0f,
                             FromBits(0x7fc00000u),
                             k % 2 ? INFINITY : -INFINITY,
                             k == 17 ? FromBits(1) : (k % 3 ? -0.0f : 0.0f),
                             k % 4 == 0 ? NAN : -0.0f,
                             3.0f,
                             float(int(k) - 64) * 0.25f};
    small[i] = values[ch];
  }
  std::vector<float> big(300000);
  for (size_t i = 0; i < big.size(); ++i) {
    big[i] = i < 70000    ? FromBits(0x7fc00000u)
             : i < 131072 ? 0.0f
                          : (((i * 2654435761u) >> 7) % 2 ? -0.0f : 0.0f);
  }
  for (const std::vector<float>* data : {&small, &big}) {
    const size_t m = data->size();
    QuantizeOptions opts;
    opts.channels = m == n ? 8 : 1;
    const std::string what = std::string(GetParam()) + " n=" + std::to_string(m);
    PackedTensor want;
    ASSERT_TRUE(Encode(format, data->data(), m, opts, &want).ok()) << what;
    std::vector<float> want_values(m);
    ASSERT_TRUE(Decode(format, want, want_values.data()).ok()) << what;
    DeviceBytes d_in(m * sizeof(float)), d_packed(want.bytes.size()), d_out(m * sizeof(float));
    d_in.Upload(data->data(), m * sizeof(float));
    PackedTensorCuda packed;
    packed.bytes = d_packed.at();
    packed.size = want.bytes.size();
    ASSERT_TRUE(EncodeCuda(format, d_in.floats(), m, opts, &packed).ok()) << what;
    ExpectSameBytes(want, format, d_packed.Download(want.bytes.size() + 64), 0, what);
    ASSERT_TRUE(DecodeCuda(format, packed, d_out.floats()).ok()) << what;
    ExpectSameValues(want_values, d_out.DownloadFloats(m, 0), *data, what + ": decode");
  }
}

std::string SpecName(const ::testing::TestParamInfo<const char*>& info) {
  std::string name = info.param;
  for (char& ch : name) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(cuda, CodecCudaDegenerateTest,
                         ::testing::Values("uint4:minmax", "uint4:minmax:ch", "uint8:minmax",
                                           "int8:ch", "fp134:ch", "log4:ch", "bfp8:16", "mxfp4",
                                           "binades:3,3,3:ch"),
                         SpecName);
// Block-scaled formats view the small span as 8 rows of 128 (columns 0, 8 channels).
INSTANTIATE_TEST_SUITE_P(cuda_block_scaled, CodecCudaDegenerateTest,
                         ::testing::Values("nvfp4", "nvfp4:2d", "e4m3:block=1x128",
                                           "e2m1:block=4x8:scale=e5m2:tensor",
                                           "e5m2:inf:block=1x32:scale=e4m3", "e4m3:block=tensor"),
                         SpecName);

// Arguments are refused before any work: a buffer whose size is not PackedSize, null buffers,
// channels that do not divide n; a packed tensor of the wrong size is Corruption, as in Decode.
TEST(CodecCudaArguments, RefusesBadArguments) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const Format format = MustParse("int8:ch");
  const size_t n = 16;
  DeviceBytes d_in(n * sizeof(float)), d_packed(64);
  QuantizeOptions opts;
  opts.channels = 2;
  const size_t size = PackedSize(format, n, opts.channels);
  PackedTensorCuda packed;
  packed.bytes = d_packed.at();
  packed.size = size + 1;
  EXPECT_EQ(EncodeCuda(format, d_in.floats(), n, opts, &packed).code(),
            Status::Code::kInvalidArgument);
  packed.size = size;
  EXPECT_EQ(EncodeCuda(format, nullptr, n, opts, &packed).code(), Status::Code::kInvalidArgument);
  EXPECT_EQ(EncodeCuda(format, d_in.floats(), n, opts, nullptr).code(),
            Status::Code::kInvalidArgument);
  opts.channels = 3;
  EXPECT_EQ(EncodeCuda(format, d_in.floats(), n, opts, &packed).code(),
            Status::Code::kInvalidArgument);
  opts.channels = 2;
  ASSERT_TRUE(EncodeCuda(format, d_in.floats(), n, opts, &packed).ok());
  PackedTensorCuda wrong = packed;
  wrong.size = size - 1;
  EXPECT_EQ(DecodeCuda(format, wrong, d_in.floats()).code(), Status::Code::kCorruption);
  wrong = packed;
  wrong.count = n + 8;
  EXPECT_EQ(DecodeCuda(format, wrong, d_in.floats()).code(), Status::Code::kCorruption);
  EXPECT_EQ(DecodeCuda(format, packed, nullptr).code(), Status::Code::kInvalidArgument);
  // The device is still usable afterwards.
  EXPECT_TRUE(DecodeCuda(format, packed, d_in.floats()).ok());
}

// A block-scaled tensor's size depends on its matrix view: columns that do not divide the span
// are refused, and a packed tensor read with other columns (other blocks) is Corruption.
TEST(CodecCudaArguments, BlockScaledColumns) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const Format format = MustParse("nvfp4:2d");
  const size_t n = 64;
  DeviceBytes d_in(n * sizeof(float)), d_packed(64);
  QuantizeOptions opts;
  opts.columns = 7;
  PackedTensorCuda packed;
  packed.bytes = d_packed.at();
  packed.size = PackedSize(format, n, 1, 32);
  EXPECT_EQ(EncodeCuda(format, d_in.floats(), n, opts, &packed).code(),
            Status::Code::kInvalidArgument);
  EXPECT_EQ(QuantizeCuda(format, d_in.floats(), d_in.floats(), n, opts).code(),
            Status::Code::kInvalidArgument);
  opts.columns = 32;  // 2 rows: one 16x16 block row, two block columns
  ASSERT_TRUE(EncodeCuda(format, d_in.floats(), n, opts, &packed).ok());
  EXPECT_EQ(packed.columns, 32u);
  PackedTensorCuda wrong = packed;
  wrong.columns = 16;  // 4 rows of one block
  EXPECT_EQ(DecodeCuda(format, wrong, d_in.floats()).code(), Status::Code::kCorruption);
  wrong.columns = 7;
  EXPECT_EQ(DecodeCuda(format, wrong, d_in.floats()).code(), Status::Code::kInvalidArgument);
  EXPECT_TRUE(DecodeCuda(format, packed, d_in.floats()).ok());
}

}  // namespace
}  // namespace cpd::test
