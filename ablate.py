"""Detail ablations on the built-in task: each implementation detail changed on its own, several seeds,
with its measured effect next to what the paper says it does (issue #11).

    python ablate.py --jobs 2 --threads 1 # every row, seeds 1 2 3, two runs at a time (under 2 hours on 2 CPU cores)
    python ablate.py --rows 7 23          # only Details 7 and 23
    python ablate.py --mode ci --seeds 1  # tiny sizes: checks that every artefact is produced
    python ablate.py --dry_run            # print the plan and the time estimate, run nothing

The baseline upstream (data, SFT model, reward model) is the quickstart pipeline's output
(`--upstream artifacts/quickstart`); whatever of it is missing is made first by `python pipeline.py`.
Then, for every row and seed, the affected stage runs once with the baseline setting and once with
the detail toggled. A baseline run is shared by every row that needs the same stage with the same
seed (the PPO baseline serves Details 7, 22, 24 and 25). Each run is a subprocess of the
real script, printed as it starts, with its console output in `<out>/logs/<run>.log`; a run whose
summary.json exists is skipped, so an interrupted ablation picks up where it stopped.

Outputs in `<out>` (default artifacts/ablations): `ablations.md` (the table, also printed),
`ablations.csv` (one line per detail and metric, with the per-seed values), one plot per detail
(`detail_NN.png`: every seed's value, the default vs the detail changed) and `timings.json`.

The toggled runs need no new flags: the scripts expose every detail (`python <script>.py --help`).
Where the task's own setting would hide a detail, its row changes that setting in both arms: Detail 23 (the
EOS trick) runs PPO with a response budget the SFT policy often overruns (EOS_TRICK_RESPONSE_LENGTH), since
with the task's 24 tokens every response ends in time and the trick never fires.
Two measurements are indirect, and say so in the table:
  * Detail 7's "ratio at the first minibatch": ppo.py logs the ratio averaged over all K epochs and
    minibatches of an update. A probe run of ONE update with one epoch and one minibatch (the first
    minibatch of the full run, same seed) split into micro-batches of one episode logs exactly the
    first minibatch's mean ratio, and the variance of the per-episode mean ratios.
  * Details 2 and 3 need data prepared with the toggled flag. data/prepare.py has no option to reuse
    an existing base model for `--task synthetic` (it always repeats the ~3-minute warm-up), so the
    toggled data is prepared with `--task tldr` from the upstream's raw rows (`data/raw/`, in the hub
    schema) and its base model's tokenizer: the very code path `--task synthetic` runs after it has
    built the base model, so only the toggled flag differs (tests/test_ablate.py checks that the
    default flags reproduce the upstream data exactly).

This file is glue, not an algorithm: it imports pipeline.py (the stage settings), report.py (the readers
of runs and samples) and the `data` package (the gold judge), which the algorithm scripts never do. A
measured table, with its run time: docs/results.md.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional

import tyro

REPO_ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, REPO_ROOT)

import pipeline  # noqa: E402  (the stage settings of the built-in task)

ALL_ROWS = [2, 3, 7, 11, 15, 22, 23, 24, 25]


@dataclass
class Args:
    mode: Literal["default", "ci"] = "default"
    """default: the budgets below (BUDGET), sized for every row on 3 seeds on 2 CPU cores (`--dry_run` prints the
    time estimate); ci: minimal steps (upstream from `pipeline.py --mode ci`),
    to check that every artefact is produced"""
    rows: list[int] = field(default_factory=lambda: list(ALL_ROWS))
    """which details to ablate (numbers of the paper's details)"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds of the ablated stage; every seed runs both the baseline and the toggled setting"""
    upstream: Optional[str] = None
    """the baseline data, SFT and reward model (a pipeline.py output folder); made with pipeline.py when missing.
    None -> artifacts/quickstart (mode default) or artifacts/ablations_ci_upstream (mode ci)"""
    out: Optional[str] = None
    """where data, runs, logs, the table and the plots go; None -> artifacts/ablations
    (mode ci: artifacts/ablations_ci)"""
    threads: int = 0
    """torch threads per run (OMP_NUM_THREADS); 0 = leave the environment's setting"""
    jobs: int = 1
    """runs at once; a run waits for the runs it reads (its toggled data or reward model). With N jobs, give
    each run about (cores / N) threads with --threads"""
    dry_run: bool = False
    """print the plan and the time estimate, then stop"""
    report_only: bool = False
    """write the table and plots from the runs that exist, run nothing"""


# --------------------------------------------------------------------------------------------
# Budgets. The built-in task's sizes come from pipeline.py's SETTINGS; the ablation runs cut a few of
# them, since every row runs its stage twice (baseline and toggled) on every seed.
# --------------------------------------------------------------------------------------------
BUDGET = {
    "default": {
        # SFT (rows 2 and 3): 1.5 passes over the 4000 training posts (375 updates of batch 16) instead of the
        # quickstart's 5. Enough for the EOS behaviour (row 3) and for the copying of facts to have begun.
        "sft": {"--num_train_epochs": None, "--total_episodes": "6000", "--num_eval_samples": "200"},
        # RM (row 11): one epoch over the 6000 training pairs (the quickstart runs two); the head init acts on
        # the early updates
        "rm": {"--total_episodes": "6016"},
        # the two RMs of row 15 (normalised or not): the upstream RM's settings (pipeline.py's SETTINGS, two epochs)
        "rm_upstream": {},
        # PPO (rows 7, 15, 22-25): 640 episodes = 20 updates of 32 (the quickstart runs 48), one evaluation
        # on 200 validation queries at the end
        "ppo": {"--total_episodes": "640", "--eval_every": "0", "--num_eval_samples": "200"},
        # Detail 7 probe: the first update only, one epoch of one minibatch, micro-batches of one episode
        "probe": {"--total_episodes": "32", "--ppo.num_ppo_epochs": "1", "--ppo.num_mini_batches": "1",
                  "--local_micro_batch_size": "1", "--num_eval_samples": "32"},
    },
    "ci": {
        "sft": {"--checkpoint_every": "0"},
        "rm": {},
        "rm_upstream": {},
        "ppo": {"--eval_every": "0"},
        "probe": {"--total_episodes": "16", "--ppo.num_ppo_epochs": "1", "--ppo.num_mini_batches": "1",
                  "--local_micro_batch_size": "1", "--num_eval_samples": "16"},
    },
}
PIPELINE_MODE = {"default": "quickstart", "ci": "ci"}
# seconds per run on 2 CPU cores with two runs at a time on one thread each (`--jobs 2 --threads 1`; the
# pipeline alone), for the estimate printed before starting (measured timings of earlier runs in
# <out>/timings.json replace them)
ESTIMATE_S = {
    "default": {"pipeline": 700, "prep": 42, "sft": 210, "rm": 350, "ppo": 180, "probe": 21},
    "ci": {"pipeline": 90, "prep": 12, "sft": 15, "rm": 15, "ppo": 15, "probe": 12},
}


# --------------------------------------------------------------------------------------------
# Runs and arms. An arm is one setting of one stage ("ppo, EOS trick off"); a run is an arm at a seed.
# --------------------------------------------------------------------------------------------
@dataclass
class Run:
    key: str  # unique name: runs/<key>/, models/<key>/, logs/<key>.log
    kind: str  # prep | sft | rm | ppo | probe (for the estimate)
    cmd: list[str]
    done_file: str  # exists once the run finished


@dataclass
class Arm:
    name: str
    kind: str  # sft | rm | ppo | probe
    extra: list[str] = field(default_factory=list)  # the toggle's flags
    data: Optional[str] = None  # a toggled data folder (name under <out>/data), else the upstream data
    reward_model: Optional[str] = None  # a toggled reward model (run key), else the upstream RM
    seedless: bool = False  # one run serves every seed (the unnormalised RM of row 15)
    budget: Optional[str] = None  # the BUDGET entry, when not the one named by `kind`
    response_length: Optional[int] = None  # PPO's --response_length, when not the task's (row 23)


# Detail 23 needs responses that run out of tokens, or the EOS trick never fires. With the task's 24 tokens
# every SFT summary ends in time (it writes 9 to 14 tokens with its EOS); with 9, most SFT summaries are cut,
# and the policy must learn to say less to end at all. Both arms of row 23 run at this length.
EOS_TRICK_RESPONSE_LENGTH = 9

ARMS = {
    # SFT (rows 2, 3)
    "sft_baseline": Arm("sft_baseline", "sft"),
    "sft_token_truncation": Arm("sft_token_truncation", "sft", data="token_truncation"),
    "sft_eos_pad": Arm("sft_eos_pad", "sft", extra=["--pad_token", "eos"], data="eos_pad"),
    # reward model (row 11)
    "rm_baseline": Arm("rm_baseline", "rm"),
    "rm_library_head": Arm("rm_library_head", "rm", extra=["--reward_head_init", "library"]),
    # row 15: two RMs trained alike (the upstream's settings, the same threads), normalised or not; the upstream RM
    # itself will not do as the baseline, since a run on another thread count sums in another order and ends
    # as a different RM
    "rm_normalised": Arm("rm_normalised", "rm", seedless=True, budget="rm_upstream"),
    "rm_unnormalised": Arm("rm_unnormalised", "rm", extra=["--no-normalize_reward"], seedless=True,
                           budget="rm_upstream"),
    # PPO (rows 7, 15, 22-25) and the Detail 7 probe
    "ppo_baseline": Arm("ppo_baseline", "ppo"),
    "ppo_dropout": Arm("ppo_dropout", "ppo", extra=["--no-disable_dropout"]),
    "probe_baseline": Arm("probe_baseline", "probe"),
    "probe_dropout": Arm("probe_dropout", "probe", extra=["--no-disable_dropout"]),
    "ppo_normalised_rm": Arm("ppo_normalised_rm", "ppo", reward_model="rm_normalised"),
    "ppo_unnormalised_rm": Arm("ppo_unnormalised_rm", "ppo", reward_model="rm_unnormalised"),
    "ppo_critic_from_sft": Arm("ppo_critic_from_sft", "ppo", extra=["--critic_init", "sft"]),
    # row 23 at a response budget the SFT policy often overruns (see EOS_TRICK_RESPONSE_LENGTH)
    "ppo_short": Arm("ppo_short", "ppo", response_length=EOS_TRICK_RESPONSE_LENGTH),
    "ppo_short_no_eos_trick": Arm("ppo_short_no_eos_trick", "ppo", extra=["--no-non_eos_penalty"],
                                  response_length=EOS_TRICK_RESPONSE_LENGTH),
    "ppo_reward_whitening": Arm("ppo_reward_whitening", "ppo", extra=["--ppo.whiten_rewards"]),
    "ppo_no_advantage_whitening": Arm("ppo_no_advantage_whitening", "ppo", extra=["--ppo.no-whiten_advantages"]),
}
# data folders of the toggled data: name -> data/prepare.py flags
TOGGLED_DATA = {"token_truncation": ["--truncation", "token"], "eos_pad": ["--pad_token", "eos"]}


# --------------------------------------------------------------------------------------------
# Metrics: each reads one finished run (or its data) and returns a number.
# --------------------------------------------------------------------------------------------
def summary_of(ab: "Ablation", key: str) -> dict:
    path = os.path.join(ab.runs, key, "summary.json")
    return json.load(open(path)) if os.path.exists(path) else {}


def series(ab: "Ablation", key: str, name: str) -> list[float]:
    """The values of one logged quantity along a run (metrics.jsonl lines that carry it, in update order)."""
    from report import read_jsonl

    return [r[name] for r in read_jsonl(os.path.join(ab.runs, key, "metrics.jsonl")) if name in r]


def samples(ab: "Ablation", key: str) -> dict:
    from report import samples_stats

    if key not in ab._samples_cache:
        ab._samples_cache[key] = samples_stats(os.path.join(ab.runs, key, "samples.csv"))
    return ab._samples_cache[key]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def last_quarter(values: list[float]) -> list[float]:
    return values[-max(1, len(values) // 4):]


def mid_sentence(ab: "Ablation", arm: Arm) -> float:
    from datasets import load_from_disk

    from report import mid_sentence_share

    folder = ab.data_dir(arm)
    if folder not in ab._samples_cache:
        ab._samples_cache[folder] = mid_sentence_share(
            list(load_from_disk(os.path.join(folder, "sft"))["train"]["query"]))
    return ab._samples_cache[folder]


@dataclass
class Metric:
    name: str  # as shown in the table
    read: Callable  # (ablation, arm, run key) -> float
    expect: Optional[str]  # up | down | same | away_from_1 | None: how the toggle moves it, per the paper
    paper: str  # what the paper says, in words
    digits: int = 3
    arms: Optional[tuple[str, str]] = None  # (baseline, toggled) arms when not the row's own


@dataclass
class Row:
    detail: int
    toggle: str
    baseline: str  # arm names
    toggled: str
    metrics: list[Metric]


ROWS = {
    2: Row(2, "token truncation (baseline: paragraph truncation)", "sft_baseline", "sft_token_truncation", [
        Metric("SFT train queries cut mid-sentence (share)", lambda ab, arm, key: mid_sentence(ab, arm), "up",
               "paragraph truncation never cuts a sentence; token truncation does"),
        Metric("SFT ROUGE-1", lambda ab, arm, key: summary_of(ab, key)["eval/rouge1"], None,
               "whole sentences in the query; no number given"),
        Metric("SFT gold score", lambda ab, arm, key: samples(ab, key)["gold_score"], None,
               "whole sentences in the query; no number given"),
    ]),
    3: Row(3, "EOS as the pad token (baseline: a distinct [PAD])", "sft_baseline", "sft_eos_pad", [
        Metric("SFT EOS rate", lambda ab, arm, key: summary_of(ab, key)["eval/eos_rate"], "down",
               "EOS is masked out with the padding, so the model does not learn to stop"),
        Metric("SFT response length (tokens)", lambda ab, arm, key: summary_of(ab, key)["eval/response_token_len_mean"],
               "up", "longer: responses run on to the length limit", digits=1),
    ]),
    7: Row(7, "dropout on (baseline: off)", "probe_baseline", "probe_dropout", [
        Metric("PPO ratio, first minibatch (mean)", lambda ab, arm, key: series(ab, key, "ppo/val/ratio")[0],
               "away_from_1", "exactly 1 without dropout, off 1 with it", digits=4),
        Metric("PPO ratio, first minibatch (variance over episodes)",
               lambda ab, arm, key: series(ab, key, "ppo/val/ratio_var")[0], "up",
               "0 without dropout, positive with it", digits=6),
        Metric("PPO KL (last quarter of updates)",
               lambda ab, arm, key: mean(last_quarter(series(ab, key, "objective/kl"))),
               None, "no number given", arms=("ppo_baseline", "ppo_dropout")),
    ]),
    11: Row(11, "reward head init: library default N(0, 0.02) (baseline: N(0, 1/sqrt(d+1)))", "rm_baseline",
            "rm_library_head", [
        Metric("RM validation accuracy", lambda ab, arm, key: summary_of(ab, key)["eval/accuracy"], None,
               "follows Stiennon et al.; no ablation in the paper"),
        Metric("RM train loss, first 10 updates", lambda ab, arm, key: mean(series(ab, key, "train/loss")[:10]),
               None, "follows Stiennon et al.; no ablation in the paper"),
    ]),
    15: Row(15, "reward model not normalised (baseline: references score mean 0)", "ppo_normalised_rm",
            "ppo_unnormalised_rm", [
        Metric("PPO RM score of the final policy", lambda ab, arm, key: summary_of(ab, key)["eval/score"], "shift",
               "shifted by the normalisation bias (see the note above)"),
        Metric("PPO KL (last quarter of updates)",
               lambda ab, arm, key: mean(last_quarter(series(ab, key, "objective/kl"))),
               "same", "unchanged (expected: a constant shift of the score)"),
        Metric("PPO gold win rate", lambda ab, arm, key: samples(ab, key)["gold_win_rate"], "same",
               "unchanged (expected: a constant shift of the score)"),
    ]),
    22: Row(22, "critic initialised from SFT (baseline: from the RM)", "ppo_baseline", "ppo_critic_from_sft", [
        Metric("PPO value loss, first 4 updates", lambda ab, arm, key: mean(series(ab, key, "ppo/loss/value_avg")[:4]),
               "up", "higher (expected: the RM-initialised critic starts near the returns)", digits=4),
        Metric("PPO gold win rate", lambda ab, arm, key: samples(ab, key)["gold_win_rate"], None,
               "no number given"),
    ]),
    23: Row(23, f"EOS trick off (baseline: on, -1 without EOS), both at --response_length {EOS_TRICK_RESPONSE_LENGTH}",
            "ppo_short", "ppo_short_no_eos_trick", [
        Metric("PPO rollouts ending with EOS, first update (share)",
               lambda ab, arm, key: series(ab, key, "objective/eos_rate")[0], "same",
               "the same: both arms start from the SFT policy (how often the trick fires at first)"),
        Metric("PPO rollouts ending with EOS, last quarter of updates (share)",
               lambda ab, arm, key: mean(last_quarter(series(ab, key, "objective/eos_rate"))), "down",
               "lower: nothing pushes the policy to end its responses"),
        Metric("PPO EOS rate", lambda ab, arm, key: samples(ab, key)["eos_rate"], "down",
               "lower: nothing pushes the policy to end its responses"),
        Metric("PPO gold win rate", lambda ab, arm, key: samples(ab, key)["gold_win_rate"], "down",
               "lower: the RM score of a response without EOS is meaningless (Detail 13)"),
    ]),
    24: Row(24, "reward whitening on (baseline: off)", "ppo_baseline", "ppo_reward_whitening", [
        Metric("PPO response length (tokens)", lambda ab, arm, key: samples(ab, key)["length"], "down",
               "shorter", digits=1),
        Metric("PPO gold win rate", lambda ab, arm, key: samples(ab, key)["gold_win_rate"], "down",
               "lower"),
    ]),
    25: Row(25, "advantage whitening off (baseline: on)", "ppo_baseline", "ppo_no_advantage_whitening", [
        Metric("PPO approx. KL per update (mean)",
               lambda ab, arm, key: mean(series(ab, key, "ppo/policy/approxkl_avg")),
               "up", "higher: less stable updates (expected)", digits=4),
        Metric("PPO approx. KL per update (max)", lambda ab, arm, key: max(series(ab, key, "ppo/policy/approxkl_avg")),
               "up", "higher: less stable updates (expected)", digits=4),
        Metric("PPO gold win rate", lambda ab, arm, key: samples(ab, key)["gold_win_rate"], None,
               "no number given"),
    ]),
}


# --------------------------------------------------------------------------------------------
# The ablation: plan the runs, run them, write the table and the plots
# --------------------------------------------------------------------------------------------
class Ablation:
    def __init__(self, args: Args):
        self.args = args
        default_up = "artifacts/quickstart" if args.mode == "default" else "artifacts/ablations_ci_upstream"
        default_out = "artifacts/ablations" if args.mode == "default" else "artifacts/ablations_ci"
        self.upstream = os.path.abspath(args.upstream or default_up)
        self.out = os.path.abspath(args.out or default_out)
        self.runs = os.path.join(self.out, "runs")
        self.models = os.path.join(self.out, "models")
        self.logs = os.path.join(self.out, "logs")
        self.budget = BUDGET[args.mode]
        self.settings = pipeline.SETTINGS[PIPELINE_MODE[args.mode]]
        self.timings_path = os.path.join(self.out, "timings.json")
        self.timings = json.load(open(self.timings_path)) if os.path.exists(self.timings_path) else {}
        self._samples_cache: dict = {}
        unknown = [r for r in args.rows if r not in ROWS]
        if unknown:
            raise ValueError(f"--rows {unknown}: no such ablation; choose among {ALL_ROWS}")

    # ---------------------------------------------------------------- paths
    def up(self, *parts: str) -> str:
        return os.path.join(self.upstream, *parts)

    def data_dir(self, arm: Arm) -> str:
        return os.path.join(self.out, "data", arm.data) if arm.data else self.up("data")

    def run_key(self, arm: Arm, seed: int) -> str:
        return arm.name if arm.seedless else f"{arm.name}_s{seed}"

    def upstream_seed(self, stage: str) -> int:
        """The seed of an upstream stage (a seedless arm repeats it, so that only its toggle differs)."""
        path = self.up("runs", stage, "args.json")
        return int(json.load(open(path))["seed"]) if os.path.exists(path) else pipeline.Args().seed

    def upstream_ready(self) -> bool:
        return all(os.path.exists(self.up("stages", f"{s}.json")) for s in ("prep", "sft", "rm"))

    # ---------------------------------------------------------------- commands
    def py(self, script: str, *flags: str) -> list[str]:
        return [sys.executable, os.path.join(REPO_ROOT, script), *flags]

    def pipeline_cmd(self) -> list[str]:
        mode = PIPELINE_MODE[self.args.mode]
        stages = pipeline.FULL_STAGES if mode in ("full", "ci") else pipeline.QUICKSTART_STAGES
        skip = [s for s in stages if s not in ("prep", "sft", "rm")]
        return self.py("pipeline.py", "--mode", mode, "--out", self.upstream, "--skip", *skip)

    def prep_run(self, name: str, flags: list[str]) -> Run:
        """Toggled data from the upstream's raw rows and base-model tokenizer (see the module docstring)."""
        # the upstream's own lengths (its args.json; before the upstream exists, only the plan is printed)
        path = self.up("data", "args.json")
        up_args = json.load(open(path)) if os.path.exists(path) else {}
        lengths = []
        for flag in ("query_length", "sft_response_length", "rm_response_length", "cnndm_query_length",
                     "cnndm_response_length"):
            lengths += [f"--{flag}", str(up_args.get(flag, "?"))]
        folder = os.path.join(self.out, "data", name)
        cmd = self.py("data/prepare.py", "--task", "tldr", "--base_model", self.up("data", "base_model"),
                      "--sft_data", self.up("data", "raw", "sft"),
                      "--preference_data", self.up("data", "raw", "comparisons"),
                      "--output_dir", folder, *lengths, "--no-plots", *flags)
        return Run(f"prep_{name}", "prep", cmd, os.path.join(folder, "prep_summary.json"))

    def arm_run(self, arm: Arm, seed: int) -> Run:
        key = self.run_key(arm, seed)
        common = ["--seed", str(seed), "--run_name", key, "--run_dir_root", self.runs, "--overwrite_output_dir",
                  "--output_dir", os.path.join(self.models, key)]
        data = self.data_dir(arm)
        response_length = str(arm.response_length or pipeline.TASK["sft_response_length"])
        budget = self.budget[arm.budget or arm.kind]
        if arm.kind == "sft":
            flags = pipeline.flags_with(self.settings["sft"], budget)
            cmd = self.py("sft.py", *common, "--base_model", self.up("data", "base_model"), "--query_dataset",
                          os.path.join(data, "sft"), "--response_length", response_length, *flags)
        elif arm.kind == "rm":
            flags = pipeline.flags_with(self.settings["rm"], budget)
            cmd = self.py("reward.py", *common, "--sft_model_path", self.up("models", "sft"), "--preference_dataset",
                          os.path.join(data, "preference"), "--query_dataset", os.path.join(data, "sft"), *flags)
        else:  # ppo or the Detail 7 probe
            flags = pipeline.flags_with(pipeline.flags_with(self.settings["ppo"], self.budget["ppo"]),
                                        self.budget["probe"] if arm.kind == "probe" else {})
            rm = os.path.join(self.models, arm.reward_model) if arm.reward_model else self.up("models", "rm")
            cmd = self.py("ppo.py", *common, "--sft_model_path", self.up("models", "sft"), "--reward_model_path", rm,
                          "--query_dataset", os.path.join(data, "sft"), "--response_length", response_length, *flags)
        return Run(key, arm.kind, cmd + arm.extra, os.path.join(self.runs, key, "summary.json"))

    def plan(self) -> list[Run]:
        """Every run the chosen rows need, without repeats: data and the seedless RM first, then seed by
        seed (so an interrupted ablation has every row at its first seeds rather than some rows at all)."""
        arms = []
        for r in self.args.rows:
            for pair in [(ROWS[r].baseline, ROWS[r].toggled)] + [m.arms for m in ROWS[r].metrics if m.arms]:
                arms += [name for name in pair if name not in arms]
        runs: dict[str, Run] = {}
        for name in arms:
            arm = ARMS[name]
            if arm.data and f"prep_{arm.data}" not in runs:
                runs[f"prep_{arm.data}"] = self.prep_run(arm.data, TOGGLED_DATA[arm.data])
            if arm.reward_model and arm.reward_model not in runs:
                runs[arm.reward_model] = self.arm_run(ARMS[arm.reward_model], self.upstream_seed("rm"))
        kinds = ["rm", "sft", "probe", "ppo"]
        for seed in self.args.seeds:
            for kind in kinds:
                for name in arms:
                    if ARMS[name].kind == kind:
                        run = self.arm_run(ARMS[name], seed)
                        runs.setdefault(run.key, run)
        return list(runs.values())

    # ---------------------------------------------------------------- running
    def env(self) -> dict:
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", WANDB_MODE=os.environ.get("WANDB_MODE", "disabled"),
                   HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))
        if self.args.threads:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(self.args.threads)
        return env

    def estimate(self, kind: str) -> float:
        """Seconds one run of this kind takes: the median of this ablation's earlier runs, else the table."""
        measured = sorted(t["wall_time_s"] for k, t in self.timings.items() if t.get("kind") == kind)
        return measured[len(measured) // 2] if measured else ESTIMATE_S[self.args.mode][kind]

    def record(self, key: str, kind: str, seconds: float) -> None:
        self.timings[key] = {"kind": kind, "wall_time_s": round(seconds, 1), "finished": time.time()}
        os.makedirs(self.out, exist_ok=True)
        with open(self.timings_path + ".tmp", "w") as f:
            json.dump(self.timings, f, indent=1)
        os.replace(self.timings_path + ".tmp", self.timings_path)

    def execute(self, key: str, cmd: list[str]) -> bool:
        """Run one subprocess, its output into logs/<key>.log; True when it exited with 0."""
        os.makedirs(self.logs, exist_ok=True)
        printable = " ".join(cmd[1:]) if cmd[0] == sys.executable else " ".join(cmd)
        print(f"=== [{key}] python {printable}", flush=True)
        log_path = os.path.join(self.logs, f"{key}.log")
        with open(log_path, "w") as log:
            code = subprocess.run(cmd, cwd=REPO_ROOT, env=self.env(), stdout=log, stderr=subprocess.STDOUT).returncode
        if code != 0:
            tail = open(log_path, errors="replace").read()[-3000:]
            print(f"!!! [{key}] failed with exit code {code}; the end of {log_path}:\n{tail}", flush=True)
        return code == 0

    def run_all(self) -> list[str]:
        t_start = time.monotonic()
        runs = self.plan()
        todo = [r for r in runs if not os.path.exists(r.done_file)]
        need_upstream = not self.upstream_ready()
        left = (sum(self.estimate(r.kind) for r in todo) / max(1, self.args.jobs)
                + (self.estimate("pipeline") if need_upstream else 0))
        counts = {k: sum(r.kind == k for r in todo) for k in ("prep", "sft", "rm", "probe", "ppo")}
        print(f"ablation plan: rows {self.args.rows}, seeds {self.args.seeds}, {len(runs)} runs, "
              f"{len(runs) - len(todo)} done already; to run: "
              f"{'the upstream pipeline (prep, SFT, RM), ' if need_upstream else ''}"
              + ", ".join(f"{n} {k}" for k, n in counts.items() if n)
              + f"\nestimated time: {left / 60:.0f} min (2 quiet CPU cores; a shared machine is slower)", flush=True)
        if self.args.dry_run:
            for r in runs:
                print(("  done  " if r not in todo else "  todo  ") + r.key)
            return []
        if need_upstream:
            t0 = time.monotonic()
            print(f"=== upstream {self.upstream} is incomplete: running the pipeline's prep, SFT and RM stages",
                  flush=True)
            if not self.execute("upstream_pipeline", self.pipeline_cmd()):
                raise SystemExit("the upstream pipeline failed; see the log above")
            self.record("upstream_pipeline", "pipeline", time.monotonic() - t0)
        runs = self.plan()  # the prep commands read the upstream's args.json, which exists now
        todo = [r for r in runs if not os.path.exists(r.done_file)]
        failed: list[str] = []
        finished = [0]
        lock = threading.Lock()
        events = {r.key: threading.Event() for r in todo}  # set once a run has ended (done, failed or skipped)

        def one(run: Run) -> None:
            for dep in self.dependencies(run):
                if dep in events:
                    events[dep].wait()
            if any(dep in failed for dep in self.dependencies(run)):
                print(f"--- [{run.key}] skipped: a run it needs failed", flush=True)
                with lock:
                    failed.append(run.key)
                events[run.key].set()
                return
            if run.kind != "prep" and os.path.isdir(os.path.join(self.runs, run.key, "checkpoints")) and any(
                    d.startswith("update_") for d in os.listdir(os.path.join(self.runs, run.key, "checkpoints"))):
                run.cmd.append("--resume")  # interrupted after a checkpoint: continue from it
            t0 = time.monotonic()
            ok = self.execute(run.key, run.cmd)
            seconds = time.monotonic() - t0
            with lock:
                if ok:
                    self.record(run.key, run.kind, seconds)
                else:
                    failed.append(run.key)
                finished[0] += 1
                left_runs = [r for r in todo if not events[r.key].is_set() and r.key != run.key]
                remaining = sum(self.estimate(r.kind) for r in left_runs) / max(1, self.args.jobs)
                print(f"--- [{finished[0]}/{len(todo)}] {run.key}: {'done' if ok else 'FAILED'} in {seconds:.0f} s; "
                      f"elapsed {(time.monotonic() - t_start) / 60:.1f} min, about {remaining / 60:.0f} min left",
                      flush=True)
            events[run.key].set()

        # runs start in plan order (the runs others read come first), at most --jobs at a time
        with ThreadPoolExecutor(max_workers=max(1, self.args.jobs)) as pool:
            for future in [pool.submit(one, run) for run in todo]:
                future.result()
        return failed

    def dependencies(self, run: Run) -> list[str]:
        """Keys of the runs this run reads: its toggled data and its toggled reward model."""
        deps = []
        for arm in ARMS.values():
            if any(run.key == self.run_key(arm, s) for s in self.args.seeds):
                if arm.data:
                    deps.append(f"prep_{arm.data}")
                if arm.reward_model:
                    deps.append(arm.reward_model)
        return deps

    # ---------------------------------------------------------------- the table
    def collect(self) -> list[dict]:
        """One line per (detail, metric): the per-seed values of both arms and their comparison."""
        import numpy as np

        lines = []
        for r in self.args.rows:
            row = ROWS[r]
            for metric in row.metrics:
                values = {}
                for side, name in zip(("baseline", "toggled"), metric.arms or (row.baseline, row.toggled)):
                    arm, vals = ARMS[name], {}
                    for seed in self.args.seeds:
                        key = self.run_key(arm, seed)
                        if not os.path.exists(os.path.join(self.runs, key, "summary.json")):
                            continue
                        try:
                            vals[seed] = float(metric.read(self, arm, key))
                        except (KeyError, IndexError, ZeroDivisionError, FileNotFoundError) as err:
                            print(f"warning: detail {r}, {metric.name}, {key}: {type(err).__name__} {err}")
                    values[side] = vals
                b = np.array(list(values["baseline"].values()))
                t = np.array(list(values["toggled"].values()))
                line = {"detail": r, "toggle": row.toggle, "metric": metric.name, "paper": metric.paper,
                        "expect": metric.expect or "", "n_baseline": len(b), "n_toggled": len(t),
                        "baseline_values": ";".join(f"s{s}={v:.6g}" for s, v in values["baseline"].items()),
                        "toggled_values": ";".join(f"s{s}={v:.6g}" for s, v in values["toggled"].items()),
                        "digits": metric.digits}
                for side, arr in (("baseline", b), ("toggled", t)):
                    line[f"{side}_mean"] = float(arr.mean()) if len(arr) else float("nan")
                    line[f"{side}_std"] = (float(arr.std(ddof=1)) if len(arr) > 1
                                           else (0.0 if len(arr) else float("nan")))
                line["difference"] = line["toggled_mean"] - line["baseline_mean"]
                common = sorted(set(values["baseline"]) & set(values["toggled"]))  # seeds of both arms: paired
                diffs = np.array([values["toggled"][s] - values["baseline"][s] for s in common])
                line["difference_std"] = float(diffs.std(ddof=1)) if len(diffs) > 1 else 0.0
                line["verdict"] = self.verdict(metric, values["baseline"], values["toggled"])
                lines.append(line)
        return lines

    def verdict(self, metric: Metric, baseline: dict, toggled: dict) -> str:
        """Did the toggle move the metric the way the paper says? `baseline` and `toggled` map seed -> value.
        A difference counts as an effect when it exceeds twice its standard error across seeds (paired by
        seed when both arms ran the same seeds, as they do here: a seed fixes the first rollout, the data order
        and the initial weights of both arms), or when the baseline is a deterministic quantity (the same value
        at every seed, e.g. a first PPO ratio of exactly 1) and every seed's toggled value lies on the same side
        of it. Differences below 1e-6 (relative) are rounding and never count."""
        import numpy as np

        if not baseline or not toggled:
            return "missing runs"
        seeds = sorted(baseline)
        paired = seeds == sorted(toggled) and len(seeds) > 1
        b = np.array([baseline[s] for s in seeds])
        t = np.array([toggled[s] for s in (seeds if paired else sorted(toggled))])
        if metric.expect == "away_from_1":
            b, t = np.abs(b - 1.0), np.abs(t - 1.0)
        diff = t.mean() - b.mean()
        if paired:
            se = (t - b).std(ddof=1) / np.sqrt(len(b))
        else:
            se = np.sqrt((b.var(ddof=1) / len(b) if len(b) > 1 else 0.0)
                         + (t.var(ddof=1) / len(t) if len(t) > 1 else 0.0))
        tol = 1e-6 * max(1.0, abs(b.mean()))
        constant_baseline = bool(np.all(np.abs(b - b[0]) <= tol))
        one_side = bool(np.all(t - b[0] > tol) or np.all(t - b[0] < -tol))
        effect = abs(diff) > tol and (abs(diff) > 2 * se or (constant_baseline and one_side))
        direction = ("up" if diff > 0 else "down") if effect else "none"
        expect = metric.expect
        if expect == "shift":  # Detail 15: the toggled score should move by the RM's normalisation bias
            bias = self.normalisation_bias()
            expect = None if bias is None else ("up" if bias > 0 else "down")
        if expect == "away_from_1":
            expect = "up"
        if expect is None:
            return {"up": "effect: higher (no prediction)", "down": "effect: lower (no prediction)",
                    "none": "no clear effect (no prediction)"}[direction]
        if expect == "same":
            return "yes" if direction == "none" else f"no: {'higher' if direction == 'up' else 'lower'}"
        if direction == expect:
            return "yes"
        return "no: no clear effect" if direction == "none" else "no: opposite"

    def normalisation_bias(self) -> Optional[float]:
        """The shift reward.py applied to row 15's normalised RM (the SFT references' mean reward before it)."""
        path = os.path.join(self.runs, "rm_normalised", "summary.json")
        if not os.path.exists(path):
            return None
        return json.load(open(path)).get("reward_normalization_bias")

    def machine(self) -> str:
        import torch

        from rlhf_utils.provenance import cpu_record, cpu_type

        ram = ""
        if os.path.exists("/proc/meminfo"):
            kb = int(open("/proc/meminfo").readline().split()[1])
            ram = f", {kb / 2**20:.0f} GiB RAM"
        device = f"GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "CPU only (float32)"
        threads = os.environ.get("OMP_NUM_THREADS", "all") if not self.args.threads else str(self.args.threads)
        return (f"{os.cpu_count()} CPU cores ({cpu_type(cpu_record())}){ram}, {device}, torch {torch.__version__}, "
                f"Python {platform.python_version()}, {threads} torch thread(s) per run")

    def write_report(self) -> str:
        import csv

        from report import made_with
        from rlhf_utils.provenance import provenance

        lines_data = self.collect()
        os.makedirs(self.out, exist_ok=True)
        planned = {run.key for run in self.plan()}
        timed = {k: t for k, t in self.timings.items() if k in planned}
        own = sum(t["wall_time_s"] for t in timed.values())
        span = (max(t["finished"] for t in timed.values())
                - min(t["finished"] - t["wall_time_s"] for t in timed.values())
                if timed else 0.0)
        upstream_s = sum(json.load(open(self.up("stages", f"{s}.json")))["wall_time_s"]
                         for s in ("prep", "sft", "rm") if os.path.exists(self.up("stages", f"{s}.json")))
        bias = self.normalisation_bias()
        b = self.budget
        untimed = ("" if len(timed) == len(planned)
                   else f"; {len(planned) - len(timed)} of the {len(planned)} runs have no timing")
        load = os.getloadavg()
        text = [
            made_with(provenance()),
            "",
            "# Detail ablations on the built-in task",
            "",
            f"Every implementation detail below changed on its own, seeds {' '.join(map(str, self.args.seeds))}, "
            "each against the baseline with the same seed "
            f"(`python ablate.py{' --mode ci' if self.args.mode == 'ci' else ''}"
            f"{f' --jobs {self.args.jobs}' if self.args.jobs != 1 else ''}"
            f"{f' --threads {self.args.threads}' if self.args.threads else ''}"
            f"{' --rows ' + ' '.join(map(str, self.args.rows)) if self.args.rows != ALL_ROWS else ''}`).",
            "",
            f"- **Run time**: {(own + upstream_s) / 60:.0f} min in all: {own / 60:.1f} min for the {len(timed)} "
            f"ablation runs (sum of their wall times{untimed}; first start to last finish {span / 60:.1f} min) and "
            f"{upstream_s / 60:.1f} min for the upstream pipeline's prep, SFT and RM "
            f"(`{os.path.relpath(self.upstream, REPO_ROOT)}`, its stage times).",
            f"- **Machine**: {self.machine()}. "
            + ("Load average: not read (--report_only writes the report after the runs)." if self.args.report_only
               else f"Load average at the end: {' / '.join(f'{x:.1f}' for x in load)} (1 / 5 / 15 min; "
               + ("above the core count: other jobs shared the cores and the times are upper bounds)."
                  if max(load) > (os.cpu_count() or 1) else "at most the core count).")),
            f"- **Budgets** ({self.args.mode} mode): SFT "
            f"{' '.join(pipeline.flags_with(self.settings['sft'], b['sft']))}; "
            f"RM {' '.join(pipeline.flags_with(self.settings['rm'], b['rm']))} (row 15's unnormalised RM: the "
            f"upstream RM's {' '.join(pipeline.flags_with(self.settings['rm'], b['rm_upstream']))}); PPO "
            f"{' '.join(pipeline.flags_with(self.settings['ppo'], b['ppo']))}; Detail 7 probe: the PPO flags with "
            f"{' '.join(f'{k} {v}' for k, v in b['probe'].items())}. Data, SFT model and RM of the PPO runs: the "
            "upstream's (seed 1); the seed varies the ablated stage.",
            "- **Expected** paraphrases what the paper says the detail is for; where it gives no measurement the "
            "column says so, and *(expected)* marks an expectation that follows from the mechanism rather than a "
            "number in the paper. **Reproduced here**: *yes* when the change moves the metric that way, where a "
            "difference counts when it exceeds twice its standard error across seeds (paired by seed: both arms of "
            "a seed share its data order, initial weights and first rollout), or when the baseline is the "
            "same at every seed (a deterministic quantity, such as a first ratio of exactly 1) and every seed's "
            "changed value lies on the same side of it; *no: no clear effect* when it does not; *(no prediction)* "
            "reports the direction of a measured effect the paper does not predict.",
        ]
        notes = {  # a note on how a row is measured, for the rows this ablation ran
            15: (f"- Detail 15: the two RMs are one training run, saved with and without the normalisation; the "
                 f"references' mean reward before it is {bias:+.3f}, so the unnormalised RM scores every response "
                 f"{bias:+.3f} against the normalised one." if bias is not None
                 else "- Detail 15: the normalised RM's bias is unknown (no run yet)."),
            7: ("- Detail 7: the ratio comes from a one-update probe run (one epoch, one minibatch, micro-batches of "
                "one episode): its mean ratio is the first minibatch's, its variance is over the episodes' mean "
                "ratios."),
            23: (f"- Detail 23: both arms run PPO with `--response_length {EOS_TRICK_RESPONSE_LENGTH}` (the task's: "
                 f"{pipeline.TASK['sft_response_length']}), a budget the SFT policy often overruns; with the task's "
                 "length every response ends in time and the trick never fires."),
        }
        text += [note for row, note in notes.items() if row in self.args.rows]
        text += [
            "",
            "| detail | change | metric | baseline (mean ± std) | changed (mean ± std) "
            "| difference (paired by seed, mean ± std) | expected | reproduced here |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for ln in lines_data:
            d = ln["digits"]

            def fmt(m: float, s: float, n: int) -> str:
                return "n/a" if n == 0 else f"{m:.{d}f} ± {s:.{d}f}"

            text.append(f"| {ln['detail']} | {ln['toggle']} | {ln['metric']} | "
                        f"{fmt(ln['baseline_mean'], ln['baseline_std'], ln['n_baseline'])} (n={ln['n_baseline']}) | "
                        f"{fmt(ln['toggled_mean'], ln['toggled_std'], ln['n_toggled'])} (n={ln['n_toggled']}) | "
                        f"{ln['difference']:+.{d}f} ± {ln['difference_std']:.{d}f} | "
                        f"{ln['paper']} | {ln['verdict']} |")
        plots = self.plot(lines_data)
        text += ["", "Plots (every seed's value, baseline vs changed, a line joining the two runs of a seed): "
                 + ", ".join(f"`{p}`" for p in plots), ""]
        out = "\n".join(text)
        with open(os.path.join(self.out, "ablations.md"), "w") as f:
            f.write(out)
        columns = ["detail", "toggle", "metric", "baseline_mean", "baseline_std", "toggled_mean", "toggled_std",
                   "difference", "difference_std",
                   "n_baseline", "n_toggled", "baseline_values", "toggled_values", "expect", "paper", "verdict"]
        with open(os.path.join(self.out, "ablations.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(lines_data)
        return out

    def plot(self, lines_data: list[dict]) -> list[str]:
        """One PNG per detail (detail_figure), in the output folder; returns their names."""
        import matplotlib.pyplot as plt

        names = []
        for r in self.args.rows:
            fig = detail_figure(r, [ln for ln in lines_data if ln["detail"] == r])
            name = f"detail_{r:02d}.png"
            fig.savefig(os.path.join(self.out, name), dpi=100)
            plt.close(fig)
            names.append(name)
        return names


def detail_figure(detail: int, lines: list[dict]):
    """One detail's figure from its rows of ablations.csv: a panel per metric, each seed's value with the project's
    default and with the detail changed (a marker per seed, a thin line joining a seed's two values, a thick bar at
    each arm's mean), the arms named in words (the row's toggle) and the seeds in one legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    change, _, default = ROWS[detail].toggle.partition(" (baseline: ")
    default = default.split(")")[0]
    seeds = sorted({p.split("=")[0] for ln in lines for side in ("baseline", "toggled")
                    for p in ln[f"{side}_values"].split(";") if p}, key=lambda s: (len(s), s))
    markers = dict(zip(seeds, "osD^vP*X"))
    fig, axes = plt.subplots(1, len(lines), figsize=(3.6 * len(lines), 3.9), squeeze=False)
    for ax, ln in zip(axes[0], lines):
        points = {}  # side -> {seed: (x, y)}
        for x, side, colour in ((0, "baseline", "tab:blue"), (1, "toggled", "tab:orange")):
            values = dict(p.split("=") for p in ln[f"{side}_values"].split(";") if p)
            for i, seed in enumerate(seeds):
                if seed in values:
                    xi, yi = x + 0.08 * (i - (len(seeds) - 1) / 2), float(values[seed])
                    ax.plot([xi], [yi], markers[seed], color=colour, ls="none", zorder=3)
                    points.setdefault(side, {})[seed] = (xi, yi)
            if values:
                mean = sum(float(v) for v in values.values()) / len(values)
                ax.hlines(mean, x - 0.22, x + 0.22, color=colour, lw=2)
        for seed, (x0, y0) in points.get("baseline", {}).items():  # the same seed in both arms: a thin line
            if seed in points.get("toggled", {}):
                x1, y1 = points["toggled"][seed]
                ax.plot([x0, x1], [y0, y1], color="gray", lw=0.6, alpha=0.6, zorder=1)
        ax.set_xticks([0, 1], ["default:\n" + textwrap.fill(default, 22), "changed:\n" + textwrap.fill(change, 22)])
        ax.set_xlim(-0.5, 1.5)
        ax.set_title(textwrap.fill(ln["metric"], 44), fontsize=8)
        ax.tick_params(labelsize=7)
    seed_keys = [matplotlib.lines.Line2D([], [], marker=markers[seed], color="0.35", ls="none") for seed in seeds]
    fig.legend(seed_keys, [f"seed {seed.lstrip('s')}" for seed in seeds], loc="upper right", fontsize=7,
               ncol=len(seeds), frameon=False)
    fig.suptitle(f"Detail {detail}: {ROWS[detail].toggle}", fontsize=9, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def main(args: Args) -> None:
    ab = Ablation(args)
    failed = [] if args.report_only else ab.run_all()
    if args.dry_run:
        return
    text = ab.write_report()
    print("\n" + text)
    print(f"table: {os.path.join(ab.out, 'ablations.md')}; csv and plots next to it")
    if failed:
        raise SystemExit(f"{len(failed)} run(s) failed: {', '.join(failed)}; rerun `python ablate.py` (same flags) "
                         "to retry them (finished runs are kept)")


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True))
