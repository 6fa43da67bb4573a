"""Direct Preference Optimization (DPO) on TL;DR, with IPO, hinge and conservative DPO (cDPO) as options:
Appendix A of "The N+ Implementation Details of RLHF with PPO" (eq. 4-5), Detail 19 and Table 6; IPO and cDPO as
listed in OpenRLHF (Appendix A.4).

The policy and a frozen reference both start from the SFT model. One update = `total_batch_size` preference pairs
(x, y_c, y_r) (Table 6: 64), in micro batches with gradient accumulation:

  1. chosen and rejected sequences of a micro batch go through the policy in one forward pass
  2. log pi(y|x) = the SUM of the response tokens' log-probs (eq. 4 compares whole sequences)
  3. the same under the frozen reference: computed live, or read from tables computed once before training
     (--precompute_ref_logprobs)
  4. h = (log pi(y_c|x) - log pi(y_r|x)) - (log ref(y_c|x) - log ref(y_r|x)), the difference of the log-ratios
  5. loss per pair: DPO -log sigmoid(beta * h) (cDPO: with label smoothing), IPO (h - 1 / (2 beta))^2 or
     hinge max(0, 1 - beta * h); the mean over the pairs
  6. AdamW step, cosine learning-rate schedule (Table 6)
Evaluation: the log-ratios give DPO's implicit reward model r(x, y) = beta * log(pi(y|x) / pi_ref(y|x)) (eq. 5),
whose accuracy on the validation pairs goes in the same table as reward.py's (Detail 19); samples of the policy
go to samples.csv.

Single process:   python dpo.py --sft_model_path models/sft --output_dir models/dpo
Several GPUs:     accelerate launch --config_file zero2.yaml dpo.py --sft_model_path models/sft
LoRA / QLoRA:     ... --lora_rank 8 [--load_in_4bit]: the reference is the policy with its adapters off; the saved
                  policy has them merged (float32)
After a crash:    the same command with --resume (and --run_name of the run, if it is not the newest): it continues
                  from the latest checkpoint in runs/{run_name}/checkpoints (policy, AdamW, schedule, data position,
                  open logging interval, RNG states; precomputed reference log-probs are read back from the run
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
from rlhf_utils.flags import RunFlags, check_dpo_flags
from rlhf_utils.run import LastGoodState, Run, due, evaluation_rng, leave_processes, seeded_accelerator, start_processes


@dataclass
class Args:
    # experiment bookkeeping
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (the script's file stem)"""
    seed: int = 1
    """seed of weights and data order (every rank); sampling uses seed + process_index * 100003"""
    output_dir: str = "models/dpo"
    """where the trained policy and its tokenizer are saved (safetensors)"""

    # models and data
    sft_model_path: str = "models/sft"
    """the SFT model (local folder written by sft.py, or a hub name): the policy's start AND the reference"""
    trust_remote_code: bool = False
    """passed to from_pretrained for models with custom code"""
    preference_dataset: str = "vwxyzjn/summarize_from_feedback_oai_preprocessing_1706381144"
    """processed preference pairs (hub name, or a local save_to_disk folder from data/prepare.py)"""
    query_dataset: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """processed SFT dataset whose validation queries are sampled for the generation table"""
    train_split: str = "train"
    """preference split to train on"""
    eval_splits: Optional[List[str]] = None
    """preference splits for the implicit-reward accuracy table; None = every split whose name starts
    with "validation" (TL;DR: validation and validation_cnndm)"""
    eval_split: str = "validation"
    """split of --query_dataset whose queries are sampled for samples.csv"""

    # Table 6 hyperparameters
    beta: float = 0.05
    """Table 6: beta, the KL coefficient of the implicit RLHF objective (the same 0.05 as PPO's --ppo.kl_coef);
    larger keeps the policy closer to the reference"""
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    """sigmoid = DPO (eq. 4, with --label_smoothing for cDPO); ipo = IPO's squared loss; hinge = SLiC's hinge"""
    ipo_average: bool = True
    """--loss_type ipo only: average each response's log-probs over its tokens before regressing onto 1 / (2 beta),
    the form the IPO authors ran (and TRL's); --no_ipo_average sums them as eq. 4 does, which puts the target on the
    whole response instead of on each token"""
    label_smoothing: float = 0.0
    """conservative DPO (cDPO): assumed probability that a preference label is flipped; sigmoid loss only"""
    precompute_ref_logprobs: bool = False
    """compute the reference's sequence log-probs once over the data before training (kept in the run folder),
    then free the reference model: a training step runs one forward pass (the policy's) instead of two"""
    num_train_epochs: int = 1
    """Table 6: 1 epoch"""
    total_episodes: Optional[int] = None
    """number of preference pairs to train on; None = num_train_epochs x the train split (92,858 on TL;DR)"""
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
    """Table 6: pairs per optimizer update over all processes = local_micro_batch_size x gradient
    accumulation steps x number of processes"""
    local_micro_batch_size: int = 8
    """pairs per forward/backward pass on one process (each pair is two sequences: chosen and rejected)"""
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
    save_policy_at: List[int] = field(default_factory=list)
    """updates after which a policy snapshot is saved in {output_dir}/snapshots/update_N (0: the starting policy; the
    last: before the final evaluation), with its weights' digest and budget, for pipeline.py --mode frontier"""
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
# The update: the docstring's steps on one batch (the pieces it shares with the forks follow main)
# ---------------------------------------------------------------------------------------------


TRAIN_STATS = [  # per micro batch, logged as means over the logging interval
    "train/loss", "train/rewards/chosen", "train/rewards/rejected", "train/rewards/margins", "train/rewards/accuracy",
    "train/logps/chosen", "train/logps/rejected",
]


def dpo_update(args, accelerator, run, policy, optimizer, ref_model, train_ref_table, micro_batches, update: int,
               pad_token_id: int):
    """Steps 1-6 of one update, on this process's next gradient_accumulation_steps micro batches: the loss of each
    and its gradient (accumulated; the non-finite guard checks the loss before each backward pass), then one AdamW
    step after the last micro batch. Returns the means over the micro batches of this process's TRAIN_STATS and
    the number of tokens trained on."""
    micro_stats, tokens = [], 0
    for _ in range(args.gradient_accumulation_steps):
        batch = next(micro_batches)
        with accelerator.accumulate(policy):
            with accelerator.autocast():  # steps 1-3: sequence log-probs (B,) of chosen and rejected
                policy_chosen, policy_rejected = concatenated_logprobs(
                    policy, batch, pad_token_id, args.query_once and not args.gradient_checkpointing)
                ref_chosen, ref_rejected = reference_logprobs(ref_model, train_ref_table, batch, pad_token_id,
                                                              args.query_once)
            losses, chosen_rewards, rejected_rewards = dpo_loss(  # steps 4-5
                policy_chosen, policy_rejected, ref_chosen, ref_rejected, args.beta, args.loss_type,
                args.label_smoothing, ipo_token_counts(args, batch, pad_token_id),
            )
            loss = losses.mean()
            # non-finite guard before backward: a NaN never reaches the gradients or the weights
            run.guard(update, **{
                "train/loss": loss, "train/logps/chosen": policy_chosen, "train/logps/rejected": policy_rejected,
                "train/ref_logps/chosen": ref_chosen, "train/ref_logps/rejected": ref_rejected,
            })
            accelerator.backward(loss)  # divided by gradient_accumulation_steps inside
            optimizer.step()  # step 6; a no-op until the last micro batch of the update
            optimizer.zero_grad()
        micro_stats.append(torch.stack([  # in the order of TRAIN_STATS
            loss.detach(), chosen_rewards.mean(), rejected_rewards.mean(),
            (chosen_rewards - rejected_rewards).mean(), (chosen_rewards > rejected_rewards).float().mean(),
            policy_chosen.detach().mean(), policy_rejected.detach().mean(),
        ]).float())
        tokens += int(
            (batch["query_chosen_token"] != pad_token_id).sum() + (batch["query_rejected_token"] != pad_token_id).sum()
        )
    if not accelerator.sync_gradients:
        raise RuntimeError("gradient accumulation went out of step with the update loop")
    return torch.stack(micro_stats).mean(0), tokens


def main(args: Args) -> dict:
    start_time = time.monotonic()
    check_dpo_flags(args)
    # ---------------- processes, batch arithmetic (Table 6: 64 pairs per update), run folder ----------------
    accelerator = make_accelerator(args)  # gradient accumulation, a resumable data order, bf16, DeepSpeed's settings
    checks.check_qlora_flags(args, accelerator)
    run = Run(args, accelerator)  # run name and folder (rlhf_utils/run.py)
    run.inputs(sft_model_path=args.sft_model_path, preference_dataset=args.preference_dataset,
               query_dataset=args.query_dataset)

    # ---------------- seeding (labelled, deliberate) ----------------
    set_seed(args.seed)  # weights and data order: identical on every rank
    local_seed = args.seed + accelerator.process_index * 100003  # sampling differs per rank

    # ---------------- tokenizer and data ----------------
    tokenizer = load_tokenizer(args.sft_model_path, args.trust_remote_code)  # Detail 3: [PAD] distinct from EOS
    pad_token_id = tokenizer.pad_token_id
    train_dataset, eval_datasets, sample_raw, sample_dataset = load_dpo_data(args, tokenizer)
    args.num_updates = num_updates = count_updates(args, len(train_dataset))
    run.claim_output_dir()  # every input check has passed: only now mark --output_dir as this run's

    # ---------------- models: the policy and the frozen reference, both the SFT model ----------------
    # with LoRA (--lora_rank) the reference is the policy with its adapters off (QLoRA: the same 4-bit base)
    policy, ref_model = (load_lora_policy_and_reference(args, accelerator, tokenizer) if args.lora_rank > 0
                         else load_policy_and_reference(args, accelerator, tokenizer))
    generation_config = sampling_config(args, tokenizer, args.eval_temperature)  # Detail 23: EOS trick
    # --precompute_ref_logprobs: the reference's log-probs of every pair, computed once; then the reference is freed
    train_ref_table, ref_tables = reference_logprob_tables(args, accelerator, run, ref_model, train_dataset,
                                                           eval_datasets, pad_token_id)
    if args.precompute_ref_logprobs:
        ref_model = None
    trained = [p for p in policy.parameters() if p.requires_grad]  # all of them, or the LoRA adapters alone
    adamw = torch.optim.AdamW(trained, lr=args.lr, eps=args.eps, weight_decay=args.weight_decay)
    # the schedule (Table 6) counts optimizer updates and is stepped by hand on each update (not prepared:
    # accelerate's wrapper would step it once per process)
    lr_scheduler = lr_schedule(adamw, args.scheduler, num_updates, args.warmup_steps)
    # the data order, from a generator of its own (shuffled_batches); kto.py reads the same pairs in the same order
    train_dataloader = shuffled_batches(train_dataset, args.local_micro_batch_size, args.seed)
    policy, optimizer, train_dataloader = accelerator.prepare(policy, adamw, train_dataloader)
    accelerator.register_for_checkpointing(lr_scheduler)  # saved and restored with the policy and optimizer
    torch.manual_seed(local_seed)  # draws differ across ranks from here on (evaluation: its own, evaluation_rng)

    # ---------------- resume and logs ----------------
    last_good = LastGoodState(run, accelerator, adamw, lr_scheduler)  # the non-finite guard's fallback
    # the trainer state: the update reached and the open logging interval. The frozen reference is not saved: it is
    # the SFT model, loaded again (or its log-probs read back from the run folder)
    state = run.start({"update": 0, "interval": [], "interval_tokens": 0, "interval_time": 0.0,
                       "last_train_metrics": {}}, num_updates=num_updates)
    start_update = state["update"]
    accelerator.step = start_update * args.gradient_accumulation_steps  # accelerate's count of micro batches
    interval = LoggingInterval(state)  # training metrics since the last log, carried by checkpoints
    # the data position: every update reads gradient_accumulation_steps micro batches on each process
    micro_batches = resumable_micro_batches(train_dataloader, start_update * args.gradient_accumulation_steps)

    def run_evaluation(update: int, final: bool = False) -> dict:
        """Detail 19: the implicit reward model on the preference splits; samples of the policy."""
        pairs = evaluate_preferences(accelerator, policy, ref_model, ref_tables, eval_datasets, args, pad_token_id)
        sampled = sample_responses(accelerator, policy, tokenizer, sample_dataset, generation_config, args)
        report = preference_report(pairs, eval_datasets)  # Detail 19's accuracy table and the eval/ metrics
        metrics = records.write_evaluation(run, args, update, final, report, sampled, sample_raw, tokenizer)
        run.log(update, {"episode": update * args.total_batch_size, **metrics})
        return metrics

    # ---------------- training: one optimizer update per total_batch_size pairs ----------------
    accelerator.print(
        f"DPO ({args.loss_type}, beta {args.beta}): {num_updates} updates of {args.total_batch_size} pairs, "
        f"{accelerator.num_processes} process(es) x {args.gradient_accumulation_steps} accumulation x "
        f"{args.local_micro_batch_size} pairs"
    )
    policy.train()

    def snapshot(update: int) -> None:  # the policy after `update` (models.save_snapshot), with the budget spent
        models.save_snapshot(accelerator, policy, accelerator.unwrap_model(policy), tokenizer, args.output_dir, update,
                             {"budget/pairs_read": update * args.total_batch_size, "num_updates": num_updates},
                             merge=models.merged_policy if args.lora_rank > 0 else None)

    if start_update == 0 and models.snapshot_due(args, 0, num_updates):  # the starting policy, before update 1
        snapshot(0)
    progress = tqdm(total=num_updates, initial=start_update, desc=args.exp_name,
                    disable=not accelerator.is_local_main_process)
    with progress:  # closed before an error's message, which stays the last line of the output
        for update in range(start_update + 1, num_updates + 1):
            with last_good.kept(update, interval.state()):  # a non-finite value: the state after update - 1 is saved
                stats, tokens = dpo_update(args, accelerator, run, policy, optimizer, ref_model, train_ref_table,
                                           micro_batches, update, pad_token_id)  # steps 1-6
            update_lr = lr_scheduler.get_last_lr()[0]  # the learning rate this update used
            lr_scheduler.step()

            # ---------------- logging: means over updates, micro batches and processes ----------------
            interval.add(accelerator.reduce(stats, reduction="mean").tolist(),
                         int(accelerator.reduce(torch.tensor(tokens, device=accelerator.device), reduction="sum")))
            episode = update * args.total_batch_size
            progress.update(1)
            if update % args.log_every == 0 or update == num_updates:
                means = interval.close(update_lr, episode / len(train_dataset))
                run.log(update, {"episode": episode, **means})
                progress.set_postfix(loss=f"{means['train/loss']:.4f}", acc=f"{means['train/rewards/accuracy']:.3f}",
                                     tok_s=f"{means['train/tokens_per_s']:.0f}")
            if due(args.eval_every, update, num_updates):
                run_evaluation(update)
                interval.restart_clock()  # evaluation time is not training throughput
            if models.snapshot_due(args, update, num_updates):
                snapshot(update)
            # after the update's logging and evaluation, so a resumed run repeats neither
            if due(args.run.checkpoint_every, update, num_updates):
                run.checkpoint(update, interval.state())

    # ---------------- final evaluation and outputs ----------------
    metrics = run_evaluation(num_updates, final=True)
    summary = {**metrics, **interval.last_means,  # the last logging interval's training means
               "num_updates": num_updates, "episodes": num_updates * args.total_batch_size,
               # the budget as spent (report.py's leaderboard reads it): every update read total_batch_size pairs
               "budget/updates": num_updates, "budget/pairs_read": num_updates * args.total_batch_size,
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


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss_type: str,
    label_smoothing: float = 0.0,
    token_counts: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
):
    """Per-pair losses (B,) and the implicit rewards of chosen and rejected (B,), (B,).

    With pi = policy sequence log-probs and ref = reference sequence log-probs:
        h = (pi_c - pi_r) - (ref_c - ref_r)   # difference of the two log-ratios
        r_c = beta * (pi_c - ref_c),  r_r = beta * (pi_r - ref_r)   # eq. 5, so beta * h = r_c - r_r
    """
    if label_smoothing != 0.0 and loss_type != "sigmoid":
        raise ValueError(f"--label_smoothing is conservative DPO, defined for --loss_type sigmoid, not {loss_type}")
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if loss_type == "sigmoid":
        # DPO (eq. 4) with cDPO's label smoothing eps (the label is flipped with probability eps):
        #   L = -(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        # IPO (Azar et al.): regress h onto the finite target 1 / (2 beta) instead of pushing it to infinity:
        #   L = (h - 1 / (2 * beta))^2
        # With token_counts (n_c, n_r) (--ipo_average, the default) each log-ratio is averaged over its response's
        # tokens, as the IPO authors ran it:  h = (pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r. Without them, h uses
        # summed log-probs as eq. 4 does, and the target 1 / (2 beta) is a margin over the whole response.
        if token_counts is not None:
            h = (policy_chosen - ref_chosen) / token_counts[0] - (policy_rejected - ref_rejected) / token_counts[1]
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        # hinge (SLiC-style), a margin of 1 on the reward difference:
        #   L = max(0, 1 - beta * h)
        losses = torch.relu(1 - beta * h)
    else:
        raise ValueError(f"unknown --loss_type {loss_type!r}")
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    return losses, chosen_rewards, rejected_rewards


def ipo_token_counts(args, batch: Dict[str, torch.Tensor], pad_token_id: int):
    """The response tokens (with the EOS) of chosen and rejected, (B,) each, that IPO averages over
    (--loss_type ipo with --ipo_average); None for every other loss."""
    if args.loss_type != "ipo" or not args.ipo_average:
        return None
    labels = (batch[f"query_{side}_token_response_label"] for side in ("chosen", "rejected"))
    return tuple((label != pad_token_id).sum(1) for label in labels)


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
def evaluate_preferences(accelerator, model, ref_model, ref_tables, eval_datasets, args: Args, pad_token_id: int):
    """Detail 19: DPO as a reward model. For every pair of every evaluation split: its loss, the implicit rewards
    beta * log(pi / pi_ref) of chosen and rejected (the pair is ranked right when chosen's is higher) and the policy's
    sequence log-probs, gathered from every process. Returns {split: per-pair frame, rows matched by row_index}."""
    model.eval()
    frames = {}
    for split, (_, dataset) in eval_datasets.items():
        dataloader = accelerator.prepare_data_loader(DataLoader(dataset, batch_size=args.local_eval_batch_size))
        gathered = []
        for batch in dataloader:
            with accelerator.autocast():
                policy_chosen, policy_rejected = concatenated_logprobs(
                    model, batch, pad_token_id, args.query_once and not args.gradient_checkpointing)
                ref_chosen, ref_rejected = reference_logprobs(ref_model, ref_tables.get(split), batch, pad_token_id,
                                                              args.query_once)
            losses, chosen_rewards, rejected_rewards = dpo_loss(
                policy_chosen, policy_rejected, ref_chosen, ref_rejected, args.beta, args.loss_type,
                args.label_smoothing, ipo_token_counts(args, batch, pad_token_id),
            )
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
# The options main switches on: the reference's log-probs computed once, LoRA and QLoRA
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def precompute_reference_logprobs(accelerator: Accelerator, ref_model, dataset, batch_size: int, pad_token_id: int,
                                  query_once: bool = False):
    """One pass of the reference over `dataset` (made by with_row_index) -> table (N, 2) of
    [chosen, rejected] sequence log-probs, indexed by row. Rows are split across processes and
    gathered back by row index."""
    dataloader = accelerator.prepare_data_loader(DataLoader(dataset, batch_size=batch_size, shuffle=False))
    table = torch.full((len(dataset), 2), float("nan"))
    for batch in tqdm(dataloader, desc="reference log-probs", disable=not accelerator.is_local_main_process):
        with accelerator.autocast():
            chosen, rejected = concatenated_logprobs(ref_model, batch, pad_token_id, query_once)
        rows, chosen, rejected = accelerator.gather_for_metrics((batch["row_index"], chosen, rejected))
        table[rows.cpu()] = torch.stack((chosen, rejected), dim=1).float().cpu()
    if torch.isnan(table).any():
        raise RuntimeError("some rows got no reference log-prob; the gathered row indices do not cover the dataset")
    return table


def reference_logprob_tables(args, accelerator, run, ref_model, train_dataset, eval_datasets, pad_token_id: int):
    """--precompute_ref_logprobs: the reference's sequence log-probs of every train and evaluation pair
    (precompute_reference_logprobs), as a train table (N_train, 2) and {evaluation split: table (N, 2)}. The tables
    are kept in the run folder: a resumed run reads the very numbers the interrupted run trained with (and skips
    the pass over the data) instead of trusting a second pass to repeat them bit for bit. Without the flag the
    reference runs live: (None, {}), and a fresh run deletes an older run's tables."""
    ref_cache = os.path.join(run.dir, "reference_logprobs.pt")
    if not args.precompute_ref_logprobs:
        if not args.run.resume and accelerator.is_main_process and os.path.exists(ref_cache):
            os.remove(ref_cache)  # an older run's tables; this run computes the reference live
        return None, {}
    sizes = {"train": len(train_dataset), "eval": {split: len(raw) for split, (raw, _) in eval_datasets.items()}}
    if args.run.resume and os.path.exists(ref_cache):
        cached = torch.load(ref_cache)
        found = {"train": len(cached["train"]), "eval": {split: len(t) for split, t in cached["eval"].items()}}
        if found != sizes:
            raise RunError(f"--resume: {ref_cache} holds reference log-probs of {found} rows, these flags read "
                             f"{sizes}; resume with the data flags of the original run")
        accelerator.print(f"reference log-probs of the interrupted run read from {ref_cache}")
        return cached["train"], cached["eval"]
    train_ref_table = precompute_reference_logprobs(
        accelerator, ref_model, train_dataset, args.local_eval_batch_size, pad_token_id, args.query_once
    )
    ref_tables = {}
    for split, (_, dataset) in eval_datasets.items():
        ref_tables[split] = precompute_reference_logprobs(
            accelerator, ref_model, dataset, args.local_eval_batch_size, pad_token_id, args.query_once
        )
    if accelerator.is_main_process:  # written whole, then renamed: never half a file under the name
        os.makedirs(run.dir, exist_ok=True)
        torch.save({"train": train_ref_table, "eval": ref_tables}, ref_cache + ".tmp")
        os.replace(ref_cache + ".tmp", ref_cache)
    return train_ref_table, ref_tables


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


def load_dpo_data(args, tokenizer):
    """The preference pairs to train on, every evaluation split of them and the SFT validation queries sampled for
    the sample table. Every split is checked for the columns read from it and for the tokenizer that made it before
    any work. Returns the train split (tensors with row_index), {split: (raw rows, tensors)} for evaluation, and the
    sample queries (raw rows, tensors); --num_eval_samples shortens the evaluation splits."""
    train_raw = checks.load_split(args.preference_dataset, args.train_split)
    checks.check_columns(train_raw, PAIR_COLUMNS, f"{args.preference_dataset} split {args.train_split!r}")
    checks.check_data_tokenizer(train_raw, tokenizer, args.sft_model_path,
                                f"{args.preference_dataset} split {args.train_split!r}")
    train_dataset = with_row_index(train_raw, PAIR_COLUMNS)
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
