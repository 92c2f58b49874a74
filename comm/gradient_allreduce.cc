#include "comm/gradient_allreduce.h"

#include <omp.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "comm/allreduce/plan.h"
#include "comm/reduce_kernels.h"
#include "kernels/grid.h"
#include "kernels/quantize_cpu.h"

namespace cpd::comm {
namespace {

using internal::AllReducePlan;
using internal::BucketPlan;
using internal::Piece;
using internal::Segment;

// Elements per work item of the packed-code pipeline: small enough that a piece's codes, its
// decoded floats and the partial sums stay in L1; a multiple of 8, so pieces start on a byte.
constexpr size_t kPiece = 2048;
// Elements per work item of the max/non-finite scan.
constexpr size_t kScanBlock = size_t(1) << 16;
constexpr int kMaxShift = 126;

size_t RoundUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

// How contributions travel between the ranks.
enum class Transport {
  kCodes,     // fixed float grid of <= 16 bits: packed codes, processed piece by piece
  kSegments,  // packed (scaled formats): cpd::Encode per segment, codes + scale metadata
  kFloats,    // emulate (scaled formats): quantised values as float32
};

// The transport's layout of one bucket: the bytes of one contribution's slot (a chunk's worth,
// starting on a cache line) and, for kSegments, each segment's byte offset in its chunk's slot.
struct Slots {
  size_t bytes = 0;
  std::vector<size_t> seg_offset;
};

uint64_t SplitMix(uint64_t z) { return kernels::SplitMix64(z); }

kernels::LoopParams Params(kernels::RoundMode mode, uint64_t seed, int64_t stage, int64_t step,
                           size_t index) {
  kernels::LoopParams p;
  p.mode = mode;
  p.rng_key = kernels::MakeRandomKey(RoundingSeed(seed, stage), uint64_t(step));
  p.index_base = index;
  return p;
}

class Reducer final : public GradientAllReducer {
 public:
  Reducer(Communicator* comm, const GradientAllReduceOptions& opts, GradientLayout layout, int k,
          Format format)
      : comm_(comm),
        opts_(opts),
        layout_(std::move(layout)),
        k_(k),
        p_(comm->size()),
        rank_(comm->rank()),
        w_(comm->size() * k),
        format_(std::move(format)) {}

  Status Init();

  Status Reduce(float* const* inputs, float* output, int64_t step, bool measure_error) override;
  bool last_nonfinite() const override { return nonfinite_; }
  const std::vector<LayerCommStats>& last_stats() const override { return stats_; }
  uint64_t last_bytes_sent() const override { return bytes_sent_; }
  const std::vector<GradientBucket>& buckets() const override { return public_buckets_; }

 private:
  int Threads() const { return threads_; }
  int Layers() const { return int(layout_.layers()); }
  size_t LayerBegin(int l) const { return layout_.offsets[size_t(l)]; }
  size_t LayerEnd(int l) const { return layout_.offsets[size_t(l) + 1]; }

  Slots BucketSlots(const BucketPlan& b) const;
  QuantizeOptions Qopts(int64_t stage, int64_t step, size_t index) const;

  // Per step: scan, max all-reduce, shifts. Returns false in *finite when a NaN/Inf was seen.
  Status ScanAndShifts(float* const* inputs, bool* finite);
  Status ReduceFp32(float* const* inputs, float* output, bool measure);
  // The all-to-all / reduce / all-gather pipeline of emulate and packed, one bucket.
  Status BucketCodes(const BucketPlan& b, const Slots& sl, float* const* inputs, float* output,
                     int64_t step);
  Status BucketSegments(const BucketPlan& b, const Slots& sl, float* const* inputs, float* output,
                        int64_t step);
  Status BucketFloats(const BucketPlan& b, const Slots& sl, float* const* inputs, float* output,
                      int64_t step);
  // Codes of the piece's values x[0, pc.end - pc.begin) (times 2^s of each layer when `shifted`),
  // rounded with `mode` and the stream of `stage`, packed to dst. stats (2 per layer, or null):
  // flushed, saturated. `shifted` is used for the contributions, which the scan found finite and
  // the shift keeps finite (max * 2^s <= 2^emax); the sums may not be.
  void EncodePiece(const float* x, const BucketPlan& b, const Piece& pc, bool shifted,
                   kernels::RoundMode mode, int64_t stage, int64_t step, uint8_t* dst,
                   uint64_t* stats);
  void ApplyShiftInPlace(const BucketPlan& b, float* const* inputs);
  void Unshift(const BucketPlan& b, int chunk, float* output) const;
  // measure_error: the float32 reduce-scatter of this bucket's inputs (before they are used as
  // scratch), then the error of this rank's chunk of the output against it.
  Status ExactChunk(const BucketPlan& b, const float* const* src, int count);
  void AccumulateError(const BucketPlan& b, const float* output);
  Status FinishStats(bool measure);

  Communicator* comm_;
  GradientAllReduceOptions opts_;
  GradientLayout layout_;
  const int k_;
  const int p_;
  const int rank_;
  const int w_;
  Format format_;
  Transport transport_ = Transport::kFloats;
  kernels::RoundMode mode_ = kernels::RoundMode::kNearestEven;
  int emax_ = 0;
  int threads_ = 1;
  int bits_ = 32;
  internal::CodeDecoder decoder_;  // kCodes

  std::unique_ptr<AllReducePlan> plan_;
  std::vector<Slots> slots_;  // per bucket of plan_
  std::vector<GradientBucket> public_buckets_;
  std::vector<std::pair<int, std::pair<size_t, size_t>>> scan_items_;  // (layer, [begin, end))

  // Scratch, sized in Init() for the largest bucket.
  std::vector<uint8_t> send_, recv_, gsend_, grecv_;
  std::vector<float> acc_, tmp_, comp_, y_, u_, t_;  // a chunk each (kSegments / kFloats)
  std::vector<uint16_t> th_codes_;                   // kPiece per thread
  std::vector<float> th_floats_;                     // 6 * kPiece per thread
  std::vector<uint32_t> th_max_;                     // layers per thread
  std::vector<uint64_t> th_nonzero_;
  std::vector<uint64_t> th_counts_;  // flushed, saturated per layer per thread
  PackedTensor pt_;
  std::vector<float> exact_send_, exact_;  // measure_error, allocated on first use

  // Per step.
  std::vector<int> shifts_;
  std::vector<float> max_;
  std::vector<uint64_t> counts_;  // flushed, saturated, nonzero per layer (local, then global)
  std::vector<double> err_;       // squared error, squared reference per layer (this rank)
  std::vector<double> err_all_;   // err_ of every rank
  std::vector<LayerCommStats> stats_;
  bool nonfinite_ = false;
  uint64_t bytes_sent_ = 0;
};

QuantizeOptions Reducer::Qopts(int64_t stage, int64_t step, size_t index) const {
  QuantizeOptions q;
  q.rounding = opts_.rounding;
  q.seed = RoundingSeed(opts_.seed, stage);
  q.step = uint64_t(step);
  q.index_offset = index;
  q.channels = 1;
  q.threads = threads_;
  return q;
}

Slots Reducer::BucketSlots(const BucketPlan& b) const {
  Slots sl;
  if (transport_ == Transport::kCodes) {
    sl.bytes = PackedCodeBytes(format_, b.max_chunk);
  } else if (transport_ == Transport::kFloats) {
    sl.bytes = b.max_chunk * sizeof(float);
  } else {
    for (int d = 0; d < p_; ++d) {
      size_t offset = 0;
      for (const Segment& s : b.segments_of(d)) {
        sl.seg_offset.push_back(offset);
        offset += PackedSize(format_, s.size(), 1);
      }
      sl.bytes = std::max(sl.bytes, offset);
    }
  }
  // Slots start on a cache line.
  sl.bytes = RoundUp(sl.bytes, 64);
  return sl;
}

Status Reducer::Init() {
  threads_ = opts_.threads > 0 ? opts_.threads : std::max(1, omp_get_max_threads());
  mode_ = opts_.rounding == Rounding::kStochastic ? kernels::RoundMode::kStochastic
          : opts_.rounding == Rounding::kZero     ? kernels::RoundMode::kTowardZero
                                                  : kernels::RoundMode::kNearestEven;
  bits_ = format_.bits();
  if (opts_.algo != AllReduceAlgo::kFp32) {
    emax_ = ApsEmax(format_);
    if (format_.family() == FormatFamily::kFloat && bits_ <= 16) {
      transport_ = Transport::kCodes;
      decoder_ = internal::MakeCodeDecoder(format_.grid());
    } else {
      transport_ = opts_.algo == AllReduceAlgo::kPacked ? Transport::kSegments : Transport::kFloats;
    }
  }
  plan_ = std::make_unique<AllReducePlan>(layout_, p_, opts_.bucket_mb, kPiece);
  for (const BucketPlan& b : plan_->buckets()) {
    public_buckets_.push_back(b.bounds);
    slots_.push_back(BucketSlots(b));
  }
  for (int l = 0; l < Layers(); ++l) {
    for (size_t s = LayerBegin(l); s < LayerEnd(l); s += kScanBlock) {
      scan_items_.push_back({l, {s, std::min(LayerEnd(l), s + kScanBlock)}});
    }
  }

  const size_t layers = size_t(Layers());
  const size_t t = size_t(threads_);
  th_max_.assign(t * layers, 0);
  th_nonzero_.assign(t * layers, 0);
  th_counts_.assign(t * 2 * layers, 0);
  shifts_.assign(layers, 0);
  max_.assign(layers, 0.0f);
  counts_.assign(3 * layers, 0);
  err_.assign(2 * layers, 0.0);
  err_all_.assign(2 * layers * size_t(p_), 0.0);
  stats_.resize(layers);
  for (size_t l = 0; l < layers; ++l) stats_[l].layer = layout_.layer_names[l];
  if (opts_.algo == AllReduceAlgo::kFp32) return Status::Ok();

  size_t slot_bytes = 0, slot_elems = 0, seg_bytes = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const BucketPlan& b = plan_->buckets()[i];
    slot_bytes = std::max(slot_bytes, slots_[i].bytes);
    slot_elems = std::max(slot_elems, b.max_chunk);
    for (const Segment& s : b.segments) {
      seg_bytes = std::max(seg_bytes, PackedSize(format_, s.size(), 1));
    }
  }
  const size_t block = size_t(k_) * slot_bytes;
  if (block > size_t(INT_MAX)) {
    return Status::InvalidArgument(
        "GradientAllReducer: bucket_mb " + std::to_string(opts_.bucket_mb) + " gives " +
        std::to_string(block) + "-byte blocks per rank, beyond MPI's limit of " +
        std::to_string(INT_MAX) + "; use a smaller bucket_mb");
  }
  send_.assign(block * size_t(p_), 0);
  recv_.assign(block * size_t(p_), 0);
  gsend_.assign(slot_bytes, 0);
  grecv_.assign(slot_bytes * size_t(p_), 0);
  if (transport_ == Transport::kCodes) {
    th_codes_.assign(t * kPiece, 0);
    th_floats_.assign(t * 6 * kPiece, 0.0f);
  } else {
    // acc_ is also the all-gather's send buffer of kFloats: a whole slot.
    acc_.assign(std::max(slot_elems, slot_bytes / sizeof(float)), 0.0f);
    tmp_.assign(slot_elems, 0.0f);
    if (opts_.kahan) {
      comp_.assign(slot_elems, 0.0f);
      y_.assign(slot_elems, 0.0f);
      u_.assign(slot_elems, 0.0f);
      t_.assign(slot_elems, 0.0f);
    }
    pt_.bytes.reserve(seg_bytes);
  }
  return Status::Ok();
}

Status Reducer::ScanAndShifts(float* const* inputs, bool* finite) {
  const size_t layers = size_t(Layers());
  std::fill(th_max_.begin(), th_max_.end(), 0u);
  std::fill(th_nonzero_.begin(), th_nonzero_.end(), 0u);
  const long items = long(scan_items_.size()) * k_;
#pragma omp parallel for schedule(static) num_threads(threads_) if (threads_ > 1 && items > 1)
  for (long it = 0; it < items; ++it) {
    const auto& [l, range] = scan_items_[size_t(it) / size_t(k_)];
    const int k = int(size_t(it) % size_t(k_));
    const size_t th = size_t(omp_get_thread_num());
    internal::ScanAbs(inputs[k] + range.first, range.second - range.first,
                      &th_max_[th * layers + size_t(l)], &th_nonzero_[th * layers + size_t(l)]);
  }
  for (size_t l = 0; l < layers; ++l) {
    uint32_t m = 0;
    uint64_t nz = 0;
    for (size_t th = 0; th < size_t(threads_); ++th) {
      m = std::max(m, th_max_[th * layers + l]);
      nz += th_nonzero_[th * layers + l];
    }
    // A non-finite element travels as +Inf in the same MAX all-reduce (NaN would not order).
    if (m >= 0x7f800000u) m = 0x7f800000u;
    max_[l] = kernels::BitsFloat(m);
    counts_[3 * l + 2] = nz;
  }
  CPD_RETURN_IF_ERROR(comm_->AllReduce(max_.data(), layers, ReduceOp::kMax));
  *finite = true;
  for (size_t l = 0; l < layers; ++l) {
    if (!(max_[l] < std::numeric_limits<float>::infinity())) *finite = false;
    const bool shifted = opts_.aps && opts_.algo != AllReduceAlgo::kFp32;
    shifts_[l] = shifted ? ApsShift(max_[l], w_, emax_) : 0;
  }
  return Status::Ok();
}

Status Reducer::Reduce(float* const* inputs, float* output, int64_t step, bool measure_error) {
  const size_t total = layout_.total();
  if (total > 0) {
    if (inputs == nullptr || output == nullptr) {
      return Status::InvalidArgument("GradientAllReducer::Reduce on rank " + std::to_string(rank_) +
                                     ": null inputs or output");
    }
    for (int k = 0; k < k_; ++k) {
      if (inputs[k] == nullptr) {
        return Status::InvalidArgument("GradientAllReducer::Reduce on rank " +
                                       std::to_string(rank_) + ": inputs[" + std::to_string(k) +
                                       "] is null");
      }
    }
  }
  nonfinite_ = false;
  bytes_sent_ = 0;
  std::fill(counts_.begin(), counts_.end(), 0u);
  std::fill(err_.begin(), err_.end(), 0.0);
  std::fill(th_counts_.begin(), th_counts_.end(), 0u);
  for (auto& s : stats_) {
    s.shift = 0;
    s.max_abs = 0;
    s.flushed = 0;
    s.saturated = 0;
    s.rel_error = -1;
  }
  bool finite = true;
  CPD_RETURN_IF_ERROR(ScanAndShifts(inputs, &finite));
  for (size_t l = 0; l < stats_.size(); ++l) {
    stats_[l].max_abs = max_[l];
    stats_[l].shift = shifts_[l];
  }
  if (!finite) {
    nonfinite_ = true;
    return Status::Ok();
  }
  if (opts_.algo == AllReduceAlgo::kFp32) {
    CPD_RETURN_IF_ERROR(ReduceFp32(inputs, output, measure_error));
  } else {
    for (size_t i = 0; i < slots_.size(); ++i) {
      const BucketPlan& b = plan_->buckets()[i];
      if (measure_error) CPD_RETURN_IF_ERROR(ExactChunk(b, inputs, k_));
      switch (transport_) {
        case Transport::kCodes:
          CPD_RETURN_IF_ERROR(BucketCodes(b, slots_[i], inputs, output, step));
          break;
        case Transport::kSegments:
          CPD_RETURN_IF_ERROR(BucketSegments(b, slots_[i], inputs, output, step));
          break;
        case Transport::kFloats:
          CPD_RETURN_IF_ERROR(BucketFloats(b, slots_[i], inputs, output, step));
          break;
      }
      if (measure_error) AccumulateError(b, output);
    }
  }
  return FinishStats(measure_error);
}

Status Reducer::ReduceFp32(float* const* inputs, float* output, bool measure) {
  // The K local replicas first, in replica order, then the backend's all-reduce per bucket.
  const size_t total = layout_.total();
  if (k_ > 1 || output != inputs[0]) {
    const long blocks = long((total + kScanBlock - 1) / kScanBlock);
#pragma omp parallel for schedule(static) num_threads(threads_) if (threads_ > 1 && blocks > 1)
    for (long bi = 0; bi < blocks; ++bi) {
      const size_t s = size_t(bi) * kScanBlock, e = std::min(total, s + kScanBlock);
      if (k_ == 1) {
        std::memcpy(output + s, inputs[0] + s, (e - s) * sizeof(float));
        continue;
      }
      for (size_t i = s; i < e; ++i) {
        float acc = inputs[0][i];
        for (int k = 1; k < k_; ++k) acc += inputs[k][i];
        output[i] = acc;
      }
    }
  }
  for (const BucketPlan& b : plan_->buckets()) {
    const size_t len = b.size();
    if (measure) {
      // `output` holds this rank's sum of its replicas now, before the all-reduce.
      const float* local[1] = {output};
      CPD_RETURN_IF_ERROR(ExactChunk(b, local, 1));
    }
    CPD_RETURN_IF_ERROR(comm_->AllReduce(output + b.bounds.begin, len, ReduceOp::kSum));
    bytes_sent_ += 2 * uint64_t(p_ - 1) * len * sizeof(float) / uint64_t(p_);
    if (measure) AccumulateError(b, output);
  }
  return Status::Ok();
}

Status Reducer::BucketCodes(const BucketPlan& b, const Slots& sl, float* const* inputs,
                            float* output, int64_t step) {
  const size_t layers = size_t(Layers());
  const size_t slot = sl.bytes, block = size_t(k_) * slot;
  const kernels::FloatGrid& g = format_.grid();
  const internal::CodeDecoder& dec = decoder_;
  // A piece's codes start at this byte of its chunk's slot.
  auto byte_off = [&](const Piece& pc) {
    return (pc.begin - b.chunk_begin(pc.chunk)) * size_t(bits_) / 8;
  };

  // 1. Every local contribution, quantised after its layer's shift and packed per destination.
  const long pieces = long(b.pieces.size());
  const long items = pieces * k_;
#pragma omp parallel for schedule(static) num_threads(threads_) if (threads_ > 1 && items > 1)
  for (long it = 0; it < items; ++it) {
    const int k = int(it / pieces);
    const Piece& pc = b.pieces[size_t(it % pieces)];
    const size_t th = size_t(omp_get_thread_num());
    EncodePiece(inputs[k] + pc.begin, b, pc, /*shifted=*/true, mode_, int64_t(rank_) * k_ + k, step,
                send_.data() + size_t(pc.chunk) * block + size_t(k) * slot + byte_off(pc),
                &th_counts_[th * 2 * layers]);
  }
  CPD_RETURN_IF_ERROR(comm_->AllToAllBytes(send_.data(), recv_.data(), block));
  bytes_sent_ += uint64_t(p_ - 1) * block;

  // 2. This rank's chunk: the W contributions in worker order w = r * K + k.
  const bool packed = opts_.algo == AllReduceAlgo::kPacked;
  const long first = long(b.piece_start[size_t(rank_)]);
  const long last = long(b.piece_start[size_t(rank_) + 1]);
#pragma omp parallel for schedule(static) \
    num_threads(threads_) if (threads_ > 1 && last - first > 1)
  for (long pi = first; pi < last; ++pi) {
    const Piece& pc = b.pieces[size_t(pi)];
    const size_t n = pc.end - pc.begin;
    const size_t th = size_t(omp_get_thread_num());
    float* f = &th_floats_[th * 6 * kPiece];
    float *acc = f, *t = f + kPiece, *c = f + 2 * kPiece, *y = f + 3 * kPiece, *u = f + 4 * kPiece,
          *q = f + 5 * kPiece;
    auto src = [&](int w) {
      return recv_.data() + size_t(w / k_) * block + size_t(w % k_) * slot + byte_off(pc);
    };
    internal::DecodeCodes(src(0), n, dec, acc);
    if (packed) {
      // Sum in float32, then one re-quantisation of the sum.
      for (int w = 1; w < w_; ++w) internal::DecodeCodesAdd(src(w), n, dec, acc);
      EncodePiece(acc, b, pc, /*shifted=*/false, mode_, 5 * int64_t(w_), step,
                  gsend_.data() + byte_off(pc), nullptr);
    } else if (!opts_.kahan) {
      // acc = Q(acc + q_w): rounded to the format after every addition.
      for (int w = 1; w < w_; ++w) {
        internal::DecodeCodesAdd(src(w), n, dec, acc);
        kernels::QuantizeFloatGrid(
            acc, acc, nullptr, n, g, 0,
            Params(mode_, opts_.seed, w_ + 4 * int64_t(w - 1), step, pc.begin), nullptr);
      }
    } else {
      // Kahan's compensated sum with every operation rounded to the format.
      std::fill(c, c + n, 0.0f);
      for (int w = 1; w < w_; ++w) {
        const int64_t st = w_ + 4 * int64_t(w - 1);
        internal::DecodeCodes(src(w), n, dec, q);
        for (size_t i = 0; i < n; ++i) y[i] = q[i] - c[i];
        kernels::QuantizeFloatGrid(y, y, nullptr, n, g, 0,
                                   Params(mode_, opts_.seed, st, step, pc.begin), nullptr);
        for (size_t i = 0; i < n; ++i) t[i] = acc[i] + y[i];
        kernels::QuantizeFloatGrid(t, t, nullptr, n, g, 0,
                                   Params(mode_, opts_.seed, st + 1, step, pc.begin), nullptr);
        for (size_t i = 0; i < n; ++i) u[i] = t[i] - acc[i];
        kernels::QuantizeFloatGrid(u, u, nullptr, n, g, 0,
                                   Params(mode_, opts_.seed, st + 2, step, pc.begin), nullptr);
        for (size_t i = 0; i < n; ++i) c[i] = u[i] - y[i];
        kernels::QuantizeFloatGrid(c, c, nullptr, n, g, 0,
                                   Params(mode_, opts_.seed, st + 3, step, pc.begin), nullptr);
        std::swap(acc, t);
      }
    }
    if (!packed) {
      // acc is on the grid: rounding it again only yields its codes.
      EncodePiece(acc, b, pc, /*shifted=*/false, kernels::RoundMode::kNearestEven, 0, 0,
                  gsend_.data() + byte_off(pc), nullptr);
    }
  }
  CPD_RETURN_IF_ERROR(comm_->AllGatherBytes(gsend_.data(), grecv_.data(), slot));
  bytes_sent_ += uint64_t(p_ - 1) * slot;

  // 3. Every chunk's result, decoded and shifted back by 2^-s per layer.
  const long all = long(b.pieces.size());
#pragma omp parallel for schedule(static) num_threads(threads_) if (threads_ > 1 && all > 1)
  for (long pi = 0; pi < all; ++pi) {
    const Piece& pc = b.pieces[size_t(pi)];
    const uint8_t* src = grecv_.data() + size_t(pc.chunk) * slot + byte_off(pc);
    const size_t n = pc.end - pc.begin;
    const Segment& first_seg = b.segments[pc.first_segment];
    if (first_seg.end >= pc.end) {
      // One layer: decode and undo its shift in one pass.
      const int sh = shifts_[size_t(first_seg.layer)];
      if (sh == 0) {
        internal::DecodeCodes(src, n, dec, output + pc.begin);
      } else {
        internal::DecodeCodesScaled(src, n, dec, kernels::Pow2(-sh), output + pc.begin);
      }
      continue;
    }
    internal::DecodeCodes(src, n, dec, output + pc.begin);
    for (size_t si = pc.first_segment; si < b.segments.size() && b.segments[si].begin < pc.end;
         ++si) {
      const Segment& s = b.segments[si];
      const int sh = shifts_[size_t(s.layer)];
      if (sh == 0) continue;
      const float up = kernels::Pow2(-sh);
      const size_t lo = std::max(s.begin, pc.begin), hi = std::min(s.end, pc.end);
      for (size_t i = lo; i < hi; ++i) output[i] *= up;
    }
  }
  return Status::Ok();
}

void Reducer::EncodePiece(const float* x, const BucketPlan& b, const Piece& pc, bool shifted,
                          kernels::RoundMode mode, int64_t stage, int64_t step, uint8_t* dst,
                          uint64_t* stats) {
  const kernels::FloatGrid& g = format_.grid();
  const size_t n = pc.end - pc.begin;
  const size_t th = size_t(omp_get_thread_num());
  // 8-bit codes go straight to dst; other widths through an L1 buffer, packed at the end.
  uint16_t* c16 = &th_codes_[th * kPiece];
  uint8_t* c8 = bits_ == 8 ? dst : reinterpret_cast<uint8_t*>(c16);
  auto encode = [&](size_t lo, size_t hi, int sh, uint64_t* st) {
    const kernels::LoopParams p = Params(mode, opts_.seed, stage, step, lo);
    if (bits_ <= 8) {
      internal::EncodeCodes8(x + (lo - pc.begin), hi - lo, kernels::Pow2(sh), g, p,
                             c8 + (lo - pc.begin), st, shifted);
    } else {
      internal::EncodeCodes16(x + (lo - pc.begin), hi - lo, kernels::Pow2(sh), g, p,
                              c16 + (lo - pc.begin), st, shifted);
    }
  };
  if (!shifted) {
    encode(pc.begin, pc.end, 0, nullptr);
  } else {
    for (size_t si = pc.first_segment; si < b.segments.size() && b.segments[si].begin < pc.end;
         ++si) {
      const Segment& s = b.segments[si];
      encode(std::max(s.begin, pc.begin), std::min(s.end, pc.end), shifts_[size_t(s.layer)],
             stats != nullptr ? stats + 2 * size_t(s.layer) : nullptr);
    }
  }
  if (bits_ < 8) internal::PackSmallCodes(c8, n, bits_, dst);
  if (bits_ > 8) internal::PackSmallCodes(c16, n, bits_, dst);
}

void Reducer::ApplyShiftInPlace(const BucketPlan& b, float* const* inputs) {
  for (int k = 0; k < k_; ++k) {
    for (const Segment& s : b.segments) {
      const int sh = shifts_[size_t(s.layer)];
      if (sh == 0) continue;
      const float scale = kernels::Pow2(sh);
      float* x = inputs[k];
      for (size_t i = s.begin; i < s.end; ++i) x[i] *= scale;
    }
  }
}

void Reducer::Unshift(const BucketPlan& b, int chunk, float* output) const {
  for (size_t si = b.seg_start[size_t(chunk)]; si < b.seg_start[size_t(chunk) + 1]; ++si) {
    const Segment& s = b.segments[si];
    const int sh = shifts_[size_t(s.layer)];
    if (sh == 0) continue;
    const float up = kernels::Pow2(-sh);
    for (size_t i = s.begin; i < s.end; ++i) output[i] *= up;
  }
}

Status Reducer::BucketSegments(const BucketPlan& b, const Slots& sl, float* const* inputs,
                               float* output, int64_t step) {
  const size_t slot = sl.bytes, block = size_t(k_) * slot;
  ApplyShiftInPlace(b, inputs);
  for (int d = 0; d < p_; ++d) {
    for (int k = 0; k < k_; ++k) {
      const int64_t worker = int64_t(rank_) * k_ + k;
      for (size_t si = b.seg_start[size_t(d)]; si < b.seg_start[size_t(d) + 1]; ++si) {
        const Segment& s = b.segments[si];
        QuantStats qs;
        CPD_RETURN_IF_ERROR(Encode(format_, inputs[k] + s.begin, s.end - s.begin,
                                   Qopts(worker, step, s.begin), &pt_, &qs));
        std::memcpy(send_.data() + size_t(d) * block + size_t(k) * slot + sl.seg_offset[si],
                    pt_.bytes.data(), pt_.bytes.size());
        counts_[3 * size_t(s.layer)] += qs.flushed;
        counts_[3 * size_t(s.layer) + 1] += qs.saturated;
      }
    }
  }
  CPD_RETURN_IF_ERROR(comm_->AllToAllBytes(send_.data(), recv_.data(), block));
  bytes_sent_ += uint64_t(p_ - 1) * block;

  // Decode a segment's packed bytes at `src` into out.
  auto decode = [&](const Segment& s, const uint8_t* src, float* out) {
    const size_t len = s.end - s.begin;
    pt_.count = len;
    pt_.channels = 1;
    pt_.bytes.assign(src, src + PackedSize(format_, len, 1));
    return Decode(format_, pt_, out, threads_);
  };
  const size_t c0 = b.bounds.chunk_bounds[size_t(rank_)];
  for (size_t si = b.seg_start[size_t(rank_)]; si < b.seg_start[size_t(rank_) + 1]; ++si) {
    const Segment& s = b.segments[si];
    const size_t len = s.end - s.begin, rel = s.begin - c0;
    float* acc = acc_.data() + rel;
    float* tmp = tmp_.data() + rel;
    for (int w = 0; w < w_; ++w) {
      const uint8_t* src =
          recv_.data() + size_t(w / k_) * block + size_t(w % k_) * slot + sl.seg_offset[si];
      CPD_RETURN_IF_ERROR(decode(s, src, w == 0 ? acc : tmp));
      if (w > 0) {
        for (size_t i = 0; i < len; ++i) acc[i] += tmp[i];
      }
    }
    CPD_RETURN_IF_ERROR(
        Encode(format_, acc, len, Qopts(5 * int64_t(w_), step, s.begin), &pt_, nullptr));
    std::memcpy(gsend_.data() + sl.seg_offset[si], pt_.bytes.data(), pt_.bytes.size());
  }
  CPD_RETURN_IF_ERROR(comm_->AllGatherBytes(gsend_.data(), grecv_.data(), slot));
  bytes_sent_ += uint64_t(p_ - 1) * slot;
  for (int d = 0; d < p_; ++d) {
    for (size_t si = b.seg_start[size_t(d)]; si < b.seg_start[size_t(d) + 1]; ++si) {
      const Segment& s = b.segments[si];
      CPD_RETURN_IF_ERROR(
          decode(s, grecv_.data() + size_t(d) * slot + sl.seg_offset[si], output + s.begin));
    }
    Unshift(b, d, output);
  }
  return Status::Ok();
}

Status Reducer::BucketFloats(const BucketPlan& b, const Slots& sl, float* const* inputs,
                             float* output, int64_t step) {
  const size_t slot = sl.bytes, block = size_t(k_) * slot;
  const size_t slot_f = slot / sizeof(float), block_f = block / sizeof(float);
  ApplyShiftInPlace(b, inputs);
  float* send = reinterpret_cast<float*>(send_.data());
  const float* recv = reinterpret_cast<const float*>(recv_.data());
  for (int d = 0; d < p_; ++d) {
    for (int k = 0; k < k_; ++k) {
      const int64_t worker = int64_t(rank_) * k_ + k;
      for (size_t si = b.seg_start[size_t(d)]; si < b.seg_start[size_t(d) + 1]; ++si) {
        const Segment& s = b.segments[si];
        QuantStats qs;
        CPD_RETURN_IF_ERROR(
            Quantize(format_, inputs[k] + s.begin,
                     send + size_t(d) * block_f + size_t(k) * slot_f + (s.begin - b.chunk_begin(d)),
                     s.end - s.begin, Qopts(worker, step, s.begin), &qs));
        counts_[3 * size_t(s.layer)] += qs.flushed;
        counts_[3 * size_t(s.layer) + 1] += qs.saturated;
      }
    }
  }
  CPD_RETURN_IF_ERROR(comm_->AllToAllBytes(send_.data(), recv_.data(), block));
  bytes_sent_ += uint64_t(p_ - 1) * block;

  for (size_t si = b.seg_start[size_t(rank_)]; si < b.seg_start[size_t(rank_) + 1]; ++si) {
    const Segment& s = b.segments[si];
    const size_t len = s.end - s.begin, rel = s.begin - b.chunk_begin(rank_);
    auto q = [&](int w) { return recv + size_t(w / k_) * block_f + size_t(w % k_) * slot_f + rel; };
    float* acc = acc_.data() + rel;
    float* tmp = tmp_.data() + rel;
    std::copy_n(q(0), len, acc);
    if (!opts_.kahan) {
      for (int w = 1; w < w_; ++w) {
        const float* qw = q(w);
        for (size_t i = 0; i < len; ++i) tmp[i] = acc[i] + qw[i];
        CPD_RETURN_IF_ERROR(
            Quantize(format_, tmp, acc, len, Qopts(w_ + 4 * int64_t(w - 1), step, s.begin)));
      }
    } else {
      float* c = comp_.data() + rel;
      float* y = y_.data() + rel;
      float* u = u_.data() + rel;
      float* t = t_.data() + rel;
      std::fill(c, c + len, 0.0f);
      for (int w = 1; w < w_; ++w) {
        const int64_t st = w_ + 4 * int64_t(w - 1);
        const float* qw = q(w);
        for (size_t i = 0; i < len; ++i) tmp[i] = qw[i] - c[i];
        CPD_RETURN_IF_ERROR(Quantize(format_, tmp, y, len, Qopts(st, step, s.begin)));
        for (size_t i = 0; i < len; ++i) tmp[i] = acc[i] + y[i];
        CPD_RETURN_IF_ERROR(Quantize(format_, tmp, t, len, Qopts(st + 1, step, s.begin)));
        for (size_t i = 0; i < len; ++i) tmp[i] = t[i] - acc[i];
        CPD_RETURN_IF_ERROR(Quantize(format_, tmp, u, len, Qopts(st + 2, step, s.begin)));
        for (size_t i = 0; i < len; ++i) tmp[i] = u[i] - y[i];
        CPD_RETURN_IF_ERROR(Quantize(format_, tmp, c, len, Qopts(st + 3, step, s.begin)));
        std::copy_n(t, len, acc);
      }
    }
  }
  CPD_RETURN_IF_ERROR(
      comm_->AllGatherBytes(reinterpret_cast<const uint8_t*>(acc_.data()), grecv_.data(), slot));
  bytes_sent_ += uint64_t(p_ - 1) * slot;
  const float* gathered = reinterpret_cast<const float*>(grecv_.data());
  for (int d = 0; d < p_; ++d) {
    for (size_t si = b.seg_start[size_t(d)]; si < b.seg_start[size_t(d) + 1]; ++si) {
      const Segment& s = b.segments[si];
      const int sh = shifts_[size_t(s.layer)];
      const float up = kernels::Pow2(-sh);
      const float* src = gathered + size_t(d) * slot_f + (s.begin - b.chunk_begin(d));
      for (size_t i = 0; i < s.end - s.begin; ++i) output[s.begin + i] = src[i] * up;
    }
  }
  return Status::Ok();
}

Status Reducer::ExactChunk(const BucketPlan& b, const float* const* src, int count) {
  size_t max_slot = 0;
  max_slot = plan_->max_chunk();
  if (exact_.empty()) {
    exact_send_.assign(max_slot * size_t(p_), 0.0f);
    exact_.assign(max_slot, 0.0f);
  }
  const size_t slot = b.max_chunk;
  for (int d = 0; d < p_; ++d) {
    const size_t c0 = b.bounds.chunk_bounds[size_t(d)], c1 = b.bounds.chunk_bounds[size_t(d) + 1];
    float* dst = exact_send_.data() + size_t(d) * slot;
    for (size_t i = c0; i < c1; ++i) {
      float v = src[0][i];
      for (int k = 1; k < count; ++k) v += src[k][i];
      dst[i - c0] = v;
    }
    std::fill(dst + (c1 - c0), dst + slot, 0.0f);
  }
  return comm_->ReduceScatter(exact_send_.data(), exact_.data(), slot * size_t(p_));
}

void Reducer::AccumulateError(const BucketPlan& b, const float* output) {
  const size_t c0 = b.bounds.chunk_bounds[size_t(rank_)];
  for (size_t si = b.seg_start[size_t(rank_)]; si < b.seg_start[size_t(rank_) + 1]; ++si) {
    const Segment& s = b.segments[si];
    double e2 = 0.0, r2 = 0.0;
    for (size_t i = s.begin; i < s.end; ++i) {
      const double ref = exact_[i - c0];
      const double d = double(output[i]) - ref;
      e2 += d * d;
      r2 += ref * ref;
    }
    err_[2 * size_t(s.layer)] += e2;
    err_[2 * size_t(s.layer) + 1] += r2;
  }
}

Status Reducer::FinishStats(bool measure) {
  const size_t layers = size_t(Layers());
  if (opts_.algo != AllReduceAlgo::kFp32) {
    for (size_t th = 0; th < size_t(threads_); ++th) {
      for (size_t l = 0; l < layers; ++l) {
        counts_[3 * l] += th_counts_[th * 2 * layers + 2 * l];
        counts_[3 * l + 1] += th_counts_[th * 2 * layers + 2 * l + 1];
      }
    }
    CPD_RETURN_IF_ERROR(comm_->AllReduce(counts_.data(), counts_.size(), ReduceOp::kSum));
    for (size_t l = 0; l < layers; ++l) {
      const uint64_t elems = uint64_t(LayerEnd(int(l)) - LayerBegin(int(l))) * uint64_t(w_);
      const uint64_t nonzero = counts_[3 * l + 2];
      stats_[l].flushed = nonzero > 0 ? double(counts_[3 * l]) / double(nonzero) : 0.0;
      stats_[l].saturated = elems > 0 ? double(counts_[3 * l + 1]) / double(elems) : 0.0;
    }
  }
  if (measure) {
    // Every rank sums the per-rank parts in rank order, so the result is identical everywhere.
    CPD_RETURN_IF_ERROR(comm_->AllGatherBytes(reinterpret_cast<const uint8_t*>(err_.data()),
                                              reinterpret_cast<uint8_t*>(err_all_.data()),
                                              err_.size() * sizeof(double)));
    for (size_t l = 0; l < layers; ++l) {
      double e2 = 0.0, r2 = 0.0;
      for (size_t r = 0; r < size_t(p_); ++r) {
        e2 += err_all_[r * 2 * layers + 2 * l];
        r2 += err_all_[r * 2 * layers + 2 * l + 1];
      }
      stats_[l].rel_error = r2 > 0.0   ? std::sqrt(e2 / r2)
                            : e2 > 0.0 ? std::numeric_limits<double>::infinity()
                                       : 0.0;
    }
  }
  return Status::Ok();
}

}  // namespace

Result<AllReduceAlgo> ParseAllReduceAlgo(const std::string& name) {
  if (name == "fp32") return AllReduceAlgo::kFp32;
  if (name == "emulate") return AllReduceAlgo::kEmulate;
  if (name == "packed") return AllReduceAlgo::kPacked;
  return Status::InvalidArgument("unknown all-reduce algorithm '" + name +
                                 "' (accepted: fp32, emulate, packed)");
}

const char* AllReduceAlgoName(AllReduceAlgo a) {
  switch (a) {
    case AllReduceAlgo::kFp32:
      return "fp32";
    case AllReduceAlgo::kEmulate:
      return "emulate";
    case AllReduceAlgo::kPacked:
      return "packed";
  }
  return "?";
}

Status GradientAllReduceOptions::Validate() const {
  if (algo != AllReduceAlgo::kFp32) {
    Result<Format> f = Format::Parse(format);
    if (!f.ok()) {
      return Status::InvalidArgument("gradient format '" + format + "' for all-reduce " +
                                     AllReduceAlgoName(algo) + ": " + f.status().message());
    }
  }
  if (!(bucket_mb > 0.0) || !std::isfinite(bucket_mb)) {
    return Status::InvalidArgument("bucket_mb must be a positive number of MiB, got " +
                                   std::to_string(bucket_mb));
  }
  if (threads < 0) {
    return Status::InvalidArgument("threads must be >= 0 (0 = all cores), got " +
                                   std::to_string(threads));
  }
  if (kahan && algo != AllReduceAlgo::kEmulate) {
    return Status::InvalidArgument(std::string("kahan summation applies to all-reduce emulate "
                                               "only, not ") +
                                   AllReduceAlgoName(algo));
  }
  return Status::Ok();
}

int ApsShift(float max_abs, int workers, int emax) {
  if (!(max_abs > 0.0f) || !std::isfinite(max_abs) || workers < 1) return 0;
  // max_abs * workers is exact in double (24-bit significand times an int below 2^29).
  const double v = double(max_abs) * double(workers);
  int e = 0;
  const double m = std::frexp(v, &e);  // v = m * 2^e, 0.5 <= m < 1
  const int ceil_log2 = m == 0.5 ? e - 1 : e;
  return std::clamp(emax - ceil_log2, -kMaxShift, kMaxShift);
}

int ApsEmax(const Format& format) {
  switch (format.family()) {
    case FormatFamily::kIntSymmetric:
      return kernels::FloorLog2(float((1 << (format.bits() - 1)) - 1));
    case FormatFamily::kUintMinMax:
      return kernels::FloorLog2(float((1u << format.bits()) - 1u));
    default:
      return kernels::FloorLog2(kernels::BitsFloat(format.grid().max_bits));
  }
}

uint64_t RoundingSeed(uint64_t seed, int64_t stage) {
  return SplitMix(seed ^ SplitMix(uint64_t(stage) ^ 0x9c6a1f3e5b7d2481ull));
}

Result<std::unique_ptr<GradientAllReducer>> GradientAllReducer::Create(
    Communicator* comm, const GradientAllReduceOptions& opts, GradientLayout layout,
    int local_replicas) {
  if (comm == nullptr) {
    return Status::InvalidArgument("GradientAllReducer: null communicator");
  }
  if (comm->memory() != MemorySpace::kHost) {
    return Status::InvalidArgument(
        "GradientAllReducer: the communicator works on device memory; the reducer needs a "
        "host-memory one (SelfCommunicator or MpiCommunicator)");
  }
  CPD_RETURN_IF_ERROR(opts.Validate());
  if (local_replicas < 1) {
    return Status::InvalidArgument("GradientAllReducer: local_replicas (K) must be >= 1, got " +
                                   std::to_string(local_replicas));
  }
  const size_t layers = layout.layer_names.size();
  if (!(layers == 0 && layout.offsets.empty())) {
    if (layout.offsets.size() != layers + 1) {
      return Status::InvalidArgument("GradientAllReducer: layout has " + std::to_string(layers) +
                                     " layer names but " + std::to_string(layout.offsets.size()) +
                                     " offsets; need layers + 1 = " + std::to_string(layers + 1));
    }
    if (layout.offsets[0] != 0) {
      return Status::InvalidArgument("GradientAllReducer: layout offsets[0] must be 0, got " +
                                     std::to_string(layout.offsets[0]));
    }
    for (size_t l = 0; l < layers; ++l) {
      if (layout.offsets[l + 1] < layout.offsets[l]) {
        return Status::InvalidArgument(
            "GradientAllReducer: layout offsets must not decrease; layer " + std::to_string(l) +
            " ('" + layout.layer_names[l] + "') ends at " + std::to_string(layout.offsets[l + 1]) +
            " before it starts at " + std::to_string(layout.offsets[l]));
      }
    }
  }
  Result<Format> format =
      Format::Parse(opts.algo == AllReduceAlgo::kFp32 ? std::string("fp32") : opts.format);
  if (!format.ok()) return format.status();
  auto reducer = std::make_unique<Reducer>(comm, opts, std::move(layout), local_replicas,
                                           std::move(format).value());
  CPD_RETURN_IF_ERROR(reducer->Init());
  return std::unique_ptr<GradientAllReducer>(std::move(reducer));
}

}  // namespace cpd::comm
