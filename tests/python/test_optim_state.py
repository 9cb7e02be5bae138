"""strata.optim.AdamW8bit and strata.optim.Adafactor against float64 references
written here from the published algorithms (cpu_optim/adamw8bit.h and
cpu_optim/adafactor.h state them), and their state_dicts round-tripping exactly."""

import copy
import math
import unittest

import torch

import strata.optim


def adafactor_reference(p, grads, lr, eps1, clip, decay, beta1, weight_decay):
    """Adafactor with a fixed lr in float64, formulas of cpu_optim/adafactor.h."""
    p = p.double().clone()
    factored = p.dim() >= 2
    if factored:
        rows, cols = p.numel() // p.shape[-1], p.shape[-1]
        r = torch.zeros(rows, dtype=torch.float64)
        c = torch.zeros(cols, dtype=torch.float64)
    else:
        v = torch.zeros_like(p)
    m = torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        beta2t = 1.0 - t ** decay
        u = g * g + eps1
        if factored:
            u2 = u.reshape(rows, cols)
            r = beta2t * r + (1 - beta2t) * u2.mean(dim=1)
            c = beta2t * c + (1 - beta2t) * u2.mean(dim=0)
            update = (torch.rsqrt(r / r.mean())[:, None] * torch.rsqrt(c)[None, :]).reshape(
                p.shape) * g
        else:
            v = beta2t * v + (1 - beta2t) * u
            update = torch.rsqrt(v) * g
        rms = update.pow(2).mean().sqrt().item()
        update = update * (lr / max(1.0, rms / clip))
        if beta1:
            m = beta1 * m + (1 - beta1) * update
            update = m
        if weight_decay:
            p = p * (1 - weight_decay * lr)
        p = p - update
    return p


class AdafactorTest(unittest.TestCase):
    def test_matches_a_float64_reference_of_the_formulas(self):
        torch.manual_seed(0)
        for shape in [(17, 23), (3, 4, 5), (41,)]:
            for beta1 in (None, 0.9):
                p0 = torch.randn(shape)
                grads = [torch.randn(shape) * 0.1 for _ in range(5)]
                p = p0.clone()
                opt = strata.optim.Adafactor([p], lr=1e-2, relative_step=False,
                                             scale_parameter=False, beta1=beta1,
                                             weight_decay=0.01)
                for g in grads:
                    p.grad = g.clone()
                    opt.step()
                want = adafactor_reference(p0, grads, 1e-2, 1e-30, 1.0, -0.8, beta1, 0.01)
                # fp32 element-wise arithmetic over 5 steps: a few ulp of the step size.
                torch.testing.assert_close(p.double(), want, rtol=1e-5, atol=1e-6)
                state = opt.state[p]
                if len(shape) >= 2:
                    self.assertEqual(tuple(state["exp_avg_sq_row"].shape),
                                     (math.prod(shape[:-1]),))
                    self.assertEqual(tuple(state["exp_avg_sq_col"].shape), (shape[-1],))
                else:
                    self.assertEqual(state["exp_avg_sq"].shape, p.shape)
                self.assertEqual("exp_avg" in state, beta1 is not None)


def adamw_reference(p, grads, lr, betas, eps, wd):
    """AdamW in float64 (the published algorithm the 8-bit optimizer approximates)."""
    p = p.double().clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        p = p * (1 - lr * wd)
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        denom = v.sqrt() / math.sqrt(1 - betas[1] ** t) + eps
        p = p - (lr / (1 - betas[0] ** t)) * m / denom
    return p


class AdamW8bitTest(unittest.TestCase):
    def test_tracks_float64_adamw_within_the_quantization_error(self):
        torch.manual_seed(1)
        p0 = torch.randn(5000)
        grads = [torch.randn(5000) * 0.1 for _ in range(10)]
        p = p0.clone()
        opt = strata.optim.AdamW8bit([p], lr=1e-3, weight_decay=0.01)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        want = adamw_reference(p0, grads, 1e-3, (0.9, 0.999), 1e-8, 0.01)
        moved = (want - p0.double()).abs()
        err = (p.double() - want).abs()
        # Each step moves an element by at most about lr; 8-bit moments (relative error
        # of the map's steps, about 1e-2 near the block's absmax) perturb the step by
        # a small fraction of it: after 10 steps every element is within 2.5e-3 of the
        # float64 AdamW path (10 lr's) and the mean error is far smaller.
        self.assertLess(err.max().item(), 2.5e-3)
        self.assertLess(err.mean().item(), 0.1 * moved.mean().item())
        state = opt.state[p]
        self.assertEqual(state["exp_avg"].dtype, torch.uint8)
        self.assertEqual(state["exp_avg"].shape, p.shape)
        self.assertEqual(tuple(state["exp_avg.absmax"].shape), (3,))

    def test_state_dict_round_trip_resumes_exactly(self):
        torch.manual_seed(2)
        for make in (lambda ps: strata.optim.AdamW8bit(ps, lr=1e-2),
                     lambda ps: strata.optim.Adafactor(ps, beta1=0.9)):
            a = [torch.randn(30, 70), torch.randn(2100)]
            b = [x.clone() for x in a]
            opt_a, opt_b = make(a), make(b)
            grads = [[torch.randn_like(x) for x in a] for _ in range(4)]
            for step in range(2):
                for x, y, g in zip(a, b, grads[step]):
                    x.grad, y.grad = g.clone(), g.clone()
                opt_a.step()
                opt_b.step()
            saved = copy.deepcopy(opt_b.state_dict())
            c = [x.clone() for x in b]
            opt_c = make(c)
            opt_c.load_state_dict(saved)
            for step in range(2, 4):
                for x, y, g in zip(a, c, grads[step]):
                    x.grad, y.grad = g.clone(), g.clone()
                opt_a.step()
                opt_c.step()
            for x, y in zip(a, c):
                self.assertTrue(torch.equal(x, y))
            for x, y in zip(a, c):
                for key, value in opt_a.state[x].items():
                    self.assertTrue(torch.equal(value, opt_c.state[y][key]), key)

    def test_a_state_of_another_layout_is_refused_before_anything_changes(self):
        p = torch.randn(100)
        opt = strata.optim.AdamW8bit([p])
        p.grad = torch.randn(100)
        opt.step()
        opt.state[p]["exp_avg"] = torch.zeros(100)  # fp32 where codes belong
        before = p.clone()
        with self.assertRaisesRegex(ValueError, "exp_avg"):
            opt.step()
        self.assertTrue(torch.equal(p, before))


class EmptyParameterTest(unittest.TestCase):
    def test_a_parameter_without_elements_is_left_out_and_the_rest_steps_as_alone(self):
        # A (0, 4) parameter beside a real one: torch.optim steps it as nothing; the 8-bit
        # and factored layouts have no state for it (the C API refuses a zero dimension).
        for cls in (strata.optim.AdamW8bit, strata.optim.Adafactor):
            with self.subTest(cls.__name__):
                torch.manual_seed(3)
                w, grad = torch.randn(64, 8), torch.randn(64, 8)
                with_empty = [torch.nn.Parameter(w.clone()), torch.nn.Parameter(torch.empty(0, 4))]
                alone = [torch.nn.Parameter(w.clone())]
                opt_a, opt_b = cls(with_empty), cls(alone)
                for _ in range(3):
                    with_empty[0].grad, with_empty[1].grad = grad.clone(), torch.empty(0, 4)
                    alone[0].grad = grad.clone()
                    opt_a.step()
                    opt_b.step()
                self.assertTrue(torch.equal(with_empty[0], alone[0]))
                self.assertNotIn(with_empty[1], opt_a.state)
                state = opt_a.state_dict()
                opt_c = cls([torch.nn.Parameter(w.clone()), torch.nn.Parameter(torch.empty(0, 4))])
                opt_c.load_state_dict(state)


if __name__ == "__main__":
    unittest.main()
