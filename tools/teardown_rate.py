"""How often a finished 2-process DeepSpeed run on the CPU fails at exit: run one small training script N times
under `accelerate launch --config_file zero3.yaml --num_processes 2` (DeepSpeed's CPU accelerator, gloo) on a small
built-in task, and count the runs that wrote their model yet ended with a failed exit (e.g. a rank aborting in the
interpreter's teardown: "terminate called without an active exception", exit -6).

    python tools/teardown_rate.py --runs 20                       # sft.py under zero3.yaml
    python tools/teardown_rate.py --runs 20 --script offline_rl     # the Decision Transformer (a reward model too)
    python tools/teardown_rate.py --runs 80 --script probe          # a 2-process gather probe; probe_destroy,
                                                                    # probe_leave (ends as the scripts end)
    python tools/teardown_rate.py --runs 20 --script probe --backtrace   # the native stack of each abort

Prints one line per run (exit code, seconds, whether the model was saved, the abort line if any) and the rate
failures / runs. It decides no number of any run; docs/results.md reports what it measured."""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_TASK = ["--synthetic_num_sft_train", "256", "--synthetic_num_sft_eval", "48", "--synthetic_num_sft_test", "48",
              "--synthetic_num_pref_train", "256",
              "--synthetic_num_pref_valid", "64", "--synthetic_num_cnndm", "8", "--synthetic_warmup_steps", "20",
              "--no-plots"]


def reward_model(task: str) -> str:
    """A reward model for offline_rl.py: the base model with a fresh scalar head (made once)."""
    path = os.path.join(task, "rm")
    if not os.path.exists(os.path.join(path, "config.json")):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        base = os.path.join(task, "base_model")
        AutoModelForSequenceClassification.from_pretrained(base, num_labels=1).save_pretrained(path)
        AutoTokenizer.from_pretrained(base).save_pretrained(path)
    return path


def script_flags(script: str, task: str, run_dir: str) -> list:
    """A small run of `script` (a few updates) on the task prepared in `task`, with a short evaluation."""
    base, sft = os.path.join(task, "base_model"), os.path.join(task, "sft")
    length = ["--response_length", str(json.load(open(os.path.join(task, "task.json")))["sft_response_length"])]
    if script == "sft":
        return ["--base_model", base, "--query_dataset", sft, *length, "--total_episodes", "64", "--total_batch_size",
                "32", "--local_micro_batch_size", "8", "--num_eval_samples", "8"]
    if script == "offline_rl":  # the Decision Transformer on an RM-labelled mixture (test_multiprocess.py's flags)
        return ["--method", "dt", "--dt_eval_targets", "0", "--sft_model_path", base, "--reward_model_path",
                reward_model(task), "--query_dataset", sft, "--preference_dataset", os.path.join(task, "preference"),
                *length, "--cache_dir", os.path.join(run_dir, "cache"), "--mixture_size", "32", "--total_batch_size",
                "8", "--local_micro_batch_size", "4", "--num_eval_samples", "4", "--local_rollout_batch_size", "8"]
    raise SystemExit(f"--script {script}: this tool knows sft and offline_rl")


# the smallest run that meets the abort: two torchrun processes over gloo, one gather and one reduce, rank 0 writes
# a file. Every variant imports rlhf_utils.run first (so that they differ only in how they end): `probe` ends as a plain
# script does, `probe_destroy` destroys the process group first (what rlhf_utils/run.py's exit handler does at exit),
# `probe_leave` calls run_module.leave_processes() (what the scripts do after main())
PROBE = """import sys, torch
sys.path.insert(0, {root!r})
from rlhf_utils import run as run_module
from accelerate import Accelerator
accelerator = Accelerator(cpu=True)
x = torch.arange(4.0) + accelerator.process_index
gathered, total = accelerator.gather(x), accelerator.reduce(x, "sum")
if accelerator.is_main_process:
    torch.save((gathered, total), sys.argv[1])
"""
ENDINGS = {"probe": "", "probe_destroy": "torch.distributed.destroy_process_group()\n",
           "probe_leave": "run_module.leave_processes()\n"}
# --backtrace: a preloaded library whose std::terminate handler prints the native stack (how the cause was found:
# a gloo worker thread dropping a tensor, taking the GIL during the interpreter's teardown; docs/results.md)
TERMINATE_HANDLER = r"""#include <exception>
#include <execinfo.h>
#include <cstdio>
#include <cstdlib>
static void handler() {
  void* frames[64];
  fprintf(stderr, "terminate: native stack\n");
  backtrace_symbols_fd(frames, backtrace(frames, 64), 2);
  abort();
}
__attribute__((constructor)) static void install() { std::set_terminate(handler); }
"""


def terminate_handler(work: str) -> str:
    """Compile TERMINATE_HANDLER (g++) into work/ and return the library's path, for LD_PRELOAD."""
    source, library = os.path.join(work, "terminate_handler.cpp"), os.path.join(work, "terminate_handler.so")
    os.makedirs(work, exist_ok=True)
    open(source, "w").write(TERMINATE_HANDLER)
    subprocess.run(["g++", "-shared", "-fPIC", "-O1", "-o", library, source], check=True)
    return library


def probe_command(script: str, work: str, i: int) -> list:
    """torchrun on 2 processes of PROBE, ended as ENDINGS[script] says."""
    path = os.path.join(work, f"{script}.py")
    if not os.path.exists(path):
        open(path, "w").write(PROBE.format(root=REPO_ROOT) + ENDINGS[script])
    with socket.socket() as s:  # a free rendezvous port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port), path,
            os.path.join(work, f"model_{i}", "model.safetensors")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="how many runs")
    parser.add_argument("--script", default="sft", help="sft, offline_rl, or probe / probe_destroy / probe_leave "
                        "(torchrun only)")
    parser.add_argument("--backtrace", action="store_true", help="print each abort's native stack (needs g++)")
    parser.add_argument("--config", default="zero3.yaml", help="the accelerate config the README ships")
    parser.add_argument("--workdir", default=None, help="where the task and the runs go (default: a temporary folder)")
    args = parser.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="teardown_")
    task = os.path.join(work, "task")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.script.startswith("probe"):  # torchrun's processes on the CPU, over gloo
        env["ACCELERATE_USE_CPU"] = "true"
    if args.backtrace:
        env["LD_PRELOAD"] = terminate_handler(work)
    if not args.script.startswith("probe") and not os.path.exists(os.path.join(task, "task.json")):
        subprocess.run([sys.executable, os.path.join(REPO_ROOT, "data", "prepare.py"), "--task", "synthetic",
                        "--output_dir", task, *SMALL_TASK], check=True, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
    failures = 0
    for i in range(args.runs):
        out = os.path.join(work, f"model_{i}")
        if args.script.startswith("probe"):
            os.makedirs(out, exist_ok=True)
            command = probe_command(args.script, work, i)
        else:
            command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                       os.path.join(REPO_ROOT, args.config), "--num_processes", "2", "--mixed_precision", "no",
                       os.path.join(REPO_ROOT, f"{args.script}.py"),
                       *script_flags(args.script, task, os.path.join(work, f"run_{i}")), "--checkpoint_every", "0",
                       "--output_dir", out, "--run_dir_root", os.path.join(work, "runs"), "--run_name", f"run_{i}",
                       "--seed", str(i + 1)]
        start = time.monotonic()
        result = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=900)
        saved = os.path.exists(os.path.join(out, "model.safetensors"))
        abort = next((line for line in result.stderr.splitlines() if "terminate called" in line), "")
        failures += result.returncode != 0
        print(f"run {i + 1}/{args.runs}: exit {result.returncode}, {time.monotonic() - start:.0f} s, "
              f"model saved {saved}{', ' + abort if abort else ''}", flush=True)
        if result.returncode != 0:  # the whole output of a failed run, to read (PYTHONFAULTHANDLER=1: the stacks)
            open(os.path.join(work, f"run_{i}.stderr"), "w").write(result.stderr)
        if result.returncode != 0 and not abort:  # another failure: the script's own error lines
            print("\n".join(line for line in result.stderr.splitlines() if "error" in line.lower())[-2000:], flush=True)
    how = "torchrun" if args.script.startswith("probe") else args.config
    print(f"{args.script}.py under {how}, 2 processes: {failures} failed exits in {args.runs} runs")


if __name__ == "__main__":
    main()
