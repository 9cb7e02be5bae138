#!/usr/bin/env python3
"""Issue 43 on the GPU machine: each Hugging Face family Strata loads, evaluated by Strata on
CUDA, by Strata's host backend and by transformers' own model on the same directory.

The directories are the tiny random models of tests/python/test_hf_new_families.py (llama with
attention_bias, mistral with a window shorter than T, qwen2 with use_sliding_window on layer 1,
qwen3 with heads * head_dim != hidden, phi3 fused with and without a window, F32 and BF16
storage, one sharded) and tests/python/test_hf_gemma3.py (gemma3_text with sliding and global
layers, linear rope scaling on the global ones, tied and untied) and tests/python/test_hf_gemma2.py
(gemma2 with soft-capped scores and logits, null caps, the default layer pattern): their builders (configs,
random_params, Model, write_model_dir) are imported, and the directories, token files and
evaluation windows are made exactly as those tests make them (tokens base.random_tokens(200 + i)
(300 + i) and (400 + i), T = 13, B = 3, every full window: base.windows). For each model:

  hf     transformers' AutoModelForCausalLM.from_pretrained(dir, attn_implementation="eager")
         on cuda, in float32 and in bfloat16 (the F32 files cast on load, the BF16 files as
         stored): the mean next-token cross-entropy over those windows (logits taken to float64
         for the loss). The load must report no missing, unexpected or mismatched tensor.
  cuda   strata eval --model-dir DIR --data FILE --seq-len T --micro-batch-size B --precision P
         --device cuda --json
  host   the same with --device host
  ref    the tests' float64 reference on the same windows (CPU; reported, not gated: when
         transformers disagrees with Strata, this says which of them the reference sides with)

Bounds (relative to the second loss of each pair):

  fp32   |cuda - hf| <= 1e-5 and |cuda - host| <= 1e-5 (base.EVAL_REL_TOL, the CPU tests'
         bound; fp32 rounding of these tiny models moves the loss ~1e-7, and the tests measure
         that each family-specific mistake moves it by more than 10x the bound).
  bf16   |cuda - hf| <= 1e-2 and |cuda - host| <= 1e-2. Why 1e-2: bf16 keeps 8 significant
         bits (unit roundoff u = 2^-9 ~ 2e-3). Two bf16 implementations round the weights alike
         (F32 to BF16, to nearest even) but the activations at different points (projection
         outputs, norms, rotary tables, attention probabilities, the residual stream, the
         logits), each a relative error of up to u. The loss moves by |dL| <= 2 max|dz| (its
         gradient in the logits z is p - onehot, of 1-norm at most 2), |z| up to ~3 here. The
         ~20-30 roundings on the path through 2-3 layers leave a few u in the logits when their
         signs are random, averaged again over the 91 positions: ~1e-3 of the loss (~5-6) or
         less; if all pushed one way, ~25 u ~ 5e-2. Measured on the CPU (--dry-run): Strata's
         host bf16 is within 4e-4 of the float64 reference on all 12 models; two implementations
         differ by at most the sum of their errors. 1e-2 sits ~10x above that and below the
         worst case: it catches a broken bf16 path (a wrong dtype read, a lost mask or bias, a
         wrong scale) but not the small mistakes, which move the loss by 1e-4..1e-2; the fp32
         rows are the exact check. |hf - ref| is printed beside it: the size of a correct bf16
         implementation's error on the same model.

Output: a table on stdout, and the rows as JSON to --json PATH, else $OUT/families.json when
OUT is set, else stdout (written again after each model, so a run cut short keeps what it
measured). Exit 0 when every comparison passes, 1 when one fails, 2 when it cannot run
(no strata, no transformers, no CUDA, no fixture modules).

  python3 scripts/gpu/families_vs_transformers.py --strata build/gpu/tools/strata
  STRATA_CLI=build/release/tools/strata python3 scripts/gpu/families_vs_transformers.py --dry-run

--dry-run (any machine): builds the directories and runs only `strata eval --device host`
(fp32 and bf16), checked against the float64 reference with the same bounds; transformers and
CUDA are not touched.
--hf-device cpu --strata-devices host: transformers on the CPU against Strata's host backend
(a machine with transformers and no GPU).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

BF16_REL_TOL = 1e-2
PRECISIONS = ("fp32", "bf16")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strata", default=os.environ.get("STRATA_CLI", ""),
                   help="the strata program (default $STRATA_CLI)")
    p.add_argument("--tests-dir", default=os.path.join(ROOT, "tests", "python"),
                   help="where test_hf_new_families.py and test_hf_gemma3.py are")
    p.add_argument("--work", default=None, help="directory for the models (default: a temporary "
                   "one, removed at the end)")
    p.add_argument("--json", default=None, help="where the JSON goes (default $OUT/families.json "
                   "when OUT is set, else stdout)")
    p.add_argument("--models", default="", help="comma-separated substrings: only the fixtures "
                   "whose name contains one")
    p.add_argument("--eval-timeout", type=float, default=120.0,
                   help="seconds per strata eval")
    p.add_argument("--hf-device", default="cuda", help="where transformers runs (default cuda)")
    p.add_argument("--strata-devices", default="cuda,host",
                   help="the strata --device values to run (default cuda,host)")
    p.add_argument("--dry-run", action="store_true",
                   help="no transformers, no CUDA: strata --device host against the reference")
    return p.parse_args()


def fail_setup(msg):
    print(f"families_vs_transformers: {msg}", file=sys.stderr)
    sys.exit(2)


def load_fixture_modules(tests_dir):
    """The tests' modules (they import torch and numpy only). Importing both patches the shared
    base.FAMILIES table with every family, as each test does for its own."""
    if not os.path.isfile(os.path.join(tests_dir, "test_hf_new_families.py")):
        fail_setup(f"no test_hf_new_families.py in {tests_dir}")
    sys.path.insert(0, tests_dir)
    try:
        import test_hf_new_families as nf
        import test_hf_gemma3 as g3
        import test_hf_gemma2 as g2
    except ImportError as e:
        fail_setup(f"cannot import the fixture builders from {tests_dir}: {e}")
    if nf.torch is None:
        fail_setup(f"torch or numpy is not importable by {sys.executable}")
    return nf, g3, g2


def build_fixtures(nf, g3, g2, root, wanted):
    """[(model, T, B)] with model.dir, model.tokens and model.data set as the tests' Fixture
    classes set them (same seeds, same token counts)."""
    base = nf.base
    out = []
    for mod, token_seed in ((nf, 200), (g3, 300), (g2, 400)):
        for i, m in enumerate(mod.make_models()):
            if wanted and not any(w in m.name for w in wanted):
                continue
            m.write(root)
            m.tokens = base.random_tokens(token_seed + i, mod.EVAL_TOKENS, m.cfg["vocab_size"])
            m.data = os.path.join(root, m.name + ".bin")
            base.write_tokens(m.data, m.tokens)
            out.append((m, mod.SEQ_LEN, mod.MICRO_BATCH))
    return out


def strata_eval(strata, model, t, b, precision, device, timeout):
    """(loss, error): Strata's JSON loss, or the reason it gave none."""
    cmd = [strata, "eval", "--model-dir", model.dir, "--data", model.data, "--seq-len", str(t),
           "--micro-batch-size", str(b), "--precision", precision, "--device", device, "--json"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"strata eval timed out after {timeout:.0f} s"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        return None, f"strata eval exit {r.returncode}: {last[:200]}"
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    try:
        got = json.loads(lines[-1])
    except (IndexError, ValueError):
        return None, f"strata eval printed no JSON: {r.stdout[-200:]!r}"
    w = (len(model.tokens) - 1) // t
    if got.get("windows") != w or got.get("tokens") != w * t:
        return None, (f"strata eval counted {got.get('windows')} windows / {got.get('tokens')} "
                      f"tokens, expected {w} / {w * t}")
    return float(got["loss"]), None


class HF:
    """transformers on cuda, eager attention, no TF32 (fp32 means fp32)."""

    def __init__(self, torch, device):
        import transformers
        self.torch, self.transformers, self.device = torch, transformers, device
        self.version = transformers.__version__
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        major, minor = (int(x) for x in self.version.split(".")[:2])
        # transformers 4.56 renamed torch_dtype to dtype (the old name still works, warning).
        self.dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"

    def loss(self, model, x, y, precision):
        """(loss, error): the mean next-token cross-entropy of the windows (x, y)."""
        torch = self.torch
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
        kw = {self.dtype_kw: dtype, "attn_implementation": "eager", "output_loading_info": True}
        try:
            net, info = self.transformers.AutoModelForCausalLM.from_pretrained(model.dir, **kw)
        except Exception as e:  # noqa: BLE001  (any load failure is this model's result)
            return None, f"from_pretrained: {type(e).__name__}: {str(e)[:200]}"
        bad = {k: list(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys",
                                                            "mismatched_keys") and v}
        # A tied model's file has no lm_head.weight: missing is right iff the head IS the
        # embedding (tied on load), which is checked, not assumed.
        head, emb = net.get_output_embeddings(), net.get_input_embeddings()
        if "lm_head.weight" in bad.get("missing_keys", []) and head is not None and \
                head.weight.data_ptr() == emb.weight.data_ptr():
            bad["missing_keys"].remove("lm_head.weight")
            bad = {k: v for k, v in bad.items() if v}
        if bad:
            return None, f"from_pretrained loaded the directory partially: {bad}"
        got = {p.dtype for p in net.parameters()}
        if got != {dtype}:
            return None, f"from_pretrained gave parameters {got}, asked for {dtype}"
        net = net.to(self.device).eval()
        with torch.no_grad():
            logits = net(input_ids=x.to(self.device), use_cache=False).logits
            v = logits.shape[-1]
            ce = torch.nn.functional.cross_entropy(logits.double().reshape(-1, v),
                                                   y.to(self.device).reshape(-1))
        del net
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
        return ce.item(), None


def rel(a, b):
    return None if a is None or b is None else abs(a - b) / abs(b)


def compare(row, pairs, bound):
    """Adds a check per (name, a, b) to row["checks"]; a missing loss is a failure."""
    for name, a, b in pairs:
        r = rel(row[a], row[b])
        row["checks"].append({"check": name, "rel": r, "bound": bound,
                              "pass": r is not None and r <= bound})


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def print_row(row):
    checks = "  ".join(f"{c['check']} {fmt(c['rel'], '.1e')} {'PASS' if c['pass'] else 'FAIL'}"
                       for c in row["checks"])
    print(f"{row['model']:<42} {row['precision']:<4} {fmt(row['hf'], '.7f'):>10} "
          f"{fmt(row['cuda'], '.7f'):>10} {fmt(row['host'], '.7f'):>10} "
          f"{fmt(row['ref'], '.7f'):>10} {fmt(rel(row['hf'], row['ref']), '.1e'):>7}  {checks}",
          flush=True)
    for e in row["errors"]:
        print(f"{'':<42} {row['precision']:<4} error: {e}", flush=True)


def main():
    args = parse_args()
    if not (args.strata and os.path.isfile(args.strata) and os.access(args.strata, os.X_OK)):
        fail_setup(f"no strata program (--strata or STRATA_CLI): {args.strata!r}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only; the machine is offline
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    nf, g3, g2 = load_fixture_modules(os.path.abspath(args.tests_dir))
    base, torch = nf.base, nf.torch
    fp32_tol = base.EVAL_REL_TOL

    hf = None
    devices = ["host"] if args.dry_run else [d for d in args.strata_devices.split(",") if d]
    if not args.dry_run:
        if args.hf_device.startswith("cuda") and not torch.cuda.is_available():
            fail_setup("torch sees no CUDA device (--dry-run runs without one)")
        try:
            hf = HF(torch, args.hf_device)
        except ImportError as e:
            fail_setup(f"transformers is not importable by {sys.executable}: {e}")
    # What is gated: Strata (on CUDA when it runs there) against transformers, and Strata's
    # CUDA path against its host backend; in a dry run Strata's host against the reference.
    first = "cuda" if "cuda" in devices else devices[0]
    pairs = [(f"{first}-hf", first, "hf")] if hf else [(f"{first}-ref", first, "ref")]
    if "cuda" in devices and "host" in devices:
        pairs.append(("cuda-host", "cuda", "host"))

    work = args.work or tempfile.mkdtemp(prefix="strata-families-")
    os.makedirs(work, exist_ok=True)
    wanted = [w for w in args.models.split(",") if w]
    t0 = time.time()
    fixtures = build_fixtures(nf, g3, g2, work, wanted)
    if not fixtures:
        fail_setup(f"no fixture matches --models {args.models!r}")

    json_path = args.json or (os.path.join(os.environ["OUT"], "families.json")
                              if os.environ.get("OUT") else None)
    report = {"strata": args.strata, "dry_run": args.dry_run,
              "transformers": hf.version if hf else None, "torch": torch.__version__,
              "bounds": {"fp32": fp32_tol, "bf16": BF16_REL_TOL}, "rows": []}

    def write_json():
        if json_path:
            os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
            tmp = json_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(report, f, indent=1)
            os.replace(tmp, json_path)

    print(f"families: {len(fixtures)} models in {work}; strata {args.strata}; "
          f"transformers {report['transformers']}; torch {torch.__version__}"
          f"{'; DRY RUN (host only, against the float64 reference)' if args.dry_run else ''}")
    print(f"bounds (relative): fp32 {fp32_tol:g}, bf16 {BF16_REL_TOL:g}; hf-ref: transformers "
          "against the float64 reference (not gated)")
    print(f"{'model':<42} {'prec':<4} {'hf':>10} {'cuda':>10} {'host':>10} {'ref':>10} "
          f"{'hf-ref':>7}  checks", flush=True)
    for model, t, b in fixtures:
        x, y = base.windows(model.tokens, t)
        with torch.no_grad():
            ref = model.loss(x, y).item()
        for precision in PRECISIONS:
            row = {"model": model.name, "model_type": model.cfg["model_type"],
                   "storage": model.storage, "precision": precision, "seq_len": t,
                   "micro_batch": b, "windows": int(x.shape[0]), "ref": ref, "hf": None,
                   "cuda": None, "host": None, "errors": [], "checks": []}
            if hf:
                row["hf"], err = hf.loss(model, x, y, precision)
                if err:
                    row["errors"].append(f"hf: {err}")
            for device in devices:
                row[device], err = strata_eval(args.strata, model, t, b, precision, device,
                                               args.eval_timeout)
                if err:
                    row["errors"].append(f"{device}: {err}")
            bound = fp32_tol if precision == "fp32" else BF16_REL_TOL
            compare(row, pairs, bound)
            report["rows"].append(row)
            print_row(row)
            write_json()

    checks = [c for r in report["rows"] for c in r["checks"]]
    failed = [f"{r['model']} {r['precision']} {c['check']}" for r in report["rows"]
              for c in r["checks"] if not c["pass"]]
    report["passed"] = not failed
    report["seconds"] = round(time.time() - t0, 1)
    write_json()
    if not json_path:
        print(json.dumps(report, indent=1))
    print(f"families: {len(checks) - len(failed)} of {len(checks)} comparisons PASS "
          f"({report['seconds']} s)" + (f"; FAIL: {', '.join(failed)}" if failed else ""))
    if not args.work:
        import shutil
        shutil.rmtree(work, ignore_errors=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
