#include "runtime/train/data.h"

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <numeric>
#include <utility>

#include "kernels/grid.h"
#include "runtime/train/split_mix.h"
#include "runtime/train/token_data.h"

namespace cpd::runtime {

namespace {

namespace fs = std::filesystem;

// Contract violations by the caller (not data errors): report and stop, like a CHECK.
void Require(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "cpd::runtime data: contract violated: %s\n", what);
  std::abort();
}

// Below this many floats a batch is copied on the calling thread: waking the OpenMP team costs
// more than copying a few hundred kilobytes (a 128 x 784 batch is 100 K floats).
constexpr int64_t kParallelFloats = int64_t(1) << 18;

// byte / 255 for every byte value, so that conversion is a table lookup with one rounding.
const std::array<float, 256>& ByteToUnit() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[size_t(i)] = float(i) / 255.0f;
    return t;
  }();
  return table;
}

void BytesToUnit(const uint8_t* src, size_t n, float* dst) {
  const std::array<float, 256>& t = ByteToUnit();
#pragma omp parallel for schedule(static) if (n >= size_t(kParallelFloats))
  for (int64_t i = 0; i < int64_t(n); ++i) dst[i] = t[src[i]];
}

Status OpenError(const std::string& path) {
  const int e = errno;
  std::string msg = "cannot open " + path + ": " + std::strerror(e);
  return e == ENOENT ? Status::NotFound(std::move(msg)) : Status::IoError(std::move(msg));
}

// A file read as a stream, transparently gunzipped when it starts with the gzip magic 1f 8b
// (zlib reads other files as they are). Readers ask for as many bytes as the header says they
// need, plus one to see whether more follow: nothing beyond that is ever inflated, so a small
// gzip that would inflate to gigabytes is refused at the first byte past its header's sizes.
class InputFile {
 public:
  static Result<InputFile> Open(const std::string& path) {
    gzFile gz = gzopen(path.c_str(), "rb");
    if (gz == nullptr) return OpenError(path);
    gzbuffer(gz, 1u << 18);
    return InputFile(path, gz);
  }

  // Appends to `out` until it holds `size` bytes or the file ends.
  Status ReadUpTo(uint64_t size, std::vector<uint8_t>* out) {
    constexpr size_t kChunk = size_t(1) << 22;
    while (out->size() < size) {
      const size_t used = out->size();
      const size_t want = size_t(std::min<uint64_t>(size - used, kChunk));
      out->resize(used + want);
      const int n = gzread(gz_.get(), out->data() + used, unsigned(want));
      if (n < 0) {
        int errnum = 0;
        return Status::Corruption(path_ +
                                  ": gzip stream is corrupt: " + gzerror(gz_.get(), &errnum));
      }
      out->resize(used + size_t(n));
      if (n == 0) break;
    }
    return Status::Ok();
  }

  // The gzip stream ended early ("unexpected end of file") before what was read: zlib lets
  // gzread return the data before a premature end and records Z_BUF_ERROR.
  bool truncated_gzip() {
    int errnum = Z_OK;
    gzerror(gz_.get(), &errnum);
    return errnum == Z_BUF_ERROR;
  }

 private:
  struct Closer {
    void operator()(gzFile_s* gz) const { gzclose(gz); }  // read only: nothing lost on error
  };
  InputFile(std::string path, gzFile gz) : path_(std::move(path)), gz_(gz) {}
  std::string path_;
  std::unique_ptr<gzFile_s, Closer> gz_;
};

// What a reader took from an InputFile.
struct FileBytes {
  std::vector<uint8_t> bytes;
  bool gzip_truncated = false;  // the gzip stream ended early: `bytes` holds what was there
};

uint32_t BigEndian32(const uint8_t* p) {
  return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | uint32_t(p[3]);
}

std::string Hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", v);
  return buf;
}

// Reads the rest of an IDX file whose header (already in f->bytes) announces `expected` payload
// bytes, stopping one byte beyond them, and checks the size: `what` is "pixel" or "label".
Status ReadPayload(const std::string& path, InputFile* in, FileBytes* f, size_t header,
                   uint64_t expected, const char* what) {
  CPD_RETURN_IF_ERROR(in->ReadUpTo(header + expected + 1, &f->bytes));
  f->gzip_truncated = in->truncated_gzip();
  const uint64_t got = f->bytes.size() - header;
  if (got < expected) {
    return Status::Corruption(path + ": truncated: expected " + std::to_string(expected) + " " +
                              what + " bytes after the header, got " + std::to_string(got));
  }
  if (got > expected) {
    return Status::Corruption(path + ": expected " + std::to_string(expected) + " " + what +
                              " bytes after the header, but more follow (trailing data)");
  }
  if (f->gzip_truncated) {
    return Status::Corruption(path + ": truncated gzip stream (unexpected end of file)");
  }
  return Status::Ok();
}

// Resolves the folder the CIFAR files are in: `dir` itself, or the folder the official archive
// unpacks to inside it.
std::string CifarDir(const std::string& dir, const char* first_file, const char* subfolder) {
  std::error_code ec;
  if (fs::exists(fs::path(dir) / first_file, ec)) return dir;
  const fs::path sub = fs::path(dir) / subfolder;
  if (fs::exists(sub / first_file, ec)) return sub.string();
  return dir;
}

// Domain separators so that shuffling, augmentation and synthetic data draw unrelated bits from
// the same user seed.
constexpr uint64_t kShuffleDomain = 0x53485546464c4531ull;      // "SHUFFLE1"
constexpr uint64_t kAugmentDomain = 0x4155474d454e5431ull;      // "AUGMENT1"
constexpr uint64_t kSynthProtoDomain = 0x53594e5450524f31ull;   // "SYNTPRO1"
constexpr uint64_t kSynthSampleDomain = 0x53594e5453414d31ull;  // "SYNTSAM1"

// [0, 1) from the top 24 bits.
float Unit24(uint64_t bits) { return float(bits >> 40) * (1.0f / 16777216.0f); }

}  // namespace

// ---- IDX --------------------------------------------------------------------------------------

Result<Dataset> LoadIdx(const std::string& images_path, const std::string& labels_path,
                        const std::string& name) {
  CPD_ASSIGN_OR_RETURN(InputFile image_file, InputFile::Open(images_path));
  FileBytes images;
  CPD_RETURN_IF_ERROR(image_file.ReadUpTo(16, &images.bytes));
  const std::vector<uint8_t>& ib = images.bytes;
  if (ib.size() < 16) {
    return Status::Corruption(images_path +
                              ": truncated: expected a 16-byte IDX image header, got " +
                              std::to_string(ib.size()) + " bytes");
  }
  const uint32_t imagic = BigEndian32(ib.data());
  if (imagic != 0x00000803u) {
    return Status::Corruption(images_path + ": bad magic " + Hex32(imagic) +
                              ": expected 0x00000803 (IDX unsigned-byte images, 3 dimensions)");
  }
  const uint32_t n = BigEndian32(ib.data() + 4);
  const uint32_t rows = BigEndian32(ib.data() + 8);
  const uint32_t cols = BigEndian32(ib.data() + 12);
  // Images wider than 2^15 per side are not an image-classification set; the bound also keeps
  // the byte count below 2^62 so that it cannot overflow.
  if (rows == 0 || cols == 0 || rows > 32768 || cols > 32768) {
    return Status::Corruption(images_path + ": bad image size " + std::to_string(rows) + "x" +
                              std::to_string(cols) + ": expected 1..32768 on each side");
  }
  const uint64_t pixels = uint64_t(n) * rows * cols;
  CPD_RETURN_IF_ERROR(ReadPayload(images_path, &image_file, &images, 16, pixels, "pixel"));

  CPD_ASSIGN_OR_RETURN(InputFile label_file, InputFile::Open(labels_path));
  FileBytes labels;
  CPD_RETURN_IF_ERROR(label_file.ReadUpTo(8, &labels.bytes));
  const std::vector<uint8_t>& lb = labels.bytes;
  if (lb.size() < 8) {
    return Status::Corruption(labels_path +
                              ": truncated: expected an 8-byte IDX label header, got " +
                              std::to_string(lb.size()) + " bytes");
  }
  const uint32_t lmagic = BigEndian32(lb.data());
  if (lmagic != 0x00000801u) {
    return Status::Corruption(labels_path + ": bad magic " + Hex32(lmagic) +
                              ": expected 0x00000801 (IDX unsigned-byte labels, 1 dimension)");
  }
  const uint32_t nl = BigEndian32(lb.data() + 4);
  if (nl != n) {
    return Status::Corruption(labels_path + ": holds " + std::to_string(nl) + " labels: expected " +
                              std::to_string(n) + ", the image count of " + images_path);
  }
  CPD_RETURN_IF_ERROR(ReadPayload(labels_path, &label_file, &labels, 8, n, "label"));

  Dataset d;
  d.name = name;
  d.count = n;
  d.channels = 1;
  d.height = int(rows);
  d.width = int(cols);
  d.classes = 10;
  d.labels.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    const uint8_t l = lb[8 + i];
    if (l >= 10) {
      return Status::Corruption(labels_path + ": label " + std::to_string(l) + " at index " +
                                std::to_string(i) + ": expected 0..9");
    }
    d.labels[i] = l;
  }
  d.images.resize(pixels);
  BytesToUnit(ib.data() + 16, pixels, d.images.data());
  return d;
}

// ---- CIFAR ------------------------------------------------------------------------------------

Result<Dataset> LoadCifar(const std::string& dir, bool train, int classes) {
  if (classes != 10 && classes != 100) {
    return Status::InvalidArgument("LoadCifar: classes = " + std::to_string(classes) +
                                   ": expected 10 (CIFAR-10) or 100 (CIFAR-100)");
  }
  constexpr int64_t kPixels = 3 * 32 * 32;
  const int label_bytes = classes == 10 ? 1 : 2;
  const int64_t record = label_bytes + kPixels;
  std::vector<std::string> files;
  std::string root;
  if (classes == 10) {
    root = CifarDir(dir, train ? "data_batch_1.bin" : "test_batch.bin", "cifar-10-batches-bin");
    if (train) {
      for (int i = 1; i <= 5; ++i) files.push_back("data_batch_" + std::to_string(i) + ".bin");
    } else {
      files.push_back("test_batch.bin");
    }
  } else {
    root = CifarDir(dir, train ? "train.bin" : "test.bin", "cifar-100-binary");
    files.push_back(train ? "train.bin" : "test.bin");
  }

  Dataset d;
  d.name = std::string(classes == 10 ? "cifar10" : "cifar100") + (train ? "/train" : "/test");
  d.channels = 3;
  d.height = 32;
  d.width = 32;
  d.classes = classes;
  const char* kind = classes == 10 ? "CIFAR-10" : "CIFAR-100";
  for (const std::string& file : files) {
    const std::string path = (fs::path(root) / file).string();
    // No header: a CIFAR file holds any whole number of records, read to its end.
    CPD_ASSIGN_OR_RETURN(InputFile in, InputFile::Open(path));
    FileBytes f;
    CPD_RETURN_IF_ERROR(in.ReadUpTo(std::numeric_limits<uint64_t>::max(), &f.bytes));
    f.gzip_truncated = in.truncated_gzip();
    const std::vector<uint8_t>& b = f.bytes;
    if (b.empty() || int64_t(b.size()) % record != 0 || f.gzip_truncated) {
      return Status::Corruption(
          path + ": truncated: size " + std::to_string(b.size()) + " bytes is not a whole, " +
          "non-zero number of " + std::to_string(record) + "-byte " + kind + " records (" +
          std::to_string(label_bytes) + " label byte" + (label_bytes > 1 ? "s" : "") + " + " +
          std::to_string(kPixels) + " pixel bytes)");
    }
    const int64_t n = int64_t(b.size()) / record;
    const int64_t base = d.count;
    d.labels.resize(size_t(base + n));
    d.images.resize(size_t((base + n) * kPixels));
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* r = b.data() + i * record;
      // CIFAR-100 records are (coarse, fine): the 100-class task uses the fine label.
      const int label = r[label_bytes - 1];
      if (label >= classes || (classes == 100 && r[0] >= 20)) {
        return Status::Corruption(
            path + ": record " + std::to_string(i) + " has label " + std::to_string(label) +
            (classes == 100 ? " (coarse " + std::to_string(r[0]) + ")" : "") + ": expected < " +
            std::to_string(classes) + (classes == 100 ? " (coarse < 20)" : ""));
      }
      d.labels[size_t(base + i)] = label;
    }
    const std::array<float, 256>& t = ByteToUnit();
    float* dst = d.images.data() + base * kPixels;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* px = b.data() + i * record + label_bytes;
      float* o = dst + i * kPixels;
      for (int64_t k = 0; k < kPixels; ++k) o[k] = t[px[k]];
    }
    d.count = base + n;
  }
  return d;
}

// ---- Synthetic --------------------------------------------------------------------------------

Result<Dataset> MakeSynthetic(int64_t count, int channels, int height, int width, int classes,
                              uint64_t seed) {
  if (count < 0 || channels < 1 || height < 1 || width < 1 || classes < 2) {
    return Status::InvalidArgument("MakeSynthetic: count " + std::to_string(count) + ", shape " +
                                   std::to_string(channels) + "x" + std::to_string(height) + "x" +
                                   std::to_string(width) + ", classes " + std::to_string(classes) +
                                   ": expected count >= 0, positive sizes and classes >= 2");
  }
  // Class patterns are constant on 4x4 blocks: learnable by an MLP or a CNN, and far enough
  // apart that a few hundred steps reduce the loss, while the low contrast and heavy noise
  // keep single samples ambiguous (nearest-class-mean accuracy is well below 100%).
  constexpr int kBlock = 4;
  constexpr float kNoiseStd = 0.4f;
  constexpr float kMinContrast = 0.1f, kMaxContrast = 0.6f;
  const int bh = (height + kBlock - 1) / kBlock, bw = (width + kBlock - 1) / kBlock;
  const uint64_t proto_key = kernels::MakeRandomKey(seed, kSynthProtoDomain);
  std::vector<float> proto(size_t(classes) * channels * bh * bw);
  for (size_t i = 0; i < proto.size(); ++i) proto[i] = Unit24(Hash2(proto_key, i));

  Dataset d;
  d.name = "synthetic";
  d.count = count;
  d.channels = channels;
  d.height = height;
  d.width = width;
  d.classes = classes;
  const int64_t sample = d.sample_size();
  d.images.resize(size_t(count * sample));
  d.labels.resize(size_t(count));
  const uint64_t sample_key = kernels::MakeRandomKey(seed, kSynthSampleDomain);
  // Irwin-Hall: the sum of four uniforms has variance 1/3, so sqrt(3) * (sum - 2) has unit
  // variance; integer-derived uniforms keep the noise free of libm differences.
  const float noise_scale = kNoiseStd * 1.7320508f;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t skey = Hash2(sample_key, uint64_t(i));
    SplitMixStream rng(skey);
    const int label = int(rng.Below(uint64_t(classes)));
    const float contrast = kMinContrast + (kMaxContrast - kMinContrast) * Unit24(rng.Next());
    d.labels[size_t(i)] = label;
    float* out = d.images.data() + i * sample;
    for (int c = 0; c < channels; ++c) {
      const float* p = proto.data() + (size_t(label) * channels + c) * bh * bw;
      for (int y = 0; y < height; ++y) {
        for (int x = 0; x < width; ++x) {
          const uint64_t r = rng.Next();
          const float u =
              float((r & 0xffff) + ((r >> 16) & 0xffff) + ((r >> 32) & 0xffff) + (r >> 48)) *
              (1.0f / 65536.0f);
          const float noise = noise_scale * (u - 2.0f);
          const float v = 0.5f + contrast * (p[(y / kBlock) * bw + x / kBlock] - 0.5f) + noise;
          out[(int64_t(c) * height + y) * width + x] = std::clamp(v, 0.0f, 1.0f);
        }
      }
    }
  }
  return d;
}

// ---- Named pairs ------------------------------------------------------------------------------

namespace {

// dir/base.gz if present, else dir/base; the error names both.
Result<std::string> IdxFile(const std::string& dir, const std::string& base) {
  const fs::path gz = fs::path(dir) / (base + ".gz");
  const fs::path raw = fs::path(dir) / base;
  std::error_code ec;
  if (fs::exists(gz, ec)) return gz.string();
  if (fs::exists(raw, ec)) return raw.string();
  return Status::NotFound("cannot open " + gz.string() + ": No such file or directory (nor " +
                          raw.string() + ")");
}

Result<Dataset> LoadIdxFromDir(const std::string& dir, const std::string& prefix,
                               const std::string& name) {
  CPD_ASSIGN_OR_RETURN(const std::string images, IdxFile(dir, prefix + "-images-idx3-ubyte"));
  CPD_ASSIGN_OR_RETURN(const std::string labels, IdxFile(dir, prefix + "-labels-idx1-ubyte"));
  return LoadIdx(images, labels, name);
}

}  // namespace

Result<std::pair<Dataset, Dataset>> LoadDatasetPair(const std::string& name,
                                                    const std::string& data_dir, uint64_t seed,
                                                    const TokenWindows& windows) {
  const auto need_dir = [&](const char* holds) {
    return Status::InvalidArgument("dataset '" + name +
                                   "' needs a data directory (--data-dir) holding " + holds);
  };
  if (name == "fashion-mnist" || name == "mnist") {
    if (name == "mnist" && data_dir.empty()) {
      return need_dir(
          "train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], "
          "t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz]");
    }
    const std::string dir = data_dir.empty() ? kFashionMnistDefaultDir : data_dir;
    CPD_ASSIGN_OR_RETURN(Dataset train, LoadIdxFromDir(dir, "train", name + "/train"));
    CPD_ASSIGN_OR_RETURN(Dataset test, LoadIdxFromDir(dir, "t10k", name + "/test"));
    return std::make_pair(std::move(train), std::move(test));
  }
  if (name == "cifar10" || name == "cifar100") {
    const int classes = name == "cifar10" ? 10 : 100;
    if (data_dir.empty()) {
      return need_dir(classes == 10 ? "data_batch_1..5.bin and test_batch.bin"
                                    : "train.bin and test.bin");
    }
    CPD_ASSIGN_OR_RETURN(Dataset train, LoadCifar(data_dir, true, classes));
    CPD_ASSIGN_OR_RETURN(Dataset test, LoadCifar(data_dir, false, classes));
    return std::make_pair(std::move(train), std::move(test));
  }
  if (name == "text" || name == "tokens") {
    if (windows.block_size < 1) {
      return Status::InvalidArgument("dataset '" + name + "' needs a block size >= 1");
    }
    if (name == "text") return LoadTextPair(data_dir.empty() ? kTextDefaultDir : data_dir, windows);
    if (data_dir.empty()) return need_dir("train.bin and val.bin (GPT-2 tokens, nanoGPT or llm.c)");
    return LoadTokenBinPair(data_dir, windows);
  }
  if (name == "synthetic") {
    // One draw split in two, so that both sets share the class patterns.
    constexpr int64_t kTrain = 8192, kTest = 2048;
    CPD_ASSIGN_OR_RETURN(Dataset a, MakeSynthetic(kTrain + kTest, 1, 28, 28, 10, seed));
    const int64_t sample = a.sample_size();
    Dataset test = a;
    test.name = "synthetic/test";
    test.count = kTest;
    test.images.assign(a.images.begin() + kTrain * sample, a.images.end());
    test.labels.assign(a.labels.begin() + kTrain, a.labels.end());
    a.name = "synthetic/train";
    a.count = kTrain;
    a.images.resize(size_t(kTrain * sample));
    a.images.shrink_to_fit();
    a.labels.resize(size_t(kTrain));
    return std::make_pair(std::move(a), std::move(test));
  }
  return Status::InvalidArgument("unknown dataset '" + name +
                                 "': expected fashion-mnist, mnist, cifar10, cifar100, "
                                 "synthetic, text or tokens");
}

// ---- Normalisation ----------------------------------------------------------------------------

ChannelStats ComputeChannelStats(const Dataset& train) {
  const int channels = train.channels;
  const int64_t plane = int64_t(train.height) * train.width;
  const int64_t n = train.count;
  ChannelStats s;
  s.mean.assign(size_t(channels), 0.0f);
  s.std.assign(size_t(channels), 0.0f);
  if (n <= 0 || plane <= 0) return s;
  // Per-sample partial sums, then a sequential reduction: the same answer for any thread count.
  // Two passes (mean, then squared deviations) avoid the cancellation of E[x^2] - E[x]^2.
  std::vector<double> part(size_t(n) * channels);
  const float* img = train.images.data();
  const auto reduce = [&](auto&& term) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      for (int c = 0; c < channels; ++c) {
        const float* p = img + (i * channels + c) * plane;
        double acc = 0;
        for (int64_t k = 0; k < plane; ++k) acc += term(c, p[k]);
        part[size_t(i * channels + c)] = acc;
      }
    }
    std::vector<double> total(size_t(channels), 0.0);
    for (int64_t i = 0; i < n; ++i) {
      for (int c = 0; c < channels; ++c) total[size_t(c)] += part[size_t(i * channels + c)];
    }
    return total;
  };
  const double count = double(n) * double(plane);
  std::vector<double> mean = reduce([](int, float v) { return double(v); });
  for (double& m : mean) m /= count;
  const std::vector<double> ss = reduce([&](int c, float v) {
    const double d = double(v) - mean[size_t(c)];
    return d * d;
  });
  for (int c = 0; c < channels; ++c) {
    s.mean[size_t(c)] = float(mean[size_t(c)]);
    s.std[size_t(c)] = float(std::sqrt(ss[size_t(c)] / count));
  }
  return s;
}

void Normalize(Dataset* data, const ChannelStats& stats) {
  Require(data != nullptr, "Normalize: data is null");
  Require(stats.mean.size() == size_t(data->channels) && stats.std.size() == size_t(data->channels),
          "Normalize: ChannelStats size differs from the dataset's channel count");
  const int channels = data->channels;
  const int64_t plane = int64_t(data->height) * data->width;
  const int64_t rows = data->count * channels;
  float* img = data->images.data();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int c = int(r % channels);
    const float m = stats.mean[size_t(c)];
    const float sd = stats.std[size_t(c)];
    const float inv = sd > 0 ? 1.0f / sd : 1.0f;
    float* p = img + r * plane;
    for (int64_t k = 0; k < plane; ++k) p[k] = (p[k] - m) * inv;
  }
}

// ---- BatchIterator ----------------------------------------------------------------------------

BatchIterator::BatchIterator(const Dataset& data, int64_t batch_size, bool shuffle, bool augment,
                             uint64_t seed, bool drop_last)
    : data_(data),
      batch_size_(batch_size),
      shuffle_(shuffle),
      augment_(augment),
      drop_last_(drop_last),
      seed_(seed) {
  Require(batch_size >= 1, "BatchIterator: batch_size must be >= 1");
  Require(
      data.count >= 0 &&
          (data.is_tokens() ? int64_t(data.tokens.size()) > data.block_size &&
                                  (data.random_windows ||
                                   data.count * data.block_size < int64_t(data.tokens.size()))
                            : data.labels.size() == size_t(data.count) &&
                                  data.images.size() == size_t(data.count * data.sample_size())),
      "BatchIterator: dataset images/labels sizes do not match its count and shape");
  BuildOrder();
}

Status BatchIterator::SetShard(int rank, int world_size) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return Status::InvalidArgument("BatchIterator::SetShard: rank " + std::to_string(rank) +
                                   " of world size " + std::to_string(world_size) +
                                   ": expected 0 <= rank < world_size");
  }
  rank_ = rank;
  world_size_ = world_size;
  return Status::Ok();
}

void BatchIterator::StartEpoch(int64_t epoch) {
  Require(epoch >= 0, "BatchIterator::StartEpoch: epoch must be >= 0");
  epoch_ = epoch;
  next_batch_ = 0;
  BuildOrder();
}

int64_t BatchIterator::batches_per_epoch() const {
  const int64_t global = batch_size_ * world_size_;
  return drop_last_ ? data_.count / global : (data_.count + global - 1) / global;
}

Status BatchIterator::Restore(const IteratorState& s) {
  if (s.epoch < 0 || s.next_batch < 0 || s.next_batch > batches_per_epoch()) {
    return Status::InvalidArgument(
        "BatchIterator::Restore: epoch " + std::to_string(s.epoch) + ", batch " +
        std::to_string(s.next_batch) + ": expected epoch >= 0 and batch in [0, " +
        std::to_string(batches_per_epoch()) + "] (was the state saved with another batch size " +
        "or dataset?)");
  }
  const bool rebuild = s.epoch != epoch_;
  epoch_ = s.epoch;
  next_batch_ = s.next_batch;
  if (rebuild) BuildOrder();
  return Status::Ok();
}

void BatchIterator::BuildOrder() {
  const int64_t n = data_.count;
  order_.resize(size_t(n));
  std::iota(order_.begin(), order_.end(), int64_t(0));
  if (!shuffle_ || n < 2) return;
  // Fisher-Yates from the back: position i takes a uniform pick among [0, i].
  SplitMixStream rng(kernels::MakeRandomKey(seed_ ^ kShuffleDomain, uint64_t(epoch_)));
  for (int64_t i = n - 1; i > 0; --i) {
    const int64_t j = int64_t(rng.Below(uint64_t(i + 1)));
    std::swap(order_[size_t(i)], order_[size_t(j)]);
  }
}

bool BatchIterator::Next(Tensor* x, std::vector<int32_t>* y) {
  Require(x != nullptr && y != nullptr, "BatchIterator::Next: null output");
  if (next_batch_ >= batches_per_epoch()) return false;
  const int64_t global = batch_size_ * world_size_;
  const int64_t start = next_batch_ * global;
  const int64_t n = std::min(global, data_.count - start);
  const int64_t lo = start + n * rank_ / world_size_;
  const int64_t hi = start + n * (rank_ + 1) / world_size_;
  const int64_t b = hi - lo;
  if (data_.is_tokens()) {
    // Windows are drawn by (seed, epoch, sample index), like augmentation: the same for any
    // batch size, sharding or resumption.
    FillTokenWindows(data_, seed_, epoch_, order_.data() + lo, b, x, y);
    ++next_batch_;
    return true;
  }
  const int C = data_.channels, H = data_.height, W = data_.width;
  const int64_t sample = data_.sample_size();

  if (x->device() != Device::kCpu) *x = Tensor();
  x->Resize({b, C, H, W});
  y->resize(size_t(b));
  float* out = x->data();
  const float* img = data_.images.data();
  const int64_t* idx = order_.data() + lo;
  const uint64_t aug_key = kernels::MakeRandomKey(seed_ ^ kAugmentDomain, uint64_t(epoch_));
  const bool augment = augment_;

#pragma omp parallel for schedule(static) if (b * sample >= kParallelFloats)
  for (int64_t i = 0; i < b; ++i) {
    const int64_t s = idx[i];
    (*y)[size_t(i)] = data_.labels[size_t(s)];
    const float* src = img + s * sample;
    float* dst = out + i * sample;
    if (!augment) {
      std::memcpy(dst, src, size_t(sample) * sizeof(float));
      continue;
    }
    // Shift (dy, dx) in [-4, 4]: out(y, x) = in(y + dy, x + dx), zero outside; then an optional
    // mirror. Equivalent to a random crop of the 4-pixel zero-padded image.
    const uint64_t h = Hash2(aug_key, uint64_t(s));
    const int dy = int(uint32_t(h) % 9u) - 4;
    const int dx = int(uint32_t(h >> 32) % 9u) - 4;
    const bool flip = (kernels::SplitMix64(h) & 1u) != 0;
    const int x0 = std::max(0, -dx), x1 = std::min(W, W - dx);  // columns with a source pixel
    for (int c = 0; c < C; ++c) {
      const float* sp = src + int64_t(c) * H * W;
      float* dp = dst + int64_t(c) * H * W;
      for (int yy = 0; yy < H; ++yy) {
        float* row = dp + int64_t(yy) * W;
        const int sy = yy + dy;
        if (sy < 0 || sy >= H || x0 >= x1) {
          std::fill(row, row + W, 0.0f);
          continue;
        }
        const float* srow = sp + int64_t(sy) * W;
        if (!flip) {
          std::fill(row, row + x0, 0.0f);
          std::memcpy(row + x0, srow + x0 + dx, size_t(x1 - x0) * sizeof(float));
          std::fill(row + x1, row + W, 0.0f);
        } else {
          // Mirrored: out(y, x) = shifted(y, W - 1 - x).
          for (int xx = 0; xx < W; ++xx) {
            const int u = W - 1 - xx;
            row[xx] = (u >= x0 && u < x1) ? srow[u + dx] : 0.0f;
          }
        }
      }
    }
  }
  ++next_batch_;
  return true;
}

}  // namespace cpd::runtime
