"""Strata's 4-bit quantization (models/ops/quantize_4bit.h) against bitsandbytes' rules, element
by element.

The reference is bnb_reference.py (bitsandbytes' CUDA kernels and functional.py re-derived in
numpy float32, independently of the C++). The test binary quantize_4bit_dump (tests/models,
path in STRATA_QUANTIZE_4BIT_DUMP) quantizes raw fp32 files and writes Strata's packed record
and its dequantized fp32, bf16 and fp16 values; for each input, both quantization types, with
and without double quantization, this test checks

- the record's layout (the parts' offsets as quantize_4bit.h describes them, zero padding);
- the packed codes, the absmax (fp32, or the 8-bit codes with the nested fp32 absmax and the
  offset) against the reference's dict, byte for byte and bit for bit;
- the dequantized values in fp32, bf16 and fp16 against the reference's, bit for bit;

on random normal weights (bf16-rounded) of sizes with partial blocks and odd n, heavy-tailed
weights, tensors with all-zero blocks, values one and a few ulps around every NF4/FP4 decision
threshold times several absmax values, nested absmax values around every midpoint of the
dynamic map, subnormals and wide ranges. DynamicMap8 and Quant4Map are compared with
create_dynamic_map() and get_4bit_type(), bit for bit.

The reference's self-checks (its trees pick the nearest table value, its tables are
bitsandbytes') run without the binary; the rest SKIP without STRATA_QUANTIZE_4BIT_DUMP. Exits 77
(CTest SKIP_RETURN_CODE) when torch or numpy is not importable.
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest

try:
    import numpy as np
    import torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bnb_reference as bnb
except ImportError as _e:  # the __main__ block reports this and exits 77
    np = torch = bnb = None
    _IMPORT_ERROR = _e

SKIP = 77
DUMP = os.environ.get("STRATA_QUANTIZE_4BIT_DUMP")
F32 = None if np is None else np.float32

# bitsandbytes' decision thresholds (dQuantizeNF4; dQuantizeFP4 on |x|), its literals' decimals.
NF4_THRESHOLDS = ("0.03979014977812767", "0.3893125355243683", "0.6427869200706482",
                  "0.8614784181118011", "0.5016634166240692", "0.2035212516784668",
                  "0.2920137718319893", "0.1202552504837513", "-0.33967943489551544",
                  "-0.13791173323988914", "-0.045525018125772476", "-0.23460740596055984",
                  "-0.6106329262256622", "-0.4599952697753906", "-0.8480964004993439")
FP4_THRESHOLDS = ("0.29166667", "0.583333", "0.8333333", "0.4166667", "0.0859375", "0.20833333",
                  "0.00260417")


def record_layout(n, double_quant):
    """The parts of Strata's record, as quantize_4bit.h describes them (16-byte aligned)."""
    def align(x):
        return (x + 15) // 16 * 16
    blocks = -(-n // 64)
    lay = {"n": n, "blocks": blocks, "codes_offset": 0, "codes_bytes": (n + 1) // 2}
    lay["absmax_offset"] = align(lay["codes_bytes"])
    if not double_quant:
        lay.update(absmax_bytes=4 * blocks, nested_blocks=0, nested_absmax_offset=0,
                   nested_absmax_bytes=0, offset_offset=0)
        lay["total_bytes"] = align(lay["absmax_offset"] + lay["absmax_bytes"])
        return lay
    nested_blocks = -(-blocks // 256)
    lay.update(absmax_bytes=blocks, nested_blocks=nested_blocks,
               nested_absmax_bytes=4 * nested_blocks)
    lay["nested_absmax_offset"] = align(lay["absmax_offset"] + blocks)
    lay["offset_offset"] = align(lay["nested_absmax_offset"] + 4 * nested_blocks)
    lay["total_bytes"] = lay["offset_offset"] + 16
    return lay


def bf16_rounded(x):
    return torch.from_numpy(np.asarray(x, dtype=F32)).to(torch.bfloat16).float().numpy()


def bits32(a):
    return np.asarray(a, dtype=F32).view(np.uint32)


class StrataRun:
    """quantize_4bit_dump's outputs for one input."""

    def __init__(self, x, quant_type, double_quant):
        x = np.ascontiguousarray(x, dtype=F32)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "x.f32")
            x.tofile(path)
            prefix = os.path.join(d, "out")
            proc = subprocess.run(
                [DUMP, "quantize", quant_type, "1" if double_quant else "0", path, prefix],
                capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise AssertionError(f"quantize_4bit_dump failed: {proc.stderr}")
            self.layout = json.loads(proc.stdout)
            self.record = np.fromfile(prefix + ".record", dtype=np.uint8)
            self.f32 = np.fromfile(prefix + ".f32", dtype=np.uint32)
            self.bf16 = np.fromfile(prefix + ".bf16", dtype=np.uint16)
            self.fp16 = np.fromfile(prefix + ".fp16", dtype=np.uint16)

    def part(self, name, dtype):
        off = self.layout[name + "_offset"]
        size = self.layout[name + "_bytes"]
        return self.record[off:off + size].view(dtype)


class ReferenceSelfCheck(unittest.TestCase):
    """bnb_reference's tables and trees, without Strata."""

    def test_tables_are_bitsandbytes(self):
        nf4 = bnb.get_4bit_type("nf4").numpy()
        self.assertEqual(nf4[0], -1.0)
        self.assertEqual(nf4[15], 1.0)
        self.assertTrue(np.all(np.diff(nf4) > 0))
        fp4 = bnb.get_4bit_type("fp4").numpy()
        expected = np.array([0, 0.0625, 8, 12, 4, 6, 2, 3], dtype=F32) / F32(12)
        np.testing.assert_array_equal(bits32(fp4[:8]), bits32(expected))
        np.testing.assert_array_equal(bits32(fp4[8:]), bits32(-expected + F32(0)))  # +0 at 8
        np.testing.assert_array_equal(bits32(bnb.kernel_table("nf4")), bits32(nf4))
        kernel = bnb.kernel_table("fp4")
        np.testing.assert_array_equal(kernel, fp4)  # equal values ...
        self.assertTrue(np.signbit(kernel[8]) and not np.signbit(fp4[8]))  # ... but -0 at 8
        dyn = bnb.create_dynamic_map().numpy()
        self.assertEqual(dyn.size, 256)
        self.assertTrue(np.all(np.diff(dyn) > 0))
        self.assertEqual(dyn[127], 0.0)
        self.assertEqual(dyn[255], 1.0)

    def test_thresholds_are_the_midpoints_of_neighbours(self):
        for name, table, thresholds in (
                ("nf4", bnb.get_4bit_type("nf4").numpy().astype(np.float64), NF4_THRESHOLDS),
                ("fp4", np.sort(np.abs(bnb.get_4bit_type("fp4").numpy()[:8])).astype(np.float64),
                 FP4_THRESHOLDS)):
            midpoints = (table[1:] + table[:-1]) / 2
            for t in thresholds:
                self.assertLess(np.min(np.abs(midpoints - float(t))), 1e-6, (name, t))
        # A literal is rounded once: four NF4 thresholds are one ulp from float32(float(t)).
        twice = sum(bnb.f32_literal(t) != F32(float(t)) for t in NF4_THRESHOLDS)
        self.assertEqual(twice, 4)
        self.assertEqual(bnb.f32_literal("0.8614784181118011"), F32(float.fromhex("0x1.b913b2p-1")))

    def test_trees_pick_the_nearest_value(self):
        rng = np.random.default_rng(0)
        x = rng.uniform(-1, 1, 20000).astype(F32)
        for quant_type, codes in (("nf4", bnb._nf4_codes(x)), ("fp4", bnb._fp4_codes(x))):
            table = bnb.get_4bit_type(quant_type).numpy().astype(np.float64)
            dist = np.abs(x.astype(np.float64)[:, None] - table[None, :])
            best = dist.min(axis=1)
            chosen = dist[np.arange(x.size), codes]
            # Ties within the literals' precision of a midpoint may go either way.
            self.assertTrue(np.all(chosen - best <= 2e-6), quant_type)
        code = bnb.create_dynamic_map().numpy()
        q = bnb._dynamic_codes(x, code)
        dist = np.abs(x.astype(np.float64)[:, None] - code.astype(np.float64)[None, :])
        chosen = dist[np.arange(x.size), q]
        self.assertTrue(np.all(chosen - dist.min(axis=1) <= 1e-7))

    def test_table_values_round_trip(self):
        for quant_type in ("nf4", "fp4"):
            table = bnb.get_4bit_type(quant_type).numpy()
            x = np.tile(table, 8) * F32(0.25)
            q = bnb.quantize_4bit(x, quant_type, double_quant=False)
            y = bnb.dequantize_4bit(q).numpy()
            np.testing.assert_array_equal(y, x)

    def test_zero_block_codes(self):
        q = bnb.quantize_4bit(np.zeros(65, dtype=F32), "nf4", double_quant=False)
        self.assertTrue(np.all(q["weight"].numpy() == 0))  # 0 * (1/0) = NaN -> code 0
        self.assertTrue(np.all(np.signbit(bnb.dequantize_4bit(q).numpy())))  # -1.0 * 0 = -0.0


@unittest.skipUnless(DUMP, "STRATA_QUANTIZE_4BIT_DUMP (the quantize_4bit_dump binary) not set")
class StrataAgainstReference(unittest.TestCase):

    def check(self, x, label):
        x = np.asarray(x, dtype=F32)
        for quant_type in ("nf4", "fp4"):
            for double_quant in (False, True):
                with self.subTest(case=label, n=x.size, quant_type=quant_type,
                                  double_quant=double_quant):
                    self.check_one(x, quant_type, double_quant)

    def check_one(self, x, quant_type, double_quant):
        run = StrataRun(x, quant_type, double_quant)
        lay = record_layout(x.size, double_quant)
        self.assertEqual(run.layout, lay)
        self.assertEqual(run.record.size, lay["total_bytes"])
        ref = bnb.quantize_4bit(x, quant_type, double_quant)

        # The record, part by part, and zeros between the parts.
        used = np.zeros(run.record.size, dtype=bool)
        codes = run.part("codes", np.uint8)
        used[:lay["codes_bytes"]] = True
        np.testing.assert_array_equal(codes, ref["weight"].numpy().reshape(-1))
        off = lay["absmax_offset"]
        used[off:off + lay["absmax_bytes"]] = True
        if not double_quant:
            np.testing.assert_array_equal(run.part("absmax", np.uint32),
                                          bits32(ref["absmax"].numpy()))
        else:
            np.testing.assert_array_equal(run.part("absmax", np.uint8), ref["absmax"].numpy())
            np.testing.assert_array_equal(run.part("nested_absmax", np.uint32),
                                          bits32(ref["nested_absmax"].numpy()))
            off = lay["nested_absmax_offset"]
            used[off:off + lay["nested_absmax_bytes"]] = True
            off = lay["offset_offset"]
            used[off:off + 4] = True
            self.assertEqual(run.record[off:off + 4].view(np.uint32)[0],
                             bits32(F32(ref["nested_offset"])))
        self.assertTrue(np.all(run.record[~used] == 0), "padding bytes are not zero")

        # The dequantized values in each storage type, bit for bit.
        np.testing.assert_array_equal(run.f32, bits32(bnb.dequantize_4bit(ref).numpy()))
        np.testing.assert_array_equal(
            run.bf16, bnb.dequantize_4bit(ref, torch.bfloat16).view(torch.int16).numpy()
            .view(np.uint16))
        np.testing.assert_array_equal(
            run.fp16, bnb.dequantize_4bit(ref, torch.float16).view(torch.int16).numpy()
            .view(np.uint16))

    def test_random_normal_weights(self):
        rng = np.random.default_rng(1)
        for n in (1, 2, 3, 63, 64, 65, 127, 128, 129, 1001, 64 * 256, 64 * 256 + 1,
                  64 * 256 * 2 + 333):
            self.check(bf16_rounded(rng.normal(0, 0.02, n)), "normal")

    def test_heavy_tails(self):
        rng = np.random.default_rng(2)
        for n in (4097, 64 * 256 * 3 + 5):
            x = rng.standard_t(2, n) * 0.02
            x[rng.integers(0, n, 20)] *= 1000
            self.check(bf16_rounded(x), "student-t")

    def test_zero_blocks(self):
        rng = np.random.default_rng(3)
        self.check(np.zeros(64 * 3 + 7, dtype=F32), "all zero")
        x = bf16_rounded(rng.normal(0, 0.02, 64 * 300 + 9))
        x[64 * 5:64 * 6] = 0          # an all-zero block
        x[64 * 300:] = 0              # the partial last block zero
        x[64 * 7:64 * 8] = -0.0       # negative zeros
        self.check(x, "zero blocks")

    def test_neighbours_of_the_decision_thresholds(self):
        # One block per (absmax a, threshold t, sign): a (the block's absmax), then t * a and the
        # values 1, 2 and 3 ulps either side, so that the normalized values straddle t.
        around = 7
        for quant_type, thresholds in (("nf4", NF4_THRESHOLDS), ("fp4", FP4_THRESHOLDS)):
            blocks = []
            for a in (1.0, 3.0, 0.0234375, 0.017578125, 1.5 * 2.0 ** -10, 0.1, 7.7e-3, 123.456):
                a = F32(a)
                for t in thresholds:
                    for s in ((1,) if quant_type == "nf4" else (1, -1)):
                        centre = F32(bnb.f32_literal(t) * a) * F32(s)
                        values = [centre]
                        lo = hi = centre
                        for _ in range((around - 1) // 2):
                            lo = np.nextafter(lo, F32(-np.inf), dtype=F32)
                            hi = np.nextafter(hi, F32(np.inf), dtype=F32)
                            values += [lo, hi]
                        block = np.zeros(64, dtype=F32)
                        block[0] = a
                        block[1:1 + around] = np.sort(np.array(values, dtype=F32))
                        blocks.append(block)
            x = np.concatenate(blocks)
            for double_quant in (False, True):
                with self.subTest(quant_type=quant_type, double_quant=double_quant):
                    self.check_one(x, quant_type, double_quant)
            # Not vacuous: in every block the values get two codes (they straddle t).
            packed = bnb.quantize_4bit(x, quant_type, False)["weight"].numpy().reshape(-1)
            codes = np.stack([packed >> 4, packed & 0x0F], axis=1).reshape(-1, 64)
            for b, block_codes in enumerate(codes):
                self.assertEqual(len(np.unique(block_codes[1:1 + around])), 2,
                                 f"{quant_type} block {b}")

    def test_neighbours_of_the_dynamic_map_midpoints(self):
        # Block absmax values offset +- v with offset = 1 (their mean, exactly) and v around
        # m * D for every midpoint m of the map, D = 0.5 the largest |v| (in every nested block),
        # so the nested normalized values (a - offset) / D straddle every midpoint.
        code = bnb.create_dynamic_map().numpy().astype(np.float64)
        midpoints = (code[1:] + code[:-1]) / 2
        offset, d = F32(1.0), F32(0.5)
        pairs = []
        for m in midpoints[midpoints > 0]:
            centre = F32(offset + F32(m * d))
            for a in (np.nextafter(centre, F32(0), dtype=F32), centre,
                      np.nextafter(centre, F32(2), dtype=F32)):
                pairs.append(a)
        absmax = []
        for i in range(0, len(pairs), 127):
            absmax += [offset + d, offset - d]
            for a in pairs[i:i + 127]:
                absmax += [a, F32(2) - a]  # offset - v, exact
        absmax = np.array(absmax, dtype=F32)
        self.assertEqual(bnb.absmax_mean(absmax), offset)
        x = np.zeros((absmax.size, 64), dtype=F32)
        x[:, 0] = absmax
        x = x.reshape(-1)
        for quant_type in ("nf4", "fp4"):
            with self.subTest(quant_type=quant_type):
                self.check_one(x, quant_type, True)
        q = bnb.quantize_4bit(x, "nf4", True)["absmax"].numpy()
        self.assertGreater(len(np.unique(q)), 200)  # most of the map's codes are hit

    def test_subnormals_and_wide_ranges(self):
        rng = np.random.default_rng(4)
        n = 64 * 200 + 3
        x = (rng.choice([-1.0, 1.0], n) * np.exp2(rng.uniform(-149, 127, n))).astype(F32)
        x[64 * 3:64 * 4] = (np.exp2(rng.uniform(-149, -127, 64)) * rng.choice([-1, 1], 64))
        x[64 * 4:64 * 5] *= F32(2.0 ** -100)
        self.check(x, "wide ranges")

    def test_maps_are_bitsandbytes(self):
        with tempfile.TemporaryDirectory() as d:
            prefix = os.path.join(d, "maps")
            subprocess.run([DUMP, "maps", prefix], check=True)
            nf4 = np.fromfile(prefix + ".nf4", dtype=np.uint32)
            fp4 = np.fromfile(prefix + ".fp4", dtype=np.uint32)
            map8 = np.fromfile(prefix + ".map8", dtype=np.uint32)
        np.testing.assert_array_equal(nf4, bits32(bnb.get_4bit_type("nf4").numpy()))
        np.testing.assert_array_equal(fp4, bits32(bnb.get_4bit_type("fp4").numpy()))
        np.testing.assert_array_equal(map8, bits32(bnb.create_dynamic_map().numpy()))


if __name__ == "__main__":
    if np is None:
        print(f"SKIPPED: torch (or numpy) is not importable by {sys.executable} "
              f"({_IMPORT_ERROR}); install python3-torch (Debian) to run the 4-bit reference test")
        sys.exit(SKIP)
    unittest.main(verbosity=2)
