"""Records: what a run writes about itself (summary.json, the trainer state's time totals and budget, sample tables,
evaluation files), for the scripts that share a layout of them.

  the PPO family (ppo.py, rloo.py, grpo.py, reinforce_pp.py)
              fresh_trainer_state, next_state: the time totals, the budget spent and the last metrics, carried by
              checkpoints; run_summary: summary.json; log_evaluation: an evaluation's sample table and its logged means
  the DPO family (dpo.py, kto.py, online_dpo.py)
              sample_table: the samples table of a policy's truncated responses; write_evaluation: an evaluation's
              files (samples, the accuracy table); breakdown_markdown: that table as Markdown
  reward.py   save_reward_evaluation: an evaluation's files (samples, the Table 5 analogue, calibration.csv) and
              its plots (save_reward_plots: calibration_figure, reward_logits_figure; counts_at_foot, which
              judge.py's length-controlled plot shares); reward_table_markdown, reward_samples_frame: its table and
              samples
  sft.py      write_sft_samples: an evaluation's sample tables (files, TensorBoard, W&B, the console)
  ilql.py     IlqlCounters (interval_means): the running counters a checkpoint carries and the means of a
              logging interval; write_ilql_evaluation (beta_name): an evaluation's metrics and tables per beta,
              whose values its ilql_sample_table computes
  offline_rl.py
              write_offline_evaluation: an evaluation's tables (dt: one per target) and their logged names, whose
              values its evaluate_policy computes; log_offline: a line of metrics at an update; OfflineCounters:
              the running counters a checkpoint carries; load_or_build_mixture (mixture_key, path_fingerprint):
              its labelled mixture, saved under --cache_dir and reused by a run whose inputs all match, whose
              content the script's build_mixture decides
  online_dpo.py
              print_round_drops: the console line of a round that dropped pairs (how many, why, slots filled)

What it never does: compute a number a run trains with. Every metric it writes is a mean or a count of values the
scripts computed (scores, EOS flags, lengths), and the scripts' own evaluations (eval_samples, preference_report,
reward.py's run_evaluation, sft.py's evaluate_sft) decide those values.
"""

import hashlib
import json
import os
import time
from typing import Dict, List

import numpy as np
import pandas as pd
import torch
from datasets import load_from_disk
from tqdm.auto import tqdm

from rlhf_utils.run import frame_markdown


# ----------------------------------------------------------------------------------------------------------------------
# The PPO family: the trainer state's records and summary.json
# ----------------------------------------------------------------------------------------------------------------------
def fresh_trainer_state() -> dict:
    """The trainer state of a run that starts at update 0: the time totals, the budget spent (responses sampled and the
    prompts they answer, counted as they are sampled) and the last metrics, for the summary."""
    return {"update": 0, "wall_time_s": 0.0, "metrics": {},
            "totals": {"generation": 0.0, "scoring": 0.0, "training": 0.0, "wall": 0.0},
            "budget": {"budget/responses_sampled": 0, "budget/prompts": 0}}


def next_state(state: dict, start_time: float, timers: dict, metrics: dict, sampled: dict) -> dict:
    """The trainer state after an update: the run's wall time, the time totals and the budget spent (this update's
    `timers` and `sampled` counts added to the state's), and the update's metrics. `start_time` is a time.monotonic()
    reading less the seconds of the run before its resume (the state's wall_time_s): the state saves elapsed seconds,
    never a reading, which would mean nothing to the process that resumes it, and a wall clock stepped back or
    forward (NTP, a changed time zone setting) moves neither."""
    return {"wall_time_s": time.monotonic() - start_time, "metrics": metrics,
            "totals": {key: state["totals"][key] + timers[key] for key in state["totals"]},
            "budget": {key: state["budget"][key] + sampled[key] for key in state["budget"]}}


def run_summary(args, state: dict, eval_metrics: dict, num_updates: int, start_time: float) -> dict:
    """summary.json: the final evaluation, the last update's objective/ metrics, and the run's speed and time shares
    (the interrupted part of a resumed run included)."""
    totals = state["totals"]
    return {
        **eval_metrics,
        **{k: v for k, v in state["metrics"].items() if k.startswith("objective/")},
        "episodes": num_updates * args.total_batch_size,
        "episodes_per_second": num_updates * args.total_batch_size / totals["wall"],
        "time/generation_share": totals["generation"] / totals["wall"],
        "time/scoring_share": totals["scoring"] / totals["wall"],
        "time/training_share": totals["training"] / totals["wall"],
        **state["budget"], "budget/updates": num_updates,  # the budget as spent (report.py's leaderboard reads it)
        "wall_time_s": time.monotonic() - start_time,  # (next_state's clock)
    }


def log_evaluation(run, args, update: int, rows: list):
    """Save the rows of the evaluation after `update` (eval_samples) as samples/step_{update}.csv and log its
    metrics at that update; return the metrics and the table."""
    table = pd.DataFrame(rows)
    run.save_table(table, f"samples/step_{update:06d}.csv")
    metrics = {"eval/score": float(table["score"].mean()), "eval/eos_rate": float(table["has_eos"].mean()),
               "eval/response_token_len_mean": float(table["response_token_len"].mean())}
    run.log(update, {"episode": update * args.total_batch_size, **metrics})
    return metrics, table


# ----------------------------------------------------------------------------------------------------------------------
# The DPO family: the samples table and an evaluation's files
# ----------------------------------------------------------------------------------------------------------------------
def sample_table(tokenizer, raw, rows: torch.Tensor, responses: torch.Tensor):
    """The samples table (the columns every policy script writes) of sample_responses' rows (N,) and truncated
    responses (N, Tr), and its metrics: the EOS rate and the mean response length."""
    has_eos = (responses == tokenizer.eos_token_id).any(1)
    # tokens up to and including the first EOS (all of them when there is none)
    token_len = torch.where(has_eos, (responses == tokenizer.eos_token_id).int().argmax(1) + 1, responses.size(1))
    query_tokens, references = raw["query_token"], raw["reference_response"]
    records = []
    for i, row in enumerate(rows.tolist()):
        query = query_tokens[row]
        records.append({
            "query": tokenizer.decode([t for t in query if t != tokenizer.pad_token_id], skip_special_tokens=True),
            "response": tokenizer.decode(
                [t for t in responses[i].tolist() if t != tokenizer.pad_token_id], skip_special_tokens=True
            ),
            "reference": references[row],
            "score": None,  # no reward model in DPO
            "response_token_len": int(token_len[i]),
            "has_eos": bool(has_eos[i]),
        })
    table = pd.DataFrame(records, columns=["query", "response", "reference", "score", "response_token_len", "has_eos"])
    metrics = {
        "eval/eos_rate": float(has_eos.float().mean()),
        "eval/response_token_len_mean": float(token_len.float().mean()),
    }
    return table, metrics


def write_evaluation(run, args, update: int, final: bool, report: tuple, sampled, sample_raw,
                     tokenizer) -> Dict[str, float]:
    """An evaluation's metrics and outputs: samples/step_N.csv and the TensorBoard text tabs; after training also
    samples.csv, the accuracy table (eval_table.csv, eval_table.md, printed) and every scored pair (eval_pairs.csv)."""
    metrics, table_rows, frame = report  # the script's preference_report: metrics, accuracy rows, pairs
    samples, sample_metrics = sample_table(tokenizer, sample_raw, *sampled)
    metrics.update(sample_metrics)
    run.save_table(samples, f"samples/step_{update:06d}.csv")
    if not run.main:
        return metrics
    run.writer.add_text("eval/accuracy_table", breakdown_markdown(table_rows), update)  # TensorBoard's text tab
    run.writer.add_text("eval/samples", frame_markdown(samples.head(8)), update)
    if final:
        run.save_table(samples, "samples.csv")
        run.save_table(pd.DataFrame(table_rows), "eval_table.csv")
        with open(os.path.join(run.dir, "eval_table.md"), "w") as f:
            f.write(breakdown_markdown(table_rows) + "\n")
        run.save_table(frame, "eval_pairs.csv")
        print(breakdown_markdown(table_rows))
    if args.print_sample_every > 0 and (final or update % args.print_sample_every == 0):
        for row in samples.head(2).itertuples():
            print(f"--- update {update}\nQUERY: {row.query[-200:]}\nRESPONSE: {row.response}\n"
                  f"REFERENCE: {row.reference}")
    return metrics


def breakdown_markdown(rows: List[dict]) -> str:
    """The accuracy table as Markdown, in reward.py's layout so the RM and DPO tables sit side by side."""
    lines = ["| dataset split | metric | key | value | n |", "| --- | --- | --- | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['dataset_split']} | {r['group']} | {r['key']} | {r['value']:.4f} | {r['n']} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------------
# reward.py: an evaluation's files (the sample table, the Table 5 analogue, calibration) and its plots
# ----------------------------------------------------------------------------------------------------------------------
def save_reward_evaluation(run, frame, rows, calibration: dict, logit_rows: list, eos_text: str, step: int,
                           final: bool) -> None:
    """The outputs of one evaluation: the sample table samples/step_N.csv; after the final one also samples.csv,
    the Table 5 analogue (eval_table.md / .csv, printed), calibration.csv and the Detail 13 / 18 plots."""
    if not run.main:
        return
    samples = reward_samples_frame(frame, eos_text)
    run.save_table(samples, f"samples/step_{step:06d}.csv")
    if final:
        run.save_table(samples, "samples.csv")
        table = reward_table_markdown(rows)
        with open(os.path.join(run.dir, "eval_table.md"), "w") as f:
            f.write(table + "\n")
        run.save_table(pd.DataFrame(rows), "eval_table.csv")
        run.save_table(pd.concat([c.assign(dataset_split=s) for s, c in calibration.items()]), "calibration.csv")
        save_reward_plots(run.dir, calibration, logit_rows)
        print(table)


def reward_table_markdown(rows: list[dict]) -> str:
    """The Table 5 analogue as Markdown."""
    lines = ["| dataset split | metric | key | value | 95% CI | n |", "| --- | --- | --- | ---: | --- | ---: |"]
    for r in rows:
        ci = f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]" if "ci_low" in r else ""
        lines.append(f"| {r['dataset_split']} | {r['group']} | {r['key']} | {r['value']:.4f} | {ci} | {r['n']} |")
    return "\n".join(lines)


def save_reward_plots(run_dir: str, calibration: dict, logit_rows: list[dict]) -> None:
    """Figure 5 (right) analogue and the Detail 13 per-token reward logits, as PNG files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = calibration_figure(calibration)
    fig.savefig(os.path.join(run_dir, "calibration.png"), dpi=120)
    plt.close(fig)
    fig = reward_logits_figure(logit_rows)
    fig.savefig(os.path.join(run_dir, "reward_logits.png"), dpi=120)
    plt.close(fig)


def calibration_figure(calibration: dict):
    """The reward model's calibration per split: the share of pairs where the raters prefer A against the score
    difference, beside the logistic curve of perfect calibration; the pairs each point rests on written along the
    panel's foot, a row per split in its colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 4.4))
    lim = max(float(np.abs(c["mean_diff"]).max()) for c in calibration.values())
    x = np.linspace(-lim, lim, 200)
    ax.plot(x, 1 / (1 + np.exp(-x)), color="black", label="perfect calibration 1/(1+e^-d)")
    for i, (split_name, c) in enumerate(calibration.items()):
        line = ax.plot(c["mean_diff"], c["accuracy"], marker="osD^v"[i % 5], ms=4, label=split_name)[0]
        counts_at_foot(ax, c["mean_diff"], c["n"], i, line.get_color())  # how many pairs each point rests on
    ax.set_ylim(-0.05 - 0.07 * len(calibration), 1.05)  # room at the foot for the rows of counts
    ax.set_xlabel("score difference d = r(A) - r(B) (reward-model logits)")
    ax.set_ylabel("share of pairs where the raters prefer A")
    ax.set_title("Reward model calibration (Detail 18)\nat the foot: pairs per point, each pair in both orders",
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


def counts_at_foot(ax, xs, counts, row: int, colour) -> None:
    """Write how many observations each point of a series rests on along a panel's foot, at the points' x, in row
    `row` (0 the lowest) of one row per series, in the series' colour: counts written at the points themselves
    cover each other where two series come close. The panel's lower y limit must leave room (9 points a row)."""
    for x, n in zip(xs, counts):
        ax.annotate(f"{n}", (x, 0), xycoords=("data", "axes fraction"), xytext=(0, 3 + 9 * row),
                    textcoords="offset points", ha="center", fontsize=6, color=colour)


def reward_logits_figure(logit_rows: list[dict]):
    """Detail 13: the reward head's logit at every response token of a few sequences, the EOS token's (where the
    reward is read) starred, a last token without EOS crossed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, row in enumerate(logit_rows):
        steps = np.arange(len(row["logits"]))
        line = ax.plot(steps, row["logits"], marker=".", label=f"sequence {i}")[0]
        marker = "*" if row["ends_with_eos"] else "x"
        ax.plot(steps[-1], row["logits"][-1], marker=marker, markersize=14, color=line.get_color())
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_xlabel("response token index (star: EOS, where the reward is read)")
    ax.set_ylabel("reward logit")
    ax.set_title("Per-token reward logits (Detail 13)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def reward_samples_frame(frame: pd.DataFrame, eos_text: str) -> pd.DataFrame:
    """One row per validation response in the project's samples schema, plus the pair's metadata."""
    out = []
    for role, other in (("chosen", "rejected"), ("rejected", "chosen")):
        out.append(pd.DataFrame({
            "query": frame["query"],
            "response": frame[role].str.replace(eos_text, "", regex=False),
            "reference": "",  # preference rows carry no reference summary
            "score": frame[f"{role}_score"],
            "response_token_len": frame[f"{role}_token_len"],
            "has_eos": frame[f"{role}_has_eos"],
            "role": role,
            "pair_index": frame.index,
            "policy": frame[f"{role}_policy"],
            "other_score": frame[f"{other}_score"],
            "dataset_split": frame["dataset_split"],
            "batch": frame["batch"],
            "split": frame["split"],
            "confidence": frame["confidence"],
        }))
    return pd.concat(out).sort_values(["dataset_split", "pair_index", "role"]).reset_index(drop=True)


# ----------------------------------------------------------------------------------------------------------------------
# sft.py: the sample tables of an evaluation
# ----------------------------------------------------------------------------------------------------------------------
def write_sft_samples(run, args, split: str, prefix: str, step: int, final: bool, metrics: dict,
                      df: pd.DataFrame) -> None:
    """The sample table of one evaluation of one split: runs/{run_name}/samples/step_N.csv (and samples.csv after
    training; `_test` added for the test split), its first --num_table_samples rows in TensorBoard (and W&B) and
    on the console, with the metrics."""
    suffix = "" if split == args.eval_split else f"_{split}"
    run.save_table(df, f"samples/step_{step:06d}{suffix}.csv")
    if final:
        run.save_table(df, f"samples{suffix}.csv")
    table = df.head(args.num_table_samples)[["query", "response", "reference"]]
    if not run.main:
        return
    run.writer.add_text(f"{prefix}/samples", frame_markdown(table), step)  # TensorBoard's text tab
    if args.run.track:
        import wandb

        wandb.log({f"{prefix}/samples": wandb.Table(dataframe=df.head(args.num_table_samples))}, step=step)
    for row in table.itertuples(index=False):
        tqdm.write(f"[{split} step {step}] query: ...{row.query[-200:]!r}\n  response: {row.response!r}\n"
                   f"  reference: {row.reference!r}")
    tqdm.write(f"[{split} step {step}] " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))


# ----------------------------------------------------------------------------------------------------------------------
# offline_rl.py: its evaluation tables, its log lines and the running counters of its trainer state
# ----------------------------------------------------------------------------------------------------------------------
def write_offline_evaluation(args, run, step: int, target: float | None, final: bool, raw_metrics: dict,
                             df: pd.DataFrame) -> dict:
    """Write one evaluation table (dt: the one at `target`) and return its metrics under their logged names. The
    table at --dt_target (every method's only table) goes to samples/step_N.csv, at the end also to samples.csv; dt's
    final tables also to samples_target_T.csv. Its first rows go to TensorBoard and the console."""
    main_table = target is None or target == args.dt_target
    metrics = {f"eval/{k}": v for k, v in raw_metrics.items()} if main_table else {}
    if target is not None and final:
        metrics.update({f"eval/target_{target:+.1f}/{k}": v for k, v in raw_metrics.items()})
    if main_table:
        run.save_table(df, f"samples/step_{step:06d}.csv")
        if final:
            run.save_table(df, "samples.csv")
    if target is not None and final:
        run.save_table(df, f"samples_target_{target:+.1f}.csv")
    name = "eval" if target is None else f"eval/target_{target:+.1f}"
    table = df.head(args.num_table_samples)[["query", "response", "reference", "score"]]
    if run.main:
        run.writer.add_text(f"{name}/samples", frame_markdown(table), step)  # TensorBoard's text tab
        for row in table.itertuples(index=False):
            tqdm.write(f"[{name} step {step}] query: ...{row.query[-120:]!r}\n"
                       f"  response: {row.response!r}  score {row.score:.3f}")
        tqdm.write(f"[{name} step {step}] " + ", ".join(f"{k}={v:.4f}" for k, v in raw_metrics.items()))
    return metrics


def log_offline(run, args, step: int, metrics: dict) -> None:
    """Log offline_rl.py's metrics at an update, with the number of samples trained on so far (`episode`)."""
    run.log(step, {"episode": step * args.total_batch_size, **metrics})


class OfflineCounters:
    """The running counters of offline_rl.py's step 2, which a checkpoint saves in trainer_state.json next to
    accelerate's state (models, optimizer, schedule, data order, RNG): completed updates, input tokens trained on, the
    last update's loss, the wall seconds per stage (Table 3) and best-of-n's per-round metrics."""

    @staticmethod
    def fresh(costs: dict) -> dict:
        """The trainer state of a run that starts from the first update, with the seconds step 1 took (`costs`)."""
        return {"update": 0, "train_tokens": 0, "last_loss": float("nan"), "costs": costs, "round_summary": {}}

    def __init__(self, state: dict):
        self.update, self.train_tokens, self.last_loss = state["update"], state["train_tokens"], state["last_loss"]
        self.costs, self.round_summary = state["costs"], state["round_summary"]

    def add_update(self, loss: float, tokens: int, seconds: float) -> None:
        self.update += 1
        self.train_tokens += tokens
        self.last_loss = loss
        self.costs["training_s"] += seconds

    def state(self) -> dict:
        """The trainer state a checkpoint saves (taken between updates): a copy, so later updates leave it as it is."""
        return {"update": self.update, "train_tokens": self.train_tokens, "last_loss": self.last_loss,
                "costs": dict(self.costs), "round_summary": dict(self.round_summary)}


# ----------------------------------------------------------------------------------------------------------------------
# ilql.py: the running counters of training, the means of a logging interval, and an evaluation's files
# ----------------------------------------------------------------------------------------------------------------------
def interval_means(interval_stats: dict, interval_tokens: int, interval_start: float, lr: float, epoch: float,
                   num_target_syncs: int) -> dict:
    """The training metrics of a logging interval: each statistic's mean over the interval, and throughput,
    learning rate, epoch and target syncs at its end."""
    means = {key: sum(values) / len(values) for key, values in interval_stats.items()}
    means["train/tokens_per_s"] = interval_tokens / (time.monotonic() - interval_start)
    means["train/lr"] = lr
    means["train/epoch"] = epoch
    means["train/num_target_syncs"] = num_target_syncs
    return means


class IlqlCounters:
    """The running counters of training, which a checkpoint saves in trainer_state.json next to accelerate's state
    (models, optimizer, schedule, RNG): completed updates (the data position: update x gradient_accumulation_steps
    micro batches), episodes, target syncs, training seconds, the last logged training means, and the open logging
    interval: per update, each statistic averaged over every micro batch of every process, the tokens of all
    processes and its seconds so far (elapsed, from time.monotonic(): a resumed interval goes on from them). Already
    reduced, they are the same on every process, so the main process's copy in the checkpoint is every process's (and
    JSON keeps the floats exactly)."""

    @staticmethod
    def fresh() -> dict:
        """The trainer state of a run that starts from the first update."""
        return {"update": 0, "episode": 0, "num_target_syncs": 0, "train_time": 0.0, "last_train_metrics": {},
                "interval_stats": {}, "interval_tokens": 0, "interval_s": 0.0}

    def __init__(self, state: dict):
        self.update, self.episode, self.num_target_syncs = state["update"], state["episode"], state["num_target_syncs"]
        self.train_time = state["train_time"]  # optimisation only (no evaluation, no RM labelling)
        self.last_train_metrics: Dict[str, float] = state["last_train_metrics"]
        self.interval_stats: Dict[str, List[float]] = state["interval_stats"]
        self.interval_tokens, self.interval_start = state["interval_tokens"], time.monotonic() - state["interval_s"]

    def end_update(self, update: int, batch_size: int, seconds: float) -> None:
        self.update = update
        self.episode += batch_size
        self.train_time += seconds
        self.interval_stats.setdefault("time/update_s", []).append(seconds)  # logged as the interval's mean

    def close_interval(self, lr: float, num_trajectories: int) -> dict:
        """The training means of the logging interval that ends here (interval_means); a new interval opens."""
        self.last_train_metrics = interval_means(self.interval_stats, self.interval_tokens, self.interval_start, lr,
                                                 self.episode / num_trajectories, self.num_target_syncs)
        self.interval_stats, self.interval_tokens, self.interval_start = {}, 0, time.monotonic()
        return self.last_train_metrics

    def state(self) -> dict:
        """The trainer state a checkpoint saves (taken between updates): a copy, so later updates leave it as it is."""
        return {"update": self.update, "episode": self.episode, "num_target_syncs": self.num_target_syncs,
                "train_time": self.train_time, "last_train_metrics": self.last_train_metrics,
                "interval_tokens": self.interval_tokens, "interval_s": time.monotonic() - self.interval_start,
                "interval_stats": {key: list(values) for key, values in self.interval_stats.items()}}

    def totals(self) -> dict:
        """The counters the summary reports."""
        return {"num_updates": self.update, "episodes": self.episode, "num_target_syncs": self.num_target_syncs,
                "train_time_s": self.train_time,
                # the budget as spent (report.py's leaderboard reads it): trajectories (RM-scored responses) read
                "budget/updates": self.update, "budget/rows_read": self.episode}


def beta_name(beta: float) -> str:
    """0.0 -> "0", 4.0 -> "4", 0.5 -> "0.5": the suffix of samples_beta{b}.csv and of the metric names."""
    return f"{beta:g}"


def write_ilql_evaluation(run, accelerator, args, update: int, episode: int, tables: dict, beta_metrics: dict,
                          final: bool) -> dict:
    """The records of one ilql.py evaluation: tables and beta_metrics hold, per beta in the order sampled, the
    samples table and the metrics of ilql_sample_table. Each beta's metrics are logged as eval/beta_{b}/..., those
    of --beta as eval/... as well; the table of --beta becomes samples/step_N.csv (and samples.csv at the end), each
    swept beta samples_beta{b}.csv; a few samples are printed. Returns the logged metrics."""
    metrics = {}
    for beta, values in beta_metrics.items():
        metrics.update({f"eval/beta_{beta_name(beta)}/{k}": v for k, v in values.items()})
        if beta == args.beta:
            metrics.update({f"eval/{k}": v for k, v in values.items()})
    default_table = tables[args.beta]
    run.save_table(default_table, f"samples/step_{update:06d}.csv")
    if final:
        run.save_table(default_table, "samples.csv")
        for beta in args.eval_betas:
            run.save_table(tables[beta], f"samples_beta{beta_name(beta)}.csv")
    printing = args.print_sample_every > 0 and (final or update % args.print_sample_every == 0)
    if accelerator.is_main_process and printing:
        for row in default_table.head(2).itertuples():
            print(f"--- update {update}, beta {args.beta}\nQUERY: {row.query[-200:]}\n"
                  f"RESPONSE: {row.response}\nREFERENCE: {row.reference}")
    run.log(update, {"episode": episode, **metrics})
    return metrics


# ----------------------------------------------------------------------------------------------------------------------
# online_dpo.py: the console line of a round that dropped pairs
# ----------------------------------------------------------------------------------------------------------------------
def print_round_drops(accelerator, round_index: int, counts: dict, pairs_per_round: int) -> None:
    """One line when round `round_index` dropped pairs: how many and why (ties, invalid verdicts, no EOS in either
    response), from its counts (online_dpo.py's label_pairs and online_round decide them), the prompt batches drawn
    and the slots of pairs_per_round filled; nothing when it kept every pair."""
    if counts["pairs_kept"] < counts["pairs"]:
        accelerator.print(
            f"round {round_index}: {counts['pairs'] - counts['pairs_kept']} of {counts['pairs']} pairs dropped (ties "
            f"{counts['dropped_ties']}, invalid {counts['dropped_invalid']}, no EOS in either "
            f"{counts['dropped_no_eos']}); {counts['draws']} prompt batch(es) drawn, {counts['pairs_trained']} of "
            f"{pairs_per_round} slots filled")


# ----------------------------------------------------------------------------------------------------------------------
# offline_rl.py: the cache of its labelled mixture, kept under --cache_dir for the next run with the same inputs
# ----------------------------------------------------------------------------------------------------------------------
def path_fingerprint(path: str) -> str:
    """What identifies a model or dataset for the cache: a local folder's file names, sizes and modification
    times (so a retrained model at the same path invalidates the cache), or the hub name itself."""
    if not os.path.isdir(path):
        return path
    entries = []
    for root, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            stat = os.stat(os.path.join(root, name))
            entries.append(f"{os.path.relpath(os.path.join(root, name), path)}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()


def mixture_key(args) -> dict:
    """Every argument offline_rl.py's mixture depends on; a cached mixture is reused only when all of them match."""
    def where(path: str) -> str:  # a local folder by its absolute path, a hub name as it is
        return os.path.abspath(path) if os.path.isdir(path) else path

    return {
        "sft_model_path": where(args.sft_model_path),
        "sft_model_fingerprint": path_fingerprint(args.sft_model_path),
        "reward_model_path": where(args.reward_model_path),
        "reward_model_fingerprint": path_fingerprint(args.reward_model_path),
        "query_dataset": where(args.query_dataset),
        "query_dataset_fingerprint": path_fingerprint(args.query_dataset),
        "preference_dataset": where(args.preference_dataset),
        "preference_dataset_fingerprint": path_fingerprint(args.preference_dataset),
        "train_split": args.train_split,
        "preference_split": args.preference_split,
        "response_length": args.response_length,
        "mixture_size": args.mixture_size,
        "mixture_weights": list(args.mixture_weights),
        "mixture_temperature": args.mixture_temperature,
        "non_eos_penalty": args.non_eos_penalty,
        "penalty_reward_value": args.penalty_reward_value,
        "seed": args.seed,
    }


def load_or_build_mixture(args, accelerator, build) -> tuple:
    """offline_rl.py's labelled mixture: the cached one under --cache_dir when its recorded arguments (mixture_key)
    match, else build() -> (dataset, stats), the script's build_mixture, saved by the main process. Returns the
    dataset and its stats, with mixture/cache_hit."""
    key = mixture_key(args)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    folder = os.path.join(args.cache_dir, "mixture_" + digest[:16])
    meta_path = os.path.join(folder, "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        if meta["args"] == key:
            accelerator.print(f"[mixture] reusing {folder}")
            return load_from_disk(os.path.join(folder, "dataset")), {**meta["stats"], "mixture/cache_hit": 1}
        accelerator.print(f"[mixture] {folder} was built with other arguments; rebuilding it")
    dataset, stats = build()
    if accelerator.is_main_process:
        os.makedirs(folder, exist_ok=True)
        dataset.save_to_disk(os.path.join(folder, "dataset"))
        with open(meta_path, "w") as f:  # written last: its presence marks a complete cache
            json.dump({"args": key, "stats": stats}, f, indent=2)
    accelerator.wait_for_everyone()
    return dataset, {**stats, "mixture/cache_hit": 0}
