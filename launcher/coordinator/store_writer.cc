// The store's report queue, the writer thread that drains it in batched transactions, and
// retention (thinning and capping each job's reports in bounded steps).
#include <sqlite3.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <thread>
#include <utility>

#include "launcher/coordinator/sqlite_util.h"
#include "launcher/coordinator/store.h"

namespace cpd::coordinator {
namespace {

constexpr const char* kInsertReport =
    "INSERT INTO reports(job_id, step, rank, has_layers, keep, finished, time_ms, received_ms, "
    "report) VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)";

size_t RowBytes(const ReportRow& r) { return sizeof(ReportRow) + (r.blob ? r.blob->size() : 0); }

}  // namespace

bool Store::Enqueue(ReportRow row) {
  const size_t bytes = RowBytes(row);
  bool wake = false;
  {
    std::lock_guard<std::mutex> l(queue_mu_);
    if (stop_ || queue_.size() >= options_.queue_max_reports ||
        queue_bytes_ + bytes > options_.queue_max_bytes) {
      return false;
    }
    queue_.push_back(std::move(row));
    queue_bytes_ += bytes;
    ++enqueued_seq_;
    stats_.queued = queue_.size();
    // The writer waits for "not empty", then lingers for a batch: wake it only at those two
    // edges (one futex wake per report cost ~10% of the coordinator's CPU under load).
    wake = queue_.size() == 1 || queue_.size() == options_.max_batch;
  }
  if (wake) queue_cv_.notify_one();
  return true;
}

void Store::Flush() {
  std::unique_lock<std::mutex> l(queue_mu_);
  const uint64_t target = enqueued_seq_;
  ++flush_waiters_;
  queue_cv_.notify_all();
  flushed_cv_.wait(l, [&] { return done_seq_ >= target; });
  --flush_waiters_;
}

Status Store::WriteBatch(const std::vector<ReportRow>& batch) {
  Transaction t(writer_db_);
  CPD_RETURN_IF_ERROR(t.Begin());
  if (insert_report_ == nullptr) {
    insert_report_ = std::make_unique<Stmt>();
    Status s = insert_report_->Prepare(writer_db_, kInsertReport);
    if (!s.ok()) {
      insert_report_.reset();
      return s;
    }
  }
  Stmt& ins = *insert_report_;
  for (const ReportRow& r : batch) {
    ins.Int(1, r.job_id);
    ins.Int(2, r.step);
    ins.Int(3, r.rank);
    ins.Int(4, r.has_layers ? 1 : 0);
    ins.Int(5, r.keep ? 1 : 0);
    ins.Int(6, r.finished ? 1 : 0);
    ins.Int(7, r.time_ms);
    ins.Int(8, r.received_ms);
    ins.Blob(9, r.blob ? std::string_view(*r.blob) : std::string_view());
    Status s = ins.Run();
    if (!s.ok()) {
      sqlite3_reset(ins.get());
      return s;
    }
  }
  return t.Commit();
}

void Store::WriterLoop() {
  using Clock = std::chrono::steady_clock;
  const auto interval = std::chrono::milliseconds(options_.retention.interval_ms);
  auto next_retention = Clock::now() + interval;
  std::deque<int64_t> retention_todo;  // jobs with retention work left in this pass
  std::vector<ReportRow> batch;
  for (;;) {
    size_t batch_bytes = 0;
    bool stopping = false;
    {
      std::unique_lock<std::mutex> l(queue_mu_);
      auto ready = [&] { return stop_ || !queue_.empty(); };
      if (!retention_todo.empty()) {
        // Retention work is pending: do not sleep.
      } else if (options_.retention.interval_ms > 0) {
        queue_cv_.wait_until(l, next_retention, ready);
      } else {
        queue_cv_.wait(l, ready);
      }
      // A few milliseconds' lingering turns a trickle of reports into one transaction.
      if (!queue_.empty() && queue_.size() < options_.max_batch / 4 && !stop_ &&
          flush_waiters_ == 0 && retention_todo.empty()) {
        queue_cv_.wait_for(l, std::chrono::milliseconds(5), [&] {
          return stop_ || flush_waiters_ > 0 || queue_.size() >= options_.max_batch;
        });
      }
      stopping = stop_;
      if (queue_.empty() && stop_) break;
      while (!queue_.empty() && batch.size() < options_.max_batch) {
        batch_bytes += RowBytes(queue_.front());
        batch.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
      stats_.queued = queue_.size();
    }
    if (!batch.empty()) {
      Status s;
      for (int attempt = 0;; ++attempt) {
        {
          std::lock_guard<std::mutex> l(write_mu_);
          s = WriteBatch(batch);
        }
        if (s.ok()) break;
        {
          std::lock_guard<std::mutex> l(queue_mu_);
          ++stats_.write_errors;
          stopping = stop_;
        }
        options_.log("storing " + std::to_string(batch.size()) + " reports failed (attempt " +
                     std::to_string(attempt + 1) + "): " + s.message());
        if (stopping && attempt >= 2) break;
        std::this_thread::sleep_for(std::chrono::seconds(1));
      }
      if (s.ok()) {
        std::lock_guard<std::mutex> l(counts_mu_);
        for (const ReportRow& r : batch) ++stored_per_job_[r.job_id];
      }
      {
        std::lock_guard<std::mutex> l(queue_mu_);
        queue_bytes_ -= batch_bytes;
        done_seq_ += batch.size();
        if (s.ok()) {
          stats_.stored += batch.size();
        } else {
          stats_.lost += batch.size();
          options_.log("gave up on " + std::to_string(batch.size()) + " reports at shutdown");
        }
      }
      flushed_cv_.notify_all();
      batch.clear();
    }
    // Retention, one bounded step of one job per round, between batches of inserts.
    if (options_.retention.interval_ms > 0 && retention_todo.empty() &&
        Clock::now() >= next_retention) {
      std::lock_guard<std::mutex> l(counts_mu_);
      for (const auto& [job, count] : stored_per_job_) retention_todo.push_back(job);
      next_retention = Clock::now() + interval;
    }
    if (!retention_todo.empty()) {
      const int64_t job = retention_todo.front();
      retention_todo.pop_front();
      std::lock_guard<std::mutex> l(write_mu_);
      auto more = RetainJobLocked(job);
      if (!more.ok()) {
        options_.log("retention of job " + std::to_string(job) + ": " + more.status().message());
      } else if (*more) {
        retention_todo.push_back(job);
      }
    }
  }
}

Status Store::ApplyRetention() {
  std::vector<std::pair<int64_t, uint64_t>> jobs;
  {
    std::lock_guard<std::mutex> l(counts_mu_);
    jobs.assign(stored_per_job_.begin(), stored_per_job_.end());
  }
  std::lock_guard<std::mutex> l(write_mu_);
  for (const auto& [job, count] : jobs) {
    for (bool more = true; more;) {
      CPD_ASSIGN_OR_RETURN(more, RetainJobLocked(job));
    }
  }
  return Status::Ok();
}

// One bounded step of retention for one job: at most kRetentionRows rows deleted, in one
// transaction, so the writer thread returns to inserting within milliseconds even when a long
// job's first pass (e.g. after a restart with a lower --keep-full) has a million rows to drop.
Result<bool> Store::RetainJobLocked(int64_t job) {
  constexpr int64_t kRetentionRows = 4096;
  const RetentionOptions& r = options_.retention;
  uint64_t count = ReportsStored(job);
  uint64_t removed = 0;
  bool more = false;
  Transaction t(writer_db_);
  CPD_RETURN_IF_ERROR(t.Begin());
  if (r.thin_every > 1 && r.keep_full > 0 && count > uint64_t(r.keep_full)) {
    // Thin [below, cutoff): cutoff is the step of the keep_full-th newest report.
    Stmt nth;
    CPD_RETURN_IF_ERROR(nth.Prepare(writer_db_,
                                    "SELECT step FROM reports WHERE job_id = ?1 "
                                    "ORDER BY step DESC, id DESC LIMIT 1 OFFSET ?2"));
    nth.Int(1, job);
    nth.Int(2, r.keep_full - 1);
    CPD_ASSIGN_OR_RETURN(const bool has_row, nth.Step());
    int64_t& below = thinned_below_[job];
    if (has_row && nth.ColInt(0) > below) {
      const int64_t cutoff = nth.ColInt(0);
      // This transaction's share: up to the step kRetentionRows rows further on.
      Stmt ahead;
      CPD_RETURN_IF_ERROR(ahead.Prepare(writer_db_,
                                        "SELECT step FROM reports WHERE job_id = ?1 AND "
                                        "step >= ?2 ORDER BY step, id LIMIT 1 OFFSET ?3"));
      ahead.Int(1, job);
      ahead.Int(2, below);
      ahead.Int(3, kRetentionRows);
      CPD_ASSIGN_OR_RETURN(const bool ahead_found, ahead.Step());
      int64_t end = cutoff;
      if (ahead_found) end = std::min(cutoff, std::max(ahead.ColInt(0), below + 1));
      Stmt thin;
      CPD_RETURN_IF_ERROR(thin.Prepare(writer_db_,
                                       "DELETE FROM reports WHERE job_id = ?1 AND step >= ?2 "
                                       "AND step < ?3 AND keep = 0 AND step % ?4 != 0"));
      thin.Int(1, job);
      thin.Int(2, below);
      thin.Int(3, end);
      thin.Int(4, r.thin_every);
      CPD_RETURN_IF_ERROR(thin.Run());
      removed += uint64_t(sqlite3_changes(writer_db_));
      below = end;
      more = end < cutoff;
    }
  }
  if (!more && r.max_reports_per_job > 0 && count - removed > uint64_t(r.max_reports_per_job)) {
    // The oldest rows beyond the cap, at most kRetentionRows of them.
    const uint64_t excess = count - removed - uint64_t(r.max_reports_per_job);
    const int64_t k = int64_t(std::min<uint64_t>(excess, kRetentionRows));
    Stmt kth;
    CPD_RETURN_IF_ERROR(kth.Prepare(writer_db_,
                                    "SELECT step, id FROM reports WHERE job_id = ?1 "
                                    "ORDER BY step, id LIMIT 1 OFFSET ?2"));
    kth.Int(1, job);
    kth.Int(2, k - 1);
    CPD_ASSIGN_OR_RETURN(const bool has_row, kth.Step());
    if (has_row) {
      Stmt cap;
      CPD_RETURN_IF_ERROR(cap.Prepare(writer_db_,
                                      "DELETE FROM reports WHERE job_id = ?1 AND "
                                      "(step < ?2 OR (step = ?2 AND id <= ?3))"));
      cap.Int(1, job);
      cap.Int(2, kth.ColInt(0));
      cap.Int(3, kth.ColInt(1));
      CPD_RETURN_IF_ERROR(cap.Run());
      removed += uint64_t(sqlite3_changes(writer_db_));
      more = excess > uint64_t(k);
    }
  }
  CPD_RETURN_IF_ERROR(t.Commit());
  if (removed > 0) {
    {
      std::lock_guard<std::mutex> l(counts_mu_);
      stored_per_job_[job] -= removed;
    }
    std::lock_guard<std::mutex> l(queue_mu_);
    stats_.thinned += removed;
  }
  return more;
}

}  // namespace cpd::coordinator
