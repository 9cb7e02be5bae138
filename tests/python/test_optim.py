"""strata.optim.AdamW / Adam / Adagrad / SGD against their torch.optim twins, and
strata.optim.Lion against a float64 implementation of the paper's update.

Comparison rule (assert_close): element-wise relative error <= 1e-5, where the
relative error of an element is |strata - torch| / max(|torch|, floor), and floor
is 5% of the largest magnitude of that quantity (the weights, or one kind of
state tensor: exp_avg, exp_avg_sq, max_exp_avg_sq, sum, momentum_buffer) over all
parameter tensors of the problem: elements below it are held to an
absolute error of 5e-7 x that largest magnitude (about 4 fp32 ulps of it). The
floor is for elements that end small by cancellation (a weight crossing zero, a
first moment of gradients of alternating sign): their rounding error is relative
to the size of the terms that cancelled (~|g|), not to the small result. Measured
on these problems, strata and torch are each up to ~1e-5 (relative, 1% floor)
away from a float64 run in such elements, so the two fp32 results cannot be held
closer to each other than to the exact one; test_as_close_to_float64_as_torch
checks that strata is no farther from float64 than torch is. Both implementations
compute the same formulas in fp32 but round in different places (torch keeps lr
and the betas as Python floats until the kernel; strata derives its per-step
scalars in fp64 from fp32 hyper-parameters), so bit equality is not expected.
"""

import copy
import os
import unittest
import unittest.mock

import torch

import strata
import strata.optim

REL_TOL = 1e-5
FLOOR_FRACTION = 5e-2
SHAPES = [(1,), (67,), (33, 17), (4099,), (3, 5, 7)]


def worst_rel_error(actual, expected, floor):
    denom = expected.abs().clamp_min(max(floor, 1e-30))
    return ((actual - expected).abs() / denom).max().item()


def floor_of(tensors):
    return FLOOR_FRACTION * max(t.abs().max().item() for t in tensors)


def make_params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def make_grads(gen, params, dtype, zeros=True):
    """Gradients of a random scale per step, with an exact zero every 13 elements
    when zeros. (Not with Adam's L2 decay: there a weight whose data gradient is
    zero oscillates around 0 by +-lr per step, a cycle in which any two fp32
    implementations diverge in the last bits: strata and torch are then both
    ~1e-6 away from float64 and from each other.)"""
    scale = float(torch.empty(()).uniform_(0.25, 1.0, generator=gen))
    grads = []
    for p in params:
        g = torch.randn(p.shape, generator=gen) * scale
        if zeros:
            g.view(-1)[::13] = 0.0
        grads.append(g.to(dtype))
    return grads


def leaves(values):
    return [torch.nn.Parameter(v.clone()) for v in values]


class OptimizerTwinTest(unittest.TestCase):
    def assert_close(self, actual, expected, floor, what):
        err = worst_rel_error(actual, expected, floor)
        self.assertLessEqual(err, REL_TOL, f"{what}: worst relative error {err:.3g}")

    def assert_same_state(self, a_opt, b_opt, a_params, b_params, what):
        """Weights and every state entry of b_opt (the reference) match a_opt's:
        same keys, same step counts, tensors within the comparison rule."""
        floors = {"param": floor_of([p.detach() for p in b_params])}
        keys = [k for k, v in b_opt.state[b_params[0]].items() if k != "step"]
        self.assertTrue(keys or isinstance(b_opt, torch.optim.SGD), f"{what}: no state")
        for key in keys:
            if torch.is_tensor(b_opt.state[b_params[0]][key]):
                floors[key] = floor_of([b_opt.state[p][key] for p in b_params])
        for i, (pa, pb) in enumerate(zip(a_params, b_params)):
            self.assert_close(pa.detach(), pb.detach(), floors["param"], f"{what} param {i}")
            sa, sb = a_opt.state[pa], b_opt.state[pb]
            self.assertEqual(sa.keys(), sb.keys(), f"{what} param {i}")
            if "step" in sb:
                self.assertEqual(float(sa["step"]), float(sb["step"]))
            for key in keys:
                if sb[key] is None:
                    self.assertIsNone(sa[key], f"{what} param {i} {key}")
                else:
                    self.assert_close(sa[key], sb[key], floors[key], f"{what} param {i} {key}")

    def step_both(self, s_opt, t_opt, s_params, t_params, grads):
        """One step of each: strata gets grads as they are (16-bit through
        step(grads=...)), torch gets them widened to fp32 as p.grad."""
        for p, g in zip(t_params, grads):
            p.grad = g.float()
        t_opt.step()
        if grads[0].dtype == torch.float32:
            for p, g in zip(s_params, grads):
                p.grad = g.clone()
            s_opt.step()
        else:
            s_opt.step(grads=grads)

    def run_twins(self, strata_cls, torch_cls, kwargs, grad_dtype, steps=100, seed=0,
                  lr_schedule=None):
        values = make_params(seed)
        s_params, t_params = leaves(values), leaves(values)
        # Two param groups with different learning rates, as a fine-tuning setup.
        groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": kwargs["lr"] * 0.5}]
        s_opt = strata_cls(groups(s_params), **kwargs)
        t_opt = torch_cls(groups(t_params), **kwargs)
        gen = torch.Generator().manual_seed(seed + 1)
        for step in range(steps):
            if lr_schedule is not None:
                for opt in (s_opt, t_opt):
                    for group in opt.param_groups:
                        group["lr"] *= lr_schedule
            grads = make_grads(gen, values, grad_dtype, zeros=torch_cls is not torch.optim.Adam)
            self.step_both(s_opt, t_opt, s_params, t_params, grads)
            if step % 10 == 9:
                self.assert_same_state(s_opt, t_opt, s_params, t_params, f"step {step + 1}")
        return s_opt, t_opt, s_params, t_params

    def test_adamw_matches_torch_over_100_steps_fp32_grads(self):
        self.run_twins(strata.optim.AdamW, torch.optim.AdamW,
                       dict(lr=2e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
                       torch.float32)

    def test_adamw_matches_torch_over_100_steps_bf16_grads(self):
        self.run_twins(strata.optim.AdamW, torch.optim.AdamW,
                       dict(lr=5e-3, betas=(0.85, 0.99), eps=1e-7, weight_decay=0.05),
                       torch.bfloat16, seed=3)

    def test_adamw_matches_torch_with_fp16_grads_and_lr_schedule(self):
        self.run_twins(strata.optim.AdamW, torch.optim.AdamW,
                       dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.2),
                       torch.float16, seed=5, lr_schedule=0.98)

    def test_adam_matches_torch_over_100_steps_fp32_grads(self):
        self.run_twins(strata.optim.Adam, torch.optim.Adam,
                       dict(lr=1e-2, betas=(0.7, 0.9), eps=1e-5, weight_decay=0.03),
                       torch.float32, seed=7)

    def test_adam_matches_torch_over_100_steps_bf16_grads(self):
        self.run_twins(strata.optim.Adam, torch.optim.Adam,
                       dict(lr=3e-3, betas=(0.95, 0.995), eps=1e-6, weight_decay=0.01),
                       torch.bfloat16, seed=9)

    def test_adamw_amsgrad_matches_torch(self):
        self.run_twins(strata.optim.AdamW, torch.optim.AdamW,
                       dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1,
                            amsgrad=True), torch.float32, seed=13)

    def test_adamw_maximize_and_amsgrad_match_torch_bf16_grads(self):
        self.run_twins(strata.optim.AdamW, torch.optim.AdamW,
                       dict(lr=5e-3, betas=(0.85, 0.99), eps=1e-7, weight_decay=0.05,
                            maximize=True), torch.bfloat16, seed=15)
        self.run_twins(strata.optim.AdamW, torch.optim.AdamW,
                       dict(lr=5e-3, betas=(0.9, 0.97), weight_decay=0.02, amsgrad=True,
                            maximize=True), torch.float16, seed=16)

    def test_adam_amsgrad_and_maximize_match_torch(self):
        self.run_twins(strata.optim.Adam, torch.optim.Adam,
                       dict(lr=1e-2, betas=(0.7, 0.9), eps=1e-5, weight_decay=0.03,
                            amsgrad=True), torch.float32, seed=17)
        self.run_twins(strata.optim.Adam, torch.optim.Adam,
                       dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01,
                            amsgrad=True, maximize=True), torch.bfloat16, seed=18)

    def test_adagrad_matches_torch_over_100_steps(self):
        kwargs = dict(lr=5e-2, lr_decay=1e-2, weight_decay=0.02, initial_accumulator_value=0.1,
                      eps=1e-6)
        self.run_twins(strata.optim.Adagrad, torch.optim.Adagrad, kwargs, torch.float32,
                       seed=19)
        self.run_twins(strata.optim.Adagrad, torch.optim.Adagrad, dict(kwargs, maximize=True),
                       torch.bfloat16, seed=20)

    def test_sgd_momentum_dampening_matches_torch_over_100_steps(self):
        self.run_twins(strata.optim.SGD, torch.optim.SGD,
                       dict(lr=2e-2, momentum=0.9, dampening=0.2, weight_decay=0.01),
                       torch.float32, seed=23)

    def test_sgd_nesterov_maximize_matches_torch_over_100_steps(self):
        self.run_twins(strata.optim.SGD, torch.optim.SGD,
                       dict(lr=1e-2, momentum=0.8, nesterov=True, weight_decay=0.05,
                            maximize=True), torch.bfloat16, seed=24)
        self.run_twins(strata.optim.SGD, torch.optim.SGD,
                       dict(lr=1e-2, momentum=0.7, nesterov=True), torch.float16, seed=25)

    def test_sgd_without_momentum_matches_torch(self):
        self.run_twins(strata.optim.SGD, torch.optim.SGD,
                       dict(lr=3e-2, weight_decay=0.1, maximize=True), torch.float32, seed=26,
                       lr_schedule=0.97)

    def test_sgd_keeps_its_momentum_buffer_through_steps_without_momentum(self):
        """momentum 0.9, then 0 for two steps, then 0.9 again (a param_groups edit):
        torch keeps the buffer, untouched, while momentum is 0 and goes on from it."""
        values = make_params(27)
        s_params, t_params = leaves(values), leaves(values)
        s_opt = strata.optim.SGD(s_params, lr=2e-2, momentum=0.9)
        t_opt = torch.optim.SGD(t_params, lr=2e-2, momentum=0.9)
        gen = torch.Generator().manual_seed(28)
        for momentum in (0.9, 0.9, 0.0, 0.0, 0.9, 0.9):
            grads = make_grads(gen, values, torch.float32)
            for opt, params in ((s_opt, s_params), (t_opt, t_params)):
                opt.param_groups[0]["momentum"] = momentum
                for p, g in zip(params, grads):
                    p.grad = g.clone()
                opt.step()
            for s, t in zip(s_params, t_params):
                self.assertIsNotNone(s_opt.state[s]["momentum_buffer"])
                torch.testing.assert_close(s_opt.state[s]["momentum_buffer"],
                                           t_opt.state[t]["momentum_buffer"], rtol=1e-6,
                                           atol=1e-7)
                torch.testing.assert_close(s.detach(), t.detach(), rtol=1e-6, atol=1e-7)

    def test_as_close_to_float64_as_torch(self):
        """strata (fp32) and torch (fp32) against torch run in float64 on the same
        problem: strata's worst and mean errors are no larger than torch's (with a
        margin for the luck of individual roundings)."""
        for strata_cls, torch_cls in ((strata.optim.AdamW, torch.optim.AdamW),
                                      (strata.optim.Adam, torch.optim.Adam)):
            kwargs = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)
            values = make_params(41)
            s_params, t_params = leaves(values), leaves(values)
            d_params = [torch.nn.Parameter(v.double()) for v in values]
            opts = [cls(ps, **kwargs) for cls, ps in
                    ((strata_cls, s_params), (torch_cls, t_params), (torch_cls, d_params))]
            gen = torch.Generator().manual_seed(42)
            for _ in range(100):
                grads = make_grads(gen, values, torch.float32, zeros=torch_cls is torch.optim.AdamW)
                for ps in (s_params, t_params, d_params):
                    for p, g in zip(ps, grads):
                        p.grad = g.to(p.dtype)
                for opt in opts:
                    opt.step()
            for key in ("param", "exp_avg", "exp_avg_sq"):
                def values_of(opt, ps):
                    if key == "param":
                        return torch.cat([p.detach().double().flatten() for p in ps])
                    return torch.cat([opt.state[p][key].double().flatten() for p in ps])
                ref = values_of(opts[2], d_params)
                denom = ref.abs().clamp_min(FLOOR_FRACTION * ref.abs().max().item())
                s_err = (values_of(opts[0], s_params) - ref).abs() / denom
                t_err = (values_of(opts[1], t_params) - ref).abs() / denom
                with self.subTest(optimizer=strata_cls.__name__, quantity=key):
                    self.assertLessEqual(s_err.max().item(), 2 * t_err.max().item() + 1e-7)
                    self.assertLessEqual(s_err.mean().item(), 1.5 * t_err.mean().item() + 1e-9)
                    self.assertLessEqual(s_err.max().item(), REL_TOL)

    def test_grad_scale_unscales_before_the_update(self):
        values = make_params(11)
        s_params, t_params = leaves(values), leaves(values)
        kwargs = dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1)
        s_opt = strata.optim.AdamW(s_params, **kwargs)
        t_opt = torch.optim.AdamW(t_params, **kwargs)
        gen = torch.Generator().manual_seed(12)
        for _ in range(20):
            grads = make_grads(gen, values, torch.bfloat16)
            # A loss scale of 1024: strata unscales in the kernel, torch beforehand.
            scaled = [(g.float() * 1024).to(torch.bfloat16) for g in grads]
            for p, g in zip(t_params, grads):
                p.grad = g.float()
            t_opt.step()
            s_opt.step(grads=scaled, grad_scale=1.0 / 1024)
        self.assert_same_state(s_opt, t_opt, s_params, t_params, "grad_scale")

    def test_copy_out_writes_the_updated_weights_rounded_as_torch(self):
        values = make_params(61)
        params = leaves(values)
        opt = strata.optim.Adam(params, lr=1e-2, weight_decay=0.01)
        outs = [torch.zeros(p.shape, dtype=dtype) for p, dtype in
                zip(params, [torch.bfloat16, torch.float16, torch.bfloat16, torch.float32,
                             torch.float16])]
        outs[0] = None  # no copy-out for this one
        gen = torch.Generator().manual_seed(62)
        for _ in range(3):
            opt.step(grads=make_grads(gen, values, torch.bfloat16, zeros=False),
                     copy_out=outs)
        for p, out in zip(params[1:], outs[1:]):
            expected = p.detach().to(out.dtype)
            self.assertTrue(torch.equal(out, expected), f"{out.dtype}")
        with self.assertRaisesRegex(ValueError, "copy_out shape"):
            opt.step(grads=make_grads(gen, values, torch.bfloat16),
                     copy_out=[None, torch.zeros(3, dtype=torch.bfloat16), None, None, None])
        with self.assertRaisesRegex(ValueError, "copy_out has 1 entries"):
            opt.step(copy_out=[None])

    def test_state_dict_has_torch_keys_and_layout(self):
        for strata_cls, torch_cls, kwargs in (
                (strata.optim.AdamW, torch.optim.AdamW, dict(lr=1e-3)),
                (strata.optim.AdamW, torch.optim.AdamW, dict(lr=1e-3, amsgrad=True)),
                (strata.optim.Adam, torch.optim.Adam, dict(lr=1e-3, maximize=True)),
                (strata.optim.Adagrad, torch.optim.Adagrad, dict(lr=1e-3)),
                (strata.optim.SGD, torch.optim.SGD, dict(lr=1e-3)),
                (strata.optim.SGD, torch.optim.SGD, dict(lr=1e-3, momentum=0.5))):
            s_opt, t_opt, _, _ = self.run_twins(strata_cls, torch_cls, kwargs,
                                                torch.float32, steps=2)
            s_sd, t_sd = s_opt.state_dict(), t_opt.state_dict()
            self.assertEqual(s_sd["param_groups"], t_sd["param_groups"])
            self.assertEqual(s_sd["state"].keys(), t_sd["state"].keys())
            for k in t_sd["state"]:
                s_state, t_state = s_sd["state"][k], t_sd["state"][k]
                self.assertEqual(s_state.keys(), t_state.keys())
                for key, t_val in t_state.items():
                    s_val = s_state[key]
                    if t_val is None:
                        self.assertIsNone(s_val, key)
                        continue
                    self.assertEqual((s_val.dtype, s_val.shape, s_val.device),
                                     (t_val.dtype, t_val.shape, t_val.device), key)

    def check_continuation(self, first_cls, second_cls, kwargs, grad_dtype):
        """Trains first_cls 50 steps, loads its state_dict into second_cls, and
        continues both for 50 steps on the same gradients."""
        values = make_params(21)
        a_params = leaves(values)
        a_opt = first_cls(a_params, **kwargs)
        gen = torch.Generator().manual_seed(22)

        def step(opt, params, grads):
            if isinstance(opt, strata.optim._StrataOptimizer) and grads[0].dtype != torch.float32:
                opt.step(grads=grads)
            else:
                for p, g in zip(params, grads):
                    p.grad = g.float()
                opt.step()

        for _ in range(50):
            step(a_opt, a_params, make_grads(gen, values, grad_dtype))
        saved = copy.deepcopy(a_opt.state_dict())
        b_params = leaves([p.detach() for p in a_params])
        b_opt = second_cls(b_params, **kwargs)
        b_opt.load_state_dict(saved)
        # Both continue on the same gradients: the original and the one loaded.
        for _ in range(50):
            grads = make_grads(gen, values, grad_dtype)
            step(a_opt, a_params, grads)
            step(b_opt, b_params, grads)
        self.assert_same_state(b_opt, a_opt, b_params, a_params, "continued")
        if "step" in a_opt.state[a_params[0]]:
            self.assertEqual(float(b_opt.state[b_params[0]]["step"]), 100.0)

    def test_torch_state_dict_loads_into_strata_and_continues(self):
        kwargs = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
        self.check_continuation(torch.optim.AdamW, strata.optim.AdamW, kwargs,
                                torch.float32)
        self.check_continuation(torch.optim.Adam, strata.optim.Adam, kwargs,
                                torch.bfloat16)

    def test_strata_state_dict_loads_into_torch_and_continues(self):
        kwargs = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
        self.check_continuation(strata.optim.AdamW, torch.optim.AdamW, kwargs,
                                torch.bfloat16)
        self.check_continuation(strata.optim.Adam, torch.optim.Adam, kwargs,
                                torch.float32)

    def test_new_optimizers_state_dicts_load_both_ways_and_continue(self):
        cases = (
            (strata.optim.AdamW, torch.optim.AdamW,
             dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, amsgrad=True), torch.float32),
            (strata.optim.Adam, torch.optim.Adam,
             dict(lr=1e-2, weight_decay=0.05, amsgrad=True, maximize=True), torch.bfloat16),
            (strata.optim.Adagrad, torch.optim.Adagrad,
             dict(lr=5e-2, lr_decay=1e-2, weight_decay=0.02, initial_accumulator_value=0.1,
                  eps=1e-6), torch.float32),
            (strata.optim.SGD, torch.optim.SGD,
             dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.01), torch.bfloat16),
            (strata.optim.SGD, torch.optim.SGD,
             dict(lr=1e-2, momentum=0.8, nesterov=True, maximize=True), torch.float32),
        )
        for strata_cls, torch_cls, kwargs, dtype in cases:
            with self.subTest(optimizer=strata_cls.__name__, kwargs=kwargs):
                self.check_continuation(torch_cls, strata_cls, kwargs, dtype)
                self.check_continuation(strata_cls, torch_cls, kwargs, dtype)

    def test_deepcopy_and_pickle_make_an_independent_working_optimizer(self):
        import pickle
        params = leaves(make_params(51))
        opt = strata.optim.AdamW(params, lr=1e-2, num_threads=1)
        gen = torch.Generator().manual_seed(52)
        opt.step(grads=make_grads(gen, params, torch.bfloat16))
        # One deepcopy of both keeps the optimizer's references to its parameters.
        twin, twin_params = copy.deepcopy((opt, params))
        restored = pickle.loads(pickle.dumps(opt))
        self.assertEqual(restored._num_threads, 1)
        grads = make_grads(gen, params, torch.bfloat16)
        opt.step(grads=grads)
        twin.step(grads=grads)
        for p, tp in zip(params, twin_params):
            self.assertTrue(torch.equal(p.detach(), tp.detach()))
            self.assertTrue(torch.equal(opt.state[p]["exp_avg"], twin.state[tp]["exp_avg"]))

    def test_results_do_not_depend_on_num_threads(self):
        values = [torch.randn(300001, generator=torch.Generator().manual_seed(31))]
        results = []
        for threads in (0, 1, 2):
            params = leaves(values)
            opt = strata.optim.AdamW(params, lr=1e-2, num_threads=threads)
            gen = torch.Generator().manual_seed(32)
            for _ in range(3):
                opt.step(grads=make_grads(gen, values, torch.bfloat16))
            results.append(params[0].detach().clone())
        for r in results[1:]:
            self.assertTrue(torch.equal(r, results[0]))

    def test_core_binding_does_not_change_results(self):
        allowed = sorted(os.sched_getaffinity(0))
        values = [torch.randn(300001, generator=torch.Generator().manual_seed(33))]
        results = []
        for cores in (None, allowed[:1], allowed[:2]):
            params = leaves(values)
            opt = strata.optim.SGD(params, lr=1e-2, momentum=0.9, num_threads=2, cores=cores)
            gen = torch.Generator().manual_seed(34)
            for _ in range(3):
                opt.step(grads=make_grads(gen, values, torch.bfloat16))
            results.append(params[0].detach().clone())
        self.assertEqual(os.sched_getaffinity(0), set(allowed))
        for r in results[1:]:
            self.assertTrue(torch.equal(r, results[0]))
        self.assertFalse(torch.equal(results[0], values[0]))
        with self.assertRaisesRegex(strata.StrataError, "listed twice"):
            strata.optim.Lion(leaves(values), cores=[allowed[0], allowed[0]])
        with self.assertRaisesRegex(ValueError, "cores must be"):
            strata.optim.AdamW(leaves(values), cores=[-1])


class BadInputTest(unittest.TestCase):
    def test_bad_parameters_are_rejected_before_anything_changes(self):
        good = torch.nn.Parameter(torch.randn(8))
        good.grad = torch.randn(8)
        before = good.detach().clone()
        cases = {
            "not contiguous": (torch.randn(6, 4).t(), torch.randn(4, 6), ValueError,
                               "not contiguous"),
            "fp64": (torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64),
                     TypeError, "float64"),
            "not on the CPU": (torch.empty(5, device="meta"), torch.empty(5, device="meta"),
                               ValueError, "meta"),
            "grad shape": (torch.randn(5), torch.randn(6), ValueError, "shape"),
        }
        for name, (value, grad, error, text) in cases.items():
            with self.subTest(name):
                bad = torch.nn.Parameter(value)
                opt = strata.optim.AdamW([good, bad])
                with self.assertRaisesRegex(error, text):
                    opt.step(grads=[good.grad, grad])
                self.assertTrue(torch.equal(good.detach(), before))
                self.assertEqual(len(opt.state), 0)

    def test_a_step_refused_for_a_later_parameter_or_group_changes_nothing(self):
        """Arguments the library refuses (a gradient or copy_out sharing memory with
        the weights, a NaN lr) in the second param group: the step raises before the
        first group is stepped, on a fresh optimizer and on one that has stepped."""
        makers = {
            "AdamW": lambda groups: strata.optim.AdamW(groups),
            "AdamW amsgrad": lambda groups: strata.optim.AdamW(groups, amsgrad=True),
            "Adagrad": lambda groups: strata.optim.Adagrad(groups),
            "SGD momentum": lambda groups: strata.optim.SGD(groups, lr=0.1, momentum=0.9),
            "Lion": lambda groups: strata.optim.Lion(groups),
            "AdamW8bit": lambda groups: strata.optim.AdamW8bit(groups),
            "Adafactor": lambda groups: strata.optim.Adafactor(groups, lr=1e-2,
                                                                relative_step=False),
        }

        def aliased_grad(opt, good, bad):
            return dict(grads=[good.grad, bad.detach()])

        def aliased_copy_out(opt, good, bad):
            return dict(grads=[good.grad, torch.randn(bad.shape)], copy_out=[None, bad.detach()])

        def nan_lr_in_group_1(opt, good, bad):
            opt.param_groups[1]["lr"] = float("nan")
            return dict(grads=[good.grad, torch.randn(bad.shape)])

        cases = {
            "aliased grad": (aliased_grad, ValueError,
                             r"param_groups\[1\]\['params'\]\[0\]: the parameter and its "
                             "gradient share memory"),
            "aliased copy_out": (aliased_copy_out, ValueError,
                                 r"param_groups\[1\]\['params'\]\[0\]: the parameter and its "
                                 "copy_out share memory"),
            "NaN lr in group 1": (nan_lr_in_group_1, strata.StrataError,
                                  r"param_groups\[1\]: .*lr must be finite"),
        }

        def snapshot(opt):
            return {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                    for p, s in opt.state.items()}

        for name, make in makers.items():
            for stepped in (False, True):
                for case, (setup, error, text) in cases.items():
                    with self.subTest(name, stepped=stepped, case=case):
                        good = torch.nn.Parameter(torch.randn(4, 8))
                        bad = torch.nn.Parameter(torch.randn(3, 5))
                        good.grad = torch.randn(4, 8)
                        opt = make([{"params": [good]}, {"params": [bad]}])
                        if stepped:
                            opt.step(grads=[torch.randn(4, 8), torch.randn(3, 5)])
                        before = snapshot(opt)
                        good_before, bad_before = good.detach().clone(), bad.detach().clone()
                        kwargs = setup(opt, good, bad)
                        with self.assertRaisesRegex(error, text):
                            opt.step(**kwargs)
                        self.assertTrue(torch.equal(good.detach(), good_before))
                        self.assertTrue(torch.equal(bad.detach(), bad_before))
                        after = snapshot(opt)
                        self.assertEqual(after.keys(), before.keys())
                        for key, state in before.items():
                            self.assertEqual(after[key].keys(), state.keys())
                            for k, v in state.items():
                                if torch.is_tensor(v):
                                    self.assertTrue(torch.equal(after[key][k], v), k)
                                else:
                                    self.assertEqual(after[key][k], v, k)

    def test_a_library_failure_mid_step_leaves_the_parameters_it_did_not_update_as_they_were(self):
        """A failure no argument check foresees (RESOURCE_EXHAUSTED for Adafactor's
        scratch, here injected into the second parameter's C step): the parameter
        stepped before it keeps its update and counts it; that one and the next are
        unchanged, with no state created or step counted for them."""

        class FailingSecondStep:
            def __init__(self, library, call):
                self.library, self.call, self.calls = library, call, 0

            def __getattr__(self, name):
                real = getattr(self.library, name)
                if name != self.call:
                    return real

                def step(*args):
                    self.calls += 1
                    return 8 if self.calls == 2 else real(*args)  # RESOURCE_EXHAUSTED
                return step

        makers = {
            "AdamW": (lambda ps: strata.optim.AdamW(ps), "strata_optimizer_step"),
            "SGD momentum": (lambda ps: strata.optim.SGD(ps, lr=0.1, momentum=0.9),
                             "strata_optimizer_step"),
            "Adafactor": (lambda ps: strata.optim.Adafactor(ps, lr=1e-2, relative_step=False),
                          "strata_optimizer_step_state"),
        }
        library = strata._lib.lib()
        for name, (make, call) in makers.items():
            for stepped in (False, True):
                with self.subTest(name, stepped=stepped):
                    params = [torch.nn.Parameter(torch.randn(4, 8)) for _ in range(3)]
                    opt = make(params)
                    if stepped:
                        opt.step(grads=[torch.randn(4, 8) for _ in params])
                    before = [p.detach().clone() for p in params]
                    states = [{k: v.clone() if torch.is_tensor(v) else v
                               for k, v in opt.state[p].items()} if p in opt.state else None
                              for p in params]
                    failing = FailingSecondStep(library, call)
                    with unittest.mock.patch.object(strata._lib, "lib", lambda: failing):
                        with self.assertRaises(strata.StrataError) as raised:
                            opt.step(grads=[torch.randn(4, 8) for _ in params])
                    self.assertEqual(raised.exception.status, "RESOURCE_EXHAUSTED")
                    self.assertFalse(torch.equal(params[0].detach(), before[0]))
                    self.assertIn(params[0], opt.state)
                    if "step" in opt.state[params[0]]:
                        self.assertEqual(float(opt.state[params[0]]["step"]), 1 + stepped)
                    for p, b, s in zip(params[1:], before[1:], states[1:]):
                        self.assertTrue(torch.equal(p.detach(), b))
                        if s is None:
                            self.assertNotIn(p, opt.state)
                        else:
                            self.assertEqual(opt.state[p].keys(), s.keys())
                            for k, v in s.items():
                                self.assertTrue(torch.equal(opt.state[p][k], v), k)

    def test_non_contiguous_and_fp64_grads_are_rejected(self):
        p = torch.nn.Parameter(torch.randn(4, 6))
        opt = strata.optim.Adam([p])
        with self.assertRaisesRegex(ValueError, "gradient is not contiguous"):
            opt.step(grads=[torch.randn(6, 4).t()])
        with self.assertRaisesRegex(TypeError, "gradient has dtype float64"):
            opt.step(grads=[torch.randn(4, 6, dtype=torch.float64)])
        with self.assertRaisesRegex(ValueError, "grads has 2 entries"):
            opt.step(grads=[None, None])

    def test_unsupported_options_are_rejected_with_reasons(self):
        p = [torch.nn.Parameter(torch.randn(3))]
        with self.assertRaisesRegex(ValueError, "capturable"):
            strata.optim.AdamW(p, capturable=True)
        with self.assertRaisesRegex(ValueError, "Invalid learning rate"):
            strata.optim.AdamW(p, lr=-1.0)
        with self.assertRaisesRegex(ValueError, "Invalid beta parameter at index 1"):
            strata.optim.Adam(p, betas=(0.9, 1.0))
        with self.assertRaisesRegex(ValueError, "num_threads"):
            strata.optim.Adam(p, num_threads=-1)
        # Options torch accepts are accepted; foreach has no effect on the result.
        strata.optim.AdamW(p, foreach=True)
        strata.optim.Adam(p, foreach=False, fused=False if "fused" in
                          torch.optim.Adam.__init__.__code__.co_varnames else None)
        for name in ("differentiable", "fused"):
            for cls in (strata.optim.AdamW, strata.optim.Adam):
                twin_has = name in cls._twin.__init__.__code__.co_varnames
                with self.subTest(cls=cls.__name__, option=name):
                    if twin_has:
                        with self.assertRaisesRegex(ValueError, name):
                            cls(p, **{name: True})
                    else:
                        with self.assertRaisesRegex(TypeError, f"no argument '{name}'"):
                            cls(p, **{name: True})

    def test_amsgrad_turned_on_over_a_state_without_max_is_rejected(self):
        p = torch.nn.Parameter(torch.randn(3))
        p.grad = torch.randn(3)
        s_opt = strata.optim.AdamW([p])
        s_opt.step()
        before = p.detach().clone()
        s_opt.param_groups[0]["amsgrad"] = True
        with self.assertRaisesRegex(ValueError, "no 'max_exp_avg_sq'"):
            s_opt.step()
        self.assertTrue(torch.equal(p.detach(), before))

    def test_new_optimizers_check_arguments_as_torch(self):
        p = [torch.nn.Parameter(torch.randn(3))]
        for kwargs in (dict(lr=-1.0), dict(lr_decay=-0.1), dict(weight_decay=-1.0),
                       dict(initial_accumulator_value=-1.0), dict(eps=-1.0)):
            with self.subTest(kwargs=kwargs):
                with self.assertRaisesRegex(ValueError, "Invalid"):
                    strata.optim.Adagrad(p, **kwargs)
                with self.assertRaisesRegex(ValueError, "Invalid"):
                    torch.optim.Adagrad(p, **kwargs)
        with self.assertRaisesRegex(ValueError, "Nesterov momentum requires"):
            strata.optim.SGD(p, lr=0.1, nesterov=True)
        with self.assertRaisesRegex(ValueError, "Nesterov momentum requires"):
            strata.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True)
        with self.assertRaisesRegex(ValueError, "Invalid momentum"):
            strata.optim.SGD(p, lr=0.1, momentum=-0.5)
        with self.assertRaisesRegex(ValueError, "differentiable"):
            strata.optim.SGD(p, lr=0.1, differentiable=True)
        # lr is required, as for torch.optim.SGD (checked when the group is added).
        with self.assertRaisesRegex(ValueError, "lr"):
            strata.optim.SGD(p)
        with self.assertRaisesRegex(ValueError, "betas"):
            strata.optim.Lion(p, betas=(0.9, 1.5))
        with self.assertRaisesRegex(ValueError, "Invalid learning rate"):
            strata.optim.Lion(p, lr=-1e-4)
        with self.assertRaisesRegex(TypeError, "capturable"):
            strata.optim.SGD(p, lr=0.1, capturable=False)


def lion_reference_step(params, exp_avgs, grads, lr, betas, weight_decay, maximize):
    """The update of Chen et al. 2023, Algorithm 2 (decoupled weight decay), in
    float64 on float64 tensors, in place."""
    beta1, beta2 = betas
    for p, m, g in zip(params, exp_avgs, grads):
        g = -g if maximize else g
        p.mul_(1.0 - lr * weight_decay)
        c = beta1 * m + (1.0 - beta1) * g
        p.sub_(lr * torch.sign(c))
        m.mul_(beta2).add_((1.0 - beta2) * g)


class LionTest(unittest.TestCase):
    """strata.optim.Lion against lion_reference_step in float64 over 100 steps,
    with the comparison rule of the module docstring. The hyper-parameters are
    given as fp32-representable values, so both sides use the same numbers."""

    def run_lion(self, kwargs, grad_dtype, seed, lr_schedule=None):
        values = make_params(seed)
        s_params = leaves(values)
        d_params = [v.double().clone() for v in values]
        d_avgs = [torch.zeros_like(p) for p in d_params]
        s_opt = strata.optim.Lion([{"params": s_params[:2]},
                                   {"params": s_params[2:], "lr": kwargs["lr"] * 0.5}],
                                  **kwargs)
        lrs = [kwargs["lr"]] * 2 + [kwargs["lr"] * 0.5] * (len(values) - 2)
        gen = torch.Generator().manual_seed(seed + 1)
        betas = kwargs.get("betas", (0.9, 0.99))
        for step in range(100):
            if lr_schedule is not None:
                for group in s_opt.param_groups:
                    group["lr"] *= lr_schedule
                lrs = [lr * lr_schedule for lr in lrs]
            grads = make_grads(gen, values, grad_dtype)
            if grad_dtype == torch.float32:
                for p, g in zip(s_params, grads):
                    p.grad = g.clone()
                s_opt.step()
            else:
                s_opt.step(grads=grads)
            for i in range(len(values)):
                # strata receives lr as fp32: the reference uses that same value.
                lr = float(torch.tensor(s_opt.param_groups[0 if i < 2 else 1]["lr"],
                                        dtype=torch.float32))
                lion_reference_step([d_params[i]], [d_avgs[i]], [grads[i].double()], lr,
                                    [float(torch.tensor(b, dtype=torch.float32))
                                     for b in betas],
                                    float(torch.tensor(kwargs.get("weight_decay", 0.0),
                                                       dtype=torch.float32)),
                                    kwargs.get("maximize", False))
            if step % 10 == 9:
                p_floor = floor_of(d_params)
                m_floor = floor_of(d_avgs)
                for i, p in enumerate(s_params):
                    err = worst_rel_error(p.detach().double(), d_params[i], p_floor)
                    self.assertLessEqual(err, REL_TOL, f"step {step + 1} param {i}: {err:.3g}")
                    m = s_opt.state[p]["exp_avg"].double()
                    err = worst_rel_error(m, d_avgs[i], m_floor)
                    self.assertLessEqual(err, REL_TOL, f"step {step + 1} exp_avg {i}: {err:.3g}")
        # The state is lion-pytorch's: exp_avg only.
        self.assertEqual(set(s_opt.state[s_params[0]].keys()), {"exp_avg"})
        # The weights moved by about lr per step (a no-op would fail above, too).
        self.assertGreater((s_params[0].detach() - values[0]).abs().max().item(),
                           10 * kwargs["lr"] * 0.5)

    def test_lion_matches_float64_reference_fp32_grads(self):
        self.run_lion(dict(lr=2.0 ** -12, betas=(0.875, 0.984375), weight_decay=0.5),
                      torch.float32, seed=71)

    def test_lion_matches_float64_reference_bf16_grads_maximize(self):
        self.run_lion(dict(lr=2.0 ** -11, betas=(0.9375, 0.99609375), weight_decay=0.25,
                           maximize=True), torch.bfloat16, seed=72)

    def test_lion_defaults_are_lion_pytorchs(self):
        opt = strata.optim.Lion([torch.nn.Parameter(torch.randn(3))])
        group = opt.param_groups[0]
        self.assertEqual((group["lr"], group["betas"], group["weight_decay"]),
                         (1e-4, (0.9, 0.99), 0.0))

    def test_lion_state_dict_round_trip_continues_identically(self):
        values = make_params(73)
        a_params = leaves(values)
        a_opt = strata.optim.Lion(a_params, lr=1e-3, weight_decay=0.1)
        gen = torch.Generator().manual_seed(74)
        for _ in range(5):
            a_opt.step(grads=make_grads(gen, values, torch.bfloat16))
        b_params = leaves([p.detach() for p in a_params])
        b_opt = strata.optim.Lion(b_params, lr=1e-3, weight_decay=0.1)
        b_opt.load_state_dict(copy.deepcopy(a_opt.state_dict()))
        for _ in range(5):
            grads = make_grads(gen, values, torch.bfloat16)
            a_opt.step(grads=grads)
            b_opt.step(grads=grads)
        for pa, pb in zip(a_params, b_params):
            self.assertTrue(torch.equal(pa.detach(), pb.detach()))
            self.assertTrue(torch.equal(a_opt.state[pa]["exp_avg"], b_opt.state[pb]["exp_avg"]))


if __name__ == "__main__":
    unittest.main()
