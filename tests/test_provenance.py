"""What produced a run or a report (issue 64, item 5: rlhf_utils/provenance.py), and which run a --resume without
--run_name continues (item 6). A run folder's provenance.json and every checkpoint's manifest record the package
versions, Python, the CPU (model name, family and model numbers, AVX-512) and the commit, marked when the tree held
uncommitted changes; a report's first line says the same; a resume on other versions says so in one line and goes
on. --resume without --run_name continues the one run of the experiment and seed that has a checkpoint, never the
newest by modification time: several are listed and refused."""

import importlib.metadata
import json
import os
import platform
import subprocess

import pytest
import torch
from accelerate import Accelerator

import report
from rlhf_utils.checks import RunError
from rlhf_utils.provenance import cpu_type, git_commit, provenance, provenance_differences, provenance_line
from rlhf_utils.run import Run
from test_leaderboard_stats import SEEDS, fake_pipelines
from test_run_infra import RunArgs, run_args, step


def git(folder, *arguments) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(folder), *arguments],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_the_record_holds_the_versions_python_cpu_and_commit():
    record = provenance()
    assert record["packages"]["torch"] == importlib.metadata.version("torch") == torch.__version__
    assert {"transformers", "accelerate", "tyro"} <= set(record["packages"])
    assert record["python"] == platform.python_version()
    if os.path.exists("/proc/cpuinfo"):
        lines = open("/proc/cpuinfo").read().splitlines()
        names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
        flags = [line.split(":", 1)[1].split() for line in lines if line.startswith("flags")]
        families = [line.split(":", 1)[1].strip() for line in lines if line.startswith("cpu family")]
        numbers = [line.split(":", 1)[1].strip() for line in lines if line.split(":")[0].strip() == "model"]
        assert record["cpu"] == {"model": names[-1], "family": families[-1], "model_number": numbers[-1],
                                 "avx512f": "avx512f" in flags[-1]}
    line = provenance_line(record)
    assert line.startswith(f"torch {record['packages']['torch']}, ") and f"Python {record['python']}" in line
    assert ("with AVX-512" if record["cpu"]["avx512f"] else "without AVX-512") in line
    assert line.endswith(f"commit {record['commit']}") and "\n" not in line


def test_two_generations_of_one_model_name_are_two_cpu_types():
    """Two "AMD EPYC" machines with AVX-512 gave the quickstart different seeded digits: their family and model
    numbers tell them apart in the words pipeline.py records per seed, in the report's header and in a resume's note.
    A record without the numbers (no /proc/cpuinfo) reads as the model name and AVX-512 alone."""
    zen4 = {"model": "AMD EPYC", "family": "25", "model_number": "17", "avx512f": True}
    other = {**zen4, "family": "26", "model_number": "2"}
    assert cpu_type(zen4) == "AMD EPYC (family 25, model 17), with AVX-512 (avx512f)"
    assert cpu_type(other) != cpu_type(zen4)
    assert cpu_type({"model": "AMD EPYC", "avx512f": False}) == "AMD EPYC, without AVX-512 (avx512f)"
    assert "CPU AMD EPYC (family 26, model 2), with AVX-512 (avx512f), commit c" in provenance_line(
        {"packages": {}, "cpu": other, "commit": "c"})
    assert provenance_differences({"cpu": zen4}, {"cpu": other}) == ["CPU family 25 -> 26", "CPU model number 17 -> 2"]
    before = {"model": "AMD EPYC", "avx512f": True}  # a run folder's record from before the numbers were kept
    assert provenance_differences({"cpu": before}, {"cpu": zen4}) == ["CPU family not recorded -> 25",
                                                                      "CPU model number not recorded -> 17"]


def test_the_commit_is_marked_when_the_tree_has_uncommitted_changes_and_unknown_without_git(tmp_path, monkeypatch):
    repo = tmp_path / "checkout"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "script.py").write_text("x = 1\n")
    git(repo, "add", "script.py")
    git(repo, "commit", "-q", "-m", "one")
    head = git(repo, "rev-parse", "HEAD")
    assert git_commit(str(repo)) == head
    (repo / "script.py").write_text("x = 2\n")
    assert git_commit(str(repo)) == f"{head} +uncommitted changes"
    assert git_commit(str(tmp_path / "elsewhere")) == "unknown"  # not a checkout
    monkeypatch.setenv("PATH", str(tmp_path / "no_programs"))  # no git at all
    assert git_commit(str(repo)) == "unknown"


def test_a_run_records_its_provenance_and_a_resume_on_other_versions_says_so_in_one_line(tmp_path, capsys):
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    run = Run(run_args(RunArgs, tmp_path), accelerator)
    run.start({"update": 0})
    step(model, optimizer)
    checkpoint = run.checkpoint(1, {})
    now = provenance()
    assert json.load(open(tmp_path / "runs" / "unit" / "provenance.json")) == now
    manifest_path = os.path.join(checkpoint, "manifest.json")
    assert json.load(open(manifest_path))["provenance"] == now

    # the same versions: no note
    Run(run_args(RunArgs, tmp_path, resume=True), accelerator).start({"update": 0})
    assert "other versions" not in capsys.readouterr().out

    # the checkpoint as another torch and CPU wrote it
    manifest = json.load(open(manifest_path))
    manifest["provenance"]["packages"]["torch"] = "0.0.1"
    manifest["provenance"]["cpu"]["model"] = "Another CPU"
    json.dump(manifest, open(manifest_path, "w"))
    resumed = Run(run_args(RunArgs, tmp_path, resume=True), accelerator)
    resumed.start({"update": 0})
    notes = [line for line in capsys.readouterr().out.splitlines() if "other versions" in line]
    assert notes == [f"--resume: {checkpoint} was written on other versions (torch 0.0.1 -> "
                     f"{now['packages']['torch']}; CPU Another CPU -> {now['cpu']['model']}); going on, but "
                     "bit-identity with an uninterrupted run holds only on the same versions, CPU type and commit"]
    record = json.load(open(tmp_path / "runs" / "unit" / "provenance.json"))
    assert record["earlier"] == [{**manifest["provenance"], "until_update": 1}]
    assert {key: value for key, value in record.items() if key != "earlier"} == now


def test_every_report_opens_with_what_made_it(tmp_path):
    """seeds.md and leaderboard.md (results.md: the same line, report.write_report) open with the provenance line;
    seeds.json records it whole."""
    made = f"Made with {provenance_line(provenance())}."
    for seed in (1, 2):
        folder = tmp_path / "seeds" / f"seed_{seed}" / "report"
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps({"policies": [{"policy": "ppo", "win_rate": 0.5}]}))
    text = report.write_seed_report(str(tmp_path / "seeds"), [1, 2])
    assert text.splitlines()[:2] == [made, ""] and (tmp_path / "seeds" / "report" / "seeds.md").read_text() == text
    assert json.load(open(tmp_path / "seeds" / "report" / "seeds.json"))["provenance"] == provenance()
    board = tmp_path / "board"
    (board / "cpu.json").parent.mkdir()
    (board / "cpu.json").write_text(json.dumps({"cpu": "CPU A, with AVX-512 (avx512f)"}))
    assert report.write_leaderboard(str(board), SEEDS, fake_pipelines(board)).splitlines()[0] == made


# ---------------------------------------------------------------- --resume without --run_name: the run it continues
def checkpointed_run(root, name: str, updates: list) -> None:
    for update in updates:
        os.makedirs(os.path.join(root, name, "checkpoints", f"update_{update:06d}"))


def test_a_resume_without_a_run_name_lists_the_runs_it_could_continue(tmp_path):
    """Two runs of the experiment and seed with checkpoints: refused, both listed with their newest checkpoint (the
    finished one marked), whatever their modification times; one of another seed, or one without a completed
    checkpoint (a killed save's temporary folder), is no candidate. With only one, it is the one continued."""
    root = tmp_path / "runs"
    checkpointed_run(root, "unit__1__1700000000", [3, 6])
    checkpointed_run(root, "unit__1__1700000500", [2])
    (root / "unit__1__1700000500" / "summary.json").write_text("{}")
    checkpointed_run(root, "unit__2__1700000900", [9])  # another seed
    os.makedirs(root / "unit__1__1700000700" / "checkpoints" / ".tmp_update_000001")  # no completed checkpoint
    os.utime(root / "unit__1__1700000000" / "checkpoints", (2e9, 2e9))  # "newest" by a clock set ahead
    accelerator = Accelerator(cpu=True)
    with pytest.raises(RunError) as refused:
        Run(run_args(RunArgs, tmp_path, run_name=None, resume=True), accelerator)
    assert str(refused.value) == (
        f"--resume: 2 runs in {root} could be continued: unit__1__1700000000 (newest checkpoint update_000006); "
        "unit__1__1700000500 (newest checkpoint update_000002, finished). Pass --run_name with the one to continue")
    assert not (root / "unit__1__1700000000" / "run.lock").exists()  # refused before any folder is claimed

    os.rename(root / "unit__1__1700000500", tmp_path / "moved")
    args = run_args(RunArgs, tmp_path, run_name=None, resume=True)
    with pytest.raises(RunError, match="no intact checkpoint"):  # the one candidate, chosen (its folders are empty)
        Run(args, accelerator)
    assert args.run.run_name == "unit__1__1700000000"

