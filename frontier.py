"""The over-optimisation frontier (pipeline.py --mode frontier): each method's gold and proxy reward against the KL it
has moved from the SFT policy, along its training, beside best-of-n on the SFT policy.

Gao et al. (2023, "Scaling laws for reward model overoptimization") draw a method as a curve, not a point: the gold
score it reaches per nat of KL(pi || pi_SFT), and where the proxy (the reward model it optimises) keeps rising while
the gold score turns down. The built-in task's gold judge (data/synthetic.py) makes that curve cheap to draw.

What it measures, per seed: every run the frontier trains (PPO, RLOO, GRPO, online DPO, DPO) saves its policy at 7
points of its updates (POINTS: 0, 1/16, 1/8, 1/4, 1/2, 3/4 and all, rounded to whole updates; dense early, where the
KL moves fastest), each with the digest of its weights and the budget spent by then (--save_policy_at). Here each
snapshot is loaded, its digest checked against the recorded one, and evaluated on the task's test prompts: one
response per prompt sampled at temperature 1 (report.py's response_kl, its generator seeded with the pipeline's seed,
so every point and method of a seed draws from the same random stream), and on those same samples, as Gao et al. do:

  - the gold judge's win rate against the reference summary and its mean gold score,
  - the mean proxy score (the seed's reward model, read at the EOS as reward.py's get_reward reads it; the raw score,
    without PPO's EOS-trick penalty or any whitening),
  - KL(pi || pi_SFT) at temperature 1, report.py's estimator (the per-token KL over the whole vocabulary summed over
    the response up to its EOS),

each with its standard error over prompts. Best-of-n on the SFT policy (n = 1, 2, ..., 32): 32 candidates per prompt
sampled at temperature 1 (candidate 1 is the SFT policy's own evaluation sample: the same generator seed), the reward
model picks the best of the first n, the gold judge scores it. Its KL is the analytic bound log n - (n - 1) / n
(Stiennon et al. 2020, appendix; Gao et al. use it too), an upper bound on the true KL of the best-of-n policy, not a
measurement.

The report (write_frontier, <out>/report/): frontier_points.csv (every seed, method and point) and frontier_runs.json
(CPU types, commit, wall times), and drawn from those two alone frontier.md (the tables) and frontier.png (the figure):
`python frontier.py <folder>` redraws them, e.g. from the copies committed under docs/.

This file is glue, as report.py: it reads what the runs saved and decides nothing any run trains with. Training is
not touched by the evaluation (it runs afterwards, on saved snapshots); tests/test_frontier.py checks that a run
saving 7 snapshots ends with the weights of one that saves none.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pandas as pd
from scipy import stats

from data import synthetic
from report import _fmt, _load, gold_win, holm, made_with, mean_and_t_interval, paired_test, response_kl
from rlhf_utils.provenance import provenance

# the fractions of a run's updates evaluated (rounded to whole updates: point_updates)
POINTS = (0.0, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 1.0)
BEST_OF_N = (1, 2, 4, 8, 16, 32)
MATCHED_KL = (0.25, 0.5, 1.0)  # nats: the KL levels the table compares methods at
BATCH = 32  # prompts per forward pass
NAMES = {"ppo": "PPO", "rloo": "RLOO", "grpo": "GRPO", "online_dpo": "online DPO", "dpo": "DPO",
         "best_of_n": "best-of-n (SFT)", "sft": "SFT"}


def point_updates(num_updates: int) -> list[int]:
    """The updates a run of `num_updates` is evaluated after: each fraction of POINTS times num_updates, rounded half
    up to a whole update (0 is the starting policy), without repeats (a run of few updates has fewer points)."""
    return sorted({int(math.floor(f * num_updates + 0.5)) for f in POINTS})


def best_of_n_kl_bound(n: int) -> float:
    """The analytic KL(best-of-n || pi) bound, log n - (n - 1) / n nats: 0 at n = 1 (the policy's own sample)."""
    return math.log(n) - (n - 1) / n


def candidate_seed(seed: int, j: int) -> int:
    """The generator seed of best-of-n's candidate j (from 0): candidate 0 is drawn as every evaluation is, with the
    pipeline's seed, so n = 1 is the SFT policy's own evaluation sample."""
    return seed + 1_000_003 * j


# ----------------------------------------------------------------------------------------------------------------------
# Evaluation of one policy: gold, proxy and KL on the same temperature-1 samples
# ----------------------------------------------------------------------------------------------------------------------
def proxy_scores(reward_model, queries, responses, pad_id: int):
    """The reward model's raw score of each left-padded query and its response (pads after the first EOS), read at
    the response's last token before its first [PAD] (Detail 12), by reward.py's get_reward."""
    import torch

    from reward import get_reward

    scores = []
    with torch.no_grad():
        for start in range(0, queries.size(0), BATCH):
            rows = torch.cat([queries[start : start + BATCH], responses[start : start + BATCH]], dim=1)
            scores.append(get_reward(reward_model, rows, pad_id, queries.size(1))[1].double())
    return torch.cat(scores).numpy()


def response_texts(tokenizer, responses) -> list[str]:
    """The responses as the judge reads them: [PAD]s dropped and special tokens skipped (as the scripts' samples)."""
    return [tokenizer.decode([t for t in row.tolist() if t != tokenizer.pad_token_id], skip_special_tokens=True)
            for row in responses]


def mean_and_se(values) -> tuple[float, float]:
    xs = np.asarray(values, dtype=float)
    return float(xs.mean()), float(xs.std(ddof=1) / np.sqrt(len(xs))) if len(xs) > 1 else float("nan")


def gold_stats(prefix: str, prompts: dict, texts: list[str]) -> dict:
    """{prefix}gold_win_rate, {prefix}gold_score and their standard errors (_se) of responses `texts` to `prompts`."""
    wins = [gold_win(q, r, ref) for q, r, ref in zip(prompts["texts"], texts, prompts["references"])]
    gold = [synthetic.gold_score(q, r) for q, r in zip(prompts["texts"], texts)]
    (win, win_se), (score, score_se) = mean_and_se(wins), mean_and_se(gold)
    return {f"{prefix}gold_win_rate": win, f"{prefix}gold_win_rate_se": win_se, f"{prefix}gold_score": score,
            f"{prefix}gold_score_se": score_se}


def evaluate_policy(policy, sft, reward_model, tokenizer, prompts: dict, response_length: int, seed: int) -> dict:
    """Gold win rate, gold score, proxy score and KL(pi || pi_SFT), each a mean over the prompts with its standard
    error, of one response per prompt sampled from `policy` at temperature 1 with a generator seeded `seed`."""
    import torch

    kl, responses = response_kl(policy, sft, prompts["ids"], tokenizer.pad_token_id, tokenizer.eos_token_id,
                                response_length, torch.Generator().manual_seed(seed))
    proxy = proxy_scores(reward_model, prompts["ids"], responses, tokenizer.pad_token_id)
    (kl_mean, kl_se), (proxy_mean, proxy_se) = mean_and_se(kl), mean_and_se(proxy)
    return {**gold_stats("", prompts, response_texts(tokenizer, responses)), "proxy_score": proxy_mean,
            "proxy_score_se": proxy_se, "kl": kl_mean, "kl_se": kl_se, "prompts": len(kl)}


def best_of_n(sft, reward_model, tokenizer, prompts: dict, response_length: int, seed: int) -> list[dict]:
    """Best-of-n on the SFT policy for every n of BEST_OF_N: max(BEST_OF_N) candidates per prompt at temperature 1
    (candidate_seed), the reward model's pick among the first n, its gold and proxy scores; KL: the bound."""
    import torch

    candidates, scores = [], []
    for j in range(max(BEST_OF_N)):
        _, responses = response_kl(sft, None, prompts["ids"], tokenizer.pad_token_id, tokenizer.eos_token_id,
                                   response_length, torch.Generator().manual_seed(candidate_seed(seed, j)))
        candidates.append(response_texts(tokenizer, responses))
        scores.append(proxy_scores(reward_model, prompts["ids"], responses, tokenizer.pad_token_id))
    scores = np.stack(scores, 1)  # (prompts, candidates)
    rows = []
    for n in BEST_OF_N:
        pick = scores[:, :n].argmax(1)  # the first of equal scores
        texts = [candidates[j][i] for i, j in enumerate(pick)]
        proxy, proxy_se = mean_and_se(scores[np.arange(len(pick)), pick])
        rows.append({"n": n, **gold_stats("", prompts, texts), "proxy_score": proxy, "proxy_score_se": proxy_se,
                     "kl": best_of_n_kl_bound(n), "kl_se": 0.0, "kl_is_bound": True, "prompts": len(pick)})
    return rows


def eval_prompts(data_dir: str, count: int, tokenizer) -> dict:
    """The first `count` prompts of the task's test split: their left-padded ids, texts and reference summaries."""
    import torch
    from datasets import load_from_disk

    split = load_from_disk(os.path.join(data_dir, "sft"))["test"]
    split = split.select(range(min(count, len(split))))
    ids = torch.tensor(split["query_token"], dtype=torch.long)
    texts = [tokenizer.decode(q[q != tokenizer.pad_token_id], skip_special_tokens=True) for q in ids]
    return {"ids": ids, "texts": texts, "references": list(split["reference_response"])}


def loaded_snapshot(folder: str):
    """The policy saved in a snapshot folder, its weights checked against the digest recorded when it was saved
    (snapshot.json): a folder holding other weights is an error naming it, never evaluated."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_utils.models import weights_digest

    record = _load(os.path.join(folder, "snapshot.json"))
    if "digest" not in record:
        raise ValueError(f"frontier: {folder} has no snapshot.json with its weights' digest; rerun its stage "
                         f"(python pipeline.py --mode frontier --force <stage>)")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    digest = weights_digest(model.state_dict())
    if digest != record["digest"]:
        raise ValueError(f"frontier: the weights in {folder} (sha256 {digest[:12]}) are not the ones saved after "
                         f"update {record['update']} (sha256 {record['digest'][:12]}); rerun its stage")
    return model, record


def evaluate_seed(p, stages: list[str], prompt_count: int) -> dict:
    """Every snapshot of the frontier's runs of one seed (Pipeline p), the SFT policy and best-of-n: the rows of
    <runs>/frontier/points.json. An evaluation is cached by its weights' digest (<runs>/frontier/cache/), so a rerun
    skips the points already evaluated, and point 0 of every run (the SFT policy's weights) is evaluated once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_utils.models import weights_digest

    seed, response_length = p.args.seed, p.response_length
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(p.models, "sft"))
    prompts = eval_prompts(p.data, prompt_count, tokenizer)
    sft = AutoModelForCausalLM.from_pretrained(os.path.join(p.models, "sft"), dtype=torch.float32).eval()
    reward_model = AutoModelForSequenceClassification.from_pretrained(os.path.join(p.models, "rm"), num_labels=1,
                                                                      dtype=torch.float32).eval()
    cache_dir = os.path.join(p.runs, "frontier", "cache")
    os.makedirs(cache_dir, exist_ok=True)
    sft_digest = weights_digest(sft.state_dict())
    # an evaluation's inputs besides the policy: the SFT policy (KL), the reward model (proxy), seed, prompts, length
    inputs = f"{sft_digest[:16]}_{weights_digest(reward_model.state_dict())[:16]}_{seed}_{len(prompts['ids'])}_" \
             f"{response_length}"

    def evaluated(model, digest: str) -> dict:
        path = os.path.join(cache_dir, f"{digest}_{inputs}.json")
        if not os.path.exists(path):
            result = evaluate_policy(model, sft, reward_model, tokenizer, prompts, response_length, seed)
            json.dump(result, open(path + ".tmp", "w"))
            os.replace(path + ".tmp", path)
        return json.load(open(path))

    rows = [{"seed": seed, "method": "sft", "stage": "sft", "update": 0, "num_updates": 0, "fraction": 0.0,
             "digest": sft_digest, **evaluated(sft, sft_digest)}]
    for stage in stages:
        flags = p.flags(stage)
        updates = [int(u) for u in flags[flags.index("--save_policy_at") + 1:]]  # the pipeline appends it last
        for update in updates:
            model, record = loaded_snapshot(os.path.join(p.models, stage, "snapshots", f"update_{update:06d}"))
            counters = {key: value for key, value in record.items() if key.startswith("budget/")}
            rows.append({"seed": seed, "method": p.kind(stage), "stage": stage, "update": update,
                         "num_updates": record["num_updates"], "fraction": update / record["num_updates"],
                         "digest": record["digest"], **counters, **evaluated(model, record["digest"])})
            if update == updates[-1] and record["digest"] != weights_digest(
                    AutoModelForCausalLM.from_pretrained(os.path.join(p.models, stage)).state_dict()):
                raise ValueError(f"frontier: the last snapshot of {stage} is not its final model; rerun the stage "
                                 f"(python pipeline.py --mode {p.args.mode} --force {stage})")
            print(f"=== [frontier] seed {seed} {stage} update {update}/{record['num_updates']}: KL "
                  f"{rows[-1]['kl']:.3f}, gold win rate {rows[-1]['gold_win_rate']:.3f}, proxy "
                  f"{rows[-1]['proxy_score']:.3f}", flush=True)
    path = os.path.join(cache_dir, f"best_of_n_{inputs}.json")
    if not os.path.exists(path):
        json.dump(best_of_n(sft, reward_model, tokenizer, prompts, response_length, seed), open(path + ".tmp", "w"))
        os.replace(path + ".tmp", path)
    rows += [{"seed": seed, "method": "best_of_n", "stage": "sft", "update": 0, "num_updates": 0, "fraction": 0.0,
              "digest": sft_digest, **row} for row in json.load(open(path))]
    result = {"seed": seed, "prompts": len(prompts["ids"]), "response_length": response_length, "rows": rows}
    json.dump(result, open(os.path.join(p.runs, "frontier", "points.json"), "w"), indent=1)
    return result


# ----------------------------------------------------------------------------------------------------------------------
# The statistics: matched-KL interpolation, paired differences to PPO, the peak and the last point
# ----------------------------------------------------------------------------------------------------------------------
def at_kl(kls: list[float], values: list[float], level: float) -> float | None:
    """The value of a run's curve, in update order, where its KL first reaches `level`: linear in KL between the two
    points around that crossing (the point itself where one lies on it); None where the run never reaches it."""
    for i in range(len(kls)):
        if kls[i] == level:
            return float(values[i])
        if i and kls[i - 1] < level < kls[i]:
            share = (level - kls[i - 1]) / (kls[i] - kls[i - 1])
            return float(values[i - 1] + share * (values[i] - values[i - 1]))
    return None


def matched_kl_table(frame: pd.DataFrame, seeds: list[int], methods: list[str], alpha: float = 0.05) -> list[dict]:
    """Per method and MATCHED_KL level: the gold win rate interpolated per seed (at_kl) and, against PPO, the paired
    differences over the seeds where both reached the level, with Holm's correction across the whole family (every
    method and level with at least two paired seeds)."""
    rows = []
    for method in methods:
        for level in MATCHED_KL:
            per_seed = {}
            for seed in seeds:
                run = frame[(frame.seed == seed) & (frame.method == method)].sort_values("update")
                per_seed[seed] = at_kl(list(run.kl), list(run.gold_win_rate), level) if len(run) else None
            rows.append({"method": method, "kl_level": level, "per_seed": per_seed,
                         "reached": sum(v is not None for v in per_seed.values())})
    ppo = {row["kl_level"]: row["per_seed"] for row in rows if row["method"] == "ppo"}
    for row in rows:
        if row["method"] != "ppo":
            both = [s for s in seeds if row["per_seed"][s] is not None and ppo[row["kl_level"]][s] is not None]
            row["test"] = paired_test([row["per_seed"][s] - ppo[row["kl_level"]][s] for s in both], alpha)
    family = [row for row in rows if "test" in row and not np.isnan(row["test"]["p"])]
    for row, (p_holm, level) in zip(family, zip(*holm([row["test"]["p"] for row in family], alpha))):
        test = row["test"]
        half = stats.t.ppf(1.0 - level / 2.0, len(test["diffs"]) - 1) * test["se"]
        test.update(p_holm=p_holm, holm_low=test["mean"] - half, holm_high=test["mean"] + half)
    return rows


def peak_and_last(frame: pd.DataFrame, seeds: list[int], method: str) -> dict:
    """The point of a method's highest mean gold score over seeds, and the paired (over seeds) differences between
    it and the run's last point in gold score and in proxy score. Over-optimisation shows where the gold difference's
    t-interval lies above 0 (the last point is worse) while the proxy score rose over the same stretch (its mean
    difference, last minus peak, is positive)."""
    runs = frame[frame.method == method]
    means = runs.groupby("fraction")[["gold_score", "proxy_score", "kl"]].mean().sort_index()
    peak, last = float(means.gold_score.idxmax()), float(means.index.max())

    def at(fraction, column):
        return [float(runs[(runs.seed == s) & (runs.fraction == fraction)][column].iloc[0]) for s in seeds]

    gold = paired_test([a - b for a, b in zip(at(peak, "gold_score"), at(last, "gold_score"))])
    proxy = paired_test([b - a for a, b in zip(at(peak, "proxy_score"), at(last, "proxy_score"))])
    shows = peak != last and not np.isnan(gold["low"]) and gold["low"] > 0 and proxy["mean"] > 0
    return {"method": method, "peak_fraction": peak, "peak_kl": float(means.kl[peak]), "last_kl": float(means.kl[last]),
            "peak_gold": float(means.gold_score[peak]), "last_gold": float(means.gold_score[last]), "gold": gold,
            "proxy_rise": proxy, "shows": bool(shows)}


# ----------------------------------------------------------------------------------------------------------------------
# The report: frontier_points.csv, frontier.png, frontier.md
# ----------------------------------------------------------------------------------------------------------------------
def frontier_frame(seeds: list[int], pipelines: list) -> pd.DataFrame:
    rows = []
    for seed, p in zip(seeds, pipelines):
        record = _load(os.path.join(p.runs, "frontier", "points.json"))
        if not record:
            raise ValueError(f"frontier: seed {seed} has no {os.path.join(p.runs, 'frontier', 'points.json')}; run "
                             f"pipeline.py --mode frontier again to finish that seed")
        rows += record["rows"]
    return pd.DataFrame(rows)


def name_line_ends(ax, ends: list[tuple[float, float, str, str]], points: float = 8.0) -> None:
    """Write each line's name (x, y, name, colour of its end) just right of its end, moved up or down to the nearest
    height where it overlaps no name already written and stays inside the panel (a thin line then joins it to its
    end), and widen the panel until every name fits in it."""
    import matplotlib.text

    figure, mine = ax.figure, []
    for _ in range(6):
        for text in mine:
            text.remove()
        figure.canvas.draw()
        renderer, placed, mine = figure.canvas.get_renderer(), [], []
        frame = ax.get_window_extent(renderer)
        for x, y, name, colour in sorted(ends, key=lambda end: -end[1]):
            for step in range(61):  # the nearest free height: 0, up one step, down one, up two, ...
                lift = 0.6 * points * ((step + 1) // 2) * (1 if step % 2 else -1)
                text = ax.annotate(name, (x, y), xytext=(4, lift), textcoords="offset points", color=colour,
                                   fontsize=points, va="center",
                                   arrowprops={"arrowstyle": "-", "color": colour, "lw": 0.6} if lift else None)
                text.update_positions(renderer)
                box = matplotlib.text.Text.get_window_extent(text, renderer)  # the words, not the joining line
                if box.y0 >= frame.y0 and box.y1 <= frame.y1 and not any(box.overlaps(b) for b in placed):
                    break
                text.remove()
            else:  # no free height inside the panel: its own height, overlapping (the test of the figure says so)
                text = ax.annotate(name, (x, y), xytext=(4, 0), textcoords="offset points", color=colour,
                                   fontsize=points, va="center")
                text.update_positions(renderer)
                box = matplotlib.text.Text.get_window_extent(text, renderer)
            placed.append(box)
            mine.append(text)
        over = max(b.x1 for b in placed) - frame.x1 + 4
        if over <= 0:
            return
        left, right = ax.get_xlim()
        ax.set_xlim(left, right + 1.2 * over / frame.width * (right - left))


def frontier_plot(frame: pd.DataFrame, seeds: list[int], methods: list[str]):
    """Gold score and proxy score against KL and against sqrt(KL): one line a method (the mean over seeds at each
    point, a band of one standard error of the seeds' spread), best-of-n as its own line at its KL bound, every line
    named at its end. Returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = dict(zip([*methods, "best_of_n"], plt.get_cmap("tab10").colors))  # one colour each, none repeated
    figure, axes = plt.subplots(2, 2, figsize=(12, 9))
    line_ends = []
    for row, (x_of, x_label) in enumerate([(lambda kl: kl, "KL(pi || pi_SFT) (nats)"),
                                           (np.sqrt, "sqrt(KL(pi || pi_SFT)) (sqrt nats)")]):
        for column, (y, y_label) in enumerate([("gold_score", "gold score (gold judge, points)"),
                                               ("proxy_score", "proxy score (reward model, logit)")]):
            ax, ends = axes[row][column], []
            for method in [*methods, "best_of_n"]:
                runs = frame[frame.method == method]
                key = "n" if method == "best_of_n" else "fraction"
                grouped = runs.groupby(key)[["kl", y]]
                mean, spread = grouped.mean().sort_index(), grouped.std(ddof=1).sort_index() / np.sqrt(len(seeds))
                x = x_of(np.clip(mean.kl.to_numpy(), 0, None))
                order = np.argsort(x, kind="stable")
                style = "--" if method == "best_of_n" else "-"
                ax.plot(x, mean[y], style, marker="o", ms=3, color=colours[method], label=NAMES[method])
                if len(seeds) > 1:
                    ax.fill_between(x[order], (mean[y] - spread[y]).to_numpy()[order],
                                    (mean[y] + spread[y]).to_numpy()[order], color=colours[method], alpha=0.15)
                ends.append((x[-1], mean[y].iloc[-1], NAMES[method] + (" (KL: bound)" if method == "best_of_n" else ""),
                             colours[method]))
            ax.set_xlabel(x_label)
            ax.set_ylabel(y_label)
            ax.grid(alpha=0.3)
            line_ends.append((ax, ends))
    figure.suptitle(f"Gold and proxy score against KL from SFT (seeds {', '.join(map(str, seeds))}; band: one "
                    "standard error over seeds)")
    figure.tight_layout()  # the panels' places, before the names go in (name_line_ends keeps them inside)
    for ax, ends in line_ends:
        name_line_ends(ax, ends)
    return figure


def interval_cell(test: dict, holm_corrected: bool = False) -> str:
    low, high = (test.get("holm_low"), test.get("holm_high")) if holm_corrected else (test["low"], test["high"])
    if low is None or np.isnan(low):
        return f"{test['mean']:+.3f}" if test["diffs"] else "n/a"
    return f"{test['mean']:+.3f} [{low:+.3f}, {high:+.3f}]"


def stage_walls(pipelines: list) -> dict[str, list]:
    """Each stage's wall time per seed from its marker; a stage the seeds share (prep) has one marker, so its time
    counts for the first seed only (None for the rest), and the report's total counts it once."""
    markers = {stage: [p.marker(stage) for p in pipelines] for stage in pipelines[0].stages}
    return {stage: [_load(m).get("wall_time_s") if m not in ms[:i] else None for i, m in enumerate(ms)]
            for stage, ms in markers.items()}


def write_frontier(out: str, seeds: list[int], pipelines: list) -> str:
    """<out>/report/: frontier_points.csv (every seed's points.json) and frontier_runs.json (the CPU types, the commit
    and every stage's wall time), then frontier.md and frontier.png drawn from those two alone (draw_frontier)."""
    report_dir = os.path.join(out, "report")
    os.makedirs(report_dir, exist_ok=True)
    frontier_frame(seeds, pipelines).to_csv(os.path.join(report_dir, "frontier_points.csv"), index=False)
    cpus = sorted({_load(os.path.join(folder, "cpu.json")).get("cpu") or "not recorded"
                   for folder in [out, *(p.base for p in pipelines)]})
    runs = {"made_with": made_with(provenance()), "cpus": cpus, "seeds": seeds, "wall_time_s": stage_walls(pipelines)}
    json.dump(runs, open(os.path.join(report_dir, "frontier_runs.json"), "w"), indent=1)
    return draw_frontier(report_dir)


def draw_frontier(report_dir: str) -> str:
    """frontier.md and frontier.png in `report_dir` from its frontier_points.csv and frontier_runs.json (as
    write_frontier leaves them, or as committed under docs/): `python frontier.py <folder>` redraws them."""
    frame = pd.read_csv(os.path.join(report_dir, "frontier_points.csv"))
    runs = json.load(open(os.path.join(report_dir, "frontier_runs.json")))
    seeds, cpus = runs["seeds"], runs["cpus"]
    methods = list(dict.fromkeys(m for m in frame.method if m not in ("sft", "best_of_n")))  # the pipeline's order
    figure = frontier_plot(frame, seeds, methods)
    figure.savefig(os.path.join(report_dir, "frontier.png"), dpi=120)
    sys.modules["matplotlib.pyplot"].close(figure)  # frontier_plot imported it
    matched = matched_kl_table(frame, seeds, methods)
    total = sum(w for ws in runs["wall_time_s"].values() for w in ws if w is not None)
    prompts = int(frame.prompts.iloc[0])
    lines = [runs["made_with"], "", "## The over-optimisation frontier", "",
             f"CPU type of every stage: {' and '.join(cpus)}. Seeds {', '.join(map(str, seeds))}; each seed trains its "
             f"own SFT and reward model, and every method of that seed starts from them. Each run is evaluated at 7 "
             f"points of its updates (0, 1/16, 1/8, 1/4, 1/2, 3/4, all; rounded to whole updates) on {prompts} test "
             f"prompts, one response each sampled at temperature 1: the gold win rate against the references, the "
             f"mean gold score, the mean proxy (reward model) score, and KL(pi || pi_SFT) at temperature 1 on those "
             f"same samples (report.py's estimator). Best-of-n samples n candidates per prompt from the SFT policy "
             f"at temperature 1; its KL is the analytic bound log n - (n - 1) / n, an upper bound, not a measurement. "
             f"Wall time of all stages and seeds: {total / 60:.0f} min.", "",
             "### Gold win rate at matched KL", "",
             "Each seed's curve interpolated linearly in KL where it first reaches the level (mean over seeds and "
             "95% t-interval); a level some seed never reaches says how many did. Against PPO: the per-seed paired "
             "difference over the seeds where both reached it, with the Holm-corrected interval across the table's "
             "whole family.", "",
             "| method | " + " | ".join(f"KL {level:g}" for level in MATCHED_KL) + " | " +
             " | ".join(f"- PPO at KL {level:g} (Holm)" for level in MATCHED_KL) + " |",
             "| --- | " + " | ".join("---" for _ in MATCHED_KL * 2) + " |"]
    better = []
    for method in methods:
        cells, diffs = [], []
        for row in [r for r in matched if r["method"] == method]:
            values = [v for v in row["per_seed"].values() if v is not None]
            if row["reached"] < len(seeds):
                cells.append(f"reached by {row['reached']} of {len(seeds)} seeds" +
                             (f" ({_fmt(np.mean(values))})" if values else ""))
            else:
                mean, low, high = mean_and_t_interval(values)
                cells.append(_fmt(mean) + (f" [{_fmt(low)}, {_fmt(high)}]" if not np.isnan(low) else ""))
            test = row.get("test")
            diffs.append("-" if test is None else interval_cell(test, holm_corrected=True))
            if test is not None and test.get("holm_low") is not None and test["holm_low"] > 0:
                better.append(f"{NAMES[method]} at KL {row['kl_level']:g}")
        lines.append(f"| {NAMES[method]} | " + " | ".join(cells) + " | " + " | ".join(diffs) + " |")
    lines += ["", "### Over-optimisation: the best point and the last", "",
              "The point of highest mean gold score over seeds, and the per-seed paired difference (95% t-interval) "
              "between it and the run's last point: over-optimisation shows where that interval lies above 0 while "
              "the proxy score rose over the same stretch.", "",
              "| method | best point (share of updates) | KL there | gold score there | KL at the end | gold score at "
              "the end | best - end, gold | end - best, proxy | shows |", "| --- | --- | --- | --- | --- | --- | --- | "
              "--- | --- |"]
    shown = []
    for method in methods:
        peak = peak_and_last(frame, seeds, method)
        shown += [NAMES[method]] if peak["shows"] else []
        lines.append(f"| {NAMES[method]} | {peak['peak_fraction']:.3g} | {_fmt(peak['peak_kl'])} | "
                     f"{_fmt(peak['peak_gold'])} | {_fmt(peak['last_kl'])} | {_fmt(peak['last_gold'])} | "
                     f"{interval_cell(peak['gold'])} | {interval_cell(peak['proxy_rise'])} | "
                     f"{'yes' if peak['shows'] else 'no'} |")
    bon = frame[frame.method == "best_of_n"].groupby("n")[["kl", "gold_win_rate", "gold_score", "proxy_score"]].mean()
    lines += ["", "### Best-of-n on the SFT policy (means over seeds)", "",
              "| n | KL bound (nats) | gold win rate | gold score | proxy score |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {int(n)} | {_fmt(r.kl)} | {_fmt(r.gold_win_rate)} | {_fmt(r.gold_score)} | {_fmt(r.proxy_score)} |"
              for n, r in bon.iterrows()]
    lines += ["", "In one sentence: " + (
        f"more gold win rate per nat than PPO under the paired, Holm-corrected test: {'; '.join(better)}. "
        if better else "the paired, Holm-corrected test finds no method with more gold win rate than PPO at any "
                       "matched KL. ") + (
        f"Over-optimisation (the proxy rising while gold falls) shows within the budget for {', '.join(shown)}."
        if shown else "Over-optimisation (the proxy rising while gold falls) shows for no method within the budget."),
        "", "![frontier](frontier.png)", ""]
    text = "\n".join(lines)
    open(os.path.join(report_dir, "frontier.md"), "w").write(text)
    return text


if __name__ == "__main__":
    if len(sys.argv) != 2 or not os.path.exists(os.path.join(sys.argv[1], "frontier_points.csv")):
        sys.exit("usage: python frontier.py <folder>: redraws frontier.md and frontier.png from the folder's "
                 "frontier_points.csv and frontier_runs.json (pipeline.py --mode frontier writes them in <out>/report)")
    print(draw_frontier(sys.argv[1]))
