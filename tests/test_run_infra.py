"""rlhf_utils/run.py's own pieces, in one process and cheap (a 4 x 4 layer, a tiny dataset), and the checks of
rlhf_utils/checks.py it relies on: the expected-error hook, the lock, the inputs' content hashes on --resume, the
finite checks at load and before a checkpoint, a full disk (a real small tmpfs; skipped, with the reason, where
mounting is refused; the final model's save is rlhf_utils/models.py's) and the query/response check of token columns.
The training scripts meet the same code end to end in tests/test_run.py."""

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field, fields
from typing import Optional

import psutil
import pytest
import torch
from accelerate import Accelerator
from datasets import Dataset, DatasetInfo

from rlhf_utils import checks, models
from rlhf_utils import run as run_module
from rlhf_utils.checks import NonFiniteError, RunError
from rlhf_utils.flags import RunFlags
from rlhf_utils.run import Run

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class RunArgs:
    """The fields of a training script's Args that Run reads: its own, and the run's flags as `run` (RunFlags)."""
    output_dir: str
    exp_name: str = "unit"
    seed: int = 1
    run: RunFlags = field(default_factory=RunFlags)


def run_args(cls, tmp_path, **kw):
    """`cls` (RunArgs or one built on it) over tmp_path/runs and tmp_path/out, run "unit" keeping 2 checkpoints; each
    keyword that names a run flag (resume=True, take_over_lock=True, ...) goes to its RunFlags, the others to `cls`."""
    flags = {"run_dir_root": str(tmp_path / "runs"), "run_name": "unit", "checkpoint_keep": 2}
    flags.update({name: kw.pop(name) for name in [f.name for f in fields(RunFlags)] if name in kw})
    return cls(str(tmp_path / "out"), run=RunFlags(**flags), **kw)


def make_run(tmp_path, width: int = 4, **kw):
    """A Run over a prepared width x width layer and its AdamW, as a script has them when it checkpoints."""
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    run = Run(run_args(RunArgs, tmp_path, **kw), accelerator)
    return run, model, optimizer


def step(model, optimizer) -> None:
    model(torch.ones(1, model.in_features)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


# ---------------------------------------------------------------- expected errors: one paragraph, no traceback
@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_an_expected_error_is_one_paragraph_from_rank_0_and_a_failed_exit(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(f"import sys\nsys.path.insert(0, {REPO_ROOT!r})\n"
                      "from rlhf_utils import checks\n"
                      "raise (checks.RunError if sys.argv[1] == 'expected' else KeyError)('bad flag: --x 3')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    ran = {(kind, rank): subprocess.run([sys.executable, str(script), kind], capture_output=True, text=True,
                                        timeout=120, env={**env, **({"RANK": rank} if rank else {})})
           for kind, rank in (("expected", None), ("expected", "1"), ("unexpected", None))}
    first, other, unexpected = ran.values()
    assert first.returncode == other.returncode == unexpected.returncode == 1
    assert first.stderr == "script.py: error: bad flag: --x 3\n"
    assert other.stderr == ""  # another rank of the same launch: silent
    assert "Traceback" in unexpected.stderr and unexpected.stderr.strip().endswith("KeyError: 'bad flag: --x 3'")


def test_the_expected_errors_are_value_errors_and_the_non_finite_stop_is_one():
    assert issubclass(RunError, ValueError)
    assert issubclass(NonFiniteError, RunError) and issubclass(NonFiniteError, RuntimeError)
    # the judge's client: a judge that cannot be used stops the run
    from rlhf_utils.judge_client import JudgeUnavailableError
    assert issubclass(JudgeUnavailableError, RunError)


def test_the_run_module_loads_no_http_client():
    """The judge's HTTP client lives in rlhf_utils/judge_client.py, which imports rlhf_utils/run.py; the run module
    imports nothing of it, so a training script pays for neither openai nor the client's sqlite cache."""
    loaded = subprocess.run([sys.executable, "-c", "import sys, rlhf_utils.run; print(sorted({'openai', 'sqlite3', "
                             "'rlhf_utils.judge_client'} & set(sys.modules)))"], capture_output=True, text=True,
                            timeout=120,
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
def test_a_resume_on_other_input_contents_is_refused_naming_both(tmp_path, capsys, monkeypatch):
    import huggingface_hub  # the hub name below is in the hub's local cache: a model path check_model_path passes

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda name, file: f"/hub_cache/{name}/{file}")
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    (data / "train" / "data-00000-of-00001.arrow").write_bytes(b"the rows as prepared")
    (data / "train" / "state.json").write_text('{"_fingerprint": "a"}')  # not what the run reads
    run, model, optimizer = make_run(tmp_path)
    run.inputs(query_dataset=str(data), base_model="EleutherAI/a-hub-name")
    run.start({"update": 0}, num_updates=4)
    step(model, optimizer)
    run.checkpoint(1, {})
    digest = run_module.content_digest(str(data))
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
    changed = run_module.content_digest(str(data))
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


@dataclass
class RewardFnArgs(RunArgs):
    """A script's Args with --reward_fn (ppo.py and the others that take it)."""
    reward_fn: Optional[list] = None


def test_a_resume_with_a_reward_functions_file_edited_is_refused_naming_it(tmp_path, capsys):
    """Every --reward_fn function's file is an input (issue 64, item 3): its bytes, recorded with the checkpoint and
    compared at --resume as a dataset's are; the same bytes rewritten resume, an edit is refused naming the file."""
    first, second = tmp_path / "a.py", tmp_path / "b.py"
    first.write_text("def f(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    second.write_text("def g(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    specs = [f"{first}:f", f"{second}:g"]

    def resumed(**kw):
        run = Run(run_args(RewardFnArgs, tmp_path, reward_fn=specs, resume=True, **kw), Accelerator(cpu=True))
        run.inputs()
        return run

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    run = Run(run_args(RewardFnArgs, tmp_path, reward_fn=specs), accelerator)
    run.inputs()
    run.start({"update": 0}, num_updates=4)
    step(model, optimizer)
    run.checkpoint(1, {})
    checkpoint = tmp_path / "runs" / "unit" / "checkpoints" / "update_000001"
    digest = run_module.content_digest(str(second))
    assert json.load(open(checkpoint / "manifest.json"))["inputs"] == {
        "reward_fn[0]": {"path": str(first), "sha256": run_module.content_digest(str(first))},
        "reward_fn[1]": {"path": str(second), "sha256": digest}}

    second.write_text(second.read_text())  # the same bytes, written again: the same input
    resumed()
    second.write_text("def g(completions, **kwargs):\n    return [2.0] * len(completions)\n")  # edited in place
    edited = run_module.content_digest(str(second))
    with pytest.raises(RunError) as refused:
        resumed()
    assert str(refused.value) == (
        f"--resume: {checkpoint} was made from other contents than these inputs hold: --reward_fn[1] {second} (sha256 "
        f"{digest[:12]} then, {edited[:12]} now). Resume with the inputs it was made from, or pass "
        "--accept_changed_inputs to go on with these knowingly")
    assert resumed(accept_changed_inputs=True).digests["reward_fn[1]"]["sha256"] == edited
    assert f"--resume with changed inputs (--accept_changed_inputs): --reward_fn[1] {second}" in capsys.readouterr().out


def uncached_digest(path: str) -> str:
    """content_digest's definition, computed here without its cache."""
    import hashlib

    digest = hashlib.sha256()
    for file in sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names if not f.startswith("cache-")
                       and f != "state.json"):
        digest.update(os.path.relpath(file, path).encode() + hashlib.sha256(open(file, "rb").read()).digest())
    return digest.hexdigest()


@pytest.fixture
def digest_cache(tmp_path, monkeypatch):
    """content_digest's cache in a file of the test's own; files count as settled once written (SETTLED_NS 0: the
    test waits a clock tick itself); `opened` lists the input files content_digest reads."""
    import builtins

    monkeypatch.setattr(run_module, "DIGEST_CACHE", str(tmp_path / "user_cache" / "content_digests.json"))
    monkeypatch.setattr(run_module, "SETTLED_NS", 0)
    opened, real_open = [], builtins.open

    def counting_open(file, *args, **kwargs):
        if str(file).startswith(str(tmp_path / "data")):
            opened.append(os.path.basename(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    return opened


def test_an_unchanged_input_is_not_read_again_and_a_rewritten_one_is(tmp_path, digest_cache):
    """The files' hashes are cached by (path, size, mtime, ctime, inode, device): a second content_digest of an
    unchanged folder reads none of its files; a file rewritten in place with the same size, its mtime even put back
    (as `cp -p` does), is read again, and the digest is its new contents'."""
    import time

    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    arrow, config = data / "train" / "data-00000-of-00001.arrow", data / "config.json"
    arrow.write_bytes(b"the rows as prepared")
    config.write_text("{}")
    time.sleep(0.05)  # past the file system's clock tick: a later write stamps a later ctime
    first = run_module.content_digest(str(data))
    assert sorted(digest_cache) == ["config.json", "data-00000-of-00001.arrow"] and first == uncached_digest(str(data))
    assert set(json.load(open(run_module.DIGEST_CACHE))) >= {str(arrow), str(config)}

    digest_cache.clear()
    assert run_module.content_digest(str(data)) == first and digest_cache == []  # from the cache: nothing read

    was = os.stat(arrow)
    with open(arrow, "r+b") as f:  # the same inode, the same size
        f.write(b"THE")
    os.utime(arrow, ns=(was.st_atime_ns, was.st_mtime_ns))  # and the same mtime: only the ctime tells
    now = os.stat(arrow)
    assert (now.st_size, now.st_mtime_ns, now.st_ino) == (was.st_size, was.st_mtime_ns, was.st_ino)
    digest_cache.clear()
    changed = run_module.content_digest(str(data))
    assert digest_cache == ["data-00000-of-00001.arrow"]  # read again; config.json still from the cache
    assert changed != first and changed == uncached_digest(str(data))


def test_a_file_hashed_just_after_a_change_is_not_cached(tmp_path, digest_cache, monkeypatch):
    """A file changed less than SETTLED_NS before its hashing is read every time (a rewrite of the same size within the
    file system's clock tick could carry the same times); a cache that is off, unreadable or unwritable is no error."""
    monkeypatch.setattr(run_module, "SETTLED_NS", 3 * 10**9)  # the default
    data = tmp_path / "data"
    data.mkdir()
    (data / "model.safetensors").write_bytes(b"weights")
    first = run_module.content_digest(str(data))
    assert run_module.content_digest(str(data)) == first and digest_cache == ["model.safetensors"] * 2
    assert not os.path.exists(run_module.DIGEST_CACHE)

    monkeypatch.setattr(run_module, "SETTLED_NS", 0)
    os.makedirs(os.path.dirname(run_module.DIGEST_CACHE))
    with open(run_module.DIGEST_CACHE, "w") as f:
        f.write('{"truncated": [1, 2')  # unreadable: as if empty, then written whole
    assert run_module.content_digest(str(data)) == first == uncached_digest(str(data))
    assert str(data / "model.safetensors") in json.load(open(run_module.DIGEST_CACHE))
    monkeypatch.setattr(run_module, "DIGEST_CACHE", str(data / "model.safetensors" / "not_a_folder.json"))
    assert run_module.content_digest(str(data)) == first  # unwritable: no cache, the same digest
    monkeypatch.setattr(run_module, "DIGEST_CACHE", "")  # RLHF_DIGEST_CACHE= : off
    digest_cache.clear()
    assert run_module.content_digest(str(data)) == first and digest_cache == ["model.safetensors"]


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
                                             r"weight \(NaN or inf\)\. The newest checkpoint is still "
                                             r".*update_000001$"):
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
    checks.check_finite(model, "any/path")  # finite: nothing to say
    with torch.no_grad():
        model.gpt_neox.layers[1].mlp.dense_h_to_4h.weight[3, 5] = float("nan")
    model.save_pretrained(tmp_path / "diverged")
    with pytest.raises(NonFiniteError) as refused:
        checks.check_finite(model, str(tmp_path / "diverged"))
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
                               f"needs about {size / 2**20:.1f} MiB). The newest checkpoint is still {first}. "
                               "Free space there, then --resume")
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
        models.save_pretrained_model(accelerator, model, model, Tokenizer(), str(out))
    assert str(full.value) == (f"the disk holding {out} is full: the final model was not saved (it needs about "
                               f"{needed / 2**20:.1f} MiB). Free space there, then run again (--resume: from the "
                               "newest checkpoint, if any)")


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
        checks.check_query_response(query_response_data(prepared), PAD, "data split 'train'")  # intact: no error
    with pytest.raises(RunError) as shifted:
        checks.check_query_response(query_response_data(True, shift_row=1), PAD, "data split 'train'")
    assert str(shifted.value) == (
        "data split 'train' row 1: the response in 'query_chosen_token' does not start where the query ends: its first "
        "tokens are not the row's query_token; prepare the data again with data/prepare.py")
    with pytest.raises(RunError, match=r"^data split 'train' row 2: .* 'query_chosen_token_response_label' is not it "
                                       r"with the query masked by \[PAD\] \(0\)"):
        checks.check_query_response(query_response_data(False, shift_row=2), PAD, "data split 'train'")
    with pytest.raises(RunError, match=r"row 1: .*'query_chosen_token_response_label' is not it"):
        checks.check_query_response(query_response_data(True, shift_labels=True), PAD, "data split 'train'")


# ---------------------------------------------------------------- --resume with other number-deciding flags
@dataclass
class Knobs:
    kl_coef: float = 0.05


@dataclass
class FlagArgs(RunArgs):
    """RunArgs with flags that decide numbers (lr, eps, a nested --ppo.kl_coef) and one that does not (eval_every)."""
    lr: float = 1e-3
    eps: float = 1e-8
    eval_every: int = 5
    ppo: Knobs = None

    def __post_init__(self):
        self.ppo = self.ppo or Knobs()


class KLCoefficient:
    """A registered object told the accepted changes (as ppo.py's AdaptiveKLController is)."""
    def __init__(self, value: float):
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]

    def flags_changed(self, changed: dict) -> None:
        self.value = changed.get("ppo.kl_coef", (None, self.value))[1]


def flag_run(tmp_path, num_updates: int = 10, **kw):
    """A Run over a layer, its AdamW (lr and eps from the flags), a linear schedule and a KL coefficient, all
    registered for checkpointing as a script registers them."""
    args = run_args(FlagArgs, tmp_path, **kw)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    adamw = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=args.eps)
    schedule = torch.optim.lr_scheduler.LambdaLR(adamw, lambda t: max(0.0, (num_updates - t) / num_updates))
    model, optimizer, schedule = accelerator.prepare(model, adamw, schedule)
    kl = KLCoefficient(args.ppo.kl_coef)
    accelerator.register_for_checkpointing(kl)
    return Run(args, accelerator), model, optimizer, schedule, kl


def test_a_resume_with_changed_flags_is_refused_naming_each_before_anything_loads(tmp_path, capsys):
    run, model, optimizer, schedule, _ = flag_run(tmp_path)
    run.start({"update": 0}, num_updates=10)
    step(model, optimizer)
    schedule.step()
    run.checkpoint(1, {})
    checkpoint = tmp_path / "runs" / "unit" / "checkpoints" / "update_000001"
    assert json.load(open(checkpoint / "manifest.json"))["flags"]["ppo.kl_coef"] == 0.05

    with pytest.raises(RunError) as refused:  # refused in Run(), before a script loads any model
        flag_run(tmp_path, resume=True, lr=0.03, ppo=Knobs(kl_coef=0.5), eval_every=1)
    assert str(refused.value) == (
        f"--resume: {checkpoint} was made with other flags than these: --lr 0.001 -> 0.03; --ppo.kl_coef 0.05 -> 0.5. "
        "Resume with the flags it was made with (its run's args.json lists them), or pass --accept_changed_flags to "
        "go on with the new values knowingly (they apply from the next update; args.json records both)")
    # the flags that decide no number may change freely (run_module.FREE_FLAGS)
    resumed = flag_run(tmp_path, resume=True, eval_every=1, checkpoint_keep=5, overwrite_output_dir=True)[0]
    assert resumed.resume_from == str(checkpoint) and resumed.changed == {}


def test_accepted_changed_flags_take_effect_and_args_json_records_both(tmp_path, capsys):
    run, model, optimizer, schedule, _ = flag_run(tmp_path)
    run.start({"update": 0}, num_updates=10)
    for update in (1, 2, 3):
        step(model, optimizer)
        schedule.step()
    run.checkpoint(3, {})

    run, model, optimizer, schedule, kl = flag_run(tmp_path, resume=True, accept_changed_flags=True, lr=2e-3,
                                                   eps=1e-6, ppo=Knobs(kl_coef=0.5))
    assert "--resume with changed flags (--accept_changed_flags): --lr 0.001 -> 0.002; --eps 1e-08 -> 1e-06; " \
           "--ppo.kl_coef 0.05 -> 0.5" in capsys.readouterr().out
    kl.value = 123.0  # what a checkpoint restores is then replaced by the new flag
    run.start({"update": 0}, num_updates=10)
    group = optimizer.param_groups[0]
    # the restored schedule continues at step 3, from the new base: 2e-3 x (10 - 3) / 10
    assert schedule.scheduler.last_epoch == 3 and group["lr"] == 2e-3 * (7 / 10) and group["initial_lr"] == 2e-3
    assert group["eps"] == 1e-6 and kl.value == 0.5
    step(model, optimizer)
    schedule.step()
    assert group["lr"] == 2e-3 * (6 / 10)
    recorded = json.load(open(tmp_path / "runs" / "unit" / "args.json"))
    assert recorded["lr"] == 2e-3 and recorded["changed_on_resume"] == [{"after_update": 3, "flags": {
        "lr": {"was": 1e-3, "now": 2e-3}, "eps": {"was": 1e-8, "now": 1e-6}, "ppo.kl_coef": {"was": 0.05, "now": 0.5}}}]


def test_the_run_flags_are_recorded_flat_as_before_their_group(tmp_path):
    """The run's flags live in one group (args.run, RunFlags) but keep their flat names where a run records them:
    args.json and a checkpoint's flags say "resume" and "checkpoint_keep", not "run.resume", so pipeline.py,
    ablate.py and a --resume across the refactor read the names they read before; a nested algorithm group keeps
    its dotted names (ppo.kl_coef)."""
    run, model, optimizer, schedule, _ = flag_run(tmp_path, checkpoint_every=3)
    run.start({"update": 0}, num_updates=10)
    step(model, optimizer)
    run.checkpoint(1, {})
    recorded = json.load(open(tmp_path / "runs" / "unit" / "args.json"))
    assert "run" not in recorded and recorded["run_name"] == "unit" and recorded["checkpoint_every"] == 3
    assert recorded["checkpoint_keep"] == 2 and recorded["resume"] is False and recorded["ppo"] == {"kl_coef": 0.05}
    flags = run.flags  # what every checkpoint records and a --resume compares
    assert flags["checkpoint_every"] == 3 and flags["ppo.kl_coef"] == 0.05
    assert not [name for name in flags if name.startswith("run.")]
    assert {f.name for f in fields(RunFlags)} <= set(flags)


def test_every_free_flag_is_a_flag_of_some_script_and_none_decides_a_number():
    """FREE_FLAGS names real flags (no stale name) and none of the flags that obviously decide numbers; every
    training script has --accept_changed_flags. A script's flags: the fields of its classes, and those of each group
    of rlhf_utils/flags.py that one of them takes in (`run: RunFlags`) or builds on (`EndpointArgs(EndpointFlags)`)."""
    import ast
    import dataclasses

    from conftest import training_scripts
    from rlhf_utils import flags

    groups = {name: {f.name for f in fields(group)} for name, group in vars(flags).items()
              if isinstance(group, type) and dataclasses.is_dataclass(group)}
    script_flags = {}
    for name in training_scripts():
        for node in ast.walk(ast.parse(open(os.path.join(REPO_ROOT, name)).read())):
            if isinstance(node, ast.ClassDef):
                annotated = [s for s in node.body if isinstance(s, ast.AnnAssign)]
                names = {s.target.id for s in annotated}
                used = {n.id for part in node.bases + [s.annotation for s in annotated] for n in ast.walk(part)
                        if isinstance(n, ast.Name)}
                for group in used & groups.keys():
                    names |= groups[group]
                script_flags.setdefault(name, set()).update(names)
    every = set().union(*script_flags.values())
    assert run_module.FREE_FLAGS - every == set()
    assert not run_module.FREE_FLAGS & {"seed", "lr", "eps", "weight_decay", "scheduler", "total_episodes",
                                       "total_batch_size", "local_micro_batch_size", "temperature", "response_length",
                                       "kl_coef", "beta", "bf16", "disable_dropout", "query_dataset", "sft_model_path"}
    assert all("accept_changed_flags" in names for names in script_flags.values()), script_flags.keys()


def test_a_checkpoint_of_an_older_script_version_is_refused_naming_what_it_lacks(tmp_path):
    """A trainer state without a key this version keeps (e.g. ppo.py's budget counters, added later): one paragraph,
    not a KeyError in the middle of the loop."""
    run, model, optimizer = make_run(tmp_path)
    run.start({"update": 0}, num_updates=4)
    step(model, optimizer)
    run.checkpoint(1, {})
    resumed = make_run(tmp_path, resume=True)[0]
    with pytest.raises(RunError) as refused:
        resumed.start({"update": 0, "budget": {}}, num_updates=4)
    checkpoint = tmp_path / "runs" / "unit" / "checkpoints" / "update_000001"
    assert str(refused.value) == (
        f"--resume: {checkpoint} was written by an older version of this script (its trainer state has no budget); "
        "finish that run with the version that wrote it, or --restart to start over")


# A process that joined a process group, then leave_processes(): an exit handler registered before the group (so it
# runs after the run module's, which destroys it), and an object whose __del__ only the interpreter's teardown would
# run.
LEAVE_PROBE = """import atexit, os, socket, sys, torch
sys.path.insert(0, {root!r})
from rlhf_utils import run as run_module
out = {out!r}
atexit.register(lambda: open(os.path.join(out, "handlers_ran"), "w").write(str(torch.distributed.is_initialized())))
class Teardown:
    def __del__(self, open=open, path=os.path.join(out, "teardown_ran")):  # (names bound now: teardown clears globals)
        open(path, "w").write("yes")
keep = Teardown()
if {join!r}:
    run_module.start_processes()  # (registers the group's destruction at exit)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=0, world_size=1)
run_module.leave_processes()
print("main went on", flush=True)
"""


@pytest.mark.parametrize("join", [True, False])
def test_leaving_after_a_process_group_runs_the_exit_handlers_and_skips_the_teardown(tmp_path, join):
    """With a process group: the exit handlers run (the group destroyed first), the interpreter's teardown does not
    (where a gloo worker thread can abort the process under DeepSpeed, docs/results.md), exit 0. Without one (a run
    of one process), leave_processes returns and the process ends as usual."""
    script = tmp_path / "leave_probe.py"
    script.write_text(LEAVE_PROBE.format(root=REPO_ROOT, out=str(tmp_path), join=join))
    env = {**os.environ, "ACCELERATE_USE_CPU": "true"}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "handlers_ran").read_text() == "False"  # ran, after the group was destroyed
    assert (tmp_path / "teardown_ran").exists() is not join
    assert ("main went on" in result.stdout) is not join


def test_every_training_script_leaves_its_processes_right_after_main():
    """Each script that joins a process group (start_processes) ends its __main__ block with main(...) and then
    leave_processes(), so a user's multi-process run never reaches the teardown that could abort it."""
    import ast

    missing = []
    for name in sorted(os.listdir(REPO_ROOT)):
        if not name.endswith(".py"):
            continue
        source = open(os.path.join(REPO_ROOT, name)).read()
        if "start_processes(" not in source:
            continue
        block = [node for node in ast.parse(source).body
                 if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)]
        calls = [ast.unparse(statement.value.func) for statement in block[-1].body
                 if isinstance(statement, ast.Expr)] if block else []
        if calls != ["main", "leave_processes"]:
            missing.append(f"{name}: {calls}")
    assert not missing, missing
