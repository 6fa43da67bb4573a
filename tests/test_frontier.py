"""The over-optimisation frontier (frontier.py, pipeline.py --mode frontier): its points, its statistics on hand-made
curves, best-of-n's bound, and the ci-sized mode end to end (every point evaluated on the snapshot of its update, its
budget the share of the run it claims, and training unchanged by the snapshots)."""

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from tests.conftest import REPO_ROOT, assert_same_safetensors

sys.path.insert(0, REPO_ROOT)
import frontier  # noqa: E402
from pipeline import FRONTIER_KINDS  # noqa: E402


def test_points_are_the_fractions_rounded_half_up():
    assert frontier.point_updates(72) == [0, 5, 9, 18, 36, 54, 72]  # 72/16 = 4.5 -> 5
    assert frontier.point_updates(45) == [0, 3, 6, 11, 23, 34, 45]  # 22.5 -> 23, 33.75 -> 34
    assert frontier.point_updates(3) == [0, 1, 2, 3]  # few updates: fewer points, none repeated


def test_best_of_n_bound_is_the_formula():
    for n in frontier.BEST_OF_N:
        assert frontier.best_of_n_kl_bound(n) == pytest.approx(math.log(n) - (n - 1) / n, abs=1e-15)
    assert frontier.best_of_n_kl_bound(1) == 0.0
    assert frontier.best_of_n_kl_bound(32) == pytest.approx(3.4657359 - 0.96875, abs=1e-7)
    assert frontier.candidate_seed(7, 0) == 7  # candidate 1 is drawn with the evaluations' own seed


def test_matched_kl_interpolation_on_a_hand_made_curve():
    kls, gold = [0.0, 0.1, 0.3, 0.6, 1.2], [0.50, 0.55, 0.60, 0.70, 0.65]
    assert frontier.at_kl(kls, gold, 0.25) == pytest.approx(0.55 + 0.75 * 0.05)
    assert frontier.at_kl(kls, gold, 0.5) == pytest.approx(0.60 + (2 / 3) * 0.10)
    assert frontier.at_kl(kls, gold, 1.0) == pytest.approx(0.70 - (2 / 3) * 0.05)
    assert frontier.at_kl(kls, gold, 0.3) == 0.60  # on a point: that point
    assert frontier.at_kl(kls, gold, 2.0) is None  # never reached
    # the first crossing counts: a curve that overshoots and comes back is read where it first got there
    assert frontier.at_kl([0.0, 1.0, 0.2, 0.8], [0.5, 0.9, 0.1, 0.1], 0.5) == pytest.approx(0.7)


def hand_frame(rloo_shift: list[float]) -> pd.DataFrame:
    """Three seeds of PPO (KL 0 -> 1 -> 2, gold 0.5 -> 0.6 -> 0.7) and RLOO on the same KLs, its gold shifted per seed;
    RLOO's seed 3 stops at KL 0.4."""
    rows = []
    for seed in (1, 2, 3):
        for method, shift, kls in (("ppo", 0.0, [0.0, 1.0, 2.0]),
                                   ("rloo", rloo_shift[seed - 1], [0.0, 1.0, 2.0] if seed < 3 else [0.0, 0.2, 0.4])):
            for update, (kl, gold) in enumerate(zip(kls, [0.5, 0.6, 0.7])):
                rows.append({"seed": seed, "method": method, "update": update, "fraction": update / 2, "kl": kl,
                             "gold_win_rate": gold + shift * (update > 0), "gold_score": gold, "proxy_score": update})
    return pd.DataFrame(rows)


def test_matched_kl_table_pairs_seeds_that_reached_the_level_and_corrects_with_holm():
    rows = frontier.matched_kl_table(hand_frame([0.10, 0.20, 0.0]), [1, 2, 3], ["ppo", "rloo"])
    cell = {(r["method"], r["kl_level"]): r for r in rows}
    assert cell[("ppo", 0.5)]["per_seed"] == {1: pytest.approx(0.55), 2: pytest.approx(0.55), 3: pytest.approx(0.55)}
    assert cell[("rloo", 0.25)]["reached"] == 3 and cell[("rloo", 0.5)]["reached"] == 2  # seed 3 stops at 0.4
    # at KL 0.5 the pairs are seeds 1 and 2: differences 0.05 and 0.10 (half the shift: halfway to update 1)
    test = cell[("rloo", 0.5)]["test"]
    assert test["diffs"] == pytest.approx([0.05, 0.10])
    assert "test" not in cell[("ppo", 0.5)]  # PPO is the baseline, not a comparison
    family = [r["test"] for r in rows if "test" in r and not np.isnan(r["test"]["p"])]
    assert len(family) == 3  # rloo at 0.25, 0.5, 1.0
    for t in family:  # Holm widens every interval at least to its own unadjusted one
        assert t["holm_low"] <= t["low"] + 1e-12 and t["holm_high"] >= t["high"] - 1e-12
        assert t["p_holm"] >= t["p"]


def test_peak_and_last_tell_over_optimisation():
    rows = []
    for seed, noise in ((1, 0.0), (2, 0.01), (3, -0.01)):
        for update, (gold, proxy) in enumerate([(0.0, 0.0), (1.0, 1.0), (0.5, 2.0)]):
            rows.append({"seed": seed, "method": "ppo", "fraction": update / 2, "kl": update, "update": update,
                         "gold_score": gold + noise * update, "proxy_score": proxy})
    peak = frontier.peak_and_last(pd.DataFrame(rows), [1, 2, 3], "ppo")
    assert peak["peak_fraction"] == 0.5 and peak["gold"]["mean"] == pytest.approx(0.5)
    assert peak["proxy_rise"]["mean"] == pytest.approx(1.0) and peak["shows"]
    # gold still rising at the end: the best point is the last, nothing shows
    flat = pd.DataFrame(rows).assign(gold_score=lambda f: f.fraction)
    assert not frontier.peak_and_last(flat, [1, 2, 3], "ppo")["shows"]


def test_frontier_settings_are_the_leaderboards_at_the_budget_multiple():
    import pipeline

    settings, leaderboard = pipeline.frontier_settings("frontier", 1.5), pipeline.SETTINGS["leaderboard"]
    for stage in ("prep", "sft", "rm"):  # the leaderboard's own commands: an --out holding them reuses them
        assert settings[stage] == leaderboard[stage]
    for stage, episodes, updates in (("frontier_ppo", 2304, 72), ("frontier_rloo", 2304, 72),
                                     ("frontier_grpo", 2304, 72), ("frontier_online_dpo", 1152, 36),
                                     ("frontier_dpo", 1440, 45)):
        values = pipeline.flag_values(["x", *settings[stage]])
        assert int(values["--total_episodes"]) == episodes and values["--eval_every"] == "0", stage
        assert values["--save_policy_at"] == " ".join(map(str, frontier.point_updates(updates))), stage
        rest = {k: v for k, v in values.items() if k not in ("--total_episodes", "--eval_every", "--num_eval_samples",
                                                             "--save_policy_at")}
        assert rest == {k: v for k, v in pipeline.flag_values(["x", *leaderboard[FRONTIER_KINDS[stage]]]).items()
                        if k in rest}, stage  # every other flag the leaderboard's
    assert pipeline.frontier_settings("frontier", 1.0)["frontier_ppo"] != settings["frontier_ppo"]


def test_frontier_mode_reuses_a_finished_stage_of_this_commit_only(tmp_path):
    import pipeline

    p = pipeline.Pipeline(pipeline.Args(mode="frontier_ci", out=str(tmp_path / "frontier")))
    for stage, commit in (("sft", p.commit), ("rm", "0" * 40)):
        json.dump({"stage": stage, "commit": commit}, open(p.marker(stage), "w"))
    json.dump({"stage": "prep"}, open(p.marker("prep"), "w"))  # written before markers recorded their commit
    assert p.commit_reruns() == {"rm", "prep"}
    assert p.stages == pipeline.FRONTIER_STAGES and p.kind("frontier_online_dpo") == "online_dpo"
    assert p.command("frontier_online_dpo")[1].endswith("online_dpo.py")
    other = pipeline.Pipeline(pipeline.Args(mode="ci", out=str(tmp_path / "frontier")))
    assert other.commit_reruns() == set()  # the other modes keep their stages whatever commit made them
    from rlhf_utils.checks import RunError

    with pytest.raises(RunError, match="--mode frontier draws the project's five methods only"):
        pipeline.parse_extras(["x.py:rloo"], "frontier")


@pytest.mark.slow
@pytest.mark.xdist_group("ci_pipeline")  # reuses the session's ci pipeline (conftest): its prep, SFT and reward model
def test_frontier_ci_end_to_end(ci_pipeline, tmp_path):
    """--mode frontier_ci on the ci pipeline's task, SFT and reward model (the same commands: reused, not rerun):
    every method's snapshots at its points, each point evaluated on the weights of its update (digests recorded and
    checked), budget counters at the claimed share of the run, best-of-n's n = 1 the SFT policy's own sample, the
    report's three files; and two of the runs repeated without snapshots end with the same weights."""
    from transformers import AutoModelForCausalLM

    from rlhf_utils.models import weights_digest

    source, _ = ci_pipeline
    out = tmp_path / "frontier"
    out.mkdir()
    shutil.copytree(source / "data", out / "data")
    for stage in ("sft", "rm"):
        shutil.copytree(source / "models" / stage, out / "models" / stage)
    (out / "stages").mkdir()
    for name in ("prep.json", "sft.json", "rm.json"):
        shutil.copy(source / "stages" / name, out / "stages" / name)
    shutil.copy(source / "cpu.json", out / "cpu.json")
    cmd = [sys.executable, os.path.join(REPO_ROOT, "pipeline.py"), "--mode", "frontier_ci", "--out", str(out)]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for stage in ("prep", "sft", "rm"):
        assert f"=== [{stage}] done already" in result.stdout  # the ci pipeline's, reused

    points = json.load(open(out / "runs" / "frontier" / "points.json"))["rows"]
    sft = next(r for r in points if r["method"] == "sft")
    sft_weights = AutoModelForCausalLM.from_pretrained(out / "models" / "sft").state_dict()
    assert sft["digest"] == weights_digest(sft_weights) and sft["kl"] == 0.0
    for stage, kind in FRONTIER_KINDS.items():
        rows = sorted((r for r in points if r["stage"] == stage), key=lambda r: r["update"])
        summary = json.load(open(out / "runs" / stage / "summary.json"))
        num_updates = summary["budget/updates"]
        assert [r["update"] for r in rows] == frontier.point_updates(num_updates), stage
        assert rows[0]["digest"] == sft["digest"] and rows[0]["kl"] == 0.0  # update 0: the SFT policy itself
        assert len({r["digest"] for r in rows}) == len(rows)  # every update its own weights
        for r in rows:
            folder = out / "models" / stage / "snapshots" / f"update_{r['update']:06d}"
            loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
            assert weights_digest(loaded) == r["digest"], folder
            assert r["fraction"] == r["update"] / num_updates
            counters = [key for key in summary if key.startswith("budget/") and key in r]
            assert len(counters) >= 2, (stage, counters)  # updates, and what the updates read or sampled
            for key in counters:
                assert r[key] * num_updates == summary[key] * r["update"], (stage, key, r)
        # the last snapshot holds the final weights
        final = AutoModelForCausalLM.from_pretrained(out / "models" / stage).state_dict()
        assert weights_digest(final) == rows[-1]["digest"]

    bon = {r["n"]: r for r in points if r["method"] == "best_of_n"}
    assert sorted(bon) == list(frontier.BEST_OF_N)
    for n, r in bon.items():
        assert r["kl"] == frontier.best_of_n_kl_bound(n)
    for key in ("gold_win_rate", "gold_score", "proxy_score"):  # n = 1: the SFT policy's own evaluation sample
        assert bon[1][key] == sft[key]
    assert bon[32]["proxy_score"] >= bon[1]["proxy_score"]  # the RM's pick of 32 scores at least its first

    # a snapshot that holds other weights than its record says is refused, naming the folder
    folder = out / "models" / "frontier_dpo" / "snapshots" / "update_000001"
    record = json.load(open(folder / "snapshot.json"))
    json.dump({**record, "digest": "0" * 64}, open(folder / "snapshot.json", "w"))
    with pytest.raises(ValueError, match="update_000001"):
        frontier.loaded_snapshot(str(folder))

    report = out / "report"
    text = (report / "frontier.md").read_text()
    assert "## The over-optimisation frontier" in text and "In one sentence:" in text
    assert (report / "frontier.png").stat().st_size > 10_000
    table = pd.read_csv(report / "frontier_points.csv")
    assert set(table.method) == {"sft", "best_of_n", *FRONTIER_KINDS.values()}

    # evaluations change no training: DPO's and GRPO's runs again without snapshots end with the same weights
    for stage in ("frontier_dpo", "frontier_grpo"):
        marker = json.load(open(out / "stages" / f"{stage}.json"))
        command = [token.replace("{out}", str(out)).replace("{repo}", REPO_ROOT) for token in marker["command"]]
        command = command[:command.index("--save_policy_at")]  # the pipeline appends it last, with its updates
        command[command.index("--output_dir") + 1] = str(tmp_path / f"{stage}_plain")
        command[command.index("--run_name") + 1] = f"{stage}_plain"
        env = dict(os.environ, PYTHONPATH=REPO_ROOT, DS_ACCELERATOR="cpu", WANDB_MODE="disabled")
        plain = subprocess.run([sys.executable, *command], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                               timeout=600)
        assert plain.returncode == 0, plain.stderr[-3000:]
        assert_same_safetensors(out / "models" / stage / "model.safetensors",
                                tmp_path / f"{stage}_plain" / "model.safetensors")


def test_a_stage_the_seeds_share_counts_its_wall_time_once(tmp_path):
    """prep has one marker for every seed (pipeline.py's marker): the frontier's total wall time counts it once."""
    (tmp_path / "prep.json").write_text(json.dumps({"wall_time_s": 200.0}))

    class Seed:
        stages = ["prep", "sft"]

        def __init__(self, seed):
            (tmp_path / f"sft_{seed}.json").write_text(json.dumps({"wall_time_s": 10.0 * seed}))
            self.seed = seed

        def marker(self, stage):
            return str(tmp_path / ("prep.json" if stage == "prep" else f"sft_{self.seed}.json"))

    walls = frontier.stage_walls([Seed(1), Seed(2), Seed(3)])
    assert walls == {"prep": [200.0, None, None], "sft": [10.0, 20.0, 30.0]}
