// The process-wide CUDA context of the runtime (stream, cuBLAS and cuDNN handles, scratch) and
// the library-backed operations: GEMMs through cuBLAS, convolutions through cuDNN.
//
// cuDNN 9 keeps the legacy convolution API (cudnnConvolutionForward and friends, in
// libcudnn_cnn) next to the graph API; the legacy calls are used here because they take plain
// descriptors and deterministic, per-shape algorithm choices are easy to pin down with them.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <array>
#include <initializer_list>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cuda/accumulate.h"
#include "runtime/engine/conv_algos.h"
#include "runtime/engine/cuda_internal.h"
#include "runtime/engine/cuda_ops.h"

namespace cpd::runtime::cuda {

namespace internal {

[[noreturn]] void ThrowError(const char* file, int line, const char* expr, const char* text,
                             int code) {
  throw std::runtime_error(std::string("CUDA error at ") + file + ":" + std::to_string(line) +
                           ": " + expr + ": " + (text != nullptr ? text : "?") + " (" +
                           std::to_string(code) + ")");
}

}  // namespace internal

namespace {

using internal::Scratch;

#define CPD_CUBLAS_CHECK(expr)                                                                \
  do {                                                                                        \
    const cublasStatus_t cpd_blas_st_ = (expr);                                               \
    if (cpd_blas_st_ != CUBLAS_STATUS_SUCCESS) {                                              \
      ::cpd::runtime::cuda::internal::ThrowError(                                             \
          __FILE__, __LINE__, #expr, cublasGetStatusString(cpd_blas_st_), int(cpd_blas_st_)); \
    }                                                                                         \
  } while (0)

#define CPD_CUDNN_CHECK(expr)                                                             \
  do {                                                                                    \
    const cudnnStatus_t cpd_dnn_st_ = (expr);                                             \
    if (cpd_dnn_st_ != CUDNN_STATUS_SUCCESS) {                                            \
      ::cpd::runtime::cuda::internal::ThrowError(                                         \
          __FILE__, __LINE__, #expr, cudnnGetErrorString(cpd_dnn_st_), int(cpd_dnn_st_)); \
    }                                                                                     \
  } while (0)

// The largest cuDNN workspace an algorithm may ask for; algorithms that need more are passed
// over for the next acceptable one.
constexpr size_t kMaxWorkspaceBytes = size_t(512) << 20;

// The largest dimension, leading dimension or batch count cuBLAS takes (int).
constexpr int64_t kMaxIndex = int64_t(0x7fffffff);

// conv_algos.h mirrors cuDNN's enums so that its rule needs no CUDA; they must agree value for
// value.
static_assert(int(FwdAlgo::kImplicitGemm) == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM);
static_assert(int(FwdAlgo::kImplicitPrecompGemm) ==
              CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM);
static_assert(int(FwdAlgo::kGemm) == CUDNN_CONVOLUTION_FWD_ALGO_GEMM);
static_assert(int(FwdAlgo::kDirect) == CUDNN_CONVOLUTION_FWD_ALGO_DIRECT);
static_assert(int(FwdAlgo::kFft) == CUDNN_CONVOLUTION_FWD_ALGO_FFT);
static_assert(int(FwdAlgo::kFftTiling) == CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING);
static_assert(int(FwdAlgo::kWinograd) == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD);
static_assert(int(FwdAlgo::kWinogradNonfused) == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED);
static_assert(kFwdAlgoCount == CUDNN_CONVOLUTION_FWD_ALGO_COUNT);
static_assert(int(BwdDataAlgo::kAlgo0) == CUDNN_CONVOLUTION_BWD_DATA_ALGO_0);
static_assert(int(BwdDataAlgo::kAlgo1) == CUDNN_CONVOLUTION_BWD_DATA_ALGO_1);
static_assert(int(BwdDataAlgo::kFft) == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT);
static_assert(int(BwdDataAlgo::kFftTiling) == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING);
static_assert(int(BwdDataAlgo::kWinograd) == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD);
static_assert(int(BwdDataAlgo::kWinogradNonfused) ==
              CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED);
static_assert(kBwdDataAlgoCount == CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT);
static_assert(int(BwdFilterAlgo::kAlgo0) == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0);
static_assert(int(BwdFilterAlgo::kAlgo1) == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1);
static_assert(int(BwdFilterAlgo::kFft) == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT);
static_assert(int(BwdFilterAlgo::kAlgo3) == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3);
static_assert(int(BwdFilterAlgo::kWinograd) == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD);
static_assert(int(BwdFilterAlgo::kWinogradNonfused) ==
              CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED);
static_assert(int(BwdFilterAlgo::kFftTiling) == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING);
static_assert(kBwdFilterAlgoCount == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT);
static_assert(int(ConvMath::kDefault) == CUDNN_DEFAULT_MATH);
static_assert(int(ConvMath::kTensorOp) == CUDNN_TENSOR_OP_MATH);
static_assert(int(ConvMath::kTensorOpAllowConversion) == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION);
static_assert(int(ConvMath::kFma) == CUDNN_FMA_MATH);

constexpr size_t kPasses = 3;  // ConvPass values, as indices

// Descriptors and algorithm choices of one convolution shape under one policy. Each pass has a
// convolution descriptor of its own because the math type, which lives on the descriptor, is
// the chosen algorithm's.
struct ConvPlan {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  std::array<cudnnConvolutionDescriptor_t, kPasses> conv{};
  // Per pass; workspace_bytes is the workspace the pass runs with.
  std::array<ConvAlgoChoice, kPasses> chosen{};

  ConvPlan() = default;
  ConvPlan(const ConvPlan&) = delete;
  ConvPlan& operator=(const ConvPlan&) = delete;
  ~ConvPlan() {
    // Plans live as long as the context; this runs when PlanFor fails half-way (a destructor
    // cannot report errors, so they are ignored).
    for (cudnnConvolutionDescriptor_t c : conv) {
      if (c != nullptr) cudnnDestroyConvolutionDescriptor(c);
    }
    if (w != nullptr) cudnnDestroyFilterDescriptor(w);
    if (y != nullptr) cudnnDestroyTensorDescriptor(y);
    if (x != nullptr) cudnnDestroyTensorDescriptor(x);
  }

  cudnnConvolutionDescriptor_t Conv(ConvPass pass) const { return conv[size_t(pass)]; }
  const ConvAlgoChoice& Chosen(ConvPass pass) const { return chosen[size_t(pass)]; }
};

// The shape and the policy it was planned under.
using ConvKey =
    std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int>;

struct Context {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  cudnnHandle_t cudnn = nullptr;
  std::array<void*, size_t(Scratch::kCount)> scratch{};
  std::array<size_t, size_t(Scratch::kCount)> scratch_bytes{};
  std::map<ConvKey, std::unique_ptr<ConvPlan>> plans;

  Context() {
    CPD_CUDA_CHECK(cudaGetDevice(&device));
    // Blocking (no cudaStreamNonBlocking): ordered against the legacy default stream, on which
    // Tensor's cudaMemcpy/cudaMemset run.
    CPD_CUDA_CHECK(cudaStreamCreate(&stream));
    CPD_CUBLAS_CHECK(cublasCreate(&cublas));
    CPD_CUBLAS_CHECK(cublasSetStream(cublas, stream));
    // CUBLAS_DEFAULT_MATH with CUBLAS_COMPUTE_32F in every call: float32 FMAs, no TF32 (only
    // CUBLAS_TF32_TENSOR_OP_MATH or CUBLAS_COMPUTE_32F_FAST_TF32 would allow it).
    CPD_CUBLAS_CHECK(cublasSetMathMode(cublas, CUBLAS_DEFAULT_MATH));
    CPD_CUDNN_CHECK(cudnnCreate(&cudnn));
    CPD_CUDNN_CHECK(cudnnSetStream(cudnn, stream));
  }
  // Never destroyed: the context lives until the process exits, when the driver releases it
  // (destroying handles from a static destructor races the CUDA runtime's own teardown).

  void* Get(Scratch which, size_t bytes) {
    const size_t i = size_t(which);
    if (bytes <= scratch_bytes[i] && scratch[i] != nullptr) return scratch[i];
    if (scratch[i] != nullptr) {
      CPD_CUDA_CHECK(cudaFree(scratch[i]));  // waits for the device: nothing still uses it
      scratch[i] = nullptr;
      scratch_bytes[i] = 0;
    }
    const size_t grown = std::max<size_t>(bytes, 256);
    CPD_CUDA_CHECK(cudaMalloc(&scratch[i], grown));
    scratch_bytes[i] = grown;
    return scratch[i];
  }
};

Context& Ctx() {
  static Context* ctx = new Context();
  return *ctx;
}

// ---- cuDNN: convolution plans ------------------------------------------------------------------

// The policy the next convolution is planned or looked up under (SetConvAlgoPolicy). A setting
// apart from the context, so that choosing it creates no CUDA state.
ConvAlgoPolicy conv_policy_in_force = ConvAlgoPolicy::kExact;

std::string ShapeText(const cpu::ConvShape& s) {
  return "[" + std::to_string(s.n) + ", " + std::to_string(s.c) + ", " + std::to_string(s.h) +
         ", " + std::to_string(s.w) + "] -> " + std::to_string(s.oc) + " channels, kernel " +
         std::to_string(s.k) + ", stride " + std::to_string(s.stride) + ", padding " +
         std::to_string(s.pad);
}

cudnnMathType_t CudnnMath(ConvMath m) { return cudnnMathType_t(int(m)); }

// One pass's algorithm: cuDNN's whole heuristic ranking (the _v7 query, asked for as many
// results as cuDNN has algorithms), turned into plain candidates for the rule of conv_algos.h,
// which picks one or the fallback. The pick's math type is left set on `conv`, the pass's
// descriptor, which the ranking was asked with at RankingMath(policy). The workspace is the
// larger of the ranking's figure and the size query's at the math type the algorithm runs with.
template <typename Perf, typename Algo, typename QueryFn, typename SizeFn>
ConvAlgoChoice ChooseAlgo(ConvPass pass, ConvAlgoPolicy policy, const cpu::ConvShape& s,
                          cudnnConvolutionDescriptor_t conv, int max_count, QueryFn query,
                          SizeFn size_of) {
  std::vector<Perf> perf(size_t(std::max(max_count, 1)));
  int returned = 0;
  CPD_CUDNN_CHECK(query(int(perf.size()), &returned, perf.data()));
  std::vector<ConvAlgoCandidate> ranked;
  for (int i = 0; i < returned && i < int(perf.size()); ++i) {
    const Perf& p = perf[size_t(i)];
    ConvAlgoCandidate c;
    c.algo = int(p.algo);
    c.ok = p.status == CUDNN_STATUS_SUCCESS;
    c.deterministic = p.determinism == CUDNN_DETERMINISTIC;
    c.math = ConvMath(int(p.mathType));
    c.workspace_bytes = p.memory;
    if (c.ok && c.deterministic && ConvAlgoAcceptable(policy, pass, c.algo, c.math)) {
      CPD_CUDNN_CHECK(cudnnSetConvolutionMathType(conv, CudnnMath(RunMath(policy, c.math))));
      size_t need = 0;
      c.ok = size_of(p.algo, &need) == CUDNN_STATUS_SUCCESS;  // else not runnable: passed over
      c.workspace_bytes = std::max(p.memory, need);
    }
    ranked.push_back(c);
  }
  ConvAlgoChoice choice = ChooseConvAlgo(policy, pass, ranked, kMaxWorkspaceBytes);
  CPD_CUDNN_CHECK(cudnnSetConvolutionMathType(conv, CudnnMath(choice.math)));
  if (choice.fallback) {
    size_t need = 0;
    const cudnnStatus_t st = size_of(Algo(choice.algo), &need);
    if (st != CUDNN_STATUS_SUCCESS) {
      throw std::runtime_error(std::string("cuDNN ranks no deterministic ") +
                               ConvAlgoPolicyName(policy) + " " + ConvPassName(pass) +
                               " algorithm for the convolution " + ShapeText(s) +
                               " within the workspace limit, and the fallback (algorithm " +
                               std::to_string(choice.algo) + ") fails: " + cudnnGetErrorString(st));
    }
    choice.workspace_bytes = need;
  }
  return choice;
}

ConvPlan& PlanFor(const cpu::ConvShape& s) {
  Context& ctx = Ctx();
  const ConvAlgoPolicy policy = conv_policy_in_force;
  const ConvKey key{s.n, s.c, s.h, s.w, s.oc, s.k, s.stride, s.pad, int(policy)};
  auto it = ctx.plans.find(key);
  if (it != ctx.plans.end()) return *it->second;
  const int64_t kMax = int64_t(0x7fffffff);
  for (int64_t d : {s.n, s.c, s.h, s.w, s.oc, s.k, s.stride, s.pad}) {
    if (d > kMax) throw std::invalid_argument("cuda Conv2d: a dimension exceeds 2^31 - 1");
  }
  auto plan = std::make_unique<ConvPlan>();
  ConvPlan& p = *plan;
  CPD_CUDNN_CHECK(cudnnCreateTensorDescriptor(&p.x));
  CPD_CUDNN_CHECK(cudnnCreateTensorDescriptor(&p.y));
  CPD_CUDNN_CHECK(cudnnCreateFilterDescriptor(&p.w));
  CPD_CUDNN_CHECK(cudnnSetTensor4dDescriptor(p.x, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, int(s.n),
                                             int(s.c), int(s.h), int(s.w)));
  CPD_CUDNN_CHECK(cudnnSetFilter4dDescriptor(p.w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, int(s.oc),
                                             int(s.c), int(s.k), int(s.k)));
  // Ranked at FMA math unless fast algorithms are allowed: cuDNN's default math lets float32
  // convolutions use TF32 tensor cores on compute capability 8.0 and later, which would round
  // the inputs to 10 mantissa bits.
  for (cudnnConvolutionDescriptor_t& c : p.conv) {
    CPD_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&c));
    CPD_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(c, int(s.pad), int(s.pad), int(s.stride),
                                                    int(s.stride), 1, 1, CUDNN_CROSS_CORRELATION,
                                                    CUDNN_DATA_FLOAT));
    CPD_CUDNN_CHECK(cudnnSetConvolutionMathType(c, CudnnMath(RankingMath(policy))));
  }
  cudnnConvolutionDescriptor_t geometry = p.Conv(ConvPass::kForward);
  int on = 0, oc = 0, oh = 0, ow = 0;
  CPD_CUDNN_CHECK(cudnnGetConvolution2dForwardOutputDim(geometry, p.x, p.w, &on, &oc, &oh, &ow));
  if (on != s.n || oc != s.oc || oh != s.oh || ow != s.ow) {
    throw std::logic_error("cuDNN computes the output of the convolution " + ShapeText(s) +
                           " as [" + std::to_string(on) + ", " + std::to_string(oc) + ", " +
                           std::to_string(oh) + ", " + std::to_string(ow) + "], the CPU as [" +
                           std::to_string(s.n) + ", " + std::to_string(s.oc) + ", " +
                           std::to_string(s.oh) + ", " + std::to_string(s.ow) + "]");
  }
  CPD_CUDNN_CHECK(
      cudnnSetTensor4dDescriptor(p.y, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, on, oc, oh, ow));
  cudnnHandle_t h = ctx.cudnn;
  int count = 0;
  cudnnConvolutionDescriptor_t fwd = p.Conv(ConvPass::kForward);
  CPD_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithmMaxCount(h, &count));
  p.chosen[size_t(ConvPass::kForward)] =
      ChooseAlgo<cudnnConvolutionFwdAlgoPerf_t, cudnnConvolutionFwdAlgo_t>(
          ConvPass::kForward, policy, s, fwd, count,
          [&](int req, int* ret, cudnnConvolutionFwdAlgoPerf_t* perf) {
            return cudnnGetConvolutionForwardAlgorithm_v7(h, p.x, p.w, fwd, p.y, req, ret, perf);
          },
          [&](cudnnConvolutionFwdAlgo_t a, size_t* b) {
            return cudnnGetConvolutionForwardWorkspaceSize(h, p.x, p.w, fwd, p.y, a, b);
          });
  cudnnConvolutionDescriptor_t bwd_data = p.Conv(ConvPass::kBackwardData);
  CPD_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithmMaxCount(h, &count));
  p.chosen[size_t(ConvPass::kBackwardData)] =
      ChooseAlgo<cudnnConvolutionBwdDataAlgoPerf_t, cudnnConvolutionBwdDataAlgo_t>(
          ConvPass::kBackwardData, policy, s, bwd_data, count,
          [&](int req, int* ret, cudnnConvolutionBwdDataAlgoPerf_t* perf) {
            return cudnnGetConvolutionBackwardDataAlgorithm_v7(h, p.w, p.y, bwd_data, p.x, req, ret,
                                                               perf);
          },
          [&](cudnnConvolutionBwdDataAlgo_t a, size_t* b) {
            return cudnnGetConvolutionBackwardDataWorkspaceSize(h, p.w, p.y, bwd_data, p.x, a, b);
          });
  cudnnConvolutionDescriptor_t bwd_filter = p.Conv(ConvPass::kBackwardFilter);
  CPD_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(h, &count));
  p.chosen[size_t(ConvPass::kBackwardFilter)] =
      ChooseAlgo<cudnnConvolutionBwdFilterAlgoPerf_t, cudnnConvolutionBwdFilterAlgo_t>(
          ConvPass::kBackwardFilter, policy, s, bwd_filter, count,
          [&](int req, int* ret, cudnnConvolutionBwdFilterAlgoPerf_t* perf) {
            return cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, p.x, p.y, bwd_filter, p.w, req,
                                                                 ret, perf);
          },
          [&](cudnnConvolutionBwdFilterAlgo_t a, size_t* b) {
            return cudnnGetConvolutionBackwardFilterWorkspaceSize(h, p.x, p.y, bwd_filter, p.w, a,
                                                                  b);
          });
  return *ctx.plans.emplace(key, std::move(plan)).first->second;
}

}  // namespace

namespace internal {

cudaStream_t StreamHandle() { return Ctx().stream; }

void* ScratchMemory(Scratch which, size_t bytes) { return Ctx().Get(which, bytes); }

// ---- cuBLAS: row-major GEMMs as column-major ones ---------------------------------------------
// A row-major [r, c] matrix is the column-major [c, r] matrix with the same leading dimension,
// so C = op(A) op(B) (row-major) is C^T = op(B)^T op(A)^T (column-major): the operands swap.

namespace {

void RequireGemmDims(std::initializer_list<int64_t> dims) {
  for (int64_t d : dims) {
    if (d > kMaxIndex) throw std::invalid_argument("cuda GEMM: a dimension exceeds 2^31 - 1");
  }
}

// k = 0: C = beta C, which the callers need only for beta 0 (C = 0) or 1 (C unchanged).
void EmptyProduct(int64_t m, int64_t n, float beta, float* c, int64_t ldc, cudaStream_t stream) {
  if (beta == 1.f) return;
  if (beta != 0.f) {
    throw std::invalid_argument("cuda GEMM: an empty product (k = 0) with beta other than 0 or 1");
  }
  CPD_CUDA_CHECK(cudaMemset2DAsync(c, size_t(ldc) * sizeof(float), 0, size_t(n) * sizeof(float),
                                   size_t(m), stream));
}

}  // namespace

void GemmRowMajor(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                  const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                  int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  RequireGemmDims({m, n, k, lda, ldb, ldc});
  Context& ctx = Ctx();
  if (k <= 0) return EmptyProduct(m, n, beta, c, ldc, ctx.stream);
  CPD_CUBLAS_CHECK(cublasGemmEx(ctx.cublas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, int(n), int(m), int(k), &alpha,
                                b, CUDA_R_32F, int(ldb), a, CUDA_R_32F, int(lda), &beta, c,
                                CUDA_R_32F, int(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void GemmRowMajorStridedBatched(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                                float alpha, const float* a, int64_t lda, int64_t stride_a,
                                const float* b, int64_t ldb, int64_t stride_b, float beta, float* c,
                                int64_t ldc, int64_t stride_c, int64_t batch) {
  if (m <= 0 || n <= 0 || batch <= 0) return;
  RequireGemmDims({m, n, k, lda, ldb, ldc, batch});
  Context& ctx = Ctx();
  if (k <= 0) {
    for (int64_t i = 0; i < batch; ++i) EmptyProduct(m, n, beta, c + i * stride_c, ldc, ctx.stream);
    return;
  }
  // The handle's CUBLAS_DEFAULT_MATH keeps cublasSgemm* at float32 (no TF32), as cublasGemmEx
  // with CUBLAS_COMPUTE_32F above.
  CPD_CUBLAS_CHECK(cublasSgemmStridedBatched(
      ctx.cublas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, int(n),
      int(m), int(k), &alpha, b, int(ldb), (long long)stride_b, a, int(lda), (long long)stride_a,
      &beta, c, int(ldc), (long long)stride_c, int(batch)));
}

}  // namespace internal

void* Stream() { return Ctx().stream; }

void Synchronize() { CPD_CUDA_CHECK(cudaStreamSynchronize(Ctx().stream)); }

void SetConvAlgoPolicy(ConvAlgoPolicy policy) { conv_policy_in_force = policy; }

ConvAlgoPolicy GetConvAlgoPolicy() { return conv_policy_in_force; }

ConvAlgoChoice ChosenConvAlgo(const cpu::ConvShape& s, ConvPass pass) {
  return PlanFor(s).Chosen(pass);
}

// ---- Fully connected (cuBLAS GEMMs; bias kernels in cuda_ops.cu) -------------------------------

namespace {

// C = op(A) op(B) (beta 0): cuBLAS, or under an emulated accumulation kernels/cuda/accumulate.h.
void Product(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a,
             int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
             const kernels::Accumulation* acc) {
  if (acc == nullptr) {
    internal::GemmRowMajor(trans_a, trans_b, m, n, k, 1.f, a, lda, b, ldb, 0.f, c, ldc);
    return;
  }
  const kernels::cuda::CudaResult r = kernels::cuda::LaunchAccumulatedGemm(
      trans_a, trans_b, m, n, k, a, lda, b, ldb, 0.f, c, ldc, *acc, internal::StreamHandle());
  if (!r.ok())
    internal::ThrowError(r.file ? r.file : "?", r.line, r.expr ? r.expr : "?", r.message, r.code);
}

}  // namespace

void LinearForward(int64_t n, int64_t in, int64_t out, const float* x, const float* w,
                   const float* bias, float* y, const kernels::Accumulation* acc) {
  // y [n, out] = x [n, in] w^T, then + bias per row (the CPU's order: product first).
  Product(false, true, n, out, in, x, in, w, in, y, out, acc);
  if (bias != nullptr) internal::AddRowBias(n, out, bias, y);
}

void LinearBackward(int64_t n, int64_t in, int64_t out, const float* x, const float* w,
                    const float* dy, float* dx, float* dw, float* db,
                    const kernels::Accumulation* acc) {
  if (dw != nullptr) Product(true, false, out, in, n, dy, out, x, in, dw, in, acc);  // dy^T x
  if (db != nullptr) internal::ColumnSums(n, out, dy, db);
  if (dx != nullptr) Product(false, false, n, in, out, dy, out, w, in, dx, in, acc);  // dy w
}

// ---- Convolution (cuDNN) ------------------------------------------------------------------------

void Conv2dForward(const cpu::ConvShape& s, const float* x, const float* w, const float* bias,
                   float* y) {
  if (s.n == 0 || s.oc == 0 || s.ohw() == 0) return;
  ConvPlan& p = PlanFor(s);
  Context& ctx = Ctx();
  const ConvAlgoChoice& a = p.Chosen(ConvPass::kForward);
  void* ws = a.workspace_bytes > 0
                 ? internal::ScratchMemory(Scratch::kCudnnWorkspace, a.workspace_bytes)
                 : nullptr;
  const float one = 1.f, zero = 0.f;
  CPD_CUDNN_CHECK(cudnnConvolutionForward(
      ctx.cudnn, &one, p.x, x, p.w, w, p.Conv(ConvPass::kForward),
      cudnnConvolutionFwdAlgo_t(a.algo), ws, a.workspace_bytes, &zero, p.y, y));
  if (bias != nullptr) internal::AddChannelBias(s.n, s.oc, s.ohw(), bias, y);
}

void Conv2dBackward(const cpu::ConvShape& s, const float* x, const float* w, const float* dy,
                    float* dx, float* dw, float* db) {
  Context& ctx = Ctx();
  if (s.n == 0 || s.oc == 0 || s.ohw() == 0) {  // an empty batch: the gradients are zero
    if (s.oc > 0) {
      CPD_CUDA_CHECK(cudaMemsetAsync(dw, 0, size_t(s.oc * s.ckk()) * sizeof(float), ctx.stream));
      if (db != nullptr) {
        CPD_CUDA_CHECK(cudaMemsetAsync(db, 0, size_t(s.oc) * sizeof(float), ctx.stream));
      }
    }
    return;
  }
  ConvPlan& p = PlanFor(s);
  const float one = 1.f, zero = 0.f;
  if (dx != nullptr) {
    const ConvAlgoChoice& a = p.Chosen(ConvPass::kBackwardData);
    void* ws = a.workspace_bytes > 0
                   ? internal::ScratchMemory(Scratch::kCudnnWorkspace, a.workspace_bytes)
                   : nullptr;
    CPD_CUDNN_CHECK(cudnnConvolutionBackwardData(
        ctx.cudnn, &one, p.w, w, p.y, dy, p.Conv(ConvPass::kBackwardData),
        cudnnConvolutionBwdDataAlgo_t(a.algo), ws, a.workspace_bytes, &zero, p.x, dx));
  }
  const ConvAlgoChoice& a = p.Chosen(ConvPass::kBackwardFilter);
  void* ws = a.workspace_bytes > 0
                 ? internal::ScratchMemory(Scratch::kCudnnWorkspace, a.workspace_bytes)
                 : nullptr;
  CPD_CUDNN_CHECK(cudnnConvolutionBackwardFilter(
      ctx.cudnn, &one, p.x, x, p.y, dy, p.Conv(ConvPass::kBackwardFilter),
      cudnnConvolutionBwdFilterAlgo_t(a.algo), ws, a.workspace_bytes, &zero, p.w, dw));
  if (db != nullptr) internal::ChannelSums(s.n, s.oc, s.ohw(), dy, db);
}

}  // namespace cpd::runtime::cuda
