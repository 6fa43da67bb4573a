"""The user's reward function (--reward_fn path.py:function of ppo.py, rloo.py, grpo.py, reinforce_pp.py and
online_dpo.py): loaded from its file, and its answers checked. Like rlhf_utils/checks.py, whose RunError it raises,
it decides no number: each script calls the function itself and turns its answers into its reward tensor
(function_scores, the same copy in each).

  load_reward_fn(spec)    the function, run from its file when the run starts, before any model loads: a missing file
                          or name is one error (reward_fn_of(args): with the checks of the scorers the flags name)
  check_rewards(...)      what the function returned for a batch: one finite number per response, or one error that
                          names the function and the first bad row (a wrong count, a non-number, NaN or inf)
  reward_fn_errors(...)   around the call: an exception it raises becomes one error naming the row that makes it
                          raise (the function is called again on one row at a time to find it) and the line of its
                          file that raised; check_rewards' own error passes through

The function is `fn(queries, responses, **columns) -> one float per response`: the decoded queries and responses
(lists of str) and, by name, each other column of the prompt rows (a list with one entry per response). Each process
calls it on its own rows. docs/usage.md, "Write your own reward", has an example.

A module of its own, as rlhf_utils/judge_client.py is: the scripts that take --reward_fn import it (rlhf_utils/flags.py
too, for check_flags' reward_fn_of, so every script loads it; it needs only the standard library and RunError), and
rlhf_utils/run.py imports none of it. What it never does: turn an answer into a reward; the scripts' copies of
function_scores do, and a check here only reads the answers and raises.
"""

import contextlib
import math
import os
import runpy
import sys
import traceback
from typing import Callable, Optional

from rlhf_utils.checks import RunError

HOW = ("it must return one finite number per response, in their order (docs/usage.md, \"Write your own reward\": "
       "fn(queries, responses, **columns) -> list of floats)")


def load_reward_fn(spec: Optional[str], judge: Optional[str] = None) -> Optional[Callable]:
    """The function that --reward_fn path.py:function names (None: no --reward_fn), its file run as a module of its
    own. A missing file or a name the file does not define as a callable is one error, raised before any model loads.
    judge: online_dpo.py's --judge, where the function is one of the judges: --judge reward_fn and --reward_fn go
    together."""
    if judge is not None and (judge == "reward_fn") != (spec is not None):
        raise RunError("--judge reward_fn labels each pair with the function --reward_fn path.py:function names (the "
                       "higher of its two scores wins); pass both flags, or neither" + (f" (--judge is {judge})"
                                                                                         if spec else ""))
    if spec is None:
        return None
    path, _, name = spec.rpartition(":")
    if not path or not os.path.isfile(path):
        raise RunError(f"--reward_fn {spec}: there is no file {path or spec!r}; pass path.py:function, the path of a "
                       f"Python file and the name of the function in it ({HOW})")
    found = runpy.run_path(path, run_name=path).get(name)  # run_name: the function's __module__, for its errors
    if not callable(found):
        raise RunError(f"--reward_fn {spec}: {path} defines no function {name!r}"
                       + (f" ({name!r} is a {type(found).__name__})" if found is not None else "")
                       + f"; pass path.py:function with a function the file defines ({HOW})")
    return found


def reward_fn_of(args) -> Optional[Callable]:
    """ppo.py, rloo.py, grpo.py: the --reward_fn function (load_reward_fn; None without the flag), after the checks of
    the scorers the flags name, each reward model and then the function: at least one, and with --reward_weights one
    weight per scorer (--reward_combine sum)."""
    reward_fn, scorers = load_reward_fn(args.reward_fn), len(args.reward_model_path) + (args.reward_fn is not None)
    if not scorers:
        raise RunError("no reward: pass --reward_model_path (one or more reward models), --reward_fn path.py:function, "
                       "or both")
    if args.reward_weights is not None and (args.reward_combine != "sum" or len(args.reward_weights) != scorers):
        raise RunError("--reward_weights needs --reward_combine sum and one weight per scorer, each "
                       f"--reward_model_path then --reward_fn ({scorers}), got {args.reward_weights} with "
                       f"{args.reward_combine}")
    return reward_fn


def function_name(fn: Callable) -> str:
    """path.py:function of a function load_reward_fn loaded (whose __module__ is its file's path)."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def described_row(i: int, queries: list, responses: list, columns: dict) -> str:
    """Row i as the function saw it: its query, response and columns (long texts cut to their ends)."""
    def short(text) -> str:
        text = repr(text)
        return text if len(text) <= 160 else f"{text[:70]} ... {text[-70:]}"

    fields = {"query": queries[i], "response": responses[i], **{k: v[i] for k, v in columns.items()}}
    return f"row {i} of the batch ({', '.join(f'{k}={short(v)}' for k, v in fields.items())})"


def reward_error(message: str) -> RunError:
    """The RunError of a bad answer. Each process calls the function on its own rows, so one process may fail alone;
    the expected-error hook prints on the main process only, so another process prints the paragraph itself."""
    if os.environ.get("RANK", "0") != "0":
        print(f"{os.path.basename(sys.argv[0])}: error (process {os.environ['RANK']}): {message}", file=sys.stderr,
              flush=True)
    return RunError(message)


def reward_fn_raised(fn: Callable, error: Exception, queries: list, responses: list, columns: dict) -> RunError:
    """The error for an exception the function raised on a batch: the first row that makes it raise when called on
    that row alone, the exception, and the line of the function's file where it was raised."""
    for i in range(len(queries)):
        try:
            fn(queries[i : i + 1], responses[i : i + 1], **{k: v[i : i + 1] for k, v in columns.items()})
        except Exception as its_error:  # noqa: BLE001 (whatever the user's code raises, it is named)
            frames = traceback.extract_tb(its_error.__traceback__)  # the innermost line of the function's own file
            frame = next((f for f in reversed(frames) if f.filename == getattr(fn, "__module__", None)), frames[-1])
            said = " ".join(str(its_error).split())  # (one line, whatever the exception's message holds)
            return reward_error(f"--reward_fn {function_name(fn)} raised {type(its_error).__name__}: {said} (at "
                                f"{frame.filename}:{frame.lineno}) on {described_row(i, queries, responses, columns)}; "
                                f"fix the function for such a row ({HOW})")
    said = " ".join(str(error).split())
    return reward_error(f"--reward_fn {function_name(fn)} raised {type(error).__name__}: {said} on a batch of "
                        f"{len(queries)} responses, but on none of them alone; a function that depends on the whole "
                        f"batch must not fail on its size or mix ({HOW})")


@contextlib.contextmanager
def reward_fn_errors(fn: Callable, queries: list, responses: list, columns: dict):
    """Around the script's call of the function on a batch: an exception it raises becomes reward_fn_raised's error."""
    try:
        yield
    except RunError:  # check_rewards' own error, or one of the function's: it is the paragraph already
        raise
    except Exception as error:  # noqa: BLE001 (whatever the user's code raises, it is named)
        raise reward_fn_raised(fn, error, queries, responses, columns) from error


def check_rewards(fn: Callable, values, queries: list, responses: list, columns: dict) -> list:
    """What the function returned for a batch: one finite number (an int, a float, a NumPy or 0-d tensor number) per
    response, returned as Python floats; else one error naming the function and the first bad row."""
    name = f"--reward_fn {function_name(fn)}"
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise reward_error(f"{name} returned {type(values).__name__} {values!r:.80}, not one number per response "
                           f"({len(queries)} here); {HOW}")
    if len(values) != len(queries):
        raise reward_error(f"{name} returned {len(values)} values for a batch of {len(queries)} responses; {HOW}")
    for i, value in enumerate(values):
        number = float(value) if hasattr(type(value), "__float__") and getattr(value, "ndim", 0) == 0 else None
        if number is None or not math.isfinite(number):
            what = f"{value!r:.80} ({type(value).__name__}), not a number" if number is None else f"{number}"
            raise reward_error(f"{name} returned {what} for {described_row(i, queries, responses, columns)}; {HOW}")
    return [float(value) for value in values]
