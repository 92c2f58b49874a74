// cpd-format-search: ranks candidate number formats for a trained model by the gradient-angle
// indicator of Lee, Park and Jeon (ICLR 2022): how far quantising the activations (A), the
// errors (E) or both to a format turns the weight gradients, averaged over N mini-batches.
// Under mpirun/srun the candidates are split over the ranks; rank 0 gathers the results, prints
// the ranked table and writes PREFIX.csv, PREFIX.json and PREFIX.png (and, while it runs,
// PREFIX.partial.csv, from which --resume continues an interrupted search).
#include <omp.h>
#include <sys/stat.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cpd/candidates.h"
#include "cpd/config.h"
#include "cpd/format.h"
#include "cpd/progress.h"
#include "kernels/grid.h"
#include "launcher/cli.h"
#include "launcher/common.h"
#include "launcher/files.h"
#include "launcher/world.h"
#include "runtime/nn/models.h"
#include "runtime/search/format_search.h"
#include "runtime/search/search_files.h"
#include "runtime/train/checkpoint.h"
#include "runtime/train/checkpointer.h"
#include "runtime/train/data.h"
#include "runtime/train/token_data.h"
#include "runtime/train/train_options.h"

extern "C" void openblas_set_num_threads(int num_threads);

namespace {

using cpd::Status;
using cpd::launcher::kUsageError;
using cpd::runtime::CandidateResult;
using cpd::runtime::SiteSet;

constexpr const char* kTool = "cpd-format-search";

struct Flags {
  std::string checkpoint, arch = "lenet5", dataset = "fashion-mnist", data_dir;
  std::vector<std::string> formats;
  std::string bits, candidates_file;
  std::string sites = "A,E,A+E";
  std::string a_rounding = "nearest", e_rounding = "nearest", keep_fp32;
  int64_t batches = 100, batch_size = 128;
  int group = 8, threads = 0, top = 20;
  uint64_t seed = 1;
  std::string device = "auto", comm = "auto", out;
  bool resume = false, no_plot = false, no_progress = false;
  std::string progress = "auto";
  double progress_interval_s = 30;
  // Whether the flag was given at all: `--bits ""` is an empty list, not the default.
  bool bits_given = false, candidates_file_given = false;
  // A language model's shape (as cpd-train's flags; no dropout: the indicator compares exact
  // gradients) and the first of its shape flags given, if any.
  cpd::runtime::LanguageModelOptions lm;
  bool untied_head = false;
  std::string lm_flag_given;
};

constexpr const char* kLanguageModelFlags[] = {"--n-layer", "--n-head", "--n-embd", "--block-size",
                                               "--untied-head"};

void AddFlags(CLI::App* app, Flags* f) {
  app->add_option("--checkpoint", f->checkpoint, "A cpd-train checkpoint of the trained model")
      ->required();
  app->add_option("--arch", f->arch, "The model (as cpd-train --arch)")->capture_default_str();
  app->add_option("--dataset", f->dataset, "Its training data (as cpd-train --dataset)")
      ->capture_default_str();
  app->add_option("--data-dir", f->data_dir, "Dataset directory (as cpd-train --data-dir)");
  app->add_option("--n-layer", f->lm.n_layer, "Language models: as cpd-train --n-layer")
      ->capture_default_str();
  app->add_option("--n-head", f->lm.n_head, "gpt: as cpd-train --n-head")->capture_default_str();
  app->add_option("--n-embd", f->lm.n_embd, "Language models: as cpd-train --n-embd")
      ->capture_default_str();
  app->add_option("--block-size", f->lm.block_size,
                  "Language models: tokens per window (as cpd-train --block-size)")
      ->capture_default_str();
  app->add_flag("--untied-head", f->untied_head, "Language models: as cpd-train --untied-head");
  app->add_option("--format", f->formats, "A candidate format spec (repeatable)");
  app->add_option("--bits", f->bits,
                  "Candidates: the enumerated per-binade formats of these widths, e.g. 8,7,6 "
                  "(cpd-quant candidates); the default when no --format or file is given: 8");
  app->add_option("--candidates-file", f->candidates_file,
                  "Candidates: one format spec per line ('#' starts a comment)");
  app->add_option("--sites", f->sites, "Site sets to evaluate: A, E, A+E (comma-separated)")
      ->capture_default_str();
  app->add_option("--batches", f->batches, "Mini-batches N the angles are averaged over")
      ->capture_default_str()
      ->check(cpd::launcher::IntegerAtLeast(1));
  app->add_option("--batch-size", f->batch_size, "Mini-batch size")
      ->capture_default_str()
      ->check(cpd::launcher::IntegerAtLeast(1));
  app->add_option("--seed", f->seed,
                  "Seed of the batches' shuffle and of stochastic rounding (as cpd-train)")
      ->check(cpd::launcher::Uint64Number())
      ->capture_default_str();
  app->add_option("--a-rounding", f->a_rounding, "Rounding at A: nearest | stochastic | zero")
      ->capture_default_str();
  app->add_option("--e-rounding", f->e_rounding, "Rounding at E: nearest | stochastic | zero")
      ->capture_default_str();
  app->add_option("--keep-fp32", f->keep_fp32,
                  "Layers left in fp32 (as cpd-train --keep-fp32: first, last, names)");
  app->add_option("--group", f->group, "Candidates a rank evaluates per round")
      ->capture_default_str()
      ->check(cpd::launcher::IntegerAtLeast(1));
  app->add_option("--threads", f->threads, "Threads per rank (0: all cores)")
      ->capture_default_str()
      ->check(cpd::launcher::ThreadCount());
  app->add_option("--device", f->device, "auto | cpu | cuda")->capture_default_str();
  app->add_option("--comm", f->comm, "auto | self | mpi")->capture_default_str();
  app->add_option("--out", f->out, "Output prefix: PREFIX.csv, PREFIX.json, PREFIX.png")
      ->required();
  app->add_flag("--resume", f->resume, "Continue from PREFIX.partial.csv");
  app->add_option("--top", f->top, "Rows of the printed table (0: all)")
      ->capture_default_str()
      ->check(cpd::launcher::IntegerAtLeast(0));
  app->add_flag("--no-plot", f->no_plot, "Write no PNG");
  app->add_option("--progress", f->progress,
                  "auto | lines | off: a line per round at most every --progress-interval "
                  "seconds and a tenth of the rounds, plus the last (no bar: a round takes "
                  "seconds to minutes)")
      ->capture_default_str();
  app->add_flag("--no-progress", f->no_progress, "The same as --progress off");
  app->add_option("--progress-interval", f->progress_interval_s,
                  "Seconds between progress lines, at least")
      ->capture_default_str();
}

Status Bad(const std::string& msg) { return Status::InvalidArgument(msg); }

// Whether `s` is short printable ASCII, which a message may quote as it is.
bool Plain(const std::string& s) {
  return s.size() <= 64 &&
         std::all_of(s.begin(), s.end(), [](char c) { return c >= 0x20 && c < 0x7f; });
}

// The canonical form of the candidate spec `spec`, given by `where` (a flag or FILE:LINE).
// A language model's shape flags and pairing with its data, checked as cpd-train checks them
// (sizes bounded before anything is allocated); refused with an image model.
Status CheckLanguageModel(const Flags& f) {
  if (!cpd::runtime::IsLanguageModel(f.arch) && !f.lm_flag_given.empty()) {
    return Bad(f.lm_flag_given + " applies to language models (--arch gpt or lstm), not --arch " +
               f.arch);
  }
  if (f.arch == "lstm" && f.lm_flag_given == "--n-head") {
    return Bad("--n-head applies to --arch gpt; an LSTM has no attention heads");
  }
  cpd::runtime::TrainOptions o;
  o.arch = f.arch;
  o.dataset = f.dataset;
  o.lm = f.lm;
  o.lm.tied_head = !f.untied_head;
  return cpd::runtime::ValidateLanguageModel(o);
}

cpd::Result<std::string> CanonicalSpec(const std::string& spec, const std::string& where) {
  auto fmt = cpd::Format::Parse(spec);
  if (fmt.ok()) return fmt->spec();
  // The parser's message quotes the spec whole: a long or binary one is quoted shortened here.
  return Bad(where + ": " +
             (Plain(spec) ? fmt.status().message()
                          : cpd::QuoteForMessage(spec) + " is not a format spec"));
}

// The candidate specs the flags name, in order, duplicates removed. The default, --bits 8, only
// when no candidate flag is given at all: an empty file or list is a mistake to report, not a
// request for the default search.
cpd::Result<std::vector<std::string>> Candidates(const Flags& f) {
  using cpd::QuoteForMessage;
  std::vector<std::string> out;
  for (const std::string& spec : f.formats) {
    CPD_ASSIGN_OR_RETURN(std::string c, CanonicalSpec(spec, "--format"));
    out.push_back(std::move(c));
  }
  if (f.candidates_file_given) {
    const std::string name = "--candidates-file " + QuoteForMessage(f.candidates_file, 200);
    CPD_ASSIGN_OR_RETURN(const std::string text,
                         cpd::runtime::ReadBoundedFile(
                             f.candidates_file, cpd::runtime::kMaxCandidatesFileBytes, name));
    CPD_ASSIGN_OR_RETURN(const auto lines, cpd::runtime::ParseCandidateList(name, text));
    for (const auto& l : lines) {
      CPD_ASSIGN_OR_RETURN(std::string c,
                           CanonicalSpec(l.spec, name + ":" + std::to_string(l.line)));
      out.push_back(std::move(c));
    }
  }
  if (f.bits_given && f.bits.empty()) {
    return Bad("--bits is empty; give bit widths such as 8,7,6 (each 2..16)");
  }
  if (f.bits_given && !Plain(f.bits)) {
    return Bad("--bits " + QuoteForMessage(f.bits) +
               " is not a list of bit widths such as 8,7,6 (each 2..16)");
  }
  const std::string bits = f.bits_given ? f.bits : out.empty() ? "8" : "";
  if (!bits.empty()) {
    auto list = cpd::EnumerateBinadeCandidates(std::string_view(bits));
    if (!list.ok()) return Bad("--bits: " + list.status().message());
    for (const auto& c : *list) out.push_back(c.spec);
  }
  std::vector<std::string> unique;
  for (const std::string& s : out) {
    if (std::find(unique.begin(), unique.end(), s) == unique.end()) unique.push_back(s);
  }
  return unique;
}

// The site set the ranking uses: A+E when evaluated, else the first one asked for.
SiteSet RankingSite(const std::vector<SiteSet>& sites) {
  for (SiteSet s : sites) {
    if (s == SiteSet::kAE) return s;
  }
  return sites.front();
}

std::string Angle(const CandidateResult& r, SiteSet s) {
  if (!r.has[int(s)]) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", r.mean[int(s)]);
  return buf;
}

// The layer with the largest mean angle at site set `s`, as "name angle".
std::string WorstLayer(const CandidateResult& r, const std::vector<std::string>& layers,
                       SiteSet s) {
  const auto& m = r.layer_mean[int(s)];
  if (m.empty()) return "-";
  const size_t i = size_t(std::max_element(m.begin(), m.end()) - m.begin());
  char buf[32];
  std::snprintf(buf, sizeof buf, " %.3f", m[i]);
  return layers[i] + buf;
}

void PrintTable(const std::vector<CandidateResult>& ranked, const std::vector<std::string>& layers,
                SiteSet by, int top) {
  std::printf("%4s  %-44s %4s %-8s %9s %9s %9s  %s\n", "rank", "format", "bits", "family", "A deg",
              "E deg", "A+E deg", "worst layer");
  for (size_t i = 0; i < ranked.size() && (top <= 0 || int(i) < top); ++i) {
    const CandidateResult& r = ranked[i];
    std::string spec = r.spec.size() > 44 ? r.spec.substr(0, 41) + "..." : r.spec;
    std::printf("%4zu  %-44s %4d %-8s %9s %9s %9s  %s\n", i + 1, spec.c_str(), r.bits,
                r.family.c_str(), Angle(r, SiteSet::kA).c_str(), Angle(r, SiteSet::kE).c_str(),
                Angle(r, SiteSet::kAE).c_str(), WorstLayer(r, layers, by).c_str());
  }
  if (top > 0 && int(ranked.size()) > top) {
    std::printf("  (%zu more in the CSV)\n", ranked.size() - size_t(top));
  }
}

nlohmann::json ToJson(const std::vector<CandidateResult>& ranked,
                      const std::vector<std::string>& layers, const std::vector<SiteSet>& sites,
                      const nlohmann::json& settings) {
  using nlohmann::json;
  json out = {{"settings", settings}, {"layers", layers}, {"candidates", json::array()}};
  for (size_t i = 0; i < ranked.size(); ++i) {
    const CandidateResult& r = ranked[i];
    json c = {{"rank", i + 1}, {"spec", r.spec}, {"bits", r.bits}, {"family", r.family}};
    for (SiteSet s : sites) {
      c["angles"][cpd::runtime::SiteSetName(s)] = {{"mean_deg", r.mean[int(s)]},
                                                   {"std_deg", r.std[int(s)]},
                                                   {"layer_mean_deg", r.layer_mean[int(s)]},
                                                   {"layer_std_deg", r.layer_std[int(s)]}};
    }
    out["candidates"].push_back(c);
  }
  return out;
}

// JSON text on one line; bytes that are no UTF-8 (a flag's garbage) replaced, never thrown on.
std::string Dump(const nlohmann::json& j, int indent = -1) {
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

// Outputs never replace a file this tool did not write: PREFIX.csv is ours when it opens with
// the ranked table's header, PREFIX.json when it is a search's document, PREFIX.png when the
// PREFIX.json beside it is ours (they are written together). Checked before any work.
Status CheckOutputsAreOurs(const std::string& prefix) {
  // (A directory under the name cannot be replaced at all: the write fails then, naming it.)
  auto exists = [](const std::string& path) {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0 && !S_ISDIR(st.st_mode);
  };
  auto refuse = [](const std::string& path) {
    return Bad("--out: " + cpd::QuoteForMessage(path) +
               " exists and was not written by cpd-format-search; refusing to replace it "
               "(choose another --out, or move the file)");
  };
  const std::string csv = prefix + ".csv", json = prefix + ".json", png = prefix + ".png";
  if (exists(csv)) {
    auto text = cpd::runtime::ReadBoundedFile(csv, size_t(64) << 20, "--out " + csv);
    if (!text.ok() || text->rfind("rank,spec,bits,family", 0) != 0) return refuse(csv);
  }
  bool json_ours = false;
  if (exists(json)) {
    auto text = cpd::runtime::ReadBoundedFile(json, size_t(64) << 20, "--out " + json);
    const nlohmann::json doc =
        text.ok() ? nlohmann::json::parse(*text, nullptr, false) : nlohmann::json();
    json_ours = doc.is_object() && doc.contains("settings") && doc.contains("layers") &&
                doc.contains("candidates");
    if (!json_ours) return refuse(json);
  }
  if (exists(png) && !json_ours) return refuse(png);
  return cpd::Status::Ok();
}

// Everything the flags say, checked before any work; every rank finds the same errors.
cpd::Result<cpd::runtime::FormatSearchOptions> SearchOptions(const Flags& f) {
  using namespace cpd::runtime;
  FormatSearchOptions o;
  // PREFIX names files: "" wrote a hidden ./.csv, and a directory's prefix ends in '/'.
  struct stat st;
  if (f.out.empty() || f.out.back() == '/' ||
      (::stat(f.out.c_str(), &st) == 0 && S_ISDIR(st.st_mode))) {
    return Bad("--out " + cpd::QuoteForMessage(f.out) +
               " is not accepted: a path prefix such as results/lenet5 (PREFIX.csv, "
               "PREFIX.json and PREFIX.png are written)");
  }
  CPD_RETURN_IF_ERROR(CheckOutputsAreOurs(f.out));
  CPD_RETURN_IF_ERROR(CheckLanguageModel(f));
  CPD_ASSIGN_OR_RETURN(o.candidates, Candidates(f));
  auto sites = ParseSiteSets(f.sites);
  if (!sites.ok()) return Bad("--sites: " + sites.status().message());
  o.indicator.sites = *sites;
  auto ar = cpd::ParseRounding(f.a_rounding);
  if (!ar.ok()) return Bad("--a-rounding: " + ar.status().message());
  auto er = cpd::ParseRounding(f.e_rounding);
  if (!er.ok()) return Bad("--e-rounding: " + er.status().message());
  o.indicator.a_rounding = *ar;
  o.indicator.e_rounding = *er;
  o.indicator.keep_fp32 = cpd::launcher::SplitCommas(f.keep_fp32);
  // The rounding stream cpd-train derives from its --seed, so that a format is judged with the
  // random bits it would train with.
  o.indicator.seed = cpd::kernels::SplitMix64(f.seed ^ 0x51u);
  o.batches = f.batches;
  o.batch_size = f.batch_size;
  o.data_seed = f.seed;
  o.group = f.group;
  o.partial_path = f.out + ".partial.csv";
  o.resume = f.resume;
  auto progress = cpd::ParseProgressMode(f.progress);
  if (!progress.ok()) return Bad("--" + progress.status().message());
  if (*progress == cpd::ProgressMode::kBar) {
    return Bad(
        "--progress bar is not offered: cpd-format-search prints lines (accepted: auto, "
        "lines, off)");
  }
  if (f.no_progress && *progress != cpd::ProgressMode::kOff && f.progress != "auto") {
    return Bad("--no-progress and --progress " + f.progress + " exclude each other; give one");
  }
  o.progress = !f.no_progress && *progress != cpd::ProgressMode::kOff;
  if (!(f.progress_interval_s >= 0) || !std::isfinite(f.progress_interval_s)) {
    return Bad("--progress-interval must be a number of seconds >= 0");
  }
  o.progress_interval_s = f.progress_interval_s;
  std::string sites_text;
  for (SiteSet s : o.indicator.sites) {
    sites_text += std::string(sites_text.empty() ? "" : ",") + SiteSetName(s);
  }
  // What determines a row besides the candidates, which the search adds; Search adds the
  // checkpoint's contents once it has read them. (Not the threads or the device: they change
  // an angle only in its last digits.)
  o.settings = Dump(nlohmann::json({{"arch", f.arch},
                                    {"dataset", f.dataset},
                                    {"batches", f.batches},
                                    {"batch_size", f.batch_size},
                                    {"seed", f.seed},
                                    {"sites", sites_text},
                                    {"a_rounding", f.a_rounding},
                                    {"e_rounding", f.e_rounding},
                                    {"keep_fp32", f.keep_fp32}}));
  if (IsLanguageModel(f.arch)) {  // the shape is part of what a row means
    nlohmann::json settings = nlohmann::json::parse(o.settings);
    settings["lm"] = {{"n_layer", f.lm.n_layer},
                      {"n_head", f.lm.n_head},
                      {"n_embd", f.lm.n_embd},
                      {"block_size", f.lm.block_size},
                      {"tied_head", !f.untied_head}};
    o.settings = Dump(settings);
  }
  CPD_RETURN_IF_ERROR(CheckFormatSearch(o));
  return o;
}

// The trained model on its device, and the normalised training set (as cpd-train sees it).
struct Trained {
  std::unique_ptr<cpd::runtime::Sequential> model;
  cpd::runtime::Dataset train;
  cpd::runtime::Device device = cpd::runtime::Device::kCpu;
  int64_t step = 0;
};

cpd::Result<Trained> LoadTrained(const Flags& f) {
  using namespace cpd::runtime;
  Trained t;
  CPD_ASSIGN_OR_RETURN(const DeviceChoice choice, ParseDeviceChoice(f.device));
  CPD_ASSIGN_OR_RETURN(t.device, ResolveDevice(choice));
  const TokenWindows windows{f.lm.block_size, 0};
  auto data = LoadDatasetPair(f.dataset, f.data_dir, f.seed, windows);
  if (!data.ok()) return Bad(data.status().message());  // the user's input: exit 2
  t.train = std::move(data->first);
  if (t.train.is_tokens()) {  // token ids are not normalised
    LanguageModelShape shape;
    shape.vocab = t.train.classes;
    shape.block_size = t.train.block_size;
    shape.n_layer = f.lm.n_layer;
    shape.n_head = f.lm.n_head;
    shape.n_embd = f.lm.n_embd;
    shape.tied_head = !f.untied_head;
    CPD_ASSIGN_OR_RETURN(t.model, BuildLanguageModel(f.arch, shape, 1));
  } else {
    Normalize(&t.train, ComputeChannelStats(t.train));
    CPD_ASSIGN_OR_RETURN(t.model,
                         BuildModel(f.arch, t.train.channels, t.train.height, t.train.classes, 1));
  }
  if (t.device != Device::kCpu) MoveToDevice(t.model.get(), t.device);
  auto step = LoadModelFromCheckpoint(f.checkpoint, f.arch, f.dataset, t.model.get());
  if (!step.ok()) return Bad(step.status().message());
  t.step = *step;
  return t;
}

// Rank 0: the ranked table, PREFIX.csv, PREFIX.json, PREFIX.png; then the partial file goes.
Status WriteOutputs(const Flags& f, const cpd::runtime::FormatSearchOptions& o,
                    const std::vector<std::string>& layers, std::vector<CandidateResult> ranked) {
  using namespace cpd::runtime;
  const SiteSet by = RankingSite(o.indicator.sites);
  std::stable_sort(ranked.begin(), ranked.end(), [by](const auto& a, const auto& b) {
    return a.mean[int(by)] < b.mean[int(by)];
  });
  PrintTable(ranked, layers, by, f.top);
  std::string csv = "rank," + ResultsCsvHeader(layers, o.indicator.sites) + "\n";
  for (size_t i = 0; i < ranked.size(); ++i) {
    csv += std::to_string(i + 1) + "," + ResultCsvRow(ranked[i], o.indicator.sites) + "\n";
  }
  nlohmann::json settings = nlohmann::json::parse(o.settings);
  settings["checkpoint"] = f.checkpoint;
  const nlohmann::json doc = ToJson(ranked, layers, o.indicator.sites, settings);
  CPD_RETURN_IF_ERROR(cpd::launcher::WriteFileAtomically(f.out + ".csv", csv));
  CPD_RETURN_IF_ERROR(cpd::launcher::WriteFileAtomically(f.out + ".json", Dump(doc, 1)));
  std::string wrote = f.out + ".csv and " + f.out + ".json";
  if (!f.no_plot) {
    CPD_ASSIGN_OR_RETURN(
        const std::string script,
        cpd::launcher::FindScript("format_search_plot.py", "CPD_FORMAT_SEARCH_PLOT_SCRIPT",
                                  {CPD_FORMAT_SEARCH_PLOT_SCRIPT,
                                   cpd::launcher::ExecutableDir() + "/format_search_plot.py"}));
    const char* py_env = std::getenv("CPD_PYTHON");
    const std::string python = py_env != nullptr && *py_env ? py_env : CPD_FORMAT_SEARCH_PYTHON;
    // The script writes a temporary that is renamed over PREFIX.png only when whole.
    const std::string tmp_png = f.out + ".tmp.png";
    const Status plotted =
        cpd::launcher::RunPythonScript(python, script, {"--in", f.out + ".json", "--out", tmp_png});
    if (!plotted.ok() || std::rename(tmp_png.c_str(), (f.out + ".png").c_str()) != 0) {
      std::remove(tmp_png.c_str());
      return Status::IoError("plot: " +
                             (plotted.ok() ? "cannot write " + f.out + ".png" : plotted.message()));
    }
    wrote += " and " + f.out + ".png";
  }
  std::printf("wrote %s\n", wrote.c_str());
  if (std::remove(o.partial_path.c_str()) != 0) {
    std::fprintf(stderr, "%s: warning: cannot remove %s\n", kTool, o.partial_path.c_str());
  }
  return Status::Ok();
}

Status Search(const Flags& f, cpd::comm::Communicator* comm) {
  using namespace cpd::runtime;
  CPD_ASSIGN_OR_RETURN(FormatSearchOptions o, SearchOptions(f));
  const int threads = f.threads > 0 ? f.threads : omp_get_num_procs();
  omp_set_num_threads(threads);
  openblas_set_num_threads(threads);
  CPD_ASSIGN_OR_RETURN(Trained t, LoadTrained(f));
  // The partial file is bound to the checkpoint's contents, not its path: a file swapped under
  // the same name must not mix two models' rows.
  CPD_ASSIGN_OR_RETURN(const cpd::runtime::CheckpointId id,
                       cpd::runtime::ReadCheckpointId(f.checkpoint));
  char crc[16];
  std::snprintf(crc, sizeof crc, "0x%08x", id.crc32);
  nlohmann::json settings = nlohmann::json::parse(o.settings);
  settings["checkpoint_crc32"] = crc;
  settings["checkpoint_bytes"] = id.bytes;
  o.settings = Dump(settings);
  const bool lead = comm->rank() == 0;
  if (lead && o.progress) {
    std::printf(
        "%s: %zu candidate(s) x %lld batch(es) of %lld, sites %s, %d rank(s) x %d "
        "thread(s), checkpoint %s (step %lld)\n",
        kTool, o.candidates.size(), static_cast<long long>(o.batches),
        static_cast<long long>(o.batch_size), f.sites.c_str(), comm->size(), threads,
        f.checkpoint.c_str(), static_cast<long long>(t.step));
    std::fflush(stdout);
  }
  CPD_ASSIGN_OR_RETURN(std::vector<CandidateResult> results,
                       RunFormatSearch(t.model.get(), t.device, t.train, comm, o));
  if (!lead) return Status::Ok();
  std::vector<std::string> layers;
  for (Layer* l : t.model->Flatten()) {
    if (l->Quantizable()) layers.push_back(l->name());
  }
  return WriteOutputs(f, o, layers, std::move(results));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "cpd-format-search: rank candidate number formats for a trained model by the "
      "gradient-angle indicator (Lee, Park, Jeon, ICLR 2022): the angle between the fp32 weight "
      "gradients and those computed with the activations (A), the errors (E) or both quantised "
      "to the candidate, averaged over N mini-batches. Smaller is better."};
  app.set_version_flag("--version", std::string(kTool) + " " + CPD_VERSION);
  Flags f;
  AddFlags(&app, &f);
  if (const int code = cpd::launcher::ParseArgs(app, argc, argv, kTool); code >= 0) return code;
  f.bits_given = app.count("--bits") > 0;
  f.candidates_file_given = app.count("--candidates-file") > 0;
  for (const char* flag : kLanguageModelFlags) {
    if (f.lm_flag_given.empty() && app.count(flag) > 0) f.lm_flag_given = flag;
  }
  std::unique_ptr<cpd::comm::Communicator> comm = cpd::launcher::MakeWorldOrExit(kTool, f.comm);
  // Layers throw on CUDA failures; the job still ends as one failure.
  Status s;
  try {
    s = Search(f, comm.get());
  } catch (const std::exception& e) {
    s = Status::Internal(e.what());
  }
  return s.ok() ? 0 : cpd::launcher::EndFailedJob(kTool, s, std::move(comm));
}
