"""Issue 10: the one-command pipeline, CI-sized. Every artefact the report lists must be produced,
and a second invocation must skip the finished stages (restartable)."""

import csv
import dataclasses
import json
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # the end-to-end runs: in the full suite, out of the quick `-m "not slow"` check
@pytest.mark.xdist_group("ci_pipeline")  # the worker that runs the session's ci pipeline (conftest) for test_ablate too
def test_pipeline_ci_mode_produces_every_artefact(ci_pipeline):
    """The leaderboard's stages at minimal sizes, with a fork outside the project named by --extra (conftest's
    `ci_pipeline`): every artefact of the report and of the leaderboard is written, every method is a row, and the
    fork is one of them."""
    out, cmd = ci_pipeline
    report = out / "report"
    text = (report / "results.md").read_text()
    results = json.loads((report / "results.json").read_text())
    policies = {r["policy"] for r in results["policies"]}
    assert {"sft", "ppo", "rloo", "grpo", "grpo_rule", "reinforce_pp", "reinforce_pp_baseline", "online_dpo", "dpo",
            "ipo", "kto", "kto_unpaired", "my_rloo"} <= policies

    # the leaderboard: one row a method in the pipeline's order, the fork's row last, the plot beside it
    board = (report / "leaderboard.md").read_text()
    methods = [line.split(" | ")[0].lstrip("| ") for line in board.splitlines() if line.startswith("| ")][2:]
    assert methods == ["SFT", "PPO", "RLOO", "GRPO", "GRPO (rule reward)", "REINFORCE++", "REINFORCE++-baseline",
                       "online DPO (RM judge)", "DPO", "IPO", "KTO (pairs)",
                       "KTO (thumbs up / down)", "ILQL", "MLE with filtering", "RWR", "Decision Transformer",
                       "best-of-n", "my_rloo (fork of rloo.py's stage rloo)"]
    import pandas as pd

    table = pd.read_csv(report / "leaderboard.csv")
    assert (table["seed_1"].between(0, 1).all() and (table["wall_time_s"] > 0).all()
            and (table["peak_rss_mib"] > 100).all())
    no_kl = set(table.loc[table["kl_from_sft"].isna(), "stage"])
    assert no_kl == {"ilql", "offline_dt"}
    budgets = table.set_index("stage")["budget"]  # from the runs' counters (summary.json budget/*)
    assert budgets["grpo"] == budgets["reinforce_pp_baseline"] == "32 sampled responses (8 prompts x 4), 2 updates"
    assert budgets["reinforce_pp"] == "32 sampled responses (32 prompts x 1), 2 updates"
    assert budgets["ppo"] == "32 sampled responses (32 prompts x 1), 2 updates"
    assert budgets["online_dpo"].startswith("32 sampled responses (16 prompts x 2") and budgets["online_dpo"].endswith(
        "), 1 update")  # ci: --total_episodes 16 prompts, nothing redrawn
    assert budgets["dpo"] == "32 preference pairs, 2 updates" and budgets["kto"] == "32 examples (16 pairs), 2 updates"
    assert (report / "leaderboard.png").stat().st_size > 1000
    # ILQL is judged once per swept beta (ilql.py --eval_betas default 0 1 4), never as one unnamed policy,
    # and gets no KL: its policy is the LM head shifted by the Q heads, which the LM alone does not give
    assert {"ilql_beta0", "ilql_beta1", "ilql_beta4"} <= policies and "ilql" not in policies
    assert all(r["kl"] is None for r in results["policies"] if r["policy"].startswith("ilql"))
    # nor does the Decision Transformer, whose samples follow a return-conditioned prompt; the others get one
    kl = {r["policy"]: r["kl"] for r in results["policies"]}
    assert kl["offline_dt"] is None and kl["sft"] == 0.0
    assert all(kl[p] is not None for p in ("ppo", "rloo", "dpo", "offline_filter", "offline_rwr", "offline_best_of_n"))
    for row in results["policies"]:
        assert row["win_rate"] is not None and 0.0 <= row["win_rate"] <= 1.0, row
        assert row["ci_low"] <= row["win_rate"] <= row["ci_high"]
        assert 0.0 <= row["eos_rate"] <= 1.0 and row["length"] > 0
    assert results["ceiling"] is not None
    for plot in ("win_rate_per_policy.png", "ppo_rm_vs_gold.png", "length_controlled_win_rate.png",
                 "rm_calibration.png", "dt_targets.png"):
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


def test_gold_win_reads_the_texts_as_the_judge_does():
    """issue 33: an EOS spelling at the end is stripped first, and what is then identical is a tie (judge.py's rule)."""
    sys.path.insert(0, REPO_ROOT)
    from report import gold_win

    post = "POST: so yesterday landlord sold furniture.\n\non top of that mom hid shoes.\n\nTL;DR:"
    ref = " landlord sold furniture."
    assert gold_win(post, ref + "<|endoftext|>", ref) == 0.5
    assert gold_win(post, ref, ref + " <|endoftext|><|endoftext|>") == 0.5
    assert gold_win(post, " landlord sold furniture and mom hid shoes.", ref + "<|endoftext|>") == 1.0


def test_several_seeds_share_the_task_and_keep_their_own_runs(tmp_path):
    sys.path.insert(0, REPO_ROOT)
    import pipeline

    assert pipeline.resolve_seeds(pipeline.Args(mode="full")) == [1, 2, 3]
    assert pipeline.resolve_seeds(pipeline.Args(seed=4)) == [4]
    assert pipeline.resolve_seeds(pipeline.Args(mode="full", seeds=[5, 6])) == [5, 6]
    assert pipeline.resolve_seeds(pipeline.Args(mode="leaderboard")) == [1, 2, 3, 4, 5]  # the paired test's 5 seeds
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


# ---------------------------------------------------------------- issue 33: output folders count only when complete
def fake_stage_output(p, stage: str, complete: bool) -> None:
    """What a training stage leaves: its stage marker, its samples and its model folder, whose run.json holds
    "complete": true only when the run finished (the training scripts write it last)."""
    import pathlib

    pathlib.Path(p.marker(stage)).write_text(json.dumps({"stage": stage, "wall_time_s": 1.0}))
    os.makedirs(os.path.join(p.runs, stage), exist_ok=True)
    pathlib.Path(p.runs, stage, "samples.csv").write_text("query,response,reference\nq,r,x\n")
    os.makedirs(os.path.join(p.models, stage), exist_ok=True)
    pathlib.Path(p.models, stage, "run.json").write_text(
        json.dumps({"run_name": stage, **({"complete": True} if complete else {})}))


def small_pipeline(tmp_path):
    sys.path.insert(0, REPO_ROOT)
    import pipeline

    p = pipeline.Pipeline(pipeline.Args(out=str(tmp_path)))
    os.makedirs(p.data, exist_ok=True)
    return p


def test_a_stage_counts_as_done_only_when_its_outputs_are_complete(tmp_path):
    p = small_pipeline(tmp_path)
    open(p.marker("prep"), "w").write("{}")
    assert not p.done("prep") and "has no task.json" in p.incomplete("prep")  # prep killed before task.json
    open(os.path.join(p.data, "task.json"), "w").write("{}")
    assert p.done("prep")
    fake_stage_output(p, "sft", complete=False)
    assert not p.done("sft")
    assert p.incomplete("sft") == (f"{p.models}/sft is incomplete: its run.json lacks \"complete\": true (its run "
                                   "stopped before the end, or is still running)")
    fake_stage_output(p, "sft", complete=True)
    assert p.done("sft") and p.incomplete("sft") is None
    os.remove(os.path.join(p.models, "sft", "run.json"))
    assert not p.done("sft") and "has no readable run.json" in p.incomplete("sft")


def test_a_seed_is_finished_only_on_the_cpu_type_it_started_on(tmp_path, monkeypatch, capsys):
    """Seeded digits hold on one CPU type: a seed resumed on another reruns every stage from the start (an interrupted
    one with --restart, not --resume), and one whose task came from another type reruns the task too."""
    sys.path.insert(0, REPO_ROOT)
    import pipeline

    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    assert pipeline.cpu_type().endswith(f"{'with' if 'avx512f' in flags else 'without'} AVX-512 (avx512f)")
    args = pipeline.Args(mode="full", out=str(tmp_path))

    def seed_pipeline(cpu):  # seed 2's pipeline on a machine of CPU type `cpu`
        monkeypatch.setattr(pipeline, "cpu_type", lambda: cpu)
        p = pipeline.Pipeline(dataclasses.replace(args, seed=2), seed_dir="seed_2", data_seed=1)
        p.stages, ran = ["prep", "sft", "rm"], []
        p.run = lambda stage, cmd: ran.append((stage, cmd[-1])) or (
            fake_stage_output(p, stage, complete=True) if stage != "prep" else
            open(os.path.join(p.data, "task.json"), "w").write("{}"))
        return p, ran

    p, ran = seed_pipeline("CPU A")
    os.makedirs(p.data, exist_ok=True)
    p.main()
    assert [stage for stage, _ in ran] == ["prep", "sft", "rm"]
    assert (json.load(open(tmp_path / "cpu.json")) == json.load(open(tmp_path / "seed_2" / "cpu.json"))
            == {"cpu": "CPU A"})
    assert json.load(open(p.marker("sft")))["cpu"] == "CPU A"
    p, ran = seed_pipeline("CPU A")
    p.main()
    assert ran == []  # the same type: every stage done
    os.makedirs(os.path.join(p.runs, "rm", "checkpoints", "update_000002"))  # as if rm had been interrupted on type A
    os.remove(os.path.join(p.models, "rm", "run.json"))
    json.dump({"cpu": "CPU B"}, open(tmp_path / "cpu.json", "w"))  # as if another seed had remade the task on type B
    json.dump({"stage": "prep", "cpu": "CPU B"}, open(p.marker("prep"), "w"))
    p, ran = seed_pipeline("CPU B")
    p.main()  # the task stays; the seed's stages rerun, the interrupted one started over
    assert [stage for stage, _ in ran] == ["sft", "rm"] and ran[1][1] == "--restart" and ran[0][1] != "--resume"
    assert "ran on another CPU type (CPU A; this one: CPU B)" in capsys.readouterr().out
    assert json.load(open(tmp_path / "seed_2" / "cpu.json")) == {"cpu": "CPU B"}
    json.dump({"stage": "rm", "cpu": "CPU A"}, open(p.marker("rm"), "w"))  # a rerun on B cut short before rm
    p, ran = seed_pipeline("CPU B")
    p.main()
    assert [stage for stage, _ in ran] == ["rm"]  # its marker still names type A
    p, ran = seed_pipeline("CPU C")  # the task too: prep and every stage rerun
    p.main()
    assert [stage for stage, _ in ran] == ["prep", "sft", "rm"]


def test_pipeline_reruns_an_incomplete_stage_and_stops_when_a_stage_ends_incomplete(tmp_path, capsys):
    import pytest

    p = small_pipeline(tmp_path)
    open(os.path.join(p.data, "task.json"), "w").write("{}")
    fake_stage_output(p, "sft", complete=False)
    ran = []

    def fake_run(stage, cmd, complete=True):
        ran.append(stage)
        fake_stage_output(p, stage, complete=complete)

    p.stages, p.run = ["sft"], fake_run
    p.main()  # marked done, but incomplete: it runs again
    assert ran == ["sft"] and "[sft] marked done, but" in capsys.readouterr().out
    p.main()  # complete now: skipped
    assert ran == ["sft"]
    p.args.force = ["sft"]
    p.run = lambda stage, cmd: fake_run(stage, cmd, complete=False)  # the command ends, the folder is incomplete
    with pytest.raises(RuntimeError,
                       match=r"\[sft\] ended, but .*models/sft is incomplete.*python pipeline.py --force sft"):
        p.main()


def test_judge_and_report_stages_name_the_incomplete_folder_and_the_stage_to_rerun(tmp_path):
    import pytest

    sys.path.insert(0, REPO_ROOT)
    import report

    p = small_pipeline(tmp_path)
    open(os.path.join(p.data, "task.json"), "w").write("{}")
    for stage in ("sft", "rm", "dpo"):
        fake_stage_output(p, stage, complete=True)
    fake_stage_output(p, "ppo", complete=False)
    with pytest.raises(RuntimeError, match=rf"judge: {p.models}/ppo is incomplete: .*; rerun that stage: python "
                                           r"pipeline.py --force ppo"):
        p.stage_judge()
    with pytest.raises(ValueError, match=rf"report: {p.models}/ppo is incomplete: .*; rerun that stage: python "
                                         r"pipeline.py --force ppo"):
        report.write_report(p)
    assert not os.path.exists(p.report_dir)
    fake_stage_output(p, "ppo", complete=True)
    fake_stage_output(p, "rm", complete=False)  # the report reads the reward model's summary too
    with pytest.raises(ValueError, match=rf"report: {p.models}/rm is incomplete: .*--force rm"):
        report.write_report(p)
    os.remove(os.path.join(p.data, "task.json"))
    with pytest.raises(ValueError, match=r"has no task.json .*--force prep"):
        report.write_report(p)


def captured_figure(monkeypatch):
    """The figures report.py closes, kept for inspection."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    return figures


def assert_legend_inside_and_gold_axis_0_to_1(fig) -> None:
    rm_axis, gold_axis = fig.axes
    assert gold_axis.get_ylim() == (0.0, 1.0)
    assert not fig.legends, "no legend hung on the figure's edge"
    legend = gold_axis.get_legend()
    fig.canvas.draw()
    box, axes_box = legend.get_window_extent(), gold_axis.get_window_extent()
    assert axes_box.x0 <= box.x0 and box.x1 <= axes_box.x1 and axes_box.y0 <= box.y0 and box.y1 <= axes_box.y1
    labels = [text.get_text() for text in legend.get_texts()]
    assert "RM score" in labels and "gold win rate" in labels


def test_ppo_plot_keeps_its_legend_inside_and_the_gold_axis_from_0_to_1(tmp_path, monkeypatch):
    sys.path.insert(0, REPO_ROOT)
    import pandas as pd

    import report

    figures = captured_figure(monkeypatch)
    curve = pd.DataFrame({"step": [8, 16, 24, 32, 40, 48], "rm_score": [0.1, 0.5, 0.9, 1.2, 1.4, 1.5],
                          "gold_win_rate": [0.30, 0.40, 0.50, 0.55, 0.60, 0.58]})
    report.rm_and_gold_plot(curve, "step", "PPO update", "mean RM score", "PPO", str(tmp_path), "ppo.png")
    assert (tmp_path / "ppo.png").stat().st_size > 1000
    assert_legend_inside_and_gold_axis_0_to_1(figures[-1])
    # 1.5 and a margin, so no point sits on the frame
    assert figures[-1].axes[0].get_ylim() == pytest.approx((0.0, 1.575))
    # a change of 0.03 in the RM score is drawn on a 0-1 axis as the gold win rate is, not zoomed into a leap
    flat = curve.assign(rm_score=[0.852, 0.86, 0.87, 0.875, 0.88, 0.883])
    report.rm_and_gold_plot(flat, "step", "PPO update", "mean RM score", "PPO", str(tmp_path), "flat.png")
    assert figures[-1].axes[0].get_ylim() == (0.0, 1.0)


def test_the_ppo_curve_starts_at_update_0_with_the_sft_samples(tmp_path):
    sys.path.insert(0, REPO_ROOT)
    import types

    import pandas as pd

    import report

    rows = {"query": ["q1", "q2"], "reference": ["a", "b"], "response_token_len": [3, 4], "has_eos": [True, True]}
    (tmp_path / "ppo" / "samples").mkdir(parents=True)
    (tmp_path / "sft").mkdir()
    pd.DataFrame({**rows, "response": ["a", "x"], "score": ["", ""]}).to_csv(tmp_path / "sft" / "samples.csv",
                                                                             index=False)
    pd.DataFrame({**rows, "response": ["a", "b"], "score": [0.5, 0.7]}).to_csv(
        tmp_path / "ppo" / "samples" / "step_000008.csv", index=False)
    curve = report.ppo_curve(types.SimpleNamespace(runs=str(tmp_path)))
    assert (list(curve["step"]) == [0, 8] and pd.isna(curve["rm_score"][0])
            and curve["rm_score"][1] == pytest.approx(0.6))
    assert curve["gold_win_rate"][1] == 0.5  # both responses equal their references: ties


def test_seed_report_draws_the_ppo_seed_band(tmp_path, monkeypatch):
    sys.path.insert(0, REPO_ROOT)
    import numpy as np
    import pandas as pd

    import report

    figures = captured_figure(monkeypatch)
    for seed, shift in ((1, 0.0), (2, 0.1), (3, -0.05)):
        (tmp_path / f"seed_{seed}" / "report").mkdir(parents=True)
        (tmp_path / f"seed_{seed}" / "report" / "results.json").write_text(json.dumps({
            "policies": [{"policy": "ppo", "win_rate": 0.6 + shift}], "rm": {}, "dpo": {}, "ceiling": 0.78}))
        pd.DataFrame({"step": [8, 16, 24], "rm_score": [0.2 + shift, 0.8 + shift, 1.1 + shift],
                      "gold_win_rate": [0.40 + shift, 0.55 + shift, 0.60 + shift]}).to_csv(
            tmp_path / f"seed_{seed}" / "report" / "ppo_overoptimisation.csv", index=False)
    text = report.write_seed_report(str(tmp_path), [1, 2, 3])
    assert ("ppo_rm_vs_gold_seeds.png" in text
            and (tmp_path / "report" / "ppo_rm_vs_gold_seeds.png").stat().st_size > 1000)
    band = pd.read_csv(tmp_path / "report" / "ppo_overoptimisation_seeds.csv")
    assert list(band["step"]) == [8, 16, 24]
    assert (np.allclose(band["gold_win_rate_low"], [0.35, 0.50, 0.55])
            and np.allclose(band["gold_win_rate_high"], [0.5, 0.65, 0.7]))
    assert np.allclose(band["rm_score"], [0.2 + 0.05 / 3, 0.8 + 0.05 / 3, 1.1 + 0.05 / 3])
    fig = figures[-1]
    assert_legend_inside_and_gold_axis_0_to_1(fig)
    assert sum(len(ax.collections) for ax in fig.axes) == 2, "one band for the RM score, one for the gold win rate"


# ---------------------------------------------------------------- issue 40: one pipeline per folder, stages by command
def fake_stages(p, ran: list) -> None:
    """Stage commands that only leave what the real ones leave (prep's task.json, a complete model folder)."""
    import pathlib

    def run(stage, cmd):
        ran.append((stage, cmd))
        if stage == "prep":
            os.makedirs(p.data, exist_ok=True)
            pathlib.Path(p.data, "task.json").write_text("{}")
        else:
            fake_stage_output(p, stage, complete=True)

    p.run = run


def test_a_stage_finished_with_another_command_is_refused_unless_forced(tmp_path):
    """Two seeds into one --out, one after the other: before, the second found seed 1's stages marked done and
    reported them as its own. Now each stage marker records its command (relative to --out and the repository), and
    another command stops the pipeline naming the flags; --threads is not part of a command."""
    sys.path.insert(0, REPO_ROOT)
    import pipeline
    from rlhf_utils.checks import RunError

    ran = []
    first = pipeline.Pipeline(pipeline.Args(out=str(tmp_path), seed=1))
    first.stages = ["prep", "sft"]
    fake_stages(first, ran)
    first.main()
    assert [stage for stage, _ in ran] == ["prep", "sft"]
    recorded = json.load(open(first.marker("sft")))["command"]
    assert recorded[:7] == ["{repo}/sft.py", "--seed", "1", "--run_name", "sft", "--run_dir_root", "{out}/runs"]

    second = pipeline.Pipeline(pipeline.Args(out=str(tmp_path), seed=2))
    second.stages = ["prep", "sft"]
    fake_stages(second, ran)
    with pytest.raises(RunError) as refused:
        second.main()
    assert str(refused.value) == (f"[prep] finished in {tmp_path} with another command than this pipeline asks (--seed "
                                  "1 then, 2 now); pass --force prep to redo it (--force all: every stage), "
                                  "or another --out")
    assert len(ran) == 2  # nothing ran

    again = pipeline.Pipeline(pipeline.Args(out=str(tmp_path), seed=1, threads=3))  # the same commands
    again.stages = ["prep", "sft"]
    fake_stages(again, ran)
    again.main()
    assert len(ran) == 2  # both done already

    second.args.force = ["all"]
    second.main()
    assert [stage for stage, _ in ran[2:]] == ["prep", "sft"]
    assert json.load(open(second.marker("prep")))["command"][-2:] == ["--seed", "2"]


def test_what_works_on_the_quickstart_folder_asks_its_commands(tmp_path):
    """--mode full (three seeds) shares the quickstart's task, ablate.py's upstream pipeline asks the quickstart's
    prep, SFT and RM, and a moved folder keeps its commands: none of them is refused."""
    sys.path.insert(0, REPO_ROOT)
    import tyro

    import ablate
    import pipeline

    quickstart = pipeline.Pipeline(pipeline.Args(out=str(tmp_path)))
    full = pipeline.Pipeline(pipeline.Args(mode="full", out=str(tmp_path), seed=2), seed_dir="seed_2", data_seed=1)
    assert full.recorded(full.cmd_prep()) == quickstart.recorded(quickstart.cmd_prep())
    upstream = ablate.Ablation(ablate.Args(upstream=str(tmp_path), out=str(tmp_path / "ablations")))
    asked = pipeline.Pipeline(tyro.cli(pipeline.Args, args=upstream.pipeline_cmd()[2:]))
    for stage in ("prep", "sft", "rm"):
        command = getattr(asked, f"cmd_{stage}")()
        assert asked.recorded(command) == quickstart.recorded(getattr(quickstart, f"cmd_{stage}")())
    moved = pipeline.Pipeline(pipeline.Args(out=str(tmp_path / "elsewhere")))
    assert moved.recorded(moved.cmd_ppo()) == quickstart.recorded(quickstart.cmd_ppo())


def test_a_second_pipeline_on_one_folder_is_refused_in_one_line(tmp_path, monkeypatch):
    """Two pipelines started 1 s apart into one --out both ended "pipeline finished" on a mixed folder. The first
    holds <out>/pipeline.lock while it runs (here a stand-in process); the second stops at once, in one line."""
    import psutil

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        lock = tmp_path / "pipeline.lock"
        lock.write_text(json.dumps({"host": os.uname().nodename, "pid": holder.pid,
                                    "started": psutil.Process(holder.pid).create_time()}))
        result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "pipeline.py"), "--out", str(tmp_path)],
                                cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"pipeline.py: error: {tmp_path} is in use by the run of process {holder.pid} on {os.uname().nodename} "
        f"({lock}); wait for it to end, or pass another --out")
    assert not (tmp_path / "stages").exists()

    sys.path.insert(0, REPO_ROOT)
    import pipeline

    held = []
    monkeypatch.setattr(pipeline.Pipeline, "main", lambda self: held.append(json.load(open(lock))["pid"]))
    pipeline.main(pipeline.Args(out=str(tmp_path)))  # the holder has ended: its lock is taken over
    assert held == [os.getpid()] and not lock.exists()  # held while running, released at the end


# ---------------------------------------------------------------- issue 42: the leaderboard, --extra, --threads
def test_the_leaderboard_interval_is_the_t_interval_of_the_seeds():
    sys.path.insert(0, REPO_ROOT)
    import numpy as np

    import report

    mean, low, high = report.mean_and_t_interval([0.615, 0.630, 0.632])
    half = 4.3027 * np.std([0.615, 0.630, 0.632], ddof=1) / np.sqrt(3)  # t(0.975, 2 degrees of freedom) = 4.3027
    assert mean == pytest.approx(0.6256667) and (low, high) == pytest.approx((mean - half, mean + half), rel=1e-5)
    assert np.isnan(report.mean_and_t_interval([0.5])[1])


def test_an_extra_fork_takes_its_stage_command_under_its_own_name(tmp_path):
    sys.path.insert(0, REPO_ROOT)
    import pipeline
    from rlhf_utils.checks import RunError

    fork = tmp_path / "my_grpo.py"
    fork.write_text("")
    p = pipeline.Pipeline(pipeline.Args(mode="leaderboard", out=str(tmp_path / "out"), extra=[f"{fork}:grpo"]))
    assert p.stages[-3:] == ["my_grpo", "judge", "report"] and "my_grpo" in p.policies_order()
    mine, theirs = p.command("my_grpo"), p.command("grpo")
    assert mine[1] == str(fork) and theirs[1].endswith("/grpo.py")
    assert (mine[mine.index("--output_dir") + 1].endswith("models/my_grpo")
            and mine[mine.index("--run_name") + 1] == "my_grpo")
    strip = {"--output_dir", "--run_name"}
    assert [t for i, t in enumerate(mine[2:]) if t not in strip and mine[2:][i - 1] not in strip] == \
        [t for i, t in enumerate(theirs[2:]) if t not in strip and theirs[2:][i - 1] not in strip]
    for bad, why in ((f"{fork}:nope", "expected path.py:stage"), (f"{tmp_path}/absent.py:rloo", "no file"),
                     (f"{fork}", "expected path.py:stage")):
        with pytest.raises(RunError, match=why):
            pipeline.parse_extras([bad])
    taken = tmp_path / "ppo.py"
    taken.write_text("")
    with pytest.raises(RunError, match="its run name 'ppo' is taken"):
        pipeline.parse_extras([f"{taken}:rloo"])


def test_the_ilql_row_is_the_pipelines_beta_and_ipo_is_dpo_with_its_loss():
    sys.path.insert(0, REPO_ROOT)
    import pipeline

    p = pipeline.Pipeline(pipeline.Args(mode="leaderboard"))
    assert p.judged_label("ilql") == "ilql_beta4" and p.judged_label("ppo") == "ppo"
    ipo = p.command("ipo")
    assert ipo[1].endswith("/dpo.py") and ipo[ipo.index("--loss_type") + 1] == "ipo"
    online = p.command("online_dpo")
    assert online[online.index("--reward_model_path") + 1].endswith("models/rm")
    # one budget: every online method samples as many responses as PPO
    sampling = ("ppo", "rloo", "grpo", "reinforce_pp", "reinforce_pp_baseline", "online_dpo")
    episodes = {s: int(p.command(s)[p.command(s).index("--total_episodes") + 1]) for s in sampling}
    assert episodes == {"ppo": 1536, "rloo": 1536, "grpo": 1536, "reinforce_pp": 1536, "reinforce_pp_baseline": 1536,
                        "online_dpo": 768}  # online DPO: pairs of 2
    # REINFORCE++-baseline is reinforce_pp.py with a group of 4 per query (GRPO's) whose mean score it subtracts
    plain, baseline = p.command("reinforce_pp"), p.command("reinforce_pp_baseline")
    assert plain[1].endswith("/reinforce_pp.py") and baseline[1].endswith("/reinforce_pp.py")
    assert baseline[baseline.index("--reinforce_pp.baseline") + 1] == "group" and "--reinforce_pp.baseline" not in plain
    assert baseline[baseline.index("--samples_per_prompt") + 1] == "4" and "--samples_per_prompt" not in plain


def test_threads_default_to_the_idle_cores(monkeypatch):
    """--threads 0: a stage on a machine whose cores another job keeps busy gets one thread, not all of them; a
    kernel thread busy a few percent of the time (DAMON's kdamond on the AMD EPYC machines) takes no core, and CPUs
    this process may not use do not count."""
    sys.path.insert(0, REPO_ROOT)
    import builtins
    import io

    import pipeline

    monkeypatch.setattr(pipeline.time, "sleep", lambda s: None)
    real_open = builtins.open

    def proc_stat(busy: list[int]) -> str:
        """/proc/stat after 100 ticks per CPU (user nice system idle iowait irq softirq steal guest guest_nice):
        `busy` of them user and system time, up to 2 iowait (idle time too), 7 guest (counted in user already)."""
        return "cpu 1 2 3 4 5 6 7 8 9 10\n" + "".join(
            f"cpu{c} {b - b // 2} 0 {b // 2} {100 - b - min(2, 100 - b)} {min(2, 100 - b)} 0 0 0 7 0\n"
            for c, b in enumerate(busy)) + "procs_running 9\nprocs_blocked 0\n"

    def reading(*texts: str):  # the texts open("/proc/stat") returns, one after the other
        texts = iter(texts)
        return lambda path, *a, **k: io.StringIO(next(texts)) if path == "/proc/stat" else real_open(path, *a, **k)

    monkeypatch.setattr(pipeline.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    zero = "".join(f"cpu{c} 0 0 0 0 0 0 0 0 0 0\n" for c in range(4))
    for busy, expected in (([0, 0, 0, 0], 4), ([6, 0, 0, 0], 4), ([100, 0, 1, 0], 3), ([60, 0, 0, 0], 3),
                           ([30, 30, 0, 0], 3), ([100, 100, 98, 0], 1), ([100, 100, 100, 100], 1)):
        monkeypatch.setattr(builtins, "open", reading(zero, proc_stat(busy)))
        assert pipeline.idle_cores() == expected, busy
    monkeypatch.setattr(pipeline.os, "sched_getaffinity", lambda pid: {2, 3})  # CPUs 0 and 1 are not ours
    monkeypatch.setattr(builtins, "open", reading(zero, proc_stat([100, 100, 0, 0])))
    assert pipeline.idle_cores() == 2
    monkeypatch.setattr(builtins, "open", reading(zero, proc_stat([100, 100, 100, 0])))
    assert pipeline.idle_cores() == 1

    def unreadable(path, *a, **k):
        if path == "/proc/stat":
            raise OSError("no /proc here")
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", unreadable)
    assert pipeline.idle_cores() == 2  # every usable core


def test_a_recorded_command_names_both_folders_when_one_path_begins_the_other(tmp_path, monkeypatch):
    """--out /tmp/lb with the project in /tmp/lb_clone: the project's scripts stay {repo}, not {out}_clone."""
    sys.path.insert(0, REPO_ROOT)
    import pipeline

    monkeypatch.setattr(pipeline, "REPO_ROOT", str(tmp_path / "lb_clone"))
    p = pipeline.Pipeline(pipeline.Args(out=str(tmp_path / "lb")))
    recorded = p.recorded(p.command("sft"))
    assert recorded[0] == "{repo}/sft.py" and "{out}/data/base_model" in recorded


# ---------------------------------------------------------------- issue 54: --extra checked against the mode
def test_an_extra_fork_is_checked_against_the_stages_of_its_mode(tmp_path):
    """Before, any leaderboard stage passed in every mode: a fork of grpo, online_dpo or ipo in the quickstart
    failed with a KeyError once every other stage had run, and `:rm` was judged as a policy. Now a fork's stage must
    be one the mode runs, and make a policy."""
    sys.path.insert(0, REPO_ROOT)
    import pipeline
    from rlhf_utils.checks import RunError

    fork = tmp_path / "my_fork.py"
    fork.write_text("")
    for mode, stage, modes in (("quickstart", "grpo", "--mode leaderboard, --mode ci"),
                               ("quickstart", "online_dpo", "--mode leaderboard, --mode ci"),
                               ("quickstart", "ipo", "--mode leaderboard, --mode ci"),
                               ("quickstart", "rloo", "--mode full, --mode leaderboard, --mode ci"),
                               ("quickstart", "offline_dt", "--mode full, --mode leaderboard, --mode ci"),
                               ("full", "grpo", "--mode leaderboard, --mode ci"),
                               ("quickstart", "kto", "--mode leaderboard, --mode ci, --mode quickstart --kto, "
                                                     "--mode full --kto")):
        with pytest.raises(RunError) as refused:
            pipeline.parse_extras([f"{fork}:{stage}"], mode)
        assert str(refused.value) == (f"--extra {fork}:{stage}: --mode {mode} has no stage {stage}, whose command and "
                                      f"settings the fork would take; the stage {stage} runs in {modes}")
        with pytest.raises(RunError, match=f"--mode {mode} has no stage {stage}"):  # the pipeline refuses it too
            pipeline.Pipeline(pipeline.Args(mode=mode, out=str(tmp_path / "out"), extra=[f"{fork}:{stage}"]))
        assert not (tmp_path / "out").exists()
    for stage in ("rm", "prep", "unpaired", "judge", "report"):  # no policy to judge, in any mode
        for mode in ("quickstart", "leaderboard"):
            with pytest.raises(RunError, match=rf"^--extra {fork}:{stage}: stage {stage} makes no policy \(.*\), so a "
                                               rf"fork of it has nothing to judge; "
                                               rf"--extra takes a policy stage: sft, "):
                pipeline.parse_extras([f"{fork}:{stage}"], mode)
    # what the mode runs still passes
    for mode, stage in (("quickstart", "ppo"), ("quickstart", "dpo"), ("quickstart", "sft"), ("full", "rloo"),
                        ("full", "ilql"), ("full", "offline_best_of_n"), ("leaderboard", "grpo"), ("ci", "ipo"),
                        ("leaderboard", "kto_unpaired")):
        assert pipeline.parse_extras([f"{fork}:{stage}"], mode) == {"my_fork": (str(fork), stage)}
    assert pipeline.parse_extras([f"{fork}:kto"], "quickstart", kto=True) == {"my_fork": (str(fork), "kto")}
    p = pipeline.Pipeline(pipeline.Args(mode="quickstart", out=str(tmp_path / "out"), extra=[f"{fork}:dpo"]))
    assert p.stages[-3:] == ["my_fork", "judge", "report"] and p.command("my_fork")[1] == str(fork)


def test_a_bad_extra_stops_the_pipeline_in_one_line_before_the_lock_and_every_stage(tmp_path):
    fork = tmp_path / "my_grpo.py"
    fork.write_text("")
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "pipeline.py"), "--out", str(out), "--extra",
                             f"{fork}:grpo"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"pipeline.py: error: --extra {fork}:grpo: --mode quickstart has no stage grpo, whose command and settings "
        f"the fork would take; the stage grpo runs in --mode leaderboard, --mode ci")
    assert not out.exists() and "#####" not in result.stdout  # no folder, no lock, no stage


def test_a_forced_stage_with_checkpoints_restarts_explicitly_and_an_interrupted_one_resumes(tmp_path, monkeypatch,
                                                                                           capsys):
    """The scripts refuse a run folder with checkpoints unless told --resume or --restart: the pipeline tells them."""
    sys.path.insert(0, REPO_ROOT)
    import pipeline

    commands = []
    for force in ([], ["sft"]):
        p = pipeline.Pipeline(pipeline.Args(out=str(tmp_path / "out"), force=force))
        (tmp_path / "out" / "runs" / "sft" / "checkpoints" / "update_000002").mkdir(parents=True, exist_ok=True)
        monkeypatch.setattr(p, "stages", ["sft"])
        monkeypatch.setattr(p, "run", lambda stage, cmd: commands.append(cmd) or (_ for _ in ()).throw(SystemExit))
        with pytest.raises(SystemExit):  # (stops after building the command: no training)
            p.main()
    assert commands[0][-1] == "--resume" and "--restart" not in commands[0]
    assert commands[1][-1] == "--restart" and "--resume" not in commands[1]
    assert "=== [sft] forced: deleting the checkpoints of its earlier run" in capsys.readouterr().out
    assert "--restart" not in p.recorded(commands[1])  # a marker records the command without it
