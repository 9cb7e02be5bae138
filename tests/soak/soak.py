#!/usr/bin/env python3
"""Soak test: a long `strata train` run whose host memory (RSS) and open file descriptors must stay
flat (issue 7). Stdlib only.

    tests/soak/soak.py --strata build/release/tools/strata [--steps 2000] [-- extra train flags]

Samples /proc/<pid>/status (VmRSS) and /proc/<pid>/fd once a second while the run trains. The
first --warmup-fraction of the samples (allocation of the arena, pinned memory, swap store, first
evaluation) and the last --cooldown-fraction (the final flush of the update in flight, the
master-weight hash, teardown closing the swap files) are not judged. Of the rest, the median RSS of the last quarter may exceed the median
of the first quarter by at most --rss-slack-mib (default 16 MiB) and the number of open file
descriptors may not change at all. Prints one JSON line with the figures; exit 0 when flat, 1 when
not, 2 when the run itself failed.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def sample(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        return rss_kib * 1024, fds
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--strata", required=True, help="the strata binary")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    ap.add_argument("--warmup-fraction", type=float, default=0.2)
    ap.add_argument("--cooldown-fraction", type=float, default=0.1)
    ap.add_argument("--rss-slack-mib", type=float, default=16.0)
    ap.add_argument("train_args", nargs="*", help="extra `strata train` flags (after --)")
    a = ap.parse_args()

    cmd = [a.strata, "train", "--steps", str(a.steps), "--offload-optimizer", "nvme",
           "--eval-every", "0", "--sample-bytes", "0", "--log-every", "100"] + a.train_args
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples = []
    while proc.poll() is None:
        s = sample(proc.pid)
        if s is not None:
            samples.append(s)
        time.sleep(a.interval)
    stderr = proc.stderr.read()
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        print(f"soak: `{' '.join(cmd)}` failed with exit {proc.returncode}: {stderr.strip()}",
              file=sys.stderr)
        return 2
    judged = samples[int(len(samples) * a.warmup_fraction):
                     len(samples) - int(len(samples) * a.cooldown_fraction)]
    if len(judged) < 8:
        print(f"soak: only {len(samples)} samples in {seconds:.0f} s; run more steps", file=sys.stderr)
        return 2
    quarter = max(1, len(judged) // 4)
    rss_first = statistics.median(r for r, _ in judged[:quarter])
    rss_last = statistics.median(r for r, _ in judged[-quarter:])
    fds = sorted({f for _, f in judged})
    growth_mib = (rss_last - rss_first) / 2**20
    ok = growth_mib <= a.rss_slack_mib and len(fds) == 1
    print(json.dumps({
        "steps": a.steps, "seconds": round(seconds, 1), "samples": len(samples),
        "rss_first_quarter_mib": round(rss_first / 2**20, 1),
        "rss_last_quarter_mib": round(rss_last / 2**20, 1),
        "rss_growth_mib": round(growth_mib, 2), "rss_peak_mib": round(max(r for r, _ in samples) / 2**20, 1),
        "open_fds": fds, "flat": ok}))
    if not ok:
        print(f"soak: not flat: RSS grew {growth_mib:.1f} MiB (slack {a.rss_slack_mib} MiB), "
              f"open file descriptors took the values {fds}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
