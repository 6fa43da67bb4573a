"""Run ppo.py's main() unchanged (in each process of `accelerate launch --config_file zero3.yaml`) up to its first
rollout, which it runs twice from the same random state: with --gather_for_generation as given, then with it off;
then record, per rank, what tests/test_zero3_generation.py compares, and leave (no update, evaluation or save):

- of each of the two rollouts: the sampled tokens, the policy's and the reference's log-probabilities, the critic's
  values, the number of all-gathers DeepSpeed's communication backend made during it (ZeRO-3 fetching partitioned
  weights: every all-gather of ZeRO-3 goes through deepspeed.comm's backend) and its wall time. The gathered one runs
  first, so that what a first call costs (allocations, caches) counts against it;
- of every weight of the frozen models (reference, reward model) as the script placed them: whether the ZeRO-3 Init
  that partitioned it was told to keep the partitions on DeepSpeed's CPU offload device (its remote device is the
  offload setting "cpu", not its local device: on DeepSpeed's CPU accelerator the local device is the CPU too, hence
  the check of the setting, not of a tensor's device).

    DS_ACCELERATOR=cpu accelerate launch --config_file zero3.yaml --num_processes 2 --mixed_precision no \
        tests/zero3_rollout_probe.py OUT_DIR -- (ppo.py's flags)

Writes OUT_DIR/rank{R}.pt = {"gathered": {...}, "per_layer": {...}, "frozen_offloaded": [bool per weight]}."""

import dataclasses
import importlib.util
import os
import sys
import time

import torch
import tyro

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
out_dir, argv = sys.argv[1], sys.argv[3:] if sys.argv[2:3] == ["--"] else sys.argv[2:]
sys.path.insert(0, REPO_ROOT)  # the scripts import rlhf_utils from the repository root
spec = importlib.util.spec_from_file_location("ppo", os.path.join(REPO_ROOT, "ppo.py"))
ppo = importlib.util.module_from_spec(spec)
sys.modules["ppo"] = ppo  # tyro reads the docstrings of nested dataclasses through the module
spec.loader.exec_module(ppo)
from rlhf_utils import models  # noqa: E402  (on sys.path above; ppo.py places its frozen models with it)
from rlhf_utils import run as run_module  # noqa: E402

record = {}


def partitions_offloaded(model) -> list:
    """Per weight: whether the ZeRO-3 Init that partitioned it (the owner its partition() closes over) offloads to
    the CPU."""
    import deepspeed
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    def owner(param):
        return next(c.cell_contents for c in param.partition.__closure__
                    if isinstance(c.cell_contents, deepspeed.zero.Init))

    return [owner(p).remote_device is not owner(p).local_device and owner(p).remote_device == OffloadDeviceEnum.cpu
            for p in model.parameters()]


original_place, original_rollout = models.place_frozen_models, ppo.rollout


def recording_place(args, accelerator, reward_models, ref_policy, zero3):
    reward_models, ref_policy, bring_frozen_to = original_place(args, accelerator, reward_models, ref_policy, zero3)
    record["frozen_offloaded"] = [flag for m in (*reward_models, ref_policy) for flag in partitions_offloaded(m)]
    return reward_models, ref_policy, bring_frozen_to


def recorded_rollout(args, *rest, **kwargs) -> dict:
    from deepspeed.comm import comm

    backend, names, calls = comm.cdb, ("all_gather", "all_gather_into_tensor", "all_gather_base",
                                       "all_gather_coalesced"), []

    def counted(name, function):
        def call(*a, **k):
            calls.append(name)
            return function(*a, **k)
        return call

    kept = {name: getattr(backend, name) for name in names}
    for name in names:
        setattr(backend, name, counted(name, kept[name]))
    torch.distributed.barrier()
    start = time.perf_counter()
    try:
        data = original_rollout(args, *rest, **kwargs)
    finally:
        for name in names:
            setattr(backend, name, kept[name])
    return {"seconds": time.perf_counter() - start, "all_gathers": len(calls), "tokens": data.query_responses.cpu(),
            "logprobs": data.logprobs.cpu(), "ref_logprobs": data.ref_logprobs.cpu(), "values": data.values.cpu()}


def recording_rollout(args, *rest, **kwargs):
    rng = torch.get_rng_state()  # sampling draws from torch's CPU generator (DeepSpeed's CPU accelerator)
    record["gathered"] = recorded_rollout(args, *rest, **kwargs)
    torch.set_rng_state(rng)
    record["per_layer"] = recorded_rollout(dataclasses.replace(args, gather_for_generation=False), *rest, **kwargs)
    os.makedirs(out_dir, exist_ok=True)
    torch.save(record, os.path.join(out_dir, f"rank{int(os.environ.get('RANK', '0'))}.pt"))
    # leave together, without the rest of the run (rlhf_utils.run's leave_processes, as the scripts leave after main())
    torch.distributed.barrier()
    run_module.leave_processes()


models.place_frozen_models, ppo.rollout = recording_place, recording_rollout
ppo.main(tyro.cli(ppo.Args, args=argv, use_underscores=True))  # as ppo.py parses its flags
raise SystemExit("ppo.py ended without a rollout")
