// Which of cuDNN's convolution algorithms the CUDA back end (runtime/engine/cuda_context.cc) may
// run, decided on plain data so that the rule builds and is tested without CUDA.
//
// Why a rule: the CPU is the GPU's reference, and a GPU run is meant to differ from the CPU run
// only by the order of float32 sums. cuDNN's heuristics rank Winograd and FFT algorithms first
// for many shapes; they compute in a transformed domain, whose rounding errors grow with the
// transform, not with the length of a dot product. For LeNet-5's conv1 at batch 32 on an H200,
// backward-filter's WINOGRAD_NONFUSED was 1.3e-3 of max|g| off a float64 reference, the GEMM
// algorithms 2.5e-7, and the GPU's loss curves drifted from the CPU's (issue 25, item 1.4).
// TF32 tensor cores round the operands to 10 mantissa bits, which is no better.
//
// The algorithm values are those of cuDNN 9's enums (cudnnConvolutionFwdAlgo_t,
// cudnnConvolutionBwdDataAlgo_t, cudnnConvolutionBwdFilterAlgo_t, cudnnMathType_t); the CUDA
// build checks every one at compile time. Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <span>

namespace cpd::runtime::cuda {

// What the user allows (cpd-train --fast-conv-algos).
enum class ConvAlgoPolicy {
  // The default: only algorithms whose arithmetic is float32 products summed in float32 (GEMM,
  // implicit GEMM, direct), run with FMA math (no tensor cores, so no TF32).
  kExact,
  // Any algorithm cuDNN ranks, at the math type it ranks it with: Winograd, FFT, TF32 tensor
  // cores. Faster on many shapes; the results are no longer the CPU's up to summation order.
  kFast,
};
// "exact" | "fast".
const char* ConvAlgoPolicyName(ConvAlgoPolicy policy);

// The three computations of a convolution layer, each with its own algorithm.
enum class ConvPass { kForward, kBackwardData, kBackwardFilter };
// "forward" | "backward-data" | "backward-filter".
const char* ConvPassName(ConvPass pass);

// cudnnConvolutionFwdAlgo_t.
enum class FwdAlgo : int {
  kImplicitGemm = 0,
  kImplicitPrecompGemm = 1,
  kGemm = 2,
  kDirect = 3,
  kFft = 4,
  kFftTiling = 5,
  kWinograd = 6,
  kWinogradNonfused = 7,
};
inline constexpr int kFwdAlgoCount = 8;

// cudnnConvolutionBwdDataAlgo_t (ALGO_0 and ALGO_1 are implicit GEMMs; cuDNN documents ALGO_0 as
// non-deterministic: it sums with atomics).
enum class BwdDataAlgo : int {
  kAlgo0 = 0,
  kAlgo1 = 1,
  kFft = 2,
  kFftTiling = 3,
  kWinograd = 4,
  kWinogradNonfused = 5,
};
inline constexpr int kBwdDataAlgoCount = 6;

// cudnnConvolutionBwdFilterAlgo_t (ALGO_0, ALGO_1 and ALGO_3 are GEMM-based; ALGO_0 and ALGO_3
// are documented as non-deterministic; WINOGRAD is not implemented by cuDNN).
enum class BwdFilterAlgo : int {
  kAlgo0 = 0,
  kAlgo1 = 1,
  kFft = 2,
  kAlgo3 = 3,
  kWinograd = 4,
  kWinogradNonfused = 5,
  kFftTiling = 6,
};
inline constexpr int kBwdFilterAlgoCount = 7;

// The number of algorithm values of `pass` (the enum's COUNT).
int ConvAlgoCount(ConvPass pass);

// cudnnMathType_t. kDefault lets cuDNN use TF32 tensor cores for float32 data on compute
// capability 8.0 and later; kFma never uses tensor cores.
enum class ConvMath : int {
  kDefault = 0,
  kTensorOp = 1,
  kTensorOpAllowConversion = 2,
  kFma = 3,
};

// Whether algorithm `algo` of `pass` computes every output from float32 products summed in
// float32 (GEMM, implicit GEMM, direct) rather than in a transformed domain (FFT, Winograd).
// A value outside the pass's enum is not.
bool IsExactArithmetic(ConvPass pass, int algo);

// Whether a ranked algorithm's math type uses tensor cores (kTensorOp: TF32 for float32 data;
// kTensorOpAllowConversion: also a conversion to half). kDefault is not counted, since kExact
// runs every choice at kFma whatever its label (kDefault as a descriptor's setting would permit
// TF32 from compute capability 8.0).
bool IsTensorOpMath(ConvMath math);

// Whether `policy` accepts running algorithm `algo` of `pass` at math type `math`: kExact
// accepts an exact-arithmetic algorithm (IsExactArithmetic) at a math type that is not tensor-op;
// kFast accepts every algorithm value of the pass at any math type. Determinism, status and
// workspace are ChooseConvAlgo's business.
bool ConvAlgoAcceptable(ConvAlgoPolicy policy, ConvPass pass, int algo, ConvMath math);

// The math type to set on the convolution descriptor that cuDNN ranks algorithms with:
// kExact: kFma; kFast: kTensorOp (TF32 allowed, but not kTensorOpAllowConversion's conversion
// to half).
ConvMath RankingMath(ConvAlgoPolicy policy);

// The math type an accepted algorithm runs with (set on its pass's convolution descriptor):
// kExact: kFma, whatever the ranking said (kDefault on a descriptor would permit TF32); kFast:
// the math type cuDNN ranked it with.
ConvMath RunMath(ConvAlgoPolicy policy, ConvMath ranked);

// The algorithm used when cuDNN ranks no acceptable one: forward IMPLICIT_GEMM, backward-data
// ALGO_1, backward-filter ALGO_1. Each is exact, deterministic (cuDNN documents it so) and
// needs no workspace, and each runs at kFma.
int FallbackConvAlgo(ConvPass pass);

// One entry of cuDNN's ranked answer (cudnnConvolution*AlgoPerf_t), as plain data.
struct ConvAlgoCandidate {
  int algo = 0;                    // the pass's algorithm value
  bool ok = false;                 // cuDNN's status was SUCCESS (and its workspace size is known)
  bool deterministic = false;      // CUDNN_DETERMINISTIC
  ConvMath math = ConvMath::kFma;  // the math type cuDNN ranked it with
  size_t workspace_bytes = 0;      // the workspace it needs
};

// What ChooseConvAlgo picked.
struct ConvAlgoChoice {
  int algo = 0;
  ConvMath math = ConvMath::kFma;  // RunMath of the candidate's; kFma for the fallback
  size_t workspace_bytes = 0;      // the candidate's; 0 for the fallback (the caller asks cuDNN)
  bool fallback = false;           // no candidate qualified: FallbackConvAlgo(pass)
  int rank = -1;                   // its index in `ranked`; -1 for the fallback
};

// The first candidate of `ranked` (cuDNN's order, fastest first) that is ok, deterministic,
// needs at most `max_workspace_bytes` and is ConvAlgoAcceptable under `policy`; else the
// fallback. Determinism is required under both policies: a run repeats bit for bit on the same
// GPU and build either way.
ConvAlgoChoice ChooseConvAlgo(ConvAlgoPolicy policy, ConvPass pass,
                              std::span<const ConvAlgoCandidate> ranked,
                              size_t max_workspace_bytes);

}  // namespace cpd::runtime::cuda
