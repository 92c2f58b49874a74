// Progress lines when stdout is not a terminal: at most 10 an epoch (the rarer of the interval
// and a tenth of the epoch, on an injected clock), the epoch's last batch always, no '\r'; the
// bar on a terminal; nothing when off.
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
  ProgressCapture(double interval_s, ProgressMode mode) : file_(std::tmpfile()) {
    EXPECT_NE(file_, nullptr);
    ProgressOptions o;
    o.mode = mode;
    o.interval_s = interval_s;
    o.out = file_;
    o.now = [this] { return now_; };
    progress_ = std::make_unique<Progress>(o);
  }
  ~ProgressCapture() { std::fclose(file_); }

  void Advance(double seconds) {
    now_ += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  }
  // Batches 1..batches of epoch `epoch`, `seconds` apart.
  void Epoch(int64_t batches, double seconds, int epoch = 1) {
    for (int64_t b = 1; b <= batches; ++b) {
      Advance(seconds);
      progress_->Update(epoch, 3, b, batches, 0.5, 100, 1, 0);
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

constexpr ProgressMode kLines = ProgressMode::kLines;

TEST(Progress, IntervalZeroIsATenthOfTheEpoch) {
  ProgressCapture p(0, kLines);
  p.Epoch(250, 0.0);
  const std::string t = p.Text();
  EXPECT_EQ(p.Lines(), 10u) << t;
  for (const char* step : {"step 25/250 ", "step 50/250 ", "step 225/250 ", "step 250/250 "}) {
    EXPECT_NE(t.find(step), std::string::npos) << step << "\n" << t;
  }
  EXPECT_EQ(t.find('\r'), std::string::npos);
}

TEST(Progress, AnEpochOfFewerThanTenStepsHasALinePerStep) {
  ProgressCapture p(0, kLines);
  p.Epoch(7, 0.0);
  EXPECT_EQ(p.Lines(), 7u) << p.Text();
}

TEST(Progress, ALongIntervalLeavesOnlyTheEpochsEnd) {
  ProgressCapture p(3600, kLines);
  p.Epoch(250, 1.0);
  EXPECT_EQ(p.Lines(), 1u) << p.Text();
  EXPECT_NE(p.Text().find("step 250/250"), std::string::npos) << p.Text();
}

TEST(Progress, ALineWheneverTheIntervalHasPassed) {
  // 5 s interval, a step every 2 s: lines at 6 s, 12 s, 18 s (steps 3, 6, 9) and at the end (10).
  ProgressCapture p(5, kLines);
  p.Epoch(10, 2.0);
  const std::string t = p.Text();
  EXPECT_EQ(p.Lines(), 4u) << t;
  for (const char* step : {"step 3/10", "step 6/10", "step 9/10", "step 10/10"}) {
    EXPECT_NE(t.find(step), std::string::npos) << step << "\n" << t;
  }
  EXPECT_EQ(t.find('\r'), std::string::npos);
}

TEST(Progress, FastStepsAreBoundedByATenthOfTheEpoch) {
  // A 5 s interval alone would give a line every 50 steps of 0.1 s; the tenth (100 steps) is
  // rarer, so it decides: steps 100, 200, ..., 1000.
  ProgressCapture p(5, kLines);
  p.Epoch(1000, 0.1);
  const std::string t = p.Text();
  EXPECT_EQ(p.Lines(), 10u) << t;
  EXPECT_NE(t.find("step 100/1000 "), std::string::npos) << t;
  EXPECT_EQ(t.find("step 50/1000 "), std::string::npos) << t;
}

TEST(Progress, SlowStepsAreBoundedByTheInterval) {
  // 40 s steps, a 30 s interval: the interval has always passed, the tenth (10 steps) decides.
  ProgressCapture p(30, kLines);
  p.Epoch(100, 40.0);
  EXPECT_EQ(p.Lines(), 10u) << p.Text();
}

TEST(Progress, EveryEpochHasAtMostTenLinesAndItsEnd) {
  ProgressCapture p(0, kLines);
  for (int epoch = 1; epoch <= 3; ++epoch) p.Epoch(1000, 0.01, epoch);
  const std::string t = p.Text();
  EXPECT_EQ(p.Lines(), 30u) << t;
  for (const char* end : {"epoch 1/3 step 1000/1000 ", "epoch 2/3 step 1000/1000 ",
                          "epoch 3/3 step 1000/1000 ", "epoch 2/3 step 100/1000 "}) {
    EXPECT_NE(t.find(end), std::string::npos) << end << "\n" << t;
  }
}

TEST(Progress, ATerminalGetsTheBarRedrawnInPlace) {
  ProgressCapture p(3600, ProgressMode::kBar);
  p.Epoch(3, 0.0);
  const std::string t = p.Text();
  EXPECT_EQ(std::count(t.begin(), t.end(), '\r'), 3) << t;
  EXPECT_EQ(p.Lines(), 0u);
}

TEST(Progress, OffPrintsNothing) {
  ProgressCapture p(0, ProgressMode::kOff);
  p.Epoch(20, 1.0);
  EXPECT_EQ(p.Text(), "");
}

}  // namespace
}  // namespace cpd::runtime
