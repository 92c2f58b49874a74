// A performance model of the gradient all-reduce: predicts the time of MPI's float32 all-reduce
// and of the packed algorithm (comm/allreduce/packed.cc) for any world size, gradient size and
// format from a few measured parameters, and the training step's speed-up from it. The APS paper
// argues for such a model (communication time from the bytes on the wire, plus the cost of
// quantising); this one follows the packed algorithm stage by stage.
//
// Cost of the wire (Hockney's alpha-beta model, one message of m bytes costs alpha + m / beta):
//   MPI_Allreduce fp32, ring      2 (P-1) (alpha + m / beta),  m = 4 N / P
//                                 plus (P-1)/P N float32 additions
//   packed: all-to-all and all-gather of the codes, each a direct exchange with the P-1 peers,
//           charged as the pairwise exchange: (P-1) (alpha + m / beta), m = N b / (8 P),
//           per round of the pipelined schedule (round r of R carries m / R per peer).
// Cost of the element loops (seconds per element, one thread, CodecCost, measured by timing the
// loops themselves), per rank: APS scan of N, encode of N, decode + add of N (P contributions of
// N / P), re-encode of N / P, decode of N; divided by Host::Parallelism() (threads per rank, or
// fewer than one core per rank where ranks outnumber cores). The small per-step MAX all-reduce of
// the APS shifts costs 2 ceil(log2 P) alpha.
// Overlap: the sequential schedule adds compute and wire. The pipelined one (R rounds, each a
// slice of every chunk) runs a round's element loops while the previous round is on the wire,
// which costs (R - 1) steps of max(compute, wire) / R plus one round of each alone to fill and
// drain the pipeline (R = 1: compute + wire). With the paper's APS scaling the all-to-all and the
// all-gather interleave (a round is gathered as soon as it is summed): one overlap over all the
// loops and both exchanges. With APS sum scaling the
// shifts t need the whole chunk's sums: the all-to-all overlaps encode + decode-add, then the
// all-gather overlaps re-encode + decode. Where the ranks of a host have no idle core
// (Host::Overlaps() false), the host's CPUs also move the bytes (TCP), and the model adds compute
// and wire as in the sequential schedule.
// What it leaves out: contention between concurrent messages beyond the per-rank link (a
// non-blocking switch is assumed), the operating system's own noise, cache effects of sizes
// below the last-level cache. docs/studies/perf-model.md validates it against measured times.
#pragma once

#include <cstddef>
#include <string>

#include "cpd/status.h"

namespace cpd::comm::perf {

// One rank's link: alpha, the start-up time of a message (s); beta, the bandwidth in each
// direction (bytes/s; full duplex).
struct Link {
  double alpha_s = 0.0;
  double beta_bytes_per_s = 0.0;
};

// Seconds per element of the all-reduce's element loops on one thread, for one format.
struct CodecCost {
  double scan = 0.0;        // max|g| / non-finite scan of the input (APS)
  double encode = 0.0;      // shift, round and pack one element
  double decode_add = 0.0;  // decode one code and add it to a float32 sum
  double decode = 0.0;      // decode one code and undo the shift
  double add = 0.0;         // one float32 addition of MPI's reduction (read two, write one)
};

// The ranks that share one host's cores.
struct Host {
  int ranks = 1;    // ranks on the host
  int cores = 1;    // cores of the host
  int threads = 1;  // element-loop threads per rank
  // Cores' worth of compute one rank gets: min(threads, cores / ranks), below 1 when ranks
  // outnumber cores.
  double Parallelism() const;
  // Whether a core is left for the network stack while every rank computes.
  bool Overlaps() const { return ranks * threads < cores; }
};

struct Case {
  int world = 2;             // P, ranks in the all-reduce
  std::size_t elements = 0;  // N, float32 gradient elements
  int bits = 8;              // b, bits per code of the format (packed)
  bool aps = true;           // the scan and the MAX all-reduce of the shifts
  bool sum_scaling = false;  // APS sum scaling (packed's default with APS)
  int rounds = 0;            // R, rounds of the pipelined schedule; 0 = sequential
};

// A prediction and its parts (seconds). total is what a caller compares with a measurement;
// compute and wire are the stage sums before any overlap.
struct Prediction {
  double total = 0.0;
  double compute = 0.0;  // element loops of one rank
  double wire = 0.0;     // its messages, start-ups included
};

// MPI_Allreduce of N float32 values, ring algorithm (the header comment).
Prediction PredictFp32Ring(const Case& c, const Link& link, const CodecCost& cost,
                           const Host& host);
// The packed algorithm with fixed-grid codes of c.bits bits (the header comment).
Prediction PredictPacked(const Case& c, const Link& link, const CodecCost& cost, const Host& host);

// The rounds of the pipelined schedule for one bucket of N elements over P ranks, with
// pipeline_kb KiB of codes per contribution per round (GradientAllReduceOptions::pipeline_kb;
// 0 = sequential), as comm/allreduce/codes.cc chooses them: one round per pipeline_kb of a
// chunk's codes, at most one per piece of the algorithm's element loops.
int PipelineRounds(std::size_t elements, int world, int bits, int pipeline_kb);

// Measures CodecCost for `format` (a fixed float grid of <= 16 bits: the packed codes) by timing
// the all-reduce's own element loops (comm/reduce_kernels.h) on one thread over `elements`
// N(0, 1) values, piece by piece as the algorithm runs them, nearest rounding; the median of
// `reps` runs. InvalidArgument for other formats or elements < 1.
Result<CodecCost> MeasureCodecCost(const std::string& format, std::size_t elements, int reps);

// The element loops' cost where they run at memory bandwidth (a GPU's kernels): every loop's
// bytes read and written per element (scan 4; encode 4 + b/8; decode + add b/8 + 8; decode
// b/8 + 4; add 12) over bytes_per_s.
CodecCost MemoryBoundCost(int bits, double bytes_per_s);

// Speed-up of a training step whose compute (forward + backward + update) takes compute_s and
// whose gradient all-reduce is not overlapped with it: (compute + base) / (compute + candidate).
double StepSpeedup(double compute_s, double base_allreduce_s, double candidate_allreduce_s);

}  // namespace cpd::comm::perf
