#include "launcher/study/run_state.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>

#include "launcher/cli.h"
#include "launcher/common.h"
#include "launcher/files.h"

namespace cpd::launcher::study {

namespace {

using nlohmann::json;

// The one line every command (run, run-one, status, report) gives for a state file it cannot
// use: the file, a short reason in our words (never the JSON library's text, which quotes the
// file's bytes), and what to do.
Status Unreadable(const std::string& path, const std::string& why) {
  return Status::Corruption(path + ": unreadable state file (" + why +
                            "); remove it to run the run again (it resumes from its "
                            "checkpoints)");
}

}  // namespace

Result<RunState> ReadState(const std::string& path) {
  RunState s;
  if (::access(path.c_str(), F_OK) != 0) return s;
  auto text = ReadWholeFile(path);
  if (!text.ok()) return Unreadable(path, "cannot be read");
  const json j = json::parse(*text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return Unreadable(path, "not a JSON object");
  // Whole numbers must be JSON integers in range: a float converted to an int out of its range
  // is undefined, and a file that says 3.7 attempts is not ours anyway.
  bool typed = true;
  auto whole = [&](const char* key, int64_t lo, int64_t hi, int64_t fallback) -> int64_t {
    auto it = j.find(key);
    if (it == j.end()) return fallback;
    if (it->is_number_unsigned() && it->get<uint64_t>() <= uint64_t(hi)) {
      return int64_t(it->get<uint64_t>());
    }
    if (it->is_number_integer() && !it->is_number_unsigned() && it->get<int64_t>() >= lo &&
        it->get<int64_t>() <= hi) {
      return it->get<int64_t>();
    }
    typed = false;
    return fallback;
  };
  auto real = [&](const char* key, double fallback) -> double {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return fallback;
    if (!it->is_number()) typed = false;
    return it->is_number() ? it->get<double>() : fallback;
  };
  auto text_of = [&](const char* key) -> std::string {
    auto it = j.find(key);
    if (it == j.end()) return "";
    if (!it->is_string()) typed = false;
    return it->is_string() ? it->get<std::string>() : "";
  };
  if (!j.contains("state") || !j["state"].is_string()) {
    return Unreadable(path, "no \"state\" string");
  }
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  constexpr int64_t kMaxI64 = std::numeric_limits<int64_t>::max();
  s.state = j["state"].get<std::string>();
  s.exit_code = int(whole("exit_code", -1, kMaxInt, -1));
  s.start_ms = whole("start_ms", 0, kMaxI64, 0);
  s.end_ms = whole("end_ms", 0, kMaxI64, 0);
  s.wall_s = real("wall_s", 0.0);
  s.total_wall_s = real("total_wall_s", 0.0);
  s.attempts = int(whole("attempts", 0, kMaxInt, 0));
  s.host = text_of("host");
  s.pid = long(whole("pid", 0, std::numeric_limits<long>::max(), 0));
  s.diverged_step = whole("diverged_step", -1, kMaxI64, -1);
  s.diverged_loss = real("diverged_loss", std::nan(""));
  s.diverged_reason = text_of("diverged_reason");
  if (!typed) return Unreadable(path, "a field of the wrong type or out of range");
  if (s.state != "running" && s.state != "done" && s.state != "diverged" && s.state != "failed") {
    return Unreadable(path, "unknown state");
  }
  if (!std::isfinite(s.wall_s) || !std::isfinite(s.total_wall_s) || s.wall_s < 0 ||
      s.total_wall_s < 0 || s.attempts < 0) {
    return Unreadable(path, "a negative or non-finite time or count");
  }
  return s;
}

Status WriteState(const std::string& path, const RunState& s) {
  json j = {{"state", s.state},       {"exit_code", s.exit_code}, {"start_ms", s.start_ms},
            {"end_ms", s.end_ms},     {"wall_s", s.wall_s},       {"total_wall_s", s.total_wall_s},
            {"attempts", s.attempts}, {"host", s.host},           {"pid", s.pid}};
  if (s.state == "diverged") {
    j["diverged_step"] = s.diverged_step;
    // JSON has no NaN: a loss that was NaN (or is unknown) is null.
    j["diverged_loss"] = std::isfinite(s.diverged_loss) ? json(s.diverged_loss) : json(nullptr);
    j["diverged_reason"] = s.diverged_reason;
  }
  // replace: a reason read from a log may hold bytes that are not UTF-8.
  return WriteFileAtomically(path, j.dump(1, ' ', false, json::error_handler_t::replace) + "\n");
}

std::string HostName() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

namespace {

// Whether process `pid` exists and is not a zombie: only where the lock cannot be checked.
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

// The whole file; l_pid must be 0 for the OFD commands.
struct flock WholeFile(short type) {
  struct flock l {};
  l.l_type = type;
  l.l_whence = SEEK_SET;
  l.l_start = 0;
  l.l_len = 0;
  return l;
}

}  // namespace

int LockState(const std::string& lock_path) {
  const int fd = ::open(lock_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT ? 0 : -1;
  struct flock l = WholeFile(F_WRLCK);
  const bool asked = ::fcntl(fd, F_OFD_GETLK, &l) == 0;
  ::close(fd);
  if (!asked) return -1;
  return l.l_type == F_UNLCK ? 0 : 1;
}

RunLock::RunLock(const std::string& lock_path) {
  fd_ = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) return;
  struct flock l = WholeFile(F_WRLCK);
  held_ = ::fcntl(fd_, F_OFD_SETLK, &l) == 0;
}

RunLock::~RunLock() {
  if (fd_ >= 0) ::close(fd_);
}

bool IsDiverged(const RunState& s) {
  return s.state == "diverged" || (s.state == "failed" && s.exit_code == kDivergedExit);
}

std::string Classify(const RunState& s, const RunPaths& p) {
  if (IsDiverged(s)) return "diverged";
  if (s.state != "running") return s.state;
  if (s.host != HostName()) return "running";  // another machine's process: cannot check it
  const int held = LockState(p.lock);
  if (held < 0) return Alive(s.pid) ? "running" : "interrupted";
  return held > 0 ? "running" : "interrupted";
}

namespace {

int64_t MtimeMs(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return 0;
  return int64_t(st.st_mtim.tv_sec) * 1000 + st.st_mtim.tv_nsec / 1000000;
}

}  // namespace

double InterruptedSeconds(const RunState& s, const RunPaths& p) {
  if (s.state != "running" || s.start_ms <= 0) return 0;
  // cpd-train writes progress lines to the log (up to 10 an epoch, 30 s apart at least) and
  // metrics as it goes: the last write is close to the kill, within one of those intervals.
  const int64_t last = std::max({MtimeMs(p.log), MtimeMs(p.metrics), MtimeMs(p.state)});
  return last > s.start_ms ? double(last - s.start_ms) / 1e3 : 0;
}

namespace {

// A number, or NaN for null (nlohmann writes NaN and Inf as null) or a missing key.
double NumberOr(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : std::nan("");
}

}  // namespace

namespace {

// The loss where a run stopped when no step record of that step has it: what cpd-train's reason
// says ("the loss is NaN", "the loss is infinite"), else unknown (NaN). An earlier step's loss
// would be a wrong answer, not an approximate one.
double LossFromReason(const std::string& why) {
  if (why.find("the loss is infinite") != std::string::npos) {
    return std::numeric_limits<double>::infinity();
  }
  return std::nan("");
}

}  // namespace

void ReadDivergence(const RunPaths& p, RunState* s) {
  std::ifstream in(p.metrics, std::ios::binary);
  std::string line, last_step;
  json stop;
  while (std::getline(in, line)) {
    if (line.find("\"type\":\"stop\"") != std::string::npos) {
      const json j = json::parse(line, nullptr, false);
      if (j.is_object()) stop = j;
    } else if (line.find("\"type\":\"step\"") != std::string::npos) {
      last_step = std::move(line);  // step records are large: only the last one is parsed
    }
  }
  if (stop.is_object() && stop.contains("step") && stop["step"].is_number_integer()) {
    s->diverged_step = stop["step"].get<int64_t>();
    if (stop.contains("reason") && stop["reason"].is_string()) {
      s->diverged_reason = stop["reason"].get<std::string>();
    }
    s->diverged_loss = LossFromReason(s->diverged_reason);
    // A step record of the very step it stopped at (--stats-every 1) has the loss itself.
    const json step = json::parse(last_step, nullptr, false);
    if (step.is_object() && step.contains("step") && step["step"].is_number_integer() &&
        step["step"].get<int64_t>() == s->diverged_step) {
      s->diverged_loss = NumberOr(step, "loss");
    }
    return;
  }
  // No stop record (metrics off, or an older cpd-train): cpd-train's last words in the log,
  // "cpd-train: training diverged at step N: why; stopping (...)".
  const std::string why = LastErrorLine(p.log);
  const size_t at = why.find("diverged at step ");
  if (at == std::string::npos) return;
  const char* begin = why.c_str() + at + 17;
  char* end = nullptr;
  const long long step = std::strtoll(begin, &end, 10);
  if (end == begin) return;
  s->diverged_step = step;
  std::string why_text(*end == ':' ? end + 1 : end);
  why_text.erase(0, std::min(why_text.size(), why_text.find_first_not_of(' ')));
  s->diverged_reason = why_text.substr(0, why_text.find(';'));
  s->diverged_loss = LossFromReason(s->diverged_reason);
}

std::string DivergenceText(const RunState& s) {
  if (s.diverged_step < 0) return "";
  std::string text = "at step " + std::to_string(s.diverged_step);
  // NaN is shown only when it is what the loss was, not when the loss is unknown.
  if (!std::isnan(s.diverged_loss) || s.diverged_reason.find("loss is NaN") != std::string::npos) {
    char buf[48];
    std::snprintf(buf, sizeof buf, " (loss %.4g)", s.diverged_loss);
    text += buf;
  }
  return text;
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
      std::printf("unreadable  %s\n", r.name.c_str());
      ++totals["unreadable"];
      rc = 1;
      continue;
    }
    const std::string what = Classify(*s, p);
    ++totals[what];
    std::string detail;
    if (what == "done") {
      char buf[32];
      std::snprintf(buf, sizeof buf, "  %.1f s", s->total_wall_s);
      detail = buf;
    } else if (what == "running") {
      detail = "  pid " + std::to_string(s->pid) + " on " + s->host;
      // Nothing here can see another host's processes: say how to take the run over.
      if (s->host != HostName()) {
        detail += " (if that process is gone, remove " + p.state + " to run it here)";
      }
    } else if (what == "failed") {
      detail = "  exit " + std::to_string(s->exit_code);
    } else if (what == "diverged") {
      detail = "  " + DivergenceText(*s);
      if (!s->diverged_reason.empty()) detail += ": " + s->diverged_reason;
    }
    std::string line =
        what + std::string(12 - std::min<size_t>(11, what.size()), ' ') + r.name + detail;
    if (what == "failed") {
      const std::string why = LastErrorLine(p.log);
      if (!why.empty()) line += ": " + why;
    }
    std::printf("%s\n", line.c_str());
  }
  const std::string unreadable =
      totals["unreadable"] > 0 ? ", " + std::to_string(totals["unreadable"]) + " unreadable" : "";
  std::printf(
      "%s: %zu runs: %d done, %d diverged, %d running, %d failed, %d interrupted, %d pending%s\n",
      study.name.c_str(), runs.size(), totals["done"], totals["diverged"], totals["running"],
      totals["failed"], totals["interrupted"], totals["pending"], unreadable.c_str());
  return rc;
}

}  // namespace cpd::launcher::study
