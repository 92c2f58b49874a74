// Command-line conventions shared by CPD's executables: help and version exit 0; any other
// parse error prints one line "<tool>: <what>" on stderr and exits 2.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <string>

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

}  // namespace cpd::launcher
