#include "runtime/control/coordinator_client.h"

#include "cpd/config.h"
#include "cpd/tag.h"

#if CPD_WITH_GRPC
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "proto/cpd/v1/coordinator.grpc.pb.h"
#endif

namespace cpd::runtime {

Status CheckCoordinatorOptions(const CoordinatorOptions& o) {
#if !CPD_WITH_GRPC
  return Status::Unavailable(
      "--coordinator: this build has no gRPC (CPD_WITH_GRPC=OFF); install libgrpc++-dev "
      "protobuf-compiler-grpc and rebuild");
#endif
  if (o.address.empty()) return Status::InvalidArgument("--coordinator: empty address");
  if (!IsTag(o.job_name, kMaxJobNameLength)) {
    return Status::InvalidArgument("--job-name '" + o.job_name + "': use 1 to " +
                                   std::to_string(kMaxJobNameLength) + " of " + kTagCharacters);
  }
  if (!o.study.empty() && !IsTag(o.study, kMaxStudyNameLength)) {
    return Status::InvalidArgument("--study '" + o.study + "': use 1 to " +
                                   std::to_string(kMaxStudyNameLength) + " of " + kTagCharacters);
  }
  if (o.queue_capacity < 1) return Status::InvalidArgument("coordinator queue capacity < 1");
  if (o.rpc_timeout_ms < 1 || o.backoff_max_ms < 1) {
    return Status::InvalidArgument("coordinator timeouts must be positive");
  }
  return Status::Ok();
}

#if CPD_WITH_GRPC

namespace {

namespace v1 = ::cpd::v1;
using Clock = std::chrono::steady_clock;

v1::Site SiteToProto(Site s) {
  switch (s) {
    case Site::kWeight:
      return v1::SITE_W;
    case Site::kActivation:
      return v1::SITE_A;
    case Site::kError:
      return v1::SITE_E;
    case Site::kWeightGrad:
      return v1::SITE_G;
  }
  return v1::SITE_UNSPECIFIED;
}

v1::Site SiteNameToProto(const std::string& s) {
  if (s == "comm") return v1::SITE_COMM;
  auto site = ParseSite(s);
  return site.ok() ? SiteToProto(*site) : v1::SITE_UNSPECIFIED;
}

Result<Site> SiteFromProto(v1::Site s) {
  switch (s) {
    case v1::SITE_W:
      return Site::kWeight;
    case v1::SITE_A:
      return Site::kActivation;
    case v1::SITE_E:
      return Site::kError;
    case v1::SITE_G:
      return Site::kWeightGrad;
    default:
      return Status::InvalidArgument("schedule: site " + v1::Site_Name(s) +
                                     " has no format (accepted: W, A, E, G)");
  }
}

void ScheduleToProto(const ScheduleUpdate& u, v1::PrecisionSchedule* out) {
  const PrecisionConfig& c = u.precision;
  out->set_version(u.version);
  out->set_effective_from_step(u.effective_from_step);
  for (int i = 0; i < kNumSites; ++i) {
    if (c.global[i].spec == "fp32" && c.global[i].rounding == Rounding::kNearest) continue;
    v1::SiteFormat* f = out->add_formats();
    f->set_site(SiteToProto(Site(i)));
    f->set_spec(c.global[i].spec);
    f->set_rounding(RoundingName(c.global[i].rounding));
  }
  if (c.cpt) {
    out->mutable_cyclic()->set_min_bits(c.cpt->min_bits);
    out->mutable_cyclic()->set_max_bits(c.cpt->max_bits);
    out->mutable_cyclic()->set_periods(c.cpt->periods);
  }
  out->set_grad_bits(c.grad_bits);
  for (const auto& [layer, by_site] : c.overrides) {
    for (const auto& [site, spec] : by_site) {
      v1::LayerOverride* o = out->add_overrides();
      o->set_layer(layer);
      o->set_site(SiteToProto(site));
      o->set_spec(spec);
    }
  }
  for (const std::string& k : c.keep_fp32) out->add_keep_fp32(k);
  for (const auto& [layer, spec] : c.allreduce_layers) {
    v1::AllReduceLayerFormat* a = out->add_allreduce_layers();
    a->set_layer(layer);
    a->set_spec(spec);
  }
  out->set_hysteresis(c.hysteresis);
  out->set_set_by(u.set_by);
}

Result<ScheduleUpdate> ScheduleFromProto(const v1::PrecisionSchedule& p) {
  ScheduleUpdate u;
  u.version = p.version();
  u.effective_from_step = p.effective_from_step();
  u.set_by = p.set_by();
  PrecisionConfig& c = u.precision;
  for (const v1::SiteFormat& f : p.formats()) {
    CPD_ASSIGN_OR_RETURN(const Site site, SiteFromProto(f.site()));
    CPD_ASSIGN_OR_RETURN(const Format fmt, Format::Parse(f.spec()));
    CPD_ASSIGN_OR_RETURN(const Rounding r,
                         ParseRounding(f.rounding().empty() ? "nearest" : f.rounding()));
    c.global[int(site)] = {fmt.spec(), r};
  }
  if (p.has_cyclic()) {
    CyclicPrecision cpt;
    cpt.min_bits = p.cyclic().min_bits();
    cpt.max_bits = p.cyclic().max_bits();
    cpt.periods = p.cyclic().periods();
    CPD_RETURN_IF_ERROR(cpt.Validate());
    c.cpt = cpt;
  }
  c.grad_bits = p.grad_bits() == 0 ? 8 : p.grad_bits();
  for (const v1::LayerOverride& o : p.overrides()) {
    CPD_ASSIGN_OR_RETURN(const Site site, SiteFromProto(o.site()));
    CPD_ASSIGN_OR_RETURN(const Format fmt, Format::Parse(o.spec()));
    c.overrides[o.layer()][site] = fmt.spec();
  }
  c.keep_fp32.assign(p.keep_fp32().begin(), p.keep_fp32().end());
  for (const v1::AllReduceLayerFormat& a : p.allreduce_layers()) {
    CPD_RETURN_IF_ERROR(AddAllReduceLayerFormat(a.layer() + "=" + a.spec(), &c));
  }
  c.hysteresis = p.hysteresis();
  return u;
}

void ReportToProto(const StepReport& r, int64_t job_id, uint64_t dropped, v1::StatsReport* out) {
  out->set_job_id(job_id);
  out->set_rank(0);
  out->set_step(r.step);
  out->set_epoch(r.epoch);
  out->set_loss(r.loss);
  out->set_lr(r.lr);
  out->set_bits(r.bits);
  out->set_schedule_version(r.schedule_version);
  out->set_images_per_s(r.images_per_s);
  out->set_ranks_alive(r.ranks_alive);
  out->set_skipped_steps(r.skipped_steps);
  out->set_dropped_reports(dropped);
  out->set_train_accuracy(r.train_accuracy);
  out->set_test_accuracy(r.test_accuracy);
  out->set_test_loss(r.test_loss);
  out->set_test_perplexity(r.test_perplexity);
  out->set_test_bits_per_byte(r.test_bits_per_byte);
  out->set_finished(r.finished);
  out->set_time_ms(r.time_ms);
  for (const LayerReport& l : r.layers) {
    v1::LayerStat* s = out->add_layers();
    s->set_layer(l.layer);
    s->set_site(SiteNameToProto(l.site));
    s->set_format(l.format);
    s->set_bits(l.bits);
    s->set_aps_shift(l.aps_shift);
    s->set_max_abs(l.max_abs);
    s->set_saturated(l.saturated);
    s->set_flushed(l.flushed);
    s->set_rel_error(l.rel_error);
    s->set_flips(l.flips);
    s->set_nonfinite(l.nonfinite);
  }
}

// Whether a failed call means the coordinator (or our registration with it) is gone, so that
// the client must reconnect and register again; otherwise the report itself was refused.
bool SessionLost(grpc::StatusCode c) {
  return c == grpc::StatusCode::UNAVAILABLE || c == grpc::StatusCode::DEADLINE_EXCEEDED ||
         c == grpc::StatusCode::NOT_FOUND || c == grpc::StatusCode::UNAUTHENTICATED ||
         c == grpc::StatusCode::CANCELLED || c == grpc::StatusCode::UNKNOWN ||
         c == grpc::StatusCode::INTERNAL;
}

// How the event line names a failed registration (each is retried all the same).
const char* RegisterFailure(grpc::StatusCode c) {
  if (c == grpc::StatusCode::UNAUTHENTICATED) return "the coordinator refused the token";
  // e.g. a resumed run whose --study is not the job's: the coordinator is there and said why.
  if (c == grpc::StatusCode::INVALID_ARGUMENT || c == grpc::StatusCode::FAILED_PRECONDITION) {
    return "the coordinator refused the registration";
  }
  return "coordinator unreachable";
}

class GrpcCoordinatorClient final : public CoordinatorClient {
 public:
  GrpcCoordinatorClient(CoordinatorOptions o, JobDescription job)
      : o_(std::move(o)), job_(std::move(job)) {
    in_force_ = job_.schedule;
    grpc::ChannelArguments args;
    // Reconnect quickly once the coordinator is back (gRPC's default backoff grows to 120 s).
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, std::min(o_.backoff_max_ms, 1000));
    std::shared_ptr<grpc::ChannelCredentials> creds;
    if (o_.tls_ca_pem.empty()) {
      creds = grpc::InsecureChannelCredentials();
    } else {
      grpc::SslCredentialsOptions ssl;
      ssl.pem_root_certs = o_.tls_ca_pem;
      creds = grpc::SslCredentials(ssl);
    }
    stub_ = v1::WorkerService::NewStub(grpc::CreateCustomChannel(o_.address, creds, args));
    session_ = std::thread([this] { SessionLoop(); });
  }

  ~GrpcCoordinatorClient() override { Finish(0); }

  bool Report(StepReport report) override {
    if (report.time_ms == 0) {
      report.time_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count();
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || queue_.size() >= o_.queue_capacity) {
      ++dropped_;
      return false;
    }
    queue_.push_back(std::move(report));
    cv_.notify_all();
    return true;
  }

  std::optional<ScheduleUpdate> TakeSchedule() override {
    std::lock_guard<std::mutex> lock(mu_);
    std::optional<ScheduleUpdate> out;
    out.swap(pending_);
    return out;
  }

  void SetScheduleInForce(const ScheduleUpdate& schedule) override {
    std::lock_guard<std::mutex> lock(mu_);
    in_force_ = schedule;
  }

  std::vector<std::string> TakeEvents() override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> out;
    out.swap(events_);
    return out;
  }

  void Finish(int max_wait_ms) override {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (finished_) return;
      finished_ = true;
      // Let the sender drain the queue (reconnecting if it must) for at most max_wait_ms.
      cv_.notify_all();
      cv_.wait_for(lock, std::chrono::milliseconds(max_wait_ms), [this] { return queue_.empty(); });
      stopping_ = true;
      if (watch_ctx_) watch_ctx_->TryCancel();
      if (unary_ctx_) unary_ctx_->TryCancel();
      cv_.notify_all();
    }
    if (session_.joinable()) session_.join();
  }

  uint64_t sent() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return sent_;
  }
  uint64_t dropped() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return dropped_;
  }
  int64_t job_id() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return job_id_;
  }

 private:
  void Event(std::string line) { events_.push_back(std::move(line)); }  // mu_ held

  // Sleeps up to `ms` or until stopping; returns false when stopping. Once Finish() waits for
  // the queue to drain, retries come every 100 ms (and Finish wakes a longer sleep).
  bool Backoff(int ms) {
    std::unique_lock<std::mutex> lock(mu_);
    const bool was_finishing = finished_;
    if (finished_) ms = std::min(ms, 100);
    cv_.wait_for(lock, std::chrono::milliseconds(ms),
                 [&] { return stopping_ || (finished_ && !was_finishing); });
    return !stopping_;
  }

  void Prepare(grpc::ClientContext* ctx, bool deadline) const {
    if (!o_.token.empty()) ctx->AddMetadata("authorization", "Bearer " + o_.token);
    if (deadline) {
      ctx->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::milliseconds(o_.rpc_timeout_ms));
    }
  }

  // Runs a unary call whose context Finish() may cancel (so that stopping never waits for a
  // deadline).
  template <typename F>
  grpc::Status Call(grpc::ClientContext* ctx, F&& call) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return grpc::Status(grpc::StatusCode::CANCELLED, "stopping");
      unary_ctx_ = ctx;
    }
    grpc::Status s = call();
    std::lock_guard<std::mutex> lock(mu_);
    unary_ctx_ = nullptr;
    return s;
  }

  grpc::Status Register() {
    v1::RegisterJobRequest req;
    req.set_job_name(o_.job_name);
    req.set_study(o_.study);
    req.set_world_size(job_.world_size);
    req.set_emulated_workers_per_rank(job_.emulate_ranks);
    for (const auto& w : job_.workers) {
      v1::WorkerInfo* wi = req.add_workers();
      wi->set_rank(w.rank);
      wi->set_host(w.host);
      wi->set_pid(w.pid);
    }
    for (const auto& l : job_.layers) {
      v1::LayerInfo* li = req.add_layers();
      li->set_name(l.name);
      li->set_kind(l.kind);
      li->set_quantizable(l.quantizable);
      li->set_params(l.params);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      ScheduleToProto(in_force_, req.mutable_schedule());
      req.set_start_step(last_step_ > 0 ? last_step_ : job_.start_step);
    }
    req.set_arch(job_.arch);
    req.set_dataset(job_.dataset);
    req.set_total_steps(job_.total_steps);
    req.set_epochs(job_.epochs);
    req.set_allreduce(job_.allreduce);
    v1::RegisterJobResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx, true);
    grpc::Status s = Call(&ctx, [&] { return stub_->RegisterJob(&ctx, req, &resp); });
    if (!s.ok()) return s;
    auto update = ScheduleFromProto(resp.schedule());
    std::lock_guard<std::mutex> lock(mu_);
    job_id_ = resp.job_id();
    registered_ = true;
    watched_version_ = resp.schedule().version();
    const bool first = !ever_registered_;
    ever_registered_ = true;
    Event(std::string(first ? "registered" : "re-registered") + " job '" + o_.job_name +
          "' as id " + std::to_string(job_id_) + " with the coordinator at " + o_.address +
          " (schedule v" + std::to_string(resp.schedule().version()) + ")");
    if (!update.ok()) {
      Event("the coordinator's schedule v" + std::to_string(resp.schedule().version()) +
            " cannot be applied: " + update.status().message());
    } else if (resp.existed() && update->version != in_force_.version) {
      // A known job (a resumed run, or a coordinator that kept it): its current schedule wins.
      pending_ = *update;
    }
    return s;
  }

  // Reads the schedule stream until it ends; returns when the stream breaks or we stop.
  void WatchLoop(grpc::ClientContext* ctx, uint64_t after_version) {
    v1::WatchScheduleRequest req;
    {
      std::lock_guard<std::mutex> lock(mu_);
      req.set_job_id(job_id_);
    }
    req.set_after_version(after_version);
    std::unique_ptr<grpc::ClientReader<v1::PrecisionSchedule>> reader =
        stub_->WatchSchedule(ctx, req);
    v1::PrecisionSchedule sched;
    while (reader->Read(&sched)) {
      auto update = ScheduleFromProto(sched);
      std::lock_guard<std::mutex> lock(mu_);
      watched_version_ = std::max(watched_version_, sched.version());
      if (!update.ok()) {
        Event("schedule v" + std::to_string(sched.version()) +
              " from the coordinator ignored: " + update.status().message());
      } else {
        pending_ = *update;  // a newer schedule supersedes one not yet taken
      }
    }
    const grpc::Status s = reader->Finish();
    std::lock_guard<std::mutex> lock(mu_);
    watch_broken_ = true;
    if (!stopping_) watch_error_ = s.error_message();
    cv_.notify_all();
  }

  // Sends queued reports until the session breaks or we stop. Returns the error that broke it.
  std::string SendLoop() {
    while (true) {
      StepReport report;
      int64_t job_id;
      uint64_t dropped;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stopping_ || watch_broken_ || !queue_.empty(); });
        if (stopping_) return "";
        if (watch_broken_) return "schedule stream ended: " + watch_error_;
        report = queue_.front();
        job_id = job_id_;
        dropped = dropped_;
      }
      v1::StatsReport req;
      ReportToProto(report, job_id, dropped, &req);
      v1::ReportStatsResponse resp;
      grpc::ClientContext ctx;
      Prepare(&ctx, true);
      const grpc::Status s = Call(&ctx, [&] { return stub_->ReportStats(&ctx, req, &resp); });
      {
        std::lock_guard<std::mutex> lock(mu_);
        last_step_ = std::max(last_step_, report.step);
        if (s.ok()) {
          queue_.pop_front();
          ++sent_;
          cv_.notify_all();
          continue;
        }
        if (SessionLost(s.error_code())) return s.error_message();
        if (s.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) {
          // The coordinator refused this report (e.g. INVALID_ARGUMENT): drop it, say so.
          queue_.pop_front();
          ++dropped_;
          Event("the coordinator refused a report at step " + std::to_string(report.step) + ": " +
                s.error_message());
          continue;
        }
      }
      // The coordinator sheds load: keep the report and retry after a pause.
      if (!Backoff(200)) return "";
    }
  }

  void SessionLoop() {
    int backoff = 100;
    bool said_unreachable = false;
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stopping_) return;
      }
      const grpc::Status reg = Register();
      if (!reg.ok()) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (!said_unreachable) {
            Event(std::string(RegisterFailure(reg.error_code())) + " at " + o_.address + " (" +
                  reg.error_message() + "); training goes on with the schedule in force, retrying");
            said_unreachable = true;
          }
        }
        if (!Backoff(backoff)) return;
        backoff = std::min(backoff * 2, o_.backoff_max_ms);
        continue;
      }
      backoff = 100;
      said_unreachable = false;
      grpc::ClientContext watch_ctx;
      Prepare(&watch_ctx, /*deadline=*/false);
      uint64_t after;
      {
        std::lock_guard<std::mutex> lock(mu_);
        watch_broken_ = false;
        watch_error_.clear();
        watch_ctx_ = &watch_ctx;
        after = watched_version_;
        if (stopping_) watch_ctx.TryCancel();
      }
      std::thread watcher([this, &watch_ctx, after] { WatchLoop(&watch_ctx, after); });
      const std::string lost = SendLoop();
      {
        std::lock_guard<std::mutex> lock(mu_);
        registered_ = false;
        watch_ctx.TryCancel();
        cv_.notify_all();
      }
      watcher.join();
      {
        std::lock_guard<std::mutex> lock(mu_);
        watch_ctx_ = nullptr;
        if (stopping_) return;
        Event("lost the coordinator at " + o_.address + " (" + lost +
              "); training goes on with the schedule in force, reconnecting");
        said_unreachable = true;
      }
      if (!Backoff(backoff)) return;
    }
  }

  const CoordinatorOptions o_;
  const JobDescription job_;
  std::unique_ptr<v1::WorkerService::Stub> stub_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<StepReport> queue_;
  std::optional<ScheduleUpdate> pending_;
  ScheduleUpdate in_force_;
  std::vector<std::string> events_;
  grpc::ClientContext* watch_ctx_ = nullptr;  // the open schedule stream's, to cancel it
  grpc::ClientContext* unary_ctx_ = nullptr;  // the unary call in flight, to cancel it
  bool watch_broken_ = false;
  std::string watch_error_;
  bool registered_ = false, ever_registered_ = false;
  bool finished_ = false, stopping_ = false;
  uint64_t watched_version_ = 0;
  uint64_t sent_ = 0, dropped_ = 0;
  int64_t job_id_ = 0, last_step_ = 0;
  std::thread session_;
};

}  // namespace

Result<std::unique_ptr<CoordinatorClient>> CoordinatorClient::Start(CoordinatorOptions options,
                                                                    JobDescription job) {
  CPD_RETURN_IF_ERROR(CheckCoordinatorOptions(options));
  return std::unique_ptr<CoordinatorClient>(
      new GrpcCoordinatorClient(std::move(options), std::move(job)));
}

#else  // !CPD_WITH_GRPC

Result<std::unique_ptr<CoordinatorClient>> CoordinatorClient::Start(CoordinatorOptions options,
                                                                    JobDescription) {
  return CheckCoordinatorOptions(options);
}

#endif  // CPD_WITH_GRPC

}  // namespace cpd::runtime
