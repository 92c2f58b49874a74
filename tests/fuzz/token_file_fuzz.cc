// The coordinator token file (--token-file of cpd-coordinator, cpdctl and cpd-train): the input
// is the file's bytes, read by launcher/common.h's ReadTokenFile as every program reads it.
// Invariants: a token accepted is exactly what gRPC accepts as a metadata value ("Bearer
// <token>" passes gRPC's own grpc_header_nonbin_value_is_legal, which would otherwise abort the
// program), non-empty, at most kMaxTokenBytes, and the trimmed first line; a refusal is one
// InvalidArgument line that starts with the path and never holds the token; reading the file
// gives the answer of reading its text.
#include <grpc/grpc.h>
#include <grpc/slice.h>

#include <cstdint>
#include <string>

#include "launcher/common.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

bool GrpcAcceptsValue(const std::string& value) {
  grpc_slice s = grpc_slice_from_copied_buffer(value.data(), value.size());
  const bool legal = grpc_header_nonbin_value_is_legal(s) != 0;
  grpc_slice_unref(s);
  return legal;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const std::string path = cpd::fuzz::ScratchDir() + "/token";
  const auto parsed = cpd::launcher::TokenFromFileText(text, path);
  // What the reader sees of a longer file: its first kMaxTokenBytes + 1 KiB bytes.
  cpd::fuzz::WriteFile(path, text);
  const auto read = cpd::launcher::ReadTokenFile(path);
  const std::string prefix = text.substr(0, cpd::launcher::kMaxTokenBytes + 1024);
  const auto parsed_prefix = cpd::launcher::TokenFromFileText(prefix, path);
  CPD_FUZZ_CHECK(read.ok() == parsed_prefix.ok(), "ReadTokenFile and the text disagree");
  if (read.ok()) {
    CPD_FUZZ_CHECK(*read == *parsed_prefix, "ReadTokenFile and the text give other tokens");
  } else {
    CPD_FUZZ_CHECK(read.status().message() == parsed_prefix.status().message(),
                   read.status().message());
  }
  // Within the prefix the answers agree (a first line that ends inside it is the same line).
  if (text.find('\n') < prefix.size()) {
    CPD_FUZZ_CHECK(parsed.ok() == parsed_prefix.ok(), "a longer file changed the answer");
  }

  const std::string line = text.substr(0, text.find('\n'));
  if (parsed.ok()) {
    const std::string& token = *parsed;
    CPD_FUZZ_CHECK(!token.empty() && token.size() <= cpd::launcher::kMaxTokenBytes, token);
    CPD_FUZZ_CHECK(GrpcAcceptsValue("Bearer " + token), "gRPC would refuse the token");
    CPD_FUZZ_CHECK(line.find(token) != std::string::npos, "the token is not on the first line");
    CPD_FUZZ_CHECK(token.front() != ' ' && token.back() != ' ', "the token is not trimmed");
    return 0;
  }
  const cpd::Status& s = parsed.status();
  CPD_FUZZ_CHECK(s.code() == cpd::Status::Code::kInvalidArgument, s.message());
  CPD_FUZZ_CHECK(s.message().rfind(path + ": ", 0) == 0, s.message());
  CPD_FUZZ_CHECK(s.message().find('\n') == std::string::npos, s.message());
  CPD_FUZZ_CHECK(s.message().size() < path.size() + 160, s.message());
  // Never the token: what follows the path is one of the fixed messages, the only variable part
  // being the column, which must point at the first byte gRPC refuses.
  const std::string rest = s.message().substr(path.size() + 2);
  const std::string tail = " of the first line; a token may hold only printable ASCII (0x20..0x7E)";
  if (rest != "the first line is empty; put the token on it" &&
      rest != "the token on the first line is longer than 4096 bytes") {
    const size_t at = rest.find(" at column ");
    CPD_FUZZ_CHECK(at != std::string::npos && rest.size() > tail.size() &&
                       rest.compare(rest.size() - tail.size(), tail.size(), tail) == 0,
                   s.message());
    const std::string what = rest.substr(0, at);
    CPD_FUZZ_CHECK(what == "a tab" || what == "a NUL byte" || what == "a control character" ||
                       what == "a non-ASCII byte",
                   s.message());
    const std::string digits = rest.substr(at + 11, rest.size() - tail.size() - at - 11);
    CPD_FUZZ_CHECK(!digits.empty() && digits.size() < 6 &&
                       digits.find_first_not_of("0123456789") == std::string::npos,
                   s.message());
    const size_t column = std::stoul(digits);
    CPD_FUZZ_CHECK(column >= 1 && column <= line.size(), s.message());
    const unsigned char c = static_cast<unsigned char>(line[column - 1]);
    CPD_FUZZ_CHECK(c < 0x20 || c > 0x7e, s.message());
    const size_t first = line.find_first_not_of(" \t\r");
    for (size_t i = first; i + 1 < column; ++i) {
      const unsigned char ok = static_cast<unsigned char>(line[i]);
      CPD_FUZZ_CHECK(ok >= 0x20 && ok <= 0x7e, "an earlier byte was refusable");
    }
  }
  // Refused only where gRPC refuses too (or the line is empty or too long).
  const size_t b = line.find_first_not_of(" \t\r");
  if (b != std::string::npos) {
    const std::string trimmed = line.substr(b, line.find_last_not_of(" \t\r") + 1 - b);
    CPD_FUZZ_CHECK(
        trimmed.size() > cpd::launcher::kMaxTokenBytes || !GrpcAcceptsValue("Bearer " + trimmed),
        s.message());
  }
  return 0;
}
