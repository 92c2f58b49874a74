// Replica consistency: what keeps the data-parallel replicas of a run bit-identical, in one place.
//
// Every rank runs the same model on its slice of each global batch. The replicas stay equal bit
// for bit because
//   * they start equal: rank 0's parameters and buffers are broadcast (BroadcastFromRank0);
//   * every quantity combined across ranks is combined in rank order, with the same float
//     additions on every rank (SumInRankOrder), never in an MPI reduction's unspecified order;
//   * BatchNorm running statistics, which each worker updates from its own micro-batch, are
//     replaced by their mean over all W workers after every step (AverageBuffers);
//   * a decision one rank takes (rank 0 wrote a checkpoint, or failed to) is shared before any
//     rank acts on it (AgreeOn);
//   * at the end, the ranks compare hashes of their parameters (CheckIdentical).
// The gradient sum itself is the GradientAllReducer's (comm/gradient_allreduce.h), which gives
// every rank the same bits by construction.
//
// Every method but the accessors and HashParams is a collective: every rank calls it in the
// same order with the same sizes. Tensors may live on any device (the communicator works on host
// memory; device tensors go through host copies).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "cpd/status.h"
#include "runtime/nn/layer.h"
#include "runtime/nn/quant_sites.h"
#include "runtime/engine/tensor.h"

namespace cpd::runtime {

// Sums over the samples of a batch: the loss (mean loss x samples), correct predictions, samples.
struct BatchTotals {
  float loss_sum = 0;
  int64_t correct = 0;
  int64_t count = 0;
};

// The loss and accuracy of a whole global batch, the same on every rank.
struct GlobalBatch {
  float loss = 0;  // mean over the global batch
  int64_t correct = 0;
  int64_t count = 0;
};

using NamedBuffers = std::vector<std::pair<std::string, Tensor*>>;

class Replicas {
 public:
  // `comm` (REQUIRED, non-null) must outlive this object.
  explicit Replicas(comm::Communicator* comm) : comm_(comm) {}

  int rank() const { return comm_->rank(); }
  int size() const { return comm_->size(); }
  bool lead() const { return comm_->rank() == 0; }

  // `local` summed over the ranks in rank order (an all-gather, then the same additions on every
  // rank), so that every rank gets the same bits whatever the backend's reduction order.
  Result<std::vector<float>> SumInRankOrder(const std::vector<float>& local) const;

  // Rank 0's parameter values and buffers, everywhere.
  Status BroadcastFromRank0(const std::vector<Param*>& params, const NamedBuffers& buffers) const;

  // BatchNorm running statistics after a step: `worker_snapshots` holds, for each of this rank's
  // local workers in order, every buffer's values (in `buffers` order) after that worker's
  // forward pass. Each buffer becomes the mean over all `workers` workers of all ranks.
  Status AverageBuffers(const std::vector<float>& worker_snapshots, int local_workers, int workers,
                        const NamedBuffers& buffers) const;

  // The loss and accuracy of the global batch from each rank's totals.
  Result<GlobalBatch> Combine(const BatchTotals& local) const;

  // Per-layer, per-site statistics reduced over the ranks (sums of counts and squares, max of
  // max|x|), so that what is logged describes the whole global batch, identically everywhere.
  Status ReduceSiteRecords(std::vector<SiteRecord>* records) const;

  // `local` is this rank's outcome of an action some ranks took (rank 0 writing a checkpoint).
  // Every rank learns whether it failed anywhere: a rank whose own action failed gets its own
  // status; the others get IoError(`failure_elsewhere`). So no rank goes on alone.
  Status AgreeOn(const Status& local, const std::string& failure_elsewhere) const;

  // FNV-1a over the bytes of every parameter value (device values copied to the host).
  static uint64_t HashParams(const std::vector<Param*>& params);
  // Whether every rank's `param_hash` is this rank's; Internal "replicas diverged" if not.
  Status CheckIdentical(uint64_t param_hash) const;

 private:
  comm::Communicator* comm_;
};

}  // namespace cpd::runtime
