#include "runtime/train/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <vector>

namespace cpd::runtime {

namespace {

constexpr char kMagic[8] = {'C', 'P', 'D', 'C', 'K', 'P', 'T', '1'};

std::string Errno() { return std::strerror(errno); }

void AppendU64(std::string* s, uint64_t v) {
  for (int i = 0; i < 8; ++i) s->push_back(char((v >> (8 * i)) & 0xff));
}

uint64_t ReadU64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Writes all of `data` to fd, retrying short writes.
bool WriteAll(int fd, const char* data, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, data, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data += w;
    n -= size_t(w);
  }
  return true;
}

// zlib's CRC-32 over n bytes (crc32 takes uInt lengths: large buffers go in pieces).
uint32_t Crc32(const unsigned char* p, size_t n, uLong crc = crc32(0L, Z_NULL, 0)) {
  while (n > 0) {
    const uInt piece = uInt(std::min<size_t>(n, 1u << 30));
    crc = crc32(crc, p, piece);
    p += piece;
    n -= piece;
  }
  return uint32_t(crc);
}

// Whether `path` exists and holds exactly head, the tensors and tail; an error when it exists
// with other contents (or cannot be read).
Result<bool> SameAsExisting(const std::string& path, const std::string& head, const Checkpoint& ck,
                            const unsigned char tail[4]) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    if (errno == ENOENT) return false;
    return Status::IoError("checkpoint " + path + " exists but cannot be read: " + Errno());
  }
  auto same_next = [f](const void* data, size_t n) {
    std::vector<char> buf(std::min<size_t>(n, 1 << 20));
    const char* want = static_cast<const char*>(data);
    while (n > 0) {
      const size_t piece = std::min(n, buf.size());
      if (std::fread(buf.data(), 1, piece, f) != piece || std::memcmp(buf.data(), want, piece)) {
        return false;
      }
      want += piece;
      n -= piece;
    }
    return true;
  };
  bool same = same_next(head.data(), head.size());
  for (size_t i = 0; same && i < ck.order.size(); ++i) {
    const auto& values = ck.data.at(ck.order[i]);
    same = same_next(values.data(), values.size() * sizeof(float));
  }
  same = same && same_next(tail, 4) && std::fgetc(f) == EOF;
  std::fclose(f);  // read only: nothing is lost if closing fails
  if (!same) {
    return Status::IoError("checkpoint " + path +
                           " already exists with other contents (another run's, or an earlier "
                           "one's); refusing to overwrite it: move it away or use another "
                           "--checkpoint-dir");
  }
  return true;
}

std::string DirOf(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

}  // namespace

Status CorruptCheckpoint(const std::string& path, const std::string& why) {
  return Status::Corruption("checkpoint " + path + " is corrupt: " + why + "; refusing it");
}

void Checkpoint::Put(const std::string& name, std::vector<int64_t> shape, const float* values,
                     size_t n) {
  if (data.count(name) == 0) order.push_back(name);
  shapes[name] = std::move(shape);
  data[name].assign(values, values + n);
}

Status WriteCheckpoint(const std::string& path, const Checkpoint& ckpt) {
  nlohmann::json header;
  nlohmann::json meta = nlohmann::json::parse(ckpt.meta_json, nullptr, false);
  if (meta.is_discarded()) return Status::InvalidArgument("checkpoint metadata is not JSON");
  header["meta"] = meta;
  header["tensors"] = nlohmann::json::array();
  uint64_t offset = 0;
  for (const auto& name : ckpt.order) {
    const auto& values = ckpt.data.at(name);
    header["tensors"].push_back({{"name", name},
                                 {"shape", ckpt.shapes.at(name)},
                                 {"offset", offset},
                                 {"count", values.size()}});
    offset += values.size() * sizeof(float);
  }
  const std::string header_text = header.dump();

  std::string head(kMagic, sizeof(kMagic));
  AppendU64(&head, header_text.size());
  head += header_text;

  uint32_t crc = Crc32(reinterpret_cast<const unsigned char*>(head.data()), head.size());
  for (const auto& name : ckpt.order) {
    const auto& values = ckpt.data.at(name);
    crc = Crc32(reinterpret_cast<const unsigned char*>(values.data()),
                values.size() * sizeof(float), crc);
  }
  unsigned char tail[4];
  for (int i = 0; i < 4; ++i) tail[i] = (crc >> (8 * i)) & 0xff;

  // A file of this name that holds anything else belongs to another run (or to this run's past
  // with other results): it is never replaced. The same bytes again need no writing.
  CPD_ASSIGN_OR_RETURN(const bool same, SameAsExisting(path, head, ckpt, tail));
  if (same) return Status::Ok();

  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IoError("cannot create " + tmp + ": " + Errno());
  bool ok = WriteAll(fd, head.data(), head.size());
  for (const auto& name : ckpt.order) {
    if (!ok) break;
    const auto& values = ckpt.data.at(name);
    ok = WriteAll(fd, reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  }
  ok = ok && WriteAll(fd, reinterpret_cast<const char*>(tail), 4);
  ok = ok && ::fsync(fd) == 0;
  std::string write_error = ok ? "" : Errno();
  // close() can report a deferred write error (NFS); then the file is not known to be whole.
  if (::close(fd) != 0 && ok) {
    ok = false;
    write_error = Errno();
  }
  if (!ok) {
    ::unlink(tmp.c_str());  // best effort: the temporary name is never read
    return Status::IoError("writing " + tmp + ": " + write_error);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string err = Errno();
    ::unlink(tmp.c_str());  // best effort, as above
    return Status::IoError("renaming " + tmp + " to " + path + ": " + err);
  }
  // Make the rename itself durable. File systems that cannot sync a directory say EINVAL; the
  // file itself is durable then, and that is all they offer.
  const int dfd = ::open(DirOf(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return Status::IoError("opening the directory of " + path + ": " + Errno());
  const bool synced = ::fsync(dfd) == 0 || errno == EINVAL;
  const std::string sync_error = synced ? "" : Errno();
  if (::close(dfd) != 0 || !synced) {
    return Status::IoError("syncing the directory of " + path + ": " +
                           (synced ? Errno() : sync_error));
  }
  return Status::Ok();
}

Result<Checkpoint> ReadCheckpoint(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return Status::NotFound("cannot open checkpoint " + path + ": " + Errno());
  std::string bytes;
  char buf[1 << 16];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof(buf), f)) > 0) bytes.append(buf, got);
  const bool read_error = std::ferror(f) != 0;
  std::fclose(f);  // read only: nothing is lost if closing fails
  if (read_error) return Status::IoError("reading checkpoint " + path + ": " + Errno());

  auto corrupt = [&](const std::string& why) { return CorruptCheckpoint(path, why); };
  if (bytes.size() < sizeof(kMagic) + 8 + 4 ||
      std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return corrupt("not a CPD checkpoint: bad magic or too short");
  }
  const auto* u = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t body = bytes.size() - 4;
  uint32_t stored = 0;
  for (int i = 3; i >= 0; --i) stored = (stored << 8) | u[body + i];
  if (Crc32(u, body) != stored) return corrupt("CRC-32 mismatch");

  const uint64_t header_bytes = ReadU64(u + sizeof(kMagic));
  if (header_bytes > body - sizeof(kMagic) - 8) return corrupt("header length out of range");
  const size_t payload_start = sizeof(kMagic) + 8 + size_t(header_bytes);
  // A valid CRC only says the file is as written: every field is still checked for its type and
  // range here, and nothing in it throws.
  const nlohmann::json header = nlohmann::json::parse(
      bytes.begin() + sizeof(kMagic) + 8, bytes.begin() + long(payload_start), nullptr, false);
  if (header.is_discarded()) return corrupt("the header is not JSON");
  if (!header.is_object()) return corrupt("the header is not a JSON object");
  const auto meta = header.find("meta");
  const auto tensors = header.find("tensors");
  if (meta == header.end() || !meta->is_object()) return corrupt("'meta' is not an object");
  if (tensors == header.end() || !tensors->is_array()) {
    return corrupt("'tensors' is not an array");
  }
  Checkpoint ckpt;
  ckpt.meta_json = meta->dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  const uint64_t payload = body - payload_start;
  uint64_t next_offset = 0;  // the writer puts the tensors back to back, in order
  for (size_t i = 0; i < tensors->size(); ++i) {
    const nlohmann::json& t = (*tensors)[i];
    const std::string entry = "tensor entry " + std::to_string(i);
    if (!t.is_object()) return corrupt(entry + " is not an object");
    const auto name = t.find("name"), shape = t.find("shape"), offset = t.find("offset"),
               count = t.find("count");
    if (name == t.end() || !name->is_string() || name->get_ref<const std::string&>().empty()) {
      return corrupt(entry + ": 'name' is not a non-empty string");
    }
    const std::string& n = name->get_ref<const std::string&>();
    if (ckpt.data.count(n) > 0) return corrupt("tensor '" + n + "' appears twice");
    if (offset == t.end() || !offset->is_number_unsigned() || count == t.end() ||
        !count->is_number_unsigned()) {
      return corrupt("tensor '" + n + "': 'offset' and 'count' must be non-negative integers");
    }
    if (shape == t.end() || !shape->is_array()) {
      return corrupt("tensor '" + n + "': 'shape' is not an array");
    }
    std::vector<int64_t> dims;
    unsigned __int128 elements = 1;  // dimensions <= 2^40, capped at 2^63: never wraps
    for (const nlohmann::json& d : *shape) {
      // A dimension beyond 2^40 cannot be a tensor in memory.
      if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t(1) << 40)) {
        return corrupt("tensor '" + n + "': 'shape' holds " + d.dump() +
                       ", not a dimension (an integer in 0..2^40)");
      }
      dims.push_back(int64_t(d.get<uint64_t>()));
      elements = std::min<unsigned __int128>(elements * uint64_t(dims.back()), uint64_t(1) << 63);
    }
    const uint64_t c = count->get<uint64_t>(), o = offset->get<uint64_t>();
    if (elements != c) {
      return corrupt("tensor '" + n + "': shape " + shape->dump() + " does not hold " +
                     std::to_string(c) + " values");
    }
    if (o != next_offset || c > (payload - o) / sizeof(float)) {
      return corrupt("tensor '" + n + "' lies outside its place in the payload");
    }
    next_offset = o + c * sizeof(float);
    std::vector<float> values(c);
    if (c > 0) std::memcpy(values.data(), bytes.data() + payload_start + o, c * sizeof(float));
    ckpt.order.push_back(n);
    ckpt.shapes[n] = std::move(dims);
    ckpt.data[n] = std::move(values);
  }
  if (next_offset != payload) {
    return corrupt(std::to_string(payload - next_offset) + " payload bytes belong to no tensor");
  }
  return ckpt;
}

std::string CheckpointPath(const std::string& dir, int64_t step) {
  char name[64];
  std::snprintf(name, sizeof(name), "ckpt-%012lld.cpd", static_cast<long long>(step));
  return dir + "/" + name;
}

std::string LatestCheckpoint(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return "";
  std::string best;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    // Only complete files: ckpt-<12 digits>.cpd (temporaries carry a .tmp.<pid> suffix).
    if (name.size() == 21 && name.rfind("ckpt-", 0) == 0 && name.substr(17) == ".cpd" &&
        name > best) {
      best = name;
    }
  }
  ::closedir(d);
  return best.empty() ? "" : dir + "/" + best;
}

Result<CheckpointId> ReadCheckpointId(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::IoError("cannot open checkpoint " + path + ": " + Errno());
  CheckpointId id;
  unsigned char tail[4];
  const off_t end = ::lseek(fd, 0, SEEK_END);
  const bool read = end >= off_t(sizeof(kMagic) + 8 + 4) && ::pread(fd, tail, 4, end - 4) == 4;
  const std::string err = Errno();
  ::close(fd);
  if (!read) return Status::IoError("cannot read the CRC-32 of checkpoint " + path + ": " + err);
  for (int i = 3; i >= 0; --i) id.crc32 = (id.crc32 << 8) | tail[i];
  id.bytes = uint64_t(end);
  return id;
}

}  // namespace cpd::runtime
