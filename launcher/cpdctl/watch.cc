// cpdctl watch: follows a job live. On a terminal the status block (and --layers table) is
// redrawn in place; otherwise one line (or one JSON object) per report.
#include <pthread.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "launcher/common.h"
#include "launcher/cpdctl/commands.h"
#include "launcher/cpdctl/output.h"

namespace cpd::ctl {
namespace {

// SIGINT/SIGTERM/SIGHUP are taken by a thread (sigwait) that cancels the stream; they must be
// blocked before gRPC starts its threads, which inherit the mask.
sigset_t StopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGHUP);
  sigaddset(&set, SIGUSR1);  // ends the signal thread
  return set;
}

// A one-line summary of a report (the non-TTY output of watch).
std::string ReportLine(const v1::StatsReport& r, const v1::JobStatusResponse& st) {
  std::string l = "step " + Ratio(r.step(), st.job().total_steps()) + " epoch " +
                  Ratio(r.epoch(), st.epochs()) + " loss " + FormatG(r.loss(), 5) + " lr " +
                  FormatG(r.lr(), 4);
  // Ratio() spaces its slash for the status block; lines are denser.
  for (size_t p; (p = l.find(" / ")) != std::string::npos;) l.replace(p, 3, "/");
  if (r.bits() > 0) l += " bits " + std::to_string(r.bits());
  l += " schedule v" + std::to_string(r.schedule_version()) + " ranks " +
       std::to_string(r.ranks_alive()) + "/" + std::to_string(st.job().world_size()) + " " +
       FormatG(r.images_per_s(), 4) + " img/s";
  if (Measured(r.test_perplexity())) {
    // A language model's epoch: its validation where a vision model's accuracies are.
    if (Measured(r.test_loss())) l += " val loss " + FormatMeasured(r.test_loss(), 4);
    l += " ppl " + FormatMeasured(r.test_perplexity(), 2);
    if (Measured(r.test_bits_per_byte())) l += " bpb " + FormatMeasured(r.test_bits_per_byte(), 3);
  } else {
    if (r.train_accuracy() >= 0) l += " train " + FormatAccuracy(r.train_accuracy());
    if (r.test_accuracy() >= 0) l += " test " + FormatAccuracy(r.test_accuracy());
  }
  if (r.skipped_steps() > 0) l += " skipped " + std::to_string(r.skipped_steps());
  if (r.layers_size() > 0) l += " layers " + std::to_string(r.layers_size());
  if (r.finished()) l += " finished";
  return l + "\n";
}

// Folds a report into the status block's fields (reports_stored stays as JobStatus said: the
// coordinator stores reports asynchronously).
void Absorb(const v1::StatsReport& r, v1::JobStatusResponse* st) {
  st->mutable_job()->set_step(r.step());
  st->mutable_job()->set_last_report_ms(r.time_ms());
  if (r.finished()) st->mutable_job()->set_state("finished");
  st->set_epoch(r.epoch());
  st->set_bits(r.bits());
  st->set_loss(r.loss());
  if (r.train_accuracy() >= 0) st->set_train_accuracy(r.train_accuracy());
  if (r.test_accuracy() >= 0) st->set_test_accuracy(r.test_accuracy());
  if (Measured(r.test_loss())) st->set_test_loss(r.test_loss());
  if (Measured(r.test_perplexity())) st->set_test_perplexity(r.test_perplexity());
  if (Measured(r.test_bits_per_byte())) st->set_test_bits_per_byte(r.test_bits_per_byte());
  st->set_ranks_alive(r.ranks_alive());
  st->set_images_per_s(r.images_per_s());
  st->set_dropped_reports(r.dropped_reports());
  st->set_skipped_steps(r.skipped_steps());
  st->mutable_schedule()->set_version(std::max(st->schedule().version(), r.schedule_version()));
}

int TerminalRows() {
  winsize ws{};
  if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_row > 0) return ws.ws_row;
  return 40;
}

// The reports of a WatchJob stream, handed from the reading thread to the drawing one.
struct WatchQueue {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<v1::StatsReport> reports;
  bool ended = false;  // the stream is over (status below)
  bool interrupted = false;
  grpc::Status status;
};

// One run of `cpdctl watch`: a thread reads the stream into the queue, another takes the stop
// signals and cancels it; the calling thread prints.
class Watch {
 public:
  Watch(const Globals& g, const WatchArgs& a) : g_(g), a_(a) {}
  int Run();

 private:
  using Clock = std::chrono::steady_clock;

  void StartThreads();
  void StopThreads();
  void LoadLatestLayers();
  // Waits for reports (on a terminal, at most one redraw interval); false once it should stop.
  bool Step();
  void Take(const v1::StatsReport& r);
  void Draw();
  std::string LayersScreen(const std::string& block) const;

  const Globals& g_;
  const WatchArgs& a_;
  v1::JobRef ref_;
  sigset_t stop_{};
  std::unique_ptr<Connection> c_;
  v1::JobStatusResponse st_;
  bool tty_ = false;

  grpc::ClientContext ctx_;
  WatchQueue q_;
  std::unique_ptr<grpc::ClientReader<v1::StatsReport>> reader_;
  std::thread signals_, reading_;

  Clock::time_point started_;
  int64_t age_at_start_ = -1;
  std::optional<Clock::time_point> last_arrival_;
  v1::StatsReport with_layers_;  // the latest report that carried layer rows
  bool have_layers_ = false, finished_ = false, dirty_ = true;
  int received_ = 0;
  std::chrono::microseconds interval_{0};
  Clock::time_point last_draw_;
  bool by_count_ = false, interrupted_ = false, ended_ = false;
  grpc::Status end_status_;
};

int Watch::Run() {
  ref_ = MakeRef(a_.job);
  stop_ = StopSignals();
  if (const int rc = pthread_sigmask(SIG_BLOCK, &stop_, nullptr); rc != 0) {
    Fail(std::string("cannot block the stop signals: ") + std::strerror(rc));
  }
  c_ = std::make_unique<Connection>(g_);
  st_ = GetStatus(*c_, a_.job);  // checks the job and the connection first
  tty_ = isatty(STDOUT_FILENO) && !g_.json;
  StartThreads();
  started_ = Clock::now();
  age_at_start_ = st_.last_report_age_ms();
  if (a_.layers && tty_) LoadLatestLayers();
  interval_ = std::chrono::microseconds(int64_t(a_.interval_s * 1e6));
  last_draw_ = Clock::now() - interval_;
  while (Step()) {
  }
  StopThreads();
  if (by_count_ || interrupted_ || finished_) return 0;
  if (end_status_.ok()) return 0;  // the coordinator ended the stream: the job is over
  c_->FailCall(end_status_, "WatchJob", a_.job);
}

void Watch::StartThreads() {
  c_->Prepare(&ctx_, /*with_deadline=*/false);
  v1::WatchJobRequest req;
  *req.mutable_job() = ref_;
  req.set_with_layers(a_.layers);
  signals_ = std::thread([this] {
    int sig = 0;
    while (sigwait(&stop_, &sig) == 0) {
      if (sig == SIGUSR1) return;
      {
        std::lock_guard<std::mutex> lock(q_.mu);
        q_.interrupted = true;
      }
      ctx_.TryCancel();
      q_.cv.notify_all();
    }
  });
  reader_ = c_->ops().WatchJob(&ctx_, req);
  reading_ = std::thread([this] {
    v1::StatsReport r;
    while (reader_->Read(&r)) {
      std::lock_guard<std::mutex> lock(q_.mu);
      q_.reports.push_back(r);
      q_.cv.notify_all();
    }
    grpc::Status s = reader_->Finish();
    std::lock_guard<std::mutex> lock(q_.mu);
    q_.status = std::move(s);
    q_.ended = true;
    q_.cv.notify_all();
  });
}

void Watch::StopThreads() {
  ctx_.TryCancel();
  reading_.join();
  if (const int rc = pthread_kill(signals_.native_handle(), SIGUSR1); rc != 0) {
    Fail(std::string("cannot stop the signal thread: ") + std::strerror(rc));
  }
  signals_.join();
  std::lock_guard<std::mutex> lock(q_.mu);
  end_status_ = q_.status;
}

// The table starts from the latest stored layer rows, not empty until the next such report.
void Watch::LoadLatestLayers() {
  v1::LayerStatsRequest lreq;
  *lreq.mutable_job() = ref_;
  lreq.set_latest(true);
  grpc::ClientContext lctx;
  c_->Prepare(&lctx);
  v1::LayerStatsResponse lresp;
  const grpc::Status ls = c_->ops().LayerStats(&lctx, lreq, &lresp);
  if (ls.ok() && lresp.reports_size() > 0) {
    with_layers_ = lresp.reports(lresp.reports_size() - 1);
    have_layers_ = true;
  }
}

bool Watch::Step() {
  std::deque<v1::StatsReport> batch;
  {
    std::unique_lock<std::mutex> lock(q_.mu);
    q_.cv.wait_for(lock, tty_ ? interval_ : std::chrono::microseconds(3'600'000'000LL),
                   [&] { return !q_.reports.empty() || q_.ended || q_.interrupted; });
    batch.swap(q_.reports);
    interrupted_ = q_.interrupted;
    ended_ = q_.ended;
    end_status_ = q_.status;
  }
  for (const auto& r : batch) {
    if (by_count_) break;
    Take(r);
  }
  if (tty_ && (dirty_ || Clock::now() - last_draw_ >= interval_ || by_count_ || ended_)) Draw();
  return !(by_count_ || interrupted_ || ended_ || finished_);
}

void Watch::Take(const v1::StatsReport& r) {
  // The stream starts with the latest report, which JobStatus already dated.
  const bool known = received_ == 0 && age_at_start_ >= 0 && r.step() == st_.job().step();
  ++received_;
  if (!known) last_arrival_ = Clock::now();
  Absorb(r, &st_);
  if (r.layers_size() > 0) {
    with_layers_ = r;
    have_layers_ = true;
  }
  finished_ = finished_ || r.finished();
  dirty_ = true;
  if (g_.json) {
    Print(ToJson(r).dump() + "\n");
    FlushStdout();
  } else if (!tty_) {
    Print(ReportLine(r, st_));
    FlushStdout();
  }
  if (a_.count > 0 && received_ >= a_.count) by_count_ = true;
}

void Watch::Draw() {
  int64_t age = -1;
  if (last_arrival_) {
    age = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - *last_arrival_)
              .count();
  } else if (age_at_start_ >= 0) {
    age = age_at_start_ +
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - started_).count();
  }
  std::string screen = "\x1b[H\x1b[2J";
  screen += "cpdctl watch " + a_.job + " on " + c_->address() + "  " +
            FormatTime(cpd::launcher::NowMs()) + "  (Ctrl-C stops)\n\n";
  const std::string block =
      StatusBlock(st_, age) + std::to_string(received_) + " reports received by this watch\n";
  screen += block;
  if (a_.layers) screen += "\n" + LayersScreen(block);
  Print(screen);
  FlushStdout();
  last_draw_ = Clock::now();
  dirty_ = false;
}

// The layer table below the status `block`, cut to the terminal's height.
std::string Watch::LayersScreen(const std::string& block) const {
  if (!have_layers_) return "no layer statistics yet\n";
  v1::LayerStatsResponse one;
  *one.add_reports() = with_layers_;
  const auto rows = SelectRows(one, "", "", 0);
  std::string screen = ReportHeadline(a_.job, with_layers_);
  const Table t = LayerTable(rows, false);
  const long used = 3 + long(std::count(block.begin(), block.end(), '\n')) + 3;
  const long room = std::max(1L, long(TerminalRows()) - used - 1);
  screen += t.Render(room);
  if (long(t.rows()) > room) {
    screen += "... " + std::to_string(t.rows() - size_t(room)) + " more rows\n";
  }
  return screen;
}

}  // namespace

int RunWatch(const Globals& g, const WatchArgs& a) { return Watch(g, a).Run(); }

}  // namespace cpd::ctl
