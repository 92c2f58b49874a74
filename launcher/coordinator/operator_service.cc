// OperatorService: what cpdctl calls (jobs, status, layer statistics, schedules, the live and
// the stored reports).
#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "launcher/coordinator/service.h"
#include "launcher/coordinator/service_internal.h"
#include "launcher/coordinator/streams.h"

namespace cpd::coordinator {

using grpc::StatusCode;

class Coordinator::OperatorImpl final : public v1::OperatorService::CallbackService {
 public:
  explicit OperatorImpl(Coordinator* c) : c_(c) {}

  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* ctx,
                                     const v1::ListJobsRequest* req,
                                     v1::ListJobsResponse* resp) override {
    return c_->Unary(ctx, [&] { return c_->ListJobs(*req, resp); });
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

std::unique_ptr<grpc::Service> Coordinator::NewOperatorService() {
  return std::make_unique<OperatorImpl>(this);
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
  out->set_study(j.info.study());
  out->set_epoch(j.latest_epoch);
  out->set_epochs(j.info.epochs());
  out->set_loss(j.latest_loss);
  out->set_test_accuracy(j.evaluations.test_accuracy);
  out->set_test_perplexity(j.evaluations.test_perplexity);
  out->set_test_bits_per_byte(j.evaluations.test_bits_per_byte);
}

grpc::Status Coordinator::ListJobs(const v1::ListJobsRequest& req, v1::ListJobsResponse* resp) {
  Status v = ValidateListJobsRequest(req, options_.limits);
  if (!v.ok()) return ToGrpc(v);
  const int64_t now = NowMs();
  std::lock_guard<std::mutex> l(mu_);
  std::vector<int64_t> ids;
  ids.reserve(jobs_.size());
  for (const auto& [id, j] : jobs_) {
    if (req.study().empty() || j->info.study() == req.study()) ids.push_back(id);
  }
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
    const Evaluations& e = j->evaluations;
    resp->set_train_accuracy(e.train_accuracy);
    resp->set_test_accuracy(e.test_accuracy);
    resp->set_test_loss(e.test_loss);
    resp->set_test_perplexity(e.test_perplexity);
    resp->set_test_bits_per_byte(e.test_bits_per_byte);
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
  int64_t total_steps = 0;
  std::string name;
  {
    std::lock_guard<std::mutex> l(mu_);
    const Job* j = FindLocked(id);
    current = j->schedule->version();
    name = j->info.job_name();
    total_steps = j->info.total_steps();
  }
  // A schedule from a step the job never reaches would be accepted and never take effect.
  if (total_steps > 0 && req.schedule().effective_from_step() >= total_steps) {
    return Invalid(
        "schedule.effective_from_step: " + std::to_string(req.schedule().effective_from_step()) +
        " is beyond the " + std::to_string(total_steps) + " steps of " + JobLabel(id, name) +
        "; accepted: 0.." + std::to_string(total_steps - 1) + " (0: the next step)");
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

}  // namespace cpd::coordinator
