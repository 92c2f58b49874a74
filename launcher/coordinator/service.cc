#include "launcher/coordinator/service.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <optional>
#include <utility>

namespace cpd::coordinator {

namespace {

using grpc::StatusCode;

grpc::Status ToGrpc(const Status& s) {
  switch (s.code()) {
    case Status::Code::kOk:
      return grpc::Status::OK;
    case Status::Code::kInvalidArgument:
    case Status::Code::kOutOfRange:
      return grpc::Status(StatusCode::INVALID_ARGUMENT, s.message());
    case Status::Code::kNotFound:
      return grpc::Status(StatusCode::NOT_FOUND, s.message());
    case Status::Code::kUnavailable:
      return grpc::Status(StatusCode::UNAVAILABLE, s.message());
    case Status::Code::kCorruption:
      return grpc::Status(StatusCode::DATA_LOSS, s.message());
    default:
      return grpc::Status(StatusCode::INTERNAL, s.message());
  }
}

grpc::Status Invalid(std::string msg) {
  return grpc::Status(StatusCode::INVALID_ARGUMENT, std::move(msg));
}

const grpc::Status kShuttingDown(StatusCode::UNAVAILABLE,
                                 "cpd-coordinator is shutting down; reconnect when it is back");

// Compares without an early exit, so the time taken does not reveal a matching prefix.
bool ConstantTimeEqual(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

// The registration as kept in memory: no workers, layers or schedule (those live in the store).
v1::RegisterJobRequest Meta(const v1::RegisterJobRequest& r) {
  v1::RegisterJobRequest m = r;
  m.clear_workers();
  m.clear_layers();
  m.clear_schedule();
  if (m.emulated_workers_per_rank() == 0) m.set_emulated_workers_per_rank(1);
  return m;
}

std::string JobLabel(int64_t id, const std::string& name) {
  return "job " + std::to_string(id) + " ('" + name + "')";
}

}  // namespace

// ---- In-memory job
// -------------------------------------------------------------------------------

enum StreamKind { kScheduleWatch = 0, kJobWatch = 1, kHistory = 2 };

class ScheduleStream;
class JobStream;

struct Coordinator::Job {
  int64_t id = 0;
  int64_t registered_ms = 0;
  int64_t updated_ms = 0;
  v1::RegisterJobRequest info;  // Meta(): no workers, layers, schedule
  std::shared_ptr<const v1::PrecisionSchedule> schedule;
  std::shared_ptr<const std::string> latest;  // serialized StatsReport with the highest step
  int64_t latest_step = -1;
  int64_t last_report_ms = 0;  // coordinator clock; 0: none
  bool finished = false;
  double train_accuracy = -1, test_accuracy = -1;
  std::vector<ScheduleStream*> schedule_watchers;
  std::vector<JobStream*> job_watchers;
};

// ---- Streams
// -------------------------------------------------------------------------------------

// Common to every server stream: it can be closed by the coordinator and unregisters itself
// when gRPC is done with it.
class StreamBase {
 public:
  explicit StreamBase(Coordinator* c) : coord_(c) {}
  virtual ~StreamBase() = default;
  // Ends the stream with `s` (after the write in flight, if any). Thread-safe; idempotent.
  virtual void Close(const grpc::Status& s) = 0;
  int64_t job_id = 0;
  int kind = kHistory;

 protected:
  void Detach() { coord_->Unregister(this); }
  Coordinator* const coord_;
};

// A server-streaming reactor with at most one write in flight. Subclasses say what to write next
// (under mu_); Close/cancel finish the stream once the write in flight completes.
template <typename Msg>
class WriterStream : public grpc::ServerWriteReactor<Msg>, public StreamBase {
 public:
  explicit WriterStream(Coordinator* c) : StreamBase(c) {}

  void Close(const grpc::Status& s) override {
    std::lock_guard<std::mutex> l(mu_);
    CloseLocked(s);
  }
  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> l(mu_);
    writing_ = false;
    if (!ok) {
      // The client went away (or the server is cancelling the call).
      if (!finished_) FinishLocked(pending_.value_or(grpc::Status(StatusCode::CANCELLED, "")));
      return;
    }
    PumpLocked();
  }
  void OnCancel() override { Close(grpc::Status(StatusCode::CANCELLED, "cancelled")); }
  void OnDone() override {
    Detach();
    delete this;
  }

 protected:
  enum class Next { kWrite, kIdle, kDone };
  // Under mu_: the next message to write in *out (kWrite; the subclass keeps it alive until its
  // next NextLocked call), or none yet (kIdle), or the stream is complete (kDone: finish with
  // done_).
  virtual Next NextLocked(const Msg** out) = 0;

  void CloseLocked(const grpc::Status& s) {
    if (finished_ || pending_) return;
    if (writing_) {
      pending_ = s;
    } else {
      FinishLocked(s);
    }
  }
  void PumpLocked() {
    if (writing_ || finished_) return;
    if (pending_) {
      FinishLocked(*pending_);
      return;
    }
    const Msg* next = nullptr;
    switch (NextLocked(&next)) {
      case Next::kWrite:
        writing_ = true;
        this->StartWrite(next);
        break;
      case Next::kIdle:
        break;
      case Next::kDone:
        FinishLocked(done_);
        break;
    }
  }
  void FinishLocked(const grpc::Status& s) {
    finished_ = true;
    this->Finish(s);
  }
  bool closed_locked() const { return finished_ || pending_.has_value(); }

  std::mutex mu_;
  grpc::Status done_;

 private:
  bool writing_ = false;
  bool finished_ = false;
  std::optional<grpc::Status> pending_;
};

// WatchSchedule: the current schedule, then each new one. Only the newest unsent schedule is
// kept: a worker needs the schedule in force, not the versions it missed.
class ScheduleStream final : public WriterStream<v1::PrecisionSchedule> {
 public:
  explicit ScheduleStream(Coordinator* c) : WriterStream(c) {}
  // The first offer: `current` unless the worker has it already (after_version >= its version).
  // A worker that claims a version the job never had (the coordinator's database was replaced)
  // gets the current one too.
  void Start(std::shared_ptr<const v1::PrecisionSchedule> current, uint64_t after_version) {
    {
      std::lock_guard<std::mutex> l(mu_);
      sent_version_ = after_version > current->version() ? 0 : after_version;
    }
    Offer(std::move(current));
  }
  void Offer(std::shared_ptr<const v1::PrecisionSchedule> s) {
    std::lock_guard<std::mutex> l(mu_);
    if (closed_locked() || s->version() <= sent_version_) return;
    sent_version_ = s->version();
    next_ = std::move(s);
    PumpLocked();
  }

 private:
  Next NextLocked(const v1::PrecisionSchedule** out) override {
    if (!next_) return Next::kIdle;
    writing_ = std::move(next_);
    *out = writing_.get();
    return Next::kWrite;
  }
  uint64_t sent_version_ = 0;
  std::shared_ptr<const v1::PrecisionSchedule> next_;     // newest not yet written
  std::shared_ptr<const v1::PrecisionSchedule> writing_;  // the write in flight
};

// WatchJob: reports as they arrive; a bounded buffer that drops the oldest for a slow reader.
// Ends (OK) after the job's final report. The messages are shared by every stream of the job
// (built once per report, with or without layer rows, by ReportStats).
class JobStream final : public WriterStream<v1::StatsReport> {
 public:
  JobStream(Coordinator* c, bool with_layers, size_t capacity)
      : WriterStream(c), with_layers_(with_layers), capacity_(std::max<size_t>(capacity, 1)) {}
  bool with_layers() const { return with_layers_; }
  // `last`: end the stream after this one (the job finished).
  void Offer(std::shared_ptr<const v1::StatsReport> report, bool last) {
    std::lock_guard<std::mutex> l(mu_);
    if (closed_locked()) return;
    if (queue_.size() >= capacity_) queue_.pop_front();
    queue_.push_back({std::move(report), last});
    PumpLocked();
  }

 private:
  Next NextLocked(const v1::StatsReport** out) override {
    if (end_ || queue_.empty()) return end_ ? Next::kDone : Next::kIdle;
    writing_ = std::move(queue_.front().report);
    end_ = queue_.front().last;
    queue_.pop_front();
    *out = writing_.get();
    return Next::kWrite;
  }
  const bool with_layers_;
  const size_t capacity_;
  struct Item {
    std::shared_ptr<const v1::StatsReport> report;
    bool last;
  };
  std::deque<Item> queue_;
  std::shared_ptr<const v1::StatsReport> writing_;  // the write in flight
  bool end_ = false;
};

// JobHistory: stored reports in (step, id) order, read from the store a page at a time as the
// client consumes them, so a long history never sits in memory.
class HistoryStream final : public WriterStream<v1::StatsReport> {
 public:
  HistoryStream(Coordinator* c, Store* store, const v1::JobHistoryRequest& req, int64_t job_id)
      : WriterStream(c), store_(store), with_layers_(req.with_layers()) {
    query_.job_id = job_id;
    query_.from_step = req.from_step();
    query_.to_step = req.to_step() == 0 ? INT64_MAX : req.to_step();
  }
  void Start() {
    std::lock_guard<std::mutex> l(mu_);
    PumpLocked();
  }

 private:
  static constexpr size_t kPageRows = 256;
  static constexpr size_t kPageBytes = size_t(4) << 20;

  Next NextLocked(const v1::StatsReport** out) override {
    if (page_.empty() && !exhausted_) {
      query_.limit = kPageRows;
      size_t rows = 0, bytes = 0;
      Status s = store_->QueryReports(query_, [&](const StoredReport& r) {
        page_.emplace_back(r.blob);
        query_.after_step = r.step;
        query_.after_id = r.id;
        ++rows;
        bytes += r.blob.size();
        return bytes < kPageBytes;
      });
      if (!s.ok()) {
        done_ = ToGrpc(s);
        return Next::kDone;
      }
      if (rows < kPageRows && bytes < kPageBytes) exhausted_ = true;
    }
    if (page_.empty()) return Next::kDone;
    const bool ok = msg_.ParseFromString(page_.front());
    page_.pop_front();
    if (!ok) {
      done_ = grpc::Status(
          StatusCode::DATA_LOSS,
          "a stored report of job " + std::to_string(query_.job_id) + " does not parse");
      return Next::kDone;
    }
    if (!with_layers_) msg_.clear_layers();
    *out = &msg_;
    return Next::kWrite;
  }
  Store* const store_;
  const bool with_layers_;
  ReportQuery query_;
  std::deque<std::string> page_;
  v1::StatsReport msg_;  // the write in flight
  bool exhausted_ = false;
};

// ---- gRPC services
// -------------------------------------------------------------------------------

// ReportStats requests are parsed into a per-call arena: a report with 100 layer rows is ~300
// objects and strings, each otherwise its own malloc/free on the hot path.
class ReportArenaAllocator final
    : public grpc::MessageAllocator<v1::StatsReport, v1::ReportStatsResponse> {
 public:
  grpc::MessageHolder<v1::StatsReport, v1::ReportStatsResponse>* AllocateMessages() override {
    return new Holder;
  }

 private:
  class Holder final : public grpc::MessageHolder<v1::StatsReport, v1::ReportStatsResponse> {
   public:
    Holder() : arena_(Options(block_)) {
      set_request(google::protobuf::Arena::CreateMessage<v1::StatsReport>(&arena_));
      set_response(google::protobuf::Arena::CreateMessage<v1::ReportStatsResponse>(&arena_));
    }
    void Release() override { delete this; }

   private:
    static google::protobuf::ArenaOptions Options(char* block) {
      google::protobuf::ArenaOptions o;
      o.initial_block = block;
      o.initial_block_size = sizeof(block_);
      o.start_block_size = sizeof(block_);
      o.max_block_size = size_t(1) << 20;
      return o;
    }
    alignas(16) char block_[32 << 10];  // a 100-row report parses into ~20 KiB
    google::protobuf::Arena arena_;
  };
};

class Coordinator::WorkerImpl final : public v1::WorkerService::CallbackService {
 public:
  explicit WorkerImpl(Coordinator* c) : c_(c) { SetMessageAllocatorFor_ReportStats(&allocator_); }

  grpc::ServerUnaryReactor* RegisterJob(grpc::CallbackServerContext* ctx,
                                        const v1::RegisterJobRequest* req,
                                        v1::RegisterJobResponse* resp) override {
    return c_->Unary(ctx, [&] { return c_->RegisterJob(*req, resp); });
  }
  grpc::ServerUnaryReactor* ReportStats(grpc::CallbackServerContext* ctx,
                                        const v1::StatsReport* req,
                                        v1::ReportStatsResponse* resp) override {
    return c_->Unary(ctx, [&] { return c_->ReportStats(*req, resp); });
  }
  grpc::ServerWriteReactor<v1::PrecisionSchedule>* WatchSchedule(
      grpc::CallbackServerContext* ctx, const v1::WatchScheduleRequest* req) override {
    return c_->StartWatchSchedule(ctx, *req);
  }

 private:
  Coordinator* const c_;
  ReportArenaAllocator allocator_;
};

class Coordinator::OperatorImpl final : public v1::OperatorService::CallbackService {
 public:
  explicit OperatorImpl(Coordinator* c) : c_(c) {}

  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* ctx,
                                     const v1::ListJobsRequest* /*req*/,
                                     v1::ListJobsResponse* resp) override {
    return c_->Unary(ctx, [&] { return c_->ListJobs(resp); });
  }
  grpc::ServerUnaryReactor* JobStatus(grpc::CallbackServerContext* ctx, const v1::JobRef* req,
                                      v1::JobStatusResponse* resp) override {
    return c_->Unary(ctx, [&] { return c_->JobStatus(*req, resp); });
  }
  grpc::ServerUnaryReactor* LayerStats(grpc::CallbackServerContext* ctx,
                                       const v1::LayerStatsRequest* req,
                                       v1::LayerStatsResponse* resp) override {
    return c_->Unary(ctx, [&] { return c_->LayerStats(*req, resp); });
  }
  grpc::ServerUnaryReactor* GetSchedule(grpc::CallbackServerContext* ctx,
                                        const v1::GetScheduleRequest* req,
                                        v1::GetScheduleResponse* resp) override {
    return c_->Unary(ctx, [&] { return c_->GetSchedule(*req, resp); });
  }
  grpc::ServerUnaryReactor* SetSchedule(grpc::CallbackServerContext* ctx,
                                        const v1::SetScheduleRequest* req,
                                        v1::SetScheduleResponse* resp) override {
    return c_->Unary(ctx, [&] { return c_->SetSchedule(*req, resp); });
  }
  grpc::ServerWriteReactor<v1::StatsReport>* WatchJob(grpc::CallbackServerContext* ctx,
                                                      const v1::WatchJobRequest* req) override {
    return c_->StartWatchJob(ctx, *req);
  }
  grpc::ServerWriteReactor<v1::StatsReport>* JobHistory(grpc::CallbackServerContext* ctx,
                                                        const v1::JobHistoryRequest* req) override {
    return c_->StartJobHistory(ctx, *req);
  }

 private:
  Coordinator* const c_;
};

// ---- Coordinator
// ---------------------------------------------------------------------------------

Coordinator::Coordinator(Store* store, CoordinatorOptions options)
    : store_(store), options_(std::move(options)) {
  worker_ = std::make_unique<WorkerImpl>(this);
  operator_ = std::make_unique<OperatorImpl>(this);
}

Coordinator::~Coordinator() {
  CloseStreams();
  // gRPC deletes each stream after its OnDone; wait (bounded) for them to unregister.
  std::unique_lock<std::mutex> l(mu_);
  streams_cv_.wait_for(l, std::chrono::seconds(10), [&] { return streams_.empty(); });
}

grpc::Service* Coordinator::worker_service() { return worker_.get(); }
grpc::Service* Coordinator::operator_service() { return operator_.get(); }

Result<std::unique_ptr<Coordinator>> Coordinator::Create(Store* store, CoordinatorOptions options) {
  std::unique_ptr<Coordinator> c(new Coordinator(store, std::move(options)));
  CPD_RETURN_IF_ERROR(c->Load());
  return c;
}

Status Coordinator::Load() {
  auto jobs = store_->LoadJobs();
  if (!jobs.ok()) return jobs.status();
  for (JobRecord& rec : jobs.value()) {
    auto job = std::make_unique<Job>();
    job->id = rec.job_id;
    job->registered_ms = rec.registered_ms;
    job->updated_ms = rec.updated_ms;
    job->info = Meta(rec.info);
    auto sched = store_->CurrentSchedule(rec.job_id);
    if (!sched.ok()) return sched.status();
    if (!sched->has_value()) {
      return Status::Corruption("database: " + JobLabel(rec.job_id, rec.info.job_name()) +
                                " has no schedule");
    }
    job->schedule = std::make_shared<const v1::PrecisionSchedule>(std::move(**sched));
    // The latest report (highest step) and the last measured accuracies.
    ReportQuery q;
    q.job_id = rec.job_id;
    q.descending = true;
    q.limit = 1;
    CPD_RETURN_IF_ERROR(store_->QueryReports(q, [&](const StoredReport& r) {
      job->latest = std::make_shared<const std::string>(r.blob);
      job->latest_step = r.step;
      job->last_report_ms = r.received_ms;
      job->finished = r.finished && r.received_ms >= job->updated_ms;
      return false;
    }));
    q.only_keep = true;
    q.limit = 1000;
    CPD_RETURN_IF_ERROR(store_->QueryReports(q, [&](const StoredReport& r) {
      v1::StatsReport rep;
      if (!rep.ParseFromArray(r.blob.data(), int(r.blob.size()))) return true;
      if (job->train_accuracy < 0 && rep.train_accuracy() >= 0) {
        job->train_accuracy = rep.train_accuracy();
      }
      if (job->test_accuracy < 0 && rep.test_accuracy() >= 0) {
        job->test_accuracy = rep.test_accuracy();
      }
      return job->train_accuracy < 0 || job->test_accuracy < 0;
    }));
    by_name_[rec.info.job_name()] = rec.job_id;
    jobs_[rec.job_id] = std::move(job);
  }
  return Status::Ok();
}

grpc::Status Coordinator::CheckAuth(const grpc::CallbackServerContext* ctx) const {
  if (options_.token.empty()) return grpc::Status::OK;
  const auto& md = ctx->client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) {
    return grpc::Status(StatusCode::UNAUTHENTICATED,
                        "this coordinator requires a token: send metadata "
                        "'authorization: Bearer <token>' (the token in its --token-file)");
  }
  const std::string_view value(it->second.data(), it->second.size());
  const std::string expected = "Bearer " + options_.token;
  if (!ConstantTimeEqual(value, expected)) {
    return grpc::Status(StatusCode::UNAUTHENTICATED,
                        "the token does not match this coordinator's --token-file");
  }
  return grpc::Status::OK;
}

template <typename F>
grpc::ServerUnaryReactor* Coordinator::Unary(grpc::CallbackServerContext* ctx, F&& f) {
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  grpc::Status s = CheckAuth(ctx);
  if (s.ok()) s = f();
  r->Finish(s);
  return r;
}

Coordinator::Job* Coordinator::FindLocked(int64_t id) const {
  auto it = jobs_.find(id);
  return it == jobs_.end() ? nullptr : it->second.get();
}

grpc::Status Coordinator::FindJob(const v1::JobRef& ref, std::string_view field,
                                  int64_t* id) const {
  Status v = ValidateJobRef(ref, field, options_.limits);
  if (!v.ok()) return ToGrpc(v);
  std::lock_guard<std::mutex> l(mu_);
  if (ref.job_id() != 0) {
    if (FindLocked(ref.job_id()) == nullptr) {
      return grpc::Status(StatusCode::NOT_FOUND,
                          "no job with job_id " + std::to_string(ref.job_id()) +
                              " (ListJobs shows the jobs this coordinator knows)");
    }
    *id = ref.job_id();
    return grpc::Status::OK;
  }
  auto it = by_name_.find(ref.job_name());
  if (it == by_name_.end()) {
    return grpc::Status(
        StatusCode::NOT_FOUND,
        "no job named '" + ref.job_name() + "' (ListJobs shows the jobs this coordinator knows)");
  }
  *id = it->second;
  return grpc::Status::OK;
}

void Coordinator::Register(StreamBase* s, int64_t job_id, int kind) {
  s->job_id = job_id;
  s->kind = kind;
  streams_.insert(s);
  Job* j = FindLocked(job_id);
  if (j == nullptr) return;
  if (kind == kScheduleWatch) j->schedule_watchers.push_back(static_cast<ScheduleStream*>(s));
  if (kind == kJobWatch) j->job_watchers.push_back(static_cast<JobStream*>(s));
}

void Coordinator::Unregister(StreamBase* s) {
  std::lock_guard<std::mutex> l(mu_);
  if (streams_.erase(s) == 0) return;
  if (Job* j = FindLocked(s->job_id)) {
    if (s->kind == kScheduleWatch) {
      auto& v = j->schedule_watchers;
      v.erase(std::remove(v.begin(), v.end(), static_cast<ScheduleStream*>(s)), v.end());
    } else if (s->kind == kJobWatch) {
      auto& v = j->job_watchers;
      v.erase(std::remove(v.begin(), v.end(), static_cast<JobStream*>(s)), v.end());
    }
  }
  if (streams_.empty()) streams_cv_.notify_all();
}

void Coordinator::CloseStreams() {
  std::lock_guard<std::mutex> l(mu_);
  closing_ = true;
  for (StreamBase* s : streams_) s->Close(kShuttingDown);
}

size_t Coordinator::open_streams() const {
  std::lock_guard<std::mutex> l(mu_);
  return streams_.size();
}

grpc::ServerWriteReactor<v1::PrecisionSchedule>* Coordinator::StartWatchSchedule(
    grpc::CallbackServerContext* ctx, const v1::WatchScheduleRequest& req) {
  auto* s = new ScheduleStream(this);
  grpc::Status st = CheckAuth(ctx);
  if (st.ok() && req.job_id() <= 0) {
    st = Invalid("job_id: " + std::to_string(req.job_id()) +
                 " is not a job id (RegisterJob returns one)");
  }
  if (st.ok()) {
    std::lock_guard<std::mutex> l(mu_);
    Job* j = FindLocked(req.job_id());
    if (closing_) {
      st = kShuttingDown;
    } else if (j == nullptr) {
      st =
          grpc::Status(StatusCode::NOT_FOUND, "no job with job_id " + std::to_string(req.job_id()));
    } else {
      Register(s, j->id, kScheduleWatch);
      s->Start(j->schedule, req.after_version());
    }
  }
  if (!st.ok()) s->Close(st);
  return s;
}

grpc::ServerWriteReactor<v1::StatsReport>* Coordinator::StartWatchJob(
    grpc::CallbackServerContext* ctx, const v1::WatchJobRequest& req) {
  auto* s = new JobStream(this, req.with_layers(), options_.watch_buffer);
  grpc::Status st = CheckAuth(ctx);
  int64_t id = 0;
  if (st.ok()) st = FindJob(req.job(), "job", &id);
  if (st.ok()) {
    std::lock_guard<std::mutex> l(mu_);
    Job* j = FindLocked(id);
    if (closing_) {
      st = kShuttingDown;
    } else {
      Register(s, id, kJobWatch);
      if (j->latest) {  // the latest report first
        auto m = std::make_shared<v1::StatsReport>();
        if (m->ParseFromString(*j->latest)) {
          if (!req.with_layers()) m->clear_layers();
          s->Offer(std::move(m), j->finished);  // a finished job: the stream ends after it
        }
      }
    }
  }
  if (!st.ok()) s->Close(st);
  return s;
}

grpc::ServerWriteReactor<v1::StatsReport>* Coordinator::StartJobHistory(
    grpc::CallbackServerContext* ctx, const v1::JobHistoryRequest& req) {
  grpc::Status st = CheckAuth(ctx);
  if (st.ok()) st = ToGrpc(ValidateJobHistoryRequest(req, options_.limits));
  int64_t id = 0;
  if (st.ok()) st = FindJob(req.job(), "job", &id);
  auto* s = new HistoryStream(this, store_, req, id);
  if (st.ok()) {
    std::lock_guard<std::mutex> l(mu_);
    if (closing_) {
      st = kShuttingDown;
    } else {
      Register(s, id, kHistory);
    }
  }
  if (st.ok()) {
    s->Start();
  } else {
    s->Close(st);
  }
  return s;
}

// ---- Unary calls
// ---------------------------------------------------------------------------------

grpc::Status Coordinator::RegisterJob(const v1::RegisterJobRequest& req,
                                      v1::RegisterJobResponse* resp) {
  Status v = ValidateRegister(req, options_.limits);
  if (!v.ok()) return ToGrpc(v);
  const int64_t now = NowMs();
  v1::RegisterJobRequest normalized = req;
  if (normalized.emulated_workers_per_rank() == 0) normalized.set_emulated_workers_per_rank(1);

  std::lock_guard<std::mutex> meta(meta_mu_);
  int64_t existing = 0;
  {
    std::lock_guard<std::mutex> l(mu_);
    auto it = by_name_.find(req.job_name());
    if (it != by_name_.end()) existing = it->second;
  }
  if (existing != 0) {
    // A reconnect or a resumed run: the coordinator's current schedule wins.
    Status s = store_->UpdateJob(existing, normalized, now);
    if (!s.ok()) return ToGrpc(s);
    std::lock_guard<std::mutex> l(mu_);
    Job* j = FindLocked(existing);
    j->info = Meta(normalized);
    j->updated_ms = now;
    j->finished = false;
    j->latest_step = -1;  // a resumed run may restart below the last step seen
    resp->set_job_id(existing);
    resp->set_existed(true);
    *resp->mutable_schedule() = *j->schedule;
    return grpc::Status::OK;
  }
  v1::PrecisionSchedule first = req.schedule();
  first.set_version(1);
  first.set_set_at_ms(now);
  first.set_set_by("register");
  auto id = store_->CreateJob(normalized, now, first);
  if (!id.ok()) return ToGrpc(id.status());
  auto job = std::make_unique<Job>();
  job->id = *id;
  job->registered_ms = job->updated_ms = now;
  job->info = Meta(normalized);
  job->schedule = std::make_shared<const v1::PrecisionSchedule>(first);
  {
    std::lock_guard<std::mutex> l(mu_);
    by_name_[req.job_name()] = *id;
    jobs_[*id] = std::move(job);
  }
  resp->set_job_id(*id);
  resp->set_existed(false);
  *resp->mutable_schedule() = std::move(first);
  return grpc::Status::OK;
}

grpc::Status Coordinator::ReportStats(const v1::StatsReport& req, v1::ReportStatsResponse* resp) {
  Status v = ValidateReport(req, options_.limits);
  if (!v.ok()) return ToGrpc(v);
  const int64_t now = NowMs();
  uint64_t version = 0;
  bool want_full = false, want_summary = false;  // WatchJob streams with / without layer rows
  {
    std::lock_guard<std::mutex> l(mu_);
    const Job* j = FindLocked(req.job_id());
    if (j == nullptr) {
      return grpc::Status(
          StatusCode::NOT_FOUND,
          "no job with job_id " + std::to_string(req.job_id()) + " (RegisterJob first)");
    }
    const int32_t world = j->info.world_size();
    if (req.rank() >= world) {
      return Invalid("rank: " + std::to_string(req.rank()) + " is out of range for " +
                     JobLabel(j->id, j->info.job_name()) + " of world_size " +
                     std::to_string(world) + "; accepted: 0.." + std::to_string(world - 1));
    }
    if (req.ranks_alive() > world) {
      return Invalid("ranks_alive: " + std::to_string(req.ranks_alive()) + " exceeds world_size " +
                     std::to_string(world) + " of " + JobLabel(j->id, j->info.job_name()));
    }
    version = j->schedule->version();
    for (const JobStream* w : j->job_watchers) (w->with_layers() ? want_full : want_summary) = true;
  }
  auto blob = std::make_shared<std::string>();
  req.SerializeToString(blob.get());
  ReportRow row;
  row.job_id = req.job_id();
  row.step = req.step();
  row.rank = req.rank();
  row.has_layers = req.layers_size() > 0;
  row.keep = req.finished() || req.train_accuracy() >= 0 || req.test_accuracy() >= 0;
  row.finished = req.finished();
  row.time_ms = req.time_ms();
  row.received_ms = now;
  row.blob = blob;
  if (!store_->Enqueue(row)) {
    const StoreStats st = store_->stats();
    return grpc::Status(StatusCode::RESOURCE_EXHAUSTED,
                        "the coordinator's report queue is full (" + std::to_string(st.queued) +
                            " reports waiting for the disk); retry later or report less often");
  }
  // The messages for WatchJob streams, built once and outside the lock.
  auto message = [&req](bool with_layers) {
    auto m = std::make_shared<v1::StatsReport>(req);
    if (!with_layers) m->clear_layers();
    return std::shared_ptr<const v1::StatsReport>(std::move(m));
  };
  std::shared_ptr<const v1::StatsReport> full, summary;
  if (want_full) full = message(true);
  if (want_summary) summary = message(false);
  {
    std::lock_guard<std::mutex> l(mu_);
    Job* j = FindLocked(req.job_id());
    if (req.step() >= j->latest_step) {
      j->latest = blob;
      j->latest_step = req.step();
    }
    j->last_report_ms = now;
    if (req.finished()) j->finished = true;
    if (req.train_accuracy() >= 0) j->train_accuracy = req.train_accuracy();
    if (req.test_accuracy() >= 0) j->test_accuracy = req.test_accuracy();
    for (JobStream* w : j->job_watchers) {
      auto& m = w->with_layers() ? full : summary;
      if (!m) m = message(w->with_layers());  // a stream that started since the first look
      w->Offer(m, req.finished());
    }
  }
  resp->set_schedule_version(version);
  return grpc::Status::OK;
}

void Coordinator::FillSummary(const Job& j, int64_t now_ms, v1::JobSummary* out) const {
  out->set_job_id(j.id);
  out->set_job_name(j.info.job_name());
  const int64_t since = j.last_report_ms != 0 ? j.last_report_ms : j.updated_ms;
  if (j.finished) {
    out->set_state("finished");
  } else if (now_ms - since > options_.stale_after_ms) {
    out->set_state("stale");
  } else {
    out->set_state("running");
  }
  out->set_world_size(j.info.world_size());
  out->set_step(j.latest_step >= 0 ? j.latest_step : j.info.start_step());
  out->set_total_steps(j.info.total_steps());
  out->set_registered_ms(j.registered_ms);
  out->set_last_report_ms(j.last_report_ms);
  out->set_arch(j.info.arch());
  out->set_dataset(j.info.dataset());
}

grpc::Status Coordinator::ListJobs(v1::ListJobsResponse* resp) {
  const int64_t now = NowMs();
  std::lock_guard<std::mutex> l(mu_);
  std::vector<int64_t> ids;
  ids.reserve(jobs_.size());
  for (const auto& [id, j] : jobs_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  for (int64_t id : ids) FillSummary(*jobs_.at(id), now, resp->add_jobs());
  return grpc::Status::OK;
}

grpc::Status Coordinator::JobStatus(const v1::JobRef& req, v1::JobStatusResponse* resp) {
  int64_t id = 0;
  grpc::Status st = FindJob(req, "", &id);
  if (!st.ok()) return st;
  const int64_t now = NowMs();
  std::shared_ptr<const std::string> latest;
  int64_t last_ms = 0;
  {
    std::lock_guard<std::mutex> l(mu_);
    const Job* j = FindLocked(id);
    FillSummary(*j, now, resp->mutable_job());
    resp->set_epochs(j->info.epochs());
    resp->set_train_accuracy(j->train_accuracy);
    resp->set_test_accuracy(j->test_accuracy);
    *resp->mutable_schedule() = *j->schedule;
    resp->set_allreduce(j->info.allreduce());
    latest = j->latest;
    last_ms = j->last_report_ms;
  }
  resp->set_last_report_age_ms(last_ms != 0 ? std::max<int64_t>(0, now - last_ms) : -1);
  if (latest) {
    v1::StatsReport r;
    if (r.ParseFromString(*latest)) {
      resp->set_epoch(r.epoch());
      resp->set_bits(r.bits());
      resp->set_loss(r.loss());
      resp->set_ranks_alive(r.ranks_alive());
      resp->set_images_per_s(r.images_per_s());
      resp->set_dropped_reports(r.dropped_reports());
      resp->set_skipped_steps(r.skipped_steps());
    }
  }
  resp->set_reports_stored(store_->ReportsStored(id));
  return ToGrpc(store_->LoadWorkersAndLayers(id, resp));
}

grpc::Status Coordinator::LayerStats(const v1::LayerStatsRequest& req,
                                     v1::LayerStatsResponse* resp) {
  Status v = ValidateLayerStatsRequest(req, options_.limits);
  if (!v.ok()) return ToGrpc(v);
  int64_t id = 0;
  grpc::Status st = FindJob(req.job(), "job", &id);
  if (!st.ok()) return st;
  ReportQuery q;
  q.job_id = id;
  q.only_with_layers = true;
  q.limit = req.limit() > 0 ? size_t(req.limit()) : size_t(options_.limits.max_layer_stats_limit);
  if (req.latest()) {
    // The newest step that carries layer rows; every report at that step.
    int64_t step = -1;
    ReportQuery newest = q;
    newest.descending = true;
    newest.limit = 1;
    Status s = store_->QueryReports(newest, [&](const StoredReport& r) {
      step = r.step;
      return false;
    });
    if (!s.ok()) return ToGrpc(s);
    if (step < 0) return grpc::Status::OK;
    q.from_step = q.to_step = step;
  } else {
    q.from_step = req.from_step();
    q.to_step = req.to_step();
  }
  size_t bytes = 0;
  Status parse_error;
  Status s = store_->QueryReports(q, [&](const StoredReport& r) {
    if (resp->reports_size() > 0 && bytes + r.blob.size() > options_.max_response_bytes) {
      return false;  // the rest: ask again from the last step returned
    }
    bytes += r.blob.size() + 16;
    if (!resp->add_reports()->ParseFromArray(r.blob.data(), int(r.blob.size()))) {
      parse_error = Status::Corruption("a stored report of job " + std::to_string(id) +
                                       " at step " + std::to_string(r.step) + " does not parse");
      return false;
    }
    return true;
  });
  if (!s.ok()) return ToGrpc(s);
  return ToGrpc(parse_error);
}

grpc::Status Coordinator::GetSchedule(const v1::GetScheduleRequest& req,
                                      v1::GetScheduleResponse* resp) {
  int64_t id = 0;
  grpc::Status st = FindJob(req.job(), "job", &id);
  if (!st.ok()) return st;
  {
    std::lock_guard<std::mutex> l(mu_);
    *resp->mutable_schedule() = *FindLocked(id)->schedule;
  }
  auto history = store_->Schedules(id);
  if (!history.ok()) return ToGrpc(history.status());
  for (auto& s : *history) *resp->add_history() = std::move(s);
  return grpc::Status::OK;
}

grpc::Status Coordinator::SetSchedule(const v1::SetScheduleRequest& req,
                                      v1::SetScheduleResponse* resp) {
  int64_t id = 0;
  grpc::Status st = FindJob(req.job(), "job", &id);
  if (!st.ok()) return st;
  if (req.set_by().size() > options_.limits.max_string) {
    return Invalid("set_by: longer than " + std::to_string(options_.limits.max_string) + " bytes");
  }
  v1::JobStatusResponse wl;
  Status s = store_->LoadWorkersAndLayers(id, &wl);
  if (!s.ok()) return ToGrpc(s);
  LayerNames names;
  for (const auto& l : wl.layers()) names.insert(l.name());
  Status v = ValidateSchedule(req.schedule(), "schedule", names, options_.limits);
  if (!v.ok()) return ToGrpc(v);

  std::lock_guard<std::mutex> meta(meta_mu_);
  uint64_t current = 0;
  std::string name;
  {
    std::lock_guard<std::mutex> l(mu_);
    const Job* j = FindLocked(id);
    current = j->schedule->version();
    name = j->info.job_name();
  }
  if (req.expected_version() != 0 && req.expected_version() != current) {
    return grpc::Status(StatusCode::FAILED_PRECONDITION,
                        JobLabel(id, name) + " is at schedule version " + std::to_string(current) +
                            ", not " + std::to_string(req.expected_version()) +
                            " (expected_version): someone changed it; read it again "
                            "(GetSchedule) and retry");
  }
  auto next = std::make_shared<v1::PrecisionSchedule>(req.schedule());
  next->set_version(current + 1);
  next->set_set_at_ms(NowMs());
  next->set_set_by(req.set_by().empty() ? "operator" : req.set_by());
  s = store_->AppendSchedule(id, *next);
  if (!s.ok()) return ToGrpc(s);
  {
    std::lock_guard<std::mutex> l(mu_);
    Job* j = FindLocked(id);
    j->schedule = next;
    for (ScheduleStream* w : j->schedule_watchers) w->Offer(next);
  }
  *resp->mutable_schedule() = *next;
  return grpc::Status::OK;
}

// ---- Server
// --------------------------------------------------------------------------------------

namespace {

// gRPC reports a failed bind only in its log; bind a probe socket first to say why in one line
// ("Address already in use"). Addresses that are not HOST:PORT are left to gRPC.
Status CheckCanListen(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos || colon == 0) return Status::Ok();
  std::string host = listen.substr(0, colon);
  const std::string port = listen.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return Status::Unavailable("cannot listen on '" + listen + "': " + gai_strerror(rc));
  }
  std::string error;
  bool bound = false;
  for (addrinfo* a = res; a != nullptr && !bound; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // as gRPC does
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0) {
      bound = true;
    } else if (error.empty()) {
      error = std::strerror(errno);
    }
    close(fd);
  }
  freeaddrinfo(res);
  if (!bound) {
    return Status::Unavailable("cannot listen on '" + listen +
                               "': " + (error.empty() ? std::string("no usable address") : error) +
                               " (another coordinator on this port? --listen HOST:PORT, port 0 "
                               "picks a free one)");
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(ServerOptions options) {
  if (options.tls_cert_pem.empty() != options.tls_key_pem.empty()) {
    return Status::InvalidArgument(
        "TLS needs both a certificate and its key (--tls-cert and "
        "--tls-key), or neither");
  }
  if (options.max_receive_bytes <= 0) {
    return Status::InvalidArgument("the maximum message size must be positive");
  }
  CPD_RETURN_IF_ERROR(CheckCanListen(options.listen));
  std::unique_ptr<CoordinatorServer> srv(new CoordinatorServer());
  auto store = Store::Open(options.store);
  if (!store.ok()) return store.status();
  srv->store_ = std::move(store).value();
  options.coordinator.max_response_bytes =
      std::min(options.coordinator.max_response_bytes, size_t(options.max_receive_bytes));
  auto coord = Coordinator::Create(srv->store_.get(), options.coordinator);
  if (!coord.ok()) return coord.status();
  srv->coordinator_ = std::move(coord).value();

  std::shared_ptr<grpc::ServerCredentials> creds;
  if (!options.tls_cert_pem.empty()) {
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({options.tls_key_pem, options.tls_cert_pem});
    creds = grpc::SslServerCredentials(ssl);
  } else {
    creds = grpc::InsecureServerCredentials();
  }
  grpc::ServerBuilder b;
  b.AddListeningPort(options.listen, creds, &srv->port_);
  b.RegisterService(srv->coordinator_->worker_service());
  b.RegisterService(srv->coordinator_->operator_service());
  b.SetMaxReceiveMessageSize(options.max_receive_bytes);
  // gRPC sets SO_REUSEPORT by default: a second coordinator on the same port would then start
  // and silently take half the connections.
  b.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Workers keep WatchSchedule open for days: probe idle connections so that a vanished client
  // does not hold a stream forever, and accept the clients' own keepalive pings.
  b.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 60000);
  b.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20000);
  b.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  b.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
  srv->server_ = b.BuildAndStart();
  if (!srv->server_ || srv->port_ == 0) {
    srv->server_.reset();
    return Status::Unavailable("cannot listen on '" + options.listen +
                               "' (address in use, not local, or malformed; "
                               "--listen HOST:PORT, port 0 picks a free one)");
  }
  return srv;
}

CoordinatorServer::~CoordinatorServer() { Shutdown(); }

void CoordinatorServer::Shutdown(int grace_ms) {
  std::lock_guard<std::mutex> l(shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  if (coordinator_) coordinator_->CloseStreams();
  if (server_) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(grace_ms));
  }
  // Every ReportStats answered OK is in the store's queue: store it before returning.
  if (store_) store_->Flush();
}

}  // namespace cpd::coordinator
