"""Shared fixtures and helpers. `synthetic_task` prepares a small built-in task once per test session;
`short_preference` cuts its preference data to 40 training pairs. `ENV` is the environment of the training
subprocesses, `without_timing` drops the wall-clock keys of a metrics row before two runs are compared, and
`kill_after_checkpoint` interrupts a run with SIGKILL right after a checkpoint (the resume tests), `run_ok` runs
one to its end, and the `assert_*` helpers compare saved weights and check the checkpoint left by a non-finite stop.
`training_scripts` finds the training scripts (a fork joins the tests that use it by existing) and `free_port`
gives each multi-process run a port of its own."""

import ast
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

# Tests share 2 cores with each other's subprocesses: one thread each keeps them from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# The environment of every training subprocess a test starts: one thread each, whatever the caller exported, and the
# repository on the module path, so that a script run from elsewhere (tests/mp_probe.py loads one by its path; runpy
# runs one from a temporary folder) still imports the rlhf_utils package beside it.
# A test that needs more (e.g. ACCELERATE_USE_CPU for torchrun on a CPU) extends it: {**ENV, "NAME": "value"}.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONPATH": os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)}


RUN_MODULE = "rlhf_utils.run"  # the run module every training script imports (rlhf_utils/run.py)


def constructs_run(tree: ast.Module) -> bool:
    """Whether a module calls the run module's `Run`: `Run(...)` after `from rlhf_utils.run import Run` (under any
    alias), or `run.Run(...)` after `from rlhf_utils import run` (under any alias), `import rlhf_utils.run as run` or
    `import rlhf_utils.run` (then `rlhf_utils.run.Run(...)`). A class of its own named Run does not count."""
    package, _, name = RUN_MODULE.rpartition(".")
    run_names, module_names = set(), set()  # the names the Run class and the run module are bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == RUN_MODULE and node.level == 0:
            run_names |= {alias.asname or alias.name for alias in node.names if alias.name == "Run"}
        elif isinstance(node, ast.ImportFrom) and node.module == package and node.level == 0:
            module_names |= {alias.asname or alias.name for alias in node.names if alias.name == name}
        elif isinstance(node, ast.Import):
            module_names |= {alias.asname or alias.name for alias in node.names if alias.name == RUN_MODULE}
    return any(isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id in run_names)
        or (isinstance(node.func, ast.Attribute) and node.func.attr == "Run"
            and ast.unparse(node.func.value) in module_names))
        for node in ast.walk(tree))


def training_scripts(root: str = REPO_ROOT) -> list:
    """The training scripts, found rather than listed: every top-level *.py of the repository that defines a
    top-level `main` and constructs the run module's run object (`Run(...)` from rlhf_utils.run). A new or renamed fork
    joins every test that uses this list by existing. File names, sorted."""
    found = []
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        tree = ast.parse(open(path).read(), filename=path)
        defines_main = any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body)
        if defines_main and constructs_run(tree):
            found.append(os.path.basename(path))
    return found


def free_port() -> int:
    """A TCP port no process listens on now, for the rendezvous of one multi-process run (torchrun's --master_port,
    accelerate launch's --main_process_port). The system picks it, so two tests running at once (pytest -n 2) never
    share one the way two hard-coded ports can."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_timing(key: str) -> bool:
    """Whether a metrics/summary key measures wall-clock time, so it legitimately differs between two correct
    runs: seconds (`wall_time_s`, `train/time_s`, `cost/training_s`, ...), speeds (`train/tokens_per_s`,
    `episodes_per_second`) and ppo.py's shares of the update time (`time/generation_share`, ...)."""
    return key.startswith("time/") or key.endswith(("_s", "_per_second"))


def without_timing(row: dict) -> dict:
    """A metrics row (or summary) without its wall-clock keys: what two runs with the same seed must share."""
    return {k: v for k, v in row.items() if not is_timing(k)}


def run_ok(command: list, cwd, env=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a training script to its end; fail with the tail of its stderr unless it exits with code 0."""
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def kill_after_checkpoint(command: list, checkpoint, cwd, env=None, timeout: float = 300) -> None:
    """Start a training run and SIGKILL it, with every process it started, as soon as its `checkpoint` folder
    exists (checkpoints are renamed into place, so an existing folder is complete). Fails, showing the run's output,
    unless the run was still going when the checkpoint appeared: a run that crashed, finished before the kill, or
    wrote no checkpoint within `timeout` seconds cannot test a resume."""
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        while not os.path.isdir(checkpoint) and process.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        # the run and every process it started: a launcher's workers (accelerate launch, torchrun) run in sessions
        # of their own and would otherwise go on training
        try:
            processes = psutil.Process(process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            processes = []
        for child in processes:
            try:
                child.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        process.send_signal(signal.SIGKILL)  # does nothing if the run has already ended
        returncode = process.wait(timeout=60)
        log.seek(0)
        output = log.read()[-3000:]
    assert returncode == -signal.SIGKILL, (
        f"the run ended (exit code {returncode}) before it could be killed mid-way:\n{output}")
    assert os.path.isdir(checkpoint), f"no {checkpoint} after {timeout} s:\n{output}"


def assert_same_safetensors(path_a, path_b) -> None:
    """Two saved weight files hold the same tensor names and bit-identical tensors (a resumed run against the
    run that was never interrupted)."""
    import torch
    from safetensors.torch import load_file

    a, b = load_file(str(path_a)), load_file(str(path_b))
    assert a.keys() == b.keys(), f"{path_a} and {path_b} hold different tensors"
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"{len(different)} tensors of {path_b} differ from {path_a}, e.g. {different[:3]}"


def assert_last_good_checkpoint(checkpoints, update: int) -> dict:
    """After a non-finite stop, the `checkpoints` folder holds one checkpoint, the one of the last good `update`,
    with finite weights only (the poisoned weights are never saved). Returns its trainer_state.json."""
    import torch
    from safetensors.torch import load_file

    name = f"update_{update:06d}"
    assert sorted(os.listdir(checkpoints)) == [name]
    weights = load_file(os.path.join(checkpoints, name, "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values()), f"{name} holds non-finite weights"
    with open(os.path.join(checkpoints, name, "trainer_state.json")) as f:
        state = json.load(f)
    assert state["update"] == update
    return state


# A training run with one NaN planted in an otherwise ordinary run: the quantities of the `call`-th run.guard of
# `update` become NaN (the script runs in a Python whose rlhf_utils.run.Run.guard is wrapped so). Every script guards
# its loss before the backward pass that would use it, so this stops a run where a NaN loss would. A resumed run,
# without the plant, trains on.
NAN_AT = """
import runpy, sys, torch; from rlhf_utils import run as run_module
guard, calls = run_module.Run.guard, []
def planted(self, update, **quantities):
    calls.append(update)
    if update == {update} and calls.count(update) == {call}:
        quantities = {{name: torch.full_like(value, float("nan")) for name, value in quantities.items()}}
    guard(self, update, **quantities)
run_module.Run.guard = planted
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def with_nan_at(command: list, update: int, call: int = 1) -> list:
    """`command` ([python, script, flags...]) with a NaN planted in the `call`-th guarded quantities of `update`."""
    return [command[0], "-c", NAN_AT.format(update=update, call=call), *command[1:]]


def assert_same_checkpoint(ordinary, fallback) -> None:
    """Two checkpoints of one update (the ordinary one of an uninterrupted run, the non-finite fallback's) hold the
    same: every file accelerate wrote (weights, AdamW, schedule, registered objects) byte for byte, accelerate's random
    states (every RNG state and its micro-batch count `step`), the manifest but for the trainer state's size, and the
    trainer state but for its wall-clock values (train_time, and without_timing on it and on its dicts)."""
    import torch

    ordinary, fallback = str(ordinary), str(fallback)
    names = sorted(os.listdir(ordinary))
    assert sorted(os.listdir(fallback)) == names
    for name in names:
        paths = [os.path.join(d, name) for d in (ordinary, fallback)]
        if name.startswith("random_states_"):
            states = [torch.load(path, weights_only=False) for path in paths]
            assert states[0].keys() == states[1].keys()
            for key in states[0]:
                same = (torch.equal(states[0][key], states[1][key]) if isinstance(states[0][key], torch.Tensor)
                        else repr(states[0][key]) == repr(states[1][key]))
                assert same, f"{fallback}: {key} differs from the ordinary checkpoint's"
        elif name == "trainer_state.json":
            states = [without_timing({k: v for k, v in json.load(open(path)).items() if k != "train_time"})
                      for path in paths]
            states = [{k: without_timing(v) if isinstance(v, dict) else v for k, v in state.items()}
                      for state in states]
            assert states[0] == states[1], name
        elif name == "manifest.json":  # the size of the trainer state differs with its seconds
            manifests = [json.load(open(path)) for path in paths]
            for manifest in manifests:
                manifest.get("files", {}).pop("trainer_state.json", None)
                # the flags but those that decide no number (the two runs differ in name and folders)
                from rlhf_utils import run as run_module
                manifest["flags"] = {k: v for k, v in manifest.get("flags", {}).items()
                                     if k.split(".")[-1] not in run_module.FREE_FLAGS}
            assert manifests[0] == manifests[1], name
        else:
            assert open(paths[0], "rb").read() == open(paths[1], "rb").read(), (
                f"{name} differs between {ordinary} and {fallback}")


def load_script(name: str):
    """Import a top-level script (e.g. "ppo") as a module, so tests can call its helpers and main()."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO_ROOT, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bigram_policy(table):
    """A policy whose logits at a position are a table's row (a copy of `table`, trained) of the token before, called
    as the group scripts' Policy is (no ptx): the update tests train it on a fixed rollout in this process."""
    import torch

    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(table.clone())

        def forward(self, query_responses, pad_token_id, context_length, ptx_query_responses=None, ptx_labels=None):
            return self.table[query_responses[:, context_length - 1 : -1]], None

    return Bigram()


def run_two_processes(*command: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """A script (and its arguments) under torchrun on 2 CPU processes (gloo), from the repository root; fails with
    the tail of its stderr unless both exit with code 0."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port()), *command]
    result = subprocess.run(torchrun, cwd=REPO_ROOT, env={**ENV, "ACCELERATE_USE_CPU": "true"}, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def tiny_causal_lm(seed: int = 0, vocab_size: int = 16, pad_token_id: int = 1, eos_token_id: int = 2):
    """A 2-layer GPT-NeoX small enough for exact hand checks (eval mode, seeded weights)."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    config = GPTNeoXConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, eos_token_id=eos_token_id, bos_token_id=eos_token_id, pad_token_id=pad_token_id,
    )
    return GPTNeoXForCausalLM(config).eval()


SMALL_TASK_FLAGS = [
    "--synthetic_num_sft_train", "256", "--synthetic_num_sft_eval", "48", "--synthetic_num_sft_test", "48",
    "--synthetic_num_pref_train", "256", "--synthetic_num_pref_valid", "64", "--synthetic_num_cnndm", "8",
    "--synthetic_warmup_steps", "20", "--no-plots",
]


def prepare_small_task(out_dir: str, *extra: str) -> dict:
    """Run data/prepare.py on a small built-in task (a real subprocess, as users run it)."""
    cmd = [sys.executable, os.path.join(REPO_ROOT, "data", "prepare.py"), "--task", "synthetic",
           "--output_dir", out_dir, *SMALL_TASK_FLAGS, *extra]
    subprocess.run(cmd, check=True, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
    return {
        "root": out_dir,
        "base_model": os.path.join(out_dir, "base_model"),
        "sft": os.path.join(out_dir, "sft"),
        "preference": os.path.join(out_dir, "preference"),
        "task_json": os.path.join(out_dir, "task.json"),
        "task": json.load(open(os.path.join(out_dir, "task.json"))),
    }


@pytest.fixture(scope="session")
def tiny_models(synthetic_task, tmp_path_factory) -> dict:
    """For the runs of ppo.py's forks (test_rloo, test_grpo, test_reinforce_pp): the base model stands in for the SFT
    policy; the RM is the base model with a fresh scalar head, seeded, so every worker makes the same one."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    root = tmp_path_factory.mktemp("tiny_models")
    tokenizer = AutoTokenizer.from_pretrained(synthetic_task["base_model"])
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(
        synthetic_task["base_model"], num_labels=1).save_pretrained(root / "rm")
    tokenizer.save_pretrained(root / "rm")
    return {"sft": synthetic_task["base_model"], "rm": str(root / "rm")}


@pytest.fixture(scope="session")
def ci_pipeline(tmp_path_factory) -> tuple:
    """`pipeline.py --mode ci` once a session, with a fork outside the project named by --extra: its folder and its
    command. test_pipeline checks its artefacts and reruns it; test_ablate takes its prep, SFT and RM as the ablations'
    upstream (the pipeline's own layout, which ablate.py would otherwise make with the same stages). The tests that use
    it are one xdist_group("ci_pipeline"), so that one worker runs it once."""
    root = tmp_path_factory.mktemp("ci_pipeline")
    out, fork = root / "qs", root / "forks" / "my_rloo.py"  # a fork kept outside the project still imports rlhf_utils
    fork.parent.mkdir()
    fork.write_text(open(os.path.join(REPO_ROOT, "rloo.py")).read())
    cmd = [sys.executable, os.path.join(REPO_ROOT, "pipeline.py"), "--mode", "ci", "--out", str(out), "--extra",
           f"{fork}:rloo"]
    subprocess.run(cmd, check=True, cwd=REPO_ROOT, timeout=1200)
    return out, cmd


@pytest.fixture(scope="session")
def synthetic_task(tmp_path_factory) -> dict:
    """Paths of a small prepared built-in task: base_model, sft, preference, task_json."""
    return prepare_small_task(str(tmp_path_factory.mktemp("synthetic_task")))


@pytest.fixture(scope="session")
def short_preference(synthetic_task, tmp_path_factory) -> str:
    """The built-in preference data with a 40-pair train split, so that a run of a few updates of 16 pairs
    crosses epoch boundaries (5 micro batches of 8 per epoch) and even has an update spanning two epochs."""
    from datasets import load_from_disk

    data = load_from_disk(synthetic_task["preference"])
    data["train"] = data["train"].select(range(40))
    path = str(tmp_path_factory.mktemp("short_preference") / "preference")
    data.save_to_disk(path)
    return path


@pytest.fixture
def small_disk(tmp_path):
    """small_disk(name, size): a real tmpfs of `size` (e.g. "3m") mounted at tmp_path/name, unmounted after the test
    (CI runs as root); the test is skipped, with the reason, where mounting is refused."""
    mounted = []

    def mount(name: str, size: str):
        folder = tmp_path / name
        folder.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a {size} tmpfs here (not root, or no CAP_SYS_ADMIN): {result.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.fixture(scope="session")
def repo_root() -> str:
    return REPO_ROOT
