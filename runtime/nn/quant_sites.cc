#include "runtime/nn/quant_sites.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "cpd/accumulate.h"
#include "cpd/config.h"
#include "kernels/grid.h"
#if CPD_WITH_CUDA
#include "cpd/quantize_cuda.h"
#include "runtime/engine/cuda_ops.h"
#endif

namespace cpd::runtime {

const char* SiteName(Site s) {
  switch (s) {
    case Site::kWeight:
      return "W";
    case Site::kActivation:
      return "A";
    case Site::kError:
      return "E";
    case Site::kWeightGrad:
      return "G";
  }
  return "?";
}

Result<Site> ParseSite(const std::string& s) {
  if (s == "W" || s == "w") return Site::kWeight;
  if (s == "A" || s == "a") return Site::kActivation;
  if (s == "E" || s == "e") return Site::kError;
  if (s == "G" || s == "g") return Site::kWeightGrad;
  return Status::InvalidArgument("bad quantisation site '" + s + "' (accepted: W, A, E, G)");
}

Status AddLayerOverride(const std::string& text, PrecisionConfig* config) {
  const size_t eq = text.find('=');
  const size_t dot = eq == std::string::npos ? std::string::npos : text.rfind('.', eq);
  if (eq == std::string::npos || dot == std::string::npos || dot == 0 || eq + 1 >= text.size()) {
    return Status::InvalidArgument("bad --layer-format '" + text +
                                   "' (expected NAME.SITE=SPEC, e.g. conv1.W=e4m3)");
  }
  auto site = ParseSite(text.substr(dot + 1, eq - dot - 1));
  if (!site.ok())
    return Status::InvalidArgument("--layer-format '" + text + "': " + site.status().message());
  const std::string spec = text.substr(eq + 1);
  auto f = Format::Parse(spec);
  if (!f.ok())
    return Status::InvalidArgument("--layer-format '" + text + "': " + f.status().message());
  config->overrides[text.substr(0, dot)][*site] = f->spec();
  return Status::Ok();
}

Status AddAllReduceLayerFormat(const std::string& text, PrecisionConfig* config) {
  const size_t eq = text.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 >= text.size()) {
    return Status::InvalidArgument("bad --allreduce-layer-format '" + text +
                                   "' (expected NAME=SPEC, NAME a layer, first, last or bn; e.g. "
                                   "first=fp32)");
  }
  auto f = Format::Parse(text.substr(eq + 1));
  if (!f.ok()) {
    return Status::InvalidArgument("--allreduce-layer-format '" + text +
                                   "': " + f.status().message());
  }
  config->allreduce_layers.emplace_back(text.substr(0, eq), f->spec());
  return Status::Ok();
}

std::string PrecisionConfigToJson(const PrecisionConfig& c) {
  using nlohmann::json;
  json sites = json::object();
  for (int i = 0; i < kNumSites; ++i) {
    sites[SiteName(Site(i))] = {{"spec", c.global[i].spec},
                                {"rounding", RoundingName(c.global[i].rounding)}};
  }
  json overrides = json::object();
  for (const auto& [layer, by_site] : c.overrides) {
    for (const auto& [site, spec] : by_site) overrides[layer][SiteName(site)] = spec;
  }
  json j = {{"sites", sites},           {"overrides", overrides},     {"keep_fp32", c.keep_fp32},
            {"grad_bits", c.grad_bits}, {"hysteresis", c.hysteresis}, {"seed", c.seed}};
  if (!c.wgrad_transform.empty()) j["wgrad_transform"] = c.wgrad_transform;
  if (!c.accumulate.empty()) j["accumulate"] = c.accumulate;
  if (!c.allreduce_layers.empty()) {
    json layers = json::array();
    for (const auto& [name, spec] : c.allreduce_layers) layers.push_back(json::array({name, spec}));
    j["allreduce_layers"] = layers;
  }
  if (c.cpt) {
    j["cpt"] = {{"min_bits", c.cpt->min_bits},
                {"max_bits", c.cpt->max_bits},
                {"periods", c.cpt->periods},
                {"total_iters", c.cpt->total_iters}};
  }
  return j.dump();
}

std::string DescribePrecision(const PrecisionConfig& c) {
  std::string out;
  auto add = [&out](const std::string& part) { out += (out.empty() ? "" : ", ") + part; };
  if (c.cpt) {
    add("CPT " + std::to_string(c.cpt->min_bits) + "-" + std::to_string(c.cpt->max_bits) + "/" +
        std::to_string(c.grad_bits) + " x" + std::to_string(c.cpt->periods));
  }
  std::string sites;
  for (int i = 0; i < kNumSites; ++i) {
    if (c.global[i].spec == "fp32") continue;
    sites += std::string(sites.empty() ? "" : " ") + SiteName(Site(i)) + "=" + c.global[i].spec;
    if (c.global[i].rounding != Rounding::kNearest) {
      sites += std::string("/") + RoundingName(c.global[i].rounding);
    }
  }
  if (!sites.empty()) add(sites);
  size_t overrides = 0;
  for (const auto& [layer, by_site] : c.overrides) overrides += by_site.size();
  if (overrides > 0) add(std::to_string(overrides) + " layer override(s)");
  if (!c.keep_fp32.empty()) {
    std::string keep;
    for (const auto& k : c.keep_fp32) keep += (keep.empty() ? "" : ",") + k;
    add("fp32: " + keep);
  }
  if (c.hysteresis) add("hysteresis");
  if (!c.wgrad_transform.empty()) add("weight-gradient " + c.wgrad_transform);
  if (!c.accumulate.empty()) add("accumulate " + c.accumulate);
  if (!c.allreduce_layers.empty()) {
    std::string layers;
    for (const auto& [name, spec] : c.allreduce_layers) {
      layers += (layers.empty() ? "" : ",") + name + "=" + spec;
    }
    add("all-reduce " + layers);
  }
  return out.empty() ? "fp32" : out;
}

Result<PrecisionConfig> PrecisionConfigFromJson(const std::string& text) {
  using nlohmann::json;
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return Status::InvalidArgument("precision config: not a JSON object");
  PrecisionConfig c;
  try {
    for (const auto& [site_name, v] : j.at("sites").items()) {
      CPD_ASSIGN_OR_RETURN(const Site site, ParseSite(site_name));
      CPD_ASSIGN_OR_RETURN(const Format f, Format::Parse(v.at("spec").get<std::string>()));
      CPD_ASSIGN_OR_RETURN(const Rounding r, ParseRounding(v.at("rounding").get<std::string>()));
      c.global[int(site)] = {f.spec(), r};
    }
    for (const auto& [layer, by_site] : j.at("overrides").items()) {
      for (const auto& [site_name, spec] : by_site.items()) {
        CPD_ASSIGN_OR_RETURN(const Site site, ParseSite(site_name));
        CPD_ASSIGN_OR_RETURN(const Format f, Format::Parse(spec.get<std::string>()));
        c.overrides[layer][site] = f.spec();
      }
    }
    c.keep_fp32 = j.at("keep_fp32").get<std::vector<std::string>>();
    c.grad_bits = j.at("grad_bits").get<int>();
    c.hysteresis = j.at("hysteresis").get<bool>();
    c.seed = j.at("seed").get<uint64_t>();
    if (j.contains("wgrad_transform")) {  // absent in configs written before it existed
      c.wgrad_transform = j["wgrad_transform"].get<std::string>();
      CPD_RETURN_IF_ERROR(ParseHadamard(c.wgrad_transform).status());
    }
    if (j.contains("accumulate")) {  // absent in configs written before it existed
      c.accumulate = j["accumulate"].get<std::string>();
      CPD_RETURN_IF_ERROR(ParseAccumulation(c.accumulate).status());
    }
    if (j.contains("allreduce_layers")) {  // absent in configs written before it existed
      for (const json& e : j["allreduce_layers"]) {
        const auto pair = e.get<std::vector<std::string>>();
        if (pair.size() != 2) {
          return Status::InvalidArgument(
              "precision config: allreduce_layers entries are "
              "[name, spec] pairs");
        }
        CPD_RETURN_IF_ERROR(AddAllReduceLayerFormat(pair[0] + "=" + pair[1], &c));
      }
    }
    if (j.contains("cpt")) {
      const json& p = j["cpt"];
      CyclicPrecision cpt;
      cpt.min_bits = p.at("min_bits").get<int>();
      cpt.max_bits = p.at("max_bits").get<int>();
      cpt.periods = p.at("periods").get<int>();
      cpt.total_iters = p.at("total_iters").get<int64_t>();
      CPD_RETURN_IF_ERROR(cpt.Validate());
      c.cpt = cpt;
    }
  } catch (const json::exception& e) {
    return Status::InvalidArgument(std::string("precision config: ") + e.what());
  }
  return c;
}

#if CPD_WITH_CUDA
// The statistics of the sites that run on a GPU, in one cpd::CudaStatsSlots: slot L (a layer's
// index) counts that layer's flips since the last TakeFlips; slots layers + i hold the i-th
// record taken on the device since the last TakeRecords.
struct SiteQuantizer::DeviceStatistics {
  std::unique_ptr<CudaStatsSlots> slots;
  size_t layers = 0;
  size_t records = 0;                // record slots in use: [layers, layers + records)
  bool flips_queued = false;         // work that counts flips was queued since the last read
  std::vector<uint64_t> flips_read;  // per layer index: the device's count at the last read
};
#else
struct SiteQuantizer::DeviceStatistics {};
#endif

SiteQuantizer::SiteQuantizer() = default;
SiteQuantizer::~SiteQuantizer() = default;

Result<std::unique_ptr<SiteQuantizer>> SiteQuantizer::Create(PrecisionConfig config,
                                                             const std::vector<Layer*>& layers) {
  std::unique_ptr<SiteQuantizer> q(new SiteQuantizer());
  for (size_t i = 0; i < layers.size(); ++i) {
    LayerState st;
    st.index = int(i);
    st.kind = layers[i]->kind();
    st.conv = st.kind == "Conv2d";
    q->layers_[layers[i]->name()] = st;
    q->order_.push_back(layers[i]->name());
  }
  if (!layers.empty()) {
    q->first_layer_ = layers.front()->name();
    q->last_layer_ = layers.back()->name();
  }
  CPD_RETURN_IF_ERROR(q->Reconfigure(std::move(config)));
  return q;
}

Result<std::vector<std::string>> SiteQuantizer::KeptLayers(const std::string& entry) const {
  auto of_kind = [&](std::initializer_list<std::string_view> kinds) {
    std::vector<std::string> names;
    for (const std::string& name : order_) {
      const std::string& kind = layers_.at(name).kind;
      for (std::string_view k : kinds) {
        if (kind == k) names.push_back(name);
      }
    }
    return names;
  };
  if (entry == "first" || entry == "last") {
    if (layers_.empty()) return std::vector<std::string>{};
    return std::vector<std::string>{entry == "first" ? first_layer_ : last_layer_};
  }
  if (entry == "embeddings") return of_kind({"TokenEmbedding", "PositionEmbedding"});
  if (entry == "attention") return of_kind({"AttentionProduct"});
  if (entry.rfind("tail=", 0) == 0 && entry.size() > 6 && entry.back() == '%') {
    // The last P% of the Linear layers in model order, rounded up (the NVFP4 recipe keeps about
    // 15% of a network's linear layers, most of them at its end, in higher precision).
    int percent = -1;
    const std::string digits = entry.substr(5, entry.size() - 6);
    const auto [p, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), percent);
    if (ec == std::errc() && p == digits.data() + digits.size() && percent >= 0 && percent <= 100) {
      const std::vector<std::string> linear = of_kind({"Linear"});
      const size_t count = (linear.size() * size_t(percent) + 99) / 100;
      return std::vector<std::string>(linear.end() - ptrdiff_t(count), linear.end());
    }
  }
  if (layers_.count(entry) == 0) {
    return Status::InvalidArgument(
        "--keep-fp32: no quantisable layer named '" + entry +
        "' (accepted: first, last, embeddings, attention, tail=P% with 0 <= P <= 100, or a "
        "layer name; see --print-model)");
  }
  return std::vector<std::string>{entry};
}

Status SiteQuantizer::Check(const PrecisionConfig& config, std::vector<std::string>* keep) const {
  if (!config.wgrad_transform.empty()) {
    auto t = ParseHadamard(config.wgrad_transform);
    if (!t.ok()) return Status::InvalidArgument("--wgrad-transform: " + t.status().message());
  }
  if (!config.accumulate.empty()) {
    auto a = ParseAccumulation(config.accumulate);
    if (!a.ok()) return Status::InvalidArgument("--accumulate: " + a.status().message());
  }
  for (const std::string& k : config.keep_fp32) {
    CPD_ASSIGN_OR_RETURN(const std::vector<std::string> names, KeptLayers(k));
    keep->insert(keep->end(), names.begin(), names.end());
  }
  for (const auto& [name, sites] : config.overrides) {
    if (layers_.count(name) == 0) {
      return Status::InvalidArgument("--layer-format: no quantisable layer named '" + name +
                                     "' (see --print-model)");
    }
    for (const auto& [site, spec] : sites) CPD_RETURN_IF_ERROR(Format::Parse(spec).status());
  }
  for (const SiteFormat& sf : config.global) CPD_RETURN_IF_ERROR(Format::Parse(sf.spec).status());
  if (config.cpt) CPD_RETURN_IF_ERROR(config.cpt->Validate());
  return Status::Ok();
}

Status SiteQuantizer::Reconfigure(PrecisionConfig config) {
  std::vector<std::string> keep;
  CPD_RETURN_IF_ERROR(Check(config, &keep));
  for (auto& [name, st] : layers_) {
    st.keep_fp32 = std::find(keep.begin(), keep.end(), name) != keep.end();
  }
  config_ = std::move(config);
  accumulation_.reset();
  if (!config_.accumulate.empty()) accumulation_ = *ParseAccumulation(config_.accumulate);
  for (auto& [name, st] : layers_) {
    if (!Quantizes(name)) DropPrevious(st);  // its hooks go: no forward would drop them
  }
  return Status::Ok();
}

bool SiteQuantizer::Quantizes(const std::string& layer) const {
  auto it = layers_.find(layer);
  if (it == layers_.end() || it->second.keep_fp32) return false;
  if (config_.cpt || config_.overrides.count(layer) > 0) return true;
  for (const SiteFormat& sf : config_.global) {
    if (sf.spec != "fp32") return true;
  }
  return false;
}

void SiteQuantizer::InstallHooks(const std::vector<Layer*>& layers) {
  for (Layer* l : layers) l->SetQuantHooks(Quantizes(l->name()) ? this : nullptr);
}

int SiteQuantizer::CurrentBits() const {
  if (!config_.cpt) return 0;
  return eval_ ? config_.cpt->max_bits : config_.cpt->BitsAt(step_);
}

std::string SiteQuantizer::SpecFor(const std::string& layer, Site site) const {
  auto it = layers_.find(layer);
  if (it == layers_.end() || it->second.keep_fp32) return "fp32";
  std::string spec = config_.global[int(site)].spec;
  if (config_.cpt) {
    const int b = CurrentBits();
    if (site == Site::kWeight) spec = "uint" + std::to_string(b) + ":minmax:ch";
    if (site == Site::kActivation) spec = "uint" + std::to_string(b) + ":minmax";
    if (site == Site::kError) spec = "uint" + std::to_string(config_.grad_bits) + ":minmax";
  }
  auto ov = config_.overrides.find(layer);
  if (ov != config_.overrides.end()) {
    auto s = ov->second.find(site);
    if (s != ov->second.end()) spec = s->second;
  }
  if (spec == "fp32" || !CachedFormat(spec).scope_by_layer()) return spec;
  // Lee et al. share a log scale per output channel in convolutions, per layer elsewhere.
  const bool weights = site == Site::kWeight || site == Site::kWeightGrad;
  return spec + (weights && it->second.conv ? ":ch" : ":tensor");
}

bool SiteQuantizer::QuantizesWeights() const {
  for (const auto& [name, st] : layers_) {
    if (SpecFor(name, Site::kWeight) != "fp32") return true;
  }
  return false;
}

const Format& SiteQuantizer::CachedFormat(const std::string& spec) const {
  auto it = format_cache_.find(spec);
  if (it == format_cache_.end()) {
    auto f = Format::Parse(spec);
    if (!f.ok()) throw std::invalid_argument(f.status().message());  // validated in Create
    it = format_cache_.emplace(spec, *f).first;
  }
  return it->second;
}

const Format* SiteQuantizer::FormatFor(const std::string& layer, Site site,
                                       Rounding* rounding) const {
  const std::string spec = SpecFor(layer, site);
  if (spec == "fp32") return nullptr;
  *rounding = config_.global[int(site)].rounding;
  if (config_.cpt && site == Site::kError &&
      spec == "uint" + std::to_string(config_.grad_bits) + ":minmax") {
    *rounding = Rounding::kStochastic;  // CPT's backward quantiser rounds stochastically
  }
  return &CachedFormat(spec);
}

void SiteQuantizer::SetStep(int64_t step) {
  step_ = step;
  RestartCallCounts();
}

void SiteQuantizer::SetWorker(uint64_t worker) {
  worker_ = worker;
  RestartCallCounts();
}

void SiteQuantizer::RestartCallCounts() {
  for (auto& [name, st] : layers_) st.calls.fill(0);
}

QuantizeOptions SiteQuantizer::OptionsFor(LayerState& st, Site site, Rounding r, size_t channels) {
  QuantizeOptions opts;
  opts.rounding = r;
  // Each (worker, layer, site) draws from its own stochastic-rounding stream, and each call of
  // the site within a step from its own part of it (SetWorker's comment).
  constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
  const uint64_t base =
      worker_ == 0 ? config_.seed : kernels::SplitMix64(config_.seed + kGolden * worker_);
  opts.seed = kernels::SplitMix64(base ^ (uint64_t(st.index) << 8 | uint64_t(site)));
  const uint32_t call = st.calls[size_t(site)]++;
  if (call > 0) opts.seed = kernels::SplitMix64(opts.seed + kGolden * call);
  opts.step = uint64_t(step_);
  opts.channels = channels;
  return opts;
}

void SiteQuantizer::Apply(const Layer& layer, Site site, const Tensor& in, Tensor* out,
                          size_t channels) {
  Rounding r = Rounding::kNearest;
  const Format* f = FormatFor(layer.name(), site, &r);
  if (f == nullptr) {
    if (out->data() != in.data()) out->CopyFrom(in);
    return;
  }
  if (in.empty()) return;
  if (out->device() != in.device()) {
    throw std::logic_error(layer.name() + "." + SiteName(site) + ": input on " +
                           DeviceName(in.device()) + ", output on " + DeviceName(out->device()));
  }
  LayerState& st = layers_.at(layer.name());
  PendingRecord pending{{layer.name(), site, f->spec(), QuantStats{}}};
  QuantizeOptions opts = OptionsFor(st, site, r, channels);
  // Block-scaled formats tile activations and errors along their last dimension (a Linear's
  // features, an attention operand's head dimension, a timestep's hidden units); weights and
  // their gradients are viewed as [output channels, fan-in] (columns 0: n / channels).
  if ((site == Site::kActivation || site == Site::kError) && in.ndim() > 0) {
    opts.columns = size_t(in.dim(in.ndim() - 1));
  }
  Status s;
#if CPD_WITH_CUDA
  if (in.device() == Device::kCuda) {
    CudaStatsTarget target;  // the statistics stay on the device until TakeRecords
    if (collect_) {
      target.slots = GpuStats().slots.get();
      target.stats = pending.slot = NextRecordSlot();
    }
    s = QuantizeCuda(*f, in.data(), out->data(), in.numel(), opts, target, cuda::Stream());
  } else {
    s = Quantize(*f, in.data(), out->data(), in.numel(), opts,
                 collect_ ? &pending.record.stats : nullptr);
  }
#else
  s = Quantize(*f, in.data(), out->data(), in.numel(), opts,
               collect_ ? &pending.record.stats : nullptr);
#endif
  if (!s.ok()) throw std::runtime_error(layer.name() + "." + SiteName(site) + ": " + s.message());
  if (collect_) records_.push_back(std::move(pending));
}

void SiteQuantizer::QuantizeWeight(const Layer& layer, const Tensor& w_master, Tensor* w_used) {
  Rounding r = Rounding::kNearest;
  const Format* f = FormatFor(layer.name(), Site::kWeight, &r);
  LayerState& st = layers_.at(layer.name());
  if (f == nullptr) {
    w_used->CopyFrom(w_master);
    DropPrevious(st);
    return;
  }
  if (w_master.device() != Device::kCpu) {
    QuantizeWeightCuda(layer, st, *f, r, w_master, w_used);
    return;
  }
  if (st.prev_on_device) {  // the layer ran on the GPU before: its newest state is there
    st.prev.resize(st.prev_dev.numel());
    st.prev_dev.CopyToHost(st.prev.data());
    st.prev_on_device = false;
  }
  const size_t n = w_master.numel();
  const size_t channels = w_master.ndim() > 0 ? size_t(w_master.dim(0)) : 1;
  const QuantizeOptions opts = OptionsFor(st, Site::kWeight, r, channels);
  QuantStats stats;
  QuantStats* sp = collect_ ? &stats : nullptr;
  // The previous weights continue into this step when they were quantised to the same format.
  const bool continues = st.prev.size() == n && st.prev_spec == f->spec();
  Status s;
  if (config_.hysteresis && continues) {
    std::memcpy(w_used->data(), st.prev.data(), n * sizeof(float));
    uint64_t flips = 0;
    s = QuantizeHysteresis(*f, w_master.data(), w_used->data(), n, opts, sp, &flips);
    st.flips += flips;
  } else {
    s = Quantize(*f, w_master.data(), w_used->data(), n, opts, sp);
    if (s.ok() && continues) {
      auto flips = CountFlips(st.prev.data(), w_used->data(), n);
      s = flips.status();
      if (flips.ok()) st.flips += *flips;
    }
  }
  if (!s.ok()) throw std::runtime_error(layer.name() + ".W: " + s.message());
  st.prev.assign(w_used->data(), w_used->data() + n);
  st.prev_spec = f->spec();
  if (collect_) records_.push_back({{layer.name(), Site::kWeight, f->spec(), stats}});
}

void SiteQuantizer::DropPrevious(LayerState& st) {
  if (st.prev_spec.empty() && st.prev.empty()) return;
  st.prev = {};
  st.prev_dev = Tensor();
  st.prev_on_device = false;
  st.prev_spec.clear();
}

void SiteQuantizer::QuantizeWeightCuda(const Layer& layer, LayerState& st, const Format& f,
                                       Rounding r, const Tensor& w_master, Tensor* w_used) {
#if CPD_WITH_CUDA
  if (w_used->device() != w_master.device()) {
    throw std::logic_error(layer.name() + ".W: master on " + DeviceName(w_master.device()) +
                           ", weights as used on " + DeviceName(w_used->device()));
  }
  const size_t n = w_master.numel();
  const size_t channels = w_master.ndim() > 0 ? size_t(w_master.dim(0)) : 1;
  const QuantizeOptions opts = OptionsFor(st, Site::kWeight, r, channels);
  if (!st.prev_on_device && st.prev.size() == n) {
    // State from a CPU run or a checkpoint: continue from it on the GPU.
    ResizeOn(&st.prev_dev, w_master.shape(), w_master.device());
    st.prev_dev.CopyFromHost(st.prev.data());
    st.prev_on_device = true;
  }
  const bool continues = st.prev_on_device && st.prev_dev.numel() == n && st.prev_spec == f.spec();
  // Statistics and flips stay on the device (slots of GpuStats()) until they are read.
  DeviceStatistics& dev = GpuStats();
  PendingRecord pending{{layer.name(), Site::kWeight, f.spec(), QuantStats{}}};
  CudaStatsTarget target;
  target.slots = dev.slots.get();
  if (collect_) target.stats = pending.slot = NextRecordSlot();
  target.flips = size_t(st.index);
  Status s;
  if (config_.hysteresis && continues) {
    // Q_{t-1} read from prev_dev; Q_t written to w_used and over prev_dev in the same pass.
    s = QuantizeHysteresisKeepCuda(f, w_master.data(), st.prev_dev.data(), w_used->data(), n, opts,
                                   target, cuda::Stream());
    dev.flips_queued = true;
  } else {
    s = QuantizeCuda(f, w_master.data(), w_used->data(), n, opts, target, cuda::Stream());
    if (s.ok() && continues) {
      // Counts against the previous weights and keeps the new ones in one pass.
      s = CountFlipsAndKeepCuda(st.prev_dev.data(), w_used->data(), n, target, cuda::Stream());
      dev.flips_queued = true;
    } else if (s.ok()) {
      ResizeOn(&st.prev_dev, w_master.shape(), w_master.device());
      st.prev_dev.CopyFrom(*w_used);
    }
  }
  if (!s.ok()) throw std::runtime_error(layer.name() + ".W: " + s.message());
  st.prev_on_device = true;
  st.prev_spec = f.spec();
  if (collect_) records_.push_back(std::move(pending));
#else
  (void)st;
  (void)f;
  (void)r;
  (void)w_used;
  throw std::logic_error(layer.name() + ".W: a " + DeviceName(w_master.device()) +
                         " tensor in a build without CUDA");
#endif
}

void SiteQuantizer::QuantizeActivation(const Layer& layer, const Tensor& x, Tensor* x_used) {
  Apply(layer, Site::kActivation, x, x_used, 1);
}

void SiteQuantizer::QuantizeError(const Layer& layer, const Tensor& dy, Tensor* dy_used) {
  Apply(layer, Site::kError, dy, dy_used, 1);
}

std::optional<HadamardOptions> SiteQuantizer::WeightGradTransform(const Layer& layer) const {
  if (config_.wgrad_transform.empty() || layers_.at(layer.name()).keep_fp32) return std::nullopt;
  HadamardOptions t = *ParseHadamard(config_.wgrad_transform);  // checked in Create
  t.seed = config_.seed;
  t.step = uint64_t(step_);
  return t;
}

const kernels::Accumulation* SiteQuantizer::ProductAccumulation(const Layer& layer) const {
  if (!accumulation_ || layers_.at(layer.name()).keep_fp32) return nullptr;
  return &*accumulation_;
}

void SiteQuantizer::QuantizeWeightGrad(const Layer& layer, Tensor* dw) {
  Apply(layer, Site::kWeightGrad, *dw, dw, dw->ndim() > 0 ? size_t(dw->dim(0)) : 1);
}

#if CPD_WITH_CUDA
SiteQuantizer::DeviceStatistics& SiteQuantizer::GpuStats() {
  if (device_ == nullptr) device_ = std::make_unique<DeviceStatistics>();
  DeviceStatistics& d = *device_;
  if (d.slots == nullptr) {
    d.layers = layers_.size();
    d.flips_read.assign(d.layers, 0);
    // The flips of every layer and, to start with, four records per layer (W, A, E, G).
    auto slots = CudaStatsSlots::Create(5 * d.layers + 4);
    if (!slots.ok()) {
      throw std::runtime_error("quantisation statistics on the GPU: " + slots.status().message());
    }
    d.slots = std::move(slots).value();
  }
  return d;
}

size_t SiteQuantizer::NextRecordSlot() {
  DeviceStatistics& d = GpuStats();
  const size_t slot = d.layers + d.records;
  if (slot >= d.slots->capacity()) {  // more sites than one pass of every layer: grow (waits)
    const Status s = d.slots->Reserve(2 * d.slots->capacity(), cuda::Stream());
    if (!s.ok()) throw std::runtime_error("quantisation statistics on the GPU: " + s.message());
  }
  ++d.records;
  return slot;
}

std::vector<uint64_t> SiteQuantizer::DeviceFlips() const {
  if (device_ == nullptr || device_->slots == nullptr) return std::vector<uint64_t>(layers_.size());
  DeviceStatistics& d = *device_;
  if (d.flips_queued) {
    auto read = d.slots->Read(0, d.layers, cuda::Stream());
    if (!read.ok()) {
      throw std::runtime_error("weight flips on the GPU: " + read.status().message());
    }
    for (size_t i = 0; i < d.layers; ++i) d.flips_read[i] = (*read)[i].flips;
    d.flips_queued = false;
  }
  return d.flips_read;
}
#else
SiteQuantizer::DeviceStatistics& SiteQuantizer::GpuStats() {
  throw std::logic_error("GPU statistics in a build without CUDA");
}
size_t SiteQuantizer::NextRecordSlot() {
  throw std::logic_error("GPU statistics in a build without CUDA");
}
std::vector<uint64_t> SiteQuantizer::DeviceFlips() const {
  return std::vector<uint64_t>(layers_.size());
}
#endif

std::vector<SiteRecord> SiteQuantizer::TakeRecords() {
  std::vector<SiteRecord> out;
  out.reserve(records_.size());
#if CPD_WITH_CUDA
  if (device_ != nullptr && device_->records > 0) {
    // Every record of the device in one copy; the flips come along when some are pending, so
    // that a report's Flips() needs no second wait.
    DeviceStatistics& d = *device_;
    const size_t first = d.flips_queued ? 0 : d.layers;
    auto read = d.slots->Read(first, d.layers + d.records - first, cuda::Stream());
    if (!read.ok()) {
      throw std::runtime_error("quantisation statistics on the GPU: " + read.status().message());
    }
    if (first == 0) {
      for (size_t i = 0; i < d.layers; ++i) d.flips_read[i] = (*read)[i].flips;
      d.flips_queued = false;
    }
    for (PendingRecord& p : records_) {
      if (p.slot != PendingRecord::kHostSlot) p.record.stats = (*read)[p.slot - first].stats;
    }
    const Status s = d.slots->Clear(d.layers, d.records, cuda::Stream());
    if (!s.ok()) throw std::runtime_error("quantisation statistics on the GPU: " + s.message());
    d.records = 0;
  }
#endif
  for (PendingRecord& p : records_) out.push_back(std::move(p.record));
  records_.clear();
  return out;
}

std::map<std::string, uint64_t> SiteQuantizer::TakeFlips() {
  std::map<std::string, uint64_t> out = Flips();
  for (auto& [name, st] : layers_) st.flips = 0;
#if CPD_WITH_CUDA
  if (device_ != nullptr && device_->slots != nullptr) {
    DeviceStatistics& d = *device_;
    const Status s = d.slots->Clear(0, d.layers, cuda::Stream());
    if (!s.ok()) throw std::runtime_error("weight flips on the GPU: " + s.message());
    d.flips_read.assign(d.layers, 0);
  }
#endif
  return out;
}

std::map<std::string, uint64_t> SiteQuantizer::Flips() const {
  const std::vector<uint64_t> device = DeviceFlips();
  std::map<std::string, uint64_t> out;
  for (const auto& [name, st] : layers_) out[name] = st.flips + device[size_t(st.index)];
  return out;
}

std::map<std::string, const std::vector<float>*> SiteQuantizer::HysteresisState() const {
  std::map<std::string, const std::vector<float>*> out;
  for (const auto& [name, st] : layers_) {
    if (st.prev_on_device) {  // copy the GPU's newest state back (it stays the newest there)
      st.prev.resize(st.prev_dev.numel());
      st.prev_dev.CopyToHost(st.prev.data());
    }
    if (!st.prev.empty()) out[name] = &st.prev;
  }
  return out;
}

void SiteQuantizer::RestoreHysteresisState(const std::string& layer, std::vector<float> q) {
  auto it = layers_.find(layer);
  if (it == layers_.end()) return;
  it->second.prev = std::move(q);
  it->second.prev_on_device = false;  // the restored state replaces whatever the GPU held
  Rounding r = Rounding::kNearest;
  const Format* f = FormatFor(layer, Site::kWeight, &r);
  it->second.prev_spec = f != nullptr ? f->spec() : "";
}

}  // namespace cpd::runtime
