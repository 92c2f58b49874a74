// The trainer's side of the control plane: schedules pushed by the coordinator take effect on
// every rank at the same step, and rank 0 reports what the job does.
//
// Rank 0 owns the CoordinatorClient. Before each step every rank calls BeforeStep(): rank 0
// takes the newest schedule the coordinator pushed, holds it until its effective_from_step, and
// broadcasts it (as JSON) to all ranks in the same step, so that all of them reconfigure their
// SiteQuantizer before the same forward pass. The broadcast of "nothing new" costs one 8-byte
// collective per step. A schedule the model cannot take (an override naming an unknown layer)
// is refused on every rank alike and the previous one stays in force.
//
// Not thread-safe: the trainer's thread drives it; the client's threads stay inside the client.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "cpd/status.h"
#include "runtime/control/coordinator_client.h"
#include "runtime/nn/layer.h"
#include "runtime/nn/quant_sites.h"

namespace cpd::runtime {

class JobControl {
 public:
  struct Setup {
    comm::Communicator* comm = nullptr;  // REQUIRED; the job's ranks
    SiteQuantizer* quant = nullptr;      // REQUIRED; reconfigured on a schedule switch
    std::vector<Layer*> quant_layers;    // hooks re-installed on a switch
    int64_t total_steps = 1;             // CPT's horizon for pushed cyclic schedules
    uint64_t seed = 0;                   // the run's stochastic-rounding seed (kept on a switch)
    double report_interval_s = 1.0;      // summary reports at least this often (rank 0)
    // Optional: whether the rest of the trainer can take a schedule (the per-layer all-reduce
    // formats); an error refuses it as an unknown override does.
    std::function<Status(const PrecisionConfig&)> check;
    // Writes one metrics record (every rank that keeps metrics).
    std::function<void(const nlohmann::json& record)> log;
  };

  // Every rank calls it with the same options (a collective: the ranks' hosts and pids are
  // gathered into job.workers). Rank 0 starts the client (which connects in the background);
  // `job` describes the job for registration (rank 0's is used).
  // `version_in_force`: the version of the quantiser's current policy (1 for the command line's).
  // `recorded_schedule` (ScheduleJson() of a checkpoint, or ""): applied first, so that a resumed
  // run goes on with the schedule it had and registers with it.
  static Result<std::unique_ptr<JobControl>> Start(const CoordinatorOptions& options, Setup setup,
                                                   JobDescription job, uint64_t version_in_force,
                                                   const std::string& recorded_schedule = "");
  ~JobControl();

  // Every rank, before step `step`: applies the schedule due at this step, if any (a
  // collective). On a switch *switched is set, and `messages` gets a line for the user (rank 0);
  // client events (connected, unreachable, ...) are appended to `messages` as well.
  Status BeforeStep(int64_t step, bool* switched, std::vector<std::string>* messages);

  // The schedule in force: {"version": V, "precision": {...}}.
  std::string ScheduleJson() const;
  uint64_t version() const { return version_; }

  // Rank 0: queues a report (elsewhere: nothing). Never blocks.
  void Report(StepReport report);
  // Whether report_interval_s has passed since the last report.
  bool SummaryDue() const;
  // Rank 0: sends what is queued (at most max_wait_ms) and disconnects.
  void Finish(int max_wait_ms);

 private:
  JobControl() = default;
  // Reconfigures the quantiser from a PrecisionConfig JSON; false (and a message) if refused.
  Status Apply(uint64_t version, const std::string& set_by, const std::string& precision_json,
               int64_t step, std::vector<std::string>* messages);

  Setup setup_;
  bool lead_ = false;
  std::unique_ptr<CoordinatorClient> client_;
  std::optional<ScheduleUpdate> pending_;  // rank 0: taken from the client, not yet due
  uint64_t version_ = 0;
  std::chrono::steady_clock::time_point last_report_{};
};

// The leaf layers of a model (its Flatten(): composites are left out, their children listed) as
// the coordinator lists them.
std::vector<JobDescription::LayerInfo> LayerInfos(const std::vector<Layer*>& flattened);

}  // namespace cpd::runtime
