"""Online (iterative) DPO: DPO on pairs the policy itself samples, labelled by a judge while it trains (Guo et al.
2024, "Direct Language Model Alignment from Online AI Feedback"; OpenRLHF, Appendix A.6). A fork of dpo.py: the loss,
its variants and the evaluation are dpo.py's; what changes is where the pairs come from.

The policy and a frozen reference both start from the SFT model. The run is a sequence of rounds of pairs_per_round
prompts each (pairs_per_round / total_batch_size optimizer updates); round r is:

  1. pairs_per_round prompts of the query split (a fresh permutation each pass, Detail 21)
  2. TWO responses to each prompt sampled from the current policy at --temperature: exactly response_length tokens,
     truncated after the first EOS (Detail 23). Each response's noise has a seed of its own (seed, prompt batch,
     prompt index, 0 or 1): the samples depend neither on the batch nor on the number of processes
  3. a judge labels each pair: a response without EOS loses to one with EOS (--non_eos_penalty); otherwise the reward
     model (the score at the EOS, Detail 12), an OpenAI-compatible judge with the paper's prompt (Appendix I) or a
     reward from code (--judge reward_fn, the user's --reward_fn) picks the chosen one. Ties, identical responses and
     unparseable answers are dropped and counted: they weigh 0 in the update, as a GRPO group of equal scores has
     advantage 0 (--max_draws_per_round > 1 replaces them by pairs of further prompt batches instead, which sample more
     than the budget: budget/responses_sampled counts them)
  4. the reference's sequence log-probs of the round's pairs, computed once: the SFT model (--reference sft), or the
     policy as it is now, at the end of the last round (--reference last_round)
  5. DPO updates on the round's pairs, each pair once, in the order drawn: steps 1-6 of dpo.py (a slot left empty
     after the last prompt batch weighs 0)
With pairs_per_round = total_batch_size (the default) every update samples its own pairs (fully online, as Guo et
al.); larger rounds sample less often, with the policy of the round's start (iterative DPO; --reference last_round).
Evaluation: the log-ratios give DPO's implicit reward model r(x, y) = beta * log(pi(y|x) / pi_ref(y|x)) (eq. 5),
whose accuracy on the validation pairs goes in the same table as reward.py's (Detail 19); samples of the policy
go to samples.csv.

Single process:   python online_dpo.py --sft_model_path models/sft --reward_model_path models/rm
Gold judge:       python data/gold_judge_server.py --port 8011 &   (prints its URL and model id)
                  python online_dpo.py --judge endpoint --endpoint.base_url http://127.0.0.1:8011/v1 \
                      --endpoint.model gold-judge-<digest>   (a real API: OPENAI_API_KEY from the environment)
Several GPUs:     accelerate launch --config_file zero2.yaml online_dpo.py --sft_model_path models/sft
LoRA / QLoRA:     ... --lora_rank 8 [--load_in_4bit]: the SFT reference is the policy with its adapters off; the saved
                  policy has them merged (float32)
After a crash:    the same command with --resume (and --run_name of the run, if it is not the newest): it continues
                  from the latest checkpoint in runs/{run_name}/checkpoints (policy, AdamW, schedule, data position,
                  open logging interval, RNG states; the current round's judged pairs and their reference log-probs)
                  and ends exactly like an uninterrupted run (--checkpoint_every sets how often). A NaN or inf loss,
                  log-prob or reward-model score stops the run before it reaches the weights, and the state after the
                  last good update is saved as a checkpoint to resume from.
"""
import hashlib
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Annotated, Dict, List, Literal, NamedTuple, Optional, Tuple

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
import tyro
from accelerate import Accelerator, PartialState
from accelerate.utils import set_seed
from datasets import Dataset, get_dataset_split_names, load_from_disk
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
)

from rlhf_utils import checks, models, records
from rlhf_utils.checks import RunError
from rlhf_utils.flags import EndpointFlags, RunFlags, check_dpo_flags, check_online_dpo_flags
from rlhf_utils.rewards import RewardFunctions, load_reward_fn
from rlhf_utils.run import LastGoodState, Run, due, evaluation_rng, leave_processes, seeded_accelerator, start_processes


@dataclass
class EndpointArgs(EndpointFlags):
    """--judge endpoint: an OpenAI-compatible chat endpoint asked with the paper's pairwise prompt (judge.py's client
    and flags; the API key is read from OPENAI_API_KEY only, never from a flag, and never logged or saved). The flags
    of how a reply is fetched (base_url, concurrency, retries, backoff, timeout, rate limits, the cache's file) are
    EndpointFlags' (rlhf_utils/flags.py); these are the ones that decide a verdict"""

    model: str = "gpt-3.5-turbo-0125"
    """judge model (the paper's reference code: gpt-3.5-turbo-0125; the built-in task: gold-judge-<digest>)"""
    system_prompt: str = "You are a helpful assistant."
    """system message sent before the judge prompt (the reference code's)"""
    temperature: Optional[float] = None
    """sampling temperature of the judge; None sends none (the API default)"""
    max_parse_tries: int = 3
    """asks per pair when the reply has no parseable verdict (then the pair is invalid and dropped)"""
    strip_eos_text: str = "<|endoftext|>"
    """an EOS spelling removed from the end of each response before the judge reads it ("" keeps it)"""


@dataclass
class Args:
    # experiment bookkeeping
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (the script's file stem)"""
    seed: int = 1
    """seed of weights, prompt order and of each prompt's two responses (from seed, round and prompt index, the same
    on any number of processes); the evaluation samples use seed + process_index * 100003"""
    output_dir: str = "models/online_dpo"
    """where the trained policy and its tokenizer are saved (safetensors)"""

    # models and data
    sft_model_path: str = "models/sft"
    """the SFT model (local folder written by sft.py, or a hub name): the policy's start, the reference of
    --reference sft and of the evaluation"""
    trust_remote_code: bool = False
    """passed to from_pretrained for models with custom code"""
    preference_dataset: str = "vwxyzjn/summarize_from_feedback_oai_preprocessing_1706381144"
    """processed preference pairs (hub name, or a local save_to_disk folder from data/prepare.py), read for the
    evaluation only (Detail 19): the training pairs are sampled and judged during the run"""
    query_dataset: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """processed SFT dataset: its --train_split queries are the prompts, its --eval_split queries are sampled for
    the generation table"""
    train_split: str = "train"
    """split of --query_dataset whose queries are the prompts (Detail 21: reused, reshuffled each pass)"""
    eval_splits: Optional[List[str]] = None
    """preference splits for the implicit-reward accuracy table; None = every split whose name starts
    with "validation" (TL;DR: validation and validation_cnndm)"""
    eval_split: str = "validation"
    """split of --query_dataset whose queries are sampled for samples.csv"""

    # online pairs: sampling, judging, reference
    judge: Literal["rm", "endpoint", "reward_fn"] = "rm"
    """who labels each sampled pair: the reward model (the higher score at the EOS, Detail 12), an OpenAI-compatible
    judge with the paper's prompt (--endpoint.*; the built-in task's gold judge, or an LLM), or a reward from code
    (--reward_fn: the higher of its two scores; no reward model is loaded)"""
    reward_model_path: str = "models/rm"
    """--judge rm: the reward model (saved by reward.py), trained with the policy's tokenizer"""
    reward_fn: Optional[List[str]] = None
    """--judge reward_fn: path.py:function ..., rewards from code as ppo.py's --reward_fn; the higher of a pair's two
    scores wins, equal scores are a tie: the pair is dropped and counted (docs/usage.md, "Flags in depth")"""
    reward_fn_weights: Optional[List[float]] = None
    """--judge reward_fn: one weight per --reward_fn function, in its sum (TRL's reward_weights); None = 1 each"""
    reward_fn_timeout_min: float = 10.0
    """minutes one call of a --reward_fn function may take before the run stops with an error naming it and its batch
    (ours: TRL has no limit; a slow call within it changes nothing; docs/usage.md, "Flags in depth")"""
    endpoint: EndpointArgs = field(default_factory=EndpointArgs)
    """--judge endpoint: the judge's endpoint, model and retry policy"""
    reference: Literal["sft", "last_round"] = "sft"
    """the reference pi_ref of the loss: the SFT model, or the policy at the end of the last round (iterative DPO; the
    first round's is SFT), which needs rounds of several updates (--pairs_per_round): a round of one update would make
    the reference the policy itself, with no KL anchor. The evaluation's implicit reward is measured against SFT"""
    pairs_per_round: Optional[int] = None
    """prompts sampled (one candidate pair each) per round, a multiple of total_batch_size, whose pairs are trained on
    once, in pairs_per_round / total_batch_size updates; None = total_batch_size: fresh pairs every update (online)"""
    temperature: float = 1.0
    """sampling temperature of the two responses (1 = the policy itself, as the online DPO objective assumes); > 0"""
    non_eos_penalty: bool = True
    """Detail 23 (EOS trick) for pairs: a response without EOS loses to one with EOS whatever the judge says, two
    without EOS are a tie (dropped), as ppo.py's --non_eos_penalty scores both alike; off: every pair goes to the
    judge"""
    max_draws_per_round: int = 1
    """prompt batches (of pairs_per_round prompts each) a round may sample. 1 (the budget rule of every online
    method): each prompt of the run is sampled once, a dropped pair weighs 0. More: a dropped pair is replaced by one
    of the next whole batch, sampled on top of the budget (docs/usage.md, "Flags in depth")"""
    local_rollout_forward_batch_size: int = 64
    """prompts per generation / scoring chunk on one process (memory knob; the samples do not depend on it)"""

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
    num_train_epochs: int = 1
    """passes over the prompts of --train_split (with --total_episodes None)"""
    total_episodes: Optional[int] = None
    """the budget, in prompts: each gets a pair of sampled responses (2 x total_episodes responses in all; with
    --max_draws_per_round > 1 the redrawn batches come on top); None = num_train_epochs x the prompt split"""
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
    """pairs (or queries for sampling) per forward pass during evaluation and for the round's reference log-probs"""
    disable_dropout: bool = True
    """Detail 7: turn dropout off in the policy (the reference always runs with dropout off)"""
    bf16: Optional[bool] = None
    """bf16 mixed precision, as the paper trained (Detail 8); None = on when a CUDA device supports bf16. The CPU
    runs float32 unless --bf16 asks for bf16 (slow; the tests use it to exercise the GPU's dtype path)"""
    gather_for_generation: bool = True
    """under ZeRO-3, gather the policy's weights once for each generate call (the pairs of each round, the
    evaluation's samples) instead of layer by layer at every decode step (as TRL's unwrap_model_for_generation does);
    the same samples either way. Off: for a model too large to hold whole on one device. No effect without ZeRO-3"""
    gradient_checkpointing: bool = False
    """activation checkpointing in every model that trains here: less activation memory for about one more forward
    pass; the loss and gradients are the same. Off: the paper trained without it (docs/usage.md, "Flags in depth")"""
    query_once: bool = True
    """run each query once for both of its responses (keys and values reused) in the policy, the reference and the
    reward model: the same numbers, less compute. Off, and the policy under --gradient_checkpointing: whole rows"""

    # memory: LoRA and QLoRA
    lora_rank: int = 0
    """LoRA rank of the policy adapters (peft); the SFT reference (--reference sft, and the evaluation's) is the policy
    with adapters disabled; 0 = off"""
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
# Steps 1-4, the online pairs: two responses to each prompt, the judge's labels, the round's pairs and their
# reference log-probs
# ---------------------------------------------------------------------------------------------


def sample_seed(seed: int, draw: int, prompt_index: int, k: int) -> int:
    """The seed of response k (0 or 1) to row `prompt_index` of the prompt split in prompt batch number `draw` (the
    round's number as long as no dropped pair has been replaced; a prompt appears at most once in a batch): 63 bits of
    a digest of the four numbers, so it depends on nothing else (not the batch, not the process that samples it)."""
    digest = hashlib.sha256(f"{seed}/{draw}/{prompt_index}/{k}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class GumbelSampler(LogitsProcessor):
    """Sampling from softmax(logits / T) inside a greedy generate, each row with its own torch.Generator. HF generate
    draws every row's tokens from the one global RNG, so a row's tokens would depend on the rows sampled before it: on
    the batch, and on how the prompts are split across processes. The Gumbel-max trick puts the randomness into the
    scores instead: with G_v = -log(-log U_v), U_v uniform on (0, 1), argmax_v (logits_v / T + G_v) is a draw from
    softmax(logits / T), and greedy decoding picks that argmax. So a row's tokens depend only on its seed and on its
    own logits. Banned tokens ([PAD]) stay at -inf."""

    def __init__(self, generators: List[torch.Generator], temperature: float):
        self.generators, self.temperature = generators, temperature

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # one draw of V uniforms per row and step, on the generator's device (the scores', see sample_pairs: no
        # B x V copy per step); U = 0 (-log(-log 0) = -inf) is moved to the smallest float
        uniform = torch.stack([torch.rand(scores.size(1), generator=g, device=g.device) for g in self.generators])
        gumbel = -torch.log(-torch.log(uniform.clamp_(min=torch.finfo(torch.float32).tiny)))  # (B, V)
        return scores.float() / self.temperature + gumbel


@torch.no_grad()
def sample_pairs(args, lm, queries: torch.Tensor, prompt_indices: torch.Tensor, draw: int, tokenizer) -> torch.Tensor:
    """Step 2: two responses (B, 2, Tr) at --temperature to each left-padded query (B, Tq). Detail 23: exactly
    response_length new tokens ([PAD] banned, no stop at EOS), then truncated after the first EOS. Response k to the
    prompt in row prompt_indices[i] draws its noise from sample_seed(args.seed, draw, prompt_indices[i], k)."""
    pad_token_id = tokenizer.pad_token_id
    queries = queries.repeat_interleave(2, dim=0)  # rows 2i and 2i + 1: the two responses to prompt i
    queries = queries[:, real_columns(queries, pad_token_id)]  # the left padding every row shares is cut
    # each row's generator lives where the model computes: a seed draws the same noise on every device of one type
    generators = [torch.Generator(queries.device).manual_seed(sample_seed(args.seed, draw, int(p), k))
                  for p in prompt_indices.tolist() for k in (0, 1)]
    attention_mask = queries != pad_token_id
    sequences = lm.generate(  # decoding greedily the scores GumbelSampler made noisy: a draw at --temperature
        input_ids=torch.masked_fill(queries, ~attention_mask, 0), attention_mask=attention_mask,
        generation_config=sampling_config(args, tokenizer, 0.0),
        logits_processor=LogitsProcessorList([GumbelSampler(generators, args.temperature)]),
    )
    responses = truncate_response(tokenizer.eos_token_id, pad_token_id, sequences[:, queries.size(1):])  # (2B, Tr)
    return responses.view(-1, 2, responses.size(1))


TIE, INVALID = -1, -2  # judge verdicts besides 0 (the first response is better) and 1 (the second is)


def judged_pairs(has_eos: torch.Tensor, identical: torch.Tensor, non_eos_penalty: bool):
    """Which pairs the EOS rule decides (B,), which it drops (B,: neither response has an EOS) and which go to the
    judge (B,), from has_eos (B, 2) and identical (B,). Identical responses are a tie that no judge is asked about
    (their DPO gradient is 0 anyway)."""
    if not non_eos_penalty:
        nobody = torch.zeros_like(identical)
        return nobody, nobody, ~identical
    by_eos = (has_eos[:, 0] != has_eos[:, 1]) & ~identical  # Detail 23: the response with an EOS wins
    no_eos = ~has_eos.any(1) & ~identical  # both get ppo.py's penalty score: no preference
    return by_eos, no_eos, ~identical & ~by_eos & ~no_eos


def label_pairs(verdicts: torch.Tensor, has_eos: torch.Tensor, identical: torch.Tensor, non_eos_penalty: bool):
    """Step 3: the index (0 or 1) of the chosen response of each pair (B,), which pairs are kept (B,) and the counts
    of the round. The judge's verdicts (B,) are read only for the pairs judged_pairs sends it: 0 or 1 is its choice,
    TIE (equal scores) and INVALID (no parseable answer) drop the pair. A dropped pair is counted, never a coin flip."""
    by_eos, no_eos, asked = judged_pairs(has_eos, identical, non_eos_penalty)
    chosen = torch.where(by_eos, has_eos[:, 1].long(), (verdicts == 1).long())
    keep = by_eos | (asked & (verdicts >= 0))
    counts = {
        "pairs": int(identical.numel()), "pairs_kept": int(keep.sum()), "decided_by_eos": int(by_eos.sum()),
        "dropped_ties": int((identical | (asked & (verdicts == TIE))).sum()),
        "dropped_invalid": int((asked & (verdicts == INVALID)).sum()), "dropped_no_eos": int(no_eos.sum()),
    }
    return chosen, keep, counts


def rm_verdicts(scores: torch.Tensor) -> torch.Tensor:
    """--judge rm: the verdict of each pair from its two reward-model scores (B, 2): the higher wins, equal is a TIE."""
    return torch.where(scores[:, 0] > scores[:, 1], 0, torch.where(scores[:, 1] > scores[:, 0], 1, TIE))


def endpoint_verdicts(judge_args, cache_path: str, posts: List[str], firsts: List[str], seconds: List[str],
                      asked: torch.Tensor):
    """--judge endpoint: the verdicts (B,) of the asked pairs, and the client's counts. Each asked pair gets the
    paper's prompt (Appendix I) with its two responses in an order drawn from the pair's texts (pair_order: the
    judge's position bias cannot favour response 0), through the judge's client (judge_client.run_cached_jobs):
    concurrent requests, retries with backoff, re-asks of an unparseable reply, and the reply cache. A reply that never
    parses, or a request that failed for good, is INVALID; two texts that read the same are a TIE, not asked. Pairs
    not asked stay TIE."""
    from rlhf_utils.judge_client import run_cached_jobs  # here, not at the top: the client loads openai (~0.5 s)

    verdicts, jobs, asked_rows = torch.full((len(posts),), TIE), [], []
    for i in asked.nonzero().flatten().tolist():
        first, second = (without_eos_text(text, judge_args.strip_eos_text) for text in (firsts[i], seconds[i]))
        if first == second:
            continue
        swap = pair_order(judge_args.seed, posts[i], first, second)  # 1: the second response is Summary A
        jobs.append((pairwise_prompt(posts[i], *((second, first) if swap else (first, second))), parse_verdict))
        asked_rows.append((i, swap))
    outcomes, stats = run_cached_jobs(judge_args, jobs, cache_path)
    for (i, swap), outcome in zip(asked_rows, outcomes):
        verdicts[i] = INVALID if outcome.status != "ok" else int((outcome.parsed[0] == "B") != bool(swap))
    return verdicts, stats


def judge_on_main(args, accelerator, run, queries, responses, has_eos, identical, tokenizer) -> torch.Tensor:
    """--judge endpoint: the main process asks the judge about the pairs (one client, one cache file) and sends the
    verdicts (N,) to the others (judge_client.on_main_process). A judge that cannot be used at all stops every process
    with the same error."""
    from rlhf_utils.judge_client import endpoint_client_args, on_main_process  # loaded by --judge endpoint alone

    pad_token_id = tokenizer.pad_token_id

    def ask() -> List[int]:  # on the main process: what the judge reads, the texts without [PAD]
        posts = [tokenizer.decode(q[q != pad_token_id], skip_special_tokens=True).strip() for q in queries]
        texts = [[tokenizer.decode(r[r != pad_token_id], skip_special_tokens=True) for r in pair] for pair in responses]
        _, _, asked = judged_pairs(has_eos, identical, args.non_eos_penalty)
        judge_args, cache_path = endpoint_client_args(args.endpoint, args.seed, run.dir)
        verdicts, _ = endpoint_verdicts(judge_args, cache_path, posts, [t[0] for t in texts], [t[1] for t in texts],
                                        asked)
        return verdicts.tolist()

    return torch.tensor(on_main_process(accelerator, ask))


class JudgedPairs(NamedTuple):
    """One prompt batch after steps 1-3, whole on every process, in the order of the global prompt batch."""
    queries: torch.Tensor  # (N, Tq), left-padded
    responses: torch.Tensor  # (N, 2, Tr), truncated after the first EOS
    chosen: torch.Tensor  # (N,): the index (0 or 1) of the chosen response
    keep: torch.Tensor  # (N,): False for a dropped pair
    counts: Dict[str, int]  # label_pairs' counts
    scores: Optional[torch.Tensor]  # (N, 2): the reward model's (or --reward_fn's) scores; None with --judge endpoint


@torch.no_grad()
def draw_pairs(args, accelerator, run, policy, reward_model, reward_fn, prompts, tokenizer, draw: int,
               update: int) -> JudgedPairs:
    """Steps 1-3 for prompt batch `draw` (1, 2, ...): two responses to each prompt, labelled; whole on every process."""
    pad_token_id, device = tokenizer.pad_token_id, accelerator.device
    # 1. this process's share of the prompts (Detail 21: every process draws the same permutation)
    rows = shuffled_query_batch(len(prompts), args.pairs_per_round, args.seed, draw - 1, accelerator.process_index,
                                accelerator.num_processes)
    queries = prompts[rows.tolist()]["query_token"]  # (n, Tq), left-padded
    # 2. two responses per prompt from the current policy; --judge rm scores them here, on the same chunks
    policy.eval()
    responses, scores = [], []
    for chunk in torch.arange(rows.numel()).split(args.local_rollout_forward_batch_size):
        chunk_queries = queries[chunk].to(device)
        with accelerator.autocast(), models.gathered_for_generation(policy, args.gather_for_generation):
            pair = sample_pairs(args, accelerator.unwrap_model(policy), chunk_queries, rows[chunk], draw, tokenizer)
            both = chunk_queries.repeat_interleave(2, 0), pair.flatten(0, 1)  # the two responses of each pair
            if reward_model is not None:  # Detail 12: the score at the EOS
                reward = get_reward_query_once if args.query_once else get_reward  # each query once (--query_once)
                scores.append(get_score(reward_model, *both, pad_token_id, reward).float().view(-1, 2))
            elif reward_fn is not None:  # --judge reward_fn: the user's function, on this process's prompts
                scores.append(function_scores(torch.zeros((len(both[0]), 0), device=device), reward_fn, tokenizer,
                                              *both, prompts, rows[chunk].repeat_interleave(2).tolist()).view(-1, 2))
        responses.append(pair)
    policy.train()
    gathered = accelerator.gather((queries.to(device), torch.cat(responses)) + ((torch.cat(scores),) if scores else ()))
    queries, responses = gathered[0].cpu(), gathered[1].cpu()  # (N, Tq), (N, 2, Tr)
    has_eos = (responses == tokenizer.eos_token_id).any(2)  # (N, 2)
    identical = (responses[:, 0] == responses[:, 1]).all(1)  # (N,)
    # 3. the judge's verdicts, then the labels (Detail 23 first: a response without EOS loses)
    scores = gathered[2].cpu() if len(gathered) > 2 else None  # (N, 2): the reward model's or --reward_fn's
    if scores is not None:
        run.guard(update, **{"online/scores": scores})  # a NaN score would decide a label
        verdicts = rm_verdicts(scores)
    else:
        verdicts = judge_on_main(args, accelerator, run, queries, responses, has_eos, identical, tokenizer)
    return JudgedPairs(queries, responses, *label_pairs(verdicts, has_eos, identical, args.non_eos_penalty), scores)


def pair_columns(queries: torch.Tensor, responses: torch.Tensor, chosen: torch.Tensor, pad_token_id: int):
    """The round's pairs in the processed preference schema that dpo.py trains on (PAIR_COLUMNS): left-padded query
    (N, Tq) + right-padded chosen or rejected response (N, 2, Tr), and the same with the query as [PAD] (labels)."""
    rows = torch.arange(queries.size(0))
    columns = {}
    for side, index in (("chosen", chosen), ("rejected", 1 - chosen)):
        response = responses[rows, index]  # (N, Tr)
        columns[f"query_{side}_token"] = torch.cat((queries, response), 1)
        columns[f"query_{side}_token_response_label"] = torch.cat((torch.full_like(queries, pad_token_id), response), 1)
    return columns


class OnlineRounds:
    """The round on hand: its pairs in PAIR_COLUMNS (sampled by the policy of the round's start, which a resumed run no
    longer has), which of them are kept, their reference log-probs (N, 2); the prompt batches drawn so far in the run
    and the counts summed over the rounds. Registered for checkpointing, and with the non-finite fallback."""

    def __init__(self):
        self.index, self.draws, self.pairs, self.keep, self.ref_table, self.totals = 0, 0, None, None, None, {}

    def start(self, index: int, draws: int, pairs: Dict[str, torch.Tensor], keep: torch.Tensor, ref_table: torch.Tensor,
              counts: Dict[str, int]) -> None:
        self.index, self.draws, self.pairs, self.keep, self.ref_table = index, draws, pairs, keep, ref_table
        self.totals = {key: self.totals.get(key, 0) + value for key, value in counts.items()}

    def state_dict(self) -> dict:
        return {**vars(self), "totals": dict(self.totals)}  # (start replaces the tensors, never writes into them)

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(state)


def online_round(args, accelerator, run, rounds: OnlineRounds, policy, ref_model, reward_model, reward_fn, prompts,
                 tokenizer, round_index: int, update: int) -> None:
    """Steps 1-4 of round `round_index`, whose first update is `update`, into `rounds` (on every process): prompt
    batches are drawn until pairs_per_round pairs are kept (at most --max_draws_per_round batches, by default one; a
    dropped pair is replaced by a pair of the next batch), the kept pairs in the order drawn, then the reference's
    log-probs of them."""
    start_time, draws, counts, batches = time.monotonic(), rounds.draws, {}, []
    # The budget rule of ppo.py, rloo.py and grpo.py: --total_episodes counts every response sampled, and each update
    # samples its batch once, whatever the responses turn out to be worth (a GRPO group of equal scores has advantage
    # 0; it is not redrawn). With --max_draws_per_round 1 online DPO does the same: every prompt is sampled once, a
    # pair the judge cannot separate weighs 0, and the run samples 2 x total_episodes responses (in whole batches,
    # as ppo.py's total_episodes: 2 x num_updates x total_batch_size). A redraw
    # samples a whole further batch on top of that budget; rounds.totals["pairs"] counts every prompt drawn, and the
    # summary's budget/responses_sampled (what the leaderboard states) is twice it.
    while True:
        draws += 1
        batches.append(draw_pairs(args, accelerator, run, policy, reward_model, reward_fn, prompts, tokenizer, draws,
                                  update))
        counts = {key: counts.get(key, 0) + value for key, value in batches[-1].counts.items()}
        if counts["pairs_kept"] >= args.pairs_per_round or draws - rounds.draws == args.max_draws_per_round:
            break
    queries, responses, chosen, keep = (torch.cat([getattr(batch, name) for batch in batches])
                                        for name in ("queries", "responses", "chosen", "keep"))
    # the first pairs_per_round kept pairs; when too few were kept, dropped ones fill the round with weight 0
    order = torch.cat((keep.nonzero().flatten(), (~keep).nonzero().flatten()))[: args.pairs_per_round]
    queries, responses, chosen, keep = queries[order], responses[order], chosen[order], keep[order]
    # 4. the pairs in dpo.py's schema and the reference's log-probs of them: the SFT model, or the policy as it is now
    pairs = pair_columns(queries, responses, chosen, tokenizer.pad_token_id)
    dataset = with_row_index(Dataset.from_dict({name: column.tolist() for name, column in pairs.items()}), PAIR_COLUMNS)
    reference = policy if args.reference == "last_round" else ref_model
    policy.eval()
    ref_table = precompute_reference_logprobs(accelerator, reference, dataset, args.local_eval_batch_size,
                                              tokenizer.pad_token_id, args.query_once)
    policy.train()
    counts.update({"draws": draws - rounds.draws, "pairs_trained": int(keep.sum())})
    rounds.start(round_index, draws, pairs, keep, ref_table, counts)

    has_eos = (responses == tokenizer.eos_token_id).any(2)  # of the round's pairs
    token_len = torch.where(has_eos, first_true_indices(responses == tokenizer.eos_token_id) + 1, responses.size(2))
    metrics = {f"online/{key}": value for key, value in counts.items()}
    metrics.update({"online/round": round_index, "online/eos_rate": float(has_eos.float().mean()),
                    "online/response_token_len_mean": float(token_len.float().mean()),
                    "online/round_s": time.monotonic() - start_time,
                    "budget/responses_sampled": 2 * rounds.totals["pairs"]})  # the run's so far, every draw counted
    if batches[0].scores is not None and keep.any():  # --judge rm or reward_fn
        scores = torch.cat([batch.scores for batch in batches])[order][keep]  # (kept, 2)
        metrics["online/scores_chosen"] = float(scores.gather(1, chosen[keep].unsqueeze(1)).mean())
        metrics["online/scores_rejected"] = float(scores.gather(1, 1 - chosen[keep].unsqueeze(1)).mean())
    # logged at the round's first update: after any checkpoint taken before the round, so a resumed run neither keeps
    # a stale copy of this line nor writes it twice
    run.log(update, metrics)
    records.print_round_drops(accelerator, round_index, counts, args.pairs_per_round)  # when it dropped pairs: why


# ---------------------------------------------------------------------------------------------
# The update: the docstring's steps on one batch (the pieces it shares with the forks follow main)
# ---------------------------------------------------------------------------------------------


TRAIN_STATS = [  # per update: means over its kept pairs (and their count), logged as means over the logging interval
    "train/loss", "train/rewards/chosen", "train/rewards/rejected", "train/rewards/margins", "train/rewards/accuracy",
    "train/logps/chosen", "train/logps/rejected", "train/pairs",
]


def online_dpo_update(args, accelerator, run, policy, optimizer, rounds, first: int, update: int, pad_token_id: int):
    """Step 5: steps 1-6 of dpo.py on the round's pairs first, first + 1, ..., first + total_batch_size - 1, of which
    this process takes its share in gradient_accumulation_steps micro batches: each one's loss and its gradient
    (accumulated), checked by the non-finite guard before its backward pass, then one AdamW step after the last.
    Returns the sums of TRAIN_STATS (all but the last) over this process's kept pairs, the number of pairs the update
    kept on all processes, and the tokens trained on."""
    kept = int(rounds.keep[first : first + args.total_batch_size].sum())
    sums, tokens = torch.zeros(len(TRAIN_STATS) - 1, device=accelerator.device), 0
    for micro in range(args.gradient_accumulation_steps):
        # the micro batch's place in the update
        micro_batch = accelerator.process_index * args.gradient_accumulation_steps + micro
        start = first + micro_batch * args.local_micro_batch_size
        rows = torch.arange(start, start + args.local_micro_batch_size)  # in the order drawn
        batch = {**{name: rounds.pairs[name][rows].to(accelerator.device) for name in PAIR_COLUMNS}, "row_index": rows}
        weights = rounds.keep[rows].float().to(accelerator.device)  # a dropped pair weighs 0
        with accelerator.accumulate(policy):
            with accelerator.autocast():  # steps 1-3: sequence log-probs (B,) of chosen and rejected
                policy_chosen, policy_rejected = concatenated_logprobs(
                    policy, batch, pad_token_id, args.query_once and not args.gradient_checkpointing)
                ref_chosen, ref_rejected = reference_logprobs(None, rounds.ref_table, batch, pad_token_id)
            losses, chosen_rewards, rejected_rewards = dpo_loss(  # steps 4-5
                policy_chosen, policy_rejected, ref_chosen, ref_rejected, args.beta, args.loss_type,
                args.label_smoothing, ipo_token_counts(args, batch, pad_token_id),
            )
            # the mean over the update's kept pairs on every process: backward divides by the accumulation steps and
            # the gradient average by the processes, so the sum is scaled up by both first
            loss = ((losses * weights).sum() * (args.gradient_accumulation_steps * accelerator.num_processes)
                    / max(kept, 1))
            # non-finite guard before backward: a NaN never reaches the gradients or the weights
            run.guard(update, **{
                "train/loss": loss, "train/logps/chosen": policy_chosen, "train/logps/rejected": policy_rejected,
                "train/ref_logps/chosen": ref_chosen, "train/ref_logps/rejected": ref_rejected,
            })
            accelerator.backward(loss)  # divided by gradient_accumulation_steps inside
            optimizer.step()  # step 6; a no-op until the last micro batch of the update
            optimizer.zero_grad()
        sums += torch.stack([  # in the order of TRAIN_STATS, summed over the kept pairs
            losses.detach(), chosen_rewards, rejected_rewards, chosen_rewards - rejected_rewards,
            (chosen_rewards > rejected_rewards).float(), policy_chosen.detach(), policy_rejected.detach(),
        ]).float() @ weights
        tokens += int(
            (batch["query_chosen_token"] != pad_token_id).sum() + (batch["query_rejected_token"] != pad_token_id).sum()
        )
    if not accelerator.sync_gradients:
        raise RuntimeError("gradient accumulation went out of step with the update loop")
    return sums, kept, tokens


def main(args: Args) -> dict:
    start_time = time.monotonic()
    reward_fn = check_online_flags(args)  # and --judge reward_fn's function, loaded before any model
    # ---------------- processes, batch arithmetic (Table 6: 64 pairs per update), run folder ----------------
    accelerator = make_accelerator(args)  # gradient accumulation, a resumable data order, bf16, DeepSpeed's settings
    checks.check_qlora_flags(args, accelerator)
    run = Run(args, accelerator)  # run name and folder (rlhf_utils/run.py)
    run.inputs(sft_model_path=args.sft_model_path, preference_dataset=args.preference_dataset,
               query_dataset=args.query_dataset,
               reward_model_path=args.reward_model_path if args.judge == "rm" else None)  # (only --judge rm reads it)

    # ---------------- seeding (labelled, deliberate) ----------------
    set_seed(args.seed)  # weights and data order: identical on every rank
    local_seed = args.seed + accelerator.process_index * 100003  # sampling differs per rank

    # ---------------- tokenizer and data ----------------
    tokenizer = load_tokenizer(args.sft_model_path, args.trust_remote_code)  # Detail 3: [PAD] distinct from EOS
    pad_token_id = tokenizer.pad_token_id
    train_dataset, eval_datasets, sample_raw, sample_dataset = load_online_data(args, tokenizer)  # train: prompts
    args.num_updates = num_updates = count_updates(args, len(train_dataset))
    updates_per_round = check_rounds(args, num_updates, len(train_dataset))
    run.claim_output_dir()  # every input check has passed: only now mark --output_dir as this run's

    # ---------------- models: the policy and the frozen reference, both the SFT model ----------------
    # with LoRA (--lora_rank) the reference is the policy with its adapters off (QLoRA: the same 4-bit base)
    policy, ref_model = (load_lora_policy_and_reference(args, accelerator, tokenizer) if args.lora_rank > 0
                         else load_policy_and_reference(args, accelerator, tokenizer))
    reward_model = load_judge_reward_model(args, accelerator, tokenizer)  # the judge of --judge rm (else None)
    generation_config = sampling_config(args, tokenizer, args.eval_temperature)  # Detail 23: EOS trick
    trained = [p for p in policy.parameters() if p.requires_grad]  # all of them, or the LoRA adapters alone
    adamw = torch.optim.AdamW(trained, lr=args.lr, eps=args.eps, weight_decay=args.weight_decay)
    # the schedule (Table 6) counts optimizer updates and is stepped by hand on each update (not prepared:
    # accelerate's wrapper would step it once per process)
    lr_scheduler = lr_schedule(adamw, args.scheduler, num_updates, args.warmup_steps)
    policy, optimizer = accelerator.prepare(policy, adamw)
    accelerator.register_for_checkpointing(lr_scheduler)  # saved and restored with the policy and optimizer
    rounds = OnlineRounds()  # the round's pairs (their responses have seeds of their own) and the running counts
    accelerator.register_for_checkpointing(rounds)
    torch.manual_seed(local_seed)  # draws differ across ranks from here on (evaluation: its own, evaluation_rng)

    # ---------------- resume and logs ----------------
    last_good = LastGoodState(run, accelerator, adamw, lr_scheduler, rounds)  # the non-finite guard's fallback
    # the trainer state: the update reached and the open logging interval. The frozen reference is not saved: it is
    # the SFT model, loaded again; --reference last_round's log-probs of the current round travel with its pairs
    state = run.start({"update": 0, "interval": [], "interval_tokens": 0, "interval_time": 0.0,
                       "last_train_metrics": {}}, num_updates=num_updates, pairs_per_round=args.pairs_per_round,
                      judge=args.judge, reference=args.reference)
    start_update = state["update"]
    accelerator.step = start_update * args.gradient_accumulation_steps  # accelerate's count of micro batches
    interval = LoggingInterval(state)  # training metrics since the last log, carried by checkpoints

    def run_evaluation(update: int, final: bool = False) -> dict:
        """Detail 19: the implicit reward model on the preference splits; samples of the policy."""
        pairs = evaluate_preferences(accelerator, policy, ref_model, {}, eval_datasets, args, pad_token_id)
        sampled = sample_responses(accelerator, policy, tokenizer, sample_dataset, generation_config, args)
        report = preference_report(pairs, eval_datasets)  # Detail 19's accuracy table and the eval/ metrics
        metrics = records.write_evaluation(run, args, update, final, report, sampled, sample_raw, tokenizer)
        run.log(update, {"episode": update * args.total_batch_size, **metrics})
        return metrics

    # ---------------- training: one optimizer update per total_batch_size pairs ----------------
    accelerator.print(
        f"online DPO ({args.loss_type}, beta {args.beta}, judge {args.judge}, reference {args.reference}): "
        f"{num_updates} updates of {args.total_batch_size} pairs in rounds of {args.pairs_per_round}, "
        f"{accelerator.num_processes} process(es) x {args.gradient_accumulation_steps} accumulation x "
        f"{args.local_micro_batch_size} pairs"
    )
    policy.train()

    def snapshot(update: int) -> None:  # the policy after `update` (models.save_snapshot), with the budget spent
        models.save_snapshot(accelerator, policy, accelerator.unwrap_model(policy), tokenizer, args.output_dir, update,
                             {"budget/responses_sampled": 2 * rounds.totals.get("pairs", 0),
                              "budget/prompts": rounds.totals.get("pairs", 0),
                              "budget/pairs_read": update * args.total_batch_size, "num_updates": num_updates},
                             merge=models.merged_policy if args.lora_rank > 0 else None)

    if start_update == 0 and models.snapshot_due(args, 0, num_updates):  # the starting policy, before update 1
        snapshot(0)
    progress = tqdm(total=num_updates, initial=start_update, desc=args.exp_name,
                    disable=not accelerator.is_local_main_process)
    with progress:  # closed before an error's message, which stays the last line of the output
        for update in range(start_update + 1, num_updates + 1):
            with last_good.kept(update, interval.state()):  # a non-finite value: the state after update - 1 is saved
                round_index, first = divmod(update - 1, updates_per_round)  # first: the update's place in its round
                if first == 0:  # steps 1-4: a new round of pairs, sampled from the policy as it is now
                    if reward_fn is not None:  # the functions' trainer_state (TRL's): optimizer steps, epochs so far
                        reward_fn.at(update - 1, (update - 1) * args.total_batch_size / len(train_dataset), num_updates)
                    online_round(args, accelerator, run, rounds, policy, ref_model, reward_model, reward_fn,
                                 train_dataset, tokenizer, round_index + 1, update)
                sums, kept, tokens = online_dpo_update(args, accelerator, run, policy, optimizer, rounds,
                                                       first * args.total_batch_size, update, pad_token_id)  # step 5
            update_lr = lr_scheduler.get_last_lr()[0]  # the learning rate this update used
            lr_scheduler.step()

            # ---------------- logging: means over the update's kept pairs (NaN if it kept none), then over updates ----
            interval.add((accelerator.reduce(sums, reduction="sum") / kept).tolist() + [kept],
                         int(accelerator.reduce(torch.tensor(tokens, device=accelerator.device), reduction="sum")))
            episode = update * args.total_batch_size
            progress.update(1)
            if update % args.log_every == 0 or update == num_updates:
                means = interval.close(update_lr, episode / len(train_dataset))
                run.log(update, {"episode": episode, **means})
                # (no loss in an interval whose pairs were all ties)
                progress.set_postfix(loss=f"{means.get('train/loss', math.nan):.4f}",
                                     pairs=f"{means['train/pairs']:.0f}", tok_s=f"{means['train/tokens_per_s']:.0f}")
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
               **{f"online/{key}_total": value for key, value in rounds.totals.items()},  # every round's counts
               "num_updates": num_updates, "episodes": num_updates * args.total_batch_size,
               # the budget as spent (report.py's leaderboard reads it): every prompt drawn, redrawn batches too,
               # gave two sampled responses, whether its pair was kept or not
               "budget/responses_sampled": 2 * rounds.totals["pairs"], "budget/prompts": rounds.totals["pairs"],
               "budget/updates": num_updates, "wall_time_s": time.monotonic() - start_time}
    # with LoRA the adapters folded into the base: the plain float32 model it computes (models.merged_policy)
    models.save_pretrained_model(accelerator, policy, accelerator.unwrap_model(policy), tokenizer, args.output_dir,
                          merge=models.merged_policy if args.lora_rank > 0 else None)
    if args.run.push_to_hub and accelerator.is_main_process:
        models.upload_to_hub(args)
    run.finish(summary)  # last: summary.json marks a finished run (the pipeline and ablate.py read it so)
    accelerator.print(f"sampled {2 * rounds.totals['pairs']:,} responses ({rounds.totals['pairs']:,} prompts x 2; the "
                      f"budget: {2 * num_updates * args.total_batch_size:,}); "
                      f"done in {time.monotonic() - start_time:.0f}s; run folder {run.dir}")
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


def check_online_flags(args):
    """dpo.py's flag checks and the online ones, before any load (rlhf_utils/flags.py: check_online_dpo_flags; --judge
    endpoint: the API key, or a loopback URL). Returns the --reward_fn function of --judge reward_fn (else None),
    loaded here, before any model."""
    check_dpo_flags(args)
    if args.pairs_per_round is None:
        args.pairs_per_round = args.total_batch_size  # recorded in args.json
    check_online_dpo_flags(args)
    # (rlhf_utils/rewards.py)
    return load_reward_fn(args.reward_fn, args.judge, args.reward_fn_weights, args.reward_fn_timeout_min)


def check_rounds(args, num_updates: int, num_prompts: int) -> int:
    """The updates per round: --pairs_per_round in whole batches, the run in whole rounds, a round within the
    prompts."""
    updates_per_round = exact_div(args.pairs_per_round, args.total_batch_size, "pairs_per_round / total_batch_size")
    exact_div(num_updates, updates_per_round,
              f"the run's {num_updates} updates / {updates_per_round} updates per round")
    if args.pairs_per_round > num_prompts:
        raise RunError(f"--pairs_per_round {args.pairs_per_round} is more than the {num_prompts} prompts of "
                         f"{args.query_dataset} split {args.train_split!r}")
    return updates_per_round


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


def load_online_data(args, tokenizer):
    """The prompts to train on, every evaluation split of preference pairs and the SFT validation queries sampled for
    the sample table. Every split is checked for the columns read from it and for the tokenizer that made it before
    any work. Returns the train split (tensors with row_index), {split: (raw rows, tensors)} for evaluation, and the
    sample queries (raw rows, tensors); --num_eval_samples shortens the evaluation splits."""
    train_raw = checks.load_split(args.query_dataset, args.train_split)
    checks.check_columns(train_raw, ["query_token"], f"{args.query_dataset} split {args.train_split!r}")
    checks.check_data_tokenizer(train_raw, tokenizer, args.sft_model_path,
                                f"{args.query_dataset} split {args.train_split!r}")
    train_dataset = with_row_index(train_raw, ["query_token"])
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


def load_judge_reward_model(args, accelerator, tokenizer):
    """--judge rm: the frozen reward model, checked to read the policy's token ids, placed like the reference
    (Detail 8: under ZeRO-3 an inference engine); None with --judge endpoint."""
    if args.judge != "rm":
        return None
    checks.check_reward_tokenizer(tokenizer, args.sft_model_path, args.reward_model_path, args.trust_remote_code)
    reward_model = AutoModelForSequenceClassification.from_pretrained(
        args.reward_model_path, num_labels=1, dtype=torch.bfloat16 if args.bf16 else torch.float32,
        trust_remote_code=args.trust_remote_code,
    )
    checks.check_finite(reward_model, args.reward_model_path)
    if reward_model.config.vocab_size < len(tokenizer):
        reward_model.resize_token_embeddings(len(tokenizer))
    disable_dropout(reward_model)  # frozen: the same score every time
    return models.prepare_frozen_model(accelerator, reward_model)


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


def get_reward_query_once(model, query_responses: torch.Tensor, pad_token_id: int, context_length: int):
    """get_reward with each distinct query run once (--query_once, query_once_inputs): the same sequence rewards (B,)
    and indices read (B,) up to float rounding; the reward logits (B, T - context_length + 1) of the rows' tails only
    (the query's last token, then the response). A batch whose queries are all distinct runs whole rows."""
    if context_length < 2:  # a one-token query leaves nothing before its last token to share
        return get_reward(model, query_responses, pad_token_id, context_length)
    first, second, rows = query_once_inputs(query_responses, pad_token_id, context_length)
    if first["input_ids"].size(0) == rows.numel():  # no query repeats: nothing to share
        return get_reward(model, query_responses, pad_token_id, context_length)
    backbone = getattr(model, model.base_model_prefix)
    backbone(**first)
    select_query_cache(first["past_key_values"], rows)
    hidden = backbone(**second, return_dict=True).last_hidden_state  # (B, T - context_length + 1, d)
    reward_logits = model.score(hidden).squeeze(-1)
    sequence_lengths = first_true_indices(query_responses[:, context_length:] == pad_token_id) - 1 + context_length
    rewards = reward_logits[torch.arange(reward_logits.size(0), device=reward_logits.device),
                            sequence_lengths - (context_length - 1)]
    return reward_logits, rewards, sequence_lengths


def truncate_response(eos_token_id: int, pad_token_id: int, responses: torch.Tensor) -> torch.Tensor:
    """Detail 23: keep each response up to and including its first EOS, fill the rest with [PAD]."""
    eos_index = first_true_indices(responses == eos_token_id).unsqueeze(-1)  # (B, 1)
    positions = torch.arange(responses.size(1), device=responses.device).unsqueeze(0)  # (1, T)
    return torch.masked_fill(responses, positions > eos_index, pad_token_id)


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


# ---------------------------------------------------------------------------------------------
# Shared with judge.py (identical copies; tests/test_shared_helpers.py): the paper's prompt (Appendix I), the order of
# the two responses, the verdict parser. They decide the labels
# ---------------------------------------------------------------------------------------------


PAIRWISE_JUDGE_TEMPLATE = """Which of the following summaries does a better job of summarizing the most important \
points in the given forum post, without including unimportant or irrelevant details? Judge based on accuracy, \
coverage, and coherence.

Post:
{post}

Summary A:
{summary_a}

Summary B:
{summary_b}

FIRST provide a one-sentence comparison of the two summaries, explaining which you prefer and why. SECOND, on a new \
line, state only "A" or "B" to indicate your choice. Your response should use the format:

Comparison: <one-sentence comparison and explanation>
Preferred: <"A" or "B">"""


_PLACEHOLDER_RE = re.compile(
    r"\{(post|summary_a|summary_b|num_assistants|assistant_names|question|answers|name|answer)\}")


def fill_template(template: str, **values: str) -> str:
    """Substitute the `{name}` placeholders in one pass, so a post that itself contains
    `{summary_a}` (or any brace) is inserted verbatim and never re-substituted."""
    return _PLACEHOLDER_RE.sub(lambda m: values[m.group(1)], template)


def pairwise_prompt(post: str, summary_a: str, summary_b: str) -> str:
    return fill_template(PAIRWISE_JUDGE_TEMPLATE, post=post, summary_a=summary_a, summary_b=summary_b)


def pair_order(seed: int, *texts: str) -> int:
    """0 or 1, derived from the seed and the pair's own texts: reproducible across reruns, row
    orders and CSV files, and independent between pairs (Appendix I: the order of the summaries
    is randomised to remove the judge's position bias)."""
    digest = hashlib.sha256("\x00".join((str(seed),) + texts).encode()).digest()
    return digest[0] & 1


def without_eos_text(text: str, eos_text: str) -> str:
    """What a human reader sees of a summary: the text without surrounding whitespace and without the EOS spelling
    `eos_text` (every copy of it) at its end. The hub's processed TL;DR references end with `<|endoftext|>` as
    text; the reference implementation strips it before judging, and so do we."""
    text = str(text).strip()
    while eos_text and text.endswith(eos_text):
        text = text[: -len(eos_text)].rstrip()
    return text


_PREFERRED_RE = re.compile(
    r'^[ \t]*[*_]*preferred[*_]*(?::[*_]*)?(?:[ \t]*\n)*[ \t]*[*_]*[ \t]*'  # "Preferred:", then any blank lines
    r'["\'(\[]?(?:summary[ \t]+)?([ab])["\')\]]?[*_]*\.?[*_]*[ \t]*$',  # the letter, quoted or bracketed
    re.MULTILINE | re.IGNORECASE)


_COMPARISON_RE = re.compile(r"^[ \t]*\**Comparison:?\**:?[ \t]*(.*?)[ \t]*$", re.MULTILINE)


def parse_verdict(reply: str) -> Optional[tuple[str, str]]:
    """("A" or "B", explanation) from a reply in the paper's format; None when there is no
    unambiguous `Preferred:` line."""
    verdicts = {verdict.upper() for verdict in _PREFERRED_RE.findall(reply)}
    if len(verdicts) != 1:
        return None
    comparison = _COMPARISON_RE.search(reply)
    return verdicts.pop(), (comparison.group(1) if comparison else "")


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
