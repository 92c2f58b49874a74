// Helpers shared by the libFuzzer targets of tests/fuzz (see tests/fuzz/README.md).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

namespace cpd::fuzz {

// Stops the run (libFuzzer reports the input) when an invariant does not hold.
#define CPD_FUZZ_CHECK(cond, what)                                                                 \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      std::fprintf(stderr, "fuzz invariant violated: %s (%s:%d): %s\n", #cond, __FILE__, __LINE__, \
                   std::string(what).c_str());                                                     \
      std::abort();                                                                                \
    }                                                                                              \
  } while (0)

// Consumes the fuzz input front to back: fixed-size values first, the rest as bytes.
class Input {
 public:
  Input(const uint8_t* data, size_t size) : p_(data), left_(size) {}
  template <typename T>
  T Take() {
    T v{};
    const size_t n = left_ < sizeof(T) ? left_ : sizeof(T);
    std::memcpy(&v, p_, n);
    p_ += n;
    left_ -= n;
    return v;
  }
  // Up to the next 0 byte (consumed) or the end.
  std::string TakeString() {
    const void* nul = std::memchr(p_, 0, left_);
    const size_t n = nul != nullptr ? size_t(static_cast<const uint8_t*>(nul) - p_) : left_;
    std::string s(reinterpret_cast<const char*>(p_), n);
    const size_t used = nul != nullptr ? n + 1 : n;
    p_ += used;
    left_ -= used;
    return s;
  }
  std::string Rest() {
    std::string s(reinterpret_cast<const char*>(p_), left_);
    p_ += left_;
    left_ = 0;
    return s;
  }
  size_t left() const { return left_; }

 private:
  const uint8_t* p_;
  size_t left_;
};

// A directory of this process for the files the readers under test open (on tmpfs when there
// is one), created once.
inline const std::string& ScratchDir() {
  static const std::string dir = [] {
    const std::string base = std::filesystem::exists("/dev/shm") ? "/dev/shm" : "/tmp";
    std::string d = base + "/cpd-fuzz-" + std::to_string(::getpid());
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

inline void WriteFile(const std::string& path, const std::string& bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) {
    std::abort();
  }
  std::fclose(f);
}

}  // namespace cpd::fuzz
