// Text someone else chose (a flag's value, a file's line, a client's field), shown in an error
// message: the one home of that quoting for every tool and library.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace cpd {

// A string someone else chose (a flag's value, a client's field, a file's line), for an error
// message: in single quotes, its first `max_bytes` bytes, then "..." and the full length when it
// is longer; every byte outside printable ASCII is escaped (\n, \t, \0, \xNN; a backslash is
// \\). Whatever it quotes, the message stays one short line of plain text: a NUL does not cut
// it short, a 400 KB argument does not fill the terminal, garbage does not reach it raw.
// QuoteForMessage("a\tb") == "'a\\tb'" (the six characters 'a\tb').
std::string QuoteForMessage(std::string_view s, size_t max_bytes = 60);

// A whole message (one that may carry text from elsewhere: a server's error, a library's parse
// error echoing an argument) as one line: control bytes escaped as QuoteForMessage does (UTF-8
// text is kept), cut after `max_bytes` bytes with "... (N bytes)". FailWith prints every
// program's last line through it.
std::string MessageLine(std::string_view text, size_t max_bytes = 2000);

// A number as a user would write it, for a message: printf's %g (-1, 0.5, 1e+30, nan).
std::string NumberText(double v);

}  // namespace cpd
