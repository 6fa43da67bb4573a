"""Several reward models in ppo.py and rloo.py (--reward_model_path A B ..., --reward_combine): the combination
rules by hand, each model's own running statistics for --*.scale_rewards, the single model unchanged, the flag
checks, and a run with two reward models that resumes after a kill like an uninterrupted run."""

import dataclasses
import json
import os
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from conftest import ENV, assert_same_safetensors, kill_after_checkpoint, load_script, run_ok, without_timing
from rlhf_utils.flags import check_flags

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ppo, rloo = load_script("ppo"), load_script("rloo")
PAD, EOS = 19, 3
SCRIPTS = {"ppo": ppo, "rloo": rloo}
# check_flags reads the number of processes and (check_qlora_flags) the DeepSpeed plugin: one process, no DeepSpeed
ONE_PROCESS = SimpleNamespace(num_processes=1, state=SimpleNamespace(deepspeed_plugin=None))


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_combination_rules_by_hand(name):
    module = SCRIPTS[name]
    scores = torch.tensor([[1.0, 3.0], [-2.0, 0.5]])
    assert module.combine_scores(scores, "mean", None).tolist() == pytest.approx([2.0, -0.75])
    assert module.combine_scores(scores, "sum", None).tolist() == pytest.approx([4.0, -1.5])
    assert module.combine_scores(scores, "sum", [0.5, 2.0]).tolist() == pytest.approx([6.5, -0.0])
    # Coste et al.'s conservative ensemble: the least impressed model decides
    assert module.combine_scores(scores, "min", None).tolist() == pytest.approx([1.0, -2.0])


@pytest.mark.parametrize("name", sorted(SCRIPTS))
@pytest.mark.parametrize("rule", ["mean", "sum", "min"])
def test_one_reward_model_keeps_its_score_exactly(name, rule):
    scores = torch.randn(7, 1)
    assert torch.equal(SCRIPTS[name].combine_scores(scores, rule, None), scores[:, 0])


def ensemble_data(module, B: int = 6, T: int = 5):
    """The script's Rollout of B episodes (ppo.py's with the critic's values)."""
    torch.manual_seed(0)
    raw = torch.randint(4, 18, (B, T))
    raw[:4, 2] = EOS  # rows 4 and 5 never end: the EOS trick replaces their scores
    responses = ppo.truncate_response(EOS, PAD, raw)
    # two reward models on scales a hundred times apart
    scores = torch.stack([torch.randn(B), 100 * torch.randn(B)], 1)
    logprobs, ref_logprobs, values = -torch.rand(B, T), -torch.rand(B, T), torch.randn(B, T)
    # the raw samples (a 2-token query before each raw response) are not read by rewards_and_advantages
    query_responses = torch.cat((torch.full((B, 2), 4), raw), 1)
    return module.Rollout(query_responses=query_responses, responses=responses, logprobs=logprobs,
                          ref_logprobs=ref_logprobs, rm_scores=scores, **({"values": values} if module is ppo else {}))


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_each_reward_model_is_scaled_by_its_own_statistics_before_the_rule(name):
    module = SCRIPTS[name]
    data = ensemble_data(module)
    args = module.Args(reward_model_path=["a", "b"], reward_combine="mean")
    getattr(args, name).scale_rewards = True
    moments = [module.RunningMoments(), module.RunningMoments()]
    shape = module.rewards_and_advantages
    out = shape(args, getattr(args, name), data, EOS, PAD, 0.05, moments, lambda x: x)
    # each column's own std of the raw scores, then the rule, then the EOS trick: an unfinished response's final
    # score is the penalty itself (never scaled, never in the running statistics)
    raw = data.rm_scores.clone()
    stds = raw.var(0, unbiased=False).sqrt()
    assert [m.std for m in moments] == pytest.approx(stds.tolist(), rel=1e-5)
    assert stds[1] > 10 * stds[0]  # the two models really are on different scales
    expected = (raw / stds).mean(1)
    expected[4:] = args.penalty_reward_value
    torch.testing.assert_close(out.scores, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_the_eos_penalty_enters_once_whatever_the_rule(name):
    """Three reward models summed: a response without EOS scores the penalty (-1), not three times it."""
    module = SCRIPTS[name]
    data = ensemble_data(module)
    data = dataclasses.replace(data, rm_scores=torch.cat([data.rm_scores, data.rm_scores[:, :1]], 1))  # (B, 3)
    args = module.Args(reward_model_path=["a", "b", "c"], reward_combine="sum")
    out = module.rewards_and_advantages(args, getattr(args, name), data, EOS, PAD, 0.05, [module.RunningMoments()] * 3,
                                        lambda x: x)
    assert out.scores[4:].tolist() == [args.penalty_reward_value] * (len(out.scores) - 4)
    torch.testing.assert_close(out.scores[:4], data.rm_scores[:4].sum(1))


def test_reward_weights_need_the_sum_rule_and_one_weight_per_model():
    """The PPO family's one check_flags (rlhf_utils/flags.py), on ppo.py's flags."""
    for kwargs in ({"reward_combine": "mean", "reward_weights": [1.0, 2.0]},
                   {"reward_combine": "sum", "reward_weights": [1.0]}):
        args = ppo.Args(reward_model_path=["a", "b"], **kwargs)
        with pytest.raises(ValueError, match="--reward_weights needs --reward_combine sum"):
            check_flags(args, ONE_PROCESS, 1, None, 1, False)


@pytest.fixture(scope="module")
def two_reward_models(synthetic_task, tmp_path_factory):
    """Two RMs: the base model with scalar heads from seeds 0 and 1."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    root = tmp_path_factory.mktemp("ensemble_rms")
    tokenizer = AutoTokenizer.from_pretrained(synthetic_task["base_model"])
    paths = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(synthetic_task["base_model"], num_labels=1)
        model.save_pretrained(root / f"rm{seed}")
        tokenizer.save_pretrained(root / f"rm{seed}")
        paths.append(str(root / f"rm{seed}"))
    return paths


def ensemble_command(name, synthetic_task, rms, root, run_name, extra=()):
    task = json.load(open(synthetic_task["task_json"]))
    return [
        os.path.join(REPO_ROOT, f"{name}.py"), "--sft_model_path", synthetic_task["base_model"],
        "--reward_model_path", *rms, "--reward_combine", "min", f"--{name}.scale_rewards",
        "--query_dataset", synthetic_task["sft"], "--response_length", str(task["sft_response_length"]),
        "--total_episodes", "40", "--total_batch_size", "8", "--local_micro_batch_size", "4",
        "--local_rollout_forward_batch_size", "8", "--num_eval_samples", "8", "--eval_every", "3",
        "--checkpoint_every", "2", "--output_dir", str(root / f"policy_{run_name}"),
        "--run_dir_root", str(root / "runs"), "--run_name", run_name, *extra,
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_two_reward_models_log_each_score_and_resume_like_an_uninterrupted_run(name, synthetic_task, two_reward_models,
                                                                             tmp_path):
    """5 updates against min(RM 0, RM 1) with per-model scaling; killed after the checkpoint of update 2 and resumed
    (the two running statistics come back from the checkpoint), the run ends with the same weights and metrics."""
    import sys

    full = [sys.executable, *ensemble_command(name, synthetic_task, two_reward_models, tmp_path, "full")]
    run_ok(full, cwd=REPO_ROOT, env=ENV)
    rows = [json.loads(line) for line in open(tmp_path / "runs" / "full" / "metrics.jsonl")]
    train = [row for row in rows if "objective/scores_rm0" in row]
    assert len(train) == 5
    for row in train:  # the combined score is the min of the two raw scores' scaled values: never above both
        assert row["objective/scores_rm0"] != row["objective/scores_rm1"]
    samples = pd.read_csv(tmp_path / "runs" / "full" / "samples.csv")
    assert (samples["score"] <= samples[["score_rm0", "score_rm1"]].min(axis=1) + 1e-6).all()
    assert (samples["score"] >= samples[["score_rm0", "score_rm1"]].min(axis=1) - 1e-6).all()

    killed = [sys.executable, *ensemble_command(name, synthetic_task, two_reward_models, tmp_path, "killed")]
    kill_after_checkpoint(killed, tmp_path / "runs" / "killed" / "checkpoints" / "update_000002", cwd=REPO_ROOT,
                          env=ENV)
    resumed = run_ok(killed + ["--resume"], cwd=REPO_ROOT, env=ENV)
    assert "resumed from" in resumed.stdout, resumed.stdout[-2000:]
    assert_same_safetensors(tmp_path / "policy_full" / "model.safetensors",
                            tmp_path / "policy_killed" / "model.safetensors")
    runs = [[without_timing(json.loads(line)) for line in open(tmp_path / "runs" / run / "metrics.jsonl")]
            for run in ("full", "killed")]
    assert runs[0] == runs[1]
