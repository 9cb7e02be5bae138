"""Strata's Gemma 3 text models (model_type gemma3_text, Gemma3ForCausalLM) against a float64
PyTorch reference of the Hugging Face architecture.

The reference is written here from the published modeling and configuration code of
transformers (models/gemma3/modeling_gemma3.py, configuration_gemma3.py, masking_utils.py;
transformers is not installed, and not to be used):

- Gemma3RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), the weights stored around 0 (Hugging
  Face initialises them to zeros); every norm of the model is one: input_layernorm,
  post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm, q_norm and
  k_norm (over head_dim, per head), model.norm; eps = rms_norm_eps (default 1e-6);
- Gemma3TextScaledWordEmbedding: embed_tokens[ids] * sqrt(hidden_size), the scale cast to the
  weight's dtype (here float64; in `strata eval --precision fp32` fp32, 1e-8 relative apart);
- the decoder layer ("sandwich" norms):
      h = x + post_attention_layernorm(attn(input_layernorm(x)))
      x' = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
  with mlp(m) = down(gelu_tanh(gate(m)) * up(m)) (hidden_activation "gelu_pytorch_tanh");
- attention: q, k, v projections (no biases: attention_bias false), q_norm / k_norm on each
  head BEFORE the rotary embedding, scores q k^T * query_pre_attn_scalar^-0.5 (not
  head_dim^-0.5), optional tanh soft-capping of the scores (attn_logit_softcapping), causal,
  and on "sliding_attention" layers the window of masking_utils: key j is visible from query i
  iff i - sliding_window < j <= i; grouped-query (query head h reads kv head h // (H / Hkv));
- layer types: config.layer_types when present, else layer i is "sliding_attention" unless
  (i + 1) % sliding_window_pattern == 0 (default pattern 6);
- rotary (rotate-half): sliding layers use base rope_local_base_freq (default 1e4) with no
  scaling; full layers rope_theta (default 1e6) with rope_scaling ({"rope_type": "linear",
  "factor": f}: inv_freq / f; other rope types are refused by the reference); the newer
  rope_parameters form (per layer type) is read too, though no fixture uses it yet;
- Gemma3ForCausalLM: final norm, logits = x @ embed_tokens^T (tied, the default) or
  lm_head.weight when tie_word_embeddings is false, optional final_logit_softcapping; mean
  next-token cross-entropy.

Tiny random models (config.json with the field names and value shapes of the published
gemma-3 text configs, head_dim != hidden / heads, query_pre_attn_scalar != head_dim, a
sliding window shorter than the evaluation sequence on some layers, rope_theta !=
rope_local_base_freq, one linear rope_scaling, GQA and MQA, odd vocabularies, F32 and BF16,
one untied and sharded) are written as Hugging Face directories with llm.c token files, then,
with the bounds of test_hf_families.py (imported as `base`):

- `strata eval --json` reports the reference's mean cross-entropy within EVAL_REL_TOL;
  ReferenceSensitivityTest measures that each mistake an engine could make about Gemma 3 --
  w instead of 1 + w, a missing embedding scale, head_dim^-0.5, the wrong RoPE base on
  sliding layers, linear scaling dropped or applied to sliding layers, any missing norm,
  q/k norm after RoPE, silu instead of the tanh GELU, the window and its off-by-one, the
  layer-type pattern -- moves the fixture's loss by more than LOSS_MARGIN * EVAL_REL_TOL and
  some gradient by more than GRAD_MARGIN times the gradient bound;
- `hf_gradients` (STRATA_HF_GRADIENTS) writes the fp32 gradient of every parameter, named as
  in the directory, within base.assert_gradient_close's bound;
- with --lora-init, adapter gradients on q/k/v/o/gate/up/down_proj (PEFT names,
  base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight, ...), dropout off and on
  (models/lora.h's mask, base.lora_keep_mask);
- `strata train --model-dir` fine-tunes a Gemma 3 (loss drops), `strata export` writes
  model_type gemma3_text with the same tensor names, the export re-evaluates to the
  checkpoint's loss, and its config.json read with Hugging Face's defaults describes the
  same model;
- what Strata does not support (attn_logit_softcapping, final_logit_softcapping, the exact
  erf GELU) fails with a non-zero exit and ONE stderr line naming config.json and the field.

CLI tests SKIP without STRATA_CLI (or STRATA_HF_GRADIENTS); the reference self-checks always
run. Run directly (`/usr/bin/python3 tests/python/test_hf_gemma3.py`); exits 77 (CTest
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

SEQ_LEN = 13  # longer than the sliding window below, odd
MICRO_BATCH = 3
EVAL_TOKENS = 7 * SEQ_LEN + 5  # 7 full windows: not a multiple of MICRO_BATCH
WINDOW = 4
SLIDING, FULL = "sliding_attention", "full_attention"

# Gemma3TextConfig's defaults for the fields a config.json may leave out.
GEMMA3_DEFAULTS = {
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
}


def field(cfg, key):
    """cfg[key], or Gemma3TextConfig's default when the config.json leaves it out."""
    return cfg[key] if key in cfg else GEMMA3_DEFAULTS[key]


# ---------------------------------------------------------------------------
# The reference.

def gemma3_layer_types(cfg):
    """config.layer_types when present, else "sliding_attention" unless (i + 1) % pattern == 0
    (Gemma3TextConfig; sliding_window_pattern defaults to 6)."""
    if cfg.get("layer_types") is not None:
        types = list(cfg["layer_types"])
        if len(types) != cfg["num_hidden_layers"] or set(types) - {SLIDING, FULL}:
            raise ValueError(f"bad layer_types {types}")
        return types
    pattern = field(cfg, "sliding_window_pattern")
    return [SLIDING if (i + 1) % pattern else FULL for i in range(cfg["num_hidden_layers"])]


def _rope_kind(d):
    """A rope dict with the older "type" key read as "rope_type" (as transformers does)."""
    d = dict(d)
    if "rope_type" not in d and "type" in d:
        d["rope_type"] = d.pop("type")
    return d


def gemma3_rope_parameters(cfg):
    """{layer type: {"rope_type", "rope_theta", ...}} as Gemma3TextConfig resolves them: from
    rope_parameters (newer configs: keyed by layer type, or one dict for the full layers), else
    rope_scaling on the full layers; rope_theta defaults to the config's rope_theta on full
    layers and to rope_local_base_freq on sliding ones."""
    full, sliding = {"rope_type": "default"}, {"rope_type": "default"}
    rp = cfg.get("rope_parameters")
    if rp is not None and set(rp) <= {SLIDING, FULL}:
        full.update(_rope_kind(rp.get(FULL) or {}))
        sliding.update(_rope_kind(rp.get(SLIDING) or {}))
    elif rp is not None:
        full.update(_rope_kind(rp))
    elif field(cfg, "rope_scaling"):
        full.update(_rope_kind(field(cfg, "rope_scaling")))
    full.setdefault("rope_theta", field(cfg, "rope_theta"))
    sliding.setdefault("rope_theta", field(cfg, "rope_local_base_freq"))
    return {FULL: full, SLIDING: sliding}


def gemma3_inv_freq(cfg, layer_type, mistakes=frozenset()):
    """Rotary inverse frequencies of a layer type: theta^(-2j/hs), j < hs/2, with the layer
    type's rope parameters (gemma3_rope_parameters): "linear" divides by factor; the
    reference refuses other rope types."""
    hs = field(cfg, "head_dim")
    rp = gemma3_rope_parameters(cfg)
    own = dict(rp[layer_type])
    if layer_type == SLIDING and "sliding_rope_theta" in mistakes:
        own["rope_theta"] = rp[FULL]["rope_theta"]
    if layer_type == SLIDING and "rope_scaling_on_sliding" in mistakes:
        own = dict(rp[FULL], rope_theta=own["rope_theta"])
    if "no_rope_scaling" in mistakes:
        own["rope_type"] = "default"
    inv = float(own["rope_theta"]) ** (-(torch.arange(0, hs, 2, dtype=F64) / hs))
    if own["rope_type"] == "linear":
        inv = inv / own["factor"]
    elif own["rope_type"] != "default":
        raise ValueError(f"reference has no rope type {own['rope_type']!r}")
    return inv


def gemma3_norm(x, w, eps, one_plus=True):
    """Gemma3RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w) (one_plus False: * w, a mistake)."""
    return base.rms_norm(x, 1.0 + w if one_plus else w, eps)


def softcap(x, cap):
    return x if cap is None else cap * torch.tanh(x / cap)


def visible(t, window=None):
    """(T, T) bool: key j visible from query i iff j <= i and (no window or j > i - window)."""
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    vis = j <= i
    return vis if window is None else vis & (j > i - window)


def gemma3_attention(q, k, v, scaling, window=None, cap=None):
    """q (B, H, T, hs), k and v (B, Hkv, T, hs): softmax(softcap(q k^T * scaling)) v over the
    visible keys; query head h reads kv head h // (H / Hkv)."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = softcap(q @ k.transpose(-1, -2) * scaling, cap)
    return scores.masked_fill(~visible(q.shape[2], window), float("-inf")).softmax(-1) @ v


def gemma3_param_shapes(cfg):
    """{Hugging Face name: shape} in the checkpoints' per-layer order."""
    if field(cfg, "attention_bias"):
        raise ValueError("reference has no attention_bias")
    c, i_size, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hs, h, hkv = field(cfg, "head_dim"), cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (v, c)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (c,),
            p + "self_attn.q_proj.weight": (h * hs, c),
            p + "self_attn.k_proj.weight": (hkv * hs, c),
            p + "self_attn.v_proj.weight": (hkv * hs, c),
            p + "self_attn.o_proj.weight": (c, h * hs),
            p + "self_attn.q_norm.weight": (hs,),
            p + "self_attn.k_norm.weight": (hs,),
            p + "post_attention_layernorm.weight": (c,),
            p + "pre_feedforward_layernorm.weight": (c,),
            p + "post_feedforward_layernorm.weight": (c,),
            p + "mlp.gate_proj.weight": (i_size, c),
            p + "mlp.up_proj.weight": (i_size, c),
            p + "mlp.down_proj.weight": (c, i_size),
        })
    shapes["model.norm.weight"] = (c,)
    if not field(cfg, "tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, c)
    return shapes


# The mistakes gemma3_loss can make on request (ReferenceSensitivityTest only):
#   norm_w              every Gemma3RMSNorm multiplies by w instead of 1 + w
#   no_embed_scale      embeddings not multiplied by sqrt(hidden_size)
#   head_dim_scaling    scores * head_dim^-0.5 instead of query_pre_attn_scalar^-0.5
#   sliding_rope_theta  sliding layers rotate with rope_theta instead of rope_local_base_freq
#   no_rope_scaling     rope_scaling ignored on full layers
#   rope_scaling_on_sliding  rope_scaling applied on sliding layers too
#   skip:<norm>         that norm left out (identity) in every layer: input_layernorm,
#                       post_attention_layernorm, pre_feedforward_layernorm,
#                       post_feedforward_layernorm, q_norm, k_norm, or norm (the final one)
#   qk_norm_after_rope  q_norm / k_norm applied after the rotary embedding
#   silu, gelu_exact    that activation instead of the tanh GELU
MISTAKES = ("norm_w", "no_embed_scale", "head_dim_scaling", "sliding_rope_theta",
            "no_rope_scaling", "rope_scaling_on_sliding", "qk_norm_after_rope", "silu",
            "gelu_exact")
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
         "post_feedforward_layernorm", "q_norm", "k_norm", "norm")


def gemma3_loss(p, cfg, inputs, targets, head=None, delta=None, mistakes=frozenset()):
    """Mean next-token cross-entropy of Gemma3ForCausalLM with parameters p (Hugging Face
    names, float64), inputs/targets (B, T) int64. head overrides the output matrix (default
    embed_tokens when tied, else lm_head). delta(layer, module, x) -> tensor or None is added
    to the output of every projection (LoRA). mistakes: see MISTAKES (self-checks only)."""
    for m in mistakes:
        if m not in MISTAKES and not (m.startswith("skip:") and m[5:] in NORMS):
            raise ValueError(f"unknown mistake {m!r}")
    if field(cfg, "use_bidirectional_attention"):
        raise ValueError("reference has no use_bidirectional_attention")
    act_name = field(cfg, "hidden_activation")
    if act_name != "gelu_pytorch_tanh":
        raise ValueError(f"reference has no hidden_activation {act_name!r}")
    b, t = inputs.shape
    c, eps = cfg["hidden_size"], field(cfg, "rms_norm_eps")
    hs, h, hkv = field(cfg, "head_dim"), cfg["num_attention_heads"], cfg["num_key_value_heads"]
    scaling = (hs if "head_dim_scaling" in mistakes else field(cfg, "query_pre_attn_scalar")) \
        ** -0.5
    types = gemma3_layer_types(cfg)
    rope = {kind: base.rope_cos_sin(gemma3_inv_freq(cfg, kind, mistakes), t)
            for kind in set(types)}
    one_plus = "norm_w" not in mistakes

    def norm(x, name, weight):
        if "skip:" + name in mistakes:
            return x
        return gemma3_norm(x, p[weight], eps, one_plus)

    def proj(i, path, x):
        y = x @ p[f"model.layers.{i}.{path}.weight"].T
        if delta is not None:
            d = delta(i, path.split(".")[-1], x)
            if d is not None:
                y = y + d
        return y

    if "silu" in mistakes:
        act = torch.nn.functional.silu
    elif "gelu_exact" in mistakes:
        act = torch.nn.functional.gelu
    else:
        act = base.gelu_tanh

    x = p["model.embed_tokens.weight"][inputs]
    if "no_embed_scale" not in mistakes:
        x = x * torch.tensor(c, dtype=x.dtype).sqrt()
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        a = norm(x, "input_layernorm", pre + "input_layernorm.weight")
        q = proj(i, "self_attn.q_proj", a).view(b, t, h, hs)
        k = proj(i, "self_attn.k_proj", a).view(b, t, hkv, hs)
        v = proj(i, "self_attn.v_proj", a).view(b, t, hkv, hs)
        if "qk_norm_after_rope" not in mistakes:
            q = norm(q, "q_norm", pre + "self_attn.q_norm.weight")
            k = norm(k, "k_norm", pre + "self_attn.k_norm.weight")
        cos, sin = rope[types[i]]
        q = base.apply_rope(q.transpose(1, 2), cos, sin)
        k = base.apply_rope(k.transpose(1, 2), cos, sin)
        if "qk_norm_after_rope" in mistakes:
            q = norm(q, "q_norm", pre + "self_attn.q_norm.weight")
            k = norm(k, "k_norm", pre + "self_attn.k_norm.weight")
        window = field(cfg, "sliding_window") if types[i] == SLIDING else None
        y = gemma3_attention(q, k, v.transpose(1, 2), scaling, window,
                             field(cfg, "attn_logit_softcapping"))
        y = proj(i, "self_attn.o_proj", y.transpose(1, 2).reshape(b, t, h * hs))
        x = x + norm(y, "post_attention_layernorm", pre + "post_attention_layernorm.weight")
        m = norm(x, "pre_feedforward_layernorm", pre + "pre_feedforward_layernorm.weight")
        m = proj(i, "mlp.down_proj", act(proj(i, "mlp.gate_proj", m)) * proj(i, "mlp.up_proj", m))
        x = x + norm(m, "post_feedforward_layernorm", pre + "post_feedforward_layernorm.weight")
    x = norm(x, "norm", "model.norm.weight")
    if head is None:
        head = p["model.embed_tokens.weight"] if field(cfg, "tie_word_embeddings") \
            else p["lm_head.weight"]
    logits = softcap(x @ head.T, field(cfg, "final_logit_softcapping"))
    return base.mean_cross_entropy(logits, targets)


# Plug gemma3_text into base's table (this process only): random_params, Model and
# write_model_dir then serve it. The other families' entries are left as base has them.
base.FAMILIES["gemma3_text"] = (gemma3_param_shapes, gemma3_loss)


# ---------------------------------------------------------------------------
# Configurations and models.

def gemma3_config(layers, heads, kv, head_dim=8, hidden=24, vocab=103, query_pre_attn_scalar=16,
                  sliding_window=WINDOW, sliding_window_pattern=2, layer_types=None,
                  rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None,
                  tied=None, torch_dtype="float32", eos_token_id=1):
    """The shape of google/gemma-3-1b's config.json (transformers 4.50: sliding_window_pattern,
    no layer_types, no tie_word_embeddings: tied by default); layer_types: the explicit list
    later versions write; tied None leaves tie_word_embeddings out."""
    cfg = {
        "architectures": ["Gemma3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "cache_implementation": "hybrid",
        "eos_token_id": eos_token_id,
        "final_logit_softcapping": None,
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": 40,
        "max_position_embeddings": 64,
        "model_type": "gemma3_text",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv,
        "pad_token_id": 0,
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "rms_norm_eps": 1e-06,
        "rope_local_base_freq": rope_local_base_freq,
        "rope_scaling": rope_scaling,
        "rope_theta": rope_theta,
        "sliding_window": sliding_window,
        "sliding_window_pattern": sliding_window_pattern,
        "torch_dtype": torch_dtype,
        "transformers_version": "4.50.0.dev0",
        "use_cache": True,
        "vocab_size": vocab,
    }
    if layer_types is not None:
        cfg["layer_types"] = layer_types
        del cfg["sliding_window_pattern"]
    if tied is not None:
        cfg["tie_word_embeddings"] = tied
    return cfg


def gemma3_model(name, cfg, seed, storage="F32", shards=1):
    """base.Model with the norm weights drawn around 0 (0.2 * randn: the multiplier is 1 + w)
    instead of base's around 1, rounded to the storage dtype."""
    model = Model(name, cfg, seed, storage, shards)
    g = torch.Generator().manual_seed(seed + 1000)
    round_to = {"F32": torch.float32, "BF16": torch.bfloat16}[storage]
    for n, t in model.params.items():
        if n.endswith("norm.weight"):
            z = torch.randn(t.shape, generator=g, dtype=F64)
            model.params[n] = (0.2 * z).to(round_to).to(F64)
    return model


LINEAR_SCALING = {"rope_type": "linear", "factor": 4.0}


def make_models():
    return [
        # As gemma-3-1b: sliding_window_pattern (2 here: layers 0, 2 slide, 1 is full), tied by
        # default, GQA, head_dim 8 != 24 / 4, query_pre_attn_scalar 16 != 8.
        gemma3_model("gemma3_pattern_tied_gqa_f32", gemma3_config(layers=3, heads=4, kv=2),
                     seed=71),
        # As gemma-3-4b's text config: linear rope scaling on the full layers, an explicit
        # layer_types list (full, sliding, full), MQA, eos a list, BF16. The local base is 100
        # (not 1e4): with one sliding layer and a 4-token window, 1e4 against 1e6 moves the
        # loss by only 6 * EVAL_REL_TOL; 100 by 23x (ReferenceSensitivityTest).
        gemma3_model("gemma3_layer_types_linear_rope_mqa_bf16",
                     gemma3_config(layers=3, heads=4, kv=1, vocab=101,
                                   layer_types=[FULL, SLIDING, FULL], rope_scaling=LINEAR_SCALING,
                                   rope_local_base_freq=100.0, torch_dtype="bfloat16",
                                   eos_token_id=[1, 106]),
                     seed=72, storage="BF16"),
        # tie_word_embeddings false (lm_head.weight), two heads of 16 over hidden 24,
        # query_pre_attn_scalar 24, two shards.
        gemma3_model("gemma3_untied_sharded_f32",
                     gemma3_config(layers=2, heads=2, kv=1, head_dim=16, vocab=97,
                                   query_pre_attn_scalar=24, tied=False,
                                   rope_local_base_freq=100.0, rope_theta=10000.0),
                     seed=73, shards=2),
    ]


# ---------------------------------------------------------------------------
# LoRA (PEFT names: base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight, ...).

def gemma3_lora_modules(cfg):
    """(module, its path in a layer, in, out) in the family's module order (Llama's)."""
    shapes = gemma3_param_shapes(cfg)
    out = []
    for module, group in base.LLAMA_LORA_MODULES:
        rows, cols = shapes[f"model.layers.0.{group}.{module}.weight"]
        out.append((module, f"{group}.{module}", cols, rows))
    return out


def gemma3_lora_loss(model, adapters, lora, inputs, targets, dropout_seed=None):
    """gemma3_loss with y += (alpha / r) dropout(x) A^T B^T on every targeted projection
    (base.lora_delta; site = index among the targeted modules in the family's order)."""
    targeted = [m for m, _, _, _ in gemma3_lora_modules(model.cfg) if m in lora["targets"]]

    def delta(i, module, x):
        if module not in targeted:
            return None
        a, bb = adapters[(i, module)]
        return base.lora_delta(x, a, bb, lora, i, targeted.index(module), dropout_seed)

    return gemma3_loss(model.params, model.cfg, inputs, targets, delta=delta)


def write_gemma3_lora_adapter(path, model, lora, seed):
    """A PEFT adapter directory with random nonzero A and B; returns {(layer, module): (A, B)}."""
    gen = torch.Generator().manual_seed(seed)
    adapters, tensors = {}, {}
    for i in range(model.cfg["num_hidden_layers"]):
        for module, mpath, fan_in, fan_out in gemma3_lora_modules(model.cfg):
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
# Self-checks of the reference: these run without strata.

def batch(cfg, seed, b=2, t=SEQ_LEN):
    return windows(base.random_tokens(seed, b * t + 1, cfg["vocab_size"]), t)


def rel_diff(a, b):
    return abs(a - b) / abs(b)


def loop_attention(q, k, v, scaling, window, cap=None):
    """Loops over batch, head, query: softcapped scores over the keys s with
    i - window < s <= i, explicit softmax."""
    b, h, t, hs = q.shape
    hkv = k.shape[1]
    out = torch.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            kv = hi * hkv // h
            for ti in range(t):
                keys = [s for s in range(ti + 1) if window is None or s > ti - window]
                scores = []
                for s in keys:
                    sc = float((q[bi, hi, ti] * k[bi, kv, s]).sum()) * scaling
                    scores.append(sc if cap is None else cap * math.tanh(sc / cap))
                top = max(scores)
                w = [math.exp(sc - top) for sc in scores]
                for s, ws in zip(keys, w):
                    out[bi, hi, ti] += ws / sum(w) * v[bi, kv, s]
    return out


@unittest.skipIf(torch is None, "torch is not importable")
class ReferenceOpsTest(unittest.TestCase):
    def setUp(self):
        self.g = torch.Generator().manual_seed(3)

    def randn(self, *shape):
        return torch.randn(shape, generator=self.g, dtype=F64)

    def test_one_plus_w_norm_at_zero_is_plain_rms_norm(self):
        x, w = self.randn(3, 5, 24), self.randn(24)
        plain = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
        self.assertLess((gemma3_norm(x, torch.zeros(24, dtype=F64), 1e-6) - plain)
                        .abs().max().item(), 1e-14)
        self.assertLess((gemma3_norm(x, w, 1e-6) - plain * (1 + w)).abs().max().item(), 1e-13)
        # Per head over head_dim: each (position, head) row normalised on its own.
        q = self.randn(2, 7, 4, 8)
        got = gemma3_norm(q, torch.zeros(8, dtype=F64), 1e-6)
        self.assertLess(((got * got).mean(-1) - 1).abs().max().item(), 1e-5)

    def test_attention_matches_loops_with_windows_scaling_and_softcap(self):
        t = 9
        for h, hkv in ((4, 2), (4, 1), (2, 2)):
            q, k, v = self.randn(2, h, t, 8), self.randn(2, hkv, t, 8), self.randn(2, hkv, t, 8)
            for window in (None, 1, 4, t):
                for cap in (None, 2.0):
                    got = gemma3_attention(q, k, v, 16 ** -0.5, window, cap)
                    want = loop_attention(q, k, v, 16 ** -0.5, window, cap)
                    self.assertLess((got - want).abs().max().item(), 1e-13,
                                    f"H {h} Hkv {hkv} w {window} cap {cap}")
        # With scaling 1/sqrt(hs), no window and no cap: base's causal attention.
        q, k, v = self.randn(1, 4, t, 8), self.randn(1, 2, t, 8), self.randn(1, 2, t, 8)
        self.assertLess((gemma3_attention(q, k, v, 8 ** -0.5) - base.causal_attention(q, k, v))
                        .abs().max().item(), 1e-14)

    def test_window_mask_is_i_minus_w_lt_j_le_i(self):
        self.assertEqual(visible(5, 3).int().tolist(), [[1, 0, 0, 0, 0],
                                                        [1, 1, 0, 0, 0],
                                                        [1, 1, 1, 0, 0],
                                                        [0, 1, 1, 1, 0],
                                                        [0, 0, 1, 1, 1]])
        self.assertTrue(torch.equal(visible(5), torch.ones(5, 5, dtype=torch.bool).tril()))

    def test_layer_types_from_the_pattern_or_the_explicit_list(self):
        def types(n, **kw):
            cfg = gemma3_config(layers=n, heads=4, kv=2, **kw)
            return gemma3_layer_types(cfg)

        # gemma-3-1b: 26 layers, pattern 6 -> full at 5, 11, 17, 23.
        cfg = gemma3_config(layers=26, heads=4, kv=1)
        del cfg["sliding_window_pattern"]  # the default, 6
        self.assertEqual([i for i, k in enumerate(gemma3_layer_types(cfg)) if k == FULL],
                         [5, 11, 17, 23])
        self.assertEqual(types(4, sliding_window_pattern=2), [SLIDING, FULL, SLIDING, FULL])
        self.assertEqual(types(3, sliding_window_pattern=1), [FULL] * 3)
        self.assertEqual(types(3, layer_types=[FULL, FULL, SLIDING]), [FULL, FULL, SLIDING])
        with_both = dict(gemma3_config(layers=3, heads=4, kv=2), layer_types=[FULL] * 3)
        self.assertEqual(gemma3_layer_types(with_both), [FULL] * 3)  # the list wins
        self.assertEqual([gemma3_layer_types(m.cfg) for m in make_models()],
                         [[SLIDING, FULL, SLIDING], [FULL, SLIDING, FULL], [SLIDING, FULL]])

    def test_rope_bases_and_linear_scaling_per_layer_type(self):
        cfg = gemma3_config(layers=2, heads=4, kv=2, rope_theta=1e6, rope_local_base_freq=1e4,
                            rope_scaling=LINEAR_SCALING)
        j = torch.arange(0, 8, 2, dtype=F64) / 8
        self.assertLess((gemma3_inv_freq(cfg, SLIDING) - 1e4 ** -j).abs().max().item(), 1e-16)
        self.assertLess((gemma3_inv_freq(cfg, FULL) - 1e6 ** -j / 4.0).abs().max().item(), 1e-16)
        # Linear scaling = positions divided by the factor.
        cos, sin = base.rope_cos_sin(gemma3_inv_freq(cfg, FULL), 9)
        ang = (torch.arange(9, dtype=F64) / 4.0)[:, None] * (1e6 ** -j)[None, :]
        self.assertLess((cos - torch.cat([ang, ang], -1).cos()).abs().max().item(), 1e-15)
        self.assertLess((sin - torch.cat([ang, ang], -1).sin()).abs().max().item(), 1e-15)
        # The defaults of an absent field: 1e4 local, 1e6 global.
        bare = {k: v for k, v in cfg.items()
                if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")}
        self.assertTrue(torch.equal(gemma3_inv_freq(bare, SLIDING), 1e4 ** -j))
        self.assertTrue(torch.equal(gemma3_inv_freq(bare, FULL), 1e6 ** -j))
        with self.assertRaises(ValueError):
            gemma3_inv_freq(dict(cfg, rope_scaling={"rope_type": "yarn", "factor": 4.0}), FULL)
        # The older "type" key, and the newer rope_parameters forms, mean the same.
        old_key = dict(cfg, rope_scaling={"type": "linear", "factor": 4.0})
        keyed = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_local_base_freq",
                                                           "rope_scaling")}
        keyed["rope_parameters"] = {
            FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            SLIDING: {"rope_type": "default", "rope_theta": 1e4}}
        flat = dict(cfg, rope_scaling=None, rope_parameters={"rope_type": "linear",
                                                             "factor": 4.0})
        for other in (old_key, keyed, flat):
            for kind in (SLIDING, FULL):
                self.assertTrue(torch.equal(gemma3_inv_freq(other, kind),
                                            gemma3_inv_freq(cfg, kind)), kind)

    def test_embedding_scale_is_sqrt_hidden_size(self):
        # Untied: feeding E * sqrt(C) without the scale is the model with E (the head is
        # lm_head, so only the input side sees E).
        model = make_models()[2]
        self.assertFalse(field(model.cfg, "tie_word_embeddings"))
        x, y = batch(model.cfg, 4)
        p = dict(model.params)
        p["model.embed_tokens.weight"] = p["model.embed_tokens.weight"] * math.sqrt(24)
        self.assertAlmostEqual(gemma3_loss(p, model.cfg, x, y, mistakes={"no_embed_scale"}).item(),
                               model.loss(x, y).item(), delta=1e-13)

    def test_softcapping_is_tanh_and_is_inert_when_null(self):
        z = torch.linspace(-100, 100, 401, dtype=F64)
        self.assertTrue(torch.equal(softcap(z, None), z))
        capped = softcap(z, 30.0)
        self.assertLess(capped.abs().max().item(), 30.0)
        self.assertLess((capped[200 - 5:200 + 6] - z[200 - 5:200 + 6]).abs().max().item(), 0.02)
        model = make_models()[0]
        x, y = batch(model.cfg, 5)
        ref = model.loss(x, y).item()
        for key, cap in (("attn_logit_softcapping", 0.5), ("final_logit_softcapping", 0.5)):
            moved = gemma3_loss(model.params, dict(model.cfg, **{key: cap}), x, y).item()
            self.assertGreater(rel_diff(moved, ref), 1e-3, key)


@unittest.skipIf(torch is None, "torch is not importable")
class ReferenceModelTest(unittest.TestCase):
    """Whole-model properties of the fixture's models."""

    def test_configs_carry_the_published_fields(self):
        want = {"architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "hidden_activation", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                "rope_local_base_freq", "rope_scaling", "query_pre_attn_scalar",
                "sliding_window", "attn_logit_softcapping", "final_logit_softcapping",
                "attention_bias", "bos_token_id", "eos_token_id", "pad_token_id",
                "torch_dtype", "use_cache"}
        for model in make_models():
            cfg = model.cfg
            self.assertLessEqual(want, set(cfg), model.name)
            self.assertTrue(("sliding_window_pattern" in cfg) != ("layer_types" in cfg))
            self.assertEqual(cfg["model_type"], "gemma3_text")
            self.assertEqual(cfg["architectures"], ["Gemma3ForCausalLM"])
            self.assertEqual(json.loads(json.dumps(cfg)), cfg, model.name)
            self.assertEqual(cfg["vocab_size"] % 2, 1, model.name)
            self.assertNotEqual(cfg["head_dim"] * cfg["num_attention_heads"], cfg["hidden_size"])
            self.assertNotEqual(cfg["query_pre_attn_scalar"], cfg["head_dim"])
            self.assertNotEqual(field(cfg, "rope_theta"), field(cfg, "rope_local_base_freq"))
            self.assertLess(cfg["num_key_value_heads"], cfg["num_attention_heads"])
            self.assertLess(cfg["sliding_window"], SEQ_LEN)
            self.assertEqual(set(gemma3_layer_types(cfg)), {SLIDING, FULL}, model.name)
            self.assertIsNone(cfg["attn_logit_softcapping"])
            self.assertIsNone(cfg["final_logit_softcapping"])
            self.assertEqual(cfg["torch_dtype"],
                             {"F32": "float32", "BF16": "bfloat16"}[model.storage], model.name)
        storages = {m.storage for m in make_models()}
        self.assertEqual(storages, {"F32", "BF16"})
        self.assertTrue(any(m.cfg["rope_scaling"] == LINEAR_SCALING for m in make_models()))

    def test_norm_weights_lie_around_zero_and_names_are_the_checkpoints(self):
        for model in make_models():
            shapes = gemma3_param_shapes(model.cfg)
            self.assertEqual(list(model.params), list(shapes), model.name)
            self.assertEqual("lm_head.weight" in shapes,
                             not field(model.cfg, "tie_word_embeddings"), model.name)
            norms = [t for n, t in model.params.items() if n.endswith("norm.weight")]
            self.assertEqual(len(norms), 6 * model.cfg["num_hidden_layers"] + 1)
            allw = torch.cat(norms)
            self.assertLess(allw.mean().abs().item(), 0.05, model.name)
            self.assertTrue(0.1 < allw.std().item() < 0.3, model.name)

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
            self.assertNotEqual(model.loss(x, y).item(), model.loss(x2, y).item(), model.name)

    def test_loss_is_near_log_vocab_but_not_uniform(self):
        for model in make_models():
            x, y = batch(model.cfg, 13)
            loss = model.loss(x, y).item()
            v = model.cfg["vocab_size"]
            self.assertTrue(0.5 * math.log(v) < loss < 3 * math.log(v), f"{model.name}: {loss}")
            self.assertGreater(abs(loss - math.log(v)), 1e-3, model.name)

    def test_tied_embedding_gradient_is_the_sum_of_its_two_uses(self):
        model = make_models()[0]
        x, y = batch(model.cfg, 14)
        embed = "model.embed_tokens.weight"
        tied = {n: t.clone().requires_grad_() for n, t in model.params.items()}
        model.loss(x, y, tied).backward()
        untied = {n: t.detach().clone().requires_grad_() for n, t in tied.items()}
        head = tied[embed].detach().clone().requires_grad_()
        gemma3_loss(untied, model.cfg, x, y, head=head).backward()
        both = untied[embed].grad + head.grad
        self.assertLess((tied[embed].grad - both).abs().max().item(), 1e-13)
        self.assertGreater(head.grad.abs().max().item(), 1e-3)
        self.assertGreater(untied[embed].grad.abs().max().item(), 1e-3)

    def test_whole_forward_with_loop_attention(self):
        global gemma3_attention
        fast = gemma3_attention
        for model in make_models()[:2]:
            x, y = batch(model.cfg, 15, b=1)
            want = model.loss(x, y).item()
            try:
                gemma3_attention = loop_attention
                got = model.loss(x, y).item()
            finally:
                gemma3_attention = fast
            self.assertAlmostEqual(got, want, delta=1e-12, msg=model.name)

    def test_kv_head_sharing_equals_mha_with_the_kv_weights_repeated(self):
        model = make_models()[1]  # MQA: 4 query heads, 1 kv head
        cfg = dict(model.cfg, num_key_value_heads=4)
        p = dict(model.params)
        for i in range(cfg["num_hidden_layers"]):
            for w in ("k_proj", "v_proj"):
                n = f"model.layers.{i}.self_attn.{w}.weight"
                p[n] = p[n].repeat(4, 1)
        x, y = batch(cfg, 16)
        self.assertAlmostEqual(gemma3_loss(p, cfg, x, y).item(), model.loss(x, y).item(),
                               delta=1e-13)

    def test_window_as_long_as_the_sequence_makes_every_layer_full(self):
        for model in make_models():
            x, y = batch(model.cfg, 17)
            a = gemma3_loss(model.params, dict(model.cfg, sliding_window=SEQ_LEN), x, y).item()
            # A window >= T hides nothing: the sliding layers then differ from full ones only
            # by their RoPE base, and any longer window gives the same loss.
            self.assertIn(SLIDING, gemma3_layer_types(model.cfg))
            self.assertNotEqual(a, model.loss(x, y).item(), model.name)  # the window matters
            b = gemma3_loss(model.params, dict(model.cfg, sliding_window=SEQ_LEN + 5), x, y)
            self.assertEqual(a, b.item(), model.name)

    def test_lora_reference_with_zero_b_is_the_base_model_and_adapters_act(self):
        tmp = tempfile.mkdtemp(prefix="strata-hf-gemma3-lora-")
        try:
            model = make_models()[0]
            model.dir = tmp
            lora = {"r": 2, "alpha": 4.0, "dropout": 0.3,
                    "targets": [m for m, _ in base.LLAMA_LORA_MODULES]}
            adapters = write_gemma3_lora_adapter(os.path.join(tmp, "a"), model, lora, seed=3)
            self.assertEqual(len(adapters), 7 * model.cfg["num_hidden_layers"])
            tensors, _ = base.read_safetensors(os.path.join(tmp, "a", "adapter_model.safetensors"))
            self.assertIn("base_model.model.model.layers.2.mlp.down_proj.lora_B.weight", tensors)
            self.assertEqual(tensors["base_model.model.model.layers.0.self_attn.k_proj"
                                     ".lora_B.weight"][2], [16, 2])
            x, y = batch(model.cfg, 9)
            zero = {k: (a, torch.zeros_like(bb)) for k, (a, bb) in adapters.items()}
            seed = base.micro_batch_dropout_seed(5)
            self.assertAlmostEqual(gemma3_lora_loss(model, zero, lora, x, y, seed).item(),
                                   model.loss(x, y).item(), delta=1e-14)
            on = gemma3_lora_loss(model, adapters, lora, x, y, seed).item()
            off = gemma3_lora_loss(model, adapters, dict(lora, dropout=0.0), x, y).item()
            self.assertGreater(abs(off - model.loss(x, y).item()), 1e-3)
            self.assertGreater(abs(on - off), 1e-4)
        finally:
            shutil.rmtree(tmp)

    def test_equivalent_config_forms_describe_the_same_model(self):
        # What the export check compares: a pattern or the list it derives, rope_scaling or
        # rope_parameters, a default written out or left out.
        model = make_models()[0]
        cfg = model.cfg
        listed = {k: v for k, v in cfg.items() if k != "sliding_window_pattern"}
        listed["layer_types"] = [SLIDING, FULL, SLIDING]
        bare = {k: v for k, v in cfg.items() if k not in ("rope_local_base_freq", "rope_scaling",
                                                          "attention_bias", "rms_norm_eps")}
        x, y = batch(cfg, 18)
        for other in (listed, bare):
            self.assertEqual(effective_config(other), effective_config(cfg))
            self.assertEqual(gemma3_loss(model.params, other, x, y).item(), model.loss(x, y).item())
        for change in ({"sliding_window_pattern": 3}, {"rope_local_base_freq": 1e5},
                       {"rope_scaling": LINEAR_SCALING}, {"query_pre_attn_scalar": 8}):
            self.assertNotEqual(effective_config(dict(cfg, **change)), effective_config(cfg))

    def test_stored_directory_reads_back_exactly(self):
        tmp = tempfile.mkdtemp(prefix="strata-hf-gemma3-")
        try:
            for model in make_models():
                d = model.write(tmp)
                tensors = base.read_model_dir_tensors(d)
                self.assertEqual(sorted(tensors), sorted(gemma3_param_shapes(model.cfg)))
                for name, t in model.params.items():
                    self.assertEqual(tensors[name][1], model.storage, name)
                    self.assertTrue(torch.equal(tensors[name][0], t), name)
                with open(os.path.join(d, "config.json")) as fh:
                    self.assertEqual(json.load(fh), model.cfg)
        finally:
            shutil.rmtree(tmp)


@unittest.skipIf(torch is None, "torch is not importable")
class ReferenceSensitivityTest(unittest.TestCase):
    """Each mistake an engine could make about Gemma 3, measured on the fixture's own models
    and tokens: it moves the eval loss by more than LOSS_MARGIN * EVAL_REL_TOL (so the eval
    test catches it alone) and some gradient by more than GRAD_MARGIN times
    assert_gradient_close's bound (so the gradient test catches it with a wide margin).
    Mean cross-entropy over random targets is a blunt probe; measured, the smallest loss effect
    is 10.6 * EVAL_REL_TOL (model 0's k_norm weights ignored), then 16x (model 1 without
    q_norm), 23x (model 1's sliding layer with rope_theta); the smallest gradient effect is
    1970 times the bound."""

    LOSS_MARGIN = 10
    GRAD_MARGIN = 1000

    def setUp(self):
        self.models = make_models()

    def data(self, index):
        model = self.models[index]
        return windows(base.random_tokens(300 + index, EVAL_TOKENS, model.cfg["vocab_size"]),
                       SEQ_LEN)

    def grads(self, p, cfg, x, y, **kw):
        leaves = {n: t.clone().requires_grad_() for n, t in p.items()}
        gemma3_loss(leaves, cfg, x[:MICRO_BATCH], y[:MICRO_BATCH], **kw).backward()
        return {n: t.grad for n, t in leaves.items()}  # None: unused (a skipped norm's weight)

    def check_mistake(self, index, what, cfg=None, params=None, **kw):
        model = self.models[index]
        x, y = self.data(index)
        wrong_cfg = model.cfg if cfg is None else cfg
        wrong_p = model.params if params is None else params
        ref = gemma3_loss(model.params, model.cfg, x, y).item()
        wrong = gemma3_loss(wrong_p, wrong_cfg, x, y, **kw).item()
        self.assertGreater(rel_diff(wrong, ref), self.LOSS_MARGIN * EVAL_REL_TOL,
                           f"{model.name} {what}: loss {wrong} vs {ref}")
        g_ref = self.grads(model.params, model.cfg, x, y)
        g_wrong = self.grads(wrong_p, wrong_cfg, x, y, **kw)
        worst = max(((g_wrong[n] - g).abs().max() /
                     (GRAD_REL_TOL * g.abs().max() + base.GRAD_ABS_TOL)).item()
                    for n, g in g_ref.items() if g_wrong.get(n) is not None)
        self.assertGreater(worst, self.GRAD_MARGIN, f"{model.name} {what}: gradients")
        return rel_diff(wrong, ref) / EVAL_REL_TOL

    def test_each_mistake_moves_the_loss_far_beyond_the_eval_tolerance(self):
        plain = ["norm_w", "no_embed_scale", "head_dim_scaling", "sliding_rope_theta",
                 "qk_norm_after_rope", "silu"] + ["skip:" + n for n in NORMS]
        for index in range(len(self.models)):
            for mistake in plain:
                with self.subTest(model=self.models[index].name, mistake=mistake):
                    self.check_mistake(index, mistake, mistakes={mistake})

    def test_linear_rope_scaling_matters_and_only_on_full_layers(self):
        for mistake in ("no_rope_scaling", "rope_scaling_on_sliding"):
            with self.subTest(mistake=mistake):
                self.check_mistake(1, mistake, mistakes={mistake})

    def test_each_norm_weight_matters(self):
        # A weight left at its initial 0 (multiplier 1) where the file holds one.
        for index in (0, 1):
            for which in NORMS:
                p = dict(self.models[index].params)
                names = [n for n in p if n.endswith(f".{which}.weight") or
                         (which == "norm" and n == "model.norm.weight")]
                self.assertTrue(names, which)
                for n in names:
                    p[n] = torch.zeros_like(p[n])
                with self.subTest(model=self.models[index].name, norm=which):
                    self.check_mistake(index, f"{which} weights ignored", params=p)

    def test_window_its_off_by_one_and_the_layer_types(self):
        for index in (0, 1):
            cfg = self.models[index].cfg
            n = cfg["num_hidden_layers"]
            wrong_cfgs = {
                "window - 1": dict(cfg, sliding_window=WINDOW - 1),
                "window + 1": dict(cfg, sliding_window=WINDOW + 1),
                "no window": dict(cfg, sliding_window=SEQ_LEN),
                "all full": dict(cfg, layer_types=[FULL] * n),
                "all sliding": dict(cfg, layer_types=[SLIDING] * n),
                "types inverted": dict(cfg, layer_types=[FULL if k == SLIDING else SLIDING
                                                         for k in gemma3_layer_types(cfg)]),
            }
            for what, wrong in wrong_cfgs.items():
                with self.subTest(model=self.models[index].name, mistake=what):
                    self.check_mistake(index, what, cfg=wrong)

    def test_exact_gelu_is_close_and_therefore_refused_rather_than_tolerated(self):
        # hidden_activation "gelu" (erf) differs from the tanh form by < 1e-3 per element: on
        # the fixture the loss moves by about EVAL_REL_TOL (measured 0.8x, 1.2x, 0.02x), which
        # the eval bound cannot be relied on to catch, so an engine must refuse the field
        # instead of computing the tanh form for it (StrataBadInputTest).
        for index, model in enumerate(self.models):
            x, y = self.data(index)
            ref = model.loss(x, y).item()
            exact = gemma3_loss(model.params, model.cfg, x, y, mistakes={"gelu_exact"}).item()
            self.assertNotEqual(exact, ref, model.name)
            self.assertLess(rel_diff(exact, ref), self.LOSS_MARGIN * EVAL_REL_TOL, model.name)


# ---------------------------------------------------------------------------
# strata against the reference.

Fixture = base.ModelFixture("strata-hf-gemma3-", lambda: make_models(), 300, EVAL_TOKENS)


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

    def test_a_multimodal_gemma3_directory_evaluates_its_language_model(self):
        # Gemma3ForConditionalGeneration (model_type "gemma3"): the config nests the text model
        # under text_config, the weights are the language model's under "language_model.model."
        # (the Hub's checkpoints) or "model.language_model." (transformers 4.52+ saves), beside
        # a vision tower and projector Strata does not read. Strata evaluates the language
        # model: the reference loss of the same text model.
        f = Fixture.get()
        model = f.models[0]
        g = torch.Generator().manual_seed(77)
        vision = {"vision_tower.vision_model.embeddings.patch_embedding.weight": (4, 3, 2, 2),
                  "multi_modal_projector.mm_input_projection_weight": (4, model.cfg["hidden_size"])}
        for style, rename, vprefix in (
                ("hub", lambda n: "language_model." + n, ""),
                ("4.52", lambda n: "model.language_model." + n[len("model."):]
                 if n.startswith("model.") else n, "model.")):
            with self.subTest(style=style):
                d = os.path.join(f.root, f"gemma3_multimodal_{style}")
                os.makedirs(d, exist_ok=True)
                text_config = {k: v for k, v in model.cfg.items() if k != "architectures"}
                cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                       "text_config": text_config,
                       "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 4},
                       "mm_tokens_per_image": 4, "image_token_index": 3, "boi_token_index": 4,
                       "eoi_token_index": 5}
                with open(os.path.join(d, "config.json"), "w") as fh:
                    json.dump(cfg, fh, indent=2)
                tensors = {rename(n): (t, "F32") for n, t in model.params.items()}
                for n, shape in vision.items():
                    tensors[vprefix + n] = (torch.randn(shape, generator=g, dtype=F64), "F32")
                base.write_safetensors(os.path.join(d, "model.safetensors"), tensors)
                check_eval(self, model, source=("--model-dir", d))

    def test_at_a_sequence_no_longer_than_the_window(self):
        # T <= w: the window hides nothing; the sliding layers still rotate with their base.
        model = Fixture.get().models[0]
        for t in (WINDOW, WINDOW - 1):
            with self.subTest(t=t):
                check_eval(self, model, t=t, b=2)


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
        adapters = write_gemma3_lora_adapter(adapter_dir, model, lora, seed=seed)
        paths = {m: path for m, path, _, _ in gemma3_lora_modules(model.cfg)}
        base.check_lora_gradients(self, f.root, model, lora, adapter_dir, adapters,
                                  gemma3_lora_loss, paths, SEQ_LEN, MICRO_BATCH)

    def test_adapters_on_every_projection(self):
        model = Fixture.get().models[0]  # tied, GQA, sliding and full layers
        self.check_lora(model, {"r": 3, "alpha": 6.0, "dropout": 0.0,
                                "targets": [m for m, _ in base.LLAMA_LORA_MODULES]})

    def test_adapters_on_some_projections_of_the_bf16_model(self):
        model = Fixture.get().models[1]  # MQA, linear rope scaling, BF16
        self.check_lora(model, {"r": 2, "alpha": 5.0, "dropout": 0.0,
                                "targets": ["k_proj", "o_proj", "up_proj"]}, seed=42)


def effective_config(cfg):
    """What a config.json means with Gemma3TextConfig's defaults: the fields the model reads,
    with the layer types resolved."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_activation",
            "rms_norm_eps", "tie_word_embeddings", "attention_bias", "query_pre_attn_scalar",
            "sliding_window", "final_logit_softcapping", "attn_logit_softcapping")
    out = {k: field(cfg, k) for k in keys}
    out["layer_types"] = gemma3_layer_types(cfg)
    for kind, rope in gemma3_rope_parameters(cfg).items():
        out[f"rope of {kind}"] = (rope["rope_type"], float(rope["rope_theta"]),
                                  float(rope.get("factor", 1.0)))
    return out


@unittest.skipIf(torch is None, "torch is not importable")
@unittest.skipUnless(STRATA_CLI, NO_CLI)
class StrataFineTuneTest(unittest.TestCase):
    """A Gemma 3 fine-tunes from its directory on a learnable token pattern (loss drops),
    exports as gemma3_text with the same tensor names, and the export re-evaluates to the
    checkpoint's loss and to the reference on the exported weights."""

    STEPS = 30

    def test_fine_tune_lowers_the_loss_and_exports_gemma3_text(self):
        model = gemma3_model("ft_gemma3", gemma3_config(layers=2, heads=4, kv=2,
                                                       rope_scaling=LINEAR_SCALING), seed=74)
        cfg = model.cfg

        def check_config(out_cfg):
            self.assertEqual(out_cfg.get("model_type"), "gemma3_text")
            self.assertEqual(out_cfg.get("architectures"), ["Gemma3ForCausalLM"])
            got_eff, want_eff = effective_config(out_cfg), effective_config(cfg)
            for key, want in want_eff.items():
                self.assertEqual(got_eff[key], want, f"exported config.json {key}")

        base.check_fine_tune_and_export(
            self, model, os.path.join(Fixture.get().root, "finetune"), self.STEPS, SEQ_LEN,
            MICRO_BATCH, gemma3_param_shapes(cfg), gemma3_loss, check_config)


@unittest.skipIf(torch is None, "torch is not importable")
@unittest.skipUnless(STRATA_CLI, NO_CLI)
class StrataBadInputTest(unittest.TestCase):
    """What Strata does not support fails with a non-zero exit and ONE stderr line naming the
    file and the field (or tensor)."""

    def setUp(self):
        self.f = Fixture.get()
        self.tmp = tempfile.mkdtemp(dir=self.f.root)
        self.model = self.f.models[0]

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def expect_error(self, model_dir, *needles):
        r = run([STRATA_CLI, "eval", "--model-dir", model_dir, "--data", self.model.data,
                 "--seq-len", SEQ_LEN, "--micro-batch-size", MICRO_BATCH, "--precision", "fp32",
                 "--device", "host", "--json"])
        self.assertGreater(r.returncode, 0, f"expected a failure exit:\n{r.stdout}\n{r.stderr}")
        err = r.stderr.strip()
        self.assertEqual(len(err.splitlines()), 1, f"stderr is not one line:\n{r.stderr}")
        for needle in needles:
            self.assertIn(needle, err)
        return err

    def with_config(self, **changes):
        d = os.path.join(self.tmp, "model")
        shutil.copytree(self.model.dir, d)
        with open(os.path.join(d, "config.json"), "w") as fh:
            json.dump(dict(self.model.cfg, **changes), fh)
        return d

    def test_attention_logit_softcapping_is_refused(self):
        self.expect_error(self.with_config(attn_logit_softcapping=50.0),
                          "config.json", "attn_logit_softcapping")

    def test_final_logit_softcapping_is_refused(self):
        self.expect_error(self.with_config(final_logit_softcapping=30.0),
                          "config.json", "final_logit_softcapping")

    def test_exact_gelu_activation_is_refused(self):
        self.expect_error(self.with_config(hidden_activation="gelu"),
                          "config.json", "hidden_activation")

    def test_missing_post_feedforward_norm_names_the_tensor(self):
        d = os.path.join(self.tmp, "model")
        name = "model.layers.1.post_feedforward_layernorm.weight"
        params = {n: t for n, t in self.model.params.items() if n != name}
        base.write_model_dir(d, self.model.cfg, params, self.model.storage)
        self.expect_error(d, "model.safetensors", name)


if __name__ == "__main__":
    if torch is None:
        print(f"SKIPPED: torch (or numpy) is not importable by {sys.executable} "
              f"({base._IMPORT_ERROR}); install python3-torch (Debian) to run the Hugging Face "
              "family tests")
        sys.exit(SKIP)
    unittest.main(verbosity=2)
