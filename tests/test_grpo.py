"""Tests of grpo.py: the group-relative advantages (group std, batch std gathered across processes, none) and the
reward against hand computations, the loss's gradient at ratio 1 against the hand formula of each normaliser, the
clip (DAPO's higher upper clip included), the KL in the loss and not in the reward, a smoke run with the options,
SIGKILL + --resume, and the two gathers across 2 processes (the batch std, DAPO's token count). The whole 2-process
run equal to 1 process (torchrun, ZeRO-2, ZeRO-3, bf16) is tests/test_multiprocess.py's (grpo is one of its scripts)."""

import dataclasses
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
grpo = load_script("grpo")

PAD, EOS = 19, 3


def test_group_relative_advantages_by_hand():
    rewards = torch.tensor([1.0, 3.0, 2.0, 6.0, 0.5, 0.5, 0.5, 0.5])  # G = 4: two queries, four responses each
    first, second = [1.0, 3.0, 2.0, 6.0], [0.5] * 4
    mean, std = statistics.mean(first), statistics.stdev(first)  # the unbiased (n - 1) standard deviation
    group = grpo.grpo_advantages(rewards, 4, "group", gather=None)
    assert group.tolist() == pytest.approx([(r - mean) / (std + 1e-4) for r in first] + [0.0] * 4)
    # one std for the whole batch
    batch_std = statistics.stdev(first + second)
    batch = grpo.grpo_advantages(rewards, 4, "batch", gather=lambda x: x)
    assert batch.tolist() == pytest.approx([(r - mean) / (batch_std + 1e-4) for r in first] + [0.0] * 4)
    # Dr. GRPO: no std at all
    assert grpo.grpo_advantages(rewards, 4, "none", gather=None).tolist() == pytest.approx(
        [r - mean for r in first] + [0.0] * 4)
    # G = 2
    assert grpo.grpo_advantages(torch.tensor([1.0, 3.0]), 2, "none", gather=None).tolist() == [-1.0, 1.0]


def test_batch_std_is_that_of_every_process():
    """With several processes each holds whole groups; the batch std is taken over the rewards gathered from all."""
    mine, other = torch.tensor([1.0, 3.0]), torch.tensor([10.0, 14.0])
    advantages = grpo.grpo_advantages(mine, 2, "batch", gather=lambda x: torch.cat([x, other]))
    std = statistics.stdev([1.0, 3.0, 10.0, 14.0])
    assert advantages.tolist() == pytest.approx([-1.0 / (std + 1e-4), 1.0 / (std + 1e-4)])


def test_reward_is_the_score_and_the_kl_stays_out_of_it():
    """Steps 5-7 by hand: the EOS trick, no KL in the reward, whatever kl_coef and the reference say."""
    args = grpo.Args(group_size=2)
    # query 1: an EOS at index 1, and a response without EOS (EOS trick: its score becomes -1);
    # query 2: EOS at index 0 and at index 2
    raw = torch.tensor([[5, EOS, 7, 8], [5, 6, 7, 8], [EOS, 4, 4, 4], [6, 6, EOS, 9]])
    responses = grpo.truncate_response(EOS, PAD, raw)
    logprobs = -torch.tensor([[0.5, 0.25, 9.0, 9.0], [0.5, 0.5, 0.5, 0.5], [1.0, 9.0, 9.0, 9.0],
                              [0.25, 0.25, 0.25, 9.0]])
    # the raw samples (a 2-token query before each raw response) are not read by rewards_and_advantages
    data = grpo.Rollout(query_responses=torch.cat((torch.full((4, 2), 4), raw), 1), responses=responses,
                        logprobs=logprobs, ref_logprobs=torch.full((4, 4), -1.0),
                        rm_scores=torch.tensor([[2.0], [3.0], [4.0], [1.0]]))
    out = grpo.rewards_and_advantages(args, args.grpo, data, EOS, PAD, [grpo.RunningMoments()], lambda x: x)
    scores = [2.0, -1.0, 4.0, 1.0]
    assert out.scores.tolist() == pytest.approx(scores)
    std = statistics.stdev([2.0, -1.0])  # both groups: two rewards 3 apart
    assert out.advantages.tolist() == pytest.approx([1.5 / (std + 1e-4), -1.5 / (std + 1e-4)] * 2)
    assert out.mask.sum(1).tolist() == [2, 4, 1, 3]
    # the logged KL is the rollout's k1 over the kept tokens; the reward holds none of it
    assert out.kl.sum(1).tolist() == pytest.approx([(1 - 0.5) + (1 - 0.25), 4 * (1 - 0.5), 0.0, 3 * (1 - 0.25)])
    assert out.objective() == {}  # nothing of GRPO's own beside the score: no KL penalty in the reward to log
    # another reference, another kl_coef: the same scores and advantages
    args.grpo.kl_coef = 10.0
    data = dataclasses.replace(data, ref_logprobs=torch.full((4, 4), -5.0))
    again = grpo.rewards_and_advantages(args, args.grpo, data, EOS, PAD, [grpo.RunningMoments()], lambda x: x)
    assert torch.equal(again.scores, out.scores) and torch.equal(again.advantages, out.advantages)


def test_minibatch_tokens_by_hand():
    """DAPO's normaliser on one process: the kept tokens of each minibatch (rows in the update's order) per micro
    batch."""
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]]).bool()
    assert grpo.minibatch_tokens(mask, 2, 1, lambda x, how: x).tolist() == [3.0, 6.0]
    assert grpo.minibatch_tokens(mask, 1, 2, lambda x, how: x).tolist() == [4.5]


MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]]).bool()
ADVANTAGES = torch.tensor([0.7, -0.7, 1.5, -1.5])


def policy_and_reference(seed: int = 0):
    torch.manual_seed(seed)
    logits = torch.randn(4, 5, 7, requires_grad=True)
    tokens = torch.randint(0, 7, (4, 5))

    def logprobs_of(x):
        return torch.gather(torch.log_softmax(x, -1), 2, tokens.unsqueeze(-1)).squeeze(-1)

    ref = logprobs_of(torch.randn(4, 5, 7))  # another policy: the KL term has a gradient
    return logits, logprobs_of, ref


@pytest.mark.parametrize("normalizer", ["response_mean", "constant", "batch_token_mean"])
def test_loss_gradient_at_ratio_one_is_the_hand_formula(normalizer):
    """On a fresh batch (ratio 1) the gradient of the loss is that of sum_{i,t} w_it (-A_i + beta (1 - p_ref / p))
    log p_it, with w_it = 1 / (B |o_i|) (GRPO), 1 / (B T) (Dr. GRPO) or 1 / (the batch's tokens) (DAPO): the policy
    gradient of GRPO's objective plus that of beta times the k3 KL, r - 1 - log r with r = p_ref / p."""
    logits, logprobs_of, ref = policy_and_reference()
    old = logprobs_of(logits).detach()
    lengths, beta = MASK.sum(1, keepdim=True).float(), 0.04
    hand_weights = {"response_mean": MASK / lengths / 4, "constant": MASK / (5 * 4.0),
                    "batch_token_mean": MASK / MASK.sum().float()}[normalizer]
    weights = grpo.token_weights(MASK, normalizer, 5, MASK.sum().float())  # one micro batch, one process
    torch.testing.assert_close(weights, hand_weights.float())
    loss, stats = grpo.grpo_loss(logprobs_of(logits), old, ref, ADVANTAGES, weights, 0.2, 0.2, beta)
    (grad,) = torch.autograd.grad(loss, logits)
    coefficient = -ADVANTAGES.unsqueeze(1) + beta * (1 - (ref - old).exp())
    hand = (hand_weights * coefficient * logprobs_of(logits)).sum()
    (expected,) = torch.autograd.grad(hand, logits)
    torch.testing.assert_close(grad, expected)
    assert stats["ratio"].item() == pytest.approx(1.0) and stats["pg_clipfrac"].item() == 0.0
    # the k3 KL of the loss: r - 1 - log r per token, r = p_ref / p, averaged as the loss averages
    k3 = (ref - old).exp() - 1 - (ref - old)
    assert stats["kl"].item() == pytest.approx(((k3 * hand_weights).sum() / hand_weights.sum()).item(), rel=1e-5)


def test_the_clip_and_dapos_higher_upper_clip():
    """After the policy moved (a reused batch, num_ppo_epochs > 1): a token whose ratio left the clip range on the
    side its advantage pushes gets no policy gradient. A ratio of 1.25 is clipped at 1.2 but not under DAPO's 1.28;
    the lower clip stays at 0.8 for tokens of negative advantage."""
    logits, logprobs_of, ref = policy_and_reference()
    old = logprobs_of(logits).detach()
    weights = grpo.token_weights(MASK, "response_mean", 5, None)
    moved = old.clone()
    moved[0, 0] += 0.223  # ratio 1.25 on a token of positive advantage
    moved[1, 0] -= 0.3  # ratio 0.74 on a token of negative advantage
    for clip_high, upper_clipped in ((0.2, True), (0.28, False)):
        new = moved.clone().requires_grad_()
        loss, stats = grpo.grpo_loss(new, old, ref, ADVANTAGES, weights, 0.2, clip_high, 0.0)
        (grad,) = torch.autograd.grad(loss, new)
        assert (grad[0, 0] == 0) == upper_clipped and grad[0, 1] != 0
        assert grad[1, 0] == 0 and grad[1, 1] != 0
        assert stats["pg_clipfrac"].item() > 0
    # the k3 KL term keeps its gradient where the clip cuts the policy term
    new = moved.clone().requires_grad_()
    loss, _ = grpo.grpo_loss(new, old, ref, ADVANTAGES, weights, 0.2, 0.2, 0.04)
    (grad,) = torch.autograd.grad(loss, new)
    assert grad[1, 0] != 0


def test_kl_coef_changes_the_loss_not_the_reward():
    logits, logprobs_of, ref = policy_and_reference()
    old = logprobs_of(logits).detach()
    weights = grpo.token_weights(MASK, "response_mean", 5, None)
    losses = [grpo.grpo_loss(old, old, ref, ADVANTAGES, weights, 0.2, 0.2, beta)[0].item() for beta in (0.0, 0.04, 0.4)]
    k3 = ((ref - old).exp() - 1 - (ref - old)) * weights
    assert losses[1] - losses[0] == pytest.approx(0.04 * k3.sum().item(), rel=1e-4)
    assert losses[2] - losses[0] == pytest.approx(0.4 * k3.sum().item(), rel=1e-4)


def test_groups_are_never_split(tmp_path):
    """Each process holds whole groups: a group size that does not divide the local batch is refused before any
    model loads."""
    args = grpo.Args(group_size=3, total_batch_size=8, local_micro_batch_size=2, total_episodes=16,
                     run=RunFlags(run_dir_root=str(tmp_path)), sft_model_path=str(tmp_path / "none"))
    with pytest.raises(ValueError, match="--group_size 3 must be at least 2 and divide the local batch 8"):
        grpo.main(args)


# ------------------------------------------------------------------------------------------------
# Subprocess runs on the built-in task
# ------------------------------------------------------------------------------------------------
def grpo_command(synthetic_task, tiny_models, root, run_name, total_episodes=16, extra=()):
    """A small run: updates of 8 episodes (2 queries x 4 responses), 2 epochs x 2 minibatches x 2 micro batches."""
    task = json.load(open(synthetic_task["task_json"]))
    return [
        sys.executable, os.path.join(REPO_ROOT, "grpo.py"),
        "--sft_model_path", tiny_models["sft"], "--reward_model_path", tiny_models["rm"],
        "--query_dataset", synthetic_task["sft"], "--response_length", str(task["sft_response_length"]),
        "--total_episodes", str(total_episodes), "--total_batch_size", "8", "--local_micro_batch_size", "2",
        "--local_rollout_forward_batch_size", "8", "--grpo.num_ppo_epochs", "2", "--grpo.num_mini_batches", "2",
        "--num_eval_samples", "8", "--eval_every", "1", "--output_dir", str(root / f"policy_{run_name}"),
        "--run_dir_root", str(root / "runs"), "--run_name", run_name, "--print_sample_every", "0", *extra,
    ]


@pytest.mark.slow
def test_smoke_with_options(synthetic_task, tiny_models, tmp_path):
    extra = ["--grpo.advantage_std", "none", "--grpo.loss_normalizer", "constant", "--grpo.clip_high", "0.28",
             "--grpo.adaptive_kl", "--grpo.ptx_coef", "0.1", "--lr", "1e-3"]
    run_ok(grpo_command(synthetic_task, tiny_models, tmp_path, "smoke", extra=extra), cwd=REPO_ROOT, env=ENV)
    run_dir = tmp_path / "runs" / "smoke"
    summary = json.load(open(run_dir / "summary.json"))
    for key in ("eval/score", "eval/eos_rate", "objective/kl", "episodes_per_second", "wall_time_s"):
        assert key in summary
    train = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if "grpo/val/ratio" in line]
    assert len(train) == 2
    assert all(0 < m["time/update_s"] < summary["wall_time_s"] for m in train)  # each update's (issue 51)
    # the budget it claims (--total_episodes 16: sampled responses) is what it sampled: 2 prompts x 4 an update
    assert [m["budget/responses_sampled"] for m in train] == [8, 16] and summary["budget/responses_sampled"] == 16
    assert summary["budget/prompts"] == 4 and summary["budget/updates"] == 2
    for key in ("objective/kl", "objective/scores", "grpo/policy/approxkl_avg",
                "grpo/policy/clipfrac_avg", "grpo/loss/policy_avg", "grpo/loss/ptx_avg", "grpo/kl", "train/lr",
                "episode"):
        assert key in train[0], key
    for row in train:  # the reward holds no KL: no always-zero penalty is logged, the score is the reward
        assert "objective/non_score_reward" not in row and "objective/rlhf_reward" not in row
    assert train[1]["objective/kl_coef"] != train[0]["objective/kl_coef"]  # the adaptive controller moved
    assert train[0]["grpo/loss/ptx_avg"] > 0 and train[1]["grpo/kl"] > 0  # the policy left the reference
    assert (tmp_path / "policy_smoke" / "model.safetensors").exists()


@pytest.mark.slow
def test_sigkill_then_resume_matches_an_uninterrupted_run(synthetic_task, tiny_models, tmp_path):
    """5 updates, a checkpoint every 2; killed during update 3 and resumed, the run ends like one never interrupted.
    With DAPO's dynamic sampling the data position is the prompt batches drawn so far, which the resumed run takes from
    the checkpoint's budget (GSPO's ratio and DAPO's overlong shaping on too)."""
    extra = ["--checkpoint_every", "2", "--grpo.adaptive_kl", "--grpo.ptx_coef", "0.1", "--grpo.scale_rewards",
             "--grpo.loss_normalizer", "batch_token_mean", "--eval_every", "3", "--grpo.max_draws_per_update", "2",
             "--grpo.ratio_level", "sequence", "--grpo.overlong_buffer", "8"]
    run_ok(grpo_command(synthetic_task, tiny_models, tmp_path, "full", 40, extra), cwd=REPO_ROOT, env=ENV)
    killed = grpo_command(synthetic_task, tiny_models, tmp_path, "killed", 40, extra)
    kill_after_checkpoint(killed, tmp_path / "runs" / "killed" / "checkpoints" / "update_000002", cwd=REPO_ROOT,
                          env=ENV)
    resumed = run_ok(killed + ["--resume"], cwd=REPO_ROOT, env=ENV)
    assert "resumed from" in resumed.stdout and "update_000002" in resumed.stdout, resumed.stdout[-2000:]
    assert_same_safetensors(tmp_path / "policy_full" / "model.safetensors",
                            tmp_path / "policy_killed" / "model.safetensors")
    rows = [[without_timing(json.loads(line)) for line in open(tmp_path / "runs" / name / "metrics.jsonl")]
            for name in ("full", "killed")]
    assert len(rows[0]) == 5 + 1 + 1 and rows[0] == rows[1]
    # some update drew more than its one batch of 2 prompts, and the budget counts them all (G = 4 responses each)
    budgets = [(row["budget/prompts"], row["budget/responses_sampled"]) for row in rows[0] if "budget/prompts" in row]
    assert budgets[-1][0] > 5 * 2 and all(responses == 4 * prompts for prompts, responses in budgets)


# ------------------------------------------------------------------------------------------------
# The gathers across 2 processes (torchrun over gloo, as tests/test_multiprocess.py launches it)
# ------------------------------------------------------------------------------------------------
GATHER_PROBE = """
import sys, torch
from accelerate import Accelerator
sys.path.insert(0, {tests!r})
from conftest import load_script
grpo = load_script("grpo")
accelerator = Accelerator(cpu=True)
rank = slice(accelerator.process_index * 4, (accelerator.process_index + 1) * 4)  # 2 whole groups of 2 each
advantages = grpo.grpo_advantages(torch.tensor({rewards!r})[rank], 2, "batch", accelerator.gather)
tokens = grpo.minibatch_tokens(torch.tensor({mask!r})[rank], 2, 1, accelerator.reduce)  # 2 minibatches of 2 rows
gathered = accelerator.gather(advantages)
if accelerator.is_main_process:
    torch.save((gathered, tokens), {out!r})
# a process group left alive at exit can abort a rank in C++ teardown ("terminate called without an active
# exception"); destroyed first, as run_infra's exit handler does for every script, it does not (docs/results.md)
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
def test_gathers_across_two_processes(tmp_path):
    """Each of 2 processes holds 2 whole groups of 2: the batch std is that of all 8 rewards, and DAPO's token count
    of a minibatch that of both processes' rows, per micro batch of one: what 1 process computes on the whole batch."""
    rewards = [1.0, 3.0, 2.0, 6.0, 10.0, 14.0, 0.0, 0.5]
    mask = [[1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]]
    script = tmp_path / "gather_probe.py"
    script.write_text(GATHER_PROBE.format(tests=os.path.join(REPO_ROOT, "tests"), rewards=rewards, mask=mask,
                                          out=str(tmp_path / "gathered.pt")))
    run_two_processes(str(script))
    advantages, tokens = torch.load(tmp_path / "gathered.pt")
    torch.testing.assert_close(advantages, grpo.grpo_advantages(torch.tensor(rewards), 2, "batch", gather=lambda x: x))
    # 1 process: minibatch 1 = rows 0, 1, 4, 5 (rank 0's first 2 and rank 1's first 2), in 2 micro batches of 2
    one = grpo.minibatch_tokens(torch.tensor(mask)[[0, 1, 4, 5, 2, 3, 6, 7]], 2, 2, lambda x, how: x)
    assert tokens.tolist() == one.tolist() == [(1 + 2 + 3 + 3) / 2, (3 + 1 + 2 + 3) / 2]
