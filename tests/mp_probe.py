"""Run one top-level script's main() (in this process, or in each process of `torchrun`) and record, per
rank, what the multi-process tests compare: the final weights of every module the script passed to
accelerator.prepare, and the seed of the process's global torch RNG after main() returned.

    python tests/mp_probe.py sft OUT_DIR -- --base_model ... (the script's own flags)
    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 tests/mp_probe.py sft OUT_DIR -- ...

Writes OUT_DIR/rank{R}.pt = {"weights": {name: tensor}, "initial_seed": int, "world_size": int}.
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
module.main(tyro.cli(module.Args, args=argv))

weights = {}
for i, (accelerator, obj) in enumerate(prepared):
    for name, tensor in accelerator.unwrap_model(obj).state_dict().items():
        weights[f"{i}.{name}"] = tensor.detach().cpu().clone()
rank = int(os.environ.get("RANK", "0"))
os.makedirs(out_dir, exist_ok=True)
torch.save({"weights": weights, "initial_seed": torch.initial_seed(), "world_size": int(os.environ.get("WORLD_SIZE", "1"))},
           os.path.join(out_dir, f"rank{rank}.pt"))
