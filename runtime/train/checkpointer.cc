#include "runtime/train/checkpointer.h"

#include <sys/stat.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <vector>

#include "runtime/train/checkpoint.h"

namespace cpd::runtime {

namespace {

using nlohmann::json;

constexpr int kCheckpointVersion = 1;

Status MakeDirectory(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0755) == 0 || errno == EEXIST) return Status::Ok();
  return Status::IoError("--checkpoint-dir: cannot create " + dir + ": " + std::strerror(errno));
}

}  // namespace

Checkpointer::Checkpointer(const TrainOptions& options, int64_t global_batch,
                           int64_t batches_per_epoch, TrainingState state, const Replicas* replicas)
    : o_(options),
      global_batch_(global_batch),
      batches_per_epoch_(batches_per_epoch),
      state_(state),
      replicas_(replicas) {}

Status Checkpointer::Write(int64_t step, int epoch) const {
  Checkpoint ck;
  json meta;
  meta["version"] = kCheckpointVersion;
  meta["step"] = step;
  meta["epoch"] = epoch;
  const IteratorState it = state_.iterator->state();
  meta["iterator"] = {{"epoch", it.epoch}, {"next_batch", it.next_batch}};
  meta["arch"] = o_.arch;
  meta["dataset"] = o_.dataset;
  meta["global_batch"] = global_batch_;
  meta["seed"] = o_.seed;
  if (state_.control != nullptr) meta["schedule"] = json::parse(state_.control->ScheduleJson());
  ck.meta_json = meta.dump();
  // Tensors on the GPU are copied to the host first.
  auto put = [&ck](const std::string& key, const Tensor& t) {
    const Tensor h = OnHost(t);
    ck.Put(key, h.shape(), h.data(), h.numel());
  };
  for (Param* p : state_.model->Params()) put("param/" + p->name, p->value);
  for (auto& [name, t] : state_.model->Buffers()) put("buffer/" + name, *t);
  for (auto& [name, t] : state_.optimizer->State()) put("opt/" + name, *t);
  for (auto& [layer, q] : state_.quant->HysteresisState()) {
    ck.Put("hyst/" + layer, {int64_t(q->size())}, q->data(), q->size());
  }
  CPD_RETURN_IF_ERROR(MakeDirectory(o_.checkpoint_dir));
  return WriteCheckpoint(CheckpointPath(o_.checkpoint_dir, step), ck);
}

Status Checkpointer::SaveEverywhere(int64_t step, int epoch) {
  const Status written = replicas_->lead() ? Write(step, epoch) : Status::Ok();
  last_saved_step_ = step;
  return replicas_->AgreeOn(written, "writing the checkpoint failed on rank 0");
}

Status Checkpointer::AfterStep(int64_t step, int epoch) {
  if (!enabled() || o_.checkpoint_every <= 0 || step % o_.checkpoint_every != 0) {
    return Status::Ok();
  }
  return SaveEverywhere(step, epoch);
}

Status Checkpointer::AfterEpoch(int64_t step, int epochs_done) {
  if (!enabled() || o_.checkpoint_every != 0) return Status::Ok();
  return SaveEverywhere(step, epochs_done);
}

Status Checkpointer::AtEnd(int64_t step) {
  if (!enabled() || step == last_saved_step_) return Status::Ok();
  const IteratorState it = state_.iterator->state();
  return SaveEverywhere(step, int(it.epoch) + (it.next_batch >= batches_per_epoch_));
}

Result<ResumePoint> Checkpointer::Restore(const std::string& path) {
  CPD_ASSIGN_OR_RETURN(const Checkpoint ck, ReadCheckpoint(path));
  json meta = json::parse(ck.meta_json, nullptr, false);
  if (meta.is_discarded() || meta.value("version", 0) != kCheckpointVersion) {
    return Status::Corruption("checkpoint " + path + ": unsupported version");
  }
  // Version-1 checkpoints of single-process runs stored the batch as "batch_size".
  const int64_t saved_global = meta.value("global_batch", meta.value("batch_size", int64_t(0)));
  if (meta.value("arch", "") != o_.arch || meta.value("dataset", "") != o_.dataset ||
      saved_global != global_batch_) {
    return Status::InvalidArgument(
        "checkpoint " + path + " was written by a run with --arch " + meta.value("arch", "?") +
        " --dataset " + meta.value("dataset", "?") + " and global batch " +
        std::to_string(saved_global) + "; this run has --arch " + o_.arch + " --dataset " +
        o_.dataset + " and global batch " + std::to_string(global_batch_));
  }
  auto take = [&](const std::string& key, Tensor* t) -> Status {
    if (!ck.Has(key)) return Status::Corruption("checkpoint " + path + ": missing " + key);
    const auto& v = ck.data.at(key);
    if (v.size() != t->numel()) {
      return Status::Corruption("checkpoint " + path + ": " + key + " has " +
                                std::to_string(v.size()) + " values, the model needs " +
                                std::to_string(t->numel()));
    }
    t->CopyFromHost(v.data());  // any device
    return Status::Ok();
  };
  for (Param* p : state_.model->Params()) CPD_RETURN_IF_ERROR(take("param/" + p->name, &p->value));
  for (auto& [name, t] : state_.model->Buffers()) CPD_RETURN_IF_ERROR(take("buffer/" + name, t));
  std::map<std::string, std::vector<float>> opt_state;
  for (const auto& name : ck.order) {
    if (name.rfind("opt/", 0) == 0) opt_state[name.substr(4)] = ck.data.at(name);
  }
  CPD_RETURN_IF_ERROR(state_.optimizer->LoadState(opt_state));
  ResumePoint point;
  point.step = meta.value("step", int64_t(0));
  if (meta.contains("schedule")) point.schedule_json = meta["schedule"].dump();
  for (const auto& name : ck.order) {
    if (name.rfind("hyst/", 0) == 0) {
      state_.quant->RestoreHysteresisState(name.substr(5), ck.data.at(name));
    }
  }
  IteratorState st;
  st.epoch = meta["iterator"].value("epoch", int64_t(0));
  st.next_batch = meta["iterator"].value("next_batch", int64_t(0));
  CPD_RETURN_IF_ERROR(state_.iterator->Restore(st));
  point.epoch = meta.value("epoch", 0);
  return point;
}

Result<int64_t> LoadModelFromCheckpoint(const std::string& path, const std::string& arch,
                                        const std::string& dataset, Sequential* model) {
  CPD_ASSIGN_OR_RETURN(const Checkpoint ck, ReadCheckpoint(path));
  const json meta = json::parse(ck.meta_json, nullptr, false);
  if (!meta.is_object() || meta.value("version", 0) != kCheckpointVersion) {
    return Status::Corruption("checkpoint " + path + ": unsupported version");
  }
  const json& saved_arch = meta.contains("arch") ? meta["arch"] : json();
  const json& saved_dataset = meta.contains("dataset") ? meta["dataset"] : json();
  if (!saved_arch.is_string() || !saved_dataset.is_string() || saved_arch != arch ||
      saved_dataset != dataset) {
    return Status::InvalidArgument(
        "checkpoint " + path + " was written for --arch " +
        (saved_arch.is_string() ? saved_arch.get<std::string>() : "?") + " --dataset " +
        (saved_dataset.is_string() ? saved_dataset.get<std::string>() : "?") +
        "; this run has --arch " + arch + " --dataset " + dataset);
  }
  auto take = [&](const std::string& key, Tensor* t) -> Status {
    if (!ck.Has(key)) return Status::Corruption("checkpoint " + path + ": missing " + key);
    const std::vector<float>& v = ck.data.at(key);
    if (v.size() != t->numel()) {
      return Status::Corruption("checkpoint " + path + ": " + key + " has " +
                                std::to_string(v.size()) + " values, the model needs " +
                                std::to_string(t->numel()));
    }
    for (float x : v) {
      if (!std::isfinite(x)) {
        return Status::Corruption("checkpoint " + path + ": " + key + " holds NaN or Inf");
      }
    }
    t->CopyFromHost(v.data());  // any device
    return Status::Ok();
  };
  for (Param* p : model->Params()) CPD_RETURN_IF_ERROR(take("param/" + p->name, &p->value));
  for (auto& [name, t] : model->Buffers()) CPD_RETURN_IF_ERROR(take("buffer/" + name, t));
  const json& step = meta.contains("step") ? meta["step"] : json();
  return step.is_number_integer() ? step.get<int64_t>() : int64_t(0);
}

}  // namespace cpd::runtime
