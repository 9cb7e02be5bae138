#!/usr/bin/env python3
"""Checks docs/training.md's reference of `strata train` against the binary.

    check_train_reference.py --strata BIN --data TEXT [--doc docs/training.md]

Three lists, each both ways (every name the binary has is documented; every documented name
exists):
  1. the flag table (the table whose header is `| flag | default | meaning |`): the `--flags` in
     its first column against those `strata train --help` lists (the first token of each option
     line, split at ','; option groups and their headings do not matter);
  2. the summary: every key of the object `--summary-json` writes (and of its time_breakdown and
     planning),
     from a two-step run of the tiny model, must be a code span of the paragraph that begins
     "`--summary-json` holds"; the documented keys must be written;
  3. the metric tags (train/..., bytes/..., time/..., val/...) the same run writes with
     --metrics-jsonl against those named in the paragraph that begins "Every optimizer step".

Prints one line per problem and exits 1 when there is any.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

_SPAN = re.compile(r"`([^`]+)`")
_TAG = re.compile(r"\b((?:train|bytes|time|val)/[a-z_0-9]+)")


def help_flags(help_text):
    flags = set()
    for line in help_text.splitlines():
        words = line.split()
        if not words or not words[0].startswith("-"):
            continue
        for name in words[0].split(","):
            name = name.split("=")[0].rstrip(":")
            if name.startswith("--") and name != "--help":
                flags.add(name)
    return flags


def table_flags(doc_lines):
    """The --flags of the first column of the `| flag | default | meaning |` table."""
    flags = set()
    in_table = False
    for line in doc_lines:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if not in_table:
            if line.startswith("|") and cells[:2] == ["flag", "default"]:
                in_table = True
            continue
        if not line.startswith("|"):
            break
        for span in _SPAN.findall(cells[0].replace("\\|", "/")):
            flags.update(re.findall(r"(--[a-z0-9][a-z0-9-]*)", span))
    return flags


def paragraph(doc_lines, start):
    """The paragraph (up to a blank line) whose first line starts with `start`."""
    for i, line in enumerate(doc_lines):
        if line.startswith(start):
            j = i
            while j < len(doc_lines) and doc_lines[j].strip():
                j += 1
            return " ".join(doc_lines[i:j])
    return None


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strata", required=True)
    ap.add_argument("--data", required=True, help="a text file to train on")
    ap.add_argument("--doc", required=True)
    args = ap.parse_args(argv)
    with open(args.doc, encoding="utf-8") as f:
        lines = f.read().split("\n")
    problems = []

    r = subprocess.run([args.strata, "train", "--help"], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"`strata train --help` failed: {r.stderr}")
        return 1
    in_help = help_flags(r.stdout)
    in_table = table_flags(lines)
    if not in_table:
        problems.append(f"{args.doc}: no `| flag | default | meaning |` table")
    for flag in sorted(in_help - in_table):
        problems.append(f"{args.doc}: flag table: no row for `{flag}` (in `strata train --help`)")
    for flag in sorted(in_table - in_help):
        problems.append(f"{args.doc}: flag table: `{flag}` is not a flag of `strata train`")

    with tempfile.TemporaryDirectory(prefix="strata-train-reference-") as tmp:
        summary_path = os.path.join(tmp, "summary.json")
        metrics_path = os.path.join(tmp, "metrics.jsonl")
        r = subprocess.run(
            [args.strata, "train", "--device", "host", "--data", args.data, "--model", "tiny",
             "--seq-len", "16", "--steps", "2", "--eval-every", "2", "--eval-batches", "1",
             "--sample-bytes", "0", "--nvme-path", tmp, "--summary-json", summary_path,
             "--metrics-jsonl", metrics_path], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"the two-step run failed: {r.stdout}{r.stderr}")
            return 1
        with open(summary_path) as f:
            summary = json.load(f)
        tags = set()
        with open(metrics_path) as f:
            for line in f:
                tags.update(k for k in json.loads(line) if k not in ("step", "wall_time"))

    text = paragraph(lines, "`--summary-json` holds")
    if text is None:
        problems.append(f"{args.doc}: no paragraph beginning \"`--summary-json` holds\"")
    else:
        spans = set(_SPAN.findall(text))
        keys = (set(summary) | set(summary.get("time_breakdown", {}))
                | set(summary.get("planning", {})))
        for key in sorted(keys - spans):
            problems.append(f"{args.doc}: summary JSON: `{key}` is written but not listed")
        # Documented names that look like keys (lower-case words with '_') must be written.
        for span in sorted(s for s in spans if re.fullmatch(r"[a-z0-9]+(_[a-z0-9]+)+", s)):
            if span not in keys:
                problems.append(f"{args.doc}: summary JSON: `{span}` is listed but not written")

    text = paragraph(lines, "Every optimizer step")
    if text is None:
        problems.append(f"{args.doc}: no paragraph beginning \"Every optimizer step\"")
    else:
        documented = set(_TAG.findall(text))
        for tag in sorted(tags - documented):
            problems.append(f"{args.doc}: metrics: tag {tag} is written but not listed")
        for tag in sorted(documented - tags):
            problems.append(f"{args.doc}: metrics: tag {tag} is listed but not written")

    for p in problems:
        print(p)
    print(f"{len(in_help)} flags, {len(summary)} summary keys, {len(tags)} metric tags checked")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
