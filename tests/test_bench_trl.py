"""tools/bench_trl.py: the rate arithmetic, the run order, the CPU features and the conversion of our prepared rows
to TRL's pre-tokenized formats (no network, no TRL). One slow test runs the tool end to end; it is opt-in
(RLHF_BENCH_TRL=1, so CI leaves the benchmark out) and needs the TRL virtual environment the tool makes."""

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import ENV, REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
import bench_trl  # noqa: E402

NO_AVX512 = """processor\t: 0
model name\t: AMD EPYC 7B12
flags\t\t: fpu sse sse2 avx avx2 fma
processor\t: 1
model name\t: AMD EPYC 7B12
flags\t\t: fpu sse sse2 avx avx2 fma
"""
SAPPHIRE = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu avx avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile
"""
AVX512_NO_BF16 = "model name\t: Intel(R) Xeon(R) Gold 6148\nflags\t\t: avx avx2 avx512f avx512bw avx512vl\n"


def test_marginal_rate_cancels_start_up():
    # 30 s of start-up and evaluation plus 0.05 s per row: the marginal rate is 20 rows/s at any start-up cost
    for start_up in (0.0, 30.0, 300.0):
        wall1, wall2 = start_up + 256 * 0.05, start_up + 2048 * 0.05
        assert bench_trl.marginal_rate(256, wall1, 2048, wall2) == pytest.approx(20.0)
    assert bench_trl.marginal_rate(256, 50.0, 2048, 140.0) == pytest.approx(1792 / 90)
    assert math.isnan(bench_trl.marginal_rate(256, 50.0, 2048, 49.0))  # noise larger than the work


def test_schedule_interleaves_ours_and_trl():
    rows = {"dpo": (256, 2048), "ppo": (128, 512)}
    order = bench_trl.schedule(["dpo", "ppo"], ["fp32", "bf16"], 3, rows)
    assert len(order) == 2 * 2 * 3 * 2 * 2
    assert order[:4] == [("dpo", "fp32", 0, 256, "ours"), ("dpo", "fp32", 0, 256, "trl"),
                         ("dpo", "fp32", 0, 2048, "ours"), ("dpo", "fp32", 0, 2048, "trl")]
    assert order[4] == ("dpo", "fp32", 1, 256, "ours")
    assert [item[4] for item in order] == ["ours", "trl"] * (len(order) // 2)  # strictly alternating
    assert order[-1] == ("ppo", "bf16", 2, 512, "trl")
    # every (trainer, precision, repeat, rows, side) exactly once
    assert len(set(order)) == len(order)


def run(trainer, side, repeat, rows, wall, ok=True, precision="fp32"):
    return {"trainer": trainer, "precision": precision, "side": side, "repeat": repeat, "rows": rows,
            "wall_s": wall, "ok": ok}


def test_summarize_takes_medians_of_per_repeat_ratios():
    runs = []
    # repeat r: ours does 1792 rows in 60, 90, 120 s; TRL in 90 s each time
    for repeat, ours_extra in enumerate((60.0, 90.0, 120.0)):
        runs += [run("dpo", "ours", repeat, 256, 20.0), run("dpo", "ours", repeat, 2048, 20.0 + ours_extra),
                 run("dpo", "trl", repeat, 256, 30.0), run("dpo", "trl", repeat, 2048, 120.0)]
    s = bench_trl.summarize(runs, "dpo", "fp32")
    assert s["rows"] == [256, 2048]
    assert s["ratios"] == pytest.approx([1.5, 1.0, 0.75])
    assert s["ratio"] == pytest.approx(1.0)
    assert s["rate_ours"] == pytest.approx(1792 / 90)
    assert s["rate_trl"] == pytest.approx(1792 / 90)
    # a failed run drops its repeat only; another precision or trainer is not mixed in
    runs[1] = dict(runs[1], ok=False)
    runs.append(run("dpo", "ours", 0, 2048, 1.0, precision="bf16"))
    runs.append(run("sft", "ours", 0, 2048, 1.0))
    s = bench_trl.summarize(runs, "dpo", "fp32")
    assert s["ratios"] == pytest.approx([1.0, 0.75])
    assert bench_trl.summarize(runs, "reward", "fp32") is None
    # a repeat whose longer run was not slower (NaN rate) is listed but left out of the medians
    runs.append(run("dpo", "ours", 3, 256, 20.0))
    runs.append(run("dpo", "ours", 3, 2048, 19.0))
    runs.append(run("dpo", "trl", 3, 256, 30.0))
    runs.append(run("dpo", "trl", 3, 2048, 120.0))
    s = bench_trl.summarize(runs, "dpo", "fp32")
    assert len(s["ratios"]) == 3 and math.isnan(s["ratios"][2])
    assert s["ratio"] == pytest.approx(0.875)


def test_cpu_features_and_precisions():
    amd = bench_trl.cpu_features(NO_AVX512)
    assert amd == {"model": "AMD EPYC 7B12", "avx2": True, "avx512": False, "avx512_bf16": False,
                   "amx_bf16": False, "bf16": False}
    spr = bench_trl.cpu_features(SAPPHIRE)
    assert spr["avx512"] and spr["avx512_bf16"] and spr["amx_bf16"] and spr["bf16"]
    skx = bench_trl.cpu_features(AVX512_NO_BF16)
    assert skx["avx512"] and not skx["bf16"]
    assert bench_trl.resolve_precisions(["auto"], amd) == ["fp32"]
    assert bench_trl.resolve_precisions(["auto"], skx) == ["fp32"]
    assert bench_trl.resolve_precisions(["auto"], spr) == ["fp32", "bf16"]
    assert bench_trl.resolve_precisions(["bf16", "fp32"], spr) == ["bf16", "fp32"]
    with pytest.raises(ValueError, match="no bf16 instructions"):
        bench_trl.resolve_precisions(["bf16"], amd)
    line = bench_trl.describe_cpu(amd, 2)
    assert "AVX-512 no" in line and "bf16 instructions no" in line and "2 threads" in line
    assert "amx_bf16" in bench_trl.describe_cpu(spr, 2)


def test_rows_must_fill_whole_batches():
    assert bench_trl.rows_of("dpo", None) == (256, 2048)
    assert bench_trl.rows_of("sft", [16, 48]) == (16, 48)
    with pytest.raises(ValueError, match="not a multiple of dpo's batch of 32"):
        bench_trl.rows_of("dpo", [48, 96])
    with pytest.raises(ValueError, match="N1 < N2"):
        bench_trl.rows_of("sft", [64, 32])


def test_conversion_keeps_the_tokens_of_every_row(synthetic_task):
    """TRL's rows hold exactly our rows' real tokens: checked against the text columns tokenized again the way
    data/prepare.py does (the query as text, each response as " " + text + EOS) and against the fixed-width
    columns with their padding cut."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    from data.prepare import encode_text, response_tokens

    tokenizer = AutoTokenizer.from_pretrained(synthetic_task["base_model"])
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    sft = load_from_disk(synthetic_task["sft"])["train"].select(range(24))
    pref = load_from_disk(synthetic_task["preference"])["train"].select(range(24))

    sft_rows = bench_trl.convert_split(sft, "sft", "sft/train")
    assert sft_rows.column_names == ["input_ids", "labels"]
    for row, out in zip(sft, sft_rows):
        query = encode_text(tokenizer, row["query"])
        response = response_tokens(tokenizer, row["reference_response"])
        assert out["input_ids"] == query + response
        assert out["labels"] == [-100] * len(query) + response  # the loss on the summary and its EOS
        assert out["input_ids"][-1] == eos and pad not in out["input_ids"]
        # the same targets as sft.py's label column without its [PAD]s
        ours = [t for t in row["query_reference_response_token_response_label"] if t != pad]
        assert [t for t in out["labels"] if t != -100] == ours

    for trainer in ("reward", "dpo"):
        rows = bench_trl.convert_split(pref, trainer, "preference/train")
        for row, out in zip(pref, rows):
            query = encode_text(tokenizer, row["query"])
            chosen, rejected = (response_tokens(tokenizer, row[name]) for name in ("chosen", "rejected"))
            if trainer == "reward":
                assert out == {"chosen_ids": query + chosen, "rejected_ids": query + rejected}
            else:
                assert out == {"prompt_ids": query, "chosen_ids": chosen, "rejected_ids": rejected}

    ppo_rows = bench_trl.convert_split(sft, "ppo", "sft/train")
    widths = []
    for row, out in zip(sft, ppo_rows):
        assert out["input_ids"] == encode_text(tokenizer, row["query"])
        # left-padded back to the data's width, it is our query column (Detail 5)
        assert [pad] * (len(row["query_token"]) - len(out["input_ids"])) + out["input_ids"] == row["query_token"]
        widths.append(len(out["input_ids"]))
    assert min(widths) < max(widths) <= len(sft[0]["query_token"])  # ragged: TRL pads to the longest in a batch


def test_conversion_names_a_bad_row(synthetic_task):
    from datasets import load_from_disk

    row = load_from_disk(synthetic_task["preference"])["train"][3]
    broken = dict(row, query_chosen_token_len=row["query_chosen_token_len"] + 1)
    with pytest.raises(ValueError, match="preference/train row 3: query_chosen_token is not the query"):
        bench_trl.reward_example(broken, "preference/train row 3")


TRL_VENV = os.path.join(os.path.expanduser("~"), ".cache", "rlhf-bench", "venv-trl-1.16", "bin", "python")


@pytest.mark.slow
@pytest.mark.skipif(not (os.environ.get("RLHF_BENCH_TRL") and os.path.exists(TRL_VENV)),
                    reason="opt-in (RLHF_BENCH_TRL=1) and needs the TRL venv that python tools/bench_trl.py makes; "
                           "the benchmark stays out of CI")
def test_end_to_end_sft(synthetic_task, tmp_path):
    """The tool on the small task: SFT at two tiny sizes, one repeat; every run ends and the table has a ratio."""
    out = tmp_path / "bench"
    cmd = [sys.executable, os.path.join(REPO_ROOT, "tools", "bench_trl.py"), "--trainers", "sft", "--rows", "16", "32",
           "--repeats", "1", "--precisions", "fp32", "--threads", "1", "--task_dir", synthetic_task["root"],
           "--out", str(out)]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads((out / "bench.json").read_text())
    assert [(r["side"], r["rows"], r["ok"]) for r in report["runs"]] == [
        ("ours", 16, True), ("trl", 16, True), ("ours", 32, True), ("trl", 32, True)]
    assert report["trl_versions"] == {"sft": "1.16.0"}
    assert "sft.py vs TRL 1.16.0 SFTTrainer" in (out / "bench.md").read_text()
    trl_log = open(report["runs"][3]["log"]).read()
    assert '"trl_trainer": "SFTTrainer", "rows": 32, "bf16": false' in trl_log
