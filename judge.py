"""LLM-as-a-judge evaluation: win rates against reference summaries with the paper's GPT prompt.

The paper (Appendix I, Figures 1, 5 and 8, Details 17-18) judges TL;DR summaries with GPT-3.5
("GPT 3.5" in the text, "GPT-3.5 Turbo" in Appendix I; the reference code defaults to
`gpt-3.5-turbo-0125`): the judge sees the post and two summaries, the order of which is
randomised, and answers `Comparison: <one sentence>` / `Preferred: <"A" or "B">`. This script does
that, and three more things the paper reports:

* pairwise (default): one or more sample CSVs (columns `query`, `response`, `reference`, as the
  training scripts write them) judged against their references, or against another CSV's
  responses for the same queries (`--baseline_csv`). Outputs: win rate with a 95% Wilson
  interval, counts, a per-pair CSV, a length-controlled plot (Figure 8: win rate against
  log(response length / reference length)), a comparison table and bar plot (Figure 1 in
  miniature) and a machine-readable `judge_summary.json`.
* agreement (Detail 17): the judge labels preference pairs; a reward model labels the same
  pairs with `get_reward`; we report how often the two agree.
* multi (the offline-RLHF paper, Appendix A): the answers of several models to the same query
  are scored 1-10 in one prompt; we report mean scores and rank-normalised scores.

Robustness, since a judge is a remote service that fails: requests run concurrently on the
official async `openai` client under a semaphore, each with a deadline on the whole request (--timeout_s: a
server that answers and then stalls or trickles is cut off); 5xx / timeouts, a cut body and a 200 that is no
chat completion are retried with exponential backoff and jitter (asyncio.sleep, a bounded number of tries); a 429 is
waited out as the API asks, with fewer requests in flight, for up to --rate_limit_patience; a reply without a
parseable verdict is asked again a bounded number of times and then counted as *invalid*
(never as a loss, never replaced by a coin flip); every reply is cached on disk (sqlite), keyed
by model and prompt, so a rerun or an interrupted run does not pay again for a reply it received
(one race remains, see `ReplyCache`; a damaged cache file is moved aside and its readable replies kept, and a full
disk under it or under the outputs, which are written whole and then renamed, is one paragraph naming the folder).
A judge that cannot be used at all (the endpoint unreachable,
stalling or answering no chat completion, the key refused, not one request answered) stops the run with one
error naming the URL and what happened, instead of marking every row invalid. The API key is read from
`OPENAI_API_KEY` only and is never printed, logged or saved.

Usage:
    export OPENAI_API_KEY=...   # not needed for a loopback --base_url
    python judge.py --csv runs/sft__1__123/samples.csv runs/ppo__1__456/samples.csv \\
        --length_unit tokens --tokenizer_path EleutherAI/pythia-1b-deduped
    # built-in task: the gold judge behind the same API. It prints its URL and its model id,
    # gold-judge-<digest of its code>, so cached verdicts never outlive a change of the gold judge.
    python data/gold_judge_server.py --port 8011 &
    python judge.py --csv runs/sft__1__123/samples.csv --base_url http://127.0.0.1:8011/v1 \\
        --model gold-judge-<digest> --tokenizer_path artifacts/synthetic/base_model
"""

import hashlib
import json
import os
import random
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Literal, Optional

import numpy as np
import pandas as pd
import torch
import tyro
from statsmodels.stats.proportion import proportion_confint
from tqdm.auto import tqdm
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlhf_utils import checks
from rlhf_utils.checks import RunError
from rlhf_utils.judge_client import Outcome, ReplyCache, public_url, run_jobs


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the order randomisation (per pair) and of the backoff jitter"""
    run_name: Optional[str] = None
    """run name; None -> f"{exp_name}__{seed}__{int(time.time())}" """
    run_dir_root: str = "runs"
    """outputs go to {run_dir_root}/{run_name} unless --output_dir is given"""
    output_dir: Optional[str] = None
    """where the judged CSVs, plots, table and judge_summary.json go"""
    mode: Literal["pairwise", "agreement", "multi"] = "pairwise"
    """pairwise: win rates vs references (Figure 1, 8); agreement: judge vs RM on preference pairs
    (Detail 17); multi: 1-10 scores of several models' answers in one prompt (offline-RLHF seed)"""

    # inputs
    csv: list[str] = field(default_factory=list)
    """sample CSVs (columns query, response, reference) written by the training scripts"""
    labels: Optional[list[str]] = None
    """one display name per --csv; None -> the run directory name (for samples.csv) or the file stem"""
    baseline_csv: Optional[str] = None
    """pairwise: judge against this CSV's response for the same query instead of the reference"""
    num_samples: int = -1
    """judge only the first N rows of each CSV (or pairs of the preference split); -1 = all"""

    # the judge
    model: str = "gpt-3.5-turbo-0125"
    """judge model; the paper used GPT-3.5 Turbo (its reference code: gpt-3.5-turbo-0125)"""
    base_url: Optional[str] = None
    """any OpenAI-compatible endpoint (e.g. the built-in gold judge); None -> the openai default"""
    system_prompt: str = "You are a helpful assistant."
    """system message sent before the judge prompt (the reference code's)"""
    temperature: Optional[float] = None
    """sampling temperature of the judge; None sends none (the API default, as the reference code)"""
    max_parallel_requests: int = 8
    """concurrency limit: requests in flight at once"""
    max_tries: int = 6
    """tries per request on 5xx, timeouts, connection errors, a cut or stalled reply and a 200 that is no chat
    completion (then the pair is invalid; when no request of the run was ever answered, the run stops with one error);
    a 429 uses up none (--rate_limit_patience)"""
    rate_limit_patience: float = 600.0
    """seconds a rate limit (HTTP 429) is waited out before the run stops with one error; the waits use up none of
    max_tries. 600: many times a per-minute limit's window, yet a quota spent for the day stops the run in 10 minutes
    instead of hanging it (docs/usage.md, "Flags in depth")"""
    backoff_base_s: float = 1.0
    """first retry waits about this long; each further retry doubles it (with jitter)"""
    backoff_max_s: float = 60.0
    """upper bound on one backoff wait"""
    timeout_s: float = 120.0
    """deadline of each request as a whole, from asking to the last byte of the reply (a server that answers, then
    stalls or trickles, is cut off there); a request past it is retried (--max_tries)"""
    max_parse_tries: int = 3
    """asks per pair when the reply has no parseable verdict (then the pair is invalid)"""
    cache_path: str = "runs/judge_cache.sqlite"
    """sqlite file caching every reply, keyed by model, endpoint, system prompt, prompt, temperature, ask index and,
    unless --temperature is 0, --seed (caches written before the endpoint and seed joined the key are not reused)"""
    strip_eos_text: str = "<|endoftext|>"
    """the EOS spelling removed from the end of every summary and reference before the judge reads it: the hub's
    processed TL;DR references end with it as text, and the reference implementation strips it too ("" keeps it)"""
    check_complete: bool = True
    """refuse a sample CSV or a reward model whose training run did not finish (its output folder's run.json lacks
    `"complete": true`); off: judge it anyway"""

    # length-controlled analysis (Figure 8)
    length_unit: Literal["tokens", "chars"] = "tokens"
    """summary length in tokens of --tokenizer_path (the paper) or in characters"""
    tokenizer_path: str = "EleutherAI/pythia-1b-deduped"
    """tokenizer used to measure lengths when --length_unit tokens"""
    num_length_bins: int = 6
    """bins of log(response length / reference length) in the length-controlled plot"""

    # agreement mode (Detail 17)
    reward_model_path: Optional[str] = None
    """agreement: the reward model (AutoModelForSequenceClassification save) whose preferences we compare"""
    preference_dataset: str = "vwxyzjn/summarize_from_feedback_oai_preprocessing_1706381144"
    """agreement: processed preference dataset (hub name or local save_to_disk folder)"""
    preference_split: str = "validation"
    """agreement: split of the preference dataset"""
    local_micro_batch_size: int = 8
    """agreement: pairs per reward-model forward pass"""
    trust_remote_code: bool = False
    """passed to from_pretrained"""


# ----------------------------------------------------------------------------------------------
# Shared helpers (copied verbatim from the project's helpers; a test checks the copies agree)
# ----------------------------------------------------------------------------------------------
def first_true_indices(bools: torch.Tensor, dtype=torch.long) -> torch.Tensor:
    """Per row, the index of the first True; the row length when the row has no True."""
    row_len = bools.size(-1)
    positions = torch.arange(row_len, dtype=dtype, device=bools.device)
    # a False entry is pushed past the end, so the minimum picks the first True (or row_len)
    return torch.where(bools, positions, torch.full_like(positions, row_len)).min(dim=-1).values


def real_columns(query_responses: torch.Tensor, pad_token_id: int) -> slice:
    """The columns of a batch of (left-padded query + right-padded response) rows that hold a real token in some
    row. The columns outside are padding in every row: the model masks them out and positions count real tokens
    only (Detail 14), so cutting them changes no loss, log-prob or reward, only the compute. The data keeps its
    fixed widths on disk (Detail 5); each batch is cut to its own longest row when it meets the model."""
    real = (query_responses != pad_token_id).any(0).nonzero()
    if real.numel() == 0:
        return slice(0, query_responses.size(1))
    return slice(int(real[0]), int(real[-1]) + 1)


def get_reward(model, query_responses: torch.Tensor, pad_token_id: int, context_length: int):
    """Reward of a (left-padded query + right-padded response) batch.

    Detail 12: the score is read at the EOS token, i.e. the last token before the first [PAD]
    of the response (the last token when there is no pad). Returns the per-token reward
    logits (B, T), the sequence rewards (B,) and the index read (B,)."""
    attention_mask = query_responses != pad_token_id
    position_ids = attention_mask.long().cumsum(1) - attention_mask.long()
    input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, return_dict=True
    ).last_hidden_state  # (B, T, d)
    reward_logits = model.score(hidden).squeeze(-1)  # (B, T)
    sequence_lengths = first_true_indices(query_responses[:, context_length:] == pad_token_id) - 1 + context_length
    rewards = reward_logits[torch.arange(reward_logits.size(0), device=reward_logits.device), sequence_lengths]
    return reward_logits, rewards, sequence_lengths


# ----------------------------------------------------------------------------------------------
# 1. The prompts (Appendix I of the paper; Appendix A of the offline-RLHF paper).
#    `data/gold_judge_server.py` holds the same strings to parse them back; a test checks that
#    the two copies are identical. Placeholders are `{name}`; other braces are literal text.
# ----------------------------------------------------------------------------------------------
PAIRWISE_JUDGE_TEMPLATE = """Which of the following summaries does a better job of summarizing the most important \
points in the given forum post, without including unimportant or irrelevant details? Judge based on accuracy, \
coverage, and coherence.

Post:
{post}

Summary A:
{summary_a}

Summary B:
{summary_b}

FIRST provide a one-sentence comparison of the two summaries, explaining which you prefer and why. SECOND, on a new \
line, state only "A" or "B" to indicate your choice. Your response should use the format:

Comparison: <one-sentence comparison and explanation>
Preferred: <"A" or "B">"""

MULTI_ANSWER_JUDGE_TEMPLATE = """Please act as an impartial judge and evaluate the quality of the responses provided \
by {num_assistants} AI assistants to the user question. You should choose the assistant that follows the user's \
instructions and answers the user's questions better. Your evaluation should consider factors such as the helpfulness, \
relevance, and level of detail of their responses.

Begin your evaluation by comparing the {num_assistants} responses and provide a short explanation. Avoid any position \
biases and ensure that the order in which the responses were presented does not influence your decision. Do not allow \
the length of the responses to influence your evaluation. Do not favor certain names of the assistants. Be as \
objective as possible. After providing your explanation, output your final verdict by strictly following this format:

{Assistant name}: {score}, where the range of {score} is 1 to 10.

The answers can have the same score, but you should distinguish them as much as possible. You should give the \
assistant's scores one by one after all the explanations. The followings are the question and answers of Assistant \
{assistant_names},

User Question:
{question}

{answers}"""

MULTI_ANSWER_BLOCK_TEMPLATE = """The answer of Assistant {name}:
{answer}"""

NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
_PLACEHOLDER_RE = re.compile(
    r"\{(post|summary_a|summary_b|num_assistants|assistant_names|question|answers|name|answer)\}")


def number_word(n: int) -> str:
    """How the prompt writes a count: "five" as in the paper, digits beyond ten."""
    return NUMBER_WORDS[n] if n < len(NUMBER_WORDS) else str(n)


def fill_template(template: str, **values: str) -> str:
    """Substitute the `{name}` placeholders in one pass, so a post that itself contains
    `{summary_a}` (or any brace) is inserted verbatim and never re-substituted."""
    return _PLACEHOLDER_RE.sub(lambda m: values[m.group(1)], template)


def pairwise_prompt(post: str, summary_a: str, summary_b: str) -> str:
    return fill_template(PAIRWISE_JUDGE_TEMPLATE, post=post, summary_a=summary_a, summary_b=summary_b)


def multi_answer_prompt(question: str, names: list[str], answers: list[str]) -> str:
    """The seed's prompt for len(names) anonymous assistants ("A, B and C")."""
    names_text = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    blocks = "\n\n".join(fill_template(MULTI_ANSWER_BLOCK_TEMPLATE, name=n, answer=a) for n, a in zip(names, answers))
    return fill_template(MULTI_ANSWER_JUDGE_TEMPLATE, num_assistants=number_word(len(names)),
                         assistant_names=names_text, question=question, answers=blocks)


# ----------------------------------------------------------------------------------------------
# 2. Order randomisation and parsing.
# ----------------------------------------------------------------------------------------------
def pair_order(seed: int, *texts: str) -> int:
    """0 or 1, derived from the seed and the pair's own texts: reproducible across reruns, row
    orders and CSV files, and independent between pairs (Appendix I: the order of the summaries
    is randomised to remove the judge's position bias)."""
    digest = hashlib.sha256("\x00".join((str(seed),) + texts).encode()).digest()
    return digest[0] & 1


def pair_rng(seed: int, *texts: str) -> random.Random:
    """A generator seeded the same way, for shuffling more than two answers."""
    return random.Random(hashlib.sha256("\x00".join((str(seed),) + texts).encode()).digest())


def without_eos_text(text: str, eos_text: str) -> str:
    """What a human reader sees of a summary: the text without surrounding whitespace and without the EOS spelling
    `eos_text` (every copy of it) at its end. The hub's processed TL;DR references end with `<|endoftext|>` as
    text; the reference implementation strips it before judging, and so do we."""
    text = str(text).strip()
    while eos_text and text.endswith(eos_text):
        text = text[: -len(eos_text)].rstrip()
    return text


# The verdict line in the forms judges write: "Preferred: A", "Preferred: Summary A", any letter case, quotes, a
# trailing period and markdown bold, and the letter alone on the line after "Preferred:". A reply with no such
# line, or with lines that disagree, is unparseable.
_PREFERRED_RE = re.compile(
    r'^[ \t]*[*_]*preferred[*_]*(?::[*_]*)?(?:[ \t]*\n)*[ \t]*[*_]*[ \t]*'  # "Preferred:", then any blank lines
    r'["\'(\[]?(?:summary[ \t]+)?([ab])["\')\]]?[*_]*\.?[*_]*[ \t]*$',  # the letter, quoted or bracketed
    re.MULTILINE | re.IGNORECASE)
_COMPARISON_RE = re.compile(r"^[ \t]*\**Comparison:?\**:?[ \t]*(.*?)[ \t]*$", re.MULTILINE)


def parse_verdict(reply: str) -> Optional[tuple[str, str]]:
    """("A" or "B", explanation) from a reply in the paper's format; None when there is no
    unambiguous `Preferred:` line."""
    verdicts = {verdict.upper() for verdict in _PREFERRED_RE.findall(reply)}
    if len(verdicts) != 1:
        return None
    comparison = _COMPARISON_RE.search(reply)
    return verdicts.pop(), (comparison.group(1) if comparison else "")


# "Assistant X: 7.5" (markdown bold and "/10" tolerated); the last score of a name wins, since
# the prompt asks for the scores after the explanations.
_SCORE_RE = re.compile(r"^\W*Assistant\s+(\w+)\W*?:\s*\**\s*(\d+(?:\.\d+)?)\s*(?:/\s*10)?\s*\**\s*$", re.MULTILINE)


def parse_scores(reply: str, names: list[str]) -> Optional[dict[str, float]]:
    """{name: score in [1, 10]} for every name; None when any is missing or out of range."""
    found = {name: float(score) for name, score in _SCORE_RE.findall(reply)}
    if any(n not in found or not 1.0 <= found[n] <= 10.0 for n in names):
        return None
    return {n: found[n] for n in names}


# ----------------------------------------------------------------------------------------------
# 3. Statistics.
# ----------------------------------------------------------------------------------------------
def wilson_interval(successes: float, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (better than the normal approximation
    near 0 or 1 and for small n); (nan, nan) when n = 0. statsmodels' proportion_confint, not
    scipy's binomtest(k, n).proportion_ci: a judge's tie counts as half a success, a k it refuses."""
    if n == 0:
        return float("nan"), float("nan")
    low, high = proportion_confint(successes, n, alpha=0.05, method="wilson")
    low = 0.0 if successes == 0 else max(0.0, low)  # exact at the edges (no 1e-17 from rounding)
    high = 1.0 if successes == n else min(1.0, high)
    return float(low), float(high)


def rank_normalised(scores: list[float]) -> list[float]:
    """The offline-RLHF paper's rank score: N + 1 - rank (rank 1 = best), tied scores share the
    average rank. With five systems the best gets 5, as in its "6 - rank"."""
    order = pd.Series(scores).rank(ascending=False, method="average").tolist()
    return [len(scores) + 1 - r for r in order]


def none_if_nan(x: float) -> Optional[float]:
    return None if x != x else float(x)


# ----------------------------------------------------------------------------------------------
# 4. The client: API key, cache, retries.
# ----------------------------------------------------------------------------------------------
# ----------------------------------------------------------------------------------------------
# 5. Pairwise mode: win rates, length control, comparison table.
# ----------------------------------------------------------------------------------------------
def incomplete_output(folder: str) -> Optional[str]:
    """Why a training script's output folder is not complete, or None when it is (or was not written by one of the
    project's training scripts: no run.json). A run marks its folder `"complete": true` in run.json last, after the
    final model is saved, so a folder without the mark holds a run that stopped (or is still running)."""
    mark = os.path.join(folder, "run.json")
    if not os.path.isfile(mark):
        return None
    try:
        info = json.load(open(mark))
    except ValueError:
        info = {}
    if info.get("complete") is True:
        return None
    return (f"{folder} is incomplete: its run.json lacks \"complete\": true (the run {info.get('run_name')!r} stopped "
            "before the end, or is still running)")


def check_sources_complete(args: Args, csvs: list[str]) -> None:
    """Bad input: samples or a reward model from a run that did not finish. A sample CSV's run folder (the folder
    holding the run's args.json: the CSV's own or its parent) names the run's --output_dir; that folder and
    --reward_model_path must carry the completion mark (incomplete_output)."""
    if not args.check_complete:
        return
    for path in csvs:
        for run_dir in (os.path.dirname(os.path.abspath(path)),
                        os.path.dirname(os.path.dirname(os.path.abspath(path)))):
            config = os.path.join(run_dir, "args.json")
            if os.path.isfile(config):
                run = json.load(open(config))
                folder = run.get("output_dir")
                problem = incomplete_output(folder) if folder and os.path.isdir(folder) else None
                if problem:
                    script = f"{run.get('exp_name', 'the training script')}.py"
                    raise RunError(f"{path} comes from an unfinished run: {problem}. Rerun {script} to its end (e.g. "
                                     f"with --resume --run_name {run.get('run_name')}), or pass --no-check_complete to "
                                     "judge these samples anyway")
                break
    if args.mode == "agreement" and args.reward_model_path and os.path.isdir(args.reward_model_path):
        problem = incomplete_output(args.reward_model_path)
        if problem:
            raise RunError(f"--reward_model_path: {problem}. Rerun reward.py to its end, or pass --no-check_complete "
                             "to use it anyway")


def csv_labels(paths: list[str], labels: Optional[list[str]]) -> list[str]:
    if labels is not None:
        if len(labels) != len(paths):
            raise RunError(f"--labels has {len(labels)} names for {len(paths)} --csv files")
        if len(set(labels)) != len(labels):
            raise RunError(f"--labels must be unique, got {labels}")
        return list(labels)
    out = []
    for p in paths:
        stem = os.path.splitext(os.path.basename(p))[0]
        name = os.path.basename(os.path.dirname(os.path.abspath(p))) if stem == "samples" else stem
        base, k = name, 2
        while name in out:
            name, k = f"{base}_{k}", k + 1
        out.append(name)
    return out


def read_samples(path: str, columns: list[str], num_samples: int) -> pd.DataFrame:
    try:
        df = pd.read_csv(path, keep_default_na=False)  # an empty response stays "", not NaN
    except pd.errors.EmptyDataError:
        raise RunError(f"{path} is empty (no header, no rows); a sample CSV has the columns {columns} and one row "
                         "per sample, as the training scripts write it") from None
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise RunError(f"{path} lacks column(s) {missing}; it has {list(df.columns)}")
    if len(df) == 0:
        raise RunError(f"{path} has a header but no rows: nothing to judge; pass a CSV that holds samples")
    if num_samples >= 0:
        df = df.iloc[:num_samples]
    return df.reset_index(drop=True)


def build_length_fn(args: Args) -> Callable[[str], int]:
    if args.length_unit == "chars":
        return len
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path, trust_remote_code=args.trust_remote_code)
    # a special token's spelling in a summary is text, as in data/prepare.py (split_special_tokens)
    return lambda text: len(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def length_bins(frames: dict[str, pd.DataFrame], num_bins: int) -> pd.DataFrame:
    """Win rate per bin of log(response length / baseline length), bins shared by all CSVs."""
    valid = {k: d[d["winner"] != "invalid"] for k, d in frames.items()}
    pooled = np.concatenate([d["log_length_ratio"].to_numpy() for d in valid.values()])
    if pooled.size == 0:
        return pd.DataFrame(
            columns=["label", "bin_low", "bin_high", "bin_center", "n", "win_rate", "ci_low", "ci_high"])
    lo, hi = float(pooled.min()), float(pooled.max())
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    edges = np.linspace(lo, hi, num_bins + 1)
    rows = []
    for label, d in valid.items():
        which = np.clip(np.digitize(d["log_length_ratio"].to_numpy(), edges[1:-1]), 0, num_bins - 1)
        wins = (d["winner"] == "ours").to_numpy() + 0.5 * (d["winner"] == "tie").to_numpy()  # a tie is half a win
        for b in range(num_bins):
            n = int((which == b).sum())
            w = float(wins[which == b].sum())
            low, high = wilson_interval(w, n)
            rows.append({"label": label, "bin_low": edges[b], "bin_high": edges[b + 1],
                         "bin_center": (edges[b] + edges[b + 1]) / 2, "n": n,
                         "win_rate": w / n if n else float("nan"), "ci_low": low, "ci_high": high})
    return pd.DataFrame(rows)


def pyplot():
    """matplotlib's pyplot, drawing to files (Agg): imported here, not at the top, as only the plots need it
    (~0.4 s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def saved(path: str, content, args: Args) -> None:
    """An output written whole or not at all (write_whole: a temporary file renamed into place), so a full output
    folder leaves no cut CSV or empty plot under a finished name and stops with one paragraph naming the folder.
    `content`: a text, or a function that writes the file it is given."""
    from rlhf_utils.run import write_whole  # here: only the writing needs the run module (0.4 s to import)

    write_whole(path, content, os.path.basename(path), "Free space there (or pass another --output_dir) and run the "
                f"same command again: every reply received is in the reply cache {args.cache_path}, so the judge is "
                "asked nothing twice")


def plot_length_controlled(bins: pd.DataFrame, path: str, unit: str) -> None:
    plt = pyplot()
    fig = length_controlled_figure(bins, unit)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def length_controlled_figure(bins: pd.DataFrame, unit: str):
    """Figure 8 in miniature: each policy's win rate (95% Wilson interval) per bin of log(response length /
    reference length). Every policy its own colour and marker, named in a legend beside the panel; the verdicts
    each point rests on are written along the panel's foot for up to 3 policies, a row each (beyond, they are in
    length_bins.csv alone)."""
    from rlhf_utils.records import counts_at_foot  # here: only the plot needs the records module

    plt = pyplot()
    labels = list(dict.fromkeys(bins["label"]))
    few = len(labels) <= 3
    fig, ax = plt.subplots(figsize=(6.4 if few else 8.4, 4.2))
    colours, markers = plt.get_cmap("tab20").colors, "osD^v<>pP*Xh"
    for i, (label, d) in enumerate(bins.groupby("label", sort=False)):
        d = d[d["n"] > 0]
        yerr = np.clip(np.stack([d["win_rate"] - d["ci_low"], d["ci_high"] - d["win_rate"]]), 0, None)
        colour = colours[2 * i % 20 + (2 * i // 20) % 2]  # the dark shades first, then the light ones
        ax.errorbar(d["bin_center"], d["win_rate"], yerr=yerr, marker=markers[i % len(markers)], ms=4, capsize=2,
                    lw=1, color=colour, label=label)
        if few:  # how many verdicts each point rests on: a row of counts a policy along the panel's foot
            counts_at_foot(ax, d["bin_center"], d["n"], i, colour)
    ax.axhline(0.5, color="gray", lw=0.8, ls="--")
    ax.axvline(0.0, color="gray", lw=0.8, ls=":")
    ax.set_xlabel(f"log(response length / reference length), lengths in {unit}")
    ax.set_ylabel("win rate vs the reference (95% Wilson CI)")
    ax.set_ylim(-0.02 - (0.1 if few else 0.0), 1.02)  # room for the counts under the lowest points
    ax.set_title("Length-controlled win rate (Figure 8)" + ("; at the foot: verdicts per point" if few else ""))
    if labels:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    else:  # every verdict invalid: an empty plot that says so
        ax.text(0.5, 0.5, "no valid verdicts", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    return fig


def plot_bars(names: list[str], rates: list[float], lows: list[float], highs: list[float], path: str, ylabel: str,
              title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(names) + 2), 4))
    r = np.array(rates, dtype=float)
    yerr = np.clip(np.stack([r - np.array(lows, dtype=float), np.array(highs, dtype=float) - r]), 0, None)
    bars = ax.bar(range(len(names)), r, yerr=yerr, capsize=4, color="tab:blue")
    ax.bar_label(bars, labels=["n/a" if v != v else f"{v:.2f}" for v in r], padding=8, fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
    ax.axhline(0.5, color="gray", lw=0.8, ls="--")
    ax.set_ylim(0, 1)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_pairwise(args: Args, output_dir: str, cache: ReplyCache) -> dict:
    if not args.csv:
        raise RunError("pairwise mode needs at least one --csv")
    for path in args.csv + ([args.baseline_csv] if args.baseline_csv is not None else []):
        if not os.path.isfile(path):
            raise RunError(f"no such sample CSV: {path}")
    labels = csv_labels(args.csv, args.labels)
    baseline = None
    if args.baseline_csv is not None:
        # model vs model: the baseline's response to the same query (first occurrence of the query)
        bdf = read_samples(args.baseline_csv, ["query", "response"], -1)
        baseline = dict(zip(bdf["query"][::-1], bdf["response"][::-1]))
    length_of = build_length_fn(args)

    frames, jobs = {}, []
    for path, label in zip(args.csv, labels):
        df = read_samples(path, ["query", "response"] + ([] if baseline is not None else ["reference"]),
                          args.num_samples)
        if baseline is not None:
            missing = [i for i, q in enumerate(df["query"]) if q not in baseline]
            if missing:
                raise RunError(f"{path}: {len(missing)} queries (first at row {missing[0]}) are not in --baseline_csv")
            other = [baseline[q] for q in df["query"]]
        else:
            other = list(df["reference"])
        out = pd.DataFrame({"query": df["query"], "response": df["response"], "baseline": other})
        # what the judge sees: the stripped texts without an EOS spelling at their end, as in the reference
        # implementation
        post = out["query"].map(str.strip)
        ours = out["response"].map(lambda text: without_eos_text(text, args.strip_eos_text))
        theirs = out["baseline"].map(lambda text: without_eos_text(text, args.strip_eos_text))
        out["shuffled_index"] = [pair_order(args.seed, p, o, t) for p, o, t in zip(post, ours, theirs)]
        # shuffled_index 0: ours is Summary A; 1: ours is Summary B
        out["summary_a"] = [o if s == 0 else t for o, t, s in zip(ours, theirs, out["shuffled_index"])]
        out["summary_b"] = [t if s == 0 else o for o, t, s in zip(ours, theirs, out["shuffled_index"])]
        # two identical texts are a tie: half a win, never sent to the judge (which could only follow the position)
        out["identical"] = ours == theirs
        out["response_len"] = [length_of(t) for t in ours]
        out["baseline_len"] = [length_of(t) for t in theirs]
        out["log_length_ratio"] = np.log(np.maximum(out["response_len"], 1) / np.maximum(out["baseline_len"], 1))
        frames[label] = out
        for row, (p, a, b, same) in enumerate(zip(post, out["summary_a"], out["summary_b"], out["identical"])):
            if not same:
                jobs.append((label, row, pairwise_prompt(p, a, b)))

    # progress bar: done, total, invalid, running win rate over every CSV so far
    tally = {"wins": 0, "losses": 0, "invalid": 0}
    bar = tqdm(total=len(jobs), desc="judging", dynamic_ncols=True)

    def on_done(i: int, outcome: Outcome) -> None:
        label, row, _ = jobs[i]
        s = frames[label].at[row, "shuffled_index"]
        if outcome.status == "ok":
            ours_won = (outcome.parsed[0] == "A") == (s == 0)
            tally["wins" if ours_won else "losses"] += 1
        else:
            tally["invalid"] += 1
        decided = tally["wins"] + tally["losses"]
        bar.set_postfix(invalid=tally["invalid"], win_rate=f"{tally['wins'] / decided:.3f}" if decided else "n/a",
                        refresh=False)
        bar.update(1)

    try:
        outcomes, stats = run_jobs(args, [(p, parse_verdict) for _, _, p in jobs], on_done, cache)
    finally:
        bar.close()  # before any error, so the error is the last line printed

    tie = Outcome("tie", None, "", 0)  # an identical pair: not asked
    by_label: dict[str, list[Outcome]] = {label: [tie] * len(d) for label, d in frames.items()}
    for (label, row, _), outcome in zip(jobs, outcomes):
        by_label[label][row] = outcome
    for label, d in frames.items():
        results = by_label[label]
        d["status"] = [o.status for o in results]
        d["asks"] = [o.asks for o in results]
        d["error"] = [o.error for o in results]
        d["judge_reply"] = [o.reply for o in results]
        d["preferred"] = [o.parsed[0] if o.status == "ok" else "" for o in results]
        d["explanation"] = [o.parsed[1] if o.status == "ok" else "" for o in results]
        # invalid: neither a loss nor a coin flip; excluded from the win rate and counted. tie: half a win
        d["winner"] = [
            o.status if o.status == "tie" else "invalid" if o.status != "ok"
            else ("ours" if (o.parsed[0] == "A") == (s == 0) else "baseline")
            for o, s in zip(results, d["shuffled_index"])
        ]

    per_csv = {}
    for path, label in zip(args.csv, labels):
        d = frames[label]
        judged_path = os.path.join(output_dir, f"{label}_judged.csv")
        saved(judged_path, d.to_csv(index=False), args)
        wins, losses = int((d["winner"] == "ours").sum()), int((d["winner"] == "baseline").sum())
        ties = int((d["winner"] == "tie").sum())
        decided = wins + losses + ties
        low, high = wilson_interval(wins + 0.5 * ties, decided)  # a tie: half a success
        per_csv[label] = {
            "csv": path,
            "baseline": args.baseline_csv if args.baseline_csv is not None else "reference",
            "win_rate": (wins + 0.5 * ties) / decided if decided else None,  # a tie counts half a win
            "ci_low": none_if_nan(low),
            "ci_high": none_if_nan(high),
            "wins": wins,
            "losses": losses,
            "ties": ties,
            "invalid": int((d["winner"] == "invalid").sum()),
            "unparseable": int((d["status"] == "unparseable").sum()),
            "api_errors": int((d["status"] == "api_error").sum()),
            "n": int(len(d)),
            "n_identical": int(d["identical"].sum()),
            "mean_log_length_ratio": float(d["log_length_ratio"].mean()) if len(d) else None,
            "judged_csv": judged_path,
        }

    bins = length_bins(frames, args.num_length_bins)
    saved(os.path.join(output_dir, "length_bins.csv"), bins.to_csv(index=False), args)
    saved(os.path.join(output_dir, "length_controlled_win_rate.png"),
          lambda temporary: plot_length_controlled(bins, temporary, args.length_unit), args)

    vs = "reference" if args.baseline_csv is None else f"`{args.baseline_csv}`"
    lines = [f"Win rate against {vs}, judge `{args.model}`, 95% Wilson intervals; invalid verdicts are excluded, "
             "not losses; a tie (identical texts, not sent to the judge) counts half a win.", "",
             "| model | win rate | 95% CI | wins | losses | ties | invalid | n | mean log(len ratio) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, s in per_csv.items():
        rate = "n/a" if s["win_rate"] is None else f"{s['win_rate']:.3f}"
        ci = "n/a" if s["ci_low"] is None else f"[{s['ci_low']:.3f}, {s['ci_high']:.3f}]"
        ratio = "n/a" if s["mean_log_length_ratio"] is None else f"{s['mean_log_length_ratio']:+.3f}"
        lines.append(f"| {label} | {rate} | {ci} | {s['wins']} | {s['losses']} | {s['ties']} | {s['invalid']} "
                     f"| {s['n']} | {ratio} |")
    saved(os.path.join(output_dir, "comparison.md"), "\n".join(lines) + "\n", args)
    saved(os.path.join(output_dir, "win_rates.png"), lambda temporary: plot_bars(
        list(per_csv), [s["win_rate"] if s["win_rate"] is not None else float("nan") for s in per_csv.values()],
        [s["ci_low"] if s["ci_low"] is not None else float("nan") for s in per_csv.values()],
        [s["ci_high"] if s["ci_high"] is not None else float("nan") for s in per_csv.values()], temporary,
        f"win rate vs {'reference' if args.baseline_csv is None else 'baseline'}", "Win rate (Figure 1)"), args)
    print("\n".join(lines))
    return {"per_csv": per_csv, "stats": stats}


# ----------------------------------------------------------------------------------------------
# 6. Agreement mode (Detail 17): judge vs reward model on the same preference pairs.
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def reward_preferences(args: Args, dataset) -> tuple[np.ndarray, np.ndarray]:
    """Reward-model scores of the chosen and rejected responses of every pair."""
    tokenizer = AutoTokenizer.from_pretrained(args.reward_model_path, trust_remote_code=args.trust_remote_code)
    where = f"{args.preference_dataset} split {args.preference_split!r}"
    checks.check_data_tokenizer(dataset, tokenizer, args.reward_model_path, where)  # before any request is paid for
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForSequenceClassification.from_pretrained(
        args.reward_model_path, num_labels=1, trust_remote_code=args.trust_remote_code, dtype=torch.float32
    ).to(device).eval()
    checks.check_finite(model, args.reward_model_path)  # a NaN reward model would score nothing
    chosen, rejected = [], []
    for start in range(0, len(dataset), args.local_micro_batch_size):
        batch = dataset[start : start + args.local_micro_batch_size]
        for key, out in (("query_chosen_token", chosen), ("query_rejected_token", rejected)):
            # unpadded query + response + EOS, right-padded: the reward sits before the first pad
            query_responses = torch.tensor(batch[key], device=device)  # (B, T)
            # shared pads cut
            query_responses = query_responses[:, real_columns(query_responses, tokenizer.pad_token_id)]
            _, rewards, _ = get_reward(model, query_responses, tokenizer.pad_token_id, 0)
            out.append(rewards.float().cpu())
    return torch.cat(chosen).numpy(), torch.cat(rejected).numpy()


def run_agreement(args: Args, output_dir: str, cache: ReplyCache) -> dict:
    if args.reward_model_path is None:
        raise RunError("agreement mode needs --reward_model_path")
    dataset = checks.load_split(args.preference_dataset, args.preference_split)
    if args.num_samples >= 0:
        dataset = dataset.select(range(min(args.num_samples, len(dataset))))
    r_chosen, r_rejected = reward_preferences(args, dataset)

    df = pd.DataFrame({"query": dataset["query"], "chosen": dataset["chosen"], "rejected": dataset["rejected"]})
    post = df["query"].map(str.strip)
    c = df["chosen"].map(lambda text: without_eos_text(text, args.strip_eos_text))
    r = df["rejected"].map(lambda text: without_eos_text(text, args.strip_eos_text))
    df["shuffled_index"] = [pair_order(args.seed, p, x, y) for p, x, y in zip(post, c, r)]  # 0: chosen is A
    # a pair whose two texts are identical holds no preference (the RM ties, the judge could only follow the
    # position): a tie, never sent to the judge, reported but left out of the agreement rate
    df["identical"] = c == r
    prompts = {i: pairwise_prompt(p, x, y) if s == 0 else pairwise_prompt(p, y, x)
               for i, (p, x, y, s, same) in enumerate(zip(post, c, r, df["shuffled_index"], df["identical"]))
               if not same}
    bar = tqdm(total=len(prompts), desc="judging pairs", dynamic_ncols=True)
    try:
        asked, stats = run_jobs(args, [(p, parse_verdict) for p in prompts.values()], lambda i, o: bar.update(1), cache)
    finally:
        bar.close()  # before any error, so the error is the last line printed
    outcomes = [Outcome("tie", None, "", 0)] * len(df)
    for i, outcome in zip(prompts, asked):
        outcomes[i] = outcome

    df["reward_chosen"], df["reward_rejected"] = r_chosen, r_rejected
    df["rm_prefers_chosen"] = r_chosen > r_rejected
    df["status"] = [o.status for o in outcomes]
    df["explanation"] = [o.parsed[1] if o.status == "ok" else "" for o in outcomes]
    df["preferred"] = [o.parsed[0] if o.status == "ok" else "" for o in outcomes]
    judge_chosen = [(o.parsed[0] == "A") == (s == 0) if o.status == "ok" else None
                    for o, s in zip(outcomes, df["shuffled_index"])]
    df["judge_prefers_chosen"] = judge_chosen
    valid = df[(df["status"] == "ok") & ~df["identical"]]
    agree = int((valid["judge_prefers_chosen"].astype(bool) == valid["rm_prefers_chosen"]).sum())
    judge_human = int(valid["judge_prefers_chosen"].astype(bool).sum())
    n = len(valid)
    saved(os.path.join(output_dir, "agreement_pairs.csv"), df.to_csv(index=False), args)
    low, high = wilson_interval(agree, n)
    result = {
        "agreement_rate": agree / n if n else None,  # Detail 17: RM and judge prefer the same summary
        "ci_low": none_if_nan(low),
        "ci_high": none_if_nan(high),
        "agree": agree,
        "n_valid": n,
        "invalid": int(((df["status"] != "ok") & ~df["identical"]).sum()),
        "n_identical": int(df["identical"].sum()),
        "n": int(len(df)),
        "judge_agrees_with_label": judge_human / n if n else None,  # judge vs the human choice
        # RM vs the human choice
        "rm_accuracy": (float(df.loc[~df["identical"], "rm_prefers_chosen"].mean())
                        if (~df["identical"]).any() else None),
        "reward_model_path": args.reward_model_path,
    }
    print(json.dumps(result, indent=2))
    return {"agreement": result, "stats": stats}


# ----------------------------------------------------------------------------------------------
# 7. Multi-answer mode (offline-RLHF seed): several answers scored 1-10 in one prompt.
# ----------------------------------------------------------------------------------------------
def run_multi(args: Args, output_dir: str, cache: ReplyCache) -> dict:
    if len(args.csv) < 2:
        raise RunError("multi mode needs at least two --csv files (the answers to compare)")
    labels = csv_labels(args.csv, args.labels)
    frames = [read_samples(p, ["query", "response"], -1) for p in args.csv]
    base = frames[0].iloc[: args.num_samples] if args.num_samples >= 0 else frames[0]
    answers_by_label = []
    for path, d in zip(args.csv, frames):
        lookup = dict(zip(d["query"][::-1], d["response"][::-1]))
        missing = [q for q in base["query"] if q not in lookup]
        if missing:
            raise RunError(f"{path} has no answer for {len(missing)} of the queries of {args.csv[0]}")
        answers_by_label.append([lookup[q] for q in base["query"]])

    names = [chr(ord("A") + k) for k in range(len(labels))]  # anonymous names: no model-name bias
    jobs, orders = {}, []
    for i, query in enumerate(base["query"]):
        question = query.strip()
        answers = [without_eos_text(answers_by_label[k][i], args.strip_eos_text) for k in range(len(labels))]
        order = list(range(len(labels)))
        pair_rng(args.seed, question, *answers).shuffle(order)  # presentation order, seeded per query
        orders.append(order)
        if len(set(answers)) > 1:  # answers all identical: a tie, not sent to the judge
            jobs[i] = (multi_answer_prompt(question, names, [answers[k] for k in order]),
                       lambda reply: parse_scores(reply, names))
    bar = tqdm(total=len(jobs), desc="scoring", dynamic_ncols=True)
    try:
        asked, stats = run_jobs(args, list(jobs.values()), lambda i, o: bar.update(1), cache)
    finally:
        bar.close()  # before any error, so the error is the last line printed
    outcomes = [Outcome("tie", None, "", 0)] * len(orders)
    for i, outcome in zip(jobs, asked):
        outcomes[i] = outcome

    rows = []
    for i, (outcome, order) in enumerate(zip(outcomes, orders)):
        row = {"query": base["query"].iloc[i], "status": outcome.status,
               "order": ",".join(labels[k] for k in order), "judge_reply": outcome.reply}
        if outcome.status == "tie":  # every answer shares the average rank; no 1-10 score was asked for
            for lab in labels:
                row[f"score/{lab}"] = float("nan")
                row[f"rank_score/{lab}"] = (len(labels) + 1) / 2
        if outcome.status == "ok":
            # the answer shown as names[j] is labels[order[j]]
            scores = {labels[order[j]]: outcome.parsed[names[j]] for j in range(len(names))}
            ranks = rank_normalised([scores[lab] for lab in labels])
            for lab, rank_score in zip(labels, ranks):
                row[f"score/{lab}"] = scores[lab]
                row[f"rank_score/{lab}"] = rank_score
        rows.append(row)
    table = pd.DataFrame(rows)
    saved(os.path.join(output_dir, "multi_scores.csv"), table.to_csv(index=False), args)
    valid = table[table["status"] == "ok"]
    ranked = table[table["status"].isin(["ok", "tie"])]  # a tie ranks every answer alike
    per_label = {}
    for lab in labels:
        per_label[lab] = {
            "mean_score": float(valid[f"score/{lab}"].mean()) if len(valid) else None,
            "mean_rank_score": float(ranked[f"rank_score/{lab}"].mean()) if len(ranked) else None,
            "n": int(len(valid)),
            "ties": int(len(ranked) - len(valid)),
        }
    lines = [f"Multi-answer scores (1-10) by `{args.model}`; rank score = N + 1 - rank (best = {len(labels)}).", "",
             "| model | mean score | mean rank score | n |", "| --- | --- | --- | --- |"]
    for lab, s in per_label.items():
        ms = "n/a" if s["mean_score"] is None else f"{s['mean_score']:.2f}"
        mr = "n/a" if s["mean_rank_score"] is None else f"{s['mean_rank_score']:.2f}"
        lines.append(f"| {lab} | {ms} | {mr} | {s['n']} |")
    lines.append(f"\ninvalid: {int(len(table) - len(ranked))} of {len(table)}; ties (every answer identical, not sent "
                 f"to the judge): {int(len(ranked) - len(valid))}")
    saved(os.path.join(output_dir, "multi_comparison.md"), "\n".join(lines) + "\n", args)
    print("\n".join(lines))
    return {"multi": per_label, "multi_invalid": int(len(table) - len(ranked)), "multi_n": int(len(table)),
            "stats": stats}


def main(args: Args) -> dict:
    start = time.monotonic()
    run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    output_dir = args.output_dir or os.path.join(args.run_dir_root, run_name)
    check_sources_complete(args, args.csv + ([args.baseline_csv] if args.baseline_csv else []))
    os.makedirs(output_dir, exist_ok=True)
    if args.max_parallel_requests < 1 or args.max_tries < 1 or args.max_parse_tries < 1:
        raise RunError("--max_parallel_requests, --max_tries and --max_parse_tries must be at least 1")
    # the API key is not an argument, so it is not here
    saved(os.path.join(output_dir, "args.json"), json.dumps(asdict(args), indent=2), args)

    cache = ReplyCache(args.cache_path)
    try:
        if args.mode == "pairwise":
            result = run_pairwise(args, output_dir, cache)
        elif args.mode == "agreement":
            result = run_agreement(args, output_dir, cache)
        else:
            result = run_multi(args, output_dir, cache)
    finally:
        cache.close()

    summary = {"mode": args.mode, "model": args.model, "base_url": public_url(args.base_url), "seed": args.seed,
               "ci": "95% Wilson score interval", **result, "wall_time_s": time.monotonic() - start}
    saved(os.path.join(output_dir, "judge_summary.json"), json.dumps(summary, indent=2), args)
    print(f"requests {result['stats']['requests']}, cache hits {result['stats']['cache_hits']}, "
          f"retries {result['stats']['retries']}, re-asks {result['stats']['reasks']}; outputs in {output_dir}")
    return summary


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True))
