"""Shared fixtures. `synthetic_task` prepares a small built-in task once per test session."""

import json
import os
import subprocess
import sys

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

def load_script(name: str):
    """Import a top-level script (e.g. "ppo") as a module, so tests can call its helpers and main()."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO_ROOT, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    "--synthetic_num_sft_train", "256", "--synthetic_num_sft_eval", "48",
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
def synthetic_task(tmp_path_factory) -> dict:
    """Paths of a small prepared built-in task: base_model, sft, preference, task_json."""
    return prepare_small_task(str(tmp_path_factory.mktemp("synthetic_task")))


@pytest.fixture(scope="session")
def repo_root() -> str:
    return REPO_ROOT
