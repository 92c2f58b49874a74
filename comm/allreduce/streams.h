// The stochastic-rounding streams of the gradient all-reduce: which stage every rounding of a
// step belongs to and the seed of that stage's stream. Host and device code (CPD_HD), so that the
// CPU reducer (comm/allreduce/) and its device kernels (comm/reduce_kernels_cuda.cu) draw the
// same random bits for the same element. Internal to comm/.
#pragma once

#include <cstdint>

#include "kernels/grid.h"

namespace cpd::comm::internal {

// Every rounding of a step has its own stream: the rounding at `stage` uses QuantizeOptions{seed =
// RoundingSeed(options.seed, stage), step, index_offset = the element's index in the flat
// buffer}. With W workers:
//   stage w (0 <= w < W)              quantises worker w's contribution;
//   stage W + 4(w - 1) + j (1 <= w)   emulate's addition of worker w: j = 0 for the plain sum;
//                                     kahan: j is the KahanOp below;
//   stage 5W                          packed's re-quantisation of the sum.
CPD_HD std::uint64_t RoundingSeed(std::uint64_t seed, std::int64_t stage) {
  return kernels::SplitMix64(seed ^
                             kernels::SplitMix64(std::uint64_t(stage) ^ 0x9c6a1f3e5b7d2481ull));
}

enum KahanOp : int {
  kKahanY = 0,     // y = q_w - c
  kKahanT = 1,     // t = sum + y
  kKahanHigh = 2,  // t - sum
  kKahanC = 3,     // c = (t - sum) - y
};
CPD_HD constexpr std::int64_t ContributionStage(std::int64_t worker) { return worker; }
CPD_HD constexpr std::int64_t AdditionStage(int workers, int w, int op = 0) {
  return workers + 4 * std::int64_t(w - 1) + op;
}
CPD_HD constexpr std::int64_t RequantizeStage(int workers) { return 5 * std::int64_t(workers); }

}  // namespace cpd::comm::internal
