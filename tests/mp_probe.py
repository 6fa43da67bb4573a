"""Run one top-level script's main() (in this process, or in each process of `torchrun`) and record, per
rank, what the multi-process tests compare: the final weights of every module the script passed to
accelerator.prepare, and the seed of the process's global torch RNG after main() returned.

    python tests/mp_probe.py sft OUT_DIR -- --base_model ... (the script's own flags)
    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 tests/mp_probe.py sft OUT_DIR -- ...
    DS_ACCELERATOR=cpu accelerate launch --config_file zero3.yaml --num_processes 2 --mixed_precision no \
        tests/mp_probe.py sft OUT_DIR -- ...

Writes OUT_DIR/rank{R}.pt = {"weights": {name: tensor}, "initial_seed": int, "world_size": int, "engines": [class
name of each prepared module], "checkpointing": [its modules marked for activation checkpointing], "zero_stage":
DeepSpeed's ZeRO stage or None}. Under ZeRO-3 only rank 0 holds weights.
The script runs unchanged: the probe only wraps Accelerator.prepare to keep a handle on its modules."""

import importlib.util
import os
import sys

import torch
import tyro
from accelerate import Accelerator

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
script, out_dir = sys.argv[1], sys.argv[2]
argv = sys.argv[4:] if len(sys.argv) > 3 and sys.argv[3] == "--" else sys.argv[3:]
sys.path.insert(0, REPO_ROOT)  # the scripts import rlhf_utils from the repository root
spec = importlib.util.spec_from_file_location(script, os.path.join(REPO_ROOT, f"{script}.py"))
module = importlib.util.module_from_spec(spec)
sys.modules[script] = module  # tyro reads the docstrings of nested dataclasses through the module
spec.loader.exec_module(module)

prepared = []
original_prepare = Accelerator.prepare


def recording_prepare(self, *objects, **kwargs):
    result = original_prepare(self, *objects, **kwargs)
    for obj in result if isinstance(result, tuple) else (result,):
        if isinstance(obj, torch.nn.Module):
            prepared.append((self, obj))
    return result


Accelerator.prepare = recording_prepare
module.main(tyro.cli(module.Args, args=argv, use_underscores=True))  # as the scripts parse their flags

weights, engines, checkpointing = {}, [], []
for i, (accelerator, obj) in enumerate(prepared):
    engines.append(type(obj).__name__)  # DeepSpeedEngine under DeepSpeed, DistributedDataParallel under torchrun
    # modules that rerun in the backward pass (--gradient_checkpointing: transformers marks each decoder layer)
    checkpointing.append(sum(getattr(module, "gradient_checkpointing", False) is True for module in obj.modules()))
    # get_state_dict gathers ZeRO-3's partitions (every rank takes part; only rank 0 receives them)
    state_dict = accelerator.get_state_dict(obj)
    for name, tensor in (state_dict or {}).items():
        weights[f"{i}.{name}"] = tensor.detach().cpu().clone()
plugin = prepared[0][0].state.deepspeed_plugin if prepared else None
rank = int(os.environ.get("RANK", "0"))
os.makedirs(out_dir, exist_ok=True)
torch.save({"weights": weights, "initial_seed": torch.initial_seed(),
            "world_size": int(os.environ.get("WORLD_SIZE", "1")), "engines": engines, "checkpointing": checkpointing,
            "zero_stage": plugin.zero_stage if plugin is not None else None},
           os.path.join(out_dir, f"rank{rank}.pt"))
# leave together, once every rank's record is written, the way the scripts leave after main() (rlhf_utils.run's
# leave_processes: the exit handlers, then no interpreter teardown, where a ZeRO-3 rank could abort)
if torch.distributed.is_initialized():
    torch.distributed.barrier()
from rlhf_utils import run as run_module  # noqa: E402  (on sys.path above)

run_module.leave_processes()
