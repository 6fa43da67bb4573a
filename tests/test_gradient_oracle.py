"""The gradient oracle (issue 63): on a policy small enough to enumerate, the exact gradient each script's loss follows.

The policy: a vocabulary of 3 tokens, responses of 2 tokens, one row of logits per prefix (the empty prefix and
each first token: a (4, 3) table, a leaf in float64), a fixed reference table and a reward per response. Two cases:
fixed lengths (all 9 responses of 2 tokens, no EOS), and one where token 2 is the EOS, so that the response (2,)
ends after 1 token (7 responses). Every response, and every group of 4 (9^4 and 7^4 = 2,401 groups for RLOO's and
GRPO's groups), is enumerated, so every expectation below is an exact sum.

The oracle computes by autograd on the enumerated sums the exact gradients of E[R], of the sequence
KL(pi || pi_ref), and of the per-token KLs with each prefix held (its probability detached): forward
sum_t E[KL(pi_ref || pi)(. | prefix)] and reverse sum_t E[KL(pi || pi_ref)(. | prefix)]. Where a loss weights a token
by 1 / |o| (GRPO's per-response mean) and an EOS makes lengths vary, the weight depends on the token itself; the
target is then the length-weighted form: each (prefix, token) term times c = 1 / |o| of the response it ends up in
(with the divergences written as sums of nonnegative terms, p_ref log(p_ref / p) + p - p_ref and
p log(p / p_ref) - p + p_ref, so that the weights act per token), and E[(R - E[R]) / |o|] for the policy term.

Against it, each script's own functions (rewards_and_advantages, the loss) are called as the script calls them on a
batch that holds every response (or every group), each weighted by its probability, at ratio 1 (old logprobs = the
current ones, detached): the gradient of that weighted loss is the exact expected gradient of the script's update,
and it must equal the gradient docs/usage.md ("Which gradient each KL setting follows") says it follows, to 1e-9.
A token mean over such a batch is the large-batch limit of the scripts' token means: the token sum divided by
E[|o|], a constant. Batch statistics enter as constants: PPO's whitening off (and once on, over the enumerated rows:
a constant shift and scale), REINFORCE++'s whitening over the enumerated rows (a constant shift and scale), GRPO's
std off (Dr. GRPO) or a fixed batch std (GRPO's per-group std, a statistic of the rewards it scales, follows no
objective and is left out). The settings: each KL estimator (k1, k2, k3, k3 importance-weighted) in the reward and,
where the script allows it, in the loss; GAE with the true and an inexact critic; each of GRPO's normalisers, its
GSPO ratio and CISPO's and SAPO's losses."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch.func import vmap

from conftest import load_script

ppo, rloo, grpo, reinforce_pp = (load_script(name) for name in ("ppo", "rloo", "grpo", "reinforce_pp"))

V, T, PAD = 3, 2, 3  # vocabulary, response length; PAD is no token of the vocabulary (no action)
BETA, K = 0.3, 4  # the KL coefficient; the group size of RLOO and GRPO
DT = torch.float64


class Case:
    """The enumerated policy. eos=False: the 9 responses of 2 tokens (token 2 an ordinary token); eos=True: token 2
    is the EOS, so (2,) is a response of 1 token and the 6 others start with 0 or 1 (7 responses)."""

    def __init__(self, eos: bool):
        self.eos = eos
        self.eos_token_id = 2 if eos else 99  # 99: no token of the vocabulary, so no response holds an EOS
        rows = [(a, b) for a in range(V) for b in range(V) if not (eos and a == 2)] + ([(2, PAD)] if eos else [])
        self.responses = torch.tensor(rows)
        self.mask, self.last_index = grpo.response_mask(self.responses, PAD)  # the scripts' own mask
        self.lengths = self.mask.sum(1).to(DT)
        self.tokens = self.responses.clamp(max=V - 1)  # PAD indexes nothing that counts: it is masked
        self.prefix = torch.stack([torch.zeros_like(self.responses[:, 0]), 1 + self.responses[:, 0]], 1)  # table row
        g = torch.Generator().manual_seed(7 + eos)
        self.theta = (0.9 * torch.randn(V + 1, V, generator=g, dtype=DT)).requires_grad_()
        self.ref_table = torch.log_softmax(0.9 * torch.randn(V + 1, V, generator=g, dtype=DT), -1)
        self.R = torch.randn(len(rows), generator=g, dtype=DT)
        self.ref = self.ref_table[self.prefix, self.tokens] * self.mask
        # c(prefix, token): 1 / |o| of the response that the token ends up in (one response length each at T = 2)
        self.c = torch.zeros(V + 1, V, dtype=DT)
        per_token = (1 / self.lengths).unsqueeze(1).expand(-1, T)
        self.c[self.prefix[self.mask], self.tokens[self.mask]] = per_token[self.mask]

    # the policy's quantities, differentiable in theta
    def logprobs(self):
        """(N, T) the log-probability of each kept token, 0 after the EOS."""
        return torch.log_softmax(self.theta, -1)[self.prefix, self.tokens] * self.mask

    def probs(self):
        return self.logprobs().sum(1).exp()

    def grad(self, value):
        return torch.autograd.grad(value, self.theta)[0]

    # the oracle's objectives
    def expected_reward(self):
        return (self.probs() * self.R).sum()

    def sequence_kl(self):
        return (self.probs() * (self.logprobs() - self.ref).sum(1)).sum()

    def prefix_probs(self):
        """Detached probability of each prefix (table row) that is followed by a token: 1 for the empty one, p(a) for
        a first token a that is not the EOS, 0 for the EOS (it ends the response)."""
        first = torch.log_softmax(self.theta, -1)[0].exp().detach()
        if self.eos:
            first = first * (torch.arange(V) != self.eos_token_id)
        return torch.cat([torch.ones(1, dtype=DT), first])

    def per_token_kl(self, direction: str, length_weighted: bool = False):
        """sum_t E[KL_t] with each prefix held: forward KL(pi_ref || pi) or reverse KL(pi || pi_ref) of each
        prefix's next token, each (prefix, token) term weighted by c = 1 / |o| when length_weighted. "none": the
        terms p - p_ref, which sum to 0 at every prefix (k1 in the loss), unless weighted."""
        logp, ref = torch.log_softmax(self.theta, -1), self.ref_table
        p, p_ref = logp.exp(), ref.exp()
        if direction == "forward":
            terms = p_ref * (ref - logp) + p - p_ref
        elif direction == "none":
            terms = p - p_ref
        else:
            terms = p * (logp - ref) - p + p_ref
        weight = self.c if length_weighted else 1.0
        return (self.prefix_probs().unsqueeze(1) * weight * terms).sum()

    def expected_sum(self, estimator: str):
        """E[sum over the kept tokens of the estimator's value] (its probability and its value both moving)."""
        kl = script_kl(self.logprobs(), self.ref, estimator) * self.mask
        return (self.probs() * kl.sum(1)).sum()

    def mean_length(self):
        return (self.probs() * self.lengths).sum().detach()

    def rollout(self, rows=None, values=None):
        """The Rollout fields the scripts' rewards_and_advantages read, for the responses `rows` (all by default)."""
        rows = torch.arange(len(self.R)) if rows is None else rows
        return SimpleNamespace(responses=self.responses[rows], rm_scores=self.R[rows].unsqueeze(1),
                               logprobs=self.logprobs().detach()[rows], ref_logprobs=self.ref[rows],
                               values=torch.zeros(len(rows), T, dtype=DT) if values is None else values)


def script_kl(logprobs, ref_logprobs, estimator):
    """The scripts' own per-token estimator (ppo.py's copy; tests/test_shared_helpers.py keeps the copies equal)."""
    return ppo.kl_per_token(logprobs, ref_logprobs, estimator)


CASES = {"fixed": Case(eos=False), "eos": Case(eos=True)}


def reward_kl_gradient(case: Case, estimator: str):
    """The gradient that a KL estimator placed in the REWARD (returns-to-go or a sequence reward, its value detached)
    follows: grad E[sum k] less E[sum_t grad k_t], i.e. k1 -> grad sequence KL; k3 -> grad sequence KL less the
    per-token forward KL's; k2 -> grad E[sum k2] less the per-token reverse KL's."""
    if estimator == "k1":
        return case.grad(case.sequence_kl())
    if estimator == "k3":
        return case.grad(case.sequence_kl()) - case.grad(case.per_token_kl("forward"))
    return case.grad(case.expected_sum("k2")) - case.grad(case.per_token_kl("reverse"))


def assert_equal(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-9)


def group_rows(case: Case):
    """Every ordered group of K responses: (G, K) response indices and each group's detached probability (G,)."""
    n = len(case.R)
    index = torch.cartesian_prod(*[torch.arange(n)] * K)
    return index, case.probs().detach()[index].prod(1)


# ---------------------------------------------------------------------------------------------------------------------
# the oracle itself
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fixed", "eos"])
def test_oracle_targets_are_distinct(name):
    """The targets the table names differ from each other, so each test below can tell them apart: the sequence KL
    and the per-token reverse KL have the same value (the chain rule) but not the same gradient (the sequence KL also
    moves through the later tokens an earlier choice leads to), and forward is not reverse."""
    case = CASES[name]
    seq, rev, fwd = case.sequence_kl(), case.per_token_kl("reverse"), case.per_token_kl("forward")
    assert seq.item() == pytest.approx(rev.item(), abs=1e-12)
    assert seq.item() == pytest.approx(case.expected_sum("k1").item(), abs=1e-12)
    assert seq.item() == pytest.approx(case.expected_sum("k3").item(), abs=1e-12)  # k3's value is unbiased too
    g_seq, g_rev, g_fwd = case.grad(seq), case.grad(rev), case.grad(fwd)
    for a, b in ((g_seq, g_rev), (g_rev, g_fwd), (g_seq, g_fwd)):
        assert (a - b).abs().max() > 1e-3
    assert_equal(case.grad(case.per_token_kl("none")), torch.zeros_like(g_fwd))  # k1 in the loss: no gradient
    if case.eos:  # the length-weighted forms differ from the plain ones only when lengths vary
        assert (case.grad(case.per_token_kl("forward", True)) - g_fwd / 2).abs().max() > 1e-3
        assert case.grad(case.per_token_kl("none", True)).abs().max() > 1e-3
    else:
        assert_equal(case.grad(case.per_token_kl("forward", True)), g_fwd / 2)
        assert_equal(case.grad(case.per_token_kl("none", True)), torch.zeros_like(g_fwd))


# ---------------------------------------------------------------------------------------------------------------------
# ppo.py: the KL in the per-token reward, GAE, the token-mean loss
# ---------------------------------------------------------------------------------------------------------------------


def true_values(case: Case, rewards: torch.Tensor) -> torch.Tensor:
    """V(prefix) = E[return-to-go | prefix] under the policy, at each (response, t): the exact value function of the
    per-token rewards (N, T), by enumeration."""
    p = case.probs().detach()
    to_go = rewards.flip(1).cumsum(1).flip(1) * case.mask
    key = torch.arange(T).unsqueeze(0) * (V + 1) + case.prefix  # (t, prefix)
    m = case.mask
    num = torch.zeros(T * (V + 1), dtype=DT).index_add_(0, key[m], (p.unsqueeze(1) * to_go)[m])
    den = torch.zeros(T * (V + 1), dtype=DT).index_add_(0, key[m], p.unsqueeze(1).expand(-1, T)[m])
    return torch.where(m, num[key] / den[key].clamp(min=1e-300), 0.0)


def ppo_expected_gradient(case: Case, estimator: str, lam: float, critic_error: float = 0.0, whiten: bool = False):
    """The expected gradient of ppo.py's policy loss (ppo_losses' pg_loss) at ratio 1, and the scored rollout."""
    args = ppo.Args()
    args.non_eos_penalty = False
    hp = dataclasses.replace(args.ppo, kl_estimator=estimator, lam=lam, gamma=1.0, whiten_advantages=whiten,
                             whiten_rewards=False)
    gather = lambda x: x  # noqa: E731  one process
    first = ppo.rewards_and_advantages(args, hp, case.rollout(), case.eos_token_id, PAD, BETA, None, gather)
    values = true_values(case, first.rewards)
    # an inexact critic: wrong at the second token's prefixes only
    values = values + critic_error * (case.prefix - 1).clamp(min=0).to(DT) * (torch.arange(T) == 1) * case.mask
    scored = ppo.rewards_and_advantages(args, hp, case.rollout(values=values), case.eos_token_id, PAD, BETA, None,
                                        gather)
    new = case.logprobs()
    weighted_mask = case.probs().detach().unsqueeze(1) * case.mask  # each response weighted by its probability
    pg_loss, _, _ = ppo.ppo_losses(new, new.detach(), scored.advantages, scored.values, scored.values,
                                   scored.returns, weighted_mask, hp.cliprange, hp.cliprange_value)
    return case.grad(pg_loss), scored


@pytest.mark.parametrize("name", ["fixed", "eos"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("lam", [1.0, 0.95, 0.0])
def test_ppo_kl_in_reward_with_true_values(name, estimator, lam):
    """ppo.py, advantage whitening off: with the true value function GAE is exact at any lambda, so the policy loss
    follows -(grad E[R] - beta x the reward KL's gradient) / E[|o|] (the token mean's normaliser): k1 -> the sequence
    KL's gradient; k3 -> the sequence KL's less the per-token forward KL's."""
    case = CASES[name]
    g, _ = ppo_expected_gradient(case, estimator, lam)
    target = -(case.grad(case.expected_reward()) - BETA * reward_kl_gradient(case, estimator)) / case.mean_length()
    assert_equal(g, target)


@pytest.mark.parametrize("name", ["fixed", "eos"])
def test_ppo_gae_inexact_critic(name):
    """An inexact critic: at lambda = 1 GAE is the return less V(s_t), a baseline, and stays exact; at lambda < 1 it
    bootstraps from the wrong V(s_{t+1}) and the gradient is biased."""
    case = CASES[name]
    target = -(case.grad(case.expected_reward()) - BETA * reward_kl_gradient(case, "k1")) / case.mean_length()
    exact, _ = ppo_expected_gradient(case, "k1", lam=1.0, critic_error=0.5)
    assert_equal(exact, target)
    biased, _ = ppo_expected_gradient(case, "k1", lam=0.5, critic_error=0.5)
    assert (biased - target).abs().max() > 1e-3


def test_ppo_whitened_advantages_scale_the_gradient():
    """Advantage whitening (the default), its statistics taken over the batch: a constant shift (no bias, as any
    baseline) and a constant scale 1 / std, the std of the unwhitened advantages computed here by hand."""
    case = CASES["eos"]
    plain, raw = ppo_expected_gradient(case, "k1", lam=0.95)
    g, scored = ppo_expected_gradient(case, "k1", lam=0.95, whiten=True)
    m = case.mask
    mean = raw.advantages[m].mean()
    std = (((raw.advantages[m] - mean) ** 2).mean() + 1e-8).sqrt()
    assert_equal(scored.advantages[m], (raw.advantages[m] - mean) / std)
    assert_equal(g, plain / std)


# ---------------------------------------------------------------------------------------------------------------------
# rloo.py: the KL in the sequence reward, the leave-one-out baseline
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fixed", "eos"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_rloo_leave_one_out_is_unbiased(name, estimator):
    """rloo.py over every group of 4: the leave-one-out baseline is independent of the response, so the expected
    gradient of rloo_loss (a mean over the group's responses) is exactly -(grad E[R] - beta x the reward KL's
    gradient): k1 -> the sequence KL's; k3 -> the sequence KL's less the per-token forward KL's."""
    case = CASES[name]
    args = rloo.Args()
    args.non_eos_penalty, args.rloo_k = False, K
    hp = dataclasses.replace(args.rloo, kl_estimator=estimator)
    index, group_p = group_rows(case)
    rows = index.flatten()
    scored = rloo.rewards_and_advantages(args, hp, case.rollout(rows), case.eos_token_id, PAD, BETA, None, None)
    new = case.logprobs()[rows]

    def group_loss(new, advantages, mask):  # one group is one batch of rloo_loss
        return rloo.rloo_loss(new, new.detach(), advantages, mask, hp.cliprange)[0]

    losses = vmap(group_loss)(new.view(-1, K, T), scored.advantages.view(-1, K), scored.mask.view(-1, K, T))
    g = case.grad((group_p * losses).sum())
    assert_equal(g, -(case.grad(case.expected_reward()) - BETA * reward_kl_gradient(case, estimator)))


# ---------------------------------------------------------------------------------------------------------------------
# grpo.py: the KL in the loss, the group mean, each loss normaliser
# ---------------------------------------------------------------------------------------------------------------------

BATCH_STD = torch.tensor([0.0, 1.5, 4.0], dtype=DT)  # a fixed "batch" whose std stands in for the gathered one


def grpo_expected_gradient(case: Case, normalizer: str, std: str, kl_coef: float, ratio_level: str = "token", **kl):
    """The expected gradient of grpo.py's grpo_loss at ratio 1 over every group of K, each group one batch with
    token_weights' weights, called as grpo_update calls it; kl: the other GrpoHParams fields (kl_estimator, kl_in,
    kl_importance_weighted, loss_type). DAPO's token count, a batch statistic, enters as its expectation K E[|o|]."""
    args = grpo.Args()
    args.non_eos_penalty, args.group_size, args.response_length = False, K, T
    hp = dataclasses.replace(args.grpo, advantage_std=std, loss_normalizer=normalizer, ratio_level=ratio_level,
                             kl_coef=kl_coef, **kl)
    index, group_p = group_rows(case)
    rows = index.flatten()
    scored = grpo.rewards_and_advantages(args, hp, case.rollout(rows), case.eos_token_id, PAD, None,
                                         lambda x: BATCH_STD, kl_coef=kl_coef)
    new, ref = case.logprobs()[rows], case.ref[rows]
    # shape (1,), not a 0-dim tensor: a 0-dim float64 would leave token_weights' float32 mask / tokens in float32
    tokens = (K * case.mean_length()).reshape(1)

    def group_loss(new, ref, advantages, mask):
        weights = grpo.token_weights(mask, normalizer, T, tokens)
        return grpo.grpo_loss(new, new.detach(), ref, advantages, weights, *grpo.clip_range(hp),
                              0.0 if hp.kl_in == "reward" else kl_coef, hp.ratio_level, hp.loss_type,
                              (hp.sapo_tau_pos, hp.sapo_tau_neg), hp.kl_estimator, hp.kl_importance_weighted)[0]

    losses = vmap(group_loss)(new.view(-1, K, T), ref.view(-1, K, T), scored.advantages.view(-1, K),
                              scored.mask.view(-1, K, T))
    return case.grad((group_p * losses).sum())


# the per-token KL that a KL estimator in the LOSS follows (k3 as published: forward; k2 and k3 importance-weighted:
# reverse; k1: none, zero in expectation unless length-weighted)
LOSS_KL = {("k1", False): "none", ("k2", False): "reverse", ("k3", False): "forward", ("k3", True): "reverse"}


def grpo_target(case: Case, normalizer: str, std: str, kl_coef: float, group_factor: float = (K - 1) / K,
                kl_estimator: str = "k3", kl_in: str = "loss", kl_importance_weighted: bool = False):
    """The gradient grpo_loss follows: -(k - 1) / k / s x the policy term + beta x the loss KL's per-token KL, both
    under the normaliser's weights: response_mean the length-weighted forms (grad E[(R - E[R]) / |o|], the
    c-weighted per-token KL), constant 1 / T, batch_token_mean 1 / E[|o|]. kl_in reward: the policy term's reward is
    R - beta x the summed estimator (its gradient reward_kl_gradient's), and the loss has no KL term."""
    s = BATCH_STD.std() + 1e-4 if std == "batch" else 1.0
    if kl_in == "reward":
        reward = case.R - kl_coef * (script_kl(case.logprobs(), case.ref, kl_estimator) * case.mask).sum(1).detach()
        direction = None
    else:
        reward, direction = case.R, LOSS_KL[kl_estimator, kl_importance_weighted]
    if normalizer == "response_mean":
        mean_r = (case.probs() * reward).sum().detach()
        policy = case.grad((case.probs() * (reward - mean_r) / case.lengths).sum())
        kl = case.grad(case.per_token_kl(direction, length_weighted=True)) if direction else 0.0
    else:
        scale = 1 / T if normalizer == "constant" else 1 / case.mean_length()
        policy = case.grad(case.expected_reward())
        if kl_in == "reward":
            policy = policy - kl_coef * reward_kl_gradient(case, kl_estimator)
        policy = scale * policy
        kl = scale * case.grad(case.per_token_kl(direction)) if direction else 0.0
    return -group_factor / s * policy + kl_coef * kl


@pytest.mark.parametrize("name", ["fixed", "eos"])
@pytest.mark.parametrize("normalizer", ["response_mean", "constant", "batch_token_mean"])
@pytest.mark.parametrize("std", ["none", "batch"])
def test_grpo_k3_in_loss_follows_forward_kl(name, normalizer, std):
    """grpo.py as published (k3 in the loss, no importance weight): the per-token FORWARD KL(pi_ref || pi), prefixes
    held, and the group-relative policy term scaled by (k - 1) / k (the group mean holds the response's own reward);
    under response_mean with varying lengths, both in their length-weighted forms."""
    case = CASES[name]
    assert_equal(grpo_expected_gradient(case, normalizer, std, BETA), grpo_target(case, normalizer, std, BETA))


GRPO_KL_SETTINGS = [("k1", False, "loss"), ("k2", False, "loss"), ("k3", True, "loss"),
                    ("k1", False, "reward"), ("k2", False, "reward"), ("k3", False, "reward")]


@pytest.mark.parametrize("name", ["fixed", "eos"])
@pytest.mark.parametrize("normalizer", ["response_mean", "constant", "batch_token_mean"])
@pytest.mark.parametrize("estimator,importance_weighted,kl_in", GRPO_KL_SETTINGS)
def test_grpo_kl_settings(name, normalizer, estimator, importance_weighted, kl_in):
    """--grpo.kl_estimator, --grpo.kl_importance_weighted and --grpo.kl_in: in the loss k1 follows no KL (zero in
    expectation; under response_mean with varying lengths the length-weighted grad sum c x p, which lowers the
    probability of ending early), k2 and the importance-weighted k3 the per-token REVERSE KL with prefixes held; in the
    reward (a
    sequence reward, then the group's mean) k1 follows the sequence KL's gradient, k3 the sequence KL's less the
    per-token forward KL's, k2 grad E[sum k2] less the per-token reverse KL's, scaled by (k - 1) / k as the score."""
    case = CASES[name]
    kl = dict(kl_estimator=estimator, kl_importance_weighted=importance_weighted, kl_in=kl_in)
    assert_equal(grpo_expected_gradient(case, normalizer, "none", BETA, **kl),
                 grpo_target(case, normalizer, "none", BETA, **kl))


@pytest.mark.parametrize("name", ["fixed", "eos"])
@pytest.mark.parametrize("normalizer", ["response_mean", "constant", "batch_token_mean"])
@pytest.mark.parametrize("loss_type", ["cispo", "sapo"])
def test_cispo_and_sapo_at_ratio_one_are_grpo(name, normalizer, loss_type):
    """--grpo.loss_type cispo (MiniMax-M1) and sapo: at ratio 1 the clipped, detached weight and the soft gate are 1
    with GRPO's slope, so the expected gradient is GRPO's (the KL term k3 as published)."""
    case = CASES[name]
    assert_equal(grpo_expected_gradient(case, normalizer, "none", BETA, loss_type=loss_type),
                 grpo_target(case, normalizer, "none", BETA))


@pytest.mark.parametrize("name", ["fixed", "eos"])
def test_grpo_group_mean_scales_by_k_minus_1_over_k(name):
    """The factor (k - 1) / k, asserted: without the KL term, the expected gradient is 3/4 of the one the policy term
    would have with a baseline independent of the response (RLOO's), and not that one."""
    case = CASES[name]
    g = grpo_expected_gradient(case, "constant", "none", 0.0)
    unscaled = grpo_target(case, "constant", "none", 0.0, group_factor=1.0)
    assert_equal(g, (K - 1) / K * unscaled)
    assert (g - unscaled).abs().max() > 1e-3


def test_grpo_response_mean_is_length_weighted():
    """With an EOS, GRPO's 1 / |o| depends on the token itself: the gradient is the length-weighted one, not the
    plain gradient over a mean length (which it would be with fixed lengths)."""
    case = CASES["eos"]
    g = grpo_expected_gradient(case, "response_mean", "none", BETA)
    plain = grpo_target(case, "batch_token_mean", "none", BETA)
    assert (g - plain).abs().max() > 1e-3
    assert_equal(g, grpo_target(case, "response_mean", "none", BETA))


@pytest.mark.parametrize("name", ["fixed", "eos"])
@pytest.mark.parametrize("normalizer", ["response_mean", "constant", "batch_token_mean"])
def test_gspo_at_ratio_one_is_grpo(name, normalizer):
    """--grpo.ratio_level sequence at ratio 1 (one optimizer step per rollout) has GRPO's gradient under every
    normaliser (issue 63 item 2): the sequence ratio cannot move."""
    case = CASES[name]
    assert_equal(grpo_expected_gradient(case, normalizer, "none", BETA, ratio_level="sequence"),
                 grpo_target(case, normalizer, "none", BETA))


# ---------------------------------------------------------------------------------------------------------------------
# reinforce_pp.py: the KL in the per-token reward, returns-to-go, whitened over the batch
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fixed", "eos"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_reinforce_pp_kl_in_reward(name, estimator):
    """reinforce_pp.py (baseline batch, gamma 1): returns-to-go of the per-token reward, whitened with the batch's
    mean and std (a constant shift: no bias; a constant scale: 1 / std, computed here by hand), in a token-mean
    loss: -(grad E[R] - beta x the reward KL's gradient) / (std x E[|o|]), the reward KL's gradient k1's, k2's or
    k3's (reward_kl_gradient)."""
    case = CASES[name]
    args = reinforce_pp.Args()
    args.non_eos_penalty = False
    hp = dataclasses.replace(args.reinforce_pp, kl_estimator=estimator, baseline="batch", gamma=1.0)
    scored = reinforce_pp.rewards_and_advantages(args, hp, case.rollout(), case.eos_token_id, PAD, BETA, None,
                                                 lambda x: x)
    m = case.mask
    mean = scored.returns[m].mean()
    std = (((scored.returns[m] - mean) ** 2).mean() + 1e-8).sqrt()
    assert_equal(scored.advantages[m], (scored.returns[m] - mean) / std)
    new = case.logprobs()
    # reinforce_pp_update's loss, each response weighted by its probability
    pg_loss, _ = reinforce_pp.clipped_policy_loss(new - new.detach(), scored.advantages,
                                                  case.probs().detach().unsqueeze(1) * m, hp.cliprange)
    target = -(case.grad(case.expected_reward()) - BETA * reward_kl_gradient(case, estimator))
    assert_equal(case.grad(pg_loss), target / (std * case.mean_length()))


@pytest.mark.parametrize("name", ["fixed", "eos"])
@pytest.mark.parametrize("estimator,importance_weighted", [("k1", False), ("k2", False), ("k3", False), ("k3", True)])
def test_reinforce_pp_kl_in_loss(name, estimator, importance_weighted):
    """--reinforce_pp.kl_in loss (OpenRLHF's use_kl_loss): the reward is the score alone, and kl_loss, a token mean
    like the policy loss's, follows: k1 no KL (zero in expectation), k2 and the importance-weighted k3 the per-token
    reverse KL, k3 the per-token forward KL, prefixes held, each over E[|o|]."""
    case = CASES[name]
    args = reinforce_pp.Args()
    args.non_eos_penalty = False
    hp = dataclasses.replace(args.reinforce_pp, kl_estimator=estimator, kl_importance_weighted=importance_weighted,
                             kl_in="loss", baseline="batch", gamma=1.0)
    scored = reinforce_pp.rewards_and_advantages(args, hp, case.rollout(), case.eos_token_id, PAD, BETA, None,
                                                 lambda x: x)
    m = case.mask
    mean = scored.returns[m].mean()
    std = (((scored.returns[m] - mean) ** 2).mean() + 1e-8).sqrt()
    new, weighted_mask = case.logprobs(), case.probs().detach().unsqueeze(1) * m
    # reinforce_pp_update's loss with the KL term, each response weighted by its probability
    pg_loss, _ = reinforce_pp.clipped_policy_loss(new - new.detach(), scored.advantages, weighted_mask, hp.cliprange)
    loss = pg_loss + BETA * reinforce_pp.kl_loss(new, new.detach(), case.ref, weighted_mask, hp)
    kl = case.grad(case.per_token_kl(LOSS_KL[estimator, importance_weighted]))
    target = (-case.grad(case.expected_reward()) / std + BETA * kl) / case.mean_length()
    assert_equal(case.grad(loss), target)
