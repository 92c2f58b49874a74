// The Coordinator's core: construction from the store, authentication, finding jobs and the
// registry of open streams. The RPCs are in worker_service.cc and operator_service.cc.
#include "launcher/coordinator/service.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "launcher/coordinator/service_internal.h"
#include "launcher/coordinator/streams.h"

namespace cpd::coordinator {

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

v1::RegisterJobRequest Meta(const v1::RegisterJobRequest& r) {
  v1::RegisterJobRequest m = r;
  m.clear_workers();
  m.clear_layers();
  m.clear_schedule();
  if (m.emulated_workers_per_rank() == 0) m.set_emulated_workers_per_rank(1);
  return m;
}

void Evaluations::Take(const v1::StatsReport& r, bool newer) {
  auto take = [newer](double v, bool measured, double* kept) {
    if (measured && (newer || *kept < 0)) *kept = v;
  };
  take(r.train_accuracy(), r.train_accuracy() >= 0, &train_accuracy);
  take(r.test_accuracy(), r.test_accuracy() >= 0, &test_accuracy);
  take(r.test_loss(), Measured(r.test_loss()), &test_loss);
  take(r.test_perplexity(), Measured(r.test_perplexity()), &test_perplexity);
  take(r.test_bits_per_byte(), Measured(r.test_bits_per_byte()), &test_bits_per_byte);
}

std::string JobLabel(int64_t id, const std::string& name) {
  return "job " + std::to_string(id) + " ('" + name + "')";
}

namespace {

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

}  // namespace

Coordinator::Coordinator(Store* store, CoordinatorOptions options)
    : store_(store), options_(std::move(options)) {
  worker_ = NewWorkerService();
  operator_ = NewOperatorService();
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
  CPD_ASSIGN_OR_RETURN(std::vector<JobRecord> jobs, store_->LoadJobs());
  for (JobRecord& rec : jobs) {
    auto job = std::make_unique<Job>();
    job->id = rec.job_id;
    job->registered_ms = rec.registered_ms;
    job->updated_ms = rec.updated_ms;
    job->info = Meta(rec.info);
    CPD_ASSIGN_OR_RETURN(std::optional<v1::PrecisionSchedule> sched,
                         store_->CurrentSchedule(rec.job_id));
    if (!sched.has_value()) {
      return Status::Corruption("database: " + JobLabel(rec.job_id, rec.info.job_name()) +
                                " has no schedule");
    }
    job->schedule = std::make_shared<const v1::PrecisionSchedule>(std::move(*sched));
    // The latest report (highest step) and the last measured accuracies (a language model's
    // validation figures come in the report that has its accuracies).
    ReportQuery q;
    q.job_id = rec.job_id;
    q.descending = true;
    q.limit = 1;
    CPD_RETURN_IF_ERROR(store_->QueryReports(q, [&](const StoredReport& r) {
      job->latest = std::make_shared<const std::string>(r.blob);
      job->latest_step = r.step;
      v1::StatsReport rep;
      if (rep.ParseFromArray(r.blob.data(), int(r.blob.size()))) {
        job->latest_epoch = rep.epoch();
        job->latest_loss = rep.loss();
      }
      job->last_report_ms = r.received_ms;
      job->finished = r.finished && r.received_ms >= job->updated_ms;
      return false;
    }));
    q.only_keep = true;
    q.limit = 1000;
    CPD_RETURN_IF_ERROR(store_->QueryReports(q, [&](const StoredReport& r) {
      v1::StatsReport rep;
      if (!rep.ParseFromArray(r.blob.data(), int(r.blob.size()))) return true;
      job->evaluations.Take(rep, /*newer=*/false);
      return !job->evaluations.accuracies_known();
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

}  // namespace cpd::coordinator
