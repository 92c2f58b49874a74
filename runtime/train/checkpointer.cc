#include "runtime/train/checkpointer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <vector>

#include "kernels/grid.h"
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

Checkpointer::Checkpointer(const CheckpointOptions& options, int64_t global_batch,
                           int64_t batches_per_epoch, TrainingState state, const Replicas* replicas)
    : o_(options),
      global_batch_(global_batch),
      batches_per_epoch_(batches_per_epoch),
      state_(state),
      replicas_(replicas) {}

Status Checkpointer::Write(int64_t step, int epoch, const EpochSums& sums) const {
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
  meta["optimizer"] = OptimizerKindName(state_.optimizer->options().kind);
  meta["random_stream"] = kernels::kRandomStreamVersion;
  if (state_.scaler != nullptr && state_.scaler->enabled()) {
    const LossScaler::State ls = state_.scaler->state();
    meta["loss_scale"] = {{"scale", ls.scale}, {"finite_in_a_row", ls.finite_in_a_row}};
  }
  meta["epoch_sums"] = {
      {"loss", sums.loss}, {"correct", sums.correct}, {"seen", sums.seen}, {"steps", sums.steps}};
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

Status Checkpointer::SaveEverywhere(int64_t step, int epoch, const EpochSums& sums) {
  const Status written = replicas_->lead() ? Write(step, epoch, sums) : Status::Ok();
  last_saved_step_ = step;
  return replicas_->AgreeOn(written, "writing the checkpoint failed on rank 0");
}

Status Checkpointer::AfterStep(int64_t step, int epoch, const EpochSums& sums) {
  if (!enabled() || o_.checkpoint_every <= 0 || step % o_.checkpoint_every != 0) {
    return Status::Ok();
  }
  return SaveEverywhere(step, epoch, sums);
}

Status Checkpointer::AfterEpoch(int64_t step, int epochs_done) {
  if (!enabled() || o_.checkpoint_every != 0) return Status::Ok();
  return SaveEverywhere(step, epochs_done, EpochSums{});  // the next epoch starts from zero
}

Status Checkpointer::AtEnd(int64_t step, const EpochSums& sums) {
  if (!enabled() || step == last_saved_step_) return Status::Ok();
  const IteratorState it = state_.iterator->state();
  return SaveEverywhere(step, int(it.epoch) + (it.next_batch >= batches_per_epoch_), sums);
}

Status Checkpointer::CheckDirectory() const {
  Status local = Status::Ok();
  if (enabled() && replicas_->lead()) {
    local = MakeDirectory(o_.checkpoint_dir);
    if (local.ok()) {
      // Root passes access(W_OK) on a read-only mount or in a directory the writer cannot use:
      // only creating a file tells.
      const std::string probe =
          o_.checkpoint_dir + "/.cpd-write-probe." + std::to_string(::getpid());
      const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
      if (fd < 0) {
        local = Status::IoError("--checkpoint-dir " + o_.checkpoint_dir +
                                ": cannot write there: " + std::strerror(errno));
      } else {
        ::close(fd);
        ::unlink(probe.c_str());
      }
    }
  }
  return replicas_->AgreeOn(local, "--checkpoint-dir cannot be written on rank 0");
}

namespace {

// Typed reads of checkpoint metadata: a missing or wrongly typed field is an error, not an
// exception.
Result<int64_t> IntField(const json& obj, const char* key, const std::string& where) {
  const auto it = obj.find(key);
  if (it == obj.end() || !it->is_number_integer()) {
    return Status::InvalidArgument(where + key + " is " +
                                   (it == obj.end() ? std::string("missing") : it->dump()) +
                                   ", not an integer");
  }
  return it->get<int64_t>();
}

Result<std::string> StringField(const json& obj, const char* key, const std::string& where) {
  const auto it = obj.find(key);
  if (it == obj.end() || !it->is_string()) {
    return Status::InvalidArgument(where + key + " is not a string");
  }
  return it->get<std::string>();
}

Status CheckInRange(int64_t v, int64_t lo, int64_t hi, const std::string& what) {
  if (v < lo || v > hi) {
    return Status::InvalidArgument(what + " " + std::to_string(v) + " is outside " +
                                   std::to_string(lo) + ".." + std::to_string(hi));
  }
  return Status::Ok();
}

// The index of the first value that is NaN or infinite, or -1.
int64_t FirstNonFinite(const std::vector<float>& v) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(v[i])) return int64_t(i);
  }
  return -1;
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// A checkpoint being restored: the file, named in every refusal, and the run it must fit.
struct RestoreCheck {
  const std::string& path;
  const CheckpointOptions& run;
  int64_t global_batch, batches_per_epoch;
  std::string optimizer;  // this run's --optimizer

  // A bad file: CorruptCheckpoint naming it. CorruptIf keeps OK as it is.
  Status Corrupt(const std::string& why) const { return CorruptCheckpoint(path, why); }
  Status CorruptIf(const Status& s) const { return s.ok() ? s : Corrupt(s.message()); }
};

// The metadata, a JSON object of the version this build reads.
Result<json> ReadMeta(const RestoreCheck& c, const Checkpoint& ck) {
  json meta = json::parse(ck.meta_json, nullptr, false);
  if (!meta.is_object()) return c.Corrupt("the metadata is not a JSON object");
  const auto v = meta.find("version");
  if (v == meta.end() || !v->is_number_integer() || v->get<int64_t>() != kCheckpointVersion) {
    return c.Corrupt("unsupported version " + (v == meta.end() ? "(none)" : v->dump()) +
                     " (this build reads version " + std::to_string(kCheckpointVersion) + ")");
  }
  return meta;
}

// The run it came from: the same model, data and global batch.
Status CheckSameRun(const RestoreCheck& c, const json& meta) {
  auto arch = StringField(meta, "arch", "meta.");
  auto dataset = StringField(meta, "dataset", "meta.");
  // Version-1 checkpoints of single-process runs stored the batch as "batch_size".
  auto saved_global =
      IntField(meta, meta.contains("global_batch") ? "global_batch" : "batch_size", "meta.");
  for (const Status& s : {arch.status(), dataset.status(), saved_global.status()}) {
    CPD_RETURN_IF_ERROR(c.CorruptIf(s));
  }
  // Older checkpoints do not say; their optimiser state's keys then decide (Optimizer::LoadState).
  const auto optimizer = meta.find("optimizer");
  if (optimizer != meta.end() && optimizer->is_string() && *optimizer != c.optimizer) {
    return Status::InvalidArgument("checkpoint " + c.path +
                                   " was written by a run with --optimizer " +
                                   optimizer->get<std::string>() + "; this run has --optimizer " +
                                   c.optimizer + " (resume with the optimizer that wrote it)");
  }
  if (*arch != c.run.arch || *dataset != c.run.dataset || *saved_global != c.global_batch) {
    return Status::InvalidArgument("checkpoint " + c.path + " was written by a run with --arch " +
                                   *arch + " --dataset " + *dataset + " and global batch " +
                                   std::to_string(*saved_global) + "; this run has --arch " +
                                   c.run.arch + " --dataset " + c.run.dataset +
                                   " and global batch " + std::to_string(c.global_batch));
  }
  return Status::Ok();
}

// Where it stands: step, epoch and the iterator, in range and consistent with each other.
Status ReadPosition(const RestoreCheck& c, const json& meta, ResumePoint* point,
                    IteratorState* it) {
  auto step = IntField(meta, "step", "meta.");
  auto epoch = IntField(meta, "epoch", "meta.");
  CPD_RETURN_IF_ERROR(c.CorruptIf(step.status()));
  CPD_RETURN_IF_ERROR(c.CorruptIf(epoch.status()));
  const auto iter = meta.find("iterator");
  if (iter == meta.end() || !iter->is_object()) return c.Corrupt("meta.iterator is not an object");
  auto it_epoch = IntField(*iter, "epoch", "meta.iterator.");
  auto it_next = IntField(*iter, "next_batch", "meta.iterator.");
  CPD_RETURN_IF_ERROR(c.CorruptIf(it_epoch.status()));
  CPD_RETURN_IF_ERROR(c.CorruptIf(it_next.status()));
  CPD_RETURN_IF_ERROR(c.CorruptIf(CheckInRange(*step, 0, int64_t(1) << 53, "meta.step")));
  CPD_RETURN_IF_ERROR(c.CorruptIf(CheckInRange(*it_epoch, 0, 1 << 30, "meta.iterator.epoch")));
  CPD_RETURN_IF_ERROR(
      c.CorruptIf(CheckInRange(*it_next, 0, c.batches_per_epoch, "meta.iterator.next_batch")));
  // The recorded epoch is the iterator's, or the next one once its last batch is done.
  if (!(*epoch == *it_epoch || (*epoch == *it_epoch + 1 && *it_next == c.batches_per_epoch))) {
    return c.Corrupt("meta.epoch " + std::to_string(*epoch) +
                     " does not go with the iterator at "
                     "batch " +
                     std::to_string(*it_next) + " of epoch " + std::to_string(*it_epoch));
  }
  // Steps done: every past epoch's batches plus this one's. A run of one worker keeps the
  // last partial batch that several workers drop, so each past epoch may differ by one.
  const int64_t expected = *it_epoch * c.batches_per_epoch + *it_next;
  if (*step < expected - *it_epoch || *step > expected + *it_epoch) {
    return c.Corrupt("meta.step " + std::to_string(*step) + " does not go with batch " +
                     std::to_string(*it_next) + " of epoch " + std::to_string(*it_epoch) + " (" +
                     std::to_string(c.batches_per_epoch) + " batches per epoch)");
  }
  if (*epoch > c.run.epochs) {
    return Status::InvalidArgument("checkpoint " + c.path + " is at epoch " +
                                   std::to_string(*epoch) + ", beyond this run's --epochs " +
                                   std::to_string(c.run.epochs));
  }
  point->step = *step;
  point->epoch = int(*epoch);
  it->epoch = *it_epoch;
  it->next_batch = *it_next;
  return Status::Ok();
}

// The schedule in force and the random stream's version, where the file recorded them.
Status ReadScheduleAndStream(const RestoreCheck& c, const json& meta, ResumePoint* point) {
  if (const auto sched = meta.find("schedule"); sched != meta.end()) {
    if (!sched->is_object()) return c.Corrupt("meta.schedule is not an object");
    point->schedule_json = sched->dump();
  }
  if (const auto rs = meta.find("random_stream"); rs != meta.end()) {
    if (!rs->is_number_integer() || rs->get<int64_t>() < 1) {
      return c.Corrupt("meta.random_stream is not a version number");
    }
    point->random_stream = int(rs->get<int64_t>());
  }
  return Status::Ok();
}

// The dynamic loss scale where it stood, restored into `scaler` (a static one, or none, is the
// command line's).
Status ReadLossScale(const RestoreCheck& c, const json& meta, LossScaler* scaler) {
  const auto ls = meta.find("loss_scale");
  if (ls == meta.end()) return Status::Ok();
  if (!ls->is_object()) return c.Corrupt("meta.loss_scale is not an object");
  auto in_a_row = IntField(*ls, "finite_in_a_row", "meta.loss_scale.");
  CPD_RETURN_IF_ERROR(c.CorruptIf(in_a_row.status()));
  const auto scale = ls->find("scale");
  if (scale == ls->end() || !scale->is_number()) {
    return c.Corrupt("meta.loss_scale.scale is not a number");
  }
  const Status s = scaler->Restore({scale->get<double>(), *in_a_row});
  if (!s.ok()) return c.Corrupt("meta.loss_scale: " + s.message());
  return Status::Ok();
}

// The sums of a mid-epoch checkpoint, consistent with its position `it` in the epoch (absent
// from checkpoints written before they were kept: the resumed epoch then reports its later
// steps).
Status ReadEpochSums(const RestoreCheck& c, const json& meta, const IteratorState& it,
                     ResumePoint* point) {
  const auto sums = meta.find("epoch_sums");
  if (sums == meta.end()) return Status::Ok();
  if (!sums->is_object()) return c.Corrupt("meta.epoch_sums is not an object");
  auto correct = IntField(*sums, "correct", "meta.epoch_sums.");
  auto seen = IntField(*sums, "seen", "meta.epoch_sums.");
  auto steps = IntField(*sums, "steps", "meta.epoch_sums.");
  for (const Status& s : {correct.status(), seen.status(), steps.status()}) {
    CPD_RETURN_IF_ERROR(c.CorruptIf(s));
  }
  const auto loss = sums->find("loss");
  if (loss == sums->end() || !loss->is_number() || !std::isfinite(loss->get<double>()) ||
      loss->get<double>() < 0) {
    return c.Corrupt("meta.epoch_sums.loss is not a finite number >= 0");
  }
  CPD_RETURN_IF_ERROR(c.CorruptIf(CheckInRange(*steps, 0, it.next_batch, "meta.epoch_sums.steps")));
  CPD_RETURN_IF_ERROR(c.CorruptIf(CheckInRange(
      *seen, 0, *steps * c.global_batch * c.run.labels_per_sample, "meta.epoch_sums.seen")));
  CPD_RETURN_IF_ERROR(c.CorruptIf(CheckInRange(*correct, 0, *seen, "meta.epoch_sums.correct")));
  if (it.next_batch > 0 && it.next_batch < c.batches_per_epoch) {
    point->epoch_sums = {loss->get<double>(), *correct, *seen, *steps};
  }
  return Status::Ok();
}

// The checkpoint's tensors, checked and sorted by where each goes. The pointers point into the
// checkpoint and the model.
struct TensorsToLoad {
  std::map<std::string, Tensor*> targets;  // the model's parameters and buffers by name
  std::map<std::string, std::vector<float>> opt_state;
  std::vector<std::pair<std::string, const std::vector<float>*>> hysteresis;  // by layer
};

// The model's parameters and buffers with their shapes, the optimiser's state and the
// hysteresis state of weight layers; all finite, running variances >= 0; nothing else.
Result<TensorsToLoad> CheckTensors(const RestoreCheck& c, const Checkpoint& ck, Sequential* model) {
  TensorsToLoad out;
  for (Param* p : model->Params()) out.targets["param/" + p->name] = &p->value;
  for (auto& [name, t] : model->Buffers()) out.targets["buffer/" + name] = t;
  std::map<std::string, size_t> weight_sizes;
  for (Param* p : model->Params()) weight_sizes[p->name] = p->value.numel();
  for (const std::string& name : ck.order) {
    const std::vector<float>& v = ck.data.at(name);
    if (const int64_t bad = FirstNonFinite(v); bad >= 0) {
      return c.Corrupt(name + " holds a non-finite value (" + std::to_string(v[size_t(bad)]) +
                       " at index " + std::to_string(bad) + ")");
    }
    if (out.targets.count(name) > 0) {
      const Tensor& t = *out.targets.at(name);
      if (ck.shapes.at(name) != t.shape()) {
        return c.Corrupt(name + " has shape " + ShapeText(ck.shapes.at(name)) +
                         "; the model's is " + ShapeText(t.shape()));
      }
      const std::string suffix = ".running_var";
      if (name.size() > suffix.size() &&
          name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
          std::any_of(v.begin(), v.end(), [](float x) { return x < 0; })) {
        return c.Corrupt(name + " holds a negative variance");
      }
    } else if (name.rfind("opt/", 0) == 0) {
      out.opt_state[name.substr(4)] = v;
    } else if (name.rfind("hyst/", 0) == 0) {
      const auto w = weight_sizes.find(name.substr(5) + ".weight");
      if (w == weight_sizes.end() || w->second != v.size()) {
        return c.Corrupt(name + " is not the hysteresis state of a weight layer of this model");
      }
      out.hysteresis.emplace_back(name.substr(5), &v);
    } else {
      return c.Corrupt("it holds '" + name + "', which this model does not have");
    }
  }
  for (const auto& [name, t] : out.targets) {
    if (!ck.Has(name)) return c.Corrupt("missing " + name);
  }
  return out;
}

}  // namespace

// Every field is checked against this run and this model before any of it is used: a
// checkpoint either fits whole or leaves the state untouched.
Result<ResumePoint> Checkpointer::Restore(const std::string& path) {
  CPD_ASSIGN_OR_RETURN(const Checkpoint ck, ReadCheckpoint(path));
  const RestoreCheck c{path, o_, global_batch_, batches_per_epoch_,
                       OptimizerKindName(state_.optimizer->options().kind)};
  CPD_ASSIGN_OR_RETURN(const json meta, ReadMeta(c, ck));
  CPD_RETURN_IF_ERROR(CheckSameRun(c, meta));
  ResumePoint point;
  IteratorState it;
  CPD_RETURN_IF_ERROR(ReadPosition(c, meta, &point, &it));
  CPD_RETURN_IF_ERROR(ReadScheduleAndStream(c, meta, &point));
  LossScaler scaler = state_.scaler != nullptr ? *state_.scaler : LossScaler(LossScaleOptions{});
  CPD_RETURN_IF_ERROR(ReadLossScale(c, meta, &scaler));
  CPD_RETURN_IF_ERROR(ReadEpochSums(c, meta, it, &point));
  CPD_ASSIGN_OR_RETURN(const TensorsToLoad tensors, CheckTensors(c, ck, state_.model));

  // The optimiser and the iterator check their parts whole before taking any of it (the
  // iterator's range is checked above, so it cannot refuse after the optimiser took its state).
  CPD_RETURN_IF_ERROR(c.CorruptIf(state_.optimizer->LoadState(tensors.opt_state)));
  CPD_RETURN_IF_ERROR(c.CorruptIf(state_.iterator->Restore(it)));
  for (const auto& [name, t] : tensors.targets) {
    t->CopyFromHost(ck.data.at(name).data());  // any device
  }
  for (const auto& [layer, q] : tensors.hysteresis) {
    state_.quant->RestoreHysteresisState(layer, *q);
  }
  if (state_.scaler != nullptr) *state_.scaler = scaler;
  // The file resumed from is this step's checkpoint: the end of the run must not write it again.
  last_saved_step_ = point.step;
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
