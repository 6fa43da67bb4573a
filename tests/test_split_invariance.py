"""Split invariance (issue 63): one batch's update against the same batch cut into micro batches x gradient
accumulation steps on 1 or 2 processes, for every loss normaliser of ppo.py, rloo.py, grpo.py and reinforce_pp.py.

Each process's gradient is the sum over its micro batches of the micro batch loss divided by the accumulation
steps (accelerate's backward under accumulate), and the processes' gradients are averaged (DDP); the processes are
simulated here in one process. A normaliser is split invariant when the summed gradient does not depend on the split:
rloo.py's mean over responses, grpo.py's response_mean, constant (Dr. GRPO) and batch_token_mean (DAPO, whose token
count is summed over the minibatch on every process). ppo.py's and reinforce_pp.py's token means are means over each
micro batch's kept tokens by design: with lengths that vary each micro batch's tokens count 1 / (M x its own token
count), M the micro batches of all processes, not 1 / (the batch's tokens); the tests pin that difference against a
hand-computed weighting, and show it vanishes when every response has the same length.

The batch: 8 responses of the policy in tests/test_gradient_oracle.py (a (4, 3) table of logits per prefix, token 2
the EOS), rollout logprobs away from the current ones so that ratios move and some clip, fixed advantages."""

import dataclasses
import os

import pytest
import torch

from conftest import REPO_ROOT, load_script, run_two_processes

ppo, rloo, grpo, reinforce_pp = (load_script(name) for name in ("ppo", "rloo", "grpo", "reinforce_pp"))

V, T, PAD, DT = 3, 2, 3, torch.float64
# (processes, micro batch size, accumulation steps): processes x micro x steps = 8 rows
SPLITS = [(1, 4, 2), (1, 2, 4), (1, 1, 8), (2, 4, 1), (2, 2, 2), (2, 1, 4)]
ALL_RESPONSES = torch.tensor([(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, PAD)])  # token 2: the EOS


class Batch:
    """8 responses (lengths 1 and 2 when `varying`, all 2 otherwise), their rollout and reference logprobs, per-token
    and per-response advantages, rollout values and returns; the policy table (and a value table for ppo.py) is the
    leaf the gradients are taken of."""

    def __init__(self, varying: bool = True):
        g = torch.Generator().manual_seed(3)
        rows = torch.tensor([6, 0, 1, 6, 6, 2, 3, 4] if varying else [0, 1, 2, 3, 4, 5, 1, 0])
        self.responses = ALL_RESPONSES[rows]
        self.mask, _ = grpo.response_mask(self.responses, PAD)
        tokens = self.responses.clamp(max=V - 1)
        self.prefix = torch.stack([torch.zeros_like(tokens[:, 0]), 1 + self.responses[:, 0]], 1)
        self.tokens = tokens
        self.theta = torch.randn(V + 1, V, generator=g, dtype=DT).requires_grad_()
        self.value_table = torch.randn(V + 1, generator=g, dtype=DT).requires_grad_()
        ref_table = torch.log_softmax(torch.randn(V + 1, V, generator=g, dtype=DT), -1)
        self.ref = ref_table[self.prefix, tokens] * self.mask
        # rollout logprobs 0.3 nats (sd) away from the current ones: ratios move, some beyond the 0.2 clip
        self.old = (self.logprobs() + 0.3 * torch.randn(8, T, generator=g, dtype=DT)).detach() * self.mask
        self.token_advantages = torch.randn(8, T, generator=g, dtype=DT) * self.mask
        self.advantages = torch.randn(8, generator=g, dtype=DT)
        self.old_values = torch.randn(8, T, generator=g, dtype=DT) * self.mask
        self.returns = torch.randn(8, T, generator=g, dtype=DT) * self.mask

    def logprobs(self):
        return torch.log_softmax(self.theta, -1)[self.prefix, self.tokens] * self.mask

    def values(self):
        return self.value_table[self.prefix] * self.mask

    def gradient(self, loss_of_micro_batch, processes: int, micro: int, steps: int, per_process=None):
        """The averaged gradient of the split: (1 / processes) sum over processes of (1 / steps) x the sum of the
        micro batch losses; loss_of_micro_batch(rows, process state). per_process(process rows) -> that state."""
        local = 8 // processes
        total = 0.0
        for p in range(processes):
            rows = torch.arange(p * local, (p + 1) * local)
            state = per_process(rows) if per_process else None
            for step in range(steps):
                total = total + loss_of_micro_batch(rows[step * micro : (step + 1) * micro], state) / steps
        grads = torch.autograd.grad(total / processes, (self.theta, self.value_table), allow_unused=True)
        return torch.cat([g.flatten() for g in grads if g is not None])


def assert_rounding(actual, expected):
    """Equal to float rounding: token_weights computes its weights in float32 (the scripts' mask.float())."""
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-9)


# ---------------------------------------------------------------------------------------------------------------------
# split invariant: rloo.py, grpo.py's three normalisers
# ---------------------------------------------------------------------------------------------------------------------


def rloo_micro_loss(b: Batch):
    def loss(rows, _):  # rloo_update's call: a mean over the micro batch's responses
        return rloo.rloo_loss(b.logprobs()[rows], b.old[rows], b.advantages[rows], b.mask[rows], 0.2)[0]
    return loss


@pytest.mark.parametrize("split", SPLITS)
def test_rloo_mean_over_responses_is_split_invariant(split):
    b = Batch()
    assert_rounding(b.gradient(rloo_micro_loss(b), *split), b.gradient(rloo_micro_loss(b), 1, 8, 1))


def grpo_micro_loss(b: Batch, normalizer: str, ratio_level: str, processes: int, steps: int, loss_type="grpo"):
    """grpo_update's calls: token_weights of each micro batch, DAPO's token count from minibatch_tokens (one
    minibatch), its reduce the mean over the simulated processes' counts; clip_range of the settings."""
    hp = dataclasses.replace(grpo.GrpoHParams(), ratio_level=ratio_level, loss_type=loss_type, clip_high=0.28)
    local = 8 // processes
    counts = [b.mask[p * local : (p + 1) * local].view(1, -1).sum(1).float() for p in range(processes)]

    def reduce(x, op):  # accelerator.reduce(x, "mean") over the simulated processes
        assert op == "mean" and any(torch.equal(x, c) for c in counts)
        return torch.stack(counts).mean(0)

    def per_process(rows):
        return grpo.minibatch_tokens(b.mask[rows], 1, steps, reduce)

    def loss(rows, tokens):
        weights = grpo.token_weights(b.mask[rows], normalizer, T, tokens[0])
        return grpo.grpo_loss(b.logprobs()[rows], b.old[rows], b.ref[rows], b.advantages[rows], weights,
                              *grpo.clip_range(hp), 0.04, ratio_level, loss_type)[0]
    return loss, per_process


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("normalizer", ["response_mean", "constant", "batch_token_mean"])
@pytest.mark.parametrize("ratio_level,loss_type", [("token", "grpo"), ("sequence", "grpo"), ("token", "cispo"),
                                                   ("token", "sapo")])
def test_grpo_normalizers_are_split_invariant(split, normalizer, ratio_level, loss_type):
    """grpo.py's response_mean (GRPO), constant (Dr. GRPO) and batch_token_mean (DAPO), token and sequence (GSPO)
    ratios, CISPO's and SAPO's losses, ratios away from 1 (some clipped): the same gradient under every split."""
    b = Batch()
    processes, micro, steps = split
    loss, per_process = grpo_micro_loss(b, normalizer, ratio_level, 1, 1, loss_type)
    one = b.gradient(loss, 1, 8, 1, per_process=per_process)
    loss, per_process = grpo_micro_loss(b, normalizer, ratio_level, processes, steps, loss_type)
    assert_rounding(b.gradient(loss, processes, micro, steps, per_process=per_process), one)


# ---------------------------------------------------------------------------------------------------------------------
# a mean per micro batch by design: ppo.py's and reinforce_pp.py's token means
# ---------------------------------------------------------------------------------------------------------------------


def ppo_micro_loss(b: Batch, mask_of=None):
    """ppo_update's call (policy and value losses, vf_coef 0.1); mask_of(rows) replaces the micro batch's mask (the
    hand weighting), else the mask itself."""
    def loss(rows, _):
        mask = b.mask[rows] if mask_of is None else mask_of(rows)
        pg, vf, _ = ppo.ppo_losses(b.logprobs()[rows], b.old[rows], b.token_advantages[rows], b.values()[rows],
                                   b.old_values[rows], b.returns[rows], mask, 0.2, 0.2)
        return pg + 0.1 * vf
    return loss


KL_LOSS = dataclasses.replace(reinforce_pp.ReinforcePpHParams(), kl_in="loss", kl_estimator="k3")


def reinforce_pp_micro_loss(b: Batch, mask_of=None, kl_coef: float = 0.0):
    """reinforce_pp_update's calls: PPO's clipped surrogate on the per-token advantages, a mean over the micro batch's
    kept tokens, and with kl_coef (--reinforce_pp.kl_in loss) kl_coef x kl_loss, a mean over the same tokens."""
    def loss(rows, _):
        mask = b.mask[rows] if mask_of is None else mask_of(rows)
        new = b.logprobs()[rows]
        pg = reinforce_pp.clipped_policy_loss(new - b.old[rows], b.token_advantages[rows], mask, 0.2)[0]
        return pg + kl_coef * reinforce_pp.kl_loss(new, b.old[rows], b.ref[rows], mask, KL_LOSS) if kl_coef else pg
    return loss


def hand_weights(b: Batch, micro: int, processes: int, steps: int, rows_of_one_batch: torch.Tensor):
    """The weight each kept token gets under the split, by hand: 1 / (M x n_m), M = processes x steps micro batches,
    n_m the kept tokens of the token's own micro batch. As the mask of one batch of 8 rows, whose masked mean (the
    weighted sum over the weights' sum, 1) is then the split's averaged loss."""
    M = processes * steps
    weights = torch.zeros(8, T, dtype=DT)
    for m in range(M):
        rows = torch.arange(m * micro, (m + 1) * micro)
        weights[rows] = b.mask[rows].to(DT) / (M * b.mask[rows].sum())
    return weights[rows_of_one_batch]


MICRO_LOSSES = {"ppo": ppo_micro_loss, "reinforce_pp": reinforce_pp_micro_loss,
                "reinforce_pp kl_in loss": lambda b, mask_of=None: reinforce_pp_micro_loss(b, mask_of, 0.5)}


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("script", list(MICRO_LOSSES))
def test_token_mean_per_micro_batch_is_pinned(split, script):
    """ppo.py and reinforce_pp.py average their loss over each micro batch's kept tokens, on each process: the split's
    gradient is exactly that of the hand weighting 1 / (M x n_m) per token, which differs from the one batch's
    1 / (its tokens) when micro batches hold different numbers of tokens, here by more than 1e-3 in some entry."""
    b = Batch(varying=True)
    processes, micro, steps = split
    micro_loss = MICRO_LOSSES[script]
    split_gradient = b.gradient(micro_loss(b), processes, micro, steps)
    one = b.gradient(micro_loss(b), 1, 8, 1)
    by_hand = b.gradient(micro_loss(b, lambda rows: hand_weights(b, micro, processes, steps, rows)), 1, 8, 1)
    torch.testing.assert_close(split_gradient, by_hand, rtol=1e-12, atol=1e-12)
    assert (split_gradient - one).abs().max() > 1e-3


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("script", list(MICRO_LOSSES))
def test_token_mean_per_micro_batch_is_invariant_at_fixed_lengths(split, script):
    """With every response of the same length each micro batch holds the same number of tokens, and the per micro
    batch token mean is the batch's: split invariant."""
    b = Batch(varying=False)
    micro_loss = MICRO_LOSSES[script]
    torch.testing.assert_close(b.gradient(micro_loss(b), *split), b.gradient(micro_loss(b), 1, 8, 1),
                               rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# one real 2-process case (torchrun over gloo, as tests/test_multiprocess.py launches it)
# ---------------------------------------------------------------------------------------------------------------------

TWO_PROCESS_PROBE = """
import sys, torch
from accelerate import Accelerator
sys.path.insert(0, {tests!r})
from test_split_invariance import T, Batch, grpo, reinforce_pp
micro, steps = 2, 2  # per process: 2 micro batches of 2 rows, 4 of the batch's 8 rows
accelerator = Accelerator()  # as the scripts make theirs, then set its accumulation steps
accelerator.gradient_accumulation_steps = steps
b = Batch()
rows = torch.arange(accelerator.process_index * 4, (accelerator.process_index + 1) * 4)


class Table(torch.nn.Module):  # the policy table as a module, so that DDP averages its gradient
    def __init__(self):
        super().__init__()
        self.theta = torch.nn.Parameter(b.theta.detach().clone())

    def forward(self, idx):
        return torch.log_softmax(self.theta, -1)[b.prefix[idx], b.tokens[idx]] * b.mask[idx]


grads = {{}}
for name in ("response_mean", "constant", "batch_token_mean", "reinforce_pp"):
    model = accelerator.prepare(Table())
    tokens = grpo.minibatch_tokens(b.mask[rows], 1, steps, accelerator.reduce)
    for step in range(steps):  # the updates' loop: accumulate, backward (loss / steps), synced at the last
        idx = rows[step * micro : (step + 1) * micro]
        with accelerator.accumulate(model):
            new = model(idx)
            if name == "reinforce_pp":
                loss = reinforce_pp.clipped_policy_loss(new - b.old[idx], b.token_advantages[idx], b.mask[idx], 0.2)[0]
            else:
                weights = grpo.token_weights(b.mask[idx], name, T, tokens[0])
                loss = grpo.grpo_loss(new, b.old[idx], b.ref[idx], b.advantages[idx], weights, 0.2, 0.28, 0.04)[0]
            accelerator.backward(loss)
    grads[name] = accelerator.unwrap_model(model).theta.grad.clone()
if accelerator.is_main_process:
    torch.save(grads, {out!r})
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
def test_two_real_processes(tmp_path):
    """2 processes (torchrun, gloo, DDP through accelerate), 2 micro batches of 2 each: grpo.py's three normalisers
    give the one batch's gradient; reinforce_pp.py's token mean gives the per micro batch weighting of the pinned
    test, 1 / (4 x n_m)."""
    script = tmp_path / "split_probe.py"
    script.write_text(TWO_PROCESS_PROBE.format(tests=os.path.join(REPO_ROOT, "tests"), out=str(tmp_path / "g.pt")))
    run_two_processes(str(script))
    grads = torch.load(tmp_path / "g.pt")
    b = Batch()
    for normalizer in ("response_mean", "constant", "batch_token_mean"):
        loss, per_process = grpo_micro_loss(b, normalizer, "token", 1, 1)
        assert_rounding(grads[normalizer].flatten(), b.gradient(loss, 1, 8, 1, per_process=per_process))
    by_hand = b.gradient(reinforce_pp_micro_loss(b, lambda rows: hand_weights(b, 2, 2, 2, rows)), 1, 8, 1)
    torch.testing.assert_close(grads["reinforce_pp"].flatten(), by_hand, rtol=1e-12, atol=1e-12)
    assert (by_hand - b.gradient(reinforce_pp_micro_loss(b), 1, 8, 1)).abs().max() > 1e-3
