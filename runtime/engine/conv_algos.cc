#include "runtime/engine/conv_algos.h"

namespace cpd::runtime::cuda {

const char* ConvAlgoPolicyName(ConvAlgoPolicy policy) {
  return policy == ConvAlgoPolicy::kFast ? "fast" : "exact";
}

const char* ConvPassName(ConvPass pass) {
  switch (pass) {
    case ConvPass::kForward:
      return "forward";
    case ConvPass::kBackwardData:
      return "backward-data";
    case ConvPass::kBackwardFilter:
      return "backward-filter";
  }
  return "?";
}

int ConvAlgoCount(ConvPass pass) {
  switch (pass) {
    case ConvPass::kForward:
      return kFwdAlgoCount;
    case ConvPass::kBackwardData:
      return kBwdDataAlgoCount;
    case ConvPass::kBackwardFilter:
      return kBwdFilterAlgoCount;
  }
  return 0;
}

// The exact algorithms are listed, not the others, so that a value outside the enums (a newer
// cuDNN's) is not taken for exact.
bool IsExactArithmetic(ConvPass pass, int algo) {
  switch (pass) {
    case ConvPass::kForward:
      return algo == int(FwdAlgo::kImplicitGemm) || algo == int(FwdAlgo::kImplicitPrecompGemm) ||
             algo == int(FwdAlgo::kGemm) || algo == int(FwdAlgo::kDirect);
    case ConvPass::kBackwardData:
      return algo == int(BwdDataAlgo::kAlgo0) || algo == int(BwdDataAlgo::kAlgo1);
    case ConvPass::kBackwardFilter:
      return algo == int(BwdFilterAlgo::kAlgo0) || algo == int(BwdFilterAlgo::kAlgo1) ||
             algo == int(BwdFilterAlgo::kAlgo3);
  }
  return false;
}

bool IsTensorOpMath(ConvMath math) {
  return math == ConvMath::kTensorOp || math == ConvMath::kTensorOpAllowConversion;
}

bool ConvAlgoAcceptable(ConvAlgoPolicy policy, ConvPass pass, int algo, ConvMath math) {
  if (algo < 0 || algo >= ConvAlgoCount(pass)) return false;
  if (policy == ConvAlgoPolicy::kFast) return true;
  return IsExactArithmetic(pass, algo) && !IsTensorOpMath(math);
}

ConvMath RankingMath(ConvAlgoPolicy policy) {
  return policy == ConvAlgoPolicy::kFast ? ConvMath::kTensorOp : ConvMath::kFma;
}

ConvMath RunMath(ConvAlgoPolicy policy, ConvMath ranked) {
  return policy == ConvAlgoPolicy::kFast ? ranked : ConvMath::kFma;
}

int FallbackConvAlgo(ConvPass pass) {
  switch (pass) {
    case ConvPass::kForward:
      return int(FwdAlgo::kImplicitGemm);
    case ConvPass::kBackwardData:
      return int(BwdDataAlgo::kAlgo1);
    case ConvPass::kBackwardFilter:
      return int(BwdFilterAlgo::kAlgo1);
  }
  return 0;
}

ConvAlgoChoice ChooseConvAlgo(ConvAlgoPolicy policy, ConvPass pass,
                              std::span<const ConvAlgoCandidate> ranked,
                              size_t max_workspace_bytes) {
  for (size_t i = 0; i < ranked.size(); ++i) {
    const ConvAlgoCandidate& c = ranked[i];
    if (!c.ok || !c.deterministic || c.workspace_bytes > max_workspace_bytes ||
        !ConvAlgoAcceptable(policy, pass, c.algo, c.math)) {
      continue;
    }
    ConvAlgoChoice choice;
    choice.algo = c.algo;
    choice.math = RunMath(policy, c.math);
    choice.workspace_bytes = c.workspace_bytes;
    choice.rank = int(i);
    return choice;
  }
  ConvAlgoChoice fallback;
  fallback.algo = FallbackConvAlgo(pass);
  fallback.math = ConvMath::kFma;
  fallback.fallback = true;
  return fallback;
}

}  // namespace cpd::runtime::cuda
