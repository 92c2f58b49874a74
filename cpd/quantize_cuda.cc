#include "cpd/quantize_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cpd/quantize_internal.h"
#include "kernels/cuda/codec.h"
#include "kernels/cuda/quantize.h"

namespace cpd {

namespace {

using kernels::FloatGrid;
using kernels::LinearGrid;
using kernels::RoundMode;
using kernels::cuda::CudaResult;
using kernels::cuda::DeviceStats;
using kernels::cuda::GroupLayout;
using kernels::cuda::RandomParams;
using kernels::cuda::StatsTarget;

// The CPU driver reduces one large group in chunks of this many elements (cpd/quantize.cc
// kChunk); which zero wins the uint<b>:minmax minimum depends on it.
constexpr size_t kCpuChunk = size_t(1) << 16;

Status CudaStatus(cudaError_t err, const char* file, int line, const char* expr) {
  return Status::Internal(std::string("CUDA error at ") + file + ":" + std::to_string(line) + ": " +
                          expr + ": " + cudaGetErrorString(err) + " (" + std::to_string(int(err)) +
                          ")");
}

Status LaunchStatus(const CudaResult& r) {
  return Status::Internal(std::string("CUDA error at ") + (r.file ? r.file : "?") + ":" +
                          std::to_string(r.line) + ": " + (r.expr ? r.expr : "?") + ": " +
                          (r.message ? r.message : "?") + " (" + std::to_string(r.code) + ")");
}

// Wraps a CUDA runtime call in a function returning Status.
#define CPD_CUDA_RETURN_IF_ERROR(expr)                             \
  do {                                                             \
    const cudaError_t cpd_cuda_err_ = (expr);                      \
    if (cpd_cuda_err_ != cudaSuccess) {                            \
      return CudaStatus(cpd_cuda_err_, __FILE__, __LINE__, #expr); \
    }                                                              \
  } while (0)

// Wraps a launcher (kernels/cuda/quantize.h) in a function returning Status.
#define CPD_LAUNCH_RETURN_IF_ERROR(expr)                                   \
  do {                                                                     \
    const CudaResult cpd_launch_result_ = (expr);                          \
    if (!cpd_launch_result_.ok()) return LaunchStatus(cpd_launch_result_); \
  } while (0)

// The buffer must be memory the current device can read and write (float buffers: aligned to a
// float; packed bytes may start anywhere).
Status CheckDeviceBuffer(const void* p, const char* what, size_t align = alignof(float)) {
  if (reinterpret_cast<uintptr_t>(p) % align != 0) {
    return Status::InvalidArgument(std::string(what) + " is not aligned to a float");
  }
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, p);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the (non-sticky) error
    if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {
      return Status::Unavailable(std::string(what) + ": no usable CUDA device (" +
                                 cudaGetErrorString(err) + ")");
    }
    return Status::InvalidArgument(std::string(what) + " is not a CUDA-accessible pointer (" +
                                   cudaGetErrorString(err) + ")");
  }
  if (attr.type == cudaMemoryTypeUnregistered) {
    int device = 0, pageable = 0;
    CPD_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
    CPD_CUDA_RETURN_IF_ERROR(
        cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, device));
    if (pageable == 0) {
      return Status::InvalidArgument(std::string(what) +
                                     " is ordinary host memory, which this device cannot "
                                     "access; pass device memory (cudaMalloc) or managed or "
                                     "pinned host memory");
    }
  }
  return Status::Ok();
}

// Scratch memory of the drivers (statistics partials, per-group scales), kept across calls: one
// buffer per (device, stream), grown when a call needs more and never shrunk, so it settles at
// what the largest call on that stream needed. Why not cudaMallocAsync + cudaFreeAsync per call:
// those are two API calls, two stream operations and a pool attribute query for every
// quantisation site of every training step. Work queued on one stream runs in order, so a call
// may reuse the buffer as soon as the previous call's work is queued; a call holds its arena's
// lock while it queues work, so host threads sharing a stream take turns.
// cudaStreamPerThread is a different stream on each thread: its arenas are per thread as well.
// A destroyed stream's handle may come back for a new stream; the driver keeps a stream object
// until its queued work has run, so a recycled handle has no work of the old stream pending.
struct Arena {
  int device = 0;
  cudaStream_t stream = nullptr;
  std::thread::id thread;  // cudaStreamPerThread only
  std::mutex mu;           // held by the call that queues work with this arena
  // [0, zero_bytes): the block ticket (first kControlBytes) and the scale reductions' buffers,
  // kept all zero between calls (the kernels clear what they use); then free_bytes of scratch
  // that each call overwrites (statistics partials, per-group scales).
  void* ptr = nullptr;
  size_t zero_bytes = 0, free_bytes = 0;
  uint64_t last_use = 0;  // the registry's clock, for eviction
};

constexpr size_t kControlBytes = 256;  // the ticket of the last-block pattern, then padding

// Every arena of the process. At most kMaxArenas are kept: a process that cycles through many
// streams (tests create one per case) gives back the least recently used idle arena of the
// current device, after waiting for that device.
class ArenaRegistry {
 public:
  static ArenaRegistry& Get() {
    static ArenaRegistry* registry = new ArenaRegistry;  // never destroyed: the CUDA runtime
    return *registry;                                    // may be torn down first at exit
  }

  Result<std::shared_ptr<Arena>> Find(int device, cudaStream_t stream) {
    const std::thread::id thread =
        stream == cudaStreamPerThread ? std::this_thread::get_id() : std::thread::id();
    std::lock_guard<std::mutex> lock(mu_);
    ++clock_;
    for (const auto& a : arenas_) {
      if (a->device == device && a->stream == stream && a->thread == thread) {
        a->last_use = clock_;
        return a;
      }
    }
    if (arenas_.size() >= kMaxArenas) CPD_RETURN_IF_ERROR(EvictOne(device));
    auto a = std::make_shared<Arena>();
    a->device = device;
    a->stream = stream;
    a->thread = thread;
    a->last_use = clock_;
    arenas_.push_back(a);
    return a;
  }

 private:
  static constexpr size_t kMaxArenas = 16;

  // Called with mu_ held. An arena another call holds, or one of another device, stays.
  Status EvictOne(int device) {
    size_t victim = arenas_.size();
    for (size_t i = 0; i < arenas_.size(); ++i) {
      if (arenas_[i]->device != device) continue;
      if (victim == arenas_.size() || arenas_[i]->last_use < arenas_[victim]->last_use) {
        victim = i;
      }
    }
    if (victim == arenas_.size()) return Status::Ok();
    std::shared_ptr<Arena> a = arenas_[victim];
    std::unique_lock<std::mutex> held(a->mu, std::try_to_lock);
    if (!held.owns_lock()) return Status::Ok();
    arenas_.erase(arenas_.begin() + std::ptrdiff_t(victim));
    if (a->ptr != nullptr) {
      // Its stream may be gone, so wait for the whole device before freeing.
      CPD_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
      CPD_CUDA_RETURN_IF_ERROR(cudaFree(a->ptr));
      a->ptr = nullptr;
      a->zero_bytes = a->free_bytes = 0;
    }
    return Status::Ok();
  }

  std::mutex mu_;
  std::vector<std::shared_ptr<Arena>> arenas_;
  uint64_t clock_ = 0;
};

// One call's use of the arena of the current device and its stream: holds the arena's lock from
// Acquire until Release (or destruction), i.e. while the call queues work that uses the memory.
class ScratchLease {
 public:
  ScratchLease() = default;
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;

  // Locks the arena and makes it hold `reduce_bytes` of zeroed reduction buffers and
  // `free_bytes` of scratch. Growing waits for the stream (queued work may still use the old
  // buffer) and zeroes the new ticket and reduction buffers in stream order.
  Status Acquire(size_t reduce_bytes, size_t free_bytes, cudaStream_t stream) {
    int device = 0;
    CPD_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
    CPD_ASSIGN_OR_RETURN(arena_, ArenaRegistry::Get().Find(device, stream));
    lock_ = std::unique_lock<std::mutex>(arena_->mu);
    const size_t zero_bytes = kControlBytes + ((reduce_bytes + 255) & ~size_t(255));
    free_bytes = (free_bytes + 255) & ~size_t(255);
    if (arena_->ptr != nullptr && arena_->zero_bytes >= zero_bytes &&
        arena_->free_bytes >= free_bytes) {
      return Status::Ok();
    }
    const size_t zero = std::max(zero_bytes, arena_->zero_bytes);
    const size_t free = std::max({free_bytes, arena_->free_bytes, size_t(64) << 10});
    if (arena_->ptr != nullptr) {
      CPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
      CPD_CUDA_RETURN_IF_ERROR(cudaFree(arena_->ptr));
      arena_->ptr = nullptr;
      arena_->zero_bytes = arena_->free_bytes = 0;
    }
    void* grown = nullptr;
    CPD_CUDA_RETURN_IF_ERROR(cudaMalloc(&grown, zero + free));
    const cudaError_t err = cudaMemsetAsync(grown, 0, zero, stream);
    if (err != cudaSuccess) {
      (void)cudaFree(grown);
      return CudaStatus(err, __FILE__, __LINE__, "cudaMemsetAsync(grown, 0, zero, stream)");
    }
    arena_->ptr = grown;
    arena_->zero_bytes = zero;
    arena_->free_bytes = free;
    return Status::Ok();
  }

  // Lets other calls use the arena; the work already queued keeps its stream order.
  void Release() {
    if (lock_.owns_lock()) lock_.unlock();
  }

  // The block ticket and the reduction buffers (zero between calls), and the free scratch; null
  // before Acquire.
  unsigned int* ticket() const {
    return arena_ ? static_cast<unsigned int*>(arena_->ptr) : nullptr;
  }
  uint8_t* reduce() const { return arena_ ? base() + kControlBytes : nullptr; }
  uint8_t* data() const { return arena_ ? base() + arena_->zero_bytes : nullptr; }

 private:
  uint8_t* base() const { return static_cast<uint8_t*>(arena_->ptr); }

  std::shared_ptr<Arena> arena_;
  std::unique_lock<std::mutex> lock_;
};

// How a format is computed on the device.
enum class Path {
  kFixed,        // a fixed float grid (shift 0): one element-wise pass
  kFused,        // power-of-two blocks of <= 128 (MX, bfp<b>:16 ...): one pass with warp reductions
  kShift,        // shared shift per tensor, channel or block: max-abs pass, then element-wise
  kInt,          // int<b>: max-abs pass, then the linear grid
  kUint,         // uint<b>:minmax: min/max pass, then the linear grid
  kBlockScaled,  // scales per R x C block of the matrix view: max-abs pass, then element-wise
};

struct Plan {
  Path path = Path::kFixed;
  size_t num_groups = 0;
  GroupLayout reduce;  // the groups of the scale reduction
  GroupLayout apply;   // the groups of the element-wise pass ({0, 1}: one group)
  bool chunked = false;
  kernels::cuda::MatrixBlocks blocks;  // kBlockScaled: the blocks (num_groups of them)
};

// The blocks of a block-scaled format's span (cpd::BlockGridOf) as the kernels take them.
kernels::cuda::MatrixBlocks MatrixBlocksOf(const Format& format, size_t n, size_t channels,
                                           size_t columns) {
  const BlockGridShape g = BlockGridOf(format, n, channels, columns);
  kernels::cuda::MatrixBlocks b;
  b.cols = g.cols;
  b.rows_per_block = format.block_rows();
  b.cols_per_block = format.block_cols();
  b.blocks_per_row = g.block_cols;
  b.num_blocks = g.block_rows * g.block_cols;
  if (g.block_cols == 1) {
    b.run = format.block_rows() * g.cols;  // whole rows
  } else if (format.block_rows() == 1 && g.cols % format.block_cols() == 0) {
    b.run = format.block_cols();
  }
  return b;
}

// How a block-scaled format chooses and stores its scales (cpd/quantize.cc ComputeBlockScales).
kernels::cuda::BlockScaleRule BlockScaleRuleOf(const Format& format) {
  kernels::cuda::BlockScaleRule r;
  switch (format.scale_type()) {
    case BlockScaleType::kPow2:
      r.kind = kernels::cuda::BlockScaleKind::kPow2;
      break;
    case BlockScaleType::kFloat32:
      r.kind = kernels::cuda::BlockScaleKind::kFloat32;
      break;
    case BlockScaleType::kFloatGrid:
      r.kind = kernels::cuda::BlockScaleKind::kFloatGrid;
      break;
  }
  r.shift = format.shift_rule();
  r.elem_max = kernels::BitsFloat(format.grid().max_bits);
  r.scale_grid = format.scale_grid();
  r.tensor_level = format.tensor_level();
  r.meta_bytes = int(format.meta_bytes_per_group());
  return r;
}

// fused_ok: whether blocks may take the one-pass fused path, which never materialises the block
// shifts (hysteresis reads previous values; the encoder stores the shifts as metadata).
// `columns`: the matrix view of block-scaled formats (QuantizeOptions::columns).
Plan MakePlan(const Format& format, size_t n, size_t channels, size_t columns, bool fused_ok) {
  Plan plan;
  switch (format.family()) {
    case FormatFamily::kFloat32:
    case FormatFamily::kFloat:
      plan.path = Path::kFixed;
      return plan;
    case FormatFamily::kBinades:  // per tensor or channel: never blocks
    case FormatFamily::kSharedShift:
      plan.path = format.scope() == ScaleScope::kBlock && fused_ok &&
                          kernels::cuda::FusedBlockSupported(format.block_size())
                      ? Path::kFused
                      : Path::kShift;
      break;
    case FormatFamily::kIntSymmetric:
      plan.path = Path::kInt;
      break;
    case FormatFamily::kUintMinMax:
      plan.path = Path::kUint;
      break;
    case FormatFamily::kBlockScaled:
      plan.path = Path::kBlockScaled;
      plan.blocks = MatrixBlocksOf(format, n, channels, columns);
      plan.num_groups = plan.blocks.num_blocks;
      return plan;
  }
  if (plan.path == Path::kFused) return plan;
  const size_t len = internal::GroupLength(format, n, channels);
  plan.num_groups = format.num_groups(n, channels);
  plan.reduce = GroupLayout{len, plan.num_groups};
  plan.apply = plan.num_groups == 1 ? GroupLayout{0, 1} : GroupLayout{len, plan.num_groups};
  plan.chunked = plan.num_groups == 1 && n > kCpuChunk;
  return plan;
}

// What a call needs of its stream's arena: offsets into the free scratch (ScratchLease::data),
// and the bytes of zeroed reduction buffers (ScratchLease::reduce).
struct ScratchLayout {
  size_t stats_result = 0, stats_partials = 0;  // DeviceStats, DeviceStats[kMaxStatsBlocks]
  size_t params = 0;      // int32_t shifts[num], LinearGrid grids[num] or BlockScale scales[num]
  size_t tensor_enc = 0;  // kBlockScaled: the tensor level's encode scale (float)
  size_t binade = 0;                            // kernels::BinadeGrid (binades formats)
  size_t bytes = 0;                             // of free scratch
  size_t reduce_bytes = 0;                      // of the scale reduction (zero between calls)
  bool needed() const { return bytes > 0 || reduce_bytes > 0; }
};

size_t Align(size_t x) { return (x + 255) & ~size_t(255); }

// The reduction a path's scales come from.
kernels::cuda::ScaleKind ScaleKindOf(Path path) {
  switch (path) {
    case Path::kInt:
      return kernels::cuda::ScaleKind::kIntGrid;
    case Path::kUint:
      return kernels::cuda::ScaleKind::kUintGrid;
    default:
      return kernels::cuda::ScaleKind::kShift;
  }
}

// `reduced`: whether the scales are computed from the data (the decoder reads them instead).
ScratchLayout MakeLayout(const Plan& plan, bool want_stats, bool binade_table, bool reduced) {
  ScratchLayout l;
  size_t at = 0;
  if (want_stats) {
    l.stats_result = at;
    at = Align(at + sizeof(DeviceStats));
    l.stats_partials = at;
    at = Align(at + kernels::cuda::kStatsScratchBytes);
  }
  const size_t num = plan.num_groups;
  if (plan.path == Path::kShift || plan.path == Path::kInt || plan.path == Path::kUint) {
    l.params = at;
    at = Align(at + num * (plan.path == Path::kShift ? sizeof(int32_t) : sizeof(LinearGrid)));
    if (reduced) l.reduce_bytes = kernels::cuda::ScaleReduceBytes(ScaleKindOf(plan.path), num);
  }
  if (plan.path == Path::kBlockScaled) {
    l.params = at;
    at = Align(at + num * sizeof(kernels::BlockScale));
    l.tensor_enc = at;
    at = Align(at + sizeof(float));
    if (reduced) l.reduce_bytes = kernels::cuda::BlockScaleReduceBytes(num);
  }
  if (binade_table) {
    l.binade = at;
    at = Align(at + sizeof(kernels::BinadeGrid));
  }
  l.bytes = at;
  return l;
}

// The counter-based stream of stochastic rounding, as the CPU draws it.
RandomParams RandomFor(const QuantizeOptions& opts) {
  RandomParams rng;
  rng.key = kernels::MakeRandomKey(opts.seed, opts.step);
  rng.index_base = opts.index_offset;
  return rng;
}

// The per-group scales of a span, in scratch memory: shifts (Path::kShift), linear grids
// (kInt, kUint) or block scales (kBlockScaled), and the binade table of kBinades formats. All
// null for fixed formats.
struct DeviceScales {
  int32_t* shifts = nullptr;
  LinearGrid* grids = nullptr;
  kernels::BlockScale* blocks = nullptr;
  kernels::BinadeGrid* binade = nullptr;
};

// Copies the format's binade table into scratch (kBinades formats only).
Status StoreBinadeTable(const Format& format, const ScratchLayout& layout, uint8_t* base,
                        cudaStream_t stream, DeviceScales* scales) {
  if (format.family() != FormatFamily::kBinades) return Status::Ok();
  scales->binade = reinterpret_cast<kernels::BinadeGrid*>(base + layout.binade);
  CPD_LAUNCH_RETURN_IF_ERROR(
      kernels::cuda::LaunchStoreBinadeGrid(format.binade_grid(), scales->binade, stream));
  return Status::Ok();
}

// Step 1 of every quantiser and of the encoder: the scale of each group, chosen on the device
// from the data with the CPU's formulas (cpd/quantize.cc ComputeGroups), in one launch (the
// reduction's last block derives the scales). `meta` (the encoder): the packed tensor's scale
// metadata, written by the same launch.
Status ComputeScales(const Format& format, const float* in, size_t n, const Plan& plan,
                     const ScratchLayout& layout, const ScratchLease& scratch, cudaStream_t stream,
                     DeviceScales* scales, uint8_t* meta = nullptr) {
  uint8_t* base = scratch.data();
  if (plan.path == Path::kBlockScaled) {
    scales->blocks = reinterpret_cast<kernels::BlockScale*>(base + layout.params);
    CPD_LAUNCH_RETURN_IF_ERROR(kernels::cuda::LaunchBlockScalesFromData(
        in, n, plan.blocks, BlockScaleRuleOf(format), {scratch.reduce(), scratch.ticket()},
        scales->blocks, reinterpret_cast<float*>(base + layout.tensor_enc), meta, stream));
    return Status::Ok();
  }
  if (plan.path == Path::kShift || plan.path == Path::kInt || plan.path == Path::kUint) {
    kernels::cuda::ScaleRule rule;
    rule.kind = ScaleKindOf(plan.path);
    rule.shift = format.shift_rule();
    rule.bits = format.bits();
    rule.chunked = plan.chunked;
    kernels::cuda::ScaleOutput out;
    if (plan.path == Path::kShift) {
      out.shifts = scales->shifts = reinterpret_cast<int32_t*>(base + layout.params);
    } else {
      out.grids = scales->grids = reinterpret_cast<LinearGrid*>(base + layout.params);
    }
    out.meta = meta;
    out.e8m0 = internal::ShiftMetaIsE8M0(format);
    out.minmax = internal::LinearMetaHasOffset(format);
    CPD_LAUNCH_RETURN_IF_ERROR(kernels::cuda::LaunchScalesFromData(
        in, n, plan.reduce, rule, {scratch.reduce(), scratch.ticket()}, out, stream));
  }
  return StoreBinadeTable(format, layout, base, stream, scales);
}

// A DeviceStats as the QuantStats of `count` elements.
QuantStats ToQuantStats(const DeviceStats& ds, uint64_t count) {
  QuantStats stats;
  stats.count = count;
  std::memcpy(&stats.max_abs, &ds.max_bits, sizeof(stats.max_abs));
  stats.saturated = ds.saturated;
  stats.flushed = ds.flushed;
  stats.nonfinite = ds.nonfinite;
  stats.sq_error = ds.sq_error;
  stats.sq_input = ds.sq_input;
  return stats;
}

// The last step of every driver: queues the statistics' copy to the host (when the caller asked
// for host values), lets other calls use the scratch, then waits for the stream and fills the
// values in; slots on the device need neither.
Status CollectStats(const StatsTarget& st, size_t n, ScratchLease* scratch, QuantStats* stats,
                    uint64_t* flips, cudaStream_t stream) {
  const bool want_stats = st.result != nullptr;
  DeviceStats ds{};
  if (want_stats) {
    CPD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(&ds, st.result, sizeof(DeviceStats), cudaMemcpyDeviceToHost, stream));
  }
  scratch->Release();
  if (!want_stats) return Status::Ok();
  CPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  if (stats != nullptr) *stats = ToQuantStats(ds, n);
  if (flips != nullptr) *flips = ds.flips;
  return Status::Ok();
}

// Statistics destinations in a caller's CudaStatsSlots (cpd::CudaStatsTarget, resolved).
struct DeviceSinks {
  DeviceStats* add_to = nullptr;
  unsigned long long* add_flips = nullptr;
};

// What a call wants: values returned to the host (waits) and/or slots updated on the device.
struct StatsRequest {
  QuantStats* stats = nullptr;
  uint64_t* flips = nullptr;
  DeviceSinks sinks;
  bool immediate() const { return stats != nullptr || flips != nullptr; }
  bool any() const { return immediate() || sinks.add_to != nullptr || sinks.add_flips != nullptr; }
};

// Points `st` at the statistics' part of the scratch and at the caller's slots (when wanted).
StatsTarget StatsIn(const ScratchLayout& layout, const ScratchLease& scratch,
                    const StatsRequest& req) {
  StatsTarget st;
  if (!req.any()) return st;
  uint8_t* base = scratch.data();
  if (req.immediate()) st.result = reinterpret_cast<DeviceStats*>(base + layout.stats_result);
  st.add_to = req.sinks.add_to;
  st.add_flips = req.sinks.add_flips;
  st.scratch = reinterpret_cast<DeviceStats*>(base + layout.stats_partials);
  st.ticket = scratch.ticket();
  return st;
}

// The slots a CudaStatsTarget names; `with_flips`: whether the call counts flips at all.
Result<DeviceSinks> SinksFor(const CudaStatsTarget& t, bool with_flips, const char* who) {
  DeviceSinks sinks;
  const bool want_stats = t.stats != CudaStatsTarget::kNone;
  const bool want_flips = with_flips && t.flips != CudaStatsTarget::kNone;
  if (!want_stats && !want_flips) return sinks;
  if (t.slots == nullptr) {
    return Status::InvalidArgument(std::string(who) + ": a statistics slot without CudaStatsSlots");
  }
  for (const size_t slot : {want_stats ? t.stats : 0, want_flips ? t.flips : 0}) {
    if (slot >= t.slots->capacity()) {
      return Status::InvalidArgument(std::string(who) + ": statistics slot " +
                                     std::to_string(slot) + " of " +
                                     std::to_string(t.slots->capacity()));
    }
  }
  auto* base = static_cast<DeviceStats*>(t.slots->device_data());
  if (want_stats) sinks.add_to = base + t.stats;
  if (want_flips) {
    static_assert(sizeof(unsigned long long) == sizeof(uint64_t));
    sinks.add_flips = reinterpret_cast<unsigned long long*>(&base[t.flips].flips);
  }
  return sinks;
}

// Where hysteresis reads the previous values (null: `out`, in place) and keeps the new ones.
struct HysteresisState {
  const float* prev = nullptr;
  float* keep = nullptr;
};

// The shared driver of QuantizeCuda (hysteresis null) and QuantizeHysteresisCuda.
Status Run(const Format& format, const float* in, float* out, size_t n, const QuantizeOptions& opts,
           const HysteresisState* hysteresis, const StatsRequest& req, void* stream_ptr) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const Plan plan =
      MakePlan(format, n, opts.channels, opts.columns, /*fused_ok=*/hysteresis == nullptr);
  const bool binades = format.family() == FormatFamily::kBinades;
  const ScratchLayout layout = MakeLayout(plan, req.any(), binades, /*reduced=*/true);

  ScratchLease scratch;
  if (layout.needed()) {
    CPD_RETURN_IF_ERROR(scratch.Acquire(layout.reduce_bytes, layout.bytes, stream));
  }
  const StatsTarget st = StatsIn(layout, scratch, req);

  // 1. Scales, on the device.
  DeviceScales scales;
  CPD_RETURN_IF_ERROR(ComputeScales(format, in, n, plan, layout, scratch, stream, &scales));
  int32_t* const shifts = scales.shifts;
  LinearGrid* const grids = scales.grids;
  kernels::BinadeGrid* const d_binade = scales.binade;

  // 2. The element-wise pass (statistics fused).
  const FloatGrid& g = format.grid();
  if (hysteresis != nullptr) {
    const float* prev = hysteresis->prev != nullptr ? hysteresis->prev : out;
    float* keep = hysteresis->keep;
    if (plan.path == Path::kBlockScaled) {
      CPD_LAUNCH_RETURN_IF_ERROR(kernels::cuda::LaunchHysteresisBlockScaled(
          in, prev, out, keep, n, g, scales.blocks, plan.blocks, st, stream));
    } else if (binades) {
      CPD_LAUNCH_RETURN_IF_ERROR(kernels::cuda::LaunchHysteresisBinadeGrid(
          in, prev, out, keep, n, d_binade, shifts, plan.apply, st, stream));
    } else if (format.is_float_grid()) {
      CPD_LAUNCH_RETURN_IF_ERROR(kernels::cuda::LaunchHysteresisFloatGrid(
          in, prev, out, keep, n, g, shifts, plan.apply, st, stream));
    } else {
      CPD_LAUNCH_RETURN_IF_ERROR(kernels::cuda::LaunchHysteresisLinearGrid(
          in, prev, out, keep, n, grids, plan.apply, st, stream));
    }
  } else {
    const RoundMode mode = internal::RoundModeFor(opts.rounding);
    const RandomParams rng = RandomFor(opts);
    switch (plan.path) {
      case Path::kFixed:
      case Path::kShift:
        if (binades) {
          CPD_LAUNCH_RETURN_IF_ERROR(kernels::cuda::LaunchQuantizeBinadeGrid(
              in, out, n, d_binade, shifts, plan.apply, mode, rng, st, stream));
        } else {
          CPD_LAUNCH_RETURN_IF_ERROR(kernels::cuda::LaunchQuantizeFloatGrid(
              in, out, n, g, shifts, plan.apply, mode, rng, st, stream));
        }
        break;
      case Path::kFused:
        CPD_LAUNCH_RETURN_IF_ERROR(kernels::cuda::LaunchQuantizeFloatBlocksFused(
            in, out, n, g, format.shift_rule(), format.block_size(), mode, rng, st, stream));
        break;
      case Path::kInt:
      case Path::kUint:
        CPD_LAUNCH_RETURN_IF_ERROR(kernels::cuda::LaunchQuantizeLinearGrid(
            in, out, n, grids, plan.apply, mode, rng, st, stream));
        break;
      case Path::kBlockScaled:
        CPD_LAUNCH_RETURN_IF_ERROR(kernels::cuda::LaunchQuantizeBlockScaled(
            in, out, n, g, scales.blocks, plan.blocks, mode, rng, st, stream));
        break;
    }
  }

  // 3. Statistics: copy back and wait (only when the caller asked for host values).
  return CollectStats(st, n, &scratch, req.stats, req.flips, stream);
}

// The encoder: QuantizeCuda's scales (never the fused block path: the shifts are metadata), one
// pass that rounds and packs, then the metadata after the codes (cpd/quantize.cc Run + WriteMeta
// or WriteBlockScales).
Status EncodeRun(const Format& format, const float* in, size_t n, const QuantizeOptions& opts,
                 uint8_t* dst, QuantStats* stats, cudaStream_t stream) {
  const Plan plan = MakePlan(format, n, opts.channels, opts.columns, /*fused_ok=*/false);
  StatsRequest req;
  req.stats = stats;
  const ScratchLayout layout =
      MakeLayout(plan, req.any(), format.family() == FormatFamily::kBinades,
                 /*reduced=*/true);
  ScratchLease scratch;
  if (layout.needed()) {
    CPD_RETURN_IF_ERROR(scratch.Acquire(layout.reduce_bytes, layout.bytes, stream));
  }
  const StatsTarget st = StatsIn(layout, scratch, req);

  // The scales, and the metadata after the codes, in one launch.
  DeviceScales scales;
  uint8_t* meta = dst + PackedCodeBytes(format, n);
  CPD_RETURN_IF_ERROR(ComputeScales(format, in, n, plan, layout, scratch, stream, &scales, meta));

  const RoundMode mode = internal::RoundModeFor(opts.rounding);
  const RandomParams rng = RandomFor(opts);
  const int bits = format.bits();
  switch (plan.path) {
    case Path::kFixed:
    case Path::kShift:
      if (scales.binade != nullptr) {
        CPD_LAUNCH_RETURN_IF_ERROR(kernels::cuda::LaunchEncodeBinadeGrid(
            in, n, bits, scales.binade, scales.shifts, plan.apply, mode, rng, st, dst, stream));
      } else {
        CPD_LAUNCH_RETURN_IF_ERROR(kernels::cuda::LaunchEncodeFloatGrid(
            in, n, bits, format.grid(), scales.shifts, plan.apply, mode, rng, st, dst, stream));
      }
      break;
    case Path::kInt:
    case Path::kUint:
      CPD_LAUNCH_RETURN_IF_ERROR(kernels::cuda::LaunchEncodeLinearGrid(
          in, n, bits, scales.grids, plan.apply, mode, rng, st, dst, stream));
      break;
    case Path::kBlockScaled:
      CPD_LAUNCH_RETURN_IF_ERROR(kernels::cuda::LaunchEncodeBlockScaled(
          in, n, bits, format.grid(), scales.blocks, plan.blocks, mode, rng, st, dst, stream));
      break;
    case Path::kFused:
      return Status::Internal("EncodeCuda: the fused block path has no shifts to store");
  }

  CPD_RETURN_IF_ERROR(CollectStats(st, n, &scratch, stats, nullptr, stream));
  // An empty span (whose metadata was still written) ran no element pass to count anything.
  if (n == 0 && stats != nullptr) *stats = QuantStats{};
  return Status::Ok();
}

// The decoder: the scales from the metadata (cpd/quantize.cc ReadMeta or ReadBlockScales), then
// one pass that unpacks and decodes.
Status DecodeRun(const Format& format, const PackedTensorCuda& packed, float* out,
                 cudaStream_t stream) {
  const size_t n = packed.count;
  const Plan plan = MakePlan(format, n, packed.channels, packed.columns, /*fused_ok=*/false);
  const ScratchLayout layout =
      MakeLayout(plan, /*want_stats=*/false, format.family() == FormatFamily::kBinades,
                 /*reduced=*/false);
  ScratchLease scratch;
  if (layout.needed()) CPD_RETURN_IF_ERROR(scratch.Acquire(0, layout.bytes, stream));
  uint8_t* base = scratch.data();

  DeviceScales scales;
  const uint8_t* meta = packed.bytes + PackedCodeBytes(format, n);
  const int bits = format.bits();
  if (plan.path == Path::kBlockScaled) {
    scales.blocks = reinterpret_cast<kernels::BlockScale*>(base + layout.params);
    CPD_LAUNCH_RETURN_IF_ERROR(kernels::cuda::LaunchReadBlockScaleMeta(
        meta, plan.num_groups, BlockScaleRuleOf(format), scales.blocks, stream));
    CPD_LAUNCH_RETURN_IF_ERROR(kernels::cuda::LaunchDecodeBlockScaled(
        packed.bytes, n, bits, format.grid(), scales.blocks, plan.blocks, out, stream));
    scratch.Release();
    return Status::Ok();
  }
  if (plan.path == Path::kShift) {
    scales.shifts = reinterpret_cast<int32_t*>(base + layout.params);
    CPD_LAUNCH_RETURN_IF_ERROR(kernels::cuda::LaunchReadShiftMeta(
        meta, plan.num_groups, internal::ShiftMetaIsE8M0(format), scales.shifts, stream));
  } else if (plan.path == Path::kInt || plan.path == Path::kUint) {
    scales.grids = reinterpret_cast<LinearGrid*>(base + layout.params);
    CPD_LAUNCH_RETURN_IF_ERROR(kernels::cuda::LaunchReadLinearMeta(
        meta, plan.num_groups, internal::LinearMetaHasOffset(format), format.bits(), scales.grids,
        stream));
  }
  CPD_RETURN_IF_ERROR(StoreBinadeTable(format, layout, base, stream, &scales));

  if (scales.binade != nullptr) {
    CPD_LAUNCH_RETURN_IF_ERROR(kernels::cuda::LaunchDecodeBinadeGrid(
        packed.bytes, n, bits, scales.binade, scales.shifts, plan.apply, out, stream));
  } else if (format.is_float_grid()) {
    CPD_LAUNCH_RETURN_IF_ERROR(kernels::cuda::LaunchDecodeFloatGrid(
        packed.bytes, n, bits, format.grid(), scales.shifts, plan.apply, out, stream));
  } else {
    CPD_LAUNCH_RETURN_IF_ERROR(kernels::cuda::LaunchDecodeLinearGrid(
        packed.bytes, n, bits, scales.grids, plan.apply, out, stream));
  }
  scratch.Release();
  return Status::Ok();
}

// The argument checks of QuantizeCuda's overloads, then the driver.
Status CheckedQuantize(const Format& format, const float* d_in, float* d_out, size_t n,
                       const QuantizeOptions& opts, const StatsRequest& req, void* stream) {
  if (n > 0 && (d_in == nullptr || d_out == nullptr)) {
    return Status::InvalidArgument("QuantizeCuda: null buffer");
  }
  CPD_RETURN_IF_ERROR(internal::ValidateSpan(format, n, opts));
  if (n == 0) {
    if (req.stats != nullptr) *req.stats = QuantStats{};
    return Status::Ok();
  }
  CPD_RETURN_IF_ERROR(CheckDeviceBuffer(d_in, "QuantizeCuda: input"));
  CPD_RETURN_IF_ERROR(CheckDeviceBuffer(d_out, "QuantizeCuda: output"));
  return Run(format, d_in, d_out, n, opts, /*hysteresis=*/nullptr, req, stream);
}

// The argument checks of QuantizeHysteresisCuda's overloads, then the driver. d_prev null: the
// previous values are d_q's (in place); else they are read from d_prev, which receives the new
// values too.
Status CheckedHysteresis(const Format& format, const float* d_w, float* d_prev, float* d_q,
                         size_t n, const QuantizeOptions& opts, const StatsRequest& req,
                         void* stream) {
  if (n > 0 && (d_w == nullptr || d_q == nullptr)) {
    return Status::InvalidArgument("QuantizeHysteresisCuda: null buffer");
  }
  CPD_RETURN_IF_ERROR(internal::ValidateSpan(format, n, opts));
  if (n == 0) {
    if (req.stats != nullptr) *req.stats = QuantStats{};
    if (req.flips != nullptr) *req.flips = 0;
    return Status::Ok();
  }
  CPD_RETURN_IF_ERROR(CheckDeviceBuffer(d_w, "QuantizeHysteresisCuda: weights"));
  CPD_RETURN_IF_ERROR(CheckDeviceBuffer(d_q, "QuantizeHysteresisCuda: quantised weights"));
  HysteresisState state;
  if (d_prev != nullptr) {
    CPD_RETURN_IF_ERROR(CheckDeviceBuffer(d_prev, "QuantizeHysteresisKeepCuda: previous weights"));
    const uintptr_t p = reinterpret_cast<uintptr_t>(d_prev), q = reinterpret_cast<uintptr_t>(d_q);
    if (p < q + n * sizeof(float) && q < p + n * sizeof(float)) {
      return Status::InvalidArgument(
          "QuantizeHysteresisKeepCuda: previous and new weights overlap");
    }
    state.prev = d_prev;
    state.keep = d_prev;
  }
  return Run(format, d_w, d_q, n, opts, &state, req, stream);
}

}  // namespace

bool CudaDeviceAvailable() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: clear the error
    return false;
  }
  return count > 0;
}

Status QuantizeCuda(const Format& format, const float* d_in, float* d_out, size_t n,
                    const QuantizeOptions& opts, QuantStats* stats, void* stream) {
  StatsRequest req;
  req.stats = stats;
  return CheckedQuantize(format, d_in, d_out, n, opts, req, stream);
}

Status QuantizeCuda(const Format& format, const float* d_in, float* d_out, size_t n,
                    const QuantizeOptions& opts, const CudaStatsTarget& target, void* stream) {
  StatsRequest req;
  CPD_ASSIGN_OR_RETURN(req.sinks, SinksFor(target, /*with_flips=*/false, "QuantizeCuda"));
  return CheckedQuantize(format, d_in, d_out, n, opts, req, stream);
}

Status QuantizeHysteresisCuda(const Format& format, const float* d_w, float* d_q, size_t n,
                              const QuantizeOptions& opts, QuantStats* stats, uint64_t* flips,
                              void* stream) {
  StatsRequest req;
  req.stats = stats;
  req.flips = flips;
  return CheckedHysteresis(format, d_w, /*d_prev=*/nullptr, d_q, n, opts, req, stream);
}

Status QuantizeHysteresisCuda(const Format& format, const float* d_w, float* d_q, size_t n,
                              const QuantizeOptions& opts, const CudaStatsTarget& target,
                              void* stream) {
  StatsRequest req;
  CPD_ASSIGN_OR_RETURN(req.sinks, SinksFor(target, /*with_flips=*/true, "QuantizeHysteresisCuda"));
  return CheckedHysteresis(format, d_w, /*d_prev=*/nullptr, d_q, n, opts, req, stream);
}

Status QuantizeHysteresisKeepCuda(const Format& format, const float* d_w, float* d_prev, float* d_q,
                                  size_t n, const QuantizeOptions& opts,
                                  const CudaStatsTarget& target, void* stream) {
  if (n > 0 && d_prev == nullptr) {
    return Status::InvalidArgument("QuantizeHysteresisKeepCuda: null buffer");
  }
  StatsRequest req;
  CPD_ASSIGN_OR_RETURN(req.sinks,
                       SinksFor(target, /*with_flips=*/true, "QuantizeHysteresisKeepCuda"));
  return CheckedHysteresis(format, d_w, d_prev, d_q, n, opts, req, stream);
}

Result<uint64_t> CountFlipsCuda(const float* d_prev, const float* d_q, size_t n, void* stream) {
  if (n > 0 && (d_prev == nullptr || d_q == nullptr)) {
    return Status::InvalidArgument("CountFlipsCuda: null buffer");
  }
  if (n == 0) return uint64_t(0);
  CPD_RETURN_IF_ERROR(CheckDeviceBuffer(d_prev, "CountFlipsCuda: previous weights"));
  CPD_RETURN_IF_ERROR(CheckDeviceBuffer(d_q, "CountFlipsCuda: quantised weights"));
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  ScratchLease scratch;
  CPD_RETURN_IF_ERROR(scratch.Acquire(0, sizeof(unsigned long long), s));
  auto* d_count = reinterpret_cast<unsigned long long*>(scratch.data());
  CPD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(d_count, 0, sizeof(unsigned long long), s));
  CPD_LAUNCH_RETURN_IF_ERROR(
      kernels::cuda::LaunchCountChangedBits(d_prev, d_q, n, /*copy_to=*/nullptr, d_count, s));
  unsigned long long count = 0;
  CPD_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(&count, d_count, sizeof(count), cudaMemcpyDeviceToHost, s));
  scratch.Release();
  CPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  return uint64_t(count);
}

Status CountFlipsAndKeepCuda(float* d_prev, const float* d_q, size_t n,
                             const CudaStatsTarget& target, void* stream) {
  if (n > 0 && (d_prev == nullptr || d_q == nullptr)) {
    return Status::InvalidArgument("CountFlipsAndKeepCuda: null buffer");
  }
  const uintptr_t prev = reinterpret_cast<uintptr_t>(d_prev), q = reinterpret_cast<uintptr_t>(d_q);
  if (n > 0 && prev < q + n * sizeof(float) && q < prev + n * sizeof(float)) {
    return Status::InvalidArgument("CountFlipsAndKeepCuda: previous and new weights overlap");
  }
  CPD_ASSIGN_OR_RETURN(const DeviceSinks sinks,
                       SinksFor(target, /*with_flips=*/true, "CountFlipsAndKeepCuda"));
  if (n == 0) return Status::Ok();
  CPD_RETURN_IF_ERROR(CheckDeviceBuffer(d_prev, "CountFlipsAndKeepCuda: previous weights"));
  CPD_RETURN_IF_ERROR(CheckDeviceBuffer(d_q, "CountFlipsAndKeepCuda: quantised weights"));
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (sinks.add_flips == nullptr) {  // nothing to count: only keep the weights
    CPD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(d_prev, d_q, n * sizeof(float), cudaMemcpyDeviceToDevice, s));
    return Status::Ok();
  }
  CPD_LAUNCH_RETURN_IF_ERROR(
      kernels::cuda::LaunchCountChangedBits(d_prev, d_q, n, d_prev, sinks.add_flips, s));
  return Status::Ok();
}

Result<std::unique_ptr<CudaStatsSlots>> CudaStatsSlots::Create(size_t capacity) {
  std::unique_ptr<CudaStatsSlots> slots(new CudaStatsSlots());
  CPD_RETURN_IF_ERROR(slots->Reserve(capacity, nullptr));
  return slots;
}

CudaStatsSlots::~CudaStatsSlots() {
  // Queued work may still update the slots; cudaFree waits for the device.
  if (data_ != nullptr) (void)cudaFree(data_);
}

Status CudaStatsSlots::Reserve(size_t capacity, void* stream) {
  if (capacity <= capacity_ && data_ != nullptr) return Status::Ok();
  capacity = std::max<size_t>(capacity, 1);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  void* grown = nullptr;
  CPD_CUDA_RETURN_IF_ERROR(cudaMalloc(&grown, capacity * sizeof(DeviceStats)));
  Status st = [&]() -> Status {
    CPD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(grown, 0, capacity * sizeof(DeviceStats), s));
    if (data_ != nullptr) {
      CPD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(grown, data_, capacity_ * sizeof(DeviceStats),
                                               cudaMemcpyDeviceToDevice, s));
    }
    // Work queued on other streams before this call is the caller's to order; ours is done when
    // the stream is.
    CPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
    return Status::Ok();
  }();
  if (!st.ok()) {
    (void)cudaFree(grown);
    return st;
  }
  if (data_ != nullptr) CPD_CUDA_RETURN_IF_ERROR(cudaFree(data_));
  data_ = grown;
  capacity_ = capacity;
  return Status::Ok();
}

Status CudaStatsSlots::Clear(size_t first, size_t count, void* stream) {
  if (first > capacity_ || count > capacity_ - first) {
    return Status::InvalidArgument("CudaStatsSlots::Clear: slots [" + std::to_string(first) +
                                   ", +" + std::to_string(count) + ") of " +
                                   std::to_string(capacity_));
  }
  if (count == 0) return Status::Ok();
  CPD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(static_cast<DeviceStats*>(data_) + first, 0,
                                           count * sizeof(DeviceStats),
                                           static_cast<cudaStream_t>(stream)));
  return Status::Ok();
}

Result<std::vector<CudaSlotStats>> CudaStatsSlots::Read(size_t first, size_t count,
                                                        void* stream) const {
  if (first > capacity_ || count > capacity_ - first) {
    return Status::InvalidArgument("CudaStatsSlots::Read: slots [" + std::to_string(first) + ", +" +
                                   std::to_string(count) + ") of " + std::to_string(capacity_));
  }
  std::vector<CudaSlotStats> out(count);
  if (count == 0) return out;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  std::vector<DeviceStats> host(count);
  CPD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host.data(), static_cast<DeviceStats*>(data_) + first,
                                           count * sizeof(DeviceStats), cudaMemcpyDeviceToHost, s));
  CPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  for (size_t i = 0; i < count; ++i) {
    out[i].stats = ToQuantStats(host[i], host[i].count);
    out[i].flips = host[i].flips;
  }
  return out;
}

Status EncodeCuda(const Format& format, const float* d_in, size_t n, const QuantizeOptions& opts,
                  PackedTensorCuda* out, QuantStats* stats, void* stream) {
  if (out == nullptr || (n > 0 && d_in == nullptr)) {
    return Status::InvalidArgument("EncodeCuda: null buffer");
  }
  CPD_RETURN_IF_ERROR(internal::ValidateSpan(format, n, opts));
  const size_t expected = PackedSize(format, n, opts.channels, opts.columns);
  if (out->size != expected || (expected > 0 && out->bytes == nullptr)) {
    return Status::InvalidArgument(
        "EncodeCuda: " + std::to_string(n) + " '" + format.spec() + "' values in " +
        std::to_string(opts.channels) + " channel(s) pack into " + std::to_string(expected) +
        " bytes, but the output buffer holds " + std::to_string(out->size));
  }
  if (n > 0) CPD_RETURN_IF_ERROR(CheckDeviceBuffer(d_in, "EncodeCuda: input"));
  if (expected > 0) CPD_RETURN_IF_ERROR(CheckDeviceBuffer(out->bytes, "EncodeCuda: output", 1));
  out->count = n;
  out->channels = opts.channels;
  out->columns = opts.columns;
  if (expected == 0) {
    if (stats != nullptr) *stats = QuantStats{};
    return Status::Ok();
  }
  // n == 0 still writes the metadata of a per-tensor scale (and a block-scaled format's tensor
  // level), as cpd::Encode does.
  return EncodeRun(format, d_in, n, opts, out->bytes, stats, static_cast<cudaStream_t>(stream));
}

Status DecodeCuda(const Format& format, const PackedTensorCuda& packed, float* d_out,
                  void* stream) {
  const size_t n = packed.count;
  QuantizeOptions opts;
  opts.channels = packed.channels;
  opts.columns = packed.columns;
  CPD_RETURN_IF_ERROR(internal::ValidateSpan(format, n, opts));
  const size_t expected = PackedSize(format, n, packed.channels, packed.columns);
  if (packed.size != expected) {
    return Status::Corruption("packed tensor of " + std::to_string(n) + " '" + format.spec() +
                              "' values must be " + std::to_string(expected) + " bytes, got " +
                              std::to_string(packed.size));
  }
  if (n == 0) return Status::Ok();
  if (packed.bytes == nullptr || d_out == nullptr) {
    return Status::InvalidArgument("DecodeCuda: null buffer");
  }
  CPD_RETURN_IF_ERROR(CheckDeviceBuffer(packed.bytes, "DecodeCuda: packed bytes", 1));
  CPD_RETURN_IF_ERROR(CheckDeviceBuffer(d_out, "DecodeCuda: output"));
  return DecodeRun(format, packed, d_out, static_cast<cudaStream_t>(stream));
}

}  // namespace cpd
