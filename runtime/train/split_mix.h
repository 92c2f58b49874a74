// The seeded streams of the data sets (shuffling, augmentation, synthetic samples, language-model
// windows): exact integer arithmetic, so that every draw is the same on every platform, standard
// library and thread count. Internal to runtime/train.
#pragma once

#include <cstdint>

#include "kernels/grid.h"

namespace cpd::runtime {

// splitmix64 as a stream: outputs mix(key + k * golden) for k = 1, 2, ... (Steele et al. 2014),
// with Lemire's unbiased multiply-and-reject for bounded draws (Lemire 2019).
class SplitMixStream {
 public:
  explicit SplitMixStream(uint64_t key) : state_(key) {}
  uint64_t Next() {
    const uint64_t r = kernels::SplitMix64(state_);
    state_ += 0x9e3779b97f4a7c15ull;
    return r;
  }
  // Uniform in [0, n), n >= 1.
  uint64_t Below(uint64_t n) {
    unsigned __int128 m = (unsigned __int128)Next() * n;
    uint64_t low = uint64_t(m);
    if (low < n) {
      const uint64_t threshold = (0 - n) % n;
      while (low < threshold) {
        m = (unsigned __int128)Next() * n;
        low = uint64_t(m);
      }
    }
    return uint64_t(m >> 64);
  }

 private:
  uint64_t state_;
};

// A key for item `i` under `key`: independent bits per item.
inline uint64_t Hash2(uint64_t key, uint64_t i) {
  return kernels::SplitMix64(key ^ kernels::SplitMix64(i));
}

}  // namespace cpd::runtime
