// Checkpoint files: named float32 tensors plus a JSON metadata document, written atomically
// (temporary file, fsync, rename, fsync of the directory) and protected by a CRC-32 over the
// whole file, so that a crash never leaves a half-written checkpoint under the real name and a
// damaged file is refused instead of half-loaded.
//
// Layout (little-endian):
//   "CPDCKPT1"                      8 bytes magic
//   u64 header_bytes                length of the JSON header that follows
//   header (UTF-8 JSON)             {"meta": {...}, "tensors": [{"name", "shape", "offset"}...]}
//   payload                         the tensors' float32 data, back to back, at their offsets
//   u32 crc32                       zlib CRC-32 of every preceding byte
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "cpd/status.h"

namespace cpd::runtime {

struct Checkpoint {
  std::string meta_json = "{}";  // free-form metadata (step, epoch, arch, options...)
  // Tensors by name; the name order is preserved in the file.
  std::vector<std::string> order;
  std::map<std::string, std::vector<int64_t>> shapes;
  std::map<std::string, std::vector<float>> data;

  void Put(const std::string& name, std::vector<int64_t> shape, const float* values, size_t n);
  bool Has(const std::string& name) const { return data.count(name) > 0; }
};

// Writes `ckpt` to `path` atomically. The directory must exist. A file already at `path` is
// never replaced: when it holds these very bytes there is nothing to do; otherwise IoError
// ("already exists with other contents ... refusing to overwrite it").
Status WriteCheckpoint(const std::string& path, const Checkpoint& ckpt);
// Reads and verifies a checkpoint: the CRC, then every header field's type and range (tensor
// entries with a name, a shape whose product is their count, back to back in the payload, which
// they fill exactly). Any inconsistency is CorruptCheckpoint(path, why); nothing throws. Whether
// the contents fit a model and a run is the Checkpointer's to check.
Result<Checkpoint> ReadCheckpoint(const std::string& path);
// Corruption "checkpoint PATH is corrupt: WHY; refusing it", the one message for a bad file.
Status CorruptCheckpoint(const std::string& path, const std::string& why);

// Checkpoint files in `dir` are named ckpt-<step, 12 digits>.cpd. Returns the newest complete
// one ("" if none).
std::string LatestCheckpoint(const std::string& dir);
std::string CheckpointPath(const std::string& dir, int64_t step);

// What identifies a checkpoint's contents without reading them all: the CRC-32 it ends with (of
// every byte before it) and its size. Reads the last 4 bytes and verifies nothing (ReadCheckpoint
// does); the format search binds its partial results to it. IoError naming the file when it
// cannot be read or is too short to be a checkpoint.
struct CheckpointId {
  uint32_t crc32 = 0;
  uint64_t bytes = 0;
};
Result<CheckpointId> ReadCheckpointId(const std::string& path);

}  // namespace cpd::runtime
