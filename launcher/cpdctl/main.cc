// cpdctl: the operator's command line for cpd-coordinator (OperatorService of cpd.v1). Lists
// jobs and a study's runs, shows a job's status and per-layer statistics, follows it live, reads
// and changes its precision schedule (read, edit, write back with expected_version, so
// concurrent edits are refused rather than lost), exports its history as CSV and plots it
// (scripts/cpdctl_plot.py on Debian's matplotlib).
//
// Exit codes: 0 success; 1 the coordinator could not be reached or refused the call, an unknown
// job, a file that could not be written; 2 a usage error (including a bad format spec, which is
// checked locally before any call).
//
// This file declares the commands and their options and calls the one named; the commands are
// in commands.h.
#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cpd/config.h"
#include "launcher/cli.h"
#include "launcher/cpdctl/client.h"
#include "launcher/cpdctl/commands.h"
#include "launcher/cpdctl/output.h"
#include "launcher/cpdctl/schedule_edits.h"

namespace cpd::ctl {
namespace {

CLI::App* AddLayersCommand(CLI::App* app, LayersArgs* la) {
  auto* layers = app->add_subcommand(
      "layers",
      "Per-layer, per-site statistics of one report: format, bits, APS shift (COMM rows), "
      "max|x|, saturated and flushed fractions, relative error, hysteresis flips (W), "
      "non-finite count");
  layers->add_option("JOB", la->job, "Job name or id")->required();
  auto* step_opt = layers->add_option("--step", la->step,
                                      "The report at this step (default: the "
                                      "latest with layer statistics)");
  auto* from_opt = layers->add_option("--from", la->from,
                                      "First step of a range (one table, a "
                                      "STEP column)");
  auto* to_opt = layers->add_option("--to", la->to, "Last step of a range (default: the end)");
  step_opt->excludes(from_opt)->excludes(to_opt);
  step_opt->check(cpd::launcher::IntegerAtLeast(0));
  from_opt->check(cpd::launcher::IntegerAtLeast(0));
  to_opt->check(cpd::launcher::IntegerAtLeast(0));
  layers
      ->add_option("--sort", la->sort,
                   "Order rows by: layer (name, then site), site, or largest first: max, "
                   "saturated, flushed, error, shift (default: the model's order)")
      ->check(cpd::launcher::OneOf(LayerSortKeys()));
  layers->add_option("--site", la->site, "Only this site: W, A, E, G or COMM")
      ->check([](const std::string& s) {
        return ParseSite(s) ? std::string() : "expected W, A, E, G or COMM";
      });
  layers->add_option("--top", la->top, "At most K rows per report (after --sort)")
      ->check(cpd::launcher::IntegerAtLeast(1));
  layers
      ->add_option("--limit", la->limit,
                   "At most this many reports of a range (default: the coordinator's cap)")
      ->check(cpd::launcher::IntegerAtLeast(1));
  return layers;
}

CLI::App* AddWatchCommand(CLI::App* app, WatchArgs* wa) {
  auto* watch = app->add_subcommand(
      "watch",
      "Follow a job live: on a terminal the status block (and --layers table) is redrawn in "
      "place; otherwise one line per report (--json: one JSON object per line). Stops on "
      "Ctrl-C, after --count reports, or when the job finishes");
  watch->add_option("JOB", wa->job, "Job name or id")->required();
  watch->add_flag("--layers", wa->layers, "Also receive and show the per-layer table");
  watch->add_option("--count", wa->count, "Stop after N reports (default: never)")
      ->check(cpd::launcher::IntegerAtLeast(1));
  watch
      ->add_option("--interval", wa->interval_s,
                   "On a terminal, redraw at least every S seconds (the report age ticks)")
      ->check(cpd::launcher::PositiveNumber())
      ->capture_default_str();
  return watch;
}

// The flags of `schedule set` as parsed; the optional edits are those whose flag was given.
struct ScheduleSetFlags {
  std::string job;
  ScheduleEdits edits;
  std::vector<int> cyclic_bits;
  int cyclic_periods = 0, grad_bits = 0;
  std::string keep_fp32, hysteresis;
  int64_t from_step = 0;
  uint64_t expect_version = 0;
  CLI::Option *cyclic_bits_opt = nullptr, *cyclic_periods_opt = nullptr, *grad_bits_opt = nullptr,
              *keep_fp32_opt = nullptr, *hysteresis_opt = nullptr, *from_step_opt = nullptr;

  ScheduleEdits Edits() const {
    ScheduleEdits e = edits;
    if (cyclic_bits_opt->count() > 0) {
      e.cyclic_bits = std::pair<int, int>{cyclic_bits[0], cyclic_bits[1]};
    }
    if (cyclic_periods_opt->count() > 0) e.cyclic_periods = cyclic_periods;
    if (grad_bits_opt->count() > 0) e.grad_bits = grad_bits;
    if (keep_fp32_opt->count() > 0) e.keep_fp32 = keep_fp32;
    if (hysteresis_opt->count() > 0) e.hysteresis = hysteresis;
    if (from_step_opt->count() > 0) e.from_step = from_step;
    return e;
  }
};

CLI::App* AddScheduleSetCommand(CLI::App* schedule, ScheduleSetFlags* f) {
  auto* sset = schedule->add_subcommand(
      "set",
      "Change the schedule: read it, apply these edits, write it back as a new version "
      "(refused if someone changed it in between). Format specs are checked before any call");
  sset->add_option("JOB", f->job, "Job name or id")->required();
  f->cyclic_bits_opt = sset->add_option("--cyclic-bits", f->cyclic_bits,
                                        "CPT: MIN MAX forward bits (W, A as uint<b>:minmax), 2..16")
                           ->expected(2);
  f->cyclic_periods_opt =
      sset->add_option("--cyclic-periods", f->cyclic_periods,
                       "CPT: cosine cycles over the run (default when CPT is new: 32)");
  f->grad_bits_opt = sset->add_option("--grad-bits", f->grad_bits, "CPT: backward (E) bits, 2..16");
  auto* st =
      sset->add_flag("--static", f->edits.make_static, "Drop CPT (cyclic bits and grad bits)");
  st->excludes(f->cyclic_bits_opt)->excludes(f->cyclic_periods_opt)->excludes(f->grad_bits_opt);
  sset->add_option("--format", f->edits.formats,
                   "SITE=SPEC (SITE W, A, E or G: that site's global format) or LAYER.SITE=SPEC "
                   "(a per-layer override; LAYER may contain dots). Repeatable. Specs: see "
                   "cpd-quant --help")
      ->allow_extra_args(false);
  sset->add_option("--rounding", f->edits.roundings,
                   "SITE=MODE: rounding of a site's global format (nearest, stochastic, zero). "
                   "Repeatable")
      ->allow_extra_args(false);
  sset->add_option("--drop-override", f->edits.drop_overrides,
                   "LAYER.SITE: remove a per-layer override. Repeatable")
      ->allow_extra_args(false);
  f->keep_fp32_opt = sset->add_option("--keep-fp32", f->keep_fp32,
                                      "Comma-separated layers kept fp32 at every site: first, "
                                      "last or names; 'none' keeps none (replaces the list)");
  sset->add_option("--allreduce-layer-format", f->edits.allreduce_layers,
                   "NAME=SPEC: layer NAME's gradient format in the emulate/packed all-reduce "
                   "(hybrid precision; NAME a layer, first, last or bn; SPEC a format, fp32, or "
                   "default to drop it); none drops them all. Repeatable")
      ->allow_extra_args(false);
  f->hysteresis_opt =
      sset->add_option("--hysteresis", f->hysteresis, "on | off: hysteresis rounding of W")
          ->check(cpd::launcher::OneOf({"on", "off"}));
  f->from_step_opt = sset->add_option("--from-step", f->from_step,
                                      "First step of the new schedule (default: the next step)")
                         ->check(cpd::launcher::IntegerAtLeast(0));
  sset->add_option("--expect-version", f->expect_version,
                   "Refuse unless the job's schedule is at this version (default: the version "
                   "just read)")
      ->check(cpd::launcher::IntegerAtLeast(1));
  return sset;
}

// export and plot: JOB, an output file and a range of steps.
CLI::App* AddRangeCommand(CLI::App* app, const char* name, const std::string& description,
                          const char* out_flag, const char* out_help, RangeArgs* a) {
  auto* cmd = app->add_subcommand(name, description);
  cmd->add_option("JOB", a->job, "Job name or id")->required();
  cmd->add_option(out_flag, a->out, out_help)->required();
  cmd->add_option("--from", a->from, "First step (default: 0)")
      ->check(cpd::launcher::IntegerAtLeast(0));
  cmd->add_option("--to", a->to, "Last step (default: the end)")
      ->check(cpd::launcher::IntegerAtLeast(0));
  return cmd;
}

// CLI11 would call an unknown command a missing one; name it instead.
void RefuseUnknownCommand(CLI::App& app, int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--coordinator" || arg == "--token-file" || arg == "--tls-ca" ||
        arg == "--timeout") {
      ++i;  // its value
      continue;
    }
    if (arg.empty() || arg[0] == '-') continue;
    try {
      app.get_subcommand_ptr(arg);
    } catch (const CLI::OptionNotFound&) {
      Usage("unknown command " + cpd::launcher::QuoteForMessage(arg) +
            " (commands: jobs, study, status, layers, watch, schedule, export, plot)");
    }
    break;
  }
}

}  // namespace
}  // namespace cpd::ctl

int main(int argc, char** argv) {
  using namespace cpd::ctl;  // NOLINT: this file is cpdctl
  CLI::App app{
      "cpdctl: the operator's command line for cpd-coordinator: jobs, studies, status, per-layer "
      "statistics, live watch, precision schedules, CSV export and plots.\nJOB is a job name or "
      "its numeric id."};
  app.set_version_flag("--version", std::string("cpdctl ") + CPD_VERSION);
  Globals g;
  AddGlobals(&app, &g);

  auto* jobs = app.add_subcommand("jobs", "List the coordinator's jobs");
  std::string study_name;
  auto* study = app.add_subcommand(
      "study",
      "A study's runs (cpd-train --study NAME): run, state, step/total, epoch, latest test "
      "accuracy, loss, last report age, then the runs per state. Without NAME: the studies "
      "known, with their runs running, stale and finished");
  study->add_option("NAME", study_name, "Study name (default: list the studies)");
  std::string status_job;
  auto* status = app.add_subcommand(
      "status",
      "A job's step/total, epoch, bits in force, schedule, ranks alive, last report age, loss, "
      "accuracies, images/s, reports stored and dropped, skipped steps");
  status->add_option("JOB", status_job, "Job name or id")->required();
  LayersArgs la;
  auto* layers = AddLayersCommand(&app, &la);
  WatchArgs wa;
  auto* watch = AddWatchCommand(&app, &wa);
  auto* schedule = app.add_subcommand("schedule", "Read or change a job's precision schedule");
  std::string get_job;
  bool history = false;
  auto* sget = schedule->add_subcommand("get", "The schedule in force (and --history)");
  sget->add_option("JOB", get_job, "Job name or id")->required();
  sget->add_flag("--history", history, "Also list every version, oldest first");
  ScheduleSetFlags set;
  auto* sset = AddScheduleSetCommand(schedule, &set);
  RangeArgs ea, pa;
  auto* exp = AddRangeCommand(
      &app, "export",
      "Write the job's stored reports as CSV: one row per report and layer/site (a report "
      "without layer rows: one row), with a header; written atomically",
      "--csv", "Output file ('-': stdout)", &ea);
  auto* plot = AddRangeCommand(
      &app, "plot",
      "Plot the job's history to a PNG (Debian's python3-matplotlib): forward bits and schedule "
      "version, loss, per-layer APS shift and per-layer flushed (underflow) fraction over steps",
      "--out", "Output FILE.png (written atomically)", &pa);

  for (CLI::App* sub : {jobs, study, status, layers, watch, schedule, sget, sset, exp, plot}) {
    AddGlobals(sub, &g);
    sub->footer(kExitCodes);
  }
  schedule->require_subcommand(1);
  app.require_subcommand(1);
  app.footer(std::string(kExitCodes) +
             "\nEnvironment: CPD_COORDINATOR, CPD_TOKEN_FILE (defaults of --coordinator, "
             "--token-file); CPD_PYTHON, CPD_PLOT_SCRIPT (plot). Each command has --help.");

  RefuseUnknownCommand(app, argc, argv);
  if (const int code = cpd::launcher::ParseArgs(app, argc, argv, kTool); code >= 0) return code;
  for (CLI::App* a : {&app, jobs, study, status, layers, watch, schedule, sget, sset, exp, plot}) {
    g.timeout_given = g.timeout_given || a->get_option("--timeout")->count() > 0;
  }

  if (*jobs) return RunJobs(g);
  if (*study) return RunStudy(g, study_name);
  if (*status) return RunStatus(g, status_job);
  if (*layers) return RunLayers(g, la);
  if (*watch) return RunWatch(g, wa);
  if (*sget) return RunScheduleGet(g, get_job, history);
  if (*sset) return RunScheduleSet(g, set.job, set.Edits(), set.expect_version);
  if (*exp) return RunExport(g, ea);
  if (*plot) return RunPlot(g, pa);
  Usage("no command (try --help)");
}
