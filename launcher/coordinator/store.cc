// The store's database: schema, jobs, schedules, the reader pool and report queries. The report
// queue, its writer thread and retention are in store_writer.cc.
#include "launcher/coordinator/store.h"

#include <fcntl.h>
#include <sqlite3.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <utility>

#include "launcher/coordinator/sqlite_util.h"

namespace cpd::coordinator {
namespace {

// 1: the first schema. 2: jobs.study (a study's runs), added to a version-1 file by Migrate().
constexpr int kSchemaVersion = 2;

constexpr const char* kSchema = R"sql(
CREATE TABLE IF NOT EXISTS jobs(
  job_id INTEGER PRIMARY KEY AUTOINCREMENT,
  name TEXT NOT NULL UNIQUE,
  registered_ms INTEGER NOT NULL,
  updated_ms INTEGER NOT NULL,
  world_size INTEGER NOT NULL,
  emulated_workers_per_rank INTEGER NOT NULL,
  arch TEXT NOT NULL,
  dataset TEXT NOT NULL,
  total_steps INTEGER NOT NULL,
  epochs INTEGER NOT NULL,
  start_step INTEGER NOT NULL,
  allreduce TEXT NOT NULL,
  study TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS workers(
  job_id INTEGER NOT NULL, rank INTEGER NOT NULL, host TEXT NOT NULL, pid INTEGER NOT NULL,
  PRIMARY KEY(job_id, rank)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS layers(
  job_id INTEGER NOT NULL, idx INTEGER NOT NULL, name TEXT NOT NULL, kind TEXT NOT NULL,
  quantizable INTEGER NOT NULL, params INTEGER NOT NULL,
  PRIMARY KEY(job_id, idx)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS schedules(
  job_id INTEGER NOT NULL, version INTEGER NOT NULL, set_at_ms INTEGER NOT NULL,
  set_by TEXT NOT NULL, schedule BLOB NOT NULL,
  PRIMARY KEY(job_id, version)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS reports(
  id INTEGER PRIMARY KEY,
  job_id INTEGER NOT NULL,
  step INTEGER NOT NULL,
  rank INTEGER NOT NULL,
  has_layers INTEGER NOT NULL,
  keep INTEGER NOT NULL,
  finished INTEGER NOT NULL,
  time_ms INTEGER NOT NULL,
  received_ms INTEGER NOT NULL,
  report BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS reports_job_step ON reports(job_id, step);
)sql";

// Whether `table` has `column` (a file written by an older schema may lack it).
Result<bool> HasColumn(sqlite3* db, const std::string& table, const std::string& column) {
  Stmt s;
  CPD_RETURN_IF_ERROR(s.Prepare(db, ("PRAGMA table_info(" + table + ")").c_str()));
  for (;;) {
    CPD_ASSIGN_OR_RETURN(const bool has_row, s.Step());
    if (!has_row) return false;
    if (s.ColText(1) == column) return true;
  }
}

// Brings a file of an older schema up to kSchemaVersion after kSchema ran (which creates what
// is missing but never alters an existing table). Runs inside Init's transaction.
Status Migrate(sqlite3* db) {
  CPD_ASSIGN_OR_RETURN(const bool has_study, HasColumn(db, "jobs", "study"));
  if (!has_study) {
    CPD_RETURN_IF_ERROR(Exec(db, "ALTER TABLE jobs ADD COLUMN study TEXT NOT NULL DEFAULT ''"));
  }
  return Status::Ok();
}

Status WriteWorkersAndLayers(sqlite3* db, int64_t job_id, const v1::RegisterJobRequest& info) {
  if (info.workers_size() > 0) {
    Stmt del;
    CPD_RETURN_IF_ERROR(del.Prepare(db, "DELETE FROM workers WHERE job_id = ?1"));
    del.Int(1, job_id);
    CPD_RETURN_IF_ERROR(del.Run());
    Stmt ins;
    CPD_RETURN_IF_ERROR(
        ins.Prepare(db, "INSERT INTO workers(job_id, rank, host, pid) VALUES(?1, ?2, ?3, ?4)"));
    for (const auto& w : info.workers()) {
      ins.Int(1, job_id);
      ins.Int(2, w.rank());
      ins.Text(3, w.host());
      ins.Int(4, w.pid());
      CPD_RETURN_IF_ERROR(ins.Run());
    }
  }
  if (info.layers_size() > 0) {
    Stmt del;
    CPD_RETURN_IF_ERROR(del.Prepare(db, "DELETE FROM layers WHERE job_id = ?1"));
    del.Int(1, job_id);
    CPD_RETURN_IF_ERROR(del.Run());
    Stmt ins;
    CPD_RETURN_IF_ERROR(ins.Prepare(db,
                                    "INSERT INTO layers(job_id, idx, name, kind, quantizable, "
                                    "params) VALUES(?1, ?2, ?3, ?4, ?5, ?6)"));
    for (int i = 0; i < info.layers_size(); ++i) {
      const auto& l = info.layers(i);
      ins.Int(1, job_id);
      ins.Int(2, i);
      ins.Text(3, l.name());
      ins.Text(4, l.kind());
      ins.Int(5, l.quantizable() ? 1 : 0);
      ins.Int(6, l.params());
      CPD_RETURN_IF_ERROR(ins.Run());
    }
  }
  return Status::Ok();
}

Status InsertSchedule(sqlite3* db, int64_t job_id, const v1::PrecisionSchedule& s) {
  Stmt ins;
  CPD_RETURN_IF_ERROR(ins.Prepare(db,
                                  "INSERT INTO schedules(job_id, version, set_at_ms, set_by, "
                                  "schedule) VALUES(?1, ?2, ?3, ?4, ?5)"));
  const std::string blob = s.SerializeAsString();
  ins.Int(1, job_id);
  ins.Int(2, int64_t(s.version()));
  ins.Int(3, s.set_at_ms());
  ins.Text(4, s.set_by());
  ins.Blob(5, blob);
  return ins.Run();
}

}  // namespace

Store::Store(StoreOptions options) : options_(std::move(options)) {}

Result<std::unique_ptr<Store>> Store::Open(const StoreOptions& options) {
  if (options.path.empty()) return Status::InvalidArgument("store: no database path given");
  std::unique_ptr<Store> store(new Store(options));
  CPD_RETURN_IF_ERROR(store->Init());
  store->writer_ = std::thread([s = store.get()] { s->WriterLoop(); });
  return store;
}

Status Store::Init() {
  // One coordinator per database: a second one would keep its own jobs and versions in memory.
  // flock() is independent of the POSIX locks SQLite takes on the same file; this descriptor is
  // closed only after SQLite's (closing any descriptor of a file drops the process's POSIX locks).
  lock_fd_ = open(options_.path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd_ < 0) {
    return Status::IoError("cannot open database '" + options_.path + "': " + std::strerror(errno) +
                           " (check that the directory exists and is writable)");
  }
  if (flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    return Status::Unavailable("database '" + options_.path +
                               "' is in use by another cpd-coordinator; stop it or use another "
                               "--db");
  }
  CPD_ASSIGN_OR_RETURN(writer_db_,
                       OpenConnection(options_.path, options_.busy_timeout_ms, /*create=*/true));
  // A report with 100 layer rows is ~6 KiB: 16 KiB pages keep it in its leaf page. Only takes
  // effect on a new file.
  CPD_RETURN_IF_ERROR(Exec(writer_db_, "PRAGMA page_size = 16384"));
  {
    Stmt s;
    Status st = s.Prepare(writer_db_, "PRAGMA journal_mode = WAL");
    if (!st.ok()) {
      return Status::IoError("'" + options_.path +
                             "' is not a usable SQLite database: " + st.message());
    }
    CPD_ASSIGN_OR_RETURN(const bool has_row, s.Step());
    if (!has_row || s.ColText(0) != "wal") {
      return Status::IoError("database '" + options_.path +
                             "': cannot switch to WAL mode (is it on a network file system?)");
    }
  }
  CPD_RETURN_IF_ERROR(Exec(writer_db_, "PRAGMA synchronous = NORMAL"));
  // The WAL is truncated back to this size after a checkpoint that let it grow beyond.
  CPD_RETURN_IF_ERROR(Exec(writer_db_, "PRAGMA journal_size_limit = 67108864"));
  {
    Stmt s;
    CPD_RETURN_IF_ERROR(s.Prepare(writer_db_, "PRAGMA user_version"));
    CPD_ASSIGN_OR_RETURN(const bool has_row, s.Step());
    const int64_t v = has_row ? s.ColInt(0) : 0;
    if (v > kSchemaVersion) {
      return Status::IoError("database '" + options_.path + "' has schema version " +
                             std::to_string(v) + ", newer than this cpd-coordinator's " +
                             std::to_string(kSchemaVersion));
    }
  }
  {
    Transaction t(writer_db_);
    CPD_RETURN_IF_ERROR(t.Begin());
    CPD_RETURN_IF_ERROR(Exec(writer_db_, kSchema));
    Status migrated = Migrate(writer_db_);
    if (!migrated.ok()) {
      return Status::IoError("database '" + options_.path + "': cannot upgrade it to schema " +
                             std::to_string(kSchemaVersion) + ": " + migrated.message());
    }
    CPD_RETURN_IF_ERROR(
        Exec(writer_db_, ("PRAGMA user_version = " + std::to_string(kSchemaVersion)).c_str()));
    CPD_RETURN_IF_ERROR(t.Commit());
  }
  {
    Stmt s;
    CPD_RETURN_IF_ERROR(
        s.Prepare(writer_db_, "SELECT job_id, COUNT(*) FROM reports GROUP BY job_id"));
    for (;;) {
      CPD_ASSIGN_OR_RETURN(const bool has_row, s.Step());
      if (!has_row) break;
      stored_per_job_[s.ColInt(0)] = uint64_t(s.ColInt(1));
    }
  }
  return Status::Ok();
}

Store::~Store() {
  {
    std::lock_guard<std::mutex> l(queue_mu_);
    stop_ = true;
  }
  queue_cv_.notify_all();
  if (writer_.joinable()) writer_.join();
  for (sqlite3* db : idle_readers_) sqlite3_close_v2(db);
  insert_report_.reset();
  if (writer_db_ != nullptr) {
    // A clean close checkpoints the WAL into the main file.
    sqlite3_close_v2(writer_db_);
  }
  // Releases the flock; nothing was written through this descriptor, so there is nothing to lose.
  if (lock_fd_ >= 0) close(lock_fd_);
}

// ---- Jobs and schedules ---------------------------------------------------------------------

Result<std::vector<JobRecord>> Store::LoadJobs() {
  std::lock_guard<std::mutex> l(write_mu_);
  Stmt s;
  CPD_RETURN_IF_ERROR(s.Prepare(writer_db_,
                                "SELECT job_id, name, registered_ms, updated_ms, world_size, "
                                "emulated_workers_per_rank, arch, dataset, total_steps, epochs, "
                                "start_step, allreduce, study FROM jobs ORDER BY job_id"));
  std::vector<JobRecord> jobs;
  for (;;) {
    CPD_ASSIGN_OR_RETURN(const bool has_row, s.Step());
    if (!has_row) break;
    JobRecord j;
    j.job_id = s.ColInt(0);
    j.info.set_job_name(s.ColText(1));
    j.registered_ms = s.ColInt(2);
    j.updated_ms = s.ColInt(3);
    j.info.set_world_size(int32_t(s.ColInt(4)));
    j.info.set_emulated_workers_per_rank(int32_t(s.ColInt(5)));
    j.info.set_arch(s.ColText(6));
    j.info.set_dataset(s.ColText(7));
    j.info.set_total_steps(s.ColInt(8));
    j.info.set_epochs(int32_t(s.ColInt(9)));
    j.info.set_start_step(s.ColInt(10));
    j.info.set_allreduce(s.ColText(11));
    j.info.set_study(s.ColText(12));
    jobs.push_back(std::move(j));
  }
  return jobs;
}

Result<int64_t> Store::CreateJob(const v1::RegisterJobRequest& info, int64_t now_ms,
                                 const v1::PrecisionSchedule& schedule) {
  std::lock_guard<std::mutex> l(write_mu_);
  Transaction t(writer_db_);
  CPD_RETURN_IF_ERROR(t.Begin());
  Stmt ins;
  CPD_RETURN_IF_ERROR(ins.Prepare(writer_db_,
                                  "INSERT INTO jobs(name, registered_ms, updated_ms, world_size, "
                                  "emulated_workers_per_rank, arch, dataset, total_steps, epochs, "
                                  "start_step, allreduce, study) "
                                  "VALUES(?1, ?2, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)"));
  ins.Text(1, info.job_name());
  ins.Int(2, now_ms);
  ins.Int(3, info.world_size());
  ins.Int(4, info.emulated_workers_per_rank());
  ins.Text(5, info.arch());
  ins.Text(6, info.dataset());
  ins.Int(7, info.total_steps());
  ins.Int(8, info.epochs());
  ins.Int(9, info.start_step());
  ins.Text(10, info.allreduce());
  ins.Text(11, info.study());
  CPD_RETURN_IF_ERROR(ins.Run());
  const int64_t id = sqlite3_last_insert_rowid(writer_db_);
  CPD_RETURN_IF_ERROR(WriteWorkersAndLayers(writer_db_, id, info));
  CPD_RETURN_IF_ERROR(InsertSchedule(writer_db_, id, schedule));
  CPD_RETURN_IF_ERROR(t.Commit());
  return id;
}

Status Store::UpdateJob(int64_t job_id, const v1::RegisterJobRequest& info, int64_t now_ms) {
  std::lock_guard<std::mutex> l(write_mu_);
  Transaction t(writer_db_);
  CPD_RETURN_IF_ERROR(t.Begin());
  Stmt up;
  CPD_RETURN_IF_ERROR(up.Prepare(writer_db_,
                                 "UPDATE jobs SET updated_ms = ?2, world_size = ?3, "
                                 "emulated_workers_per_rank = ?4, arch = ?5, dataset = ?6, "
                                 "total_steps = ?7, epochs = ?8, start_step = ?9, allreduce = ?10, "
                                 "study = ?11 WHERE job_id = ?1"));
  up.Int(1, job_id);
  up.Int(2, now_ms);
  up.Int(3, info.world_size());
  up.Int(4, info.emulated_workers_per_rank());
  up.Text(5, info.arch());
  up.Text(6, info.dataset());
  up.Int(7, info.total_steps());
  up.Int(8, info.epochs());
  up.Int(9, info.start_step());
  up.Text(10, info.allreduce());
  up.Text(11, info.study());
  CPD_RETURN_IF_ERROR(up.Run());
  CPD_RETURN_IF_ERROR(WriteWorkersAndLayers(writer_db_, job_id, info));
  return t.Commit();
}

Status Store::AppendSchedule(int64_t job_id, const v1::PrecisionSchedule& schedule) {
  std::lock_guard<std::mutex> l(write_mu_);
  return InsertSchedule(writer_db_, job_id, schedule);
}

Result<sqlite3*> Store::AcquireReader() {
  {
    std::lock_guard<std::mutex> l(readers_mu_);
    if (!idle_readers_.empty()) {
      sqlite3* db = idle_readers_.back();
      idle_readers_.pop_back();
      return db;
    }
  }
  CPD_ASSIGN_OR_RETURN(sqlite3 * db,
                       OpenConnection(options_.path, options_.busy_timeout_ms, /*create=*/false));
  Status s = Exec(db, "PRAGMA query_only = 1");
  if (!s.ok()) {
    sqlite3_close(db);
    return s;
  }
  return db;
}

void Store::ReleaseReader(sqlite3* db) {
  std::lock_guard<std::mutex> l(readers_mu_);
  if (idle_readers_.size() < 8) {
    idle_readers_.push_back(db);
  } else {
    sqlite3_close(db);
  }
}

namespace {
// Returns a pooled reader connection on scope exit.
template <typename Release>
struct ReaderGuard {
  sqlite3* db;
  Release release;
  ~ReaderGuard() { release(db); }
};
}  // namespace

#define CPD_WITH_READER(var)                                 \
  CPD_ASSIGN_OR_RETURN(sqlite3* var, AcquireReader());       \
  auto var##_rel = [this](sqlite3* d) { ReleaseReader(d); }; \
  ReaderGuard<decltype(var##_rel)> var##_guard { var, var##_rel }

Status Store::LoadWorkersAndLayers(int64_t job_id, v1::JobStatusResponse* out) {
  CPD_WITH_READER(db);
  Stmt w;
  CPD_RETURN_IF_ERROR(
      w.Prepare(db, "SELECT rank, host, pid FROM workers WHERE job_id = ?1 ORDER BY rank"));
  w.Int(1, job_id);
  for (;;) {
    CPD_ASSIGN_OR_RETURN(const bool has_row, w.Step());
    if (!has_row) break;
    auto* wi = out->add_workers();
    wi->set_rank(int32_t(w.ColInt(0)));
    wi->set_host(w.ColText(1));
    wi->set_pid(w.ColInt(2));
  }
  Stmt l;
  CPD_RETURN_IF_ERROR(l.Prepare(db,
                                "SELECT name, kind, quantizable, params FROM layers "
                                "WHERE job_id = ?1 ORDER BY idx"));
  l.Int(1, job_id);
  for (;;) {
    CPD_ASSIGN_OR_RETURN(const bool has_row, l.Step());
    if (!has_row) break;
    auto* li = out->add_layers();
    li->set_name(l.ColText(0));
    li->set_kind(l.ColText(1));
    li->set_quantizable(l.ColInt(2) != 0);
    li->set_params(l.ColInt(3));
  }
  return Status::Ok();
}

Result<std::vector<v1::PrecisionSchedule>> Store::Schedules(int64_t job_id) {
  CPD_WITH_READER(db);
  Stmt s;
  CPD_RETURN_IF_ERROR(
      s.Prepare(db, "SELECT schedule FROM schedules WHERE job_id = ?1 ORDER BY version"));
  s.Int(1, job_id);
  std::vector<v1::PrecisionSchedule> out;
  for (;;) {
    CPD_ASSIGN_OR_RETURN(const bool has_row, s.Step());
    if (!has_row) break;
    const std::string_view b = s.ColBlob(0);
    out.emplace_back();
    if (!out.back().ParseFromArray(b.data(), int(b.size()))) {
      return Status::Corruption("database: schedule of job " + std::to_string(job_id) +
                                " does not parse");
    }
  }
  return out;
}

Result<std::optional<v1::PrecisionSchedule>> Store::CurrentSchedule(int64_t job_id) {
  CPD_WITH_READER(db);
  Stmt s;
  CPD_RETURN_IF_ERROR(s.Prepare(
      db, "SELECT schedule FROM schedules WHERE job_id = ?1 ORDER BY version DESC LIMIT 1"));
  s.Int(1, job_id);
  CPD_ASSIGN_OR_RETURN(const bool has_row, s.Step());
  if (!has_row) return std::optional<v1::PrecisionSchedule>();
  const std::string_view b = s.ColBlob(0);
  v1::PrecisionSchedule out;
  if (!out.ParseFromArray(b.data(), int(b.size()))) {
    return Status::Corruption("database: schedule of job " + std::to_string(job_id) +
                              " does not parse");
  }
  return std::optional<v1::PrecisionSchedule>(std::move(out));
}

// ---- Reports ---------------------------------------------------------------------------------

Status Store::QueryReports(const ReportQuery& q,
                           const std::function<bool(const StoredReport&)>& visit) {
  CPD_WITH_READER(db);
  std::string sql =
      "SELECT id, step, rank, has_layers, finished, received_ms, report FROM reports "
      "WHERE job_id = ?1 AND step >= ?2 AND step <= ?3";
  if (q.only_with_layers) sql += " AND has_layers = 1";
  if (q.only_keep) sql += " AND keep = 1";
  if (q.after_step >= 0) sql += " AND (step > ?4 OR (step = ?4 AND id > ?5))";
  sql += q.descending ? " ORDER BY step DESC, id DESC" : " ORDER BY step, id";
  sql += " LIMIT ?6";
  Stmt s;
  CPD_RETURN_IF_ERROR(s.Prepare(db, sql.c_str()));
  s.Int(1, q.job_id);
  s.Int(2, q.from_step);
  s.Int(3, q.to_step);
  if (q.after_step >= 0) {
    s.Int(4, q.after_step);
    s.Int(5, q.after_id);
  }
  s.Int(6, q.limit > size_t(INT64_MAX) ? INT64_MAX : int64_t(q.limit));
  for (;;) {
    CPD_ASSIGN_OR_RETURN(const bool has_row, s.Step());
    if (!has_row) break;
    StoredReport r;
    r.id = s.ColInt(0);
    r.step = s.ColInt(1);
    r.rank = int32_t(s.ColInt(2));
    r.has_layers = s.ColInt(3) != 0;
    r.finished = s.ColInt(4) != 0;
    r.received_ms = s.ColInt(5);
    r.blob = s.ColBlob(6);
    if (!visit(r)) break;
  }
  return Status::Ok();
}

uint64_t Store::ReportsStored(int64_t job_id) const {
  std::lock_guard<std::mutex> l(counts_mu_);
  auto it = stored_per_job_.find(job_id);
  return it == stored_per_job_.end() ? 0 : it->second;
}

StoreStats Store::stats() const {
  std::lock_guard<std::mutex> l(queue_mu_);
  return stats_;
}

}  // namespace cpd::coordinator
