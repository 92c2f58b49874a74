// Files that cpdctl writes: whole or not at all, and no temporary left behind on any exit.
#pragma once

#include <cstdio>
#include <string>

namespace cpd::ctl {

// Temporary files to remove when cpdctl exits, also through Fail() (std::exit runs no
// destructors). Single-threaded use: the watch threads create no files.
void AddTempFile(const std::string& path);
void ForgetTempFile(const std::string& path);

// A file created as a temporary in the target's directory and renamed over the target only when
// complete (after fsync), so a reader sees the old file or the whole new one. Every failure is a
// Fail() naming the file.
class AtomicFile {
 public:
  // `suffix` is kept at the end of the temporary's name (matplotlib reads the format from it).
  explicit AtomicFile(const std::string& path, const std::string& suffix = "");
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  const std::string& temp_path() const { return tmp_; }
  FILE* stream();

  // fsync, rename over the target, fsync the directory.
  void Commit();

 private:
  void SyncAndClose();
  void SyncDirectory();
  [[noreturn]] void WriteFailed();

  std::string path_, dir_, tmp_;
  int fd_ = -1;
  FILE* file_ = nullptr;
  bool committed_ = false;
};

}  // namespace cpd::ctl
