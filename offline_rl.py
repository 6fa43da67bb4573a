"""Offline RLHF: label a data mixture with the reward model once, then align with a supervised-style loss.

Spec: "Aligning Language Models with Offline RL from Human Feedback" (Hu et al., seed 001: eq. 4-6,
the data mixture, the `<rm_score>` prompt, Tables 1 and 3) and OpenRLHF Appendix A.7 (rejection
sampling) and A.8 (conditional SFT).

  step 1  the alignment data set (the seed's step 3), built once and cached under --cache_dir:
          SFT reference summaries + preference-pair responses (chosen and rejected) + new responses the
          SFT model writes for SFT prompts (greedy, the seed's footnote 8), in proportions set by
          --mixture_weights. Every (prompt, response) is scored by the reward model at its EOS token
          (Detail 12) and the scores are z-normalised over the mixture (the seed's Figure 5).
  step 2  --method
          filter     MLE with filtering (eq. 4): the next-token loss only on samples whose normalised
                     reward is above --filter_threshold (0).
          rwr        reward-weighted regression (eq. 5): each sample's loss is weighted by exp(R / beta),
                     beta = 5; weights are self-normalised over the update batch and clipped.
          dt         Decision-Transformer alignment / conditional SFT (eq. 6): the reward, one decimal, is
                     written as " <rm_score> a.b" between query and response; at inference the prompt
                     carries --dt_target (5.0). The reward prompt never carries loss.
          best_of_n  rejection sampling (OpenRLHF A.7): n samples per prompt from the current policy, keep
                     the RM's best, fine-tune on it; --iterations > 1 repeats with the updated policy.
                     It samples its own data, so it does not use the cached mixture.
          For every method the loss covers response tokens (and their EOS) only, never the query; it is the
          (weighted) token mean over the whole update batch, whatever the micro-batch size and process count.
  step 3  samples of the validation split as CSV (judge.py reads them), RM-scored. For dt also one CSV per
          target in --dt_eval_targets (the seed's Table 1: controllability), and the cost of each stage in
          wall seconds (generation, labelling, training: the seed's Table 3) in summary.json.

Checkpoints: every --checkpoint_every updates of step 2, runs/{run_name}/checkpoints/update_N holds the policy,
optimizer, schedule, RNG states and the data position (the shuffle generator, the current permutation and, for
best_of_n, the current round's selected samples); `--resume --run_name NAME` continues from the newest one and ends
with the weights and metrics of an uninterrupted run. A NaN/inf loss, RWR weight or RM score stops the run before
any weight sees it and saves the state after the last good update as its checkpoint, which --resume continues from
like any other.

Single process:   python offline_rl.py --method dt --sft_model_path models/sft --reward_model_path models/rm
Several:          accelerate launch [--config_file zero2.yaml] offline_rl.py ...
"""

import functools
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Annotated, Literal, Optional, Tuple

import numpy as np
import pandas as pd
import pyarrow
import pyarrow.compute
import torch
import torch.nn.functional as F
import tyro
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from datasets import Dataset
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GenerationConfig

from rlhf_utils import checks, models, records
from rlhf_utils.checks import NonFiniteError, RunError
from rlhf_utils.flags import RunFlags, check_offline_flags, check_round_size
from rlhf_utils.run import LastGoodState, Run, due, evaluation_rng, leave_processes, start_processes


@dataclass
class Args:
    # ---- experiment bookkeeping ----
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (the run name starts with it)"""
    seed: int = 1
    """seed of the mixture draw, weights and data order (the same on every process); sampling uses
    seed + 100003 * rank"""
    output_dir: str = "models/offline_rl"
    """where the aligned model and tokenizer are saved (safetensors)"""

    # ---- method ----
    method: Literal["filter", "rwr", "dt", "best_of_n"] = "dt"
    """the alignment loss of step 2 (see the module docstring); the seed finds dt best"""
    filter_threshold: float = 0.0
    """filter (eq. 4): train only on samples whose z-normalised reward is strictly above this (seed: t = 0)"""
    rwr_beta: float = 5.0
    """rwr (eq. 5): temperature beta of the weight exp(R / beta) on the z-normalised reward R (seed: 5)"""
    rwr_max_weight: float = 10.0
    """rwr: after self-normalising the weights to mean 1 over the update batch, clip each at this value, so
    that one sample cannot carry more than this many samples' share of the batch gradient (our choice; the
    seed does not say how it bounds the weights)"""
    dt_target: float = 5.0
    """dt: the reward written in the prompt at inference (seed: 5.0, although most normalised rewards lie in
    [-2.5, 2.5])"""
    dt_target_percentile: Optional[float] = None
    """dt: if set, the inference target is this percentile of the labelled mixture's normalised rewards (rounded to
    one decimal) instead of --dt_target: a target the model saw in its training prompts, whatever the reward scale"""
    dt_eval_targets: Tuple[float, ...] = (-5.0, 0.0, 5.0)
    """dt: targets evaluated after training, one sample table each (the seed's Table 1, controllability)"""
    dt_eval_percentiles: Tuple[float, ...] = (10.0, 50.0, 90.0, 99.0)
    """dt: also evaluate at these percentiles of the labelled mixture's normalised rewards (rounded to the prompt's
    one decimal), so that the targets lie inside the range the model was trained on; () = only --dt_eval_targets"""
    n: int = 4
    """best_of_n: responses sampled per prompt; the RM's arg-max is kept"""
    bon_temperature: float = 0.7
    """best_of_n: sampling temperature of the n candidates (Table 7's rollout temperature)"""
    bon_num_prompts: int = 4096
    """best_of_n: prompts (SFT train split) sampled per iteration; each gives one training sample"""
    iterations: int = 1
    """best_of_n: rounds of sample -> select -> fine-tune, each sampling from the updated policy (OpenRLHF
    A.7); the other methods train on the fixed mixture, so they take 1"""

    # ---- models and data ----
    sft_model_path: str = "models/sft"
    """the SFT model: the policy to align, and the generator of the mixture's new responses; its tokenizer is used"""
    reward_model_path: str = "models/rm"
    """the reward model (reward.py output: AutoModelForSequenceClassification with one label)"""
    trust_remote_code: bool = False
    """allow model code from the hub (needed by some architectures)"""
    query_dataset: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """the processed SFT dataset (hub name, or a local `save_to_disk` folder from data/prepare.py)"""
    preference_dataset: str = "vwxyzjn/summarize_from_feedback_oai_preprocessing_1706381144"
    """the processed preference dataset whose chosen and rejected responses join the mixture"""
    train_split: str = "train"
    """SFT split that gives the references, the prompts of generated responses and the best-of-n prompts"""
    preference_split: str = "train"
    """preference split whose responses join the mixture"""
    eval_split: str = "validation"
    """SFT split whose queries are sampled at evaluation"""
    response_length: int = 53
    """response length of the SFT data (TL;DR: 53, Detail 4): the length of every mixture response and of
    every sampled response. Preference responses longer than this (with their EOS) are left out of the
    mixture, because the policy is only ever asked for this many tokens"""

    # ---- step 1: the alignment data set ----
    cache_dir: str = "cache/offline_rl"
    """the labelled mixture is saved here (one folder per set of mixture arguments) and reused by later runs
    whose mixture arguments match, so filter, rwr and dt share one labelling pass"""
    mixture_size: int = 100_000
    """samples in the mixture (seed: 100k alignment samples, a third of them generated)"""
    mixture_weights: Tuple[float, float, float] = (1.0, 1.0, 1.0)
    """relative shares of (SFT references, preference responses, generated responses); normalised to sum 1"""
    mixture_temperature: float = 0.0
    """temperature of the SFT model's new responses; 0 = greedy decoding (the seed's footnote 8 finds greedy
    samples better)"""
    non_eos_penalty: bool = False
    """give generated responses without EOS the score penalty_reward_value before normalisation (Detail 23's
    EOS trick, borrowed from PPO; off as in the seed)"""
    penalty_reward_value: float = -1.0
    """raw RM score of a response without EOS when --non_eos_penalty is on"""

    # ---- step 2: optimisation (seed: lr 5e-6, global batch 128 for every offline method) ----
    num_train_epochs: int = 1
    """passes over the training samples (per iteration for best_of_n)"""
    total_episodes: Optional[int] = None
    """train on this many samples (per iteration for best_of_n) instead of num_train_epochs passes (small budgets)"""
    total_batch_size: int = 128
    """samples per optimizer update over all processes (seed: 128) = local_micro_batch_size *
    gradient accumulation steps * number of processes"""
    local_micro_batch_size: int = 16
    """samples per forward/backward pass on one process (memory knob; the update size stays total_batch_size)"""
    gradient_accumulation_steps: Optional[int] = None
    """micro batches per optimizer step; None = derived from the batch sizes, else checked against them"""
    lr: float = 5e-6
    """AdamW learning rate (seed: 5e-6 for all offline RLHF models)"""
    eps: float = 1e-5
    """AdamW epsilon (Table 3: 1e-5)"""
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    """learning-rate schedule over all updates (of all iterations), no warm-up"""
    disable_dropout: bool = True
    """Detail 7: set every dropout probability to 0 (policy and reward model)"""
    bf16: Optional[bool] = None
    """bf16 mixed precision, as the paper trained (Detail 8); None = on when a CUDA device supports bf16. The CPU
    runs float32 unless --bf16 asks for bf16 (slow; the tests use it to exercise the GPU's dtype path)"""
    gather_for_generation: bool = True
    """under ZeRO-3, gather the policy's weights once for each chunk it samples (the mixture, best-of-n's candidates,
    the evaluation) instead of layer by layer at every decode step (as TRL's unwrap_model_for_generation does); the
    same samples either way. Off: for a model too large to hold whole on one device. No effect without ZeRO-3"""
    gradient_checkpointing: bool = False
    """activation checkpointing in every model that trains here: less activation memory for about one more forward
    pass; the loss and gradients are the same. Off: the paper trained without it (docs/usage.md, "Flags in depth")"""
    local_rollout_batch_size: int = 64
    """sequences per generate / reward-model call on one process (mixture, best-of-n, evaluation)"""

    # ---- step 3: evaluation ----
    eval_every: int = 0
    """evaluate every this many optimizer updates (0 = only after training); tables go to samples/step_N.csv"""
    num_eval_samples: Optional[int] = None
    """evaluate on the first this many rows of the eval split (None = all of it)"""
    eval_temperature: float = 0.01
    """sampling temperature of the evaluation summaries (0.01: almost greedy, as sft.py and ppo.py); 0 = greedy"""
    num_table_samples: int = 4
    """rows of each sample table printed to the console and logged to TensorBoard"""

    run: Annotated[RunFlags, tyro.conf.OmitArgPrefixes] = field(default_factory=RunFlags)
    """the run's folder, checkpoints, --resume, lock, tracking and hub (rlhf_utils/flags.py): they decide no number"""

    # ---- derived at run time (not flags) ----
    world_size: tyro.conf.Suppress[Optional[int]] = None
    """number of processes"""


# ---------------------------------------------------------------------------------------------
# The algorithm's pieces: step 1 (the labelled mixture), step 2 (loss weights, the loss, the data order, one
# update) and step 3 (evaluation)
# ---------------------------------------------------------------------------------------------


def filter_weights(rewards: torch.Tensor, threshold: float) -> torch.Tensor:
    """Eq. 4 (MLE with filtering): weight 1 for a sample whose normalised reward is above the threshold, else 0."""
    return (rewards > threshold).float()


def rwr_weights(rewards: torch.Tensor, beta: float, max_weight: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Eq. 5 (reward-weighted regression): the raw weight exp(R / beta) of every sample of an update batch,
    and the weight actually used.

    Our choice (the seed leaves it open): the raw weights are divided by their mean over the update batch
    (self-normalisation: the batch gradient keeps the scale of plain SFT whatever the reward offset, and the
    loss is the same function of relative weights as eq. 5 within the batch), then clipped at max_weight so
    that no single sample carries more than max_weight samples' share. With z-normalised rewards and beta = 5
    the raw weights lie in about [0.5, 2] and the clip rarely binds; it matters for small beta. The exp is
    computed after subtracting the batch maximum, which cancels in the ratio and cannot overflow."""
    raw = torch.exp(rewards / beta)
    shifted = torch.exp((rewards - rewards.max()) / beta)
    normalised = shifted / shifted.mean()
    return raw, torch.clamp(normalised, max=max_weight)


def dt_reward_prompt(score: float) -> str:
    """Eq. 6: the reward prompt " <rm_score> a.b" (one decimal).

    The ONLY place the template lives: training and inference both build their prompt here, so the two are
    byte-identical and the model is evaluated on the prompt it was trained on. The leading space separates it
    from the query's final "TL;DR:"; the response that follows starts with its own space (Detail 3). Rounding can
    give -0.0, which is written as 0.0 so that one reward has one spelling. `<rm_score>` stays plain text, not a
    new special token: the tokenizer, vocabulary and pad id stay those of the SFT model and the reward model (their
    token ids must agree), and no untrained embedding row is added; the model learns the marker from its few
    subword pieces."""
    value = round(float(score), 1) + 0.0  # + 0.0 turns -0.0 into 0.0
    return f" <rm_score> {value:.1f}"


def dt_percentile_targets(rewards, percentiles) -> dict:
    """Targets inside the training distribution of the reward prompt: percentile -> the mixture's normalised reward
    at that percentile, rounded as the prompt writes it (one decimal)."""
    values = np.percentile(np.asarray(rewards, dtype=np.float64), list(percentiles)) if len(percentiles) else []
    return {float(p): round(float(v), 1) + 0.0 for p, v in zip(percentiles, values)}


def dt_query_tokens(tokenizer, query: str, score: float) -> list:
    """Token ids of query + reward prompt, as seen at training (score = the sample's normalised reward) and at
    inference (score = the target). The whole string is tokenized at once, in both cases. The query is user text:
    a special token's spelling inside it stays ordinary tokens (split_special_tokens)."""
    return tokenizer(query + dt_reward_prompt(score), add_special_tokens=False, split_special_tokens=True)["input_ids"]


def dt_queries(tokenizer, queries: list, scores: list, pad_token_id: int) -> torch.Tensor:
    """The DT prompts of a set of rows, left-padded to the longest: (N, W). Training passes each sample's own
    normalised reward, inference the target reward; both go through dt_query_tokens."""
    rows = [dt_query_tokens(tokenizer, query, score) for query, score in zip(queries, scores, strict=True)]
    width = max(len(r) for r in rows)
    return torch.tensor([[pad_token_id] * (width - len(r)) + r for r in rows], dtype=torch.long)


def response_labels(query_responses: torch.Tensor, context_length: int, pad_token_id: int) -> torch.Tensor:
    """Next-token targets of a (left-padded query [+ reward prompt], right-padded response) batch: only the
    response tokens and their EOS, -100 everywhere else (query, DT reward prompt, pads)."""
    labels = query_responses.clone()
    labels[:, :context_length] = -100
    return labels.masked_fill(query_responses == pad_token_id, -100)


def weighted_response_loss(model, query_responses: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                           pad_token_id: int,
                           num_tokens: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """sum over samples i and target tokens t of w_i * (-log pi(x_t | x_<t)), divided by num_tokens: the target
    tokens of the whole update batch when this is one of its micro batches (train_update), None = this batch's own
    target tokens (so w = 1 is the SFT token mean). Eq. 4: w = 1[R > t]; eq. 5: w = RWR weight; eq. 6 and
    best-of-n: w = 1. Returns the loss and the per-sample mean token NLL (B,), for logging."""
    targets = labels[:, 1:]  # (B, T-1): token t + 1 is predicted at position t
    mask = targets != -100
    # the LM head runs only at the positions that predict a target (the last position predicts none)
    logits = forward(model, query_responses, pad_token_id, read=F.pad(mask, (0, 1))).logits.float()  # (N, V)
    picked = F.cross_entropy(logits, targets[mask], reduction="none")  # (N,)
    nll = torch.zeros(mask.shape, device=picked.device).masked_scatter(mask, picked)  # (B, T-1), 0 elsewhere
    loss = (nll * weights.unsqueeze(1)).sum() / (mask.sum() if num_tokens is None else num_tokens)
    return loss, nll.sum(1) / mask.sum(1).clamp(min=1)


def best_of_n_select(scores: torch.Tensor, responses: torch.Tensor, n: int):
    """Rejection sampling (OpenRLHF A.7): rows are grouped as n consecutive candidates per prompt; keep the
    candidate with the highest RM score. Returns the kept responses (P, Tr), their scores (P,) and index (P,)."""
    grouped = scores.view(-1, n)  # (P, n)
    best = grouped.argmax(dim=1)  # (P,)
    rows = torch.arange(grouped.size(0), device=scores.device) * n + best
    return responses[rows], grouped.max(dim=1).values, best


@torch.no_grad()
def sample_policy(accelerator, model, queries: torch.Tensor, generation_config, tokenizer, batch_size: int, desc: str,
                  gather: bool):
    """Fixed-length responses (Detail 23) to left-padded queries (N, W), truncated after the first EOS:
    (N, response_length), the same on every process. gather: --gather_for_generation (ZeRO-3)."""
    unwrapped = accelerator.unwrap_model(model)
    was_training = unwrapped.training
    unwrapped.eval()
    indices = local_rows(queries.size(0), accelerator)
    pairs = []
    for start in tqdm(range(0, len(indices), batch_size), desc=desc, disable=not accelerator.is_main_process):
        rows = indices[start : start + batch_size]
        query = queries[rows]
        query = query[:, real_columns(query, tokenizer.pad_token_id)]  # the left padding every query shares is cut
        query = query.to(accelerator.device)
        with models.gathered_for_generation(model, gather):  # ZeRO-3: the weights gathered once for the chunk
            query_response = generate(unwrapped, query, tokenizer.pad_token_id, generation_config)
        response = truncate_response(tokenizer.eos_token_id, tokenizer.pad_token_id, query_response[:, query.size(1) :])
        pairs += list(zip(rows, response.cpu().tolist()))
    unwrapped.train(was_training)
    return torch.tensor(gather_rows(pairs, queries.size(0)), dtype=torch.long)


@torch.no_grad()
def score_responses(accelerator, reward_model, queries: torch.Tensor, responses: torch.Tensor, pad_token_id: int,
                    batch_size: int, desc: str) -> torch.Tensor:
    """Raw RM score of every (left-padded query, right-padded response) row, read at the EOS (Detail 12): (N,)."""
    indices = local_rows(queries.size(0), accelerator)
    pairs = []
    for start in tqdm(range(0, len(indices), batch_size), desc=desc, disable=not accelerator.is_main_process):
        rows = indices[start : start + batch_size]
        score = get_score(reward_model, queries[rows].to(accelerator.device), responses[rows].to(accelerator.device),
                          pad_token_id)
        pairs += list(zip(rows, score.float().cpu().tolist()))
    return torch.tensor(gather_rows(pairs, queries.size(0)), dtype=torch.float32)


def mixture_counts(size: int, weights: Tuple[float, float, float]) -> Tuple[int, int, int]:
    """Samples per source (references, preference responses, generated) for relative weights; sums to size."""
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise RunError(f"--mixture_weights must be non-negative with a positive sum, got {weights}")
    total = sum(weights)
    num_references = round(size * weights[0] / total)
    num_preference = round(size * weights[1] / total)
    return num_references, num_preference, size - num_references - num_preference


def build_mixture(args: Args, accelerator, policy, reward_model, tokenizer) -> Tuple[Dataset, dict]:
    """Step 1 (the seed's step 3): draw the three sources, generate, label with the RM, z-normalise."""
    pad_token_id, eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    num_references, num_preference, num_generated = mixture_counts(args.mixture_size, args.mixture_weights)
    draw = torch.Generator().manual_seed(args.seed)
    sft_train = checks.load_split(args.query_dataset, args.train_split)
    query_length = len(sft_train[0]["query_token"])
    queries, query_texts, responses, sources = [], [], [], []

    # (a) SFT references: " " + summary + EOS, right-padded to response_length
    if num_references > len(sft_train):
        raise RunError(f"{num_references} references requested but {args.train_split} has {len(sft_train)} rows")
    picked = sft_train.select(torch.randperm(len(sft_train), generator=draw)[:num_references].tolist())
    for row in tqdm(picked, desc="mixture: references", disable=not accelerator.is_main_process):
        if len(row["reference_response_token"]) != args.response_length:
            raise RunError(
                f"--response_length {args.response_length} but {args.query_dataset} has responses of "
                f"{len(row['reference_response_token'])} tokens"
            )
        queries.append(row["query_token"])
        query_texts.append(row["query"])
        responses.append(row["reference_response_token"])
        sources.append("reference")

    # (b) preference-pair responses, chosen and rejected. Left out: responses longer than response_length
    # (the policy never writes them), queries of another length (e.g. CNN/DM rows), exact duplicates (a summary
    # appears in several comparisons of the same post).
    preference = checks.load_split(args.preference_dataset, args.preference_split)  # checked in load_offline_data
    # the query length of every row, read from the Arrow column without decoding the rows
    query_lengths = pyarrow.compute.list_value_length(preference.data.column("query_token")).to_pylist()
    candidates, seen, dropped = [], set(), {"too_long": 0, "query_length": 0, "duplicate": 0}
    columns = preference.select_columns(["query", "chosen", "rejected", "chosen_token_len", "rejected_token_len"])
    for i, row in enumerate(tqdm(columns, desc="mixture: preference pool", disable=not accelerator.is_main_process)):
        for side in ("chosen", "rejected"):
            if query_lengths[i] != query_length:
                dropped["query_length"] += 1
            elif row[f"{side}_token_len"] > args.response_length:
                dropped["too_long"] += 1
            elif (row["query"], row[side]) in seen:
                dropped["duplicate"] += 1
            else:
                seen.add((row["query"], row[side]))
                candidates.append((i, side))
    if num_preference > len(candidates):
        raise RunError(
            f"{num_preference} preference responses requested but only {len(candidates)} usable ones exist "
            f"(left out: {dropped}); lower --mixture_size or the preference weight"
        )
    chosen_rows = [candidates[j] for j in torch.randperm(len(candidates), generator=draw)[:num_preference].tolist()]
    picked = preference.select([i for i, _ in chosen_rows])
    for (_, side), row in zip(chosen_rows,
                              tqdm(picked, desc="mixture: preference", disable=not accelerator.is_main_process)):
        queries.append(row["query_token"])
        query_texts.append(row["query"])
        responses.append(row[f"{side}_token"][: args.response_length])  # the rest was padding
        sources.append(side)

    # (c) new responses of the SFT model on SFT prompts (greedy by default)
    if num_generated > len(sft_train):
        raise RunError(f"{num_generated} generated responses requested but {args.train_split} has "
                       f"{len(sft_train)} prompts")
    picked = sft_train.select(torch.randperm(len(sft_train), generator=draw)[:num_generated].tolist())
    generation_time = 0.0
    if num_generated > 0:
        prompts = torch.tensor(picked["query_token"], dtype=torch.long)
        config = sampling_config(args, tokenizer, args.mixture_temperature)
        start = time.monotonic()
        generated = sample_policy(accelerator, policy, prompts, config, tokenizer, args.local_rollout_batch_size,
                                  "mixture: generate", args.gather_for_generation)
        generation_time = time.monotonic() - start
        queries += prompts.tolist()
        query_texts += picked["query"]
        responses += generated.tolist()
        sources += ["generated"] * num_generated

    # (d) label every (prompt, response) with the RM, then z-normalise over the mixture (the seed's Figure 5)
    query_tensor = torch.tensor(queries, dtype=torch.long)
    response_tensor = torch.tensor(responses, dtype=torch.long)
    start = time.monotonic()
    raw = score_responses(accelerator, reward_model, query_tensor, response_tensor, pad_token_id,
                          args.local_rollout_batch_size, "mixture: label")
    labelling_time = time.monotonic() - start
    # a NaN/inf RM score would poison the normalisation of every reward: stop here, before anything is cached (every
    # process holds every score, gathered, so all of them stop)
    if not torch.isfinite(raw).all():
        raise NonFiniteError(f"mixture/raw_reward: {int((~torch.isfinite(raw)).sum())} of {raw.numel()} RM scores are "
                             "not finite (NaN or inf); check the reward model (--reward_model_path) before labelling")
    has_eos = (response_tensor == eos_token_id).any(1)
    if args.non_eos_penalty:
        raw = torch.where(has_eos, raw, torch.full_like(raw, args.penalty_reward_value))
    mean, std = raw.mean(), raw.std(unbiased=False)
    if not std > 0:
        raise RunError("every mixture sample has the same reward; z-normalisation is undefined")
    normalised = (raw - mean) / std
    dataset = Dataset.from_dict(
        {
            "query": query_texts,
            "query_token": queries,
            "response_token": responses,
            "source": sources,
            "raw_reward": raw.tolist(),
            "reward": normalised.tolist(),
        }
    )
    stats = {
        "mixture/size": len(dataset),
        "mixture/num_references": num_references,
        "mixture/num_preference": num_preference,
        "mixture/num_generated": num_generated,
        "mixture/preference_left_out_too_long": dropped["too_long"],
        "mixture/preference_left_out_query_length": dropped["query_length"],
        "mixture/preference_left_out_duplicate": dropped["duplicate"],
        "mixture/raw_reward_mean": mean.item(),
        "mixture/raw_reward_std": std.item(),
        "mixture/eos_rate": has_eos.float().mean().item(),
        "mixture/generation_s": generation_time,
        "mixture/labelling_s": labelling_time,
    }
    for source in ("reference", "chosen", "rejected", "generated"):
        selected = [r for r, s in zip(normalised.tolist(), sources) if s == source]
        if selected:
            stats[f"mixture/reward_mean_{source}"] = sum(selected) / len(selected)
    return dataset, stats


def filter_mixture(args: Args, accelerator, mixture: Dataset) -> Tuple[Dataset, dict]:
    """Eq. 4 (MLE with filtering) applied to the data: only the samples whose normalised reward is above
    --filter_threshold are trained on. The others would only add zero-loss rows (the loss applies the same 0/1
    weight anyway), so they are dropped here, which makes filter the cheapest method (the seed's Table 3).
    Returns the kept samples and the pass fractions, overall and per source."""
    rewards = torch.tensor(mixture["reward"], dtype=torch.float32)
    keep = (filter_weights(rewards, args.filter_threshold) > 0).nonzero().squeeze(1).tolist()
    stats = {"filter/num_pass": len(keep), "filter/pass_fraction": len(keep) / len(mixture)}
    sources = mixture["source"]
    for source in ("reference", "chosen", "rejected", "generated"):
        total = sum(s == source for s in sources)
        if total:
            passed = sum(sources[i] == source for i in keep)
            stats[f"filter/pass_fraction_{source}"] = passed / total
    accelerator.print(f"[filter] {len(keep)} of {len(mixture)} samples have normalised reward > "
                      f"{args.filter_threshold}")
    return mixture.select(keep), stats


def mixture_samples(args: Args, mixture: Dataset, tokenizer):
    """The training samples of filter, rwr and dt: queries (N, W) left-padded, responses (N, Tr) right-padded and
    the normalised rewards (N,). For dt (eq. 6) each query carries its sample's own reward prompt, built by the
    same function as the prompt at inference."""
    rewards = torch.tensor(mixture["reward"], dtype=torch.float32)
    responses = torch.tensor(mixture["response_token"], dtype=torch.long)
    if args.method == "dt":
        queries = dt_queries(tokenizer, mixture["query"], rewards.tolist(), tokenizer.pad_token_id)
    else:
        queries = torch.tensor(mixture["query_token"], dtype=torch.long)
    return queries, responses, rewards


def best_of_n_candidates(args: Args, accelerator, model, reward_model, tokenizer, queries: torch.Tensor, costs: dict,
                         desc: str):
    """Rejection sampling (OpenRLHF A.7), first half: --n responses per prompt from the current policy at
    --bon_temperature, and their raw RM scores. Returns the candidates (P * n, Tr), n consecutive rows per prompt
    as best_of_n_select reads them, and their scores (P * n,); the seconds spent go into `costs` (Table 3)."""
    candidates_q = queries.repeat_interleave(args.n, 0)  # (P * n, Tq): n consecutive copies per prompt
    config = sampling_config(args, tokenizer, args.bon_temperature)
    start = time.monotonic()
    candidates = sample_policy(accelerator, model, candidates_q, config, tokenizer, args.local_rollout_batch_size,
                               f"{desc}: sample", args.gather_for_generation)
    costs["generation_s"] += time.monotonic() - start
    start = time.monotonic()
    scores = score_responses(accelerator, reward_model, candidates_q, candidates, tokenizer.pad_token_id,
                             args.local_rollout_batch_size, f"{desc}: score")
    costs["labelling_s"] += time.monotonic() - start
    return candidates, scores


def loss_weights(args: Args, rewards: torch.Tensor) -> torch.Tensor:
    """The weight w_i of each sample of an update batch in weighted_response_loss, from its reward: eq. 4 (filter)
    1[R > t], eq. 5 (rwr) the self-normalised and clipped exp(R / beta), eq. 6 (dt) and best-of-n 1. Computed over
    the whole update batch (identical on every process) before each process takes its share of the batch."""
    if args.method == "filter":
        return filter_weights(rewards, args.filter_threshold)
    if args.method == "rwr":
        return rwr_weights(rewards, args.rwr_beta, args.rwr_max_weight)[1]
    return torch.ones(rewards.numel())


class OfflineDataOrder:
    """The data position of step 2, in a form accelerate's save_state / load_state carry
    (register_for_checkpointing needs state_dict and load_state_dict).

    One generator draws every shuffle of the run, the same on every process: best-of-n's prompt order (a new
    one each time the prompts run out) and each round's permutation of its samples (a new one each pass).
    `permutation` and `position` say which update batches of the current pass are used. For best-of-n the
    round's samples themselves are kept too: they were sampled from the policy of that moment, so after a
    resume they could not be drawn again; the mixture methods rebuild theirs from the cached mixture.
    Its tensors are replaced, never changed in place, so a state_dict stays as it was taken."""

    def __init__(self, seed: int, num_prompts: int):
        self.generator = torch.Generator().manual_seed(seed)
        self.prompt_order, self.prompt_cursor = torch.randperm(num_prompts, generator=self.generator), 0
        self.permutation, self.position = None, 0
        self.round_samples = None  # best-of-n: (queries, responses, rewards) of the current round

    def next_prompts(self, count: int) -> list:
        """Best-of-n: the next `count` prompt rows; a new pass over the prompts is reshuffled."""
        if self.prompt_cursor + count > self.prompt_order.numel():
            self.prompt_order, self.prompt_cursor = (
                torch.randperm(self.prompt_order.numel(), generator=self.generator), 0)
        rows = self.prompt_order[self.prompt_cursor : self.prompt_cursor + count].tolist()
        self.prompt_cursor += count
        return rows

    def new_round(self, round_samples=None) -> None:
        """A new set of training samples: its first permutation is drawn at its first batch."""
        self.permutation, self.position, self.round_samples = None, 0, round_samples

    def next_batch(self, num_samples: int, batch_size: int) -> torch.Tensor:
        """Row indices of the next update batch (every process gets the same). A pass that cannot fill another
        batch ends (its last incomplete batch is left out) and the next pass is reshuffled."""
        if self.permutation is None or self.position == num_samples // batch_size:
            self.permutation, self.position = torch.randperm(num_samples, generator=self.generator), 0
        batch = self.permutation[self.position * batch_size : (self.position + 1) * batch_size]
        self.position += 1
        return batch

    def state_dict(self) -> dict:
        return {
            "generator": self.generator.get_state(), "prompt_order": self.prompt_order,
            "prompt_cursor": self.prompt_cursor, "permutation": self.permutation, "position": self.position,
            "round_samples": self.round_samples,
        }

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.prompt_order, self.prompt_cursor = state["prompt_order"], state["prompt_cursor"]
        self.permutation, self.position = state["permutation"], state["position"]
        self.round_samples = state["round_samples"]


@torch.no_grad()
def evaluate_policy(args: Args, accelerator, model, reward_model, tokenizer, eval_rows: dict,
                    policy_queries: torch.Tensor, generation_config, reward_stats: Optional[Tuple[float, float]]):
    """Sample the eval queries (policy_queries: with the DT prompt for dt), score them with the RM on the
    ORIGINAL query (the reward prompt is an instruction to the policy, not part of the task), and build the
    sample table in the contract's columns. reward_stats = the mixture's (mean, std), to also report the score
    in the normalised units of the DT target."""
    pad_token_id, eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    # evaluation samples from its own random stream, the same at every evaluation (evaluation_rng): how often and
    # how much a run evaluates never changes what it trains
    with evaluation_rng(accelerator, args.seed + accelerator.process_index * 100003):
        responses = sample_policy(accelerator, model, policy_queries, generation_config, tokenizer,
                                  args.local_rollout_batch_size, "evaluate", args.gather_for_generation)
    queries = eval_rows["query_token"]
    scores = score_responses(accelerator, reward_model, queries, responses, pad_token_id, args.local_rollout_batch_size,
                             "evaluate: score")
    has_eos = (responses == eos_token_id).any(1)
    response_token_len = torch.clamp(first_true_indices(responses == eos_token_id) + 1, max=responses.size(1))
    df = pd.DataFrame(
        {
            "query": [tokenizer.decode(q[q != pad_token_id], skip_special_tokens=True) for q in queries],
            "response": tokenizer.batch_decode(responses, skip_special_tokens=True),
            "reference": eval_rows["reference_response"],
            "score": scores.tolist(),
            "response_token_len": response_token_len.tolist(),
            "has_eos": has_eos.tolist(),
        }
    )
    metrics = {
        "score": float(scores.mean()),
        "eos_rate": float(has_eos.float().mean()),
        "response_token_len_mean": float(response_token_len.float().mean()),
        "num_samples": len(df),
    }
    if reward_stats is not None:
        metrics["score_normalized"] = float(((scores - reward_stats[0]) / reward_stats[1]).mean())
    return metrics, df


def alignment_data(args: Args, accelerator, model, reward_model, tokenizer, costs: dict):
    """Step 1: the labelled mixture of filter, rwr and dt (build_mixture, or its cached copy: the three methods share
    one labelling pass when their mixture flags match), and for filter (eq. 4) only its samples above the threshold.
    Returns the mixture, its statistics and the summary entries of step 1; best_of_n samples its own data in step 2
    and gets (None, {}, {}). The cost of building the mixture is paid once and shared; it is counted in `costs` for
    every method (Table 3)."""
    if args.method == "best_of_n":
        return None, {}, {}
    build = functools.partial(build_mixture, args, accelerator, model, reward_model, tokenizer)
    # cached under --cache_dir (rlhf_utils/records.py), or build()
    mixture, mixture_stats = records.load_or_build_mixture(args, accelerator, build)
    summary = dict(mixture_stats)
    costs["generation_s"] += mixture_stats["mixture/generation_s"]
    costs["labelling_s"] += mixture_stats["mixture/labelling_s"]
    if args.method == "filter":  # eq. 4: only the samples above the threshold are trained on
        mixture, filter_stats = filter_mixture(args, accelerator, mixture)
        summary.update(filter_stats)
    return mixture, mixture_stats, summary


def dt_targets(args: Args, mixture, summary: dict) -> dict:
    """dt: the targets at --dt_eval_percentiles of the rewards the model saw in its prompts (the mixture's own
    distribution), and with --dt_target_percentile the inference target itself as one of them (written into
    args.dt_target: a derived value that args.json records). Adds them to `summary`; returns percentile -> target.
    The other methods have no target: {}."""
    if args.method != "dt":
        return {}
    percentile_targets = dt_percentile_targets(mixture["reward"], args.dt_eval_percentiles)
    if args.dt_target_percentile is not None:
        args.dt_target = dt_percentile_targets(mixture["reward"],
                                               (args.dt_target_percentile,))[args.dt_target_percentile]
    summary.update({f"dt/target_at_percentile_{p:g}": t for p, t in percentile_targets.items()})
    summary["dt/target"] = args.dt_target
    return percentile_targets


def round_samples(args: Args, run, accelerator, model, reward_model, tokenizer, sft_train, mixture,
                  data_order: "OfflineDataOrder", counters: "records.OfflineCounters", update: int, iteration: int,
                  resumed: bool):
    """Step 2 (a): the training samples of the round that starts at `update` (or, `resumed`, goes on there after a
    resume): queries (N, W) left-padded, responses (N, Tr) right-padded, rewards (N,). filter, rwr and dt read the
    mixture (dt: each query with its sample's reward prompt). best_of_n (rejection sampling) draws --n candidates per
    prompt from the current policy and keeps the RM's best; a resumed round takes the samples the interrupted run
    drew, which data_order carries (they came from the policy of that moment and cannot be drawn again)."""
    if args.method != "best_of_n":
        samples = mixture_samples(args, mixture, tokenizer)  # dt: with the reward prompt
        if not resumed:
            data_order.new_round()
        return samples
    if resumed:
        return data_order.round_samples  # sampled before the interruption
    rows = data_order.next_prompts(args.bon_num_prompts)
    queries = torch.tensor(sft_train.select(rows)["query_token"], dtype=torch.long)
    candidates, scores = best_of_n_candidates(args, accelerator, model, reward_model, tokenizer, queries,
                                              counters.costs, f"best_of_n {iteration + 1}/{args.iterations}")
    # a NaN/inf RM score would decide which sample is kept: stop before training on this round
    run.guard(update, **{"best_of_n/scores": scores})
    responses, rewards, _ = best_of_n_select(scores, candidates, args.n)
    data_order.new_round((queries, responses, rewards))
    round_metrics = {
        "best_of_n/score_mean_all": scores.mean().item(),
        "best_of_n/score_mean_best": rewards.mean().item(),
        "best_of_n/eos_rate_best": (responses == tokenizer.eos_token_id).any(1).float().mean().item(),
        "best_of_n/iteration": iteration + 1,
    }
    counters.round_summary.update(
        {f"{k}_iter{iteration + 1}": v for k, v in round_metrics.items() if k != "best_of_n/iteration"})
    # the budget as spent, over the rounds so far (the summary's, which report.py's leaderboard reads): every
    # candidate sampled, kept or not, and the prompts they answer
    budget = {key: counters.round_summary.get(key, 0) + count
              for key, count in (("budget/responses_sampled", len(candidates)), ("budget/prompts", len(queries)))}
    counters.round_summary.update(budget)
    # logged at the round's first update: a step after any checkpoint taken before the round, so a resumed run
    # neither keeps a stale copy of this line nor writes it twice
    records.log_offline(run, args, update, {**round_metrics, **budget})
    accelerator.print(f"[best_of_n] iteration {iteration + 1}: "
                      + ", ".join(f"{k}={v:.4f}" for k, v in round_metrics.items()))
    return queries, responses, rewards


def train_update(args: Args, accelerator, model, optimizer, run, update: int, queries: torch.Tensor,
                 responses: torch.Tensor, global_batch: torch.Tensor, batch_weights: torch.Tensor, pad_token_id: int):
    """Step 2 (b), one optimizer update on the rows `global_batch` (the same on every process) with their loss
    weights: this process trains on its share, in micro batches of --local_micro_batch_size whose gradients
    accumulate into one optimizer step. The loss of every micro batch is divided by the target tokens of the whole
    update batch (all its micro batches, on every process), so the update's gradient is that of the batch's weighted
    token mean whatever the micro-batch size and the number of processes; its backward is scaled by the micro batches
    of the update (accumulation steps x processes), which accelerate's accumulation and the data-parallel gradient
    average divide out again. Returns the update's loss (the weighted token mean over the batch) and its input tokens
    (non-pad, every process)."""
    local_batch_size = args.local_micro_batch_size * args.gradient_accumulation_steps
    local_slice = slice(accelerator.process_index * local_batch_size,
                        (accelerator.process_index + 1) * local_batch_size)
    local_batch, local_weights = global_batch[local_slice], batch_weights[local_slice]
    # every response token (and its EOS) of the update batch is a target; the same count on every process
    batch_tokens = (responses[global_batch] != pad_token_id).sum().to(accelerator.device)
    scale = args.gradient_accumulation_steps * accelerator.num_processes
    stats = torch.zeros(2, device=accelerator.device)  # loss (its share of the batch mean), input tokens (non-pad)
    for micro in range(0, local_batch_size, args.local_micro_batch_size):
        micro_rows = local_batch[micro : micro + args.local_micro_batch_size]
        query_responses = torch.cat((queries[micro_rows], responses[micro_rows]), 1)
        labels = response_labels(query_responses, queries.size(1), pad_token_id)  # the response tokens only
        cols = real_columns(query_responses, pad_token_id)  # the padding every row shares is cut
        query_responses, labels = (query_responses[:, cols].to(accelerator.device),
                                   labels[:, cols].to(accelerator.device))
        weights = local_weights[micro : micro + args.local_micro_batch_size].to(accelerator.device)
        with accelerator.accumulate(model):
            loss, _ = weighted_response_loss(model, query_responses, labels, weights, pad_token_id, batch_tokens)
            # non-finite guard: checked before backward, so the weights never see it
            run.guard(update, **{"train/loss": loss})
            accelerator.backward(loss * scale)
            optimizer.step()  # a no-op until the last micro-batch of the update
            optimizer.zero_grad()
        stats += torch.stack([loss.detach(), (query_responses != pad_token_id).sum().float()])
    stats = accelerator.reduce(stats, reduction="sum")
    return stats[0].item(), int(stats[1])


def offline_evaluation(args: Args, run, accelerator, model, reward_model, tokenizer, eval_rows: dict,
                       percentile_targets: dict, mixture_stats: dict, step: int, final: bool) -> dict:
    """Step 3: sample and score the eval rows, write the tables and log their metrics; returns the metrics. dt: the
    final evaluation visits every target of --dt_eval_targets (Table 1), the percentile targets and --dt_target; the
    main table (samples.csv) is the one at --dt_target. The other methods have one prompt and no target. With a
    mixture, the scores are also given in its normalised units (those of the DT target)."""
    reward_stats = (mixture_stats["mixture/raw_reward_mean"], mixture_stats["mixture/raw_reward_std"]) \
        if mixture_stats else None
    if args.method != "dt":
        targets = [None]
    else:
        targets = list(dict.fromkeys([args.dt_target, *args.dt_eval_targets, *percentile_targets.values()])) \
            if final else [args.dt_target]
    eval_config = sampling_config(args, tokenizer, args.eval_temperature)
    out = {}
    for target in targets:
        # dt: the same prompt builder as in training, with the target reward in the prompt
        queries = eval_rows["query_token"] if target is None else dt_queries(
            tokenizer, eval_rows["query"], [target] * len(eval_rows["query"]), tokenizer.pad_token_id)
        raw_metrics, df = evaluate_policy(args, accelerator, model, reward_model, tokenizer, eval_rows, queries,
                                          eval_config, reward_stats)
        metrics = records.write_offline_evaluation(args, run, step, target, final, raw_metrics, df)
        out.update(metrics)
        records.log_offline(run, args, step, metrics)
    return out


def main(args: Args) -> dict:
    start_time = time.monotonic()
    # ---------------- processes, batch arithmetic and precision ----------------
    accelerator = make_offline_accelerator(args)
    run = Run(args, accelerator)  # run name and folder (rlhf_utils/run.py)
    run.inputs(sft_model_path=args.sft_model_path, reward_model_path=args.reward_model_path,
               preference_dataset=args.preference_dataset, query_dataset=args.query_dataset)

    # ---------------- seeding (labelled, deliberate) ----------------
    set_seed(args.seed)  # mixture draw, weights and data order: the same on every process
    local_seed = args.seed + accelerator.process_index * 100003  # sampling differs per process

    # ---------------- tokenizer and models ----------------
    tokenizer = load_tokenizer(args.sft_model_path, args.trust_remote_code)  # Detail 3: [PAD] distinct from EOS
    pad_token_id = tokenizer.pad_token_id
    # the RM scores the policy's token ids as they are: one tokenizer for both (checked before any weights load)
    checks.check_reward_tokenizer(tokenizer, args.sft_model_path, args.reward_model_path, args.trust_remote_code)
    policy, reward_model = load_offline_models(args, tokenizer)
    reward_model = models.prepare_frozen_model(accelerator, reward_model)  # Detail 8: under ZeRO-3, an inference engine
    # the policy samples the mixture before it trains: it goes through accelerator.prepare first, because under
    # ZeRO-3 its weights are already partitioned and only a DeepSpeed engine gathers them for a forward
    adamw = torch.optim.AdamW(policy.parameters(), lr=args.lr, eps=args.eps)
    model, optimizer = accelerator.prepare(policy, adamw)
    torch.manual_seed(local_seed)  # generation (mixture, best-of-n) differs across processes; evaluation has its own

    # ---------------- data ----------------
    sft_train, eval_dataset = load_offline_data(args, tokenizer)
    run.claim_output_dir()  # every input check has passed: only now mark --output_dir as this run's

    # ---------------- step 1: the labelled mixture (best-of-n samples its own data in step 2) ----------------
    costs = {"generation_s": 0.0, "labelling_s": 0.0, "training_s": 0.0}  # wall seconds per stage (Table 3)
    mixture, mixture_stats, summary = alignment_data(args, accelerator, model, reward_model, tokenizer, costs)
    percentile_targets = dt_targets(args, mixture, summary)  # dt: the inference and evaluation targets
    samples_per_round, updates_per_round, num_updates = count_offline_updates(args, mixture, len(sft_train))

    # ---------------- schedule, data order and resume ----------------
    scheduler = lr_schedule(optimizer, args.scheduler, num_updates)  # over the updates of every iteration
    # every shuffle of step 2 comes from one generator seeded like the rest of the run (the same on every process)
    data_order = OfflineDataOrder(args.seed, len(sft_train))
    # saved and restored with the model and optimizer: the schedule and the data position
    accelerator.register_for_checkpointing(scheduler)
    accelerator.register_for_checkpointing(data_order)
    last_good = LastGoodState(run, accelerator, adamw, scheduler, data_order)  # the non-finite guard's fallback
    # the running counters; --resume takes them from the checkpoint, whose run must share the flags that fix the
    # number of updates and the data order
    counters = records.OfflineCounters(run.start(
        records.OfflineCounters.fresh(costs), num_updates=num_updates, method=args.method, iterations=args.iterations,
        total_batch_size=args.total_batch_size, world_size=args.world_size))
    if mixture_stats and counters.update == 0:
        records.log_offline(run, args, 0, mixture_stats)  # a resumed run kept this line of metrics.jsonl

    # step 3's evaluation, on the first num_eval_samples rows of the eval split
    evaluate = functools.partial(offline_evaluation, args, run, accelerator, model, reward_model, tokenizer,
                                 offline_eval_rows(args, eval_dataset), percentile_targets, mixture_stats)

    # ---------------- step 2: training rounds (one; --iterations for best_of_n) ----------------
    model.train()
    progress = tqdm(total=num_updates, initial=counters.update, disable=not accelerator.is_main_process,
                    desc=f"offline_rl {args.method}")
    samples = None
    for update in range(counters.update + 1, num_updates + 1):
        with last_good.kept(update, counters.state()):  # a non-finite value leaves the state after update - 1 saved
            # (a) a round's samples (queries (N, W) left-padded, responses (N, Tr) right-padded, rewards (N,)) at its
            # first update; a run resumed in the middle of a round goes on with that round's samples and permutation
            if samples is None or (update - 1) % updates_per_round == 0:
                samples = round_samples(args, run, accelerator, model, reward_model, tokenizer, sft_train, mixture,
                                        data_order, counters, update, iteration=(update - 1) // updates_per_round,
                                        resumed=(update - 1) % updates_per_round > 0)
            queries, responses, rewards = samples
            # (b) the update: every process draws the same permutation (a new one each pass over the samples) and
            # trains on its share of each batch
            global_batch = data_order.next_batch(queries.size(0), args.total_batch_size)
            batch_weights = loss_weights(args, rewards[global_batch])  # eq. 4-6, over the whole update batch
            if args.method == "rwr":  # non-finite guard: a NaN/inf weight would scale this update's gradient
                run.guard(update, **{"train/rwr_weights": batch_weights})
            update_start = time.monotonic()
            loss, tokens = train_update(args, accelerator, model, optimizer, run, update, queries, responses,
                                        global_batch, batch_weights, pad_token_id)
        scheduler.step()
        update_s = time.monotonic() - update_start  # training alone (a best-of-n round's sampling is cost/generation_s)
        counters.add_update(loss, tokens, update_s)
        metrics = {
            "train/loss": loss,
            "time/update_s": update_s,
            "train/lr": scheduler.get_last_lr()[0],
            "train/tokens_per_s": counters.train_tokens / counters.costs["training_s"],
            "train/weight_max": batch_weights.max().item(),
            "train/reward_mean": rewards[global_batch].mean().item(),
        }
        progress.update(1)
        progress.set_postfix(loss=f"{loss:.4f}", tok_s=f"{metrics['train/tokens_per_s']:.0f}")
        records.log_offline(run, args, update, metrics)
        if due(args.eval_every, update, num_updates):
            evaluate(update, final=False)
        if due(args.run.checkpoint_every, update, num_updates):
            run.checkpoint(update, counters.state())
    progress.close()

    # ---------------- step 3: final evaluation, costs (Table 3), model ----------------
    eval_start = time.monotonic()
    summary.update(counters.round_summary)
    summary.update(evaluate(num_updates, final=True))
    costs = counters.costs
    summary.update(
        {
            "train/loss": counters.last_loss,
            "train/tokens": counters.train_tokens,
            "train/updates": num_updates,
            "train/samples_per_round": samples_per_round,
            # the budget as spent (report.py's leaderboard reads it; best_of_n's samples: round_summary)
            "budget/updates": counters.update, "budget/rows_read": counters.update * args.total_batch_size,
            "cost/generation_s": costs["generation_s"],
            "cost/labelling_s": costs["labelling_s"],
            "cost/training_s": costs["training_s"],
            "cost/total_s": costs["generation_s"] + costs["labelling_s"] + costs["training_s"],
            "cost/evaluation_s": time.monotonic() - eval_start,
            "wall_time_s": time.monotonic() - start_time,
        }
    )
    models.save_pretrained_model(accelerator, model, accelerator.unwrap_model(model), tokenizer, args.output_dir)
    run.finish(summary)
    if accelerator.is_main_process and args.run.push_to_hub:
        models.push_offline_model(args)
    accelerator.print(json.dumps(summary, indent=2))
    return summary


# ---------------------------------------------------------------------------------------------
# The setup main runs on: processes and batch arithmetic, models, inputs, rows per process, the evaluation rows,
# the number of updates. What decides no number lives in rlhf_utils/: in sections titled for offline_rl.py, the
# refusals (flags.py), the mixture's cache (run.py), the evaluation tables, log lines and counters (records.py) and
# the upload (models.py); the preference split's input check is checks.py's check_preference_columns
# ---------------------------------------------------------------------------------------------


def make_offline_accelerator(args: Args) -> Accelerator:
    """Join the processes, do the batch arithmetic (a batch that does not divide fails here) and make the
    accelerator: gradient accumulation over total_batch_size / (local_micro_batch_size * world_size) micro batches,
    bf16 when asked (or available), and DeepSpeed's micro batch and clipping (Detail 8)."""
    # first: the accumulation steps depend on the number of processes
    args.world_size = start_processes(args.run.process_group_timeout_min).num_processes
    gradient_accumulation_steps = exact_div(
        args.total_batch_size,
        args.local_micro_batch_size * args.world_size,
        "total_batch_size / (local_micro_batch_size * world_size)",
    )
    check_offline_flags(args, gradient_accumulation_steps)
    args.gradient_accumulation_steps = gradient_accumulation_steps  # args.json records the value used
    if args.bf16 is None:
        args.bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps, mixed_precision="bf16" if args.bf16 else "no"
    )
    configure_deepspeed(accelerator, args.local_micro_batch_size)  # Detail 8 (no-op without DeepSpeed)
    return accelerator


def load_offline_models(args: Args, tokenizer):
    """The two models: the policy (the SFT model, which also writes the mixture's new responses) and the frozen
    reward model that labels every sample. There is no reference model: none of these losses has a KL term."""
    # float32 master weights whatever the checkpoint's dtype (Pythia's hub weights are float16); bf16 is autocast
    policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, dtype=torch.float32,
                                                  trust_remote_code=args.trust_remote_code)
    checks.check_finite(policy, args.sft_model_path)
    reward_model = AutoModelForSequenceClassification.from_pretrained(
        args.reward_model_path, num_labels=1, dtype=torch.bfloat16 if args.bf16 else torch.float32,
        trust_remote_code=args.trust_remote_code,
    )
    checks.check_finite(reward_model, args.reward_model_path)
    for model in (policy, reward_model):
        # the config's row count, not the weight's shape: ZeRO-3 partitions weights as they load
        if model.config.vocab_size < len(tokenizer):
            model.resize_token_embeddings(len(tokenizer))
        if args.disable_dropout:
            disable_dropout(model)
    return models.checkpointed(policy, args.gradient_checkpointing), reward_model


def load_offline_data(args: Args, tokenizer):
    """The SFT train and eval splits, and for the mixture methods the preference split (read again when the mixture
    is built): each is checked for the columns it is read for and for the tokenizer that made it, before the
    output folder is claimed. Returns the train and eval splits."""
    sft_train = checks.load_split(args.query_dataset, args.train_split)
    checks.check_columns(sft_train, TRAIN_COLUMNS["best_of_n" if args.method == "best_of_n" else "mixture"],
                  f"{args.query_dataset} split {args.train_split!r}")
    eval_dataset = checks.load_split(args.query_dataset, args.eval_split)
    checks.check_columns(eval_dataset, EVAL_COLUMNS, f"{args.query_dataset} split {args.eval_split!r}")
    for split, dataset in ((args.train_split, sft_train), (args.eval_split, eval_dataset)):
        checks.check_data_tokenizer(dataset, tokenizer, args.sft_model_path, f"{args.query_dataset} split {split!r}")
        checks.check_query_response(dataset, tokenizer.pad_token_id, f"{args.query_dataset} split {split!r}")
    if args.method != "best_of_n":  # the mixture reads the preference responses (when it is not cached yet)
        preference = checks.load_split(args.preference_dataset, args.preference_split)
        checks.check_preference_columns(preference, args)
        checks.check_data_tokenizer(preference, tokenizer, args.sft_model_path,
                             f"{args.preference_dataset} split {args.preference_split!r}")
    return sft_train, eval_dataset


# the columns each split is read for (checks.check_columns runs on every split before it is used; the preference
# split's: rlhf_utils/checks.py's OFFLINE_PREFERENCE_COLUMNS)
TRAIN_COLUMNS = {"mixture": ["query_token", "query", "reference_response_token"], "best_of_n": ["query_token"]}
EVAL_COLUMNS = ["query", "query_token", "reference_response"]


def local_rows(num_rows: int, accelerator) -> list:
    """This process's contiguous share of row indices. Shares are equal in size (the last row is repeated to
    fill them), so every process runs the same number of generate calls; gather_rows drops the repeats."""
    per_process = math.ceil(num_rows / accelerator.num_processes)
    indices = list(range(num_rows)) + [num_rows - 1] * (per_process * accelerator.num_processes - num_rows)
    return indices[accelerator.process_index * per_process : (accelerator.process_index + 1) * per_process]


def gather_rows(pairs: list, num_rows: int) -> list:
    """Inverse of local_rows: (row index, value) pairs from every process -> the values in row order."""
    by_row = {}
    for row, value in gather_object(pairs):
        by_row.setdefault(row, value)
    if len(by_row) != num_rows:
        raise RuntimeError(f"gathered {len(by_row)} rows, expected {num_rows}")
    return [by_row[i] for i in range(num_rows)]


def offline_eval_rows(args: Args, eval_dataset) -> dict:
    """The first --num_eval_samples rows of the eval split (all of it for None): query texts, left-padded query
    tokens (N, Tq) and reference summaries."""
    num_eval = len(eval_dataset) if args.num_eval_samples is None else min(args.num_eval_samples, len(eval_dataset))
    eval_subset = eval_dataset.select(range(num_eval))
    return {
        "query": eval_subset["query"],
        "query_token": torch.tensor(eval_subset["query_token"], dtype=torch.long),
        "reference_response": eval_subset["reference_response"],
    }


def count_offline_updates(args: Args, mixture, num_prompts: int) -> Tuple[int, int, int]:
    """Training samples per round (best_of_n: one per prompt, else the mixture's), updates per round (--total_episodes,
    or --num_train_epochs passes over the round's samples, in full batches) and of the whole run (--iterations
    rounds); a round must fill at least one update batch."""
    samples_per_round = args.bon_num_prompts if args.method == "best_of_n" else len(mixture)
    episodes_per_round = (args.total_episodes if args.total_episodes is not None
                          else args.num_train_epochs * samples_per_round)
    updates_per_round = episodes_per_round // args.total_batch_size
    check_round_size(args, samples_per_round, episodes_per_round, updates_per_round, num_prompts)
    return samples_per_round, updates_per_round, updates_per_round * args.iterations


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


def truncate_response(eos_token_id: int, pad_token_id: int, responses: torch.Tensor) -> torch.Tensor:
    """Detail 23: keep each response up to and including its first EOS, fill the rest with [PAD]."""
    eos_index = first_true_indices(responses == eos_token_id).unsqueeze(-1)  # (B, 1)
    positions = torch.arange(responses.size(1), device=responses.device).unsqueeze(0)  # (1, T)
    return torch.masked_fill(responses, positions > eos_index, pad_token_id)


def get_score(reward_model, queries: torch.Tensor, responses: torch.Tensor, pad_token_id: int,
              reward=get_reward) -> torch.Tensor:
    """RM scores (B,) of left-padded queries (B, Tq) and right-padded responses (B, Tr), read at the EOS
    (Detail 12), computed on the columns that hold a real token in some row by `reward` (get_reward, or
    get_reward_query_once: each query once, --query_once)."""
    query_responses = torch.cat((queries, responses), 1)
    cols = real_columns(query_responses, pad_token_id)
    start = min(cols.start, queries.size(1))
    return reward(reward_model, query_responses[:, start : cols.stop], pad_token_id, queries.size(1) - start)[1]


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


def configure_deepspeed(accelerator, micro_batch_size: int) -> None:
    """Under DeepSpeed (zero2.yaml / zero3.yaml; Detail 8) set what accelerate would fill as "auto": the micro batch
    per process, and no gradient clipping (the paper clips none; accelerate's "auto" clips at 1.0)."""
    config = getattr(accelerator.state.deepspeed_plugin, "deepspeed_config", None)
    if config is not None:
        config["train_micro_batch_size_per_gpu"] = micro_batch_size
        clipping = config.get("gradient_clipping", "auto")
        config["gradient_clipping"] = 0.0 if clipping == "auto" else clipping


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
