// The device back end of the gradient all-reduce (comm/allreduce/backend.h), for gradients in
// device memory (GradientAllReduceOptions::gradients = kDevice): the CUDA twins of the host
// loops (comm/reduce_kernels_cuda.h, cpd::EncodeCuda / DecodeCuda / QuantizeCuda) queued on the
// reducer's stream, buffers in device memory, the blocking payload collectives through a
// DeviceTransport (direct over NCCL, staged through pinned memory over MPI/Self), and the
// nonblocking exchange of a pipelined schedule staged through pinned mirrors of the exchanged
// buffers (MPI only: NCCL's communicator has none, so its schedule stays sequential).
// A stage over a run of pieces is one kernel over their flat range (pieces are contiguous), which
// computes what the host loops compute piece by piece, bit for bit.
#include "comm/allreduce/backend.h"
#include "cpd/config.h"

#if CPD_WITH_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <utility>

#include "comm/allreduce/codes.h"
#include "comm/allreduce/cuda_memory.h"
#include "comm/allreduce/device_transport.h"
#include "comm/allreduce/internal.h"
#include "comm/reduce_kernels_cuda.h"
#include "cpd/quantize_cuda.h"
#endif

namespace cpd::comm::internal {

#if !CPD_WITH_CUDA

Result<std::unique_ptr<Backend>> MakeDeviceBackend(const ReducerSetup&, const AllReducePlan&) {
  return Status::InvalidArgument(
      "GradientAllReducer: gradients in device memory need a build with CUDA (CPD_WITH_CUDA=ON)");
}

#else

namespace {

void FreeDevice(void* p) { cudaFree(p); }

// An exchange staged through pinned mirrors: the send blocks were copied down before it started;
// once the host exchange is complete, the received blocks are queued for upload (once).
class StagedExchange final : public Communicator::PendingExchange {
 public:
  struct Upload {
    void* device = nullptr;
    const void* pinned = nullptr;
    std::size_t bytes = 0;
  };
  StagedExchange(std::unique_ptr<Communicator::PendingExchange> host, std::vector<Upload> uploads,
                 cudaStream_t stream)
      : host_(std::move(host)), uploads_(std::move(uploads)), stream_(stream) {}

  Status Test(bool* done) override {
    CPD_RETURN_IF_ERROR(host_->Test(done));
    if (*done) return QueueUploads();
    return Status::Ok();
  }
  Status Wait() override {
    CPD_RETURN_IF_ERROR(host_->Wait());
    return QueueUploads();
  }

 private:
  Status QueueUploads() {
    if (uploaded_) return Status::Ok();
    uploaded_ = true;
    for (const Upload& u : uploads_) {
      CPD_COMM_CUDA_CHECK(
          cudaMemcpyAsync(u.device, u.pinned, u.bytes, cudaMemcpyHostToDevice, stream_));
    }
    return Status::Ok();
  }

  std::unique_ptr<Communicator::PendingExchange> host_;
  std::vector<Upload> uploads_;
  cudaStream_t stream_;
  bool uploaded_ = false;
};

class DeviceBackend final : public Backend {
 public:
  DeviceBackend(const ReducerSetup& setup, const AllReducePlan& plan)
      : setup_(setup),
        plan_(plan),
        comm_(*setup.comm),
        stream_(static_cast<cudaStream_t>(setup.options.cuda_stream)),
        layers_(setup.layers()),
        bits_(setup.format.bits()),
        codes_(!setup.mixed() && CodeTransport::Supports(setup.format)),
        // The pipelined schedule's exchange is staged through pinned mirrors over a host
        // communicator that has one; a device-memory one (NCCL) has none.
        staged_exchange_(setup.comm->memory() == MemorySpace::kHost &&
                         setup.comm->has_nonblocking_exchange() && setup.world_size > 1) {}

  Status Init() {
    CPD_COMM_CUDA_CHECK(cudaGetDevice(&device_));
    const std::size_t p = std::size_t(setup_.world_size);
    TransportSizes sizes;
    // The payload staging grows on first use (Reserve); the per-layer counters, and
    // measure_error's all-gather of (error, reference) pairs, are known now.
    sizes.small_count = std::max(3 * layers_, (p + 1) * 2 * layers_);
    CPD_ASSIGN_OR_RETURN(transport_,
                         DeviceTransport::Create(setup_.comm, setup_.options.cuda_stream, sizes));
    CPD_RETURN_IF_ERROR(d_offsets_.Allocate(layers_ + 1));
    for (auto* a : {&d_layer_shifts_, &d_zero_shifts_}) CPD_RETURN_IF_ERROR(a->Allocate(layers_));
    CPD_RETURN_IF_ERROR(h_layer_shifts_.Allocate(layers_));
    CPD_RETURN_IF_ERROR(d_max_bits_.Allocate(layers_));
    CPD_RETURN_IF_ERROR(d_nonzero_.Allocate(layers_));
    CPD_RETURN_IF_ERROR(h_max_bits_.Allocate(layers_));
    CPD_RETURN_IF_ERROR(h_nonzero_.Allocate(layers_));
    CPD_RETURN_IF_ERROR(d_counters_.Allocate(2 * layers_));
    CPD_RETURN_IF_ERROR(h_counters_.Allocate(2 * layers_));
    CPD_COMM_CUDA_CHECK(cudaMemsetAsync(d_counters_.data(), 0, d_counters_.bytes(), stream_));
    CPD_COMM_CUDA_CHECK(
        cudaMemsetAsync(d_zero_shifts_.data(), 0, d_zero_shifts_.bytes(), stream_));
    std::vector<std::uint64_t> offsets(setup_.layout.offsets.begin(), setup_.layout.offsets.end());
    if (!offsets.empty()) {
      // From pageable memory: returns once the source is staged, ordered on the stream.
      CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(d_offsets_.data(), offsets.data(),
                                          offsets.size() * sizeof(std::uint64_t),
                                          cudaMemcpyHostToDevice, stream_));
    }
    return UploadSegmentBounds();
  }

  // ---- Memory
  // -------------------------------------------------------------------------------------
  Result<Memory> Allocate(std::size_t bytes, bool exchanged) override {
    void* p = nullptr;
    const std::size_t rounded = std::max<std::size_t>((bytes + 63) / 64 * 64, 64);
    CPD_COMM_CUDA_CHECK(cudaMalloc(&p, rounded));
    Memory m(p, bytes, &FreeDevice);
    // On the reducer's stream, so that the work queued there later finds the zeros.
    CPD_COMM_CUDA_CHECK(cudaMemsetAsync(p, 0, rounded, stream_));
    if (exchanged && staged_exchange_) {
      auto mirror = std::make_unique<PinnedArray<std::uint8_t>>();
      CPD_RETURN_IF_ERROR(mirror->Allocate(rounded));
      mirrors_.push_back({static_cast<std::uint8_t*>(p), rounded, std::move(mirror)});
    }
    return m;
  }
  Status Copy(void* dst, const void* src, std::size_t bytes) override {
    if (bytes == 0 || dst == src) return Status::Ok();
    CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
    return Status::Ok();
  }
  Status Zero(void* dst, std::size_t bytes) override {
    if (bytes > 0) CPD_COMM_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream_));
    return Status::Ok();
  }
  Status ToHost(const void* src, std::size_t bytes, void* host_dst) override {
    if (bytes > 0) {
      CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    }
    CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return Status::Ok();
  }
  // A copy from pageable memory returns once the source has been staged: it may be reused.
  Status FromHost(void* dst, const void* host_src, std::size_t bytes) override {
    if (bytes > 0) {
      CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_));
    }
    return Status::Ok();
  }
  Status BeginStep(float* const* inputs, const float* output) override {
    CPD_COMM_CUDA_CHECK(cudaSetDevice(device_));
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

  Status EndStep() override {
    CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return Status::Ok();
  }

  // ---- Scan and shifts
  // ----------------------------------------------------------------------------
  Status ScanLayers(float* const* inputs, std::vector<std::uint32_t>* host_max_bits,
                    std::vector<std::uint64_t>* host_nonzero) override {
    host_max_bits->assign(layers_, 0);
    host_nonzero->assign(layers_, 0);
    if (layers_ == 0) return Status::Ok();
    CPD_COMM_CUDA_CHECK(
        cudaMemsetAsync(d_max_bits_.data(), 0, layers_ * sizeof(std::uint32_t), stream_));
    CPD_COMM_CUDA_CHECK(
        cudaMemsetAsync(d_nonzero_.data(), 0, layers_ * sizeof(std::uint64_t), stream_));
    const GradientLayout& layout = setup_.layout;
    for (std::size_t l = 0; l < layers_; ++l) {
      for (int k = 0; k < setup_.local_replicas; ++k) {
        CPD_RETURN_IF_ERROR(ScanAbsCuda(inputs[k] + layout.offsets[l], setup_.layer_size(l),
                                        d_max_bits_.data() + l, d_nonzero_.data() + l, stream_));
      }
    }
    CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(h_max_bits_.data(), d_max_bits_.data(),
                                        layers_ * sizeof(std::uint32_t), cudaMemcpyDeviceToHost,
                                        stream_));
    CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(h_nonzero_.data(), d_nonzero_.data(),
                                        layers_ * sizeof(std::uint64_t), cudaMemcpyDeviceToHost,
                                        stream_));
    CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::copy_n(h_max_bits_.data(), layers_, host_max_bits->begin());
    std::copy_n(h_nonzero_.data(), layers_, host_nonzero->begin());
    return Status::Ok();
  }
  // Once per step, after the previous step's work has been waited for (its statistics): the
  // pinned staging is free again.
  Status SetLayerShifts(const std::vector<int>& shifts) override {
    if (layers_ == 0) return Status::Ok();
    std::copy(shifts.begin(), shifts.end(), h_layer_shifts_.data());
    CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(d_layer_shifts_.data(), h_layer_shifts_.data(),
                                        layers_ * sizeof(std::int32_t), cudaMemcpyHostToDevice,
                                        stream_));
    return Status::Ok();
  }
  // Each bucket has its own region of the pinned staging and of the device tables, so that an
  // upload still queued for one bucket is never overwritten by the next.
  Status SetSegmentShifts(const BucketPlan& b, Shifts table,
                          const std::vector<int>& shifts) override {
    const std::size_t base = seg_base_[Index(b)], count = b.segments.size();
    if (count == 0) return Status::Ok();
    const std::size_t at = (table == Shifts::kSums ? 0 : total_segments_) + base;
    std::copy_n(shifts.begin(), count, h_seg_shifts_.data() + at);
    CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(d_seg_shifts_.data() + at, h_seg_shifts_.data() + at,
                                        count * sizeof(std::int32_t), cudaMemcpyHostToDevice,
                                        stream_));
    return Status::Ok();
  }

  // ---- Float32 arithmetic
  // -------------------------------------------------------------------------
  Status SumBuffers(const float* const* in, int count, std::size_t begin, std::size_t end,
                    float* out) override {
    const std::size_t n = end - begin;
    if (count == 1) return Copy(out, in[0] + begin, n * sizeof(float));
    // ((in0 + in1) + in2) + ...: the host loop's order.
    for (int k = 1; k < count; ++k) {
      CPD_RETURN_IF_ERROR(CombineCuda(k == 1 ? in[0] + begin : out, in[k] + begin, out, n,
                                      ElementOp::kAdd, stream_));
    }
    return Status::Ok();
  }
  Status Scale(const float* x, float* out, std::size_t n, float scale) override {
    CPD_RETURN_IF_ERROR(Copy(out, x, n * sizeof(float)));
    return ScaleCuda(out, n, scale, stream_);
  }
  Status Combine(const float* a, const float* b, float* out, std::size_t n, ElementOp op) override {
    return CombineCuda(a, b, out, n, op, stream_);
  }
  Status SegmentMaxima(const BucketPlan& b, const float* sums, std::size_t sums_base,
                       std::vector<std::uint32_t>* host_max_bits) override {
    const std::span<const Segment> own = b.segments_of(setup_.rank);
    host_max_bits->assign(own.size(), 0);
    if (own.empty()) return Status::Ok();
    CPD_COMM_CUDA_CHECK(
        cudaMemsetAsync(d_seg_max_.data(), 0, own.size() * sizeof(std::uint32_t), stream_));
    for (std::size_t j = 0; j < own.size(); ++j) {
      CPD_RETURN_IF_ERROR(ScanAbsCuda(sums + (own[j].begin - sums_base), own[j].size(),
                                      d_seg_max_.data() + j, d_seg_nonzero_.data() + j, stream_));
    }
    CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(h_seg_max_.data(), d_seg_max_.data(),
                                        own.size() * sizeof(std::uint32_t), cudaMemcpyDeviceToHost,
                                        stream_));
    CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::copy_n(h_seg_max_.data(), own.size(), host_max_bits->begin());
    return Status::Ok();
  }

  // ---- Any format, a segment at a time (statistics wait for the stream) ------------------------
  Status Encode(const Format& f, const float* x, std::size_t n, const QuantizeOptions& o,
                std::uint8_t* dst, QuantStats* stats) override {
    PackedTensorCuda packed = Packed(f, n, dst);
    return EncodeCuda(f, x, n, o, &packed, stats, stream_);
  }
  Status Decode(const Format& f, const std::uint8_t* src, std::size_t n, float* out) override {
    return DecodeCuda(f, Packed(f, n, const_cast<std::uint8_t*>(src)), out, stream_);
  }
  Status Quantize(const Format& f, const float* in, float* out, std::size_t n,
                  const QuantizeOptions& o, QuantStats* stats) override {
    return QuantizeCuda(f, in, out, n, o, stats, stream_);
  }

  // ---- Packed codes: one kernel over a run of pieces --------------------------------------------
  Status EncodeCodes(const BucketPlan& b, std::span<const Piece> pieces, const float* x,
                     std::size_t x_base, Shifts shifts, kernels::RoundMode mode, std::int64_t stage,
                     std::int64_t step, std::uint8_t* slot, bool count) override {
    const Run r = RunOf(b, pieces);
    const std::uint64_t key = setup_.LoopAt(mode, stage, step, r.begin).rng_key;
    CPD_RETURN_IF_ERROR(EncodeContributionCuda(
        x + (r.begin - x_base), r.size(), r.begin, Table(b, r.chunk, shifts), setup_.format.grid(),
        mode, key, slot + r.offset, count ? d_counters_.data() : nullptr, stream_));
    KeepMoving();
    return Status::Ok();
  }
  Status DecodeCodes(const BucketPlan& b, std::span<const Piece> pieces, const std::uint8_t* slot,
                     Shifts shifts, float* out) override {
    const Run r = RunOf(b, pieces);
    CPD_RETURN_IF_ERROR(DecodeUnshiftCuda(slot + r.offset, r.size(), r.begin,
                                          Table(b, r.chunk, shifts), setup_.format.grid(),
                                          out + r.begin, stream_));
    KeepMoving();
    return Status::Ok();
  }
  Status SumRequantizeCodes(const BucketPlan& b, std::span<const Piece> pieces,
                            const Contributions& in, std::int64_t step,
                            std::uint8_t* slot) override {
    const Run r = RunOf(b, pieces);
    CPD_RETURN_IF_ERROR(SumRequantizeCodesCuda(
        Received(in, r), r.size(), setup_.format.grid(),
        setup_.LoopAt(setup_.round_mode, RequantizeStage(setup_.workers), step, r.begin),
        slot + r.offset, stream_));
    KeepMoving();
    return Status::Ok();
  }
  Status SumCodes(const BucketPlan& b, std::span<const Piece> pieces, const Contributions& in,
                  float* sums, std::size_t sums_base) override {
    const Run r = RunOf(b, pieces);
    CPD_RETURN_IF_ERROR(SumCodesCuda(Received(in, r), r.size(), setup_.format.grid(),
                                     sums + (r.begin - sums_base), stream_));
    KeepMoving();
    return Status::Ok();
  }
  Status SumRoundedCodes(const BucketPlan& b, std::span<const Piece> pieces,
                         const Contributions& in, std::int64_t step, std::uint8_t* slot) override {
    const Run r = RunOf(b, pieces);
    EmulateRounding rounding;
    rounding.mode = setup_.round_mode;
    rounding.kahan = setup_.options.kahan;
    rounding.seed = setup_.options.seed;
    rounding.step = step;
    rounding.index_base = r.begin;
    CPD_RETURN_IF_ERROR(SumRoundedCodesCuda(Received(in, r), r.size(), setup_.format.grid(),
                                            rounding, slot + r.offset, stream_));
    KeepMoving();
    return Status::Ok();
  }
  Status ReadCodeCounters(std::vector<std::uint64_t>* host_counts) override {
    if (!codes_ || layers_ == 0) return Status::Ok();
    CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(h_counters_.data(), d_counters_.data(),
                                        2 * layers_ * sizeof(std::uint64_t), cudaMemcpyDeviceToHost,
                                        stream_));
    CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    for (std::size_t l = 0; l < layers_; ++l) {
      (*host_counts)[3 * l] += h_counters_.data()[2 * l];
      (*host_counts)[3 * l + 1] += h_counters_.data()[2 * l + 1];
    }
    CPD_COMM_CUDA_CHECK(
        cudaMemsetAsync(d_counters_.data(), 0, 2 * layers_ * sizeof(std::uint64_t), stream_));
    return Status::Ok();
  }

  // ---- Collectives
  // --------------------------------------------------------------------------------
  Status AllToAllBytes(const std::uint8_t* in, std::uint8_t* out,
                       std::size_t block_bytes) override {
    CPD_RETURN_IF_ERROR(transport_->Reserve(block_bytes * std::size_t(setup_.world_size)));
    return transport_->AllToAllBytes(in, out, block_bytes);
  }
  Status AllGatherBytes(const std::uint8_t* in, std::uint8_t* out,
                        std::size_t block_bytes) override {
    CPD_RETURN_IF_ERROR(transport_->Reserve(block_bytes * std::size_t(setup_.world_size)));
    return transport_->AllGatherBytes(in, out, block_bytes);
  }
  Status AllReduceSum(float* data, std::size_t count) override {
    CPD_RETURN_IF_ERROR(transport_->Reserve(count * sizeof(float)));
    return transport_->AllReduceSum(data, count);
  }
  Status ReduceScatterSum(const float* in, float* out, std::size_t count) override {
    CPD_RETURN_IF_ERROR(transport_->Reserve(count * sizeof(float)));
    return transport_->ReduceScatterSum(in, out, count);
  }
  bool has_nonblocking_exchange() const override { return staged_exchange_; }
  Status AllReduceHost(float* data, std::size_t count, ReduceOp op) override {
    return transport_->AllReduceHost(data, count, op);
  }
  Status AllReduceHost(std::uint64_t* data, std::size_t count, ReduceOp op) override {
    return transport_->AllReduceHost(data, count, op);
  }
  Status AllGatherHost(const std::uint8_t* in, std::uint8_t* out,
                       std::size_t block_bytes) override {
    return transport_->AllGatherHost(in, out, block_bytes);
  }

 protected:
  // The send blocks are copied down to their pinned mirrors once the stream has produced them,
  // the host exchange runs between mirrors, and the received blocks go up on completion.
  Result<std::unique_ptr<Communicator::PendingExchange>> StartExchangeBytes(
      std::span<const Communicator::SendBlock> send,
      std::span<const Communicator::RecvBlock> recv) override {
    if (!staged_exchange_) {
      return Status::Unavailable(
          "GradientAllReducer: the device back end has no nonblocking exchange over this "
          "communicator");
    }
    CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::vector<Communicator::SendBlock> host_send(send.size());
    std::vector<Communicator::RecvBlock> host_recv(recv.size());
    std::vector<StagedExchange::Upload> uploads;
    for (std::size_t d = 0; d < send.size(); ++d) {
      CPD_ASSIGN_OR_RETURN(std::uint8_t * s, MirrorOf(send[d].data, send[d].bytes));
      host_send[d] = {s, send[d].bytes};
      if (send[d].bytes > 0) {
        CPD_COMM_CUDA_CHECK(
            cudaMemcpyAsync(s, send[d].data, send[d].bytes, cudaMemcpyDeviceToHost, stream_));
      }
      CPD_ASSIGN_OR_RETURN(std::uint8_t * r, MirrorOf(recv[d].data, recv[d].bytes));
      host_recv[d] = {r, recv[d].bytes};
      if (recv[d].bytes > 0) uploads.push_back({recv[d].data, r, recv[d].bytes});
    }
    CPD_COMM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    CPD_ASSIGN_OR_RETURN(std::unique_ptr<Communicator::PendingExchange> host,
                         comm_.StartExchangeBytes(host_send, host_recv));
    return std::unique_ptr<Communicator::PendingExchange>(
        new StagedExchange(std::move(host), std::move(uploads), stream_));
  }

 private:
  // The flat range of a run of pieces of one chunk, and where its codes start in the slot.
  struct Run {
    int chunk = 0;
    std::size_t begin = 0, end = 0, offset = 0;
    std::size_t size() const { return end - begin; }
  };
  Run RunOf(const BucketPlan& b, std::span<const Piece> pieces) const {
    Run r;
    if (pieces.empty()) return r;
    r.chunk = pieces.front().chunk;
    r.begin = pieces.front().begin;
    r.end = pieces.back().end;
    r.offset = PieceCodeOffset(b, pieces.front(), bits_);
    return r;
  }
  ContributionCodes Received(const Contributions& in, const Run& r) const {
    ContributionCodes c;
    c.codes = in.codes + r.offset;
    c.stride = in.stride;
    c.workers = setup_.workers;
    return c;
  }
  std::size_t Index(const BucketPlan& b) const { return std::size_t(&b - plan_.buckets().data()); }
  // The kernels' view of a shift table for chunk d of b: the layers (per layer shifts), or the
  // chunk's segments with their shifts.
  DeviceLayers Table(const BucketPlan& b, int d, Shifts shifts) const {
    if (shifts == Shifts::kNone || shifts == Shifts::kLayers) {
      return DeviceLayers{d_offsets_.data(),
                          shifts == Shifts::kNone ? d_zero_shifts_.data() : d_layer_shifts_.data(),
                          int(layers_)};
    }
    const std::size_t i = Index(b), s0 = b.seg_start[std::size_t(d)];
    const std::size_t at = (shifts == Shifts::kSums ? 0 : total_segments_) + seg_base_[i] + s0;
    return DeviceLayers{d_seg_bounds_.data() + bounds_base_[i] + s0 + std::size_t(d),
                        d_seg_shifts_.data() + at, int(b.seg_start[std::size_t(d) + 1] - s0)};
  }
  PackedTensorCuda Packed(const Format& f, std::size_t n, std::uint8_t* bytes) const {
    PackedTensorCuda t;
    t.count = n;
    t.channels = 1;  // a segment is one scale group
    t.bytes = bytes;
    t.size = PackedSize(f, n, 1);
    return t;
  }
  // The pinned mirror of [p, p + bytes) of an exchanged buffer.
  Result<std::uint8_t*> MirrorOf(const std::uint8_t* p, std::size_t bytes) const {
    for (const Mirror& m : mirrors_) {
      if (p >= m.device && p + bytes <= m.device + m.bytes)
        return m.pinned->data() + (p - m.device);
    }
    return Status::Internal("GradientAllReducer: an exchanged block outside the exchange buffers");
  }
  // After each kernel queued while exchanges are in flight: the MPI backend moves bytes only
  // inside its calls.
  void KeepMoving() {
    if (exchanges_in_flight()) KeepExchangesMoving();
  }

  // Per bucket, the flat bounds of its segments chunk by chunk (chunk d's seg_start[d + 1] -
  // seg_start[d] + 1 entries from bounds_base_[bucket] + seg_start[d] + d), and the segment
  // tables' regions; the buffers of the sum scaling's maxima.
  Status UploadSegmentBounds() {
    std::vector<std::uint64_t> bounds;
    std::size_t chunk_segments = 0;
    for (const BucketPlan& b : plan_.buckets()) {
      bounds_base_.push_back(bounds.size());
      seg_base_.push_back(total_segments_);
      total_segments_ += b.segments.size();
      for (int d = 0; d < setup_.world_size; ++d) {
        const std::span<const Segment> segments = b.segments_of(d);
        chunk_segments = std::max(chunk_segments, segments.size());
        for (const Segment& sg : segments) bounds.push_back(sg.begin);
        bounds.push_back(segments.empty() ? b.chunk_begin(d) : segments.back().end);
      }
    }
    CPD_RETURN_IF_ERROR(d_seg_bounds_.Allocate(bounds.size()));
    if (!bounds.empty()) {
      CPD_COMM_CUDA_CHECK(cudaMemcpyAsync(d_seg_bounds_.data(), bounds.data(),
                                          bounds.size() * sizeof(std::uint64_t),
                                          cudaMemcpyHostToDevice, stream_));
    }
    CPD_RETURN_IF_ERROR(d_seg_shifts_.Allocate(2 * total_segments_));
    CPD_RETURN_IF_ERROR(h_seg_shifts_.Allocate(2 * total_segments_));
    CPD_RETURN_IF_ERROR(d_seg_max_.Allocate(chunk_segments));
    CPD_RETURN_IF_ERROR(d_seg_nonzero_.Allocate(chunk_segments));
    return h_seg_max_.Allocate(chunk_segments);
  }

  struct Mirror {
    std::uint8_t* device = nullptr;
    std::size_t bytes = 0;
    std::unique_ptr<PinnedArray<std::uint8_t>> pinned;
  };

  const ReducerSetup& setup_;
  const AllReducePlan& plan_;
  Communicator& comm_;
  const cudaStream_t stream_;
  const std::size_t layers_;
  const int bits_;
  const bool codes_;
  const bool staged_exchange_;
  int device_ = 0;
  std::unique_ptr<DeviceTransport> transport_;
  std::vector<Mirror> mirrors_;

  DeviceArray<std::uint64_t> d_offsets_;  // layout.offsets
  DeviceArray<std::int32_t> d_layer_shifts_, d_zero_shifts_;
  PinnedArray<std::int32_t> h_layer_shifts_;
  DeviceArray<std::uint32_t> d_max_bits_;
  DeviceArray<std::uint64_t> d_nonzero_;
  PinnedArray<std::uint32_t> h_max_bits_;
  PinnedArray<std::uint64_t> h_nonzero_;
  DeviceArray<std::uint64_t> d_counters_;  // flushed, saturated per layer
  PinnedArray<std::uint64_t> h_counters_;
  // Segment tables: kSums then kResults, each total_segments_ long, bucket i's at seg_base_[i].
  std::vector<std::size_t> bounds_base_, seg_base_;
  std::size_t total_segments_ = 0;
  DeviceArray<std::uint64_t> d_seg_bounds_;
  DeviceArray<std::int32_t> d_seg_shifts_;
  PinnedArray<std::int32_t> h_seg_shifts_;
  DeviceArray<std::uint32_t> d_seg_max_;
  DeviceArray<std::uint64_t> d_seg_nonzero_;
  PinnedArray<std::uint32_t> h_seg_max_;
};

}  // namespace

Result<std::unique_ptr<Backend>> MakeDeviceBackend(const ReducerSetup& setup,
                                                   const AllReducePlan& plan) {
  auto backend = std::make_unique<DeviceBackend>(setup, plan);
  CPD_RETURN_IF_ERROR(backend->Init());
  return std::unique_ptr<Backend>(std::move(backend));
}

#endif  // CPD_WITH_CUDA

}  // namespace cpd::comm::internal
