#!/usr/bin/env python3
"""strata.torch against torch.optim.AdamW, side by side in one run (issue 15).

Three measurements, each printed with the machine, the thread count and medians:

  speed   the optimizer step on the same ~100M fp32 parameters (a stack of
          Linear(2048, 2048) layers trained on random data), 2 threads for both:
          torch.optim.AdamW's step() against strata.torch.OffloadAdamW's step()
          plus synchronize() (state on host: the whole update, no overlap
          credited), and each one's whole iteration (forward + backward + step).
  hidden  the same model with state on NVMe and the module attached, so each
          Linear's forward waits only for its own bucket: the fraction of the
          update hidden under backward and the next forward is
          1 - wait_seconds / update_seconds from Strata's counters.
  memory  peak RSS (/usr/bin/time -v, one process each) of a model with
          >= 400 MB of fp32 optimizer state (masters + m + v) trained a few steps
          with: a stateless optimizer (torch SGD without momentum: the baseline),
          torch AdamW, OffloadAdamW(offload="cpu") and OffloadAdamW(offload="nvme").
          The growth over the baseline is compared with the state's size.

Run (a release build first):
  STRATA_LIBRARY=build/release/capi/libstrata.so PYTHONPATH=python \\
    /usr/bin/python3 bench/bench_torch_offload.py [--nvme-dir DIR] [--only speed,hidden,memory]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import strata
import strata.torch
from bench_vs_torch import cpu_model  # bench/ is on sys.path: this script's folder


def make_model(layers, width, dtype=torch.float32):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*mods).to(dtype)


def num_params(model):
    return sum(p.numel() for p in model.parameters())


def batches(width, batch, count, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g))
            for _ in range(count)]


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def header(threads):
    print(f"# {cpu_model()}, {os.cpu_count()} CPUs visible, torch {torch.__version__} "
          f"({threads} threads), libstrata {strata.library_version()} "
          f"kernel {strata.kernel_name()}")


def bench_speed(args):
    torch.set_num_threads(args.threads)
    model_t = make_model(args.layers, args.width)
    model_s = make_model(args.layers, args.width)
    n = num_params(model_t)
    data = batches(args.width, args.batch, args.steps + args.warmup)
    opt_t = torch.optim.AdamW(model_t.parameters(), lr=1e-4)
    opt_s = strata.torch.OffloadAdamW(model_s, lr=1e-4, offload="cpu",
                                      num_threads=args.threads)
    res = {"torch": {"step": [], "iter": []}, "strata": {"step": [], "iter": []}}
    for i, (x, y) in enumerate(data):
        # Alternate who goes first, so neither always runs on a warmer cache.
        order = [("torch", model_t, opt_t), ("strata", model_s, opt_s)]
        if i % 2:
            order.reverse()
        for name, model, opt in order:
            t0 = time.perf_counter()
            if name == "torch":
                opt.zero_grad(set_to_none=True)
            loss_of(model, x, y).backward()
            t1 = time.perf_counter()
            opt.step()
            if name == "strata":
                opt.synchronize()
            t2 = time.perf_counter()
            if i >= args.warmup:
                res[name]["step"].append(t2 - t1)
                res[name]["iter"].append(t2 - t0)
    with torch.no_grad():
        diff = max(((a - b).abs().max() / a.abs().max()).item()
                   for a, b in zip(model_t.parameters(), model_s.parameters()))
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in res.items()}
    spread = {k: {m: (min(v), max(v)) for m, v in d.items()} for k, d in res.items()}
    print(f"\n## speed: {n / 1e6:.1f}M fp32 params ({args.layers} x Linear({args.width}, "
          f"{args.width})), batch {args.batch}, {args.steps} steps after {args.warmup} warm-up, "
          f"{args.threads} threads")
    print(f"{'':28s}{'median':>10s}{'min':>10s}{'max':>10s}")
    for name, label in (("torch", "torch.optim.AdamW step"),
                        ("strata", "strata.torch step+sync")):
        s = spread[name]["step"]
        print(f"{label:28s}{med[name]['step'] * 1e3:9.1f}ms{s[0] * 1e3:9.1f}ms{s[1] * 1e3:9.1f}ms")
    for name, label in (("torch", "torch iteration"), ("strata", "strata iteration")):
        s = spread[name]["iter"]
        print(f"{label:28s}{med[name]['iter'] * 1e3:9.1f}ms{s[0] * 1e3:9.1f}ms{s[1] * 1e3:9.1f}ms")
    ratio = med["torch"]["step"] / med["strata"]["step"]
    print(f"step speed-up: {ratio:.2f}x (torch / strata, medians); iteration: "
          f"{med['torch']['iter'] / med['strata']['iter']:.2f}x; largest relative parameter "
          f"difference after the run: {diff:.2e}")
    return {"params": n, "torch_step_s": med["torch"]["step"],
            "strata_step_s": med["strata"]["step"], "step_speedup": ratio,
            "torch_iter_s": med["torch"]["iter"], "strata_iter_s": med["strata"]["iter"]}


def bench_hidden(args):
    torch.set_num_threads(args.threads)
    model = make_model(args.layers, args.width)
    n = num_params(model)
    data = batches(args.width, args.batch, args.steps + args.warmup, seed=2)
    with tempfile.TemporaryDirectory(dir=args.nvme_dir) as d:
        opt = strata.torch.OffloadAdamW(model, lr=1e-4, offload="nvme", nvme_path=d,
                                        num_threads=args.threads)
        iters = []
        for i, (x, y) in enumerate(data):
            if i == args.warmup:
                opt.synchronize()
                before = opt.stats()
                t_start = time.perf_counter()
            t0 = time.perf_counter()
            loss_of(model, x, y).backward()
            opt.step()
            if i >= args.warmup:
                iters.append(time.perf_counter() - t0)
        opt.synchronize()
        after = opt.stats()
        wall = time.perf_counter() - t_start
        opt.close()
    upd = after["update_seconds"] - before["update_seconds"]
    wait = after["wait_seconds"] - before["wait_seconds"]
    rd = (after["nvme_bytes_read"] - before["nvme_bytes_read"]) / args.steps
    wr = (after["nvme_bytes_written"] - before["nvme_bytes_written"]) / args.steps
    hidden = 1 - wait / upd if upd > 0 else float("nan")
    print(f"\n## hidden: {n / 1e6:.1f}M params, state on NVMe ({args.nvme_dir or 'TMPDIR'}), "
          f"{args.steps} steps, {args.threads} threads")
    print(f"iteration median {statistics.median(iters) * 1e3:.1f} ms (wall {wall:.2f} s); "
          f"update {upd / args.steps * 1e3:.1f} ms/step, caller blocked "
          f"{wait / args.steps * 1e3:.1f} ms/step; NVMe read {rd / 2**20:.0f} MiB, written "
          f"{wr / 2**20:.0f} MiB per step")
    print(f"fraction of the update hidden under backward and the next forward: {hidden:.2f}")
    return {"params": n, "update_s_per_step": upd / args.steps,
            "wait_s_per_step": wait / args.steps, "hidden_fraction": hidden,
            "nvme_read_per_step": rd, "nvme_written_per_step": wr}


def memory_child(mode, layers, width, batch, steps, nvme_dir, threads, bucket_size):
    """One training run in this process (the parent measures its peak RSS)."""
    torch.set_num_threads(threads)
    model = make_model(layers, width)
    data = batches(width, batch, steps, seed=3)
    if mode == "baseline":
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    elif mode == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        opt = strata.torch.OffloadAdamW(model, lr=1e-4, offload=mode,
                                        nvme_path=nvme_dir if mode == "nvme" else None,
                                        num_threads=threads, bucket_size=bucket_size)
    for x, y in data:
        if mode in ("baseline", "torch"):
            opt.zero_grad(set_to_none=True)
        loss_of(model, x, y).backward()
        opt.step()
    if mode in ("cpu", "nvme"):
        opt.synchronize()
        opt.close()


def peak_rss_kib(cmd):
    out = subprocess.run(["/usr/bin/time", "-v"] + cmd, capture_output=True, text=True,
                         check=True)
    for line in out.stderr.splitlines():
        if "Maximum resident set size" in line:
            return int(line.split(":")[1])
    raise RuntimeError("no 'Maximum resident set size' in /usr/bin/time -v output")


def bench_memory(args):
    if not os.path.exists("/usr/bin/time"):
        print("\n## memory: skipped (/usr/bin/time missing: apt-get install time)")
        return None
    layers, width = args.memory_layers, args.memory_width
    n = layers * (width * width + width)
    state = 12 * n
    print(f"\n## memory: {n / 1e6:.1f}M fp32 params, fp32 optimizer state (masters + m + v) "
          f"{state / 1e6:.0f} MB; peak RSS of one training process each ({args.memory_steps} "
          f"steps, /usr/bin/time -v); strata buckets of {args.memory_bucket_size} elements")
    rss = {}
    with tempfile.TemporaryDirectory(dir=args.nvme_dir) as d:
        for mode in ("baseline", "torch", "cpu", "nvme"):
            cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", mode,
                   "--memory-layers", str(layers), "--memory-width", str(width),
                   "--memory-bucket-size", str(args.memory_bucket_size), "--batch",
                   str(args.batch), "--memory-steps", str(args.memory_steps),
                   "--threads", str(args.threads), "--nvme-dir", d]
            rss[mode] = peak_rss_kib(cmd) * 1024
    labels = {"baseline": "torch SGD (no state)", "torch": "torch.optim.AdamW",
              "cpu": "OffloadAdamW offload=cpu", "nvme": "OffloadAdamW offload=nvme"}
    for mode, label in labels.items():
        growth = rss[mode] - rss["baseline"]
        print(f"{label:28s} peak RSS {rss[mode] / 1e6:8.0f} MB   growth {growth / 1e6:7.0f} MB "
              f"= {growth / state:5.2f} x state")
    return {"params": n, "state_bytes": state, "peak_rss": rss,
            "nvme_growth_over_state": (rss["nvme"] - rss["baseline"]) / state}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="speed,hidden,memory")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=24, help="Linear layers: 24 x 2048^2 = 100M")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    # Strata's host buffers beside the fp32 gradient accumulator (4 B/param) scale with the
    # largest bucket: staging_buffers x 4 B + buffer_count x 12 B per element (see docs/pytorch.md).
    ap.add_argument("--memory-layers", type=int, default=36, help="36 x 1024^2: 453 MB of state")
    ap.add_argument("--memory-width", type=int, default=1024)
    ap.add_argument("--memory-bucket-size", type=int, default=1 << 20)
    ap.add_argument("--memory-steps", type=int, default=4)
    ap.add_argument("--nvme-dir", default=None, help="directory on the drive to offload to")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child:
        memory_child(args.memory_child, args.memory_layers, args.memory_width, args.batch,
                     args.memory_steps, args.nvme_dir, args.threads, args.memory_bucket_size)
        return
    header(args.threads)
    results = {}
    for part in args.only.split(","):
        results[part] = {"speed": bench_speed, "hidden": bench_hidden,
                         "memory": bench_memory}[part](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
