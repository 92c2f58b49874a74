// A run's state file (<run>/state.json), written atomically by whoever runs it, and what
// `cpd-study status` makes of it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cpd/status.h"
#include "launcher/study/plan.h"

namespace cpd::launcher::study {

struct RunState {
  std::string state = "pending";     // pending (no file) | running | done | failed
  int exit_code = -1;                // of the last attempt (done: 0)
  int64_t start_ms = 0, end_ms = 0;  // the last attempt, Unix epoch milliseconds
  double wall_s = 0;                 // the last attempt
  double total_wall_s = 0;           // every attempt's, summed
  int attempts = 0;
  std::string host;  // where the last attempt ran
  long pid = 0;      // of the process that runs it (cpd-study run-one), while running
};

// The state in `path`; "pending" when there is no file. A file that cannot be parsed is an
// error naming it.
Result<RunState> ReadState(const std::string& path);
Status WriteState(const std::string& path, const RunState& s);

std::string HostName();

// What a run is now: done, failed, running (state running, and its pid is alive on this host, or
// it runs on another host), interrupted (state running, its process gone: `run` resumes it from
// its checkpoints), pending.
std::string Classify(const RunState& s);

// The line of a failed run's log that says why: the last line cpd-train wrote about an error
// ("cpd-train: ...", "error"), else the last non-empty line; read from the end of the file only.
std::string LastErrorLine(const std::string& log_path);

// `cpd-study status`: one line per run, then the totals. Returns 0, or 1 when a state file
// cannot be read (named on stderr).
int PrintStatus(const Study& study, const std::vector<PlannedRun>& runs, const std::string& out);

}  // namespace cpd::launcher::study
