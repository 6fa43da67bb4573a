"""Tests of dpo.py: each loss against a hand computation, the summed response log-prob, the
precomputed-reference path against the live one, the accuracy table, and a subprocess smoke run
on the built-in task."""

import json
import math
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import (
    ENV,
    assert_last_good_checkpoint,
    assert_same_safetensors,
    kill_after_checkpoint,
    load_script,
    run_ok,
    tiny_causal_lm,
    without_timing,
)
from rlhf_utils import records

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE_COLUMNS = ["query", "response", "reference", "score", "response_token_len", "has_eos"]
PAD, EOS = 1, 2




dpo = load_script("dpo")




def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# made-up sequence log-probs of two pairs: (policy chosen, policy rejected, ref chosen, ref rejected)
PAIRS = [(-10.0, -12.0, -11.0, -11.0), (-20.0, -15.0, -18.0, -16.0)]
BETA = 0.1


def made_up_logps():
    return [torch.tensor([p[i] for p in PAIRS]) for i in range(4)]


def hand_h(pair):
    pc, pr, rc, rr = pair
    return (pc - pr) - (rc - rr)  # pair 0: 2 - 0 = 2; pair 1: -5 - (-2) = -3


def test_implicit_rewards_by_hand():
    _, chosen, rejected = dpo.dpo_loss(*made_up_logps(), beta=BETA, loss_type="sigmoid")
    # r = beta * (logp - ref_logp): pair 0 -> 0.1 * 1 = 0.1 and 0.1 * -1 = -0.1; pair 1 -> -0.2 and 0.1
    assert torch.allclose(chosen, torch.tensor([0.1, -0.2]))
    assert torch.allclose(rejected, torch.tensor([-0.1, 0.1]))
    assert torch.allclose(chosen - rejected, BETA * torch.tensor([hand_h(p) for p in PAIRS]))


def test_sigmoid_loss_by_hand():
    losses, _, _ = dpo.dpo_loss(*made_up_logps(), beta=BETA, loss_type="sigmoid")
    expected = [-math.log(sigmoid(BETA * hand_h(p))) for p in PAIRS]  # -log sigmoid(0.2), -log sigmoid(-0.3)
    assert losses.tolist() == pytest.approx(expected, rel=1e-6)
    assert expected[0] == pytest.approx(math.log(1 + math.exp(-0.2)))


def test_conservative_dpo_loss_by_hand():
    eps = 0.1
    losses, _, _ = dpo.dpo_loss(*made_up_logps(), beta=BETA, loss_type="sigmoid", label_smoothing=eps)
    expected = [
        -(1 - eps) * math.log(sigmoid(BETA * hand_h(p))) - eps * math.log(sigmoid(-BETA * hand_h(p))) for p in PAIRS
    ]
    assert losses.tolist() == pytest.approx(expected, rel=1e-6)
    # smoothing makes the loss larger than plain DPO on a pair the model already ranks right
    plain, _, _ = dpo.dpo_loss(*made_up_logps(), beta=BETA, loss_type="sigmoid")
    assert losses[0] > plain[0]
    # label_smoothing 0.5 makes the loss blind to the label: swapping chosen and rejected (h -> -h) changes nothing
    half, _, _ = dpo.dpo_loss(*made_up_logps(), beta=BETA, loss_type="sigmoid", label_smoothing=0.5)
    flipped, _, _ = dpo.dpo_loss(*[made_up_logps()[i] for i in (1, 0, 3, 2)], beta=BETA, loss_type="sigmoid",
                                 label_smoothing=0.5)
    assert torch.allclose(half, flipped)


def test_ipo_loss_by_hand():
    losses, _, _ = dpo.dpo_loss(*made_up_logps(), beta=BETA, loss_type="ipo")
    # (h - 1 / (2 beta))^2 with 1 / (2 * 0.1) = 5: (2 - 5)^2 = 9 and (-3 - 5)^2 = 64
    assert losses.tolist() == pytest.approx([9.0, 64.0], rel=1e-6)


def test_ipo_averages_log_probs_over_response_tokens_by_default():
    """The IPO authors' form: policy chosen -10 over 10 tokens, rejected -20 over 20, reference -12 and -19,
    beta 0.05 (target 1 / (2 beta) = 10). Summed: h = (-10 + 20) - (-12 + 19) = 3, loss (3 - 10)^2 = 49.
    Averaged: h = (-10 + 12) / 10 - (-20 + 19) / 20 = 0.25, loss (0.25 - 10)^2 = 95.0625."""
    logps = [torch.tensor([v]) for v in (-10.0, -20.0, -12.0, -19.0)]
    args = dpo.Args(loss_type="ipo")
    assert args.ipo_average  # the default
    batch = {
        "query_chosen_token_response_label": torch.tensor([[PAD] * 3 + [5] * 9 + [EOS] + [PAD] * 10]),
        "query_rejected_token_response_label": torch.tensor([[PAD] * 3 + [6] * 19 + [EOS]]),
    }
    counts = dpo.ipo_token_counts(args, batch, PAD)
    assert [int(c) for c in counts] == [10, 20]
    averaged, _, _ = dpo.dpo_loss(*logps, beta=0.05, loss_type="ipo", token_counts=counts)
    assert averaged.item() == pytest.approx(95.0625, rel=1e-6)
    summed_args = dpo.Args(loss_type="ipo", ipo_average=False)
    assert dpo.ipo_token_counts(summed_args, batch, PAD) is None
    summed, _, _ = dpo.dpo_loss(*logps, beta=0.05, loss_type="ipo", token_counts=None)
    assert summed.item() == pytest.approx(49.0, rel=1e-6)
    assert dpo.ipo_token_counts(dpo.Args(loss_type="sigmoid"), batch, PAD) is None  # only IPO averages


def test_hinge_loss_by_hand():
    losses, _, _ = dpo.dpo_loss(*made_up_logps(), beta=BETA, loss_type="hinge")
    # max(0, 1 - beta h): 1 - 0.2 = 0.8 and 1 + 0.3 = 1.3
    assert losses.tolist() == pytest.approx([0.8, 1.3], rel=1e-6)
    # past the margin the hinge is flat zero
    zero, _, _ = dpo.dpo_loss(torch.tensor([0.0]), torch.tensor([-50.0]), torch.tensor([0.0]), torch.tensor([0.0]),
                              beta=BETA, loss_type="hinge")
    assert zero.item() == 0.0


def test_label_smoothing_only_for_sigmoid():
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo.dpo_loss(*made_up_logps(), beta=BETA, loss_type="ipo", label_smoothing=0.1)


def test_loss_gradients_push_chosen_up_and_rejected_down():
    for loss_type in ("sigmoid", "ipo", "hinge"):
        pc, pr = torch.tensor([-10.0], requires_grad=True), torch.tensor([-10.0], requires_grad=True)
        losses, _, _ = dpo.dpo_loss(pc, pr, torch.tensor([-10.0]), torch.tensor([-10.0]), beta=BETA,
                                    loss_type=loss_type)
        losses.sum().backward()
        assert pc.grad.item() < 0 < pr.grad.item(), loss_type


def test_sequence_logprob_is_the_sum_over_response_tokens():
    model = tiny_causal_lm(pad_token_id=PAD, eos_token_id=EOS)
    query, response = [5, 6, 7], [8, 9, EOS]
    tokens = torch.tensor([query + response + [PAD, PAD]])
    labels = torch.tensor([[PAD] * len(query) + response + [PAD, PAD]])
    got = dpo.sequence_logprobs(model, tokens, labels, PAD)
    # by hand: an unpadded forward, then log pi(y_t | prefix) of each response token, summed
    with torch.no_grad():
        logprobs = F.log_softmax(model(torch.tensor([query + response])).logits[0].float(), dim=-1)
    expected = sum(logprobs[len(query) + i - 1, token].item() for i, token in enumerate(response))
    assert got.item() == pytest.approx(expected, abs=1e-5)
    # more right padding changes nothing; a longer response changes the sum
    more_pad = dpo.sequence_logprobs(
        model, torch.cat((tokens, torch.full((1, 3), PAD)), 1), torch.cat((labels, torch.full((1, 3), PAD)), 1), PAD
    )
    assert more_pad.item() == pytest.approx(got.item(), abs=1e-5)
    # the tokens after the first two carry real log-probability mass: a sum over fewer tokens is visibly larger
    assert got.item() < sum(logprobs[len(query) + i - 1, t].item() for i, t in enumerate(response[:2])) - 1e-3


def tiny_preference_dataset(num_rows: int = 10, seed: int = 0) -> Dataset:
    """Rows in the processed schema: unpadded query + response + EOS, right-padded; labels with the query as [PAD]."""
    g = torch.Generator().manual_seed(seed)
    total = 12
    columns = {name: [] for name in dpo.PAIR_COLUMNS}
    for _ in range(num_rows):
        query = torch.randint(3, 16, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
        for name in ("chosen", "rejected"):
            response = (torch.randint(3, 16, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
                        + [EOS])
            sequence = query + response
            label = [PAD] * len(query) + response
            columns[f"query_{name}_token"].append(sequence + [PAD] * (total - len(sequence)))
            columns[f"query_{name}_token_response_label"].append(label + [PAD] * (total - len(label)))
    return Dataset.from_dict(columns)


def test_precomputed_reference_equals_live_reference():
    policy, reference = (tiny_causal_lm(seed=0, pad_token_id=PAD, eos_token_id=EOS),
                         tiny_causal_lm(seed=1, pad_token_id=PAD, eos_token_id=EOS))
    dataset = dpo.with_row_index(tiny_preference_dataset(), dpo.PAIR_COLUMNS)
    table = dpo.precompute_reference_logprobs(Accelerator(cpu=True), reference, dataset, batch_size=3, pad_token_id=PAD)
    assert table.shape == (10, 2)
    # a shuffled batch: rows are matched through row_index, not position
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True,
                                         generator=torch.Generator().manual_seed(3))
    batch = next(iter(loader))
    assert batch["row_index"].tolist() != [0, 1, 2, 3]
    with torch.no_grad():
        policy_chosen, policy_rejected = dpo.concatenated_logprobs(policy, batch, PAD)
    results = {}
    for name, ref_model, ref_table in (("live", reference, None), ("precomputed", None, table)):
        ref_chosen, ref_rejected = dpo.reference_logprobs(ref_model, ref_table, batch, PAD)
        for loss_type in ("sigmoid", "ipo", "hinge"):
            results[name, loss_type] = dpo.dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, 0.05,
                                                    loss_type)
    for loss_type in ("sigmoid", "ipo", "hinge"):
        for live, precomputed in zip(results["live", loss_type], results["precomputed", loss_type]):
            assert torch.allclose(live, precomputed, atol=1e-5)
    # the two models differ, so the rewards are not trivially zero
    assert results["live", "sigmoid"][1].abs().max() > 1e-4


def test_concatenated_forward_matches_separate_forwards():
    model = tiny_causal_lm(pad_token_id=PAD, eos_token_id=EOS)
    batch = dpo.with_row_index(tiny_preference_dataset(4), dpo.PAIR_COLUMNS)[:4]
    chosen, rejected = dpo.concatenated_logprobs(model, batch, PAD)
    for name, got in (("chosen", chosen), ("rejected", rejected)):  # both halves of the concatenated batch
        separate = dpo.sequence_logprobs(model, batch[f"query_{name}_token"],
                                         batch[f"query_{name}_token_response_label"], PAD)
        assert torch.allclose(got, separate, atol=1e-5), name
    assert not torch.allclose(chosen, rejected, atol=1e-3)  # the halves differ, so a swap would be seen
    assert chosen.shape == rejected.shape == (4,)


def test_implicit_reward_breakdown_table():
    frame = pd.DataFrame({
        "chosen_reward": [0.3, 0.1, -0.2, 0.5],
        "rejected_reward": [0.1, 0.2, -0.4, 0.6],
        "batch": ["b1", "b1", "b2", "b2"],
        "confidence": [1, 9, 9, 9],
        "split": ["valid1", "valid1", "valid2", "valid2"],
    })
    frame["correct"] = frame["chosen_reward"] > frame["rejected_reward"]
    rows = dpo.implicit_reward_breakdown(frame, "validation")
    keyed = {(r["group"], r["key"]): r for r in rows}
    assert list(rows[0]) == ["dataset_split", "group", "key", "value", "n"]
    assert keyed[("accuracy", "overall")]["value"] == 0.5 and keyed[("accuracy", "overall")]["n"] == 4
    assert keyed[("accuracy by batch", "b1")]["value"] == 0.5
    assert keyed[("accuracy by confidence", "9")]["value"] == pytest.approx(1 / 3)
    assert keyed[("accuracy by split", "valid2")]["value"] == 0.5
    assert keyed[("reward", "max")]["value"] == 0.6 and keyed[("reward", "max")]["n"] == 8
    markdown = records.breakdown_markdown(rows)  # (rlhf_utils/records.py)
    assert markdown.splitlines()[0] == "| dataset split | metric | key | value | n |"
    assert "| validation | accuracy | overall | 0.5000 | 4 |" in markdown


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_smoke_run_on_builtin_task(synthetic_task, tmp_path):
    """A tiny run (the base model stands in for the SFT model) with the reference precomputed."""
    with open(synthetic_task["task_json"]) as f:
        task = json.load(f)
    output_dir, runs = tmp_path / "dpo", tmp_path / "runs"
    command = [
        sys.executable, os.path.join(REPO_ROOT, "dpo.py"),
        "--sft_model_path", synthetic_task["base_model"],
        "--preference_dataset", synthetic_task["preference"],
        "--query_dataset", synthetic_task["sft"],
        "--response_length", str(task["sft_response_length"]),
        "--output_dir", str(output_dir), "--run_dir_root", str(runs), "--run_name", "smoke",
        "--total_episodes", "32", "--total_batch_size", "16", "--local_micro_batch_size", "8",
        "--lr", "1e-4", "--beta", "0.1", "--precompute_ref_logprobs",
        "--eval_every", "1", "--log_every", "1", "--num_eval_samples", "8", "--local_eval_batch_size", "8",
    ]
    result = subprocess.run(command, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]

    run_dir = runs / "smoke"
    for name in ("args.json", "metrics.jsonl", "summary.json", "eval_table.md", "eval_table.csv", "samples.csv",
                 "samples/step_000001.csv", "samples/step_000002.csv"):
        assert (run_dir / name).exists(), name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["num_updates"] == 2
    assert summary["budget/updates"] == 2 and summary["budget/pairs_read"] == 32  # the budget as spent
    assert 0.0 <= summary["eval/accuracy"] <= 1.0
    assert summary["eval/accuracy"] == summary["eval/validation/accuracy"]
    assert summary["wall_time_s"] > 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in train] == [1, 2]
    assert all(0 < m["time/update_s"] < summary["wall_time_s"] for m in train)  # each update's (issue 51)
    # the policy starts as the reference: the first update's rewards are exactly zero and its loss log 2
    assert train[0]["train/rewards/chosen"] == pytest.approx(0.0, abs=1e-3)
    assert train[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-3)
    assert train[-1]["train/rewards/chosen"] != 0.0
    table = (run_dir / "eval_table.md").read_text()
    assert table.startswith("| dataset split | metric | key | value | n |")
    assert "| validation | accuracy | overall |" in table
    samples = pd.read_csv(run_dir / "samples.csv")
    assert list(samples.columns) == SAMPLE_COLUMNS
    assert len(samples) == 8
    assert samples["response_token_len"].between(1, task["sft_response_length"]).all()
    assert (samples["response_token_len"][~samples["has_eos"]] == task["sft_response_length"]).all()

    model = AutoModelForCausalLM.from_pretrained(output_dir)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id


# ------------------------------------------------------------------------------------------------
# Reliability (issue #13): resume after SIGKILL with the reference log-probs read back, non-finite guard
# ------------------------------------------------------------------------------------------------
def dpo_command(task: dict, preference: str, tmp_path, output_dir, *extra: str) -> list:
    return [
        sys.executable, os.path.join(REPO_ROOT, "dpo.py"),
        "--sft_model_path", task["base_model"], "--preference_dataset", preference, "--query_dataset", task["sft"],
        "--response_length", str(task["task"]["sft_response_length"]),
        "--output_dir", str(output_dir), "--run_dir_root", str(tmp_path / "runs"),
        "--total_batch_size", "16", "--local_micro_batch_size", "8", "--lr", "1e-4", "--beta", "0.1",
        "--num_eval_samples", "8", "--local_eval_batch_size", "8", *extra,
    ]


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_weights_and_metrics(synthetic_task, short_preference, tmp_path):
    """SIGKILL after the update-3 checkpoint (first epoch, inside a logging interval), then --resume (the run
    found by its name prefix): the policy, metrics.jsonl, summary.json and the sampled responses equal an
    uninterrupted run's. The precomputed reference log-probs are read back, not recomputed."""
    # 3 epochs of 40 pairs = 7 updates of 16 (update 3 spans epochs 1 and 2); logs at 2, 4, 6, 7; evaluation at 3, 6
    flags = ["--num_train_epochs", "3", "--checkpoint_every", "3", "--eval_every", "3", "--log_every", "2",
             "--precompute_ref_logprobs", "--eval_temperature", "1.0",  # temperature 1: the samples depend on the RNG
             "--print_sample_every", "3"]
    full = run_ok(dpo_command(synthetic_task, short_preference, tmp_path, tmp_path / "full", "--run_name", "full",
                              *flags),
                  cwd=REPO_ROOT, env=ENV)
    # --print_sample_every counts updates: the evaluations at updates 3 and 6 print samples, and the final one
    assert all(f"--- update {u}\n" in full.stdout for u in (3, 6, 7)), full.stdout[-2000:]

    command = dpo_command(synthetic_task, short_preference, tmp_path, tmp_path / "cut", *flags)
    runs = tmp_path / "runs"
    kill_after_checkpoint(command + ["--run_name", "dpo__1__cut"],
                          runs / "dpo__1__cut" / "checkpoints" / "update_000003", cwd=REPO_ROOT, env=ENV, timeout=240)
    assert not (tmp_path / "cut" / "model.safetensors").exists()  # killed before its final save

    # no --run_name: --resume picks the newest runs/dpo__1__* that has a checkpoint
    resumed = run_ok(command + ["--resume"], cwd=REPO_ROOT, env=ENV)
    output = resumed.stdout + resumed.stderr
    assert "dpo__1__cut/checkpoints/update_000003 (update 3)" in output
    assert "reference log-probs of the interrupted run read from" in output

    assert_same_safetensors(tmp_path / "full" / "model.safetensors", tmp_path / "cut" / "model.safetensors")
    rows = {name: [without_timing(json.loads(line)) for line in open(runs / name / "metrics.jsonl")]
            for name in ("full", "dpo__1__cut")}
    assert [r["step"] for r in rows["full"]] == [2, 3, 4, 6, 6, 7, 7]  # training logs and evaluations
    assert rows["dpo__1__cut"] == rows["full"]
    summaries = {name: without_timing(json.load(open(runs / name / "summary.json")))
                 for name in ("full", "dpo__1__cut")}
    assert summaries["dpo__1__cut"] == summaries["full"]
    # sampled from the restored RNG states: the same responses, token for token
    assert (runs / "dpo__1__cut" / "samples.csv").read_text() == (runs / "full" / "samples.csv").read_text()
    # two fresh computations of the reference tables agree exactly, so reading them back equals recomputing
    tables = {name: torch.load(runs / name / "reference_logprobs.pt") for name in ("full", "dpo__1__cut")}
    assert torch.equal(tables["full"]["train"], tables["dpo__1__cut"]["train"])
    assert tables["full"]["train"].shape == (40, 2) and torch.isfinite(tables["full"]["train"]).all()
    assert os.listdir(runs / "dpo__1__cut" / "checkpoints") == ["update_000006"]


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(synthetic_task, short_preference, tmp_path):
    """An absurd learning rate overflows the policy: the guard names the update and the quantities before
    backward, no final model is written, and the checkpoint holds the finite policy after the update before."""
    result = subprocess.run(
        dpo_command(synthetic_task, short_preference, tmp_path, tmp_path / "model", "--run_name", "nan",
                    "--total_episodes", "48", "--lr", "1e30", "--eval_every", "0"),
        cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("dpo.py: error: update 2: train/loss, train/logps/chosen"), last_line
    assert "train/ref_logps" not in last_line  # the frozen reference stays finite
    assert not (tmp_path / "model" / "model.safetensors").exists()
    assert_last_good_checkpoint(tmp_path / "runs" / "nan" / "checkpoints", 1)
