#include "launcher/files.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>

extern char** environ;

namespace cpd::launcher {

namespace {

std::string Errno() { return std::strerror(errno); }

bool IsFile(const std::string& p) {
  struct stat sb;
  return ::stat(p.c_str(), &sb) == 0 && S_ISREG(sb.st_mode);
}

std::string DirOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string Trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

std::vector<char*> Pointers(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

}  // namespace

Status WriteFileAtomically(const std::string& path, const std::string& contents) {
  std::string tmp = path + ".tmp.XXXXXX";
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) return Status::IoError("cannot create a temporary beside " + path + ": " + Errno());
  size_t off = 0;
  bool ok = true;
  while (ok && off < contents.size()) {
    const ssize_t w = ::write(fd, contents.data() + off, contents.size() - off);
    if (w < 0 && errno == EINTR) continue;
    ok = w > 0;
    if (ok) off += size_t(w);
  }
  ok = ok && ::fchmod(fd, 0644) == 0 && ::fsync(fd) == 0;
  std::string err = ok ? "" : Errno();
  if (::close(fd) != 0 && ok) {
    ok = false;
    err = Errno();
  }
  if (ok && ::rename(tmp.c_str(), path.c_str()) != 0) {
    ok = false;
    err = Errno();
  }
  if (!ok) {
    ::unlink(tmp.c_str());  // best effort: the temporary name is never read
    return Status::IoError("writing " + path + ": " + err);
  }
  // The rename is durable once the directory is synced (EINVAL: a file system that cannot).
  const int dfd = ::open(DirOf(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return Status::IoError("opening the directory of " + path + ": " + Errno());
  const bool synced = ::fsync(dfd) == 0 || errno == EINVAL;
  err = synced ? "" : Errno();
  if (::close(dfd) != 0 || !synced) {
    return Status::IoError("syncing the directory of " + path + ": " + (synced ? Errno() : err));
  }
  return Status::Ok();
}

std::string ExecutableDir() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  const std::string p(buf, size_t(n));
  return p.substr(0, p.rfind('/'));
}

Result<std::string> FindScript(const std::string& name, const char* env_var,
                               const std::vector<std::string>& candidates) {
  if (const char* env = std::getenv(env_var); env != nullptr && *env) {
    if (IsFile(env)) return std::string(env);
    return Status::NotFound(std::string(env_var) + "=" + env + " is not a file");
  }
  std::string tried;
  for (const std::string& p : candidates) {
    if (IsFile(p)) return p;
    tried += (tried.empty() ? "" : ", ") + p;
  }
  return Status::NotFound("cannot find " + name + " (looked at " + tried + "; or set " + env_var +
                          ")");
}

Status RunPythonScript(const std::string& python, const std::string& script,
                       const std::vector<std::string>& args) {
  const char* tmpdir = std::getenv("TMPDIR");
  std::string err_path =
      std::string(tmpdir != nullptr && *tmpdir ? tmpdir : "/tmp") + "/cpd_script_XXXXXX";
  const int efd = ::mkstemp(err_path.data());
  if (efd < 0) return Status::IoError("cannot create a temporary file: " + Errno());
  ::close(efd);  // reopened by the child through the file actions

  std::vector<std::string> argv_s = {python, script};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<std::string> env_s;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "MPLBACKEND=", 11) != 0) env_s.emplace_back(*e);
  }
  env_s.emplace_back("MPLBACKEND=Agg");
  const std::vector<char*> argv = Pointers(argv_s), envp = Pointers(env_s);

  posix_spawn_file_actions_t fa;
  int rc = posix_spawn_file_actions_init(&fa);
  if (rc == 0) rc = posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  if (rc == 0) rc = posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  if (rc == 0) {
    rc = posix_spawn_file_actions_addopen(&fa, STDERR_FILENO, err_path.c_str(), O_WRONLY | O_TRUNC,
                                          0600);
  }
  pid_t pid = -1;
  if (rc == 0) rc = posix_spawnp(&pid, python.c_str(), &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    ::unlink(err_path.c_str());
    return Status::Unavailable("cannot run " + python + ": " + std::strerror(rc) +
                               " (it needs python3 and python3-matplotlib)");
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) {
      const std::string err = Errno();
      ::unlink(err_path.c_str());
      return Status::Internal("waiting for " + python + ": " + err);
    }
  }
  std::string last, line;
  {
    std::ifstream in(err_path);
    while (std::getline(in, line)) {
      if (!Trim(line).empty()) last = Trim(line);
    }
  }
  ::unlink(err_path.c_str());
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return Status::Ok();
  if (WIFEXITED(status) && WEXITSTATUS(status) == 127) {
    return Status::Unavailable("cannot run " + python +
                               " (it needs python3 and python3-matplotlib)");
  }
  return Status::Internal(script + " failed" +
                          (WIFEXITED(status) ? " (exit " + std::to_string(WEXITSTATUS(status)) + ")"
                                             : std::string(" (killed by a signal)")) +
                          (last.empty() ? "" : ": " + last));
}

}  // namespace cpd::launcher
