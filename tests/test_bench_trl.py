"""tools/bench_trl.py: the rate arithmetic, the run order (with the side before too), the summaries and table, the
peak memory of a run, the CPU features, the model shapes and their random rows, and the conversion of our prepared
rows to TRL's pre-tokenized formats (no network, no TRL). One test runs the tool end to end on our side alone at the
tiny shape; another, opt-in (RLHF_BENCH_TRL=1, so CI leaves the benchmark out), runs it against TRL and needs the
TRL virtual environment the tool makes."""

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
    assert bench_trl.rows_of("sft", [8], "pythia410m") == (8,)  # one size: per-step times and memory only
    with pytest.raises(ValueError, match="not a multiple of sft's batch of 8"):
        bench_trl.rows_of("sft", [12], "pythia410m")


def test_one_size_gives_memory_and_no_rate():
    """Runs of one size (--rows N): each side's peak memory is reported, the two-run rate and the ratio are NaN."""
    runs = [dict(run("sft", side, 0, 8, wall), peak_rss_mib=rss) for side, wall, rss in
            (("ours", 100.0, 1000.0), ("trl", 90.0, 1200.0))]
    s = bench_trl.summarize(runs, "sft", "fp32")
    assert s["rss_ours"] == 1000.0 and s["rss_trl"] == 1200.0
    assert math.isnan(s["rate_ours"]) and math.isnan(s["ratio"])


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


def test_schedule_with_before_and_ours_alone():
    rows = {"sft": (16, 48)}
    order = bench_trl.schedule(["sft"], ["fp32"], 2, rows, ("trl", "ours", "before"))  # run order, whatever given
    assert order[:6] == [("sft", "fp32", 0, 16, "ours"), ("sft", "fp32", 0, 16, "before"),
                         ("sft", "fp32", 0, 16, "trl"),
                         ("sft", "fp32", 0, 48, "ours"), ("sft", "fp32", 0, 48, "before"),
                         ("sft", "fp32", 0, 48, "trl")]
    assert len(order) == len(set(order)) == 2 * 2 * 3
    alone = bench_trl.schedule(["sft"], ["fp32"], 2, rows, ("ours",))
    assert alone == [("sft", "fp32", r, n, "ours") for r in (0, 1) for n in (16, 48)]


def test_sides_are_checked(tmp_path):
    args = bench_trl.Args(trainers=["sft", "dpo"], sides=["trl", "ours"])
    assert bench_trl.check_sides(args) == ["ours", "trl"]
    with pytest.raises(ValueError, match="expected ours"):
        bench_trl.check_sides(bench_trl.Args(sides=["trl"]))
    with pytest.raises(ValueError, match="expected ours"):
        bench_trl.check_sides(bench_trl.Args(sides=["ours", "theirs"]))
    with pytest.raises(ValueError, match="lacks sft.py dpo.py"):
        bench_trl.check_sides(bench_trl.Args(trainers=["sft", "dpo"], sides=["ours", "before"]))
    (tmp_path / "sft.py").write_text("")
    with pytest.raises(ValueError, match="lacks dpo.py"):
        bench_trl.check_sides(bench_trl.Args(trainers=["sft", "dpo"], sides=["ours", "before"],
                                             before_repo=str(tmp_path)))
    args = bench_trl.Args(trainers=["sft"], sides=["before", "ours"], before_repo=str(tmp_path))
    assert bench_trl.check_sides(args) == ["ours", "before"]


def test_summarize_with_before_and_peak_memory():
    runs = []
    # ours does 32 rows in 8 s, before in 16 s, TRL in 32 s: ours/before 2, ours/TRL 4; then a repeat with other times
    for repeat, (ours, before, trl) in enumerate(((8.0, 16.0, 32.0), (8.0, 8.0, 16.0), (16.0, 8.0, 32.0))):
        for side, extra, rss in (("ours", ours, 1000.0), ("before", before, 1500.0), ("trl", trl, 3000.0)):
            runs += [dict(run("sft", side, repeat, 16, 10.0), peak_rss_mib=rss / 2),
                     dict(run("sft", side, repeat, 48, 10.0 + extra), peak_rss_mib=rss + repeat)]
    s = bench_trl.summarize(runs, "sft", "fp32", ("ours", "before", "trl"))
    assert s["sides"] == ["ours", "before", "trl"]
    assert s["ratios_before"] == pytest.approx([2.0, 1.0, 0.5]) and s["ratio_before"] == pytest.approx(1.0)
    assert s["ratios"] == pytest.approx([4.0, 2.0, 2.0]) and s["ratio"] == pytest.approx(2.0)
    assert s["rate_ours"] == pytest.approx(4.0) and s["rate_before"] == pytest.approx(4.0)
    assert s["rate_trl"] == pytest.approx(32 / 32)
    # peak memory: the median of the runs at N2 (not those at N1)
    assert (s["rss_ours"], s["rss_before"], s["rss_trl"]) == (1001.0, 1501.0, 3001.0)
    # a repeat without its before runs is left out when before is a side, kept when it is not
    partial = [r for r in runs if not (r["side"] == "before" and r["repeat"] == 0)]
    assert bench_trl.summarize(partial, "sft", "fp32", ("ours", "before", "trl"))["ratios"] == pytest.approx([2.0, 2.0])
    assert bench_trl.summarize(partial, "sft", "fp32")["ratios"] == pytest.approx([4.0, 2.0, 2.0])
    # ours alone: its rates and memory, no ratio; runs without a measured memory give None
    alone = bench_trl.summarize([r for r in runs if r["side"] == "ours"], "sft", "fp32", ("ours",))
    assert (alone["rates_ours"] == pytest.approx([4.0, 4.0, 2.0]) and "ratio" not in alone
            and "ratio_before" not in alone)
    assert bench_trl.summarize([run("sft", "ours", 0, 16, 1.0), run("sft", "ours", 0, 48, 2.0)], "sft", "fp32",
                               ("ours",))["rss_ours"] is None

    text = bench_trl.table([s], ["CPU: test", "Shape: test"], {"sft": "1.16.0"}, ("ours", "before", "trl"))
    head, row = [line for line in text.splitlines() if line.startswith("| ")][:3:2]
    assert head == ("| trainer | precision | rows N1 -> N2 | ours | before | ours/before (median) | ours/before of the "
                    "repeats | TRL | ours/TRL (median) | ours/TRL of the repeats | "
                    "peak RSS MiB (ours / before / TRL) |")
    assert row == ("| sft.py vs TRL 1.16.0 SFTTrainer | fp32 | 16 -> 48 | 4.00 rows/s | 4.00 | **1.00** | 2.00, 1.00, "
                   "0.50 | 1.00 | **2.00** | 4.00, 2.00, 2.00 | 1001 / 1501 / 3001 |")
    assert text.startswith("CPU: test\nShape: test\n")
    text = bench_trl.table([alone], ["CPU: test"], {}, ("ours",))
    assert "| sft.py | fp32 | 16 -> 48 | 4.00 rows/s | 1001 |" in text and "TRL" not in text


def test_timed_reports_exit_code_and_peak_memory(tmp_path):
    log = tmp_path / "logs" / "child.log"
    child = "import sys; block = bytearray(300 << 20); print('held'); sys.exit(3)"  # 300 MiB, touched by bytearray
    wall, code, rss = bench_trl.timed([sys.executable, "-c", child], ENV, str(log), cwd=str(tmp_path))
    assert code == 3 and wall > 0 and log.read_text() == "held\n"
    assert 300 < rss < 400
    # a small run reports its own size, not that of the process that started it (pytest, with what it imported)
    _, code, rss = bench_trl.timed([sys.executable, "-c", "pass"], ENV, str(log))
    assert code == 0 and rss < 100
    assert bench_trl.timed([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"], ENV, str(log))[1] == 128 + 9


def test_shapes_are_pythias_configurations():
    import torch
    from transformers import GPTNeoXForCausalLM

    counts = {}
    for shape in ("pythia160m", "pythia410m", "tiny"):
        config = bench_trl.neox_config(shape, pad_token_id=bench_trl.SHAPES[shape]["vocab_size"] - 1)
        assert config.rope_parameters["partial_rotary_factor"] == 0.25 and config.rope_parameters["rope_theta"] == 10000
        assert config.use_parallel_residual and not config.tie_word_embeddings
        assert config.max_position_embeddings == 2048 and config.layer_norm_eps == 1e-5
        assert config.hidden_dropout == config.attention_dropout == config.classifier_dropout == 0.0
        with torch.device("meta"):  # no memory, no time: just the parameter shapes
            counts[shape] = sum(p.numel() for p in GPTNeoXForCausalLM(config).parameters())
    # the published sizes of Pythia-160M and Pythia-410M (untied input and output embeddings)
    assert counts["pythia160m"] == 162_322_944 and counts["pythia410m"] == 405_334_016
    assert counts["tiny"] < 100_000
    for shape in ("pythia160m", "pythia410m"):
        assert bench_trl.SHAPES[shape]["query_length"] == 512 and bench_trl.SHAPES[shape]["response_length"] == 53

    assert bench_trl.settings_for("builtin")["dpo"] == {**bench_trl.SETTINGS["dpo"], "eval_rows": 16, "eval_batch": 16}
    with pytest.raises(ValueError, match="--shape pythia1b"):
        bench_trl.settings_for("pythia1b")
    settings = bench_trl.settings_for("pythia160m")
    assert {t: (s["batch"], s["micro"]) for t, s in settings.items()} == {
        "sft": (8, 4), "reward": (8, 4), "dpo": (8, 2), "ppo": (8, 4), "rloo": (8, 4), "grpo": (8, 4)}
    assert settings["ppo"]["rollout_forward_batch"] == 4 and settings["dpo"]["lr"] == bench_trl.SETTINGS["dpo"]["lr"]
    for trainer, s in settings.items():
        sequences = s["micro"] * (2 if trainer == "dpo" else 1)  # a DPO pair is two sequences with logits
        assert sequences <= 4 and s["eval_batch"] <= 4 and s["eval_rows"] % s["eval_batch"] == 0
        assert bench_trl.rows_of(trainer, None, "pythia160m") == s["rows"]  # the defaults fill whole batches
    assert bench_trl.rows_of("dpo", None, "tiny") == (8, 24)
    with pytest.raises(ValueError, match="not a multiple of sft's batch of 8"):
        bench_trl.rows_of("sft", [12, 48], "pythia410m")


def test_random_rows_follow_the_prepared_schema():
    from datasets import Dataset

    from rlhf_utils.checks import check_columns, check_query_response

    vocab, q, r = 512, 24, 8
    pad, eos = vocab - 1, 0
    tokenizer = bench_trl.shape_tokenizer(vocab)
    assert (len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id) == (vocab, pad, eos)
    assert tokenizer.decode([7, 510, eos]) == "t7 t510 " + bench_trl.EOS_TEXT  # every id decodes
    sft = bench_trl.random_rows("sft", "train", 6, q, r, vocab)
    pref = bench_trl.random_rows("preference", "validation", 6, q, r, vocab)
    for columns, names in ((sft, ["reference_response"]), (pref, ["chosen", "rejected"])):
        for i in range(6):
            query = columns["query_token"][i]
            assert len(query) == columns["query_token_len"][i] == q and pad not in query and eos not in query
            for name in names:
                response = columns[f"{name}_token"][i]
                assert len(response) == columns[f"{name}_token_len"][i] == r
                assert response[-1] == eos and eos not in response[:-1] and pad not in response
                assert columns[f"query_{name}_token"][i] == query + response
                assert columns[f"query_{name}_token_len"][i] == q + r
                assert columns[f"query_{name}_token_response_label"][i] == [pad] * q + response
                assert tokenizer(columns[name][i])["input_ids"] == response[:-1]  # the text spells the ids
    assert pref["chosen_token"] != pref["rejected_token"]
    # seeded per row: more rows keep the first ones; another split or kind draws others
    assert bench_trl.random_rows("sft", "train", 3, q, r, vocab) == {k: v[:3] for k, v in sft.items()}
    assert bench_trl.random_rows("sft", "validation", 3, q, r, vocab)["query_token"] != sft["query_token"][:3]
    # what the scripts check, and TRL's formats
    sft_set, pref_set = Dataset.from_dict(sft), Dataset.from_dict(pref)
    check_columns(sft_set, ["query_token", "query_reference_response_token",
                            "query_reference_response_token_response_label", "reference_response"], "sft")
    check_query_response(sft_set, pad, "sft")
    check_query_response(pref_set, pad, "preference")
    assert bench_trl.convert_split(sft_set, "sft", "sft")[0] == {
        "input_ids": sft["query_token"][0] + sft["reference_response_token"][0],
        "labels": [-100] * q + sft["reference_response_token"][0]}
    assert bench_trl.convert_split(pref_set, "dpo", "preference")[1] == {
        "prompt_ids": pref["query_token"][1], "chosen_ids": pref["chosen_token"][1],
        "rejected_ids": pref["rejected_token"][1]}


@pytest.mark.slow  # about a minute on 2 cores: four runs of a script, each mostly its start-up
def test_end_to_end_ours_at_the_tiny_shape(tmp_path):
    """The tool on our side alone (no TRL) at the tiny shape: its random model, tokenizer and rows are made, sft.py and
    dpo.py accept them and run, and the table has a positive rate and the peak memory of each trainer. N2 is far
    above N1 because an update of the tiny model takes milliseconds: the run at N2 must be slower than the one at N1
    by more than the noise of their start-ups on a busy machine (here about 8 s for SFT and 13 s for DPO)."""
    out = tmp_path / "bench"
    cmd = [sys.executable, os.path.join(REPO_ROOT, "tools", "bench_trl.py"), "--shape", "tiny", "--sides", "ours",
           "--trainers", "sft", "dpo", "--rows", "8", "4800", "--repeats", "1", "--precisions", "fp32", "--threads",
           "1", "--out", str(out)]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "bench.json").read_text())
    assert [(r["trainer"], r["side"], r["rows"], r["ok"]) for r in report["runs"]] == [
        ("sft", "ours", 8, True), ("sft", "ours", 4800, True), ("dpo", "ours", 8, True), ("dpo", "ours", 4800, True)]
    assert all(r["peak_rss_mib"] > 50 for r in report["runs"])
    assert report["sides"] == ["ours"] and report["shape"]["name"] == "tiny"
    assert report["settings"]["dpo"]["micro"] == 2
    walls = [(r["trainer"], r["rows"], r["wall_s"]) for r in report["runs"]]
    for summary in report["summaries"]:
        assert summary["rate_ours"] > 0, walls  # NaN: the run at N2 was not slower
        assert summary["rss_ours"] > 50 and "ratio" not in summary
    assert [s["trainer"] for s in report["summaries"]] == ["sft", "dpo"]
    # per step (issue 51): every update's time/update_s read back, dpo.py's too (--log_every 1)
    assert all(summary["step_ours"] > 0 for summary in report["summaries"])
    assert [len(r["step_s"]) for r in report["runs"]] == [1, 4800 // 8, 1, 4800 // 8]  # batch 8: one per update
    table = (out / "bench.md").read_text()
    assert "Shape: tiny, GPT-NeoX with random weights" in table and "query 24 + response 8 tokens" in table
    assert "| sft.py | fp32 | 8 -> 4800 |" in table and "| dpo.py | fp32 | 8 -> 4800 |" in table


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


def test_per_step_medians_beside_the_rates(tmp_path):
    """Each run's step times (ours: time/update_s of its metrics.jsonl, in step order; TRL: the callback's file): the
    summary's per-step time of a side is the median over its runs' steps but each run's first, and ours / TRL per
    step is TRL's step time over ours; the table gives them under the rates."""
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 2, "time/update_s": 0.5}, {"step": 1, "time/update_s": 9.0}, {"step": 2, "eval/score": 1.0}]
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert bench_trl.step_times("ours", str(tmp_path / "x.log"), str(metrics)) == [9.0, 0.5]
    (tmp_path / "x.log.steps.json").write_text("[7.0, 2.0, 3.0]")
    assert bench_trl.step_times("trl", str(tmp_path / "x.log"), str(metrics)) == [7.0, 2.0, 3.0]
    assert bench_trl.step_times("before", str(tmp_path / "x.log"), str(tmp_path / "none.jsonl")) is None
    # ours: steps 1.0 and 2.0 after a slow first one (left out); TRL: 3.0 and 4.0, then 5.0 in the second run
    runs = [dict(run("reward", "ours", 0, 16, 10.0), step_s=[8.0, 1.0]),
            dict(run("reward", "ours", 0, 48, 12.0), step_s=[8.0, 2.0, 1.0]),
            dict(run("reward", "trl", 0, 16, 20.0), step_s=[9.0, 3.0]),
            dict(run("reward", "trl", 0, 48, 30.0), step_s=[9.0, 4.0, 5.0])]
    s = bench_trl.summarize(runs, "reward", "fp32")
    assert s["step_ours"] == pytest.approx(1.0) and s["step_trl"] == pytest.approx(4.0)
    assert s["step_ratio_trl"] == pytest.approx(4.0)
    assert s["ratio"] == pytest.approx((32 / 2) / (32 / 10))  # the two-run difference, as before
    text = bench_trl.table([s], ["CPU: test"], {"reward": "1.16.0"})
    assert "| reward.py | fp32 | 1.000 | 4.000 | **4.00** |" in text
    assert "| trainer | precision | ours s/step | TRL s/step | ours/TRL per step |" in text
    # runs without step times (a copy of the project from before time/update_s): no per-step table
    plain = bench_trl.summarize([dict(r, step_s=None) for r in runs], "reward", "fp32")
    assert plain["step_ours"] is None and "step_ratio_trl" not in plain
    assert "s/step" not in bench_trl.table([plain], ["CPU: test"], {"reward": "1.16.0"})


def test_the_trl_side_times_each_step_between_the_ends_of_two_steps(monkeypatch):
    """The TrainerCallback of TRL's side: training begins at t = 1, steps end at 3 and 6 -> steps of 2 and 3 s."""
    callback = bench_trl.StepTimes()
    monkeypatch.setattr(callback, "now", iter([1.0, 3.0, 6.0]).__next__)  # the clock, read after a GPU's sync
    callback.on_train_begin(None, None, None)
    callback.on_step_end(None, None, None)
    callback.on_step_end(None, None, None)
    assert callback.seconds() == [2.0, 3.0]


@pytest.mark.parametrize("trainer, group_flag, k", [("rloo", "--rloo_k", 2), ("grpo", "--group_size", 4)])
def test_group_trainers_run_our_script_with_the_settings_trl_gets(trainer, group_flag, k, monkeypatch):
    """rloo and grpo (issue 65): our command line parses as the script's own flags and holds the settings TRL's side
    reads (k, the KL coefficient, one epoch and one minibatch, the rollout one batch at a time)."""
    import importlib.util

    import tyro

    spec = importlib.util.spec_from_file_location(f"bench_{trainer}", os.path.join(REPO_ROOT, f"{trainer}.py"))
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # tyro reads the fields' docstrings from the module's source
    spec.loader.exec_module(script)
    s = bench_trl.settings_for("builtin")[trainer]
    assert s["k"] == k and s["rollout_forward_batch"] == s["batch"]
    paths = {"sft_model": "sft", "reward_model": "rm", "rows": "rows", "response_length": 24}
    cmd = bench_trl.our_command(trainer, "fp32", 128, paths, "/tmp/work", "name", s)
    assert cmd[1].endswith(f"{trainer}.py")
    args = tyro.cli(script.Args, args=cmd[2:], use_underscores=True)
    hp = getattr(args, trainer)
    assert getattr(args, group_flag[2:]) == k and hp.kl_coef == s["kl_coef"]
    assert (hp.num_ppo_epochs, hp.num_mini_batches) == (1, 1)
    assert (args.total_episodes, args.total_batch_size, args.local_micro_batch_size) == (128, 32, 16)
    assert args.local_rollout_forward_batch_size == 32 and args.query_once  # the default, what users run
    assert bench_trl.settings_for("pythia160m")[trainer]["rollout_forward_batch"] == 8


def test_phase_times_of_online_runs_and_their_table(tmp_path):
    """Each online step split into generation, scoring and training: ours from each update's time/*_share of its
    time/update_s (in step order, the first step left out), TRL's from the file its child wrote; the summary takes
    each side's median over its runs and the table prints them."""
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 2, "time/update_s": 2.0, "time/generation_share": 0.5, "time/scoring_share": 0.25,
             "time/training_share": 0.25},
            {"step": 1, "time/update_s": 9.0, "time/generation_share": 0.9, "time/scoring_share": 0.05,
             "time/training_share": 0.05},
            {"step": 3, "time/update_s": 4.0, "time/generation_share": 0.5, "time/scoring_share": 0.25,
             "time/training_share": 0.25}]
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    ours = bench_trl.phase_times("ours", str(tmp_path / "x.log"), str(metrics))
    assert ours == pytest.approx({"generation": 1.5, "scoring": 0.75, "training": 0.75})  # steps 2 and 3
    (tmp_path / "x.log.phases.json").write_text(json.dumps(
        [{"generation": 5.0, "scoring": 5.0, "training": 5.0}, {"generation": 1.0, "scoring": 2.0, "training": 3.0}]))
    trl = bench_trl.phase_times("trl", str(tmp_path / "x.log"), str(metrics))
    assert trl == pytest.approx({"generation": 1.0, "scoring": 2.0, "training": 3.0})
    assert bench_trl.phase_times("ours", str(tmp_path / "x.log"), str(tmp_path / "none.jsonl")) is None
    runs = [dict(run("grpo", "ours", 0, 128, 10.0), phases=ours), dict(run("grpo", "ours", 0, 512, 20.0), phases=ours),
            dict(run("grpo", "trl", 0, 128, 10.0), phases=trl), dict(run("grpo", "trl", 0, 512, 30.0), phases=trl)]
    s = bench_trl.summarize(runs, "grpo", "fp32")
    assert s["phases_ours"] == pytest.approx(ours) and s["phases_trl"] == pytest.approx(trl)
    text = bench_trl.table([s], ["CPU: test"], {"grpo": "1.16.0"})
    assert "| grpo.py | fp32 | 1.500 | 0.750 | 0.750 | 1.000 | 2.000 | 3.000 |" in text


@pytest.mark.slow
@pytest.mark.skipif(not (os.environ.get("RLHF_BENCH_TRL") and os.path.exists(TRL_VENV)),
                    reason="opt-in (RLHF_BENCH_TRL=1) and needs the TRL venv that python tools/bench_trl.py makes; "
                           "the benchmark stays out of CI")
def test_end_to_end_rloo_and_grpo_against_trl_at_the_tiny_shape(tmp_path):
    """RLOOTrainer and GRPOTrainer beside rloo.py and grpo.py: every run ends, TRL trains N / batch steps on N / k
    prompts, each of its completions exactly response_length tokens, and both sides' steps are split by phase."""
    out = tmp_path / "bench"
    cmd = [sys.executable, os.path.join(REPO_ROOT, "tools", "bench_trl.py"), "--shape", "tiny", "--trainers", "rloo",
           "grpo", "--rows", "16", "48", "--repeats", "1", "--precisions", "fp32", "--threads", "1", "--out", str(out)]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads((out / "bench.json").read_text())
    assert all(r["ok"] and r["phases"] for r in report["runs"])
    for r in report["runs"]:
        if r["side"] == "trl":
            assert len(r["step_s"]) == r["rows"] // 8  # batch 8
            log = open(r["log"]).read()
            assert "'completions/min_length': '8'" in log and "'completions/max_length': '8'" in log
    assert all(s["phases_ours"] and s["phases_trl"] for s in report["summaries"])
    assert "grpo.py vs TRL 1.16.0 GRPOTrainer" in (out / "bench.md").read_text()
