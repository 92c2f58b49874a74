#include "launcher/train_flags.h"

#include <yaml-cpp/yaml.h>

#include <string>
#include <vector>

#include "comm/gradient_allreduce.h"
#include "cpd/format.h"
#include "cpd/progress.h"
#include "launcher/cli.h"
#include "launcher/common.h"

namespace cpd::launcher {

using runtime::TrainOptions;

Status ApplyConfigEntries(CLI::App& app, const std::vector<ConfigEntry>& entries,
                          const std::string& origin) {
  auto bad = [&](const std::string& m) { return Status::InvalidArgument(origin + ": " + m); };
  for (const ConfigEntry& e : entries) {
    if (e.key == "config") return bad("'config' cannot be nested");
    CLI::Option* opt = nullptr;
    try {
      opt = app.get_option("--" + e.key);
    } catch (const CLI::OptionNotFound&) {
      return bad("unknown key " + QuoteForMessage(e.key) + " (keys are the long flag names)");
    }
    if (opt->count() > 0) continue;  // the command line wins
    try {
      for (const auto& v : e.values) opt->add_result(v);
      opt->run_callback();
    } catch (const CLI::Error& err) {
      // CLI11 echoes the value, which a YAML scalar may spread over lines: one line here.
      return bad("key '" + e.key + "': " + MessageLine(err.what(), 300));
    }
  }
  return Status::Ok();
}

Result<std::vector<std::string>> FlagValuesOf(const YAML::Node& node) {
  const Status bad = Status::InvalidArgument("expected a scalar or a list of scalars");
  if (node.IsScalar()) return std::vector<std::string>{node.as<std::string>()};
  if (!node.IsSequence()) return bad;
  std::vector<std::string> values;
  for (const auto& item : node) {
    if (!item.IsScalar()) return bad;
    values.push_back(item.as<std::string>());
  }
  return values;
}

// The keys of a YAML mapping onto the options the command line did not give. yaml-cpp reports
// problems by exceptions; each becomes an InvalidArgument naming `origin`.
Status ApplyConfigText(CLI::App& app, const std::string& yaml, const std::string& origin) {
  auto bad = [&](const std::string& m) { return Status::InvalidArgument(origin + ": " + m); };
  std::vector<ConfigEntry> entries;
  try {
    const YAML::Node root = YAML::Load(yaml);
    if (!root.IsMap()) return bad("expected a mapping of option: value");
    for (const auto& kv : root) {
      if (!kv.first.IsScalar()) return bad("every key must be a flag name");
      ConfigEntry e;
      e.key = kv.first.as<std::string>();
      // yaml-cpp keeps every pair of a mapping; the first would silently win.
      for (const ConfigEntry& seen : entries) {
        if (seen.key == e.key) {
          return bad("line " + std::to_string(kv.first.Mark().line + 1) + ": key '" + e.key +
                     "' is given twice (each key once)");
        }
      }
      auto values = FlagValuesOf(kv.second);
      if (!values.ok()) return bad("key '" + e.key + "': " + values.status().message());
      e.values = std::move(values).value();
      entries.push_back(std::move(e));
    }
  } catch (const YAML::Exception& e) {
    return bad(MessageLine(e.what(), 300));
  }
  return ApplyConfigEntries(app, entries, origin);
}

Status ApplyConfigFile(CLI::App& app, const std::string& path) {
  auto text = ReadWholeFile(path);
  if (!text.ok()) return Status::InvalidArgument("--config " + text.status().message());
  return ApplyConfigText(app, *text, "--config " + path);
}

namespace {

Result<cpd::runtime::SiteFormat> CheckSite(const std::string& flag, const std::string& spec,
                                           const std::string& rounding) {
  auto f = cpd::Format::Parse(spec);
  if (!f.ok()) return Status::InvalidArgument(flag + ": " + f.status().message());
  auto r = cpd::ParseRounding(rounding);
  if (!r.ok()) return Status::InvalidArgument(flag + " rounding: " + r.status().message());
  return cpd::runtime::SiteFormat{f->spec(), *r};
}

void AddDataAndModelOptions(CLI::App* app, TrainOptions* o, TrainFlags* f) {
  app->add_option("--dataset", o->dataset,
                  "fashion-mnist | mnist | cifar10 | cifar100 | synthetic | text (byte-level "
                  "over the text files of --data-dir, a file or a folder) | tokens (GPT-2 "
                  "tokens: --data-dir's train.bin and val.bin, nanoGPT's or llm.c's)")
      ->capture_default_str();
  app->add_option("--data-dir", o->data_dir,
                  "Dataset directory (default for fashion-mnist: "
                  "/usr/share/datasets/fashion-mnist; for text: /usr/share/games/fortunes)");
  app->add_option("--arch", o->arch,
                  "mlp | lenet5 | resnet<6n+2> (resnet20, resnet32, ...) | gpt | lstm (language "
                  "models: --dataset text or tokens)")
      ->capture_default_str();
  app->add_option("--n-layer", o->lm.n_layer, "gpt: Transformer blocks; lstm: LSTM layers")
      ->capture_default_str();
  app->add_option("--n-head", o->lm.n_head, "gpt: attention heads (divide --n-embd)")
      ->capture_default_str();
  app->add_option("--n-embd", o->lm.n_embd,
                  "gpt: embedding width; lstm: embedding and hidden width")
      ->capture_default_str();
  app->add_option("--block-size", o->lm.block_size,
                  "Language models: tokens per window (the context; an LSTM's unrolled steps)")
      ->capture_default_str();
  app->add_option("--dropout", o->lm.dropout,
                  "gpt: attention, residual and MLP dropout; lstm: on the embeddings, between "
                  "layers and on the output")
      ->capture_default_str();
  app->add_flag("--untied-head", f->untied_head,
                "Language models: lm_head gets a table of its own (default: tied to wte)");
  app->add_option("--tokens-per-epoch", o->lm.tokens_per_epoch,
                  "Language models: training tokens per epoch (windows x --block-size; default "
                  "0: as many as the training stream holds)")
      ->capture_default_str();
  app->add_option("--in-channels", o->in_channels, "Input channels (default: the dataset's)")
      ->check(IntegerIn(1, 4096));
  app->add_option("--image-size", o->image_size, "Input height/width (default: the dataset's)")
      ->check(IntegerIn(1, 32768));
  app->add_option("--classes", o->classes, "Output classes (default: the dataset's)")
      ->check(IntegerIn(1, 1 << 20));
  app->add_flag("--augment", f->augment, "Random crop (pad 4) + horizontal flip (default: CIFAR)");
  app->add_flag("--no-augment", f->no_augment, "No augmentation");
  app->add_flag("--print-model", o->print_model,
                "Print the layers (names for --layer-format) and exit");
}

void AddOptimisationOptions(CLI::App* app, TrainOptions* o, TrainFlags* f) {
  app->add_option("--epochs", o->epochs, "Training epochs")->capture_default_str();
  app->add_option("--max-steps", o->max_steps, "Stop after this many steps in total (0: all)")
      ->capture_default_str();
  app->add_option("--max-skipped-steps", o->max_skipped_steps,
                  "Stop with an error (exit 3) after this many consecutive steps skipped for "
                  "NaN/Inf gradients (0: never); a NaN/Inf loss or parameter always stops the run")
      ->capture_default_str();
  app->add_option("--batch-size", o->batch_size, "Batch size per worker (see --global-batch)")
      ->capture_default_str();
  app->add_option("--global-batch", o->global_batch,
                  "Global batch, split evenly over ranks x --emulate-ranks workers (default: "
                  "--batch-size per worker)");
  app->add_option("--optimizer", f->optimizer,
                  "sgd | lars | adamw (torch.optim.AdamW: decoupled --weight-decay on weights and "
                  "embeddings, not on biases or norms)")
      ->capture_default_str();
  app->add_option("--lr", o->lr, "Base learning rate")->capture_default_str();
  app->add_option("--momentum", o->momentum, "SGD momentum")->capture_default_str();
  app->add_option("--weight-decay", o->weight_decay,
                  "Weight decay on the params of 2+ dimensions (not on biases, LayerNorm or "
                  "BatchNorm): coupled L2 for sgd/lars, decoupled for adamw (typical 0.01-0.1)")
      ->capture_default_str();
  app->add_flag("--nesterov", o->nesterov, "Nesterov momentum");
  app->add_option("--beta1", o->beta1, "AdamW: decay rate of the first moment, in [0, 1)")
      ->capture_default_str();
  app->add_option("--beta2", o->beta2,
                  "AdamW: decay rate of the second moment, in [0, 1); the default is torch's, "
                  "so a recipe ported from PyTorch trains alike (nanoGPT's GPT-2 recipe sets "
                  "0.95)")
      ->capture_default_str();
  app->add_option("--eps", o->adam_eps, "AdamW: added to sqrt(v), > 0")->capture_default_str();
  app->add_option("--clip-grad-norm", o->clip_grad_norm,
                  "Scale the averaged gradients to at most this global L2 norm before each "
                  "update (torch's clip_grad_norm_; the norm goes into the metrics as grad_norm); "
                  "0: off")
      ->capture_default_str();
  app->add_option("--lars-eta", o->lars_eta, "LARS trust coefficient")->capture_default_str();
  app->add_option("--lars-exclude", f->lars_exclude,
                  "LARS: bias-bn (biases and BatchNorm take no trust ratio and run at lr x "
                  "--lars-excluded-lr-ratio) | none (every param takes the trust ratio)")
      ->capture_default_str();
  app->add_option("--lars-excluded-lr-ratio", o->lars_excluded_lr_ratio,
                  "LARS bias-bn: the biases' and BatchNorm's lr as a fraction of --lr (default "
                  "0.024 = 0.0048/0.2, Barlow Twins)");
  app->add_option("--lr-schedule", f->lr_schedule, "constant | step | cosine (per step)")
      ->capture_default_str();
  app->add_option("--lr-scaling", f->lr_scaling,
                  "Large-batch rule for the base lr: none | linear (lr x B/--lr-base-batch, "
                  "Goyal et al. 2017) | sqrt (lr x sqrt(B/--lr-base-batch), Krizhevsky 2014, "
                  "Hoffer et al. 2017); B is the global batch")
      ->capture_default_str();
  app->add_option("--lr-base-batch", o->lr_base_batch, "The batch at which --lr was tuned")
      ->capture_default_str();
  app->add_option("--warmup-steps", o->warmup_steps, "Linear warm-up steps")->capture_default_str();
  app->add_option("--warmup-epochs", o->warmup_epochs,
                  "Linear warm-up in epochs (x steps per epoch, to the nearest step); excludes "
                  "--warmup-steps");
  app->add_option("--lr-milestones", o->lr_milestones,
                  "Epochs at which 'step' multiplies by gamma");
  app->add_option("--lr-gamma", o->lr_gamma, "Factor of the 'step' schedule")
      ->capture_default_str();
  app->add_option("--seed", o->seed, "Seed of initialisation, shuffling and rounding")
      ->check(Uint64Number())
      ->capture_default_str();
  app->add_option("--threads", o->threads, "Threads (0: all cores)")
      ->check(ThreadCount())
      ->capture_default_str();
}

void AddPrecisionOptions(CLI::App* app, TrainOptions* o, TrainFlags* f) {
  app->add_option("--w-format", f->wf, "Format of W (weights in forward)")->capture_default_str();
  app->add_option("--a-format", f->af, "Format of A (input activations)")->capture_default_str();
  app->add_option("--e-format", f->ef, "Format of E (errors)")->capture_default_str();
  app->add_option("--g-format", f->gf, "Format of G (weight gradients)")->capture_default_str();
  app->add_option("--w-rounding", f->wr, "nearest | stochastic | zero")->capture_default_str();
  app->add_option("--a-rounding", f->ar, "nearest | stochastic | zero")->capture_default_str();
  app->add_option("--e-rounding", f->er, "nearest | stochastic | zero")->capture_default_str();
  app->add_option("--g-rounding", f->gr, "nearest | stochastic | zero")->capture_default_str();
  app->add_option("--layer-format", f->layer_formats,
                  "Per-layer override NAME.SITE=SPEC, e.g. conv1.W=fp32 (repeatable)");
  app->add_option("--keep-fp32", f->keep_fp32,
                  "Comma-separated layers kept in fp32: first, last, embeddings, attention (the "
                  "attention products), tail=P% (the last P% of the Linear layers), or names "
                  "(CPT preset: last)");
  app->add_option("--cyclic-bits", f->cyclic_bits, "CPT: MIN MAX forward bits")->expected(2);
  app->add_option("--cyclic-periods", f->cyclic_periods, "CPT: cycles over the run")
      ->capture_default_str();
  app->add_option("--grad-bits", o->precision.grad_bits, "CPT: backward (E) bits")
      ->capture_default_str();
  app->add_flag("--hysteresis", o->precision.hysteresis,
                "Hysteresis rounding of W (Lee et al.) instead of the W rounding");
  app->add_option("--wgrad-transform", o->precision.wgrad_transform,
                  "Block Hadamard transform of both operands of every Linear's weight-gradient "
                  "product, down the rows it sums over, before A and E quantise them: rht<k> "
                  "(random signs by seed and step, as NVFP4 and MXFP4 training) or had<k> "
                  "(deterministic), k = 16..256 a power of two, or none; on the CPU and CUDA "
                  "alike");
  app->add_option("--accumulate", o->precision.accumulate,
                  "Emulate the quantised layers' matrix products accumulated in a reduced float "
                  "format: FORMAT[:every=N][:round=nearest|toward-zero], e.g. e8m13:every=128 "
                  "(DeepSeek-V3's FP8 GEMMs: about 14 bits, promoted to float32 every 128 "
                  "products); without every the whole sum stays in FORMAT. Linear layers on the "
                  "CPU and CUDA, convolutions on the CPU; far slower than float32 GEMMs; none "
                  "(the default): float32 GEMMs");
  app->add_option("--loss-scale", f->loss_scale,
                  "Loss scaling of the backward pass: off | dynamic | S (static). Every error "
                  "(E) and weight gradient (G) is S times larger at its site, and the gradient "
                  "is divided by S before the update: E in a format without a scale of its own "
                  "(e4m3, e2m1, fp16) otherwise flushes gradients of about 1e-3 to zero. "
                  "dynamic: S halves after a step with NaN/Inf gradients (skipped) and doubles "
                  "after --loss-scale-growth-interval finite steps (a saturating format clips "
                  "instead of overflowing: use a static S, or its :inf variant)")
      ->capture_default_str();
  app->add_option("--loss-scale-init", f->loss_scale_init, "dynamic: the first S")
      ->capture_default_str();
  app->add_option("--loss-scale-growth-interval", f->loss_scale_growth_interval,
                  "dynamic: finite steps in a row before S doubles")
      ->capture_default_str();
  app->add_option("--cost-reference", f->cost_reference,
                  "FWD/BWD bits of the static training that relative costs (CPT's cost model) "
                  "are measured against")
      ->capture_default_str();
}

void AddParallelOptions(CLI::App* app, TrainOptions* o, TrainFlags* f) {
  app->add_option("--comm", f->comm_kind,
                  "auto (mpi when started by mpirun/srun, else one process; the gradient "
                  "all-reduce over NCCL when every rank trains on a GPU) | self | mpi | nccl "
                  "(as auto, and the gradient all-reduce over NCCL or an error)")
      ->capture_default_str();
  app->add_option("--gradients", f->gradients,
                  "With --device cuda: device (the all-reduce works on the GPU's gradients; only "
                  "packed codes cross PCIe) | host (gradients staged through host memory, the "
                  "all-reduce on the CPU). The same bits either way")
      ->capture_default_str();
  app->add_option("--emulate-ranks", o->emulate_ranks,
                  "Logical workers per process, summed with the same quantised semantics as ranks")
      ->capture_default_str();
  app->add_option("--allreduce", f->algo,
                  "Gradient all-reduce: fp32 (the backend's) | emulate (CPD: every addition "
                  "rounded to --allreduce-format) | packed (low-bit codes on the wire)")
      ->capture_default_str();
  app->add_option("--allreduce-format", f->ar_format, "Gradient format of emulate/packed")
      ->capture_default_str();
  app->add_option("--allreduce-rounding", f->ar_rounding, "nearest | stochastic | zero")
      ->capture_default_str();
  app->add_option("--allreduce-layer-format", f->ar_layer_formats,
                  "Hybrid precision: NAME=SPEC, the layer's gradient format in emulate/packed "
                  "(SPEC a format or fp32; NAME a layer, first, last or bn; repeatable, later "
                  "wins)");
  app->add_flag("--aps", o->allreduce.aps,
                "Auto-precision scaling: per-layer power-of-two shift from the global max");
  app->add_option("--aps-scaling", f->aps_scaling,
                  "With --aps: paper (max|g|*W reaches the top of the format) | sum (packed only: "
                  "max|g| reaches the top, each chunk's float32 sum re-quantised with its own "
                  "shift) | auto (sum for packed, paper for emulate)")
      ->capture_default_str();
  app->add_flag("--kahan", o->allreduce.kahan, "emulate: Kahan-compensated sum");
  app->add_option("--bucket-mb", o->allreduce.bucket_mb, "Gradient bucket size in MiB")
      ->capture_default_str();
  app->add_option("--pipeline-kb", o->allreduce.pipeline_kb,
                  "emulate/packed with float grids: KiB of codes per contribution per round of "
                  "the pipelined all-reduce (quantise one round while the last is on the wire); "
                  "0 = sequential. The same bits either way")
      ->capture_default_str();
  app->add_option("--measure-error", o->measure_error_every,
                  "Every N steps, the all-reduce error against exact fp32 (0: never)")
      ->capture_default_str();
  app->add_option("--debug-nan-step", o->debug_nan_step,
                  "Testing aid: rank 0 puts a NaN into its gradient at this step (-1: never)")
      ->capture_default_str();
  app->add_option("--debug-nan-steps", o->debug_nan_steps,
                  "Testing aid: ... and at this many consecutive steps from it")
      ->capture_default_str();
  app->add_option("--debug-step-sleep-ms", o->debug_step_sleep_ms,
                  "Testing aid: sleep this long after every step (paces integration tests)")
      ->capture_default_str();
}

void AddControlPlaneOptions(CLI::App* app, TrainOptions* o, TrainFlags* f) {
  app->add_option("--coordinator", o->coordinator.address,
                  "HOST:PORT of a cpd-coordinator: rank 0 registers the job, takes the precision "
                  "schedules it pushes (every rank switches at the same step) and reports "
                  "per-layer statistics; training never waits for it (default: none, the "
                  "command line's schedule holds)");
  app->add_option("--job-name", o->coordinator.job_name,
                  "Job name at the coordinator, [A-Za-z0-9._-]{1,128}; a resumed run with the "
                  "same name continues the same job (default: <arch>-<dataset>-<UTC time>)");
  app->add_option("--study", o->coordinator.study,
                  "Study the job belongs to at the coordinator, [A-Za-z0-9._-]{1,64} "
                  "(`cpdctl study NAME` lists its runs); a resumed job keeps its study");
  app->add_option("--token-file", f->token_file,
                  "File whose first line is the coordinator's token (sent as a bearer token)");
  app->add_option("--tls-ca", f->tls_ca, "PEM root certificates: talk TLS to the coordinator");
  app->add_option("--report-interval", o->report_interval_s,
                  "Seconds between summary reports to the coordinator (statistics steps and "
                  "epoch ends are reported as well)")
      ->capture_default_str();
}

void AddOutputOptions(CLI::App* app, TrainOptions* o, TrainFlags* f) {
  app->add_option("--stats-every", o->stats_every, "Per-layer statistics every N steps (0: off)")
      ->capture_default_str();
  app->add_option("--metrics-out", o->metrics_out, "Append JSON lines (steps, epochs) to FILE");
  app->add_option("--checkpoint-dir", o->checkpoint_dir,
                  "Directory for checkpoints (created; must be writable: checked at start-up). "
                  "An existing checkpoint file with other contents is never overwritten");
  app->add_option("--checkpoint-every", o->checkpoint_every,
                  "Checkpoint every N steps (0: at the end of each epoch)")
      ->capture_default_str();
  app->add_option("--resume", o->resume, "auto (newest in --checkpoint-dir) or a checkpoint file");
  app->add_option("--device", f->device,
                  "auto | cpu | cuda (auto: cuda when this build has CUDA and a GPU is present)")
      ->capture_default_str();
  app->add_flag("--fast-conv-algos", o->fast_conv_algos,
                "With --device cuda: let cuDNN use Winograd, FFT and TF32 convolution "
                "algorithms for speed (default: only GEMM-like float32 ones, which match the "
                "CPU up to summation order)");
  app->add_option("--progress", f->progress,
                  "auto | bar | lines | off: a bar redrawn in place, or plain lines for a log "
                  "(at most 10 an epoch, never a carriage return); auto: the bar on an "
                  "interactive terminal, lines when stdout is a file or a pipe or mpirun/srun "
                  "started the process")
      ->capture_default_str();
  app->add_flag("--no-progress", f->no_progress, "The same as --progress off");
  app->add_option("--progress-interval", o->progress_interval_s,
                  "Progress lines: one when at least this many seconds and a tenth of the "
                  "epoch have passed since the last, and at each epoch's end")
      ->capture_default_str();
  app->add_flag("--quiet", o->quiet, "Print nothing but errors");
  app->add_flag("--check", f->check,
                "Check the flags and --config, then exit: 0 and nothing printed where a run "
                "would start, else the one-line error and 2 (no data is read; for batch "
                "scripts, before mpirun or sbatch)");
}

}  // namespace

void AddTrainOptions(CLI::App* app, TrainOptions* o, TrainFlags* f) {
  app->add_option("--config", f->config_path, "YAML file with the same keys as the flags");
  app->add_option("--preset", f->preset,
                  "cpt: CPT 3-8 cyclic forward bits, 32 periods, 8-bit backward, last layer fp32; "
                  "lee2022: FP134 activations and errors, log4 weights (per channel in "
                  "convolutions, per tensor elsewhere) with hysteresis, first and last layers "
                  "fp32; nvfp4: NVIDIA's NVFP4 pre-training recipe (2025): W nvfp4:2d (16x16 "
                  "blocks), A and E nvfp4 (1x16), E stochastic, W and A nearest, a 16-point random "
                  "Hadamard transform of the weight-gradient product's operands, embeddings, "
                  "attention products, the output layer and the last 15% of the Linear layers in "
                  "fp32 (G, master weights and the optimizer fp32 throughout); deepseek-fp8: "
                  "DeepSeek-V3's FP8 recipe (2024): E4M3 everywhere, W in 128x128 blocks, A and E "
                  "in 1x128 tiles, float32 scales, nearest, embeddings, attention and the output "
                  "layer fp32 (add --accumulate e8m13:every=128 for its limited-precision "
                  "accumulation); mxfp4-rht: Tseng et al.'s MXFP4 backward (2025): E mxfp4 "
                  "stochastic, W and A bf16, a 64-point random Hadamard transform of the "
                  "weight-gradient product's operands, embeddings, attention and the output "
                  "layer fp32");
  AddDataAndModelOptions(app, o, f);
  AddOptimisationOptions(app, o, f);
  AddPrecisionOptions(app, o, f);
  AddParallelOptions(app, o, f);
  AddControlPlaneOptions(app, o, f);
  AddOutputOptions(app, o, f);
}

namespace {

// --preset: defaults for the flags the command line did not give.
Status ApplyPreset(const CLI::App& app, TrainFlags* f, TrainOptions* o) {
  auto given = [&](const char* flag) { return app.get_option(flag)->count() > 0; };
  if (f->preset == "cpt") {
    if (!given("--cyclic-bits")) f->cyclic_bits = {3, 8};
    if (!given("--keep-fp32")) f->keep_fp32 = "last";
  } else if (f->preset == "lee2022") {
    if (!given("--w-format")) f->wf = "log4";
    if (!given("--a-format")) f->af = "fp134";
    if (!given("--e-format")) f->ef = "fp134";
    if (!given("--keep-fp32")) f->keep_fp32 = "first,last";
    o->precision.hysteresis = true;
  } else if (f->preset == "nvfp4") {
    // NVIDIA, "Pretraining Large Language Models with NVFP4" (arXiv 2509.25149): 2D 16x16
    // weights, 1x16 activations and gradients, stochastic rounding of gradients only, a 16x16
    // random Hadamard transform on the inputs of the weight-gradient GEMMs, and about 15% of the
    // linear layers (most at the end) plus embeddings, the output head and attention's batched
    // products in higher precision.
    if (!given("--w-format")) f->wf = "nvfp4:2d";
    if (!given("--a-format")) f->af = "nvfp4";
    if (!given("--e-format")) f->ef = "nvfp4";
    if (!given("--e-rounding")) f->er = "stochastic";
    if (!given("--wgrad-transform")) o->precision.wgrad_transform = "rht16";
    if (!given("--keep-fp32")) f->keep_fp32 = "embeddings,attention,last,tail=15%";
  } else if (f->preset == "deepseek-fp8") {
    // DeepSeek-V3 technical report (arXiv 2412.19437), section 3.3: E4M3 for every GEMM's inputs,
    // activations (and their gradients) scaled per 1x128 tile, weights per 128x128 block;
    // embeddings, the output head and attention kept in higher precision. Its accumulation in
    // limited precision with promotion to float32 every 128 products is hardware's, not a
    // choice: --accumulate e8m13:every=128 emulates it (slowly), so the preset leaves it off.
    if (!given("--w-format")) f->wf = "e4m3:block=128x128";
    if (!given("--a-format")) f->af = "e4m3:block=1x128";
    if (!given("--e-format")) f->ef = "e4m3:block=1x128";
    if (!given("--keep-fp32")) f->keep_fp32 = "embeddings,attention,last";
  } else if (f->preset == "mxfp4-rht") {
    // Tseng, Yu, Park, "Training LLMs with MXFP4" (AISTATS 2025; amazon-science/mxfp4-llm):
    // BF16 forward; the backward GEMMs in MXFP4 with stochastic rounding and a 64-point random
    // Hadamard transform; Megatron's transformer Linear layers only. CPD's nearest: E MXFP4
    // stochastic, W and A BF16, the transform on the weight-gradient product (docs/cpd-train.md
    // lists the departures).
    if (!given("--w-format")) f->wf = "bf16";
    if (!given("--a-format")) f->af = "bf16";
    if (!given("--e-format")) f->ef = "mxfp4";
    if (!given("--e-rounding")) f->er = "stochastic";
    if (!given("--wgrad-transform")) o->precision.wgrad_transform = "rht64";
    if (!given("--keep-fp32")) f->keep_fp32 = "embeddings,attention,last";
  } else {
    return Status::InvalidArgument("--preset '" + f->preset +
                                   "' (accepted: cpt, lee2022, nvfp4, deepseek-fp8, mxfp4-rht)");
  }
  return Status::Ok();
}

// The precision policy: the four sites' global formats, per-layer overrides, fp32 layers, CPT.
Status ApplyPrecisionFlags(const TrainFlags& f, TrainOptions* o) {
  using cpd::runtime::Site;
  auto& global = o->precision.global;
  CPD_ASSIGN_OR_RETURN(global[int(Site::kWeight)], CheckSite("--w-format", f.wf, f.wr));
  CPD_ASSIGN_OR_RETURN(global[int(Site::kActivation)], CheckSite("--a-format", f.af, f.ar));
  CPD_ASSIGN_OR_RETURN(global[int(Site::kError)], CheckSite("--e-format", f.ef, f.er));
  CPD_ASSIGN_OR_RETURN(global[int(Site::kWeightGrad)], CheckSite("--g-format", f.gf, f.gr));
  for (const auto& lf : f.layer_formats) {
    CPD_RETURN_IF_ERROR(cpd::runtime::AddLayerOverride(lf, &o->precision));
  }
  o->precision.keep_fp32 = SplitCommas(f.keep_fp32);
  // "none" turns off a preset's transform (an empty value cannot be written in a study file).
  if (o->precision.wgrad_transform == "none") o->precision.wgrad_transform.clear();
  if (o->precision.accumulate == "none") o->precision.accumulate.clear();
  for (const auto& lf : f.ar_layer_formats) {
    CPD_RETURN_IF_ERROR(cpd::runtime::AddAllReduceLayerFormat(lf, &o->precision));
  }
  if (!f.cyclic_bits.empty()) {
    cpd::CyclicPrecision c;
    c.min_bits = f.cyclic_bits[0];
    c.max_bits = f.cyclic_bits[1];
    c.periods = f.cyclic_periods;
    c.total_iters = 1;  // set by the trainer from epochs x steps per epoch
    o->precision.cpt = c;
  }
  CPD_ASSIGN_OR_RETURN(o->loss_scale, cpd::runtime::ParseLossScale(f.loss_scale, f.loss_scale_init,
                                                                   f.loss_scale_growth_interval));
  auto ref = cpd::ParseStepBits(f.cost_reference);
  if (!ref.ok()) return Status::InvalidArgument("--cost-reference: " + ref.status().message());
  o->cost_reference = *ref;
  return Status::Ok();
}

}  // namespace

namespace {

Status ApplyAndCheck(const CLI::App& app, TrainFlags* f, TrainOptions* o) {
  auto bad = [](const std::string& m) { return Status::InvalidArgument(m); };
  auto given = [&](const char* flag) { return app.get_option(flag)->count() > 0; };
  if (!f->preset.empty()) CPD_RETURN_IF_ERROR(ApplyPreset(app, f, o));
  if (f->augment && f->no_augment) return bad("--augment and --no-augment exclude each other");
  if (o->arch == "lstm" && given("--n-head")) {
    return bad("--n-head applies to --arch gpt; an LSTM has no attention heads");
  }
  if (!runtime::IsLanguageModel(o->arch)) {
    for (const char* flag : {"--n-layer", "--n-head", "--n-embd", "--block-size", "--dropout",
                             "--untied-head", "--tokens-per-epoch"}) {
      if (given(flag)) {
        return bad(std::string(flag) +
                   " applies to language models (--arch gpt or lstm), not --arch " + o->arch);
      }
    }
  }
  o->lm.tied_head = !f->untied_head;
  if (!o->coordinator.address.empty()) {
    std::string host;
    int port = 0;
    if (!SplitHostPort(o->coordinator.address, &host, &port)) {
      return bad("--coordinator '" + o->coordinator.address +
                 "': expected HOST:PORT, e.g. 127.0.0.1:50051");
    }
  }
  if ((!f->token_file.empty() || !f->tls_ca.empty() || !o->coordinator.job_name.empty() ||
       !o->coordinator.study.empty()) &&
      o->coordinator.address.empty()) {
    return bad("--job-name, --study, --token-file and --tls-ca need --coordinator HOST:PORT");
  }
  if (!f->token_file.empty()) {
    auto token = ReadTokenFile(f->token_file);
    if (!token.ok()) return bad("--token-file: " + token.status().message());
    o->coordinator.token = *token;
  }
  if (!f->tls_ca.empty()) {
    auto pem = ReadPemFile(f->tls_ca, "CERTIFICATE");
    if (!pem.ok()) return bad("--tls-ca: " + pem.status().message());
    o->coordinator.tls_ca_pem = *pem;
  }
  // Names become enums here, at the edge; the trainer sees only valid values.
  if (auto k = cpd::runtime::ParseOptimizerKind(f->optimizer); k.ok()) {
    o->optimizer = *k;
  } else {
    return bad("--" + k.status().message());
  }
  if (given("--warmup-steps") && given("--warmup-epochs")) {
    return bad("--warmup-steps and --warmup-epochs exclude each other; give one");
  }
  if (auto k = cpd::ParseLrScaling(f->lr_scaling); k.ok()) {
    o->lr_scaling = *k;
  } else {
    return bad("--" + k.status().message());
  }
  if (auto k = cpd::runtime::ParseLarsExclude(f->lars_exclude); k.ok()) {
    o->lars_exclude = *k;
  } else {
    return bad("--" + k.status().message());
  }
  if (auto k = cpd::ParseLrScheduleKind(f->lr_schedule); k.ok()) {
    o->lr_schedule = *k;
  } else {
    return bad("--lr-schedule: " + k.status().message());
  }
  if (auto d = cpd::runtime::ParseDeviceChoice(f->device); d.ok()) {
    o->device = *d;
  } else {
    return bad("--" + d.status().message());
  }
  o->augment_set = f->augment || f->no_augment;
  o->augment = f->augment;
  if (auto p = ParseProgressMode(f->progress); !p.ok()) {
    return bad("--" + p.status().message());
  } else if (f->no_progress && *p != ProgressMode::kOff && app.count("--progress") > 0) {
    return bad("--no-progress and --progress " + f->progress + " exclude each other; give one");
  } else {
    o->progress = f->no_progress ? ProgressMode::kOff : *p;
  }
  CPD_RETURN_IF_ERROR(ApplyPrecisionFlags(*f, o));
  if (f->comm_kind == "auto") {
    o->allreduce_comm = cpd::runtime::AllReduceComm::kAuto;
  } else if (f->comm_kind == "self" || f->comm_kind == "mpi") {
    o->allreduce_comm = cpd::runtime::AllReduceComm::kWorld;
  } else if (f->comm_kind == "nccl") {
    o->allreduce_comm = cpd::runtime::AllReduceComm::kNccl;
  } else {
    return bad("--comm '" + f->comm_kind + "' (accepted: auto, self, mpi, nccl)");
  }
  if (f->gradients != "device" && f->gradients != "host") {
    return bad("--gradients '" + f->gradients + "' (accepted: device, host)");
  }
  o->device_gradients = f->gradients == "device";
  auto a = cpd::comm::ParseAllReduceAlgo(f->algo);
  if (!a.ok()) return bad("--allreduce: " + a.status().message());
  o->allreduce.algo = *a;
  auto fmt = cpd::Format::Parse(f->ar_format);
  if (!fmt.ok()) return bad("--allreduce-format: " + fmt.status().message());
  o->allreduce.format = fmt->spec();
  auto r = cpd::ParseRounding(f->ar_rounding);
  if (!r.ok()) return bad("--allreduce-rounding: " + r.status().message());
  o->allreduce.rounding = *r;
  auto scaling = cpd::comm::ParseApsScaling(f->aps_scaling);
  if (!scaling.ok()) return bad("--aps-scaling: " + scaling.status().message());
  o->allreduce.aps_scaling = *scaling;
  if (*scaling == cpd::comm::ApsScaling::kSum &&
      o->allreduce.algo == cpd::comm::AllReduceAlgo::kEmulate) {
    return bad(
        "--aps-scaling sum applies to --allreduce packed only; emulate keeps the paper's "
        "scaling (accepted with emulate: auto, paper)");
  }
  return runtime::ValidateTrainOptions(*o);
}

}  // namespace

Status ApplyTrainFlags(const CLI::App& app, TrainFlags* f, TrainOptions* o) {
  // Messages quote what the user wrote (a format spec, a layer name), which a YAML scalar may
  // spread over lines or fill with control bytes: one line of text, whatever the value.
  const Status s = ApplyAndCheck(app, f, o);
  if (s.ok() || s.code() != Status::Code::kInvalidArgument) return s;
  return Status::InvalidArgument(MessageLine(s.message(), 2000));
}

std::string WorldKind(const TrainFlags& f) { return f.comm_kind == "nccl" ? "auto" : f.comm_kind; }

}  // namespace cpd::launcher
