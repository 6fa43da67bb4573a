"""The run infrastructure (rlhf_utils/run.py's `Run`, which every training script imports), tested through sft.py, the
cheapest script that uses it. Each test interrupts or damages a run the way a long run meets it in practice
and checks that the run either ends exactly like one that was never interrupted or stops with a clear message:

- SIGKILL in the middle of a checkpoint save, SIGTERM between updates, a 2-process run resumed on 1 process;
- a truncated or missing checkpoint file (the RNG states included): --resume skips to the newest intact one;
- a resume under another number of processes or DeepSpeed stage: refused before anything loads;
- a second run into a folder a live run holds: refused, naming the holder; a dead run's lock is taken over;
- a full disk during a save (simulated, and a real small tmpfs as the run folder or as the output folder): one message
  naming the folder, no temporary folder left behind, the previous checkpoint intact, and after freeing space a
  resume that ends like the uninterrupted run;
- a resume refused (another process count or stage, no intact checkpoint) or a held folder: one `sft.py: error:`
  paragraph, no traceback;
- the output folder is marked complete (run.json) only by a run that finished.

One uninterrupted 10-update run (`reference`, module scope) is what every resumed run must reproduce bit for bit."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import ENV, assert_same_safetensors, free_port, kill_after_checkpoint, run_ok, without_timing

# one xdist worker runs the whole module, so that the reference run below is made once
pytestmark = pytest.mark.xdist_group("test_run")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT = os.path.join(REPO_ROOT, "sft.py")
TORCHRUN_ENV = {**ENV, "ACCELERATE_USE_CPU": "true"}
# 10 updates of 16 rows, a checkpoint after updates 3, 6 and 9, the two newest kept
FLAGS = ["--total_episodes", "160", "--total_batch_size", "16", "--local_micro_batch_size", "8", "--lr", "1e-3",
         "--num_eval_samples", "16", "--local_eval_batch_size", "8", "--eval_every", "4", "--checkpoint_every", "3",
         "--checkpoint_keep", "2"]


def sft_args(task: dict, root, name: str, *extra: str) -> list:
    return ["--base_model", task["base_model"], "--query_dataset", task["sft"],
            "--response_length", str(task["task"]["sft_response_length"]), *FLAGS,
            "--output_dir", str(root / f"model_{name}"), "--run_dir_root", str(root / "runs"), "--run_name", name,
            *extra]


def patched(code: str, args: list) -> list:
    """Run sft.py in a Python that first executes `code` (to make a save fail or stop at a chosen moment)."""
    runner = (f"import runpy, sys\nsys.path.insert(0, {REPO_ROOT!r})  # (rlhf_utils beside sft.py)\n{code}\n"
              f"sys.argv = [{SFT!r}] + sys.argv[1:]\nrunpy.run_path({SFT!r}, run_name='__main__')")
    return [sys.executable, "-c", runner, *args]


# the save of update 6 is cut off by SIGKILL after accelerate has written the model, the optimizer and the RNG
# states into the temporary folder, but before the checkpoint is complete (no trainer state, no manifest, no rename)
KILL_DURING_SAVE = """
import os, signal
import accelerate
original = accelerate.Accelerator.save_state
def save_state(self, output_dir=None, **kwargs):
    result = original(self, output_dir, **kwargs)
    if str(output_dir).endswith("update_000006"):
        os.kill(os.getpid(), signal.SIGKILL)
    return result
accelerate.Accelerator.save_state = save_state
"""

# the disk fills while the model of update 6 is written: half a file lands, then ENOSPC
DISK_FULL_DURING_SAVE = """
import errno, os
import accelerate
original = accelerate.Accelerator.save_state
def save_state(self, output_dir=None, **kwargs):
    if str(output_dir).endswith("update_000006"):
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, "model.safetensors"), "wb") as f:
            f.write(b"half a model")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return original(self, output_dir, **kwargs)
accelerate.Accelerator.save_state = save_state
"""


def rows(root, name: str) -> list:
    return [without_timing(json.loads(line)) for line in open(root / "runs" / name / "metrics.jsonl")]


def assert_same_as_reference(reference, root, name: str) -> None:
    """Weights, metrics and summary of the run `name` equal the uninterrupted reference run's."""
    assert_same_safetensors(reference / "model_reference" / "model.safetensors",
                            root / f"model_{name}" / "model.safetensors")
    assert rows(root, name) == rows(reference, "reference")
    summaries = [without_timing(json.load(open(r / "runs" / n / "summary.json")))
                 for r, n in ((reference, "reference"), (root, name))]
    assert summaries[0] == summaries[1]
    assert json.load(open(root / f"model_{name}" / "run.json")) == {"run_name": name, "complete": True}


@pytest.fixture(scope="module")
def reference(synthetic_task, tmp_path_factory):
    """The uninterrupted run, and its folders (checkpoints of updates 6 and 9 are kept: --checkpoint_keep 2)."""
    root = tmp_path_factory.mktemp("reference")
    run_ok([sys.executable, SFT, *sft_args(synthetic_task, root, "reference")], cwd=root, env=ENV)
    return root


def test_a_finished_run_marks_its_output_complete_and_records_its_checkpoints(reference):
    assert json.load(open(reference / "model_reference" / "run.json")) == {"run_name": "reference", "complete": True}
    checkpoints = reference / "runs" / "reference" / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == ["update_000006", "update_000009"]
    manifest = json.load(open(checkpoints / "update_000009" / "manifest.json"))
    assert manifest["num_processes"] == 1 and manifest["deepspeed_stage"] is None
    on_disk = {os.path.relpath(os.path.join(d, f), checkpoints / "update_000009"): os.path.getsize(os.path.join(d, f))
               for d, _, files in os.walk(checkpoints / "update_000009") for f in files if f != "manifest.json"}
    assert manifest["files"] == on_disk and "random_states_0.pkl" in on_disk and "trainer_state.json" in on_disk
    assert not os.path.exists(reference / "runs" / "reference" / "run.lock")  # released at the end


@pytest.mark.slow  # the run module's checkpoint save, which a fork of a script does not change: full suite only
def test_sigkill_during_a_checkpoint_save_resumes_from_the_previous_checkpoint(synthetic_task, reference, tmp_path):
    args = sft_args(synthetic_task, tmp_path, "cut")
    killed = subprocess.run(patched(KILL_DURING_SAVE, args), cwd=tmp_path, env=ENV, capture_output=True, text=True,
                            timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    checkpoints = tmp_path / "runs" / "cut" / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == [".tmp_update_000006", "update_000003"]
    assert json.load(open(tmp_path / "model_cut" / "run.json")) == {"run_name": "cut"}  # not complete

    resumed = run_ok([sys.executable, SFT, *args, "--resume"], cwd=tmp_path, env=ENV)
    assert f"resumed from {checkpoints / 'update_000003'} (update 3)" in resumed.stdout
    assert_same_as_reference(reference, tmp_path, "cut")
    assert sorted(os.listdir(checkpoints)) == ["update_000006", "update_000009"]  # the half-written folder is gone


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_sigterm_stops_the_run_and_resume_ends_like_an_uninterrupted_run(synthetic_task, reference, tmp_path):
    args = sft_args(synthetic_task, tmp_path, "term")
    process = subprocess.Popen([sys.executable, SFT, *args], cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    checkpoint = tmp_path / "runs" / "term" / "checkpoints" / "update_000003"
    deadline = time.time() + 240
    while not checkpoint.is_dir() and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "the run ended before it could be stopped"
    process.send_signal(signal.SIGTERM)
    start = time.time()
    assert process.wait(timeout=60) == -signal.SIGTERM
    assert time.time() - start < 10, "SIGTERM did not stop the run promptly"
    assert not (tmp_path / "model_term" / "model.safetensors").exists()

    resumed = run_ok([sys.executable, SFT, *args, "--resume"], cwd=tmp_path, env=ENV)
    assert "resumed from" in resumed.stdout
    assert_same_as_reference(reference, tmp_path, "term")


@pytest.mark.slow
def test_a_two_process_run_resumes_on_one_process_exactly(synthetic_task, reference, tmp_path):
    """Plain data parallel (torchrun, 2 processes) killed after its update-3 checkpoint, resumed by one plain process:
    the same weights and metrics as the 1-process reference (2 processes and 1 compute the same global batch)."""
    args = sft_args(synthetic_task, tmp_path, "ddp")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port()), SFT]
    kill_after_checkpoint([*torchrun, *args], tmp_path / "runs" / "ddp" / "checkpoints" / "update_000003", cwd=tmp_path,
                          env=TORCHRUN_ENV, timeout=300)
    manifest = json.load(open(tmp_path / "runs" / "ddp" / "checkpoints" / "update_000003" / "manifest.json"))
    assert manifest["num_processes"] == 2 and manifest["deepspeed_stage"] is None
    run_ok([sys.executable, SFT, *args, "--resume"], cwd=tmp_path, env=ENV)
    assert_same_as_reference(reference, tmp_path, "ddp")


def copy_of(reference, tmp_path, name: str):
    """A copy of the finished reference run under another name, to damage and resume."""
    shutil.copytree(reference / "runs" / "reference", tmp_path / "runs" / name)
    shutil.copytree(reference / "model_reference", tmp_path / f"model_{name}")
    os.remove(tmp_path / f"model_{name}" / "model.safetensors")
    return tmp_path / "runs" / name / "checkpoints"


@pytest.mark.parametrize("damage", ["truncated model", "missing rng state", "missing manifest"])
@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_resume_skips_a_damaged_checkpoint_for_the_newest_intact_one(synthetic_task, reference, tmp_path, damage):
    checkpoints = copy_of(reference, tmp_path, "damaged")
    newest = checkpoints / "update_000009"
    if damage == "truncated model":
        damaged = newest / "model.safetensors"
        data = damaged.read_bytes()
        damaged.write_bytes(data[: len(data) // 2])
        reason = f"{damaged} has {len(data) // 2} bytes, not {len(data)}"
    elif damage == "missing rng state":
        damaged = newest / "random_states_0.pkl"
        damaged.unlink()
        reason = f"{damaged} is missing"
    else:
        damaged = newest / "manifest.json"
        damaged.unlink()
        reason = f"{damaged} is missing"
    resumed = run_ok([sys.executable, SFT, *sft_args(synthetic_task, tmp_path, "damaged"), "--resume"], cwd=tmp_path,
                     env=ENV)
    assert f"--resume: skipping the damaged checkpoint {newest}: {reason}" in resumed.stdout, resumed.stdout[-2000:]
    assert f"resumed from {checkpoints / 'update_000006'} (update 6)" in resumed.stdout
    assert_same_as_reference(reference, tmp_path, "damaged")


def test_resume_without_an_intact_checkpoint_names_the_damaged_file(synthetic_task, reference, tmp_path):
    checkpoints = copy_of(reference, tmp_path, "broken")
    (checkpoints / "update_000009" / "random_states_0.pkl").unlink()
    (checkpoints / "update_000006" / "optimizer.bin").write_bytes(b"")
    result = subprocess.run([sys.executable, SFT, *sft_args(synthetic_task, tmp_path, "broken"), "--resume"],
                            cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    size = os.path.getsize(reference / "runs" / "reference" / "checkpoints" / "update_000006" / "optimizer.bin")
    assert result.stderr.strip().splitlines()[-1] == (
        f"sft.py: error: --resume: no intact checkpoint in {checkpoints}: "
        f"{checkpoints / 'update_000006' / 'optimizer.bin'} has 0 bytes, not {size}")
    assert "resumed from" not in result.stdout


def test_resume_under_another_process_count_or_deepspeed_stage_is_refused_before_loading(synthetic_task, reference,
                                                                                         tmp_path):
    """The manifest says the checkpoint was written by 2 ZeRO-2 processes; one plain process must not load it.
    (tests/test_multiprocess.py checks the same refusal on a real ZeRO-2 checkpoint.)"""
    checkpoints = copy_of(reference, tmp_path, "other")
    for name in os.listdir(checkpoints):
        path = checkpoints / name / "manifest.json"
        path.write_text(json.dumps({**json.load(open(path)), "num_processes": 2, "deepspeed_stage": 2}))
    result = subprocess.run([sys.executable, SFT, *sft_args(synthetic_task, tmp_path, "other"), "--resume"],
                            cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"sft.py: error: --resume: {checkpoints / 'update_000009'} was written by 2 process(es) with DeepSpeed "
        "stage 2, this run has 1 with stage None; launch 2 process(es) with the original config")
    assert "resumed from" not in result.stdout


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_a_second_run_into_a_live_run_folder_is_refused_and_a_dead_runs_lock_is_taken_over(synthetic_task, tmp_path):
    args = sft_args(synthetic_task, tmp_path, "shared", "--total_episodes", "1600")  # long enough to be caught alive
    first = subprocess.Popen([sys.executable, SFT, *args], cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        lock = tmp_path / "runs" / "shared" / "run.lock"
        deadline = time.time() + 120
        while not lock.exists() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        assert json.load(open(lock)) == {"host": os.uname().nodename, "pid": first.pid,
                                         "started": psutil.Process(first.pid).create_time()}
        first.send_signal(signal.SIGSTOP)  # alive but paused: it holds its lock without taking the second run's CPU
        second = subprocess.run([sys.executable, SFT, *args], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                                timeout=300)
        assert second.returncode != 0 and "Traceback" not in second.stderr
        assert second.stderr.strip().splitlines()[-1] == (
            f"sft.py: error: {tmp_path / 'runs' / 'shared'} is in use by the run of process {first.pid} on "
            f"{os.uname().nodename} ({lock}); wait for it to end, or pass another --run_name")
        assert first.poll() is None  # the holder goes on
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    # the killed run left its lock behind: a new run of that name takes it over (it left checkpoints too, which a new
    # run replaces only when told to: --restart)
    assert json.load(open(lock))["pid"] == first.pid
    short = sft_args(synthetic_task, tmp_path, "shared", "--total_episodes", "32", "--overwrite_output_dir",
                     "--restart")
    run_ok([sys.executable, SFT, *short], cwd=tmp_path, env=ENV)
    assert not lock.exists()


@pytest.mark.slow  # the run module's checkpoint save, which a fork of a script does not change: full suite only
def test_a_full_disk_during_a_save_is_a_clear_error_and_leaves_nothing_behind(synthetic_task, reference, tmp_path):
    args = sft_args(synthetic_task, tmp_path, "full_disk")
    result = subprocess.run(patched(DISK_FULL_DURING_SAVE, args), cwd=tmp_path, env=ENV, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    checkpoints = tmp_path / "runs" / "full_disk" / "checkpoints"
    assert result.stderr.strip().splitlines()[-1] == full_disk_message(checkpoints, 6)
    assert os.listdir(checkpoints) == ["update_000003"]  # no temporary folder filling the disk
    assert json.load(open(tmp_path / "model_full_disk" / "run.json")) == {"run_name": "full_disk"}  # not complete
    run_ok([sys.executable, SFT, *args, "--resume"], cwd=tmp_path, env=ENV)
    assert_same_as_reference(reference, tmp_path, "full_disk")


def full_disk_message(checkpoints, update: int) -> str:
    newest = checkpoints / f"update_{update - 3:06d}"
    size = sum(json.load(open(newest / "manifest.json"))["files"].values())
    return (f"sft.py: error: the disk holding {checkpoints} is full: the checkpoint of update {update} was not saved "
            f"(it needs about {size / 2**20:.1f} MiB). The newest checkpoint is still {newest}. Free space there, "
            "then --resume")


@pytest.mark.slow  # two sft.py runs on a real tmpfs (tests/test_run_infra.py checks the pieces quickly)
def test_a_full_run_folder_on_a_real_disk_is_one_message_and_the_resume_after_freeing_space_is_exact(
        synthetic_task, reference, small_disk):
    """issue 40: a 20 MiB tmpfs holds the update-3 checkpoint (about 12 MiB), not the one of update 6. Before, the
    message was torch's `[enforce fail at inline_container.cc] ... unexpected pos` after two chained tracebacks."""
    disk = small_disk("disk", "20m")
    args = sft_args(synthetic_task, disk, "full")
    result = subprocess.run([sys.executable, SFT, *args], cwd=disk, env=ENV, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    checkpoints = disk / "runs" / "full" / "checkpoints"
    assert result.stderr.strip().splitlines()[-1] == full_disk_message(checkpoints, 6)
    assert os.listdir(checkpoints) == ["update_000003"]  # nothing half-written left filling the disk
    subprocess.run(["mount", "-o", "remount,size=80m", str(disk)], check=True)  # space freed
    resumed = run_ok([sys.executable, SFT, *args, "--resume"], cwd=disk, env=ENV)
    assert f"resumed from {checkpoints / 'update_000003'} (update 3)" in resumed.stdout
    assert_same_as_reference(reference, disk, "full")


@pytest.mark.slow  # two sft.py runs on a real tmpfs (tests/test_run_infra.py checks the pieces quickly)
def test_a_full_output_folder_on_a_real_disk_names_it_and_the_size_of_the_model(synthetic_task, tmp_path, small_disk):
    """issue 40: only --output_dir is full (a 1 MiB tmpfs; the model has about 3.8 MiB): before, a raw
    `SafetensorError ... No space left on device` naming no folder."""
    out = small_disk("out", "1m")
    args = sft_args(synthetic_task, tmp_path, "out_full", "--total_episodes", "32", "--checkpoint_every", "0")
    args[args.index("--output_dir") + 1] = str(out)
    result = subprocess.run([sys.executable, SFT, *args], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert re.fullmatch(rf"sft\.py: error: the disk holding {re.escape(str(out))} is full: the final model was not "
                        r"saved \(it needs about 3\.\d MiB\)\. Free space there, then run again \(--resume: from the "
                        r"newest checkpoint, if any\)", result.stderr.strip().splitlines()[-1]), result.stderr[-2000:]


# sft.py names its inputs in one line of main (run.inputs); where it does not yet, the runner adds the call there
NAMES_ITS_INPUTS = """
from rlhf_utils import run as run_module
claim = run_module.Run.claim_output_dir
def claim_output_dir(self):
    if not self.digests:
        self.inputs(query_dataset=self.args.query_dataset, base_model=self.args.base_model)
    claim(self)
run_module.Run.claim_output_dir = claim_output_dir
"""


@pytest.mark.slow  # an sft.py run and a refused resume
def test_a_resume_on_data_shuffled_in_place_is_refused_naming_both_hashes(synthetic_task, tmp_path):
    """issue 40: the train split shuffled (or prepared again with another --query_length) under a run's feet: before,
    --resume went on silently (only the data's shape was compared); now the checkpoint's content hash of the data
    differs from the data's, and the resume stops, naming both."""
    from datasets import load_from_disk

    data = tmp_path / "sft"
    shutil.copytree(synthetic_task["sft"], data)
    args = sft_args({**synthetic_task, "sft": str(data)}, tmp_path, "moved", "--total_episodes", "64",
                    "--checkpoint_every", "2", "--eval_every", "0")
    run_ok(patched(NAMES_ITS_INPUTS, args), cwd=tmp_path, env=ENV)
    checkpoint = tmp_path / "runs" / "moved" / "checkpoints" / "update_000002"
    then = json.load(open(checkpoint / "manifest.json"))["inputs"]["query_dataset"]["sha256"]
    splits = load_from_disk(str(data))
    splits["train"] = splits["train"].shuffle(seed=0)
    splits.save_to_disk(str(tmp_path / "shuffled"))
    shutil.rmtree(data)
    os.rename(tmp_path / "shuffled", data)  # the same folder, other contents
    result = subprocess.run(patched(NAMES_ITS_INPUTS, [*args, "--resume"]), cwd=tmp_path, env=ENV, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    from rlhf_utils.run import content_digest

    assert result.stderr.strip().splitlines()[-1] == (
        f"sft.py: error: --resume: {checkpoint} was made from other contents than these inputs hold: --query_dataset "
        f"{data} (sha256 {then[:12]} then, {content_digest(str(data))[:12]} now). Resume with the inputs it was made "
        "from, or pass --accept_changed_inputs to go on with these knowingly")
    assert "resumed from" not in result.stdout


def test_a_resume_with_a_changed_learning_rate_is_refused_before_loading(synthetic_task, reference, tmp_path):
    """The commonest slip: a resume with another --lr. Refused in one paragraph naming the flag (was -> now); the
    checkpoint's optimizer state would otherwise win silently while args.json recorded the new rate."""
    checkpoints = copy_of(reference, tmp_path, "changed")
    result = subprocess.run([sys.executable, SFT, *sft_args(synthetic_task, tmp_path, "changed"), "--resume", "--lr",
                             "0.03"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"sft.py: error: --resume: {checkpoints / 'update_000009'} was made with other flags than these: --lr 0.001 -> "
        "0.03. Resume with the flags it was made with (its run's args.json lists them), or pass --accept_changed_flags "
        "to go on with the new values knowingly (they apply from the next update; args.json records both)")
    assert "resumed from" not in result.stdout


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_a_resume_may_change_the_flags_that_decide_no_number(synthetic_task, reference, tmp_path):
    """Evaluation, checkpoint cadence and output folder changed on resume: the run ends with the reference's weights."""
    copy_of(reference, tmp_path, "free")
    args = sft_args(synthetic_task, tmp_path, "free")
    for flag, value in (("--eval_every", "5"), ("--num_eval_samples", "8"), ("--checkpoint_keep", "3")):
        args[args.index(flag) + 1] = value
    resumed = run_ok([sys.executable, SFT, *args, "--resume"], cwd=tmp_path, env=ENV)
    assert "resumed from" in resumed.stdout and "changed flags" not in resumed.stdout
    assert_same_safetensors(reference / "model_reference" / "model.safetensors",
                            tmp_path / "model_free" / "model.safetensors")


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_an_accepted_new_learning_rate_continues_the_schedule_from_the_new_base(synthetic_task, reference, tmp_path):
    """--accept_changed_flags: the restored linear schedule goes on at the same step, scaled to the new base (update
    10's rate is twice the reference's), and args.json records both values."""
    copy_of(reference, tmp_path, "faster")
    args = sft_args(synthetic_task, tmp_path, "faster")
    args[args.index("--lr") + 1] = "2e-3"
    resumed = run_ok([sys.executable, SFT, *args, "--resume", "--accept_changed_flags"], cwd=tmp_path, env=ENV)
    assert "--resume with changed flags (--accept_changed_flags): --lr 0.001 -> 0.002" in resumed.stdout
    rate = {name: [row["train/lr"] for row in rows(root, name) if row["step"] == 10 and "train/lr" in row]
            for root, name in ((reference, "reference"), (tmp_path, "faster"))}
    assert rate["faster"] == [2 * rate["reference"][0]] and rate["reference"][0] > 0
    recorded = json.load(open(tmp_path / "runs" / "faster" / "args.json"))
    assert recorded["lr"] == 2e-3
    assert recorded["changed_on_resume"] == [{"after_update": 9, "flags": {"lr": {"was": 1e-3, "now": 2e-3}}}]


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_processes_leave_their_process_group_at_exit(synthetic_task, tmp_path):
    """Each process of a 2-process torchrun run has left the process group when Python exits (a rank that tears it
    down while another still uses it can abort). An exit handler registered before the script starts runs last, so
    it sees the group as the script left it."""
    record = tmp_path / "initialized_at_exit_rank"
    code = ("import atexit, os, torch.distributed as dist\n"
            f"atexit.register(lambda: open({str(record)!r} + os.environ['RANK'], 'w')"
            ".write(str(dist.is_initialized())))")
    args = sft_args(synthetic_task, tmp_path, "group", "--total_episodes", "32", "--checkpoint_every", "0")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port())]
    runner = patched(code, args)
    run_ok([*torchrun, "--no-python", *runner], cwd=tmp_path, env=TORCHRUN_ENV)
    assert [open(f"{record}{rank}").read() for rank in (0, 1)] == ["False", "False"]
