// Files the tools write for their users, and the Python helpers they run (plots). Errors are
// Status values naming the file; nothing here exits.
#pragma once

#include <string>
#include <vector>

#include "cpd/status.h"

namespace cpd::launcher {

// Writes `contents` to `path` whole or not at all: a temporary in the same directory, fsync,
// rename over `path`, fsync of the directory. A reader sees the old file or the new one.
Status WriteFileAtomically(const std::string& path, const std::string& contents);

// The directory of the running executable ("." if /proc/self/exe cannot be read).
std::string ExecutableDir();

// A helper script: $`env_var` when it is set (it must name a file), else the first of
// `candidates` that is a file; NotFound listing what was tried otherwise.
Result<std::string> FindScript(const std::string& name, const char* env_var,
                               const std::vector<std::string>& candidates);

// Runs `python script args...` with matplotlib's non-interactive backend, stdin and stdout on
// /dev/null and stderr collected. OK when it exits 0; otherwise an error whose message is
// "cannot run PYTHON: ..." when the interpreter cannot start, or "SCRIPT failed (exit N): <the
// last line it wrote to stderr>".
Status RunPythonScript(const std::string& python, const std::string& script,
                       const std::vector<std::string>& args);

}  // namespace cpd::launcher
