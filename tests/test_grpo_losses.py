"""Tests of grpo.py's loss options against hand computations (issue 63, items 1 and 5): CISPO and SAPO
(--grpo.loss_type) have GRPO's gradient at ratio 1 and their papers' gradients off-policy, clipped and not; the KL
estimators in the loss and the importance-weighted k3 (--grpo.kl_estimator, --grpo.kl_importance_weighted) follow
the gradients their docstrings name; the KL in the reward (--grpo.kl_in reward) enters the advantage and leaves the
loss; truncated responses leave the loss (--grpo.mask_truncated_completions); the entropy bonus and the top-entropy
tokens (--grpo.entropy_coef, --grpo.top_entropy_quantile); which clip range grpo_update gives the loss (clip_range);
and the refusals of rlhf_utils/flags.py's check_grpo_losses. The exact expected gradients over every response of a
tiny policy are the oracle's (another test module)."""

import contextlib
import dataclasses
import json
import math
import os
import types

import pytest
import torch
import torch.nn as nn

from conftest import ENV, load_script, run_ok
from rlhf_utils.checks import RunError
from rlhf_utils.flags import check_grpo_losses
from test_grpo import REPO_ROOT, grpo_command

grpo = load_script("grpo")

PAD, EOS, V = 5, 4, 6  # a vocabulary of 6: token 5 is [PAD], token 4 the EOS
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]).bool()
ADVANTAGES = torch.tensor([0.7, -0.7, 1.5, -1.5], dtype=torch.float64)


def policy(seed: int = 0):
    """Logits (4, 4, 7) as the leaf to differentiate, the log-probability of fixed tokens under them, a reference."""
    torch.manual_seed(seed)
    logits = torch.randn(4, 4, 7, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 7, (4, 4))

    def logprobs_of(x):
        return torch.gather(torch.log_softmax(x, -1), 2, tokens.unsqueeze(-1)).squeeze(-1)

    return logits, logprobs_of, logprobs_of(torch.randn(4, 4, 7, dtype=torch.float64))


def gradient(loss, leaf):
    return torch.autograd.grad(loss, leaf)[0]


def close(tensor, by_hand: list):
    torch.testing.assert_close(tensor, torch.tensor(by_hand, dtype=tensor.dtype), rtol=1e-12, atol=1e-15)


# ------------------------------------------------------------------------------------------------
# CISPO and SAPO
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("normalizer", ["response_mean", "constant", "batch_token_mean"])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_cispo_and_sapo_have_grpos_gradient_at_ratio_one(normalizer, ratio_level):
    """On a fresh batch (every ratio 1) CISPO's and SAPO's gradients are GRPO's, -A grad log p per weighted token, KL
    term included, under every normaliser and both ratio levels; their loss values differ (CISPO's is -A log p,
    SAPO's -2 A / tau)."""
    logits, logprobs_of, ref = policy()
    old = logprobs_of(logits).detach()
    weights = grpo.token_weights(MASK, normalizer, 4, MASK.sum().double())
    losses, grads = {}, {}
    for loss_type in ("grpo", "cispo", "sapo"):
        losses[loss_type], _ = grpo.grpo_loss(logprobs_of(logits), old, ref, ADVANTAGES, weights, 0.2, 0.2, 0.04,
                                              ratio_level, loss_type)
        grads[loss_type] = gradient(losses[loss_type], logits)
    torch.testing.assert_close(grads["cispo"], grads["grpo"], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grads["sapo"], grads["grpo"], rtol=1e-12, atol=1e-14)
    assert grads["grpo"].abs().max() > 1e-3  # not a vacuous zero
    assert not torch.isclose(losses["cispo"], losses["grpo"]) and not torch.isclose(losses["sapo"], losses["grpo"])


# two responses of 3 tokens, all kept; ratios p / p_old away from 1, on both sides and past every clip
RATIOS = torch.tensor([[0.5, 1.3, 5.0], [0.7, 1.0, 6.0]], dtype=torch.float64)
NEW = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]], dtype=torch.float64)
TWO_ADVANTAGES = torch.tensor([1.5, -0.5], dtype=torch.float64)


def off_policy_loss(loss_type: str, cliprange=1.0, clip_high=3.0, **kw):
    new = NEW.clone().requires_grad_()
    weights = torch.full((2, 3), 1 / 6, dtype=torch.float64)  # GRPO's 1 / (B |o_i|)
    loss, stats = grpo.grpo_loss(new, NEW - RATIOS.log(), NEW, TWO_ADVANTAGES, weights, cliprange, clip_high, 0.0,
                                 "token", loss_type, **kw)
    return loss, gradient(loss, new), stats


def test_cispo_off_policy_by_hand():
    """CISPO's default clip (clip_range: [0, cispo_max_weight 4]): the weights are 0.5, 1.3, 4 (5 clipped) and 0.7,
    1, 4 (6 clipped); the gradient of -(1/6) sg(w) A log p at each token is -(1/6) w A, nonzero at every token, the
    clipped ones too, and its value is -(1/6) sum w A log p."""
    loss, grad, stats = off_policy_loss("cispo", *grpo.clip_range(grpo.GrpoHParams(loss_type="cispo")))
    hand = [[-1.5 * 0.5 / 6, -1.5 * 1.3 / 6, -1.5 * 4.0 / 6], [0.5 * 0.7 / 6, 0.5 * 1.0 / 6, 0.5 * 4.0 / 6]]
    close(grad, hand)
    by_hand = (-1.5 * (0.5 * -1.0 + 1.3 * -2.0 + 4.0 * -0.5) + 0.5 * (0.7 * -1.5 + 1.0 * -0.7 + 4.0 * -3.0)) / 6
    assert loss.item() == pytest.approx(by_hand, rel=1e-12)
    assert stats["pg_clipfrac"].item() == pytest.approx(2 / 6)
    # GRPO's clip on the same ratios cuts the gradient where the ratio left [0.8, 1.2] on the side its advantage
    # pushes (1.3 and 5 at A > 0, 0.7 at A < 0); CISPO cuts none
    _, grpo_grad, _ = off_policy_loss("grpo", 0.2, 0.2)
    assert (grpo_grad == 0).tolist() == [[False, True, True], [True, False, False]]
    # a narrower CISPO clip, [0.8, 1.2]: the weights 0.8, 1.2, 1.2 and 0.8, 1, 1.2
    _, grad, _ = off_policy_loss("cispo", 0.2, 0.2)
    close(grad, [[-1.5 * w / 6 for w in (0.8, 1.2, 1.2)], [0.5 * w / 6 for w in (0.8, 1.0, 1.2)]])


def test_sapo_off_policy_by_hand():
    """SAPO (tau 1 for A > 0, 1.05 for A < 0): the loss -(1/6) sum A (4 / tau) sigmoid(tau (r - 1)), whose gradient at
    a token is -(1/6) A 4 s (1 - s) r, s = sigmoid(tau (r - 1)): the gate shrinks it smoothly as r leaves 1, never to
    exactly 0 (GRPO's hard clip: 0)."""
    loss, grad, stats = off_policy_loss("sapo", sapo_taus=(1.0, 1.05))

    def sigmoid(x):
        return 1 / (1 + math.exp(-x))

    hand_grad, hand_loss = [], 0.0
    for advantage, tau, ratios in zip((1.5, -0.5), (1.0, 1.05), RATIOS.tolist()):
        s = [sigmoid(tau * (r - 1)) for r in ratios]
        hand_grad.append([-advantage * 4 * si * (1 - si) * r / 6 for si, r in zip(s, ratios)])
        hand_loss += sum(-advantage * 4 / tau * si / 6 for si in s)
    close(grad, hand_grad)
    assert loss.item() == pytest.approx(hand_loss, rel=1e-12)
    assert grad[1, 1].item() == pytest.approx(0.5 / 6, rel=1e-12)  # at r = 1: GRPO's -A / 6
    assert 0 < -grad[0, 2].item() < 0.4 * 1.5 / 6  # r = 5, A > 0: damped to a third, not cut
    assert "pg_clipfrac" not in stats  # no clip to count
    # the negative temperature, the larger, closes the gate faster: at r = 6 the A < 0 token keeps less of its
    # gradient than a tau of 1 would leave it
    _, same_tau, _ = off_policy_loss("sapo", sapo_taus=(1.0, 1.0))
    assert abs(grad[1, 2].item()) < abs(same_tau[1, 2].item())


# ------------------------------------------------------------------------------------------------
# The KL term: estimators, importance weighting, placement
# ------------------------------------------------------------------------------------------------
def test_kl_estimators_in_the_loss_follow_their_gradients():
    """At ratio 1, advantage 0, kl_coef 1, the loss's gradient is sum_t w_t c_t grad log p_t with c_t: k3 (1 - p_ref /
    p): the per-token forward KL's; k2 (log p - log p_ref): the per-token reverse KL's; k1 1 (zero in expectation);
    k3 weighted by the ratio p / p_old (TRL's use_bias_correction_kl), whose value is k3's: k2's gradient."""
    logits, logprobs_of, ref = policy(1)
    old = logprobs_of(logits).detach()
    weights = grpo.token_weights(MASK, "response_mean", 4, None).double()
    zero = torch.zeros(4, dtype=torch.float64)
    coefficient = {"k3": 1 - (ref - old).exp(), "k2": old - ref, "k1": torch.ones_like(old)}
    for estimator, c in coefficient.items():
        loss, stats = grpo.grpo_loss(logprobs_of(logits), old, ref, zero, weights, 0.2, 0.2, 1.0,
                                     kl_estimator=estimator)
        expected = gradient((weights * c * logprobs_of(logits)).sum(), logits)
        torch.testing.assert_close(gradient(loss, logits), expected, rtol=1e-12, atol=1e-14)
    k3_loss, k3_stats = grpo.grpo_loss(logprobs_of(logits), old, ref, zero, weights, 0.2, 0.2, 1.0)
    weighted, weighted_stats = grpo.grpo_loss(logprobs_of(logits), old, ref, zero, weights, 0.2, 0.2, 1.0,
                                              kl_importance_weighted=True)
    assert weighted.item() == pytest.approx(k3_loss.item(), rel=1e-12)  # the ratio is 1: the same value
    assert weighted_stats["kl"].item() == pytest.approx(k3_stats["kl"].item(), rel=1e-12)
    expected = gradient((weights * coefficient["k2"] * logprobs_of(logits)).sum(), logits)
    torch.testing.assert_close(gradient(weighted, logits), expected, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(gradient(k3_loss, logits), expected)  # k3 uncorrected follows another gradient
    # off-policy the weighted value is the ratio times k3
    moved = old + 0.1
    weighted, _ = grpo.grpo_loss(moved, old, ref, zero, weights, 0.2, 0.2, 1.0, kl_importance_weighted=True)
    k3 = (ref - moved).exp() - 1 - (ref - moved)
    assert weighted.item() == pytest.approx((weights * k3 * math.exp(0.1)).sum().item(), rel=1e-12)


MASK_OF_ROLLOUT = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]]).bool()  # rollout()'s


def rollout(kl_in: str = "loss", estimator: str = "k3", **kw):
    """Two groups of two responses (EOS at index 1; none: the EOS trick's -1; EOS at 0; at 2) and their rewards."""
    args = grpo.Args(group_size=2, grpo=grpo.GrpoHParams(kl_in=kl_in, kl_estimator=estimator, kl_coef=0.5))
    raw = torch.tensor([[1, EOS, 2, 3], [1, 2, 2, 3], [EOS, 0, 0, 0], [1, 1, EOS, 3]])
    logprobs = -torch.tensor([[0.5, 0.25, 9.0, 9.0], [0.5, 0.5, 0.5, 0.5], [1.0, 9.0, 9.0, 9.0],
                              [0.25, 0.25, 0.25, 9.0]])
    data = grpo.Rollout(query_responses=torch.cat((torch.full((4, 2), 1), raw), 1),
                        responses=grpo.truncate_response(EOS, PAD, raw), logprobs=logprobs,
                        ref_logprobs=torch.full((4, 4), -1.0), rm_scores=torch.tensor([[2.0], [3.0], [4.0], [1.0]]))
    return args, data, grpo.rewards_and_advantages(args, args.grpo, data, EOS, PAD, [], lambda x: x, **kw)


def test_kl_in_the_reward_enters_the_advantage_before_the_group_statistics():
    """--grpo.kl_in reward: each reward is the final score (after the EOS trick) less kl_coef x the response's summed
    per-token KL of the rollout, then the group advantage; the scores stay the scores. kl_coef: hp.kl_coef, or the
    value passed (main's adaptive controller)."""
    scores = [2.0, -1.0, 4.0, 1.0]
    kept = [[0.5, 0.25], [0.5] * 4, [1.0], [0.25] * 3]  # -log p of each kept token; log p_ref = -1 everywhere
    k1 = [sum(1 - x for x in row) for row in kept]
    k3 = [sum(math.exp(x - 1) - 1 - (x - 1) for x in row) for row in kept]  # r = p_ref / p = e^(x - 1)
    for estimator, kl, coef in (("k1", k1, 0.5), ("k3", k3, 0.5), ("k1", k1, 2.0)):
        _, _, out = rollout("reward", estimator, **({} if coef == 0.5 else {"kl_coef": coef}))
        rewards = [s - coef * k for s, k in zip(scores, kl)]
        hand = []
        for first, second in (rewards[:2], rewards[2:]):
            std = abs(first - second) / math.sqrt(2)  # the unbiased std of two
            hand += [(first - second) / 2 / (std + 1e-4), (second - first) / 2 / (std + 1e-4)]
        assert out.advantages.tolist() == pytest.approx(hand, rel=1e-5)
        assert out.scores.tolist() == pytest.approx(scores)
    _, _, in_loss = rollout("loss")
    assert not torch.allclose(in_loss.advantages, out.advantages)


class TinyPolicy(nn.Module):
    """Policy's interface (grpo.training_logprobs) over a table of logits per previous token."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(V, V)

    def forward(self, query_responses, pad_token_id, context_length, ptx_query_responses=None, ptx_labels=None):
        return self.table(query_responses[:, context_length - 1 : -1]), None


class OneProcess:
    device = torch.device("cpu")

    def reduce(self, x, how):
        return x

    def accumulate(self, model):
        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()


NO_PTX = types.SimpleNamespace(coef=0.0, batch=lambda *a: (None, None), loss=lambda *a: torch.zeros(()))


def run_update(hp, monkeypatch, seen=None):
    """grpo_update on one micro batch of the 4 responses of rollout() in their order, on-policy for TinyPolicy, one
    SGD step of lr 1; returns the policy, the statistics and the rewards. seen: a list that gets the positional
    arguments of each grpo_loss call."""
    monkeypatch.setattr(grpo.torch, "randperm", lambda n, device=None: torch.arange(n, device=device))
    args, data, scored = rollout(hp.kl_in)
    args = dataclasses.replace(args, local_micro_batch_size=4, temperature=1.0, grpo=hp)
    scored = grpo.rewards_and_advantages(args, hp, data, EOS, PAD, [], lambda x: x)
    model = TinyPolicy()
    with torch.no_grad():
        data.logprobs = grpo.training_logprobs(model, data.query_responses, 2, 1.0, PAD)[0]
    if seen is not None:
        real = grpo.grpo_loss

        def spy(*a, **kw):
            seen.append(a)
            return real(*a, **kw)

        monkeypatch.setattr(grpo, "grpo_loss", spy)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    stats = grpo.grpo_update(args, hp, OneProcess(), model, optimizer, data, scored, 1, lambda *a, **kw: None, NO_PTX,
                             hp.kl_coef, PAD)
    return model, stats, scored


def test_kl_in_the_reward_leaves_the_loss(monkeypatch):
    """grpo_update gives the loss the KL coefficient with --grpo.kl_in loss, 0 with reward (the KL is in the
    advantage)."""
    for kl_in, coef in (("loss", 0.04), ("reward", 0.0)):
        seen = []
        run_update(grpo.GrpoHParams(kl_in=kl_in), monkeypatch, seen)
        assert seen[0][7] == coef
        monkeypatch.undo()


# ------------------------------------------------------------------------------------------------
# Which clip range reaches the loss
# ------------------------------------------------------------------------------------------------
def test_clip_range_of_each_ratio_level_reaches_the_loss(monkeypatch):
    """grpo_update hands grpo_loss (cliprange, clip_high) at ratio_level token, sequence_cliprange at sequence (GSPO),
    [0, cispo_max_weight] under CISPO: swapping the branches fails here. And the range decides the gradient: a
    response ratio of 1.001 is inside the token range 0.2 and outside GSPO's 4e-4."""
    cases = [(grpo.GrpoHParams(), (0.2, 0.2)), (grpo.GrpoHParams(clip_high=0.28), (0.2, 0.28)),
             (grpo.GrpoHParams(ratio_level="sequence"), (3e-4, 4e-4)),
             (grpo.GrpoHParams(ratio_level="sequence", sequence_cliprange=(0.01, 0.02)), (0.01, 0.02)),
             (grpo.GrpoHParams(loss_type="cispo", cispo_max_weight=3.0), (1.0, 2.0))]
    for hp, expected in cases:
        assert tuple(grpo.clip_range(hp)) == expected
        seen = []
        run_update(hp, monkeypatch, seen)
        assert tuple(seen[0][5:7]) == expected
        monkeypatch.undo()
    new = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    weights = torch.full((1, 3), 1 / 3, dtype=torch.float64)
    for hp, moves in ((grpo.GrpoHParams(), True), (grpo.GrpoHParams(ratio_level="sequence"), False)):
        loss, _ = grpo.grpo_loss(new, new.detach() - 0.001, new.detach(), torch.ones(1, dtype=torch.float64),
                                 weights, *grpo.clip_range(hp), 0.0, hp.ratio_level)
        assert bool(gradient(loss, new).abs().sum() > 0) == moves


# ------------------------------------------------------------------------------------------------
# Truncated responses, the entropy bonus, the top-entropy tokens
# ------------------------------------------------------------------------------------------------
def test_truncated_responses_leave_the_loss(monkeypatch):
    """--grpo.mask_truncated_completions: the response without EOS (row 1) weighs 0 in the loss, the others keep
    GRPO's weights (B = 4 still divides); under DAPO's normaliser the token count leaves it out; a micro batch of
    truncated responses only has a loss of 0 and a zero gradient, no NaN."""
    for normalizer, others in (("response_mean", [1 / 8, 1 / 4, 1 / 12]), ("batch_token_mean", [1 / 6] * 3)):
        seen = []
        run_update(grpo.GrpoHParams(mask_truncated_completions=True, loss_normalizer=normalizer), monkeypatch, seen)
        weights = seen[0][4]
        monkeypatch.undo()
        assert (weights[1] == 0).all()
        assert [w[w > 0].unique().item() for w in weights[[0, 2, 3]]] == pytest.approx(others)
    # the EOS trick's -1 still shapes the advantages: those of the truncated row's group are not 0
    _, _, scored = run_update(grpo.GrpoHParams(mask_truncated_completions=True), monkeypatch)
    assert scored.advantages[0] > 0 > scored.advantages[1]
    # all truncated: loss 0, gradient 0, finite statistics
    logits, logprobs_of, ref = policy()
    none = grpo.token_weights(torch.zeros(4, 4, dtype=torch.bool), "response_mean", 4, None).double()
    for loss_type, level in (("grpo", "token"), ("grpo", "sequence"), ("cispo", "token"), ("sapo", "token")):
        loss, stats = grpo.grpo_loss(logprobs_of(logits), logprobs_of(logits).detach(), ref, ADVANTAGES, none, 0.2,
                                     0.2, 0.04, level, loss_type)
        assert loss.item() == 0 and (gradient(loss, logits) == 0).all()
        assert all(torch.isfinite(value) for value in stats.values())
    tokens = torch.zeros(())  # no kept token in a minibatch of any process
    assert (grpo.token_weights(torch.zeros(2, 3, dtype=torch.bool), "batch_token_mean", 3, tokens) == 0).all()


def entropies(model: nn.Module) -> torch.Tensor:
    """Each response token's entropy (4, 4) under TinyPolicy at temperature 1, [PAD] excluded, by hand."""
    logits = model(rollout()[1].query_responses, PAD, 2)[0].masked_fill(torch.arange(V) == PAD, float("-inf"))
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * torch.where(logp.exp() > 0, logp, 0.0)).sum(-1)


def test_entropy_bonus_is_the_gradient_of_the_weighted_entropy(monkeypatch):
    """--grpo.entropy_coef c: one SGD step (lr 1) moves the policy by c x the gradient of sum_t w_t H_t more than
    without, H_t the entropy of the token's distribution ([PAD] excluded), w_t GRPO's weights."""
    before = TinyPolicy()
    plain, _, scored = run_update(grpo.GrpoHParams(), monkeypatch)
    bonus, _, _ = run_update(grpo.GrpoHParams(entropy_coef=0.1), monkeypatch)
    weights = MASK_OF_ROLLOUT / MASK_OF_ROLLOUT.sum(1, keepdim=True) / 4
    (hand,) = torch.autograd.grad((entropies(before) * weights).sum(), before.table.weight)
    torch.testing.assert_close(bonus.table.weight - plain.table.weight, 0.1 * hand)
    assert hand.abs().max() > 1e-3
    assert torch.equal(scored.mask, MASK_OF_ROLLOUT)


def test_top_entropy_tokens_by_hand():
    """TRL's definition: keep the tokens whose entropy is at least the (1 - q) quantile (linear interpolation) of the
    kept tokens' entropies. 0.5 of [0.1, 0.2, 0.3, 0.5, 0.7, 0.9] keeps those >= 0.4: three; 0.2 those >= 0.7."""
    entropy = torch.tensor([[0.1, 0.5, 0.9, 8.0], [0.3, 0.7, 0.2, 8.0]])
    kept = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]]).bool()  # 8.0: not a kept token, neither counted nor kept
    assert grpo.top_entropy_tokens(entropy, kept, 0.5).tolist() == [[False, True, True, False],
                                                                    [False, True, False, False]]
    assert grpo.top_entropy_tokens(entropy, kept, 0.2).tolist() == [[False, False, True, False],
                                                                    [False, True, False, False]]
    assert torch.equal(grpo.top_entropy_tokens(entropy, kept, 1.0), kept)
    empty = torch.zeros(2, 4, dtype=torch.bool)
    assert not grpo.top_entropy_tokens(entropy, empty, 0.2).any()


def test_top_entropy_tokens_train_the_policy_term_only(monkeypatch):
    """The mask of the kept tokens of highest entropy (under the policy before the step) reaches grpo_loss from the
    update, and grpo_loss drops the policy term of the other tokens while their KL term stays."""
    seen = []
    run_update(grpo.GrpoHParams(top_entropy_quantile=0.5), monkeypatch, seen)
    pg_mask = seen[0][13]
    assert torch.equal(pg_mask, grpo.top_entropy_tokens(entropies(TinyPolicy()).detach(), MASK_OF_ROLLOUT, 0.5))
    assert 0 < pg_mask.sum() < MASK_OF_ROLLOUT.sum()
    logits, logprobs_of, ref = policy()
    old = logprobs_of(logits).detach()
    weights = grpo.token_weights(MASK, "response_mean", 4, None).double()
    pg_mask = torch.tensor([[1, 0, 1, 0], [0, 1, 1, 1], [1, 0, 0, 0], [0, 0, 1, 1]]).bool()
    loss, _ = grpo.grpo_loss(logprobs_of(logits), old, ref, ADVANTAGES, weights, 0.2, 0.2, 0.04, pg_mask=pg_mask)
    coefficient = -ADVANTAGES.unsqueeze(1) * pg_mask + 0.04 * (1 - (ref - old).exp())
    expected = gradient((weights * coefficient * logprobs_of(logits)).sum(), logits)
    torch.testing.assert_close(gradient(loss, logits), expected, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------------------------------------
# Refusals
# ------------------------------------------------------------------------------------------------
def test_refusals_of_the_loss_and_kl_options():
    check_grpo_losses(grpo.GrpoHParams())  # the defaults pass
    check_grpo_losses(None)  # another script's Args: nothing to check
    for hp, words in ((grpo.GrpoHParams(kl_importance_weighted=True, kl_in="reward"), "kl_in reward"),
                      (grpo.GrpoHParams(kl_importance_weighted=True, kl_estimator="k2"), "kl_estimator k2"),
                      (grpo.GrpoHParams(kl_in="reward", max_draws_per_update=3), "max_draws_per_update 3"),
                      (grpo.GrpoHParams(top_entropy_quantile=0.0), "top_entropy_quantile 0.0"),
                      (grpo.GrpoHParams(top_entropy_quantile=1.5), "top_entropy_quantile 1.5"),
                      (grpo.GrpoHParams(loss_type="sapo", sapo_tau_neg=0.0), "sapo_tau_neg")):
        with pytest.raises(RunError, match=words):
            check_grpo_losses(hp)


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    ["--grpo.loss_type", "cispo", "--grpo.kl_in", "reward", "--grpo.kl_estimator", "k1", "--grpo.adaptive_kl",
     "--grpo.mask_truncated_completions", "--grpo.entropy_coef", "0.01", "--grpo.top_entropy_quantile", "0.5"],
    ["--grpo.loss_type", "sapo", "--grpo.kl_estimator", "k3", "--grpo.kl_importance_weighted",
     "--grpo.loss_normalizer", "batch_token_mean"]], ids=["cispo-kl_in_reward", "sapo-weighted_k3"])
def test_runs_with_the_loss_options(synthetic_task, tiny_models, tmp_path, options):
    """The options through main on the built-in task (2 updates, 2 epochs x 2 minibatches: ratios move): the run
    ends, every logged loss and KL is finite, and the policy moved."""
    run_ok(grpo_command(synthetic_task, tiny_models, tmp_path, "run", extra=[*options, "--lr", "1e-3"]),
           cwd=REPO_ROOT, env=ENV)
    train = [json.loads(line) for line in open(tmp_path / "runs" / "run" / "metrics.jsonl") if "grpo/kl" in line]
    assert len(train) == 2
    for row in train:
        assert all(math.isfinite(row[key]) for key in ("grpo/loss/policy_avg", "grpo/kl", "grpo/val/ratio"))
    assert train[1]["grpo/val/ratio"] != 1.0  # the second minibatch trains off-policy
    assert os.path.exists(tmp_path / "policy_run" / "model.safetensors")
