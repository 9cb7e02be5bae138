#!/usr/bin/env python3
"""Hugging Face transformers + PEFT LoRA training of Strata's llama-1b shape: the baseline for
the LoRA runs of scripts/gpu/device.sh (phase `lora`), i.e. what a user fine-tunes with instead.

The model is transformers' LlamaForCausalLM with the configuration of Strata's `llama-1b` preset
(models/llama.cc: vocabulary 32000, 2048 channels, MLP 5632, 22 layers, 32 heads, 4 key/value
heads, untied head), randomly initialised, its weights in bf16 and frozen; PEFT's LoraConfig with
the given rank, alpha and target modules (the adapters in fp32, PEFT's default), no dropout.
Recipe (stated, since it decides the speed): fully resident on the GPU, no activation
checkpointing (Strata recomputes each block's forward in backward; this baseline does not have
to), the forward and backward under torch.autocast(bfloat16), attention through SDPA, AdamW with
fused=True on the adapters, micro-batches of random token ids, `--grad-accum` of them per step.

Timing: `--warmup` untimed steps, then `--steps` timed ones, each bracketed by a device
synchronize; tokens/s from the median step. Prints one JSON object.

  python3 bench/gpu/torch_lora_baseline.py --batch 4 --seq-len 1024 --grad-accum 2

Imports torch, transformers, peft and the standard library.
"""

import argparse
import json
import statistics
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

ALL7 = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32)
    p.add_argument("--targets", default=ALL7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                         num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                         max_position_embeddings=2048, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=0.0,
                                             target_modules=a.targets.split(","),
                                             task_type="CAUSAL_LM"))
    trained = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-4, fused=True)
    ids = torch.randint(0, config.vocab_size, (a.grad_accum, a.batch, a.seq_len), device="cuda")

    def step():
        for m in range(a.grad_accum):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids[m], labels=ids[m]).loss / a.grad_accum
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(a.warmup):
        step()
    times = []
    for _ in range(a.steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    t = statistics.median(times)
    tokens = a.grad_accum * a.batch * a.seq_len
    print(json.dumps({
        "name": "torch+peft/llama-1b/lora-resident", "rank": a.rank, "targets": a.targets,
        "tokens_per_step": tokens, "step_s": t, "tokens_per_second": tokens / t,
        "trained_params": sum(q.numel() for q in trained),
        "peak_bytes": torch.cuda.max_memory_allocated(), "device": torch.cuda.get_device_name(),
    }))


if __name__ == "__main__":
    main()
