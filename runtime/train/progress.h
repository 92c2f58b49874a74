// The console's view of a running epoch: on a terminal, a bar with rate and ETA redrawn in place;
// otherwise (a pipe, a file, a cluster job's log) plain lines, one whenever at least
// interval_s seconds have passed since the last one, and one for the epoch's last batch, never
// a '\r'.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>

namespace cpd::runtime {

struct ProgressOptions {
  bool enabled = true;      // nothing is printed unless set
  bool tty = false;         // stdout is a terminal: the bar
  double interval_s = 5;    // plain lines at least this many seconds apart (0: every step); >= 0
  std::FILE* out = stdout;  // where lines go
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
  // A plain line is due: the interval has passed since the last one, or the epoch ends.
  bool LineDue(int64_t batch, int64_t batches);

  ProgressOptions o_;
  bool dirty_ = false;
  std::chrono::steady_clock::time_point last_line_;  // of the last plain line, or the start
};

}  // namespace cpd::runtime
