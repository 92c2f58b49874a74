// Runs a built program as a subprocess for the command-line tests.
#pragma once

#include <errno.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace cpd::test {

// A built program's path: the one compiled in, unless CPD_BIN_DIR names a folder that holds the
// executables (the GPU bundle of scripts/gpu_bundle.sh, unpacked on another machine).
inline std::string BuiltProgram(const std::string& compiled_path) {
  const char* dir = std::getenv("CPD_BIN_DIR");
  if (dir == nullptr || *dir == '\0') return compiled_path;
  const size_t slash = compiled_path.rfind('/');
  return std::string(dir) + "/" +
         (slash == std::string::npos ? compiled_path : compiled_path.substr(slash + 1));
}

struct RunResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Where a child's stdout goes: a file, or a pipe (as in `cpd-train | tee log`) that the parent
// reads to the end.
enum class StdoutTo { kFile, kPipe };

// Runs `binary` with `args`, feeding `input` on stdin; stdout goes to a file or a pipe, stderr
// to a file.
inline RunResult RunProgram(const std::string& binary, const std::vector<std::string>& args,
                            const std::string& input = "", StdoutTo stdout_to = StdoutTo::kFile) {
  char dir_template[] = "/tmp/cpd_cli_test_XXXXXX";
  const char* dir = mkdtemp(dir_template);
  EXPECT_NE(dir, nullptr);
  const std::string in_path = std::string(dir) + "/in", out_path = std::string(dir) + "/out",
                    err_path = std::string(dir) + "/err";
  {
    std::ofstream f(in_path, std::ios::binary);
    f.write(input.data(), std::streamsize(input.size()));
  }
  std::vector<std::string> argv_s = {binary};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  int pipe_fds[2] = {-1, -1};
  const bool piped = stdout_to == StdoutTo::kPipe;
  if (piped) {
    EXPECT_EQ(pipe(pipe_fds), 0);
  }
  const pid_t pid = fork();
  if (pid == 0) {
    const int in = open(in_path.c_str(), O_RDONLY);
    const int out =
        piped ? pipe_fds[1] : open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    const int err = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (in < 0 || out < 0 || err < 0) _exit(126);
    if (piped) close(pipe_fds[0]);
    dup2(in, 0);
    dup2(out, 1);
    dup2(err, 2);
    execv(argv[0], argv.data());
    _exit(127);
  }
  RunResult r;
  if (piped) {
    close(pipe_fds[1]);
    char buf[4096];
    ssize_t n;
    while ((n = read(pipe_fds[0], buf, sizeof buf)) != 0) {
      if (n > 0) r.out.append(buf, size_t(n));
      if (n < 0 && errno != EINTR) break;
    }
    close(pipe_fds[0]);
  }
  int status = 0;
  EXPECT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status)) << binary << " did not exit normally";
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (!piped) r.out = ReadFile(out_path);
  r.err = ReadFile(err_path);
  std::remove(in_path.c_str());
  std::remove(out_path.c_str());
  std::remove(err_path.c_str());
  rmdir(dir);
  return r;
}

// RunProgram with every GPU hidden from the CUDA runtime (CUDA_VISIBLE_DEVICES=""), so that a
// test of the behaviour without a GPU runs on GPU machines too (and in builds without CUDA).
inline RunResult RunProgramWithoutGpu(const std::string& binary,
                                      const std::vector<std::string>& args) {
  const char* old = std::getenv("CUDA_VISIBLE_DEVICES");
  const std::string saved = old != nullptr ? old : "";
  setenv("CUDA_VISIBLE_DEVICES", "", 1);
  RunResult r = RunProgram(binary, args);
  if (old != nullptr) {
    setenv("CUDA_VISIBLE_DEVICES", saved.c_str(), 1);
  } else {
    unsetenv("CUDA_VISIBLE_DEVICES");
  }
  return r;
}

}  // namespace cpd::test
