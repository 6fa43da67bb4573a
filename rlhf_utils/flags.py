"""The flags of a run that decide no number, shared by every training script, and the PPO family's refusals.

  RunFlags      one group of flags that every training script's Args takes in (`run: RunFlags`), shown in --help
                as "run options" under their own flat names (--resume, --run_name; tyro.conf.OmitArgPrefixes): the
                run's name and folder, its checkpoints and --resume, the lock, the process group's timeout,
                tracking and the hub. args.json and a checkpoint's flags record them flat, as before the group
                (rlhf_utils/run.py: flag_values), and every one is in FREE_FLAGS: a --resume may change it
  check_flags   the PPO family's (ppo.py, rloo.py, grpo.py, reinforce_pp.py) flag combinations that cannot work,
                refused before anything loads, and its --reward_fn function loaded
  EndpointFlags online_dpo.py's --endpoint.* flags of the judge's client (where and how a reply is fetched: URL,
                concurrency, retries, backoff, timeout, rate-limit patience, the reply cache's file)
  check_online_dpo_flags  online_dpo.py's flag combinations that cannot work, and --judge endpoint's API key

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


# ----------------------------------------------------------------------------------------------------------------------
# online_dpo.py
# ----------------------------------------------------------------------------------------------------------------------
@dataclass
class EndpointFlags:
    """online_dpo.py --judge endpoint: how the judge's client reaches the endpoint (where, how many requests at once,
    retries, backoff, timeouts, rate limits, the reply cache's file). online_dpo.py's EndpointArgs takes them in (as
    its base class, so they stay --endpoint.base_url ... and args.json's endpoint group is as before) beside the flags
    that decide a verdict (the judge model, its prompt and temperature, the re-asks, the EOS spelling). Every one is in
    FREE_FLAGS (rlhf_utils/run.py): how a reply is fetched, not what it says. Here, not in rlhf_utils/judge_client.py:
    that module loads openai, which a run of --judge rm never does."""

    base_url: Optional[str] = None
    """the endpoint's /v1 root, e.g. the built-in gold judge's; None -> the openai default"""
    max_parallel_requests: int = 8
    """requests in flight at once"""
    max_tries: int = 6
    """tries per request on 5xx, timeouts and connection errors (then the pair is invalid and dropped); a 429 uses up
    none (--endpoint.rate_limit_patience)"""
    rate_limit_patience: float = 600.0
    """seconds a rate limit (HTTP 429) is waited out: the judge waits as the API asks (Retry-After,
    x-ratelimit-reset-*), with fewer requests in flight, using up no --max_tries, and stops with one error once the API
    has limited this long with no answer (the replies so far stay in the cache, a rerun asks the rest). 600: many times
    a per-minute limit's window, yet a quota spent for the day stops the run in 10 minutes instead of hanging it"""
    backoff_base_s: float = 1.0
    """first retry waits about this long; each further retry doubles it (with jitter)"""
    backoff_max_s: float = 60.0
    """upper bound on one backoff wait"""
    timeout_s: float = 120.0
    """per-request timeout of the client"""
    cache_path: Optional[str] = None
    """sqlite file caching every reply (judge.py's cache); None -> runs/{run_name}/judge_cache.sqlite, so a resumed
    run asks nothing twice"""


def check_online_dpo_flags(args) -> None:
    """online_dpo.py's flag combinations that cannot work, refused before anything loads (--pairs_per_round has its
    default by now): a sampling temperature of 0, no prompt batch per round, --reference last_round with rounds of one
    update; with --judge endpoint, a key to send (OPENAI_API_KEY, or none to a loopback URL)."""
    if args.temperature <= 0:
        raise RunError(f"--temperature must be > 0: at 0 both responses to a prompt are the same (got "
                       f"{args.temperature})")
    if args.max_draws_per_round < 1:
        raise RunError("--max_draws_per_round must be >= 1 (1 = never replace a dropped pair), got "
                       f"{args.max_draws_per_round}")
    if args.reference == "last_round" and args.pairs_per_round <= args.total_batch_size:  # a round of one update
        raise RunError(f"--reference last_round with --pairs_per_round {args.pairs_per_round} (one update per round) "
                       "makes the reference the policy of that very update: every loss starts at log 2 and nothing "
                       "holds the policy near a reference; pass --pairs_per_round of several updates (e.g. 4 x "
                       "--total_batch_size)")
    if args.judge == "endpoint":
        from rlhf_utils.judge_client import resolve_api_key  # the judge's client (it loads openai), for it alone

        resolve_api_key(args.endpoint.base_url)  # raises when OPENAI_API_KEY is unset; the key itself is not kept
