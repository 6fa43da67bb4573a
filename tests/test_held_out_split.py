"""Issue 54: the leaderboard reports a test split that nothing was tuned on. The built-in task's test split has a
random stream of its own (data/synthetic.py), at least 500 prompts that share none with train or validation, and
leaves every other file byte for byte as it was; the leaderboard (and ci) modes evaluate every policy on it, the
report and the leaderboard say so, and quickstart and full modes keep the validation split their numbers come from."""

import hashlib
import json
import os
from types import SimpleNamespace

import pandas as pd
import pytest

import pipeline
import report
from data import prepare, synthetic

# sha256 of generate_raw(seed=1) at its default sizes (seed 1: the pipeline's task) before the test split had a stream
# of its own: these files, and so the tokenizer, base model and processed train / validation splits made from them,
# must not move
OLD_SHA256 = {
    "sft/train.jsonl": "7cc3027765fcbc92c056fdaa7c4f5d06ea739d5de551269ff0e6f4070e424b28",
    "sft/validation.jsonl": "8f362d2c8be9fe6896d5280689595826f3fe23a6d3dd5530f48a60f54995511c",
    "comparisons/train.jsonl": "6208df70bbc1fd8aca534f957fd7cefe4e5350d0751b00ab3646d32d70335c7e",
    "comparisons/validation.jsonl": "6ba7d23ddf650d0e1f0cd4afd322324d16cd54772e6ffce20050ebaf8acb96fe",
}
OLD_TEST_SHA256 = "fcdcee966f1e40756d60ecf2f4ae65a5ffc524f8056e95ecb70d9f0a073d770f"  # 400 posts of the main stream


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def rows(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def test_the_test_split_has_a_stream_of_its_own_and_moves_no_other_file(tmp_path):
    raw = tmp_path / "raw"
    info = synthetic.generate_raw(str(raw), seed=1)
    for name, digest in OLD_SHA256.items():
        assert sha256(raw / name) == digest, name
    test = rows(raw / "sft" / "test.jsonl")
    assert len(test) >= 500 and info["counts"]["sft/test.jsonl"] == len(test)
    assert prepare.Args().synthetic_num_sft_test == len(test)  # data/prepare.py's default is the generator's
    assert sha256(raw / "sft" / "test.jsonl") != OLD_TEST_SHA256
    # no prompt of the test split is one of train or validation, nor twice in the test split: not the formatted
    # query, nor the part of it that truncation always keeps (subreddit, title, opening paragraph)
    others = rows(raw / "sft" / "train.jsonl") + rows(raw / "sft" / "validation.jsonl")
    keys = [synthetic.prompt_key(row) for row in test]
    assert len(set(keys)) == len(test) and not set(keys) & {synthetic.prompt_key(row) for row in others}
    queries = {prepare.TLDR_FORMAT.format(**row) for row in test}
    assert len(queries) == len(test) and not queries & {prepare.TLDR_FORMAT.format(**row) for row in others}
    assert len({row["id"] for row in test}) == len(test)
    # its own stream: resizing it moves no other file, and the rows it shares with the larger split are the same
    smaller = tmp_path / "smaller"
    assert synthetic.generate_raw(str(smaller), seed=1, num_sft_test=520)["ceiling"] == info["ceiling"]
    for name, digest in OLD_SHA256.items():
        assert sha256(smaller / name) == digest, name
    assert rows(smaller / "sft" / "test.jsonl") == test[:520]


POLICY_STAGES = [s for s in pipeline.LEADERBOARD_STAGES if s in pipeline.POLICY_STAGES]


def test_the_leaderboard_evaluates_every_policy_on_every_test_prompt_and_the_other_modes_on_validation(tmp_path):
    board = pipeline.Pipeline(pipeline.Args(mode="leaderboard", out=str(tmp_path / "lb")))
    prep = pipeline.flag_values(board.command("prep"))
    assert int(prep["--synthetic_num_sft_test"]) >= 500
    assert set(POLICY_STAGES) <= set(board.stages) and len(POLICY_STAGES) == 17
    for stage in POLICY_STAGES:
        flags = pipeline.flag_values(board.command(stage))
        assert flags["--eval_split"] == "test", stage
        assert flags["--num_eval_samples"] == prep["--synthetic_num_sft_test"], stage  # every test prompt
    ilql = pipeline.flag_values(board.command("ilql"))
    assert ilql["--eval_betas"] == ilql["--beta"] == "4.0"  # no sweep of betas on the test split: the chosen one
    assert board.judged_label("ilql") == "ilql_beta4"
    assert "--eval_split" not in board.command("rm")  # the reward model is judged on its validation comparisons
    ci = pipeline.Pipeline(pipeline.Args(mode="ci", out=str(tmp_path / "ci")))
    assert "--synthetic_num_sft_test" in ci.command("prep")
    assert all(pipeline.flag_values(ci.command(stage))["--eval_split"] == "test" for stage in POLICY_STAGES)
    # quickstart and full modes report the first 200 validation prompts, as before (the scripts' default split)
    for mode in ("quickstart", "full"):
        p = pipeline.Pipeline(pipeline.Args(mode=mode, out=str(tmp_path / mode)))
        assert "--synthetic_num_sft_test" not in p.command("prep")
        for stage in [s for s in p.stages if s in pipeline.POLICY_STAGES]:
            flags = pipeline.flag_values(p.command(stage))
            assert "--eval_split" not in flags and flags["--num_eval_samples"] == "200", (mode, stage)


def test_the_kl_reads_the_prompts_of_the_split_the_stage_evaluated(tmp_path):
    """The KL from SFT samples the very prompts the win rate reads: those of the stage's --eval_split (args.json)."""
    from datasets import Dataset, DatasetDict

    DatasetDict({split: Dataset.from_dict({"query_token": tokens}) for split, tokens in
                 (("validation", [[0, 1], [0, 2]]), ("test", [[3, 4], [0, 5]]))}).save_to_disk(str(tmp_path / "sft"))
    (tmp_path / "runs" / "ppo").mkdir(parents=True)
    (tmp_path / "runs" / "ppo" / "args.json").write_text(json.dumps(
        {"query_dataset": str(tmp_path / "sft"), "eval_split": "test", "response_length": 3}))
    tokenizer = SimpleNamespace(pad_token_id=0,
                                decode=lambda ids, skip_special_tokens: " ".join(map(str, ids.tolist())))
    p = SimpleNamespace(runs=str(tmp_path / "runs"))
    samples = tmp_path / "samples.csv"
    pd.DataFrame({"query": ["3 4", "5"]}).to_csv(samples, index=False)
    queries, length = report.kl_prompts(p, "ppo", 2, str(samples), tokenizer)
    assert queries.tolist() == [[3, 4], [0, 5]] and length == 3 and report.eval_split_of(p, "ppo") == "test"
    pd.DataFrame({"query": ["1", "2"]}).to_csv(samples, index=False)  # the validation prompts: not the stage's
    with pytest.raises(ValueError, match="split 'test'"):
        report.kl_prompts(p, "ppo", 2, str(samples), tokenizer)


def test_the_leaderboard_names_the_split_its_rows_were_evaluated_on(tmp_path):
    """write_leaderboard on two seeds of two methods evaluated on the test split: the text and leaderboard.csv say
    so, and that nothing was tuned there."""
    pipelines = []
    for i, seed in enumerate((1, 2)):
        base = tmp_path / f"seed_{seed}"
        p = SimpleNamespace(stages=["prep", "sft", "ppo", "judge", "report"], extras={}, runs=str(base / "runs"),
                            report_dir=str(base / "report"), policies_order=lambda: ["sft", "ppo"], kind=lambda s: s,
                            judged_label=lambda s: s, marker=lambda s, base=base: str(base / "stages" / f"{s}.json"))
        policies = []
        for stage, rate in (("sft", 0.3 + i / 100), ("ppo", 0.6 + i / 50)):
            os.makedirs(base / "runs" / stage)
            (base / "runs" / stage / "args.json").write_text(json.dumps(
                {"eval_split": "test", "total_episodes": 64, "total_batch_size": 16}))
            policies.append({"policy": stage, "win_rate": rate, "ci_low": rate - 0.04, "ci_high": rate + 0.04, "n": 600,
                             "kl": 0.0 if stage == "sft" else 1.0, "kl_se": 0.0 if stage == "sft" else 0.1,
                             "length": 10.0, "eos_rate": 1.0, **({"eval_split": "test"} if seed == 1 else {})})
        os.makedirs(base / "report")
        (base / "report" / "results.json").write_text(json.dumps({"policies": policies}))
        pipelines.append(p)
    text = report.write_leaderboard(str(tmp_path), [1, 2], pipelines)
    assert "on 600 test samples per seed" in text and "validation samples" not in text
    assert "no setting was chosen on them" in text
    table = pd.read_csv(tmp_path / "report" / "leaderboard.csv")
    assert list(table["eval_split"]) == ["test", "test"]
