// The CIFAR-10 and CIFAR-100 binary readers: the input becomes test_batch.bin (CIFAR-10) or
// test.bin (CIFAR-100), raw or gzip-compressed, in a directory of its own. Nothing may crash or
// throw; an accepted set has whole 32x32x3 records with labels below the class count.
#include <zlib.h>

#include <cstdint>
#include <string>

#include "runtime/train/data.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  cpd::fuzz::Input in(data, size);
  const uint8_t mode = in.Take<uint8_t>();
  std::string bytes = in.Rest();
  const int classes = (mode & 1) ? 100 : 10;
  if (mode & 2) {
    uLongf n = compressBound(uLong(bytes.size()));
    std::string z(n, '\0');
    compress(reinterpret_cast<Bytef*>(z.data()), &n, reinterpret_cast<const Bytef*>(bytes.data()),
             uLong(bytes.size()));
    z.resize(n);
    // A gzip member around the zlib stream's deflate data: header, data, CRC-32 and size.
    std::string gz("\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03", 10);
    gz += z.substr(2, z.size() - 6);
    const uLong crc = crc32(0L, reinterpret_cast<const Bytef*>(bytes.data()), uInt(bytes.size()));
    for (int i = 0; i < 4; ++i) gz.push_back(char((crc >> (8 * i)) & 0xff));
    for (int i = 0; i < 4; ++i) gz.push_back(char((bytes.size() >> (8 * i)) & 0xff));
    bytes = gz;
  }
  const std::string dir = cpd::fuzz::ScratchDir() + "/cifar" + std::to_string(classes);
  static bool made = false;
  if (!made) {
    std::filesystem::create_directories(cpd::fuzz::ScratchDir() + "/cifar10");
    std::filesystem::create_directories(cpd::fuzz::ScratchDir() + "/cifar100");
    made = true;
  }
  cpd::fuzz::WriteFile(dir + (classes == 10 ? "/test_batch.bin" : "/test.bin"), bytes);
  auto d = cpd::runtime::LoadCifar(dir, /*train=*/false, classes);
  if (!d.ok()) return 0;
  CPD_FUZZ_CHECK(d->channels == 3 && d->height == 32 && d->width == 32, "shape");
  CPD_FUZZ_CHECK(d->images.size() == size_t(d->count) * 3072, "image count");
  for (int32_t l : d->labels) CPD_FUZZ_CHECK(l >= 0 && l < classes, "label out of range");
  return 0;
}
