// Format specs and the quantisers: any spec string, rounding, channel count and float32 data.
// Invariants checked on every input that the library accepts:
//   * a parsed spec's canonical form parses to itself;
//   * in place == out of place, bit for bit;
//   * Decode(Encode(x)) == Quantize(x), bit for bit;
//   * every NaN that comes out is the canonical 0x7fc00000;
//   * idempotence: with nearest rounding, Q(Q(x)) == Q(x) bit for bit whenever Q(x) keeps the
//     scales of x;
//   * the statistics count every element and every non-finite input;
// and nothing crashes, throws or allocates by a count the data does not back (channels).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpd/format.h"
#include "cpd/quantize.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using cpd::fuzz::Input;

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

// The scale metadata of an encoding (what follows the codes).
std::vector<uint8_t> Meta(const cpd::Format& f, const cpd::PackedTensor& p) {
  const size_t codes = cpd::PackedCodeBytes(f, p.count);
  return std::vector<uint8_t>(p.bytes.begin() + long(codes), p.bytes.end());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  const uint8_t mode = in.Take<uint8_t>();
  const uint64_t channels_raw = in.Take<uint64_t>();
  const uint32_t seed = in.Take<uint32_t>();
  const std::string spec = in.TakeString();
  const std::string raw = in.Rest();

  auto parsed = cpd::Format::Parse(spec);
  if (!parsed.ok()) return 0;
  const cpd::Format f = *parsed;
  auto again = cpd::Format::Parse(f.spec());
  CPD_FUZZ_CHECK(again.ok() && again->spec() == f.spec(), spec + " -> " + f.spec());

  std::vector<float> x(raw.size() / 4);
  if (!x.empty()) std::memcpy(x.data(), raw.data(), x.size() * 4);
  const size_t n = x.size();
  cpd::QuantizeOptions o;
  o.rounding = cpd::Rounding(mode % 3);
  o.seed = seed;
  o.step = mode >> 2;
  o.threads = 1;
  // Mostly small channel counts that may divide n; sometimes any 64-bit count (item 1: such a
  // count must be refused, not allocated).
  o.channels = (mode & 0x80) != 0 ? size_t(channels_raw) : size_t(channels_raw % 9);

  std::vector<float> q(n);
  cpd::QuantStats st;
  const cpd::Status s = cpd::Quantize(f, x.data(), q.data(), n, o, &st);
  std::vector<float> inplace = x;
  const cpd::Status s2 = cpd::Quantize(f, inplace.data(), inplace.data(), n, o);
  CPD_FUZZ_CHECK(s.ok() == s2.ok(), "in place and out of place disagree on accepting");
  cpd::PackedTensor packed;
  const cpd::Status se = cpd::Encode(f, x.data(), n, o, &packed);
  CPD_FUZZ_CHECK(s.ok() == se.ok(), "Encode and Quantize disagree on accepting: " + se.message());
  if (!s.ok()) return 0;

  CPD_FUZZ_CHECK(SameBits(q, inplace), f.spec() + ": in place != out of place");
  std::vector<float> decoded(n);
  const cpd::Status sd = cpd::Decode(f, packed, decoded.data(), 1);
  CPD_FUZZ_CHECK(sd.ok(), sd.message());
  CPD_FUZZ_CHECK(SameBits(decoded, q), f.spec() + ": Decode(Encode(x)) != Quantize(x)");

  uint64_t nonfinite = 0;
  for (size_t i = 0; i < n; ++i) {
    nonfinite += !std::isfinite(x[i]);
    if (std::isnan(q[i]))
      CPD_FUZZ_CHECK(Bits(q[i]) == 0x7fc00000u, f.spec() + ": NaN not canonical");
  }
  CPD_FUZZ_CHECK(st.count == n, "stats.count");
  CPD_FUZZ_CHECK(st.nonfinite == nonfinite, "stats.nonfinite");

  // Quantising the result again changes no bit where the scales stay (always for fixed formats).
  // Directed and stochastic rounding of a linear grid may move a level whose division by the
  // scale lands a hair below the integer: idempotence is nearest rounding's promise.
  if (o.rounding != cpd::Rounding::kNearest) return 0;
  std::vector<float> qq(n);
  CPD_FUZZ_CHECK(cpd::Quantize(f, q.data(), qq.data(), n, o).ok(), "Q(Q(x)) refused");
  cpd::PackedTensor packed_q;
  CPD_FUZZ_CHECK(cpd::Encode(f, q.data(), n, o, &packed_q).ok(), "Encode(Q(x)) refused");
  if (Meta(f, packed) == Meta(f, packed_q)) {
    CPD_FUZZ_CHECK(SameBits(qq, q), f.spec() + ": Q(Q(x)) != Q(x)");
  }

  // Hysteresis from the quantised weights: accepted alike.
  std::vector<float> h = q;
  CPD_FUZZ_CHECK(cpd::QuantizeHysteresis(f, x.data(), h.data(), n, o).ok(), "hysteresis refused");
  return 0;
}
