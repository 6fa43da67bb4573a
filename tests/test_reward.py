"""Tests for reward.py: the EOS reward index (Details 12, 14), the head init (Detail 11), the
normalisation fold (Detail 15), the loss and calibration maths, and one smoke run on the built-in task."""

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import (
    ENV,
    assert_last_good_checkpoint,
    assert_same_checkpoint,
    assert_same_safetensors,
    kill_after_checkpoint,
    load_script,
    run_ok,
    with_nan_at,
    without_timing,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAD, EOS = 1, 0


reward = load_script("reward")
from rlhf_utils import (  # noqa: E402
    checks,  # the input checks the scripts import
    records,  # the evaluation files reward.py writes
)


def tiny_rm(hidden_size: int = 32, seed: int = 0):
    """A tiny GPT-NeoX sequence-classification model (the saved RM's format) with [PAD]=1, EOS=0."""
    from transformers import GPTNeoXConfig, GPTNeoXForSequenceClassification

    config = GPTNeoXConfig(
        vocab_size=64, hidden_size=hidden_size, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=2 * hidden_size, max_position_embeddings=64, rotary_pct=0.25, num_labels=1,
        pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS, hidden_dropout=0.0,
    )
    torch.manual_seed(seed)
    model = GPTNeoXForSequenceClassification(config).eval()
    reward.init_reward_head(model, "paper", None)
    return model


def head_output_at_last_token(model, tokens: list[int]) -> float:
    """The head's output at the last token of an unpadded sequence, by a plain forward with no pads."""
    with torch.no_grad():
        hidden = model.gpt_neox(input_ids=torch.tensor([tokens])).last_hidden_state  # (1, T, d)
        return float(model.score(hidden)[0, -1, 0])


def test_reward_index_right_padded_and_unpadded():
    model = tiny_rm()
    rows = [
        [5, 6, 7, 12, 13, EOS, PAD, PAD, PAD],  # EOS then pads: read at index 5
        [8, 9, 10, 11, 14, 15, 16, 17, EOS],  # no pad: read at the last token
        [20, 21, 22, 23, 24, 25, 26, 27, 28],  # no pad and no EOS: still the last token (Detail 12)
    ]
    with torch.no_grad():
        logits, rewards, index = reward.get_reward(model, torch.tensor(rows), PAD, 0)
    assert index.tolist() == [5, 8, 8]
    for row, r, i in zip(rows, rewards, index):
        unpadded = row[: int(i) + 1]
        assert PAD not in unpadded
        assert float(r) == pytest.approx(head_output_at_last_token(model, unpadded), abs=1e-5)
    # the reward is one entry of the per-token logits, and the logits elsewhere differ from it
    assert torch.equal(rewards, logits[torch.arange(3), index])
    assert not torch.allclose(logits[0, 3], logits[0, 5])


def test_real_columns_keep_rewards():
    model = tiny_rm()
    rows = torch.tensor([
        [5, 6, 7, 12, 13, EOS, PAD, PAD, PAD, PAD],
        [8, 9, 10, 11, 14, 15, EOS, PAD, PAD, PAD],
    ])
    trimmed = rows[:, reward.real_columns(rows, PAD)]
    assert trimmed.shape == (2, 7)  # the longer row ends exactly at the new edge
    with torch.no_grad():
        _, full, full_index = reward.get_reward(model, rows, PAD, 0)
        _, short, short_index = reward.get_reward(model, trimmed, PAD, 0)
    assert torch.equal(full_index, short_index)
    torch.testing.assert_close(short, full, atol=1e-6, rtol=0)


def test_reward_index_left_padded_query():
    """Detail 14: a left-padded query + right-padded response gives the head output at the EOS of the
    unpadded sequence (positions and mask ignore the pads)."""
    model = tiny_rm()
    queries = torch.tensor([[PAD, PAD, 5, 6, 7], [PAD, 8, 9, 10, 11], [30, 31, 32, 33, 34]])
    responses = torch.tensor([[12, 13, EOS, PAD], [14, 15, 16, EOS], [40, EOS, PAD, PAD]])
    query_responses = torch.cat((queries, responses), dim=1)
    with torch.no_grad():
        _, rewards, index = reward.get_reward(model, query_responses, PAD, queries.size(1))
    assert index.tolist() == [7, 8, 6]
    for row, r, i in zip(query_responses.tolist(), rewards, index):
        unpadded = [t for t in row[: int(i) + 1] if t != PAD]
        assert unpadded[-1] == EOS
        assert float(r) == pytest.approx(head_output_at_last_token(model, unpadded), abs=1e-5)
    # why context_length matters: searching from 0, the query's left pads look like the end of the row
    with torch.no_grad():
        _, _, index_from_zero = reward.get_reward(model, query_responses, PAD, 0)
    assert index_from_zero.tolist() == [-1, -1, 6]


def test_query_once_gives_the_whole_rows_rewards_and_gradients():
    """--score_query_once: each query runs once and both responses read its keys and values. The rewards are those
    of the whole rows query + chosen and query + rejected (left-padded queries of different lengths, responses of
    different lengths, one without a pad), and so are the pairwise loss's gradients, up to float rounding."""
    model = tiny_rm().train()  # train mode: the cache is built with gradients (no dropout in tiny_rm)
    queries = torch.tensor([[PAD, PAD, 5, 6, 7], [PAD, 8, 9, 10, 11], [30, 31, 32, 33, 34]])
    chosen = torch.tensor([[12, 13, EOS, PAD], [14, 15, 16, EOS], [40, EOS, PAD, PAD]])
    rejected = torch.tensor([[17, EOS, PAD, PAD], [18, 19, EOS, PAD], [41, 42, 43, EOS]])

    def whole_rows():
        rows = torch.cat((torch.cat((queries, chosen), 1), torch.cat((queries, rejected), 1)))
        rewards = reward.get_reward(model, rows, PAD, queries.size(1))[1]
        return rewards[:3], rewards[3:]

    grads = []
    for score in (whole_rows, lambda: reward.get_pair_rewards(model, queries, chosen, rejected, PAD)):
        model.zero_grad()
        chosen_rewards, rejected_rewards = score()
        reward.pairwise_loss(chosen_rewards, rejected_rewards).backward()
        grads.append(({n: p.grad.clone() for n, p in model.named_parameters()}, chosen_rewards, rejected_rewards))
    (whole, c1, r1), (once, c2, r2) = grads
    torch.testing.assert_close(c2, c1, atol=1e-5, rtol=0)
    torch.testing.assert_close(r2, r1, atol=1e-5, rtol=0)
    assert not torch.allclose(c1, r1)  # the two responses score differently: a mix-up of rows would show
    for name, grad in whole.items():
        torch.testing.assert_close(once[name], grad, atol=1e-6, rtol=1e-4, msg=name)
    assert any(grad.abs().max() > 1e-4 for grad in whole.values())  # the gradients compared are not all zero


@pytest.mark.parametrize("hidden_size", [256, 1024])
def test_head_init_std(hidden_size):
    from transformers import GPTNeoXConfig, GPTNeoXForSequenceClassification

    config = GPTNeoXConfig(vocab_size=32, hidden_size=hidden_size, num_hidden_layers=1, num_attention_heads=4,
                           intermediate_size=8, num_labels=1)
    model = GPTNeoXForSequenceClassification(config)
    torch.manual_seed(0)
    std = reward.init_reward_head(model, "paper", None)
    assert model.score.bias is None  # Detail 11: zero (absent) bias
    assert std == pytest.approx(1 / math.sqrt(hidden_size + 1))
    empirical = float(model.score.weight.detach().std())
    assert empirical == pytest.approx(std, rel=0.15)
    assert abs(float(model.score.weight.detach().mean())) < 3 * std / math.sqrt(hidden_size)
    # the library default is much smaller (0.02), so the ablation really changes the head
    library_std = reward.init_reward_head(model, "library", None)
    assert library_std == config.initializer_range
    assert float(model.score.weight.detach().std()) == pytest.approx(library_std, rel=0.15)
    assert reward.init_reward_head(model, "paper", 0.5) == 0.5
    assert float(model.score.weight.detach().std()) == pytest.approx(0.5, rel=0.15)
    with pytest.raises(ValueError):
        reward.init_reward_head(model, "library", 0.5)


def test_fold_reward_bias_shifts_every_logit_exactly():
    """Detail 15: folding the mean into the final norm's bias shifts every reward logit by -mean, so the
    references score mean 0 through get_reward, and the ranking of any pair is unchanged."""
    model = tiny_rm(seed=3)
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(2, 64, (16, 12), generator=g)
    rows[:, 8] = EOS
    rows[:, 9:] = PAD
    with torch.no_grad():
        logits_before, before, _ = reward.get_reward(model, rows, PAD, 0)
    mean = float(before.mean())
    reward.fold_reward_bias(model, mean)
    with torch.no_grad():
        logits_after, after, _ = reward.get_reward(model, rows, PAD, 0)
    assert abs(mean) > 1e-3  # the test would be vacuous otherwise
    assert float(after.mean()) == pytest.approx(0.0, abs=1e-5)
    torch.testing.assert_close(logits_after, logits_before - mean, atol=1e-5, rtol=0)
    # the library's own forward sees the shift too (any loader gets normalised scores)
    with torch.no_grad():
        library_logits = model(input_ids=rows[:, :9]).logits[:, 0]
    torch.testing.assert_close(library_logits, after, atol=1e-5, rtol=0)


def test_pairwise_loss_matches_formula():
    chosen = torch.tensor([1.0, -0.5, 2.0])
    rejected = torch.tensor([0.0, 0.5, 2.5])
    expected = np.mean([math.log(1 + math.exp(-(c - r))) for c, r in zip(chosen.tolist(), rejected.tolist())])
    assert float(reward.pairwise_loss(chosen, rejected)) == pytest.approx(expected, rel=1e-6)


def _calibrated_frame(n: int, seed: int = 0) -> pd.DataFrame:
    """Pairs whose rater prefers A with probability exactly 1 / (1 + e^-(r_A - r_B))."""
    rng = np.random.default_rng(seed)
    r_a, r_b = rng.normal(0, 2, n), rng.normal(0, 2, n)
    prefers_a = rng.random(n) < 1 / (1 + np.exp(-(r_a - r_b)))
    frame = pd.DataFrame({"chosen_score": np.where(prefers_a, r_a, r_b),
                          "rejected_score": np.where(prefers_a, r_b, r_a)})
    frame["score_diff"] = frame["chosen_score"] - frame["rejected_score"]
    frame["correct"] = frame["score_diff"] > 0
    frame["batch"] = np.where(np.arange(n) % 2 == 0, "batch10", "batch11")
    frame["confidence"] = 1 + np.arange(n) % 9
    frame["split"] = "valid1"
    frame["chosen"] = [f"summary {i}" for i in range(n)]
    frame["rejected"] = [f"summary {i}" if i % 10 == 0 else f"other {i}" for i in range(n)]  # 10% identical
    return frame


def test_calibration_bins():
    frame = _calibrated_frame(20000)
    bins = reward.calibration_bins(frame, 10)
    assert bins["n"].sum() == 2 * len(frame)  # every (symmetrised) pair lands in a bin
    # mirrored bins: accuracy(d) = 1 - accuracy(-d)
    np.testing.assert_allclose(bins["accuracy"].to_numpy(), 1 - bins["accuracy"].to_numpy()[::-1], atol=1e-12)
    # a calibrated model follows the ideal curve...
    np.testing.assert_allclose(bins["accuracy"], bins["ideal"], atol=0.05)
    # ...and an over-confident one (scores x3) falls below it at large differences
    over = frame.copy()
    over[["chosen_score", "rejected_score", "score_diff"]] *= 3
    over_bins = reward.calibration_bins(over, 40)
    middle = over_bins[(over_bins["ideal"] > 0.6) & (over_bins["ideal"] < 0.97)]
    assert len(middle) >= 2
    assert (middle["accuracy"] < middle["ideal"] - 0.03).all()


def test_accuracy_breakdown_table():
    frame = _calibrated_frame(2000)
    rows = reward.accuracy_breakdown(frame, "validation")
    keyed = {(r["group"], r["key"]): r for r in rows}
    assert keyed[("accuracy", "overall")]["value"] == pytest.approx(float(frame["correct"].mean()))
    assert keyed[("accuracy by batch", "batch10")]["n"] == 1000
    assert keyed[("accuracy by confidence", "9")]["value"] == pytest.approx(float(frame["correct"][8::9].mean()))
    scores = np.concatenate([frame["chosen_score"], frame["rejected_score"]])
    assert keyed[("reward", "max")]["value"] == pytest.approx(float(scores.max()))
    assert keyed[("reward", "std")]["value"] == pytest.approx(float(scores.std()))
    assert keyed[("pairs", "identical_texts")]["value"] == pytest.approx(0.1)
    assert "| validation | accuracy | overall |" in records.reward_table_markdown(rows)
    # the 95% Wilson interval of each accuracy: it holds the value, and at n = 2000 its half-width is
    # close to the normal approximation 1.96 * sqrt(p (1 - p) / n)
    overall = keyed[("accuracy", "overall")]
    p, n = overall["value"], overall["n"]
    assert overall["ci_low"] < p < overall["ci_high"]
    half = 1.96 * np.sqrt(p * (1 - p) / n)
    assert (overall["ci_high"] - overall["ci_low"]) / 2 == pytest.approx(half, rel=0.02)
    small = keyed[("accuracy by confidence", "9")]
    assert small["ci_high"] - small["ci_low"] > overall["ci_high"] - overall["ci_low"]  # fewer pairs, wider


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_smoke_run_on_builtin_task(synthetic_task, tmp_path):
    """One tiny training run (the base model stands in for the SFT model: same architecture), then the
    saved model is loaded like ppo.py would load it and the references score mean ~0 through get_reward."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out_dir = tmp_path / "rm"
    runs = tmp_path / "runs"
    cmd = [
        sys.executable, os.path.join(ROOT, "reward.py"),
        "--sft_model_path", synthetic_task["base_model"],
        "--preference_dataset", synthetic_task["preference"],
        "--query_dataset", synthetic_task["sft"],
        "--output_dir", str(out_dir), "--run_dir_root", str(runs), "--run_name", "smoke",
        "--total_episodes", "64", "--total_batch_size", "16", "--local_micro_batch_size", "8",
        "--lr", "1e-4", "--num_eval_samples", "48", "--num_normalization_samples", "32",
        "--eval_every", "2",
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = runs / "smoke"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0.0 <= summary["eval/accuracy"] <= 1.0
    assert summary["eval/validation/accuracy"] == summary["eval/accuracy"]
    assert summary["num_updates"] == 4
    assert summary["budget/updates"] == 4 and summary["budget/pairs_read"] == 64  # the budget as spent
    assert summary["left_right_pad_diff"] < 1e-3  # Detail 14: almost identical
    for name in ("eval_table.md", "eval_table.csv", "calibration.png", "reward_logits.png", "samples.csv",
                 "metrics.jsonl", "args.json", "samples/step_000002.csv"):
        assert (run_dir / name).exists(), name
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "train/loss" in m] == [1, 2, 3, 4]
    # each update's wall time (issue 51), logged with it: a part of the whole run's
    assert all(0 < m["time/update_s"] < summary["wall_time_s"] for m in metrics if "train/loss" in m)
    # the pairwise metrics carry dpo.py's names (one vocabulary across the scripts)
    train = next(m for m in metrics if "train/loss" in m)
    assert {"train/rewards/chosen", "train/rewards/rejected", "train/rewards/margins", "train/rewards/accuracy",
            "train/lr", "train/epoch", "train/tokens_per_s"} <= set(train), sorted(train)
    assert train["train/rewards/margins"] == pytest.approx(
        train["train/rewards/chosen"] - train["train/rewards/rejected"])
    assert not {"lr", "epoch", "tokens_per_s", "train/accuracy", "train/chosen_rewards"} & set(train)
    samples = pd.read_csv(run_dir / "samples.csv")
    assert {"query", "response", "reference", "score", "response_token_len", "has_eos"} <= set(samples.columns)
    assert samples["has_eos"].all()  # every preference response of the prepared data ends with EOS

    # the saved RM: a plain sequence-classification model whose references score mean 0 (Detail 15)
    model = AutoModelForSequenceClassification.from_pretrained(str(out_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    assert model.config.pad_token_id == tokenizer.pad_token_id != tokenizer.eos_token_id
    bias = model.config.reward_normalization_bias
    assert bias == pytest.approx(summary["reference_reward_mean_before_normalization"])
    assert bias != 0.0
    references = checks.load_split(synthetic_task["sft"], "train").select(range(32))
    rows = torch.tensor(references["query_reference_response_token"])
    with torch.no_grad():
        _, scores, _ = reward.get_reward(model, rows, tokenizer.pad_token_id, 0)
    assert float(scores.mean()) == pytest.approx(0.0, abs=1e-3 + 1e-3 * abs(bias))

    # the README's snippet: score one (query, response) pair with the library's own forward
    pair = checks.load_split(synthetic_task["preference"], "validation")[0]
    query, response = pair["query"], pair["chosen"]  # response = " " + summary (Detail 3)
    ids = tokenizer.encode(query) + tokenizer.encode(response) + [tokenizer.eos_token_id]
    with torch.no_grad():
        score = model(input_ids=torch.tensor([ids])).logits[0, 0]
    assert ids == pair["query_chosen_token"][: pair["query_chosen_token_len"]]
    with torch.no_grad():
        _, expected, _ = reward.get_reward(model, torch.tensor([pair["query_chosen_token"]]), tokenizer.pad_token_id, 0)
    assert float(score) == pytest.approx(float(expected[0]), abs=1e-5)


# ------------------------------------------------------------------------------------------------
# Reliability (issue #13): data position, resume after SIGKILL, non-finite guard, output-folder ownership
# ------------------------------------------------------------------------------------------------
def rm_command(task: dict, preference: str, tmp_path, run_name: str, output_dir, *extra: str) -> list:
    return [
        sys.executable, os.path.join(ROOT, "reward.py"),
        "--sft_model_path", task["base_model"], "--preference_dataset", preference, "--query_dataset", task["sft"],
        "--output_dir", str(output_dir), "--run_dir_root", str(tmp_path / "runs"), "--run_name", run_name,
        "--total_batch_size", "16", "--local_micro_batch_size", "8", "--lr", "1e-4",
        "--num_eval_samples", "16", "--num_normalization_samples", "16", "--local_eval_batch_size", "16", *extra,
    ]


def prepared_loader(num_rows: int, batch_size: int, seed: int):
    """A train DataLoader prepared exactly as reward.py prepares it (seedable sampler, its own generator)."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True,
                                                                                  data_seed=seed))
    loader = torch.utils.data.DataLoader([{"row": i} for i in range(num_rows)], batch_size=batch_size, shuffle=True,
                                         drop_last=True, generator=torch.Generator().manual_seed(seed))
    return accelerator.prepare(loader)


def test_resumed_data_position_gives_the_uninterrupted_batches():
    """The data position after resume: skipping k micro batches, wherever k falls (inside the first epoch, on an
    epoch boundary, inside a later epoch), yields exactly the batches an uninterrupted run reads after its k-th."""
    it = reward.resumable_micro_batches(prepared_loader(37, 4, seed=5), 0)  # 9 micro batches per epoch
    uninterrupted = [next(it)["row"].tolist() for _ in range(30)]
    epochs = [sorted(sum(uninterrupted[e * 9 : (e + 1) * 9], [])) for e in range(3)]
    assert all(len(set(rows)) == 36 for rows in epochs)  # each epoch is a permutation (one row dropped)
    assert uninterrupted[:9] != uninterrupted[9:18]  # and the shuffle differs from epoch to epoch
    for k in (1, 4, 8, 9, 10, 17, 22):
        torch.manual_seed(1000 + k)  # the global RNG of a resumed process is elsewhere: it must not matter
        it = reward.resumable_micro_batches(prepared_loader(37, 4, seed=5), k)
        assert [next(it)["row"].tolist() for _ in range(30 - k)] == uninterrupted[k:], k
    other_seed = reward.resumable_micro_batches(prepared_loader(37, 4, seed=6), 0)
    assert next(other_seed)["row"].tolist() != uninterrupted[0]


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_weights_and_metrics(synthetic_task, short_preference, tmp_path):
    """SIGKILL after the update-2 checkpoint (inside the first epoch), then --resume: the model (trunk, head and
    Detail 15 shift), metrics.jsonl, summary.json and the evaluation table equal an uninterrupted run's."""
    # 3 epochs of 40 pairs = 7 updates of 16 (update 3 spans epochs 1 and 2); evaluation at 3 and 6
    flags = ["--num_train_epochs", "3", "--checkpoint_every", "2", "--eval_every", "3"]
    run_ok(rm_command(synthetic_task, short_preference, tmp_path, "full", tmp_path / "full", *flags), cwd=ROOT, env=ENV)

    command = rm_command(synthetic_task, short_preference, tmp_path, "cut", tmp_path / "cut", *flags)
    kill_after_checkpoint(command, tmp_path / "runs" / "cut" / "checkpoints" / "update_000002", cwd=ROOT, env=ENV,
                          timeout=240)
    assert not (tmp_path / "cut" / "model.safetensors").exists()  # killed before its final save

    resumed = run_ok(command + ["--resume"], cwd=ROOT, env=ENV)
    assert "resumed from" in resumed.stdout + resumed.stderr

    assert_same_safetensors(tmp_path / "full" / "model.safetensors", tmp_path / "cut" / "model.safetensors")
    runs = tmp_path / "runs"
    rows = {name: [without_timing(json.loads(line)) for line in open(runs / name / "metrics.jsonl")]
            for name in ("full", "cut")}
    assert [r["step"] for r in rows["full"]] == [1, 2, 3, 3, 4, 5, 6, 6, 7, 7]  # train rows and evaluations
    assert rows["cut"] == rows["full"]
    summaries = {name: without_timing(json.load(open(runs / name / "summary.json"))) for name in ("full", "cut")}
    assert summaries["cut"] == summaries["full"]
    assert summaries["full"]["reward_normalization_bias"] != 0.0  # the post-training steps ran after the resume
    assert (runs / "cut" / "eval_table.csv").read_text() == (runs / "full" / "eval_table.csv").read_text()
    # only the newest checkpoint is kept (--checkpoint_keep 1), and no temporary folder is left behind
    assert os.listdir(runs / "cut" / "checkpoints") == ["update_000006"]


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(synthetic_task, short_preference, tmp_path):
    """An absurd learning rate overflows the weights: the guard names the update and the quantities, the final
    model is not written, and the checkpoint holds the finite weights after the update before."""
    result = subprocess.run(
        rm_command(synthetic_task, short_preference, tmp_path, "nan", tmp_path / "model", "--total_episodes", "64",
                   "--lr", "1e30"),
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("reward.py: error: update 2: train/loss"), last_line
    assert not (tmp_path / "model" / "model.safetensors").exists()
    assert_last_good_checkpoint(tmp_path / "runs" / "nan" / "checkpoints", 1)


@pytest.mark.slow
def test_the_fallback_checkpoint_is_the_ordinary_one_and_resumes_alike(synthetic_task, short_preference, tmp_path):
    """A NaN planted in the guarded loss of update 3's second micro batch, the first of epoch 2 (after the first micro
    batch's backward, its tokens counted, and a new epoch of the data begun): the run stops with the fallback
    checkpoint of update 2, which holds what an uninterrupted run's ordinary checkpoint of update 2 holds, and the
    run resumed from it ends with the uninterrupted run's model, metrics, summary and evaluation table."""
    # 3 epochs of 40 pairs = 7 updates of 2 micro batches of 8 (update 3 spans epochs 1 and 2); evaluation at 3 and 6
    flags = ["--num_train_epochs", "3", "--eval_every", "3"]
    run_ok(rm_command(synthetic_task, short_preference, tmp_path, "full", tmp_path / "full", *flags,
                      "--checkpoint_every", "1", "--checkpoint_keep", "0"), cwd=ROOT, env=ENV)
    command = rm_command(synthetic_task, short_preference, tmp_path, "planted", tmp_path / "planted", *flags,
                         "--checkpoint_every", "0")
    result = subprocess.run(with_nan_at(command, update=3, call=2), cwd=ROOT, env=ENV, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("reward.py: error: update 3: train/loss"), last_line
    runs = tmp_path / "runs"
    assert_last_good_checkpoint(runs / "planted" / "checkpoints", 2)
    assert_same_checkpoint(runs / "full" / "checkpoints" / "update_000002",
                           runs / "planted" / "checkpoints" / "update_000002")

    run_ok(command + ["--resume"], cwd=ROOT, env=ENV)
    assert_same_safetensors(tmp_path / "full" / "model.safetensors", tmp_path / "planted" / "model.safetensors")
    rows = {name: [without_timing(json.loads(line)) for line in open(runs / name / "metrics.jsonl")]
            for name in ("full", "planted")}
    assert [r["step"] for r in rows["full"]] == [1, 2, 3, 3, 4, 5, 6, 6, 7, 7] and rows["planted"] == rows["full"]
    summaries = {name: without_timing(json.load(open(runs / name / "summary.json"))) for name in ("full", "planted")}
    assert summaries["planted"] == summaries["full"]
    assert (runs / "planted" / "eval_table.csv").read_text() == (runs / "full" / "eval_table.csv").read_text()


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_output_dir_of_another_run_is_refused(synthetic_task, short_preference, tmp_path):
    """An --output_dir holding another run's model fails at once with the fix; --overwrite_output_dir takes it."""
    output_dir = tmp_path / "rm"
    output_dir.mkdir()
    (output_dir / "run.json").write_text(json.dumps({"run_name": "someone_else"}))
    (output_dir / "model.safetensors").write_bytes(b"another run's weights")
    command = rm_command(synthetic_task, short_preference, tmp_path, "mine", output_dir, "--total_episodes", "16")
    refused = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0
    message = refused.stderr.strip().splitlines()[-1]
    assert message.startswith("reward.py: error: --output_dir") and "'someone_else'" in message, message
    assert "--overwrite_output_dir" in message
    assert (output_dir / "model.safetensors").read_bytes() == b"another run's weights"  # untouched
    assert not (tmp_path / "runs" / "mine" / "metrics.jsonl").exists()  # refused before any training

    accepted = subprocess.run(command + ["--overwrite_output_dir"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                              timeout=300)
    assert accepted.returncode == 0, accepted.stderr[-3000:]
    assert json.loads((output_dir / "run.json").read_text()) == {"run_name": "mine", "complete": True}
    from transformers import AutoModelForSequenceClassification

    assert AutoModelForSequenceClassification.from_pretrained(str(output_dir)).config.num_labels == 1


# ------------------------------------------------------------------------------------------------
# Bad input: data tokenized by another tokenizer than the model's (issue #23)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def foreign_task(synthetic_task, tmp_path_factory) -> dict:
    """The built-in task's raw rows prepared with another tokenizer: a 512-token BPE trained on the same text. Every
    id it writes is also a valid id of the base model's larger vocabulary, so training on it raises no error."""
    from data import prepare, synthetic

    root = tmp_path_factory.mktemp("foreign_task")
    raw = os.path.join(synthetic_task["root"], "raw")
    texts = []
    for name in ("sft/train.jsonl", "comparisons/train.jsonl"):
        with open(os.path.join(raw, name)) as f:
            for line in f:
                row = json.loads(line)
                texts += [row["summary"]] if "summary" in row else [s["text"] for s in row["summaries"]]
                texts += [row["post"]] if "post" in row else [row["info"]["post"]]
    tokenizer_dir = str(root / "tokenizer")
    synthetic.train_tokenizer(texts, vocab_size=512).save_pretrained(tokenizer_dir)
    prepare.main(prepare.Args(task="tldr", output_dir=str(root / "data"), base_model=tokenizer_dir, plots=False,
                              sft_data=os.path.join(raw, "sft"), preference_data=os.path.join(raw, "comparisons"),
                              query_length=256, sft_response_length=48, rm_response_length=64, cnndm_query_length=256,
                              cnndm_response_length=64))
    return {"tokenizer": tokenizer_dir, "sft": str(root / "data" / "sft"),
            "preference": str(root / "data" / "preference")}


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_data_of_another_tokenizer_is_refused_before_the_output_folder(synthetic_task, foreign_task, tmp_path):
    """reward.py on preference data of a smaller tokenizer: one error naming the data, both tokenizers and the fix,
    before the output folder is claimed (instead of a model trained on ids that mean other tokens)."""
    from transformers import AutoTokenizer

    base = synthetic_task["base_model"]
    assert (len(AutoTokenizer.from_pretrained(foreign_task["tokenizer"])) == 512
            < len(AutoTokenizer.from_pretrained(base)))
    command = rm_command(synthetic_task, foreign_task["preference"], tmp_path, "foreign", tmp_path / "rm",
                         "--total_episodes", "16")
    result = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    message = result.stderr.strip().splitlines()[-1]
    assert message == (
        f"reward.py: error: {foreign_task['preference']} split 'train' was tokenized by the tokenizer of "
        f"{foreign_task['tokenizer']}, not by the one of {base}: vocab_size 512 vs "
        f"{len(AutoTokenizer.from_pretrained(base))} (data vs model); its token ids would be read as other tokens. "
        f"Prepare the data again with this model's tokenizer: python data/prepare.py --base_model {base} "
        "(with the task's other flags)"), message
    assert not (tmp_path / "rm").exists() and not (tmp_path / "runs" / "foreign" / "metrics.jsonl").exists()


def test_the_fingerprint_in_the_data_is_compared_with_the_model_tokenizer(synthetic_task):
    """The record data/prepare.py writes: equal for the model it was made with, and any difference is named."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    base = synthetic_task["base_model"]
    tokenizer = AutoTokenizer.from_pretrained(base)
    for name in ("sft", "preference"):
        for split, data in load_from_disk(synthetic_task[name]).items():
            record = json.loads(data.info.description)["tokenizer"]
            assert record == {"name_or_path": base, **checks.tokenizer_fingerprint(tokenizer)}
            checks.check_data_tokenizer(data, tokenizer, base, f"{name}/{split}")  # its own tokenizer: no error
    data = load_from_disk(synthetic_task["preference"])["train"]
    for change, expected in [({"pad_token_id": 0}, "pad_token_id 0 vs 1 (data vs model)"),
                             ({"vocab_sha256": "0" * 64}, "same size, other tokens (data vs model)")]:
        data.info.description = json.dumps({"tokenizer": {**record, **change}})
        with pytest.raises(ValueError, match="^" + re.escape(f"pref was tokenized by the tokenizer of {base}, not by "
                                                             f"the one of {base}: {expected}")):
            checks.check_data_tokenizer(data, tokenizer, base, "pref")


def test_data_without_a_fingerprint_is_checked_by_its_ids(synthetic_task):
    """Data with no record (a hub dataset): every id below the vocabulary size, [PAD] in the padding, EOS at the end
    of the responses. Prepared data passes; each kind of foreign id is named with its column (and row)."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    base = synthetic_task["base_model"]
    tokenizer = AutoTokenizer.from_pretrained(base)
    vocab_size = len(tokenizer)
    for name in ("sft", "preference"):
        for split, data in load_from_disk(synthetic_task[name]).items():
            data.info.description = ""
            checks.check_data_tokenizer(data, tokenizer, base, f"{name}/{split}")  # no false alarm
    data = load_from_disk(synthetic_task["preference"])["train"].select(range(16))
    data.info.description = ""

    def edit(column, fn):
        out = data.map(lambda row, i: {column: fn(row, i)}, with_indices=True)
        out.info.description = ""
        return out

    past_the_vocabulary = edit("query_chosen_token", lambda r, i: [vocab_size + 100] + r["query_chosen_token"][1:]
                               if i == 2 else r["query_chosen_token"])
    with pytest.raises(ValueError, match=re.escape(f"pref: 'query_chosen_token' holds the token id {vocab_size + 100}, "
                                                   f"but the tokenizer of {base} has {vocab_size} tokens")):
        checks.check_data_tokenizer(past_the_vocabulary, tokenizer, base, "pref")
    row = next(i for i in range(16) if data[i]["query_chosen_token_len"] < len(data[i]["query_chosen_token"]))
    other_pad = edit("query_chosen_token", lambda r, i: r["query_chosen_token"][: r["query_chosen_token_len"]]
                     + [5] * (len(r["query_chosen_token"]) - r["query_chosen_token_len"]) if i == row
                     else r["query_chosen_token"])
    with pytest.raises(ValueError, match=re.escape(f"pref row {row}: 'query_chosen_token' is padded with the id 5, but "
                                                   f"the tokenizer of {base} pads with {tokenizer.pad_token_id}")):
        checks.check_data_tokenizer(other_pad, tokenizer, base, "pref")
    other_eos = edit("chosen_token", lambda r, i: r["chosen_token"][: r["chosen_token_len"] - 1] + [7]
                     + r["chosen_token"][r["chosen_token_len"]:])
    with pytest.raises(ValueError, match=re.escape(f"pref: no response in the first 16 rows of 'chosen_token' "
                                                   f"ends with the EOS id {tokenizer.eos_token_id} of the tokenizer "
                                                   f"of {base}")):
        checks.check_data_tokenizer(other_eos, tokenizer, base, "pref")
