"""Implicit Language Q-Learning (ILQL), the offline RLHF alternative of trlX, on TL;DR preference pairs.

trlX ("A Framework for Large Scale RLHF", Havrilla et al., Sec. 4.1 and 4.2) trains ILQL (Snell et al.)
OFFLINE: no sampling during training and no reward model in the loop. The paper reports that +-1 preference
labels beat labelling the same responses with the learned RM ("RM rewards are denser, but the inequality
r_chosen > r_rejected is sometimes not respected"); `--reward_source rm` is that variant.

The model is the causal LM plus small heads on its final hidden state h(s_t):
    pi_beta(a | s) = softmax(lm_head(h))            the LM head: the behaviour policy of the data
    Q_1, Q_2 (s, .) : h -> R^|vocab|                two Q heads, one value per next token (action)
    Q'_1, Q'_2 (s, .)                               target copies of the Q heads, frozen, Polyak-averaged
    V(s)            : h -> R                        the value head

  data     1. every preference pair (x, y_chosen, y_rejected) gives two trajectories, (x, y_chosen), (x, y_rejected)
           2. their rewards: +1 and -1 (trlX), or the RM's score of each (--reward_source rm); z-normalised
              over the dataset
           3. the reward sits on the last response token (the EOS); every other action gets 0
  update   4. one forward reads the LM logits, Q_i, Q'_i and V at the state before each response token
           5. L = L_Q + L_V + cql_scale * L_CQL + awac_scale * L_AWAC (formulas at `ilql_loss`); one AdamW
              step per total_batch_size trajectories
           6. every steps_for_target_q_sync optimizer steps: Polyak-average the target Q heads towards the online ones
  sampling 7. the LM's log-probabilities shifted by the advantage of each candidate token,
                  log pi(a | s) = log pi_beta(a | s) + beta * (min_i Q'_i(s, a) - V(s)) + const,
              then top-k and temperature sampling; beta = 0 is the behaviour policy itself. The final
              evaluation samples at every beta of --eval_betas.

Initialisation (--init_from): trlX trained ILQL on top of the BASE (pretrained) model, "Notably, we do
not initialize from the SFT checkpoint as we saw minimal benefit in the offline regime" (Sec. 4.1). The
L_AWAC term is itself supervised fine-tuning on every response of the dataset, so the LM head learns the
data's behaviour policy during ILQL anyway; the paper also finds its ILQL models keep the base model's
benchmark scores (little "alignment tax", Appendix B). The default here is trlX's, base; start from SFT when
the base model cannot learn to summarise from the offline data in the run's budget (the built-in task's
1M-parameter base model cannot).

Checkpoints: every --checkpoint_every updates, runs/{run_name}/checkpoints/update_N holds the LM with all its heads
(V, Q and the Polyak-averaged target Q), optimizer, schedule, RNG states, the data position and the running counters
(target syncs, the open logging interval); `--resume --run_name NAME` continues from the newest one and ends with the
weights and metrics of an uninterrupted run. A NaN/inf loss term stops the run before any weight sees it and saves the
state after the last good update as its checkpoint, which --resume continues from like any other.

Single process:   python ilql.py --init_from base --model_path EleutherAI/pythia-1b-deduped --output_dir models/ilql
Several GPUs:     accelerate launch --config_file zero2.yaml ilql.py --seed 1
"""

import functools
import math
import os
import time
from copy import deepcopy
from dataclasses import dataclass, field
from functools import reduce
from typing import Annotated, Dict, List, Literal, Optional, Sequence, Tuple

import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from accelerate import Accelerator, skip_first_batches
from accelerate.utils import set_seed
from datasets import concatenate_datasets
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from rlhf_utils import checks, models, records
from rlhf_utils.checks import RunError
from rlhf_utils.flags import RunFlags, check_ilql_flags
from rlhf_utils.run import LastGoodState, Run, due, evaluation_rng, leave_processes, seeded_accelerator, start_processes


@dataclass
class IlqlHParams:
    """ILQL knobs; defaults are trlX's `default_ilql_config` (trlx/data/default_configs.py)."""

    tau: float = 0.7
    """expectile of the V loss: V regresses towards the tau-expectile of min target-Q (trlX: 0.7; 0.5 = the mean,
    higher = a more optimistic V)"""
    gamma: float = 0.99
    """discount of the TD target r + gamma * V(next state) (trlX: 0.99)"""
    cql_scale: float = 0.1
    """weight of the CQL term, the cross-entropy of the Q values over the vocabulary with the data's token as the
    label (trlX: 0.1) (docs/usage.md, "Flags in depth")"""
    awac_scale: float = 1.0
    """weight of the advantage-weighted LM loss on the LM head, the behaviour policy (trlX: 1)"""
    awac_beta: float = 0.0
    """temperature of the AWAC weight exp(awac_beta * (min target-Q - V)); trlX's method `beta` is 0, which
    makes every weight 1 and L_AWAC plain next-token cross-entropy on the dataset's responses"""
    alpha: float = 0.001
    """Polyak rate (trlX: 0.001): on each sync, target <- alpha * online + (1 - alpha) * target. The terminal reward
    moves back one token per TD step, and each step waits for the targets: a run of a few hundred updates needs a
    fast target (1 = copy the online heads)"""
    steps_for_target_q_sync: int = 5
    """sync the target Q heads every N optimizer updates, independent of epochs (trlX: 5)"""
    two_qs: bool = True
    """two Q heads (and two targets); the minimum of the two targets is used (clipped double-Q, trlX: on)"""


@dataclass
class Args:
    # experiment bookkeeping
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (the script's file stem)"""
    seed: int = 1
    """seed of weights and data order (every rank); sampling uses seed + process_index * 100003"""
    output_dir: str = "models/ilql"
    """where the LM (safetensors), its tokenizer and ilql_heads.safetensors are saved"""

    # models and data
    init_from: Literal["base", "sft"] = "base"
    """the starting model: base = the pretrained model (trlX, Sec. 4.1), sft = the model written by sft.py; it picks
    the default of --model_path. sft when the base model is too weak to learn the task from the offline data"""
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
    eval_split: str = "validation"
    """split of --query_dataset whose queries are sampled for the evaluation tables (samples.csv)"""
    reward_source: Literal["labels", "rm"] = "labels"
    """the reward of each trajectory: labels = +1 for the chosen and -1 for the rejected response (trlX, Sec. 4.1);
    rm = the score of --reward_model_path (docs/usage.md, "Flags in depth")"""

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
    scheduler: Literal["cosine", "linear", "constant"] = "constant"
    """learning-rate schedule (transformers.get_scheduler's curves, written out: lr_schedule); trlX's
    cosine_annealing with T_max=1e12 and eta_min=lr is a constant learning rate"""
    warmup_steps: int = 0
    """learning-rate warm-up, in optimizer updates"""
    total_batch_size: int = 128
    """trajectories per optimizer update over all processes (trlX: batch 128, "at least 128 global samples")"""
    local_micro_batch_size: int = 8
    """trajectories per forward/backward pass on one process"""
    gradient_accumulation_steps: Optional[int] = None
    """micro batches per optimizer step; None = derived from the batch sizes, else checked against them"""
    local_eval_batch_size: int = 8
    """queries per sampling batch (and trajectories per RM-labelling batch)"""
    disable_dropout: bool = True
    """Detail 7: turn dropout off (the target heads and the TD targets then see deterministic features)"""
    bf16: Optional[bool] = None
    """bf16 mixed precision, as the paper trained (Detail 8); None = on when a CUDA device supports bf16. The CPU
    runs float32 unless --bf16 asks for bf16 (slow; the tests use it to exercise the GPU's dtype path)"""
    gradient_checkpointing: bool = False
    """activation checkpointing in every model that trains here: less activation memory for about one more forward
    pass; the loss and gradients are the same. Off: the paper trained without it (docs/usage.md, "Flags in depth")"""

    # evaluation, sampling and logging
    eval_every: int = 500
    """sample the evaluation table with --beta every N optimizer updates (0 = only after training)"""
    num_eval_samples: Optional[int] = None
    """sample only the first N queries of --eval_split; None = all"""
    response_length: int = 53
    """new tokens sampled per query (TL;DR SFT response length 53; the built-in task uses 24)"""
    eval_temperature: float = 1.0
    """sampling temperature of the evaluation samples (trlX ILQL gen_kwargs: 1.0); ILQL samples nothing else"""
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
    """print a few samples of the evaluations at updates that are multiples of N (and of the final one); 0 = never"""

    run: Annotated[RunFlags, tyro.conf.OmitArgPrefixes] = field(default_factory=RunFlags)
    """the run's folder, checkpoints, --resume, lock, tracking and hub (rlhf_utils/flags.py): they decide no number"""

    # derived at run time (not flags)
    world_size: tyro.conf.Suppress[Optional[int]] = None
    """number of processes"""
    num_updates: tyro.conf.Suppress[Optional[int]] = None
    """optimizer updates of the whole run"""


# the starting model of each --init_from when --model_path is not given (the paper's Pythia; sft.py's output)
DEFAULT_MODEL_PATHS = {"base": "EleutherAI/pythia-1b-deduped", "sft": "models/sft"}


# ---------------------------------------------------------------------------------------------
# ILQL data: one trajectory per (query, response), the reward on the last response token
# ---------------------------------------------------------------------------------------------


TRAJECTORY_COLUMNS = ["query_response", "response_label", "query_token_len"]
# the columns of a preference split that `flatten_pairs` reads are these and query_token_len (checked by
# checks.check_columns before it runs)
PAIR_COLUMNS = [  # the processed preference schema: query + response, and the response as labels
    "query_chosen_token",
    "query_rejected_token",
    "query_chosen_token_response_label",
    "query_rejected_token_response_label",
]


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
            query_responses = batch["query_response"]
            query_responses = query_responses[:, real_columns(query_responses, pad_token_id)]  # shared padding cut
            _, scores, _ = get_reward(reward_model, query_responses, pad_token_id, 0)
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


# ---------------------------------------------------------------------------------------------
# The model: the causal LM (behaviour policy) + V, Q and target-Q heads on its final hidden state
# ---------------------------------------------------------------------------------------------


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
        with models.whole_parameters(targets + onlines):  # ZeRO-3 (zero3.yaml) holds slices: average the whole tensors
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
        # every action the LM head can emit (not the weight's shape: ZeRO-3 slices it)
        vocab_size = lm.config.vocab_size
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


# ---------------------------------------------------------------------------------------------
# The ILQL loss
# ---------------------------------------------------------------------------------------------


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


# the loss terms the non-finite guard checks before every backward
ILQL_LOSS_TERMS = ("loss", "loss_q", "loss_v", "loss_cql", "loss_awac")


def should_sync_target(update: int, steps_for_target_q_sync: int) -> bool:
    """True after optimizer update number `update` (1-based) when the target Q heads are synced: every
    steps_for_target_q_sync optimizer updates, independent of epochs."""
    return update % steps_for_target_q_sync == 0


# ---------------------------------------------------------------------------------------------
# One optimizer update: steps 3-5 on gradient_accumulation_steps micro batches
# ---------------------------------------------------------------------------------------------


def ilql_update(args: Args, accelerator, model, optimizer, run, update: int, micro_batches, pad_token_id: int):
    """Steps 3-5 of optimizer update `update`: gradient_accumulation_steps micro batches of this process, whose
    gradients accumulate into one AdamW step on the last of them; every loss term is checked by the non-finite
    guard before its backward. Returns this process's statistics of every micro batch (name -> list) and its input
    tokens (non-pad)."""
    update_stats: Dict[str, List[torch.Tensor]] = {}  # this process's micro batch statistics
    update_tokens = 0
    for _ in range(args.gradient_accumulation_steps):
        batch = next(micro_batches)
        cols = real_columns(batch["query_response"], pad_token_id)  # the right padding every row shares is cut
        query_responses = batch["query_response"][:, cols]  # (B, T)
        # 3. the states, actions and per-action rewards of each trajectory
        labels = batch["response_label"][:, cols]  # (B, T): the response tokens, [PAD] elsewhere
        positions, mask = action_positions(
            batch["query_token_len"], (labels != pad_token_id).sum(1), labels.size(1)
        )  # (B, Tr) states s_t and real-action mask
        actions = labels.gather(1, positions + 1).masked_fill(~mask, pad_token_id)  # (B, Tr): a_t
        step_rewards = terminal_rewards(batch["reward"].float(), mask)  # (B, Tr)
        with accelerator.accumulate(model):
            with accelerator.autocast():  # 4. every output read at the action states only
                lm_logits, qs, target_qs, values = model(query_responses, pad_token_id, positions)
            # 5. the ILQL loss
            loss, stats = ilql_loss(lm_logits, qs, target_qs, values, actions, step_rewards, mask, args.ilql)
            # non-finite guard: the total loss and every term, before backward, so no weight sees them
            run.guard(update, **{f"train/{key}": stats[key] for key in ILQL_LOSS_TERMS})
            accelerator.backward(loss)  # divided by gradient_accumulation_steps inside
            optimizer.step()  # a no-op until the last micro batch of the update
            optimizer.zero_grad()
        for key, value in stats.items():
            update_stats.setdefault(f"train/{key}", []).append(value.float())
        update_tokens += int((query_responses != pad_token_id).sum())
    if not accelerator.sync_gradients:
        raise RuntimeError("gradient accumulation went out of step with the update loop")
    return update_stats, update_tokens


# ---------------------------------------------------------------------------------------------
# Advantage-shifted sampling
# ---------------------------------------------------------------------------------------------


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
    rest with [PAD]: what is kept after truncation is the same as with the full length. With several
    processes it ends once every row of EVERY process holds one: under ZeRO-3 each forward pass gathers
    the weights from all processes, so all of them must run as many; a process whose rows are done
    runs the forward passes without sampling (its tokens and its random stream are those it stops with).
    A manual loop rather than `generate`: the logits need the heads' Q and V at every step."""
    batch = queries.size(0)
    attention_mask = queries != pad_token_id
    position_ids = attention_mask.long().cumsum(1) - attention_mask.long()  # left pads do not count
    input_ids = torch.masked_fill(queries, ~attention_mask, 0)
    responses = torch.full((batch, response_length), pad_token_id, dtype=queries.dtype, device=queries.device)
    cache, done = None, False
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
        if not done:  # (a process done before the others feeds its last tokens again, and keeps nothing)
            tokens = torch.multinomial(F.softmax(scores / temperature, dim=-1), num_samples=1)  # (B, 1)
            responses[:, t] = tokens[:, 0]
            done = bool((responses[:, : t + 1] == eos_token_id).any(1).all())
        running = torch.tensor([float(not done)], device=queries.device)  # the processes still sampling
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(running)
        if running.item() == 0:
            break
        input_ids = tokens
        attention_mask = torch.cat((attention_mask, torch.ones_like(tokens, dtype=torch.bool)), dim=1)
        position_ids = position_ids[:, -1:] + 1
    return torch.cat((queries, responses), dim=1)


@torch.no_grad()
def ilql_sample_table(accelerator, model, reward_model, tokenizer, raw, dataset, beta: float, args: Args):
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
        queries = queries[:, real_columns(queries, pad_id)]  # the left padding every query of the batch shares is cut
        context_length = queries.size(1)
        with accelerator.autocast():
            query_responses = ilql_generate(
                unwrapped, queries, pad_id, eos_id, args.response_length, beta, args.eval_temperature, args.top_k
            )
        responses = truncate_response(eos_id, pad_id, query_responses[:, context_length:])  # (B, Tr)
        if reward_model is not None:
            with accelerator.autocast():
                scores = get_score(reward_model, queries, responses, pad_id)
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
    metrics = {"eos_rate": float(has_eos.float().mean()), "response_token_len_mean": float(token_len.float().mean())}
    if reward_model is not None:
        metrics["score"] = float(scores.mean())
    if was_training:
        unwrapped.train()
    return table, metrics


def main(args: Args) -> dict:
    start_time = time.monotonic()
    # ---------------- processes, batch arithmetic (fails loudly), accelerator, run folder ----------------
    accelerator = make_ilql_accelerator(args)
    if args.model_path is None:
        args.model_path = DEFAULT_MODEL_PATHS[args.init_from]  # --init_from picks the starting model
    run = Run(args, accelerator)  # run name and folder (rlhf_utils/run.py)
    run.inputs(model_path=args.model_path, reward_model_path=args.reward_model_path,
               preference_dataset=args.preference_dataset, query_dataset=args.query_dataset)

    # ---------------- seeding (labelled, deliberate) ----------------
    set_seed(args.seed)  # weights (the fresh heads) and data order: identical on every rank
    local_seed = args.seed + accelerator.process_index * 100003  # sampling differs per rank

    # ---------------- tokenizer and models ----------------
    tokenizer = load_tokenizer(args.model_path, args.trust_remote_code)  # Detail 3: [PAD] distinct from EOS
    pad_token_id = tokenizer.pad_token_id
    model, reward_model = load_ilql_models(args, accelerator, tokenizer)

    # ---------------- data: steps 1-2 ----------------
    train_raw, eval_raw = load_data(args, tokenizer)
    run.claim_output_dir()  # every input check has passed: only now mark --output_dir as this run's
    trajectories = flatten_pairs(train_raw)  # 1. the (query, chosen) rows, then the (query, rejected) rows
    if args.reward_source == "labels":  # 2. trlX: +1 / -1
        raw_rewards = label_rewards(len(train_raw))
    else:  # 2. the RM's score of each trajectory
        raw_rewards = rm_rewards(accelerator, reward_model, trajectories, args.local_eval_batch_size, pad_token_id)
    rewards = normalize_rewards(raw_rewards)
    data_metrics = reward_statistics(raw_rewards, rewards, len(train_raw))
    trajectories = trajectories.add_column("reward", rewards.tolist())
    train_dataset = trajectories.with_format("torch", columns=TRAJECTORY_COLUMNS + ["reward"])
    eval_raw, eval_dataset = evaluation_queries(args, eval_raw)
    args.num_updates = num_updates = count_updates(args, len(trajectories))

    # ---------------- optimizer, schedule, data order ----------------
    # the target heads are not optimised: only parameters that require gradients go to AdamW
    adamw = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=args.lr, eps=args.eps, weight_decay=args.weight_decay
    )
    # counts optimizer updates, stepped by hand once per update (accelerate's wrapper would step per process)
    lr_scheduler = lr_schedule(adamw, args.scheduler, num_updates, args.warmup_steps)
    train_dataloader = DataLoader(
        train_dataset, batch_size=args.local_micro_batch_size, shuffle=True, drop_last=True,
        generator=torch.Generator().manual_seed(args.seed),
    )
    model, optimizer, train_dataloader = accelerator.prepare(model, adamw, train_dataloader)
    heads = accelerator.unwrap_model(model).heads
    # saved and restored with the model (LM, V, Q and target-Q heads) and the optimizer: the schedule, and the
    # float32 Polyak copies of low-precision targets
    accelerator.register_for_checkpointing(lr_scheduler)
    accelerator.register_for_checkpointing(TargetCopies(heads))
    torch.manual_seed(local_seed)  # draws differ across ranks from here on (evaluation: its own, evaluation_rng)

    # ---------------- resume: a killed run loses at most --checkpoint_every updates ----------------
    # the non-finite guard's fallback. The target heads' float32 copies change only after an update's guards (and are
    # big): they are not snapshot before every update
    last_good = LastGoodState(run, accelerator, adamw, lr_scheduler)
    # the trainer state: running counters and the open logging interval. The flags that fix the data order, the
    # schedule and the target syncs (the shape) must be those of the checkpoint's run
    counters = records.IlqlCounters(run.start(
        records.IlqlCounters.fresh(), num_updates=num_updates, total_batch_size=args.total_batch_size,
        world_size=args.world_size, steps_for_target_q_sync=args.ilql.steps_for_target_q_sync))
    if counters.update == 0:
        run.log(0, {"episode": 0, **data_metrics})  # a resumed run kept this line of metrics.jsonl
    evaluate = functools.partial(evaluate_and_save, run, accelerator, model, reward_model, tokenizer, eval_raw,
                                 eval_dataset, args)

    # ---------------- training: one optimizer update per total_batch_size trajectories ----------------
    accelerator.print(
        f"ILQL ({args.reward_source} rewards, from {args.init_from}): {num_updates} updates of "
        f"{args.total_batch_size} trajectories, {accelerator.num_processes} process(es) x "
        f"{args.gradient_accumulation_steps} accumulation x {args.local_micro_batch_size}"
    )
    model.train()
    progress = tqdm(total=num_updates, initial=counters.update, desc="ilql",
                    disable=not accelerator.is_local_main_process)
    # the data position is the update number itself (update x gradient_accumulation_steps micro batches)
    micro_batches = resumable_micro_batches(train_dataloader, counters.update * args.gradient_accumulation_steps)
    for update in range(counters.update + 1, num_updates + 1):
        update_start = time.monotonic()
        with last_good.kept(update, counters.state()):  # a non-finite loss leaves the state after update - 1 saved
            update_stats, update_tokens = ilql_update(args, accelerator, model, optimizer, run, update, micro_batches,
                                                      pad_token_id)  # steps 3-5
        # 6. Polyak-average the target Q heads every steps_for_target_q_sync OPTIMIZER updates. The decision reads
        # the global update number only, so a resumed run syncs on exactly the updates the uninterrupted one does
        if should_sync_target(update, args.ilql.steps_for_target_q_sync):
            heads.sync_target_q_heads(args.ilql.alpha)
            counters.num_target_syncs += 1
        counters.interval_tokens += add_update_means(accelerator, update_stats, update_tokens, counters.interval_stats)
        update_lr = lr_scheduler.get_last_lr()[0]  # the learning rate this update used
        lr_scheduler.step()
        counters.end_update(update, args.total_batch_size, time.monotonic() - update_start)
        progress.update(1)
        # ---------------- logging: averages over the interval since the last log ----------------
        if update % args.log_every == 0 or update == num_updates:
            metrics = counters.close_interval(update_lr, len(trajectories))
            run.log(update, {"episode": counters.episode, **metrics})
            progress.set_postfix(loss=f"{metrics['train/loss']:.4f}", awac=f"{metrics['train/loss_awac']:.3f}",
                                 tok_s=f"{metrics['train/tokens_per_s']:.0f}")
        if due(args.eval_every, update, num_updates):
            evaluate(update, counters.episode, [args.beta], final=False)
            counters.interval_start = time.monotonic()  # evaluation time is not training throughput
        if due(args.run.checkpoint_every, update, num_updates):
            run.checkpoint(update, counters.state())
    progress.close()

    # ---------------- final evaluation (7. the beta sweep) and outputs ----------------
    final_betas = list(dict.fromkeys(list(args.eval_betas) + [args.beta]))
    metrics = evaluate(counters.update, counters.episode, final_betas, final=True)
    summary = {**metrics, **counters.last_train_metrics, **data_metrics, **counters.totals(),
               "wall_time_s": time.monotonic() - start_time}
    accelerator.wait_for_everyone()
    models.save_ilql_model(accelerator, model, tokenizer, args)
    run.finish(summary)  # last: summary.json marks a finished run (the pipeline and ablate.py read it so)
    if args.run.push_to_hub and accelerator.is_main_process:  # --output_dir whole: the LM, its tokenizer and the heads
        models.upload_to_hub(args)
    accelerator.print(f"done in {time.monotonic() - start_time:.0f}s; run folder {run.dir}")
    return summary


# ---------------------------------------------------------------------------------------------
# The setup main runs on: processes and batch arithmetic, inputs, models, the data's metrics, evaluation, the target
# copies a checkpoint carries (refusals, counters, records and saving: rlhf_utils/)
# ---------------------------------------------------------------------------------------------


def make_ilql_accelerator(args: Args) -> Accelerator:
    """Join the processes, do the batch arithmetic (a batch that does not divide fails here) and make the
    accelerator: gradient accumulation over total_batch_size / (local_micro_batch_size x world_size) micro batches,
    the seeded data order, bf16 when asked (or available), and DeepSpeed's micro batch and clipping (Detail 8)."""
    # first: the batch arithmetic depends on the process count
    args.world_size = start_processes(args.run.process_group_timeout_min).num_processes
    gradient_accumulation_steps = exact_div(
        args.total_batch_size, args.local_micro_batch_size * args.world_size,
        "total_batch_size / (local_micro_batch_size x world_size)",
    )
    check_ilql_flags(args, gradient_accumulation_steps)
    args.gradient_accumulation_steps = gradient_accumulation_steps  # args.json records the value used
    if args.bf16 is None:
        args.bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    # gradient accumulation on the micro-step count, the seeded data order that resumable_micro_batches needs
    # (rlhf_utils/run.py)
    accelerator = seeded_accelerator(args.gradient_accumulation_steps, args.seed, args.bf16)
    configure_deepspeed(accelerator, args.local_micro_batch_size)  # Detail 8 (no-op without DeepSpeed)
    return accelerator


def load_data(args, tokenizer):
    """The preference split to train on and the query split to sample, checked for the columns this run reads, for
    the tokenizer that made them and (the train split) for responses that start where query_token_len says."""
    train_raw = checks.load_split(args.preference_dataset, args.train_split)
    checks.check_columns(train_raw, PAIR_COLUMNS + ["query_token_len"],
                         f"{args.preference_dataset} split {args.train_split!r}")
    checks.check_data_tokenizer(train_raw, tokenizer, args.model_path,
                                f"{args.preference_dataset} split {args.train_split!r}")
    checks.check_query_response(train_raw, tokenizer.pad_token_id,
                                f"{args.preference_dataset} split {args.train_split!r}")
    checks.check_response_starts(train_raw, tokenizer.pad_token_id,
                                 f"{args.preference_dataset} split {args.train_split!r}")
    eval_raw = checks.load_split(args.query_dataset, args.eval_split)
    checks.check_columns(eval_raw, ["query_token", "reference_response"],
                         f"{args.query_dataset} split {args.eval_split!r}")
    checks.check_data_tokenizer(eval_raw, tokenizer, args.model_path, f"{args.query_dataset} split {args.eval_split!r}")
    checks.check_query_response(eval_raw, tokenizer.pad_token_id, f"{args.query_dataset} split {args.eval_split!r}")
    return train_raw, eval_raw


def load_ilql_models(args, accelerator, tokenizer):
    """The two models of ILQL: the LM with fresh V, Q and target-Q heads (the only model that trains), and the
    frozen reward model when --reward_model_path is given (it labels the data with --reward_source rm and scores
    the evaluation samples; None otherwise)."""
    lm = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32,
                                              trust_remote_code=args.trust_remote_code)
    checks.check_finite(lm, args.model_path)
    # the config's row count, not the weight's shape: ZeRO-3 partitions weights as they load
    if len(tokenizer) > lm.config.vocab_size:
        lm.resize_token_embeddings(len(tokenizer))
    model = ILQLModel(models.checkpointed(lm, args.gradient_checkpointing), args.ilql.two_qs)
    if args.disable_dropout:  # Detail 7
        disable_dropout(model)
    reward_model = None
    if args.reward_model_path is not None:
        # the RM scores the policy's token ids as they are: one tokenizer for both (checked before any weights load)
        checks.check_reward_tokenizer(tokenizer, args.model_path, args.reward_model_path, args.trust_remote_code)
        reward_model = AutoModelForSequenceClassification.from_pretrained(
            args.reward_model_path, num_labels=1, dtype=torch.bfloat16 if args.bf16 else torch.float32,
            trust_remote_code=args.trust_remote_code,
        )
        checks.check_finite(reward_model, args.reward_model_path)
        if len(tokenizer) > reward_model.config.vocab_size:
            reward_model.resize_token_embeddings(len(tokenizer))
        disable_dropout(reward_model)  # frozen and deterministic whatever --disable_dropout says
        # Detail 8: under ZeRO-3, an inference engine
        reward_model = models.prepare_frozen_model(accelerator, reward_model)
    return model, reward_model


def reward_statistics(raw_rewards: torch.Tensor, rewards: torch.Tensor, num_pairs: int) -> dict:
    """The data/ metrics of the trajectory rewards (raw, and z-normalised by side of the pair)."""
    return {
        "data/raw_reward_mean": float(raw_rewards.mean()), "data/raw_reward_std": float(raw_rewards.std()),
        "data/reward_chosen_mean": float(rewards[:num_pairs].mean()),
        "data/reward_rejected_mean": float(rewards[num_pairs:].mean()),
        # how often the rewards respect the human label r_chosen > r_rejected (1 for +-1 labels; trlX's
        # explanation of why the labels beat RM scores)
        "data/pair_order_agreement": float((rewards[:num_pairs] > rewards[num_pairs:]).float().mean()),
    }


def evaluation_queries(args, eval_raw):
    """The first --num_eval_samples rows of the query split, and the same rows with their row index as a torch
    dataset (ilql_sample_table gathers its rows back in that order)."""
    if args.num_eval_samples is not None:
        eval_raw = eval_raw.select(range(min(args.num_eval_samples, len(eval_raw))))
    eval_dataset = eval_raw.add_column("row_index", list(range(len(eval_raw))))
    return eval_raw, eval_dataset.with_format("torch", columns=["query_token", "row_index"])


def add_update_means(accelerator, update_stats: dict, update_tokens: int, interval_stats: dict) -> int:
    """Append the update's statistics over every process to the logging interval; returns the update's tokens on all
    processes. Every process has the same number of micro batches, so the mean of these per-update means over an
    interval is the mean over all its micro batches."""
    keys = list(update_stats)
    update_means = accelerator.reduce(torch.stack([torch.stack(update_stats[k]).mean() for k in keys]),
                                      reduction="mean")
    for key, value in zip(keys, update_means.tolist()):
        interval_stats.setdefault(key, []).append(value)
    return int(accelerator.reduce(torch.tensor(update_tokens, device=accelerator.device), reduction="sum"))


def evaluate_and_save(run, accelerator, model, reward_model, tokenizer, eval_raw, eval_dataset, args,
                      update: int, episode: int, betas: List[float], final: bool) -> dict:
    """Sample the evaluation queries at each beta (ilql_sample_table) and log the metrics; the table of --beta
    becomes samples/step_N.csv (and samples.csv at the end), each swept beta samples_beta{b}.csv
    (records.write_ilql_evaluation)."""
    tables, beta_metrics = {}, {}
    for beta in betas:
        # evaluation samples from its own random stream, the same at every evaluation and beta (evaluation_rng): how
        # often and how much a run evaluates never changes what it trains
        with evaluation_rng(accelerator, args.seed + accelerator.process_index * 100003):
            tables[beta], beta_metrics[beta] = ilql_sample_table(accelerator, model, reward_model, tokenizer, eval_raw,
                                                                 eval_dataset, beta, args)
    return records.write_ilql_evaluation(run, accelerator, args, update, episode, tables, beta_metrics, final)


class TargetCopies:
    """The float32 copies of low-precision target heads (ILQLHeads.target_fp32) as an object that accelerate's
    save_state / load_state can carry (register_for_checkpointing needs state_dict and load_state_dict).

    The target heads themselves are parameters of the prepared model and travel with it; the float32 copies are
    plain tensors that no module owns, and under bf16 they hold the precise Polyak average. Without them a
    resumed bf16 run would restart the average from the rounded targets and drift from the uninterrupted run.
    In float32 (CPU, or DDP without DeepSpeed) there are no copies and the state is just None."""

    def __init__(self, heads: ILQLHeads):
        self.heads = heads

    def state_dict(self) -> dict:
        copies = self.heads.target_fp32
        return {"target_fp32": None if copies is None else [c.detach().cpu() for c in copies]}

    def load_state_dict(self, state: dict) -> None:
        copies = state["target_fp32"]
        targets = list(self.heads.target_q_heads.parameters())
        self.heads.target_fp32 = None if copies is None else [c.to(t.device) for c, t in zip(copies, targets)]


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


def get_score(reward_model, queries: torch.Tensor, responses: torch.Tensor, pad_token_id: int,
              reward=get_reward) -> torch.Tensor:
    """RM scores (B,) of left-padded queries (B, Tq) and right-padded responses (B, Tr), read at the EOS
    (Detail 12), computed on the columns that hold a real token in some row by `reward` (get_reward, or
    get_reward_query_once: each query once, --query_once)."""
    query_responses = torch.cat((queries, responses), 1)
    cols = real_columns(query_responses, pad_token_id)
    start = min(cols.start, queries.size(1))
    return reward(reward_model, query_responses[:, start : cols.stop], pad_token_id, queries.size(1) - start)[1]


def truncate_response(eos_token_id: int, pad_token_id: int, responses: torch.Tensor) -> torch.Tensor:
    """Detail 23: keep each response up to and including its first EOS, fill the rest with [PAD]."""
    eos_index = first_true_indices(responses == eos_token_id).unsqueeze(-1)  # (B, 1)
    positions = torch.arange(responses.size(1), device=responses.device).unsqueeze(0)  # (1, T)
    return torch.masked_fill(responses, positions > eos_index, pad_token_id)


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


def count_updates(args, num_rows: int) -> int:
    """Optimizer updates of the run: --total_episodes rows (None: num_train_epochs passes over the num_rows of the
    train data) in full batches of total_batch_size; a last partial batch is dropped."""
    total_episodes = args.total_episodes if args.total_episodes is not None else args.num_train_epochs * num_rows
    num_updates = total_episodes // args.total_batch_size
    if num_updates < 1:
        raise RunError(f"{total_episodes} episodes give no full batch of {args.total_batch_size}; raise "
                       "--total_episodes (or --num_train_epochs) or lower --total_batch_size")
    return num_updates


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
