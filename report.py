"""The pipeline's results report (pipeline.py's `report` stage, and the readers ablate.py shares): one
Markdown table set plus plots, from the files the stages wrote.

Reads (never recomputes training): each run's `summary.json` and `samples*.csv`, the judge's
`judge_summary.json`, the reward model's calibration plot, the stage timings. Two numbers are computed
here because no single stage can: the KL of each policy from the SFT policy on that policy's own
evaluation samples, and the gold score along PPO training (the over-optimisation curve).
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import numpy as np
import pandas as pd

from data import synthetic
from judge import without_eos_text  # the text the judge reads: the same stripping for the gold win rate


def _load(path: str) -> dict:
    return json.load(open(path)) if os.path.exists(path) else {}


def missing_completion_mark(folder: str) -> str | None:
    """Why a training script's output folder is not complete, or None when it is. A run writes `"complete": true`
    into its output folder's run.json last, after the final model, so a folder without it holds a run that
    stopped before the end (or is still running)."""
    try:
        info = json.load(open(os.path.join(folder, "run.json")))
    except (OSError, ValueError):
        info = None
    if isinstance(info, dict) and info.get("complete") is True:
        return None
    why = "it has no readable run.json" if info is None else 'its run.json lacks "complete": true'
    return f"{folder} is incomplete: {why} (its run stopped before the end, or is still running)"


def check_outputs_complete(p) -> None:
    """Bad input: a report from an unfinished stage. Every folder the report reads must be complete: the task
    (task.json, written last by data/prepare.py) and the output folder of every training stage whose samples or
    summaries it reads. One error names the folder and the pipeline stage to rerun."""
    problems = []
    if not os.path.exists(os.path.join(p.data, "task.json")):
        problems.append(("prep", f"{p.data} is incomplete: it has no task.json (written last by data/prepare.py)"))
    stages = {label.split("_beta")[0] if label.startswith("ilql_beta") else label for label, _ in p.policies()}
    stages |= {stage for stage in ("rm", "dpo") if stage in p.stages}
    for stage in sorted(stages):
        problem = missing_completion_mark(os.path.join(p.models, stage))
        if problem:
            problems.append((stage, problem))
    if problems:
        stage, problem = problems[0]
        raise ValueError(f"report: {problem}; rerun that stage: python pipeline.py --force {stage}"
                         + (f" (incomplete too: {', '.join(s for s, _ in problems[1:])})" if len(problems) > 1 else ""))


def _fmt(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and np.isnan(x)):
        return "n/a"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _first(d: dict, *keys):
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return None


def sequence_logprobs(model_path: str, samples: pd.DataFrame, tokenizer, batch_size: int = 32) -> np.ndarray:
    """Sum of log pi(response | query) under the model at `model_path`, at temperature 1."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = []
    rows = list(samples.itertuples())
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        seqs, spans = [], []
        for r in batch:
            # a special token's spelling in the text is text, as data/prepare.py tokenized it (split_special_tokens)
            q = tokenizer.encode(r.query, split_special_tokens=True)
            resp = tokenizer.encode(r.response if str(r.response).startswith(" ") else " " + str(r.response),
                                    split_special_tokens=True)
            if bool(r.has_eos):
                resp = resp + [tokenizer.eos_token_id]
            seqs.append(q + resp)
            spans.append((len(q), len(q) + len(resp)))
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
        mask = torch.zeros((len(seqs), width), dtype=torch.bool)
        for i, s in enumerate(seqs):  # right padding, so positions are plain 0..n-1
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = True
        with torch.no_grad():
            logits = model(input_ids=ids.masked_fill(~mask, 0), attention_mask=mask).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        for i, (a, b) in enumerate(spans):
            out.append(logp[i, a - 1 : b - 1].sum().item())
    return np.array(out)


def kl_from_sft(p, label: str, samples_csv: str, tokenizer) -> float | None:
    """Mean of log pi(y|x) - log pi_sft(y|x) over the policy's evaluation samples (a sample estimate of
    KL(pi || pi_sft) at the evaluation temperature's samples; 0 for SFT itself)."""
    if label == "sft":
        return 0.0
    if label.startswith("ilql"):
        # the ILQL policy is the LM head shifted by beta x the Q heads' advantage; the LM head alone is not it
        return None
    if label == "offline_dt":
        # the Decision Transformer writes after a return-conditioned prompt (`<rm_score> ...`), not after the
        # plain query the SFT model reads: log-probabilities of the two on the plain query do not compare
        # (such an estimate can even come out negative)
        return None
    model_dir = os.path.join(p.models, label)
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        return None
    df = pd.read_csv(samples_csv, keep_default_na=False).head(128)
    return float(np.mean(sequence_logprobs(model_dir, df, tokenizer) - sequence_logprobs(os.path.join(p.models, "sft"), df, tokenizer)))


def gold_win(query: str, response: str, reference: str) -> float:
    """1 if the gold judge prefers the response to the reference in both A/B orders, 0 if in neither, half when
    it prefers it in one order only. As in judge.py, both texts lose an EOS spelling at their end first, and two
    identical texts are a tie: half a win."""
    response, reference = without_eos_text(response, synthetic.EOS_TEXT), without_eos_text(reference, synthetic.EOS_TEXT)
    if response == reference:
        return 0.5
    return 0.5 * (synthetic.gold_prefer(query, response, reference) == "A") + \
        0.5 * (synthetic.gold_prefer(query, reference, response) == "B")


def ppo_curve(p) -> pd.DataFrame:
    """RM score and gold win rate vs reference at every PPO evaluation (the over-optimisation curve). Update 0 is the
    SFT policy's samples of the same queries (sft.py scores none with the RM: its RM score is empty)."""
    rows = []
    evaluations = sorted(glob.glob(os.path.join(p.runs, "ppo", "samples", "step_*.csv")))
    sft = os.path.join(p.runs, "sft", "samples.csv")
    if evaluations and os.path.exists(sft) and \
            set(pd.read_csv(sft, keep_default_na=False)["query"]) == set(pd.read_csv(evaluations[0], keep_default_na=False)["query"]):
        evaluations.insert(0, sft)
    for path in evaluations:
        step = int(os.path.basename(path)[len("step_"):-len(".csv")]) if path != sft else 0
        df = pd.read_csv(path, keep_default_na=False)
        wins = [gold_win(q, r, ref) for q, r, ref in zip(df["query"], df["response"], df["reference"])]
        gold = [synthetic.gold_score(q, r) for q, r in zip(df["query"], df["response"])]
        rows.append({"step": step, "rm_score": pd.to_numeric(df["score"], errors="coerce").mean(),
                     "gold_win_rate": float(np.mean(wins)), "gold_score": float(np.mean(gold)),
                     "eos_rate": float(df["has_eos"].astype(str).str.lower().eq("true").mean())})
    return pd.DataFrame(rows)


def dt_targets(run_dir: str) -> pd.DataFrame:
    """The Decision Transformer's final samples at every target reward of its prompt (offline_rl.py writes
    samples_target_T.csv): mean RM score and gold win rate vs the reference per target, the seed's Table 1.
    `percentile` names the targets taken from the labelled mixture's own reward distribution."""
    summary = _load(os.path.join(run_dir, "summary.json"))
    at = {v: float(k.rsplit("_", 1)[1]) for k, v in summary.items() if k.startswith("dt/target_at_percentile_")}
    rows = []
    for path in glob.glob(os.path.join(run_dir, "samples_target_*.csv")):
        target = float(os.path.basename(path)[len("samples_target_"):-len(".csv")])
        df = pd.read_csv(path, keep_default_na=False)
        wins = [gold_win(q, r, ref) for q, r, ref in zip(df["query"], df["response"], df["reference"])]
        rows.append({"target": target, "percentile": at.get(target), "rm_score": pd.to_numeric(df["score"]).mean(),
                     "gold_win_rate": float(np.mean(wins)), "n": len(df)})
    return pd.DataFrame(rows).sort_values("target").reset_index(drop=True) if rows else pd.DataFrame()


def rm_and_gold_plot(frame: pd.DataFrame, x: str, xlabel: str, ylabel: str, title: str, report_dir: str, name: str) -> str:
    """The mean RM score (left axis) and the gold win rate (right axis, 0 to 1) of samples against `x`; returns the
    file name. A frame with `<column>_low` / `<column>_high` columns (several seeds, write_seed_report) also gets
    the band between them. Called by write_report and write_seed_report, which have chosen matplotlib's Agg backend."""
    import matplotlib.pyplot as plt

    fig, ax1 = plt.subplots(figsize=(6, 4))
    ax2 = ax1.twinx()
    for ax, column, style, color, label in ((ax1, "rm_score", "o-", "tab:orange", "RM score"),
                                            (ax2, "gold_win_rate", "s-", "tab:green", "gold win rate")):
        ax.plot(frame[x], frame[column], style, color=color, label=label)
        if f"{column}_low" in frame:
            ax.fill_between(frame[x], frame[f"{column}_low"], frame[f"{column}_high"], color=color, alpha=0.2,
                            label=f"{label}: range over seeds")
    # the RM axis spans at least 0 to 1 as the gold axis does, so that a change of 0.03 looks like one on either axis
    values = pd.concat([frame[c] for c in ("rm_score", "rm_score_low", "rm_score_high") if c in frame]).dropna().to_numpy()
    low, high = float(np.min(values, initial=0.0)), float(np.max(values, initial=1.0))
    margin = 0.05 * (high - low)  # a point beyond 0-1 is not drawn on the frame
    low, high = (low - margin if low < 0 else low), (high + margin if high > 1 else high)
    ax1.set(xlabel=xlabel, ylabel=ylabel, ylim=(low, high))
    ax2.set(ylabel="gold win rate vs reference", ylim=(0, 1))
    # the legend lives inside the axes, on the gold axis (drawn last, so nothing covers it); matplotlib's "best" spot
    # avoids only that axis's data, so the RM curves are copied onto it, invisible, in its 0-1 coordinates
    low, high = ax1.get_ylim()
    for column in ("rm_score", "rm_score_low", "rm_score_high"):
        if column in frame:
            ax2.plot(frame[x], (frame[column] - low) / (high - low), alpha=0)
    handles, labels = (sum(pair, []) for pair in zip(ax1.get_legend_handles_labels(), ax2.get_legend_handles_labels()))
    ax2.legend(handles, labels, loc="best", fontsize=8, framealpha=0.8)
    ax1.set_title(title)
    fig.tight_layout()
    fig.savefig(os.path.join(report_dir, name), dpi=100)
    plt.close(fig)
    return name


def write_report(p) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from transformers import AutoTokenizer

    check_outputs_complete(p)
    os.makedirs(p.report_dir, exist_ok=True)
    judge = _load(os.path.join(p.runs, "judge", "judge_summary.json"))
    per_csv = judge.get("per_csv", {})
    task = _load(os.path.join(p.data, "task.json"))
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(p.data, "base_model"))

    # 1. policies: gold win rate vs reference with its 95% CI, EOS rate, length, KL from SFT
    lines = ["## Policies on the built-in task", "",
             "Gold-judge win rate against the reference summaries (95% Wilson interval, through the OpenAI-compatible "
             "endpoint and `judge.py`), EOS rate and mean response length on the validation samples, and the KL from "
             "the SFT policy (mean log-ratio on the policy's own samples).", "",
             "| policy | gold win rate | 95% CI | n | invalid | EOS rate | mean length (tokens) | KL from SFT | mean RM score |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    policy_rows = []
    for label, samples_csv in p.policies():
        j = per_csv.get(label, {})
        df = pd.read_csv(samples_csv, keep_default_na=False)
        eos = float(df["has_eos"].astype(str).str.lower().eq("true").mean())
        length = float(pd.to_numeric(df["response_token_len"], errors="coerce").mean())
        score = pd.to_numeric(df["score"], errors="coerce").mean() if "score" in df else float("nan")
        kl = kl_from_sft(p, label, samples_csv, tokenizer)
        policy_rows.append({"policy": label, "win_rate": j.get("win_rate"), "ci_low": j.get("ci_low"), "n": j.get("n"),
                            "ci_high": j.get("ci_high"), "eos_rate": eos, "length": length, "kl": kl})
        ci = f"[{_fmt(j.get('ci_low'))}, {_fmt(j.get('ci_high'))}]" if j.get("ci_low") is not None else "n/a"
        lines.append(f"| {label} | {_fmt(j.get('win_rate'))} | {ci} | {j.get('n', 'n/a')} | {j.get('invalid', 'n/a')} | "
                     f"{_fmt(eos)} | {_fmt(length, 1)} | {_fmt(kl)} | {_fmt(float(score)) if not np.isnan(score) else 'n/a'} |")

    # 2. reward model accuracy vs the known ceiling, and DPO's implicit reward model (Detail 19)
    rm = _load(os.path.join(p.runs, "rm", "summary.json"))
    dpo = _load(os.path.join(p.runs, "dpo", "summary.json"))
    by_split = task.get("ceiling_by_split", {})
    lines += ["", "## Reward models (validation preference split)", "",
              "Accuracy against the raters' labels; the ceiling is the accuracy of the gold judge itself on those noisy "
              "labels (expected value from the known noise). batch10: policy pairs also compared in training; batch11: "
              "pairs never compared in training (Detail 6).", "",
              "| model | accuracy | 95% CI | batch10 | batch11 | ceiling (overall / batch10 / batch11) |",
              "| --- | --- | --- | --- | --- | --- |"]
    for name, summary in (("reward model (reward.py)", rm), ("DPO implicit reward (dpo.py)", dpo)):
        low, high = summary.get("eval/validation/accuracy_ci_low"), summary.get("eval/validation/accuracy_ci_high")
        ci = f"[{low:.3f}, {high:.3f}]" if low is not None and high is not None else "n/a"
        lines.append(f"| {name} | {_fmt(_first(summary, 'eval/validation/accuracy', 'eval/accuracy'))} | {ci} | "
                     f"{_fmt(summary.get('eval/validation/accuracy/batch/batch10'))} | "
                     f"{_fmt(summary.get('eval/validation/accuracy/batch/batch11'))} | {_fmt(task.get('ceiling'))} / "
                     f"{_fmt(by_split.get('validation_in_distribution'))} / {_fmt(by_split.get('validation_ood'))} |")
    # by rater confidence (Table 5's view): the ceiling at confidence c is 1 - the label-flip probability at c
    confidences = sorted({int(k.rsplit("/", 1)[1]) for k in rm if k.startswith("eval/validation/accuracy/confidence/")})
    if confidences:
        lines += ["", "| rater confidence | " + " | ".join(map(str, confidences)) + " |",
                  "| --- | " + " | ".join("---" for _ in confidences) + " |"]
        for name, summary in (("reward model", rm), ("DPO implicit reward", dpo)):
            lines.append(f"| {name} | " + " | ".join(_fmt(summary.get(f"eval/validation/accuracy/confidence/{c}"))
                                                    for c in confidences) + " |")
        lines.append("| ceiling | " + " | ".join(_fmt(1.0 - synthetic.flip_probability(c)) for c in confidences) + " |")

    # 3. wall time per stage
    lines += ["", "## Wall time per stage", "", "| stage | seconds |", "| --- | --- |"]
    total = 0.0
    for stage in p.stages:
        m = _load(p.marker(stage))
        if m:
            total += m["wall_time_s"]
            lines.append(f"| {stage} | {m['wall_time_s']:.0f} |")
    lines.append(f"| **total** | **{total:.0f}** |")

    # 4. plots
    plots = []
    if policy_rows:
        fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(policy_rows) + 2), 4.5))
        names = [r["policy"] for r in policy_rows]
        rates = [r["win_rate"] if r["win_rate"] is not None else np.nan for r in policy_rows]
        err = [[max(0.0, (r["win_rate"] or 0) - (r["ci_low"] or 0)) for r in policy_rows],
               [max(0.0, (r["ci_high"] or 0) - (r["win_rate"] or 0)) for r in policy_rows]]
        ax.bar(names, rates, yerr=err, capsize=4, color="tab:blue")
        ax.axhline(0.5, color="gray", ls="--", lw=1)
        ax.set(ylabel="gold win rate vs reference", ylim=(0, 1), title="Win rate per policy (Figure 1 in miniature)")
        ax.tick_params(axis="x", labelrotation=35)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
        fig.tight_layout()
        fig.savefig(os.path.join(p.report_dir, "win_rate_per_policy.png"), dpi=100)
        plt.close(fig)
        plots.append("win_rate_per_policy.png")
    curve = ppo_curve(p)
    if len(curve):
        curve.to_csv(os.path.join(p.report_dir, "ppo_overoptimisation.csv"), index=False)
        plots.append(rm_and_gold_plot(curve, "step", "PPO update", "mean RM score",
                                      "PPO: RM score and gold judge along training", p.report_dir, "ppo_rm_vs_gold.png"))
        lines += ["", "## PPO along training (over-optimisation check)", "", "| update | mean RM score | gold win rate | gold score | EOS rate |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r.step} | {_fmt(r.rm_score)} | {_fmt(r.gold_win_rate)} | {_fmt(r.gold_score)} | {_fmt(r.eos_rate)} |"
                  for r in curve.itertuples()]
    dt = dt_targets(os.path.join(p.runs, "offline_dt"))
    if len(dt):
        dt.to_csv(os.path.join(p.report_dir, "dt_targets.csv"), index=False)
        plots.append(rm_and_gold_plot(dt, "target", "target reward in the prompt (normalised units)",
                                      "mean RM score of the samples",
                                      "Decision Transformer: outcome against the target it is given", p.report_dir,
                                      "dt_targets.png"))
        lines += ["", "## Decision Transformer: outcome against the target in its prompt", "",
                  "Targets at percentiles of the labelled mixture's normalised rewards lie inside what the model saw in "
                  "training; the others are the seed's (Table 1).", "",
                  "| target | mixture percentile | mean RM score | gold win rate | n |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r.target:+.1f} | {'' if pd.isna(r.percentile) else f'{r.percentile:g}th'} | {_fmt(r.rm_score)} | "
                  f"{_fmt(r.gold_win_rate)} | {r.n} |" for r in dt.itertuples()]
    copies = {"length_controlled_win_rate.png": os.path.join(p.runs, "judge", "length_controlled_win_rate.png")}
    copies["rm_calibration.png"] = next(iter(glob.glob(os.path.join(p.runs, "rm", "*calibration*.png"))), "")
    for name, src in copies.items():
        if src and os.path.exists(src):
            shutil.copy(src, os.path.join(p.report_dir, name))
            plots.append(name)
    lines += ["", "## Plots", ""] + [f"- `{name}`" for name in plots]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(p.report_dir, "results.md"), "w") as f:
        f.write(text)
    with open(os.path.join(p.report_dir, "results.json"), "w") as f:
        json.dump({"policies": policy_rows, "rm": rm, "dpo": dpo, "ceiling": task.get("ceiling"), "plots": plots}, f, indent=2,
                  default=float)
    return text


# --------------------------------------------------------------------------------------------
# Readers shared with ablate.py (the detail ablations): one run's metrics and one sample table.
# --------------------------------------------------------------------------------------------
def read_jsonl(path: str) -> list[dict]:
    """The rows of a metrics.jsonl file, in order (an absent file gives no rows)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def samples_stats(samples_csv: str) -> dict:
    """EOS rate, mean response length (tokens, up to and including the EOS), gold win rate against the
    reference (a tie counts half, see gold_win) and mean gold score of one sample table (samples.csv of
    sft.py or ppo.py: query, response, reference, response_token_len, has_eos)."""
    df = pd.read_csv(samples_csv, keep_default_na=False)
    queries, responses, references = df["query"].astype(str), df["response"].astype(str), df["reference"].astype(str)
    return {
        "eos_rate": float(df["has_eos"].astype(str).str.lower().eq("true").mean()),
        "length": float(pd.to_numeric(df["response_token_len"], errors="coerce").mean()),
        "gold_win_rate": float(np.mean([gold_win(q, r, ref) for q, r, ref in zip(queries, responses, references)])),
        "gold_score": float(np.mean([synthetic.gold_score(q, r) for q, r in zip(queries, responses)])),
        "num_samples": int(len(df)),
    }


def mid_sentence_share(queries: list[str]) -> float:
    """Share of formatted queries (`... POST: {post}\\n\\nTL;DR:`) whose post does not end a sentence
    (".", "!" or "?"): the queries that truncation cut mid-sentence (Detail 2). Every post of the
    built-in task ends with a full stop, so an untruncated query never counts."""
    if not queries:
        return float("nan")
    cut = 0
    for query in queries:
        post = query.split("POST:", 1)[-1].rsplit("TL;DR:", 1)[0].strip()
        cut += not post.endswith((".", "!", "?"))
    return cut / len(queries)


# --------------------------------------------------------------------------------------------
# Several seeds (pipeline.py --seeds 1 2 3): every seed's own report, side by side.
# --------------------------------------------------------------------------------------------
def ppo_seed_band(out: str, seeds: list[int]) -> pd.DataFrame:
    """The PPO over-optimisation curves of every seed (`<out>/seed_<n>/report/ppo_overoptimisation.csv`, written by
    write_report) at the updates they share: mean, lowest and highest RM score and gold win rate. Empty unless at
    least two seeds have a curve."""
    curves = [pd.read_csv(path) for path in (os.path.join(out, f"seed_{seed}", "report", "ppo_overoptimisation.csv")
                                             for seed in seeds) if os.path.exists(path)]
    if len(curves) < 2:
        return pd.DataFrame()
    stacked = pd.concat(curves)
    shared = stacked.groupby("step").filter(lambda g: len(g) == len(curves))
    grouped = shared.groupby("step")[["rm_score", "gold_win_rate"]]
    band = grouped.mean()
    for column in ("rm_score", "gold_win_rate"):
        band[f"{column}_low"], band[f"{column}_high"] = grouped.min()[column], grouped.max()[column]
    band["num_seeds"] = len(curves)
    return band.reset_index()


def write_seed_report(out: str, seeds: list[int]) -> str:
    """`<out>/report/seeds.md` (+ .json and a plot) from `<out>/seed_<n>/report/results.json`: per policy the
    gold win rate of every seed, their mean and sample standard deviation; the same for the RM and DPO-as-RM
    validation accuracies. A seed whose report is missing is an error naming it (rerun the pipeline)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = {}
    for seed in seeds:
        path = os.path.join(out, f"seed_{seed}", "report", "results.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"seed {seed}: no report at {path}; run pipeline.py again to finish that seed")
        results[seed] = json.load(open(path))
    rows: dict[str, dict[int, float | None]] = {}
    for seed, res in results.items():
        for r in res["policies"]:
            rows.setdefault(f"{r['policy']} gold win rate", {})[seed] = r["win_rate"]
        for name, key in (("reward model accuracy", "rm"), ("DPO-as-RM accuracy", "dpo")):
            rows.setdefault(name, {})[seed] = _first(res.get(key) or {}, "eval/validation/accuracy", "eval/accuracy")
    ceilings = {res.get("ceiling") for res in results.values()}

    def stats(values: dict[int, float | None]) -> tuple[float, float]:
        xs = np.array([v for v in values.values() if v is not None], dtype=float)
        if len(xs) == 0:
            return float("nan"), float("nan")
        return float(xs.mean()), float(xs.std(ddof=1)) if len(xs) > 1 else float("nan")

    lines = ["## Seeds side by side", "",
             f"Seeds {', '.join(map(str, seeds))}: one task (data, tokenizer, base model), every training stage once per seed. "
             f"RM-accuracy ceiling: {', '.join(_fmt(c) for c in ceilings)}.", "",
             "| metric | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | std |",
             "| --- | " + " | ".join("---" for _ in seeds) + " | --- | --- |"]
    summary = {}
    for name, values in rows.items():
        mean, std = stats(values)
        summary[name] = {"per_seed": {str(s): values.get(s) for s in seeds}, "mean": mean, "std": std}
        lines.append(f"| {name} | " + " | ".join(_fmt(values.get(s)) for s in seeds) + f" | {_fmt(mean)} | {_fmt(std)} |")
    report_dir = os.path.join(out, "report")
    os.makedirs(report_dir, exist_ok=True)
    policies = [n for n in rows if n.endswith("gold win rate")]
    if policies:
        fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(policies) + 2), 4.5))
        for i, name in enumerate(policies):
            vals = [v for v in rows[name].values() if v is not None]
            ax.bar(i, np.mean(vals) if vals else np.nan, color="tab:blue", alpha=0.6)
            ax.plot([i] * len(vals), vals, "ko", ms=4)
        ax.axhline(0.5, color="gray", ls="--", lw=1)
        ax.set_xticks(range(len(policies)), [n.split(" ")[0] for n in policies], rotation=35, ha="right")
        ax.set(ylabel="gold win rate vs reference", ylim=(0, 1), title=f"Win rate per policy, seeds {seeds} (dots)")
        fig.tight_layout()
        fig.savefig(os.path.join(report_dir, "seeds_win_rate.png"), dpi=100)
        plt.close(fig)
        lines += ["", "Plot: `seeds_win_rate.png`"]
    band = ppo_seed_band(out, seeds)
    if len(band):
        band.to_csv(os.path.join(report_dir, "ppo_overoptimisation_seeds.csv"), index=False)
        name = rm_and_gold_plot(band, "step", "PPO update", "mean RM score",
                                f"PPO along training: mean and range of seeds {seeds}", report_dir,
                                "ppo_rm_vs_gold_seeds.png")
        lines += [f"Plot: `{name}` (the PPO curve of every seed: mean line, band from the lowest to the highest seed)"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(report_dir, "seeds.md"), "w") as f:
        f.write(text)
    with open(os.path.join(report_dir, "seeds.json"), "w") as f:
        json.dump({"seeds": seeds, "metrics": summary}, f, indent=2)
    return text


# --------------------------------------------------------------------------------------------
# The leaderboard (pipeline.py --mode leaderboard): every method on every seed, one table and one plot.
# --------------------------------------------------------------------------------------------
NAMES = {"sft": "SFT", "ppo": "PPO", "rloo": "RLOO", "grpo": "GRPO", "online_dpo": "online DPO (RM judge)", "dpo": "DPO",
         "ipo": "IPO", "kto": "KTO (pairs)", "kto_unpaired": "KTO (thumbs up / down)", "ilql": "ILQL",
         "offline_filter": "MLE with filtering", "offline_rwr": "RWR", "offline_dt": "Decision Transformer",
         "offline_best_of_n": "best-of-n"}
# the 97.5% quantile of Student's t by degrees of freedom (a two-sided 95% interval of a mean over few seeds)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def mean_and_t_interval(values: list[float]) -> tuple[float, float, float]:
    """The mean of a few seeds' values and its two-sided 95% t-interval (nan bounds for a single value)."""
    xs = np.array(values, dtype=float)
    if len(xs) < 2:
        return float(xs.mean()), float("nan"), float("nan")
    half = T975.get(len(xs) - 1, 1.96) * xs.std(ddof=1) / np.sqrt(len(xs))
    return float(xs.mean()), float(xs.mean() - half), float(xs.mean() + half)


def budget(kind: str, args: dict, summary: dict) -> str:
    """What a method spent, from its run's args.json and summary.json: sampled responses, prompts, pairs or
    examples, and optimizer updates."""
    def n(x):
        return f"{int(x):,}"

    def updates(x):
        return f"{int(x):,} update{'s' * (int(x) != 1)}"

    if kind == "sft":
        return f"{updates(summary.get('train/updates', 0))} on the reference summaries"
    if kind in ("ppo", "rloo", "grpo"):
        per = {"rloo": args.get("rloo_k", 2), "grpo": args.get("group_size", 4)}.get(kind, 1)
        episodes = args["total_episodes"]
        return (f"{n(episodes)} sampled responses ({n(episodes // per)} prompts x {per}), "
                f"{updates(episodes // args['total_batch_size'])}")
    if kind == "online_dpo":
        pairs = args["total_episodes"]
        return (f"{n(2 * pairs)} sampled responses ({n(pairs)} prompts x 2; pairs the judge cannot separate are "
                f"redrawn on top), {updates(pairs // args['total_batch_size'])}")
    if kind in ("dpo", "ipo"):
        pairs = args["total_episodes"]
        return f"{n(pairs)} preference pairs, {updates(pairs // args['total_batch_size'])}"
    if kind in ("kto", "kto_unpaired"):
        examples = args["total_episodes"]
        what = f"examples ({n(examples // 2)} pairs)" if kind == "kto" else "thumbs up / down"
        return f"{n(examples)} {what}, {updates(examples // args['total_batch_size'])}"
    if kind == "ilql":
        episodes = args["total_episodes"]
        return (f"{n(episodes)} RM-scored responses of the pairs, {updates(episodes // args['total_batch_size'])}, "
                f"beta {args.get('beta'):g}")
    if kind == "offline_best_of_n":
        return f"{n(args['n'] * args['bon_num_prompts'])} sampled responses ({n(args['bon_num_prompts'])} prompts x {args['n']})"
    if kind.startswith("offline_"):
        return (f"{n(args['mixture_size'])} SFT responses scored by the RM, {args.get('num_train_epochs', 1)} "
                f"pass{'es' * (args.get('num_train_epochs', 1) > 1)}")
    return ""


def write_leaderboard(out: str, seeds: list[int], pipelines: list) -> str:
    """`<out>/report/leaderboard.md` (+ .csv and leaderboard.png) from every seed's report (results.json), run
    (args.json, summary.json) and stage markers. One row a method: its budget, its gold win rate against the
    references per seed (95% Wilson interval) and over seeds (mean, 95% t-interval), the mean over seeds of its KL
    from SFT, length and EOS rate, its mean wall time and highest peak memory. The plot: gold win rate against KL
    from SFT, one point a method and seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = pipelines[0]
    rows = []
    for stage in [s for s in first.stages if s in first.policies_order()]:
        kind = first.kind(stage)
        label = first.judged_label(stage)
        per_seed, extra = {}, {"kl": [], "length": [], "eos_rate": [], "wall": [], "shared": [], "peak": []}
        for seed, p in zip(seeds, pipelines):
            res = _load(os.path.join(p.report_dir, "results.json"))
            row = next((r for r in res.get("policies", []) if r["policy"] == label), None)
            if row is None:
                raise ValueError(f"leaderboard: seed {seed} has no judged {label} in {p.report_dir}/results.json; run "
                                 f"pipeline.py again to finish that seed")
            per_seed[seed] = row
            for key in ("kl", "length", "eos_rate"):
                if row.get(key) is not None:
                    extra[key].append(row[key])
            marker = _load(p.marker(stage))
            extra["wall"].append(marker.get("wall_time_s"))
            extra["shared"].append(bool(marker.get("shared")))
            extra["peak"].append(marker.get("peak_rss_mib"))
        args = _load(os.path.join(first.runs, stage, "args.json"))
        summary = _load(os.path.join(first.runs, stage, "summary.json"))
        name = NAMES.get(stage, f"{stage} (fork of {kind}.py's stage {kind})" if stage in first.extras else stage)
        rows.append({"stage": stage, "method": name, "budget": budget(kind, args, summary), "per_seed": per_seed, **extra})

    def avg(xs):
        xs = [x for x in xs if x is not None]
        return float(np.mean(xs)) if xs else None

    n_samples = {r.get("n") for row in rows for r in row["per_seed"].values()} - {None}
    lines = ["## Leaderboard: every method on the built-in task", "",
             f"Seeds {', '.join(map(str, seeds))}; each seed trains its own SFT and reward model, and every method of "
             f"that seed starts from them. Gold win rate against the reference summaries on "
             f"{', '.join(map(str, sorted(n_samples))) or 'the'} validation samples per seed (95% Wilson interval), "
             f"and over seeds (mean, 95% t-interval). KL from SFT: the mean over the policy's first 128 evaluation "
             f"samples of log pi(y|x) - log pi_SFT(y|x), averaged over seeds; n/a for ILQL (its policy is the LM head "
             f"shifted by the Q heads' advantage, not one model's log-probs) and the Decision Transformer (it writes "
             f"after a return prompt, not the plain query). Wall time: the stage's mean over seeds, marked shared where "
             f"another job held a core as one of its runs started; peak memory: the stage process's highest resident "
             f"set over seeds.", "",
             "| method | budget | " + " | ".join(f"seed {s}" for s in seeds) +
             " | mean [95% t-interval] | KL from SFT | mean length | EOS rate | wall time (s) | peak memory (MiB) |",
             "| --- | --- | " + " | ".join("---" for _ in seeds) + " | --- | --- | --- | --- | --- | --- |"]
    table = []
    for row in rows:
        rates = [row["per_seed"][s]["win_rate"] for s in seeds]
        mean, low, high = mean_and_t_interval(rates)
        cells = [f"{_fmt(r['win_rate'])} [{_fmt(r['ci_low'])}, {_fmt(r['ci_high'])}]"
                 for r in (row["per_seed"][s] for s in seeds)]
        interval = f" [{_fmt(low)}, {_fmt(high)}]" if not np.isnan(low) else ""
        kl, wall = avg(row["kl"]), avg(row["wall"])
        peak = max((x for x in row["peak"] if x is not None), default=None)
        lines.append(f"| {row['method']} | {row['budget']} | " + " | ".join(cells) + f" | {_fmt(mean)}{interval} | "
                     f"{_fmt(kl) if kl is not None else 'n/a'} | {_fmt(avg(row['length']), 1)} | "
                     f"{_fmt(avg(row['eos_rate']), 2)} | {f'{wall:.0f}' if wall is not None else 'n/a'}"
                     f"{' (shared)' if any(row['shared']) else ''} | "
                     f"{f'{peak:.0f}' if peak is not None else 'n/a'} |")
        table.append({"stage": row["stage"], "method": row["method"], "budget": row["budget"],
                      **{f"seed_{s}": r for s, r in zip(seeds, rates)}, "mean": mean, "t_low": low, "t_high": high,
                      "kl_from_sft": kl, "length": avg(row["length"]), "eos_rate": avg(row["eos_rate"]),
                      "wall_time_s": wall, "wall_time_shared": any(row["shared"]), "peak_rss_mib": peak})
    report_dir = os.path.join(out, "report")
    os.makedirs(report_dir, exist_ok=True)
    pd.DataFrame(table).to_csv(os.path.join(report_dir, "leaderboard.csv"), index=False)

    fig, ax = plt.subplots(figsize=(7, 5))
    markers, no_kl = "osD^v<>pP*Xdh8H", []
    for i, row in enumerate(rows):
        points = [(r["kl"], r["win_rate"]) for r in (row["per_seed"][s] for s in seeds) if r.get("kl") is not None]
        if not points:
            no_kl.append(row["method"])
            continue
        xs, ys = zip(*points)
        ax.scatter(xs, ys, marker=markers[i % len(markers)], s=40, label=row["method"], alpha=0.8)
    ax.axhline(0.5, color="gray", ls="--", lw=1)
    ax.set(xlabel="KL from SFT (nats, on the policy's own samples)", ylabel="gold win rate vs reference", ylim=(0, 1),
           title=f"Gold win rate against KL from SFT, seeds {seeds} (one point a seed)")
    if no_kl:
        ax.text(0.99, 0.02, f"no KL, not drawn: {', '.join(no_kl)}", transform=ax.transAxes, ha="right", fontsize=7)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(os.path.join(report_dir, "leaderboard.png"), dpi=100)
    plt.close(fig)
    lines += ["", "Plot: `leaderboard.png` (gold win rate against KL from SFT, one point a method and seed); the table as "
              "CSV: `leaderboard.csv`."]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(report_dir, "leaderboard.md"), "w") as f:
        f.write(text)
    return text
