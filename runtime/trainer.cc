#include "runtime/trainer.h"

#include <omp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "cpd/schedule.h"
#include "runtime/checkpoint.h"
#include "runtime/data.h"
#include "runtime/layers.h"
#include "runtime/models.h"
#include "runtime/optimizer.h"

extern "C" void openblas_set_num_threads(int num_threads);

namespace cpd::runtime {

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

constexpr int kCheckpointVersion = 1;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

Status Validate(const TrainOptions& o) {
  auto bad = [](const std::string& m) { return Status::InvalidArgument(m); };
  if (o.epochs < 1) return bad("--epochs must be >= 1, got " + std::to_string(o.epochs));
  if (o.batch_size < 1) return bad("--batch-size must be >= 1");
  if (o.lr <= 0 || !std::isfinite(o.lr)) return bad("--lr must be a positive number");
  if (o.momentum < 0 || o.momentum >= 1) return bad("--momentum must be in [0, 1)");
  if (o.weight_decay < 0) return bad("--weight-decay must be >= 0");
  if (o.optimizer != "sgd" && o.optimizer != "lars") {
    return bad("--optimizer '" + o.optimizer + "' (accepted: sgd, lars)");
  }
  if (o.lr_schedule != "constant" && o.lr_schedule != "step" && o.lr_schedule != "cosine") {
    return bad("--lr-schedule '" + o.lr_schedule + "' (accepted: constant, step, cosine)");
  }
  if (o.stats_every < 0) return bad("--stats-every must be >= 0");
  if (o.checkpoint_every < 0) return bad("--checkpoint-every must be >= 0");
  if (!o.resume.empty() && o.resume != "auto" && access(o.resume.c_str(), R_OK) != 0) {
    return bad("--resume: cannot read checkpoint '" + o.resume + "'");
  }
  if (o.resume == "auto" && o.checkpoint_dir.empty()) {
    return bad("--resume auto needs --checkpoint-dir");
  }
  if (o.device != "auto" && o.device != "cpu" && o.device != "cuda") {
    return bad("--device '" + o.device + "' (accepted: auto, cpu, cuda)");
  }
  if (o.precision.cpt) {
    const auto& c = *o.precision.cpt;
    if (c.min_bits < 2 || c.max_bits > 16 || c.min_bits > c.max_bits) {
      return bad("--cyclic-bits MIN MAX needs 2 <= MIN <= MAX <= 16");
    }
    if (c.periods < 1) return bad("--cyclic-periods must be >= 1");
    if (o.precision.grad_bits < 2 || o.precision.grad_bits > 16) {
      return bad("--grad-bits must be in 2..16");
    }
  }
  return Status::Ok();
}

// A terminal progress bar with rate and ETA; plain periodic lines when not a terminal.
class Progress {
 public:
  Progress(bool enabled, bool tty) : enabled_(enabled), tty_(tty) {}
  void Update(int epoch, int epochs, int64_t batch, int64_t batches, double loss,
              double images_per_s, double eta_s, int bits) {
    if (!enabled_) return;
    if (tty_) {
      const int width = 30;
      const int filled = batches > 0 ? int(width * batch / batches) : width;
      std::string bar(size_t(filled), '#');
      bar.resize(size_t(width), '.');
      std::printf("\r  epoch %d/%d [%s] %lld/%lld loss %.4f %6.0f img/s ETA %5.0fs%s", epoch,
                  epochs, bar.c_str(), static_cast<long long>(batch),
                  static_cast<long long>(batches), loss, images_per_s, eta_s,
                  bits > 0 ? (" bits " + std::to_string(bits)).c_str() : "");
      std::fflush(stdout);
      dirty_ = true;
    } else if (batch % 100 == 0 || batch == batches) {
      std::printf("  epoch %d/%d step %lld/%lld loss %.4f %.0f img/s eta %.0fs\n", epoch, epochs,
                  static_cast<long long>(batch), static_cast<long long>(batches), loss,
                  images_per_s, eta_s);
      std::fflush(stdout);
    }
  }
  void EndLine() {
    if (dirty_) std::printf("\r%100s\r", "");
    dirty_ = false;
  }

 private:
  bool enabled_, tty_;
  bool dirty_ = false;
};

struct Run {
  const TrainOptions& o;
  Dataset train, test;
  std::unique_ptr<Sequential> model;
  std::vector<Layer*> quant_layers;
  std::unique_ptr<SiteQuantizer> quant;
  std::unique_ptr<Optimizer> optimizer;
  LrSchedule lr;
  std::unique_ptr<BatchIterator> iter;
  int64_t step = 0;
  int64_t last_saved_step = -1;
  int64_t batches_per_epoch = 0;
  std::ofstream metrics;

  explicit Run(const TrainOptions& opts) : o(opts) {}

  void Log(const json& j) {
    if (metrics.is_open()) {
      metrics << j.dump() << '\n';
      metrics.flush();
    }
  }

  Status SaveCheckpoint(int epoch) {
    Checkpoint ck;
    json meta;
    meta["version"] = kCheckpointVersion;
    meta["step"] = step;
    meta["epoch"] = epoch;
    const IteratorState it = iter->state();
    meta["iterator"] = {{"epoch", it.epoch}, {"next_batch", it.next_batch}};
    meta["arch"] = o.arch;
    meta["dataset"] = o.dataset;
    meta["batch_size"] = o.batch_size;
    meta["seed"] = o.seed;
    ck.meta_json = meta.dump();
    for (Param* p : model->Params()) {
      ck.Put("param/" + p->name, p->value.shape(), p->value.data(), p->value.numel());
    }
    for (auto& [name, t] : model->Buffers()) {
      ck.Put("buffer/" + name, t->shape(), t->data(), t->numel());
    }
    for (auto& [name, t] : optimizer->State()) {
      ck.Put("opt/" + name, t->shape(), t->data(), t->numel());
    }
    for (auto& [layer, q] : quant->HysteresisState()) {
      ck.Put("hyst/" + layer, {int64_t(q->size())}, q->data(), q->size());
    }
    ::mkdir(o.checkpoint_dir.c_str(), 0755);
    CPD_RETURN_IF_ERROR(WriteCheckpoint(CheckpointPath(o.checkpoint_dir, step), ck));
    last_saved_step = step;
    return Status::Ok();
  }

  // Restores everything a step depends on; returns the epoch to continue in.
  Result<int> LoadCheckpoint(const std::string& path) {
    auto ck = ReadCheckpoint(path);
    if (!ck.ok()) return ck.status();
    json meta = json::parse(ck->meta_json, nullptr, false);
    if (meta.is_discarded() || meta.value("version", 0) != kCheckpointVersion) {
      return Status::Corruption("checkpoint " + path + ": unsupported version");
    }
    if (meta.value("arch", "") != o.arch || meta.value("dataset", "") != o.dataset ||
        meta.value("batch_size", 0) != o.batch_size) {
      return Status::InvalidArgument(
          "checkpoint " + path + " was written by a run with --arch " + meta.value("arch", "?") +
          " --dataset " + meta.value("dataset", "?") + " --batch-size " +
          std::to_string(meta.value("batch_size", 0)) + "; this run differs");
    }
    auto take = [&](const std::string& key, Tensor* t) -> Status {
      if (!ck->Has(key)) return Status::Corruption("checkpoint " + path + ": missing " + key);
      const auto& v = ck->data.at(key);
      if (v.size() != t->numel()) {
        return Status::Corruption("checkpoint " + path + ": " + key + " has " +
                                  std::to_string(v.size()) + " values, the model needs " +
                                  std::to_string(t->numel()));
      }
      std::copy(v.begin(), v.end(), t->data());
      return Status::Ok();
    };
    for (Param* p : model->Params()) CPD_RETURN_IF_ERROR(take("param/" + p->name, &p->value));
    for (auto& [name, t] : model->Buffers()) CPD_RETURN_IF_ERROR(take("buffer/" + name, t));
    std::map<std::string, std::vector<float>> opt_state;
    for (const auto& name : ck->order) {
      if (name.rfind("opt/", 0) == 0) opt_state[name.substr(4)] = ck->data.at(name);
    }
    CPD_RETURN_IF_ERROR(optimizer->LoadState(opt_state));
    step = meta.value("step", int64_t(0));
    quant->SetStep(step);
    for (const auto& name : ck->order) {
      if (name.rfind("hyst/", 0) == 0) {
        quant->RestoreHysteresisState(name.substr(5), ck->data.at(name));
      }
    }
    IteratorState st;
    st.epoch = meta["iterator"].value("epoch", int64_t(0));
    st.next_batch = meta["iterator"].value("next_batch", int64_t(0));
    CPD_RETURN_IF_ERROR(iter->Restore(st));
    return meta.value("epoch", 0);
  }

  // Test-set accuracy and loss in evaluation mode.
  std::pair<double, double> Evaluate() {
    quant->SetEval(true);
    BatchIterator it(test, 500, /*shuffle=*/false, /*augment=*/false, o.seed, false);
    it.StartEpoch(0);
    Tensor x;
    std::vector<int32_t> y;
    SoftmaxCrossEntropy ce;
    Tensor dlogits;
    double loss_sum = 0;
    int64_t correct = 0, seen = 0;
    while (it.Next(&x, &y)) {
      Tensor logits = model->Forward(x, /*train=*/false);
      loss_sum += double(ce.Forward(logits, y, &dlogits)) * double(y.size());
      correct += SoftmaxCrossEntropy::CountCorrect(logits, y);
      seen += int64_t(y.size());
    }
    quant->SetEval(false);
    return {seen > 0 ? double(correct) / double(seen) : 0.0,
            seen > 0 ? loss_sum / double(seen) : 0.0};
  }
};

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

}  // namespace

Result<TrainResult> Train(const TrainOptions& o) {
  CPD_RETURN_IF_ERROR(Validate(o));
  if (o.device == "cuda") {
    return Status::Unavailable(
        "--device cuda: the engine's CUDA layers are not built yet; use --device cpu");
  }
  const int threads = o.threads > 0 ? o.threads : omp_get_num_procs();
  omp_set_num_threads(threads);
  openblas_set_num_threads(threads);

  Run run(o);
  auto data = LoadDatasetPair(o.dataset, o.data_dir, o.seed);
  if (!data.ok()) return data.status();
  run.train = std::move(data->first);
  run.test = std::move(data->second);
  const ChannelStats norm = ComputeChannelStats(run.train);
  Normalize(&run.train, norm);
  Normalize(&run.test, norm);

  const int in_ch = o.in_channels > 0 ? o.in_channels : run.train.channels;
  const int size = o.image_size > 0 ? o.image_size : run.train.height;
  const int classes = o.classes > 0 ? o.classes : run.train.classes;
  if (in_ch != run.train.channels || size != run.train.height || classes < run.train.classes) {
    return Status::InvalidArgument(
        "--in-channels/--image-size/--classes (" + std::to_string(in_ch) + ", " +
        std::to_string(size) + ", " + std::to_string(classes) + ") do not fit dataset '" +
        o.dataset + "' (" + std::to_string(run.train.channels) + ", " +
        std::to_string(run.train.height) + ", " + std::to_string(run.train.classes) + ")");
  }
  auto model = BuildModel(o.arch, in_ch, size, classes, o.seed);
  if (!model.ok()) return model.status();
  run.model = std::move(model.value());
  for (Layer* l : run.model->Flatten()) {
    if (l->Quantizable()) run.quant_layers.push_back(l);
  }
  if (o.print_model) {
    std::printf("%s", DescribeModel(*run.model).c_str());
    return TrainResult{};
  }

  const bool augment = o.augment_set ? o.augment : o.dataset.rfind("cifar", 0) == 0;
  run.iter = std::make_unique<BatchIterator>(run.train, o.batch_size, /*shuffle=*/true, augment,
                                             o.seed, /*drop_last=*/false);
  run.batches_per_epoch = run.iter->batches_per_epoch();
  const int64_t total_steps = run.batches_per_epoch * o.epochs;

  PrecisionConfig pc = o.precision;
  if (pc.cpt) {
    pc.cpt->total_iters = total_steps;
    CPD_RETURN_IF_ERROR(pc.cpt->Validate());
  }
  pc.seed = kernels::SplitMix64(o.seed ^ 0x51u);
  auto quant = SiteQuantizer::Create(pc, run.quant_layers);
  if (!quant.ok()) return quant.status();
  run.quant = std::move(quant.value());
  for (Layer* l : run.quant_layers) {
    l->SetQuantHooks(run.quant->Quantizes(l->name()) ? run.quant.get() : nullptr);
  }

  OptimizerOptions oo;
  oo.momentum = o.momentum;
  oo.weight_decay = o.weight_decay;
  oo.nesterov = o.nesterov;
  oo.lars = o.optimizer == "lars";
  oo.lars_eta = o.lars_eta;
  oo.threads = threads;
  CPD_RETURN_IF_ERROR(oo.Validate());
  run.optimizer = std::make_unique<Optimizer>(run.model->Params(), oo);

  std::vector<int64_t> milestones;
  for (int64_t e : o.lr_milestones) milestones.push_back(e * run.batches_per_epoch);
  auto lr =
      ParseLrSchedule(o.lr_schedule, o.lr, total_steps, o.warmup_steps, milestones, o.lr_gamma);
  if (!lr.ok()) return lr.status();
  run.lr = *lr;

  if (!o.metrics_out.empty()) {
    run.metrics.open(o.metrics_out, std::ios::out | std::ios::app);
    if (!run.metrics) {
      return Status::IoError("--metrics-out: cannot open " + o.metrics_out + " for writing");
    }
  }

  int start_epoch = 0;
  std::string resume_path = o.resume;
  if (o.resume == "auto") resume_path = LatestCheckpoint(o.checkpoint_dir);
  if (!resume_path.empty()) {
    auto e = run.LoadCheckpoint(resume_path);
    if (!e.ok()) return e.status();
    start_epoch = *e;
    // A checkpoint taken after the last batch of an epoch continues with the next epoch.
    const IteratorState it = run.iter->state();
    if (it.epoch == start_epoch && it.next_batch >= run.batches_per_epoch) ++start_epoch;
    if (!o.quiet) {
      std::printf("resumed from %s at step %lld (epoch %d)\n", resume_path.c_str(),
                  static_cast<long long>(run.step), start_epoch + 1);
    }
  } else {
    run.iter->StartEpoch(0);
  }

  const bool tty = isatty(STDOUT_FILENO) != 0;
  Progress progress(o.progress && !o.quiet, tty);
  if (!o.quiet) {
    std::printf(
        "cpd-train: %s on %s (%lld train / %lld test), %d threads, batch %d, %d epochs "
        "x %lld steps\n",
        o.arch.c_str(), o.dataset.c_str(), static_cast<long long>(run.train.count),
        static_cast<long long>(run.test.count), threads, o.batch_size, o.epochs,
        static_cast<long long>(run.batches_per_epoch));
  }

  TrainResult result;
  if (pc.cpt) {
    // CPT's cost model over the whole schedule, against static training at MAX bits.
    std::vector<int> schedule;
    schedule.reserve(size_t(total_steps));
    for (int64_t t = 0; t < total_steps; ++t) schedule.push_back(pc.cpt->BitsAt(t));
    result.relative_cost = RelativeCost(schedule, pc.grad_bits, pc.cpt->max_bits);
  }
  SoftmaxCrossEntropy ce;
  Tensor x, dlogits;
  std::vector<int32_t> y;
  const auto t_start = Clock::now();
  int64_t steps_this_run = 0;
  bool stop = false;
  for (int epoch = start_epoch; epoch < o.epochs && !stop; ++epoch) {
    if (run.iter->state().epoch != epoch) run.iter->StartEpoch(epoch);
    const auto t_epoch = Clock::now();
    double loss_sum = 0;
    int64_t correct = 0, seen = 0, epoch_steps = 0;
    while (run.iter->Next(&x, &y)) {
      run.quant->SetStep(run.step);
      run.model->SetStep(uint64_t(run.step));
      const bool collect = o.stats_every > 0 && run.step % o.stats_every == 0;
      run.quant->SetCollectStats(collect);

      run.optimizer->ZeroGrad();
      Tensor logits = run.model->Forward(x, /*train=*/true);
      const float loss = ce.Forward(logits, y, &dlogits);
      run.model->Backward(dlogits);
      const double lr_now = run.lr.At(run.step);
      run.optimizer->Step(lr_now);

      loss_sum += double(loss) * double(y.size());
      correct += SoftmaxCrossEntropy::CountCorrect(logits, y);
      seen += int64_t(y.size());
      result.step_losses.push_back(loss);
      ++run.step;
      ++epoch_steps;
      ++steps_this_run;

      if (collect) {
        run.quant->SetCollectStats(false);
        json j = {{"type", "step"},
                  {"step", run.step - 1},
                  {"epoch", epoch + 1},
                  {"loss", loss},
                  {"lr", lr_now},
                  {"bits", run.quant->CurrentBits()},
                  {"layers", StatsJson(run.quant->TakeRecords())}};
        run.Log(j);
      }
      const double elapsed = Seconds(t_epoch, Clock::now());
      const double ips = elapsed > 0 ? double(seen) / elapsed : 0.0;
      const int64_t batch = run.iter->state().next_batch;
      const double eta =
          ips > 0 ? double((run.batches_per_epoch - batch) * o.batch_size) / ips : 0.0;
      progress.Update(epoch + 1, o.epochs, batch, run.batches_per_epoch, loss, ips, eta,
                      run.quant->CurrentBits());
      if (!o.checkpoint_dir.empty() && o.checkpoint_every > 0 &&
          run.step % o.checkpoint_every == 0) {
        CPD_RETURN_IF_ERROR(run.SaveCheckpoint(epoch));
      }
      if (o.max_steps > 0 && run.step >= o.max_steps) {
        stop = true;
        break;
      }
    }
    progress.EndLine();
    const double epoch_s = Seconds(t_epoch, Clock::now());
    const double train_acc = seen > 0 ? double(correct) / double(seen) : 0.0;
    const double train_loss = seen > 0 ? loss_sum / double(seen) : 0.0;
    double test_acc = 0, test_loss = 0;
    const bool epoch_complete = run.iter->state().next_batch >= run.batches_per_epoch;
    if (o.eval_each_epoch || epoch + 1 == o.epochs || stop) {
      std::tie(test_acc, test_loss) = run.Evaluate();
    }
    const auto flips = run.quant->TakeFlips();
    uint64_t total_flips = 0;
    json flips_json = json::object();
    for (const auto& [name, f] : flips) {
      if (o.precision.hysteresis) flips_json[name] = f;
      total_flips += f;
    }
    if (!o.quiet) {
      std::string extra;
      if (pc.cpt) {
        char buf[96];
        std::snprintf(buf, sizeof(buf), " bits %d-%d/%d cost %+.2f%%", pc.cpt->min_bits,
                      pc.cpt->max_bits, pc.grad_bits, 100.0 * result.relative_cost);
        extra += buf;
      }
      if (o.precision.hysteresis) extra += " flips " + std::to_string(total_flips);
      std::printf("epoch %d/%d loss %.4f train %.2f%% test %.2f%% %.0f img/s %.1f ms/step%s\n",
                  epoch + 1, o.epochs, train_loss, 100 * train_acc, 100 * test_acc,
                  epoch_s > 0 ? double(seen) / epoch_s : 0.0,
                  epoch_steps > 0 ? 1e3 * epoch_s / double(epoch_steps) : 0.0, extra.c_str());
      std::fflush(stdout);
    }
    run.Log({{"type", "epoch"},
             {"epoch", epoch + 1},
             {"step", run.step},
             {"loss", train_loss},
             {"train_accuracy", train_acc},
             {"test_accuracy", test_acc},
             {"test_loss", test_loss},
             {"bits", pc.cpt ? pc.cpt->max_bits : 0},
             {"images_per_s", epoch_s > 0 ? double(seen) / epoch_s : 0.0},
             {"relative_cost", result.relative_cost},
             {"flips", flips_json}});
    result.final_loss = train_loss;
    result.train_accuracy = train_acc;
    result.test_accuracy = test_acc;
    if (epoch_complete) result.epochs_done = epoch + 1;
    if (!o.checkpoint_dir.empty() && o.checkpoint_every == 0 && epoch_complete) {
      CPD_RETURN_IF_ERROR(run.SaveCheckpoint(epoch + 1));
    }
  }
  // A final checkpoint when the run ends between checkpoint steps (e.g. at --max-steps).
  if (!o.checkpoint_dir.empty() && run.step != run.last_saved_step) {
    const IteratorState it = run.iter->state();
    CPD_RETURN_IF_ERROR(
        run.SaveCheckpoint(int(it.epoch) + (it.next_batch >= run.batches_per_epoch)));
  }
  result.steps = run.step;
  const double total_s = Seconds(t_start, Clock::now());
  result.ms_per_step = steps_this_run > 0 ? 1e3 * total_s / double(steps_this_run) : 0.0;
  return result;
}

}  // namespace cpd::runtime
