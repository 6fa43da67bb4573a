"""Tests of sft.py: the label masking (Detail 3), the loss math, fixed-length sampling (Detail 23) and a
subprocess smoke run on the built-in task."""

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import (
    ENV,
    assert_last_good_checkpoint,
    assert_same_checkpoint,
    assert_same_safetensors,
    kill_after_checkpoint,
    load_script,
    run_ok,
    tiny_causal_lm,
    with_nan_at,
    without_timing,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE_COLUMNS = ["query", "response", "reference", "score", "response_token_len", "has_eos"]

PAD, EOS = 1, 2




sft = load_script("sft")
from rlhf_utils import checks  # noqa: E402  (the input checks the scripts import)


@pytest.mark.parametrize("kind", ["hidden_dropout", "attention_dropout"])
def test_detail7_disable_dropout_makes_training_forwards_deterministic(kind):
    """GPT-NeoX applies attention dropout from a float attribute, not an nn.Dropout module: both kinds must be
    switched off, or two training-mode forwards of the same batch differ."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=64, **{kind: 0.5})
    config._attn_implementation = "eager"
    model = GPTNeoXForCausalLM(config).train()
    tokens = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
    assert not torch.allclose(model(tokens).logits, model(tokens).logits)  # dropout is live before
    sft.disable_dropout(model)
    assert torch.equal(model(tokens).logits, model(tokens).logits)


def test_make_labels_masks_every_pad():
    tokens = torch.tensor([[5, 6, 7, EOS, PAD, PAD], [5, 8, 9, 10, 11, EOS]])
    labels = sft.sft_labels(tokens, PAD)
    assert labels.tolist() == [[5, 6, 7, EOS, -100, -100], [5, 8, 9, 10, 11, EOS]]
    assert tokens[0, -1] == PAD  # the input is not modified in place


def test_sft_loss_matches_hand_computation():
    model = tiny_causal_lm(pad_token_id=PAD, eos_token_id=EOS)
    # query [5, 6, 7], response [8, 9] + EOS, right-padded; the response-label row has the query as pads
    tokens = torch.tensor([[5, 6, 7, 8, 9, EOS, PAD, PAD]])
    response_label_tokens = torch.tensor([[PAD, PAD, PAD, 8, 9, EOS, PAD, PAD]])
    with torch.no_grad():
        loss, count = sft.next_token_loss(model, tokens, sft.sft_labels(response_label_tokens, PAD), PAD)
        logits = model(input_ids=tokens[:, :6]).logits[0]  # the unpadded sequence needs no mask
    log_probs = F.log_softmax(logits, dim=-1)
    # targets 8, 9, EOS sit at positions 3, 4, 5 and are predicted from positions 2, 3, 4
    expected = -(log_probs[2, 8] + log_probs[3, 9] + log_probs[4, EOS]) / 3
    assert count.item() == 3
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)

    with torch.no_grad():
        sequence_loss, sequence_count = sft.next_token_loss(model, tokens, sft.sft_labels(tokens, PAD), PAD)
    expected_sequence = -sum(log_probs[t - 1, tokens[0, t]] for t in range(1, 6)) / 5
    assert sequence_count.item() == 5
    torch.testing.assert_close(sequence_loss, expected_sequence, atol=1e-5, rtol=1e-5)


def test_appending_padding_leaves_the_loss_unchanged():
    model = tiny_causal_lm(pad_token_id=PAD, eos_token_id=EOS)
    tokens = torch.tensor([[5, 6, 7, 8, 9, EOS, PAD, PAD], [5, 6, 10, 11, 12, 13, 14, EOS]])
    more_padding = torch.cat([tokens, torch.full((2, 5), PAD)], dim=1)
    with torch.no_grad():
        loss, count = sft.next_token_loss(model, tokens, sft.sft_labels(tokens, PAD), PAD)
        padded_loss, padded_count = sft.next_token_loss(model, more_padding, sft.sft_labels(more_padding, PAD), PAD)
    assert count == padded_count == 5 + 7
    torch.testing.assert_close(loss, padded_loss, atol=1e-6, rtol=1e-6)


def test_eos_stays_a_target_only_with_a_distinct_pad():
    """Detail 3 by hand: the same reference padded with [PAD] or with EOS itself."""
    with_pad = torch.tensor([[5, 6, 7, 8, 9, EOS, PAD, PAD]])
    with_eos_as_pad = torch.tensor([[5, 6, 7, 8, 9, EOS, EOS, EOS]])
    assert (sft.sft_labels(with_pad, PAD) == EOS).sum() == 1
    assert (sft.sft_labels(with_eos_as_pad, EOS) == EOS).sum() == 0


def test_fixed_length_sampling_keeps_going_past_eos():
    """Detail 23: exactly L new tokens come back even when EOS is sampled early, and EOS can be sampled."""
    model = tiny_causal_lm(pad_token_id=PAD, eos_token_id=EOS)
    with torch.no_grad():  # a constant final hidden state of ones: the logit of a token is its row sum
        model.gpt_neox.final_layer_norm.weight.zero_()
        model.gpt_neox.final_layer_norm.bias.fill_(1.0)
        model.get_output_embeddings().weight[EOS] = 0.1  # logit 3.2: EOS has p ~ 0.6 at every step
    length = 12
    config = sft.sampling_config(SimpleNamespace(response_length=length), SimpleNamespace(pad_token_id=PAD), 1.0)
    queries = torch.tensor([[PAD, PAD, 5, 6, 7], [4, 5, 6, 7, 8]] * 8)  # left-padded
    torch.manual_seed(0)
    query_responses = sft.generate(model, queries, PAD, config)
    assert query_responses.shape == (16, 5 + length)
    responses = query_responses[:, 5:]
    assert not (responses == PAD).any()  # [PAD] is never sampled
    assert torch.equal(query_responses[:, :5], queries)
    # EOS was sampled somewhere before the last position, and sampling went on after it
    eos_positions = sft.first_true_indices(responses == EOS)
    assert (eos_positions < length - 1).any()
    after_first_eos = torch.arange(length).unsqueeze(0) > eos_positions.unsqueeze(1)
    # generation did not stop (it would fill [PAD]): real tokens follow the first EOS
    assert (after_first_eos & (responses != EOS) & (responses != PAD)).any()
    truncated = sft.truncate_response(EOS, PAD, responses)
    row = int(torch.argmin(eos_positions))
    assert truncated[row, eos_positions[row]] == EOS
    assert (truncated[row, eos_positions[row] + 1 :] == PAD).all()


def test_generation_config_does_not_inherit_eos_stopping():
    config = sft.sampling_config(SimpleNamespace(response_length=7), SimpleNamespace(pad_token_id=PAD), 0.01)
    assert config.eos_token_id == [] and config.min_new_tokens is None
    assert config.max_new_tokens == 7 and config.do_sample and config.top_k == 0 and config.top_p == 1.0
    assert config.temperature == 0.01 and config.pad_token_id == PAD and config.suppress_tokens == [PAD]


def test_gradient_accumulation_flag_is_checked_against_the_batch_sizes():
    """--gradient_accumulation_steps checks the batch arithmetic and never overrides it: None takes the derived
    value, the same value passes, another one is refused with the arithmetic that gives the right one."""
    args = SimpleNamespace(gradient_accumulation_steps=None, total_batch_size=128, local_micro_batch_size=16)
    checks.check_gradient_accumulation(args, 4, 2)
    args.gradient_accumulation_steps = 4
    checks.check_gradient_accumulation(args, 4, 2)
    args.gradient_accumulation_steps = 8
    with pytest.raises(ValueError, match=re.escape("--gradient_accumulation_steps 8 does not match total_batch_size "
                                                   "128 / (2 processes x 1 minibatches x 16 micro batch) = 4")):
        checks.check_gradient_accumulation(args, 4, 2)


def test_count_updates_uses_full_batches_only():
    args = SimpleNamespace(total_episodes=None, num_train_epochs=2, total_batch_size=16)
    assert sft.count_updates(args, 40) == 5  # two passes over 40 rows: 80 rows, 5 full batches of 16
    args.total_episodes = 47
    assert sft.count_updates(args, 40) == 2  # --total_episodes wins over the epochs; the last 15 rows are dropped
    args.total_episodes = 15
    with pytest.raises(ValueError, match="15 episodes give no full batch of 16"):
        sft.count_updates(args, 40)


def test_batch_arithmetic_is_exact():
    assert sft.exact_div(128, 16) == 8
    with pytest.raises(ValueError, match="not divisible"):
        sft.exact_div(128, 48)


def task_paths(request):
    """The session fixture of tests/conftest.py, or the full built-in task while conftest is not there."""
    if "synthetic_task" in request.fixturenames or os.path.exists(os.path.join(REPO_ROOT, "tests", "conftest.py")):
        return request.getfixturevalue("synthetic_task")
    root = os.path.join(REPO_ROOT, "artifacts", "synthetic")
    if not os.path.exists(os.path.join(root, "task.json")):
        pytest.skip("the built-in task is not prepared (python data/prepare.py --task synthetic)")
    return {"root": root, "base_model": os.path.join(root, "base_model"), "sft": os.path.join(root, "sft"),
            "task_json": os.path.join(root, "task.json")}


def test_eos_labels_on_the_prepared_data(request):
    """Detail 3 on the built-in task: every response label row of the [PAD] data ends with an EOS target."""
    paths = task_paths(request)
    tokenizer = AutoTokenizer.from_pretrained(paths["base_model"])
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    rows = checks.load_split(paths["sft"], "train").with_format("torch")[:16]  # dict of (16, T) tensors
    for column in ("query_reference_response_token", "query_reference_response_token_response_label"):
        labels = sft.sft_labels(rows[column], tokenizer.pad_token_id)
        assert ((labels == tokenizer.eos_token_id).sum(dim=1) == 1).all()
    # the same rows re-padded with EOS (what `data/prepare.py --pad_token eos` writes) lose that target
    eos_padded = rows["query_reference_response_token_response_label"].masked_fill(
        rows["query_reference_response_token_response_label"] == tokenizer.pad_token_id, tokenizer.eos_token_id
    )
    assert (sft.sft_labels(eos_padded, tokenizer.eos_token_id) == tokenizer.eos_token_id).sum() == 0


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_smoke_run_saves_a_loadable_model(request, tmp_path):
    paths = task_paths(request)
    with open(paths["task_json"]) as f:
        task = json.load(f)
    output_dir = tmp_path / "model"
    command = [
        sys.executable, os.path.join(REPO_ROOT, "sft.py"),
        "--base_model", paths["base_model"],
        "--query_dataset", paths["sft"],
        "--response_length", str(task["sft_response_length"]),
        "--output_dir", str(output_dir),
        "--run_dir_root", str(tmp_path / "runs"),
        "--run_name", "smoke",
        "--total_episodes", "32",
        "--total_batch_size", "16",
        "--local_micro_batch_size", "8",
        "--lr", "1e-3",
        "--eval_every", "1",
        "--num_eval_samples", "8",
        "--local_eval_batch_size", "4",
    ]
    result = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]

    run_dir = tmp_path / "runs" / "smoke"
    assert os.path.exists(output_dir / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(output_dir)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert model.get_input_embeddings().weight.size(0) >= len(tokenizer)

    samples = pd.read_csv(run_dir / "samples.csv")
    assert list(samples.columns) == SAMPLE_COLUMNS
    assert len(samples) == 8
    assert samples["score"].isna().all()
    assert samples["response_token_len"].between(1, task["sft_response_length"]).all()
    assert (samples["response_token_len"][~samples["has_eos"]] == task["sft_response_length"]).all()
    # one table per evaluation: after update 1 and the final one after update 2
    assert sorted(os.listdir(run_dir / "samples")) == ["step_000001.csv", "step_000002.csv"]

    with open(run_dir / "summary.json") as f:
        summary = json.load(f)
    for key in ("eval/loss", "eval/rouge1", "eval/rouge2", "eval/rougeL", "eval/eos_rate",
                "eval/response_token_len_mean", "train/tokens_per_s", "wall_time_s"):
        assert isinstance(summary[key], (int, float)), key
    assert 0.0 <= summary["eval/eos_rate"] <= 1.0
    assert summary["train/updates"] == 2
    assert summary["budget/updates"] == 2 and summary["budget/rows_read"] == 2 * json.load(
        open(run_dir / "args.json"))["total_batch_size"]  # the budget as spent
    with open(run_dir / "metrics.jsonl") as f:
        logged = [json.loads(line) for line in f]
    assert [row["step"] for row in logged if "train/loss" in row] == [1, 2]
    # each update's wall time (issue 51), logged with it: a part of the whole run's
    assert all(0 < row["time/update_s"] < summary["wall_time_s"] for row in logged if "train/loss" in row)
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(run_dir))


# ---------------------------------------------------------------------------------------------
# Reliability (issue #13): resume after SIGKILL, non-finite guard, bad input that fails clearly
# ---------------------------------------------------------------------------------------------
def sft_command(paths: dict, tmp_path, run_name: str, output_dir, *extra: str) -> list:
    return [
        sys.executable, os.path.join(REPO_ROOT, "sft.py"),
        "--base_model", paths["base_model"], "--query_dataset", paths["sft"],
        "--response_length", str(paths["task"]["sft_response_length"]),
        "--output_dir", str(output_dir), "--run_dir_root", str(tmp_path / "runs"), "--run_name", run_name,
        "--total_batch_size", "16", "--local_micro_batch_size", "8", "--lr", "1e-3",
        "--num_eval_samples", "16", "--local_eval_batch_size", "8", *extra,
    ]


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_weights_and_metrics(synthetic_task, tmp_path):
    """SIGKILL after the update-6 checkpoint, then --resume: weights, metrics.jsonl and summary.json equal an
    uninterrupted run's (Adam moments, schedule, data position and RNG all restored)."""
    flags = ["--total_episodes", "320", "--checkpoint_every", "3", "--eval_every", "4"]  # 20 updates
    run_ok(sft_command(synthetic_task, tmp_path, "full", tmp_path / "full", *flags), cwd=tmp_path, env=ENV)

    command = sft_command(synthetic_task, tmp_path, "cut", tmp_path / "cut", *flags)
    kill_after_checkpoint(command, tmp_path / "runs" / "cut" / "checkpoints" / "update_000006", cwd=tmp_path, env=ENV,
                          timeout=240)
    assert not (tmp_path / "cut" / "model.safetensors").exists()  # killed before its final save

    resumed = run_ok(command + ["--resume"], cwd=tmp_path, env=ENV)
    assert "resumed from" in resumed.stdout + resumed.stderr

    assert_same_safetensors(tmp_path / "full" / "model.safetensors", tmp_path / "cut" / "model.safetensors")
    rows = {name: [without_timing(json.loads(line)) for line in open(tmp_path / "runs" / name / "metrics.jsonl")]
            for name in ("full", "cut")}
    assert len(rows["full"]) == 20 + 5 and rows["cut"] == rows["full"]  # 20 train rows, evals at 4, 8, 12, 16, 20
    summaries = {name: without_timing(json.load(open(tmp_path / "runs" / name / "summary.json")))
                 for name in ("full", "cut")}
    assert summaries["cut"] == summaries["full"]
    # only the newest checkpoint is kept (--checkpoint_keep 1), and no temporary folder is left behind
    assert os.listdir(tmp_path / "runs" / "cut" / "checkpoints") == ["update_000018"]


def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(synthetic_task, tmp_path):
    """An absurd learning rate drives the weights to overflow: the guard names the update and the quantity,
    the final model is not written, and the checkpoint holds the finite weights of the update before."""
    result = subprocess.run(
        sft_command(synthetic_task, tmp_path, "nan", tmp_path / "model", "--total_episodes", "64", "--lr", "1e30"),
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("sft.py: error: update 2: train/loss is not finite"), last_line
    assert not (tmp_path / "model" / "model.safetensors").exists()
    assert assert_last_good_checkpoint(tmp_path / "runs" / "nan" / "checkpoints", 1)["num_updates"] == 4


@pytest.mark.slow
def test_the_fallback_checkpoint_is_the_ordinary_one_and_resumes_alike(synthetic_task, tmp_path):
    """A NaN planted in the guarded loss of update 3's second micro batch (after the first one's backward, and after
    accelerate counted it): the run stops with the fallback checkpoint of update 2, which holds what an uninterrupted
    run's ordinary checkpoint of update 2 holds, and the run resumed from it ends with the uninterrupted run's
    weights, metrics, samples and summary."""
    flags = ["--total_episodes", "96", "--eval_every", "2"]  # 6 updates of 2 micro batches, evaluations at 2 and 4
    run_ok(sft_command(synthetic_task, tmp_path, "full", tmp_path / "full", *flags, "--checkpoint_every", "1",
                       "--checkpoint_keep", "0"), cwd=tmp_path, env=ENV)
    command = sft_command(synthetic_task, tmp_path, "planted", tmp_path / "planted", *flags, "--checkpoint_every", "0")
    result = subprocess.run(with_nan_at(command, update=3, call=2), cwd=tmp_path, env=ENV, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("sft.py: error: update 3: train/loss is not finite"), last_line
    runs = tmp_path / "runs"
    assert_last_good_checkpoint(runs / "planted" / "checkpoints", 2)
    assert_same_checkpoint(runs / "full" / "checkpoints" / "update_000002",
                           runs / "planted" / "checkpoints" / "update_000002")

    run_ok(command + ["--resume"], cwd=tmp_path, env=ENV)
    assert_same_safetensors(tmp_path / "full" / "model.safetensors", tmp_path / "planted" / "model.safetensors")
    rows = {name: [without_timing(json.loads(line)) for line in open(runs / name / "metrics.jsonl")]
            for name in ("full", "planted")}
    assert len(rows["full"]) == 6 + 3 and rows["planted"] == rows["full"]  # 6 train rows, evaluations at 2, 4, 6
    summaries = {name: without_timing(json.load(open(runs / name / "summary.json"))) for name in ("full", "planted")}
    assert summaries["planted"] == summaries["full"]
    assert (runs / "planted" / "samples.csv").read_text() == (runs / "full" / "samples.csv").read_text()


def failing_run(paths: dict, tmp_path, *extra: str, **overrides) -> str:
    """Run sft.py with bad input; return the error's message after checking the error is raised by the project's
    own checks: an expected error (one `sft.py: error: ...` line, no traceback), or one raised in sft.py itself (the
    last traceback frame), not deep inside a library."""
    command = sft_command(paths, tmp_path, "bad", tmp_path / "model", "--total_episodes", "32", *extra)
    for flag, value in overrides.items():
        command[command.index(f"--{flag}") + 1] = str(value)
    result = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    frames = [line for line in result.stderr.splitlines() if line.strip().startswith("File ")]
    last = result.stderr.strip().splitlines()[-1]
    assert ((last.startswith("sft.py: error: ") and not frames)
            or (frames and "sft.py" in frames[-1])), result.stderr[-2000:]
    return re.sub(r"^(sft\.py: error|ValueError): ", "", last)  # the message


def test_dataset_missing_a_column_names_it(synthetic_task, tmp_path):
    from datasets import load_from_disk

    broken = tmp_path / "sft_missing"
    load_from_disk(synthetic_task["sft"]).remove_columns("query_token").save_to_disk(str(broken))
    message = failing_run(synthetic_task, tmp_path, query_dataset=broken)
    assert "'query_token'" in message and "data/prepare.py" in message


def test_dataset_with_a_row_of_another_length_names_the_row(synthetic_task, tmp_path):
    from datasets import load_from_disk

    broken = tmp_path / "sft_ragged"
    data = load_from_disk(synthetic_task["sft"])
    data["train"] = data["train"].map(lambda row, i: {"query_token": row["query_token"][:-1] if i == 5
                                                      else row["query_token"]},
                                      with_indices=True)
    data.save_to_disk(str(broken))
    message = failing_run(synthetic_task, tmp_path, query_dataset=broken)
    assert "row 5" in message and "'query_token'" in message


def test_tokenizer_padding_with_eos_is_refused(synthetic_task, tmp_path):
    import shutil

    model_dir = tmp_path / "eos_pad_model"
    shutil.copytree(synthetic_task["base_model"], model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(model_dir)
    message = failing_run(synthetic_task, tmp_path, base_model=model_dir)
    assert "distinct pad token" in message and "[PAD]" in message


def test_batch_sizes_that_do_not_divide_are_refused(synthetic_task, tmp_path):
    message = failing_run(synthetic_task, tmp_path, local_micro_batch_size=6)
    assert "16 is not divisible by 6" in message


def test_gradient_accumulation_flag_that_contradicts_the_batch_sizes_is_refused(synthetic_task, tmp_path):
    message = failing_run(synthetic_task, tmp_path, "--gradient_accumulation_steps", "3")
    assert message.startswith("--gradient_accumulation_steps 3 does not match total_batch_size 16"), message


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_output_dir_of_another_run_is_refused(synthetic_task, tmp_path):
    output_dir = tmp_path / "model"
    output_dir.mkdir()
    (output_dir / "run.json").write_text(json.dumps({"run_name": "someone_else"}))
    message = failing_run(synthetic_task, tmp_path)
    assert "'someone_else'" in message and "--overwrite_output_dir" in message
    (output_dir / "run.json").unlink()
    (output_dir / "notes.txt").write_text("not a model")  # any other content counts as another run's too
    assert "--overwrite_output_dir" in failing_run(synthetic_task, tmp_path)
