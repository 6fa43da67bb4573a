"""The figures a reader looks at: no two texts overlap and none is cut off at the edge (tests/figures.py reads the
rendered extents), no two series of a panel share a colour and a marker, every method is named where it is drawn.
Checked on the leaderboard's figure (report.py's draw_leaderboard) and the frontier's (frontier.py's frontier_plot),
each drawn from hand-made tables of the shape the runs write; and the checks themselves on figures built to fail."""

import json
import os
import runpy
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from tests.conftest import REPO_ROOT  # noqa: E402
from tests.figures import overlapping_texts, rendered_texts, series_sharing_a_style  # noqa: E402

sys.path.insert(0, REPO_ROOT)
import frontier  # noqa: E402
import report  # noqa: E402


def test_the_checks_find_overlapping_and_cut_off_texts_and_series_alike():
    figure, (left, right) = plt.subplots(1, 2, figsize=(6, 3))
    left.text(0.5, 0.5, "first words", transform=left.transAxes)
    left.text(0.52, 0.5, "second words", transform=left.transAxes)  # on top of the first
    right.text(0.9, 0.5, "a label that runs past the figure's right edge", transform=right.transAxes)
    left.plot([0, 1], [0, 1], "o-", color="C0", label="one")
    left.plot([0, 1], [1, 0], "o-", color="C0", label="two")  # the same colour, marker and line
    right.plot([0, 1], [0, 1], "o-", color="C0", label="one, alone in its panel")
    problems = overlapping_texts(figure)
    assert "overlap: 'first words' and 'second words'" in problems
    assert any(p.startswith("cut off at the edge: \"a label that runs past") for p in problems)
    assert series_sharing_a_style(figure) == ["panel 0: 'one' and 'two' share ('#1f77b4', 'o', '-')"]
    plt.close(figure)

    figure, ax = plt.subplots(figsize=(6, 3))
    ax.plot([0, 1], [0, 1], "o-", color="C0", label="one")
    ax.plot([0, 1], [1, 0], "s-", color="C0", label="two")  # another marker: told apart
    ax.set(xlabel="x (units)", ylabel="y (units)", title="a clean figure")
    figure.tight_layout()
    assert overlapping_texts(figure) == [] and series_sharing_a_style(figure) == []
    assert {"x (units)", "y (units)", "a clean figure"} <= {text for text, _ in rendered_texts(figure)}
    plt.close(figure)


def leaderboard_tables(methods: int = 17, seeds: int = 5) -> tuple[pd.DataFrame, pd.DataFrame]:
    """leaderboard.csv and leaderboard_paired.csv as write_leaderboard makes them, for `methods` methods named as
    the leaderboard's (the longest names among them), their win rates drawn around spread-out means."""
    rng = np.random.default_rng(0)
    stages = list(report.NAMES)[:methods]
    means = dict(zip(stages, np.linspace(0.30, 0.62, len(stages))[rng.permutation(len(stages))]))
    means["ppo"] = 0.50
    rates = {stage: list(np.clip(means[stage] + rng.normal(0, 0.03, seeds), 0, 1)) for stage in stages}
    rates["rloo"] = [r + 0.2 for r in rates["ppo"]]  # above PPO (and every other method) on every seed alike
    rows = []
    for stage in stages:
        mean, low, high = report.mean_and_t_interval(rates[stage])
        rows.append({"stage": stage, "method": report.NAMES[stage],
                     **{f"seed_{s + 1}": r for s, r in enumerate(rates[stage])}, "mean": mean, "t_low": low,
                     "t_high": high, "kl_from_sft": np.nan if stage in ("ilql", "offline_dt") else rng.uniform(0, 1.6),
                     "kl_from_sft_se": 0.01})
    paired = pd.DataFrame([{k: v for k, v in c.items() if k != "diffs"} for c in report.paired_comparisons(rates)])
    return pd.DataFrame(rows), paired


def test_the_leaderboard_figure_reads_cleanly_sorted_and_names_every_method():
    table, paired = leaderboard_tables()
    figure = report.draw_leaderboard(table, paired)
    assert overlapping_texts(figure) == []
    assert series_sharing_a_style(figure) == []
    rate_ax, diff_ax, kl_ax = figure.axes
    names = [label.get_text() for label in rate_ax.get_yticklabels()]
    assert names == list(table.sort_values("mean").method)  # the lowest at the bottom, the best on top
    assert names[-1] == "RLOO" and len(set(names)) == len(table)
    legend = [text.get_text() for text in diff_ax.get_legend().get_texts()]
    assert "above PPO" in legend and "below PPO" in legend  # RLOO's interval lies above 0, SFT-like rows below
    texts = [text for text, _ in rendered_texts(figure)]
    assert texts.count("n/a") == 2 and "the reference" in texts  # ILQL and DT have no KL; PPO is the reference
    assert "[" not in figure._suptitle.get_text()
    low, high = rate_ax.get_xlim()  # a range that fits the data: every seed inside, no more than 10% to spare
    values = table[[c for c in table.columns if c.startswith("seed_")]].to_numpy()
    assert low <= values.min() and values.max() <= high and high - low <= 1.1 * (values.max() - values.min()) + 0.01
    plt.close(figure)


def test_report_py_redraws_the_leaderboard_figure_from_the_two_csvs(tmp_path, monkeypatch):
    table, paired = leaderboard_tables(methods=4, seeds=3)
    table.to_csv(tmp_path / "leaderboard.csv", index=False)
    paired.to_csv(tmp_path / "leaderboard_paired.csv", index=False)
    monkeypatch.setattr(sys, "argv", ["report.py", str(tmp_path)])
    runpy.run_path(os.path.join(REPO_ROOT, "report.py"), run_name="__main__")
    assert (tmp_path / "leaderboard.png").stat().st_size > 1000
    monkeypatch.setattr(sys, "argv", ["report.py", str(tmp_path / "nothing here")])
    with pytest.raises(SystemExit, match="usage: python report.py <folder>"):
        runpy.run_path(os.path.join(REPO_ROOT, "report.py"), run_name="__main__")


def frontier_points(seeds: int = 3) -> pd.DataFrame:
    """frontier_points.csv's columns the figure reads, for five methods whose curves end close together (the case
    where names at the lines' ends collide) and best-of-n at its KL bound."""
    rng, rows = np.random.default_rng(0), []
    for seed in range(1, seeds + 1):
        for method, reach in zip(["ppo", "rloo", "grpo", "online_dpo", "dpo"], [1.6, 0.8, 0.75, 1.5, 1.0]):
            for fraction in frontier.POINTS:
                kl = max(0.0, 1.5 * reach * fraction + rng.normal(0, 0.01))
                rows.append({"seed": seed, "method": method, "fraction": fraction, "n": np.nan, "kl": kl,
                             "gold_score": 0.5 + 0.3 * np.sqrt(kl) - 0.05 * kl, "proxy_score": 0.2 + 0.5 * kl})
        for n in frontier.BEST_OF_N:
            kl = frontier.best_of_n_kl_bound(n)
            rows.append({"seed": seed, "method": "best_of_n", "fraction": 0.0, "n": n, "kl": kl,
                         "gold_score": 0.5 + 0.2 * np.sqrt(kl), "proxy_score": 0.2 + 0.4 * kl})
    frame = pd.DataFrame(rows)
    frame["update"] = (frame.fraction * 16).round()
    frame["gold_win_rate"], frame["prompts"] = frame.gold_score - 0.2, 16
    return frame


@pytest.mark.slow  # about 5 s: the names are placed on a drawn figure
def test_the_frontier_figure_names_every_line_at_its_end_without_overlap():
    methods = ["ppo", "rloo", "grpo", "online_dpo", "dpo"]
    figure = frontier.frontier_plot(frontier_points(), [1, 2, 3], methods)
    assert overlapping_texts(figure) == []
    assert series_sharing_a_style(figure) == []
    for ax in figure.axes:
        names = {text.get_text() for text in ax.texts}
        assert names == {frontier.NAMES[m] for m in methods} | {"best-of-n (SFT) (KL: bound)"}
        assert ax.get_xlabel().endswith("nats)") and ax.get_ylabel().endswith(("points)", "logit)"))
    plt.close(figure)


def test_an_ablation_figure_names_its_arms_in_words_and_its_seeds_by_marker():
    import ablate

    values = {"baseline": "s1=0.281;s2=0.188;s3=0.281", "toggled": "s1=0.281;s2=0.188;s3=0.281"}
    lines = [{"detail": 23, "metric": metric, "baseline_values": base, "toggled_values": changed}
             for metric, base, changed in [
                 ("PPO rollouts ending with EOS, first update (share)", values["baseline"], values["toggled"]),
                 ("PPO rollouts ending with EOS, last quarter of updates (share)", "s1=0.95;s2=0.94;s3=0.945",
                  "s1=0.03;s2=0.035;s3=0.06"),
                 ("PPO EOS rate", "s1=0.99;s2=0.985;s3=1.0", "s1=0.0;s2=0.0;s3=0.0"),
                 ("PPO gold win rate", "s1=0.622;s2=0.617;s3=0.613", "s1=0.255;s2=0.257;s3=0.251")]]
    figure = ablate.detail_figure(23, lines)
    assert overlapping_texts(figure) == []
    assert series_sharing_a_style(figure) == []  # an arm's colour and a seed's marker tell every point apart
    texts = " ".join(text for text, _ in rendered_texts(figure))
    assert "toggled" not in texts and "changed:" in texts and "EOS trick off" in texts
    assert [t.get_text() for t in figure.legends[0].get_texts()] == ["seed 1", "seed 2", "seed 3"]
    plt.close(figure)


def test_the_length_controlled_plot_tells_seventeen_policies_apart():
    import judge

    rng = np.random.default_rng(0)
    rows = [{"label": stage, "bin_center": center, "n": int(n), "win_rate": rate,
             "ci_low": max(0.0, rate - 0.08), "ci_high": min(1.0, rate + 0.08)}
            for stage in list(report.NAMES)[:17] for center, n, rate in
            zip(np.linspace(-0.7, 0.65, 6), rng.integers(1, 300, 6), rng.uniform(0.1, 0.9, 6))]
    figure = judge.length_controlled_figure(pd.DataFrame(rows), "tokens")
    assert overlapping_texts(figure) == [] and series_sharing_a_style(figure) == []
    legend = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert legend == list(report.NAMES)[:17]
    assert not figure.axes[0].texts  # too many policies for the verdict counts at the points
    plt.close(figure)
    few = judge.length_controlled_figure(pd.DataFrame([r for r in rows if r["label"] in ("sft", "ppo")]), "tokens")
    assert overlapping_texts(few) == [] and len(few.axes[0].texts) == 12  # two policies: every point's count
    plt.close(few)


def test_the_reward_models_plots_read_cleanly():
    from rlhf_utils import records

    rng = np.random.default_rng(0)
    diffs = np.linspace(-2.9, 2.9, 10)
    calibration = {"validation": {"mean_diff": diffs, "accuracy": 1 / (1 + np.exp(-diffs)) + rng.normal(0, 0.03, 10),
                                  "n": rng.integers(50, 320, 10)},
                   "validation_cnndm": {"mean_diff": diffs[1:-1] + 0.1, "accuracy": rng.uniform(0, 1, 8),
                                        "n": rng.integers(1, 20, 8)}}
    figure = records.calibration_figure(calibration)
    assert overlapping_texts(figure) == [] and series_sharing_a_style(figure) == []
    assert len(figure.axes[0].texts) == 18  # every point's count, in its split's row
    plt.close(figure)
    rows = [{"logits": list(rng.normal(0, 1, length)), "ends_with_eos": length < 12} for length in (5, 6, 12, 9)]
    figure = records.reward_logits_figure(rows)
    assert overlapping_texts(figure) == [] and series_sharing_a_style(figure) == []
    plt.close(figure)


@pytest.mark.slow  # about 5 s: the names are placed on a drawn figure
def test_frontier_py_redraws_the_report_and_figure_from_the_committed_files(tmp_path, monkeypatch):
    frontier_points().to_csv(tmp_path / "frontier_points.csv", index=False)
    (tmp_path / "frontier_runs.json").write_text(json.dumps({"seeds": [1, 2, 3], "cpus": ["AMD EPYC, with AVX-512"],
                                                            "made_with": "made with: a test",
                                                            "wall_time_s": {"frontier_ppo": [60.0, 61.0, None]}}))
    monkeypatch.setattr(sys, "argv", ["frontier.py", str(tmp_path)])
    runpy.run_path(os.path.join(REPO_ROOT, "frontier.py"), run_name="__main__")
    text = (tmp_path / "frontier.md").read_text()
    assert "| RLOO |" in text and "Wall time of all stages and seeds: 2 min." in text
    assert (tmp_path / "frontier.png").stat().st_size > 10000
