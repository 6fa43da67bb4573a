"""The pipeline's results report (pipeline.py's `report` stage, and the readers ablate.py shares): one
Markdown table set plus plots, from the files the stages wrote.

Reads (never recomputes training): each run's `summary.json` and `samples*.csv`, the judge's
`judge_summary.json`, the reward model's calibration plot, the stage timings. Two numbers are computed
here because no single stage can: the KL of each policy from the SFT policy (KL(pi || pi_SFT) of the two
models' own distributions at temperature 1, on responses the policy samples at temperature 1 from its
evaluation prompts), and the gold score along PPO training (the over-optimisation curve). The leaderboard's
statistics over seeds (t-intervals, paired differences with Holm's correction) are here too.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import numpy as np
import pandas as pd
from scipy import stats
from statsmodels.stats.multitest import multipletests

from data import synthetic
from judge import without_eos_text  # the text the judge reads: the same stripping for the gold win rate
from rlhf_utils.provenance import provenance, provenance_line


def _load(path: str) -> dict:
    return json.load(open(path)) if os.path.exists(path) else {}


def _marker(path: str) -> dict:
    """A stage marker; {} when absent or unreadable (cut by a full disk: pipeline.py says so and reruns the stage)."""
    try:
        marker = json.load(open(path))
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def _saved(path: str, content) -> None:
    """`content` (a text, or a function that writes the file it is given) written to `path` whole or not at all
    (write_whole: a temporary file renamed into place), so a full report folder leaves no cut or empty file under a
    finished name and stops with one paragraph naming the folder."""
    from rlhf_utils.run import write_whole

    write_whole(path, content, f"the report's {os.path.basename(path)}", "Free space there and run the same "
                "pipeline.py command again: its finished stages are skipped and the report is written anew")


def made_with(record: dict) -> str:
    """A report's first line: what produced it (package versions, Python, CPU, commit; rlhf_utils/provenance.py)."""
    return f"Made with {provenance_line(record)}."


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


# --------------------------------------------------------------------------------------------
# KL from SFT: KL(pi || pi_SFT) of the two models' own distributions at temperature 1
# --------------------------------------------------------------------------------------------
# stage kinds whose policy is not one causal LM reading the plain query: their KL is n/a, for this reason
NO_KL = {
    "ilql": "ILQL's policy is its LM head shifted by beta times the Q heads' advantage, not the distribution of one "
            "causal LM",
    "offline_dt": "the Decision Transformer writes after a return-conditioned prompt, not after the plain query the "
                  "SFT model reads",
}
KL_BATCH = 32  # prompts per forward pass


def masked_logprobs(model, sequences, pad_id: int, start: int, stop: int):
    """log pi(. | prefix) at columns start..stop-1 of `sequences` (left-padded query + response, right-padded
    after an EOS), the distribution of the token in the next column, at temperature 1 and in float64. Pads are
    masked out and positions count real tokens only (as the training scripts' forward does), and [PAD] is never
    an action: its logit is -inf before the softmax (as their action_logprobs)."""
    import torch

    real = sequences != pad_id
    positions = real.long().cumsum(1) - real.long()
    logits = model(input_ids=sequences.masked_fill(~real, 0), attention_mask=real, position_ids=positions).logits
    logits = logits[:, start:stop].double()
    logits[..., pad_id] = float("-inf")
    return torch.log_softmax(logits, dim=-1)


def position_kl(logp, logq):
    """KL(p || q) over the last (vocabulary) axis, from log-probabilities: the sum of p * (log p - log q) over
    every token p gives a chance (a token with p = 0, such as [PAD], adds nothing)."""
    import torch

    p = logp.exp()
    return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)


def sample_with_cache(model, query, pad_id: int, eos_id: int, response_length: int, generator):
    """`response_length` tokens after each left-padded query, drawn from the model at temperature 1 with [PAD]
    never drawn and no stop at EOS (as the scripts' sampling), one token a forward through the key/value cache.
    Positions count real tokens only, as in masked_logprobs. Once every row holds an EOS the rest is [PAD]: what
    follows an EOS is cut anyway."""
    import torch

    real = (query != pad_id).long()
    output = model(input_ids=query.masked_fill(real == 0, 0), attention_mask=real,
                   position_ids=real.cumsum(1) - real, use_cache=True)
    response = torch.full((query.size(0), response_length), pad_id, dtype=query.dtype)
    mask, position = real, real.sum(1, keepdim=True)
    for step in range(response_length):
        logits = output.logits[:, -1].double()
        logits[:, pad_id] = float("-inf")
        token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        response[:, step] = token[:, 0]
        if step + 1 == response_length or (response == eos_id).any(1).all():
            break
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        output = model(input_ids=token, attention_mask=mask, position_ids=position,
                       past_key_values=output.past_key_values, use_cache=True)
        position = position + 1
    return response


def response_kl(policy, reference, queries, pad_id: int, eos_id: int, response_length: int, generator,
                batch_size: int = KL_BATCH):
    """One response per query sampled from `policy` at temperature 1 (`response_length` tokens, [PAD] never drawn,
    drawn with `generator` alone), and per query the sum over its response positions, up to and including the first
    EOS, of KL(policy(.|prefix) || reference(.|prefix)) over the whole vocabulary. The distributions of the KL come
    from one full forward of each model on the finished rows (masked_logprobs), not from the sampling's cache.
    `queries` (N, Tq) are left-padded token ids. Returns the N sums (float64 numpy; None with reference None: the
    samples alone) and the sampled responses (N, response_length; pads after the first EOS)."""
    import torch

    sums, responses = [], []
    with torch.no_grad():
        for start in range(0, queries.size(0), batch_size):
            query = queries[start : start + batch_size]
            real = (query != pad_id).any(0).nonzero()
            query = query[:, int(real[0]):] if real.numel() else query  # padding every row shares is cut
            width = query.size(1)
            response = sample_with_cache(policy, query, pad_id, eos_id, response_length, generator)
            # the response ends at its first EOS: what follows is padding, neither sampled nor counted
            ended = (response == eos_id).long().cumsum(1)
            after_eos = (ended - (response == eos_id).long()) > 0
            response = response.masked_fill(after_eos, pad_id)
            sequence = torch.cat([query, response], dim=1)
            responses.append(response)
            if reference is None:
                continue
            stop = sequence.size(1) - 1
            kl = position_kl(masked_logprobs(policy, sequence, pad_id, width - 1, stop),
                             masked_logprobs(reference, sequence, pad_id, width - 1, stop))
            sums.append((kl * ~after_eos).sum(1))
    return (torch.cat(sums).numpy() if reference is not None else None), torch.cat(responses)


def kl_prompts(p, stage: str, count: int, samples_csv: str, tokenizer):
    """The prompts and response length of a stage's evaluation, read from its run's args.json: the first `count`
    rows of `query_token` in its eval split (left-padded ids, as the scripts sample them). Their decoded texts must
    be the queries of `samples_csv`, so that the column reads the very prompts the win rate does."""
    import torch
    from datasets import load_dataset, load_from_disk

    args = _load(os.path.join(p.runs, stage, "args.json"))
    path, split = args.get("query_dataset"), args.get("eval_split", "validation")
    if path is None or "response_length" not in args:
        raise ValueError(f"report: {os.path.join(p.runs, stage, 'args.json')} does not say the evaluation's prompts "
                         f"(query_dataset, eval_split, response_length); rerun that stage: python pipeline.py --force "
                         f"{stage}")
    data = load_from_disk(path)[split] if os.path.isdir(path) else load_dataset(path, split=split)
    queries = torch.tensor(data.select(range(min(count, len(data))))["query_token"], dtype=torch.long)
    texts = list(pd.read_csv(samples_csv, keep_default_na=False)["query"].astype(str))
    for i, query in enumerate(queries):
        if tokenizer.decode(query[query != tokenizer.pad_token_id], skip_special_tokens=True) != texts[i]:
            raise ValueError(f"report: row {i} of {samples_csv} is not the query of row {i} of {path} split {split!r}, "
                             f"which {stage}'s args.json names as its evaluation prompts")
    return queries, int(args["response_length"])


def eval_split_of(p, label: str) -> str:
    """The split of the task's SFT data whose prompts a policy's samples answer: its run's --eval_split (args.json;
    the scripts' default, validation, where it names none). The leaderboard's is test, every other mode's validation."""
    stage = "ilql" if label.startswith("ilql_beta") else label
    return _load(os.path.join(p.runs, stage, "args.json")).get("eval_split", "validation")


def kl_from_sft(p, label: str, samples_csv: str, tokenizer) -> dict:
    """KL(pi || pi_SFT) of a policy: per evaluation prompt (the same prompts, count and response length as its
    evaluation) one response sampled from the policy at temperature 1, the KL of the two models' next-token
    distributions summed over the vocabulary and over the response (up to and including its first EOS), averaged
    over the prompts. Returns {"kl", "kl_se" (its standard error over prompts), "kl_n" (prompts), "kl_note" (why
    there is none)}. The sampling has a generator of its own, seeded with the pipeline's seed, so the column is
    reproducible and every policy of a seed draws from the same random stream. n/a, with the reason, for the stage
    kinds in NO_KL (ILQL, the Decision Transformer, and any --extra fork of them)."""
    import torch
    from transformers import AutoModelForCausalLM

    stage = "ilql" if label.startswith("ilql_beta") else label
    kind = p.kind(stage) if hasattr(p, "kind") else stage
    none = {"kl": None, "kl_se": None, "kl_n": 0}
    if kind in NO_KL:
        return {**none, "kl_note": NO_KL[kind]}
    model_dir = os.path.join(p.models, stage)
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        return {**none, "kl_note": f"no model in {model_dir}"}
    count = len(pd.read_csv(samples_csv, keep_default_na=False))
    queries, response_length = kl_prompts(p, stage, count, samples_csv, tokenizer)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(os.path.join(p.models, "sft"), dtype=torch.float32).eval()
    seed = getattr(getattr(p, "args", None), "seed", 0)
    sums, _ = response_kl(policy, reference, queries, tokenizer.pad_token_id, tokenizer.eos_token_id, response_length,
                          torch.Generator().manual_seed(seed))
    se = float(sums.std(ddof=1) / np.sqrt(len(sums))) if len(sums) > 1 else None
    return {"kl": float(sums.mean()), "kl_se": se, "kl_n": len(sums), "kl_note": None}


def kl_cell(kl, se) -> str:
    """A KL with its standard error in parentheses, n/a without a KL."""
    if kl is None:
        return "n/a"
    return _fmt(kl) + (f" ({_fmt(se)})" if se is not None else "")


def gold_win(query: str, response: str, reference: str) -> float:
    """1 if the gold judge prefers the response to the reference in both A/B orders, 0 if in neither, half when
    it prefers it in one order only. As in judge.py, both texts lose an EOS spelling at their end first, and two
    identical texts are a tie: half a win."""
    response, reference = (without_eos_text(response, synthetic.EOS_TEXT),
                           without_eos_text(reference, synthetic.EOS_TEXT))
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
            set(pd.read_csv(sft, keep_default_na=False)["query"]) == \
            set(pd.read_csv(evaluations[0], keep_default_na=False)["query"]):
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


def rm_and_gold_plot(frame: pd.DataFrame, x: str, xlabel: str, ylabel: str, title: str, report_dir: str,
                     name: str) -> str:
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
    values = pd.concat([frame[c] for c in ("rm_score", "rm_score_low", "rm_score_high")
                        if c in frame]).dropna().to_numpy()
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
    _saved(os.path.join(report_dir, name), lambda temporary: fig.savefig(temporary, dpi=100))
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
    splits = " and ".join(sorted({eval_split_of(p, label) for label, _ in p.policies()})) or "validation"
    made = provenance()
    lines = [made_with(made), "", "## Policies on the built-in task", "",
             "Gold-judge win rate against the reference summaries (95% Wilson interval, through the OpenAI-compatible "
             f"endpoint and `judge.py`), EOS rate and mean response length on the {splits} samples (all drawn at the "
             "evaluation temperature, 0.01), and the KL from the SFT policy: KL(pi || pi_SFT) of the two models' own "
             "distributions at temperature 1, on one response per evaluation prompt sampled from the policy at "
             "temperature 1 (the per-token KL summed over the vocabulary and over the response up to its EOS, the "
             "mean over prompts, nats, with its standard error).", "",
             "| policy | gold win rate | 95% CI | n | invalid | EOS rate | mean length (tokens) | KL from SFT (SE) "
             "| mean RM score |",
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
                            "ci_high": j.get("ci_high"), "eos_rate": eos, "length": length, **kl,
                            "eval_split": eval_split_of(p, label)})
        ci = f"[{_fmt(j.get('ci_low'))}, {_fmt(j.get('ci_high'))}]" if j.get("ci_low") is not None else "n/a"
        lines.append(f"| {label} | {_fmt(j.get('win_rate'))} | {ci} | {j.get('n', 'n/a')} | "
                     f"{j.get('invalid', 'n/a')} | {_fmt(eos)} | {_fmt(length, 1)} | "
                     f"{kl_cell(kl['kl'], kl['kl_se'])} | {_fmt(float(score)) if not np.isnan(score) else 'n/a'} |")
    notes = {row["policy"]: row["kl_note"] for row in policy_rows if row["kl_note"]}
    if notes:
        lines += ["", "KL from SFT n/a: " + "; ".join(f"{label}: {why}" for label, why in notes.items()) + "."]

    # 2. reward model accuracy vs the known ceiling, and DPO's implicit reward model (Detail 19)
    rm = _load(os.path.join(p.runs, "rm", "summary.json"))
    dpo = _load(os.path.join(p.runs, "dpo", "summary.json"))
    by_split = task.get("ceiling_by_split", {})
    lines += ["", "## Reward models (validation preference split)", "",
              "Accuracy against the raters' labels; the ceiling is the accuracy of the gold judge itself on those "
              "noisy labels (expected value from the known noise). batch10: policy pairs also compared in training; "
              "batch11: pairs never compared in training (Detail 6).", "",
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
        m = _marker(p.marker(stage))
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
        _saved(os.path.join(p.report_dir, "win_rate_per_policy.png"), lambda temporary: fig.savefig(temporary, dpi=100))
        plt.close(fig)
        plots.append("win_rate_per_policy.png")
    curve = ppo_curve(p)
    if len(curve):
        _saved(os.path.join(p.report_dir, "ppo_overoptimisation.csv"), curve.to_csv(index=False))
        plots.append(rm_and_gold_plot(curve, "step", "PPO update", "mean RM score",
                                      "PPO: RM score and gold judge along training", p.report_dir,
                                      "ppo_rm_vs_gold.png"))
        lines += ["", "## PPO along training (over-optimisation check)", "",
                  "| update | mean RM score | gold win rate | gold score | EOS rate |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r.step} | {_fmt(r.rm_score)} | {_fmt(r.gold_win_rate)} | {_fmt(r.gold_score)} | "
                  f"{_fmt(r.eos_rate)} |"
                  for r in curve.itertuples()]
    dt = dt_targets(os.path.join(p.runs, "offline_dt"))
    if len(dt):
        _saved(os.path.join(p.report_dir, "dt_targets.csv"), dt.to_csv(index=False))
        plots.append(rm_and_gold_plot(dt, "target", "target reward in the prompt (normalised units)",
                                      "mean RM score of the samples",
                                      "Decision Transformer: outcome against the target it is given", p.report_dir,
                                      "dt_targets.png"))
        lines += ["", "## Decision Transformer: outcome against the target in its prompt", "",
                  "Targets at percentiles of the labelled mixture's normalised rewards lie inside what the model saw "
                  "in training; the others are the seed's (Table 1).", "",
                  "| target | mixture percentile | mean RM score | gold win rate | n |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r.target:+.1f} | {'' if pd.isna(r.percentile) else f'{r.percentile:g}th'} | "
                  f"{_fmt(r.rm_score)} | {_fmt(r.gold_win_rate)} | {r.n} |" for r in dt.itertuples()]
    copies = {"length_controlled_win_rate.png": os.path.join(p.runs, "judge", "length_controlled_win_rate.png")}
    copies["rm_calibration.png"] = next(iter(glob.glob(os.path.join(p.runs, "rm", "*calibration*.png"))), "")
    for name, src in copies.items():
        if src and os.path.exists(src):
            _saved(os.path.join(p.report_dir, name), lambda temporary, src=src: shutil.copy(src, temporary))
            plots.append(name)
    lines += ["", "## Plots", ""] + [f"- `{name}`" for name in plots]
    text = "\n".join(lines) + "\n"
    _saved(os.path.join(p.report_dir, "results.md"), text)
    _saved(os.path.join(p.report_dir, "results.json"), json.dumps(
        {"policies": policy_rows, "rm": rm, "dpo": dpo, "ceiling": task.get("ceiling"), "plots": plots,
         "provenance": made}, indent=2,
        default=float))
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

    made = provenance()
    lines = [made_with(made), "", "## Seeds side by side", "",
             f"Seeds {', '.join(map(str, seeds))}: one task (data, tokenizer, base model), "
             "every training stage once per seed. "
             f"RM-accuracy ceiling: {', '.join(_fmt(c) for c in ceilings)}.", "",
             "| metric | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | std |",
             "| --- | " + " | ".join("---" for _ in seeds) + " | --- | --- |"]
    summary = {}
    for name, values in rows.items():
        mean, std = stats(values)
        summary[name] = {"per_seed": {str(s): values.get(s) for s in seeds}, "mean": mean, "std": std}
        lines.append(f"| {name} | " + " | ".join(_fmt(values.get(s)) for s in seeds)
                     + f" | {_fmt(mean)} | {_fmt(std)} |")
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
        _saved(os.path.join(report_dir, "seeds_win_rate.png"), lambda temporary: fig.savefig(temporary, dpi=100))
        plt.close(fig)
        lines += ["", "Plot: `seeds_win_rate.png`"]
    band = ppo_seed_band(out, seeds)
    if len(band):
        _saved(os.path.join(report_dir, "ppo_overoptimisation_seeds.csv"), band.to_csv(index=False))
        name = rm_and_gold_plot(band, "step", "PPO update", "mean RM score",
                                f"PPO along training: mean and range of seeds {seeds}", report_dir,
                                "ppo_rm_vs_gold_seeds.png")
        lines += [f"Plot: `{name}` (the PPO curve of every seed: mean line, band from the lowest to the highest seed)"]
    text = "\n".join(lines) + "\n"
    _saved(os.path.join(report_dir, "seeds.md"), text)
    _saved(os.path.join(report_dir, "seeds.json"),
           json.dumps({"seeds": seeds, "metrics": summary, "provenance": made}, indent=2))
    return text


# --------------------------------------------------------------------------------------------
# The leaderboard (pipeline.py --mode leaderboard): every method on every seed, one table and one plot.
# --------------------------------------------------------------------------------------------
NAMES = {"sft": "SFT", "ppo": "PPO", "rloo": "RLOO", "grpo": "GRPO", "grpo_rule": "GRPO (rule reward)",
         "reinforce_pp": "REINFORCE++", "reinforce_pp_baseline": "REINFORCE++-baseline",
         "online_dpo": "online DPO (RM judge)", "dpo": "DPO",
         "ipo": "IPO", "kto": "KTO (pairs)", "kto_unpaired": "KTO (thumbs up / down)", "ilql": "ILQL",
         "offline_filter": "MLE with filtering", "offline_rwr": "RWR", "offline_dt": "Decision Transformer",
         "offline_best_of_n": "best-of-n"}


def mean_and_t_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """The mean of a few seeds' values and its two-sided t-interval at `level` (the t quantile of n - 1 degrees of
    freedom, whatever n is; nan bounds for a single value)."""
    xs = np.array(values, dtype=float)
    if len(xs) < 2:
        return float(xs.mean()), float("nan"), float("nan")
    half = stats.t.ppf(0.5 + level / 2.0, len(xs) - 1) * xs.std(ddof=1) / np.sqrt(len(xs))
    return float(xs.mean()), float(xs.mean() - half), float(xs.mean() + half)


def holm(p_values: list[float], alpha: float = 0.05) -> tuple[list[float], list[float]]:
    """Holm's step-down correction of m tests (statsmodels' multipletests): sorted by p-value, the test of rank r
    (from 1) is rejected at alpha / (m - r + 1) as long as every test before it was. Returns, in the input order, the
    adjusted p-values (rejected exactly where <= alpha) and the significance level each test is judged at: its own
    step's for a rejected test, and the level of the step where the procedure stopped for the others. A confidence
    interval at 1 - that level excludes the null value exactly where Holm rejects (the "corrected interval")."""
    if not p_values:
        return [], []
    m = len(p_values)
    rejected, adjusted, _, _ = multipletests(p_values, alpha=alpha, method="holm")
    kept = m - int(rejected.sum())  # the procedure stopped at the step of rank m - kept + 1 (every rejection before)
    rank = {i: r for r, i in enumerate(sorted(range(m), key=lambda i: p_values[i]))}
    levels = [alpha / (m - rank[i]) if rejected[i] else alpha / kept for i in range(m)]
    return [float(a) for a in adjusted], levels


def paired_test(diffs: list[float], alpha: float = 0.05) -> dict:
    """A paired t-test of per-seed differences: their mean, its (1 - alpha) t-interval (low, high), the two-sided
    p-value and the standard error (se); nan for all but the mean with fewer than two differences (and for the mean
    too with none)."""
    xs = np.array(diffs, dtype=float)
    test = {"diffs": xs.tolist(), "mean": float(xs.mean()) if len(xs) else float("nan"), "low": float("nan"),
            "high": float("nan"), "p": float("nan"), "se": float("nan")}
    if len(xs) >= 2:
        test["se"] = se = float(xs.std(ddof=1) / np.sqrt(len(xs)))
        _, test["low"], test["high"] = mean_and_t_interval(xs, 1.0 - alpha)
        if se == 0.0:  # every seed the same difference: certain when it is not 0
            test["p"] = 0.0 if test["mean"] != 0.0 else 1.0
        else:
            test["p"] = float(2.0 * stats.t.sf(abs(test["mean"]) / se, len(xs) - 1))
    return test


def paired_comparisons(rates: dict[str, list[float]], baselines: tuple[str, ...] = ("ppo", "dpo", "sft"),
                       alpha: float = 0.05) -> list[dict]:
    """Every method against every baseline present (not itself): the per-seed differences in gold win rate (the
    seeds pair them: one SFT, reward model and prompts per seed for every method), their mean with a paired
    (1 - alpha) t-interval over seeds and its p-value, and Holm's correction across all these comparisons. `rates`
    maps a stage to its win rates in seed order; the family Holm corrects across is the distinct pairs compared
    (both ways of one pair are one test). A comparison `beats` ("yes" / "no") only where its Holm-corrected interval
    lies above 0; "n/a" with fewer than two seeds."""
    out = []
    for method, mine in rates.items():
        for baseline in baselines:
            if baseline == method or baseline not in rates:
                continue
            test = paired_test(list(np.array(mine, dtype=float) - np.array(rates[baseline], dtype=float)), alpha)
            out.append({"method": method, "baseline": baseline, **test, "p_holm": float("nan"),
                        "holm_level": float("nan"), "holm_low": float("nan"), "holm_high": float("nan"),
                        "beats": "n/a"})
    # a pair compared both ways (PPO against DPO and DPO against PPO) is one test of the family, not two
    pairs = {}
    for row in out:
        if not np.isnan(row["p"]):
            pairs.setdefault(frozenset((row["method"], row["baseline"])), row["p"])
    adjusted, levels = holm(list(pairs.values()), alpha)
    by_pair = dict(zip(pairs, zip(adjusted, levels)))
    for row in out:
        se = row.pop("se")
        if np.isnan(row["p"]):
            continue
        p_holm, level = by_pair[frozenset((row["method"], row["baseline"]))]
        half = stats.t.ppf(1.0 - level / 2.0, len(row["diffs"]) - 1) * se
        row.update(p_holm=p_holm, holm_level=level, holm_low=row["mean"] - half, holm_high=row["mean"] + half,
                   beats="yes" if row["mean"] - half > 0 else "no")
    return out


def distinct_pairs(comparisons: list[dict]) -> int:
    """How many tests Holm's family of paired_comparisons holds (a pair compared both ways counts once)."""
    return len({frozenset((c["method"], c["baseline"])) for c in comparisons if not np.isnan(c["p"])})


def budget(kind: str, args: dict, summary: dict) -> str:
    """What a method spent, from the counters its run logged in summary.json (budget/*: the responses it sampled and
    the prompts they answer, the preference pairs or rows it read, its optimizer updates), never from the settings
    meant to produce them: a run that sampled more than its flags asked (online DPO's --max_draws_per_round > 1)
    shows what it sampled. args.json gives only what is no budget (ILQL's beta). A summary without the counters (a
    run older than them) gives a note that says so."""
    def n(key: str) -> str:
        return f"{int(summary[key]):,}"

    def ratio(numerator: str, denominator: str) -> str:  # 4, 2.5, 0.99: the counters' own quotient
        return f"{summary[numerator] / summary[denominator]:.2f}".rstrip("0").rstrip(".")

    try:
        updates = f"{n('budget/updates')} update{'s' * (int(summary['budget/updates']) != 1)}"
        if kind == "sft":
            return f"{n('budget/rows_read')} reference summaries read, {updates}"
        if kind in ("ppo", "rloo", "grpo", "grpo_rule", "reinforce_pp", "reinforce_pp_baseline", "online_dpo",
                    "offline_best_of_n"):
            per = ratio("budget/responses_sampled", "budget/prompts")
            # online DPO: the sampled pairs it did not train on (the judge could not separate them, or a redraw's spare)
            untrained = summary.get("online/pairs_total", 0) - summary.get("online/pairs_trained_total", 0)
            dropped = f"; {untrained:,} pairs dropped" if untrained else ""
            return (f"{n('budget/responses_sampled')} sampled responses "
                    f"({n('budget/prompts')} prompts x {per}{dropped}), {updates}")
        if kind in ("dpo", "ipo"):
            return f"{n('budget/pairs_read')} preference pairs, {updates}"
        if kind == "kto":
            return f"{n('budget/rows_read')} examples ({n('budget/pairs_read')} pairs), {updates}"
        if kind == "kto_unpaired":
            return f"{n('budget/rows_read')} thumbs up / down, {updates}"
        if kind == "ilql":
            return f"{n('budget/rows_read')} RM-scored responses of the pairs, {updates}, beta {args.get('beta'):g}"
        if kind.startswith("offline_"):
            passes = ratio("budget/rows_read", "mixture/size")
            return (f"{n('mixture/size')} SFT responses scored by the RM, {passes} pass{'es' * (passes != '1')}, "
                    f"{updates}")
    except KeyError as missing:
        return f"unknown: summary.json has no {missing.args[0]} (a run older than the budget counters)"
    return ""


def draw_leaderboard(table: pd.DataFrame, paired: pd.DataFrame, reference: str = "ppo"):
    """leaderboard.png's figure from leaderboard.csv and leaderboard_paired.csv (so that the committed tables redraw
    it: `python report.py <folder>`). Three panels side by side, one row a method, sorted by mean gold win rate (the
    best on top), the methods named on the axis: the mean over seeds with its 95% t-interval and every seed's value;
    the paired difference to `reference` (PPO) with its Holm-corrected interval and a line at 0; the KL from SFT
    with its standard error (none drawn where the table says n/a)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = table.sort_values("mean", kind="stable").reset_index(drop=True)  # row 0 at the bottom: the best on top
    seeds = [c for c in table.columns if c.startswith("seed_")]
    y = np.arange(len(rows))
    fig, (rate_ax, diff_ax, kl_ax) = plt.subplots(1, 3, figsize=(12, 1.6 + 0.34 * len(rows)), sharey=True,
                                                  gridspec_kw={"width_ratios": [3, 2.4, 2]})
    values = rows[seeds].to_numpy(dtype=float)
    rate_ax.plot(values.ravel(), np.repeat(y, len(seeds)), "o", ms=3.5, color="0.6", ls="none",
                 label=f"one seed ({len(seeds)} a method)")
    low, high = rows.t_low.fillna(rows["mean"]), rows.t_high.fillna(rows["mean"])
    rate_ax.errorbar(rows["mean"], y, xerr=[rows["mean"] - low, high - rows["mean"]], fmt="D", ms=5, color="C0",
                     capsize=3, label="mean, 95% t-interval")
    rate_ax.axvline(0.5, color="0.4", ls=":", lw=1)
    span = [min(np.nanmin(values), low.min()), max(np.nanmax(values), high.max())]
    margin = 0.05 * (span[1] - span[0] or 1.0)
    rate_ax.set(yticks=y, yticklabels=rows.method, xlim=(max(0.0, span[0] - margin), min(1.0, span[1] + margin)),
                xlabel="gold win rate vs the references (share of prompts)", title="gold win rate (dotted: 0.5)")

    name = NAMES.get(reference, reference)
    diffs = paired[paired.baseline == reference].set_index("method") if len(paired) else pd.DataFrame(
        columns=["beats", "holm_low"])
    tested = [(i, diffs.loc[stage]) for i, stage in enumerate(rows.stage)
              if stage in diffs.index and not np.isnan(diffs.loc[stage, "holm_low"])]
    for marker, colour, words, where in [("s", "C2", f"above {name}", lambda d: d.holm_low > 0),
                                         ("o", "C1", "covers 0", lambda d: d.holm_low <= 0 <= d.holm_high),
                                         ("^", "C3", f"below {name}", lambda d: d.holm_high < 0)]:
        here = [(i, d) for i, d in tested if where(d)]
        if here:
            at, d = [i for i, _ in here], pd.DataFrame([r for _, r in here])
            diff_ax.errorbar(d["mean"], at, xerr=[d["mean"] - d.holm_low, d.holm_high - d["mean"]], fmt=marker, ms=5,
                             color=colour, capsize=3, ls="none", label=words)
    diff_ax.axvline(0.0, color="0.4", lw=1)
    for i, stage in enumerate(rows.stage):
        if stage == reference:
            diff_ax.annotate("the reference", (0.0, i), xytext=(4, 0), textcoords="offset points", va="center",
                             fontsize=8, color="0.3")
    diff_ax.set(xlabel=f"difference to {name} (Holm-corrected interval)", title=f"paired difference to {name}")

    kl = rows.kl_from_sft.to_numpy(dtype=float)
    has = ~np.isnan(kl)
    kl_ax.errorbar(kl[has], y[has], xerr=rows.kl_from_sft_se.fillna(0.0).to_numpy(dtype=float)[has], fmt="v", ms=5,
                   color="C4", capsize=3, ls="none")
    for i in y[~has]:
        kl_ax.annotate("n/a", (0.0, i), xytext=(2, 0), textcoords="offset points", va="center", fontsize=8,
                       color="0.3")
    top = float(np.nanmax(kl)) if has.any() else 1.0
    kl_ax.set(xlabel="KL(pi || pi_SFT) (nats)", title="KL from SFT (temperature 1)",
              xlim=(-0.05 * top, 1.15 * top))
    for ax in (rate_ax, diff_ax, kl_ax):
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(5))
        ax.grid(axis="x", alpha=0.3)
        ax.tick_params(axis="y", length=0)
        if ax.get_legend_handles_labels()[0]:  # below the panel, clear of the rows
            ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.6 / fig.get_figheight()), ncol=2,
                      frameon=False)
    fig.suptitle(f"Every method on the built-in task: {len(rows)} methods, {len(seeds)} seeds, the test split")
    fig.tight_layout(w_pad=2.5)
    return fig


def write_leaderboard(out: str, seeds: list[int], pipelines: list) -> str:
    """`<out>/report/leaderboard.md` (+ leaderboard.csv, leaderboard_paired.csv and leaderboard.png) from every
    seed's report (results.json), run (args.json, summary.json) and stage markers. One row a method: its budget, its
    gold win rate against the references per seed (95% Wilson interval) and over seeds (mean, 95% t-interval), the
    baselines (PPO, DPO, SFT) it beats under the paired test, the mean over seeds of its KL from SFT (with the
    standard error of that mean from the seeds' spread: kl_of_seeds), length and EOS rate, its mean wall time and
    highest peak memory. A second table: every method's per-seed difference in gold win rate to PPO, DPO and SFT
    with a paired t-interval and Holm's correction across all those comparisons. The plot: draw_leaderboard."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = pipelines[0]
    rows = []
    for stage in [s for s in first.stages if s in first.policies_order()]:
        kind = first.kind(stage)
        label = first.judged_label(stage)
        per_seed, extra = {}, {"kl": [], "kl_se": [], "length": [], "eos_rate": [], "wall": [], "shared": [],
                               "peak": [], "eval_split": []}  # per seed the split whose prompts its samples answer
        note = None
        for seed, p in zip(seeds, pipelines):
            res = _load(os.path.join(p.report_dir, "results.json"))
            row = next((r for r in res.get("policies", []) if r["policy"] == label), None)
            if row is None:
                raise ValueError(f"leaderboard: seed {seed} has no judged {label} in {p.report_dir}/results.json; run "
                                 f"pipeline.py again to finish that seed")
            per_seed[seed] = row
            extra["eval_split"].append(row.get("eval_split") or eval_split_of(p, label))
            for key in ("length", "eos_rate"):
                if row.get(key) is not None:
                    extra[key].append(row[key])
            if row.get("kl") is not None:
                extra["kl"].append(row["kl"])
                extra["kl_se"].append(row.get("kl_se"))
            note = note or row.get("kl_note")
            marker = _marker(p.marker(stage))
            extra["wall"].append(marker.get("wall_time_s"))
            extra["shared"].append(bool(marker.get("shared")))
            extra["peak"].append(marker.get("peak_rss_mib"))
        if kind in NO_KL:
            note = NO_KL[kind]
        args = _load(os.path.join(first.runs, stage, "args.json"))
        summary = _load(os.path.join(first.runs, stage, "summary.json"))
        name = NAMES.get(stage, f"{stage} (fork of {kind}.py's stage {kind})" if stage in first.extras else stage)
        rows.append({"stage": stage, "method": name, "budget": budget(kind, args, summary), "per_seed": per_seed,
                     "kl_note": note, **extra})

    def avg(xs):
        xs = [x for x in xs if x is not None]
        return float(np.mean(xs)) if xs else None

    def kl_of_seeds(row) -> tuple[float | None, float | None, float | None]:
        """The mean over seeds of a method's KL; the standard error of that mean from the spread of the seeds' KLs
        (sd / sqrt(seeds); with one seed, that seed's own over its prompts); and the seeds' own standard errors over
        prompts, averaged. The seeds answer the same prompts, so their prompt-sampling errors are not independent:
        the root-sum-of-squares of their own standard errors / seeds (which assumes they are) would understate it,
        and the spread over seeds holds the seeds' training alone (a draw of prompts shared by every seed moves
        them all). None where a seed has no KL or no standard error."""
        if len(row["kl"]) != len(seeds):
            return None, None, None
        ses = row["kl_se"]
        prompts = avg(ses) if all(s is not None for s in ses) else None
        spread = float(np.std(row["kl"], ddof=1) / np.sqrt(len(seeds))) if len(seeds) > 1 else prompts
        return avg(row["kl"]), spread, prompts

    rates = {row["stage"]: [row["per_seed"][s]["win_rate"] for s in seeds] for row in rows}
    comparisons = paired_comparisons(rates)
    beaten = {stage: [NAMES.get(c["baseline"], c["baseline"]) for c in comparisons
                      if c["method"] == stage and c["beats"] == "yes"] for stage in rates}
    methods = {row["stage"]: row["method"] for row in rows}

    n_samples = {r.get("n") for row in rows for r in row["per_seed"].values()} - {None}
    split = " and ".join(sorted({s for row in rows for s in row["eval_split"]})) or "validation"  # leaderboard: test
    held_out = (" The test split's prompts share none with the train and validation splits, and no setting was chosen "
                "on them: ILQL's beta, the reward model's settings and every other setting were chosen by gold win "
                "rate on the validation split (docs/results.md)." if split == "test" else "")
    # the seeds share the evaluation prompts: the standard error comes from their spread, not from their own ones
    # combined as if independent (kl_of_seeds; leaderboard.csv's kl_from_sft_se_prompts keeps the prompts' share)
    kl_se_words = ("the standard error of that mean from the spread over seeds (the seeds answer the same prompts, "
                   "so their own standard errors over prompts are not independent; leaderboard.csv's "
                   "kl_from_sft_se_prompts averages those)" if len(seeds) > 1 else
                   "its standard error over the prompts")
    # the CPU type every stage ran on (pipeline.py's cpu.json: a seed resumed on another type is rerun there)
    cpus = sorted({_load(os.path.join(folder, "cpu.json")).get("cpu") or "not recorded"
                   for folder in [out, *(os.path.dirname(p.report_dir) for p in pipelines)]})
    lines = [made_with(provenance()), "", "## Leaderboard: every method on the built-in task", "",
             f"CPU type of every stage: {' and '.join(cpus)}. "
             f"Seeds {', '.join(map(str, seeds))}; each seed trains its own SFT and reward model, and every method of "
             f"that seed starts from them. Gold win rate against the reference summaries on "
             f"{', '.join(map(str, sorted(n_samples))) or 'the'} {split} samples per seed, drawn at the evaluation "
             f"temperature 0.01 (95% Wilson interval), and over seeds (mean, 95% t-interval).{held_out} Beats: the "
             f"baselines (PPO, DPO, SFT) whose gold win rate this method exceeds under the paired test below (its "
             f"Holm-corrected interval of the per-seed differences lies above 0). KL from SFT: KL(pi || pi_SFT) of the "
             f"two models' own distributions at temperature 1 (one response per evaluation prompt sampled from the "
             f"policy at temperature 1, the per-token KL over the whole vocabulary summed over the response up to its "
             f"EOS, the mean over prompts), averaged over seeds, in nats, with {kl_se_words} in parentheses. Wall "
             f"time: the stage's mean over seeds, marked shared where another job held a core as one of its runs "
             f"started; peak memory: the stage process's highest resident set over seeds.", "",
             "| method | budget | " + " | ".join(f"seed {s}" for s in seeds) +
             " | mean [95% t-interval] | beats (paired, Holm) | KL from SFT (SE) | mean length | EOS rate | "
             "wall time (s) | peak memory (MiB) |",
             "| --- | --- | " + " | ".join("---" for _ in seeds) + " | --- | --- | --- | --- | --- | --- | --- |"]
    table = []
    for row in rows:
        rates_of = rates[row["stage"]]
        mean, low, high = mean_and_t_interval(rates_of)
        cells = [f"{_fmt(r['win_rate'])} [{_fmt(r['ci_low'])}, {_fmt(r['ci_high'])}]"
                 for r in (row["per_seed"][s] for s in seeds)]
        interval = f" [{_fmt(low)}, {_fmt(high)}]" if not np.isnan(low) else ""
        kl, kl_se, kl_se_prompts = kl_of_seeds(row)
        wall = avg(row["wall"])
        peak = max((x for x in row["peak"] if x is not None), default=None)
        mine = [c for c in comparisons if c["method"] == row["stage"]]
        beats = ", ".join(beaten[row["stage"]]) or ("none" if any(c["beats"] != "n/a" for c in mine) else "n/a")
        lines.append(f"| {row['method']} | {row['budget']} | " + " | ".join(cells) + f" | {_fmt(mean)}{interval} | "
                     f"{beats} | {kl_cell(kl, kl_se)} | {_fmt(avg(row['length']), 1)} | "
                     f"{_fmt(avg(row['eos_rate']), 2)} | {f'{wall:.0f}' if wall is not None else 'n/a'}"
                     f"{' (shared)' if any(row['shared']) else ''} | "
                     f"{f'{peak:.0f}' if peak is not None else 'n/a'} |")
        table.append({"stage": row["stage"], "method": row["method"], "budget": row["budget"],
                      "eval_split": " and ".join(sorted(set(row["eval_split"]))),
                      **{f"seed_{s}": r for s, r in zip(seeds, rates_of)}, "mean": mean, "t_low": low, "t_high": high,
                      **{f"beats_{b}": next((c["beats"] for c in mine if c["baseline"] == b), None)
                         for b in ("ppo", "dpo", "sft")},
                      "kl_from_sft": kl, "kl_from_sft_se": kl_se,
                      "kl_from_sft_se_prompts": kl_se_prompts, "kl_note": row["kl_note"],
                      "length": avg(row["length"]), "eos_rate": avg(row["eos_rate"]),
                      "wall_time_s": wall, "wall_time_shared": any(row["shared"]), "peak_rss_mib": peak})
    no_kl = [f"{row['method']}: {row['kl_note']}" for row in rows if kl_of_seeds(row)[0] is None and row["kl_note"]]
    if no_kl:
        lines += ["", "KL from SFT n/a: " + "; ".join(no_kl) + "."]

    # the paired differences behind the beats column
    tested = distinct_pairs(comparisons)
    lines += ["", "### Paired differences in gold win rate", "",
              f"Every seed shares its SFT model, reward model and prompts across methods, so a method's per-seed "
              f"difference in gold win rate to a baseline is paired. Mean difference with its 95% paired t-interval "
              f"over the {len(seeds)} seeds (t quantile of {len(seeds) - 1} degrees of freedom) and two-sided p-value; "
              f"Holm's correction across the {tested} distinct pairs of methods this table compares (a pair compared "
              f"both ways is one test): the adjusted p-value, and the interval at the level Holm judges the comparison "
              f"at (1 - that level is its confidence), which excludes 0 exactly where Holm rejects. Beats: yes only "
              f"where that corrected interval lies above 0.", "",
              "method | vs | " + " | ".join(f"seed {s}" for s in seeds) +
              " | mean [95% t-interval] | p | Holm p | Holm-corrected interval (level) | beats",
              "--- | --- | " + " | ".join("---" for _ in seeds) + " | --- | --- | --- | --- | ---"]
    # this table's rows are written without the outer pipes (GitHub Markdown allows it), so that the lines beginning
    # with "| " are the main table's alone, a row per method, as readers of leaderboard.md take them
    for c in comparisons:
        interval = f" [{_fmt(c['low'])}, {_fmt(c['high'])}]" if not np.isnan(c["low"]) else ""
        corrected = (f"[{_fmt(c['holm_low'])}, {_fmt(c['holm_high'])}] ({100 * (1 - c['holm_level']):.2f}%)"
                     if not np.isnan(c["holm_low"]) else "n/a")
        lines.append(f"{methods[c['method']]} | {NAMES.get(c['baseline'], c['baseline'])} | "
                     + " | ".join(f"{d:+.3f}" for d in c["diffs"]) + f" | {c['mean']:+.3f}{interval} | "
                     f"{_fmt(c['p'], 4)} | {_fmt(c['p_holm'], 4)} | {corrected} | {c['beats']}")

    report_dir = os.path.join(out, "report")
    os.makedirs(report_dir, exist_ok=True)
    _saved(os.path.join(report_dir, "leaderboard.csv"), pd.DataFrame(table).to_csv(index=False))
    paired = pd.DataFrame([
        {**{k: v for k, v in c.items() if k != "diffs"}, **{f"diff_seed_{s}": d for s, d in zip(seeds, c["diffs"])}}
        for c in comparisons])
    _saved(os.path.join(report_dir, "leaderboard_paired.csv"), paired.to_csv(index=False))

    fig = draw_leaderboard(pd.DataFrame(table), paired)
    _saved(os.path.join(report_dir, "leaderboard.png"), lambda temporary: fig.savefig(temporary, dpi=100))
    plt.close(fig)
    lines += ["", "Plot: `leaderboard.png` (every method's gold win rate over seeds, sorted; its paired difference to "
              "PPO with the Holm-corrected interval; its KL from SFT); the tables as CSV: `leaderboard.csv`, "
              "`leaderboard_paired.csv` (`python report.py <folder>` redraws the plot from them)."]
    text = "\n".join(lines) + "\n"
    _saved(os.path.join(report_dir, "leaderboard.md"), text)
    return text


if __name__ == "__main__":
    import sys

    folder = sys.argv[1] if len(sys.argv) == 2 else ""
    if not os.path.exists(os.path.join(folder, "leaderboard.csv")):
        sys.exit("usage: python report.py <folder>: redraws leaderboard.png from the folder's leaderboard.csv and "
                 "leaderboard_paired.csv (pipeline.py --mode leaderboard writes them in <out>/report)")
    figure = draw_leaderboard(pd.read_csv(os.path.join(folder, "leaderboard.csv")),
                              pd.read_csv(os.path.join(folder, "leaderboard_paired.csv")))
    figure.savefig(os.path.join(folder, "leaderboard.png"), dpi=100)
    print(f"wrote {os.path.join(folder, 'leaderboard.png')}")
