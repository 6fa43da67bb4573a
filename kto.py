"""Kahneman-Tversky Optimization (KTO) on TL;DR: "KTO: Model Alignment as Prospect Theoretic Optimization"
(Ethayarajh et al. 2024), forked from dpo.py. KTO needs one bit per response, desirable or not, so it trains on
preference pairs cut in two or on unpaired thumbs-up / thumbs-down feedback (--feedback).

The policy and a frozen reference both start from the SFT model. One update = `total_batch_size` examples
(x, y, desirable or not), in micro batches with gradient accumulation. --feedback pairs splits each preference pair
(x, y_c, y_r) into the desirable example (x, y_c) and the undesirable example (x, y_r), both in the same micro batch,
and reads dpo.py's pairs in dpo.py's order (the same shuffle: shuffled_batches), so that with twice dpo.py's
--total_episodes and --total_batch_size every update trains on the pairs of dpo.py's update; --feedback unpaired
reads rows of prompt, completion and a boolean label (the layout of the hub's KTO data sets):

  1. the reference point z0, before any gradient: every prompt of a micro batch is paired with the completion of
     the example before it in that micro batch (a mismatched pair, y'), and
        z0 = max(0, mean of log pi(y'|x) - log ref(y'|x) over the update's whole batch, every process included),
     an estimate of KL(pi || ref) that is a constant of the update (no gradient flows through it)
  2. log pi(y|x) = the SUM of the response tokens' log-probs of every example, as in dpo.py
  3. the same under the frozen reference; r = log pi(y|x) - log ref(y|x), the log-ratio (beta * r is the implicit
     reward, as in DPO)
  4. the value of an example, a prospect-theory value function: gains and losses are measured from the reference
     point z0, and the sigmoid flattens both far gains and far losses:
        desirable:   v = lambda_D * sigmoid(beta * (r - z0))
        undesirable: v = lambda_U * sigmoid(beta * (z0 - r))
     loss per example lambda_y - v, i.e. lambda_D * (1 - sigmoid(beta * (r - z0))) for a desirable one and
     lambda_U * (1 - sigmoid(beta * (z0 - r))) for an undesirable one; the mean over the examples
  5. AdamW step, cosine learning-rate schedule (dpo.py's Table 6 settings)
Measuring r against z0 rather than 0 means the loss only pays for a response moving relative to how far the policy
has drifted from the reference as a whole: raising every response's probability at once raises z0 as much.
Evaluation as in dpo.py: the implicit reward beta * log(pi / pi_ref) ranks the validation preference pairs (the
Detail 19 table; a pair's loss is the mean of its two examples' at the last update's z0); samples of the policy go
to samples.csv.

Single process:   python kto.py --sft_model_path models/sft --output_dir models/kto
Thumbs up / down: python kto.py --feedback unpaired --unpaired_dataset data/processed/tldr/unpaired (made by
                  data/prepare.py --unpaired; the validation pairs of --preference_dataset are still evaluated)
Several GPUs:     accelerate launch --config_file zero2.yaml kto.py --sft_model_path models/sft
LoRA / QLoRA:     ... --lora_rank 8 [--load_in_4bit]: the reference is the policy with its adapters off; the saved
                  policy has them merged (float32)
After a crash:    the same command with --resume (and --run_name of the run, if it is not the newest): it continues
                  from the latest checkpoint in runs/{run_name}/checkpoints (policy, AdamW, schedule, data position,
                  open logging interval, RNG states; the reference point z0 of the last update is kept in the checkpoint
                  folder) and ends exactly like an uninterrupted run (--checkpoint_every sets how often). A NaN or inf
                  loss or log-prob stops the run before it reaches the weights, and the state after the last good
                  update is saved as a checkpoint to resume from.
"""
import math
import os
import time
from dataclasses import dataclass, field
from typing import Annotated, Dict, List, Literal, Optional, Tuple

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
import tyro
from accelerate import Accelerator, PartialState, skip_first_batches
from accelerate.utils import set_seed
from datasets import get_dataset_split_names, load_from_disk
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, GenerationConfig

from rlhf_utils import checks, models, records
from rlhf_utils.checks import RunError
from rlhf_utils.flags import RunFlags, check_kto_flags
from rlhf_utils.run import LastGoodState, Run, due, evaluation_rng, leave_processes, seeded_accelerator, start_processes


@dataclass
class Args:
    # experiment bookkeeping
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (the script's file stem)"""
    seed: int = 1
    """seed of weights and data order (every rank); sampling uses seed + process_index * 100003"""
    output_dir: str = "models/kto"
    """where the trained policy and its tokenizer are saved (safetensors)"""

    # models and data
    sft_model_path: str = "models/sft"
    """the SFT model (local folder written by sft.py, or a hub name): the policy's start AND the reference"""
    trust_remote_code: bool = False
    """passed to from_pretrained for models with custom code"""
    preference_dataset: str = "vwxyzjn/summarize_from_feedback_oai_preprocessing_1706381144"
    """processed preference pairs (hub name, or a local save_to_disk folder from data/prepare.py): the training data
    with --feedback pairs, and the validation pairs of the implicit-reward table with either feedback"""
    feedback: Literal["pairs", "unpaired"] = "pairs"
    """pairs: each preference pair of --preference_dataset gives one desirable (chosen) and one undesirable (rejected)
    example; unpaired: the binary feedback of --unpaired_dataset, one labelled completion per row"""
    unpaired_dataset: Optional[str] = None
    """--feedback unpaired: processed unpaired feedback (a local save_to_disk folder written by data/prepare.py
    --unpaired from rows of prompt, completion and a boolean label, e.g. the hub's trl-lib/kto-mix-14k)"""
    query_dataset: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """processed SFT dataset whose validation queries are sampled for the generation table"""
    train_split: str = "train"
    """split to train on (of --preference_dataset, or of --unpaired_dataset with --feedback unpaired)"""
    eval_splits: Optional[List[str]] = None
    """preference splits for the implicit-reward accuracy table; None = every split whose name starts
    with "validation" (TL;DR: validation and validation_cnndm)"""
    eval_split: str = "validation"
    """split of --query_dataset whose queries are sampled for samples.csv"""

    # KTO hyperparameters (the paper's recommended setting); the optimizer and batch follow dpo.py's Table 6
    beta: float = 0.1
    """KTO's beta, 0.1 by default as the KTO paper recommends: how steeply the value of an example saturates in its
    log-ratio measured from z0; larger keeps the policy closer to the reference"""
    desirable_weight: float = 1.0
    """lambda_D, the weight of a desirable example's loss (1.0, the paper's default). The paper's guidance: choose the
    weights so that lambda_D n_D / (lambda_U n_U) lies in [1, 4/3], with n_D and n_U the desirable and undesirable
    examples; a run whose data fall outside prints a warning at start (and trains anyway)"""
    undesirable_weight: float = 1.0
    """lambda_U, the weight of an undesirable example's loss (1.0, the paper's default); see --desirable_weight"""
    num_train_epochs: int = 1
    """Table 6: 1 epoch"""
    total_episodes: Optional[int] = None
    """number of examples to train on (a preference pair gives two: --feedback pairs with twice dpo.py's value reads
    dpo.py's pairs, in its order); None = num_train_epochs x the train examples"""
    lr: float = 3e-6
    """Table 6: AdamW learning rate"""
    eps: float = 1e-5
    """Table 6: AdamW epsilon"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    """Table 6: learning-rate schedule (transformers.get_scheduler's curves, written out: lr_schedule)"""
    warmup_steps: int = 0
    """learning-rate warm-up, in optimizer updates"""
    total_batch_size: int = 64
    """examples per optimizer update over all processes (z0 is estimated over them all) = local_micro_batch_size x
    gradient accumulation steps x number of processes (dpo.py's Table 6 value, counted in examples here)"""
    local_micro_batch_size: int = 8
    """examples per forward/backward pass on one process (at least 2: a mismatched pair borrows the completion of
    another example of the micro batch)"""
    gradient_accumulation_steps: Optional[int] = None
    """micro batches per optimizer step; None = derived from the batch sizes, else checked against them"""
    local_eval_batch_size: int = 8
    """pairs (or queries for sampling) per forward pass during evaluation"""
    disable_dropout: bool = True
    """Detail 7: turn dropout off in the policy (the reference always runs with dropout off)"""
    bf16: Optional[bool] = None
    """bf16 mixed precision, as the paper trained (Detail 8); None = on when a CUDA device supports bf16. The CPU
    runs float32 unless --bf16 asks for bf16 (slow; the tests use it to exercise the GPU's dtype path)"""
    gather_for_generation: bool = True
    """under ZeRO-3, gather the policy's weights once per generate call of the evaluation's samples, not layer by
    layer at each decode step: the same samples. Off: for models too big for a device (docs/usage.md, Flags in depth)"""
    gradient_checkpointing: bool = False
    """activation checkpointing in every model that trains here: less activation memory for about one more forward
    pass; the loss and gradients are the same. Off: the paper trained without it (docs/usage.md, "Flags in depth")"""
    query_once: bool = True
    """run each query once for both of its responses (keys and values reused): the same log-probs, less compute.
    Off, and under --gradient_checkpointing (no cache): whole rows, as the reference implementation and TRL run"""

    # memory: LoRA and QLoRA
    lora_rank: int = 0
    """LoRA rank of the policy adapters (peft); the reference is the policy with adapters disabled; 0 = off"""
    lora_alpha: float = 16.0
    """LoRA scaling alpha (read only when --lora_rank > 0)"""
    load_in_4bit: bool = False
    """QLoRA: the frozen base of the policy in 4-bit NF4 with double quantization (bitsandbytes), LoRA adapters trained
    on top; needs --lora_rank. The settings are the QLoRA paper's (Dettmers et al. 2023); each 4-bit layer computes in
    the run's dtype (bf16 with --bf16, else float32), and the saved model has the adapters merged in float32"""

    # evaluation, sampling and logging
    eval_every: int = 500
    """run the evaluation every N optimizer updates (0 = only after training)"""
    num_eval_samples: Optional[int] = None
    """use only the first N rows of each evaluation split (preference and sampling); None = all"""
    response_length: int = 53
    """number of new tokens sampled per query (TL;DR SFT response length 53; the built-in task uses 24)"""
    eval_temperature: float = 0.01
    """sampling temperature of the evaluation samples (0.01 = near-greedy, as in sft.py)"""
    log_every: int = 10
    """log training metrics every N optimizer updates, averaged over every micro batch since the last log"""
    print_sample_every: int = 1
    """updates between printed samples: an evaluation at a multiple of it prints a few (the final one always);
    0 = never"""

    run: Annotated[RunFlags, tyro.conf.OmitArgPrefixes] = field(default_factory=RunFlags)
    """the run's folder, checkpoints, --resume, lock, tracking and hub (rlhf_utils/flags.py): they decide no number"""

    # derived at run time (not flags)
    world_size: tyro.conf.Suppress[Optional[int]] = None
    """number of processes"""
    num_updates: tyro.conf.Suppress[Optional[int]] = None
    """optimizer updates of the whole run"""


# ---------------------------------------------------------------------------------------------
# KTO pieces (module-level so that tests can check each one against a hand computation)
# ---------------------------------------------------------------------------------------------


EXAMPLE_COLUMNS = [  # one KTO example: the left-padded query, the right-padded completion, desirable or not
    "query_token",
    "completion_token",
    "label",
]


def example_logprobs(model, query_tokens: torch.Tensor, completion_tokens: torch.Tensor, pad_token_id: int,
                     query_once: bool = False):
    """log pi(y | x) of every example (B,): the left-padded query (B, Tq) and the right-padded completion (B, Tr)
    side by side form one row whose padding lies at its two ends only (Detail 5), so any completion can follow any
    query (the mismatched pairs of the KL estimate); the query's tokens are masked out of the sum."""
    query_responses = torch.cat((query_tokens, completion_tokens), dim=1)  # (B, Tq + Tr)
    labels = torch.cat((torch.full_like(query_tokens, pad_token_id), completion_tokens), dim=1)
    return sequence_logprobs(model, query_responses, labels, pad_token_id, query_once)


def reference_point(kl_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """KTO's reference point z0 = max(0, kl_sum / count): the mean log-ratio log pi(y'|x) - log ref(y'|x) of `count`
    mismatched pairs, a sample estimate of KL(pi || ref). Clamped at 0, since a KL is never negative (a negative
    estimate is noise), and detached: z0 is a constant of the update, never trained through."""
    return (kl_sum / count).clamp(min=0).detach()


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    z0: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
):
    """Per-example losses (B,) and implicit rewards beta * r (B,).

    With r = log pi(y|x) - log ref(y|x) (sequence log-probs) and the reference point z0:
        desirable:   lambda_D * (1 - sigmoid(beta * (r - z0)))   # a gain over z0 lowers it, down to 0
        undesirable: lambda_U * (1 - sigmoid(beta * (z0 - r)))   # a loss below z0 lowers it, down to 0
    Each is lambda_y minus the example's value; neither gives a gradient through z0 (detached here as well)."""
    log_ratios = policy_logps - ref_logps
    z0 = z0.detach()
    losses = torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (log_ratios - z0))),
        undesirable_weight * (1 - torch.sigmoid(beta * (z0 - log_ratios))),
    )
    return losses, beta * log_ratios.detach()


@torch.no_grad()
def kl_estimate(accelerator, policy, ref_model, batches: List[Dict[str, torch.Tensor]], pad_token_id: int,
                query_once: bool = False):
    """Step 1: the KL estimate of the update and its reference point z0, before any gradient is taken. Each prompt
    of a micro batch gets the completion of the example before it in the same micro batch (a roll by one: the first
    takes the last's), so the mismatched pairs are the same however the update's micro batches are spread over
    processes. The mean runs over every micro batch of the update on every process (summed, then all-reduced with
    the count): one z0 for the whole update, whatever its micro batches and processes, so 2 processes train as 1
    process with twice the accumulation (to float rounding). An estimate per micro batch would be noisier, and it
    would change with the micro batch size and the number of processes. Returns (the estimate, z0), scalars."""
    totals = torch.zeros(2, device=accelerator.device)  # [sum of the log-ratios, number of pairs]
    for batch in batches:
        query, mismatched = batch["query_token"], batch["completion_token"].roll(1, dims=0)
        with accelerator.autocast():
            log_ratios = example_logprobs(policy, query, mismatched, pad_token_id, query_once) - example_logprobs(
                ref_model, query, mismatched, pad_token_id, query_once)
        totals += torch.stack((log_ratios.float().sum(), torch.tensor(float(len(query)), device=totals.device)))
    kl_sum, count = accelerator.reduce(totals, reduction="sum")
    return kl_sum / count, reference_point(kl_sum, count)


def pair_halves(rows: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """--feedback pairs, the collate_fn of training: a micro batch of k preference pairs (x, y_c, y_r), in dpo.py's
    order of the pairs (shuffled_batches), becomes 2k KTO examples in the columns of EXAMPLE_COLUMNS: (x, y_c)
    desirable for every pair, then (x, y_r) undesirable in the same order. The two halves of a pair are thus k rows
    apart, so with k >= 2 the KL estimate's roll by one (kl_estimate) never gives a prompt its own pair's response."""
    pairs = torch.utils.data.default_collate(rows)
    return {"query_token": pairs["query_token"].repeat(2, 1), "label": torch.arange(2 * len(rows)) < len(rows),
            "completion_token": torch.cat((pairs["chosen_token"], pairs["rejected_token"])),
            "row_index": pairs["row_index"].repeat(2)}


def feedback_balance(args, labels) -> Tuple[float, Optional[str]]:
    """lambda_D n_D / (lambda_U n_U) of the training examples, and a warning when it lies outside [1, 4/3], the
    range the KTO paper advises choosing the weights for (the warning names a --desirable_weight that brings the
    ratio to 1). Only a warning: the run trains as asked."""
    n_desirable = int(torch.as_tensor(labels).sum())
    n_undesirable = len(labels) - n_desirable
    desirable, undesirable = args.desirable_weight * n_desirable, args.undesirable_weight * n_undesirable
    ratio = desirable / undesirable if undesirable else float("inf")
    if 1.0 <= ratio <= 4 / 3:
        return ratio, None
    fix = (f"--desirable_weight {undesirable / n_desirable:.3g} would bring it to 1" if n_desirable and n_undesirable
           else "the data hold one kind of example only")
    return ratio, (f"WARNING: lambda_D n_D / (lambda_U n_U) = {args.desirable_weight:g} x {n_desirable} / "
                   f"({args.undesirable_weight:g} x {n_undesirable}) = {ratio:.3f} lies outside [1, 4/3], the KTO "
                   f"paper's advice; {fix} (training goes on as asked)")


# ---------------------------------------------------------------------------------------------
# The update: the docstring's steps on one batch (the pieces it shares with the forks follow main)
# ---------------------------------------------------------------------------------------------


TRAIN_STATS = [  # per micro batch, logged as means over the logging interval; sums and counts become per-example means
    "train/loss", "train/kl", "train/z0", "train/sum/rewards/desirable", "train/sum/rewards/undesirable",
    "train/sum/logps/desirable", "train/sum/logps/undesirable", "train/count/desirable", "train/count/undesirable",
]


def per_example_means(means: Dict[str, float]) -> Dict[str, float]:
    """The logged means of an interval: a micro batch may hold few or no examples of a kind, so rewards and log-probs
    are logged as sums and counts and divided here (the ratio of the interval's totals), with the margin between
    the kinds and the desirable share of the examples."""
    out = {key: value for key, value in means.items() if not key.startswith(("train/sum/", "train/count/"))}
    counts = {kind: means[f"train/count/{kind}"] for kind in ("desirable", "undesirable")}
    for name, kind in ((f"{what}/{kind}", kind) for what in ("rewards", "logps") for kind in counts):
        out[f"train/{name}"] = means[f"train/sum/{name}"] / counts[kind] if counts[kind] else float("nan")
    out["train/rewards/margins"] = out["train/rewards/desirable"] - out["train/rewards/undesirable"]
    out["train/desirable_share"] = counts["desirable"] / (counts["desirable"] + counts["undesirable"])
    return out


def kto_update(args, accelerator, run, policy, optimizer, ref_model, micro_batches, update: int,
               pad_token_id: int):
    """Steps 1-5 of one update, on this process's next gradient_accumulation_steps micro batches: the loss of each
    and its gradient (accumulated; the non-finite guard checks the loss before each backward pass), then one AdamW
    step after the last micro batch. Returns the means over the micro batches of this process's TRAIN_STATS and
    the number of tokens trained on, and the update's reference point z0 (step 1: a float, the same everywhere)."""
    micro_stats, tokens = [], 0
    # step 1 first, without gradients: z0 is the KL estimate of the update's whole batch (every micro batch on every
    # process), so each micro batch's loss below is measured from the same reference point
    batches = [next(micro_batches) for _ in range(args.gradient_accumulation_steps)]
    kl, z0 = kl_estimate(accelerator, policy, ref_model, batches, pad_token_id,
                         args.query_once and not args.gradient_checkpointing)
    for batch in batches:
        desirable = batch["label"].bool()
        with accelerator.accumulate(policy):
            with accelerator.autocast():  # steps 2-3: sequence log-probs (B,) of the examples
                policy_logps = example_logprobs(policy, batch["query_token"], batch["completion_token"], pad_token_id,
                                                args.query_once and not args.gradient_checkpointing)
                ref_logps = example_logprobs(ref_model, batch["query_token"], batch["completion_token"], pad_token_id,
                                             args.query_once)
            losses, rewards = kto_loss(  # step 4
                policy_logps, ref_logps, desirable, z0, args.beta, args.desirable_weight, args.undesirable_weight
            )
            loss = losses.mean()
            # non-finite guard before backward: a NaN never reaches the gradients or the weights
            run.guard(update, **{
                "train/loss": loss, "train/logps": policy_logps, "train/ref_logps": ref_logps, "train/kl": kl,
            })
            accelerator.backward(loss)  # divided by gradient_accumulation_steps inside
            optimizer.step()  # step 5; a no-op until the last micro batch of the update
            optimizer.zero_grad()
        logps = policy_logps.detach()
        micro_stats.append(torch.stack([  # in the order of TRAIN_STATS
            loss.detach(), kl, z0, rewards[desirable].sum(), rewards[~desirable].sum(), logps[desirable].sum(),
            logps[~desirable].sum(), desirable.sum(), (~desirable).sum(),
        ]).float())
        tokens += int(
            (batch["query_token"] != pad_token_id).sum() + (batch["completion_token"] != pad_token_id).sum()
        )
    if not accelerator.sync_gradients:
        raise RuntimeError("gradient accumulation went out of step with the update loop")
    return torch.stack(micro_stats).mean(0), tokens, z0.item()


def main(args: Args) -> dict:
    start_time = time.monotonic()
    check_kto_flags(args)
    # ---------------- processes, batch arithmetic (64 examples per update), run folder ----------------
    accelerator = make_accelerator(args)  # gradient accumulation, a resumable data order, bf16, DeepSpeed's settings
    checks.check_qlora_flags(args, accelerator)
    run = Run(args, accelerator)  # run name and folder (rlhf_utils/run.py)
    run.inputs(sft_model_path=args.sft_model_path, preference_dataset=args.preference_dataset,
               query_dataset=args.query_dataset, unpaired_dataset=args.unpaired_dataset)

    # ---------------- seeding (labelled, deliberate) ----------------
    set_seed(args.seed)  # weights and data order: identical on every rank
    local_seed = args.seed + accelerator.process_index * 100003  # sampling differs per rank

    # ---------------- tokenizer and data ----------------
    tokenizer = load_tokenizer(args.sft_model_path, args.trust_remote_code)  # Detail 3: [PAD] distinct from EOS
    pad_token_id = tokenizer.pad_token_id
    train_dataset, eval_datasets, sample_raw, sample_dataset = load_kto_data(args, tokenizer)
    halves = 1 + (args.feedback == "pairs")  # examples a row gives: a preference pair's two halves, or one thumb
    args.num_updates = num_updates = count_updates(args, halves * len(train_dataset))
    # the paper's advice: lambda_D n_D / (lambda_U n_U), over the examples (a pair gives one of each kind)
    balance, warning = feedback_balance(args,
                                        train_dataset["label"] if halves == 1 else [True, False] * len(train_dataset))
    if warning:
        accelerator.print(warning)
    run.claim_output_dir()  # every input check has passed: only now mark --output_dir as this run's

    # ---------------- models: the policy and the frozen reference, both the SFT model ----------------
    # with LoRA (--lora_rank) the reference is the policy with its adapters off (QLoRA: the same 4-bit base)
    policy, ref_model = (load_lora_policy_and_reference(args, accelerator, tokenizer) if args.lora_rank > 0
                         else load_policy_and_reference(args, accelerator, tokenizer))
    generation_config = sampling_config(args, tokenizer, args.eval_temperature)  # Detail 23: EOS trick
    # the reference runs live: the mismatched pairs of the KL estimate are drawn by each update's batch
    trained = [p for p in policy.parameters() if p.requires_grad]  # all of them, or the LoRA adapters alone
    adamw = torch.optim.AdamW(trained, lr=args.lr, eps=args.eps, weight_decay=args.weight_decay)
    # the schedule (Table 6) counts optimizer updates and is stepped by hand on each update (not prepared:
    # accelerate's wrapper would step it once per process)
    lr_scheduler = lr_schedule(adamw, args.scheduler, num_updates, args.warmup_steps)
    # the data order, from a generator of its own (shuffled_batches); --feedback pairs: dpo.py's pairs in dpo.py's
    # order (the same shuffle of the same rows), local_micro_batch_size / 2 a micro batch, each as its two halves
    train_dataloader = shuffled_batches(train_dataset, args.local_micro_batch_size // halves, args.seed,
                                        pair_halves if halves == 2 else None)
    policy, optimizer, train_dataloader = accelerator.prepare(policy, adamw, train_dataloader)
    accelerator.register_for_checkpointing(lr_scheduler)  # saved and restored with the policy and optimizer
    torch.manual_seed(local_seed)  # draws differ across ranks from here on (evaluation: its own, evaluation_rng)

    # ---------------- resume and logs ----------------
    last_good = LastGoodState(run, accelerator, adamw, lr_scheduler)  # the non-finite guard's fallback
    # the trainer state: the update reached and the open logging interval. The frozen reference is not saved: it is
    # the SFT model, loaded again. z0: the reference point of that update, which the evaluation measures from
    state = run.start({"update": 0, "interval": [], "interval_tokens": 0, "interval_time": 0.0,
                       "last_train_metrics": {}, "z0": None}, num_updates=num_updates)
    start_update = state["update"]
    z0 = state.get("z0")  # None before the first update
    accelerator.step = start_update * args.gradient_accumulation_steps  # accelerate's count of micro batches
    interval = LoggingInterval(state)  # training metrics since the last log, carried by checkpoints
    # the data position: every update reads gradient_accumulation_steps micro batches on each process
    micro_batches = resumable_micro_batches(train_dataloader, start_update * args.gradient_accumulation_steps)

    def run_evaluation(update: int, z0: float, final: bool = False) -> dict:
        """Detail 19: the implicit reward model on the preference splits; samples of the policy."""
        pairs = evaluate_implicit_rewards(accelerator, policy, ref_model, z0, eval_datasets, args, pad_token_id)
        sampled = sample_responses(accelerator, policy, tokenizer, sample_dataset, generation_config, args)
        report = preference_report(pairs, eval_datasets)  # Detail 19's accuracy table and the eval/ metrics
        metrics = records.write_evaluation(run, args, update, final, report, sampled, sample_raw, tokenizer)
        run.log(update, {"episode": update * args.total_batch_size, **metrics})
        return metrics

    # ---------------- training: one optimizer update per total_batch_size examples ----------------
    accelerator.print(
        f"KTO ({args.feedback}, beta {args.beta}, lambda_D {args.desirable_weight}, "
        f"lambda_U {args.undesirable_weight}, lambda_D n_D / (lambda_U n_U) = {balance:.3f}): "
        f"{num_updates} updates of {args.total_batch_size} examples, "
        f"{accelerator.num_processes} process(es) x {args.gradient_accumulation_steps} accumulation x "
        f"{args.local_micro_batch_size} examples"
    )
    policy.train()
    progress = tqdm(total=num_updates, initial=start_update, desc=args.exp_name,
                    disable=not accelerator.is_local_main_process)
    with progress:  # closed before an error's message, which stays the last line of the output
        for update in range(start_update + 1, num_updates + 1):
            with last_good.kept(update, {**interval.state(), "z0": z0}):  # a non-finite value: update - 1's is saved
                stats, tokens, z0 = kto_update(args, accelerator, run, policy, optimizer, ref_model, micro_batches,
                                               update, pad_token_id)  # steps 1-5
            update_lr = lr_scheduler.get_last_lr()[0]  # the learning rate this update used
            lr_scheduler.step()

            # ---------------- logging: means over updates, micro batches and processes ----------------
            interval.add(accelerator.reduce(stats, reduction="mean").tolist(),
                         int(accelerator.reduce(torch.tensor(tokens, device=accelerator.device), reduction="sum")))
            episode = update * args.total_batch_size
            progress.update(1)
            if update % args.log_every == 0 or update == num_updates:
                means = per_example_means(interval.close(update_lr, episode / (halves * len(train_dataset))))
                run.log(update, {"episode": episode, **means})
                progress.set_postfix(loss=f"{means['train/loss']:.4f}", kl=f"{means['train/kl']:.3f}",
                                     tok_s=f"{means['train/tokens_per_s']:.0f}")
            if due(args.eval_every, update, num_updates):
                run_evaluation(update, z0)
                interval.restart_clock()  # evaluation time is not training throughput
            # after the update's logging and evaluation, so a resumed run repeats neither
            if due(args.run.checkpoint_every, update, num_updates):
                run.checkpoint(update, {**interval.state(), "z0": z0})

    # ---------------- final evaluation and outputs ----------------
    metrics = run_evaluation(num_updates, z0, final=True)  # at the last update's z0 (with --resume, the checkpoint's)
    summary = {**metrics, **per_example_means(interval.last_means),  # the last logging interval's training means
               "num_updates": num_updates, "episodes": num_updates * args.total_batch_size,
               # the budget as spent (report.py's leaderboard reads it): every update read total_batch_size examples
               "budget/updates": num_updates, "budget/rows_read": num_updates * args.total_batch_size,
               **({"budget/pairs_read": num_updates * args.total_batch_size // 2} if halves == 2 else {}),
               "wall_time_s": time.monotonic() - start_time}
    # with LoRA the adapters folded into the base: the plain float32 model it computes (models.merged_policy)
    models.save_pretrained_model(accelerator, policy, accelerator.unwrap_model(policy), tokenizer, args.output_dir,
                          merge=models.merged_policy if args.lora_rank > 0 else None)
    if args.run.push_to_hub and accelerator.is_main_process:
        models.upload_to_hub(args)
    run.finish(summary)  # last: summary.json marks a finished run (the pipeline and ablate.py read it so)
    accelerator.print(f"done in {time.monotonic() - start_time:.0f}s; run folder {run.dir}")
    return summary


# ---------------------------------------------------------------------------------------------
# What the update and the evaluation call, shared by dpo.py and its forks
# ---------------------------------------------------------------------------------------------


PAIR_COLUMNS = [  # the processed preference schema: query + response, and the response as labels
    "query_chosen_token",
    "query_rejected_token",
    "query_chosen_token_response_label",
    "query_rejected_token_response_label",
]


def sequence_logprobs(model, query_responses: torch.Tensor, response_labels: torch.Tensor, pad_token_id: int,
                      query_once: bool = False):
    """log pi(y | x) = SUM over the response tokens of log pi(y_t | x, y_<t)  -> (B,)

    `response_labels` is `query_responses` with every query token replaced by [PAD]; so query
    and pad positions are exactly the [PAD] positions of the labels and are masked out. This is a
    sum, not a mean: eq. 4 compares probabilities of whole sequences. query_once: rows that share a query run it once
    (forward_query_once), the query's columns being those before the first response label."""
    cols = real_columns(query_responses, pad_token_id)  # the padding every row shares is cut: same sums, less compute
    query_responses, response_labels = query_responses[:, cols], response_labels[:, cols]
    targets = response_labels[:, 1:]  # (B, T-1): token t + 1 is predicted at position t
    mask = targets != pad_token_id
    read = F.pad(mask, (0, 1))  # (N, V) logits: the LM head only at the positions read
    if query_once:
        context_length = int(first_true_indices((response_labels != pad_token_id).any(0, keepdim=True))[0])
        logits = forward_query_once(model, query_responses, pad_token_id, context_length, read).logits
    else:
        logits = forward(model, query_responses, pad_token_id, read=read).logits
    picked = torch.gather(F.log_softmax(logits.float(), dim=-1), 1, targets[mask].unsqueeze(-1)).squeeze(-1)  # (N,)
    return torch.zeros(mask.shape, device=picked.device).masked_scatter(mask, picked).sum(1)  # summed in (B, T-1)


def concatenated_logprobs(model, batch: Dict[str, torch.Tensor], pad_token_id: int, query_once: bool = False):
    """Chosen and rejected sequences go through the model in ONE forward pass (batch 2B) -> (B,), (B,); query_once:
    their shared query once (--query_once)."""
    query_responses = torch.cat((batch["query_chosen_token"], batch["query_rejected_token"]), dim=0)  # (2B, T)
    labels = torch.cat((batch["query_chosen_token_response_label"], batch["query_rejected_token_response_label"]))
    logps = sequence_logprobs(model, query_responses, labels, pad_token_id, query_once)  # (2B,)
    return logps.chunk(2)  # chosen (B,), rejected (B,)


@torch.no_grad()
def reference_logprobs(ref_model, ref_table: Optional[torch.Tensor], batch: Dict[str, torch.Tensor], pad_token_id: int,
                       query_once: bool = False):
    """The frozen reference's (chosen, rejected) sequence log-probs: looked up in the precomputed
    table (N, 2) by row index when there is one, else computed live."""
    if ref_table is not None:
        rows = ref_table[batch["row_index"].cpu()].to(batch["query_chosen_token"].device)  # (B, 2)
        return rows[:, 0], rows[:, 1]
    return concatenated_logprobs(ref_model, batch, pad_token_id, query_once)


# ---------------------------------------------------------------------------------------------
# Detail 19: the implicit reward model (the Table 5 analogue), and samples of the policy
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate_implicit_rewards(accelerator, model, ref_model, z0, eval_datasets, args: Args, pad_token_id: int):
    """Detail 19: KTO as a reward model, as dpo.py evaluates DPO. For every pair of every evaluation split: its loss
    (the mean of the KTO losses of chosen as desirable and rejected as undesirable, at the reference point z0 of the
    last update, a float), the implicit rewards beta * log(pi / pi_ref) of chosen and rejected (the pair is ranked
    right when chosen's is higher) and the policy's sequence log-probs, gathered from every process. Returns
    {split: per-pair frame, rows matched by row_index}."""
    z0 = torch.tensor(z0, device=accelerator.device)  # the float of the trainer state, as kto_loss takes it
    model.eval()
    frames = {}
    for split, (_, dataset) in eval_datasets.items():
        dataloader = accelerator.prepare_data_loader(DataLoader(dataset, batch_size=args.local_eval_batch_size))
        gathered = []
        for batch in dataloader:
            with accelerator.autocast():
                policy_chosen, policy_rejected = concatenated_logprobs(model, batch, pad_token_id, args.query_once)
                ref_chosen, ref_rejected = reference_logprobs(ref_model, None, batch, pad_token_id, args.query_once)
            desirable = torch.arange(2 * len(policy_chosen), device=policy_chosen.device) < len(policy_chosen)
            losses, rewards = kto_loss(torch.cat((policy_chosen, policy_rejected)),
                                       torch.cat((ref_chosen, ref_rejected)),
                                       desirable, z0, args.beta, args.desirable_weight, args.undesirable_weight)
            losses, (chosen_rewards, rejected_rewards) = losses.view(2, -1).mean(0), rewards.view(2, -1)
            stats = torch.stack((losses, chosen_rewards, rejected_rewards, policy_chosen, policy_rejected), 1).float()
            gathered.append(accelerator.gather_for_metrics((batch["row_index"], stats)))
        stats = torch.cat([g[1] for g in gathered]).cpu().numpy()
        columns = ["loss", "chosen_reward", "rejected_reward", "chosen_logp", "rejected_logp"]
        frame = pd.DataFrame(stats, columns=columns)
        frame["row_index"] = torch.cat([g[0] for g in gathered]).cpu().numpy()
        frames[split] = frame
    model.train()
    return frames


def preference_report(pairs: Dict[str, pd.DataFrame], eval_datasets):
    """The per-pair frames of evaluate_preferences with each pair's annotation batch, confidence and comparison
    split, as flat metrics (reward.py's names), the rows of the accuracy table and one frame of every pair."""
    metrics, frames, table_rows = {}, [], []
    for split, frame in pairs.items():
        raw, rows = eval_datasets[split][0], frame["row_index"]
        batches, confidences, comparison_splits = raw["batch"], raw["confidence"], raw["split"]
        frame["batch"] = [batches[int(i)] for i in rows]
        frame["confidence"] = [int(confidences[int(i)]) for i in rows]
        frame["split"] = [comparison_splits[int(i)] for i in rows]
        frame["correct"] = frame["chosen_reward"] > frame["rejected_reward"]
        frame["dataset_split"] = split
        frames.append(frame)
        split_rows = implicit_reward_breakdown(frame, split)
        table_rows.extend(split_rows)
        for r in split_rows:
            # the same metric names as reward.py: eval/{split}/accuracy, eval/{split}/accuracy/batch/batch10, ...
            if r["group"] == "accuracy":
                metrics[f"eval/{split}/accuracy"] = r["value"]
            else:
                group = r["group"].replace("accuracy by ", "accuracy/")
                metrics[f"eval/{split}/{group}/{r['key']}"] = r["value"]
        metrics[f"eval/{split}/loss"] = float(frame["loss"].mean())
        metrics[f"eval/{split}/rewards/chosen"] = float(frame["chosen_reward"].mean())
        metrics[f"eval/{split}/rewards/rejected"] = float(frame["rejected_reward"].mean())
        metrics[f"eval/{split}/rewards/margins"] = float((frame["chosen_reward"] - frame["rejected_reward"]).mean())
        metrics[f"eval/{split}/logps/chosen"] = float(frame["chosen_logp"].mean())
        metrics[f"eval/{split}/logps/rejected"] = float(frame["rejected_logp"].mean())
    # as in reward.py: the headline accuracy is the first split's (TL;DR "validation"); all pairs pooled too
    metrics["eval/accuracy"] = metrics[f"eval/{next(iter(pairs))}/accuracy"]
    frame = pd.concat(frames, ignore_index=True)
    metrics["eval/accuracy_all_splits"] = float(frame["correct"].mean())
    return metrics, table_rows, frame


def implicit_reward_breakdown(frame: pd.DataFrame, split_name: str) -> List[dict]:
    """Detail 19: the Table 5 analogue of reward.py, row for row, with DPO's implicit reward
    beta * log(pi / pi_ref) as the score: reward statistics, then accuracy overall, by annotation
    batch, by confidence and by the comparisons' own `split` column (Detail 16)."""
    scores = np.concatenate([frame["chosen_reward"].to_numpy(), frame["rejected_reward"].to_numpy()])
    rows = [{"dataset_split": split_name, "group": "reward", "key": k, "value": float(v), "n": len(scores)}
            for k, v in (("max", scores.max()), ("mean", scores.mean()), ("min", scores.min()), ("std", scores.std()))]
    rows.append({"dataset_split": split_name, "group": "accuracy", "key": "overall",
                 "value": float(frame["correct"].mean()), "n": len(frame)})
    for group in ("batch", "confidence", "split"):
        for key, part in frame.groupby(group, sort=True):
            rows.append({"dataset_split": split_name, "group": f"accuracy by {group}", "key": str(key),
                         "value": float(part["correct"].mean()), "n": len(part)})
    return rows


@torch.no_grad()
def sample_responses(accelerator, model, tokenizer, dataset, generation_config, args: Args):
    """Detail 23 sampling on the SFT validation queries: exactly response_length new tokens, then truncate
    after the first EOS. Returns the row index (N,) of each query and its truncated response (N, Tr)."""
    model.eval()
    unwrapped = accelerator.unwrap_model(model)
    dataloader = accelerator.prepare_data_loader(DataLoader(dataset, batch_size=args.local_eval_batch_size))
    rows_all, responses_all = [], []
    # evaluation samples from its own random stream, the same at every evaluation (evaluation_rng): how often and
    # how much a run evaluates never changes what it trains
    with evaluation_rng(accelerator, args.seed + accelerator.process_index * 100003):
        for batch in dataloader:
            queries = batch["query_token"]  # (B, Tq), left-padded
            queries = queries[:, real_columns(queries, tokenizer.pad_token_id)]  # the left padding all rows share: cut
            with accelerator.autocast(), models.gathered_for_generation(model, args.gather_for_generation):
                query_responses = generate(unwrapped, queries, tokenizer.pad_token_id, generation_config)
            responses = truncate_response(
                tokenizer.eos_token_id, tokenizer.pad_token_id, query_responses[:, queries.size(1):]
            )  # (B, Tr)
            rows, responses = accelerator.gather_for_metrics((batch["row_index"], responses))
            rows_all.append(rows.cpu())
            responses_all.append(responses.cpu())
    model.train()
    return torch.cat(rows_all), torch.cat(responses_all)  # (N,), (N, Tr)


# ---------------------------------------------------------------------------------------------
# The options main switches on: LoRA and QLoRA
# ---------------------------------------------------------------------------------------------


def load_lora_policy_and_reference(args, accelerator, tokenizer):
    """--lora_rank: the policy is the SFT model with LoRA adapters (lora_policy), and the reference is the same model
    with its adapters off (AdaptersOff), so the weights exist once. With --load_in_4bit (QLoRA) the reference is
    therefore the 4-bit base the adapters train on, and the log-ratios of the policy and the reference are exactly 0
    at initialisation (LoRA's B starts at zero). A separate float32 reference would differ from the 4-bit policy by
    the rounding of every weight: its log-ratios would start away from 0, a quantization bias in the implicit reward
    (eq. 5) that the loss would spend its first updates on."""
    policy = AutoModelForCausalLM.from_pretrained(
        args.sft_model_path, dtype=torch.float32, trust_remote_code=args.trust_remote_code,
        **quantized_loading(args, args.bf16),
    )
    checks.check_finite(policy, args.sft_model_path)  # a diverged save stops here (4-bit packed weights are not floats)
    # the config's row count, not the weight's shape: ZeRO-3 partitions weights as they load
    if len(tokenizer) > policy.config.vocab_size:
        policy.resize_token_embeddings(len(tokenizer))
    if args.disable_dropout:  # Detail 7
        disable_dropout(policy)
    policy = models.checkpointed(lora_policy(policy, args), args.gradient_checkpointing)
    if not args.load_in_4bit:  # on the device already for --precompute_ref_logprobs (a 4-bit model loads there)
        policy.to(accelerator.device)
    return policy, AdaptersOff(policy)


class AdaptersOff:
    """The reference of a LoRA run: the policy itself with its adapters disabled, which computes the SFT model it
    started from. Called like a model (by forward()), always in eval mode (no dropout), whatever mode the policy is
    in. It holds the peft model, not the wrapper accelerator.prepare makes of it: the reference needs no gradients."""

    def __init__(self, policy):
        self.policy = policy

    def get_output_embeddings(self):  # the LM head forward() picks positions for: the policy's own
        return self.policy.get_output_embeddings()

    def __call__(self, **inputs):
        training = self.policy.training
        self.policy.eval()
        try:
            with self.policy.disable_adapter():
                return self.policy(**inputs)
        finally:
            self.policy.train(training)


def quantized_loading(args, bf16: bool) -> dict:
    """The policy's extra from_pretrained arguments: none without --load_in_4bit (the model loads as it always did);
    with it, the QLoRA base, quantized as it loads and placed on this process's device (every data-parallel
    process holds its own copy). bf16: whether the run computes in bf16 (--bf16)."""
    if not args.load_in_4bit:
        return {}
    from transformers import BitsAndBytesConfig

    # QLoRA: the settings of Dettmers et al. (2023). The frozen weights of every linear layer stored in 4-bit
    # NormalFloat (NF4), their per-block scales quantized a second time (double quantization), each layer dequantized
    # on the fly to the compute dtype, the run's: bf16 with --bf16, else float32. The embeddings, layer norms and
    # output layer stay unquantized, and the LoRA adapters train in float32 on top
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16 if bf16 else torch.float32)
    return {"quantization_config": config, "device_map": {"": PartialState().device}}


def lora_policy(model, args):
    """LoRA (--lora_rank): adapters of rank --lora_rank on every linear layer of the policy (peft), the only weights
    that train; the base stays frozen (in 4-bit with --load_in_4bit). The reference policy of a LoRA run is this
    model with its adapters disabled."""

    def load_quant_state(layer, state_dict, prefix, *_):
        # --resume: a checkpoint holds each 4-bit layer's packed weight and, beside it, its quantization state (block
        # scales, code book), which bitsandbytes writes but does not read back: taken out here and put in place
        from bitsandbytes.functional import QuantState

        stored = {key[len(f"{prefix}weight."):]: state_dict.pop(key) for key in list(state_dict)
                  if key.startswith(f"{prefix}weight.")}
        if stored:
            layer.weight.quant_state = layer.quant_state = QuantState.from_dict(stored, device=layer.weight.device)

    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):  # a 4-bit layer of bitsandbytes (QLoRA)
            # On a CPU with AVX-512 BF16, bitsandbytes moves a 4-bit layer to a bf16 inference kernel (with a weight
            # layout of its own) at its first forward in eval mode without gradients. That kernel computes other
            # numbers than training does, and a training forward after it fails: every forward keeps the one path
            # (dequantize to the compute dtype, then multiply)
            module.support_avx512bf16_for_cpu = False
            module.register_load_state_dict_pre_hook(load_quant_state)
    from peft import LoraConfig, get_peft_model  # here, not at the top: a run without LoRA never loads peft

    return get_peft_model(
        model, LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules="all-linear")
    )


# ---------------------------------------------------------------------------------------------
# The setup that decides numbers: flags, processes and batches, tokenizer, data, models
# ---------------------------------------------------------------------------------------------


def make_accelerator(args) -> Accelerator:
    """The run's processes and Accelerator, and the batch arithmetic that depends on their number: gradient
    accumulation over args.gradient_accumulation_steps micro batches (derived from the batch sizes), a data order
    that a resumed run can find its place in, bf16 autocast with --bf16 (None: where CUDA supports it), and under
    DeepSpeed the micro batch and the gradient clipping (configure_deepspeed)."""
    # first: the batch arithmetic depends on the process count
    args.world_size = start_processes(args.run.process_group_timeout_min).num_processes
    accumulation = exact_div(args.total_batch_size, args.local_micro_batch_size * args.world_size,
                             "total_batch_size / (local_micro_batch_size * world_size)")
    checks.check_gradient_accumulation(args, accumulation, args.world_size)
    args.gradient_accumulation_steps = accumulation  # recorded in args.json
    if args.bf16 is None:
        args.bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    # gradient accumulation over the micro batches counted here, synced on that count alone (an update may straddle
    # two epochs); the data order seeded by --seed, so that a resumed run finds its place (resumable_micro_batches)
    accelerator = seeded_accelerator(args.gradient_accumulation_steps, args.seed, args.bf16)
    configure_deepspeed(accelerator, args.local_micro_batch_size)  # Detail 8 (no-op without DeepSpeed)
    return accelerator


def configure_deepspeed(accelerator, micro_batch_size: int) -> None:
    """Under DeepSpeed (zero2.yaml / zero3.yaml; Detail 8) set what accelerate would fill as "auto": the micro batch
    per process, and no gradient clipping (the paper clips none; accelerate's "auto" clips at 1.0)."""
    config = getattr(accelerator.state.deepspeed_plugin, "deepspeed_config", None)
    if config is not None:
        config["train_micro_batch_size_per_gpu"] = micro_batch_size
        clipping = config.get("gradient_clipping", "auto")
        config["gradient_clipping"] = 0.0 if clipping == "auto" else clipping


def load_tokenizer(model_path: str, trust_remote_code: bool, pad_token: str = "pad"):
    """The tokenizer of model_path with a [PAD] distinct from EOS (Detail 3), added when it has none: the loss
    masks, the truncation after the first EOS (Detail 23) and the reward's EOS lookup (Detail 12) tell the end of a
    response from its padding by that [PAD]. pad_token="eos" pads with EOS itself instead (sft.py's Detail 3
    ablation); otherwise a tokenizer that already pads with EOS is refused."""
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    if pad_token == "eos":
        tokenizer.pad_token = tokenizer.eos_token  # Detail 3 ablation: EOS doubles as the pad token
    elif tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})  # Detail 3: Pythia ships no pad token
    if pad_token == "pad" and tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise RunError(
            f"the tokenizer of {model_path} pads with its EOS token {tokenizer.eos_token!r}; Detail 3 needs a distinct "
            "pad token, or the EOS of every response is taken for padding (masked out of the loss, never found as the "
            "end of a response). Save the tokenizer with tokenizer.add_special_tokens({'pad_token': '[PAD]'}) (or one "
            "without a pad token) and prepare the data with it (sft.py --pad_token eos runs the EOS-as-pad ablation on "
            "purpose; the later stages refuse its model)"
        )
    return tokenizer


def load_kto_data(args, tokenizer):
    """The training rows with row_index: the preference pairs (--feedback pairs: dpo.py's training rows, read as two
    examples each by pair_halves) or the unpaired examples (EXAMPLE_COLUMNS); and as in dpo.py every evaluation split
    of the preference pairs and the SFT validation queries sampled for the sample table. Every split is checked for the
    columns read from it and for the tokenizer that made it before any work; --num_eval_samples shortens the
    evaluation splits."""
    if args.feedback == "pairs":
        source, columns = args.preference_dataset, ["query_token", "chosen_token", "rejected_token"]
    else:
        source, columns = args.unpaired_dataset, EXAMPLE_COLUMNS
    train_raw = checks.load_split(source, args.train_split)
    checks.check_columns(train_raw, columns, f"{source} split {args.train_split!r}")
    checks.check_data_tokenizer(train_raw, tokenizer, args.sft_model_path, f"{source} split {args.train_split!r}")
    train_dataset = with_row_index(train_raw, columns)  # --feedback pairs: a row a pair, split by pair_halves
    eval_split_names = (args.eval_splits if args.eval_splits is not None
                        else preference_eval_splits(args.preference_dataset))
    eval_datasets = {}
    for split in eval_split_names:
        raw = checks.load_split(args.preference_dataset, split)
        checks.check_columns(raw, PAIR_COLUMNS + ["batch", "confidence", "split"],
                             f"{args.preference_dataset} split {split!r}")
        checks.check_data_tokenizer(raw, tokenizer, args.sft_model_path, f"{args.preference_dataset} split {split!r}")
        checks.check_query_response(raw, tokenizer.pad_token_id, f"{args.preference_dataset} split {split!r}")
        if args.num_eval_samples is not None:
            raw = raw.select(range(min(args.num_eval_samples, len(raw))))
        eval_datasets[split] = (raw, with_row_index(raw, PAIR_COLUMNS))
    sample_raw = checks.load_split(args.query_dataset, args.eval_split)
    checks.check_columns(sample_raw, ["query_token", "reference_response"],
                         f"{args.query_dataset} split {args.eval_split!r}")
    checks.check_data_tokenizer(sample_raw, tokenizer, args.sft_model_path,
                                f"{args.query_dataset} split {args.eval_split!r}")
    if args.num_eval_samples is not None:
        sample_raw = sample_raw.select(range(min(args.num_eval_samples, len(sample_raw))))
    return train_dataset, eval_datasets, sample_raw, with_row_index(sample_raw, ["query_token"])


def with_row_index(dataset, columns: List[str]):
    """Keep only `columns` (as torch tensors) plus `row_index`, the row's position in `dataset`.
    The index travels with every batch so that results gathered from several processes (and the
    precomputed reference log-probs) can be matched back to their rows."""
    dataset = dataset.add_column("row_index", list(range(len(dataset))))
    return dataset.with_format("torch", columns=columns + ["row_index"])


def preference_eval_splits(path: str) -> List[str]:
    """Every split of the preference dataset whose name starts with "validation" (Detail 6: the
    TL;DR validation set has out-of-distribution policy pairs and a CNN/DM split)."""
    names = list(load_from_disk(path).keys()) if os.path.isdir(path) else get_dataset_split_names(path)
    splits = sorted(name for name in names if name.startswith("validation"))
    if not splits:
        raise RunError(f"{path} has no split named validation*; it has {names}; pass --eval_splits")
    return splits


def count_updates(args, num_rows: int) -> int:
    """Optimizer updates of the run: --total_episodes rows (None: num_train_epochs passes over the num_rows of the
    train data) in full batches of total_batch_size; a last partial batch is dropped."""
    total_episodes = args.total_episodes if args.total_episodes is not None else args.num_train_epochs * num_rows
    num_updates = total_episodes // args.total_batch_size
    if num_updates < 1:
        raise RunError(f"{total_episodes} episodes give no full batch of {args.total_batch_size}; raise "
                       "--total_episodes (or --num_train_epochs) or lower --total_batch_size")
    return num_updates


def load_policy_and_reference(args, accelerator, tokenizer):
    """The two models of DPO, both the SFT model: the policy, with float32 master weights (bf16 is autocast), and
    the frozen reference, which may live in bf16 and never drops out (it must give the same log-probs every time).
    Detail 8: under ZeRO-3 the reference runs in a DeepSpeed inference engine (models.prepare_frozen_model)."""
    policy = AutoModelForCausalLM.from_pretrained(
        args.sft_model_path, dtype=torch.float32, trust_remote_code=args.trust_remote_code
    )
    ref_model = AutoModelForCausalLM.from_pretrained(
        args.sft_model_path, dtype=torch.bfloat16 if args.bf16 else torch.float32,
        trust_remote_code=args.trust_remote_code,
    )
    for model in (policy, ref_model):
        # a diverged save stops here, named with its first non-finite tensor
        checks.check_finite(model, args.sft_model_path)
        # the config's row count, not the weight's shape: ZeRO-3 partitions weights as they load
        if len(tokenizer) > model.config.vocab_size:
            model.resize_token_embeddings(len(tokenizer))
    if args.disable_dropout:  # Detail 7
        disable_dropout(policy)
    disable_dropout(ref_model)  # the reference is frozen and deterministic whatever --disable_dropout says
    return models.checkpointed(policy, args.gradient_checkpointing), models.prepare_frozen_model(accelerator, ref_model)


# ---------------------------------------------------------------------------------------------
# Helpers shared with the sibling scripts (identical copies; tests/test_shared_helpers.py)
# ---------------------------------------------------------------------------------------------


def exact_div(a: int, b: int, what: str = "batch size") -> int:
    """a / b as an int; raise a clear error when b does not divide a (batch arithmetic must be exact)."""
    q = a // b
    if q * b != a:
        raise RunError(f"{what}: {a} is not divisible by {b}; pick sizes so that it divides exactly")
    return q


def first_true_indices(bools: torch.Tensor, dtype=torch.long) -> torch.Tensor:
    """Per row, the index of the first True; the row length when the row has no True."""
    row_len = bools.size(-1)
    positions = torch.arange(row_len, dtype=dtype, device=bools.device)
    # a False entry is pushed past the end, so the minimum picks the first True (or row_len)
    return torch.where(bools, positions, torch.full_like(positions, row_len)).min(dim=-1).values


def disable_dropout(model: torch.nn.Module) -> None:
    """Detail 7: set every dropout probability to 0 so that training-mode forwards are deterministic.
    Besides the nn.Dropout modules, several attention implementations (GPT-NeoX, Llama, ...) apply dropout
    functionally from a float attribute of the attention module; those are zeroed too."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("attention_dropout", "attn_dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


def real_columns(query_responses: torch.Tensor, pad_token_id: int) -> slice:
    """The columns of a batch of (left-padded query + right-padded response) rows that hold a real token in some
    row. The columns outside are padding in every row: the model masks them out and positions count real tokens
    only (Detail 14), so cutting them changes no loss, log-prob or reward, only the compute. The data keeps its
    fixed widths on disk (Detail 5); each batch is cut to its own longest row when it meets the model."""
    real = (query_responses != pad_token_id).any(0).nonzero()
    if real.numel() == 0:
        return slice(0, query_responses.size(1))
    return slice(int(real[0]), int(real[-1]) + 1)


def forward(model, query_responses: torch.Tensor, pad_token_id: int, read):
    """Forward a padded batch. Pads are masked out and positions count real tokens only, so a
    left-padded query gets the same positions as an unpadded one (Detail 14). `read` runs the LM head only where the
    caller reads logits: a (B, T) bool mask -> (N, V) in row order, a slice of columns -> (B, columns, V); they are
    picked on the way into the model's own output layer, through any wrapper, so LoRA on that layer still applies."""
    attention_mask = query_responses != pad_token_id
    position_ids = attention_mask.long().cumsum(1) - attention_mask.long()
    input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
    head = getattr(model, "module", model).get_output_embeddings()  # DDP and DeepSpeed hold the model as .module
    pick = head.register_forward_pre_hook(lambda _, x: (x[0][:, read] if isinstance(read, slice) else x[0][read],))
    try:
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, return_dict=True)
    finally:
        pick.remove()


def query_once_inputs(query_responses: torch.Tensor, pad_token_id: int, context_length: int):
    """Each query once (--query_once): rows (B, T) of a LEFT-padded query in their first context_length columns and a
    RIGHT-padded response after it, as the keyword arguments of two passes through a model. The first runs each
    distinct query but its last token (Q, context_length - 1), its keys and values kept in a cache; the second runs
    every row's tail (B, T - context_length + 1), the query's last token and the response, after the cache's row of
    its own query, positions counting on from the query's real tokens (Detail 14). Causal attention lets no query
    token see a response, so every output of the second pass is the whole row's at that position up to float
    rounding, and a query's gradient is the sum of its rows'. Returns both passes' arguments and each row's query
    (B,), the cache row that the second pass reads (the first pass fills `past_key_values` in place)."""
    attention_mask = query_responses != pad_token_id
    position_ids = attention_mask.long().cumsum(1) - attention_mask.long()
    input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
    queries, rows = torch.unique(query_responses[:, : context_length - 1], dim=0, return_inverse=True)  # (Q, Tq-1)
    query_mask = queries != pad_token_id
    cache = DynamicCache()
    first = dict(input_ids=torch.masked_fill(queries, ~query_mask, 0), attention_mask=query_mask,
                 position_ids=query_mask.long().cumsum(1) - query_mask.long(), past_key_values=cache, use_cache=True)
    second = dict(input_ids=input_ids[:, context_length - 1 :], attention_mask=attention_mask,
                  position_ids=position_ids[:, context_length - 1 :], past_key_values=cache)
    return first, second, rows


def select_query_cache(cache, rows: torch.Tensor) -> None:
    """Each row's copy of its query's keys and values (rows (B,): a cache row per row), in place. index_select, whose
    backward sums every copy's gradient into its query's row; plain indexing's backward (index_put) is several times
    slower on the CPU (a sort), enough to undo the saving at the built-in shape."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)


def forward_query_once(model, query_responses: torch.Tensor, pad_token_id: int, context_length: int, read):
    """forward() of rows whose queries repeat, each distinct query run once (query_once_inputs). `read` is forward()'s
    (a (B, T) bool mask or a slice of the rows' columns) and reads only positions from context_length - 1 on, those
    that predict a response token. The model runs twice, the first time with no LM head output; a batch whose queries
    are all distinct runs once, as whole rows."""
    if context_length < 2:  # a one-token query leaves nothing before its last token to share
        return forward(model, query_responses, pad_token_id, read)
    first, second, rows = query_once_inputs(query_responses, pad_token_id, context_length)
    if first["input_ids"].size(0) == rows.numel():  # no query repeats: nothing to share
        return forward(model, query_responses, pad_token_id, read)
    head = getattr(model, "module", model).get_output_embeddings()  # as in forward()
    pick = head.register_forward_pre_hook(lambda _, x: (x[0][:, :0],))  # the queries' pass reads no logits
    try:
        model(**first)
    finally:
        pick.remove()
    if first["past_key_values"].get_seq_length() != context_length - 1:  # gradient checkpointing keeps no cache
        raise RuntimeError("--query_once found no key/value cache after the query's pass; run with --no_query_once")
    select_query_cache(first["past_key_values"], rows)
    start = context_length - 1  # the rows' column of the second pass's first token
    if isinstance(read, slice):
        read = slice(read.start - start, read.stop if read.stop is None or read.stop < 0 else read.stop - start)
    else:
        read = read[:, start:]
    pick = head.register_forward_pre_hook(lambda _, x: (x[0][:, read] if isinstance(read, slice) else x[0][read],))
    try:
        return model(**second, return_dict=True)
    finally:
        pick.remove()


def truncate_response(eos_token_id: int, pad_token_id: int, responses: torch.Tensor) -> torch.Tensor:
    """Detail 23: keep each response up to and including its first EOS, fill the rest with [PAD]."""
    eos_index = first_true_indices(responses == eos_token_id).unsqueeze(-1)  # (B, 1)
    positions = torch.arange(responses.size(1), device=responses.device).unsqueeze(0)  # (1, T)
    return torch.masked_fill(responses, positions > eos_index, pad_token_id)


def generate(lm, queries: torch.Tensor, pad_token_id: int, generation_config) -> torch.Tensor:
    """Sample continuations of LEFT-padded queries with the KV cache -> query_responses (B, Tq + Tr)."""
    context_length = queries.size(1)
    attention_mask = queries != pad_token_id
    input_ids = torch.masked_fill(queries, ~attention_mask, 0)
    sequences = lm.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config)
    return torch.cat((queries, sequences[:, context_length:]), dim=1)


def sampling_config(args, tokenizer, temperature: float) -> GenerationConfig:
    """Detail 23: exactly response_length tokens. eos_token_id=[] removes the stop criterion while EOS stays a
    normal token that can be sampled (min_new_tokens would forbid it). [PAD] is not an action. Pure sampling at
    `temperature` (top_k 0, top_p 1); temperature 0 decodes greedily."""
    if temperature < 0:
        raise RunError(f"a sampling temperature must be >= 0 (0 = greedy), got {temperature}")
    sampling = dict(temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else {}
    return GenerationConfig(
        max_new_tokens=args.response_length, do_sample=temperature > 0, **sampling,
        eos_token_id=[], pad_token_id=tokenizer.pad_token_id, suppress_tokens=[tokenizer.pad_token_id],
    )


class LoggingInterval:
    """The training metrics since the last log: one row of TRAIN_STATS per update (already averaged over micro
    batches and processes, so every process holds the same rows and a checkpoint can carry them), the tokens
    trained on and the time taken. Built from the trainer state (an empty interval, or a checkpoint's)."""

    def __init__(self, state: dict):
        self.rows, self.tokens = state["interval"], state["interval_tokens"]
        self.start = time.monotonic() - state["interval_time"]
        self.last_means = state["last_train_metrics"]  # the last logged means, for the summary

    def add(self, row: List[float], tokens: int) -> None:
        self.rows.append(row)
        self.tokens += tokens

    def close(self, lr: float, epoch: float) -> Dict[str, float]:
        """The interval's means (and throughput, learning rate, epoch); a new interval starts."""
        # an update that trained on no pair (online DPO: every pair of it a tie) has NaN means: each quantity is
        # averaged over the updates that did, and one that none did is left out of this log line
        columns = np.array(self.rows, dtype=float).T
        means = {key: float(np.nanmean(c)) for key, c in zip(TRAIN_STATS, columns) if not np.isnan(c).all()}
        elapsed = time.monotonic() - self.start  # (the updates' .tolist() waited for the device)
        means["train/tokens_per_s"] = self.tokens / elapsed
        means["time/update_s"] = elapsed / len(self.rows)  # each update's wall time, averaged over the interval
        means["train/lr"] = lr
        means["train/epoch"] = epoch
        self.last_means = means
        self.rows, self.tokens, self.start = [], 0, time.monotonic()
        return means

    def restart_clock(self) -> None:
        self.start = time.monotonic()

    def state(self) -> dict:
        return {"interval": self.rows, "interval_tokens": self.tokens, "interval_time": time.monotonic() - self.start,
                "last_train_metrics": self.last_means}


def shuffled_batches(dataset, batch_size: int, seed: int, collate_fn=None) -> DataLoader:
    """The training data order: micro batches of batch_size rows (a last partial one dropped) in a shuffle drawn from a
    generator of its own, which accelerate's seedable sampler (make_accelerator) reseeds with seed + epoch, so neither
    sampling nor a resume shifts it, and iterating the data never draws from the global torch RNG. The shuffle depends
    on the number of rows and the seed alone: kto.py --feedback pairs reads dpo.py's pairs in dpo.py's order,
    local_micro_batch_size / 2 pairs a micro batch, each pair read as its two halves (its collate_fn)."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True,
                      generator=torch.Generator().manual_seed(seed), collate_fn=collate_fn)


def resumable_micro_batches(loader, skip: int):
    """Micro batches of an accelerate-prepared DataLoader, epoch after epoch without end, starting after
    the first `skip` of them: the data position of a run resumed after skip // accumulation updates.

    The loader must come from an Accelerator made with DataLoaderConfiguration(use_seedable_sampler=True,
    data_seed=seed): its shuffle of epoch e is then drawn from a generator seeded with seed + e, so it
    depends on e alone and not on how many epochs this process has iterated before. A resumed run can
    therefore set epoch e directly and drop the micro batches of it already trained on; skip_first_batches
    drops them from the index lists (no row is read). Every process skips its own share the same way."""
    per_epoch = len(loader)  # micro batches per process and epoch (drop_last)
    if per_epoch == 0:
        raise RunError("the train split is smaller than one micro batch per process; "
                       "lower --local_micro_batch_size or use more data")
    epoch, skip = divmod(skip, per_epoch)
    while True:
        loader.set_epoch(epoch)  # the shuffle of this epoch (the skipping copy below inherits it)
        yield from (skip_first_batches(loader, skip) if skip else loader)
        epoch, skip = epoch + 1, 0


def lr_schedule(optimizer, kind: str, num_updates: int, warmup_steps: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning rate of update t (from 0) over num_updates updates, as a multiple of --lr: a linear warm-up from 0
    over the first warmup_steps updates, then cosine decays to 0 as 0.5 * (1 + cos(pi * progress)) and linear as
    (T - t) / (T - warmup); constant stays 1 and, as in transformers, ignores the warm-up. These are
    transformers.get_scheduler's multipliers bit for bit (tests/test_lr_schedule.py), written out because importing
    get_scheduler loads peft and bitsandbytes through transformers.trainer_utils, about 3 s of every process."""
    if kind not in ("cosine", "linear", "constant"):
        raise ValueError(f"unknown learning-rate schedule {kind!r}: cosine, linear or constant")

    def multiplier(t: int) -> float:  # transformers' arithmetic, in its order, so that every float is the same
        if kind == "constant":
            return 1.0
        if t < warmup_steps:
            return float(t) / float(max(1, warmup_steps))
        if kind == "linear":
            return max(0.0, float(num_updates - t) / float(max(1, num_updates - warmup_steps)))
        progress = float(t - warmup_steps) / float(max(1, num_updates - warmup_steps))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(0.5) * 2.0 * progress)))  # num_cycles 0.5: half a wave

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True))
    leave_processes()  # after a multi-process run: exit without the teardown that can abort (rlhf_utils/run.py)
