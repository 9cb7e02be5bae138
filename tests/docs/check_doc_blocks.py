#!/usr/bin/env python3
"""Runs the command blocks of Markdown documents and checks the output lines they quote.

    check_doc_blocks.py --root REPO --strata BIN [--tier run|long] [--keep] DOC.md|DIR ...

A directory stands for every *.md file directly in it. The convention (docs/continuous-checks.md,
"Documentation that runs", states it for authors):

  MARKED BLOCKS. A fenced block whose info string has a word `check=KIND`:
    check=run    runs on the host backend in seconds: run by the default tier (ctest, label docs)
    check=long   runs on the host backend but takes longer (a full training run): run by the
                 `long` tier (ctest -L docs_long) and parsed by the default one
    check=parse  needs what a test machine has not (a GPU, MPI across machines, a drive, a model
                 from the Hub, hours): parsed only
    check=none   is not a command block of Strata (build steps, other programs): left alone
  Every block whose language is sh, bash, console or empty must carry one (a new block cannot
  slip past the check unmarked); blocks of other languages (json, c, python, cmake) may.

  COMMANDS AND QUOTED OUTPUT. In an sh/bash block every line is shell; a line ending in '\\'
  continues on the next; a comment line '#' followed by at least three spaces quotes output of
  the command before it; other comment lines are comments. In a console block (or a block with
  no language) a line starting with '$ ' is a command and the lines after it are its output.

  MATCHING. A quoted line is split at each ellipsis ('...' or the character U+2026); the pieces
  must appear in one line of the command's output (stdout and stderr together), in order, the
  first at the line's start and the last at its end (an ellipsis at either end frees that end),
  all compared without surrounding white space (white space next to an ellipsis does not count). A number is matched to the digits shown: a
  piece that ends in a digit cannot be followed by another digit, or by '.' and a digit, and one
  that starts with a digit cannot follow a digit or '.'. A quoted line that is only an ellipsis
  stands for lines left out and matches nothing.

  RUNNING. The runnable blocks of one document run, in order, as one bash script (set -e and
  pipefail) in a fresh scratch directory that holds a symbolic link to every top-level entry of
  the repository (data/, tests/, bench/, ...; not build/), build/release/tools/strata and
  bin/strata (first on PATH) pointing at the binary under test, so `strata`,
  `./build/release/tools/strata` and `$S` all run it. '/mnt/' and '/tmp/strata/' in a command
  become directories of the scratch directory, where mnt/nvme0 ... mnt/nvme3 exist (the drives). A command that exits non-zero fails the check
  with its output; so does a quoted line that no output line matches.

  PARSING. Every command of every marked block that runs Strata (`strata`, a path ending in
  /strata, or a variable assigned one) is checked: its subcommand exists, and each of its
  `--flags` is listed by `strata SUBCOMMAND --help` (the first token of an option line, split at
  ','). Every token of any command that starts with a top-level entry of the repository and a
  '/' (data/..., tests/..., bench/...) must name an existing path.

Prints one line per problem, "DOC:LINE: ...", and a line per document with the blocks run and
parsed and the seconds taken; exits 1 when there is any problem or no marked block at all.
"""

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

KINDS = ("run", "long", "parse", "none")
SHELL_LANGUAGES = ("sh", "bash", "shell")
CONSOLE_LANGUAGES = ("console", "")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
_QUOTE = re.compile(r"^\s*#\s{3,}(.*)$")
_ELLIPSIS = re.compile(r"\.\.\.|\u2026")
# Commands are rewritten so that they write nowhere outside the scratch directory.
# An absolute path, not one that follows a name or another path: $X/mnt/ stays.
SUBSTITUTIONS = ((re.compile(r"(?<![\w/}.])/mnt/"), "$STRATA_DOC_SCRATCH/mnt/"),
                 (re.compile(r"(?<![\w/}.])/tmp/strata/"), "$STRATA_DOC_SCRATCH/tmp/strata/"))


class Command:
    def __init__(self, line, text):
        self.line = line      # 1-based line of the document where the command starts
        self.text = text      # the command, continuations joined with newlines kept
        self.quoted = []      # (line, text) of each quoted output line


class Block:
    def __init__(self, doc, line, language, kind):
        self.doc = doc
        self.line = line      # line of the opening fence
        self.language = language
        self.kind = kind      # one of KINDS, or None when unmarked
        self.commands = []


def parse_info(info):
    """(language, kind or None, error or None) of a fence's info string."""
    words = info.split()
    language = words[0] if words and "=" not in words[0] else ""
    kind = None
    for w in words:
        if w.startswith("check="):
            kind = w[len("check="):]
            if kind not in KINDS:
                return language, None, f"unknown check kind '{kind}' (one of {', '.join(KINDS)})"
    return language, kind, None


def split_commands(body, first_line, console):
    """The commands of a block's body lines, each with its quoted output lines."""
    commands = []
    i = 0
    pending = None  # a command still continued with '\'
    while i < len(body):
        raw = body[i]
        n = first_line + i
        i += 1
        if pending is not None:
            pending.text += "\n" + raw
            if not raw.rstrip().endswith("\\"):
                pending = None
            continue
        if console:
            if raw.startswith("$ "):
                cmd = Command(n, raw[2:])
                commands.append(cmd)
                if raw.rstrip().endswith("\\"):
                    pending = cmd
            elif raw.strip() and commands:
                commands[-1].quoted.append((n, raw.strip()))
            continue
        m = _QUOTE.match(raw)
        if m:
            if commands:
                commands[-1].quoted.append((n, m.group(1).strip()))
            continue
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        cmd = Command(n, raw)
        commands.append(cmd)
        if raw.rstrip().endswith("\\"):
            pending = cmd
    return commands


def read_blocks(doc):
    """Every fenced block of a document, with its commands when it is a command block."""
    with open(doc, encoding="utf-8") as f:
        lines = f.read().split("\n")
    blocks, problems = [], []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence = m.group(1)
        language, kind, error = parse_info(m.group(2))
        start = i + 1
        body = []
        i += 1
        while i < len(lines):
            close = _FENCE.match(lines[i])
            if close and close.group(1)[0] == fence[0] and len(close.group(1)) >= len(fence) \
                    and not close.group(2).strip():
                break
            body.append(lines[i])
            i += 1
        i += 1
        if error:
            problems.append(f"{doc}:{start}: {error}")
        block = Block(doc, start, language, kind)
        command_block = language in SHELL_LANGUAGES or language in CONSOLE_LANGUAGES
        if command_block and kind is None:
            problems.append(f"{doc}:{start}: a command block without check=run|long|parse|none "
                            f"(docs/continuous-checks.md, \"Documentation that runs\")")
        if kind in ("run", "long", "parse"):
            block.commands = split_commands(body, start + 1, language in CONSOLE_LANGUAGES)
            if not block.commands:
                problems.append(f"{doc}:{start}: check={kind} but the block has no command")
        blocks.append(block)
    return blocks, problems


def quoted_line_regex(quoted):
    """The regex of one quoted output line (the matching rule of the module's docstring)."""
    pieces = _ELLIPSIS.split(quoted.strip())
    parts = []
    for k, piece in enumerate(pieces):
        piece = piece.strip()  # white space next to an ellipsis or at either end does not count
        if piece and piece[0].isdigit():
            parts.append(r"(?<![0-9.])")
        parts.append(re.escape(piece))
        if piece and piece[-1].isdigit():
            parts.append(r"(?![0-9]|\.[0-9])")
        if k < len(pieces) - 1:
            parts.append(".*?")
    return re.compile("^" + "".join(parts) + "$")


def is_only_ellipsis(quoted):
    return not _ELLIPSIS.sub("", quoted).strip()


def matches(quoted, output_lines):
    regex = quoted_line_regex(quoted)
    return any(regex.match(line.strip()) for line in output_lines)


# --- parsing: flags and paths -----------------------------------------------------------------

def help_flags(strata, args, cache):
    """The --flags `strata ARGS --help` lists, or None when the command does not exist."""
    key = tuple(args)
    if key not in cache:
        r = subprocess.run([strata, *args, "--help"], capture_output=True, text=True)
        if r.returncode != 0:
            cache[key] = None
        else:
            flags = set()
            for line in r.stdout.splitlines():
                words = line.split()
                if not words or not words[0].startswith("-"):
                    continue
                for name in words[0].split(","):
                    name = name.split("=")[0].rstrip(":")
                    if name.startswith("--"):
                        flags.add(name)
            cache[key] = flags
    return cache[key]


def subcommands(strata, cache):
    """The subcommands `strata --help` lists."""
    if "__subcommands__" not in cache:
        r = subprocess.run([strata, "--help"], capture_output=True, text=True)
        names = set()
        in_list = False
        for line in r.stdout.splitlines():
            if line.strip().upper().startswith("SUBCOMMANDS"):
                in_list = True
                continue
            if in_list and line.startswith("  ") and line.split():
                names.add(line.split()[0])
        cache["__subcommands__"] = names
    return cache["__subcommands__"]


def tokens_of(text):
    lexer = shlex.shlex(text.replace("\\\n", " "), posix=True, punctuation_chars=";&|<>()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        return list(lexer)
    except ValueError:
        return text.split()


def check_command(doc, cmd, root, top_level, strata, strata_vars, cache):
    """Problems of one command's flags and repository paths."""
    problems = []
    toks = tokens_of(cmd.text)
    # Variables that name the binary: S=./build/release/tools/strata.
    for t in toks:
        m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", t)
        if m and (m.group(2) == "strata" or m.group(2).endswith("/strata")):
            strata_vars.add("$" + m.group(1))
    for t in toks:
        path = t.rstrip(",;:)")
        first = path.split("/")[0] if "/" in path else ""
        if first in top_level and not re.search(r"[{}$*<>]", path):
            if not os.path.exists(os.path.join(root, path)):
                problems.append(f"{doc}:{cmd.line}: `{path}` does not exist in the repository")
    i = 0
    while i < len(toks):
        t = toks[i]
        names_strata = t == "strata" or t.endswith("/strata") or t in strata_vars
        # The value of a flag (--strata build/release/tools/strata) is not an invocation.
        if names_strata and not (i > 0 and toks[i - 1].startswith("-")):
            j = i + 1
            sub = []
            while j < len(toks) and not toks[j].startswith("-") and toks[j] in subcommands(strata, cache) \
                    and not sub:
                sub.append(toks[j])
                j += 1
            if j < len(toks) and not sub and not toks[j].startswith("-") and toks[j] not in ";&|":
                problems.append(f"{doc}:{cmd.line}: `strata {toks[j]}`: no such subcommand")
                return problems
            flags = help_flags(strata, sub, cache)
            if flags is None:
                problems.append(f"{doc}:{cmd.line}: `strata {' '.join(sub)} --help` fails")
                return problems
            while j < len(toks) and toks[j] not in (";", "&&", "||", "|", "&", ">", ">>", "<"):
                tok = toks[j]
                if tok.startswith("--") and tok != "--":
                    name = tok.split("=")[0]
                    if name not in flags:
                        where = "strata " + " ".join(sub) if sub else "strata"
                        problems.append(f"{doc}:{cmd.line}: `{name}` is not a flag of `{where}` "
                                        f"(not in its --help)")
                j += 1
            i = j
        else:
            i += 1
    return problems


# --- running ----------------------------------------------------------------------------------

def make_scratch(root, strata):
    scratch = tempfile.mkdtemp(prefix="strata-docs-")
    for name in sorted(os.listdir(root)):
        if name in ("build", ".git") or name.startswith("."):
            continue
        os.symlink(os.path.join(root, name), os.path.join(scratch, name))
    os.makedirs(os.path.join(scratch, "build", "release", "tools"))
    os.symlink(strata, os.path.join(scratch, "build", "release", "tools", "strata"))
    for k in range(4):  # the drives /mnt/nvme0../mnt/nvme3 a page may name, mounted
        os.makedirs(os.path.join(scratch, "mnt", f"nvme{k}"))
    os.makedirs(os.path.join(scratch, "bin"))
    os.symlink(strata, os.path.join(scratch, "bin", "strata"))
    return scratch


def shell_text(text):
    for old, new in SUBSTITUTIONS:
        text = old.sub(lambda m: new, text)
    return text


def run_document(doc, commands, root, strata, keep, timeout):
    """Runs the commands in one bash script; returns (problems, seconds per command)."""
    scratch = make_scratch(root, strata)
    out_dir = os.path.join(scratch, ".doc-out")
    os.makedirs(out_dir)
    script = ["set -o pipefail", f'cd "{scratch}"']
    for k, cmd in enumerate(commands):
        script.append(f'echo "$EPOCHREALTIME" > "{out_dir}/{k}.start"')
        script.append("{ " + shell_text(cmd.text) + "\n} >\"" + out_dir + f"/{k}.out\" 2>&1 || "
                      f'{{ echo $? > "{out_dir}/{k}.rc"; exit 1; }}')
        script.append(f'echo "$EPOCHREALTIME" > "{out_dir}/{k}.end"')
    env = dict(os.environ)
    env["PATH"] = os.path.join(scratch, "bin") + os.pathsep + env.get("PATH", "")
    env["STRATA_DOC_SCRATCH"] = scratch
    problems = []
    try:
        r = subprocess.run(["bash", "-c", "\n".join(script)], env=env, timeout=timeout,
                           capture_output=True, text=True)
        if r.returncode != 0 and not any(os.path.exists(os.path.join(out_dir, f"{k}.rc"))
                                         for k in range(len(commands))):
            problems.append(f"{doc}: the script failed: {r.stderr.strip()}")
    except subprocess.TimeoutExpired:
        problems.append(f"{doc}: the commands did not finish in {timeout} s")
    seconds = []
    for k, cmd in enumerate(commands):
        out_path = os.path.join(out_dir, f"{k}.out")
        if not os.path.exists(out_path):
            # Nothing ran it: the script stopped before (a command failed or timed out, reported
            # above) or bash could not parse the commands (a quote left open across lines).
            # (Without a timeout problem, `r` is the finished script.)
            if not problems:
                problems.append(f"{doc}:{cmd.line}: did not run (the script stopped before it"
                                f"{': ' + r.stderr.strip()[-300:] if r.stderr.strip() else ''}): "
                                f"{cmd.text.strip().splitlines()[0]}")
            break
        with open(out_path, encoding="utf-8", errors="replace") as f:
            output = f.read()
        rc_path = os.path.join(out_dir, f"{k}.rc")
        if os.path.exists(rc_path):
            with open(rc_path) as f:
                rc = f.read().strip()
            tail = "\n".join("    | " + l for l in output.splitlines()[-15:])
            problems.append(f"{doc}:{cmd.line}: exited with status {rc}: {cmd.text.strip()}\n{tail}")
            break
        try:
            with open(os.path.join(out_dir, f"{k}.start")) as f:
                t0 = float(f.read())
            with open(os.path.join(out_dir, f"{k}.end")) as f:
                t1 = float(f.read())
            seconds.append((cmd, t1 - t0))
        except (OSError, ValueError):
            pass
        lines = output.splitlines()
        for line_no, quoted in cmd.quoted:
            if is_only_ellipsis(quoted):
                continue
            if not matches(quoted, lines):
                problems.append(f"{doc}:{line_no}: quoted output not printed by "
                                f"`{cmd.text.strip().splitlines()[0]}`: {quoted}")
    if keep:
        print(f"{doc}: scratch directory kept: {scratch}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    return problems, seconds


def documents(paths):
    docs = []
    for p in paths:
        if os.path.isdir(p):
            docs.extend(sorted(os.path.join(p, n) for n in os.listdir(p) if n.endswith(".md")))
        else:
            docs.append(p)
    return docs


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True, help="the repository")
    ap.add_argument("--strata", required=True, help="the strata binary under test")
    ap.add_argument("--tier", choices=("run", "long"), default="run",
                    help="run: check=run blocks; long: check=run and check=long blocks")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directories")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per document")
    ap.add_argument("docs", nargs="+")
    args = ap.parse_args(argv)
    root = os.path.abspath(args.root)
    strata = os.path.abspath(args.strata)
    top_level = {n for n in os.listdir(root) if not n.startswith(".") and n != "build"}
    runnable = ("run",) if args.tier == "run" else ("run", "long")
    cache = {}
    problems = []
    marked = 0
    for doc in documents(args.docs):
        blocks, doc_problems = read_blocks(doc)
        problems.extend(doc_problems)
        strata_vars = set()
        to_run = []
        parsed = ran = 0
        for b in blocks:
            if b.kind in (None, "none"):
                continue
            marked += 1
            for cmd in b.commands:
                problems.extend(check_command(doc, cmd, root, top_level, strata, strata_vars,
                                              cache))
            if b.kind in runnable:
                to_run.extend(b.commands)
                ran += 1
            else:
                parsed += 1
        t0 = time.monotonic()
        slowest = ""
        if to_run:
            run_problems, seconds = run_document(doc, to_run, root, strata, args.keep,
                                                 args.timeout)
            problems.extend(run_problems)
            if seconds:
                cmd, s = max(seconds, key=lambda x: x[1])
                slowest = f"; slowest {s:.1f} s (line {cmd.line})"
        if ran or parsed:
            print(f"{doc}: {ran} blocks run, {parsed} parsed, {time.monotonic() - t0:.1f} s"
                  f"{slowest}")
    for p in problems:
        print(p)
    if marked == 0:
        print("no block is marked check=run|long|parse: nothing was checked")
        return 1
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
