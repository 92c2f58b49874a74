// What a run tells the world, in one place: the console (rank 0: header, progress, skipped
// steps, one line per epoch), the metrics file (JSON lines: a "run" record first, then "step"
// records with per-layer statistics, "skip" and "epoch" records) and the coordinator's reports
// (through JobControl).
// It also keeps the running totals of the epoch (loss, accuracy, images/s).
#pragma once

#include <chrono>
#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/gradient_allreduce.h"
#include "cpd/progress.h"
#include "cpd/schedule.h"
#include "cpd/status.h"
#include "runtime/control/job_control.h"
#include "runtime/nn/optimizer.h"
#include "runtime/nn/quant_sites.h"
#include "runtime/train/loss_scale.h"
#include "runtime/train/progress.h"
#include "runtime/train/replicas.h"

namespace cpd::runtime {

// What the reporter reads of a run's options. Every field is REQUIRED: the trainer copies each
// from the TrainOptions field of the same name (runtime/train/train_options.h), where they are
// described; the values here only keep a field from being indeterminate.
struct ReporterOptions {
  // Where the reports go: the metrics file ("": none), the console (rank 0, unless quiet) and
  // its progress display.
  std::string metrics_out;
  bool quiet = false;
  ProgressMode progress = ProgressMode::kOff;
  double progress_interval_s = 0;
  // The run as the "run" record, the progress and the epoch lines describe it.
  std::string arch, dataset;
  int epochs = 0;
  int64_t max_steps = 0;
  uint64_t seed = 0;
  OptimizerKind optimizer = OptimizerKind::kSgd;
  double lr = 0, momentum = 0, weight_decay = 0;
  LrScaling lr_scaling = LrScaling::kNone;
  int64_t lr_base_batch = 0;
  LrSchedule::Kind lr_schedule = LrSchedule::kConstant;
  double lars_eta = 0;
  LarsExclude lars_exclude = LarsExclude::kBiasBn;
  double lars_excluded_lr_ratio = 0;
  double beta1 = 0, beta2 = 0, adam_eps = 0;  // AdamW's
  double clip_grad_norm = 0;                  // > 0: step records carry grad_norm
  comm::GradientAllReduceOptions allreduce;
  LossScaleOptions loss_scale;
  StepBits cost_reference;
};

// The run around the reporter: where this process stands, and the parts it reports on.
struct ReporterSetup {
  int rank = 0, world = 1, workers = 1;
  int64_t global_batch = 0, batches_per_epoch = 0;
  // A language model's run (a token dataset): the rates count tokens (labels_per_sample of them
  // per sample), the epoch line shows the validation loss, perplexity and, for byte-level text,
  // bits per byte where an image model's shows accuracy.
  int64_t labels_per_sample = 1;
  bool language_model = false, byte_level = false;
  SiteQuantizer* quant = nullptr;                     // REQUIRED
  const Replicas* replicas = nullptr;                 // REQUIRED
  const comm::GradientAllReducer* reducer = nullptr;  // REQUIRED
};

// A run (re)starting, as the "run" record needs it beyond the options and the setup.
struct RunStart {
  int64_t step = 0;  // the first step this process runs (> 0 on a resume)
  int classes = 0;   // the dataset's classes (chance level = 1 / classes); a vocabulary
  // A language model's: tokens per window, the unigram entropy of the training tokens (bits per
  // token) and the parameter count.
  int64_t block_size = 0;
  double unigram_bits = 0;
  int64_t params = 0;
  int64_t total_steps = 0;
  double lr_effective = 0;   // the schedule's base lr after --lr-scaling
  int64_t warmup_steps = 0;  // after --warmup-epochs
  std::string precision;     // DescribePrecision of the policy at the start
  std::string device;        // "cpu" | "cuda"
  std::string conv_algos;    // on a GPU: "exact" | "fast" (--fast-conv-algos); else empty
};

// A step just done, as the reporter needs it.
struct StepDone {
  int epoch = 0;      // 1-based
  int64_t step = 0;   // its index
  GlobalBatch batch;  // the global batch's loss and accuracy
  double lr = 0;
  bool skipped = false;       // NaN/Inf somewhere: no update
  bool statistics = false;    // its site statistics were recorded (or the error measured)
  int64_t next_batch = 0;     // the iterator's position in the epoch
  int64_t skipped_steps = 0;  // in the run so far
  double loss_scale = 1;      // the step's (runtime/train/loss_scale.h)
  // The global gradient norm before clipping (--clip-grad-norm; NaN when the step skipped
  // before clipping or clipping is off).
  double grad_norm = 0;
};

// The running sums of an epoch's training loss and accuracy. A checkpoint keeps them, so that
// an epoch resumed mid-way reports all of its steps and not only those after the resume.
struct EpochSums {
  double loss = 0;  // loss x images, summed over the global batches
  int64_t correct = 0, seen = 0, steps = 0;
};

// The epoch's totals over the global batches it ran (images_per_s: labels per second, which for
// a language model are tokens).
struct EpochTotals {
  double train_loss = 0, train_accuracy = 0, images_per_s = 0, ms_per_step = 0;
  int64_t steps = 0;
};

// An epoch just done, as the reporter needs it.
struct EpochDone {
  int epoch = 0;     // 1-based
  int64_t step = 0;  // steps done in the run
  EpochTotals totals;
  double test_accuracy = 0, test_loss = 0;
  // Whether the test set was evaluated (TrainOptions::eval_each_epoch = false evaluates the last
  // epoch only): a language model's perplexity and bits per byte are reported only then.
  bool evaluated = true;
  const PrecisionConfig* precision = nullptr;  // the policy in force
  double relative_cost = 0;
  int64_t skipped_steps = 0;
  double lr = 0;          // of the epoch's last step
  double loss_scale = 1;  // in force after the epoch's last step
  bool finished = false;  // the run's last epoch
};

class Reporter {
 public:
  // Opens the metrics file (rank 0, or every rank when the path holds "{rank}").
  static Result<std::unique_ptr<Reporter>> Create(const ReporterOptions& options,
                                                  ReporterSetup setup);

  // The coordinator's reports go through `control` (null: none).
  void set_control(JobControl* control) { control_ = control; }
  // The all-reducer whose statistics are reported (the trainer rebuilds it when a schedule
  // changes the per-layer all-reduce formats).
  void set_reducer(const comm::GradientAllReducer* reducer) { setup_.reducer = reducer; }
  bool quiet() const { return quiet_; }

  // A line on rank 0's console (unless quiet), after clearing the progress bar.
  void Say(const std::string& line);
  // One metrics record (every rank that keeps metrics).
  void Log(const nlohmann::json& record);

  // The "run" record: everything a report needs to read the metrics file on its own (the
  // model, data, workers, batch, schedule, optimiser, all-reduce, precision and device). The
  // first record of a run, and again at the start step of each resume (the file is appended
  // to).
  void Started(const RunStart& run);

  // `carried`: the sums of the epoch's steps before a resume (none for a fresh epoch); the rates
  // (images/s, ms/step) count only the steps this process runs.
  void BeginEpoch(const EpochSums& carried = {});
  // The epoch's sums so far (what a checkpoint keeps).
  EpochSums Sums() const { return sums_; }
  // The step's gradient held NaN/Inf on some rank: a "skip" record, and a console line for the
  // first kSkipLinesInFull skips of the run and every kSkipLineEvery-th after them.
  // `scale_before` / `scale_after`: the loss scale of the step and the one after it (dynamic
  // loss scaling halves it after an overflow); 1 and 1 without loss scaling.
  void StepSkipped(int64_t step, double scale_before = 1, double scale_after = 1);
  static constexpr int64_t kSkipLinesInFull = 5, kSkipLineEvery = 100;
  // The run stops because it cannot recover: a "stop" record and the console line.
  void Stopped(int64_t step, const std::string& why);
  // Epoch totals, the "step" record (with the site statistics, reduced over the ranks, when the
  // step recorded them: a collective then), the progress bar and the coordinator's report.
  Status AfterStep(const StepDone& step);
  // The epoch so far (call before evaluating, so that the rate leaves evaluation out).
  EpochTotals Totals() const;
  // The epoch line, the "epoch" record (with weight flips where W is quantised, and the cost
  // against --cost-reference) and the coordinator's report.
  void AfterEpoch(const EpochDone& epoch);

 private:
  Reporter(const ReporterOptions& options, ReporterSetup setup);
  StepReport MakeStepReport(int epoch, int64_t step, double loss, double lr, double images_per_s,
                            int64_t skipped_steps) const;
  // The coordinator's report of an epoch: its accuracies, and when evaluated the validation
  // loss, and a language model's perplexity and bits per byte.
  StepReport EpochReport(const EpochDone& e) const;

  ReporterSetup setup_;
  const ReporterOptions o_;
  bool quiet_;
  JobControl* control_ = nullptr;
  std::ofstream metrics_;
  Progress progress_;
  std::map<std::string, uint64_t> flips_reported_;  // weight flips already reported
  std::chrono::steady_clock::time_point epoch_start_;
  EpochSums sums_;     // of the whole epoch
  EpochSums carried_;  // the part of sums_ from before a resume
  int64_t skips_ = 0;  // in this run
};

}  // namespace cpd::runtime
