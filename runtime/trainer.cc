#include "runtime/trainer.h"

#include <omp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "cpd/schedule.h"
#include "runtime/checkpoint.h"
#include "runtime/data.h"
#include "runtime/job_control.h"
#include "runtime/layers.h"
#include "runtime/models.h"
#include "runtime/optimizer.h"

extern "C" void openblas_set_num_threads(int num_threads);

namespace cpd::runtime {

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

constexpr int kCheckpointVersion = 1;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

Status Validate(const TrainOptions& o) {
  auto bad = [](const std::string& m) { return Status::InvalidArgument(m); };
  if (o.epochs < 1) return bad("--epochs must be >= 1, got " + std::to_string(o.epochs));
  if (o.batch_size < 1) return bad("--batch-size must be >= 1");
  if (o.global_batch < 0) return bad("--global-batch must be >= 1 (or 0: batch-size x workers)");
  if (o.emulate_ranks < 1 || o.emulate_ranks > 4096) {
    return bad("--emulate-ranks must be in 1..4096, got " + std::to_string(o.emulate_ranks));
  }
  if (o.measure_error_every < 0) return bad("--measure-error must be >= 0");
  if (o.debug_step_sleep_ms < 0) return bad("--debug-step-sleep-ms must be >= 0");
  CPD_RETURN_IF_ERROR(o.allreduce.Validate());
  if (o.lr <= 0 || !std::isfinite(o.lr)) return bad("--lr must be a positive number");
  if (o.momentum < 0 || o.momentum >= 1) return bad("--momentum must be in [0, 1)");
  if (o.weight_decay < 0) return bad("--weight-decay must be >= 0");
  if (o.optimizer != "sgd" && o.optimizer != "lars") {
    return bad("--optimizer '" + o.optimizer + "' (accepted: sgd, lars)");
  }
  if (o.lr_schedule != "constant" && o.lr_schedule != "step" && o.lr_schedule != "cosine") {
    return bad("--lr-schedule '" + o.lr_schedule + "' (accepted: constant, step, cosine)");
  }
  if (o.stats_every < 0) return bad("--stats-every must be >= 0");
  if (o.checkpoint_every < 0) return bad("--checkpoint-every must be >= 0");
  if (!o.resume.empty() && o.resume != "auto" && access(o.resume.c_str(), R_OK) != 0) {
    return bad("--resume: cannot read checkpoint '" + o.resume + "'");
  }
  if (o.resume == "auto" && o.checkpoint_dir.empty()) {
    return bad("--resume auto needs --checkpoint-dir");
  }
  if (o.device != "auto" && o.device != "cpu" && o.device != "cuda") {
    return bad("--device '" + o.device + "' (accepted: auto, cpu, cuda)");
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

// A terminal progress bar with rate and ETA; plain periodic lines when not a terminal.
class Progress {
 public:
  Progress(bool enabled, bool tty) : enabled_(enabled), tty_(tty) {}
  void Update(int epoch, int epochs, int64_t batch, int64_t batches, double loss,
              double images_per_s, double eta_s, int bits) {
    if (!enabled_) return;
    if (tty_) {
      const int width = 30;
      const int filled = batches > 0 ? int(width * batch / batches) : width;
      std::string bar(size_t(filled), '#');
      bar.resize(size_t(width), '.');
      std::printf("\r  epoch %d/%d [%s] %lld/%lld loss %.4f %6.0f img/s ETA %5.0fs%s", epoch,
                  epochs, bar.c_str(), static_cast<long long>(batch),
                  static_cast<long long>(batches), loss, images_per_s, eta_s,
                  bits > 0 ? (" bits " + std::to_string(bits)).c_str() : "");
      std::fflush(stdout);
      dirty_ = true;
    } else if (batch % 100 == 0 || batch == batches) {
      std::printf("  epoch %d/%d step %lld/%lld loss %.4f %.0f img/s eta %.0fs\n", epoch, epochs,
                  static_cast<long long>(batch), static_cast<long long>(batches), loss,
                  images_per_s, eta_s);
      std::fflush(stdout);
    }
  }
  void EndLine() {
    if (dirty_) std::printf("\r%100s\r", "");
    dirty_ = false;
  }

 private:
  bool enabled_, tty_;
  bool dirty_ = false;
};

// Sums `local` over the ranks in rank order (an all-gather, then the same additions on every
// rank), so that every rank gets bit-identical results, whatever the MPI reduction order.
Result<std::vector<float>> SumInRankOrder(comm::Communicator* comm,
                                          const std::vector<float>& local) {
  if (comm->size() == 1) return local;
  std::vector<float> all(local.size() * size_t(comm->size()));
  CPD_RETURN_IF_ERROR(comm->AllGather(local.data(), all.data(), local.size()));
  std::vector<float> sum(local.size(), 0.0f);
  for (int r = 0; r < comm->size(); ++r) {
    for (size_t i = 0; i < local.size(); ++i) sum[i] += all[size_t(r) * local.size() + i];
  }
  return sum;
}

// `t` itself when it is in host memory, else a host copy.
Tensor OnHost(const Tensor& t) { return t.device() == Device::kCpu ? t : t.To(Device::kCpu); }

// FNV-1a over the bytes of every parameter value.
uint64_t HashParams(const std::vector<Param*>& params) {
  uint64_t h = 1469598103934665603ull;
  for (const Param* p : params) {
    const Tensor v = OnHost(p->value);
    const auto* b = reinterpret_cast<const unsigned char*>(v.data());
    for (size_t i = 0; i < v.numel() * sizeof(float); ++i) {
      h = (h ^ b[i]) * 1099511628211ull;
    }
  }
  return h;
}

// Groups the params into the all-reducer's layers: consecutive params whose names share the
// prefix before the last '.' ("conv1.weight", "conv1.bias") form one layer (one APS shift).
comm::GradientLayout LayoutOf(const std::vector<Param*>& params) {
  comm::GradientLayout layout;
  layout.offsets.push_back(0);
  size_t offset = 0;
  for (const Param* p : params) {
    const size_t dot = p->name.rfind('.');
    const std::string layer = dot == std::string::npos ? p->name : p->name.substr(0, dot);
    if (layout.layer_names.empty() || layout.layer_names.back() != layer) {
      if (!layout.layer_names.empty()) layout.offsets.push_back(offset);
      layout.layer_names.push_back(layer);
    }
    offset += p->grad.numel();
  }
  if (!layout.layer_names.empty()) layout.offsets.push_back(offset);
  return layout;
}

// `x` itself on the CPU; else `x` copied into *staging on `device` (reused across calls).
Tensor ToDevice(const Tensor& x, Device device, Tensor* staging) {
  if (device == Device::kCpu) return x;
  ResizeOn(staging, x.shape(), device);
  staging->CopyFrom(x);
  return *staging;
}

struct Run {
  const TrainOptions& o;
  comm::Communicator* comm = nullptr;
  Device device = Device::kCpu;
  int world = 1, rank = 0, local_workers = 1, workers = 1;
  int64_t worker_batch = 0, global_batch = 0;
  Dataset train, test;
  std::unique_ptr<Sequential> model;
  std::vector<Layer*> quant_layers;
  std::unique_ptr<SiteQuantizer> quant;
  std::unique_ptr<Optimizer> optimizer;
  LrSchedule lr;
  std::unique_ptr<BatchIterator> iter;
  Tensor grad_flat;  // on a GPU: every param's gradient, as views (TrainOn)
  int64_t step = 0;
  int64_t last_saved_step = -1;
  int64_t batches_per_epoch = 0;
  std::ofstream metrics;
  JobControl* control = nullptr;  // the coordinator's schedules and reports (or none)
  std::string resumed_schedule;   // the schedule a checkpoint recorded ("" if none)

  explicit Run(const TrainOptions& opts) : o(opts) {}

  void Log(const json& j) {
    if (metrics.is_open()) {
      metrics << j.dump() << '\n';
      metrics.flush();
    }
  }

  Status SaveCheckpoint(int epoch) {
    Checkpoint ck;
    json meta;
    meta["version"] = kCheckpointVersion;
    meta["step"] = step;
    meta["epoch"] = epoch;
    const IteratorState it = iter->state();
    meta["iterator"] = {{"epoch", it.epoch}, {"next_batch", it.next_batch}};
    meta["arch"] = o.arch;
    meta["dataset"] = o.dataset;
    meta["global_batch"] = global_batch;
    meta["seed"] = o.seed;
    if (control != nullptr) meta["schedule"] = json::parse(control->ScheduleJson());
    ck.meta_json = meta.dump();
    // Tensors on the GPU are copied to the host first.
    auto put = [&ck](const std::string& key, const Tensor& t) {
      const Tensor h = OnHost(t);
      ck.Put(key, h.shape(), h.data(), h.numel());
    };
    for (Param* p : model->Params()) put("param/" + p->name, p->value);
    for (auto& [name, t] : model->Buffers()) put("buffer/" + name, *t);
    for (auto& [name, t] : optimizer->State()) put("opt/" + name, *t);
    for (auto& [layer, q] : quant->HysteresisState()) {
      ck.Put("hyst/" + layer, {int64_t(q->size())}, q->data(), q->size());
    }
    ::mkdir(o.checkpoint_dir.c_str(), 0755);
    CPD_RETURN_IF_ERROR(WriteCheckpoint(CheckpointPath(o.checkpoint_dir, step), ck));
    last_saved_step = step;
    return Status::Ok();
  }

  // Rank 0 writes; every rank learns whether it worked, so that none goes on alone.
  Status SaveCheckpointOnce(int epoch) {
    Status s = Status::Ok();
    if (rank == 0) s = SaveCheckpoint(epoch);
    last_saved_step = step;
    if (world == 1) return s;
    int32_t failed = s.ok() ? 0 : 1;
    CPD_RETURN_IF_ERROR(comm->AllReduce(&failed, 1, comm::ReduceOp::kMax));
    if (!s.ok()) return s;
    if (failed) return Status::IoError("writing the checkpoint failed on rank 0");
    return Status::Ok();
  }

  // Restores everything a step depends on; returns the epoch to continue in.
  Result<int> LoadCheckpoint(const std::string& path) {
    auto ck = ReadCheckpoint(path);
    if (!ck.ok()) return ck.status();
    json meta = json::parse(ck->meta_json, nullptr, false);
    if (meta.is_discarded() || meta.value("version", 0) != kCheckpointVersion) {
      return Status::Corruption("checkpoint " + path + ": unsupported version");
    }
    // Version-1 checkpoints of single-process runs stored the batch as "batch_size".
    const int64_t saved_global = meta.value("global_batch", meta.value("batch_size", int64_t(0)));
    if (meta.value("arch", "") != o.arch || meta.value("dataset", "") != o.dataset ||
        saved_global != global_batch) {
      return Status::InvalidArgument(
          "checkpoint " + path + " was written by a run with --arch " + meta.value("arch", "?") +
          " --dataset " + meta.value("dataset", "?") + " and global batch " +
          std::to_string(saved_global) + "; this run has --arch " + o.arch + " --dataset " +
          o.dataset + " and global batch " + std::to_string(global_batch));
    }
    auto take = [&](const std::string& key, Tensor* t) -> Status {
      if (!ck->Has(key)) return Status::Corruption("checkpoint " + path + ": missing " + key);
      const auto& v = ck->data.at(key);
      if (v.size() != t->numel()) {
        return Status::Corruption("checkpoint " + path + ": " + key + " has " +
                                  std::to_string(v.size()) + " values, the model needs " +
                                  std::to_string(t->numel()));
      }
      t->CopyFromHost(v.data());  // any device
      return Status::Ok();
    };
    for (Param* p : model->Params()) CPD_RETURN_IF_ERROR(take("param/" + p->name, &p->value));
    for (auto& [name, t] : model->Buffers()) CPD_RETURN_IF_ERROR(take("buffer/" + name, t));
    std::map<std::string, std::vector<float>> opt_state;
    for (const auto& name : ck->order) {
      if (name.rfind("opt/", 0) == 0) opt_state[name.substr(4)] = ck->data.at(name);
    }
    CPD_RETURN_IF_ERROR(optimizer->LoadState(opt_state));
    step = meta.value("step", int64_t(0));
    quant->SetStep(step);
    if (meta.contains("schedule")) resumed_schedule = meta["schedule"].dump();
    for (const auto& name : ck->order) {
      if (name.rfind("hyst/", 0) == 0) {
        quant->RestoreHysteresisState(name.substr(5), ck->data.at(name));
      }
    }
    IteratorState st;
    st.epoch = meta["iterator"].value("epoch", int64_t(0));
    st.next_batch = meta["iterator"].value("next_batch", int64_t(0));
    CPD_RETURN_IF_ERROR(iter->Restore(st));
    return meta.value("epoch", 0);
  }

  // Test-set accuracy and loss in evaluation mode, the test set sharded over the ranks.
  Result<std::pair<double, double>> Evaluate() {
    quant->SetEval(true);
    BatchIterator it(test, 500, /*shuffle=*/false, /*augment=*/false, o.seed, false);
    CPD_RETURN_IF_ERROR(it.SetShard(rank, world));
    it.StartEpoch(0);
    Tensor x;
    std::vector<int32_t> y;
    SoftmaxCrossEntropy ce;
    Tensor dlogits;
    double loss_sum = 0;
    int64_t correct = 0, seen = 0;
    Tensor x_dev;
    while (it.Next(&x, &y)) {
      if (y.empty()) continue;  // this rank's share of the last batch
      Tensor logits = model->Forward(ToDevice(x, device, &x_dev), /*train=*/false);
      loss_sum += double(ce.Forward(logits, y, &dlogits)) * double(y.size());
      correct += SoftmaxCrossEntropy::CountCorrect(logits, y);
      seen += int64_t(y.size());
    }
    quant->SetEval(false);
    auto sums = SumInRankOrder(comm, {float(loss_sum), float(correct), float(seen)});
    if (!sums.ok()) return sums.status();
    const double n = (*sums)[2];
    return std::make_pair(n > 0 ? double((*sums)[1]) / n : 0.0,
                          n > 0 ? double((*sums)[0]) / n : 0.0);
  }
};

json StatsJson(const std::vector<SiteRecord>& records) {
  json layers = json::array();
  for (const SiteRecord& r : records) {
    const double n = r.stats.count > 0 ? double(r.stats.count) : 1.0;
    layers.push_back({{"layer", r.layer},
                      {"site", SiteName(r.site)},
                      {"format", r.format},
                      {"max_abs", r.stats.max_abs},
                      {"saturated", double(r.stats.saturated) / n},
                      {"flushed", double(r.stats.flushed) / n},
                      {"nonfinite", r.stats.nonfinite},
                      {"rel_error", r.stats.relative_error()}});
  }
  return layers;
}

// Reduces per-layer site statistics over the ranks (sums of counts and squares, max of max|x|),
// so that what is logged describes the whole global batch of worker 0 on every rank.
Status ReduceRecords(comm::Communicator* comm, std::vector<SiteRecord>* records) {
  if (comm->size() == 1 || records->empty()) return Status::Ok();
  std::vector<uint64_t> counts;
  std::vector<float> sums, maxes;
  for (const SiteRecord& r : *records) {
    counts.insert(counts.end(),
                  {r.stats.count, r.stats.saturated, r.stats.flushed, r.stats.nonfinite});
    sums.insert(sums.end(), {float(r.stats.sq_error), float(r.stats.sq_input)});
    maxes.push_back(r.stats.max_abs);
  }
  CPD_RETURN_IF_ERROR(comm->AllReduce(counts.data(), counts.size(), comm::ReduceOp::kSum));
  CPD_RETURN_IF_ERROR(comm->AllReduce(maxes.data(), maxes.size(), comm::ReduceOp::kMax));
  auto total = SumInRankOrder(comm, sums);
  if (!total.ok()) return total.status();
  for (size_t i = 0; i < records->size(); ++i) {
    QuantStats& st = (*records)[i].stats;
    st.count = counts[4 * i];
    st.saturated = counts[4 * i + 1];
    st.flushed = counts[4 * i + 2];
    st.nonfinite = counts[4 * i + 3];
    st.sq_error = (*total)[2 * i];
    st.sq_input = (*total)[2 * i + 1];
    st.max_abs = maxes[i];
  }
  return Status::Ok();
}

json CommStatsJson(const std::vector<comm::LayerCommStats>& stats) {
  json layers = json::array();
  for (const auto& s : stats) {
    json j = {{"layer", s.layer},
              {"shift", s.shift},
              {"max_abs", s.max_abs},
              {"flushed", s.flushed},
              {"saturated", s.saturated}};
    if (s.rel_error >= 0) j["rel_error"] = s.rel_error;
    layers.push_back(j);
  }
  return layers;
}

// Storage bits of a format spec (0 for fp32, which is not quantised).
int FormatBits(const std::string& spec) {
  if (spec == "fp32") return 0;
  auto f = Format::Parse(spec);
  return f.ok() ? f->bits() : 0;
}

// The per-layer rows of a coordinator report: the quantisation sites (reduced over the ranks),
// hysteresis flips since the last report, and the all-reduce's per-layer statistics.
std::vector<LayerReport> LayerReports(const std::vector<SiteRecord>& records,
                                      const std::map<std::string, uint64_t>& flips,
                                      const std::vector<comm::LayerCommStats>& comm_stats,
                                      const std::string& comm_format) {
  std::vector<LayerReport> out;
  for (const SiteRecord& r : records) {
    const double n = r.stats.count > 0 ? double(r.stats.count) : 1.0;
    LayerReport l;
    l.layer = r.layer;
    l.site = SiteName(r.site);
    l.format = r.format;
    l.bits = FormatBits(r.format);
    l.max_abs = r.stats.max_abs;
    l.saturated = double(r.stats.saturated) / n;
    l.flushed = double(r.stats.flushed) / n;
    l.rel_error = r.stats.relative_error();
    l.nonfinite = r.stats.nonfinite;
    if (r.site == Site::kWeight) {
      auto f = flips.find(r.layer);
      if (f != flips.end()) l.flips = f->second;
    }
    out.push_back(l);
  }
  const int comm_bits = FormatBits(comm_format);
  for (const auto& c : comm_stats) {
    LayerReport l;
    l.layer = c.layer;
    l.site = "comm";
    l.format = comm_format;
    l.bits = comm_bits;
    l.aps_shift = c.shift;
    l.max_abs = c.max_abs;
    l.saturated = c.saturated;
    l.flushed = c.flushed;
    l.rel_error = c.rel_error;
    out.push_back(l);
  }
  return out;
}

// Every rank's host name and pid, gathered on every rank (for the coordinator's registration).
Result<std::vector<JobDescription::Worker>> GatherWorkers(comm::Communicator* comm) {
  constexpr size_t kHost = 120;
  std::vector<uint8_t> mine(kHost + sizeof(int64_t), 0);
  char host[kHost] = {};
  if (gethostname(host, kHost - 1) != 0) std::strcpy(host, "?");
  std::memcpy(mine.data(), host, kHost);
  const int64_t pid = getpid();
  std::memcpy(mine.data() + kHost, &pid, sizeof pid);
  std::vector<uint8_t> all(mine.size() * size_t(comm->size()));
  CPD_RETURN_IF_ERROR(comm->AllGatherBytes(mine.data(), all.data(), mine.size()));
  std::vector<JobDescription::Worker> out;
  for (int r = 0; r < comm->size(); ++r) {
    const uint8_t* rec = all.data() + size_t(r) * mine.size();
    JobDescription::Worker w;
    w.rank = r;
    w.host.assign(reinterpret_cast<const char*>(rec),
                  strnlen(reinterpret_cast<const char*>(rec), kHost));
    std::memcpy(&w.pid, rec + kHost, sizeof w.pid);
    out.push_back(w);
  }
  return out;
}

// The model's leaf layers as the coordinator lists them.
std::vector<JobDescription::LayerInfo> LayerInfos(Sequential& model) {
  std::vector<JobDescription::LayerInfo> out;
  for (Layer* l : model.Flatten()) {
    if (l->Flatten().size() != 1) continue;  // composites: their children are listed
    JobDescription::LayerInfo info;
    info.name = l->name();
    info.kind = l->kind();
    info.quantizable = l->Quantizable();
    for (Param* p : l->Params()) info.params += int64_t(p->value.numel());
    out.push_back(info);
  }
  return out;
}

// "<arch>-<dataset>-<UTC yyyymmdd-hhmmss>": a job name when the user gives none.
std::string DefaultJobName(const TrainOptions& o) {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char when[32];
  std::strftime(when, sizeof when, "%Y%m%d-%H%M%S", &tm);
  return o.arch + "-" + o.dataset + "-" + when;
}

// CPT's relative cost (cpd/schedule.h) of a run whose forward bits per step are `planned`; a
// step without CPT (0) counts as static training at `static_bits`.
double PlannedRelativeCost(std::vector<int> planned, int grad_bits, int static_bits) {
  for (int& b : planned) {
    if (b == 0) b = static_bits;
  }
  return RelativeCost(planned, grad_bits, static_bits);
}

// Rows [begin, end) of a batch tensor, as a new tensor.
Tensor SliceRows(const Tensor& x, int64_t begin, int64_t end) {
  std::vector<int64_t> shape = x.shape();
  shape[0] = end - begin;
  Tensor out(shape);
  const size_t row = x.numel() / size_t(x.dim(0));
  std::copy(x.data() + size_t(begin) * row, x.data() + size_t(end) * row, out.data());
  return out;
}

// --device: auto picks CUDA when the build has it and cudaGetDeviceCount finds a GPU.
Result<Device> ResolveDevice(const std::string& flag) {
  if (flag == "cpu") return Device::kCpu;
  std::string why;
  const bool cuda = CudaAvailable(&why);
  if (flag == "auto") return cuda ? Device::kCuda : Device::kCpu;
  if (!cuda) {
    return Status::Unavailable("--device cuda: no usable GPU (" + why + "); use --device cpu");
  }
  return Device::kCuda;
}

Result<TrainResult> TrainOn(const TrainOptions& o, comm::Communicator* comm);

}  // namespace

Result<TrainResult> Train(const TrainOptions& o, comm::Communicator* comm) {
  // The layers report CUDA failures (and misuse) by exceptions; the trainer's callers get them
  // as a Status, like every other failure.
  try {
    return TrainOn(o, comm);
  } catch (const std::exception& e) {
    return Status::Internal(std::string("training failed: ") + e.what());
  }
}

namespace {

Result<TrainResult> TrainOn(const TrainOptions& o, comm::Communicator* comm) {
  CPD_RETURN_IF_ERROR(Validate(o));
  CoordinatorOptions coord_opts = o.coordinator;
  const bool coordinated = !coord_opts.address.empty();
  if (coordinated) {
    if (coord_opts.job_name.empty()) coord_opts.job_name = DefaultJobName(o);
    CPD_RETURN_IF_ERROR(CheckCoordinatorOptions(coord_opts));
    if (!(o.report_interval_s > 0)) {
      return Status::InvalidArgument("--report-interval must be a positive number of seconds");
    }
  }
  auto device = ResolveDevice(o.device);
  if (!device.ok()) return device.status();
  comm::SelfCommunicator self;
  if (comm == nullptr) comm = &self;
  if (*device == Device::kCuda && comm->size() > 1) {
    // The ranks of a node take its GPUs in turn (before any CUDA tensor exists).
    const int local = comm::LocalRankFromEnv();
    SelectCudaDevice(local >= 0 ? local : comm->rank());
  }
  const int threads = o.threads > 0 ? o.threads : omp_get_num_procs();
  omp_set_num_threads(threads);
  openblas_set_num_threads(threads);

  Run run(o);
  run.comm = comm;
  run.device = *device;
  run.world = comm->size();
  run.rank = comm->rank();
  run.local_workers = o.emulate_ranks;
  run.workers = run.world * run.local_workers;
  if (o.global_batch > 0) {
    if (o.global_batch % run.workers != 0) {
      return Status::InvalidArgument("--global-batch " + std::to_string(o.global_batch) +
                                     " does not split evenly over " + std::to_string(run.workers) +
                                     " workers (" + std::to_string(run.world) + " ranks x " +
                                     std::to_string(run.local_workers) + " emulated)");
    }
    run.worker_batch = o.global_batch / run.workers;
  } else {
    run.worker_batch = o.batch_size;
  }
  run.global_batch = run.worker_batch * run.workers;
  const bool lead = run.rank == 0;
  const bool quiet = o.quiet || !lead;

  auto data = LoadDatasetPair(o.dataset, o.data_dir, o.seed);
  if (!data.ok()) return data.status();
  run.train = std::move(data->first);
  run.test = std::move(data->second);
  const ChannelStats norm = ComputeChannelStats(run.train);
  Normalize(&run.train, norm);
  Normalize(&run.test, norm);

  const int in_ch = o.in_channels > 0 ? o.in_channels : run.train.channels;
  const int size = o.image_size > 0 ? o.image_size : run.train.height;
  const int classes = o.classes > 0 ? o.classes : run.train.classes;
  if (in_ch != run.train.channels || size != run.train.height || classes < run.train.classes) {
    return Status::InvalidArgument(
        "--in-channels/--image-size/--classes (" + std::to_string(in_ch) + ", " +
        std::to_string(size) + ", " + std::to_string(classes) + ") do not fit dataset '" +
        o.dataset + "' (" + std::to_string(run.train.channels) + ", " +
        std::to_string(run.train.height) + ", " + std::to_string(run.train.classes) + ")");
  }
  auto model = BuildModel(o.arch, in_ch, size, classes, o.seed);
  if (!model.ok()) return model.status();
  run.model = std::move(model.value());
  if (run.device != Device::kCpu && !o.print_model) {
    MoveToDevice(run.model.get(), run.device);
    // The gradients as views of one flat device buffer, so that staging them to the host for
    // the all-reduce (which sums host memory) is one copy each way per step.
    size_t total = 0;
    for (Param* p : run.model->Params()) total += p->grad.numel();
    run.grad_flat = Tensor({int64_t(total)}, run.device);
    size_t off = 0;
    for (Param* p : run.model->Params()) {
      p->grad = run.grad_flat.Slice(off, p->grad.shape());
      off += p->grad.numel();
    }
  }
  for (Layer* l : run.model->Flatten()) {
    if (l->Quantizable()) run.quant_layers.push_back(l);
  }
  if (o.print_model) {
    if (lead) std::printf("%s", DescribeModel(*run.model).c_str());
    return TrainResult{};
  }

  // One iterator per rank over the shared permutation: a step takes a global batch, this rank
  // gets its K workers' slices in one piece. Several workers drop the last partial batch, so
  // that every worker's gradient is a mean over the same number of samples.
  const bool augment = o.augment_set ? o.augment : o.dataset.rfind("cifar", 0) == 0;
  run.iter = std::make_unique<BatchIterator>(run.train, run.worker_batch * run.local_workers,
                                             /*shuffle=*/true, augment, o.seed,
                                             /*drop_last=*/run.workers > 1);
  CPD_RETURN_IF_ERROR(run.iter->SetShard(run.rank, run.world));
  run.batches_per_epoch = run.iter->batches_per_epoch();
  if (run.batches_per_epoch < 1) {
    return Status::InvalidArgument("global batch " + std::to_string(run.global_batch) +
                                   " exceeds the " + std::to_string(run.train.count) +
                                   " training samples");
  }
  const int64_t total_steps = run.batches_per_epoch * o.epochs;

  PrecisionConfig pc = o.precision;
  if (pc.cpt) {
    pc.cpt->total_iters = total_steps;
    CPD_RETURN_IF_ERROR(pc.cpt->Validate());
  }
  pc.seed = kernels::SplitMix64(o.seed ^ 0x51u);
  auto quant = SiteQuantizer::Create(pc, run.quant_layers);
  if (!quant.ok()) return quant.status();
  run.quant = std::move(quant.value());
  run.quant->InstallHooks(run.quant_layers);

  OptimizerOptions oo;
  oo.momentum = o.momentum;
  oo.weight_decay = o.weight_decay;
  oo.nesterov = o.nesterov;
  oo.lars = o.optimizer == "lars";
  oo.lars_eta = o.lars_eta;
  oo.threads = threads;
  CPD_RETURN_IF_ERROR(oo.Validate());
  const std::vector<Param*> params = run.model->Params();
  run.optimizer = std::make_unique<Optimizer>(params, oo);

  // The gradient all-reducer over the flat gradients of the K local workers.
  comm::GradientAllReduceOptions ar = o.allreduce;
  ar.seed = kernels::SplitMix64(o.seed ^ 0xA11u);
  ar.threads = threads;
  const comm::GradientLayout layout = LayoutOf(params);
  auto reducer = comm::GradientAllReducer::Create(comm, ar, layout, run.local_workers);
  if (!reducer.ok()) return reducer.status();
  std::vector<std::vector<float>> flat(size_t(run.local_workers),
                                       std::vector<float>(layout.total()));
  std::vector<float*> flat_ptrs;
  for (auto& f : flat) flat_ptrs.push_back(f.data());

  std::vector<int64_t> milestones;
  for (int64_t e : o.lr_milestones) milestones.push_back(e * run.batches_per_epoch);
  auto lr =
      ParseLrSchedule(o.lr_schedule, o.lr, total_steps, o.warmup_steps, milestones, o.lr_gamma);
  if (!lr.ok()) return lr.status();
  run.lr = *lr;

  if (!o.metrics_out.empty()) {
    std::string path = o.metrics_out;
    const size_t at = path.find("{rank}");
    if (at != std::string::npos) path.replace(at, 6, std::to_string(run.rank));
    if (at != std::string::npos || lead) {
      run.metrics.open(path, std::ios::out | std::ios::app);
      if (!run.metrics) {
        return Status::IoError("--metrics-out: cannot open " + path + " for writing");
      }
    }
  }

  int start_epoch = 0;
  std::string resume_path = o.resume;
  if (o.resume == "auto") resume_path = LatestCheckpoint(o.checkpoint_dir);
  if (!resume_path.empty()) {
    auto e = run.LoadCheckpoint(resume_path);
    if (!e.ok()) return e.status();
    start_epoch = *e;
    // A checkpoint taken after the last batch of an epoch continues with the next epoch.
    const IteratorState it = run.iter->state();
    if (it.epoch == start_epoch && it.next_batch >= run.batches_per_epoch) ++start_epoch;
    if (!quiet) {
      std::printf("resumed from %s at step %lld (epoch %d)\n", resume_path.c_str(),
                  static_cast<long long>(run.step), start_epoch + 1);
    }
  } else {
    run.iter->StartEpoch(0);
  }
  // Identical replicas from the start: rank 0's parameters and buffers everywhere.
  if (run.world > 1) {
    // The communicator works on host memory: GPU tensors go through a host copy.
    auto broadcast = [&](Tensor* t) -> Status {
      Tensor h = OnHost(*t);
      CPD_RETURN_IF_ERROR(comm->Broadcast(h.data(), h.numel(), 0));
      if (t->device() != Device::kCpu) t->CopyFrom(h);
      return Status::Ok();
    };
    for (Param* p : params) CPD_RETURN_IF_ERROR(broadcast(&p->value));
    for (auto& [name, t] : run.model->Buffers()) CPD_RETURN_IF_ERROR(broadcast(t));
  }
  const std::vector<std::pair<std::string, Tensor*>> buffers = run.model->Buffers();
  size_t buffer_floats = 0;
  for (const auto& b : buffers) buffer_floats += b.second->numel();
  const bool sync_buffers = run.workers > 1 && buffer_floats > 0;

  const bool tty = isatty(STDOUT_FILENO) != 0;
  Progress progress(o.progress && !quiet, tty);
  if (!quiet) {
    std::string par;
    if (run.workers > 1) {
      par = ", " + std::to_string(run.world) + " rank(s) x " + std::to_string(run.local_workers) +
            " worker(s), all-reduce " + comm::AllReduceAlgoName(ar.algo);
      if (ar.algo != comm::AllReduceAlgo::kFp32) {
        par += " " + ar.format + (ar.aps ? " +APS" : "") + (ar.kahan ? " +Kahan" : "");
      }
    }
    std::printf(
        "cpd-train: %s on %s (%lld train / %lld test), %s, %d threads, batch %lld (%lld per "
        "worker)%s, %d epochs x %lld steps\n",
        o.arch.c_str(), o.dataset.c_str(), static_cast<long long>(run.train.count),
        static_cast<long long>(run.test.count), DeviceName(run.device), threads,
        static_cast<long long>(run.global_batch), static_cast<long long>(run.worker_batch),
        par.c_str(), o.epochs, static_cast<long long>(run.batches_per_epoch));
  }

  TrainResult result;
  result.world_size = run.world;
  result.workers = run.workers;
  // CPT's cost model over the whole schedule, against static training at MAX bits. A schedule
  // pushed by the coordinator replans the steps from where it takes effect.
  std::vector<int> planned_bits(size_t(total_steps), 0);
  int static_bits = pc.cpt ? pc.cpt->max_bits : 0;
  auto replan = [&](int64_t from) {
    for (int64_t t = from; t < total_steps; ++t) {
      planned_bits[size_t(t)] = pc.cpt ? pc.cpt->BitsAt(t) : 0;
    }
    if (static_bits > 0) {
      result.relative_cost = PlannedRelativeCost(planned_bits, pc.grad_bits, static_bits);
    }
  };
  replan(0);

  // The control plane: the coordinator's schedules (same step on every rank) and reports.
  std::unique_ptr<JobControl> control;
  std::map<std::string, uint64_t> flips_reported;  // hysteresis flips already reported
  if (coordinated) {
    JobControl::Setup cs;
    cs.comm = comm;
    cs.quant = run.quant.get();
    cs.quant_layers = run.quant_layers;
    cs.total_steps = total_steps;
    cs.seed = pc.seed;
    cs.report_interval_s = o.report_interval_s;
    cs.log = [&run](const json& record) { run.Log(record); };
    JobDescription job;
    job.arch = o.arch;
    job.dataset = o.dataset;
    job.allreduce = comm::AllReduceAlgoName(ar.algo);
    if (ar.algo != comm::AllReduceAlgo::kFp32) {
      job.allreduce += " " + ar.format + (ar.aps ? " +APS" : "") + (ar.kahan ? " +Kahan" : "");
    }
    job.world_size = run.world;
    job.emulate_ranks = run.local_workers;
    job.epochs = o.epochs;
    job.total_steps = total_steps;
    job.start_step = run.step;
    auto workers = GatherWorkers(comm);
    if (!workers.ok()) return workers.status();
    job.workers = std::move(workers.value());
    job.layers = LayerInfos(*run.model);
    job.schedule.precision = pc;
    job.schedule.set_by = "command line";
    auto c = JobControl::Start(coord_opts, cs, std::move(job), 1, run.resumed_schedule);
    if (!c.ok()) return c.status();
    control = std::move(c.value());
    run.control = control.get();
    if (!run.resumed_schedule.empty()) {
      pc = run.quant->config();
      if (pc.cpt && static_bits == 0) static_bits = pc.cpt->max_bits;
      replan(run.step);
    }
    if (!quiet) {
      std::printf("coordinator %s: job '%s' (reports every %lld steps and at least every %.1f s)\n",
                  coord_opts.address.c_str(), coord_opts.job_name.c_str(),
                  static_cast<long long>(o.stats_every), o.report_interval_s);
    }
  }
  // Rank 0's summary of the step just done, for the coordinator.
  auto step_report = [&](int epoch, double loss, double lr_now, double ips) {
    StepReport r;
    r.step = run.step - 1;
    r.epoch = epoch;
    r.loss = loss;
    r.lr = lr_now;
    r.bits = run.quant->CurrentBits();
    r.images_per_s = ips;
    r.ranks_alive = run.world;
    r.skipped_steps = uint64_t(result.skipped_steps);
    return r;
  };
  SoftmaxCrossEntropy ce;
  Tensor x, dlogits, x_dev;
  std::vector<int32_t> y;
  std::vector<float> buffers_before(buffer_floats), buffers_after;
  const auto t_start = Clock::now();
  int64_t steps_this_run = 0;
  bool stop = false;
  for (int epoch = start_epoch; epoch < o.epochs && !stop; ++epoch) {
    if (run.iter->state().epoch != epoch) run.iter->StartEpoch(epoch);
    const auto t_epoch = Clock::now();
    double loss_sum = 0;
    int64_t correct = 0, seen = 0, epoch_steps = 0;
    while (run.iter->Next(&x, &y)) {
      if (control) {
        bool switched = false;
        std::vector<std::string> messages;
        CPD_RETURN_IF_ERROR(control->BeforeStep(run.step, &switched, &messages));
        if (!quiet && !messages.empty()) {
          progress.EndLine();
          for (const std::string& m : messages) std::printf("%s\n", m.c_str());
          std::fflush(stdout);
        }
        if (switched) {
          pc = run.quant->config();
          result.schedule_switches.emplace_back(run.step, control->version());
          if (pc.cpt && static_bits == 0) static_bits = pc.cpt->max_bits;
          replan(run.step);
        }
      }
      run.quant->SetStep(run.step);
      const bool collect = o.stats_every > 0 && run.step % o.stats_every == 0;

      // Forward and backward of each local worker on its micro-batch.
      if (sync_buffers) {
        size_t off = 0;
        for (const auto& b : buffers) {
          b.second->CopyToHost(buffers_before.data() + off);
          off += b.second->numel();
        }
        buffers_after.assign(buffer_floats * size_t(run.local_workers), 0.0f);
      }
      const int64_t n = int64_t(y.size());
      float step_loss_sum = 0;
      int64_t step_correct = 0;
      for (int k = 0; k < run.local_workers; ++k) {
        const uint64_t worker = uint64_t(run.rank) * uint64_t(run.local_workers) + uint64_t(k);
        const int64_t begin = n * k / run.local_workers, end = n * (k + 1) / run.local_workers;
        Tensor xk = run.local_workers == 1 ? x : SliceRows(x, begin, end);
        xk = ToDevice(xk, run.device, &x_dev);
        const std::vector<int32_t> yk(y.begin() + begin, y.begin() + end);
        run.quant->SetWorker(worker);
        // Dropout masks: a stream per (step, worker); worker 0 of a 1-worker run keeps `step`.
        run.model->SetStep(uint64_t(run.step) * uint64_t(run.workers) + worker);
        run.quant->SetCollectStats(collect && k == 0);
        if (sync_buffers && k > 0) {
          size_t off = 0;
          for (const auto& b : buffers) {
            b.second->CopyFromHost(buffers_before.data() + off);
            off += b.second->numel();
          }
        }
        run.optimizer->ZeroGrad();
        Tensor logits = run.model->Forward(xk, /*train=*/true);
        const float loss = ce.Forward(logits, yk, &dlogits);
        run.model->Backward(dlogits);
        step_loss_sum += loss * float(yk.size());
        step_correct += SoftmaxCrossEntropy::CountCorrect(logits, yk);
        if (run.device == Device::kCpu) {
          size_t off = 0;
          for (Param* p : params) {
            std::copy(p->grad.data(), p->grad.data() + p->grad.numel(),
                      flat[size_t(k)].data() + off);
            off += p->grad.numel();
          }
        } else {
          run.grad_flat.CopyToHost(flat[size_t(k)].data());  // every gradient in one copy
        }
        if (run.step == o.debug_nan_step && worker == 0 && !flat[0].empty()) {
          flat[0][0] = std::numeric_limits<float>::quiet_NaN();
        }
        if (sync_buffers) {
          size_t boff = buffer_floats * size_t(k);
          for (const auto& b : buffers) {
            b.second->CopyToHost(buffers_after.data() + boff);
            boff += b.second->numel();
          }
        }
      }
      run.quant->SetWorker(0);

      // Sum the W gradients, average, and step (or skip the step everywhere on NaN/Inf).
      const bool measure = o.measure_error_every > 0 && run.step % o.measure_error_every == 0;
      CPD_RETURN_IF_ERROR((*reducer)->Reduce(flat_ptrs.data(), flat[0].data(), run.step, measure));
      const double lr_now = run.lr.At(run.step);
      const bool skipped = (*reducer)->last_nonfinite();
      if (skipped) {
        ++result.skipped_steps;
        if (!quiet) {
          progress.EndLine();
          std::printf("step %lld: NaN/Inf in a gradient on some rank; step skipped on all ranks\n",
                      static_cast<long long>(run.step));
        }
        run.Log({{"type", "skip"}, {"step", run.step}, {"reason", "nonfinite gradient"}});
      } else {
        const float inv_workers = 1.0f / float(run.workers);
        if (run.device == Device::kCpu) {
          size_t off = 0;
          for (Param* p : params) {
            float* g = p->grad.data();
            const float* src = flat[0].data() + off;
            for (size_t i = 0; i < p->grad.numel(); ++i) g[i] = src[i] * inv_workers;
            off += p->grad.numel();
          }
        } else {
          // The same float products on the host, then one copy back into the gradient views.
          float* src = flat[0].data();
          for (size_t i = 0; i < flat[0].size(); ++i) src[i] = src[i] * inv_workers;
          run.grad_flat.CopyFromHost(src);
        }
        run.optimizer->Step(lr_now);
      }
      if (sync_buffers) {
        // BatchNorm running statistics: the mean over the W workers' updates, identical everywhere.
        std::vector<float> local(buffer_floats, 0.0f);
        for (int k = 0; k < run.local_workers; ++k) {
          for (size_t i = 0; i < buffer_floats; ++i) {
            local[i] += buffers_after[size_t(k) * buffer_floats + i];
          }
        }
        auto total = SumInRankOrder(comm, local);
        if (!total.ok()) return total.status();
        size_t off = 0;
        std::vector<float> averaged;
        for (const auto& b : buffers) {
          averaged.resize(b.second->numel());
          for (size_t i = 0; i < b.second->numel(); ++i) {
            averaged[i] = (*total)[off + i] / float(run.workers);
          }
          b.second->CopyFromHost(averaged.data());
          off += b.second->numel();
        }
      }
      // Loss and accuracy of the global batch, the same on every rank.
      float loss = step_loss_sum / float(std::max<int64_t>(n, 1));
      int64_t global_n = n, global_correct = step_correct;
      if (run.world > 1) {
        auto sums = SumInRankOrder(comm, {step_loss_sum, float(step_correct), float(n)});
        if (!sums.ok()) return sums.status();
        global_n = int64_t((*sums)[2]);
        global_correct = int64_t((*sums)[1]);
        loss = (*sums)[0] / float(std::max<int64_t>(global_n, 1));
      }

      loss_sum += double(loss) * double(global_n);
      correct += global_correct;
      seen += global_n;
      result.step_losses.push_back(loss);
      ++run.step;
      ++epoch_steps;
      ++steps_this_run;

      std::vector<SiteRecord> records;
      if (collect || measure) {
        run.quant->SetCollectStats(false);
        records = run.quant->TakeRecords();
        CPD_RETURN_IF_ERROR(ReduceRecords(comm, &records));
        json j = {{"type", "step"},     {"step", run.step - 1},
                  {"epoch", epoch + 1}, {"loss", loss},
                  {"lr", lr_now},       {"bits", run.quant->CurrentBits()},
                  {"skipped", skipped}, {"layers", StatsJson(records)}};
        if (run.workers > 1 && !skipped) j["comm"] = CommStatsJson((*reducer)->last_stats());
        run.Log(j);
      }
      const double elapsed = Seconds(t_epoch, Clock::now());
      const double ips = elapsed > 0 ? double(seen) / elapsed : 0.0;
      const int64_t batch = run.iter->state().next_batch;
      const double eta =
          ips > 0 ? double((run.batches_per_epoch - batch) * run.global_batch) / ips : 0.0;
      progress.Update(epoch + 1, o.epochs, batch, run.batches_per_epoch, loss, ips, eta,
                      run.quant->CurrentBits());
      if (control && (collect || measure || control->SummaryDue())) {
        StepReport r = step_report(epoch + 1, loss, lr_now, ips);
        if (collect || measure) {
          std::map<std::string, uint64_t> flips = run.quant->Flips();
          std::map<std::string, uint64_t> delta;
          for (const auto& [name, f] : flips) delta[name] = f - flips_reported[name];
          flips_reported = std::move(flips);
          static const std::vector<comm::LayerCommStats> kNone;
          r.layers = LayerReports(records, delta,
                                  run.workers > 1 && !skipped ? (*reducer)->last_stats() : kNone,
                                  ar.algo == comm::AllReduceAlgo::kFp32 ? "fp32" : ar.format);
        }
        control->Report(std::move(r));
      }
      if (o.debug_step_sleep_ms > 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(o.debug_step_sleep_ms));
      }
      if (!o.checkpoint_dir.empty() && o.checkpoint_every > 0 &&
          run.step % o.checkpoint_every == 0) {
        CPD_RETURN_IF_ERROR(run.SaveCheckpointOnce(epoch));
      }
      if (o.max_steps > 0 && run.step >= o.max_steps) {
        stop = true;
        break;
      }
    }
    progress.EndLine();
    const double epoch_s = Seconds(t_epoch, Clock::now());
    const double train_acc = seen > 0 ? double(correct) / double(seen) : 0.0;
    const double train_loss = seen > 0 ? loss_sum / double(seen) : 0.0;
    double test_acc = 0, test_loss = 0;
    const bool epoch_complete = run.iter->state().next_batch >= run.batches_per_epoch;
    if (o.eval_each_epoch || epoch + 1 == o.epochs || stop) {
      auto ev = run.Evaluate();
      if (!ev.ok()) return ev.status();
      std::tie(test_acc, test_loss) = *ev;
    }
    const auto flips = run.quant->TakeFlips();
    flips_reported.clear();
    uint64_t total_flips = 0;
    json flips_json = json::object();
    for (const auto& [name, f] : flips) {
      if (o.precision.hysteresis) flips_json[name] = f;
      total_flips += f;
    }
    if (!quiet) {
      std::string extra;
      if (pc.cpt) {
        char buf[96];
        std::snprintf(buf, sizeof(buf), " bits %d-%d/%d cost %+.2f%%", pc.cpt->min_bits,
                      pc.cpt->max_bits, pc.grad_bits, 100.0 * result.relative_cost);
        extra += buf;
      }
      if (o.precision.hysteresis) extra += " flips " + std::to_string(total_flips);
      if (result.skipped_steps > 0) extra += " skipped " + std::to_string(result.skipped_steps);
      std::printf("epoch %d/%d loss %.4f train %.2f%% test %.2f%% %.0f img/s %.1f ms/step%s\n",
                  epoch + 1, o.epochs, train_loss, 100 * train_acc, 100 * test_acc,
                  epoch_s > 0 ? double(seen) / epoch_s : 0.0,
                  epoch_steps > 0 ? 1e3 * epoch_s / double(epoch_steps) : 0.0, extra.c_str());
      std::fflush(stdout);
    }
    run.Log({{"type", "epoch"},
             {"epoch", epoch + 1},
             {"step", run.step},
             {"loss", train_loss},
             {"train_accuracy", train_acc},
             {"test_accuracy", test_acc},
             {"test_loss", test_loss},
             {"bits", pc.cpt ? pc.cpt->max_bits : 0},
             {"images_per_s", epoch_s > 0 ? double(seen) / epoch_s : 0.0},
             {"relative_cost", result.relative_cost},
             {"skipped_steps", result.skipped_steps},
             {"flips", flips_json}});
    result.final_loss = train_loss;
    result.train_accuracy = train_acc;
    result.test_accuracy = test_acc;
    if (control) {
      StepReport r =
          step_report(epoch + 1, train_loss, run.lr.At(std::max<int64_t>(run.step - 1, 0)),
                      epoch_s > 0 ? double(seen) / epoch_s : 0.0);
      r.train_accuracy = train_acc;
      r.test_accuracy = test_acc;
      r.finished = stop || epoch + 1 == o.epochs;
      control->Report(std::move(r));
    }
    if (epoch_complete) result.epochs_done = epoch + 1;
    if (!o.checkpoint_dir.empty() && o.checkpoint_every == 0 && epoch_complete) {
      CPD_RETURN_IF_ERROR(run.SaveCheckpointOnce(epoch + 1));
    }
  }
  // A final checkpoint when the run ends between checkpoint steps (e.g. at --max-steps).
  if (!o.checkpoint_dir.empty() && run.step != run.last_saved_step) {
    const IteratorState it = run.iter->state();
    CPD_RETURN_IF_ERROR(
        run.SaveCheckpointOnce(int(it.epoch) + (it.next_batch >= run.batches_per_epoch)));
  }
  if (control) control->Finish(/*max_wait_ms=*/3000);
  result.steps = run.step;
  const double total_s = Seconds(t_start, Clock::now());
  result.ms_per_step = steps_this_run > 0 ? 1e3 * total_s / double(steps_this_run) : 0.0;
  // Replicas must have stayed bit-identical: compare the parameter hashes of all ranks.
  result.param_hash = HashParams(params);
  if (run.world > 1) {
    uint64_t hi = result.param_hash, lo = ~result.param_hash;
    CPD_RETURN_IF_ERROR(comm->AllReduce(&hi, 1, comm::ReduceOp::kMax));
    CPD_RETURN_IF_ERROR(comm->AllReduce(&lo, 1, comm::ReduceOp::kMax));
    result.replicas_identical = hi == result.param_hash && lo == ~result.param_hash;
    if (!result.replicas_identical) {
      return Status::Internal("replicas diverged: the ranks' final parameters differ");
    }
  }
  if (!quiet && run.workers > 1) {
    std::printf("replicas bit-identical on %d rank(s); %lld step(s) skipped for NaN/Inf\n",
                run.world, static_cast<long long>(result.skipped_steps));
  }
  return result;
}

}  // namespace

}  // namespace cpd::runtime
