"""Durations come from a monotonic clock, and what a checkpoint carries across a resume is elapsed seconds: a wall
clock stepped a day back in the middle of a run (NTP, a corrected date) once made summary.json's wall_time_s
-86,394.8. Here a fake clock (the modules' `time`, its wall clock jumping a day back while its monotonic clock runs
on) drives the records that the PPO family, ILQL and the DPO family keep (rlhf_utils/records.py; dpo.py's
LoggingInterval, copied in kto.py and online_dpo.py), rlhf_utils/run.py's synced_time, and a resume in a new process
whose monotonic clock starts elsewhere (a reading means nothing there: the state carries seconds). The last test keeps
time.time() out of every duration of the scripts, rlhf_utils/, the pipeline and the judge."""

import glob
import json
import os
import re
from types import SimpleNamespace

import pytest
import torch

import dpo
from conftest import REPO_ROOT, training_scripts
from rlhf_utils import records
from rlhf_utils import run as run_module

DAY = 86400.0


class FakeClock:
    """time.time() and time.monotonic() of a machine whose wall clock can be stepped; `advance` lets both run on."""

    def __init__(self, wall: float = 1.7e9, monotonic: float = 5000.0):
        self.wall, self.mono = wall, monotonic

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds

    def module(self) -> SimpleNamespace:
        return SimpleNamespace(time=lambda: self.wall, monotonic=lambda: self.mono)


def resumed(state: dict) -> dict:
    """The trainer state as another process reads it back from trainer_state.json."""
    return json.loads(json.dumps(state))


def test_the_ppo_familys_wall_time_survives_a_clock_stepped_back_and_a_resume(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(records, "time", clock.module())
    args = SimpleNamespace(total_batch_size=4)
    timers = {"generation": 1.0, "scoring": 1.0, "training": 2.0, "wall": 5.0}
    sampled = {"budget/responses_sampled": 4, "budget/prompts": 4}

    start_time = clock.mono  # ppo.py's main: start_time = time.monotonic()
    state = records.fresh_trainer_state()
    clock.advance(30.0)
    state = {**records.next_state(state, start_time, timers, {}, sampled), "update": 1}
    assert state["wall_time_s"] == pytest.approx(30.0)
    clock.wall -= DAY  # the wall clock is stepped a day back mid-run
    clock.advance(20.0)
    state = {**records.next_state(state, start_time, timers, {}, sampled), "update": 2}
    assert state["wall_time_s"] == pytest.approx(50.0)

    # killed after the checkpoint of update 2; the resume is another process, its monotonic clock elsewhere
    clock.mono, clock.wall = 12.0, clock.wall + DAY + 3600.0
    state = resumed(state)
    start_time = clock.mono - state["wall_time_s"]  # ppo.py: start_time -= state["wall_time_s"]
    clock.advance(10.0)
    state = {**records.next_state(state, start_time, timers, {}, sampled), "update": 3}
    assert state["wall_time_s"] == pytest.approx(60.0)  # the interrupted run's 50 s and this one's 10 s
    assert state["totals"]["wall"] == pytest.approx(15.0) and state["budget"]["budget/prompts"] == 12
    clock.wall -= DAY
    summary = records.run_summary(args, state, {}, 3, start_time)
    assert summary["wall_time_s"] == pytest.approx(60.0)
    assert summary["episodes_per_second"] == pytest.approx(12 / 15.0)


def test_ilqls_logging_interval_carries_its_seconds_across_a_resume(monkeypatch):
    """The open interval's tokens and seconds both go through the checkpoint: its throughput after a resume is its
    tokens over its seconds, not the interrupted run's tokens over the seconds since the resume."""
    clock = FakeClock()
    monkeypatch.setattr(records, "time", clock.module())
    counters = records.IlqlCounters(records.IlqlCounters.fresh())
    counters.interval_tokens += 1000
    clock.advance(10.0)
    counters.end_update(1, 4, 10.0)
    state = resumed(counters.state())
    assert state["interval_s"] == pytest.approx(10.0)

    clock.mono, clock.wall = 7.0, clock.wall - DAY  # another process, and the wall clock a day back
    counters = records.IlqlCounters(state)
    counters.interval_tokens += 1000
    clock.advance(10.0)
    counters.end_update(2, 4, 10.0)
    clock.wall -= DAY
    metrics = counters.close_interval(lr=1e-5, num_trajectories=8)
    assert metrics["train/tokens_per_s"] == pytest.approx(2000 / 20.0)
    assert counters.totals()["train_time_s"] == pytest.approx(20.0)
    clock.advance(4.0)  # a new interval opens at the close
    assert counters.state()["interval_s"] == pytest.approx(4.0) and counters.state()["interval_tokens"] == 0


def test_the_dpo_familys_logging_interval_ignores_the_wall_clock(monkeypatch):
    """dpo.py's LoggingInterval (kto.py and online_dpo.py hold identical copies: tests/test_shared_helpers.py)."""
    clock = FakeClock()
    monkeypatch.setattr(dpo, "time", clock.module())
    row = [0.5] * len(dpo.TRAIN_STATS)
    interval = dpo.LoggingInterval({"interval": [], "interval_tokens": 0, "interval_time": 0.0,
                                    "last_train_metrics": {}})
    interval.add(list(row), 300)
    clock.advance(6.0)
    clock.wall -= DAY
    state = resumed(interval.state())
    assert state["interval_time"] == pytest.approx(6.0)

    clock.mono = 1.0  # the resume's process
    interval = dpo.LoggingInterval(state)
    interval.add(list(row), 300)
    clock.advance(6.0)
    means = interval.close(lr=1e-6, epoch=0.5)
    assert means["train/tokens_per_s"] == pytest.approx(600 / 12.0)
    assert means["time/update_s"] == pytest.approx(6.0)


def test_synced_time_reads_the_monotonic_clock(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(run_module, "time", clock.module())
    start = run_module.synced_time(torch.device("cpu"))
    clock.advance(2.5)
    clock.wall -= DAY
    assert run_module.synced_time(torch.device("cpu")) - start == pytest.approx(2.5)


# time.time() where a date is meant: a run's name, a judge cache row's time, an HTTP Retry-After date, a file's
# modification time against now, a stage marker's and an ablation run's "finished" (a date: report spans of runs
# that several processes ran). Every other clock reading in these files is a duration's, and monotonic.
DATES = [r"int\(time\.time\(\)\)", r'"finished": time\.time\(\)', r"time\.time\(\) if now is None else now",
         r"\(key, model, reply, time\.time\(\)\)", r"`now` \(time\.time\(\)\)", r"time\.time_ns\(\), os\.stat"]


def test_no_duration_reads_the_wall_clock():
    files = {*training_scripts(), "judge.py", "pipeline.py", "report.py", "ablate.py", "data/prepare.py",
             *(os.path.relpath(path, REPO_ROOT) for path in glob.glob(os.path.join(REPO_ROOT, "rlhf_utils", "*.py")))}
    assert {"ppo.py", "dpo.py", "rlhf_utils/records.py", "rlhf_utils/run.py"} <= files
    found = []
    for name in sorted(files):
        with open(os.path.join(REPO_ROOT, name)) as f:
            for number, line in enumerate(f, 1):
                rest = line
                for date in DATES:
                    rest = re.sub(date, "", rest)
                if re.search(r"time\.time(_ns)?\(\)", rest):
                    found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "a duration read from the wall clock (time.monotonic() instead):\n" + "\n".join(found)
