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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "cpd-allreduce-bench: quantised gradient all-reduce vs MPI_Allreduce (fp32), "
      "same buffers, same run. Run under mpirun."};
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
  app.add_option("--device", device,
                 "cpu (host gradients) | cuda (gradients in GPU memory; SKIP without a GPU)")
      ->capture_default_str();
  app.add_option("--comm", comm_kind,
                 "With --device cuda: mpi (packed bytes staged through pinned host memory) | "
                 "nccl")
      ->capture_default_str();
  app.add_option("-b,--minbytes", minbytes, "Smallest size, bytes of float32 (8, 64K, 64M)")
      ->capture_default_str();
  app.add_option("-e,--maxbytes", maxbytes, "Largest size")->capture_default_str();
  app.add_option("-f,--stepfactor", stepfactor, "Size multiplier between rows")
      ->capture_default_str();
  app.add_option("--formats", formats_list, "Gradient formats for emulate/packed")
      ->capture_default_str();
  app.add_option("--algos", algos_list, "fp32, emulate, packed")->capture_default_str();
  app.add_option("--aps", aps, "Auto-precision scaling: on or off")->capture_default_str();
  app.add_option("--iters", iters, "Timed iterations (median reported)")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed iterations first")->capture_default_str();
  app.add_option("--threads", threads,
                 "Quantisation threads per rank; 0 = cores / ranks on this node")
      ->check(cpd::launcher::ThreadCount())
      ->capture_default_str();
  app.add_option("--pipeline-kb", pipeline_kb,
                 "KiB of codes per round of the pipelined emulate/packed schedule; 0 = "
                 "sequential (default: the reducer's, 256)");
  app.add_option("--bucket-mb", bucket_mb, "Fusion bucket, MiB of float32")->capture_default_str();
  app.add_option("--scale", scale,
                 "Standard deviation of the N(0, s^2) inputs (e.g. 1e-5 to see e4m3 flush "
                 "without APS)")
      ->capture_default_str();
  app.add_flag("--model", model,
               "Also predict every fp32 and packed row with the performance model "
               "(comm/perf_model.h) from parameters measured in this run (ping-pong alpha and "
               "beta between ranks 0 and 1, the bandwidth of all ranks exchanging at once, the "
               "element loops' cost per format): columns pp(us) and loaded(us) with their err "
               "(model vs measured)");
  app.add_flag("--project", project,
               "Print the model's projection for large clusters (no measurement) and exit: ring "
               "fp32 vs packed e4m3/e3m0 + APS per model, link and world size");
  app.add_option("--project-models", project_models,
                 "NAME:PARAMS:STEP_MS,... gradient elements and the step's compute time (ms)")
      ->capture_default_str();
  app.add_option("--project-gbits", project_gbits, "Link rates, Gbit/s")->capture_default_str();
  app.add_option("--project-ranks", project_ranks, "World sizes")->capture_default_str();
  app.add_option("--project-alpha-us", project_alpha_us, "Start-up time of one message, us")
      ->capture_default_str();
  app.add_option("--project-mem-gbs", project_mem_gbs,
                 "Memory bandwidth the element loops run at (GPU kernels), GB/s")
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return Usage("cpd-allreduce-bench: %s\n", e.what());
  }
  if (project) {
    const std::vector<ProjectionModel> models = ParseProjectionModels(project_models);
    std::vector<double> gbits;
    std::vector<int> ranks;
    try {
      for (const std::string& g : cpd::bench::SplitList(project_gbits))
        gbits.push_back(std::stod(g));
      for (const std::string& p : cpd::bench::SplitList(project_ranks))
        ranks.push_back(std::stoi(p));
    } catch (const std::exception&) {
      gbits.clear();
    }
    const bool ok_lists = !models.empty() && !gbits.empty() && !ranks.empty() &&
                          std::all_of(gbits.begin(), gbits.end(), [](double g) { return g > 0; }) &&
                          std::all_of(ranks.begin(), ranks.end(), [](int p) { return p >= 2; });
    if (!ok_lists || !(project_alpha_us >= 0) || !(project_mem_gbs > 0) || !(bucket_mb > 0)) {
      return Usage(
          "cpd-allreduce-bench: --project needs --project-models NAME:PARAMS:STEP_MS,... "
          "(PARAMS >= 1, STEP_MS >= 0), --project-gbits > 0, --project-ranks >= 2, "
          "--project-alpha-us >= 0, --project-mem-gbs > 0, --bucket-mb > 0\n");
    }
    PrintProjection(models, gbits, ranks, project_alpha_us, project_mem_gbs, bucket_mb);
    return 0;
  }

  const size_t min_b = ParseSize(minbytes), max_b = ParseSize(maxbytes);
  if (min_b < 4 || max_b < min_b) {
    return Usage(
        "cpd-allreduce-bench: bad -b/-e '%s'/'%s' (need 4 <= min <= max, e.g. "
        "-b 8 -e 64M)\n",
        minbytes.c_str(), maxbytes.c_str());
  }
  if (max_b > MaxBenchBytes()) {
    return Usage(
        "cpd-allreduce-bench: -e %s is not accepted: at most %s (4 GiB, or an eighth of "
        "this machine's memory: each rank holds several buffers of this size)\n",
        maxbytes.c_str(), FormatSize(MaxBenchBytes()).c_str());
  }
  if (!(bucket_mb > 0) || !(bucket_mb <= cpd::comm::kMaxBucketMb)) {
    return Usage(
        "cpd-allreduce-bench: --bucket-mb %g is not accepted: a number of MiB > 0 and "
        "<= %g\n",
        bucket_mb, cpd::comm::kMaxBucketMb);
  }
  if (app.count("--pipeline-kb") > 0 &&
      (pipeline_kb < 0 || pipeline_kb > cpd::comm::kMaxPipelineKb)) {
    return Usage(
        "cpd-allreduce-bench: --pipeline-kb %d is not accepted: 0 (sequential) or "
        "1..%d KiB of codes per round\n",
        pipeline_kb, cpd::comm::kMaxPipelineKb);
  }
  if (!(stepfactor > 1.0)) {
    return Usage("cpd-allreduce-bench: -f must be > 1, got %g\n", stepfactor);
  }
  if (aps != "on" && aps != "off") {
    return Usage("cpd-allreduce-bench: --aps must be on or off, got '%s'\n", aps.c_str());
  }
  if (pipeline_kb < 0) pipeline_kb = GradientAllReduceOptions{}.pipeline_kb;
  if (iters < 1 || warmup < 0 || threads < 0 || !(scale > 0.0) || !std::isfinite(scale)) {
    return Usage(
        "cpd-allreduce-bench: need --iters >= 1, --warmup >= 0, --threads >= 0, "
        "--scale > 0\n");
  }
  if (device != "cpu" && device != "cuda") {
    return Usage("cpd-allreduce-bench: --device must be cpu or cuda, got '%s'\n", device.c_str());
  }
  if (comm_kind != "mpi" && comm_kind != "nccl") {
    return Usage("cpd-allreduce-bench: --comm must be mpi or nccl, got '%s'\n", comm_kind.c_str());
  }
  if (comm_kind == "nccl" && device != "cuda") {
    return Usage("cpd-allreduce-bench: --comm nccl needs --device cuda\n");
  }
  const bool on_gpu = device == "cuda";
  if (model && on_gpu) {
    return Usage(
        "cpd-allreduce-bench: --model predicts host gradients only (not "
        "--device cuda)\n");
  }
  std::vector<AllReduceAlgo> algos;
  for (const std::string& a : cpd::bench::SplitList(algos_list)) {
    auto parsed = cpd::comm::ParseAllReduceAlgo(a);
    if (!parsed.ok()) {
      return Usage("cpd-allreduce-bench: --algos: %s\n", parsed.status().ToString().c_str());
    }
    algos.push_back(parsed.value());
  }
  const std::vector<std::string> formats = cpd::bench::SplitList(formats_list);
  for (const std::string& f : formats) {
    auto parsed = cpd::Format::Parse(f);
    if (!parsed.ok()) {
      return Usage("cpd-allreduce-bench: --formats: %s\n", parsed.status().ToString().c_str());
    }
  }

  auto created = cpd::comm::MpiCommunicator::Create();
  if (!created.ok()) {
    std::fprintf(stderr, "cpd-allreduce-bench: %s\n", created.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<cpd::comm::MpiCommunicator> comm = std::move(created).value();
  const int rank = comm->rank(), np = comm->size();
  const MPI_Comm mc = comm->mpi_comm();
  const NodeRanks node = LocalRanks();
  const int local = node.size;
  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  if (threads == 0) threads = std::max(1, cores / local);

  // --device cuda: this rank's GPU, and the communicator the reducer and the baseline use.
  cpd::comm::Communicator* reduce_comm = comm.get();
  std::string gpu_name;
  if (on_gpu) {
    int gpu_ok = 1;
#if CPD_WITH_CUDA
    int gpus = 0;
    if (!cpd::CudaDeviceAvailable() || cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 1) {
      gpu_ok = 0;
    }
#else
    gpu_ok = 0;
#endif
    MPI_Allreduce(MPI_IN_PLACE, &gpu_ok, 1, MPI_INT, MPI_MIN, mc);
    if (!gpu_ok) {
      if (rank == 0) {
        std::printf("SKIP: --device cuda: %s\n",
                    CPD_WITH_CUDA ? "no CUDA device on some rank" : "this build has no CUDA");
      }
      return 0;
    }
#if CPD_WITH_CUDA
    if (cudaSetDevice(node.rank % gpus) != cudaSuccess) Fail("cudaSetDevice failed");
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, node.rank % gpus) == cudaSuccess) gpu_name = prop.name;
#endif
  }
#if CPD_WITH_NCCL
  std::unique_ptr<cpd::comm::NcclCommunicator> nccl;
  if (comm_kind == "nccl") {
    auto made = cpd::comm::NcclCommunicator::Create(comm.get(), -1);
    Check(made.status(), "NcclCommunicator::Create");
    nccl = std::move(made).value();
    reduce_comm = nccl.get();
  }
#else
  if (comm_kind == "nccl") {
    if (rank == 0) std::printf("SKIP: --comm nccl: this build has no NCCL\n");
    return 0;
  }
#endif
  const char* baseline = !on_gpu ? "mpi" : comm_kind == "nccl" ? "nccl" : "staged";

  if (rank == 0) {
    cpd::bench::WarnIfUnoptimised();
    std::string load = "?";
    std::ifstream la("/proc/loadavg");
    std::getline(la, load);
    std::printf(
        "# cpd-allreduce-bench: %d ranks (%d on this node, %d cores), %d quantisation "
        "thread(s) per rank, APS %s, bucket %g MiB, pipeline %d KiB, median of %d after %d "
        "warm-up\n",
        np, local, cores, threads, aps.c_str(), bucket_mb, pipeline_kb, iters, warmup);
    if (on_gpu) {
      std::printf(
          "# gradients on the GPU (%s), transport %s; baseline '%s' (float32), x_base = "
          "time / its time\n",
          gpu_name.c_str(),
          comm_kind == "nccl" ? "NCCL" : "MPI, packed bytes through pinned memory", baseline);
    }
    std::printf("# load average at start: %s\n", load.c_str());
  }
  // --model: the machine's parameters, measured before the rows. Two links: the ping-pong's
  // (alpha, beta), and the same alpha with the bandwidth of every rank exchanging at once.
  cpd::comm::perf::Link link_pp, link_loaded;
  const cpd::comm::perf::Host host{local, cores, threads};
  std::vector<cpd::comm::perf::CodecCost> codec;
  if (model) {
    if (np < 2) Fail("--model needs at least 2 ranks (ping-pong)");
    link_pp = MeasureLink(mc, rank);
    link_loaded = {link_pp.alpha_s, MeasureLoadedBandwidth(mc, rank, np)};
    for (const std::string& f : formats.empty() ? std::vector<std::string>{"e4m3"} : formats) {
      codec.push_back(MeasureCodec(mc, rank, f));
    }
    if (rank == 0) {
      std::printf(
          "# model: alpha %.1f us, beta %.1f MB/s (ping-pong 0-1), loaded beta %.1f MB/s "
          "(all ranks at once); %d rank(s) on %d core(s), %d thread(s): parallelism "
          "%.2f, overlap %s\n",
          link_pp.alpha_s * 1e6, link_pp.beta_bytes_per_s / 1e6, link_loaded.beta_bytes_per_s / 1e6,
          host.ranks, host.cores, host.threads, host.Parallelism(), host.Overlaps() ? "yes" : "no");
      for (std::size_t i = 0; i < formats.size(); ++i) {
        std::printf(
            "# model %s, ns/element on one thread: scan %.3f encode %.3f decode+add "
            "%.3f decode %.3f; float32 add %.3f\n",
            formats[i].c_str(), codec[i].scan * 1e9, codec[i].encode * 1e9,
            codec[i].decode_add * 1e9, codec[i].decode * 1e9, codec[i].add * 1e9);
      }
    }
  }
  if (rank == 0) {
    std::printf("%10s %10s %7s %8s %11s %8s %8s %10s %7s %9s %7s", "size", "count", "format",
                "algo", "time(us)", "algbw", "busbw", "fp32-busbw", on_gpu ? "x_base" : "x_mpi",
                "relerr", "#wrong");
    std::printf(model ? " %11s %7s %11s %7s\n" : "\n", "pp(us)", "err", "loaded(us)", "err");
    std::printf("%10s %10s %7s %8s %11s %8s %8s %10s %7s %9s %7s", "(B)", "(elems)", "", "", "",
                "(GB/s)", "(GB/s)", "(GB/s)", "", "", "");
    std::printf(model ? " %11s %7s %11s %7s\n" : "\n", "(model)", "(%)", "(model)", "(%)");
  }

  for (double size_d = double(min_b); size_d <= double(max_b) * 1.0000001; size_d *= stepfactor) {
    const size_t count = std::max<size_t>(1, size_t(size_d) / sizeof(float));
    const size_t bytes = count * sizeof(float);
    // N(0, 1) inputs, different on every rank; a float64 reference sum of them.
    std::vector<float> x(count), out(count);
    std::mt19937_64 rng(1234567u + uint64_t(rank));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& v : x) v = normal(rng) * float(scale);
    std::vector<double> ref(x.begin(), x.end());
    MPI_Allreduce(MPI_IN_PLACE, ref.data(), int(count), MPI_DOUBLE, MPI_SUM, mc);
    double ref2 = 0.0;
    for (double v : ref) ref2 += v * v;
    auto relerr = [&](const std::vector<float>& o) {
      double e2 = 0.0;
      for (size_t i = 0; i < count; ++i) e2 += (double(o[i]) - ref[i]) * (double(o[i]) - ref[i]);
      return ref2 > 0.0 ? std::sqrt(e2 / ref2) : 0.0;
    };
    // Small integers: every fp32 sum is exact.
    std::vector<float> xi(count);
    auto int_value = [](size_t i, int r) { return float(int((i * 7 + size_t(r) * 3) % 17) - 8); };
    for (size_t i = 0; i < count; ++i) xi[i] = int_value(i, rank);
    auto count_wrong = [&](const std::vector<float>& o) {
      size_t wrong = 0;
      for (size_t i = 0; i < count; ++i) {
        float e = 0.0f;
        for (int r = 0; r < np; ++r) e += int_value(i, r);
        wrong += o[i] != e;
      }
      unsigned long long w = wrong, total = 0;
      MPI_Allreduce(&w, &total, 1, MPI_UNSIGNED_LONG_LONG, MPI_SUM, mc);
      return total;
    };
    const double ring = 2.0 * (np - 1) / np * double(bytes);

    // predicted: the model's times (s) with the ping-pong and the loaded link, < 0 for none.
    using Predicted = std::pair<double, double>;
    auto print = [&](const char* format, const char* algo, double t, double sent, double err,
                     long long wrong, double t_mpi, Predicted predicted) {
      if (rank != 0) return;
      char wrong_s[24];
      if (wrong < 0) {
        std::snprintf(wrong_s, sizeof wrong_s, "-");
      } else {
        std::snprintf(wrong_s, sizeof wrong_s, "%lld", wrong);
      }
      std::printf("%10s %10zu %7s %8s %11.1f %8.2f %8.2f %10.2f %7.3f %9.2e %7s",
                  FormatSize(bytes).c_str(), count, format, algo, t * 1e6, bytes / t / 1e9,
                  sent / t / 1e9, ring / t / 1e9, t / t_mpi, err, wrong_s);
      if (!model) {
        std::printf("\n");
      } else if (predicted.first < 0.0) {
        std::printf(" %11s %7s %11s %7s\n", "-", "-", "-", "-");
      } else {
        std::printf(" %11.1f %+7.1f %11.1f %+7.1f\n", predicted.first * 1e6,
                    (predicted.first - t) / t * 100.0, predicted.second * 1e6,
                    (predicted.second - t) / t * 100.0);
      }
      std::fflush(stdout);
    };

    GradientMemory mem(on_gpu);
    mem.Resize(count);
    mem.Upload(mem.x(), x);
    // The baseline's float32 all-reduce of `src` into mem.out(): MPI_Allreduce on host buffers;
    // on the GPU ncclAllReduce (in place, so src is copied first) or staged through the host.
    std::vector<float> staged(on_gpu ? count : 0);
    auto baseline_allreduce = [&](float* src) {
      if (!on_gpu) {
        MPI_Allreduce(src, mem.out(), int(count), MPI_FLOAT, MPI_SUM, mc);
      } else if (reduce_comm != comm.get()) {
        mem.RestoreInput();  // ncclAllReduce works in place on mem.in()
        Check(reduce_comm->AllReduce(mem.in(), count, cpd::comm::ReduceOp::kSum), "AllReduce");
      } else {
        mem.Download(&staged, src);
        MPI_Allreduce(MPI_IN_PLACE, staged.data(), int(count), MPI_FLOAT, MPI_SUM, mc);
        mem.Upload(mem.out(), staged);
      }
      mem.Wait();
    };
    const bool in_place_baseline = on_gpu && reduce_comm != comm.get();
    const double t_mpi = TimeIt(mc, warmup, iters, [&](bool) {
      if (in_place_baseline) mem.RestoreInput();
      mem.Wait();
      MPI_Barrier(mc);
      const double t0 = MPI_Wtime();
      if (in_place_baseline) {
        Check(reduce_comm->AllReduce(mem.in(), count, cpd::comm::ReduceOp::kSum), "AllReduce");
        mem.Wait();
      } else {
        baseline_allreduce(mem.x());
      }
      return MPI_Wtime() - t0;
    });
    auto baseline_result = [&]() -> const float* {
      return in_place_baseline ? mem.in() : mem.out();
    };
    mem.Download(&out, baseline_result());
    const double err_mpi = relerr(out);
    mem.Upload(mem.x(), xi);
    baseline_allreduce(mem.x());
    mem.Download(&out, baseline_result());
    mem.Upload(mem.x(), x);
    Predicted predicted_mpi{-1.0, -1.0};
    if (model) {
      const cpd::comm::perf::Case c{np, count, 32, false, false, 0};
      predicted_mpi = {cpd::comm::perf::PredictFp32Ring(c, link_pp, codec.front(), host).total,
                       cpd::comm::perf::PredictFp32Ring(c, link_loaded, codec.front(), host).total};
    }
    print("fp32", baseline, t_mpi, ring, err_mpi, (long long)count_wrong(out), t_mpi,
          predicted_mpi);

    GradientLayout layout;
    layout.layer_names = {"grad"};
    layout.offsets = {0, count};
    for (AllReduceAlgo algo : algos) {
      const std::vector<std::string> fmts =
          algo == AllReduceAlgo::kFp32 ? std::vector<std::string>{"fp32"} : formats;
      for (std::size_t fi = 0; fi < fmts.size(); ++fi) {
        const std::string& f = fmts[fi];
        GradientAllReduceOptions opts;
        opts.algo = algo;
        opts.format = algo == AllReduceAlgo::kFp32 ? "e4m3" : f;
        opts.aps = aps == "on";
        opts.bucket_mb = bucket_mb;
        opts.threads = threads;
        opts.pipeline_kb = pipeline_kb;
        if (on_gpu) opts.gradients = cpd::comm::MemorySpace::kDevice;
        auto red = GradientAllReducer::Create(reduce_comm, opts, layout, 1);
        Check(red.status(), "GradientAllReducer::Create");
        GradientAllReducer& r = *red.value();
        float* ptrs[1] = {mem.in()};
        // The inputs may serve as scratch: restore them (untimed) before every run.
        const double t = TimeIt(mc, warmup, iters, [&](bool) {
          mem.RestoreInput();
          mem.Wait();
          MPI_Barrier(mc);
          const double t0 = MPI_Wtime();
          Check(r.Reduce(ptrs, mem.out(), 0), "Reduce");
          mem.Wait();
          return MPI_Wtime() - t0;
        });
        const double sent = double(r.last_bytes_sent());
        mem.Download(&out, mem.out());
        const double err = relerr(out);
        long long wrong = -1;
        if (algo == AllReduceAlgo::kFp32) {
          mem.Upload(mem.in(), xi);
          Check(r.Reduce(ptrs, mem.out(), 0), "Reduce");
          mem.Download(&out, mem.out());
          wrong = (long long)count_wrong(out);
        }
        Predicted predicted{-1.0, -1.0};
        if (model && algo == AllReduceAlgo::kPacked) {
          predicted = {0.0, 0.0};
          const int bits = cpd::Format::Parse(f)->bits();
          for (const cpd::comm::GradientBucket& bucket : r.buckets()) {
            const std::size_t n = bucket.end - bucket.begin;
            const cpd::comm::perf::Case c{
                np,
                n,
                bits,
                opts.aps,
                cpd::comm::UsesApsSumScaling(opts),
                cpd::comm::perf::PipelineRounds(n, np, bits, opts.pipeline_kb)};
            predicted.first += cpd::comm::perf::PredictPacked(c, link_pp, codec[fi], host).total;
            predicted.second +=
                cpd::comm::perf::PredictPacked(c, link_loaded, codec[fi], host).total;
          }
        }
        print(algo == AllReduceAlgo::kFp32 ? "fp32" : f.c_str(), cpd::comm::AllReduceAlgoName(algo),
              t, sent, err, wrong, t_mpi, predicted);
      }
    }
  }
  return 0;
}
