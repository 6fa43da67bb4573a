"""PPO for RLHF on TL;DR summarization, with every detail of "The N+ Implementation Details of RLHF
with PPO" (Details 20-25, Table 7) and the trlX / OpenRLHF options as flags.

One update = one rollout of `total_batch_size` episodes followed by K PPO epochs over it:

  rollout  1. sample left-padded queries from the SFT split, reshuffling after each pass (Detail 21)
           2. sample exactly `response_length` tokens at temperature 0.7, no early stop (Detail 23)
           3. truncate each response after its first EOS, fill the rest with [PAD]   (Detail 23)
           4. score query + truncated response with the RM, read at the EOS          (Details 12, 14)
           5. EOS trick: no EOS in the response -> score = penalty_reward_value (-1)  (Detail 23)
           6. per-token rewards: -kl_coef * KL on every token, the score at the EOS
           7. optional reward whitening (Detail 24)
           8. GAE (gamma 1, lambda 0.95); returns = advantages + values
           9. advantage whitening (Detail 25)
  update   K epochs x num_mini_batches minibatches x gradient accumulation of micro batches;
           clipped policy loss, clipped value loss (vf_coef 0.1), AdamW with linear decay.

Single process:   python ppo.py --sft_model_path models/sft --reward_model_path models/rm
Several:          accelerate launch --config_file zero2.yaml ppo.py ...
After a crash:    the same command with --resume: it continues from the latest checkpoint in
                  runs/{run_name}/checkpoints (policy + critic, AdamW, KL controller, reward statistics, data
                  position, RNG states) and ends exactly like an uninterrupted run (--checkpoint_every sets how often).
"""

import contextlib
import copy
import json
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from typing import Literal, Optional

import numpy as np
import pandas as pd
import pyarrow
import pyarrow.compute
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from accelerate import Accelerator, PartialState
from accelerate.utils import broadcast_object_list, gather_object, set_seed
from datasets import load_dataset, load_from_disk
from peft import LoraConfig, get_peft_model
from torch.utils.tensorboard import SummaryWriter
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GenerationConfig


@dataclass
class PpoHParams:
    """PPO knobs (Table 7 defaults) and the trlX / OpenRLHF options, each off by default."""

    num_ppo_epochs: int = 4
    """K: PPO epochs over each rollout batch (Table 7)"""
    num_mini_batches: int = 1
    """N_mb: minibatches per PPO epoch (Table 7); each is one optimizer step"""
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
    """Details 24-25: the whitening mean and variance are those of the whole rollout batch over every process,
    so N processes whiten exactly as one process would. Off: each process whitens its own share, as the
    reference implementation did (its statistics then depend on the number of GPUs)"""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """per-token KL estimate in the penalty: k1 = log p - log p_ref (paper); k3 = r - 1 - log r, r = p_ref / p"""
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
    """OpenRLHF: for the first N updates only the critic learns; the actor takes no optimizer step, so its AdamW
    state is untouched when it starts learning (under DeepSpeed: actor lr 0 and policy loss 0, its AdamW state
    counting the frozen steps)"""


@dataclass
class Args:
    # common
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of weights and data order on every rank (sampling uses seed + process_index * 100003)"""
    run_name: Optional[str] = None
    """None -> {exp_name}__{seed}__{unix time}; outputs go to {run_dir_root}/{run_name}"""
    track: bool = False
    """log to Weights & Biases (mirrors TensorBoard)"""
    wandb_project_name: str = "tldr_summarize"
    """the W&B project"""
    wandb_entity: Optional[str] = None
    """the W&B entity (team)"""
    push_to_hub: bool = False
    """upload the final policy to the Hugging Face hub"""
    hub_model_id: Optional[str] = None
    """hub repository id for --push_to_hub (None -> run_name)"""
    output_dir: str = "models/ppo"
    """where the final policy and its tokenizer are saved"""
    run_dir_root: str = "runs"
    """root folder of run outputs (args, metrics, TensorBoard, sample tables)"""
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

    # models
    sft_model_path: str = "models/sft"
    """the SFT policy: initial policy, reference policy, and the tokenizer"""
    reward_model_path: str = "models/rm"
    """the reward model (saved by reward.py with the Detail 15 normalisation folded in)"""
    critic_init: Literal["reward", "sft"] = "reward"
    """Detail 22: initialise the critic from the reward model (paper) or from the SFT model with a fresh head"""
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
    """Detail 23 (EOS trick): score given to a response that never emits EOS"""

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
    """Detail 7: no dropout in policy, reference, critic and RM, so that the first PPO ratio is exactly 1"""
    bf16: Optional[bool] = None
    """bf16 mixed precision, as the paper trained (Detail 8); None = on when a CUDA device supports bf16. The CPU
    runs float32 unless --bf16 asks for bf16 (slow; the tests use it to exercise the GPU's dtype path)"""

    # memory and speed (trlX / OpenRLHF)
    num_layers_unfrozen: int = -1
    """Hydra (trlX): the policy trains only its top N layers and the reference shares the frozen trunk; -1 = off"""
    lora_rank: int = 0
    """LoRA rank of the policy adapters (peft); the reference is the policy with adapters disabled; 0 = off"""
    lora_alpha: float = 16.0
    """LoRA scaling alpha (read only when --lora_rank > 0)"""
    offload: bool = False
    """keep the reference and reward models on CPU between uses (GPU runs; with ZeRO-3, DeepSpeed param offload)"""

    # evaluation and logging
    eval_every: int = 20
    """updates between evaluations (sample tables); 0 = only the final evaluation"""
    num_eval_samples: int = 256
    """validation queries per evaluation"""
    save_policy_every: int = 0
    """updates between policy snapshots (save_pretrained, for evaluation; not resumable) in
    {output_dir}/snapshots/update_N; 0 = only the final policy. Resumable checkpoints: --checkpoint_every"""
    print_sample_every: int = 10
    """updates between printed rollout samples; 0 = never"""

    ppo: PpoHParams = field(default_factory=PpoHParams)
    """PPO hyperparameters"""


# ---------------------------------------------------------------------------------------------
# PPO pieces (module-level so that tests can check each one against a hand computation)
# ---------------------------------------------------------------------------------------------


def shuffled_query_batches(num_rows: int, batch_size: int, seed: int, process_index: int, num_processes: int):
    """Detail 21: endless local index batches. Each pass over the split is a fresh permutation
    (sampling without replacement); the incomplete tail of a pass is dropped. Every rank draws the
    same permutation and takes its own slice of each global batch."""
    if num_rows < batch_size:
        raise ValueError(f"the query split has {num_rows} rows, fewer than one batch of {batch_size}")
    local_batch_size = exact_div(batch_size, num_processes, "total_batch_size across processes")
    data_pass = 0
    while True:
        permutation = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + data_pass))
        for start in range(0, num_rows - batch_size + 1, batch_size):
            local_start = start + process_index * local_batch_size
            yield permutation[local_start : local_start + local_batch_size]
        data_pass += 1


def action_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, pad_token_id: int):
    """Log-probabilities (B, T) of `tokens` under temperature-scaled logits (B, T, V), and the
    log-softmax itself. [PAD] is not an action: generation suppresses it, so it is removed here as
    well (the reference implementation lets the policy sample [PAD]; we do not)."""
    scaled = logits.float() / temperature
    scaled[..., pad_token_id] = float("-inf")
    all_logprobs = F.log_softmax(scaled, dim=-1)
    return torch.gather(all_logprobs, 2, tokens.unsqueeze(-1)).squeeze(-1), all_logprobs


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
    """Per-token estimate of KL(policy || reference) from samples of the policy.
    k1 = log p - log p_ref (unbiased, can be negative); k3 = (r - 1) - log r with r = p_ref / p
    (unbiased, always >= 0, lower variance; Schulman's estimator used by OpenRLHF)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}")


def per_token_rewards(scores, kl, mask, last_index, kl_coef):
    """Step 6: -kl_coef * KL on every kept response token, plus the sequence score at the last kept
    token (the EOS, or the last token when there is none); zero after the EOS."""
    non_score_reward = -kl_coef * kl * mask
    rewards = non_score_reward.clone()
    # Detail 22 / Figure 11: the score is the reward of the EOS action, the episode's last; the state after it
    # is terminal (compute_gae masks its value to 0), so the critic's reading at the EOS itself is never used.
    # The reference's final ppo.py puts the score one position later (EOS+1, the first [PAD]; the EOS when it
    # is the last token) and keeps and trains V(EOS+1), the critic's reading at the EOS. We follow Figure 11:
    # [PAD] is not an action, and nothing comes after the last one. At initialisation V(EOS+1) is the score
    # (the critic is the RM), so both give the same advantages; later, with gamma 1, they differ at the EOS
    # by (1 - lam) * (V(EOS+1) - score).
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
    """Clipped policy loss and clipped value loss (both masked means), and per-microbatch stats."""
    vpred_clipped = old_values + torch.clamp(vpred - old_values, -cliprange_value, cliprange_value)
    vf_losses_unclipped = (vpred - returns) ** 2
    vf_losses_clipped = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * masked_mean(torch.max(vf_losses_unclipped, vf_losses_clipped), mask)
    log_ratio = new_logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    pg_losses_unclipped = -advantages * ratio
    pg_losses_clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = masked_mean(torch.max(pg_losses_unclipped, pg_losses_clipped), mask)
    with torch.no_grad():
        stats = {
            "approxkl": 0.5 * masked_mean(log_ratio**2, mask),
            "pg_clipfrac": masked_mean((pg_losses_clipped > pg_losses_unclipped).float(), mask),
            "vf_clipfrac": masked_mean((vf_losses_clipped > vf_losses_unclipped).float(), mask),
            "ratio": masked_mean(ratio, mask),
        }
    return pg_loss, vf_loss, stats


def skip_frozen_actor_step(actor_params) -> None:
    """OpenRLHF (--ppo.freeze_actor_updates): a frozen actor takes no optimizer step at all. Called after
    backward and before optimizer.step(): the actor's gradients become None, and AdamW skips a parameter
    without a gradient (no step count, no moment update, no weight decay). Its AdamW state therefore stays
    as it was, and its first step after the freeze is the step of a run that never froze. The actor still
    takes part in backward, so DDP sees a gradient for every parameter."""
    for param in actor_params:
        param.grad = None


class AdaptiveKLController:
    """trlX / Ziegler et al. (2019): move kl_coef proportionally to the KL error, clipped to +-20%."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        self.value, self.target, self.horizon = init_kl_coef, target, horizon

    def update(self, current_kl: float, num_episodes: int) -> None:
        proportional_error = float(np.clip(current_kl / self.target - 1.0, -0.2, 0.2))
        self.value *= 1.0 + proportional_error * num_episodes / self.horizon

    # state_dict / load_state_dict let accelerate save the coefficient in a checkpoint
    # (register_for_checkpointing); target and horizon come from the flags
    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class RunningMoments:
    """trlX reward scaling: running mean / std of every score seen (parallel-variance merge).
    Feed it globally gathered scores so that all ranks hold the same statistics."""

    def __init__(self):
        self.mean, self.var, self.count = 0.0, 1.0, 1e-24

    def update(self, values: torch.Tensor) -> None:
        batch_mean = values.mean().item()
        batch_var = values.var(unbiased=False).item()
        batch_count = values.numel()
        delta = batch_mean - self.mean
        total = self.count + batch_count
        self.mean += delta * batch_count / total
        m2 = self.var * self.count + batch_var * batch_count + delta**2 * self.count * batch_count / total
        self.var = m2 / total
        self.count = total

    @property
    def std(self) -> float:
        return max(self.var, 0.0) ** 0.5

    # the statistics of every score seen so far go into checkpoints (register_for_checkpointing)
    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The stack of transformer blocks of a causal LM (GPT-NeoX `layers`, GPT-2 `h`, ...)."""
    backbone = getattr(model, model.base_model_prefix)
    for name in ("layers", "h", "blocks"):
        layers = getattr(backbone, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} for Hydra")


def build_hydra_reference(policy: nn.Module, num_layers_unfrozen: int) -> nn.Module:
    """Hydra (trlX): freeze the embeddings and the bottom layers of the policy, and build the reference
    as a model that SHARES those frozen modules with the policy and owns frozen copies of the top
    `num_layers_unfrozen` layers, the final norm and the LM head. The trunk exists once in memory.
    (trlX also reuses the trunk's activations; here the reference recomputes them, which keeps the
    code model-agnostic at the cost of compute, not memory.)"""
    layers = decoder_layers(policy)
    if not 1 <= num_layers_unfrozen <= len(layers):
        raise ValueError(f"--num_layers_unfrozen must be in [1, {len(layers)}], got {num_layers_unfrozen}")
    num_frozen = len(layers) - num_layers_unfrozen
    shared = [policy.get_input_embeddings()] + list(layers[:num_frozen])
    for module in shared:
        module.requires_grad_(False)
    # deepcopy with a memo that maps each shared module to itself: those are reused, not copied
    memo = {id(module): module for module in shared}
    reference = copy.deepcopy(policy, memo)
    reference.requires_grad_(False)
    return reference.eval()


class PolicyAndValue(nn.Module):
    """Policy and critic in one module, so that one `accelerator.prepare` (DDP / DeepSpeed) and one
    optimizer hold both, and one forward serves the PPO loss (and the ptx loss)."""

    def __init__(self, policy: nn.Module, critic: nn.Module):
        super().__init__()
        self.policy = policy
        self.critic = critic

    def forward(self, query_responses: torch.Tensor, pad_token_id: int, context_length: int, ptx_query_responses=None):
        logits = forward(self.policy, query_responses, pad_token_id).logits  # (B, T, V)
        values, _, _ = get_reward(self.critic, query_responses, pad_token_id, context_length)  # (B, T) per-token values
        ptx_logits = None
        if ptx_query_responses is not None:
            ptx_logits = forward(self.policy, ptx_query_responses, pad_token_id).logits
        return logits, values, ptx_logits


def sft_loss(logits: torch.Tensor, labels: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """PPO-ptx: next-token NLL on the reference-summary tokens (labels are [PAD] elsewhere)."""
    targets = labels[:, 1:]
    logprobs = torch.gather(F.log_softmax(logits[:, :-1].float(), dim=-1), 2, targets.unsqueeze(-1)).squeeze(-1)
    return -masked_mean(logprobs, targets != pad_token_id)


def shape_rewards(args, data: dict, eos_token_id: int, pad_token_id: int, kl_coef: float, reward_moments, gather):
    """Steps 5-9 on a local rollout batch: mask after the EOS, EOS trick, optional reward scaling and
    clipping, per-token KL penalty with the score at the EOS, optional reward whitening, GAE, then
    advantage whitening. `gather` collects a tensor across ranks (for the running reward statistics)."""
    responses = data["responses"]
    mask, last_index = response_mask(responses, pad_token_id)  # kept tokens: up to and including the EOS
    scores = data["scores"]
    contains_eos = (responses == eos_token_id).any(1)
    if args.non_eos_penalty:  # 5. Detail 23: EOS trick
        scores, contains_eos = apply_eos_trick(scores, responses, eos_token_id, args.penalty_reward_value)
    if args.ppo.scale_rewards:  # trlX: running-std scaling, statistics over all ranks
        reward_moments.update(gather(scores))
        scores = scores / max(reward_moments.std, 1e-8)
    if args.ppo.reward_clip is not None:
        scores = torch.clamp(scores, -args.ppo.reward_clip, args.ppo.reward_clip)
    # 6. per-token KL penalty and the score at the EOS; everything after the EOS is masked
    kl = kl_per_token(data["logprobs"], data["ref_logprobs"], args.ppo.kl_estimator) * mask
    rewards, non_score_reward = per_token_rewards(scores, kl, mask, last_index, kl_coef)
    # whitening statistics of the global rollout batch: summing over processes = summing the gathered copies
    sum_over_processes = (lambda x: gather(x.reshape(1)).sum()) if args.ppo.whiten_across_processes else None
    if args.ppo.whiten_rewards:  # 7. Detail 24 (optional)
        rewards = masked_whiten(rewards, mask, shift_mean=False, sum_over_processes=sum_over_processes)
    values = data["values"] * mask
    advantages, returns = compute_gae(rewards, values, mask, args.ppo.gamma, args.ppo.lam)  # 8.
    if args.ppo.whiten_advantages:  # 9. Detail 25
        advantages = masked_whiten(advantages, mask, sum_over_processes=sum_over_processes)
    return {"mask": mask, "last_index": last_index, "scores": scores, "contains_eos": contains_eos, "kl": kl,
            "non_score_reward": non_score_reward, "rewards": rewards, "values": values,
            "advantages": advantages, "returns": returns}


def policy_value_forward(model, query_responses, context_length: int, temperature: float, pad_token_id: int,
                         ptx_query_responses=None):
    """The training-time forward: temperature-scaled logprobs of the responses (B, T), the full
    log-softmax (B, T, V), the values (B, T) of the state before each response token, ptx logits."""
    logits, full_values, ptx_logits = model(query_responses, pad_token_id, context_length, ptx_query_responses)
    new_logprobs, all_logprobs = action_logprobs(
        logits[:, context_length - 1 : -1], query_responses[:, context_length:], temperature, pad_token_id
    )
    return new_logprobs, all_logprobs, full_values[:, context_length - 1 : -1].float(), ptx_logits


@contextlib.contextmanager
def placed_on(model: nn.Module, device: torch.device, offload: bool):
    """--offload: keep a frozen model on CPU and bring it to the accelerator only while it is used."""
    if offload:
        model.to(device)
    try:
        yield model
    finally:
        if offload:
            model.to("cpu")


def reference_logits(ref_policy, policy, query_responses, pad_token_id):
    """Reference policy logits: a separate (or Hydra) frozen model, or the LoRA policy with its adapters off."""
    if ref_policy is None:
        with policy.disable_adapter():
            return forward(policy, query_responses, pad_token_id).logits
    return forward(ref_policy, query_responses, pad_token_id).logits


@torch.no_grad()
def rollout(args, accelerator, model, ref_policy, reward_model, queries, tokenizer, generation_config, timers):
    """Steps 2-5 for one local batch, in chunks of local_rollout_forward_batch_size. Returns the raw
    (untruncated) query_responses, the truncated responses, temperature-scaled logprobs of policy and
    reference, critic values (B, T_response) and RM scores (B,) before the EOS trick."""
    unwrapped = accelerator.unwrap_model(model)
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    context_length = queries.size(1)
    out = {k: [] for k in ("query_responses", "responses", "logprobs", "ref_logprobs", "values", "scores")}
    for start in range(0, queries.size(0), args.local_rollout_forward_batch_size):
        query = queries[start : start + args.local_rollout_forward_batch_size]
        t0 = time.time()
        # 2. fixed-length sampling with the KV cache; EOS can be sampled but never stops generation
        query_response, _ = generate(unwrapped.policy, query, pad_id, generation_config)
        t1 = time.time()
        response = query_response[:, context_length:]  # (b, T)
        # temperature-scaled logprobs from a full forward pass: the same computation as the PPO update,
        # so the first ratio is exactly 1 without dropout (Detail 7)
        logits = forward(unwrapped.policy, query_response, pad_id).logits[:, context_length - 1 : -1]
        logprob, _ = action_logprobs(logits, response, args.temperature, pad_id)
        del logits
        ref_model = ref_policy if ref_policy is not None else unwrapped.policy
        with placed_on(ref_model, accelerator.device, args.offload and ref_policy is not None):
            ref_logits = reference_logits(ref_policy, unwrapped.policy, query_response, pad_id)
        ref_logprob, _ = action_logprobs(ref_logits[:, context_length - 1 : -1], response, args.temperature, pad_id)
        del ref_logits
        # 3. truncate after the first EOS; 4. RM score at the EOS (Detail 12)
        truncated = truncate_response(eos_id, pad_id, response)
        with placed_on(reward_model, accelerator.device, args.offload):
            _, score, _ = get_reward(reward_model, torch.cat((query, truncated), 1), pad_id, context_length)
        full_values, _, _ = get_reward(unwrapped.critic, query_response, pad_id, context_length)
        timers["generation"] += t1 - t0
        timers["scoring"] += time.time() - t1
        out["query_responses"].append(query_response)
        out["responses"].append(truncated)
        out["logprobs"].append(logprob)
        out["ref_logprobs"].append(ref_logprob)
        out["values"].append(full_values[:, context_length - 1 : -1].float())  # V(state before each token)
        out["scores"].append(score.float())
    return {k: torch.cat(v, 0) for k, v in out.items()}


@torch.no_grad()
def evaluate(args, accelerator, model, reward_model, eval_dataset, tokenizer, generation_config):
    """Sample the first num_eval_samples validation queries (split evenly across ranks so that every
    rank runs the same number of generate calls), score them and return the rows of the sample table."""
    unwrapped = accelerator.unwrap_model(model)
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    per_rank = min(args.num_eval_samples, len(eval_dataset)) // accelerator.num_processes
    start_row = accelerator.process_index * per_rank
    rows = []
    for start in range(start_row, start_row + per_rank, args.local_rollout_forward_batch_size):
        batch = eval_dataset[start : min(start + args.local_rollout_forward_batch_size, start_row + per_rank)]
        query = torch.tensor(batch["query_token"], device=accelerator.device)
        context_length = query.size(1)
        query_response, _ = generate(unwrapped.policy, query, pad_id, generation_config)
        truncated = truncate_response(eos_id, pad_id, query_response[:, context_length:])
        with placed_on(reward_model, accelerator.device, args.offload):
            _, score, _ = get_reward(reward_model, torch.cat((query, truncated), 1), pad_id, context_length)
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
                }
            )
    return gather_object(rows)


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


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the positions where mask is True."""
    return (values * mask).sum() / mask.sum()


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, sum_over_processes=None) -> torch.Tensor:
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


def load_models(args, tokenizer, bf16: bool):
    """The four models of PPO: the policy (from the SFT model), the critic (Detail 22: from the reward model by
    default), the frozen reward model, and the frozen reference policy (a copy of the SFT model; a Hydra head
    that shares the policy's frozen trunk; or None with LoRA, where the reference is the policy with its
    adapters off)."""
    frozen_dtype = torch.bfloat16 if bf16 else torch.float32
    policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, trust_remote_code=args.trust_remote_code)
    critic_path = args.reward_model_path if args.critic_init == "reward" else args.sft_model_path
    # Detail 22: the critic starts as the reward model (a per-token RM); "sft" gets a fresh scalar head
    critic = AutoModelForSequenceClassification.from_pretrained(
        critic_path, num_labels=1, trust_remote_code=args.trust_remote_code
    )
    reward_model = AutoModelForSequenceClassification.from_pretrained(
        args.reward_model_path, num_labels=1, dtype=frozen_dtype, trust_remote_code=args.trust_remote_code
    )
    for model in (policy, critic, reward_model):
        # the config's row count, not the weight's shape: ZeRO-3 partitions weights as they load
        if model.config.vocab_size < len(tokenizer):
            model.resize_token_embeddings(len(tokenizer))
    if args.disable_dropout:  # Detail 7
        for model in (policy, critic, reward_model):
            disable_dropout(model)
    reward_model.requires_grad_(False).eval()
    if args.lora_rank > 0:
        policy = get_peft_model(
            policy,
            LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules="all-linear"),
        )
        ref_policy = None  # the reference is the policy with its adapters disabled
    elif args.num_layers_unfrozen >= 0:
        ref_policy = build_hydra_reference(policy, args.num_layers_unfrozen)
    else:
        ref_policy = AutoModelForCausalLM.from_pretrained(
            args.sft_model_path, dtype=frozen_dtype, trust_remote_code=args.trust_remote_code
        )
        if ref_policy.config.vocab_size < len(tokenizer):
            ref_policy.resize_token_embeddings(len(tokenizer))
        disable_dropout(ref_policy)  # the reference never trains: its logprobs must be deterministic
        ref_policy.requires_grad_(False).eval()
    return policy, critic, reward_model, ref_policy


def sampling_config(args, tokenizer, temperature: float) -> GenerationConfig:
    """Detail 23: exactly response_length tokens. eos_token_id=[] removes the stop criterion while EOS stays a
    normal token that can be sampled (min_new_tokens would forbid it). [PAD] is not an action."""
    return GenerationConfig(
        max_new_tokens=args.response_length, temperature=temperature, top_k=0, top_p=1.0, do_sample=True,
        eos_token_id=[], pad_token_id=tokenizer.pad_token_id, suppress_tokens=[tokenizer.pad_token_id],
    )


def main(args: Args) -> dict:
    start_time = time.time()
    bf16 = args.bf16 if args.bf16 is not None else (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    start_processes()  # first: the batch arithmetic below depends on the number of processes
    accelerator = Accelerator(mixed_precision="bf16" if bf16 else "no")
    # ---------------- batch arithmetic (fails loudly) ----------------
    num_processes = accelerator.num_processes
    local_batch_size = exact_div(args.total_batch_size, num_processes, "total_batch_size across processes")
    local_mini_batch_size = exact_div(local_batch_size, args.ppo.num_mini_batches, "local batch across minibatches")
    gradient_accumulation_steps = exact_div(local_mini_batch_size, args.local_micro_batch_size, "local minibatch")
    accelerator.gradient_accumulation_steps = gradient_accumulation_steps
    configure_deepspeed(accelerator, args.local_micro_batch_size)  # Detail 8 (no-op without DeepSpeed)
    num_updates = args.total_episodes // args.total_batch_size
    deepspeed_plugin = accelerator.state.deepspeed_plugin
    zero3 = deepspeed_plugin is not None and deepspeed_plugin.zero_stage == 3
    check_flags(args, num_processes, gradient_accumulation_steps, num_updates, zero3)
    run = Run(args, accelerator)  # run name and folder; see the run infrastructure below main

    # ---------------- seeding (labelled, deliberate) ----------------
    set_seed(args.seed)  # weights (fresh critic head) and data order: identical on every rank
    local_seed = args.seed + accelerator.process_index * 100003  # sampling differs per rank

    # ---------------- tokenizer and models ----------------
    tokenizer = load_tokenizer(args)  # Detail 3: [PAD] distinct from EOS
    check_reward_tokenizer(tokenizer, args.sft_model_path, args.reward_model_path, args.trust_remote_code)
    policy, critic, reward_model, ref_policy = load_models(args, tokenizer, bf16)
    model = PolicyAndValue(policy, critic)
    actor_params = [p for p in policy.parameters() if p.requires_grad]
    critic_params = [p for p in critic.parameters() if p.requires_grad]
    # two groups so that the actor can be frozen while the critic warms up (OpenRLHF, --ppo.freeze_actor_updates)
    optimizer = torch.optim.AdamW(
        [{"params": actor_params}, {"params": critic_params}], lr=args.lr, eps=args.eps, weight_decay=args.weight_decay
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    device = accelerator.device
    # the frozen models need no optimizer state (Detail 8): see place_frozen_models
    reward_model, ref_policy, args_for_rollout = place_frozen_models(args, accelerator, reward_model, ref_policy, zero3)

    # ---------------- data ----------------
    train_dataset, eval_dataset = load_query_data(args, tokenizer)
    run.claim_output_dir()  # every input check has passed: only now mark --output_dir as this run's
    query_tokens = torch.tensor(train_dataset["query_token"])  # (N, query_length), left-padded
    context_length = query_tokens.size(1)
    batches = shuffled_query_batches(
        len(train_dataset), args.total_batch_size, args.seed, accelerator.process_index, num_processes
    )
    if args.ppo.ptx_coef > 0:
        ptx_tokens = torch.tensor(train_dataset["query_reference_response_token"])
        ptx_labels = torch.tensor(train_dataset["query_reference_response_token_response_label"])
        ptx_batches = shuffled_query_batches(
            len(train_dataset), args.local_micro_batch_size * num_processes, args.seed + 7919,
            accelerator.process_index, num_processes,
        )
    # sampling seed is set after the models exist, so model init stays identical across ranks
    random.seed(local_seed)
    np.random.seed(local_seed)
    torch.manual_seed(local_seed)
    generation_config = sampling_config(args, tokenizer, args.temperature)
    eval_generation_config = sampling_config(args, tokenizer, args.eval_temperature)

    # ---------------- stateful PPO pieces and resume ----------------
    kl_controller = AdaptiveKLController(args.ppo.kl_coef, args.ppo.target_kl, args.ppo.kl_horizon)
    reward_moments = RunningMoments()
    # saved and restored with the models, the optimizer and the RNG states. The learning rate needs no entry:
    # it is a function of the update number (see the loop)
    accelerator.register_for_checkpointing(kl_controller)
    accelerator.register_for_checkpointing(reward_moments)
    # the trainer state: the data position is the number of index batches drawn from each sampler (replaying
    # that many draws puts the samplers where they were); the totals and last metrics feed the summary
    state = run.start({"update": 0, "query_batches_drawn": 0, "ptx_batches_drawn": 0, "wall_time_s": 0.0,
                       "totals": {"generation": 0.0, "scoring": 0.0, "training": 0.0, "wall": 0.0}, "metrics": {}},
                      num_updates=num_updates, total_batch_size=args.total_batch_size)
    start_update = state["update"]
    start_time -= state["wall_time_s"]  # wall_time_s of the summary counts the interrupted run too
    drawn = {"query": 0, "ptx": 0}  # index batches drawn so far from each sampler

    def next_query_batch() -> torch.Tensor:
        drawn["query"] += 1
        return next(batches)

    def next_ptx_batch() -> torch.Tensor:
        drawn["ptx"] += 1
        return next(ptx_batches)

    for _ in range(state["query_batches_drawn"]):
        next_query_batch()  # the data position: replay the draws of the updates already done
    for _ in range(state["ptx_batches_drawn"] if args.ppo.ptx_coef > 0 else 0):
        next_ptx_batch()
    totals, metrics = dict(state["totals"]), dict(state["metrics"])

    def trainer_state() -> dict:
        return {"query_batches_drawn": drawn["query"], "ptx_batches_drawn": drawn["ptx"],
                "wall_time_s": time.time() - start_time, "totals": dict(totals), "metrics": dict(metrics)}

    def run_evaluation(tag: str):
        table = pd.DataFrame(evaluate(args_for_rollout, accelerator, model, reward_model, eval_dataset, tokenizer,
                                      eval_generation_config))
        run.save_table(table, f"samples/{tag}.csv")
        return {"eval/score": float(table["score"].mean()), "eval/eos_rate": float(table["has_eos"].mean()),
                "eval/response_token_len_mean": float(table["response_token_len"].mean())}, table

    K, nmb, ga = args.ppo.num_ppo_epochs, args.ppo.num_mini_batches, gradient_accumulation_steps
    accelerator.print(
        f"PPO: {num_updates} updates of {args.total_batch_size} episodes ({num_processes} processes x {local_batch_size}); "
        f"{K} epochs x {nmb} minibatches x {ga} micro batches of {args.local_micro_batch_size}"
    )
    progress = tqdm(range(start_update + 1, num_updates + 1), initial=start_update, total=num_updates,
                    disable=not accelerator.is_local_main_process)
    update, optimizer_steps = start_update, 0
    try:
        for update in progress:
            # what a checkpoint holds besides the weights and AdamW, as it stands after update - 1: put back if
            # this update's rollout turns out non-finite (see recover_from_non_finite)
            last_good = {"rng": rng_states(), "accelerator_step": accelerator.step, "kl": kl_controller.state_dict(),
                         "moments": reward_moments.state_dict(), "trainer_state": trainer_state()}
            optimizer_steps = 0  # optimizer steps of this update (the weights change from the first one on)
            update_start = time.time()
            timers = {"generation": 0.0, "scoring": 0.0}
            # linear decay to 0 over the run (Table 7). A frozen actor (OpenRLHF) takes no step: see
            # skip_frozen_actor_step; its lr of 0 is what keeps its weights under DeepSpeed
            lr_now = args.lr * (1.0 - (update - 1.0) / num_updates) if args.scheduler == "linear" else args.lr
            actor_frozen = update <= args.ppo.freeze_actor_updates
            optimizer.param_groups[0]["lr"] = 0.0 if actor_frozen else lr_now
            optimizer.param_groups[1]["lr"] = lr_now

            # ---------------- rollout: steps 1-5 ----------------
            model.eval()  # rollouts sample without dropout; with Detail 7 (dropout off) train() and eval() agree
            queries = query_tokens[next_query_batch()].to(device)  # 1. Detail 21
            with accelerator.autocast():
                data = rollout(args_for_rollout, accelerator, model, ref_policy, reward_model, queries, tokenizer,
                               generation_config, timers)
            t_post = time.time()
            with torch.no_grad():
                # ---------------- steps 5-9: EOS trick, KL penalty, GAE, whitening ----------------
                kl_coef = kl_controller.value if args.ppo.adaptive_kl else args.ppo.kl_coef
                shaped = shape_rewards(args, data, tokenizer.eos_token_id, tokenizer.pad_token_id, kl_coef,
                                       reward_moments, accelerator.gather)
                responses, logprobs, mask = data["responses"], data["logprobs"], shaped["mask"]
                kl, scores, non_score_reward = shaped["kl"], shaped["scores"], shaped["non_score_reward"]
                values, advantages, returns = shaped["values"], shaped["advantages"], shaped["returns"]
                rewards, contains_eos = shaped["rewards"], shaped["contains_eos"]
                # non-finite guard on the rollout, before any optimizer step uses it. The raw RM scores are
                # checked themselves: the EOS trick would hide a NaN score of a response without EOS.
                run.guard(update, **{"rollout/rm_scores": data["scores"], "rollout/rewards": rewards,
                                     "rollout/advantages": advantages})
                # rollout statistics, per episode then averaged over the global batch
                kl_sum = accelerator.gather(kl.sum(1))
                if args.ppo.adaptive_kl:
                    kl_controller.update(kl_sum.mean().item(), args.total_batch_size)
                entropy_sum = accelerator.gather((-logprobs * mask).sum(1))
                non_score_sum = accelerator.gather(non_score_reward.sum(1))
                all_scores = accelerator.gather(scores)
                all_eos = accelerator.gather(contains_eos.float())
            timers["scoring"] += time.time() - t_post

            # ---------------- PPO update: K epochs x minibatches x micro batches ----------------
            t_train = time.time()
            model.train()
            stat_names = ("approxkl", "pg_clipfrac", "pg_loss", "vf_loss", "vf_clipfrac", "entropy", "ratio",
                          "ptx_loss")
            stats = {name: torch.zeros((K, nmb, ga), device=device) for name in stat_names}
            query_responses = data["query_responses"]
            for epoch in range(K):
                permutation = torch.randperm(local_batch_size, device=device)
                for mb, mb_start in enumerate(range(0, local_batch_size, local_mini_batch_size)):
                    mb_indices = permutation[mb_start : mb_start + local_mini_batch_size]
                    for micro, micro_start in enumerate(range(0, local_mini_batch_size, args.local_micro_batch_size)):
                        with accelerator.accumulate(model):
                            idx = mb_indices[micro_start : micro_start + args.local_micro_batch_size]
                            ptx_input = None
                            if args.ppo.ptx_coef > 0:
                                ptx_idx = next_ptx_batch()
                                ptx_input = ptx_tokens[ptx_idx].to(device)
                            new_logprobs, all_logprobs, vpred, ptx_logits = policy_value_forward(
                                model, query_responses[idx], context_length, args.temperature, tokenizer.pad_token_id,
                                ptx_input,
                            )
                            pg_loss, vf_loss, mb_stats = ppo_losses(
                                new_logprobs, logprobs[idx], advantages[idx], vpred, values[idx], returns[idx],
                                mask[idx], args.ppo.cliprange, args.ppo.cliprange_value,
                            )
                            # frozen actor: the policy term is multiplied by 0 (not dropped) so that DDP still
                            # sees a gradient for every parameter; the actor's gradients are dropped before the step
                            loss = (0.0 if actor_frozen else 1.0) * pg_loss + args.ppo.vf_coef * vf_loss
                            ptx_loss = torch.zeros((), device=device)
                            if ptx_logits is not None:
                                ptx_loss = sft_loss(ptx_logits, ptx_labels[ptx_idx].to(device), tokenizer.pad_token_id)
                                loss = loss + args.ppo.ptx_coef * ptx_loss
                            # non-finite guard: checked before backward, so the optimizer never applies it
                            run.guard(update, **{f"ppo/loss (epoch {epoch + 1}, minibatch {mb + 1})": loss})
                            accelerator.backward(loss)
                            # a frozen actor takes no step. Under DeepSpeed the engine steps inside
                            # accelerator.backward, on its own copies of the weights: there the actor's lr of 0 and
                            # zero policy gradient keep its weights, while its AdamW state counts the frozen steps
                            if actor_frozen and deepspeed_plugin is None:
                                skip_frozen_actor_step(actor_params)
                            optimizer.step()  # a no-op until the last micro batch of the minibatch
                            optimizer.zero_grad()
                            optimizer_steps += int(accelerator.sync_gradients)
                            with torch.no_grad():
                                probs = all_logprobs.exp()
                                token_entropy = -(probs * torch.where(probs > 0, all_logprobs, 0.0)).sum(-1)
                                for name, value in mb_stats.items():
                                    stats[name][epoch, mb, micro] = value
                                stats["pg_loss"][epoch, mb, micro] = pg_loss.detach()
                                stats["vf_loss"][epoch, mb, micro] = vf_loss.detach()
                                stats["entropy"][epoch, mb, micro] = masked_mean(token_entropy, mask[idx])
                                stats["ptx_loss"][epoch, mb, micro] = ptx_loss.detach()
            timers["training"] = time.time() - t_train
            update_time = time.time() - update_start
            for key in ("generation", "scoring", "training"):
                totals[key] += timers[key]
            totals["wall"] += update_time

            # ---------------- logging: whole-update averages gathered across ranks ----------------
            with torch.no_grad():
                gathered = {name: accelerator.gather(value) for name, value in stats.items()}
                num_eos_tokens = accelerator.gather((responses == tokenizer.eos_token_id).sum().unsqueeze(0)).sum()
            episode = update * args.total_batch_size
            metrics = {
                "episode": episode,
                "lr": lr_now,
                "objective/kl": kl_sum.mean().item(),
                "objective/kl_coef": kl_coef,
                "objective/entropy": entropy_sum.mean().item(),
                "objective/non_score_reward": non_score_sum.mean().item(),
                "objective/rlhf_reward": non_score_sum.mean().item() + all_scores.mean().item(),
                "objective/scores": all_scores.mean().item(),
                "objective/eos_rate": all_eos.mean().item(),
                "ppo/policy/approxkl_avg": gathered["approxkl"].mean().item(),
                "ppo/policy/clipfrac_avg": gathered["pg_clipfrac"].mean().item(),
                "ppo/policy/entropy_avg": gathered["entropy"].mean().item(),
                "ppo/loss/policy_avg": gathered["pg_loss"].mean().item(),
                "ppo/loss/value_avg": gathered["vf_loss"].mean().item(),
                "ppo/loss/ptx_avg": gathered["ptx_loss"].mean().item(),
                "ppo/val/clipfrac_avg": gathered["vf_clipfrac"].mean().item(),
                "ppo/val/ratio": gathered["ratio"].mean().item(),
                "ppo/val/ratio_var": gathered["ratio"].var(unbiased=False).item(),
                "ppo/val/num_eos_tokens": num_eos_tokens.item(),
                "episodes_per_second": args.total_batch_size / update_time,
                "time/generation_share": timers["generation"] / update_time,
                "time/scoring_share": timers["scoring"] / update_time,
                "time/training_share": timers["training"] / update_time,
            }
            run.log(update, metrics)
            progress.set_postfix(score=f"{metrics['objective/scores']:.3f}", kl=f"{metrics['objective/kl']:.2f}",
                                 eps=f"{metrics['episodes_per_second']:.1f}")
            if args.print_sample_every > 0 and update % args.print_sample_every == 0:
                accelerator.print(
                    f"[update {update}] score {scores[0].item():.3f} | "
                    + tokenizer.decode(responses[0], skip_special_tokens=True)
                )
            if args.eval_every > 0 and update % args.eval_every == 0 and update < num_updates:
                eval_metrics, _ = run_evaluation(f"step_{update:06d}")
                run.log(update, {"episode": episode, **eval_metrics})
            if args.save_policy_every > 0 and update % args.save_policy_every == 0 and update < num_updates:
                save_policy(accelerator, model, tokenizer,
                            os.path.join(args.output_dir, "snapshots", f"update_{update:06d}"), args.lora_rank > 0)
            del data, query_responses, rewards, advantages, returns, values
            # resumable checkpoint, after this update's logging and evaluation: a resumed run starts with the
            # next update, with the RNG states as they are now (not at the final update: the model is saved)
            if args.checkpoint_every > 0 and update % args.checkpoint_every == 0 and update < num_updates:
                run.checkpoint(update, trainer_state())
    except NonFiniteError:
        recover_from_non_finite(run, accelerator, update, optimizer_steps, last_good, kl_controller, reward_moments)
        raise
    progress.close()

    # ---------------- final evaluation and outputs ----------------
    eval_metrics, table = run_evaluation(f"step_{num_updates:06d}")
    run.log(num_updates, {"episode": num_updates * args.total_batch_size, **eval_metrics})
    save_policy(accelerator, model, tokenizer, args.output_dir, args.lora_rank > 0)
    summary = {
        **eval_metrics,
        **{k: v for k, v in metrics.items() if k.startswith("objective/")},
        "episodes": num_updates * args.total_batch_size,
        "episodes_per_second": num_updates * args.total_batch_size / totals["wall"],
        "time/generation_share": totals["generation"] / totals["wall"],
        "time/scoring_share": totals["scoring"] / totals["wall"],
        "time/training_share": totals["training"] / totals["wall"],
        "wall_time_s": time.time() - start_time,
    }
    run.save_table(table, "samples.csv")
    run.finish(summary)
    if accelerator.is_main_process and args.push_to_hub:
        accelerator.unwrap_model(model).policy.push_to_hub(args.hub_model_id or args.run_name)
        tokenizer.push_to_hub(args.hub_model_id or args.run_name)
    accelerator.print(json.dumps(summary, indent=2))
    return summary


# =============================================================================================
# RUN INFRASTRUCTURE: TRY NOT TO MODIFY. The algorithm ends here. What follows serves main() without
# being part of the algorithm: flag and input checks, processes and DeepSpeed, output folders, logging,
# checkpoints and resume, the non-finite guard, saving. (Python looks these names up when main runs.)
# =============================================================================================


def check_flags(args, num_processes: int, gradient_accumulation_steps: int, num_updates: int, zero3: bool) -> None:
    """Flag combinations that cannot work, refused before anything is loaded."""
    if args.gradient_accumulation_steps is not None and args.gradient_accumulation_steps != gradient_accumulation_steps:
        raise ValueError(
            f"--gradient_accumulation_steps {args.gradient_accumulation_steps} does not match total_batch_size "
            f"{args.total_batch_size} / ({num_processes} processes x {args.ppo.num_mini_batches} minibatches x "
            f"{args.local_micro_batch_size} micro batch) = {gradient_accumulation_steps}"
        )
    if num_updates < 1:
        raise ValueError(f"total_episodes {args.total_episodes} is less than one batch of {args.total_batch_size}")
    if args.lora_rank > 0 and args.num_layers_unfrozen >= 0:
        raise ValueError("choose one of --lora_rank and --num_layers_unfrozen (each builds its own reference)")
    if args.offload and args.num_layers_unfrozen >= 0:
        raise ValueError("--offload cannot move a Hydra reference: it shares its trunk with the policy")
    if zero3 and args.num_layers_unfrozen >= 0:
        raise ValueError("Hydra shares modules between policy and reference, which ZeRO-3 cannot partition")


def load_tokenizer(args):
    """The SFT model's tokenizer with a [PAD] distinct from EOS (Detail 3)."""
    tokenizer = AutoTokenizer.from_pretrained(args.sft_model_path, trust_remote_code=args.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})  # Detail 3: pad distinct from EOS
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        # Detail 3/23: truncation fills after the EOS with [PAD] and the RM reads the score at the last token
        # before the first [PAD]; with [PAD] == EOS the EOS itself would be taken for padding
        raise ValueError(
            f"the tokenizer of {args.sft_model_path} pads with its EOS token {tokenizer.eos_token!r}; PPO needs a "
            "distinct pad token to find the EOS of a response (Details 3 and 23). Save the tokenizer with "
            "tokenizer.add_special_tokens({'pad_token': '[PAD]'}) (or one without a pad token) and prepare the data "
            "with it (an SFT model of the sft.py --pad_token eos ablation cannot be trained with PPO)"
        )
    return tokenizer


def load_query_data(args, tokenizer):
    """The query splits, checked for the columns this run reads and for the tokenizer that made them."""
    train_dataset = load_split(args.query_dataset, args.train_split)
    eval_dataset = load_split(args.query_dataset, args.eval_split)
    ptx_columns = ["query_reference_response_token", "query_reference_response_token_response_label"]
    check_columns(train_dataset, ["query_token"] + (ptx_columns if args.ppo.ptx_coef > 0 else []),
                  f"{args.query_dataset} split {args.train_split!r}")
    check_columns(eval_dataset, ["query_token", "reference_response"],
                  f"{args.query_dataset} split {args.eval_split!r}")
    for split, dataset in ((args.train_split, train_dataset), (args.eval_split, eval_dataset)):
        check_data_tokenizer(dataset, tokenizer, args.sft_model_path, f"{args.query_dataset} split {split!r}")
    return train_dataset, eval_dataset


def place_frozen_models(args, accelerator, reward_model, ref_policy, zero3: bool):
    """The reward model and the reference policy: placed on the device, kept on the CPU between uses (--offload),
    or under ZeRO-3 partitioned in a DeepSpeed inference engine that offloads them itself (Detail 8). Returns
    them and the args rollout() reads (its --offload means "move the models by hand around each use")."""
    device = accelerator.device
    reward_model = prepare_frozen_model(accelerator, reward_model, offload=args.offload)
    if args.num_layers_unfrozen >= 0:
        ref_policy.to(device)  # Hydra: the reference shares the policy's frozen trunk
    elif ref_policy is not None:
        ref_policy = prepare_frozen_model(accelerator, ref_policy, offload=args.offload)
    args_for_rollout = copy.copy(args)
    args_for_rollout.offload = args.offload and not zero3 and device.type != "cpu"
    if args.offload and not zero3 and device.type == "cpu":
        accelerator.print("--offload: no accelerator present, models already live on CPU")
    return reward_model, ref_policy, args_for_rollout


def recover_from_non_finite(run, accelerator, update, optimizer_steps, last_good, kl_controller, reward_moments):
    """After the non-finite guard fired in `update`: keep the last good state as a checkpoint, if there is one."""
    if optimizer_steps == 0:
        # no optimizer step of this update happened: the weights and AdamW are those after update - 1. Put back
        # what the rollout already moved (RNG, KL controller, reward statistics, accumulation counter, counters)
        # and save them as the last good checkpoint; the poisoned rollout is not in it.
        set_rng_states(last_good["rng"])
        accelerator.step = last_good["accelerator_step"]
        kl_controller.load_state_dict(last_good["kl"])
        reward_moments.load_state_dict(last_good["moments"])
        run.checkpoint(update - 1, last_good["trainer_state"])
        accelerator.print(f"non-finite value at update {update} before any optimizer step of it; "
                          f"last good checkpoint: {run.latest_checkpoint()}")
    else:
        # some minibatch steps of this update already changed the weights: they are not saved
        accelerator.print(
            f"non-finite value at update {update} after {optimizer_steps} optimizer step(s) of it had already "
            f"changed the weights; those weights are NOT saved. Last good checkpoint: "
            f"{run.latest_checkpoint() or 'none (no --checkpoint_every checkpoint was written before it)'}"
        )


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


def save_policy(accelerator, model, tokenizer, path: str, lora: bool) -> None:
    """save_pretrained (safetensors) of the policy (LoRA adapters merged) and the tokenizer."""
    state_dict = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards
    if not accelerator.is_main_process:
        return
    policy = accelerator.unwrap_model(model).policy
    if lora:
        merged = copy.deepcopy(policy).merge_and_unload()
        merged.save_pretrained(path, safe_serialization=True)
    else:
        policy_state = {k[len("policy.") :]: v for k, v in state_dict.items() if k.startswith("policy.")}
        policy.save_pretrained(path, state_dict=policy_state, safe_serialization=True)
    tokenizer.save_pretrained(path)


def rng_states() -> dict:
    """The random states accelerate's save_state writes (Python, NumPy, torch CPU, CUDA). Taken at the
    start of each update, so that after a non-finite rollout the last good checkpoint can be written
    exactly as the previous update would have written it."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    """Put back the random states taken by rng_states()."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])


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
