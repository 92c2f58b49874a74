#include "launcher/cpdctl/output.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <functional>
#include <limits>
#include <map>

#include "launcher/common.h"

namespace cpd::ctl {

using cpd::v1::LayerStat;
using cpd::v1::PrecisionSchedule;
using cpd::v1::Site;
using google::protobuf::FieldDescriptor;

void Table::AddRow(std::vector<std::string> cells) {
  cells.resize(columns_.size());
  rows_.push_back(std::move(cells));
}

std::string Table::Render(long max_rows) const {
  const size_t n = (max_rows < 0) ? rows_.size() : std::min(rows_.size(), size_t(max_rows));
  std::vector<size_t> width(columns_.size());
  for (size_t c = 0; c < columns_.size(); ++c) width[c] = columns_[c].header.size();
  for (size_t r = 0; r < n; ++r) {
    for (size_t c = 0; c < columns_.size(); ++c) width[c] = std::max(width[c], rows_[r][c].size());
  }
  std::string out;
  auto line = [&](auto cell_of) {
    std::string l;
    for (size_t c = 0; c < columns_.size(); ++c) {
      const std::string& cell = cell_of(c);
      const size_t pad = width[c] - cell.size();
      if (c > 0) l += "  ";
      if (columns_[c].align == Align::kRight) {
        l.append(pad, ' ');
        l += cell;
      } else {
        l += cell;
        l.append(pad, ' ');
      }
    }
    while (!l.empty() && l.back() == ' ') l.pop_back();
    out += l;
    out += '\n';
  };
  line([&](size_t c) -> const std::string& { return columns_[c].header; });
  for (size_t r = 0; r < n; ++r) line([&](size_t c) -> const std::string& { return rows_[r][c]; });
  return out;
}

std::string FormatG(double v, int digits) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*g", digits, v);
  return buf;
}

std::string FormatPercent(double fraction) {
  if (fraction == 0) return "0%";
  return FormatG(100.0 * fraction, 3) + "%";
}

std::string FormatAccuracy(double fraction) {
  if (!(fraction >= 0)) return "-";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f%%", 100.0 * fraction);
  return buf;
}

bool Measured(double v) { return !(v <= 0); }

std::string FormatMeasured(double v, int decimals) {
  if (!Measured(v)) return "-";
  if (std::isnan(v) || std::isinf(v)) return FormatG(v);
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, v);
  return buf;
}

std::string ValidationSummary(double perplexity, double bits_per_byte, double loss) {
  std::string details;
  if (Measured(bits_per_byte)) details += ", " + FormatMeasured(bits_per_byte, 3) + " bits/byte";
  if (Measured(loss)) details += ", loss " + FormatMeasured(loss, 4);
  if (!details.empty()) details = ";" + details.substr(1);
  return FormatMeasured(perplexity, 2) + " (validation" + details + ")";
}

std::string FormatDuration(int64_t ms) {
  char buf[64];
  if (ms < 0) return "-";
  if (ms < 1000) {
    std::snprintf(buf, sizeof(buf), "%lld ms", static_cast<long long>(ms));
  } else if (ms < 60'000) {
    std::snprintf(buf, sizeof(buf), "%.1f s", double(ms) / 1e3);
  } else if (ms < 3'600'000) {
    std::snprintf(buf, sizeof(buf), "%lld min %02lld s", static_cast<long long>(ms / 60'000),
                  static_cast<long long>(ms / 1000 % 60));
  } else if (ms < 86'400'000) {
    std::snprintf(buf, sizeof(buf), "%lld h %02lld min", static_cast<long long>(ms / 3'600'000),
                  static_cast<long long>(ms / 60'000 % 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%lld d %lld h", static_cast<long long>(ms / 86'400'000),
                  static_cast<long long>(ms / 3'600'000 % 24));
  }
  return buf;
}

std::string FormatTime(int64_t unix_ms) {
  if (unix_ms <= 0) return "-";
  const std::time_t t = static_cast<std::time_t>(unix_ms / 1000);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

std::string ShortestDouble(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, r.ptr);
}

std::string SiteName(Site site) {
  switch (site) {
    case cpd::v1::SITE_W:
      return "W";
    case cpd::v1::SITE_A:
      return "A";
    case cpd::v1::SITE_E:
      return "E";
    case cpd::v1::SITE_G:
      return "G";
    case cpd::v1::SITE_COMM:
      return "COMM";
    default:
      return "?";
  }
}

std::optional<Site> ParseSite(std::string_view name) {
  std::string up(name);
  for (char& c : up) c = char(std::toupper(static_cast<unsigned char>(c)));
  if (up == "W") return cpd::v1::SITE_W;
  if (up == "A") return cpd::v1::SITE_A;
  if (up == "E") return cpd::v1::SITE_E;
  if (up == "G") return cpd::v1::SITE_G;
  if (up == "COMM") return cpd::v1::SITE_COMM;
  return std::nullopt;
}

namespace {

nlohmann::json FieldValue(const google::protobuf::Message& m, const FieldDescriptor* f, int index) {
  const auto* r = m.GetReflection();
  const bool rep = f->is_repeated();
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return rep ? r->GetRepeatedInt32(m, f, index) : r->GetInt32(m, f);
    case FieldDescriptor::CPPTYPE_INT64:
      return rep ? r->GetRepeatedInt64(m, f, index) : r->GetInt64(m, f);
    case FieldDescriptor::CPPTYPE_UINT32:
      return rep ? r->GetRepeatedUInt32(m, f, index) : r->GetUInt32(m, f);
    case FieldDescriptor::CPPTYPE_UINT64:
      return rep ? r->GetRepeatedUInt64(m, f, index) : r->GetUInt64(m, f);
    case FieldDescriptor::CPPTYPE_DOUBLE: {
      const double v = rep ? r->GetRepeatedDouble(m, f, index) : r->GetDouble(m, f);
      // JSON has no NaN/Inf: write them as proto3's JSON mapping does, as strings.
      if (std::isfinite(v)) return v;
      return ShortestDouble(v);
    }
    case FieldDescriptor::CPPTYPE_FLOAT: {
      const double v = rep ? r->GetRepeatedFloat(m, f, index) : r->GetFloat(m, f);
      if (std::isfinite(v)) return v;
      return ShortestDouble(v);
    }
    case FieldDescriptor::CPPTYPE_BOOL:
      return rep ? r->GetRepeatedBool(m, f, index) : r->GetBool(m, f);
    case FieldDescriptor::CPPTYPE_ENUM: {
      const auto* e = rep ? r->GetRepeatedEnum(m, f, index) : r->GetEnum(m, f);
      return e->name();
    }
    case FieldDescriptor::CPPTYPE_STRING:
      return rep ? r->GetRepeatedString(m, f, index) : r->GetString(m, f);
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return ToJson(rep ? r->GetRepeatedMessage(m, f, index) : r->GetMessage(m, f));
  }
  return nullptr;
}

}  // namespace

nlohmann::json ToJson(const google::protobuf::Message& message) {
  nlohmann::json out = nlohmann::json::object();
  const auto* d = message.GetDescriptor();
  const auto* r = message.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    if (f->is_repeated()) {
      nlohmann::json arr = nlohmann::json::array();
      for (int k = 0; k < r->FieldSize(message, f); ++k) arr.push_back(FieldValue(message, f, k));
      out[f->name()] = std::move(arr);
    } else {
      out[f->name()] = FieldValue(message, f, 0);
    }
  }
  return out;
}

std::string ScheduleSummary(const PrecisionSchedule& s) {
  std::vector<std::string> parts;
  if (s.has_cyclic()) {
    parts.push_back("CPT " + std::to_string(s.cyclic().min_bits()) + "-" +
                    std::to_string(s.cyclic().max_bits()) + " bits x" +
                    std::to_string(s.cyclic().periods()) + ", E " +
                    std::to_string(s.grad_bits() > 0 ? s.grad_bits() : 8) + " bits");
  }
  std::string formats;
  for (const auto& f : s.formats()) {
    if (!formats.empty()) formats += ' ';
    formats += SiteName(f.site()) + "=" + f.spec();
    if (!f.rounding().empty() && f.rounding() != "nearest") formats += "/" + f.rounding();
  }
  if (!formats.empty()) parts.push_back(formats);
  if (parts.empty()) parts.push_back("fp32");
  if (s.overrides_size() > 0) {
    parts.push_back(std::to_string(s.overrides_size()) +
                    (s.overrides_size() == 1 ? " override" : " overrides"));
  }
  if (s.keep_fp32_size() > 0) {
    std::string keep = "fp32: ";
    for (int i = 0; i < s.keep_fp32_size(); ++i) keep += (i ? "," : "") + s.keep_fp32(i);
    parts.push_back(keep);
  }
  if (s.hysteresis()) parts.push_back("hysteresis");
  if (s.allreduce_layers_size() > 0) {
    std::string layers = "all-reduce: ";
    for (int i = 0; i < s.allreduce_layers_size(); ++i) {
      layers += (i ? "," : "") + s.allreduce_layers(i).layer() + "=" + s.allreduce_layers(i).spec();
    }
    parts.push_back(layers);
  }
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? "; " : "") + parts[i];
  return out;
}

std::string ScheduleDetails(const PrecisionSchedule& s) {
  std::vector<std::pair<std::string, std::string>> kv;
  kv.emplace_back("version", std::to_string(s.version()));
  kv.emplace_back("effective from", "step " + std::to_string(s.effective_from_step()));
  kv.emplace_back("set", (s.set_by().empty() ? std::string("-") : s.set_by()) + " at " +
                             FormatTime(s.set_at_ms()));
  if (s.has_cyclic()) {
    kv.emplace_back("cyclic", std::to_string(s.cyclic().min_bits()) + "-" +
                                  std::to_string(s.cyclic().max_bits()) + " bits, " +
                                  std::to_string(s.cyclic().periods()) + " periods (W, A)");
  } else {
    kv.emplace_back("cyclic", "off");
  }
  kv.emplace_back("grad bits", s.grad_bits() > 0 ? std::to_string(s.grad_bits()) : "default (8)");
  for (Site site : {cpd::v1::SITE_W, cpd::v1::SITE_A, cpd::v1::SITE_E, cpd::v1::SITE_G}) {
    std::string v = "fp32";
    for (const auto& f : s.formats()) {
      if (f.site() != site) continue;
      v = f.spec() + " (" + (f.rounding().empty() ? std::string("nearest") : f.rounding()) + ")";
    }
    kv.emplace_back("format " + SiteName(site), v);
  }
  for (const auto& o : s.overrides()) {
    kv.emplace_back("override", o.layer() + "." + SiteName(o.site()) + "=" + o.spec());
  }
  std::string keep;
  for (int i = 0; i < s.keep_fp32_size(); ++i) keep += (i ? "," : "") + s.keep_fp32(i);
  kv.emplace_back("keep fp32", keep.empty() ? "-" : keep);
  kv.emplace_back("hysteresis", s.hysteresis() ? "on" : "off");
  for (const auto& a : s.allreduce_layers()) {
    kv.emplace_back("all-reduce layer", a.layer() + "=" + a.spec());
  }
  return KeyValues(kv);
}

std::string KeyValues(const std::vector<std::pair<std::string, std::string>>& kv) {
  size_t w = 0;
  for (const auto& [k, v] : kv) w = std::max(w, k.size());
  std::string out;
  for (const auto& [k, v] : kv) out += k + std::string(w - k.size() + 2, ' ') + v + "\n";
  return out;
}

std::vector<StudyTally> TallyStudies(const cpd::v1::ListJobsResponse& jobs) {
  std::map<std::string, StudyTally> by_name;
  for (const auto& j : jobs.jobs()) {
    if (j.study().empty()) continue;
    StudyTally& t = by_name[j.study()];
    t.study = j.study();
    ++t.runs;
    if (j.state() == "running") ++t.running;
    if (j.state() == "stale") ++t.stale;
    if (j.state() == "finished") ++t.finished;
  }
  std::vector<StudyTally> out;
  for (auto& [name, t] : by_name) out.push_back(std::move(t));
  return out;
}

const std::vector<std::string>& LayerSortKeys() {
  static const std::vector<std::string> keys = {"layer",   "site",  "max",  "saturated",
                                                "flushed", "error", "shift"};
  return keys;
}

namespace {

int SiteRank(Site s) {
  switch (s) {
    case cpd::v1::SITE_W:
      return 0;
    case cpd::v1::SITE_A:
      return 1;
    case cpd::v1::SITE_E:
      return 2;
    case cpd::v1::SITE_G:
      return 3;
    case cpd::v1::SITE_COMM:
      return 4;
    default:
      return 5;
  }
}

// Larger first; NaN last.
double Descending(double v) { return std::isnan(v) ? std::numeric_limits<double>::infinity() : -v; }

}  // namespace

Status SortLayerRows(std::vector<LayerRow>* rows, std::string_view key) {
  using Key = std::pair<std::string, double>;  // (text, number) compared lexicographically
  std::function<Key(const LayerRow&)> key_of;
  if (key == "layer") {
    key_of = [](const LayerRow& r) { return Key{r.stat->layer(), SiteRank(r.stat->site())}; };
  } else if (key == "site") {
    key_of = [](const LayerRow& r) { return Key{"", SiteRank(r.stat->site())}; };
  } else if (key == "max") {
    key_of = [](const LayerRow& r) { return Key{"", Descending(r.stat->max_abs())}; };
  } else if (key == "saturated") {
    key_of = [](const LayerRow& r) { return Key{"", Descending(r.stat->saturated())}; };
  } else if (key == "flushed") {
    key_of = [](const LayerRow& r) { return Key{"", Descending(r.stat->flushed())}; };
  } else if (key == "error") {
    // Unmeasured (< 0) after every measured error.
    key_of = [](const LayerRow& r) {
      const double e = r.stat->rel_error();
      return Key{"", e < 0 ? std::numeric_limits<double>::infinity() : Descending(e)};
    };
  } else if (key == "shift") {
    // Rows without a shift (all but COMM) after those with one.
    key_of = [](const LayerRow& r) {
      return Key{"", r.stat->site() == cpd::v1::SITE_COMM
                         ? Descending(r.stat->aps_shift())
                         : std::numeric_limits<double>::infinity()};
    };
  } else {
    std::string accepted;
    for (const auto& k : LayerSortKeys()) accepted += (accepted.empty() ? "" : ", ") + k;
    return Status::InvalidArgument("--sort " + cpd::launcher::QuoteForMessage(key) +
                                   " (accepted: " + accepted + ")");
  }
  std::stable_sort(rows->begin(), rows->end(), [&](const LayerRow& a, const LayerRow& b) {
    if (a.report->step() != b.report->step()) return a.report->step() < b.report->step();
    const Key ka = key_of(a), kb = key_of(b);
    if (ka != kb) return ka < kb;
    return a.order < b.order;
  });
  return Status::Ok();
}

Table LayerTable(const std::vector<LayerRow>& rows, bool with_step) {
  using A = Table::Align;
  std::vector<Table::Column> cols;
  if (with_step) cols.push_back({"STEP", A::kRight});
  for (Table::Column c : std::initializer_list<Table::Column>{{"LAYER", A::kLeft},
                                                              {"SITE", A::kLeft},
                                                              {"FORMAT", A::kLeft},
                                                              {"BITS", A::kRight},
                                                              {"SHIFT", A::kRight},
                                                              {"MAX|X|", A::kRight},
                                                              {"SATURATED", A::kRight},
                                                              {"FLUSHED", A::kRight},
                                                              {"REL.ERR", A::kRight},
                                                              {"FLIPS", A::kRight},
                                                              {"NONFINITE", A::kRight}}) {
    cols.push_back(std::move(c));
  }
  Table t(std::move(cols));
  for (const LayerRow& r : rows) {
    const LayerStat& s = *r.stat;
    std::vector<std::string> cells;
    if (with_step) cells.push_back(std::to_string(r.report->step()));
    cells.push_back(s.layer());
    cells.push_back(SiteName(s.site()));
    cells.push_back(s.format().empty() ? "-" : s.format());
    cells.push_back(s.bits() > 0 ? std::to_string(s.bits()) : "-");
    cells.push_back(s.site() == cpd::v1::SITE_COMM ? std::to_string(s.aps_shift()) : "-");
    cells.push_back(FormatG(s.max_abs()));
    cells.push_back(FormatPercent(s.saturated()));
    cells.push_back(FormatPercent(s.flushed()));
    cells.push_back(s.rel_error() < 0 ? "-" : FormatG(s.rel_error()));
    cells.push_back(s.site() == cpd::v1::SITE_W ? std::to_string(s.flips()) : "-");
    cells.push_back(std::to_string(s.nonfinite()));
    t.AddRow(std::move(cells));
  }
  return t;
}

}  // namespace cpd::ctl
