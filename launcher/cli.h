// Command-line conventions shared by CPD's executables: help and version exit 0; any other
// parse error prints one line "<tool>: <what>" on stderr and exits 2.
#pragma once

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "cpd/status.h"

namespace cpd::launcher {

constexpr int kUsageError = 2;

[[noreturn]] inline void FailWith(const char* tool, const std::string& msg,
                                  int code = kUsageError) {
  std::fprintf(stderr, "%s: %s\n", tool, msg.c_str());
  std::exit(code);
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

// A coordinator token: the file's first line without surrounding whitespace; an empty token is
// an error (it would silently turn authentication off).
inline Result<std::string> ReadTokenFile(const std::string& path) {
  CPD_ASSIGN_OR_RETURN(const std::string text, ReadWholeFile(path));
  std::string line = text.substr(0, text.find('\n'));
  const char* ws = " \t\r\v\f";
  const size_t begin = line.find_first_not_of(ws);
  if (begin == std::string::npos) {
    return Status::InvalidArgument(path + ": the first line is empty; put the token on it");
  }
  line = line.substr(begin, line.find_last_not_of(ws) - begin + 1);
  return line;
}

// The whole file, or exit `code` with "<tool>: <flag> <why>".
inline std::string ReadFileOrExit(const char* tool, const std::string& flag,
                                  const std::string& path, int code) {
  auto text = ReadWholeFile(path);
  if (!text.ok()) FailWith(tool, flag + " " + text.status().message(), code);
  return *text;
}

// The token in the file, or exit `code` with "<tool>: <flag> <why>".
inline std::string ReadTokenFileOrExit(const char* tool, const std::string& flag,
                                       const std::string& path, int code) {
  auto token = ReadTokenFile(path);
  if (!token.ok()) FailWith(tool, flag + " " + token.status().message(), code);
  return *token;
}

}  // namespace cpd::launcher
