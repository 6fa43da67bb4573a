"""Issue 11: the detail ablations. A CI-sized run of two rows on one seed must produce the table, the CSV
and one plot per row with numbers in every cell; the data prepared from the upstream's raw rows must be
the upstream's data itself when no flag is toggled (so only the toggle differs); and the verdict rule
must call an effect only when it stands out from the seed-to-seed spread (or from a deterministic baseline)."""

import csv
import math
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import ablate  # noqa: E402


@pytest.mark.slow  # the end-to-end runs: in the full suite, out of the quick `-m "not slow"` check
@pytest.mark.xdist_group("ci_pipeline")  # the worker that runs the session's ci pipeline (conftest), run once
def test_ablate_ci_rows_2_and_7_write_table_csv_and_plots(ci_pipeline, tmp_path):
    """The upstream is the session's `pipeline.py --mode ci` folder (conftest), which holds the prep, SFT and RM that
    ablate.py would make with those very stages (test_a_missing_upstream_is_made_by_the_pipelines_first_stages)."""
    up, out = ci_pipeline[0], tmp_path / "ablations"
    cmd = [sys.executable, os.path.join(REPO_ROOT, "ablate.py"), "--mode", "ci", "--rows", "2", "7", "--seeds", "1",
           "--upstream", str(up), "--out", str(out), "--jobs", "2", "--threads", "1"]
    first = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    assert "is incomplete" not in first.stdout and "to run: the upstream" not in first.stdout  # taken as it is
    assert f"--sft_model_path {up / 'models' / 'sft'}" in first.stdout  # the baseline PPO starts from its SFT
    # a progress line per run: prep, 2 SFT, 2 probes, 2 PPO; two at a time, and the toggled SFT after its data
    assert first.stdout.count("--- [") == 7, first.stdout[-3000:]
    assert first.stdout.index("] prep_token_truncation: done") < first.stdout.index("=== [sft_token_truncation_s1]")

    text = (out / "ablations.md").read_text()
    for needle in ("Run time", "Machine", "CPU cores", "torch", "| detail | change | metric |", "- Detail 7: "):
        assert needle in text, needle
    assert text.startswith("Made with torch ") and "toggled" not in text
    assert "- Detail 15: " not in text and "- Detail 23: " not in text  # the notes of rows not run are left out
    with open(out / "ablations.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["detail"], r["metric"]) for r in rows] == [
        ("2", "SFT train queries cut mid-sentence (share)"), ("2", "SFT ROUGE-1"), ("2", "SFT gold score"),
        ("7", "PPO ratio, first minibatch (mean)"), ("7", "PPO ratio, first minibatch (variance over episodes)"),
        ("7", "PPO KL (last quarter of updates)")]
    for r in rows:
        assert r["n_baseline"] == "1" and r["n_toggled"] == "1", r
        for col in ("baseline_mean", "baseline_std", "toggled_mean", "toggled_std", "difference"):
            assert math.isfinite(float(r[col])), (r["metric"], col, r[col])
        assert r["verdict"] and r["verdict"] != "missing runs"
        assert f"| {r['detail']} | {r['toggle']} | {r['metric']} |" in text
    by_metric = {r["metric"]: r for r in rows}
    # Detail 2: paragraph truncation never leaves a post mid-sentence; token truncation does
    cut = by_metric["SFT train queries cut mid-sentence (share)"]
    assert float(cut["baseline_mean"]) == 0.0 and float(cut["toggled_mean"]) > 0.05
    assert cut["verdict"] == "yes"
    # Detail 7: without dropout the first minibatch's ratio is 1 and does not vary; with dropout it does
    ratio, var = (by_metric["PPO ratio, first minibatch (mean)"],
                  by_metric["PPO ratio, first minibatch (variance over episodes)"])
    assert abs(float(ratio["baseline_mean"]) - 1.0) < 1e-5 and float(var["baseline_mean"]) < 1e-10
    assert float(var["toggled_mean"]) > 1e-6 and var["verdict"] == "yes"
    for detail in (2, 7):
        plot = out / f"detail_{detail:02d}.png"
        assert plot.stat().st_size > 5000 and plot.name in text

    # restartable: a second invocation runs nothing and writes the same table
    again = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "7 runs, 7 done already" in again.stdout and "--- [" not in again.stdout


def test_a_missing_upstream_is_made_by_the_pipelines_first_stages(tmp_path):
    """An upstream folder without the prep, SFT and RM stages is made first by the pipeline in the ablation's mode,
    every other stage skipped (the ci run above takes a complete upstream, so this is where the branch is checked)."""
    up = tmp_path / "upstream"
    ab = ablate.Ablation(ablate.Args(mode="ci", upstream=str(up), out=str(tmp_path / "out"), rows=[2], dry_run=True))
    assert not ab.upstream_ready()
    cmd = ab.pipeline_cmd()
    assert cmd[1:6] == [os.path.join(REPO_ROOT, "pipeline.py"), "--mode", "ci", "--out", str(up)]
    import pipeline

    assert cmd[6] == "--skip" and set(cmd[7:]) == set(pipeline.FULL_STAGES) - {"prep", "sft", "rm"}
    for stage in ("prep", "sft", "rm"):  # ready once the three stages are marked done, not before
        assert not ab.upstream_ready()
        os.makedirs(up / "stages", exist_ok=True)
        (up / "stages" / f"{stage}.json").write_text("{}")
    assert ab.upstream_ready()


def test_reused_base_model_prep_reproduces_the_upstream_data(synthetic_task, tmp_path):
    """The toggled data of Details 2 and 3 is prepared from the upstream's raw rows and base-model tokenizer;
    with no toggle that path must give the upstream's own processed data, column for column."""
    from datasets import load_from_disk

    up = tmp_path / "upstream"
    up.mkdir()
    os.symlink(synthetic_task["root"], up / "data")
    ab = ablate.Ablation(ablate.Args(mode="ci", upstream=str(up), out=str(tmp_path / "out")))
    run = ab.prep_run("same", [])
    assert "--task" in run.cmd and "tldr" in run.cmd and "?" not in run.cmd
    subprocess.run(run.cmd, check=True, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
    assert os.path.exists(run.done_file)
    for name, splits in (("sft", ("train", "validation")), ("preference", ("train", "validation", "validation_cnndm"))):
        mine, theirs = (load_from_disk(str(tmp_path / "out" / "data" / "same" / name)),
                        load_from_disk(os.path.join(synthetic_task["root"], name)))
        for split in splits:
            assert mine[split].column_names == theirs[split].column_names
            assert mine[split].to_dict() == theirs[split].to_dict(), (name, split)


@pytest.mark.parametrize(
    "expect, baseline, toggled, verdict",
    [
        ("up", [1.0, 1.1, 0.9], [2.0, 2.1, 1.9], "yes"),
        ("down", [1.0, 1.1, 0.9], [2.0, 2.1, 1.9], "no: opposite"),
        ("up", [1.0, 2.0, 0.0], [0.9, 2.5, 0.2], "no: no clear effect"),  # +0.2 inside the seed-to-seed spread
        ("same", [1.0, 2.0, 0.0], [0.9, 2.5, 0.2], "yes"),
        # paired by seed: every seed moves +0.2 although the seeds differ by 1 among themselves
        ("up", [1.0, 2.0, 0.0], [1.2, 2.21, 0.19], "yes"),
        ("same", [1.0, 1.0, 1.0], [1.5, 1.5, 1.5], "no: higher"),  # deterministic values: any change counts
        ("away_from_1", [1.0, 1.0, 1.0], [0.9, 1.05, 0.95], "yes"),
        # a deterministic baseline (exactly 0 at every seed) and every toggled seed above it: an effect even
        # though the toggled values spread more than their mean (Detail 7's ratio variance)
        ("up", [0.0, 0.0, 0.0], [0.036, 0.0056, 0.0041], "yes"),
        ("up", [0.0, 0.0, 0.0], [0.036, -0.0056, 0.0041], "no: no clear effect"),  # not all on one side
        ("same", [0.5, 0.5, 0.5], [0.5 + 1e-8, 0.5, 0.5 - 1e-8], "yes"),  # rounding is no effect
        (None, [0.0, 0.1, 0.2], [1.0, 1.1, 1.2], "effect: higher (no prediction)"),
    ],
)
def test_verdict_needs_an_effect_beyond_twice_its_standard_error(tmp_path, expect, baseline, toggled, verdict):
    ab = ablate.Ablation(ablate.Args(mode="ci", upstream=str(tmp_path / "up"), out=str(tmp_path / "out")))
    metric = ablate.Metric("m", lambda *a: 0.0, expect, "")
    seeds = range(1, len(baseline) + 1)
    assert ab.verdict(metric, dict(zip(seeds, baseline)), dict(zip(seeds, toggled))) == verdict


def test_plan_flags_of_the_eos_trick_and_the_two_reward_models(tmp_path):
    """Row 23 runs both arms at the short response budget, differing by the toggle only; the unnormalised RM
    of row 15 repeats the upstream RM's settings while row 11's RMs take the ablation's shorter budget."""
    ab = ablate.Ablation(ablate.Args(rows=[11, 15, 23], seeds=[1], upstream=str(tmp_path / "up"),
                                     out=str(tmp_path / "out")))
    cmds = {run.key: run.cmd for run in ab.plan()}

    def flag(key, name):
        return cmds[key][cmds[key].index(name) + 1]

    short = str(ablate.EOS_TRICK_RESPONSE_LENGTH)
    assert flag("ppo_short_s1", "--response_length") == flag("ppo_short_no_eos_trick_s1", "--response_length") == short
    assert (flag("ppo_normalised_rm_s1", "--response_length") == str(ablate.pipeline.TASK["sft_response_length"])
            != short)
    only_toggled = set(cmds["ppo_short_no_eos_trick_s1"]) - set(cmds["ppo_short_s1"])
    # besides its names
    assert {a for a in only_toggled if "ppo_short_no_eos_trick_s1" not in a} == {"--no-non_eos_penalty"}
    upstream_rm = ablate.pipeline.flags_with(ablate.pipeline.SETTINGS["quickstart"]["rm"], {})
    assert flag("rm_unnormalised", "--total_episodes") == upstream_rm[upstream_rm.index("--total_episodes") + 1]
    assert flag("rm_baseline_s1", "--total_episodes") == ablate.BUDGET["default"]["rm"]["--total_episodes"]
    assert flag("rm_baseline_s1", "--total_episodes") != flag("rm_unnormalised", "--total_episodes")
    # row 15's two reward models are trained alike and differ by the normalisation alone
    differ = set(cmds["rm_unnormalised"]) ^ set(cmds["rm_normalised"])
    assert {a for a in differ if "rm_unnormalised" not in a and "rm_normalised" not in a} == {"--no-normalize_reward"}
