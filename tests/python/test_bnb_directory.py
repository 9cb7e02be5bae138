"""`strata quantize` and bitsandbytes 4-bit directories (issue 45) against bnb_reference.py.

Tiny Llama directories (test_hf_families.py's helpers: random parameters, safetensors written by
hand) are quantized by `strata quantize`; the output is read back by hand and compared with
what bitsandbytes + transformers' save_pretrained store for the same model loaded with
BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type, bnb_4bit_use_double_quant):

- each projection of the layers (q/k/v/o, gate/up/down) as the parts of
  QuantState.as_dict(packed=True) under "X.weight." -- the packed codes under the weight's name
  (uint8 [ceil(n/2), 1]), absmax, quant_map, nested_absmax, nested_quant_map byte for byte equal
  to bnb_reference.quantize_4bit of the values rounded to the 16-bit type the model is loaded in
  (fp16 as it is, bf16 as it is, fp32 rounded to bf16), and quant_state.bitsandbytes__<type> a
  JSON object equal to bitsandbytes' (quant_type, blocksize, dtype, shape, nested_*);
- every other tensor (embeddings, norms, LM head) byte for byte as it was, in its dtype;
- config.json: the input's fields and transformers' BitsAndBytesConfig.to_dict() as
  quantization_config; the tokenizer files copied byte for byte;
- `strata eval` of the 4-bit directory equals (EVAL_REL_TOL) the float64 reference loss of the
  model with the reference-dequantized weights (fp32 values), and the eval of a 16-bit directory
  holding those weights rounded to bf16 within the effect of that rounding (measured on the
  float64 reference) plus EVAL_REL_TOL;
- a directory whose llm_int8_skip_modules keeps a projection in bf16 (Unsloth's dynamic 4-bit
  directories do) evaluates against the float64 reference with that tensor as stored, and the
  same whether held 4-bit or read dequantized, as a LoRA run over it is;
- refused, with one line on stderr and nothing written: a GPT-2 directory, an existing
  non-empty --out-dir, an input that is already 4-bit.

Sizes are odd on purpose: hidden 23 and intermediate 37 give tensors with a partial last block
of 64 and an odd number of values (a half-used last byte); one case has an intermediate size of
1001 so gate/up/down hold 360 blocks, two nested blocks of 256.

CLI tests SKIP without STRATA_CLI (an executable) or without bnb_reference.py beside this file
(issue 45's op branch); exits 77 (CTest SKIP_RETURN_CODE) when torch is not importable.
"""

import json
import os
import shutil
import struct
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
STRATA_CLI = base.STRATA_CLI
NO_CLI = base.NO_CLI
run = base.run

try:
    import bnb_reference as bnb
    NO_REFERENCE = None
except ImportError as _e:  # the op's branch has not been merged
    bnb = None
    NO_REFERENCE = f"bnb_reference.py is not importable ({_e})"

SEQ_LEN = 11
MICRO_BATCH = 3
EVAL_TOKENS = 7 * SEQ_LEN + 5

PROJECTIONS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
               "mlp.down_proj.weight")
TORCH_NAME = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
TOKENIZER_FILES = {"tokenizer.json": b'{"model": {"type": "BPE"}}',
                   "tokenizer_config.json": b'{"bos_token": "<s>"}'}


def is_quantized(name):
    """HfBaseQuantized for a Llama: the 2-D tensors of the layers."""
    return name.startswith("model.layers.") and name.endswith(PROJECTIONS)


def read_raw(path):
    """{name: (dtype, shape, bytes)} of a safetensors file, every range checked."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode())
    data = blob[8 + n:]
    header.pop("__metadata__", None)
    out = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        if not 0 <= begin <= end <= len(data):
            raise ValueError(f"{path}: tensor {name} has a bad byte range")
        out[name] = (e["dtype"], list(e["shape"]), data[begin:end])
    return out


def read_dir_raw(model_dir):
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.exists(index):
        return read_raw(os.path.join(model_dir, "model.safetensors"))
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    out = {}
    for shard in sorted(set(weight_map.values())):
        for name, v in read_raw(os.path.join(model_dir, shard)).items():
            if weight_map.get(name) == shard:
                out[name] = v
    return out


def rounded_for_quantization(values, storage):
    """The fp32 values bitsandbytes quantizes: the tensor as loaded in 16 bits."""
    to = torch.float16 if storage == "F16" else torch.bfloat16
    return values.to(to).to(torch.float32).reshape(-1)


def expected_quantization_config(quant, double_quant, compute):
    """transformers' BitsAndBytesConfig(load_in_4bit=True, ...).to_dict()."""
    return {"quant_method": "bitsandbytes", "_load_in_8bit": False, "_load_in_4bit": True,
            "llm_int8_threshold": 6.0, "llm_int8_skip_modules": None,
            "llm_int8_enable_fp32_cpu_offload": False, "llm_int8_has_fp16_weight": False,
            "bnb_4bit_quant_type": quant, "bnb_4bit_use_double_quant": double_quant,
            "bnb_4bit_compute_dtype": compute, "bnb_4bit_quant_storage": "uint8",
            "load_in_4bit": True, "load_in_8bit": False}


def small_llama(storage, intermediate=37):
    cfg = base.llama_config(layers=2, heads=4, kv_heads=2, tied=False,
                            torch_dtype=TORCH_NAME[storage])
    cfg["hidden_size"] = 23  # head_dim stays 6: q is (24, 23)
    cfg["intermediate_size"] = intermediate
    return cfg


def write_dir(path, cfg, params, storage, shards=1):
    base.write_model_dir(path, cfg, params, storage, shards)
    for name, data in TOKENIZER_FILES.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)


@unittest.skipIf(torch is None, "torch is not importable")
class QuantizeTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="strata-bnb-")

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def quantize(self, in_dir, out_dir, *flags):
        return run([STRATA_CLI, "quantize", "--model-dir", in_dir, "--out-dir", out_dir, *flags])

    def check_case(self, name, storage, quant, double_quant, intermediate=37, shards=1):
        cfg = small_llama(storage, intermediate)
        params = base.random_params(cfg, seed=len(name), storage=storage)
        in_dir = os.path.join(self.tmp, name)
        out_dir = os.path.join(self.tmp, name + "-4bit")
        write_dir(in_dir, cfg, params, storage, shards)
        r = self.quantize(in_dir, out_dir, "--quant", quant,
                          "--double-quant", "on" if double_quant else "off")
        self.assertEqual(r.returncode, 0, f"strata quantize failed:\n{r.stdout}\n{r.stderr}")
        self.assertEqual(len(r.stdout.strip().splitlines()), 1, r.stdout)
        self.assertIn(f"quantized {2 * len(PROJECTIONS)} tensors to {quant}", r.stdout)

        quantized_from = "F16" if storage == "F16" else "BF16"
        got = read_dir_raw(out_dir)
        stored_in = read_dir_raw(in_dir)
        dequantized = {}
        seen = set()
        for pname, values in params.items():
            if not is_quantized(pname):
                self.assertEqual(got[pname], stored_in[pname], pname)
                seen.add(pname)
                continue
            shape = list(values.shape)
            q = bnb.quantize_4bit(rounded_for_quantization(values, storage), quant, double_quant)
            parts = {pname: ("U8", list(q["weight"].shape), q["weight"].numpy().tobytes()),
                     pname + ".absmax": ("U8" if double_quant else "F32", list(q["absmax"].shape),
                                         q["absmax"].numpy().tobytes()),
                     pname + ".quant_map": ("F32", [16], q["quant_map"].numpy().tobytes())}
            if double_quant:
                parts[pname + ".nested_absmax"] = (
                    "F32", list(q["nested_absmax"].shape), q["nested_absmax"].numpy().tobytes())
                parts[pname + ".nested_quant_map"] = (
                    "F32", [256], q["nested_quant_map"].numpy().tobytes())
            for part, want in parts.items():
                self.assertIn(part, got)
                self.assertEqual(got[part][:2], want[:2], part)
                self.assertTrue(got[part][2] == want[2], f"{part}: bytes differ from bitsandbytes'")
            state_name = f"{pname}.quant_state.bitsandbytes__{quant}"
            dtype, state_shape, state_bytes = got[state_name]
            self.assertEqual((dtype, state_shape), ("U8", [len(state_bytes)]))
            state = json.loads(state_bytes.decode("utf-8"))
            want_state = {"quant_type": quant, "blocksize": 64,
                          "dtype": TORCH_NAME[quantized_from], "shape": shape}
            if double_quant:
                want_state.update({"nested_blocksize": 256, "nested_dtype": "float32",
                                   "nested_offset": q["nested_offset"]})
            self.assertEqual(state, want_state, state_name)
            self.assertEqual(list(state), list(want_state), "bitsandbytes' key order")
            seen.update(parts)
            seen.add(state_name)
            # bitsandbytes' dequantize_4bit returns the quant_state's dtype (what MatMul4Bit
            # then casts to the compute dtype).
            dequantized[pname] = bnb.dequantize_4bit(
                q, getattr(torch, TORCH_NAME[quantized_from])).to(F64).reshape(shape)
        self.assertEqual(sorted(got), sorted(seen), "tensors other than the model's")

        with open(os.path.join(in_dir, "config.json")) as f:
            cfg_in = json.load(f)
        with open(os.path.join(out_dir, "config.json")) as f:
            cfg_out = json.load(f)
        qc = cfg_out.pop("quantization_config")
        self.assertEqual(cfg_out, cfg_in)
        self.assertEqual(qc, expected_quantization_config(quant, double_quant,
                                                          TORCH_NAME[quantized_from]))
        for fname, data in TOKENIZER_FILES.items():
            with open(os.path.join(out_dir, fname), "rb") as f:
                self.assertEqual(f.read(), data, fname)
        self.assertEqual([e for e in os.listdir(self.tmp) if e.startswith(".")], [],
                         "a temporary directory was left behind")
        return cfg, params, dequantized, out_dir

    def check_eval(self, cfg, params, dequantized, out_dir):
        """eval of the 4-bit directory against the float64 reference of its dequantized weights,
        and against the eval of a bf16 directory holding them."""
        tokens = base.random_tokens(5, EVAL_TOKENS, cfg["vocab_size"])
        data = os.path.join(self.tmp, "eval.bin")
        base.write_tokens(data, tokens)
        x, y = base.windows(tokens, SEQ_LEN)
        fp32_params = dict(params, **dequantized)
        bf16_params = {n: t.to(torch.bfloat16).to(F64) for n, t in fp32_params.items()}
        ref = base.model_loss(cfg, fp32_params, x, y).item()
        ref_bf16 = base.model_loss(cfg, bf16_params, x, y).item()
        got = base.strata_eval(self, ["--model-dir", out_dir], data, SEQ_LEN, MICRO_BATCH)
        self.assertLessEqual(abs(got["loss"] - ref), EVAL_REL_TOL * abs(ref),
                             f"eval {got['loss']} vs the reference {ref}")
        bf16_dir = os.path.join(self.tmp, "dequantized-bf16")
        base.write_model_dir(bf16_dir, cfg, bf16_params, "BF16")
        got16 = base.strata_eval(self, ["--model-dir", bf16_dir], data, SEQ_LEN, MICRO_BATCH)
        bound = abs(ref - ref_bf16) + 2 * EVAL_REL_TOL * abs(ref)
        self.assertLessEqual(abs(got["loss"] - got16["loss"]), bound,
                             f"eval {got['loss']} vs the bf16 directory's {got16['loss']}")

    @unittest.skipIf(STRATA_CLI is None, NO_CLI)
    @unittest.skipIf(bnb is None, NO_REFERENCE)
    def test_bf16_nf4_double_quant_is_what_bitsandbytes_stores_and_evaluates(self):
        cfg, params, dequantized, out = self.check_case("bf16-nf4-dq", "BF16", "nf4", True)
        self.check_eval(cfg, params, dequantized, out)

    @unittest.skipIf(STRATA_CLI is None, NO_CLI)
    @unittest.skipIf(bnb is None, NO_REFERENCE)
    def test_fp16_fp4_without_double_quant_from_shards(self):
        cfg, params, dequantized, out = self.check_case("f16-fp4", "F16", "fp4", False,
                                                        shards=2)
        self.check_eval(cfg, params, dequantized, out)

    @unittest.skipIf(STRATA_CLI is None, NO_CLI)
    @unittest.skipIf(bnb is None, NO_REFERENCE)
    def test_fp32_is_rounded_to_bf16_and_two_nested_blocks(self):
        cfg, params, dequantized, out = self.check_case("f32-nf4-dq-wide", "F32", "nf4", True,
                                                        intermediate=1001)
        self.check_eval(cfg, params, dequantized, out)

    @unittest.skipIf(STRATA_CLI is None, NO_CLI)
    @unittest.skipIf(bnb is None, NO_REFERENCE)
    def test_a_projection_the_skip_list_keeps_in_16_bits(self):
        """A directory whose llm_int8_skip_modules keeps one projection in bf16 (as Unsloth's
        dynamic 4-bit directories do): `strata quantize`'s output with layer 0's down_proj stored
        back as the input's bf16 tensor. eval holds the rest in 4 bits and equals the float64
        reference within EVAL_REL_TOL, and equals the same directory read dequantized
        (--base-quant none) exactly; a LoRA step over it is the same, bit for bit, either way."""
        cfg, params, dequantized, out = self.check_case("bf16-nf4-skip", "BF16", "nf4", True)
        kept = "model.layers.0.mlp.down_proj.weight"
        raw = read_dir_raw(out)
        for name in list(raw):
            if name.startswith(kept + "."):
                del raw[name]
        raw[kept] = ("BF16", list(params[kept].shape), base.tensor_bytes(params[kept], "BF16"))
        header, blobs, offset = {}, [], 0
        for name, (dtype, shape, data) in raw.items():
            header[name] = {"dtype": dtype, "shape": shape,
                            "data_offsets": [offset, offset + len(data)]}
            blobs.append(data)
            offset += len(data)
        header["__metadata__"] = {"format": "pt"}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        with open(os.path.join(out, "model.safetensors"), "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
        with open(os.path.join(out, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"]["llm_int8_skip_modules"] = [
            "lm_head", "model.layers.0.mlp.down_proj"]
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(config, f)

        tokens = base.random_tokens(6, EVAL_TOKENS, cfg["vocab_size"])
        data = os.path.join(self.tmp, "eval-skip.bin")
        base.write_tokens(data, tokens)
        x, y = base.windows(tokens, SEQ_LEN)
        weights = dict(params, **dequantized)
        weights[kept] = params[kept].to(F64)
        ref = base.model_loss(cfg, weights, x, y).item()
        got = base.strata_eval(self, ["--model-dir", out], data, SEQ_LEN, MICRO_BATCH)
        self.assertLessEqual(abs(got["loss"] - ref), EVAL_REL_TOL * abs(ref),
                             f"eval {got['loss']} vs the reference {ref}")
        plain = base.strata_eval(self, ["--model-dir", out], data, SEQ_LEN, MICRO_BATCH,
                                 extra=["--base-quant", "none"])
        self.assertEqual(got["loss"], plain["loss"])
        # ... and not by accident: with that projection in 4 bits the loss is another.
        ref_4bit = base.model_loss(cfg, dict(params, **dequantized), x, y).item()
        self.assertGreater(abs(ref - ref_4bit), 4 * EVAL_REL_TOL * abs(ref))

        for name in TOKENIZER_FILES:  # placeholders, not tokenizers training could load
            os.remove(os.path.join(out, name))
        hashes = []
        for quant in ("auto", "none"):
            summary = os.path.join(self.tmp, f"lora-{quant}.json")
            r = run([STRATA_CLI, "train", "--model-dir", out, "--data", data, "--val-data", data,
                     "--device", "host",
                     "--seq-len", SEQ_LEN, "--micro-batch-size", MICRO_BATCH, "--steps", 2,
                     "--lora-rank", 2, "--lora-targets", "down_proj,q_proj", "--base-quant",
                     quant, "--precision", "bf16", "--eval-every", 0, "--sample-bytes", 0,
                     "--log-every", 0, "--summary-json", summary])
            self.assertEqual(r.returncode, 0, f"{r.stdout}\n{r.stderr}")
            with open(summary) as f:
                hashes.append(json.load(f)["master_xxh3"])
        self.assertEqual(hashes[0], hashes[1])

    def expect_refused(self, r, *needles):
        self.assertNotEqual(r.returncode, 0, r.stdout)
        lines = r.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, r.stderr)
        for n in needles:
            self.assertIn(n, lines[0])

    @unittest.skipIf(STRATA_CLI is None, NO_CLI)
    def test_refuses_gpt2_an_existing_output_and_a_4bit_input(self):
        gpt_cfg = base.gpt2_config(layers=2)
        gpt_dir = os.path.join(self.tmp, "gpt2")
        base.write_model_dir(gpt_dir, gpt_cfg, base.random_params(gpt_cfg, 3))
        self.expect_refused(self.quantize(gpt_dir, os.path.join(self.tmp, "g4")), "gpt2")

        cfg = small_llama("BF16")
        in_dir = os.path.join(self.tmp, "llama")
        write_dir(in_dir, cfg, base.random_params(cfg, 4, "BF16"), "BF16")
        busy = os.path.join(self.tmp, "busy")
        os.makedirs(busy)
        with open(os.path.join(busy, "keep"), "w") as f:
            f.write("x")
        self.expect_refused(self.quantize(in_dir, busy), busy, "not an empty directory")
        self.assertEqual(os.listdir(busy), ["keep"])

        out = os.path.join(self.tmp, "llama-4bit")
        r = self.quantize(in_dir, out)  # defaults: nf4, double quantization
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(out, "config.json")) as f:
            qc = json.load(f)["quantization_config"]
        self.assertEqual((qc["bnb_4bit_quant_type"], qc["bnb_4bit_use_double_quant"]),
                         ("nf4", True))
        self.expect_refused(self.quantize(out, os.path.join(self.tmp, "again")),
                            "already a 4-bit directory")
        self.expect_refused(self.quantize(in_dir, os.path.join(self.tmp, "x"), "--quant", "int4"),
                            "--quant")
        self.assertEqual(sorted(os.listdir(self.tmp)), ["busy", "gpt2", "llama", "llama-4bit"])


if __name__ == "__main__":
    if torch is None:
        print(f"SKIPPED: torch (or numpy) is not importable by {sys.executable} "
              f"({base._IMPORT_ERROR}); install python3-torch (Debian) to run the 4-bit "
              "directory tests")
        sys.exit(SKIP)
    unittest.main(verbosity=2)
