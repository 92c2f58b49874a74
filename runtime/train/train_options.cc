// ValidateTrainOptions (runtime/train/train_options.h): the one check of a run's options, before
// any work.
#include "runtime/train/train_options.h"

#include <unistd.h>

#include <cmath>
#include <string>
#include <tuple>
#include <utility>

#include "cpd/accumulate.h"
#include "cpd/message.h"
#include "cpd/threads.h"
#include "cpd/transform.h"

namespace cpd::runtime {

Status CheckGlobalBatchSplit(int64_t global_batch, int ranks, int emulate_ranks) {
  const int64_t workers = int64_t(ranks) * emulate_ranks;
  if (workers > 0 && global_batch % workers == 0) return Status::Ok();
  return Status::InvalidArgument("--global-batch " + std::to_string(global_batch) +
                                 " does not split evenly over " + std::to_string(workers) +
                                 " workers (" + std::to_string(ranks) + " ranks x " +
                                 std::to_string(emulate_ranks) + " emulated)");
}

bool IsTokenDataset(const std::string& dataset) { return dataset == "text" || dataset == "tokens"; }

bool IsLanguageModel(const std::string& arch) { return arch == "gpt" || arch == "lstm"; }

// The language model's sizes, each bounded before anything is allocated, and the pairing of a
// language model with a token dataset.
Status ValidateLanguageModel(const TrainOptions& o) {
  auto bad = [](const std::string& m) { return Status::InvalidArgument(m); };
  const bool lm = IsLanguageModel(o.arch), tokens = IsTokenDataset(o.dataset);
  if (lm && !tokens) {
    return bad("--arch " + o.arch +
               " is a language model: it needs --dataset text or tokens, got " + o.dataset);
  }
  if (tokens && !lm) {
    return bad("--dataset " + o.dataset + " is a token stream: it needs --arch gpt or lstm, got " +
               o.arch);
  }
  if (!lm) return Status::Ok();
  const LanguageModelOptions& m = o.lm;
  using L = LanguageModelOptions;
  for (const auto& [flag, v, hi] :
       {std::tuple<const char*, int, int>{"--n-layer", m.n_layer, L::kMaxLayers},
        {"--n-head", m.n_head, L::kMaxHeads},
        {"--n-embd", m.n_embd, L::kMaxEmbd},
        {"--block-size", m.block_size, L::kMaxBlock}}) {
    if (v < 1 || v > hi) {
      return bad(std::string(flag) + " " + std::to_string(v) + " is not accepted: 1.." +
                 std::to_string(hi));
    }
  }
  if (o.arch == "gpt" && m.n_embd % m.n_head != 0) {
    return bad("--n-embd " + std::to_string(m.n_embd) + " is not a multiple of --n-head " +
               std::to_string(m.n_head) + " (each head takes n_embd / n_head channels)");
  }
  if (!(m.dropout >= 0 && m.dropout < 1)) {
    return bad("--dropout " + NumberText(m.dropout) + " is not accepted: a number in [0, 1)");
  }
  if (m.tokens_per_epoch < 0) {
    return bad("--tokens-per-epoch must be >= 0 (0: the training tokens), got " +
               std::to_string(m.tokens_per_epoch));
  }
  // GPT-2's count: 12 C^2 + 13 C per block, the embeddings, the final LayerNorm and an untied
  // head; the LSTM's: 8 C^2 + 8 C per layer (four gates of two products), the embedding and an
  // untied head. The vocabulary is at most GPT-2's 50257 here.
  const int64_t C = m.n_embd, vocab = o.dataset == "text" ? 256 : 50257;
  const int64_t head = m.tied_head ? 0 : vocab * C;
  const int64_t params =
      o.arch == "gpt"
          ? int64_t(m.n_layer) * (12 * C * C + 13 * C) + (vocab + m.block_size) * C + 2 * C + head
          : int64_t(m.n_layer) * (8 * C * C + 8 * C) + vocab * C + head;
  if (params > L::kMaxParams) {
    return bad("--n-layer " + std::to_string(m.n_layer) + " --n-embd " + std::to_string(C) +
               " make a model of " + std::to_string(params) + " parameters, more than " +
               std::to_string(L::kMaxParams));
  }
  return Status::Ok();
}

Status ValidateTrainOptions(const TrainOptions& o) {
  auto bad = [](const std::string& m) { return Status::InvalidArgument(m); };
  CPD_RETURN_IF_ERROR(ValidateLanguageModel(o));
  if (o.epochs < 1) return bad("--epochs must be >= 1, got " + std::to_string(o.epochs));
  if (!o.precision.wgrad_transform.empty()) {
    auto t = ParseHadamard(o.precision.wgrad_transform);
    if (!t.ok()) return bad("--wgrad-transform: " + t.status().message());
  }
  if (!o.precision.accumulate.empty()) {
    auto a = ParseAccumulation(o.precision.accumulate);
    if (!a.ok()) return bad("--accumulate: " + a.status().message());
  }
  if (o.max_steps < 0) {
    return bad("--max-steps must be >= 0 (0: all epochs), got " + std::to_string(o.max_steps));
  }
  if (o.max_skipped_steps < 0) {
    return bad("--max-skipped-steps must be >= 0 (0: never stop for skipped steps), got " +
               std::to_string(o.max_skipped_steps));
  }
  if (o.threads < 0 || o.threads > MaxThreads()) {
    return bad("--threads " + std::to_string(o.threads) + " is not accepted: " + ThreadsAccepted());
  }
  for (const auto& [flag, v] : {std::pair<const char*, int>{"--in-channels", o.in_channels},
                                {"--image-size", o.image_size},
                                {"--classes", o.classes}}) {
    if (v < 0) {
      return bad(std::string(flag) +
                 " must be a positive number (or left out: the dataset's), "
                 "got " +
                 std::to_string(v));
    }
  }
  if (o.batch_size < 1) {
    return bad("--batch-size " + std::to_string(o.batch_size) + " is not accepted: >= 1");
  }
  if (o.global_batch < 0) return bad("--global-batch must be >= 1 (or 0: batch-size x workers)");
  if (o.emulate_ranks < 1 || o.emulate_ranks > 4096) {
    return bad("--emulate-ranks must be in 1..4096, got " + std::to_string(o.emulate_ranks));
  }
  if (o.measure_error_every < 0) return bad("--measure-error must be >= 0");
  if (o.debug_step_sleep_ms < 0) return bad("--debug-step-sleep-ms must be >= 0");
  CPD_RETURN_IF_ERROR(o.allreduce.Validate());
  if (!(o.lr > 0) || !std::isfinite(o.lr)) {
    return bad("--lr " + NumberText(o.lr) + " is not accepted: a number > 0");
  }
  if (o.lr_base_batch < 1) {
    return bad("--lr-base-batch must be >= 1, got " + std::to_string(o.lr_base_batch));
  }
  if (o.warmup_steps < 0) {
    return bad("--warmup-steps must be >= 0, got " + std::to_string(o.warmup_steps));
  }
  if (!(o.warmup_epochs >= 0) || !std::isfinite(o.warmup_epochs)) {
    return bad("--warmup-epochs must be a number >= 0, got " + NumberText(o.warmup_epochs));
  }
  if (o.warmup_steps > 0 && o.warmup_epochs > 0) {
    return bad("--warmup-steps and --warmup-epochs exclude each other; give one");
  }
  if (!(o.lars_eta > 0) || !std::isfinite(o.lars_eta)) {
    return bad("--lars-eta must be a positive number");
  }
  if (!(o.lars_excluded_lr_ratio > 0) || !std::isfinite(o.lars_excluded_lr_ratio)) {
    return bad("--lars-excluded-lr-ratio must be a positive number (default 0.024)");
  }
  if (!(o.momentum >= 0 && o.momentum < 1)) {
    return bad("--momentum " + NumberText(o.momentum) + " is not accepted: a number in [0, 1)");
  }
  if (!(o.weight_decay >= 0) || !std::isfinite(o.weight_decay)) {
    return bad("--weight-decay " + NumberText(o.weight_decay) + " is not accepted: a number >= 0");
  }
  for (const auto& [flag, beta] : {std::pair{"--beta1", o.beta1}, std::pair{"--beta2", o.beta2}}) {
    if (!(beta >= 0 && beta < 1)) {
      return bad(std::string(flag) + " " + NumberText(beta) +
                 " is not accepted: a number in [0, 1)");
    }
  }
  if (!(o.adam_eps > 0) || !std::isfinite(o.adam_eps)) {
    return bad("--eps " + NumberText(o.adam_eps) + " is not accepted: a number > 0");
  }
  if (o.nesterov && o.optimizer == OptimizerKind::kAdamW) {
    return bad("--nesterov applies to --optimizer sgd and lars, not adamw");
  }
  if (!(o.clip_grad_norm >= 0) || !std::isfinite(o.clip_grad_norm)) {
    return bad("--clip-grad-norm " + NumberText(o.clip_grad_norm) +
               " is not accepted: a number >= 0 (0: off)");
  }
  if (o.stats_every < 0) return bad("--stats-every must be >= 0");
  if (!(o.progress_interval_s >= 0) || !std::isfinite(o.progress_interval_s)) {
    return bad("--progress-interval must be a number of seconds >= 0");
  }
  if (o.checkpoint_every < 0) return bad("--checkpoint-every must be >= 0");
  if (o.fast_conv_algos && o.device == DeviceChoice::kCpu) {
    return bad(
        "--fast-conv-algos chooses cuDNN's convolution algorithms on a GPU; it needs "
        "--device cuda or auto, got --device cpu");
  }
  if (!o.resume.empty() && o.resume != "auto" && access(o.resume.c_str(), R_OK) != 0) {
    return bad("--resume: cannot read checkpoint '" + o.resume + "'");
  }
  if (o.resume == "auto" && o.checkpoint_dir.empty()) {
    return bad("--resume auto needs --checkpoint-dir");
  }
  if (o.precision.cpt) {
    const auto& c = *o.precision.cpt;
    if (c.min_bits < 2 || c.max_bits > 16 || c.min_bits > c.max_bits) {
      return bad("--cyclic-bits MIN MAX needs 2 <= MIN <= MAX <= 16");
    }
    if (c.periods < 1) return bad("--cyclic-periods must be >= 1");
    if (o.precision.grad_bits < 2 || o.precision.grad_bits > 16) {
      return bad("--grad-bits must be in 2..16");
    }
  }
  return Status::Ok();
}

}  // namespace cpd::runtime
