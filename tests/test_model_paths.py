"""A model path that is not there (issue 64, item 4): every model flag of every training script (checks.MODEL_FLAGS,
checked in Run.inputs by rlhf_utils/checks.py's check_model_paths) is refused in seconds with one paragraph naming
the flag and the path, before transformers would take it for a hub name and retry for about 40 s. A path under
models/ (the scripts' own defaults) is never asked of the hub; a hub name is looked up in the local cache and, unless
HF_HUB_OFFLINE, asked of the hub once. No test here reaches the network: the hub's calls are replaced."""

import dataclasses
import time

import huggingface_hub
import pytest
from huggingface_hub.errors import RepositoryNotFoundError

from conftest import load_script, training_scripts
from rlhf_utils import checks
from rlhf_utils.checks import RunError
from rlhf_utils.flags import RunFlags

SCRIPTS = {}  # name -> the loaded script module, each loaded once


def script(name: str):
    if name not in SCRIPTS:
        SCRIPTS[name] = load_script(name)
    return SCRIPTS[name]


def model_flags(name: str) -> list:
    """The model flags of a script's Args (those of checks.MODEL_FLAGS it has)."""
    return [f.name for f in dataclasses.fields(script(name).Args) if f.name in checks.MODEL_FLAGS]


CASES = [(name[:-3], flag) for name in training_scripts() for flag in model_flags(name[:-3])]


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """No network: HF_HUB_OFFLINE=1, and any call that would ask the hub or read its cache fails the test (a path
    under models/ must be refused without either). Runs in tmp_path, where no models/ folder exists."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    asked = []

    def refuse(*args, **kwargs):
        asked.append(args)
        raise AssertionError(f"the hub was asked: {args}")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", refuse)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", refuse)
    monkeypatch.chdir(tmp_path)
    return asked


def saved_model(folder) -> str:
    """A folder that passes as a saved model: it holds a config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    return str(folder)


def args_with(name: str, tmp_path, missing_flag: str, missing: str, **extra):
    """The script's Args with every model flag a saved-model folder, but `missing_flag` set to `missing`."""
    module = script(name)
    flags = {}
    for flag in model_flags(name):
        value = missing if flag == missing_flag else saved_model(tmp_path / "saved" / flag)
        list_flag = "List" in str(next(f.type for f in dataclasses.fields(module.Args) if f.name == flag))
        flags[flag] = [value] if list_flag else value
    return module.Args(run=RunFlags(run_dir_root=str(tmp_path / "runs")), output_dir=str(tmp_path / "out"),
                       **flags, **extra)


def refusal(name: str, args) -> tuple:
    """main() until it stops: the RunError's message and the seconds it took."""
    started = time.monotonic()
    with pytest.raises(RunError) as refused:
        script(name).main(args)
    return str(refused.value), time.monotonic() - started


@pytest.mark.parametrize("name,flag", CASES)
def test_a_missing_folder_under_models_is_refused_at_once_naming_the_flag(name, flag, no_hub, tmp_path):
    """Each model flag of each script, set to a folder under models/ that is not there: one paragraph naming the flag
    and the path, in under 3 s, with no call to the hub or its cache."""
    message, seconds = refusal(name, args_with(name, tmp_path, flag, "models/not_trained_yet"))
    assert message.startswith(f"--{flag} models/not_trained_yet: there is no folder "), message
    assert "\n" not in message and "not asked of the hub" in message and seconds < 3.0, (message, seconds)
    assert no_hub == []


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_the_default_reward_model_beside_a_reward_fn_says_how_to_use_the_function_alone(name, no_hub, tmp_path):
    """The issue's case: `--reward_fn f.py:fn` with the default --reward_model_path models/rm, which is not there."""
    (tmp_path / "f.py").write_text("def fn(queries, responses, **columns):\n    return [0.0] * len(responses)\n")
    module = script(name)
    reward_fn = ["f.py:fn"] if "List" in str(module.Args.__dataclass_fields__["reward_fn"].type) else "f.py:fn"
    args = module.Args(sft_model_path=saved_model(tmp_path / "sft"), reward_fn=reward_fn,
                       run=RunFlags(run_dir_root=str(tmp_path / "runs")), output_dir=str(tmp_path / "out"))
    message, seconds = refusal(name, args)
    assert message.startswith("--reward_model_path models/rm: there is no folder"), message
    assert message.endswith("to score with --reward_fn alone, pass --reward_model_path with nothing after it (no "
                            "reward model is loaded)") and seconds < 3.0, (message, seconds)
    without = refusal(name, args_with(name, tmp_path, "reward_model_path", "models/rm"))[0]
    assert without.startswith("--reward_model_path models/rm:") and "--reward_fn" not in without


def test_online_dpo_checks_the_reward_model_only_where_its_judge_reads_it(no_hub, tmp_path):
    """--judge rm reads --reward_model_path: its default, not there, is refused; --judge reward_fn loads no reward
    model, so the same absent default is not refused (the run gets past the check, to loading the policy)."""
    (tmp_path / "f.py").write_text("def fn(queries, responses, **columns):\n    return [0.0] * len(responses)\n")
    module, sft = script("online_dpo"), saved_model(tmp_path / "sft")
    flags = {"sft_model_path": sft, "output_dir": str(tmp_path / "out")}
    message, _ = refusal("online_dpo", module.Args(run=RunFlags(run_dir_root=str(tmp_path / "rm")), **flags))
    assert message.startswith("--reward_model_path models/rm: there is no folder"), message
    with pytest.raises(Exception) as later:  # the empty config.json of the policy's folder, read by transformers
        module.main(module.Args(judge="reward_fn", reward_fn=["f.py:fn"], **flags,
                                run=RunFlags(run_dir_root=str(tmp_path / "fn"))))
    assert "--reward_model_path" not in str(later.value), str(later.value)
    assert "load_tokenizer" in [entry.name for entry in later.traceback], later.traceback  # past Run.inputs


def test_a_hub_name_not_in_the_cache_is_refused_offline_in_seconds(monkeypatch, tmp_path):
    """HF_HUB_OFFLINE=1, a hub name the cache does not hold: refused naming the flag, the name and HF_HUB_OFFLINE,
    through sft.py's --base_model (its default is a hub name), without asking the hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda *a, **k: pytest.fail("the hub was asked"))
    monkeypatch.chdir(tmp_path)
    module = script("sft")
    message, seconds = refusal("sft", module.Args(base_model="nobody-here/no-such-model", output_dir="out",
                                                  run=RunFlags(run_dir_root=str(tmp_path / "runs"))))
    assert message.startswith("--base_model nobody-here/no-such-model: no such folder, and the hub is off "
                              "(HF_HUB_OFFLINE)") and seconds < 3.0, (message, seconds)


def test_the_hub_is_asked_once_and_its_answer_named(monkeypatch, tmp_path):
    """Online (the hub's calls replaced): a name the hub lacks, and a hub that cannot be reached, are each one
    paragraph naming the flag and the name; a name in the local cache is accepted without asking; a path that
    cannot be a hub name, a file, and a folder without config.json are refused without asking."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.chdir(tmp_path)
    asked = []

    def answer(self, name, timeout=None, **kwargs):
        asked.append((name, timeout))
        if name == "someone/unreachable":
            raise ConnectionError("[Errno -2] Name or service not known")
        missing = RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # (as the hub's 404 raises it, no HTTP)
        Exception.__init__(missing, "404 Client Error: Repository Not Found")
        raise missing

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", answer)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache",
                        lambda name, file: "/cache/config.json" if name == "someone/cached" and file == "config.json"
                        else None)
    with pytest.raises(RunError, match=r"^--sft_model_path someone/absent: no such folder, and the hub has no model "
                                       r"of that name"):
        checks.check_model_path("sft_model_path", "someone/absent")
    with pytest.raises(RunError, match=r"^--reward_model_path someone/unreachable: no such folder, and the hub could "
                                       r"not be asked .*\(ConnectionError: \[Errno -2\] Name or service not known\)"):
        checks.check_model_path("reward_model_path", "someone/unreachable")
    assert asked == [("someone/absent", checks.HUB_TIMEOUT_S), ("someone/unreachable", checks.HUB_TIMEOUT_S)]
    checks.check_model_path("sft_model_path", "someone/cached")  # in the cache: no question
    (tmp_path / "weights.safetensors").write_text("")
    (tmp_path / "empty").mkdir()
    for path, expected in [("./nowhere/model", "it cannot be a hub name either"), ("weights.safetensors", "is a file"),
                           ("empty", "holds no config.json")]:
        with pytest.raises(RunError, match=expected):
            checks.check_model_path("model_path", path)
    assert len(asked) == 2
    checks.check_model_path("model_path", saved_model(tmp_path / "saved"))  # a saved model's folder passes
