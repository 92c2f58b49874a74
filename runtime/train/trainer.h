// The trainer behind cpd-train: data, model, precision policy, optimiser, schedules,
// statistics, metrics, checkpoints and bit-identical resume, on one process or data-parallel
// over a Communicator (one rank per process, each running K logical workers).
//
// Data parallelism: there are W = world_size * emulate_ranks logical workers; worker
// w = rank * K + k takes its slice of every global batch (global_batch / W samples), computes
// its gradient, and the W gradients are summed by a GradientAllReducer (fp32, or CPD's emulated
// low-precision sum, or packed low-bit codes, with or without APS) and averaged. Parameters are
// broadcast from rank 0 at the start; BatchNorm running statistics are averaged over the W
// workers every step; so all replicas stay bit-identical (checked at the end of the run). A
// gradient with NaN/Inf on any rank skips the step on every rank. Rank 0 prints and writes
// checkpoints; every rank reads them, so a run can resume at another world size with the same
// global batch.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "cpd/status.h"
#include "runtime/train/train_options.h"

namespace cpd::runtime {

// The outcome of a run (for tests and callers).
struct TrainResult {
  int64_t steps = 0;
  int epochs_done = 0;
  double final_loss = 0;
  double train_accuracy = 0;
  double test_accuracy = 0;
  double ms_per_step = 0;
  double lr_effective = 0;          // the schedule's base lr after --lr-scaling
  int64_t warmup_steps = 0;         // after --warmup-epochs
  std::vector<double> step_losses;  // every step's training loss, in order
  double relative_cost = 0;         // CPT's cost model vs static cost_reference bits
  int world_size = 1;               // ranks
  int workers = 1;                  // logical workers W
  int64_t skipped_steps = 0;        // steps skipped for a non-finite gradient
  double loss_scale = 1;            // at the end (runtime/train/loss_scale.h)
  uint64_t param_hash = 0;          // of the final parameters (FNV-1a of their bytes)
  bool replicas_identical = true;   // every rank ended with the same param_hash
  // Schedules applied during the run: (step at which it took effect, coordinator version).
  std::vector<std::pair<int64_t, uint64_t>> schedule_switches;
};

// Validates options (clear messages naming the flag); then trains. A diverged run (see
// max_skipped_steps) returns OutOfRange, the same on every rank. Prints to stdout unless
// quiet (rank 0 only). Writes metrics/checkpoints when asked. `comm` (null: world size 1) must be
// the same kind of communicator on every rank, and every rank calls Train with the same options.
Result<TrainResult> Train(const TrainOptions& opts, comm::Communicator* comm = nullptr);

}  // namespace cpd::runtime
