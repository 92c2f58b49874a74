// The study file of cpd-study: a YAML description of a grid of cpd-train runs (name, ranks per
// run, base flags, grid axes, seeds, excluded combinations). Loading checks its shape and that
// every key names a real cpd-train flag (looked up in the option set AddTrainOptions builds, so
// there is no second list); the runs themselves are checked when the plan expands them.
#pragma once

#include <string>
#include <vector>

#include "cpd/status.h"
#include "launcher/train_flags.h"

namespace cpd::launcher::study {

// The special axis (or base key) "workers": logical workers W of a run; cpd-study passes
// --emulate-ranks W / ranks.
inline constexpr const char* kWorkersKey = "workers";

// One value of an axis or a base key: the values given to the flag (a YAML list gives several,
// e.g. cyclic-bits: [3, 8]). A boolean flag's value is "true" or "false".
using FlagValue = std::vector<std::string>;

struct Axis {
  std::string name;  // a cpd-train long flag name without dashes, or "workers"
  bool boolean = false;
  std::vector<FlagValue> values;  // non-empty, distinct
};

// One "exclude:" entry: runs whose axis (or "seed") values all equal these are dropped.
struct Exclusion {
  std::vector<std::pair<std::string, std::string>> match;  // key -> value as the name shows it
};

struct Study {
  std::string path;                // the file it came from (messages)
  std::string name;                // [A-Za-z0-9._-]{1,64}, not "." or ".."
  int ranks = 1;                   // mpirun -np per run
  std::vector<ConfigEntry> base;   // flags of every run, in file order ("workers" may be one)
  std::vector<bool> base_boolean;  // per base entry: a boolean flag
  std::vector<Axis> axes;          // the grid, in file order
  std::vector<long long> seeds;    // non-empty, distinct
  std::vector<Exclusion> exclude;
};

// The flags cpd-study sets itself on every run; a study file that sets one is rejected.
const std::vector<std::string>& DriverOwnedFlags();

// Parses and checks a study file: unknown keys, unknown flags, a key repeated in any mapping
// (named with its line), a name that is not a folder of its own ("." or ".."), flags with which
// cpd-train trains nothing (print-model, help, version), empty or repeated axes and values,
// booleans that are not true/false, workers not divisible by ranks. Errors are InvalidArgument,
// one line starting with the file's path and naming the key.
Result<Study> LoadStudy(const std::string& path);
Result<Study> ParseStudy(const std::string& yaml, const std::string& path);

// A run name's spelling of an axis value: booleans on/off, lists joined with '-', and every
// character outside [A-Za-z0-9.-] turned into '-' (names are directory and coordinator job
// names).
std::string ValueLabel(const FlagValue& v, bool boolean);

}  // namespace cpd::launcher::study
