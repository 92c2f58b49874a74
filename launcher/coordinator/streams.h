// The coordinator's server streams: gRPC callback-API write reactors with at most one write in
// flight and a bounded backlog each, so a slow or vanished client costs memory proportional to
// its buffer only and no thread. The Coordinator creates them (service.h), registers them, and
// closes them on shutdown; each unregisters itself when gRPC is done with it.
#pragma once

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "launcher/coordinator/store.h"
#include "proto/cpd/v1/coordinator.grpc.pb.h"

namespace cpd::coordinator {

class Coordinator;

enum StreamKind { kScheduleWatch = 0, kJobWatch = 1, kHistory = 2 };

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
  void Detach();
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
      if (!finished_) {
        FinishLocked(pending_.value_or(grpc::Status(grpc::StatusCode::CANCELLED, "")));
      }
      return;
    }
    PumpLocked();
  }
  void OnCancel() override { Close(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled")); }
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
  void Start(std::shared_ptr<const v1::PrecisionSchedule> current, uint64_t after_version);
  void Offer(std::shared_ptr<const v1::PrecisionSchedule> s);

 private:
  Next NextLocked(const v1::PrecisionSchedule** out) override;

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
  void Offer(std::shared_ptr<const v1::StatsReport> report, bool last);

 private:
  Next NextLocked(const v1::StatsReport** out) override;

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
  HistoryStream(Coordinator* c, Store* store, const v1::JobHistoryRequest& req, int64_t job_id);
  void Start();

 private:
  static constexpr size_t kPageRows = 256;
  static constexpr size_t kPageBytes = size_t(4) << 20;

  Next NextLocked(const v1::StatsReport** out) override;

  Store* const store_;
  const bool with_layers_;
  ReportQuery query_;
  std::deque<std::string> page_;
  v1::StatsReport msg_;  // the write in flight
  bool exhausted_ = false;
};

}  // namespace cpd::coordinator
