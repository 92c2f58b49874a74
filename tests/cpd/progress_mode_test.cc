// --progress's words, and what auto becomes for this process's stdout: a bar only on a terminal
// that no process manager started (mpirun gives its ranks a pseudo-terminal whose output ends in
// the job's log file), plain lines otherwise.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "cpd/progress.h"

namespace cpd {
namespace {

TEST(ProgressMode, ParsesTheFourWordsAndNamesThemBack) {
  for (const char* word : {"auto", "bar", "lines", "off"}) {
    auto m = ParseProgressMode(word);
    ASSERT_TRUE(m.ok()) << word;
    EXPECT_EQ(std::string(ProgressModeName(*m)), word);
  }
}

TEST(ProgressMode, RefusesAnythingElseNamingTheAcceptedWords) {
  for (const char* word : {"", "Bar", "line", "none", "auto "}) {
    auto m = ParseProgressMode(word);
    ASSERT_FALSE(m.ok()) << word;
    EXPECT_NE(m.status().message().find("(accepted: auto, bar, lines, off)"), std::string::npos)
        << m.status().message();
  }
}

// The variables mpirun (Open MPI, MPICH/PMI, PMIx) and srun set in every process they start.
constexpr const char* kLauncherVars[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK",
                                         "PMI_SIZE", "SLURM_STEP_ID"};

// Clears the launcher variables for a test's duration (ctest itself may run under srun), and
// puts this process's stdout on `fd` until the end of the scope.
class StdoutOn {
 public:
  explicit StdoutOn(int fd) {
    for (const char* v : kLauncherVars) {
      if (const char* old = std::getenv(v)) saved_.emplace_back(v, old);
      unsetenv(v);
    }
    std::fflush(stdout);
    saved_stdout_ = dup(STDOUT_FILENO);
    EXPECT_GE(dup2(fd, STDOUT_FILENO), 0);
  }
  ~StdoutOn() {
    std::fflush(stdout);
    dup2(saved_stdout_, STDOUT_FILENO);
    close(saved_stdout_);
    for (const char* v : kLauncherVars) unsetenv(v);
    for (const auto& [name, value] : saved_) setenv(name.c_str(), value.c_str(), 1);
  }

 private:
  int saved_stdout_ = -1;
  std::vector<std::pair<std::string, std::string>> saved_;
};

TEST(ProgressMode, AutoIsLinesWhenStdoutIsAFile) {
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  {
    StdoutOn out(fileno(file));
    EXPECT_FALSE(LaunchedByProcessManager());
    EXPECT_EQ(ResolveProgressMode(ProgressMode::kAuto), ProgressMode::kLines);
    EXPECT_EQ(ResolveProgressMode(ProgressMode::kBar), ProgressMode::kBar);  // asked for
    EXPECT_EQ(ResolveProgressMode(ProgressMode::kOff), ProgressMode::kOff);
  }
  std::fclose(file);
}

TEST(ProgressMode, AutoOnATerminalIsTheBarUnlessAProcessManagerStartedUs) {
  const int master = posix_openpt(O_RDWR | O_NOCTTY);
  if (master < 0) GTEST_SKIP() << "no pseudo-terminals here (posix_openpt failed)";
  ASSERT_EQ(grantpt(master), 0);
  ASSERT_EQ(unlockpt(master), 0);
  const int terminal = open(ptsname(master), O_RDWR | O_NOCTTY);
  ASSERT_GE(terminal, 0);
  {
    StdoutOn out(terminal);
    EXPECT_EQ(ResolveProgressMode(ProgressMode::kAuto), ProgressMode::kBar);
    for (const char* v : kLauncherVars) {
      setenv(v, "0", 1);
      EXPECT_TRUE(LaunchedByProcessManager()) << v;
      EXPECT_EQ(ResolveProgressMode(ProgressMode::kAuto), ProgressMode::kLines) << v;
      EXPECT_EQ(ResolveProgressMode(ProgressMode::kLines), ProgressMode::kLines) << v;
      unsetenv(v);
    }
  }
  close(terminal);
  close(master);
}

}  // namespace
}  // namespace cpd
