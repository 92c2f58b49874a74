// The precision policy of a training run and the hooks that apply it at the four quantisation
// sites of every quantisable layer (Lee et al., ICLR 2022): W weights as used in forward,
// A input activations, E errors (gradient w.r.t. the output), G weight gradients.
//
// Resolution for layer L, site S, step t (later rules win):
//   1. the global --w/a/e/g-format (default fp32);
//   2. CPT (--cyclic-bits MIN MAX): W = uint<b_t>:minmax:ch and A = uint<b_t>:minmax, nearest;
//      E = uint<grad_bits>:minmax with stochastic rounding (Fu et al., ICLR 2021);
//   3. per-layer overrides NAME.SITE=SPEC;
//   4. layers listed in keep_fp32 ("first", "last", or a layer name) stay fp32 at every site.
// Then the grouping of a log<b> spec without :ch or :tensor (Format::scope_by_layer()): per
// output channel ("log<b>:ch") for the W and G of convolutions (Conv2d), per tensor
// ("log<b>:tensor") everywhere else, as Lee et al. (ICLR 2022) scale their log weights; SpecFor
// and the statistics' records name the resolved spec.
//
// Weight flips: for every layer whose W is quantised, the quantised weights of each forward are
// kept (one copy per layer, on the layer's device) and compared with the next forward's, bit for
// bit; the number that changed is the layer's flip count, with nearest (or any) rounding as with
// hysteresis, so the two can be compared. A forward whose W format differs from the previous
// one's (a CPT step to other bits, a pushed schedule) counts no flips and starts afresh.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cpd/format.h"
#include "cpd/quantize.h"
#include "cpd/schedule.h"
#include "cpd/transform.h"
#include "runtime/nn/layer.h"

namespace cpd::runtime {

enum class Site { kWeight = 0, kActivation = 1, kError = 2, kWeightGrad = 3 };
constexpr int kNumSites = 4;
const char* SiteName(Site s);  // "W", "A", "E", "G"
Result<Site> ParseSite(const std::string& s);

struct SiteFormat {
  std::string spec = "fp32";  // "fp32": the site is not quantised
  Rounding rounding = Rounding::kNearest;
};

struct PrecisionConfig {
  SiteFormat global[kNumSites];                                  // indexed by int(Site)
  std::map<std::string, std::map<Site, std::string>> overrides;  // layer -> site -> spec
  std::vector<std::string> keep_fp32;  // "first", "last" (quantisable layers) or layer names
  // Hybrid precision of the gradient all-reduce (not a quantisation site): NAME=SPEC in order,
  // later entries winning; NAME "first"/"last" (the first/last layer with gradients), "bn"
  // (every BatchNorm layer) or a layer name; SPEC a format spec or "fp32". Resolved against the
  // model by runtime/train/allreduce_layers.h; the SiteQuantizer ignores it.
  std::vector<std::pair<std::string, std::string>> allreduce_layers;
  std::optional<CyclicPrecision> cpt;
  int grad_bits = 8;  // CPT's fixed backward precision
  bool hysteresis = false;
  // A block Hadamard transform of both operands of every Linear's weight-gradient product, down
  // the rows they are summed over, before A and E quantise them ("rht16", "had64"; none when
  // empty): NVFP4's and MXFP4 training's random Hadamard transform. Its signs are drawn by
  // (seed, step).
  std::string wgrad_transform;
  // How the matrix products of the quantised layers accumulate (cpd/accumulate.h:
  // "e8m13:every=128" is DeepSeek-V3's FP8 GEMM; empty: float32 GEMMs).
  std::string accumulate;
  uint64_t seed = 0;
};

// Parses "NAME.SITE=SPEC" (NAME may contain dots) into config->overrides, checking the spec.
Status AddLayerOverride(const std::string& text, PrecisionConfig* config);
// Parses "NAME=SPEC" (--allreduce-layer-format) into config->allreduce_layers, checking the spec
// (the name is checked against the model when the all-reducer is built).
Status AddAllReduceLayerFormat(const std::string& text, PrecisionConfig* config);

// The policy as one JSON object (sites, rounding, overrides, keep_fp32, CPT, grad bits,
// hysteresis, seed) and back; used to hand a schedule from rank 0 to every rank, to record the
// schedule in force in checkpoints and metrics. FromJson checks every spec and value it reads.
std::string PrecisionConfigToJson(const PrecisionConfig& config);
// One line describing a policy: "CPT 3-8/8, W=e4m3 ..., 2 overrides, fp32: last, hysteresis".
std::string DescribePrecision(const PrecisionConfig& config);
Result<PrecisionConfig> PrecisionConfigFromJson(const std::string& text);

// Devices: the hooks quantise where the layer's tensors are: cpd::Quantize /
// cpd::QuantizeHysteresis for CPU tensors, cpd::QuantizeCuda / cpd::QuantizeHysteresisCuda
// (cpd/quantize_cuda.h: bit-identical results and statistics counts) for CUDA tensors, queued
// on the runtime's CUDA stream (runtime/engine/cuda_ops.h); flips are counted there too
// (the hysteresis kernel's own count, or cpd::CountFlipsAndKeepCuda). On the GPU the statistics
// and flip counts stay in device memory (cpd::CudaStatsSlots) as the steps run: no hook waits for
// the stream. TakeRecords, Flips and TakeFlips read them back, each with at most one copy and one
// wait (TakeRecords also refreshes the flips, so a report that asks for both waits once).

// Statistics of one site of one layer at one step.
struct SiteRecord {
  std::string layer;
  Site site;
  std::string format;
  QuantStats stats;
};

class SiteQuantizer : public QuantHooks {
 public:
  ~SiteQuantizer() override;
  // `layers`: every quantisable layer of the model, in model order (the first and last of them
  // are "first" and "last"). Fails on unknown layer names in overrides or keep_fp32, or on bad
  // specs.
  static Result<std::unique_ptr<SiteQuantizer>> Create(PrecisionConfig config,
                                                       const std::vector<Layer*>& layers);
  // Replaces the policy mid-run (a schedule pushed by the coordinator), checked as Create checks
  // it; on error nothing changes. Hysteresis state is kept: a layer whose W format changed
  // starts its hysteresis afresh at its next forward. Callers re-install the hooks afterwards
  // (Quantizes() may have changed).
  Status Reconfigure(PrecisionConfig config);

  // The step about to run (selects CPT bits; part of the stochastic-rounding stream).
  // Restarts the per-site call counts (below).
  void SetStep(int64_t step);
  // The logical data-parallel worker whose micro-batch runs next (0 for single-process runs):
  // each worker draws its own stochastic-rounding stream, as separate ranks would. Worker 0
  // keeps the single-process stream, so a one-worker run is unchanged. Restarts the per-site
  // call counts, so an emulated worker counts its calls as a rank of its own would.
  //
  // Stochastic-rounding streams: each (worker, layer, site) has its own, and within a step the
  // k-th call of a site (an attention product's second operand, an LSTM's timesteps: one A and
  // one E call per step of the sequence) draws the k-th stream of it, so that no two tensors of
  // a step are rounded with the same random bits. The first call keeps the stream a one-call
  // layer always had.
  void SetWorker(uint64_t worker);
  // While on, every site records its statistics (TakeRecords() hands them over).
  void SetCollectStats(bool on) { collect_ = on; }
  // The records since the last call, in the order the sites ran. Statistics of GPU sites come
  // back from the device here (one copy, one wait for the runtime's stream); CUDA failures throw
  // std::runtime_error, as the hooks do.
  std::vector<SiteRecord> TakeRecords();
  // Weight flips per layer since the last call (every layer; 0 where W is not quantised).
  std::map<std::string, uint64_t> TakeFlips();
  // The same counts without resetting them.
  std::map<std::string, uint64_t> Flips() const;

  // The format spec in force for a layer and site at the current step ("fp32" if none), with
  // log<b>'s grouping resolved for the layer ("log4:ch" or "log4:tensor").
  std::string SpecFor(const std::string& layer, Site site) const;
  // Whether some layer's W is quantised at the current step (so flips are counted).
  bool QuantizesWeights() const;
  // Whether any site of `layer` can be quantised at some step (layers that never are need no
  // hooks, which saves the layer a copy of its input and incoming gradient).
  bool Quantizes(const std::string& layer) const;
  // Installs this quantiser as the hooks of each layer that Quantizes() (null on the others);
  // called at the start and again after Reconfigure.
  void InstallHooks(const std::vector<Layer*>& layers);
  // CPT forward bits at the current step (0 without CPT); MAX bits in evaluation mode.
  int CurrentBits() const;
  // Evaluation: CPT evaluates at its highest precision, as the model is deployed.
  void SetEval(bool eval) { eval_ = eval; }
  const PrecisionConfig& config() const { return config_; }

  // The previous quantised weights of every layer whose W is quantised (hysteresis's Q_{t-1},
  // and what the next flip count compares with) for checkpoints, in host memory (state kept on
  // the GPU is copied back first). The pointers stay valid until the next hook call.
  std::map<std::string, const std::vector<float>*> HysteresisState() const;
  void RestoreHysteresisState(const std::string& layer, std::vector<float> q);

  // QuantHooks.
  void QuantizeWeight(const Layer& layer, const Tensor& w_master, Tensor* w_used) override;
  void QuantizeActivation(const Layer& layer, const Tensor& x, Tensor* x_used) override;
  void QuantizeError(const Layer& layer, const Tensor& dy, Tensor* dy_used) override;
  void QuantizeWeightGrad(const Layer& layer, Tensor* dw) override;
  std::optional<HadamardOptions> WeightGradTransform(const Layer& layer) const override;
  const kernels::Accumulation* ProductAccumulation(const Layer& layer) const override;

 private:
  struct LayerState {
    int index = 0;
    std::string kind;  // Layer::kind(): what --keep-fp32's groups select by
    bool keep_fp32 = false;
    bool conv = false;  // a convolution: log<b> groups its W and G per output channel
    // Previous quantised weights (kept while W is quantised), in host memory, or on the GPU
    // while the layer runs there: prev_on_device means prev_dev holds the newest copy and
    // prev may be stale.
    mutable std::vector<float> prev;
    Tensor prev_dev;
    bool prev_on_device = false;
    std::string prev_spec;  // the format the previous weights were quantised to
    uint64_t flips = 0;
    std::array<uint32_t, kNumSites> calls{};  // quantisations of each site since SetStep/SetWorker
  };

  // A record whose statistics may still be on the device: slot `slot` of the device's slots
  // (kHostSlot: `record.stats` already holds them).
  struct PendingRecord {
    static constexpr size_t kHostSlot = ~size_t(0);
    SiteRecord record;
    size_t slot = kHostSlot;
  };
  struct DeviceStatistics;  // the slots of GPU sites (quant_sites.cc; empty without CUDA)

  SiteQuantizer();
  // The layers one --keep-fp32 entry names: first, last, embeddings (token and position
  // embeddings), attention (every attention product), tail=P% (the last P% of the Linear layers,
  // rounded up) or a layer's name.
  Result<std::vector<std::string>> KeptLayers(const std::string& entry) const;
  // Resolves keep_fp32 and checks overrides and specs against this model's layers; fills
  // `keep` with the layers kept fp32.
  Status Check(const PrecisionConfig& config, std::vector<std::string>* keep) const;
  const Format* FormatFor(const std::string& layer, Site site, Rounding* rounding) const;
  // The parsed format of a spec (checked in Create, so it parses).
  const Format& CachedFormat(const std::string& spec) const;
  // Forgets a layer's previous quantised weights (its W is no longer quantised).
  static void DropPrevious(LayerState& st);
  // Quantises `in` into `out` (which may be `in` itself) at one site.
  void Apply(const Layer& layer, Site site, const Tensor& in, Tensor* out, size_t channels);
  // QuantizeWeight for CUDA tensors.
  void QuantizeWeightCuda(const Layer& layer, LayerState& st, const Format& f, Rounding r,
                          const Tensor& w_master, Tensor* w_used);
  // Counts the call in st.calls (the stream of the site's next call).
  QuantizeOptions OptionsFor(LayerState& st, Site site, Rounding r, size_t channels);
  void RestartCallCounts();
  // GPU statistics: the slots (created on first use, GpuStats), the slot of the next record, and
  // the flips counted on the device per layer index (read when some were queued since the last
  // read).
  DeviceStatistics& GpuStats();
  size_t NextRecordSlot();
  std::vector<uint64_t> DeviceFlips() const;

  PrecisionConfig config_;
  std::optional<kernels::Accumulation> accumulation_;  // config_.accumulate, parsed
  std::map<std::string, LayerState> layers_;
  std::string first_layer_, last_layer_;
  std::vector<std::string> order_;  // the quantisable layers in model order
  mutable std::map<std::string, Format> format_cache_;
  int64_t step_ = 0;
  uint64_t worker_ = 0;
  bool collect_ = false;
  bool eval_ = false;
  std::vector<PendingRecord> records_;
  std::unique_ptr<DeviceStatistics> device_;
};

}  // namespace cpd::runtime
