"""Tests of rloo.py: the leave-one-out baseline and the sequence reward against hand computations, the loss's
gradient against the paper's REINFORCE estimator, a smoke run, and SIGKILL + --resume. The 2-process run equal to
1 process is tests/test_multiprocess.py's (rloo is one of its scripts)."""

import json
import os
import sys

import pytest
import torch

from conftest import ENV, assert_same_safetensors, kill_after_checkpoint, load_script, run_ok, without_timing

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
rloo = load_script("rloo")

PAD, EOS = 19, 3


def test_leave_one_out_baseline_by_hand():
    rewards = torch.tensor([1.0, 3.0, 2.0, 6.0])  # k = 2: two queries, two responses each
    # the baseline of each response is the other response's reward
    assert rloo.rloo_advantages(rewards, 2).tolist() == [1.0 - 3.0, 3.0 - 1.0, 2.0 - 6.0, 6.0 - 2.0]
    rewards = torch.tensor([1.0, 2.0, 6.0, 0.0, 0.0, 3.0])  # k = 3
    expected = [1.0 - (2.0 + 6.0) / 2, 2.0 - (1.0 + 6.0) / 2, 6.0 - (1.0 + 2.0) / 2,
                0.0 - (0.0 + 3.0) / 2, 0.0 - (0.0 + 3.0) / 2, 3.0 - (0.0 + 0.0) / 2]
    assert rloo.rloo_advantages(rewards, 3).tolist() == pytest.approx(expected)
    # equal rewards within a group: nothing to learn from it
    assert rloo.rloo_advantages(torch.tensor([0.5, 0.5, 0.5, 0.5]), 4).tolist() == [0.0] * 4


def test_sequence_reward_and_advantage_by_hand():
    args = rloo.Args()
    args.rloo.kl_coef = 0.1
    # query 1: an EOS at index 1, and a response without EOS (EOS trick: its score becomes -1);
    # query 2: EOS at index 0 and at index 2
    raw = torch.tensor([[5, EOS, 7, 8], [5, 6, 7, 8], [EOS, 4, 4, 4], [6, 6, EOS, 9]])
    responses = rloo.truncate_response(EOS, PAD, raw)
    logprobs = -torch.tensor([[0.5, 0.25, 9.0, 9.0], [0.5, 0.5, 0.5, 0.5], [1.0, 9.0, 9.0, 9.0],
                              [0.25, 0.25, 0.25, 9.0]])
    ref_logprobs = torch.full((4, 4), -1.0)
    # the raw samples (a 2-token query before each raw response) are not read by rewards_and_advantages
    data = rloo.Rollout(query_responses=torch.cat((torch.full((4, 2), 4), raw), 1), responses=responses,
                        logprobs=logprobs, ref_logprobs=ref_logprobs,
                        rm_scores=torch.tensor([[2.0], [3.0], [4.0], [1.0]]))
    out = rloo.rewards_and_advantages(args, args.rloo, data, EOS, PAD, args.rloo.kl_coef, [rloo.RunningMoments()],
                                      lambda x: x)
    # k1 KL summed over the kept tokens only (the 9s after each EOS are masked)
    kl_sums = [(1 - 0.5) + (1 - 0.25), 4 * (1 - 0.5), 1 - 1.0, 3 * (1 - 0.25)]
    scores = [2.0, -1.0, 4.0, 1.0]
    expected_rewards = [s - 0.1 * k for s, k in zip(scores, kl_sums)]
    assert out.scores.tolist() == pytest.approx(scores)
    assert out.rewards.tolist() == pytest.approx(expected_rewards)
    assert out.non_score_reward.sum(1).tolist() == pytest.approx([-0.1 * k for k in kl_sums])
    r = expected_rewards
    assert out.advantages.tolist() == pytest.approx([r[0] - r[1], r[1] - r[0], r[2] - r[3], r[3] - r[2]])


def test_loss_gradient_is_the_papers_reinforce_estimator():
    """On a fresh batch (ratio 1) the clipped surrogate's gradient equals that of REINFORCE on the log-probability
    of each whole response, -mean(A * log p(y|x)): the paper's estimator. After the policy moved past the clip
    range, a response with a positive advantage gets no gradient."""
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 7, requires_grad=True)
    tokens = torch.randint(0, 7, (4, 5))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]]).bool()
    advantages = torch.tensor([0.7, -0.7, 1.5, -1.5])

    def logprobs_of(x):
        return torch.gather(torch.log_softmax(x, -1), 2, tokens.unsqueeze(-1)).squeeze(-1)

    old = logprobs_of(logits).detach()
    loss, stats = rloo.rloo_loss(logprobs_of(logits), old, advantages, mask, 0.2)
    (grad,) = torch.autograd.grad(loss, logits)
    reinforce = -(advantages * (logprobs_of(logits) * mask).sum(1)).mean()
    (expected,) = torch.autograd.grad(reinforce, logits)
    torch.testing.assert_close(grad, expected)
    assert stats["ratio"].item() == 1.0 and stats["pg_clipfrac"].item() == 0.0
    # a policy that raised response 0's probability by a factor e (> 1.2): clipped, so no gradient reaches it
    moved = old.clone()
    moved[0, 0] += 1.0
    loss, stats = rloo.rloo_loss(moved.requires_grad_(), old, advantages, mask, 0.2)
    (grad,) = torch.autograd.grad(loss, moved)
    assert (grad[0] == 0).all() and (grad[1:] != 0).any()
    assert stats["pg_clipfrac"].item() == pytest.approx(0.25)


# ------------------------------------------------------------------------------------------------
# Subprocess runs on the built-in task
# ------------------------------------------------------------------------------------------------
def rloo_command(synthetic_task, tiny_models, root, run_name, total_episodes=16, extra=()):
    """A small run: updates of 8 episodes (4 queries x 2 responses), 2 epochs x 2 minibatches x 2 micro batches."""
    task = json.load(open(synthetic_task["task_json"]))
    return [
        sys.executable, os.path.join(REPO_ROOT, "rloo.py"),
        "--sft_model_path", tiny_models["sft"], "--reward_model_path", tiny_models["rm"],
        "--query_dataset", synthetic_task["sft"], "--response_length", str(task["sft_response_length"]),
        "--total_episodes", str(total_episodes), "--total_batch_size", "8", "--local_micro_batch_size", "2",
        "--local_rollout_forward_batch_size", "8", "--rloo.num_ppo_epochs", "2", "--rloo.num_mini_batches", "2",
        "--num_eval_samples", "8", "--eval_every", "1", "--output_dir", str(root / f"policy_{run_name}"),
        "--run_dir_root", str(root / "runs"), "--run_name", run_name, "--print_sample_every", "0", *extra,
    ]


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_smoke_with_options(synthetic_task, tiny_models, tmp_path):
    extra = ["--rloo_k", "4", "--rloo.kl_estimator", "k3", "--rloo.adaptive_kl", "--rloo.ptx_coef", "0.1"]
    run_ok(rloo_command(synthetic_task, tiny_models, tmp_path, "smoke", extra=extra), cwd=REPO_ROOT, env=ENV)
    run_dir = tmp_path / "runs" / "smoke"
    summary = json.load(open(run_dir / "summary.json"))
    for key in ("eval/score", "eval/eos_rate", "objective/kl", "episodes_per_second", "wall_time_s"):
        assert key in summary
    train = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if "rloo/val/ratio" in line]
    assert len(train) == 2
    assert all(0 < m["time/update_s"] < summary["wall_time_s"] for m in train)  # each update's (issue 51)
    # the budget it claims (--total_episodes 16: sampled responses) is what it sampled: 2 prompts x 4 an update
    assert [m["budget/responses_sampled"] for m in train] == [8, 16] and summary["budget/responses_sampled"] == 16
    assert summary["budget/prompts"] == 4 and summary["budget/updates"] == 2
    for key in ("objective/kl", "objective/scores", "objective/rlhf_reward", "rloo/policy/approxkl_avg",
                "rloo/policy/clipfrac_avg", "rloo/loss/policy_avg", "rloo/loss/ptx_avg", "train/lr", "episode"):
        assert key in train[0], key
    assert train[1]["objective/kl_coef"] != train[0]["objective/kl_coef"]  # the adaptive controller moved
    assert train[0]["rloo/loss/ptx_avg"] > 0
    assert (tmp_path / "policy_smoke" / "model.safetensors").exists()


@pytest.mark.slow
def test_sigkill_then_resume_matches_an_uninterrupted_run(synthetic_task, tiny_models, tmp_path):
    """5 updates, a checkpoint every 2; killed during update 3 and resumed, the run ends like one never interrupted."""
    extra = ["--checkpoint_every", "2", "--rloo.adaptive_kl", "--rloo.ptx_coef", "0.1", "--eval_every", "3"]
    run_ok(rloo_command(synthetic_task, tiny_models, tmp_path, "full", 40, extra), cwd=REPO_ROOT, env=ENV)
    killed = rloo_command(synthetic_task, tiny_models, tmp_path, "killed", 40, extra)
    kill_after_checkpoint(killed, tmp_path / "runs" / "killed" / "checkpoints" / "update_000002", cwd=REPO_ROOT,
                          env=ENV)
    resumed = run_ok(killed + ["--resume"], cwd=REPO_ROOT, env=ENV)
    assert "resumed from" in resumed.stdout and "update_000002" in resumed.stdout, resumed.stdout[-2000:]
    assert_same_safetensors(tmp_path / "policy_full" / "model.safetensors",
                            tmp_path / "policy_killed" / "model.safetensors")
    rows = [[without_timing(json.loads(line)) for line in open(tmp_path / "runs" / name / "metrics.jsonl")]
            for name in ("full", "killed")]
    assert len(rows[0]) == 5 + 1 + 1 and rows[0] == rows[1]
