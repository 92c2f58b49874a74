// The host back end of the gradient all-reduce (comm/allreduce/backend.h): the CPU element loops
// of comm/reduce_kernels.h and cpd::Encode/Decode/Quantize on OpenMP threads, buffers in host
// memory, the communicator's collectives as they are. A run of pieces is split over the threads
// piece by piece; a piece (kPiece elements) is decoded, summed, rounded and packed while it is in
// L1, and thread 0 keeps the exchanges in flight moving every few pieces.
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "comm/allreduce/backend.h"
#include "comm/allreduce/codes.h"
#include "comm/allreduce/internal.h"

namespace cpd::comm::internal {
namespace {

// Elements per work item of the max/non-finite scan and of the replica sums.
constexpr std::size_t kScanBlock = std::size_t(1) << 16;
// Thread 0 tests the exchanges in flight every this many work items of an element loop.
constexpr long kPollItems = 8;

class HostBackend final : public Backend {
 public:
  HostBackend(const ReducerSetup& setup, const AllReducePlan& plan)
      : setup_(setup),
        comm_(*setup.comm),
        threads_(setup.threads),
        layers_(setup.layers()),
        bits_(setup.format.bits()),
        codes_(!setup.mixed() && CodeTransport::Supports(setup.format)) {
    const GradientLayout& layout = setup.layout;
    for (std::size_t l = 0; l < layout.layers(); ++l) {
      for (std::size_t s = layout.offsets[l]; s < layout.offsets[l + 1]; s += kScanBlock) {
        scan_items_.push_back({int(l), s, std::min(layout.offsets[l + 1], s + kScanBlock)});
      }
    }
    const std::size_t threads = std::size_t(threads_);
    thread_max_.assign(threads * layers_, 0);
    thread_nonzero_.assign(threads * layers_, 0);
    thread_counters_.assign(threads * 2 * layers_, 0);
    layer_shifts_.assign(layers_, 0);
    std::size_t segments = 0;
    for (const BucketPlan& b : plan.buckets()) segments = std::max(segments, b.segments.size());
    sum_shifts_.assign(segments, 0);
    result_shifts_.assign(segments, 0);
    if (codes_) {
      decoder_ = MakeCodeDecoder(setup.format.grid());
      thread_codes_.assign(threads * kPiece, 0);
      // Per thread: the sum, and for Kahan t, c, y, u and the decoded contribution.
      floats_per_thread_ = (setup.options.kahan ? 6 : 1) * kPiece;
      thread_floats_.assign(threads * floats_per_thread_, 0.0f);
    }
  }

  // ---- Memory
  // -------------------------------------------------------------------------------------
  Result<Memory> Allocate(std::size_t bytes, bool /*exchanged*/) override {
    // Cache-line aligned, at least one line, so that data() is never null.
    const std::size_t rounded = std::max<std::size_t>((bytes + 63) / 64 * 64, 64);
    void* p = std::aligned_alloc(64, rounded);
    if (p == nullptr) {
      return Status::Internal("GradientAllReducer: cannot allocate " + std::to_string(bytes) +
                              " bytes of host memory");
    }
    std::memset(p, 0, rounded);
    return Memory(p, bytes, &std::free);
  }
  Status Copy(void* dst, const void* src, std::size_t bytes) override {
    if (bytes > 0) std::memmove(dst, src, bytes);
    return Status::Ok();
  }
  Status Zero(void* dst, std::size_t bytes) override {
    if (bytes > 0) std::memset(dst, 0, bytes);
    return Status::Ok();
  }
  Status ToHost(const void* src, std::size_t bytes, void* host_dst) override {
    return Copy(host_dst, src, bytes);
  }
  Status FromHost(void* dst, const void* host_src, std::size_t bytes) override {
    return Copy(dst, host_src, bytes);
  }
  // Host pointers cannot be told from others here; a device pointer faults in the first loop.
  Status BeginStep(float* const*, const float*) override { return Status::Ok(); }
  Status EndStep() override { return Status::Ok(); }

  // ---- Scan and shifts
  // ----------------------------------------------------------------------------
  Status ScanLayers(float* const* inputs, std::vector<std::uint32_t>* host_max_bits,
                    std::vector<std::uint64_t>* host_nonzero) override {
    const std::size_t replicas = std::size_t(setup_.local_replicas);
    std::fill(thread_max_.begin(), thread_max_.end(), 0u);
    std::fill(thread_nonzero_.begin(), thread_nonzero_.end(), 0u);
    const long count = long(scan_items_.size() * replicas);
#pragma omp parallel for schedule(static) num_threads(threads_) if (threads_ > 1 && count > 1)
    for (long it = 0; it < count; ++it) {
      const ScanItem& item = scan_items_[std::size_t(it) / replicas];
      const std::size_t k = std::size_t(it) % replicas;
      const std::size_t at = std::size_t(omp_get_thread_num()) * layers_ + std::size_t(item.layer);
      ScanAbs(inputs[k] + item.begin, item.end - item.begin, &thread_max_[at],
              &thread_nonzero_[at]);
    }
    host_max_bits->assign(layers_, 0);
    host_nonzero->assign(layers_, 0);
    for (std::size_t l = 0; l < layers_; ++l) {
      for (std::size_t th = 0; th < std::size_t(threads_); ++th) {
        (*host_max_bits)[l] = std::max((*host_max_bits)[l], thread_max_[th * layers_ + l]);
        (*host_nonzero)[l] += thread_nonzero_[th * layers_ + l];
      }
    }
    return Status::Ok();
  }
  Status SetLayerShifts(const std::vector<int>& shifts) override {
    layer_shifts_ = shifts;
    return Status::Ok();
  }
  Status SetSegmentShifts(const BucketPlan& b, Shifts table,
                          const std::vector<int>& shifts) override {
    std::vector<int>& dst = table == Shifts::kSums ? sum_shifts_ : result_shifts_;
    std::copy_n(shifts.begin(), b.segments.size(), dst.begin());
    return Status::Ok();
  }

  // ---- Float32 arithmetic
  // -------------------------------------------------------------------------
  Status SumBuffers(const float* const* in, int count, std::size_t begin, std::size_t end,
                    float* out) override {
    const long blocks = long((end - begin + kScanBlock - 1) / kScanBlock);
#pragma omp parallel for schedule(static) num_threads(threads_) if (threads_ > 1 && blocks > 1)
    for (long bi = 0; bi < blocks; ++bi) {
      const std::size_t s = begin + std::size_t(bi) * kScanBlock;
      const std::size_t e = std::min(end, s + kScanBlock);
      if (count == 1) {
        if (out + (s - begin) != in[0] + s) {
          std::memcpy(out + (s - begin), in[0] + s, (e - s) * sizeof(float));
        }
        continue;
      }
      for (std::size_t i = s; i < e; ++i) {
        float acc = in[0][i];
        for (int k = 1; k < count; ++k) acc += in[k][i];
        out[i - begin] = acc;
      }
    }
    return Status::Ok();
  }
  Status Scale(const float* x, float* out, std::size_t n, float scale) override {
    for (std::size_t i = 0; i < n; ++i) out[i] = x[i] * scale;
    return Status::Ok();
  }
  Status Combine(const float* a, const float* b, float* out, std::size_t n, ElementOp op) override {
    if (op == ElementOp::kAdd) {
      for (std::size_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
    } else {
      for (std::size_t i = 0; i < n; ++i) out[i] = a[i] - b[i];
    }
    return Status::Ok();
  }
  Status SegmentMaxima(const BucketPlan& b, const float* sums, std::size_t sums_base,
                       std::vector<std::uint32_t>* host_max_bits) override {
    const std::span<const Segment> own = b.segments_of(setup_.rank);
    host_max_bits->assign(own.size(), 0);
    for (std::size_t j = 0; j < own.size(); ++j) {
      std::uint64_t nonzero = 0;
      ScanAbs(sums + (own[j].begin - sums_base), own[j].size(), &(*host_max_bits)[j], &nonzero);
    }
    return Status::Ok();
  }

  // ---- Any format, a segment at a time
  // ------------------------------------------------------------
  Status Encode(const Format& f, const float* x, std::size_t n, const QuantizeOptions& o,
                std::uint8_t* dst, QuantStats* stats) override {
    CPD_RETURN_IF_ERROR(cpd::Encode(f, x, n, o, &packed_, stats));
    std::memcpy(dst, packed_.bytes.data(), packed_.bytes.size());
    return Status::Ok();
  }
  Status Decode(const Format& f, const std::uint8_t* src, std::size_t n, float* out) override {
    packed_.count = n;
    packed_.channels = 1;
    packed_.bytes.assign(src, src + PackedSize(f, n, 1));
    return cpd::Decode(f, packed_, out, threads_);
  }
  Status Quantize(const Format& f, const float* in, float* out, std::size_t n,
                  const QuantizeOptions& o, QuantStats* stats) override {
    return cpd::Quantize(f, in, out, n, o, stats);
  }

  // ---- Packed codes
  // -------------------------------------------------------------------------------
  Status EncodeCodes(const BucketPlan& b, std::span<const Piece> pieces, const float* x,
                     std::size_t x_base, Shifts shifts, kernels::RoundMode mode, std::int64_t stage,
                     std::int64_t step, std::uint8_t* slot, bool count) override {
    return ForEachPiece(pieces, [&](const Piece& pc) {
      std::uint64_t* counters =
          count ? &thread_counters_[std::size_t(omp_get_thread_num()) * 2 * layers_] : nullptr;
      EncodePiece(x + (pc.begin - x_base), b, pc, shifts, mode, stage, step,
                  slot + PieceCodeOffset(b, pc, bits_), counters);
    });
  }
  Status DecodeCodes(const BucketPlan& b, std::span<const Piece> pieces, const std::uint8_t* slot,
                     Shifts shifts, float* out) override {
    return ForEachPiece(pieces, [&](const Piece& pc) { DecodePiece(b, pc, slot, shifts, out); });
  }
  Status SumRequantizeCodes(const BucketPlan& b, std::span<const Piece> pieces,
                            const Contributions& in, std::int64_t step,
                            std::uint8_t* slot) override {
    return ForEachPiece(pieces, [&](const Piece& pc) {
      float* sum = ThreadFloats();
      SumPiece(b, pc, in, sum);
      EncodePiece(sum, b, pc, Shifts::kNone, setup_.round_mode, RequantizeStage(setup_.workers),
                  step, slot + PieceCodeOffset(b, pc, bits_), nullptr);
    });
  }
  Status SumCodes(const BucketPlan& b, std::span<const Piece> pieces, const Contributions& in,
                  float* sums, std::size_t sums_base) override {
    return ForEachPiece(
        pieces, [&](const Piece& pc) { SumPiece(b, pc, in, sums + (pc.begin - sums_base)); });
  }
  Status SumRoundedCodes(const BucketPlan& b, std::span<const Piece> pieces,
                         const Contributions& in, std::int64_t step, std::uint8_t* slot) override {
    return ForEachPiece(pieces, [&](const Piece& pc) {
      float* scratch = ThreadFloats();
      const float* sum = setup_.options.kahan ? SumPieceKahan(b, pc, in, step, scratch)
                                              : SumPieceRounded(b, pc, in, step, scratch);
      // The sum is on the grid: rounding it again only yields its codes.
      EncodePiece(sum, b, pc, Shifts::kNone, kernels::RoundMode::kNearestEven, 0, 0,
                  slot + PieceCodeOffset(b, pc, bits_), nullptr);
    });
  }
  Status ReadCodeCounters(std::vector<std::uint64_t>* host_counts) override {
    for (std::size_t th = 0; th < std::size_t(threads_); ++th) {
      std::uint64_t* c = &thread_counters_[th * 2 * layers_];
      for (std::size_t l = 0; l < layers_; ++l) {
        (*host_counts)[3 * l] += c[2 * l];
        (*host_counts)[3 * l + 1] += c[2 * l + 1];
      }
    }
    std::fill(thread_counters_.begin(), thread_counters_.end(), 0u);
    return Status::Ok();
  }

  // ---- Collectives
  // --------------------------------------------------------------------------------
  Status AllToAllBytes(const std::uint8_t* in, std::uint8_t* out,
                       std::size_t block_bytes) override {
    return comm_.AllToAllBytes(in, out, block_bytes);
  }
  Status AllGatherBytes(const std::uint8_t* in, std::uint8_t* out,
                        std::size_t block_bytes) override {
    return comm_.AllGatherBytes(in, out, block_bytes);
  }
  Status AllReduceSum(float* data, std::size_t count) override {
    return comm_.AllReduce(data, count, ReduceOp::kSum);
  }
  Status ReduceScatterSum(const float* in, float* out, std::size_t count) override {
    return comm_.ReduceScatter(in, out, count);
  }
  bool has_nonblocking_exchange() const override { return comm_.has_nonblocking_exchange(); }
  Status AllReduceHost(float* data, std::size_t count, ReduceOp op) override {
    return comm_.AllReduce(data, count, op);
  }
  Status AllReduceHost(std::uint64_t* data, std::size_t count, ReduceOp op) override {
    return comm_.AllReduce(data, count, op);
  }
  Status AllGatherHost(const std::uint8_t* in, std::uint8_t* out,
                       std::size_t block_bytes) override {
    return comm_.AllGatherBytes(in, out, block_bytes);
  }

 protected:
  Result<std::unique_ptr<Communicator::PendingExchange>> StartExchangeBytes(
      std::span<const Communicator::SendBlock> send,
      std::span<const Communicator::RecvBlock> recv) override {
    return comm_.StartExchangeBytes(send, recv);
  }

 private:
  struct ScanItem {
    int layer = 0;
    std::size_t begin = 0, end = 0;
  };

  // fn(piece) for every piece, split over the threads; thread 0 keeps the exchanges moving.
  template <typename Fn>
  Status ForEachPiece(std::span<const Piece> pieces, Fn&& fn) {
    const long n = long(pieces.size());
    const bool poll = exchanges_in_flight();
#pragma omp parallel for schedule(static) num_threads(threads_) if (threads_ > 1 && n > 1)
    for (long i = 0; i < n; ++i) {
      if (poll && i % kPollItems == 0 && omp_get_thread_num() == 0) KeepExchangesMoving();
      fn(pieces[std::size_t(i)]);
    }
    return Status::Ok();
  }

  float* ThreadFloats() {
    return &thread_floats_[std::size_t(omp_get_thread_num()) * floats_per_thread_];
  }

  // The shift of segment si (of layer `layer`) of b in table `shifts`.
  int ShiftOf(Shifts shifts, std::size_t si, int layer) const {
    switch (shifts) {
      case Shifts::kLayers:
        return layer_shifts_[std::size_t(layer)];
      case Shifts::kSums:
        return sum_shifts_[si];
      case Shifts::kResults:
        return result_shifts_[si];
      default:
        return 0;
    }
  }

  // Codes of x[0, pc.size()) (times 2^shift of each segment), rounded with `mode` and the stream
  // of `stage`, packed to dst. counters (2 per layer, or null): flushed, saturated.
  void EncodePiece(const float* x, const BucketPlan& b, const Piece& pc, Shifts shifts,
                   kernels::RoundMode mode, std::int64_t stage, std::int64_t step,
                   std::uint8_t* dst, std::uint64_t* counters) {
    const kernels::FloatGrid& g = setup_.format.grid();
    // The contributions are finite (the scan found them so, the shift keeps them so), which lets
    // nearest-even rounding skip the Inf/NaN handling; the sums may not be.
    const bool finite = shifts == Shifts::kLayers;
    // 8-bit codes go straight to dst; other widths through an L1 buffer, packed at the end.
    std::uint16_t* c16 = &thread_codes_[std::size_t(omp_get_thread_num()) * kPiece];
    std::uint8_t* c8 = bits_ == 8 ? dst : reinterpret_cast<std::uint8_t*>(c16);
    auto encode = [&](std::size_t lo, std::size_t hi, int shift, std::uint64_t* st) {
      const kernels::LoopParams p = setup_.LoopAt(mode, stage, step, lo);
      const float scale = kernels::Pow2(shift);
      if (bits_ <= 8) {
        EncodeCodes8(x + (lo - pc.begin), hi - lo, scale, g, p, c8 + (lo - pc.begin), st, finite);
      } else {
        EncodeCodes16(x + (lo - pc.begin), hi - lo, scale, g, p, c16 + (lo - pc.begin), st, finite);
      }
    };
    if (shifts == Shifts::kNone && counters == nullptr) {
      encode(pc.begin, pc.end, 0, nullptr);
    } else {
      for (std::size_t si = pc.first_segment;
           si < b.segments.size() && b.segments[si].begin < pc.end; ++si) {
        const Segment& s = b.segments[si];
        encode(std::max(s.begin, pc.begin), std::min(s.end, pc.end), ShiftOf(shifts, si, s.layer),
               counters != nullptr ? counters + 2 * std::size_t(s.layer) : nullptr);
      }
    }
    if (bits_ < 8) PackSmallCodes(c8, pc.size(), bits_, dst);
    if (bits_ > 8) PackSmallCodes(c16, pc.size(), bits_, dst);
  }

  void DecodePiece(const BucketPlan& b, const Piece& pc, const std::uint8_t* slot, Shifts shifts,
                   float* output) const {
    const std::uint8_t* src = slot + PieceCodeOffset(b, pc, bits_);
    const Segment& first = b.segments[pc.first_segment];
    if (first.end >= pc.end) {
      // One layer: decode and undo its shift in one pass.
      const int sh = ShiftOf(shifts, pc.first_segment, first.layer);
      if (sh == 0) {
        internal::DecodeCodes(src, pc.size(), decoder_, output + pc.begin);
      } else {
        DecodeCodesScaled(src, pc.size(), decoder_, kernels::Pow2(-sh), output + pc.begin);
      }
      return;
    }
    internal::DecodeCodes(src, pc.size(), decoder_, output + pc.begin);
    for (std::size_t si = pc.first_segment; si < b.segments.size() && b.segments[si].begin < pc.end;
         ++si) {
      const Segment& s = b.segments[si];
      const int sh = ShiftOf(shifts, si, s.layer);
      if (sh == 0) continue;
      const float up = kernels::Pow2(-sh);
      const std::size_t lo = std::max(s.begin, pc.begin), hi = std::min(s.end, pc.end);
      for (std::size_t i = lo; i < hi; ++i) output[i] *= up;
    }
  }

  // The W contributions of piece pc decoded and summed in float32 in worker order (into sum).
  void SumPiece(const BucketPlan& b, const Piece& pc, const Contributions& in, float* sum) const {
    const std::size_t off = PieceCodeOffset(b, pc, bits_);
    internal::DecodeCodes(in.codes + off, pc.size(), decoder_, sum);
    for (int w = 1; w < setup_.workers; ++w) {
      DecodeCodesAdd(in.codes + std::size_t(w) * in.stride + off, pc.size(), decoder_, sum);
    }
  }

  // acc = Q(acc + q_w): rounded to the format after every addition.
  const float* SumPieceRounded(const BucketPlan& b, const Piece& pc, const Contributions& in,
                               std::int64_t step, float* acc) const {
    const std::size_t off = PieceCodeOffset(b, pc, bits_);
    internal::DecodeCodes(in.codes + off, pc.size(), decoder_, acc);
    for (int w = 1; w < setup_.workers; ++w) {
      DecodeCodesAdd(in.codes + std::size_t(w) * in.stride + off, pc.size(), decoder_, acc);
      Round(acc, pc, AdditionStage(setup_.workers, w), step);
    }
    return acc;
  }

  // Kahan's compensated sum with every operation rounded to the format.
  const float* SumPieceKahan(const BucketPlan& b, const Piece& pc, const Contributions& in,
                             std::int64_t step, float* scratch) const {
    const std::size_t n = pc.size(), off = PieceCodeOffset(b, pc, bits_);
    float *acc = scratch, *t = scratch + kPiece, *c = scratch + 2 * kPiece,
          *y = scratch + 3 * kPiece, *u = scratch + 4 * kPiece, *q = scratch + 5 * kPiece;
    internal::DecodeCodes(in.codes + off, n, decoder_, acc);
    std::fill(c, c + n, 0.0f);
    for (int w = 1; w < setup_.workers; ++w) {
      const std::int64_t stage = AdditionStage(setup_.workers, w);
      internal::DecodeCodes(in.codes + std::size_t(w) * in.stride + off, n, decoder_, q);
      for (std::size_t i = 0; i < n; ++i) y[i] = q[i] - c[i];
      Round(y, pc, stage + kKahanY, step);
      for (std::size_t i = 0; i < n; ++i) t[i] = acc[i] + y[i];
      Round(t, pc, stage + kKahanT, step);
      for (std::size_t i = 0; i < n; ++i) u[i] = t[i] - acc[i];
      Round(u, pc, stage + kKahanHigh, step);
      for (std::size_t i = 0; i < n; ++i) c[i] = u[i] - y[i];
      Round(c, pc, stage + kKahanC, step);
      std::swap(acc, t);
    }
    return acc;
  }

  // x[0, pc.size()) rounded to the format in place with the stream of `stage`.
  void Round(float* x, const Piece& pc, std::int64_t stage, std::int64_t step) const {
    kernels::QuantizeFloatGrid(x, x, nullptr, pc.size(), setup_.format.grid(), 0,
                               setup_.LoopAt(setup_.round_mode, stage, step, pc.begin), nullptr);
  }

  const ReducerSetup& setup_;
  Communicator& comm_;
  const int threads_;
  const std::size_t layers_;
  const int bits_;
  const bool codes_;  // the format travels as codes (CodeTransport::Supports)
  CodeDecoder decoder_;
  std::vector<ScanItem> scan_items_;  // every layer in blocks
  std::vector<std::uint32_t> thread_max_;
  std::vector<std::uint64_t> thread_nonzero_;
  std::vector<std::uint64_t> thread_counters_;  // flushed, saturated per layer per thread
  std::vector<int> layer_shifts_, sum_shifts_, result_shifts_;
  std::vector<std::uint16_t> thread_codes_;  // kPiece per thread
  std::size_t floats_per_thread_ = 0;
  std::vector<float> thread_floats_;
  PackedTensor packed_;  // one segment, for Encode / Decode
};

}  // namespace

Result<std::unique_ptr<Backend>> MakeHostBackend(const ReducerSetup& setup,
                                                 const AllReducePlan& plan) {
  return std::unique_ptr<Backend>(new HostBackend(setup, plan));
}

}  // namespace cpd::comm::internal
