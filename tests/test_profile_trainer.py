"""tools/profile_trainer.py on a tiny sft.py run: three runs end, and the report's shares, FLOPs and rates are
measured values, not placeholders; the FLOPs split into body, output layer and rest adds up and sits above its
minimum."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ENV

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_profile_of_a_small_sft_run(synthetic_task, tmp_path):
    task = json.load(open(synthetic_task["task_json"]))
    out = tmp_path / "profile"
    cmd = [sys.executable, os.path.join(REPO_ROOT, "tools", "profile_trainer.py"), "--out", str(out), "--threads", "1",
           "--", "sft.py", "--base_model", synthetic_task["base_model"], "--query_dataset", synthetic_task["sft"],
           "--response_length", str(task["sft_response_length"]), "--total_episodes", "64", "--total_batch_size", "16",
           "--local_micro_batch_size", "8", "--num_eval_samples", "8", "--local_eval_batch_size", "8",
           "--run_dir_root", str(tmp_path / "runs"), "--run_name", "prof_{mode}",
           "--output_dir", str(tmp_path / "sft_{mode}")]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads((out / "profile.json").read_text())
    # each run had its own run folder ({mode} replaced)
    assert sorted(os.listdir(tmp_path / "runs")) == ["prof_cprofile", "prof_flops", "prof_plain"]
    shares = report["shares"]
    # SFT trains (forward and backward take time) and samples its evaluation (generation)
    for name in ("transformer forward passes", "backward", "optimizer step", "generation (holds forward passes)"):
        assert 0 < shares[name] < 1, (name, shares)
    assert shares["transformer forward passes"] + shares["backward"] < 1.2  # generation's forwards overlap, no more
    # 4 updates of 16 rows, each row's matmuls at least 2 x params x tokens: far above zero
    assert report["flops"] > 1e8
    assert report["plain_seconds"] > 0 and report["achieved_gflops"] > 0
    assert report["matmul_gflops_large"] > 0 and report["matmul_gflops_model_shape"] > 0
    assert "GFLOP/s" in (out / "profile.md").read_text()
    # the phases: the imports before main(), main()'s direct calls (the training loop's and the model loading's
    # among them) and main's own lines add up to the script's profiled time; each is a measured, nonnegative time
    phases = dict(report["phases"])
    assert phases["module body before main() (imports)"] > 0.5  # torch and transformers load there
    assert phases["sft.py:sft_update"] > 0 and phases["main()'s own lines"] >= 0, phases
    assert all(seconds >= -1e-6 for seconds in phases.values()), phases
    assert sum(phases.values()) <= report["profiled_seconds"] + 1e-6
    assert "| phase (under cProfile" in (out / "profile.md").read_text()
    # torch.mm is timed at the hidden size of the model the run built (recorded when it was tagged; None otherwise)
    hidden = json.load(open(os.path.join(synthetic_task["base_model"], "config.json")))["hidden_size"]
    assert report["flop_accounting"]["hidden_size"] == hidden
    assert f"(4096 x {hidden}) x ({hidden} x {4 * hidden})" in (out / "profile.md").read_text()
    # the split of the FLOPs: body, output layer and rest add up to the counter's total
    accounting = report["flop_accounting"]
    body, head, rest, total = (accounting[k] for k in ("body", "output_layer", "rest", "total"))
    assert body["flops"] > 0 and head["flops"] > 0 and rest["flops"] >= 0
    assert body["flops"] + head["flops"] + rest["flops"] == total["flops"] == report["flops"]
    # the evaluation samples with generate: its forward passes are counted, and apart
    assert 0 < body["flops_in_generation"] < body["flops"] and 0 < head["flops_in_generation"] < head["flops"]
    assert 0 < body["positions_computed_in_generation"] < body["positions_computed"]
    # the body computes ragged rows: every real token, and some padding among them
    assert 0 < body["positions_real"] <= body["positions_computed"]
    assert 0 < body["positions_real_in_generation"] <= body["positions_computed_in_generation"]
    # SFT's LM head runs at the response targets only (and at the last position of each generation step), far
    # fewer rows than the positions the body computed or handed to it; the loss reads every row it computed
    assert 0 < head["rows_read"] <= head["rows_computed"] < head["rows_offered"] <= body["positions_computed"]
    assert head["rows_computed"] < body["positions_computed"] / 2
    # the minimum: positive, at most what was measured, and the ratio matches it
    for part in (body, head, rest, total):
        assert 0 <= part["minimum_flops"] <= part["flops"] * (1 + 1e-9), part
    assert 0 < total["minimum_flops"] and accounting["measured_over_minimum"] >= 1 - 1e-9
    assert abs(accounting["measured_over_minimum"] - total["flops"] / total["minimum_flops"]) < 1e-9
    markdown = (out / "profile.md").read_text()
    assert "| transformer body |" in markdown and "| output layer (LM head, score head) |" in markdown
    assert "Measured / minimum: **" in markdown


def test_a_run_needs_no_tyro(tmp_path):
    """--python runs the three runs in another environment (TRL's, which has no tyro): a run as main() starts it
    (`--mode M --out DIR -- script ...`) must not import tyro. Here tyro fails to import, and the run still ends."""
    blocker = tmp_path / "blocked"
    blocker.mkdir()
    (blocker / "tyro.py").write_text("raise ImportError('tyro is not installed in this environment')\n")
    script = tmp_path / "work.py"
    script.write_text("import sys\nopen(sys.argv[1], 'w').write('ran')\n")
    env = {**ENV, "PYTHONPATH": str(blocker)}
    cmd = [sys.executable, os.path.join(REPO_ROOT, "tools", "profile_trainer.py"), "--mode", "plain", "--out",
           str(tmp_path / "out"), "--", str(script), str(tmp_path / "marker")]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "marker").read_text() == "ran"
    assert json.loads((tmp_path / "out" / "plain.json").read_text())["wall"] > 0


def test_functions_found_in_another_environment(tmp_path):
    """A profile made with --python names the other environment's files: a function is found there by its path
    inside site-packages (the same release), never by its bare name."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
    from profile_trainer import same_source

    ours = os.path.join(os.sep, "venv", "lib", "python3.11", "site-packages", "transformers", "models", "x.py")
    other = os.path.join(os.sep, "trl-venv", "lib", "python3.11", "site-packages", "transformers", "models", "x.py")
    elsewhere = os.path.join(os.sep, "trl-venv", "lib", "python3.11", "site-packages", "transformers", "y.py")
    assert same_source(other, ours) and not same_source(elsewhere, ours)
    assert same_source(__file__, __file__) and not same_source(str(tmp_path / "x.py"), ours)
