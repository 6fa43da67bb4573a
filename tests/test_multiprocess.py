"""Multi-process correctness (issue #12) on the CPU: 2 processes over gloo (`torchrun`), for every training
script. tests/mp_probe.py runs the script's main() unchanged and saves each rank's final weights and RNG seed.

For each script one 2-process run and one 1-process run with the same global batch prove:
- the weights are identical on both ranks after the updates (gradients are all-reduced, nothing diverges);
- the sampling seeds differ per rank (each rank draws its own samples);
- the 1-process and 2-process runs make the same number of updates, log the same training metrics and end
  with the same weights, within float tolerance. Because the 1-process run accumulates the two micro-batches
  that the two ranks take, this also proves that each rank reads a different shard (two ranks reading the
  same rows would train on half the data) and that logged metrics are gathered from every rank (rank 0's
  alone would differ from the 1-process mean)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ENV, without_timing

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(REPO_ROOT, "tests", "mp_probe.py")
ENV = {**ENV, "ACCELERATE_USE_CPU": "true"}  # torchrun's processes talk over gloo on the CPU


def sft_flags(task: dict) -> list:
    return ["--base_model", task["base_model"], "--query_dataset", task["sft"],
            "--response_length", str(task["task"]["sft_response_length"]), "--total_episodes", "64",
            "--total_batch_size", "16", "--local_micro_batch_size", "8", "--lr", "1e-3",
            "--num_eval_samples", "16", "--local_eval_batch_size", "8", "--eval_every", "2"]


def reward_flags(task: dict) -> list:
    return ["--sft_model_path", task["base_model"], "--preference_dataset", task["preference"],
            "--query_dataset", task["sft"], "--total_episodes", "64", "--total_batch_size", "16",
            "--local_micro_batch_size", "8", "--lr", "1e-4", "--num_eval_samples", "32",
            "--num_normalization_samples", "32", "--eval_every", "2", "--log_every", "1"]


def dpo_flags(task: dict) -> list:
    return ["--sft_model_path", task["base_model"], "--preference_dataset", task["preference"],
            "--query_dataset", task["sft"], "--response_length", str(task["task"]["sft_response_length"]),
            "--total_episodes", "64", "--total_batch_size", "16", "--local_micro_batch_size", "8", "--lr", "1e-4",
            "--beta", "0.1", "--log_every", "1", "--num_eval_samples", "16", "--local_eval_batch_size", "8"]


def ilql_flags(task: dict) -> list:
    return ["--init_from", "base", "--model_path", task["base_model"], "--preference_dataset", task["preference"],
            "--query_dataset", task["sft"], "--response_length", str(task["task"]["sft_response_length"]),
            "--total_episodes", "64", "--total_batch_size", "16", "--local_micro_batch_size", "8",
            "--ilql.steps_for_target_q_sync", "2", "--log_every", "1", "--num_eval_samples", "8",
            "--local_eval_batch_size", "4", "--eval_betas", "1"]


def reward_model(task: dict) -> str:
    """A reward model for the PPO run: the base model with a seeded scalar head (made once per task)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = os.path.join(task["root"], "mp_reward_model")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        torch.manual_seed(0)
        AutoModelForSequenceClassification.from_pretrained(task["base_model"], num_labels=1).save_pretrained(path)
        AutoTokenizer.from_pretrained(task["base_model"]).save_pretrained(path)
    return path


def ppo_flags(task: dict) -> list:
    # Rollouts are sampled with a different seed on each rank, so the 1-process run can only draw the same
    # responses when sampling is near greedy (--temperature 0.001). One minibatch per epoch keeps the
    # minibatches of both runs the same rows; whitening uses the statistics of the global batch.
    return ["--sft_model_path", task["base_model"], "--reward_model_path", reward_model(task),
            "--query_dataset", task["sft"], "--response_length", str(task["task"]["sft_response_length"]),
            "--total_episodes", "32", "--total_batch_size", "8", "--local_micro_batch_size", "4",
            "--local_rollout_forward_batch_size", "4", "--ppo.num_ppo_epochs", "2", "--ppo.num_mini_batches", "1",
            "--temperature", "0.001", "--num_eval_samples", "8", "--eval_every", "2", "--lr", "1e-4"]


def offline_rl_flags(task: dict) -> list:
    # each run builds its own RM-labelled mixture ({run} is the run's folder), greedy as the seed paper did
    return ["--method", "rwr", "--sft_model_path", task["base_model"], "--reward_model_path", reward_model(task),
            "--query_dataset", task["sft"], "--preference_dataset", task["preference"],
            "--response_length", str(task["task"]["sft_response_length"]), "--cache_dir", "{run}/cache",
            "--mixture_size", "32", "--total_batch_size", "8", "--local_micro_batch_size", "4",
            "--num_eval_samples", "4", "--local_rollout_batch_size", "8", "--lr", "1e-4"]


SCRIPTS = {"sft": sft_flags, "reward": reward_flags, "dpo": dpo_flags, "ilql": ilql_flags, "ppo": ppo_flags,
           "offline_rl": offline_rl_flags}


def run_probe(script: str, flags: list, tmp_path, name: str, processes: int, port: int):
    out = tmp_path / name
    flags = [flag.replace("{run}", str(out)) for flag in flags]
    common = ["--output_dir", str(tmp_path / f"model_{name}"), "--run_dir_root", str(tmp_path / "runs"),
              "--run_name", name, "--checkpoint_every", "0"]
    if processes == 1:
        command = [sys.executable, PROBE, script, str(out), "--", *flags, *common]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                   "--master_port", str(port), PROBE, script, str(out), "--", *flags, *common]
    result = subprocess.run(command, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(processes)]
    rows = [without_timing(json.loads(line)) for line in open(tmp_path / "runs" / name / "metrics.jsonl")]
    return ranks, rows


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_two_processes_match_one_process(script, synthetic_task, tmp_path):
    flags = SCRIPTS[script](synthetic_task)
    port = 29600 + sorted(SCRIPTS).index(script)
    two, two_rows = run_probe(script, flags, tmp_path, "two", 2, port)
    (one,), one_rows = run_probe(script, flags, tmp_path, "one", 1, port)

    # both ranks end with bit-identical weights
    assert two[0]["world_size"] == 2 and two[0]["weights"].keys() == two[1]["weights"].keys()
    for name, tensor in two[0]["weights"].items():
        assert torch.equal(tensor, two[1]["weights"][name]), f"{name} differs between rank 0 and rank 1"
    # each rank samples with its own seed (reward.py samples nothing: it keeps the common seed)
    if script != "reward":
        assert two[0]["initial_seed"] != two[1]["initial_seed"]

    # the same updates, the same logged metrics and the same final weights as one process
    steps = lambda rows: [row["step"] for row in rows]  # noqa: E731
    assert steps(two_rows) == steps(one_rows) and len(two_rows) > 0
    for a, b in zip(two_rows, one_rows):
        assert a.keys() == b.keys()
        for key in a:
            if key.startswith(("train/", "objective/", "ppo/", "loss")) and isinstance(a[key], float):
                # a clip fraction counts values past a threshold: a 1e-8 difference can flip one token
                tolerance = dict(abs=0.01) if "clipfrac" in key else dict(rel=1e-4, abs=1e-5)
                assert a[key] == pytest.approx(b[key], **tolerance), (a["step"], key)
    for name, tensor in one["weights"].items():
        torch.testing.assert_close(two[0]["weights"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
