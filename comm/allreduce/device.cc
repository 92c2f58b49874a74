#include "comm/allreduce/device.h"

#include <string>
#include <utility>

#include "comm/allreduce/codes.h"
#include "cpd/config.h"

#if CPD_WITH_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "comm/allreduce/cuda_memory.h"
#include "comm/allreduce/device_transport.h"
#include "comm/allreduce/plan.h"
#include "comm/allreduce/streams.h"
#include "comm/reduce_kernels_cuda.h"
#include "cpd/quantize_cuda.h"
#include "kernels/grid.h"
#endif

namespace cpd::comm::internal {

#if !CPD_WITH_CUDA

Result<std::unique_ptr<GradientAllReducer>> CreateDeviceReducer(ReducerSetup) {
  return Status::InvalidArgument(
      "GradientAllReducer: gradients in device memory need a build with CUDA (CPD_WITH_CUDA=ON)");
}

#else

namespace {

class DeviceReducer final : public GradientAllReducer {
 public:
  explicit DeviceReducer(ReducerSetup setup)
      : setup_(std::move(setup)),
        plan_(setup_.layout, setup_.world_size, setup_.options.bucket_mb, kPiece),
        stream_(static_cast<cudaStream_t>(setup_.options.cuda_stream)),
        path_(PathFor(setup_)),
        max_abs_(setup_.layers(), 0.0f),
        shifts_(setup_.layers(), 0),
        counts_(3 * setup_.layers(), 0) {
    for (const BucketPlan& b : plan_.buckets()) buckets_.push_back(b.bounds);
    stats_ = NewLayerStats(setup_);
  }

  Status Init();

  Status Reduce(float* const* inputs, float* output, std::int64_t step,
                bool measure_error) override;
  bool last_nonfinite() const override { return nonfinite_; }
  const std::vector<LayerCommStats>& last_stats() const override { return stats_; }
  std::uint64_t last_bytes_sent() const override { return bytes_sent_; }
  const std::vector<GradientBucket>& buckets() const override { return buckets_; }

 private:
  // How contributions travel, as on the host: no quantisation (fp32), packed codes of a fixed
  // float grid (comm/allreduce/codes.h), cpd::Encode'd segments (packed, other formats: packed.cc's
  // PackedSegments) or quantised float32 values (emulate, other formats: EmulateFloats).
  enum class Path { kFp32, kCodes, kSegments, kFloats };
  static Path PathFor(const ReducerSetup& setup) {
    if (setup.options.algo == AllReduceAlgo::kFp32) return Path::kFp32;
    if (CodeTransport::Supports(setup.format)) return Path::kCodes;
    return setup.options.algo == AllReduceAlgo::kPacked ? Path::kSegments : Path::kFloats;
  }
  bool quantised() const { return path_ != Path::kFp32; }
  // The all-to-all slot of one contribution's share of bucket `index`'s chunks: the host path's,
  // so that the bytes sent are the same.
  std::size_t SlotBytes(std::size_t index) const {
    const BucketPlan& b = plan_.buckets()[index];
    switch (path_) {
      case Path::kCodes:
        return internal::SlotBytes(PackedCodeBytes(setup_.format, b.max_chunk));
      case Path::kSegments:
        return segment_slots_[index].bytes;
      default:
        return FloatSlotElems(b) * sizeof(float);
    }
  }
  DeviceLayers Layers() const {
    return DeviceLayers{d_offsets_.data(), d_shifts_.data(), int(setup_.layers())};
  }

  Status CheckDevicePointers(float* const* inputs, const float* output) const;
  // aps_sum: the buffers of the sum scaling, and every bucket's segment bounds uploaded.
  Status AllocateSumScaling();
  // ScanAbsCuda over every layer of every replica, the MAX all-reduce of the maxima on the host,
  // the shifts (uploaded for the kernels). *finite = false when some rank holds NaN/Inf.
  Status ScanAndShift(float* const* inputs, bool* finite);
  Status ReduceFp32(float* const* inputs, float* output, bool measure_error);
  Status StartMeasuring();
  Status ReduceReference(const BucketPlan& b, const float* const* src, int count);
  Status AccumulateError(const BucketPlan& b, const float* output);
  Status ReduceBucket(std::size_t index, float* const* inputs, float* output, std::int64_t step);
  // Fixed float grids: the stages of comm/allreduce/codes.h with the fused kernels.
  Status ReduceBucketCodes(std::size_t index, float* const* inputs, float* output,
                           std::int64_t step);
  Status SumOwnChunk(const BucketPlan& b, std::size_t slot, std::int64_t step);
  // The W contributions to this rank's chunk after the all-to-all: worker w's at w * slot.
  ContributionCodes ReceivedContributions(std::size_t slot) {
    ContributionCodes in;
    in.codes = d_recv_.data();
    in.stride = slot;
    in.workers = setup_.workers;
    return in;
  }
  // aps_sum: PackedCodes::SumShiftAndRequantizeOwnChunk, the float32 sums (SumCodesCuda), the
  // shifts t, the rounding of sum * 2^t (EncodeContributionCuda over the segments).
  Status SumShiftRequantize(std::size_t index, std::size_t slot, std::int64_t step);
  // APS sum scaling (ReducerSetup::aps_sum), the host path's stages: the max|sum| of each of this
  // rank's segments of b from the chunk's float32 sums in d_sum_ (from the chunk's start), back
  // on the host (waits for the stream), gives each segment's shift t; t goes to h_seg_shifts_
  // (at the bucket's segment index) and, as int8, after the codes of the all-gather's send slot
  // (at slot_bytes).
  Status PickSumShifts(const BucketPlan& b, std::size_t slot_bytes);
  // After the all-gather: every segment's s + t into h_seg_shifts_ (waits for the stream).
  Status ResultShifts(const BucketPlan& b, std::size_t slot_bytes, std::size_t gather_slot);
  // Chunk d's segments of bucket `index` with their uploaded shifts, as the kernels' "layers".
  DeviceLayers SegmentLayers(std::size_t index, int d) const {
    const BucketPlan& b = plan_.buckets()[index];
    const std::size_t s0 = b.seg_start[std::size_t(d)];
    return DeviceLayers{d_seg_bounds_.data() + seg_bounds_base_[index] + s0 + std::size_t(d),
                        d_seg_shifts_.data() + s0, int(b.seg_start[std::size_t(d) + 1] - s0)};
  }
  std::size_t GatherSlot(std::size_t index) const {
    return GatherSlotBytes(setup_, plan_.buckets()[index], SlotBytes(index));
  }
  // Other formats: packed.cc's PackedSegments and emulate.cc's EmulateFloats, stage by stage,
  // with cpd::EncodeCuda / DecodeCuda / QuantizeCuda per segment (their statistics wait for the
  // stream) and CombineCuda for the float32 arithmetic between roundings.
  Status ReduceBucketSegments(std::size_t index, float* const* inputs, float* output,
                              std::int64_t step);
  Status ReduceBucketFloats(std::size_t index, float* const* inputs, float* output,
                            std::int64_t step);
  Status RequantizeSegment(const BucketPlan& b, const SegmentSlots& slots, std::size_t si, int t,
                           std::int64_t step);
  Status AddRounded(const float* qw, const Segment& s, std::size_t rel, std::int64_t stage,
                    std::int64_t step);
  Status AddKahan(const float* qw, const Segment& s, std::size_t rel, std::int64_t stage,
                  std::int64_t step);
  // A packed segment of the format at `bytes` (device memory).
  PackedTensorCuda SegmentAt(const Segment& s, std::uint8_t* bytes) const;
  // StepContext::ApplyShift / Unshift on the device.
  Status ApplyShift(const BucketPlan& b, float* const* inputs);
  Status Unshift(const Segment& s, float* output);
  void AddQuantStats(int layer, const QuantStats& qs) {
    counts_[3 * std::size_t(layer)] += qs.flushed;
    counts_[3 * std::size_t(layer) + 1] += qs.saturated;
  }
  // Quantised algorithms: the flushed / saturated counters of every rank into stats_.
  Status FinishStats();

  const ReducerSetup setup_;
  const AllReducePlan plan_;
  const cudaStream_t stream_;
  const Path path_;
  int device_ = 0;
  std::unique_ptr<DeviceTransport> transport_;

  DeviceArray<std::uint64_t> d_offsets_;  // layout.offsets
  DeviceArray<std::int32_t> d_shifts_;    // per layer
  DeviceArray<std::uint32_t> d_max_bits_;
  DeviceArray<std::uint64_t> d_nonzero_;
  DeviceArray<std::uint64_t> d_counters_;  // flushed, saturated per layer
  PinnedArray<std::uint32_t> h_max_bits_;
  PinnedArray<std::uint64_t> h_nonzero_, h_counters_;
  PinnedArray<std::int32_t> h_shifts_;
  // The payload buffers of ExchangeBuffers, in device memory.
  DeviceArray<std::uint8_t> d_send_, d_recv_, d_gather_send_, d_gather_recv_;
  // kSegments: every bucket's slot layout. kSegments and kFloats: a chunk each of the sum and a
  // temporary (kFloats: the sum is also the all-gather's send slot); Kahan's c, y, high and t.
  std::vector<SegmentSlots> segment_slots_;
  DeviceArray<float> d_sum_, d_tmp_, d_comp_, d_y_, d_high_, d_t_;
  // aps_sum: per segment of a chunk its max|sum| bits (and ScanAbsCuda's unused count); per
  // segment of a bucket its shift (t, then s + t) and the gathered int8 t; per bucket the flat
  // bounds of its segments, chunk by chunk (chunk d's seg_start[d] - seg_start[d + 1] + 1
  // entries from seg_bounds_base_[bucket] + seg_start[d] + d).
  DeviceArray<std::uint32_t> d_seg_max_;
  DeviceArray<std::uint64_t> d_seg_nonzero_, d_seg_bounds_;
  DeviceArray<std::int32_t> d_seg_shifts_;
  PinnedArray<std::uint32_t> h_seg_max_;
  PinnedArray<std::int32_t> h_seg_shifts_;
  PinnedArray<std::int8_t> h_seg_meta_;
  std::vector<std::size_t> seg_bounds_base_;

  // measure_error (allocated on first use): the reference's send buffer (every chunk padded to
  // the longest) and this rank's chunk of it; host copies of it and of the result's chunk; the
  // per-layer (squared error, squared reference) of this rank and of all ranks.
  DeviceArray<float> d_reference_send_, d_reference_;
  std::vector<float> reference_, output_chunk_;
  std::vector<double> error_, error_all_ranks_;

  std::vector<float> max_abs_;
  std::vector<int> shifts_;
  std::vector<std::uint64_t> counts_;  // flushed, saturated, nonzero per layer
  std::vector<GradientBucket> buckets_;
  std::vector<LayerCommStats> stats_;
  bool nonfinite_ = false;
  std::uint64_t bytes_sent_ = 0;
};

Status DeviceReducer::Init() {
  CPD_COMM_CUDA_CHECK(cudaGetDevice(&device_));
  const std::size_t layers = setup_.layers();
  const std::size_t p = std::size_t(setup_.world_size);
  const std::size_t k = std::size_t(setup_.local_replicas);
  std::size_t slot = 0, payload = 0, largest_segment = 0;
  if (path_ == Path::kSegments) {
    segment_slots_ = LayOutSegmentSlots(setup_, plan_, &largest_segment);
  }
  std::size_t gather = 0;
  for (std::size_t i = 0; i < plan_.buckets().size(); ++i) {
    if (quantised()) {
      slot = std::max(slot, SlotBytes(i));
      gather = std::max(gather, GatherSlot(i));
    } else {
      payload = std::max(payload, plan_.buckets()[i].size() * sizeof(float));
    }
  }
  if (quantised()) {
    // The host path's limit, so that both accept the same options.
    CPD_RETURN_IF_ERROR(CheckBlockBytes(setup_, slot));
    CPD_RETURN_IF_ERROR(d_send_.Allocate(p * k * slot));
    CPD_RETURN_IF_ERROR(d_recv_.Allocate(p * k * slot));
    CPD_RETURN_IF_ERROR(d_gather_send_.Allocate(gather));
    CPD_RETURN_IF_ERROR(d_gather_recv_.Allocate(p * gather));
    for (auto* buf : {&d_send_, &d_recv_, &d_gather_send_, &d_gather_recv_}) {
      CPD_COMM_CUDA_CHECK(cudaMemset(buf->data(), 0, buf->bytes()));
    }
    payload = std::max(p * k * slot, p * gather);
  }
  if (setup_.aps_sum) CPD_RETURN_IF_ERROR(AllocateSumScaling());
  if (path_ == Path::kSegments || path_ == Path::kFloats) {
    const std::size_t chunk = plan_.max_chunk();
    // kFloats gathers from the sum: it spans a slot too.
    CPD_RETURN_IF_ERROR(d_sum_.Allocate(std::max(chunk, slot / sizeof(float))));
    CPD_RETURN_IF_ERROR(d_tmp_.Allocate(chunk));
    if (path_ == Path::kFloats && setup_.options.kahan) {
      for (auto* buf : {&d_comp_, &d_y_, &d_high_, &d_t_})
        CPD_RETURN_IF_ERROR(buf->Allocate(chunk));
    }
  }
  TransportSizes sizes;
  sizes.bytes = payload;
  // The per-layer counters, and measure_error's all-gather of (error, reference) pairs.
  sizes.small_count = std::max(3 * layers, (p + 1) * 2 * layers);
  CPD_ASSIGN_OR_RETURN(transport_,
                       DeviceTransport::Create(setup_.comm, setup_.options.cuda_stream, sizes));

  CPD_RETURN_IF_ERROR(d_offsets_.Allocate(layers + 1));
  CPD_RETURN_IF_ERROR(d_shifts_.Allocate(layers));
  CPD_RETURN_IF_ERROR(d_max_bits_.Allocate(layers));
  CPD_RETURN_IF_ERROR(d_nonzero_.Allocate(layers));
  CPD_RETURN_IF_ERROR(d_counters_.Allocate(2 * layers));
  CPD_RETURN_IF_ERROR(h_max_bits_.Allocate(layers));
  CPD_RETURN_IF_ERROR(h_nonzero_.Allocate(layers));
  CPD_RETURN_IF_ERROR(h_counters_.Allocate(2 * layers));
  CPD_RETURN_IF_ERROR(h_shifts_.Allocate(layers));
  std::vector<std::uint64_t> offsets(setup_.layout.offsets.begin(), setup_.layout.offsets.end());
  if (!offsets.empty()) {
    CPD_COMM_CUDA_CHECK(cudaMemcpy(d_offsets_.data(), offsets.data(),
                                   offsets.size() * sizeof(std::uint64_t), cudaMemcpyHostToDevice));
  }
  return Status::Ok();
}

Status DeviceReducer::Reduce(float* const* inputs, float* output, std::int64_t step,
                             bool measure_error) {
  CPD_RETURN_IF_ERROR(CheckReduceBuffers(setup_, inputs, output));
  CPD_COMM_CUDA_CHECK(cudaSetDevice(device_));
  CPD_RETURN_IF_ERROR(CheckDevicePointers(inputs, output));
  nonfinite_ = false;
  bytes_sent_ = 0;
  ResetLayerStats(&stats_);
  std::fill(counts_.begin(), counts_.end(), 0u);

  bool finite = true;
  CPD_RETURN_IF_ERROR(ScanAndShift(inputs, &finite));
  for (std::size_t l = 0; l < stats_.size(); ++l) {
    stats_[l].max_abs = max_abs_[l];
    stats_[l].shift = shifts_[l];
  }
  if (!finite) {
    nonfinite_ = true;
    return Status::Ok();
  }
  if (measure_error) CPD_RETURN_IF_ERROR(StartMeasuring());
  if (!quantised()) {
    CPD_RETURN_IF_ERROR(ReduceFp32(inputs, output, measure_error));
    CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  } else {
    for (std::size_t i = 0; i < plan_.buckets().size(); ++i) {
      const BucketPlan& b = plan_.buckets()[i];
      // The reference first: the inputs serve as scratch, and output may alias inputs[0].
      if (measure_error) CPD_RETURN_IF_ERROR(ReduceReference(b, inputs, setup_.local_replicas));
      CPD_RETURN_IF_ERROR(ReduceBucket(i, inputs, output, step));
      if (measure_error) CPD_RETURN_IF_ERROR(AccumulateError(b, output));
    }
    CPD_RETURN_IF_ERROR(FinishStats());  // waits for the stream
  }
  if (!measure_error) return Status::Ok();
  CPD_RETURN_IF_ERROR(transport_->AllGatherHost(
      reinterpret_cast<const std::uint8_t*>(error_.data()),
      reinterpret_cast<std::uint8_t*>(error_all_ranks_.data()), error_.size() * sizeof(double)));
  SetRelErrors(setup_, error_all_ranks_, &stats_);
  return Status::Ok();
}

// measure_error: the reference buffers on first use (as the host path's LayerStatistics), the
// per-layer error sums zeroed.
Status DeviceReducer::StartMeasuring() {
  const std::size_t p = std::size_t(setup_.world_size), chunk = plan_.max_chunk();
  if (reference_.empty()) {
    CPD_RETURN_IF_ERROR(d_reference_send_.Allocate(p * chunk));
    CPD_RETURN_IF_ERROR(d_reference_.Allocate(chunk));
    CPD_RETURN_IF_ERROR(transport_->Reserve(p * chunk * sizeof(float)));
    reference_.assign(std::max<std::size_t>(chunk, 1), 0.0f);
    output_chunk_.assign(std::max<std::size_t>(chunk, 1), 0.0f);
    error_all_ranks_.assign(2 * setup_.layers() * p, 0.0);
  }
  error_.assign(2 * setup_.layers(), 0.0);
  return Status::Ok();
}

// LayerStatistics::ReduceReference on the device: the float32 sum of the `count` local buffers in
// order, chunk by chunk padded to the longest, reduce-scattered.
Status DeviceReducer::ReduceReference(const BucketPlan& b, const float* const* src, int count) {
  const std::size_t slot = b.max_chunk;
  for (int d = 0; d < setup_.world_size; ++d) {
    const std::size_t c0 = b.chunk_begin(d), n = b.chunk_end(d) - c0;
    float* dst = d_reference_send_.data() + std::size_t(d) * slot;
    if (count == 1 && n > 0) {
      CPD_COMM_CUDA_CHECK(
          cudaMemcpyAsync(dst, src[0] + c0, n * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    }
    for (int k = 1; k < count; ++k) {
      CPD_RETURN_IF_ERROR(
          CombineCuda(k == 1 ? src[0] + c0 : dst, src[k] + c0, dst, n, ElementOp::kAdd, stream_));
    }
    if (slot > n) {
      CPD_COMM_CUDA_CHECK(cudaMemsetAsync(dst + n, 0, (slot - n) * sizeof(float), stream_));
    }
  }
  return transport_->ReduceScatterSum(d_reference_send_.data(), d_reference_.data(),
                                      slot * std::size_t(setup_.world_size));
}

// LayerStatistics::AccumulateError: this rank's chunk of the result and its reference on the
// host (measure_error's float32 copies), then the host path's sums.
Status DeviceReducer::AccumulateError(const BucketPlan& b, const float* output) {
  const std::size_t c0 = b.chunk_begin(setup_.rank), n = b.chunk_end(setup_.rank) - c0;
  if (n == 0) return Status::Ok();
  CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(output_chunk_.data(), output + c0, n * sizeof(float),
                                      cudaMemcpyDeviceToHost, stream_));
  CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(reference_.data(), d_reference_.data(), n * sizeof(float),
                                      cudaMemcpyDeviceToHost, stream_));
  CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  AddChunkErrors(b, setup_.rank, output_chunk_.data(), reference_.data(), &error_);
  return Status::Ok();
}

Status DeviceReducer::CheckDevicePointers(float* const* inputs, const float* output) const {
  if (setup_.layout.total() == 0) return Status::Ok();
  auto check = [&](const void* p, const std::string& what) -> Status {
    cudaPointerAttributes attr;
    CPD_COMM_CUDA_CHECK(cudaPointerGetAttributes(&attr, p));
    if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) {
      return Status::Ok();
    }
    return Status::InvalidArgument("GradientAllReducer::Reduce on rank " +
                                   std::to_string(setup_.rank) + ": " + what +
                                   " is not device memory, but options.gradients is kDevice");
  };
  for (int k = 0; k < setup_.local_replicas; ++k) {
    CPD_RETURN_IF_ERROR(check(inputs[k], "inputs[" + std::to_string(k) + "]"));
  }
  return check(output, "output");
}

Status DeviceReducer::ScanAndShift(float* const* inputs, bool* finite) {
  const std::size_t layers = setup_.layers();
  const GradientLayout& layout = setup_.layout;
  if (layers > 0) {
    CPD_COMM_CUDA_CHECK(
        cudaMemsetAsync(d_max_bits_.data(), 0, layers * sizeof(std::uint32_t), stream_));
    CPD_COMM_CUDA_CHECK(
        cudaMemsetAsync(d_nonzero_.data(), 0, layers * sizeof(std::uint64_t), stream_));
    for (std::size_t l = 0; l < layers; ++l) {
      for (int k = 0; k < setup_.local_replicas; ++k) {
        CPD_RETURN_IF_ERROR(ScanAbsCuda(inputs[k] + layout.offsets[l], setup_.layer_size(l),
                                        d_max_bits_.data() + l, d_nonzero_.data() + l, stream_));
      }
    }
    CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(h_max_bits_.data(), d_max_bits_.data(),
                                        layers * sizeof(std::uint32_t), cudaMemcpyDeviceToHost,
                                        stream_));
    CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(h_nonzero_.data(), d_nonzero_.data(),
                                        layers * sizeof(std::uint64_t), cudaMemcpyDeviceToHost,
                                        stream_));
    CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  for (std::size_t l = 0; l < layers; ++l) {
    max_abs_[l] = MaxAbsForAllReduce(h_max_bits_.data()[l]);
    counts_[3 * l + 2] = h_nonzero_.data()[l];
  }
  CPD_RETURN_IF_ERROR(transport_->AllReduceHost(max_abs_.data(), layers, ReduceOp::kMax));
  *finite = ShiftsFromMaxima(setup_, max_abs_, &shifts_);
  if (!*finite || layers == 0) return Status::Ok();
  std::copy(shifts_.begin(), shifts_.end(), h_shifts_.data());
  CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(d_shifts_.data(), h_shifts_.data(),
                                      layers * sizeof(std::int32_t), cudaMemcpyHostToDevice,
                                      stream_));
  if (path_ == Path::kCodes) {
    CPD_COMM_CUDA_CHECK(
        cudaMemsetAsync(d_counters_.data(), 0, 2 * layers * sizeof(std::uint64_t), stream_));
  }
  return Status::Ok();
}

// fp32: the K replicas summed in replica order (comm/allreduce/fp32.cc), then each bucket's
// sum all-reduce (with measure_error, its reference from that local sum first).
Status DeviceReducer::ReduceFp32(float* const* inputs, float* output, bool measure_error) {
  const std::size_t total = setup_.layout.total();
  const int replicas = setup_.local_replicas;
  if (total > 0 && replicas == 1 && output != inputs[0]) {
    CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(output, inputs[0], total * sizeof(float),
                                        cudaMemcpyDeviceToDevice, stream_));
  }
  for (int k = 1; k < replicas; ++k) {
    CPD_RETURN_IF_ERROR(CombineCuda(k == 1 ? inputs[0] : output, inputs[k], output, total,
                                    ElementOp::kAdd, stream_));
  }
  const float* local[1] = {output};
  for (const BucketPlan& b : plan_.buckets()) {
    if (measure_error) CPD_RETURN_IF_ERROR(ReduceReference(b, local, 1));
    CPD_RETURN_IF_ERROR(transport_->AllReduceSum(output + b.bounds.begin, b.size()));
    bytes_sent_ += SentByAllReduce(setup_.world_size, b.size() * sizeof(float));
    if (measure_error) CPD_RETURN_IF_ERROR(AccumulateError(b, output));
  }
  return Status::Ok();
}

Status DeviceReducer::ReduceBucket(std::size_t index, float* const* inputs, float* output,
                                   std::int64_t step) {
  switch (path_) {
    case Path::kCodes:
      return ReduceBucketCodes(index, inputs, output, step);
    case Path::kSegments:
      return ReduceBucketSegments(index, inputs, output, step);
    default:
      return ReduceBucketFloats(index, inputs, output, step);
  }
}

// One bucket of emulate / packed with a fixed float grid, the stages of comm/allreduce/codes.h.
Status DeviceReducer::ReduceBucketCodes(std::size_t index, float* const* inputs, float* output,
                                        std::int64_t step) {
  const BucketPlan& b = plan_.buckets()[index];
  const std::size_t slot = SlotBytes(index);
  const std::size_t block = std::size_t(setup_.local_replicas) * slot;
  const kernels::FloatGrid& g = setup_.format.grid();
  for (int d = 0; d < setup_.world_size; ++d) {
    const std::size_t c0 = b.chunk_begin(d), n = b.chunk_end(d) - c0;
    for (int k = 0; k < setup_.local_replicas; ++k) {
      const std::uint64_t key =
          setup_.LoopAt(setup_.round_mode, ContributionStage(setup_.worker(k)), step, c0).rng_key;
      CPD_RETURN_IF_ERROR(
          EncodeContributionCuda(inputs[k] + c0, n, c0, Layers(), g, setup_.round_mode, key,
                                 d_send_.data() + std::size_t(d) * block + std::size_t(k) * slot,
                                 d_counters_.data(), stream_));
    }
  }
  CPD_RETURN_IF_ERROR(transport_->AllToAllBytes(d_send_.data(), d_recv_.data(), block));
  bytes_sent_ += SentByExchange(setup_.world_size, block);
  if (setup_.aps_sum) {
    CPD_RETURN_IF_ERROR(SumShiftRequantize(index, slot, step));
  } else {
    CPD_RETURN_IF_ERROR(SumOwnChunk(b, slot, step));
  }
  const std::size_t gather = GatherSlot(index);
  CPD_RETURN_IF_ERROR(
      transport_->AllGatherBytes(d_gather_send_.data(), d_gather_recv_.data(), gather));
  bytes_sent_ += SentByExchange(setup_.world_size, gather);
  if (setup_.aps_sum) CPD_RETURN_IF_ERROR(ResultShifts(b, slot, gather));
  for (int d = 0; d < setup_.world_size; ++d) {
    const std::size_t c0 = b.chunk_begin(d), n = b.chunk_end(d) - c0;
    CPD_RETURN_IF_ERROR(DecodeUnshiftCuda(d_gather_recv_.data() + std::size_t(d) * gather, n, c0,
                                          setup_.aps_sum ? SegmentLayers(index, d) : Layers(), g,
                                          output + c0, stream_));
  }
  return Status::Ok();
}

Status DeviceReducer::SumShiftRequantize(std::size_t index, std::size_t slot, std::int64_t step) {
  const BucketPlan& b = plan_.buckets()[index];
  const int rank = setup_.rank, workers = setup_.workers;
  const std::size_t c0 = b.chunk_begin(rank), n = b.chunk_end(rank) - c0;
  const ContributionCodes in = ReceivedContributions(slot);
  const kernels::FloatGrid& g = setup_.format.grid();
  CPD_RETURN_IF_ERROR(SumCodesCuda(in, n, g, d_sum_.data(), stream_));
  CPD_RETURN_IF_ERROR(PickSumShifts(b, slot));
  const std::uint64_t key =
      setup_.LoopAt(setup_.round_mode, RequantizeStage(workers), step, c0).rng_key;
  return EncodeContributionCuda(d_sum_.data(), n, c0, SegmentLayers(index, rank), g,
                                setup_.round_mode, key, d_gather_send_.data(), nullptr, stream_);
}

Status DeviceReducer::AllocateSumScaling() {
  std::size_t chunk_segments = 0, bucket_segments = 0;
  std::vector<std::uint64_t> bounds;
  for (const BucketPlan& b : plan_.buckets()) {
    seg_bounds_base_.push_back(bounds.size());
    bucket_segments = std::max(bucket_segments, b.segments.size());
    for (int d = 0; d < setup_.world_size; ++d) {
      const std::span<const Segment> segments = b.segments_of(d);
      chunk_segments = std::max(chunk_segments, segments.size());
      for (const Segment& sg : segments) bounds.push_back(sg.begin);
      bounds.push_back(segments.empty() ? b.chunk_begin(d) : segments.back().end);
    }
  }
  CPD_RETURN_IF_ERROR(d_seg_max_.Allocate(chunk_segments));
  CPD_RETURN_IF_ERROR(d_seg_nonzero_.Allocate(chunk_segments));
  CPD_RETURN_IF_ERROR(h_seg_max_.Allocate(chunk_segments));
  CPD_RETURN_IF_ERROR(d_seg_shifts_.Allocate(bucket_segments));
  CPD_RETURN_IF_ERROR(h_seg_shifts_.Allocate(bucket_segments));
  CPD_RETURN_IF_ERROR(h_seg_meta_.Allocate(bucket_segments));
  CPD_RETURN_IF_ERROR(d_seg_bounds_.Allocate(bounds.size()));
  if (!bounds.empty()) {
    CPD_COMM_CUDA_CHECK(cudaMemcpy(d_seg_bounds_.data(), bounds.data(),
                                   bounds.size() * sizeof(std::uint64_t), cudaMemcpyHostToDevice));
  }
  // The codes path sums a chunk here (the other paths allocate d_sum_ themselves).
  if (path_ == Path::kCodes) CPD_RETURN_IF_ERROR(d_sum_.Allocate(plan_.max_chunk()));
  return Status::Ok();
}

Status DeviceReducer::PickSumShifts(const BucketPlan& b, std::size_t slot_bytes) {
  const int rank = setup_.rank;
  const std::span<const Segment> own = b.segments_of(rank);
  if (own.empty()) return Status::Ok();
  const std::size_t c0 = b.chunk_begin(rank), seg0 = b.seg_start[std::size_t(rank)];
  CPD_COMM_CUDA_CHECK(
      cudaMemsetAsync(d_seg_max_.data(), 0, own.size() * sizeof(std::uint32_t), stream_));
  for (std::size_t j = 0; j < own.size(); ++j) {
    CPD_RETURN_IF_ERROR(ScanAbsCuda(d_sum_.data() + (own[j].begin - c0), own[j].size(),
                                    d_seg_max_.data() + j, d_seg_nonzero_.data() + j, stream_));
  }
  CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(h_seg_max_.data(), d_seg_max_.data(),
                                      own.size() * sizeof(std::uint32_t), cudaMemcpyDeviceToHost,
                                      stream_));
  CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (std::size_t j = 0; j < own.size(); ++j) {
    const int t = SumShift(h_seg_max_.data()[j], shifts_[std::size_t(own[j].layer)], setup_.emax);
    h_seg_shifts_.data()[seg0 + j] = t;
    h_seg_meta_.data()[j] = std::int8_t(t);
  }
  CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(d_gather_send_.data() + slot_bytes, h_seg_meta_.data(),
                                      own.size(), cudaMemcpyHostToDevice, stream_));
  CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(d_seg_shifts_.data() + seg0, h_seg_shifts_.data() + seg0,
                                      own.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice,
                                      stream_));
  return Status::Ok();
}

Status DeviceReducer::ResultShifts(const BucketPlan& b, std::size_t slot_bytes,
                                   std::size_t gather_slot) {
  if (b.segments.empty()) return Status::Ok();
  for (int d = 0; d < setup_.world_size; ++d) {
    const std::size_t s0 = b.seg_start[std::size_t(d)];
    const std::size_t count = b.seg_start[std::size_t(d) + 1] - s0;
    if (count == 0) continue;
    CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(
        h_seg_meta_.data() + s0, d_gather_recv_.data() + std::size_t(d) * gather_slot + slot_bytes,
        count, cudaMemcpyDeviceToHost, stream_));
  }
  CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (std::size_t si = 0; si < b.segments.size(); ++si) {
    h_seg_shifts_.data()[si] =
        shifts_[std::size_t(b.segments[si].layer)] + int(h_seg_meta_.data()[si]);
  }
  CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(d_seg_shifts_.data(), h_seg_shifts_.data(),
                                      b.segments.size() * sizeof(std::int32_t),
                                      cudaMemcpyHostToDevice, stream_));
  return Status::Ok();
}

// This rank's chunk from the W contributions (worker w's slot at w * slot after the all-to-all),
// packed into the all-gather's send slot: PackedCodes::SumAndRequantizeOwnChunk and
// EmulateCodes::SumOwnChunk on the device.
Status DeviceReducer::SumOwnChunk(const BucketPlan& b, std::size_t slot, std::int64_t step) {
  const int rank = setup_.rank, workers = setup_.workers;
  const std::size_t c0 = b.chunk_begin(rank), n = b.chunk_end(rank) - c0;
  const ContributionCodes in = ReceivedContributions(slot);
  const kernels::FloatGrid& g = setup_.format.grid();
  if (setup_.options.algo == AllReduceAlgo::kPacked) {
    return SumRequantizeCodesCuda(
        in, n, g, setup_.LoopAt(setup_.round_mode, RequantizeStage(workers), step, c0),
        d_gather_send_.data(), stream_);
  }
  EmulateRounding r;
  r.mode = setup_.round_mode;
  r.kahan = setup_.options.kahan;
  r.seed = setup_.options.seed;
  r.step = step;
  r.index_base = c0;
  return SumRoundedCodesCuda(in, n, g, r, d_gather_send_.data(), stream_);
}

PackedTensorCuda DeviceReducer::SegmentAt(const Segment& s, std::uint8_t* bytes) const {
  PackedTensorCuda t;
  t.count = s.size();
  t.channels = 1;  // a segment is one scale group
  t.bytes = bytes;
  t.size = PackedSize(setup_.format, s.size(), 1);
  return t;
}

Status DeviceReducer::ApplyShift(const BucketPlan& b, float* const* inputs) {
  for (int k = 0; k < setup_.local_replicas; ++k) {
    for (const Segment& s : b.segments) {
      const int sh = shifts_[std::size_t(s.layer)];
      if (sh != 0) {
        CPD_RETURN_IF_ERROR(ScaleCuda(inputs[k] + s.begin, s.size(), kernels::Pow2(sh), stream_));
      }
    }
  }
  return Status::Ok();
}

Status DeviceReducer::Unshift(const Segment& s, float* output) {
  const int sh = shifts_[std::size_t(s.layer)];
  if (sh == 0) return Status::Ok();
  return ScaleCuda(output + s.begin, s.size(), kernels::Pow2(-sh), stream_);
}

// packed, other formats (PackedSegments::ReduceBucket): cpd::Encode per segment with its scale
// metadata, the W contributions decoded and summed in float32 in worker order, one
// re-quantisation, decoded and unshifted after the all-gather.
Status DeviceReducer::ReduceBucketSegments(std::size_t index, float* const* inputs, float* output,
                                           std::int64_t step) {
  const BucketPlan& b = plan_.buckets()[index];
  const SegmentSlots& slots = segment_slots_[index];
  const std::size_t block = std::size_t(setup_.local_replicas) * slots.bytes;
  CPD_RETURN_IF_ERROR(ApplyShift(b, inputs));
  for (int d = 0; d < setup_.world_size; ++d) {
    for (int k = 0; k < setup_.local_replicas; ++k) {
      std::uint8_t* dst = d_send_.data() + std::size_t(d) * block + std::size_t(k) * slots.bytes;
      for (std::size_t si = b.seg_start[std::size_t(d)]; si < b.seg_start[std::size_t(d) + 1];
           ++si) {
        const Segment& s = b.segments[si];
        PackedTensorCuda packed = SegmentAt(s, dst + slots.offset[si]);
        QuantStats qs;
        CPD_RETURN_IF_ERROR(
            EncodeCuda(setup_.format, inputs[k] + s.begin, s.size(),
                       setup_.QuantizeAt(ContributionStage(setup_.worker(k)), step, s.begin),
                       &packed, &qs, stream_));
        AddQuantStats(s.layer, qs);
      }
    }
  }
  CPD_RETURN_IF_ERROR(transport_->AllToAllBytes(d_send_.data(), d_recv_.data(), block));
  bytes_sent_ += SentByExchange(setup_.world_size, block);

  const int rank = setup_.rank;
  const std::size_t c0 = b.chunk_begin(rank);
  for (std::size_t si = b.seg_start[std::size_t(rank)]; si < b.seg_start[std::size_t(rank) + 1];
       ++si) {
    const Segment& s = b.segments[si];
    float* sum = d_sum_.data() + (s.begin - c0);
    float* tmp = d_tmp_.data() + (s.begin - c0);
    for (int w = 0; w < setup_.workers; ++w) {
      const PackedTensorCuda in =
          SegmentAt(s, d_recv_.data() + std::size_t(w) * slots.bytes + slots.offset[si]);
      CPD_RETURN_IF_ERROR(DecodeCuda(setup_.format, in, w == 0 ? sum : tmp, stream_));
      if (w > 0)
        CPD_RETURN_IF_ERROR(CombineCuda(sum, tmp, sum, s.size(), ElementOp::kAdd, stream_));
    }
    // aps_sum rounds once every segment's shift t is known, below.
    if (!setup_.aps_sum) CPD_RETURN_IF_ERROR(RequantizeSegment(b, slots, si, 0, step));
  }
  if (setup_.aps_sum) {
    CPD_RETURN_IF_ERROR(PickSumShifts(b, slots.bytes));
    for (std::size_t si = b.seg_start[std::size_t(rank)];
         si < b.seg_start[std::size_t(rank) + 1]; ++si) {
      CPD_RETURN_IF_ERROR(RequantizeSegment(b, slots, si, h_seg_shifts_.data()[si], step));
    }
  }
  const std::size_t gather = GatherSlot(index);
  CPD_RETURN_IF_ERROR(
      transport_->AllGatherBytes(d_gather_send_.data(), d_gather_recv_.data(), gather));
  bytes_sent_ += SentByExchange(setup_.world_size, gather);

  if (setup_.aps_sum) CPD_RETURN_IF_ERROR(ResultShifts(b, slots.bytes, gather));
  for (int d = 0; d < setup_.world_size; ++d) {
    std::uint8_t* chunk = d_gather_recv_.data() + std::size_t(d) * gather;
    for (std::size_t si = b.seg_start[std::size_t(d)]; si < b.seg_start[std::size_t(d) + 1]; ++si) {
      const Segment& s = b.segments[si];
      CPD_RETURN_IF_ERROR(DecodeCuda(setup_.format, SegmentAt(s, chunk + slots.offset[si]),
                                     output + s.begin, stream_));
      if (!setup_.aps_sum) {
        CPD_RETURN_IF_ERROR(Unshift(s, output));
      } else if (const int sh = h_seg_shifts_.data()[si]; sh != 0) {
        CPD_RETURN_IF_ERROR(ScaleCuda(output + s.begin, s.size(), kernels::Pow2(-sh), stream_));
      }
    }
  }
  return Status::Ok();
}

// This rank's segment si of b: its float32 sum in d_sum_ times 2^t (aps_sum; t = 0 otherwise),
// cpd::EncodeCuda'd into the all-gather's send slot (PackedSegments::SumAndRequantizeOwnChunk).
Status DeviceReducer::RequantizeSegment(const BucketPlan& b, const SegmentSlots& slots,
                                        std::size_t si, int t, std::int64_t step) {
  const Segment& s = b.segments[si];
  float* sum = d_sum_.data() + (s.begin - b.chunk_begin(setup_.rank));
  if (t != 0) CPD_RETURN_IF_ERROR(ScaleCuda(sum, s.size(), kernels::Pow2(t), stream_));
  PackedTensorCuda packed = SegmentAt(s, d_gather_send_.data() + slots.offset[si]);
  return EncodeCuda(setup_.format, sum, s.size(),
                    setup_.QuantizeAt(RequantizeStage(setup_.workers), step, s.begin), &packed,
                    nullptr, stream_);
}

// emulate, other formats (EmulateFloats::ReduceBucket): every contribution quantised as float32
// values, the W contributions of each segment summed in worker order with every addition (or
// Kahan operation) rounded to the format, the chunks all-gathered and unshifted.
Status DeviceReducer::ReduceBucketFloats(std::size_t index, float* const* inputs, float* output,
                                         std::int64_t step) {
  const BucketPlan& b = plan_.buckets()[index];
  const std::size_t slot = FloatSlotElems(b);
  const std::size_t block = std::size_t(setup_.local_replicas) * slot;
  CPD_RETURN_IF_ERROR(ApplyShift(b, inputs));
  float* send = reinterpret_cast<float*>(d_send_.data());
  for (int d = 0; d < setup_.world_size; ++d) {
    for (int k = 0; k < setup_.local_replicas; ++k) {
      float* dst = send + std::size_t(d) * block + std::size_t(k) * slot;
      for (const Segment& s : b.segments_of(d)) {
        QuantStats qs;
        CPD_RETURN_IF_ERROR(QuantizeCuda(
            setup_.format, inputs[k] + s.begin, dst + (s.begin - b.chunk_begin(d)), s.size(),
            setup_.QuantizeAt(ContributionStage(setup_.worker(k)), step, s.begin), &qs, stream_));
        AddQuantStats(s.layer, qs);
      }
    }
  }
  CPD_RETURN_IF_ERROR(
      transport_->AllToAllBytes(d_send_.data(), d_recv_.data(), block * sizeof(float)));
  bytes_sent_ += SentByExchange(setup_.world_size, block * sizeof(float));

  const float* recv = reinterpret_cast<const float*>(d_recv_.data());
  const std::size_t c0 = b.chunk_begin(setup_.rank);
  for (const Segment& s : b.segments_of(setup_.rank)) {
    const std::size_t rel = s.begin - c0;
    auto q = [&](int w) { return recv + std::size_t(w) * slot + rel; };
    CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(d_sum_.data() + rel, q(0), s.size() * sizeof(float),
                                        cudaMemcpyDeviceToDevice, stream_));
    if (setup_.options.kahan) {
      CPD_COMM_CUDA_CHECK(
          cudaMemsetAsync(d_comp_.data() + rel, 0, s.size() * sizeof(float), stream_));
    }
    for (int w = 1; w < setup_.workers; ++w) {
      const std::int64_t stage = AdditionStage(setup_.workers, w);
      CPD_RETURN_IF_ERROR(setup_.options.kahan ? AddKahan(q(w), s, rel, stage, step)
                                               : AddRounded(q(w), s, rel, stage, step));
    }
  }
  const std::size_t slot_bytes = slot * sizeof(float);
  CPD_RETURN_IF_ERROR(transport_->AllGatherBytes(
      reinterpret_cast<const std::uint8_t*>(d_sum_.data()), d_gather_recv_.data(), slot_bytes));
  bytes_sent_ += SentByExchange(setup_.world_size, slot_bytes);

  const float* gathered = reinterpret_cast<const float*>(d_gather_recv_.data());
  for (int d = 0; d < setup_.world_size; ++d) {
    for (const Segment& s : b.segments_of(d)) {
      const float* src = gathered + std::size_t(d) * slot + (s.begin - b.chunk_begin(d));
      CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(output + s.begin, src, s.size() * sizeof(float),
                                          cudaMemcpyDeviceToDevice, stream_));
      // The host multiplies by 2^-s even for s = 0; x * 1 is x, NaN included.
      CPD_RETURN_IF_ERROR(Unshift(s, output));
    }
  }
  return Status::Ok();
}

// sum = Q(sum + q_w) over segment s (at rel in the chunk): EmulateFloats::AddRounded.
Status DeviceReducer::AddRounded(const float* qw, const Segment& s, std::size_t rel,
                                 std::int64_t stage, std::int64_t step) {
  float* acc = d_sum_.data() + rel;
  float* tmp = d_tmp_.data() + rel;
  CPD_RETURN_IF_ERROR(CombineCuda(acc, qw, tmp, s.size(), ElementOp::kAdd, stream_));
  return QuantizeCuda(setup_.format, tmp, acc, s.size(), setup_.QuantizeAt(stage, step, s.begin),
                      nullptr, stream_);
}

// One step of Kahan's compensated sum, every operation rounded: EmulateFloats::AddKahan.
Status DeviceReducer::AddKahan(const float* qw, const Segment& s, std::size_t rel,
                               std::int64_t stage, std::int64_t step) {
  const std::size_t n = s.size();
  float *acc = d_sum_.data() + rel, *tmp = d_tmp_.data() + rel, *c = d_comp_.data() + rel,
        *y = d_y_.data() + rel, *high = d_high_.data() + rel, *t = d_t_.data() + rel;
  auto round = [&](float* out, int op) {
    return QuantizeCuda(setup_.format, tmp, out, n, setup_.QuantizeAt(stage + op, step, s.begin),
                        nullptr, stream_);
  };
  CPD_RETURN_IF_ERROR(CombineCuda(qw, c, tmp, n, ElementOp::kSubtract, stream_));
  CPD_RETURN_IF_ERROR(round(y, kKahanY));
  CPD_RETURN_IF_ERROR(CombineCuda(acc, y, tmp, n, ElementOp::kAdd, stream_));
  CPD_RETURN_IF_ERROR(round(t, kKahanT));
  CPD_RETURN_IF_ERROR(CombineCuda(t, acc, tmp, n, ElementOp::kSubtract, stream_));
  CPD_RETURN_IF_ERROR(round(high, kKahanHigh));
  CPD_RETURN_IF_ERROR(CombineCuda(high, y, tmp, n, ElementOp::kSubtract, stream_));
  CPD_RETURN_IF_ERROR(round(c, kKahanC));
  CPD_COMM_CUDA_CHECK(
      cudaMemcpyAsync(acc, t, n * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
  return Status::Ok();
}

Status DeviceReducer::FinishStats() {
  const std::size_t layers = setup_.layers();
  if (path_ == Path::kCodes && layers > 0) {
    CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(h_counters_.data(), d_counters_.data(),
                                        2 * layers * sizeof(std::uint64_t), cudaMemcpyDeviceToHost,
                                        stream_));
  }
  CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (std::size_t l = 0; path_ == Path::kCodes && l < layers; ++l) {
    counts_[3 * l] += h_counters_.data()[2 * l];
    counts_[3 * l + 1] += h_counters_.data()[2 * l + 1];
  }
  CPD_RETURN_IF_ERROR(transport_->AllReduceHost(counts_.data(), counts_.size(), ReduceOp::kSum));
  SetCountFractions(setup_, counts_, &stats_);
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<GradientAllReducer>> CreateDeviceReducer(ReducerSetup setup) {
  auto reducer = std::make_unique<DeviceReducer>(std::move(setup));
  CPD_RETURN_IF_ERROR(reducer->Init());
  return std::unique_ptr<GradientAllReducer>(std::move(reducer));
}

#endif  // CPD_WITH_CUDA

}  // namespace cpd::comm::internal
