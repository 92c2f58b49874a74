// The format-quality search (Lee, Park, Jeon, ICLR 2022, §2.4): the gradient-angle indicator
// (runtime/search/indicator.h) of every candidate format over the same N mini-batches of a
// trained model, as a collective over the ranks of a communicator.
//
// Work: the candidates are cut into groups (FormatSearchOptions::group each); in round k, rank r
// evaluates group k*P + r over all N batches (one fp32 pass per batch shared by the group), then
// the round's results are gathered on rank 0, which appends them to the partial-results file.
// Every candidate sees the same batches and the same random streams whatever the rank count and
// the grouping, so its angles depend only on the model, the data, the options and the thread
// count of its rank (CPU sums are ordered per thread count).
//
// Resume: the partial file (runtime/search/search_files.h) starts with a line binding it to the
// search's settings and candidates; a resumed search refuses a file of another search or with a
// row that is not a valid result of this one, and skips the candidates it already holds.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "cpd/format.h"
#include "cpd/status.h"
#include "runtime/nn/layers.h"
#include "runtime/search/indicator.h"
#include "runtime/train/data.h"

namespace cpd::runtime {

// One candidate's indicator: per site set asked for, the network angle's mean and standard
// deviation over the batches, and the same per layer. Degrees.
struct CandidateResult {
  std::string spec;
  int bits = 0;
  std::string family;
  bool has[kNumSiteSets] = {false, false, false};
  double mean[kNumSiteSets] = {0, 0, 0};
  double std[kNumSiteSets] = {0, 0, 0};
  std::vector<double> layer_mean[kNumSiteSets];
  std::vector<double> layer_std[kNumSiteSets];
};

struct FormatSearchOptions {
  std::vector<std::string> candidates;  // format specs; REQUIRED non-empty, each parses
  IndicatorOptions indicator;
  int64_t batches = 100;     // N >= 1
  int64_t batch_size = 128;  // >= 1
  uint64_t data_seed = 1;    // the shuffle of the training set that picks the N batches
  int group = 8;             // candidates per rank per round, >= 1
  // Rank 0 appends each round's results here ("": nowhere). With `resume`, candidates already
  // in the file are skipped; without it, an existing file is an error (nothing is overwritten).
  // The file is created whole (its settings line and header at once) and grows by whole rows.
  std::string partial_path;
  bool resume = false;
  // A JSON object ("" for none) naming everything besides the candidates that determines a row:
  // the checkpoint's contents, the data, batches, seed, sites, rounding. Stored, with the
  // candidates' count and CRC, in the partial file and compared key by key on resume.
  std::string settings;
  // Rank 0 prints progress lines (rounds done, ETA): one when at least progress_interval_s
  // seconds and a tenth of the rounds have passed since the last, and the last round's
  // (cpd::ProgressLineRate), so a log holds at most 10.
  bool progress = true;
  double progress_interval_s = 30;
};

// A short family name for tables and plots: "fixed", "float", "hybrid" or "log" for binade
// lists, else the format family ("float", "shared-exponent", "block", "int", "uint", "fp32").
std::string CandidateFamily(const Format& format);

// Checks the options (the candidates parse and are distinct, N, batch size and group are
// positive, a site set is given, the settings are a JSON object); no work is done. Errors name the
// flag. (Whether the partial file fits `resume` is rank 0's to check, in RunFormatSearch: only it
// reads the file.)
Status CheckFormatSearch(const FormatSearchOptions& options);

// Collective over `comm`'s ranks (every rank passes the same options). `model` holds the trained
// parameters on `device`; `train` is the normalised training set. Returns, on rank 0, the
// results of every candidate in the order of options.candidates (resumed ones included); on the
// other ranks an empty vector. A partial file that exists without `resume`, or that
// ParsePartialResults refuses, is an InvalidArgument on every rank; a row torn by a crash at its
// end is cut off the file and evaluated again.
Result<std::vector<CandidateResult>> RunFormatSearch(Sequential* model, Device device,
                                                     const Dataset& train, comm::Communicator* comm,
                                                     const FormatSearchOptions& options);

// The results as CSV: a header naming, per site set, the network angle and its spread, then
// per layer and site set the same; one row per candidate.
std::string ResultsCsvHeader(const std::vector<std::string>& layers,
                             const std::vector<SiteSet>& sites);
std::string ResultCsvRow(const CandidateResult& r, const std::vector<SiteSet>& sites);
// Reads a row back (for resume); `layers` and `sites` must be those the header was written with.
// Every field is checked: the field count, a spec that parses (the result's spec is its canonical
// form), bits that are a whole number equal to the format's, a known family that is the
// format's (CandidateFamily), and angles and spreads that are whole numbers, finite and within
// [0, 180] degrees (GradientAngle's range). InvalidArgument, one line naming the column.
Result<CandidateResult> ParseResultRow(const std::string& row,
                                       const std::vector<std::string>& layers,
                                       const std::vector<SiteSet>& sites);

}  // namespace cpd::runtime
