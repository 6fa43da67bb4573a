"""PPO for RLHF on TL;DR summarization, with every detail of "The N+ Implementation Details of RLHF
with PPO" (Details 20-25, Table 7) and the trlX / OpenRLHF options as flags.

One update = one rollout of `total_batch_size` episodes followed by K PPO epochs over it:

  rollout  1. sample left-padded queries from the SFT split, reshuffling after each pass (Detail 21)
           2. sample exactly `response_length` tokens at temperature 0.7, no early stop (Detail 23)
           3. truncate each response after its first EOS, fill the rest with [PAD]   (Detail 23)
           4. score query + truncated response with the RM, read at the EOS          (Details 12, 14);
              several RMs: each scored, scaled on its own, then joined (--reward_combine); a reward from code
              (--reward_fn) is one more scorer, or the only one
           5. EOS trick: no EOS in the response -> score = penalty_reward_value (-1)  (Detail 23)
           6. per-token rewards: -kl_coef * KL on every token, the score at the EOS
           7. optional reward whitening (Detail 24)
           8. GAE (gamma 1, lambda 0.95); returns = advantages + values
           9. advantage whitening (Detail 25)
  update   K epochs x num_mini_batches minibatches x gradient accumulation of micro batches;
           clipped policy loss, clipped value loss (vf_coef 0.1), AdamW with linear decay.

Single process:   python ppo.py --sft_model_path models/sft --reward_model_path models/rm
Several:          accelerate launch --config_file zero2.yaml ppo.py ...
After a crash:    the same command with --resume: it continues from the latest checkpoint in runs/{run_name}/checkpoints
                  (policy + critic, AdamW, KL controller, reward statistics, RNG states; the data position follows from
                  the update number) and ends exactly like an uninterrupted run (--checkpoint_every sets how often).
"""

import copy
import functools
import json
import os
import random
import time
from dataclasses import dataclass, field, fields
from typing import Annotated, List, Literal, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from accelerate import Accelerator, PartialState
from accelerate.utils import gather_object, set_seed
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GenerationConfig

from rlhf_utils import checks, models, records
from rlhf_utils.checks import RunError
from rlhf_utils.flags import RunFlags, check_flags
from rlhf_utils.rewards import RewardFunctions
from rlhf_utils.run import LastGoodState, Run, due, evaluation_rng, leave_processes, start_processes, synced_time


@dataclass
class PpoHParams:
    """PPO knobs (Table 7 defaults) and the trlX / OpenRLHF options, each off by default."""

    num_ppo_epochs: int = 4
    """K: PPO epochs over each rollout batch (Table 7)"""
    num_mini_batches: int = 1
    """N_mb: minibatches per epoch (Table 7); each is one optimizer step"""
    cliprange: float = 0.2
    """epsilon: policy ratio clipping (Table 7)"""
    cliprange_value: float = 0.2
    """value clipping around the rollout values (Table 7: value function loss clipping on)"""
    vf_coef: float = 0.1
    """c_1: value loss coefficient (Table 7)"""
    gamma: float = 1.0
    """discount (Table 7)"""
    lam: float = 0.95
    """GAE lambda (Table 7)"""
    kl_coef: float = 0.05
    """beta: per-token KL penalty coefficient (Table 7); the initial value with --ppo.adaptive_kl"""
    whiten_rewards: bool = False
    """Detail 24: whiten the per-token rewards of each rollout batch (mean kept at 0 shift)"""
    whiten_advantages: bool = True
    """Detail 25: whiten the advantages of each rollout batch"""
    whiten_across_processes: bool = True
    """Details 24-25: whiten with the mean and variance of the whole rollout batch over every process (N processes
    whiten as one would); off: each process its own share, as the reference code did"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """per-token KL estimate in the reward's penalty: k1 = log p - log p_ref (paper); k2 = (log p - log p_ref)^2 / 2;
    k3 = r - 1 - log r, r = p_ref / p (docs/usage.md, "Which gradient each KL setting follows")"""
    adaptive_kl: bool = False
    """trlX / Ziegler et al.: adapt kl_coef so that the KL of a rollout tracks --ppo.target_kl"""
    target_kl: float = 6.0
    """adaptive KL target (sum over the response, trlX Table 4 uses 6)"""
    kl_horizon: int = 10000
    """adaptive KL horizon in episodes: how fast kl_coef moves"""
    scale_rewards: bool = False
    """trlX: divide scores by a running standard deviation of all scores seen (no mean subtraction)"""
    reward_clip: Optional[float] = None
    """trlX / OpenRLHF: clip scores to [-reward_clip, reward_clip] (after --ppo.scale_rewards); None = off"""
    ptx_coef: float = 0.0
    """PPO-ptx (InstructGPT, OpenRLHF): add ptx_coef x the SFT loss on reference summaries; 0 = off"""
    freeze_actor_updates: int = 0
    """OpenRLHF: for the first N updates only the critic learns; the actor takes no optimizer step (under DeepSpeed:
    actor lr 0 and policy loss 0, its AdamW counting the frozen steps)"""


@dataclass
class Args:
    # common
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of weights and data order on every rank (sampling uses seed + process_index * 100003)"""
    output_dir: str = "models/ppo"
    """where the final policy and its tokenizer are saved"""

    # models
    sft_model_path: str = "models/sft"
    """the SFT policy: initial policy, reference policy, and the tokenizer"""
    reward_model_path: List[str] = field(default_factory=lambda: ["models/rm"])
    """the reward model (saved by reward.py, at the default path, with the Detail 15 normalisation folded in); several
    paths make an ensemble whose scores --reward_combine joins into one. None at all (the flag without a path) with
    --reward_fn: the function alone scores, and no reward model is loaded (docs/usage.md, "Flags in depth")"""
    reward_fn: Optional[List[str]] = None
    """path.py:function ..., rewards from code written for TRL's GRPOTrainer (fn(prompts=, completions=, **kwargs):
    a float or None per response); their weighted sum is one more scorer beside the reward models, joined like
    them, then the EOS trick (Detail 23). None = no function (docs/usage.md, "Flags in depth")"""
    reward_fn_weights: Optional[List[float]] = None
    """one weight per --reward_fn function, in its sum (TRL's reward_weights); None = 1 each"""
    reward_fn_timeout_min: float = 10.0
    """minutes one call of a --reward_fn function may take before the run stops with an error naming it and its batch
    (ours: TRL has no limit; a slow call within it changes nothing; docs/usage.md, "Flags in depth")"""
    reward_combine: Literal["mean", "sum", "min"] = "mean"
    """how the scores of several reward models become one, each after its own scaling: mean, weighted sum
    (--reward_weights) or min (the conservative ensemble of Coste et al. 2024); one reward model: its score"""
    reward_weights: Optional[List[float]] = None
    """--reward_combine sum: one weight per reward model, then one for --reward_fn; None = 1 each"""
    critic_init: Literal["reward", "sft"] = "reward"
    """Detail 22: initialise the critic from the reward model (paper) or from the SFT model with a fresh head; with no
    reward model (--reward_fn alone) reward starts it from the SFT model too (the run's log says so)"""
    trust_remote_code: bool = False
    """passed to from_pretrained"""

    # data
    query_dataset: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """processed SFT dataset (hub name, or a local save_to_disk folder); queries are left-padded"""
    train_split: str = "train"
    """split the rollout queries (and the ptx data) come from"""
    eval_split: str = "validation"
    """split used for evaluation sample tables"""

    # sampling
    response_length: int = 53
    """tokens sampled per response, always exactly this many (Detail 23)"""
    temperature: float = 0.7
    """sampling temperature of rollouts; logprobs of policy and reference use it too (Table 7)"""
    eval_temperature: float = 0.01
    """sampling temperature of evaluation samples (near greedy, as the reference)"""
    non_eos_penalty: bool = True
    """Detail 23 (EOS trick): a response without EOS gets --penalty_reward_value as its score"""
    penalty_reward_value: float = -1.0
    """Detail 23 (EOS trick): score given to a response that never emits EOS; the paper's -1. It replaces the
    final score, once per response: after the reward models are scaled (scale_rewards) and joined
    (--reward_combine), before the clip (reward_clip)"""

    # optimisation
    total_episodes: int = 1_000_000
    """episodes (sampled responses) in the whole run (Table 7)"""
    total_batch_size: int = 512
    """episodes per update across all processes (Table 7)"""
    local_micro_batch_size: int = 8
    """episodes per forward/backward pass on one process"""
    gradient_accumulation_steps: Optional[int] = None
    """micro batches per optimizer step; None = derived from the batch sizes, else checked against them"""
    local_rollout_forward_batch_size: int = 64
    """episodes per generation / scoring chunk on one process (memory knob; no effect on results)"""
    lr: float = 3e-6
    """AdamW learning rate (Table 7)"""
    eps: float = 1e-5
    """AdamW epsilon (Table 7)"""
    weight_decay: float = 0.01
    """AdamW weight decay (torch's default, which the reference implementation uses)"""
    scheduler: Literal["linear", "constant"] = "linear"
    """learning-rate schedule over updates (Table 7: linear decay to 0)"""
    disable_dropout: bool = True
    """Detail 7: no dropout in any model (policy, reference, RM, a critic), so that the first ratio is exactly 1"""
    bf16: Optional[bool] = None
    """bf16 mixed precision, as the paper trained (Detail 8); None = on when a CUDA device supports bf16. On the CPU
    the run computes in float32 unless --bf16 asks for bf16 (slow)"""
    gradient_checkpointing: bool = False
    """activation checkpointing in every model that trains here: less activation memory for about one more forward
    pass; the loss and gradients are the same. Off: the paper trained without it (docs/usage.md, "Flags in depth")"""

    # memory and speed (trlX / OpenRLHF)
    num_layers_unfrozen: int = -1
    """Hydra (trlX): the policy trains only its top N layers and the reference shares the frozen trunk; -1 = off"""
    lora_rank: int = 0
    """LoRA rank of the policy adapters (peft); the reference is the policy with adapters disabled; 0 = off"""
    lora_alpha: float = 16.0
    """LoRA scaling alpha (read only when --lora_rank > 0)"""
    load_in_4bit: bool = False
    """QLoRA: the frozen base of the policy in 4-bit NF4 with double quantization (bitsandbytes), LoRA adapters trained
    on top; needs --lora_rank. The settings are the QLoRA paper's (Dettmers et al. 2023); each 4-bit layer computes in
    the run's dtype (bf16 with --bf16, else float32), and the saved model has the adapters merged in float32"""
    offload: bool = False
    """keep the reference and reward models on CPU between uses (GPU runs): by hand, brought to the device once per
    rollout and per evaluation from pinned memory; with ZeRO-3, DeepSpeed's parameter offload, from CPU partitions"""
    gather_for_generation: bool = True
    """under ZeRO-3, gather the policy's weights once for each rollout and evaluation instead of layer by layer at every
    decode step (as TRL's unwrap_model_for_generation and the reference reproduction do); the same samples either way.
    Off: for a model too large to hold whole on one device. No effect without ZeRO-3"""

    # evaluation and logging
    eval_every: int = 20
    """updates between evaluations (sample tables); 0 = only the final evaluation"""
    num_eval_samples: int = 256
    """validation queries per evaluation"""
    save_policy_every: int = 0
    """updates between policy snapshots (save_pretrained, for evaluation; not resumable) in
    {output_dir}/snapshots/update_N; 0 = only the final policy. Resumable checkpoints: --checkpoint_every"""
    save_policy_at: List[int] = field(default_factory=list)
    """updates after which a snapshot is saved as well (0: the starting policy; the last: before the final
    evaluation), each with its weights' digest and budget; pipeline.py --mode frontier evaluates them"""
    print_sample_every: int = 10
    """updates between printed rollout samples; 0 = never"""

    ppo: PpoHParams = field(default_factory=PpoHParams)
    """PPO hyperparameters"""

    run: Annotated[RunFlags, tyro.conf.OmitArgPrefixes] = field(default_factory=RunFlags)
    """the run's folder, checkpoints, --resume, lock, tracking and hub (rlhf_utils/flags.py): they decide no number"""


# ---------------------------------------------------------------------------------------------
# Steps 1-5, the rollout: PPO's own, as it also reads the critic's values (rloo.py, grpo.py and reinforce_pp.py
# share a copy without the critic)
# ---------------------------------------------------------------------------------------------


@dataclass
class Rollout:
    """Steps 2-5 for a local batch of B episodes: what the update trains on, one row per episode."""

    query_responses: torch.Tensor  # (B, context + T) the raw samples: the query and the whole sampled response
    responses: torch.Tensor  # (B, T) the responses truncated after their first EOS, [PAD] after it (Detail 23)
    logprobs: torch.Tensor  # (B, T) the policy's temperature-scaled log-probabilities of the sampled tokens
    ref_logprobs: torch.Tensor  # (B, T) the reference policy's, likewise
    rm_scores: torch.Tensor  # (B, n) each reward model's raw score (then --reward_fn's), before the EOS trick
    values: torch.Tensor  # (B, T) the critic's value of the state before each response token (Detail 22)


@torch.no_grad()
def rollout(args, accelerator, model, ref_policy, reward_models, queries, tokenizer, generation_config, timers,
            bring_frozen_to: Optional[torch.device], reward_fn, prompts, rows) -> Rollout:
    """Steps 2-5 for one local batch, in chunks of local_rollout_forward_batch_size: sample, score with the policy,
    the reference, the reward models and the critic (Rollout). bring_frozen_to: the device the frozen models come to
    for the whole rollout (--offload; None: they stay where they are; see models.place_frozen_models)."""
    unwrapped = accelerator.unwrap_model(model)
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    queries = queries[:, real_columns(queries, pad_id)]  # the left padding every query of the batch shares is cut
    context_length = queries.size(1)
    out = {f.name: [] for f in fields(Rollout)}
    # the frozen models come to the device once for the whole rollout (--offload), and under ZeRO-3 the policy's
    # weights are gathered once for it (--gather_for_generation), not layer by layer at each decode step
    with models.placed_on((ref_policy, *reward_models), bring_frozen_to), \
            models.gathered_for_generation(model, args.gather_for_generation):
        for start in range(0, queries.size(0), args.local_rollout_forward_batch_size):
            query = queries[start : start + args.local_rollout_forward_batch_size]
            t0 = synced_time(accelerator.device)  # (a GPU's queued work done: each phase timed alone)
            # 2. fixed-length sampling with the KV cache; EOS can be sampled but never stops generation
            query_response = generate(unwrapped.policy, query, pad_id, generation_config)
            t1 = synced_time(accelerator.device)
            response = query_response[:, context_length:]  # (b, T)
            # temperature-scaled logprobs from a full forward pass: the same computation as the update, so the first
            # ratio is exactly 1 without dropout (Detail 7); the head only where a response token is predicted
            actions = slice(context_length - 1, -1)
            logits = forward(unwrapped.policy, query_response, pad_id, read=actions).logits  # (b, T, V)
            logprob, _ = action_logprobs(logits, response, args.temperature, pad_id)
            ref_logits = reference_logits(ref_policy, unwrapped.policy,
                                          lambda lm: forward(lm, query_response, pad_id, read=actions).logits)
            ref_logprob, _ = action_logprobs(ref_logits, response, args.temperature, pad_id)
            del logits, ref_logits
            # 3. truncate after the first EOS; 4. RM score at the EOS (Detail 12)
            truncated = truncate_response(eos_id, pad_id, response)
            score = ensemble_scores(reward_models, query, truncated, pad_id)
            # the critic reads the raw samples; the EOS ends the episode in compute_gae
            values = get_reward(unwrapped.critic, query_response, pad_id, context_length)[0]
            timers["generation"] += t1 - t0
            timers["scoring"] += synced_time(accelerator.device) - t1
            out["query_responses"].append(query_response)
            out["responses"].append(truncated)
            out["logprobs"].append(logprob)
            out["ref_logprobs"].append(ref_logprob)
            out["rm_scores"].append(score)
            out["values"].append(values[:, context_length - 1 : -1].float())
    data = Rollout(**{name: torch.cat(chunks, 0) for name, chunks in out.items()})
    # --reward_fn: one more column, the user's functions of the texts and of the prompt rows' other columns, called
    # once on the whole local batch, as TRL calls them, so that a response no scorer scores finds its group
    t2 = synced_time(accelerator.device)
    data.rm_scores = function_scores(data.rm_scores, reward_fn, tokenizer, queries, data.responses, prompts,
                                     rows.repeat_interleave(len(queries) // len(rows)).tolist())  # (B, n + 1)
    timers["reward_fn"] = timers.get("reward_fn", 0.0) + time.monotonic() - t2
    timers["scoring"] += time.monotonic() - t2
    return data


# ---------------------------------------------------------------------------------------------
# The pieces of the rollout and the update that ppo.py, rloo.py, grpo.py and reinforce_pp.py share (the same code
# in each)
# ---------------------------------------------------------------------------------------------


def action_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, pad_token_id: int):
    """Log-probabilities (B, T) of `tokens` under temperature-scaled logits (B, T, V), and the
    log-softmax itself. [PAD] is not an action: generation suppresses it, so it is removed here as
    well (the reference implementation lets the policy sample [PAD]; we do not)."""
    scaled = logits.float() / temperature
    scaled[..., pad_token_id] = float("-inf")
    all_logprobs = F.log_softmax(scaled, dim=-1)
    return torch.gather(all_logprobs, 2, tokens.unsqueeze(-1)).squeeze(-1), all_logprobs


def reference_logits(ref_policy, policy, logits_of):
    """The reference policy's logits, logits_of(model): a separate (or Hydra) frozen model, or the LoRA policy with
    its adapters off."""
    if ref_policy is None:
        with policy.disable_adapter():
            return logits_of(policy)
    return logits_of(ref_policy)


def response_mask(truncated_responses: torch.Tensor, pad_token_id: int):
    """Mask (B, T) of the response tokens up to and including the first EOS (all tokens when there
    is none), and the index of the last kept token (B,), where the score goes."""
    last_index = first_true_indices(truncated_responses == pad_token_id) - 1
    positions = torch.arange(truncated_responses.size(1), device=truncated_responses.device).unsqueeze(0)
    return positions <= last_index.unsqueeze(1), last_index


def apply_eos_trick(scores: torch.Tensor, truncated_responses: torch.Tensor, eos_token_id: int, penalty: float):
    """Detail 23 (EOS trick): a response that contains no EOS gets `penalty` as its score."""
    contains_eos = (truncated_responses == eos_token_id).any(dim=1)
    return torch.where(contains_eos, scores, torch.full_like(scores, penalty)), contains_eos


def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman's k1, k2, k3):
    k1 = log p - log p_ref (an unbiased estimate of the value, can be negative); k2 = (log p - log p_ref)^2 / 2
    (a biased estimate, >= 0); k3 = (r - 1) - log r with r = p_ref / p (an unbiased estimate of the value, >= 0,
    lower variance; OpenRLHF's and GRPO's). Unbiased of the value only: the gradient each follows depends on where it
    is placed, the reward or the loss (docs/usage.md, "Which gradient each KL setting follows")."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise RunError(f"unknown KL estimator {estimator!r}")


def clipped_policy_loss(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cliprange: float):
    """PPO's clipped surrogate: the masked mean of max(-A * r, -A * clip(r, 1 - eps, 1 + eps)) over the ratios
    r = exp(log_ratio) of new to rollout probabilities, and its per-micro-batch stats."""
    ratio = torch.exp(log_ratio)
    pg_losses_unclipped = -advantages * ratio
    pg_losses_clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = masked_mean(torch.max(pg_losses_unclipped, pg_losses_clipped), mask)
    with torch.no_grad():
        stats = {
            "approxkl": 0.5 * masked_mean(log_ratio**2, mask),
            "pg_clipfrac": masked_mean((pg_losses_clipped > pg_losses_unclipped).float(), mask),
            "ratio": masked_mean(ratio, mask),
        }
    return pg_loss, stats


def trim_micro_batch(query_responses, responses, context_length: int, pad_token_id: int):
    """The columns of a micro batch of rollouts that its training pass needs: from its longest query's first token
    to its last kept response token. The raw samples go on after their EOS, but the loss masks those tokens and
    causal attention keeps them out of every earlier position. Returns the cut query_responses, their context
    length and how many response columns were kept."""
    cols = real_columns(torch.cat((query_responses[:, :context_length], responses), 1), pad_token_id)
    start, width = min(cols.start, context_length), max(cols.stop - context_length, 1)
    return query_responses[:, start : context_length + width], context_length - start, width


# ---------------------------------------------------------------------------------------------
# PPO's own pieces: policy and critic in one module, the per-token rewards, GAE (steps 6-9), the losses and the
# update
# ---------------------------------------------------------------------------------------------


class PolicyAndValue(nn.Module):
    """Policy and critic in one module, so that one `accelerator.prepare` (DDP / DeepSpeed) and one optimizer hold
    both, and one forward serves the PPO loss (and the ptx loss)."""

    def __init__(self, policy: nn.Module, critic: nn.Module):
        super().__init__()
        self.policy = policy
        self.critic = critic

    def forward(self, query_responses, pad_token_id: int, context_length: int, ptx_query_responses=None,
                ptx_labels=None):
        actions = slice(context_length - 1, -1)  # the positions that predict a response token: (B, T, V) logits
        logits = forward(self.policy, query_responses, pad_token_id, read=actions).logits
        values = get_reward(self.critic, query_responses, pad_token_id, context_length)[0]  # (B, context + T)
        ptx_logits = None
        if ptx_query_responses is not None:
            ptx_read = F.pad(ptx_labels[:, 1:] != pad_token_id, (0, 1))  # position t predicts token t + 1: (N, V)
            ptx_logits = forward(self.policy, ptx_query_responses, pad_token_id, read=ptx_read).logits
        return logits, values, ptx_logits


def training_logprobs_and_values(model, query_responses, context_length: int, temperature: float,
                                 pad_token_id: int, ptx_query_responses=None, ptx_labels=None):
    """The update's pass through PolicyAndValue: temperature-scaled logprobs of the responses (B, T), the full
    log-softmax (B, T, V), the critic's values (B, T) of the state before each response token, and the ptx logits
    (N, V) at the N positions that predict a ptx target."""
    logits, values, ptx_logits = model(query_responses, pad_token_id, context_length, ptx_query_responses, ptx_labels)
    new_logprobs, all_logprobs = action_logprobs(logits, query_responses[:, context_length:], temperature, pad_token_id)
    return new_logprobs, all_logprobs, values[:, context_length - 1 : -1].float(), ptx_logits


def per_token_rewards(scores, kl, mask, last_index, kl_coef):
    """Step 6: -kl_coef * KL on every kept response token, plus the sequence score at the last kept
    token (the EOS, or the last token when there is none); zero after the EOS."""
    non_score_reward = -kl_coef * kl * mask
    rewards = non_score_reward.clone()
    # Detail 22 / Figure 11: the score is the reward of the EOS action, the episode's last; the state after it is
    # terminal (compute_gae masks its value to 0). Unlike the reference code, which puts the score one position later
    # (the first [PAD]) and trains V there, we follow Figure 11: [PAD] is not an action. At initialisation (critic =
    # RM) both give the same advantages; later, with gamma 1, they differ at the EOS by (1 - lam)(V(EOS+1) - score).
    rewards[torch.arange(rewards.size(0), device=rewards.device), last_index] += scores
    return rewards, non_score_reward


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Generalised advantage estimation over the response tokens, vectorised over the batch.
    Rewards and values after the EOS are zeroed, so the episode ends at the EOS: the token after it
    contributes no bootstrap value. Returns (advantages, returns), both zero after the EOS."""
    rewards, values = rewards * mask, values * mask
    num_steps = rewards.size(1)
    last_gae = torch.zeros_like(rewards[:, 0])
    advantages_reversed = []
    for t in reversed(range(num_steps)):
        next_values = values[:, t + 1] if t + 1 < num_steps else torch.zeros_like(values[:, t])
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last_gae = delta + gamma * lam * last_gae
        advantages_reversed.append(last_gae)
    advantages = torch.stack(advantages_reversed[::-1], dim=1) * mask
    return advantages, advantages + values


def ppo_losses(new_logprobs, old_logprobs, advantages, vpred, old_values, returns, mask, cliprange, cliprange_value):
    """Clipped policy loss and clipped value loss (both masked means over the tokens), and per-micro-batch stats."""
    pg_loss, stats = clipped_policy_loss(new_logprobs - old_logprobs, advantages, mask, cliprange)
    vpred_clipped = old_values + torch.clamp(vpred - old_values, -cliprange_value, cliprange_value)
    vf_losses_unclipped = (vpred - returns) ** 2
    vf_losses_clipped = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * masked_mean(torch.max(vf_losses_unclipped, vf_losses_clipped), mask)
    stats["vf_clipfrac"] = masked_mean((vf_losses_clipped > vf_losses_unclipped).float(), mask).detach()
    return pg_loss, vf_loss, stats


@dataclass
class RewardsAndAdvantages:
    """Steps 5-9 for a local rollout batch of B episodes; each (B, T) tensor is 0 after the EOS."""

    mask: torch.Tensor  # (B, T) response tokens up to and including the EOS
    last_index: torch.Tensor  # (B,) index of the EOS (the last token when there is none)
    scores: torch.Tensor  # (B,) after the EOS trick and the optional scaling and clipping
    contains_eos: torch.Tensor  # (B,)
    kl: torch.Tensor  # (B, T) per-token KL estimate
    non_score_reward: torch.Tensor  # (B, T) -kl_coef * kl
    rewards: torch.Tensor  # (B, T) the KL penalty plus the score at the EOS
    values: torch.Tensor  # (B, T) the critic's values from the rollout
    advantages: torch.Tensor  # (B, T)
    returns: torch.Tensor  # (B, T)

    def objective(self) -> dict:
        """Per-episode values logged as objective/{name} (update_metrics): the KL penalty summed over the response,
        and the reward with it (score + penalty)."""
        return {"non_score_reward": self.non_score_reward.sum(1),
                "rlhf_reward": self.non_score_reward.sum(1) + self.scores}


@torch.no_grad()
def rewards_and_advantages(args, hp, data: Rollout, eos_token_id: int, pad_token_id: int, kl_coef: float,
                           reward_moments, gather):
    """From the reward models' scores to what the update trains on, for a local rollout batch: the mask after the
    EOS, optional reward scaling (trlX), the models joined, 5. the EOS trick, optional clipping, then 6. the per-token
    KL penalty with the score at the EOS, 7. optional reward whitening, 8. GAE (advantages and returns), 9. advantage
    whitening. `gather` collects a tensor across ranks (for the running reward statistics and the whitening)."""
    responses = data.responses
    mask, last_index = response_mask(responses, pad_token_id)  # kept tokens: up to and including the EOS
    scores = data.rm_scores  # (B, n): each reward model's raw score
    if hp.scale_rewards:  # trlX: running-std scaling, statistics of raw scores over all ranks, one per model
        for column, moments in enumerate(reward_moments):
            moments.update(gather(scores[:, column]))
        scores = scores / torch.tensor([max(m.std, 1e-8) for m in reward_moments], device=scores.device)
    # (B,) several reward models joined into one score
    scores = combine_scores(scores, args.reward_combine, args.reward_weights)
    contains_eos = (responses == eos_token_id).any(1)
    if args.non_eos_penalty:  # 5. Detail 23: EOS trick, once per response, on the joined score
        scores, contains_eos = apply_eos_trick(scores, responses, eos_token_id, args.penalty_reward_value)
    if hp.reward_clip is not None:
        scores = torch.clamp(scores, -hp.reward_clip, hp.reward_clip)
    # 6. per-token KL penalty and the score at the EOS; everything after the EOS is masked
    kl = kl_per_token(data.logprobs, data.ref_logprobs, hp.kl_estimator) * mask
    rewards, non_score_reward = per_token_rewards(scores, kl, mask, last_index, kl_coef)
    # whitening statistics of the global rollout batch: summing over processes = summing the gathered copies
    sum_over_processes = (lambda x: gather(x.reshape(1)).sum()) if hp.whiten_across_processes else None
    if hp.whiten_rewards:  # 7. Detail 24 (optional)
        rewards = masked_whiten(rewards, mask, shift_mean=False, sum_over_processes=sum_over_processes)
    values = data.values * mask
    advantages, returns = compute_gae(rewards, values, mask, hp.gamma, hp.lam)  # 8.
    if hp.whiten_advantages:  # 9. Detail 25
        advantages = masked_whiten(advantages, mask, sum_over_processes=sum_over_processes)
    return RewardsAndAdvantages(mask, last_index, scores, contains_eos, kl, non_score_reward, rewards, values,
                                advantages, returns)


def ppo_update(args, hp, accelerator, model, optimizer, data: Rollout, scored, update: int, guard,
               actor_freeze, ptx, pad_token_id: int) -> dict:
    """The update: K epochs over the local rollout batch, each a fresh permutation cut into micro batches; every
    gradient_accumulation_steps of them make a minibatch and one optimizer step. Returns this process's
    statistics of each micro batch, (K, num_mini_batches, gradient_accumulation_steps) tensors. guard(update,
    **tensors) is the non-finite guard (run.guard), checked on each loss before its backward. The options that act
    inside the update, each a no-op when off: actor_freeze (ActorFreeze) and ptx (PtxData)."""
    local_batch_size, response_length = data.responses.shape
    context_length = data.query_responses.size(1) - response_length
    micro = args.local_micro_batch_size
    K, nmb = hp.num_ppo_epochs, hp.num_mini_batches
    ga = local_batch_size // nmb // micro
    device = accelerator.device
    stats = {}  # name -> (K, nmb, ga)
    model.train()
    for epoch in range(K):
        permutation = torch.randperm(local_batch_size, device=device)
        for step in range(nmb * ga):  # micro batch `step` of this epoch is micro batch `micro_index` of minibatch `mb`
            mb, micro_index = divmod(step, ga)
            idx = permutation[step * micro : (step + 1) * micro]
            with accelerator.accumulate(model):
                ptx_tokens, ptx_labels = ptx.batch(update, epoch * nmb * ga + step, device, pad_token_id)
                query_responses, ctx, width = trim_micro_batch(data.query_responses[idx], data.responses[idx],
                                                               context_length, pad_token_id)
                # the micro batch's rows, cut once to the response columns its training pass reads
                old_logprobs, mask = data.logprobs[idx, :width], scored.mask[idx, :width]
                advantages, old_values, returns = (x[idx, :width] for x in (scored.advantages, scored.values,
                                                                             scored.returns))
                new_logprobs, all_logprobs, vpred, ptx_logits = training_logprobs_and_values(
                    model, query_responses, ctx, args.temperature, pad_token_id, ptx_tokens, ptx_labels)
                pg_loss, vf_loss, mb_stats = ppo_losses(new_logprobs, old_logprobs, advantages, vpred, old_values,
                                                        returns, mask, hp.cliprange, hp.cliprange_value)
                ptx_loss = ptx.loss(ptx_logits, ptx_labels, pad_token_id, device)
                pg_weight = actor_freeze.policy_loss_weight(update)  # option (OpenRLHF): 0 while the actor is frozen
                loss = pg_weight * pg_loss + hp.vf_coef * vf_loss  # PPO: clipped policy loss + c_1 x clipped value loss
                loss = loss + ptx.coef * ptx_loss  # option (PPO-ptx): the SFT loss of reference summaries; coef 0: off
                # non-finite guard: checked before backward, so the optimizer never applies it
                guard(update, **{f"ppo/loss (epoch {epoch + 1}, minibatch {mb + 1})": loss})
                accelerator.backward(loss)
                actor_freeze.before_step(update)
                optimizer.step()  # a no-op until the last micro batch of the minibatch
                optimizer.zero_grad()
            with torch.no_grad():
                probs = all_logprobs.exp()
                token_entropy = -(probs * torch.where(probs > 0, all_logprobs, 0.0)).sum(-1)
                mb_stats.update(pg_loss=pg_loss.detach(), vf_loss=vf_loss.detach(), ptx_loss=ptx_loss.detach(),
                                entropy=masked_mean(token_entropy, mask))
                for name, value in mb_stats.items():
                    if name not in stats:  # allocated once, at the first micro batch
                        stats[name] = torch.zeros((K, nmb, ga), device=device)
                    stats[name][epoch, mb, micro_index] = value
    return stats


# ---------------------------------------------------------------------------------------------
# The update's metrics and the evaluation, shared by ppo.py, rloo.py, grpo.py and reinforce_pp.py (the same code in
# each)
# ---------------------------------------------------------------------------------------------


def update_metrics(args, accelerator, update: int, lr: float, kl_coef: float, data: Rollout, scored, stats: dict,
                   timers: dict, eos_token_id: int, prefix: str) -> dict:
    """The update's metrics: rollout sums per episode, the statistics of the update's micro batches (under the
    algorithm's `prefix`), each averaged over the global batch (gathered across processes), and the shares of the
    update's time. A statistic logs as {prefix}/{its name in `names`} (the reference's names), else as
    {prefix}/{its key}: a statistic a method adds reaches the logs as it is."""
    names = {"approxkl": "policy/approxkl_avg", "pg_clipfrac": "policy/clipfrac_avg", "entropy": "policy/entropy_avg",
             "pg_loss": "loss/policy_avg", "vf_loss": "loss/value_avg", "ptx_loss": "loss/ptx_avg",
             "vf_clipfrac": "val/clipfrac_avg", "ratio": "val/ratio"}  # those a method has (no critic: no vf_*)
    logged = [key for key in names if key in stats] + [key for key in stats if key not in names]
    gather = accelerator.gather
    kl_sum = gather(scored.kl.sum(1))
    entropy_sum, scores = gather((-data.logprobs * scored.mask).sum(1)), gather(scored.scores)
    stats = {name: gather(value) for name, value in stats.items()}
    num_eos_tokens = gather((data.responses == eos_token_id).sum().unsqueeze(0)).sum()
    return {
        "episode": update * args.total_batch_size,
        "train/lr": lr,
        "objective/kl": kl_sum.mean().item(),
        "objective/kl_coef": kl_coef,
        "objective/entropy": entropy_sum.mean().item(),
        # the method's own per-episode values (its RewardsAndAdvantages.objective: the KL penalty, the reward with it)
        **{f"objective/{name}": gather(value).mean().item() for name, value in scored.objective().items()},
        "objective/scores": scores.mean().item(),
        **({f"objective/scores_rm{j}": gather(data.rm_scores[:, j]).mean().item()  # each reward model's raw score
            for j in range(data.rm_scores.size(1))} if data.rm_scores.size(1) > 1 else {}),
        "objective/eos_rate": gather(scored.contains_eos.float()).mean().item(),
        **{f"{prefix}/{names.get(key, key)}": stats[key].mean().item() for key in logged},
        f"{prefix}/val/ratio_var": stats["ratio"].var(unbiased=False).item(),
        f"{prefix}/val/num_eos_tokens": num_eos_tokens.item(),
        "episodes_per_second": args.total_batch_size / timers["wall"],
        "time/generation_share": timers["generation"] / timers["wall"],
        "time/scoring_share": timers["scoring"] / timers["wall"],
        "time/training_share": timers["training"] / timers["wall"],
        "time/update_s": timers["wall"],  # the update's wall time: rollout, scoring and training
        **({"time/reward_fn_share": timers["reward_fn"] / timers["wall"]} if args.reward_fn else {}),  # of scoring
    }


@torch.no_grad()
def eval_samples(args, accelerator, model, reward_models, eval_dataset, tokenizer, generation_config,
                 bring_frozen_to: Optional[torch.device], reward_fn):
    """The evaluation's samples: sample the first num_eval_samples validation queries (split evenly across ranks so
    that every rank runs the same number of generate calls), score them and return the rows of the sample table."""
    unwrapped = accelerator.unwrap_model(model)
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    per_rank = min(args.num_eval_samples, len(eval_dataset)) // accelerator.num_processes
    start_row = accelerator.process_index * per_rank
    rows = []
    # evaluation samples from its own random stream, the same at every evaluation (evaluation_rng): how often
    # and how much a run evaluates never changes what it trains. The reward models come to the device once for the
    # whole evaluation (--offload), and the policy's ZeRO-3 weights are gathered once for it (--gather_for_generation)
    with evaluation_rng(accelerator, args.seed + accelerator.process_index * 100003), \
            models.placed_on(reward_models, bring_frozen_to), \
            models.gathered_for_generation(model, args.gather_for_generation):
        for start in range(start_row, start_row + per_rank, args.local_rollout_forward_batch_size):
            batch = eval_dataset[start : min(start + args.local_rollout_forward_batch_size, start_row + per_rank)]
            query = torch.tensor(batch["query_token"], device=accelerator.device)
            query = query[:, real_columns(query, pad_id)]  # the left padding every query of the batch shares is cut
            context_length = query.size(1)
            query_response = generate(unwrapped.policy, query, pad_id, generation_config)
            truncated = truncate_response(eos_id, pad_id, query_response[:, context_length:])
            scores = ensemble_scores(reward_models, query, truncated, pad_id)
            batch_rows = range(start, start + len(query))  # the rows of eval_dataset this batch holds
            scores = function_scores(scores, reward_fn, tokenizer, query, truncated, eval_dataset, batch_rows)
            score = combine_scores(scores, args.reward_combine, args.reward_weights)  # raw: no EOS trick, no scaling
            _, last_index = response_mask(truncated, pad_id)
            has_eos = (truncated == eos_id).any(1)
            for i in range(query.size(0)):
                rows.append(
                    {
                        "query": tokenizer.decode(query[i][query[i] != pad_id], skip_special_tokens=True),
                        "response": tokenizer.decode(truncated[i], skip_special_tokens=True).strip(),
                        "reference": batch["reference_response"][i].strip(),
                        "score": score[i].item(),
                        "response_token_len": int(last_index[i].item()) + 1,
                        "has_eos": bool(has_eos[i].item()),
                        **({f"score_rm{j}": scores[i, j].item() for j in range(scores.size(1))}
                           if scores.size(1) > 1 else {}),
                    }
                )
    return gather_object(rows)


def main(args: Args) -> dict:
    start_time = time.monotonic()
    bf16 = args.bf16 if args.bf16 is not None else (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    # first: the batch arithmetic below depends on the number of processes
    start_processes(args.run.process_group_timeout_min)
    accelerator = Accelerator(mixed_precision="bf16" if bf16 else "no")
    hp = args.ppo  # the algorithm's knobs, --ppo.*
    num_processes, device = accelerator.num_processes, accelerator.device
    local_batch_size, gradient_accumulation_steps, num_updates = batch_arithmetic(args, hp, num_processes)
    accelerator.gradient_accumulation_steps = gradient_accumulation_steps
    configure_deepspeed(accelerator, args.local_micro_batch_size)  # Detail 8 (no-op without DeepSpeed)
    zero3 = getattr(accelerator.state.deepspeed_plugin, "zero_stage", None) == 3
    reward_fn = check_flags(args, accelerator, hp.num_mini_batches, gradient_accumulation_steps, num_updates, zero3)
    run = Run(args, accelerator)  # run name and folder (rlhf_utils/run.py)
    run.inputs(sft_model_path=args.sft_model_path, reward_model_path=args.reward_model_path,
               query_dataset=args.query_dataset)

    # ---------------- seeding (labelled, deliberate) ----------------
    set_seed(args.seed)  # weights (any fresh head) and data order: identical on every rank
    local_seed = args.seed + accelerator.process_index * 100003  # sampling differs per rank

    # ---------------- tokenizer and models ----------------
    tokenizer = load_tokenizer(args.sft_model_path, args.trust_remote_code)  # Detail 3: [PAD] distinct from EOS
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    for path in args.reward_model_path:
        checks.check_reward_tokenizer(tokenizer, args.sft_model_path, path, args.trust_remote_code)
    critic = load_critic(args, tokenizer)  # Detail 22: the reward model, a per-token RM (--critic_init)
    # Hydra and LoRA enter here: they decide what the reference policy is (None with LoRA)
    policy, reward_models, ref_policy = load_models(args, tokenizer, bf16)
    model = PolicyAndValue(policy, critic)
    adamw, actor_params = actor_critic_optimizer(args, policy, critic)
    model, optimizer = accelerator.prepare(model, adamw)
    # the frozen models need no optimizer state (Detail 8); --offload decides where they live between uses
    reward_models, ref_policy, bring_frozen_to = models.place_frozen_models(args, accelerator, reward_models,
                                                                            ref_policy, zero3)
    actor_freeze = ActorFreeze(hp.freeze_actor_updates, actor_params, accelerator)

    # ---------------- data ----------------
    train_dataset, eval_dataset = load_query_data(args, tokenizer, ptx=hp.ptx_coef > 0)
    run.claim_output_dir()  # every input check has passed: only now mark --output_dir as this run's
    query_tokens = torch.tensor(train_dataset["query_token"])  # (N, query_length), left-padded
    draws_per_update = hp.num_ppo_epochs * hp.num_mini_batches * gradient_accumulation_steps
    ptx = PtxData(hp.ptx_coef, args, train_dataset, accelerator.process_index, num_processes, draws_per_update)
    seed_sampling(local_seed)  # after the models exist, so that model init stays identical across ranks
    generation_config = sampling_config(args, tokenizer, args.temperature)
    eval_generation_config = sampling_config(args, tokenizer, args.eval_temperature)
    eval_rows = functools.partial(eval_samples, args, accelerator, model, reward_models, eval_dataset, tokenizer,
                                  eval_generation_config, bring_frozen_to, reward_fn)

    # ---------------- stateful pieces and resume ----------------
    kl_controller = AdaptiveKLController(hp.kl_coef, hp.target_kl, hp.kl_horizon, hp.adaptive_kl)
    reward_moments = [RunningMoments() for _ in range(len(args.reward_model_path) + (reward_fn is not None))]  # scorers
    # saved and restored with the models, the optimizer and the RNG states. The data position and the learning
    # rate need no entry: both are functions of the update number (see the loop)
    accelerator.register_for_checkpointing(kl_controller, *reward_moments)
    # the non-finite guard's fallback
    last_good = LastGoodState(run, accelerator, adamw, kl_controller, *reward_moments)
    state = run.start(records.fresh_trainer_state(), num_updates=num_updates, total_batch_size=args.total_batch_size)
    start_time -= state["wall_time_s"]  # wall_time_s of the summary counts the interrupted run too
    accelerator.print(f"{args.exp_name}: {num_updates} updates of {args.total_batch_size} episodes ({num_processes} "
                      f"processes x {local_batch_size}); {hp.num_ppo_epochs} epochs x {hp.num_mini_batches} "
                      f"minibatches x {gradient_accumulation_steps} micro batches of {args.local_micro_batch_size}")
    if state["update"] == 0 and models.snapshot_due(args, 0, num_updates):  # the starting policy, before update 1
        models.save_policy_snapshot(accelerator, model, tokenizer, args.output_dir, 0,
                                    {**state["budget"], "num_updates": num_updates}, args.lora_rank > 0)
    progress = tqdm(range(state["update"] + 1, num_updates + 1), initial=state["update"], total=num_updates,
                    disable=not accelerator.is_local_main_process)
    for update in progress:
        with last_good.kept(update, state):  # a non-finite rollout leaves the state after update - 1 as a checkpoint
            if reward_fn is not None:  # the functions' trainer_state (TRL's): optimizer steps and epochs so far
                steps = hp.num_ppo_epochs * hp.num_mini_batches  # per update
                reward_fn.at((update - 1) * steps, state["budget"]["budget/prompts"] / len(train_dataset),
                             num_updates * steps)
            update_start, timers = synced_time(device), {"generation": 0.0, "scoring": 0.0}
            # linear decay to 0 over the run (Table 7); a frozen actor (OpenRLHF) gets lr 0
            lr = args.lr * (1.0 - (update - 1.0) / num_updates) if args.scheduler == "linear" else args.lr
            actor_freeze.set_lr(optimizer, update, lr)

            # ---------------- rollout: steps 1-5 ----------------
            model.eval()  # rollouts sample without dropout; with Detail 7 (dropout off) train() and eval() agree
            rows = shuffled_query_batch(len(query_tokens), args.total_batch_size, args.seed, update - 1,
                                        accelerator.process_index, num_processes)
            queries = query_tokens[rows].to(device)  # 1. Detail 21
            with accelerator.autocast():
                data = rollout(args, accelerator, model, ref_policy, reward_models, queries, tokenizer,
                               generation_config, timers, bring_frozen_to, reward_fn, train_dataset, rows)

            # ---------------- steps 5-9: EOS trick, KL penalty, GAE, whitening ----------------
            t_shaping = synced_time(device)
            scored = rewards_and_advantages(args, hp, data, eos_id, pad_id, kl_controller.value, reward_moments,
                                            accelerator.gather)
            # non-finite guard on the rollout, before any optimizer step uses it. The raw RM scores are checked
            # themselves: the EOS trick would hide a NaN score of a response without EOS.
            run.guard(update, **{"rollout/rm_scores": data.rm_scores, "rollout/rewards": scored.rewards,
                                 "rollout/advantages": scored.advantages})
            timers["scoring"] += synced_time(device) - t_shaping

            # ---------------- the update: K epochs x minibatches x micro batches ----------------
            t_train = synced_time(device)
            stats = ppo_update(args, hp, accelerator, model, optimizer, data, scored, update, run.guard, actor_freeze,
                               ptx, pad_id)
            timers["training"] = synced_time(device) - t_train
            timers["wall"] = synced_time(device) - update_start

            # ---------------- logging: whole-update averages gathered across ranks ----------------
            metrics = update_metrics(args, accelerator, update, lr, kl_controller.value, data, scored, stats, timers,
                                     eos_id, "ppo")
            # the rollout's KL (summed over each response, averaged over the global batch); no-op without adaptive_kl
            kl_controller.update(accelerator.gather(scored.kl.sum(1)).mean().item(), args.total_batch_size)
            # the budget spent: the responses this update sampled and the prompts they answer, on every process
            state = records.next_state(state, start_time, timers, metrics,
                                       {"budget/responses_sampled": len(data.responses) * num_processes,
                                        "budget/prompts": len(rows) * num_processes})
            run.log(update, {**metrics, **state["budget"]})
        progress.set_postfix(score=f"{metrics['objective/scores']:.3f}", kl=f"{metrics['objective/kl']:.2f}",
                             eps=f"{metrics['episodes_per_second']:.1f}")
        if due(args.print_sample_every, update):
            accelerator.print(f"[update {update}] score {scored.scores[0].item():.3f} | "
                              + tokenizer.decode(data.responses[0], skip_special_tokens=True))
        del data, scored, stats
        if due(args.eval_every, update, num_updates):
            records.log_evaluation(run, args, update, eval_rows())
        if models.snapshot_due(args, update, num_updates):
            models.save_policy_snapshot(accelerator, model, tokenizer, args.output_dir, update,
                                        {**state["budget"], "num_updates": num_updates}, args.lora_rank > 0)
        # resumable checkpoint, after this update's logging and evaluation: a resumed run starts with the next
        # update, with the RNG states as they are now (not at the final update: the model is saved)
        if due(args.run.checkpoint_every, update, num_updates):
            run.checkpoint(update, state)
    progress.close()

    # ---------------- final evaluation and outputs ----------------
    eval_metrics, table = records.log_evaluation(run, args, num_updates, eval_rows())
    models.save_policy(accelerator, model, tokenizer, args.output_dir, args.lora_rank > 0)
    summary = records.run_summary(args, state, eval_metrics, num_updates, start_time)
    run.save_table(table, "samples.csv")
    run.finish(summary)
    if args.run.push_to_hub and accelerator.is_main_process:
        models.upload_to_hub(args)
    accelerator.print(json.dumps(summary, indent=2))
    return summary


# ---------------------------------------------------------------------------------------------
# The trlX / OpenRLHF options: each enters main at one place and does nothing when it is off
# ---------------------------------------------------------------------------------------------


class ActorFreeze:
    """OpenRLHF (--ppo.freeze_actor_updates N): for the first N updates only the critic learns (N = 0: no-ops). A
    frozen update gives the "actor" group of AdamW lr 0 and the policy loss weight 0 (kept, so that DDP sees a
    gradient for every parameter); after backward the actor's gradients become None, and AdamW skips a parameter
    without one (no step count, moments or decay), so its first real step is that of a run that never froze."""

    def __init__(self, num_frozen_updates: int, actor_params: list, accelerator):
        self.num_frozen_updates, self.actor_params = num_frozen_updates, actor_params
        self.deepspeed = accelerator.state.deepspeed_plugin is not None

    def set_lr(self, optimizer, update: int, lr: float) -> None:
        for group in optimizer.param_groups:  # main's AdamW has two named groups, "actor" and "critic"
            group["lr"] = 0.0 if group["name"] == "actor" and update <= self.num_frozen_updates else lr

    def policy_loss_weight(self, update: int) -> float:
        return 0.0 if update <= self.num_frozen_updates else 1.0

    def before_step(self, update: int) -> None:
        # DeepSpeed steps inside backward: lr 0 and the zero gradient keep the actor, its AdamW counts the steps
        if update <= self.num_frozen_updates and not self.deepspeed:
            for param in self.actor_params:
                param.grad = None


class AdaptiveKLController:
    """trlX / Ziegler et al. (2019): move kl_coef proportionally to the KL error, clipped to +-20%. With
    adaptive=False (the adaptive_kl flag off) kl_coef stays at its initial value: update() is a no-op."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int, adaptive: bool = True):
        self.value, self.target, self.horizon, self.adaptive = init_kl_coef, target, horizon, adaptive

    def update(self, current_kl: float, num_episodes: int) -> None:
        if not self.adaptive:
            return
        proportional_error = float(np.clip(current_kl / self.target - 1.0, -0.2, 0.2))
        self.value *= 1.0 + proportional_error * num_episodes / self.horizon

    # a checkpoint holds the coefficient (register_for_checkpointing); target and horizon come from the flags
    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]

    def flags_changed(self, changed: dict) -> None:
        """--resume --accept_changed_flags (Run.apply_changed_flags): a new --*.kl_coef replaces the restored value."""
        for name, (_, now) in changed.items():
            if name.endswith(".kl_coef"):
                self.value = now


class RunningMoments:
    """trlX reward scaling: running mean / std of every score seen (parallel-variance merge). Feed it globally
    gathered scores so that all ranks hold the same statistics; a checkpoint holds them (register_for_checkpointing)."""

    def __init__(self):
        self.mean, self.var, self.count = 0.0, 1.0, 1e-24

    def update(self, values: torch.Tensor) -> None:
        batch_mean, batch_var, batch_count = values.mean().item(), values.var(unbiased=False).item(), values.numel()
        delta, total = batch_mean - self.mean, self.count + batch_count
        self.mean += delta * batch_count / total
        self.var = (self.var * self.count + batch_var * batch_count
                    + delta**2 * self.count * batch_count / total) / total
        self.count = total

    @property
    def std(self) -> float:
        return max(self.var, 0.0) ** 0.5

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]


def sft_loss(logits: torch.Tensor, labels: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """PPO-ptx: next-token NLL on the reference-summary tokens (labels are [PAD] elsewhere), from their logits
    (N, V)."""
    targets = labels[:, 1:][labels[:, 1:] != pad_token_id]  # (N,)
    logprobs = torch.gather(F.log_softmax(logits.float(), dim=-1), 1, targets.unsqueeze(-1)).squeeze(-1)
    return -logprobs.mean()


class PtxData:
    """PPO-ptx (InstructGPT, OpenRLHF; the ptx_coef flag): every micro batch adds ptx_coef x the SFT loss of a batch
    of reference summaries, drawn like the queries (shuffled passes, Detail 21) with a seed of its own. With
    ptx_coef 0 (off) there is no batch and the loss is 0."""

    def __init__(self, ptx_coef: float, args, train_dataset, process_index: int, num_processes: int,
                 draws_per_update: int):
        self.coef, self.on = ptx_coef, ptx_coef > 0
        self.seed, self.draws_per_update = args.seed + 7919, draws_per_update
        self.process_index, self.num_processes = process_index, num_processes
        self.batch_size = args.local_micro_batch_size * num_processes
        if self.on:
            self.tokens = torch.tensor(train_dataset["query_reference_response_token"])
            self.labels = torch.tensor(train_dataset["query_reference_response_token_response_label"])

    def batch(self, update: int, draw: int, device, pad_token_id: int):
        """Tokens and labels of the ptx batch of micro batch `draw` of `update` (None, None when off)."""
        if not self.on:
            return None, None
        index = (update - 1) * self.draws_per_update + draw
        rows = shuffled_query_batch(len(self.tokens), self.batch_size, self.seed, index, self.process_index,
                                    self.num_processes)
        tokens, labels = self.tokens[rows], self.labels[rows]
        cols = real_columns(tokens, pad_token_id)  # the padding every row shares is cut
        return tokens[:, cols].to(device), labels[:, cols].to(device)

    def loss(self, logits, labels, pad_token_id: int, device) -> torch.Tensor:
        return torch.zeros((), device=device) if logits is None else sft_loss(logits, labels, pad_token_id)


# ---------------------------------------------------------------------------------------------
# The setup that decides numbers: batch sizes, flags, tokenizer, models, reference, placement, seeds, data, saving
# ---------------------------------------------------------------------------------------------


def batch_arithmetic(args, hp, num_processes: int):
    """The batch sizes, each division exact or a clear error (before anything loads): the local batch size, the
    micro batches per optimizer step (gradient accumulation) and the number of updates."""
    local_batch_size = exact_div(args.total_batch_size, num_processes, "total_batch_size across processes")
    local_mini_batch_size = exact_div(local_batch_size, hp.num_mini_batches, "local batch across minibatches")
    gradient_accumulation_steps = exact_div(local_mini_batch_size, args.local_micro_batch_size, "local minibatch")
    num_updates = args.total_episodes // args.total_batch_size
    return local_batch_size, gradient_accumulation_steps, num_updates


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


def load_models(args, tokenizer, bf16: bool):
    """The models: the policy (from the SFT model), the frozen reward models, and the frozen reference policy (a copy
    of the SFT model; a Hydra head that shares the policy's frozen trunk; or None with LoRA, where the reference is
    the policy with its adapters off)."""
    frozen_dtype, remote = torch.bfloat16 if bf16 else torch.float32, args.trust_remote_code
    # float32 master weights whatever the checkpoint's dtype (Pythia's hub weights are float16); bf16 is autocast
    policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, dtype=torch.float32, trust_remote_code=remote,
                                                  **quantized_loading(args, bf16))  # QLoRA: a 4-bit base
    ref_policy = None  # with LoRA: the policy with its adapters disabled
    with models.zero3_offloaded_init(args.offload):  # --offload under ZeRO-3: their partitions in CPU memory
        reward_models = [AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=frozen_dtype, trust_remote_code=remote) for path in args.reward_model_path]
        if args.lora_rank <= 0 and args.num_layers_unfrozen < 0:  # a frozen copy of the SFT model
            ref_policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, dtype=frozen_dtype,
                                                              trust_remote_code=remote)
    paths = (args.sft_model_path, *args.reward_model_path, args.sft_model_path)
    loaded = zip((policy, *reward_models, ref_policy), paths)
    for model, path in ((m, p) for m, p in loaded if m is not None):
        checked_for_training(model, path, tokenizer, args.disable_dropout or model is ref_policy)
    for frozen in (m for m in (*reward_models, ref_policy) if m is not None):
        frozen.requires_grad_(False).eval()
    if args.lora_rank > 0:
        policy = lora_policy(policy, args)
    elif args.num_layers_unfrozen >= 0:
        ref_policy = build_hydra_reference(policy, args.num_layers_unfrozen)
    return models.checkpointed(policy, args.gradient_checkpointing), reward_models, ref_policy


def load_critic(args, tokenizer) -> nn.Module:
    """The critic, a scalar head on a transformer (Detail 22): it starts as the (first) reward model, a per-token RM
    (--critic_init reward, the paper's), or as the SFT model with a fresh scalar head (sft); float32 master
    weights, trained like the policy (--gradient_checkpointing as well). Without a reward model (--reward_fn alone)
    --critic_init reward starts from the SFT model too; the log names the model it starts from."""
    path = args.reward_model_path[0] if args.critic_init == "reward" and args.reward_model_path else args.sft_model_path
    PartialState().print(f"critic (Detail 22): {'a fresh scalar head on ' * (path == args.sft_model_path)}{path}")
    critic = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32,
                                                                trust_remote_code=args.trust_remote_code)
    return checked_for_training(models.checkpointed(critic, args.gradient_checkpointing), path, tokenizer,
                                args.disable_dropout)


def checked_for_training(model: nn.Module, path: str, tokenizer, no_dropout: bool) -> nn.Module:
    """A loaded model made ready: finite weights (a diverged save stops here, named with its first non-finite
    tensor), embeddings for every token of the tokenizer ([PAD] included), and dropout off where asked (Detail 7;
    the frozen reference always: deterministic)."""
    checks.check_finite(model, path)
    # the config's row count, not the weight's shape: ZeRO-3 partitions weights as they load
    if model.config.vocab_size < len(tokenizer):
        model.resize_token_embeddings(len(tokenizer))
    if no_dropout:
        disable_dropout(model)
    return model


def actor_critic_optimizer(args, policy: nn.Module, critic: nn.Module):
    """AdamW over the trainable weights in two named groups, "actor" and "critic", so that the actor can be frozen
    while the critic warms up (--ppo.freeze_actor_updates). Returns it and the actor's trainable weights."""
    actor_params = [p for p in policy.parameters() if p.requires_grad]
    critic_params = [p for p in critic.parameters() if p.requires_grad]
    adamw = torch.optim.AdamW([{"params": actor_params, "name": "actor"}, {"params": critic_params, "name": "critic"}],
                              lr=args.lr, eps=args.eps, weight_decay=args.weight_decay)
    return adamw, actor_params


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The stack of transformer blocks of a causal LM (GPT-NeoX `layers`, GPT-2 `h`, ...)."""
    backbone = getattr(model, model.base_model_prefix)
    for name in ("layers", "h", "blocks"):
        layers = getattr(backbone, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise RunError(f"cannot find the decoder layers of {type(model).__name__} for Hydra")


def build_hydra_reference(policy: nn.Module, num_layers_unfrozen: int) -> nn.Module:
    """Hydra (trlX): freeze the embeddings and the bottom layers of the policy, and build the reference
    as a model that SHARES those frozen modules with the policy and owns frozen copies of the top
    `num_layers_unfrozen` layers, the final norm and the LM head. The trunk exists once in memory.
    (trlX also reuses the trunk's activations; here the reference recomputes them, which keeps the
    code model-agnostic at the cost of compute, not memory.)"""
    layers = decoder_layers(policy)
    if not 1 <= num_layers_unfrozen <= len(layers):
        raise RunError(f"--num_layers_unfrozen must be in [1, {len(layers)}], got {num_layers_unfrozen}")
    num_frozen = len(layers) - num_layers_unfrozen
    shared = [policy.get_input_embeddings()] + list(layers[:num_frozen])
    for module in shared:
        module.requires_grad_(False)
    # deepcopy with a memo that maps each shared module to itself: those are reused, not copied
    memo = {id(module): module for module in shared}
    reference = copy.deepcopy(policy, memo)
    reference.requires_grad_(False)
    return reference.eval()


def seed_sampling(local_seed: int) -> None:
    """The seed of this process's random draws from here on (sampling, the update's permutations): Python, NumPy
    and torch (all devices), each seeded with local_seed."""
    random.seed(local_seed)
    np.random.seed(local_seed)
    torch.manual_seed(local_seed)


def load_query_data(args, tokenizer, ptx: bool):
    """The query splits, checked for the columns this run reads and for the tokenizer that made them."""
    train_dataset = checks.load_split(args.query_dataset, args.train_split)
    eval_dataset = checks.load_split(args.query_dataset, args.eval_split)
    ptx_columns = ["query_reference_response_token", "query_reference_response_token_response_label"]
    checks.check_columns(train_dataset, ["query_token"] + (ptx_columns if ptx else []),
                  f"{args.query_dataset} split {args.train_split!r}")
    if ptx:  # the reference summaries the ptx loss trains on start where their queries end
        where = f"{args.query_dataset} split {args.train_split!r}"
        checks.check_query_response(train_dataset, tokenizer.pad_token_id, where)
    checks.check_columns(eval_dataset, ["query_token", "reference_response"],
                  f"{args.query_dataset} split {args.eval_split!r}")
    for split, dataset in ((args.train_split, train_dataset), (args.eval_split, eval_dataset)):
        checks.check_data_tokenizer(dataset, tokenizer, args.sft_model_path, f"{args.query_dataset} split {split!r}")
    return train_dataset, eval_dataset


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


def shuffled_query_batch(num_rows: int, batch_size: int, seed: int, index: int, process_index: int, num_processes: int):
    """Detail 21: this process's slice of global index batch number `index` (0, 1, 2, ...) of an endless stream.
    Each pass over the split is a fresh permutation (seeded by seed + pass number: sampling without replacement);
    the incomplete tail of a pass is dropped. Every rank draws the same permutation and takes its own slice of
    each global batch. The batch depends on its arguments only, so a resumed run needs no replay of past draws."""
    if num_rows < batch_size:
        raise RunError(f"the query split has {num_rows} rows, fewer than one batch of {batch_size}")
    local_batch_size = exact_div(batch_size, num_processes, "total_batch_size across processes")
    data_pass, batch_in_pass = divmod(index, num_rows // batch_size)
    permutation = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + data_pass))
    local_start = batch_in_pass * batch_size + process_index * local_batch_size
    return permutation[local_start : local_start + local_batch_size]


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


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the positions where mask is True."""
    return (values * mask).sum() / mask.sum()


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, sum_over_processes=None):
    """Normalise to unit variance over the masked positions (Details 24-25); optionally keep the mean.
    `sum_over_processes` (a function that sums a tensor over every process) makes the mean and variance
    those of the global batch; None uses this process's positions only."""
    total = sum_over_processes or (lambda x: x)
    count = total(mask.sum().float())
    mean = total((values * mask).sum()) / count
    var = total((((values - mean) ** 2) * mask).sum()) / count
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def get_score(reward_model, queries: torch.Tensor, responses: torch.Tensor, pad_token_id: int,
              reward=get_reward) -> torch.Tensor:
    """RM scores (B,) of left-padded queries (B, Tq) and right-padded responses (B, Tr), read at the EOS
    (Detail 12), computed on the columns that hold a real token in some row by `reward` (get_reward, or
    get_reward_query_once: each query once, --query_once)."""
    query_responses = torch.cat((queries, responses), 1)
    cols = real_columns(query_responses, pad_token_id)
    start = min(cols.start, queries.size(1))
    return reward(reward_model, query_responses[:, start : cols.stop], pad_token_id, queries.size(1) - start)[1]


def ensemble_scores(reward_models, queries, responses, pad_token_id: int, reward=get_reward) -> torch.Tensor:
    """Raw scores (B, n) of the responses under each of the n reward models, one column each (Detail 12), by
    get_score's `reward`."""
    columns = [get_score(reward_model, queries, responses, pad_token_id, reward).float()
               for reward_model in reward_models]
    return torch.stack(columns, 1) if columns else torch.zeros((queries.size(0), 0), device=queries.device)


def function_scores(scores, reward_fn: Optional[RewardFunctions], tokenizer, queries: torch.Tensor,
                    responses: torch.Tensor, prompts, rows):
    """--reward_fn: the reward models' scores (B, n) and, joined as column n, the one score the user's functions give
    B responses (right-padded, truncated after the EOS) to their left-padded queries, called as TRL's GRPOTrainer
    calls them (rlhf_utils/rewards.py: by keyword, prompts and completions decoded as text with no [PAD], no EOS and
    the leading space stripped, completion_ids the response's tokens up to its EOS, the other columns of the prompt
    rows `rows` of the dataset `prompts` that hold no token ids; each answer checked: a finite number or None per
    response). Combined as TRL combines them: sum_f w_f * s_f over the functions f that score the response (a None
    is skipped; w: --reward_fn_weights), 0 where none does. A response that no function and no reward model scores
    takes the mean score of the scored responses to its prompt (0 if none), so that its group-relative advantage is
    0 (TRL's sum gives it 0); a line counts them. No function: the scores as they are."""
    if reward_fn is None:
        return scores
    decoded = (tokenizer.batch_decode(x, skip_special_tokens=True) for x in (queries, responses))
    texts, answers = ([s.strip() for s in batch] for batch in decoded)
    completion_ids = [response[response != tokenizer.pad_token_id].tolist() for response in responses]
    values = reward_fn.answers(texts, answers, completion_ids, prompts, rows)  # per function: a float or None each
    each = scores.new_tensor([[float("nan") if v is None else v for v in column] for column in values])  # (F, B)
    score = (each.nan_to_num() * scores.new_tensor(reward_fn.weights).unsqueeze(1)).sum(0)  # (B,) float32, as the RMs'
    unscored = each.isnan().all(0) & (scores.size(1) == 0)  # no function and no reward model scores it
    if unscored.any():  # the mean of its group's scored responses (the responses to its prompt row): advantage 0
        reward_fn.warn_unscored(int(unscored.sum()), len(unscored))
        group = torch.tensor(list(rows), device=scores.device)
        peers = (group.unsqueeze(1) == group.unsqueeze(0)) & ~unscored.unsqueeze(0)  # (B, B) scored, same prompt
        score = torch.where(unscored, (peers * score).sum(1) / peers.sum(1).clamp(min=1), score)
    return torch.cat((scores, score.unsqueeze(1)), 1)


def combine_scores(scores: torch.Tensor, rule: str, weights: Optional[List[float]]) -> torch.Tensor:
    """One score per episode (B,) from the n reward models' scores (B, n): their mean; their weighted sum
    sum_i w_i * s_i; or their min, the conservative ensemble of Coste et al. 2024 (an episode is worth what the
    least impressed reward model gives it, so the policy gains only where every model agrees)."""
    if rule == "mean":
        return scores.mean(1)
    if rule == "sum":
        w = torch.ones(scores.size(1)) if weights is None else torch.tensor(weights, dtype=torch.float32)
        return (scores * w.to(scores.device, scores.dtype)).sum(1)
    if rule == "min":
        return scores.min(1).values
    raise RunError(f"unknown --reward_combine {rule!r}")


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


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True))
    leave_processes()  # after a multi-process run: exit without the teardown that can abort (rlhf_utils/run.py)
