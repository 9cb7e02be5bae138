#!/usr/bin/env python3
"""The MFU table of a GPU check: Strata's bench_train_step cases against PyTorch's baseline.

Usage: mfu_table.py BENCH_TRAIN_STEP_JSON TORCH_BASELINE_JSONL
The first file is Google Benchmark's JSON (counters tokens_per_s, model_TFLOP_per_s, MFU, step_s,
offload_cost); the second holds one JSON object per line as bench/gpu/torch_gpt_baseline.py prints
it. A missing or truncated file is a row that says so, never an exception: the table is printed
at the end of a device call whose steps may have been cut short.
"""
import json
import sys


def rows_of(bench_path, torch_path):
    rows = []
    try:
        with open(bench_path) as f:
            text = f.read()
        for b in json.loads(text).get("benchmarks", []):
            name = b["name"].split("/iterations")[0]
            if b.get("error_occurred"):
                rows.append((name, None, None, None, b.get("error_message", "")[:90]))
            else:
                note = f"step {b.get('step_s', 0):.2f} s, offload cost {b.get('offload_cost', 1):.2f}"
                rows.append((name, b.get("tokens_per_s"), b.get("model_TFLOP_per_s"), b.get("MFU"), note))
    except (OSError, ValueError, KeyError) as e:
        rows.append(("strata", None, None, None, f"no complete bench_train_step.json ({e})"))
    try:
        with open(torch_path) as f:
            for line in f:
                if not line.strip():
                    continue
                r = json.loads(line)
                name = r.get("name", "torch")
                if "skipped" in r:
                    rows.append((name, None, None, None, r["skipped"][:90]))
                else:
                    note = f"step {r['step_s']:.2f} s, {r['layers_run']} of {r['layers']} layers"
                    rows.append((name, r["tokens_per_s"], r["model_TFLOP_per_s"], r["MFU"], note))
    except (OSError, ValueError, KeyError) as e:
        rows.append(("torch", None, None, None, f"no complete torch baseline ({e})"))
    return rows


def cell(x, fmt):
    return format("-", ">" + fmt.split(".")[0]) if x is None else format(x, fmt)


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    print(f"{'case':<34} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6}  note")
    for name, tps, tf, mfu, note in rows_of(argv[1], argv[2]):
        print(f"{name:<34} {cell(tps, '10.0f')} {cell(tf, '8.1f')} {cell(mfu, '6.1%')}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
