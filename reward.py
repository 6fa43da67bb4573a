"""Reward model training: the paper's section 6 and Appendix E (Details 10-18, Table 4, Table 5, Figure 5).

A scalar reward model r(x, y) is trained on pairs of summaries of the same post, one preferred by a
human rater (chosen) and one not (rejected), with the pairwise loss -log sigmoid(r(x, y_c) - r(x, y_r)).

  model    1. the SFT model's transformer trunk plus a bias-free linear head, weights drawn
              from N(0, std = 1 / sqrt(d_model + 1)); --reward_head_init library is the ablation      (Detail 11)
  train    2. chosen and rejected of a micro batch in one forward call: each query once, both responses
              reading its keys and values (--score_query_once; the reference runs two whole rows); a
              sequence's reward is the head's output at its EOS: the first [PAD] of the response minus 1
              (the last token when there is no pad)                                                   (Detail 12)
           3. loss -log sigmoid(r_chosen - r_rejected); 1 epoch, AdamW (eps 1e-5, lr 3e-6), cosine
              schedule, batch 64                                                             (Detail 10, Table 4)
  after    4. score the SFT reference summaries with a left-padded query (as PPO does) and as one
              right-padded row: almost the same reward; we report the difference                      (Detail 14)
           5. shift the model so that the references score mean 0, folded into the final norm's bias  (Detail 15)
           6. evaluate on every validation split: accuracy by annotation batch, confidence and split
              (Details 6, 16: the analogue of Table 5), calibration against the ideal 1 / (1 + e^-d)
              (Detail 18), and the head's output at non-EOS positions, which is no reward (Detail 13)

Launch: `python reward.py ...` on one process, `accelerate launch [--config_file zero2.yaml] reward.py ...`
on several. The saved model is a plain `AutoModelForSequenceClassification` with one label: any tool can
load it, and scores come from `get_reward` below (docs/usage.md has a four-line example).

Interrupted runs: every --checkpoint_every updates the scorer (trunk + head), AdamW, the schedule, the data
position and the RNG states go to runs/{run_name}/checkpoints; `--resume` continues from the latest one and ends
with the same weights and metrics as a run that was never stopped (steps 4-6 run after training as usual). A NaN
or inf loss or reward stops the run before it reaches the weights; the state after the update before is saved as
that update's checkpoint, from which --resume goes on as from an ordinary one.
"""

import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Annotated, Literal, Optional

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
import tyro
from accelerate import skip_first_batches
from accelerate.utils import set_seed
from datasets import load_from_disk
from statsmodels.stats.proportion import proportion_confint
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DynamicCache

from rlhf_utils import checks, models, records
from rlhf_utils.checks import RunError
from rlhf_utils.flags import RunFlags
from rlhf_utils.run import LastGoodState, Run, due, leave_processes, seeded_accelerator, start_processes


@dataclass
class Args:
    # ---- experiment bookkeeping ----
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (the run name starts with it)"""
    seed: int = 1
    """seed for the head initialisation and the data order (the same on every process)"""
    output_dir: str = "models/rm"
    """where the trained reward model and its tokenizer are saved (safetensors)"""

    # ---- model and data ----
    sft_model_path: str = "models/sft"
    """the SFT model to start from (Detail 11): a hub name or a local save_pretrained folder"""
    preference_dataset: str = "vwxyzjn/summarize_from_feedback_oai_preprocessing_1706381144"
    """the processed preference dataset (hub name, or a local folder written by data/prepare.py)"""
    query_dataset: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """the processed SFT dataset whose reference summaries set the normalisation (Detail 15) and the
    left/right padding check (Detail 14)"""
    train_split: str = "train"
    """the preference split to train on"""
    eval_splits: tuple[str, ...] = ("validation", "validation_cnndm")
    """preference splits to evaluate on; those absent from the dataset are skipped (with a message)"""
    normalization_split: str = "train"
    """the split of --query_dataset whose references are scored for Detail 15"""
    trust_remote_code: bool = False
    """allow model code from the hub (needed by some non-Pythia models)"""

    # ---- Detail 11: reward head initialisation ----
    reward_head_init: Literal["paper", "library"] = "paper"
    """paper: head weights ~ N(0, reward_head_init_std) as in Stiennon et al. (Detail 11);
    library: the transformers default for a fresh head, N(0, config.initializer_range) (the ablation)"""
    reward_head_init_std: Optional[float] = None
    """std of the paper init; None -> 1 / sqrt(d_model + 1). Only valid with --reward_head_init paper"""

    # ---- Detail 15: normalisation on the SFT references ----
    normalize_reward: bool = True
    """after training, shift the model so that the SFT reference summaries score mean 0 (Detail 15)"""
    num_normalization_samples: Optional[int] = None
    """how many references (the first N of the split) to score for Detail 15 and 14; None -> all"""

    # ---- optimisation (Table 4) ----
    num_train_epochs: int = 1
    """passes over the preference train split (Table 4: 1)"""
    total_episodes: Optional[int] = None
    """number of preference pairs to train on; None -> num_train_epochs x the size of the train split"""
    lr: float = 3e-6
    """AdamW learning rate (Table 4)"""
    eps: float = 1e-5
    """AdamW epsilon (Table 4)"""
    weight_decay: float = 0.01
    """AdamW weight decay (0.01: torch's default, which the reference implementation keeps)"""
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    """learning-rate schedule, decaying to 0 over the run (Table 4: cosine)"""
    warmup_steps: int = 0
    """optimizer steps of linear warm-up before the schedule (the paper uses none)"""
    total_batch_size: int = 64
    """pairs per optimizer step over all processes (Table 4: 64)"""
    local_micro_batch_size: int = 8
    """pairs per forward pass on one process (chosen and rejected make 2x this many sequences)"""
    gradient_accumulation_steps: Optional[int] = None
    """micro batches per optimizer step; None = derived from the batch sizes, else checked against them"""
    disable_dropout: bool = True
    """Detail 7: set every dropout probability to 0"""
    bf16: Optional[bool] = None
    """bf16 mixed precision, as the paper trained (Detail 8); None = on when a CUDA device supports bf16. The CPU
    runs float32 unless --bf16 asks for bf16 (slow there)"""
    score_query_once: bool = True
    """each pair's query goes through the model once and both responses read its keys and values, not two whole rows
    as the reference code and TRL run them: the same rewards and gradients up to float rounding, less compute; with
    --no_disable_dropout both share the query's dropout mask (docs/usage.md, "Flags in depth")"""
    gradient_checkpointing: bool = False
    """activation checkpointing in every model that trains here: less activation memory for about one more forward
    pass; the loss and gradients are the same. Off: the paper trained without it (docs/usage.md, "Flags in depth")"""

    # ---- evaluation and logging ----
    eval_every: int = 0
    """evaluate every N optimizer steps during training (0 -> only after training)"""
    num_eval_samples: Optional[int] = None
    """evaluate on the first N pairs of each split; None -> all of them (Detail 16 warns that different
    subsets give incomparable accuracies, so the default is the whole split)"""
    local_eval_batch_size: int = 16
    """pairs per forward pass during evaluation"""
    num_calibration_bins: int = 10
    """bins of score difference in the calibration plot (Detail 18)"""
    num_logit_plot_samples: int = 4
    """sequences drawn in the per-token reward-logit plot (Detail 13)"""
    log_every: int = 1
    """write training metrics every N optimizer steps"""

    run: Annotated[RunFlags, tyro.conf.OmitArgPrefixes] = field(default_factory=RunFlags)
    """the run's folder, checkpoints, --resume, lock, tracking and hub (rlhf_utils/flags.py): they decide no number"""

    # ---- derived at run time (not flags) ----
    world_size: tyro.conf.Suppress[Optional[int]] = None
    """number of processes"""
    num_updates: tyro.conf.Suppress[Optional[int]] = None
    """optimizer updates of the whole run"""
    head_init_std: tyro.conf.Suppress[Optional[float]] = None
    """the std the reward head was drawn with (Detail 11)"""


# ---------------------------------------------------------------------------------------------
# Reward model pieces (module-level so that tests can check each one against a hand computation)
# ---------------------------------------------------------------------------------------------


class RewardScorer(torch.nn.Module):
    """The sequence-classification model with `get_reward` as its forward.

    Training goes through this wrapper so that accelerate's DDP / DeepSpeed wrapper sees the whole
    scoring computation as one forward call (gradient synchronisation and accumulation hook into it).
    Returns what `get_reward` returns: per-token reward logits (B, T), rewards (B,), EOS indices (B,); called with
    queries and two response batches, what `get_pair_rewards` returns."""

    def __init__(self, rm, pad_token_id: int):
        super().__init__()
        self.rm = rm
        self.pad_token_id = pad_token_id

    def forward(self, query_responses: torch.Tensor, context_length: int, pair: Optional[tuple] = None):
        if pair is not None:  # query_responses holds the queries alone, pair the (chosen, rejected) responses
            return get_pair_rewards(self.rm, query_responses, *pair, self.pad_token_id)
        return get_reward(self.rm, query_responses, self.pad_token_id, context_length)


def init_reward_head(model, mode: str, std: Optional[float]) -> float:
    """Detail 11: draw the scalar head's weights; return the std used.

    `paper`: N(0, 1 / sqrt(d_model + 1)) (or the given std), as in Stiennon et al.'s reference code.
    `library`: N(0, config.initializer_range), which is what transformers' `_init_weights` gives a
    fresh `nn.Linear` head (0.02 for Pythia); written out here so that the ablation is explicit.
    The GPT-NeoX sequence-classification head has no bias, which is the paper's zero bias."""
    if mode == "paper":
        std = 1.0 / math.sqrt(model.config.hidden_size + 1) if std is None else std
    elif std is not None:
        raise RunError("--reward_head_init_std only applies to --reward_head_init paper")
    else:
        std = model.config.initializer_range
    with torch.no_grad(), models.whole_parameters([model.score.weight, model.score.bias]):
        torch.nn.init.normal_(model.score.weight, mean=0.0, std=std)
        if model.score.bias is not None:
            torch.nn.init.zeros_(model.score.bias)
    return std


def final_norm_of(model) -> torch.nn.Module:
    """The normalisation layer whose output is the head's input (GPT-NeoX: `final_layer_norm`)."""
    backbone = getattr(model, model.base_model_prefix)
    for name in ("final_layer_norm", "ln_f", "norm"):
        norm = getattr(backbone, name, None)
        if norm is not None and getattr(norm, "bias", None) is not None:
            return norm
    raise RunError(
        f"{type(backbone).__name__} has no final norm with a bias, so the Detail 15 shift cannot be folded "
        "into its weights; run with --no-normalize_reward"
    )


def pairwise_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> torch.Tensor:
    """The Bradley-Terry loss -log sigmoid(r_chosen - r_rejected), averaged over pairs."""
    return -F.logsigmoid(chosen_rewards - rejected_rewards).mean()


def reward_update(args, accelerator, run, scorer, optimizer, lr_scheduler, batches, pad_token_id: int, update: int,
                  tokens_seen: int):
    """Steps 2-3 of one update on this process's next gradient_accumulation_steps micro batches: chosen and rejected
    of each in one forward pass, the pairwise loss and its gradient (accumulated), checked by the non-finite guard
    before its backward pass, then one AdamW step after the last and one step of the schedule. Returns the means over
    every micro batch of the update and every process of the loss, the accuracy and both rewards, and `tokens_seen`
    counted on by this update's tokens (all processes), and the update's wall time ("update_s")."""
    update_start, stats = time.monotonic(), {"loss": [], "accuracy": [], "chosen": [], "rejected": []}
    query_once = args.score_query_once and not args.gradient_checkpointing  # no key/value cache under checkpointing
    for _ in range(args.gradient_accumulation_steps):
        batch = next(batches)
        with accelerator.accumulate(scorer):
            if query_once:  # each query once, both responses after it (--score_query_once)
                queries = batch["query_token"][:, real_columns(batch["query_token"], pad_token_id)]  # (B, Tq)
                responses = torch.cat((batch["chosen_token"], batch["rejected_token"]), dim=0)
                responses = responses[:, real_columns(responses, pad_token_id)]  # (2B, Tr)
                chosen_rewards, rejected_rewards = scorer(queries, 0, responses.chunk(2))  # (B,), (B,) at each EOS
                tokens = 2 * (queries != pad_token_id).sum() + (responses != pad_token_id).sum()  # both rows' tokens
            else:  # chosen and rejected as whole right-padded rows (the reference's)
                b = batch["query_chosen_token"].size(0)
                query_responses = torch.cat((batch["query_chosen_token"], batch["query_rejected_token"]), dim=0)
                query_responses = query_responses[:, real_columns(query_responses, pad_token_id)]  # (2B, T)
                _, rewards, _ = scorer(query_responses, 0)  # (2B,), read at each EOS (Detail 12)
                chosen_rewards, rejected_rewards = rewards[:b], rewards[b:]
                tokens = (query_responses != pad_token_id).sum()
            loss = pairwise_loss(chosen_rewards, rejected_rewards)
            # non-finite guard before backward: a NaN never reaches the gradients or the weights
            run.guard(update, **{"train/loss": loss, "train/rewards/chosen": chosen_rewards,
                                 "train/rewards/rejected": rejected_rewards})
            accelerator.backward(loss)
            optimizer.step()  # a no-op until the last micro batch of the update
            optimizer.zero_grad()
        tokens_seen += int(tokens) * accelerator.num_processes
        stats["loss"].append(loss.detach())
        stats["accuracy"].append((chosen_rewards > rejected_rewards).float().mean().detach())
        stats["chosen"].append(chosen_rewards.detach().float().mean())
        stats["rejected"].append(rejected_rewards.detach().float().mean())
    if not accelerator.sync_gradients:
        raise RuntimeError("gradient accumulation went out of step with the update loop")
    lr_scheduler.step()
    # averages over every micro batch of the update and every process
    means = {k: accelerator.gather(torch.stack(v)).float().mean().item() for k, v in stats.items()}
    return {**means, "update_s": time.monotonic() - update_start}, tokens_seen  # (.item() waited for the device)


@torch.no_grad()
def score_references(scorer, accelerator, dataset, pad_token_id: int, batch_size: int):
    """Score the SFT references twice: as one right-padded row (how the RM is trained) and as a
    left-padded query followed by the right-padded reference (how PPO scores). Returns both (N,) arrays
    on every process (Details 14 and 15)."""
    dataset = dataset.with_format("torch", columns=["query_token", "reference_response_token",
                                                    "query_reference_response_token"])
    loader = accelerator.prepare(DataLoader(dataset, batch_size=batch_size, shuffle=False))
    right, left = [], []
    scorer.eval()
    for batch in loader:
        # right-padded: unpadded query + reference + EOS + pads; no pad before the response, so context 0
        right_rows = batch["query_reference_response_token"]
        right_rows = right_rows[:, real_columns(right_rows, pad_token_id)]
        _, right_scores, _ = scorer(right_rows, 0)
        # left-padded query (B, Tq) + right-padded reference (B, Tr): the layout PPO scores (Detail 14)
        query_responses = torch.cat((batch["query_token"], batch["reference_response_token"]), dim=1)
        cols = real_columns(query_responses, pad_token_id)
        _, left_scores, _ = scorer(query_responses[:, cols], batch["query_token"].size(1) - cols.start)
        right.append(accelerator.gather_for_metrics(right_scores.float()))
        left.append(accelerator.gather_for_metrics(left_scores.float()))
    return torch.cat(right).cpu().numpy(), torch.cat(left).cpu().numpy()


def fold_reward_bias(model, bias: float) -> None:
    """Detail 15: make every output of the model `bias` lower, exactly, without a new parameter.

    The reference implementation keeps the bias in its own config and subtracts it in its forward.
    We keep the library's bias-free sequence-classification format instead, so that any loader gets
    normalised scores: the head computes r = w . LN(x) with LN(x) = gamma * xhat + beta, which is linear
    in the final norm's bias beta. Moving beta by delta = -bias * w / ||w||^2 changes every reward logit
    by w . delta = -bias. The value is also stored as `config.reward_normalization_bias` (already applied;
    never subtract it again)."""
    norm = final_norm_of(model)
    with torch.no_grad(), models.whole_parameters([model.score.weight, norm.bias]):
        w = model.score.weight[0].detach().float()  # (d,)
        norm.bias.add_((-bias * w / w.dot(w)).to(norm.bias.dtype))


def normalize_on_references(scorer, accelerator, model, references, pad_token_id: int, args) -> dict:
    """Details 14 and 15, after training: score the SFT references right-padded (as the RM trains) and with a
    left-padded query (as PPO scores), then, with --normalize_reward, fold their mean into `model` so that
    they score mean 0. Returns the summary entries of both steps."""
    right, left = score_references(scorer, accelerator, references, pad_token_id, args.local_eval_batch_size)
    summary = {
        "reference_reward_mean_before_normalization": float(right.mean()),
        "reference_reward_std": float(right.std()),
        # Detail 14: the same sequences, left-padded query vs one right-padded row
        "left_right_pad_diff": float(np.abs(left - right).mean()),
        "left_right_pad_diff_signed": float((left - right).mean()),
        "reward_normalization_bias": 0.0,
    }
    if args.normalize_reward:
        fold_reward_bias(model, float(right.mean()))  # the same shift on every process
        summary["reward_normalization_bias"] = float(right.mean())
    model.config.reward_normalization_bias = summary["reward_normalization_bias"]
    accelerator.print(f"SFT references: mean reward {right.mean():.4f} before normalisation; "
                      f"mean |left - right padding| {summary['left_right_pad_diff']:.2e}")
    return summary


@torch.no_grad()
def score_preference_split(scorer, accelerator, dataset, pad_token_id: int, eos_token_id: int, batch_size: int,
                           num_logit_rows: int):
    """Score every pair of a preference split. Returns a DataFrame with one row per pair (scores and the
    rater metadata of Table 5), the per-token reward logits of the first `num_logit_rows` chosen
    responses (Detail 13), and the mean / negative share of the non-EOS response logits."""
    columns = ["query_chosen_token", "query_rejected_token", "query_token_len"]
    indexed = dataset.add_column("row_index", list(range(len(dataset))))
    loader = accelerator.prepare(
        DataLoader(indexed.with_format("torch", columns=columns + ["row_index"]), batch_size=batch_size)
    )
    scorer.eval()
    chosen, rejected, indices, ends_with_eos = [], [], [], []
    logit_rows = []
    non_eos_sum = torch.zeros((), device=accelerator.device)
    non_eos_negative = torch.zeros((), device=accelerator.device)
    non_eos_count = torch.zeros((), device=accelerator.device)
    for batch in loader:
        b = batch["query_chosen_token"].size(0)
        # chosen and rejected in one forward pass; both are right-padded rows, so context length 0
        query_responses = torch.cat((batch["query_chosen_token"], batch["query_rejected_token"]), dim=0)
        query_responses = query_responses[:, real_columns(query_responses, pad_token_id)]  # (2B, T)
        reward_logits, rewards, eos_index = scorer(query_responses, 0)
        chosen.append(accelerator.gather_for_metrics(rewards[:b].float()))
        rejected.append(accelerator.gather_for_metrics(rewards[b:].float()))
        indices.append(accelerator.gather_for_metrics(batch["row_index"]))
        # is the token the reward is read at really an EOS? (a response cut at the length limit has none)
        eos_read = query_responses[torch.arange(2 * b, device=query_responses.device), eos_index] == eos_token_id
        ends_with_eos.append(accelerator.gather_for_metrics(torch.stack((eos_read[:b], eos_read[b:]), dim=1)))
        # Detail 13: the logits at response positions before the EOS are not rewards
        positions = torch.arange(query_responses.size(1), device=query_responses.device).unsqueeze(0)
        query_len = batch["query_token_len"].repeat(2).unsqueeze(1)
        non_eos = (positions >= query_len) & (positions < eos_index.unsqueeze(1))
        non_eos_sum += (reward_logits.float() * non_eos).sum()
        non_eos_negative += ((reward_logits < 0) & non_eos).sum()
        non_eos_count += non_eos.sum()
        for i in range(b):
            if len(logit_rows) < num_logit_rows:
                start, end = int(query_len[i]), int(eos_index[i])
                tokens = query_responses[i, start : end + 1].tolist()
                logit_rows.append({
                    "logits": reward_logits[i, start : end + 1].float().cpu().numpy(),
                    "ends_with_eos": tokens[-1] == eos_token_id,
                })
    non_eos_sum, non_eos_negative, non_eos_count = (accelerator.reduce(t, "sum") for t in
                                                    (non_eos_sum, non_eos_negative, non_eos_count))
    index = torch.cat(indices).cpu().numpy()
    meta = dataset.select_columns(["query", "chosen", "rejected", "batch", "split", "confidence",
                                   "chosen_policy", "rejected_policy", "choice", "chosen_token_len",
                                   "rejected_token_len"]).to_pandas()
    frame = meta.iloc[index].reset_index(drop=True)
    frame["chosen_score"] = torch.cat(chosen).cpu().numpy()
    frame["rejected_score"] = torch.cat(rejected).cpu().numpy()
    eos_flags = torch.cat(ends_with_eos).cpu().numpy()  # (N, 2)
    frame["chosen_has_eos"], frame["rejected_has_eos"] = eos_flags[:, 0], eos_flags[:, 1]
    frame["score_diff"] = frame["chosen_score"] - frame["rejected_score"]
    frame["correct"] = frame["score_diff"] > 0
    logit_stats = {
        "non_eos_logit_mean": float(non_eos_sum / non_eos_count.clamp(min=1)),
        "non_eos_logit_negative_frac": float(non_eos_negative / non_eos_count.clamp(min=1)),
    }
    return frame, logit_rows, logit_stats


# ---------------------------------------------------------------------------------------------
# What the paper measures: the Table 5 analogue (Details 6, 16), calibration (Detail 18), the logits at
# non-EOS positions (Detail 13)
# ---------------------------------------------------------------------------------------------


def run_evaluation(scorer, accelerator, eval_sets: dict, pad_token_id: int, eos_token_id: int, args: Args):
    """Evaluate on every preference split; return flat metrics, the table rows, calibration bins, the
    Detail 13 logit rows and the per-pair frame."""
    metrics, rows, calibration, frames = {}, [], {}, []
    logit_rows = []
    for split_name, dataset in eval_sets.items():
        frame, split_logit_rows, logit_stats = score_preference_split(
            scorer, accelerator, dataset, pad_token_id, eos_token_id, args.local_eval_batch_size,
            args.num_logit_plot_samples if not logit_rows else 0,
        )
        logit_rows.extend(split_logit_rows)
        frame["dataset_split"] = split_name
        frames.append(frame)
        split_rows = accuracy_breakdown(frame, split_name)
        rows.extend(split_rows)
        for r in split_rows:
            # eval/{split}/reward/mean, eval/{split}/accuracy, eval/{split}/accuracy/batch/batch10, ...
            if r["group"] == "accuracy":
                metrics[f"eval/{split_name}/accuracy"] = r["value"]
                metrics[f"eval/{split_name}/accuracy_ci_low"] = r["ci_low"]
                metrics[f"eval/{split_name}/accuracy_ci_high"] = r["ci_high"]
            else:
                group = r["group"].replace("accuracy by ", "accuracy/")
                metrics[f"eval/{split_name}/{group}/{r['key']}"] = r["value"]
        metrics[f"eval/{split_name}/loss"] = float(np.mean(np.log1p(np.exp(-frame["score_diff"].to_numpy()))))
        calibration[split_name] = calibration_bins(frame, args.num_calibration_bins)
        c = calibration[split_name]
        # expected calibration error: |accuracy - ideal| weighted by the share of (symmetrised) pairs per bin
        metrics[f"eval/{split_name}/calibration_error"] = float((c["n"] * (c["accuracy"] - c["ideal"]).abs()).sum()
                                                                / c["n"].sum())
        for k, v in logit_stats.items():
            metrics[f"eval/{split_name}/{k}"] = v
    first = next(iter(eval_sets))
    metrics["eval/accuracy"] = metrics[f"eval/{first}/accuracy"]
    return metrics, rows, calibration, logit_rows, pd.concat(frames).reset_index(drop=True)


def evaluate_and_log_reward(run, args, accelerator, scorer, eval_sets: dict, tokenizer, step: int, final: bool) -> dict:
    """One evaluation on every preference split (run_evaluation): its outputs written (records.save_reward_evaluation),
    its metrics logged at `step` and returned; the scorer is left in training mode."""
    metrics, rows, calibration, logit_rows, frame = run_evaluation(scorer, accelerator, eval_sets,
                                                                   tokenizer.pad_token_id, tokenizer.eos_token_id, args)
    records.save_reward_evaluation(run, frame, rows, calibration, logit_rows, tokenizer.eos_token, step, final)
    run.log(step, {"episode": step * args.total_batch_size, **metrics})
    scorer.train()
    return metrics


def accuracy_breakdown(frame: pd.DataFrame, split_name: str) -> list[dict]:
    """Table 5 analogue for one preference split: reward statistics and accuracy overall, by batch,
    by confidence and by split, one dict per table row. A pair is correct when r_chosen > r_rejected."""
    scores = np.concatenate([frame["chosen_score"].to_numpy(), frame["rejected_score"].to_numpy()])
    rows = [{"dataset_split": split_name, "group": "reward", "key": k, "value": float(v), "n": len(scores)}
            for k, v in (("max", scores.max()), ("mean", scores.mean()), ("min", scores.min()),
                         ("std", scores.std()))]
    # every accuracy comes with its 95% Wilson interval: on ~1000 validation pairs it is about +-3 points,
    # so two RMs (or two seeds) that differ by less than that are not distinguishable on this split
    rows.append({"dataset_split": split_name, "group": "accuracy", "key": "overall",
                 "value": float(frame["correct"].mean()), "n": len(frame), **accuracy_interval(frame["correct"])})
    # a pair whose two summaries are the same text always ties, and a tie counts as wrong (strict >, as
    # in the reference implementation): this share bounds the accuracy any scalar reward model can reach
    rows.append({"dataset_split": split_name, "group": "pairs", "key": "identical_texts",
                 "value": float((frame["chosen"] == frame["rejected"]).mean()), "n": len(frame)})
    for group in ("batch", "confidence", "split"):
        for key, sub in frame.groupby(group, sort=True):
            rows.append({"dataset_split": split_name, "group": f"accuracy by {group}", "key": str(key),
                         "value": float(sub["correct"].mean()), "n": len(sub), **accuracy_interval(sub["correct"])})
    return rows


def accuracy_interval(correct: pd.Series) -> dict:
    """The 95% Wilson interval of an accuracy, as the table row's ci_low / ci_high."""
    low, high = wilson_interval(int(correct.sum()), len(correct))
    return {"ci_low": float(low), "ci_high": float(high)}


def wilson_interval(successes: float, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (better than the normal approximation
    near 0 or 1 and for small n); (nan, nan) when n = 0. statsmodels' proportion_confint, not
    scipy's binomtest(k, n).proportion_ci: a judge's tie counts as half a success, a k it refuses."""
    if n == 0:
        return float("nan"), float("nan")
    low, high = proportion_confint(successes, n, alpha=0.05, method="wilson")
    low = 0.0 if successes == 0 else max(0.0, low)  # exact at the edges (no 1e-17 from rounding)
    high = 1.0 if successes == n else min(1.0, high)
    return float(low), float(high)


def calibration_bins(frame: pd.DataFrame, num_bins: int) -> pd.DataFrame:
    """Detail 18 (Bai et al.): the fraction of pairs in which the rater preferred A, against the score
    difference d = r(A) - r(B). Each pair enters twice, once as (A, B) = (chosen, rejected) with label 1
    and once swapped with label 0, so the curve does not depend on the order of the two summaries.
    A calibrated model follows 1 / (1 + e^-d)."""
    d = np.concatenate([frame["score_diff"].to_numpy(), -frame["score_diff"].to_numpy()])
    label = np.concatenate([np.ones(len(frame)), np.zeros(len(frame))])
    edge = max(float(np.quantile(np.abs(d), 0.99)), 1e-6)
    edges = np.linspace(-edge, edge, num_bins + 1)
    which = np.clip(np.digitize(d, edges) - 1, 0, num_bins - 1)
    rows = []
    for b in range(num_bins):
        in_bin = which == b
        if in_bin.any():
            rows.append({"bin_center": float((edges[b] + edges[b + 1]) / 2), "mean_diff": float(d[in_bin].mean()),
                         "accuracy": float(label[in_bin].mean()), "ideal": float(1 / (1 + np.exp(-d[in_bin].mean()))),
                         "n": int(in_bin.sum())})
    return pd.DataFrame(rows)


def main(args: Args) -> dict:
    start_time = time.monotonic()
    # ---------------- processes, batch arithmetic and precision ----------------
    args.world_size = num_processes = start_processes(args.run.process_group_timeout_min).num_processes
    accumulation = exact_div(args.total_batch_size, args.local_micro_batch_size * num_processes,
                             "total_batch_size / (local_micro_batch_size * world_size)")
    checks.check_gradient_accumulation(args, accumulation, num_processes)
    args.gradient_accumulation_steps = gradient_accumulation_steps = accumulation  # recorded in args.json
    if args.bf16 is None:
        args.bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    # sync_with_dataloader=False: an update never straddles the end of an epoch with fewer pairs than
    # total_batch_size; the accumulation counter simply runs on into the next epoch.
    # use_seedable_sampler: the shuffle of epoch e depends on (seed, e) only, which is what lets a resumed
    # run find its place in the data (see resumable_micro_batches)
    # gradient accumulation over the micro batches counted here, synced on that count alone (an update may straddle
    # two epochs); the data order seeded by --seed, so that a resumed run finds its place (resumable_micro_batches)
    accelerator = seeded_accelerator(gradient_accumulation_steps, args.seed, args.bf16)
    configure_deepspeed(accelerator, args.local_micro_batch_size)  # Detail 8 (no-op without DeepSpeed)
    run = Run(args, accelerator)  # run name and folder (rlhf_utils/run.py)
    run.inputs(sft_model_path=args.sft_model_path, preference_dataset=args.preference_dataset,
               query_dataset=args.query_dataset)
    set_seed(args.seed)  # same weights and data order on every process

    # ---------------- tokenizer and data ----------------
    tokenizer = load_tokenizer(args.sft_model_path, args.trust_remote_code)  # Details 3 and 12: [PAD] distinct from EOS
    pad_id = tokenizer.pad_token_id
    train_set, eval_sets, references = load_reward_data(args, tokenizer, accelerator)
    args.num_updates = num_updates = count_updates(args, len(train_set))
    run.claim_output_dir()  # every input check has passed: only now mark --output_dir as this run's

    # ---------------- model: the SFT trunk plus a fresh scalar head (Detail 11) ----------------
    model, head_std = build_reward_model(args, tokenizer)
    args.head_init_std = head_std  # recorded in args.json and the summary
    # the shuffle has its own generator (reseeded with seed + epoch by the seedable sampler), so iterating
    # the data never draws from the global torch RNG
    train_loader = DataLoader(
        train_set.with_format("torch", columns=["query_chosen_token", "query_rejected_token", "query_token",
                                                "chosen_token", "rejected_token"]),
        batch_size=args.local_micro_batch_size, shuffle=True, drop_last=True,
        generator=torch.Generator().manual_seed(args.seed),
    )

    # ---------------- optimiser (Table 4) ----------------
    scorer = RewardScorer(model, pad_id)
    adamw = torch.optim.AdamW(scorer.parameters(), lr=args.lr, eps=args.eps, weight_decay=args.weight_decay)
    # stepped by hand once per optimizer step, so its length is exactly num_updates on any process count
    lr_scheduler = lr_schedule(adamw, args.scheduler, num_updates, args.warmup_steps)
    scorer, optimizer, train_loader = accelerator.prepare(scorer, adamw, train_loader)
    accelerator.register_for_checkpointing(lr_scheduler)  # saved and restored with the scorer and optimizer
    unwrapped = accelerator.unwrap_model(scorer).rm  # the bare sequence-classification model

    # ---------------- resume ----------------
    last_good = LastGoodState(run, accelerator, adamw, lr_scheduler)  # the non-finite guard's fallback
    # a checkpoint holds the scorer (trunk + head), AdamW's moments, the schedule and every process's RNG states;
    # the trainer state adds the update reached and the running counters of the summary
    state = run.start({"update": 0, "tokens_seen": 0, "train_time": 0.0}, num_updates=num_updates)
    start_update = state["update"]
    # accelerate's count of micro batches, in this run's: a checkpoint of more processes counts fewer per update
    accelerator.step = start_update * gradient_accumulation_steps

    # ---------------- training: one forward pass over chosen + rejected per micro batch ----------------
    accelerator.print(f"{num_updates} optimizer steps of {args.total_batch_size} pairs "
                      f"({args.local_micro_batch_size} per micro batch x {gradient_accumulation_steps} accumulation "
                      f"x {num_processes} processes), head init std {head_std:.5f}, "
                      + ("each query scored once" if args.score_query_once and not args.gradient_checkpointing else
                         "whole rows" + " (--gradient_checkpointing keeps no key/value cache)" * args.score_query_once))
    scorer.train()
    # the running counters continue from the checkpoint, so the summary covers the whole run
    tokens_seen, train_time_before = state["tokens_seen"], state["train_time"]
    train_start = time.monotonic()
    # the data position: every update reads gradient_accumulation_steps micro batches on each process
    batches = resumable_micro_batches(train_loader, start_update * gradient_accumulation_steps)
    progress = tqdm(range(start_update + 1, num_updates + 1), initial=start_update, total=num_updates,
                    disable=not accelerator.is_local_main_process, desc="reward model")
    for update in progress:
        with last_good.kept(update, state):  # a non-finite value leaves the state after update - 1 as a checkpoint
            means, tokens_seen = reward_update(args, accelerator, run, scorer, optimizer, lr_scheduler, batches, pad_id,
                                               update, tokens_seen)  # steps 2-3
        tokens_per_s = tokens_seen / (train_time_before + time.monotonic() - train_start)
        progress.set_postfix(loss=f"{means['loss']:.4f}", acc=f"{means['accuracy']:.3f}", tok_s=f"{tokens_per_s:.0f}")
        if update % args.log_every == 0 or update == num_updates:
            run.log(update, {"episode": update * args.total_batch_size, "train/loss": means["loss"],
                             "train/rewards/chosen": means["chosen"], "train/rewards/rejected": means["rejected"],
                             "train/rewards/margins": means["chosen"] - means["rejected"],
                             "train/rewards/accuracy": means["accuracy"], "train/lr": lr_scheduler.get_last_lr()[0],
                             "train/epoch": update * args.total_batch_size / len(train_set),
                             "train/tokens_per_s": tokens_per_s, "time/update_s": means["update_s"]})
        if due(args.eval_every, update, num_updates):
            evaluate_and_log_reward(run, args, accelerator, scorer, eval_sets, tokenizer, update, final=False)
        # the trainer state after this update, models.checkpointed after its logging and evaluation (a resumed run
        # repeats neither)
        state = {"tokens_seen": tokens_seen, "train_time": train_time_before + time.monotonic() - train_start}
        if due(args.run.checkpoint_every, update, num_updates):
            run.checkpoint(update, state)
    progress.close()
    train_time = train_time_before + time.monotonic() - train_start

    # ---------------- Details 14 and 15: score the SFT references, then normalise ----------------
    summary = normalize_on_references(scorer, accelerator, unwrapped, references, pad_id, args)

    # ---------------- final evaluation of the saved (normalised) model, and outputs ----------------
    summary.update(evaluate_and_log_reward(run, args, accelerator, scorer, eval_sets, tokenizer, num_updates,
                                           final=True))
    summary.update({"train_time_s": train_time, "wall_time_s": time.monotonic() - start_time,
                    "tokens_per_s": tokens_seen / max(train_time, 1e-9), "num_updates": num_updates,
                    "head_init_std": head_std,
                    # the budget as spent: every update read total_batch_size pairs
                    "budget/updates": num_updates, "budget/pairs_read": num_updates * args.total_batch_size})
    models.save_pretrained_model(accelerator, scorer, unwrapped, tokenizer, args.output_dir, prefix="rm.")
    if args.run.push_to_hub and accelerator.is_main_process:
        models.upload_to_hub(args)
    run.finish(summary)
    if accelerator.is_main_process:
        print(json.dumps({k: summary[k] for k in ("eval/accuracy", "left_right_pad_diff", "train_time_s")}))
    return summary


# ---------------------------------------------------------------------------------------------
# The number-deciding setup (tokenizer, data, model, DeepSpeed); the evaluation outputs main writes are
# rlhf_utils/records.py's save_reward_evaluation
# ---------------------------------------------------------------------------------------------


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


def load_reward_data(args, tokenizer, accelerator):
    """The preference train split, the preference evaluation splits (those absent are skipped) and the SFT
    references of Details 14 and 15 (scored after training; loaded now so that a bad split fails early). Every
    split is checked for the columns read from it and for the tokenizer that made it, before any training."""
    train_set = checks.load_split(args.preference_dataset, args.train_split)
    checks.check_columns(train_set, ["query_chosen_token", "query_rejected_token", "query_chosen_token_len",
                                     "query_token", "chosen_token", "rejected_token"],
                         f"{args.preference_dataset} split {args.train_split!r}")
    # the data must come from this tokenizer (Detail 12 also finds the EOS by its pad id)
    checks.check_data_tokenizer(train_set, tokenizer, args.sft_model_path,
                                f"{args.preference_dataset} split {args.train_split!r}")
    checks.check_query_response(train_set, tokenizer.pad_token_id,
                                f"{args.preference_dataset} split {args.train_split!r}")
    if os.path.isdir(args.preference_dataset):
        available = set(load_from_disk(args.preference_dataset).keys())
    else:
        from datasets import get_dataset_split_names

        available = set(get_dataset_split_names(args.preference_dataset))
    eval_sets = {}
    eval_columns = ["query_chosen_token", "query_rejected_token", "query_token_len", "query", "chosen", "rejected",
                    "batch", "split", "confidence", "chosen_policy", "rejected_policy", "choice", "chosen_token_len",
                    "rejected_token_len"]  # what score_preference_split reads
    for split_name in args.eval_splits:
        if split_name not in available:
            accelerator.print(f"evaluation split {split_name!r} is not in {args.preference_dataset}; skipped")
            continue
        dataset = checks.load_split(args.preference_dataset, split_name)
        checks.check_columns(dataset, eval_columns, f"{args.preference_dataset} split {split_name!r}")
        checks.check_data_tokenizer(dataset, tokenizer, args.sft_model_path,
                                    f"{args.preference_dataset} split {split_name!r}")
        checks.check_query_response(dataset, tokenizer.pad_token_id, f"{args.preference_dataset} split {split_name!r}")
        if args.num_eval_samples is not None:
            dataset = dataset.select(range(min(args.num_eval_samples, len(dataset))))
        eval_sets[split_name] = dataset
    if not eval_sets:
        raise RunError(f"none of {args.eval_splits} is in {args.preference_dataset}")
    references = checks.load_split(args.query_dataset, args.normalization_split)
    checks.check_columns(references, ["query_token", "reference_response_token", "query_reference_response_token"],
                         f"{args.query_dataset} split {args.normalization_split!r}")
    checks.check_data_tokenizer(references, tokenizer, args.sft_model_path,
                                f"{args.query_dataset} split {args.normalization_split!r}")
    checks.check_query_response(references, tokenizer.pad_token_id,
                                f"{args.query_dataset} split {args.normalization_split!r}")
    if args.num_normalization_samples is not None:
        references = references.select(range(min(args.num_normalization_samples, len(references))))
    return train_set, eval_sets, references


def count_updates(args, num_rows: int) -> int:
    """Optimizer updates of the run: --total_episodes rows (None: num_train_epochs passes over the num_rows of the
    train data) in full batches of total_batch_size; a last partial batch is dropped."""
    total_episodes = args.total_episodes if args.total_episodes is not None else args.num_train_epochs * num_rows
    num_updates = total_episodes // args.total_batch_size
    if num_updates < 1:
        raise RunError(f"{total_episodes} episodes give no full batch of {args.total_batch_size}; raise "
                       "--total_episodes (or --num_train_epochs) or lower --total_batch_size")
    return num_updates


def build_reward_model(args, tokenizer):
    """Detail 11: the SFT model's transformer trunk plus a fresh scalar head (see init_reward_head).
    Returns the model and the std its head was drawn with."""
    model = AutoModelForSequenceClassification.from_pretrained(
        args.sft_model_path, num_labels=1, trust_remote_code=args.trust_remote_code, dtype=torch.float32
    )
    checks.check_finite(model, args.sft_model_path)
    # the config's row count, not the weight's shape: ZeRO-3 partitions weights as they load
    if len(tokenizer) > model.config.vocab_size:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    head_std = init_reward_head(model, args.reward_head_init, args.reward_head_init_std)
    if args.disable_dropout:
        disable_dropout(model)  # Detail 7
    return models.checkpointed(model, args.gradient_checkpointing), head_std


def configure_deepspeed(accelerator, micro_batch_size: int) -> None:
    """Under DeepSpeed (zero2.yaml / zero3.yaml; Detail 8) set what accelerate would fill as "auto": the micro batch
    per process, and no gradient clipping (the paper clips none; accelerate's "auto" clips at 1.0)."""
    config = getattr(accelerator.state.deepspeed_plugin, "deepspeed_config", None)
    if config is not None:
        config["train_micro_batch_size_per_gpu"] = micro_batch_size
        clipping = config.get("gradient_clipping", "auto")
        config["gradient_clipping"] = 0.0 if clipping == "auto" else clipping


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


def get_reward(model, query_responses: torch.Tensor, pad_token_id: int, context_length: int):
    """Reward of a (left-padded query + right-padded response) batch.

    Detail 12: the score is read at the EOS token, i.e. the last token before the first [PAD]
    of the response (the last token when there is no pad). Returns the per-token reward
    logits (B, T), the sequence rewards (B,) and the index read (B,)."""
    attention_mask = query_responses != pad_token_id
    position_ids = attention_mask.long().cumsum(1) - attention_mask.long()
    input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, return_dict=True
    ).last_hidden_state  # (B, T, d)
    reward_logits = model.score(hidden).squeeze(-1)  # (B, T)
    sequence_lengths = first_true_indices(query_responses[:, context_length:] == pad_token_id) - 1 + context_length
    rewards = reward_logits[torch.arange(reward_logits.size(0), device=reward_logits.device), sequence_lengths]
    return reward_logits, rewards, sequence_lengths


def get_pair_rewards(model, queries: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor, pad_token_id: int):
    """Rewards of two responses to each query, the query run once (--score_query_once): the LEFT-padded queries (B, Tq)
    go through the trunk, which keeps their keys and values; each query's cache is repeated for its two RIGHT-padded
    responses (chosen (B, Tr), rejected (B, Tr)), which run after it with positions counting on from the query's real
    tokens. Causal attention lets no query token see a response, so each reward is the one get_reward reads from the
    row query + response (Detail 12, at the response's last token before its first [PAD]), up to float rounding, and
    the query's gradient is the sum of both rows'. Returns the chosen and the rejected rewards (B,), (B,)."""
    backbone = getattr(model, model.base_model_prefix)
    query_mask = queries != pad_token_id
    cache = DynamicCache()  # the queries' keys and values, filled in place by their pass
    backbone(input_ids=torch.masked_fill(queries, ~query_mask, 0), attention_mask=query_mask,
             position_ids=query_mask.long().cumsum(1) - query_mask.long(), past_key_values=cache, use_cache=True)
    cache.batch_repeat_interleave(2)  # rows q0, q0, q1, q1, ...: each query for its chosen, then its rejected
    responses = torch.stack((chosen, rejected), dim=1).flatten(0, 1)  # (2B, Tr): c0, r0, c1, r1, ...
    response_mask = responses != pad_token_id
    positions = (query_mask.sum(1).repeat_interleave(2).unsqueeze(1) + response_mask.long().cumsum(1)
                 - response_mask.long())
    hidden = backbone(input_ids=torch.masked_fill(responses, ~response_mask, 0), position_ids=positions,
                      attention_mask=torch.cat((query_mask.repeat_interleave(2, dim=0), response_mask), dim=1),
                      past_key_values=cache, return_dict=True).last_hidden_state  # (2B, Tr, d)
    eos_index = first_true_indices(~response_mask) - 1  # (2B,): the last token before the first [PAD]
    rewards = model.score(hidden[torch.arange(hidden.size(0), device=hidden.device), eos_index]).squeeze(-1)
    return rewards[0::2], rewards[1::2]


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
