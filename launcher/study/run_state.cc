#include "launcher/study/run_state.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "launcher/cli.h"
#include "launcher/files.h"

namespace cpd::launcher::study {

Result<RunState> ReadState(const std::string& path) {
  RunState s;
  if (::access(path.c_str(), F_OK) != 0) return s;
  CPD_ASSIGN_OR_RETURN(const std::string text, ReadWholeFile(path));
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    s.state = j.at("state").get<std::string>();
    s.exit_code = j.value("exit_code", -1);
    s.start_ms = j.value("start_ms", int64_t{0});
    s.end_ms = j.value("end_ms", int64_t{0});
    s.wall_s = j.value("wall_s", 0.0);
    s.total_wall_s = j.value("total_wall_s", 0.0);
    s.attempts = j.value("attempts", 0);
    s.host = j.value("host", std::string());
    s.pid = j.value("pid", 0L);
  } catch (const nlohmann::json::exception& e) {
    return Status::Corruption(path + ": not a cpd-study state file: " + e.what());
  }
  if (s.state != "running" && s.state != "done" && s.state != "failed") {
    return Status::Corruption(path + ": unknown state '" + s.state + "'");
  }
  return s;
}

Status WriteState(const std::string& path, const RunState& s) {
  nlohmann::json j = {
      {"state", s.state},       {"exit_code", s.exit_code}, {"start_ms", s.start_ms},
      {"end_ms", s.end_ms},     {"wall_s", s.wall_s},       {"total_wall_s", s.total_wall_s},
      {"attempts", s.attempts}, {"host", s.host},           {"pid", s.pid}};
  return WriteFileAtomically(path, j.dump(1) + "\n");
}

std::string HostName() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

namespace {

// Whether process `pid` exists and is not a zombie (a killed run-one whose parent died too stays
// one until init reaps it, and in a container nothing may).
bool Alive(long pid) {
  if (pid <= 0 || (::kill(pid_t(pid), 0) != 0 && errno != EPERM)) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  std::getline(stat, text);
  const size_t paren = text.rfind(')');
  if (paren == std::string::npos || paren + 2 >= text.size()) return true;  // no /proc: trust kill
  const char state = text[paren + 2];
  return state != 'Z' && state != 'X';
}

}  // namespace

std::string Classify(const RunState& s) {
  if (s.state != "running") return s.state;
  if (s.host != HostName()) return "running";  // another machine's process: cannot check it
  return Alive(s.pid) ? "running" : "interrupted";
}

std::string LastErrorLine(const std::string& log_path) {
  std::ifstream in(log_path, std::ios::binary);
  if (!in) return "";
  // The tail is enough: the error is among the last lines, and logs of long runs are large.
  constexpr std::streamoff kTail = 64 * 1024;
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  in.seekg(size > kTail ? size - kTail : 0);
  std::string line, last, error;
  while (std::getline(in, line)) {
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
    if (line.empty() || line.rfind("=== cpd-study", 0) == 0) continue;
    last = line;
    if (line.rfind("cpd-train:", 0) == 0 || line.find("error") != std::string::npos ||
        line.find("Error") != std::string::npos) {
      error = line;
    }
  }
  return error.empty() ? last : error;
}

int PrintStatus(const Study& study, const std::vector<PlannedRun>& runs, const std::string& out) {
  std::map<std::string, int> totals;
  int rc = 0;
  for (const PlannedRun& r : runs) {
    const RunPaths p = PathsOf(out, r.name);
    auto s = ReadState(p.state);
    if (!s.ok()) {
      std::fprintf(stderr, "cpd-study: %s\n", s.status().message().c_str());
      rc = 1;
      continue;
    }
    const std::string what = Classify(*s);
    ++totals[what];
    char detail[96] = "";
    if (what == "done") {
      std::snprintf(detail, sizeof detail, "  %.1f s", s->total_wall_s);
    } else if (what == "running") {
      std::snprintf(detail, sizeof detail, "  pid %ld on %s", s->pid, s->host.c_str());
    } else if (what == "failed") {
      std::snprintf(detail, sizeof detail, "  exit %d", s->exit_code);
    }
    std::string line =
        what + std::string(12 - std::min<size_t>(11, what.size()), ' ') + r.name + detail;
    if (what == "failed") {
      const std::string why = LastErrorLine(p.log);
      if (!why.empty()) line += ": " + why;
    }
    std::printf("%s\n", line.c_str());
  }
  std::printf("%s: %zu runs: %d done, %d running, %d failed, %d interrupted, %d pending\n",
              study.name.c_str(), runs.size(), totals["done"], totals["running"], totals["failed"],
              totals["interrupted"], totals["pending"]);
  return rc;
}

}  // namespace cpd::launcher::study
