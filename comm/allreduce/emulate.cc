// emulate, faithful to CPD: every contribution quantised to the gradient format (after the APS
// shift), the W contributions of a chunk summed in worker order with rounding to the format after
// every addition (kahan: a compensated sum, every operation rounded), the chunks all-gathered.
// Fixed float grids of <= 16 bits travel as packed codes (comm/allreduce/codes.h), other formats
// as quantised float32 values; the result is the same bits either way.
#include <omp.h>

#include <algorithm>
#include <utility>

#include "comm/allreduce/codes.h"
#include "comm/allreduce/internal.h"

namespace cpd::comm::internal {
namespace {

// Packed codes, piece by piece.
class EmulateCodes final : public BucketAlgorithm {
 public:
  EmulateCodes(StepContext* ctx, std::unique_ptr<CodeTransport> codes)
      : BucketAlgorithm(ctx), codes_(std::move(codes)) {
    // Per thread: the sum, t, c, y, u and the decoded contribution (kahan); the sum alone else.
    const std::size_t per_thread = setup_.options.kahan ? kScratchPerThread : 1;
    thread_floats_.assign(std::size_t(setup_.threads) * per_thread * kPiece, 0.0f);
  }

 protected:
  Status ReduceBucket(std::size_t, const BucketPlan& b, float* const* inputs, float* output,
                      std::int64_t step) override {
    CodeTransport::OwnChunk own;
    own.sum = [&](std::span<const Piece> pieces) { SumPieces(b, pieces, step); };
    return codes_->ReduceBucket(b, inputs, output, step, own);
  }

 private:
  static constexpr std::size_t kScratchPerThread = 6;

  // Pieces of this rank's chunk: the W contributions in worker order, the sum encoded for the
  // all-gather.
  void SumPieces(const BucketPlan& b, std::span<const Piece> pieces, std::int64_t step) {
    const int threads = setup_.threads;
    const long n = long(pieces.size());
    const std::size_t per_thread = setup_.options.kahan ? kScratchPerThread : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n > 1)
    for (long i = 0; i < n; ++i) {
      codes_->KeepExchangesMoving(i);
      const Piece& pc = pieces[std::size_t(i)];
      float* scratch = &thread_floats_[std::size_t(omp_get_thread_num()) * per_thread * kPiece];
      const float* sum = setup_.options.kahan ? SumPieceKahan(b, pc, step, scratch)
                                              : SumPieceRounded(b, pc, step, scratch);
      // The sum is on the grid: rounding it again only yields its codes.
      codes_->EncodeResult(sum, b, pc, kernels::RoundMode::kNearestEven, 0, 0);
    }
  }

  // acc = Q(acc + q_w): rounded to the format after every addition.
  const float* SumPieceRounded(const BucketPlan& b, const Piece& pc, std::int64_t step,
                               float* acc) const {
    const CodeDecoder& dec = codes_->decoder();
    DecodeCodes(codes_->Contribution(b, pc, 0), pc.size(), dec, acc);
    for (int w = 1; w < setup_.workers; ++w) {
      DecodeCodesAdd(codes_->Contribution(b, pc, w), pc.size(), dec, acc);
      Round(acc, pc, AdditionStage(setup_.workers, w), step);
    }
    return acc;
  }

  // Kahan's compensated sum with every operation rounded to the format.
  const float* SumPieceKahan(const BucketPlan& b, const Piece& pc, std::int64_t step,
                             float* scratch) const {
    const CodeDecoder& dec = codes_->decoder();
    const std::size_t n = pc.size();
    float *acc = scratch, *t = scratch + kPiece, *c = scratch + 2 * kPiece,
          *y = scratch + 3 * kPiece, *u = scratch + 4 * kPiece, *q = scratch + 5 * kPiece;
    DecodeCodes(codes_->Contribution(b, pc, 0), n, dec, acc);
    std::fill(c, c + n, 0.0f);
    for (int w = 1; w < setup_.workers; ++w) {
      const std::int64_t stage = AdditionStage(setup_.workers, w);
      DecodeCodes(codes_->Contribution(b, pc, w), n, dec, q);
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

  std::unique_ptr<CodeTransport> codes_;
  std::vector<float> thread_floats_;
};

// Scaled formats: the quantised values travel as float32, segment by segment.
class EmulateFloats final : public BucketAlgorithm {
 public:
  explicit EmulateFloats(StepContext* ctx) : BucketAlgorithm(ctx) {}

  Status Allocate() {
    std::size_t slot = 0;
    for (const BucketPlan& b : ctx_.plan.buckets()) slot = std::max(slot, SlotBytes(b));
    CPD_RETURN_IF_ERROR(ctx_.exchange.Allocate(setup_, slot));
    const std::size_t chunk = ctx_.plan.max_chunk();
    sum_.assign(std::max(chunk, slot / sizeof(float)), 0.0f);  // also the all-gather's send slot
    tmp_.assign(chunk, 0.0f);
    if (setup_.options.kahan) {
      comp_.assign(chunk, 0.0f);
      y_.assign(chunk, 0.0f);
      high_.assign(chunk, 0.0f);
      t_.assign(chunk, 0.0f);
    }
    return Status::Ok();
  }

 protected:
  Status ReduceBucket(std::size_t, const BucketPlan& b, float* const* inputs, float* output,
                      std::int64_t step) override {
    ctx_.ApplyShift(b, inputs);
    CPD_RETURN_IF_ERROR(QuantizeContributions(b, inputs, step));
    CPD_RETURN_IF_ERROR(
        ctx_.ExchangeContributions(std::size_t(setup_.local_replicas) * SlotBytes(b)));
    CPD_RETURN_IF_ERROR(SumOwnChunk(b, step));
    CPD_RETURN_IF_ERROR(
        ctx_.GatherChunks(reinterpret_cast<const std::uint8_t*>(sum_.data()), SlotBytes(b)));
    UnshiftResults(b, output);
    return Status::Ok();
  }

 private:
  std::size_t SlotBytes(const BucketPlan& b) const { return FloatSlotElems(b) * sizeof(float); }

  // Every local contribution (already shifted), quantised into its destination's block.
  Status QuantizeContributions(const BucketPlan& b, float* const* inputs, std::int64_t step) {
    const std::size_t slot = SlotBytes(b) / sizeof(float);
    const std::size_t block = std::size_t(setup_.local_replicas) * slot;
    float* send = reinterpret_cast<float*>(ctx_.exchange.send.data());
    for (int d = 0; d < setup_.world_size; ++d) {
      for (int k = 0; k < setup_.local_replicas; ++k) {
        float* dst = send + std::size_t(d) * block + std::size_t(k) * slot;
        for (const Segment& s : b.segments_of(d)) {
          QuantStats qs;
          CPD_RETURN_IF_ERROR(
              Quantize(setup_.FormatOf(s.layer), inputs[k] + s.begin,
                       dst + (s.begin - b.chunk_begin(d)), s.size(),
                       setup_.QuantizeAt(ContributionStage(setup_.worker(k)), step, s.begin), &qs));
          ctx_.stats.AddQuantStats(s.layer, qs);
        }
      }
    }
    return Status::Ok();
  }

  // This rank's chunk, segment by segment: the W contributions summed in worker order into sum_.
  Status SumOwnChunk(const BucketPlan& b, std::int64_t step) {
    const std::size_t slot = SlotBytes(b) / sizeof(float);
    const float* recv = reinterpret_cast<const float*>(ctx_.exchange.recv.data());
    const std::size_t c0 = b.chunk_begin(setup_.rank);
    for (const Segment& s : b.segments_of(setup_.rank)) {
      const std::size_t rel = s.begin - c0;
      auto q = [&](int w) { return recv + std::size_t(w) * slot + rel; };
      std::copy_n(q(0), s.size(), sum_.data() + rel);
      if (setup_.options.kahan) std::fill_n(comp_.data() + rel, s.size(), 0.0f);
      for (int w = 1; w < setup_.workers; ++w) {
        if (setup_.options.kahan) {
          CPD_RETURN_IF_ERROR(AddKahan(q(w), s, rel, AdditionStage(setup_.workers, w), step));
        } else {
          CPD_RETURN_IF_ERROR(AddRounded(q(w), s, rel, AdditionStage(setup_.workers, w), step));
        }
      }
    }
    return Status::Ok();
  }

  // sum = Q(sum + q_w) over segment s (at rel in the chunk).
  Status AddRounded(const float* qw, const Segment& s, std::size_t rel, std::int64_t stage,
                    std::int64_t step) {
    float* acc = sum_.data() + rel;
    float* tmp = tmp_.data() + rel;
    for (std::size_t i = 0; i < s.size(); ++i) tmp[i] = acc[i] + qw[i];
    return Quantize(setup_.FormatOf(s.layer), tmp, acc, s.size(),
                    setup_.QuantizeAt(stage, step, s.begin));
  }

  // One step of Kahan's compensated sum (compensation c), every operation rounded.
  Status AddKahan(const float* qw, const Segment& s, std::size_t rel, std::int64_t stage,
                  std::int64_t step) {
    const std::size_t n = s.size();
    float *acc = sum_.data() + rel, *tmp = tmp_.data() + rel, *c = comp_.data() + rel,
          *y = y_.data() + rel, *high = high_.data() + rel, *t = t_.data() + rel;
    auto round = [&](float* out, int op) {
      return Quantize(setup_.FormatOf(s.layer), tmp, out, n,
                      setup_.QuantizeAt(stage + op, step, s.begin));
    };
    for (std::size_t i = 0; i < n; ++i) tmp[i] = qw[i] - c[i];
    CPD_RETURN_IF_ERROR(round(y, kKahanY));
    for (std::size_t i = 0; i < n; ++i) tmp[i] = acc[i] + y[i];
    CPD_RETURN_IF_ERROR(round(t, kKahanT));
    for (std::size_t i = 0; i < n; ++i) tmp[i] = t[i] - acc[i];
    CPD_RETURN_IF_ERROR(round(high, kKahanHigh));
    for (std::size_t i = 0; i < n; ++i) tmp[i] = high[i] - y[i];
    CPD_RETURN_IF_ERROR(round(c, kKahanC));
    std::copy_n(t, n, acc);
    return Status::Ok();
  }

  // Every chunk's result, times 2^-s of its layer.
  void UnshiftResults(const BucketPlan& b, float* output) const {
    const std::size_t slot = SlotBytes(b) / sizeof(float);
    const float* gathered = reinterpret_cast<const float*>(ctx_.exchange.gather_recv.data());
    for (int d = 0; d < setup_.world_size; ++d) {
      for (const Segment& s : b.segments_of(d)) {
        const float up = kernels::Pow2(-ctx_.shifts[std::size_t(s.layer)]);
        const float* src = gathered + std::size_t(d) * slot + (s.begin - b.chunk_begin(d));
        for (std::size_t i = 0; i < s.size(); ++i) output[s.begin + i] = src[i] * up;
      }
    }
  }

  std::vector<float> sum_, tmp_, comp_, y_, high_, t_;  // a chunk each
};

}  // namespace

Result<std::unique_ptr<Algorithm>> MakeEmulate(StepContext* ctx) {
  // A hybrid plan rounds each segment to its layer's format: the per-segment path.
  if (!ctx->setup.mixed() && CodeTransport::Supports(ctx->setup.format)) {
    CPD_ASSIGN_OR_RETURN(std::unique_ptr<CodeTransport> codes, CodeTransport::Create(ctx));
    return std::unique_ptr<Algorithm>(new EmulateCodes(ctx, std::move(codes)));
  }
  auto floats = std::make_unique<EmulateFloats>(ctx);
  CPD_RETURN_IF_ERROR(floats->Allocate());
  return std::unique_ptr<Algorithm>(std::move(floats));
}

}  // namespace cpd::comm::internal
