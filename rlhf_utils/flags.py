"""The flags of a run that decide no number, shared by every training script, and the PPO family's refusals.

  RunFlags      one group of flags that every training script's Args takes in (`run: RunFlags`), shown in --help
                as "run options" under their own flat names (--resume, --run_name; tyro.conf.OmitArgPrefixes): the
                run's name and folder, its checkpoints and --resume, the lock, the process group's timeout,
                tracking and the hub. args.json and a checkpoint's flags record them flat, as before the group
                (rlhf_utils/run.py: flag_values), and every one is in FREE_FLAGS: a --resume may change it
  check_flags   the PPO family's (ppo.py, rloo.py, grpo.py, reinforce_pp.py) flag combinations that cannot work,
                refused before anything loads, and its --reward_fn function loaded

What it never does: hold a flag that changes a number a run computes. Each script keeps those in its own Args (the
seed, every batch size, the models, sampling, the algorithm's group), beside its exp_name and output_dir, whose
defaults are the script's own.
"""

from dataclasses import dataclass
from typing import Optional

from rlhf_utils.rewards import reward_fn_of
from rlhf_utils.run import RunError, check_gradient_accumulation, check_qlora_flags


@dataclass
class RunFlags:
    """The run's name and folder, checkpoints and --resume, the lock, tracking and the hub: they decide no number."""

    run_name: Optional[str] = None
    """None -> {exp_name}__{seed}__{unix time}; outputs go to {run_dir_root}/{run_name}"""
    run_dir_root: str = "runs"
    """root folder of run outputs (args.json, metrics.jsonl, TensorBoard, sample tables, summary.json)"""
    overwrite_output_dir: bool = False
    """allow --output_dir to hold another run's model (it is replaced at the end); off: such a folder is an error"""
    checkpoint_every: int = 100
    """save a resumable checkpoint (model, optimizer, schedule, data position, RNG states) to
    runs/{run_name}/checkpoints every this many updates (0 = never)"""
    checkpoint_keep: int = 1
    """how many of the newest checkpoints to keep"""
    resume: bool = False
    """continue from the latest checkpoint of --run_name (None: the newest runs/{exp_name}__{seed}__* that has one);
    the resumed run ends with the same weights and metrics as one that was never interrupted"""
    restart: bool = False
    """delete the checkpoints of --run_name and start over (without it, a run folder that holds checkpoints is
    refused: --resume continues it)"""
    accept_changed_inputs: bool = False
    """--resume although a data or model folder this run reads has other contents than the checkpoint recorded"""
    accept_changed_flags: bool = False
    """--resume although a flag that decides numbers differs from the checkpoint's: the new value applies from the next
    update (a new --lr continues the schedule at the same step from the new base) and args.json records both"""
    take_over_lock: bool = False
    """take over runs/<run_name>/run.lock when its holder cannot be checked (another host, e.g. a restarted container)"""
    process_group_timeout_min: float = 60.0
    """minutes a process waits in a collective (a barrier, a gather) for the others before the run stops with a
    timeout error (60: several times the longest lone wait of the main process; NCCL's and DeepSpeed's own: 10)"""
    track: bool = False
    """log to Weights & Biases (it mirrors TensorBoard)"""
    wandb_project_name: str = "tldr_summarize"
    """the W&B project (with --track)"""
    wandb_entity: Optional[str] = None
    """the W&B entity (team); None = your default entity"""
    push_to_hub: bool = False
    """upload the trained model and its tokenizer (--output_dir) to the Hugging Face hub"""
    hub_model_id: Optional[str] = None
    """hub repository id for --push_to_hub; None -> the run name (offline_rl.py: {sft model}__{exp_name}__{method}__{seed})"""


def check_flags(args, accelerator, num_mini_batches: int, gradient_accumulation_steps: int, num_updates: int,
                zero3: bool):
    """Flag combinations that cannot work, refused before anything is loaded. Returns the --reward_fn function (None
    without the flag), loaded here: a missing file or function name stops the run before any model loads."""
    check_gradient_accumulation(args, gradient_accumulation_steps, accelerator.num_processes, num_mini_batches)
    check_qlora_flags(args, accelerator)
    if num_updates < 1:
        raise RunError(f"total_episodes {args.total_episodes} is less than one batch of {args.total_batch_size}")
    # the scorers, each reward model and then the --reward_fn function: at least one, --reward_weights one each
    reward_fn = reward_fn_of(args)  # (rlhf_utils/rewards.py)
    if args.lora_rank > 0 and args.num_layers_unfrozen >= 0:
        raise RunError("choose one of --lora_rank and --num_layers_unfrozen (each builds its own reference)")
    if args.offload and args.num_layers_unfrozen >= 0:
        raise RunError("--offload cannot move a Hydra reference: it shares its trunk with the policy")
    if zero3 and args.num_layers_unfrozen >= 0:
        raise RunError("Hydra shares modules between policy and reference, which ZeRO-3 cannot partition")
    return reward_fn
