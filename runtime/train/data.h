// Training data: image-classification datasets held in memory as float32 NCHW, their loaders
// (MNIST/Fashion-MNIST IDX, CIFAR-10/100 binary, a seeded synthetic task), per-channel
// normalisation, token streams for language models (runtime/train/token_data.h), and a seeded,
// resumable, shardable batch iterator over either.
//
// Loaders report every problem as a Status whose one-line message names the file and what was
// expected; nothing here throws except std::bad_alloc when memory runs out.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cpd/status.h"
#include "runtime/engine/tensor.h"

namespace cpd::runtime {

// How a token stream is cut into samples (the "text" and "tokens" datasets).
struct TokenWindows {
  int64_t block_size = 0;        // tokens a model sees at once (T); REQUIRED >= 1 for tokens
  int64_t tokens_per_epoch = 0;  // training windows per epoch x block_size; 0: the train tokens
};

// An in-memory labelled image set, or a token stream cut into windows (a language model's data,
// block_size > 0; see runtime/train/token_data.h).
struct Dataset {
  std::string name;  // e.g. "fashion-mnist/train"
  int64_t count = 0;
  int channels = 0, height = 0, width = 0, classes = 0;
  // count * channels * height * width values, sample-major NCHW. The loaders produce values in
  // [0, 1] (byte / 255); Normalize() rewrites them in place.
  std::vector<float> images;
  std::vector<int32_t> labels;  // count values in [0, classes)

  // A token stream (block_size > 0): sample i is a window of block_size + 1 consecutive tokens,
  // x its first block_size (as floats), its labels the block_size tokens that follow each of
  // them. count is the windows per epoch; classes the vocabulary; images and labels stay empty.
  // random_windows: window i of epoch e starts at an offset drawn uniformly from
  // [0, tokens.size() - block_size) by the seeded stream of (seed, e, i) (the training set);
  // otherwise window i starts at i * block_size (the validation set: disjoint windows in order).
  std::vector<uint16_t> tokens;
  int64_t block_size = 0;
  bool random_windows = false;
  bool byte_level = false;  // tokens are the bytes of text (so bits per byte = loss / ln 2)
  double unigram_bits = 0;  // entropy of the token frequencies, bits per token (train set)

  int64_t sample_size() const { return int64_t(channels) * height * width; }
  bool is_tokens() const { return block_size > 0; }
  // Labels per sample: block_size for a token stream, 1 for an image.
  int64_t labels_per_sample() const { return is_tokens() ? block_size : 1; }
};

// MNIST-style IDX pair: images (magic 0x00000803, u8, [count, rows, cols]) and labels (magic
// 0x00000801, u8, [count], each < 10). Each file may be gzip-compressed (detected by its 1f 8b
// magic) or raw. Result: count x 1 x rows x cols, 10 classes, named `name`.
// Errors: NotFound/IoError for unreadable files, Corruption for a wrong magic, truncated or
// oversized payload, mismatched counts or an out-of-range label.
Result<Dataset> LoadIdx(const std::string& images_path, const std::string& labels_path,
                        const std::string& name);

// CIFAR binary format from `dir` (or its cifar-10-batches-bin / cifar-100-binary subfolder, as
// the official archives unpack). classes = 10: data_batch_1..5.bin (train) or test_batch.bin,
// records of 1 label byte + 3072 pixel bytes. classes = 100: train.bin or test.bin, records of
// 2 label bytes (coarse, fine; the fine label is used) + 3072 pixel bytes. Pixels are stored
// channel-planar (1024 R, 1024 G, 1024 B), which is already CHW. Result: count x 3 x 32 x 32.
// Any whole number of records per file is accepted.
Result<Dataset> LoadCifar(const std::string& dir, bool train, int classes);

// A learnable synthetic task: each class has a fixed blocky mean pattern per channel (a function
// of `seed` only); a sample is that pattern at a random contrast plus noise, clamped to [0, 1].
// Labels and noise are functions of (seed, sample index), so the output is identical across
// runs and thread counts, and a prefix of a larger set equals the smaller set.
// Errors: InvalidArgument for a non-positive size or classes < 2.
Result<Dataset> MakeSynthetic(int64_t count, int channels, int height, int width, int classes,
                              uint64_t seed);

// Default directory of the "fashion-mnist" dataset (Debian's dataset-fashion-mnist package).
inline constexpr const char* kFashionMnistDefaultDir = "/usr/share/datasets/fashion-mnist";

// (train, test) for `name`:
//   "fashion-mnist"  IDX files in data_dir (default kFashionMnistDefaultDir when empty)
//   "mnist"          IDX files in data_dir (required)
//   For both: train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte,
//   t10k-labels-idx1-ubyte, each with or without a .gz suffix (.gz preferred).
//   "cifar10", "cifar100"  LoadCifar(data_dir, ...) (data_dir required)
//   "synthetic"      8192 train / 2048 test, 1x28x28, 10 classes, from MakeSynthetic(seed); the
//                    two sets share class patterns and have disjoint samples.
//   "text"           LoadTextPair(data_dir, default kTextDefaultDir) and
//   "tokens"         LoadTokenBinPair(data_dir, required) of runtime/train/token_data.h: token
//                    streams for language models, cut as `windows` says (REQUIRED there:
//                    block_size >= 1, else InvalidArgument).
// `seed` only affects "synthetic". Errors: InvalidArgument for an unknown name (the message
// lists the accepted ones) or a missing data_dir; the loaders' errors otherwise.
Result<std::pair<Dataset, Dataset>> LoadDatasetPair(const std::string& name,
                                                    const std::string& data_dir, uint64_t seed,
                                                    const TokenWindows& windows = {});

// Per-channel mean and population standard deviation (size = channels each).
struct ChannelStats {
  std::vector<float> mean, std;
};

// Statistics over every pixel of every sample, accumulated in double in a fixed order (the
// result does not depend on the thread count).
ChannelStats ComputeChannelStats(const Dataset& train);

// x <- (x - mean[c]) / std[c] in place; a channel whose std is 0 is only centred.
// REQUIRED: stats.mean.size() == stats.std.size() == data->channels (aborts otherwise: a
// programming error, not a data error).
void Normalize(Dataset* data, const ChannelStats& stats);

// Where an iterator is within its schedule: batch `next_batch` of epoch `epoch` comes next.
// next_batch == batches_per_epoch() means the epoch is exhausted.
struct IteratorState {
  int64_t epoch = 0;
  int64_t next_batch = 0;
};

// Yields mini-batches of a Dataset in epochs.
//
// Order: with shuffle, epoch e visits the samples in a permutation that is a function of
// (seed, e) only (Fisher-Yates driven by SplitMix64, so it is the same on every platform and
// standard library); without shuffle, in index order. Every sample appears exactly once per
// epoch (with drop_last, the final partial global batch is skipped).
//
// Sharding: after SetShard(rank, world_size), one step consumes a global batch of
// batch_size * world_size samples of the shared permutation, and rank r receives the contiguous
// slice [r * n / world_size, (r + 1) * n / world_size) of its n samples. Full global batches
// therefore give every rank exactly batch_size samples; the last partial one is split as evenly
// as possible (sizes differ by at most one, and a rank may get 0 samples when fewer remain than
// ranks; Next() still returns true so that all ranks take the same number of steps).
//
// Augmentation (augment = true; the usual CIFAR recipe): each sample is shifted by a random
// offset in [-4, 4] on both axes, the uncovered border filled with 0 (i.e. a random 32x32 crop
// of the image zero-padded by 4), and mirrored horizontally with probability 1/2. The choices
// are a function of (seed, epoch, dataset index of the sample): independent of batch size,
// sharding, resumption and thread count. Output shape equals input shape. Note that the fill
// value 0 is the channel mean when the dataset was normalised first.
//
// Resumption: state() after any Next() and Restore() of it on a fresh iterator (same dataset,
// batch size, flags, seed and shard) produce exactly the batches the original would have.
//
// The Dataset must outlive the iterator and keep its size; its values are read at Next() time.
// Not thread-safe; Next() itself fills the batch on OpenMP threads.
class BatchIterator {
 public:
  // REQUIRED: batch_size >= 1 (aborts otherwise). Starts at epoch 0, batch 0.
  BatchIterator(const Dataset& data, int64_t batch_size, bool shuffle, bool augment, uint64_t seed,
                bool drop_last);

  // Data-parallel sharding (default: rank 0 of 1). Resets nothing else; call before Next().
  // Errors: InvalidArgument unless 0 <= rank < world_size.
  Status SetShard(int rank, int world_size);

  // Positions the iterator at batch 0 of `epoch` (>= 0).
  void StartEpoch(int64_t epoch);

  // Fills x with a [b, C, H, W] CPU tensor (Resize()d; b = batch_size except possibly in the
  // last batch, see sharding) and y with its b labels (a token stream: x is [b, block_size] of
  // token ids as floats, y holds b * block_size labels, window-major), and returns true; returns
  // false, leaving x, y and state() untouched, when the epoch is exhausted (call StartEpoch for
  // the next one).
  bool Next(Tensor* x, std::vector<int32_t>* y);

  // Global batches per epoch: ceil(count / (batch_size * world_size)), or floor with drop_last.
  int64_t batches_per_epoch() const;

  IteratorState state() const { return {epoch_, next_batch_}; }
  // Errors: InvalidArgument when epoch < 0 or next_batch is outside [0, batches_per_epoch()]
  // (e.g. a checkpoint from a run with another batch size); the position is unchanged then.
  Status Restore(const IteratorState& s);

  int64_t batch_size() const { return batch_size_; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

 private:
  void BuildOrder();  // order_ for epoch_

  const Dataset& data_;
  int64_t batch_size_;
  bool shuffle_, augment_, drop_last_;
  uint64_t seed_;
  int rank_ = 0, world_size_ = 1;
  int64_t epoch_ = 0, next_batch_ = 0;
  std::vector<int64_t> order_;  // sample indices of epoch_ in visiting order
};

}  // namespace cpd::runtime
