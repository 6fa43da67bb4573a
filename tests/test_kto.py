"""Tests of kto.py and of its data: the KTO loss and its reference point z0 against a worked example computed by
hand, the KL estimate on mismatched pairs, the paper's weight guidance, unpaired feedback from a jsonl file to a
prepared split (and the errors a bad row raises), the built-in raters' thumbs up / down, tiny end-to-end runs on
the built-in task with both kinds of feedback, and DeepSpeed ZeRO-2 on 2 CPU processes against 1 process."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from accelerate import Accelerator
from datasets import Dataset, load_from_disk

from conftest import (
    ENV,
    REPO_ROOT,
    assert_same_safetensors,
    kill_after_checkpoint,
    load_script,
    run_ok,
    tiny_causal_lm,
    without_timing,
)
from data import prepare, synthetic
from rlhf_utils.flags import check_kto_flags
from test_multiprocess import assert_same_run, run_probe, saved_weights

PAD, EOS = 1, 2
kto = load_script("kto")


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ------------------------------------------------------------------------------------------------
# The loss, worked by hand
# ------------------------------------------------------------------------------------------------
# Two desirable (D) and two undesirable (U) examples, beta 0.1, lambda_D 1.0, lambda_U 1.5.
#   sequence log-probs      policy   reference   r = policy - reference
#   D1                       -10       -12          2
#   D2                       -20       -19         -1
#   U1                       -15       -14         -1
#   U2                        -8       -11          3
# Mismatched pairs (each prompt with another example's completion): policy -30 -25 -28 -22, reference
# -31 -26 -27 -24, log-ratios 1, 1, -1, 2: the KL estimate is 3 / 4 = 0.75, so z0 = max(0, 0.75) = 0.75.
#   D1: 1.0 * (1 - sigmoid(0.1 * (2 - 0.75)))  = 1 - sigmoid(0.125)  = 1 - 0.531209 = 0.468791
#   D2: 1.0 * (1 - sigmoid(0.1 * (-1 - 0.75))) = 1 - sigmoid(-0.175) = sigmoid(0.175) = 0.543639
#   U1: 1.5 * (1 - sigmoid(0.1 * (0.75 + 1)))  = 1.5 * (1 - 0.543639)  = 0.684542
#   U2: 1.5 * (1 - sigmoid(0.1 * (0.75 - 3)))  = 1.5 * sigmoid(0.225)  = 1.5 * 0.556014 = 0.834021
#   mean: (0.468791 + 0.543639 + 0.684542 + 0.834021) / 4 = 0.632748
# With mismatched log-ratios -1, -2, 0.5, -0.5 instead the estimate is -0.75, clamped to z0 = 0:
#   D1: 1 - sigmoid(0.2) = 0.450166    D2: 1 - sigmoid(-0.1) = 0.524979
#   U1: 1.5 * (1 - sigmoid(0.1)) = 0.712531    U2: 1.5 * sigmoid(0.3) = 0.861664    mean 0.637335
POLICY, REFERENCE = [-10.0, -20.0, -15.0, -8.0], [-12.0, -19.0, -14.0, -11.0]
DESIRABLE = [True, True, False, False]
BETA, LAMBDA_D, LAMBDA_U = 0.1, 1.0, 1.5


def worked_example(policy_mismatched, ref_mismatched):
    policy = torch.tensor(POLICY, requires_grad=True)
    mismatched = torch.tensor(policy_mismatched, requires_grad=True)
    log_ratios = mismatched - torch.tensor(ref_mismatched)
    z0 = kto.reference_point(log_ratios.sum(), torch.tensor(4.0))
    losses, rewards = kto.kto_loss(policy, torch.tensor(REFERENCE), torch.tensor(DESIRABLE), z0, BETA, LAMBDA_D,
                                   LAMBDA_U)
    return policy, mismatched, z0, losses, rewards


def test_kto_loss_worked_example_by_hand():
    policy, mismatched, z0, losses, rewards = worked_example([-30.0, -25.0, -28.0, -22.0], [-31.0, -26.0, -27.0, -24.0])
    assert z0.item() == pytest.approx(0.75)
    assert losses.tolist() == pytest.approx([0.468791, 0.543639, 0.684542, 0.834021], abs=1e-6)
    assert losses.mean().item() == pytest.approx(0.632748, abs=1e-6)
    assert rewards.tolist() == pytest.approx([0.2, -0.1, -0.1, 0.3])  # beta * r, the implicit reward
    # z0 carries no gradient: the loss trains the matched log-probs only, never the mismatched pairs
    assert not z0.requires_grad
    losses.mean().backward()
    assert mismatched.grad is None
    # a desirable example's log-prob is pushed up, an undesirable one's down
    assert policy.grad[0] < 0 and policy.grad[1] < 0 and policy.grad[2] > 0 and policy.grad[3] > 0


def test_negative_kl_estimate_is_clamped_to_zero():
    _, _, z0, losses, _ = worked_example([-31.0, -28.0, -26.5, -24.5], [-30.0, -26.0, -27.0, -24.0])  # mean -0.75
    assert z0.item() == 0.0
    assert losses.tolist() == pytest.approx([0.450166, 0.524979, 0.712531, 0.861664], abs=1e-6)
    assert losses.mean().item() == pytest.approx(0.637335, abs=1e-6)


def test_kto_loss_detaches_a_reference_point_that_has_a_gradient():
    z0 = torch.tensor(0.5, requires_grad=True)
    losses, _ = kto.kto_loss(torch.tensor(POLICY, requires_grad=True), torch.tensor(REFERENCE), torch.tensor(DESIRABLE),
                             z0, BETA)
    losses.sum().backward()
    assert z0.grad is None
    # with the policy equal to the reference and z0 = 0 every example's loss is lambda * (1 - sigmoid(0)) = lambda / 2
    even, _ = kto.kto_loss(torch.zeros(4), torch.zeros(4), torch.tensor(DESIRABLE), torch.tensor(0.0), BETA, 2.0, 4.0)
    assert even.tolist() == [1.0, 1.0, 2.0, 2.0]


def test_feedback_balance_follows_the_papers_range():
    def args(d, u):
        return kto.Args(desirable_weight=d, undesirable_weight=u)

    labels = torch.tensor([True] * 30 + [False] * 70)
    ratio, warning = kto.feedback_balance(args(1.0, 1.0), labels)  # 30 / 70
    assert ratio == pytest.approx(30 / 70) and "outside [1, 4/3]" in warning
    assert "--desirable_weight 2.33" in warning  # 70 / 30 brings it to 1
    for d in (70 / 30, 1.3 * 70 / 30):  # ratio 1 and 1.3: inside
        assert kto.feedback_balance(args(d, 1.0), labels)[1] is None
    assert kto.feedback_balance(args(1.5 * 70 / 30, 1.0), labels)[1] is not None  # 1.5 > 4/3
    balanced = torch.tensor([True, False] * 10)  # preference pairs split in two: n_D = n_U
    assert kto.feedback_balance(args(1.0, 1.0), balanced) == (1.0, None)


def test_flags_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="--unpaired_dataset"):
        check_kto_flags(kto.Args(feedback="unpaired"))
    with pytest.raises(ValueError, match="at least 2"):
        check_kto_flags(kto.Args(local_micro_batch_size=1))
    for size in (2, 5):  # pairs: both halves of each pair in one micro batch, and at least 2 pairs for the KL estimate
        with pytest.raises(ValueError, match="even and at least 4"):
            check_kto_flags(kto.Args(local_micro_batch_size=size))
    check_kto_flags(kto.Args(feedback="unpaired", unpaired_dataset="thumbs", local_micro_batch_size=3))
    check_kto_flags(kto.Args())


# ------------------------------------------------------------------------------------------------
# Log-probs and the KL estimate on mismatched pairs
# ------------------------------------------------------------------------------------------------
def example_batch(queries, completions, labels, query_width=5, completion_width=5):
    """KTO examples: queries left-padded, completions (with EOS) right-padded, as data/prepare.py writes them."""
    return {
        "query_token": torch.tensor([[PAD] * (query_width - len(q)) + q for q in queries]),
        "completion_token": torch.tensor([c + [PAD] * (completion_width - len(c)) for c in completions]),
        "label": torch.tensor(labels),
    }


def test_example_logprobs_equal_the_sum_over_the_completion_of_an_unpadded_row():
    model = tiny_causal_lm(pad_token_id=PAD, eos_token_id=EOS)
    batch = example_batch([[5, 6, 7], [8, 9]], [[10, 11, EOS], [12, EOS]], [True, False])
    got = kto.example_logprobs(model, batch["query_token"], batch["completion_token"], PAD)
    for i, (query, completion) in enumerate((([5, 6, 7], [10, 11, EOS]), ([8, 9], [12, EOS]))):
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([query + completion])).logits[0].float(), -1)
        expected = sum(logprobs[len(query) + t - 1, token].item() for t, token in enumerate(completion))
        assert got[i].item() == pytest.approx(expected, abs=1e-5)


def test_kl_estimate_is_the_mean_over_every_micro_batch_of_the_mismatched_pairs():
    policy, reference = tiny_causal_lm(seed=0), tiny_causal_lm(seed=1)
    batches = [example_batch([[5, 6], [7, 8, 9], [10]], [[11, EOS], [12, 13, EOS], [14, EOS]], [True, False, True]),
               example_batch([[3, 4], [6]], [[15, EOS], [9, 9, 9, EOS]], [False, False])]
    kl, z0 = kto.kl_estimate(Accelerator(cpu=True), policy, reference, batches, PAD)
    # by hand: in each micro batch prompt i takes completion i - 1 (the first prompt the last completion)
    log_ratios = []
    for batch in batches:
        size = len(batch["query_token"])
        for i in range(size):
            query, completion = batch["query_token"][i:i + 1], batch["completion_token"][(i - 1) % size:][:1]
            with torch.no_grad():
                log_ratios.append(kto.example_logprobs(policy, query, completion, PAD).item()
                                  - kto.example_logprobs(reference, query, completion, PAD).item())
    assert len(log_ratios) == 5
    assert kl.item() == pytest.approx(sum(log_ratios) / 5, abs=1e-5)  # one mean over both micro batches
    assert z0.item() == pytest.approx(max(0.0, kl.item()), abs=1e-6)
    assert not z0.requires_grad
    # the models differ, so the estimate is not trivially 0; the same model gives exactly 0
    assert abs(kl.item()) > 1e-4
    same, z_same = kto.kl_estimate(Accelerator(cpu=True), policy, policy, batches, PAD)
    assert same.item() == 0.0 and z_same.item() == 0.0


def test_pairs_become_one_desirable_and_one_undesirable_example_each(synthetic_task):
    pairs = load_from_disk(synthetic_task["preference"])["train"].select(range(6))
    rows = kto.with_row_index(pairs, ["query_token", "chosen_token", "rejected_token"])
    examples = kto.pair_halves([rows[i] for i in range(6)])  # a micro batch of 6 pairs
    assert examples["label"].tolist() == [True] * 6 + [False] * 6
    assert examples["completion_token"][:6].tolist() == pairs["chosen_token"]
    assert examples["completion_token"][6:].tolist() == pairs["rejected_token"]
    assert examples["query_token"][:6].tolist() == examples["query_token"][6:].tolist() == pairs["query_token"]
    assert examples["row_index"].tolist() == list(range(6)) * 2
    # the example layout gives the log-probs of the preference layout (query + response, right-padded)
    model = tiny_causal_lm(vocab_size=1024, pad_token_id=PAD, eos_token_id=EOS)
    pad = json.load(open(os.path.join(synthetic_task["root"], "prep_summary.json")))["pad_token_id"]
    ours = kto.example_logprobs(model, examples["query_token"][:6], examples["completion_token"][:6], pad)
    theirs = kto.with_row_index(pairs, kto.PAIR_COLUMNS)[:6]
    chosen, _ = kto.concatenated_logprobs(model, theirs, pad)
    assert torch.allclose(ours, chosen, atol=1e-4)


def test_pairs_are_dpos_pairs_in_dpos_order():
    """--feedback pairs (the default) trains on exactly dpo.py's pairs in dpo.py's order: the loaders as each main
    builds and prepares them (shuffled_batches, make_accelerator's seedable sampler, resumable_micro_batches), KTO with
    twice DPO's batch and a micro batch of 2 pairs where DPO's holds 4. Every KTO micro batch holds both halves of
    its pairs, and every update the pairs of DPO's update, over two epochs (each its own shuffle)."""
    dpo = load_script("dpo")
    n = 24
    table = Dataset.from_dict({"query_token": [[i, i] for i in range(n)], "chosen_token": [[100 + i] for i in range(n)],
                               "rejected_token": [[200 + i] for i in range(n)]})
    rows = kto.with_row_index(table, ["query_token", "chosen_token", "rejected_token"])
    dpo_args = dpo.Args(seed=3, total_batch_size=8, local_micro_batch_size=4)  # 6 micro batches an epoch
    kto_args = kto.Args(seed=3, total_batch_size=16, local_micro_batch_size=4)  # 12 (2 pairs each)
    check_kto_flags(kto_args)
    loader = dpo.make_accelerator(dpo_args).prepare(dpo.shuffled_batches(rows, dpo_args.local_micro_batch_size, 3))
    batches = dpo.resumable_micro_batches(loader, 0)
    dpo_order = [int(i) for _ in range(12) for i in next(batches)["row_index"]]
    loader = kto.make_accelerator(kto_args).prepare(
        kto.shuffled_batches(rows, kto_args.local_micro_batch_size // 2, 3, kto.pair_halves))
    batches, kto_order = kto.resumable_micro_batches(loader, 0), []
    for _ in range(24):
        batch = next(batches)
        pair_rows = batch["row_index"][:2]
        assert batch["label"].tolist() == [True, True, False, False]
        assert batch["row_index"].tolist() == pair_rows.tolist() * 2
        assert batch["query_token"][:, 0].tolist() == pair_rows.tolist() * 2
        assert batch["completion_token"][:, 0].tolist() == (pair_rows + 100).tolist() + (pair_rows + 200).tolist()
        kto_order += pair_rows.tolist()
    assert kto_order == dpo_order  # so each update of 16 examples holds the 8 pairs of DPO's update
    assert sorted(dpo_order[:n]) == sorted(dpo_order[n:]) == list(range(n)) and dpo_order[:n] != dpo_order[n:]


# ------------------------------------------------------------------------------------------------
# Unpaired feedback: jsonl -> prepared split, and the errors of bad rows
# ------------------------------------------------------------------------------------------------
def write_jsonl(folder, name: str, rows: list) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def prepare_args(synthetic_task, folder, **overrides) -> prepare.Args:
    args = prepare.Args(task="synthetic", base_model=synthetic_task["base_model"], unpaired_data=str(folder),
                        output_dir=str(folder), **overrides)
    prepare.resolve_lengths(args)
    return args


TLDR_PROMPT = prepare.TLDR_FORMAT.format(subreddit="tifu", title="what do i do now",
                                         post="so yesterday mom lost cash.\n\non top of that dad sold shoes.")


def test_unpaired_jsonl_becomes_a_prepared_split(synthetic_task, tmp_path):
    args = prepare_args(synthetic_task, tmp_path / "feedback")
    write_jsonl(tmp_path / "feedback", "train.jsonl", [
        {"prompt": TLDR_PROMPT, "completion": "mom lost cash and dad sold shoes.", "label": True},
        "",  # a blank line is no row
        {"prompt": "a prompt in no known format\n\nits last paragraph", "completion": " lol.", "label": False},
        {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "hello."}],
         "label": False},
        {"prompt": TLDR_PROMPT, "completion": "mom lost cash " * 40, "label": True},  # too long: dropped
    ])
    tokenizer = prepare.load_tokenizer(args)
    split = prepare.prepare_unpaired(args, tokenizer)["unpaired"]["train"]
    assert len(split) == 3 and split["label"] == [True, False, False]
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    row = split[0]
    # the TL;DR prompt is rebuilt from its fields (Detail 2's truncation applies to its post), left-padded (Detail 5)
    query_ids = prepare.encode_text(tokenizer, TLDR_PROMPT)
    assert row["query"] == TLDR_PROMPT and row["query_token_len"] == len(query_ids)
    assert row["query_token"] == [pad] * (args.query_length - len(query_ids)) + query_ids
    # the completion: " " + text + EOS (Detail 3), right-padded to the preference responses' length
    completion_ids = prepare.encode_text(tokenizer, " mom lost cash and dad sold shoes.") + [eos]
    assert row["completion_token"] == completion_ids + [pad] * (args.rm_response_length - len(completion_ids))
    assert row["completion_token_len"] == len(completion_ids)
    assert split[2]["query"] == "\n\nHuman: hi\n\nAssistant:" and split[2]["completion"] == " hello."
    # a query too long for --query_length loses its post's last paragraphs, as the SFT and preference queries do
    short = prepare_args(synthetic_task, tmp_path / "feedback", query_length=30)
    cut = prepare.prepare_unpaired(short, tokenizer)["unpaired"]["train"][0]
    assert cut["query_truncated"] and "dad sold shoes" not in cut["query"] and cut["query"].endswith("TL;DR:")


@pytest.mark.parametrize("row, problem", [
    ({"completion": "mom lost cash.", "label": True}, "missing 'prompt'"),
    ({"prompt": TLDR_PROMPT, "completion": "mom lost cash."}, "missing 'label'"),
    ({"prompt": TLDR_PROMPT, "completion": "mom lost cash.", "label": "yes"}, "label is 'yes' (str), not a boolean"),
    ({"prompt": TLDR_PROMPT, "completion": "mom lost cash.", "label": 1}, "label is 1 (int), not a boolean"),
    ({"prompt": TLDR_PROMPT, "completion": "  ", "label": True}, "the completion is empty"),
    ({"prompt": 7, "completion": "mom lost cash.", "label": True}, "'prompt' is int, not text"),
    ("{not json", "not a JSON object"),
])
def test_a_bad_row_names_the_file_the_row_and_the_fix(synthetic_task, tmp_path, row, problem):
    good = {"prompt": TLDR_PROMPT, "completion": "mom lost cash.", "label": True}
    path = write_jsonl(tmp_path / "feedback", "train.jsonl", [good, "", good, row])  # the bad row: row 2, line 4
    args = prepare_args(synthetic_task, tmp_path / "feedback")
    with pytest.raises(ValueError) as error:
        prepare.prepare_unpaired(args, prepare.load_tokenizer(args))
    message = str(error.value)
    assert message.startswith(f"{path} row 2 (line 4): "), message
    assert problem in message
    assert "true" in message and ("fix the row" in message or "write it as true" in message), message


# ------------------------------------------------------------------------------------------------
# The built-in task's thumbs up / down
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def unpaired_task(synthetic_task, tmp_path_factory) -> str:
    """A copy of the small built-in task (its base model, raw comparisons and task.json) with its thumbs up / down
    prepared by the documented command, `data/prepare.py --task synthetic --unpaired_only`."""
    root = str(tmp_path_factory.mktemp("unpaired_task"))
    for name in ("base_model", os.path.join("raw", "comparisons"), "preference", "sft"):
        shutil.copytree(os.path.join(synthetic_task["root"], name), os.path.join(root, name))
    shutil.copy(synthetic_task["task_json"], root)
    subprocess.run([sys.executable, os.path.join(REPO_ROOT, "data", "prepare.py"), "--task", "synthetic",
                    "--output_dir", root, "--unpaired_only"], check=True, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
    return root


def test_builtin_raters_give_every_compared_summary_a_noisy_thumb(unpaired_task, tmp_path):
    comparisons = [json.loads(line) for line in open(os.path.join(unpaired_task, "raw", "comparisons", "train.jsonl"))]
    rows = [json.loads(line) for line in open(os.path.join(unpaired_task, "raw", "feedback", "train.jsonl"))]
    # the hub's KTO layout, one row per summary of every comparison, in order
    assert all(set(row) == {"prompt", "completion", "label"} and isinstance(row["label"], bool) for row in rows)
    assert [row["completion"] for row in rows] == [s["text"].strip() for c in comparisons for s in c["summaries"]]
    assert rows[0]["prompt"] == prepare.TLDR_FORMAT.format(**{k: comparisons[0]["info"][k]
                                                              for k in ("subreddit", "title", "post")})
    # labels follow the gold judge's bar with the raters' noise: mostly, not always
    gold = [synthetic.gold_score(c["info"]["post"], s["text"]) >= synthetic.DESIRABLE_SCORE
            for c in comparisons for s in c["summaries"]]
    agreement = sum(row["label"] == g for row, g in zip(rows, gold)) / len(rows)
    assert 0.6 < agreement < 0.95
    assert 0.1 < sum(row["label"] for row in rows) / len(rows) < 0.6
    summary = json.load(open(os.path.join(unpaired_task, "unpaired_summary.json")))
    assert summary["built_in_raters"]["train"]["agreement_with_gold"] == pytest.approx(agreement)
    # seeded and on a stream of its own: the same thumbs again, and the comparisons untouched
    info = synthetic.generate_feedback(os.path.join(unpaired_task, "raw", "comparisons"), str(tmp_path),
                                       prepare.TLDR_FORMAT, seed=0)
    assert (open(tmp_path / "train.jsonl").read()
            == open(os.path.join(unpaired_task, "raw", "feedback", "train.jsonl")).read())
    assert info["train"]["rows"] == len(rows)
    # ... read by data/prepare.py into a split whose queries are the preference split's queries
    unpaired = load_from_disk(os.path.join(unpaired_task, "unpaired"))
    preference = load_from_disk(os.path.join(unpaired_task, "preference"))["train"]
    assert len(unpaired["train"]) == len(rows) and unpaired["train"]["label"] == [row["label"] for row in rows]
    assert unpaired["train"]["query_token"][:4:2] == preference["query_token"][:2]
    assert json.loads(unpaired["train"].info.description)["tokenizer"]["vocab_size"] > 0


def test_unpaired_only_needs_a_prepared_task(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "data", "prepare.py"), "--task", "synthetic",
                             "--output_dir", str(tmp_path), "--unpaired_only"], cwd=REPO_ROOT, capture_output=True,
                            text=True)
    assert result.returncode != 0 and "holds no prepared built-in task" in result.stderr


# ------------------------------------------------------------------------------------------------
# kto.py end to end on the built-in task, both kinds of feedback
# ------------------------------------------------------------------------------------------------
def kto_flags(task: dict, unpaired: str, *extra: str) -> list:
    return ["--sft_model_path", task["base_model"], "--preference_dataset", task["preference"],
            "--query_dataset", task["sft"], "--unpaired_dataset", unpaired,
            "--response_length", str(task["task"]["sft_response_length"]), "--total_episodes", "64",
            "--total_batch_size", "16", "--local_micro_batch_size", "8", "--lr", "1e-4", "--log_every", "1",
            "--num_eval_samples", "16", "--local_eval_batch_size", "8", *extra]


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
@pytest.mark.parametrize("feedback", ["pairs", "unpaired"])
def test_smoke_run_on_builtin_task(feedback, synthetic_task, unpaired_task, tmp_path):
    command = [sys.executable, os.path.join(REPO_ROOT, "kto.py"),
               *kto_flags(synthetic_task, os.path.join(unpaired_task, "unpaired"), "--feedback", feedback,
                          "--eval_every", "2"),
               "--output_dir", str(tmp_path / "model"), "--run_dir_root", str(tmp_path / "runs"), "--run_name", "smoke"]
    result = subprocess.run(command, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    # pairs give as many desirable as undesirable examples (ratio 1); the built-in thumbs are mostly down
    assert ("outside [1, 4/3]" in result.stdout) == (feedback == "unpaired"), result.stdout[-2000:]
    run_dir = tmp_path / "runs" / "smoke"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["num_updates"] == 4 and 0.0 <= summary["eval/accuracy"] <= 1.0
    # the budget as spent: 4 updates of 16 examples (pairs: both halves of 32 pairs; thumbs: 64 of them)
    assert summary["budget/updates"] == 4 and summary["budget/rows_read"] == 64
    assert summary.get("budget/pairs_read") == (32 if feedback == "pairs" else None)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if "train/loss" in row]
    assert [row["step"] for row in train] == [1, 2, 3, 4]
    assert all(0 < row["time/update_s"] < summary["wall_time_s"] for row in train)  # each update's (issue 51)
    assert [row["step"] for row in rows if "eval/accuracy" in row] == [2, 4]
    # the policy starts as the reference: r = 0 and z0 = 0, so every example's loss is 1 - sigmoid(0) = 0.5
    assert train[0]["train/loss"] == pytest.approx(0.5, abs=1e-6)
    assert (train[0]["train/kl"] == pytest.approx(0.0, abs=1e-6)
            and train[0]["train/rewards/desirable"] == pytest.approx(0.0, abs=1e-6))
    assert train[-1]["train/kl"] != 0.0 and train[-1]["train/rewards/desirable"] != 0.0
    assert all(row["train/z0"] == max(0.0, row["train/kl"]) for row in train)
    assert all(0.0 < row["train/desirable_share"] < 1.0 for row in train)
    assert (run_dir / "samples.csv").exists() and (run_dir / "eval_table.md").exists()
    assert (tmp_path / "model" / "model.safetensors").exists()


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_weights_and_metrics(synthetic_task, unpaired_task, tmp_path):
    """SIGKILL after the update-2 checkpoint, then --resume: the policy, metrics.jsonl (z0 included: each update's
    reference point is estimated again on the same examples), summary.json and the sampled responses equal those of
    an uninterrupted run."""
    # 4 updates of 16 examples; checkpoints and evaluations at updates 2 and 4 (the last one: the final evaluation)
    flags = kto_flags(synthetic_task, os.path.join(unpaired_task, "unpaired"), "--checkpoint_every", "2",
                      "--eval_every", "2", "--eval_temperature", "1.0")  # temperature 1: the samples depend on the RNG
    runs, script = tmp_path / "runs", [sys.executable, os.path.join(REPO_ROOT, "kto.py"), *flags]
    command = {name: script + ["--output_dir", str(tmp_path / name), "--run_dir_root", str(runs), "--run_name", name]
               for name in ("full", "cut")}
    run_ok(command["full"], cwd=REPO_ROOT, env=ENV)
    kill_after_checkpoint(command["cut"], runs / "cut" / "checkpoints" / "update_000002", cwd=REPO_ROOT, env=ENV,
                          timeout=240)
    assert not (tmp_path / "cut" / "model.safetensors").exists()  # killed before its final save
    resumed = run_ok(command["cut"] + ["--resume"], cwd=REPO_ROOT, env=ENV)
    assert "cut/checkpoints/update_000002 (update 2)" in resumed.stdout + resumed.stderr

    assert_same_safetensors(tmp_path / "full" / "model.safetensors", tmp_path / "cut" / "model.safetensors")
    rows = {name: [without_timing(json.loads(line)) for line in open(runs / name / "metrics.jsonl")]
            for name in command}
    assert [row["step"] for row in rows["full"] if "train/z0" in row] == [1, 2, 3, 4]
    assert rows["cut"] == rows["full"]
    summaries = {name: without_timing(json.load(open(runs / name / "summary.json"))) for name in command}
    assert summaries["cut"] == summaries["full"]
    assert (runs / "cut" / "samples.csv").read_text() == (runs / "full" / "samples.csv").read_text()


@pytest.mark.slow
def test_resume_with_no_update_left_evaluates_at_the_checkpoints_reference_point(synthetic_task, unpaired_task,
                                                                                tmp_path):
    """A --resume from a checkpoint of the last update goes straight to the final evaluation, whose pair losses are
    measured from z0: the z0 of the checkpoint's update, which the trainer state carries (before it did, such a
    resume stopped with a NameError). No run saves a checkpoint at its last update (the final model covers it), so
    the test makes one: the update-2 checkpoint of a 3-update run, its trainer state relabelled as update 3. The
    final evaluation then sees the weights and the z0 of update 2, and must give update 2's evaluation exactly."""
    # a large beta and learning rate and a heavy desirable weight: z0 of update 2 is positive (not clamped to 0)
    flags = kto_flags(synthetic_task, os.path.join(unpaired_task, "unpaired"), "--feedback", "unpaired",
                      "--total_episodes", "48", "--checkpoint_every", "2", "--eval_every", "2", "--beta", "1.0",
                      "--lr", "1e-3", "--desirable_weight", "3")
    runs, script = tmp_path / "runs", [sys.executable, os.path.join(REPO_ROOT, "kto.py"), *flags]
    run_ok(script + ["--output_dir", str(tmp_path / "full"), "--run_dir_root", str(runs), "--run_name", "full"],
           cwd=REPO_ROOT, env=ENV)
    rows = [json.loads(line) for line in open(runs / "full" / "metrics.jsonl")]
    z0 = next(row["train/z0"] for row in rows if row["step"] == 2 and "train/z0" in row)
    evaluation = next(row for row in rows if row["step"] == 2 and "eval/validation/loss" in row)
    assert z0 > 0.01, "the test needs a z0 away from 0"

    shutil.copytree(runs / "full" / "checkpoints", runs / "end" / "checkpoints")
    state_file = runs / "end" / "checkpoints" / "update_000002" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state["update"] == 2 and state["num_updates"] == 3
    state_file.write_text(json.dumps({**state, "update": 3}))  # the same size: the manifest still matches
    resumed = run_ok(script + ["--output_dir", str(tmp_path / "end"), "--run_dir_root", str(runs), "--run_name", "end",
                               "--resume"], cwd=REPO_ROOT, env=ENV)
    assert "(update 3)" in resumed.stdout + resumed.stderr
    summary = json.load(open(runs / "end" / "summary.json"))
    for key in ("eval/validation/loss", "eval/validation/accuracy", "eval/validation/rewards/margins"):
        assert summary[key] == evaluation[key], key
    assert (tmp_path / "end" / "model.safetensors").exists()


@pytest.mark.slow
def test_zero2_on_two_processes_matches_one_process(synthetic_task, unpaired_task, tmp_path):
    """As tests/test_multiprocess.py runs dpo.py: ZeRO-2 (the README's zero2.yaml, hardware lines overridden) on 2 CPU
    processes against 1 process that accumulates the two micro batches the ranks take. z0 is gathered over the
    update's batch, so both runs see the same reference point and log the same loss, KL and rewards, and end with the
    same weights. Unpaired feedback, so the micro batches hold uneven mixes of desirable and undesirable examples."""
    # a large beta and learning rate and a heavy desirable weight, so that the policy drifts up within 4 updates and
    # z0 (positive, not clamped) moves the loss visibly: a z0 estimated on each process's own micro batches instead
    # would change the loss, the gradients and the weights
    flags = kto_flags(synthetic_task, os.path.join(unpaired_task, "unpaired"), "--feedback", "unpaired",
                      "--eval_every", "0", "--beta", "1.0", "--lr", "1e-3", "--desirable_weight", "3")
    (one,), one_rows, one_dir = run_probe("kto", flags, tmp_path, "one", 1, 0)
    two, two_rows, two_dir = run_probe("kto", flags, tmp_path, "two", 2, None, "zero2")
    assert two[0]["world_size"] == 2 and two[0]["zero_stage"] == 2 and set(two[0]["engines"]) == {"DeepSpeedEngine"}
    for name, tensor in two[0]["weights"].items():
        assert torch.equal(tensor, two[1]["weights"][name]), f"{name} differs between rank 0 and rank 1"
    train = [row for row in two_rows if "train/kl" in row]
    assert len(train) == 4 and all(row["train/z0"] > 0.1 for row in train[1:])
    assert_same_run("kto", two, two_rows, one, one_rows, "kto under zero2")
    saved, expected = saved_weights(two_dir), saved_weights(one_dir)
    for name, tensor in expected.items():
        torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=1e-5, msg=f"saved {name}")


def test_pipeline_opt_in_adds_the_kto_stages(tmp_path):
    """`pipeline.py --kto`: the thumbs are prepared once for every seed right after prep, and the two KTO runs follow
    DPO with DPO's pairs and updates (a pair is two examples) and the built-in raters' feedback."""
    import pipeline

    plain = pipeline.Pipeline(pipeline.Args(out=str(tmp_path / "plain")))
    assert not {"unpaired", "kto", "kto_unpaired"} & set(plain.stages)
    p = pipeline.Pipeline(pipeline.Args(out=str(tmp_path / "kto"), kto=True))
    assert p.stages == ["prep", "unpaired", "sft", "rm", "ppo", "dpo", "kto", "kto_unpaired", "judge", "report"]
    assert (p.cmd_unpaired()[-1] == "--unpaired_only"
            and p.marker("unpaired") == p.marker("prep").replace("prep", "unpaired"))
    assert "unpaired_summary.json" in p.incomplete("unpaired")  # not prepared yet
    pairs, thumbs = p.command("kto"), p.command("kto_unpaired")
    for command, feedback in ((pairs, "pairs"), (thumbs, "unpaired")):
        assert command[command.index("--feedback") + 1] == feedback
        assert (command[command.index("--total_batch_size") + 1] == "64"
                and command[command.index("--total_episodes") + 1] == "1920")
    assert thumbs[thumbs.index("--desirable_weight") + 1] == "2" and "--desirable_weight" not in pairs
    assert thumbs[thumbs.index("--output_dir") + 1].endswith("models/kto_unpaired")
