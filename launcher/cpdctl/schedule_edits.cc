#include "launcher/cpdctl/schedule_edits.h"

#include <algorithm>

#include "cpd/format.h"
#include "cpd/quantize.h"
#include "launcher/common.h"
#include "launcher/cpdctl/output.h"

namespace cpd::ctl {

using cpd::v1::LayerInfo;
using cpd::v1::PrecisionSchedule;
using cpd::v1::Site;

namespace {

constexpr const char* kSites = "W, A, E, G";

using cpd::launcher::QuoteForMessage;

// A format spec, parsed. Format::Parse's message holds the spec whole: one that QuoteForMessage
// would shorten or escape (longer than the coordinator's 256-byte limit, bytes outside
// printable ASCII) is refused here, quoted.
Result<cpd::Format> ParseSpec(const std::string& flag, const std::string& spec) {
  constexpr size_t kMaxSpec = 256;
  const bool printable = std::all_of(spec.begin(), spec.end(), [](char c) {
    return static_cast<unsigned char>(c) >= 0x20 && static_cast<unsigned char>(c) < 0x7f;
  });
  if (spec.size() > kMaxSpec || !printable) {
    return Status::InvalidArgument(
        flag + ": " + QuoteForMessage(spec) +
        " is not a format spec (at most 256 printable ASCII characters, "
        "e.g. e4m3, int8:ch, fp134:room=2; cpd-quant --list shows them)");
  }
  auto f = cpd::Format::Parse(spec);
  if (!f.ok()) return Status::InvalidArgument(flag + ": " + f.status().message());
  return f;
}

// "W" .. "G" (COMM carries statistics only and has no format).
std::optional<Site> ParseFormatSite(std::string_view s) {
  auto site = ParseSite(s);
  if (!site || *site == cpd::v1::SITE_COMM) return std::nullopt;
  return site;
}

struct FormatEdit {
  std::string layer;  // empty: the site's global format
  Site site = cpd::v1::SITE_UNSPECIFIED;
  std::string spec;  // canonical spelling
};

Result<FormatEdit> ParseFormatEdit(const std::string& arg) {
  const std::string flag = "--format " + QuoteForMessage(arg);
  const size_t eq = arg.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == arg.size()) {
    return Status::InvalidArgument(flag + ": expected SITE=SPEC or LAYER.SITE=SPEC (SITE one of " +
                                   kSites + ")");
  }
  const std::string lhs = arg.substr(0, eq), spec = arg.substr(eq + 1);
  FormatEdit e;
  if (auto site = ParseFormatSite(lhs)) {
    e.site = *site;
  } else {
    const size_t dot = lhs.rfind('.');
    if (dot == std::string::npos) {
      return Status::InvalidArgument(flag + ": " + QuoteForMessage(lhs) +
                                     " is not a site (accepted: " + kSites + ", or LAYER.SITE)");
    }
    auto site2 = ParseFormatSite(lhs.substr(dot + 1));
    if (!site2) {
      return Status::InvalidArgument(flag + ": site " + QuoteForMessage(lhs.substr(dot + 1)) +
                                     " (accepted: " + kSites + ")");
    }
    if (dot == 0) return Status::InvalidArgument(flag + ": the layer name is empty");
    e.layer = lhs.substr(0, dot);
    e.site = *site2;
  }
  CPD_ASSIGN_OR_RETURN(const cpd::Format f, ParseSpec(flag, spec));
  e.spec = f.spec();
  return e;
}

Result<std::pair<Site, std::string>> ParseRoundingEdit(const std::string& arg) {
  const std::string flag = "--rounding " + QuoteForMessage(arg);
  const size_t eq = arg.find('=');
  if (eq == std::string::npos) {
    return Status::InvalidArgument(flag + ": expected SITE=MODE (SITE one of " + kSites +
                                   "; MODE nearest, stochastic or zero)");
  }
  auto site = ParseFormatSite(arg.substr(0, eq));
  if (!site) {
    return Status::InvalidArgument(flag + ": site " + QuoteForMessage(arg.substr(0, eq)) +
                                   " (accepted: " + kSites + ")");
  }
  auto mode = cpd::ParseRounding(arg.substr(eq + 1));
  if (!mode.ok()) {
    return Status::InvalidArgument(flag + ": " + QuoteForMessage(arg.substr(eq + 1)) +
                                   " is not a rounding (accepted: nearest, stochastic, zero)");
  }
  return std::pair<Site, std::string>{*site, cpd::RoundingName(*mode)};
}

Result<std::pair<std::string, Site>> ParseLayerSite(const std::string& flag,
                                                    const std::string& arg) {
  const size_t dot = arg.rfind('.');
  std::optional<Site> site;
  if (dot != std::string::npos && dot > 0) site = ParseFormatSite(arg.substr(dot + 1));
  if (!site) {
    return Status::InvalidArgument(flag + " " + QuoteForMessage(arg) +
                                   ": expected LAYER.SITE (SITE one of " + kSites + ")");
  }
  return std::pair<std::string, Site>{arg.substr(0, dot), *site};
}

std::vector<std::string> KeepList(const std::string& arg) {
  if (arg == "none") return {};
  return cpd::launcher::SplitCommas(arg);
}

Status CheckBits(const std::string& flag, int v, int lo, int hi) {
  if (v < lo || v > hi) {
    return Status::InvalidArgument(flag + " " + std::to_string(v) + ": expected " +
                                   std::to_string(lo) + ".." + std::to_string(hi));
  }
  return Status::Ok();
}

// The job's layer `name`, or an error naming it and listing the job's layers (the first
// kListed of them: a job may have thousands).
Status CheckLayer(const std::string& flag,
                  const google::protobuf::RepeatedPtrField<LayerInfo>* layers,
                  const std::string& name, bool need_quantizable) {
  if (layers == nullptr || layers->empty()) return Status::Ok();
  constexpr int kListed = 20;
  std::string names;
  int candidates = 0;
  for (const LayerInfo& l : *layers) {
    if (l.name() == name) {
      if (need_quantizable && !l.quantizable()) {
        return Status::InvalidArgument(flag + ": layer " + QuoteForMessage(name) + " (" + l.kind() +
                                       ") has no quantisation sites");
      }
      return Status::Ok();
    }
    if (need_quantizable && !l.quantizable()) continue;
    if (candidates++ < kListed) names += (names.empty() ? "" : ", ") + l.name();
  }
  if (candidates > kListed) names += ", ... (" + std::to_string(candidates) + " in all)";
  return Status::InvalidArgument(flag + ": the job has no layer " + QuoteForMessage(name) +
                                 " (layers: " + names + ")");
}

// --allreduce-layer-format: "none" (empty name), or NAME=SPEC with SPEC a format or "default".
Result<std::pair<std::string, std::string>> ParseAllReduceLayerEdit(const std::string& arg) {
  if (arg == "none") return std::pair<std::string, std::string>{};
  const size_t eq = arg.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 >= arg.size()) {
    return Status::InvalidArgument("--allreduce-layer-format " + QuoteForMessage(arg) +
                                   ": expected NAME=SPEC (NAME a layer, first, last or bn; SPEC "
                                   "a format, fp32 or default) or none");
  }
  std::string spec = arg.substr(eq + 1);
  if (spec != "default") {
    CPD_ASSIGN_OR_RETURN(const cpd::Format f,
                         ParseSpec("--allreduce-layer-format " + QuoteForMessage(arg), spec));
    spec = f.spec();
  }
  return std::pair<std::string, std::string>{arg.substr(0, eq), spec};
}

}  // namespace

Status ValidateScheduleEdits(const ScheduleEdits& e) {
  if (e.make_static && (e.cyclic_bits || e.cyclic_periods || e.grad_bits)) {
    return Status::InvalidArgument(
        "--static drops CPT; it excludes --cyclic-bits, --cyclic-periods and --grad-bits");
  }
  if (e.cyclic_bits) {
    const auto [lo, hi] = *e.cyclic_bits;
    CPD_RETURN_IF_ERROR(CheckBits("--cyclic-bits MIN", lo, 2, 16));
    if (hi < lo || hi > 16) {
      return Status::InvalidArgument("--cyclic-bits " + std::to_string(lo) + " " +
                                     std::to_string(hi) + ": expected MIN <= MAX <= 16");
    }
  }
  if (e.cyclic_periods && *e.cyclic_periods < 1) {
    return Status::InvalidArgument("--cyclic-periods " + std::to_string(*e.cyclic_periods) +
                                   ": expected >= 1");
  }
  if (e.grad_bits) CPD_RETURN_IF_ERROR(CheckBits("--grad-bits", *e.grad_bits, 2, 16));
  for (const auto& f : e.formats) CPD_RETURN_IF_ERROR(ParseFormatEdit(f).status());
  for (const auto& r : e.roundings) CPD_RETURN_IF_ERROR(ParseRoundingEdit(r).status());
  for (const auto& d : e.drop_overrides) {
    CPD_RETURN_IF_ERROR(ParseLayerSite("--drop-override", d).status());
  }
  if (e.hysteresis && *e.hysteresis != "on" && *e.hysteresis != "off") {
    return Status::InvalidArgument("--hysteresis " + QuoteForMessage(*e.hysteresis) +
                                   " (accepted: on, off)");
  }
  for (const auto& a : e.allreduce_layers) {
    CPD_RETURN_IF_ERROR(ParseAllReduceLayerEdit(a).status());
  }
  if (e.from_step && *e.from_step < 0) {
    return Status::InvalidArgument("--from-step " + std::to_string(*e.from_step) +
                                   ": expected a step >= 0");
  }
  if (e.empty()) {
    return Status::InvalidArgument(
        "schedule set: nothing to change (give --cyclic-bits, --cyclic-periods, --grad-bits, "
        "--static, --format, --rounding, --drop-override, --keep-fp32, --hysteresis or "
        "--allreduce-layer-format)");
  }
  return Status::Ok();
}

Status ApplyScheduleEdits(const ScheduleEdits& e,
                          const google::protobuf::RepeatedPtrField<LayerInfo>* layers,
                          PrecisionSchedule* s) {
  CPD_RETURN_IF_ERROR(ValidateScheduleEdits(e));
  if (e.make_static) {
    s->clear_cyclic();
    s->set_grad_bits(0);
  }
  if (e.cyclic_bits) {
    const int periods = s->has_cyclic() ? s->cyclic().periods() : 32;
    s->mutable_cyclic()->set_min_bits(e.cyclic_bits->first);
    s->mutable_cyclic()->set_max_bits(e.cyclic_bits->second);
    s->mutable_cyclic()->set_periods(periods);
  }
  if (e.cyclic_periods) {
    if (!s->has_cyclic()) {
      return Status::InvalidArgument("--cyclic-periods " + std::to_string(*e.cyclic_periods) +
                                     ": the schedule has no CPT; give --cyclic-bits MIN MAX too");
    }
    s->mutable_cyclic()->set_periods(*e.cyclic_periods);
  }
  if (e.grad_bits) s->set_grad_bits(*e.grad_bits);

  for (const auto& arg : e.formats) {
    CPD_ASSIGN_OR_RETURN(const FormatEdit f, ParseFormatEdit(arg));
    if (f.layer.empty()) {
      auto* formats = s->mutable_formats();
      auto it = std::find_if(formats->begin(), formats->end(),
                             [&](const cpd::v1::SiteFormat& x) { return x.site() == f.site; });
      cpd::v1::SiteFormat* target = it != formats->end() ? &*it : s->add_formats();
      target->set_site(f.site);
      target->set_spec(f.spec);
    } else {
      CPD_RETURN_IF_ERROR(CheckLayer("--format " + QuoteForMessage(arg), layers, f.layer, true));
      auto* ov = s->mutable_overrides();
      auto it = std::find_if(ov->begin(), ov->end(), [&](const cpd::v1::LayerOverride& x) {
        return x.layer() == f.layer && x.site() == f.site;
      });
      cpd::v1::LayerOverride* target = it != ov->end() ? &*it : s->add_overrides();
      target->set_layer(f.layer);
      target->set_site(f.site);
      target->set_spec(f.spec);
    }
  }
  for (const auto& arg : e.roundings) {
    CPD_ASSIGN_OR_RETURN(const auto rounding, ParseRoundingEdit(arg));
    // Named copies, not a structured binding: clang before 16 cannot capture one in a lambda.
    const auto site = rounding.first;
    const auto mode = rounding.second;
    auto* formats = s->mutable_formats();
    auto it = std::find_if(formats->begin(), formats->end(),
                           [&](const cpd::v1::SiteFormat& x) { return x.site() == site; });
    if (it == formats->end()) {
      return Status::InvalidArgument("--rounding " + QuoteForMessage(arg) + ": site " +
                                     SiteName(site) +
                                     " has no format in the schedule (it is fp32); give --format " +
                                     SiteName(site) + "=SPEC too");
    }
    it->set_rounding(mode);
  }
  for (const auto& arg : e.drop_overrides) {
    CPD_ASSIGN_OR_RETURN(const auto layer_site, ParseLayerSite("--drop-override", arg));
    const auto& layer = layer_site.first;
    const auto site = layer_site.second;
    auto* ov = s->mutable_overrides();
    auto it = std::find_if(ov->begin(), ov->end(), [&](const cpd::v1::LayerOverride& x) {
      return x.layer() == layer && x.site() == site;
    });
    if (it == ov->end()) {
      return Status::InvalidArgument("--drop-override " + QuoteForMessage(arg) +
                                     ": the schedule has no such override");
    }
    ov->erase(it);
  }
  if (e.keep_fp32) {
    const auto keep = KeepList(*e.keep_fp32);
    for (const auto& name : keep) {
      if (name == "first" || name == "last") continue;
      CPD_RETURN_IF_ERROR(
          CheckLayer("--keep-fp32 " + QuoteForMessage(*e.keep_fp32), layers, name, false));
    }
    s->clear_keep_fp32();
    for (const auto& name : keep) s->add_keep_fp32(name);
  }
  for (const auto& arg : e.allreduce_layers) {
    CPD_ASSIGN_OR_RETURN(const auto edit, ParseAllReduceLayerEdit(arg));
    if (edit.first.empty()) {
      s->clear_allreduce_layers();
      continue;
    }
    const std::string name = edit.first;
    if (name != "first" && name != "last" && name != "bn") {
      CPD_RETURN_IF_ERROR(
          CheckLayer("--allreduce-layer-format " + QuoteForMessage(arg), layers, name, false));
    }
    auto* al = s->mutable_allreduce_layers();
    auto it = std::find_if(al->begin(), al->end(), [&](const cpd::v1::AllReduceLayerFormat& x) {
      return x.layer() == name;
    });
    if (edit.second == "default") {
      if (it != al->end()) al->erase(it);
      continue;
    }
    cpd::v1::AllReduceLayerFormat* target = it != al->end() ? &*it : s->add_allreduce_layers();
    target->set_layer(name);
    target->set_spec(edit.second);
  }
  if (e.hysteresis) s->set_hysteresis(*e.hysteresis == "on");
  s->set_effective_from_step(e.from_step.value_or(0));
  s->set_version(0);
  s->set_set_at_ms(0);
  s->clear_set_by();
  return Status::Ok();
}

}  // namespace cpd::ctl
