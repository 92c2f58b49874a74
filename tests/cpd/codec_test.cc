// Encode/Decode: Decode(Encode(x)) equals Quantize(x) bit for bit for every family and width,
// the packed size is PackedSize(), metadata holds the group scales, wrong sizes are rejected;
// PackCodes/UnpackCodes against a bit-by-bit reference for every width 1..32.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpd/format.h"
#include "cpd/quantize.h"
#include "kernels/pack.h"
#include "tests/cpd/format_test_util.h"

namespace cpd::test {
namespace {

const std::vector<std::string>& CodecSpecs() {
  static const std::vector<std::string> specs = {"fp32",          "fp32:nosub",
                                                 "bf16",          "bf16:inf",
                                                 "fp16",          "fp16:inf",
                                                 "e4m3",          "e4m3:inf",
                                                 "e4m3:ieee",     "e5m2",
                                                 "e5m2:inf",      "e3m2",
                                                 "e2m3",          "e2m1",
                                                 "e4m0",          "e3m0",
                                                 "e5m10",         "e8m23",
                                                 "e1m3",          "e2m5:nosub",
                                                 "e6m9",          "e8m1",
                                                 "fp134",         "fp143:ch",
                                                 "fp152:room=3",  "fp134:room=-2:ch",
                                                 "log2",          "log4",
                                                 "log5:ch",       "log8",
                                                 "int2",          "int7",
                                                 "int8",          "int8:ch",
                                                 "int16",         "uint2:minmax",
                                                 "uint5:minmax",  "uint8:minmax:ch",
                                                 "uint16:minmax", "mxfp8",
                                                 "mxfp6",         "mxfp4",
                                                 "bfp2:3",        "bfp3:5",
                                                 "bfp4:7",        "bfp8:16",
                                                 "bfp16:3",       "bfp5:1"};
  return specs;
}

// Per-binade lists: a float, a gapped list per channel, a 9-bit hybrid, the 2-bit list and a
// 16-bit one.
const std::vector<std::string>& BinadeCodecSpecs() {
  static const std::vector<std::string> specs = {"binades:4x7,3,2,1,0", "binades:3,3,3:ch",
                                                 "binades:5,5,4x5,3,2,1,0:room=0", "binades:0",
                                                 "binades:14,13:room=3"};
  return specs;
}

// Inputs with a spread of magnitudes (so that groups get different scales), exact zeros,
// subnormals, and (every 97th element) a non-finite value.
std::vector<float> CodecInputs(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) {
    const float scale = std::ldexp(1.0f, int((i / 37) % 23) - 11);
    x[i] = normal(rng) * scale;
    switch (rng() % 97) {
      case 0:
        x[i] = 0.0f;
        break;
      case 1:
        x[i] = -0.0f;
        break;
      case 2:
        x[i] = 1e-40f;
        break;
      case 3:
        x[i] = (i % 3 == 0) ? NAN : (i % 3 == 1 ? INFINITY : -INFINITY);
        break;
      case 4:
        x[i] = 1e5f;
        break;
      default:
        break;
    }
  }
  return x;
}

// The smallest of a few divisors of n (channel count for :ch formats), or 1.
struct CodecCase {
  std::string spec;
  size_t n;
};

void PrintTo(const CodecCase& c, std::ostream* os) { *os << c.spec << " n=" << c.n; }

std::vector<CodecCase> CodecCases() {
  std::vector<CodecCase> cases;
  std::vector<std::string> specs = CodecSpecs();
  specs.insert(specs.end(), BinadeCodecSpecs().begin(), BinadeCodecSpecs().end());
  for (const std::string& s : specs) {
    for (size_t n : {size_t(0), size_t(1), size_t(7), size_t(33), size_t(65536 + 13)}) {
      cases.push_back({s, n});
    }
  }
  return cases;
}

class CodecTest : public ::testing::TestWithParam<CodecCase> {};

TEST_P(CodecTest, DecodeOfEncodeEqualsQuantize) {
  const CodecCase& c = GetParam();
  const Format f = MustParse(c.spec);
  const std::vector<float> x = CodecInputs(c.n, 1234 + c.n);
  for (Rounding r : {Rounding::kNearest, Rounding::kZero, Rounding::kStochastic}) {
    QuantizeOptions opts;
    opts.rounding = r;
    opts.seed = 99;
    opts.step = 3;
    opts.channels = ChannelsFor(f, c.n);
    QuantStats qs, es;
    const std::vector<float> q = Q(f, x, opts, &qs);
    PackedTensor p;
    ASSERT_TRUE(Encode(f, x.data(), x.size(), opts, &p, &es).ok());
    EXPECT_EQ(p.count, c.n);
    EXPECT_EQ(p.channels, opts.channels);
    const size_t groups = f.num_groups(c.n, opts.channels);
    EXPECT_EQ(p.bytes.size(), PackedSize(f, c.n, opts.channels));
    EXPECT_EQ(PackedSize(f, c.n, opts.channels),
              (c.n * size_t(f.bits()) + 7) / 8 + groups * f.meta_bytes_per_group());
    EXPECT_EQ(PackedCodeBytes(f, c.n), (c.n * size_t(f.bits()) + 7) / 8);
    for (int threads : {1, 2}) {
      std::vector<float> d(c.n, 12345.0f);
      Status s = Decode(f, p, d.data(), threads);
      ASSERT_TRUE(s.ok()) << s.message();
      MismatchCounter bad(c.spec + "/" + RoundingName(r) + " threads=" + std::to_string(threads));
      for (size_t i = 0; i < c.n; ++i) {
        if (!SameResult(d[i], q[i])) {
          bad.Add() << "i = " << i << ", x = " << Show(x[i]) << ": Quantize " << Show(q[i])
                    << ", Decode(Encode) " << Show(d[i]);
        }
      }
    }
    // Encode's statistics are Quantize's.
    EXPECT_EQ(es.count, qs.count);
    EXPECT_EQ(Bits(es.max_abs), Bits(qs.max_abs));
    EXPECT_EQ(es.saturated, qs.saturated);
    EXPECT_EQ(es.flushed, qs.flushed);
    EXPECT_EQ(es.nonfinite, qs.nonfinite);
    EXPECT_EQ(es.sq_error, qs.sq_error);
    EXPECT_EQ(es.sq_input, qs.sq_input);
  }
}

TEST_P(CodecTest, DecodeRejectsWrongSizes) {
  const CodecCase& c = GetParam();
  const Format f = MustParse(c.spec);
  const std::vector<float> x = CodecInputs(c.n, 7);
  QuantizeOptions opts;
  opts.channels = ChannelsFor(f, c.n);
  PackedTensor p;
  ASSERT_TRUE(Encode(f, x.data(), x.size(), opts, &p).ok());
  std::vector<float> d(c.n + 1);
  {
    PackedTensor longer = p;
    longer.bytes.push_back(0);
    Status s = Decode(f, longer, d.data());
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find(std::to_string(p.bytes.size())), std::string::npos) << s.message();
  }
  if (!p.bytes.empty()) {
    PackedTensor shorter = p;
    shorter.bytes.pop_back();
    EXPECT_FALSE(Decode(f, shorter, d.data()).ok());
  }
  {
    // A count that does not match the bytes (unless it happens to need the same size).
    PackedTensor wrong = p;
    wrong.count = c.n + 64;
    if (f.scope() == ScaleScope::kChannel) wrong.channels = 1;
    if (PackedSize(f, wrong.count, wrong.channels) != p.bytes.size()) {
      std::vector<float> big(wrong.count);
      EXPECT_FALSE(Decode(f, wrong, big.data()).ok());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllFormats, CodecTest, ::testing::ValuesIn(CodecCases()),
                         [](const ::testing::TestParamInfo<CodecCase>& info) {
                           std::string name = info.param.spec;
                           for (char& ch : name) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return name + "_n" + std::to_string(info.param.n);
                         });

// The width of each element code is the format's bit count, odd widths included.
TEST(Codec, OddWidthsAreDenselyPacked) {
  const std::pair<const char*, int> widths[] = {
      {"e3m2", 6},  {"e2m1", 4},         {"e4m0", 5}, {"e5m10", 16}, {"bfp3:5", 3},
      {"int7", 7},  {"uint5:minmax", 5}, {"log5", 5}, {"fp32", 32},  {"e8m1", 10},
      {"e6m9", 16}, {"log2", 2},         {"int2", 2}, {"e2m0", 3},   {"e3m3:nosub", 7}};
  const std::pair<const char*, int> binade_widths[] = {{"binades:3,3,3", 6},
                                                       {"binades:5,5,4x5,3,2,1,0", 9},
                                                       {"binades:0", 2},
                                                       {"binades:14,13", 16}};
  for (const auto& [spec, bits] : widths) {
    const Format f = MustParse(spec);
    EXPECT_EQ(f.bits(), bits) << spec;
    EXPECT_EQ(PackedCodeBytes(f, 1000), (1000u * bits + 7) / 8) << spec;
  }
  for (const auto& [spec, bits] : binade_widths) {
    const Format f = MustParse(spec);
    EXPECT_EQ(f.bits(), bits) << spec;
    EXPECT_EQ(PackedCodeBytes(f, 1000), (1000u * bits + 7) / 8) << spec;
  }
}

TEST(Codec, ChannelCountMustDivideN) {
  const Format f = MustParse("int8:ch");
  const std::vector<float> x(10, 1.0f);
  QuantizeOptions opts;
  opts.channels = 3;
  PackedTensor p;
  EXPECT_FALSE(Encode(f, x.data(), x.size(), opts, &p).ok());
  std::vector<float> out(10);
  EXPECT_FALSE(Quantize(f, x.data(), out.data(), x.size(), opts).ok());
  opts.channels = 0;
  EXPECT_FALSE(Quantize(MustParse("e4m3"), x.data(), out.data(), x.size(), opts).ok());
}

// Per-channel storage is never sized by a channel count beyond the data: an empty span with
// 2^62 or 10^12 channels is refused (it used to allocate them: std::length_error, bad_alloc).
TEST(Codec, ChannelsBeyondTheElementCountAreRefusedBeforeAnyAllocation) {
  for (const char* spec : {"int8:ch", "log4:ch", "fp134:ch", "uint4:minmax:ch"}) {
    const Format f = MustParse(spec);
    for (size_t channels : {size_t(1) << 62, size_t(1000000000000), size_t(5)}) {
      QuantizeOptions opts;
      opts.channels = channels;
      const std::vector<float> x(channels == 5 ? 4 : 0, 1.0f);
      std::vector<float> out(x.size());
      const Status q = Quantize(f, x.data(), out.data(), x.size(), opts);
      EXPECT_EQ(q.code(), Status::Code::kInvalidArgument) << spec << " " << channels;
      EXPECT_NE(q.message().find("channels"), std::string::npos) << q.message();
      PackedTensor p;
      EXPECT_FALSE(Encode(f, x.data(), x.size(), opts, &p).ok()) << spec;
      EXPECT_FALSE(QuantizeHysteresis(f, x.data(), out.data(), x.size(), opts).ok()) << spec;
      p.count = x.size();
      p.channels = channels;
      EXPECT_FALSE(Decode(f, p, out.data()).ok()) << spec;
    }
    // One channel of nothing is an empty tensor, as before.
    QuantizeOptions one;
    EXPECT_TRUE(Quantize(f, nullptr, nullptr, 0, one).ok()) << spec;
  }
}

TEST(Codec, MetadataHoldsTheGroupScales) {
  {
    // int8: the float32 scale max|x| / 127.
    const Format f = MustParse("int8");
    const std::vector<float> x = {0.25f, -63.5f, 1.0f};
    PackedTensor p;
    ASSERT_TRUE(Encode(f, x.data(), x.size(), {}, &p).ok());
    ASSERT_EQ(p.bytes.size(), 3u + 4u);
    float scale;
    std::memcpy(&scale, p.bytes.data() + 3, 4);
    EXPECT_EQ(scale, 0.5f);
    EXPECT_EQ(p.bytes[1], uint8_t(-127 + 127));  // code = q - qmin
    EXPECT_EQ(p.bytes[2], uint8_t(2 + 127));
  }
  {
    // uint4:minmax: float32 min, then float32 scale (max - min) / 15.
    const Format f = MustParse("uint4:minmax");
    const std::vector<float> x = {-1.0f, 14.0f, 3.0f};
    PackedTensor p;
    ASSERT_TRUE(Encode(f, x.data(), x.size(), {}, &p).ok());
    ASSERT_EQ(p.bytes.size(), 2u + 8u);
    float lo, scale;
    std::memcpy(&lo, p.bytes.data() + 2, 4);
    std::memcpy(&scale, p.bytes.data() + 6, 4);
    EXPECT_EQ(lo, -1.0f);
    EXPECT_EQ(scale, 1.0f);
    EXPECT_EQ(p.bytes[0], 0x0f << 4 | 0x0);  // codes 0, 15
    EXPECT_EQ(p.bytes[1], 4);                // code 4 (3 = -1 + 4)
  }
  {
    // mxfp4: the E8M0 byte, shift + 127, shift = floor(log2 max|block|) - 2.
    const Format f = MustParse("mxfp4");
    std::vector<float> x(40, 0.0f);
    x[0] = 48.0f;     // block 0: shift 3
    x[33] = -0.375f;  // block 1: shift -4
    PackedTensor p;
    ASSERT_TRUE(Encode(f, x.data(), x.size(), {}, &p).ok());
    ASSERT_EQ(p.bytes.size(), 20u + 2u);
    EXPECT_EQ(p.bytes[20], 127 + 3);
    EXPECT_EQ(p.bytes[21], 127 - 4);
    EXPECT_EQ(p.bytes[0] & 0xf, 0x7);        // 48 = 6 * 2^3: max code
    EXPECT_EQ(p.bytes[16] >> 4, 0x8 | 0x7);  // -0.375 = -6 * 2^-4
  }
  {
    // fp134 (room 1): the signed shift floor(log2 max|x|) + 1.
    const Format f = MustParse("fp134");
    const std::vector<float> x = {0.75f, -0.1f};
    PackedTensor p;
    ASSERT_TRUE(Encode(f, x.data(), x.size(), {}, &p).ok());
    ASSERT_EQ(p.bytes.size(), 3u);
    EXPECT_EQ(int8_t(p.bytes[2]), 0);
    const Format g = MustParse("fp134:room=-2");
    ASSERT_TRUE(Encode(g, x.data(), x.size(), {}, &p).ok());
    EXPECT_EQ(int8_t(p.bytes[2]), -3);
  }
  {
    // binades (room 1): the signed shift floor(log2 max|x|) + 1, per channel with :ch.
    const Format f = MustParse("binades:3,3,3:ch");
    const std::vector<float> x = {0.75f, -0.1f, 1e-30f, 40.0f};
    QuantizeOptions o;
    o.channels = 2;
    PackedTensor p;
    ASSERT_TRUE(Encode(f, x.data(), x.size(), o, &p).ok());
    ASSERT_EQ(p.bytes.size(), 3u + 2u);  // four 6-bit codes, two shift bytes
    EXPECT_EQ(int8_t(p.bytes[3]), 0);
    EXPECT_EQ(int8_t(p.bytes[4]), 6);
    // 0.75 = 1.5 * 2^-1: binade 1 of a 3,3,3 grid at shift 0, code 9 + 4.
    EXPECT_EQ(p.bytes[0] & 0x3f, 13);
  }
}

// ---- PackCodes / UnpackCodes
// --------------------------------------------------------------------- Bit-by-bit reference: code
// i occupies bits [i*bits, (i+1)*bits), little-endian.
std::vector<uint8_t> ReferencePack(const std::vector<uint32_t>& codes, int bits) {
  std::vector<uint8_t> out((codes.size() * size_t(bits) + 7) / 8, 0);
  for (size_t i = 0; i < codes.size(); ++i) {
    for (int b = 0; b < bits; ++b) {
      const size_t pos = i * size_t(bits) + size_t(b);
      if ((codes[i] >> b) & 1u) out[pos / 8] |= uint8_t(1u << (pos % 8));
    }
  }
  return out;
}

TEST(PackCodes, RoundTripAndLayoutForEveryWidth) {
  std::mt19937_64 rng(42);
  for (int bits = 1; bits <= 32; ++bits) {
    const uint32_t mask = bits == 32 ? 0xffffffffu : (1u << bits) - 1u;
    for (size_t n : {0, 1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 33, 64, 1000, 1001}) {
      std::vector<uint32_t> codes(n);
      for (size_t i = 0; i < n; ++i) {
        // Random codes, with the extremes 0 and all-ones mixed in.
        const uint64_t r = rng();
        codes[i] = (r % 7 == 0) ? mask : (r % 7 == 1) ? 0u : uint32_t(r >> 20) & mask;
      }
      const std::vector<uint8_t> ref = ReferencePack(codes, bits);
      // Guard bytes after the packed stream must survive.
      std::vector<uint8_t> dst(ref.size() + 8, 0xab);
      PackCodes(codes.data(), n, bits, dst.data());
      EXPECT_TRUE(std::equal(ref.begin(), ref.end(), dst.begin())) << "bits " << bits << " n " << n;
      for (size_t i = ref.size(); i < dst.size(); ++i) {
        ASSERT_EQ(dst[i], 0xab) << "bits " << bits << " n " << n << ": wrote past the end";
      }
      std::vector<uint32_t> back(n + 1, 0xdeadbeefu);
      UnpackCodes(ref.data(), n, bits, back.data());
      EXPECT_TRUE(std::equal(codes.begin(), codes.end(), back.begin()))
          << "bits " << bits << " n " << n;
      EXPECT_EQ(back[n], 0xdeadbeefu) << "bits " << bits << " n " << n;
    }
  }
}

// The device codec's packing unit (kernels/pack.h, what one GPU thread does), run here on the
// host: a stream packed unit by unit (unit u at byte u * bits, the kernels' addressing) equals
// PackCodes' bytes, nothing is written past it, and unpacking it unit by unit gives the codes
// back; for every width, every length of the last unit, byte and 32-bit word access.
TEST(PackCodes, DeviceUnitsMatchPackCodes) {
  std::mt19937_64 rng(7);
  for (int bits = 1; bits <= 32; ++bits) {
    const uint32_t mask = kernels::CodeMask(bits);
    for (size_t n : {1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 29, 64, 77}) {
      std::vector<uint32_t> codes(n);
      for (size_t i = 0; i < n; ++i) {
        const uint64_t r = rng();
        codes[i] = (r % 7 == 0) ? mask : (r % 7 == 1) ? 0u : uint32_t(r >> 20) & mask;
      }
      const std::vector<uint8_t> ref = ReferencePack(codes, bits);
      const size_t units = (n + kernels::kUnitCodes - 1) / kernels::kUnitCodes;
      for (bool words : {false, true}) {
        if (words && bits % 4 != 0) continue;
        const std::string what =
            "bits " + std::to_string(bits) + " n " + std::to_string(n) + (words ? " words" : "");
        std::vector<uint32_t> storage((ref.size() + 8) / 4 + 1);  // 4-byte aligned bytes
        uint8_t* dst = reinterpret_cast<uint8_t*>(storage.data());
        std::memset(dst, 0xab, storage.size() * 4);
        std::vector<uint32_t> back(units * kernels::kUnitCodes, 0xdeadbeefu);
        for (size_t u = 0; u < units; ++u) {
          const size_t first = u * kernels::kUnitCodes;
          const int len = int(std::min<size_t>(kernels::kUnitCodes, n - first));
          uint32_t unit[kernels::kUnitCodes] = {};
          for (int k = 0; k < len; ++k) unit[k] = codes[first + size_t(k)];
          kernels::StoreCodeUnit(unit, len, bits, words, dst + u * size_t(bits));
          uint32_t got[kernels::kUnitCodes];
          kernels::LoadCodeUnit(ref.data() + u * size_t(bits), len, bits,
                                words && (reinterpret_cast<uintptr_t>(ref.data()) & 3u) == 0, got);
          for (int k = 0; k < kernels::kUnitCodes; ++k) back[first + size_t(k)] = got[k];
        }
        EXPECT_TRUE(std::equal(ref.begin(), ref.end(), dst)) << what;
        for (size_t i = ref.size(); i < storage.size() * 4; ++i) {
          ASSERT_EQ(dst[i], 0xab) << what << ": wrote past the end";
        }
        for (size_t i = 0; i < back.size(); ++i) {
          ASSERT_EQ(back[i], i < n ? codes[i] : 0u) << what << ": code " << i;
        }
      }
    }
  }
}

// The device codec's quads (kernels/pack.h): four codes of 4, 8, 16 or 32 bits per lane at byte
// q * bits / 2, the rest of the stream (n % 4 codes) as the last, short unit; packed quad by
// quad the stream equals PackCodes' bytes, and unpacked quad by quad it gives the codes back.
TEST(PackCodes, DeviceQuadsMatchPackCodes) {
  std::mt19937_64 rng(11);
  for (int bits : {4, 8, 16, 32}) {
    const int quad_bytes = bits / 2;
    ASSERT_EQ(kernels::QuadCodeBits(quad_bytes), bits);
    const uint32_t mask = kernels::CodeMask(bits);
    for (size_t n : {1, 2, 3, 4, 5, 6, 7, 8, 29, 64, 78}) {
      std::vector<uint32_t> codes(n);
      for (size_t i = 0; i < n; ++i) {
        const uint64_t r = rng();
        codes[i] = (r % 7 == 0) ? mask : (r % 7 == 1) ? 0u : uint32_t(r >> 20) & mask;
      }
      const std::vector<uint8_t> ref = ReferencePack(codes, bits);
      const std::string what = "bits " + std::to_string(bits) + " n " + std::to_string(n);
      std::vector<uint32_t> storage(ref.size() / 4 + 8);  // 16-byte quads need no more
      uint8_t* dst = reinterpret_cast<uint8_t*>(storage.data());
      std::memset(dst, 0xab, storage.size() * 4);
      const size_t quads = n / 4;
      std::vector<uint32_t> back(n, 0xdeadbeefu);
      for (size_t q = 0; q < quads; ++q) {
        const uint32_t four[4] = {codes[4 * q], codes[4 * q + 1], codes[4 * q + 2],
                                  codes[4 * q + 3]};
        kernels::StoreCodeQuad(four, quad_bytes, dst + q * size_t(quad_bytes));
        uint32_t got[4];
        kernels::LoadCodeQuad(ref.data() + q * size_t(quad_bytes), quad_bytes, got);
        for (int k = 0; k < 4; ++k) back[4 * q + size_t(k)] = got[k];
      }
      const int len = int(n - 4 * quads);
      if (len > 0) {
        uint32_t tail[kernels::kUnitCodes] = {};
        for (int k = 0; k < len; ++k) tail[k] = codes[4 * quads + size_t(k)];
        kernels::StoreCodeUnit(tail, len, bits, /*words=*/false, dst + quads * size_t(quad_bytes));
        uint32_t got[kernels::kUnitCodes];
        kernels::LoadCodeUnit(ref.data() + quads * size_t(quad_bytes), len, bits, false, got);
        for (int k = 0; k < len; ++k) back[4 * quads + size_t(k)] = got[k];
      }
      EXPECT_TRUE(std::equal(ref.begin(), ref.end(), dst)) << what;
      for (size_t i = ref.size(); i < storage.size() * 4; ++i) {
        ASSERT_EQ(dst[i], 0xab) << what << ": wrote past the end";
      }
      EXPECT_EQ(back, codes) << what;
    }
  }
}

}  // namespace
}  // namespace cpd::test
