#include "comm/perf_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "comm/allreduce/internal.h"
#include "comm/gradient_allreduce.h"
#include "comm/reduce_kernels.h"
#include "cpd/format.h"

namespace cpd::comm::perf {
namespace {

// One exchange with each of the P - 1 peers, m bytes to each, charged as the pairwise exchange.
double DirectExchange(int world, double m, const Link& link) {
  return double(world - 1) * (link.alpha_s + m / link.beta_bytes_per_s);
}

// Median seconds per element of fn() over `reps` runs, after one untimed run.
template <typename Fn>
double PerElement(std::size_t elements, int reps, Fn&& fn) {
  fn();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(t.begin(), t.begin() + std::ptrdiff_t(t.size() / 2), t.end());
  return t[t.size() / 2] / double(elements);
}

}  // namespace

double Host::Parallelism() const {
  const double per_rank = double(cores) / double(std::max(ranks, 1));
  return std::min(double(std::max(threads, 1)), per_rank);
}

Prediction PredictFp32Ring(const Case& c, const Link& link, const CodecCost& cost,
                           const Host& host) {
  Prediction p;
  if (c.world <= 1) return p;
  const double n = double(c.elements), w = double(c.world);
  // Reduce-scatter then all-gather: 2 (P-1) steps of one chunk each; the reduce-scatter's P-1
  // steps each add one chunk (one thread: MPI's reduction is not threaded).
  p.wire = 2.0 * (w - 1.0) * (link.alpha_s + 4.0 * n / w / link.beta_bytes_per_s);
  p.compute = (w - 1.0) / w * n * cost.add / std::min(1.0, host.Parallelism());
  p.total = host.Overlaps() ? std::max(p.wire, p.compute) : p.wire + p.compute;
  return p;
}

Prediction PredictPacked(const Case& c, const Link& link, const CodecCost& cost, const Host& host) {
  Prediction p;
  const double n = double(c.elements), w = double(c.world), par = host.Parallelism();
  const double scan = c.aps ? n * cost.scan / par : 0.0;
  // The loops before the all-gather (encode, decode + add) and after it (re-encode, decode).
  const double gathered = (n * cost.encode + n * cost.decode_add) / par;
  const double scattered = (n / w * cost.encode + n * cost.decode) / par;
  p.compute = scan + gathered + scattered;
  if (c.world <= 1) {
    p.total = p.compute;
    return p;
  }
  const double shifts = c.aps ? 2.0 * std::ceil(std::log2(w)) * link.alpha_s : 0.0;
  const double codes = n * double(c.bits) / 8.0 / w;  // bytes to each peer, per exchange
  const int rounds = std::max(c.rounds, 1);
  // The all-to-all and the all-gather, each in `rounds` exchanges of codes / rounds per peer.
  const double exchange = double(rounds) * DirectExchange(c.world, codes / rounds, link);
  p.wire = shifts + 2.0 * exchange;
  if (c.rounds == 0 || !host.Overlaps()) {
    p.total = p.compute + p.wire;
    return p;
  }
  // R rounds of compute c / R and wire w / R: the first round's compute and the last one's wire
  // stand alone (fill and drain), the R - 1 steps between take the longer of the two.
  auto overlap = [&](double compute, double wire) {
    const double r = double(rounds);
    return std::max(compute, wire) * (r - 1.0) / r + (compute + wire) / r;
  };
  p.total = scan + shifts +
            (c.sum_scaling ? overlap(gathered, exchange) + overlap(scattered, exchange)
                           : overlap(gathered + scattered, 2.0 * exchange));
  return p;
}

Result<CodecCost> MeasureCodecCost(const std::string& format, std::size_t elements, int reps) {
  CPD_ASSIGN_OR_RETURN(Format f, Format::Parse(format));
  if (f.family() != FormatFamily::kFloat || f.bits() > 16) {
    return Status::InvalidArgument("MeasureCodecCost: '" + format +
                                   "' is not a fixed float grid of <= 16 bits (packed codes)");
  }
  if (elements < 1 || reps < 1) {
    return Status::InvalidArgument("MeasureCodecCost: needs elements >= 1 and reps >= 1");
  }
  constexpr std::size_t kPieceElems = internal::kPiece;
  const kernels::FloatGrid& g = f.grid();
  const int bits = f.bits();
  const internal::CodeDecoder dec = internal::MakeCodeDecoder(g);
  std::vector<float> x(elements), y(elements), acc(elements, 0.0f);
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::size_t i = 0; i < elements; ++i) x[i] = normal(rng), y[i] = normal(rng);
  std::uint32_t max_bits = 0;
  std::uint64_t nonzero = 0;
  internal::ScanAbs(x.data(), elements, &max_bits, &nonzero);
  float max_abs;
  static_assert(sizeof max_abs == sizeof max_bits);
  std::memcpy(&max_abs, &max_bits, sizeof max_abs);
  const float scale = kernels::Pow2(ApsShift(max_abs, 1, ApsEmax(f)));
  std::vector<std::uint8_t> packed((elements * std::size_t(bits) + 7) / 8 + 8);
  std::vector<std::uint16_t> c16(kPieceElems);
  std::uint64_t stats[2] = {0, 0};
  const kernels::LoopParams params;  // nearest-even

  auto piece_offset = [&](std::size_t lo) { return lo * std::size_t(bits) / 8; };
  CodecCost cost;
  cost.scan = PerElement(elements, reps, [&] {
    std::uint32_t m = 0;
    std::uint64_t nz = 0;
    internal::ScanAbs(x.data(), elements, &m, &nz);
  });
  cost.encode = PerElement(elements, reps, [&] {
    for (std::size_t lo = 0; lo < elements; lo += kPieceElems) {
      const std::size_t n = std::min(kPieceElems, elements - lo);
      std::uint8_t* dst = packed.data() + piece_offset(lo);
      if (bits <= 8) {
        std::uint8_t* c8 = bits == 8 ? dst : reinterpret_cast<std::uint8_t*>(c16.data());
        internal::EncodeCodes8(x.data() + lo, n, scale, g, params, c8, stats, /*finite=*/true);
        if (bits < 8) internal::PackSmallCodes(c8, n, bits, dst);
      } else {
        internal::EncodeCodes16(x.data() + lo, n, scale, g, params, c16.data(), stats, true);
        internal::PackSmallCodes(c16.data(), n, bits, dst);
      }
    }
  });
  cost.decode_add = PerElement(elements, reps, [&] {
    for (std::size_t lo = 0; lo < elements; lo += kPieceElems) {
      const std::size_t n = std::min(kPieceElems, elements - lo);
      internal::DecodeCodesAdd(packed.data() + piece_offset(lo), n, dec, acc.data() + lo);
    }
  });
  cost.decode = PerElement(elements, reps, [&] {
    for (std::size_t lo = 0; lo < elements; lo += kPieceElems) {
      const std::size_t n = std::min(kPieceElems, elements - lo);
      internal::DecodeCodesScaled(packed.data() + piece_offset(lo), n, dec, 1.0f / scale,
                                  y.data() + lo);
    }
  });
  cost.add = PerElement(elements, reps, [&] {
    float* a = acc.data();
    const float* b = x.data();
    for (std::size_t i = 0; i < elements; ++i) a[i] += b[i];
  });
  return cost;
}

int PipelineRounds(std::size_t elements, int world, int bits, int pipeline_kb) {
  if (pipeline_kb <= 0 || world <= 1) return 0;
  const std::size_t chunk = (elements + std::size_t(world) - 1) / std::size_t(world);
  const std::size_t codes = (chunk * std::size_t(bits) + 7) / 8;
  const std::size_t round_bytes = std::size_t(pipeline_kb) * 1024;
  const std::size_t pieces =
      std::max<std::size_t>((chunk + internal::kPiece - 1) / internal::kPiece, 1);
  return int(std::clamp<std::size_t>((codes + round_bytes - 1) / round_bytes, 1, pieces));
}

CodecCost MemoryBoundCost(int bits, double bytes_per_s) {
  const double code = double(bits) / 8.0;
  return {4.0 / bytes_per_s, (4.0 + code) / bytes_per_s, (code + 8.0) / bytes_per_s,
          (code + 4.0) / bytes_per_s, 12.0 / bytes_per_s};
}

double StepSpeedup(double compute_s, double base_allreduce_s, double candidate_allreduce_s) {
  return (compute_s + base_allreduce_s) / (compute_s + candidate_allreduce_s);
}

}  // namespace cpd::comm::perf
