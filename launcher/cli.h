// Command-line conventions shared by CPD's executables: help and version exit 0; any other
// parse error prints one line "<tool>: <what>" on stderr and exits 2.
#pragma once

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cpd/status.h"
#include "cpd/threads.h"
#include "launcher/common.h"

namespace cpd::launcher {

constexpr int kUsageError = 2;

// The one line is MessageLine(msg): whatever `msg` quotes (an argument CLI11 echoes, a server's
// message), a NUL cannot cut it short, a newline cannot make it two lines and a 400 KB value
// cannot make it 400 KB.
[[noreturn]] inline void FailWith(const char* tool, const std::string& msg,
                                  int code = kUsageError) {
  std::fprintf(stderr, "%s: %s\n", tool, MessageLine(msg).c_str());
  std::exit(code);
}

// Validators for numeric flags whose messages say in words what is accepted ("--channels: 0 is
// not accepted: a whole number >= 1"), where CLI11's own print both bounds of a double range
// ("Value 0 not in range 0.000000 to 1797693134862..."). `what` names the accepted values.
inline CLI::Validator NumberValidator(std::string what, bool integer, long double lo,
                                      long double hi) {
  return CLI::Validator(
      [what, integer, lo, hi](std::string& text) -> std::string {
        char* end = nullptr;
        errno = 0;
        const long double v = std::strtold(text.c_str(), &end);
        const bool parsed = !text.empty() && end == text.c_str() + text.size() && errno == 0;
        if (!parsed || !(v >= lo && v <= hi) || (integer && v != std::floor(v))) {
          return QuoteForMessage(text) + " is not accepted: " + what;
        }
        return std::string();
      },
      what);
}
// One of `choices` ("--hysteresis: 'yes' is not accepted: one of on, off"); CLI11's IsMember
// echoes the value whole.
inline CLI::Validator OneOf(std::vector<std::string> choices) {
  std::string what = "one of ";
  for (size_t i = 0; i < choices.size(); ++i) what += (i > 0 ? ", " : "") + choices[i];
  return CLI::Validator(
      [choices, what](std::string& text) -> std::string {
        for (const std::string& c : choices) {
          if (text == c) return std::string();
        }
        return QuoteForMessage(text) + " is not accepted: " + what;
      },
      what);
}
// A whole number >= lo (up to 2^63).
inline CLI::Validator IntegerAtLeast(long long lo) {
  return NumberValidator("a whole number >= " + std::to_string(lo), true, lo, 9.2e18L);
}
// A whole number in lo..hi.
inline CLI::Validator IntegerIn(long long lo, long long hi) {
  return NumberValidator("a whole number from " + std::to_string(lo) + " to " + std::to_string(hi),
                         true, lo, hi);
}
// A seed or a step: a whole number 0..2^64-1 in decimal digits. CLI11's own conversion wraps -1 to
// 2^64-1 and saturates 2^64 and 1e23 to it, so three different seeds gave one stream.
inline CLI::Validator Uint64Number() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const char* what = "' is not accepted: a whole number from 0 to 18446744073709551615";
        if (text.empty() || text.size() > 20 ||
            text.find_first_not_of("0123456789") != std::string::npos) {
          return "'" + text.substr(0, 40) + what;
        }
        errno = 0;
        std::strtoull(text.c_str(), nullptr, 10);
        if (errno == ERANGE) return "'" + text + what;
        return std::string();
      },
      "a whole number from 0 to 2^64-1");
}
// The count of threads a tool runs (0: all cores), bounded by cpd::MaxThreads.
inline CLI::Validator ThreadCount() {
  return NumberValidator(ThreadsAccepted(), true, 0, MaxThreads());
}
// A number > 0 (seconds, rates).
inline CLI::Validator PositiveNumber() {
  return NumberValidator("a number > 0", false, 4.9e-324L, 1.7976931348623157e308L);
}

// Parses argv into `app`. Returns -1 to go on, or the exit code for --help/--version.
inline int ParseArgs(CLI::App& app, int argc, char** argv, const char* tool) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    FailWith(tool, e.what());
  }
  return -1;
}

// The whole of a (small) file: PEM certificates, keys.
inline Result<std::string> ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IoError(path + ": cannot read: " + std::strerror(errno));
  std::stringstream s;
  s << in.rdbuf();
  if (in.bad()) return Status::IoError(path + ": error while reading");
  return s.str();
}

// The whole file, or exit `code` with "<tool>: <flag> <why>".
inline std::string ReadFileOrExit(const char* tool, const std::string& flag,
                                  const std::string& path, int code) {
  auto text = ReadWholeFile(path);
  if (!text.ok()) FailWith(tool, flag + " " + text.status().message(), code);
  return *text;
}

// The token in the file (ReadTokenFile: the one reader and check of every program's token), or
// exit `code` with "<tool>: <flag> <why>".
inline std::string ReadTokenFileOrExit(const char* tool, const std::string& flag,
                                       const std::string& path, int code) {
  auto token = ReadTokenFile(path);
  if (!token.ok()) FailWith(tool, flag + " " + token.status().message(), code);
  return *token;
}

// The PEM file (ReadPemFile: checked before gRPC sees it), or exit `code` with
// "<tool>: <flag> <why>".
inline std::string ReadPemFileOrExit(const char* tool, const std::string& flag,
                                     const std::string& path, std::string_view kind, int code) {
  auto pem = ReadPemFile(path, kind);
  if (!pem.ok()) FailWith(tool, flag + " " + pem.status().message(), code);
  return *pem;
}

}  // namespace cpd::launcher
