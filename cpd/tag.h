// The names a user chooses for what CPD keeps under a name — coordinator jobs, studies, study
// runs (also directory names): 1 to N of A-Z a-z 0-9 . _ -, so that they are safe as file names,
// in URLs and on command lines. One rule for the trainer, the coordinator, cpdctl and cpd-study.
#pragma once

#include <cstddef>
#include <string_view>

namespace cpd {

inline constexpr std::size_t kMaxJobNameLength = 128;
inline constexpr std::size_t kMaxStudyNameLength = 64;
// How the rule reads in messages and help texts.
inline constexpr const char* kTagCharacters = "A-Z a-z 0-9 . _ -";

constexpr bool IsTagCharacter(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

// Whether every character of `name` is a tag character (true for an empty name).
constexpr bool HasOnlyTagCharacters(std::string_view name) {
  for (char c : name) {
    if (!IsTagCharacter(c)) return false;
  }
  return true;
}

// A tag: 1 to max_length tag characters.
constexpr bool IsTag(std::string_view name, std::size_t max_length) {
  return !name.empty() && name.size() <= max_length && HasOnlyTagCharacters(name);
}

}  // namespace cpd
