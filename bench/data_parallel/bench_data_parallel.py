#!/usr/bin/env python3
"""The partitioned (ZeRO) training step on the host backend: 1 rank vs 2 ranks (issue 18).

Same machine, same global batch: 1 rank accumulating 2 micro-batches against 2 ranks (mpirun)
with 1 micro-batch each, for optimizer state (fp32 master weights, Adam m and v) on NVMe and on
the host. Each configuration runs --reps times, the configurations alternating (1 rank, 2 ranks,
1 rank, ...) so slow drifts of a shared machine hit both alike; the table gives medians of:

  tokens/s           the global batch's tokens per second of training (rank 0's clock)
  comm / step        time_breakdown.comm / steps: busy time in collectives (reduce-scatter,
                     all-gather, the scalar all-reduces), rank 0
  overlap eff.       overlap_efficiency: the largest part of the step / step time
  cpu_optimizer/step time_breakdown.cpu_optimizer / steps on rank 0: its update of its own
                     partition (the whole model with 1 rank, half with 2)
  NVMe written/rank  nvme_bytes_written of each rank over the run (summary "ranks"), MB
  host optim/rank    host_optimizer_bytes of each rank (master weights and Adam state kept in
                     host memory), MB

Usage (from the repository root, after building strata):
  python3 bench/data_parallel/bench_data_parallel.py [--strata build/release/tools/strata]
      [--steps 20] [--reps 3] [--model small] [--json out.json]
Prints a markdown table. Only the Python standard library is used.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

MPIRUN = ["mpirun", "--oversubscribe", "--bind-to", "none", "--mca", "btl", "self,vader"]
MPIRUN_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def train(args, ranks, home, work):
    d = tempfile.mkdtemp(prefix=f"r{ranks}-{home}-", dir=work)
    for r in range(ranks):
        os.makedirs(os.path.join(d, f"nvme{r}"))
    summary = os.path.join(d, "summary.json")
    command = [args.strata, "train", "--model", args.model, "--device", "host",
               "--data", args.data, "--seq-len", str(args.seq_len),
               "--micro-batch-size", str(args.micro_batch),
               "--global-batch-size", str(2 * args.micro_batch), "--steps", str(args.steps),
               "--offload-optimizer", home, "--precision", "bf16",
               # {rank} is substituted under mpirun only.
               "--nvme-path", os.path.join(d, "nvme{rank}" if ranks > 1 else "nvme0"),
               "--eval-every", "0",
               "--sample-bytes", "0", "--log-every", "1000000", "--summary-json", summary]
    if ranks > 1:
        command = MPIRUN + ["-n", str(ranks)] + command
    env = dict(os.environ, **MPIRUN_ENV)
    p = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=env, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        sys.exit(f"exit {p.returncode}: {' '.join(command)}\n{p.stdout[-4000:]}")
    with open(summary) as f:
        s = json.load(f)
    shutil.rmtree(d, ignore_errors=True)
    steps = s["steps"] - s["start_step"]
    tb = s["time_breakdown"]
    return {
        "tokens_per_second": s["tokens_per_second"],
        "step_ms": 1e3 * tb["step"] / steps,
        "comm_ms": 1e3 * tb.get("comm", 0.0) / steps,
        "overlap_efficiency": s["overlap_efficiency"],
        "cpu_optimizer_ms": 1e3 * tb["cpu_optimizer"] / steps,
        "nvme_written_mb": [r["nvme_bytes_written"] / 1e6 for r in s["ranks"]],
        "host_optimizer_mb": [r["host_optimizer_bytes"] / 1e6 for r in s["ranks"]],
        "grad_accum_steps": s["grad_accum_steps"],
        "model_params": s["model_params"],
    }


def median_of(runs, key):
    return statistics.median(r[key] for r in runs)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strata", default=os.path.join(root, "build/release/tools/strata"))
    ap.add_argument("--data", default=os.path.join(root, "data/tinyshakespeare.txt"))
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="NVMe swap directories go here")
    ap.add_argument("--json", help="also write every run's figures here")
    args = ap.parse_args()
    if shutil.which(MPIRUN[0]) is None:
        sys.exit("mpirun not found: install openmpi-bin (scripts/install-deps.sh)")
    work = tempfile.mkdtemp(prefix="strata-bench-dp-", dir=args.workdir)
    results = {}
    t0 = time.monotonic()
    try:
        for home in ("nvme", "host"):
            for rep in range(args.reps):
                for ranks in (1, 2):
                    r = train(args, ranks, home, work)
                    results.setdefault((home, ranks), []).append(r)
                    print(f"# {home} {ranks} rank(s) rep {rep + 1}: {r['tokens_per_second']:.0f} "
                          f"tok/s, comm {r['comm_ms']:.1f} ms/step, cpu_optimizer "
                          f"{r['cpu_optimizer_ms']:.1f} ms/step", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    params = results[("nvme", 1)][0]["model_params"]
    print(f"`--model {args.model}` ({params / 1e6:.2f} M params), bf16, {args.steps} steps, "
          f"global batch {2 * args.micro_batch} x {args.seq_len} tokens (1 rank: 2 micro-batches "
          f"of {args.micro_batch}; 2 ranks: 1 each), medians of {args.reps}, "
          f"{time.monotonic() - t0:.0f} s in all.\n")
    print("| optimizer state | ranks | tokens/s | step | comm / step | overlap eff. | "
          "cpu_optimizer / step (rank 0) | NVMe written / rank | host optimizer / rank |")
    print("|---|---|---|---|---|---|---|---|---|")
    for home in ("nvme", "host"):
        for ranks in (1, 2):
            runs = results[(home, ranks)]
            nvme = [statistics.median(r["nvme_written_mb"][k] for r in runs) for k in range(ranks)]
            host = [statistics.median(r["host_optimizer_mb"][k] for r in runs)
                    for k in range(ranks)]
            print(f"| {home} | {ranks} | {median_of(runs, 'tokens_per_second'):.0f} | "
                  f"{median_of(runs, 'step_ms'):.1f} ms | {median_of(runs, 'comm_ms'):.1f} ms | "
                  f"{median_of(runs, 'overlap_efficiency'):.2f} | "
                  f"{median_of(runs, 'cpu_optimizer_ms'):.1f} ms | "
                  f"{' / '.join(f'{x:.1f}' for x in nvme)} MB | "
                  f"{' / '.join(f'{x:.1f}' for x in host)} MB |")
    print()
    for home in ("nvme", "host"):
        one = median_of(results[(home, 1)], "cpu_optimizer_ms")
        two = median_of(results[(home, 2)], "cpu_optimizer_ms")
        print(f"- optimizer on {home}: per-rank cpu_optimizer time 2 ranks / 1 rank = "
              f"{two / one:.2f}; tokens/s 2 ranks / 1 rank = "
              f"{median_of(results[(home, 2)], 'tokens_per_second') / median_of(results[(home, 1)], 'tokens_per_second'):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{h}/{n}": v for (h, n), v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
