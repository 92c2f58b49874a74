// When a run writes checkpoints and what they hold; resuming from one.
//
// A checkpoint (runtime/train/checkpoint.h: atomic, CRC-checked) holds everything a step depends
// on: parameters, BatchNorm buffers, optimiser state, hysteresis state, the iterator's position,
// the step, and the schedule in force (when a coordinator pushed one), plus metadata that must
// match the resuming run (arch, dataset, global batch). Rank 0 writes; every rank learns whether
// it worked (Replicas::AgreeOn), so that none goes on alone; every rank reads on resume. Since
// all randomness is counter-based, a resumed run is bit-identical to one that never stopped.
//
// When: every --checkpoint-every steps; with --checkpoint-every 0, at the end of every complete
// epoch; and once more at the end of a run that stopped between checkpoints (--max-steps).
#pragma once

#include <cstdint>
#include <string>

#include "cpd/status.h"
#include "runtime/control/job_control.h"
#include "runtime/nn/layers.h"
#include "runtime/nn/optimizer.h"
#include "runtime/nn/quant_sites.h"
#include "runtime/train/data.h"
#include "runtime/train/loss_scale.h"
#include "runtime/train/replicas.h"
#include "runtime/train/reporter.h"

namespace cpd::runtime {

// What the checkpointer reads of a run's options. Every field is REQUIRED: the trainer copies
// each from the TrainOptions field of the same name (runtime/train/train_options.h).
struct CheckpointOptions {
  std::string checkpoint_dir;    // "": no checkpoints
  int64_t checkpoint_every = 0;  // steps (0: at the end of each epoch)
  // The run, recorded in each checkpoint; a resume must match arch and dataset and be within
  // epochs.
  std::string arch, dataset;
  uint64_t seed = 0;
  int epochs = 0;
  // Labels per sample (a language model's window has block_size): bounds the label count of
  // the epoch's sums that a checkpoint may hold.
  int64_t labels_per_sample = 1;
};

// What a checkpoint saves and restores. REQUIRED: all but `control` and `scaler`.
struct TrainingState {
  Sequential* model = nullptr;
  Optimizer* optimizer = nullptr;
  SiteQuantizer* quant = nullptr;
  BatchIterator* iterator = nullptr;
  const JobControl* control = nullptr;
  LossScaler* scaler = nullptr;  // null: the run has no loss scale to keep
};

// Where a resumed run continues.
struct ResumePoint {
  int64_t step = 0;
  int epoch = 0;              // the epoch recorded (0-based; see Checkpointer::Restore)
  std::string schedule_json;  // the schedule in force then ("" if none was recorded)
  int random_stream = 1;      // kernels::kRandomStreamVersion of the run that wrote it (1 if
                              // not recorded: written before versions were)
  // The resumed epoch's sums before the checkpoint: zero unless it was taken mid-epoch (and
  // by a build that recorded them).
  EpochSums epoch_sums;
};

class Checkpointer {
 public:
  // `replicas` and what `state` points to must outlive the checkpointer.
  Checkpointer(const CheckpointOptions& options, int64_t global_batch, int64_t batches_per_epoch,
               TrainingState state, const Replicas* replicas);

  void set_control(const JobControl* control) { state_.control = control; }

  // With --checkpoint-dir: creates it and proves rank 0 can write a file there, at start-up
  // rather than at the first checkpoint (a collective: every rank learns the outcome).
  Status CheckDirectory() const;

  // Restores what `path` holds into the state after checking every field against this run and
  // this model (types, ranges, shapes, finiteness: a bad file is CorruptCheckpoint, a file of
  // another run InvalidArgument); nothing is changed unless all of it fits. The returned epoch
  // is the one the checkpoint recorded. That checkpoint counts as this run's latest.
  Result<ResumePoint> Restore(const std::string& path);

  // After step `step` (steps done) of 0-based epoch `epoch`, whose sums so far are `sums`: a
  // checkpoint every --checkpoint-every steps.
  Status AfterStep(int64_t step, int epoch, const EpochSums& sums);
  // After a complete epoch (`epochs_done` of them), with --checkpoint-every 0.
  Status AfterEpoch(int64_t step, int epochs_done);
  // At the end of the run: one more when the last step is not saved yet.
  Status AtEnd(int64_t step, const EpochSums& sums);

 private:
  bool enabled() const { return !o_.checkpoint_dir.empty(); }
  // Rank 0 writes, every rank learns the outcome.
  Status SaveEverywhere(int64_t step, int epoch, const EpochSums& sums);
  Status Write(int64_t step, int epoch, const EpochSums& sums) const;

  const CheckpointOptions o_;
  int64_t global_batch_, batches_per_epoch_;
  TrainingState state_;
  const Replicas* replicas_;
  int64_t last_saved_step_ = -1;
};

// The parameters and BatchNorm buffers of a cpd-train checkpoint, loaded into `model` (on any
// device), for tools that use a trained model (the format search). Checks that the checkpoint
// was written for `arch` and `dataset` and that every tensor the model needs is there with its
// size and finite values; InvalidArgument or Corruption naming the file otherwise. Returns the
// checkpoint's step.
Result<int64_t> LoadModelFromCheckpoint(const std::string& path, const std::string& arch,
                                        const std::string& dataset, Sequential* model);

}  // namespace cpd::runtime
