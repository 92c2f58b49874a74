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
// Gradients are fused into buckets of at most bucket_mb (layers are kept whole where they fit;
// each layer keeps its own shift).
#pragma once

#include <cstddef>
#include <cstdint>
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

struct GradientAllReduceOptions {
  AllReduceAlgo algo = AllReduceAlgo::kFp32;
  std::string format = "e4m3";  // the gradient format (ignored by fp32)
  Rounding rounding = Rounding::kNearest;
  bool aps = false;
  bool kahan = false;      // emulate only
  double bucket_mb = 25;   // > 0
  uint64_t seed = 0;       // stochastic rounding stream (mixed with step and worker)
  int threads = 0;         // quantisation threads; 0 = all cores
  Status Validate() const;
};

// The flat gradient buffer: layer l occupies [offsets[l], offsets[l + 1]).
struct GradientLayout {
  std::vector<std::string> layer_names;
  std::vector<size_t> offsets;  // size layer_names.size() + 1, offsets[0] = 0, non-decreasing
  size_t total() const { return offsets.empty() ? 0 : offsets.back(); }
  size_t layers() const { return layer_names.size(); }
};

// Per layer, for the last Reduce() (identical on every rank).
struct LayerCommStats {
  std::string layer;
  int shift = 0;           // APS shift s_l (0 without APS)
  float max_abs = 0;       // global max |g_l| over all W contributions, before the shift
  double flushed = 0;      // fraction of nonzero contribution elements quantised to 0
  double saturated = 0;    // fraction of contribution elements beyond the largest finite value
  double rel_error = -1;   // ||q - exact|| / ||exact|| against an fp32 all-reduce; -1 if not
                           // measured this step
};

class GradientAllReducer {
 public:
  // `comm` must outlive the reducer. local_replicas = K >= 1.
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
};

}  // namespace cpd::comm
