"""The flags of a run that decide no number, shared by the training scripts, and the refusals of flag combinations.

  RunFlags      one group of flags that every training script's Args takes in (`run: RunFlags`), shown in --help
                as "run options" under their own flat names (--resume, --run_name; tyro.conf.OmitArgPrefixes): the
                run's name and folder, its checkpoints and --resume, the lock, the process group's timeout,
                tracking and the hub. args.json and a checkpoint's flags record them flat, as before the group
                (rlhf_utils/run.py: flag_values), and every one is in FREE_FLAGS: a --resume may change it
  EndpointFlags online_dpo.py's --endpoint.* flags of the judge's client (where and how a reply is fetched: URL,
                concurrency, retries, backoff, timeout, rate-limit patience, the reply cache's file)
  refusals      flag combinations that cannot work, refused before anything loads: check_flags (the PPO family:
                ppo.py, rloo.py, grpo.py, reinforce_pp.py; it also loads the --reward_fn function),
                check_online_dpo_flags (and --judge endpoint's API key), check_groups (reinforce_pp.py; grpo.py's too,
                beside note_idle_ratio: a line at start, not a refusal), check_grpo_losses (grpo.py), check_kl_flags
                (reinforce_pp.py), check_ilql_flags, check_offline_flags and check_round_size (offline_rl.py)

What it never does: hold a flag that changes a number a run computes. Each script keeps those in its own Args (the
seed, every batch size, the models, sampling, the algorithm's group), beside its exp_name and output_dir, whose
defaults are the script's own; a refusal reads flags and raises, and changes none.
"""

from dataclasses import dataclass
from typing import Optional

from rlhf_utils.checks import RunError, check_gradient_accumulation, check_qlora_flags
from rlhf_utils.rewards import reward_fn_of


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
    """continue from the latest checkpoint of --run_name (None: the one runs/{exp_name}__{seed}__* that has one;
    several are refused, listed); the resumed run ends with the same weights and metrics as one never interrupted"""
    restart: bool = False
    """delete the checkpoints of --run_name and start over (without it, a run folder that holds checkpoints is
    refused: --resume continues it)"""
    accept_changed_inputs: bool = False
    """--resume although a data or model folder this run reads has other contents than the checkpoint recorded"""
    accept_changed_flags: bool = False
    """--resume although a flag that decides numbers differs from the checkpoint's: the new value applies from the next
    update (a new --lr continues the schedule at the same step from the new base) and args.json records both"""
    take_over_lock: bool = False
    """take over runs/<run_name>/run.lock when its holder cannot be checked (another host, e.g. a restarted
    container)"""
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
    """hub repository id for --push_to_hub; None -> the run name (offline_rl.py:
    {sft model}__{exp_name}__{method}__{seed})"""


def check_flags(args, accelerator, num_mini_batches: int, gradient_accumulation_steps: int, num_updates: int,
                zero3: bool):
    """Flag combinations that cannot work, refused before anything is loaded. Returns the --reward_fn function (None
    without the flag), loaded here: a missing file or function name stops the run before any model loads."""
    check_gradient_accumulation(args, gradient_accumulation_steps, accelerator.num_processes, num_mini_batches)
    check_qlora_flags(args, accelerator)
    check_groups(args, accelerator.num_processes)  # rloo.py, grpo.py, reinforce_pp.py: whole groups on each process
    check_grpo_losses(getattr(args, "grpo", None))  # grpo.py
    check_kl_flags(getattr(args, "reinforce_pp", None))  # reinforce_pp.py
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
# dpo.py, online_dpo.py, kto.py
# ----------------------------------------------------------------------------------------------------------------------
def check_dpo_flags(args) -> None:
    """dpo.py's (and online_dpo.py's) flag combinations that cannot work, refused before anything is loaded."""
    if args.label_smoothing != 0.0 and args.loss_type != "sigmoid":
        raise RunError(f"--label_smoothing is conservative DPO, defined for --loss_type sigmoid, not {args.loss_type}")


def check_kto_flags(args) -> None:
    """kto.py's flag combinations that cannot work, refused before anything is loaded: unpaired feedback without its
    data, micro batches the KL estimate cannot pair within, weights and beta that are not positive."""
    if args.feedback == "unpaired" and args.unpaired_dataset is None:
        raise RunError("--feedback unpaired reads --unpaired_dataset (a folder from data/prepare.py --unpaired); "
                         "pass it, or train on preference pairs with --feedback pairs")
    if args.local_micro_batch_size < 2 or (args.feedback == "pairs" and (args.local_micro_batch_size < 4
                                                                         or args.local_micro_batch_size % 2)):
        raise RunError("--local_micro_batch_size must be at least 2 (--feedback pairs: even and at least 4, the two "
                       "halves of local_micro_batch_size / 2 pairs): the KL estimate pairs each prompt with the "
                       "completion of another example (another pair) of its micro batch")
    if min(args.desirable_weight, args.undesirable_weight) <= 0 or args.beta <= 0:
        raise RunError("--beta, --desirable_weight and --undesirable_weight must be positive")


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
    """seconds a rate limit (HTTP 429) is waited out before the run stops with one error; the waits use up none of
    max_tries. 600: many times a per-minute limit's window, yet a quota spent for the day stops the run in 10 minutes
    instead of hanging it (docs/usage.md, "Flags in depth")"""
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


# ----------------------------------------------------------------------------------------------------------------------
# offline_rl.py
# ----------------------------------------------------------------------------------------------------------------------
def check_offline_flags(args, gradient_accumulation_steps: int) -> None:
    """Flag combinations that cannot work, refused before anything is loaded. gradient_accumulation_steps: the value
    the batch sizes give, total_batch_size / (local_micro_batch_size * world_size)."""
    check_gradient_accumulation(args, gradient_accumulation_steps, args.world_size)
    if args.iterations < 1:
        raise RunError(f"--iterations must be >= 1, got {args.iterations}")
    if args.method != "best_of_n" and args.iterations != 1:
        raise RunError("--iterations > 1 re-samples from the updated policy: only --method best_of_n does that")
    if args.rwr_beta <= 0 or args.rwr_max_weight <= 0:
        raise RunError("--rwr_beta and --rwr_max_weight must be positive")
    if args.n < 1:
        raise RunError(f"--n must be >= 1, got {args.n}")
    target_percentile = [args.dt_target_percentile] if args.dt_target_percentile is not None else []
    percentiles = list(args.dt_eval_percentiles) + target_percentile
    if any(not 0 <= p <= 100 for p in percentiles):
        raise RunError("--dt_eval_percentiles and --dt_target_percentile are percentiles in [0, 100], "
                       f"got {percentiles}")


def check_round_size(args, samples_per_round: int, episodes_per_round: int, updates_per_round: int,
                     num_prompts: int) -> None:
    """A round must fill at least one update batch (best-of-n: with prompts of the train split)."""
    if args.method == "best_of_n" and samples_per_round > num_prompts:
        raise RunError(f"--bon_num_prompts {samples_per_round} > {num_prompts} prompts in {args.train_split}")
    if updates_per_round == 0:
        raise RunError(f"{episodes_per_round} training samples do not fill one update of {args.total_batch_size}")
    if samples_per_round < args.total_batch_size:
        raise RunError(f"{samples_per_round} training samples are fewer than one batch of {args.total_batch_size}")


# ----------------------------------------------------------------------------------------------------------------------
# ilql.py
# ----------------------------------------------------------------------------------------------------------------------
def check_ilql_flags(args, gradient_accumulation_steps: int) -> None:
    """Flag combinations that cannot work, refused before anything is loaded. gradient_accumulation_steps: the value
    the batch sizes give, total_batch_size / (local_micro_batch_size x world_size)."""
    check_gradient_accumulation(args, gradient_accumulation_steps, args.world_size)
    if args.eval_temperature <= 0:
        raise RunError(f"--eval_temperature must be positive, got {args.eval_temperature}")
    if args.ilql.steps_for_target_q_sync < 1:
        raise RunError(f"--ilql.steps_for_target_q_sync must be >= 1, got {args.ilql.steps_for_target_q_sync}")
    if args.reward_source == "rm" and args.reward_model_path is None:
        raise RunError("--reward_source rm needs --reward_model_path")


# ----------------------------------------------------------------------------------------------------------------------
# rloo.py, grpo.py, reinforce_pp.py: their groups (check_flags calls it; ppo.py has none)
# ----------------------------------------------------------------------------------------------------------------------
def check_groups(args, num_processes: int) -> None:
    """The group methods' groups, refused before anything loads: each process holds whole groups of responses to one
    query (rloo.py --rloo_k, grpo.py --group_size, reinforce_pp.py --samples_per_prompt); RLOO's leave-one-out, GRPO's
    group statistics and REINFORCE++-baseline's group mean need 2 or more; grpo.py's DAPO sizes are not negative."""
    local_batch_size = args.total_batch_size // num_processes  # batch_arithmetic has checked that it divides
    for name in ("rloo_k", "group_size"):
        size = getattr(args, name, None)
        if size is not None and (size < 2 or local_batch_size % size):
            raise RunError(f"--{name} {size} must be at least 2 and divide the local batch {local_batch_size}")
    grpo = getattr(args, "grpo", None)
    if grpo is not None and (grpo.max_draws_per_update < 1 or grpo.overlong_buffer < 0):
        raise RunError(f"--grpo.max_draws_per_update must be >= 1 (1 = off) and --grpo.overlong_buffer >= 0 "
                       f"(0 = off), got {grpo.max_draws_per_update} and {grpo.overlong_buffer}")
    if grpo is not None and grpo.dynamic_sampling_on == "reward_fn" and not args.reward_fn:
        raise RunError("--grpo.dynamic_sampling_on reward_fn compares the values the --reward_fn function gives a "
                       "group's responses, and this run has no --reward_fn: pass one (path.py:function), or let "
                       "dynamic sampling compare the scores that train (--grpo.dynamic_sampling_on score)")
    if not hasattr(args, "samples_per_prompt"):
        return
    if local_batch_size % args.samples_per_prompt:
        raise RunError(f"--samples_per_prompt {args.samples_per_prompt} must divide the local batch {local_batch_size}")
    if args.reinforce_pp.baseline == "group" and args.samples_per_prompt < 2:
        raise RunError(f"--reinforce_pp.baseline group (REINFORCE++-baseline) subtracts from each score the mean "
                       f"score of its query's --samples_per_prompt responses, which needs 2 or more (got "
                       f"{args.samples_per_prompt}, whose mean is the score itself: every advantage would come from "
                       "the KL penalty alone); pass --samples_per_prompt 2 or more (e.g. 4), or "
                       "--reinforce_pp.baseline batch for REINFORCE++")


def check_grpo_losses(hp) -> None:
    """grpo.py's loss and KL options (hp: its --grpo.* group; None in the other scripts), refused before anything
    loads where they cannot work together or take a value outside their range."""
    if hp is None:
        return
    if hp.kl_importance_weighted and (hp.kl_in == "reward" or hp.kl_estimator != "k3"):
        raise RunError(f"--grpo.kl_importance_weighted (TRL's use_bias_correction_kl) multiplies the k3 KL term of the "
                       f"loss by each token's ratio p / p_old, and this run has --grpo.kl_in {hp.kl_in} and "
                       f"--grpo.kl_estimator {hp.kl_estimator}: pass --grpo.kl_in loss --grpo.kl_estimator k3 with it, "
                       "or, for a per-token reverse KL's gradient without the ratio, --grpo.kl_estimator k2")
    if hp.kl_in == "reward" and hp.max_draws_per_update > 1:
        raise RunError("--grpo.kl_in reward with dynamic sampling (--grpo.max_draws_per_update "
                       f"{hp.max_draws_per_update}): dynamic sampling computes the advantages of the batch it keeps "
                       "again from the scores alone, which would drop the KL from the reward; pass "
                       "--grpo.max_draws_per_update 1, or keep the KL in the loss (--grpo.kl_in loss)")
    if not 0 < hp.top_entropy_quantile <= 1:
        raise RunError(f"--grpo.top_entropy_quantile {hp.top_entropy_quantile} is the share of tokens (those of the "
                       "highest entropy) that train: a value in (0, 1], 1.0 = every token")
    if min(hp.cispo_max_weight, hp.sapo_tau_pos, hp.sapo_tau_neg) <= 0:
        raise RunError(f"--grpo.cispo_max_weight ({hp.cispo_max_weight}), --grpo.sapo_tau_pos ({hp.sapo_tau_pos}) "
                       f"and --grpo.sapo_tau_neg ({hp.sapo_tau_neg}) must be positive (CISPO's largest IS weight, "
                       "SAPO's gate temperatures; 4, 1.0 and 1.05 by default)")


def check_kl_flags(hp) -> None:
    """reinforce_pp.py's KL options (hp: its --reinforce_pp.* group; None in the other scripts), refused before
    anything loads where they cannot act: the importance weight multiplies a k3 term of the loss, and a clamp is a
    positive bound."""
    if hp is None:
        return
    if hp.kl_importance_weighted and (hp.kl_in != "loss" or hp.kl_estimator != "k3"):
        raise RunError(f"--reinforce_pp.kl_importance_weighted (TRL's use_bias_correction_kl) multiplies the k3 KL "
                       f"term of the loss by each token's ratio p / p_old, and this run has --reinforce_pp.kl_in "
                       f"{hp.kl_in} and --reinforce_pp.kl_estimator {hp.kl_estimator}, where the loss has no k3 term: "
                       "pass --reinforce_pp.kl_in loss --reinforce_pp.kl_estimator k3 with it, or leave it off (for "
                       "the per-token reverse KL's gradient without the ratio: --reinforce_pp.kl_estimator k2)")
    if hp.kl_clamp is not None and not hp.kl_clamp > 0:
        raise RunError(f"--reinforce_pp.kl_clamp {hp.kl_clamp} bounds each token's KL estimate to [-kl_clamp, "
                       "kl_clamp]: a positive value (OpenRLHF's is 10), or leave it unset for no clamp")


def note_idle_ratio(hp, say) -> None:
    """grpo.py's one line at start when its --grpo.* options (hp) set a clip that cannot act: with one epoch of one
    minibatch each rollout makes one optimizer step, on-policy, so every ratio is 1 (GSPO's and DAPO's recipes split
    each rollout into minibatches). `say` prints on the main process."""
    idle = [name for name, on in (("--grpo.ratio_level sequence (GSPO)", hp.ratio_level == "sequence"),
                                  ("--grpo.clip_high (DAPO)", hp.clip_high is not None)) if on]
    if idle and hp.num_ppo_epochs * hp.num_mini_batches == 1:
        say(f"{' and '.join(idle)} with 1 epoch of 1 minibatch: each rollout makes one optimizer step on-policy, so "
            "every ratio is 1, the clip never acts and the update is GRPO's; the ratio moves with "
            "--grpo.num_mini_batches above 1 (GSPO's recipe: 4, DAPO's: 16) or --grpo.num_ppo_epochs above 1")
