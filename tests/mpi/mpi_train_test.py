#!/usr/bin/env python3
"""`strata train` as a data-parallel job under mpirun (issue 18, "Done when").

One script, one case per invocation (ctest runs each case as its own entry, LABELS mpi):

  python3 mpi_train_test.py CASE --strata BIN --data FILE [--workdir DIR] -- MPIRUN [FLAGS...]

MPIRUN [FLAGS...] is tests/CMakeLists.txt's STRATA_MPIRUN (the launcher plus the flags a container
needs); the environment carries STRATA_MPIRUN_ENV. Exit code 77 (ctest SKIP) when the launcher is
not installed.

Cases:
  equivalence-{bf16,fp16}-{host,nvme}  2 ranks x micro-batch B x 1 == 1 rank x 2 micro-batches of
                                       B, master weights element by element within kBound
  determinism                          two identical 2-rank runs: the same master_xxh3
  bytes                                each rank's NVMe bytes written and host optimizer bytes are
                                       half the 1-rank run's, within the partition padding
  resume                               a 2-rank checkpoint resumes with 2 ranks (bit-identical to a
                                       straight run) and with 1 rank (within kBound); export works
  kill                                 SIGKILL of rank 1 mid-training ends the job in < 60 s,
                                       naming rank 1, leaving no process behind
  mismatch                             ranks launched with different flags refuse to start
  preference                           DPO and IPO, and LoRA-DPO: 2 ranks x 1 pair == 1 rank x 2
                                       pairs, master weights within kBound, the job's metrics on
                                       rank 0
  lora                                 LoRA (with dropout) and QLoRA (NF4 base from NVMe,
                                       layer-major): 2 ranks == 1 rank within kBound; a 2-rank
                                       LoRA resume equals the straight run
  instruction                          instruction data (responses of 1 to 12 of a row's 16
                                       tokens): 2 ranks == 1 rank within kBound, the loss the
                                       mean over the whole job's counted targets
  rank-error                           an error on rank 1 only ends the job with one line
                                       `strata: rank 1: ...`

Only the Python standard library is used.
"""

import argparse
import json
import os
import re
import shutil
import signal
import math
import struct
import subprocess
import sys
import tempfile
import threading
import time
from array import array

SKIP = 77

# The bound on |w_2ranks - w_1rank| for every fp32 master weight. Where the two runs differ: the
# 1-rank run folds micro-batch 0's then micro-batch 1's gradient into one fp32 sum; 2 ranks each
# widen their own micro-batch's 16-bit gradient to fp32 and the reduce-scatter adds them (rank 0's
# + rank 1's), the same two fp32 addends, and a + b == b + a exactly in IEEE arithmetic. What is
# summed in another order is the squared gradient norm (per partition on each rank, then over the
# ranks), so the clipping factor and fp16's overflow check see a norm a few ulps (~1e-7
# relative) apart. That scales every update by (1 + ~1e-7): with lr 1e-2 and AdamW steps of at
# most ~lr each, 6 steps move a weight by at most ~6e-2, so the difference is ~6e-9 per weight,
# and Adam's m / (sqrt(v) + eps) amplifies a relative gradient change only where |g| is near eps
# (1e-8). 1e-5 leaves three orders of magnitude above that and is still ~1000x smaller than the
# distance the weights travel (checked: most weights move by more than 100 x kBound).
kBound = 1e-5
kMinMoved = 100 * kBound  # a weight that "moved": by more than this over the run
kMovedFraction = 0.5      # at least this fraction of all weights must have moved

# A small job: the tiny GPT (2 layers, 16 channels, context 16), micro-batch 2 of 16 bytes, a
# large constant learning rate so weights travel far in a few steps (constant: a run of --steps k
# resumed to 2k then sees the rates of a straight 2k-step run; cosine decays over --steps),
# weight decay and clipping on (so the all-reduced norm matters), no evaluation or sampling.
kSteps = 6
kMicroBatch = 2
kRanks = 2
kGlobalBatch = kMicroBatch * kRanks  # 1 rank accumulates 2 micro-batches, 2 ranks 1 each


class Failure(Exception):
    pass


def check(cond, message):
    if not cond:
        raise Failure(message)


# ------------------------------------------------------------------------------------------------
# safetensors: 8-byte little-endian header length, a JSON header {name: {dtype, shape,
# data_offsets: [begin, end]}} (offsets relative to the end of the header), then the data.


def read_safetensors_f32(path):
    """{tensor name: array('f')} of every F32 tensor in the file; other dtypes are an error."""
    with open(path, "rb") as f:
        blob = f.read()
    check(len(blob) >= 8, f"{path}: {len(blob)} bytes, shorter than the header length")
    (header_len,) = struct.unpack("<Q", blob[:8])
    check(8 + header_len <= len(blob), f"{path}: header of {header_len} bytes past the end")
    header = json.loads(blob[8:8 + header_len].decode("utf-8"))
    data = memoryview(blob)[8 + header_len:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        check(info["dtype"] == "F32", f"{path}: tensor {name} is {info['dtype']}, not F32")
        begin, end = info["data_offsets"]
        num_elems = 1
        for d in info["shape"]:
            num_elems *= d
        check(end - begin == 4 * num_elems and end <= len(data),
              f"{path}: tensor {name} has offsets {begin}..{end} for shape {info['shape']}")
        values = array("f")
        values.frombytes(data[begin:end])
        if sys.byteorder != "little":
            values.byteswap()
        tensors[name] = values
    return tensors


def checkpoint_dir(save_dir):
    """save_dir/<the name in save_dir/latest>."""
    with open(os.path.join(save_dir, "latest")) as f:
        return os.path.join(save_dir, f.read().strip())


def master_weights(ckpt_dir):
    return read_safetensors_f32(os.path.join(ckpt_dir, "master.safetensors"))


def compare_weights(got, want, bound, what):
    """Element by element: |got - want| <= bound for every weight. Returns the largest difference."""
    check(sorted(got) == sorted(want),
          f"{what}: tensors {sorted(got)} != {sorted(want)}")
    worst = (0.0, None, -1)
    for name in sorted(want):
        g, w = got[name], want[name]
        check(len(g) == len(w), f"{what}: {name} has {len(g)} elements, want {len(w)}")
        for i, (a, b) in enumerate(zip(g, w)):
            d = abs(a - b)
            if not d <= bound:  # also catches NaN
                raise Failure(f"{what}: {name}[{i}] = {a!r}, want {b!r} (|diff| {d:.3g} > "
                              f"bound {bound:g})")
            if d > worst[0]:
                worst = (d, name, i)
    return worst[0]


def check_moved(after, before, what):
    """Most weights moved by far more than kBound between the two states."""
    moved = total = 0
    for name in before:
        for a, b in zip(after[name], before[name]):
            total += 1
            moved += abs(a - b) > kMinMoved
    check(total > 0 and moved >= kMovedFraction * total,
          f"{what}: only {moved} of {total} weights moved by more than {kMinMoved:g}: the "
          f"comparison against the bound {kBound:g} would not tell the runs apart")
    return moved / total


# ------------------------------------------------------------------------------------------------
# Running strata.


class Runner:
    def __init__(self, args):
        self.strata = os.path.abspath(args.strata)
        self.data = os.path.abspath(args.data)
        self.mpirun = args.mpirun
        self.work = args.workdir
        self.counter = 0

    def fresh_dir(self, name):
        self.counter += 1
        path = os.path.join(self.work, f"{self.counter:02d}-{name}")
        os.makedirs(path)
        return path

    def train_args(self, precision="bf16", optimizer_home="nvme", steps=kSteps, seed=5,
                   nvme=None, save_dir=None, model="tiny", extra=(), data=None, seq_len=16):
        a = [self.strata, "train", "--model", model, "--device", "host",
             "--data", data or self.data, "--seq-len", str(seq_len),
             "--micro-batch-size", str(kMicroBatch),
             "--global-batch-size", str(kGlobalBatch), "--steps", str(steps),
             "--lr", "1e-2", "--lr-schedule", "constant", "--weight-decay", "0.1",
             "--grad-clip", "1.0",
             "--precision", precision, "--offload-optimizer", optimizer_home,
             "--seed", str(seed), "--eval-every", "0", "--sample-bytes", "0", "--log-every", "1",
             "--comm-timeout", "60"]
        if nvme:
            a += ["--nvme-path", nvme]
        if save_dir:
            a += ["--save-dir", save_dir]
        return a + list(extra)

    def launch(self, ranks, strata_args):
        """The command line: strata itself for 1 rank, mpirun -n N strata for more."""
        if ranks == 1:
            return list(strata_args)
        return list(self.mpirun) + ["-n", str(ranks)] + list(strata_args)

    def run(self, command, timeout=110, expect_ok=True):
        t0 = time.monotonic()
        p = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, timeout=timeout, text=True, errors="replace")
        seconds = time.monotonic() - t0
        if expect_ok and p.returncode != 0:
            raise Failure(f"exit code {p.returncode} after {seconds:.1f} s from:\n  "
                          f"{' '.join(command)}\n--- output ---\n{p.stdout[-6000:]}")
        return p

    def train(self, ranks, name, **kw):
        """Trains in a fresh directory; returns (summary JSON, that directory)."""
        d = self.fresh_dir(name)
        for r in range(ranks):
            os.makedirs(os.path.join(d, f"nvme{r}"))
        summary = os.path.join(d, "summary.json")
        # {rank} is replaced under mpirun only: a single process gets nvme0 by name.
        kw.setdefault("nvme", os.path.join(d, "nvme{rank}" if ranks > 1 else "nvme0"))
        kw.setdefault("save_dir", os.path.join(d, "ckpt"))
        extra = list(kw.pop("extra", ())) + ["--summary-json", summary]
        self.run(self.launch(ranks, self.train_args(extra=extra, **kw)))
        with open(summary) as f:
            return json.load(f), d


# ------------------------------------------------------------------------------------------------
# Cases.


def case_equivalence(runner, precision, optimizer_home):
    one, one_dir = runner.train(1, f"one-{precision}-{optimizer_home}", precision=precision,
                                optimizer_home=optimizer_home, extra=["--save-every", "1"])
    two, two_dir = runner.train(kRanks, f"two-{precision}-{optimizer_home}", precision=precision,
                                optimizer_home=optimizer_home)
    check(one["grad_accum_steps"] == 2 and two["grad_accum_steps"] == 1,
          f"accumulation steps {one['grad_accum_steps']} (1 rank), {two['grad_accum_steps']} "
          "(2 ranks): want 2 and 1")
    check(one["global_batch_size"] == two["global_batch_size"] == kGlobalBatch,
          f"global batch {one['global_batch_size']} vs {two['global_batch_size']}")
    check(two["comm_backend"] == "mpi", f"comm_backend {two['comm_backend']!r}, want 'mpi'")
    check(len(two["ranks"]) == kRanks, f"{len(two['ranks'])} entries in 'ranks'")
    check(one["skipped_steps"] == two["skipped_steps"],
          f"skipped steps: 1 rank {one['skipped_steps']}, 2 ranks {two['skipped_steps']}")
    want = master_weights(checkpoint_dir(os.path.join(one_dir, "ckpt")))
    got = master_weights(checkpoint_dir(os.path.join(two_dir, "ckpt")))
    worst = compare_weights(got, want, kBound, f"{precision}, optimizer on {optimizer_home}: "
                            "2 ranks vs 1 rank")
    # The weights after step 1 of the reference: the runs must have travelled far beyond the bound
    # since then, or the comparison above proves nothing.
    after_first = master_weights(os.path.join(one_dir, "ckpt", "step-1"))
    moved = check_moved(want, after_first, "1-rank run, step 1 -> step 6")
    print(f"{precision}/{optimizer_home}: largest |2 ranks - 1 rank| {worst:.3g} (bound "
          f"{kBound:g}); {moved:.0%} of weights moved > {kMinMoved:g} after step 1; loss "
          f"{one['loss_last']:.4f} vs {two['loss_last']:.4f}")


def case_determinism(runner):
    a, a_dir = runner.train(kRanks, "first", precision="fp16", optimizer_home="nvme")
    b, b_dir = runner.train(kRanks, "second", precision="fp16", optimizer_home="nvme")
    check(a["master_xxh3"] == b["master_xxh3"],
          f"two identical 2-rank runs: master_xxh3 {a['master_xxh3']} != {b['master_xxh3']}")
    # The hash covers the whole master state; the checkpoints agree byte for byte too.
    for name in ("master.safetensors", "exp_avg.safetensors", "exp_avg_sq.safetensors"):
        with open(os.path.join(checkpoint_dir(os.path.join(a_dir, "ckpt")), name), "rb") as f:
            x = f.read()
        with open(os.path.join(checkpoint_dir(os.path.join(b_dir, "ckpt")), name), "rb") as f:
            y = f.read()
        check(x == y, f"two identical 2-rank runs: {name} differs")
    print(f"two 2-rank runs: master_xxh3 {a['master_xxh3']} both; checkpoints byte-identical")


def case_bytes(runner):
    # The small GPT (14 blocks of ~175k params), so that the padding is small against a partition.
    # (1) optimizer state on NVMe: NVMe bytes written per rank; (2) on the host: host optimizer
    # bytes per rank. No checkpoint: its writes are not the swap traffic being measured. The
    # working params live in host memory: with an NVMe home only the streamed blocks' params
    # are swapped, and which blocks stream depends on the device budget, not on the ranks.
    steps = 2
    for home, key in (("nvme", "nvme_bytes_written"), ("host", "host_optimizer_bytes")):
        kw = dict(optimizer_home=home, save_dir="", steps=steps, model="small",
                  extra=["--offload-params", "host"])
        one, _ = runner.train(1, f"bytes-one-{home}", **kw)
        two, _ = runner.train(kRanks, f"bytes-two-{home}", **kw)
        full = one["ranks"][0][key]
        # One copy of the state: fp32 master weights, Adam m and v (12 bytes per parameter).
        parts = 3
        state_bytes = one["model_params"] * 4 * parts
        copies = round(full / state_bytes)
        check(copies >= 1, f"1 rank, optimizer on {home}: {key} is {full}, less than one copy "
              f"of the {state_bytes}-byte optimizer state")
        # Slack per copy of the state: a rank's partition of a block is num_params / 2 rounded up
        # to 64 elements (kPartitionAlign; 256 bytes in fp32), and each part of a block (master,
        # m, v) is stored rounded up to 4 KiB (kStateAlign), on a rank as in the 1-rank run
        # (where half of its rounding, up to 2 KiB, is in "half the 1-rank figure"). So a rank
        # differs from half the 1-rank figure by at most blocks x parts x (256 + 4096 + 2048)
        # bytes per copy written (NVMe: the initial state, then once per step).
        blocks = one["num_blocks"]
        per_copy = blocks * parts * (256 + 4096 + 2048)
        slack = per_copy * copies
        for r in two["ranks"]:
            got = r[key]
            check(abs(got - full / 2) <= slack,
                  f"optimizer on {home}: rank {r['rank']} {key} {got}, want half of the 1-rank "
                  f"{full} = {full / 2:.0f} within {slack} bytes ({blocks} blocks x {parts} parts "
                  f"x 6400 bytes x {copies} copies)")
            print(f"optimizer on {home}: rank {r['rank']} {key} {got} = "
                  f"{got / full:.4f} of 1 rank's {full} (|diff| {abs(got - full / 2):.0f} <= "
                  f"slack {slack} bytes = {slack / full:.2%})")
        # Together the ranks hold all of it (they may not halve by dropping state).
        total = sum(r[key] for r in two["ranks"])
        check(total >= full - blocks * parts * 4096 * copies,
              f"optimizer on {home}: the ranks' {key} sum to {total} < the 1-rank {full}: "
              "some state is missing")


def case_resume(runner):
    k = kSteps // 2
    straight2, s2_dir = runner.train(kRanks, "straight-2")
    straight1, s1_dir = runner.train(1, "straight-1")
    first, f_dir = runner.train(kRanks, "first-half", steps=k)
    saved = os.path.join(f_dir, "ckpt")
    saved_step = os.path.join(saved, f"step-{k}")
    check(os.path.isdir(saved_step), f"no {saved_step} after {k} steps with 2 ranks")
    with open(os.path.join(saved_step, "manifest.json")) as f:
        manifest = json.load(f)
    check(manifest["engine"].get("ranks") == kRanks,
          f"manifest engine.ranks {manifest['engine'].get('ranks')}, want 2")
    # `strata export` from the 2-rank checkpoint: every exported tensor is fp32 and readable.
    exported = os.path.join(f_dir, "export.safetensors")
    runner.run([runner.strata, "export", "--checkpoint", saved_step, "--safetensors", exported,
                "--dtype", "fp32"])
    tensors = read_safetensors_f32(exported)
    master = master_weights(saved_step)
    num_master = sum(len(t) for t in master.values())
    num_exported = sum(len(t) for t in tensors.values())
    check(len(tensors) > 0 and num_exported >= num_master * 0.5,
          f"export: {len(tensors)} tensors, {num_exported} values for {num_master} master weights")
    exported_values = set()
    for t in tensors.values():
        exported_values.update(t)
    missing = sum(1 for t in master.values() for v in t if v not in exported_values)
    check(missing == 0, f"export: {missing} master weights appear nowhere in the exported file")

    # Same number of ranks: exactly the straight run.
    resumed2, _ = runner.train(kRanks, "resume-2", save_dir=saved,
                               extra=["--resume", "latest"])
    check(resumed2["start_step"] == k, f"resumed at step {resumed2['start_step']}, want {k}")
    check(resumed2["master_xxh3"] == straight2["master_xxh3"],
          f"2-rank resume at step {k}: master_xxh3 {resumed2['master_xxh3']} != the straight "
          f"2-rank run's {straight2['master_xxh3']}")
    # One rank from the 2-rank checkpoint (the global batch kept by --global-batch-size).
    resumed1, r1_dir = runner.train(1, "resume-1", extra=["--resume", saved_step])
    check(resumed1["start_step"] == k and resumed1["grad_accum_steps"] == 2,
          f"1-rank resume: start {resumed1['start_step']}, accumulation "
          f"{resumed1['grad_accum_steps']}")
    worst = compare_weights(master_weights(checkpoint_dir(os.path.join(r1_dir, "ckpt"))),
                            master_weights(checkpoint_dir(os.path.join(s1_dir, "ckpt"))),
                            kBound, f"1-rank resume of the 2-rank step-{k} checkpoint vs a "
                            "straight 1-rank run")
    check_moved(master_weights(checkpoint_dir(os.path.join(s1_dir, "ckpt"))), master,
                f"straight 1-rank run, step {k} -> {kSteps}")
    print(f"2-rank resume: master_xxh3 {resumed2['master_xxh3']} == straight; 1-rank resume: "
          f"largest |diff| {worst:.3g} (bound {kBound:g}); export: {len(tensors)} tensors")


def job_pids(root_pid):
    """Every live descendant of root_pid: {pid: (ppid, OMPI_COMM_WORLD_RANK or None)}."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] == "Z":
            continue
        parents[int(entry)] = int(fields[1])
    found = {}
    for pid in parents:
        p = pid
        while p in parents and p != root_pid and p > 1:
            p = parents[p]
        if p != root_pid or pid == root_pid:
            continue
        rank = None
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                for var in f.read().split(b"\0"):
                    if var.startswith(b"OMPI_COMM_WORLD_RANK="):
                        rank = int(var.split(b"=", 1)[1])
        except (OSError, ValueError):
            pass
        found[pid] = (parents[pid], rank)
    return found


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


class SteppingJob:
    """A job started in its own session whose output a thread collects; started() waits for its
    first step line and returns {rank: pid} of its two ranks. Use as a context manager: a job
    still running at the end is killed."""

    def __init__(self, command):
        self.job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, text=True, errors="replace",
                                    start_new_session=True)
        self.lines = []
        self.stepping = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.job.stdout:
            self.lines.append(line)
            if re.match(r"\s*step\s+\d+", line):
                self.stepping.set()

    def started(self):
        if not self.stepping.wait(90):
            raise Failure("no step line within 90 s:\n" + "".join(self.lines[-50:]))
        ranks = {}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            ranks = {rank: pid for pid, (_, rank) in job_pids(self.job.pid).items()
                     if rank is not None}
            if 0 in ranks and 1 in ranks:
                break
            time.sleep(0.2)
        check(0 in ranks and 1 in ranks, f"ranks of the job not found among "
              f"{job_pids(self.job.pid)}")
        return ranks

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.job.poll() is None:
            os.killpg(self.job.pid, signal.SIGKILL)
            self.job.wait()
        return False


def case_kill(runner):
    d = runner.fresh_dir("kill")
    for r in range(kRanks):
        os.makedirs(os.path.join(d, f"nvme{r}"))
    command = runner.launch(kRanks, runner.train_args(
        steps=1000000, nvme=os.path.join(d, "nvme{rank}")))
    with SteppingJob(command) as j:
        ranks = j.started()
        everything = set(job_pids(j.job.pid))
        os.kill(ranks[1], signal.SIGKILL)
        t_kill = time.monotonic()
        try:
            rc = j.job.wait(60)
        except subprocess.TimeoutExpired:
            raise Failure("mpirun still running 60 s after rank 1 was killed:\n" +
                          "".join(j.lines[-30:]))
        seconds = time.monotonic() - t_kill
        j.reader.join(10)
        out = "".join(j.lines)
        tail = out[-4000:]
        check(rc != 0, f"mpirun exited 0 after rank 1 was killed:\n{tail}")
        check(re.search(r"rank 1\b", out) is not None,
              f"the output does not name rank 1:\n{tail}")
        check("signal 9" in out or "Killed" in out,
              f"the output names neither 'signal 9' nor 'Killed':\n{tail}")
        # Nothing of the job may remain: the ranks and mpirun's helpers are gone.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(alive(p) for p in everything):
            time.sleep(0.2)
        left = sorted(p for p in everything if alive(p))
        check(not left, f"processes of the job still running: {left}")
        print(f"rank 1 (pid {ranks[1]}) killed: mpirun exited {rc} after {seconds:.1f} s, "
              f"{len(everything)} processes of the job all gone; its line: " +
              next((l.strip() for l in j.lines if "rank 1" in l), ""))


def case_mismatch(runner):
    d = runner.fresh_dir("mismatch")
    nvme = os.path.join(d, "nvme")
    os.makedirs(nvme)
    command = (list(runner.mpirun) + ["-n", "1"] + runner.train_args(seed=1, nvme=nvme) +
               [":", "-n", "1"] + runner.train_args(seed=2, nvme=nvme))
    t0 = time.monotonic()
    p = runner.run(command, timeout=100, expect_ok=False)
    out = p.stdout
    check(p.returncode != 0, f"ranks with --seed 1 and --seed 2 ran (exit 0):\n{out[-4000:]}")
    check("differs from rank 0's" in out,
          f"no 'differs from rank 0's' in the output (exit {p.returncode}):\n{out[-4000:]}")
    check(not re.search(r"^\s*step\s+\d+", out, re.M), "the job trained before refusing")
    check("(the flags of strata train: --seed)" in out,
          f"the line does not name --seed:\n{out[-4000:]}")
    print(f"mismatched --seed: exit {p.returncode} after {time.monotonic() - t0:.1f} s: " +
          next(l for l in out.splitlines() if "differs from rank 0's" in l))
    # A placement flag changes the order of the collectives: a rank that streamed where rank 0
    # kept blocks resident waited in another collective until --comm-timeout.
    command = (list(runner.mpirun) + ["-n", "1"] + runner.train_args(nvme=nvme) +
               [":", "-n", "1"] + runner.train_args(nvme=nvme, extra=["--device-budget", "8MiB"]))
    t0 = time.monotonic()
    p = runner.run(command, timeout=100, expect_ok=False)
    out = p.stdout
    check(p.returncode != 0 and "(the flags of strata train: --device-budget)" in out,
          f"a --device-budget on one rank was not refused by name (exit {p.returncode}):\n"
          f"{out[-4000:]}")
    check(time.monotonic() - t0 < 30, f"the refusal took {time.monotonic() - t0:.1f} s")


def case_signal_one_rank(runner):
    """SIGTERM to one rank (not to mpirun) with --save-on-signal: every rank stops after the same
    step, the checkpoint is saved, each rank exits 143 and no swap directory is left. (The other
    rank used to wait in the next step's collectives until --comm-timeout, then abort unsaved.)"""
    d = runner.fresh_dir("signal-one-rank")
    for r in range(kRanks):
        os.makedirs(os.path.join(d, f"nvme{r}"))
    save = os.path.join(d, "ckpt")
    command = runner.launch(kRanks, runner.train_args(
        steps=1000000, nvme=os.path.join(d, "nvme{rank}"), save_dir=save,
        extra=["--save-on-signal"]))
    with SteppingJob(command) as j:
        ranks = j.started()
        os.kill(ranks[1], signal.SIGTERM)
        t_signal = time.monotonic()
        try:
            rc = j.job.wait(40)
        except subprocess.TimeoutExpired:
            raise Failure("mpirun still running 40 s after SIGTERM to rank 1:\n" +
                          "".join(j.lines[-30:]))
        seconds = time.monotonic() - t_signal
        j.reader.join(10)
        out = "".join(j.lines)
        tail = out[-4000:]
        check(rc == 143, f"mpirun exited {rc}, not 143:\n{tail}")
        check("stopped by signal 15 after step" in out, f"no 'stopped by signal 15':\n{tail}")
        check("MPI_ABORT" not in out, f"the job was aborted:\n{tail}")
        check(os.path.exists(os.path.join(save, "latest")), f"no checkpoint saved:\n{tail}")
        left = [e for r in range(kRanks) for e in os.listdir(os.path.join(d, f"nvme{r}"))]
        check(not left, f"left in the NVMe directories: {left}")
        print(f"SIGTERM to rank 1: the job saved and exited {rc} after {seconds:.1f} s: " +
              next((l.strip() for l in j.lines if "stopped by signal" in l), ""))


def case_preference(runner):
    # Preference pairs whose chosen side is the prompt in upper case, the rejected side other
    # letters (issue 46), tokenized as bytes: one pair per micro-batch of 2 rows.
    d = runner.fresh_dir("preference-data")
    jsonl, tokens = os.path.join(d, "prefs.jsonl"), os.path.join(d, "prefs.bin")
    rng = __import__("random").Random(7)
    word = lambda: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6)))
    with open(jsonl, "w") as f:
        for _ in range(200):
            w = word()
            f.write(json.dumps({"prompt": w, "chosen": w.upper(), "rejected": word()}) + "\n")
    runner.run([runner.strata, "tokenize", "--byte-level", "--input", jsonl, "--output", tokens])
    # Full fine-tuning (the initial weights as the reference, computed before step 1 on every
    # rank), then LoRA (the frozen base as the reference, in the same pass), then LoRA with the
    # NLL term (its mean over the chosen tokens of every rank).
    for objective, lora, rpo in (("dpo", False, 0), ("ipo", False, 0), ("dpo", True, 0),
                                 ("dpo", True, 0.5)):
        what = (f"{objective}, " + ("LoRA, the frozen base as reference" if lora else
                                    "the initial weights as reference") +
                (f", rpo_alpha {rpo}" if rpo else ""))
        flags = ["--objective", objective, "--beta", "0.5"] + (
            ["--lora-rank", "4", "--lora-alpha", "8"] if lora else []) + (
            ["--rpo-alpha", str(rpo)] if rpo else [])
        kw = dict(model="llama-tiny", data=tokens, seq_len=32)
        one, one_dir = runner.train(1, "preference-one", extra=flags + ["--save-every", "1"], **kw)
        two, two_dir = runner.train(kRanks, "preference-two", extra=flags, **kw)
        # The policy is its own reference at step 1: DPO's ln 2, IPO's (1 / (2 beta))^2 = 1.
        first = math.log(2) if objective == "dpo" else 1.0
        if rpo:  # ln 2 plus the term: the same on 1 and 2 ranks
            check(one["loss_first"] == two["loss_first"] > first,
                  f"{what}: first loss {one['loss_first']} (1 rank), {two['loss_first']} "
                  f"(2 ranks): want them equal and above ln 2")
        else:
            check(one["loss_first"] == two["loss_first"] == struct.unpack("f", struct.pack(
                "f", first))[0], f"{what}: first loss {one['loss_first']} (1 rank), "
                  f"{two['loss_first']} (2 ranks): want {first} in fp32")
        want = master_weights(checkpoint_dir(os.path.join(one_dir, "ckpt")))
        got = master_weights(checkpoint_dir(os.path.join(two_dir, "ckpt")))
        worst = compare_weights(got, want, kBound, f"{what}: 2 ranks vs 1 rank")
        after_first = master_weights(os.path.join(one_dir, "ckpt", "step-1"))
        check_moved(want, after_first, f"{what}: 1-rank run, step 1 -> step {kSteps}")
        a, b = one["preference"]["train_last_step"], two["preference"]["train_last_step"]
        check(a["pairs"] == b["pairs"] == kGlobalBatch // 2,
              f"{what}: pairs of the last step {a['pairs']} vs {b['pairs']}: want every rank's")
        check(abs(a["loss"] - b["loss"]) <= 1e-4 and abs(one["loss_last"] - two["loss_last"]) <= 1e-4,
              f"{what}: last step's loss {a['loss']} / {one['loss_last']} (1 rank) vs "
              f"{b['loss']} / {two['loss_last']} (2 ranks)")
        print(f"{what}: largest |2 ranks - 1 rank| {worst:.3g} (bound {kBound:g}); loss "
              f"{one['loss_last']:.4f} vs {two['loss_last']:.4f}")


def case_instruction(runner):
    # Instruction data counts a different number of targets in each micro-batch: each rank weights
    # its own by their share of the targets of the whole job, so that 2 ranks train as 1 rank
    # accumulating all of them (a mean per rank, averaged over the ranks, is not that mean).
    d = runner.fresh_dir("instruction-data")
    jsonl, tokens = os.path.join(d, "sft.jsonl"), os.path.join(d, "sft.bin")
    rng = __import__("random").Random(11)
    letters = "abcdefghijklmnopqrstuvwxyz"
    with open(jsonl, "w") as f:
        for _ in range(400):
            prompt = "".join(rng.choice(letters) for _ in range(rng.randint(1, 3)))
            response = "".join(rng.choice(letters) for _ in range(rng.randint(1, 12)))
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    runner.run([runner.strata, "tokenize", "--byte-level", "--input", jsonl, "--output", tokens])
    for precision, home in (("fp32", "host"), ("bf16", "nvme")):
        what = f"instruction data, {precision}, optimizer on {home}"
        kw = dict(data=tokens, precision=precision, optimizer_home=home)
        one, one_dir = runner.train(1, "instruction-one", extra=["--save-every", "1"], **kw)
        two, two_dir = runner.train(kRanks, "instruction-two", **kw)
        want = master_weights(checkpoint_dir(os.path.join(one_dir, "ckpt")))
        got = master_weights(checkpoint_dir(os.path.join(two_dir, "ckpt")))
        worst = compare_weights(got, want, kBound, f"{what}: 2 ranks vs 1 rank")
        after_first = master_weights(os.path.join(one_dir, "ckpt", "step-1"))
        check_moved(want, after_first, f"{what}: 1-rank run, step 1 -> step {kSteps}")
        check(abs(one["loss_last"] - two["loss_last"]) <= 1e-5 * abs(one["loss_last"]),
              f"{what}: last step's loss {one['loss_last']} (1 rank) vs {two['loss_last']} "
              "(2 ranks)")
        print(f"{what}: largest |2 ranks - 1 rank| {worst:.3g} (bound {kBound:g}); loss "
              f"{one['loss_last']:.6f} vs {two['loss_last']:.6f}")


def case_lora(runner):
    # LoRA over a frozen base under mpirun: the adapters are partitioned and reduced as any
    # block's params, the base is whole on every rank (one pinned copy per machine, shared). With dropout (each micro-batch's masks are
    # drawn from its index in the global batch, so 2 ranks draw what 1 rank accumulating draws),
    # then an NF4 base streamed from NVMe with the layer-major schedule; then a 2-rank resume.
    lora = ["--lora-rank", "4", "--lora-alpha", "8"]
    kw = dict(model="llama-tiny", seq_len=32)
    for what, flags in (
            ("LoRA, dropout 0.1", lora + ["--lora-dropout", "0.1", "--offload-params", "host"]),
            ("QLoRA nf4, base from NVMe, layer-major", lora + [
                "--base-quant", "nf4", "--offload-params", "nvme", "--schedule", "layer-major"])):
        one, one_dir = runner.train(1, "lora-one", extra=flags + ["--save-every", "1"], **kw)
        two, two_dir = runner.train(kRanks, "lora-two", extra=flags, **kw)
        want = master_weights(checkpoint_dir(os.path.join(one_dir, "ckpt")))
        got = master_weights(checkpoint_dir(os.path.join(two_dir, "ckpt")))
        worst = compare_weights(got, want, kBound, f"{what}: 2 ranks vs 1 rank")
        moved = check_moved(want, master_weights(os.path.join(one_dir, "ckpt", "step-1")),
                            f"{what}: 1-rank run, step 1 -> step {kSteps}")
        print(f"{what}: largest |2 ranks - 1 rank| {worst:.3g} (bound {kBound:g}), master_xxh3 "
              f"{'equal' if one['master_xxh3'] == two['master_xxh3'] else 'different'}; "
              f"{moved:.0%} of adapter weights moved; loss {one['loss_last']:.4f} vs "
              f"{two['loss_last']:.4f}; frozen base shared by {two['frozen_base_shared_by']}")
        check(one["frozen_base_shared_by"] == 1, f"{what}: one rank shares its base with none")
        if "--offload-params" in flags and flags[flags.index("--offload-params") + 1] == "host":
            # The base's pinned homes: one copy for the machine's two ranks (/dev/shm).
            check(two["frozen_base_shared_by"] == kRanks,
                  f"{what}: the 2 ranks' frozen base is shared by "
                  f"{two['frozen_base_shared_by']}, want {kRanks}")
    flags = lora + ["--lora-dropout", "0.1", "--offload-params", "host"]
    k = kSteps // 2
    straight, _ = runner.train(kRanks, "lora-straight", extra=flags, **kw)
    _, first_dir = runner.train(kRanks, "lora-first-half", steps=k, extra=flags, **kw)
    resumed, _ = runner.train(kRanks, "lora-resume", save_dir=os.path.join(first_dir, "ckpt"),
                              extra=flags + ["--resume", "latest"], **kw)
    check(resumed["start_step"] == k, f"LoRA resumed at step {resumed['start_step']}, want {k}")
    check(resumed["master_xxh3"] == straight["master_xxh3"],
          f"2-rank LoRA resume at step {k}: master_xxh3 {resumed['master_xxh3']} != the straight "
          f"run's {straight['master_xxh3']}")
    print(f"2-rank LoRA resume at step {k}: master_xxh3 {resumed['master_xxh3']} == straight")


def case_rank_error(runner):
    d = runner.fresh_dir("rank-error")
    os.makedirs(os.path.join(d, "nvme0"))
    # nvme1 is a file where rank 1's directory should be: strata train makes a missing --nvme-path
    # (tools/run_destinations.h) but cannot make one over a file, so rank 1 fails and rank 0 not.
    with open(os.path.join(d, "nvme1"), "w") as f:
        f.write("not a directory\n")
    t0 = time.monotonic()
    p = runner.run(runner.launch(kRanks, runner.train_args(nvme=os.path.join(d, "nvme{rank}"))),
                   timeout=100, expect_ok=False)
    out = p.stdout
    check(p.returncode != 0, f"exit 0 though rank 1's --nvme-path is missing:\n{out[-4000:]}")
    strata_lines = [l for l in out.splitlines() if l.startswith("strata: rank")]
    check(len(strata_lines) == 1 and strata_lines[0].startswith("strata: rank 1: "),
          f"want exactly one line 'strata: rank 1: ...', got {strata_lines}:\n{out[-4000:]}")
    check("nvme1" in strata_lines[0], f"the line does not name the missing directory: "
          f"{strata_lines[0]}")
    # As one process words it: "error: <message>", no status code (INVALID_ARGUMENT: ...).
    check(re.match(r"strata: rank 1: error: (?![A-Z_]+: )", strata_lines[0]) is not None,
          f"the line is not 'strata: rank 1: error: <message>': {strata_lines[0]}")
    print(f"rank 1's missing NVMe directory: exit {p.returncode} after "
          f"{time.monotonic() - t0:.1f} s: {strata_lines[0]}")


CASES = {
    "determinism": case_determinism,
    "bytes": case_bytes,
    "resume": case_resume,
    "kill": case_kill,
    "mismatch": case_mismatch,
    "rank-error": case_rank_error,
    "signal-one-rank": case_signal_one_rank,
    "preference": case_preference,
    "instruction": case_instruction,
    "lora": case_lora,
}
for _precision in ("bf16", "fp16"):
    for _home in ("host", "nvme"):
        CASES[f"equivalence-{_precision}-{_home}"] = (
            lambda r, p=_precision, h=_home: case_equivalence(r, p, h))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--strata", required=True, help="the strata binary")
    parser.add_argument("--data", required=True, help="training text (tinyshakespeare.txt)")
    parser.add_argument("--workdir", help="keep the runs' files here (default: a temporary "
                        "directory, removed at the end)")
    # After "--": the launcher and its flags (STRATA_MPIRUN), passed through untouched.
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.mpirun = argv[split + 1:]
    launcher = args.mpirun[0] if args.mpirun else ""
    if not launcher or shutil.which(launcher) is None:
        print(f"SKIP: no MPI launcher ('{launcher}'); install openmpi-bin "
              "(scripts/install-deps.sh)")
        return SKIP
    keep = args.workdir is not None
    if keep:
        os.makedirs(args.workdir, exist_ok=True)
        args.workdir = tempfile.mkdtemp(prefix=f"{args.case}-", dir=args.workdir)
    else:
        args.workdir = tempfile.mkdtemp(prefix=f"strata-mpi-{args.case}-")
    t0 = time.monotonic()
    try:
        CASES[args.case](Runner(args))
    except Failure as e:
        print(f"FAIL {args.case}: {e}")
        return 1
    except subprocess.TimeoutExpired as e:
        print(f"FAIL {args.case}: timed out after {e.timeout} s: {' '.join(e.cmd)}\n"
              f"{(e.output or '')[-4000:] if isinstance(e.output, str) else ''}")
        return 1
    finally:
        if not keep:
            shutil.rmtree(args.workdir, ignore_errors=True)
    print(f"PASS {args.case} in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
