// cpd-study: a grid of cpd-train runs (global batch x all-reduce format x APS x workers x seeds
// x ...) described by one YAML study file, as one command: plan (the runs and their commands),
// run (each in its own directory under <out>/runs/, K at a time, resumable), status, and report
// (CSV tables, a Markdown summary and plots). The logic lives in launcher/study/.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cpd/config.h"
#include "launcher/cli.h"
#include "launcher/common.h"
#include "launcher/files.h"
#include "launcher/study/out_dir.h"
#include "launcher/study/plan.h"
#include "launcher/study/report.h"
#include "launcher/study/run_state.h"
#include "launcher/study/runner.h"
#include "launcher/study/slurm.h"
#include "launcher/study/study_file.h"

namespace {

namespace study = cpd::launcher::study;
using cpd::launcher::kUsageError;

constexpr const char* kTool = "cpd-study";

[[noreturn]] void Fail(const std::string& msg, int code = kUsageError) {
  cpd::launcher::FailWith(kTool, msg, code);
}

struct Flags {
  std::string study_path, out, launcher = "local", coordinator, cpd_train, reference;
  int parallel = 1;
  std::string progress = "auto";  // run --launcher local: auto | lines | off
  long long index = -1;
  bool json = false, retry_failed = false, no_plot = false, wait = false, parallel_given = false;
  std::vector<std::string> sbatch_args;
};

// The study, its runs and where they go; exits 2 on any problem with the file.
struct Loaded {
  study::Study study;
  std::vector<study::PlannedRun> runs;
  std::string out;
};

Loaded Load(const Flags& f) {
  Loaded l;
  auto s = study::LoadStudy(f.study_path);
  if (!s.ok()) Fail(s.status().message());
  l.study = std::move(s).value();
  auto runs = study::ExpandPlan(l.study);
  if (!runs.ok()) Fail(runs.status().message());
  l.runs = std::move(runs).value();
  l.out = f.out.empty() ? "studies/" + l.study.name : f.out;
  while (l.out.size() > 1 && l.out.back() == '/') l.out.pop_back();
  return l;
}

// Before `run`, `run-one` and `report` write anything: the output folder is cpd-study's
// (launcher/study/out_dir.h), or nothing is written.
void ClaimOut(const Loaded& l) {
  const cpd::Status s = study::ClaimOutDir(l.out, l.study.name);
  if (!s.ok()) Fail(s.message(), s.code() == cpd::Status::Code::kInvalidArgument ? kUsageError : 1);
}

// cpd-train: --cpd-train, else the one next to this executable.
std::string CpdTrain(const Flags& f, bool must_exist) {
  const std::string path =
      f.cpd_train.empty() ? cpd::launcher::ExecutableDir() + "/cpd-train" : f.cpd_train;
  if (must_exist && ::access(path.c_str(), X_OK) != 0) {
    Fail(f.cpd_train.empty()
             ? "cannot find cpd-train next to cpd-study (" + path + "); give --cpd-train PATH"
             : "--cpd-train " + path + ": not an executable file");
  }
  return path;
}

// What `run` and `run-one` need before anything runs: cpd-train, mpirun, a valid coordinator.
study::RunOptions RunOptionsOf(const Flags& f, const Loaded& l) {
  study::RunOptions o;
  o.launch.cpd_train = CpdTrain(f, true);
  o.launch.out_dir = l.out;
  o.launch.coordinator = f.coordinator;
  o.retry_failed = f.retry_failed;
  if (!f.coordinator.empty()) {
    std::string host;
    int port = 0;
    if (!cpd::launcher::SplitHostPort(f.coordinator, &host, &port)) {
      Fail("--coordinator '" + f.coordinator + "': expected HOST:PORT, e.g. 127.0.0.1:50051");
    }
    for (const auto& r : l.runs) {
      if (l.study.name.size() + 1 + r.name.size() > 128) {
        Fail("--coordinator: the job name " + l.study.name + "." + r.name +
             " is longer than 128 characters; shorten the study name or the values");
      }
    }
  }
  o.launch.srun = f.launcher == "slurm";
  if (o.launch.srun) {
    if (study::FindOnPath("srun").empty()) Fail("--launcher slurm: srun is not on PATH", 1);
  } else if (l.study.ranks > 1 && study::FindOnPath("mpirun").empty()) {
    Fail("ranks " + std::to_string(l.study.ranks) + " needs mpirun, which is not on PATH");
  }
  return o;
}

int Plan(const Flags& f) {
  const Loaded l = Load(f);
  study::LaunchSpec launch{CpdTrain(f, false), l.out, ""};
  if (!f.json) {
    for (const auto& r : l.runs) {
      std::printf("%s\t%s\n", r.name.c_str(),
                  study::ShellLine(study::RunCommand(l.study, r, launch, true)).c_str());
    }
    return 0;
  }
  nlohmann::json out = nlohmann::json::array();
  for (const auto& r : l.runs) {
    nlohmann::json axes = nlohmann::json::object(), flags = nlohmann::json::object();
    for (size_t a = 0; a < l.study.axes.size(); ++a) axes[l.study.axes[a].name] = r.labels[a];
    for (size_t i = 0; i < r.flags.size(); ++i) {
      const auto& e = r.flags[i];
      if (r.boolean[i]) {
        flags[e.key] = true;
      } else if (e.values.size() == 1) {
        flags[e.key] = e.values[0];
      } else {
        flags[e.key] = e.values;
      }
    }
    out.push_back({{"index", r.index},
                   {"name", r.name},
                   {"axes", axes},
                   {"seed", r.seed},
                   {"flags", flags},
                   {"dir", study::PathsOf(l.out, r.name).dir},
                   {"command", study::RunCommand(l.study, r, launch, true)}});
  }
  std::printf("%s\n", out.dump(1).c_str());
  return 0;
}

// The batch script of the Slurm launcher: $CPD_STUDY_SBATCH, the source tree's, or a copy
// next to this executable.
std::string SlurmScript() {
  auto script = cpd::launcher::FindScript(
      "cpd_study_array.sbatch", "CPD_STUDY_SBATCH",
      {CPD_STUDY_SBATCH, cpd::launcher::ExecutableDir() + "/cpd_study_array.sbatch"});
  if (!script.ok()) Fail(script.status().message(), 1);
  return *script;
}

int RunOnSlurm(const Flags& f, const Loaded& l) {
  study::SlurmOptions o;
  o.run = RunOptionsOf(f, l);
  o.parallel = f.parallel_given ? f.parallel : 0;
  o.wait = f.wait;
  o.self = cpd::launcher::ExecutableDir() + "/cpd-study";
  o.study_path = f.study_path;
  o.script = SlurmScript();
  o.sbatch_args = f.sbatch_args;
  ClaimOut(l);
  return study::RunSlurm(l.study, l.runs, o);
}

int Run(const Flags& f) {
  const Loaded l = Load(f);
  if (f.launcher == "slurm") return RunOnSlurm(f, l);
  if (f.wait || !f.sbatch_args.empty()) Fail("--wait and --sbatch-arg need --launcher slurm");
  study::LocalOptions o;
  o.run = RunOptionsOf(f, l);
  o.parallel = f.parallel;
  o.progress = f.progress != "off";
  o.self = cpd::launcher::ExecutableDir() + "/cpd-study";
  o.study_path = f.study_path;
  ClaimOut(l);
  return study::RunLocal(l.study, l.runs, o);
}

int RunOne(const Flags& f) {
  const Loaded l = Load(f);
  const study::RunOptions o = RunOptionsOf(f, l);
  if (o.launch.srun) {
    if (auto s = study::CheckSlurmTask(l.study); !s.ok()) Fail(s.message());
  }
  if (f.index < 0 || size_t(f.index) >= l.runs.size()) {
    Fail("--index " + std::to_string(f.index) + ": the plan has runs 0 to " +
         std::to_string(l.runs.size() - 1));
  }
  ClaimOut(l);
  return study::RunOne(l.study, l.runs[size_t(f.index)], o);
}

int Status(const Flags& f) {
  const Loaded l = Load(f);
  return study::PrintStatus(l.study, l.runs, l.out);
}

int Report(const Flags& f) {
  const Loaded l = Load(f);
  study::ReportOptions o;
  o.out_dir = l.out;
  o.reference_glob = f.reference;
  if (!f.no_plot) {
    auto script = cpd::launcher::FindScript(
        "study_plot.py", "CPD_STUDY_PLOT_SCRIPT",
        {CPD_STUDY_PLOT_SCRIPT, cpd::launcher::ExecutableDir() + "/study_plot.py"});
    if (!script.ok()) Fail(script.status().message() + " (or --no-plot)", 1);
    o.script = *script;
    const char* py = std::getenv("CPD_PYTHON");
    o.python = py != nullptr && *py ? py : CPD_STUDY_PYTHON;
  }
  ClaimOut(l);
  auto wrote = study::WriteReport(l.study, l.runs, o);
  if (!wrote.ok()) {
    Fail(wrote.status().message(),
         wrote.status().code() == cpd::Status::Code::kInvalidArgument ? kUsageError : 1);
  }
  for (const auto& p : *wrote) std::printf("wrote %s\n", p.c_str());
  return 0;
}

CLI::App* Command(CLI::App& app, const char* name, const char* what, Flags* f) {
  CLI::App* c = app.add_subcommand(name, what);
  c->add_option("study", f->study_path, "The study file (YAML)")->required();
  c->add_option("--out", f->out, "Output directory (default: studies/<name>)");
  return c;
}

void AddRunFlags(CLI::App* c, Flags* f) {
  c->add_option("--cpd-train", f->cpd_train, "cpd-train to run (default: next to cpd-study)");
  c->add_option("--coordinator", f->coordinator,
                "HOST:PORT of a cpd-coordinator: each run reports to it as job <study>.<run>");
  c->add_flag("--retry-failed", f->retry_failed,
              "Run failed runs again (they resume from their checkpoints)");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "cpd-study: a grid of cpd-train runs from one YAML study file: plan, run (resumable, K at "
      "a time), status, report (CSV, Markdown, plots)."};
  app.set_version_flag("--version", std::string(kTool) + " " + CPD_VERSION);
  app.require_subcommand(1);
  Flags f;
  CLI::App* plan = Command(app, "plan", "The runs, one per line: name and cpd-train command", &f);
  plan->add_flag("--json", f.json, "A JSON array of the runs instead");
  CLI::App* run = Command(app, "run", "Run every run that is not done", &f);
  run->add_option("--launcher", f.launcher,
                  "Where the runs run: local (this machine, mpirun) | slurm (one job array; "
                  "each task starts its run's ranks with srun --mpi=pmix)")
      ->capture_default_str()
      ->check(CLI::IsMember({"local", "slurm"}));
  CLI::Option* parallel =
      run->add_option("--parallel", f.parallel,
                      "Runs at a time (slurm: array tasks at a time, default as Slurm schedules)")
          ->capture_default_str()
          ->check(cpd::launcher::IntegerIn(1, 1024));
  run->add_option("--progress", f.progress,
                  "auto | lines | off: a line as each run starts and ends, with the counts and "
                  "an ETA (plain lines in a terminal too; off keeps failures and the summary)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "lines", "off"}));
  run->add_flag("--wait", f.wait, "slurm: wait until the array has ended, then show the status");
  run->add_option("--sbatch-arg", f.sbatch_args,
                  "slurm: an sbatch option for the array, e.g. --sbatch-arg=--partition=gpu "
                  "--sbatch-arg=--gpus-per-task=1 (repeatable)")
      ->allow_extra_args(false);
  AddRunFlags(run, &f);
  CLI::App* one =
      Command(app, "run-one", "Run the plan's run number --index (a launcher's task)", &f);
  one->add_option("--launcher", f.launcher,
                  "How the ranks start: local (mpirun) | slurm (srun, inside an allocation)")
      ->capture_default_str()
      ->check(CLI::IsMember({"local", "slurm"}));
  one->add_option("--index", f.index, "The run's index in the plan (0-based)")
      ->required()
      ->check(cpd::launcher::IntegerAtLeast(0));
  AddRunFlags(one, &f);
  CLI::App* status = Command(app, "status", "Each run's state, then the totals", &f);
  CLI::App* report =
      Command(app, "report", "Tables and plots of the runs' metrics in <out>/report", &f);
  report->add_option("--reference", f.reference,
                     "Glob of run names whose mean final test accuracy every row is compared to");
  report->add_flag("--no-plot", f.no_plot, "Write the tables only");
  if (const int code = cpd::launcher::ParseArgs(app, argc, argv, kTool); code >= 0) return code;
  if (plan->parsed()) return Plan(f);
  f.parallel_given = parallel->count() > 0;
  if (run->parsed()) return Run(f);
  if (one->parsed()) return RunOne(f);
  if (status->parsed()) return Status(f);
  if (report->parsed()) return Report(f);
  return kUsageError;
}
