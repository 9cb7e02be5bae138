#!/usr/bin/env python3
"""Issue 42's targets from one `.gpurun/run.sh targets` call: Strata against PyTorch, and the step
the measured machine profile predicts against the measured one.

Usage: targets_table.py LOG_DIR
LOG_DIR holds what scripts/gpu/device.sh's targets phase wrote: bench_device.json (Google
Benchmark JSON of bench_train_step's device cases: counters step_s, tokens_per_s,
model_TFLOP_per_s), torch_baseline.jsonl (bench/gpu/torch_gpt_baseline.py's lines), gpt7b_24g.log
(the progress lines of `strata train`, one per step) and estimate_<case>.json (`strata estimate
--json` with the measured profile: step_s, model_flops). Strata and PyTorch are compared by model
FLOPs per second (the same count, 6 P + 12 L T C per token, on both sides), which is the ratio of
tokens/s at the same shape and stays right when the PyTorch baseline runs only the layers that fit
(--fit-layers). A missing or cut-short file is a row that says so, never an exception.
"""
import json
import os
import re
import statistics
import sys

# case -> (the PyTorch baseline it is held against, the target ratio of model FLOP/s)
CASES = {
    "gpt2-1.5b_device": ("gpt2-1.5b", 1.1),
    "gpt-7b_device": ("gpt-7b", 1.0),
    "gpt-7b_24g": ("gpt-7b", 0.8),
}
STEP_LINE = re.compile(r"^step\s+(\d+)/\d+ \|.*?\|\s*([0-9.]+) tok/s \|")


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def measured_bench(log_dir):
    """case -> (step_s, model TFLOP/s) of bench_train_step's device cases."""
    out = {}
    bench = load_json(os.path.join(log_dir, "bench_device.json")) or {}
    for b in bench.get("benchmarks", []):
        m = re.match(r"TrainStep/([^/]+)/device/", b.get("name", ""))
        if m and not b.get("error_occurred") and b.get("step_s"):
            out[m.group(1) + "_device"] = (b["step_s"], b.get("model_TFLOP_per_s"))
    return out


def measured_offload(log_dir, estimate):
    """(step_s, model TFLOP/s) of the 24 GiB run: the median step after the first (warm-up)."""
    rates = []
    try:
        with open(os.path.join(log_dir, "gpt7b_24g.log")) as f:
            for line in f:
                m = STEP_LINE.match(line.strip())
                if m and int(m.group(1)) > 1:
                    rates.append(float(m.group(2)))
    except OSError:
        return None
    if not rates:
        return None
    tokens = 16 * 2 * 2048
    step_s = tokens / statistics.median(rates)
    flops = (estimate or {}).get("model_flops")
    return step_s, (flops / step_s / 1e12 if flops else None)


def torch_rates(log_dir):
    """preset -> PyTorch's model TFLOP/s."""
    out = {}
    try:
        with open(os.path.join(log_dir, "torch_baseline.jsonl")) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    if "model_TFLOP_per_s" in r:
                        out[r.get("preset") or r.get("name", "")] = r["model_TFLOP_per_s"]
    except (OSError, ValueError):
        pass
    return out


def torch_rate(rates, preset):
    for name, rate in rates.items():
        if name == preset or name.endswith("/" + preset) or preset in name:
            return rate
    return None


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    log_dir = argv[1]
    measured = measured_bench(log_dir)
    estimates = {c: load_json(os.path.join(log_dir, f"estimate_{c}.json"))
                 for c in CASES}
    measured["gpt-7b_24g"] = measured_offload(log_dir, estimates.get("gpt-7b_24g"))
    torch = torch_rates(log_dir)
    print(f"{'case':<18} {'step s':>8} {'TFLOP/s':>8} {'torch':>8} {'ratio':>6} {'target':>6}"
          f" {'predicted s':>11} {'error':>7}")
    for case, (preset, target) in CASES.items():
        got = measured.get(case)
        est = estimates.get(case) or {}
        predicted = est.get("step_s")
        if got is None:
            print(f"{case:<18} not measured (see its log)")
            continue
        step_s, tflops = got
        base = torch_rate(torch, preset)
        ratio = tflops / base if tflops and base else None
        error = predicted / step_s - 1 if predicted else None
        verdict = "" if ratio is None else ("  met" if ratio >= target else "  MISSED")
        print(f"{case:<18} {step_s:8.3f} {tflops or 0:8.1f} {base or 0:8.1f} "
              f"{'-' if ratio is None else format(ratio, '6.2f'):>6} {target:6.2f}"
              f" {'-' if predicted is None else format(predicted, '11.3f'):>11}"
              f" {'-' if error is None else format(error, '+7.1%'):>7}{verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
