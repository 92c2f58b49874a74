#!/usr/bin/env python3
"""Reports every function longer than a limit (150 lines) in the project's C++ and CUDA sources.

    scripts/check_function_length.py [--limit N] [PATH...]

PATH (files or folders, default: kernels cpd comm runtime launcher benchmarks under the
repository root) are scanned for *.h, *.cc, *.cu, *.cuh and *.inc files. A function is counted
from the first line of its declaration to its closing brace. Each one over the limit is printed
as 'path:line: function NAME is N lines (limit 150)' and the exit status is 1; otherwise one
summary line is printed and the status is 0 (2 for a usage error or an unreadable file).

The scanner matches braces after blanking comments, string, raw string and character literals
(a ' between digits is a digit separator) and preprocessor lines, keeping only the first branch
of each #if/#ifdef chain so that branches which each open a brace count once. A brace at
namespace or class scope opens a function when the text before it is a declarator (a parameter
list, then qualifiers, a trailing return type or a constructor's initializers), or a lambda
assigned to a variable; namespace, extern "C", class, struct, union and enum bodies are scopes,
not functions, and whatever a function contains (lambdas, local classes) counts as its lines.
Issue 27 set the limit: a function that does not fit a few screens is split into named steps.
"""

import argparse
import os
import re
import sys

LIMIT = 150
FOLDERS = ("kernels", "cpd", "comm", "runtime", "launcher", "benchmarks")
EXTENSIONS = (".h", ".cc", ".cu", ".cuh", ".inc")

_IDENT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_RAW_PREFIXES = ("R", "u8R", "uR", "UR", "LR")
_CONDITIONAL_OPEN = ("if", "ifdef", "ifndef")
_CONDITIONAL_ALTERNATIVE = ("elif", "else", "elifdef", "elifndef")


def _blank(text):
    """`text` with every character but newlines replaced by a space (keeps line numbers)."""
    return re.sub(r"[^\n]", " ", text)


def _preceding_token(src, i):
    """The identifier or number characters (and digit separators) that end just before src[i]."""
    j = i
    while j > 0 and (src[j - 1] in _IDENT_CHARS or src[j - 1] == "'"):
        j -= 1
    return src[j:i]


def strip_literals_and_comments(src):
    """src with comments and string, raw string and character literals blanked."""
    out = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if c == "/" and src.startswith("//", i):
            j = i
            while True:  # a backslash before the newline continues the comment
                j = src.find("\n", j)
                if j < 0:
                    j = n
                    break
                if src[j - 1] != "\\":
                    break
                j += 1
            out.append(_blank(src[i:j]))
            i = j
        elif c == "/" and src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(_blank(src[i:j]))
            i = j
        elif c == '"':
            if _preceding_token(src, i) in _RAW_PREFIXES:
                m = re.match(r'"([^()\\\s]{0,16})\(', src[i:])
                if m:
                    end = src.find(")" + m.group(1) + '"', i)
                    j = n if end < 0 else end + len(m.group(1)) + 2
                    out.append(_blank(src[i:j]))
                    i = j
                    continue
            j = _end_of_quoted(src, i)
            out.append(_blank(src[i:j]))
            i = j
        elif c == "'":
            token = _preceding_token(src, i)
            if token[:1].isdigit():  # 1'000'000
                out.append(c)
                i += 1
                continue
            j = _end_of_quoted(src, i)
            out.append(_blank(src[i:j]))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _end_of_quoted(src, i):
    """The index just past the literal that starts with the quote src[i] (or the line's end)."""
    quote, j, n = src[i], i + 1, len(src)
    while j < n and src[j] != quote and src[j] != "\n":
        j += 2 if src[j] == "\\" else 1
    return min(j + 1, n)


def strip_preprocessor(code):
    """Blanks preprocessor lines (with their continuations) and every branch of an #if chain but
    the first; `code` has no comments or literals left."""
    lines = code.split("\n")
    out = []
    # Per open #if: whether the branch being read is skipped (a later branch, or inside one).
    skipping = []
    i = 0
    while i < len(lines):
        line = lines[i]
        directive = re.match(r"\s*#\s*(\w*)", line)
        if not directive:
            out.append(_blank(line) if skipping and skipping[-1] else line)
            i += 1
            continue
        block = [line]
        while block[-1].endswith("\\") and i + 1 < len(lines):
            i += 1
            block.append(lines[i])
        word = directive.group(1)
        if word in _CONDITIONAL_OPEN:
            skipping.append(bool(skipping and skipping[-1]))
        elif word in _CONDITIONAL_ALTERNATIVE and skipping:
            skipping[-1] = True
        elif word == "endif" and skipping:
            skipping.pop()
        out.extend(_blank(b) for b in block)
        i += 1
    return "\n".join(out)


# ---- Declarations in front of a brace

_ACCESS = re.compile(r"^(?:(?:public|private|protected)\s*:(?!:)\s*)+")
# Specifiers with arguments that may precede a declarator's name (or, decltype, be its type).
_SPECIFIER_CALLS = ("__attribute__", "__launch_bounds__", "__declspec", "alignas", "decltype")
_CLASS_KEY = re.compile(r"^(?:typedef\s+)?(?:class|struct|union|enum)\b")


def _matching(text, i, open_c, close_c):
    """The index of the bracket that closes text[i] (an open_c), or -1."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_c:
            depth += 1
        elif text[j] == close_c:
            depth -= 1
            if depth == 0:
                return j
    return -1


def _remove_calls(text, names):
    """text without `name(...)` for each name (attributes), and without [[...]]."""
    text = re.sub(r"\[\[.*?\]\]", " ", text, flags=re.S)
    for name in names:
        while True:
            m = re.search(r"\b" + name + r"\s*\(", text)
            if not m:
                break
            close = _matching(text, m.end() - 1, "(", ")")
            if close < 0:
                break
            text = text[:m.start()] + " " * (close + 1 - m.start()) + text[close + 1:]
    return text


def _remove_template_prefix(text):
    """text without its leading `template <...>` clauses."""
    while True:
        m = re.match(r"\s*template\s*<", text)
        if not m:
            return text
        close = _matching(text, m.end() - 1, "<", ">")
        if close < 0:
            return text
        text = text[close + 1:]


def _first_parameter_list(text):
    """Index of the '(' that opens the declarator's parameters: after an operator's name (whose
    own symbols may be "()"), else the first one outside template arguments. -1 when none."""
    m = re.search(r"\boperator\b", text)
    if m:
        call = re.match(r"\s*\(\s*\)", text[m.end():])
        return text.find("(", m.end() + (call.end() if call else 0))
    angle = 0
    for i, c in enumerate(text):
        if c == "<":
            angle += 1
        elif c == ">" and angle > 0:
            angle -= 1
        elif c == "(" and angle == 0:
            return i
    return -1


def _is_declarator_tail(tail):
    """Whether `tail`, the text after a parameter list's ')', can precede a function body:
    qualifiers, noexcept(...), a trailing return type, a constructor's initializers."""
    tail = tail.strip()
    while True:
        m = re.match(r"(?:const|volatile|override|final|mutable|&&|&|try)\b\s*|&&\s*|&\s*", tail)
        if m and m.end() > 0:
            tail = tail[m.end():]
            continue
        if tail.startswith("noexcept"):
            rest = tail[len("noexcept"):].lstrip()
            if rest.startswith("("):
                close = _matching(rest, 0, "(", ")")
                if close < 0:
                    return False
                rest = rest[close + 1:]
            tail = rest.lstrip()
            continue
        break
    if not tail or tail.startswith("->"):
        return True
    if tail.startswith(":") and not tail.startswith("::"):
        # A constructor's member initializers, complete: "a_(x), b_{y}" (not "a_(x), b_", whose
        # brace initializes b_).
        return tail.endswith((")", "}"))
    if tail.startswith("requires"):
        return True
    return False


def classify(header):
    """What a '{' after `header` (the statement's text so far, at namespace or class scope)
    opens: ('namespace', None), ('class', NAME), ('function', NAME) or ('other', None)."""
    text = _ACCESS.sub("", header.strip())
    if re.match(r"^(?:inline\s+)?namespace\b", text) or re.fullmatch(r"extern\s*", text):
        return ("namespace", None)
    text = _remove_template_prefix(_remove_calls(text, _SPECIFIER_CALLS)).strip()
    paren = _first_parameter_list(text)
    # An '=' before the parameters makes a variable (operator=, operator== are names).
    assign = None if re.search(r"\boperator\b", text) else re.search(r"(?<![=!<>])=(?!=)", text)
    if assign and (paren < 0 or assign.start() < paren):
        # A variable's initializer: a function only where a lambda is assigned.
        value = text[assign.end():].lstrip()
        if value.startswith("["):
            m = re.search(r"([\w:]+)\s*$", text[:assign.start()])
            return ("function", m.group(1) if m else "<lambda>")
        return ("other", None)
    if _CLASS_KEY.match(text):
        if paren < 0 or not _is_declarator_tail(text[_matching(text, paren, "(", ")") + 1:]):
            m = re.match(r"(?:typedef\s+)?(?:class|struct|union|enum)\s+(?:class\s+|struct\s+)?"
                         r"(?:[A-Z_][A-Z0-9_]*\s+)*(\w+)", text)
            return ("class", m.group(1) if m else None)
    if paren < 0:
        return ("other", None)
    close = _matching(text, paren, "(", ")")
    if close < 0 or not _is_declarator_tail(text[close + 1:]):
        return ("other", None)
    m = re.search(r"((?:~\s*)?[\w:]*\w(?:\s*<[^()]*>)?|operator\b.*)\s*$", text[:paren])
    name = m.group(1) if m else text[:paren]
    # One space between words ("operator bool"), none next to a symbol ("~Box", "operator()").
    name = re.sub(r" (?=\W)|(?<=\W) ", "", re.sub(r"\s+", " ", name.strip()))
    if not name or re.fullmatch(r"\w+", name) and name in ("if", "for", "while", "switch",
                                                            "catch", "return", "sizeof"):
        return ("other", None)
    return ("function", name)


def find_functions(src):
    """(name, first line, last line) of every function in C++ source text `src`. Raises
    ValueError where the braces do not match (the scan cannot be trusted there)."""
    code = strip_preprocessor(strip_literals_and_comments(src))
    functions = []
    # Open scopes: (kind, name, first line, start of the statement being read inside it).
    scopes = [("namespace", None, 1, 0)]
    line = 1
    i = 0
    n = len(code)
    while i < n:
        c = code[i]
        if c == "\n":
            line += 1
        elif c == "{":
            kind, _, _, start = scopes[-1]
            if kind in ("namespace", "class"):
                header = code[start:i]
                new_kind, name = classify(header)
                stripped = len(header) - len(header.lstrip())
                access = _ACCESS.match(header.lstrip())
                first = start + stripped + (access.end() if access else 0)
                first_line = line - code.count("\n", first, i)
                scopes.append((new_kind, name, first_line, i + 1))
            else:
                scopes.append(("inner", None, line, i + 1))
        elif c == "}":
            if len(scopes) == 1:
                raise ValueError(f"line {line}: '}}' closes nothing")
            kind, name, first_line, _ = scopes.pop()
            if kind == "function":
                owners = [s[1] for s in scopes if s[0] == "class" and s[1]]
                functions.append(("::".join(owners + [name]), first_line, line))
            parent = scopes[-1]
            if parent[0] in ("namespace", "class") and kind != "other":
                scopes[-1] = parent[:3] + (i + 1,)
        elif c == ";":
            parent = scopes[-1]
            if parent[0] in ("namespace", "class"):
                scopes[-1] = parent[:3] + (i + 1,)
        i += 1
    if len(scopes) > 1:
        raise ValueError(f"line {scopes[-1][2]}: '{{' is never closed")
    return functions


def source_files(paths):
    for path in paths:
        if os.path.isfile(path):
            yield path
            continue
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for f in sorted(files):
                if f.endswith(EXTENSIONS):
                    yield os.path.join(root, f)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, default=LIMIT, help="most lines a function may have")
    parser.add_argument("paths", nargs="*", help="files or folders (default: the project's)")
    args = parser.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = args.paths or [os.path.join(root, d) for d in FOLDERS]
    long_functions = []
    count = files = 0
    longest = None
    for path in source_files(paths):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                src = f.read()
        except OSError as e:
            print(f"check_function_length: cannot read {path}: {e.strerror}", file=sys.stderr)
            return 2
        files += 1
        shown = os.path.relpath(path, root) if not args.paths else path
        try:
            functions = find_functions(src)
        except ValueError as e:
            print(f"{shown}: check_function_length cannot match the braces: {e}", file=sys.stderr)
            return 2
        for name, first, last in functions:
            count += 1
            lines = last - first + 1
            if longest is None or lines > longest[0]:
                longest = (lines, name, shown, first)
            if lines > args.limit:
                long_functions.append((shown, first, name, lines))
    for shown, first, name, lines in long_functions:
        print(f"{shown}:{first}: function {name} is {lines} lines (limit {args.limit})")
    if long_functions:
        return 1
    summary = (f"check_function_length: {count} functions in {files} files, none over "
               f"{args.limit} lines")
    if longest:
        summary += f" (longest: {longest[1]}, {longest[0]} lines, {longest[2]}:{longest[3]})"
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
