// The coordinator's persistent store: one SQLite file (WAL, synchronous=NORMAL) holding jobs,
// their workers and layers, every schedule version, and the statistics reports.
//
// A report is ONE row (job_id, step, rank, flags, times, the serialized cpd.v1.StatsReport):
// 512 workers x 10 Hz x 100 layers would be 512k rows/s as row-per-layer. Reports reach the
// database through a bounded in-memory queue drained by a single writer thread in batched
// transactions; Enqueue refuses (returns false) when the queue is full, so memory stays bounded
// and the caller can shed load. A report Enqueue accepted is stored: Flush() and the destructor
// wait for the queue to drain. The writer thread also applies the retention policy.
//
// Thread-safety: every method may be called from any thread. Job and schedule writes go through
// one write connection (serialised with the writer thread's batches); reads take a connection
// from a small pool, and in WAL mode they do not wait for the writer.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cpd/status.h"
#include "proto/cpd/v1/coordinator.pb.h"

struct sqlite3;
struct sqlite3_stmt;

namespace cpd::coordinator {

namespace internal {
class Stmt;  // a prepared statement (store.cc)
}

// How a long job is kept from filling the disk. Applied per job by the writer thread every
// `interval_ms`, and by Store::ApplyRetention().
struct RetentionOptions {
  // The newest `keep_full` reports of a job stay at full resolution (0: all of them).
  int64_t keep_full = 10000;
  // Reports older than those are thinned to the ones whose step is a multiple of `thin_every`;
  // end-of-epoch reports (an accuracy measured) and final reports are always kept. <= 1: none
  // are thinned.
  int64_t thin_every = 10;
  // Hard cap on a job's reports: the oldest beyond it are deleted, whatever they are (0: none).
  int64_t max_reports_per_job = 100000;
  int64_t interval_ms = 30000;
};

struct StoreOptions {
  std::string path;  // REQUIRED: the SQLite file (created if missing)
  // The report queue holds at most this many bytes of serialized reports and this many reports.
  size_t queue_max_bytes = size_t(64) << 20;
  size_t queue_max_reports = 65536;
  size_t max_batch = 4096;  // reports per transaction
  RetentionOptions retention;
  int busy_timeout_ms = 10000;
  // Where the writer thread reports failed writes (default: stderr).
  std::function<void(const std::string&)> log = [](const std::string& msg) {
    std::fprintf(stderr, "cpd-coordinator: %s\n", msg.c_str());
  };
};

// A report on its way to the database. `blob` is the serialized cpd.v1.StatsReport; it is shared
// with the coordinator's "latest report" so that the hot path copies it once.
struct ReportRow {
  int64_t job_id = 0;
  int64_t step = 0;
  int32_t rank = 0;
  bool has_layers = false;
  bool keep = false;  // end of epoch or finished: exempt from thinning
  bool finished = false;
  int64_t time_ms = 0;      // the worker's clock
  int64_t received_ms = 0;  // the coordinator's clock
  std::shared_ptr<const std::string> blob;
};

// A stored report as read back.
struct StoredReport {
  int64_t id = 0;  // insertion order
  int64_t step = 0;
  int32_t rank = 0;
  bool has_layers = false;
  bool finished = false;
  int64_t received_ms = 0;
  std::string_view blob;  // valid during the visit only
};

// A job as stored: its registration (without workers, layers and schedule, which have their own
// tables) and bookkeeping.
struct JobRecord {
  int64_t job_id = 0;
  int64_t registered_ms = 0;  // first registration
  int64_t updated_ms = 0;     // latest (re-)registration
  v1::RegisterJobRequest info;
};

struct ReportQuery {
  int64_t job_id = 0;
  int64_t from_step = 0;
  int64_t to_step = INT64_MAX;  // inclusive
  bool only_with_layers = false;
  bool only_keep = false;   // end-of-epoch / finished reports only
  bool descending = false;  // (step, id) newest first
  // Cursor for paging in (step, id) order: rows after (after_step, after_id).
  int64_t after_step = -1;
  int64_t after_id = 0;
  size_t limit = SIZE_MAX;
};

struct StoreStats {
  uint64_t queued = 0;        // reports waiting for the writer
  uint64_t stored = 0;        // reports committed since Open
  uint64_t thinned = 0;       // reports removed by retention since Open
  uint64_t write_errors = 0;  // failed batch attempts (each retried)
  uint64_t lost = 0;          // reports given up on at shutdown after repeated failures
};

class Store {
 public:
  // Opens (creating if needed) the database and starts the writer thread.
  static Result<std::unique_ptr<Store>> Open(const StoreOptions& options);
  // Drains the queue (every accepted report is stored), stops the writer, closes the database.
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // ---- Jobs and schedules (synchronous) ----
  Result<std::vector<JobRecord>> LoadJobs();
  // Creates a job with `schedule` as version 1. Returns the new job_id.
  Result<int64_t> CreateJob(const v1::RegisterJobRequest& info, int64_t now_ms,
                            const v1::PrecisionSchedule& schedule);
  // A re-registration: metadata (the study included: the caller decides which one holds)
  // replaced; workers/layers replaced when `info` lists any.
  Status UpdateJob(int64_t job_id, const v1::RegisterJobRequest& info, int64_t now_ms);
  Status LoadWorkersAndLayers(int64_t job_id, v1::JobStatusResponse* out);
  Status AppendSchedule(int64_t job_id, const v1::PrecisionSchedule& schedule);
  // Every version, oldest first.
  Result<std::vector<v1::PrecisionSchedule>> Schedules(int64_t job_id);
  Result<std::optional<v1::PrecisionSchedule>> CurrentSchedule(int64_t job_id);

  // ---- Reports ----
  // Queues a report for the writer; false when the queue is full (nothing is queued).
  bool Enqueue(ReportRow row);
  // Blocks until every report queued before the call is committed (or given up on).
  void Flush();
  // Visits stored reports matching `q`; `visit` returns false to stop early.
  Status QueryReports(const ReportQuery& q, const std::function<bool(const StoredReport&)>& visit);
  // Rows in the database for the job (committed, after retention).
  uint64_t ReportsStored(int64_t job_id) const;
  // Applies the retention policy to every job now (the writer does it every interval_ms).
  Status ApplyRetention();
  StoreStats stats() const;
  const StoreOptions& options() const { return options_; }

 private:
  explicit Store(StoreOptions options);
  Status Init();
  void WriterLoop();
  Status WriteBatch(const std::vector<ReportRow>& batch);
  // One bounded retention step for `job` (write_mu_ held); true when it has more to do.
  Result<bool> RetainJobLocked(int64_t job);
  Result<sqlite3*> AcquireReader();
  void ReleaseReader(sqlite3* db);

  const StoreOptions options_;
  int lock_fd_ = -1;  // flock()ed for the Store's life
  sqlite3* writer_db_ = nullptr;
  std::unique_ptr<internal::Stmt> insert_report_;  // the writer's cached INSERT
  std::mutex write_mu_;                            // guards writer_db_ and thinned_below_
  std::unordered_map<int64_t, int64_t> thinned_below_;

  std::mutex readers_mu_;
  std::vector<sqlite3*> idle_readers_;

  mutable std::mutex counts_mu_;
  std::unordered_map<int64_t, uint64_t> stored_per_job_;

  mutable std::mutex queue_mu_;
  std::condition_variable queue_cv_;    // the writer waits for work
  std::condition_variable flushed_cv_;  // Flush() waits for progress
  std::deque<ReportRow> queue_;
  size_t queue_bytes_ = 0;
  uint64_t enqueued_seq_ = 0;  // reports ever queued
  uint64_t done_seq_ = 0;      // reports committed or given up on
  bool stop_ = false;
  int flush_waiters_ = 0;
  StoreStats stats_;
  std::thread writer_;
};

}  // namespace cpd::coordinator
