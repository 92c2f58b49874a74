// The files a format search reads (runtime/search/format_search.h): the candidate list a user
// writes (cpd-format-search --candidates-file) and the partial results a search appends as it
// goes (PREFIX.partial.csv), read back on --resume with every field checked. A bad file is one
// InvalidArgument line naming the file, the line and the problem; what the file holds is quoted
// shortened and escaped (cpd/message.h QuoteForMessage), never raw. Nothing here writes.
//
// The partial-results file:
//   line 1   "# cpd-format-search: " + a JSON object: the search's settings (everything that
//            determines a row: the checkpoint's contents, the data, batches, seed, sites,
//            rounding; FormatSearchOptions::settings) plus the candidates' count and CRC-32
//   line 2   ResultsCsvHeader(layers, sites)
//   line 3.. ResultCsvRow of each finished candidate, each ended by '\n'
// A last line without its '\n' is a row a crash cut short: it is left out (and re-evaluated).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "cpd/message.h"
#include "cpd/status.h"
#include "runtime/search/format_search.h"

namespace cpd::runtime {

// The most of a --candidates-file that is read: thousands of specs, far more than a search runs.
constexpr size_t kMaxCandidatesFileBytes = size_t(1) << 20;
// The most of a partial-results file that is read: thousands of candidate rows of a model with
// hundreds of layers.
constexpr size_t kMaxPartialFileBytes = size_t(64) << 20;

// The whole of the regular file `path`, read only when it is at most `max_bytes`. `what` starts
// every message (e.g. "--candidates-file 'c.txt'"). InvalidArgument when the file cannot be
// opened, is a directory, is not a regular file (a device such as /dev/zero, a FIFO: opened
// without blocking, never read) or is larger than `max_bytes`.
Result<std::string> ReadBoundedFile(const std::string& path, size_t max_bytes,
                                    const std::string& what);

struct CandidateLine {
  int line = 0;      // 1-based
  std::string spec;  // as written, blanks around it removed; not parsed here
};

// The format specs of a candidates file's `text`, one a line in order ('#' starts a comment;
// blank lines and the blanks around a spec are ignored). `name` starts every message.
// InvalidArgument "NAME:LINE: ..." for a byte that is no text (a control byte other than TAB and
// CR, such as NUL), "NAME names no format ..." when no line does (empty or only comments).
Result<std::vector<CandidateLine>> ParseCandidateList(const std::string& name,
                                                      std::string_view text);

// Line 1 of the partial file of a search with options `o`: its settings with the candidates'
// count and the CRC-32 of their sorted canonical specs (so that the order of --format flags does
// not matter). `o` must pass CheckFormatSearch.
std::string PartialSettingsLine(const FormatSearchOptions& o);

struct PartialResults {
  std::vector<CandidateResult> rows;  // in file order, specs canonical
  size_t complete_bytes = 0;          // the length of `text` without a torn last row
};

// Reads back the partial file `text` (named `path` in messages) for a resumed search with
// options `o` over the model layers `layers`. Refused, InvalidArgument, one line each:
//  * line 1 that is not PartialSettingsLine(o): not a partial file, a file of an older
//    cpd-format-search (which bound neither the checkpoint's contents nor the candidates), or a
//    file of a search whose settings differ (the first differing setting is named, with its
//    value there and here);
//  * line 2 that is not this search's CSV header (other layers or site sets);
//  * a complete row that ParseResultRow refuses, whose spec is not one of o.candidates or that
//    repeats a candidate of an earlier row ("PATH:LINE: what is wrong").
Result<PartialResults> ParsePartialResults(const std::string& path, std::string_view text,
                                           const FormatSearchOptions& o,
                                           const std::vector<std::string>& layers);

}  // namespace cpd::runtime
