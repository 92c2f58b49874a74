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

// Whether a report measured a validation loss, perplexity or bits per byte: negative is "not
// measured", and so is 0, what a worker older than these fields sends. NaN and +inf (a model
// that diverged) are measurements, kept as they are.
inline bool Measured(double v) { return !(v <= 0); }

// What a job's evaluations measured, each figure as last measured (negative: none yet).
struct Evaluations {
  double train_accuracy = -1, test_accuracy = -1;
  double test_loss = -1, test_perplexity = -1, test_bits_per_byte = -1;
  // Takes the figures `r` measured. `newer`: r is newer than every report taken before (one as
  // it arrives) and replaces them; otherwise (reports read newest first) it only fills the
  // figures still missing.
  void Take(const v1::StatsReport& r, bool newer);
  // Every accuracy is known: older reports cannot change what a newest-first reading keeps.
  bool accuracies_known() const { return train_accuracy >= 0 && test_accuracy >= 0; }
};

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
  Evaluations evaluations;
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
