// The rule that picks cuDNN's convolution algorithms (runtime/engine/conv_algos.h), on plain
// data: every algorithm value of every pass, every math type, both policies, cuDNN's ranking with
// the candidates it must pass over, and the fallback.
#include "runtime/engine/conv_algos.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <set>
#include <string>
#include <vector>

#include "runtime/engine/conv_shape.h"

namespace cpd::runtime::cuda {
namespace {

constexpr ConvPass kPasses[] = {ConvPass::kForward, ConvPass::kBackwardData,
                                ConvPass::kBackwardFilter};
constexpr ConvMath kMaths[] = {ConvMath::kDefault, ConvMath::kTensorOp,
                               ConvMath::kTensorOpAllowConversion, ConvMath::kFma};
constexpr size_t kMiB = size_t(1) << 20;

// The algorithms whose arithmetic is float32 products and sums, from cuDNN's documentation of
// the three enums (GEMM, implicit GEMM, direct); the rest are FFT and Winograd.
std::set<int> ExactAlgos(ConvPass pass) {
  switch (pass) {
    case ConvPass::kForward:
      return {0 /*IMPLICIT_GEMM*/, 1 /*IMPLICIT_PRECOMP_GEMM*/, 2 /*GEMM*/, 3 /*DIRECT*/};
    case ConvPass::kBackwardData:
      return {0 /*ALGO_0*/, 1 /*ALGO_1*/};
    case ConvPass::kBackwardFilter:
      return {0 /*ALGO_0*/, 1 /*ALGO_1*/, 3 /*ALGO_3*/};
  }
  return {};
}

ConvAlgoCandidate Candidate(int algo, size_t workspace = 0, bool deterministic = true,
                            ConvMath math = ConvMath::kFma, bool ok = true) {
  ConvAlgoCandidate c;
  c.algo = algo;
  c.ok = ok;
  c.deterministic = deterministic;
  c.math = math;
  c.workspace_bytes = workspace;
  return c;
}

TEST(ConvAlgos, TheEnumsHaveCudnnsValuesAndCounts) {
  EXPECT_EQ(ConvAlgoCount(ConvPass::kForward), 8);
  EXPECT_EQ(ConvAlgoCount(ConvPass::kBackwardData), 6);
  EXPECT_EQ(ConvAlgoCount(ConvPass::kBackwardFilter), 7);
  EXPECT_EQ(int(FwdAlgo::kWinogradNonfused), 7);
  EXPECT_EQ(int(BwdDataAlgo::kWinogradNonfused), 5);
  EXPECT_EQ(int(BwdFilterAlgo::kAlgo3), 3);
  EXPECT_EQ(int(BwdFilterAlgo::kWinogradNonfused), 5);
  EXPECT_EQ(int(BwdFilterAlgo::kFftTiling), 6);
  EXPECT_EQ(int(ConvMath::kFma), 3);
}

TEST(ConvAlgos, ExactArithmeticIsGemmAndDirectOnlyForEveryAlgorithmValue) {
  for (ConvPass pass : kPasses) {
    const std::set<int> exact = ExactAlgos(pass);
    for (int a = -1; a <= ConvAlgoCount(pass); ++a) {
      EXPECT_EQ(IsExactArithmetic(pass, a), exact.count(a) == 1)
          << ConvPassName(pass) << " algo " << a;
    }
  }
  // The transformed-domain ones by name.
  EXPECT_FALSE(IsExactArithmetic(ConvPass::kForward, int(FwdAlgo::kFft)));
  EXPECT_FALSE(IsExactArithmetic(ConvPass::kForward, int(FwdAlgo::kFftTiling)));
  EXPECT_FALSE(IsExactArithmetic(ConvPass::kForward, int(FwdAlgo::kWinograd)));
  EXPECT_FALSE(IsExactArithmetic(ConvPass::kForward, int(FwdAlgo::kWinogradNonfused)));
  EXPECT_FALSE(IsExactArithmetic(ConvPass::kBackwardData, int(BwdDataAlgo::kFft)));
  EXPECT_FALSE(IsExactArithmetic(ConvPass::kBackwardData, int(BwdDataAlgo::kFftTiling)));
  EXPECT_FALSE(IsExactArithmetic(ConvPass::kBackwardData, int(BwdDataAlgo::kWinograd)));
  EXPECT_FALSE(IsExactArithmetic(ConvPass::kBackwardData, int(BwdDataAlgo::kWinogradNonfused)));
  EXPECT_FALSE(IsExactArithmetic(ConvPass::kBackwardFilter, int(BwdFilterAlgo::kFft)));
  EXPECT_FALSE(IsExactArithmetic(ConvPass::kBackwardFilter, int(BwdFilterAlgo::kFftTiling)));
  EXPECT_FALSE(IsExactArithmetic(ConvPass::kBackwardFilter, int(BwdFilterAlgo::kWinograd)));
  EXPECT_FALSE(IsExactArithmetic(ConvPass::kBackwardFilter, int(BwdFilterAlgo::kWinogradNonfused)));
}

TEST(ConvAlgos, TensorOpMathIsTheTwoTensorCoreTypes) {
  EXPECT_FALSE(IsTensorOpMath(ConvMath::kDefault));
  EXPECT_TRUE(IsTensorOpMath(ConvMath::kTensorOp));
  EXPECT_TRUE(IsTensorOpMath(ConvMath::kTensorOpAllowConversion));
  EXPECT_FALSE(IsTensorOpMath(ConvMath::kFma));
}

TEST(ConvAlgos, ExactPolicyAcceptsExactAlgorithmsWithoutTensorCores) {
  for (ConvPass pass : kPasses) {
    const std::set<int> exact = ExactAlgos(pass);
    for (int a = -1; a <= ConvAlgoCount(pass); ++a) {
      for (ConvMath m : kMaths) {
        const bool want = exact.count(a) == 1 && !IsTensorOpMath(m);
        EXPECT_EQ(ConvAlgoAcceptable(ConvAlgoPolicy::kExact, pass, a, m), want)
            << ConvPassName(pass) << " algo " << a << " math " << int(m);
      }
    }
  }
}

TEST(ConvAlgos, FastPolicyAcceptsEveryAlgorithmOfThePassAtAnyMath) {
  for (ConvPass pass : kPasses) {
    for (int a = -1; a <= ConvAlgoCount(pass); ++a) {
      for (ConvMath m : kMaths) {
        const bool in_enum = a >= 0 && a < ConvAlgoCount(pass);
        EXPECT_EQ(ConvAlgoAcceptable(ConvAlgoPolicy::kFast, pass, a, m), in_enum)
            << ConvPassName(pass) << " algo " << a << " math " << int(m);
      }
    }
  }
}

TEST(ConvAlgos, RankingMathIsFmaUnlessFast) {
  EXPECT_EQ(RankingMath(ConvAlgoPolicy::kExact), ConvMath::kFma);
  EXPECT_EQ(RankingMath(ConvAlgoPolicy::kFast), ConvMath::kTensorOp);
}

TEST(ConvAlgos, ExactRunsEverythingAtFmaFastAtTheRankedMath) {
  for (ConvMath m : kMaths) {
    EXPECT_EQ(RunMath(ConvAlgoPolicy::kExact, m), ConvMath::kFma) << int(m);
    EXPECT_EQ(RunMath(ConvAlgoPolicy::kFast, m), m) << int(m);
  }
}

TEST(ConvAlgos, FallbacksAreExactAndNamed) {
  EXPECT_EQ(FallbackConvAlgo(ConvPass::kForward), int(FwdAlgo::kImplicitGemm));
  EXPECT_EQ(FallbackConvAlgo(ConvPass::kBackwardData), int(BwdDataAlgo::kAlgo1));
  EXPECT_EQ(FallbackConvAlgo(ConvPass::kBackwardFilter), int(BwdFilterAlgo::kAlgo1));
  for (ConvPass pass : kPasses) {
    EXPECT_TRUE(IsExactArithmetic(pass, FallbackConvAlgo(pass))) << ConvPassName(pass);
  }
}

TEST(ConvAlgos, NamesOfPoliciesAndPasses) {
  EXPECT_STREQ(ConvAlgoPolicyName(ConvAlgoPolicy::kExact), "exact");
  EXPECT_STREQ(ConvAlgoPolicyName(ConvAlgoPolicy::kFast), "fast");
  EXPECT_STREQ(ConvPassName(ConvPass::kForward), "forward");
  EXPECT_STREQ(ConvPassName(ConvPass::kBackwardData), "backward-data");
  EXPECT_STREQ(ConvPassName(ConvPass::kBackwardFilter), "backward-filter");
}

TEST(ConvAlgos, AnEmptyRankingGivesTheFallbackAtFma) {
  for (ConvAlgoPolicy policy : {ConvAlgoPolicy::kExact, ConvAlgoPolicy::kFast}) {
    for (ConvPass pass : kPasses) {
      const ConvAlgoChoice c = ChooseConvAlgo(policy, pass, {}, 512 * kMiB);
      EXPECT_TRUE(c.fallback) << ConvPassName(pass);
      EXPECT_EQ(c.algo, FallbackConvAlgo(pass)) << ConvPassName(pass);
      EXPECT_EQ(c.math, ConvMath::kFma) << ConvPassName(pass);
      EXPECT_EQ(c.rank, -1) << ConvPassName(pass);
      EXPECT_EQ(c.workspace_bytes, 0u) << ConvPassName(pass);
    }
  }
}

// cuDNN's ranking, fastest first; each candidate ahead of the exact one fails one test.
TEST(ConvAlgos, TheFirstCandidateThatPassesEveryTestIsTaken) {
  const int kFft = int(BwdFilterAlgo::kFft);
  const int kAlgo0 = int(BwdFilterAlgo::kAlgo0);
  const int kAlgo1 = int(BwdFilterAlgo::kAlgo1);
  const int kAlgo3 = int(BwdFilterAlgo::kAlgo3);
  const std::vector<ConvAlgoCandidate> ranked = {
      Candidate(kFft, 4 * kMiB),                                 // not exact
      Candidate(kAlgo1, 0, true, ConvMath::kFma, /*ok=*/false),  // status not SUCCESS
      Candidate(kAlgo0, 0, /*deterministic=*/false),             // atomics
      Candidate(kAlgo1, 0, true, ConvMath::kTensorOp),           // TF32
      Candidate(kAlgo3, 600 * kMiB),                             // workspace too large
      Candidate(kAlgo3, 512 * kMiB, true, ConvMath::kDefault),   // this one
      Candidate(kAlgo1, 0),
  };
  const ConvAlgoChoice c =
      ChooseConvAlgo(ConvAlgoPolicy::kExact, ConvPass::kBackwardFilter, ranked, 512 * kMiB);
  EXPECT_FALSE(c.fallback);
  EXPECT_EQ(c.rank, 5);
  EXPECT_EQ(c.algo, kAlgo3);
  EXPECT_EQ(c.workspace_bytes, 512 * kMiB);  // the limit itself fits
  // Ranked at kDefault, run at kFma: kDefault on a descriptor would permit TF32.
  EXPECT_EQ(c.math, ConvMath::kFma);

  // The fast policy takes the FFT at the head of the list; determinism, status and workspace
  // still count.
  const ConvAlgoChoice f =
      ChooseConvAlgo(ConvAlgoPolicy::kFast, ConvPass::kBackwardFilter, ranked, 512 * kMiB);
  EXPECT_EQ(f.rank, 0);
  EXPECT_EQ(f.algo, kFft);
  const ConvAlgoChoice small =
      ChooseConvAlgo(ConvAlgoPolicy::kFast, ConvPass::kBackwardFilter, ranked, 1 * kMiB);
  EXPECT_EQ(small.rank, 3);  // the FFT no longer fits; TF32 ALGO_1 is next that passes
  EXPECT_EQ(small.algo, kAlgo1);
  EXPECT_EQ(small.math, ConvMath::kTensorOp);  // run at the math type cuDNN ranked it with
}

TEST(ConvAlgos, NoAcceptableCandidateGivesTheFallback) {
  const std::vector<ConvAlgoCandidate> ranked = {
      Candidate(int(FwdAlgo::kWinograd)),
      Candidate(int(FwdAlgo::kFftTiling), 8 * kMiB),
      Candidate(int(FwdAlgo::kImplicitPrecompGemm), 1 * kMiB, true, ConvMath::kTensorOp),
      Candidate(int(FwdAlgo::kGemm), 64 * kMiB),  // over this call's limit
      Candidate(99),                              // not a cuDNN 9 value
  };
  const ConvAlgoChoice c =
      ChooseConvAlgo(ConvAlgoPolicy::kExact, ConvPass::kForward, ranked, 32 * kMiB);
  EXPECT_TRUE(c.fallback);
  EXPECT_EQ(c.algo, int(FwdAlgo::kImplicitGemm));
  EXPECT_EQ(c.math, ConvMath::kFma);
  EXPECT_EQ(c.rank, -1);
}

// Issue 25, item 1.4: LeNet-5's conv1 (1 -> 6 channels, 5x5, 28x28 padded by 2, as the model
// builds it) at batch 32. On an H200 cuDNN ranked WINOGRAD_NONFUSED first for backward-filter,
// which was 1.3e-3 of max|g| off a float64 reference (GEMM: 2.5e-7). The rest of the ranking
// below is illustrative: FFT and FFT_TILING (deterministic, transformed), then the GEMM ones.
TEST(ConvAlgos, LeNetConv1Batch32BackwardFilterSkipsWinogradForAGemm) {
  cpu::ConvShape s;
  s.n = 32, s.c = 1, s.h = 28, s.w = 28, s.oc = 6, s.k = 5, s.stride = 1, s.pad = 2;
  ASSERT_TRUE(s.ComputeOutput());
  ASSERT_EQ(s.oh, 28);
  ASSERT_EQ(s.ow, 28);
  // The workspaces are illustrative (Winograd's and FFT's scale with the transformed tiles) and
  // all fit the limit, so that only the arithmetic decides.
  const size_t tiles = size_t(s.n * s.oc * s.ohw()) * sizeof(float);
  const std::vector<ConvAlgoCandidate> ranked = {
      Candidate(int(BwdFilterAlgo::kWinogradNonfused), tiles),
      Candidate(int(BwdFilterAlgo::kFftTiling), 2 * tiles),
      Candidate(int(BwdFilterAlgo::kFft), 4 * tiles),
      Candidate(int(BwdFilterAlgo::kAlgo1), 0),
      Candidate(int(BwdFilterAlgo::kAlgo0), 0, /*deterministic=*/false),
      Candidate(int(BwdFilterAlgo::kAlgo3), 4096, /*deterministic=*/false),
  };
  const ConvAlgoChoice exact =
      ChooseConvAlgo(ConvAlgoPolicy::kExact, ConvPass::kBackwardFilter, ranked, 512 * kMiB);
  EXPECT_FALSE(exact.fallback);
  EXPECT_EQ(exact.algo, int(BwdFilterAlgo::kAlgo1));
  EXPECT_TRUE(IsExactArithmetic(ConvPass::kBackwardFilter, exact.algo));
  EXPECT_EQ(exact.math, ConvMath::kFma);
  EXPECT_EQ(exact.workspace_bytes, 0u);

  const ConvAlgoChoice fast =
      ChooseConvAlgo(ConvAlgoPolicy::kFast, ConvPass::kBackwardFilter, ranked, 512 * kMiB);
  EXPECT_EQ(fast.algo, int(BwdFilterAlgo::kWinogradNonfused));
  EXPECT_EQ(fast.workspace_bytes, tiles);
}

}  // namespace
}  // namespace cpd::runtime::cuda
