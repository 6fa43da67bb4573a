"""The DeepSpeed configs the README points to parse with accelerate's own loader and say what we claim.
The ZeRO-2 / ZeRO-3 runs themselves (2 CPU processes, these files with only the hardware lines overridden on the
command line, and bf16 once per script) are in tests/test_multiprocess.py."""

import os

import pytest
from accelerate.commands.config.config_args import load_config_from_file

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name, stage", [("zero2.yaml", 2), ("zero3.yaml", 3)])
def test_deepspeed_configs(name, stage):
    config = load_config_from_file(os.path.join(REPO_ROOT, name))
    assert config.distributed_type.value == "DEEPSPEED"
    assert config.mixed_precision == "bf16"
    assert config.num_processes == 8  # the paper's 8 GPUs
    assert config.deepspeed_config["zero_stage"] == stage
    assert config.deepspeed_config["zero3_init_flag"] == (stage == 3)
