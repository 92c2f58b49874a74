#include "launcher/common.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

namespace cpd::launcher {

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

bool SplitHostPort(const std::string& address, std::string* host, int* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) return false;
  const std::string p = address.substr(colon + 1);
  if (p.size() > 5 || p.find_first_not_of("0123456789") != std::string::npos) return false;
  const int value = std::stoi(p);
  if (value > 65535) return false;
  std::string h = address.substr(0, colon);
  // A bare IPv6 address has colons of its own: it must be bracketed.
  if (h.find(':') != std::string::npos && (h.front() != '[' || h.back() != ']')) return false;
  *host = std::move(h);
  *port = value;
  return true;
}

bool IsLoopbackHost(const std::string& host) {
  if (host == "localhost" || host == "[::1]") return true;
  // 127.0.0.0/8 as a dotted quad.
  unsigned a = 0, b = 0, c = 0, d = 0;
  char tail = 0;
  return std::sscanf(host.c_str(), "%u.%u.%u.%u%c", &a, &b, &c, &d, &tail) == 4 && a == 127 &&
         b < 256 && c < 256 && d < 256;
}

std::vector<std::string> SplitCommas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::string CsvField(std::string_view s) {
  if (s.find_first_of(",\"\r\n") == std::string_view::npos) return std::string(s);
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  out += '"';
  return out;
}

namespace {

// At most `max` bytes from the start of `path`.
Result<std::string> ReadFilePrefix(const std::string& path, size_t max) {
  // A directory opens and then reads as empty: name it instead.
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return Status::IoError(path + ": cannot read: " + std::strerror(EISDIR));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IoError(path + ": cannot read: " + std::strerror(errno));
  std::string text(max, '\0');
  in.read(text.data(), std::streamsize(max));
  if (in.bad()) return Status::IoError(path + ": error while reading");
  text.resize(size_t(in.gcount()));
  return text;
}

// What a byte a token may not hold is, in words: not its value, which is part of the secret.
std::string ByteName(unsigned char c) {
  if (c == '\t') return "a tab";
  if (c == 0) return "a NUL byte";
  if (c < 0x20 || c == 0x7f) return "a control character";
  return "a non-ASCII byte";
}

}  // namespace

Result<std::string> TokenFromFileText(std::string_view text, const std::string& path) {
  const std::string_view line = text.substr(0, text.find('\n'));
  constexpr std::string_view kSpace = " \t\r";
  const size_t begin = line.find_first_not_of(kSpace);
  if (begin == std::string_view::npos) {
    return Status::InvalidArgument(path + ": the first line is empty; put the token on it");
  }
  const size_t end = line.find_last_not_of(kSpace) + 1;
  if (end - begin > kMaxTokenBytes) {
    return Status::InvalidArgument(path + ": the token on the first line is longer than " +
                                   std::to_string(kMaxTokenBytes) + " bytes");
  }
  for (size_t i = begin; i < end; ++i) {
    const unsigned char c = static_cast<unsigned char>(line[i]);
    if (c < 0x20 || c > 0x7e) {
      return Status::InvalidArgument(path + ": " + ByteName(c) + " at column " +
                                     std::to_string(i + 1) +
                                     " of the first line; a token may hold only printable ASCII "
                                     "(0x20..0x7E)");
    }
  }
  return std::string(line.substr(begin, end - begin));
}

Result<std::string> ReadTokenFile(const std::string& path) {
  // Enough for the longest token with spaces around it; a longer line is refused as too long.
  CPD_ASSIGN_OR_RETURN(const std::string text, ReadFilePrefix(path, kMaxTokenBytes + 1024));
  return TokenFromFileText(text, path);
}

Result<std::string> ReadPemFile(const std::string& path, std::string_view kind) {
  constexpr size_t kMaxPem = size_t(1) << 20;
  CPD_ASSIGN_OR_RETURN(std::string pem, ReadFilePrefix(path, kMaxPem + 1));
  if (pem.size() > kMaxPem) {
    return Status::InvalidArgument(path + ": larger than 1 MiB; not a PEM file");
  }
  const std::string want = "-----BEGIN " + std::string(kind) + "-----";
  const bool is_key = kind == "PRIVATE KEY";
  size_t begin = std::string::npos;
  if (is_key) {
    // "-----BEGIN PRIVATE KEY-----", "-----BEGIN RSA PRIVATE KEY-----", ...
    for (size_t at = pem.find("-----BEGIN "); at != std::string::npos;
         at = pem.find("-----BEGIN ", at + 1)) {
      const size_t close = pem.find("-----", at + 11);
      if (close != std::string::npos &&
          std::string_view(pem).substr(at, close - at).ends_with("PRIVATE KEY")) {
        begin = at;
        break;
      }
    }
  } else {
    begin = pem.find(want);
  }
  if (begin == std::string::npos) {
    return Status::InvalidArgument(path + ": not a PEM file with a " + std::string(kind) +
                                   " (no '" + want + "' line)");
  }
  const size_t body = pem.find('\n', begin);
  const size_t end = pem.find("-----END ", begin);
  if (body == std::string::npos || end == std::string::npos || end < body) {
    return Status::InvalidArgument(path + ": the PEM block at '" + want +
                                   "' has no '-----END' line");
  }
  if (!is_key) {
    // A certificate's body is base64: anything else would reach gRPC's parser.
    const std::string_view b64 = std::string_view(pem).substr(body, end - body);
    const size_t bad = b64.find_first_not_of(
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/= \t\r\n");
    if (bad != std::string_view::npos || b64.find_first_not_of(" \t\r\n") == std::string::npos) {
      return Status::InvalidArgument(path + ": the " + std::string(kind) +
                                     " block is not base64 text; not a PEM file");
    }
  }
  return pem;
}

}  // namespace cpd::launcher
