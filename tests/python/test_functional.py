"""strata.functional (gradient statistics, accumulation, conversions) against
torch computed in float64 or torch's own conversions."""

import math
import unittest

import torch

import strata
import strata.functional as F


def random_grad(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 5, (n,), generator=g).float())
    return x.to(dtype)


class GradStatsTest(unittest.TestCase):
    def test_sum_of_squares_matches_float64(self):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            with self.subTest(dtype=dtype):
                g = random_grad(100003, dtype, 1)
                stats = F.grad_stats(g, scale=0.5)
                expected = ((g.double() * 0.5) ** 2).sum().item()
                self.assertEqual(stats.num_elems, g.numel())
                self.assertFalse(stats.nonfinite)
                self.assertAlmostEqual(stats.sum_squares / expected, 1.0, delta=1e-12)

    def test_inf_and_nan_set_the_flag(self):
        for bad in (math.inf, -math.inf, math.nan):
            g = random_grad(5000, torch.bfloat16, 2)
            g[1234] = bad
            self.assertTrue(F.grad_stats(g).nonfinite)

    def test_bad_tensors_are_rejected(self):
        with self.assertRaisesRegex(TypeError, "float64"):
            F.grad_stats(torch.zeros(3, dtype=torch.float64))
        with self.assertRaisesRegex(ValueError, "not contiguous"):
            F.grad_stats(torch.zeros(4, 4).t())
        with self.assertRaisesRegex(ValueError, "finite"):
            F.grad_stats(torch.zeros(4), scale=math.inf)


class AccumulateTest(unittest.TestCase):
    def test_overwrite_then_add_in_fp32(self):
        a, b = random_grad(70001, torch.float16, 3), random_grad(70001, torch.float16, 4)
        accum = torch.full((70001,), 7.0)
        self.assertIsNone(F.accumulate_grad(accum, a, overwrite=True))
        self.assertTrue(torch.equal(accum, a.float()))
        stats = F.accumulate_grad(accum, b, want_stats=True)
        expected = a.float() + b.float()  # one fp32 rounding, as documented
        self.assertTrue(torch.equal(accum, expected))
        self.assertAlmostEqual(stats.sum_squares / (expected.double() ** 2).sum().item(), 1.0,
                               delta=1e-12)

    def test_size_mismatch_is_rejected(self):
        with self.assertRaisesRegex(ValueError, "elements"):
            F.accumulate_grad(torch.zeros(4), torch.zeros(5, dtype=torch.bfloat16))


class ConvertTest(unittest.TestCase):
    def test_round_trip_matches_torch_bit_for_bit(self):
        src = random_grad(50003, torch.float32, 5) * 1000
        src[0], src[1], src[2], src[3] = math.inf, -math.inf, 1e30, 1e-41
        for dtype in (torch.bfloat16, torch.float16):
            with self.subTest(dtype=dtype):
                out = F.from_f32(src, dtype)
                expected = src.to(dtype)
                self.assertTrue(torch.equal(out.view(torch.int16), expected.view(torch.int16)))
                back = F.to_f32(out)
                self.assertTrue(torch.equal(back.view(torch.int32),
                                            expected.float().view(torch.int32)))

    def test_nan_stays_nan(self):
        src = torch.tensor([math.nan, -math.nan, 1.0])
        for dtype in (torch.bfloat16, torch.float16):
            out = F.to_f32(F.from_f32(src, dtype))
            self.assertTrue(torch.isnan(out[:2]).all())
            self.assertEqual(out[2].item(), 1.0)

    def test_errors_come_back_as_exceptions(self):
        with self.assertRaisesRegex(ValueError, "out must be"):
            F.from_f32(torch.zeros(3), torch.bfloat16, out=torch.zeros(4, dtype=torch.bfloat16))
        # A C-level error: overlapping buffers, reported by libstrata with its message.
        buf = torch.zeros(8)
        with self.assertRaises(strata.StrataError) as ctx:
            F.accumulate_grad(buf[:4], buf[2:6])
        self.assertEqual(ctx.exception.status, "INVALID_ARGUMENT")
        self.assertIn("overlap", str(ctx.exception))


if __name__ == "__main__":
    unittest.main()
