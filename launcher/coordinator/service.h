// The coordinator service (cpd.v1 WorkerService + OperatorService); server.h hosts it.
//
// The coordinator is CPD's control plane: it pushes each job's precision schedule to the job's
// workers (WatchSchedule) and keeps their per-layer statistics (ReportStats -> Store). It never
// sees a gradient buffer. Every RPC uses gRPC's callback API, so hundreds of open streams
// (WatchSchedule, WatchJob, JobHistory) cost no thread each; every stream's buffer is bounded.
//
// In memory per job: its registration summary, the current schedule, the latest report (shared
// with the store queue, not copied) and the last measured accuracies. Everything else is read
// from the Store, so memory is bounded by the number of jobs, not by how long they run.
#pragma once

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "cpd/status.h"
#include "launcher/common.h"
#include "launcher/coordinator/store.h"
#include "launcher/coordinator/validate.h"
#include "proto/cpd/v1/coordinator.grpc.pb.h"

namespace cpd::coordinator {

struct CoordinatorOptions {
  // When not empty, every call must carry metadata "authorization: Bearer <token>".
  std::string token;
  // A job with no report for this long (and not finished) is "stale".
  int64_t stale_after_ms = 60000;
  // WatchJob: reports buffered per stream for a slow reader (the oldest are dropped).
  size_t watch_buffer = 64;
  // LayerStats answers stop adding reports beyond this many bytes (gRPC clients receive 4 MiB
  // by default).
  size_t max_response_bytes = size_t(4) << 20;
  Limits limits;
};

class StreamBase;

// The service state and both gRPC services. Thread-safe.
class Coordinator {
 public:
  // Loads every job (and its latest report) from `store`, which must outlive the Coordinator.
  static Result<std::unique_ptr<Coordinator>> Create(Store* store, CoordinatorOptions options);
  ~Coordinator();

  grpc::Service* worker_service();
  grpc::Service* operator_service();

  // Ends every open stream (UNAVAILABLE "shutting down") and refuses new ones. Call before
  // grpc::Server::Shutdown so that it does not wait for streams that would never end.
  void CloseStreams();

  // Open streams (for tests and diagnostics).
  size_t open_streams() const;

 private:
  struct Job;               // service_internal.h
  class WorkerImpl;         // worker_service.cc
  class OperatorImpl;       // operator_service.cc
  friend class StreamBase;  // streams unregister themselves when gRPC is done with them

  Coordinator(Store* store, CoordinatorOptions options);
  Status Load();
  std::unique_ptr<grpc::Service> NewWorkerService();
  std::unique_ptr<grpc::Service> NewOperatorService();

  grpc::Status CheckAuth(const grpc::CallbackServerContext* ctx) const;
  // Auth, then `f`, then Finish: the shape of every unary call.
  template <typename F>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* ctx, F&& f);
  // Validates `ref` (field names it in errors) and resolves it; NOT_FOUND names the job.
  grpc::Status FindJob(const v1::JobRef& ref, std::string_view field, int64_t* id) const;
  Job* FindLocked(int64_t id) const;  // mu_ held

  grpc::ServerWriteReactor<v1::PrecisionSchedule>* StartWatchSchedule(
      grpc::CallbackServerContext* ctx, const v1::WatchScheduleRequest& req);
  grpc::ServerWriteReactor<v1::StatsReport>* StartWatchJob(grpc::CallbackServerContext* ctx,
                                                           const v1::WatchJobRequest& req);
  grpc::ServerWriteReactor<v1::StatsReport>* StartJobHistory(grpc::CallbackServerContext* ctx,
                                                             const v1::JobHistoryRequest& req);

  // ---- the RPCs (each returns the status to finish with) ----
  grpc::Status RegisterJob(const v1::RegisterJobRequest& req, v1::RegisterJobResponse* resp);
  grpc::Status ReportStats(const v1::StatsReport& req, v1::ReportStatsResponse* resp);
  grpc::Status ListJobs(const v1::ListJobsRequest& req, v1::ListJobsResponse* resp);
  grpc::Status JobStatus(const v1::JobRef& req, v1::JobStatusResponse* resp);
  grpc::Status LayerStats(const v1::LayerStatsRequest& req, v1::LayerStatsResponse* resp);
  grpc::Status GetSchedule(const v1::GetScheduleRequest& req, v1::GetScheduleResponse* resp);
  grpc::Status SetSchedule(const v1::SetScheduleRequest& req, v1::SetScheduleResponse* resp);

  // A re-registration of job `id`: an empty study becomes the job's tag; another tag than the
  // job's is refused (FAILED_PRECONDITION). meta_mu_ held.
  grpc::Status KeepStudy(int64_t id, v1::RegisterJobRequest* req) const;
  void FillSummary(const Job& j, int64_t now_ms, v1::JobSummary* out) const;  // mu_ held
  void Register(StreamBase* s, int64_t job_id, int kind);                     // mu_ held
  void Unregister(StreamBase* s);

  Store* const store_;
  const CoordinatorOptions options_;
  std::unique_ptr<grpc::Service> worker_;
  std::unique_ptr<grpc::Service> operator_;

  std::mutex meta_mu_;     // serialises RegisterJob and SetSchedule (version numbers, names)
  mutable std::mutex mu_;  // guards everything below
  std::unordered_map<int64_t, std::unique_ptr<Job>> jobs_;
  std::unordered_map<std::string, int64_t> by_name_;
  std::set<StreamBase*> streams_;  // open streams, registered until their OnDone
  std::condition_variable streams_cv_;
  bool closing_ = false;
};

// Milliseconds since the Unix epoch (one definition for the launcher's programs).
using cpd::launcher::NowMs;

}  // namespace cpd::coordinator
