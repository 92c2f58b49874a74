#include "runtime/train/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

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

std::string DirOf(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

}  // namespace

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

  uLong crc = crc32(0L, Z_NULL, 0);
  crc = crc32(crc, reinterpret_cast<const Bytef*>(head.data()), uInt(head.size()));
  for (const auto& name : ckpt.order) {
    const auto& values = ckpt.data.at(name);
    // crc32 takes uInt lengths: feed large tensors in pieces.
    const auto* p = reinterpret_cast<const Bytef*>(values.data());
    size_t left = values.size() * sizeof(float);
    while (left > 0) {
      const uInt piece = uInt(std::min<size_t>(left, 1u << 30));
      crc = crc32(crc, p, piece);
      p += piece;
      left -= piece;
    }
  }
  unsigned char tail[4];
  for (int i = 0; i < 4; ++i) tail[i] = (uint32_t(crc) >> (8 * i)) & 0xff;

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

  auto corrupt = [&](const std::string& why) {
    return Status::Corruption("checkpoint " + path + " is corrupt (" + why + "); refusing it");
  };
  if (bytes.size() < sizeof(kMagic) + 8 + 4 ||
      std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return corrupt("not a CPD checkpoint: bad magic or too short");
  }
  const auto* u = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t body = bytes.size() - 4;
  uLong crc = crc32(0L, Z_NULL, 0);
  for (size_t at = 0; at < body;) {
    const uInt piece = uInt(std::min<size_t>(body - at, 1u << 30));
    crc = crc32(crc, u + at, piece);
    at += piece;
  }
  uint32_t stored = 0;
  for (int i = 3; i >= 0; --i) stored = (stored << 8) | u[body + i];
  if (uint32_t(crc) != stored) return corrupt("CRC-32 mismatch");

  const uint64_t header_bytes = ReadU64(u + sizeof(kMagic));
  const size_t payload_start = sizeof(kMagic) + 8 + header_bytes;
  if (header_bytes > body || payload_start > body) return corrupt("header length out of range");
  nlohmann::json header = nlohmann::json::parse(
      bytes.begin() + sizeof(kMagic) + 8, bytes.begin() + long(payload_start), nullptr, false);
  if (header.is_discarded() || !header.contains("tensors") || !header.contains("meta")) {
    return corrupt("bad header");
  }
  Checkpoint ckpt;
  ckpt.meta_json = header["meta"].dump();
  const size_t payload = body - payload_start;
  for (const auto& t : header["tensors"]) {
    const std::string name = t.value("name", "");
    const uint64_t offset = t.value("offset", uint64_t(0));
    const uint64_t count = t.value("count", uint64_t(0));
    if (name.empty() || offset > payload || count > (payload - offset) / sizeof(float)) {
      return corrupt("tensor '" + name + "' lies outside the payload");
    }
    std::vector<int64_t> shape = t.value("shape", std::vector<int64_t>{});
    std::vector<float> values(count);
    if (count > 0) std::memcpy(values.data(), bytes.data() + payload_start + offset, count * 4);
    ckpt.order.push_back(name);
    ckpt.shapes[name] = std::move(shape);
    ckpt.data[name] = std::move(values);
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

}  // namespace cpd::runtime
