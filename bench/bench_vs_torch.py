#!/usr/bin/env python3
"""params/s of a strata.optim optimizer against its torch.optim twin (foreach=True
and foreach=False) on the same CPU tensors.

    STRATA_LIBRARY=build/release/capi/libstrata.so PYTHONPATH=python \\
        /usr/bin/python3 bench/bench_vs_torch.py --params 10e6 50e6 --repeats 5 \\
        --optimizer adamw

--optimizer: adamw (default), adam, adagrad, sgd (momentum 0.9) or lion (strata
only: torch has no Lion).

Each configuration gets the same fp32 parameters (split into tensors of
--tensor-elems elements, as a model's layers) and the same gradients; one
untimed warm-up step creates the optimizer state, then --repeats timed steps;
the table shows the median (and min-max) time per step and params/s =
parameters / median. strata is run with fp32 gradients in p.grad (torch's
setting) and with bf16 gradients through step(grads=...) (its mixed-precision
setting; torch cannot hold a bf16 .grad on an fp32 parameter). Bytes per
parameter moved by one step: AdamW/Adam with fp32 grads 28 (read p, m, v, g;
write p, m, v), bf16 grads 26; Adagrad, SGD with momentum and Lion (one state
tensor) 20 and 18; GB/s is reported from those.
"""

import argparse
import os
import platform
import statistics
import time

import torch

import strata
import strata.optim


# --optimizer: (strata class, torch twin or None, hyper-parameters, state tensors)
OPTIMIZERS = {
    "adamw": (strata.optim.AdamW, torch.optim.AdamW,
              dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2), 2),
    "adam": (strata.optim.Adam, torch.optim.Adam,
             dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0), 2),
    "adagrad": (strata.optim.Adagrad, torch.optim.Adagrad,
                dict(lr=1e-2, lr_decay=0, weight_decay=0, eps=1e-10), 1),
    "sgd": (strata.optim.SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9), 1),
    "lion": (strata.optim.Lion, None, dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1), 1),
}


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def make_tensors(num_params, tensor_elems, seed):
    g = torch.Generator().manual_seed(seed)
    sizes = [tensor_elems] * (num_params // tensor_elems)
    if num_params % tensor_elems:
        sizes.append(num_params % tensor_elems)
    params = [torch.randn(n, generator=g) for n in sizes]
    grads = [torch.randn(n, generator=g) * 1e-2 for n in sizes]
    return params, grads


def time_steps(make_opt, params, grads, repeats, grads_kw):
    leaves = [torch.nn.Parameter(p.clone()) for p in params]
    if grads_kw is None:
        for p, g in zip(leaves, grads):
            p.grad = g
    opt = make_opt(leaves)
    step = (lambda: opt.step()) if grads_kw is None else (lambda: opt.step(grads=grads_kw))
    step()  # warm-up: allocates the optimizer state, faults in pages
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    del opt, leaves
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, nargs="+", default=[10e6, 50e6],
                        help="parameter counts (default 10e6 50e6)")
    parser.add_argument("--tensor-elems", type=float, default=1e6,
                        help="elements per parameter tensor (default 1e6)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps (default 5)")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS),
                        help="which optimizer (default adamw)")
    parser.add_argument("--threads", type=int, default=0,
                        help="strata num_threads and torch.set_num_threads (0: defaults)")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    strata_cls, torch_cls, kwargs, state_tensors = OPTIMIZERS[args.optimizer]
    name = strata_cls.__name__
    fp32_bytes = 4 * (3 + 2 * state_tensors)  # read p, state, g; write p, state
    configs = []
    if torch_cls is not None:
        for foreach in (False, True):
            configs.append((f"torch.optim.{name} foreach={foreach}", fp32_bytes, None,
                            lambda ps, f=foreach: torch_cls(ps, foreach=f, **kwargs)))
    configs += [
        (f"strata.optim.{name} fp32 grads", fp32_bytes, None,
         lambda ps: strata_cls(ps, num_threads=args.threads, **kwargs)),
        (f"strata.optim.{name} bf16 grads", fp32_bytes - 2, torch.bfloat16,
         lambda ps: strata_cls(ps, num_threads=args.threads, **kwargs)),
    ]
    print(f"# {cpu_model()}, {os.cpu_count()} CPUs; torch {torch.__version__} "
          f"({torch.get_num_threads()} threads); libstrata {strata.library_version()} "
          f"kernel {strata.kernel_name()} ({strata.library_path()}), strata threads "
          f"{args.threads or 'all'}")
    print(f"# {name}: {kwargs}")
    print(f"# median of {args.repeats} steps after one warm-up step; tensors of "
          f"{int(args.tensor_elems)} elements")
    print()
    print(f"| {'params':>6} | {'optimizer':<33} | {'median ms':>9} | {'min-max ms':>15} | "
          f"{'params/s':>9} | {'GB/s':>5} | {'vs foreach':>10} |")
    print(f"|{'-' * 8}|{'-' * 35}|{'-' * 11}|{'-' * 17}|{'-' * 11}|{'-' * 7}|{'-' * 12}|")
    for n in args.params:
        n = int(n)
        params, grads = make_tensors(n, int(args.tensor_elems), seed=0)
        baseline = None
        for label, bytes_per_param, grad_dtype, make_opt in configs:
            grads_kw = None if grad_dtype is None else [g.to(grad_dtype) for g in grads]
            times = time_steps(make_opt, params, grads, args.repeats, grads_kw)
            med = statistics.median(times)
            if "foreach=True" in label:
                baseline = med
            ratio = f"{baseline / med:.2f}x" if baseline else "-"
            print(f"| {n / 1e6:>5.0f}M | {label:<33} | {med * 1e3:>9.1f} | "
                  f"{min(times) * 1e3:>7.1f}-{max(times) * 1e3:<7.1f} | "
                  f"{n / med / 1e6:>8.0f}M | {n * bytes_per_param / med / 1e9:>5.2f} | "
                  f"{ratio:>10} |", flush=True)
        del params, grads


if __name__ == "__main__":
    main()
