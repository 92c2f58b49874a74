// The device kernels of the quantised all-reduce (comm/reduce_kernels_cuda.h) against the CPU
// reducer's element loops (comm/reduce_kernels.h, kernels::QuantizeFloatGrid), bit for bit: the
// max|g| / non-finite scan, the APS scaling, packed's decode + sum + one re-quantisation + pack,
// and emulate's sum rounded after every addition (plain and Kahan). The CPU references below run
// the CPU functions in the order comm/allreduce/{packed,emulate}.cc run them, with the streams of
// comm/allreduce/streams.h. Counts 0, 1, odd and large; W = 1..8; e4m3, e5m2, e3m0 (APS's 4-bit),
// fp16, bf16; nearest, stochastic and toward-zero rounding; APS shifts; NaN/Inf contributions;
// unaligned buffers. Every test skips when no CUDA device is present.
#include "comm/reduce_kernels_cuda.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "comm/allreduce/streams.h"
#include "comm/reduce_kernels.h"
#include "cpd/format.h"
#include "cpd/quantize.h"
#include "cpd/quantize_cuda.h"
#include "kernels/grid.h"
#include "kernels/quantize_cpu.h"

namespace cpd::comm::internal {
namespace {

using kernels::RoundMode;

#define SKIP_WITHOUT_GPU() \
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device"

constexpr const char* kFormats[] = {"e4m3", "e5m2", "e3m0", "fp16", "bf16"};
constexpr RoundMode kModes[] = {RoundMode::kNearestEven, RoundMode::kStochastic,
                                RoundMode::kTowardZero};
constexpr std::size_t kCounts[] = {0, 1, 7, 13, 2048 + 5, 100003};

std::uint32_t Bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Device memory holding a copy of a host vector (plus `slack` bytes), copied back on demand.
class DeviceBytes {
 public:
  explicit DeviceBytes(std::size_t bytes) : bytes_(bytes == 0 ? 1 : bytes) {
    EXPECT_EQ(cudaMalloc(&ptr_, bytes_), cudaSuccess);
    EXPECT_EQ(cudaMemset(ptr_, 0xab, bytes_), cudaSuccess);
  }
  ~DeviceBytes() { cudaFree(ptr_); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;

  std::uint8_t* data() { return static_cast<std::uint8_t*>(ptr_); }
  void Upload(const void* src, std::size_t bytes, std::size_t offset = 0) {
    ASSERT_LE(offset + bytes, bytes_);
    ASSERT_EQ(cudaMemcpy(data() + offset, src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  }
  void Download(void* dst, std::size_t bytes, std::size_t offset = 0) {
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_LE(offset + bytes, bytes_);
    ASSERT_EQ(cudaMemcpy(dst, data() + offset, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_;
};

std::size_t CodeBytes(const Format& f, std::size_t n) {
  return (n * std::size_t(f.bits()) + 7) / 8;
}

// Gradient-like values: normal with a spread of magnitudes, some zeros and tiny values.
std::vector<float> RandomGradient(std::size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-30, 4), kind(0, 15);
  std::vector<float> x(n);
  for (float& v : x) {
    const int k = kind(rng);
    v = k == 0 ? 0.0f : std::ldexp(normal(rng), k == 1 ? -40 : exponent(rng) / 4);
  }
  return x;
}

// The packed codes of x * scale, as CodeTransport::EncodePiece writes a contribution.
std::vector<std::uint8_t> EncodeContribution(const Format& f, const std::vector<float>& x,
                                             float scale, const kernels::LoopParams& p) {
  const std::size_t n = x.size();
  std::vector<std::uint8_t> out(CodeBytes(f, n) + 1, 0);
  if (f.bits() <= 8) {
    std::vector<std::uint8_t> codes(n);
    EncodeCodes8(x.data(), n, scale, f.grid(), p, codes.data(), nullptr, false);
    PackSmallCodes(codes.data(), n, f.bits(), out.data());
  } else {
    std::vector<std::uint16_t> codes(n);
    EncodeCodes16(x.data(), n, scale, f.grid(), p, codes.data(), nullptr, false);
    PackSmallCodes(codes.data(), n, f.bits(), out.data());
  }
  out.resize(CodeBytes(f, n));
  return out;
}

// Every code of the format, NaN and Inf codes included, in random order.
std::vector<std::uint8_t> RandomCodes(const Format& f, std::size_t n, std::mt19937& rng) {
  std::uniform_int_distribution<std::uint32_t> code(0, (1u << f.bits()) - 1u);
  std::vector<std::uint32_t> codes(n);
  for (std::uint32_t& c : codes) c = code(rng);
  std::vector<std::uint8_t> out(CodeBytes(f, n) + 8, 0);
  PackCodes(codes.data(), n, f.bits(), out.data());
  out.resize(CodeBytes(f, n));
  return out;
}

kernels::LoopParams Loop(RoundMode mode, std::uint64_t seed, std::int64_t stage, std::int64_t step,
                         std::size_t index) {
  kernels::LoopParams p;
  p.mode = mode;
  p.rng_key = kernels::MakeRandomKey(RoundingSeed(seed, stage), std::uint64_t(step));
  p.index_base = index;
  return p;
}

// W contributions laid out as the all-to-all's receive buffer: worker w's codes at w * stride.
struct Contributions {
  std::vector<std::vector<std::uint8_t>> codes;
  std::size_t n = 0;
};

Contributions MakeContributions(const Format& f, std::size_t n, int workers, bool edge,
                                std::uint64_t seed, std::size_t index_base, std::mt19937& rng) {
  Contributions c;
  c.n = n;
  for (int w = 0; w < workers; ++w) {
    if (edge) {
      c.codes.push_back(RandomCodes(f, n, rng));
    } else {
      // An APS-like shift so that the sum of W contributions stays in range, as the reducer's.
      const float scale = kernels::Pow2(w % 3 - 1);
      c.codes.push_back(EncodeContribution(
          f, RandomGradient(n, rng), scale,
          Loop(RoundMode::kStochastic, seed, ContributionStage(w), 3, index_base)));
    }
  }
  return c;
}

// ---- CPU references, in comm/allreduce/{packed,emulate}.cc's order ------------------------------

std::vector<std::uint8_t> PackedReference(const Format& f, const Contributions& c,
                                          const kernels::LoopParams& p) {
  const CodeDecoder dec = MakeCodeDecoder(f.grid());
  std::vector<float> sum(c.n);
  if (c.n == 0) return {};
  DecodeCodes(c.codes[0].data(), c.n, dec, sum.data());
  for (std::size_t w = 1; w < c.codes.size(); ++w) {
    DecodeCodesAdd(c.codes[w].data(), c.n, dec, sum.data());
  }
  return EncodeContribution(f, sum, 1.0f, p);
}

std::vector<std::uint8_t> EmulateReference(const Format& f, const Contributions& c,
                                           const EmulateRounding& r) {
  if (c.n == 0) return {};
  const CodeDecoder dec = MakeCodeDecoder(f.grid());
  const int workers = int(c.codes.size());
  const std::size_t n = c.n;
  auto round = [&](std::vector<float>& x, std::int64_t stage) {
    kernels::QuantizeFloatGrid(x.data(), x.data(), nullptr, n, f.grid(), 0,
                               Loop(r.mode, r.seed, stage, r.step, r.index_base), nullptr);
  };
  std::vector<float> acc(n), comp(n, 0.0f), q(n), y(n), t(n), u(n);
  DecodeCodes(c.codes[0].data(), n, dec, acc.data());
  for (int w = 1; w < workers; ++w) {
    const std::int64_t stage = AdditionStage(workers, w);
    if (!r.kahan) {
      DecodeCodesAdd(c.codes[std::size_t(w)].data(), n, dec, acc.data());
      round(acc, stage);
      continue;
    }
    DecodeCodes(c.codes[std::size_t(w)].data(), n, dec, q.data());
    for (std::size_t i = 0; i < n; ++i) y[i] = q[i] - comp[i];
    round(y, stage + kKahanY);
    for (std::size_t i = 0; i < n; ++i) t[i] = acc[i] + y[i];
    round(t, stage + kKahanT);
    for (std::size_t i = 0; i < n; ++i) u[i] = t[i] - acc[i];
    round(u, stage + kKahanHigh);
    for (std::size_t i = 0; i < n; ++i) comp[i] = u[i] - y[i];
    round(comp, stage + kKahanC);
    std::swap(acc, t);
  }
  return EncodeContribution(f, acc, 1.0f, kernels::LoopParams{});
}

// ---- Running a device kernel on Contributions ---------------------------------------------------

// Uploads the contributions at `offset` bytes into a device buffer with `stride` bytes between
// workers (offset and stride choose aligned or unaligned layouts), runs `launch` with the
// ContributionCodes and a destination at dst_offset, and returns the destination's bytes; the
// bytes around the destination must keep the fill pattern.
template <typename Launch>
std::vector<std::uint8_t> RunOnDevice(const Format& f, const Contributions& c, std::size_t offset,
                                      std::size_t extra_stride, std::size_t dst_offset,
                                      Launch&& launch) {
  const std::size_t bytes = CodeBytes(f, c.n);
  const std::size_t stride = bytes + extra_stride;
  const int workers = int(c.codes.size());
  DeviceBytes src(offset + stride * std::size_t(workers));
  for (int w = 0; w < workers; ++w) {
    src.Upload(c.codes[std::size_t(w)].data(), bytes, offset + std::size_t(w) * stride);
  }
  DeviceBytes dst(dst_offset + bytes + 16);
  ContributionCodes in;
  in.codes = src.data() + offset;
  in.stride = stride;
  in.workers = workers;
  const Status st = launch(in, dst.data() + dst_offset);
  EXPECT_TRUE(st.ok()) << st.ToString();
  std::vector<std::uint8_t> all(dst_offset + bytes + 16);
  dst.Download(all.data(), all.size());
  for (std::size_t i = 0; i < dst_offset; ++i) EXPECT_EQ(all[i], 0xab) << "before dst at " << i;
  for (std::size_t i = dst_offset + bytes; i < all.size(); ++i) {
    EXPECT_EQ(all[i], 0xab) << "after dst at " << i;
  }
  return std::vector<std::uint8_t>(all.begin() + std::ptrdiff_t(dst_offset),
                                   all.begin() + std::ptrdiff_t(dst_offset + bytes));
}

std::size_t CountDifferent(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b) {
  EXPECT_EQ(a.size(), b.size());
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) wrong += a[i] != b[i];
  return wrong;
}

// The layouts every reduction is tried with: aligned (the exchange's 64-byte slots, whole-word
// code units where bits % 4 == 0) and unaligned (byte-wise units).
struct Layout {
  std::size_t offset, extra_stride, dst_offset;
};
constexpr Layout kLayouts[] = {{0, 64, 0}, {1, 3, 5}};

// ---- Tests --------------------------------------------------------------------------------------

TEST(ReduceKernelsCudaTest, ScanAbsMatchesCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(11);
  const float inf = std::numeric_limits<float>::infinity();
  for (std::size_t n : kCounts) {
    for (int special = 0; special < 4; ++special) {
      SCOPED_TRACE("n " + std::to_string(n) + " special " + std::to_string(special));
      std::vector<float> x = RandomGradient(n, rng);
      if (n > 0 && special == 1) x[n / 2] = -inf;
      if (n > 0 && special == 2) x[n - 1] = std::nanf("7");
      if (special == 3) std::fill(x.begin(), x.end(), 0.0f);
      // Counters that already hold an earlier layer part's results, to check the merge.
      std::uint32_t max_cpu = 0x3f800000u;
      std::uint64_t nz_cpu = 5;
      ScanAbs(x.data(), n, &max_cpu, &nz_cpu);
      DeviceBytes d_x(n * sizeof(float)), d_max(4), d_nz(8);
      d_x.Upload(x.data(), n * sizeof(float));
      const std::uint32_t max0 = 0x3f800000u;
      const std::uint64_t nz0 = 5;
      d_max.Upload(&max0, 4);
      d_nz.Upload(&nz0, 8);
      ASSERT_TRUE(ScanAbsCuda(reinterpret_cast<const float*>(d_x.data()), n,
                              reinterpret_cast<std::uint32_t*>(d_max.data()),
                              reinterpret_cast<std::uint64_t*>(d_nz.data()), nullptr)
                      .ok());
      std::uint32_t max_gpu = 0;
      std::uint64_t nz_gpu = 0;
      d_max.Download(&max_gpu, 4);
      d_nz.Download(&nz_gpu, 8);
      EXPECT_EQ(max_gpu, max_cpu);
      EXPECT_EQ(nz_gpu, nz_cpu);
    }
  }
}

TEST(ReduceKernelsCudaTest, ScaleMatchesCpuShift) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(12);
  for (std::size_t n : kCounts) {
    for (int shift : {-24, -3, 0, 5, 30}) {
      SCOPED_TRACE("n " + std::to_string(n) + " shift " + std::to_string(shift));
      std::vector<float> x = RandomGradient(n, rng);
      if (n > 2) {
        x[0] = std::nanf("123");  // a NaN with a payload keeps its bits
        x[1] = -std::numeric_limits<float>::infinity();
        x[2] = std::numeric_limits<float>::denorm_min();
      }
      const float scale = kernels::Pow2(shift);
      std::vector<float> expected = x;
      for (float& v : expected) v *= scale;  // StepContext::ApplyShift's loop
      DeviceBytes d_x(n * sizeof(float));
      d_x.Upload(x.data(), n * sizeof(float));
      ASSERT_TRUE(ScaleCuda(reinterpret_cast<float*>(d_x.data()), n, scale, nullptr).ok());
      std::vector<float> got(n);
      d_x.Download(got.data(), n * sizeof(float));
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < n; ++i) wrong += Bits(got[i]) != Bits(expected[i]);
      EXPECT_EQ(wrong, 0u);
    }
  }
}

// A contribution's encoding on the device is the APS scaling of each segment (ScaleCuda) followed
// by cpd::EncodeCuda of the whole chunk with the contribution's stream: the same bytes as
// CodeTransport::EncodePiece, which rounds x * 2^s segment by segment (finite fast path included).
TEST(ReduceKernelsCudaTest, ScaledContributionEncodeMatchesCodeTransport) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(16);
  for (const char* spec : kFormats) {
    const Format f = Format::Parse(spec).value();
    for (std::size_t n : kCounts) {
      for (RoundMode mode : kModes) {
        SCOPED_TRACE(std::string(spec) + " n " + std::to_string(n) + " mode " +
                     std::to_string(int(mode)));
        const std::size_t chunk_begin = 8 * 1000;
        const std::int64_t worker = 3, step = 9;
        const std::uint64_t seed = 21;
        std::vector<float> x = RandomGradient(n, rng);
        // Segments of random lengths (one layer each), with APS shifts that keep every
        // |x| * 2^s finite on the grid, as the scan guarantees.
        std::vector<std::size_t> bounds{0};
        std::uniform_int_distribution<std::size_t> len(1, 700);
        while (bounds.back() < n) bounds.push_back(std::min(n, bounds.back() + len(rng)));
        std::uniform_int_distribution<int> shift(-4, 3);
        std::vector<int> shifts;
        for (std::size_t s = 0; s + 1 < bounds.size(); ++s) shifts.push_back(shift(rng));

        // CPU: codes of x * 2^s per segment, one stream counted from the flat index, packed.
        std::vector<std::uint32_t> codes(n);
        for (std::size_t s = 0; s + 1 < bounds.size(); ++s) {
          const std::size_t lo = bounds[s], hi = bounds[s + 1];
          const kernels::LoopParams p =
              Loop(mode, seed, ContributionStage(worker), step, chunk_begin + lo);
          const float scale = kernels::Pow2(shifts[s]);
          if (f.bits() <= 8) {
            std::vector<std::uint8_t> c(hi - lo);
            EncodeCodes8(x.data() + lo, hi - lo, scale, f.grid(), p, c.data(), nullptr, true);
            for (std::size_t i = lo; i < hi; ++i) codes[i] = c[i - lo];
          } else {
            std::vector<std::uint16_t> c(hi - lo);
            EncodeCodes16(x.data() + lo, hi - lo, scale, f.grid(), p, c.data(), nullptr, true);
            for (std::size_t i = lo; i < hi; ++i) codes[i] = c[i - lo];
          }
        }
        std::vector<std::uint8_t> expected(CodeBytes(f, n) + 8, 0);
        PackCodes(codes.data(), n, f.bits(), expected.data());
        expected.resize(CodeBytes(f, n));

        // Device: scale each segment in place, then encode the chunk.
        DeviceBytes d_x(n * sizeof(float)), d_codes(PackedSize(f, n, 1));
        d_x.Upload(x.data(), n * sizeof(float));
        float* dx = reinterpret_cast<float*>(d_x.data());
        for (std::size_t s = 0; s + 1 < bounds.size(); ++s) {
          ASSERT_TRUE(ScaleCuda(dx + bounds[s], bounds[s + 1] - bounds[s], kernels::Pow2(shifts[s]),
                                nullptr)
                          .ok());
        }
        QuantizeOptions q;
        q.rounding = mode == RoundMode::kStochastic   ? Rounding::kStochastic
                     : mode == RoundMode::kTowardZero ? Rounding::kZero
                                                      : Rounding::kNearest;
        q.seed = RoundingSeed(seed, ContributionStage(worker));
        q.step = std::uint64_t(step);
        q.index_offset = chunk_begin;
        q.channels = 1;
        PackedTensorCuda packed;
        packed.bytes = d_codes.data();
        packed.size = PackedSize(f, n, 1);
        const Status st = EncodeCuda(f, dx, n, q, &packed);
        ASSERT_TRUE(st.ok()) << st.ToString();
        ASSERT_EQ(packed.size, expected.size());
        std::vector<std::uint8_t> got(expected.size());
        d_codes.Download(got.data(), got.size());
        EXPECT_EQ(CountDifferent(got, expected), 0u);
      }
    }
  }
}

// Random layer boundaries (offsets from `begin`, lengths 0..max_len) over n elements.
std::vector<std::uint64_t> RandomLayers(std::size_t begin, std::size_t n, std::size_t max_len,
                                        std::mt19937& rng) {
  std::vector<std::uint64_t> offsets{begin};
  std::uniform_int_distribution<std::size_t> len(0, max_len);
  while (offsets.back() < begin + n)
    offsets.push_back(std::min(begin + n, offsets.back() + len(rng)));
  if (offsets.size() == 1) offsets.push_back(begin);  // n == 0: one empty layer
  return offsets;
}

// The fused contribution encode of the device reducer (shift of each element's layer, rounding,
// packing, flushed / saturated counts per layer) against CodeTransport's per-segment
// EncodeCodes8/16 with statistics; layers cross code units and bytes, empty ones included.
TEST(ReduceKernelsCudaTest, EncodeContributionMatchesCodeTransportWithCounts) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(17);
  for (const char* spec : kFormats) {
    const Format f = Format::Parse(spec).value();
    for (std::size_t n : kCounts) {
      for (RoundMode mode : kModes) {
        for (int max_shift : {3, 20}) {  // 20: many elements saturate
          SCOPED_TRACE(std::string(spec) + " n " + std::to_string(n) + " mode " +
                       std::to_string(int(mode)) + " shifts up to " + std::to_string(max_shift));
          const std::size_t chunk_begin = 8 * 1000;
          const std::int64_t worker = 2, step = 5;
          const std::uint64_t seed = 23;
          const std::vector<float> x = RandomGradient(n, rng);
          const std::vector<std::uint64_t> offsets = RandomLayers(chunk_begin, n, 300, rng);
          const std::size_t layers = offsets.size() - 1;
          std::uniform_int_distribution<int> shift(-4, max_shift);
          std::vector<std::int32_t> shifts(layers);
          for (auto& sh : shifts) sh = shift(rng);

          std::vector<std::uint32_t> codes(n);
          std::vector<std::uint64_t> counts(2 * layers, 0);
          for (std::size_t l = 0; l < layers; ++l) {
            const std::size_t lo = offsets[l] - chunk_begin, hi = offsets[l + 1] - chunk_begin;
            const kernels::LoopParams p =
                Loop(mode, seed, ContributionStage(worker), step, chunk_begin + lo);
            const float scale = kernels::Pow2(shifts[l]);
            if (f.bits() <= 8) {
              std::vector<std::uint8_t> c(hi - lo);
              EncodeCodes8(x.data() + lo, hi - lo, scale, f.grid(), p, c.data(), &counts[2 * l]);
              for (std::size_t i = lo; i < hi; ++i) codes[i] = c[i - lo];
            } else {
              std::vector<std::uint16_t> c(hi - lo);
              EncodeCodes16(x.data() + lo, hi - lo, scale, f.grid(), p, c.data(), &counts[2 * l]);
              for (std::size_t i = lo; i < hi; ++i) codes[i] = c[i - lo];
            }
          }
          std::vector<std::uint8_t> expected(CodeBytes(f, n) + 8, 0);
          PackCodes(codes.data(), n, f.bits(), expected.data());
          expected.resize(CodeBytes(f, n));

          DeviceBytes d_x(n * sizeof(float)), d_codes(CodeBytes(f, n));
          DeviceBytes d_offsets(offsets.size() * 8), d_shifts(layers * 4), d_counts(layers * 16);
          d_x.Upload(x.data(), n * sizeof(float));
          d_offsets.Upload(offsets.data(), offsets.size() * 8);
          d_shifts.Upload(shifts.data(), layers * 4);
          ASSERT_EQ(cudaMemset(d_counts.data(), 0, layers * 16), cudaSuccess);
          const DeviceLayers dl{reinterpret_cast<const std::uint64_t*>(d_offsets.data()),
                                reinterpret_cast<const std::int32_t*>(d_shifts.data()),
                                int(layers)};
          const std::uint64_t key =
              Loop(mode, seed, ContributionStage(worker), step, chunk_begin).rng_key;
          const Status st = EncodeContributionCuda(
              reinterpret_cast<const float*>(d_x.data()), n, chunk_begin, dl, f.grid(), mode, key,
              d_codes.data(), reinterpret_cast<std::uint64_t*>(d_counts.data()), nullptr);
          ASSERT_TRUE(st.ok()) << st.ToString();
          std::vector<std::uint8_t> got(expected.size());
          d_codes.Download(got.data(), got.size());
          EXPECT_EQ(CountDifferent(got, expected), 0u);
          std::vector<std::uint64_t> got_counts(2 * layers);
          d_counts.Download(got_counts.data(), layers * 16);
          EXPECT_EQ(got_counts, counts);

          // And back: decode, times 2^-s of each layer, as CodeTransport::DecodeResults.
          std::vector<float> back(n), expected_back(n);
          const CodeDecoder dec = MakeCodeDecoder(f.grid());
          for (std::size_t l = 0; l < layers; ++l) {
            const std::size_t lo = offsets[l] - chunk_begin, hi = offsets[l + 1] - chunk_begin;
            for (std::size_t i = lo; i < hi; ++i) {
              std::uint8_t one[2] = {0, 0};
              PackCodes(&codes[i], 1, f.bits(), one);
              DecodeCodesScaled(one, 1, dec, kernels::Pow2(-shifts[l]), &expected_back[i]);
            }
          }
          DeviceBytes d_back(n * sizeof(float));
          const Status ds = DecodeUnshiftCuda(d_codes.data(), n, chunk_begin, dl, f.grid(),
                                              reinterpret_cast<float*>(d_back.data()), nullptr);
          ASSERT_TRUE(ds.ok()) << ds.ToString();
          d_back.Download(back.data(), n * sizeof(float));
          std::size_t bad = 0;
          for (std::size_t i = 0; i < n; ++i) bad += Bits(back[i]) != Bits(expected_back[i]);
          EXPECT_EQ(bad, 0u);
        }
      }
    }
  }
}

TEST(ReduceKernelsCudaTest, PackedSumRequantizeMatchesCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(13);
  for (const char* spec : kFormats) {
    const Format f = Format::Parse(spec).value();
    for (std::size_t n : kCounts) {
      for (int workers = 1; workers <= 8; ++workers) {
        // Large spans with a few worker counts only, to keep the test quick.
        if (n > 5000 && workers != 1 && workers != 3 && workers != 8) continue;
        for (bool edge : {false, true}) {
          const std::size_t index_base = 4096 * std::size_t(workers);
          const Contributions c = MakeContributions(f, n, workers, edge, 99, index_base, rng);
          for (RoundMode mode : kModes) {
            const kernels::LoopParams p = Loop(mode, 99, RequantizeStage(workers), 7, index_base);
            const std::vector<std::uint8_t> expected = PackedReference(f, c, p);
            for (const Layout& l : kLayouts) {
              SCOPED_TRACE(std::string(spec) + " n " + std::to_string(n) + " W " +
                           std::to_string(workers) + (edge ? " edge" : " gradient") + " mode " +
                           std::to_string(int(mode)) + " offset " + std::to_string(l.offset));
              const std::vector<std::uint8_t> got =
                  RunOnDevice(f, c, l.offset, l.extra_stride, l.dst_offset,
                              [&](const ContributionCodes& in, std::uint8_t* dst) {
                                return SumRequantizeCodesCuda(in, n, f.grid(), p, dst, nullptr);
                              });
              EXPECT_EQ(CountDifferent(got, expected), 0u);
            }
          }
        }
      }
    }
  }
}

// The sum scaling's first stage (PackedCodes::SumShiftAndRequantizeOwnChunk): the float32 sums
// in worker order, bit for bit (two NaNs count as equal: their payloads may differ, and the
// reducer's contributions are finite anyway).
TEST(ReduceKernelsCudaTest, PackedFloatSumMatchesCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(15);
  for (const char* spec : kFormats) {
    const Format f = Format::Parse(spec).value();
    const CodeDecoder dec = MakeCodeDecoder(f.grid());
    for (std::size_t n : kCounts) {
      for (int workers : {1, 2, 3, 8}) {
        for (bool edge : {false, true}) {
          SCOPED_TRACE(std::string(spec) + " n " + std::to_string(n) + " W " +
                       std::to_string(workers) + (edge ? " edge" : " gradient"));
          const Contributions c = MakeContributions(f, n, workers, edge, 98, 0, rng);
          std::vector<float> expected(n);
          if (n > 0) {
            DecodeCodes(c.codes[0].data(), n, dec, expected.data());
            for (int w = 1; w < workers; ++w) {
              DecodeCodesAdd(c.codes[std::size_t(w)].data(), n, dec, expected.data());
            }
          }
          const std::size_t stride = CodeBytes(f, n) + 64;
          DeviceBytes src(stride * std::size_t(workers));
          for (int w = 0; w < workers; ++w) {
            src.Upload(c.codes[std::size_t(w)].data(), CodeBytes(f, n), std::size_t(w) * stride);
          }
          DeviceBytes sum(n * sizeof(float));
          ContributionCodes in;
          in.codes = src.data();
          in.stride = stride;
          in.workers = workers;
          const Status st =
              SumCodesCuda(in, n, f.grid(), reinterpret_cast<float*>(sum.data()), nullptr);
          ASSERT_TRUE(st.ok()) << st.ToString();
          std::vector<float> got(n);
          sum.Download(got.data(), n * sizeof(float));
          std::size_t wrong = 0;
          for (std::size_t i = 0; i < n; ++i) {
            const bool both_nan = std::isnan(got[i]) && std::isnan(expected[i]);
            wrong += !both_nan && Bits(got[i]) != Bits(expected[i]);
          }
          EXPECT_EQ(wrong, 0u);
        }
      }
    }
  }
}

TEST(ReduceKernelsCudaTest, EmulateRoundedAndKahanSumsMatchCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(14);
  for (const char* spec : kFormats) {
    const Format f = Format::Parse(spec).value();
    for (std::size_t n : kCounts) {
      for (int workers = 1; workers <= 8; ++workers) {
        if (n > 5000 && workers != 2 && workers != 8) continue;
        for (bool edge : {false, true}) {
          const std::size_t index_base = 2048 * std::size_t(workers + 1);
          const Contributions c = MakeContributions(f, n, workers, edge, 5, index_base, rng);
          for (RoundMode mode : kModes) {
            for (bool kahan : {false, true}) {
              EmulateRounding r;
              r.mode = mode;
              r.kahan = kahan;
              r.seed = 5;
              r.step = 11;
              r.index_base = index_base;
              const std::vector<std::uint8_t> expected = EmulateReference(f, c, r);
              for (const Layout& l : kLayouts) {
                SCOPED_TRACE(std::string(spec) + " n " + std::to_string(n) + " W " +
                             std::to_string(workers) + (edge ? " edge" : " gradient") + " mode " +
                             std::to_string(int(mode)) + (kahan ? " kahan" : " rounded") +
                             " offset " + std::to_string(l.offset));
                const std::vector<std::uint8_t> got =
                    RunOnDevice(f, c, l.offset, l.extra_stride, l.dst_offset,
                                [&](const ContributionCodes& in, std::uint8_t* dst) {
                                  return SumRoundedCodesCuda(in, n, f.grid(), r, dst, nullptr);
                                });
                EXPECT_EQ(CountDifferent(got, expected), 0u);
              }
            }
          }
        }
      }
    }
  }
}

// Scaled formats: emulate's sum of quantised float32 contributions, rounded after every addition
// (plain and Kahan), as EmulateFloats computes it on the CPU (cpd::Quantize of the segment, float32
// loops) and as the device computes it (cpd::QuantizeCuda, CombineCuda): the same bits.
TEST(ReduceKernelsCudaTest, ScaledFormatEmulateSumMatchesCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(17);
  const std::uint64_t seed = 31;
  const std::int64_t step = 4;
  for (const char* spec : {"int8", "mxfp8", "mxfp4", "e4m3"}) {
    const Format f = Format::Parse(spec).value();
    for (std::size_t n : {std::size_t{1}, std::size_t{37}, std::size_t{5000}}) {
      for (int workers : {1, 2, 5}) {
        for (Rounding rounding : {Rounding::kNearest, Rounding::kStochastic}) {
          for (bool kahan : {false, true}) {
            SCOPED_TRACE(std::string(spec) + " n " + std::to_string(n) + " W " +
                         std::to_string(workers) + " " + RoundingName(rounding) +
                         (kahan ? " kahan" : " rounded"));
            const std::size_t begin = 640;  // the segment's flat index
            auto options = [&](std::int64_t stage) {
              QuantizeOptions q;
              q.rounding = rounding;
              q.seed = RoundingSeed(seed, stage);
              q.step = std::uint64_t(step);
              q.index_offset = begin;
              q.channels = 1;
              return q;
            };
            std::vector<std::vector<float>> contrib;
            for (int w = 0; w < workers; ++w) {
              std::vector<float> q(n);
              ASSERT_TRUE(Quantize(f, RandomGradient(n, rng).data(), q.data(), n,
                                   options(ContributionStage(w)))
                              .ok());
              contrib.push_back(std::move(q));
            }
            // CPU: EmulateFloats::AddRounded / AddKahan.
            std::vector<float> acc = contrib[0], comp(n, 0.0f), tmp(n), y(n), high(n), t(n);
            for (int w = 1; w < workers; ++w) {
              const std::int64_t stage = AdditionStage(workers, w);
              const std::vector<float>& qw = contrib[std::size_t(w)];
              auto round = [&](std::vector<float>& out, int op) {
                ASSERT_TRUE(Quantize(f, tmp.data(), out.data(), n, options(stage + op)).ok());
              };
              if (!kahan) {
                for (std::size_t i = 0; i < n; ++i) tmp[i] = acc[i] + qw[i];
                round(acc, 0);
                continue;
              }
              for (std::size_t i = 0; i < n; ++i) tmp[i] = qw[i] - comp[i];
              round(y, kKahanY);
              for (std::size_t i = 0; i < n; ++i) tmp[i] = acc[i] + y[i];
              round(t, kKahanT);
              for (std::size_t i = 0; i < n; ++i) tmp[i] = t[i] - acc[i];
              round(high, kKahanHigh);
              for (std::size_t i = 0; i < n; ++i) tmp[i] = high[i] - y[i];
              round(comp, kKahanC);
              acc = t;
            }

            // Device: the same stages with QuantizeCuda and CombineCuda.
            const std::size_t bytes = n * sizeof(float);
            std::vector<std::unique_ptr<DeviceBytes>> d_q;
            for (int w = 0; w < workers; ++w) {
              d_q.push_back(std::make_unique<DeviceBytes>(bytes));
              d_q.back()->Upload(contrib[std::size_t(w)].data(), bytes);
            }
            DeviceBytes d_acc(bytes), d_comp(bytes), d_y(bytes), d_high(bytes), d_t(bytes);
            auto dev = [](DeviceBytes& b) { return reinterpret_cast<float*>(b.data()); };
            ASSERT_EQ(cudaMemcpy(dev(d_acc), dev(*d_q[0]), bytes, cudaMemcpyDeviceToDevice),
                      cudaSuccess);
            ASSERT_EQ(cudaMemset(dev(d_comp), 0, bytes), cudaSuccess);
            for (int w = 1; w < workers; ++w) {
              const std::int64_t stage = AdditionStage(workers, w);
              const float* qw = dev(*d_q[std::size_t(w)]);
              auto step_of = [&](const float* a, const float* b, ElementOp op, float* out,
                                 int kahan_op) {
                ASSERT_TRUE(CombineCuda(a, b, out, n, op, nullptr).ok());
                ASSERT_TRUE(QuantizeCuda(f, out, out, n, options(stage + kahan_op)).ok());
              };
              if (!kahan) {
                step_of(dev(d_acc), qw, ElementOp::kAdd, dev(d_acc), 0);
                continue;
              }
              step_of(qw, dev(d_comp), ElementOp::kSubtract, dev(d_y), kKahanY);
              step_of(dev(d_acc), dev(d_y), ElementOp::kAdd, dev(d_t), kKahanT);
              step_of(dev(d_t), dev(d_acc), ElementOp::kSubtract, dev(d_high), kKahanHigh);
              step_of(dev(d_high), dev(d_y), ElementOp::kSubtract, dev(d_comp), kKahanC);
              ASSERT_EQ(cudaMemcpy(dev(d_acc), dev(d_t), bytes, cudaMemcpyDeviceToDevice),
                        cudaSuccess);
            }
            std::vector<float> got(n);
            d_acc.Download(got.data(), bytes);
            std::size_t wrong = 0;
            for (std::size_t i = 0; i < n; ++i) wrong += Bits(got[i]) != Bits(acc[i]);
            EXPECT_EQ(wrong, 0u);
          }
        }
      }
    }
  }
}

// Stochastic rounding must draw from the stream of its own stage: a different step or seed gives
// different codes (so the equalities above do not hold by accident of a constant stream).
TEST(ReduceKernelsCudaTest, StochasticStreamsDependOnSeedAndStep) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(15);
  const Format f = Format::Parse("e3m0").value();
  const std::size_t n = 4096;
  const Contributions c = MakeContributions(f, n, 4, false, 1, 0, rng);
  EmulateRounding r;
  r.mode = RoundMode::kStochastic;
  r.seed = 1;
  r.step = 1;
  auto run = [&](const EmulateRounding& rr) {
    return RunOnDevice(f, c, 0, 64, 0, [&](const ContributionCodes& in, std::uint8_t* dst) {
      return SumRoundedCodesCuda(in, n, f.grid(), rr, dst, nullptr);
    });
  };
  const std::vector<std::uint8_t> base = run(r);
  EmulateRounding other_step = r;
  other_step.step = 2;
  EmulateRounding other_seed = r;
  other_seed.seed = 2;
  EXPECT_GT(CountDifferent(base, run(other_step)), 0u);
  EXPECT_GT(CountDifferent(base, run(other_seed)), 0u);
  EXPECT_EQ(CountDifferent(base, EmulateReference(f, c, r)), 0u);
}

TEST(ReduceKernelsCudaTest, RejectsInvalidArguments) {
  SKIP_WITHOUT_GPU();
  const Format e4m3 = Format::Parse("e4m3").value();
  DeviceBytes buf(256);
  ContributionCodes in;
  in.codes = buf.data();
  in.stride = 64;
  in.workers = 0;
  EXPECT_FALSE(
      SumRequantizeCodesCuda(in, 8, e4m3.grid(), kernels::LoopParams{}, buf.data(), nullptr).ok());
  in.workers = 2;
  in.stride = 4;  // 16 e4m3 codes need 16 bytes
  EXPECT_FALSE(
      SumRoundedCodesCuda(in, 16, e4m3.grid(), EmulateRounding{}, buf.data(), nullptr).ok());
  in.stride = 64;
  EXPECT_FALSE(
      SumRequantizeCodesCuda(in, 8, e4m3.grid(), kernels::LoopParams{}, nullptr, nullptr).ok());
  const Format fp32 = Format::Parse("fp32").value();
  EXPECT_FALSE(
      SumRoundedCodesCuda(in, 8, fp32.grid(), EmulateRounding{}, buf.data(), nullptr).ok());
  EmulateRounding down;
  down.mode = RoundMode::kDown;
  EXPECT_FALSE(SumRoundedCodesCuda(in, 8, e4m3.grid(), down, buf.data(), nullptr).ok());
  EXPECT_FALSE(ScanAbsCuda(nullptr, 8, nullptr, nullptr, nullptr).ok());
  EXPECT_FALSE(ScaleCuda(nullptr, 8, 2.0f, nullptr).ok());
  EXPECT_FALSE(CombineCuda(nullptr, nullptr, nullptr, 8, ElementOp::kAdd, nullptr).ok());
}

}  // namespace
}  // namespace cpd::comm::internal
