// What the coordinator's source files share and its users do not see: the in-memory job, the
// shape of a unary call and the translation of errors into gRPC statuses. Include only from
// launcher/coordinator/*.cc.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cpd/status.h"
#include "launcher/coordinator/service.h"
#include "proto/cpd/v1/coordinator.pb.h"

namespace cpd::coordinator {

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
  // The latest report's epoch and loss, kept apart so that ListJobs does not parse reports.
  int32_t latest_epoch = 0;
  double latest_loss = 0;
  int64_t last_report_ms = 0;  // coordinator clock; 0: none
  bool finished = false;
  double train_accuracy = -1, test_accuracy = -1;
  std::vector<ScheduleStream*> schedule_watchers;
  std::vector<JobStream*> job_watchers;
};

template <typename F>
grpc::ServerUnaryReactor* Coordinator::Unary(grpc::CallbackServerContext* ctx, F&& f) {
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  grpc::Status s = CheckAuth(ctx);
  if (s.ok()) s = f();
  r->Finish(s);
  return r;
}

grpc::Status ToGrpc(const Status& s);
grpc::Status Invalid(std::string msg);  // INVALID_ARGUMENT
// What streams and calls get once CloseStreams() ran.
extern const grpc::Status kShuttingDown;

// The registration as kept in memory: no workers, layers or schedule (those live in the store).
v1::RegisterJobRequest Meta(const v1::RegisterJobRequest& r);
// "job ID ('NAME')", as error messages name a job.
std::string JobLabel(int64_t id, const std::string& name);

}  // namespace cpd::coordinator
