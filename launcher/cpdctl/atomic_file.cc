#include "launcher/cpdctl/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "launcher/cpdctl/client.h"

namespace cpd::ctl {
namespace {

std::vector<std::string>& TempFiles() {
  static std::vector<std::string> files;
  return files;
}

void RemoveTempFiles() {
  // Best effort at exit: a file that cannot be removed is left, and nothing can be reported.
  for (const auto& f : TempFiles()) unlink(f.c_str());
  TempFiles().clear();
}

}  // namespace

void AddTempFile(const std::string& path) {
  // The list exists before the handler is registered, so it is destroyed after the handler ran.
  std::vector<std::string>& files = TempFiles();
  static const bool registered = std::atexit(RemoveTempFiles) == 0;
  (void)registered;
  files.push_back(path);
}

void ForgetTempFile(const std::string& path) {
  auto& v = TempFiles();
  v.erase(std::remove(v.begin(), v.end(), path), v.end());
}

AtomicFile::AtomicFile(const std::string& path, const std::string& suffix) : path_(path) {
  const size_t slash = path.rfind('/');
  dir_ = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  tmp_ = dir_ + "/." + base + ".tmp.XXXXXX" + suffix;
  fd_ = mkstemps(tmp_.data(), int(suffix.size()));
  if (fd_ < 0) Fail("cannot create a file in " + dir_ + ": " + std::strerror(errno));
  AddTempFile(tmp_);
}

AtomicFile::~AtomicFile() {
  // Cleanup of an abandoned temporary: errors change nothing and have no one to go to.
  if (file_ != nullptr) std::fclose(file_);
  if (fd_ >= 0 && file_ == nullptr) close(fd_);
  if (!committed_) unlink(tmp_.c_str());
  ForgetTempFile(tmp_);
}

FILE* AtomicFile::stream() {
  if (file_ == nullptr) file_ = fdopen(fd_, "w");
  if (file_ == nullptr) Fail("cannot open " + tmp_ + ": " + std::strerror(errno));
  return file_;
}

void AtomicFile::Commit() {
  SyncAndClose();
  // mkstemp makes the file 0600; give it the permissions a new file would get.
  const mode_t mask = umask(0);
  umask(mask);
  if (chmod(tmp_.c_str(), 0666 & ~mask) != 0) {
    Fail("cannot set the permissions of " + tmp_ + ": " + std::strerror(errno));
  }
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    Fail("cannot rename " + tmp_ + " to " + path_ + ": " + std::strerror(errno));
  }
  committed_ = true;
  ForgetTempFile(tmp_);
  SyncDirectory();
}

void AtomicFile::SyncAndClose() {
  if (file_ != nullptr) {
    if (std::fflush(file_) != 0 || std::ferror(file_)) WriteFailed();
  }
  // Another process (the plot script) may have written the temporary: sync it by name.
  const int fd = open(tmp_.c_str(), O_RDONLY);
  if (fd < 0) WriteFailed();
  if (fsync(fd) != 0) {
    const int saved = errno;
    close(fd);
    errno = saved;
    WriteFailed();
  }
  if (close(fd) != 0) WriteFailed();
  FILE* const file = file_;
  const int own_fd = fd_;
  file_ = nullptr;
  fd_ = -1;
  if ((file != nullptr ? std::fclose(file) : close(own_fd)) != 0) WriteFailed();
}

// The rename is durable once the directory is synced. File systems that cannot sync a
// directory say EINVAL; the rename stands there as it does on any other.
void AtomicFile::SyncDirectory() {
  const int dfd = open(dir_.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd < 0) Fail("cannot open the directory " + dir_ + ": " + std::strerror(errno));
  const bool synced = fsync(dfd) == 0 || errno == EINVAL;
  const int saved = errno;
  close(dfd);
  if (!synced) Fail("cannot sync the directory " + dir_ + ": " + std::strerror(saved));
}

void AtomicFile::WriteFailed() { Fail("writing " + path_ + ": " + std::strerror(errno)); }

}  // namespace cpd::ctl
