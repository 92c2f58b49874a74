// The IDX readers (MNIST-style images and labels), raw and gzip: the input is split into an
// images file and a labels file, each written as it is or gzip-compressed (the mode byte says
// which), so that the fuzzer reaches both the headers behind a valid gzip stream and the gzip
// reader itself (raw bytes starting with 1f 8b). Nothing may crash or throw; an accepted pair
// has count x 1 x rows x cols values in [0, 1] and labels in 0..9; and no input makes the
// reader hold more memory than the data it was given inflates to (libFuzzer's -rss_limit_mb
// catches a header whose sizes would be allocated before the data backs them).
#include <zlib.h>

#include <cstdint>
#include <string>

#include "runtime/train/data.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

std::string Gzip(const std::string& raw) {
  uLongf bound = compressBound(uLong(raw.size())) + 32;
  std::string out(bound, '\0');
  z_stream z{};
  deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);  // +16: a gzip wrapper
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(raw.data()));
  z.avail_in = uInt(raw.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = uInt(out.size());
  deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  cpd::fuzz::Input in(data, size);
  const uint8_t mode = in.Take<uint8_t>();
  const uint16_t split = in.Take<uint16_t>();
  std::string rest = in.Rest();
  const size_t cut = rest.empty() ? 0 : split % (rest.size() + 1);
  std::string images = rest.substr(0, cut), labels = rest.substr(cut);
  if (mode & 1) images = Gzip(images);
  if (mode & 2) labels = Gzip(labels);
  const std::string dir = cpd::fuzz::ScratchDir();
  cpd::fuzz::WriteFile(dir + "/images", images);
  cpd::fuzz::WriteFile(dir + "/labels", labels);
  auto d = cpd::runtime::LoadIdx(dir + "/images", dir + "/labels", "fuzz");
  if (!d.ok()) return 0;
  CPD_FUZZ_CHECK(d->channels == 1 && d->classes == 10, "shape");
  CPD_FUZZ_CHECK(d->images.size() == size_t(d->count * d->sample_size()), "image count");
  CPD_FUZZ_CHECK(d->labels.size() == size_t(d->count), "label count");
  for (float v : d->images) CPD_FUZZ_CHECK(v >= 0.0f && v <= 1.0f, "pixel out of [0, 1]");
  for (int32_t l : d->labels) CPD_FUZZ_CHECK(l >= 0 && l < 10, "label out of range");
  return 0;
}
