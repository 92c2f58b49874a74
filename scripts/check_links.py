#!/usr/bin/env python3
"""Checks that every relative link in the repository's Markdown files resolves, and that their
headings nest.

For each tracked *.md file (git ls-files), every inline link or image `[text](target)`,
`[text](target#anchor)` and every reference definition `[label]: target` must name a file or
directory that exists, relative to the Markdown file (a target starting with '/' is relative to
the repository root, as on GitHub). An `#anchor` into a Markdown file (the same file or another)
must match one of its headings' GitHub slugs: lowercase, punctuation other than '-' and '_'
dropped, spaces turned into '-', repeated headings numbered -1, -2, ...; an anchor into a file
that is not Markdown is not checked. Links with a scheme (http:, https:, mailto:, ...) are
skipped, and so is everything inside fenced code blocks and inline code spans.

Headings (ATX, outside fenced code): a page has exactly one H1, its first heading, and no
heading is more than one level deeper than the one before it (an H2 then an H4 skips a level),
so that a page's outline and its table of contents read as a tree.

Run from anywhere (ctest: test `markdown_links`); the repository is the folder above scripts/.
Prints one line per problem, `FILE:LINE: broken link 'TARGET' (REASON)` or
`FILE:LINE: heading ...`, and exits 1 when there is one; else prints a one-line summary and
exits 0. Standard library only.
"""

import os
import re
import subprocess
import sys
import unicodedata
import urllib.parse

FENCE_RE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
ATX_HEADING_RE = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT_UNDERLINE_RE = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
REFERENCE_DEF_RE = re.compile(r"^ {0,3}\[([^\]]+)\]:[ \t]*(<[^>]*>|\S+)", re.MULTILINE)
HTML_ID_RE = re.compile(r"<a\s[^>]*\b(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def mask_fences(text):
    """Returns text with its fenced code blocks replaced by spaces (newlines kept)."""
    lines = text.split("\n")
    fence = None
    for i, line in enumerate(lines):
        match = FENCE_RE.match(line)
        if fence is None:
            if match:
                fence = match.group(1)
                lines[i] = " " * len(line)
        else:
            # A fence closes with at least as many of the same character and nothing else.
            stripped = line.strip()
            if (match and stripped[0] == fence[0] and len(stripped) >= len(fence)
                    and set(stripped) == {fence[0]}):
                fence = None
            lines[i] = " " * len(line)
    return "\n".join(lines)


def mask_code(text):
    """Returns text with fenced code blocks and inline code spans replaced by spaces.

    Newlines are kept, so offsets and line numbers stay those of the original text.
    """
    text = mask_fences(text)
    # Inline code: a run of N backticks up to the next run of exactly N, within a paragraph.
    out = list(text)
    i = 0
    while i < len(text):
        if text[i] != "`":
            i += 1
            continue
        run_end = i
        while run_end < len(text) and text[run_end] == "`":
            run_end += 1
        ticks = run_end - i
        j = run_end
        closed = -1
        while j < len(text):
            if text[j] == "`":
                k = j
                while k < len(text) and text[k] == "`":
                    k += 1
                if k - j == ticks:
                    closed = k
                    break
                j = k
            elif text[j] == "\n" and re.match(r"\n[ \t]*\n", text[j:j + 80]):
                break
            else:
                j += 1
        if closed < 0:
            i = run_end
            continue
        for k in range(i, closed):
            if out[k] != "\n":
                out[k] = " "
        i = closed
    return "".join(out)


def heading_text_to_plain(text):
    """The visible text of a heading's inline Markdown, as GitHub renders it."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links and images: their text
    text = re.sub(r"!?\[([^\]]*)\]\[[^\]]*\]", r"\1", text)  # reference links
    text = re.sub(r"<[^>]+>", "", text)  # HTML tags
    return text.replace("`", "")


def github_slug(text):
    """GitHub's anchor for a heading (github-slugger): lowercase, keep letters, digits, marks,
    '_', '-' and spaces, then spaces to '-'."""
    kept = []
    for ch in heading_text_to_plain(text).strip().lower():
        category = unicodedata.category(ch)
        if ch in " -_" or category[0] in "LNM" or category == "Pc":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


ANCHORS_BY_FILE = {}


def anchors_of(path):
    """The set of anchors that the Markdown file at path defines (headings and <a name/id>)."""
    if path in ANCHORS_BY_FILE:
        return ANCHORS_BY_FILE[path]
    with open(path, encoding="utf-8") as f:
        text = f.read()
    anchors = set()
    counts = {}

    def add(slug):
        n = counts.get(slug, 0)
        counts[slug] = n + 1
        anchors.add(slug if n == 0 else "%s-%d" % (slug, n))

    # Headings are read from the text outside fenced code (inline code in them is their text).
    lines = mask_fences(text).split("\n")
    for i, line in enumerate(lines):
        match = ATX_HEADING_RE.match(line)
        if match:
            add(github_slug(match.group(2) or ""))
            continue
        previous = lines[i - 1] if i > 0 else ""
        before_previous = lines[i - 2] if i > 1 else ""
        if (SETEXT_UNDERLINE_RE.match(line) and previous.strip()
                and not previous.lstrip().startswith(("|", "-", "*", "+", ">"))
                and not ATX_HEADING_RE.match(previous)
                and (not before_previous.strip() or ATX_HEADING_RE.match(before_previous))):
            add(github_slug(previous.strip()))
    for match in HTML_ID_RE.finditer(mask_code(text)):
        anchors.add(match.group(1))
    ANCHORS_BY_FILE[path] = anchors
    return anchors


def find_inline_links(masked):
    """Yields (offset, target) of every inline link or image `[text](target "title")`."""
    i = 0
    n = len(masked)
    while True:
        close = masked.find("](", i)
        if close < 0:
            return
        # The link text must open with '[' before ']' (brackets may nest) and no blank line.
        depth = 0
        start = -1
        j = close - 1
        while j >= 0:
            ch = masked[j]
            if ch == "]":
                depth += 1
            elif ch == "[":
                if depth == 0:
                    start = j
                    break
                depth -= 1
            elif ch == "\n" and masked[j - 1:j] == "\n":
                break
            j -= 1
        # The destination: up to the matching ')', parentheses balanced.
        k = close + 2
        depth = 0
        while k < n:
            ch = masked[k]
            if ch == "\\":
                k += 2
                continue
            if ch == "(":
                depth += 1
            elif ch == ")":
                if depth == 0:
                    break
                depth -= 1
            elif ch == "\n" and masked[k + 1:k + 2] == "\n":
                break
            k += 1
        if start >= 0 and k < n and masked[k] == ")":
            destination = masked[close + 2:k].strip()
            if destination.startswith("<"):
                target = destination[1:destination.find(">")] if ">" in destination else ""
            else:
                target = destination.split()[0] if destination else ""
            yield close + 2, target
        i = close + 2


def check_target(md_path, target, root):
    """Returns why target (a link in md_path) does not resolve, or None when it does."""
    if not target:
        return "empty target"
    if SCHEME_RE.match(target) or target.startswith("//"):
        return None
    path_part, _, anchor = target.partition("#")
    path_part = urllib.parse.unquote(path_part.split("?")[0])
    anchor = urllib.parse.unquote(anchor)
    if path_part:
        if path_part.startswith("/"):
            resolved = os.path.normpath(os.path.join(root, path_part.lstrip("/")))
        else:
            resolved = os.path.normpath(os.path.join(os.path.dirname(md_path), path_part))
        if not os.path.exists(resolved):
            return "no such file: %s" % os.path.relpath(resolved, root)
    else:
        resolved = md_path
    if anchor and resolved.endswith(".md") and os.path.isfile(resolved):
        if anchor not in anchors_of(resolved):
            return "no heading with anchor '#%s' in %s" % (anchor, os.path.relpath(resolved, root))
    return None


def markdown_files(root):
    """The tracked *.md files under root (git ls-files); outside a git checkout (a source
    tarball), every *.md file except in hidden and build* folders."""
    try:
        listed = subprocess.run(["git", "-C", root, "ls-files", "-z", "*.md"],
                                capture_output=True, text=True, check=True).stdout.split("\0")
        return sorted(f for f in listed if f and os.path.isfile(os.path.join(root, f)))
    except (OSError, subprocess.CalledProcessError):
        found = []
        for folder, subfolders, names in os.walk(root):
            subfolders[:] = [d for d in subfolders if not d.startswith((".", "build"))]
            found += [os.path.relpath(os.path.join(folder, n), root) for n in names
                      if n.endswith(".md")]
        return sorted(found)


def heading_problems(text):
    """(line, problem) for each heading that breaks the nesting rules above."""
    problems = []
    previous = 0
    h1_lines = []
    for i, line in enumerate(mask_fences(text).split("\n")):
        match = ATX_HEADING_RE.match(line)
        if not match:
            continue
        level = len(match.group(1))
        if level == 1:
            h1_lines.append(i + 1)
        if previous == 0 and level != 1:
            problems.append((i + 1, "heading: the first heading is H%d, not the page's H1" % level))
        elif previous and level > previous + 1:
            problems.append((i + 1, "heading: H%d follows H%d (a level skipped)" % (level, previous)))
        previous = level
    for extra in h1_lines[1:]:
        problems.append((extra, "heading: a second H1 (a page has one title)"))
    if previous == 0:
        problems.append((1, "heading: the page has no H1 title"))
    return problems


def main():
    # The repository is the folder above this script's, wherever it is run from.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = markdown_files(root)
    broken = 0
    links = 0
    for relative in files:
        md_path = os.path.join(root, relative)
        with open(md_path, encoding="utf-8") as f:
            text = f.read()
        for line, problem in heading_problems(text):
            broken += 1
            print("%s:%d: %s" % (relative, line, problem))
        masked = mask_code(text)
        found = list(find_inline_links(masked))
        found += [(m.start(2), m.group(2).strip("<>")) for m in REFERENCE_DEF_RE.finditer(masked)]
        for offset, target in sorted(found):
            if SCHEME_RE.match(target) or target.startswith("//"):
                continue
            links += 1
            reason = check_target(md_path, target, root)
            if reason:
                broken += 1
                line = masked.count("\n", 0, offset) + 1
                print("%s:%d: broken link '%s' (%s)" % (relative, line, target, reason))
    if broken:
        print("check_links: %d problem(s) (broken links or headings) in %d Markdown files, "
              "%d relative links" % (broken, len(files), links))
        return 1
    print("check_links: %d links in %d Markdown files, all resolve; headings nest" %
          (links, len(files)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
