"""Implicit Language Q-Learning (ILQL), the offline RLHF alternative of trlX, on TL;DR preference pairs.

trlX ("A Framework for Large Scale RLHF", Havrilla et al., Sec. 4.1 and 4.2) trains ILQL (Snell et al.)
OFFLINE: no sampling during training and no reward model in the loop. Every preference pair
(x, y_chosen, y_rejected) gives two trajectories, (x, y_chosen) with reward +1 and (x, y_rejected)
with reward -1; the reward sits on the last response token (the EOS). The paper reports that these
+-1 labels beat labelling the same responses with the learned RM ("RM rewards are denser, but the
inequality r_chosen > r_rejected is sometimes not respected"); `--reward_source rm` is that variant.

The model is the causal LM plus small heads on its final hidden state h(s_t):
    pi_beta(a | s) = softmax(lm_head(h))            the LM head: the behaviour policy of the data
    Q_1, Q_2 (s, .) : h -> R^|vocab|                two Q heads, one value per next token (action)
    Q'_1, Q'_2 (s, .)                               target copies of the Q heads, frozen, Polyak-averaged
    V(s)            : h -> R                        the value head
and is trained with
    L = L_Q + L_V + cql_scale * L_CQL + awac_scale * L_AWAC     (formulas at `ilql_loss`).
At inference the LM's log-probabilities are shifted by the advantage of each candidate token,
    log pi(a | s) = log pi_beta(a | s) + beta * (min_i Q'_i(s, a) - V(s)) + const,
then top-k and temperature sampling; beta = 0 is the behaviour policy itself.

Initialisation (--init_from): trlX trained ILQL on top of the BASE (pretrained) model, "Notably, we do
not initialize from the SFT checkpoint as we saw minimal benefit in the offline regime" (Sec. 4.1). The
L_AWAC term is itself supervised fine-tuning on every response of the dataset, so the LM head learns the
data's behaviour policy during ILQL anyway; the paper also finds its ILQL models keep the base model's
benchmark scores (little "alignment tax", Appendix B). `--init_from sft` is offered for comparison.

Single process:   python ilql.py --init_from base --model_path EleutherAI/pythia-1b-deduped --output_dir models/ilql
Several GPUs:     accelerate launch --config_file zero2.yaml ilql.py --seed 1
"""

import json
import os
import time
from copy import deepcopy
from dataclasses import asdict, dataclass, field
from functools import reduce
from typing import Dict, List, Literal, Optional, Sequence, Tuple

import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from accelerate import Accelerator, PartialState
from accelerate.utils import GradientAccumulationPlugin, set_seed
from datasets import concatenate_datasets, load_dataset, load_from_disk
from safetensors.torch import save_file
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, get_scheduler


@dataclass
class IlqlHParams:
    """ILQL knobs; defaults are trlX's `default_ilql_config` (trlx/data/default_configs.py)."""

    tau: float = 0.7
    """expectile of the V loss: V regresses towards the tau-expectile of min target-Q (0.5 = the mean)"""
    gamma: float = 0.99
    """discount of the TD target r + gamma * V(next state)"""
    cql_scale: float = 0.1
    """weight of the CQL term (cross-entropy of the Q values over the vocabulary, taken action = label)"""
    awac_scale: float = 1.0
    """weight of the advantage-weighted LM loss on the LM head (the behaviour policy)"""
    awac_beta: float = 0.0
    """temperature of the AWAC weight exp(awac_beta * (min target-Q - V)); trlX's method `beta` is 0, which
    makes every weight 1 and L_AWAC plain next-token cross-entropy on the dataset's responses"""
    alpha: float = 0.001
    """Polyak rate: on each sync, target <- alpha * online + (1 - alpha) * target"""
    steps_for_target_q_sync: int = 5
    """sync the target Q heads every N OPTIMIZER updates (a trlX regression synced once per pass over the data)"""
    two_qs: bool = True
    """two Q heads (and two targets); the minimum of the two targets is used (clipped double-Q)"""


@dataclass
class Args:
    # experiment bookkeeping
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (the script's file stem)"""
    seed: int = 1
    """seed of weights and data order (every rank); sampling uses seed + process_index * 100003"""
    run_name: Optional[str] = None
    """run name; None -> f"{exp_name}__{seed}__{int(time.time())}"; outputs go to {run_dir_root}/{run_name}"""
    run_dir_root: str = "runs"
    """folder that holds the run folders (args.json, metrics.jsonl, TensorBoard, samples, summary)"""
    track: bool = False
    """mirror the TensorBoard logs to Weights & Biases"""
    wandb_project_name: str = "summarize_from_feedback_details"
    """W&B project (with --track)"""
    wandb_entity: Optional[str] = None
    """W&B entity (with --track); None = your default entity"""
    push_to_hub: bool = False
    """upload the trained LM, its ILQL heads and the tokenizer to the Hugging Face hub"""
    hub_model_id: Optional[str] = None
    """hub repository id for --push_to_hub; None -> the run name"""
    output_dir: str = "models/ilql"
    """where the LM (safetensors), its tokenizer and ilql_heads.safetensors are saved"""

    # models and data
    init_from: Literal["base", "sft"] = "base"
    """what the starting model is: base = the pretrained model (what trlX did, Sec. 4.1), sft = the model
    written by sft.py; it picks the default of --model_path"""
    model_path: Optional[str] = None
    """the starting model (hub name or local folder), of the kind --init_from says; None =
    EleutherAI/pythia-1b-deduped for --init_from base, models/sft for --init_from sft"""
    reward_model_path: Optional[str] = None
    """reward model from reward.py: scores the evaluation samples, and labels the data with --reward_source rm"""
    trust_remote_code: bool = False
    """passed to from_pretrained for models with custom code"""
    preference_dataset: str = "vwxyzjn/summarize_from_feedback_oai_preprocessing_1706381144"
    """processed preference pairs (hub name, or a local save_to_disk folder from data/prepare.py)"""
    query_dataset: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """processed SFT dataset whose queries (and reference summaries) are sampled for the evaluation tables"""
    train_split: str = "train"
    """preference split to train on"""
    sample_split: str = "validation"
    """split of --query_dataset whose queries are sampled for samples.csv"""
    reward_source: Literal["labels", "rm"] = "labels"
    """labels = trlX: +1 for the chosen and -1 for the rejected response; rm = the score of --reward_model_path"""

    # optimisation
    ilql: IlqlHParams = field(default_factory=IlqlHParams)
    """the ILQL loss and target-network knobs"""
    num_train_epochs: int = 1
    """passes over the trajectories (2 per preference pair)"""
    total_episodes: Optional[int] = None
    """number of trajectories to train on; None = num_train_epochs x 2 x the pairs of the train split"""
    lr: float = 5e-5
    """AdamW learning rate (trlX default_ilql_config: 5e-5)"""
    eps: float = 1e-5
    """AdamW epsilon (the project's common value; trlX's ILQL configs use 1e-8)"""
    weight_decay: float = 1e-6
    """AdamW weight decay (trlX default_ilql_config: 1e-6)"""
    scheduler: str = "constant"
    """learning-rate schedule (any transformers.get_scheduler name); trlX's cosine_annealing with
    T_max=1e12 and eta_min=lr is a constant learning rate"""
    warmup_steps: int = 0
    """learning-rate warm-up, in optimizer updates"""
    total_batch_size: int = 128
    """trajectories per optimizer update over all processes (trlX: batch 128, "at least 128 global samples")"""
    local_micro_batch_size: int = 8
    """trajectories per forward/backward pass on one process"""
    local_eval_batch_size: int = 8
    """queries per sampling batch (and trajectories per RM-labelling batch)"""
    disable_dropout: bool = True
    """Detail 7: turn dropout off (the target heads and the TD targets then see deterministic features)"""
    bf16: Optional[bool] = None
    """bf16 mixed precision; None = on only when a CUDA device supports bf16 (CPU always runs float32)"""

    # evaluation, sampling and logging
    eval_every: int = 500
    """sample the evaluation table with --beta every N optimizer updates (0 = only after training)"""
    num_eval_samples: Optional[int] = None
    """sample only the first N queries of --sample_split; None = all"""
    response_length: int = 53
    """new tokens sampled per query (TL;DR SFT response length 53; the built-in task uses 24)"""
    temperature: float = 1.0
    """sampling temperature (trlX ILQL gen_kwargs: 1.0)"""
    top_k: int = 20
    """top-k of the advantage-shifted scores (trlX ILQL gen_kwargs: 20); 0 = no top-k"""
    beta: float = 1.0
    """advantage scale of the sampling policy for samples.csv and the periodic evaluations (trlX
    default_ilql_config: 1; some of its examples use 4)"""
    eval_betas: List[float] = field(default_factory=lambda: [0.0, 1.0, 4.0])
    """betas swept at the final evaluation, one samples_beta{b}.csv each (trlX sweeps gen_kwargs beta lists)"""
    log_every: int = 10
    """log training metrics every N optimizer updates, averaged over every micro batch since the last log"""
    print_sample_every: int = 1
    """print a few generated samples at every N-th evaluation (0 = never)"""

    # derived at run time (not flags)
    world_size: tyro.conf.Suppress[Optional[int]] = None
    """number of processes"""
    gradient_accumulation_steps: tyro.conf.Suppress[Optional[int]] = None
    """micro batches per update on one process = total_batch_size / (local_micro_batch_size x world_size)"""
    num_updates: tyro.conf.Suppress[Optional[int]] = None
    """optimizer updates of the whole run"""


# the starting model of each --init_from when --model_path is not given (the paper's Pythia; sft.py's output)
DEFAULT_MODEL_PATHS = {"base": "EleutherAI/pythia-1b-deduped", "sft": "models/sft"}


# ------------------------------------------------------------------------------------------------
# Shared helpers (copied verbatim across scripts; a test checks that the copies stay identical)
# ------------------------------------------------------------------------------------------------
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


def first_true_indices(bools: torch.Tensor, dtype=torch.long) -> torch.Tensor:
    """Per row, the index of the first True; the row length when the row has no True."""
    row_len = bools.size(-1)
    positions = torch.arange(row_len, dtype=dtype, device=bools.device)
    # a False entry is pushed past the end, so the minimum picks the first True (or row_len)
    return torch.where(bools, positions, torch.full_like(positions, row_len)).min(dim=-1).values


def disable_dropout(model: torch.nn.Module) -> None:
    """Detail 7: set every dropout probability to 0 so that training-mode forwards are deterministic."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


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


# ------------------------------------------------------------------------------------------------
# ILQL data: one trajectory per (query, response), the reward on the last response token
# ------------------------------------------------------------------------------------------------
TRAJECTORY_COLUMNS = ["query_response", "response_label", "query_token_len"]


def flatten_pairs(raw):
    """Preference pairs (N rows) -> trajectories (2N rows): rows 0..N-1 are (query, chosen), rows
    N..2N-1 are (query, rejected). `query_response` is the unpadded query + response + EOS, right-padded;
    `response_label` is the same with every query token replaced by [PAD]."""
    views = []
    for side in ("chosen", "rejected"):
        view = raw.select_columns([f"query_{side}_token", f"query_{side}_token_response_label", "query_token_len"])
        views.append(view.rename_columns({
            f"query_{side}_token": "query_response", f"query_{side}_token_response_label": "response_label",
        }))
    return concatenate_datasets(views)


def label_rewards(num_pairs: int) -> torch.Tensor:
    """trlX's labelling of preference pairs (Sec. 4.1, 4.2): +1 for chosen, -1 for rejected, in the row
    order of `flatten_pairs` -> (2N,)."""
    return torch.cat((torch.ones(num_pairs), -torch.ones(num_pairs)))


def normalize_rewards(rewards: torch.Tensor) -> torch.Tensor:
    """z-normalise the sequence rewards over the whole dataset, as trlX's ILQL `make_experience`:
    (r - mean) / (std + eps). With balanced +-1 labels this leaves them (almost exactly) at +-1."""
    rewards = rewards.double()
    return ((rewards - rewards.mean()) / (rewards.std() + torch.finfo(rewards.dtype).eps)).float()


@torch.no_grad()
def rm_rewards(accelerator: Accelerator, reward_model, trajectories, batch_size: int, pad_token_id: int):
    """--reward_source rm: the RM score of every trajectory (read at its EOS, Detail 12) -> (2N,).
    Rows are split across processes and gathered back by row index, so every rank gets the same table."""
    dataset = trajectories.add_column("row_index", list(range(len(trajectories))))
    dataset = dataset.with_format("torch", columns=["query_response", "row_index"])
    dataloader = accelerator.prepare_data_loader(DataLoader(dataset, batch_size=batch_size, shuffle=False))
    table = torch.full((len(dataset),), float("nan"))
    for batch in tqdm(dataloader, desc="RM labelling", disable=not accelerator.is_local_main_process):
        with accelerator.autocast():
            # context_length 0: the query is unpadded, so the first [PAD] of the row follows the EOS
            _, scores, _ = get_reward(reward_model, batch["query_response"], pad_token_id, 0)
        rows, scores = accelerator.gather_for_metrics((batch["row_index"], scores.float()))
        table[rows.cpu()] = scores.cpu()
    if torch.isnan(table).any():
        raise RuntimeError("some trajectories got no RM score; the gathered row indices do not cover the dataset")
    return table


def action_positions(query_token_len: torch.Tensor, response_token_len: torch.Tensor, seq_len: int):
    """States and actions of a right-padded batch of (B, seq_len) trajectories.

    A row's response (its tokens up to and including the EOS) starts at index query_token_len, so the
    state s_t that chooses response token t is the hidden state at query_token_len - 1 + t (trlX's
    `actions_ixs`) and the action a_t is the token at query_token_len + t. Returns the state positions
    (B, Tr) with Tr = the longest response of the batch, and the mask (B, Tr) of real actions; the
    positions past a row's response are clamped into the sequence and masked out."""
    offsets = torch.arange(int(response_token_len.max()), device=query_token_len.device).unsqueeze(0)  # (1, Tr)
    mask = offsets < response_token_len.unsqueeze(1)  # (B, Tr)
    positions = (query_token_len.long().unsqueeze(1) - 1 + offsets).clamp(max=seq_len - 2)  # (B, Tr)
    return positions, mask


def terminal_rewards(sequence_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-action rewards (B, Tr): 0 everywhere except the sequence reward on the last kept action (the
    EOS), as trlX's `rewards[-1] = return`."""
    last = mask.long().sum(1) - 1  # (B,)
    rewards = torch.zeros(mask.shape, dtype=sequence_rewards.dtype, device=mask.device)
    rewards[torch.arange(mask.size(0), device=mask.device), last] = sequence_rewards
    return rewards


# ------------------------------------------------------------------------------------------------
# The model: the causal LM (behaviour policy) + V, Q and target-Q heads on its final hidden state
# ------------------------------------------------------------------------------------------------
def make_head(hidden_size: int, out_size: int) -> nn.Sequential:
    """trlX's `make_head`: a 2-layer MLP of width 2 x hidden."""
    return nn.Sequential(nn.Linear(hidden_size, 2 * hidden_size), nn.ReLU(), nn.Linear(2 * hidden_size, out_size))


class ILQLHeads(nn.Module):
    """V(s) -> scalar; Q_i(s, .) and target Q'_i(s, .) -> one value per vocabulary token (action)."""

    def __init__(self, hidden_size: int, vocab_size: int, two_qs: bool):
        super().__init__()
        self.v_head = make_head(hidden_size, 1)
        self.q_heads = nn.ModuleList(make_head(hidden_size, vocab_size) for _ in range(2 if two_qs else 1))
        # the targets start as exact copies of the online heads and never get gradients
        self.target_q_heads = nn.ModuleList(deepcopy(head) for head in self.q_heads)
        self.target_q_heads.requires_grad_(False)
        self.target_fp32: Optional[List[torch.Tensor]] = None  # float32 copies of low-precision targets

    def forward(self, hidden: torch.Tensor):
        """hidden (..., d) -> Q_i (..., V) per head, Q'_i (..., V) per head, V (...)."""
        qs = tuple(head(hidden) for head in self.q_heads)
        # no gradient ever flows through the targets: detaching here keeps their (..., V) graphs out of memory
        target_qs = tuple(head(hidden.detach()) for head in self.target_q_heads)
        return qs, target_qs, self.v_head(hidden).squeeze(-1)

    @torch.no_grad()
    def sync_target_q_heads(self, alpha: float) -> None:
        """Polyak averaging: theta' <- alpha * theta + (1 - alpha) * theta', i.e. each target parameter
        moves by exactly alpha of its distance to the online parameter.

        DeepSpeed's bf16 engine (zero2.yaml) casts the whole model to bf16, which resolves only about 1/256
        of a value: a step of alpha = 0.001 of the gap would round away and the targets would never move.
        Low-precision targets therefore accumulate the average in float32 copies and get the rounded result."""
        targets, onlines = list(self.target_q_heads.parameters()), list(self.q_heads.parameters())
        if self.target_fp32 is None and any(p.dtype != torch.float32 for p in targets):
            self.target_fp32 = [p.detach().float().clone() for p in targets]
        for i, (target, online) in enumerate(zip(targets, onlines)):
            if self.target_fp32 is None:
                target.lerp_(online, alpha)
            else:
                self.target_fp32[i].lerp_(online.float(), alpha)
                target.copy_(self.target_fp32[i])


class ILQLModel(nn.Module):
    """The causal LM plus ILQL heads, both reading the backbone's final hidden state."""

    def __init__(self, lm: nn.Module, two_qs: bool):
        super().__init__()
        self.lm = lm
        hidden_size = lm.config.hidden_size
        vocab_size = lm.get_output_embeddings().weight.size(0)  # every action the LM head can emit
        self.heads = ILQLHeads(hidden_size, vocab_size, two_qs)

    def backbone(self, **kwargs):
        """The transformer without its LM head (its last hidden state is what the LM head reads, after the
        final layer norm; as in trlX, which reads `hidden_states[-1]`)."""
        return getattr(self.lm, self.lm.base_model_prefix)(return_dict=True, **kwargs)

    def forward(self, query_responses: torch.Tensor, pad_token_id: int, positions: torch.Tensor):
        """Forward a right-padded batch (B, T) and read every output at the states `positions` (B, Tr)
        only, so the vocabulary-sized outputs are (B, Tr, V) rather than (B, T, V).
        Returns LM logits (B, Tr, V), Q_i and Q'_i (B, Tr, V) per head, V (B, Tr)."""
        attention_mask = query_responses != pad_token_id
        position_ids = attention_mask.long().cumsum(1) - attention_mask.long()
        input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state  # (B, T, d)
        hidden = hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.size(-1)))  # (B, Tr, d)
        lm_logits = self.lm.get_output_embeddings()(hidden)  # (B, Tr, V)
        qs, target_qs, values = self.heads(hidden)
        return lm_logits, qs, target_qs, values


# ------------------------------------------------------------------------------------------------
# The ILQL loss
# ------------------------------------------------------------------------------------------------
def ilql_loss(
    lm_logits: torch.Tensor,
    qs: Sequence[torch.Tensor],
    target_qs: Sequence[torch.Tensor],
    values: torch.Tensor,
    actions: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    hp: IlqlHParams,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The ILQL loss of trlX's `ILQLConfig.loss` over the actions of a batch.

    lm_logits (B, T, V), each q / target q (B, T, V), values (B, T) = V(s_t); actions (B, T) = a_t;
    rewards (B, T) = r_t (the sequence reward on the last action); mask (B, T) = m_t, 1 on real
    actions (up to and including the EOS). Every term is a sum over actions divided by
    n = max(1, sum_t m_t), the number of actions in the batch.
    """
    mask = mask.float()
    n = mask.sum().clamp(min=1.0)
    index = actions.unsqueeze(-1)  # (B, T, 1)
    q_taken = [q.float().gather(-1, index).squeeze(-1) for q in qs]  # Q_i(s_t, a_t), (B, T) each
    # min_i Q'_i(s_t, a_t): clipped double-Q over the frozen targets
    target_q = reduce(torch.minimum, [q.float().gather(-1, index).squeeze(-1) for q in target_qs]).detach()
    values = values.float()

    # 1. Q loss (TD): the next state's value counts only while the episode goes on; after the EOS
    #    action the state is terminal (trlX: Vnext = V[1:] * dones[1:]):
    #       y_t = r_t + gamma * m_{t+1} * V(s_{t+1})      (no gradient through y_t)
    #       L_Q = sum_i sum_t m_t (Q_i(s_t, a_t) - y_t)^2 / n
    next_mask = torch.cat((mask[:, 1:], torch.zeros_like(mask[:, :1])), dim=1)
    next_values = torch.cat((values[:, 1:], torch.zeros_like(values[:, :1])), dim=1) * next_mask
    td_target = rewards.float() + hp.gamma * next_values.detach()
    loss_q = sum(((q - td_target) ** 2 * mask).sum() / n for q in q_taken)

    # 2. V loss: expectile regression of V towards the target Q (tau > 0.5 leans to the upper expectile):
    #       u_t = min_i Q'_i(s_t, a_t) - V(s_t)
    #       L_V = sum_t m_t |tau - 1(u_t < 0)| u_t^2 / n
    u = target_q - values
    expectile_weight = torch.where(u >= 0, torch.full_like(u, hp.tau), torch.full_like(u, 1 - hp.tau))
    loss_v = (expectile_weight * u**2 * mask).sum() / n

    # 3. CQL: the Q values over the vocabulary as logits, the dataset's action as the label
    #       L_CQL = sum_i sum_t m_t [ -log softmax(Q_i(s_t, .))[a_t] ] / n
    #             = sum_i sum_t m_t [ logsumexp_a Q_i(s_t, a) - Q_i(s_t, a_t) ] / n
    #    (pushes down the Q of actions the data never took, so the sampler is not drawn to them)
    batch, length = actions.shape
    flat_actions = actions.reshape(-1)
    loss_cql = sum(
        (F.cross_entropy(q.float().reshape(batch * length, -1), flat_actions, reduction="none").view(batch, length)
         * mask).sum() / n
        for q in qs
    )

    # 4. AWAC: advantage-weighted next-token cross-entropy of the LM head (the behaviour policy):
    #       w_t = exp(awac_beta * (min_i Q'_i(s_t, a_t) - V(s_t)))        (no gradient through w_t)
    #       L_AWAC = sum_t m_t w_t [ -log softmax(lm_logits(s_t))[a_t] ] / n
    #    trlX's configs set awac_beta (its method `beta`) to 0, so w_t = 1 and L_AWAC is plain
    #    behaviour cloning of every response in the data, chosen and rejected alike.
    nll = F.cross_entropy(lm_logits.float().reshape(batch * length, -1), flat_actions, reduction="none")
    nll = nll.view(batch, length)
    awac_weight = torch.exp(hp.awac_beta * u).detach()
    loss_awac = (nll * awac_weight * mask).sum() / n

    # 5. L = L_Q + L_V + cql_scale * L_CQL + awac_scale * L_AWAC
    loss = loss_q + loss_v + hp.cql_scale * loss_cql + hp.awac_scale * loss_awac

    def masked(x: torch.Tensor) -> torch.Tensor:
        return (x.detach() * mask).sum() / n

    stats = {
        "loss": loss.detach(), "loss_q": loss_q.detach(), "loss_v": loss_v.detach(),
        "loss_cql": loss_cql.detach(), "loss_awac": loss_awac.detach(),
        "values": masked(values), "qvalues": masked(q_taken[0]), "target_qvalues": masked(target_q),
        "advantages": masked(u), "awac_weight": masked(awac_weight),
    }
    return loss, stats


def should_sync_target(update: int, steps_for_target_q_sync: int) -> bool:
    """True after optimizer update number `update` (1-based) when the target Q heads are synced: every
    steps_for_target_q_sync optimizer updates, independent of epochs."""
    return update % steps_for_target_q_sync == 0


# ------------------------------------------------------------------------------------------------
# Advantage-shifted sampling
# ------------------------------------------------------------------------------------------------
def advantage_shifted_scores(
    lm_logits: torch.Tensor, target_qs: Sequence[torch.Tensor], value: torch.Tensor,
    beta: float, top_k: int, pad_token_id: int,
) -> torch.Tensor:
    """Unnormalised log-probabilities of the ILQL policy for one step: lm_logits (B, V), each target q
    (B, V), value (B,) ->
        s(a) = log_softmax(lm_logits)(a) + beta * (min_i Q'_i(s, a) - V(s)),
    [PAD] removed (it is no action in our data; ppo.py suppresses it too, trlX does not), and every
    score below the top_k-th set to -inf (trlX's `topk_mask`; top_k 0 = keep all)."""
    advantage = reduce(torch.minimum, [q.float() for q in target_qs]) - value.float().unsqueeze(-1)  # (B, V)
    scores = F.log_softmax(lm_logits.float(), dim=-1) + beta * advantage
    scores[:, pad_token_id] = float("-inf")
    if 0 < top_k < scores.size(-1):
        kth_best = torch.topk(scores, top_k, dim=-1).values[:, -1:]  # (B, 1)
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    return scores


@torch.no_grad()
def ilql_generate(
    model: ILQLModel, queries: torch.Tensor, pad_token_id: int, eos_token_id: int, response_length: int,
    beta: float, temperature: float, top_k: int,
) -> torch.Tensor:
    """Sample response_length tokens after LEFT-padded queries (B, Tq) with the KV cache, each from
    softmax(advantage_shifted_scores / temperature) -> query_responses (B, Tq + response_length).

    Detail 23: EOS is an ordinary token and never stops a row early (fixed-length sampling, the caller
    truncates after the first EOS). The loop only ends early once EVERY row holds an EOS, filling the
    rest with [PAD]: what is kept after truncation is the same as with the full length.
    A manual loop rather than `generate`: the logits need the heads' Q and V at every step."""
    batch = queries.size(0)
    attention_mask = queries != pad_token_id
    position_ids = attention_mask.long().cumsum(1) - attention_mask.long()  # left pads do not count
    input_ids = torch.masked_fill(queries, ~attention_mask, 0)
    responses = torch.full((batch, response_length), pad_token_id, dtype=queries.dtype, device=queries.device)
    cache = None
    for t in range(response_length):
        output = model.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=cache, use_cache=True,
        )
        cache = output.past_key_values
        hidden = output.last_hidden_state[:, -1]  # (B, d): the state that chooses token t
        lm_logits = model.lm.get_output_embeddings()(hidden)  # (B, V)
        _, target_qs, value = model.heads(hidden)
        scores = advantage_shifted_scores(lm_logits, target_qs, value, beta, top_k, pad_token_id)
        tokens = torch.multinomial(F.softmax(scores / temperature, dim=-1), num_samples=1)  # (B, 1)
        responses[:, t] = tokens[:, 0]
        if (responses[:, : t + 1] == eos_token_id).any(1).all():
            break
        input_ids = tokens
        attention_mask = torch.cat((attention_mask, torch.ones_like(tokens, dtype=torch.bool)), dim=1)
        position_ids = position_ids[:, -1:] + 1
    return torch.cat((queries, responses), dim=1)


@torch.no_grad()
def sample_table(accelerator, model, reward_model, tokenizer, raw, dataset, beta: float, args: Args):
    """Sample the evaluation queries with the ILQL policy at `beta`, truncate after the first EOS, score
    with the RM when there is one. Returns the samples table (contract columns) and summary metrics."""
    unwrapped = accelerator.unwrap_model(model)
    was_training = unwrapped.training
    unwrapped.eval()
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    dataloader = accelerator.prepare_data_loader(DataLoader(dataset, batch_size=args.local_eval_batch_size))
    rows_all, responses_all, scores_all = [], [], []
    for batch in dataloader:
        queries = batch["query_token"]  # (B, Tq), left-padded
        context_length = queries.size(1)
        with accelerator.autocast():
            query_responses = ilql_generate(
                unwrapped, queries, pad_id, eos_id, args.response_length, beta, args.temperature, args.top_k
            )
        responses = truncate_response(eos_id, pad_id, query_responses[:, context_length:])  # (B, Tr)
        if reward_model is not None:
            with accelerator.autocast():
                _, scores, _ = get_reward(reward_model, torch.cat((queries, responses), 1), pad_id, context_length)
            scores = scores.float()
        else:
            scores = torch.full((queries.size(0),), float("nan"), device=queries.device)
        rows, responses, scores = accelerator.gather_for_metrics((batch["row_index"], responses, scores))
        rows_all.append(rows.cpu())
        responses_all.append(responses.cpu())
        scores_all.append(scores.cpu())
    rows, responses, scores = torch.cat(rows_all), torch.cat(responses_all), torch.cat(scores_all)
    has_eos = (responses == eos_id).any(1)
    # tokens up to and including the first EOS (all of them when there is none)
    token_len = torch.where(has_eos, first_true_indices(responses == eos_id) + 1, responses.size(1))
    query_tokens, references = raw["query_token"], raw["reference_response"]
    records = []
    for i, row in enumerate(rows.tolist()):
        records.append({
            "query": tokenizer.decode([t for t in query_tokens[row] if t != pad_id], skip_special_tokens=True),
            "response": tokenizer.decode(
                [t for t in responses[i].tolist() if t != pad_id], skip_special_tokens=True
            ).strip(),
            "reference": references[row].strip(),
            "score": float(scores[i]) if reward_model is not None else None,
            "response_token_len": int(token_len[i]),
            "has_eos": bool(has_eos[i]),
        })
    table = pd.DataFrame(records, columns=["query", "response", "reference", "score", "response_token_len", "has_eos"])
    metrics = {"eos_rate": float(has_eos.float().mean()), "response_token_len": float(token_len.float().mean())}
    if reward_model is not None:
        metrics["score"] = float(scores.mean())
    if was_training:
        unwrapped.train()
    return table, metrics


def beta_name(beta: float) -> str:
    """0.0 -> "0", 4.0 -> "4", 0.5 -> "0.5": the suffix of samples_beta{b}.csv and of the metric names."""
    return f"{beta:g}"


def main(args: Args) -> dict:
    start_time = time.time()
    # 1. batch arithmetic, accelerator and run folder
    args.world_size = PartialState(cpu=not torch.cuda.is_available()).num_processes  # cpu=True: gloo ranks on CPU
    args.gradient_accumulation_steps = exact_div(
        args.total_batch_size, args.local_micro_batch_size * args.world_size,
        "total_batch_size / (local_micro_batch_size x world_size)",
    )
    if args.temperature <= 0:
        raise ValueError(f"--temperature must be positive, got {args.temperature}")
    if args.ilql.steps_for_target_q_sync < 1:
        raise ValueError(f"--ilql.steps_for_target_q_sync must be >= 1, got {args.ilql.steps_for_target_q_sync}")
    if args.reward_source == "rm" and args.reward_model_path is None:
        raise ValueError("--reward_source rm needs --reward_model_path")
    if args.bf16 is None:
        args.bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    accelerator = Accelerator(
        # sync on the micro-step count only: an update may straddle two epochs (--total_episodes)
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.gradient_accumulation_steps, sync_with_dataloader=False
        ),
        mixed_precision="bf16" if args.bf16 else "no",
    )
    deepspeed_plugin = accelerator.state.deepspeed_plugin
    if deepspeed_plugin is not None and deepspeed_plugin.zero_stage == 3:
        # the Polyak update works on whole local parameters; ZeRO-3 holds only shards (use zero2.yaml)
        raise ValueError("ilql.py supports DDP and ZeRO-2, not ZeRO-3")
    if args.run_name is None:
        args.run_name = f"{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = os.path.join(args.run_dir_root, args.run_name)
    writer = None
    if accelerator.is_main_process:
        os.makedirs(os.path.join(run_dir, "samples"), exist_ok=True)
        if args.track:
            import wandb

            wandb.init(
                project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                config=asdict(args), name=args.run_name, save_code=True,
            )
        writer = SummaryWriter(run_dir)
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items()))

    def log(metrics: dict, step: int, episode: int):
        if accelerator.is_main_process:
            for key, value in metrics.items():
                writer.add_scalar(key, value, step)
            with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "episode": episode, **metrics}) + "\n")

    # 2. seeding: the same seed on every rank for weights (the heads) and data order
    set_seed(args.seed)
    local_seed = args.seed + accelerator.process_index * 100003

    # 3. tokenizer from the starting model; Detail 3: a [PAD] distinct from EOS
    if args.model_path is None:
        args.model_path = DEFAULT_MODEL_PATHS[args.init_from]
    tokenizer = AutoTokenizer.from_pretrained(args.model_path, trust_remote_code=args.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ValueError("the tokenizer's pad token is its EOS; Detail 3 needs a distinct [PAD] (re-run data/prepare.py)")
    pad_token_id = tokenizer.pad_token_id

    # 4. models: the LM + fresh ILQL heads; the (optional) frozen reward model
    lm = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32, trust_remote_code=args.trust_remote_code)
    if len(tokenizer) > lm.get_input_embeddings().weight.size(0):
        lm.resize_token_embeddings(len(tokenizer))
    model = ILQLModel(lm, args.ilql.two_qs)
    if args.disable_dropout:
        disable_dropout(model)
    reward_model = None
    if args.reward_model_path is not None:
        reward_model = AutoModelForSequenceClassification.from_pretrained(
            args.reward_model_path, num_labels=1, dtype=torch.bfloat16 if args.bf16 else torch.float32,
            trust_remote_code=args.trust_remote_code,
        )
        if len(tokenizer) > reward_model.get_input_embeddings().weight.size(0):
            reward_model.resize_token_embeddings(len(tokenizer))
        disable_dropout(reward_model)  # frozen and deterministic whatever --disable_dropout says
        reward_model.eval().requires_grad_(False)
        reward_model = reward_model.to(accelerator.device)

    # 5. data: trajectories (query, chosen, +1) and (query, rejected, -1), or RM-scored; z-normalised
    train_raw = load_split(args.preference_dataset, args.train_split)
    trajectories = flatten_pairs(train_raw)
    if args.reward_source == "labels":
        raw_rewards = label_rewards(len(train_raw))
    else:
        raw_rewards = rm_rewards(accelerator, reward_model, trajectories, args.local_eval_batch_size, pad_token_id)
    rewards = normalize_rewards(raw_rewards)
    data_metrics = {
        "data/raw_reward_mean": float(raw_rewards.mean()), "data/raw_reward_std": float(raw_rewards.std()),
        "data/reward_chosen_mean": float(rewards[: len(train_raw)].mean()),
        "data/reward_rejected_mean": float(rewards[len(train_raw):].mean()),
        # how often the rewards respect the human label r_chosen > r_rejected (1 for +-1 labels; trlX's
        # explanation of why the labels beat RM scores)
        "data/pair_order_agreement": float((rewards[: len(train_raw)] > rewards[len(train_raw):]).float().mean()),
    }
    trajectories = trajectories.add_column("reward", rewards.tolist())
    train_dataset = trajectories.with_format("torch", columns=TRAJECTORY_COLUMNS + ["reward"])
    sample_raw = load_split(args.query_dataset, args.sample_split)
    if args.num_eval_samples is not None:
        sample_raw = sample_raw.select(range(min(args.num_eval_samples, len(sample_raw))))
    sample_dataset = sample_raw.add_column("row_index", list(range(len(sample_raw))))
    sample_dataset = sample_dataset.with_format("torch", columns=["query_token", "row_index"])

    total_episodes = args.total_episodes if args.total_episodes is not None else args.num_train_epochs * len(trajectories)
    args.num_updates = num_updates = total_episodes // args.total_batch_size  # a last partial batch is dropped
    if num_updates < 1:
        raise ValueError(f"{total_episodes} trajectories give no full batch of {args.total_batch_size}")
    if accelerator.is_main_process:
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump(asdict(args), f, indent=2)  # with the derived fields filled in
    log(data_metrics, 0, 0)

    # the target heads are not optimised: only parameters that require gradients go to AdamW
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=args.lr, eps=args.eps, weight_decay=args.weight_decay
    )
    # counts optimizer updates, stepped by hand once per update (accelerate's wrapper would step per process)
    lr_scheduler = get_scheduler(args.scheduler, optimizer, num_warmup_steps=args.warmup_steps, num_training_steps=num_updates)
    train_dataloader = DataLoader(
        train_dataset, batch_size=args.local_micro_batch_size, shuffle=True, drop_last=True,
        generator=torch.Generator().manual_seed(args.seed),
    )
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    torch.manual_seed(local_seed)  # sampling differs across ranks from here on

    def run_evaluation(update: int, episode: int, betas: List[float], final: bool) -> dict:
        """Sample the evaluation queries at each beta; the table of --beta becomes samples/step_N.csv
        (and samples.csv at the end), each swept beta samples_beta{b}.csv."""
        metrics, tables = {}, {}
        for beta in betas:
            table, beta_metrics = sample_table(accelerator, model, reward_model, tokenizer, sample_raw, sample_dataset, beta, args)
            tables[beta] = table
            metrics.update({f"eval/beta_{beta_name(beta)}/{k}": v for k, v in beta_metrics.items()})
            if beta == args.beta:
                metrics.update({f"eval/{k}": v for k, v in beta_metrics.items()})
        if accelerator.is_main_process:
            default_table = tables[args.beta]
            default_table.to_csv(os.path.join(run_dir, "samples", f"step_{update:06d}.csv"), index=False)
            if final:
                default_table.to_csv(os.path.join(run_dir, "samples.csv"), index=False)
                for beta in args.eval_betas:
                    tables[beta].to_csv(os.path.join(run_dir, f"samples_beta{beta_name(beta)}.csv"), index=False)
            num_evals = update // args.eval_every if args.eval_every > 0 else 1
            if args.print_sample_every > 0 and (final or num_evals % args.print_sample_every == 0):
                for row in default_table.head(2).itertuples():
                    print(f"--- update {update}, beta {args.beta}\nQUERY: {row.query[-200:]}\n"
                          f"RESPONSE: {row.response}\nREFERENCE: {row.reference}")
        log(metrics, update, episode)
        return metrics

    # 6. training: one optimizer update per total_batch_size trajectories; target sync on updates
    accelerator.print(
        f"ILQL ({args.reward_source} rewards, from {args.init_from}): {num_updates} updates of "
        f"{args.total_batch_size} trajectories, {accelerator.num_processes} process(es) x "
        f"{args.gradient_accumulation_steps} accumulation x {args.local_micro_batch_size}"
    )
    model.train()
    heads = accelerator.unwrap_model(model).heads
    episode, num_target_syncs = 0, 0
    last_train_metrics: Dict[str, float] = {}
    interval_stats: Dict[str, List[torch.Tensor]] = {}
    interval_tokens, interval_start = 0, time.time()
    train_time = 0.0  # optimisation only (no evaluation, no RM labelling): compare with ppo.py's training
    progress = tqdm(total=num_updates, desc="ilql", disable=not accelerator.is_local_main_process)

    def micro_batches():
        """Micro batches forever, reshuffled at every pass over the data."""
        epoch = 0
        while True:
            train_dataloader.set_epoch(epoch)
            yield from train_dataloader
            epoch += 1

    micro_batch_iterator = micro_batches()
    for update in range(1, num_updates + 1):
        update_start = time.time()
        for _ in range(args.gradient_accumulation_steps):
            batch = next(micro_batch_iterator)
            labels = batch["response_label"]  # (B, T): the response tokens, [PAD] elsewhere
            positions, mask = action_positions(
                batch["query_token_len"], (labels != pad_token_id).sum(1), labels.size(1)
            )  # (B, Tr) states s_t and real-action mask
            actions = labels.gather(1, positions + 1).masked_fill(~mask, pad_token_id)  # (B, Tr): a_t
            step_rewards = terminal_rewards(batch["reward"].float(), mask)  # (B, Tr)
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    lm_logits, qs, target_qs, values = model(batch["query_response"], pad_token_id, positions)
                loss, stats = ilql_loss(lm_logits, qs, target_qs, values, actions, step_rewards, mask, args.ilql)
                accelerator.backward(loss)  # divided by gradient_accumulation_steps inside
                optimizer.step()  # a no-op until the last micro batch of the update
                optimizer.zero_grad()
            for key, value in stats.items():
                interval_stats.setdefault(f"train/{key}", []).append(value.float())
            interval_tokens += int((batch["query_response"] != pad_token_id).sum())
        if not accelerator.sync_gradients:
            raise RuntimeError("gradient accumulation went out of step with the update loop")
        # Polyak-average the target Q heads every steps_for_target_q_sync OPTIMIZER updates
        if should_sync_target(update, args.ilql.steps_for_target_q_sync):
            heads.sync_target_q_heads(args.ilql.alpha)
            num_target_syncs += 1
        update_lr = lr_scheduler.get_last_lr()[0]  # the learning rate this update used
        lr_scheduler.step()
        episode += args.total_batch_size
        train_time += time.time() - update_start
        progress.update(1)
        if update % args.log_every == 0 or update == num_updates:
            means = {
                key: accelerator.reduce(torch.stack(values).mean(), reduction="mean").item()
                for key, values in interval_stats.items()
            }
            tokens = accelerator.reduce(torch.tensor(interval_tokens, device=accelerator.device), reduction="sum").item()
            means["train/tokens_per_s"] = tokens / (time.time() - interval_start)
            means["train/lr"] = update_lr
            means["train/epoch"] = episode / len(trajectories)
            means["train/num_target_syncs"] = num_target_syncs
            log(means, update, episode)
            last_train_metrics = means
            progress.set_postfix(
                loss=f"{means['train/loss']:.4f}", awac=f"{means['train/loss_awac']:.3f}",
                tok_s=f"{means['train/tokens_per_s']:.0f}",
            )
            interval_stats, interval_tokens, interval_start = {}, 0, time.time()
        if args.eval_every > 0 and update % args.eval_every == 0 and update < num_updates:
            run_evaluation(update, episode, [args.beta], final=False)
            interval_start = time.time()  # evaluation time is not training throughput
    progress.close()

    # 7. final evaluation: the beta sweep (and --beta for samples.csv), summary, saving
    final_betas = list(dict.fromkeys(list(args.eval_betas) + [args.beta]))
    metrics = run_evaluation(update, episode, final_betas, final=True)
    summary = dict(metrics)
    summary.update(last_train_metrics)  # the last logging interval's training means
    summary.update(data_metrics)
    summary["num_updates"] = update
    summary["episodes"] = episode
    summary["num_target_syncs"] = num_target_syncs
    summary["train_time_s"] = train_time
    summary["wall_time_s"] = time.time() - start_time
    if accelerator.is_main_process:
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        writer.close()
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        lm_state = {k[len("lm."):]: v for k, v in state_dict.items() if k.startswith("lm.")}
        heads_state = {k[len("heads."):]: v.contiguous() for k, v in state_dict.items() if k.startswith("heads.")}
        # transformers v5 always writes safetensors; the heads go next to the LM in their own file
        unwrapped.lm.save_pretrained(args.output_dir, state_dict=lm_state)
        tokenizer.save_pretrained(args.output_dir)
        heads_path = os.path.join(args.output_dir, "ilql_heads.safetensors")
        save_file(heads_state, heads_path)
        with open(os.path.join(args.output_dir, "ilql_heads.json"), "w") as f:
            json.dump({"hidden_size": unwrapped.lm.config.hidden_size, "two_qs": args.ilql.two_qs,
                       "beta": args.beta, "top_k": args.top_k, "temperature": args.temperature}, f, indent=2)
        if args.push_to_hub:
            from huggingface_hub import HfApi

            hub_model_id = args.hub_model_id if args.hub_model_id is not None else args.run_name
            unwrapped.lm.push_to_hub(hub_model_id)
            tokenizer.push_to_hub(hub_model_id)
            HfApi().upload_file(path_or_fileobj=heads_path, path_in_repo="ilql_heads.safetensors", repo_id=hub_model_id)
    if accelerator.is_main_process and args.track:
        import wandb

        wandb.finish()
    accelerator.print(f"done in {time.time() - start_time:.0f}s; run folder {run_dir}")
    return summary


if __name__ == "__main__":
    main(tyro.cli(Args))
