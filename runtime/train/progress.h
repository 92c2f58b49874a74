// The console's view of a running epoch: a bar with rate and ETA redrawn in place (an
// interactive terminal), or plain lines for a log (a pipe, a file, a cluster job's output), at
// most 10 an epoch and never a '\r' (the mode and the rate: cpd/progress.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>

#include "cpd/progress.h"

namespace cpd::runtime {

struct ProgressOptions {
  ProgressMode mode = ProgressMode::kLines;  // kBar, kLines or kOff (kAuto: as kLines)
  // Plain lines at least this many seconds and a tenth of an epoch apart, plus the epoch's
  // last batch (ProgressLineRate); >= 0.
  double interval_s = 30;
  std::FILE* out = stdout;          // where lines go
  const char* rate_unit = "img/s";  // what the rate counts ("tok/s" for a language model)
  // The clock of the interval (tests inject one); null: std::chrono::steady_clock::now.
  std::function<std::chrono::steady_clock::time_point()> now;
};

class Progress {
 public:
  explicit Progress(ProgressOptions options);
  // Batch `batch` of `batches` of epoch `epoch` of `epochs` is done. `bits` > 0: CPT's bits.
  void Update(int epoch, int epochs, int64_t batch, int64_t batches, double loss,
              double images_per_s, double eta_s, int bits);
  // Clears the bar's line before other output (a no-op unless a bar is showing).
  void EndLine();

 private:
  std::chrono::steady_clock::time_point Now() const;

  ProgressOptions o_;
  bool dirty_ = false;  // a bar is showing
  ProgressLineRate line_rate_;
};

}  // namespace cpd::runtime
