#!/usr/bin/env python3
"""Prints the ratios that bench_cpu_optim is held to, from its JSON output.

    bench_cpu_optim --benchmark_repetitions=3 --benchmark_out=cpu_optim.json \\
        --benchmark_out_format=json
    python3 bench/cpu_optim/summarize.py cpu_optim.json

Per case it takes the median over repetitions (the single run without
repetitions) and prints:
  - BM_AdamW against BM_AdamWTraffic with the same variant and arguments: the
    fraction of the memory-only limit reached (target >= 0.9 with bf16 gradients
    and bf16 copy-out at all threads, for the best variant);
  - the best variant at 1 thread against the scalar reference (target >= 5x);
  - BM_AdamWCopyOut: each gradient/copy-out dtype pair against bf16/bf16 with the
    same variant, size and threads (target: fp16/fp16 within 10 %, every variant
    but the generic one);
  - params/s and GB/s of every optimizer benchmark.
Standard library only. Exit status 0 always: this reports, it does not judge.
"""
import json
import re
import sys

NAME = re.compile(r"^(?P<family>BM_\w+?)(?:/(?P<isa>[a-z][a-z0-9]*))?"
                  r"/params:(?P<params>\d+)/grad:(?P<grad>\d+)(?:/threads:(?P<threads>\d+))?")
SUFFIX = re.compile(r"/(min_time:[0-9.]+s?|iterations:\d+|repeats:\d+|real_time|manual_time)")
GRAD = {"0": "fp32", "1": "fp16", "2": "bf16"}
COPY_OUT = re.compile(r"^BM_AdamWCopyOut/(?P<isa>[a-z][a-z0-9]*)/params:(?P<params>\d+)"
                      r"/grad:(?P<grad>\d+)/out:(?P<out>\d+)/threads:(?P<threads>\d+)")


def load(path):
    with open(path) as f:
        doc = json.load(f)
    runs = {}
    for b in doc.get("benchmarks", []):
        kind = b.get("run_type", "iteration")
        if kind == "aggregate" and b.get("aggregate_name") != "median":
            continue
        # Options Google Benchmark appends to the name are not arguments.
        name = SUFFIX.sub("", b.get("run_name", b["name"]))
        if kind == "iteration" and name in runs:
            continue  # repetitions without aggregates: keep the first
        if b.get("error_occurred"):
            continue
        runs[name] = b
    return doc.get("context", {}), runs


def parse(name):
    m = NAME.match(name)
    if not m:
        return None
    d = m.groupdict()
    d["threads"] = d["threads"] or "1"
    return d


def fmt_rate(b):
    return "{:8.1f} M params/s {:6.2f} GB/s".format(
        b.get("items_per_second", 0) / 1e6, b.get("bytes_per_second", 0) / 1e9)


def main(argv):
    if len(argv) != 2:
        print(__doc__)
        return 2
    context, runs = load(argv[1])
    best = context.get("cpu_optim_kernel", "")
    print("host: {} CPUs, load average {}, kernel variant {} (supported: {})".format(
        context.get("num_cpus", "?"), context.get("load_avg", "?"), best,
        context.get("cpu_optim_supported_kernels", "?")))
    print()
    print("AdamW vs its memory-only traffic limit (same variant, same arguments):")
    parsed = {n: parse(n) for n in runs}
    for name in sorted(runs, key=lambda n: (parsed[n] or {}).get("params", "") + n):
        p = parsed[name]
        if not p or p["family"] != "BM_AdamW":
            continue
        traffic = runs.get(name.replace("BM_AdamW/", "BM_AdamWTraffic/", 1))
        ratio = (runs[name]["bytes_per_second"] / traffic["bytes_per_second"]
                 if traffic else float("nan"))
        mark = ""
        if p["isa"] == best and p["grad"] == "2" and p["threads"] != "1":
            mark = "  <- headline, target >= 0.90: {}".format("met" if ratio >= 0.9 else "NOT met")
        print("  {:8s} {:>10s} params grad {:4s} threads {:>2s}: {}  ratio {:.3f}{}".format(
            p["isa"] or "-", p["params"], GRAD[p["grad"]], p["threads"], fmt_rate(runs[name]),
            ratio, mark))
    print()
    ref = [n for n in runs if n.startswith("BM_AdamWReference/")]
    for r in ref:
        p = parsed[r]
        vec = runs.get("BM_AdamW/{}/params:{}/grad:{}/threads:1".format(best, p["params"], p["grad"]))
        if vec:
            speedup = vec["items_per_second"] / runs[r]["items_per_second"]
            print("scalar reference vs {} at 1 thread, {} params, {} grads: {:.1f}x "
                  "(target >= 5x: {})".format(best, p["params"], GRAD[p["grad"]], speedup,
                                              "met" if speedup >= 5 else "NOT met"))
            print("  reference: {}".format(fmt_rate(runs[r])))
    print()
    print("AdamW by gradient/copy-out dtype, time against bf16/bf16 (same variant, size, threads):")
    copy_out = {n: COPY_OUT.match(n) for n in runs}
    copy_out = {n: m.groupdict() for n, m in copy_out.items() if m}
    for name in sorted(copy_out, key=lambda n: (
            copy_out[n]["isa"], int(copy_out[n]["params"]), int(copy_out[n]["threads"]),
            -int(copy_out[n]["grad"]), -int(copy_out[n]["out"]))):
        d = copy_out[name]
        base = runs.get(name.replace("/grad:{}/out:{}/".format(d["grad"], d["out"]),
                                     "/grad:2/out:2/", 1))
        ratio = (base["items_per_second"] / runs[name]["items_per_second"]
                 if base else float("nan"))
        mark = ""
        if d["grad"] == "1" and d["out"] == "1" and d["isa"] != "generic":
            mark = "  <- target <= 1.10: {}".format("met" if ratio <= 1.10 else "NOT met")
        print("  {:8s} {:>10s} params {:4s}/{:4s} threads {:>2s}: {}  time x{:.3f}{}".format(
            d["isa"], d["params"], GRAD[d["grad"]], GRAD[d["out"]], d["threads"],
            fmt_rate(runs[name]), ratio, mark))
    print()
    print("Other optimizers (best variant, bf16 copy-out):")
    for name in sorted(runs):
        p = parsed[name]
        if p and p["family"] in ("BM_Adagrad", "BM_Lion", "BM_Sgd"):
            print("  {:10s} {:>10s} params grad {:4s} threads {:>2s}: {}".format(
                p["family"], p["params"], GRAD[p["grad"]], p["threads"], fmt_rate(runs[name])))
    for name in sorted(runs):
        if name.startswith("BM_Triad"):
            print("  {:40s} {:6.2f} GB/s".format(name, runs[name].get("bytes_per_second", 0) / 1e9))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
