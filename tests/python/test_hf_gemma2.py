"""Strata's Gemma 2 models (model_type gemma2, Gemma2ForCausalLM) against a float64 PyTorch
reference of the Hugging Face architecture.

Gemma 2 is Gemma 3's text layer (test_hf_gemma3.py, imported as `g3`, holds that reference)
with these differences, read from transformers' published models/gemma2/modeling_gemma2.py and
configuration_gemma2.py (transformers is not installed, and not to be used):

- no q_norm / k_norm: the projections go straight into the rotary embedding;
- one rotary embedding for every layer: rope_theta (Gemma2Config default 1e4) and rope_scaling
  on sliding and full layers alike (Gemma 3's sliding layers have their own base, unscaled);
- soft-capping of the attention scores, cap * tanh(scores / cap) after the
  query_pre_attn_scalar^-0.5 scaling and before the mask (attn_logit_softcapping, default
  50.0), and of the final logits before the loss (final_logit_softcapping, default 30.0); null
  disables either;
- layer types: config.layer_types when present, else "sliding_attention" when (i + 1) % 2,
  i.e. the even layers 0, 2, ... slide (window sliding_window, default 4096);
- Gemma2Config's other defaults: vocabulary 256000, head_dim 256, query_pre_attn_scalar 256,
  tied embeddings, hidden_activation gelu_pytorch_tanh.

The (1 + w) norms, the embedding scale sqrt(hidden_size), the sandwich norms, GeGLU, GQA and the
sliding-window mask (i - w < j <= i) are Gemma 3's, and g3.gemma3_loss computes the model from
the Gemma 3 form of a Gemma 2 config (as_gemma3_form): every field explicit, the resolved layer
types, the sliding layers' base set to rope_theta and the rope scaling applied on them too, and
the q/k norms left out.

Tiny random models (the field names and value shapes of google/gemma-2-2b's config.json;
soft-capping constants of the order of the tiny models' scores and logits, so that tanh bends;
GQA and MQA, odd vocabularies, F32 and BF16, one untied and sharded) are written as Hugging Face
directories with llm.c token files, then, with the bounds of test_hf_families.py:

- `strata eval --json` reports the reference's mean cross-entropy within EVAL_REL_TOL;
  ReferenceSensitivityTest measures that each Gemma 2 mistake -- either cap ignored, the
  derivative-free "clamp" instead of tanh, q/k norms where there are none, the sliding layers'
  pattern inverted, linear rope scaling left off the sliding layers -- moves the loss by more
  than LOSS_MARGIN * EVAL_REL_TOL and some gradient by more than GRAD_MARGIN times the bound;
- `hf_gradients` writes the fp32 gradient of every parameter within the gradient bound, and
  LoRA adapter gradients (PEFT names) likewise;
- `strata train --model-dir` fine-tunes a Gemma 2 (loss drops), `strata export` writes
  model_type gemma2 with the same tensor names and soft-capping fields, and the export
  re-evaluates to the checkpoint's loss;
- a malformed soft-capping field fails with ONE stderr line naming config.json and the field.

CLI tests SKIP without STRATA_CLI (or STRATA_HF_GRADIENTS); the reference self-checks always
run. Exits 77 (CTest SKIP_RETURN_CODE) when torch is not importable.
"""

import json
import os
import shutil
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_hf_families as base  # noqa: E402  (the shared helpers, formats and bounds)
import test_hf_gemma3 as g3  # noqa: E402  (the Gemma 3 reference Gemma 2 is a variant of)

torch = base.torch
F64 = base.F64
EVAL_REL_TOL = base.EVAL_REL_TOL
GRAD_REL_TOL = base.GRAD_REL_TOL
STRATA_CLI = base.STRATA_CLI
STRATA_HF_GRADIENTS = base.STRATA_HF_GRADIENTS
run, windows = base.run, base.windows

SEQ_LEN = 13  # longer than the window, odd
MICRO_BATCH = 3
EVAL_TOKENS = 7 * SEQ_LEN + 5
WINDOW = 4
SLIDING, FULL = g3.SLIDING, g3.FULL

# Gemma2Config's defaults for the fields a config.json may leave out.
GEMMA2_DEFAULTS = {
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
    "use_bidirectional_attention": False,
}


def field(cfg, key):
    return cfg[key] if key in cfg else GEMMA2_DEFAULTS[key]


def gemma2_layer_types(cfg):
    """config.layer_types when present, else sliding when (i + 1) % 2 (Gemma2Config)."""
    if cfg.get("layer_types") is not None:
        return list(cfg["layer_types"])
    return [SLIDING if (i + 1) % 2 else FULL for i in range(cfg["num_hidden_layers"])]


def as_gemma3_form(cfg):
    """The Gemma 3 config g3.gemma3_loss reads for a Gemma 2 config: every field explicit, the
    layer types resolved, the sliding layers rotating with rope_theta."""
    out = {k: v for k, v in cfg.items() if k not in GEMMA2_DEFAULTS}
    out.update({k: field(cfg, k) for k in GEMMA2_DEFAULTS})
    out["layer_types"] = gemma2_layer_types(cfg)
    out["rope_local_base_freq"] = field(cfg, "rope_theta")
    out.pop("sliding_window_pattern", None)
    return out


# Gemma 2's mistakes (ReferenceSensitivityTest only), on top of g3.MISTAKES:
#   no_attn_softcap, no_final_softcap   that cap ignored
#   qk_norms                            q_norm / k_norm applied (weights zero: plain RMSNorm)
#   rope_scaling_only_on_full           Gemma 3's rule: linear scaling left off sliding layers
GEMMA2_MISTAKES = ("no_attn_softcap", "no_final_softcap", "qk_norms", "rope_scaling_only_on_full")


def gemma2_param_shapes(cfg):
    """{Hugging Face name: shape}: Gemma 3's without q_norm and k_norm."""
    return {n: s for n, s in g3.gemma3_param_shapes(as_gemma3_form(cfg)).items()
            if not n.endswith(("q_norm.weight", "k_norm.weight"))}


def gemma2_loss(p, cfg, inputs, targets, head=None, delta=None, mistakes=frozenset()):
    """Mean next-token cross-entropy of Gemma2ForCausalLM (see the module docstring)."""
    g3cfg = as_gemma3_form(cfg)
    own = set(mistakes) & set(GEMMA2_MISTAKES)
    rest = set(mistakes) - own
    if "no_attn_softcap" in own:
        g3cfg["attn_logit_softcapping"] = None
    if "no_final_softcap" in own:
        g3cfg["final_logit_softcapping"] = None
    if "qk_norms" in own:
        hs = g3cfg["head_dim"]
        p = dict(p)
        for i in range(cfg["num_hidden_layers"]):
            for which in ("q_norm", "k_norm"):
                p[f"model.layers.{i}.self_attn.{which}.weight"] = torch.zeros(hs, dtype=F64)
    else:
        rest |= {"skip:q_norm", "skip:k_norm"}
    if "rope_scaling_only_on_full" not in own:
        rest.add("rope_scaling_on_sliding")  # one rotary embedding for every layer
    return g3.gemma3_loss(p, g3cfg, inputs, targets, head=head, delta=delta,
                          mistakes=frozenset(rest))


base.FAMILIES["gemma2"] = (gemma2_param_shapes, gemma2_loss)


def gemma2_config(layers, heads, kv, head_dim=8, hidden=24, vocab=103, query_pre_attn_scalar=16,
                  sliding_window=WINDOW, layer_types=None, rope_theta=10000.0, rope_scaling=None,
                  attn_cap=1.0, final_cap=2.0, tied=None, torch_dtype="float32"):
    """The shape of google/gemma-2-2b's config.json (no layer_types: the default pattern);
    attn_cap / final_cap "default" leave the field out (Gemma2Config's 50 / 30)."""
    cfg = {
        "architectures": ["Gemma2ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 2,
        "cache_implementation": "hybrid",
        "eos_token_id": [1, 107],
        "head_dim": head_dim,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": 40,
        "max_position_embeddings": 64,
        "model_type": "gemma2",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv,
        "pad_token_id": 0,
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "rms_norm_eps": 1e-06,
        "rope_theta": rope_theta,
        "sliding_window": sliding_window,
        "torch_dtype": torch_dtype,
        "transformers_version": "4.42.4",
        "use_cache": True,
        "vocab_size": vocab,
    }
    if attn_cap != "default":
        cfg["attn_logit_softcapping"] = attn_cap
    if final_cap != "default":
        cfg["final_logit_softcapping"] = final_cap
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    if layer_types is not None:
        cfg["layer_types"] = layer_types
    if tied is not None:
        cfg["tie_word_embeddings"] = tied
    return cfg


def make_models():
    return [
        # As gemma-2-2b: the default layer pattern (0 and 2 slide), tied by default, GQA,
        # head_dim 8 != 24 / 4, both caps small enough to bend.
        g3.gemma3_model("gemma2_default_pattern_tied_gqa_f32",
                        gemma2_config(layers=3, heads=4, kv=2, attn_cap=0.7, final_cap=1.5),
                        seed=81),
        # An explicit layer_types list (full, sliding, sliding), linear rope scaling (on every
        # layer), MQA, both caps null (none: not Gemma2Config's defaults), BF16.
        g3.gemma3_model("gemma2_layer_types_linear_rope_mqa_null_caps_bf16",
                        gemma2_config(layers=3, heads=4, kv=1, vocab=101,
                                      layer_types=[FULL, SLIDING, SLIDING],
                                      rope_scaling=g3.LINEAR_SCALING, attn_cap=None,
                                      final_cap=None, rope_theta=100.0, torch_dtype="bfloat16"),
                        seed=82, storage="BF16"),
        # Untied, two shards, heads of 16 over hidden 24, the final cap left to its default 30
        # (nearly inert on these logits) and no window on the full layer.
        g3.gemma3_model("gemma2_untied_sharded_default_final_cap_f32",
                        gemma2_config(layers=2, heads=2, kv=1, head_dim=16, vocab=97,
                                      query_pre_attn_scalar=24, tied=False, attn_cap=0.5,
                                      final_cap="default"),
                        seed=83, shards=2),
    ]


def gemma2_lora_loss(model, adapters, lora, inputs, targets, dropout_seed=None):
    """gemma2_loss with the LoRA deltas of g3.gemma3_lora_loss."""
    targeted = [m for m, _, _, _ in g3.gemma3_lora_modules(model.cfg) if m in lora["targets"]]

    def delta(i, module, x):
        if module not in targeted:
            return None
        a, bb = adapters[(i, module)]
        return base.lora_delta(x, a, bb, lora, i, targeted.index(module), dropout_seed)

    return gemma2_loss(model.params, model.cfg, inputs, targets, delta=delta)


# ---------------------------------------------------------------------------
# Self-checks of the reference: these run without strata.

def data(model, index):
    return windows(base.random_tokens(400 + index, EVAL_TOKENS, model.cfg["vocab_size"]), SEQ_LEN)


@unittest.skipIf(torch is None, "torch is not importable")
class ReferenceTest(unittest.TestCase):
    def test_defaults_and_layer_pattern_are_gemma2s(self):
        cfg = gemma2_config(layers=5, heads=2, kv=1, attn_cap="default", final_cap="default")
        g = as_gemma3_form(cfg)
        self.assertEqual(g["layer_types"], [SLIDING, FULL, SLIDING, FULL, SLIDING])
        self.assertEqual(g["attn_logit_softcapping"], 50.0)
        self.assertEqual(g["final_logit_softcapping"], 30.0)
        self.assertEqual(g["rope_local_base_freq"], g["rope_theta"])
        names = gemma2_param_shapes(cfg)
        self.assertFalse([n for n in names if "q_norm" in n or "k_norm" in n])
        self.assertIn("model.layers.4.post_feedforward_layernorm.weight", names)

    def test_every_parameter_has_a_gradient(self):
        model = make_models()[0]
        x, y = data(model, 0)
        leaves = {n: t.clone().requires_grad_() for n, t in model.params.items()}
        gemma2_loss(leaves, model.cfg, x[:2], y[:2]).backward()
        for n, t in leaves.items():
            self.assertIsNotNone(t.grad, n)
            self.assertGreater(t.grad.abs().max().item(), 0, n)

    def test_softcapping_is_the_tanh_of_the_scaled_score(self):
        s = torch.linspace(-10, 10, 41, dtype=F64)
        self.assertTrue(torch.allclose(g3.softcap(s, 2.0), 2.0 * torch.tanh(s / 2.0)))
        self.assertLess(g3.softcap(s, 2.0).abs().max().item(), 2.0)


@unittest.skipIf(torch is None, "torch is not importable")
class ReferenceSensitivityTest(unittest.TestCase):
    """Each Gemma 2 mistake, measured on the fixture's own models and tokens: it moves the eval
    loss by more than LOSS_MARGIN * EVAL_REL_TOL and some gradient by more than GRAD_MARGIN
    times assert_gradient_close's bound."""

    LOSS_MARGIN = 10
    GRAD_MARGIN = 1000

    def setUp(self):
        self.models = make_models()

    def grads(self, model, cfg, x, y, **kw):
        leaves = {n: t.clone().requires_grad_() for n, t in model.params.items()}
        gemma2_loss(leaves, cfg, x[:MICRO_BATCH], y[:MICRO_BATCH], **kw).backward()
        return {n: t.grad for n, t in leaves.items()}

    def check(self, index, what, cfg=None, grad_margin=None, **kw):
        model = self.models[index]
        x, y = data(model, index)
        wrong_cfg = model.cfg if cfg is None else cfg
        ref = gemma2_loss(model.params, model.cfg, x, y).item()
        wrong = gemma2_loss(model.params, wrong_cfg, x, y, **kw).item()
        self.assertGreater(g3.rel_diff(wrong, ref), self.LOSS_MARGIN * EVAL_REL_TOL,
                           f"{model.name} {what}: loss {wrong} vs {ref}")
        g_ref = self.grads(model, model.cfg, x, y)
        g_wrong = self.grads(model, wrong_cfg, x, y, **kw)
        worst = max(((g_wrong[n] - g).abs().max() /
                     (GRAD_REL_TOL * g.abs().max() + base.GRAD_ABS_TOL)).item()
                    for n, g in g_ref.items() if g_wrong.get(n) is not None)
        self.assertGreater(worst, grad_margin or self.GRAD_MARGIN, f"{model.name} {what}: gradients")

    def test_each_cap_matters_where_it_is_set(self):
        for index, mistake in ((0, "no_attn_softcap"), (0, "no_final_softcap"),
                               (2, "no_attn_softcap")):
            with self.subTest(model=self.models[index].name, mistake=mistake):
                self.check(index, mistake, mistakes={mistake})

    def test_null_caps_read_as_the_defaults_would_be_caught(self):
        # null is no capping; absent is Gemma2Config's 50 / 30 (a parser that treats null as
        # absent moves model 1's loss by about 300 times the tolerance, its gradients by 360
        # times the bound: measured).
        cfg = self.models[1].cfg
        wrong = {k: v for k, v in cfg.items()
                 if k not in ("attn_logit_softcapping", "final_logit_softcapping")}
        self.check(1, "null caps read as the defaults", cfg=wrong, grad_margin=100)

    def test_qk_norms_and_gemma3s_rope_rule_would_be_caught(self):
        for index in (0, 1):
            with self.subTest(model=self.models[index].name):
                self.check(index, "qk_norms", mistakes={"qk_norms"})
        self.check(1, "rope_scaling_only_on_full", mistakes={"rope_scaling_only_on_full"})

    def test_the_layer_pattern_and_the_window(self):
        for index in (0, 1):
            cfg = self.models[index].cfg
            inverted = [FULL if k == SLIDING else SLIDING for k in gemma2_layer_types(cfg)]
            for what, wrong in {"types inverted": dict(cfg, layer_types=inverted),
                                "window + 1": dict(cfg, sliding_window=WINDOW + 1)}.items():
                with self.subTest(model=self.models[index].name, mistake=what):
                    self.check(index, what, cfg=wrong)


# ---------------------------------------------------------------------------
# strata against the reference.

Fixture = base.ModelFixture("strata-hf-gemma2-", lambda: make_models(), 400, EVAL_TOKENS)


def tearDownModule():
    Fixture.cleanup()


@unittest.skipIf(torch is None, "torch is not importable")
@unittest.skipUnless(STRATA_CLI, base.NO_CLI)
class StrataEvalTest(unittest.TestCase):
    def test_eval_loss_equals_the_reference_for_every_model(self):
        for model in Fixture.get().models:
            with self.subTest(model=model.name):
                g3.check_eval(self, model)

    def test_at_a_sequence_no_longer_than_the_window(self):
        model = Fixture.get().models[0]
        for t in (WINDOW, WINDOW - 1):
            with self.subTest(t=t):
                g3.check_eval(self, model, t=t, b=2)


@unittest.skipIf(torch is None, "torch is not importable")
@unittest.skipUnless(STRATA_HF_GRADIENTS, base.NO_GRADIENTS)
class StrataGradientTest(unittest.TestCase):
    def test_every_parameter_gradient_equals_the_reference(self):
        f = Fixture.get()
        for model in f.models:
            with self.subTest(model=model.name):
                base.check_every_parameter_gradient(self, f.root, model, SEQ_LEN, MICRO_BATCH)

    def test_lora_adapters_on_every_projection(self):
        f = Fixture.get()
        model = f.models[0]
        lora = {"r": 3, "alpha": 6.0, "dropout": 0.0,
                "targets": [m for m, _ in base.LLAMA_LORA_MODULES]}
        adapter_dir = os.path.join(f.root, model.name + ".lora")
        # Gemma 3's adapter writer and module table read only the projections' shapes.
        adapters = g3.write_gemma3_lora_adapter(adapter_dir, model, lora, seed=43)
        paths = {m: path for m, path, _, _ in g3.gemma3_lora_modules(model.cfg)}
        base.check_lora_gradients(self, f.root, model, lora, adapter_dir, adapters,
                                  gemma2_lora_loss, paths, SEQ_LEN, MICRO_BATCH)


@unittest.skipIf(torch is None, "torch is not importable")
@unittest.skipUnless(STRATA_CLI, base.NO_CLI)
class StrataFineTuneTest(unittest.TestCase):
    """A Gemma 2 fine-tunes from its directory (loss drops), exports as gemma2 with the same
    tensor names and soft-capping, and the export re-evaluates to the checkpoint's loss and to
    the reference on the exported weights and config.json."""

    STEPS = 30

    def test_fine_tune_lowers_the_loss_and_exports_gemma2(self):
        # A cap of 3 on the logits bounds how low the loss can go (the logits span at most 6
        # nats), but a bigram pattern still falls well below the random start.
        model = g3.gemma3_model("ft_gemma2", gemma2_config(layers=2, heads=4, kv=2,
                                                          attn_cap=1.0, final_cap=3.0), seed=84)

        def check_config(out_cfg):
            self.assertEqual(out_cfg.get("model_type"), "gemma2")
            self.assertEqual(out_cfg.get("architectures"), ["Gemma2ForCausalLM"])
            self.assertEqual(out_cfg.get("attn_logit_softcapping"), 1.0)
            self.assertEqual(out_cfg.get("final_logit_softcapping"), 3.0)
            self.assertEqual(gemma2_layer_types(out_cfg), gemma2_layer_types(model.cfg))

        base.check_fine_tune_and_export(
            self, model, os.path.join(Fixture.get().root, "finetune"), self.STEPS, SEQ_LEN,
            MICRO_BATCH, gemma2_param_shapes(model.cfg), gemma2_loss, check_config)


@unittest.skipIf(torch is None, "torch is not importable")
@unittest.skipUnless(STRATA_CLI, base.NO_CLI)
class StrataBadInputTest(unittest.TestCase):
    def test_a_malformed_softcap_is_one_line_naming_the_field(self):
        f = Fixture.get()
        model = f.models[0]
        for key, value in (("attn_logit_softcapping", -1.0), ("final_logit_softcapping", "30")):
            with self.subTest(key=key):
                d = tempfile.mkdtemp(dir=f.root)
                shutil.rmtree(d)
                shutil.copytree(model.dir, d)
                with open(os.path.join(d, "config.json"), "w") as fh:
                    json.dump(dict(model.cfg, **{key: value}), fh)
                r = run([STRATA_CLI, "eval", "--model-dir", d, "--data", model.data,
                         "--seq-len", SEQ_LEN, "--micro-batch-size", MICRO_BATCH,
                         "--precision", "fp32", "--device", "host", "--json"])
                self.assertGreater(r.returncode, 0, r.stdout + r.stderr)
                err = r.stderr.strip()
                self.assertEqual(len(err.splitlines()), 1, err)
                self.assertIn("config.json", err)
                self.assertIn(key, err)


if __name__ == "__main__":
    if torch is None:
        print(f"SKIPPED: torch (or numpy) is not importable by {sys.executable} "
              f"({base._IMPORT_ERROR}); install python3-torch (Debian) to run the Hugging Face "
              "family tests")
        sys.exit(base.SKIP)
    unittest.main(verbosity=2)
