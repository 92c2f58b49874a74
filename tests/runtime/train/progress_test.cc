// Progress lines when stdout is not a terminal: time-based (an injected clock), the epoch's last
// batch always, no '\r'; the bar on a terminal.
#include "runtime/train/progress.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

namespace cpd::runtime {
namespace {

using Clock = std::chrono::steady_clock;

// A Progress writing to a temporary file, on a clock the test moves.
class ProgressCapture {
 public:
  ProgressCapture(double interval_s, bool tty) : file_(std::tmpfile()) {
    EXPECT_NE(file_, nullptr);
    ProgressOptions o;
    o.tty = tty;
    o.interval_s = interval_s;
    o.out = file_;
    o.now = [this] { return now_; };
    progress_ = std::make_unique<Progress>(o);
  }
  ~ProgressCapture() { std::fclose(file_); }

  void Advance(double seconds) {
    now_ += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  }
  // Batches 1..batches of one epoch, `seconds` apart.
  void Epoch(int64_t batches, double seconds) {
    for (int64_t b = 1; b <= batches; ++b) {
      Advance(seconds);
      progress_->Update(1, 1, b, batches, 0.5, 100, 1, 0);
    }
  }
  std::string Text() {
    std::fflush(file_);
    std::rewind(file_);
    std::string out;
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, file_)) > 0) out.append(buf, n);
    return out;
  }
  size_t Lines() {
    const std::string t = Text();
    return size_t(std::count(t.begin(), t.end(), '\n'));
  }

 private:
  std::FILE* file_;
  Clock::time_point now_{};
  std::unique_ptr<Progress> progress_;
};

TEST(Progress, IntervalZeroIsOneLinePerStep) {
  ProgressCapture p(0, /*tty=*/false);
  p.Epoch(7, 0.0);
  EXPECT_EQ(p.Lines(), 7u) << p.Text();
  EXPECT_EQ(p.Text().find('\r'), std::string::npos);
}

TEST(Progress, ALongIntervalLeavesOnlyTheEpochsEnd) {
  ProgressCapture p(3600, /*tty=*/false);
  p.Epoch(250, 1.0);
  EXPECT_EQ(p.Lines(), 1u) << p.Text();
  EXPECT_NE(p.Text().find("step 250/250"), std::string::npos) << p.Text();
}

TEST(Progress, ALineWheneverTheIntervalHasPassed) {
  // 5 s interval, a step every 2 s: lines at 6 s, 12 s, 18 s (steps 3, 6, 9) and at the end (10).
  ProgressCapture p(5, /*tty=*/false);
  p.Epoch(10, 2.0);
  const std::string t = p.Text();
  EXPECT_EQ(p.Lines(), 4u) << t;
  for (const char* step : {"step 3/10", "step 6/10", "step 9/10", "step 10/10"}) {
    EXPECT_NE(t.find(step), std::string::npos) << step << "\n" << t;
  }
  EXPECT_EQ(t.find('\r'), std::string::npos);
}

TEST(Progress, ATerminalGetsTheBarRedrawnInPlace) {
  ProgressCapture p(3600, /*tty=*/true);
  p.Epoch(3, 0.0);
  const std::string t = p.Text();
  EXPECT_EQ(std::count(t.begin(), t.end(), '\r'), 3) << t;
  EXPECT_EQ(p.Lines(), 0u);
}

}  // namespace
}  // namespace cpd::runtime
