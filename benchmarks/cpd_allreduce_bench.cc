// cpd-allreduce-bench: the gradient all-reduce algorithms against plain MPI_Allreduce (float32)
// on the same buffer in the same run, after nccl-tests. Run under mpirun:
//
//   mpirun -np 4 build/bin/cpd-allreduce-bench -b 1M -e 64M -f 4 --formats e4m3,e3m0
//       --algos fp32,emulate,packed --aps on   (one line)
//
// Sizes are bytes of float32 gradient (8, 64K, 64M). For every size: MPI_Allreduce, then each
// algorithm (fp32 once, emulate/packed per format). time: median over --iters of the slowest
// rank, after --warmup untimed runs. algbw = size / time; busbw = bytes this rank actually sent
// (GradientAllReducer::last_bytes_sent; MPI: the ring's 2(n-1)/n * size) / time; fp32-busbw =
// 2(n-1)/n * size / time, the bus bandwidth an fp32 all-reduce would need for the same time;
// x_mpi = time / MPI_Allreduce's time. relerr = ||out - sum|| / ||sum|| against a float64 sum of
// the same N(0, scale^2) inputs. #wrong: fp32 rows re-run on small integers, whose sum is exact,
// and count the elements that differ ("-" for quantised rows, whose error relerr reports).
//
// --device cuda: the gradients live in GPU memory (each rank on GPU local rank mod GPUs) and the
// reducer works on them (GradientAllReduceOptions::gradients = kDevice). The baseline row is then
// the float32 all-reduce a GPU job would otherwise run: ncclAllReduce with --comm nccl, or with
// --comm mpi the float32 gradient copied to the host, MPI_Allreduce and copied back ("staged"),
// timed from device to device; the x_base column is the ratio to it. Times wait for the GPU.
// Without a GPU (or in a build without CUDA) it prints one SKIP line and exits 0.
#include <mpi.h>
#include <omp.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "benchmarks/bench_util.h"
#include "comm/gradient_allreduce.h"
#include "comm/mpi_communicator.h"
#include "comm/perf_model.h"
#include "cpd/config.h"
#include "launcher/cli.h"
#include "launcher/world.h"
#if CPD_WITH_CUDA
#include <cuda_runtime.h>

#include "cpd/quantize_cuda.h"
#endif
#if CPD_WITH_NCCL
#include "comm/nccl_communicator.h"
#endif

namespace {

using cpd::Status;
using cpd::comm::AllReduceAlgo;
using cpd::comm::GradientAllReduceOptions;
using cpd::comm::GradientAllReducer;
using cpd::comm::GradientLayout;

// "8", "64K", "64M", "1G" (powers of 1024) -> bytes; 0 on a malformed value.
// Bytes of "N", "NK", "NM" or "NG"; 0 for anything else, or a size past 2^62.
size_t ParseSize(const std::string& s) {
  if (s.empty() || s.size() > 19) return 0;
  size_t mult = 1;
  std::string digits = s;
  const char last = char(std::toupper(static_cast<unsigned char>(s.back())));
  if (last == 'K' || last == 'M' || last == 'G') {
    mult = last == 'K' ? size_t(1) << 10 : last == 'M' ? size_t(1) << 20 : size_t(1) << 30;
    digits = s.substr(0, s.size() - 1);
  }
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) return 0;
  const unsigned long long n = std::stoull(digits);  // at most 19 digits: no overflow
  if (n > (1ull << 62) / mult) return 0;
  return size_t(n) * mult;
}

// The largest -e: a rank holds several buffers of this size (inputs, sums, staging copies), and
// ranks share a node, so a size past an eighth of the memory (or 4 GiB) would only end in
// allocation failure or swapping.
size_t MaxBenchBytes() {
  const size_t memory = size_t(sysconf(_SC_PHYS_PAGES)) * size_t(sysconf(_SC_PAGE_SIZE));
  return std::min(size_t(1) << 32, memory / 8);
}

// A usage error: said once, by rank 0 (before MPI starts every rank finds it), exit status 2.
[[gnu::format(printf, 1, 2)]] int Usage(const char* fmt, ...) {
  if (cpd::launcher::LaunchRank() == 0) {
    va_list args;
    va_start(args, fmt);
    std::vfprintf(stderr, fmt, args);
    va_end(args);
  }
  return 2;
}

std::string FormatSize(size_t bytes) {
  char buf[32];
  if (bytes >= (size_t(1) << 20) && bytes % (size_t(1) << 20) == 0) {
    std::snprintf(buf, sizeof buf, "%zuM", bytes >> 20);
  } else if (bytes >= 1024 && bytes % 1024 == 0) {
    std::snprintf(buf, sizeof buf, "%zuK", bytes >> 10);
  } else {
    std::snprintf(buf, sizeof buf, "%zu", bytes);
  }
  return buf;
}

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "cpd-allreduce-bench: %s\n", what.c_str());
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
}

void Check(const Status& s, const char* what) {
  if (!s.ok()) Fail(std::string(what) + ": " + s.ToString());
}

// Median over iterations of the slowest rank's time, in seconds.
template <typename Fn>
double TimeIt(MPI_Comm comm, int warmup, int iters, Fn&& fn) {
  for (int i = 0; i < warmup; ++i) fn(false);
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    MPI_Barrier(comm);
    const double dt = fn(true);
    double slowest = 0.0;
    MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, comm);
    t.push_back(slowest);
  }
  return cpd::bench::Median(t);
}

// A barrier whose waiting ranks sleep instead of spinning, so that a measurement on some ranks
// does not share its cores with the others' polling.
void QuietBarrier(MPI_Comm comm) {
  MPI_Request req;
  MPI_Ibarrier(comm, &req);
  int done = 0;
  while (MPI_Test(&req, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done) usleep(200);
}

// Ping-pong between ranks 0 and 1 (the others wait quietly): alpha = half the median round trip
// of an 8-byte message; beta = m / (half the median round trip of m bytes - alpha), m = 4 MiB.
// Every rank returns rank 0's figures.
cpd::comm::perf::Link MeasureLink(MPI_Comm comm, int rank) {
  auto half_round_trip = [&](std::size_t bytes, int reps) {
    std::vector<char> buf(bytes);
    std::vector<double> t;
    for (int i = 0; i < reps + 2; ++i) {
      const double t0 = MPI_Wtime();
      if (rank == 0) {
        MPI_Send(buf.data(), int(bytes), MPI_BYTE, 1, 7, comm);
        MPI_Recv(buf.data(), int(bytes), MPI_BYTE, 1, 7, comm, MPI_STATUS_IGNORE);
      } else if (rank == 1) {
        MPI_Recv(buf.data(), int(bytes), MPI_BYTE, 0, 7, comm, MPI_STATUS_IGNORE);
        MPI_Send(buf.data(), int(bytes), MPI_BYTE, 0, 7, comm);
      }
      if (i >= 2) t.push_back((MPI_Wtime() - t0) / 2.0);
    }
    return cpd::bench::Median(t);
  };
  double figures[2] = {0.0, 0.0};
  QuietBarrier(comm);
  if (rank <= 1) {
    const std::size_t m = std::size_t(4) << 20;
    const double alpha = half_round_trip(8, 200);
    const double big = half_round_trip(m, 20);
    figures[0] = alpha;
    figures[1] = double(m) / std::max(big - alpha, 1e-9);
  }
  QuietBarrier(comm);
  MPI_Bcast(figures, 2, MPI_DOUBLE, 0, comm);
  return {figures[0], figures[1]};
}

// Every rank sends 16 MiB / (P - 1) bytes to every other rank at once, as the packed
// algorithm's exchanges do (nonblocking sends and receives to all peers): bytes sent per rank /
// the median time of the slowest rank. Where ranks share a host's cores this is below the
// ping-pong's beta: the host's CPUs also run every rank's network stack.
double MeasureLoadedBandwidth(MPI_Comm comm, int rank, int np) {
  // 16 MiB in all: long enough for TCP to leave slow start.
  const std::size_t m = (std::size_t(16) << 20) / std::size_t(np - 1);
  std::vector<char> send(m * std::size_t(np)), recv(m * std::size_t(np));
  std::vector<MPI_Request> req;
  std::vector<double> t;
  for (int i = 0; i < 7; ++i) {
    QuietBarrier(comm);
    const double t0 = MPI_Wtime();
    req.clear();
    for (int d = 0; d < np; ++d) {
      if (d == rank) continue;
      req.emplace_back();
      MPI_Irecv(recv.data() + std::size_t(d) * m, int(m), MPI_BYTE, d, 9, comm, &req.back());
    }
    for (int d = 0; d < np; ++d) {
      if (d == rank) continue;
      req.emplace_back();
      MPI_Isend(send.data() + std::size_t(d) * m, int(m), MPI_BYTE, d, 9, comm, &req.back());
    }
    MPI_Waitall(int(req.size()), req.data(), MPI_STATUSES_IGNORE);
    double dt = MPI_Wtime() - t0, slowest = 0.0;
    MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, comm);
    if (i >= 2) t.push_back(slowest);
  }
  return double(np - 1) * double(m) / cpd::bench::Median(t);
}

// Rank 0 times the element loops of `format` (the others wait quietly); every rank gets them.
cpd::comm::perf::CodecCost MeasureCodec(MPI_Comm comm, int rank, const std::string& format) {
  double c[5] = {0, 0, 0, 0, 0};
  QuietBarrier(comm);
  if (rank == 0) {
    auto cost = cpd::comm::perf::MeasureCodecCost(format, std::size_t(1) << 22, 5);
    Check(cost.status(), "MeasureCodecCost");
    c[0] = cost->scan, c[1] = cost->encode, c[2] = cost->decode_add, c[3] = cost->decode;
    c[4] = cost->add;
  }
  QuietBarrier(comm);
  MPI_Bcast(c, 5, MPI_DOUBLE, 0, comm);
  return {c[0], c[1], c[2], c[3], c[4]};
}

// --project: the model's prediction for clusters this machine cannot emulate (no measurement).
struct ProjectionModel {
  std::string name;
  double params = 0;   // gradient elements
  double step_ms = 0;  // forward + backward + update of one step, not overlapped with the sum
};

// "NAME:PARAMS:STEP_MS,..." -> models; empty on a malformed list.
std::vector<ProjectionModel> ParseProjectionModels(const std::string& list) {
  std::vector<ProjectionModel> out;
  for (const std::string& item : cpd::bench::SplitList(list)) {
    const std::size_t a = item.find(':'), b = item.rfind(':');
    if (a == std::string::npos || b == a) return {};
    ProjectionModel m{item.substr(0, a), 0, 0};
    try {
      m.params = std::stod(item.substr(a + 1, b - a - 1));
      m.step_ms = std::stod(item.substr(b + 1));
    } catch (const std::exception&) {
      return {};
    }
    if (m.name.empty() || !(m.params >= 1) || !(m.step_ms >= 0)) return {};
    out.push_back(m);
  }
  return out;
}

// Per bucket of bucket_mb MiB of float32 (the last one holds the rest), as the trainer fuses
// gradients: the ring fp32 all-reduce and packed + APS (sum scaling, pipelined as by default).
void PrintProjection(const std::vector<ProjectionModel>& models, const std::vector<double>& gbits,
                     const std::vector<int>& ranks, double alpha_us, double mem_gbs,
                     double bucket_mb) {
  namespace perf = cpd::comm::perf;
  const perf::Host gpu{1, 2, 1};  // one rank per GPU; its kernels overlap the host's transfers
  const std::size_t bucket = std::size_t(bucket_mb * double(1 << 20) / sizeof(float));
  const int pipeline_kb = cpd::comm::GradientAllReduceOptions{}.pipeline_kb;
  std::printf(
      "# projection (model only, nothing measured): ring fp32 all-reduce vs packed + APS "
      "sum scaling; alpha %.1f us per message, element loops at %.0f GB/s (memory "
      "bound), buckets of %g MiB, pipeline %d KiB; step = compute (not overlapped) + "
      "all-reduce\n",
      alpha_us, mem_gbs, bucket_mb, pipeline_kb);
  std::printf("%12s %8s %6s %5s %9s %9s %7s %9s %7s %9s %8s %8s\n", "model", "params", "Gb/s", "P",
              "fp32(ms)", "e4m3(ms)", "x_fp32", "e3m0(ms)", "x_fp32", "step(ms)", "up_e4m3",
              "up_e3m0");
  for (const ProjectionModel& m : models) {
    const std::size_t n = std::size_t(m.params);
    for (double g : gbits) {
      const perf::Link link{alpha_us * 1e-6, g * 1e9 / 8.0};
      for (int p : ranks) {
        double fp32 = 0.0, packed[2] = {0.0, 0.0};
        const int bits[2] = {8, 4};
        for (std::size_t begin = 0; begin < n; begin += bucket) {
          const std::size_t len = std::min(bucket, n - begin);
          fp32 += perf::PredictFp32Ring({p, len, 32, false, false, 0}, link,
                                        perf::MemoryBoundCost(32, mem_gbs * 1e9), gpu)
                      .total;
          for (int k = 0; k < 2; ++k) {
            const perf::Case c{p,    len,  bits[k],
                               true, true, perf::PipelineRounds(len, p, bits[k], pipeline_kb)};
            packed[k] +=
                perf::PredictPacked(c, link, perf::MemoryBoundCost(bits[k], mem_gbs * 1e9), gpu)
                    .total;
          }
        }
        const double step = m.step_ms * 1e-3;
        std::printf("%12s %7.1fM %6.0f %5d %9.2f %9.2f %7.3f %9.2f %7.3f %9.1f %8.2f %8.2f\n",
                    m.name.c_str(), m.params / 1e6, g, p, fp32 * 1e3, packed[0] * 1e3,
                    packed[0] / fp32, packed[1] * 1e3, packed[1] / fp32, m.step_ms,
                    perf::StepSpeedup(step, fp32, packed[0]),
                    perf::StepSpeedup(step, fp32, packed[1]));
      }
    }
  }
}

// This rank's place among the ranks of its node, and their number.
struct NodeRanks {
  int rank = 0, size = 1;
};
NodeRanks LocalRanks() {
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local);
  NodeRanks n;
  MPI_Comm_rank(local, &n.rank);
  MPI_Comm_size(local, &n.size);
  MPI_Comm_free(&local);
  return n;
}

// Where the gradients live: host vectors, or (--device cuda) device buffers of the same sizes.
// The benchmark keeps its inputs and checks on the host and moves them with these.
class GradientMemory {
 public:
  explicit GradientMemory(bool device) : device_(device) {}
  GradientMemory(const GradientMemory&) = delete;
  GradientMemory& operator=(const GradientMemory&) = delete;
  ~GradientMemory() { Release(); }

  bool device() const { return device_; }
  // x (the inputs, kept), in (the reducer's input, used as scratch) and out, of count floats.
  void Resize(size_t count) {
    Release();
    count_ = count;
    for (float** p : {&x_, &in_, &out_}) {
      if (device_) {
#if CPD_WITH_CUDA
        CudaCheck(cudaMalloc(reinterpret_cast<void**>(p), count * sizeof(float)), "cudaMalloc");
#endif
      } else {
        *p = new float[count];
      }
    }
  }
  float* x() { return x_; }
  float* in() { return in_; }
  float* out() { return out_; }
  void Upload(float* dst, const std::vector<float>& src) { Copy(dst, src.data()); }
  void Download(std::vector<float>* dst, const float* src) { Copy(dst->data(), src); }
  // in = x, before every run (the reducer may use its input as scratch).
  void RestoreInput() { Copy(in_, x_); }
  // Waits for the device's queued work (timing ends here).
  void Wait() {
#if CPD_WITH_CUDA
    if (device_) CudaCheck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
#endif
  }

 private:
#if CPD_WITH_CUDA
  static void CudaCheck(cudaError_t e, const char* what) {
    if (e != cudaSuccess) Fail(std::string(what) + ": " + cudaGetErrorString(e));
  }
#endif
  // Either side may be host or device memory (unified addressing).
  void Copy(float* dst, const float* src) {
    if (!device_) {
      std::memcpy(dst, src, count_ * sizeof(float));
      return;
    }
#if CPD_WITH_CUDA
    CudaCheck(cudaMemcpy(dst, src, count_ * sizeof(float), cudaMemcpyDefault), "cudaMemcpy");
#endif
  }
  void Release() {
    for (float** p : {&x_, &in_, &out_}) {
      if (*p == nullptr) continue;
#if CPD_WITH_CUDA
      if (device_) cudaFree(*p);
#endif
      if (!device_) delete[] * p;
      *p = nullptr;
    }
  }

  bool device_;
  size_t count_ = 0;
  float *x_ = nullptr, *in_ = nullptr, *out_ = nullptr;
};

// What the command line asks for. ValidateOptions also fills pipeline_kb's default (-1: the
// reducer's) and SetUpWorld threads' (0: cores / ranks on this node).
struct BenchOptions {
  std::string minbytes = "1M", maxbytes = "64M", formats_list = "e4m3,e3m0",
              algos_list = "fp32,emulate,packed", aps = "on";
  double stepfactor = 2;
  int iters = 10, warmup = 2, threads = 0, pipeline_kb = -1;
  double bucket_mb = 25;
  double scale = 1.0;
  std::string device = "cpu", comm_kind = "mpi";
  bool model = false, project = false;
  std::string project_models = "ResNet-50:25.6e6:85,GPT-2-small:124e6:15",
              project_gbits = "100,400", project_ranks = "64,512,4096";
  double project_alpha_us = 5.0, project_mem_gbs = 2000.0;
  // Filled by ValidateOptions: the sizes in bytes, --device cuda, the parsed lists.
  size_t min_b = 0, max_b = 0;
  bool on_gpu = false;
  std::vector<AllReduceAlgo> algos;
  std::vector<std::string> formats;
};

void AddOptions(CLI::App* app, BenchOptions* o) {
  app->add_option("--device", o->device,
                  "cpu (host gradients) | cuda (gradients in GPU memory; SKIP without a GPU)")
      ->capture_default_str();
  app->add_option("--comm", o->comm_kind,
                  "With --device cuda: mpi (packed bytes staged through pinned host memory) | "
                  "nccl")
      ->capture_default_str();
  app->add_option("-b,--minbytes", o->minbytes, "Smallest size, bytes of float32 (8, 64K, 64M)")
      ->capture_default_str();
  app->add_option("-e,--maxbytes", o->maxbytes, "Largest size")->capture_default_str();
  app->add_option("-f,--stepfactor", o->stepfactor, "Size multiplier between rows")
      ->capture_default_str();
  app->add_option("--formats", o->formats_list, "Gradient formats for emulate/packed")
      ->capture_default_str();
  app->add_option("--algos", o->algos_list, "fp32, emulate, packed")->capture_default_str();
  app->add_option("--aps", o->aps, "Auto-precision scaling: on or off")->capture_default_str();
  app->add_option("--iters", o->iters, "Timed iterations (median reported)")->capture_default_str();
  app->add_option("--warmup", o->warmup, "Untimed iterations first")->capture_default_str();
  app->add_option("--threads", o->threads,
                  "Quantisation threads per rank; 0 = cores / ranks on this node")
      ->check(cpd::launcher::ThreadCount())
      ->capture_default_str();
  app->add_option("--pipeline-kb", o->pipeline_kb,
                  "KiB of codes per round of the pipelined emulate/packed schedule; 0 = "
                  "sequential (default: the reducer's, 256)");
  app->add_option("--bucket-mb", o->bucket_mb, "Fusion bucket, MiB of float32")
      ->capture_default_str();
  app->add_option("--scale", o->scale,
                  "Standard deviation of the N(0, s^2) inputs (e.g. 1e-5 to see e4m3 flush "
                  "without APS)")
      ->capture_default_str();
  app->add_flag("--model", o->model,
                "Also predict every fp32 and packed row with the performance model "
                "(comm/perf_model.h) from parameters measured in this run (ping-pong alpha and "
                "beta between ranks 0 and 1, the bandwidth of all ranks exchanging at once, the "
                "element loops' cost per format): columns pp(us) and loaded(us) with their err "
                "(model vs measured)");
  app->add_flag("--project", o->project,
                "Print the model's projection for large clusters (no measurement) and exit: ring "
                "fp32 vs packed e4m3/e3m0 + APS per model, link and world size");
  app->add_option("--project-models", o->project_models,
                  "NAME:PARAMS:STEP_MS,... gradient elements and the step's compute time (ms)")
      ->capture_default_str();
  app->add_option("--project-gbits", o->project_gbits, "Link rates, Gbit/s")->capture_default_str();
  app->add_option("--project-ranks", o->project_ranks, "World sizes")->capture_default_str();
  app->add_option("--project-alpha-us", o->project_alpha_us, "Start-up time of one message, us")
      ->capture_default_str();
  app->add_option("--project-mem-gbs", o->project_mem_gbs,
                  "Memory bandwidth the element loops run at (GPU kernels), GB/s")
      ->capture_default_str();
}

// --project: checks its lists and prints the projection; the exit status.
int RunProjection(const BenchOptions& o) {
  const std::vector<ProjectionModel> models = ParseProjectionModels(o.project_models);
  std::vector<double> gbits;
  std::vector<int> ranks;
  try {
    for (const std::string& g : cpd::bench::SplitList(o.project_gbits))
      gbits.push_back(std::stod(g));
    for (const std::string& p : cpd::bench::SplitList(o.project_ranks))
      ranks.push_back(std::stoi(p));
  } catch (const std::exception&) {
    gbits.clear();
  }
  const bool ok_lists = !models.empty() && !gbits.empty() && !ranks.empty() &&
                        std::all_of(gbits.begin(), gbits.end(), [](double g) { return g > 0; }) &&
                        std::all_of(ranks.begin(), ranks.end(), [](int p) { return p >= 2; });
  if (!ok_lists || !(o.project_alpha_us >= 0) || !(o.project_mem_gbs > 0) || !(o.bucket_mb > 0)) {
    return Usage(
        "cpd-allreduce-bench: --project needs --project-models NAME:PARAMS:STEP_MS,... "
        "(PARAMS >= 1, STEP_MS >= 0), --project-gbits > 0, --project-ranks >= 2, "
        "--project-alpha-us >= 0, --project-mem-gbs > 0, --bucket-mb > 0\n");
  }
  PrintProjection(models, gbits, ranks, o.project_alpha_us, o.project_mem_gbs, o.bucket_mb);
  return 0;
}

// Checks the measurement's options in a fixed order (the first fault is the one reported) and
// fills the parsed fields. Returns 0, or Usage's exit status.
int ValidateOptions(const CLI::App& app, BenchOptions* o) {
  o->min_b = ParseSize(o->minbytes);
  o->max_b = ParseSize(o->maxbytes);
  if (o->min_b < 4 || o->max_b < o->min_b) {
    return Usage(
        "cpd-allreduce-bench: bad -b/-e '%s'/'%s' (need 4 <= min <= max, e.g. "
        "-b 8 -e 64M)\n",
        o->minbytes.c_str(), o->maxbytes.c_str());
  }
  if (o->max_b > MaxBenchBytes()) {
    return Usage(
        "cpd-allreduce-bench: -e %s is not accepted: at most %s (4 GiB, or an eighth of "
        "this machine's memory: each rank holds several buffers of this size)\n",
        o->maxbytes.c_str(), FormatSize(MaxBenchBytes()).c_str());
  }
  if (!(o->bucket_mb > 0) || !(o->bucket_mb <= cpd::comm::kMaxBucketMb)) {
    return Usage(
        "cpd-allreduce-bench: --bucket-mb %g is not accepted: a number of MiB > 0 and "
        "<= %g\n",
        o->bucket_mb, cpd::comm::kMaxBucketMb);
  }
  if (app.count("--pipeline-kb") > 0 &&
      (o->pipeline_kb < 0 || o->pipeline_kb > cpd::comm::kMaxPipelineKb)) {
    return Usage(
        "cpd-allreduce-bench: --pipeline-kb %d is not accepted: 0 (sequential) or "
        "1..%d KiB of codes per round\n",
        o->pipeline_kb, cpd::comm::kMaxPipelineKb);
  }
  if (!(o->stepfactor > 1.0)) {
    return Usage("cpd-allreduce-bench: -f must be > 1, got %g\n", o->stepfactor);
  }
  if (o->aps != "on" && o->aps != "off") {
    return Usage("cpd-allreduce-bench: --aps must be on or off, got '%s'\n", o->aps.c_str());
  }
  if (o->pipeline_kb < 0) o->pipeline_kb = GradientAllReduceOptions{}.pipeline_kb;
  if (o->iters < 1 || o->warmup < 0 || o->threads < 0 || !(o->scale > 0.0) ||
      !std::isfinite(o->scale)) {
    return Usage(
        "cpd-allreduce-bench: need --iters >= 1, --warmup >= 0, --threads >= 0, "
        "--scale > 0\n");
  }
  if (o->device != "cpu" && o->device != "cuda") {
    return Usage("cpd-allreduce-bench: --device must be cpu or cuda, got '%s'\n",
                 o->device.c_str());
  }
  if (o->comm_kind != "mpi" && o->comm_kind != "nccl") {
    return Usage("cpd-allreduce-bench: --comm must be mpi or nccl, got '%s'\n",
                 o->comm_kind.c_str());
  }
  if (o->comm_kind == "nccl" && o->device != "cuda") {
    return Usage("cpd-allreduce-bench: --comm nccl needs --device cuda\n");
  }
  o->on_gpu = o->device == "cuda";
  if (o->model && o->on_gpu) {
    return Usage(
        "cpd-allreduce-bench: --model predicts host gradients only (not "
        "--device cuda)\n");
  }
  for (const std::string& a : cpd::bench::SplitList(o->algos_list)) {
    auto parsed = cpd::comm::ParseAllReduceAlgo(a);
    if (!parsed.ok()) {
      return Usage("cpd-allreduce-bench: --algos: %s\n", parsed.status().ToString().c_str());
    }
    o->algos.push_back(parsed.value());
  }
  o->formats = cpd::bench::SplitList(o->formats_list);
  for (const std::string& f : o->formats) {
    auto parsed = cpd::Format::Parse(f);
    if (!parsed.ok()) {
      return Usage("cpd-allreduce-bench: --formats: %s\n", parsed.status().ToString().c_str());
    }
  }
  return 0;
}

// The ranks and communicators of the run.
struct BenchWorld {
  std::unique_ptr<cpd::comm::MpiCommunicator> comm;
  int rank = 0, np = 1;
  MPI_Comm mc = MPI_COMM_NULL;
  NodeRanks node;
  int cores = 1;
  // What the reducer and the baseline use: comm, or (--comm nccl) nccl.
  cpd::comm::Communicator* reduce_comm = nullptr;
#if CPD_WITH_NCCL
  std::unique_ptr<cpd::comm::NcclCommunicator> nccl;  // destroyed before comm
#endif
  std::string gpu_name;  // --device cuda
  const char* baseline = "mpi";

  // The baseline all-reduces in place on the reducer's input (ncclAllReduce).
  bool in_place_baseline(const BenchOptions& o) const {
    return o.on_gpu && reduce_comm != comm.get();
  }
};

// --device cuda: picks this rank's GPU. False (after rank 0 printed a SKIP line) when some rank
// has none.
bool SelectGpu(BenchWorld* w) {
  int gpu_ok = 1;
#if CPD_WITH_CUDA
  int gpus = 0;
  if (!cpd::CudaDeviceAvailable() || cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 1) {
    gpu_ok = 0;
  }
#else
  gpu_ok = 0;
#endif
  MPI_Allreduce(MPI_IN_PLACE, &gpu_ok, 1, MPI_INT, MPI_MIN, w->mc);
  if (!gpu_ok) {
    if (w->rank == 0) {
      std::printf("SKIP: --device cuda: %s\n",
                  CPD_WITH_CUDA ? "no CUDA device on some rank" : "this build has no CUDA");
    }
    return false;
  }
#if CPD_WITH_CUDA
  if (cudaSetDevice(w->node.rank % gpus) != cudaSuccess) Fail("cudaSetDevice failed");
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, w->node.rank % gpus) == cudaSuccess) w->gpu_name = prop.name;
#endif
  return true;
}

// Starts MPI and the communicators, and fills o->threads' default. Returns -1 to go on, or the
// exit status: 1 when MPI cannot start, 0 after a SKIP line (no GPU, or no NCCL in this build).
int SetUpWorld(BenchOptions* o, BenchWorld* w) {
  auto created = cpd::comm::MpiCommunicator::Create();
  if (!created.ok()) {
    std::fprintf(stderr, "cpd-allreduce-bench: %s\n", created.status().ToString().c_str());
    return 1;
  }
  w->comm = std::move(created).value();
  w->rank = w->comm->rank();
  w->np = w->comm->size();
  w->mc = w->comm->mpi_comm();
  w->node = LocalRanks();
  w->cores = int(std::max(1u, std::thread::hardware_concurrency()));
  if (o->threads == 0) o->threads = std::max(1, w->cores / w->node.size);

  w->reduce_comm = w->comm.get();
  if (o->on_gpu && !SelectGpu(w)) return 0;
#if CPD_WITH_NCCL
  if (o->comm_kind == "nccl") {
    auto made = cpd::comm::NcclCommunicator::Create(w->comm.get(), -1);
    Check(made.status(), "NcclCommunicator::Create");
    w->nccl = std::move(made).value();
    w->reduce_comm = w->nccl.get();
  }
#else
  if (o->comm_kind == "nccl") {
    if (w->rank == 0) std::printf("SKIP: --comm nccl: this build has no NCCL\n");
    return 0;
  }
#endif
  w->baseline = !o->on_gpu ? "mpi" : o->comm_kind == "nccl" ? "nccl" : "staged";
  return -1;
}

void PrintRunHeader(const BenchOptions& o, const BenchWorld& w) {
  cpd::bench::WarnIfUnoptimised();
  std::string load = "?";
  std::ifstream la("/proc/loadavg");
  std::getline(la, load);
  std::printf(
      "# cpd-allreduce-bench: %d ranks (%d on this node, %d cores), %d quantisation "
      "thread(s) per rank, APS %s, bucket %g MiB, pipeline %d KiB, median of %d after %d "
      "warm-up\n",
      w.np, w.node.size, w.cores, o.threads, o.aps.c_str(), o.bucket_mb, o.pipeline_kb, o.iters,
      o.warmup);
  if (o.on_gpu) {
    std::printf(
        "# gradients on the GPU (%s), transport %s; baseline '%s' (float32), x_base = "
        "time / its time\n",
        w.gpu_name.c_str(),
        o.comm_kind == "nccl" ? "NCCL" : "MPI, packed bytes through pinned memory", w.baseline);
  }
  std::printf("# load average at start: %s\n", load.c_str());
}

// --model: the machine's parameters, measured before the rows. Two links: the ping-pong's
// (alpha, beta), and the same alpha with the bandwidth of every rank exchanging at once.
struct MachineModel {
  cpd::comm::perf::Link link_pp, link_loaded;
  cpd::comm::perf::Host host;
  std::vector<cpd::comm::perf::CodecCost> codec;  // per format (e4m3 without --formats)
};

MachineModel MeasureMachine(const BenchOptions& o, const BenchWorld& w) {
  MachineModel m{{}, {}, {w.node.size, w.cores, o.threads}, {}};
  if (!o.model) return m;
  if (w.np < 2) Fail("--model needs at least 2 ranks (ping-pong)");
  m.link_pp = MeasureLink(w.mc, w.rank);
  m.link_loaded = {m.link_pp.alpha_s, MeasureLoadedBandwidth(w.mc, w.rank, w.np)};
  for (const std::string& f : o.formats.empty() ? std::vector<std::string>{"e4m3"} : o.formats) {
    m.codec.push_back(MeasureCodec(w.mc, w.rank, f));
  }
  if (w.rank == 0) {
    const cpd::comm::perf::Host& host = m.host;
    std::printf(
        "# model: alpha %.1f us, beta %.1f MB/s (ping-pong 0-1), loaded beta %.1f MB/s "
        "(all ranks at once); %d rank(s) on %d core(s), %d thread(s): parallelism "
        "%.2f, overlap %s\n",
        m.link_pp.alpha_s * 1e6, m.link_pp.beta_bytes_per_s / 1e6,
        m.link_loaded.beta_bytes_per_s / 1e6, host.ranks, host.cores, host.threads,
        host.Parallelism(), host.Overlaps() ? "yes" : "no");
    for (std::size_t i = 0; i < o.formats.size(); ++i) {
      std::printf(
          "# model %s, ns/element on one thread: scan %.3f encode %.3f decode+add "
          "%.3f decode %.3f; float32 add %.3f\n",
          o.formats[i].c_str(), m.codec[i].scan * 1e9, m.codec[i].encode * 1e9,
          m.codec[i].decode_add * 1e9, m.codec[i].decode * 1e9, m.codec[i].add * 1e9);
    }
  }
  return m;
}

void PrintTableHeader(const BenchOptions& o) {
  std::printf("%10s %10s %7s %8s %11s %8s %8s %10s %7s %9s %7s", "size", "count", "format", "algo",
              "time(us)", "algbw", "busbw", "fp32-busbw", o.on_gpu ? "x_base" : "x_mpi", "relerr",
              "#wrong");
  std::printf(o.model ? " %11s %7s %11s %7s\n" : "\n", "pp(us)", "err", "loaded(us)", "err");
  std::printf("%10s %10s %7s %8s %11s %8s %8s %10s %7s %9s %7s", "(B)", "(elems)", "", "", "",
              "(GB/s)", "(GB/s)", "(GB/s)", "", "", "");
  std::printf(o.model ? " %11s %7s %11s %7s\n" : "\n", "(model)", "(%)", "(model)", "(%)");
}

// Small integers: every fp32 sum of them is exact.
float IntValue(size_t i, int r) { return float(int((i * 7 + size_t(r) * 3) % 17) - 8); }

// One size's inputs, the same for every row: N(0, scale^2) floats, different on every rank,
// with a float64 reference sum, and small integers for counting wrong elements.
class RowInputs {
 public:
  RowInputs(size_t count, double scale, const BenchWorld& w)
      : count_(count), np_(w.np), mc_(w.mc), x_(count), ref_(count), xi_(count) {
    std::mt19937_64 rng(1234567u + uint64_t(w.rank));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& v : x_) v = normal(rng) * float(scale);
    ref_.assign(x_.begin(), x_.end());
    MPI_Allreduce(MPI_IN_PLACE, ref_.data(), int(count), MPI_DOUBLE, MPI_SUM, mc_);
    for (double v : ref_) ref2_ += v * v;
    for (size_t i = 0; i < count; ++i) xi_[i] = IntValue(i, w.rank);
  }

  const std::vector<float>& x() const { return x_; }
  const std::vector<float>& xi() const { return xi_; }
  // ||o - sum|| / ||sum|| against the float64 sum of x.
  double RelErr(const std::vector<float>& o) const {
    double e2 = 0.0;
    for (size_t i = 0; i < count_; ++i) e2 += (double(o[i]) - ref_[i]) * (double(o[i]) - ref_[i]);
    return ref2_ > 0.0 ? std::sqrt(e2 / ref2_) : 0.0;
  }
  // Elements of o that differ from the exact sum of xi, over all ranks (a collective).
  unsigned long long CountWrong(const std::vector<float>& o) const {
    size_t wrong = 0;
    for (size_t i = 0; i < count_; ++i) {
      float e = 0.0f;
      for (int r = 0; r < np_; ++r) e += IntValue(i, r);
      wrong += o[i] != e;
    }
    unsigned long long w = wrong, total = 0;
    MPI_Allreduce(&w, &total, 1, MPI_UNSIGNED_LONG_LONG, MPI_SUM, mc_);
    return total;
  }

 private:
  size_t count_;
  int np_;
  MPI_Comm mc_;
  std::vector<float> x_;
  std::vector<double> ref_;
  double ref2_ = 0.0;
  std::vector<float> xi_;
};

// The model's times (s) with the ping-pong and the loaded link, < 0 for none.
using Predicted = std::pair<double, double>;

// What one row measured.
struct RowResult {
  double t = 0;          // seconds
  double sent = 0;       // bytes this rank sent
  double err = 0;        // relerr
  long long wrong = -1;  // -1: not counted
  Predicted predicted{-1.0, -1.0};
};

// Rank 0 prints the rows of one size.
class RowPrinter {
 public:
  RowPrinter(const BenchOptions& o, const BenchWorld& w, size_t count)
      : rank_(w.rank),
        model_(o.model),
        count_(count),
        bytes_(count * sizeof(float)),
        ring_(2.0 * (w.np - 1) / w.np * double(bytes_)) {}

  // Bytes an fp32 ring all-reduce sends per rank.
  double ring() const { return ring_; }

  void Print(const char* format, const char* algo, const RowResult& r, double t_mpi) const {
    if (rank_ != 0) return;
    char wrong_s[24];
    if (r.wrong < 0) {
      std::snprintf(wrong_s, sizeof wrong_s, "-");
    } else {
      std::snprintf(wrong_s, sizeof wrong_s, "%lld", r.wrong);
    }
    const double t = r.t;
    std::printf("%10s %10zu %7s %8s %11.1f %8.2f %8.2f %10.2f %7.3f %9.2e %7s",
                FormatSize(bytes_).c_str(), count_, format, algo, t * 1e6, bytes_ / t / 1e9,
                r.sent / t / 1e9, ring_ / t / 1e9, t / t_mpi, r.err, wrong_s);
    if (!model_) {
      std::printf("\n");
    } else if (r.predicted.first < 0.0) {
      std::printf(" %11s %7s %11s %7s\n", "-", "-", "-", "-");
    } else {
      std::printf(" %11.1f %+7.1f %11.1f %+7.1f\n", r.predicted.first * 1e6,
                  (r.predicted.first - t) / t * 100.0, r.predicted.second * 1e6,
                  (r.predicted.second - t) / t * 100.0);
    }
    std::fflush(stdout);
  }

 private:
  int rank_;
  bool model_;
  size_t count_;
  size_t bytes_;
  double ring_;
};

// The baseline's float32 all-reduce of `src` into mem->out(): MPI_Allreduce on host buffers; on
// the GPU ncclAllReduce (in place on mem->in(), so src is copied there first) or staged through
// the host (`staged`, count floats).
void BaselineAllReduce(const BenchOptions& o, const BenchWorld& w, size_t count,
                       GradientMemory* mem, std::vector<float>* staged, float* src) {
  if (!o.on_gpu) {
    MPI_Allreduce(src, mem->out(), int(count), MPI_FLOAT, MPI_SUM, w.mc);
  } else if (w.reduce_comm != w.comm.get()) {
    mem->RestoreInput();  // ncclAllReduce works in place on mem.in()
    Check(w.reduce_comm->AllReduce(mem->in(), count, cpd::comm::ReduceOp::kSum), "AllReduce");
  } else {
    mem->Download(staged, src);
    MPI_Allreduce(MPI_IN_PLACE, staged->data(), int(count), MPI_FLOAT, MPI_SUM, w.mc);
    mem->Upload(mem->out(), *staged);
  }
  mem->Wait();
}

// The baseline row (float32: MPI_Allreduce, NCCL or staged); prints it and returns its time.
// Leaves mem->x() holding the inputs.
double RunBaselineRow(const BenchOptions& o, const BenchWorld& w, const MachineModel& m,
                      const RowInputs& in, const RowPrinter& printer, GradientMemory* mem) {
  const size_t count = in.x().size();
  std::vector<float> out(count);
  std::vector<float> staged(o.on_gpu ? count : 0);
  const bool in_place = w.in_place_baseline(o);
  RowResult r;
  r.t = TimeIt(w.mc, o.warmup, o.iters, [&](bool) {
    if (in_place) mem->RestoreInput();
    mem->Wait();
    MPI_Barrier(w.mc);
    const double t0 = MPI_Wtime();
    if (in_place) {
      Check(w.reduce_comm->AllReduce(mem->in(), count, cpd::comm::ReduceOp::kSum), "AllReduce");
      mem->Wait();
    } else {
      BaselineAllReduce(o, w, count, mem, &staged, mem->x());
    }
    return MPI_Wtime() - t0;
  });
  auto result = [&]() -> const float* { return in_place ? mem->in() : mem->out(); };
  mem->Download(&out, result());
  r.err = in.RelErr(out);
  mem->Upload(mem->x(), in.xi());
  BaselineAllReduce(o, w, count, mem, &staged, mem->x());
  mem->Download(&out, result());
  mem->Upload(mem->x(), in.x());
  if (o.model) {
    const cpd::comm::perf::Case c{w.np, count, 32, false, false, 0};
    r.predicted = {
        cpd::comm::perf::PredictFp32Ring(c, m.link_pp, m.codec.front(), m.host).total,
        cpd::comm::perf::PredictFp32Ring(c, m.link_loaded, m.codec.front(), m.host).total};
  }
  r.sent = printer.ring();
  r.wrong = (long long)in.CountWrong(out);
  printer.Print("fp32", w.baseline, r, r.t);
  return r.t;
}

// --model: the packed algorithm's time for each of the reducer's buckets, summed.
Predicted PredictPackedRow(const BenchWorld& w, const MachineModel& m,
                           const cpd::comm::perf::CodecCost& codec,
                           const GradientAllReduceOptions& opts, const GradientAllReducer& r) {
  Predicted predicted{0.0, 0.0};
  const int bits = cpd::Format::Parse(opts.format)->bits();
  for (const cpd::comm::GradientBucket& bucket : r.buckets()) {
    const std::size_t n = bucket.end - bucket.begin;
    const cpd::comm::perf::Case c{w.np,
                                  n,
                                  bits,
                                  opts.aps,
                                  cpd::comm::UsesApsSumScaling(opts),
                                  cpd::comm::perf::PipelineRounds(n, w.np, bits, opts.pipeline_kb)};
    predicted.first += cpd::comm::perf::PredictPacked(c, m.link_pp, codec, m.host).total;
    predicted.second += cpd::comm::perf::PredictPacked(c, m.link_loaded, codec, m.host).total;
  }
  return predicted;
}

// One reducer row: `algo` on format formats[fi] (fp32: no format), timed on mem's inputs.
void RunReducerRow(const BenchOptions& o, const BenchWorld& w, const MachineModel& m,
                   const RowInputs& in, const RowPrinter& printer, GradientMemory* mem,
                   AllReduceAlgo algo, const std::string& f, std::size_t fi, double t_mpi) {
  const size_t count = in.x().size();
  GradientLayout layout;
  layout.layer_names = {"grad"};
  layout.offsets = {0, count};
  GradientAllReduceOptions opts;
  opts.algo = algo;
  opts.format = algo == AllReduceAlgo::kFp32 ? "e4m3" : f;
  opts.aps = o.aps == "on";
  opts.bucket_mb = o.bucket_mb;
  opts.threads = o.threads;
  opts.pipeline_kb = o.pipeline_kb;
  if (o.on_gpu) opts.gradients = cpd::comm::MemorySpace::kDevice;
  auto red = GradientAllReducer::Create(w.reduce_comm, opts, layout, 1);
  Check(red.status(), "GradientAllReducer::Create");
  GradientAllReducer& r = *red.value();
  float* ptrs[1] = {mem->in()};
  RowResult row;
  // The inputs may serve as scratch: restore them (untimed) before every run.
  row.t = TimeIt(w.mc, o.warmup, o.iters, [&](bool) {
    mem->RestoreInput();
    mem->Wait();
    MPI_Barrier(w.mc);
    const double t0 = MPI_Wtime();
    Check(r.Reduce(ptrs, mem->out(), 0), "Reduce");
    mem->Wait();
    return MPI_Wtime() - t0;
  });
  row.sent = double(r.last_bytes_sent());
  std::vector<float> out(count);
  mem->Download(&out, mem->out());
  row.err = in.RelErr(out);
  if (algo == AllReduceAlgo::kFp32) {
    mem->Upload(mem->in(), in.xi());
    Check(r.Reduce(ptrs, mem->out(), 0), "Reduce");
    mem->Download(&out, mem->out());
    row.wrong = (long long)in.CountWrong(out);
  }
  if (o.model && algo == AllReduceAlgo::kPacked) {
    row.predicted = PredictPackedRow(w, m, m.codec[fi], opts, r);
  }
  printer.Print(algo == AllReduceAlgo::kFp32 ? "fp32" : f.c_str(),
                cpd::comm::AllReduceAlgoName(algo), row, t_mpi);
}

// Every row of one size: the baseline, then each algorithm on each format (fp32 once).
void RunSize(const BenchOptions& o, const BenchWorld& w, const MachineModel& m, size_t count) {
  const RowInputs in(count, o.scale, w);
  const RowPrinter printer(o, w, count);
  GradientMemory mem(o.on_gpu);
  mem.Resize(count);
  mem.Upload(mem.x(), in.x());
  const double t_mpi = RunBaselineRow(o, w, m, in, printer, &mem);
  for (AllReduceAlgo algo : o.algos) {
    const std::vector<std::string> fmts =
        algo == AllReduceAlgo::kFp32 ? std::vector<std::string>{"fp32"} : o.formats;
    for (std::size_t fi = 0; fi < fmts.size(); ++fi) {
      RunReducerRow(o, w, m, in, printer, &mem, algo, fmts[fi], fi, t_mpi);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "cpd-allreduce-bench: quantised gradient all-reduce vs MPI_Allreduce (fp32), "
      "same buffers, same run. Run under mpirun."};
  BenchOptions o;
  AddOptions(&app, &o);
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return Usage("cpd-allreduce-bench: %s\n", e.what());
  }
  if (o.project) return RunProjection(o);
  if (int status = ValidateOptions(app, &o); status != 0) return status;

  BenchWorld w;
  if (int status = SetUpWorld(&o, &w); status >= 0) return status;
  if (w.rank == 0) PrintRunHeader(o, w);
  const MachineModel m = MeasureMachine(o, w);
  if (w.rank == 0) PrintTableHeader(o);
  for (double size_d = double(o.min_b); size_d <= double(o.max_b) * 1.0000001;
       size_d *= o.stepfactor) {
    RunSize(o, w, m, std::max<size_t>(1, size_t(size_d) / sizeof(float)));
  }
  return 0;
}
