#include "runtime/train/progress.h"

#include <string>
#include <utility>

namespace cpd::runtime {

Progress::Progress(ProgressOptions options)
    : o_(std::move(options)), line_rate_(o_.interval_s, Now()) {}

std::chrono::steady_clock::time_point Progress::Now() const {
  return o_.now ? o_.now() : std::chrono::steady_clock::now();
}

void Progress::Update(int epoch, int epochs, int64_t batch, int64_t batches, double loss,
                      double images_per_s, double eta_s, int bits) {
  if (o_.mode == ProgressMode::kOff) return;
  if (o_.mode == ProgressMode::kBar) {
    const int width = 30;
    const int filled = batches > 0 ? int(width * batch / batches) : width;
    std::string bar(size_t(filled), '#');
    bar.resize(size_t(width), '.');
    std::fprintf(o_.out, "\r  epoch %d/%d [%s] %lld/%lld loss %.4f %6.0f %s ETA %5.0fs%s", epoch,
                 epochs, bar.c_str(), static_cast<long long>(batch),
                 static_cast<long long>(batches), loss, images_per_s, o_.rate_unit, eta_s,
                 bits > 0 ? (" bits " + std::to_string(bits)).c_str() : "");
    std::fflush(o_.out);
    dirty_ = true;
  } else if (line_rate_.Due(batch, batches, Now())) {
    std::fprintf(o_.out, "  epoch %d/%d step %lld/%lld loss %.4f %.0f %s eta %.0fs%s\n", epoch,
                 epochs, static_cast<long long>(batch), static_cast<long long>(batches), loss,
                 images_per_s, o_.rate_unit, eta_s,
                 bits > 0 ? (" bits " + std::to_string(bits)).c_str() : "");
    std::fflush(o_.out);
  }
}

void Progress::EndLine() {
  if (dirty_) std::fprintf(o_.out, "\r%100s\r", "");
  dirty_ = false;
}

}  // namespace cpd::runtime
