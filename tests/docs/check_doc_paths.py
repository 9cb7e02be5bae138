#!/usr/bin/env python3
"""Checks that every repository path a Markdown document cites exists.

    check_doc_paths.py [--root DIR] DOC.md|DIR [DOC.md|DIR ...]

A directory stands for every *.md file directly in it, found when the check runs (so a new page
under docs/ is checked without touching the build); a directory without one is an error.

The rule (docs/ARCHITECTURE.md states it on its first line):

  A CITED PATH is the text of an inline code span that
    1. lies on one line, outside fenced code blocks (a block opens with a line of three or more
       backticks or tildes, indented at most 3 spaces, and closes with a line of the same
       character at least as long, as CommonMark says); the span is delimited by two backtick
       runs of the same length (`x` or ``x``), one leading and one trailing space stripped when
       both are present;
    2. consists only of the characters A-Z a-z 0-9 _ . / + - (so spans with spaces, placeholders
       such as <name> or {b}, globs, '::' or '=' are not paths);
    3. contains a '/' or ends in one of SOURCE_EXTENSIONS.
  A cited path is resolved relative to the repository root and must name an existing file or
  directory there; one ending in '/' must be a directory. An absolute path or one with a '..'
  component is an error too: the document must cite repository-relative paths.

File names that only describe formats (manifest.json, config.json, model.safetensors) are not
cited paths: .json and .safetensors are not source extensions and they contain no '/'.

Prints one line per problem, "DOC:LINE: `PATH` ...", and exits 1 when there is any problem or
when a document cites no path at all (a document that cites nothing checks nothing, which
would hide a broken rule); 0 otherwise.
"""

import argparse
import os
import re
import sys

SOURCE_EXTENSIONS = (
    ".h", ".cc", ".cu", ".cuh", ".c", ".inc", ".py", ".cmake", ".txt", ".md", ".sh", ".map",
    ".in", ".toml",
)

_PATH_CHARS = re.compile(r"^[A-Za-z0-9_./+-]+$")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def code_spans(line):
    """The inline code spans of one line, as CommonMark delimits them (single line only)."""
    spans = []
    i = 0
    n = len(line)
    while i < n:
        if line[i] != "`":
            i += 1
            continue
        j = i
        while j < n and line[j] == "`":
            j += 1
        run = j - i
        # The closing run: the next run of exactly `run` backticks.
        k = j
        close = -1
        while k < n:
            if line[k] != "`":
                k += 1
                continue
            m = k
            while m < n and line[m] == "`":
                m += 1
            if m - k == run:
                close = k
                break
            k = m
        if close < 0:
            i = j  # an unmatched run is literal text
            continue
        text = line[j:close]
        if len(text) >= 2 and text[0] == " " and text[-1] == " " and text.strip(" "):
            text = text[1:-1]
        spans.append(text)
        i = close + run
    return spans


def is_cited_path(text):
    """Whether an inline code span's text is a cited path (rules 2 and 3)."""
    if not text or not _PATH_CHARS.match(text):
        return False
    return "/" in text or text.endswith(SOURCE_EXTENSIONS)


def cited_paths(markdown):
    """[(line number, path)] of every cited path in a document's text, in order."""
    out = []
    fence = None  # the opening fence's character and length while inside a fenced block
    for number, line in enumerate(markdown.splitlines(), start=1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = (m.group(1)[0], len(m.group(1)))
            continue
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= fence[1] \
                    and not line[m.end():].strip():
                fence = None
            continue
        for text in code_spans(line):
            if is_cited_path(text):
                out.append((number, text))
    return out


def problem(root, path):
    """Why `path` does not name something in the repository at `root`, or None."""
    if path.startswith("/"):
        return "is absolute: cite paths relative to the repository root"
    parts = path.rstrip("/").split("/")
    if ".." in parts:
        return "leaves the repository ('..')"
    relative = path[2:] if path.startswith("./") else path
    full = os.path.join(root, relative)
    if path.endswith("/"):
        return None if os.path.isdir(full) else "is not a directory of the repository"
    return None if os.path.exists(full) else "does not exist in the repository"


def check(doc_path, root):
    """Problems of one document as printable lines, and the number of cited paths."""
    with open(doc_path, encoding="utf-8") as f:
        paths = cited_paths(f.read())
    lines = []
    for number, path in paths:
        why = problem(root, path)
        if why:
            lines.append(f"{doc_path}:{number}: `{path}` {why} ({root})")
    if not paths:
        lines.append(f"{doc_path}: cites no repository path (is the rule broken?)")
    return lines, len(paths)


def expand(args):
    """The documents named by the command line, a directory replaced by its *.md files (sorted),
    and the problems of arguments that name no document."""
    docs, problems = [], []
    for arg in args:
        if os.path.isdir(arg):
            found = sorted(os.path.join(arg, name) for name in os.listdir(arg)
                           if name.endswith(".md") and os.path.isfile(os.path.join(arg, name)))
            if not found:
                problems.append(f"{arg}: a directory with no *.md file to check")
            docs.extend(found)
        elif os.path.isfile(arg):
            docs.append(arg)
        else:
            problems.append(f"{arg}: no such document or directory")
    return docs, problems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser.add_argument("--root", default=default_root, help="repository root (default: this "
                        "script's ../..)")
    parser.add_argument("docs", nargs="+",
                        help="Markdown files to check, or directories: every *.md file in them")
    args = parser.parse_args(argv)
    docs, problems = expand(args.docs)
    for line in problems:
        print(line)
    failed = bool(problems)
    for doc in docs:
        lines, count = check(doc, args.root)
        for line in lines:
            print(line)
        if lines:
            failed = True
        else:
            print(f"{doc}: all {count} cited paths exist")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
