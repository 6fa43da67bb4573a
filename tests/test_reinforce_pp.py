"""Tests of reinforce_pp.py: the per-token rewards (KL penalty, score at the EOS), the discounted returns (gamma 1 and
0.5) and their whitening over the batch by hand, REINFORCE++-baseline's group mean by hand and its refusal of groups of
one, the loss's gradient at ratio 1 against the hand formula and its per-token clip, the whitening gathered across 2
processes equal to 1 process, and SIGKILL + --resume of a run with the options. The whole 2-process run equal to 1
process (torchrun, ZeRO-2, ZeRO-3, bf16) is tests/test_multiprocess.py's (reinforce_pp is one of its scripts)."""

import json
import os
import statistics
import sys

import pytest
import torch

from conftest import (
    ENV,
    assert_same_safetensors,
    kill_after_checkpoint,
    load_script,
    run_ok,
    run_two_processes,
    without_timing,
)
from rlhf_utils.flags import RunFlags

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
reinforce_pp = load_script("reinforce_pp")

PAD, EOS = 19, 3
# query 1: an EOS at index 1, and a response without EOS (EOS trick: its score becomes -1); query 2: EOS at index 0
# and at index 2. Kept tokens: 2, 4, 1 and 3
RAW = torch.tensor([[5, EOS, 7, 8], [5, 6, 7, 8], [EOS, 4, 4, 4], [6, 6, EOS, 9]])
LOGPROBS = -torch.tensor([[0.5, 0.25, 9.0, 9.0], [0.5, 0.5, 0.5, 0.5], [1.0, 9.0, 9.0, 9.0], [0.25, 0.25, 0.25, 9.0]])
SCORES = [[2.0], [3.0], [4.0], [1.0]]


def rollout(rows=slice(None)):
    """The batch above (or some of its rows) as a rollout. The reference's log-probability is -1 on every token, so
    the k1 KL of a kept token is its log-probability + 1: 0.5 and 0.75; 0.5 four times; 0; 0.75 three times."""
    # the raw samples (a 2-token query before each raw response) are not read by rewards_and_advantages
    return reinforce_pp.Rollout(query_responses=torch.cat((torch.full((4, 2), 4), RAW), 1)[rows],
                                responses=reinforce_pp.truncate_response(EOS, PAD, RAW)[rows], logprobs=LOGPROBS[rows],
                                ref_logprobs=torch.full((4, 4), -1.0)[rows], rm_scores=torch.tensor(SCORES)[rows])


def whitened(returns: list) -> list:
    """Each kept token's return less the mean of all of them, over their population std (masked_whiten: + 1e-8)."""
    flat = [r for row in returns for r in row]
    mean, var = statistics.fmean(flat), statistics.pvariance(flat)
    return [[(r - mean) / (var + 1e-8) ** 0.5 for r in row] for row in returns]


def kept(tensor: torch.Tensor, lengths=(2, 4, 1, 3)) -> list:
    return [tensor[i, :n].tolist() for i, n in enumerate(lengths)]


def test_returns_and_advantages_by_hand():
    args = reinforce_pp.Args()
    args.reinforce_pp.kl_coef = 0.1
    out = reinforce_pp.rewards_and_advantages(args, args.reinforce_pp, rollout(), EOS, PAD, args.reinforce_pp.kl_coef,
                                              [reinforce_pp.RunningMoments()], lambda x: x)
    assert out.scores.tolist() == pytest.approx([2.0, -1.0, 4.0, 1.0])
    # per token: -0.1 x the k1 KL (log p + 1), and the score at the EOS (the last token of the response without one)
    rewards = [[-0.05, -0.075 + 2.0], [-0.05, -0.05, -0.05, -0.05 - 1.0], [0.0 + 4.0], [-0.075, -0.075, -0.075 + 1.0]]
    for got, expected in zip(kept(out.rewards), rewards):
        assert got == pytest.approx(expected)
    assert out.rewards.sum().item() == pytest.approx(sum(map(sum, rewards)))  # nothing after the EOS
    # gamma 1: each token's return is the sum of its own reward and those after it
    returns = [[1.875, 1.925], [-1.2, -1.15, -1.1, -1.05], [4.0], [0.775, 0.85, 0.925]]
    for got, expected in zip(kept(out.returns), returns):
        assert got == pytest.approx(expected)
    # the advantages: the 10 kept returns whitened together, 0 after each EOS
    for got, expected in zip(kept(out.advantages), whitened(returns)):
        assert got == pytest.approx(expected, abs=1e-6)
    assert (out.advantages[~out.mask] == 0).all() and out.mask.sum(1).tolist() == [2, 4, 1, 3]

    # gamma 0.5: r_t + 0.5 r_{t+1} + 0.25 r_{t+2} + ...
    args.reinforce_pp.gamma = 0.5
    out = reinforce_pp.rewards_and_advantages(args, args.reinforce_pp, rollout(), EOS, PAD, 0.1,
                                              [reinforce_pp.RunningMoments()], lambda x: x)
    returns = [[-0.05 + 0.5 * 1.925, 1.925], [-0.21875, -0.3375, -0.575, -1.05], [4.0],
               [-0.075 + 0.5 * -0.075 + 0.25 * 0.925, -0.075 + 0.5 * 0.925, 0.925]]
    for got, expected in zip(kept(out.returns), returns):
        assert got == pytest.approx(expected)
    for got, expected in zip(kept(out.advantages), whitened(returns)):
        assert got == pytest.approx(expected, abs=1e-6)


def test_the_baseline_variant_subtracts_the_group_mean_then_whitens():
    """REINFORCE++-baseline with 2 responses per query: scores 2 and -1 (mean 0.5), 4 and 1 (mean 2.5) become 1.5 and
    -1.5 before the KL penalty and the returns; the logged scores stay the scores."""
    args = reinforce_pp.Args(samples_per_prompt=2)
    args.reinforce_pp.kl_coef, args.reinforce_pp.baseline = 0.1, "group"
    out = reinforce_pp.rewards_and_advantages(args, args.reinforce_pp, rollout(), EOS, PAD, 0.1,
                                              [reinforce_pp.RunningMoments()], lambda x: x)
    assert out.scores.tolist() == pytest.approx([2.0, -1.0, 4.0, 1.0])
    rewards = [[-0.05, -0.075 + 1.5], [-0.05, -0.05, -0.05, -0.05 - 1.5], [1.5], [-0.075, -0.075, -0.075 - 1.5]]
    for got, expected in zip(kept(out.rewards), rewards):
        assert got == pytest.approx(expected)
    returns = [[1.375, 1.425], [-1.7, -1.65, -1.6, -1.55], [1.5], [-1.725, -1.65, -1.575]]
    for got, expected in zip(kept(out.returns), returns):
        assert got == pytest.approx(expected)
    for got, expected in zip(kept(out.advantages), whitened(returns)):
        assert got == pytest.approx(expected, abs=1e-6)


def test_the_baseline_needs_groups_of_two_or_more(tmp_path):
    """Refused before any model loads (the model paths do not exist): a group of one has its own score as its mean."""
    common = dict(total_batch_size=8, local_micro_batch_size=2, total_episodes=16,
                  run=RunFlags(run_dir_root=str(tmp_path)), sft_model_path=str(tmp_path / "none"))
    args = reinforce_pp.Args(**common)
    args.reinforce_pp.baseline = "group"
    with pytest.raises(ValueError, match=r"--reinforce_pp.baseline group \(REINFORCE\+\+-baseline\) subtracts .* needs "
                                         r"2 or more \(got 1,.* pass --samples_per_prompt 2 or more"):
        reinforce_pp.main(args)
    with pytest.raises(ValueError, match="--samples_per_prompt 3 must divide the local batch 8"):
        reinforce_pp.main(reinforce_pp.Args(samples_per_prompt=3, **common))


MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]]).bool()


def policy():
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 7, requires_grad=True)
    tokens = torch.randint(0, 7, (4, 5))
    advantages = torch.randn(4, 5) * MASK  # one advantage per token

    def logprobs_of(x):
        return torch.gather(torch.log_softmax(x, -1), 2, tokens.unsqueeze(-1)).squeeze(-1)

    return logits, logprobs_of, advantages


def test_loss_gradient_at_ratio_one_is_the_hand_formula():
    """The update's loss (clipped_policy_loss on each token's ratio and advantage) on a fresh batch, where every ratio
    is 1: its gradient is that of -sum_{i,t} A_it log p_it / N over the N kept tokens of the micro batch."""
    logits, logprobs_of, advantages = policy()
    old = logprobs_of(logits).detach()
    loss, stats = reinforce_pp.clipped_policy_loss(logprobs_of(logits) - old, advantages, MASK, 0.2)
    (grad,) = torch.autograd.grad(loss, logits)
    hand = -(advantages * logprobs_of(logits) * MASK).sum() / 13  # 3 + 5 + 1 + 4 kept tokens
    (expected,) = torch.autograd.grad(hand, logits)
    torch.testing.assert_close(grad, expected)
    assert stats["ratio"].item() == pytest.approx(1.0) and stats["pg_clipfrac"].item() == 0.0


def test_the_clip_acts_per_token():
    """After the policy moved (a reused batch): a token whose ratio left [0.8, 1.2] on the side its advantage pushes
    gets no gradient, and the other tokens of its response keep theirs (rloo.py's ratio of a whole response would cut
    them all)."""
    logits, logprobs_of, advantages = policy()
    old = logprobs_of(logits).detach()
    advantages[1] = torch.tensor([1.0, 1.0, -1.0, 1.0, 1.0])
    moved = old.clone()
    moved[1, 0] += 0.3  # ratio 1.35 on a token of positive advantage: clipped
    moved[1, 2] += 0.3  # ratio 1.35 on a token of negative advantage: not clipped (the loss keeps the larger term)
    moved = moved.requires_grad_()
    loss, stats = reinforce_pp.clipped_policy_loss(moved - old, advantages, MASK, 0.2)
    (grad,) = torch.autograd.grad(loss, moved)
    assert (grad[1, 0] == 0 and grad[1, 1] == pytest.approx(-1.0 / 13)
            and grad[1, 2] == pytest.approx(1.35 / 13, rel=1e-3))
    assert stats["pg_clipfrac"].item() == pytest.approx(1 / 13)


# ------------------------------------------------------------------------------------------------
# The whitening across 2 processes (torchrun over gloo, as tests/test_multiprocess.py launches it)
# ------------------------------------------------------------------------------------------------
WHITEN_PROBE = """
import sys, torch
from accelerate import Accelerator
sys.path.insert(0, {tests!r})
import test_reinforce_pp as t
accelerator = Accelerator(cpu=True)
args = t.reinforce_pp.Args(samples_per_prompt=2)
args.reinforce_pp.baseline = "group"
rows = slice(2 * accelerator.process_index, 2 * accelerator.process_index + 2)  # one whole group of 2 each
out = t.reinforce_pp.rewards_and_advantages(args, args.reinforce_pp, t.rollout(rows), t.EOS, t.PAD, 0.1,
                                            [t.reinforce_pp.RunningMoments()], accelerator.gather)
gathered = accelerator.gather(out.advantages)
if accelerator.is_main_process:
    torch.save(gathered, {out!r})
torch.distributed.destroy_process_group()  # before exit, as run_infra's exit handler does (docs/results.md)
"""


@pytest.mark.slow
def test_whitening_over_two_processes_is_that_of_one(tmp_path):
    """Each of 2 processes holds one group of 2 responses: the advantages are whitened with the mean and variance of
    both processes' kept tokens, so they are the advantages one process computes on the whole batch."""
    script = tmp_path / "whiten_probe.py"
    script.write_text(WHITEN_PROBE.format(tests=os.path.join(REPO_ROOT, "tests"), out=str(tmp_path / "gathered.pt")))
    run_two_processes(str(script))
    args = reinforce_pp.Args(samples_per_prompt=2)
    args.reinforce_pp.baseline = "group"
    one = reinforce_pp.rewards_and_advantages(args, args.reinforce_pp, rollout(), EOS, PAD, 0.1,
                                              [reinforce_pp.RunningMoments()], lambda x: x)
    torch.testing.assert_close(torch.load(tmp_path / "gathered.pt"), one.advantages)
    # and each process alone would have whitened otherwise
    alone = reinforce_pp.rewards_and_advantages(args, args.reinforce_pp, rollout(slice(0, 2)), EOS, PAD, 0.1,
                                                [reinforce_pp.RunningMoments()], lambda x: x)
    assert not torch.allclose(alone.advantages, one.advantages[:2], atol=1e-3)


# ------------------------------------------------------------------------------------------------
# Subprocess runs on the built-in task
# ------------------------------------------------------------------------------------------------
def reinforce_pp_command(synthetic_task, tiny_models, root, run_name, total_episodes=16, extra=()):
    """A small run: updates of 8 episodes, 2 epochs x 2 minibatches x 2 micro batches."""
    task = json.load(open(synthetic_task["task_json"]))
    return [
        sys.executable, os.path.join(REPO_ROOT, "reinforce_pp.py"),
        "--sft_model_path", tiny_models["sft"], "--reward_model_path", tiny_models["rm"],
        "--query_dataset", synthetic_task["sft"], "--response_length", str(task["sft_response_length"]),
        "--total_episodes", str(total_episodes), "--total_batch_size", "8", "--local_micro_batch_size", "2",
        "--local_rollout_forward_batch_size", "8", "--reinforce_pp.num_ppo_epochs", "2",
        "--reinforce_pp.num_mini_batches", "2", "--num_eval_samples", "8", "--eval_every", "1",
        "--output_dir", str(root / f"policy_{run_name}"), "--run_dir_root", str(root / "runs"), "--run_name", run_name,
        "--print_sample_every", "0", *extra,
    ]


@pytest.mark.slow
def test_sigkill_then_resume_matches_an_uninterrupted_run(synthetic_task, tiny_models, tmp_path):
    """3 updates of REINFORCE++-baseline with the options, a checkpoint every 2; killed during update 3 and resumed,
    the run ends like one never interrupted. The uninterrupted run also shows what a run logs and counts."""
    extra = ["--checkpoint_every", "2", "--samples_per_prompt", "4", "--reinforce_pp.baseline", "group",
             "--reinforce_pp.gamma", "0.9", "--reinforce_pp.kl_estimator", "k3", "--reinforce_pp.adaptive_kl",
             "--reinforce_pp.ptx_coef", "0.1", "--eval_every", "2"]
    run_ok(reinforce_pp_command(synthetic_task, tiny_models, tmp_path, "full", 24, extra), cwd=REPO_ROOT, env=ENV)
    killed = reinforce_pp_command(synthetic_task, tiny_models, tmp_path, "killed", 24, extra)
    kill_after_checkpoint(killed, tmp_path / "runs" / "killed" / "checkpoints" / "update_000002", cwd=REPO_ROOT,
                          env=ENV)
    resumed = run_ok(killed + ["--resume"], cwd=REPO_ROOT, env=ENV)
    assert "resumed from" in resumed.stdout and "update_000002" in resumed.stdout, resumed.stdout[-2000:]
    assert_same_safetensors(tmp_path / "policy_full" / "model.safetensors",
                            tmp_path / "policy_killed" / "model.safetensors")
    rows = [[without_timing(json.loads(line)) for line in open(tmp_path / "runs" / name / "metrics.jsonl")]
            for name in ("full", "killed")]
    assert len(rows[0]) == 3 + 1 + 1 and rows[0] == rows[1]  # the updates, the evaluations after updates 2 and 3

    train = [row for row in rows[0] if "reinforce_pp/val/ratio" in row]
    # the budget it claims (--total_episodes 24: sampled responses) is what it sampled: 2 prompts x 4 an update
    assert [m["budget/responses_sampled"] for m in train] == [8, 16, 24]
    assert [m["budget/prompts"] for m in train] == [2, 4, 6]
    for key in ("objective/kl", "objective/scores", "objective/rlhf_reward", "reinforce_pp/policy/approxkl_avg",
                "reinforce_pp/policy/clipfrac_avg", "reinforce_pp/loss/policy_avg", "reinforce_pp/loss/ptx_avg"):
        assert key in train[0], key
    assert train[1]["objective/kl_coef"] != train[0]["objective/kl_coef"]  # the adaptive controller moved
    assert train[0]["reinforce_pp/loss/ptx_avg"] > 0 and train[1]["reinforce_pp/policy/approxkl_avg"] > 0
