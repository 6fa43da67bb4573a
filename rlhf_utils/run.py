"""The run: what every training script imports to name, lock, log, checkpoint and resume one run.

  flags             FREE_FLAGS (those a --resume may change), flag_values and flat_config (the flags as args.json and a
                    checkpoint record them, the groups of FLAT_GROUPS flat); evaluation_rng: evaluation's own random
                    stream, so that evaluating never changes what a run trains
  processes         start_processes (with the process group's timeout), leave_processes (the exit without the
                    teardown that can abort); synced_time: a phase's end, the GPU's queued work done;
                    seeded_accelerator: the Accelerator whose data order a resume rebuilds, from the numbers
                    the script decides (accumulation steps, data seed, bf16)
  the run folder    Run: name, lock (claim_lock), --output_dir claim, the inputs' content hashes (content_digest,
                    INPUT_FILES; each file's hash cached on its size, times and inode), logs (TensorBoard,
                    metrics.jsonl, W&B with --track), checkpoints (atomic, with a manifest) and --resume (the flags
                    compared; or --restart: checkpoints are never deleted implicitly), completion marks, the
                    non-finite guard, provenance.json (what produced the run: rlhf_utils/provenance.py); due:
                    whether an action done every N updates falls on this one
  the fallback      LastGoodState: after a non-finite value, the state after the last good update as a checkpoint
  outputs           saving: a full disk named, for every save; written_whole, write_whole: a file renamed into
                    place once whole (the pipeline's markers, judge.py's and report.py's outputs); frame_markdown: a
                    table for TensorBoard's text tab

The expected errors and input checks are rlhf_utils/checks.py, which this module imports; the run's flags (RunFlags)
and the refusals of flag combinations are rlhf_utils/flags.py; placement and saving are rlhf_utils/models.py; what a
run writes about itself is rlhf_utils/records.py. The judge's HTTP client (judge.py, online_dpo.py --judge endpoint)
is rlhf_utils/judge_client.py; this module imports nothing of it (nor openai), so a training run that asks no judge
never loads an HTTP client.

Its rule: it never changes an uninterrupted run, and a resume or a fallback restores exactly what an ordinary
checkpoint of that update holds. It imports no training script.
"""

import atexit
import contextlib
import datetime
import glob
import hashlib
import json
import os
import random
import shutil
import sys
import time
import traceback
from dataclasses import asdict
from typing import Optional

import numpy as np
import pandas as pd
import psutil
import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, broadcast_object_list
from torch.utils.tensorboard import SummaryWriter

from rlhf_utils.checks import NonFiniteError, RunError, check_model_paths
from rlhf_utils.provenance import provenance, provenance_differences

# ----------------------------------------------------------------------------------------------------------------------
# The flags that decide no number a run computes: they may change between a checkpoint and its --resume (Run compares
# every other flag and refuses a change unless --accept_changed_flags). tests/test_run.py reads this set.
# ----------------------------------------------------------------------------------------------------------------------
FREE_FLAGS = frozenset({
    # names and folders of the run and its outputs
    "exp_name", "run_name", "run_dir_root", "output_dir", "overwrite_output_dir", "cache_dir",
    # checkpoints, resume and locks
    "checkpoint_every", "checkpoint_keep", "resume", "restart", "take_over_lock", "accept_changed_inputs",
    "accept_changed_flags",
    # tracking and uploads
    "track", "wandb_project_name", "wandb_entity", "push_to_hub", "hub_model_id",
    # logging and evaluation: evaluation samples from its own random stream (evaluation_rng), so how often and how
    # much a run evaluates never changes what it trains
    "eval_every", "num_eval_samples", "local_eval_batch_size", "eval_split", "eval_splits", "eval_temperature",
    "eval_test_split", "eval_betas", "dt_eval_percentiles", "dt_eval_targets", "num_table_samples",
    "num_logit_plot_samples", "num_calibration_bins", "print_sample_every", "log_every", "save_policy_every",
    "save_policy_at",
    # where frozen models wait between uses, whether generation gathers the policy's ZeRO-3 partitions once
    # (gathered_for_generation), and whether the backward pass reruns each layer instead of keeping its activations
    # (checkpointed): the same numbers either way
    "offload", "gather_for_generation", "gradient_checkpointing",
    # how long a collective waits for the other processes before the run fails (a wait, not a number)
    "process_group_timeout_min",
    # how long one call of a --reward_fn function may take before the run stops (a wait: a call that returns in time
    # gives the same numbers)
    "reward_fn_timeout_min",
    # the process layout: the checkpoint's process count and DeepSpeed stage are checked on their own
    # (Run.intact_checkpoint), and the accumulation steps follow from them and the batch-size flags
    "world_size", "gradient_accumulation_steps",
    # the judge's network settings (online_dpo.py --judge endpoint): how a reply is fetched, not what it says
    "base_url", "timeout_s", "max_tries", "backoff_base_s", "backoff_max_s", "max_parallel_requests", "cache_path",
    "rate_limit_patience",
})


# the groups of flags whose names are flat on the command line (tyro.conf.OmitArgPrefixes): the run's (RunFlags,
# rlhf_utils/flags.py), recorded flat in args.json and a checkpoint's flags as before the group existed
FLAT_GROUPS = ("run",)


def flat_config(args) -> dict:
    """The flags as args.json records them: a dict of asdict(args), the flat groups' flags at the top level."""
    config = asdict(args)
    for group in FLAT_GROUPS:
        config.update(config.pop(group, {}))
    return config


def flag_values(args) -> dict:
    """Every flag's value as JSON holds it, a nested group's flags under dotted names (ppo.kl_coef), the flat
    groups' under their own names (resume)."""
    def flat(values: dict, prefix: str = ""):
        for name, value in values.items():
            if isinstance(value, dict):
                yield from flat(value, f"{prefix}{name}.")
            else:
                yield prefix + name, value
    return dict(flat(json.loads(json.dumps(flat_config(args), default=str))))


@contextlib.contextmanager
def evaluation_rng(accelerator, seed: int):
    """Evaluation's own random stream: the torch RNG states of the CPU and of this process's accelerator are kept,
    torch is seeded with `seed` (the same stream at every evaluation), and the kept states are put back after. What
    training draws next is then what it would have drawn without the evaluation."""
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


# ----------------------------------------------------------------------------------------------------------------------
# Processes, locks, the run folder, checkpoints and resume, the non-finite guard and its fallback
# ----------------------------------------------------------------------------------------------------------------------
def start_processes(timeout_min: float = 60.0) -> PartialState:
    """Join the run's process group before anything reads the process count, and leave it at exit. accelerate picks a
    backend by itself only for GPUs; on the CPU we name gloo (`torchrun` ranks, or DeepSpeed with DS_ACCELERATOR=cpu):
    it ships with torch and needs no other library. `timeout_min` (--process_group_timeout_min): how long a collective
    waits for the other processes before it fails; accelerate hands it to torch.distributed.init_process_group, or
    under DeepSpeed to deepspeed.init_distributed, which hands it on to torch (their own default: 10 minutes)."""
    atexit.register(lambda: torch.distributed.is_initialized() and torch.distributed.destroy_process_group())
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    backend = {} if torch.cuda.is_available() else {"backend": "gloo"} if deepspeed else {"cpu": True}
    return PartialState(timeout=datetime.timedelta(minutes=timeout_min), **backend)


def leave_processes() -> None:
    """End a process that joined a process group, once its script's main() has returned: every exit handler now (the
    group destroyed, TensorBoard's and W&B's files closed, temporary folders removed), then os._exit(0), without the
    interpreter's teardown. Why: DeepSpeed keeps its own references to the process groups (every ZeRO-3 parameter,
    its engines, deepspeed.utils.groups), so destroying them at exit cannot stop gloo's worker threads. A worker that
    drops the last C++ reference of a tensor Python also holds (the last collectives') must take the GIL, and once
    the interpreter's teardown has begun Python ends such a thread with pthread_exit: the unwind through gloo's
    noexcept run loop calls std::terminate, "terminate called without an active exception" and exit -6 after the run
    saved everything (PyTorch issue 190489). Without the teardown no thread outlives a living interpreter. The
    scripts call it after main(), never inside it (the tests run main() in their own process)."""
    if torch.distributed.is_initialized():  # (one process without a launcher has no group: the usual exit)
        atexit._run_exitfuncs()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)


def synced_time(device: torch.device) -> float:
    """time.monotonic() once the work queued on `device` is done (torch.cuda.synchronize on a GPU, where kernels run
    after the Python call returns; nothing to wait for on the CPU), so that a logged phase time is that phase's own.
    A monotonic clock: a wall clock stepped back (NTP, a changed date) would make a duration negative. A reading
    means nothing in another process: what a checkpoint carries is elapsed seconds (records.next_state)."""
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    return time.monotonic()


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


# what a run reads of a data or model folder besides its weights and arrow files: config and tokenizer
INPUT_FILES = {"config.json", "adapter_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
               "merges.txt", "special_tokens_map.json", "added_tokens.json"}


def content_digest(path: str) -> Optional[str]:
    """The sha256 of the names and bytes (not times: a byte-identical re-prepare is the same input) of what a run reads
    of `path`: weights, arrow files (not datasets' cache-*), INPUT_FILES. None for a path that is none (a hub name).
    Each file's own sha256 comes from DIGEST_CACHE while the file is unchanged (file_sha256)."""
    if not os.path.exists(path):
        return None
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(d, f) for d, _, names in os.walk(path) for f in names
        if f in INPUT_FILES or not f.startswith("cache-") and f.endswith((".arrow", ".safetensors", ".bin", ".model")))
    digest, cache, fresh = hashlib.sha256(), read_digest_cache(), {}
    for file in files:
        digest.update(os.path.relpath(file, path).encode() + file_sha256(file, cache, fresh))
    write_digest_cache(fresh)
    return digest.hexdigest()


# The files' hashes content_digest has made, so that an unchanged input is not read again: a JSON file of
# {absolute path: [size, mtime_ns, ctime_ns, inode, device, sha256]} in the user's cache folder, shared by the runs of
# every checkout. RLHF_DIGEST_CACHE names another file; set empty, it turns the cache off.
DIGEST_CACHE = os.environ.get("RLHF_DIGEST_CACHE", os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "rlhf-details",
    "content_digests.json"))
# A file changed less than this before it was hashed is not cached: a file system stamps times coarsely (a clock tick;
# 1-2 s on some), so a rewrite of the same size right after could carry the very same times.
SETTLED_NS = 3 * 10**9


def file_sha256(file: str, cache: dict, fresh: dict) -> bytes:
    """A file's sha256: the cached one while its size, mtime, ctime (any write or utime changes it), inode and device
    are those it was hashed with, else read (and put in `fresh` when the file was settled and did not change during
    the read)."""
    key, started, before = os.path.abspath(file), time.time_ns(), os.stat(file)
    stamp = [before.st_size, before.st_mtime_ns, before.st_ctime_ns, before.st_ino, before.st_dev]
    entry = cache.get(key)
    if isinstance(entry, list) and len(entry) == 6 and entry[:5] == stamp:
        return bytes.fromhex(entry[5])
    with open(file, "rb") as f:
        sha256 = hashlib.file_digest(f, "sha256").digest()
    after = os.stat(file)
    if [after.st_size, after.st_mtime_ns, after.st_ctime_ns, after.st_ino, after.st_dev] == stamp and \
            started - max(before.st_mtime_ns, before.st_ctime_ns) > SETTLED_NS:
        fresh[key] = stamp + [sha256.hex()]
    return sha256


def read_digest_cache() -> dict:
    with contextlib.suppress(OSError, ValueError), open(DIGEST_CACHE) as f:
        cache = json.load(f)
        return cache if isinstance(cache, dict) else {}
    return {}


def write_digest_cache(fresh: dict) -> None:
    """Adds `fresh` to the cache file, written whole and then renamed into place (a concurrent run's additions may be
    lost, never mixed in); entries of files that are gone are dropped. A cache that cannot be written is no error."""
    if not fresh or not DIGEST_CACHE:
        return
    temporary = f"{DIGEST_CACHE}.{os.getpid()}.tmp"
    try:
        cache = {key: entry for key, entry in read_digest_cache().items() if os.path.exists(key)} | fresh
        os.makedirs(os.path.dirname(os.path.abspath(DIGEST_CACHE)), exist_ok=True)
        with open(temporary, "w") as f:
            json.dump(cache, f)
        os.replace(temporary, DIGEST_CACHE)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(temporary)


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


@contextlib.contextmanager
def written_whole(path: str, what: str, then: str):
    """`path` written whole or not at all, as the checkpoints are: the body writes the temporary file it is given
    (`.tmp_<pid>_<name>` beside it, the same extension), renamed to `path` once complete and removed on any error, so
    a full disk leaves no cut file under the finished name; the full disk is one RunError naming the folder (saving)."""
    folder = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(folder, f".tmp_{os.getpid()}_{os.path.basename(path)}")
    try:
        with saving(folder, what, None, then):
            yield temporary
            os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)


def write_whole(path: str, content, what: str, then: str) -> None:
    """written_whole for `content`: a text (UTF-8), or a function that writes the file it is given."""
    with written_whole(path, what, then) as temporary:
        if isinstance(content, str):
            with open(temporary, "w", encoding="utf-8") as f:
                f.write(content)
        else:
            content(temporary)


class Run:
    """Everything a training run keeps on disk besides the model, behind one small interface:

        run = Run(args, accelerator)          # name, folder and its lock; with --resume, the checkpoint to load;
                                              # checkpoints there without --resume or --restart: refused
        run.inputs(query_dataset=path, ...)   # content hashes of the data and models read (refused if changed on
                                              # resume)
        run.claim_output_dir()                # after the input checks: --output_dir becomes this run's
        state = run.start(state, **shape)     # --resume: load that checkpoint; then open the logs
        run.guard(update, loss=loss)          # non-finite guard (raises NonFiniteError on every process)
        run.log(step, metrics)                # TensorBoard + metrics.jsonl (+ W&B with --track); run.writer
        run.save_table(frame, "samples.csv")  # a CSV in the run folder
        run.checkpoint(update, state)         # atomic checkpoint with a manifest of its files; finite weights only
        run.finish(summary)                   # summary.json; marks --output_dir complete, last

    `state` is the script's trainer state (data position, counters); accelerate's save_state holds the rest
    (models, optimizers, registered objects, RNG states). `shape` must match between a checkpoint and a resume."""

    def __init__(self, args, accelerator):
        self.args, self.accelerator, self.main, root = (args, accelerator, accelerator.is_main_process,
                                                        args.run.run_dir_root)
        # the one run of this experiment and seed that has a checkpoint: never the newest by modification time,
        # which a clock corrected between two runs makes the wrong one; several are listed, and --run_name chooses
        if args.run.run_name is None and args.run.resume:
            newest = {}  # run name -> its newest checkpoint (update_000006: zero-padded, the last in order)
            for path in sorted(glob.glob(os.path.join(root, f"{args.exp_name}__{args.seed}__*", "checkpoints",
                                                      "update_*"))):
                newest[os.path.basename(os.path.dirname(os.path.dirname(path)))] = os.path.basename(path)
            if not newest:
                raise RunError(f"--resume: no run {root}/{args.exp_name}__{args.seed}__* has a checkpoint; "
                               "pass --run_name")
            if len(newest) > 1:
                listed = "; ".join(f"{name} (newest checkpoint {update}" + (", finished" if os.path.exists(
                    os.path.join(root, name, "summary.json")) else "") + ")" for name, update in sorted(newest.items()))
                raise RunError(f"--resume: {len(newest)} runs in {root} could be continued: {listed}. Pass "
                               "--run_name with the one to continue")
            args.run.run_name = next(iter(newest))
        # one name for all processes: their clocks may disagree on the second
        name = args.run.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
        args.run.run_name = broadcast_object_list([name])[0]
        self.dir, self.shape, self.writer = os.path.join(root, args.run.run_name), {}, None
        # the inputs' content hashes (inputs) and the manifest of the checkpoint to resume
        self.digests, self.manifest = {}, {}
        self.stage = getattr(accelerator.state.deepspeed_plugin, "zero_stage", None)  # None: no DeepSpeed
        self.checkpoints, self.lock = os.path.join(self.dir, "checkpoints"), os.path.join(self.dir, "run.lock")
        if self.main:  # one live run per folder: the lock holds its host, pid and start time (claim_lock)
            os.makedirs(self.dir, exist_ok=True)
            claim_lock(self.lock, args.run.take_over_lock)
        self.restart = args.run.restart
        if args.run.resume and self.restart:
            raise RunError("--resume continues the run's newest checkpoint and --restart deletes its checkpoints; "
                           "pass one of them")
        if not args.run.resume and not self.restart and self.saved():  # checkpoints are never deleted implicitly
            raise RunError(f"the run folder {self.dir} holds checkpoints of an earlier run named {args.run.run_name!r} "
                           f"(newest: {os.path.basename(self.latest_checkpoint())}); this launch neither continues nor "
                           f"replaces them. Pass --resume to continue from the newest, or --restart to delete them and "
                           f"start over (or another --run_name to keep them and start a new run)")
        self.resume_from = self.intact_checkpoint() if args.run.resume else None
        # the flags as given (before a script derives any): each checkpoint records them, a resume compares them
        self.flags, self.changed = flag_values(args), {}
        if self.resume_from:
            self.compare_flags()

    def saved(self) -> list:
        """The completed checkpoints, oldest first (a killed save never got its name update_N)."""
        return sorted(glob.glob(os.path.join(self.checkpoints, "update_*")))

    def intact_checkpoint(self) -> str:
        """--resume: the newest checkpoint whose files all match its manifest (sizes included, RNG states too),
        written by as many processes and the same DeepSpeed stage as this run; checked before any model loads."""
        root, saved = self.checkpoints, self.saved()
        for path in reversed(saved):
            try:
                manifest = json.load(open(os.path.join(path, "manifest.json")))
                problem = next((f"{os.path.join(path, f)} has {os.path.getsize(os.path.join(path, f))} bytes, not {n}"
                                for f, n in manifest["files"].items() if os.path.getsize(os.path.join(path, f)) != n),
                               None)
            except (OSError, ValueError, KeyError) as error:  # a missing file, or a manifest that is not one
                missing = isinstance(error, FileNotFoundError)
                problem = (f"{error.filename} is missing" if missing
                           else f"{path}/manifest.json is unreadable ({error!r})")
            if problem is None:
                break
            self.accelerator.print(f"--resume: skipping the damaged checkpoint {path}: {problem}")
        else:
            raise RunError(f"--resume: no intact checkpoint in {root}" + (f": {problem}" if saved else ""))
        for stale in (d for d in os.listdir(root) if d.startswith(".tmp_") and self.main):  # of killed or failed saves
            shutil.rmtree(os.path.join(root, stale))
        self.manifest, theirs = manifest, (manifest["num_processes"], manifest["deepspeed_stage"])
        ours = (self.accelerator.num_processes, self.stage)
        # the same process count and DeepSpeed stage; or plain DDP onto fewer processes, which resumes exactly
        if theirs != ours and not (theirs[1] is None and ours[1] is None and ours[0] < theirs[0]):
            raise RunError(f"--resume: {path} was written by {theirs[0]} process(es) with DeepSpeed stage {theirs[1]}, "
                           f"this run has {ours[0]} with stage {ours[1]}; launch {theirs[0]} process(es) with the "
                           "original config")
        return path

    def compare_flags(self) -> None:
        """--resume: the flags that decide numbers (all but FREE_FLAGS) must be the checkpoint's. A change is refused
        before any model loads, naming each flag (was -> now); --accept_changed_flags goes on with the new values,
        which then truly apply (Run.start) and args.json records both."""
        then = self.manifest.get("flags")
        if then is None:  # a checkpoint of an older version records no flags
            self.accelerator.print(f"--resume: {self.resume_from} records no flags; they cannot be compared")
            return
        self.changed = {name: (then.get(name), now) for name, now in self.flags.items()
                        if name.split(".")[-1] not in FREE_FLAGS and then.get(name) != now}
        listed = "; ".join(f"--{name} {was!r} -> {now!r}" for name, (was, now) in self.changed.items())
        if self.changed and not self.args.run.accept_changed_flags:
            raise RunError(f"--resume: {self.resume_from} was made with other flags than these: {listed}. Resume with "
                           f"the flags it was made with (its run's args.json lists them), or pass "
                           "--accept_changed_flags to go on with the new values knowingly (they apply from the next "
                           "update; args.json records both)")
        if self.changed:
            self.accelerator.print(f"--resume with changed flags (--accept_changed_flags): {listed}")

    def apply_changed_flags(self) -> None:
        """--accept_changed_flags, after the checkpoint is loaded: what it restored from the old flags takes the new
        values. A param group's eps or weight_decay equal to the old flag takes the new one; a new --lr rescales each
        restored learning-rate schedule to the new base at the same step (LambdaLR: lr = base x factor(step)); a
        registered object with a `flags_changed` method (ppo.py's KL controller) is told the changes itself."""
        for name in ("eps", "weight_decay"):
            if name in self.changed:
                was, now = self.changed[name]
                for group in (g for optimizer in self.accelerator._optimizers for g in optimizer.param_groups):
                    group[name] = now if group.get(name) == was else group[name]
        if "lr" in self.changed:
            was, now = self.changed["lr"]
            schedules = [getattr(s, "scheduler", s) for s in self.accelerator._schedulers] + [  # prepared or registered
                o for o in self.accelerator._custom_objects if isinstance(o, torch.optim.lr_scheduler.LRScheduler)]
            for schedule in schedules:
                schedule.base_lrs = [now if base == was else base for base in schedule.base_lrs]
                for group, base, factor in zip(schedule.optimizer.param_groups, schedule.base_lrs, schedule.lr_lambdas):
                    group["initial_lr"], group["lr"] = base, base * factor(schedule.last_epoch)
                schedule._last_lr = [group["lr"] for group in schedule.optimizer.param_groups]
        for obj in self.accelerator._custom_objects:
            if hasattr(obj, "flags_changed"):
                obj.flags_changed(self.changed)

    def inputs(self, **paths) -> None:
        """The content hashes (content_digest) of what this run reads, name=path (prepared data and model folders,
        named as their flags; a list gives name[i]; each --reward_fn function's file, by itself), saved with every
        checkpoint. With --resume, contents other than the checkpoint's are refused, unless --accept_changed_inputs
        goes on with them knowingly. First, a model path (checks.MODEL_FLAGS) that is neither a folder nor a model of
        the hub is refused (check_model_paths)."""
        flat = {f"{n}[{i}]": p for n, ps in paths.items() if isinstance(ps, (list, tuple)) for i, p in enumerate(ps)}
        flat.update({n: p for n, p in paths.items() if isinstance(p, str)})
        # every --reward_fn function's file is an input too, as reward_fn[i]: its bytes, not the modules it imports
        specs = getattr(self.args, "reward_fn", None) or []
        flat.update({f"reward_fn[{i}]": spec.rpartition(":")[0] or spec
                     for i, spec in enumerate([specs] if isinstance(specs, str) else specs)})
        refused = digests = None
        if self.main:  # one process asks (the hub at most once a path), every process raises
            try:
                check_model_paths(paths, reward_fn=bool(getattr(self.args, "reward_fn", None)))
                digests = {n: {"path": p, "sha256": content_digest(p)} for n, p in flat.items()}
            except RunError as error:
                refused = str(error)
        digests, refused = broadcast_object_list([digests, refused])  # one process reads the files
        if refused:
            raise RunError(refused)
        self.digests.update(digests)
        changed = []
        for name, now in self.digests.items():
            then = self.manifest.get("inputs", {}).get(name, {})
            if None not in (then.get("sha256"), now["sha256"]) and then["sha256"] != now["sha256"]:
                moved = f" in {then['path']}" if then["path"] != now["path"] else ""
                changed.append(f"--{name} {now['path']} (sha256 {then['sha256'][:12]}{moved} then, "
                               f"{now['sha256'][:12]} now)")
        if changed and not self.args.run.accept_changed_inputs:
            raise RunError(f"--resume: {self.resume_from} was made from other contents than these inputs hold: "
                           f"{'; '.join(changed)}. Resume with the inputs it was made from, or pass "
                           "--accept_changed_inputs to go on with these knowingly")
        if changed:
            self.accelerator.print(f"--resume with changed inputs (--accept_changed_inputs): {'; '.join(changed)}")

    def claim_output_dir(self) -> None:
        """Refuse an --output_dir that holds another run's files, then mark it as this run's (run.json, not
        complete)."""
        out, mark = self.args.output_dir, os.path.join(self.args.output_dir, "run.json")
        if os.path.isdir(out) and os.listdir(out) and not (self.args.run.overwrite_output_dir or self.args.run.resume):
            owner = json.load(open(mark)).get("run_name") if os.path.exists(mark) else None
            if owner != self.args.run.run_name:
                raise RunError(
                    f"--output_dir {out} already holds "
                    f"{'the run ' + repr(owner) if owner else 'files of another run'}; "
                    f"pass a new --output_dir, or --overwrite_output_dir to replace it"
                    + (f", or --resume --run_name {owner} to continue that run" if owner else ""))
        self.accelerator.wait_for_everyone()  # every process checked before the mark changes
        if self.main:
            os.makedirs(out, exist_ok=True)
            json.dump({"run_name": self.args.run.run_name}, open(mark, "w"))

    def start(self, state: dict, **shape) -> dict:
        """The trainer state to go on from (the checkpoint's with --resume, else `state`); opens the logs."""
        self.shape, resumed_at = shape, 0
        if self.resume_from:
            fresh, state = state, json.load(open(os.path.join(self.resume_from, "trainer_state.json")))
            missing = sorted(set(fresh) - set(state))
            if missing:  # a checkpoint of an older version of the script, which kept less state
                raise RunError(f"--resume: {self.resume_from} was written by an older version of this script (its "
                               f"trainer state has no {', '.join(missing)}); finish that run with the version that "
                               "wrote it, or --restart to start over")
            if {key: state.get(key) for key in shape} != shape:
                raise RunError(f"--resume: the checkpoint belongs to a run with {({k: state.get(k) for k in shape})}, "
                               f"these flags give {shape}; resume with the flags of the original run")
            self.accelerator.load_state(self.resume_from)
            self.apply_changed_flags()
            self.accelerator.print(f"resumed from {self.resume_from} (update {state['update']})")
            resumed_at = state["update"]
        elif self.main:  # a fresh run: no checkpoints (Run refused them without --restart) or --restart deletes them
            if self.restart and self.saved():
                self.accelerator.print(f"--restart: deleting the checkpoints in {self.checkpoints}, starting over")
            shutil.rmtree(self.checkpoints, ignore_errors=True)  # (with a killed save's temporary folder, if any)
        if self.main:
            os.makedirs(os.path.join(self.dir, "samples"), exist_ok=True)
            config = flat_config(self.args)  # with the derived fields filled in
            earlier = os.path.join(self.dir, "args.json")  # a resume keeps the record of earlier accepted changes
            history = json.load(open(earlier)).get("changed_on_resume", []) if self.resume_from and os.path.exists(
                earlier) else []
            if self.changed:  # --accept_changed_flags: both values, and the update from which the new ones apply
                history.append({"after_update": resumed_at,
                                "flags": {name: {"was": was, "now": now} for name, (was, now) in self.changed.items()}})
            if history:
                config["changed_on_resume"] = history
            json.dump(config, open(os.path.join(self.dir, "args.json"), "w"), indent=2)
            self.record_provenance(resumed_at)
            if self.args.run.track:
                import wandb  # only with --track; it mirrors TensorBoard
                wandb.init(project=self.args.run.wandb_project_name, entity=self.args.run.wandb_entity,
                           sync_tensorboard=True, config=config, name=self.args.run.run_name, save_code=True)
            self.writer = SummaryWriter(self.dir, purge_step=resumed_at + 1 if self.resume_from else None)
            self.writer.add_text("hyperparameters",
                                 "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in config.items()))
            metrics, kept = os.path.join(self.dir, "metrics.jsonl"), []
            # what was logged after the checkpoint goes: the logs read as if the run had never been cut
            if resumed_at and os.path.exists(metrics):
                kept = [line for line in open(metrics) if json.loads(line)["step"] <= resumed_at]
            open(metrics, "w").writelines(kept)
        return state

    def record_provenance(self, resumed_at: int) -> None:
        """provenance.json in the run folder: the package versions, Python, CPU and commit of this launch
        (rlhf_utils/provenance.py), which every checkpoint's manifest records too. A --resume from a checkpoint
        written on others says so in one line and goes on; the file keeps those of the earlier launches under
        "earlier", each with the update it ran to. Main process."""
        self.provenance, path = provenance(), os.path.join(self.dir, "provenance.json")
        earlier = []
        with contextlib.suppress(OSError, ValueError, AttributeError):  # none yet, or cut (a full disk): start anew
            earlier = json.load(open(path)).get("earlier", []) if self.resume_from else []
        then = self.manifest.get("provenance") if self.resume_from else None
        if then and (differ := provenance_differences(then, self.provenance)):
            self.accelerator.print(f"--resume: {self.resume_from} was written on other versions ({'; '.join(differ)}); "
                                   "going on, but bit-identity with an uninterrupted run holds only on the same "
                                   "versions, CPU type and commit")
            earlier.append({**then, "until_update": resumed_at})
        json.dump({**self.provenance, **({"earlier": earlier} if earlier else {})}, open(path, "w"), indent=2)

    def guard(self, update: int, **quantities: torch.Tensor) -> None:
        """Non-finite guard: stop when a named tensor holds a NaN or inf on any process (the flags are summed, so all
        raise together). Called before the optimizer step that would use it: the weights on hand are the last good."""
        flags = torch.stack([(~torch.isfinite(value.detach().float())).any() for value in quantities.values()]).float()
        flags = self.accelerator.reduce(flags.to(self.accelerator.device), reduction="sum")
        bad = [name for name, flag in zip(quantities, flags.tolist()) if flag > 0]
        if bad:
            raise NonFiniteError(
                f"update {update}: {', '.join(bad)} is not finite (NaN or inf). The weights were not updated with it "
                "and the final model is not saved. Check the data of this update, or start a fresh run with a lower "
                "--lr (--resume from the last good checkpoint keeps the checkpoint's learning rate and schedule)")

    def log(self, step: int, metrics: dict) -> None:
        """Scalars of `step` to TensorBoard (and W&B, which mirrors it) and one line of metrics.jsonl; main process."""
        if self.main:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step)
            with open(os.path.join(self.dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")

    def save_table(self, frame, name: str) -> None:
        """A pandas frame as the CSV file `name` in the run folder; main process."""
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
                    json.dump({**self.shape, **state, "update": update},
                              open(os.path.join(temporary, "trainer_state.json"), "w"))
                    files = {os.path.relpath(os.path.join(d, f), temporary): os.path.getsize(os.path.join(d, f))
                             for d, _, names in os.walk(temporary) for f in names}
                    json.dump({"files": files, "num_processes": self.accelerator.num_processes,
                               "deepspeed_stage": self.stage, "inputs": self.digests, "flags": self.flags,
                               "provenance": self.provenance},
                              open(os.path.join(temporary, "manifest.json"), "w"))
        except Exception:  # e.g. a full disk (named by `saving`), or a serializer's own error
            shutil.rmtree(temporary, ignore_errors=True)  # a failed save leaves no half-written folder behind
            raise
        if self.main:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(temporary, final)
            for old in self.saved()[:-self.args.run.checkpoint_keep]:  # --checkpoint_keep 0 keeps all ([:-0] is empty)
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
        if flag.item() == 0:
            return ""
        # another process found them when this one found none
        return ", ".join(bad[:3]) + (" ..." if len(bad) > 3 else "") or "another process's state"

    def latest_checkpoint(self) -> Optional[str]:
        """The newest completed checkpoint, None before the first."""
        return (self.saved() or [None])[-1]

    def finish(self, summary: dict) -> None:
        """summary.json, then the mark that --output_dir is complete (written last: a folder without it is not)."""
        if self.main:
            json.dump(summary, open(os.path.join(self.dir, "summary.json"), "w"), indent=2)
            self.writer.close()  # (a W&B run ends with the process)
            json.dump({"run_name": self.args.run.run_name, "complete": True},
                      open(os.path.join(self.args.output_dir, "run.json"), "w"))
            os.remove(self.lock)


class LastGoodState:
    """The non-finite guard's fallback. `with last_good.kept(update, state):` wraps one update. When run.guard raises
    in it before any optimizer step of it (a poisoned rollout), the weights and AdamW are still those after update - 1:
    the RNG states, the gradient accumulation counter and the objects registered for checkpointing are put back as
    they were, and all of it is saved as the last good checkpoint. After a step the weights have changed: nothing is
    saved."""

    def __init__(self, run, accelerator, optimizer: torch.optim.Optimizer, *registered):
        self.run, self.accelerator, self.registered, self.optimizer_steps = run, accelerator, registered, 0
        optimizer.register_step_post_hook(self.count_step)

    def count_step(self, *_) -> None:
        """The optimizer's step post-hook: one more step taken within the update kept."""
        self.optimizer_steps += 1

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
                what = (f"after {self.optimizer_steps} optimizer step(s) of it changed the weights; those weights are "
                        "NOT saved")
            self.accelerator.print(f"non-finite value at update {update} {what}. Last good checkpoint: "
                                   f"{self.run.latest_checkpoint() or 'none (no --checkpoint_every checkpoint yet)'}")
            raise


def due(every: int, update: int, num_updates: Optional[int] = None) -> bool:
    """Whether an action done every `every` updates (0 = never) falls on `update`; with num_updates, never on the
    last update (the final evaluation and the final model cover it)."""
    return every > 0 and update % every == 0 and (num_updates is None or update < num_updates)


# ----------------------------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------------------------
def frame_markdown(df: pd.DataFrame) -> str:
    """A small pandas table as markdown for TensorBoard's text tab (pipes and newlines escaped)."""

    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------------
# The Accelerator of the scripts whose data order a resume rebuilds
# ----------------------------------------------------------------------------------------------------------------------
def seeded_accelerator(gradient_accumulation_steps: int, data_seed: int, bf16: bool) -> Accelerator:
    """The Accelerator of reward.py, dpo.py, kto.py, online_dpo.py and ilql.py, from the numbers the script decides:
    gradient accumulation over gradient_accumulation_steps micro batches, the data order seeded with data_seed, bf16
    autocast or none."""
    return Accelerator(
        # sync on the micro-step count only: an update may straddle two epochs (--total_episodes)
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=gradient_accumulation_steps, sync_with_dataloader=False
        ),
        # the shuffled order of pass e over the data is a function of (seed, e) alone, so a resumed run can
        # rebuild the pass it was in and skip the micro batches already used (see resumable_micro_batches)
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=data_seed),
        mixed_precision="bf16" if bf16 else "no",
    )
