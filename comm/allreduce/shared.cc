// The parts of comm/allreduce/internal.h that every algorithm uses: rounding streams, the scan
// with the APS shifts, the statistics, and the payload collectives; the exchange tracking of
// comm/allreduce/backend.h.
#include <omp.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "comm/allreduce/internal.h"
#include "comm/reduce_kernels.h"

namespace cpd::comm::internal {

QuantizeOptions ReducerSetup::QuantizeAt(std::int64_t stage, std::int64_t step,
                                         std::size_t index) const {
  QuantizeOptions q;
  q.rounding = options.rounding;
  q.seed = RoundingSeed(options.seed, stage);
  q.step = std::uint64_t(step);
  q.index_offset = index;
  q.channels = 1;
  q.threads = threads;
  return q;
}

kernels::LoopParams ReducerSetup::LoopAt(kernels::RoundMode mode, std::int64_t stage,
                                         std::int64_t step, std::size_t index) const {
  kernels::LoopParams p;
  p.mode = mode;
  p.rng_key = kernels::MakeRandomKey(RoundingSeed(options.seed, stage), std::uint64_t(step));
  p.index_base = index;
  return p;
}

// ---- LayerStatistics ----------------------------------------------------------------------------

void SetCountFractions(const ReducerSetup& setup, const std::vector<std::uint64_t>& counts,
                       std::vector<LayerCommStats>* stats) {
  for (std::size_t l = 0; l < setup.layers(); ++l) {
    const std::uint64_t elems = std::uint64_t(setup.layer_size(l)) * std::uint64_t(setup.workers);
    const std::uint64_t nonzero = counts[3 * l + 2];
    (*stats)[l].flushed = nonzero > 0 ? double(counts[3 * l]) / double(nonzero) : 0.0;
    (*stats)[l].saturated = elems > 0 ? double(counts[3 * l + 1]) / double(elems) : 0.0;
  }
}

LayerStatistics::LayerStatistics(const ReducerSetup& setup, Backend* backend, std::size_t max_chunk)
    : setup_(setup), backend_(*backend), max_chunk_(max_chunk) {
  const std::size_t layers = setup.layers();
  counts_.assign(3 * layers, 0);
  error_.assign(2 * layers, 0.0);
  error_all_ranks_.assign(2 * layers * std::size_t(setup.world_size), 0.0);
}

void LayerStatistics::Reset() {
  std::fill(counts_.begin(), counts_.end(), 0u);
  std::fill(error_.begin(), error_.end(), 0.0);
}

void LayerStatistics::AddQuantStats(int layer, const QuantStats& qs) {
  counts_[3 * std::size_t(layer)] += qs.flushed;
  counts_[3 * std::size_t(layer) + 1] += qs.saturated;
}

Status LayerStatistics::ReduceReference(const BucketPlan& b, const float* const* src, int count) {
  const std::size_t p = std::size_t(setup_.world_size);
  if (reference_.bytes() == 0) {
    const std::size_t chunk = std::max<std::size_t>(max_chunk_, 1);
    CPD_ASSIGN_OR_RETURN(reference_send_, backend_.Allocate(chunk * p * sizeof(float)));
    CPD_ASSIGN_OR_RETURN(reference_, backend_.Allocate(chunk * sizeof(float)));
    host_reference_.assign(chunk, 0.0f);
    host_output_.assign(chunk, 0.0f);
  }
  // Every chunk padded to the longest, so that the reduce-scatter's blocks are equal.
  const std::size_t slot = b.max_chunk;
  for (int d = 0; d < setup_.world_size; ++d) {
    const std::size_t c0 = b.chunk_begin(d), c1 = b.chunk_end(d);
    float* dst = reference_send_.floats() + std::size_t(d) * slot;
    CPD_RETURN_IF_ERROR(backend_.SumBuffers(src, count, c0, c1, dst));
    CPD_RETURN_IF_ERROR(backend_.Zero(dst + (c1 - c0), (slot - (c1 - c0)) * sizeof(float)));
  }
  return backend_.ReduceScatterSum(reference_send_.floats(), reference_.floats(), slot * p);
}

void AddChunkErrors(const BucketPlan& b, int rank, const float* output_chunk,
                    const float* reference, std::vector<double>* error) {
  const std::size_t c0 = b.chunk_begin(rank);
  for (const Segment& s : b.segments_of(rank)) {
    double e2 = 0.0, r2 = 0.0;
    for (std::size_t i = s.begin - c0; i < s.end - c0; ++i) {
      const double ref = reference[i];
      const double d = double(output_chunk[i]) - ref;
      e2 += d * d;
      r2 += ref * ref;
    }
    (*error)[2 * std::size_t(s.layer)] += e2;
    (*error)[2 * std::size_t(s.layer) + 1] += r2;
  }
}

void SetRelErrors(const ReducerSetup& setup, const std::vector<double>& error_all_ranks,
                  std::vector<LayerCommStats>* stats) {
  const std::size_t layers = setup.layers();
  for (std::size_t l = 0; l < layers; ++l) {
    double e2 = 0.0, r2 = 0.0;
    for (std::size_t r = 0; r < std::size_t(setup.world_size); ++r) {
      e2 += error_all_ranks[r * 2 * layers + 2 * l];
      r2 += error_all_ranks[r * 2 * layers + 2 * l + 1];
    }
    (*stats)[l].rel_error = r2 > 0.0   ? std::sqrt(e2 / r2)
                            : e2 > 0.0 ? std::numeric_limits<double>::infinity()
                                       : 0.0;
  }
}

Status LayerStatistics::AccumulateError(const BucketPlan& b, const float* output) {
  const std::size_t c0 = b.chunk_begin(setup_.rank), n = b.chunk_end(setup_.rank) - c0;
  CPD_RETURN_IF_ERROR(backend_.ToHost(output + c0, n * sizeof(float), host_output_.data()));
  CPD_RETURN_IF_ERROR(
      backend_.ToHost(reference_.floats(), n * sizeof(float), host_reference_.data()));
  AddChunkErrors(b, setup_.rank, host_output_.data(), host_reference_.data(), &error_);
  return Status::Ok();
}

Status LayerStatistics::Finish(bool measure_error, std::vector<LayerCommStats>* stats) {
  if (setup_.options.algo != AllReduceAlgo::kFp32) {
    CPD_RETURN_IF_ERROR(backend_.ReadCodeCounters(&counts_));
    CPD_RETURN_IF_ERROR(backend_.AllReduceHost(counts_.data(), counts_.size(), ReduceOp::kSum));
    SetCountFractions(setup_, counts_, stats);
  }
  if (!measure_error) return Status::Ok();
  // Every rank sums the per-rank parts in rank order, so the result is identical everywhere.
  CPD_RETURN_IF_ERROR(backend_.AllGatherHost(
      reinterpret_cast<const std::uint8_t*>(error_.data()),
      reinterpret_cast<std::uint8_t*>(error_all_ranks_.data()), error_.size() * sizeof(double)));
  SetRelErrors(setup_, error_all_ranks_, stats);
  return Status::Ok();
}

// ---- ExchangeBuffers, StepContext ---------------------------------------------------------------

Status CheckBlockBytes(const ReducerSetup& setup, std::size_t slot_bytes) {
  const std::size_t block = std::size_t(setup.local_replicas) * slot_bytes;
  if (block <= std::size_t(INT_MAX)) return Status::Ok();
  return Status::InvalidArgument(
      "GradientAllReducer: bucket_mb " + std::to_string(setup.options.bucket_mb) + " gives " +
      std::to_string(block) + "-byte blocks per rank, beyond MPI's limit of " +
      std::to_string(INT_MAX) + "; use a smaller bucket_mb");
}

Status ExchangeBuffers::Allocate(const ReducerSetup& setup, Backend* backend,
                                 std::size_t slot_bytes, std::size_t gather_slot_bytes) {
  CPD_RETURN_IF_ERROR(CheckBlockBytes(setup, slot_bytes));
  const std::size_t block = std::size_t(setup.local_replicas) * slot_bytes;
  const std::size_t p = std::size_t(setup.world_size);
  const std::size_t gather = gather_slot_bytes > 0 ? gather_slot_bytes : slot_bytes;
  CPD_ASSIGN_OR_RETURN(send, backend->Allocate(block * p, /*exchanged=*/true));
  CPD_ASSIGN_OR_RETURN(recv, backend->Allocate(block * p, /*exchanged=*/true));
  CPD_ASSIGN_OR_RETURN(gather_send, backend->Allocate(gather, /*exchanged=*/true));
  CPD_ASSIGN_OR_RETURN(gather_recv, backend->Allocate(gather * p, /*exchanged=*/true));
  return Status::Ok();
}

StepContext::StepContext(const ReducerSetup& setup_in, const AllReducePlan& plan_in,
                         Backend* backend_in)
    : setup(setup_in),
      plan(plan_in),
      backend(*backend_in),
      max_abs(setup_in.layers(), 0.0f),
      shifts(setup_in.layers(), 0),
      stats(setup_in, backend_in, plan_in.max_chunk()) {}

void StepContext::Reset() {
  bytes_sent = 0;
  stats.Reset();
}

Status StepContext::ScanAndShift(float* const* inputs, bool* finite) {
  std::vector<std::uint32_t> max_bits;
  std::vector<std::uint64_t> nonzero;
  CPD_RETURN_IF_ERROR(backend.ScanLayers(inputs, &max_bits, &nonzero));
  for (std::size_t l = 0; l < setup.layers(); ++l) {
    max_abs[l] = MaxAbsForAllReduce(max_bits[l]);
    stats.SetNonzero(l, nonzero[l]);
  }
  CPD_RETURN_IF_ERROR(backend.AllReduceHost(max_abs.data(), setup.layers(), ReduceOp::kMax));
  *finite = ShiftsFromMaxima(setup, max_abs, &shifts);
  if (!*finite) return Status::Ok();
  return backend.SetLayerShifts(shifts);
}

Status StepContext::ExchangeContributions(std::size_t block_bytes) {
  CPD_RETURN_IF_ERROR(
      backend.AllToAllBytes(exchange.send.data(), exchange.recv.data(), block_bytes));
  bytes_sent += SentByExchange(setup.world_size, block_bytes);
  return Status::Ok();
}

Status StepContext::GatherChunks(const std::uint8_t* chunk, std::size_t slot_bytes) {
  CPD_RETURN_IF_ERROR(backend.AllGatherBytes(chunk, exchange.gather_recv.data(), slot_bytes));
  bytes_sent += SentByExchange(setup.world_size, slot_bytes);
  return Status::Ok();
}

Status StepContext::AllReduceSum(float* data, std::size_t count) {
  CPD_RETURN_IF_ERROR(backend.AllReduceSum(data, count));
  bytes_sent += SentByAllReduce(setup.world_size, count * sizeof(float));
  return Status::Ok();
}

Status StepContext::ApplyShift(const BucketPlan& b, float* const* inputs) {
  for (int k = 0; k < setup.local_replicas; ++k) {
    for (const Segment& s : b.segments) {
      const int sh = shifts[std::size_t(s.layer)];
      if (sh == 0) continue;
      float* x = inputs[k] + s.begin;
      CPD_RETURN_IF_ERROR(backend.Scale(x, x, s.size(), kernels::Pow2(sh)));
    }
  }
  return Status::Ok();
}

// ---- Backend: the exchanges in flight -----------------------------------------------------------

Status Backend::StartExchange(std::span<const Communicator::SendBlock> send,
                              std::span<const Communicator::RecvBlock> recv,
                              std::vector<std::unique_ptr<Communicator::PendingExchange>>* flight) {
  CPD_ASSIGN_OR_RETURN(std::unique_ptr<Communicator::PendingExchange> pending,
                       StartExchangeBytes(send, recv));
  in_flight_.push_back(pending.get());
  flight->push_back(std::move(pending));
  return Status::Ok();
}

Status Backend::Land(std::vector<std::unique_ptr<Communicator::PendingExchange>>* flight) {
  for (std::unique_ptr<Communicator::PendingExchange>& pending : *flight) {
    CPD_RETURN_IF_ERROR(pending->Wait());
    in_flight_.erase(std::find(in_flight_.begin(), in_flight_.end(), pending.get()));
  }
  flight->clear();
  return Status::Ok();
}

void Backend::KeepExchangesMoving() {
  for (Communicator::PendingExchange* pending : in_flight_) {
    bool done = false;
    const Status st = pending->Test(&done);
    if (!st.ok() && moving_error_.ok()) moving_error_ = st;
  }
}

// ---- What every implementation checks and computes alike ----------------------------------------

Status CheckReduceBuffers(const ReducerSetup& setup, float* const* inputs, const float* output) {
  if (setup.layout.total() == 0) return Status::Ok();
  const std::string where = "GradientAllReducer::Reduce on rank " + std::to_string(setup.rank);
  if (inputs == nullptr || output == nullptr) {
    return Status::InvalidArgument(where + ": null inputs or output");
  }
  for (int k = 0; k < setup.local_replicas; ++k) {
    if (inputs[k] == nullptr) {
      return Status::InvalidArgument(where + ": inputs[" + std::to_string(k) + "] is null");
    }
  }
  return Status::Ok();
}

void ResetLayerStats(std::vector<LayerCommStats>* stats) {
  for (LayerCommStats& s : *stats) {
    s.shift = 0;
    s.max_abs = 0;
    s.flushed = 0;
    s.saturated = 0;
    s.rel_error = -1;
  }
}

float MaxAbsForAllReduce(std::uint32_t max_bits) {
  return kernels::BitsFloat(max_bits >= 0x7f800000u ? 0x7f800000u : max_bits);
}

bool ShiftsFromMaxima(const ReducerSetup& setup, const std::vector<float>& max_abs,
                      std::vector<int>* shifts) {
  const bool aps = setup.options.aps && setup.options.algo != AllReduceAlgo::kFp32;
  bool finite = true;
  for (std::size_t l = 0; l < setup.layers(); ++l) {
    if (!(max_abs[l] < std::numeric_limits<float>::infinity())) finite = false;
    // fp32 layers of a hybrid plan travel unshifted.
    const bool shifted = aps && setup.FormatOf(int(l)).family() != FormatFamily::kFloat32;
    const int emax = setup.EmaxOf(int(l));
    if (!shifted) {
      (*shifts)[l] = 0;
    } else if (setup.aps_sum) {
      (*shifts)[l] = SumContributionShift(max_abs[l], setup.workers, emax);
    } else {
      (*shifts)[l] = ApsShift(max_abs[l], setup.workers, emax);
    }
  }
  return finite;
}

// ---- APS sum scaling ----------------------------------------------------------------------------

int SumContributionShift(float max_abs, int workers, int emax) {
  // 127: the exponent of float32's largest power of two, so that W * max * 2^s <= 2^127.
  return std::min(ApsShift(max_abs, 1, emax), ApsShift(max_abs, workers, 127));
}

int SumShift(std::uint32_t max_sum_bits, int s, int emax) {
  const int t = ApsShift(kernels::BitsFloat(max_sum_bits & 0x7fffffffu), 1, emax);
  return std::clamp(t, -126 - s, 126 - s);
}

std::size_t GatherSlotBytes(const ReducerSetup& setup, const BucketPlan& b,
                            std::size_t slot_bytes) {
  if (!setup.aps_sum) return slot_bytes;
  std::size_t most = 0;
  for (int d = 0; d < setup.world_size; ++d) {
    most = std::max(most, b.seg_start[std::size_t(d) + 1] - b.seg_start[std::size_t(d)]);
  }
  return SlotBytes(slot_bytes + most);
}

// ---- SegmentSlots -------------------------------------------------------------------------------

std::vector<SegmentSlots> LayOutSegmentSlots(const ReducerSetup& setup, const AllReducePlan& plan,
                                             std::size_t* largest_segment) {
  std::vector<SegmentSlots> all;
  *largest_segment = 0;
  for (const BucketPlan& b : plan.buckets()) {
    SegmentSlots slots;
    for (int d = 0; d < setup.world_size; ++d) {
      std::size_t offset = 0;
      for (const Segment& s : b.segments_of(d)) {
        const std::size_t bytes = PackedSize(setup.FormatOf(s.layer), s.size(), 1);
        slots.offset.push_back(offset);
        offset += bytes;
        *largest_segment = std::max(*largest_segment, bytes);
      }
      slots.bytes = std::max(slots.bytes, offset);
    }
    slots.bytes = SlotBytes(slots.bytes);
    all.push_back(std::move(slots));
  }
  return all;
}

// ---- BucketAlgorithm ----------------------------------------------------------------------------

Status BucketAlgorithm::Reduce(float* const* inputs, float* output, std::int64_t step,
                               bool measure_error) {
  const std::vector<BucketPlan>& buckets = ctx_.plan.buckets();
  for (std::size_t i = 0; i < buckets.size(); ++i) {
    if (measure_error) {
      CPD_RETURN_IF_ERROR(ctx_.stats.ReduceReference(buckets[i], inputs, setup_.local_replicas));
    }
    CPD_RETURN_IF_ERROR(ReduceBucket(i, buckets[i], inputs, output, step));
    if (measure_error) CPD_RETURN_IF_ERROR(ctx_.stats.AccumulateError(buckets[i], output));
  }
  return Status::Ok();
}

}  // namespace cpd::comm::internal
