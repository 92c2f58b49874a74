// What cpdctl prints: aligned tables, numbers for humans, CSV fields, the proto messages as JSON,
// one-line summaries of schedules, and the ordering of per-layer rows. No I/O and no RPCs here,
// so all of it is testable without a coordinator.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cpd/status.h"
#include "proto/cpd/v1/coordinator.pb.h"

namespace cpd::ctl {

// A text table whose columns are as wide as their widest cell, separated by two spaces, with no
// trailing blanks. Text columns align left, numbers right.
class Table {
 public:
  enum class Align { kLeft, kRight };
  struct Column {
    std::string header;
    Align align = Align::kLeft;
  };

  explicit Table(std::vector<Column> columns) : columns_(std::move(columns)) {}
  // REQUIRES: cells.size() == the number of columns.
  void AddRow(std::vector<std::string> cells);
  size_t rows() const { return rows_.size(); }
  // The header line and at most `max_rows` rows (all when negative), each ending in '\n'.
  std::string Render(long max_rows = -1) const;

 private:
  std::vector<Column> columns_;
  std::vector<std::vector<std::string>> rows_;
};

// printf("%.<digits>g"); "nan"/"inf" as such.
std::string FormatG(double v, int digits = 3);
// A fraction as a percentage with 3 significant digits: 0 -> "0%", 0.0123 -> "1.23%".
std::string FormatPercent(double fraction);
// An accuracy in [0, 1] as "85.20%"; negative (not measured) -> "-".
std::string FormatAccuracy(double fraction);
// Whether a validation loss, perplexity or bits per byte was measured: negative is "none", and
// so is 0, what a coordinator or worker older than these fields sends; NaN and inf (a model that
// diverged) are measurements. A job with a perplexity is a language model: cpdctl shows its
// perplexity (and bits per byte) where it shows a vision model's accuracy.
bool Measured(double v);
// A validation figure with `decimals` decimals ("nan"/"inf" as such); "-" when not Measured.
std::string FormatMeasured(double v, int decimals);
// A language model's validation as the status block shows it: "5.75 (validation; 2.524
// bits/byte, loss 1.7500)", each part only when measured.
std::string ValidationSummary(double perplexity, double bits_per_byte, double loss);
// A duration in milliseconds: "850 ms", "12.3 s", "4 min 05 s", "2 h 10 min", "3 d 4 h".
std::string FormatDuration(int64_t ms);
// Milliseconds since the Unix epoch as local time "YYYY-MM-DD HH:MM:SS"; 0 -> "-".
std::string FormatTime(int64_t unix_ms);
// The shortest decimal that reads back as the same double (std::to_chars).
std::string ShortestDouble(double v);

// "W", "A", "E", "G", "COMM" (SITE_UNSPECIFIED and unknown numbers: "?").
std::string SiteName(cpd::v1::Site site);
// Accepts W A E G COMM in either case.
std::optional<cpd::v1::Site> ParseSite(std::string_view name);

// A proto message as JSON with the proto's field names, every field present (defaults too),
// 64-bit integers as JSON numbers (unlike proto3's canonical mapping, which quotes them) and
// enums by their value names.
nlohmann::json ToJson(const google::protobuf::Message& message);

// "CPT 3-8 bits x32, E 8 bits; W=e4m3 A=e4m3; 2 overrides; fp32: last; hysteresis" or "static".
std::string ScheduleSummary(const cpd::v1::PrecisionSchedule& s);
// A multi-line description of a schedule, one "key  value" line per part.
std::string ScheduleDetails(const cpd::v1::PrecisionSchedule& s);
// One "key  value" line per pair, the values aligned two spaces after the longest key.
std::string KeyValues(const std::vector<std::pair<std::string, std::string>>& kv);

// A study's runs counted by state, as `cpdctl study` shows them.
struct StudyTally {
  std::string study;
  int runs = 0, running = 0, stale = 0, finished = 0;
};
// One tally per study among `jobs` (untagged jobs are in none), ordered by study name.
std::vector<StudyTally> TallyStudies(const cpd::v1::ListJobsResponse& jobs);

// One per-layer row of a report.
struct LayerRow {
  const cpd::v1::StatsReport* report = nullptr;
  const cpd::v1::LayerStat* stat = nullptr;
  size_t order = 0;  // position in the reports as received (the model's order)
};

// The sort keys of `cpdctl layers --sort`.
const std::vector<std::string>& LayerSortKeys();
// Orders rows by `key`: "layer" (name, then site W A E G COMM), "site" (site, then the model's
// order), or a number, largest first: "max" (max|x|), "saturated", "flushed", "error"
// (rel_error; unmeasured last), "shift" (APS shift). Ties keep the model's order; rows of earlier
// steps come first. InvalidArgument for another key.
Status SortLayerRows(std::vector<LayerRow>* rows, std::string_view key);
// The table of `cpdctl layers` and `cpdctl watch --layers`; a STEP column when `with_step`.
Table LayerTable(const std::vector<LayerRow>& rows, bool with_step);

}  // namespace cpd::ctl
