#include "launcher/study/report.h"

#include <fnmatch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>

#include "launcher/common.h"
#include "launcher/files.h"
#include "launcher/study/run_state.h"

namespace cpd::launcher::study {

namespace {

using nlohmann::json;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct EpochRow {
  int64_t step = 0;
  double loss = kNaN, train_accuracy = kNaN, test_accuracy = kNaN, test_loss = kNaN;
  double images_per_s = kNaN, relative_cost = kNaN;
  double test_perplexity = kNaN, test_bits_per_byte = kNaN;  // language models
  int64_t skipped_steps = 0;
  std::string cost_reference;
};

struct LayerSums {
  double flushed = 0, shift = 0;
  int64_t n = 0;
};

// What one run's metrics say.
struct RunMetrics {
  std::map<int, EpochRow> epochs;
  int classes = 0;              // from a "run" record; 0 when there is none
  bool language_model = false;  // its "run" record has a block_size
  bool stopped = false;
  int64_t last_comm_step = -1;  // steps up to here are counted (a resumed run repeats steps)
  LayerSums all;
  std::vector<std::string> layer_order;
  std::map<std::string, LayerSums> layers;
  int64_t malformed = 0;
};

// A number, or NaN for null (nlohmann writes NaN and Inf as null) or a missing key.
double Num(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : kNaN;
}

void AddComm(const json& comm, RunMetrics* m) {
  for (const json& c : comm) {
    const std::string layer = c.value("layer", std::string("?"));
    const double flushed = Num(c, "flushed"), shift = Num(c, "shift");
    auto [it, added] = m->layers.try_emplace(layer);
    if (added) m->layer_order.push_back(layer);
    // A layer whose gradient is all zero at this step has nothing to flush and no shift (the
    // reducer reports 0 for both); counting it as "0 % flushed" would hide that every nonzero
    // value of the other steps was flushed.
    if (Num(c, "max_abs") == 0) continue;
    for (LayerSums* s : {&it->second, &m->all}) {
      s->flushed += std::isfinite(flushed) ? flushed : 0;
      s->shift += std::isfinite(shift) ? shift : 0;
      ++s->n;
    }
  }
}

// A step's all-reduce statistics, unless it repeats a step already counted (a resumed run logs
// the steps after its checkpoint again).
void AddStepComm(int64_t step, const json& comm, RunMetrics* m) {
  if (step <= m->last_comm_step) return;
  m->last_comm_step = step;
  AddComm(comm, m);
}

// The end of the JSON array that starts at line[begin] ('['): strings may hold brackets.
size_t ArrayEnd(const std::string& line, size_t begin) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = begin; i < line.size(); ++i) {
    const char c = line[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      ++depth;
    } else if (c == ']' || c == '}') {
      if (--depth == 0) return i;
    }
  }
  return std::string::npos;
}

// A "step" record: only its all-reduce statistics matter here, and they are a small part of the
// line (the per-site "layers" are most of it), so only "step" and the "comm" array are parsed.
void ReadStepLine(const std::string& line, RunMetrics* m) {
  const size_t comm = line.find("\"comm\":[");
  if (comm == std::string::npos) return;
  const size_t key = line.rfind("\"step\":");
  if (key == std::string::npos) {
    ++m->malformed;
    return;
  }
  const int64_t step = std::strtoll(line.c_str() + key + 7, nullptr, 10);
  if (step <= m->last_comm_step) return;  // a resumed run's repeat of a counted step
  const size_t begin = comm + 7, end = ArrayEnd(line, begin);
  if (end == std::string::npos) {
    ++m->malformed;
    return;
  }
  const json arr =
      json::parse(line.begin() + long(begin), line.begin() + long(end) + 1, nullptr, false);
  if (!arr.is_array()) {
    ++m->malformed;
    return;
  }
  AddStepComm(step, arr, m);
}

void ReadRecord(const json& j, RunMetrics* m) {
  const std::string type = j.value("type", std::string());
  if (type == "epoch") {
    EpochRow e;
    e.step = j.value("step", int64_t{0});
    e.loss = Num(j, "loss");
    e.train_accuracy = Num(j, "train_accuracy");
    e.test_accuracy = Num(j, "test_accuracy");
    e.test_loss = Num(j, "test_loss");
    e.images_per_s = Num(j, "images_per_s");
    e.relative_cost = Num(j, "relative_cost");
    e.test_perplexity = Num(j, "test_perplexity");
    e.test_bits_per_byte = Num(j, "test_bits_per_byte");
    e.skipped_steps = j.value("skipped_steps", int64_t{0});
    if (auto it = j.find("cost_reference"); it != j.end()) {
      e.cost_reference = it->is_string() ? it->get<std::string>() : it->dump();
    }
    m->epochs[j.value("epoch", 0)] = e;  // the last record of an epoch wins
  } else if (type == "run") {
    m->classes = j.value("classes", 0);
    m->language_model = m->language_model || j.contains("block_size");
  } else if (type == "stop") {
    m->stopped = true;
  } else if (type == "step") {
    if (auto it = j.find("comm"); it != j.end() && it->is_array()) {
      AddStepComm(j.value("step", int64_t{0}), *it, m);
    }
  }
}

RunMetrics ReadMetrics(const std::string& path) {
  RunMetrics m;
  std::ifstream in(path, std::ios::binary);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    if (line.find("\"type\":\"step\"") != std::string::npos) {
      ReadStepLine(line, &m);
      continue;
    }
    const json j = json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      ++m.malformed;  // e.g. the last line of a run killed while writing it
      continue;
    }
    ReadRecord(j, &m);
  }
  return m;
}

// The run's classes when no "run" record says: its --classes, else its dataset's.
int FallbackClasses(const PlannedRun& r) {
  std::string dataset;
  for (const ConfigEntry& e : r.flags) {
    if (e.key == "classes") return std::atoi(e.values[0].c_str());
    if (e.key == "dataset") dataset = e.values[0];
  }
  return dataset == "cifar100" ? 100 : 10;
}

std::string Fmt(double v) {
  if (std::isnan(v)) return "";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

// One run's row of runs.csv, and what the summary needs of it.
struct RunRow {
  const PlannedRun* run = nullptr;
  std::string state;
  RunMetrics m;
  RunState s;
  int classes = 10;
  double final_acc = kNaN, best_acc = kNaN, final_loss = kNaN;
  // A language model's validation: perplexity and bits per byte of the last epoch and of the
  // best (the lowest), and the last validation loss per token; NaN when not logged.
  double final_ppl = kNaN, best_ppl = kNaN, final_bpb = kNaN, best_bpb = kNaN;
  double final_test_loss = kNaN;
  // The all-reduce's flushed fraction and APS shift, means over the logged steps and layers
  // (NaN without all-reduce statistics).
  double mean_flushed = kNaN, mean_shift = kNaN;
  // Throughput (mean over the epochs), wall time over every attempt, and the relative cost and
  // skipped steps of the last epoch; NaN / empty / 0 before the first epoch.
  double images_per_s = kNaN, wall_s = kNaN, relative_cost = kNaN;
  std::string cost_reference;
  int64_t skipped_steps = 0;
  bool has_epochs = false, collapsed = false;
  // Diverged (cpd-train exit 3, or a "stop" record): a result, even before its first epoch;
  // the step and loss where it stopped (-1 / NaN when unknown).
  bool diverged = false;
  int64_t diverged_step = -1;
  double diverged_loss = kNaN;
  std::string diverged_reason;
  // A result to count: an epoch, or a divergence.
  bool has_result() const { return has_epochs || diverged; }
};

// The smaller of `best` and `v`; a NaN `v` (not logged) leaves `best` as it is.
double Lowest(double best, double v) { return std::isnan(v) || v >= best ? best : v; }

// What a run's epochs say: the final and best figures, throughput, cost and skipped steps.
void SummariseEpochs(RunRow* row) {
  const EpochRow& last = row->m.epochs.rbegin()->second;
  row->final_acc = last.test_accuracy;
  row->final_loss = last.loss;
  row->final_ppl = last.test_perplexity;
  row->final_bpb = last.test_bits_per_byte;
  row->final_test_loss = last.test_loss;
  double ips = 0;
  for (const auto& [n, e] : row->m.epochs) {
    if (!(row->best_acc >= e.test_accuracy)) row->best_acc = e.test_accuracy;
    row->best_ppl = Lowest(row->best_ppl, e.test_perplexity);
    row->best_bpb = Lowest(row->best_bpb, e.test_bits_per_byte);
    ips += e.images_per_s;
  }
  row->images_per_s = ips / double(row->m.epochs.size());
  row->relative_cost = last.relative_cost;
  // Metrics from before --cost-reference measured against CPT's max bits.
  row->cost_reference = last.cost_reference.empty() ? "cpt-max-bits" : last.cost_reference;
  row->skipped_steps = last.skipped_steps;
}

RunRow Summarise(const PlannedRun& r, const std::string& out) {
  RunRow row;
  row.run = &r;
  const RunPaths p = PathsOf(out, r.name);
  auto s = ReadState(p.state);
  if (!s.ok()) {
    // The same line `run` and `status` give for this file.
    std::fprintf(stderr, "cpd-study: warning: %s\n", s.status().message().c_str());
  }
  row.s = s.ok() ? *s : RunState{};
  row.state = s.ok() ? Classify(*s, p) : "unreadable";
  row.m = ReadMetrics(p.metrics);
  if (row.m.malformed > 0) {
    std::fprintf(stderr, "cpd-study: warning: %s: %lld malformed line(s) skipped\n",
                 p.metrics.c_str(), static_cast<long long>(row.m.malformed));
  }
  row.classes = row.m.classes > 0 ? row.m.classes : FallbackClasses(r);
  if (row.m.all.n > 0) {
    row.mean_flushed = row.m.all.flushed / double(row.m.all.n);
    row.mean_shift = row.m.all.shift / double(row.m.all.n);
  }
  row.has_epochs = !row.m.epochs.empty();
  if (row.has_epochs) SummariseEpochs(&row);
  // Every attempt's wall time: the finished ones, and the one a kill ended (up to its last
  // write) or the one still running (up to now).
  if (row.s.attempts > 0) {
    row.wall_s = row.s.total_wall_s;
    if (row.state == "interrupted") row.wall_s += InterruptedSeconds(row.s, p);
    if (row.state == "running" && row.s.start_ms > 0) {
      row.wall_s += std::max(0.0, double(NowMs() - row.s.start_ms) / 1e3);
    }
  }
  row.diverged = row.m.stopped || row.state == "diverged";
  if (row.diverged) {
    RunState where = row.s;
    if (where.diverged_step < 0) ReadDivergence(p, &where);  // not run by cpd-study's driver
    row.diverged_step = where.diverged_step;
    row.diverged_loss = where.diverged_loss;
    row.diverged_reason = where.diverged_reason;
  }
  row.collapsed =
      row.diverged ||
      (row.has_epochs && (!std::isfinite(row.final_loss) || !(row.final_acc > 1.5 / row.classes)));
  return row;
}

std::string AxesHeader(const Study& s) {
  std::string h;
  for (const Axis& a : s.axes) h += "," + CsvField(a.name);
  return h;
}

std::string AxesCells(const PlannedRun& r) {
  std::string c;
  for (const auto& l : r.labels) c += "," + CsvField(l);
  return c;
}

// What the tables show besides the fixed columns: the all-reduce's columns only when some run
// logged all-reduce statistics (a study of one worker per run has none, and columns that are
// always empty only hide the others), the reference's only with --reference.
struct Columns {
  bool allreduce = false, reference = false;
  // Validation perplexity and bits per byte where accuracy is: only when some run is a language
  // model (the image studies' tables keep their columns). summary.md shows bits per byte only
  // when some run logged them (byte-level text).
  bool language_model = false, bits_per_byte = false;
};

// What --reference's runs reached: the means of their final test accuracy, and of a language
// model's final validation perplexity and bits per byte (NaN: none).
struct Reference {
  double accuracy = kNaN, perplexity = kNaN, bits_per_byte = kNaN;
};

// "nan" when that is what the loss was, empty when it is not known.
std::string DivergedLossCell(const RunRow& r) {
  const bool nan = r.diverged_reason.find("loss is NaN") != std::string::npos;
  return std::isnan(r.diverged_loss) && nan ? "nan" : Fmt(r.diverged_loss);
}

std::string RunsCsv(const Study& s, const std::vector<RunRow>& rows, const Reference& ref,
                    const Columns& c) {
  std::string csv = "run" + AxesHeader(s) +
                    ",seed,state,epochs,final_test_accuracy,best_test_accuracy,final_loss,"
                    "final_test_loss,skipped_steps,collapsed,diverged_step,diverged_loss,classes";
  if (c.language_model) {
    csv +=
        ",final_test_perplexity,final_test_bits_per_byte,best_test_perplexity,"
        "best_test_bits_per_byte";
  }
  if (c.allreduce) csv += ",mean_aps_shift,mean_allreduce_flushed";
  csv += ",images_per_s,wall_s,relative_cost,cost_reference,accuracy_vs_reference";
  if (c.language_model) csv += ",perplexity_vs_reference,bits_per_byte_vs_reference";
  csv += "\n";
  for (const RunRow& r : rows) {
    csv += CsvField(r.run->name) + AxesCells(*r.run) + "," + std::to_string(r.run->seed) + "," +
           r.state + "," + std::to_string(r.m.epochs.size()) + "," + Fmt(r.final_acc) + "," +
           Fmt(r.best_acc) + "," + Fmt(r.final_loss) + "," + Fmt(r.final_test_loss) + "," +
           (r.has_epochs ? std::to_string(r.skipped_steps) : "") + "," + (r.collapsed ? "1" : "0") +
           "," + (r.diverged_step >= 0 ? std::to_string(r.diverged_step) : "") + "," +
           DivergedLossCell(r) + "," + std::to_string(r.classes);
    if (c.language_model) {
      csv += "," + Fmt(r.final_ppl) + "," + Fmt(r.final_bpb) + "," + Fmt(r.best_ppl) + "," +
             Fmt(r.best_bpb);
    }
    if (c.allreduce) csv += "," + Fmt(r.mean_shift) + "," + Fmt(r.mean_flushed);
    csv += "," + Fmt(r.images_per_s) + "," + Fmt(r.wall_s) + "," + Fmt(r.relative_cost) + "," +
           CsvField(r.cost_reference) + "," + Fmt(r.final_acc - ref.accuracy);
    if (c.language_model) {
      csv += "," + Fmt(r.final_ppl - ref.perplexity) + "," + Fmt(r.final_bpb - ref.bits_per_byte);
    }
    csv += "\n";
  }
  return csv;
}

struct MeanStd {
  double mean = kNaN, std = kNaN;
};

// Mean and sample standard deviation (n - 1); std is NaN (left empty) below two values.
MeanStd Stats(const std::vector<double>& v) {
  MeanStd r;
  if (v.empty()) return r;
  double sum = 0;
  for (double x : v) sum += x;
  r.mean = sum / double(v.size());
  if (v.size() < 2) return r;
  double sq = 0;
  for (double x : v) sq += (x - r.mean) * (x - r.mean);
  r.std = std::sqrt(sq / double(v.size() - 1));
  return r;
}

struct Group {
  const PlannedRun* first = nullptr;
  int results = 0;    // seeds with a result: an epoch, or a divergence
  int collapsed = 0;  // of those
  std::vector<double> final_acc, best_acc, final_loss, delta;  // seeds with an epoch
  // A language model's, over the seeds with an epoch (NaN where a run logged none).
  std::vector<double> final_ppl, best_ppl, final_bpb, best_bpb, final_test_loss;
  std::vector<double> flushed, shift;  // per run with all-reduce statistics: its step mean
  std::vector<double> images_per_s, wall_s, relative_cost;
  std::string cost_reference;  // the runs' reference; "mixed" when they differ
  int64_t skipped_steps = 0;   // over the seeds
};

// Adds a run with an epoch to its group's language-model figures.
void AddValidation(const RunRow& r, Group* g) {
  g->final_ppl.push_back(r.final_ppl);
  g->best_ppl.push_back(r.best_ppl);
  g->final_bpb.push_back(r.final_bpb);
  g->best_bpb.push_back(r.best_bpb);
  g->final_test_loss.push_back(r.final_test_loss);
}

// A setting's mean final perplexity and bits per byte minus the reference's (the mean over the
// seeds of each run's difference, but exactly 0 for the reference's own setting).
MeanStd PerplexityVsReference(const Group& g, const Reference& ref) {
  return {Stats(g.final_ppl).mean - ref.perplexity, kNaN};
}
MeanStd BitsPerByteVsReference(const Group& g, const Reference& ref) {
  return {Stats(g.final_bpb).mean - ref.bits_per_byte, kNaN};
}

std::vector<Group> GroupOverSeeds(const std::vector<RunRow>& rows, const Reference& ref) {
  std::vector<Group> groups;
  std::map<std::vector<std::string>, size_t> at;
  for (const RunRow& r : rows) {
    auto [it, added] = at.try_emplace(r.run->labels, groups.size());
    if (added) {
      groups.emplace_back();
      groups.back().first = r.run;
    }
    Group& g = groups[it->second];
    if (!r.has_result()) continue;  // no result yet
    // A run that diverged before its first epoch has no accuracy, but it is a seed with a
    // result, and a collapsed one.
    ++g.results;
    g.collapsed += r.collapsed ? 1 : 0;
    if (!std::isnan(r.wall_s)) g.wall_s.push_back(r.wall_s);
    if (!r.has_epochs) continue;
    g.final_acc.push_back(r.final_acc);
    g.best_acc.push_back(r.best_acc);
    g.final_loss.push_back(r.final_loss);
    g.delta.push_back(r.final_acc - ref.accuracy);
    AddValidation(r, &g);
    g.skipped_steps += r.skipped_steps;
    g.images_per_s.push_back(r.images_per_s);
    if (!std::isnan(r.relative_cost)) g.relative_cost.push_back(r.relative_cost);
    if (g.cost_reference.empty()) g.cost_reference = r.cost_reference;
    if (g.cost_reference != r.cost_reference) g.cost_reference = "mixed";
    if (!std::isnan(r.mean_flushed)) {
      g.flushed.push_back(r.mean_flushed);
      g.shift.push_back(r.mean_shift);
    }
  }
  return groups;
}

// A language model's columns of summary.csv, where the accuracy's are (which follow them: for a
// language model they are the next-token accuracy).
constexpr const char* kValidationCsvHeader =
    ",final_test_perplexity_mean,final_test_perplexity_std,best_test_perplexity_mean,"
    "best_test_perplexity_std,final_test_bits_per_byte_mean,final_test_bits_per_byte_std,"
    "best_test_bits_per_byte_mean,best_test_bits_per_byte_std,final_test_loss_mean,"
    "final_test_loss_std,perplexity_vs_reference_mean,bits_per_byte_vs_reference_mean";

std::string ValidationCsvCells(const Group& g, const Reference& ref) {
  std::string cells;
  for (const auto* v : {&g.final_ppl, &g.best_ppl, &g.final_bpb, &g.best_bpb, &g.final_test_loss}) {
    const MeanStd m = Stats(*v);
    cells += "," + Fmt(m.mean) + "," + Fmt(m.std);
  }
  return cells + "," + Fmt(PerplexityVsReference(g, ref).mean) + "," +
         Fmt(BitsPerByteVsReference(g, ref).mean);
}

std::string SummaryCsv(const Study& s, const std::vector<Group>& groups, const Reference& ref,
                       const Columns& c) {
  std::string csv = AxesHeader(s).substr(1) + ",n_seeds,n_collapsed" +
                    (c.language_model ? kValidationCsvHeader : "") +
                    ",final_test_accuracy_mean,final_test_accuracy_std,"
                    "best_test_accuracy_mean,best_test_accuracy_std,final_loss_mean,"
                    "final_loss_std,accuracy_vs_reference_mean";
  if (c.allreduce) csv += ",allreduce_flushed_mean,allreduce_flushed_std,aps_shift_mean";
  csv += ",skipped_steps,images_per_s_mean,wall_s_mean,relative_cost_mean,cost_reference\n";
  for (const Group& g : groups) {
    const MeanStd fa = Stats(g.final_acc), ba = Stats(g.best_acc), fl = Stats(g.final_loss),
                  flushed = Stats(g.flushed);
    csv += AxesCells(*g.first).substr(1) + "," + std::to_string(g.results) + "," +
           std::to_string(g.collapsed) + (c.language_model ? ValidationCsvCells(g, ref) : "") +
           "," + Fmt(fa.mean) + "," + Fmt(fa.std) + "," + Fmt(ba.mean) + "," + Fmt(ba.std) + "," +
           Fmt(fl.mean) + "," + Fmt(fl.std) + "," + Fmt(Stats(g.delta).mean);
    if (c.allreduce) {
      csv += "," + Fmt(flushed.mean) + "," + Fmt(flushed.std) + "," + Fmt(Stats(g.shift).mean);
    }
    csv += "," + std::to_string(g.skipped_steps) + "," + Fmt(Stats(g.images_per_s).mean) + "," +
           Fmt(Stats(g.wall_s).mean) + "," + Fmt(Stats(g.relative_cost).mean) + "," +
           CsvField(g.cost_reference) + "\n";
  }
  return csv;
}

std::string PlusMinus(const MeanStd& m, double scale, const char* fmt) {
  if (std::isnan(m.mean) && !std::isnan(m.std)) return "nan";
  if (std::isnan(m.mean)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, m.mean * scale);
  std::string out = buf;
  if (!std::isnan(m.std)) {
    std::snprintf(buf, sizeof buf, fmt, m.std * scale);
    out += std::string(" ± ") + buf;
  }
  return out;
}

// "-36.67 % vs 8/8"; "-" without a cost.
std::string CostCell(double relative_cost, const std::string& reference) {
  if (std::isnan(relative_cost)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%+.2f %% vs ", 100 * relative_cost);
  return buf + reference;
}

// summary.md's opening paragraph: what each column is.
std::string SummaryMdIntro(const Study& s, size_t runs, const Columns& c,
                           const std::string& reference_glob) {
  const bool lm = c.language_model;
  std::string md = "# Study " + s.name + "\n\n" + std::to_string(runs) + " runs, " +
                   std::to_string(s.seeds.size()) +
                   " seed(s) per setting. seeds: the seeds with a result (an epoch, or a "
                   "divergence); collapsed: of those, the runs whose final " +
                   (lm ? "next-token" : "test") +
                   " accuracy is <= 1.5 x chance, whose loss is not finite, or that diverged "
                   "(runs.csv gives the step and loss). ";
  if (lm) {
    md += std::string("Validation perplexity (val ppl), ") +
          (c.bits_per_byte ? "bits per byte (bpb) " : "") +
          "and loss per token (val loss), mean ± sample std over the seeds with an epoch; best: "
          "the epoch with the lowest perplexity";
  } else {
    md += "Accuracy in %, mean ± sample std over the seeds with an epoch";
  }
  if (c.reference && lm) {
    md += "; vs ref: the mean final validation perplexity minus that of the reference runs (" +
          reference_glob + ")" +
          (c.bits_per_byte ? ", and vs ref bpb the same in bits per byte" : "");
  } else if (c.reference) {
    md += "; vs ref: final test accuracy minus the mean of the reference runs (" + reference_glob +
          "), in points, mean over the seeds";
  }
  if (c.allreduce) {
    md +=
        "; flushed: the fraction of gradient values the all-reduce flushed to zero and shift: "
        "the APS shift, means over the logged steps and layers, then over the seeds";
  }
  return md + "; skipped: steps skipped for non-finite gradients, over the seeds; " +
         (c.language_model ? "windows/s (windows of --block-size tokens)" : "img/s") +
         " and wall s: means over the seeds; cost: the relative training cost (CPT's BitOPs "
         "model) against the reference it names.\n\n";
}

// summary.md's header line and rule.
std::string SummaryMdHeader(const Study& s, const Columns& c) {
  std::string md = "|", rule = "|";
  auto add = [&](const char* header, const char* align) {
    md += header;
    rule += align;
  };
  for (const Axis& a : s.axes) add((" " + a.name + " |").c_str(), "---|");
  add(" seeds | collapsed |", "---:|---:|");
  if (c.language_model) {
    add(" final val ppl | best val ppl |", "---:|---:|");
    if (c.bits_per_byte) add(" final bpb | best bpb |", "---:|---:|");
    add(" final val loss |", "---:|");
  } else {
    add(" final test acc | best test acc |", "---:|---:|");
  }
  if (c.reference) add(" vs ref |", "---:|");
  if (c.reference && c.language_model && c.bits_per_byte) add(" vs ref bpb |", "---:|");
  add(" final loss |", "---:|");
  if (c.allreduce) add(" flushed % | shift |", "---:|---:|");
  // A language model's samples are windows of --block-size tokens.
  add(c.language_model ? " skipped | windows/s | wall s | cost |"
                       : " skipped | img/s | wall s | cost |",
      "---:|---:|---:|---:|");
  return md + "\n" + rule + "\n";
}

// A setting's row of summary.md: a language model's validation where accuracy is.
std::string SummaryMdRow(const Group& g, const Reference& ref, const Columns& c) {
  std::string md = "|";
  for (const auto& l : g.first->labels) md += " " + l + " |";
  md += " " + std::to_string(g.results) + " | " + std::to_string(g.collapsed) + " | ";
  if (c.language_model) {
    md += PlusMinus(Stats(g.final_ppl), 1, "%.2f") + " | " +
          PlusMinus(Stats(g.best_ppl), 1, "%.2f") + " | ";
    if (c.bits_per_byte) {
      md += PlusMinus(Stats(g.final_bpb), 1, "%.3f") + " | " +
            PlusMinus(Stats(g.best_bpb), 1, "%.3f") + " | ";
    }
    md += PlusMinus(Stats(g.final_test_loss), 1, "%.4f") + " | ";
    if (c.reference) md += PlusMinus(PerplexityVsReference(g, ref), 1, "%+.2f") + " | ";
    if (c.reference && c.bits_per_byte) {
      md += PlusMinus(BitsPerByteVsReference(g, ref), 1, "%+.3f") + " | ";
    }
  } else {
    md += PlusMinus(Stats(g.final_acc), 100, "%.2f") + " | " +
          PlusMinus(Stats(g.best_acc), 100, "%.2f") + " | ";
    if (c.reference) md += PlusMinus(MeanStd{Stats(g.delta).mean, kNaN}, 100, "%+.2f") + " | ";
  }
  md += PlusMinus(Stats(g.final_loss), 1, "%.4f") + " | ";
  if (c.allreduce) {
    md += PlusMinus(Stats(g.flushed), 100, "%.2f") + " | " +
          PlusMinus(MeanStd{Stats(g.shift).mean, kNaN}, 1, "%.1f") + " | ";
  }
  return md + std::to_string(g.skipped_steps) + " | " +
         PlusMinus(MeanStd{Stats(g.images_per_s).mean, kNaN}, 1, "%.0f") + " | " +
         PlusMinus(MeanStd{Stats(g.wall_s).mean, kNaN}, 1, "%.1f") + " | " +
         CostCell(Stats(g.relative_cost).mean, g.cost_reference) + " |\n";
}

std::string SummaryMd(const Study& s, const std::vector<Group>& groups, size_t runs,
                      const Reference& ref, const Columns& c, const std::string& reference_glob) {
  std::string md = SummaryMdIntro(s, runs, c, reference_glob) + SummaryMdHeader(s, c);
  for (const Group& g : groups) md += SummaryMdRow(g, ref, c);
  return md;
}

// Diverged marks which run diverged, so that the plots can say so.
std::string CurvesCsv(const Study& s, const std::vector<RunRow>& rows, const Columns& c) {
  std::string csv = "run" + AxesHeader(s) +
                    ",seed,epoch,step,loss,train_accuracy,test_accuracy,test_loss,images_per_s,"
                    "diverged" +
                    std::string(c.language_model ? ",test_perplexity,test_bits_per_byte" : "") +
                    "\n";
  for (const RunRow& r : rows) {
    const std::string head =
        CsvField(r.run->name) + AxesCells(*r.run) + "," + std::to_string(r.run->seed) + ",";
    for (const auto& [n, e] : r.m.epochs) {
      csv += head + std::to_string(n) + "," + std::to_string(e.step) + "," + Fmt(e.loss) + "," +
             Fmt(e.train_accuracy) + "," + Fmt(e.test_accuracy) + "," + Fmt(e.test_loss) + "," +
             Fmt(e.images_per_s) + "," + (r.diverged ? "1" : "0");
      if (c.language_model) csv += "," + Fmt(e.test_perplexity) + "," + Fmt(e.test_bits_per_byte);
      csv += "\n";
    }
  }
  return csv;
}

std::string LayersCsv(const Study& s, const std::vector<RunRow>& rows) {
  std::string csv =
      "run" + AxesHeader(s) + ",seed,layer_index,layer,steps,mean_flushed,mean_shift\n";
  for (const RunRow& r : rows) {
    for (size_t i = 0; i < r.m.layer_order.size(); ++i) {
      const LayerSums& l = r.m.layers.at(r.m.layer_order[i]);
      csv += CsvField(r.run->name) + AxesCells(*r.run) + "," + std::to_string(r.run->seed) + "," +
             std::to_string(i) + "," + CsvField(r.m.layer_order[i]) + "," + std::to_string(l.n) +
             "," + Fmt(l.flushed / double(l.n)) + "," + Fmt(l.shift / double(l.n)) + "\n";
    }
  }
  return csv;
}

Result<Reference> ReferenceOf(const std::vector<RunRow>& rows, const std::string& glob) {
  if (glob.empty()) return Reference{};
  std::vector<double> acc, ppl, bpb;
  size_t matched = 0;
  for (const RunRow& r : rows) {
    if (::fnmatch(glob.c_str(), r.run->name.c_str(), 0) != 0) continue;
    ++matched;
    if (!r.has_epochs) continue;
    acc.push_back(r.final_acc);
    ppl.push_back(r.final_ppl);
    bpb.push_back(r.final_bpb);
  }
  if (matched == 0) {
    return Status::InvalidArgument("--reference '" + glob + "' matches no run of the study");
  }
  if (acc.empty()) {
    std::fprintf(stderr, "cpd-study: warning: the %zu reference run(s) have no results yet\n",
                 matched);
  }
  return Reference{Stats(acc).mean, Stats(ppl).mean, Stats(bpb).mean};
}

}  // namespace

std::vector<PlotSpec> Plots(const Study& study, bool language_model) {
  // Accuracy against the global batch when it is an axis (what the plot was made for), else
  // against the first axis; the file says which. A language model's validation per epoch in
  // its place.
  std::string x = study.axes.empty() ? "seed" : study.axes[0].name;
  for (const Axis& a : study.axes) {
    if (a.name == "global-batch") x = a.name;
  }
  PlotSpec first = {"accuracy", "accuracy_vs_" + x + ".png", x};
  if (language_model) first = {"perplexity", "perplexity_curves.png", ""};
  return {first, {"loss", "loss_curves.png", ""}, {"layers", "layer_flushed.png", ""}};
}

Result<std::vector<std::string>> WriteReport(const Study& study,
                                             const std::vector<PlannedRun>& runs,
                                             const ReportOptions& o) {
  std::vector<RunRow> rows;
  rows.reserve(runs.size());
  for (const PlannedRun& r : runs) rows.push_back(Summarise(r, o.out_dir));
  CPD_ASSIGN_OR_RETURN(const Reference reference, ReferenceOf(rows, o.reference_glob));
  Columns columns;
  columns.reference = !o.reference_glob.empty();
  for (const RunRow& r : rows) {
    columns.allreduce = columns.allreduce || r.m.all.n > 0;
    columns.language_model = columns.language_model || r.m.language_model;
    columns.bits_per_byte = columns.bits_per_byte || !std::isnan(r.best_bpb);
  }
  const std::string dir = o.out_dir + "/report";
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IoError("cannot create " + dir + ": " + ec.message());
  const std::vector<Group> groups = GroupOverSeeds(rows, reference);
  const std::vector<std::pair<std::string, std::string>> files = {
      {dir + "/runs.csv", RunsCsv(study, rows, reference, columns)},
      {dir + "/summary.csv", SummaryCsv(study, groups, reference, columns)},
      {dir + "/summary.md",
       SummaryMd(study, groups, runs.size(), reference, columns, o.reference_glob)},
      {dir + "/curves.csv", CurvesCsv(study, rows, columns)},
      {dir + "/layers.csv", LayersCsv(study, rows)}};
  std::vector<std::string> wrote;
  for (const auto& [path, text] : files) {
    CPD_RETURN_IF_ERROR(WriteFileAtomically(path, text));
    wrote.push_back(path);
  }
  if (o.script.empty()) return wrote;
  // One process per plot: a plot that fails (a matplotlib error, a crash) is one warning naming
  // it, and the tables and the other plots stand. The script writes each PNG under a temporary
  // name and renames it when whole.
  for (const PlotSpec& plot : Plots(study, columns.language_model)) {
    std::vector<std::string> args = {"--dir", dir, "--plot", plot.kind, "--out", plot.file};
    if (!plot.x_axis.empty()) args.insert(args.end(), {"--x-axis", plot.x_axis});
    const Status drawn = RunPythonScript(o.python, o.script, args);
    if (drawn.ok()) {
      wrote.push_back(dir + "/" + plot.file);
    } else {
      std::fprintf(stderr, "cpd-study: warning: plot %s not drawn: %s\n", plot.file.c_str(),
                   drawn.message().c_str());
    }
  }
  return wrote;
}

}  // namespace cpd::launcher::study
