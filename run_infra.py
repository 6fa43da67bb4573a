"""The run infrastructure every training script and judge.py import, what decides no number a script computes: expected
errors (RunError: one paragraph, no traceback), input checks, processes, the run folder (Run: name, lock, logs,
checkpoints with the inputs' content hashes, --resume, completion marks, the non-finite guard; LastGoodState, its
fallback), outputs (a full disk named) and the judge's HTTP client (deadline, retries, cache, the key from the
environment). The scripts keep tokenizer and [PAD], batch arithmetic, data order, sampling, losses and metrics.

Its rule: it never changes an uninterrupted run, and a resume or a fallback restores exactly what an ordinary
checkpoint of that update holds. It imports no training script."""

import asyncio
import atexit
import collections
import contextlib
import glob
import hashlib
import ipaddress
import json
import os
import random
import shutil
import sqlite3
import sys
import time
import traceback
import urllib.parse
from dataclasses import asdict
from typing import Callable, Optional

import numpy as np
import pandas as pd
import openai
import psutil
import pyarrow.compute
import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list
from openai import AsyncOpenAI
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoTokenizer

# ---- Expected errors: one paragraph from rank 0 and a failed exit, without a traceback --------------------------------
class RunError(ValueError):
    """An expected stop (a bad flag or input, a refused resume, a held lock, a full disk): its message says the fix."""

class NonFiniteError(RunError, RuntimeError):
    """A loss, reward, advantage, gradient norm or loaded weight became NaN or inf (Run.guard, check_finite)."""

def print_expected_error(kind, error, trace) -> None:
    """sys.excepthook: a RunError prints `script.py: error: message` (rank 0 alone); other errors their traceback."""
    if not isinstance(error, RunError):
        return sys.__excepthook__(kind, error, trace)
    if os.environ.get("RANK", "0") == "0":
        print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr, flush=True)

sys.excepthook = print_expected_error

# ---- Input checks: bad flags and bad inputs fail before any model loads, naming the file and the fix ------------------
def check_columns(dataset, columns: list, where: str) -> None:
    """Bad input fails here with the row and the fix, not deep inside a library: every needed column is present,
    and every token column has one length in all rows (processed data is padded to fixed lengths)."""
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise RunError(f"{where} lacks the column(s) {missing} (it has {dataset.column_names}); "
                       "make it with data/prepare.py, whose output has every column the scripts read")
    table = dataset.select_columns(list(columns)).with_format("arrow")[:]
    for column in (c for c in columns if pyarrow.types.is_list(table.schema.field(c).type) and table.num_rows):
        lengths = pyarrow.compute.list_value_length(table.column(column)).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero(lengths != lengths[0])
        if bad.size:
            raise RunError(f"{where}: row {int(bad[0])} has {int(lengths[bad[0]])} tokens in {column!r}, row 0 has "
                           f"{int(lengths[0])}; every row must be padded to one length (prepare it with data/prepare.py)")

def tokenizer_fingerprint(tokenizer) -> dict:
    """The identity of the tokenizer of token ids: a digest of its vocabulary (added tokens such as [PAD] included),
    its size, [PAD] and EOS ids. data/prepare.py stores it with every split; the scripts compare it with theirs."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    return {"vocab_sha256": hashlib.sha256(json.dumps(vocab).encode("utf-8")).hexdigest(), "vocab_size": len(tokenizer),
            "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}

def tokenizer_difference(theirs: dict, ours: dict) -> list:
    """What differs between two tokenizer fingerprints (theirs vs ours), for an error message; [] = the same."""
    differ = [f"{k} {theirs.get(k)} vs {ours[k]}" for k in ("vocab_size", "pad_token_id", "eos_token_id")
              if theirs.get(k) != ours[k]]
    return differ or (["same size, other tokens"] if theirs.get("vocab_sha256") != ours["vocab_sha256"] else [])

def written_by_prepare(dataset) -> Optional[dict]:
    """The tokenizer fingerprint data/prepare.py stored in a split's description; None for other data (a hub set)."""
    with contextlib.suppress(TypeError, ValueError, KeyError):
        return json.loads(dataset.info.description)["tokenizer"]

def check_data_tokenizer(dataset, tokenizer, model_path: str, where: str, rows: int = 64) -> None:
    """Bad input: token ids mean something only to the tokenizer that wrote them. A split of data/prepare.py carries
    its tokenizer's fingerprint, which must equal the model's; other data (a hub dataset) is checked by its ids: all
    below the vocabulary size and, in the first `rows` rows, padded with this [PAD] and responses ended by this EOS."""
    ours = tokenizer_fingerprint(tokenizer)
    pad, eos, size = ours["pad_token_id"], ours["eos_token_id"], ours["vocab_size"]
    fix = (f"Prepare the data again with this model's tokenizer: python data/prepare.py --base_model {model_path} "
           "(with the task's other flags)")
    if (theirs := written_by_prepare(dataset)) is not None:
        if differ := tokenizer_difference(theirs, ours):
            raise RunError(f"{where} was tokenized by the tokenizer of {theirs.get('name_or_path')}, not by the one "
                           f"of {model_path}: {'; '.join(differ)} (data vs model); its token ids would be read as "
                           f"other tokens. {fix}")
        return
    other = f"so the data was tokenized by another tokenizer. {fix}"
    columns = [c for c in dataset.column_names if c.endswith(("_token", "_token_response_label"))]
    table = dataset.select_columns(columns).with_format("arrow")[:]
    for column in (c for c in columns if table.num_rows and pyarrow.types.is_integer(getattr(
            table.schema.field(c).type, "value_type", pyarrow.string()))):
        highest = pyarrow.compute.max(pyarrow.compute.list_flatten(table.column(column))).as_py()
        if highest is not None and highest >= size:
            raise RunError(f"{where}: {column!r} holds the token id {highest}, but the tokenizer of {model_path} "
                           f"has {size} tokens, {other}")
    head = dataset.select(range(min(rows, len(dataset))))
    for column in (c for c in columns if c + "_len" in dataset.column_names):
        ends = []  # the last token of each response (the query column has none)
        for i, (ids, n) in enumerate(zip(head[column], head[column + "_len"])):
            left = column == "query_token"  # queries are left-padded, responses right-padded (Detail 5)
            wrong = [t for t in (ids[: len(ids) - n] if left else ids[n:]) if t != pad] if n <= len(ids) else []
            if wrong:
                raise RunError(f"{where} row {i}: {column!r} is padded with the id {wrong[0]}, but the tokenizer of "
                               f"{model_path} pads with {pad}, {other}")
            ends += [ids[n - 1]] if not left and 0 < n <= len(ids) else []
        if ends and eos not in ends:  # every response ends with EOS (Detail 3); not one does here
            raise RunError(f"{where}: no response in the first {len(ends)} rows of {column!r} ends with the EOS id "
                           f"{eos} of the tokenizer of {model_path} (they end with {sorted(set(ends))[:5]}), {other}")

def check_query_response(dataset, pad_token_id: int, where: str) -> None:
    """Bad input: in each query_<X>_token column the response starts where the query (query_token without [PAD])
    ends: its labels (..._response_label) are its tokens with the query masked by [PAD], and in data/prepare.py's
    splits its first tokens are the query. A column shifted by a token would train in silence. After check_columns."""
    names, table = dataset.column_names, dataset.with_format("arrow")[:]
    matrix = lambda c: pyarrow.compute.list_flatten(table.column(c)).to_numpy(zero_copy_only=False).reshape(len(dataset), -1)  # noqa: E731
    query = matrix("query_token") if "query_token" in names and len(dataset) else np.zeros((0, 0))
    length = (query != pad_token_id).sum(1)  # the query's real tokens, wherever its padding is
    for column in (c for c in names if c.startswith("query_") and c.endswith("_token") and c != "query_token" and len(query)):
        tokens, label, found = matrix(column), column + "_response_label", []
        in_query = np.arange(tokens.shape[1]) < length[:, None]  # the positions of the row's query
        if written_by_prepare(dataset) is not None:  # (hub data may have tokenized query + response as one text)
            moved = np.repeat(np.arange(len(query)), length)[tokens[in_query] != query[query != pad_token_id]]
            found += [(int(moved[0]), "its first tokens are not the row's query_token")] if moved.size else []
        if label in names:
            bad = np.flatnonzero((np.where(in_query, pad_token_id, tokens) != matrix(label)).any(1))
            found += [(int(bad[0]), f"{label!r} is not it with the query masked by [PAD] ({pad_token_id})")] if bad.size else []
        if found:
            row, what = min(found, key=lambda item: item[0])  # (on one row, the first reason)
            raise RunError(f"{where} row {row}: the response in {column!r} does not start where the query ends: {what}; "
                           "prepare the data again with data/prepare.py")

def check_finite(model, path: str) -> None:
    """Bad input: a loaded model whose weights hold NaN or inf (a diverged run's save), named with its first such tensor."""
    files = glob.glob(os.path.join(path, "*.safetensors")) if os.path.isdir(path) else []
    for name, weight in model.named_parameters():
        if weight.is_floating_point() and not torch.isfinite(weight).all():
            raise NonFiniteError(
                f"{files[0] if len(files) == 1 else path} holds non-finite weights: {name} has "
                f"{int((~torch.isfinite(weight)).sum())} NaN or inf values of {weight.numel()}; load a model whose "
                "weights are finite (e.g. a checkpoint from before its run diverged)")

def check_reward_tokenizer(tokenizer, sft_model_path: str, reward_model_path: str, trust_remote_code: bool) -> None:
    """Bad input: the reward model (and a critic made from it, Detail 22) reads the policy's token ids, so it must have
    the policy's tokenizer; a mismatch raises no error elsewhere, it makes every score noise."""
    files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if os.path.isdir(reward_model_path) and not any(os.path.exists(os.path.join(reward_model_path, f)) for f in files):
        raise RunError(
            f"--reward_model_path {reward_model_path} holds no tokenizer, so this script cannot check that the reward model "
            f"reads the token ids of the policy {sft_model_path}; save the tokenizer the reward model was trained with "
            f"into that folder (tokenizer.save_pretrained), as reward.py does")
    rm_tokenizer = AutoTokenizer.from_pretrained(reward_model_path, trust_remote_code=trust_remote_code)
    if rm_tokenizer.pad_token is None:
        rm_tokenizer.add_special_tokens({"pad_token": "[PAD]"})  # the same fallback the policy's tokenizer gets
    if differ := tokenizer_difference(tokenizer_fingerprint(tokenizer), tokenizer_fingerprint(rm_tokenizer)):
        raise RunError(
            f"the reward model {reward_model_path} was trained with a different tokenizer than the policy "
            f"{sft_model_path}: {'; '.join(differ)} (policy vs reward model). The reward model would read token ids "
            f"it was not trained on and score noise. Train the reward model from this SFT model "
            f"(reward.py --sft_model_path {sft_model_path}), or pass the SFT model the reward model was trained from")

def check_gradient_accumulation(args, derived: int, num_processes: int, num_mini_batches: int = 1) -> None:
    """--gradient_accumulation_steps left out (None) takes `derived`, the micro batches per optimizer step that the
    batch sizes give; a stated value must equal it (it checks the batch arithmetic, it never overrides it)."""
    if args.gradient_accumulation_steps is not None and args.gradient_accumulation_steps != derived:
        raise RunError(
            f"--gradient_accumulation_steps {args.gradient_accumulation_steps} does not match total_batch_size "
            f"{args.total_batch_size} / ({num_processes} processes x {num_mini_batches} minibatches x "
            f"{args.local_micro_batch_size} micro batch) = {derived}; leave it out or change the batch sizes")

def check_qlora_flags(args, accelerator) -> None:
    """--load_in_4bit (QLoRA): what it needs, checked before any model loads and before --output_dir is claimed."""
    if not args.load_in_4bit:
        return
    if args.lora_rank <= 0:
        raise RunError("--load_in_4bit (QLoRA) stores the frozen base of a LoRA policy in 4 bits and trains LoRA adapters "
                       "on top: it needs --lora_rank > 0 (e.g. --lora_rank 8); 4-bit weights cannot be trained themselves")
    if getattr(accelerator.state.deepspeed_plugin, "zero_stage", None) == 3:
        raise RunError("--load_in_4bit cannot run under DeepSpeed ZeRO-3, which splits every weight across the processes: "
                       "bitsandbytes' packed 4-bit weights cannot be split. Use zero2.yaml (each process keeps the small "
                       "4-bit base whole) or plain data parallel (torchrun)")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise ImportError("--load_in_4bit needs the bitsandbytes package, which quantizes the base to 4 bits and "
                          "computes with it: pip install bitsandbytes") from error

# ---- Processes, locks, the run folder, checkpoints and resume, the non-finite guard and its fallback ------------------
def start_processes() -> PartialState:
    """Join the run's process group before anything reads the process count, and leave it at exit (gloo on the CPU)."""
    atexit.register(lambda: torch.distributed.is_initialized() and torch.distributed.destroy_process_group())
    if torch.cuda.is_available():
        return PartialState()
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    return PartialState(backend="gloo") if deepspeed else PartialState(cpu=True)

def claim_lock(path: str, take_over: bool = False, other: str = "--run_name") -> None:
    """One live owner per folder: `path` holds its host, pid and process start time, written whole (a temporary file
    linked into place: the link fails if a lock exists). The lock of an ended process is taken over, an unreadable one
    (a crash before this rule) with a warning; one of another host cannot be checked: `take_over` takes it."""
    me = {"host": os.uname().nodename, "pid": os.getpid(), "started": psutil.Process().create_time()}
    temporary, folder = f"{path}.{os.getpid()}.tmp", os.path.dirname(os.path.abspath(path))
    try:
        with open(temporary, "w") as f:  # complete before it is linked
            json.dump(me, f)
        with contextlib.suppress(FileExistsError):
            return os.link(temporary, path)
        try:
            holder = json.load(open(path))
            host, pid, started = holder["host"], holder["pid"], holder.get("started")
        except (OSError, ValueError, KeyError, TypeError) as error:
            host = pid = started = None
            print(f"warning: taking over the unreadable lock {path} ({error!r})", file=sys.stderr)
        if host not in (None, me["host"]) and not take_over:
            raise RunError(f"{folder} is locked by process {pid} on the host {host} ({path}), which cannot be checked "
                           f"from {me['host']}; if that run has ended (e.g. its container restarted under a new host "
                           f"name), pass --take_over_lock; if it still runs, wait for it, or pass another {other}")
        with contextlib.suppress(psutil.Error):  # the holder, not a later process with its pid, is running
            if host == me["host"] and pid != me["pid"] and not take_over and psutil.pid_exists(pid) and (
                    started is None or abs(psutil.Process(pid).create_time() - started) < 1):
                raise RunError(f"{folder} is in use by the run of process {pid} on {host} ({path}); wait for it to "
                               f"end, or pass another {other}")
        os.replace(temporary, path)  # the whole new lock in place of the stale one
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)


INPUT_FILES = {"config.json", "adapter_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
               "merges.txt", "special_tokens_map.json", "added_tokens.json"}

def content_digest(path: str) -> Optional[str]:
    """The sha256 of the names and bytes (not times: a byte-identical re-prepare is the same input) of what a run reads
    of `path`: weights, arrow files (not datasets' cache-*), INPUT_FILES. None for a path that is none (a hub name)."""
    if not os.path.exists(path):
        return None
    files = [path] if os.path.isfile(path) else sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names
                                                     if f in INPUT_FILES or not f.startswith("cache-") and
                                                     f.endswith((".arrow", ".safetensors", ".bin", ".model")))
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            digest.update(os.path.relpath(file, path).encode() + hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()

@contextlib.contextmanager
def saving(folder: str, what: str, needed: Optional[int], then: str):
    """A full disk named: an error saving `what` into `folder` (ENOSPC, or under 1 MiB left: torch's writer says it in
    its own words) becomes one RunError naming the folder and, when known, the space needed; others pass unchanged."""
    try:
        yield
    except Exception as error:
        if "No space left" not in "".join(traceback.format_exception(error)) and not (
                os.path.isdir(folder) and shutil.disk_usage(folder).free < 2**20):
            raise
        need = f" (it needs about {needed / 2**20:.1f} MiB)" if needed else ""
        raise RunError(f"the disk holding {folder} is full: {what} was not saved{need}. {then}") from error

class Run:
    """Everything a training run keeps on disk besides the model, behind one small interface:

        run = Run(args, accelerator)          # name, folder and its lock; with --resume, the checkpoint to load
        run.inputs(query_dataset=path, ...)   # content hashes of the data and models read (refused if changed on resume)
        run.claim_output_dir()                # after the input checks: --output_dir becomes this run's
        state = run.start(state, **shape)     # --resume: load that checkpoint; then open the logs
        run.guard(update, loss=loss)          # non-finite guard (raises NonFiniteError on every process)
        run.log(step, metrics)                # TensorBoard + metrics.jsonl (+ W&B with --track); run.save_table(frame, name)
        run.checkpoint(update, state)         # atomic checkpoint with a manifest of its files; finite weights only
        run.finish(summary)                   # summary.json; marks --output_dir complete, last
    `state` is the script's trainer state (data position, counters); accelerate's save_state holds the rest
    (models, optimizers, registered objects, RNG states). `shape` must match between a checkpoint and a resume."""

    def __init__(self, args, accelerator):
        self.args, self.accelerator, self.main, root = args, accelerator, accelerator.is_main_process, args.run_dir_root
        if args.run_name is None and args.resume:  # the run of this experiment and seed whose checkpoints are newest
            runs = glob.glob(os.path.join(root, f"{args.exp_name}__{args.seed}__*", "checkpoints"))
            if not runs:
                raise RunError(f"--resume: no run {root}/{args.exp_name}__{args.seed}__* has a checkpoint; pass --run_name")
            args.run_name = os.path.basename(os.path.dirname(max(runs, key=os.path.getmtime)))
        # one name for all processes: their clocks may disagree on the second
        args.run_name = broadcast_object_list([args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"])[0]
        # the inputs' content hashes (inputs) and the manifest of the checkpoint to resume
        self.dir, self.shape, self.writer, self.digests, self.manifest = os.path.join(root, args.run_name), {}, None, {}, {}
        self.stage = getattr(accelerator.state.deepspeed_plugin, "zero_stage", None)  # None: no DeepSpeed
        self.checkpoints, self.lock = os.path.join(self.dir, "checkpoints"), os.path.join(self.dir, "run.lock")
        if self.main:  # one live run per folder (claim_lock)
            os.makedirs(self.dir, exist_ok=True)
            claim_lock(self.lock, getattr(args, "take_over_lock", False))
        self.resume_from = self.intact_checkpoint() if args.resume else None

    def saved(self) -> list:  # the completed checkpoints, oldest first (a killed save never got its name update_N)
        return sorted(glob.glob(os.path.join(self.checkpoints, "update_*")))

    def intact_checkpoint(self) -> str:
        """--resume: the newest checkpoint whose files all match its manifest (sizes included, RNG states too),
        written by as many processes and the same DeepSpeed stage as this run; checked before any model loads."""
        root, saved = self.checkpoints, self.saved()
        for path in reversed(saved):
            try:
                manifest = json.load(open(os.path.join(path, "manifest.json")))
                problem = next((f"{os.path.join(path, f)} has {os.path.getsize(os.path.join(path, f))} bytes, not {n}"
                                for f, n in manifest["files"].items() if os.path.getsize(os.path.join(path, f)) != n), None)
            except (OSError, ValueError, KeyError) as error:  # a missing file, or a manifest that is not one
                missing = isinstance(error, FileNotFoundError)
                problem = f"{error.filename} is missing" if missing else f"{path}/manifest.json is unreadable ({error!r})"
            if problem is None:
                break
            self.accelerator.print(f"--resume: skipping the damaged checkpoint {path}: {problem}")
        else:
            raise RunError(f"--resume: no intact checkpoint in {root}" + (f": {problem}" if saved else ""))
        for stale in (d for d in os.listdir(root) if d.startswith(".tmp_") and self.main):  # of killed or failed saves
            shutil.rmtree(os.path.join(root, stale))
        self.manifest, theirs = manifest, (manifest["num_processes"], manifest["deepspeed_stage"])
        ours = (self.accelerator.num_processes, self.stage)
        if theirs != ours and not (theirs[1] is None and ours[1] is None and ours[0] < theirs[0]):  # plain DDP onto fewer: exact
            raise RunError(f"--resume: {path} was written by {theirs[0]} process(es) with DeepSpeed stage {theirs[1]}, this "
                           f"run has {ours[0]} with stage {ours[1]}; launch {theirs[0]} process(es) with the original config")
        return path

    def inputs(self, **paths) -> None:
        """The content hashes (content_digest) of what this run reads, name=path (prepared data and model folders,
        named as their flags; a list gives name[i]), saved with every checkpoint. With --resume, contents other than
        the checkpoint's are refused, unless --accept_changed_inputs goes on with them knowingly."""
        flat = {f"{n}[{i}]": p for n, ps in paths.items() if isinstance(ps, (list, tuple)) for i, p in enumerate(ps)}
        flat.update({n: p for n, p in paths.items() if isinstance(p, str)})
        digests = {n: {"path": p, "sha256": content_digest(p)} for n, p in flat.items()} if self.main else None
        self.digests.update(broadcast_object_list([digests])[0])  # one process reads the files
        changed = []
        for name, now in self.digests.items():
            then = self.manifest.get("inputs", {}).get(name, {})
            if None not in (then.get("sha256"), now["sha256"]) and then["sha256"] != now["sha256"]:
                moved = f" in {then['path']}" if then["path"] != now["path"] else ""
                changed.append(f"--{name} {now['path']} (sha256 {then['sha256'][:12]}{moved} then, {now['sha256'][:12]} now)")
        if changed and not getattr(self.args, "accept_changed_inputs", False):
            raise RunError(f"--resume: {self.resume_from} was made from other contents than these inputs hold: "
                           f"{'; '.join(changed)}. Resume with the inputs it was made from, or pass "
                           "--accept_changed_inputs to go on with these knowingly")
        if changed:
            self.accelerator.print(f"--resume with changed inputs (--accept_changed_inputs): {'; '.join(changed)}")

    def claim_output_dir(self) -> None:
        """Refuse an --output_dir that holds another run's files, then mark it as this run's (run.json, not complete)."""
        out, mark = self.args.output_dir, os.path.join(self.args.output_dir, "run.json")
        if os.path.isdir(out) and os.listdir(out) and not (self.args.overwrite_output_dir or self.args.resume):
            owner = json.load(open(mark)).get("run_name") if os.path.exists(mark) else None
            if owner != self.args.run_name:
                raise RunError(
                    f"--output_dir {out} already holds {'the run ' + repr(owner) if owner else 'files of another run'}; "
                    f"pass a new --output_dir, or --overwrite_output_dir to replace it"
                    + (f", or --resume --run_name {owner} to continue that run" if owner else ""))
        self.accelerator.wait_for_everyone()  # every process checked before the mark changes
        if self.main:
            os.makedirs(out, exist_ok=True)
            json.dump({"run_name": self.args.run_name}, open(mark, "w"))

    def start(self, state: dict, **shape) -> dict:
        """The trainer state to go on from (the checkpoint's with --resume, else `state`); opens the logs."""
        self.shape, resumed_at = shape, 0
        if self.resume_from:
            state = json.load(open(os.path.join(self.resume_from, "trainer_state.json")))
            if {key: state.get(key) for key in shape} != shape:
                raise RunError(f"--resume: the checkpoint belongs to a run with {({k: state.get(k) for k in shape})}, "
                               f"these flags give {shape}; resume with the flags of the original run")
            self.accelerator.load_state(self.resume_from)
            self.accelerator.print(f"resumed from {self.resume_from} (update {state['update']})")
            resumed_at = state["update"]
        elif self.main:
            shutil.rmtree(self.checkpoints, ignore_errors=True)  # a fresh run of the same name starts over
        if self.main:
            os.makedirs(os.path.join(self.dir, "samples"), exist_ok=True)
            config = asdict(self.args)  # with the derived fields filled in
            json.dump(config, open(os.path.join(self.dir, "args.json"), "w"), indent=2)
            if self.args.track:
                import wandb  # only with --track; it mirrors TensorBoard
                wandb.init(project=self.args.wandb_project_name, entity=self.args.wandb_entity, sync_tensorboard=True,
                           config=config, name=self.args.run_name, save_code=True)
            self.writer = SummaryWriter(self.dir, purge_step=resumed_at + 1 if self.resume_from else None)
            self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in config.items()))
            metrics, kept = os.path.join(self.dir, "metrics.jsonl"), []
            if resumed_at and os.path.exists(metrics):  # what was logged after the checkpoint goes: logs as if never cut
                kept = [line for line in open(metrics) if json.loads(line)["step"] <= resumed_at]
            open(metrics, "w").writelines(kept)
        return state

    def guard(self, update: int, **quantities: torch.Tensor) -> None:
        """Non-finite guard: stop when a named tensor holds a NaN or inf on any process (the flags are summed, so all
        raise together). Called before the optimizer step that would use it: the weights on hand are the last good."""
        flags = torch.stack([(~torch.isfinite(value.detach().float())).any() for value in quantities.values()]).float()
        flags = self.accelerator.reduce(flags.to(self.accelerator.device), reduction="sum")
        bad = [name for name, flag in zip(quantities, flags.tolist()) if flag > 0]
        if bad:
            raise NonFiniteError(
                f"update {update}: {', '.join(bad)} is not finite (NaN or inf). The weights were not updated with it and "
                "the final model is not saved. Check the data of this update, or start a fresh run with a lower --lr "
                "(--resume from the last good checkpoint keeps the checkpoint's learning rate and schedule)")

    def log(self, step: int, metrics: dict) -> None:
        if self.main:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step)
            with open(os.path.join(self.dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")

    def save_table(self, frame, name: str) -> None:
        if self.main:
            frame.to_csv(os.path.join(self.dir, name), index=False)

    def checkpoint(self, update: int, state: dict) -> str:
        """Save what a resumed run needs after `update` (on every process); refused while a weight or an optimizer
        state holds NaN or inf. Atomic: written to a temporary folder, its manifest (files and sizes, the inputs'
        hashes) last, then renamed to update_N, so a killed or failed save leaves the previous one."""
        final, temporary = (os.path.join(self.checkpoints, f"{p}update_{update:06d}") for p in ("", ".tmp_"))
        latest, bad, needed = self.latest_checkpoint(), self.not_finite(), None
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # a new one takes about as much as the last
            needed = sum(json.load(open(os.path.join(latest, "manifest.json")))["files"].values())
        if bad:
            raise NonFiniteError(f"the checkpoint of update {update} was not saved: {bad} (NaN or inf). The newest "
                                 f"checkpoint is still {latest}")
        self.accelerator.wait_for_everyone()
        try:  # (a temporary folder of a killed save is removed by the --resume that follows it)
            with saving(self.checkpoints, f"the checkpoint of update {update}", needed,
                        f"The newest checkpoint is still {latest}. Free space there, then --resume"):
                self.accelerator.save_state(temporary)
                self.accelerator.wait_for_everyone()
                if self.main:
                    json.dump({**self.shape, **state, "update": update}, open(os.path.join(temporary, "trainer_state.json"), "w"))
                    files = {os.path.relpath(os.path.join(d, f), temporary): os.path.getsize(os.path.join(d, f))
                             for d, _, names in os.walk(temporary) for f in names}
                    json.dump({"files": files, "num_processes": self.accelerator.num_processes, "deepspeed_stage": self.stage,
                               "inputs": self.digests}, open(os.path.join(temporary, "manifest.json"), "w"))
        except Exception:
            shutil.rmtree(temporary, ignore_errors=True)  # a failed save leaves no half-written folder behind
            raise
        if self.main:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(temporary, final)
            for old in self.saved()[:-self.args.checkpoint_keep]:  # --checkpoint_keep 0 keeps all ([:-0] is empty)
                shutil.rmtree(old)
        self.accelerator.wait_for_everyone()
        return final

    def not_finite(self) -> str:
        """What of the prepared models' weights and the optimizers' states holds NaN or inf, on any process ("": all
        finite). A checkpoint of them would only resume into the same NaN."""
        names = {id(p): n for m in self.accelerator._models for n, p in m.named_parameters()}
        tensors = [(f"the weight {n}", getattr(p, "ds_tensor", p)) for m in self.accelerator._models
                   for n, p in m.named_parameters()]  # (ZeRO-3 keeps each process's part in ds_tensor)
        tensors += [(f"the optimizer's {k} of {names.get(id(p), 'a weight')}", v) for o in self.accelerator._optimizers
                    for p, s in getattr(o, "state", {}).items() for k, v in s.items() if torch.is_tensor(v)]
        bad = [name for name, t in tensors if t.is_floating_point() and not torch.isfinite(t).all()]
        flag = self.accelerator.reduce(torch.tensor([float(len(bad))], device=self.accelerator.device), reduction="sum")
        return "" if flag.item() == 0 else ", ".join(bad[:3]) + (" ..." if len(bad) > 3 else "") or "another process's state"

    def latest_checkpoint(self) -> Optional[str]:
        return (self.saved() or [None])[-1]

    def finish(self, summary: dict) -> None:
        """summary.json, then the mark that --output_dir is complete (written last: a folder without it is not)."""
        if self.main:
            json.dump(summary, open(os.path.join(self.dir, "summary.json"), "w"), indent=2)
            self.writer.close()  # (a W&B run ends with the process)
            json.dump({"run_name": self.args.run_name, "complete": True},
                      open(os.path.join(self.args.output_dir, "run.json"), "w"))
            os.remove(self.lock)

class LastGoodState:
    """The non-finite guard's fallback around one update (`with last_good.kept(update, state):`): raised before its first
    optimizer step, the RNG states, accumulation counter and registered objects are put back and saved as last good."""
    def __init__(self, run, accelerator, optimizer: torch.optim.Optimizer, *registered):
        self.run, self.accelerator, self.registered, self.optimizer_steps = run, accelerator, registered, 0
        optimizer.register_step_post_hook(lambda *_: setattr(self, "optimizer_steps", self.optimizer_steps + 1))
    @contextlib.contextmanager
    def kept(self, update: int, trainer_state: dict):
        # the random states accelerate's save_state writes (Python, NumPy, torch, CUDA), as the update starts
        python_rng, numpy_rng, torch_rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        step, registered, self.optimizer_steps = self.accelerator.step, [o.state_dict() for o in self.registered], 0
        try:
            yield
        except NonFiniteError:
            if self.optimizer_steps == 0:
                random.setstate(python_rng)
                np.random.set_state(numpy_rng)
                torch.set_rng_state(torch_rng)
                if cuda_rng is not None:
                    torch.cuda.set_rng_state_all(cuda_rng)
                self.accelerator.step = step
                for obj, saved in zip(self.registered, registered):
                    obj.load_state_dict(saved)
                self.run.checkpoint(update - 1, trainer_state)
                what = "before any optimizer step of it"
            else:
                what = f"after {self.optimizer_steps} optimizer step(s) of it changed the weights; those weights are NOT saved"
            self.accelerator.print(f"non-finite value at update {update} {what}. Last good checkpoint: "
                                   f"{self.run.latest_checkpoint() or 'none (no --checkpoint_every checkpoint yet)'}")
            raise

def due(every: int, update: int, num_updates: Optional[int] = None) -> bool:
    """Whether an action done every `every` updates (0 = never) falls on `update`; never on the last, num_updates."""
    return every > 0 and update % every == 0 and (num_updates is None or update < num_updates)

# ---- Outputs ----------------------------------------------------------------------------------------------------------
def save_pretrained_model(accelerator, wrapped, model, tokenizer, output_dir: str, prefix: str = "") -> None:
    """save_pretrained (safetensors) of `model` and its tokenizer in output_dir, the weights of
    accelerator.get_state_dict(wrapped) (every process calls it: ZeRO-3 gathers the shards) without their `prefix`
    (the name of `model` inside the wrapper: reward.py's "rm."). A full disk is named."""
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(wrapped)
    if accelerator.is_main_process:
        state_dict = {name[len(prefix):]: value for name, value in state_dict.items() if name.startswith(prefix)}
        with saving(output_dir, "the final model", sum(v.numel() * v.element_size() for v in state_dict.values()),
                    "Free space there, then run again (--resume: from the newest checkpoint, if any)"):
            model.save_pretrained(output_dir, state_dict=state_dict)
            tokenizer.save_pretrained(output_dir)

def upload_to_hub(args) -> None:
    """--push_to_hub: upload --output_dir to the hub repository --hub_model_id (None: the run name); main process."""
    from huggingface_hub import HfApi
    hub_model_id, api = args.hub_model_id if args.hub_model_id is not None else args.run_name, HfApi()
    api.create_repo(hub_model_id, exist_ok=True)
    api.upload_folder(folder_path=args.output_dir, repo_id=hub_model_id)

def frame_markdown(df: pd.DataFrame) -> str:
    """A small pandas table as markdown for TensorBoard's text tab (pipes and newlines escaped)."""
    cell = lambda value: str(value).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)

# ---- The judge's client (judge.py, online_dpo.py --judge endpoint): API key, cache, retries ---------------------------
LOOPBACK_PLACEHOLDER_KEY = "sk-loopback-placeholder"

def is_loopback_url(url: Optional[str]) -> bool:
    host = urllib.parse.urlsplit(url or "").hostname or ""
    with contextlib.suppress(ValueError):
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    return False

def resolve_api_key(base_url: Optional[str]) -> str:
    """The key comes from the environment only; a loopback endpoint (the gold judge) needs none: a placeholder."""
    key = os.environ.get("OPENAI_API_KEY") or (LOOPBACK_PLACEHOLDER_KEY if is_loopback_url(base_url) else None)
    if key:
        return key
    raise SystemExit("set OPENAI_API_KEY in the environment (the key is never read from flags or files)")

def public_url(url: Optional[str]) -> Optional[str]:
    """The base URL without any user:password part, for the summary file."""
    parts = urllib.parse.urlsplit(url or "")
    netloc = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    return None if url is None else urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))

class ReplyCache:
    """Every reply the judge paid for, in sqlite, keyed by model, endpoint (its URL without credentials), system prompt,
    prompt, temperature, seed (when the judge samples) and ask index (re-asks after an unparseable reply): a rerun
    replays them without a request. A kill between an answer and `put` pays again for the requests in flight."""
    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.db = sqlite3.connect(path)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("CREATE TABLE IF NOT EXISTS replies (key TEXT PRIMARY KEY, model TEXT, reply TEXT, created REAL)")
        self.db.commit()
    @staticmethod
    def key(model: str, endpoint: str, system_prompt: str, prompt: str, temperature: Optional[float], seed: int,
            ask_index: int) -> str:
        sampled_with = None if temperature == 0 else seed  # a greedy judge answers alike whatever the seed
        fields = [model, endpoint, system_prompt, prompt, temperature, sampled_with, ask_index]
        return hashlib.sha256(json.dumps(fields).encode()).hexdigest()
    def get(self, key: str) -> Optional[str]:
        row = self.db.execute("SELECT reply FROM replies WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]
    def put(self, key: str, model: str, reply: str) -> None:
        # committed at once, so an interrupted run keeps every reply it received
        self.db.execute("INSERT OR REPLACE INTO replies VALUES (?, ?, ?, ?)", (key, model, reply, time.time()))
        self.db.commit()
    def close(self) -> None:
        self.db.close()

class JudgeAPIError(Exception):
    """A request that failed for good (non-retryable status, or retryable ones past --max_tries)."""

class JudgeUnavailableError(RunError, RuntimeError):
    """The judge cannot be used at all (unreachable, stalling, answering no chat completion or failing before its first
    answer, the key refused, every request refused): asking on would only mark each row invalid, so the run stops."""

class BadReply(Exception):
    """An answer that is no chat completion: cut off, or no JSON with a message's text (args: what, the detail)."""

# status "ok", "unparseable" or "api_error"; parsed: parse_fn's result if ok; the last reply; asks made (cached or not)
Outcome = collections.namedtuple("Outcome", "status parsed reply asks error", defaults=[""])

class Judge:
    """The async client, its concurrency limit, the retry policy and the cache."""

    RETRYABLE = (openai.RateLimitError, openai.InternalServerError, openai.APIConnectionError)
    # what the run-stopping error says of a judge that never answered, by the last failure, and the fix
    STOPPED = {"cannot be reached": "check that the server is running and that --base_url points at it",
               "answers no chat completion": "check that --base_url is the /v1 root of an OpenAI-compatible API",
               "answered, but the body was cut": "check the server (and any proxy before it), or try again later",
               **dict.fromkeys(["did not answer", "answered and stalled"], "check the server's load, or raise --timeout_s")}

    def __init__(self, args, cache: ReplyCache):
        self.args, self.cache, self._api_key = args, cache, resolve_api_key(args.base_url)
        # max_retries=0: the retry policy below is the only one, so tries are bounded and counted
        self.client = AsyncOpenAI(api_key=self._api_key, base_url=args.base_url, max_retries=0, timeout=args.timeout_s)
        self.semaphore, self.jitter = asyncio.Semaphore(args.max_parallel_requests), random.Random(args.seed)
        self.stats = {"requests": 0, "cache_hits": 0, "retries": 0, "reasks": 0, "api_errors": 0}
        self.answered = 0  # requests the server answered in this run (cache hits not counted)

    def redact(self, text: str) -> str:  # belt and braces: no error text we keep may contain the key
        return text.replace(self._api_key, "[REDACTED]") if self._api_key else text

    def unavailable(self, what: str, cause: str, fix: str) -> JudgeUnavailableError:
        """The error that stops the run: the URL (without credentials), what went wrong, the cause and the fix."""
        url = public_url(self.args.base_url or str(self.client.base_url))
        return JudgeUnavailableError(self.redact(f"the judge at {url} {what} ({cause}); {fix}"))

    def backoff_s(self, attempt: int) -> float:  # exponential backoff with jitter: half the doubled delay fixed
        cap = min(self.args.backoff_max_s, self.args.backoff_base_s * 2**attempt)
        return cap / 2 + self.jitter.uniform(0, cap / 2)

    async def ask_once(self, messages: list, extra: dict, phase: list) -> str:
        """One request: the reply's text. phase[0] turns "answered" once the status and headers are in, so that a
        deadline past it reads as a stall after answering."""
        create = self.client.chat.completions.with_streaming_response.create
        async with create(model=self.args.model, messages=messages, **extra) as response:
            phase[0] = "answered"
            try:
                body = await response.read()
            except Exception as error:  # the HTTP library's own (httpx, or httpx2 under newer openai): stalled or cut
                cut = BadReply("answered, but the body was cut", f"{type(error).__name__}: {error}")
                raise (TimeoutError() if "Timeout" in type(error).__name__ else cut) from error
        with contextlib.suppress(ValueError, TypeError, KeyError, IndexError):
            content = json.loads(body)["choices"][0]["message"]["content"]
            if content is None or isinstance(content, str):
                self.answered += 1
                return content or ""
        raise BadReply("answers no chat completion", f"200 with the body {body[:100].decode(errors='replace')!r}")

    async def request(self, prompt: str) -> str:
        messages = [{"role": "system", "content": self.args.system_prompt}, {"role": "user", "content": prompt}]
        extra = {} if self.args.temperature is None else {"temperature": self.args.temperature}
        # the slot is held through the backoff waits too: a rate-limited API gets fewer requests
        async with self.semaphore:
            for attempt in range(self.args.max_tries):
                self.stats["requests"] += 1
                phase = ["asked"]
                try:  # --timeout_s bounds the whole request: a server that trickles its answer is cut off too
                    return await asyncio.wait_for(self.ask_once(messages, extra, phase), self.args.timeout_s)
                except (openai.AuthenticationError, openai.PermissionDeniedError) as e:  # 401 / 403: so for every row
                    raise self.unavailable("refused the API key", f"{type(e).__name__}: {e}", "check the key in "
                                           "OPENAI_API_KEY (it is read from the environment only)") from None
                except (TimeoutError, openai.APITimeoutError):  # (before the APIConnectionError it is)
                    what = "answered and stalled" if phase[0] == "answered" else "did not answer"
                    last_error = f"no complete reply within --timeout_s {self.args.timeout_s} s"
                except BadReply as e:
                    what, last_error = e.args
                except self.RETRYABLE as e:
                    what = "cannot be reached" if isinstance(e, openai.APIConnectionError) else "failed"
                    last_error = f"{type(e).__name__}: {e}"
                except openai.APIStatusError as e:  # 400, 404 ...: asking again will not help
                    error = f"{type(e).__name__}: {e}"
                    if isinstance(e, openai.NotFoundError) and not self.answered:  # an unknown model or path
                        raise self.unavailable("failed before answering any request", error, "check that it serves the "
                                               f"model {self.args.model!r} (--model) and that --base_url is its /v1 root") from None
                    raise JudgeAPIError(self.redact(error)) from None  # this prompt only (e.g. too long)
                if attempt + 1 < self.args.max_tries:
                    self.stats["retries"] += 1
                    await asyncio.sleep(self.backoff_s(attempt))  # never a blocking sleep in async code
            error = f"gave up after {self.args.max_tries} tries; last error {last_error}"
            if not self.answered:  # unreachable, stalled or failing since the start: no row would be judged
                raise self.unavailable(what if what in self.STOPPED else "failed before answering any request", error,
                                       self.STOPPED.get(what, "try again later, or raise --max_tries"))
            raise JudgeAPIError(self.redact(error))

    async def ask(self, prompt: str, parse_fn: Callable[[str], object]) -> Outcome:
        """Ask until parse_fn accepts the reply, at most --max_parse_tries times."""
        reply, endpoint = "", public_url(str(self.client.base_url))  # the URL asked (--base_url or the client's default)
        for ask_index in range(self.args.max_parse_tries):
            key = ReplyCache.key(self.args.model, endpoint, self.args.system_prompt, prompt, self.args.temperature,
                                 self.args.seed, ask_index)
            reply = self.cache.get(key)
            if reply is not None:
                self.stats["cache_hits"] += 1
            else:
                try:
                    reply = await self.request(prompt)
                except JudgeAPIError as e:
                    self.stats["api_errors"] += 1
                    return Outcome("api_error", None, "", ask_index, str(e))
                self.cache.put(key, self.args.model, reply)
            parsed = parse_fn(reply)
            if parsed is not None:
                return Outcome("ok", parsed, reply, ask_index + 1)
            if ask_index + 1 < self.args.max_parse_tries:
                self.stats["reasks"] += 1
        return Outcome("unparseable", None, reply, self.args.max_parse_tries)

    async def ask_all(self, jobs: list[tuple[str, Callable[[str], object]]], on_done: Callable[[int, Outcome], None]) -> list[Outcome]:
        """Run every (prompt, parse_fn) job concurrently; on_done(index, outcome) as each finishes."""
        async def run(i: int, prompt: str, parse_fn) -> tuple[int, Outcome]:
            return i, await self.ask(prompt, parse_fn)
        outcomes: list[Optional[Outcome]] = [None] * len(jobs)
        tasks = [asyncio.ensure_future(run(i, p, f)) for i, (p, f) in enumerate(jobs)]
        try:
            for next_done in asyncio.as_completed(tasks):
                i, outcome = await next_done
                outcomes[i] = outcome
                on_done(i, outcome)
            failed = [o for o in outcomes if o.status == "api_error"]
            if failed and len(failed) == len(outcomes):  # e.g. every prompt refused with a 400
                raise self.unavailable("refused every request", f"all {len(failed)} failed; the first: {failed[0].error}",
                                       "check --model, --temperature and the prompts it refuses")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # collect the cancelled ones (no "never retrieved")
            await self.client.close()
        return outcomes

def run_jobs(args, jobs: list[tuple[str, Callable[[str], object]]], on_done, cache: ReplyCache) -> tuple[list[Outcome], dict]:
    if not jobs:  # e.g. every pair a tie: nothing to ask
        return [], {"requests": 0, "cache_hits": 0, "retries": 0, "reasks": 0, "api_errors": 0, "judging_s": 0.0}

    async def go():
        judge, start = Judge(args, cache), time.time()
        outcomes = await judge.ask_all(jobs, on_done)
        judge.stats["judging_s"] = time.time() - start  # the requests alone, without loading or plotting
        return outcomes, judge.stats
    return asyncio.run(go())

