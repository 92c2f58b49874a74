#include "runtime/train/progress.h"

#include <cstdio>
#include <string>

namespace cpd::runtime {

void Progress::Update(int epoch, int epochs, int64_t batch, int64_t batches, double loss,
                      double images_per_s, double eta_s, int bits) {
  if (!enabled_) return;
  if (tty_) {
    const int width = 30;
    const int filled = batches > 0 ? int(width * batch / batches) : width;
    std::string bar(size_t(filled), '#');
    bar.resize(size_t(width), '.');
    std::printf("\r  epoch %d/%d [%s] %lld/%lld loss %.4f %6.0f img/s ETA %5.0fs%s", epoch, epochs,
                bar.c_str(), static_cast<long long>(batch), static_cast<long long>(batches), loss,
                images_per_s, eta_s, bits > 0 ? (" bits " + std::to_string(bits)).c_str() : "");
    std::fflush(stdout);
    dirty_ = true;
  } else if (batch % 100 == 0 || batch == batches) {
    std::printf("  epoch %d/%d step %lld/%lld loss %.4f %.0f img/s eta %.0fs\n", epoch, epochs,
                static_cast<long long>(batch), static_cast<long long>(batches), loss, images_per_s,
                eta_s);
    std::fflush(stdout);
  }
}

void Progress::EndLine() {
  if (dirty_) std::printf("\r%100s\r", "");
  dirty_ = false;
}

}  // namespace cpd::runtime
