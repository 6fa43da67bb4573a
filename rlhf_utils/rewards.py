"""The user's reward functions (--reward_fn path.py:function ... of ppo.py, rloo.py, grpo.py, reinforce_pp.py and
online_dpo.py), in the form TRL's GRPOTrainer calls them: loaded from their files, called by keyword, and their answers
checked. Like rlhf_utils/checks.py, whose RunError it raises, it decides no number: each script's copy of
function_scores joins the answers into one score (TRL's weighted sum) and turns it into its reward tensor.

  load_reward_fn(specs, judge, weights)  the functions (RewardFunctions), run from their files when the run starts,
                          before any model loads: a missing file or name, a function outside the contract, or
                          --reward_fn_weights of the wrong count is one error (reward_fn_of(args): with the checks of
                          the scorers the flags name)
  RewardFunctions.answers(...)  each function called on a batch by TRL's keywords (an `async def` one awaited), its
                          answers checked (check_rewards): a finite number or None per response
  check_rewards(...)      one function's answers: a finite number (or None: it does not apply) per response, or one
                          error that names the function and the first bad row (a wrong count, a non-number, NaN, inf)
  call(...)               one call by keyword, in a worker thread waited on for --reward_fn_timeout_min: a call that
                          does not return in time is one error naming the function, the batch and the flag
  reward_fn_errors(...)   around the call: an exception it raises becomes one error naming the row that makes it
                          raise (the function is called again on one row at a time to find it) and the line of its
                          file that raised; check_rewards' own error passes through

The contract is TRL's: `fn(prompts=[...], completions=[...], completion_ids=[[...], ...], trainer_state=...,
**columns) -> one float (or None) per completion`, by keyword: the decoded queries and responses (lists of str), each
response's token ids (after its EOS truncation, with the EOS, without [PAD]), a stand-in of TRL's trainer state
(TrainerState: the fields these scripts can fill), and by name each other column of the prompt rows (a list with one
entry per response) that holds no token ids. Each process calls it on its own rows. docs/usage.md, "Write your own
reward", has an example and says what differs from TRL.

A module of its own, as rlhf_utils/judge_client.py is: the scripts that take --reward_fn import it (rlhf_utils/flags.py
too, for check_flags' reward_fn_of, so every script loads it; it needs only the standard library and RunError), and
rlhf_utils/run.py imports none of it. What it never does: turn an answer into a reward; the scripts' copies of
function_scores do, and a check here only reads the answers and raises.
"""

import asyncio
import contextlib
import inspect
import math
import os
import runpy
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Callable, List, Optional, Union

from rlhf_utils.checks import RunError

CONTRACT = ("fn(prompts=[...], completions=[...], completion_ids=[[...], ...], trainer_state=..., **columns), called "
            "by keyword as TRL's GRPOTrainer calls a reward function")
HOW = (f"it must return one finite number, or None where it does not apply, per completion, in their order "
       f"(docs/usage.md, \"Write your own reward\": {CONTRACT})")
# the keywords every function is given; a dataset column of one of these names is not passed (the keyword wins)
KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state")


@dataclass
class TrainerState:
    """The `trainer_state` a function is given: a stand-in for the transformers TrainerState that TRL passes, with
    the fields these scripts can fill, set by the script before each update's rollout: global_step (the optimizer
    steps taken so far), epoch (the prompts drawn so far over the training split's size, a float as TRL's) and
    max_steps (the run's optimizer steps). The others (log_history, best_metric, best_model_checkpoint, total_flos,
    num_input_tokens_seen, the logging, eval and save steps, trial_name, trial_params, stateful_callbacks) are absent:
    a function that reads one raises AttributeError, reported with its row as any exception is."""

    global_step: int = 0
    epoch: float = 0.0
    max_steps: int = 0

    @property
    def is_world_process_zero(self) -> bool:
        return os.environ.get("RANK", "0") == "0"

    @property
    def is_local_process_zero(self) -> bool:
        return os.environ.get("LOCAL_RANK", "0") == "0"


def holds_token_ids(feature) -> bool:
    """Whether a dataset column holds token ids, decided by its type, not its name: a list of integers (at any depth,
    as the tokenized columns query_token and the like are). An integer column (a length, a user's max_tokens) does
    not; nor do strings, floats or lists of them."""
    inner = feature[0] if isinstance(feature, list) and feature else getattr(feature, "feature", None)
    if inner is None:
        return False
    while isinstance(inner, list) or hasattr(inner, "feature"):
        inner = inner[0] if isinstance(inner, list) else inner.feature
    return str(getattr(inner, "dtype", "")).startswith(("int", "uint"))


def takes_keywords(fn: Callable) -> Optional[str]:
    """None if TRL's keywords can reach the function (it has a `completions` parameter that can be given by keyword,
    or a **kwargs), else the signature it has. A callable without a signature (a builtin) is let through."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    params = signature.parameters.values()
    if any(p.kind is p.VAR_KEYWORD or (p.name == "completions" and p.kind is not p.POSITIONAL_ONLY) for p in params):
        return None
    return str(signature)


class RewardFunctions:
    """The --reward_fn functions (one or more), their --reward_fn_weights (`weights`, one each, 1 by default) and the
    trainer_state they are given. answers() calls each on a batch; the script's function_scores combines them."""

    def __init__(self, fns: List[Callable], weights: Optional[List[float]], timeout_min: Optional[float] = None):
        self.fns, self.weights = fns, [1.0] * len(fns) if weights is None else [float(w) for w in weights]
        self.timeout_min = timeout_min  # --reward_fn_timeout_min (None: no limit)
        self.trainer_state = TrainerState()
        self.told, self.unscored = False, 0  # the withheld columns said once; the responses no scorer scored so far

    def at(self, global_step: int, epoch: float, max_steps: int) -> None:
        """The script's position before an update's rollout, for trainer_state (TrainerState)."""
        self.trainer_state.global_step, self.trainer_state.epoch = int(global_step), float(epoch)
        self.trainer_state.max_steps = int(max_steps)

    def columns(self, dataset, rows) -> dict:
        """The prompt rows' columns a function is given, by name, one entry per response: every column that holds no
        token ids (holds_token_ids), but a column named as one of TRL's keywords. The columns withheld are said once,
        on the main process: the run's log names each column a function does not see."""
        features = dataset.features
        names = [c for c in dataset.column_names if not holds_token_ids(features[c]) and c not in KEYWORDS]
        if not self.told and os.environ.get("RANK", "0") == "0":
            withheld = [c for c in dataset.column_names if c not in names]
            if withheld:
                print(f"--reward_fn: the columns {', '.join(withheld)} are not passed to the functions (token ids, "
                      "whose completion_ids holds each response's; or named as a keyword of the contract)", flush=True)
        self.told = True
        return dataset.select_columns(names).with_format(None)[rows] if names else {}

    def answers(self, prompts: list, completions: list, completion_ids: list, dataset, rows) -> list:
        """Each function's answers for a batch (a list per function: a float or None per response), called by TRL's
        keywords with the prompt rows' columns (columns()), each answer checked (check_rewards), an exception named
        with its row (reward_fn_errors)."""
        columns = self.columns(dataset, list(rows))
        keywords = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids}
        limit = Limit(self.timeout_min, batch_of(dataset, list(rows), self.trainer_state))
        out = []
        for fn in self.fns:
            with reward_fn_errors(fn, keywords, columns, self.trainer_state, limit):
                values = call(fn, keywords, columns, self.trainer_state, limit)
                out.append(check_rewards(fn, values, prompts, completions, columns))
        return out

    def warn_unscored(self, count: int, total: int) -> None:
        """One line for a batch with responses that no function and no reward model scores (function_scores)."""
        self.unscored += count
        where = f" (process {os.environ['RANK']})" if os.environ.get("RANK", "0") != "0" else ""
        print(f"--reward_fn: {count} of {total} responses{where} were scored by no function (each returned None) and "
              f"no reward model ({self.unscored} so far): each takes the mean score of its prompt's scored responses "
              "(0 if none), so that its group-relative advantage is 0 (docs/usage.md, \"Write your own reward\")",
              flush=True)


@dataclass
class Limit:
    """How long one call may take (--reward_fn_timeout_min, in minutes; None: no limit) and the batch it is on, for
    the error."""

    minutes: Optional[float] = None
    batch: str = "a batch"


def batch_of(dataset, rows: list, trainer_state) -> str:
    """The batch, as its error names it: its prompt rows (a range, or the first few of a shuffled draw), the split they
    are of (training or evaluation: the split's name, else the folder of its arrow file, as data/prepare.py saves a
    split) and the run's position (trainer_state: the optimizer steps taken so far)."""
    numbers = sorted({int(row) for row in rows})  # (a tensor's rows, or a group's repeated ones)
    if numbers and numbers == list(range(numbers[0], numbers[-1] + 1)):
        span = f"prompt rows {numbers[0]}-{numbers[-1]}"
    else:
        span = f"prompt rows {', '.join(map(str, numbers[:6]))}{', ...' if len(numbers) > 6 else ''} ({len(numbers)})"
    split, files = getattr(dataset, "split", None), getattr(dataset, "cache_files", None) or [{}]
    if split is not None:
        where = f"the {str(split)!r} split"
    else:
        where = os.path.dirname(files[0]["filename"]) if "filename" in files[0] else "the prompts"
    return (f"{span} of {where}, at optimizer step {trainer_state.global_step} of {trainer_state.max_steps} "
            "(trainer_state.global_step)")


def in_thread(run: Callable[[], object], fn: Callable, limit: Limit) -> object:
    """run() in a worker thread, waited on for limit.minutes: signal.alarm would work in the main thread only, and
    this works in any thread and under torchrun, each process on its own rows. The thread gets the caller's torch
    device and grad mode (both are per thread). A call past the limit is one error naming the function, the batch
    and the flag; the thread cannot be stopped and is left to end with the process (a daemon). An exception the
    function raises is raised here, with its own traceback."""
    torch = sys.modules.get("torch")  # (not imported here: only what the caller's thread set is carried over)
    device = torch.cuda.current_device() if torch is not None and torch.cuda.is_initialized() else None
    grad = torch.is_grad_enabled() if torch is not None else None
    result = {}

    def work():
        try:
            if device is not None:
                torch.cuda.set_device(device)
            with torch.set_grad_enabled(grad) if grad is not None else contextlib.nullcontext():
                result["value"] = run()
        except BaseException as error:  # noqa: BLE001 (passed to the caller's thread, which raises it)
            result["error"] = error

    worker = threading.Thread(target=work, name=f"reward_fn {function_name(fn)}", daemon=True)
    worker.start()
    worker.join(None if limit.minutes is None else limit.minutes * 60)
    if worker.is_alive():
        raise reward_error(f"--reward_fn {function_name(fn)} did not return within --reward_fn_timeout_min "
                           f"{limit.minutes:g} (minutes) on {limit.batch}; a function that waits on something that "
                           f"never answers (a network call without its own timeout) stops the run: give its calls a "
                           f"timeout, or raise --reward_fn_timeout_min for a function that is slow by design")
    if "error" in result:
        raise result["error"]
    return result["value"]


def call(fn: Callable, keywords: dict, columns: dict, trainer_state, limit: Optional[Limit] = None) -> object:
    """fn called by keyword: TRL's keywords, trainer_state and the columns, in a worker thread waited on for
    limit.minutes (in_thread); an `async def` function (or one that returns an awaitable) is awaited there. Keywords
    the function cannot take, or a parameter that none of them gives (a column the dataset lacks), is one error
    naming them before the call."""
    given = {**columns, **keywords, "trainer_state": trainer_state}
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # (a callable without a signature is called as it is)
        signature = None
    if signature is not None:
        try:
            signature.bind(**given)
        except TypeError as error:
            raise reward_error(f"--reward_fn {function_name(fn)}{signature} cannot be called with the keywords "
                               f"{', '.join(given)}: {error}; a parameter must be one of TRL's keywords or a column "
                               f"of the prompt rows, and a function that does not name every one must take **kwargs "
                               f"({CONTRACT})") from None

    def run():
        values = fn(**given)
        if inspect.isawaitable(values):
            async def awaited():
                return await values

            values = asyncio.run(awaited())
        return values

    return in_thread(run, fn, limit or Limit())


def load_reward_fn(specs: Union[None, str, List[str]], judge: Optional[str] = None,
                   weights: Optional[List[float]] = None,
                   timeout_min: Optional[float] = None) -> Optional[RewardFunctions]:
    """The functions that --reward_fn path.py:function ... names (RewardFunctions; None: no --reward_fn), each file
    run as a module of its own. A missing file or a name the file does not define as a callable, a function that
    takes neither `completions` nor **kwargs (the positional fn(queries, responses) of earlier versions), or
    --reward_fn_weights not one per function is one error, raised before any model loads. judge: online_dpo.py's
    --judge, where the functions are one of the judges: --judge reward_fn and --reward_fn go together. timeout_min:
    --reward_fn_timeout_min, how long one call may take (a positive number of minutes; None: no limit)."""
    specs = [specs] if isinstance(specs, str) else specs or None
    if judge is not None and (judge == "reward_fn") != (specs is not None):
        raise RunError("--judge reward_fn labels each pair with the functions --reward_fn path.py:function names (the "
                       "higher of its two scores wins); pass both flags, or neither" + (f" (--judge is {judge})"
                                                                                         if specs else ""))
    if specs is None:
        if weights is not None:
            raise RunError(f"--reward_fn_weights {weights} weighs --reward_fn functions, and there are none; pass "
                           "--reward_fn path.py:function ..., or drop --reward_fn_weights")
        return None
    if timeout_min is not None and not timeout_min > 0:
        raise RunError(f"--reward_fn_timeout_min {timeout_min} is how many minutes one call of a --reward_fn function "
                       "may take: pass a positive number (a fraction is fine, e.g. 0.5)")
    if weights is not None and len(weights) != len(specs):
        raise RunError(f"--reward_fn_weights needs one weight per --reward_fn function ({len(specs)}: "
                       f"{' '.join(specs)}), got {len(weights)}: {weights}")
    return RewardFunctions([load_one(spec) for spec in specs], weights, timeout_min)


def load_one(spec: str) -> Callable:
    """One path.py:function, checked: the file, the name, the contract."""
    path, _, name = spec.rpartition(":")
    if not path or not os.path.isfile(path):
        raise RunError(f"--reward_fn {spec}: there is no file {path or spec!r}; pass path.py:function, the path of a "
                       f"Python file and the name of the function in it ({HOW})")
    found = runpy.run_path(path, run_name=path).get(name)  # run_name: the function's __module__, for its errors
    if not callable(found):
        raise RunError(f"--reward_fn {spec}: {path} defines no function {name!r}"
                       + (f" ({name!r} is a {type(found).__name__})" if found is not None else "")
                       + f"; pass path.py:function with a function the file defines ({HOW})")
    signature = takes_keywords(found)
    if signature is not None:
        raise RunError(f"--reward_fn {spec}: {name}{signature} takes neither `completions` nor **kwargs, so TRL's "
                       f"keywords cannot reach it: the contract is {CONTRACT}. The positional form fn(queries, "
                       f"responses, **columns) is gone: name the parameters prompts and completions and add **kwargs "
                       f"(docs/usage.md, \"Write your own reward\")")
    return found


def reward_fn_of(args) -> Optional[RewardFunctions]:
    """ppo.py, rloo.py, grpo.py: the --reward_fn functions (load_reward_fn; None without the flag), after the checks
    of the scorers the flags name, each reward model and then the functions' one score: at least one, and with
    --reward_weights one weight per scorer (--reward_combine sum)."""
    reward_fn = load_reward_fn(args.reward_fn, weights=args.reward_fn_weights, timeout_min=args.reward_fn_timeout_min)
    scorers = len(args.reward_model_path) + (reward_fn is not None)
    if not scorers:
        raise RunError("no reward: pass --reward_model_path (one or more reward models), --reward_fn path.py:function, "
                       "or both")
    if args.reward_weights is not None and (args.reward_combine != "sum" or len(args.reward_weights) != scorers):
        raise RunError("--reward_weights needs --reward_combine sum and one weight per scorer, each "
                       f"--reward_model_path then --reward_fn's functions as one ({scorers}), got "
                       f"{args.reward_weights} with {args.reward_combine}")
    return reward_fn


def function_name(fn: Callable) -> str:
    """path.py:function of a function load_reward_fn loaded (whose __module__ is its file's path)."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def described_row(i: int, prompts: list, completions: list, columns: dict) -> str:
    """Row i as the function saw it: its prompt, completion and columns (long texts cut to their ends)."""
    def short(text) -> str:
        text = repr(text)
        return text if len(text) <= 160 else f"{text[:70]} ... {text[-70:]}"

    fields = {"prompt": prompts[i], "completion": completions[i], **{k: v[i] for k, v in columns.items()}}
    return f"row {i} of the batch ({', '.join(f'{k}={short(v)}' for k, v in fields.items())})"


def reward_error(message: str) -> RunError:
    """The RunError of a bad answer. Each process calls the function on its own rows, so one process may fail alone;
    the expected-error hook prints on the main process only, so another process prints the paragraph itself."""
    if os.environ.get("RANK", "0") != "0":
        print(f"{os.path.basename(sys.argv[0])}: error (process {os.environ['RANK']}): {message}", file=sys.stderr,
              flush=True)
    return RunError(message)


def reward_fn_raised(fn: Callable, error: Exception, keywords: dict, columns: dict, trainer_state,
                     limit: Optional[Limit] = None) -> RunError:
    """The error for an exception the function raised on a batch: the first row that makes it raise when called on
    that row alone, the exception, and the line of the function's file where it was raised."""
    prompts, completions = keywords["prompts"], keywords["completions"]
    for i in range(len(prompts)):
        try:
            call(fn, {k: v[i : i + 1] for k, v in keywords.items()}, {k: v[i : i + 1] for k, v in columns.items()},
                 trainer_state, limit)
        except RunError:
            raise
        except Exception as its_error:  # noqa: BLE001 (whatever the user's code raises, it is named)
            frames = traceback.extract_tb(its_error.__traceback__)  # the innermost line of the function's own file
            frame = next((f for f in reversed(frames) if f.filename == getattr(fn, "__module__", None)), frames[-1])
            said = " ".join(str(its_error).split())  # (one line, whatever the exception's message holds)
            return reward_error(f"--reward_fn {function_name(fn)} raised {type(its_error).__name__}: {said} (at "
                                f"{frame.filename}:{frame.lineno}) on {described_row(i, prompts, completions, columns)}"
                                f"; fix the function for such a row ({HOW})")
    said = " ".join(str(error).split())
    return reward_error(f"--reward_fn {function_name(fn)} raised {type(error).__name__}: {said} on a batch of "
                        f"{len(prompts)} responses, but on none of them alone; a function that depends on the whole "
                        f"batch must not fail on its size or mix ({HOW})")


@contextlib.contextmanager
def reward_fn_errors(fn: Callable, keywords: dict, columns: dict, trainer_state, limit: Optional[Limit] = None):
    """Around the call of the function on a batch: an exception it raises becomes reward_fn_raised's error (each row
    called again under the same limit)."""
    try:
        yield
    except RunError:  # check_rewards' own error, or one of the function's: it is the paragraph already
        raise
    except Exception as error:  # noqa: BLE001 (whatever the user's code raises, it is named)
        raise reward_fn_raised(fn, error, keywords, columns, trainer_state, limit) from error


def check_rewards(fn: Callable, values, prompts: list, completions: list, columns: dict) -> list:
    """What the function returned for a batch: one finite number (an int, a float, a NumPy or 0-d tensor number) or
    None (TRL's "does not apply": the function is skipped for that response) per response, returned as Python floats
    and None; else one error naming the function and the first bad row."""
    name = f"--reward_fn {function_name(fn)}"
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise reward_error(f"{name} returned {type(values).__name__} {values!r:.80}, not one number per response "
                           f"({len(prompts)} here); {HOW}")
    if len(values) != len(prompts):
        raise reward_error(f"{name} returned {len(values)} values for a batch of {len(prompts)} responses; {HOW}")
    out = []
    for i, value in enumerate(values):
        number = float(value) if hasattr(type(value), "__float__") and getattr(value, "ndim", 0) == 0 else None
        if value is not None and (number is None or not math.isfinite(number)):
            what = f"{value!r:.80} ({type(value).__name__}), not a number" if number is None else f"{number}"
            raise reward_error(f"{name} returned {what} for {described_row(i, prompts, completions, columns)}; {HOW}")
        out.append(number)
    return out
