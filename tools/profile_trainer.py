"""Where a trainer's time goes: one run of a script under cProfile and one under torch's FLOP counter, and this
machine's matmul rate for comparison.

    python tools/profile_trainer.py --out artifacts/profile/reward -- reward.py --sft_model_path ...
                                                                      (the script's flags)

It runs the script (the part after `--`, exactly as a user types it; `{mode}` in it becomes plain, cprofile or
flops, so that each run can have its own --run_name) three times, each in a fresh process:
  1. plainly, for its wall time;
  2. under cProfile, for the share of that time spent in the transformer's forward passes (GPTNeoXModel.forward and
     what it calls, wherever it is called from, including generation), in backward, in the optimizer step and in
     generation (which holds forward passes of its own, so the shares overlap there);
  3. under torch.utils.flop_counter.FlopCounterMode, for the matmul FLOPs of every forward and backward pass, split
     (FlopAccounting below) into the transformer body, the output layer and the rest, with the token positions the
     body computed (and how many of them held a real token) and the rows the output layer computed (and how many of
     them the loss read): from these, the FLOPs the run would need without padding and unread rows.
Then it times torch.mm on this machine at the model's own shapes (tokens x hidden by hidden x 4 hidden) and at a
large square, and writes profile.md and profile.json to --out: the shares, the FLOPs, the FLOP rate of the model
calls (FLOPs / the plain run's wall time x the share of forward + backward) against the measured matmul rates.
cProfile slows Python-heavy code more than kernels, so its shares lean towards Python overhead: read them as where
the time goes, not as exact fractions. At a large model the cProfile run can take very long: --no-cprofile skips it
(the report then has no shares, and its FLOP rate is over the whole plain run).

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

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Args:
    out: str = "artifacts/profile"
    """where profile.md, profile.json and the raw cProfile stats go"""
    threads: int = 0
    """torch threads of every run (OMP_NUM_THREADS); 0 = all cores of this machine"""
    mode: str = "all"
    """all = the three runs and the report; plain / cprofile / flops = one run in this process (used by `all`)"""
    cprofile: bool = True
    """run the cProfile pass (--no-cprofile skips it: no time shares, the FLOP rate is over the whole plain run)"""
    python: str = sys.executable
    """the Python of the three runs: this one, or another environment's with torch and transformers, e.g. the TRL
    environment tools/bench_trl.py made, to profile TRL's trainer the same way: `--python <venv>/bin/python --
    tools/bench_trl.py --_trl <a spec.json of its work folder>` (that environment needs no tyro)"""


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


def same_source(filename: str, other: str) -> bool:
    """Whether a profiled file is `other`, this environment's copy of it: the same file, or the same path inside
    site-packages (a run in another environment with the same releases, --python)."""
    if os.path.exists(filename) and os.path.samefile(filename, other):
        return True
    inside = os.sep + "site-packages" + os.sep
    return inside in filename and inside in other and filename.split(inside)[-1] == other.split(inside)[-1]


def cumulative(stats: pstats.Stats, function) -> float:
    """Cumulative seconds of one Python function (all its calls, recursion counted once)."""
    code = function.__code__
    for (filename, line, name), (_, _, _, ct, _) in stats.stats.items():
        if name == code.co_name and line == code.co_firstlineno and same_source(filename, code.co_filename):
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


def phases(stats: pstats.Stats, script: str) -> List[tuple]:
    """A run's fixed costs and work, phase by phase, from its cProfile stats: the script's module body before main()
    (its imports), each function main() calls directly (the cumulative seconds of its calls from main, all calls of
    one function together; those under 1 % of main's time in one row), and main's own lines; longest first.
    [(phase, seconds)]."""
    own = {key: value for key, value in stats.stats.items()
           if os.path.exists(key[0]) and os.path.samefile(key[0], script)}
    main_key = next((key for key in own if key[2] == "main"), None)
    module_key = next((key for key in own if key[2] == "<module>"), None)
    if main_key is None or module_key is None:
        return []
    main_total = stats.stats[main_key][3]
    def name(key) -> str:
        if key[2] == "decorate_context":  # torch.no_grad's wrapper: name the script's functions it wraps
            wrapped = sorted({k[2] for k, (*_, callers) in own.items() if key in callers})
            return f"{os.path.basename(script)}:{' / '.join(wrapped)} (under torch.no_grad)"
        return f"{os.path.basename(key[0])}:{key[2]}" if key[0] != "~" else key[2]

    called = [(name(key), callers[main_key][3]) for key, (*_, callers) in stats.stats.items() if main_key in callers]
    called.sort(key=lambda item: -item[1])
    rest = main_total - sum(seconds for _, seconds in called)
    small = [seconds for _, seconds in called if seconds < 0.01 * main_total]  # folded into one row
    called = [item for item in called if item[1] >= 0.01 * main_total]
    called.append(("other calls of main() (each < 1 %)", sum(small)))
    return [("module body before main() (imports)", stats.stats[module_key][3] - main_total), *called,
            ("main()'s own lines", rest)]


class Call:
    """One forward call of a transformer body or an output layer, with the FLOPs of its forward and its backward.
    `computed`: the token positions (body) or rows (output layer) it ran on; `needed`: how many of them the run
    needed (body: real tokens; output layer: rows the loss read)."""

    __slots__ = ("role", "generating", "computed", "needed", "offered", "flops")

    def __init__(self, role: str, generating: bool, computed: int = 0, needed: int = 0, offered: int = 0):
        self.role, self.generating, self.flops = role, generating, 0
        self.computed, self.needed, self.offered = computed, needed, offered


def rows(tensor) -> int:
    """Rows of a (..., features) tensor: every position it holds."""
    return tensor.numel() // tensor.shape[-1] if tensor.dim() else 1


class FlopAccounting:
    """Splits the FLOPs a FlopCounterMode counts into the transformer body, the output layer and the rest.

    The body is a transformers model's base model (GPTNeoXModel: `model.base_model`, found through its
    base_model_prefix); the output layer is any other child of a transformers model that has weights (the LM head
    of a causal LM, the score head of a sequence-classification model). Every model built while it is installed is
    tagged in PreTrainedModel.post_init, so a body called on its own (as get_reward does) or a copy of a model
    (copy.deepcopy keeps hooks and tags) is counted as well. FLOPs go to the role of the call running: in forward the
    innermost tagged module; in backward the call whose output got its gradient last (the same trick as torch's
    ModuleTracker: a gradient hook on a call's outputs enters it, one on its inputs leaves it, and every backward ends
    outside all of them). The counter's running total is read at each of these transitions.

    Per body call it counts the positions computed (batch x new tokens, so one per row and step in cached
    generation) and the real ones among them (attention_mask true). Per output-layer call it counts the rows handed
    to it, the rows it computed (after the scripts' own forward pre-hook has picked the positions a loss reads) and
    the rows read: in a pass that is backpropagated, the rows whose output gets a nonzero gradient; in a pass that
    is not, every row computed. FLOPs inside GenerationMixin.generate are counted apart as well."""

    def __init__(self, counter):
        self.counter = counter
        self.last = 0  # the counter's total at the last transition
        self.forward: List[Call] = []  # calls whose forward is running, innermost last
        self.backward: List[Call] = []  # calls entered in the running backward, latest last
        self.calls: List[Call] = []  # calls with a backward that may still come: folded at the end
        self.totals = {role: dict.fromkeys(self.KEYS, 0) for role in ("body", "head")}  # the other calls, folded
        self.rest = [0, 0]  # FLOPs outside every call: [all, inside generate]
        self.generating = 0
        self.ending_backward = False
        self.signatures = {}
        self.hidden_sizes = set()  # of every model tagged: torch.mm is timed at the largest

    # ---- the transitions ----
    def mark(self) -> None:
        """Give the FLOPs counted since the last transition to whatever ran in between."""
        now = self.counter.get_total_flops()
        delta, self.last = now - self.last, now
        if not delta:
            return
        running = self.forward or self.backward
        if running:
            running[-1].flops += delta
        else:
            self.rest[0] += delta
            self.rest[1] += delta if self.generating else 0

    def _end_of_backward(self) -> None:
        self.mark()
        self.backward.clear()
        self.ending_backward = False

    def _enter_in_backward(self, call: Call):
        def enter(_grads) -> None:
            self.mark()
            self.backward.append(call)
            if not self.ending_backward:  # once per backward: leave every call when it ends
                import torch

                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
                self.ending_backward = True

        return enter

    def _leave_in_backward(self, call: Call):
        def leave(_grads) -> None:
            self.mark()
            if call in self.backward:
                self.backward.remove(call)

        return leave

    def _start(self, call: Call, inputs) -> None:
        from torch.autograd.graph import register_multi_grad_hook
        from torch.utils._pytree import tree_flatten

        self.mark()
        self.forward.append(call)
        needing_grad = [t for t in tree_flatten(inputs)[0] if getattr(t, "requires_grad", False)]
        if needing_grad:
            register_multi_grad_hook(needing_grad, self._leave_in_backward(call))

    def _finish(self, call: Call, output) -> None:
        from torch.autograd.graph import register_multi_grad_hook
        from torch.utils._pytree import tree_flatten

        self.mark()
        self.forward.remove(call)
        needing_grad = [t for t in tree_flatten(output)[0] if getattr(t, "requires_grad", False)]
        if needing_grad:
            register_multi_grad_hook(needing_grad, self._enter_in_backward(call))
            self.calls.append(call)
        else:  # no backward will add to it (generation, no-grad passes): fold it now, keep no record
            self._fold(call, self.totals)

    # ---- the hooks ----
    def _body_pre_hook(self, module, args, kwargs):
        import torch

        signature = self.signatures.get(type(module)) or self.signatures.setdefault(
            type(module), inspect.signature(module.forward))
        bound = signature.bind_partial(*args, **kwargs).arguments
        tokens = bound.get("input_ids")
        tokens = tokens if tokens is not None else bound.get("inputs_embeds")
        mask = bound.get("attention_mask")
        call = Call("body", self.generating > 0)
        if tokens is not None:
            batch, new = tokens.shape[0], tokens.shape[1] if tokens.dim() > 1 else 1
            call.computed = batch * new
            # the mask covers the cached positions too; the last `new` columns are the ones computed now
            is_2d = isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == batch
            call.needed = int(mask[:, -new:].bool().sum()) if is_2d else call.computed
        self._start(call, (args, kwargs))
        module._profile_calls.append(call)

    def _body_hook(self, module, args, kwargs, output):
        self._finish(module._profile_calls.pop(), output)

    def _head_pre_hook(self, module, args):
        call = Call("head", self.generating > 0, offered=rows(args[0]) if args else 0)
        self._start(call, args)
        module._profile_calls.append(call)

    def _head_hook(self, module, args, output):
        call = module._profile_calls.pop()
        # the args after every forward pre-hook: the rows the scripts' pick left, which the layer computed
        call.computed = call.needed = rows(args[0]) if args else call.offered
        if getattr(output, "requires_grad", False):

            def read(grad) -> None:
                call.needed = int((grad.reshape(-1, grad.shape[-1]) != 0).any(-1).sum())

            output.register_hook(read)
        self._finish(call, output)

    def tag(self, model) -> None:
        """Hook the body and the output layers of a transformers model (once each)."""
        body = model.base_model
        if getattr(model.config, "hidden_size", None):
            self.hidden_sizes.add(model.config.hidden_size)
        parts = [(body, "body")]
        if body is not model:  # a model with a head: its other children with weights are output layers
            parts += [(child, "head") for child in model.children()
                      if child is not body and any(True for _ in child.parameters())]
        for module, role in parts:
            if getattr(module, "_profile_role", None):
                continue
            module._profile_role, module._profile_calls = role, []
            # plain functions, not bound methods: copy.deepcopy shares a function but would copy a method's object
            if role == "body":
                module.register_forward_pre_hook(lambda m, a, k: self._body_pre_hook(m, a, k), with_kwargs=True)
                module.register_forward_hook(lambda m, a, k, o: self._body_hook(m, a, k, o), with_kwargs=True)
            else:
                module.register_forward_pre_hook(lambda m, a: self._head_pre_hook(m, a))
                module.register_forward_hook(lambda m, a, o: self._head_hook(m, a, o))

    def install(self) -> None:
        """Tag every transformers model built from now on, and count what runs inside generate apart."""
        import functools

        from transformers import PreTrainedModel
        from transformers.generation.utils import GenerationMixin

        post_init, generate = PreTrainedModel.post_init, GenerationMixin.generate

        @functools.wraps(post_init)
        def tagging_post_init(model, *args, **kwargs):
            result = post_init(model, *args, **kwargs)
            self.tag(model)
            return result

        @functools.wraps(generate)
        def counted_generate(*args, **kwargs):
            self.mark()
            self.generating += 1
            try:
                return generate(*args, **kwargs)
            finally:
                self.mark()
                self.generating -= 1

        PreTrainedModel.post_init, GenerationMixin.generate = tagging_post_init, counted_generate

    # ---- the result ----
    KEYS = ("flops", "flops_in_generation", "minimum_flops", "computed", "needed", "computed_in_generation",
            "needed_in_generation", "offered", "calls")

    def _fold(self, call: Call, into: dict) -> None:
        """Add a finished call to its role's totals; its FLOPs count at the share of its positions / rows needed."""
        part = into[call.role]
        minimum = call.flops * call.needed / call.computed if call.computed else 0
        for key, value in (("flops", call.flops), ("minimum_flops", minimum), ("computed", call.computed),
                           ("needed", call.needed), ("offered", call.offered), ("calls", 1)):
            part[key] += value
            if call.generating and key in ("flops", "computed", "needed"):
                part[f"{key}_in_generation"] += value

    def summary(self) -> dict:
        self.mark()
        parts = {role: dict(totals) for role, totals in self.totals.items()}
        for call in self.calls:  # the calls that were backpropagated (or could have been)
            self._fold(call, parts)
        parts["rest"] = {"flops": self.rest[0], "flops_in_generation": self.rest[1], "minimum_flops": self.rest[0]}
        total = {key: sum(parts[role][key] for role in parts) for key in ("flops", "flops_in_generation",
                                                                          "minimum_flops")}
        body, head = parts["body"], parts["head"]
        return {
            "body": {"flops": body["flops"], "flops_in_generation": body["flops_in_generation"],
                     "positions_computed": body["computed"], "positions_real": body["needed"],
                     "positions_computed_in_generation": body["computed_in_generation"],
                     "positions_real_in_generation": body["needed_in_generation"], "calls": body["calls"],
                     "minimum_flops": body["minimum_flops"]},
            "output_layer": {"flops": head["flops"], "flops_in_generation": head["flops_in_generation"],
                             "rows_offered": head["offered"], "rows_computed": head["computed"],
                             "rows_read": head["needed"], "rows_computed_in_generation": head["computed_in_generation"],
                             "calls": head["calls"], "minimum_flops": head["minimum_flops"]},
            "rest": parts["rest"],
            "total": total,
            "measured_over_minimum": total["flops"] / total["minimum_flops"] if total["minimum_flops"] else None,
            "hidden_size": max(self.hidden_sizes, default=None),
        }


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

        counter = FlopCounterMode(display=False)
        accounting = FlopAccounting(counter)
        accounting.install()
        with counter:
            run_script(argv)
            summary = accounting.summary()
        json.dump({"flops": counter.get_total_flops(), "accounting": summary},
                  open(os.path.join(out, "flops.json"), "w"), indent=2)
    else:
        raise ValueError(f"unknown --mode {mode!r}")


def accounting_lines(accounting: dict) -> List[str]:
    """profile.md's table of the FLOPs against the minimum (FlopAccounting.summary)."""
    body, head, rest, total = (accounting[k] for k in ("body", "output_layer", "rest", "total"))
    ratio = "-" if accounting["measured_over_minimum"] is None else f"{accounting['measured_over_minimum']:.2f}x"

    def gflop(flops: float) -> str:
        return f"{flops / 1e9:.3g}"

    def share(part: int, whole: int) -> str:
        return f"{part / whole:.0%}" if whole else "-"

    return [
        "| matmul FLOPs, forward + backward | GFLOP | of it in generate | positions / rows computed | needed of them "
        "| minimum GFLOP |", "| --- | --- | --- | --- | --- | --- |",
        f"| transformer body | {gflop(body['flops'])} | {gflop(body['flops_in_generation'])} "
        f"| {body['positions_computed']:,} positions | {body['positions_real']:,} real tokens "
        f"({share(body['positions_real'], body['positions_computed'])}) | {gflop(body['minimum_flops'])} |",
        f"| output layer (LM head, score head) | {gflop(head['flops'])} | {gflop(head['flops_in_generation'])} "
        f"| {head['rows_computed']:,} rows (of {head['rows_offered']:,} handed to it) | {head['rows_read']:,} read "
        f"({share(head['rows_read'], head['rows_computed'])}) | {gflop(head['minimum_flops'])} |",
        f"| rest | {gflop(rest['flops'])} | {gflop(rest['flops_in_generation'])} | | "
        f"| {gflop(rest['minimum_flops'])} |",
        f"| all | {gflop(total['flops'])} | {gflop(total['flops_in_generation'])} | | "
        f"| {gflop(total['minimum_flops'])} |", "",
        f"Measured / minimum: **{ratio}**. The minimum scales each body call's "
        "FLOPs by its real tokens (attention_mask true) over the positions it computed, and each output-layer call's "
        "by the rows read over the rows computed (read: a nonzero gradient in a backpropagated pass; every row in a "
        "pass without backward); the rest counts in full. Attention grows with the square of the length, so the "
        "body's scaling is approximate.",
    ]


def main(args: Args, argv: List[str]) -> None:
    if not argv:
        raise SystemExit("give the script and its flags after `--`, e.g. -- reward.py --sft_model_path ...")
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    modes = ("plain", "cprofile", "flops") if args.cprofile else ("plain", "flops")
    for mode in modes:
        print(f"[profile] {mode} run of {' '.join(argv)}", flush=True)
        script_argv = [arg.replace("{mode}", mode) for arg in argv]  # e.g. --run_name prof_{mode}: a folder per run
        command = [args.python, os.path.abspath(__file__), "--mode", mode, "--out", args.out, "--", *script_argv]
        subprocess.run(command, cwd=REPO_ROOT, env=env, check=True)
    wall = json.load(open(os.path.join(args.out, "plain.json")))["wall"]
    counted = json.load(open(os.path.join(args.out, "flops.json")))
    flops = counted["flops"]
    if args.cprofile:
        report = time_shares(os.path.join(args.out, "cprofile.stats"), wall)
        script = argv[0] if os.path.isabs(argv[0]) else os.path.join(REPO_ROOT, argv[0])
        report["phases"] = phases(pstats.Stats(os.path.join(args.out, "cprofile.stats")), script)
        model_share = report["shares"]["transformer forward passes"] + report["shares"]["backward"]
    else:  # no shares: the rate is over the whole plain run
        report, model_share = {"profiled_seconds": None, "plain_seconds": wall, "shares": None}, 1.0
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    hidden = counted["accounting"]["hidden_size"] or 128  # the models' hidden size (128 if none was tagged)
    report.update(
        script=" ".join(argv), flops=flops, threads=torch.get_num_threads(),
        achieved_gflops=flops / max(wall * model_share, 1e-9) / 1e9,
        matmul_gflops_model_shape=matmul_rate(4096, hidden), matmul_gflops_large=matmul_rate(2048, 1024),
        flop_accounting=counted["accounting"],
    )
    machine = (f"against torch.mm on this machine: {report['matmul_gflops_model_shape']:.1f} GFLOP/s at the model's "
               f"shape (4096 x {hidden}) x ({hidden} x {4 * hidden}), {report['matmul_gflops_large']:.1f} GFLOP/s at "
               f"(2048 x 1024) x (1024 x 4096).")
    if args.cprofile:
        lines = [
            f"`{report['script']}` ({report['threads']} threads): {wall:.1f} s plain, "
            f"{report['profiled_seconds']:.1f} s under cProfile", "",
            "| where the time goes (share of the profiled run) | share |", "| --- | --- |",
            *[f"| {name} | {share:.0%} |" for name, share in report["shares"].items()], "",
            f"Matmul FLOPs of the run: {flops / 1e9:.1f} GFLOP; over the plain run's time in forward + backward "
            f"({model_share:.0%} of {wall:.1f} s): **{report['achieved_gflops']:.1f} GFLOP/s**, {machine}", "",
            "| phase (under cProfile: the module body, then each call main() makes) | s | share |",
            "| --- | --- | --- |",
            *[f"| {name} | {seconds:.2f} | {seconds / report['profiled_seconds']:.0%} |"
              for name, seconds in report["phases"]],
        ]
    else:
        lines = [
            f"`{report['script']}` ({report['threads']} threads): {wall:.1f} s plain (no cProfile run)", "",
            f"Matmul FLOPs of the run: {flops / 1e9:.1f} GFLOP; over the whole plain run ({wall:.1f} s): "
            f"**{report['achieved_gflops']:.1f} GFLOP/s**, {machine}",
        ]
    lines += ["", *accounting_lines(report["flop_accounting"])]
    open(os.path.join(args.out, "profile.md"), "w").write("\n".join(lines) + "\n")
    json.dump(report, open(os.path.join(args.out, "profile.json"), "w"), indent=2)
    print("\n".join(lines))


if __name__ == "__main__":
    split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    own, script_argv = sys.argv[1:split], sys.argv[split + 1 :]
    if len(own) == 4 and own[0] == "--mode" and own[2] == "--out":  # one run, as main() starts it: maybe with --python
        child(own[1], own[3], script_argv)
    else:
        import tyro

        parsed = tyro.cli(Args, args=own, use_underscores=True)
        if parsed.mode == "all":
            main(parsed, script_argv)
        else:
            child(parsed.mode, parsed.out, script_argv)
