"""lr_schedule, the learning-rate schedule every script with --scheduler keeps a copy of, is transformers.get_scheduler
bit for bit. The scripts write it out because importing get_scheduler (transformers.optimization ->
transformers.trainer_utils) loads peft and bitsandbytes, about 3 s of every process; the numbers must not move.

Every copy is tested, compiled from its own script's source (tests/test_shared_helpers.py keeps the copies the same
code; importing each script here would cost its import time for nothing the copy needs but math and torch)."""

import ast
import io
import math
import os

import pytest
import torch
from transformers import get_scheduler

from conftest import REPO_ROOT, training_scripts

KINDS = ("cosine", "linear", "constant")


def lr_schedule_copies() -> dict:
    """script -> its lr_schedule, compiled from the script's own source (it needs only math and torch)."""
    copies = {}
    for script in training_scripts():
        tree = ast.parse(open(os.path.join(REPO_ROOT, script)).read())
        node = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "lr_schedule"), None)
        if node is not None:
            namespace = {"math": math, "torch": torch}
            exec(compile(ast.Module(body=[node], type_ignores=[]), script, "exec"), namespace)
            copies[script] = namespace["lr_schedule"]
    return copies


COPIES = lr_schedule_copies()


def optimizer(lr: float = 3e-5) -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def learning_rates(scheduler, opt, steps: int) -> list:
    """The learning rate the optimizer holds at each of `steps` updates, and the scheduler's own record of it."""
    out = []
    for _ in range(steps):
        out.append((opt.param_groups[0]["lr"], scheduler.get_last_lr()[0]))
        opt.step()  # no gradients: nothing moves, but the scheduler sees an optimizer step first
        scheduler.step()
    return out


def test_every_script_with_a_schedule_has_a_copy():
    assert {"sft.py", "reward.py", "dpo.py", "kto.py", "online_dpo.py", "ilql.py", "offline_rl.py"} <= set(COPIES)


@pytest.mark.parametrize("script", sorted(COPIES))
def test_the_multipliers_are_transformers_bit_for_bit(script):
    """Every kind the --scheduler flags allow, with and without warm-up (reward, dpo, kto, online_dpo and ilql have
    --warmup_steps), at every update and past the end (the rate after the last update is still computed): the
    multiplier and the learning rate are == transformers.get_scheduler's, not approximately."""
    lr_schedule = COPIES[script]
    for kind in KINDS:
        for num_updates in (1, 7, 100, 1000):
            for warmup in (0, 3):
                ours_opt, theirs_opt = optimizer(), optimizer()
                ours = lr_schedule(ours_opt, kind, num_updates, warmup)
                theirs = get_scheduler(kind, theirs_opt, num_warmup_steps=warmup, num_training_steps=num_updates)
                steps = num_updates + 5
                assert ([ours.lr_lambdas[0](t) for t in range(steps)]
                        == [theirs.lr_lambdas[0](t) for t in range(steps)]), (kind, num_updates, warmup)
                assert learning_rates(ours, ours_opt, steps) == learning_rates(theirs, theirs_opt, steps), \
                    (kind, num_updates, warmup)
    # the default is no warm-up: the three-argument call of sft.py and offline_rl.py
    ours_opt, theirs_opt = optimizer(), optimizer()
    assert learning_rates(COPIES[script](ours_opt, "cosine", 12), ours_opt, 14) == learning_rates(
        get_scheduler("cosine", theirs_opt, num_warmup_steps=0, num_training_steps=12), theirs_opt, 14)


def test_an_unknown_kind_is_refused():
    lr_schedule = next(iter(COPIES.values()))
    with pytest.raises(ValueError, match="cosine, linear or constant"):
        lr_schedule(optimizer(), "cosine_with_restarts", 10)


def round_trip(state: dict) -> dict:
    """A scheduler's state through a checkpoint file (accelerate saves a registered scheduler with torch.save)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("kind", KINDS)
def test_a_resumed_schedule_goes_on_as_an_uninterrupted_one(kind):
    """Stopped after 4 of 10 updates, saved and loaded into a fresh schedule: the rates from there on are those of an
    uninterrupted run, and those of transformers' schedule (a checkpoint written by a script that still used
    get_scheduler resumes the same way)."""
    lr_schedule = next(iter(COPIES.values()))
    whole_opt = optimizer()
    whole = learning_rates(lr_schedule(whole_opt, kind, 10, 2), whole_opt, 12)
    for make in (lambda o: lr_schedule(o, kind, 10, 2),
                 lambda o: get_scheduler(kind, o, num_warmup_steps=2, num_training_steps=10)):
        first_opt = optimizer()
        first = make(first_opt)
        before = learning_rates(first, first_opt, 4)
        # as a script resumes: its schedule is built, then accelerate loads the optimizer's state and the schedule's
        resumed_opt = optimizer()
        resumed = lr_schedule(resumed_opt, kind, 10, 2)
        resumed_opt.load_state_dict(round_trip(first_opt.state_dict()))
        resumed.load_state_dict(round_trip(first.state_dict()))
        assert before + learning_rates(resumed, resumed_opt, 8) == whole
