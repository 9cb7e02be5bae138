#!/usr/bin/env python3
"""Plain PyTorch training of Strata's GPT shape: the baseline for bench/gpu/bench_train_step.

The same model as models/gpt.h: pre-LN GPT-2 blocks (LayerNorm, causal self-attention with one
fused QKV projection and biases, LayerNorm, 4C GELU MLP), learned position embeddings, byte
vocabulary (256), a final LayerNorm and an untied LM head without bias, so the parameter count P
equals Strata's for the same preset. Fully resident on one device, no offload, no activation
checkpointing (Strata recomputes the forward; that is not counted as model FLOPs either side).

Recipe (stated, since it decides the speed): fp32 parameters as the master weights, the forward
and backward under torch.autocast(bfloat16) (matrix products on the bf16 tensor cores, fp32
accumulation), attention through torch.nn.functional.scaled_dot_product_attention(is_causal=True)
(flash attention on Hopper), AdamW with fused=True on the fp32 parameters, zero_grad(set_to_none).
Memory: 16 B/param of model state (fp32 params, grads, m, v) plus activations.

Timing: `--warmup` untimed steps, then `--steps` timed ones, each bracketed by a device
synchronize (events would time the same: a step ends with the optimizer's kernels); the median
step time gives tokens/s and model FLOP/s by the formula of bench_train_step:
    model FLOPs per step = 6 * P * tokens + 12 * L * T * C * tokens
(Chowdhery et al. 2022, "PaLM", appendix B), and MFU = model FLOP/s / the device's dense bf16
peak (--peak-tflops, else by device name: H100 SXM and H200 989, H100 PCIe 756, A100 312).

A model whose state does not fit in the device's free memory is not run as given: with
--fit-layers it runs the largest number of layers of the same width that fits (reported as
layers_run; MFU per layer hardly depends on the depth), else it prints a JSON line that says it
was skipped and why. Prints one JSON object on stdout (and writes it to --out when given).

  python3 bench/gpu/torch_gpt_baseline.py --preset gpt2-1.5b --batch 8 --seq-len 1024
  python3 bench/gpu/torch_gpt_baseline.py --device cpu --layers 2 --heads 2 --channels 64 \\
      --seq-len 32 --batch 2 --steps 2 --warmup 1

Imports only torch and the standard library.
"""

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# models/gpt.cc's presets: max_seq_len, layers, heads, channels (vocabulary 256).
PRESETS = {
    "tiny": (16, 2, 2, 16),
    "small": (64, 12, 4, 128),
    "gpt2-124m": (1024, 12, 12, 768),
    "gpt2-350m": (1024, 24, 16, 1024),
    "gpt2-774m": (1024, 36, 20, 1280),
    "gpt2-1.5b": (1024, 48, 25, 1600),
    "gpt-7b": (2048, 32, 32, 4096),
    "gpt-13b": (2048, 40, 40, 5120),
}
VOCAB = 256


def attention(q, k, v):
    """Causal attention of (B, H, T, d) bf16 tensors: SDPA (flash attention on Hopper)."""
    if HAVE_SDPA:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # torch < 2.0 (the CPU check of this script on Debian 12's python3-torch): the same
    # function, materialising the (T, T) scores.
    T = q.shape[2]
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return s.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype) @ v


HAVE_SDPA = hasattr(F, "scaled_dot_product_attention")
OOM = getattr(torch, "OutOfMemoryError", getattr(torch.cuda, "OutOfMemoryError", RuntimeError))


class Block(nn.Module):
    def __init__(self, channels, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(channels)
        self.qkv = nn.Linear(channels, 3 * channels)
        self.attn_proj = nn.Linear(channels, channels)
        self.ln2 = nn.LayerNorm(channels)
        self.fc = nn.Linear(channels, 4 * channels)
        self.mlp_proj = nn.Linear(4 * channels, channels)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        shape = (B, T, self.heads, C // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = attention(q, k, v)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, max_seq_len, layers, heads, channels):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, channels)
        self.wpe = nn.Embedding(max_seq_len, channels)
        self.blocks = nn.ModuleList(Block(channels, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, VOCAB, bias=False)  # untied, as Strata's head block
        # GPT-2's initialisation (models/gpt_kernels.cc): N(0, 0.02), residual projections
        # N(0, 0.02 / sqrt(2 L)), zero biases, unit LayerNorm weights.
        for name, p in self.named_parameters():
            if p.dim() == 1:
                continue  # biases 0, LayerNorm weights 1 (nn defaults)
            std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
            nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


def num_params(max_seq_len, layers, channels):
    """Strata's P for the shape (models/gpt.cc): embeddings, L layers, final LayerNorm + head."""
    C = channels
    return (VOCAB + max_seq_len) * C + layers * (12 * C * C + 13 * C) + 2 * C + VOCAB * C


def model_flops(params, layers, seq_len, channels, tokens):
    """bench_train_step's model FLOPs per step: 6 P tokens + 12 L T C tokens."""
    return 6.0 * params * tokens + 12.0 * layers * seq_len * channels * tokens


def peak_tflops_by_name(name):
    if "H100" in name and "PCIe" in name.replace("PCIE", "PCIe"):
        return 756.0
    if "H100" in name or "H200" in name:
        return 989.0
    if "A100" in name:
        return 312.0
    return 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), help="shape of models/gpt.cc")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--channels", type=int)
    ap.add_argument("--max-seq-len", type=int, help="position table size (default: seq-len)")
    ap.add_argument("--seq-len", type=int, required=True, help="T")
    ap.add_argument("--batch", type=int, required=True, help="B, sequences per step")
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="dense bf16 peak")
    ap.add_argument("--fit-layers", action="store_true",
                    help="run fewer layers of the same width when the state does not fit")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()

    max_seq_len, layers, heads, channels = PRESETS.get(args.preset, (None,) * 4)
    layers = args.layers or layers
    heads = args.heads or heads
    channels = args.channels or channels
    max_seq_len = args.max_seq_len or max_seq_len or args.seq_len
    if not (layers and heads and channels):
        ap.error("give --preset or all of --layers, --heads, --channels")
    if channels % heads or args.seq_len > max_seq_len:
        ap.error("channels must divide by heads and seq-len must not exceed max-seq-len")
    B, T = args.batch, args.seq_len
    tokens = B * T
    device = torch.device(args.device)

    result = {
        "name": f"torch/{args.preset or 'custom'}/resident",
        "framework": f"torch {torch.__version__}",
        "recipe": "fp32 master params, autocast bf16, AdamW"
                  + (" (fused)" if args.device.startswith("cuda") else ""),
        "layers": layers, "heads": heads, "channels": channels, "max_seq_len": max_seq_len,
        "batch": B, "seq_len": T, "tokens_per_step": tokens,
        "params": num_params(max_seq_len, layers, channels),
    }
    peak = args.peak_tflops
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return emit(args, dict(result, skipped="no CUDA device visible to torch"))
        name = torch.cuda.get_device_name(device)
        result["device"] = name
        peak = peak or peak_tflops_by_name(name)
        free, _ = torch.cuda.mem_get_info(device)
        # 16 B/param of state, activations ~34 C bytes per token and layer in 16-bit, plus
        # 5 H T for the attention scores where they are materialised (Korthikanti et al. 2022,
        # "Reducing Activation Recomputation in Large Transformer Models"; SDPA keeps none), and
        # 10% for the allocator and the workspaces.
        def need(n_layers):
            p = num_params(max_seq_len, n_layers, channels)
            per_token = 34 * channels + (0 if HAVE_SDPA else 5 * heads * T)
            return 1.1 * (16 * p + tokens * n_layers * per_token)
        if need(layers) > free:
            fits = max((n for n in range(1, layers + 1) if need(n) <= free), default=0)
            why = (f"the state of {layers} layers needs ~{need(layers) / 2**30:.0f} GiB, "
                   f"{free / 2**30:.0f} GiB free")
            if not args.fit_layers or fits == 0:
                return emit(args, dict(result, skipped=why))
            result["note"] = f"{why}: ran {fits} of {layers} layers of the same width"
            layers = fits
    else:
        result["device"] = device.type
    result["attention"] = "sdpa causal" if HAVE_SDPA else "explicit causal softmax (no SDPA)"
    result["layers_run"] = layers
    result["params_run"] = num_params(max_seq_len, layers, channels)
    result["peak_bf16_tflops"] = peak or None

    torch.manual_seed(1337)
    if hasattr(torch.device, "__enter__"):  # torch >= 2.0: built and initialised on the device
        with device:
            model = Gpt(max_seq_len, layers, heads, channels)
    else:
        model = Gpt(max_seq_len, layers, heads, channels).to(device)
    assert sum(p.numel() for p in model.parameters()) == result["params_run"]
    # fused AdamW (one multi-tensor kernel) on the GPU; torch < 2.0 has no fused option.
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, **fused)
    gen = torch.Generator(device="cpu").manual_seed(7)
    idx = torch.randint(0, VOCAB, (B, T), generator=gen).to(device)
    targets = torch.randint(0, VOCAB, (B, T), generator=gen).to(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step():
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    try:
        for _ in range(args.warmup):
            step()
        sync()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            loss = step()
            sync()
            times.append(time.perf_counter() - t0)
    except OOM as e:
        return emit(args, dict(result, skipped=f"out of device memory: {str(e)[:200]}"))

    med = statistics.median(times)
    flops = model_flops(result["params_run"], layers, T, channels, tokens)
    result.update({
        "steps": args.steps, "warmup": args.warmup,
        "step_s": med, "step_s_min": min(times), "step_s_max": max(times),
        "tokens_per_s": tokens / med,
        "model_TFLOP_per_s": flops / med / 1e12,
        "MFU": flops / med / 1e12 / peak if peak else None,
        "loss": float(loss),
    })
    if device.type == "cuda":
        result["max_memory_allocated_GiB"] = torch.cuda.max_memory_allocated(device) / 2**30
    return emit(args, result)


def emit(args, result):
    text = json.dumps(result)
    print(text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
