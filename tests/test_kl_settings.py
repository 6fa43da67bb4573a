"""The KL settings of issue 63 (items 1 and 3): k2 in every copy of kl_per_token, by hand; reinforce_pp.py's
--reinforce_pp.kl_in loss (the KL in the update's loss, none in the reward), the importance-weighted k3 (its value by
hand, its gradient at ratio 1 k2's, by autograd in float64), --reinforce_pp.kl_clamp, --reinforce_pp.clip_after_baseline
(the two orders of clip and group mean, by hand), the refusals of settings that cannot act, and the docs' line of
OpenRLHF's REINFORCE++-baseline example, parsed as the script parses it. Which gradient each setting follows against
the exact one is tests/test_gradient_oracle.py's."""

import dataclasses
import json
import math
import shlex
import sys

import pytest
import torch
import tyro

from conftest import ENV, REPO_ROOT, bigram_policy, load_script, run_ok
from rlhf_utils.checks import RunError
from rlhf_utils.flags import RunFlags, check_kl_flags

SCRIPTS = {name: load_script(name) for name in ("ppo", "rloo", "grpo", "reinforce_pp")}
reinforce_pp = SCRIPTS["reinforce_pp"]
sys.modules["reinforce_pp"] = reinforce_pp  # tyro reads the docstrings of nested dataclasses through the module


def test_k2_and_the_other_estimators_by_hand_in_every_copy():
    """log p - log p_ref = 0.5, -1, 0: k1 is it; k2 its square over 2 (0.125, 0.5, 0); k3 = e^-x - 1 + x."""
    logprobs, ref = torch.tensor([-0.5, -2.0, -0.7]), torch.tensor([-1.0, -1.0, -0.7])
    expected = {"k1": [0.5, -1.0, 0.0], "k2": [0.125, 0.5, 0.0],
                "k3": [math.exp(-0.5) - 0.5, math.exp(1.0) - 2.0, 0.0]}
    for name, script in SCRIPTS.items():
        for estimator, values in expected.items():
            assert script.kl_per_token(logprobs, ref, estimator).tolist() == pytest.approx(values, abs=1e-7), name
        with pytest.raises(RunError, match="unknown KL estimator 'k4'"):
            script.kl_per_token(logprobs, ref, "k4")


# ---------------------------------------------------------------------------------------------------------------------
# reinforce_pp.py: a fixed rollout of a bigram policy (tests/test_grpo_recipes.py's), the update in this process
# ---------------------------------------------------------------------------------------------------------------------
VOCAB, PAD, EOS, QUERY, T = 9, 8, 3, 2, 6
BATCH = 8  # 4 groups of 2


def fixed_rollout(args):
    """Responses of T tokens whose EOS comes at 1 to 5 tokens (a quarter without one), scores drawn once, a reference
    table away from the policy's (so every KL has a gradient); logprobs the policy's own (the first ratio is 1)."""
    generator = torch.Generator().manual_seed(0)
    table = torch.randn(VOCAB, VOCAB, generator=generator)
    ref_table = table + 0.5 * torch.randn(VOCAB, VOCAB, generator=generator)
    queries = torch.randint(4, PAD, (BATCH // 2, QUERY), generator=generator).repeat_interleave(2, 0)
    raw = torch.randint(4, PAD, (BATCH, T), generator=generator)
    eos_at = torch.randint(1, T, (BATCH,), generator=generator)
    with_eos = torch.arange(BATCH) % 4 != 3
    raw[with_eos, eos_at[with_eos]] = EOS
    query_responses = torch.cat((queries, raw), 1)
    with torch.no_grad():
        logprobs, ref_logprobs = (
            reinforce_pp.training_logprobs(bigram_policy(t), query_responses, QUERY, args.temperature, PAD)[0]
            for t in (table, ref_table))
    responses = reinforce_pp.truncate_response(EOS, PAD, raw)
    data = reinforce_pp.Rollout(query_responses=query_responses, responses=responses, logprobs=logprobs,
                                ref_logprobs=ref_logprobs,
                                rm_scores=torch.randn(BATCH, 1, generator=generator))
    return table, data


def args_with(**settings):
    args = reinforce_pp.Args(samples_per_prompt=2, total_batch_size=BATCH, local_micro_batch_size=BATCH)
    args.reinforce_pp = dataclasses.replace(args.reinforce_pp, baseline="group", **settings)
    return args


def scored_of(args, kl_coef: float):
    """rewards_and_advantages of the fixed rollout."""
    _, data = fixed_rollout(args)
    return reinforce_pp.rewards_and_advantages(args, args.reinforce_pp, data, EOS, PAD, kl_coef,
                                               [reinforce_pp.RunningMoments()], lambda x: x)


def update(args, kl_coef: float):
    """One update (one micro batch of the whole batch), SGD at lr 1, so that the step is minus the gradient: the
    step, the statistics and what rewards_and_advantages gave it."""
    from accelerate import Accelerator

    table, data = fixed_rollout(args)
    accelerator = Accelerator(cpu=True)
    accelerator.gradient_accumulation_steps = 1
    model = bigram_policy(table)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    hp = args.reinforce_pp
    scored = reinforce_pp.rewards_and_advantages(args, hp, data, EOS, PAD, kl_coef, [reinforce_pp.RunningMoments()],
                                                 lambda x: x)
    ptx = reinforce_pp.PtxData(0.0, args, None, 0, 1, 1)
    stats = reinforce_pp.reinforce_pp_update(args, hp, accelerator, model, optimizer, data, scored, 1,
                                             lambda *_, **__: None, ptx, PAD, kl_coef)
    return model.table.detach() - table, stats, scored, table, data


def test_kl_in_loss_puts_the_kl_in_the_loss_and_none_in_the_reward():
    """--reinforce_pp.kl_in loss: each token's reward is 0 but the (centred) score at the EOS, the advantages are those
    of kl_coef 0, the logged KL is still the rollout's; the update's step is minus the gradient of the policy loss plus
    kl_coef x the token mean of k2 of the new policy (computed here by autograd), and the loss term is logged."""
    beta = 0.5
    step, stats, scored, table, data = update(args_with(kl_in="loss", kl_estimator="k2"), beta)
    no_kl, in_reward = (scored_of(args_with(kl_estimator="k2"), coef) for coef in (0.0, beta))
    assert (scored.non_score_reward == 0).all()
    torch.testing.assert_close(scored.rewards, no_kl.rewards)
    torch.testing.assert_close(scored.advantages, no_kl.advantages)
    assert not torch.allclose(in_reward.rewards, no_kl.rewards)  # the reward's KL is there without the setting
    k2 = 0.5 * (data.logprobs - data.ref_logprobs) ** 2 * scored.mask
    torch.testing.assert_close(scored.kl, k2)  # the rollout's KL, logged (objective/kl)

    policy = bigram_policy(table)
    new = reinforce_pp.training_logprobs(policy, data.query_responses, QUERY, 0.7, PAD)[0]
    pg_loss, _ = reinforce_pp.clipped_policy_loss(new - data.logprobs, scored.advantages, scored.mask, 0.2)
    kl_term = ((0.5 * (new - data.ref_logprobs) ** 2) * scored.mask).sum() / scored.mask.sum()
    (grad,) = torch.autograd.grad(pg_loss + beta * kl_term, policy.table)
    torch.testing.assert_close(step, -grad)
    assert stats["kl_loss"].item() == pytest.approx(kl_term.item(), rel=1e-5)
    assert kl_term.item() > 0
    # without the loss's KL term the step differs: the term acts
    plain, _, _, _, _ = update(args_with(kl_in="loss", kl_estimator="k2"), 0.0)
    assert (plain - step).norm() > 1e-3 * step.norm()
    assert "kl_loss" not in update(args_with(), beta)[1]  # the default logs no loss term


def test_importance_weighted_k3_by_hand_and_its_gradient_at_ratio_one_is_k2s():
    """r k3 with r = p / p_old (not detached), a token mean: by hand at ratios away from 1; at ratio 1 its gradient
    equals k2's (the per-token reverse KL's) and differs from uncorrected k3's, by autograd in float64."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float64)
    logits = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 5, (3, 4))
    ref = torch.log_softmax(torch.randn(3, 4, 5, dtype=torch.float64), -1).gather(2, tokens.unsqueeze(-1)).squeeze(-1)

    def logprobs():
        return torch.log_softmax(logits, -1).gather(2, tokens.unsqueeze(-1)).squeeze(-1)

    def hp(**settings):
        return dataclasses.replace(reinforce_pp.ReinforcePpHParams(), kl_in="loss", **settings)

    weighted = hp(kl_estimator="k3", kl_importance_weighted=True)
    # the value, off-policy: old log-probs 0.3 away from the new ones on every token
    new = logprobs().detach()
    old = new - 0.3
    r_ref = torch.exp(ref - new)
    by_hand = (math.exp(0.3) * (r_ref - 1 - torch.log(r_ref)) * mask).sum() / mask.sum()
    value = reinforce_pp.kl_loss(new, old, ref, mask, weighted)
    torch.testing.assert_close(value, by_hand)
    uncorrected = reinforce_pp.kl_loss(new, old, ref, mask, hp(kl_estimator="k3"))
    assert value.item() == pytest.approx(math.exp(0.3) * uncorrected.item())

    def gradient(setting):
        new = logprobs()
        return torch.autograd.grad(reinforce_pp.kl_loss(new, new.detach(), ref, mask, setting), logits)[0]

    k2, k3 = gradient(hp(kl_estimator="k2")), gradient(hp(kl_estimator="k3"))
    torch.testing.assert_close(gradient(weighted), k2, rtol=0, atol=1e-12)
    assert (k3 - k2).abs().max() > 1e-3  # uncorrected k3 follows another gradient (the forward KL's)


def test_kl_clamp_clamps_the_estimate_in_the_reward_and_the_loss():
    """--reinforce_pp.kl_clamp 0.3: k1 of 0.5, -1 and 0.1 becomes 0.3, -0.3 and 0.1, in the reward's KL and in the
    loss's (where a clamped token has no gradient); None leaves it as it is."""
    logprobs = torch.tensor([[-0.5, -2.0, -0.9]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0, -1.0]])
    clamped = dataclasses.replace(reinforce_pp.ReinforcePpHParams(), kl_clamp=0.3)
    assert reinforce_pp.clamped_kl(logprobs, ref, clamped)[0].tolist() == pytest.approx([0.3, -0.3, 0.1])
    free = reinforce_pp.ReinforcePpHParams()
    assert reinforce_pp.clamped_kl(logprobs, ref, free)[0].tolist() == pytest.approx([0.5, -1.0, 0.1])
    mask = torch.ones(1, 3)
    (grad,) = torch.autograd.grad(reinforce_pp.kl_loss(logprobs, logprobs.detach(), ref, mask, clamped), logprobs)
    assert grad[0].tolist() == pytest.approx([0.0, 0.0, 1 / 3])
    # in the rollout's KL, the one the reward holds (kl_coef 1: each token's reward is minus its clamped KL)
    args = args_with(kl_clamp=0.05)
    _, data = fixed_rollout(args)
    scored = scored_of(args, 1.0)
    raw = reinforce_pp.kl_per_token(data.logprobs, data.ref_logprobs, "k1") * scored.mask
    assert raw.abs().max() > 0.05  # the clamp has something to do
    torch.testing.assert_close(scored.kl, raw.clamp(-0.05, 0.05))
    torch.testing.assert_close(scored.non_score_reward, -scored.kl)


def test_clip_after_baseline_orders_the_clip_and_the_group_mean():
    """REINFORCE++-baseline, groups of 2, scores 2 and -1 (the second has no EOS: the EOS trick), 4 and 1, clip 1.2,
    no KL: clipped first (the default), 1.2, -1, 1.2, 1 less their group means 0.1 and 1.1; clipped after
    (OpenRLHF's order), 1.5, -1.5, 1.5, -1.5 clipped to +-1.2. The logged scores are the clipped scores, or the
    scores."""
    args = reinforce_pp.Args(samples_per_prompt=2)
    data = reinforce_pp.Rollout(query_responses=torch.full((4, 6), 4), responses=torch.tensor(
        [[5, EOS, PAD, PAD], [5, 6, 7, 5], [EOS, PAD, PAD, PAD], [6, 6, EOS, PAD]]), logprobs=torch.zeros(4, 4),
        ref_logprobs=torch.zeros(4, 4), rm_scores=torch.tensor([[2.0], [3.0], [4.0], [1.0]]))
    last = [1, 3, 0, 2]
    for after, centred, logged in ((False, [1.1, -1.1, 0.1, -0.1], [1.2, -1.0, 1.2, 1.0]),
                                   (True, [1.2, -1.2, 1.2, -1.2], [2.0, -1.0, 4.0, 1.0])):
        hp = dataclasses.replace(args.reinforce_pp, baseline="group", reward_clip=1.2, clip_after_baseline=after)
        out = reinforce_pp.rewards_and_advantages(args, hp, data, EOS, PAD, 0.0, [reinforce_pp.RunningMoments()],
                                                  lambda x: x)
        assert out.rewards[torch.arange(4), last].tolist() == pytest.approx(centred)
        assert out.rewards.sum().item() == pytest.approx(sum(centred))  # nothing but the score at the EOS
        assert out.scores.tolist() == pytest.approx(logged)


def test_settings_that_cannot_act_are_refused_before_anything_loads(tmp_path):
    """The importance weight multiplies a k3 term of the loss: refused with the KL in the reward, or with k1 / k2;
    a clamp must be positive. Through main: refused before any model loads (the model paths do not exist)."""
    hp = reinforce_pp.ReinforcePpHParams
    check_kl_flags(None)  # the other scripts
    check_kl_flags(hp())
    check_kl_flags(hp(kl_in="loss", kl_estimator="k3", kl_importance_weighted=True, kl_clamp=10.0))
    for settings in ({"kl_importance_weighted": True}, {"kl_importance_weighted": True, "kl_estimator": "k3"},
                     {"kl_importance_weighted": True, "kl_in": "loss", "kl_estimator": "k2"}):
        with pytest.raises(RunError, match=r"--reinforce_pp.kl_importance_weighted .* pass --reinforce_pp.kl_in loss "
                                           r"--reinforce_pp.kl_estimator k3 with it"):
            check_kl_flags(hp(**settings))
    for bound in (0.0, -1.0):
        with pytest.raises(RunError, match=f"--reinforce_pp.kl_clamp {bound} bounds .* a positive value"):
            check_kl_flags(hp(kl_clamp=bound))
    args = reinforce_pp.Args(total_batch_size=8, local_micro_batch_size=2, total_episodes=16,
                             run=RunFlags(run_dir_root=str(tmp_path)), sft_model_path=str(tmp_path / "none"))
    args.reinforce_pp.kl_importance_weighted = True
    with pytest.raises(RunError, match="--reinforce_pp.kl_importance_weighted"):
        reinforce_pp.main(args)


# ---------------------------------------------------------------------------------------------------------------------
# docs/usage.md: "REINFORCE++ as OpenRLHF's example runs it"
# ---------------------------------------------------------------------------------------------------------------------
def doc_recipe() -> list:
    """The flags of the section's command line (the model paths, "...", left out)."""
    text = open(f"{REPO_ROOT}/docs/usage.md").read()
    section = text[text.index("### REINFORCE++ as OpenRLHF's example runs it"):]
    start = section.index("```bash") + len("```bash")
    words = shlex.split(section[start: section.index("```", start)].replace("\\\n", " "))
    assert words[:3] == ["python", "reinforce_pp.py", "..."], words
    return words[3:]


def test_the_docs_recipe_of_openrlhfs_reinforce_pp_baseline():
    """Parsed as reinforce_pp.py parses its flags: 8 samples, the group baseline, gamma 1, k2 in the loss at 1e-5,
    the KL clamped and the scores clipped to +-10 after the baseline, nothing else changed; it passes the refusals
    at the default batch sizes, and its update has the KL in the loss and none in the reward."""
    args = tyro.cli(reinforce_pp.Args, args=doc_recipe(), use_underscores=True)
    hp, default = args.reinforce_pp, reinforce_pp.ReinforcePpHParams()
    changed = {f.name for f in dataclasses.fields(hp) if getattr(hp, f.name) != getattr(default, f.name)}
    assert changed == {"baseline", "kl_in", "kl_estimator", "kl_coef", "kl_clamp", "reward_clip",
                       "clip_after_baseline"}  # gamma 1 is the default
    assert args.samples_per_prompt == 8 and hp.baseline == "group" and hp.gamma == 1.0
    assert (hp.kl_in, hp.kl_estimator, hp.kl_coef) == ("loss", "k2", 1e-5) and not hp.kl_importance_weighted
    assert hp.kl_clamp == 10.0 and hp.reward_clip == 10.0 and hp.clip_after_baseline
    reinforce_pp.batch_arithmetic(args, hp, 1)
    check_kl_flags(hp)
    small = args_with(**{name: getattr(hp, name) for name in changed - {"baseline"}})
    _, stats, scored, _, _ = update(small, hp.kl_coef)
    assert (scored.non_score_reward == 0).all() and stats["kl_loss"].item() > 0


@pytest.mark.slow
def test_the_docs_recipe_runs_one_update(synthetic_task, tiny_models, tmp_path):
    """The docs' line, its flags as printed, runs one update of 8 responses to one prompt on the built-in task (tiny
    models) and logs the loss's KL term; the reward holds none."""
    from test_reinforce_pp import reinforce_pp_command

    command = reinforce_pp_command(synthetic_task, tiny_models, tmp_path, "recipe", 8, doc_recipe())
    run_ok(command, cwd=REPO_ROOT, env=ENV)
    rows = [json.loads(line) for line in open(tmp_path / "runs" / "recipe" / "metrics.jsonl")]
    train = [row for row in rows if "reinforce_pp/kl_loss" in row]
    assert len(train) == 1 and train[0]["objective/non_score_reward"] == 0 and train[0]["objective/kl_coef"] == 1e-5
    assert train[0]["reinforce_pp/kl_loss"] >= 0 and math.isfinite(train[0]["reinforce_pp/kl_loss"])
