"""Where a trainer's time goes: one run of a script under cProfile and one under torch's FLOP counter, and this
machine's matmul rate for comparison.

    python tools/profile_trainer.py --out artifacts/profile/reward -- reward.py --sft_model_path ... (the script's flags)

It runs the script (the part after `--`, exactly as a user types it; `{mode}` in it becomes plain, cprofile or
flops, so that each run can have its own --run_name) three times, each in a fresh process:
  1. plainly, for its wall time;
  2. under cProfile, for the share of that time spent in the transformer's forward passes (GPTNeoXModel.forward and
     what it calls, wherever it is called from, including generation), in backward, in the optimizer step and in
     generation (which holds forward passes of its own, so the shares overlap there);
  3. under torch.utils.flop_counter.FlopCounterMode, for the matmul FLOPs of every forward and backward pass.
Then it times torch.mm on this machine at the model's own shapes (tokens x hidden by hidden x 4 hidden) and at a
large square, and writes profile.md and profile.json to --out: the shares, the FLOPs, the FLOP rate of the model
calls (FLOPs / the plain run's wall time x the share of forward + backward) against the measured matmul rates.
cProfile slows Python-heavy code more than kernels, so its shares lean towards Python overhead: read them as where
the time goes, not as exact fractions.

This file is glue, not an algorithm: it runs the scripts, which never import it.
"""

from __future__ import annotations

import cProfile
import inspect
import json
import os
import pstats
import runpy
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import List

import tyro

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Args:
    out: str = "artifacts/profile"
    """where profile.md, profile.json and the raw cProfile stats go"""
    threads: int = 0
    """torch threads of every run (OMP_NUM_THREADS); 0 = all cores of this machine"""
    mode: str = "all"
    """all = the three runs and the report; plain / cprofile / flops = one run in this process (used by `all`)"""


def run_script(argv: List[str]) -> None:
    """Run a top-level script as `python <argv>` would, in this process."""
    script = os.path.join(REPO_ROOT, argv[0]) if not os.path.isabs(argv[0]) else argv[0]
    sys.argv = [script] + argv[1:]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            raise


def cumulative(stats: pstats.Stats, function) -> float:
    """Cumulative seconds of one Python function (all its calls, recursion counted once)."""
    code = function.__code__
    for (filename, line, name), (_, _, _, ct, _) in stats.stats.items():
        if name == code.co_name and line == code.co_firstlineno and os.path.samefile(filename, code.co_filename):
            return ct
    return 0.0


def time_shares(prof_path: str, wall: float) -> dict:
    import torch
    from transformers.generation.utils import GenerationMixin
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXModel

    stats = pstats.Stats(prof_path)
    total = max(v[3] for v in stats.stats.values())  # the outermost call: the whole script
    parts = {
        "transformer forward passes": cumulative(stats, GPTNeoXModel.forward),
        "backward": cumulative(stats, torch.autograd.backward),
        "optimizer step": cumulative(stats, torch.optim.AdamW.step) + cumulative(stats, torch.optim.Adam.step),
        "generation (holds forward passes)": cumulative(stats, inspect.unwrap(GenerationMixin.generate)),
    }
    return {"profiled_seconds": total, "plain_seconds": wall, "shares": {k: v / total for k, v in parts.items()}}


def matmul_rate(tokens: int, hidden: int, repeats: int = 20) -> float:
    """GFLOP/s of torch.mm (tokens, hidden) x (hidden, 4 hidden), float32, this process's threads."""
    import torch

    a, b = torch.randn(tokens, hidden), torch.randn(hidden, 4 * hidden)
    for _ in range(3):
        a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * tokens * hidden * 4 * hidden * repeats / (time.perf_counter() - start) / 1e9


def child(mode: str, out: str, argv: List[str]) -> None:
    os.makedirs(out, exist_ok=True)
    if mode == "plain":
        start = time.perf_counter()
        run_script(argv)
        json.dump({"wall": time.perf_counter() - start}, open(os.path.join(out, "plain.json"), "w"))
    elif mode == "cprofile":
        profiler = cProfile.Profile()
        profiler.runcall(run_script, argv)
        profiler.dump_stats(os.path.join(out, "cprofile.stats"))
    elif mode == "flops":
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            run_script(argv)
        json.dump({"flops": counter.get_total_flops()}, open(os.path.join(out, "flops.json"), "w"))
    else:
        raise ValueError(f"unknown --mode {mode!r}")


def main(args: Args, argv: List[str]) -> None:
    if not argv:
        raise SystemExit("give the script and its flags after `--`, e.g. -- reward.py --sft_model_path ...")
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    for mode in ("plain", "cprofile", "flops"):
        print(f"[profile] {mode} run of {' '.join(argv)}", flush=True)
        script_argv = [arg.replace("{mode}", mode) for arg in argv]  # e.g. --run_name prof_{mode}: a folder per run
        command = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--out", args.out, "--", *script_argv]
        subprocess.run(command, cwd=REPO_ROOT, env=env, check=True)
    wall = json.load(open(os.path.join(args.out, "plain.json")))["wall"]
    flops = json.load(open(os.path.join(args.out, "flops.json")))["flops"]
    report = time_shares(os.path.join(args.out, "cprofile.stats"), wall)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    model_share = report["shares"]["transformer forward passes"] + report["shares"]["backward"]
    report.update(
        script=" ".join(argv), flops=flops, threads=torch.get_num_threads(),
        achieved_gflops=flops / max(wall * model_share, 1e-9) / 1e9,
        matmul_gflops_model_shape=matmul_rate(4096, 128), matmul_gflops_large=matmul_rate(2048, 1024),
    )
    lines = [
        f"`{report['script']}` ({report['threads']} threads): {wall:.1f} s plain, {report['profiled_seconds']:.1f} s "
        "under cProfile", "", "| where the time goes (share of the profiled run) | share |", "| --- | --- |",
        *[f"| {name} | {share:.0%} |" for name, share in report["shares"].items()], "",
        f"Matmul FLOPs of the run: {flops / 1e9:.1f} GFLOP; over the plain run's time in forward + backward "
        f"({model_share:.0%} of {wall:.1f} s): **{report['achieved_gflops']:.1f} GFLOP/s**, against torch.mm on this "
        f"machine: {report['matmul_gflops_model_shape']:.1f} GFLOP/s at (4096 x 128) x (128 x 512), "
        f"{report['matmul_gflops_large']:.1f} GFLOP/s at (2048 x 1024) x (1024 x 4096).",
    ]
    open(os.path.join(args.out, "profile.md"), "w").write("\n".join(lines) + "\n")
    json.dump(report, open(os.path.join(args.out, "profile.json"), "w"), indent=2)
    print("\n".join(lines))


if __name__ == "__main__":
    split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    own, script_argv = sys.argv[1:split], sys.argv[split + 1 :]
    parsed = tyro.cli(Args, args=own)
    if parsed.mode == "all":
        main(parsed, script_argv)
    else:
        child(parsed.mode, parsed.out, script_argv)
