#include "runtime/control/job_control.h"

#include <unistd.h>

#include <cstring>
#include <nlohmann/json.hpp>

namespace cpd::runtime {

using nlohmann::json;

namespace {

// Every rank's host name and pid, gathered on every rank (for the coordinator's registration).
Result<std::vector<JobDescription::Worker>> GatherWorkers(comm::Communicator* comm) {
  constexpr size_t kHost = 120;
  std::vector<uint8_t> mine(kHost + sizeof(int64_t), 0);
  char host[kHost] = {};
  if (gethostname(host, kHost - 1) != 0) std::strcpy(host, "?");
  std::memcpy(mine.data(), host, kHost);
  const int64_t pid = getpid();
  std::memcpy(mine.data() + kHost, &pid, sizeof pid);
  std::vector<uint8_t> all(mine.size() * size_t(comm->size()));
  CPD_RETURN_IF_ERROR(comm->AllGatherBytes(mine.data(), all.data(), mine.size()));
  std::vector<JobDescription::Worker> out;
  for (int r = 0; r < comm->size(); ++r) {
    const uint8_t* rec = all.data() + size_t(r) * mine.size();
    JobDescription::Worker w;
    w.rank = r;
    w.host.assign(reinterpret_cast<const char*>(rec),
                  strnlen(reinterpret_cast<const char*>(rec), kHost));
    std::memcpy(&w.pid, rec + kHost, sizeof w.pid);
    out.push_back(w);
  }
  return out;
}

}  // namespace

std::vector<JobDescription::LayerInfo> LayerInfos(const std::vector<Layer*>& flattened) {
  std::vector<JobDescription::LayerInfo> out;
  for (Layer* l : flattened) {
    if (l->Flatten().size() != 1) continue;  // composites: their children are listed
    JobDescription::LayerInfo info;
    info.name = l->name();
    info.kind = l->kind();
    info.quantizable = l->Quantizable();
    for (Param* p : l->Params()) info.params += int64_t(p->value.numel());
    out.push_back(info);
  }
  return out;
}

Result<std::unique_ptr<JobControl>> JobControl::Start(const CoordinatorOptions& options,
                                                      Setup setup, JobDescription job,
                                                      uint64_t version_in_force,
                                                      const std::string& recorded_schedule) {
  CPD_RETURN_IF_ERROR(CheckCoordinatorOptions(options));
  CPD_ASSIGN_OR_RETURN(job.workers, GatherWorkers(setup.comm));
  std::unique_ptr<JobControl> jc(new JobControl());
  jc->setup_ = std::move(setup);
  jc->lead_ = jc->setup_.comm->rank() == 0;
  jc->version_ = version_in_force;
  if (!recorded_schedule.empty()) {
    const json j = json::parse(recorded_schedule, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("precision")) {
      return Status::Corruption("the checkpoint's schedule is not {version, precision}");
    }
    CPD_RETURN_IF_ERROR(jc->Apply(j.value("version", uint64_t(0)), "checkpoint",
                                  j.at("precision").dump(), job.start_step, nullptr));
    job.schedule.precision = jc->setup_.quant->config();
    job.schedule.set_by = "checkpoint";
  }
  if (jc->lead_) {
    job.schedule.version = jc->version_;
    CPD_ASSIGN_OR_RETURN(jc->client_, CoordinatorClient::Start(options, std::move(job)));
  }
  jc->last_report_ = std::chrono::steady_clock::now();
  return jc;
}

JobControl::~JobControl() { Finish(0); }

Status JobControl::Apply(uint64_t version, const std::string& set_by,
                         const std::string& precision_json, int64_t step,
                         std::vector<std::string>* messages) {
  auto config = PrecisionConfigFromJson(precision_json);
  Status s = config.status();
  if (s.ok()) {
    PrecisionConfig& c = config.value();
    c.seed = setup_.seed;
    if (c.cpt) c.cpt->total_iters = setup_.total_steps;
    if (setup_.check) s = setup_.check(c);
    if (s.ok()) s = setup_.quant->Reconfigure(c);
  }
  if (!s.ok()) {
    if (messages) {
      messages->push_back("step " + std::to_string(step) + ": schedule v" +
                          std::to_string(version) +
                          " refused, the previous one stays: " + s.message());
    }
    if (setup_.log) {
      setup_.log({{"type", "schedule_refused"},
                  {"step", step},
                  {"version", version},
                  {"reason", s.message()}});
    }
    return s;
  }
  setup_.quant->InstallHooks(setup_.quant_layers);
  version_ = version;
  if (messages) {
    messages->push_back("step " + std::to_string(step) + ": schedule v" + std::to_string(version) +
                        (set_by.empty() ? "" : " (" + set_by + ")") +
                        " in force: " + DescribePrecision(setup_.quant->config()));
  }
  if (setup_.log) {
    setup_.log({{"type", "schedule"},
                {"step", step},
                {"version", version},
                {"set_by", set_by},
                {"precision", json::parse(PrecisionConfigToJson(setup_.quant->config()))}});
  }
  if (client_) {
    ScheduleUpdate in_force;
    in_force.version = version;
    in_force.effective_from_step = step;
    in_force.precision = setup_.quant->config();
    in_force.set_by = set_by;
    client_->SetScheduleInForce(in_force);
  }
  return Status::Ok();
}

Status JobControl::BeforeStep(int64_t step, bool* switched, std::vector<std::string>* messages) {
  *switched = false;
  std::string payload;
  if (lead_) {
    for (std::string& e : client_->TakeEvents()) messages->push_back(std::move(e));
    if (auto update = client_->TakeSchedule()) pending_ = std::move(update);
    if (pending_ && pending_->effective_from_step <= step) {
      payload = json({{"version", pending_->version},
                      {"set_by", pending_->set_by},
                      {"precision", json::parse(PrecisionConfigToJson(pending_->precision))}})
                    .dump();
      pending_.reset();
    }
  }
  comm::Communicator* comm = setup_.comm;
  if (comm->size() > 1) {
    uint64_t size = payload.size();
    uint8_t size_bytes[sizeof size];
    std::memcpy(size_bytes, &size, sizeof size);
    CPD_RETURN_IF_ERROR(comm->BroadcastBytes(size_bytes, sizeof size, 0));
    std::memcpy(&size, size_bytes, sizeof size);
    if (size > 0) {
      payload.resize(size);
      CPD_RETURN_IF_ERROR(
          comm->BroadcastBytes(reinterpret_cast<uint8_t*>(payload.data()), size, 0));
    }
  }
  if (payload.empty()) return Status::Ok();
  const json j = json::parse(payload, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return Status::Internal("schedule broadcast: not JSON");
  // A refusal is the same on every rank (same model, same JSON): the job goes on.
  *switched = Apply(j.value("version", uint64_t(0)), j.value("set_by", ""),
                    j.at("precision").dump(), step, lead_ ? messages : nullptr)
                  .ok();
  return Status::Ok();
}

std::string JobControl::ScheduleJson() const {
  return json({{"version", version_},
               {"precision", json::parse(PrecisionConfigToJson(setup_.quant->config()))}})
      .dump();
}

void JobControl::Report(StepReport report) {
  if (!client_) return;
  report.schedule_version = version_;
  client_->Report(std::move(report));
  last_report_ = std::chrono::steady_clock::now();
}

bool JobControl::SummaryDue() const {
  return lead_ &&
         std::chrono::duration<double>(std::chrono::steady_clock::now() - last_report_).count() >=
             setup_.report_interval_s;
}

void JobControl::Finish(int max_wait_ms) {
  if (client_) client_->Finish(max_wait_ms);
}

}  // namespace cpd::runtime
