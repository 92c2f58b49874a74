// The gradient all-reduce on device memory (GradientAllReduceOptions::gradients = kDevice: the
// device back end, comm/allreduce/device_backend.cc) against the host reducer on the same inputs,
// bit for bit: the sum, the non-finite flag, every layer's shift, max|g|, flushed and saturated
// fractions, and the bytes sent, and with measure_error the relative error. fp32, packed and
// emulate (plain and Kahan); e4m3, e5m2, e3m0, e2m1, fp16, bf16 (fused kernels) and int8, int4,
// uint4:minmax, mxfp8, mxfp4, bfp8:16, fp134, log4 (per segment); nearest, stochastic and
// toward-zero rounding; APS on and off; K = 1 and 3 local replicas; layers of 0, 1, odd and large
// sizes cut by small buckets; pipelined schedules and hybrid (per-layer) formats; NaN/Inf on one
// rank. Transports: the world communicator under mpirun (MPI, staged through pinned memory; world
// size 1 also through SelfCommunicator, where the collectives are device copies), a mirrored
// world of 2 and 3 ranks in one process (staged: what a GPU machine without MPI can run) and
// NcclCommunicator where every rank has its own GPU. Every test that needs a GPU skips without
// one (on every rank alike: they share the machine).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/gradient_allreduce.h"
#include "cpd/config.h"
#include "cpd/quantize.h"
#include "cpd/quantize_cuda.h"
#include "tests/comm/mirror_communicator.h"
#include "tests/mpi_test_main.h"
#if CPD_WITH_NCCL
#include "comm/nccl_communicator.h"
#endif

namespace cpd::comm {
namespace {

#define SKIP_WITHOUT_GPU() \
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device: the device all-reduce needs a GPU"

std::uint32_t Bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

GradientLayout MakeLayout(const std::vector<std::size_t>& sizes) {
  GradientLayout layout;
  layout.offsets.push_back(0);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    layout.layer_names.push_back("layer" + std::to_string(i));
    layout.offsets.push_back(layout.offsets.back() + sizes[i]);
  }
  return layout;
}

// Worker w's gradient: per layer a magnitude 2^(3l - 6), times 2^(2 (w % 4)) so that float32 sums
// round and their order shows, times N(0, 1); every 97th element an exact zero, and a few tiny
// and huge ones so that flushing and saturation have something to count.
std::vector<float> WorkerInput(const GradientLayout& layout, std::uint64_t seed, int worker) {
  std::vector<float> x(layout.total());
  std::mt19937_64 rng(seed * 1000003u + std::uint64_t(worker));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::size_t l = 0; l < layout.layers(); ++l) {
    const float scale = std::ldexp(1.0f, 3 * int(l) - 6 + 2 * (worker % 4));
    for (std::size_t i = layout.offsets[l]; i < layout.offsets[l + 1]; ++i) {
      float v = normal(rng) * scale;
      if (i % 97 == 5) v = 0.0f;
      if (i % 211 == 7) v *= 1e-12f;
      if (i % 307 == 11) v *= 1e12f;
      x[i] = v;
    }
  }
  return x;
}

// Device floats holding a copy of a host vector.
class DeviceFloats {
 public:
  explicit DeviceFloats(const std::vector<float>& v) : count_(v.size()) {
    EXPECT_EQ(cudaMalloc(&ptr_, (count_ > 0 ? count_ : 1) * sizeof(float)), cudaSuccess);
    if (count_ > 0) {
      EXPECT_EQ(cudaMemcpy(ptr_, v.data(), count_ * sizeof(float), cudaMemcpyHostToDevice),
                cudaSuccess);
    }
  }
  ~DeviceFloats() { cudaFree(ptr_); }
  DeviceFloats(const DeviceFloats&) = delete;
  DeviceFloats& operator=(const DeviceFloats&) = delete;

  float* data() { return static_cast<float*>(ptr_); }
  std::vector<float> Download() const {
    std::vector<float> v(count_);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (count_ > 0) {
      EXPECT_EQ(cudaMemcpy(v.data(), ptr_, count_ * sizeof(float), cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
    return v;
  }

 private:
  void* ptr_ = nullptr;
  std::size_t count_;
};

struct Case {
  AllReduceAlgo algo = AllReduceAlgo::kPacked;
  std::string format = "e4m3";
  Rounding rounding = Rounding::kNearest;
  bool aps = false;
  bool kahan = false;
  ApsScaling scaling = ApsScaling::kAuto;  // with aps: auto is sum for packed, paper for emulate
};

std::string Name(const Case& c, int k) {
  return std::string(AllReduceAlgoName(c.algo)) + "/" + c.format +
         (c.aps ? std::string("/aps-") + ApsScalingName(c.scaling) : "") +
         (c.kahan ? "/kahan" : "") + "/" + RoundingName(c.rounding) + "/K=" + std::to_string(k);
}

GradientAllReduceOptions Options(const Case& c, double bucket_mb, MemorySpace gradients,
                                 void* stream = nullptr) {
  GradientAllReduceOptions o;
  o.algo = c.algo;
  o.format = c.format;
  o.rounding = c.rounding;
  o.aps = c.aps;
  o.aps_scaling = c.scaling;
  o.kahan = c.kahan;
  o.bucket_mb = bucket_mb;
  o.seed = 0x5eed;
  o.gradients = gradients;
  o.cuda_stream = stream;
  return o;
}

// What a Reduce() left behind.
struct Outcome {
  bool ok = false;
  std::vector<float> out;
  bool nonfinite = false;
  std::vector<LayerCommStats> stats;
  std::uint64_t bytes = 0;
};

constexpr float kSentinel = -12345.5f;

// This rank's K local inputs (workers rank * K + k).
std::vector<std::vector<float>> LocalInputs(const GradientLayout& layout, std::uint64_t seed,
                                            int rank, int k) {
  std::vector<std::vector<float>> x;
  for (int j = 0; j < k; ++j) x.push_back(WorkerInput(layout, seed, rank * k + j));
  return x;
}

Outcome RunHost(Communicator* comm, const GradientAllReduceOptions& o, const GradientLayout& layout,
                std::vector<std::vector<float>> x, std::int64_t step, bool measure = false) {
  Outcome r;
  auto red = GradientAllReducer::Create(comm, o, layout, int(x.size()));
  EXPECT_TRUE(red.ok()) << red.status().ToString();
  if (!red.ok()) return r;
  std::vector<float*> ptrs;
  for (auto& v : x) ptrs.push_back(v.data());
  r.out.assign(layout.total(), kSentinel);
  const Status s = red.value()->Reduce(ptrs.data(), r.out.data(), step, measure);
  EXPECT_TRUE(s.ok()) << s.ToString();
  r.ok = s.ok();
  r.nonfinite = red.value()->last_nonfinite();
  r.stats = red.value()->last_stats();
  r.bytes = red.value()->last_bytes_sent();
  return r;
}

// The same through device memory; with `alias`, the output is inputs[0] (K = 1 only).
Outcome RunDevice(Communicator* comm, const GradientAllReduceOptions& o,
                  const GradientLayout& layout, const std::vector<std::vector<float>>& x,
                  std::int64_t step, bool alias = false, bool measure = false) {
  Outcome r;
  auto red = GradientAllReducer::Create(comm, o, layout, int(x.size()));
  EXPECT_TRUE(red.ok()) << red.status().ToString();
  if (!red.ok()) return r;
  std::vector<std::unique_ptr<DeviceFloats>> d;
  std::vector<float*> ptrs;
  for (const auto& v : x) {
    d.push_back(std::make_unique<DeviceFloats>(v));
    ptrs.push_back(d.back()->data());
  }
  DeviceFloats out(std::vector<float>(layout.total(), kSentinel));
  float* dst = alias ? ptrs[0] : out.data();
  const Status s = red.value()->Reduce(ptrs.data(), dst, step, measure);
  EXPECT_TRUE(s.ok()) << s.ToString();
  r.ok = s.ok();
  r.out = alias ? d[0]->Download() : out.Download();
  r.nonfinite = red.value()->last_nonfinite();
  r.stats = red.value()->last_stats();
  r.bytes = red.value()->last_bytes_sent();
  return r;
}

void ExpectSame(const Outcome& host, const Outcome& dev, const std::string& what) {
  ASSERT_TRUE(host.ok && dev.ok) << what;
  EXPECT_EQ(host.nonfinite, dev.nonfinite) << what;
  ASSERT_EQ(host.out.size(), dev.out.size()) << what;
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < host.out.size(); ++i) {
    if (Bits(host.out[i]) != Bits(dev.out[i])) {
      if (bad == 0) first = i;
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << host.out.size()
                     << " elements differ; first at [" << first << "]: host "
                     << (bad > 0 ? host.out[first] : 0.0f) << " device "
                     << (bad > 0 ? dev.out[first] : 0.0f);
  ASSERT_EQ(host.stats.size(), dev.stats.size()) << what;
  for (std::size_t l = 0; l < host.stats.size(); ++l) {
    EXPECT_EQ(host.stats[l].shift, dev.stats[l].shift) << what << " layer " << l;
    EXPECT_EQ(Bits(host.stats[l].max_abs), Bits(dev.stats[l].max_abs)) << what << " layer " << l;
    EXPECT_EQ(host.stats[l].flushed, dev.stats[l].flushed) << what << " layer " << l;
    EXPECT_EQ(host.stats[l].saturated, dev.stats[l].saturated) << what << " layer " << l;
    EXPECT_EQ(host.stats[l].rel_error, dev.stats[l].rel_error) << what << " layer " << l;
  }
  EXPECT_EQ(host.bytes, dev.bytes) << what;
}

// Layers of 1, odd, aligned and larger-than-a-bucket sizes, and an empty one; bucket_mb 0.01
// (2621 floats) splits the large layers and fuses the small ones.
const std::vector<std::size_t> kSizes = {1, 7, 130, 0, 3001, 64, 20011, 5};
constexpr double kSmallBuckets = 0.01;

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  cases.push_back({AllReduceAlgo::kFp32, "fp32", Rounding::kNearest, false, false});
  for (AllReduceAlgo algo : {AllReduceAlgo::kPacked, AllReduceAlgo::kEmulate}) {
    for (const char* f : {"e4m3", "e5m2", "e3m0", "e2m1", "fp16", "bf16"}) {
      for (Rounding r : {Rounding::kNearest, Rounding::kStochastic}) {
        for (bool aps : {false, true}) cases.push_back({algo, f, r, aps, false});
        // packed with APS above is the sum scaling (auto); the paper's as well.
        if (algo == AllReduceAlgo::kPacked) {
          cases.push_back({algo, f, r, true, false, ApsScaling::kPaper});
        }
      }
    }
  }
  for (const char* f : {"e4m3", "e5m2"}) {
    for (Rounding r : {Rounding::kNearest, Rounding::kStochastic}) {
      cases.push_back({AllReduceAlgo::kEmulate, f, r, true, true});
    }
  }
  cases.push_back({AllReduceAlgo::kPacked, "e4m3", Rounding::kZero, true, false});
  cases.push_back(
      {AllReduceAlgo::kPacked, "e3m0", Rounding::kZero, true, false, ApsScaling::kPaper});
  cases.push_back({AllReduceAlgo::kEmulate, "e5m2", Rounding::kZero, false, true});
  // Formats that travel as cpd::Encode'd segments (packed) or quantised float32 (emulate).
  for (AllReduceAlgo algo : {AllReduceAlgo::kPacked, AllReduceAlgo::kEmulate}) {
    for (const char* f : {"int8", "uint4:minmax", "mxfp8", "mxfp4", "bfp8:16", "fp134", "log4"}) {
      for (Rounding r : {Rounding::kNearest, Rounding::kStochastic}) {
        cases.push_back({algo, f, r, true, false});
        if (algo == AllReduceAlgo::kPacked) {
          cases.push_back({algo, f, r, true, false, ApsScaling::kPaper});
        }
      }
    }
  }
  cases.push_back({AllReduceAlgo::kEmulate, "int8", Rounding::kStochastic, true, true});
  cases.push_back({AllReduceAlgo::kPacked, "int4", Rounding::kNearest, false, false});
  return cases;
}

// Every case, K = 1 and 3, through `comm` for both reducers: host gradients and device
// gradients (staged when comm is a host communicator).
void ExpectDeviceMatchesHost(Communicator* host_comm, Communicator* device_comm, void* stream,
                             bool fp32_too) {
  const GradientLayout layout = MakeLayout(kSizes);
  for (const Case& c : AllCases()) {
    if (c.algo == AllReduceAlgo::kFp32 && !fp32_too) continue;
    for (int k : {1, 3}) {
      const auto x = LocalInputs(layout, 11, host_comm->rank(), k);
      const Outcome host =
          RunHost(host_comm, Options(c, kSmallBuckets, MemorySpace::kHost), layout, x, 3);
      const Outcome dev = RunDevice(
          device_comm, Options(c, kSmallBuckets, MemorySpace::kDevice, stream), layout, x, 3);
      ExpectSame(host, dev, Name(c, k));
    }
  }
}

TEST(GradientAllReduceCudaTest, StagedMpiMatchesHostReducerBitForBit) {
  SKIP_WITHOUT_GPU();
  ExpectDeviceMatchesHost(test::World(), test::World(), nullptr, /*fp32_too=*/true);
}

TEST(GradientAllReduceCudaTest, OnAStreamOfItsOwnWithTheOutputAliasingTheInput) {
  SKIP_WITHOUT_GPU();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const GradientLayout layout = MakeLayout(kSizes);
  for (const Case& c : {Case{AllReduceAlgo::kFp32, "fp32", Rounding::kNearest, false, false},
                        Case{AllReduceAlgo::kPacked, "e4m3", Rounding::kStochastic, true, false},
                        Case{AllReduceAlgo::kEmulate, "e3m0", Rounding::kNearest, true, true}}) {
    const auto x = LocalInputs(layout, 12, test::World()->rank(), 1);
    const Outcome host =
        RunHost(test::World(), Options(c, kSmallBuckets, MemorySpace::kHost), layout, x, 9);
    const Outcome dev =
        RunDevice(test::World(), Options(c, kSmallBuckets, MemorySpace::kDevice, stream), layout, x,
                  9, /*alias=*/true);
    ExpectSame(host, dev, Name(c, 1) + " on a stream, output = inputs[0]");
  }
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

TEST(GradientAllReduceCudaTest, StagedTransportOverAMirroredWorldMatchesHostReducer) {
  SKIP_WITHOUT_GPU();
  const GradientLayout layout = MakeLayout(kSizes);
  for (int size : {2, 3}) {
    test::MirrorCommunicator mirror(size);
    for (const Case& c : {Case{AllReduceAlgo::kFp32, "fp32", Rounding::kNearest, false, false},
                          Case{AllReduceAlgo::kPacked, "e4m3", Rounding::kStochastic, true, false},
                          Case{AllReduceAlgo::kPacked, "e2m1", Rounding::kNearest, true, false},
                          Case{AllReduceAlgo::kPacked, "e4m3", Rounding::kStochastic, true, false,
                               ApsScaling::kPaper},
                          Case{AllReduceAlgo::kEmulate, "e5m2", Rounding::kNearest, false, true},
                          Case{AllReduceAlgo::kEmulate, "bf16", Rounding::kStochastic, true, false},
                          Case{AllReduceAlgo::kPacked, "mxfp8", Rounding::kStochastic, true, false},
                          Case{AllReduceAlgo::kEmulate, "int8", Rounding::kNearest, true, true}}) {
      for (int k : {1, 3}) {
        const auto x = LocalInputs(layout, 16, 0, k);
        for (bool measure : {false, true}) {
          const Outcome host = RunHost(&mirror, Options(c, kSmallBuckets, MemorySpace::kHost),
                                       layout, x, 8, measure);
          const Outcome dev = RunDevice(&mirror, Options(c, kSmallBuckets, MemorySpace::kDevice),
                                        layout, x, 8, /*alias=*/false, measure);
          ExpectSame(host, dev,
                     Name(c, k) + " mirrored world of " + std::to_string(size) +
                         (measure ? " with measure_error" : ""));
        }
      }
    }
  }
}

// One algorithm per file runs on both back ends, so the device path has what the host path has:
// the pipelined schedule (rounds of 1 KiB of codes, several per chunk here; staged through pinned
// mirrors over MPI, sequential where the communicator has no nonblocking exchange) and per-layer
// formats (hybrid precision: an fp32 layer, a scaled format and another float grid among e4m3
// ones), bit for bit the host reducer's, bytes sent included.
TEST(GradientAllReduceCudaTest, PipelinedAndHybridPlansMatchHostReducer) {
  SKIP_WITHOUT_GPU();
  const GradientLayout layout = MakeLayout({1, 7, 130, 0, 9001, 64, 20011, 5});
  struct Plan {
    Case c;
    int pipeline_kb;
    std::map<std::string, std::string> layer_formats;
  };
  const std::map<std::string, std::string> hybrid = {
      {"layer2", "fp32"}, {"layer4", "int8"}, {"layer6", "e5m2"}};
  const std::vector<Plan> plans = {
      {Case{AllReduceAlgo::kPacked, "e4m3", Rounding::kStochastic, true, false}, 1, {}},
      {Case{AllReduceAlgo::kPacked, "e2m1", Rounding::kNearest, true, false, ApsScaling::kPaper},
       1,
       {}},
      {Case{AllReduceAlgo::kPacked, "e3m0", Rounding::kNearest, false, false}, 1, {}},
      {Case{AllReduceAlgo::kEmulate, "e5m2", Rounding::kStochastic, true, true}, 1, {}},
      {Case{AllReduceAlgo::kEmulate, "bf16", Rounding::kNearest, false, false}, 2, {}},
      {Case{AllReduceAlgo::kPacked, "e4m3", Rounding::kStochastic, true, false}, 0, hybrid},
      {Case{AllReduceAlgo::kPacked, "e4m3", Rounding::kNearest, true, false, ApsScaling::kPaper}, 0,
       hybrid},
      {Case{AllReduceAlgo::kEmulate, "e4m3", Rounding::kStochastic, true, false}, 0, hybrid},
      {Case{AllReduceAlgo::kEmulate, "e4m3", Rounding::kNearest, false, true}, 0, hybrid}};
  for (const Plan& plan : plans) {
    for (int k : {1, 2}) {
      GradientAllReduceOptions host_o = Options(plan.c, 0.05, MemorySpace::kHost);
      host_o.pipeline_kb = plan.pipeline_kb;
      host_o.layer_formats = plan.layer_formats;
      GradientAllReduceOptions dev_o = host_o;
      dev_o.gradients = MemorySpace::kDevice;
      const auto x = LocalInputs(layout, 17, test::World()->rank(), k);
      for (bool measure : {false, true}) {
        const Outcome host = RunHost(test::World(), host_o, layout, x, 5, measure);
        const Outcome dev = RunDevice(test::World(), dev_o, layout, x, 5, false, measure);
        ExpectSame(host, dev,
                   Name(plan.c, k) + " pipeline_kb " + std::to_string(plan.pipeline_kb) +
                       (plan.layer_formats.empty() ? "" : " hybrid") +
                       (measure ? " with measure_error" : ""));
      }
    }
  }
}

TEST(GradientAllReduceCudaTest, SelfCommunicatorMatchesHostReducer) {
  SKIP_WITHOUT_GPU();
  SelfCommunicator self;
  ExpectDeviceMatchesHost(&self, &self, nullptr, /*fp32_too=*/true);
}

TEST(GradientAllReduceCudaTest, LargeAndTinyCounts) {
  SKIP_WITHOUT_GPU();
  // A layer of 2^20 + 3 elements in default buckets; a layout of one element; one of empty
  // layers only (the per-step collectives still run on every rank).
  for (const auto& sizes :
       std::vector<std::vector<std::size_t>>{{(std::size_t(1) << 20) + 3, 5}, {1}, {0, 0}}) {
    const GradientLayout layout = MakeLayout(sizes);
    for (const Case& c :
         {Case{AllReduceAlgo::kFp32, "fp32", Rounding::kNearest, false, false},
          Case{AllReduceAlgo::kPacked, "e4m3", Rounding::kStochastic, true, false},
          Case{AllReduceAlgo::kPacked, "e2m1", Rounding::kNearest, true, false},
          Case{AllReduceAlgo::kEmulate, "e5m2", Rounding::kStochastic, true, true},
          Case{AllReduceAlgo::kEmulate, "bf16", Rounding::kNearest, false, false}}) {
      for (int k : {1, 3}) {
        const auto x = LocalInputs(layout, 13, test::World()->rank(), k);
        const Outcome host =
            RunHost(test::World(), Options(c, 25, MemorySpace::kHost), layout, x, 4);
        const Outcome dev =
            RunDevice(test::World(), Options(c, 25, MemorySpace::kDevice), layout, x, 4);
        ExpectSame(host, dev, Name(c, k) + " layers of " + std::to_string(sizes[0]) + "...");
      }
    }
  }
}

TEST(GradientAllReduceCudaTest, NonFiniteOnOneRankSkipsTheStepEverywhere) {
  SKIP_WITHOUT_GPU();
  const GradientLayout layout = MakeLayout(kSizes);
  const int last = test::World()->size() - 1;
  for (float bad :
       {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
    for (const Case& c :
         {Case{AllReduceAlgo::kFp32, "fp32", Rounding::kNearest, false, false},
          Case{AllReduceAlgo::kPacked, "e4m3", Rounding::kNearest, true, false},
          Case{AllReduceAlgo::kEmulate, "e5m2", Rounding::kStochastic, false, true}}) {
      auto x = LocalInputs(layout, 14, test::World()->rank(), 3);
      if (test::World()->rank() == last) x[2][layout.offsets[4] + 17] = bad;
      const Outcome host =
          RunHost(test::World(), Options(c, kSmallBuckets, MemorySpace::kHost), layout, x, 2);
      const Outcome dev =
          RunDevice(test::World(), Options(c, kSmallBuckets, MemorySpace::kDevice), layout, x, 2);
      EXPECT_TRUE(dev.nonfinite) << Name(c, 3);
      // The output was not written: still the sentinel everywhere.
      std::size_t touched = 0;
      for (float v : dev.out) touched += Bits(v) != Bits(kSentinel);
      EXPECT_EQ(touched, 0u) << Name(c, 3);
      ExpectSame(host, dev, Name(c, 3) + " with a non-finite input");
    }
  }
}

TEST(GradientAllReduceCudaTest, RefusesHostPointers) {
  SKIP_WITHOUT_GPU();
  const GradientLayout layout = MakeLayout({10, 20});
  auto red = GradientAllReducer::Create(test::World(), Options(Case{}, 25, MemorySpace::kDevice),
                                        layout, 1);
  ASSERT_TRUE(red.ok()) << red.status().ToString();
  std::vector<float> host(layout.total(), 1.0f);
  float* ptrs[1] = {host.data()};
  const Status s = red.value()->Reduce(ptrs, host.data(), 0);
  EXPECT_EQ(s.code(), Status::Code::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("not device memory"), std::string::npos) << s.ToString();
}

// measure_error: the float32 reference reduce-scattered through the same transport and the
// errors summed as the host path sums them, so rel_error has the host path's bits too.
TEST(GradientAllReduceCudaTest, MeasuredErrorMatchesHostReducer) {
  SKIP_WITHOUT_GPU();
  const GradientLayout layout = MakeLayout(kSizes);
  for (const Case& c : {Case{AllReduceAlgo::kFp32, "fp32", Rounding::kNearest, false, false},
                        Case{AllReduceAlgo::kPacked, "e4m3", Rounding::kStochastic, true, false},
                        Case{AllReduceAlgo::kEmulate, "e3m0", Rounding::kNearest, true, true}}) {
    for (int k : {1, 3}) {
      const auto x = LocalInputs(layout, 15, test::World()->rank(), k);
      const Outcome host = RunHost(test::World(), Options(c, kSmallBuckets, MemorySpace::kHost),
                                   layout, x, 6, /*measure=*/true);
      const Outcome dev =
          RunDevice(test::World(), Options(c, kSmallBuckets, MemorySpace::kDevice), layout, x, 6,
                    /*alias=*/false, /*measure=*/true);
      for (const LayerCommStats& st : dev.stats) EXPECT_GE(st.rel_error, 0.0) << Name(c, k);
      ExpectSame(host, dev, Name(c, k) + " with measure_error");
    }
  }
}

#if CPD_WITH_NCCL
// NCCL needs a GPU per rank: skipped (on every rank) where the machine has fewer GPUs than ranks.
TEST(GradientAllReduceCudaTest, NcclMatchesHostReducer) {
  SKIP_WITHOUT_GPU();
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  if (devices < test::World()->size()) {
    GTEST_SKIP() << "NCCL needs a GPU per rank: " << devices << " GPU(s) for "
                 << test::World()->size() << " ranks";
  }
  auto nccl = NcclCommunicator::Create(test::World());
  ASSERT_TRUE(nccl.ok()) << nccl.status().ToString();
  // fp32 sums in NCCL's order, which equals MPI's only at world size 1.
  ExpectDeviceMatchesHost(test::World(), nccl.value().get(), nullptr,
                          /*fp32_too=*/test::World()->size() == 1);
}
#endif

}  // namespace
}  // namespace cpd::comm
