"""Peak memory of every training script, measured on a mid-sized GPT-NeoX, in every memory mode it has.

    python tools/measure_memory.py                                  # everything, defaults below (~15 min on 2 CPUs)
    python tools/measure_memory.py --scripts ppo.py --modes lora hydra
    python tools/measure_memory.py --scripts sft.py dpo.py ppo.py --modes plain lora qlora   # LoRA vs QLoRA
    python tools/measure_memory.py --hidden_size 1024 --num_layers 16 --output_dir artifacts/memory_1024
    python tools/measure_memory.py --task_dir artifacts/quickstart/data   # an already prepared task
    python tools/measure_memory.py --scripts sft.py ppo.py --modes plain checkpointing   # --gradient_checkpointing
    python tools/measure_memory.py --recipe [--gpu_gib 40]   # the README's per-size flags; measures nothing

What it does, step by step:
  1. the built-in task: `--task_dir` (a folder written by `python data/prepare.py --task synthetic`), or a
     small one prepared here once (kept in the work folder and reused on the next call);
  2. a GPT-NeoX of the requested size (default hidden 512, 8 layers, 8 heads, intermediate 2048: about 26M
     parameters) with the task's tokenizer, saved twice: as the SFT model (AutoModelForCausalLM) and as a
     reward model (AutoModelForSequenceClassification, num_labels=1, a fresh head). Its weights are random:
     memory does not depend on what a model has learnt;
  3. each training script as its own child process for a few updates, in every memory mode it has (RUNS
     below). The child imports the script as a module, builds its Args with tyro from the same flags a user
     would type, calls main(), and when main() returns writes what it measured on itself: peak RSS
     (getrusage ru_maxrss), peak GPU memory (torch.cuda.max_memory_allocated, when there is a GPU), the
     wall time, and the parameter counts of the model handed to accelerator.prepare;
  4. a Markdown table (`memory.md`, also printed) and a CSV (`memory.csv`) in --output_dir, followed by a
     back-of-envelope estimate for the paper's 6.9B PPO setting on 8 GPUs (an estimate, not a measurement).

--recipe measures nothing: from the same accounting per phase (phase_estimate) at Pythia 1B, 2.8B and 6.9B it
prints the flags of the README's per-size commands for 8 GPUs of 80 GiB (recipe: ZeRO stage, micro batch and
accumulation, generation chunk, --gradient_checkpointing, --offload) and their estimated peaks.

Why this parent process never imports torch: on Linux a child's ru_maxrss starts from the peak RSS of
the process that started it (the kernel carries the old address space's high-water mark across exec).
A parent that had built a model would lift every child's figure to its own peak. So the model is built
in a child as well, and the parent stays at about 20 MiB. Each child also records the high-water mark of
its own address space (VmHWM in /proc/self/status), which the CSV keeps as a cross-check.

This file is glue, not an algorithm (like pipeline.py): it imports the scripts, which never import it.
"""

from __future__ import annotations

import csv
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD_FLAG = "--_child"  # internal: `measure_memory.py --_child script result.json -- <script flags>`
BUILD_FLAG = "--_build"  # internal: `measure_memory.py --_build spec.json result.json`

# Every memory mode of every script: (script, mode) -> the flags that select the mode. "plain" is each
# script's default. The other modes are the memory options the scripts have (grep for lora / load_in_4bit /
# offload / unfrozen / precompute): LoRA on a float32 base and QLoRA (LoRA on a 4-bit NF4 base) in sft.py,
# dpo.py and ppo.py, PPO's Hydra and offload (trlX / OpenRLHF), and DPO's precomputed reference log-probs (the
# reference model is freed before training), and --gradient_checkpointing (every script has it; measured here in
# sft.py, reward.py, dpo.py and ppo.py). reward.py, ilql.py and offline_rl.py have no other memory option.
# offline_rl.py runs its default method (dt).
# The values of --lora_rank and --num_layers_unfrozen come from this tool's flags (see mode_flags).
RUNS = [
    ("sft.py", "plain"),
    ("sft.py", "lora"),
    ("sft.py", "qlora"),
    ("reward.py", "plain"),
    ("dpo.py", "plain"),
    ("dpo.py", "precompute_ref"),
    ("dpo.py", "lora"),
    ("dpo.py", "qlora"),
    ("ppo.py", "plain"),
    ("ppo.py", "lora"),
    ("ppo.py", "qlora"),
    ("ppo.py", "hydra"),
    ("ppo.py", "offload"),
    ("sft.py", "checkpointing"),
    ("reward.py", "checkpointing"),
    ("dpo.py", "checkpointing"),
    ("ppo.py", "checkpointing"),
    ("rloo.py", "plain"),
    ("ilql.py", "plain"),
    ("offline_rl.py", "plain"),
]
SCRIPTS = list(dict.fromkeys(script for script, _ in RUNS))
MODES = list(dict.fromkeys(mode for _, mode in RUNS))


@dataclass
class Args:
    task_dir: Optional[str] = None
    """a prepared built-in task (`python data/prepare.py --task synthetic --output_dir DIR`); None = prepare a
    small one in the work folder (once; later calls reuse it)"""
    output_dir: str = "artifacts/memory"
    """where memory.md and memory.csv go (a partial rerun, e.g. --scripts ppo.py, overwrites them: give it
    its own --output_dir to keep the full table)"""
    work_dir: Optional[str] = None
    """models, run folders, logs and per-run results; None = {output_dir}/work"""
    scripts: list[str] = field(default_factory=lambda: list(SCRIPTS))
    """scripts to measure (names with or without .py)"""
    modes: Optional[list[str]] = None
    """memory modes to measure (plain, lora, qlora, hydra, offload, precompute_ref, checkpointing); None = every mode of
    each script"""
    recipe: bool = False
    """print the README's per-size commands and the table of their estimated peaks (recipe_commands, recipe_table:
    flags from the estimate for 8 GPUs of --gpu_gib) and exit without measuring anything"""
    gpu_gib: float = 80.0
    """--recipe: GiB of memory of each of the 8 GPUs (the README's commands assume 80: GPU_GIB)"""

    # ---- the model (GPT-NeoX, Pythia's architecture; the rest of the config comes from the task's base model) ----
    hidden_size: int = 512
    num_layers: int = 8
    num_heads: int = 8
    intermediate_size: Optional[int] = None
    """MLP width; None = 4 x hidden_size (as in Pythia)"""
    seed: int = 0
    """seed of the random weights (and --seed of every run)"""

    # ---- the runs ----
    updates: int = 3
    """optimizer updates per run (AdamW's moments exist from the first update on, so a few suffice)"""
    micro_batch_size: int = 8
    """--local_micro_batch_size of every run, and its --total_batch_size (one micro batch per update), PPO's
    rollout forward batch, and every evaluation batch. Memory grows with it: state it with the figures"""
    num_eval_samples: int = 8
    """rows of each (final, minimal) evaluation"""
    lora_rank: int = 8
    """--lora_rank of the lora and qlora modes"""
    num_layers_unfrozen: int = 2
    """ppo.py --num_layers_unfrozen of the hydra mode (at most --num_layers)"""
    threads: int = 0
    """OMP_NUM_THREADS of every child (0 = leave the environment as it is)"""
    timeout_s: int = 3600
    """a run that takes longer than this is stopped and reported as failed"""
    keep_going: bool = False
    """after a failed run, measure the remaining ones (the failure is still reported, and the exit code is 1)"""


# ================================================================================================
# The child side: runs inside the measured process
# ================================================================================================
def load_script(name: str):
    """Import a top-level script (e.g. "ppo") as a module, as tests/conftest.py does. It is registered in
    sys.modules so that tyro and dataclasses can resolve the script's types by module name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO_ROOT, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def own_peak_rss_kib() -> Optional[int]:
    """The high-water mark of this process's own address space (Linux only), in KiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def count_params(module) -> dict:
    """Total and trainable (requires_grad) parameters of a module; shared tensors counted once."""
    params = {id(p): p for p in module.parameters()}.values()
    return {"total": sum(p.numel() for p in params), "trainable": sum(p.numel() for p in params if p.requires_grad)}


def child_main(script: str, result_path: str, argv: list) -> None:
    """Run `script`'s main() on `argv` in this process and write what it cost to `result_path` (JSON)."""
    start = time.monotonic()
    sys.path.insert(0, REPO_ROOT)
    import accelerate
    import torch
    import tyro

    name = script[: -len(".py")]
    module = load_script(name)
    args = tyro.cli(module.Args, args=argv, prog=script, use_underscores=True)
    sys.argv = [os.path.join(REPO_ROOT, script), *argv]  # what the script would see if run directly

    # Every script hands the model it trains, and its AdamW, to accelerator.prepare (the first module it
    # prepares; reward.py also prepares evaluation data loaders, which are not modules). A thin wrapper
    # around Accelerator.prepare counts their parameters before they are wrapped, without touching the script.
    # "policy": PPO's PolicyAndValue keeps it in .policy (the critic is the rest); every other script trains
    # one module (reward.py: the reward model; ilql.py: the LM with its Q/V heads).
    counts = {}
    original_prepare = accelerate.Accelerator.prepare

    def counting_prepare(self, *objects, **kwargs):
        for obj in objects:
            if isinstance(obj, torch.nn.Module) and "policy" not in counts:
                counts["policy"] = count_params(getattr(obj, "policy", obj))
                counts["trained_module"] = count_params(obj)
            if isinstance(obj, torch.optim.Optimizer) and "optimizer" not in counts:
                params = {id(p): p for group in obj.param_groups for p in group["params"]}.values()
                counts["optimizer"] = sum(p.numel() for p in params)
        return original_prepare(self, *objects, **kwargs)

    accelerate.Accelerator.prepare = counting_prepare
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rss_before_main_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # imports: torch, transformers, ...
    main_start = time.monotonic()
    module.main(args)
    main_s = time.monotonic() - main_start
    if cuda:
        torch.cuda.synchronize()
    result = {
        "script": script,
        # ru_maxrss is in KiB on Linux (bytes on macOS)
        "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "own_peak_rss_kib": own_peak_rss_kib(),
        "rss_before_main_kib": rss_before_main_kib,
        "peak_gpu_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
        "gpu_name": torch.cuda.get_device_name() if cuda else None,
        "main_s": main_s,
        "child_s": time.monotonic() - start,
        "policy_params": counts.get("policy", {}).get("total"),
        "policy_trainable_params": counts.get("policy", {}).get("trainable"),
        "trained_module_params": counts.get("trained_module", {}).get("total"),
        "optimizer_params": counts.get("optimizer"),
    }
    with open(result_path, "w") as f:
        json.dump(result, f, indent=2)


def build_main(spec_path: str, result_path: str) -> None:
    """Build the measured GPT-NeoX with the task's tokenizer; save it as the SFT model and as a reward model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    spec = json.load(open(spec_path))
    base = spec["base_model"]
    tokenizer = AutoTokenizer.from_pretrained(base)
    # the task's base model gives the architecture details (rotary embeddings, parallel residual, vocabulary
    # padded to a multiple of 64, EOS / pad ids); only the sizes change
    config = AutoConfig.from_pretrained(base)
    config.hidden_size = spec["hidden_size"]
    config.num_hidden_layers = spec["num_layers"]
    config.num_attention_heads = spec["num_heads"]
    config.intermediate_size = spec["intermediate_size"]
    if spec["hidden_size"] % spec["num_heads"]:
        raise ValueError(f"--hidden_size {spec['hidden_size']} is not a multiple of --num_heads {spec['num_heads']}")
    torch.manual_seed(spec["seed"])
    sft = AutoModelForCausalLM.from_config(config)
    sft.save_pretrained(spec["sft_dir"], safe_serialization=True)
    tokenizer.save_pretrained(spec["sft_dir"])
    # the reward model: the same trunk with a fresh one-label head instead of the LM head (as reward.py saves it)
    torch.manual_seed(spec["seed"])
    rm = AutoModelForSequenceClassification.from_pretrained(spec["sft_dir"], num_labels=1)
    rm.save_pretrained(spec["rm_dir"], safe_serialization=True)
    tokenizer.save_pretrained(spec["rm_dir"])
    cuda = torch.cuda.is_available()
    result = {
        "sft_params": sum(p.numel() for p in sft.parameters()),
        "rm_params": sum(p.numel() for p in rm.parameters()),
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "torch_version": torch.__version__,
        "gpu_name": torch.cuda.get_device_name() if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
    }
    with open(result_path, "w") as f:
        json.dump(result, f, indent=2)


# ================================================================================================
# The parent side: prepares, launches, tabulates (no torch here; see the module docstring)
# ================================================================================================
class RunFailed(RuntimeError):
    pass


def tail(path: str, max_lines: int = 30, max_chars: int = 4000) -> str:
    """The last lines of a log file (progress bars rewrite one line with \\r: keep each line's last state)."""
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return "(no log)"
    lines = [line.split("\r")[-1] for line in text.splitlines()]
    return "\n".join(lines[-max_lines:])[-max_chars:]


def child_env(args: Args) -> dict:
    env = dict(os.environ)
    for key, value in {"TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1",
                       "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}.items():
        env.setdefault(key, value)
    if args.threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    return env


def run_child(cmd: list, what: str, log_stem: str, args: Args) -> None:
    """Run a child with its output in {log_stem}.out / .err; a failure names `what` and shows the stderr tail."""
    with open(log_stem + ".out", "w") as out, open(log_stem + ".err", "w") as err:
        try:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env(args), stdout=out, stderr=err,
                                  timeout=args.timeout_s)
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            returncode = f"timeout after {args.timeout_s} s"
    if returncode != 0:
        raise RunFailed(
            f"{what} failed (exit code {returncode}).\n  command: {' '.join(cmd)}\n  full logs: {log_stem}.out / "
            f"{log_stem}.err\n  last lines of its stderr:\n"
            + "\n".join("    " + line for line in tail(log_stem + ".err").splitlines())
        )


def script_has_flag(script: str, flag: str) -> bool:
    """Whether the script's Args has this field, its own or its run group's (rlhf_utils/flags.py RunFlags).

    Read from the sources, so the parent need not import the script (and torch with it)."""
    with open(os.path.join(REPO_ROOT, script)) as f:
        source = f.read()
    if re.search(r"^\s+run: .*RunFlags", source, flags=re.M):  # the run flags every script takes in, flat
        with open(os.path.join(REPO_ROOT, "rlhf_utils", "flags.py")) as f:
            flags = f.read()
        source += flags[flags.index("class RunFlags:"):flags.index("\nclass ", flags.index("class RunFlags:"))]
    return re.search(rf"^\s+{re.escape(flag)}\s*:", source, flags=re.M) is not None


def mode_flags(script: str, mode: str, args: Args) -> list:
    """The flags that select a memory mode."""
    if mode == "plain":
        return []
    if mode == "checkpointing":  # activation checkpointing of every model that trains
        return ["--gradient_checkpointing"]
    if mode in ("lora", "qlora"):  # LoRA on the float32 base, or on the 4-bit base (QLoRA)
        return ["--lora_rank", str(args.lora_rank)] + (["--load_in_4bit"] if mode == "qlora" else [])
    return {
        ("ppo.py", "hydra"): ["--num_layers_unfrozen", str(min(args.num_layers_unfrozen, args.num_layers))],
        ("ppo.py", "offload"): ["--offload"],
        ("dpo.py", "precompute_ref"): ["--precompute_ref_logprobs"],
    }[(script, mode)]


def script_flags(script: str, mode: str, args: Args, paths: dict, task: dict, run_root: str) -> list:
    """Each script's flags for a short run: `updates` updates of one micro batch, no checkpoints, one small
    final evaluation. Read from each script's Args and from tests/test_<script>.py."""
    b, n = str(args.micro_batch_size), args.updates * args.micro_batch_size
    e = str(args.num_eval_samples)
    common = ["--seed", str(args.seed), "--output_dir", os.path.join(run_root, "model"),
              "--run_dir_root", os.path.join(run_root, "runs"), "--run_name", f"{script[:-3]}_{mode}",
              "--total_batch_size", b, "--local_micro_batch_size", b, "--total_episodes", str(n)]
    response = ["--response_length", str(task["sft_response_length"])]
    per_script = {
        "sft.py": ["--base_model", paths["sft"], "--query_dataset", paths["sft_data"], *response,
                   "--eval_every", "0", "--num_eval_samples", e, "--local_eval_batch_size", b],
        "reward.py": ["--sft_model_path", paths["sft"], "--preference_dataset", paths["preference"],
                      "--query_dataset", paths["sft_data"], "--eval_every", "0", "--num_eval_samples", e,
                      "--num_normalization_samples", e, "--local_eval_batch_size", b],
        "dpo.py": ["--sft_model_path", paths["sft"], "--preference_dataset", paths["preference"],
                   "--query_dataset", paths["sft_data"], *response, "--eval_every", "0", "--num_eval_samples", e,
                   "--local_eval_batch_size", b, "--log_every", "1", "--print_sample_every", "0"],
        # one PPO epoch over one minibatch: the epochs repeat the same computation and do not change the peak
        "ppo.py": ["--sft_model_path", paths["sft"], "--reward_model_path", paths["rm"],
                   "--query_dataset", paths["sft_data"], *response, "--local_rollout_forward_batch_size", b,
                   "--ppo.num_ppo_epochs", "1", "--ppo.num_mini_batches", "1", "--eval_every", "0",
                   "--num_eval_samples", e, "--print_sample_every", "0"],
        # RLOO's defaults (k = 2, one epoch over one minibatch): the same micro batch as PPO's, no critic
        "rloo.py": ["--sft_model_path", paths["sft"], "--reward_model_path", paths["rm"],
                    "--query_dataset", paths["sft_data"], *response, "--local_rollout_forward_batch_size", b,
                    "--eval_every", "0", "--num_eval_samples", e, "--print_sample_every", "0"],
        "ilql.py": ["--init_from", "base", "--model_path", paths["sft"], "--preference_dataset", paths["preference"],
                    "--query_dataset", paths["sft_data"], *response, "--eval_every", "0", "--num_eval_samples", e,
                    "--local_eval_batch_size", b, "--eval_betas", "1", "--beta", "1", "--log_every", "1",
                    "--print_sample_every", "0"],
        # the mixture holds two batches' worth of samples (a third of them generated and scored by the RM)
        "offline_rl.py": ["--method", "dt", "--sft_model_path", paths["sft"], "--reward_model_path", paths["rm"],
                          "--query_dataset", paths["sft_data"], "--preference_dataset", paths["preference"], *response,
                          "--cache_dir", os.path.join(run_root, "cache"), "--mixture_size", str(2 * n),
                          "--local_rollout_batch_size", b, "--eval_every", "0", "--num_eval_samples", e,
                          "--dt_eval_targets", "5"],
    }[script]
    flags = common + per_script + mode_flags(script, mode, args)
    if script_has_flag(script, "checkpoint_every"):
        flags += ["--checkpoint_every", "0"]  # no resumable checkpoints: they are not what is measured
    return flags


def machine_line(build: dict) -> str:
    pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    gpu = f"{build['gpu_count']} x {build['gpu_name']}" if build["gpu_name"] else "CPU only"
    return (f"{os.cpu_count()} CPUs, {pages * page_size / 2**30:.1f} GiB RAM, torch {build['torch_version']}, {gpu}, "
            f"Python {sys.version.split()[0]}")


def fmt_int(x) -> str:
    return f"{x:,}" if isinstance(x, int) else "?"


def write_outputs(args: Args, rows: list, header: str, estimate: str) -> str:
    """memory.md (table + estimate) and memory.csv in --output_dir; returns the Markdown."""
    os.makedirs(args.output_dir, exist_ok=True)
    gpu_seen = any(r.get("peak_gpu_allocated_bytes") is not None for r in rows)
    lines = [header, "",
             "| script | mode | mode flags | trainable params (policy / total) | AdamW params | peak CPU RSS MiB "
             "| RSS before main() MiB | peak GPU MiB | wall s (main() s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['script']} | {r['mode']} | {' '.join(r['mode_flags'])} | FAILED | | | | | |")
            continue
        gpu = (f"{r['peak_gpu_allocated_bytes'] / 2**20:.0f}" if r["peak_gpu_allocated_bytes"] is not None
               else "n/a (no GPU)")
        lines.append(
            f"| {r['script']} | {r['mode']} | {' '.join(r['mode_flags']) or '-'} | "
            f"{fmt_int(r['policy_trainable_params'])} / {fmt_int(r['policy_params'])} | "
            f"{fmt_int(r['optimizer_params'])} | "
            f"{r['peak_rss_kib'] / 1024:.0f} | {r['rss_before_main_kib'] / 1024:.0f} | {gpu} | "
            f"{r['wall_s']:.0f} ({r['main_s']:.0f}) |"
        )
    notes = [
        "",
        "Peak CPU RSS: `resource.getrusage(RUSAGE_SELF).ru_maxrss` of the child process at the end of main() "
        "(it includes the imports: \"RSS before main()\" is the peak up to the call). "
        + ("Peak GPU: `torch.cuda.max_memory_allocated()` (tensors; the CSV also has the allocator's reserved peak). "
           if gpu_seen else "")
        + "Trainable params (policy / total): the policy's parameters that require gradients, and all of them "
        "(PPO: the policy without the critic; reward.py: the reward model; ilql.py: the LM with its heads). "
        "AdamW params: everything the optimizer updates (PPO: policy + critic). Wall s: the whole child process "
        "(main() s: the call alone, without the imports).",
    ]
    if any(r["mode"] == "qlora" for r in rows):
        notes.append("QLoRA's total counts stored elements: bitsandbytes packs two 4-bit weights into each byte of a "
                     "4-bit layer, so such a layer counts half its weights.")
    inherited = [f"{r['script']} {r['mode']}" for r in rows if r["status"] == "ok" and r.get("own_peak_rss_kib")
                 and r["peak_rss_kib"] > 1.05 * r["own_peak_rss_kib"]]
    if inherited:  # see the module docstring: the launcher's own peak leaks into ru_maxrss
        notes.append("Warning: ru_maxrss exceeds the process's own high-water mark (VmHWM) for "
                     f"{', '.join(inherited)}: the figure carries the launching process's peak; the CSV's "
                     "own_peak_rss_mib is the process's own.")
    if not gpu_seen:
        notes.append("Without a GPU, `ppo.py --offload` has nothing to move (the models already live in CPU memory), "
                     "so its figure shows the option's cost-free path only; its saving appears on a GPU.")
    text = "\n".join(lines + notes) + "\n\n" + estimate + "\n"
    with open(os.path.join(args.output_dir, "memory.md"), "w") as f:
        f.write(text)
    columns = ["script", "mode", "mode_flags", "status", "policy_trainable_params", "policy_params",
               "trained_module_params", "optimizer_params", "peak_rss_mib", "own_peak_rss_mib", "rss_before_main_mib",
               "peak_gpu_allocated_mib", "peak_gpu_reserved_mib", "gpu_name", "wall_s", "main_s", "updates",
               "micro_batch_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "model_params",
               "command"]
    with open(os.path.join(args.output_dir, "memory.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for r in rows:
            mib = lambda key, scale: round(r[key] / scale, 1) if r.get(key) is not None else ""  # noqa: E731
            writer.writerow({
                **{k: r.get(k, "") for k in columns},
                "mode_flags": " ".join(r["mode_flags"]),
                "peak_rss_mib": mib("peak_rss_kib", 1024), "own_peak_rss_mib": mib("own_peak_rss_kib", 1024),
                "rss_before_main_mib": mib("rss_before_main_kib", 1024),
                "peak_gpu_allocated_mib": mib("peak_gpu_allocated_bytes", 2**20),
                "peak_gpu_reserved_mib": mib("peak_gpu_reserved_bytes", 2**20),
                "wall_s": round(r["wall_s"], 1) if r.get("wall_s") is not None else "",
                "main_s": round(r["main_s"], 1) if r.get("main_s") is not None else "",
                "command": " ".join(r["command"]),
            })
    return text


# ================================================================================================
# The paper's 6.9B setting: a back-of-envelope estimate (no measurement)
# ================================================================================================
def gpt_neox_params(h: int, layers: int, vocab: int, intermediate: int, lm_head: bool = True) -> int:
    """Parameters of a GPT-NeoX (untied embeddings, biases everywhere). Per layer: QKV 3h^2+3h, attention
    output h^2+h, MLP 2*h*i+i+h, two layer norms 4h; then the input embedding V*h, the final norm 2h, and
    either the LM head V*h (causal LM) or a scalar head h (reward model / critic, no bias)."""
    per_layer = 4 * h * h + 2 * h * intermediate + 9 * h + intermediate
    return layers * per_layer + vocab * h + 2 * h + (vocab * h if lm_head else h)


def paper_estimate(measured_params: Optional[int] = None, measured_config: Optional[dict] = None) -> str:
    """Per-GPU memory of ppo.py at Pythia-6.9B on 8 GPUs in bf16 with the paper's batches, from phase_estimate's
    accounting (below): ZeRO-2, ZeRO-3, ZeRO-3 with --offload, each with and without --gradient_checkpointing."""
    GiB = 2**30
    h, L, i, V = PYTHIA_SIZES["6.9b"]
    N = NUM_GPUS
    policy = gpt_neox_params(h, L, V, i)  # 6,857,302,016: the published Pythia-6.9B count
    critic = gpt_neox_params(h, L, V, i, lm_head=False)  # Detail 22: the critic is a copy of the RM
    reward_model, reference = critic, policy
    trained = policy + critic  # PolicyAndValue: one module, one AdamW
    frozen = reference + reward_model
    c = RECIPE_SCRIPTS["ppo.py"]
    b, chunk, s = c["micro"], c["chunk"][1], c["s"]  # ppo.py's defaults (the paper's)
    settings = {"zero2": (2, False), "zero3": (3, False), "zero3 --offload": (3, True)}
    plain = {k: phase_estimate("ppo.py", "6.9b", st, b, chunk, False, off) for k, (st, off) in settings.items()}
    ckpt = {k: phase_estimate("ppo.py", "6.9b", st, b, chunk, True, off) for k, (st, off) in settings.items()}
    activations = 2 * L * 34 * s * b * h
    activations_ckpt = 2 * (L * 2 * s * b * h + 34 * s * b * h)
    kv_cache = 2 * L * chunk * s * h * 2

    def gib(x: float) -> str:
        return f"{x / GiB:.1f}"

    def row(name: str, values, formula: str = "") -> str:
        return f"| {name} | " + " | ".join(values) + f" | {formula} |"

    states = [2 * trained + 14 * trained / N, 16 * trained / N, 16 * trained / N]
    lines = [
        "## Worked example: PPO at Pythia-6.9B on 8 GPUs (an estimate, not a measurement)",
        "",
        f"Policy {policy:,} + critic {critic:,} parameters trained (P = {trained / 1e9:.2f}B) with AdamW in bf16 "
        f"(fp32 master weights and two fp32 moments); frozen reference {reference:,} + reward model {reward_model:,} "
        f"(F = {frozen / 1e9:.2f}B) in bf16. Counts from the GPT-NeoX formula in `gpt_neox_params`"
        + (f" (which gives {measured_params:,} for the measured model above: exactly its checkpoint's count)"
           if measured_params is not None else "")
        + f". ppo.py's defaults: micro batch {b}, rollout chunk {chunk}, {s} tokens. GiB per GPU (N = {N} processes); "
        "the accounting is `phase_estimate`'s:",
        "",
        "| per GPU | ZeRO-2 (zero2.yaml) | ZeRO-3 (zero3.yaml) | ZeRO-3 with --offload | formula |",
        "| --- | --- | --- | --- | --- |",
        row("bf16 weights of policy + critic", [gib(2 * trained), gib(2 * trained / N), gib(2 * trained / N)],
            "2P ; 2P/N"),
        row("bf16 gradients + fp32 master weights + AdamW m, v", [gib(14 * trained / N)] * 3, "14P/N"),
        row("**model states** (always resident)", [f"**{gib(x)}**" for x in states], "2P+14P/N ; 16P/N"),
        row("reference + RM on the GPU between phases", [gib(2 * frozen), gib(2 * frozen / N), "0"],
            "2F ; 2F/N ; 0 (CPU partitions, 2F/N per process)"),
        row("policy + critic gathered for a rollout (--gather_for_generation)", ["0", gib(2 * trained),
                                                                                  gib(2 * trained)], "- ; 2P"),
        row(f"activations, micro batch {b}, no checkpointing", [gib(activations)] * 3, "2 x L x 34sbh"),
        row(f"activations, micro batch {b}, --gradient_checkpointing", [gib(activations_ckpt)] * 3,
            "2 x (L x 2sbh + 34sbh)"),
        row(f"generation KV cache, rollout chunk {chunk}", [gib(kv_cache)] * 3, "2 x L x chunk x s x h x 2"),
        row("rollout phase", [gib(p["generation"]) for p in plain.values()]),
        row("training phase", [gib(p["training"]) for p in plain.values()]),
        row("training phase with --gradient_checkpointing", [gib(p["training"]) for p in ckpt.values()]),
        row("**estimated peak** (the largest phase)", [f"**{gib(max(p.values()))}**" for p in plain.values()]),
        row("**estimated peak with --gradient_checkpointing**", [f"**{gib(max(p.values()))}**" for p in ckpt.values()]),
        "",
        f"Reading it: ZeRO-2 replicates the bf16 weights of two 6.9B models ({gib(2 * trained)} GiB) and keeps the "
        f"frozen pair whole on every GPU (or, with --offload, brings both for each rollout): more than the "
        f"{HEADROOM:.0%} of an 80 GiB GPU the recipe allows, with or without checkpointing. ZeRO-3 shards the "
        "states; its rollout holds the policy and critic gathered whole (`--gather_for_generation`), its training "
        "phase the activations, which `--gradient_checkpointing` cuts from all layers' to the layers' inputs plus "
        "one layer's. `--offload` (ZeRO-3 parameter offload) takes the frozen models' shards off the GPU. "
        "Activations grow linearly with `--local_micro_batch_size` and the KV cache with "
        "`--local_rollout_forward_batch_size`. Not counted: the CUDA context (~0.5-1 GiB), DeepSpeed's "
        "communication buckets, allocator fragmentation and PyTorch's temporary buffers: real peaks are higher than "
        f"this table, hence the {HEADROOM:.0%} headroom. Measure on the GPUs before trusting it.",
    ]
    return "\n".join(lines)


# ================================================================================================
# The paper's sizes on 80 GB GPUs: per-phase estimate and the README's per-size flags (no measurement)
# ================================================================================================
# Pythia's configurations (config.json of EleutherAI/pythia-{size}-deduped): hidden, layers, MLP width, vocabulary
PYTHIA_SIZES = {"1b": (2048, 16, 8192, 50304), "2.8b": (2560, 32, 10240, 50304), "6.9b": (4096, 32, 16384, 50432)}
GPU_GIB = 80  # the GPU the recipe assumes: one of 8 (zero2.yaml / zero3.yaml) with 80 GiB, an A100 or H100 80 GB
NUM_GPUS = 8
# The estimate counts weights, gradients, optimizer states, activations, the LM head's outputs and the KV cache. The
# rest (CUDA context, DeepSpeed's communication buckets, the optimizer step's temporary fp32 gradients, allocator
# fragmentation, PyTorch's temporary buffers) has no formula here: a recipe may fill HEADROOM of the GPU, not all.
HEADROOM = 0.85
LIVE_PARAMETERS = 1e9  # DeepSpeed's stage3_max_live_parameters default: ZeRO-3 holds at most this many gathered
# What the estimate reads of each script's defaults (the paper's; TL;DR's widths from data/prepare.py): sequences
# per row (a preference pair is two), tokens per sequence (query 512 + response 53, or + the RM's 169), response
# tokens the LM head computes (0: a scalar head only), rows per process and minibatch (total_batch_size / 8 /
# num_mini_batches), the default micro batch, the flag of the generation (or scoring) chunk and its default, and
# the models that train and that stay frozen ("lm": a causal LM, "rm": a scalar-head model: reward model, critic).
RECIPE_SCRIPTS = {
    "sft.py": {"seqs": 1, "s": 565, "r": 53, "rows": 128 // 8, "micro": 16, "chunk": ("--local_eval_batch_size", 32),
               "trained": ("lm",), "frozen": (), "offload_flag": False},
    "reward.py": {"seqs": 2, "s": 681, "r": 0, "rows": 64 // 8, "micro": 8, "chunk": None,
                  "trained": ("rm",), "frozen": (), "offload_flag": False},
    "dpo.py": {"seqs": 2, "s": 681, "r": 169, "rows": 64 // 8, "micro": 8, "chunk": ("--local_eval_batch_size", 8),
               "trained": ("lm",), "frozen": ("lm",), "offload_flag": False},
    "ppo.py": {"seqs": 1, "s": 565, "r": 53, "rows": 512 // 8, "micro": 8,
               "chunk": ("--local_rollout_forward_batch_size", 64), "trained": ("lm", "rm"), "frozen": ("lm", "rm"),
               "offload_flag": True},
}


def phase_estimate(script: str, size: str, stage: int, micro: int, chunk: int, checkpointing: bool, offload: bool,
                   gpus: int = NUM_GPUS) -> dict:
    """Bytes per GPU in each phase of `script` at Pythia-`size` under ZeRO-`stage` on `gpus` GPUs in bf16 (phases run
    one after the other; the run's peak is the largest). The accounting:
      model states (P trained parameters; ZeRO paper, Rajbhandari et al. 2020, Sec. 3.1): bf16 weights 2P, bf16
        gradients 2P, fp32 master weights and AdamW's m and v 12P; ZeRO-2 splits gradients and optimizer states over
        the GPUs (2P + 14P/N), ZeRO-3 the weights too (16P/N), and gathers a trained model's layers as they run, at
        most LIVE_PARAMETERS at a time;
      frozen models (reference, reward model; bf16, 2 bytes per parameter): ZeRO-2 keeps them whole on every GPU, or
        with --offload in CPU memory, brought whole to the GPU for a phase (both for a PPO rollout); ZeRO-3 keeps 1/N
        of them on each GPU and gathers at most LIVE_PARAMETERS of one at a time as it runs, or with --offload (ZeRO-3
        parameter offload) keeps its partitions in CPU memory and none on the GPU between uses;
      activations of one micro batch of B sequences of s tokens (Korthikanti et al. 2022, Sec. 4.1, 16-bit, with a
        fused attention kernel that stores no s x s scores): 34 s B h bytes per layer and trained model, all L layers
        kept; with --gradient_checkpointing each layer keeps its bf16 input (2 s B h) and one layer at a time is rerun
        in the backward pass (34 s B h);
      the LM head's outputs over the r response positions it computes: bf16 logits and about three fp32 copies of
        the log-softmax, 14 B r V bytes;
      generation (a PPO rollout, an SFT or DPO evaluation's samples) in chunks: the key/value cache, 2 (K and V) x L x
        chunk x s x h x 2 bytes, and under ZeRO-3 the trained engine's weights gathered whole for the phase
        (--gather_for_generation, on by default: 2P); a PPO rollout also scores each chunk with no-grad forwards (one
        layer's activations at a time and the head's outputs) after its generation has freed the cache;
      DPO's reference forward on each micro batch (no grad): one layer's activations and the head's outputs;
      the optimizer step: the GPU's gradient partition in fp32 (4P/N) beside the model states."""
    h, L, i, V = PYTHIA_SIZES[size]
    c = RECIPE_SCRIPTS[script]
    params = {"lm": gpt_neox_params(h, L, V, i), "rm": gpt_neox_params(h, L, V, i, lm_head=False)}
    trained = sum(params[m] for m in c["trained"])
    frozen = [params[m] for m in c["frozen"]]
    states = 2 * trained + 14 * trained / gpus if stage == 2 else 16 * trained / gpus
    gathered = 0 if stage == 2 else 2 * min(LIVE_PARAMETERS, max(params[m] for m in c["trained"]))
    if stage == 2:  # frozen weights on the GPU between phases, and those brought for a phase (--offload)
        resident, brought = (0, 2 * sum(frozen)) if offload else (2 * sum(frozen), 0)
    else:
        resident, brought = (0 if offload else 2 * sum(frozen) / gpus), 2 * min([LIVE_PARAMETERS, *frozen])
    s, r, B = c["s"], c["r"], c["seqs"] * micro
    layer = lambda rows: 34 * s * rows * h  # noqa: E731  one layer's activations, bytes
    head = lambda rows: 14 * rows * r * V  # noqa: E731  the LM head's outputs, bytes
    kept = L * 2 * s * B * h + layer(B) if checkpointing else L * layer(B)
    phases = {"training": states + resident + gathered + len(c["trained"]) * kept + head(B),
              "step": states + resident + 4 * trained / gpus}
    if c["chunk"] is not None:
        engine = 0 if stage == 2 else 2 * trained  # ZeRO-3, --gather_for_generation
        kv_cache = 2 * L * chunk * s * h * 2
        scoring = layer(chunk) + head(chunk) if script == "ppo.py" else 0
        phases["generation"] = states + resident + engine + (brought if script == "ppo.py" else 0) + max(kv_cache,
                                                                                                        scoring)
    if script == "dpo.py":
        phases["reference"] = states + resident + (0 if stage == 2 else brought) + layer(B) + head(B)
    return phases


MIN_MICRO = 4  # rows: below this micro batch a recipe turns checkpointing on instead


def halvings(n: int) -> list:
    """n, n/2, ..., 1 (the micro batches and chunks a recipe tries, largest first)."""
    return [n >> k for k in range(n.bit_length())]


def recipe(script: str, size: str, gpu_gib: float = GPU_GIB) -> dict:
    """The flags of `script` at Pythia-`size` on 8 GPUs of `gpu_gib`: the first setting, in this order, whose
    estimated peak fits HEADROOM of the GPU: ZeRO-2 before ZeRO-3 (no gathers), no offload before --offload (no CPU
    transfers; ppo.py only), then micro batches of at least MIN_MICRO rows without checkpointing before
    --gradient_checkpointing (whose second forward pass costs more than a smaller micro batch, down to MIN_MICRO),
    each the largest micro batch first, then the largest chunk. The update stays the paper's: gradient accumulation
    makes up the rows per process that a smaller micro batch leaves out."""
    c = RECIPE_SCRIPTS[script]
    budget = HEADROOM * gpu_gib * 2**30
    batches = [(False, m) for m in halvings(c["micro"]) if m >= min(MIN_MICRO, c["micro"])]
    batches += [(True, m) for m in halvings(c["micro"])]
    for stage in (2, 3):
        for offload in (False, True) if c["offload_flag"] else (False,):
            for checkpointing, micro in batches:
                for chunk in halvings(c["chunk"][1]) if c["chunk"] else [0]:
                    peak = max(phase_estimate(script, size, stage, micro, chunk, checkpointing, offload).values())
                    if peak <= budget:
                        return {"stage": stage, "offload": offload, "checkpointing": checkpointing, "micro": micro,
                                "accumulation": c["rows"] // micro, "chunk": chunk, "peak_gib": peak / 2**30}
    raise ValueError(f"{script} at Pythia-{size} fits no setting on a {gpu_gib} GiB GPU by this estimate")


def recipe_flags(script: str, settings: dict) -> list:
    """A recipe as the command-line flags of the script (after `--config_file zeroN.yaml script`)."""
    c = RECIPE_SCRIPTS[script]
    flags = ["--local_micro_batch_size", str(settings["micro"]), "--gradient_accumulation_steps",
             str(settings["accumulation"])]
    if c["chunk"] is not None:
        flags += [c["chunk"][0], str(settings["chunk"])]
    return flags + (["--gradient_checkpointing"] if settings["checkpointing"] else []) + (
        ["--offload"] if settings["offload"] else [])


# The README's per-size commands, with the per-size flags spliced in: {flags}
README_COMMANDS = {
    "sft.py": "sft.py --base_model EleutherAI/pythia-{size}-deduped \\\n    {flags} \\\n"
              "    --query_dataset data/processed/tldr/sft --output_dir models/sft_{size}",
    "reward.py": "reward.py --sft_model_path models/sft_{size} \\\n    {flags} \\\n"
                 "    --preference_dataset data/processed/tldr/preference --query_dataset data/processed/tldr/sft "
                 "--output_dir models/rm_{size}",
    "ppo.py": "ppo.py --sft_model_path models/sft_{size} --reward_model_path models/rm_{size} \\\n    {flags} \\\n"
              "    --query_dataset data/processed/tldr/sft --output_dir models/ppo_{size}",
    "dpo.py": "dpo.py --sft_model_path models/sft_{size} \\\n    {flags} \\\n"
              "    --preference_dataset data/processed/tldr/preference --query_dataset data/processed/tldr/sft "
              "--output_dir models/dpo_{size}",
}


def recipe_commands(gpu_gib: float = GPU_GIB) -> str:
    """The README's per-size block (`python tools/measure_memory.py --recipe` prints it)."""
    lines = []
    for size in PYTHIA_SIZES:
        lines.append(f"# Pythia-{size.upper()}")
        for script, command in README_COMMANDS.items():
            try:
                settings = recipe(script, size, gpu_gib)
            except ValueError as error:
                lines.append(f"# {error}")
                continue
            flags = " ".join(recipe_flags(script, settings))
            lines.append(f"accelerate launch --config_file zero{settings['stage']}.yaml "
                         + command.format(size=size, flags=flags))
    return "\n".join(lines)


def recipe_table(gpu_gib: float = GPU_GIB) -> str:
    """Each recipe with its estimated peak and that of the same flags without checkpointing (Markdown)."""
    rows = ["| size | script | ZeRO | micro x accumulation | chunk | checkpointing | offload | estimated peak GiB "
            "| without checkpointing |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for size in PYTHIA_SIZES:
        for script in README_COMMANDS:
            try:
                r = recipe(script, size, gpu_gib)
            except ValueError:
                rows.append(f"| {size} | {script} | fits no setting | | | | | | |")
                continue
            plain = max(phase_estimate(script, size, r["stage"], r["micro"], r["chunk"], False, r["offload"]).values())
            rows.append(f"| {size} | {script} | {r['stage']} | {r['micro']} x {r['accumulation']} "
                        f"| {r['chunk'] or '-'} "
                        f"| {'yes' if r['checkpointing'] else 'no'} | {'yes' if r['offload'] else 'no'} "
                        f"| {r['peak_gib']:.1f} | {plain / 2**30:.1f} |")
    return "\n".join(rows)


# ================================================================================================
# Driver
# ================================================================================================
def select_runs(args: Args) -> list:
    scripts = [s if s.endswith(".py") else f"{s}.py" for s in args.scripts]
    unknown = [s for s in scripts if s not in SCRIPTS]
    if unknown:
        raise SystemExit(f"error: unknown --scripts {unknown}; choose from {SCRIPTS}")
    if args.modes is not None:
        bad = [m for m in args.modes if m not in MODES]
        if bad:
            raise SystemExit(f"error: unknown --modes {bad}; choose from {MODES}")
    runs = [(s, m) for s, m in RUNS if s in scripts and (args.modes is None or m in args.modes)]
    if not runs:
        raise SystemExit(f"error: no run matches --scripts {args.scripts} --modes {args.modes}; the runs are {RUNS}")
    return runs


def main(args: Args) -> int:
    from tqdm import tqdm

    if args.recipe:
        print(recipe_commands(args.gpu_gib) + "\n\n" + recipe_table(args.gpu_gib))
        return 0
    t_start = time.monotonic()
    runs = select_runs(args)
    if args.intermediate_size is None:
        args.intermediate_size = 4 * args.hidden_size
    args.output_dir = os.path.abspath(args.output_dir)
    work = os.path.abspath(args.work_dir or os.path.join(args.output_dir, "work"))
    logs = os.path.join(work, "logs")
    os.makedirs(logs, exist_ok=True)
    me = os.path.abspath(__file__)

    # ---- 1. the task ----
    if args.task_dir is None:
        task_dir = os.path.join(work, "task")
        if not os.path.exists(os.path.join(task_dir, "task.json")):
            # the small task of tests/conftest.py (prepare_small_task): ~1 minute
            small = ["--synthetic_num_sft_train", "256", "--synthetic_num_sft_eval", "48", "--synthetic_num_sft_test",
                     "48", "--synthetic_num_pref_train", "256", "--synthetic_num_pref_valid", "64",
                     "--synthetic_num_cnndm", "8",
                     "--synthetic_warmup_steps", "20", "--no-plots"]
            print(f"preparing a small built-in task in {task_dir} (once; later calls reuse it)", flush=True)
            shutil.rmtree(task_dir, ignore_errors=True)
            run_child([sys.executable, os.path.join(REPO_ROOT, "data", "prepare.py"), "--task", "synthetic",
                       "--output_dir", task_dir, "--seed", str(args.seed), *small],
                      "data/prepare.py --task synthetic", os.path.join(logs, "prepare"), args)
    else:
        task_dir = os.path.abspath(args.task_dir)
    task_json = os.path.join(task_dir, "task.json")
    if not os.path.exists(task_json):
        raise SystemExit(f"error: {task_json} not found; --task_dir must be a folder written by "
                         "`python data/prepare.py --task synthetic --output_dir DIR`")
    task = json.load(open(task_json))

    # ---- 2. the model, saved as the SFT model and as a reward model (in a child: see the docstring) ----
    tag = f"h{args.hidden_size}_l{args.num_layers}_a{args.num_heads}_i{args.intermediate_size}"
    paths = {"sft": os.path.join(work, "models", tag, "sft"), "rm": os.path.join(work, "models", tag, "rm"),
             "sft_data": os.path.join(task_dir, "sft"), "preference": os.path.join(task_dir, "preference")}
    spec = {"base_model": os.path.join(task_dir, "base_model"), "hidden_size": args.hidden_size,
            "num_layers": args.num_layers, "num_heads": args.num_heads, "intermediate_size": args.intermediate_size,
            "seed": args.seed, "sft_dir": paths["sft"], "rm_dir": paths["rm"]}
    os.makedirs(os.path.dirname(paths["sft"]), exist_ok=True)
    spec_path = os.path.join(work, "models", tag, "spec.json")
    build_path = os.path.join(work, "models", tag, "build.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f, indent=2)
    print(f"building the GPT-NeoX ({tag}) in {os.path.dirname(paths['sft'])}", flush=True)
    run_child([sys.executable, me, BUILD_FLAG, spec_path, build_path], "building the model",
              os.path.join(logs, f"build_{tag}"), args)
    build = json.load(open(build_path))

    # ---- 3. the runs ----
    rows, failures = [], []
    progress = tqdm(runs, desc="memory runs", unit="run", dynamic_ncols=True)
    for script, mode in progress:
        progress.set_postfix_str(f"{script} {mode}")
        name = f"{script[:-3]}_{mode}"
        run_root = os.path.join(work, "runs", name)
        shutil.rmtree(run_root, ignore_errors=True)  # a fresh start: no old checkpoint, no cached mixture
        os.makedirs(run_root)
        flags = script_flags(script, mode, args, paths, task, run_root)
        result_path = os.path.join(run_root, "result.json")
        cmd = [sys.executable, me, CHILD_FLAG, script, result_path, "--", *flags]
        row = {"script": script, "mode": mode, "mode_flags": mode_flags(script, mode, args), "command": cmd,
               "updates": args.updates, "micro_batch_size": args.micro_batch_size, "hidden_size": args.hidden_size,
               "num_layers": args.num_layers, "num_heads": args.num_heads, "intermediate_size": args.intermediate_size,
               "model_params": build["sft_params"]}
        t0 = time.monotonic()
        try:
            run_child(cmd, f"{script} ({mode} mode)", os.path.join(logs, name), args)
        except RunFailed as error:
            failures.append(str(error))
            rows.append({**row, "status": "failed", "wall_s": time.monotonic() - t0})
            tqdm.write(f"\n{error}\n", file=sys.stderr)
            if not args.keep_going:
                break
            continue
        row.update(json.load(open(result_path)), status="ok", wall_s=time.monotonic() - t0)
        rows.append(row)
        tqdm.write(f"{script} {mode}: peak RSS {row['peak_rss_kib'] / 1024:.0f} MiB, "
                   f"trainable {fmt_int(row['policy_trainable_params'])}, {row['wall_s']:.0f} s")
    progress.close()

    # ---- 4. the table, the CSV and the estimate ----
    header = (f"# Peak memory per training script ({machine_line(build)}; model: GPT-NeoX hidden {args.hidden_size}, "
              f"{args.num_layers} layers, {args.num_heads} heads, MLP {args.intermediate_size}, vocabulary "
              f"{build['vocab_size']}: {build['sft_params'] / 1e6:.1f}M parameters as a causal LM, "
              f"{build['rm_params'] / 1e6:.1f}M as a reward model; {args.updates} update(s) of micro batch "
              f"{args.micro_batch_size}, queries of {task['query_length']} tokens, responses of "
              f"{task['sft_response_length']} (preference pairs {task['rm_response_length']}); float32 on CPU, "
              f"bf16 autocast on a bf16 GPU)")
    config = {"h": args.hidden_size, "L": args.num_layers, "V": build["vocab_size"], "i": args.intermediate_size}
    formula = gpt_neox_params(config["h"], config["L"], config["V"], config["i"])
    if formula != build["sft_params"]:  # the estimate's parameter formula, checked on a real checkpoint
        print(f"warning: the parameter formula gives {formula:,} for the measured model, which has "
              f"{build['sft_params']:,}; the 6.9B estimate below may be off", file=sys.stderr)
    estimate = paper_estimate(measured_params=formula if formula == build["sft_params"] else None)
    text = write_outputs(args, rows, header, estimate)
    print("\n" + text)
    print(f"written: {os.path.join(args.output_dir, 'memory.md')} and memory.csv "
          f"({len(rows)} runs, {time.monotonic() - t_start:.0f} s in all; logs in {logs})")
    if failures or len(rows) < len(runs):
        print(f"\n{len(failures)} run(s) failed:\n\n" + "\n\n".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == CHILD_FLAG:
        # measure_memory.py --_child SCRIPT RESULT_JSON -- FLAGS...
        _, _, child_script, child_result, separator, *child_argv = sys.argv
        assert separator == "--", sys.argv
        child_main(child_script, child_result, child_argv)
    elif len(sys.argv) > 1 and sys.argv[1] == BUILD_FLAG:
        build_main(sys.argv[2], sys.argv[3])
    else:
        import tyro

        sys.exit(main(tyro.cli(Args, use_underscores=True)))
