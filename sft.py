"""Supervised fine-tuning (SFT), step 1 of the RLHF pipeline (section 5 and Appendix D of the paper; Table 3).

One update = one batch of `total_batch_size` (query, reference summary) pairs from the processed data, whose rows
are `query + " " + reference summary + EOS`, right-padded with a [PAD] distinct from EOS (Detail 3):

  1. draw the batch from a fresh permutation of the train split each epoch, the same on every process; each process
     reads its own share, split into micro-batches (an epoch's incomplete last batch is left out)
  2. labels: the reference summary and its EOS (--loss_on response) or the whole sequence (--loss_on sequence);
     every [PAD] becomes -100, so the EOS stays a target and the model learns to stop (Detail 3)
  3. loss: mean next-token cross-entropy over the labels, accumulated over the micro-batches
  4. AdamW step (lr 3e-6, eps 1e-5) on a cosine schedule without warm-up (Table 3)

Evaluation (every --eval_every updates and after training): the validation loss, then one summary per query,
sampled with exactly `response_length` tokens ([PAD] never; Detail 23) at --eval_temperature 0.01 and truncated
after its first EOS; ROUGE-1/2/L against the reference, the EOS rate (share of samples that end inside the response
length) and the mean response length. Sample tables go to runs/{run_name}/samples/step_N.csv and
runs/{run_name}/samples.csv (judge.py reads them), metrics to TensorBoard, runs/{run_name}/metrics.jsonl and
runs/{run_name}/summary.json.

Single process:         python sft.py --base_model ... --query_dataset ...
Several GPU processes:  accelerate launch [--config_file zero2.yaml] sft.py ...
Several CPU processes:  torchrun --nproc_per_node 2 sft.py ...   (gloo; `accelerate launch --cpu` starts only one)
Built-in task (CPU):    pipeline.py's SETTINGS hold the paths and the small sizes it passes.
LoRA / QLoRA:           ... --lora_rank 8 [--load_in_4bit]: adapters on a frozen (4-bit) base; saved merged, float32.
After a crash:          the same command with --resume: it continues from the latest checkpoint in
                        runs/{run_name}/checkpoints (model, AdamW, schedule, data position, RNG states) and ends
                        exactly like an uninterrupted run (--checkpoint_every sets how often).
A NaN or inf loss:      stops the run before it reaches the weights; the state after the update before is saved as
                        that update's checkpoint, from which --resume goes on as from an ordinary one.
"""

import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Annotated, Literal, Optional

import pandas as pd
import torch
import torch.nn.functional as F
import tyro
from accelerate import Accelerator, PartialState
from accelerate.utils import gather_object, set_seed
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from rlhf_utils import checks, models, records
from rlhf_utils.checks import RunError
from rlhf_utils.flags import RunFlags
from rlhf_utils.run import LastGoodState, Run, due, evaluation_rng, leave_processes, start_processes, synced_time


@dataclass
class Args:
    # ---- experiment bookkeeping ----
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (the run name starts with it)"""
    seed: int = 1
    """seed of weights and data order (the same on every process); sampling uses seed + 100003 * rank"""
    output_dir: str = "models/sft"
    """where the trained model and tokenizer are saved (safetensors)"""

    # ---- model and data ----
    base_model: str = "EleutherAI/pythia-1b-deduped"
    """the pretrained model to fine-tune (hub name or local folder); its tokenizer is used too"""
    trust_remote_code: bool = False
    """allow model code from the hub (needed by some architectures)"""
    query_dataset: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """the processed SFT dataset (hub name, or a local `save_to_disk` folder from data/prepare.py)"""
    train_split: str = "train"
    """split to train on"""
    eval_split: str = "validation"
    """split evaluated during and after training"""
    eval_test_split: bool = False
    """also evaluate the `test` split after training (metrics `test/...`, table samples_test.csv)"""
    response_length: int = 53
    """response length of the processed data (TL;DR: 53, Detail 4); checked against the dataset, and the
    number of tokens sampled at evaluation"""
    pad_token: Literal["pad", "eos"] = "pad"
    """Detail 3: `pad` pads with a distinct [PAD] (added when the tokenizer has none). `eos` pads with EOS,
    the common practice, only for the ablation (data from data/prepare.py --pad_token eos): the EOS targets
    are then masked out together with the padding, so the model never learns to stop"""

    # ---- optimisation (Table 3 / Detail 9) ----
    loss_on: Literal["response", "sequence"] = "response"
    """tokens that carry the next-token loss. `response` (our default, the trlX HH practice): the reference summary
    and its EOS only. `sequence`: query and response, what the reference implementation did. Pads never carry loss
    (Detail 3) (docs/usage.md, "Flags in depth")"""
    num_train_epochs: int = 1
    """passes over the train split (Table 3: 1)"""
    total_episodes: Optional[int] = None
    """train on this many (query, reference) pairs instead of num_train_epochs passes (small budgets, smoke tests)"""
    total_batch_size: int = 128
    """pairs per optimizer update over all processes (Table 3: 128) = local_micro_batch_size *
    gradient accumulation steps * number of processes"""
    local_micro_batch_size: int = 16
    """pairs per forward/backward pass on one process (memory knob; the update size stays total_batch_size)"""
    gradient_accumulation_steps: Optional[int] = None
    """micro batches per optimizer step; None = derived from the batch sizes, else checked against them"""
    lr: float = 3e-6
    """AdamW learning rate (Table 3: 3e-6, the same for SFT, RM and PPO)"""
    eps: float = 1e-5
    """AdamW epsilon (Table 3: 1e-5)"""
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    """learning-rate schedule over the updates, no warm-up (Table 3: cosine)"""
    disable_dropout: bool = True
    """Detail 7: set every dropout probability to 0 (the same for SFT, RM and PPO)"""
    bf16: Optional[bool] = None
    """bf16 mixed precision, as the paper trained (Detail 8); None = on when a CUDA device supports bf16. The CPU
    runs float32 unless --bf16 asks for bf16 (slow there)"""
    gather_for_generation: bool = True
    """under ZeRO-3, gather the policy's weights once per generate call of the evaluation's samples, not layer by
    layer at each decode step: the same samples. Off: for models too big for a device (docs/usage.md, Flags in depth)"""
    gradient_checkpointing: bool = False
    """activation checkpointing in every model that trains here: less activation memory for about one more forward
    pass; the loss and gradients are the same. Off: the paper trained without it (docs/usage.md, "Flags in depth")"""

    # ---- memory: LoRA and QLoRA ----
    lora_rank: int = 0
    """LoRA rank of the adapters (peft) trained on the frozen base model; 0 = off (full fine-tuning)"""
    lora_alpha: float = 16.0
    """LoRA scaling alpha (read only when --lora_rank > 0)"""
    load_in_4bit: bool = False
    """QLoRA: the frozen base of the policy in 4-bit NF4 with double quantization (bitsandbytes), LoRA adapters trained
    on top; needs --lora_rank. The settings are the QLoRA paper's (Dettmers et al. 2023); each 4-bit layer computes in
    the run's dtype (bf16 with --bf16, else float32), and the saved model has the adapters merged in float32"""

    # ---- evaluation ----
    eval_every: int = 0
    """evaluate every this many optimizer updates (0 = only after training)"""
    num_eval_samples: Optional[int] = None
    """evaluate on the first this many rows of the split (None = all of it)"""
    local_eval_batch_size: int = 32
    """queries per generation / loss batch on one process during evaluation"""
    eval_temperature: float = 0.01
    """sampling temperature of the evaluation summaries (0.01: almost greedy, as in the reference)"""
    num_table_samples: int = 4
    """rows of the sample table printed to the console and logged to TensorBoard / W&B at each evaluation"""

    run: Annotated[RunFlags, tyro.conf.OmitArgPrefixes] = field(default_factory=RunFlags)
    """the run's folder, checkpoints, --resume, lock, tracking and hub (rlhf_utils/flags.py): they decide no number"""

    # ---- derived at run time (not flags) ----
    world_size: tyro.conf.Suppress[Optional[int]] = None
    """number of processes"""
    num_updates: tyro.conf.Suppress[Optional[int]] = None
    """optimizer updates of the whole run"""


# ---------------------------------------------------------------------------------------------
# SFT pieces (module-level so that tests can check each one against a hand computation)
# ---------------------------------------------------------------------------------------------


def sft_batch_indices(num_rows: int, total_batch_size: int, local_micro_batch_size: int,
                      gradient_accumulation_steps: int, seed: int, process_index: int):
    """Step 1: endless updates, each a list of this process's micro-batches of row indices. Every process draws the
    same permutation each epoch (from --seed alone, so the data order does not depend on the sampling seed) and
    reads its own share of every update's batch; an epoch that does not fill a last update leaves those rows out
    (like drop_last)."""
    data_generator = torch.Generator().manual_seed(seed)
    updates_per_epoch = num_rows // total_batch_size
    local_batch_size = local_micro_batch_size * gradient_accumulation_steps
    while True:
        permutation = torch.randperm(num_rows, generator=data_generator)
        for update in range(updates_per_epoch):
            global_batch = permutation[update * total_batch_size : (update + 1) * total_batch_size]
            local_batch = global_batch[process_index * local_batch_size :][:local_batch_size]
            yield [local_batch[i : i + local_micro_batch_size].tolist()
                   for i in range(0, local_batch_size, local_micro_batch_size)]


def sft_labels(label_tokens: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Next-token targets: every pad becomes -100 (ignored by the loss).

    Detail 3: with a distinct [PAD] the EOS after the summary stays a target, so the model learns to
    end; when the data was padded with EOS itself (pad_token_id == eos_token_id) this line also masks
    the EOS out, and the model never sees a reason to stop."""
    return torch.masked_fill(label_tokens, label_tokens == pad_token_id, -100)


def next_token_loss(model, query_responses: torch.Tensor, labels: torch.Tensor, pad_token_id: int):
    """Mean next-token cross-entropy over the target tokens of a right-padded batch, and their count.

    Token t is predicted from the logits at t - 1, so logits drop the last position and labels the
    first. Right padding only appends masked positions, which neither attend into the real tokens
    (causal attention) nor carry labels, so extra padding leaves the loss unchanged."""
    cols = real_columns(query_responses, pad_token_id)  # the padding every row shares is cut: same loss, less compute
    query_responses, labels = query_responses[:, cols], labels[:, cols]
    # a token whose input position is a [PAD] has no context to be predicted from (the first token of a
    # left-padded query in the `sequence` mode): it is not a target
    shifted_labels = labels[:, 1:].masked_fill(query_responses[:, :-1] == pad_token_id, -100)  # (B, T-1)
    is_target = shifted_labels != -100
    # the LM head runs only where a target is predicted (position t predicts token t + 1; the last predicts none)
    logits = forward(model, query_responses, pad_token_id, read=F.pad(is_target, (0, 1))).logits  # (N, V)
    loss = F.cross_entropy(logits.float(), shifted_labels[is_target])  # the mean over the N targets
    return loss, is_target.sum()


def sft_update(args, accelerator, run, model, optimizer, scheduler, dataset, batches, label_column: str,
               pad_token_id: int, update: int, state: dict):
    """Steps 1-4 of one update: this process's micro batches of it (1), their labels (2), each one's loss and its
    gradient, accumulated (3), checked by the non-finite guard before its backward pass, then one AdamW step after the
    last and one step of the schedule (4). `state` is the trainer state after update - 1; returns the one after this
    update (the running counters of the summary) and the update's training metrics."""
    update_start = time.monotonic()
    stats = torch.zeros(3, device=accelerator.device)  # loss sum over micro-batches, micro-batches, input tokens
    for micro_indices in next(batches):  # 1.
        micro_batch = dataset[micro_indices]
        query_responses = micro_batch["query_reference_response_token"].to(accelerator.device)  # (b, Tq + Tr)
        labels = sft_labels(micro_batch[label_column].to(accelerator.device), pad_token_id)  # 2.
        with accelerator.accumulate(model):
            loss, _ = next_token_loss(model, query_responses, labels, pad_token_id)  # 3.
            # non-finite guard: checked before backward, so the weights never see it
            run.guard(update, **{"train/loss": loss})
            accelerator.backward(loss)  # divided by the accumulation steps inside
            optimizer.step()  # 4. a no-op until the last micro-batch of the update
            optimizer.zero_grad()
        stats += torch.stack(
            [loss.detach(), torch.ones((), device=loss.device), (query_responses != pad_token_id).sum().float()]
        )
    lr = scheduler.get_last_lr()[0]  # the rate this update used
    scheduler.step()
    stats = accelerator.reduce(stats, reduction="sum")
    update_s = synced_time(accelerator.device) - update_start  # (a GPU's queued work done)
    train_time = state["train_time"] + update_s
    train_tokens = state["train_tokens"] + int(stats[2])
    last_loss = (stats[0] / stats[1]).item()  # mean over every micro-batch of the update, all processes
    metrics = {"train/loss": last_loss, "train/lr": lr, "train/tokens_per_s": train_tokens / train_time,
               "time/update_s": update_s}
    return {"train_tokens": train_tokens, "train_time": train_time, "last_loss": last_loss}, metrics


@torch.no_grad()
def evaluate_sft(args: Args, accelerator: Accelerator, model, tokenizer, dataset, generation_config, label_column: str):
    """Validation loss, then fixed-length sampling of a summary per query, truncated after its first EOS.

    Every process takes an equal contiguous share of the rows (the last len % world_size rows are left
    out, so every process runs the same number of forward/generate calls). Returns the metrics (on every
    process) and the sample table (complete on the main process)."""
    model.eval()
    unwrapped = accelerator.unwrap_model(model)
    pad_token_id, eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    num_rows = len(dataset) if args.num_eval_samples is None else min(args.num_eval_samples, len(dataset))
    local_rows = num_rows // accelerator.num_processes
    if local_rows == 0:
        raise RunError(f"{num_rows} evaluation rows cannot be shared by {accelerator.num_processes} processes")
    start = accelerator.process_index * local_rows
    loss_sum = torch.zeros((), device=accelerator.device)
    num_targets = torch.zeros((), device=accelerator.device)
    rows = []
    # evaluation samples from its own random stream, the same at every evaluation (evaluation_rng): how often and
    # how much a run evaluates never changes what it trains
    with evaluation_rng(accelerator, args.seed + accelerator.process_index * 100003):
        for begin in range(start, start + local_rows, args.local_eval_batch_size):
            batch = dataset[begin : min(begin + args.local_eval_batch_size, start + local_rows)]
            query_responses = batch["query_reference_response_token"].to(accelerator.device)  # (B, Tq + Tr)
            labels = sft_labels(batch[label_column].to(accelerator.device), pad_token_id)
            loss, count = next_token_loss(model, query_responses, labels, pad_token_id)
            loss_sum += loss * count
            num_targets += count

            queries = batch["query_token"].to(accelerator.device)  # (B, Tq), left-padded
            queries = queries[:, real_columns(queries, pad_token_id)]  # the left padding every row shares is cut
            context_length = queries.size(1)
            with models.gathered_for_generation(model, args.gather_for_generation):  # ZeRO-3: the weights gathered once
                query_sampled = generate(unwrapped, queries, pad_token_id, generation_config)
            responses = query_sampled[:, context_length:]  # (B, response_length)
            postprocessed = truncate_response(eos_token_id, pad_token_id, responses)
            has_eos = (responses == eos_token_id).any(dim=1)  # (B,)
            # tokens up to and including the first EOS (response_length when there is none)
            response_token_len = torch.clamp(first_true_indices(responses == eos_token_id) + 1, max=responses.size(1))
            for i in range(queries.size(0)):
                rows.append(
                    {
                        "query": tokenizer.decode(queries[i][queries[i] != pad_token_id], skip_special_tokens=True),
                        "response": tokenizer.decode(postprocessed[i], skip_special_tokens=True),
                        "reference": batch["reference_response"][i],
                        "score": None,
                        "response_token_len": int(response_token_len[i]),
                        "has_eos": bool(has_eos[i]),
                    }
                )
    loss_sum = accelerator.reduce(loss_sum, reduction="sum")
    num_targets = accelerator.reduce(num_targets, reduction="sum")
    rows = gather_object(rows)
    model.train()

    df = pd.DataFrame(rows, columns=["query", "response", "reference", "score", "response_token_len", "has_eos"])
    from rouge_score import rouge_scorer  # here, not at the top: it loads nltk (~0.15 s), which only evaluation needs

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    rouge = {key: 0.0 for key in ("rouge1", "rouge2", "rougeL")}
    for response, reference in zip(df["response"], df["reference"]):
        scores = scorer.score(reference, response)  # (target, prediction)
        for key in rouge:
            rouge[key] += scores[key].fmeasure / len(df)
    metrics = {
        "loss": (loss_sum / num_targets).item(),
        **rouge,
        "eos_rate": float(df["has_eos"].mean()),
        "response_token_len_mean": float(df["response_token_len"].mean()),
        "num_samples": len(df),
    }
    return metrics, df


def evaluate_and_log_sft(run, args, accelerator, model, tokenizer, eval_datasets: dict, generation_config,
                         label_column: str, step: int, final: bool) -> dict:
    """One evaluation of every split (evaluate_sft): its sample table written, its metrics logged at `step`. Returns
    the metrics of all splits (`eval/...`, and `test/...` with --eval_test_split)."""
    summary = {}
    for split, dataset in eval_datasets.items():
        prefix = "eval" if split == args.eval_split else split
        metrics, table = evaluate_sft(args, accelerator, model, tokenizer, dataset, generation_config, label_column)
        metrics = {f"{prefix}/{key}": value for key, value in metrics.items()}
        summary.update(metrics)
        records.write_sft_samples(run, args, split, prefix, step, final, metrics, table)
        run.log(step, {"episode": step * args.total_batch_size, **metrics})
    return summary


def main(args: Args) -> dict:
    start_time = time.monotonic()
    # ---------------- processes, batch arithmetic and precision ----------------
    # first: the accumulation steps depend on the process count
    args.world_size = start_processes(args.run.process_group_timeout_min).num_processes
    accumulation = exact_div(args.total_batch_size, args.local_micro_batch_size * args.world_size,
                             "total_batch_size / (local_micro_batch_size * world_size)")
    checks.check_gradient_accumulation(args, accumulation, args.world_size)
    args.gradient_accumulation_steps = accumulation  # recorded in args.json
    if args.bf16 is None:
        args.bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps, mixed_precision="bf16" if args.bf16 else "no"
    )
    configure_deepspeed(accelerator, args.local_micro_batch_size)  # Detail 8 (no-op without DeepSpeed)
    checks.check_qlora_flags(args, accelerator)
    run = Run(args, accelerator)  # run name and folder (rlhf_utils/run.py)
    run.inputs(query_dataset=args.query_dataset, base_model=args.base_model)

    # ---------------- seeding ----------------
    set_seed(args.seed)  # weights and data order: the same on every process
    local_seed = args.seed + accelerator.process_index * 100003  # sampling (set after the model exists) differs

    # ---------------- tokenizer, data, model ----------------
    # Detail 3: a [PAD] distinct from EOS (EOS itself with --pad_token eos)
    tokenizer = load_tokenizer(args.base_model, args.trust_remote_code, args.pad_token)
    pad_token_id = tokenizer.pad_token_id
    # step 2: the tokens that carry the loss (--loss_on): the reference summary and its EOS, or the whole sequence
    label_column = {
        "response": "query_reference_response_token_response_label",
        "sequence": "query_reference_response_token",
    }[args.loss_on]
    train_dataset, eval_datasets = load_sft_data(args, tokenizer, label_column)
    run.claim_output_dir()  # every input check has passed: only now mark --output_dir as this run's
    model = load_sft_model(args, tokenizer)
    generation_config = sampling_config(args, tokenizer, args.eval_temperature)  # Detail 23: EOS trick

    # ---------------- optimizer, schedule and the data order ----------------
    args.num_updates = count_updates(args, len(train_dataset))
    # the reference uses torch's AdamW with its default weight decay (0.01); so do we. It holds the weights that train:
    # all of them, or the LoRA adapters alone (--lora_rank)
    trained = [p for p in model.parameters() if p.requires_grad]
    adamw = torch.optim.AdamW(trained, lr=args.lr, eps=args.eps)
    # the schedule is not passed to accelerator.prepare, which would step it once per process
    scheduler = lr_schedule(adamw, args.scheduler, args.num_updates)
    model, optimizer = accelerator.prepare(model, adamw)
    accelerator.register_for_checkpointing(scheduler)  # saved and restored with the model and optimizer
    torch.manual_seed(local_seed)  # dropout (when on) differs across processes; evaluation has its own stream
    batches = sft_batch_indices(len(train_dataset), args.total_batch_size, args.local_micro_batch_size,
                                args.gradient_accumulation_steps, args.seed, accelerator.process_index)

    # ---------------- resume ----------------
    last_good = LastGoodState(run, accelerator, adamw, scheduler)  # the non-finite guard's fallback
    # the trainer state: the running counters of the summary (the data position is the update number)
    state = run.start({"update": 0, "train_tokens": 0, "train_time": 0.0, "last_loss": float("nan")},
                      num_updates=args.num_updates)
    start_update = state["update"]
    # accelerate's count of micro batches, in this run's: a checkpoint of more processes counts fewer
    if args.run.resume:
        accelerator.step = start_update * args.gradient_accumulation_steps

    # ---------------- training: steps 1-4 ----------------
    model.train()
    progress = tqdm(range(start_update + 1, args.num_updates + 1), initial=start_update, total=args.num_updates,
                    disable=not accelerator.is_main_process, desc="sft")
    for _ in range(start_update):
        next(batches)  # the data position: replay the permutations of the updates already done
    for update in progress:
        with last_good.kept(update, state):  # a non-finite loss leaves the state after update - 1 as a checkpoint
            state, metrics = sft_update(args, accelerator, run, model, optimizer, scheduler, train_dataset, batches,
                                        label_column, pad_token_id, update, state)  # steps 1-4
        progress.set_postfix(loss=f"{state['last_loss']:.4f}", tok_s=f"{metrics['train/tokens_per_s']:.0f}")
        run.log(update, {"episode": update * args.total_batch_size, **metrics})
        if due(args.eval_every, update, args.num_updates):
            evaluate_and_log_sft(run, args, accelerator, model, tokenizer, eval_datasets, generation_config,
                                 label_column, update, final=False)
        if due(args.run.checkpoint_every, update, args.num_updates):
            run.checkpoint(update, state)
    progress.close()

    # ---------------- final evaluation, summary and model ----------------
    summary = evaluate_and_log_sft(run, args, accelerator, model, tokenizer, eval_datasets, generation_config,
                                   label_column, args.num_updates, final=True)
    summary.update(
        {
            "train/loss": state["last_loss"],
            "train/tokens": state["train_tokens"],
            "train/time_s": state["train_time"],
            "train/tokens_per_s": state["train_tokens"] / state["train_time"],
            "train/updates": args.num_updates,
            # the budget as spent (report.py's leaderboard reads it): every update read total_batch_size rows
            "budget/updates": args.num_updates, "budget/rows_read": args.num_updates * args.total_batch_size,
            "wall_time_s": time.monotonic() - start_time,
        }
    )
    # with LoRA the adapters folded into the base: the plain float32 model it computes (models.merged_policy)
    models.save_pretrained_model(accelerator, model, accelerator.unwrap_model(model), tokenizer, args.output_dir,
                          merge=models.merged_policy if args.lora_rank > 0 else None)
    if args.run.push_to_hub and accelerator.is_main_process:
        models.upload_to_hub(args)
    run.finish(summary)
    accelerator.print(json.dumps(summary, indent=2))
    return summary


# ---------------------------------------------------------------------------------------------
# The number-deciding setup (tokenizer, data, model, DeepSpeed); the sample tables main writes are
# rlhf_utils/records.py's write_sft_samples
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


def load_sft_data(args, tokenizer, label_column: str):
    """The train split and the evaluation splits ({split: dataset}; `test` too with --eval_test_split) as torch
    tensors, checked for the columns this run reads, for the tokenizer that made them and for --response_length."""
    columns = list(dict.fromkeys(  # loss_on=sequence reads its labels from the input column itself
        ["query_reference_response_token", label_column, "query_token", "query_reference_response_token_len"]
    ))
    train_dataset = checks.load_split(args.query_dataset, args.train_split)
    checks.check_columns(train_dataset, columns, f"{args.query_dataset} split {args.train_split!r}")
    # the data must come from this tokenizer (its pad id also decides which labels are masked)
    checks.check_data_tokenizer(train_dataset, tokenizer, args.base_model,
                                f"{args.query_dataset} split {args.train_split!r}")
    checks.check_query_response(train_dataset, tokenizer.pad_token_id,
                                f"{args.query_dataset} split {args.train_split!r}")
    train_dataset = train_dataset.with_format("torch", columns=columns)
    eval_splits = [args.eval_split] + (["test"] if args.eval_test_split else [])
    eval_datasets = {}
    for split in eval_splits:
        dataset = checks.load_split(args.query_dataset, split)
        checks.check_columns(dataset, columns + ["reference_response"], f"{args.query_dataset} split {split!r}")
        checks.check_data_tokenizer(dataset, tokenizer, args.base_model, f"{args.query_dataset} split {split!r}")
        checks.check_query_response(dataset, tokenizer.pad_token_id, f"{args.query_dataset} split {split!r}")
        eval_datasets[split] = dataset.with_format("torch", columns=columns + ["reference_response"])
    first = train_dataset[0]
    data_response_length = first["query_reference_response_token"].numel() - first["query_token"].numel()
    if data_response_length != args.response_length:
        raise RunError(
            f"--response_length {args.response_length} but {args.query_dataset} has responses of "
            f"{data_response_length} tokens"
        )
    return train_dataset, eval_datasets


def load_sft_model(args, tokenizer) -> torch.nn.Module:
    """The base model to fine-tune, with an embedding row for the tokenizer's [PAD] (Detail 3) and no dropout
    (Detail 7). Float32 master weights (transformers v5 would otherwise keep the checkpoint's dtype, float16 for
    Pythia); --bf16 computes in bf16 through accelerate's autocast. With --lora_rank only LoRA adapters train on the
    frozen model, whose linear layers --load_in_4bit stores in 4 bits (QLoRA)."""
    model = AutoModelForCausalLM.from_pretrained(
        args.base_model, trust_remote_code=args.trust_remote_code, dtype=torch.float32,
        **quantized_loading(args, args.bf16),
    )
    checks.check_finite(model, args.base_model)
    # the config's row count, not the weight's shape: ZeRO-3 partitions weights as they load
    if len(tokenizer) > model.config.vocab_size:
        model.resize_token_embeddings(len(tokenizer))
    if args.disable_dropout:
        disable_dropout(model)
    if args.lora_rank > 0:
        model = lora_policy(model, args)
    return models.checkpointed(model, args.gradient_checkpointing)


def count_updates(args, num_rows: int) -> int:
    """Optimizer updates of the run: --total_episodes rows (None: num_train_epochs passes over the num_rows of the
    train data) in full batches of total_batch_size; a last partial batch is dropped."""
    total_episodes = args.total_episodes if args.total_episodes is not None else args.num_train_epochs * num_rows
    num_updates = total_episodes // args.total_batch_size
    if num_updates < 1:
        raise RunError(f"{total_episodes} episodes give no full batch of {args.total_batch_size}; raise "
                       "--total_episodes (or --num_train_epochs) or lower --total_batch_size")
    return num_updates


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
