"""Issue 10: the one-command pipeline, CI-sized. Every artefact the report lists must be produced,
and a second invocation must skip the finished stages (restartable)."""

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
    for row in results["policies"]:
        assert row["win_rate"] is not None and 0.0 <= row["win_rate"] <= 1.0, row
        assert row["ci_low"] <= row["win_rate"] <= row["ci_high"]
        assert 0.0 <= row["eos_rate"] <= 1.0 and row["length"] > 0
    assert results["ceiling"] is not None
    for plot in ("win_rate_per_policy.png", "ppo_rm_vs_gold.png", "length_controlled_win_rate.png", "rm_calibration.png"):
        assert (report / plot).stat().st_size > 1000, plot
        assert plot in text
    for heading in ("gold win rate", "Reward models", "Wall time per stage", "PPO along training"):
        assert heading in text

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
    from data.report import gold_win

    post = "POST: so yesterday landlord sold furniture.\n\non top of that mom hid shoes.\n\nTL;DR:"
    ref = " landlord sold furniture."
    assert gold_win(post, ref, ref) == 0.5  # identical: whichever side is A wins the tie-break
    assert gold_win(post, " landlord sold furniture and mom hid shoes.", ref) == 1.0
    assert gold_win(post, " lol.", ref) == 0.0
