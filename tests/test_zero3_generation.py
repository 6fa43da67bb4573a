"""ZeRO-3 on 2 processes on the CPU (issue 52, items 1 and 2), with the README's `accelerate launch --config_file
zero3.yaml` and only its hardware lines overridden, on DeepSpeed's CPU accelerator (its gathers, hooks and offload
run there as on GPUs). tests/zero3_rollout_probe.py runs ppo.py's main() and records its first rollout.

- --gather_for_generation (the default) gathers the policy's and critic's partitions once for the rollout instead of
  every layer at every decode step: the same sampled tokens and log-probabilities (bit for bit) as with it off, with
  far fewer all-gathers and less time.
- --offload: the frozen reference and reward model are partitioned by a ZeRO-3 Init whose partitions live on
  DeepSpeed's CPU offload device, the setting their engines' config asks for (before: the launch's zero3_init_flag
  partitioned them onto the accelerator inside from_pretrained, and the engine's offload_param never applied)."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import ENV, free_port
from test_multiprocess import ppo_flags, with_flag

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(REPO_ROOT, "tests", "zero3_rollout_probe.py")


def zero3_rollouts(task: dict, tmp_path) -> list:
    """Each rank's record (tests/zero3_rollout_probe.py) of the first rollout of a 2-process ZeRO-3 ppo.py run with
    --offload, made gathered and per layer from the same random state."""
    flags = with_flag(with_flag(ppo_flags(task), "--total_episodes", "8"), "--local_rollout_forward_batch_size", "2")
    command = [sys.executable, "-m", "accelerate.commands.launch",
               "--config_file", os.path.join(REPO_ROOT, "zero3.yaml"),
               "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(free_port()), PROBE,
               str(tmp_path / "probe"), "--", *flags, "--offload", "--output_dir", str(tmp_path / "model"),
               "--run_dir_root", str(tmp_path / "runs"), "--run_name", "zero3", "--checkpoint_every", "0"]
    result = subprocess.run(command, cwd=REPO_ROOT, env={**ENV, "DS_ACCELERATOR": "cpu"}, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return [torch.load(tmp_path / "probe" / f"rank{rank}.pt") for rank in range(2)]


@pytest.mark.slow
def test_zero3_generation_gathers_once_with_the_same_samples_and_offloads_the_frozen_models(synthetic_task, tmp_path):
    ranks = zero3_rollouts(synthetic_task, tmp_path)
    for rank, record in enumerate(ranks):
        gathered, per_layer = record["gathered"], record["per_layer"]
        for name in ("tokens", "logprobs", "ref_logprobs", "values"):
            assert torch.equal(gathered[name], per_layer[name]), f"rank {rank}: {name} differ"
        print(f"rank {rank}: all-gathers {per_layer['all_gathers']} -> {gathered['all_gathers']}, rollout "
              f"{per_layer['seconds']:.2f} s -> {gathered['seconds']:.2f} s")  # shown with pytest -s or -rP
        # the frozen engines fetch their layers either way; the policy and critic only once instead of at each step
        assert gathered["all_gathers"] < per_layer["all_gathers"] / 2, (per_layer["all_gathers"],
                                                                        gathered["all_gathers"])
        assert gathered["seconds"] < per_layer["seconds"], (per_layer["seconds"], gathered["seconds"])
        assert record["frozen_offloaded"] and all(record["frozen_offloaded"]), record["frozen_offloaded"]
    assert not torch.equal(ranks[0]["gathered"]["tokens"], ranks[1]["gathered"]["tokens"])  # each rank: its own queries
