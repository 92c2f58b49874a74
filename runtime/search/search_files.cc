#include "runtime/search/search_files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

namespace cpd::runtime {

namespace {

using nlohmann::json;

constexpr char kSettingsPrefix[] = "# cpd-format-search: ";
// What every refusal of a partial file tells the user to do: the rows cannot be trusted for this
// search, and the tool never deletes a file itself.
constexpr char kStartAgain[] =
    "; rerun without --resume, with another --out or after removing the file";

std::string Hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

// A JSON value for a message: strings quoted and escaped, anything else as JSON, shortened.
std::string ShowValue(const json& v) {
  if (v.is_string()) return QuoteForMessage(v.get<std::string>());
  const std::string text = v.dump(-1, ' ', true, json::error_handler_t::replace);
  return text.size() > 48 ? text.substr(0, 45) + "..." : text;
}

// The settings line's JSON object (an empty object for empty settings).
json SettingsObject(const FormatSearchOptions& o) {
  json j = o.settings.empty() ? json::object() : json::parse(o.settings, nullptr, false);
  std::vector<std::string> specs;
  for (const std::string& spec : o.candidates) {
    auto f = Format::Parse(spec);
    specs.push_back(f.ok() ? f->spec() : spec);
  }
  std::sort(specs.begin(), specs.end());
  uLong crc = crc32(0L, Z_NULL, 0);
  for (const std::string& s : specs) {
    crc = crc32(crc, reinterpret_cast<const Bytef*>(s.data()), uInt(s.size()));
    crc = crc32(crc, reinterpret_cast<const Bytef*>("\n"), 1);
  }
  j["candidates"] = specs.size();
  j["candidates_crc32"] = Hex32(uint32_t(crc));
  return j;
}

// Why the settings line `line` (line 1 of `path`) does not bind the file to this search, or "".
std::string SettingsMismatch(const std::string& path, std::string_view line,
                             const FormatSearchOptions& o) {
  const std::string prefix = kSettingsPrefix;
  if (line.substr(0, prefix.size()) != prefix) {
    return path + ":1: not a cpd-format-search partial file (its first line is " +
           QuoteForMessage(line) + ")" + kStartAgain;
  }
  const json there = json::parse(line.substr(prefix.size()), nullptr, false);
  if (!there.is_object()) {
    return path + ":1: the settings line is not a JSON object" + kStartAgain;
  }
  const json here = SettingsObject(o);
  for (const auto& [key, value] : here.items()) {
    if (!there.contains(key)) {
      return path + " was written by an older cpd-format-search: its settings line has no " + key +
             ", so it does not bind its rows to the checkpoint's contents and the " + "candidates" +
             kStartAgain;
    }
  }
  for (const auto& [key, value] : there.items()) {
    if (!here.contains(key)) {
      return path + ":1: its settings name " + QuoteForMessage(key) +
             ", which this search does not have" + kStartAgain;
    }
  }
  for (const auto& [key, value] : here.items()) {
    const json& old = there[key];
    if (old == value) continue;
    std::string what = key;
    if (key.rfind("checkpoint", 0) == 0) what = "the checkpoint's contents (" + key + ")";
    if (key.rfind("candidates", 0) == 0) what = "the candidates (" + key + ")";
    return path + " holds the rows of another search: " + what + " " + ShowValue(old) + " there, " +
           ShowValue(value) + " here" + kStartAgain;
  }
  return "";
}

}  // namespace

Result<std::string> ReadBoundedFile(const std::string& path, size_t max_bytes,
                                    const std::string& what) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; fstat refuses it before any read.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return Status::InvalidArgument(what + ": cannot open it: " + std::strerror(errno));
  struct stat sb;
  if (::fstat(fd, &sb) != 0) {
    const std::string err = std::strerror(errno);
    ::close(fd);
    return Status::InvalidArgument(what + ": cannot read it: " + err);
  }
  if (!S_ISREG(sb.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument(what + (S_ISDIR(sb.st_mode) ? " is a directory" : "") +
                                   (S_ISDIR(sb.st_mode) ? "" : " is not a regular file") +
                                   "; give a file");
  }
  if (uint64_t(sb.st_size) > max_bytes) {
    ::close(fd);
    return Status::InvalidArgument(what + " is " + std::to_string(sb.st_size) + " bytes; at most " +
                                   std::to_string(max_bytes) + " are read");
  }
  std::string text;
  // One byte more than allowed: a file that grew since fstat is refused, not cut.
  text.resize(max_bytes + 1 > size_t(sb.st_size) + 1 ? size_t(sb.st_size) + 1 : max_bytes + 1);
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t r = ::read(fd, text.data() + got, text.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const std::string err = std::strerror(errno);
      ::close(fd);
      return Status::InvalidArgument(what + ": cannot read it: " + err);
    }
    if (r == 0) break;
    got += size_t(r);
    if (got == text.size() && got <= max_bytes) text.resize(std::min(max_bytes + 1, got * 2));
  }
  ::close(fd);
  if (got > max_bytes) {
    return Status::InvalidArgument(what + " is larger than " + std::to_string(max_bytes) +
                                   " bytes, the most that is read");
  }
  text.resize(got);
  return text;
}

Result<std::vector<CandidateLine>> ParseCandidateList(const std::string& name,
                                                      std::string_view text) {
  std::vector<CandidateLine> out;
  int line = 0;
  size_t start = 0;
  while (start < text.size()) {
    ++line;
    const size_t nl = std::min(text.find('\n', start), text.size());
    std::string_view l = text.substr(start, nl - start);
    start = nl + 1;
    for (size_t i = 0; i < l.size(); ++i) {
      const unsigned char c = static_cast<unsigned char>(l[i]);
      if ((c < 0x20 && c != '\t' && c != '\r') || c == 0x7f) {
        return Status::InvalidArgument(name + ":" + std::to_string(line) + ": byte " +
                                       QuoteForMessage(l.substr(i, 1)) + " at column " +
                                       std::to_string(i + 1) + ": not a text file of format specs");
      }
    }
    l = l.substr(0, l.find('#'));
    const size_t b = l.find_first_not_of(" \t\r");
    if (b == std::string_view::npos) continue;
    const size_t e = l.find_last_not_of(" \t\r");
    out.push_back({line, std::string(l.substr(b, e - b + 1))});
  }
  if (out.empty()) {
    return Status::InvalidArgument(
        name +
        " names no format (it is empty or holds only comments and blank lines); give one "
        "format spec a line");
  }
  return out;
}

std::string PartialSettingsLine(const FormatSearchOptions& o) {
  return kSettingsPrefix + SettingsObject(o).dump(-1, ' ', true, json::error_handler_t::replace);
}

Result<PartialResults> ParsePartialResults(const std::string& path, std::string_view text,
                                           const FormatSearchOptions& o,
                                           const std::vector<std::string>& layers) {
  PartialResults out;
  std::set<std::string> candidates;
  for (const std::string& spec : o.candidates) {
    auto f = Format::Parse(spec);
    if (f.ok()) candidates.insert(f->spec());
  }
  const std::string header = ResultsCsvHeader(layers, o.indicator.sites);
  const std::string incomplete =
      path + " is empty or ends before its column header (line 2)" + std::string(kStartAgain);
  std::map<std::string, int> seen;  // canonical spec -> its line
  int line = 0;
  size_t start = 0;
  while (start < text.size()) {
    ++line;
    const size_t nl = text.find('\n', start);
    const bool whole = nl != std::string_view::npos;
    const std::string_view row = text.substr(start, (whole ? nl : text.size()) - start);
    if (!whole && line > 2) break;  // a row torn by a crash: left out, evaluated again
    start = whole ? nl + 1 : text.size();
    out.complete_bytes = start;
    const std::string where = path + ":" + std::to_string(line) + ": ";
    if (line == 1) {
      const std::string why = SettingsMismatch(path, row, o);
      if (!why.empty()) return Status::InvalidArgument(why);
      if (!whole) return Status::InvalidArgument(incomplete);
      continue;
    }
    if (line == 2) {
      if (row != header) {
        return Status::InvalidArgument(
            where + "the column header is not this search's (other layers or --sites)" +
            kStartAgain);
      }
      if (!whole) return Status::InvalidArgument(incomplete);
      continue;
    }
    if (row.empty()) continue;
    auto r = ParseResultRow(std::string(row), layers, o.indicator.sites);
    if (!r.ok()) return Status::InvalidArgument(where + r.status().message());
    if (candidates.count(r->spec) == 0) {
      return Status::InvalidArgument(where + QuoteForMessage(r->spec) +
                                     " is not a candidate of this search");
    }
    const auto [it, fresh] = seen.emplace(r->spec, line);
    if (!fresh) {
      return Status::InvalidArgument(where + QuoteForMessage(r->spec) + " has a row on line " +
                                     std::to_string(it->second) +
                                     " already; a candidate has one row");
    }
    out.rows.push_back(std::move(r).value());
  }
  if (line < 2) return Status::InvalidArgument(incomplete);
  return out;
}

}  // namespace cpd::runtime
