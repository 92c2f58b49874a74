#include "runtime/train/token_data.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

#include "kernels/grid.h"
#include "runtime/train/split_mix.h"

namespace cpd::runtime {

namespace {

namespace fs = std::filesystem;

constexpr uint64_t kWindowDomain = 0x57494e444f575331ull;  // "WINDOWS1"

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }  // read only: nothing lost
};
using File = std::unique_ptr<std::FILE, FileCloser>;

Status OpenError(const std::string& path) {
  const int e = errno;
  std::string msg = "cannot open " + path + ": " + std::strerror(e);
  return e == ENOENT ? Status::NotFound(std::move(msg)) : Status::IoError(std::move(msg));
}

// The whole of a text file (at most kMaxTextBytes).
Result<std::vector<uint8_t>> ReadAll(const std::string& path) {
  File f(std::fopen(path.c_str(), "rb"));
  if (!f) return OpenError(path);
  std::error_code ec;
  const uintmax_t size = fs::file_size(path, ec);
  if (ec) return Status::IoError("cannot read the size of " + path + ": " + ec.message());
  if (size > kMaxTextBytes) {
    return Status::InvalidArgument(path + ": " + std::to_string(size) +
                                   " bytes is more than the text dataset reads (" +
                                   std::to_string(kMaxTextBytes) + ")");
  }
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  const size_t got = bytes.empty() ? 0 : std::fread(bytes.data(), 1, bytes.size(), f.get());
  if (got != bytes.size()) {
    if (std::ferror(f.get())) {
      return Status::IoError("cannot read " + path + ": " + std::strerror(errno));
    }
    return Status::Corruption(path + ": truncated while reading: expected " + std::to_string(size) +
                              " bytes, got " + std::to_string(got));
  }
  return bytes;
}

uint32_t LittleEndian32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

// Shannon entropy of the token frequencies, in bits per token.
double UnigramBits(const std::vector<uint16_t>& tokens, int64_t vocab) {
  std::vector<int64_t> counts(size_t(vocab), 0);
  for (uint16_t t : tokens) ++counts[t];
  const double n = double(tokens.size());
  double h = 0;
  for (int64_t c : counts) {
    if (c > 0) h -= double(c) / n * std::log2(double(c) / n);
  }
  return h;
}

}  // namespace

Result<std::vector<std::string>> TextFiles(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    return Status::NotFound("cannot open " + path + ": No such file or directory");
  }
  const auto has_nul = [](const std::string& file) -> Result<bool> {
    CPD_ASSIGN_OR_RETURN(const std::vector<uint8_t> bytes, ReadAll(file));
    return std::find(bytes.begin(), bytes.end(), uint8_t(0)) != bytes.end();
  };
  if (!fs::is_directory(path, ec)) {
    CPD_ASSIGN_OR_RETURN(const bool binary, has_nul(path));
    if (binary) {
      return Status::InvalidArgument(path + ": holds a NUL byte: not a text file (the text " +
                                     "dataset reads UTF-8 or ASCII text)");
    }
    return std::vector<std::string>{path};
  }
  std::vector<std::string> files;
  for (const fs::directory_entry& e : fs::directory_iterator(path, ec)) {
    const std::string name = e.path().filename().string();
    if (name.empty() || name[0] == '.' || e.is_symlink() || !e.is_regular_file()) continue;
    files.push_back(e.path().string());
  }
  if (ec) return Status::IoError("cannot list " + path + ": " + ec.message());
  std::sort(files.begin(), files.end());
  std::vector<std::string> text;
  for (const std::string& f : files) {
    CPD_ASSIGN_OR_RETURN(const bool binary, has_nul(f));
    if (!binary) text.push_back(f);
  }
  if (text.empty()) {
    return Status::InvalidArgument(path + ": no text file in this folder (every regular file " +
                                   "is read except those holding a NUL byte)");
  }
  return text;
}

Result<std::pair<Dataset, Dataset>> LoadTextPair(const std::string& path,
                                                 const TokenWindows& windows) {
  CPD_ASSIGN_OR_RETURN(const std::vector<std::string> files, TextFiles(path));
  std::vector<uint16_t> train, val;
  uint64_t total = 0;
  for (const std::string& f : files) {
    CPD_ASSIGN_OR_RETURN(const std::vector<uint8_t> bytes, ReadAll(f));
    total += bytes.size();
    if (total > kMaxTextBytes) {
      return Status::InvalidArgument(path + ": more than " + std::to_string(kMaxTextBytes) +
                                     " bytes of text (the text dataset's limit)");
    }
    // The last 10% of every file validates, so that each file (a genre of fortunes, a book) is
    // represented in both streams.
    const size_t cut = bytes.size() - bytes.size() / 10;
    train.insert(train.end(), bytes.begin(), bytes.begin() + ptrdiff_t(cut));
    val.insert(val.end(), bytes.begin() + ptrdiff_t(cut), bytes.end());
  }
  return MakeTokenPair("text", std::move(train), std::move(val), 256, /*byte_level=*/true, windows);
}

Result<std::vector<uint16_t>> ReadTokenFile(const std::string& path) {
  static_assert(std::endian::native == std::endian::little,
                "token files are little-endian uint16 and are read in place");
  const auto corrupt = [&](const std::string& what) {
    return Status::Corruption(path + ": " + what);
  };
  File f(std::fopen(path.c_str(), "rb"));
  if (!f) return OpenError(path);
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  if (ec) return Status::IoError("cannot read the size of " + path + ": " + ec.message());
  if (size == 0) return corrupt("empty: expected GPT-2 tokens (uint16)");
  uint8_t head[kLlmcHeaderBytes];
  const size_t head_size = size_t(std::min<uint64_t>(size, kLlmcHeaderBytes));
  if (std::fread(head, 1, head_size, f.get()) != head_size) {
    return Status::IoError("cannot read " + path + ": " + std::strerror(errno));
  }
  uint64_t begin = 0;
  if (size >= 4 && int32_t(LittleEndian32(head)) == kLlmcMagic) {
    if (size < uint64_t(kLlmcHeaderBytes)) {
      return corrupt("truncated: llm.c's header is " + std::to_string(kLlmcHeaderBytes) +
                     " bytes, the file has " + std::to_string(size));
    }
    const int32_t version = int32_t(LittleEndian32(head + 4));
    const int32_t count = int32_t(LittleEndian32(head + 8));
    if (version != 1) {
      return corrupt("llm.c token file version " + std::to_string(version) +
                     ": only version 1 (uint16 GPT-2 tokens) is read");
    }
    if (count < 0) return corrupt("llm.c header: negative token count " + std::to_string(count));
    const uint64_t expected = uint64_t(kLlmcHeaderBytes) + 2 * uint64_t(count);
    if (size != expected) {
      return corrupt(std::string(size < expected ? "truncated" : "trailing data") +
                     ": the llm.c header says " + std::to_string(count) + " tokens (" +
                     std::to_string(expected) + " bytes), the file has " + std::to_string(size) +
                     " bytes");
    }
    begin = uint64_t(kLlmcHeaderBytes);
  } else if (size % 2 != 0) {
    return corrupt("odd size " + std::to_string(size) +
                   " bytes: expected uint16 tokens (nanoGPT) or llm.c's header (magic " +
                   std::to_string(kLlmcMagic) + ")");
  }
  // Read in place (the tokens are most of memory for a large corpus: no second copy).
  std::vector<uint16_t> tokens(size_t((size - begin) / 2));
  if (std::fseek(f.get(), long(begin), SEEK_SET) != 0 ||
      std::fread(tokens.data(), 2, tokens.size(), f.get()) != tokens.size()) {
    return corrupt("truncated while reading: expected " + std::to_string(tokens.size()) +
                   " tokens");
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] >= kGpt2Vocab) {
      return corrupt("token " + std::to_string(tokens[i]) + " at position " + std::to_string(i) +
                     " is outside GPT-2's vocabulary (0.." + std::to_string(kGpt2Vocab - 1) + ")");
    }
  }
  return tokens;
}

Result<std::pair<Dataset, Dataset>> LoadTokenBinPair(const std::string& dir,
                                                     const TokenWindows& windows) {
  CPD_ASSIGN_OR_RETURN(std::vector<uint16_t> train,
                       ReadTokenFile((fs::path(dir) / "train.bin").string()));
  CPD_ASSIGN_OR_RETURN(std::vector<uint16_t> val,
                       ReadTokenFile((fs::path(dir) / "val.bin").string()));
  return MakeTokenPair("tokens", std::move(train), std::move(val), kGpt2Vocab,
                       /*byte_level=*/false, windows);
}

Result<std::pair<Dataset, Dataset>> MakeTokenPair(const std::string& name,
                                                  std::vector<uint16_t> train,
                                                  std::vector<uint16_t> val, int64_t vocab,
                                                  bool byte_level, const TokenWindows& windows) {
  const int64_t T = windows.block_size;
  if (T < 1) return Status::InvalidArgument("dataset '" + name + "' needs a block size >= 1");
  for (const auto& [stream, tokens] :
       {std::pair<const char*, const std::vector<uint16_t>*>{"train", &train}, {"val", &val}}) {
    if (int64_t(tokens->size()) < T + 1) {
      return Status::InvalidArgument("dataset '" + name + "': the " + stream + " stream has " +
                                     std::to_string(tokens->size()) +
                                     " tokens, fewer than --block-size " + std::to_string(T) +
                                     " + 1 (give more text or a smaller --block-size)");
    }
  }
  const auto make = [&](std::vector<uint16_t> tokens, const char* part, bool random) {
    Dataset d;
    d.name = name + "/" + part;
    d.channels = d.height = 1;
    d.width = int(T);
    d.classes = int(vocab);
    d.block_size = T;
    d.random_windows = random;
    d.byte_level = byte_level;
    const int64_t n = int64_t(tokens.size());
    if (random) {
      const int64_t per_epoch = windows.tokens_per_epoch > 0 ? windows.tokens_per_epoch : n;
      d.count = std::max<int64_t>(1, per_epoch / T);
      d.unigram_bits = UnigramBits(tokens, vocab);
    } else {
      d.count = (n - 1) / T;  // window i covers tokens [i T, (i + 1) T], the last as a label
    }
    d.tokens = std::move(tokens);
    return d;
  };
  Dataset t = make(std::move(train), "train", true);
  Dataset v = make(std::move(val), "val", false);
  return std::make_pair(std::move(t), std::move(v));
}

int64_t WindowOffset(const Dataset& data, uint64_t seed, int64_t epoch, int64_t sample) {
  if (!data.random_windows) return sample * data.block_size;
  const uint64_t key = kernels::MakeRandomKey(seed ^ kWindowDomain, uint64_t(epoch));
  SplitMixStream rng(Hash2(key, uint64_t(sample)));
  return int64_t(rng.Below(uint64_t(int64_t(data.tokens.size()) - data.block_size)));
}

void FillTokenWindows(const Dataset& data, uint64_t seed, int64_t epoch, const int64_t* samples,
                      int64_t b, Tensor* x, std::vector<int32_t>* y) {
  const int64_t T = data.block_size;
  if (x->device() != Device::kCpu) *x = Tensor();
  x->Resize({b, T});
  y->resize(size_t(b * T));
  float* out = x->data();
  const uint16_t* tokens = data.tokens.data();
  for (int64_t i = 0; i < b; ++i) {
    const uint16_t* w = tokens + WindowOffset(data, seed, epoch, samples[i]);
    for (int64_t t = 0; t < T; ++t) {
      out[i * T + t] = float(w[t]);
      (*y)[size_t(i * T + t)] = int32_t(w[t + 1]);
    }
  }
}

}  // namespace cpd::runtime
