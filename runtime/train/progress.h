// The console's view of a running epoch: a bar with rate and ETA redrawn in place on a terminal;
// plain lines every 100 steps (and at the epoch's end) otherwise.
#pragma once

#include <cstdint>

namespace cpd::runtime {

class Progress {
 public:
  // Nothing is printed unless `enabled`; `tty`: stdout is a terminal.
  Progress(bool enabled, bool tty) : enabled_(enabled), tty_(tty) {}
  // Batch `batch` of `batches` of epoch `epoch` of `epochs` is done. `bits` > 0: CPT's bits.
  void Update(int epoch, int epochs, int64_t batch, int64_t batches, double loss,
              double images_per_s, double eta_s, int bits);
  // Clears the bar's line before other output (a no-op unless a bar is showing).
  void EndLine();

 private:
  bool enabled_, tty_;
  bool dirty_ = false;
};

}  // namespace cpd::runtime
