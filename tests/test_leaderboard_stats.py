"""The leaderboard's statistics over seeds (report.py): Student's t quantile of every count (scipy's, no 1.96 past a
table), Holm's step-down correction (statsmodels'), the paired t-interval of per-seed differences between methods,
a synthetic leaderboard where a method that is better on every seed, whose unpaired intervals overlap the
baseline's, is reported as beating it under the paired test, and the KL column's standard error over seeds."""

import json
import math
import os
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

import report


@pytest.mark.parametrize("level, n, expected", [
    (0.95, 2, 12.706), (0.95, 3, 4.303), (0.95, 4, 3.182), (0.95, 5, 2.776), (0.95, 11, 2.228), (0.95, 31, 2.042),
    (0.95, 121, 1.980), (0.99, 11, 3.169), (0.8, 6, 1.476)])
def test_the_seeds_t_interval_takes_the_t_quantile_of_the_tables(level, n, expected):
    """n values' interval at `level` is the mean -+ t(1/2 + level/2, n - 1) x sd / sqrt(n), t from the printed
    tables: the quantile and the degrees of freedom the report passes, whatever the count (past 10 seeds the
    interval once used 1.96, too narrow)."""
    values = list(np.linspace(0.4, 0.7, n))
    mean, low, high = report.mean_and_t_interval(values, level)
    assert mean == pytest.approx(0.55)
    assert (high - mean) / (np.std(values, ddof=1) / np.sqrt(n)) == pytest.approx(expected, abs=5e-4)
    assert mean - low == pytest.approx(high - mean, rel=1e-12)
    assert all(np.isnan(report.mean_and_t_interval([0.6])[1:]))


def test_holm_on_a_hand_example():
    """p = 0.01, 0.04, 0.03, 0.005 (m = 4). Sorted, 0.005 <= 0.05/4 and 0.01 <= 0.05/3 are rejected; 0.03 > 0.05/2
    stops the procedure, so 0.04 is kept too though it is below 0.05/1. Adjusted p: 4 x 0.005 = 0.02, 3 x 0.01 =
    0.03, 2 x 0.03 = 0.06, and for 0.04 the running maximum 0.06."""
    adjusted, levels = report.holm([0.01, 0.04, 0.03, 0.005])
    assert adjusted == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert levels == pytest.approx([0.05 / 3, 0.05 / 2, 0.05 / 2, 0.05 / 4])
    assert [a <= 0.05 for a in adjusted] == [True, False, False, True]
    assert report.holm([]) == ([], [])
    assert report.holm([0.2]) == ([0.2], [0.05])
    # every test rejected: each judged at its own step (0.001 at 0.05 / 2, then 0.002 at 0.05 / 1)
    assert report.holm([0.002, 0.001]) == (pytest.approx([0.002, 0.002]), pytest.approx([0.05, 0.025]))


def test_the_paired_interval_on_hand_numbers():
    """Differences 0.05, 0.08, 0.04 over 3 seeds: mean 0.05667, sample sd 0.020817, standard error 0.012019,
    t(0.975, 2) = 4.302653: the interval 0.05667 -+ 0.051712; t = 4.7148 and with 2 degrees of freedom the two-sided
    p = 1 - t / sqrt(t^2 + 2) = 0.04216. One comparison: Holm leaves it alone, and it beats."""
    [row] = report.paired_comparisons({"mine": [0.60, 0.70, 0.65], "base": [0.55, 0.62, 0.61]}, baselines=("base",))
    assert row["method"] == "mine" and row["baseline"] == "base"
    assert row["diffs"] == pytest.approx([0.05, 0.08, 0.04])
    assert row["mean"] == pytest.approx(0.0566667, abs=1e-6)
    assert (row["low"], row["high"]) == pytest.approx((0.0566667 - 0.051712, 0.0566667 + 0.051712), abs=1e-5)
    t = 0.0566667 / (0.0208167 / math.sqrt(3))
    assert (row["p"] == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-4)
            and row["p"] == pytest.approx(0.04216, abs=1e-4))
    assert row["p_holm"] == row["p"] and row["holm_level"] == 0.05
    assert (row["holm_low"], row["holm_high"]) == pytest.approx((row["low"], row["high"]), rel=1e-12)
    assert row["beats"] == "yes"
    # the other way round it does not beat (its interval lies below 0); one seed tells nothing
    [back] = report.paired_comparisons({"mine": [0.60, 0.70, 0.65], "base": [0.55, 0.62, 0.61]}, baselines=("mine",))
    assert back["beats"] == "no" and back["holm_high"] < 0
    [single] = report.paired_comparisons({"mine": [0.6], "base": [0.5]}, baselines=("base",))
    assert single["beats"] == "n/a" and np.isnan(single["p"])


def test_holm_corrects_across_every_pair_and_its_interval_agrees_with_its_rejections():
    """Two methods each 0.05, 0.08, 0.04 above one baseline (p = 0.04216 each): alone each would beat it at 0.05,
    but Holm across the two pairs adjusts both to 0.0843, and the corrected interval (97.5%) then holds 0. A pair
    compared both ways is one test: the baseline against the method adds nothing to the family."""
    rates = {"mine": [0.60, 0.70, 0.65], "base": [0.55, 0.62, 0.61], "other": [0.60, 0.70, 0.65]}
    rows = report.paired_comparisons(rates, baselines=("base",))
    assert [(r["method"], r["baseline"]) for r in rows] == [("mine", "base"), ("other", "base")]
    assert all(r["p"] == pytest.approx(0.04216, abs=1e-4) for r in rows)
    assert all(r["p_holm"] == pytest.approx(2 * r["p"]) and r["holm_level"] == 0.025 for r in rows)
    assert all(r["holm_low"] < 0 < r["holm_high"] and r["beats"] == "no" for r in rows)
    both_ways = report.paired_comparisons({"mine": rates["mine"], "base": rates["base"]}, baselines=("mine", "base"))
    assert report.distinct_pairs(both_ways) == 1 and [r["beats"] for r in both_ways] == ["yes", "no"]
    assert both_ways[0]["p_holm"] == both_ways[1]["p_holm"] == both_ways[0]["p"]
    rng = np.random.default_rng(0)
    rates = {f"m{i}": list(0.5 + 0.02 * i + rng.normal(0, 0.01, 5)) for i in range(6)}
    rows = report.paired_comparisons(rates, baselines=("m0", "m3"))
    assert report.distinct_pairs(rows) == 5 + 4  # m0 with the 5 others, m3 with the 4 others but m0
    for r in rows:  # the corrected interval excludes 0 exactly where Holm rejects
        assert (r["p_holm"] <= 0.05) == (r["holm_low"] > 0 or r["holm_high"] < 0), r
        assert (r["beats"] == "yes") == (r["p_holm"] <= 0.05 and r["mean"] > 0)


# ---------------------------------------------------------------- a synthetic leaderboard
SEEDS = [1, 2, 3, 4]
WIN = {  # RLOO is PPO plus about 0.03 on every seed; the seeds themselves differ by far more
    "sft": [0.22, 0.30, 0.26, 0.20],
    "ppo": [0.50, 0.64, 0.57, 0.45],
    "rloo": [0.530, 0.675, 0.595, 0.482],
    "dpo": [0.55, 0.58, 0.49, 0.60],
}
ARGS = {"sft": {}, "ppo": {"total_episodes": 1536, "total_batch_size": 32},
        "rloo": {"total_episodes": 1536, "total_batch_size": 32, "rloo_k": 2},
        "dpo": {"total_episodes": 960, "total_batch_size": 32}}


def fake_pipelines(out) -> list:
    """Per seed what write_leaderboard reads of a pipeline: its stages, run folder, report and stage markers."""
    pipelines = []
    for i, seed in enumerate(SEEDS):
        base = out / f"seed_{seed}"
        p = SimpleNamespace(stages=["prep", "sft", "rm", "ppo", "rloo", "dpo", "judge", "report"], extras={},
                            runs=str(base / "runs"), report_dir=str(base / "report"),
                            policies_order=lambda: ["sft", "ppo", "rloo", "dpo"], kind=lambda s: s,
                            judged_label=lambda s: s, marker=lambda s, base=base: str(base / "stages" / f"{s}.json"))
        os.makedirs(p.report_dir)
        os.makedirs(base / "stages")
        policies = []
        for stage, rates in WIN.items():
            rate = rates[i]
            policies.append({"policy": stage, "win_rate": rate, "ci_low": rate - 0.07, "ci_high": rate + 0.07, "n": 200,
                             "kl": 0.0 if stage == "sft" else 1.0 + i / 10, "kl_se": 0.0 if stage == "sft" else 0.05,
                             "length": 20.0, "eos_rate": 0.9})
            (base / "stages" / f"{stage}.json").write_text(json.dumps({"wall_time_s": 10.0, "peak_rss_mib": 500.0}))
            os.makedirs(os.path.join(p.runs, stage))
            (base / "runs" / stage / "args.json").write_text(json.dumps(ARGS[stage]))
        (base / "report" / "results.json").write_text(json.dumps({"policies": policies}))
        # pipeline.check_cpu's record
        (base / "cpu.json").write_text(json.dumps({"cpu": "CPU A, with AVX-512 (avx512f)"}))
        pipelines.append(p)
    return pipelines


def test_a_consistently_better_method_beats_under_the_paired_test_where_unpaired_intervals_overlap(tmp_path):
    _, ppo_low, ppo_high = report.mean_and_t_interval(WIN["ppo"])
    _, rloo_low, rloo_high = report.mean_and_t_interval(WIN["rloo"])
    assert rloo_low < ppo_high and ppo_low < rloo_high  # unpaired, the two cannot be told apart

    pipelines = fake_pipelines(tmp_path)
    (tmp_path / "cpu.json").write_text(json.dumps({"cpu": "CPU A, with AVX-512 (avx512f)"}))
    text = report.write_leaderboard(str(tmp_path), SEEDS, pipelines)
    assert "CPU type of every stage: CPU A, with AVX-512 (avx512f). Seeds 1, 2, 3, 4;" in text
    paired = pd.read_csv(tmp_path / "report" / "leaderboard_paired.csv")
    pairs = paired.set_index(["method", "baseline"])
    assert len(paired) == 9  # every method against the baselines (PPO, DPO, SFT) but itself: 6 distinct pairs
    rloo = pairs.loc[("rloo", "ppo")]
    assert rloo["mean"] == pytest.approx(0.0305) and rloo["holm_low"] > 0 and rloo["beats"] == "yes"
    assert rloo["p_holm"] <= 0.05 and rloo["holm_level"] < 0.05 and rloo["p"] < 0.001
    # every other comparison but the ones against SFT (every method is far above it on every seed) stays "no"
    beats = {key for key, row in pairs.iterrows() if row["beats"] == "yes"}
    assert beats == {("rloo", "ppo"), ("rloo", "sft"), ("ppo", "sft"), ("dpo", "sft")}
    for key, row in pairs.iterrows():  # the corrected interval excludes 0 exactly where Holm rejects
        assert (row["p_holm"] <= 0.05) == (row["holm_low"] > 0 or row["holm_high"] < 0), key

    # the main table: the beats column, and the CSV's per-baseline columns
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert list(rows)[2:] == ["SFT", "PPO", "RLOO", "DPO"]  # lines beginning "| " are the main table's alone
    assert " | PPO, SFT | " in rows["RLOO"] and " | SFT | " in rows["DPO"] and " | none | " in rows["SFT"]
    table = pd.read_csv(tmp_path / "report" / "leaderboard.csv").set_index("stage")
    assert table.loc["rloo", "beats_ppo"] == "yes" and table.loc["dpo", "beats_ppo"] == "no"
    assert pd.isna(table.loc["ppo", "beats_ppo"])
    # the paired table in the markdown: RLOO against PPO, its differences per seed, and yes
    line = next(line for line in text.splitlines() if line.startswith("RLOO | PPO | "))
    assert line.startswith("RLOO | PPO | +0.030 | +0.035 | +0.025 | +0.032 | ") and line.endswith("| yes")
    assert "Holm's correction across the 6 distinct pairs" in text
    # KL: the mean over seeds with the standard error of that mean from the seeds' spread (1.0, 1.1, 1.2, 1.3: sd
    # 0.12910, / sqrt(4) = 0.06455), not the seeds' own 0.05 each combined as independent (0.05 x 2 / 4 = 0.025:
    # the seeds answer the same prompts); the CSV keeps their own averaged
    assert " | 1.150 (0.065) | " in rows["RLOO"] and " | 0.000 (0.000) | " in rows["SFT"]
    assert table.loc["rloo", "kl_from_sft_se"] == pytest.approx(0.0645497, abs=1e-6)
    assert table.loc["rloo", "kl_from_sft_se_prompts"] == pytest.approx(0.05)
    assert "with the standard error of that mean from the spread over seeds (the seeds answer the same" in text


def test_one_seeds_kl_takes_its_own_standard_error_over_prompts(tmp_path):
    """With one seed there is no spread over seeds: the KL cell gives that seed's own standard error over its
    prompts, and the caption says so."""
    pipelines = fake_pipelines(tmp_path)
    text = report.write_leaderboard(str(tmp_path), SEEDS[:1], pipelines[:1])
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert " | 1.000 (0.050) | " in rows["RLOO"]
    assert "in nats, with its standard error over the prompts in parentheses" in text
    table = pd.read_csv(tmp_path / "report" / "leaderboard.csv").set_index("stage")
    assert table.loc["rloo", "kl_from_sft_se"] == pytest.approx(0.05)


# ---------------------------------------------------------------- the budget column
# settings that would give other numbers: the column must come from the counters, never from these
SETTINGS = {"total_episodes": 100, "total_batch_size": 10, "rloo_k": 3, "group_size": 5, "n": 7, "bon_num_prompts": 9,
            "mixture_size": 11, "num_train_epochs": 3, "beta": 4.0}


def counters(**values) -> dict:
    return {f"budget/{key}": value for key, value in values.items()}


@pytest.mark.parametrize("kind, summary, expected", [
    ("sft", counters(rows_read=20000, updates=1250), "20,000 reference summaries read, 1,250 updates"),
    ("ppo", counters(responses_sampled=1536, prompts=1536, updates=48),
     "1,536 sampled responses (1,536 prompts x 1), 48 updates"),
    ("rloo", counters(responses_sampled=1536, prompts=768, updates=48),
     "1,536 sampled responses (768 prompts x 2), 48 updates"),
    ("grpo", counters(responses_sampled=32, prompts=8, updates=2), "32 sampled responses (8 prompts x 4), 2 updates"),
    ("online_dpo", {**counters(responses_sampled=1536, prompts=768, updates=24), "online/pairs_total": 768,
                    "online/pairs_trained_total": 741},
     "1,536 sampled responses (768 prompts x 2; 27 pairs dropped), 24 updates"),
    # redrawn pairs (--max_draws_per_round > 1) are sampled on top of the flags' budget: the column shows them
    ("online_dpo", {**counters(responses_sampled=3072, prompts=1536, updates=24), "online/pairs_total": 1536,
                    "online/pairs_trained_total": 768},
     "3,072 sampled responses (1,536 prompts x 2; 768 pairs dropped), 24 updates"),
    ("dpo", counters(pairs_read=960, updates=30), "960 preference pairs, 30 updates"),
    ("ipo", counters(pairs_read=960, updates=1), "960 preference pairs, 1 update"),
    ("kto", counters(rows_read=1920, pairs_read=960, updates=30), "1,920 examples (960 pairs), 30 updates"),
    ("kto_unpaired", counters(rows_read=1920, updates=30), "1,920 thumbs up / down, 30 updates"),
    ("ilql", counters(rows_read=19200, updates=600), "19,200 RM-scored responses of the pairs, 600 updates, beta 4"),
    ("offline_best_of_n", counters(responses_sampled=3200, prompts=800, updates=25),
     "3,200 sampled responses (800 prompts x 4), 25 updates"),
    ("offline_rwr", {**counters(rows_read=2400, updates=75), "mixture/size": 2400},
     "2,400 SFT responses scored by the RM, 1 pass, 75 updates"),
    ("offline_dt", {**counters(rows_read=24000, updates=750), "mixture/size": 2400},
     "2,400 SFT responses scored by the RM, 10 passes, 750 updates"),
])
def test_the_budget_column_reads_the_runs_counters_not_their_settings(kind, summary, expected):
    assert report.budget(kind, SETTINGS, summary) == expected


def test_a_run_without_budget_counters_gets_a_note_not_its_settings():
    assert report.budget("ppo", SETTINGS, {"episodes": 100}) == \
        "unknown: summary.json has no budget/updates (a run older than the budget counters)"
    assert "budget/pairs_read" in report.budget("dpo", SETTINGS, counters(updates=3))
