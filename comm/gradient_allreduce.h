// Gradient all-reduce in customised precision (the CPD paper's study mode and a real
// bandwidth-saving mode), with per-layer auto-precision scaling (APS, Han/Demmel/You).
//
// The trainer hands over, per step, the flattened gradients of its K local replicas (K > 1 with
// --emulate-ranks: K logical workers in one process). There are W = world_size * K logical
// workers; rank r's replica k is worker w = r * K + k. Every algorithm returns on every rank the
// identical SUM over the W contributions (not the mean; the caller divides).
//
// Algorithms (--allreduce):
//   fp32     the K local replicas are summed in fp32 in order, then the backend's own all-reduce.
//   emulate  faithful to CPD: every contribution is quantised to the gradient format (after the
//            APS shift), then the W contributions are summed in worker order with rounding to the
//            format after every addition (kahan: a Kahan-compensated sum, every operation
//            rounded). Traffic is O(size) per rank: each rank owns a chunk, gathers the W
//            quantised contributions of it, sums them in order, and the chunks are all-gathered.
//   packed   values travel as densely packed b-bit codes (cpd::Encode) with their scale
//            metadata: all-to-all of packed chunks (reduce-scatter), decode and sum the W
//            contributions in fp32, one re-quantisation, all-gather of the packed result.
//
// APS (aps = true): for every layer l, e_l = ceil(log2(max|g_l| * W)) from the global max
// (one small MAX all-reduce for all layers per step), shift s_l = emax(format) - e_l; the
// gradients are multiplied by 2^s_l before quantisation and by 2^-s_l after the sum. Without APS
// the shift is 0. The same small collective also carries a non-finite flag: when any input on any
// rank holds NaN/Inf, Reduce() reports it on every rank and leaves `output` untouched, so that
// the step is skipped everywhere.
//
// APS scaling of packed (aps_scaling): the paper's shift above leaves log2(W) binades of headroom
// so that a *low-precision* running sum cannot overflow; packed sums in float32, where that
// headroom only throws range away (e3m0 at W = 64 flushes every contribution). With `sum` (packed's
// default with APS), every contribution is shifted so that max|g_l| itself reaches the top,
// s_l = ApsShift(max|g_l|, 1, emax), capped at ApsShift(max|g_l|, W, 127) so that the float32 sum
// of the W contributions stays finite; the rank that owns a segment (a layer's part of a chunk)
// re-quantises its float32 sum after a second shift t = ApsShift(max|sum|, 1, emax) of that
// segment (0 for an all-zero sum), clamped so that |s_l + t| <= 126, and sends t (one int8 per
// segment, after the codes of its chunk) with the all-gather; every rank decodes the segment and
// multiplies by 2^-(s_l + t); since t depends on the chunk bounds, so do the results (as with the
// per-tensor-scaled formats below). LayerCommStats::shift reports s_l. emulate keeps the paper's
// formula (its sums are in the format): `sum` with emulate is InvalidArgument; fp32 ignores it.
//
// Gradients are fused into buckets of at most bucket_mb (layers are kept whole where they fit;
// each layer keeps its own shift).
//
// Hybrid precision (the APS paper's remedy; options.layer_formats): named layers travel in their
// own format (another spec, or "fp32"), the others in options.format, over the same plan. Each
// segment is quantised, summed and re-quantised in its layer's format; APS uses its layer's
// emax; fp32 layers travel as float32, unshifted and exact (a float32 sum in worker order). A
// mixed plan always takes the per-segment paths (packed: cpd::Encode'd segments of per-format
// sizes; emulate: quantised float32 values), also for fixed float grids; a layer map that gives
// every layer options.format changes nothing. Host and device gradients alike.
//
// Details this implementation fixes (comm/gradient_allreduce.cc and comm/allreduce/):
// - bucket_mb counts MiB of float32 (2^20 bytes). A layer larger than a bucket is split into
//   buckets at multiples of 64 elements from the layer's start.
// - In a bucket, rank r owns chunk r, [chunk_bounds[r], chunk_bounds[r + 1]) (buckets()): the
//   bucket split evenly, each boundary that falls inside a layer rounded down to a multiple of
//   64 elements from that layer's start. A segment is a layer's part of one chunk.
// - Scale groups of per-tensor-scaled formats (int<b>, uint<b>:minmax, fp134, log<b>...) are
//   segments, so their results depend on the world size; MX/bfp blocks count from the layer's
//   start and fixed float grids are element-wise, so those results do not. A flat gradient has
//   no channels: channel-scaled formats (:ch) see each segment as one channel.
// - emulate with a fixed float grid of <= 16 bits ships the quantised values as packed codes (they
//   are exact); otherwise as float32. The result is the same bits either way.
// - emax(format), used by APS: the exponent of the largest finite value of the element grid
//   (e4m3 8, e5m2 15, e3m0 3, fp16 15, bf16 127; mxfp8 8, mxfp4 2); for int<b> and
//   uint<b>:minmax the exponent of the largest level (int8: 6). Formats that choose a scale per
//   group from the data (int, MX, bfp, fp134) give the same values with and without the shift,
//   except near the ends of the float32 range, where the shift keeps the float32 sums finite.
//   Shifts are clamped to [-126, 126], so 2^s and 2^-s are normal floats and scaling is exact
//   unless a product lands below float32's normal range.
// - Stochastic rounding: every rounding (of a contribution, of an addition, of a sum) has its own
//   stream, drawn from opts.seed, the step and each element's index in the flat buffer, so the
//   results depend neither on threads nor on the split into pieces. comm/allreduce/internal.h
//   numbers the streams.
// - Pipelining (pipeline_kb > 0, fixed float grids of <= 16 bits, P > 1, a communicator with a
//   nonblocking exchange: MPI, not NCCL; Communicator::has_nonblocking_exchange): a
//   bucket's stages run over rounds, each round a slice of every chunk of about pipeline_kb KiB
//   of codes per contribution; round j's contributions are quantised while round j - 1's are on
//   the wire, and summed as they arrive, and the all-gather of one round overlaps the decoding of
//   the previous one, over the communicator's nonblocking exchange. Each element meets the same
//   arithmetic in the same order, so the results are the same bits as the sequential schedule
//   (pipeline_kb = 0: one blocking all-to-all and one all-gather per bucket).
// - last_stats().rel_error compares with a float32 reduce-scatter of the same inputs.
// - last_bytes_sent() counts what a bandwidth-optimal implementation of each payload collective
//   sends from this rank: all-to-all (P-1) blocks, all-gather (P-1) blocks, all-reduce
//   2(P-1)/P of the buffer (pipelined: the bytes of every round, without the padding of
//   blocks to a cache line). The per-step max/statistics collectives (O(layers)) are not
//   counted.
//
// Gradients in device memory (options.gradients = kDevice, CUDA builds): the same algorithms
// over the device back end (comm/allreduce/backend.h, device_backend.cc): the same plan, schedule,
// per-layer formats, streams, statistics and bytes sent, with the element loops as CUDA kernels
// (comm/reduce_kernels_cuda.h) and the payload collectives on device buffers, over any
// communicator: a device-memory one (NcclCommunicator) directly, a host-memory one (MPI, Self)
// with the payload staged through pinned host memory (a pipelined schedule's exchanges through
// pinned mirrors). Only the payload crosses PCIe: packed codes (fp32 stages its float32 buckets,
// formats other than fixed float grids of <= 16 bits their cpd::Encode'd segments or quantised
// float32 values, as on the wire; measure_error copies its float32 reference and this rank's
// chunks of the result). Every result is bit for bit the host path's with the same communicator
// kind (fp32 and the reference over NCCL sum in NCCL's order). Formats other than fixed float
// grids of <= 16 bits (int, uint:minmax, MX, bfp, fp134, log, binades) are encoded per segment with
// cpd::EncodeCuda / QuantizeCuda, whose statistics wait for the stream (a synchronisation per
// segment and replica). Reduce() returns once the sum is complete on options.cuda_stream (it waits
// for the stream). The per-layer max|g| all-reduce runs on host values (one small copy and one
// stream synchronisation per step); each payload collective waits for the stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "cpd/format.h"
#include "cpd/quantize.h"
#include "cpd/status.h"

namespace cpd::comm {

enum class AllReduceAlgo { kFp32, kEmulate, kPacked };
Result<AllReduceAlgo> ParseAllReduceAlgo(const std::string& name);  // fp32 | emulate | packed
const char* AllReduceAlgoName(AllReduceAlgo a);

// How APS scales the contributions (see "APS scaling of packed" above): kAuto is kSum for packed
// and kPaper for emulate; kPaper is the paper's formula everywhere; kSum is packed only.
enum class ApsScaling { kAuto, kPaper, kSum };
Result<ApsScaling> ParseApsScaling(const std::string& name);  // auto | paper | sum
const char* ApsScalingName(ApsScaling s);
struct GradientAllReduceOptions;
// Whether `o` selects the sum scaling: aps, packed, and aps_scaling auto or sum.
bool UsesApsSumScaling(const GradientAllReduceOptions& o);

// Validate() (also called by Create) gives InvalidArgument, naming the option, the value and what
// is accepted, for: a format that does not parse (emulate and packed only), bucket_mb outside
// (0, kMaxBucketMb], threads < 0, pipeline_kb outside [0, kMaxPipelineKb], kahan with an algorithm
// other than emulate, aps_scaling kSum with emulate, layer_formats with the fp32 algorithm or with
// a spec that does not parse. The bounds on the sizes users give (cpd-train's and
// cpd-allreduce-bench's --bucket-mb and
// --pipeline-kb, whose names Validate's messages use): a bucket's buffers and a round's slices
// are allocated at these sizes, so a mistyped value must not reach an allocation.
inline constexpr double kMaxBucketMb = 4096;        // 4 GiB of float32 gradients per bucket
inline constexpr int kMaxPipelineKb = 1024 * 1024;  // 1 GiB of codes per round
struct GradientAllReduceOptions {
  AllReduceAlgo algo = AllReduceAlgo::kFp32;
  std::string format = "e4m3";  // the gradient format (ignored by fp32)
  // Hybrid precision: layer name (a GradientLayout name) -> its format spec ("fp32" allowed);
  // layers not named use `format`. emulate and packed only, host or device gradients; Create
  // refuses unknown names.
  std::map<std::string, std::string> layer_formats;
  Rounding rounding = Rounding::kNearest;
  bool aps = false;
  ApsScaling aps_scaling = ApsScaling::kAuto;  // with aps; ignored by fp32
  bool kahan = false;                          // emulate only
  double bucket_mb = 25;                       // > 0
  uint64_t seed = 0;  // stochastic rounding stream (mixed with step and worker)
  int threads = 0;    // quantisation threads; 0 = all cores
  // KiB of codes per contribution per round of the pipelined schedule (see "Pipelining" above);
  // 0 = the sequential schedule.
  int pipeline_kb = 256;
  // Where Reduce()'s inputs and output live. kDevice (CUDA builds only): device pointers of the
  // current CUDA device; the plan, the rounding streams and the bits of the result are the host
  // path's, see "Gradients in device memory" above.
  MemorySpace gradients = MemorySpace::kHost;
  // kDevice only: the cudaStream_t that produces the gradients and consumes the sum (nullptr =
  // the legacy default stream). Reduce() orders its work after what is queued on it.
  void* cuda_stream = nullptr;
  Status Validate() const;
};

// The flat gradient buffer: layer l occupies [offsets[l], offsets[l + 1]).
struct GradientLayout {
  std::vector<std::string> layer_names;
  std::vector<size_t> offsets;  // size layer_names.size() + 1, offsets[0] = 0, non-decreasing
  size_t total() const { return offsets.empty() ? 0 : offsets.back(); }
  size_t layers() const { return layer_names.size(); }
};

// Whether Create accepts gradients in device memory: in a CUDA build (for every algorithm and
// format).
bool DeviceGradientsSupported();

// One fusion bucket: the flat range [begin, end) and the chunk each rank owns in it.
struct GradientBucket {
  size_t begin = 0;
  size_t end = 0;
  std::vector<size_t> chunk_bounds;  // world_size + 1 entries, chunk_bounds[0] = begin
};

// APS (Han/Demmel/You): the shift for a layer whose largest |g| over all `workers` contributions
// is max_abs: s = emax - ceil(log2(max_abs * workers)), clamped to [-126, 126]; 0 for an all-zero
// layer (or a non-finite max).
int ApsShift(float max_abs, int workers, int emax);
// emax(format) as described above. REQUIRED: a format Validate() accepts.
int ApsEmax(const Format& format);

// Per layer, for the last Reduce() (identical on every rank).
struct LayerCommStats {
  std::string layer;
  std::string format;     // the layer's all-reduce format spec ("fp32" for the fp32 algorithm)
  int shift = 0;          // APS shift s_l (0 without APS)
  float max_abs = 0;      // global max |g_l| over all W contributions, before the shift
  double flushed = 0;     // fraction of nonzero contribution elements quantised to 0
  double saturated = 0;   // fraction of contribution elements beyond the largest finite value
  double rel_error = -1;  // ||q - exact|| / ||exact|| against an fp32 all-reduce; -1 if not
                          // measured this step
};

class GradientAllReducer {
 public:
  // `comm` must outlive the reducer. Host gradients need a host-memory communicator
  // (SelfCommunicator, MpiCommunicator); device gradients take either kind.
  // local_replicas = K >= 1. InvalidArgument for bad options, K < 1, a null communicator, a
  // device-memory communicator with host gradients, device gradients in a build without CUDA, a
  // layer_formats name the layout does not have, or a layout whose offsets are not layers() + 1
  // non-decreasing values from 0.
  // Scratch memory is bounded by the largest bucket and allocated here (the measure_error
  // reference buffers on first use), not per Reduce().
  // Thread-safety: a reducer is not thread-safe; call it from one thread (its Communicator's).
  static Result<std::unique_ptr<GradientAllReducer>> Create(Communicator* comm,
                                                            const GradientAllReduceOptions& opts,
                                                            GradientLayout layout,
                                                            int local_replicas);
  virtual ~GradientAllReducer() = default;

  // inputs[k] (k < K) points to layout.total() floats of local replica k; they may be used as
  // scratch (their contents are unspecified afterwards). `output` receives layout.total()
  // floats, the sum over all W workers; it may alias inputs[0]. `step` feeds the stochastic
  // rounding stream. With measure_error, also computes LayerCommStats::rel_error (an extra
  // fp32 all-reduce). Collective: every rank calls it with the same layout and step.
  virtual Status Reduce(float* const* inputs, float* output, int64_t step,
                        bool measure_error = false) = 0;

  // Whether the last Reduce() found NaN/Inf in some input (on any rank); output was not written.
  virtual bool last_nonfinite() const = 0;
  // Statistics of the last Reduce(), one entry per layer, in layout order.
  virtual const std::vector<LayerCommStats>& last_stats() const = 0;
  // Bytes this rank sent in the last Reduce() (payload only, for busbw).
  virtual uint64_t last_bytes_sent() const = 0;
  // The fusion buckets, in order (fixed at Create).
  virtual const std::vector<GradientBucket>& buckets() const = 0;
};

}  // namespace cpd::comm
