#include "launcher/study/plan.h"

#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <unordered_set>

#include "runtime/train/train_options.h"

namespace cpd::launcher::study {

namespace {

// More runs than any study means to run; the bound keeps a mistyped grid (or a hostile file)
// from planning for minutes and filling memory before the first line.
constexpr double kMaxRuns = 100000;

// Longer names would not fit a file name with room for the coordinator's job name prefix.
constexpr size_t kMaxNameLength = 120;

bool Excluded(const Study& s, const std::vector<std::string>& labels, long long seed) {
  for (const Exclusion& e : s.exclude) {
    bool all = true;
    for (const auto& [key, value] : e.match) {
      if (key == "seed") {
        all = all && value == std::to_string(seed);
        continue;
      }
      for (size_t a = 0; a < s.axes.size(); ++a) {
        if (s.axes[a].name == key) all = all && labels[a] == value;
      }
    }
    if (all) return true;
  }
  return false;
}

// One key's contribution to the run's flags: "workers" becomes --emulate-ranks W / ranks, a
// false boolean is left out.
void AddFlag(const Study& s, const std::string& key, const FlagValue& v, bool boolean,
             PlannedRun* r) {
  if (key == kWorkersKey) {
    r->flags.push_back({"emulate-ranks", {std::to_string(std::stoll(v[0]) / s.ranks)}});
    r->boolean.push_back(false);
  } else if (!boolean || v[0] == "true") {
    r->flags.push_back({key, v});
    r->boolean.push_back(boolean);
  }
}

PlannedRun MakeRun(const Study& s, const std::vector<size_t>& at, long long seed) {
  PlannedRun r;
  r.seed = seed;
  for (size_t i = 0; i < s.base.size(); ++i) {
    AddFlag(s, s.base[i].key, s.base[i].values, s.base_boolean[i], &r);
  }
  for (size_t a = 0; a < s.axes.size(); ++a) {
    const Axis& axis = s.axes[a];
    const FlagValue& v = axis.values[at[a]];
    r.labels.push_back(ValueLabel(v, axis.boolean));
    r.name += axis.name + "_" + r.labels.back() + ".";
    AddFlag(s, axis.name, v, axis.boolean, &r);
  }
  r.name += "seed_" + std::to_string(seed);
  r.flags.push_back({"seed", {std::to_string(seed)}});
  r.boolean.push_back(false);
  return r;
}

// cpd-train's option set, built once and reset between runs (building it is most of the cost
// of a check, and a 10,000-run plan checks every run).
class RunChecker {
 public:
  RunChecker() { AddTrainOptions(&app_, &o_, &f_); }

  // The run's flags through cpd-train's own parser and checks, and the global batch against its
  // workers (ranks x emulate-ranks), as cpd-train would find them at start-up.
  Status Check(const Study& s, const PlannedRun& r) {
    for (CLI::Option* opt : app_.get_options()) opt->clear();
    o_ = runtime::TrainOptions();  // the options keep their addresses: the app stays bound
    f_ = TrainFlags();
    const std::string origin = s.path + ": run " + r.name;
    CPD_RETURN_IF_ERROR(ApplyConfigEntries(app_, r.flags, origin));
    const Status applied = ApplyTrainFlags(app_, &f_, &o_);
    if (!applied.ok()) return Status::InvalidArgument(origin + ": " + applied.message());
    if (o_.emulate_ranks < 1) {
      return Status::InvalidArgument(origin + ": emulate-ranks must be >= 1");
    }
    if (o_.global_batch > 0) {
      const Status split =
          runtime::CheckGlobalBatchSplit(o_.global_batch, s.ranks, o_.emulate_ranks);
      if (!split.ok()) return Status::InvalidArgument(origin + ": " + split.message());
    }
    return Status::Ok();
  }

 private:
  CLI::App app_;
  TrainFlags f_;
  runtime::TrainOptions o_;
};

// The next combination of axis value indices (the last axis fastest); false after the last.
bool Next(const Study& s, std::vector<size_t>* at) {
  for (size_t a = s.axes.size(); a-- > 0;) {
    if (++(*at)[a] < s.axes[a].values.size()) return true;
    (*at)[a] = 0;
  }
  return false;
}

}  // namespace

Result<std::vector<PlannedRun>> ExpandPlan(const Study& study) {
  double grid = double(study.seeds.size());
  for (const Axis& a : study.axes) grid *= double(a.values.size());
  if (grid > kMaxRuns) {
    char n[32];
    std::snprintf(n, sizeof n, "%.0f", grid);
    return Status::InvalidArgument(study.path + ": the grid has " + n +
                                   " runs (before exclude); "
                                   "at most 100000 in one study: split it");
  }
  std::vector<PlannedRun> runs;
  std::unordered_set<std::string> names;
  std::vector<size_t> at(study.axes.size(), 0);
  RunChecker checker;
  do {
    for (long long seed : study.seeds) {
      PlannedRun r = MakeRun(study, at, seed);
      if (Excluded(study, r.labels, seed)) continue;
      if (r.name.size() > kMaxNameLength) {
        return Status::InvalidArgument(
            study.path + ": run " + r.name + ": the name is longer than " +
            std::to_string(kMaxNameLength) + " characters; use shorter values");
      }
      if (!names.insert(r.name).second) {
        return Status::InvalidArgument(study.path + ": run " + r.name +
                                       ": two runs have this name (values that differ only in "
                                       "characters a name cannot hold)");
      }
      CPD_RETURN_IF_ERROR(checker.Check(study, r));
      r.index = runs.size();
      runs.push_back(std::move(r));
    }
  } while (Next(study, &at));
  if (runs.empty()) {
    return Status::InvalidArgument(study.path + ": exclude: every run of the grid is excluded");
  }
  return runs;
}

RunPaths PathsOf(const std::string& out_dir, const std::string& run_name) {
  RunPaths p;
  p.dir = out_dir + "/runs/" + run_name;
  p.config = p.dir + "/config.yaml";
  p.cmd = p.dir + "/cmd.txt";
  p.metrics = p.dir + "/metrics.jsonl";
  p.log = p.dir + "/log.txt";
  p.checkpoints = p.dir + "/checkpoints";
  p.state = p.dir + "/state.json";
  p.lock = p.dir + "/.lock";
  return p;
}

std::vector<std::string> RunCommand(const Study& study, const PlannedRun& run,
                                    const LaunchSpec& launch, bool inline_flags) {
  std::vector<std::string> argv;
  if (launch.srun) {
    // Slurm's own PMIx starts the ranks inside the array task's allocation (--ntasks = R).
    argv = {"srun", "--mpi=pmix", "-n", std::to_string(study.ranks)};
  } else if (study.ranks > 1) {
    argv = {"mpirun", "-np", std::to_string(study.ranks)};
    // Open MPI refuses root without the first; the second lets R exceed the cores (tests, CI).
    if (::geteuid() == 0) argv.insert(argv.end(), {"--allow-run-as-root", "--oversubscribe"});
  }
  argv.push_back(launch.cpd_train);
  const RunPaths p = PathsOf(launch.out_dir, run.name);
  if (inline_flags) {
    for (size_t i = 0; i < run.flags.size(); ++i) {
      argv.push_back("--" + run.flags[i].key);
      if (!run.boolean[i])
        argv.insert(argv.end(), run.flags[i].values.begin(), run.flags[i].values.end());
    }
  } else {
    argv.insert(argv.end(), {"--config", p.config});
  }
  argv.insert(argv.end(),
              {"--resume", "auto", "--checkpoint-dir", p.checkpoints, "--metrics-out", p.metrics});
  if (!launch.coordinator.empty()) {
    // --study is cpd-train's from the coordinator's study support on; only passed with a
    // coordinator, so runs without one work with any cpd-train.
    argv.insert(argv.end(), {"--coordinator", launch.coordinator, "--job-name",
                             study.name + "." + run.name, "--study", study.name});
  }
  return argv;
}

std::string ConfigYaml(const Study& study, const PlannedRun& run) {
  YAML::Emitter out;
  out << YAML::Comment("cpd-study " + study.name + ", run " + run.name);
  out << YAML::BeginMap;
  for (const ConfigEntry& e : run.flags) {
    out << YAML::Key << e.key << YAML::Value;
    if (e.values.size() == 1) {
      out << YAML::DoubleQuoted << e.values[0];
    } else {
      out << YAML::Flow << YAML::BeginSeq;
      for (const auto& v : e.values) out << YAML::DoubleQuoted << v;
      out << YAML::EndSeq;
    }
  }
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::string ShellLine(const std::vector<std::string>& argv) {
  std::string line;
  for (const std::string& a : argv) {
    if (!line.empty()) line += ' ';
    const bool plain = !a.empty() && a.find_first_not_of(
                                         "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                         "0123456789._-/:=,+@%") == std::string::npos;
    if (plain) {
      line += a;
      continue;
    }
    line += '\'';
    for (char c : a) line += c == '\'' ? std::string("'\\''") : std::string(1, c);
    line += '\'';
  }
  return line;
}

}  // namespace cpd::launcher::study
