#include "launcher/coordinator/streams.h"

#include <cstdint>
#include <utility>

#include "launcher/coordinator/service.h"
#include "launcher/coordinator/service_internal.h"

namespace cpd::coordinator {

void StreamBase::Detach() { coord_->Unregister(this); }

void ScheduleStream::Start(std::shared_ptr<const v1::PrecisionSchedule> current,
                           uint64_t after_version) {
  {
    std::lock_guard<std::mutex> l(mu_);
    sent_version_ = after_version > current->version() ? 0 : after_version;
  }
  Offer(std::move(current));
}

void ScheduleStream::Offer(std::shared_ptr<const v1::PrecisionSchedule> s) {
  std::lock_guard<std::mutex> l(mu_);
  if (closed_locked() || s->version() <= sent_version_) return;
  sent_version_ = s->version();
  next_ = std::move(s);
  PumpLocked();
}

ScheduleStream::Next ScheduleStream::NextLocked(const v1::PrecisionSchedule** out) {
  if (!next_) return Next::kIdle;
  writing_ = std::move(next_);
  *out = writing_.get();
  return Next::kWrite;
}

void JobStream::Offer(std::shared_ptr<const v1::StatsReport> report, bool last) {
  std::lock_guard<std::mutex> l(mu_);
  if (closed_locked()) return;
  if (queue_.size() >= capacity_) queue_.pop_front();
  queue_.push_back({std::move(report), last});
  PumpLocked();
}

JobStream::Next JobStream::NextLocked(const v1::StatsReport** out) {
  if (end_ || queue_.empty()) return end_ ? Next::kDone : Next::kIdle;
  writing_ = std::move(queue_.front().report);
  end_ = queue_.front().last;
  queue_.pop_front();
  *out = writing_.get();
  return Next::kWrite;
}

HistoryStream::HistoryStream(Coordinator* c, Store* store, const v1::JobHistoryRequest& req,
                             int64_t job_id)
    : WriterStream(c), store_(store), with_layers_(req.with_layers()) {
  query_.job_id = job_id;
  query_.from_step = req.from_step();
  query_.to_step = req.to_step() == 0 ? INT64_MAX : req.to_step();
}

void HistoryStream::Start() {
  std::lock_guard<std::mutex> l(mu_);
  PumpLocked();
}

HistoryStream::Next HistoryStream::NextLocked(const v1::StatsReport** out) {
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
    done_ =
        grpc::Status(grpc::StatusCode::DATA_LOSS,
                     "a stored report of job " + std::to_string(query_.job_id) + " does not parse");
    return Next::kDone;
  }
  if (!with_layers_) msg_.clear_layers();
  *out = &msg_;
  return Next::kWrite;
}

}  // namespace cpd::coordinator
