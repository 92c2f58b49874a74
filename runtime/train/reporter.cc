#include "runtime/train/reporter.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "cpd/format.h"

namespace cpd::runtime {

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

json StatsJson(const std::vector<SiteRecord>& records) {
  json layers = json::array();
  for (const SiteRecord& r : records) {
    const double n = r.stats.count > 0 ? double(r.stats.count) : 1.0;
    layers.push_back({{"layer", r.layer},
                      {"site", SiteName(r.site)},
                      {"format", r.format},
                      {"max_abs", r.stats.max_abs},
                      {"saturated", double(r.stats.saturated) / n},
                      {"flushed", double(r.stats.flushed) / n},
                      {"nonfinite", r.stats.nonfinite},
                      {"rel_error", r.stats.relative_error()}});
  }
  return layers;
}

json CommStatsJson(const std::vector<comm::LayerCommStats>& stats) {
  json layers = json::array();
  for (const auto& s : stats) {
    json j = {{"layer", s.layer},     {"format", s.format},   {"shift", s.shift},
              {"max_abs", s.max_abs}, {"flushed", s.flushed}, {"saturated", s.saturated}};
    if (s.rel_error >= 0) j["rel_error"] = s.rel_error;
    layers.push_back(j);
  }
  return layers;
}

// The gradient format on the wire: fp32 for the backend's all-reduce.
std::string AllReduceFormat(const comm::GradientAllReduceOptions& ar) {
  return ar.algo == comm::AllReduceAlgo::kFp32 ? "fp32" : ar.format;
}

// Storage bits of a format spec (0 for fp32, which is not quantised).
int FormatBits(const std::string& spec) {
  if (spec == "fp32") return 0;
  auto f = Format::Parse(spec);
  return f.ok() ? f->bits() : 0;
}

// The per-layer rows of a coordinator report: the quantisation sites (reduced over the ranks),
// weight flips since the last report, and the all-reduce's per-layer statistics, each with its
// layer's all-reduce format (hybrid precision).
std::vector<LayerReport> LayerReports(const std::vector<SiteRecord>& records,
                                      const std::map<std::string, uint64_t>& flips,
                                      const std::vector<comm::LayerCommStats>& comm_stats) {
  std::vector<LayerReport> out;
  for (const SiteRecord& r : records) {
    const double n = r.stats.count > 0 ? double(r.stats.count) : 1.0;
    LayerReport l;
    l.layer = r.layer;
    l.site = SiteName(r.site);
    l.format = r.format;
    l.bits = FormatBits(r.format);
    l.max_abs = r.stats.max_abs;
    l.saturated = double(r.stats.saturated) / n;
    l.flushed = double(r.stats.flushed) / n;
    l.rel_error = r.stats.relative_error();
    l.nonfinite = r.stats.nonfinite;
    if (r.site == Site::kWeight) {
      auto f = flips.find(r.layer);
      if (f != flips.end()) l.flips = f->second;
    }
    out.push_back(l);
  }
  for (const auto& c : comm_stats) {
    LayerReport l;
    l.layer = c.layer;
    l.site = "comm";
    l.format = c.format;
    l.bits = FormatBits(c.format);
    l.aps_shift = c.shift;
    l.max_abs = c.max_abs;
    l.saturated = c.saturated;
    l.flushed = c.flushed;
    l.rel_error = c.rel_error;
    out.push_back(l);
  }
  return out;
}

// The progress display of stdout: --progress, with auto resolved for this process.
ProgressOptions ConsoleProgress(const ReporterOptions& o, bool quiet, bool language_model) {
  ProgressOptions p;
  p.mode = quiet ? ProgressMode::kOff : ResolveProgressMode(o.progress);
  p.interval_s = o.progress_interval_s;
  if (language_model) p.rate_unit = "tok/s";
  return p;
}

}  // namespace

Reporter::Reporter(const ReporterOptions& options, ReporterSetup setup)
    : setup_(setup),
      o_(options),
      quiet_(o_.quiet || setup.rank != 0),
      progress_(ConsoleProgress(o_, quiet_, setup.language_model)) {}

Result<std::unique_ptr<Reporter>> Reporter::Create(const ReporterOptions& options,
                                                   ReporterSetup setup) {
  std::unique_ptr<Reporter> r(new Reporter(options, setup));
  const std::string& requested = r->o_.metrics_out;
  if (requested.empty()) return r;
  std::string path = requested;
  const size_t at = path.find("{rank}");
  if (at != std::string::npos) path.replace(at, 6, std::to_string(setup.rank));
  if (at != std::string::npos || setup.rank == 0) {
    r->metrics_.open(path, std::ios::out | std::ios::app);
    if (!r->metrics_) return Status::IoError("--metrics-out: cannot open " + path + " for writing");
  }
  return r;
}

void Reporter::Say(const std::string& line) {
  if (quiet_) return;
  progress_.EndLine();
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

void Reporter::Log(const json& record) {
  if (!metrics_.is_open()) return;
  metrics_ << record.dump() << '\n';
  metrics_.flush();
}

void Reporter::Started(const RunStart& run) {
  json j = {{"type", "run"},
            {"step", run.step},
            {"arch", o_.arch},
            {"dataset", o_.dataset},
            {"classes", run.classes},
            {"ranks", setup_.world},
            {"workers", setup_.workers},
            {"global_batch", setup_.global_batch},
            {"epochs", o_.epochs},
            {"total_steps", run.total_steps},
            {"steps_per_epoch", setup_.batches_per_epoch},
            {"max_steps", o_.max_steps},
            {"seed", o_.seed},
            {"optimizer", OptimizerKindName(o_.optimizer)},
            {"lr", o_.lr},
            {"lr_scaling", LrScalingName(o_.lr_scaling)},
            {"lr_base_batch", o_.lr_base_batch},
            {"lr_effective", run.lr_effective},
            {"lr_schedule", LrScheduleName(o_.lr_schedule)},
            {"warmup_steps", run.warmup_steps},
            {"momentum", o_.momentum},
            {"weight_decay", o_.weight_decay},
            {"allreduce", comm::AllReduceAlgoName(o_.allreduce.algo)},
            {"allreduce_format", AllReduceFormat(o_.allreduce)},
            {"aps", o_.allreduce.aps},
            {"precision", run.precision},
            {"device", run.device}};
  if (!run.conv_algos.empty()) j["conv_algos"] = run.conv_algos;
  if (setup_.language_model) {
    j["vocab"] = run.classes;
    j["block_size"] = run.block_size;
    j["params"] = run.params;
    j["byte_level"] = setup_.byte_level;
    j["unigram_bits"] = run.unigram_bits;
  }
  if (o_.optimizer == OptimizerKind::kAdamW) {
    j["beta1"] = o_.beta1;
    j["beta2"] = o_.beta2;
    j["eps"] = o_.adam_eps;
  }
  if (o_.clip_grad_norm > 0) j["clip_grad_norm"] = o_.clip_grad_norm;
  if (o_.optimizer == OptimizerKind::kLars) {
    j["lars_eta"] = o_.lars_eta;
    j["lars_exclude"] = LarsExcludeName(o_.lars_exclude);
    if (o_.lars_exclude == LarsExclude::kBiasBn) {
      j["lars_excluded_lr_ratio"] = o_.lars_excluded_lr_ratio;
    }
  }
  if (o_.loss_scale.mode != LossScaleOptions::Mode::kOff) {
    j["loss_scale"] = DescribeLossScale(o_.loss_scale);
  }
  Log(j);
}

void Reporter::BeginEpoch(const EpochSums& carried) {
  epoch_start_ = Clock::now();
  sums_ = carried_ = carried;
}

void Reporter::StepSkipped(int64_t step, double scale_before, double scale_after) {
  ++skips_;
  const bool in_full = skips_ <= kSkipLinesInFull;
  if (!quiet_ && (in_full || skips_ % kSkipLineEvery == 0)) {
    std::string note;
    if (skips_ == kSkipLinesInFull) {
      note = " (from now on every " + std::to_string(kSkipLineEvery) + "th skip is shown)";
    } else if (!in_full) {
      note = " (" + std::to_string(skips_) + " skipped so far)";
    }
    progress_.EndLine();
    if (scale_after != scale_before) {
      std::printf(
          "step %lld: NaN/Inf in a gradient at loss scale %g on some rank; step skipped "
          "on all ranks, loss scale now %g%s\n",
          static_cast<long long>(step), scale_before, scale_after, note.c_str());
    } else {
      std::printf("step %lld: NaN/Inf in a gradient on some rank; step skipped on all ranks%s\n",
                  static_cast<long long>(step), note.c_str());
    }
    std::fflush(stdout);
  }
  json record = {{"type", "skip"}, {"step", step}, {"reason", "nonfinite gradient"}};
  if (o_.loss_scale.mode != LossScaleOptions::Mode::kOff) record["loss_scale"] = scale_before;
  Log(record);
}

void Reporter::Stopped(int64_t step, const std::string& why) {
  progress_.EndLine();
  Log({{"type", "stop"}, {"step", step}, {"reason", why}});
}

StepReport Reporter::MakeStepReport(int epoch, int64_t step, double loss, double lr,
                                    double images_per_s, int64_t skipped_steps) const {
  StepReport r;
  r.step = step;
  r.epoch = epoch;
  r.loss = loss;
  r.lr = lr;
  r.bits = setup_.quant->CurrentBits();
  r.images_per_s = images_per_s;
  r.ranks_alive = setup_.world;
  r.skipped_steps = uint64_t(skipped_steps);
  return r;
}

Status Reporter::AfterStep(const StepDone& s) {
  sums_.loss += double(s.batch.loss) * double(s.batch.count);
  sums_.correct += s.batch.correct;
  sums_.seen += s.batch.count;
  ++sums_.steps;
  const bool comm_stats = setup_.workers > 1 && !s.skipped;
  std::vector<SiteRecord> records;
  if (s.statistics) {
    setup_.quant->SetCollectStats(false);
    records = setup_.quant->TakeRecords();
    CPD_RETURN_IF_ERROR(setup_.replicas->ReduceSiteRecords(&records));
    json j = {{"type", "step"},       {"step", s.step},
              {"epoch", s.epoch},     {"loss", s.batch.loss},
              {"lr", s.lr},           {"bits", setup_.quant->CurrentBits()},
              {"skipped", s.skipped}, {"layers", StatsJson(records)}};
    if (o_.loss_scale.mode != LossScaleOptions::Mode::kOff) j["loss_scale"] = s.loss_scale;
    // null where the step skipped before its norm was taken (JSON has no NaN).
    if (o_.clip_grad_norm > 0) j["grad_norm"] = s.grad_norm;
    if (comm_stats) j["comm"] = CommStatsJson(setup_.reducer->last_stats());
    Log(j);
  }
  const double elapsed = SecondsSince(epoch_start_);
  const double ips = elapsed > 0 ? double(sums_.seen - carried_.seen) / elapsed : 0.0;
  const double remaining = double((setup_.batches_per_epoch - s.next_batch) * setup_.global_batch *
                                  setup_.labels_per_sample);
  const double eta = ips > 0 ? remaining / ips : 0.0;
  progress_.Update(s.epoch, o_.epochs, s.next_batch, setup_.batches_per_epoch, s.batch.loss, ips,
                   eta, setup_.quant->CurrentBits());
  if (control_ && (s.statistics || control_->SummaryDue())) {
    StepReport r = MakeStepReport(s.epoch, s.step, s.batch.loss, s.lr, ips, s.skipped_steps);
    if (s.statistics) {
      std::map<std::string, uint64_t> flips = setup_.quant->Flips();
      std::map<std::string, uint64_t> delta;
      for (const auto& [name, f] : flips) delta[name] = f - flips_reported_[name];
      flips_reported_ = std::move(flips);
      r.layers = LayerReports(
          records, delta,
          comm_stats ? setup_.reducer->last_stats() : std::vector<comm::LayerCommStats>{});
    }
    control_->Report(std::move(r));
  }
  return Status::Ok();
}

EpochTotals Reporter::Totals() const {
  EpochTotals t;
  const double seconds = SecondsSince(epoch_start_);
  const EpochSums& s = sums_;
  const int64_t steps_here = s.steps - carried_.steps;
  t.steps = s.steps;
  t.train_accuracy = s.seen > 0 ? double(s.correct) / double(s.seen) : 0.0;
  t.train_loss = s.seen > 0 ? s.loss / double(s.seen) : 0.0;
  t.images_per_s = seconds > 0 ? double(s.seen - carried_.seen) / seconds : 0.0;
  t.ms_per_step = steps_here > 0 ? 1e3 * seconds / double(steps_here) : 0.0;
  return t;
}

void Reporter::AfterEpoch(const EpochDone& e) {
  progress_.EndLine();
  const auto flips = setup_.quant->TakeFlips();
  flips_reported_.clear();
  // Flips are counted wherever W is quantised (nearest rounding as well as hysteresis).
  const bool show_flips = setup_.quant->QuantizesWeights();
  uint64_t total_flips = 0;
  json flips_json = json::object();
  for (const auto& [name, f] : flips) {
    if (show_flips) flips_json[name] = f;
    total_flips += f;
  }
  const PrecisionConfig& pc = *e.precision;
  if (!quiet_) {
    std::string extra;
    char buf[128];
    if (pc.cpt) {
      std::snprintf(buf, sizeof(buf), " bits %d-%d/%d", pc.cpt->min_bits, pc.cpt->max_bits,
                    pc.grad_bits);
      extra += buf;
    }
    std::snprintf(buf, sizeof(buf), " cost %+.2f%% vs %s", 100.0 * e.relative_cost,
                  StepBitsText(o_.cost_reference).c_str());
    extra += buf;
    if (show_flips) extra += " flips " + std::to_string(total_flips);
    if (e.skipped_steps > 0) extra += " skipped " + std::to_string(e.skipped_steps);
    if (o_.loss_scale.mode != LossScaleOptions::Mode::kOff) {
      std::snprintf(buf, sizeof(buf), " loss-scale %g", e.loss_scale);
      extra += buf;
    }
    if (setup_.language_model) {
      // Validation loss per token, perplexity exp(loss), and bits per byte loss / ln 2 where a
      // token is a byte.
      std::string bpb;
      if (setup_.byte_level) {
        std::snprintf(buf, sizeof(buf), " bpb %.3f", e.test_loss / std::log(2.0));
        bpb = buf;
      }
      std::printf("epoch %d/%d loss %.4f val loss %.4f ppl %.2f%s %.0f tok/s %.1f ms/step%s\n",
                  e.epoch, o_.epochs, e.totals.train_loss, e.test_loss, std::exp(e.test_loss),
                  bpb.c_str(), e.totals.images_per_s, e.totals.ms_per_step, extra.c_str());
    } else {
      std::printf("epoch %d/%d loss %.4f train %.2f%% test %.2f%% %.0f img/s %.1f ms/step%s\n",
                  e.epoch, o_.epochs, e.totals.train_loss, 100 * e.totals.train_accuracy,
                  100 * e.test_accuracy, e.totals.images_per_s, e.totals.ms_per_step,
                  extra.c_str());
    }
    std::fflush(stdout);
  }
  json record = {{"type", "epoch"},
                 {"epoch", e.epoch},
                 {"step", e.step},
                 {"loss", e.totals.train_loss},
                 {"train_accuracy", e.totals.train_accuracy},
                 {"test_accuracy", e.test_accuracy},
                 {"test_loss", e.test_loss},
                 {"bits", pc.cpt ? pc.cpt->max_bits : 0},
                 {"images_per_s", e.totals.images_per_s},
                 {"relative_cost", e.relative_cost},
                 {"cost_reference", StepBitsText(o_.cost_reference)},
                 {"skipped_steps", e.skipped_steps},
                 {"flips", flips_json}};
  if (o_.loss_scale.mode != LossScaleOptions::Mode::kOff) record["loss_scale"] = e.loss_scale;
  if (setup_.language_model) {
    // images_per_s stays the rate of samples (windows); the tokens' rate is its own key. An
    // epoch whose validation set was not evaluated has no perplexity (not exp(0) = 1).
    record["images_per_s"] = e.totals.images_per_s / double(setup_.labels_per_sample);
    record["tokens_per_s"] = e.totals.images_per_s;
    if (e.evaluated) {
      record["test_perplexity"] = std::exp(e.test_loss);
      if (setup_.byte_level) record["test_bits_per_byte"] = e.test_loss / std::log(2.0);
    }
  }
  Log(record);
  if (control_) control_->Report(EpochReport(e));
}

StepReport Reporter::EpochReport(const EpochDone& e) const {
  StepReport r = MakeStepReport(e.epoch, e.step - 1, e.totals.train_loss, e.lr,
                                e.totals.images_per_s, e.skipped_steps);
  r.train_accuracy = e.totals.train_accuracy;
  r.test_accuracy = e.test_accuracy;
  if (e.evaluated) {
    r.test_loss = e.test_loss;
    if (setup_.language_model) r.test_perplexity = std::exp(e.test_loss);
    if (setup_.language_model && setup_.byte_level) {
      r.test_bits_per_byte = e.test_loss / std::log(2.0);
    }
  }
  r.finished = e.finished;
  return r;
}

}  // namespace cpd::runtime
