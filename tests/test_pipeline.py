"""Issue 10: the one-command pipeline, CI-sized. Every artefact the report lists must be produced,
and a second invocation must skip the finished stages (restartable)."""

import csv
import json
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pipeline_ci_mode_produces_every_artefact(tmp_path):
    out = tmp_path / "qs"
    cmd = [sys.executable, os.path.join(REPO_ROOT, "pipeline.py"), "--mode", "ci", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=REPO_ROOT, timeout=1200)
    report = out / "report"
    text = (report / "results.md").read_text()
    results = json.loads((report / "results.json").read_text())
    policies = {r["policy"] for r in results["policies"]}
    assert {"sft", "ppo", "dpo"} <= policies
    # ILQL is judged once per swept beta (ilql.py --eval_betas default 0 1 4), never as one unnamed policy,
    # and gets no KL: its policy is the LM head shifted by the Q heads, which the LM alone does not give
    assert {"ilql_beta0", "ilql_beta1", "ilql_beta4"} <= policies and "ilql" not in policies
    assert all(r["kl"] is None for r in results["policies"] if r["policy"].startswith("ilql"))
    # nor does the Decision Transformer, whose samples follow a return-conditioned prompt; the others get one
    kl = {r["policy"]: r["kl"] for r in results["policies"]}
    assert kl["offline_dt"] is None and kl["sft"] == 0.0
    assert all(kl[p] is not None for p in ("ppo", "dpo", "offline_filter", "offline_rwr", "offline_best_of_n"))
    for row in results["policies"]:
        assert row["win_rate"] is not None and 0.0 <= row["win_rate"] <= 1.0, row
        assert row["ci_low"] <= row["win_rate"] <= row["ci_high"]
        assert 0.0 <= row["eos_rate"] <= 1.0 and row["length"] > 0
    assert results["ceiling"] is not None
    for plot in ("win_rate_per_policy.png", "ppo_rm_vs_gold.png", "length_controlled_win_rate.png", "rm_calibration.png",
                 "dt_targets.png"):
        assert (report / plot).stat().st_size > 1000, plot
        assert plot in text
    for heading in ("gold win rate", "Reward models", "rater confidence", "Wall time per stage", "PPO along training",
                    "Decision Transformer: outcome against the target"):
        assert heading in text
    # the Decision Transformer's Table 1: one row per target, the seed's targets and the mixture's percentiles
    with open(report / "dt_targets.csv") as f:
        dt = list(csv.DictReader(f))
    assert {-5.0, 0.0, 5.0} <= {float(row["target"]) for row in dt}
    assert sum(row["percentile"] != "" for row in dt) >= 2
    assert all(0.0 <= float(row["gold_win_rate"]) <= 1.0 and int(row["n"]) > 0 for row in dt)

    # restartable: nothing but the judge and the report runs again
    again = subprocess.run(cmd, check=True, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    for stage in ("prep", "sft", "rm", "ppo", "dpo"):
        assert f"[{stage}] done already" in again.stdout

    # a training stage interrupted after a checkpoint continues from it (ci mode checkpoints SFT every 2 updates)
    (out / "stages" / "sft.json").unlink()
    weights = (out / "models" / "sft" / "model.safetensors").read_bytes()
    resumed = subprocess.run(cmd, check=True, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert "[sft] interrupted earlier; continuing from its latest checkpoint" in resumed.stdout
    assert "--resume" in resumed.stdout and "resumed from" in resumed.stdout + resumed.stderr
    assert (out / "models" / "sft" / "model.safetensors").read_bytes() == weights  # the same model again


def test_gold_win_counts_a_tie_with_the_reference_as_half():
    sys.path.insert(0, REPO_ROOT)
    from report import gold_win

    post = "POST: so yesterday landlord sold furniture.\n\non top of that mom hid shoes.\n\nTL;DR:"
    ref = " landlord sold furniture."
    assert gold_win(post, ref, ref) == 0.5  # identical: whichever side is A wins the tie-break
    assert gold_win(post, " landlord sold furniture and mom hid shoes.", ref) == 1.0
    assert gold_win(post, " lol.", ref) == 0.0


def test_several_seeds_share_the_task_and_keep_their_own_runs(tmp_path):
    sys.path.insert(0, REPO_ROOT)
    import pipeline

    assert pipeline.resolve_seeds(pipeline.Args(mode="full")) == [1, 2, 3]
    assert pipeline.resolve_seeds(pipeline.Args(seed=4)) == [4]
    assert pipeline.resolve_seeds(pipeline.Args(mode="full", seeds=[5, 6])) == [5, 6]
    args = pipeline.Args(mode="full", out=str(tmp_path), seed=2)
    p = pipeline.Pipeline(args, seed_dir="seed_2", data_seed=1)
    prep, sft = p.cmd_prep(), p.cmd_sft()
    assert prep[prep.index("--seed") + 1] == "1"  # one task for every seed
    assert prep[prep.index("--output_dir") + 1] == str(tmp_path / "data")
    assert sft[sft.index("--seed") + 1] == "2"
    assert sft[sft.index("--output_dir") + 1] == str(tmp_path / "seed_2" / "models" / "sft")
    assert sft[sft.index("--base_model") + 1] == str(tmp_path / "data" / "base_model")
    assert p.marker("prep") == str(tmp_path / "stages" / "prep.json")
    assert p.marker("ppo") == str(tmp_path / "seed_2" / "stages" / "ppo.json")
    offline = p.cmd_offline("filter")  # the RM-labelled mixture depends on the seed's RM: not shared
    assert offline[offline.index("--cache_dir") + 1] == str(tmp_path / "seed_2" / "offline_cache")


def test_seed_report_gives_every_seed_with_mean_and_std(tmp_path):
    sys.path.insert(0, REPO_ROOT)
    from report import write_seed_report

    wins = {1: (0.30, 0.60), 2: (0.34, 0.70), 3: (0.32, 0.65)}
    for seed, (sft, ppo) in wins.items():
        (tmp_path / f"seed_{seed}" / "report").mkdir(parents=True)
        (tmp_path / f"seed_{seed}" / "report" / "results.json").write_text(json.dumps({
            "policies": [{"policy": "sft", "win_rate": sft}, {"policy": "ppo", "win_rate": ppo}],
            "rm": {"eval/validation/accuracy": 0.7 + seed / 100}, "dpo": {}, "ceiling": 0.78}))
    text = write_seed_report(str(tmp_path), [1, 2, 3])
    assert "| ppo gold win rate | 0.600 | 0.700 | 0.650 | 0.650 | 0.050 |" in text
    assert "| sft gold win rate | 0.300 | 0.340 | 0.320 | 0.320 | 0.020 |" in text
    assert "| reward model accuracy | 0.710 | 0.720 | 0.730 | 0.720 | 0.010 |" in text
    assert "| DPO-as-RM accuracy | n/a | n/a | n/a | n/a | n/a |" in text
    summary = json.loads((tmp_path / "report" / "seeds.json").read_text())
    assert abs(summary["metrics"]["ppo gold win rate"]["mean"] - 0.65) < 1e-9
    assert (tmp_path / "report" / "seeds_win_rate.png").stat().st_size > 1000
    import pytest

    with pytest.raises(FileNotFoundError, match="seed 4"):
        write_seed_report(str(tmp_path), [1, 4])
