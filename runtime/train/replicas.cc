#include "runtime/train/replicas.h"

#include <algorithm>

namespace cpd::runtime {

Result<std::vector<float>> Replicas::SumInRankOrder(const std::vector<float>& local) const {
  if (comm_->size() == 1) return local;
  std::vector<float> all(local.size() * size_t(comm_->size()));
  CPD_RETURN_IF_ERROR(comm_->AllGather(local.data(), all.data(), local.size()));
  std::vector<float> sum(local.size(), 0.0f);
  for (int r = 0; r < comm_->size(); ++r) {
    for (size_t i = 0; i < local.size(); ++i) sum[i] += all[size_t(r) * local.size() + i];
  }
  return sum;
}

Status Replicas::BroadcastFromRank0(const std::vector<Param*>& params,
                                    const NamedBuffers& buffers) const {
  if (comm_->size() == 1) return Status::Ok();
  auto broadcast = [this](Tensor* t) -> Status {
    Tensor h = OnHost(*t);
    CPD_RETURN_IF_ERROR(comm_->Broadcast(h.data(), h.numel(), 0));
    if (t->device() != Device::kCpu) t->CopyFrom(h);
    return Status::Ok();
  };
  for (Param* p : params) CPD_RETURN_IF_ERROR(broadcast(&p->value));
  for (const auto& [name, t] : buffers) CPD_RETURN_IF_ERROR(broadcast(t));
  return Status::Ok();
}

Status Replicas::AverageBuffers(const std::vector<float>& worker_snapshots, int local_workers,
                                int workers, const NamedBuffers& buffers) const {
  size_t floats = 0;
  for (const auto& b : buffers) floats += b.second->numel();
  // This rank's workers first (in worker order), then the ranks in rank order.
  std::vector<float> local(floats, 0.0f);
  for (int k = 0; k < local_workers; ++k) {
    for (size_t i = 0; i < floats; ++i) local[i] += worker_snapshots[size_t(k) * floats + i];
  }
  CPD_ASSIGN_OR_RETURN(const std::vector<float> total, SumInRankOrder(local));
  size_t offset = 0;
  std::vector<float> averaged;
  for (const auto& b : buffers) {
    averaged.resize(b.second->numel());
    for (size_t i = 0; i < b.second->numel(); ++i) {
      averaged[i] = total[offset + i] / float(workers);
    }
    b.second->CopyFromHost(averaged.data());
    offset += b.second->numel();
  }
  return Status::Ok();
}

Result<GlobalBatch> Replicas::Combine(const BatchTotals& local) const {
  GlobalBatch g;
  g.loss = local.loss_sum / float(std::max<int64_t>(local.count, 1));
  g.correct = local.correct;
  g.count = local.count;
  if (comm_->size() == 1) return g;
  CPD_ASSIGN_OR_RETURN(const std::vector<float> sums,
                       SumInRankOrder({local.loss_sum, float(local.correct), float(local.count)}));
  g.count = int64_t(sums[2]);
  g.correct = int64_t(sums[1]);
  g.loss = sums[0] / float(std::max<int64_t>(g.count, 1));
  return g;
}

Status Replicas::ReduceSiteRecords(std::vector<SiteRecord>* records) const {
  if (comm_->size() == 1 || records->empty()) return Status::Ok();
  std::vector<uint64_t> counts;
  std::vector<float> sums, maxes;
  for (const SiteRecord& r : *records) {
    counts.insert(counts.end(),
                  {r.stats.count, r.stats.saturated, r.stats.flushed, r.stats.nonfinite});
    sums.insert(sums.end(), {float(r.stats.sq_error), float(r.stats.sq_input)});
    maxes.push_back(r.stats.max_abs);
  }
  CPD_RETURN_IF_ERROR(comm_->AllReduce(counts.data(), counts.size(), comm::ReduceOp::kSum));
  CPD_RETURN_IF_ERROR(comm_->AllReduce(maxes.data(), maxes.size(), comm::ReduceOp::kMax));
  CPD_ASSIGN_OR_RETURN(const std::vector<float> total, SumInRankOrder(sums));
  for (size_t i = 0; i < records->size(); ++i) {
    QuantStats& st = (*records)[i].stats;
    st.count = counts[4 * i];
    st.saturated = counts[4 * i + 1];
    st.flushed = counts[4 * i + 2];
    st.nonfinite = counts[4 * i + 3];
    st.sq_error = total[2 * i];
    st.sq_input = total[2 * i + 1];
    st.max_abs = maxes[i];
  }
  return Status::Ok();
}

Status Replicas::AgreeOn(const Status& local, const std::string& failure_elsewhere) const {
  if (comm_->size() == 1) return local;
  int32_t failed = local.ok() ? 0 : 1;
  CPD_RETURN_IF_ERROR(comm_->AllReduce(&failed, 1, comm::ReduceOp::kMax));
  if (!local.ok()) return local;
  if (failed) return Status::IoError(failure_elsewhere);
  return Status::Ok();
}

uint64_t Replicas::HashParams(const std::vector<Param*>& params) {
  uint64_t h = 1469598103934665603ull;
  for (const Param* p : params) {
    const Tensor v = OnHost(p->value);
    const auto* b = reinterpret_cast<const unsigned char*>(v.data());
    for (size_t i = 0; i < v.numel() * sizeof(float); ++i) {
      h = (h ^ b[i]) * 1099511628211ull;
    }
  }
  return h;
}

Status Replicas::CheckIdentical(uint64_t param_hash) const {
  if (comm_->size() == 1) return Status::Ok();
  // Equal maxima of h and of ~h on every rank mean every rank holds the same h.
  uint64_t hi = param_hash, lo = ~param_hash;
  CPD_RETURN_IF_ERROR(comm_->AllReduce(&hi, 1, comm::ReduceOp::kMax));
  CPD_RETURN_IF_ERROR(comm_->AllReduce(&lo, 1, comm::ReduceOp::kMax));
  if (hi != param_hash || lo != ~param_hash) {
    return Status::Internal("replicas diverged: the ranks' final parameters differ");
  }
  return Status::Ok();
}

}  // namespace cpd::runtime
