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
          For every method the loss covers response tokens (and their EOS) only, never the query.
  step 3  samples of the validation split as CSV (judge.py reads them), RM-scored. For dt also one CSV per
          target in --dt_eval_targets (the seed's Table 1: controllability), and the cost of each stage in
          wall seconds (generation, labelling, training: the seed's Table 3) in summary.json.

Checkpoints: every --checkpoint_every updates of step 2, runs/{run_name}/checkpoints/update_N holds the policy,
optimizer, schedule, RNG states and the data position (the shuffle generator, the current permutation and, for
best_of_n, the current round's selected samples); `--resume --run_name NAME` continues from the newest one and ends
with the weights and metrics of an uninterrupted run. A NaN/inf loss, RWR weight or RM score stops the run and
keeps the last good checkpoint.

Single process:   python offline_rl.py --method dt --sft_model_path models/sft --reward_model_path models/rm
Several:          accelerate launch [--config_file zero2.yaml] offline_rl.py ...
"""

import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Literal, Optional, Tuple

import numpy as np
import pandas as pd
import pyarrow
import pyarrow.compute
import torch
import torch.nn.functional as F
import tyro
from accelerate import Accelerator, PartialState
from accelerate.utils import broadcast_object_list, gather_object, set_seed
from datasets import Dataset, load_dataset, load_from_disk
from huggingface_hub import HfApi
from torch.utils.tensorboard import SummaryWriter
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GenerationConfig


@dataclass
class Args:
    # ---- experiment bookkeeping ----
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (the run name starts with it)"""
    seed: int = 1
    """seed of the mixture draw, weights and data order (the same on every process); sampling uses seed + 100003 * rank"""
    run_name: Optional[str] = None
    """None -> f"{exp_name}__{seed}__{unix time}"; every file of the run goes under runs/{run_name}/"""
    track: bool = False
    """log to Weights and Biases (it mirrors TensorBoard)"""
    wandb_project_name: str = "tldr_summarize"
    """the W&B project (with --track)"""
    wandb_entity: Optional[str] = None
    """the W&B entity (team); None = your default entity"""
    push_to_hub: bool = False
    """upload the aligned model and tokenizer to the Hugging Face hub"""
    hub_model_id: Optional[str] = None
    """hub repository for --push_to_hub; None -> f"{sft model name}__{exp_name}__{method}__{seed}" """
    output_dir: str = "models/offline_rl"
    """where the aligned model and tokenizer are saved (safetensors)"""
    run_dir_root: str = "runs"
    """folder that holds runs/{run_name}/"""
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

    # ---- derived at run time (not flags) ----
    world_size: tyro.conf.Suppress[Optional[int]] = None
    """number of processes"""
    gradient_accumulation_steps: tyro.conf.Suppress[Optional[int]] = None
    """micro-batches per update on one process = total_batch_size / (local_micro_batch_size * world_size)"""


# ---------------------------------------------------------------------------------------------
# Offline-RL pieces (module-level so that tests can check each one against a hand computation; names kept
# unique to this script)
# ---------------------------------------------------------------------------------------------


def offline_generation_config(response_length: int, temperature: float, pad_token_id: int) -> GenerationConfig:
    """Detail 23: exactly response_length new tokens. `eos_token_id=[]` turns off stopping at EOS while EOS
    stays an ordinary token that can be chosen (`min_new_tokens` would forbid it). temperature 0 means
    greedy decoding (the seed generates its mixture greedily); otherwise pure sampling (top_k 0, top_p 1)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if temperature == 0:
        return GenerationConfig(max_new_tokens=response_length, do_sample=False, eos_token_id=[], pad_token_id=pad_token_id)
    return GenerationConfig(
        max_new_tokens=response_length,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        do_sample=True,
        eos_token_id=[],
        pad_token_id=pad_token_id,
    )


def offline_lr_schedule(optimizer, kind: str, num_updates: int) -> torch.optim.lr_scheduler.LambdaLR:
    """No warm-up; cosine decays to 0 as 0.5 * (1 + cos(pi * t / T)), linear as 1 - t / T, constant stays.
    The same curves as transformers.get_scheduler, written out because importing that module loads peft."""
    curves = {
        "cosine": lambda t: 0.5 * (1.0 + math.cos(math.pi * min(t, num_updates) / num_updates)),
        "linear": lambda t: max(0.0, 1.0 - t / num_updates),
        "constant": lambda t: 1.0,
    }
    return torch.optim.lr_scheduler.LambdaLR(optimizer, curves[kind])


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
    inference (score = the target). The whole string is tokenized at once, in both cases."""
    return tokenizer.encode(query + dt_reward_prompt(score))


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
                           pad_token_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """sum over samples i and target tokens t of w_i * (-log pi(x_t | x_<t)), divided by the number of target
    tokens in the micro-batch (so w = 1 is the SFT token mean). Eq. 4: w = 1[R > t]; eq. 5: w = RWR weight;
    eq. 6 and best-of-n: w = 1. Returns the loss and the per-sample mean token NLL (B,), for logging."""
    logits = forward(model, query_responses, pad_token_id).logits[:, :-1].float()  # (B, T-1, V)
    targets = labels[:, 1:]  # (B, T-1): token t is predicted at t - 1
    mask = targets != -100
    nll = F.cross_entropy(logits.transpose(1, 2), targets.clamp(min=0), reduction="none")  # (B, T-1)
    nll = nll * mask
    loss = (nll * weights.unsqueeze(1)).sum() / mask.sum()
    return loss, nll.sum(1) / mask.sum(1).clamp(min=1)


def best_of_n_select(scores: torch.Tensor, responses: torch.Tensor, n: int):
    """Rejection sampling (OpenRLHF A.7): rows are grouped as n consecutive candidates per prompt; keep the
    candidate with the highest RM score. Returns the kept responses (P, Tr), their scores (P,) and index (P,)."""
    grouped = scores.view(-1, n)  # (P, n)
    best = grouped.argmax(dim=1)  # (P,)
    rows = torch.arange(grouped.size(0), device=scores.device) * n + best
    return responses[rows], grouped.max(dim=1).values, best


def trim_columns(queries: torch.Tensor, responses: torch.Tensor, pad_token_id: int):
    """Drop leading query columns and trailing response columns that are padding in every row (saves compute;
    positions and masks come from the pads, so the loss and the rewards do not change)."""
    query_real = (queries != pad_token_id).any(0)
    first = int(first_true_indices(query_real.unsqueeze(0))[0]) if bool(query_real.any()) else queries.size(1)
    response_real = (responses != pad_token_id).any(0)
    last = int(response_real.nonzero().max()) + 1 if bool(response_real.any()) else 1
    return queries[:, first:], responses[:, :last]


@torch.no_grad()
def sample_policy(accelerator, model, queries: torch.Tensor, generation_config, tokenizer, batch_size: int, desc: str):
    """Fixed-length responses (Detail 23) to left-padded queries (N, W), truncated after the first EOS:
    (N, response_length), the same on every process."""
    unwrapped = accelerator.unwrap_model(model)
    was_training = unwrapped.training
    unwrapped.eval()
    indices = local_rows(queries.size(0), accelerator)
    pairs = []
    for start in tqdm(range(0, len(indices), batch_size), desc=desc, disable=not accelerator.is_main_process):
        rows = indices[start : start + batch_size]
        query = queries[rows]
        query = query[:, int(first_true_indices((query != tokenizer.pad_token_id).any(0).unsqueeze(0))[0]) :]  # drop all-pad columns
        query = query.to(accelerator.device)
        query_response, _ = generate(unwrapped, query, tokenizer.pad_token_id, generation_config)
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
        query, response = trim_columns(queries[rows], responses[rows], pad_token_id)
        query_response = torch.cat((query, response), 1).to(accelerator.device)
        _, score, _ = get_reward(reward_model, query_response, pad_token_id, query.size(1))
        pairs += list(zip(rows, score.float().cpu().tolist()))
    return torch.tensor(gather_rows(pairs, queries.size(0)), dtype=torch.float32)


def mixture_counts(size: int, weights: Tuple[float, float, float]) -> Tuple[int, int, int]:
    """Samples per source (references, preference responses, generated) for relative weights; sums to size."""
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--mixture_weights must be non-negative with a positive sum, got {weights}")
    total = sum(weights)
    num_references = round(size * weights[0] / total)
    num_preference = round(size * weights[1] / total)
    return num_references, num_preference, size - num_references - num_preference


def build_mixture(args: Args, accelerator, policy, reward_model, tokenizer) -> Tuple[Dataset, dict]:
    """Step 1 (the seed's step 3): draw the three sources, generate, label with the RM, z-normalise."""
    pad_token_id, eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    num_references, num_preference, num_generated = mixture_counts(args.mixture_size, args.mixture_weights)
    draw = torch.Generator().manual_seed(args.seed)
    sft_train = load_split(args.query_dataset, args.train_split)
    query_length = len(sft_train[0]["query_token"])
    queries, query_texts, responses, sources = [], [], [], []

    # (a) SFT references: " " + summary + EOS, right-padded to response_length
    if num_references > len(sft_train):
        raise ValueError(f"{num_references} references requested but {args.train_split} has {len(sft_train)} rows")
    picked = sft_train.select(torch.randperm(len(sft_train), generator=draw)[:num_references].tolist())
    for row in tqdm(picked, desc="mixture: references", disable=not accelerator.is_main_process):
        if len(row["reference_response_token"]) != args.response_length:
            raise ValueError(
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
    preference = load_split(args.preference_dataset, args.preference_split)  # checked in load_offline_data
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
        raise ValueError(
            f"{num_preference} preference responses requested but only {len(candidates)} usable ones exist "
            f"(left out: {dropped}); lower --mixture_size or the preference weight"
        )
    chosen_rows = [candidates[j] for j in torch.randperm(len(candidates), generator=draw)[:num_preference].tolist()]
    picked = preference.select([i for i, _ in chosen_rows])
    for (_, side), row in zip(chosen_rows, tqdm(picked, desc="mixture: preference", disable=not accelerator.is_main_process)):
        queries.append(row["query_token"])
        query_texts.append(row["query"])
        responses.append(row[f"{side}_token"][: args.response_length])  # the rest was padding
        sources.append(side)

    # (c) new responses of the SFT model on SFT prompts (greedy by default)
    if num_generated > len(sft_train):
        raise ValueError(f"{num_generated} generated responses requested but {args.train_split} has {len(sft_train)} prompts")
    picked = sft_train.select(torch.randperm(len(sft_train), generator=draw)[:num_generated].tolist())
    generation_time = 0.0
    if num_generated > 0:
        prompts = torch.tensor(picked["query_token"], dtype=torch.long)
        config = offline_generation_config(args.response_length, args.mixture_temperature, pad_token_id)
        start = time.time()
        generated = sample_policy(accelerator, policy, prompts, config, tokenizer, args.local_rollout_batch_size, "mixture: generate")
        generation_time = time.time() - start
        queries += prompts.tolist()
        query_texts += picked["query"]
        responses += generated.tolist()
        sources += ["generated"] * num_generated

    # (d) label every (prompt, response) with the RM, then z-normalise over the mixture (the seed's Figure 5)
    query_tensor = torch.tensor(queries, dtype=torch.long)
    response_tensor = torch.tensor(responses, dtype=torch.long)
    start = time.time()
    raw = score_responses(accelerator, reward_model, query_tensor, response_tensor, pad_token_id,
                          args.local_rollout_batch_size, "mixture: label")
    labelling_time = time.time() - start
    # a NaN/inf RM score would poison the normalisation of every reward: stop here, before anything is cached
    check_finite(accelerator, 0, **{"mixture/raw_reward": raw})
    has_eos = (response_tensor == eos_token_id).any(1)
    if args.non_eos_penalty:
        raw = torch.where(has_eos, raw, torch.full_like(raw, args.penalty_reward_value))
    mean, std = raw.mean(), raw.std(unbiased=False)
    if not std > 0:
        raise ValueError("every mixture sample has the same reward; z-normalisation is undefined")
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
    accelerator.print(f"[filter] {len(keep)} of {len(mixture)} samples have normalised reward > {args.filter_threshold}")
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
    config = offline_generation_config(args.response_length, args.bon_temperature, tokenizer.pad_token_id)
    start = time.time()
    candidates = sample_policy(accelerator, model, candidates_q, config, tokenizer, args.local_rollout_batch_size,
                               f"{desc}: sample")
    costs["generation_s"] += time.time() - start
    start = time.time()
    scores = score_responses(accelerator, reward_model, candidates_q, candidates, tokenizer.pad_token_id,
                             args.local_rollout_batch_size, f"{desc}: score")
    costs["labelling_s"] += time.time() - start
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

    state_dict returns the state as of the last `commit()` (called after every completed update), so a
    checkpoint written while an update is under way (the non-finite guard) holds the position after the last
    good update, not the batch of the update that failed."""

    def __init__(self, seed: int, num_prompts: int):
        self.generator = torch.Generator().manual_seed(seed)
        self.prompt_order, self.prompt_cursor = torch.randperm(num_prompts, generator=self.generator), 0
        self.permutation, self.position = None, 0
        self.round_samples = None  # best-of-n: (queries, responses, rewards) of the current round
        self.commit()

    def next_prompts(self, count: int) -> list:
        """Best-of-n: the next `count` prompt rows; a new pass over the prompts is reshuffled."""
        if self.prompt_cursor + count > self.prompt_order.numel():
            self.prompt_order, self.prompt_cursor = torch.randperm(self.prompt_order.numel(), generator=self.generator), 0
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

    def commit(self) -> None:
        """Mark the current position as the one a checkpoint records (tensors are never changed in place)."""
        self.saved = {
            "generator": self.generator.get_state(), "prompt_order": self.prompt_order,
            "prompt_cursor": self.prompt_cursor, "permutation": self.permutation, "position": self.position,
            "round_samples": self.round_samples,
        }

    def state_dict(self) -> dict:
        return dict(self.saved)

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.prompt_order, self.prompt_cursor = state["prompt_order"], state["prompt_cursor"]
        self.permutation, self.position = state["permutation"], state["position"]
        self.round_samples = state["round_samples"]
        self.commit()


@torch.no_grad()
def evaluate_policy(args: Args, accelerator, model, reward_model, tokenizer, eval_rows: dict, policy_queries: torch.Tensor,
                    generation_config, reward_stats: Optional[Tuple[float, float]]):
    """Sample the eval queries (policy_queries: with the DT prompt for dt), score them with the RM on the
    ORIGINAL query (the reward prompt is an instruction to the policy, not part of the task), and build the
    sample table in the contract's columns. reward_stats = the mixture's (mean, std), to also report the score
    in the normalised units of the DT target."""
    pad_token_id, eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    responses = sample_policy(accelerator, model, policy_queries, generation_config, tokenizer,
                              args.local_rollout_batch_size, "evaluate")
    queries = eval_rows["query_token"]
    scores = score_responses(accelerator, reward_model, queries, responses, pad_token_id, args.local_rollout_batch_size, "evaluate: score")
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
        "score_mean": float(scores.mean()),
        "eos_rate": float(has_eos.float().mean()),
        "response_token_len_mean": float(response_token_len.float().mean()),
        "num_samples": len(df),
    }
    if reward_stats is not None:
        metrics["score_normalized_mean"] = float(((scores - reward_stats[0]) / reward_stats[1]).mean())
    return metrics, df


# ---------------------------------------------------------------------------------------------
# Helpers shared with the sibling scripts (identical copies; tests/test_shared_helpers.py)
# ---------------------------------------------------------------------------------------------


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


def forward(model, query_responses: torch.Tensor, pad_token_id: int):
    """Forward a padded batch. Pads are masked out and positions count real tokens only, so a
    left-padded query gets the same positions as an unpadded one (Detail 14)."""
    attention_mask = query_responses != pad_token_id
    position_ids = attention_mask.long().cumsum(1) - attention_mask.long()
    input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        return_dict=True,
        output_hidden_states=True,
    )


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


def generate(lm, queries: torch.Tensor, pad_token_id: int, generation_config):
    """Sample continuations of LEFT-padded queries with the KV cache.

    Returns query_responses (B, Tq + Tr) and the raw (untempered) logits of every sampled step
    (B, Tr, V), so callers need no extra forward pass to get rollout logprobs."""
    context_length = queries.size(1)
    attention_mask = queries != pad_token_id
    input_ids = torch.masked_fill(queries, ~attention_mask, 0)
    output = lm.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        generation_config=generation_config,
        return_dict_in_generate=True,
        output_logits=True,
    )
    logits = torch.stack(output.logits, 1)  # (B, Tr, V)
    return torch.cat((queries, output.sequences[:, context_length:]), dim=1), logits


def load_offline_models(args: Args, tokenizer):
    """The two models: the policy (the SFT model, which also writes the mixture's new responses) and the frozen
    reward model that labels every sample. There is no reference model: none of these losses has a KL term."""
    policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, trust_remote_code=args.trust_remote_code)
    reward_model = AutoModelForSequenceClassification.from_pretrained(
        args.reward_model_path, num_labels=1, dtype=torch.bfloat16 if args.bf16 else torch.float32,
        trust_remote_code=args.trust_remote_code,
    )
    for model in (policy, reward_model):
        # the config's row count, not the weight's shape: ZeRO-3 partitions weights as they load
        if model.config.vocab_size < len(tokenizer):
            model.resize_token_embeddings(len(tokenizer))
        if args.disable_dropout:
            disable_dropout(model)
    return policy, reward_model


def main(args: Args) -> dict:
    start_time = time.time()
    # ---------------- processes, batch arithmetic and precision ----------------
    processes = start_processes()  # first: the accumulation steps depend on the number of processes
    args.world_size = processes.num_processes
    args.gradient_accumulation_steps = exact_div(
        args.total_batch_size,
        args.local_micro_batch_size * args.world_size,
        "total_batch_size / (local_micro_batch_size * world_size)",
    )
    check_offline_flags(args)
    if args.bf16 is None:
        args.bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps, mixed_precision="bf16" if args.bf16 else "no"
    )
    configure_deepspeed(accelerator, args.local_micro_batch_size)  # Detail 8 (no-op without DeepSpeed)
    run = Run(args, accelerator)  # run name and folder; see the run infrastructure below main

    # ---------------- seeding (labelled, deliberate) ----------------
    set_seed(args.seed)  # mixture draw, weights and data order: the same on every process
    local_seed = args.seed + accelerator.process_index * 100003  # sampling differs per process

    # ---------------- tokenizer and models ----------------
    tokenizer = load_offline_tokenizer(args)  # Detail 3: [PAD] distinct from EOS
    pad_token_id, eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    # the RM scores the policy's token ids as they are: one tokenizer for both (checked before any weights load)
    check_reward_tokenizer(tokenizer, args.sft_model_path, args.reward_model_path, args.trust_remote_code)
    policy, reward_model = load_offline_models(args, tokenizer)
    reward_model = prepare_frozen_model(accelerator, reward_model)  # Detail 8: under ZeRO-3, an inference engine
    # the policy samples the mixture before it trains: it goes through accelerator.prepare first, because under
    # ZeRO-3 its weights are already partitioned and only a DeepSpeed engine gathers them for a forward
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, eps=args.eps)
    model, optimizer = accelerator.prepare(policy, optimizer)
    torch.manual_seed(local_seed)  # generation (mixture, best-of-n, evaluation) differs across processes

    # ---------------- data ----------------
    sft_train, eval_dataset = load_offline_data(args, tokenizer)
    run.claim_output_dir()  # every input check has passed: only now mark --output_dir as this run's

    # ---------------- step 1: the labelled mixture (best-of-n samples its own data in step 2) ----------------
    costs = {"generation_s": 0.0, "labelling_s": 0.0, "training_s": 0.0}  # wall seconds per stage (Table 3)
    summary, reward_stats, mixture_stats = {}, None, {}
    if args.method == "best_of_n":
        samples_per_round = args.bon_num_prompts  # one selected response per prompt and round
    else:
        # build_mixture, or its cached copy: filter, rwr and dt with the same mixture flags share one labelling pass
        mixture, mixture_stats = load_or_build_mixture(args, accelerator, model, reward_model, tokenizer)
        summary.update(mixture_stats)
        # the cost of building the mixture is paid once and shared; it is counted for every method (Table 3)
        costs["generation_s"] += mixture_stats["mixture/generation_s"]
        costs["labelling_s"] += mixture_stats["mixture/labelling_s"]
        reward_stats = (mixture_stats["mixture/raw_reward_mean"], mixture_stats["mixture/raw_reward_std"])
        if args.method == "filter":  # eq. 4: only the samples above the threshold are trained on
            mixture, filter_stats = filter_mixture(args, accelerator, mixture)
            summary.update(filter_stats)
        samples_per_round = len(mixture)
    # dt: targets at percentiles of the rewards the model saw in its prompts (the mixture's own distribution); with
    # --dt_target_percentile the inference target itself is one (a derived value: args.json records it)
    percentile_targets = dt_percentile_targets(mixture["reward"], args.dt_eval_percentiles) \
        if args.method == "dt" else {}
    if args.method == "dt" and args.dt_target_percentile is not None:
        args.dt_target = dt_percentile_targets(mixture["reward"], (args.dt_target_percentile,))[args.dt_target_percentile]
    summary.update({f"dt/target_at_percentile_{p:g}": t for p, t in percentile_targets.items()})
    if args.method == "dt":
        summary["dt/target"] = args.dt_target
    episodes_per_round = args.total_episodes if args.total_episodes is not None else args.num_train_epochs * samples_per_round
    updates_per_round = episodes_per_round // args.total_batch_size
    check_round_size(args, samples_per_round, episodes_per_round, updates_per_round, len(sft_train))
    num_updates = updates_per_round * args.iterations

    # ---------------- schedule, data order and resume ----------------
    scheduler = offline_lr_schedule(optimizer, args.scheduler, num_updates)  # over the updates of every iteration
    # every shuffle of step 2 comes from one generator seeded like the rest of the run (the same on every process)
    data_order = OfflineDataOrder(args.seed, len(sft_train))
    # saved and restored with the model and optimizer: the schedule and the data position
    accelerator.register_for_checkpointing(scheduler)
    accelerator.register_for_checkpointing(data_order)
    # the running counters; --resume takes them from the checkpoint, whose run must share the flags that fix the
    # number of updates and the data order
    state = run.start({"update": 0, "train_tokens": 0, "last_loss": float("nan"), "costs": costs, "round_summary": {}},
                      num_updates=num_updates, method=args.method, iterations=args.iterations,
                      total_batch_size=args.total_batch_size, world_size=args.world_size)
    start_update, train_tokens, last_loss = state["update"], state["train_tokens"], state["last_loss"]
    costs = state["costs"]  # a resumed run goes on counting from the interrupted run's costs
    round_summary = state["round_summary"]  # best-of-n's per-iteration metrics of the rounds done so far

    def log(step: int, metrics: dict) -> None:
        run.log(step, {"episode": step * args.total_batch_size, **metrics})

    if mixture_stats and start_update == 0:
        log(0, mixture_stats)  # a resumed run kept this line of metrics.jsonl

    # ---------------- evaluation (step 3): the first num_eval_samples rows of the eval split ----------------
    eval_rows = offline_eval_rows(args, eval_dataset)
    eval_config = offline_generation_config(args.response_length, args.eval_temperature, pad_token_id)

    def run_evaluation(step: int, final: bool) -> dict:
        # dt: the final evaluation visits every target of --dt_eval_targets (Table 1) and --dt_target; the
        # main table (samples.csv) is the one at --dt_target. Other methods have one prompt, no target.
        if args.method != "dt":
            targets = [None]
        else:
            targets = list(dict.fromkeys([args.dt_target, *args.dt_eval_targets, *percentile_targets.values()])) \
                if final else [args.dt_target]
        out = {}
        for target in targets:
            # dt: the same prompt builder as in training, with the target reward in the prompt
            queries = eval_rows["query_token"] if target is None else dt_queries(
                tokenizer, eval_rows["query"], [target] * len(eval_rows["query"]), pad_token_id)
            raw_metrics, df = evaluate_policy(args, accelerator, model, reward_model, tokenizer, eval_rows, queries,
                                              eval_config, reward_stats)
            metrics = write_offline_evaluation(args, run, step, target, final, raw_metrics, df)
            out.update(metrics)
            log(step, metrics)
        return out

    # ---------------- step 2: training rounds (one; --iterations for best_of_n) ----------------
    model.train()
    local_batch_size = args.local_micro_batch_size * args.gradient_accumulation_steps
    progress = tqdm(total=num_updates, initial=start_update, disable=not accelerator.is_main_process,
                    desc=f"offline_rl {args.method}")
    update = start_update

    def trainer_state() -> dict:
        """What a resumed run needs besides accelerate's state (models, optimizer, schedule, data order, RNG)."""
        return {"train_tokens": train_tokens, "last_loss": last_loss, "costs": dict(costs),
                "round_summary": dict(round_summary)}

    last_good = trainer_state()  # the counters after the last completed update
    # a run resumed in the middle of a round goes on with that round's samples and permutation (data_order)
    first_iteration, resume_in_round = divmod(start_update, updates_per_round)
    try:
        for iteration in range(first_iteration, args.iterations):
            resumed_round = iteration == first_iteration and resume_in_round > 0
            # (a) the samples of this round: (queries (N, W) left-padded, responses (N, Tr) right-padded, rewards (N,))
            if args.method == "best_of_n" and resumed_round:
                queries, responses, rewards = data_order.round_samples  # sampled before the interruption
            elif args.method == "best_of_n":
                # rejection sampling from the current policy: n candidates per prompt, the RM's best is kept
                rows = data_order.next_prompts(args.bon_num_prompts)
                queries = torch.tensor(sft_train.select(rows)["query_token"], dtype=torch.long)
                candidates, scores = best_of_n_candidates(args, accelerator, model, reward_model, tokenizer, queries,
                                                          costs, f"best_of_n {iteration + 1}/{args.iterations}")
                # a NaN/inf RM score would decide which sample is kept: stop before training on this round
                run.guard(update + 1, **{"best_of_n/scores": scores})
                responses, rewards, _ = best_of_n_select(scores, candidates, args.n)
                data_order.new_round((queries, responses, rewards))
                round_metrics = {
                    "best_of_n/score_mean_all": scores.mean().item(),
                    "best_of_n/score_mean_best": rewards.mean().item(),
                    "best_of_n/eos_rate_best": (responses == eos_token_id).any(1).float().mean().item(),
                    "best_of_n/iteration": iteration + 1,
                }
                round_summary.update({f"{k}_iter{iteration + 1}": v for k, v in round_metrics.items() if k != "best_of_n/iteration"})
                # logged at the round's first update: a step after any checkpoint taken before the round, so a
                # resumed run neither keeps a stale copy of this line nor writes it twice
                log(update + 1, round_metrics)
                accelerator.print(f"[best_of_n] iteration {iteration + 1}: " + ", ".join(f"{k}={v:.4f}" for k, v in round_metrics.items()))
            else:
                queries, responses, rewards = mixture_samples(args, mixture, tokenizer)  # dt: with the reward prompt
                if not resumed_round:
                    data_order.new_round()

            # (b) the updates of this round: every process draws the same permutation (a new one each pass over the
            # samples) and reads its share of each batch
            for _ in range(resume_in_round if resumed_round else 0, updates_per_round):
                global_batch = data_order.next_batch(queries.size(0), args.total_batch_size)
                batch_weights = loss_weights(args, rewards[global_batch])  # eq. 4-6, over the whole update batch
                if args.method == "rwr":  # non-finite guard: a NaN/inf weight would scale this update's gradient
                    run.guard(update + 1, **{"train/rwr_weights": batch_weights})
                local_slice = slice(accelerator.process_index * local_batch_size, (accelerator.process_index + 1) * local_batch_size)
                local_batch, local_weights = global_batch[local_slice], batch_weights[local_slice]
                update_start = time.time()
                stats = torch.zeros(3, device=accelerator.device)  # loss sum, micro-batches, input tokens (non-pad)
                for micro in range(0, local_batch_size, args.local_micro_batch_size):
                    micro_rows = local_batch[micro : micro + args.local_micro_batch_size]
                    query, response = trim_columns(queries[micro_rows], responses[micro_rows], pad_token_id)
                    query_responses = torch.cat((query, response), 1).to(accelerator.device)
                    labels = response_labels(query_responses, query.size(1), pad_token_id)  # the response tokens only
                    weights = local_weights[micro : micro + args.local_micro_batch_size].to(accelerator.device)
                    with accelerator.accumulate(model):
                        loss, _ = weighted_response_loss(model, query_responses, labels, weights, pad_token_id)
                        # non-finite guard: checked before backward, so the weights never see it
                        run.guard(update + 1, **{"train/loss": loss})
                        accelerator.backward(loss)
                        optimizer.step()  # a no-op until the last micro-batch of the update
                        optimizer.zero_grad()
                    stats += torch.stack([loss.detach(), torch.ones((), device=loss.device), (query_responses != pad_token_id).sum().float()])
                scheduler.step()
                costs["training_s"] += time.time() - update_start
                loss_stats = accelerator.reduce(stats, reduction="sum")
                update += 1
                train_tokens += int(loss_stats[2])
                last_loss = (loss_stats[0] / loss_stats[1]).item()  # mean over every micro-batch of the update
                metrics = {
                    "train/loss": last_loss,
                    "train/lr": scheduler.get_last_lr()[0],
                    "train/tokens_per_s": train_tokens / costs["training_s"],
                    "train/weight_max": batch_weights.max().item(),
                    "train/reward_mean": rewards[global_batch].mean().item(),
                }
                progress.update(1)
                progress.set_postfix(loss=f"{last_loss:.4f}", tok_s=f"{metrics['train/tokens_per_s']:.0f}")
                log(update, metrics)
                if args.eval_every > 0 and update % args.eval_every == 0 and update != num_updates:
                    run_evaluation(update, final=False)
                data_order.commit()
                last_good = trainer_state()
                if args.checkpoint_every > 0 and update % args.checkpoint_every == 0 and update != num_updates:
                    run.checkpoint(update, last_good)
    except NonFiniteError:
        keep_last_good_checkpoint(run, accelerator, update, last_good)
        raise
    progress.close()

    # ---------------- step 3: final evaluation, costs (Table 3), model ----------------
    eval_start = time.time()
    summary.update(round_summary)
    summary.update(run_evaluation(num_updates, final=True))
    summary.update(
        {
            "train/loss": last_loss,
            "train/tokens": train_tokens,
            "train/updates": num_updates,
            "train/samples_per_round": samples_per_round,
            "cost/generation_s": costs["generation_s"],
            "cost/labelling_s": costs["labelling_s"],
            "cost/training_s": costs["training_s"],
            "cost/total_s": costs["generation_s"] + costs["labelling_s"] + costs["training_s"],
            "cost/evaluation_s": time.time() - eval_start,
            "wall_time_s": time.time() - start_time,
        }
    )
    save_offline_model(args, accelerator, model, tokenizer)
    run.finish(summary)
    if accelerator.is_main_process and args.push_to_hub:
        push_offline_model(args)
    accelerator.print(json.dumps(summary, indent=2))
    return summary


# =============================================================================================
# RUN INFRASTRUCTURE: TRY NOT TO MODIFY. The algorithm ends here. What follows serves main() without
# being part of the algorithm: flag and input checks, processes and DeepSpeed, output folders, logging,
# checkpoints and resume, the non-finite guard, saving. (Python looks these names up when main runs.)
# =============================================================================================


def check_offline_flags(args: Args) -> None:
    """Flag combinations that cannot work, refused before anything is loaded."""
    if args.iterations < 1:
        raise ValueError(f"--iterations must be >= 1, got {args.iterations}")
    if args.method != "best_of_n" and args.iterations != 1:
        raise ValueError("--iterations > 1 re-samples from the updated policy: only --method best_of_n does that")
    if args.rwr_beta <= 0 or args.rwr_max_weight <= 0:
        raise ValueError("--rwr_beta and --rwr_max_weight must be positive")
    if args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}")
    percentiles = list(args.dt_eval_percentiles) + ([args.dt_target_percentile] if args.dt_target_percentile is not None else [])
    if any(not 0 <= p <= 100 for p in percentiles):
        raise ValueError(f"--dt_eval_percentiles and --dt_target_percentile are percentiles in [0, 100], got {percentiles}")


def load_offline_tokenizer(args: Args):
    """The SFT model's tokenizer with a [PAD] distinct from EOS (Detail 3)."""
    tokenizer = AutoTokenizer.from_pretrained(args.sft_model_path, trust_remote_code=args.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})  # Detail 3: a pad distinct from EOS
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ValueError(
            f"the tokenizer of {args.sft_model_path} pads with its EOS token {tokenizer.eos_token!r}; Detail 3 needs a "
            "distinct pad token, or the EOS is masked out of the loss and the model never learns to stop. Save the "
            "tokenizer with tokenizer.add_special_tokens({'pad_token': '[PAD]'}) (or one without a pad token) and "
            "prepare the data with it"
        )
    return tokenizer


def load_offline_data(args: Args, tokenizer):
    """The SFT train and eval splits, and for the mixture methods the preference split (read again when the mixture
    is built): each is checked for the columns it is read for and for the tokenizer that made it, before the
    output folder is claimed. Returns the train and eval splits."""
    sft_train = load_split(args.query_dataset, args.train_split)
    check_columns(sft_train, TRAIN_COLUMNS["best_of_n" if args.method == "best_of_n" else "mixture"],
                  f"{args.query_dataset} split {args.train_split!r}")
    eval_dataset = load_split(args.query_dataset, args.eval_split)
    check_columns(eval_dataset, EVAL_COLUMNS, f"{args.query_dataset} split {args.eval_split!r}")
    for split, dataset in ((args.train_split, sft_train), (args.eval_split, eval_dataset)):
        check_data_tokenizer(dataset, tokenizer, args.sft_model_path, f"{args.query_dataset} split {split!r}")
    if args.method != "best_of_n":  # the mixture reads the preference responses (when it is not cached yet)
        preference = load_split(args.preference_dataset, args.preference_split)
        check_preference_columns(preference, args)
        check_data_tokenizer(preference, tokenizer, args.sft_model_path,
                             f"{args.preference_dataset} split {args.preference_split!r}")
    return sft_train, eval_dataset


# the columns each split is read for (check_columns runs on every split before it is used)
TRAIN_COLUMNS = {"mixture": ["query_token", "query", "reference_response_token"], "best_of_n": ["query_token"]}
PREFERENCE_COLUMNS = ["query", "query_token", "chosen", "rejected", "chosen_token", "rejected_token",
                      "chosen_token_len", "rejected_token_len"]
EVAL_COLUMNS = ["query", "query_token", "reference_response"]


def check_preference_columns(preference, args: Args) -> None:
    """check_columns for the preference split the mixture reads. query_token may mix query lengths (build_mixture
    leaves rows of another length out), so only its presence is checked; the response columns must have one length."""
    where = f"{args.preference_dataset} split {args.preference_split!r}"
    check_columns(preference, [c for c in PREFERENCE_COLUMNS if c != "query_token"], where)
    if "query_token" not in preference.column_names:
        check_columns(preference, ["query_token"], where)  # raises the missing-column error


def check_reward_tokenizer(tokenizer, sft_model_path: str, reward_model_path: str, trust_remote_code: bool) -> None:
    """Bad input: the reward model (and the critic, Detail 22) reads the policy's token ids, so it must have
    been trained with the policy's tokenizer: the same vocabulary and the same [PAD] and EOS ids. A mismatch
    raises no error anywhere else, it only makes every score meaningless, so we check before loading weights."""
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if os.path.isdir(reward_model_path) and not any(
        os.path.exists(os.path.join(reward_model_path, name)) for name in tokenizer_files
    ):
        raise ValueError(
            f"--reward_model_path {reward_model_path} holds no tokenizer, so this script cannot check that the reward model "
            f"reads the token ids of the policy {sft_model_path}; save the tokenizer the reward model was trained with "
            f"into that folder (tokenizer.save_pretrained), as reward.py does"
        )
    rm_tokenizer = AutoTokenizer.from_pretrained(reward_model_path, trust_remote_code=trust_remote_code)
    if rm_tokenizer.pad_token is None:
        rm_tokenizer.add_special_tokens({"pad_token": "[PAD]"})  # the same fallback the policy's tokenizer gets
    problems = []
    policy_vocab, rm_vocab = tokenizer.get_vocab(), rm_tokenizer.get_vocab()
    if policy_vocab != rm_vocab:
        # name one token that differs, so the user sees what kind of mismatch it is
        differing = sorted(set(policy_vocab.items()) ^ set(rm_vocab.items()), key=lambda item: item[1])[:1]
        example = f", e.g. {differing[0][0]!r} (id {differing[0][1]})" if differing else ""
        problems.append(f"the vocabularies differ ({len(policy_vocab)} vs {len(rm_vocab)} tokens{example})")
    for name in ("pad_token_id", "eos_token_id"):
        if getattr(tokenizer, name) != getattr(rm_tokenizer, name):
            problems.append(f"{name} {getattr(tokenizer, name)} vs {getattr(rm_tokenizer, name)}")
    if problems:
        raise ValueError(
            f"the reward model {reward_model_path} was trained with a different tokenizer than the policy "
            f"{sft_model_path}: {'; '.join(problems)} (policy vs reward model). The reward model would read token ids "
            f"it was not trained on and score noise. Train the reward model from this SFT model "
            f"(reward.py --sft_model_path {sft_model_path}), or pass the SFT model the reward model was trained from"
        )


def check_round_size(args: Args, samples_per_round: int, episodes_per_round: int, updates_per_round: int,
                     num_prompts: int) -> None:
    """A round must fill at least one update batch (best-of-n: with prompts of the train split)."""
    if args.method == "best_of_n" and samples_per_round > num_prompts:
        raise ValueError(f"--bon_num_prompts {samples_per_round} > {num_prompts} prompts in {args.train_split}")
    if updates_per_round == 0:
        raise ValueError(f"{episodes_per_round} training samples do not fill one update of {args.total_batch_size}")
    if samples_per_round < args.total_batch_size:
        raise ValueError(f"{samples_per_round} training samples are fewer than one batch of {args.total_batch_size}")


def fingerprint(path: str) -> str:
    """What identifies a model or dataset for the cache: a local folder's file names, sizes and modification
    times (so a retrained model at the same path invalidates the cache), or the hub name itself."""
    if not os.path.isdir(path):
        return path
    entries = []
    for root, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            stat = os.stat(os.path.join(root, name))
            entries.append(f"{os.path.relpath(os.path.join(root, name), path)}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()


def mixture_key(args: Args) -> dict:
    """Every argument the mixture depends on; a cached mixture is reused only when all of them match."""
    def where(path: str) -> str:  # a local folder by its absolute path, a hub name as it is
        return os.path.abspath(path) if os.path.isdir(path) else path

    return {
        "sft_model_path": where(args.sft_model_path),
        "sft_model_fingerprint": fingerprint(args.sft_model_path),
        "reward_model_path": where(args.reward_model_path),
        "reward_model_fingerprint": fingerprint(args.reward_model_path),
        "query_dataset": where(args.query_dataset),
        "query_dataset_fingerprint": fingerprint(args.query_dataset),
        "preference_dataset": where(args.preference_dataset),
        "preference_dataset_fingerprint": fingerprint(args.preference_dataset),
        "train_split": args.train_split,
        "preference_split": args.preference_split,
        "response_length": args.response_length,
        "mixture_size": args.mixture_size,
        "mixture_weights": list(args.mixture_weights),
        "mixture_temperature": args.mixture_temperature,
        "non_eos_penalty": args.non_eos_penalty,
        "penalty_reward_value": args.penalty_reward_value,
        "seed": args.seed,
    }


def load_or_build_mixture(args: Args, accelerator, policy, reward_model, tokenizer) -> Tuple[Dataset, dict]:
    """The cached mixture when its recorded arguments match, else a fresh one (saved by the main process)."""
    key = mixture_key(args)
    folder = os.path.join(args.cache_dir, "mixture_" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16])
    meta_path = os.path.join(folder, "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        if meta["args"] == key:
            accelerator.print(f"[mixture] reusing {folder}")
            return load_from_disk(os.path.join(folder, "dataset")), {**meta["stats"], "mixture/cache_hit": 1}
        accelerator.print(f"[mixture] {folder} was built with other arguments; rebuilding it")
    dataset, stats = build_mixture(args, accelerator, policy, reward_model, tokenizer)
    if accelerator.is_main_process:
        os.makedirs(folder, exist_ok=True)
        dataset.save_to_disk(os.path.join(folder, "dataset"))
        with open(meta_path, "w") as f:  # written last: its presence marks a complete cache
            json.dump({"args": key, "stats": stats}, f, indent=2)
    accelerator.wait_for_everyone()
    return dataset, {**stats, "mixture/cache_hit": 0}


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


def write_offline_evaluation(args: Args, run, step: int, target: Optional[float], final: bool, raw_metrics: dict,
                             df: pd.DataFrame) -> dict:
    """Write one evaluation table (dt: the one at `target`) and return its metrics under their logged names. The
    table at --dt_target (every method's only table) goes to samples/step_N.csv, at the end also to samples.csv; dt's
    final tables also to samples_target_T.csv. Its first rows go to TensorBoard and the console."""
    main_table = target is None or target == args.dt_target
    metrics = {f"eval/{k}": v for k, v in raw_metrics.items()} if main_table else {}
    if target is not None and final:
        metrics.update({f"eval/target_{target:+.1f}/{k}": v for k, v in raw_metrics.items()})
    if main_table:
        run.save_table(df, f"samples/step_{step:06d}.csv")
        if final:
            run.save_table(df, "samples.csv")
    if target is not None and final:
        run.save_table(df, f"samples_target_{target:+.1f}.csv")
    name = "eval" if target is None else f"eval/target_{target:+.1f}"
    table = df.head(args.num_table_samples)[["query", "response", "reference", "score"]]
    run.log_text(f"{name}/samples", markdown_rows(table), step)
    if run.main:
        for row in table.itertuples(index=False):
            tqdm.write(f"[{name} step {step}] query: ...{row.query[-120:]!r}\n  response: {row.response!r}  score {row.score:.3f}")
        tqdm.write(f"[{name} step {step}] " + ", ".join(f"{k}={v:.4f}" for k, v in raw_metrics.items()))
    return metrics


def markdown_rows(df: pd.DataFrame) -> str:
    """A small pandas table as markdown for TensorBoard's text tab (pipes and newlines escaped)."""
    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    for row in df.itertuples(index=False):
        lines.append("| " + " | ".join(str(v).replace("|", "\\|").replace("\n", " ") for v in row) + " |")
    return "\n".join(lines)


def keep_last_good_checkpoint(run, accelerator, update: int, last_good: dict) -> None:
    """After the non-finite guard fired in update + 1. Every guard runs before the backward / optimizer step that
    would use the value, so the weights on hand are those after `update` (the last completed update); data_order
    and the counters are saved as of that update too (commit), so the poisoned update is never applied or saved."""
    run.checkpoint(update, last_good)
    accelerator.print(f"non-finite value at update {update + 1}; last good checkpoint: {run.latest_checkpoint()}")


def save_offline_model(args: Args, accelerator, model, tokenizer) -> None:
    """save_pretrained (safetensors) of the aligned policy and its tokenizer in --output_dir."""
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    state_dict = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards
    if accelerator.is_main_process:
        unwrapped.save_pretrained(args.output_dir, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(args.output_dir)


def push_offline_model(args: Args) -> None:
    """--push_to_hub: upload --output_dir (None -> f"{sft model name}__{exp_name}__{method}__{seed}")."""
    hub_model_id = args.hub_model_id or (
        f"{os.path.basename(args.sft_model_path.rstrip('/'))}__{args.exp_name}__{args.method}__{args.seed}"
    )
    api = HfApi()
    api.create_repo(hub_model_id, exist_ok=True)
    api.upload_folder(folder_path=args.output_dir, repo_id=hub_model_id)


# ---- shared run infrastructure: identical in every training script (tests/test_shared_helpers.py) ----


class Run:
    """Everything a training run keeps on disk besides the model, behind one small interface:

        run = Run(args, accelerator)          # the run's name and its folder {run_dir_root}/{run_name}
        run.claim_output_dir()                # after the input checks: --output_dir becomes this run's
        state = run.start(state, **shape)     # --resume: restore the latest checkpoint; then open the logs
        run.guard(update, loss=loss)          # non-finite guard (raises NonFiniteError on every process)
        run.log(step, metrics)                # TensorBoard + metrics.jsonl (+ W&B with --track)
        run.save_table(frame, "samples.csv")  # a CSV in the run folder
        run.checkpoint(update, state)         # atomic, resumable checkpoint
        run.finish(summary)                   # summary.json, close the logs

    `state` is the script's own trainer state (data position, running counters); accelerate's save_state
    holds the rest (prepared models, optimizers, registered objects, RNG states). `shape` names what a
    checkpoint must share with the flags of a resumed run (e.g. num_updates)."""

    def __init__(self, args, accelerator):
        self.args, self.accelerator = args, accelerator
        args.run_name = resolve_run_name(args)  # with --resume and no --run_name: the newest run with a checkpoint
        self.dir = os.path.join(args.run_dir_root, args.run_name)
        self.main = accelerator.is_main_process
        self.shape, self.writer = {}, None

    def claim_output_dir(self) -> None:
        claim_output_dir(self.accelerator, self.args.output_dir, self.args.run_name,
                         self.args.overwrite_output_dir or self.args.resume)

    def start(self, state: dict, **shape) -> dict:
        """Returns the trainer state to go on from: the checkpoint's with --resume, else `state`."""
        self.shape = shape
        if self.args.resume:
            state = load_checkpoint(self.accelerator, self.dir)
            found = {key: state.get(key) for key in shape}
            if found != shape:
                raise ValueError(f"--resume: the checkpoint belongs to a run with {found}, these flags give {shape}; "
                                 "resume with the flags of the original run")
        elif self.main and os.path.isdir(os.path.join(self.dir, "checkpoints")):
            shutil.rmtree(os.path.join(self.dir, "checkpoints"))  # a fresh run of the same name starts over
        if self.main:
            os.makedirs(os.path.join(self.dir, "samples"), exist_ok=True)
            config = asdict(self.args)  # with the derived fields filled in
            with open(os.path.join(self.dir, "args.json"), "w") as f:
                json.dump(config, f, indent=2)
            if self.args.track:
                import wandb

                wandb.init(project=self.args.wandb_project_name, entity=self.args.wandb_entity, sync_tensorboard=True,
                           config=config, name=self.args.run_name, save_code=True)
            # a resumed run drops what the interrupted run logged after its checkpoint (TensorBoard's purge_step,
            # start_metrics_file), so its logs match an uninterrupted run's
            resumed_at = state.get("update", 0) if self.args.resume else 0
            self.writer = SummaryWriter(self.dir, purge_step=resumed_at + 1 if self.args.resume else None)
            self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(
                f"|{key}|{value}|" for key, value in config.items()))
            start_metrics_file(os.path.join(self.dir, "metrics.jsonl"), resumed_at)
        return state

    def guard(self, update: int, **quantities: torch.Tensor) -> None:
        check_finite(self.accelerator, update, **quantities)

    def log(self, step: int, metrics: dict) -> None:
        if self.main:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step)
            with open(os.path.join(self.dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")

    def log_text(self, tag: str, text: str, step: int) -> None:
        if self.main:
            self.writer.add_text(tag, text, step)

    def save_table(self, frame, name: str) -> None:
        if self.main:
            frame.to_csv(os.path.join(self.dir, name), index=False)

    def checkpoint(self, update: int, state: dict) -> str:
        return save_checkpoint(self.accelerator, self.dir, update, {**self.shape, **state, "update": update}, self.args.checkpoint_keep)

    def latest_checkpoint(self) -> Optional[str]:
        return latest_checkpoint(self.dir)

    def finish(self, summary: dict) -> None:
        if self.main:
            with open(os.path.join(self.dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
            self.writer.close()
            if self.args.track:
                import wandb

                wandb.finish()


def start_processes() -> PartialState:
    """Join the run's process group before anything reads the process count. accelerate picks a
    communication backend by itself only for GPUs, so without CUDA we name it: gloo. Plain multi-process
    runs (`torchrun`) become gloo ranks on the CPU (cpu=True); a DeepSpeed launch
    (`DS_ACCELERATOR=cpu accelerate launch --config_file zero2.yaml ...`) keeps DeepSpeed over gloo."""
    if torch.cuda.is_available():
        return PartialState()
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return PartialState(backend="gloo")
    return PartialState(cpu=True)


def configure_deepspeed(accelerator, micro_batch_size: int) -> None:
    """Under DeepSpeed (zero2.yaml / zero3.yaml; Detail 8), state what the script itself does, where
    accelerate would fill DeepSpeed's "auto" values with something else: the micro batch per process (not
    every script hands accelerate a dataloader to read it from) and no gradient clipping (the paper clips
    no gradients; accelerate's "auto" clips at 1.0)."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch_size
    if plugin.deepspeed_config.get("gradient_clipping", "auto") == "auto":
        plugin.deepspeed_config["gradient_clipping"] = 0.0


def prepare_frozen_model(accelerator, model: torch.nn.Module, offload: bool = False) -> torch.nn.Module:
    """Place a model that only runs forward (reference policy, reward model). Under ZeRO-3 (zero3.yaml)
    from_pretrained has already partitioned its weights across processes, so it runs inside a DeepSpeed
    inference engine that gathers each layer's weights for its forward; `offload` keeps them in CPU memory
    between uses (ZeRO-3 parameter offload: the paper's 6.9B setting, Detail 8). Elsewhere it moves to the
    device (and a script that offloads by hand moves it on use)."""
    model.requires_grad_(False).eval()
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or plugin.zero_stage != 3:
        return model.to("cpu" if offload else accelerator.device)
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": plugin.deepspeed_config["train_micro_batch_size_per_gpu"],
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu" if offload else "none"}},
        "bf16": {"enabled": plugin.deepspeed_config.get("bf16", {}).get("enabled") is True},
    }
    engine = deepspeed.initialize(model=model, config=config)[0]
    engine.eval()
    return engine.module


def exact_div(a: int, b: int, what: str = "batch size") -> int:
    """a / b as an int; raise a clear error when b does not divide a (batch arithmetic must be exact)."""
    q = a // b
    if q * b != a:
        raise ValueError(f"{what}: {a} is not divisible by {b}; pick sizes so that it divides exactly")
    return q


def load_split(path: str, split: str):
    """A processed split: a local `save_to_disk` folder (the built-in task, tests) or a hub dataset name."""
    if os.path.isdir(path):
        dataset_dict = load_from_disk(path)
        if split not in dataset_dict:
            raise ValueError(f"{path} has no split {split!r}; it has {list(dataset_dict.keys())}")
        return dataset_dict[split]
    return load_dataset(path, split=split)


def check_columns(dataset, columns: list, where: str) -> None:
    """Bad input fails here with the row and the fix, not deep inside a library: every needed column is
    present, and every token column has one length in all rows (processed data is padded to fixed lengths)."""
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise ValueError(
            f"{where} lacks the column(s) {missing} (it has {dataset.column_names}); "
            "make it with data/prepare.py, whose output has every column the scripts read"
        )
    table = dataset.select_columns(list(columns)).with_format("arrow")[:]
    for column in columns:
        if not pyarrow.types.is_list(table.schema.field(column).type) or table.num_rows == 0:
            continue
        lengths = pyarrow.compute.list_value_length(table.column(column)).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero(lengths != lengths[0])
        if bad.size:
            raise ValueError(
                f"{where}: row {int(bad[0])} has {int(lengths[bad[0]])} tokens in {column!r}, row 0 has {int(lengths[0])}; "
                "every row must be padded to the same length (prepare the data again with data/prepare.py)"
            )


def tokenizer_fingerprint(tokenizer) -> dict:
    """The identity of the tokenizer that writes (or reads) token ids: a digest of its vocabulary (every token and
    its id, added tokens such as [PAD] included), its size, and its [PAD] and EOS ids. data/prepare.py stores it
    in the description of every split it writes; the training scripts compare it with their model's tokenizer."""
    import hashlib

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    return {
        "vocab_sha256": hashlib.sha256(json.dumps(vocab).encode("utf-8")).hexdigest(),
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def check_data_tokenizer(dataset, tokenizer, model_path: str, where: str, rows: int = 64) -> None:
    """Bad input: token ids mean something only to the tokenizer that wrote them. Data prepared with another
    tokenizer trains without an error on the wrong ids (a larger vocabulary) or fails deep inside the embedding
    (a smaller one), so it is refused here, before the output folder is claimed. A split written by
    data/prepare.py carries its tokenizer's fingerprint, which must equal the model's; a split without one (e.g.
    a hub dataset) is checked by its ids: every id below the vocabulary size, and in the first `rows` rows the
    padding made of this [PAD] and the responses ended by this EOS."""
    ours = tokenizer_fingerprint(tokenizer)
    fix = (f"Prepare the data again with this model's tokenizer: python data/prepare.py --base_model {model_path} "
           "(with the task's other flags)")
    try:
        theirs = json.loads(dataset.info.description)["tokenizer"]
    except (TypeError, ValueError, KeyError):  # no description, or one not written by data/prepare.py
        theirs = None
    if theirs is not None:
        keys = ("vocab_size", "pad_token_id", "eos_token_id")
        differ = [f"{key} {theirs.get(key)} vs {ours[key]}" for key in keys if theirs.get(key) != ours[key]]
        if theirs.get("vocab_sha256") != ours["vocab_sha256"] and not differ:
            differ.append("same size, other tokens")
        if differ:
            raise ValueError(
                f"{where} was tokenized by the tokenizer of {theirs.get('name_or_path')}, not by the one of "
                f"{model_path}: {'; '.join(differ)} (data vs model); its token ids would be read as other tokens. {fix}"
            )
        return
    columns = [c for c in dataset.column_names if c.endswith(("_token", "_token_response_label"))]
    lengths = [c + "_len" for c in columns if c + "_len" in dataset.column_names]
    table = dataset.select_columns(columns + lengths).with_format("arrow")[:]
    pad, eos, vocab_size = ours["pad_token_id"], ours["eos_token_id"], ours["vocab_size"]
    for column in columns:
        kind = table.schema.field(column).type
        listed = pyarrow.types.is_list(kind) or pyarrow.types.is_large_list(kind)
        if not (listed and pyarrow.types.is_integer(kind.value_type)) or table.num_rows == 0:
            continue
        highest = pyarrow.compute.max(pyarrow.compute.list_flatten(table.column(column))).as_py()
        if highest is not None and highest >= vocab_size:
            raise ValueError(
                f"{where}: {column!r} holds the token id {highest}, but the tokenizer of {model_path} has {vocab_size} "
                f"tokens, so the data was tokenized by another tokenizer. {fix}"
            )
    head = table.slice(0, rows).to_pylist()
    for column in [c for c in columns if c + "_len" in dataset.column_names]:
        ends = []  # the last token of each response (the query column has none)
        for i, row in enumerate(head):
            ids, n = row[column], row[column + "_len"]
            if n > len(ids):
                continue  # a response cut to the column's width has no padding and no EOS to check
            padding = ids[: len(ids) - n] if column == "query_token" else ids[n:]  # queries are left-padded (Detail 5)
            wrong = [token for token in padding if token != pad]
            if wrong:
                raise ValueError(
                    f"{where} row {i}: {column!r} is padded with the id {wrong[0]}, but the tokenizer of {model_path} "
                    f"pads with {pad}, so the data was tokenized by another tokenizer. {fix}"
                )
            if column != "query_token" and n > 0:
                ends.append(ids[n - 1])
        if ends and eos not in ends:  # every response ends with EOS (Detail 3); not one does here
            raise ValueError(
                f"{where}: no response in the first {len(ends)} rows of {column!r} ends with the EOS id {eos} of the "
                f"tokenizer of {model_path} (they end with {sorted(set(ends))[:5]}), so the data was tokenized by "
                f"another tokenizer. {fix}"
            )


class NonFiniteError(RuntimeError):
    """A loss, reward, advantage or gradient norm became NaN or inf (raised by check_finite)."""


def check_finite(accelerator, update: int, **quantities: torch.Tensor) -> None:
    """Non-finite guard: stop when any named tensor holds a NaN or inf on any process.

    The flags are summed over processes, so every process raises together and none is left waiting in
    a collective. Callers check before the optimizer step that would use the quantity, so the weights
    on hand are still the last good ones when this raises."""
    flags = torch.stack([(~torch.isfinite(value.detach().float())).any() for value in quantities.values()]).float()
    flags = accelerator.reduce(flags.to(accelerator.device), reduction="sum")
    bad = [name for name, flag in zip(quantities, flags.tolist()) if flag > 0]
    if bad:
        raise NonFiniteError(
            f"update {update}: {', '.join(bad)} is not finite (NaN or inf). The weights were not updated with it and "
            "the final model is not saved. Check the data of this update, or start a fresh run with a lower --lr "
            "(--resume from the last good checkpoint keeps the checkpoint's learning rate and schedule)"
        )


def latest_checkpoint(run_dir: str) -> Optional[str]:
    """The newest complete checkpoint folder of a run, or None. A folder gets its final name only once it
    is complete (see save_checkpoint), so a save that was killed half-way is never picked."""
    root = os.path.join(run_dir, "checkpoints")
    done = sorted(d for d in os.listdir(root) if d.startswith("update_")) if os.path.isdir(root) else []
    return os.path.join(root, done[-1]) if done else None


def save_checkpoint(accelerator, run_dir: str, update: int, trainer_state: dict, keep: int) -> str:
    """Save what a resumed run needs after `update`: accelerate's save_state writes the prepared models
    (safetensors), their optimizers, the objects given to register_for_checkpointing (schedule, ...) and
    every process's RNG states; trainer_state.json adds the data position and the running counters.

    Atomic: everything goes to a hidden temporary folder that is renamed to update_N when complete, so a
    kill during the save leaves the previous checkpoint as the latest. Called on every process."""
    root = os.path.join(run_dir, "checkpoints")
    final, temporary = os.path.join(root, f"update_{update:06d}"), os.path.join(root, f".tmp_update_{update:06d}")
    if accelerator.is_main_process and os.path.isdir(temporary):
        shutil.rmtree(temporary)  # left by a save that was killed
    accelerator.wait_for_everyone()
    accelerator.save_state(temporary)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with open(os.path.join(temporary, "trainer_state.json"), "w") as f:
            json.dump({"update": update, **trainer_state}, f, indent=2)
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(temporary, final)
        older = sorted(d for d in os.listdir(root) if d.startswith("update_"))[:-keep] if keep > 0 else []
        for name in older:
            shutil.rmtree(os.path.join(root, name))
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, run_dir: str) -> dict:
    """Restore the latest checkpoint of run_dir into the prepared objects; returns its trainer_state."""
    path = latest_checkpoint(run_dir)
    if path is None:
        raise ValueError(f"--resume: {run_dir}/checkpoints holds no checkpoint; start the run without --resume")
    accelerator.load_state(path)
    with open(os.path.join(path, "trainer_state.json")) as f:
        trainer_state = json.load(f)
    accelerator.print(f"resumed from {path} (update {trainer_state['update']})")
    return trainer_state


def resolve_run_name(args) -> str:
    """The run's name, the same on every process. With --resume and no --run_name: the newest
    runs/{exp_name}__{seed}__* that has a checkpoint."""
    if args.run_name is None and args.resume:
        prefix = f"{args.exp_name}__{args.seed}__"
        root = args.run_dir_root
        candidates = sorted(
            (d for d in (os.listdir(root) if os.path.isdir(root) else []) if d.startswith(prefix)
             and latest_checkpoint(os.path.join(root, d)) is not None),
            key=lambda d: os.path.getmtime(os.path.join(root, d)),
        )
        if not candidates:
            raise ValueError(f"--resume: no run {root}/{prefix}* has a checkpoint; pass --run_name of the run to resume")
        return candidates[-1]
    name = [args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"]
    broadcast_object_list(name)  # the clocks of the processes may disagree on the second
    return name[0]


def claim_output_dir(accelerator, output_dir: str, run_name: str, overwrite: bool) -> None:
    """Refuse an --output_dir that already holds another run's files, then mark it as this run's
    (run.json). A resumed run finds its own mark and goes on."""
    mark = os.path.join(output_dir, "run.json")
    if os.path.isdir(output_dir) and os.listdir(output_dir) and not overwrite:
        owner = json.load(open(mark)).get("run_name") if os.path.exists(mark) else None
        if owner != run_name:
            raise ValueError(
                f"--output_dir {output_dir} already holds {'the run ' + repr(owner) if owner else 'files of another run'}; "
                f"pass a new --output_dir, or --overwrite_output_dir to replace it"
                + (f", or --resume --run_name {owner} to continue that run" if owner else "")
            )
    accelerator.wait_for_everyone()  # every process checked before the mark changes
    if accelerator.is_main_process:
        os.makedirs(output_dir, exist_ok=True)
        with open(mark, "w") as f:
            json.dump({"run_name": run_name}, f)


def start_metrics_file(path: str, resume_update: int) -> None:
    """metrics.jsonl of a fresh run starts empty; a resumed run keeps the lines up to its checkpoint and
    drops those written after it (they are written again), so the file matches an uninterrupted run."""
    kept = []
    if resume_update > 0 and os.path.exists(path):
        kept = [line for line in open(path) if line.strip() and json.loads(line)["step"] <= resume_update]
    with open(path, "w") as f:
        f.writelines(kept)


if __name__ == "__main__":
    main(tyro.cli(Args))
