"""Strata's preference objectives against PyTorch implementations of TRL's formulas (issue 46):
the loss, the logged metrics and every gradient of a tiny Llama and a tiny GPT-2 under DPO (with
and without label smoothing), IPO and SimPO, on the same weights and data.

The models, their Hugging Face directories, the float64 forwards of LlamaForCausalLM and
GPT2LMHeadModel, the PEFT adapter writer and the LoRA forward are test_hf_families.py's (imported
as `hf`, not copied); this file adds the per-target log-probabilities (each reference forward ends
in hf.mean_cross_entropy(logits, targets): policy_logits swaps that one module global for a
function that hands the logits back, so the very same forward yields them), and TRL's formulas,
written here from TRL's source:

- DPOTrainer.get_batch_logps: each completion's log-probability is the sum over its targets of
  log_softmax(logits)[target] (labels != ignored); divided by the target count ("average_log_prob")
  for IPO (DPOTrainer, loss_type "ipo") and SimPO (CPOTrainer, loss_type "simpo").
- DPOTrainer.dpo_loss: logits = (pi_c - pi_r) - (ref_c - ref_r);
  sigmoid: -logsigmoid(beta logits)(1 - label_smoothing) - logsigmoid(-beta logits) label_smoothing;
  ipo: (logits - 1 / (2 beta))^2; rewards beta (pi - ref), detached.
- CPOTrainer.cpo_loss, simpo: logits = (pi_c - pi_r) - simpo_gamma / beta, the sigmoid loss of
  beta logits with label smoothing; rewards beta pi, detached.
- The NLL term (DPOConfig.rpo_alpha in DPOTrainer, CPOConfig.cpo_alpha in CPOTrainer): alpha
  times nll_loss, the cross-entropy of the chosen rows' logits against their labels with the
  ignored targets left out (one F.cross_entropy over them: a mean over the chosen targets), added
  to the loss; TRL computes it per forward batch, the engine per step (this step's).
- The step's loss is the mean over all of its pairs (here 3: a micro-batch of 2 pairs and one of
  1, engine/preference_objective.h); the metrics (rewards/chosen, rewards/rejected,
  rewards/accuracies, rewards/margins, logps/chosen, logps/rejected) are means over them.

Each micro-batch has B = 4 rows of T = 12 positions, row 2k the chosen and row 2k + 1 the
rejected completion of its pair k (rows past 2 pairs hold no target), each row one sequence at
positions 0..T-1 with causal attention: a random prompt shared by the pair's two rows, then
completions of different lengths, then random filler that nothing earlier attends to. The
`hf_gradients` test binary (STRATA_HF_GRADIENTS) runs one fp32 engine step of the objective over
the JSON file written here (--preference, --objective, --metrics-out) and writes the gradient; the
cases:

- full fine-tuning of both models under dpo, dpo with label_smoothing 0.1, ipo and simpo, with
  random reference log-probabilities in the JSON (so the reference matters: SimPO must ignore it);
- full fine-tuning DPO without reference_logps: the engine's reference is the initial weights, the
  policy itself, so the loss is ln 2 to within the fp32 rounding of StepResult::loss and every
  reward and margin is exactly 0;
- LoRA over the tiny Llama (a PEFT adapter with non-zero lora_B, dropout 0, via --lora-init) under
  dpo and ipo, the reference being the base without adapters: the lora_A / lora_B gradients.

Bounds (Higham, "Accuracy and Stability of Numerical Algorithms", ch. 3: a computed sum is off by
at most gamma_n sum |x_i|, so a bound follows the magnitude of the terms, not of the result):

- A completion's log-probability is a sum (or mean) of per-target log-probabilities that all have
  one sign; each is an fp32 logsumexp over V ~ 100 logits, each logit an fp32 sum over C = 24
  products through two layers, so it is off by ~1e-7 of its O(1..5) magnitude, as the eval loss
  of test_hf_families.py is (measured there within 1e-7 of float64). LOGP_REL_TOL =
  hf.EVAL_REL_TOL = 1e-5 of |log-probability| leaves two orders of margin, while a wrong
  completion boundary or count moves it by a whole target's log-probability, O(1 / 10) of it.
- The loss and every metric are functions of the completions' log-probabilities x_i computed by
  the engine (the policy's; with LoRA also the reference's): each is compared within its
  first-order error sum_i |dq/dx_i| LOGP_REL_TOL |x_i| (the derivatives by float64 autograd; exact
  for the rewards, margins and logps, which are linear), plus 2^-24 |loss| for StepResult::loss's
  float. rewards_accuracy must be equal, and every pair's margin is checked to lie beyond its own
  error bound so that the comparison is well defined (or to be 0 exactly, the policy as its
  reference).
- Gradients: the step's gradient is sum_t w_t dCE_t/dtheta with weights w_t = dL/dCE_t of both
  signs (a chosen completion's pull against a rejected one's, on a shared prompt), so an element
  may be a difference of larger terms. Each tensor is compared as assert_gradient_close does
  (|g - ref| <= GRAD_REL_TOL max + GRAD_ABS_TOL, test_hf_families.py's derivation) with the max
  taken over both the gradient and the gradient of sum_t |w_t| CE_t, the same terms with their
  signs made equal: the bound of the terms, not of their difference (up to 3.5 times max|ref|
  here).

Measured: the loss and the metrics land within 0.011 of their bounds, the gradients within 0.05
(0.06 of assert_gradient_close's own bound). Planted in engine/preference_objective.cc, each of
these fails every case it concerns: the wrong sign of a rejected completion's weight, IPO's
log-probabilities summed instead of averaged, and the averaged objectives' weights not divided by
the completion's target count, each by more than 10^4 times a bound; the loss as the mean of the
micro-batches' means (still ln 2 with the policy as its reference, but not its gradient) by more
than 500 times.

Run directly (`/usr/bin/python3 tests/python/test_preference.py`); exits 77 (CTest
SKIP_RETURN_CODE) when torch is not importable; the strata cases SKIP when STRATA_HF_GRADIENTS does
not name an executable file (the reference's self-checks always run).
"""

import json
import math
import os
import shutil
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_hf_families as hf  # noqa: E402  (the models, their forwards, formats and bounds)

torch = hf.torch
F64 = hf.F64
SKIP = hf.SKIP
STRATA_HF_GRADIENTS = hf.STRATA_HF_GRADIENTS
NO_GRADIENTS = hf.NO_GRADIENTS
if torch is not None:
    import torch.nn.functional as F
MEAN_CROSS_ENTROPY = hf.mean_cross_entropy  # policy_logits restores it after each use

B = 4   # rows per micro-batch: 2 pairs at most
T = 12  # positions per row
PAIRS_PER_MICRO_BATCH = (2, 1)
IGNORE = -1
LOGP_REL_TOL = hf.EVAL_REL_TOL
FLOAT_LOSS_REL = 2.0 ** -24  # StepResult::loss is a float

# (name, hf_gradients --objective, options): TRL's defaults (beta 0.1) for DPO; IPO's tau and
# SimPO's beta and gamma in the ranges their papers use.
OBJECTIVES = [
    ("dpo", "dpo", {"beta": 0.1, "label_smoothing": 0.0}),
    ("dpo_smoothed", "dpo", {"beta": 0.1, "label_smoothing": 0.1}),
    ("ipo", "ipo", {"beta": 0.3}),
    ("simpo", "simpo", {"beta": 2.0, "simpo_gamma": 0.8, "label_smoothing": 0.05}),
    ("dpo_rpo", "dpo", {"beta": 0.1, "rpo_alpha": 0.5}),
    ("simpo_cpo", "simpo", {"beta": 2.0, "simpo_gamma": 0.8, "cpo_alpha": 1.0}),
]


def nll_alpha(opts):
    return opts.get("rpo_alpha", opts.get("cpo_alpha", 0.0))
LORA = {"r": 3, "alpha": 6.0, "dropout": 0.0,
        "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def make_models():
    return [hf.Model("pref_llama", hf.llama_config(layers=2, heads=4, kv_heads=2, tied=False),
                     seed=61),
            hf.Model("pref_gpt2", hf.gpt2_config(layers=2), seed=62)]


# ---------------------------------------------------------------------------
# The data.

def make_micro_batches(seed, vocab):
    """PAIRS_PER_MICRO_BATCH micro-batches of (B, T) int64 tokens, targets and sequences (as
    hf_gradients reads them): per pair k a prompt of 2..5 tokens shared by rows 2k and 2k + 1,
    then completions of different lengths (>= 2 tokens), whose tokens are the targets of the
    positions before them (the prompt's last position predicts the completion's first token)."""
    g = torch.Generator().manual_seed(seed)

    def randint(lo, hi):  # [lo, hi]
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    out = []
    for pairs in PAIRS_PER_MICRO_BATCH:
        tokens = torch.randint(0, vocab, (B, T), generator=g)
        targets = torch.full((B, T), IGNORE, dtype=torch.int64)
        sequences = torch.full((B, T), -1, dtype=torch.int64)
        for k in range(pairs):
            prompt = randint(2, 5)
            chosen = randint(2, T - prompt)
            rejected = chosen
            while rejected == chosen:
                rejected = randint(2, T - prompt)
            tokens[2 * k + 1, :prompt] = tokens[2 * k, :prompt]
            for side, length in ((0, chosen), (1, rejected)):
                row = 2 * k + side
                span = slice(prompt - 1, prompt - 1 + length)
                targets[row, span] = tokens[row, prompt:prompt + length]
                sequences[row, span] = row
        out.append({"tokens": tokens, "targets": targets, "sequences": sequences,
                    "pairs": pairs})
    return out


def write_preference_file(path, micro_batches, reference_logps=None):
    """The --preference JSON; reference_logps: per micro-batch a list of 2 pairs floats (or
    None: the field left out)."""
    entries = []
    for i, mb in enumerate(micro_batches):
        e = {key: mb[key].flatten().tolist() for key in ("tokens", "targets", "sequences")}
        e["pairs"] = mb["pairs"]
        if reference_logps is not None:
            e["reference_logps"] = [float(v) for v in reference_logps[i]]
        entries.append(e)
    with open(path, "w") as f:
        json.dump({"micro_batches": entries}, f)


# ---------------------------------------------------------------------------
# The reference: per-target log-probabilities of the imported forwards, TRL's formulas.

def policy_logits(forward, *args):
    """The (B, T, V) logits of a test_hf_families forward (llama_loss, gpt2_loss through
    hf.model_loss, llama_lora_loss): each ends in the module global mean_cross_entropy(logits,
    targets), replaced for the call by one that keeps the logits (the rest of the forward, and its
    autograd graph, is the imported one)."""
    kept = []

    def keep(logits, targets):
        kept.append(logits)
        return logits.new_zeros(())

    saved = hf.mean_cross_entropy
    hf.mean_cross_entropy = keep
    try:
        forward(*args)
    finally:
        hf.mean_cross_entropy = saved
    if len(kept) != 1:
        raise AssertionError(f"the forward computed {len(kept)} losses, expected 1")
    return kept[0]


def get_batch_logps(logits, labels, average_log_prob):
    """TRL DPOTrainer.get_batch_logps on our rows: labels are already the next tokens (the
    engine's targets), so no shift; the per-token log-probabilities (B, T) (0 where ignored) and
    each row's sum, or mean over its targets."""
    loss_mask = labels != IGNORE
    safe = torch.where(loss_mask, labels, torch.zeros_like(labels))
    per_token_logps = torch.gather(logits.log_softmax(-1), 2, safe.unsqueeze(2)).squeeze(2)
    per_token_logps = per_token_logps * loss_mask
    if average_log_prob:
        return per_token_logps, per_token_logps.sum(-1) / loss_mask.sum(-1).clamp(min=1)
    return per_token_logps, per_token_logps.sum(-1)


def dpo_loss(pc, pr, rc, rr, loss_type, beta, label_smoothing=0.0):
    """TRL DPOTrainer.dpo_loss (loss_type "sigmoid" or "ipo")."""
    pi_logratios = pc - pr
    ref_logratios = rc - rr
    logits = pi_logratios - ref_logratios
    if loss_type == "sigmoid":
        losses = (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
                  - F.logsigmoid(-beta * logits) * label_smoothing)
    elif loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2  # eq. 17 of Azar et al.; beta is tau
    else:
        raise ValueError(loss_type)
    chosen_rewards = beta * (pc - rc).detach()
    rejected_rewards = beta * (pr - rr).detach()
    return losses, chosen_rewards, rejected_rewards


def simpo_loss(pc, pr, beta, simpo_gamma, label_smoothing=0.0):
    """TRL CPOTrainer.cpo_loss, loss_type "simpo" (cpo_alpha 0: no NLL term)."""
    logits = pc - pr
    gamma_logratios = simpo_gamma / beta
    logits = logits - gamma_logratios
    losses = (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
              - F.logsigmoid(-beta * logits) * label_smoothing)
    chosen_rewards = beta * pc.detach()
    rejected_rewards = beta * pr.detach()
    return losses, chosen_rewards, rejected_rewards


def trl_losses(objective, opts, pc, pr, rc, rr):
    if objective == "dpo":
        return dpo_loss(pc, pr, rc, rr, "sigmoid", opts["beta"], opts.get("label_smoothing", 0))
    if objective == "ipo":
        return dpo_loss(pc, pr, rc, rr, "ipo", opts["beta"])
    return simpo_loss(pc, pr, opts["beta"], opts["simpo_gamma"], opts.get("label_smoothing", 0))


def averaged(objective):
    return objective != "dpo"


def completion_logps(micro_batches, logits_of, objective):
    """Per micro-batch: the per-token log-probabilities (B, T) and the pair completions' log-
    probabilities [c_0, r_0, c_1, r_1, ...] under logits_of(inputs) (float64, with its graph)."""
    out = []
    for mb in micro_batches:
        per_token, rows = get_batch_logps(logits_of(mb["tokens"]), mb["targets"],
                                          averaged(objective))
        out.append((per_token, rows[:2 * mb["pairs"]]))
    return out


class ReferenceStep:
    """The step's loss, metrics and gradient in float64, with their error bounds.

    policy: per micro-batch (per-token log-probs, completion log-probs) with a graph to the leaves;
    reference: per micro-batch the reference's completion log-probs (no graph), or None for the
    policy's own (detached); reference_from_engine: the engine computes the reference too (its
    rounding enters the bounds); micro_batches: the step's (their chosen rows' targets make the
    NLL term's mean)."""

    def __init__(self, objective, opts, policy, reference, reference_from_engine, micro_batches):
        self.objective, self.opts = objective, opts
        pi = torch.cat([p for _, p in policy])
        ref = pi.detach().clone() if reference is None else \
            torch.cat([torch.as_tensor(r, dtype=F64) for r in reference])
        pc, pr = pi[0::2], pi[1::2]
        rc, rr = ref[0::2], ref[1::2]
        losses, chosen, rejected = trl_losses(objective, opts, pc, pr, rc, rr)
        # nll_loss: minus the mean per-token log-probability over the chosen rows' targets.
        chosen_sum, chosen_count = 0, 0
        for (per_token, _), mb in zip(policy, micro_batches):
            seq = mb["sequences"]
            mask = (seq >= 0) & (seq % 2 == 0)
            chosen_sum = chosen_sum + (per_token * mask).sum()
            chosen_count += int(mask.sum())
        nll = -chosen_sum / chosen_count
        alpha = nll_alpha(opts)
        self.loss = losses.mean() + alpha * nll  # the pairs' mean over all pairs of the step
        self.pairs = len(losses)
        margins = chosen - rejected
        self.metrics = {
            "loss": self.loss.item(), "pairs": self.pairs,
            "rewards_chosen": chosen.mean().item(), "rewards_rejected": rejected.mean().item(),
            "rewards_accuracy": (chosen > rejected).double().mean().item(),
            "rewards_margin": margins.mean().item(),
            "logps_chosen": pc.detach().mean().item(), "logps_rejected": pr.detach().mean().item(),
            "nll_loss": nll.item(),
        }

        # First-order error bounds: |dq/dx| LOGP_REL_TOL |x| over the engine's log-probs x.
        x_pi = pi.detach().clone().requires_grad_()
        x_ref = ref.detach().clone().requires_grad_()
        pair_losses, _, _ = trl_losses(objective, opts, x_pi[0::2], x_pi[1::2], x_ref[0::2],
                                       x_ref[1::2])
        d_pi, d_ref = torch.autograd.grad(pair_losses.mean(), (x_pi, x_ref), allow_unused=True)
        d_ref = d_ref if d_ref is not None else torch.zeros_like(x_ref)
        err_pi = LOGP_REL_TOL * pi.detach().abs()
        err_ref = LOGP_REL_TOL * ref.abs() if reference_from_engine else torch.zeros_like(ref)
        beta = opts["beta"]
        ref_counts = 0 if objective == "simpo" else 1  # SimPO's rewards have no reference
        err_chosen = beta * (err_pi[0::2] + ref_counts * err_ref[0::2])
        err_rejected = beta * (err_pi[1::2] + ref_counts * err_ref[1::2])
        self.pair_margins, self.pair_margin_errors = margins, err_chosen + err_rejected
        self.bounds = {
            # The NLL term: a mean of per-token log-probabilities of one sign, each within
            # LOGP_REL_TOL of itself as the completions' sums are.
            "loss": ((d_pi.abs() * err_pi).sum() + (d_ref.abs() * err_ref).sum()).item()
            + alpha * LOGP_REL_TOL * abs(nll.item()) + FLOAT_LOSS_REL * abs(self.loss.item()),
            "nll_loss": LOGP_REL_TOL * abs(nll.item()),
            "rewards_chosen": err_chosen.mean().item(),
            "rewards_rejected": err_rejected.mean().item(),
            "rewards_margin": (err_chosen + err_rejected).mean().item(),
            "logps_chosen": err_pi[0::2].mean().item(),
            "logps_rejected": err_pi[1::2].mean().item(),
        }
        # The gradients' bound of the terms: d/dtheta of sum_t |w_t| CE_t, w_t = dL/dCE_t.
        per_token = [t for t, _ in policy]
        weights = torch.autograd.grad(self.loss, per_token, retain_graph=True)
        self.terms = sum((w.abs() * t).sum() for w, t in zip(weights, per_token))

    def backward(self, leaves):
        """The loss's gradient and the terms' gradient of every leaf (name -> tensor)."""
        names = list(leaves)
        grads = torch.autograd.grad(self.loss, [leaves[n] for n in names], retain_graph=True,
                                    allow_unused=True)
        terms = torch.autograd.grad(self.terms, [leaves[n] for n in names], allow_unused=True)
        zero = lambda n, g: g if g is not None else torch.zeros_like(leaves[n])  # noqa: E731
        return ({n: zero(n, g) for n, g in zip(names, grads)},
                {n: zero(n, g) for n, g in zip(names, terms)})


def assert_preference_gradient_close(test, got, ref, terms, what):
    """assert_gradient_close's element-wise bound, GRAD_REL_TOL times the larger of max|ref| and
    max|terms| (the gradient with every weight's sign made positive) plus GRAD_ABS_TOL."""
    test.assertEqual(list(got.shape), list(ref.shape), f"{what}: shape")
    scale = max(ref.abs().max().item(), terms.abs().max().item())
    bound = hf.GRAD_REL_TOL * scale + hf.GRAD_ABS_TOL
    err = (got - ref).abs()
    worst = err.max().item()
    test.assertLessEqual(worst, bound, f"{what}: worst |g - ref| {worst:.3g} (ref max "
                         f"{ref.abs().max().item():.3g}, terms max {terms.abs().max().item():.3g})"
                         f" > bound {bound:.3g}")
    return worst / bound


# ---------------------------------------------------------------------------
# Self-checks of the reference (no strata needed).

@unittest.skipIf(torch is None, "torch is not importable")
class ReferenceTest(unittest.TestCase):
    def test_batches_share_prompts_and_differ_in_completion_lengths(self):
        for mb in make_micro_batches(3, 97):
            seq, tgt, tok = mb["sequences"], mb["targets"], mb["tokens"]
            for k in range(mb["pairs"]):
                c, r = 2 * k, 2 * k + 1
                first_c = int((seq[c] == c).nonzero()[0])
                first_r = int((seq[r] == r).nonzero()[0])
                self.assertEqual(first_c, first_r)  # the same prompt length
                self.assertTrue(torch.equal(tok[c, :first_c + 1], tok[r, :first_r + 1]))
                self.assertNotEqual(int((seq[c] == c).sum()), int((seq[r] == r).sum()))
                # A completion's targets are its next tokens and nothing else is a target.
                pos = (seq[c] == c).nonzero()[:, 0]
                self.assertTrue(torch.equal(tgt[c, pos], tok[c, pos + 1]))
            self.assertTrue(torch.equal(seq >= 0, tgt != IGNORE))
            self.assertFalse((seq[2 * mb["pairs"]:] >= 0).any())

    def test_kept_logits_give_the_imported_forwards_mean_cross_entropy(self):
        for model in make_models():
            mb = make_micro_batches(4, hf.vocab_size(model.cfg))[0]
            x, y = mb["tokens"], torch.randint(0, hf.vocab_size(model.cfg), (B, T))
            logits = policy_logits(hf.model_loss, model.cfg, model.params, x, y)
            per_token, _ = get_batch_logps(logits, y, False)
            self.assertAlmostEqual(-per_token.mean().item(), model.loss(x, y).item(), delta=1e-13)
            self.assertIs(hf.mean_cross_entropy, MEAN_CROSS_ENTROPY)

    def test_trl_formulas_at_known_points(self):
        z = torch.zeros(1, dtype=F64)
        losses, c, r = dpo_loss(z - 3, z - 5, z - 3, z - 5, "sigmoid", 0.1)
        self.assertAlmostEqual(losses.item(), math.log(2), delta=1e-15)
        self.assertEqual((c.item(), r.item()), (0.0, 0.0))
        losses, _, _ = dpo_loss(z - 3, z - 5, z - 3, z - 5, "sigmoid", 0.1, 0.25)
        self.assertAlmostEqual(losses.item(), math.log(2), delta=1e-15)
        losses, _, _ = dpo_loss(z - 1, z - 2, z, z, "ipo", 0.25)
        self.assertAlmostEqual(losses.item(), (1 - 2) ** 2, delta=1e-15)
        # SimPO: -log sigmoid(beta (pi_c - pi_r) - gamma).
        losses, c, _ = simpo_loss(z - 1, z - 2, 2.0, 0.5)
        self.assertAlmostEqual(losses.item(), math.log1p(math.exp(-1.5)), delta=1e-15)
        self.assertEqual(c.item(), -2.0)


# ---------------------------------------------------------------------------
# strata against the reference.

class Fixture:
    root = None
    models = None

    @classmethod
    def get(cls):
        if cls.root is None:
            cls.root = tempfile.mkdtemp(prefix="strata-preference-")
            cls.models = make_models()
            for m in cls.models:
                m.write(cls.root)
        return cls

    @classmethod
    def cleanup(cls):
        if cls.root is not None:
            shutil.rmtree(cls.root, ignore_errors=True)
            cls.root = None


def tearDownModule():
    Fixture.cleanup()


def objective_flags(objective, opts):
    flags = ["--objective", objective, "--beta", opts["beta"]]
    if "label_smoothing" in opts:
        flags += ["--label-smoothing", opts["label_smoothing"]]
    if "simpo_gamma" in opts:
        flags += ["--simpo-gamma", opts["simpo_gamma"]]
    if "rpo_alpha" in opts:
        flags += ["--rpo-alpha", opts["rpo_alpha"]]
    if "cpo_alpha" in opts:
        flags += ["--cpo-alpha", opts["cpo_alpha"]]
    return flags


@unittest.skipIf(torch is None, "torch is not importable")
@unittest.skipUnless(STRATA_HF_GRADIENTS, NO_GRADIENTS)
class StrataPreferenceTest(unittest.TestCase):
    worst = {}  # what -> the largest error over its bound seen, printed at the end

    @classmethod
    def tearDownClass(cls):
        for what, ratio in sorted(cls.worst.items()):
            print(f"  {what}: worst error {ratio:.3f} of its bound", file=sys.stderr)

    def note(self, what, ratio):
        self.worst[what] = max(self.worst.get(what, 0.0), ratio)

    def run_binary(self, name, model, micro_batches, objective, opts, reference_logps=None,
                   lora_dir=None):
        f = Fixture.get()
        path = os.path.join(f.root, name + ".json")
        write_preference_file(path, micro_batches, reference_logps)
        out = os.path.join(f.root, name + ".safetensors")
        metrics_path = os.path.join(f.root, name + ".metrics.json")
        args = [STRATA_HF_GRADIENTS, "--model-dir", model.dir, "--preference", path,
                "--seq-len", T, "--micro-batch-size", B, "--output", out,
                "--metrics-out", metrics_path, *objective_flags(objective, opts)]
        if lora_dir is not None:
            args += ["--lora-init", lora_dir]
        r = hf.run(args)
        self.assertEqual(r.returncode, 0, f"hf_gradients failed:\n{r.stdout}\n{r.stderr}")
        with open(metrics_path) as fh:
            metrics = json.load(fh)
        return hf.read_safetensors(out)[0], metrics

    def check_metrics(self, what, got, step):
        want = step.metrics
        self.assertEqual(got["pairs"], want["pairs"], what)
        for key, bound in step.bounds.items():
            err = abs(got[key] - want[key])
            self.assertLessEqual(err, bound, f"{what} {key}: strata {got[key]!r}, reference "
                                 f"{want[key]!r}, bound {bound:.3g}")
            self.note(key, err / bound)
        # The accuracy is a count: every pair's margin must be beyond its error (or exactly 0).
        for m, e in zip(step.pair_margins.tolist(), step.pair_margin_errors.tolist()):
            self.assertTrue(m == 0 or abs(m) > e, f"{what}: a margin {m} within its error {e}")
        self.assertEqual(got["rewards_accuracy"], want["rewards_accuracy"], what)

    def check_full_gradients(self, what, got, step, leaves):
        grads, terms = step.backward(leaves)
        got = {hf.strip_prefix(n): v for n, v in got.items()}
        self.assertEqual(sorted(got), sorted(hf.strip_prefix(n) for n in leaves), what)
        for name in leaves:
            g, dtype, _ = got[hf.strip_prefix(name)]
            self.assertEqual(dtype, "F32", name)
            self.note("gradient", assert_preference_gradient_close(
                self, g, grads[name], terms[name], f"{what} {name}"))

    def full_step(self, model, micro_batches, objective, opts, reference):
        leaves = {n: t.clone().requires_grad_() for n, t in model.params.items()}
        policy = completion_logps(
            micro_batches, lambda x: policy_logits(hf.model_loss, model.cfg, leaves, x, x),
            objective)
        return ReferenceStep(objective, opts, policy, reference, False, micro_batches), leaves

    def test_full_fine_tuning_equals_trl_under_every_objective(self):
        for mi, model in enumerate(Fixture.get().models):
            vocab = hf.vocab_size(model.cfg)
            for oi, (name, objective, opts) in enumerate(OBJECTIVES):
                with self.subTest(model=model.name, objective=name):
                    mbs = make_micro_batches(100 * mi + oi, vocab)
                    # Random references near the initial policy's (|beta z| ~ 1: the sigmoid is
                    # far from saturated, and each pair's reference differs).
                    g = torch.Generator().manual_seed(7 + 10 * mi + oi)
                    with torch.no_grad():
                        start = completion_logps(
                            mbs, lambda x: policy_logits(hf.model_loss, model.cfg, model.params,
                                                         x, x), objective)
                    spread = 0.5 if averaged(objective) else 3.0
                    reference = [(p + spread * torch.randn(p.shape, generator=g, dtype=F64))
                                 .tolist() for _, p in start]
                    got, metrics = self.run_binary(f"{model.name}.{name}", model, mbs, objective,
                                                   opts, reference_logps=reference)
                    step, leaves = self.full_step(model, mbs, objective, opts, reference)
                    what = f"{model.name} {name}"
                    self.check_metrics(what, metrics, step)
                    self.check_full_gradients(what, got, step, leaves)

    def test_dpo_with_the_policy_as_its_reference_is_ln2_with_zero_rewards(self):
        opts = dict(OBJECTIVES[0][2], beta=0.5)
        for mi, model in enumerate(Fixture.get().models):
            with self.subTest(model=model.name):
                mbs = make_micro_batches(500 + mi, hf.vocab_size(model.cfg))
                got, metrics = self.run_binary(f"{model.name}.selfref", model, mbs, "dpo", opts)
                self.assertLessEqual(abs(metrics["loss"] - math.log(2)),
                                     FLOAT_LOSS_REL * math.log(2), metrics)
                for key in ("rewards_chosen", "rewards_rejected", "rewards_margin",
                            "rewards_accuracy"):
                    self.assertEqual(metrics[key], 0.0, f"{model.name} {key}")
                step, leaves = self.full_step(model, mbs, "dpo", opts, None)
                self.assertAlmostEqual(step.loss.item(), math.log(2), delta=1e-15)
                what = f"{model.name} dpo, the policy as reference"
                self.check_metrics(what, metrics, step)
                self.check_full_gradients(what, got, step, leaves)

    def test_lora_adapter_gradients_equal_trl_with_the_base_as_reference(self):
        f = Fixture.get()
        model = f.models[0]
        self.assertEqual(model.cfg["model_type"], "llama")
        adapter_dir = os.path.join(f.root, model.name + ".lora")
        adapters = hf.write_lora_adapter(adapter_dir, model, LORA, seed=43)
        self.assertTrue(all(bb.abs().max() > 0 for _, bb in adapters.values()))
        for oi, (name, objective, opts) in enumerate(OBJECTIVES[:1] + OBJECTIVES[2:3] +
                                                     OBJECTIVES[4:5]):
            with self.subTest(objective=name):
                mbs = make_micro_batches(700 + oi, hf.vocab_size(model.cfg))
                got, metrics = self.run_binary(f"{model.name}.lora.{name}", model, mbs,
                                               objective, opts, lora_dir=adapter_dir)
                leaves = {k: (a.clone().requires_grad_(), bb.clone().requires_grad_())
                          for k, (a, bb) in adapters.items()}
                policy = completion_logps(
                    mbs, lambda x: policy_logits(hf.llama_lora_loss, model.params, leaves,
                                                 model.cfg, LORA, x, x), objective)
                with torch.no_grad():  # the base, adapters off
                    base = completion_logps(
                        mbs, lambda x: policy_logits(hf.model_loss, model.cfg, model.params, x,
                                                     x), objective)
                step = ReferenceStep(objective, opts, policy, [p for _, p in base], True, mbs)
                what = f"{model.name} LoRA {name}"
                self.assertGreater(abs(step.metrics["rewards_margin"]), 0, what)
                self.check_metrics(what, metrics, step)
                named = {}
                for (i, module), (a, bb) in leaves.items():
                    prefix = hf.lora_tensor_prefix(
                        model.cfg, i, f"{dict(hf.LLAMA_LORA_MODULES)[module]}.{module}")
                    named[prefix + ".lora_A.weight"] = a
                    named[prefix + ".lora_B.weight"] = bb
                grads, terms = step.backward(named)
                self.assertEqual(sorted(got), sorted(named), what)
                for n in named:
                    g, dtype, _ = got[n]
                    self.assertEqual(dtype, "F32", n)
                    self.note("gradient", assert_preference_gradient_close(
                        self, g, grads[n], terms[n], f"{what} {n}"))

    def expect_refusal(self, path, extra, *needles):
        f = Fixture.get()
        r = hf.run([STRATA_HF_GRADIENTS, "--model-dir", f.models[0].dir, "--preference", path,
                    "--objective", "dpo", "--seq-len", T, "--micro-batch-size", B, "--output",
                    os.path.join(f.root, "refused.safetensors"), *extra])
        self.assertEqual(r.returncode, 1, f"{r.stdout}\n{r.stderr}")
        for needle in needles:
            self.assertIn(needle, r.stderr)

    def test_a_completion_on_an_ignored_target_is_refused_naming_the_file(self):
        f = Fixture.get()
        mbs = make_micro_batches(900, hf.vocab_size(f.models[0].cfg))
        mbs[1]["sequences"][3, 0] = 1  # row 3 of a one-pair micro-batch holds no target
        path = os.path.join(f.root, "bad.json")
        write_preference_file(path, mbs)
        self.expect_refusal(path, [], path, "micro-batch 1", "position 36")

    def test_reference_logps_with_lora_are_refused(self):
        # With LoRA the reference is the base: log-probabilities in the file would be ignored.
        f = Fixture.get()
        mbs = make_micro_batches(901, hf.vocab_size(f.models[0].cfg))
        path = os.path.join(f.root, "lora_ref.json")
        write_preference_file(path, mbs, [[-1.0] * (2 * mb["pairs"]) for mb in mbs])
        adapter_dir = os.path.join(f.root, "refused.lora")
        hf.write_lora_adapter(adapter_dir, f.models[0], LORA, seed=44)
        self.expect_refusal(path, ["--lora-init", adapter_dir], path, "reference_logps",
                            "--lora-init")


if __name__ == "__main__":
    if torch is None:
        print(f"SKIPPED: torch (or numpy) is not importable by {sys.executable} "
              f"({hf._IMPORT_ERROR}); install python3-torch (Debian) to run the preference tests")
        sys.exit(SKIP)
    unittest.main(verbosity=2)
