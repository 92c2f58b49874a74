#include "cpd/message.h"

#include <algorithm>
#include <cstdio>

namespace cpd {

namespace {

// `c` as the message helpers show it: itself when printable ASCII (or, with `keep_non_ascii`,
// a byte of UTF-8 text), else an escape.
void AppendShown(std::string* out, unsigned char c, bool keep_non_ascii) {
  static constexpr char kHex[] = "0123456789abcdef";
  switch (c) {
    case '\\':
      *out += keep_non_ascii ? "\\" : "\\\\";
      return;
    case '\n':
      *out += "\\n";
      return;
    case '\r':
      *out += "\\r";
      return;
    case '\t':
      *out += "\\t";
      return;
    case '\0':
      *out += "\\0";
      return;
    default:
      if ((c >= 0x20 && c < 0x7f) || (keep_non_ascii && c >= 0x80)) {
        *out += char(c);
        return;
      }
      *out += "\\x";
      *out += kHex[c >> 4];
      *out += kHex[c & 15];
  }
}

}  // namespace

std::string QuoteForMessage(std::string_view s, size_t max_bytes) {
  std::string out = "'";
  const size_t n = std::min(s.size(), max_bytes);
  for (size_t i = 0; i < n; ++i) AppendShown(&out, static_cast<unsigned char>(s[i]), false);
  out += '\'';
  if (s.size() > max_bytes) out += "... (" + std::to_string(s.size()) + " bytes)";
  return out;
}

std::string MessageLine(std::string_view text, size_t max_bytes) {
  std::string out;
  const size_t n = std::min(text.size(), max_bytes);
  for (size_t i = 0; i < n; ++i) AppendShown(&out, static_cast<unsigned char>(text[i]), true);
  if (text.size() > max_bytes) out += "... (" + std::to_string(text.size()) + " bytes)";
  return out;
}

std::string NumberText(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", v);
  return text;
}

}  // namespace cpd
