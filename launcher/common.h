// Small helpers that more than one of the launcher's programs (cpd-train, cpd-coordinator,
// cpdctl) uses; nothing here needs CLI11 or gRPC.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cpd/message.h"
#include "cpd/status.h"

namespace cpd::launcher {

// Milliseconds since the Unix epoch (the wall clock, comparable across machines).
int64_t NowMs();

// "HOST:PORT" -> HOST (an IPv6 literal keeps its brackets) and PORT (0..65535); false when
// malformed. The one parser of addresses given to cpd-train, cpd-coordinator and cpdctl.
bool SplitHostPort(const std::string& address, std::string* host, int* port);

// Whether HOST names this machine's loopback interface only: localhost, 127.0.0.0/8, [::1].
bool IsLoopbackHost(const std::string& host);

// The non-empty items of a comma-separated list: "a,,b" -> {"a", "b"}.
std::vector<std::string> SplitCommas(const std::string& s);

// A CSV field (RFC 4180): quoted when it holds a comma, quote, CR or LF, quotes doubled.
std::string CsvField(std::string_view s);

// QuoteForMessage and MessageLine (cpd/message.h) quote what others wrote in messages.
using cpd::MessageLine;
using cpd::QuoteForMessage;

// ---- Coordinator tokens and certificates (cpd-coordinator, cpdctl and cpd-train's client) ---

// The longest token accepted. It travels as the header "authorization: Bearer <token>", and gRPC
// refuses a call whose headers exceed 8 KiB.
constexpr size_t kMaxTokenBytes = 4096;

// The token in the text of a token file: its first line without the spaces, tabs and CR around
// it. gRPC aborts the whole process (SIGABRT, the header in its log line) on a metadata value
// with any byte outside printable ASCII (0x20..0x7E, its rule for non-binary values), so such a
// token is refused here. InvalidArgument naming `path` when the line is empty, longer than
// kMaxTokenBytes, or holds such a byte; the message gives the byte's value and 1-based column in
// the line, never the token.
Result<std::string> TokenFromFileText(std::string_view text, const std::string& path);

// TokenFromFileText of the file's first kMaxTokenBytes + 1 KiB bytes (a FIFO or /dev/zero
// cannot make it read forever); IoError naming `path` when it cannot be read. The one reader of
// every program's --token-file.
Result<std::string> ReadTokenFile(const std::string& path);

// A PEM file handed to gRPC (--tls-ca, --tls-cert, --tls-key), checked first: readable, at most
// 1 MiB, and holding a "-----BEGIN <kind>-----" block with its END line. gRPC itself, given
// anything else, logs several lines per connection attempt and fails every call. `kind` is
// "CERTIFICATE" or "PRIVATE KEY" (any "... PRIVATE KEY" block: RSA, EC, encrypted). Errors name
// `path` and what was expected.
Result<std::string> ReadPemFile(const std::string& path, std::string_view kind);

}  // namespace cpd::launcher
