"""Side-by-side speed of our trainers and TRL's on the same model, rows and settings; prints ours/TRL per trainer.

    python tools/bench_trl.py                                        # all four trainers, defaults below
    python tools/bench_trl.py --trainers dpo ppo --rows 256 2048 --repeats 3
    python tools/bench_trl.py --pipeline_dir artifacts/quickstart    # the quickstart's data and SFT / RM models
    python tools/bench_trl.py --rows 32 64 --repeats 1 --precisions fp32   # a smoke run (a few minutes)

Pairs compared (our script, run as a subprocess exactly as a user types it; TRL's trainer, run as a subprocess of
a virtual environment that holds TRL):

    sft     sft.py    vs SFTTrainer    (current TRL)   rows = (query, reference) pairs, loss on the summary and EOS
    reward  reward.py vs RewardTrainer (current TRL)   rows = preference pairs, pairwise loss
    dpo     dpo.py    vs DPOTrainer    (current TRL)   rows = preference pairs, sigmoid loss, live reference model
    ppo     ppo.py    vs PPOTrainer    (TRL 1.12, the last release that has it)   rows = episodes

What it does, step by step:
  1. TRL: a virtual environment per TRL version under --venv_root (`python -m venv --system-site-packages`, then
     `pip install trl==X` with a constraint that pins the torch this machine already has, so pip never fetches
     another torch; a transformers / accelerate that a TRL release needs and the system lacks goes into the venv).
     Made once, reused while it imports the pinned TRL.
  2. The task: a prepared built-in task (--task_dir, or --pipeline_dir's data/), or a new one prepared here once
     (data/prepare.py --task synthetic at the quickstart's sizes with a short warm-up: the speed of a model does not
     depend on how well it was warmed up). The SFT and reward models: --sft_model / --reward_model, the pipeline's
     models/sft and models/rm, or short runs of sft.py and reward.py made here once (pipeline.py's ci sizes).
  3. For each row count N of --rows, the task's train split cut to its first N rows (saved in the work folder), so
     that both sides train one epoch over exactly the same rows.
  4. Runs, interleaved so that a slow spell of a shared machine hits both sides alike: per trainer and precision,
     repeat r = 1..R: (ours, N1), (TRL, N1), (ours, N2), (TRL, N2). The wall time of a run is that of its whole
     process (start-up, data loading, training, final evaluation, saving).
  5. Rates: a side's rate in repeat r is (N2 - N1) / (wall(N2) - wall(N1)): start-up, loading and the final
     evaluation take the same time at N1 and N2 rows and cancel. The ratio of repeat r is ours / TRL; the table
     gives the median rate of each side and the median ratio (and every ratio).
  6. `bench.md` (the table, also printed, with the CPU model and what it has: AVX2, AVX-512, bf16 instructions)
     and `bench.json` (every run: command, rows, wall time, exit code) in --out.

How the two sides are matched:
  - the same model files (the base model for SFT; the SFT model for the reward model, DPO's policy and reference
    and PPO's policy and reference; the reward model for PPO's reward and critic), float32 weights on both sides;
  - the same token ids: TRL gets our prepared token columns with the padding cut off (pre-tokenized datasets: SFT
    `input_ids` + `labels` (-100 on the query), reward `chosen_ids` / `rejected_ids` (query + response), DPO
    `prompt_ids` / `chosen_ids` / `rejected_ids`, PPO `input_ids` (the query)), so no text is tokenized again and
    both sides read the same tokens of the same rows. No truncation on either side (TRL's max_length=None): every
    row already fits the task's widths. Padding stays each side's own: our scripts cut each batch of the data's
    fixed-width rows to its columns that hold a real token (real_columns), TRL's collators pad each batch to its longest row (PPO's queries on the left);
  - the same batch and micro batch (TRL: per_device_train_batch_size = our micro batch, gradient accumulation =
    batch / micro batch), one epoch over the N rows, the same learning rate, AdamW epsilon 1e-5 and weight decay,
    the same schedule without warm-up (cosine; PPO linear on both sides), no gradient clipping (none of our scripts
    clips; TRL's max_grad_norm=0), no gradient checkpointing (TRL's default is on: turned off), dropout off on
    both sides, no logging service, no checkpoints, no evaluation during training;
  - precision: the float32 row turns TRL's bf16 default off (bf16=False) and runs ours in float32 (its CPU
    default). The bf16 row (only on a CPU with bf16 instructions: avx512_bf16 or amx_bf16 in /proc/cpuinfo) runs
    ours with --bf16 True and TRL with bf16=True; both are bf16 autocast over float32 weights. TRL 1.12's
    PPOTrainer builds its own Accelerator, which reads the precision from ACCELERATE_MIXED_PRECISION (what
    `accelerate launch --mixed_precision` sets): the tool sets that variable for every TRL bf16 run;
  - the same threads: OMP_NUM_THREADS / MKL_NUM_THREADS = --threads for every process, and torch.set_num_threads
    in TRL's process;
  - PPO: the same rollout shapes (response_length tokens, always that many: TRL without a stop token, ours by
    Detail 23), temperature 0.7, 4 PPO epochs, 1 minibatch, the same rollout forward batch, KL coefficient 0.05;
  - DPO: beta 0.1, sigmoid loss, the reference model run live on both sides (no precomputed log-probs).
Not matched, because each side's own design decides them: the final evaluation and saving (they cancel in the
marginal rate), TRL's per-step logging and our metric logging, and what each side does with padding.

This file is glue, not an algorithm (like pipeline.py): it runs the scripts, which never import it. Measured
ratios: docs/results.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRL_FLAG = "--_trl"  # internal: `<venv python> tools/bench_trl.py --_trl spec.json` runs one TRL trainer

TRAINERS = ["sft", "reward", "dpo", "ppo"]
SCRIPT = {"sft": "sft.py", "reward": "reward.py", "dpo": "dpo.py", "ppo": "ppo.py"}
TRL_NAME = {"sft": "SFTTrainer", "reward": "RewardTrainer", "dpo": "DPOTrainer", "ppo": "PPOTrainer"}
UNIT = {"sft": "rows/s", "reward": "pairs/s", "dpo": "pairs/s", "ppo": "episodes/s"}

# Per trainer: batch and micro batch (rows per optimizer step / per forward-backward pass; for reward and DPO a
# row is a pair, i.e. two sequences), learning rate and schedule. The sizes and rates are those the issue's
# measurement used (pipeline.py's quickstart for PPO), the learning rates pipeline.py's.
SETTINGS = {
    "sft": {"batch": 16, "micro": 16, "lr": 3e-3, "scheduler": "cosine", "weight_decay": 0.01, "rows": (256, 2048)},
    "reward": {"batch": 16, "micro": 16, "lr": 1e-3, "scheduler": "cosine", "weight_decay": 0.01, "rows": (256, 2048)},
    "dpo": {"batch": 32, "micro": 8, "lr": 3e-4, "scheduler": "cosine", "weight_decay": 0.0, "rows": (256, 2048),
            "beta": 0.1},
    "ppo": {"batch": 32, "micro": 16, "lr": 1e-4, "scheduler": "linear", "weight_decay": 0.01, "rows": (128, 512),
            "rollout_forward_batch": 32, "num_ppo_epochs": 4, "temperature": 0.7, "kl_coef": 0.05},
}
EVAL_ROWS = 16  # rows of our final evaluations (a fixed cost: it cancels in the marginal rate)

# The task prepared when none is given: the quickstart's split sizes (enough rows for the default --rows) with a
# short base-model warm-up and small evaluation splits.
PREP_FLAGS = ["--synthetic_warmup_steps", "20", "--synthetic_num_sft_eval", "48", "--synthetic_num_pref_valid", "64",
              "--synthetic_num_cnndm", "8", "--no-plots"]


@dataclass
class Args:
    trainers: list[str] = field(default_factory=lambda: list(TRAINERS))
    """which comparisons to run: any of sft reward dpo ppo"""
    rows: Optional[list[int]] = None
    """N1 N2: rows (SFT rows, preference pairs, PPO episodes) of the short and the long run; each a multiple of the
    trainer's batch. None = per trainer: sft, reward and dpo 256 2048, ppo 128 512"""
    repeats: int = 3
    """runs of each (side, N); the table gives the median"""
    threads: int = 0
    """torch threads of every run (OMP_NUM_THREADS); 0 = all cores of this machine"""
    precisions: list[str] = field(default_factory=lambda: ["auto"])
    """fp32 and/or bf16; auto = fp32, plus bf16 when the CPU has bf16 instructions (avx512_bf16 or amx_bf16)"""
    out: str = "artifacts/bench_trl"
    """where bench.md and bench.json go"""
    work_dir: Optional[str] = None
    """prepared task, models, row subsets and run folders; None = <out>/work"""
    pipeline_dir: Optional[str] = None
    """a pipeline.py output folder: its data/ is the task, models/sft and models/rm the models"""
    task_dir: Optional[str] = None
    """a prepared built-in task (data/prepare.py --task synthetic); None = --pipeline_dir's, else one made here"""
    sft_model: Optional[str] = None
    """the SFT model (DPO, reward and PPO start from it); None = --pipeline_dir's, else a short sft.py run made here"""
    reward_model: Optional[str] = None
    """the reward model of PPO (reward and critic); None = --pipeline_dir's, else a short reward.py run made here"""
    trl_version: str = "1.16.0"
    """TRL release for SFTTrainer, RewardTrainer and DPOTrainer (the current one)"""
    trl_ppo_version: str = "1.12.0"
    """TRL release for PPOTrainer (1.12: the last release that has it)"""
    venv_root: str = os.path.join(os.path.expanduser("~"), ".cache", "rlhf-bench")
    """folder of the TRL virtual environments (venv-trl-<major.minor>)"""


# --------------------------------------------------------------------------------------------
# Pure pieces: CPU features, the run order, the rates (tests/test_bench_trl.py checks each)
# --------------------------------------------------------------------------------------------
def cpu_features(cpuinfo: str) -> dict:
    """What the CPU has, from the text of /proc/cpuinfo: its model name, AVX2, AVX-512 (avx512f) and bf16
    instructions (avx512_bf16 or AMX's amx_bf16). Ratios of two trainers move with these."""
    flags: set[str] = set()
    model = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags" and not flags:
            flags = set(value.split())
        elif key == "model name" and not model:
            model = value.strip()
    return {
        "model": model or platform.processor() or "unknown",
        "avx2": "avx2" in flags,
        "avx512": "avx512f" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "bf16": "avx512_bf16" in flags or "amx_bf16" in flags,
    }


def describe_cpu(cpu: dict, threads: int) -> str:
    bf16 = [name for name in ("avx512_bf16", "amx_bf16") if cpu[name]]
    return (f"CPU: {cpu['model']}; AVX2 {'yes' if cpu['avx2'] else 'no'}, AVX-512 {'yes' if cpu['avx512'] else 'no'}, "
            f"bf16 instructions {'yes (' + ', '.join(bf16) + ')' if bf16 else 'no'}; {threads} threads")


def resolve_precisions(requested: list[str], cpu: dict) -> list[str]:
    """fp32 always with auto; bf16 only on a CPU with bf16 instructions (asked for by name elsewhere: an error)."""
    out: list[str] = []
    for name in requested:
        if name == "auto":
            out += ["fp32"] + (["bf16"] if cpu["bf16"] else [])
        elif name in ("fp32", "bf16"):
            if name == "bf16" and not cpu["bf16"]:
                raise ValueError("--precisions bf16: this CPU has no bf16 instructions (neither avx512_bf16 nor "
                                 "amx_bf16 in /proc/cpuinfo); bf16 would be emulated and the ratio meaningless. "
                                 "Use --precisions fp32")
            out.append(name)
        else:
            raise ValueError(f"--precisions {name}: expected fp32, bf16 or auto")
    return list(dict.fromkeys(out))


def rows_of(trainer: str, rows: Optional[list[int]]) -> tuple[int, int]:
    """N1 < N2 for one trainer, each a whole number of its batches (our scripts drop an incomplete last batch)."""
    n1, n2 = SETTINGS[trainer]["rows"] if rows is None else rows
    batch = SETTINGS[trainer]["batch"]
    if not 0 < n1 < n2:
        raise ValueError(f"--rows {n1} {n2}: need 0 < N1 < N2")
    for n in (n1, n2):
        if n % batch:
            raise ValueError(f"--rows: {n} is not a multiple of {trainer}'s batch of {batch}; use "
                             f"{n // batch * batch or batch} or {(n // batch + 1) * batch}")
    return n1, n2


def schedule(trainers: list[str], precisions: list[str], repeats: int, rows: dict) -> list[tuple]:
    """The runs in order: per trainer and precision, repeat r: (ours, N1), (TRL, N1), (ours, N2), (TRL, N2).
    Each item: (trainer, precision, repeat, n, side)."""
    order = []
    for trainer in trainers:
        for precision in precisions:
            for repeat in range(repeats):
                for n in rows[trainer]:
                    for side in ("ours", "trl"):
                        order.append((trainer, precision, repeat, n, side))
    return order


def marginal_rate(n1: int, wall1: float, n2: int, wall2: float) -> float:
    """(N2 - N1) rows / (wall time at N2 - wall time at N1): what start-up and final evaluation cost cancels.
    NaN when the longer run was not slower (noise larger than the work: use more rows)."""
    if wall2 <= wall1:
        return float("nan")
    return (n2 - n1) / (wall2 - wall1)


def summarize(runs: list[dict], trainer: str, precision: str) -> Optional[dict]:
    """Rates and ratios of one trainer and precision from its runs (dicts with side, repeat, rows, wall_s, ok):
    per repeat, each side's marginal rate and ours / TRL; then the medians. None when no repeat has all four runs."""
    mine = [r for r in runs if r["trainer"] == trainer and r["precision"] == precision and r["ok"]]
    by_key = {(r["side"], r["repeat"], r["rows"]): r["wall_s"] for r in mine}
    sizes = sorted({r["rows"] for r in mine})
    repeats = sorted({r["repeat"] for r in mine})
    if len(sizes) < 2:
        return None
    n1, n2 = sizes[0], sizes[-1]
    ours, trl, ratios = [], [], []
    for repeat in repeats:
        walls = [by_key.get((side, repeat, n)) for side in ("ours", "trl") for n in (n1, n2)]
        if None in walls:
            continue
        rate_ours = marginal_rate(n1, walls[0], n2, walls[1])
        rate_trl = marginal_rate(n1, walls[2], n2, walls[3])
        ours.append(rate_ours)
        trl.append(rate_trl)
        ratios.append(rate_ours / rate_trl)
    if not ratios:
        return None
    # a repeat whose longer run was not slower on one side (NaN rate) stays in the lists but not in the medians
    valid = [i for i, ratio in enumerate(ratios) if math.isfinite(ratio)]

    def median(values):
        return statistics.median(values[i] for i in valid) if valid else float("nan")

    return {"trainer": trainer, "precision": precision, "rows": [n1, n2], "rates_ours": ours, "rates_trl": trl,
            "ratios": ratios, "rate_ours": median(ours), "rate_trl": median(trl), "ratio": median(ratios)}


# --------------------------------------------------------------------------------------------
# Our prepared rows -> TRL's pre-tokenized formats (the same token ids, the padding cut off)
# --------------------------------------------------------------------------------------------
def real_query(row: dict) -> list[int]:
    """The query's tokens without its left padding (Detail 5 pads queries on the left)."""
    n = row["query_token_len"]
    return list(row["query_token"][len(row["query_token"]) - n:])


def checked_concat(row: dict, column: str, response: list[int], where: str) -> list[int]:
    """query + response, checked against the row's own right-padded query+response column, so that both sides
    read the same tokens; an error names the row when the columns disagree."""
    tokens = real_query(row) + response
    if list(row[column][: len(tokens)]) != tokens or row[f"{column}_len"] != len(tokens):
        raise ValueError(f"{where}: {column} is not the query followed by its response; prepare the data again "
                         "with data/prepare.py")
    return tokens


def sft_example(row: dict, where: str = "row") -> dict:
    """SFTTrainer's pre-tokenized row: input_ids = query + reference + EOS, labels = -100 on the query (the loss on
    the summary and its EOS, as sft.py's --loss_on response)."""
    n = row["reference_response_token_len"]
    response = list(row["reference_response_token"][:n])
    input_ids = checked_concat(row, "query_reference_response_token", response, where)
    return {"input_ids": input_ids, "labels": [-100] * (len(input_ids) - n) + response}


def response_of(row: dict, name: str) -> list[int]:
    return list(row[f"{name}_token"][: row[f"{name}_token_len"]])


def reward_example(row: dict, where: str = "row") -> dict:
    """RewardTrainer's pre-tokenized pair: query + chosen and query + rejected."""
    return {name + "_ids": checked_concat(row, f"query_{name}_token", response_of(row, name), where)
            for name in ("chosen", "rejected")}


def dpo_example(row: dict, where: str = "row") -> dict:
    """DPOTrainer's pre-tokenized triple: the query, and each response (with its EOS) apart."""
    pair = reward_example(row, where)  # checks both columns
    query = real_query(row)
    return {"prompt_ids": query, "chosen_ids": pair["chosen_ids"][len(query):],
            "rejected_ids": pair["rejected_ids"][len(query):]}


def ppo_example(row: dict, where: str = "row") -> dict:
    """PPOTrainer's query: its real tokens (TRL's collator pads them on the left to the longest in the batch)."""
    return {"input_ids": real_query(row)}


CONVERT = {"sft": sft_example, "reward": reward_example, "dpo": dpo_example, "ppo": ppo_example}


def convert_split(dataset, trainer: str, name: str):
    """A prepared split in the format TRL's `trainer` reads (a datasets.Dataset with only those columns)."""
    convert = CONVERT[trainer]
    return dataset.map(lambda row, i: convert(row, f"{name} row {i}"), with_indices=True,
                       remove_columns=dataset.column_names, desc=f"{name} -> TRL {trainer}")


# --------------------------------------------------------------------------------------------
# Set-up: TRL environments, the task, the models, the row subsets
# --------------------------------------------------------------------------------------------
def venv_python(args: Args, version: str) -> str:
    major_minor = ".".join(version.split(".")[:2])
    return os.path.join(args.venv_root, f"venv-trl-{major_minor}", "bin", "python")


def trl_version_in(python: str) -> Optional[str]:
    if not os.path.exists(python):
        return None
    probe = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('trl'))"],
                           capture_output=True, text=True)
    return probe.stdout.strip() if probe.returncode == 0 else None


def ensure_trl(args: Args, version: str) -> str:
    """A virtual environment with TRL `version` that sees this machine's packages, torch pinned to the one here."""
    from importlib.metadata import version as installed

    python = venv_python(args, version)
    if trl_version_in(python) == version:
        return python
    venv = os.path.dirname(os.path.dirname(python))
    print(f"[bench] installing TRL {version} into {venv}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
    constraints = os.path.join(venv, "constraints.txt")
    with open(constraints, "w") as f:  # never another torch (a CUDA wheel would be gigabytes)
        f.write(f"torch=={installed('torch').split('+')[0]}\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "-c", constraints, f"trl=={version}"], check=True)
    if trl_version_in(python) != version:
        raise RuntimeError(f"{venv}: TRL {version} did not install; remove the folder and run again")
    return python


def prepare_inputs(args: Args, work: str, env: dict) -> dict:
    """Paths of the task (sft/ and preference/ datasets, base model) and of the SFT and reward models (each made
    here only when a trainer of --trainers needs it and none was given)."""
    task = args.task_dir or (os.path.join(args.pipeline_dir, "data") if args.pipeline_dir else None)
    if task is None:
        task = os.path.join(work, "task")
        if not os.path.exists(os.path.join(task, "task.json")):  # written last by data/prepare.py
            run_checked([sys.executable, os.path.join(REPO_ROOT, "data", "prepare.py"), "--task", "synthetic",
                         "--output_dir", task, *PREP_FLAGS], env, "preparing the built-in task")
    if not os.path.exists(os.path.join(task, "task.json")):
        raise FileNotFoundError(f"{task} holds no task.json: not a prepared built-in task (python data/prepare.py "
                                "--task synthetic --output_dir DIR)")
    with open(os.path.join(task, "task.json")) as f:
        lengths = json.load(f)
    paths = {"task": task, "sft_data": os.path.join(task, "sft"), "preference": os.path.join(task, "preference"),
             "base_model": os.path.join(task, "base_model"), "response_length": lengths["sft_response_length"]}
    from_pipeline = {"sft_model": "sft", "reward_model": "rm"}
    for key, stage in from_pipeline.items():
        given = getattr(args, key) or (os.path.join(args.pipeline_dir, "models", stage) if args.pipeline_dir else None)
        if given and not model_ready(given):
            raise FileNotFoundError(f"{given} is not a complete model folder (no config.json, or a run.json without "
                                    f'"complete": true); train it to its end, or leave --{key} out to make one here')
        paths[key] = given or os.path.join(work, "models", stage)
    # pipeline.py's ci sizes: a few updates give models of the right shapes (speed does not depend on the weights)
    ci = ["--seed", "1", "--run_dir_root", os.path.join(work, "runs"), "--overwrite_output_dir", "--checkpoint_every", "0"]
    needs_sft, needs_rm = bool(set(args.trainers) & {"reward", "dpo", "ppo"}), "ppo" in args.trainers
    if needs_sft and not model_ready(paths["sft_model"]):
        run_checked([sys.executable, os.path.join(REPO_ROOT, "sft.py"), *ci, "--run_name", "setup_sft",
                     "--base_model", paths["base_model"], "--query_dataset", paths["sft_data"],
                     "--response_length", str(paths["response_length"]), "--output_dir", paths["sft_model"],
                     "--lr", "3e-3", "--total_batch_size", "16", "--local_micro_batch_size", "16",
                     "--total_episodes", "64", "--num_eval_samples", "16"], env, "training the SFT model")
    if needs_rm and not model_ready(paths["reward_model"]):
        run_checked([sys.executable, os.path.join(REPO_ROOT, "reward.py"), *ci, "--run_name", "setup_rm",
                     "--sft_model_path", paths["sft_model"], "--preference_dataset", paths["preference"],
                     "--query_dataset", paths["sft_data"], "--output_dir", paths["reward_model"], "--lr", "1e-3",
                     "--total_batch_size", "16", "--local_micro_batch_size", "16", "--total_episodes", "64",
                     "--num_eval_samples", "16", "--num_normalization_samples", "16"], env, "training the reward model")
    return paths


def model_ready(folder: str) -> bool:
    """A model folder written to its end: our scripts write `"complete": true` into its run.json last (a folder
    without run.json, saved by another tool, counts as ready when it holds a config.json)."""
    try:
        with open(os.path.join(folder, "run.json")) as f:
            return json.load(f).get("complete") is True
    except FileNotFoundError:
        return os.path.exists(os.path.join(folder, "config.json"))
    except ValueError:
        return False


def run_checked(cmd: list[str], env: dict, what: str) -> None:
    print(f"[bench] {what}: {' '.join(cmd)}", flush=True)
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed (exit code {result.returncode}):\n{result.stderr[-3000:]}")


def subset(source: str, n: int, work: str, name: str) -> str:
    """`source` (a saved DatasetDict) with its train split cut to the first n rows; the other splits as they are."""
    from datasets import load_from_disk

    path = os.path.join(work, "subsets", f"{name}_{n}")
    if not os.path.exists(os.path.join(path, "dataset_dict.json")):
        data = load_from_disk(source)
        if len(data["train"]) < n:
            raise ValueError(f"{source}: its train split has {len(data['train'])} rows, fewer than --rows {n}; "
                             "prepare a larger task or ask for fewer rows")
        data["train"] = data["train"].select(range(n))
        shutil.rmtree(path, ignore_errors=True)
        data.save_to_disk(path)
    return path


# --------------------------------------------------------------------------------------------
# One run of each side
# --------------------------------------------------------------------------------------------
def our_command(trainer: str, precision: str, n: int, paths: dict, work: str, run_name: str) -> list[str]:
    s = SETTINGS[trainer]
    common = ["--seed", "1", "--run_name", run_name, "--run_dir_root", os.path.join(work, "runs"),
              "--output_dir", os.path.join(work, "out", f"ours_{trainer}"), "--overwrite_output_dir",
              "--checkpoint_every", "0", "--bf16", str(precision == "bf16"), "--lr", str(s["lr"]),
              "--total_batch_size", str(s["batch"]), "--local_micro_batch_size", str(s["micro"])]
    py = [sys.executable, os.path.join(REPO_ROOT, SCRIPT[trainer])]
    eval_rows = ["--num_eval_samples", str(EVAL_ROWS)]
    if trainer == "sft":
        return py + common + ["--base_model", paths["base_model"], "--query_dataset", paths["rows"],
                              "--response_length", str(paths["response_length"]), "--num_train_epochs", "1",
                              "--scheduler", s["scheduler"], "--local_eval_batch_size", str(EVAL_ROWS), *eval_rows]
    if trainer == "reward":
        return py + common + ["--sft_model_path", paths["sft_model"], "--preference_dataset", paths["rows"],
                              "--query_dataset", paths["sft_data"], "--num_train_epochs", "1",
                              "--scheduler", s["scheduler"], "--weight_decay", str(s["weight_decay"]),
                              "--num_normalization_samples", str(EVAL_ROWS), "--local_eval_batch_size", str(EVAL_ROWS),
                              *eval_rows]
    if trainer == "dpo":
        return py + common + ["--sft_model_path", paths["sft_model"], "--preference_dataset", paths["rows"],
                              "--query_dataset", paths["sft_data"], "--response_length", str(paths["response_length"]),
                              "--num_train_epochs", "1", "--beta", str(s["beta"]), "--loss_type", "sigmoid",
                              "--scheduler", s["scheduler"], "--weight_decay", str(s["weight_decay"]),
                              "--eval_every", "0", "--local_eval_batch_size", str(EVAL_ROWS), *eval_rows]
    return py + common + ["--sft_model_path", paths["sft_model"], "--reward_model_path", paths["reward_model"],
                          "--query_dataset", paths["rows"], "--response_length", str(paths["response_length"]),
                          "--total_episodes", str(n), "--local_rollout_forward_batch_size",
                          str(s["rollout_forward_batch"]), "--temperature", str(s["temperature"]),
                          "--ppo.num_ppo_epochs", str(s["num_ppo_epochs"]), "--ppo.num_mini_batches", "1",
                          "--ppo.kl_coef", str(s["kl_coef"]), "--scheduler", s["scheduler"],
                          "--weight_decay", str(s["weight_decay"]), "--eval_every", "0", "--print_sample_every", "0",
                          *eval_rows]


def timed(cmd: list[str], env: dict, log_path: str) -> tuple[float, int]:
    """Wall time and exit code of one run; its output goes to log_path."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "w") as log:
        start = time.perf_counter()
        code = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        return time.perf_counter() - start, code


def tail(path: str, lines: int = 15) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


# --------------------------------------------------------------------------------------------
# The TRL side (runs inside a TRL virtual environment: `--_trl spec.json`)
# --------------------------------------------------------------------------------------------
def trl_child(spec_path: str) -> None:
    """Train one TRL trainer as the spec says (see trl_spec), one epoch over the spec's rows."""
    with open(spec_path) as f:
        spec = json.load(f)
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    trainer_name, s = spec["trainer"], SETTINGS[spec["trainer"]]
    bf16 = spec["precision"] == "bf16"
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    f32 = {"dtype": torch.float32}

    def no_dropout(model):  # our scripts turn dropout off (Detail 7); so does this side
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
            for name in ("attention_dropout", "attn_dropout"):
                if isinstance(getattr(module, name, None), float):
                    setattr(module, name, 0.0)
        return model

    def causal_lm(path):
        return no_dropout(AutoModelForCausalLM.from_pretrained(path, **f32))

    def scorer(path):
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **f32)
        model.config.pad_token_id = tokenizer.pad_token_id
        return no_dropout(model)

    train = convert_split(load_from_disk(spec["rows"])["train"], trainer_name, "train")
    common = dict(
        output_dir=spec["output_dir"], per_device_train_batch_size=s["micro"],
        gradient_accumulation_steps=s["batch"] // s["micro"], num_train_epochs=1, learning_rate=s["lr"],
        lr_scheduler_type=s["scheduler"], warmup_steps=0, weight_decay=s["weight_decay"], adam_epsilon=1e-5,
        max_grad_norm=0.0, gradient_checkpointing=False, bf16=bf16, use_cpu=not torch.cuda.is_available(),
        report_to="none", save_strategy="no", eval_strategy="no", logging_steps=10, disable_tqdm=True, seed=1,
        dataloader_num_workers=0,
    )
    if trainer_name == "sft":
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(**common, max_length=None, packing=False, padding_free=False)
        trainer = SFTTrainer(model=causal_lm(spec["model"]), args=config, train_dataset=train,
                             processing_class=tokenizer)
    elif trainer_name == "reward":
        from trl import RewardConfig, RewardTrainer

        config = RewardConfig(**common, max_length=None)
        trainer = RewardTrainer(model=scorer(spec["model"]), args=config, train_dataset=train,
                                processing_class=tokenizer)
    elif trainer_name == "dpo":
        from trl import DPOConfig, DPOTrainer

        class PreTokenizedDPOTrainer(DPOTrainer):
            """DPOTrainer that reads rows already split into prompt_ids / chosen_ids / rejected_ids as they are
            (its own preparation tokenizes text; ours is tokenized already, so both sides read the same ids)."""

            def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
                return dataset

        config = DPOConfig(**common, beta=s["beta"], loss_type=["sigmoid"], max_length=None,
                           precompute_ref_log_probs=False)
        trainer = PreTokenizedDPOTrainer(model=causal_lm(spec["model"]), ref_model=causal_lm(spec["model"]),
                                         args=config, train_dataset=train, processing_class=tokenizer)
    else:
        try:
            from trl.experimental.ppo import PPOConfig, PPOTrainer
        except ImportError:
            from trl import PPOConfig, PPOTrainer

        tokenizer.padding_side = "left"  # PPO's queries are left-padded (Detail 5), by its collator here
        evaluation = convert_split(load_from_disk(spec["rows"])["validation"].select(range(EVAL_ROWS)), "ppo",
                                   "validation")
        config = PPOConfig(**{k: v for k, v in common.items() if k != "num_train_epochs"},
                           total_episodes=spec["rows_n"], response_length=spec["response_length"],
                           temperature=s["temperature"], num_ppo_epochs=s["num_ppo_epochs"], num_mini_batches=1,
                           local_rollout_forward_batch_size=s["rollout_forward_batch"], kl_coef=s["kl_coef"],
                           num_sample_generations=0, stop_token=None, missing_eos_penalty=1.0,
                           per_device_eval_batch_size=EVAL_ROWS)
        trainer = PPOTrainer(args=config, processing_class=tokenizer, model=causal_lm(spec["model"]),
                             ref_model=causal_lm(spec["model"]), reward_model=scorer(spec["reward_model"]),
                             value_model=scorer(spec["reward_model"]), train_dataset=train, eval_dataset=evaluation)
    trainer.train()
    # what the trainer ran with, for the run's log: its class, rows, autocast precision and threads
    print(json.dumps({"trl_trainer": type(trainer).__name__, "rows": len(train), "bf16": bf16,
                      "mixed_precision": str(trainer.accelerator.mixed_precision), "threads": torch.get_num_threads()}))


def trl_spec(trainer: str, precision: str, n: int, paths: dict, work: str, threads: int) -> dict:
    model = paths["base_model"] if trainer == "sft" else paths["sft_model"]
    return {"trainer": trainer, "precision": precision, "rows": paths["rows"], "rows_n": n, "model": model,
            "tokenizer": model, "reward_model": paths["reward_model"], "response_length": paths["response_length"],
            "output_dir": os.path.join(work, "out", f"trl_{trainer}"), "threads": threads}


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------
def table(summaries: list[dict], cpu_line: str, versions: dict) -> str:
    lines = [
        "| trainer | precision | rows N1 -> N2 | ours | TRL | ratio ours/TRL (median) | ratios of the repeats |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    def num(x: float) -> str:  # n/a: the longer run was not slower (noise larger than the work)
        return f"{x:.2f}" if math.isfinite(x) else "n/a"

    for s in summaries:
        trainer = s["trainer"]
        name = f"{SCRIPT[trainer]} vs TRL {versions[trainer]} {TRL_NAME[trainer]}"
        lines.append(f"| {name} | {s['precision']} | {s['rows'][0]} -> {s['rows'][1]} | "
                     f"{num(s['rate_ours'])} {UNIT[trainer]} | {num(s['rate_trl'])} | **{num(s['ratio'])}** | "
                     f"{', '.join(num(r) for r in s['ratios'])} |")
    return "\n".join([cpu_line, "", *lines, "",
                      "A rate is (N2 - N1) rows / (wall time at N2 - wall time at N1) of whole processes; "
                      "runs interleaved (ours, TRL) per size and repeat; n/a: the run at N2 was not slower "
                      "than at N1 (use more rows)."])


def main(args: Args) -> dict:
    unknown = [t for t in args.trainers if t not in TRAINERS]
    if unknown:
        raise ValueError(f"--trainers {' '.join(unknown)}: expected some of {' '.join(TRAINERS)}")
    if args.rows is not None and len(args.rows) != 2:
        raise ValueError(f"--rows takes two numbers, N1 N2 (got {args.rows})")
    with open("/proc/cpuinfo") as f:
        cpu = cpu_features(f.read())
    threads = args.threads or os.cpu_count() or 1
    precisions = resolve_precisions(args.precisions, cpu)
    rows = {t: rows_of(t, args.rows) for t in args.trainers}
    out = os.path.abspath(args.out)
    work = os.path.abspath(args.work_dir or os.path.join(out, "work"))
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               WANDB_MODE="disabled", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    cpu_line = describe_cpu(cpu, threads)
    print(f"[bench] {cpu_line}; precisions {' '.join(precisions)}", flush=True)

    versions = {t: args.trl_ppo_version if t == "ppo" else args.trl_version for t in args.trainers}
    pythons = {v: ensure_trl(args, v) for v in sorted(set(versions.values()))}
    paths = prepare_inputs(args, work, env)
    row_data = {}
    for trainer in args.trainers:
        source = paths["sft_data"] if trainer in ("sft", "ppo") else paths["preference"]
        for n in rows[trainer]:
            row_data[trainer, n] = subset(source, n, work, f"{'sft' if trainer in ('sft', 'ppo') else 'pref'}")

    runs: list[dict] = []
    order = schedule(args.trainers, precisions, args.repeats, rows)
    for i, (trainer, precision, repeat, n, side) in enumerate(order):
        run_paths = {**paths, "rows": row_data[trainer, n]}
        name = f"{trainer}_{precision}_{side}_n{n}_r{repeat}"
        run_env = dict(env)
        if side == "ours":
            cmd = our_command(trainer, precision, n, run_paths, work, name)
        else:
            spec_path = os.path.join(work, "specs", f"{name}.json")
            os.makedirs(os.path.dirname(spec_path), exist_ok=True)
            with open(spec_path, "w") as f:
                json.dump(trl_spec(trainer, precision, n, run_paths, work, threads), f, indent=1)
            cmd = [pythons[versions[trainer]], os.path.abspath(__file__), TRL_FLAG, spec_path]
            if precision == "bf16":
                run_env["ACCELERATE_MIXED_PRECISION"] = "bf16"  # read by TRL 1.12 PPOTrainer's own Accelerator
        log_path = os.path.join(work, "logs", f"{name}.log")
        wall, code = timed(cmd, run_env, log_path)
        record = {"trainer": trainer, "precision": precision, "repeat": repeat, "rows": n, "side": side,
                  "wall_s": round(wall, 3), "returncode": code, "ok": code == 0, "command": cmd, "log": log_path}
        runs.append(record)
        status = f"{wall:.1f} s" if code == 0 else f"FAILED (exit {code}), log {log_path}:\n{tail(log_path)}"
        print(f"[bench] {i + 1}/{len(order)} {trainer} {precision} {side:4s} N={n} repeat {repeat + 1}: {status}",
              flush=True)

    summaries = [s for t in args.trainers for p in precisions if (s := summarize(runs, t, p)) is not None]
    text = table(summaries, cpu_line, versions)
    failed = [r for r in runs if not r["ok"]]
    if failed:
        text += f"\n\n{len(failed)} of {len(runs)} runs failed: " + ", ".join(os.path.basename(r["log"]) for r in failed)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(text + "\n")
    result = {"cpu": cpu, "threads": threads, "precisions": precisions, "trl_versions": versions,
              "settings": {t: SETTINGS[t] for t in args.trainers}, "args": dataclasses.asdict(args),
              "summaries": summaries, "runs": runs}
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("\n" + text + f"\n\n[bench] {out}/bench.md, {out}/bench.json")
    return result


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == TRL_FLAG:
        trl_child(sys.argv[2])
    else:
        import tyro

        main(tyro.cli(Args))
