"""strata.torch (ZeRO-Offload for PyTorch over the strata_offload C API) against
torch.optim on a small GPT written here: same initial weights, same batches.

Comparison rule for parameters (assert_params_close): element-wise relative error
<= 1e-5, relative to max(|torch|, 5% of the tensor's largest magnitude), as in
test_optim.py (elements that end small by cancellation carry the rounding error
of the terms that cancelled). Losses: |strata - torch| <= 1e-5 * |torch|. The two
fp32 implementations round in different places (test_optim.py's docstring), so
bit equality with torch is not expected; bit equality IS expected between two
strata runs (a skipped step, a resumed run).
"""

import ctypes
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import weakref
from unittest import mock

import torch
import torch.utils.checkpoint

import strata
import strata._lib
import strata.torch as st

REL_TOL = 1e-5
FLOOR_FRACTION = 5e-2
VOCAB, CTX, EMBD, HEADS, LAYERS = 48, 16, 32, 4, 2


class Block(torch.nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(EMBD)
        self.qkv = torch.nn.Linear(EMBD, 3 * EMBD, bias=False)  # a key bias has no gradient
        self.proj = torch.nn.Linear(EMBD, EMBD)
        self.ln2 = torch.nn.LayerNorm(EMBD)
        self.fc = torch.nn.Linear(EMBD, 4 * EMBD)
        self.out = torch.nn.Linear(4 * EMBD, EMBD)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(EMBD, dim=2)
        q, k, v = (y.view(b, t, HEADS, c // HEADS).transpose(1, 2) for y in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // HEADS)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))


class TinyGPT(torch.nn.Module):
    """Token and position embeddings, LAYERS blocks, final norm, LM head."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, EMBD)
        self.wpe = torch.nn.Embedding(CTX, EMBD)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = torch.nn.LayerNorm(EMBD)
        self.head = torch.nn.Linear(EMBD, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return TinyGPT().to(dtype)


def batch(step, micro=0, size=4):
    """Deterministic batch of a step: a noisy counting sequence (learnable)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    seq = (start + torch.arange(CTX + 1)) % VOCAB
    noise = torch.rand(seq.shape, generator=g) < 0.1
    seq = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=g), seq)
    return seq[:, :-1], seq[:, 1:]


def worst_rel_error(actual, expected):
    floor = max(FLOOR_FRACTION * expected.abs().max().item(), 1e-30)
    return ((actual - expected).abs() / expected.abs().clamp_min(floor)).max().item()


def train(model, opt, steps, first_step=0, micro_batches=1, clip=None, scheduler=None,
          losses=None):
    """steps optimizer steps; opt is a strata.torch or a torch.optim optimizer.
    clip with a torch optimizer: clip_grad_norm_ (strata clips inside)."""
    for step in range(first_step, first_step + steps):
        opt.zero_grad()
        total = 0.0
        for micro in range(micro_batches):
            loss = model(*batch(step, micro)) / micro_batches
            loss.backward()
            total += loss.item()
        if clip is not None and not isinstance(opt, st.OffloadOptimizer):
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if scheduler is not None:
            scheduler.step()
        if losses is not None:
            losses.append(total)
    if isinstance(opt, st.OffloadOptimizer):
        opt.synchronize()


def warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))


TINY_BUCKET = 20  # elements: tiny_mlp's layers are one bucket each (16 + 4, 8 + 2)


def tiny_mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def tiny_step(model, opt, step):
    """One forward, backward and step() of tiny_mlp on a batch fixed by step."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)
    (model(x) - y).square().mean().backward()
    opt.step()


class HandleCallProbe:
    """Stands in for libstrata (strata._lib.lib()): every strata_offload_* call but
    strata_offload_wait_bucket (which strata.h lets run concurrently) sleeps 10 ms
    inside, to widen the window, and the most calls in flight at once is kept."""

    def __init__(self, real):
        self.real = real
        self.lock = threading.Lock()
        self.inside = 0
        self.most = 0

    def __getattr__(self, name):
        fn = getattr(self.real, name)
        if not name.startswith("strata_offload_") or name == "strata_offload_wait_bucket":
            return fn

        def call(*args):
            with self.lock:
                self.inside += 1
                self.most = max(self.most, self.inside)
            try:
                time.sleep(0.01)
                return fn(*args)
            finally:
                with self.lock:
                    self.inside -= 1

        return call


class OffloadTestCase(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="strata-offload-torch-")
        self.addCleanup(self.tmp.cleanup)

    def assert_params_close(self, model, ref, what, tol=REL_TOL):
        worst = 0.0
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            err = worst_rel_error(p.detach(), q.detach())
            worst = max(worst, err)
            self.assertLessEqual(err, tol, f"{what}: {name}: worst relative error {err:.3g}")
        if os.environ.get("STRATA_TEST_VERBOSE"):
            print(f"{what}: worst relative error {worst:.3g}")

    def assert_losses_equal(self, losses, ref_losses, what):
        self.assertEqual(len(losses), len(ref_losses))
        for i, (a, b) in enumerate(zip(losses, ref_losses)):
            self.assertLessEqual(abs(a - b), REL_TOL * abs(b), f"{what}: loss of step {i}: "
                                 f"{a!r} vs torch {b!r}")

    def assert_params_equal(self, model, ref, what):
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            self.assertTrue(torch.equal(p, q), f"{what}: {name} differs "
                            f"(max {(p - q).abs().max().item():.3g})")


class EquivalenceTest(OffloadTestCase):
    def test_nvme_adamw_matches_torch_adamw_for_50_steps_of_a_gpt(self):
        model, ref = make_model(), make_model()
        opt = st.OffloadAdamW(model, lr=3e-3, weight_decay=0.1, offload="nvme",
                              nvme_path=self.tmp.name, bucket_size=5000)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
        self.assertGreater(len(opt._buckets), 2, "the test wants several buckets")
        losses, ref_losses = [], []
        train(model, opt, 50, scheduler=warmup(opt), losses=losses)
        train(ref, ref_opt, 50, scheduler=warmup(ref_opt), losses=ref_losses)
        self.assertLess(ref_losses[-1], ref_losses[0] - 0.5, "the model should learn")
        self.assert_losses_equal(losses, ref_losses, "nvme AdamW")
        self.assert_params_close(model, ref, "nvme AdamW")
        stats = opt.stats()
        self.assertEqual(stats["steps"], 50)
        self.assertGreater(stats["nvme_bytes_written"], 0)
        for p in model.parameters():
            self.assertIsNone(p.grad, "gradients must not stay in torch memory")
        # The state_dict is torch's AdamW format, and its tensors match torch's.
        sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
        self.assertEqual(sd["param_groups"], ref_sd["param_groups"])
        self.assertEqual(sorted(sd["state"]), sorted(ref_sd["state"]))
        for i, entry in sd["state"].items():
            self.assertEqual(set(entry), set(ref_sd["state"][i]))
            self.assertEqual(float(entry["step"]), float(ref_sd["state"][i]["step"]))
            for key in ("exp_avg", "exp_avg_sq"):
                err = worst_rel_error(entry[key], ref_sd["state"][i][key])
                self.assertLessEqual(err, 1e-4, f"state {i} {key}: {err:.3g}")

    def test_accumulation_and_clipping_match_torch(self):
        model, ref = make_model(1), make_model(1)
        opt = st.OffloadAdamW(model, lr=2e-3, max_grad_norm=0.3, bucket_size=8000)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=2e-3)
        losses, ref_losses = [], []
        train(model, opt, 20, micro_batches=2, clip=0.3, losses=losses)
        train(ref, ref_opt, 20, micro_batches=2, clip=0.3, losses=ref_losses)
        self.assertGreater(opt.grad_norm, 0.3, "clipping must be active in this test")
        self.assert_losses_equal(losses, ref_losses, "accumulation + clipping")
        self.assert_params_close(model, ref, "accumulation + clipping")

    def test_other_optimizers_match_their_torch_twins(self):
        cases = [
            (st.OffloadAdam, torch.optim.Adam, dict(lr=2e-3, weight_decay=0.01, amsgrad=True)),
            (st.OffloadSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
            (st.OffloadAdagrad, torch.optim.Adagrad,
             dict(lr=0.02, initial_accumulator_value=0.1)),
        ]
        for cls, twin, kwargs in cases:
            with self.subTest(cls.__name__):
                model, ref = make_model(2), make_model(2)
                opt = cls(model, **kwargs)
                ref_opt = twin(ref.parameters(), **kwargs)
                losses, ref_losses = [], []
                train(model, opt, 8, losses=losses)
                train(ref, ref_opt, 8, losses=ref_losses)
                self.assert_losses_equal(losses, ref_losses, cls.__name__)
                self.assert_params_close(model, ref, cls.__name__)
                sd = opt.state_dict()
                ref_sd = ref_opt.state_dict()
                self.assertEqual(set(sd["state"][0]), set(ref_sd["state"][0]))

    def test_param_groups_with_their_own_hyper_parameters_match_torch(self):
        model, ref = make_model(9), make_model(9)

        def groups(m):
            decay = [p for n, p in m.named_parameters() if p.dim() >= 2]
            no_decay = [p for n, p in m.named_parameters() if p.dim() < 2]
            return [{"params": decay, "weight_decay": 0.1},
                    {"params": no_decay, "weight_decay": 0.0, "lr": 1e-3}]

        opt = st.OffloadAdamW(groups(model), lr=3e-3, module=model, bucket_size=5000)
        ref_opt = torch.optim.AdamW(groups(ref), lr=3e-3)
        losses, ref_losses = [], []
        train(model, opt, 10, losses=losses)
        train(ref, ref_opt, 10, losses=ref_losses)
        self.assert_losses_equal(losses, ref_losses, "two param groups")
        self.assert_params_close(model, ref, "two param groups")
        self.assertEqual(opt.state_dict()["param_groups"], ref_opt.state_dict()["param_groups"])

    def test_lion_matches_strata_optim_lion(self):
        import strata.optim
        model, ref = make_model(3), make_model(3)
        opt = st.OffloadLion(model, lr=1e-3, weight_decay=0.1)
        ref_opt = strata.optim.Lion(ref.parameters(), lr=1e-3, weight_decay=0.1)
        train(model, opt, 6)
        train(ref, ref_opt, 6)
        self.assert_params_close(model, ref, "Lion")


class AutoOffloadTest(OffloadTestCase):
    """offload="auto" (issue 41): the home comes from the engine's planning rule
    (strata_offload_choose_device, engine/plan/plan_choice.h ChooseOffloadHome)."""

    def test_a_small_model_auto_is_host_memory_and_trains_as_cpu_bit_for_bit(self):
        model, twin = make_model(), make_model()
        opt = st.OffloadAdamW(model, lr=3e-3, offload="auto", bucket_size=5000)
        twin_opt = st.OffloadAdamW(twin, lr=3e-3, offload="cpu", bucket_size=5000)
        self.assertEqual(opt._offload, "cpu")
        train(model, opt, 5)
        train(twin, twin_opt, 5)
        self.assert_params_equal(model, twin, "auto vs cpu")
        # The state the rule weighs: fp32 masters and AdamW's m and v, 12 bytes a parameter.
        n = sum(p.numel() for p in model.parameters())
        self.assertEqual(opt._state_bytes(), 12 * n)
        # With a drive given, a small state still stays in host memory.
        model2 = make_model()
        opt2 = st.OffloadAdamW(model2, lr=3e-3, offload="auto", nvme_path=self.tmp.name)
        self.assertEqual(opt2._offload, "cpu")
        self.assertEqual(opt2._nvme_paths, [])

    def test_the_rule_takes_the_drive_for_a_state_beyond_host_memory(self):
        library = strata._lib.lib()
        device = ctypes.c_int(-1)
        huge = 1 << 62  # more than any host's memory
        self.assertEqual(library.strata_offload_choose_device(huge, 1, ctypes.byref(device)), 0)
        self.assertEqual(device.value, strata._lib.OFFLOAD_NVME)
        status = library.strata_offload_choose_device(huge, 0, ctypes.byref(device))
        self.assertNotEqual(status, 0)
        with self.assertRaisesRegex(Exception, "does not fit"):
            strata._lib.check(status)
        self.assertEqual(library.strata_offload_choose_device(1 << 20, 0, ctypes.byref(device)), 0)
        self.assertEqual(device.value, strata._lib.OFFLOAD_CPU)

    def test_an_unknown_offload_value_names_the_three(self):
        with self.assertRaisesRegex(ValueError, '"cpu", "nvme" or "auto"'):
            st.OffloadAdamW(make_model(), offload="disk")


class HooksTest(OffloadTestCase):
    """The gradient and forward pre-hooks: who they keep alive, what they wait for,
    and on which threads they may run."""

    def test_a_dropped_optimizer_is_freed_and_a_new_one_on_the_model_trains_as_fresh(self):
        swap = os.path.join(self.tmp.name, "swap")
        os.mkdir(swap)
        model = tiny_mlp(1)
        opt1 = st.OffloadAdamW(model, lr=1e-2, offload="nvme", nvme_path=swap,
                               bucket_size=TINY_BUCKET)
        tiny_step(model, opt1, 0)
        opt1.synchronize()
        alive = weakref.ref(opt1)
        del opt1
        gc.collect()
        self.assertIsNone(alive(), "the model's hooks keep a dropped optimizer alive")
        self.assertEqual(os.listdir(swap), [], "a dropped optimizer's swap files remain")
        ref = tiny_mlp(2)
        ref.load_state_dict(model.state_dict())
        opt2 = st.OffloadAdamW(model, lr=1e-2, bucket_size=TINY_BUCKET)
        fresh = st.OffloadAdamW(ref, lr=1e-2, bucket_size=TINY_BUCKET)
        for step in range(1, 4):
            tiny_step(model, opt2, step)
            tiny_step(ref, fresh, step)
        opt2.synchronize()
        fresh.synchronize()
        self.assert_params_equal(model, ref, "a second optimizer on the same model")

    def test_a_skipped_step_keeps_the_update_nobody_waited_for_pending(self):
        model = tiny_mlp(3)
        opt = st.OffloadAdamW(model, bucket_size=TINY_BUCKET)
        tiny_step(model, opt, 0)  # attached: step() returns before the update is waited for
        self.assertEqual([b.pending for b in opt._buckets], [True, True])
        # A backward that runs no module forward (nothing waits), with an inf gradient.
        params = list(model.parameters())
        torch.autograd.backward(params, [torch.full_like(p, math.inf) for p in params])
        opt.step()
        self.assertTrue(opt.skipped)
        self.assertEqual([b.pending for b in opt._buckets], [True, True],
                         "a skipped step forgot an update nobody waited for (on CUDA: its "
                         "mirror is never copied to the device)")
        opt.synchronize()
        self.assertEqual([b.pending for b in opt._buckets], [False, False])

    def assert_forward_waits_for_every_bucket(self, module, run, bucket_size):
        """module's parameters split over several buckets; a forward pre-hook
        registered after the optimizer's sees none of them pending."""
        opt = st.OffloadAdamW(module, lr=1e-2, bucket_size=bucket_size)
        self.assertGreater(len(opt._buckets), 1, "the test wants several buckets")
        seen = []
        module.register_forward_pre_hook(
            lambda mod, inputs: seen.append([b.pending for b in opt._buckets]))
        for _ in range(2):
            run().square().mean().backward()
            opt.step()
        run()
        self.assertEqual(seen, [[False] * len(opt._buckets)] * 3,
                         "the forward started while an update of its parameters was running")
        opt.close()

    def test_modules_that_read_their_childrens_parameters_wait_for_them(self):
        x = torch.randn(3, 1, 8, generator=torch.Generator().manual_seed(4))
        torch.manual_seed(4)
        mha = torch.nn.MultiheadAttention(8, 2)
        # in_proj_weight (24, 8) and in_proj_bias (24): 216 elements, one bucket;
        # out_proj, read by F.multi_head_attention_forward without calling it: another.
        with self.subTest("MultiheadAttention"):
            self.assert_forward_waits_for_every_bucket(mha, lambda: mha(x, x, x)[0], 216)
        torch.manual_seed(4)
        layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0)
        with self.subTest("TransformerEncoderLayer"):  # owns no parameter of its own
            self.assert_forward_waits_for_every_bucket(layer, lambda: layer(x), 216)

    def test_a_param_group_added_later_is_waited_for_by_its_attached_module(self):
        model = tiny_mlp(5)
        opt = st.OffloadAdamW(list(model[0].parameters()), module=model,
                              bucket_size=TINY_BUCKET)
        opt.add_param_group({"params": list(model[1].parameters()), "lr": 1e-2})
        self.assertEqual(len(opt._buckets), 2)
        seen = []
        model[1].register_forward_pre_hook(
            lambda mod, inputs: seen.append([b.pending for b in opt._buckets]))
        tiny_step(model, opt, 0)
        tiny_step(model, opt, 1)
        self.assertEqual(seen, [[False, False]] * 2,
                         "model[1] ran while its group's update was running")

    def test_a_refused_param_group_is_not_kept(self):
        # As torch.optim, which validates a group before it appends it: an fp64 parameter
        # or a NaN lr leaves param_groups, the state_dict and later steps as they were.
        model = tiny_mlp(7)
        opt = st.OffloadAdamW(list(model[0].parameters()), bucket_size=TINY_BUCKET)
        extra = torch.nn.Parameter(torch.randn(4))
        wide = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
        for group, error in (({"params": [wide]}, TypeError),
                             ({"params": [extra], "lr": float("nan")}, strata.StrataError)):
            with self.assertRaises(error):
                opt.add_param_group(group)
            self.assertEqual(len(opt.param_groups), 1)
        opt.add_param_group({"params": list(model[1].parameters()), "lr": 1e-2})
        self.assertEqual(len(opt.param_groups), 2)
        tiny_step(model, opt, 0)
        self.assertEqual(len(opt.state_dict()["param_groups"]), 2)

    def test_a_closed_optimizer_says_so(self):
        model = tiny_mlp(8)
        opt = st.OffloadAdamW(model, bucket_size=TINY_BUCKET)
        tiny_step(model, opt, 0)
        opt.close()
        for call in (opt.step, opt.stats,
                     lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))]})):
            with self.assertRaisesRegex(RuntimeError, "OffloadAdamW was closed"):
                call()
        self.assertEqual(len(opt.param_groups), 1)

    def run_two_layers(self, threaded):
        """Two independent layers, one bucket each, trained 2 steps; each step's two
        backward passes run on two threads at once (as autograd runs a CPU and a CUDA
        part) or one after the other. Returns the layers' parameters and the most
        strata_offload calls that ran at once."""
        torch.manual_seed(6)
        pair = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
        opt = st.OffloadAdamW(pair, lr=1e-2, bucket_size=TINY_BUCKET)
        probe = HandleCallProbe(strata._lib.lib())
        errors = []

        def backward(loss, barrier):
            try:
                barrier.wait()
                loss.backward()
            except BaseException as e:  # re-raised on the main thread
                errors.append(e)

        for step in range(2):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            losses = [layer(x).square().sum() for layer in pair]
            with mock.patch.object(strata._lib, "lib", lambda: probe):
                if threaded:
                    barrier = threading.Barrier(len(losses), timeout=60)
                    threads = [threading.Thread(target=backward, args=(loss, barrier))
                               for loss in losses]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                else:
                    for loss in losses:
                        loss.backward()
            if errors:
                raise errors[0]
            opt.step()
        opt.synchronize()
        return [p.detach().clone() for p in pair.parameters()], probe.most

    def test_gradient_hooks_on_two_threads_never_call_the_handle_at_once(self):
        params, most = self.run_two_layers(threaded=True)
        self.assertEqual(most, 1, "two threads called the strata_offload handle at once")
        ref_params, _ = self.run_two_layers(threaded=False)
        for p, q in zip(params, ref_params):
            self.assertTrue(torch.equal(p, q), "two threads trained otherwise than one")


class StateTest(OffloadTestCase):
    def test_state_dict_round_trip_is_exact_and_training_continues_identically(self):
        model = make_model(4)
        opt = st.OffloadAdamW(model, lr=3e-3, bucket_size=6000)
        train(model, opt, 5)
        sd = opt.state_dict()
        other = make_model(99)
        other.load_state_dict(model.state_dict())
        other_opt = st.OffloadAdamW(other, lr=1.0, bucket_size=7000)  # lr comes from sd
        other_opt.load_state_dict(sd)
        sd2 = other_opt.state_dict()
        self.assertEqual(sd["param_groups"], sd2["param_groups"])
        for i in sd["state"]:
            for key, value in sd["state"][i].items():
                self.assertTrue(torch.equal(value, sd2["state"][i][key]), f"{i} {key}")
        train(model, opt, 3, first_step=5)
        train(other, other_opt, 3, first_step=5)
        self.assert_params_equal(other, model, "after load_state_dict")
        # torch.optim.AdamW loads it too, and continues within the comparison rule.
        ref = make_model(99)
        ref.load_state_dict(other.state_dict())
        ref_opt = torch.optim.AdamW(ref.parameters())
        ref_opt.load_state_dict(other_opt.state_dict())
        train(ref, ref_opt, 2, first_step=8)
        train(other, other_opt, 2, first_step=8)
        # (A format check: two fp32 implementations from one state, 2 steps apart.)
        self.assert_params_close(other, ref, "torch after loading strata's state_dict",
                                 tol=1e-4)

    def test_bf16_parameters_keep_fp32_masters(self):
        model = make_model(5, torch.bfloat16)
        opt = st.OffloadAdamW(model, lr=1e-2)
        train(model, opt, 3)
        sd = opt.state_dict()
        for i, p in enumerate(model.parameters()):
            master = sd["state"][i]["master"]
            self.assertEqual(master.dtype, torch.float32)
            self.assertTrue(torch.equal(master.to(torch.bfloat16), p),
                            "a bf16 parameter is its master weights rounded")
        self.assertTrue(any(not torch.equal(sd["state"][i]["master"],
                                            p.float()) for i, p in enumerate(model.parameters())),
                        "the masters must carry more precision than the bf16 weights")

    def test_hysteresis_backs_off_at_the_nth_overflow_as_deepspeed(self):
        model = make_model(6)
        opt = st.OffloadAdamW(model, lr=1e-3)
        scaler = st.GradScaler(init_scale=1024.0, growth_interval=2, hysteresis=2)
        victim = model.blocks[1].fc.weight
        scales = []
        # overflow, overflow, clean, clean (growth), overflow, overflow
        for step, overflow in enumerate([True, True, False, False, True, True]):
            handle = None
            if overflow:
                handle = victim.register_hook(
                    lambda g: g.index_fill(0, torch.tensor([0]), math.inf))
            scaler.scale(model(*batch(step))).backward()
            if handle:
                handle.remove()
            scaler.step(opt)
            self.assertEqual(opt.skipped, overflow)
            scaler.update()
            scales.append(scaler.get_scale())
        # The first overflow only skips; the second backs off; growth restores the
        # hysteresis, so again only the second overflow after it backs off.
        self.assertEqual(scales, [1024.0, 512.0, 512.0, 1024.0, 1024.0, 512.0])
        opt.synchronize()

    def test_overflow_skips_the_step_and_leaves_everything_bit_identical(self):
        model = make_model(6)
        opt = st.OffloadAdamW(model, lr=1e-3)
        scaler = st.GradScaler(init_scale=1024.0, growth_interval=3)
        for step in range(2):
            scaler.scale(model(*batch(step))).backward()
            scaler.step(opt)
            scaler.update()
        opt.synchronize()
        before = [p.detach().clone() for p in model.parameters()]
        state_before = opt.state_dict()
        scale_before = scaler.get_scale()
        victim = model.blocks[1].fc.weight
        handle = victim.register_hook(lambda g: g.index_fill(0, torch.tensor([3]), math.inf))
        scaler.scale(model(*batch(2))).backward()
        handle.remove()
        self.assertIsNone(scaler.step(opt))
        scaler.update()
        opt.synchronize()
        self.assertTrue(opt.skipped)
        self.assertEqual(scaler.get_scale(), scale_before * 0.5)
        for p, q in zip(model.parameters(), before):
            self.assertTrue(torch.equal(p, q), "a skipped step must not change a parameter")
        state_after = opt.state_dict()
        for i, entry in state_before["state"].items():
            for key, value in entry.items():
                self.assertTrue(torch.equal(value, state_after["state"][i][key]), f"{i} {key}")
        # Training goes on, and three clean steps grow the scale back.
        for step in range(3, 6):
            scaler.scale(model(*batch(step))).backward()
            scaler.step(opt)
            scaler.update()
        opt.synchronize()
        self.assertFalse(opt.skipped)
        self.assertEqual(scaler.get_scale(), scale_before)
        self.assertFalse(all(torch.equal(p, q) for p, q in zip(model.parameters(), before)))

    def test_save_and_resume_in_a_fresh_process_is_bit_identical(self):
        ckpt = os.path.join(self.tmp.name, "ckpt")
        swap = os.path.join(self.tmp.name, "swap")
        os.mkdir(swap)
        model = make_model(7)
        opt = st.OffloadAdamW(model, lr=3e-3, offload="nvme", nvme_path=swap,
                              bucket_size=5000)
        train(model, opt, 6)
        opt.save(ckpt)
        torch.save(model.state_dict(), os.path.join(self.tmp.name, "model.pt"))
        train(model, opt, 6, first_step=6)
        out = os.path.join(self.tmp.name, "resumed.pt")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--resume", self.tmp.name,
                        out], check=True, timeout=300)
        resumed = make_model(7)
        resumed.load_state_dict(torch.load(out))
        self.assert_params_equal(resumed, model, "resumed in a fresh process")

    def test_a_damaged_param_groups_file_is_named_before_anything_changes(self):
        ckpt = os.path.join(self.tmp.name, "ckpt")
        model = make_model(7)
        opt = st.OffloadAdamW(model, lr=3e-3, betas=(0.9, 0.95), bucket_size=5000)
        train(model, opt, 2)
        opt.save(ckpt)
        groups_file = os.path.join(ckpt, "torch_param_groups.json")
        with open(groups_file) as f:
            saved = f.read()
        cases = [
            ("{\"lr\": ", "not a JSON file of param groups"),
            ("[" * 5000 + "]" * 5000, "not a JSON file of param groups"),
            ("{\"lr\": 1}", "not a list of param group objects"),
            ("[1]", "not a list of param group objects"),
            (json.dumps([{"lr": "fast\x1b[2J"}]),
             "param group 0's 'lr' = 'fast\\x1b[2J' is not a number"),
            (json.dumps([{"betas": [0.9]}]), "'betas' = [0.9] is not a list of 2 numbers"),
            (json.dumps([{"amsgrad": 1}]), "'amsgrad' = 1 is not a bool"),
            (json.dumps([{"initial_lr": {"a": [[[[1]]]]}}]),
             "'initial_lr' = {'a': [[[...]]]} is not null, a bool, a number"),
            (json.dumps([{"params": [0, 1]}]), "'params'"),
        ]
        for text, expected in cases:
            with self.subTest(text=text[:40]):
                with open(groups_file, "w") as f:
                    f.write(text)
                fresh = make_model(8)
                before = [p.detach().clone() for p in fresh.parameters()]
                other = st.OffloadAdamW(fresh, lr=3e-3, betas=(0.9, 0.95), bucket_size=5000)
                with self.assertRaises(ValueError) as raised:
                    other.load(ckpt)
                message = str(raised.exception)
                self.assertIn(groups_file, message)
                self.assertIn(expected, message)
                self.assertNotIn("\n", message)
                self.assertTrue(all(ord(c) >= 0x20 and c != "\x7f" for c in message), message)
                self.assertEqual(other.param_groups[0]["lr"], 3e-3)
                self.assertTrue(all(torch.equal(p, q) for p, q in zip(fresh.parameters(), before)))
                other.close()
        with open(groups_file, "w") as f:
            f.write(saved)
        fresh = make_model(8)
        other = st.OffloadAdamW(fresh, lr=1e-3, betas=(0.9, 0.95), bucket_size=5000)
        other.load(ckpt)
        self.assertEqual(other.param_groups[0]["lr"], 3e-3)
        self.assert_params_equal(fresh, model, "loaded")
        other.close()


    def test_param_group_keys_the_optimizer_does_not_read_round_trip(self):
        # torch adds param_names to groups built from named parameters; users add their own.
        ckpt = os.path.join(self.tmp.name, "ckpt")
        model = make_model(7)
        opt = st.OffloadAdamW(model, lr=3e-3, betas=(0.9, 0.95), bucket_size=5000)
        train(model, opt, 2)
        opt.param_groups[0]["param_names"] = ["0.weight", "0.bias"]
        opt.param_groups[0]["tags"] = {"stage": "warmup"}
        opt.save(ckpt)
        other = st.OffloadAdamW(make_model(8), lr=1e-3, betas=(0.9, 0.95), bucket_size=5000)
        other.load(ckpt)
        self.assertEqual(other.param_groups[0]["param_names"], ["0.weight", "0.bias"])
        self.assertEqual(other.param_groups[0]["tags"], {"stage": "warmup"})
        self.assertEqual(other.param_groups[0]["lr"], 3e-3)
        self.assertEqual(other.param_groups[0]["betas"], (0.9, 0.95))
        # Against a live group holding the key, the saved value must be of its kind.
        other.param_groups[0]["tags"] = {"stage": "other"}
        groups_file = os.path.join(ckpt, "torch_param_groups.json")
        with open(groups_file) as f:
            groups = json.load(f)
        groups[0]["tags"] = 3
        with open(groups_file, "w") as f:
            json.dump(groups, f)
        with self.assertRaises(ValueError) as raised:
            other.load(ckpt)
        self.assertIn(groups_file, str(raised.exception))
        self.assertIn("param group 0's 'tags' = 3 is not an object", str(raised.exception))
        self.assertEqual(other.param_groups[0]["tags"], {"stage": "other"})
        other.close()
        opt.close()

    def test_a_param_group_json_cannot_hold_fails_before_the_save_changes_anything(self):
        ckpt = os.path.join(self.tmp.name, "ckpt")
        model = tiny_mlp(7)
        opt = st.OffloadAdamW(model, lr=1e-2, bucket_size=TINY_BUCKET)
        tiny_step(model, opt, 0)
        opt.save(ckpt)
        opt.synchronize()
        saved = [p.detach().clone() for p in model.parameters()]
        tiny_step(model, opt, 1)
        opt.param_groups[0]["lr"] = torch.tensor(5e-3)
        with self.assertRaisesRegex(TypeError, r"param group 0's 'lr' = tensor\(0\.0050\) "
                                    "cannot be written as JSON.*nothing was saved"):
            opt.save(ckpt)
        self.assertIn("torch_param_groups.json", os.listdir(ckpt))
        self.assertNotIn("torch_param_groups.json.tmp", os.listdir(ckpt))
        fresh = tiny_mlp(8)
        other = st.OffloadAdamW(fresh, lr=1e-3, bucket_size=TINY_BUCKET)
        other.load(ckpt)
        self.assertEqual(other.param_groups[0]["lr"], 1e-2)
        for p, q in zip(fresh.parameters(), saved):
            self.assertTrue(torch.equal(p, q), "the earlier save was changed")

    def test_load_refuses_a_save_that_did_not_write_its_param_groups(self):
        ckpt = os.path.join(self.tmp.name, "ckpt")
        model = tiny_mlp(9)
        opt = st.OffloadAdamW(model, lr=1e-2, bucket_size=TINY_BUCKET)
        tiny_step(model, opt, 0)
        opt.save(ckpt)
        groups_file = os.path.join(ckpt, "torch_param_groups.json")
        os.replace(groups_file, groups_file + ".tmp")  # as a save interrupted before its rename
        fresh = tiny_mlp(10)
        before = [p.detach().clone() for p in fresh.parameters()]
        other = st.OffloadAdamW(fresh, lr=1e-3, bucket_size=TINY_BUCKET)
        with self.assertRaisesRegex(ValueError, "torch_param_groups.json.tmp but no "
                                    "torch_param_groups.json: a save\\(\\) that did not finish"):
            other.load(ckpt)
        self.assertEqual(other.param_groups[0]["lr"], 1e-3)
        for p, q in zip(fresh.parameters(), before):
            self.assertTrue(torch.equal(p, q), "a refused load changed a parameter")


def resume_main(tmp, out):
    """The fresh process of test_save_and_resume_...: loads the model and the
    optimizer state saved after step 6, trains steps 6..11, writes the weights."""
    model = make_model(123)
    model.load_state_dict(torch.load(os.path.join(tmp, "model.pt")))
    swap = os.path.join(tmp, "swap2")
    os.mkdir(swap)
    opt = st.OffloadAdamW(model, lr=3e-3, offload="nvme", nvme_path=swap, bucket_size=5000)
    opt.load(os.path.join(tmp, "ckpt"))
    train(model, opt, 6, first_step=6)
    torch.save(model.state_dict(), out)


class DeepSpeedConfigTest(OffloadTestCase):
    def config(self):
        return {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW",
                          "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {
                "device": "nvme", "nvme_path": self.tmp.name, "pin_memory": True,
                "buffer_count": 3}},
            "gradient_clipping": 1.0,
            "fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500},
        }

    def test_config_file_gives_the_optimizer_and_scaler_it_describes(self):
        path = os.path.join(self.tmp.name, "ds.json")
        with open(path, "w") as f:
            json.dump(self.config(), f)
        model, ref = make_model(8), make_model(8)
        opt, scaler = st.from_deepspeed_config(path, model)
        self.assertIsInstance(opt, st.OffloadAdamW)
        self.assertEqual(opt.max_grad_norm, 1.0)
        self.assertEqual(opt.param_groups[0]["betas"], (0.9, 0.95))
        self.assertEqual(scaler.get_scale(), 2.0 ** 12)
        self.assertEqual(scaler.get_growth_interval(), 500)
        ref_opt = st.OffloadAdamW(ref, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1,
                                  max_grad_norm=1.0)
        for step in range(3):
            scaler.scale(model(*batch(step))).backward()
            scaler.step(opt)
            scaler.update()
            ref(*batch(step)).backward()
            ref_opt.step()
        opt.synchronize()
        ref_opt.synchronize()
        # Power-of-two loss scales are exact: the same numbers as unscaled.
        self.assert_params_equal(model, ref, "DeepSpeed config vs direct")

    def test_semantic_keys_it_cannot_honour_are_refused_by_name(self):
        for patch, key in [({"scheduler": {"type": "WarmupLR"}}, "scheduler"),
                           ({"zero_optimization": {"offload_param": {"device": "cpu"}}},
                            "offload_param"),
                           ({"fp16": {"enabled": True, "hysteresis": 0}}, "hysteresis"),
                           ({"optimizer": {"type": "OneBitAdam", "params": {}}}, "OneBitAdam")]:
            with self.subTest(key):
                config = dict(self.config(), **patch)
                with self.assertRaisesRegex(ValueError, key):
                    st.from_deepspeed_config(config, make_model())


    def test_a_bad_value_in_a_config_file_names_the_file_and_the_key(self):
        path = os.path.join(self.tmp.name, "ds.json")
        cases = [
            ("{\"optimizer\": ", "ds.json: not a JSON file"),
            ("[" * 5000 + "]" * 5000, "ds.json: not a JSON file"),
            ({"zero_optimization": {"offload_optimizer": {"device": "cpu",
                                                          "buffer_count": "four"}}},
             "ds.json: zero_optimization.offload_optimizer.buffer_count: must be a number, "
             "got 'four'"),
            ({"zero_optimization": {"offload_optimizer": {"device": "cpu",
                                                          "pin_memory": "yes"}}},
             "pin_memory: must be true or false"),
            ({"gradient_clipping": None}, "ds.json: gradient_clipping: must be a number"),
            ({"gradient_clipping": 1e300}, "gradient_clipping: 1e+300 does not fit fp32"),
            ({"zero_optimization": {"reduce_bucket_size": 2.5}},
             "zero_optimization.reduce_bucket_size: must be an integer, got 2.5"),
            ({"fp16": {"enabled": True, "initial_scale_power": 100000}},
             "fp16.initial_scale_power: must be in [0, 127]"),
            ({"fp16": {"enabled": True, "loss_scale_window": [1]}},
             "fp16.loss_scale_window: must be a number, got [1]"),
            ({"optimizer": {"type": "Adam\x1b[2J", "params": {}}},
             "optimizer.type: 'Adam\\x1b[2J' is not one of"),
            ({"optimizer": {"type": "AdamW", "params": [0.1]}},
             "optimizer.params: must be a JSON object"),
            ({"zero_optimization": {"stage": 2, "x" * 500: 1}}, "unknown or unsupported key 'xxx"),
        ]
        for patch, expected in cases:
            with self.subTest(expected=expected):
                with open(path, "w") as f:
                    if isinstance(patch, str):
                        f.write(patch)
                    else:
                        config = self.config()
                        for key, value in patch.items():
                            if isinstance(value, dict) and isinstance(config.get(key), dict):
                                merged = dict(config[key])
                                for k, v in value.items():
                                    if isinstance(v, dict) and isinstance(merged.get(k), dict):
                                        merged[k] = dict(merged[k], **v)
                                    else:
                                        merged[k] = v
                                config[key] = merged
                            else:
                                config[key] = value
                        json.dump(config, f)
                with self.assertRaises(ValueError) as raised:
                    st.from_deepspeed_config(path, make_model())
                message = str(raised.exception)
                self.assertIn(expected, message)
                self.assertIn(path, message)
                self.assertLess(len(message), 1000, message)
                self.assertTrue(all(ord(c) >= 0x20 and c != "\x7f" for c in message), message)

class Boom(torch.autograd.Function):
    """Identity forward; its backward raises (a backward that fails halfway)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom")


class SharedTwice(torch.nn.Module):
    """One linear layer applied twice, each time under torch.utils.checkpoint."""

    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(3)
        self.inp = torch.nn.Linear(4, 4)
        self.shared = torch.nn.Linear(4, 4)
        self.out = torch.nn.Linear(4, 1)
        self.reentrant = reentrant

    def forward(self, x):
        x = self.inp(x)
        for _ in range(2):
            x = torch.utils.checkpoint.checkpoint(lambda y: torch.tanh(self.shared(y)), x,
                                                  use_reentrant=self.reentrant)
        return self.out(x).square().mean()


class GradientLifecycleTest(OffloadTestCase):
    """zero_grad() discards what Strata holds (strata_offload_discard_grads), a
    gradient in pieces is named, and parameters changed in place reach the masters."""

    def test_zero_grad_discards_a_whole_backward_as_torch(self):
        ref = make_model()
        ref_opt = st.OffloadAdamW(ref, bucket_size=3000)
        train(ref, ref_opt, 3)
        model = make_model()
        opt = st.OffloadAdamW(model, bucket_size=3000)
        for step in range(3):
            model(*batch(100 + step)).backward()  # discarded by train()'s zero_grad
            train(model, opt, 1, first_step=step)
        opt.synchronize()
        self.assert_params_equal(model, ref, "after discarded backward passes")

    def test_a_backward_that_raised_halfway_is_discarded_by_zero_grad(self):
        for offload in ("cpu", "nvme"):
            kwargs = dict(bucket_size=3000, staging_buffers=2, offload=offload,
                          nvme_path=self.tmp.name if offload == "nvme" else None)
            ref = make_model()
            ref_opt = st.OffloadAdamW(ref, **kwargs)
            train(ref, ref_opt, 4)
            model = make_model()
            opt = st.OffloadAdamW(model, **kwargs)
            block = model.blocks[1]
            plain = block.forward
            for step in range(4):
                if step in (0, 2):  # at the first step, and with an update in flight
                    block.forward = lambda x: plain(Boom.apply(x))
                    with self.assertRaisesRegex(RuntimeError, "boom"):
                        model(*batch(50 + step)).backward()
                    block.forward = plain
                    self.assertTrue(any(b.count or b.micro_batches for b in opt._buckets),
                                    "the failed backward handed some gradients over")
                train(model, opt, 1, first_step=step)
            opt.synchronize()
            self.assert_params_equal(model, ref, f"{offload}: after two failed backward passes")
            ref_opt.close()
            opt.close()

    def test_a_parameter_in_two_reentrant_checkpoints_is_named_and_recoverable(self):
        x = torch.randn(3, 4, requires_grad=True)
        model = SharedTwice(reentrant=True)
        opt = st.OffloadAdamW(model, bucket_size=20)
        with self.assertRaisesRegex(RuntimeError, r"shared\.\w+ .* received a second gradient in "
                                    r"one backward before .* use_reentrant=False"):
            model(x).backward()
        opt.zero_grad()
        model.reentrant = False  # the recipe the message gives: one gradient per parameter
        ref = SharedTwice(reentrant=False)
        ref_opt = torch.optim.AdamW(ref.parameters())
        for _ in range(3):
            opt.zero_grad()
            ref_opt.zero_grad()
            model(x).backward()
            ref(x).backward()
            opt.step()
            ref_opt.step()
        opt.synchronize()
        self.assert_params_close(model, ref, "non-reentrant checkpoints after the refusal")

    def test_weights_loaded_after_the_optimizer_was_made_are_the_ones_trained(self):
        for dtype in (torch.float32, torch.bfloat16):
            source = make_model(1, dtype)
            model = make_model(0, dtype)
            opt = st.OffloadAdamW(model)  # attached: step() returns before the update ends
            train(model, opt, 2)
            model.load_state_dict(source.state_dict())  # right after a step
            fresh = make_model(1, dtype)
            fresh_opt = st.OffloadAdamW(fresh)
            # The moments of the first two steps differ; the weights start from the same.
            fresh_opt.load_state_dict(opt.state_dict())
            self.assert_params_equal(model, source, f"{dtype}: the loaded weights, kept")
            train(model, opt, 3, first_step=2)
            train(fresh, fresh_opt, 3, first_step=2)
            self.assert_params_equal(model, fresh, f"{dtype}: trained from the loaded weights")

    def test_a_bf16_parameter_changed_in_place_keeps_the_masters_of_the_rest(self):
        model = make_model(5, torch.bfloat16)
        opt = st.OffloadAdamW(model, lr=1e-2)
        train(model, opt, 3)
        before = opt.state_dict()["state"][0]["master"].clone()
        weight = next(model.parameters())
        with torch.no_grad():
            weight[0, 0] = 0.5  # advances the version counter
        after = opt.state_dict()["state"][0]["master"]
        self.assertEqual(after[0, 0].item(), 0.5)
        after[0, 0] = before[0, 0]
        self.assertTrue(torch.equal(after, before), "the unchanged elements keep their fp32 bits")

    def test_reload_parameters_reads_a_change_the_version_counter_missed(self):
        model = make_model(0)
        opt = st.OffloadAdamW(model)
        train(model, opt, 1)
        saved = opt.state_dict()
        weight = next(model.parameters())
        version = weight._version
        weight.data.copy_(torch.full_like(weight, 0.25))
        self.assertEqual(weight._version, version, "p.data bypasses the counter")
        opt.reload_parameters()
        fresh = make_model(0)
        fresh.load_state_dict(model.state_dict())
        fresh_opt = st.OffloadAdamW(fresh)
        fresh_opt.load_state_dict(saved)  # fp32: the masters come from fresh's parameters
        train(model, opt, 2, first_step=1)
        train(fresh, fresh_opt, 2, first_step=1)
        self.assert_params_equal(model, fresh, "trained from the reloaded weights")


class BadUseTest(OffloadTestCase):
    def test_unwritable_nvme_path_is_a_clear_error(self):
        blocker = os.path.join(self.tmp.name, "a-file")
        open(blocker, "w").close()
        with self.assertRaises(strata.StrataError) as cm:
            st.OffloadAdamW(make_model(), offload="nvme", nvme_path=os.path.join(blocker, "x"))
        self.assertIn("a-file", str(cm.exception))

    def test_wrong_offload_value_is_a_value_error(self):
        with self.assertRaisesRegex(ValueError, "offload must be"):
            st.OffloadAdamW(make_model(), offload="gpu")
        with self.assertRaisesRegex(ValueError, "needs nvme_path"):
            st.OffloadAdamW(make_model(), offload="nvme")

    def test_parameter_without_gradient_at_step_is_named(self):
        model = make_model()
        model.unused = torch.nn.Linear(3, 3)
        opt = st.OffloadAdamW(model, bucket_size=1 << 20)
        model(*batch(0)).backward()
        with self.assertRaisesRegex(RuntimeError, r"unused\.weight.*received no gradient"):
            opt.step()

    def test_step_before_backward_is_an_error(self):
        model = make_model()
        opt = st.OffloadAdamW(model)
        with self.assertRaisesRegex(RuntimeError, "no gradient since the last step"):
            opt.step()
        model(*batch(0)).backward()
        opt.step()
        opt.zero_grad()  # after a step: nothing to discard

    def test_frozen_parameters_are_left_out(self):
        model = make_model()
        model.unused = torch.nn.Linear(3, 3).requires_grad_(False)
        before = model.unused.weight.detach().clone()
        opt = st.OffloadAdamW(model)
        train(model, opt, 2)
        self.assertTrue(torch.equal(model.unused.weight, before))

    def test_strata_torch_does_not_shadow_torch(self):
        self.assertIs(sys.modules["torch"], torch)
        self.assertTrue(hasattr(torch, "nn"))
        self.assertIs(strata.torch, st)
        self.assertTrue(issubclass(st.OffloadAdamW, torch.optim.Optimizer))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--resume":
        resume_main(sys.argv[2], sys.argv[3])
    else:
        unittest.main()
