// The worker's side of the coordinator (gRPC service cpd.v1, proto/cpd/v1/coordinator.proto).
//
// Rank 0 of a job starts one CoordinatorClient. In the background it registers the job, keeps a
// WatchSchedule stream open and sends statistics reports; the trainer never waits on it:
//  * Report() only queues (a bounded queue; a full queue drops the report and counts it, and
//    the count travels with the next report that gets through);
//  * TakeSchedule() hands over the newest schedule the coordinator pushed, if any;
//  * when the coordinator is unreachable or goes away, the job goes on with the schedule in
//    force; the client retries with exponential backoff (100 ms doubling to backoff_max_ms),
//    re-registers (a coordinator that lost the job learns it again, with the schedule the job
//    now runs) and resends what is queued;
//  * Finish() gives the queue a bounded time to drain, reconnecting meanwhile if it must.
// This header has no gRPC types, so the trainer does not depend on gRPC; in a build without
// gRPC (CPD_WITH_GRPC=0) Start() returns Unavailable.
//
// Thread-safety: every public method may be called from any one thread while the background
// threads run; it is meant for the trainer's thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cpd/status.h"
#include "runtime/nn/quant_sites.h"

namespace cpd::runtime {

struct CoordinatorOptions {
  std::string address;           // HOST:PORT; REQUIRED
  std::string token;             // sent as "authorization: Bearer <token>" when not empty
  std::string tls_ca_pem;        // PEM root certificates: TLS when not empty, plaintext otherwise
  std::string job_name;          // REQUIRED: [A-Za-z0-9._-]{1,128}
  std::string study;             // the job's study, [A-Za-z0-9._-]{1,64}; empty: none
  size_t queue_capacity = 1024;  // reports held while the coordinator is slow or away
  int rpc_timeout_ms = 5000;     // deadline of each unary call
  int backoff_max_ms = 2000;     // reconnect backoff cap
};

// OK, or why these options cannot work: an empty address, a bad job name or study, non-positive
// limits, or a build without gRPC (Unavailable).
Status CheckCoordinatorOptions(const CoordinatorOptions& options);

// A schedule as the trainer applies it. `precision` carries everything but the run's seed and
// CPT's total_iters, which the trainer fills in.
struct ScheduleUpdate {
  uint64_t version = 0;
  int64_t effective_from_step = 0;
  PrecisionConfig precision;
  std::string set_by;
};

// What rank 0 tells the coordinator about its job when it registers.
struct JobDescription {
  struct Worker {
    int rank = 0;
    std::string host;
    int64_t pid = 0;
  };
  struct LayerInfo {
    std::string name, kind;
    bool quantizable = false;
    int64_t params = 0;
  };
  std::string arch, dataset, allreduce;
  int world_size = 1, emulate_ranks = 1, epochs = 0;
  int64_t total_steps = 0, start_step = 0;
  std::vector<Worker> workers;
  std::vector<LayerInfo> layers;
  ScheduleUpdate schedule;  // the schedule the job starts with (its version is ignored)
};

// One layer and site of a statistics report. site: "W", "A", "E", "G" or "comm" (the layer's
// gradient in the all-reduce: aps_shift is meaningful there).
struct LayerReport {
  std::string layer, site, format;
  int bits = 0;  // storage bits of the format, 0 when not quantised (fp32)
  int aps_shift = 0;
  double max_abs = 0, saturated = 0, flushed = 0;
  double rel_error = -1;  // < 0: not measured
  uint64_t flips = 0, nonfinite = 0;
};

struct StepReport {
  int64_t step = 0;
  int epoch = 0;
  double loss = 0, lr = 0;
  int bits = 0;  // CPT forward bits in force (0 without CPT)
  uint64_t schedule_version = 0;
  double images_per_s = 0;
  int ranks_alive = 0;
  uint64_t skipped_steps = 0;
  double train_accuracy = -1, test_accuracy = -1;  // end of an epoch; < 0: not measured
  // End of an evaluated epoch: the validation loss, and a language model's perplexity
  // exp(test_loss) and (byte-level text) bits per byte test_loss / ln 2; < 0: not measured.
  double test_loss = -1, test_perplexity = -1, test_bits_per_byte = -1;
  std::vector<LayerReport> layers;
  bool finished = false;  // the run's last report
  // When the report was made: wall-clock ms since the Unix epoch. Report() stamps a report that
  // has none (0), so that reports queued through an outage keep the times they were made at.
  int64_t time_ms = 0;
};

class CoordinatorClient {
 public:
  // Checks the options and starts the background threads; does not wait for the coordinator.
  static Result<std::unique_ptr<CoordinatorClient>> Start(CoordinatorOptions options,
                                                          JobDescription job);
  virtual ~CoordinatorClient() = default;

  // Queues a report (stamping its time_ms when 0); false when the queue was full (the report is
  // dropped and counted).
  virtual bool Report(StepReport report) = 0;
  // The newest schedule pushed since the last call (older unread ones are superseded).
  virtual std::optional<ScheduleUpdate> TakeSchedule() = 0;
  // What the job runs now (sent when the client has to register again).
  virtual void SetScheduleInForce(const ScheduleUpdate& schedule) = 0;
  // Lines worth showing the user ("registered job ...", "coordinator unreachable ..."), once each.
  virtual std::vector<std::string> TakeEvents() = 0;
  // Sends what is queued for at most max_wait_ms, then stops the background threads. Idempotent.
  virtual void Finish(int max_wait_ms) = 0;

  virtual uint64_t sent() const = 0;
  virtual uint64_t dropped() const = 0;
  virtual int64_t job_id() const = 0;  // 0 until registered
};

}  // namespace cpd::runtime
