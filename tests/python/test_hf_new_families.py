"""Strata's Qwen2, Qwen3, Phi-3, sliding-window Mistral and biased Llama against float64
PyTorch references of the Hugging Face architectures.

The references are written here from the published modeling and configuration code of
transformers (not installed, and not to be used), as one decoder (decoder_loss) whose
per-family differences are spelled out in family_traits:

- qwen2 (Qwen2ForCausalLM): Llama with biases on q_proj, k_proj, v_proj (none on o_proj);
  layer i uses a sliding window iff use_sliding_window, sliding_window is set and
  i >= max_window_layers (Qwen2Config.layer_types; Qwen2.5 configs carry
  use_sliding_window false, so their sliding_window and max_window_layers are inert);
- qwen3 (Qwen3ForCausalLM): an explicit head_dim (num_attention_heads * head_dim need not be
  hidden_size), RMSNorm over head_dim of every query and key head (self_attn.q_norm,
  self_attn.k_norm) BEFORE the rotary embedding, q/k/v/o biases iff attention_bias;
- mistral (MistralForCausalLM) with sliding_window w: key j is visible from query i iff
  i - w < j <= i (masking_utils: causal_mask_function and sliding_window_overlay), in every
  layer;
- phi3 (Phi3ForCausalLM): fused self_attn.qkv_proj ((H + 2 Hkv) hs, C: rows q, then k, then
  v) and mlp.gate_up_proj (2I, C: gate = first I rows, up = last I; out = down(up * silu(gate))),
  sliding_window as Mistral's (every layer; null: none), no biases; partial_rotary_factor
  (Phi-4-mini): RoPE on the first int(head_dim * factor) columns of each head only
  (modeling_phi3.apply_rotary_pos_emb: rotary_dim = cos.shape[-1], the rest passed through),
  inv_freq over that dim; rope_scaling longrope (Phi-3 128k, Phi-3.5, Phi-4-mini;
  modeling_rope_utils._compute_longrope_parameters with Phi3Config's
  original_max_position_embeddings, default 4096): inv_freq[j] = 1 / (ext[j] theta^(2j/dim))
  with ext = long_factor when the sequence is longer than original_max_position_embeddings
  (dynamic_rope_update's longrope switch on max(position_ids) + 1), else short_factor, and cos
  and sin times attention_factor (default sqrt(1 + ln s / ln original), s = max_position /
  original, 1 when s <= 1);
- llama (LlamaForCausalLM) with attention_bias true: q, k, v AND o biases.

Tiny random models of each (config.json with the fields and value shapes Hugging Face's
configuration classes write, safetensors F32 or BF16, one sharded) and llm.c token files
are written, then, with the bounds of test_hf_families.py (imported as `base`):

- `strata eval --json` reports the reference's mean cross-entropy within EVAL_REL_TOL
  (1e-5 relative, see base); ReferenceSensitivityTest shows that each thing this file is
  about -- the window (and its off-by-one), each kind of bias, q_norm/k_norm and their place
  before RoPE, the fused row orders -- moves the fixture's loss by more than 10 *
  EVAL_REL_TOL (measured: 34x at least), so an eval within the bound rules each mistake out;
  the attention biases are drawn 5x larger than base's for that (with_strong_biases);
- `hf_gradients` (STRATA_HF_GRADIENTS) writes the fp32 gradient of every parameter, named as
  in the directory (phi3's fused names; every bias; q_norm and k_norm), within
  |g - ref| <= GRAD_REL_TOL * max|ref| + GRAD_ABS_TOL per tensor (base.assert_gradient_close);
  each mistake above moves some gradient by more than 1000x that bound (measured: 3200x);
- with --lora-init, the adapter gradients of qwen2 (q/k/v/o/gate/up/down_proj) and phi3
  (qkv_proj, o_proj, gate_up_proj, down_proj: ONE adapter A (r, C), B (out_total, r) over a
  fused module's whole output, as PEFT puts on the nn.Linear) within the same bound, dropout
  off and on (models/lora.h's mask, base.lora_keep_mask; sites numbered among the targeted
  modules in the family's module order);
- `strata train --model-dir` fine-tunes each family (loss drops), `strata export` writes the
  family's model_type, architectures and exact tensor names (phi3 fused), and the export
  re-evaluates to the checkpoint's loss and to the reference on the exported weights;
- malformed or unsupported configurations fail with a non-zero exit and ONE stderr line
  naming config.json and the field (or the file and the tensor).

CLI tests SKIP without STRATA_CLI (or STRATA_HF_GRADIENTS); the reference self-checks always
run. Run directly (`/usr/bin/python3 tests/python/test_hf_new_families.py`); exits 77 (CTest
SKIP_RETURN_CODE) when torch is not importable.
"""

import json
import math
import os
import shutil
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_hf_families as base  # noqa: E402  (the shared helpers, formats and bounds)

torch = base.torch
np = getattr(base, "np", None)
F64 = base.F64
SKIP = base.SKIP
EVAL_REL_TOL = base.EVAL_REL_TOL
GRAD_REL_TOL = base.GRAD_REL_TOL
STRATA_CLI = base.STRATA_CLI
STRATA_HF_GRADIENTS = base.STRATA_HF_GRADIENTS
NO_CLI = base.NO_CLI
NO_GRADIENTS = base.NO_GRADIENTS
Model = base.Model
run, windows = base.run, base.windows
rms_norm, apply_rope, rope_cos_sin = base.rms_norm, base.apply_rope, base.rope_cos_sin

SEQ_LEN = 13  # longer than every sliding window below, odd
MICRO_BATCH = 3
EVAL_TOKENS = 7 * SEQ_LEN + 5  # 7 full windows: not a multiple of MICRO_BATCH
MISTRAL_WINDOW = 5
PHI3_WINDOW = 6


# ---------------------------------------------------------------------------
# The reference decoder.

def family_traits(cfg):
    """What distinguishes the family's decoder layer, from its modeling code:
    qkv_bias / o_bias (nn.Linear bias of q,k,v_proj / o_proj), qk_norm (Qwen3's per-head
    RMSNorm of q and k before RoPE), fused (Phi-3's qkv_proj and gate_up_proj)."""
    mt = cfg["model_type"]
    bias = bool(cfg.get("attention_bias", False))
    if mt in ("llama", "mistral"):
        if cfg.get("mlp_bias", False):
            raise ValueError("reference has no mlp_bias")
        b = bias if mt == "llama" else False  # MistralAttention: bias=False
        return {"qkv_bias": b, "o_bias": b, "qk_norm": False, "fused": False}
    if mt == "qwen2":  # q,k,v_proj bias=True, o_proj bias=False, whatever the config says
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False, "fused": False}
    if mt == "qwen3":  # every projection bias=config.attention_bias
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True, "fused": False}
    if mt == "phi3":  # qkv_proj and o_proj bias=False (attention_bias is not read)
        return {"qkv_bias": False, "o_bias": False, "qk_norm": False, "fused": True}
    raise ValueError(f"no reference for model_type {mt!r}")


def head_dim(cfg):
    """Qwen3Config has head_dim (default 128); the others read head_dim when the config
    carries one, else hidden_size // num_attention_heads."""
    if cfg["model_type"] == "qwen3":
        return cfg.get("head_dim", 128)
    hd = cfg.get("head_dim")
    return hd if hd is not None else cfg["hidden_size"] // cfg["num_attention_heads"]


def kv_heads(cfg):
    return cfg.get("num_key_value_heads") or cfg["num_attention_heads"]


def qwen_layer_types(cfg):
    """Qwen2Config / Qwen3Config: sliding_window is dropped unless use_sliding_window; then
    layer i is "sliding_attention" iff sliding_window is set and i >= max_window_layers
    (an explicit layer_types list wins)."""
    if cfg.get("layer_types") is not None:
        return list(cfg["layer_types"])
    window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
    return ["sliding_attention" if window is not None and i >= cfg.get("max_window_layers", 28)
            else "full_attention" for i in range(cfg["num_hidden_layers"])]


def layer_windows(cfg):
    """The sliding window w of each layer (None: plain causal)."""
    mt, n = cfg["model_type"], cfg["num_hidden_layers"]
    if mt in ("qwen2", "qwen3"):
        window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
        return [window if kind == "sliding_attention" else None for kind in qwen_layer_types(cfg)]
    if mt in ("mistral", "phi3"):  # every layer; MistralConfig's default is 4096, Phi3's None
        return [cfg.get("sliding_window", 4096 if mt == "mistral" else None)] * n
    return [None] * n


def rotary_dim(cfg):
    """int(head_dim * partial_rotary_factor) (phi3 only; the others rotate the whole head)."""
    if cfg["model_type"] != "phi3":
        return head_dim(cfg)
    return int(head_dim(cfg) * cfg.get("partial_rotary_factor", 1.0))


def rope_tables(cfg, t, full_rotary=False):
    """cos, sin (T, rotary dim) of positions 0..T-1, each half duplicated, times LongRoPE's
    attention factor. inv_freq: theta^(-2j/dim), j < dim/2; Llama-3 scaling for llama/mistral
    as base does; longrope for phi3 (the module docstring); the reference raises on any other
    rope_scaling. full_rotary: the whole head turns (LongRoPE's factors padded with 1), for
    ReferenceSensitivityTest only."""
    dim = head_dim(cfg) if full_rotary else rotary_dim(cfg)
    theta = cfg.get("rope_theta", 10000.0)
    base_freq = theta ** (torch.arange(0, dim, 2, dtype=F64) / dim)
    inv, attention = 1 / base_freq, 1.0
    rs = cfg.get("rope_scaling")
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "llama3" and cfg["model_type"] in ("llama", "mistral"):
            inv = base.llama3_scale_inv_freq(inv, rs)
        elif kind in ("longrope", "su") and cfg["model_type"] == "phi3":
            original = cfg.get("original_max_position_embeddings", 4096)
            ext = rs["long_factor"] if t > original else rs["short_factor"]
            ext = torch.tensor(list(ext) + [1.0] * (dim // 2 - len(ext)), dtype=F64)
            inv = 1 / (ext * base_freq)
            scale = cfg["max_position_embeddings"] / original
            attention = rs.get("attention_factor") or (
                math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        else:
            raise ValueError(f"reference has no rope_scaling {kind!r} for {cfg['model_type']}")
    cos, sin = rope_cos_sin(inv, t)
    return cos * attention, sin * attention


def apply_partial_rope(x, cos, sin):
    """apply_rope on the first cos.shape[-1] columns of x's heads, the rest passed through."""
    d = cos.shape[-1]
    return torch.cat([apply_rope(x[..., :d], cos, sin), x[..., d:]], -1)


def visible(t, window=None):
    """(T, T) bool: key j visible from query i iff j <= i and (no window or j > i - window)."""
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    vis = j <= i
    return vis if window is None else vis & (j > i - window)


def windowed_attention(q, k, v, window=None):
    """base.causal_attention with the sliding-window mask: softmax(q k^T / sqrt(hs)) v over
    the visible keys; query head h reads kv head h // (H / Hkv)."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~visible(q.shape[2], window), float("-inf")).softmax(-1) @ v


def decoder_param_shapes(cfg):
    """{Hugging Face name: shape} of the family, in Llama's order."""
    tr = family_traits(cfg)
    c, i_size, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hs, h, hkv = head_dim(cfg), cfg["num_attention_heads"], kv_heads(cfg)
    shapes = {"model.embed_tokens.weight": (v, c)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c,)
        if tr["fused"]:
            shapes[p + "self_attn.qkv_proj.weight"] = ((h + 2 * hkv) * hs, c)
        else:
            for name, rows in (("q_proj", h * hs), ("k_proj", hkv * hs), ("v_proj", hkv * hs)):
                shapes[p + f"self_attn.{name}.weight"] = (rows, c)
                if tr["qkv_bias"]:
                    shapes[p + f"self_attn.{name}.bias"] = (rows,)
        if tr["qk_norm"]:
            shapes[p + "self_attn.q_norm.weight"] = (hs,)
            shapes[p + "self_attn.k_norm.weight"] = (hs,)
        shapes[p + "self_attn.o_proj.weight"] = (c, h * hs)
        if tr["o_bias"]:
            shapes[p + "self_attn.o_proj.bias"] = (c,)
        shapes[p + "post_attention_layernorm.weight"] = (c,)
        if tr["fused"]:
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * i_size, c)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (i_size, c)
            shapes[p + "mlp.up_proj.weight"] = (i_size, c)
        shapes[p + "mlp.down_proj.weight"] = (c, i_size)
    shapes["model.norm.weight"] = (c,)
    if not cfg.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (v, c)
    return shapes


def decoder_loss(p, cfg, inputs, targets, head=None, delta=None, qk_norm_after_rope=False,
                 full_rotary=False):
    """Mean next-token cross-entropy of the family's ForCausalLM with parameters p (Hugging
    Face names, float64), inputs/targets (B, T) int64. head overrides the output matrix
    (default lm_head, or embed_tokens when tied). delta(layer, module, x) -> tensor or None
    is added to the output of every projection (LoRA). qk_norm_after_rope: the wrong order,
    and full_rotary (rope_tables), for ReferenceSensitivityTest only."""
    tr = family_traits(cfg)
    b, t = inputs.shape
    hs, eps = head_dim(cfg), cfg["rms_norm_eps"]
    h, hkv = cfg["num_attention_heads"], kv_heads(cfg)
    cos, sin = rope_tables(cfg, t, full_rotary)
    layer_window = layer_windows(cfg)

    def proj(i, path, x, bias):
        pre = f"model.layers.{i}.{path}."
        y = x @ p[pre + "weight"].T
        if bias:
            y = y + p[pre + "bias"]
        if delta is not None:
            d = delta(i, path.split(".")[-1], x)
            if d is not None:
                y = y + d
        return y

    x = p["model.embed_tokens.weight"][inputs]
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        a = rms_norm(x, p[pre + "input_layernorm.weight"], eps)
        if tr["fused"]:
            q, k, v = proj(i, "self_attn.qkv_proj", a, False).split(
                [h * hs, hkv * hs, hkv * hs], dim=-1)
        else:
            q = proj(i, "self_attn.q_proj", a, tr["qkv_bias"])
            k = proj(i, "self_attn.k_proj", a, tr["qkv_bias"])
            v = proj(i, "self_attn.v_proj", a, tr["qkv_bias"])
        q, k, v = q.view(b, t, h, hs), k.view(b, t, hkv, hs), v.view(b, t, hkv, hs)
        if tr["qk_norm"] and not qk_norm_after_rope:
            q = rms_norm(q, p[pre + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, p[pre + "self_attn.k_norm.weight"], eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        if tr["qk_norm"] and qk_norm_after_rope:
            q = rms_norm(q, p[pre + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, p[pre + "self_attn.k_norm.weight"], eps)
        y = windowed_attention(q, k, v, layer_window[i])
        x = x + proj(i, "self_attn.o_proj", y.transpose(1, 2).reshape(b, t, h * hs), tr["o_bias"])
        m = rms_norm(x, p[pre + "post_attention_layernorm.weight"], eps)
        if tr["fused"]:
            gate, up = proj(i, "mlp.gate_up_proj", m, False).chunk(2, dim=-1)
        else:
            gate = proj(i, "mlp.gate_proj", m, False)
            up = proj(i, "mlp.up_proj", m, False)
        x = x + proj(i, "mlp.down_proj", up * torch.nn.functional.silu(gate), False)
    x = rms_norm(x, p["model.norm.weight"], eps)
    if head is None:
        head = p["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings", False) \
            else p["lm_head.weight"]
    return base.mean_cross_entropy(x @ head.T, targets)


# Plug the families into base's table: random_params, Model and write_model_dir then serve
# them. llama and mistral are replaced by decoder_loss, which equals base.llama_loss on every
# configuration base covers (ReferenceDecoderTest checks it on base's models) and adds
# attention_bias and sliding windows. Only this process's table changes.
for _mt in ("llama", "mistral", "qwen2", "qwen3", "phi3"):
    base.FAMILIES[_mt] = (decoder_param_shapes, decoder_loss)


# ---------------------------------------------------------------------------
# Configurations: the fields (and value shapes) that the configuration classes write in a
# published config.json, tiny sizes.

def qwen2_config(layers, heads, kv, tied, sliding_window, max_window_layers,
                 use_sliding_window=False, rope_theta=1000000.0, torch_dtype="float32",
                 realistic_extras=True):
    """Qwen2.5's config.json shape (e.g. Qwen2.5-1.5B: use_sliding_window false,
    sliding_window 32768, max_window_layers 21 of 28 layers)."""
    cfg = {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 95,
        "eos_token_id": 96,
        "hidden_act": "silu",
        "hidden_size": 24,
        "initializer_range": 0.02,
        "intermediate_size": 40,
        "max_position_embeddings": 64,
        "max_window_layers": max_window_layers,
        "model_type": "qwen2",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv,
        "rms_norm_eps": 1e-06,
        "rope_theta": rope_theta,
        "sliding_window": sliding_window,
        "tie_word_embeddings": tied,
        "torch_dtype": torch_dtype,
        "transformers_version": "4.43.1",
        "use_cache": True,
        "use_sliding_window": use_sliding_window,
        "vocab_size": 97,
    }
    if realistic_extras:  # Qwen2.5 configs also carry these
        cfg["rope_scaling"] = None
        cfg["use_mrope"] = False
    return cfg


def qwen3_config(layers, heads, kv, hd, tied, attention_bias, hidden=32, torch_dtype="float32"):
    """Qwen3's config.json shape (e.g. Qwen3-0.6B: hidden 1024, 16 heads of head_dim 128)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": attention_bias,
        "attention_dropout": 0.0,
        "bos_token_id": 99,
        "eos_token_id": 100,
        "head_dim": hd,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": 48,
        "max_position_embeddings": 64,
        "max_window_layers": layers,
        "model_type": "qwen3",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": tied,
        "torch_dtype": torch_dtype,
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 101,
    }


def mistral_config(layers, heads, kv, window, tied=False, torch_dtype="float32"):
    """Mistral-7B-v0.1's config.json shape (sliding_window 4096 < max_position_embeddings)."""
    return {
        "architectures": ["MistralForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 24,
        "initializer_range": 0.02,
        "intermediate_size": 40,
        "max_position_embeddings": 64,
        "model_type": "mistral",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "sliding_window": window,
        "tie_word_embeddings": tied,
        "torch_dtype": torch_dtype,
        "transformers_version": "4.34.0.dev0",
        "use_cache": True,
        "vocab_size": 97,
    }


def phi3_config(layers, heads, kv, window, tied=False, torch_dtype="float32",
                partial_rotary_factor=None, rope_scaling=None, original_max=64):
    """Phi-3-mini-4k-instruct's config.json shape (sliding_window 2047, rope_scaling null,
    original_max_position_embeddings, the dropouts at 0); with rope_scaling longrope that of
    Phi-3.5-mini-instruct (and partial_rotary_factor 0.75, Phi-4-mini-instruct's).
    partial_rotary_factor None: absent."""
    cfg = {
        "architectures": ["Phi3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "embd_pdrop": 0.0,
        "eos_token_id": 100,
        "hidden_act": "silu",
        "hidden_size": 24,
        "initializer_range": 0.02,
        "intermediate_size": 40,
        "max_position_embeddings": 64,
        "model_type": "phi3",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv,
        "original_max_position_embeddings": original_max,
        "pad_token_id": 100,
        "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05,
        "rope_scaling": rope_scaling,
        "rope_theta": 10000.0,
        "sliding_window": window,
        "tie_word_embeddings": tied,
        "torch_dtype": torch_dtype,
        "transformers_version": "4.40.2",
        "use_cache": True,
        "vocab_size": 101,
    }
    if partial_rotary_factor is not None:
        cfg["partial_rotary_factor"] = partial_rotary_factor
    return cfg


def llama_bias_config(layers, heads, kv, tied=False):
    cfg = base.llama_config(layers=layers, heads=heads, kv_heads=kv, tied=tied)
    cfg["attention_bias"] = True
    return cfg


def with_strong_biases(model, scale=5.0):
    """Attention biases drawn at 0.5 instead of base.random_params' 0.1 (Qwen's q/k biases
    are large in the published checkpoints), rounded to the storage dtype again: at 0.1 the
    loss moves by less than EVAL_REL_TOL without them (ReferenceSensitivityTest)."""
    round_to = {"F32": torch.float32, "BF16": torch.bfloat16}[model.storage]
    for name, t in model.params.items():
        if name.endswith(".bias"):
            model.params[name] = (scale * t).to(round_to).to(F64)
    return model


def make_models():
    return [with_strong_biases(m) for m in _make_models()]


def _make_models():
    return [
        # Inert window fields (use_sliding_window false, sliding_window < T, max_window_layers
        # < layers), sharded, rope_theta 1e4.
        Model("qwen2_untied_inert_window_sharded_f32",
              qwen2_config(layers=2, heads=4, kv=2, tied=False, sliding_window=4,
                           max_window_layers=1, rope_theta=10000.0, realistic_extras=False),
              seed=51, shards=2),
        # As Qwen2.5-0.5B: tied, window = context, max_window_layers = layers, BF16.
        Model("qwen2_tied_bf16",
              qwen2_config(layers=2, heads=6, kv=2, tied=True, sliding_window=64,
                           max_window_layers=2, torch_dtype="bfloat16"),
              seed=52, storage="BF16"),
        # 4 heads of 12 = 48 != hidden 32.
        Model("qwen3_tied_head_dim_f32",
              qwen3_config(layers=2, heads=4, kv=2, hd=12, tied=True, attention_bias=False),
              seed=53),
        Model("qwen3_untied_bias_mqa_f32",
              qwen3_config(layers=3, heads=4, kv=1, hd=10, tied=False, attention_bias=True),
              seed=54),
        Model("mistral_window5_gqa_f32",
              mistral_config(layers=2, heads=4, kv=2, window=MISTRAL_WINDOW), seed=55),
        Model("phi3_window6_gqa_f32",
              phi3_config(layers=2, heads=4, kv=2, window=PHI3_WINDOW), seed=56),
        Model("phi3_tied_no_window_bf16",
              phi3_config(layers=2, heads=4, kv=4, window=None, tied=True,
                          torch_dtype="bfloat16", partial_rotary_factor=1.0),
              seed=57, storage="BF16"),
        Model("llama_attention_bias_f32", llama_bias_config(layers=2, heads=4, kv=2), seed=58),
        # use_sliding_window true: layer 1 (>= max_window_layers) attends through a 4-token
        # window, layer 0 sees the whole causal prefix.
        Model("qwen2_window_on_layer1_f32",
              qwen2_config(layers=2, heads=4, kv=2, tied=False, sliding_window=4,
                           max_window_layers=1, rope_theta=10000.0, realistic_extras=False,
                           use_sliding_window=True),
              seed=59),
        # As Phi-4-mini: RoPE on int(6 x 0.75) = 4 of each head's 6 columns, LongRoPE; T = 13
        # is past the original 8 positions, so the long factors apply; s = 64 / 8, attention
        # factor sqrt(1 + ln 8 / ln 8) = sqrt(2).
        Model("phi3_longrope_partial_long_f32",
              phi3_config(layers=2, heads=4, kv=2, window=None, partial_rotary_factor=0.75,
                          rope_scaling={"type": "longrope", "short_factor": [1.0, 1.7],
                                        "long_factor": [2.5, 7.0]},
                          original_max=8),
              seed=60),
        # As Phi-3.5-mini: the whole head turns, LongRoPE; T = 13 is within the original 16
        # positions: the short factors, attention factor sqrt(1 + ln 4 / ln 16); tied, BF16.
        Model("phi3_longrope_short_tied_bf16",
              phi3_config(layers=2, heads=2, kv=1, window=PHI3_WINDOW, tied=True,
                          torch_dtype="bfloat16",
                          rope_scaling={"type": "longrope",
                                        "short_factor": [1.0, 1.1, 1.3, 2.0, 3.5, 6.0],
                                        "long_factor": [1.5, 4.0, 9.0, 16.0, 30.0, 60.0]},
                          original_max=16),
              seed=61, storage="BF16"),
    ]


# ---------------------------------------------------------------------------
# LoRA on the new families (PEFT names: base_model.model.<module path>.lora_A/B.weight).

PHI3_LORA_MODULES = [("qkv_proj", "self_attn"), ("o_proj", "self_attn"),
                     ("gate_up_proj", "mlp"), ("down_proj", "mlp")]


def family_lora_modules(cfg):
    """(module, its path in a layer, in, out) in the family's module order; out of a fused
    module is its whole output ((H + 2 Hkv) hs for qkv_proj, 2I for gate_up_proj)."""
    order = PHI3_LORA_MODULES if family_traits(cfg)["fused"] else base.LLAMA_LORA_MODULES
    shapes = decoder_param_shapes(cfg)
    out = []
    for module, group in order:
        rows, cols = shapes[f"model.layers.0.{group}.{module}.weight"]
        out.append((module, f"{group}.{module}", cols, rows))
    return out


def family_lora_loss(model, adapters, lora, inputs, targets, dropout_seed=None):
    """decoder_loss with y += (alpha / r) dropout(x) A^T B^T on every targeted module
    (base.lora_delta; site = index among the targeted modules in the family's order)."""
    targeted = [m for m, _, _, _ in family_lora_modules(model.cfg) if m in lora["targets"]]

    def delta(i, module, x):
        if module not in targeted:
            return None
        a, bb = adapters[(i, module)]
        return base.lora_delta(x, a, bb, lora, i, targeted.index(module), dropout_seed)

    return decoder_loss(model.params, model.cfg, inputs, targets, delta=delta)


def write_family_lora_adapter(path, model, lora, seed):
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) with random
    nonzero A and B; returns {(layer, module): (A, B)}."""
    gen = torch.Generator().manual_seed(seed)
    adapters, tensors = {}, {}
    for i in range(model.cfg["num_hidden_layers"]):
        for module, mpath, fan_in, fan_out in family_lora_modules(model.cfg):
            if module not in lora["targets"]:
                continue
            a = (0.3 * torch.randn(lora["r"], fan_in, generator=gen, dtype=F64)).float().double()
            bb = (0.3 * torch.randn(fan_out, lora["r"], generator=gen, dtype=F64)).float().double()
            adapters[(i, module)] = (a, bb)
            name = f"base_model.model.model.layers.{i}.{mpath}"
            tensors[name + ".lora_A.weight"] = (a, "F32")
            tensors[name + ".lora_B.weight"] = (bb, "F32")
    os.makedirs(path)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora["r"],
                   "lora_alpha": lora["alpha"], "lora_dropout": lora["dropout"],
                   "target_modules": lora["targets"], "bias": "none",
                   "base_model_name_or_path": model.dir}, f)
    base.write_safetensors(os.path.join(path, "adapter_model.safetensors"), tensors)
    return adapters


# ---------------------------------------------------------------------------
# Helpers of the self-checks.

def split_phi3_to_llama(p, cfg):
    """Phi-3 parameters under Llama's names (qkv_proj rows -> q, k, v; gate_up_proj rows ->
    gate, up) and the Llama config of the same shape (no window)."""
    h, hkv, hs, i_size = cfg["num_attention_heads"], kv_heads(cfg), head_dim(cfg), \
        cfg["intermediate_size"]
    out = {}
    for name, t in p.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            pre = name[:-len("qkv_proj.weight")]
            q, k, v = t.split([h * hs, hkv * hs, hkv * hs], dim=0)
            out.update({pre + "q_proj.weight": q, pre + "k_proj.weight": k,
                        pre + "v_proj.weight": v})
        elif name.endswith("mlp.gate_up_proj.weight"):
            pre = name[:-len("gate_up_proj.weight")]
            out[pre + "gate_proj.weight"] = t[:i_size]
            out[pre + "up_proj.weight"] = t[i_size:]
        else:
            out[name] = t
    lcfg = base.llama_config(layers=cfg["num_hidden_layers"], heads=h, kv_heads=hkv,
                             tied=cfg["tie_word_embeddings"], rope_theta=cfg["rope_theta"])
    lcfg.update(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                intermediate_size=i_size, rms_norm_eps=cfg["rms_norm_eps"], head_dim=hs)
    return out, lcfg


def loop_attention(q, k, v, window):
    """Loops over batch, head, query: scores over the keys s with i - window < s <= i."""
    b, h, t, hs = q.shape
    hkv = k.shape[1]
    out = torch.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            kv = hi * hkv // h
            for ti in range(t):
                keys = [s for s in range(ti + 1) if window is None or s > ti - window]
                scores = [float((q[bi, hi, ti] * k[bi, kv, s]).sum()) / math.sqrt(hs)
                          for s in keys]
                top = max(scores)
                w = [math.exp(sc - top) for sc in scores]
                for s, ws in zip(keys, w):
                    out[bi, hi, ti] += ws / sum(w) * v[bi, kv, s]
    return out


def batch(cfg, seed, b=2, t=SEQ_LEN):
    return windows(base.random_tokens(seed, b * t + 1, cfg["vocab_size"]), t)


def rel_diff(a, b):
    return abs(a - b) / abs(b)


@unittest.skipIf(torch is None, "torch is not importable")
class ReferenceAttentionTest(unittest.TestCase):
    def setUp(self):
        self.g = torch.Generator().manual_seed(2)

    def randn(self, *shape):
        return torch.randn(shape, generator=self.g, dtype=F64)

    def test_window_mask_is_i_minus_w_lt_j_le_i(self):
        want = [[1, 0, 0, 0, 0, 0],
                [1, 1, 0, 0, 0, 0],
                [1, 1, 1, 0, 0, 0],
                [0, 1, 1, 1, 0, 0],
                [0, 0, 1, 1, 1, 0],
                [0, 0, 0, 1, 1, 1]]
        self.assertEqual(visible(6, 3).int().tolist(), want)
        self.assertTrue(torch.equal(visible(6, None), torch.ones(6, 6, dtype=torch.bool).tril()))
        self.assertEqual(int(visible(6, 1).sum()), 6)  # a window of 1: only itself

    def test_windowed_attention_matches_loops_and_plain_causal_when_w_ge_t(self):
        t = 9
        for h, hkv in ((4, 2), (4, 1), (3, 3)):
            q, k, v = self.randn(2, h, t, 4), self.randn(2, hkv, t, 4), self.randn(2, hkv, t, 4)
            plain = base.causal_attention(q, k, v)
            for w in (None, 1, 3, 5, t - 1, t, t + 4):
                got = windowed_attention(q, k, v, w)
                self.assertLess((got - loop_attention(q, k, v, w)).abs().max().item(), 1e-13,
                                f"H {h} Hkv {hkv} w {w}")
                if w is None or w >= t:
                    self.assertLess((got - plain).abs().max().item(), 1e-15, f"w {w}")
                else:  # rows i >= w lose keys
                    self.assertTrue(torch.equal(got[:, :, :w], plain[:, :, :w]), f"w {w}")
                    self.assertGreater((got - plain).abs().max().item(), 1e-3, f"w {w}")

    def test_a_key_outside_the_window_does_not_change_the_output(self):
        t, w, i = 10, 4, 8  # query 8 sees keys 5..8
        q, k, v = self.randn(1, 2, t, 4), self.randn(1, 2, t, 4), self.randn(1, 2, t, 4)
        ref = windowed_attention(q, k, v, w)
        for j, changes in ((i - w, False), (0, False), (i - w + 1, True), (i, True)):
            k2, v2 = k.clone(), v.clone()
            k2[:, :, j] += 1.0
            v2[:, :, j] += 1.0
            got = windowed_attention(q, k2, v2, w)
            moved = (got[:, :, i] - ref[:, :, i]).abs().max().item()
            if changes:
                self.assertGreater(moved, 1e-3, f"key {j}")
            else:
                self.assertEqual(moved, 0.0, f"key {j}")


@unittest.skipIf(torch is None, "torch is not importable")
class ReferenceDecoderTest(unittest.TestCase):
    """The reference decoder against base's independent Llama and against itself."""

    def test_decoder_equals_base_llama_on_base_models(self):
        for model in base.make_models():
            if model.cfg["model_type"] == "gpt2":
                continue
            self.assertEqual(list(decoder_param_shapes(model.cfg).items()),
                             list(base.llama_param_shapes(model.cfg).items()), model.name)
            x, y = batch(model.cfg, 3, t=base.SEQ_LEN)
            self.assertAlmostEqual(decoder_loss(model.params, model.cfg, x, y).item(),
                                   base.llama_loss(model.params, model.cfg, x, y).item(),
                                   delta=1e-13, msg=model.name)

    def test_qwen2_with_zero_biases_equals_llama(self):
        for model in make_models()[:2]:
            p = {n: (torch.zeros_like(t) if n.endswith(".bias") else t)
                 for n, t in model.params.items()}
            self.assertEqual(sum(n.endswith(".bias") for n in p), 3 * model.cfg[
                "num_hidden_layers"])
            llama = {n: t for n, t in p.items() if not n.endswith(".bias")}
            lcfg = dict(model.cfg, model_type="llama", architectures=["LlamaForCausalLM"])
            x, y = batch(model.cfg, 4)
            self.assertAlmostEqual(decoder_loss(p, model.cfg, x, y).item(),
                                   base.llama_loss(llama, lcfg, x, y).item(), delta=1e-13)

    def test_llama_and_qwen3_with_zero_biases_equal_their_biasless_models(self):
        for model in (make_models()[7], make_models()[3]):
            p = {n: (torch.zeros_like(t) if n.endswith(".bias") else t)
                 for n, t in model.params.items()}
            self.assertEqual(sum(n.endswith(".bias") for n in p),
                             4 * model.cfg["num_hidden_layers"], model.name)
            plain = {n: t for n, t in p.items() if not n.endswith(".bias")}
            cfg = dict(model.cfg, attention_bias=False)
            self.assertEqual(set(plain), set(decoder_param_shapes(cfg)))
            x, y = batch(model.cfg, 5)
            self.assertAlmostEqual(decoder_loss(p, model.cfg, x, y).item(),
                                   decoder_loss(plain, cfg, x, y).item(), delta=1e-13)
            if model.cfg["model_type"] == "llama":
                self.assertAlmostEqual(decoder_loss(p, model.cfg, x, y).item(),
                                       base.llama_loss(plain, cfg, x, y).item(), delta=1e-13)

    def test_phi3_fused_equals_llama_fed_the_split_weights(self):
        for model in make_models()[5:7]:
            split, lcfg = split_phi3_to_llama(model.params, model.cfg)
            self.assertEqual(set(split), set(base.llama_param_shapes(lcfg)))
            x, y = batch(model.cfg, 6)
            if model.cfg["sliding_window"] is None:
                want = base.llama_loss(split, lcfg, x, y).item()
            else:  # the same window in a Mistral of the split weights
                mcfg = dict(lcfg, model_type="mistral", sliding_window=model.cfg["sliding_window"])
                want = decoder_loss(split, mcfg, x, y).item()
            self.assertAlmostEqual(decoder_loss(model.params, model.cfg, x, y).item(), want,
                                   delta=1e-13, msg=model.name)

    def test_windowed_models_equal_their_loop_attention_forward(self):
        # The whole forward with loop_attention in place of the vectorised mask.
        global windowed_attention
        fast = windowed_attention
        for model in (make_models()[4], make_models()[5]):
            x, y = batch(model.cfg, 7, b=1)
            want = decoder_loss(model.params, model.cfg, x, y).item()
            try:
                windowed_attention = loop_attention
                got = decoder_loss(model.params, model.cfg, x, y).item()
            finally:
                windowed_attention = fast
            self.assertAlmostEqual(got, want, delta=1e-12, msg=model.name)

    def test_qwen_layer_types_follow_use_sliding_window_and_max_window_layers(self):
        def types(**kw):
            cfg = qwen2_config(layers=4, heads=4, kv=2, tied=False, sliding_window=kw.pop("w", 4),
                               max_window_layers=kw.pop("mwl", 2), **kw)
            return qwen_layer_types(cfg), layer_windows(cfg)

        full, slide = "full_attention", "sliding_attention"
        self.assertEqual(types(), ([full] * 4, [None] * 4))
        self.assertEqual(types(use_sliding_window=True), ([full, full, slide, slide],
                                                          [None, None, 4, 4]))
        self.assertEqual(types(use_sliding_window=True, mwl=0)[1], [4] * 4)
        self.assertEqual(types(use_sliding_window=True, mwl=4)[1], [None] * 4)
        self.assertEqual(types(use_sliding_window=True, w=None)[1], [None] * 4)
        cfg = qwen2_config(4, 4, 2, False, 4, 2, use_sliding_window=True)
        cfg["layer_types"] = [slide, full, slide, full]
        self.assertEqual(layer_windows(cfg), [4, None, 4, None])
        self.assertEqual(layer_windows(mistral_config(3, 4, 2, 5)), [5] * 3)
        self.assertEqual(layer_windows(phi3_config(3, 4, 2, None)), [None] * 3)
        for model in make_models():  # one fixture Qwen slides on layer 1, the others are inert
            if model.cfg["model_type"] in ("qwen2", "qwen3"):
                want = [None, 4] if model.name == "qwen2_window_on_layer1_f32" else \
                    [None] * model.cfg["num_hidden_layers"]
                self.assertEqual(layer_windows(model.cfg), want, model.name)

    def test_qwen3_q_k_norm_makes_the_loss_scale_invariant_per_head(self):
        model = make_models()[2]
        cfg = dict(model.cfg, rms_norm_eps=1e-30)  # exact invariance needs eps << mean(x^2)
        hs = head_dim(cfg)
        x, y = batch(cfg, 8)
        ref = decoder_loss(model.params, cfg, x, y).item()
        scaled = dict(model.params)
        for proj, head, c in (("q_proj", 1, 3.0), ("q_proj", 3, 0.25), ("k_proj", 0, 5.0)):
            name = f"model.layers.0.self_attn.{proj}.weight"
            w = scaled[name].clone()
            w[head * hs:(head + 1) * hs] *= c
            scaled[name] = w
        self.assertAlmostEqual(decoder_loss(scaled, cfg, x, y).item(), ref, delta=1e-12)
        # Without the norms (a Llama of the same weights) the same scaling moves the loss.
        llama = {n: t for n, t in scaled.items() if "_norm." not in n or "layernorm" in n}
        plain = {n: t for n, t in model.params.items() if "_norm." not in n or "layernorm" in n}
        lcfg = dict(cfg, model_type="llama")
        self.assertGreater(abs(decoder_loss(llama, lcfg, x, y).item()
                               - decoder_loss(plain, lcfg, x, y).item()), 1e-3)

    def test_lora_reference_matches_base_on_llama_and_the_fused_adapter_is_one_adapter(self):
        tmp = tempfile.mkdtemp(prefix="strata-hf-new-lora-")
        try:
            # 1. On base's Llama, family_lora_loss equals base.llama_lora_loss, dropout on.
            model = base.make_models()[0]
            model.dir = tmp
            lora = {"r": 2, "alpha": 4.0, "dropout": 0.3,
                    "targets": ["q_proj", "v_proj", "up_proj", "down_proj"]}
            adapters = write_family_lora_adapter(os.path.join(tmp, "a"), model, lora, seed=3)
            x, y = batch(model.cfg, 9, t=base.SEQ_LEN)
            seed = base.micro_batch_dropout_seed(5)
            self.assertAlmostEqual(
                family_lora_loss(model, adapters, lora, x, y, seed).item(),
                base.llama_lora_loss(model.params, adapters, model.cfg, lora, x, y, seed).item(),
                delta=1e-13)
            # 2. Phi-3's fused qkv adapter (A, B) = q, k, v adapters sharing A with B split by
            #    rows; gate_up's = gate and up adapters sharing A.
            phi3 = make_models()[5]
            phi3.dir = tmp
            lora = {"r": 3, "alpha": 6.0, "dropout": 0.0,
                    "targets": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
            fused = write_family_lora_adapter(os.path.join(tmp, "b"), phi3, lora, seed=4)
            split_p, lcfg = split_phi3_to_llama(phi3.params, phi3.cfg)
            lcfg = dict(lcfg, model_type="mistral", sliding_window=PHI3_WINDOW)
            h, hkv, hs, i_size = 4, 2, head_dim(phi3.cfg), phi3.cfg["intermediate_size"]
            split = {}
            for (i, module), (a, bb) in fused.items():
                if module == "qkv_proj":
                    for name, part in zip(("q_proj", "k_proj", "v_proj"),
                                          bb.split([h * hs, hkv * hs, hkv * hs], dim=0)):
                        split[(i, name)] = (a, part)
                elif module == "gate_up_proj":
                    split[(i, "gate_proj")] = (a, bb[:i_size])
                    split[(i, "up_proj")] = (a, bb[i_size:])
                else:
                    split[(i, module)] = (a, bb)
            split_model = Model("split", lcfg, seed=0)
            split_model.params = split_p
            all_llama = dict(lora, targets=[m for m, _ in base.LLAMA_LORA_MODULES])
            x, y = batch(phi3.cfg, 10)
            got = family_lora_loss(phi3, fused, lora, x, y).item()
            want = family_lora_loss(split_model, split, all_llama, x, y).item()
            self.assertAlmostEqual(got, want, delta=1e-13)
            self.assertGreater(abs(got - phi3.loss(x, y).item()), 1e-3)  # the adapters act
            # 3. With B = 0 the adapted model is the base model.
            zero = {k: (a, torch.zeros_like(bb)) for k, (a, bb) in fused.items()}
            self.assertAlmostEqual(family_lora_loss(phi3, zero, lora, x, y).item(),
                                   phi3.loss(x, y).item(), delta=1e-14)
        finally:
            shutil.rmtree(tmp)


@unittest.skipIf(torch is None, "torch is not importable")
class ReferenceSensitivityTest(unittest.TestCase):
    """Each mistake an engine could make about what this file covers -- the window and its
    off-by-one, a family's biases, q_norm/k_norm and their place before RoPE, the fused row
    orders -- measured on the fixture's own models and tokens: it moves the eval loss by more
    than LOSS_MARGIN * EVAL_REL_TOL (so the eval test catches it alone), and the gradient of
    some tensor by more than GRAD_MARGIN times assert_gradient_close's bound (so the gradient
    test catches it with a wide margin). Mean cross-entropy over random targets is a blunt
    probe (first-order changes average out over positions); measured, the smallest loss effect
    is 34 * EVAL_REL_TOL (Qwen3 q/k norm after RoPE) and the smallest gradient effect 3200
    times the bound."""

    LOSS_MARGIN = 10
    GRAD_MARGIN = 1000

    def setUp(self):
        self.models = make_models()

    def data(self, index):
        model = self.models[index]
        return windows(base.random_tokens(200 + index, EVAL_TOKENS, model.cfg["vocab_size"]),
                       SEQ_LEN)

    def grads(self, p, cfg, x, y, **kw):
        leaves = {n: t.clone().requires_grad_() for n, t in p.items()}
        decoder_loss(leaves, cfg, x[:MICRO_BATCH], y[:MICRO_BATCH], **kw).backward()
        return {n: t.grad for n, t in leaves.items()}

    def check_mistake(self, index, what, cfg=None, params=None, **kw):
        model = self.models[index]
        x, y = self.data(index)
        wrong_cfg = model.cfg if cfg is None else cfg
        wrong_p = model.params if params is None else params
        ref = decoder_loss(model.params, model.cfg, x, y).item()
        wrong = decoder_loss(wrong_p, wrong_cfg, x, y, **kw).item()
        self.assertGreater(rel_diff(wrong, ref), self.LOSS_MARGIN * EVAL_REL_TOL,
                           f"{model.name} {what}: loss {wrong} vs {ref}")
        g_ref = self.grads(model.params, model.cfg, x, y)
        g_wrong = self.grads(wrong_p, wrong_cfg, x, y, **kw)
        worst = max(((g_wrong[n] - g).abs().max() /
                     (GRAD_REL_TOL * g.abs().max() + base.GRAD_ABS_TOL)).item()
                    for n, g in g_ref.items() if n in g_wrong)
        self.assertGreater(worst, self.GRAD_MARGIN, f"{model.name} {what}: gradients")

    def test_windows_and_their_off_by_one(self):
        for index in (4, 5):
            w = self.models[index].cfg["sliding_window"]
            for other in (None, w - 1, w + 1):
                self.check_mistake(index, f"window {other}",
                                   cfg=dict(self.models[index].cfg, sliding_window=other))

    def test_qwen2_inert_window_fields_would_matter_if_used(self):
        model = self.models[0]
        x, y = self.data(0)
        self.assertEqual(decoder_loss(model.params, model.cfg, x, y).item(),
                         decoder_loss(model.params, dict(model.cfg, sliding_window=None),
                                      x, y).item())
        self.check_mistake(0, "use_sliding_window", cfg=dict(model.cfg, use_sliding_window=True))

    def test_each_kind_of_bias_matters(self):
        for index in (0, 1, 3, 7):
            model = self.models[index]
            for which in ("q_proj", "k_proj", "v_proj", "o_proj"):
                p = dict(model.params)
                names = [n for n in p if n.endswith(f"self_attn.{which}.bias")]
                for n in names:
                    p[n] = torch.zeros_like(p[n])
                if names:
                    self.check_mistake(index, f"without the {which} biases", params=p)

    def test_qk_norm_its_weights_and_its_place_before_rope(self):
        for index in (2, 3):
            self.check_mistake(index, "q/k norm after RoPE", qk_norm_after_rope=True)
            for which in ("q_norm", "k_norm"):
                p = dict(self.models[index].params)
                for n in [n for n in p if n.endswith(f"self_attn.{which}.weight")]:
                    p[n] = torch.ones_like(p[n])
                self.check_mistake(index, f"unit {which}", params=p)

    def test_fused_row_orders(self):
        model = self.models[5]
        h, hkv, hs = 4, 2, head_dim(model.cfg)
        i_size = model.cfg["intermediate_size"]
        swapped_mlp, swapped_kv = dict(model.params), dict(model.params)
        for i in range(model.cfg["num_hidden_layers"]):
            n = f"model.layers.{i}.mlp.gate_up_proj.weight"
            swapped_mlp[n] = torch.cat([model.params[n][i_size:], model.params[n][:i_size]])
            n = f"model.layers.{i}.self_attn.qkv_proj.weight"
            q, k, v = model.params[n].split([h * hs, hkv * hs, hkv * hs])
            swapped_kv[n] = torch.cat([q, v, k])
        self.check_mistake(5, "up before gate", params=swapped_mlp)
        self.check_mistake(5, "v before k", params=swapped_kv)

    def test_longrope_factors_attention_factor_and_partial_rotary(self):
        # 9: long factors (T past the original length), rotary on 4 of 6 columns; 10: short.
        for index, used, other in ((9, "long_factor", "short_factor"),
                                   (10, "short_factor", "long_factor")):
            cfg = self.models[index].cfg
            rs = cfg["rope_scaling"]
            self.check_mistake(index, f"{other} instead of {used}",
                               cfg=dict(cfg, rope_scaling=dict(rs, **{used: rs[other]})))
            self.check_mistake(index, "no attention factor",
                               cfg=dict(cfg, rope_scaling=dict(rs, attention_factor=1.0)))
        self.check_mistake(9, "the whole head turns", full_rotary=True)

    def test_qwen3_head_dim_is_not_hidden_over_heads(self):
        for model in self.models[2:4]:
            cfg = model.cfg
            self.assertNotEqual(cfg["num_attention_heads"] * cfg["head_dim"], cfg["hidden_size"])


@unittest.skipIf(torch is None, "torch is not importable")
class ReferenceModelTest(unittest.TestCase):
    """Whole-model properties of the fixture's models."""

    def test_configs_carry_the_published_fields(self):
        common = {"architectures", "model_type", "vocab_size", "hidden_size",
                  "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps",
                  "rope_theta", "tie_word_embeddings", "bos_token_id", "eos_token_id",
                  "torch_dtype", "use_cache"}
        extra = {"qwen2": {"use_sliding_window", "sliding_window", "max_window_layers",
                           "attention_dropout"},
                 "qwen3": {"head_dim", "attention_bias", "use_sliding_window", "sliding_window",
                           "max_window_layers", "rope_scaling"},
                 "mistral": {"sliding_window"},
                 "phi3": {"sliding_window", "original_max_position_embeddings", "rope_scaling",
                          "resid_pdrop", "embd_pdrop", "attention_dropout", "pad_token_id"},
                 "llama": {"attention_bias", "mlp_bias"}}
        arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM",
                "llama": "LlamaForCausalLM"}
        seen = set()
        for model in make_models():
            cfg, mt = model.cfg, model.cfg["model_type"]
            seen.add(mt)
            self.assertLessEqual(common | extra[mt], set(cfg), model.name)
            self.assertEqual(cfg["architectures"], [arch[mt]], model.name)
            self.assertEqual(json.loads(json.dumps(cfg)), cfg, model.name)
            self.assertLess(cfg["bos_token_id"], cfg["vocab_size"])
            self.assertLess(cfg["eos_token_id"], cfg["vocab_size"])
            self.assertEqual(cfg["torch_dtype"],
                             {"F32": "float32", "BF16": "bfloat16"}[model.storage], model.name)
            self.assertLessEqual(SEQ_LEN, cfg["max_position_embeddings"])
        self.assertEqual(seen, set(arch))

    def test_every_parameter_has_a_gradient(self):
        for model in make_models():
            x, y = batch(model.cfg, 11)
            params = {n: t.clone().requires_grad_() for n, t in model.params.items()}
            model.loss(x, y, params).backward()
            for name, t in params.items():
                self.assertGreater(t.grad.abs().max().item(), 1e-5, f"{model.name} {name}")

    def test_future_tokens_do_not_change_earlier_losses(self):
        for model in make_models():
            x, y = batch(model.cfg, 12)
            x2 = x.clone()
            x2[:, -1] = (x2[:, -1] + 1) % model.cfg["vocab_size"]
            self.assertEqual(model.loss(x[:, :-1], y[:, :-1]).item(),
                             model.loss(x2[:, :-1], y[:, :-1]).item(), model.name)

    def test_loss_is_near_log_vocab_but_not_uniform(self):
        for model in make_models():
            x, y = batch(model.cfg, 13)
            loss = model.loss(x, y).item()
            v = model.cfg["vocab_size"]
            self.assertTrue(0.5 * math.log(v) < loss < 3 * math.log(v), f"{model.name}: {loss}")

    def test_stored_directory_reads_back_exactly(self):
        tmp = tempfile.mkdtemp(prefix="strata-hf-new-")
        try:
            for model in make_models():
                d = model.write(tmp)
                tensors = base.read_model_dir_tensors(d)
                self.assertEqual(sorted(tensors), sorted(decoder_param_shapes(model.cfg)))
                for name, t in model.params.items():
                    self.assertEqual(tensors[name][1], model.storage, name)
                    self.assertTrue(torch.equal(tensors[name][0], t), name)
        finally:
            shutil.rmtree(tmp)


# ---------------------------------------------------------------------------
# strata against the references.

Fixture = base.ModelFixture("strata-hf-new-families-", lambda: make_models(), 200, EVAL_TOKENS)


def tearDownModule():
    Fixture.cleanup()


def check_eval(test, model, t=SEQ_LEN, b=MICRO_BATCH, source=None):
    got = base.strata_eval(test, source or ("--model-dir", model.dir), model.data, t, b)
    x, y = windows(model.tokens, t)
    with torch.no_grad():
        ref = model.loss(x, y).item()
    what = f"{model.name} T {t} B {b}"
    test.assertEqual(got["windows"], x.shape[0], what)
    test.assertEqual(got["tokens"], x.numel(), what)
    test.assertLessEqual(abs(got["loss"] - ref), EVAL_REL_TOL * ref,
                         f"{what}: strata {got['loss']!r} reference {ref!r}")
    return got


@unittest.skipIf(torch is None, "torch is not importable")
@unittest.skipUnless(STRATA_CLI, NO_CLI)
class StrataEvalTest(unittest.TestCase):
    def test_eval_loss_equals_the_reference_for_every_model(self):
        for model in Fixture.get().models:
            with self.subTest(model=model.name):
                check_eval(self, model)

    def test_windowed_models_at_a_sequence_no_longer_than_the_window(self):
        # T <= w: the window hides nothing, the models are Llamas at this length.
        for model in Fixture.get().models:
            w = model.cfg.get("sliding_window")
            if model.cfg["model_type"] in ("mistral", "phi3") and w is not None:
                with self.subTest(model=model.name):
                    check_eval(self, model, t=w, b=2)
                    check_eval(self, model, t=w - 1, b=2)


@unittest.skipIf(torch is None, "torch is not importable")
@unittest.skipUnless(STRATA_HF_GRADIENTS, NO_GRADIENTS)
class StrataGradientTest(unittest.TestCase):
    def test_every_parameter_gradient_equals_the_reference(self):
        f = Fixture.get()
        for model in f.models:
            with self.subTest(model=model.name):
                base.check_every_parameter_gradient(self, f.root, model, SEQ_LEN, MICRO_BATCH)


@unittest.skipIf(torch is None, "torch is not importable")
@unittest.skipUnless(STRATA_HF_GRADIENTS, NO_GRADIENTS)
class StrataLoraGradientTest(unittest.TestCase):
    def check_lora(self, model, lora, seed=41):
        f = Fixture.get()
        adapter_dir = os.path.join(f.root, model.name + ".lora")
        adapters = write_family_lora_adapter(adapter_dir, model, lora, seed=seed)
        paths = {m: path for m, path, _, _ in family_lora_modules(model.cfg)}
        base.check_lora_gradients(self, f.root, model, lora, adapter_dir, adapters,
                                  family_lora_loss, paths, SEQ_LEN, MICRO_BATCH)

    def test_phi3_fused_module_adapters(self):
        model = [m for m in Fixture.get().models if m.cfg["model_type"] == "phi3"][0]
        self.check_lora(model, {"r": 3, "alpha": 6.0, "dropout": 0.0,
                                "targets": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]})

    def test_qwen2_adapters_over_biased_projections(self):
        model = [m for m in Fixture.get().models if m.cfg["model_type"] == "qwen2"][1]  # tied
        self.check_lora(model, {"r": 2, "alpha": 5.0, "dropout": 0.0,
                                "targets": [m for m, _ in base.LLAMA_LORA_MODULES]})


def fine_tune_models():
    """One untied F32 model per family, the fixture's shapes (Phi-3 also with Phi-4-mini's
    partial rotary and LongRoPE)."""
    return [
        Model("ft_qwen2", qwen2_config(2, 4, 2, False, sliding_window=4, max_window_layers=1),
              seed=61),
        Model("ft_qwen3", qwen3_config(2, 4, 2, hd=10, tied=False, attention_bias=True), seed=62),
        Model("ft_mistral", mistral_config(2, 4, 2, window=MISTRAL_WINDOW), seed=63),
        Model("ft_phi3", phi3_config(2, 4, 2, window=PHI3_WINDOW), seed=64),
        Model("ft_phi3_longrope",
              phi3_config(2, 4, 2, window=None, partial_rotary_factor=0.75,
                          rope_scaling={"type": "longrope", "short_factor": [1.0, 1.7],
                                        "long_factor": [2.5, 7.0]},
                          original_max=8),
              seed=66),
        Model("ft_llama_bias", llama_bias_config(2, 4, 2), seed=65),
    ]


# The family's own fields an export must keep (read with Hugging Face's default where the
# exported config.json leaves one out).
EXPORTED_FIELDS = {
    "qwen2": ["use_sliding_window"],
    "qwen3": ["head_dim", "attention_bias", "use_sliding_window"],
    "mistral": ["sliding_window"],
    "phi3": ["sliding_window", "partial_rotary_factor", "rope_scaling",
             "original_max_position_embeddings"],
    "llama": ["attention_bias"],
}
HF_DEFAULTS = {"attention_bias": False, "use_sliding_window": False, "partial_rotary_factor": 1.0}


@unittest.skipIf(torch is None, "torch is not importable")
@unittest.skipUnless(STRATA_CLI, NO_CLI)
class StrataFineTuneTest(unittest.TestCase):
    """Each family fine-tunes from its directory on a learnable token pattern (loss drops),
    exports under its own model_type, architectures and tensor names, and the export
    re-evaluates to the checkpoint's loss and to the reference on the exported weights."""

    STEPS = 30

    def check_fine_tune(self, model):
        cfg = model.cfg
        mt = cfg["model_type"]

        def check_config(out_cfg):
            for key in ["model_type", "architectures", "vocab_size", "hidden_size",
                        "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "rms_norm_eps", "rope_theta",
                        "tie_word_embeddings", *EXPORTED_FIELDS[mt]]:
                self.assertEqual(out_cfg.get(key, HF_DEFAULTS.get(key)),
                                 cfg.get(key, HF_DEFAULTS.get(key)),
                                 f"exported config.json {key}")

        # The exported config.json read as Hugging Face would (defaults where absent).
        base.check_fine_tune_and_export(
            self, model, os.path.join(Fixture.get().root, "finetune-" + model.name), self.STEPS,
            SEQ_LEN, MICRO_BATCH, decoder_param_shapes(cfg), decoder_loss, check_config)

    def test_each_family_fine_tunes_and_exports(self):
        for model in fine_tune_models():
            with self.subTest(model=model.name):
                self.check_fine_tune(model)


@unittest.skipIf(torch is None, "torch is not importable")
@unittest.skipUnless(STRATA_CLI, NO_CLI)
class StrataBadInputTest(unittest.TestCase):
    """What Strata does not support fails with a non-zero exit and ONE stderr line naming the
    file and the field (or tensor)."""

    def setUp(self):
        self.f = Fixture.get()
        self.tmp = tempfile.mkdtemp(dir=self.f.root)

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def model(self, model_type):
        return [m for m in self.f.models if m.cfg["model_type"] == model_type][0]

    def expect_error(self, model_dir, data, *needles):
        r = run([STRATA_CLI, "eval", "--model-dir", model_dir, "--data", data, "--seq-len",
                 SEQ_LEN, "--micro-batch-size", MICRO_BATCH, "--precision", "fp32",
                 "--device", "host", "--json"])
        self.assertGreater(r.returncode, 0, f"expected a failure exit:\n{r.stdout}\n{r.stderr}")
        err = r.stderr.strip()
        self.assertEqual(len(err.splitlines()), 1, f"stderr is not one line:\n{r.stderr}")
        for needle in needles:
            self.assertIn(needle, err)
        return err

    def with_config(self, model, **changes):
        d = os.path.join(self.tmp, "model")
        shutil.copytree(model.dir, d)
        with open(os.path.join(d, "config.json"), "w") as fh:
            json.dump(dict(model.cfg, **changes), fh)
        return d

    def test_phi3_partial_rotary_factor_giving_an_odd_rotary_dim_is_refused(self):
        model = self.model("phi3")  # head_dim 6: int(6 x 0.5) = 3 columns cannot pair up
        d = self.with_config(model, partial_rotary_factor=0.5)
        self.expect_error(d, model.data, "config.json", "partial_rotary_factor")

    def test_phi3_longrope_factors_of_the_wrong_length_are_refused(self):
        # One factor per rotary frequency (head_dim / 2 = 3) is what the config must carry.
        model = self.model("phi3")
        d = self.with_config(model, rope_scaling={"type": "longrope",
                                                  "short_factor": [1.0] * 2,
                                                  "long_factor": [1.5] * 3},
                             max_position_embeddings=256)
        self.expect_error(d, model.data, "config.json", "rope_scaling.short_factor")

    def test_mistral_window_of_zero_is_refused(self):
        model = self.model("mistral")
        d = self.with_config(model, sliding_window=0)
        self.expect_error(d, model.data, "config.json", "sliding_window")

    def test_qwen3_without_its_k_norm_names_the_tensor(self):
        model = self.model("qwen3")
        d = os.path.join(self.tmp, "model")
        name = "model.layers.1.self_attn.k_norm.weight"
        params = {n: t for n, t in model.params.items() if n != name}
        base.write_model_dir(d, model.cfg, params, model.storage)
        self.expect_error(d, model.data, "model.safetensors", name)

    def test_llama_attention_bias_without_the_o_proj_bias_names_the_tensor(self):
        model = self.model("llama")
        d = os.path.join(self.tmp, "model")
        name = "model.layers.0.self_attn.o_proj.bias"
        params = {n: t for n, t in model.params.items() if n != name}
        base.write_model_dir(d, model.cfg, params, model.storage)
        self.expect_error(d, model.data, "model.safetensors", name)


if __name__ == "__main__":
    if torch is None:
        print(f"SKIPPED: torch (or numpy) is not importable by {sys.executable} "
              f"({base._IMPORT_ERROR}); install python3-torch (Debian) to run the Hugging Face "
              "family tests")
        sys.exit(SKIP)
    unittest.main(verbosity=2)
