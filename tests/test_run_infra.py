"""run_infra.py's own pieces, in one process and cheap (a 4 x 4 layer, a tiny dataset): the expected-error hook, the
lock, the inputs' content hashes on --resume, the finite checks at load and before a checkpoint, a full disk (a real
small tmpfs; skipped, with the reason, where mounting is refused) and the query/response check of token columns.
The training scripts meet the same code end to end in tests/test_run.py."""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

import psutil
import pytest
import torch
from accelerate import Accelerator
from datasets import Dataset, DatasetInfo

import run_infra
from run_infra import NonFiniteError, Run, RunError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class RunArgs:
    """The fields of a training script's Args that Run reads."""
    run_dir_root: str
    output_dir: str
    exp_name: str = "unit"
    seed: int = 1
    run_name: Optional[str] = "unit"
    resume: bool = False
    restart: bool = False
    track: bool = False
    checkpoint_keep: int = 2
    overwrite_output_dir: bool = False
    take_over_lock: bool = False
    accept_changed_inputs: bool = False


def make_run(tmp_path, width: int = 4, **kw):
    """A Run over a prepared width x width layer and its AdamW, as a script has them when it checkpoints."""
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    run = Run(RunArgs(str(tmp_path / "runs"), str(tmp_path / "out"), **kw), accelerator)
    return run, model, optimizer


def step(model, optimizer) -> None:
    model(torch.ones(1, model.in_features)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


# ---------------------------------------------------------------- expected errors: one paragraph, no traceback
def test_an_expected_error_is_one_paragraph_from_rank_0_and_a_failed_exit(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(f"import sys\nsys.path.insert(0, {REPO_ROOT!r})\nimport run_infra\n"
                      "raise (run_infra.RunError if sys.argv[1] == 'expected' else KeyError)('bad flag: --x 3')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    ran = {(kind, rank): subprocess.run([sys.executable, str(script), kind], capture_output=True, text=True, timeout=120,
                                        env={**env, **({"RANK": rank} if rank else {})})
           for kind, rank in (("expected", None), ("expected", "1"), ("unexpected", None))}
    first, other, unexpected = ran.values()
    assert first.returncode == other.returncode == unexpected.returncode == 1
    assert first.stderr == "script.py: error: bad flag: --x 3\n"
    assert other.stderr == ""  # another rank of the same launch: silent
    assert "Traceback" in unexpected.stderr and unexpected.stderr.strip().endswith("KeyError: 'bad flag: --x 3'")


def test_the_expected_errors_are_value_errors_and_the_non_finite_stop_is_one():
    assert issubclass(RunError, ValueError)
    assert issubclass(NonFiniteError, RunError) and issubclass(NonFiniteError, RuntimeError)
    from judge_client import JudgeUnavailableError  # the judge's client: a judge that cannot be used stops the run
    assert issubclass(JudgeUnavailableError, RunError)


def test_the_run_module_loads_no_http_client():
    """The judge's HTTP client lives in judge_client.py, which imports run_infra; run_infra imports nothing of it, so
    a training script pays for neither openai nor the client's sqlite cache."""
    loaded = subprocess.run([sys.executable, "-c", "import sys, run_infra; print(sorted({'openai', 'sqlite3', "
                             "'judge_client'} & set(sys.modules)))"], capture_output=True, text=True, timeout=120,
                            cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]"


# ---------------------------------------------------------------- the lock
def test_an_unreadable_lock_is_taken_over_with_a_warning_and_the_new_lock_is_whole(tmp_path, capsys):
    lock = tmp_path / "runs" / "unit" / "run.lock"
    lock.parent.mkdir(parents=True)
    for stale in ("", '{"host": "'):  # a run that died between creating and writing it (before locks were atomic)
        lock.write_text(stale)
        make_run(tmp_path)
        assert "warning: taking over the unreadable lock" in capsys.readouterr().err
        me = psutil.Process()
        assert json.loads(lock.read_text()) == {"host": os.uname().nodename, "pid": me.pid, "started": me.create_time()}
        assert sorted(os.listdir(lock.parent)) == ["run.lock"]  # no temporary file left


def test_a_live_holder_is_refused_and_an_ended_one_or_a_reused_pid_taken_over(tmp_path):
    lock = tmp_path / "runs" / "unit" / "run.lock"
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        live = {"host": os.uname().nodename, "pid": holder.pid, "started": psutil.Process(holder.pid).create_time()}
        lock.write_text(json.dumps(live))
        with pytest.raises(RunError) as refused:
            make_run(tmp_path)
        assert str(refused.value) == (f"{lock.parent} is in use by the run of process {holder.pid} on "
                                      f"{os.uname().nodename} ({lock}); wait for it to end, or pass another --run_name")
        assert json.loads(lock.read_text()) == live  # untouched
        lock.write_text(json.dumps({**live, "started": live["started"] - 1000}))  # its pid, but a later process
        make_run(tmp_path)
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    finally:
        holder.kill()
        holder.wait()
    lock.write_text(json.dumps(live))  # the holder has ended
    make_run(tmp_path)
    assert json.loads(lock.read_text())["pid"] == os.getpid()


def test_a_lock_of_another_host_names_the_flag_that_takes_it_over(tmp_path):
    lock = tmp_path / "runs" / "unit" / "run.lock"
    lock.parent.mkdir(parents=True)
    lock.write_text(json.dumps({"host": "gone-container-7f3a", "pid": 12, "started": 1.0}))
    with pytest.raises(RunError, match="--take_over_lock") as refused:
        make_run(tmp_path)
    assert str(refused.value).startswith(f"{lock.parent} is locked by process 12 on the host gone-container-7f3a "
                                         f"({lock}), which cannot be checked from {os.uname().nodename}")
    make_run(tmp_path, take_over_lock=True)
    assert json.loads(lock.read_text())["pid"] == os.getpid()


# ---------------------------------------------------------------- the inputs' content hashes
def test_a_resume_on_other_input_contents_is_refused_naming_both(tmp_path, capsys):
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    (data / "train" / "data-00000-of-00001.arrow").write_bytes(b"the rows as prepared")
    (data / "train" / "state.json").write_text('{"_fingerprint": "a"}')  # not what the run reads
    run, model, optimizer = make_run(tmp_path)
    run.inputs(query_dataset=str(data), base_model="EleutherAI/a-hub-name")
    run.start({"update": 0}, num_updates=4)
    step(model, optimizer)
    run.checkpoint(1, {})
    digest = run_infra.content_digest(str(data))
    checkpoint = tmp_path / "runs" / "unit" / "checkpoints" / "update_000001"
    assert json.load(open(checkpoint / "manifest.json"))["inputs"] == {
        "query_dataset": {"path": str(data), "sha256": digest},
        "base_model": {"path": "EleutherAI/a-hub-name", "sha256": None}}

    # prepared again, byte for byte (new file times, other datasets bookkeeping): the same input
    (data / "train" / "data-00000-of-00001.arrow").write_bytes(b"the rows as prepared")
    (data / "train" / "state.json").write_text('{"_fingerprint": "b"}')
    (data / "train" / "cache-1234.arrow").write_bytes(b"a map cache of datasets")
    make_run(tmp_path, resume=True)[0].inputs(query_dataset=str(data))

    (data / "train" / "data-00000-of-00001.arrow").write_bytes(b"the rows shuffled")  # other contents
    changed = run_infra.content_digest(str(data))
    with pytest.raises(RunError) as refused:
        make_run(tmp_path, resume=True)[0].inputs(query_dataset=str(data))
    assert str(refused.value) == (
        f"--resume: {checkpoint} was made from other contents than these inputs hold: --query_dataset {data} (sha256 "
        f"{digest[:12]} then, {changed[:12]} now). Resume with the inputs it was made from, or pass "
        "--accept_changed_inputs to go on with these knowingly")
    run = make_run(tmp_path, resume=True, accept_changed_inputs=True)[0]
    run.inputs(query_dataset=str(data))
    assert "--resume with changed inputs (--accept_changed_inputs): --query_dataset" in capsys.readouterr().out
    assert run.digests["query_dataset"]["sha256"] == changed  # what its own checkpoints will record


# ---------------------------------------------------------------- the same command again, without --resume
def test_a_run_folder_with_checkpoints_is_refused_without_resume_and_restart_deletes_them_explicitly(tmp_path, capsys):
    run, model, optimizer = make_run(tmp_path)  # a run cut after update 4 that saved every 2 updates
    run.start({"update": 0}, num_updates=8)
    for update in (2, 4):
        step(model, optimizer)
        run.checkpoint(update, {})
    checkpoints = tmp_path / "runs" / "unit" / "checkpoints"
    saved = sorted(os.listdir(checkpoints))
    assert saved == ["update_000002", "update_000004"]

    with pytest.raises(RunError) as refused:  # the same command again: Run refuses before any model loads
        make_run(tmp_path)
    assert str(refused.value) == (
        f"the run folder {tmp_path / 'runs' / 'unit'} holds checkpoints of an earlier run named 'unit' (newest: "
        "update_000004); this launch neither continues nor replaces them. Pass --resume to continue from the newest, "
        "or --restart to delete them and start over (or another --run_name to keep them and start a new run)")
    assert sorted(os.listdir(checkpoints)) == saved  # nothing deleted
    with pytest.raises(RunError, match="pass one of them"):
        make_run(tmp_path, resume=True, restart=True)
    assert sorted(os.listdir(checkpoints)) == saved

    run = make_run(tmp_path, restart=True)[0]  # the explicit way to start over
    assert run.resume_from is None and sorted(os.listdir(checkpoints)) == saved  # deleted only once the run starts
    assert run.start({"update": 0}, num_updates=8) == {"update": 0}
    assert not checkpoints.exists()
    assert f"--restart: deleting the checkpoints in {checkpoints}, starting over" in capsys.readouterr().out
    make_run(tmp_path)  # no checkpoints left: the plain command runs again


# ---------------------------------------------------------------- finite weights only
def test_a_checkpoint_of_non_finite_weights_or_optimizer_state_is_refused(tmp_path):
    run, model, optimizer = make_run(tmp_path)
    run.start({"update": 0}, num_updates=4)
    step(model, optimizer)
    run.checkpoint(1, {})
    checkpoints = tmp_path / "runs" / "unit" / "checkpoints"
    exp_avg = optimizer.state[model.weight]["exp_avg"]
    exp_avg[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"^the checkpoint of update 2 was not saved: the optimizer's exp_avg of "
                                             r"weight \(NaN or inf\)\. The newest checkpoint is still .*update_000001$"):
        run.checkpoint(2, {})
    exp_avg[0, 0] = 0.0
    with torch.no_grad():
        model.bias[1] = float("inf")
    with pytest.raises(NonFiniteError, match=r"not saved: the weight bias \(NaN or inf\)"):
        run.checkpoint(2, {})
    assert sorted(os.listdir(checkpoints)) == ["update_000001"]  # nothing else written, no temporary folder


def test_a_loaded_model_with_a_non_finite_weight_is_refused_naming_file_and_tensor(tmp_path):
    from conftest import tiny_causal_lm

    model = tiny_causal_lm()
    run_infra.check_finite(model, "any/path")  # finite: nothing to say
    with torch.no_grad():
        model.gpt_neox.layers[1].mlp.dense_h_to_4h.weight[3, 5] = float("nan")
    model.save_pretrained(tmp_path / "diverged")
    with pytest.raises(NonFiniteError) as refused:
        run_infra.check_finite(model, str(tmp_path / "diverged"))
    assert str(refused.value).startswith(f"{tmp_path / 'diverged' / 'model.safetensors'} holds non-finite weights: "
                                         "gpt_neox.layers.1.mlp.dense_h_to_4h.weight has 1 NaN or inf values of 2048")


# ---------------------------------------------------------------- a full disk
def test_a_full_disk_during_a_checkpoint_names_the_folder_and_the_space(tmp_path, small_disk):
    disk = small_disk("disk", "3m")  # a checkpoint of the 400 x 400 layer and its AdamW: about 1.9 MiB
    run, model, optimizer = make_run(disk, width=400)
    run.start({"update": 0}, num_updates=4)
    step(model, optimizer)
    first = run.checkpoint(1, {})
    size = sum(json.load(open(os.path.join(first, "manifest.json")))["files"].values())
    step(model, optimizer)
    checkpoints = disk / "runs" / "unit" / "checkpoints"
    with pytest.raises(RunError) as full:
        run.checkpoint(2, {})
    assert str(full.value) == (f"the disk holding {checkpoints} is full: the checkpoint of update 2 was not saved (it "
                               f"needs about {size / 2**20:.1f} MiB). The newest checkpoint is still {first}. Free space "
                               "there, then --resume")
    assert os.listdir(checkpoints) == ["update_000001"]  # the half-written one is gone: the space is free again


def test_a_full_output_folder_names_it_and_the_size_of_the_model(tmp_path, small_disk):
    from conftest import tiny_causal_lm

    class Tokenizer:
        def save_pretrained(self, folder):
            open(os.path.join(folder, "tokenizer.json"), "w").write("{}")

    out = small_disk("out", "64k")  # the model's 98 KiB of weights do not fit
    accelerator, model = Accelerator(cpu=True), tiny_causal_lm()
    needed = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    with pytest.raises(RunError) as full:
        run_infra.save_pretrained_model(accelerator, model, model, Tokenizer(), str(out))
    assert str(full.value) == (f"the disk holding {out} is full: the final model was not saved (it needs about "
                               f"{needed / 2**20:.1f} MiB). Free space there, then run again (--resume: from the newest "
                               "checkpoint, if any)")


# ---------------------------------------------------------------- the response starts where the query ends
PAD = 0


def query_response_data(prepared: bool, shift_row: Optional[int] = None, shift_labels: bool = False) -> Dataset:
    """Three rows in data/prepare.py's layout: query_token left-padded to 4, query + response right-padded to 7, and
    labels = the same with the query as [PAD]. `shift_row`: that row's token column one position to the right."""
    queries, responses = [[5, 6], [7, 8, 9], [3]], [[11, 2], [12, 13, 2], [14, 2]]
    rows = {"query_token": [], "query_chosen_token": [], "query_chosen_token_response_label": []}
    for i, (q, r) in enumerate(zip(queries, responses)):
        tokens = q + r + [PAD] * (7 - len(q) - len(r))
        rows["query_token"].append([PAD] * (4 - len(q)) + q)
        rows["query_chosen_token_response_label"].append([PAD] * len(q) + tokens[len(q):])
        rows["query_chosen_token"].append([PAD] + tokens[:-1] if i == shift_row else tokens)
    if shift_labels:
        rows["query_chosen_token_response_label"][1] = [PAD] + rows["query_chosen_token_response_label"][1][:-1]
    info = DatasetInfo(description=json.dumps({"tokenizer": {"vocab_size": 16}}) if prepared else "")
    return Dataset.from_dict(rows, info=info)


def test_a_token_column_shifted_by_one_is_refused_naming_the_row():
    for prepared in (True, False):
        run_infra.check_query_response(query_response_data(prepared), PAD, "data split 'train'")  # intact: no error
    with pytest.raises(RunError) as shifted:
        run_infra.check_query_response(query_response_data(True, shift_row=1), PAD, "data split 'train'")
    assert str(shifted.value) == (
        "data split 'train' row 1: the response in 'query_chosen_token' does not start where the query ends: its first "
        "tokens are not the row's query_token; prepare the data again with data/prepare.py")
    with pytest.raises(RunError, match=r"^data split 'train' row 2: .* 'query_chosen_token_response_label' is not it "
                                       r"with the query masked by \[PAD\] \(0\)"):
        run_infra.check_query_response(query_response_data(False, shift_row=2), PAD, "data split 'train'")
    with pytest.raises(RunError, match=r"row 1: .*'query_chosen_token_response_label' is not it"):
        run_infra.check_query_response(query_response_data(True, shift_labels=True), PAD, "data split 'train'")
