// Small helpers that more than one of the launcher's programs (cpd-train, cpd-coordinator,
// cpdctl) uses; nothing here needs CLI11 or gRPC.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

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

}  // namespace cpd::launcher
