"""Side-by-side speed of our trainers and TRL's on the same model, rows and settings; prints ours/TRL per trainer.

    python tools/bench_trl.py                                        # all four trainers, defaults below
    python tools/bench_trl.py --trainers dpo ppo --rows 256 2048 --repeats 3
    python tools/bench_trl.py --pipeline_dir artifacts/quickstart    # the quickstart's data and SFT / RM models
    python tools/bench_trl.py --rows 32 64 --repeats 1 --precisions fp32   # a smoke run (a few minutes)
    python tools/bench_trl.py --shape pythia160m                     # the paper's model shape, random weights
    python tools/bench_trl.py --sides ours before trl --before_repo ../before   # also an older copy of the project
    python tools/bench_trl.py --shape tiny --sides ours --trainers sft --rows 8 4800 --repeats 1   # ours only, no TRL

Pairs compared (our script, run as a subprocess exactly as a user types it; TRL's trainer, run as a subprocess of
a virtual environment that holds TRL):

    sft     sft.py    vs SFTTrainer    (current TRL)   rows = (query, reference) pairs, loss on the summary and EOS
    reward  reward.py vs RewardTrainer (current TRL)   rows = preference pairs, pairwise loss
    dpo     dpo.py    vs DPOTrainer    (current TRL)   rows = preference pairs, sigmoid loss, live reference model
    ppo     ppo.py    vs PPOTrainer    (TRL 1.12, the last release that has it)   rows = episodes
    rloo    rloo.py   vs RLOOTrainer   (current TRL)   rows = episodes (k = 2 per query), KL in the reward
    grpo    grpo.py   vs GRPOTrainer   (current TRL)   rows = episodes (G = 4 per query), k3 KL in the loss

Sides (--sides, any of ours before trl, ours always among them): `ours` runs this folder's scripts, `trl` TRL's
trainers, `before` the same commands as `ours` with the scripts of another copy of the project (--before_repo, e.g.
`git worktree add ../before <commit>`), run from that folder: a before / after measurement of a change to the
scripts, on the same rows and models. `--sides ours` needs no TRL at all.

Shapes (--shape): `builtin` (the default) is the built-in task's small model and its data, described below.
`pythia160m` and `pythia410m` are the paper's model shapes: a GPT-NeoX at Pythia's configuration (hidden size,
layers, heads, MLP width, vocabulary of 50304, a quarter of each head rotary, parallel residual, untied embeddings)
with random weights, on random token ids at TL;DR's widths (query 512 tokens, response 53). `tiny` is the same
recipe at a toy size, for tests. The speed of a model does not depend on its weights or on what its tokens say, so
random ones measure it as well as trained ones; generated here once per work folder (SHAPES below):
  - a word-level tokenizer whose vocabulary is exactly the model's (EOS "<|endoftext|>" = 0, "t1" ... and "[PAD]"
    last), so that every id a model samples decodes;
  - the policy (base model = SFT model, a causal LM) and a reward model (a one-label sequence classifier, what
    reward.py saves), both seeded, dropout off, safetensors, each with the tokenizer;
  - sft/ and preference/ datasets in data/prepare.py's processed schema with its tokenizer record, train and
    validation splits: every query fills its width with real tokens, every response is random ids and a final EOS
    (no EOS or [PAD] inside), so every row has the same length (565 tokens at Pythia's shapes);
  - the batch and micro batch shrink so that no micro batch holds much more than four sequences' logits
    (SHAPE_BATCHES), and the final evaluations cover a few rows. The table names the shape and these settings.

What it does, step by step:
  1. TRL (with the side trl): a virtual environment per TRL version under --venv_root (`python -m venv
     --system-site-packages`, then `pip install trl==X` with a constraint that pins the torch this machine already
     has, so pip never fetches another torch; a transformers / accelerate that a TRL release needs and the system
     lacks goes into the venv). Made once, reused while it imports the pinned TRL.
  2. The task: with --shape builtin, a prepared built-in task (--task_dir, or --pipeline_dir's data/), or a new one
     prepared here once (data/prepare.py --task synthetic at the quickstart's sizes with a short warm-up: the speed
     of a model does not depend on how well it was warmed up). The SFT and reward models: --sft_model /
     --reward_model, the pipeline's models/sft and models/rm, or short runs of sft.py and reward.py made here once
     (pipeline.py's ci sizes). With another shape: the inputs made as above.
  3. For each row count N of --rows, the task's train split cut to its first N rows (saved in the work folder), so
     that every side trains one epoch over exactly the same rows.
  4. Runs, interleaved so that a slow spell of a shared machine hits every side alike: per trainer and precision,
     repeat r = 1..R: (ours, N1), (before, N1), (TRL, N1), (ours, N2), (before, N2), (TRL, N2), each side only when
     asked for. The wall time of a run is that of its whole process (start-up, data loading, training, final
     evaluation, saving); its peak memory is the largest resident set (ru_maxrss of os.wait4) of the process and
     of any process it started and waited for, measured by a small process in between (PEAK_RSS_LAUNCHER).
  5. Rates: a side's rate in repeat r is (N2 - N1) / (wall(N2) - wall(N1)): start-up, loading and the final
     evaluation take the same time at N1 and N2 rows and cancel. The ratios of repeat r are ours / TRL and ours /
     before; the table gives the median rate of each side, the median of each ratio (and every ratio), and each
     side's median peak memory over its runs at N2.
     Per step, beside them: each optimizer step's wall time, ours from the time/update_s of every update in the
     run's metrics.jsonl (dpo.py runs with --log_every 1 for it), TRL's from a TrainerCallback (the time between the
     ends of two steps); a side's median over every step of its runs but each run's first, and ours / TRL as TRL's
     step time over ours. It needs no second run, and start-up noise does not enter it.
  6. `bench.md` (the table, also printed, with the CPU model and what it has: AVX2, AVX-512, bf16 instructions,
     and the shape) and `bench.json` (every run: command, rows, wall time, peak memory, exit code) in --out.

How the sides are matched (ours and before: the same command line, flag for flag, the same inputs; only the
scripts, and the folder they run from, differ; ours and TRL as follows):
  - the same model files (the base model for SFT; the SFT model for the reward model, DPO's policy and reference
    and PPO's policy and reference; the reward model for PPO's reward and critic), float32 weights on both sides;
  - the same token ids: TRL gets our prepared token columns with the padding cut off (pre-tokenized datasets: SFT
    `input_ids` + `labels` (-100 on the query), reward `chosen_ids` / `rejected_ids` (query + response), DPO
    `prompt_ids` / `chosen_ids` / `rejected_ids`, PPO `input_ids` (the query)), so no text is tokenized again and
    both sides read the same tokens of the same rows. No truncation on either side (TRL's max_length=None): every
    row already fits the task's widths. Padding stays each side's own: our scripts cut each batch of the data's
    fixed-width rows to its columns that hold a real token (real_columns), TRL's collators pad each batch to its
    longest row (PPO's queries on the left). At the shapes other than builtin every row fills the widths, so
    neither side pads;
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
  - RLOO and GRPO: the rollout of one optimizer step is the whole batch (TRL: per_device_train_batch_size = our
    micro batch, its generation batch = our batch; ours: --local_rollout_forward_batch_size = the batch), k
    responses per query (RLOO 2, GRPO 4), temperature 0.7 (top-k 0, top-p 1), one epoch and one minibatch per
    rollout (TRL's num_iterations 1), clip 0.2, and each side's loss set to the other's: RLOO the k1 KL summed into
    the reward (beta 0.05), the leave-one-out baseline, no advantage normalisation, a clipped ratio per sequence;
    GRPO the k3 KL in the loss (beta 0.04), the group's std, the per-response mean (TRL's loss_type "grpo"), per-token
    ratios, TRL's use_bias_correction_kl off (TRL 1.16 turns it on). Both sides generate exactly response_length
    tokens: ours samples them all (EOS does not stop it, Detail 23), TRL's generation gets min_new_tokens =
    max_completion_length (EOS suppressed until then; the compute per step is the same, the samples differ). TRL
    reads our query ids as they are (its prompt tokenizer is replaced by a lookup of our ids); its reward model
    reads the prompt and completion texts tokenized again, as TRL always does. The time of each step is split into
    generation, scoring (the policy's, the reference's and the reward model's passes over the rollout) and
    training: ours from each update's time/*_share in metrics.jsonl, TRL's by timing its _generate_single_turn and
    _generate_and_score_completions.
Not matched, because each side's own design decides them: the final evaluation and saving (they cancel in the
marginal rate), TRL's per-step logging and our metric logging, and what each side does with padding. Peak memory
does not cancel: it is that of the whole run, models, optimizer state, data and evaluation included.

This file is glue, not an algorithm (like pipeline.py): it runs the scripts, which never import it. Measured
ratios: docs/results.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)  # data.prepare's tokenizer record, for the shapes' data
TRL_FLAG = "--_trl"  # internal: `<venv python> tools/bench_trl.py --_trl spec.json` runs one TRL trainer

TRAINERS = ["sft", "reward", "dpo", "ppo", "rloo", "grpo"]
SCRIPT = {"sft": "sft.py", "reward": "reward.py", "dpo": "dpo.py", "ppo": "ppo.py", "rloo": "rloo.py",
          "grpo": "grpo.py"}
TRL_NAME = {"sft": "SFTTrainer", "reward": "RewardTrainer", "dpo": "DPOTrainer", "ppo": "PPOTrainer",
            "rloo": "RLOOTrainer", "grpo": "GRPOTrainer"}
UNIT = {"sft": "rows/s", "reward": "pairs/s", "dpo": "pairs/s", "ppo": "episodes/s", "rloo": "episodes/s",
        "grpo": "episodes/s"}
GROUP_TRAINERS = ("rloo", "grpo")  # online, k responses per query, no critic

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
    # PPO's sizes, each script's own defaults (one epoch, k, the KL coefficient), the rollout one batch at a time
    "rloo": {"batch": 32, "micro": 16, "lr": 1e-4, "scheduler": "linear", "weight_decay": 0.01, "rows": (128, 512),
             "rollout_forward_batch": 32, "num_ppo_epochs": 1, "temperature": 0.7, "kl_coef": 0.05, "k": 2},
    "grpo": {"batch": 32, "micro": 16, "lr": 1e-4, "scheduler": "linear", "weight_decay": 0.01, "rows": (128, 512),
             "rollout_forward_batch": 32, "num_ppo_epochs": 1, "temperature": 0.7, "kl_coef": 0.04, "k": 4},
}
EVAL_ROWS = 16  # rows of our final evaluations (a fixed cost: it cancels in the marginal rate)

SIDES = ["ours", "before", "trl"]  # in the order they run within a (trainer, precision, repeat, N)

# The model shapes besides the built-in task's: GPT-NeoX at Pythia's configurations (the paper's models) and a toy
# one for tests, with random weights, on random token ids of TL;DR's widths (query 512, SFT response 53 tokens).
PYTHIA = {"vocab_size": 50304, "rotary_pct": 0.25, "rotary_emb_base": 10000, "use_parallel_residual": True,
          "tie_word_embeddings": False, "max_position_embeddings": 2048, "layer_norm_eps": 1e-5}
SHAPES = {
    "pythia160m": {**PYTHIA, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "intermediate_size": 3072, "query_length": 512, "response_length": 53},
    "pythia410m": {**PYTHIA, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                   "intermediate_size": 4096, "query_length": 512, "response_length": 53},
    "tiny": {**PYTHIA, "vocab_size": 512, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 128, "query_length": 24, "response_length": 8},
}
# Their batches: a row costs seconds at Pythia's shape on a few cores, and a micro batch's float32 logits cost
# 565 x 50304 x 4 bytes (114 MB) per sequence, so a micro batch holds at most four sequences (DPO: two pairs, each
# a chosen and a rejected sequence; reward: four pairs, whose scalar head has no such logits); PPO's rollout
# forwards go four queries at a time. The final evaluations read SHAPE_EVAL_ROWS rows, a micro batch at a time.
SHAPE_BATCHES = {
    "sft": {"batch": 8, "micro": 4, "rows": (16, 48)},
    "reward": {"batch": 8, "micro": 4, "rows": (16, 48)},
    "dpo": {"batch": 8, "micro": 2, "rows": (8, 24)},
    "ppo": {"batch": 8, "micro": 4, "rows": (16, 48), "rollout_forward_batch": 4},
    "rloo": {"batch": 8, "micro": 4, "rows": (16, 48), "rollout_forward_batch": 8},
    "grpo": {"batch": 8, "micro": 4, "rows": (16, 48), "rollout_forward_batch": 8},
}
SHAPE_EVAL_ROWS = 8
SHAPE_SEED = 1
EOS_TEXT = "<|endoftext|>"  # the shapes' tokenizer: EOS = 0, "t1" ... "t<V-2>", "[PAD]" = V - 1


def settings_for(shape: str) -> dict:
    """Per trainer: SETTINGS, with the batches of SHAPE_BATCHES at a shape other than builtin, and the rows and
    batch of the final evaluation (eval_rows, eval_batch)."""
    if shape == "builtin":
        return {t: {**SETTINGS[t], "eval_rows": EVAL_ROWS, "eval_batch": EVAL_ROWS} for t in TRAINERS}
    if shape not in SHAPES:
        raise ValueError(f"--shape {shape}: expected builtin or one of {' '.join(SHAPES)}")
    return {t: {**SETTINGS[t], **SHAPE_BATCHES[t], "eval_rows": SHAPE_EVAL_ROWS,
                "eval_batch": SHAPE_BATCHES[t]["micro"]}
            for t in TRAINERS}


def neox_config(shape: str, pad_token_id: int, eos_token_id: int = 0):
    """The GPTNeoXConfig of a shape: its sizes, dropout off (our scripts turn it off too: Detail 7)."""
    from transformers import GPTNeoXConfig

    sizes = {k: v for k, v in SHAPES[shape].items() if k not in ("query_length", "response_length")}
    return GPTNeoXConfig(**sizes, hidden_dropout=0.0, attention_dropout=0.0, classifier_dropout=0.0,
                         bos_token_id=eos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id)

# The task prepared when none is given: the quickstart's split sizes (enough rows for the default --rows) with a
# short base-model warm-up and small evaluation splits.
PREP_FLAGS = ["--synthetic_warmup_steps", "20", "--synthetic_num_sft_eval", "48", "--synthetic_num_sft_test", "48",
              "--synthetic_num_pref_valid", "64", "--synthetic_num_cnndm", "8", "--no-plots"]


@dataclass
class Args:
    trainers: list[str] = field(default_factory=lambda: list(TRAINERS))
    """which comparisons to run: any of sft reward dpo ppo rloo grpo"""
    rows: Optional[list[int]] = None
    """N1 N2: rows (SFT rows, pairs, episodes) of the short and the long run, multiples of the trainer's batch; one
    N: that size only (per-step times, no two-run rate). None = sft, reward, dpo 256 2048, ppo, rloo, grpo 128 512
    (builtin); other shapes 16 48, dpo 8 24"""
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
    """the reward model of PPO (reward and critic), RLOO and GRPO; None = --pipeline_dir's, else a short reward.py
    run made here"""
    trl_version: str = "1.16.0"
    """TRL release for SFTTrainer, RewardTrainer, DPOTrainer, RLOOTrainer and GRPOTrainer (the current one)"""
    trl_ppo_version: str = "1.12.0"
    """TRL release for PPOTrainer (1.12: the last release that has it)"""
    venv_root: str = os.path.join(os.path.expanduser("~"), ".cache", "rlhf-bench")
    """folder of the TRL virtual environments (venv-trl-<major.minor>)"""
    shape: str = "builtin"
    """the model and data: builtin (the built-in task's, or --task_dir / --pipeline_dir's), or a GPT-NeoX with
    random weights on random tokens at pythia160m, pythia410m (Pythia's configurations, TL;DR's widths) or tiny"""
    sides: list[str] = field(default_factory=lambda: ["ours", "trl"])
    """what runs: ours (this folder's scripts, always), before (--before_repo's scripts), trl (TRL's trainers)"""
    before_repo: Optional[str] = None
    """another copy of this project (e.g. `git worktree add ../before <commit>`): the scripts of the side before"""
    gradient_checkpointing: bool = False
    """activation checkpointing on every side: our scripts' --gradient_checkpointing (the side before needs a copy
    that has the flag), TRL's gradient_checkpointing=True, both non-reentrant; off = neither (our default, TRL's
    set off here so that both sides keep every activation)"""


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


def rows_of(trainer: str, rows: Optional[list[int]], shape: str = "builtin") -> tuple:
    """N1 < N2 for one trainer, each a whole number of its batches (our scripts drop an incomplete last batch); or
    one N alone (per-step times and peak memory, no two-run rate)."""
    s = settings_for(shape)[trainer]
    sizes = tuple(s["rows"] if rows is None else rows)
    batch = s["batch"]
    if len(sizes) == 2 and not 0 < sizes[0] < sizes[1] or min(sizes) <= 0:
        raise ValueError(f"--rows {' '.join(map(str, sizes))}: need 0 < N1 < N2 (or one N > 0)")
    for n in sizes:
        if n % batch:
            raise ValueError(f"--rows: {n} is not a multiple of {trainer}'s batch of {batch}; use "
                             f"{n // batch * batch or batch} or {(n // batch + 1) * batch}")
    return sizes


def schedule(trainers: list[str], precisions: list[str], repeats: int, rows: dict,
             sides: tuple = ("ours", "trl")) -> list[tuple]:
    """The runs in order: per trainer and precision, repeat r: (ours, N1), (before, N1), (TRL, N1), (ours, N2),
    (before, N2), (TRL, N2), each side only when in `sides`. Each item: (trainer, precision, repeat, n, side)."""
    order = []
    for trainer in trainers:
        for precision in precisions:
            for repeat in range(repeats):
                for n in rows[trainer]:
                    for side in (s for s in SIDES if s in sides):
                        order.append((trainer, precision, repeat, n, side))
    return order


def marginal_rate(n1: int, wall1: float, n2: int, wall2: float) -> float:
    """(N2 - N1) rows / (wall time at N2 - wall time at N1): what start-up and final evaluation cost cancels.
    NaN when the longer run was not slower (noise larger than the work: use more rows)."""
    if wall2 <= wall1:
        return float("nan")
    return (n2 - n1) / (wall2 - wall1)


def summarize(runs: list[dict], trainer: str, precision: str, sides: tuple = ("ours", "trl")) -> Optional[dict]:
    """Rates, ratios and memory of one trainer and precision from its runs (dicts with side, repeat, rows, wall_s,
    ok, and peak_rss_mib when measured). Per repeat in which every side has both of its runs: each side's marginal
    rate (rates_<side>), ours / TRL (ratios) and ours / before (ratios_before); then their medians (rate_<side>,
    ratio, ratio_before) and each side's median peak memory of its runs at N2 (rss_<side>, MiB; None when not
    measured). None when no repeat is complete."""
    mine = [r for r in runs if r["trainer"] == trainer and r["precision"] == precision and r["ok"]]
    walls = {(r["side"], r["repeat"], r["rows"]): r["wall_s"] for r in mine}
    sizes = sorted({r["rows"] for r in mine})  # one size: no rate (NaN), the per-step times and memory only
    if not sizes:
        return None
    n1, n2 = sizes[0], sizes[-1]
    sides = [s for s in SIDES if s in sides]
    rates: dict = {side: [] for side in sides}
    for repeat in sorted({r["repeat"] for r in mine}):
        if all((side, repeat, n) in walls for side in sides for n in (n1, n2)):
            for side in sides:
                rates[side].append(marginal_rate(n1, walls[side, repeat, n1], n2, walls[side, repeat, n2]))
    if not rates[sides[0]]:
        return None
    # a repeat whose longer run was not slower on some side (NaN rate) stays in the lists but not in the medians
    valid = [i for i in range(len(rates[sides[0]])) if all(math.isfinite(rates[side][i]) for side in sides)]

    def median(values):
        return statistics.median(values[i] for i in valid) if valid else float("nan")

    summary = {"trainer": trainer, "precision": precision, "rows": [n1, n2], "sides": sides}
    for side in sides:
        rss = [r["peak_rss_mib"] for r in mine if r["side"] == side and r["rows"] == n2 and r.get("peak_rss_mib")]
        summary.update({f"rates_{side}": rates[side], f"rate_{side}": median(rates[side]),
                        f"rss_{side}": statistics.median(rss) if rss else None})
    for other, each, key in (("trl", "ratios", "ratio"), ("before", "ratios_before", "ratio_before")):
        if other in sides and "ours" in sides:
            ratios = [ours / theirs for ours, theirs in zip(rates["ours"], rates[other])]
            summary.update({each: ratios, key: median(ratios)})
    # per step: each side's median step time over its runs (both sizes, every repeat; each run's first step left
    # out), and ours / X by it: X's step time over ours (> 1: ours is faster)
    for side in sides:
        summary[f"step_{side}"] = median_step([r for r in mine if r["side"] == side])
    for other in ("trl", "before"):
        if other in sides and summary["step_ours"] and summary[f"step_{other}"]:
            summary[f"step_ratio_{other}"] = summary[f"step_{other}"] / summary["step_ours"]
    for side in sides:  # online trainers: each phase's median over the side's runs of its seconds per step
        phases = [r["phases"] for r in mine if r["side"] == side and r.get("phases")]
        if phases:
            summary[f"phases_{side}"] = {p: statistics.median(run[p] for run in phases) for p in PHASES}
    return summary


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


CONVERT = {"sft": sft_example, "reward": reward_example, "dpo": dpo_example, "ppo": ppo_example,
           "rloo": ppo_example, "grpo": ppo_example}  # RLOO's and GRPO's prompts: ids here, text in trl_child


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
    task = os.path.abspath(task) if task else None  # (the side before runs from another folder)
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
             "base_model": os.path.join(task, "base_model"), "query_length": lengths["query_length"],
             "response_length": lengths["sft_response_length"], "rm_response_length": lengths["rm_response_length"]}
    from_pipeline = {"sft_model": "sft", "reward_model": "rm"}
    for key, stage in from_pipeline.items():
        given = getattr(args, key) or (os.path.join(args.pipeline_dir, "models", stage) if args.pipeline_dir else None)
        if given and not model_ready(given):
            raise FileNotFoundError(f"{given} is not a complete model folder (no config.json, or a run.json without "
                                    f'"complete": true); train it to its end, or leave --{key} out to make one here')
        paths[key] = os.path.abspath(given) if given else os.path.join(work, "models", stage)
    # pipeline.py's ci sizes: a few updates give models of the right shapes (speed does not depend on the weights)
    ci = ["--seed", "1", "--run_dir_root", os.path.join(work, "runs"), "--overwrite_output_dir",
          "--checkpoint_every", "0"]
    online = {"ppo", *GROUP_TRAINERS}  # the trainers that score with the reward model
    needs_sft, needs_rm = bool(set(args.trainers) & {"reward", "dpo", *online}), bool(set(args.trainers) & online)
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


def shape_tokenizer(vocab_size: int):
    """A word-level tokenizer of exactly vocab_size ids, so that any id a model samples decodes: EOS_TEXT = 0,
    "t1" ... "t<vocab_size - 2>", "[PAD]" = vocab_size - 1 (a [PAD] distinct from EOS: Detail 3)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {EOS_TEXT: 0, **{f"t{i}": i for i in range(1, vocab_size - 1)}, "[PAD]": vocab_size - 1}
    words = Tokenizer(models.WordLevel(vocab, unk_token=EOS_TEXT))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, eos_token=EOS_TEXT, bos_token=EOS_TEXT, unk_token=EOS_TEXT,
                                   pad_token="[PAD]", model_max_length=PYTHIA["max_position_embeddings"])


def random_rows(kind: str, split: str, n: int, query_length: int, response_length: int, vocab_size: int,
                seed: int = SHAPE_SEED) -> dict:
    """n rows of random token ids in data/prepare.py's processed schema, as columns: kind "sft" (a reference
    response) or "preference" (a chosen and a rejected one). Every query is query_length real tokens, every response
    response_length - 1 random tokens and EOS, with ids from 1 to vocab_size - 2 (never EOS or [PAD] inside a
    text); the text columns spell the ids. Row i depends on (seed, kind, split, i) alone, so more rows keep the
    first ones (and the row subsets cut from them)."""
    pad, eos = vocab_size - 1, 0
    text_ids = range(1, vocab_size - 1)  # neither EOS nor [PAD]

    def spell(ids):
        return " ".join(f"t{t}" for t in ids if t != eos)

    columns: dict = {}
    for i in range(n):
        rng = random.Random(f"{seed} {kind} {split} {i}")
        query = rng.choices(text_ids, k=query_length)
        row = {"id": f"{split}{i:06d}", "query": spell(query), "query_token": query, "query_token_len": query_length,
               "query_truncated": False, "response_too_long": False}
        for name in ["reference_response"] if kind == "sft" else ["chosen", "rejected"]:
            response = rng.choices(text_ids, k=response_length - 1) + [eos]
            row.update({name: " " + spell(response), f"{name}_token": response, f"{name}_token_len": response_length,
                        f"query_{name}_token": query + response,
                        f"query_{name}_token_len": query_length + response_length,
                        f"query_{name}_token_response_label": [pad] * query_length + response})
        if kind == "sft":
            row["query_reference_response"] = row["query"] + row["reference_response"]
        else:
            row.update({"chosen_policy": "random", "rejected_policy": "random", "choice": 0, "confidence": -1,
                        "batch": "random", "split": split, "is_cnndm": False})
        for key, value in row.items():
            columns.setdefault(key, []).append(value)
    return columns


def save_random_model(path: str, shape: str, tokenizer, seed: int, reward_model: bool) -> None:
    """A GPT-NeoX of the shape with random (seeded) weights, and the tokenizer, saved as safetensors: a causal LM
    (the base / SFT model), or a one-label sequence classifier (what reward.py saves as a reward model). Written
    under a temporary name, then renamed: the folder, when it exists, is complete."""
    import torch
    from transformers import GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

    torch.manual_seed(seed)
    config = neox_config(shape, tokenizer.pad_token_id, tokenizer.eos_token_id)
    if reward_model:
        config.num_labels = 1
        config.reward_normalization_bias = 0.0  # reward.py records the shift it folded into the weights (none here)
        model = GPTNeoXForSequenceClassification(config)
    else:
        model = GPTNeoXForCausalLM(config)
    temporary = path + ".tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    model.save_pretrained(temporary, safe_serialization=True)
    tokenizer.save_pretrained(temporary)
    os.replace(temporary, path)


def make_shape_inputs(shape: str, work: str, train_rows: dict) -> dict:
    """The inputs of a shape other than builtin, in <work>/shape_<shape>: the policy (base and SFT model), the reward
    model and the sft/ and preference/ datasets (train: train_rows[kind] rows, validation: SHAPE_EVAL_ROWS), each
    made once and reused; all made again when the shape's configuration changed, a dataset again when it has
    fewer train rows than asked for. Returns the paths prepare_inputs returns."""
    from datasets import Dataset, DatasetDict, load_from_disk

    from data.prepare import tokenizer_fingerprint

    config = SHAPES[shape]
    root = os.path.join(work, f"shape_{shape}")
    record = {"shape": shape, "config": config, "seed": SHAPE_SEED}
    marker = os.path.join(root, "shape.json")
    try:
        with open(marker) as f:
            same = json.load(f) == record
    except (OSError, ValueError):
        same = False
    if not same:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        with open(marker, "w") as f:
            json.dump(record, f, indent=1)
    tokenizer = shape_tokenizer(config["vocab_size"])
    paths = {"task": root, "sft_data": os.path.join(root, "sft"), "preference": os.path.join(root, "preference"),
             "base_model": os.path.join(root, "policy"), "sft_model": os.path.join(root, "policy"),
             "reward_model": os.path.join(root, "reward_model"), "query_length": config["query_length"],
             "response_length": config["response_length"], "rm_response_length": config["response_length"]}
    for key, seed in (("base_model", SHAPE_SEED), ("reward_model", SHAPE_SEED + 1)):
        if not os.path.exists(paths[key]):
            print(f"[bench] {shape}: a {key.replace('_', ' ')} with random weights in {paths[key]}", flush=True)
            save_random_model(paths[key], shape, tokenizer, seed, reward_model=key == "reward_model")
    # the record of data/prepare.py that every script checks: the ids are those of the policy's tokenizer
    fingerprint = {"name_or_path": paths["base_model"], **tokenizer_fingerprint(tokenizer)}
    description = json.dumps({"prepared_by": "tools/bench_trl.py", "task": f"random tokens, shape {shape}",
                              "tokenizer": fingerprint})
    for kind, key in (("sft", "sft_data"), ("preference", "preference")):
        n = max(train_rows[kind], SHAPE_EVAL_ROWS)
        if os.path.exists(paths[key]) and len(load_from_disk(paths[key])["train"]) >= n:
            continue
        print(f"[bench] {shape}: {n} random {kind} rows in {paths[key]}", flush=True)
        splits = DatasetDict({split: Dataset.from_dict(random_rows(kind, split, count, config["query_length"],
                                                                   config["response_length"], config["vocab_size"]))
                              for split, count in (("train", n), ("validation", SHAPE_EVAL_ROWS))})
        for dataset in splits.values():
            dataset.info.description = description
        temporary = paths[key] + ".tmp"
        shutil.rmtree(temporary, ignore_errors=True)
        splits.save_to_disk(temporary)
        shutil.rmtree(paths[key], ignore_errors=True)
        os.replace(temporary, paths[key])
    return paths


def parameters_in(folder: str) -> int:
    """The number of weights in a model folder's safetensors files (read from their headers)."""
    import glob

    from safetensors import safe_open

    total = 0
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


def describe_shape(shape: str, paths: dict, settings: dict, trainers: list[str]) -> str:
    """The table's line on the model, the token widths and the batches."""
    with open(os.path.join(paths["base_model"], "config.json")) as f:
        config = json.load(f)
    kind = "the built-in task's GPT-NeoX" if shape == "builtin" else "GPT-NeoX with random weights"
    batches = ", ".join(f"{t} {settings[t]['batch']}/{settings[t]['micro']}" for t in trainers)
    if "ppo" in trainers:
        batches += f" (PPO's rollout forwards: {settings['ppo']['rollout_forward_batch']})"
    for t in (t for t in GROUP_TRAINERS if t in trainers):
        batches += f" ({t} k = {settings[t]['k']})"
    return (f"Shape: {shape}, {kind}: {parameters_in(paths['base_model']) / 1e6:.1f}M parameters (hidden "
            f"{config['hidden_size']}, {config['num_hidden_layers']} layers, {config['num_attention_heads']} heads, "
            f"vocabulary {config['vocab_size']}); query {paths['query_length']} + response "
            f"{paths['response_length']} tokens (preference responses {paths['rm_response_length']}); batch / micro "
            f"batch: {batches}; final evaluations of {settings[trainers[0]]['eval_rows']} rows")


# --------------------------------------------------------------------------------------------
# One run of each side
# --------------------------------------------------------------------------------------------
def our_command(trainer: str, precision: str, n: int, paths: dict, work: str, run_name: str, s: dict,
                repo: str = REPO_ROOT, side: str = "ours") -> list[str]:
    """The command line of one run of our script of `trainer` (the side before: the same, from `repo`), with the
    trainer's settings `s` (settings_for)."""
    common = ["--seed", "1", "--run_name", run_name, "--run_dir_root", os.path.join(work, "runs"),
              "--output_dir", os.path.join(work, "out", f"{side}_{trainer}"), "--overwrite_output_dir",
              "--checkpoint_every", "0", "--bf16", str(precision == "bf16"), "--lr", str(s["lr"]),
              "--total_batch_size", str(s["batch"]), "--local_micro_batch_size", str(s["micro"])]
    common += ["--gradient_checkpointing"] if s.get("gradient_checkpointing") else []
    py = [sys.executable, os.path.join(repo, SCRIPT[trainer])]
    eval_rows = ["--num_eval_samples", str(s["eval_rows"])]
    eval_batch = ["--local_eval_batch_size", str(s["eval_batch"])]
    if trainer == "sft":
        return py + common + ["--base_model", paths["base_model"], "--query_dataset", paths["rows"],
                              "--response_length", str(paths["response_length"]), "--num_train_epochs", "1",
                              "--scheduler", s["scheduler"], *eval_batch, *eval_rows]
    if trainer == "reward":
        return py + common + ["--sft_model_path", paths["sft_model"], "--preference_dataset", paths["rows"],
                              "--query_dataset", paths["sft_data"], "--num_train_epochs", "1",
                              "--scheduler", s["scheduler"], "--weight_decay", str(s["weight_decay"]),
                              "--num_normalization_samples", str(s["eval_rows"]), *eval_batch, *eval_rows]
    if trainer == "dpo":
        return py + common + ["--sft_model_path", paths["sft_model"], "--preference_dataset", paths["rows"],
                              "--query_dataset", paths["sft_data"], "--response_length", str(paths["response_length"]),
                              "--num_train_epochs", "1", "--beta", str(s["beta"]), "--loss_type", "sigmoid",
                              "--scheduler", s["scheduler"], "--weight_decay", str(s["weight_decay"]),
                              "--eval_every", "0", "--log_every", "1", *eval_batch, *eval_rows]
    group = {"rloo": ["--rloo_k", str(s.get("k"))], "grpo": ["--group_size", str(s.get("k"))]}.get(trainer, [])
    return py + common + group + [
        "--sft_model_path", paths["sft_model"], "--reward_model_path", paths["reward_model"],
        "--query_dataset", paths["rows"], "--response_length", str(paths["response_length"]),
        "--total_episodes", str(n), "--local_rollout_forward_batch_size", str(s["rollout_forward_batch"]),
        "--temperature", str(s["temperature"]), f"--{trainer}.num_ppo_epochs", str(s["num_ppo_epochs"]),
        f"--{trainer}.num_mini_batches", "1", f"--{trainer}.kl_coef", str(s["kl_coef"]), "--scheduler", s["scheduler"],
        "--weight_decay", str(s["weight_decay"]), "--eval_every", "0", "--print_sample_every", "0", *eval_rows]


# Runs the command argv[2:] and writes its peak resident memory (ru_maxrss of os.wait4, KiB on Linux) into the file
# argv[1]; exits with the command's exit code (128 + N when signal N ended it). Every run goes through this small
# process because Linux counts in a process's ru_maxrss the memory of the one it was forked from (what was mapped
# when it called exec): a run forked straight from this tool, which holds torch and datasets, would report at
# least this tool's size.
PEAK_RSS_LAUNCHER = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""


def timed(cmd: list[str], env: dict, log_path: str, cwd: str = REPO_ROOT) -> tuple[float, int, float]:
    """Wall time, exit code and peak memory of one run (MiB: the largest resident set of its process, or of a
    process that one started and waited for); its output goes to log_path."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    rss_path = log_path + ".rss"
    with open(log_path, "w") as log:
        start = time.perf_counter()
        code = subprocess.run([sys.executable, "-c", PEAK_RSS_LAUNCHER, rss_path, *cmd], cwd=cwd, env=env,
                              stdout=log, stderr=subprocess.STDOUT).returncode
        wall = time.perf_counter() - start
    with open(rss_path) as f:
        return wall, code, int(f.read()) / 1024


def step_times(side: str, log_path: str, metrics_path: str) -> Optional[list[float]]:
    """Each optimizer step's wall time of one run, in order (seconds): ours and before from the run's metrics.jsonl
    (time/update_s, one row per update), TRL's from the file its StepTimes callback wrote next to the log. None when
    the run wrote none (a failed run, or a copy of the project from before time/update_s)."""
    try:
        if side == "trl":
            with open(log_path + ".steps.json") as f:
                return [float(t) for t in json.load(f)]
        with open(metrics_path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        times = [row["time/update_s"] for row in sorted(rows, key=lambda row: row["step"]) if "time/update_s" in row]
        return times or None
    except (OSError, ValueError, TypeError):
        return None


PHASES = ("generation", "scoring", "training")  # an online step's parts (RLOO and GRPO: both sides report them)


def phase_times(side: str, log_path: str, metrics_path: str) -> Optional[dict]:
    """An online run's seconds per step in each of PHASES, the mean over its steps but the first: ours and before
    from metrics.jsonl (each update's time/<phase>_share of its time/update_s), TRL's from the file trl_child wrote
    next to the log (its generation and scoring timed per step, training the rest of the step). None when the run
    wrote none."""
    try:
        if side == "trl":
            with open(log_path + ".phases.json") as f:
                steps = json.load(f)
        else:
            with open(metrics_path) as f:
                rows = sorted((json.loads(line) for line in f if line.strip()), key=lambda row: row["step"])
            steps = [{phase: row[f"time/{phase}_share"] * row["time/update_s"] for phase in PHASES}
                     for row in rows if all(f"time/{phase}_share" in row for phase in PHASES)]
        steps = steps[1:]
        return {phase: statistics.mean(step[phase] for step in steps) for phase in PHASES} if steps else None
    except (OSError, ValueError, TypeError, KeyError):
        return None


def median_step(runs: list[dict]) -> Optional[float]:
    """The median step time over every step of `runs` but each run's first (which also warms up kernels, caches and
    the allocator); None when they hold no such step."""
    steps = [t for r in runs for t in (r.get("step_s") or [])[1:]]
    return statistics.median(steps) if steps else None


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

    trainer_name, s = spec["trainer"], spec["settings"]
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
        max_grad_norm=0.0, gradient_checkpointing=bool(s.get("gradient_checkpointing")),
        gradient_checkpointing_kwargs={"use_reentrant": False}, bf16=bf16, use_cpu=not torch.cuda.is_available(),
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
    elif trainer_name in GROUP_TRAINERS:
        trainer = group_trainer(spec, common, causal_lm(spec["model"]), scorer(spec["reward_model"]), tokenizer, train)
    else:
        try:
            from trl.experimental.ppo import PPOConfig, PPOTrainer
        except ImportError:
            from trl import PPOConfig, PPOTrainer

        tokenizer.padding_side = "left"  # PPO's queries are left-padded (Detail 5), by its collator here
        evaluation = convert_split(load_from_disk(spec["rows"])["validation"].select(range(s["eval_rows"])), "ppo",
                                   "validation")
        config = PPOConfig(**{k: v for k, v in common.items() if k != "num_train_epochs"},
                           total_episodes=spec["rows_n"], response_length=spec["response_length"],
                           temperature=s["temperature"], num_ppo_epochs=s["num_ppo_epochs"], num_mini_batches=1,
                           local_rollout_forward_batch_size=s["rollout_forward_batch"], kl_coef=s["kl_coef"],
                           num_sample_generations=0, stop_token=None, missing_eos_penalty=1.0,
                           per_device_eval_batch_size=s["eval_batch"])
        trainer = PPOTrainer(args=config, processing_class=tokenizer, model=causal_lm(spec["model"]),
                             ref_model=causal_lm(spec["model"]), reward_model=scorer(spec["reward_model"]),
                             value_model=scorer(spec["reward_model"]), train_dataset=train, eval_dataset=evaluation)
    from transformers import TrainerCallback

    steps = type("StepTimesCallback", (StepTimes, TrainerCallback), {})()  # each optimizer step's wall time
    trainer.add_callback(steps)
    trainer.train()
    with open(spec["step_times"], "w") as f:  # each step's wall time, read by step_times
        json.dump(steps.seconds(), f)
    if trainer_name in GROUP_TRAINERS:  # each step's generation, scoring and training seconds, read by phase_times
        with open(spec["step_times"].replace(".steps.json", ".phases.json"), "w") as f:
            json.dump([{"generation": g, "scoring": r - g, "training": step - r}
                       for step, (g, r) in zip(steps.seconds(), trainer.rollout_seconds)], f)
    # what the trainer ran with, for the run's log: its class, rows, autocast precision and threads
    print(json.dumps({"trl_trainer": type(trainer).__name__, "rows": len(train), "bf16": bf16,
                      "mixed_precision": str(trainer.accelerator.mixed_precision), "threads": torch.get_num_threads()}))


def group_trainer(spec: dict, common: dict, model, reward_model, tokenizer, train):
    """TRL's RLOOTrainer or GRPOTrainer set to our script's computation (the module docstring: how the sides are
    matched), reading our query ids, with each rollout's generation and generation + scoring timed
    (rollout_seconds: one (generation, rollout) pair per optimizer step, one rollout per step here)."""
    import trl

    name, s = spec["trainer"], spec["settings"]
    ids_of = {}  # prompt text -> our query ids: TRL tokenizes the "prompt" column; it gets our ids back instead
    prompts = []
    for row in train.select(range(spec["rows_n"] // s["k"])):  # N episodes: N / k queries, k responses each
        text = tokenizer.decode(row["input_ids"])
        ids_of[text] = row["input_ids"]
        prompts.append({"prompt": text})
    from datasets import Dataset

    train = Dataset.from_list(prompts)
    length = spec["response_length"]
    config = dict({k: v for k, v in common.items() if k not in ("per_device_train_batch_size",
                                                               "gradient_accumulation_steps")},
                  per_device_train_batch_size=s["micro"], gradient_accumulation_steps=s["batch"] // s["micro"],
                  num_generations=s["k"], max_completion_length=length, temperature=s["temperature"], top_k=0,
                  top_p=1.0, generation_kwargs={"min_new_tokens": length}, beta=s["kl_coef"], num_iterations=1,
                  epsilon=0.2, mask_truncated_completions=False, disable_dropout=True, log_completions=False)
    if name == "grpo":
        config.update(loss_type="grpo", scale_rewards="group", importance_sampling_level="token",
                      use_bias_correction_kl=False)
        config_class, trainer_class = trl.GRPOConfig, trl.GRPOTrainer
    else:
        config.update(normalize_advantages=False)
        config_class, trainer_class = trl.RLOOConfig, trl.RLOOTrainer

    class OurIdsTimed(trainer_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.rollout_seconds, self._generation_s = [], 0.0

        def _tokenize_prompts(self, prompts):  # our ids, not a second tokenization
            return [ids_of[p] for p in prompts], None, {}

        def _generate_single_turn(self, *args, **kwargs):
            start = StepTimes.now()
            out = super()._generate_single_turn(*args, **kwargs)
            self._generation_s = StepTimes.now() - start
            return out

        def _generate_and_score_completions(self, *args, **kwargs):
            start = StepTimes.now()
            out = super()._generate_and_score_completions(*args, **kwargs)
            self.rollout_seconds.append((self._generation_s, StepTimes.now() - start))
            return out

    return OurIdsTimed(model=model, reward_funcs=[reward_model], args=config_class(**config), train_dataset=train,
                       processing_class=tokenizer, reward_processing_classes=[tokenizer])


class StepTimes:
    """When training began and when each optimizer step ended (a GPU's queued work done first), so that a step's wall
    time is the time between the ends of two steps (the first: from the start of training). These are two events of
    a transformers TrainerCallback, which trl_child mixes in: TRL's trainers, PPOTrainer's own loop too, call
    on_train_begin and on_step_end."""

    def __init__(self):
        self.ends: list[float] = []

    @staticmethod
    def now() -> float:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        self.ends = [self.now()]

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(self.now())

    def seconds(self) -> list[float]:
        return [b - a for a, b in zip(self.ends, self.ends[1:])]


def trl_spec(trainer: str, precision: str, n: int, paths: dict, work: str, threads: int, settings: dict) -> dict:
    model = paths["base_model"] if trainer == "sft" else paths["sft_model"]
    return {"trainer": trainer, "precision": precision, "rows": paths["rows"], "rows_n": n, "model": model,
            "tokenizer": model, "reward_model": paths["reward_model"], "response_length": paths["response_length"],
            "output_dir": os.path.join(work, "out", f"trl_{trainer}"), "threads": threads, "settings": settings}


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------
def table(summaries: list[dict], header: list[str], versions: dict, sides: tuple = ("ours", "trl")) -> str:
    """bench.md: the header lines (CPU, shape), then per trainer and precision each side's rate, ours / before and
    ours / TRL (the median and every repeat's) and each side's peak memory."""
    sides = [side for side in SIDES if side in sides]
    names = {"ours": "ours", "before": "before", "trl": "TRL"}
    columns = ["trainer", "precision", "rows N1 -> N2", "ours"]
    for side in sides[1:]:
        columns += [names[side], f"ours/{names[side]} (median)", f"ours/{names[side]} of the repeats"]
    columns.append(f"peak RSS MiB ({' / '.join(names[side] for side in sides)})")
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]

    def num(x: float) -> str:  # n/a: the longer run was not slower (noise larger than the work)
        return f"{x:.2f}" if math.isfinite(x) else "n/a"

    for s in summaries:
        trainer = s["trainer"]
        name = SCRIPT[trainer] + (f" vs TRL {versions[trainer]} {TRL_NAME[trainer]}" if "trl" in sides else "")
        cells = [name, s["precision"], f"{s['rows'][0]} -> {s['rows'][1]}", f"{num(s['rate_ours'])} {UNIT[trainer]}"]
        for side, each, key in (("before", "ratios_before", "ratio_before"), ("trl", "ratios", "ratio")):
            if side in sides:
                cells += [num(s[f"rate_{side}"]), f"**{num(s[key])}**", ", ".join(num(r) for r in s[each])]
        cells.append(" / ".join("n/a" if s[f"rss_{side}"] is None else f"{s[f'rss_{side}']:.0f}" for side in sides))
        lines.append("| " + " | ".join(cells) + " |")
    note = ("A rate is (N2 - N1) rows / (wall time at N2 - wall time at N1) of whole processes; runs interleaved "
            f"({', '.join(names[side] for side in sides)}) per size and repeat; n/a: the run at N2 was not slower than "
            "at N1 (use more rows). Peak RSS: the median over the runs at N2 of each run's largest resident set.")
    return "\n".join([*header, "", *lines, "", note, *step_table(summaries, sides, names),
                      *phase_table(summaries, sides, names)])


def step_table(summaries: list[dict], sides: list[str], names: dict) -> list[str]:
    """The per-step measure beside the rates: each side's median step time and ours / X by it (none when no run
    logged its steps)."""
    if not any(s.get(f"step_{side}") for s in summaries for side in sides):
        return []
    others = [side for side in sides if side != "ours"]
    columns = ["trainer", "precision", *(f"{names[side]} s/step" for side in sides),
               *(f"ours/{names[side]} per step" for side in others)]
    lines = ["", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for s in summaries:
        steps = [f"{s[f'step_{side}']:.3f}" if s.get(f"step_{side}") else "n/a" for side in sides]
        ratios = [f"**{s[f'step_ratio_{side}']:.2f}**" if s.get(f"step_ratio_{side}") else "n/a" for side in others]
        lines.append("| " + " | ".join([SCRIPT[s["trainer"]], s["precision"], *steps, *ratios]) + " |")
    lines += ["", "s/step: the median wall time of one optimizer step over every run of the side (both sizes, "
                  "every repeat), each run's first step left out; ours: each update's time/update_s in its "
                  "metrics.jsonl, TRL: the time between the ends of two steps (a TrainerCallback); ours/X per "
                  "step: X's step time over ours."]
    return lines


def phase_table(summaries: list[dict], sides: list[str], names: dict) -> list[str]:
    """The online trainers' steps by phase: each side's seconds per step in generation, scoring and training (none
    when no run reported them)."""
    rows = [s for s in summaries if any(s.get(f"phases_{side}") for side in sides)]
    if not rows:
        return []
    columns = ["trainer", "precision", *(f"{names[side]} {phase} s" for side in sides for phase in PHASES)]
    lines = ["", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for s in rows:
        cells = [f"{s[f'phases_{side}'][phase]:.3f}" if s.get(f"phases_{side}") else "n/a"
                 for side in sides for phase in PHASES]
        lines.append("| " + " | ".join([SCRIPT[s["trainer"]], s["precision"], *cells]) + " |")
    return lines + ["", "Seconds per step by phase, the median over the side's runs of each run's mean over its "
                        "steps but the first: generation (sampling), scoring (the policy's, the reference's and the "
                        "reward model's passes over the rollout; TRL: the rest of its _generate_and_score_completions) "
                        "and training (the rest of the step)."]


def check_sides(args: Args) -> list[str]:
    """--sides in the order they run; ours always among them, --before_repo with the scripts for the side before."""
    unknown = [side for side in args.sides if side not in SIDES]
    if unknown or "ours" not in args.sides:
        raise ValueError(f"--sides {' '.join(args.sides)}: expected ours and any of before trl")
    if "before" in args.sides:
        missing = [SCRIPT[t] for t in args.trainers if not (args.before_repo and
                                                            os.path.exists(os.path.join(args.before_repo, SCRIPT[t])))]
        if missing:
            raise ValueError(f"--sides before runs the scripts of --before_repo ({args.before_repo}), which lacks "
                             f"{' '.join(missing)}; point it at another copy of this project (git worktree add DIR "
                             "<commit>)")
    return [side for side in SIDES if side in args.sides]


def main(args: Args) -> dict:
    unknown = [t for t in args.trainers if t not in TRAINERS]
    if unknown:
        raise ValueError(f"--trainers {' '.join(unknown)}: expected some of {' '.join(TRAINERS)}")
    if args.rows is not None and len(args.rows) not in (1, 2):
        raise ValueError(f"--rows takes two numbers, N1 N2, or one N (got {args.rows})")
    sides = check_sides(args)
    settings = settings_for(args.shape)
    for trainer_settings in settings.values():  # both sides read it from the settings (bench.json records it)
        trainer_settings["gradient_checkpointing"] = args.gradient_checkpointing
    if args.shape != "builtin" and (args.pipeline_dir or args.task_dir or args.sft_model or args.reward_model):
        raise ValueError(f"--shape {args.shape} makes its own data and models; leave out --pipeline_dir, --task_dir, "
                         "--sft_model and --reward_model (or use --shape builtin)")
    before_repo = os.path.abspath(args.before_repo) if "before" in sides else None
    with open("/proc/cpuinfo") as f:
        cpu = cpu_features(f.read())
    threads = args.threads or os.cpu_count() or 1
    precisions = resolve_precisions(args.precisions, cpu)
    rows = {t: rows_of(t, args.rows, args.shape) for t in args.trainers}
    out = os.path.abspath(args.out)
    work = os.path.abspath(args.work_dir or os.path.join(out, "work"))
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               WANDB_MODE="disabled", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    cpu_line = describe_cpu(cpu, threads)
    print(f"[bench] {cpu_line}; precisions {' '.join(precisions)}; sides {' '.join(sides)}", flush=True)

    versions = {t: args.trl_ppo_version if t == "ppo" else args.trl_version for t in args.trainers}
    pythons = {v: ensure_trl(args, v) for v in sorted(set(versions.values()))} if "trl" in sides else {}
    # the dataset a trainer reads
    kind_of = {"sft": "sft", "ppo": "sft", "rloo": "sft", "grpo": "sft", "reward": "preference", "dpo": "preference"}
    if args.shape == "builtin":
        paths = prepare_inputs(args, work, env)
    else:
        longest = {kind: max([rows[t][-1] for t in args.trainers if kind_of[t] == kind], default=0)
                   for kind in ("sft", "preference")}
        paths = make_shape_inputs(args.shape, work, longest)
    shape_line = describe_shape(args.shape, paths, settings, args.trainers)
    print(f"[bench] {shape_line}", flush=True)
    row_data = {}
    subsets_in = work if args.shape == "builtin" else paths["task"]  # (a shape's subsets go when its data goes)
    for trainer in args.trainers:
        source = paths["sft_data"] if kind_of[trainer] == "sft" else paths["preference"]
        for n in rows[trainer]:
            row_data[trainer, n] = subset(source, n, subsets_in, kind_of[trainer])

    runs: list[dict] = []
    order = schedule(args.trainers, precisions, args.repeats, rows, sides)
    for i, (trainer, precision, repeat, n, side) in enumerate(order):
        run_paths = {**paths, "rows": row_data[trainer, n]}
        name = f"{trainer}_{precision}_{side}_n{n}_r{repeat}"
        run_env, cwd = dict(env), REPO_ROOT
        log_path = os.path.join(work, "logs", f"{name}.log")
        if side == "trl":
            spec_path = os.path.join(work, "specs", f"{name}.json")
            os.makedirs(os.path.dirname(spec_path), exist_ok=True)
            spec = trl_spec(trainer, precision, n, run_paths, work, threads, settings[trainer])
            with open(spec_path, "w") as f:
                json.dump({**spec, "step_times": log_path + ".steps.json"}, f, indent=1)
            cmd = [pythons[versions[trainer]], os.path.abspath(__file__), TRL_FLAG, spec_path]
            if precision == "bf16":
                run_env["ACCELERATE_MIXED_PRECISION"] = "bf16"  # read by TRL 1.12 PPOTrainer's own Accelerator
        else:  # ours, or the same command with the scripts of --before_repo, run from there
            cwd = before_repo if side == "before" else REPO_ROOT
            cmd = our_command(trainer, precision, n, run_paths, work, name, settings[trainer], cwd, side)
        wall, code, rss = timed(cmd, run_env, log_path, cwd)
        record = {"trainer": trainer, "precision": precision, "repeat": repeat, "rows": n, "side": side,
                  "wall_s": round(wall, 3), "peak_rss_mib": round(rss, 1), "returncode": code, "ok": code == 0,
                  "step_s": step_times(side, log_path, os.path.join(work, "runs", name, "metrics.jsonl")),
                  "phases": (phase_times(side, log_path, os.path.join(work, "runs", name, "metrics.jsonl"))
                             if trainer in GROUP_TRAINERS else None),
                  "command": cmd, "cwd": cwd, "log": log_path}
        runs.append(record)
        status = (f"{wall:.1f} s, peak {rss:.0f} MiB" if code == 0
                  else f"FAILED (exit {code}), log {log_path}:\n{tail(log_path)}")
        print(f"[bench] {i + 1}/{len(order)} {trainer} {precision} {side:6s} N={n} repeat {repeat + 1}: {status}",
              flush=True)

    summaries = [s for t in args.trainers for p in precisions if (s := summarize(runs, t, p, sides)) is not None]
    text = table(summaries, [cpu_line, shape_line], versions, sides)
    failed = [r for r in runs if not r["ok"]]
    if failed:
        text += (f"\n\n{len(failed)} of {len(runs)} runs failed: "
                 + ", ".join(os.path.basename(r["log"]) for r in failed))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(text + "\n")
    result = {"cpu": cpu, "threads": threads, "precisions": precisions, "sides": sides, "before_repo": before_repo,
              "trl_versions": versions if "trl" in sides else {},
              "shape": {"name": args.shape, "line": shape_line, "config": SHAPES.get(args.shape),
                        "parameters": parameters_in(paths["base_model"])},
              "settings": {t: settings[t] for t in args.trainers}, "args": dataclasses.asdict(args),
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

        main(tyro.cli(Args, use_underscores=True))
