"""Shared data preparation for TL;DR, Anthropic HH and the built-in synthetic task.

    python data/prepare.py --task synthetic --output_dir artifacts/synthetic      # built-in task
    python data/prepare.py --task tldr --output_dir data/processed/tldr            # the paper's data
    python data/prepare.py --task hh --output_dir data/processed/hh                # Anthropic HH

It writes processed `DatasetDict`s (`save_to_disk`) whose columns follow the reference
implementation, so every training script reads TL;DR, HH and the synthetic task alike:

    <output_dir>/sft/          train / validation / test      (SFT, PPO prompts; test: the hub's TL;DR test split,
                               or the built-in task's 600 posts from a random stream of their own, which the
                               leaderboard reports; HH has none: its hub test split is the validation here)
    <output_dir>/preference/   train / validation / validation_cnndm   (RM, DPO, ILQL)
    <output_dir>/unpaired/     train / validation   (KTO's thumbs up / down, with --unpaired or --unpaired_only)
    <output_dir>/plots/        token-length histograms (Figures 9-10 of the paper)
    <output_dir>/prep_summary.json

Details of the paper implemented here (seeds/003): 1 (policies, batch, split, confidence kept),
2 (paragraph truncation), 3 (" " + response + EOS, [PAD] != EOS), 4 (SFT and preference
responses have different lengths), 5 (queries left-padded, query+response right-padded),
6 (the validation split keeps its CNN/DM part apart).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from typing import Literal, Optional

import tyro

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


class InputError(ValueError):
    """A bad source file, row or flag; the message names the file (path:line), row or flag and the way on. Run as a
    script, it prints as one paragraph, `prepare.py: error: ...`, with a failed exit and no traceback
    (print_expected_error): the training scripts' RunError format, kept here, as data preparation imports nothing of
    rlhf_utils."""


def print_expected_error(kind, error, trace) -> None:
    """sys.excepthook when run as a script: an InputError prints as one paragraph; any other error its traceback."""
    if not isinstance(error, InputError):
        return sys.__excepthook__(kind, error, trace)
    print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr, flush=True)

CNNDM_BATCHES = ("batch0_cnndm", "cnndm0", "cnndm2")
TLDR_FORMAT = "SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"  # no trailing space (Detail 2)
CNNDM_FORMAT = "Article:\n{article}\n\nTL;DR:\n"


@dataclass
class Args:
    task: Literal["tldr", "hh", "synthetic"] = "tldr"
    """which data set to prepare"""
    output_dir: str = "data/processed/tldr"
    """where the processed DatasetDicts, plots and summary go"""
    base_model: str = "EleutherAI/pythia-1b-deduped"
    """model whose tokenizer tokenizes the data (for --task synthetic the tokenizer is trained here)"""
    sft_data: Optional[str] = None
    """local folder with `<split>.jsonl` / `<split>.parquet` files in the schema of
    `vwxyzjn/summarize_from_feedback_tldr_3_filtered`; None = load that hub dataset"""
    preference_data: Optional[str] = None
    """local folder with `<split>.jsonl` / `.parquet` files in the schema of `openai/summarize_from_feedback`
    (config `comparisons`); None = load that hub dataset"""
    hh_data: Optional[str] = None
    """local folder with `<split>.jsonl` / `.parquet` files in the schema of `Anthropic/hh-rlhf`; None = hub"""
    sft_dataset_name: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered"
    """hub name of the SFT data (TL;DR)"""
    preference_dataset_name: str = "openai/summarize_from_feedback"
    """hub name of the preference data (TL;DR), config `comparisons`"""
    hh_dataset_name: str = "Anthropic/hh-rlhf"
    """hub name of the HH data"""
    unpaired: bool = False
    """also prepare unpaired binary feedback (KTO) into <output_dir>/unpaired: rows of `prompt`, `completion` and a
    boolean `label` (true = desirable) from --unpaired_data or the hub's --unpaired_dataset_name; with --task
    synthetic, the built-in raters' thumbs up / down on every compared summary (written to <output_dir>/raw/feedback)"""
    unpaired_only: bool = False
    """prepare the unpaired feedback alone (as --unpaired) with the tokenizer of --base_model, leaving the other
    splits as they are; --task synthetic: of the task already prepared in --output_dir, whose comparisons are rated"""
    unpaired_data: Optional[str] = None
    """local folder with `<split>.jsonl` / `.parquet` files in the layout of the hub's KTO data sets (prompt,
    completion, label); None = load --unpaired_dataset_name"""
    unpaired_dataset_name: str = "trl-lib/kto-mix-14k"
    """hub name of unpaired feedback in the KTO layout (prompts and completions as text, or as chat messages, which
    are written as HH dialogues)"""
    truncation: Literal["paragraph", "token"] = "paragraph"
    """Detail 2: `paragraph` cuts the post at its last newline until the query fits; `token` cuts the
    post's tokens at the limit, mid-sentence (the ablation)"""
    pad_token: Literal["pad", "eos"] = "pad"
    """Detail 3: `pad` adds a dedicated [PAD] token; `eos` reuses EOS as the pad (the common practice,
    which masks EOS out of the SFT labels; for ablation only)"""
    query_length: Optional[int] = None
    """Detail 5: queries are left-padded to this many tokens (None = the task's: tldr 512, hh 512, synthetic 128)"""
    sft_response_length: Optional[int] = None
    """Detail 4: SFT reference responses (with EOS) fit in this many tokens (None = tldr 53, hh 256, synthetic 24);
    TL;DR query+response columns are 512 + 53 = 565 wide (the paper's (B, 562) is the longest such row in the real
    data; the extra columns are [PAD], which no loss reads)"""
    rm_response_length: Optional[int] = None
    """Detail 4: preference responses (with EOS) fit in this many tokens (None = tldr 169, hh 256, synthetic 32);
    TL;DR query+response columns are 512 + 169 = 681 wide (the paper's (B, 638) is the longest such row in the real
    data; the extra columns are [PAD])"""
    cnndm_query_length: Optional[int] = None
    """query length of the CNN/DM validation rows (None = 1866, so query+response = 2021; synthetic 192)"""
    cnndm_response_length: Optional[int] = None
    """response length of the CNN/DM validation rows (None = 155; synthetic 32)"""
    long_response_policy: Literal["drop", "error"] = "drop"
    """a response longer than its length: `drop` the row (counted and printed) or stop with an error.
    Responses are never cut: a cut response would lose its EOS and teach the model not to stop"""
    hh_mismatch_policy: Literal["drop", "error"] = "drop"
    """an HH pair whose chosen and rejected dialogues differ before the last assistant turn (so they share no
    query): `drop` the row (counted, the first rows named in the summary and the log) or stop with an error"""
    num_proc: Optional[int] = None
    """processes for `datasets.map` (the hub data has ~200k rows)"""
    plots: bool = True
    """write token-length histograms (Figures 9-10)"""
    push_to_hub: bool = False
    """push the processed data sets to the hub"""
    hf_entity: Optional[str] = None
    """hub user or organisation for --push_to_hub"""
    seed: int = 0
    """seed of the synthetic generator, tokenizer and base model"""
    synthetic_num_sft_train: int = 4000
    """synthetic task: SFT training posts"""
    synthetic_num_sft_eval: int = 400
    """synthetic task: SFT validation posts"""
    synthetic_num_sft_test: int = 600
    """synthetic task: SFT test posts, from a random stream of their own and sharing no prompt with train or
    validation (the leaderboard reports them; no setting is tuned on them)"""
    synthetic_num_pref_train: int = 6000
    """synthetic task: training comparisons"""
    synthetic_num_pref_valid: int = 1000
    """synthetic task: validation comparisons (30% of them pair policies never seen in train, Detail 6)"""
    synthetic_num_cnndm: int = 60
    """synthetic task: CNN/DM-style validation comparisons"""
    synthetic_vocab_size: int = 1024
    """synthetic task: BPE vocabulary size"""
    synthetic_hidden_size: int = 128
    """synthetic task: width of the tiny GPT-NeoX"""
    synthetic_num_layers: int = 4
    """synthetic task: depth of the tiny GPT-NeoX"""
    synthetic_warmup_steps: int = 600
    """synthetic task: language-model warm-up steps (batch 16) on fresh posts ending in the author's recap, so the
    base model knows the language and copies phrases before SFT, like Pythia; 0 = a random-init base
    (docs/usage.md, "Flags in depth")"""


# --------------------------------------------------------------------------------------------
# Raw rows: hub or local files in the hub schema, checked field by field
# --------------------------------------------------------------------------------------------
# the fields every raw row needs, and their types, per source schema (checked per row, named by its place)
TLDR_SFT_FIELDS = {"id": str, "subreddit": str, "title": str, "post": str, "summary": str}
TLDR_PREFERENCE_FIELDS = {"info": dict, "summaries": list, "choice": int, "batch": str}
HH_FIELDS = {"chosen": str, "rejected": str}


def check_json_lines(path: str, fields: Optional[dict]) -> None:
    """Bad input: a local JSON-lines split file is read here line by line before `datasets` sees it, so a line cut in
    the middle, a line that is not JSON, or a row that lacks a field of `fields` is one error naming path:line and
    what a row needs, raised before anything is saved (the loader would fail deep inside, naming neither). A .json
    file that parses whole (a JSON array) is left to the loader; blank lines are skipped, as the loader skips them."""
    if path.endswith(".json"):
        with contextlib.suppress(ValueError, UnicodeDecodeError), open(path, encoding="utf-8") as f:
            json.load(f)
            return
    need = f"each line must be one JSON object with the fields {sorted(fields)}" if fields else \
        "each line must be one JSON object"
    fix = "fix or remove that line (or download the file again); nothing was saved"
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as error:
                cut = " (the line ends early: cut in the middle?)" if not line.rstrip().endswith("}") else ""
                raise InputError(f"{where}: not valid JSON: {error.msg} at column {error.colno}{cut}; {need}; "
                                 f"{fix}") from None
            if not isinstance(row, dict):
                raise InputError(f"{where}: a JSON {type(row).__name__}, not an object; {need}; {fix}")
            try:
                check_fields(row, fields or {}, where + (f" (id {row['id']})" if "id" in row else ""))
            except ValueError as error:
                raise InputError(f"{error}; {fix}") from None


def load_raw(local: Optional[str], hub_name: str, config: Optional[str] = None, fields: Optional[dict] = None):
    """A DatasetDict of raw rows from a local folder (`<split>.jsonl|parquet`) or the hub. A local JSON-lines file is
    checked line by line first (check_json_lines: each line a JSON object with `fields`)."""
    from datasets import DatasetDict, load_dataset

    if local is None:
        return load_dataset(hub_name, config) if config else load_dataset(hub_name)
    if not os.path.isdir(local):
        raise FileNotFoundError(f"{local} is not a folder; "
                                "pass a folder holding <split>.jsonl or <split>.parquet files")
    data_files = {}
    for name in sorted(os.listdir(local)):
        stem, ext = os.path.splitext(name)
        if ext in (".jsonl", ".json", ".parquet"):
            data_files[stem] = os.path.join(local, name)
    if not data_files:
        raise FileNotFoundError(f"{local} holds no <split>.jsonl or <split>.parquet file")
    out = {}
    for split, path in data_files.items():
        kind = "parquet" if path.endswith(".parquet") else "json"
        if source_rows(path) == 0:
            check_not_empty(f"{split} ({path})", 0, 0, {})
        if kind == "json":
            check_json_lines(path, fields)
        out[split] = load_dataset(kind, data_files={split: path}, split=split)
    return DatasetDict(out)


def source_rows(path: str) -> int:
    """Rows of a local split file (0 for an empty one, which the loader cannot read), or -1 when unknown."""
    if os.path.getsize(path) == 0:
        return 0
    if path.endswith(".parquet"):
        import pyarrow.parquet

        return pyarrow.parquet.ParquetFile(path).metadata.num_rows
    with open(path, "rb") as f:
        return -1 if any(line.strip() for line in f) else 0


def check_fields(row: dict, fields: dict, where: str) -> None:
    """Raise a clear error naming the row and field when a required field is missing or mistyped."""
    for field, kinds in fields.items():
        if field not in row or row[field] is None:
            raise InputError(f"{where}: missing field {field!r}; every row needs {sorted(fields)}")
        if not isinstance(row[field], kinds):
            raise InputError(f"{where}: field {field!r} must be {kinds}, got {type(row[field]).__name__}")
        if isinstance(row[field], str) and not row[field].strip() and field not in ("title",):
            raise InputError(f"{where}: field {field!r} is empty; drop or fix this row in the source file")


# --------------------------------------------------------------------------------------------
# User text is text: the spelling of a special token in a post or summary is not that token
# --------------------------------------------------------------------------------------------
def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of text that came from data or a user. A post, title or summary may spell a special token
    (`<|endoftext|>` in quoted code or a copied chat log, `[PAD]`): the tokenizer's `split_special_tokens` turns
    such a spelling into the ordinary tokens of its characters, so the only special ids in the prepared data are
    the ones this file puts there (the [PAD] of Detail 5's padding, the EOS of Detail 3). No special token is added
    either (`add_special_tokens=False`): a BOS a tokenizer would prepend is not part of the text."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def special_spellings(tokenizer) -> list[str]:
    """The spellings of the tokenizer's special tokens (EOS, [PAD], BOS, UNK and any added special token)."""
    added = [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]
    return sorted({str(t) for t in list(tokenizer.all_special_tokens) + added if t})


def count_special_spelling_rows(texts_per_row, spellings: list[str], name: str, report: dict) -> None:
    """Count (in the prep report) the rows of split `name` whose text holds the spelling of a special token, and
    say so in the log; those spellings were tokenized as plain text (encode_text)."""
    n = sum(any(s in text for text in texts for s in spellings) for texts in texts_per_row)
    report[f"{name}_rows_with_special_token_text"] = n
    if n:
        print(f"[prepare] {name}: {n} rows hold the spelling of a special token ({', '.join(spellings)}); it is "
              "tokenized as the plain text it is, never as the special token")


# --------------------------------------------------------------------------------------------
# Detail 2: paragraph truncation; Detail 5: left-padded queries
# --------------------------------------------------------------------------------------------
def build_query(tokenizer, fields: dict, fmt: str, truncate_field: str, length: int, truncation: str,
                row_id: str) -> tuple[str, list[int], bool]:
    """Format a query and shorten `truncate_field` until it fits in `length` tokens.

    Detail 2 (`paragraph`): cut the field at its last "\\n" and re-tokenize, so the query stays
    coherent; the cut field keeps no trailing "\\r" or "\\n" (CRLF posts included). A field with no
    newline left loses characters from its end until it fits (`longest_fitting_prefix`). The ablation
    (`token`) cuts the field's tokens at the limit, mid-sentence. Returns (query, token ids, whether
    it was truncated)."""
    fields = dict(fields)
    text = fmt.format(**fields)
    tokens = encode_text(tokenizer, text)
    truncated = False
    while len(tokens) > length:
        truncated = True
        body = fields[truncate_field]
        if not body:
            raise InputError(
                f"row {row_id}: the query is {len(tokens)} tokens even with an empty {truncate_field}; "
                f"its other fields are longer than the query length {length}. Raise --query_length or drop the row."
            )
        if truncation == "paragraph":
            cut = body.rfind("\n")
            if cut >= 0:
                body = body[:cut].rstrip("\r\n")
            else:
                body = longest_fitting_prefix(tokenizer, fields, fmt, truncate_field, length)
        else:
            body_tokens = encode_text(tokenizer, body)
            body = tokenizer.decode(body_tokens[: max(0, len(body_tokens) - (len(tokens) - length))])
        fields[truncate_field] = body
        text = fmt.format(**fields)
        tokens = encode_text(tokenizer, text)
    return text, tokens, truncated


def longest_fitting_prefix(tokenizer, fields: dict, fmt: str, field: str, length: int) -> str:
    """The longest proper prefix of `fields[field]` whose query fits in `length` tokens ("" when none does): the
    cut that removing the field's last character until the query fits would give, without one tokenization per
    removed character. Token counts are not monotone in the prefix (half a word can take more tokens than the
    whole word), so a binary search could stop short of that cut. Instead, a query k tokens too long is shortened
    next by characters worth at least k UTF-8 bytes: the excess shrinks by a constant factor per try, and a post
    of thousands of characters takes a few dozen tokenizations. This skips no prefix that fits as long as removing
    a character of b bytes drops at most b tokens from the query (tests/test_data.py compares the two cuts)."""
    body = fields[field]
    cut = len(body) - 1  # the whole field is known not to fit
    while cut > 0:
        excess = len(encode_text(tokenizer, fmt.format(**{**fields, field: body[:cut]}))) - length
        if excess <= 0:
            return body[:cut]
        while excess > 0 and cut > 0:
            cut -= 1
            excess -= len(body[cut].encode("utf-8"))
    return ""


def left_pad(tokens: list[int], length: int, pad_id: int) -> list[int]:
    return [pad_id] * (length - len(tokens)) + tokens


def right_pad(tokens: list[int], length: int, pad_id: int) -> list[int]:
    return tokens + [pad_id] * (length - len(tokens))


def response_tokens(tokenizer, text: str) -> list[int]:
    """Detail 3: a response is " " + text + EOS (the query ends with "TL;DR:" and no space). The EOS id is the one
    this function appends; an EOS spelled inside the text stays text (encode_text)."""
    return encode_text(tokenizer, " " + text.strip()) + [tokenizer.eos_token_id]


def process_sft_row(row: dict, tokenizer, args: Args, where: str) -> dict:
    """One SFT row -> the processed columns (query left-padded, query+reference right-padded)."""
    pad = tokenizer.pad_token_id
    query, q_tokens, truncated = build_query(
        tokenizer, {k: row[k] for k in ("subreddit", "title", "post")}, TLDR_FORMAT, "post",
        args.query_length, args.truncation, where)
    r_tokens = response_tokens(tokenizer, row["summary"])
    too_long = len(r_tokens) > args.sft_response_length
    if too_long and args.long_response_policy == "error":
        raise InputError(f"{where}: the reference response is {len(r_tokens)} tokens > --sft_response_length "
                         f"{args.sft_response_length}; raise the length or use --long_response_policy drop")
    r_tokens = r_tokens[: args.sft_response_length]  # only rows flagged too_long are affected, and they are dropped
    total = args.query_length + args.sft_response_length
    qr = q_tokens + r_tokens
    return {
        "query": query,
        "query_token": left_pad(q_tokens, args.query_length, pad),
        "query_token_len": len(q_tokens),
        "query_truncated": truncated,
        "reference_response": " " + row["summary"].strip(),
        "reference_response_token": right_pad(r_tokens, args.sft_response_length, pad),
        "reference_response_token_len": len(r_tokens),
        "query_reference_response": query + " " + row["summary"].strip(),
        "query_reference_response_token": right_pad(qr, total, pad),
        "query_reference_response_token_response_label": right_pad([pad] * len(q_tokens) + r_tokens, total, pad),
        "query_reference_response_token_len": len(qr),
        "response_too_long": too_long,
    }


def process_preference_row(row: dict, tokenizer, args: Args, where: str) -> dict:
    """One comparison row -> chosen/rejected columns (Detail 1 keeps policies, batch, split, confidence)."""
    pad = tokenizer.pad_token_id
    info = row["info"]
    is_cnndm = row["batch"] in CNNDM_BATCHES
    if is_cnndm:
        check_fields(info, {"article": str}, f"{where} (info)")
        query, q_tokens, truncated = build_query(
            tokenizer, {"article": info["article"]}, CNNDM_FORMAT, "article", args.cnndm_query_length,
            args.truncation, where)
        q_len, r_len = args.cnndm_query_length, args.cnndm_response_length
    else:
        check_fields(info, {"post": str, "title": str, "subreddit": str}, f"{where} (info)")
        query, q_tokens, truncated = build_query(
            tokenizer, {k: info[k] for k in ("subreddit", "title", "post")}, TLDR_FORMAT, "post",
            args.query_length, args.truncation, where)
        q_len, r_len = args.query_length, args.rm_response_length
    summaries = row["summaries"]
    if len(summaries) != 2 or row["choice"] not in (0, 1):
        raise InputError(f"{where}: a comparison needs exactly 2 summaries and choice 0 or 1")
    for i, s in enumerate(summaries):
        if not isinstance(s.get("text"), str) or not s["text"].strip():
            raise InputError(f"{where}: summaries[{i}].text must be a non-empty string")
    chosen, rejected = summaries[row["choice"]], summaries[1 - row["choice"]]
    c_tokens, r_tokens = response_tokens(tokenizer, chosen["text"]), response_tokens(tokenizer, rejected["text"])
    too_long = max(len(c_tokens), len(r_tokens)) > r_len
    if too_long and args.long_response_policy == "error":
        raise InputError(f"{where}: a response is {max(len(c_tokens), len(r_tokens))} tokens > {r_len}; "
                         "raise --rm_response_length or use --long_response_policy drop")
    c_tokens, r_tokens = c_tokens[:r_len], r_tokens[:r_len]
    total = q_len + r_len
    confidence = (row.get("extra") or {}).get("confidence")
    out = {
        "query": query,
        "query_token": left_pad(q_tokens, q_len, pad),
        "query_token_len": len(q_tokens),
        "query_truncated": truncated,
        "chosen": " " + chosen["text"].strip(),
        "chosen_token": right_pad(c_tokens, r_len, pad),
        "chosen_token_len": len(c_tokens),
        "rejected": " " + rejected["text"].strip(),
        "rejected_token": right_pad(r_tokens, r_len, pad),
        "rejected_token_len": len(r_tokens),
        "chosen_policy": chosen.get("policy") or "",
        "rejected_policy": rejected.get("policy") or "",
        "confidence": int(confidence) if confidence is not None else -1,
        "is_cnndm": is_cnndm,
        "response_too_long": too_long,
    }
    for name, toks in (("chosen", c_tokens), ("rejected", r_tokens)):
        out[f"query_{name}_token"] = right_pad(q_tokens + toks, total, pad)
        out[f"query_{name}_token_len"] = len(q_tokens) + len(toks)
        out[f"query_{name}_token_response_label"] = right_pad([pad] * len(q_tokens) + toks, total, pad)
    return out


# --------------------------------------------------------------------------------------------
# HH: split a dialogue into (query = everything through the last "\n\nAssistant:", response)
# --------------------------------------------------------------------------------------------
ASSISTANT, HUMAN = "\n\nAssistant:", "\n\nHuman:"


def hh_pair_problem(chosen: str, rejected: str) -> Optional[str]:
    """Why an HH pair cannot be split into one query and two responses, or None when it can."""
    c_cut, r_cut = chosen.rfind(ASSISTANT), rejected.rfind(ASSISTANT)
    if c_cut < 0 or r_cut < 0:
        return "a dialogue has no '\\n\\nAssistant:' turn"
    if chosen[: c_cut + len(ASSISTANT)] != rejected[: r_cut + len(ASSISTANT)]:
        return "chosen and rejected dialogues differ before their last assistant turn"
    return None


def split_hh(chosen: str, rejected: str, where: str) -> tuple[str, str, str]:
    """(query, chosen response, rejected response) of one HH pair. Both dialogues must share the prefix
    through their last assistant turn; the responses are what follows it."""
    problem = hh_pair_problem(chosen, rejected)
    if problem is not None:
        raise InputError(f"{where}: {problem}")
    c_cut, r_cut = chosen.rfind(ASSISTANT), rejected.rfind(ASSISTANT)
    return chosen[: c_cut + len(ASSISTANT)], chosen[c_cut + len(ASSISTANT):], rejected[r_cut + len(ASSISTANT):]


def truncate_hh_query(tokenizer, query: str, length: int, where: str) -> tuple[str, list[int], bool]:
    """The HH analogue of paragraph truncation: drop the oldest turns (a Human turn and the reply after
    it) until the query fits; the last human turn is never dropped."""
    tokens = encode_text(tokenizer, query)
    truncated = False
    while len(tokens) > length:
        truncated = True
        starts = [i for i in range(len(query)) if query.startswith(HUMAN, i)]
        if len(starts) < 2:
            raise InputError(f"row {where}: the last human turn alone is {len(tokens)} tokens > query length "
                             f"{length}; raise --query_length or drop the row")
        query = query[starts[1]:]
        tokens = encode_text(tokenizer, query)
    return query, tokens, truncated


def process_hh_row(row: dict, tokenizer, args: Args, where: str) -> dict:
    check_fields(row, {"chosen": str, "rejected": str}, where)
    query, chosen, rejected = split_hh(row["chosen"], row["rejected"], where)
    query, q_tokens, truncated = truncate_hh_query(tokenizer, query, args.query_length, where)
    fake = {  # the comparison schema, so one function builds the columns
        "info": {"post": query, "title": "", "subreddit": ""},
        "summaries": [{"text": chosen, "policy": "chosen"}, {"text": rejected, "policy": "rejected"}],
        "choice": 0, "batch": "hh", "extra": {},
    }
    pad = tokenizer.pad_token_id
    c_tokens, r_tokens = response_tokens(tokenizer, chosen), response_tokens(tokenizer, rejected)
    r_len = args.rm_response_length
    too_long = max(len(c_tokens), len(r_tokens)) > r_len
    if too_long and args.long_response_policy == "error":
        raise InputError(f"{where}: a response is longer than --rm_response_length {r_len}")
    c_tokens, r_tokens = c_tokens[:r_len], r_tokens[:r_len]
    total = args.query_length + r_len
    out = {
        "query": query, "query_token": left_pad(q_tokens, args.query_length, pad), "query_token_len": len(q_tokens),
        "query_truncated": truncated,
        "chosen": " " + chosen.strip(), "chosen_token": right_pad(c_tokens, r_len, pad),
        "chosen_token_len": len(c_tokens),
        "rejected": " " + rejected.strip(), "rejected_token": right_pad(r_tokens, r_len, pad),
        "rejected_token_len": len(r_tokens), "chosen_policy": "chosen", "rejected_policy": "rejected",
        "confidence": -1, "is_cnndm": False, "response_too_long": too_long,
        "info": fake["info"], "summaries": fake["summaries"], "choice": 0, "batch": "hh", "split": "",
        "worker": "", "extra": {"confidence": None},
    }
    for name, toks in (("chosen", c_tokens), ("rejected", r_tokens)):
        out[f"query_{name}_token"] = right_pad(q_tokens + toks, total, pad)
        out[f"query_{name}_token_len"] = len(q_tokens) + len(toks)
        out[f"query_{name}_token_response_label"] = right_pad([pad] * len(q_tokens) + toks, total, pad)
    return out


def hh_sft_row(row: dict, tokenizer, args: Args, where: str) -> dict:
    """SFT rows of HH come from the chosen dialogues: query + the chosen final reply."""
    check_fields(row, {"chosen": str, "rejected": str}, where)
    query, chosen, _ = split_hh(row["chosen"], row["rejected"], where)
    query, q_tokens, truncated = truncate_hh_query(tokenizer, query, args.query_length, where)
    pad = tokenizer.pad_token_id
    r_tokens = response_tokens(tokenizer, chosen)
    too_long = len(r_tokens) > args.sft_response_length
    if too_long and args.long_response_policy == "error":
        raise InputError(f"{where}: the chosen reply is longer than --sft_response_length {args.sft_response_length}")
    r_tokens = r_tokens[: args.sft_response_length]
    total = args.query_length + args.sft_response_length
    return {
        "id": where, "subreddit": "", "title": "", "post": query, "summary": chosen.strip(),
        "query": query, "query_token": left_pad(q_tokens, args.query_length, pad), "query_token_len": len(q_tokens),
        "query_truncated": truncated,
        "reference_response": " " + chosen.strip(),
        "reference_response_token": right_pad(r_tokens, args.sft_response_length, pad),
        "reference_response_token_len": len(r_tokens),
        "query_reference_response": query + " " + chosen.strip(),
        "query_reference_response_token": right_pad(q_tokens + r_tokens, total, pad),
        "query_reference_response_token_response_label": right_pad([pad] * len(q_tokens) + r_tokens, total, pad),
        "query_reference_response_token_len": len(q_tokens) + len(r_tokens),
        "response_too_long": too_long,
    }


# --------------------------------------------------------------------------------------------
# Unpaired binary feedback (KTO): prompt, completion, label -> one query and one labelled response
# --------------------------------------------------------------------------------------------
FEEDBACK_FIX = ("every row of unpaired feedback needs `prompt` (text), `completion` (non-empty text) and `label` "
                "(true = desirable, false = undesirable, as JSON booleans); fix the row or remove it from the file")


def feedback_sources(args: Args) -> dict:
    """{split: (where its rows come from, [(where a row is, the row)])} of the unpaired feedback: the local files of
    --unpaired_data (a .jsonl file is read line by line, so a bad row is named by its line, not by a type error of
    the loader), else the hub's --unpaired_dataset_name."""
    if args.unpaired_data is None:
        from datasets import load_dataset

        return {split: (f"{args.unpaired_dataset_name} split {split!r}", [
            (f"{args.unpaired_dataset_name} split {split!r} row {i}", row) for i, row in enumerate(ds.to_list())])
            for split, ds in load_dataset(args.unpaired_dataset_name).items()}
    if not os.path.isdir(args.unpaired_data):
        raise FileNotFoundError(f"{args.unpaired_data} is not a folder; pass a folder holding <split>.jsonl files")
    sources = {}
    for name in sorted(os.listdir(args.unpaired_data)):
        path, (split, ext) = os.path.join(args.unpaired_data, name), os.path.splitext(name)
        if ext == ".jsonl":
            rows = []
            with open(path) as f:
                for line_number, line in enumerate(f, 1):
                    if line.strip():
                        where = f"{path} row {len(rows)} (line {line_number})"
                        try:
                            rows.append((where, json.loads(line)))
                        except json.JSONDecodeError as error:
                            raise InputError(f"{where}: not a JSON object ({error}); {FEEDBACK_FIX}") from None
            sources[split] = (path, rows)
        elif ext == ".parquet":
            import pyarrow.parquet

            sources[split] = (path, [(f"{path} row {i}", row)
                                     for i, row in enumerate(pyarrow.parquet.read_table(path).to_pylist())])
    if not sources:
        raise FileNotFoundError(f"{args.unpaired_data} holds no <split>.jsonl or <split>.parquet file")
    return sources


def as_text(value, field: str, where: str, prompt: bool):
    """A prompt or completion as text; chat messages ([{"role", "content"}, ...], the conversational layout) become
    an HH dialogue ("\n\nHuman: ...\n\nAssistant: ..."), a prompt ending with "\n\nAssistant:"."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in value):
        names = {"user": "Human", "assistant": "Assistant"}
        if not prompt:
            return " ".join(m["content"] for m in value)
        return "".join(f"\n\n{names.get(m.get('role'), str(m.get('role')).capitalize())}: {m['content']}"
                       for m in value) + ASSISTANT
    raise InputError(f"{where}: {field!r} is {type(value).__name__}, not text (or a list of chat messages); "
                     f"{FEEDBACK_FIX}")


def check_feedback_row(row, where: str) -> tuple[str, str, bool]:
    """(prompt, completion, label) of one row of unpaired feedback, or a clear error naming the row and the fix."""
    if not isinstance(row, dict):
        raise InputError(f"{where}: a row must be a JSON object, got {type(row).__name__}; {FEEDBACK_FIX}")
    missing = [field for field in ("prompt", "completion", "label") if row.get(field) is None]
    if missing:
        raise InputError(f"{where}: missing {', '.join(map(repr, missing))} (the row has {sorted(row)}); "
                         f"{FEEDBACK_FIX}")
    if not isinstance(row["label"], bool):
        raise InputError(f"{where}: label is {row['label']!r} ({type(row['label']).__name__}), not a boolean; write it "
                         f"as true (desirable) or false (undesirable)")
    prompt, completion = (as_text(row["prompt"], "prompt", where, True),
                          as_text(row["completion"], "completion", where, False))
    if not completion.strip():
        raise InputError(f"{where}: the completion is empty; a rated response cannot be empty: {FEEDBACK_FIX}")
    return prompt, completion, row["label"]


TLDR_FIELDS = re.compile(r"SUBREDDIT: r/(?P<subreddit>.*?)\n\nTITLE: (?P<title>.*?)\n\nPOST: (?P<post>.*)"
                         r"\n\nTL;DR:", re.S)


def process_feedback_row(prompt: str, completion: str, label: bool, tokenizer, args: Args, where: str) -> dict:
    """One labelled completion -> the query left-padded to --query_length (Detail 5) and the completion as
    " " + text + EOS (Detail 3) right-padded to --rm_response_length, as the preference responses are. A prompt in
    the TL;DR query format is cut at its post's last paragraph (Detail 2, as the SFT and preference queries are); an
    HH dialogue loses its oldest turns; any other prompt is cut at its last paragraph too."""
    pad = tokenizer.pad_token_id
    tldr = TLDR_FIELDS.fullmatch(prompt)
    if tldr:
        query, q_tokens, truncated = build_query(tokenizer, tldr.groupdict(), TLDR_FORMAT, "post", args.query_length,
                                                 args.truncation, where)
    elif prompt.startswith(HUMAN) and prompt.endswith(ASSISTANT):
        query, q_tokens, truncated = truncate_hh_query(tokenizer, prompt, args.query_length, where)
    else:
        query, q_tokens, truncated = build_query(tokenizer, {"prompt": prompt}, "{prompt}", "prompt", args.query_length,
                                                 args.truncation, where)
    c_tokens = response_tokens(tokenizer, completion)
    too_long = len(c_tokens) > args.rm_response_length
    if too_long and args.long_response_policy == "error":
        raise InputError(f"{where}: the completion is {len(c_tokens)} tokens > --rm_response_length "
                         f"{args.rm_response_length}; raise the length or use --long_response_policy drop")
    c_tokens = c_tokens[: args.rm_response_length]  # only rows flagged too_long are affected, and they are dropped
    return {
        "prompt": prompt, "completion": " " + completion.strip(), "label": label,
        "query": query, "query_token": left_pad(q_tokens, args.query_length, pad), "query_token_len": len(q_tokens),
        "query_truncated": truncated, "completion_token": right_pad(c_tokens, args.rm_response_length, pad),
        "completion_token_len": len(c_tokens), "response_too_long": too_long,
    }


def prepare_unpaired(args: Args, tokenizer) -> dict:
    """Every split of the unpaired feedback, checked row by row, tokenized (process_feedback_row), rows whose
    completion is too long dropped; returns {"unpaired": DatasetDict, "report": counts}."""
    from datasets import Dataset, DatasetDict

    report: dict = {}
    spellings = special_spellings(tokenizer)
    out = {}
    for split, (where, rows) in feedback_sources(args).items():
        check_not_empty(f"unpaired/{split} ({where})", len(rows), len(rows), {})
        checked = [(row_where, check_feedback_row(row, row_where)) for row_where, row in rows]
        count_special_spelling_rows(([p, c] for _, (p, c, _) in checked), spellings, f"unpaired/{split}", report)
        ds = Dataset.from_list([process_feedback_row(*row, tokenizer, args, row_where) for row_where, row in checked])
        report[f"unpaired/{split}_truncated_queries"] = int(sum(ds["query_truncated"]))
        ds = drop_long(ds, f"unpaired/{split}", report)
        check_not_empty(f"unpaired/{split} ({where})", len(ds), len(rows),
                        {LONG.format(flag="rm_response_length"): report[f"unpaired/{split}_dropped_long_response"]})
        report[f"unpaired/{split}_desirable_share"] = round(sum(ds["label"]) / len(ds), 4)
        out[split] = ds
    return {"unpaired": DatasetDict(out), "report": report}


def build_synthetic_feedback(args: Args) -> dict:
    """--task synthetic with --unpaired: the built-in raters' thumbs on every summary of the task's comparisons
    (raw/comparisons), written in the hub's KTO layout to raw/feedback and read from there like any local data."""
    from data import synthetic

    raw_dir = os.path.join(args.output_dir, "raw")
    info = synthetic.generate_feedback(os.path.join(raw_dir, "comparisons"), os.path.join(raw_dir, "feedback"),
                                       TLDR_FORMAT, seed=args.seed)
    args.unpaired_data = os.path.join(raw_dir, "feedback")
    return info


def save_unpaired(args: Args, tokenizer, feedback_info: dict) -> dict:
    """Prepare the unpaired feedback, save it to <output_dir>/unpaired with the tokenizer's fingerprint (as every
    split) and write <output_dir>/unpaired_summary.json."""
    result = prepare_unpaired(args, tokenizer)
    record = json.dumps({"prepared_by": "data/prepare.py", "task": args.task,
                         "tokenizer": {"name_or_path": args.base_model, **tokenizer_fingerprint(tokenizer)}})
    for dataset in result["unpaired"].values():
        dataset.info.description = record
    result["unpaired"].save_to_disk(os.path.join(args.output_dir, "unpaired"))
    summary = {"source": args.unpaired_data or args.unpaired_dataset_name,
               "rows": {f"unpaired/{split}": len(ds) for split, ds in result["unpaired"].items()},
               "report": result["report"], "built_in_raters": feedback_info}
    with open(os.path.join(args.output_dir, "unpaired_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    for key, value in {**summary["rows"], **summary["report"]}.items():
        print(f"  {key:40s} {value}")
    return summary


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------
def load_tokenizer(args: Args):
    """The tokenizer of --base_model with Detail 3's [PAD] (or EOS-as-pad for the ablation)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.base_model, trust_remote_code=False)
    if args.pad_token == "eos":
        tokenizer.pad_token = tokenizer.eos_token
    elif tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})  # Pythia ships no pad token
    return tokenizer


def map_rows(dataset, fn, tokenizer, args: Args, id_of, desc: str):
    """Apply a row function with a progress bar; the row id goes into every error message."""
    def wrapped(row, idx):
        return fn(row, tokenizer, args, f"{desc} row {idx} (id {id_of(row, idx)})")
    return dataset.map(wrapped, with_indices=True, num_proc=args.num_proc, desc=desc)


def drop_long(dataset, name: str, report: dict):
    n_long = sum(dataset["response_too_long"])
    report[f"{name}_dropped_long_response"] = n_long
    if n_long:
        print(f"[prepare] {name}: dropped {n_long} rows whose response exceeds its length "
              "(--long_response_policy drop)")
    return dataset.filter(lambda r: not r["response_too_long"]).remove_columns("response_too_long")


def check_not_empty(name: str, kept: int, read: int, dropped: dict) -> None:
    """Bad input: a split that ends with no row would be saved empty and fail later (or train on nothing). One
    error, raised before anything is saved, says how many rows were read and how many were dropped for which
    reason (`dropped`: reason -> count)."""
    if kept:
        return
    if read == 0:
        raise InputError(f"{name}: the source split holds no rows; nothing was saved. "
                         "Add rows to it or remove its file")
    reasons = "; ".join(f"{count} {why}" for why, count in dropped.items() if count)
    raise InputError(f"{name}: no row is left of the {read} rows read ({reasons or 'none dropped'}); nothing was "
                     "saved. Fix the source rows or the flags named here, or remove the split's file")


LONG = ("dropped: response longer than --{flag} (--long_response_policy drop; raise the length or shorten "
        "the responses)")


def prepare_tldr(args: Args, tokenizer) -> dict:
    from datasets import DatasetDict

    report: dict = {}
    spellings = special_spellings(tokenizer)
    raw_sft = load_raw(args.sft_data, args.sft_dataset_name, fields=TLDR_SFT_FIELDS)
    sft = {}
    for split, ds in raw_sft.items():
        read = len(ds)
        check_not_empty(f"sft/{split}", read, read, {})
        def check(row, idx, split=split):
            check_fields(row, TLDR_SFT_FIELDS,
                         f"sft/{split} row {idx} (id {row.get('id')})")
            return row
        ds = ds.map(check, with_indices=True, desc=f"check sft/{split}")
        count_special_spelling_rows(zip(ds["subreddit"], ds["title"], ds["post"], ds["summary"]), spellings,
                                    f"sft/{split}", report)
        ds = map_rows(ds, process_sft_row, tokenizer, args, lambda r, i: r["id"], f"sft/{split}")
        report[f"sft/{split}_truncated_queries"] = int(sum(ds["query_truncated"]))
        sft[split] = drop_long(ds, f"sft/{split}", report)
        check_not_empty(f"sft/{split}", len(sft[split]), read,
                        {LONG.format(flag="sft_response_length"): report[f"sft/{split}_dropped_long_response"]})
    raw_pref = load_raw(args.preference_data, args.preference_dataset_name, "comparisons",
                        fields=TLDR_PREFERENCE_FIELDS)
    pref = {}
    for split, ds in raw_pref.items():
        read = len(ds)
        check_not_empty(f"preference/{split}", read, read, {})
        def check(row, idx, split=split):
            check_fields(row, TLDR_PREFERENCE_FIELDS,
                         f"preference/{split} row {idx}")
            return row
        ds = ds.map(check, with_indices=True, desc=f"check preference/{split}")
        count_special_spelling_rows(
            ([str(v) for k, v in info.items() if k in ("post", "title", "subreddit", "article") and v]
             + [str(s.get("text") or "") for s in summaries] for info, summaries in zip(ds["info"], ds["summaries"])),
            spellings, f"preference/{split}", report)
        ds = map_rows(ds, process_preference_row, tokenizer, args, lambda r, i: r["info"].get("id"),
                      f"preference/{split}")
        ds = drop_long(ds, f"preference/{split}", report)
        dropped = {LONG.format(flag="rm_response_length"): report[f"preference/{split}_dropped_long_response"]}
        if split == "validation":  # Detail 6: keep the CNN/DM batches apart
            pref["validation_cnndm"] = ds.filter(lambda r: r["is_cnndm"])
            ds = ds.filter(lambda r: not r["is_cnndm"])
            dropped["moved to validation_cnndm (CNN/DM batches, Detail 6)"] = len(pref["validation_cnndm"])
        check_not_empty(f"preference/{split}", len(ds), read, dropped)
        report[f"preference/{split}_truncated_queries"] = int(sum(ds["query_truncated"]))
        pref[split] = ds
    return {"sft": DatasetDict(sft), "preference": DatasetDict({k: v for k, v in pref.items() if len(v)}),
            "report": report}


def drop_mismatched_hh(ds, name: str, args: Args, report: dict):
    """The Anthropic HH data holds pairs whose two dialogues differ before the last assistant turn (or lack
    one), so they share no query. `--hh_mismatch_policy drop` leaves them out, counts them and names the first
    few rows (by their row in the raw split) in the report and the log; `error` stops at the first one. Returns
    the kept rows and, for each kept row, its row in the raw split (so later errors name the raw row)."""
    def problem(row, idx):
        check_fields(row, HH_FIELDS, f"hh/{name} row {idx}")
        return {"problem": hh_pair_problem(row["chosen"], row["rejected"]) or ""}

    problems = ds.map(problem, with_indices=True, remove_columns=ds.column_names, num_proc=args.num_proc,
                      desc=f"check hh/{name}")["problem"]
    bad = [i for i, p in enumerate(problems) if p]
    report[f"hh/{name}_dropped_mismatched_pairs"] = len(bad)
    if not bad:
        return ds, range(len(ds))
    if args.hh_mismatch_policy == "error":
        raise InputError(f"hh/{name} row {bad[0]}: {problems[bad[0]]} (rows of hh/{name} that share no query: "
                         f"{len(bad)} of {len(ds)}); fix or remove them in the source, or leave them out with "
                         "--hh_mismatch_policy drop")
    report[f"hh/{name}_mismatched_pair_rows"] = bad[:5]
    shown = ", ".join(f"row {i} ({problems[i]})" for i in bad[:3])
    print(f"[prepare] hh/{name}: dropped {len(bad)} of {len(ds)} pairs that share no query, e.g. {shown} "
          "(--hh_mismatch_policy drop)")
    bad_rows = set(bad)
    keep = [i for i in range(len(ds)) if i not in bad_rows]
    return ds.select(keep), keep


def prepare_hh(args: Args, tokenizer) -> dict:
    from datasets import DatasetDict

    report: dict = {}
    spellings = special_spellings(tokenizer)
    raw = load_raw(args.hh_data, args.hh_dataset_name, fields=HH_FIELDS)
    sft, pref = {}, {}
    for split, ds in raw.items():
        name = "validation" if split == "test" else split
        read = len(ds)
        check_not_empty(f"hh/{name}", read, read, {})
        ds, raw_row = drop_mismatched_hh(ds, name, args, report)
        mismatched = {"dropped: chosen and rejected share no query (--hh_mismatch_policy drop)":
                      report[f"hh/{name}_dropped_mismatched_pairs"]}
        check_not_empty(f"hh/{name}", len(ds), read, mismatched)
        count_special_spelling_rows(zip(ds["chosen"], ds["rejected"]), spellings, f"hh/{name}", report)
        s = map_rows(ds, hh_sft_row, tokenizer, args, lambda r, i: raw_row[i], f"hh-sft/{name}")
        s = s.remove_columns([c for c in ds.column_names if c in ("chosen", "rejected")])
        report[f"sft/{name}_truncated_queries"] = int(sum(s["query_truncated"]))
        sft[name] = drop_long(s, f"sft/{name}", report)
        check_not_empty(f"sft/{name} (HH)", len(sft[name]), read, {
            **mismatched, LONG.format(flag="sft_response_length"): report[f"sft/{name}_dropped_long_response"]})
        p = ds.map(lambda r, i: process_hh_row(r, tokenizer, args, f"hh/{name} row {raw_row[i]}"), with_indices=True,
                   remove_columns=ds.column_names, num_proc=args.num_proc, desc=f"hh/{name}")
        report[f"preference/{name}_truncated_queries"] = int(sum(p["query_truncated"]))
        pref[name] = drop_long(p, f"preference/{name}", report)
        check_not_empty(f"preference/{name} (HH)", len(pref[name]), read, {
            **mismatched, LONG.format(flag="rm_response_length"): report[f"preference/{name}_dropped_long_response"]})
    return {"sft": DatasetDict(sft), "preference": DatasetDict(pref), "report": report}


def plot_lengths(result: dict, out_dir: str, args: Args) -> str:
    """Figures 9-10: token lengths of SFT references and of chosen / rejected responses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    sft_train = result["sft"]["train"]
    axes[0].hist(sft_train["query_token_len"], bins=40, color="tab:gray")
    axes[0].axvline(args.query_length, color="red", ls="--", label="query length")
    axes[0].set(title="SFT train: query tokens", xlabel="tokens", ylabel="rows")
    axes[1].hist(sft_train["reference_response_token_len"], bins=40, color="tab:blue")
    axes[1].axvline(args.sft_response_length, color="red", ls="--", label="SFT response length")
    axes[1].set(title="SFT train: reference response tokens (Detail 4)", xlabel="tokens")
    pref = result["preference"]["train"]
    axes[2].hist(pref["chosen_token_len"], bins=40, alpha=0.6, label="chosen")
    axes[2].hist(pref["rejected_token_len"], bins=40, alpha=0.6, label="rejected")
    axes[2].axvline(args.rm_response_length, color="red", ls="--", label="RM response length")
    axes[2].set(title="preference train: response tokens (Detail 4)", xlabel="tokens")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, "plots", "token_lengths.png")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def build_synthetic(args: Args) -> dict:
    """Raw rows + tokenizer + tiny (warmed-up) base model for the built-in task, then point the regular
    TL;DR code path at them."""
    from data import synthetic

    raw_dir = os.path.join(args.output_dir, "raw")
    info = synthetic.generate_raw(
        raw_dir, seed=args.seed, num_sft_train=args.synthetic_num_sft_train, num_sft_eval=args.synthetic_num_sft_eval,
        num_pref_train=args.synthetic_num_pref_train, num_pref_valid=args.synthetic_num_pref_valid,
        num_cnndm=args.synthetic_num_cnndm, num_sft_test=args.synthetic_num_sft_test)
    texts = []
    for name in ("sft/train.jsonl", "comparisons/train.jsonl"):
        with open(os.path.join(raw_dir, name)) as f:
            for line in f:
                row = json.loads(line)
                if "post" in row:
                    texts.append(TLDR_FORMAT.format(**row) + " " + row["summary"])
                else:
                    texts.extend(" " + s["text"].strip() for s in row["summaries"])
    texts += synthetic.pretraining_documents(2000, args.seed)  # the warm-up text's words are in the vocabulary too
    tokenizer = synthetic.train_tokenizer(texts, vocab_size=args.synthetic_vocab_size)
    if args.pad_token == "eos":
        tokenizer.pad_token = tokenizer.eos_token
    model = synthetic.build_base_model(len(tokenizer), hidden_size=args.synthetic_hidden_size,
                                       num_layers=args.synthetic_num_layers, seed=args.seed)
    model.config.pad_token_id = tokenizer.pad_token_id
    if args.synthetic_warmup_steps > 0:
        docs = synthetic.pretraining_documents(args.synthetic_warmup_steps * 16, args.seed)
        warmup_lm(model, tokenizer, docs, args.synthetic_warmup_steps, args.seed)
    base_dir = os.path.join(args.output_dir, "base_model")
    model.save_pretrained(base_dir, safe_serialization=True)
    tokenizer.save_pretrained(base_dir)
    n_params = sum(p.numel() for p in model.parameters())
    args.sft_data = os.path.join(raw_dir, "sft")
    args.preference_data = os.path.join(raw_dir, "comparisons")
    args.base_model = base_dir
    return {"ceiling": info["ceiling"], "raw_counts": info["counts"], "vocab_size": len(tokenizer),
            "base_model_parameters": n_params}


def warmup_lm(model, tokenizer, texts: list[str], steps: int, seed: int, batch_size: int = 16, max_len: int = 192):
    """A short next-token warm-up, the tiny stand-in for Pythia's pre-training. One document per row
    (padded, pads masked out of the loss), so a post and its recap are always seen together."""
    import torch
    from tqdm.auto import tqdm

    encoded = [encode_text(tokenizer, t)[: max_len - 1] + [tokenizer.eos_token_id] for t in texts]
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    model.train()
    bar = tqdm(range(steps), desc="base-model warm-up")
    for _ in bar:
        rows = [encoded[i] for i in torch.randint(0, len(encoded), (batch_size,), generator=gen).tolist()]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()


TASK_LENGTHS = {  # query, SFT response, RM response, CNN/DM query, CNN/DM response
    "tldr": (512, 53, 169, 1866, 155),
    "hh": (512, 256, 256, 1866, 155),
    "synthetic": (128, 24, 32, 192, 32),
}


def resolve_lengths(args: Args) -> None:
    """Fill the lengths left at None with the task's defaults (the paper's for TL;DR)."""
    names = ("query_length", "sft_response_length", "rm_response_length", "cnndm_query_length", "cnndm_response_length")
    for name, default in zip(names, TASK_LENGTHS[args.task]):
        if getattr(args, name) is None:
            setattr(args, name, default)


# The same text as run_module.py's copy (tests/test_shared_helpers.py compares them): data preparation
# imports no training script.
def tokenizer_fingerprint(tokenizer) -> dict:
    """The identity of the tokenizer of token ids: a digest of its vocabulary (added tokens such as [PAD] included),
    its size, [PAD] and EOS ids. data/prepare.py stores it with every split; the scripts compare it with theirs."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    return {"vocab_sha256": hashlib.sha256(json.dumps(vocab).encode("utf-8")).hexdigest(), "vocab_size": len(tokenizer),
            "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}


def main(args: Args) -> dict:
    t0 = time.monotonic()
    resolve_lengths(args)
    os.makedirs(args.output_dir, exist_ok=True)
    if args.unpaired_only:
        return main_unpaired_only(args)
    task_info: dict = {}
    if args.task == "synthetic":
        task_info = build_synthetic(args)
        feedback_info = build_synthetic_feedback(args) if args.unpaired else {}
    tokenizer = load_tokenizer(args)
    if tokenizer.pad_token_id == tokenizer.eos_token_id and args.pad_token == "pad":
        raise InputError("the tokenizer's pad token equals EOS; Detail 3 needs a distinct [PAD]")
    result = prepare_hh(args, tokenizer) if args.task == "hh" else prepare_tldr(args, tokenizer)
    # every split carries the identity of the tokenizer that wrote its token ids, so that each training script
    # can refuse data made with another tokenizer than its model's (check_data_tokenizer)
    fingerprint = {"name_or_path": args.base_model, **tokenizer_fingerprint(tokenizer)}
    record = json.dumps({"prepared_by": "data/prepare.py", "task": args.task, "tokenizer": fingerprint})
    for name in ("sft", "preference"):
        for dataset in result[name].values():
            dataset.info.description = record
        result[name].save_to_disk(os.path.join(args.output_dir, name))
    report = result["report"]
    summary = {
        "task": args.task,
        "rows": {f"{name}/{split}": len(ds) for name in ("sft", "preference") for split, ds in result[name].items()},
        "max_lengths": {
            "query_token_len": max(max(ds["query_token_len"]) for ds in result["sft"].values()),
            "reference_response_token_len": max(max(ds["reference_response_token_len"])
                                                for ds in result["sft"].values()),
            "chosen_token_len": max(max(ds["chosen_token_len"]) for ds in result["preference"].values()),
            "rejected_token_len": max(max(ds["rejected_token_len"]) for ds in result["preference"].values()),
        },
        "report": report,
        "query_length": args.query_length,
        "sft_response_length": args.sft_response_length,
        "rm_response_length": args.rm_response_length,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "tokenizer": fingerprint,
        "truncation": args.truncation,
        **task_info,
    }
    if args.plots:
        summary["plot"] = plot_lengths(result, args.output_dir, args)
    if args.unpaired:  # before task.json, the mark of a finished task
        summary["unpaired"] = save_unpaired(args, tokenizer, feedback_info if args.task == "synthetic" else {})["rows"]
    summary["prep_seconds"] = round(time.monotonic() - t0, 1)
    with open(os.path.join(args.output_dir, "prep_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(args.output_dir, "args.json"), "w") as f:
        json.dump(asdict(args), f, indent=2)
    if args.task == "synthetic":
        task = {k: summary[k] for k in ("query_length", "sft_response_length", "rm_response_length")}
        task["ceiling"] = summary["ceiling"]["validation"]
        task["ceiling_by_split"] = summary["ceiling"]
        with open(os.path.join(args.output_dir, "task.json"), "w") as f:  # written last: marks the task ready
            json.dump(task, f, indent=2)
    if args.push_to_hub:
        prefix = f"{args.hf_entity}/" if args.hf_entity else ""
        for name in ("sft", "preference"):
            result[name].push_to_hub(f"{prefix}{args.task}_{name}_{int(t0)}")
    print_summary(summary)
    return summary


def main_unpaired_only(args: Args) -> dict:
    """--unpaired_only: the unpaired feedback alone, tokenized by --base_model's tokenizer. With --task synthetic the
    task in --output_dir must be complete (task.json): its raw comparisons are rated and its base model's tokenizer
    is the one its other splits were written with."""
    feedback_info: dict = {}
    if args.task == "synthetic":
        if not os.path.exists(os.path.join(args.output_dir, "task.json")):
            raise FileNotFoundError(f"--unpaired_only: {args.output_dir} holds no prepared built-in task (task.json); "
                                    "prepare it first (python data/prepare.py --task synthetic --output_dir ...), or "
                                    "in one go with --unpaired instead of --unpaired_only")
        args.base_model = os.path.join(args.output_dir, "base_model")
        feedback_info = build_synthetic_feedback(args)
    print(f"\n== unpaired feedback for {args.task} ==")
    return save_unpaired(args, load_tokenizer(args), feedback_info)


def print_summary(summary: dict) -> None:
    print(f"\n== prepared {summary['task']} in {summary['prep_seconds']} s ==")
    for k, v in summary["rows"].items():
        print(f"  rows {k:32s} {v}")
    for k, v in summary["report"].items():
        print(f"  {k:40s} {v}")
    for k, v in summary["max_lengths"].items():
        print(f"  max {k:36s} {v}")
    if "ceiling" in summary:
        print(f"  RM-accuracy ceiling (validation)         {summary['ceiling']['validation']:.3f}")
        print(f"  tokenizer vocabulary                     {summary['vocab_size']}")
        print(f"  base model parameters                    {summary['base_model_parameters']:,}")


if __name__ == "__main__":
    sys.excepthook = print_expected_error
    main(tyro.cli(Args, use_underscores=True))
