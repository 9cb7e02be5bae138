"""strata.torch.OffloadAdamW8bit and OffloadAdafactor (8-bit and factored state
in the offload optimizer) against strata.optim.AdamW8bit / Adafactor, and the
state_dict of every strata.torch optimizer against its strata.optim twin.

Both sides run libstrata's kernels on the same parameters with the same
gradients (the offload optimizer steps each parameter as one tensor with its
shape, as strata.optim does): every parameter and every state tensor must be
equal BIT FOR BIT, with state on the CPU and on NVMe, after a state_dict round
trip and after save/load in a fresh process. The model is test_offload_torch's
small GPT (2-D weights, 1-D biases and norms, embeddings; some parameters span
several 2048-element quantization blocks), split into several buckets that mix
parameters of different dimensions.
"""

import copy
import os
import subprocess
import sys
import tempfile
import unittest

import torch

import strata.optim
import strata.torch as st
from test_offload_torch import batch, make_model, train

BUCKET = 5000  # elements: several buckets, each holding 1-D and 2-D parameters
STEPS = 20

# name: (strata.torch class, strata.optim class, hyper-parameters)
CASES = {
    "adamw8bit": (st.OffloadAdamW8bit, strata.optim.AdamW8bit,
                  dict(lr=3e-3, weight_decay=0.1)),
    # relative_step and scale_parameter (transformers' defaults) depend on the step
    # count and on each parameter's RMS; beta1 adds exp_avg.
    "adafactor": (st.OffloadAdafactor, strata.optim.Adafactor,
                  dict(beta1=0.9, weight_decay=0.01)),
    "adafactor_lr": (st.OffloadAdafactor, strata.optim.Adafactor,
                     dict(lr=1e-2, relative_step=False, scale_parameter=False,
                          clip_threshold=0.5)),
}


class OffloadStateTestCase(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="strata-offload-state-")
        self.addCleanup(self.tmp.cleanup)

    def offload(self, name, model, offload, **extra):
        cls, _, kwargs = CASES[name]
        options = dict(offload=offload, bucket_size=BUCKET)
        if offload == "nvme":
            swap = tempfile.mkdtemp(dir=self.tmp.name)
            options["nvme_path"] = swap
        options.update(extra)
        return cls(model, **kwargs, **options)

    def assert_params_equal(self, model, ref, what):
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            self.assertTrue(torch.equal(p, q), f"{what}: {name} differs "
                            f"(max {(p.double() - q.double()).abs().max().item():.3g})")

    def assert_state_dicts_equal(self, sd, ref_sd, what):
        """Same param_groups, same entries, same keys, and every tensor of the same
        dtype, shape and bits."""
        self.assertEqual(sd["param_groups"], ref_sd["param_groups"], what)
        self.assertEqual(sorted(sd["state"]), sorted(ref_sd["state"]), what)
        for i, entry in sd["state"].items():
            ref_entry = ref_sd["state"][i]
            self.assertEqual(set(entry), set(ref_entry), f"{what}: keys of state {i}")
            for key, value in entry.items():
                ref_value = ref_entry[key]
                if value is None or ref_value is None:
                    self.assertIs(value, ref_value, f"{what}: state {i} {key}")
                    continue
                self.assertEqual(value.dtype, ref_value.dtype, f"{what}: state {i} {key}")
                self.assertEqual(value.shape, ref_value.shape, f"{what}: state {i} {key}")
                self.assertTrue(torch.equal(value, ref_value), f"{what}: state {i} {key}")


class EquivalenceTest(OffloadStateTestCase):
    def test_offload_optimizers_equal_strata_optim_bit_for_bit_on_cpu_and_nvme(self):
        for name, (cls, twin, kwargs) in CASES.items():
            for offload in ("cpu", "nvme"):
                with self.subTest(name, offload=offload):
                    model, ref = make_model(11), make_model(11)
                    opt = self.offload(name, model, offload)
                    self.assertGreater(len(opt._buckets), 2, "the test wants several buckets")
                    self.assertTrue(any(len({p.dim() for p in b.params}) > 1
                                        for b in opt._buckets),
                                    "the test wants buckets mixing 1-D and 2-D parameters")
                    ref_opt = twin(ref.parameters(), **kwargs)
                    losses, ref_losses = [], []
                    train(model, opt, STEPS, losses=losses)
                    train(ref, ref_opt, STEPS, losses=ref_losses)
                    self.assertLess(ref_losses[-1], ref_losses[0], "the model should learn")
                    self.assertEqual(losses, ref_losses)
                    self.assert_params_equal(model, ref, f"{name} {offload}")
                    self.assert_state_dicts_equal(opt.state_dict(), ref_opt.state_dict(),
                                                  f"{name} {offload}")
                    for p in model.parameters():
                        self.assertIsNone(p.grad)
                    if offload == "nvme":
                        self.assertGreater(opt.stats()["nvme_bytes_written"], 0)
                    opt.close()

    def test_per_element_optimizers_keep_their_torch_format_bit_for_bit(self):
        # The per-element kinds read through the sections too: one fp32 tensor per
        # key shaped like the parameter, as strata.optim (torch's format) keeps it.
        cases = [
            (st.OffloadAdamW, strata.optim.AdamW, dict(lr=3e-3, weight_decay=0.1)),
            (st.OffloadAdam, strata.optim.Adam, dict(lr=2e-3, amsgrad=True)),
            (st.OffloadSGD, strata.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
            (st.OffloadSGD, strata.optim.SGD, dict(lr=0.05)),
            (st.OffloadAdagrad, strata.optim.Adagrad,
             dict(lr=0.02, initial_accumulator_value=0.1)),
            (st.OffloadLion, strata.optim.Lion, dict(lr=1e-3, weight_decay=0.1)),
        ]
        for cls, twin, kwargs in cases:
            with self.subTest(cls.__name__, **kwargs):
                model, ref = make_model(21), make_model(21)
                opt = cls(model, bucket_size=BUCKET, **kwargs)
                ref_opt = twin(ref.parameters(), **kwargs)
                train(model, opt, 4)
                train(ref, ref_opt, 4)
                self.assert_params_equal(model, ref, cls.__name__)
                self.assert_state_dicts_equal(opt.state_dict(), ref_opt.state_dict(),
                                              cls.__name__)
                opt.close()

    def test_state_dict_holds_8bit_codes_and_factored_moments_per_parameter(self):
        model = make_model(12)
        opt = self.offload("adamw8bit", model, "cpu")
        train(model, opt, 2)
        sd = opt.state_dict()
        names = [n for n, _ in model.named_parameters()]
        fc = model.blocks[0].fc.weight  # 128 x 32: 2 blocks
        entry = sd["state"][names.index("blocks.0.fc.weight")]
        self.assertEqual(entry["exp_avg"].dtype, torch.uint8)
        self.assertEqual(entry["exp_avg"].shape, fc.shape)
        self.assertEqual(entry["exp_avg_sq"].dtype, torch.uint8)
        self.assertEqual(tuple(entry["exp_avg.absmax"].shape), (2,))
        self.assertEqual(entry["exp_avg_sq.absmax"].dtype, torch.float32)
        self.assertEqual(float(entry["step"]), 2.0)

        model = make_model(12)
        opt = self.offload("adafactor", model, "cpu")
        train(model, opt, 2)
        sd = opt.state_dict()
        weight = sd["state"][names.index("blocks.0.fc.weight")]
        self.assertEqual(set(weight), {"step", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg"})
        self.assertEqual(tuple(weight["exp_avg_sq_row"].shape), (128,))
        self.assertEqual(tuple(weight["exp_avg_sq_col"].shape), (32,))
        self.assertEqual(weight["exp_avg"].shape, (128, 32))
        bias = sd["state"][names.index("blocks.0.fc.bias")]
        self.assertEqual(set(bias), {"step", "exp_avg_sq", "exp_avg"})
        self.assertEqual(bias["exp_avg_sq"].shape, (128,))

    def test_bf16_parameters_get_their_masters_and_the_8bit_state(self):
        model = make_model(13, torch.bfloat16)
        opt = self.offload("adamw8bit", model, "cpu")
        train(model, opt, 3)
        sd = opt.state_dict()
        for i, p in enumerate(model.parameters()):
            entry = sd["state"][i]
            self.assertEqual(entry["master"].dtype, torch.float32)
            self.assertTrue(torch.equal(entry["master"].to(torch.bfloat16), p))
            self.assertEqual(entry["exp_avg"].dtype, torch.uint8)


class ResumeTest(OffloadStateTestCase):
    def test_state_dict_round_trip_resumes_bit_identically(self):
        for name in CASES:
            for offload in ("cpu", "nvme"):
                with self.subTest(name, offload=offload):
                    model = make_model(14)
                    opt = self.offload(name, model, offload)
                    train(model, opt, 5)
                    sd = copy.deepcopy(opt.state_dict())
                    other = make_model(98)
                    other.load_state_dict(model.state_dict())
                    # Another bucketing: the state_dict is per parameter.
                    other_opt = self.offload(name, other, offload, bucket_size=7000)
                    other_opt.load_state_dict(sd)
                    self.assert_state_dicts_equal(other_opt.state_dict(), sd, "reloaded")
                    train(model, opt, 4, first_step=5)
                    train(other, other_opt, 4, first_step=5)
                    self.assert_params_equal(other, model, f"{name} after load_state_dict")
                    self.assert_state_dicts_equal(other_opt.state_dict(), opt.state_dict(),
                                                  f"{name} after load_state_dict")
                    opt.close()
                    other_opt.close()

    def test_strata_optim_state_dict_loads_into_the_offload_optimizer_and_back(self):
        for name, (cls, twin, kwargs) in CASES.items():
            with self.subTest(name):
                model, ref = make_model(15), make_model(15)
                ref_opt = twin(ref.parameters(), **kwargs)
                train(ref, ref_opt, 4)
                model.load_state_dict(ref.state_dict())
                opt = self.offload(name, model, "cpu")
                opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
                train(ref, ref_opt, 3, first_step=4)
                train(model, opt, 3, first_step=4)
                self.assert_params_equal(model, ref, f"{name} from strata.optim's state")
                back = make_model(16)
                back.load_state_dict(model.state_dict())
                back_opt = twin(back.parameters(), **kwargs)
                back_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
                train(ref, ref_opt, 2, first_step=7)
                train(back, back_opt, 2, first_step=7)
                self.assert_params_equal(back, ref, f"{name} back into strata.optim")

    def test_save_and_load_in_a_fresh_process_resume_bit_identically(self):
        for name in CASES:
            for offload in ("cpu", "nvme"):
                with self.subTest(name, offload=offload):
                    work = tempfile.mkdtemp(dir=self.tmp.name)
                    ckpt = os.path.join(work, "ckpt")
                    model = make_model(17)
                    opt = self.offload(name, model, offload)
                    train(model, opt, 6)
                    opt.save(ckpt)
                    torch.save(model.state_dict(), os.path.join(work, "model.pt"))
                    train(model, opt, 6, first_step=6)
                    out = os.path.join(work, "resumed.pt")
                    subprocess.run([sys.executable, os.path.abspath(__file__), "--resume", name,
                                    offload, work, out], check=True, timeout=300)
                    resumed = make_model(17)
                    resumed.load_state_dict(torch.load(out))
                    self.assert_params_equal(resumed, model, f"{name} {offload} resumed")
                    saved = torch.load(out + ".opt")
                    self.assert_state_dicts_equal(saved, opt.state_dict(),
                                                  f"{name} {offload} resumed")
                    opt.close()


class BadStateTest(OffloadStateTestCase):
    def test_a_state_dict_of_another_representation_is_refused_before_anything_changes(self):
        model = make_model(18)
        opt = self.offload("adamw8bit", model, "cpu")
        train(model, opt, 2)
        before = opt.state_dict()
        weights = [p.detach().clone() for p in model.parameters()]
        # AdamW's fp32 moments carry the same names as the 8-bit codes.
        ref = make_model(18)
        adamw = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
        train(ref, adamw, 2)
        with self.assertRaisesRegex(ValueError, "exp_avg.*torch.float32.*torch.uint8"):
            opt.load_state_dict(adamw.state_dict())
        bad = copy.deepcopy(before)
        bad["state"][5]["exp_avg.absmax"] = torch.zeros(7)
        with self.assertRaisesRegex(ValueError, r"exp_avg\.absmax.*keeps 1 values"):
            opt.load_state_dict(bad)
        self.assert_state_dicts_equal(opt.state_dict(), before, "after refused loads")
        for p, w in zip(model.parameters(), weights):
            self.assertTrue(torch.equal(p, w))

    def test_adafactor_state_without_its_factored_rows_is_refused(self):
        model = make_model(19)
        opt = self.offload("adafactor", model, "cpu")
        train(model, opt, 1)
        sd = opt.state_dict()
        names = [n for n, _ in model.named_parameters()]
        del sd["state"][names.index("head.weight")]["exp_avg_sq_row"]
        with self.assertRaisesRegex(ValueError, r"head\.weight.*exp_avg_sq_row"):
            opt.load_state_dict(sd)

    def test_options_that_shape_the_state_cannot_change_on_load(self):
        # Adafactor's beta1 on/off decides whether 'exp_avg' exists; two groups, so
        # that a refusal after the first group's config was applied would show.
        def groups(m):
            return [{"params": [p for p in m.parameters() if p.dim() >= 2]},
                    {"params": [p for p in m.parameters() if p.dim() < 2]}]

        with_beta1 = make_model(23)
        opt = st.OffloadAdafactor(groups(with_beta1), beta1=0.9)
        train(with_beta1, opt, 1)
        sd = opt.state_dict()
        model = make_model(23)
        plain = st.OffloadAdafactor(groups(model), lr=1e-2, relative_step=False)
        train(model, plain, 1)
        before = plain.state_dict()
        sd["param_groups"][0]["beta1"] = None  # only the second group differs
        with self.assertRaisesRegex(ValueError, r"param group 1 was saved with beta1=0\.9"):
            plain.load_state_dict(sd)
        self.assert_state_dicts_equal(plain.state_dict(), before, "after a refused load")
        train(model, plain, 1, first_step=1)  # the configs in Strata are unchanged too
        ref = make_model(23)
        ref_opt = strata.optim.Adafactor(groups(ref), lr=1e-2, relative_step=False)
        train(ref, ref_opt, 2)
        self.assert_params_equal(model, ref, "after a refused load")

    def test_amsgrad_is_refused_by_the_8bit_optimizer(self):
        model = make_model(20)
        opt = self.offload("adamw8bit", model, "cpu")
        train(model, opt, 1)
        sd = opt.state_dict()
        sd["param_groups"][0]["amsgrad"] = True
        with self.assertRaisesRegex(ValueError, "amsgrad"):
            opt.load_state_dict(sd)


class DeepSpeedConfigTest(OffloadStateTestCase):
    def test_adamw8bit_and_adafactor_types_give_those_optimizers(self):
        cases = [("AdamW8bit", st.OffloadAdamW8bit, {"lr": 3e-3, "betas": [0.9, 0.95]},
                  dict(lr=3e-3, betas=(0.9, 0.95))),
                 ("adafactor", st.OffloadAdafactor,
                  {"beta1": 0.9, "eps": [1e-30, 2e-3], "weight_decay": 0.01},
                  dict(beta1=0.9, eps=(1e-30, 2e-3), weight_decay=0.01))]
        for kind, cls, params, kwargs in cases:
            with self.subTest(kind):
                config = {"optimizer": {"type": kind, "params": params},
                          "zero_optimization": {"stage": 2, "offload_optimizer": {
                              "device": "nvme", "nvme_path": self.tmp.name}},
                          "gradient_clipping": 0.5}
                model, ref = make_model(22), make_model(22)
                opt, scaler = st.from_deepspeed_config(config, model)
                self.assertIs(type(opt), cls)
                self.assertFalse(scaler.is_enabled())
                ref_opt = cls(ref, max_grad_norm=0.5, **kwargs)
                self.assertEqual(opt.param_groups[0]["lr"], ref_opt.param_groups[0]["lr"])
                train(model, opt, 3)
                train(ref, ref_opt, 3)
                self.assertGreater(opt.grad_norm, 0.5, "clipping must be active in this test")
                self.assert_params_equal(model, ref, f"{kind} from a DeepSpeed config")
                self.assert_state_dicts_equal(opt.state_dict(), ref_opt.state_dict(), kind)
                opt.close()
                ref_opt.close()


def resume_main(name, offload, work, out):
    """The fresh process of test_save_and_load_...: loads the model and the
    optimizer state saved after step 6 into a new optimizer, trains steps 6..11,
    writes the weights to out and the optimizer's state_dict to out + '.opt'."""
    model = make_model(321)
    model.load_state_dict(torch.load(os.path.join(work, "model.pt")))
    cls, _, kwargs = CASES[name]
    options = dict(offload=offload, bucket_size=BUCKET)
    if offload == "nvme":
        options["nvme_path"] = tempfile.mkdtemp(dir=work)
    # Hyper-parameters other than the saved ones: load() restores the saved ones.
    kwargs = dict(kwargs, weight_decay=0.5)
    opt = cls(model, **kwargs, **options)
    opt.load(os.path.join(work, "ckpt"))
    train(model, opt, 6, first_step=6)
    torch.save(model.state_dict(), out)
    torch.save(opt.state_dict(), out + ".opt")
    opt.close()


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--resume":
        resume_main(*sys.argv[2:])
    else:
        unittest.main()
