// The output folder of a study (--out, default studies/<name>): cpd-study writes only into a
// folder it created, so that `run` and `report` never replace a file of the user's (a study
// named ".." once put its report over ./report/runs.csv).
//
// The folder is marked by the file <out>/.cpd-study (the study's name, written atomically) when
// cpd-study first writes into it. A folder with the marker is cpd-study's, and so is everything
// under runs/, report/ and slurm/ in it. Before anything is written, a folder without the marker
// is claimed only when it is new or empty, or when it holds nothing but the folders cpd-study
// makes (runs/, with report/ and slurm/ beside it: the output of a cpd-study from before the
// marker); any other existing folder is refused with one line, and nothing is written in it.
#pragma once

#include <string>

#include "cpd/status.h"

namespace cpd::launcher::study {

inline constexpr const char* kOutMarker = ".cpd-study";

// Makes `out` cpd-study's output folder of `study_name` (above), creating it when missing.
// InvalidArgument naming the folder when it is not cpd-study's; IoError when it cannot be
// created or marked. Safe to call from several processes at once.
Status ClaimOutDir(const std::string& out, const std::string& study_name);

}  // namespace cpd::launcher::study
