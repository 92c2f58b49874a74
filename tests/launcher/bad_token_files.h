// Token files that gRPC would refuse as a metadata value (it aborted cpdctl and cpd-train with
// SIGABRT and printed "Bearer <token>" in its log line): every program that reads a
// --token-file must refuse them with one line naming the file and the column, never the token.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include "tests/subprocess.h"

namespace cpd::test {

struct BadTokenFile {
  std::string name;  // the file's name
  std::string text;  // its contents
  std::string why;   // what the one line must say: the byte and its 1-based column
};

// Both halves of every token below hold this, so that a message printing any of it is caught.
constexpr char kTokenSecret[] = "S3CRET";

inline std::vector<BadTokenFile> BadTokenFiles() {
  return {
      {"tab", "S3CRETaa\tS3CRETbb\n", "a tab at column 9"},
      {"control", "  S3CRETaa\x01S3CRETbb\n", "a control character at column 11"},
      {"non_ascii", "S3CRETaa\xc3\xa9S3CRETbb\nline 2\n", "a non-ASCII byte at column 9"},
      {"nul", std::string("S3CRETaa\0S3CRETbb\n", 19), "a NUL byte at column 9"},
      {"del", "S3CRETaa\x7fS3CRETbb", "a control character at column 9"},
      {"long", std::string(kTokenSecret) + std::string(5000, 'x') + "\n", "longer than 4096"},
  };
}

// Writes every bad token file into `dir`; returns their paths in BadTokenFiles() order.
inline std::vector<std::string> WriteBadTokenFiles(const std::string& dir) {
  std::vector<std::string> paths;
  for (const BadTokenFile& t : BadTokenFiles()) {
    paths.push_back(dir + "/" + t.name + ".token");
    std::ofstream(paths.back(), std::ios::binary) << t.text;
  }
  return paths;
}

// Exit 2, one line on stderr starting "<tool>: " naming the file and the reason, nothing of the
// token on stdout or stderr.
inline void ExpectTokenRefused(const RunResult& r, const std::string& tool, const std::string& path,
                               const BadTokenFile& t) {
  SCOPED_TRACE(tool + " with the token file '" + t.name + "'");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_EQ(r.err.rfind(tool + ": ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find(path), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(t.why), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find(kTokenSecret), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find(kTokenSecret), std::string::npos) << r.out;
  EXPECT_EQ(r.err.find("Bearer"), std::string::npos) << r.err;
}

}  // namespace cpd::test
