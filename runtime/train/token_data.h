// Token streams for language models (issue 28): byte-level text (vocabulary 256) and the
// GPT-2 BPE token files of nanoGPT and llm.c, each as a train and a validation Dataset of
// windows (runtime/train/data.h: Dataset::tokens and block_size), and the filling of a batch of
// windows for BatchIterator.
//
// Every problem is a Status whose one-line message starts with the file (or folder) and says
// what was expected: NotFound/IoError for what cannot be read, Corruption for a malformed or
// truncated file, InvalidArgument for data too small for the block size.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cpd/status.h"
#include "runtime/engine/tensor.h"
#include "runtime/train/data.h"

namespace cpd::runtime {

// The default corpus of the "text" dataset: the fortune cookies of Debian's `fortunes` package
// (about 2.5 MB of English; scripts/install_deps.sh installs it).
inline constexpr const char* kTextDefaultDir = "/usr/share/games/fortunes";

// GPT-2's BPE vocabulary (the "tokens" dataset; not padded to a multiple of 64).
inline constexpr int64_t kGpt2Vocab = 50257;

// The longest text the "text" dataset reads (its bytes are held as 16-bit tokens).
inline constexpr uint64_t kMaxTextBytes = uint64_t(1) << 32;

// llm.c's token file header: 256 int32 values (little-endian), [0] the magic, [1] the version
// (1: uint16 GPT-2 tokens), [2] the token count; the tokens follow.
inline constexpr int32_t kLlmcMagic = 20240520;
inline constexpr int64_t kLlmcHeaderBytes = 256 * 4;

// The files the "text" dataset reads from `path`: the file itself, or every regular file of the
// folder (not its subfolders, symbolic links or names starting with '.'), sorted by name, except
// those holding a NUL byte, which are binary (the .dat indices beside Debian's fortune files).
// Errors: NotFound for a missing path; InvalidArgument for a folder without a text file or a
// given file that holds a NUL byte.
Result<std::vector<std::string>> TextFiles(const std::string& path);

// Byte-level text: each file's bytes are tokens 0..255, its first 90% (rounded down) go to the
// train stream and the rest to the validation stream, files in TextFiles order (so windows may
// span two files). Nothing is stripped or normalised (fortune's '%' separator lines stay).
// Errors: the reader's, and InvalidArgument when either stream has fewer than
// windows.block_size + 1 tokens or the text exceeds kMaxTextBytes.
Result<std::pair<Dataset, Dataset>> LoadTextPair(const std::string& path,
                                                 const TokenWindows& windows);

// One GPT-2 token file: nanoGPT's (raw little-endian uint16, no header) or llm.c's (the header
// above, then header[2] uint16 tokens), told apart by the magic. Every token must be below
// kGpt2Vocab. Errors (Corruption, message "PATH: ..."): an empty or odd-sized file, an llm.c
// header with another version, a count that disagrees with the file's size (truncated or
// trailing data), a token out of range.
Result<std::vector<uint16_t>> ReadTokenFile(const std::string& path);

// nanoGPT's layout: `dir`/train.bin and `dir`/val.bin (either format above).
Result<std::pair<Dataset, Dataset>> LoadTokenBinPair(const std::string& dir,
                                                     const TokenWindows& windows);

// The train set (random windows, windows.tokens_per_epoch / block_size of them per epoch, at
// least 1; all train tokens / block_size without it) and the validation set (every disjoint
// window of the validation stream, in order) over the two streams; the unigram entropy of the
// train stream. Errors: InvalidArgument when a stream is shorter than block_size + 1 tokens.
Result<std::pair<Dataset, Dataset>> MakeTokenPair(const std::string& name,
                                                  std::vector<uint16_t> train,
                                                  std::vector<uint16_t> val, int64_t vocab,
                                                  bool byte_level, const TokenWindows& windows);

// x [b, block_size] and y (b * block_size labels) for the windows `samples[0..b)` of `epoch`
// (Dataset's contract). `seed` is the run's; the offsets of random windows are a function of
// (seed, epoch, sample index) only.
void FillTokenWindows(const Dataset& data, uint64_t seed, int64_t epoch, const int64_t* samples,
                      int64_t b, Tensor* x, std::vector<int32_t>* y);

// The first token of window `sample` of `epoch` (what FillTokenWindows reads).
int64_t WindowOffset(const Dataset& data, uint64_t seed, int64_t epoch, int64_t sample);

}  // namespace cpd::runtime
