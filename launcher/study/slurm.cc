#include "launcher/study/slurm.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "launcher/study/run_state.h"

namespace cpd::launcher::study {

namespace {

void Complain(const std::string& line) { std::fprintf(stderr, "cpd-study: %s\n", line.c_str()); }

std::string Absolute(const std::string& path) {
  std::error_code ec;
  const auto abs = std::filesystem::absolute(path, ec);
  return ec ? path : abs.lexically_normal().string();
}

// Runs argv with stdout captured (stderr inherited); its exit code, or -1 if it cannot start.
int Capture(const std::vector<std::string>& argv, std::string* out) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return -1;
  const pid_t pid = SpawnProcess(argv, fds[1], -1);
  ::close(fds[1]);
  if (pid < 0) {
    ::close(fds[0]);
    return -1;
  }
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof buf)) != 0) {
    if (n > 0) out->append(buf, size_t(n));
  }
  ::close(fds[0]);
  return WaitForExit(pid);
}

// OK when the controller answers: a configured but stopped slurmctld makes sinfo retry for
// minutes, hence the bound.
Status CheckSlurmAnswers() {
  if (FindOnPath("sbatch").empty() || FindOnPath("sinfo").empty()) {
    return Status::NotFound(
        "--launcher slurm: sbatch/sinfo not found on PATH (is Slurm installed?)");
  }
  std::string states;
  const int code = Capture({"timeout", "20", "sinfo", "-h", "-o", "%T"}, &states);
  if (code != 0 || states.empty()) {
    return Status::Unavailable("--launcher slurm: the Slurm controller does not answer (sinfo " +
                               std::string(code == 124 ? "timed out after 20 s" : "failed") +
                               "); nothing was submitted");
  }
  return Status::Ok();
}

}  // namespace

std::string ArraySpec(const std::vector<size_t>& indices) {
  std::string spec;
  for (size_t i = 0; i < indices.size();) {
    size_t j = i;
    while (j + 1 < indices.size() && indices[j + 1] == indices[j] + 1) ++j;
    if (!spec.empty()) spec += ',';
    spec += std::to_string(indices[i]);
    if (j > i) spec += '-' + std::to_string(indices[j]);
    i = j + 1;
  }
  return spec;
}

std::vector<std::string> SbatchCommand(const Study& study, const std::vector<size_t>& indices,
                                       const SlurmOptions& o) {
  const std::string out = Absolute(o.run.launch.out_dir);
  std::string array = ArraySpec(indices);
  if (o.parallel > 0) array += '%' + std::to_string(o.parallel);
  std::vector<std::string> argv = {"sbatch",
                                   "--parsable",
                                   "--array=" + array,
                                   "--ntasks=" + std::to_string(study.ranks),
                                   "--job-name=cpd-study-" + study.name,
                                   "--output=" + out + "/slurm/%A_%a.log"};
  if (o.wait) argv.push_back("--wait");
  argv.insert(argv.end(), o.sbatch_args.begin(), o.sbatch_args.end());
  argv.insert(argv.end(), {Absolute(o.script), Absolute(o.study_path), "--out", out, "--cpd-train",
                           Absolute(o.run.launch.cpd_train)});
  if (!o.run.launch.coordinator.empty()) {
    argv.insert(argv.end(), {"--coordinator", o.run.launch.coordinator});
  }
  if (o.run.retry_failed) argv.push_back("--retry-failed");
  return argv;
}

int RunSlurm(const Study& study, const std::vector<PlannedRun>& runs, const SlurmOptions& o) {
  if (Status s = CheckSlurmAnswers(); !s.ok()) {
    Complain(s.message());
    return 1;
  }
  const RunTally tally = TallyRuns(runs, o.run.launch.out_dir, o.run.retry_failed);
  for (const std::string& line : tally.unreadable) Complain(line);
  const std::vector<size_t>& todo = tally.to_run;
  const size_t done = tally.done + tally.diverged, skipped = tally.failed + tally.running;
  std::printf(
      "%s: %zu runs: %zu done or diverged, %zu failed or running (not submitted), %zu to "
      "submit\n",
      study.name.c_str(), runs.size(), done, skipped, todo.size());
  std::fflush(stdout);
  if (todo.empty()) return tally.failed == 0 && tally.unreadable.empty() ? 0 : 1;
  std::error_code ec;
  std::filesystem::create_directories(o.run.launch.out_dir + "/slurm", ec);
  if (ec) {
    Complain("cannot create " + o.run.launch.out_dir + "/slurm: " + ec.message());
    return 1;
  }
  // The tasks find this cpd-study through the environment sbatch exports (--export=ALL).
  ::setenv("CPD_STUDY", Absolute(o.self).c_str(), 1);
  const std::vector<std::string> argv = SbatchCommand(study, todo, o);
  std::printf("submitting: %s\n", ShellLine(argv).c_str());
  std::fflush(stdout);
  std::string job;
  const int code = Capture(argv, &job);
  while (!job.empty() && (job.back() == '\n' || job.back() == '\r')) job.pop_back();
  if (job.empty()) {
    Complain(
        "sbatch " +
        std::string(code < 0 ? "could not start" : "failed (exit " + std::to_string(code) + ")") +
        "; nothing was submitted");
    return 1;
  }
  if (!o.wait) {
    std::printf(
        "submitted job array %s (%zu runs); `cpd-study status` shows progress, logs in "
        "%s/slurm/\n",
        job.c_str(), todo.size(), o.run.launch.out_dir.c_str());
    return 0;
  }
  std::printf("job array %s ended (sbatch exit %d)\n", job.c_str(), code);
  std::fflush(stdout);
  PrintStatus(study, runs, o.run.launch.out_dir);
  const RunTally after = TallyRuns(runs, o.run.launch.out_dir, o.run.retry_failed);
  return after.done + after.diverged == runs.size() ? 0 : 1;
}

Status CheckSlurmTask(const Study& study) {
  const char* ntasks = std::getenv("SLURM_NTASKS");
  if (ntasks == nullptr || *ntasks == '\0') return Status::Ok();
  if (std::string(ntasks) != std::to_string(study.ranks)) {
    return Status::InvalidArgument(
        "the Slurm task has " + std::string(ntasks) + " tasks but the study's ranks is " +
        std::to_string(study.ranks) + ": submit with --ntasks=" + std::to_string(study.ranks));
  }
  return Status::Ok();
}

}  // namespace cpd::launcher::study
