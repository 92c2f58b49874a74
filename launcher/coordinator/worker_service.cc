// WorkerService: what a job's rank 0 calls (RegisterJob, ReportStats, WatchSchedule).
#include <google/protobuf/arena.h>

#include <memory>
#include <mutex>
#include <utility>

#include "launcher/coordinator/service.h"
#include "launcher/coordinator/service_internal.h"
#include "launcher/coordinator/streams.h"

namespace cpd::coordinator {

using grpc::StatusCode;

namespace {

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

}  // namespace

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

std::unique_ptr<grpc::Service> Coordinator::NewWorkerService() {
  return std::make_unique<WorkerImpl>(this);
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

grpc::Status Coordinator::KeepStudy(int64_t id, v1::RegisterJobRequest* req) const {
  std::lock_guard<std::mutex> l(mu_);
  const Job* j = FindLocked(id);
  const std::string& tag = j->info.study();
  if (req->study().empty()) {
    req->set_study(tag);  // a resumed run started without --study
    return grpc::Status::OK;
  }
  if (tag.empty() || tag == req->study()) return grpc::Status::OK;
  return grpc::Status(StatusCode::FAILED_PRECONDITION,
                      "study: " + JobLabel(id, j->info.job_name()) + " belongs to study '" + tag +
                          "', not '" + req->study() +
                          "'; a job keeps its study (register the run under another job_name)");
}

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
    // A reconnect or a resumed run: the coordinator's current schedule wins, the study stays.
    grpc::Status kept = KeepStudy(existing, &normalized);
    if (!kept.ok()) return kept;
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
    v = ValidateReportForJob(req, j->info, JobLabel(j->id, j->info.job_name()));
    if (!v.ok()) return ToGrpc(v);
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
  row.keep = req.finished() || req.train_accuracy() >= 0 || req.test_accuracy() >= 0 ||
             Measured(req.test_loss()) || Measured(req.test_perplexity());
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
      j->latest_epoch = req.epoch();
      j->latest_loss = req.loss();
    }
    j->last_report_ms = now;
    if (req.finished()) j->finished = true;
    j->evaluations.Take(req, /*newer=*/true);
    for (JobStream* w : j->job_watchers) {
      auto& m = w->with_layers() ? full : summary;
      if (!m) m = message(w->with_layers());  // a stream that started since the first look
      w->Offer(m, req.finished());
    }
  }
  resp->set_schedule_version(version);
  return grpc::Status::OK;
}

}  // namespace cpd::coordinator
