"""Data prep (Details 1-6), the built-in task and its gold judge."""

import json
import os
import random
import re

import numpy as np
import pytest
from datasets import load_from_disk
from transformers import AutoTokenizer

from data import prepare, synthetic

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO_ROOT, "data", "fixtures")


@pytest.fixture(scope="module")
def tokenizer(synthetic_task):
    return AutoTokenizer.from_pretrained(synthetic_task["base_model"])


def run_prepare(tmp_path, tokenizer_path, **kw):
    args = prepare.Args(task=kw.pop("task", "tldr"), output_dir=str(tmp_path / "out"), base_model=tokenizer_path,
                        plots=False, **kw)
    prepare.main(args)
    return str(tmp_path / "out")


# ---------------------------------------------------------------- Detail 2: paragraph truncation
PARAGRAPHS = ["first paragraph holds sister lost tickets.", "second paragraph is filler about the weather.",
              "third paragraph is an edit with more filler text that goes on and on.",
              "fourth paragraph keeps going with yet more words to push the length."]


def test_paragraph_truncation_cuts_at_a_paragraph_boundary(tokenizer):
    fields = {"subreddit": "tifu", "title": "a title", "post": "\n\n".join(PARAGRAPHS)}
    full = len(tokenizer.encode(prepare.TLDR_FORMAT.format(**fields)))
    limit = full - 5  # forces at least one cut
    query, tokens, truncated = prepare.build_query(tokenizer, fields, prepare.TLDR_FORMAT, "post", limit,
                                                   "paragraph", "t3_x")
    assert truncated and len(tokens) <= limit
    post = query.split("POST: ", 1)[1].rsplit("\n\nTL;DR:", 1)[0]
    kept = post.split("\n\n")
    assert kept == PARAGRAPHS[: len(kept)], "the post must keep whole paragraphs only"
    assert len(kept) < len(PARAGRAPHS)
    assert query.endswith("TL;DR:")  # no trailing space (Detail 2)


def test_token_truncation_cuts_mid_paragraph(tokenizer):
    fields = {"subreddit": "tifu", "title": "a title", "post": "\n\n".join(PARAGRAPHS)}
    limit = len(tokenizer.encode(prepare.TLDR_FORMAT.format(**fields))) - 5
    query, tokens, truncated = prepare.build_query(tokenizer, fields, prepare.TLDR_FORMAT, "post", limit,
                                                   "token", "t3_x")
    assert truncated and len(tokens) <= limit
    post = query.split("POST: ", 1)[1].rsplit("\n\nTL;DR:", 1)[0]
    assert post.split("\n\n")[-1] not in PARAGRAPHS, "token truncation should end mid-paragraph"


def test_crlf_post_cut_at_a_paragraph_keeps_no_carriage_return(tokenizer):
    fields = {"subreddit": "tifu", "title": "a title", "post": "\r\n\r\n".join(PARAGRAPHS) + "\r\n"}
    full = len(tokenizer.encode(prepare.TLDR_FORMAT.format(**fields)))
    for limit in (full - 1, full - 5, full - 25):
        query, tokens, truncated = prepare.build_query(tokenizer, fields, prepare.TLDR_FORMAT, "post", limit,
                                                       "paragraph", "t3_crlf")
        assert truncated and len(tokens) <= limit
        post = query.split("POST: ", 1)[1][: -len("\n\nTL;DR:")]
        kept = post.split("\r\n\r\n")
        assert kept == PARAGRAPHS[: len(kept)] and query.endswith(kept[-1] + "\n\nTL;DR:"), repr(query[-40:])


class CountingTokenizer:
    """A tokenizer that counts its calls (data/prepare.py tokenizes text with `tokenizer(text, ...)`)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def __call__(self, text, **kwargs):
        self.calls += 1
        return self.tokenizer(text, **kwargs)


def one_character_at_a_time(tokenizer, fields: dict, length: int) -> str:
    """The reference cut of a post with no newline: drop its last character until the query fits."""
    post = fields["post"]
    while len(tokenizer.encode(prepare.TLDR_FORMAT.format(**{**fields, "post": post}))) > length:
        post = post[:-1]
    return prepare.TLDR_FORMAT.format(**{**fields, "post": post})


def test_post_without_newline_is_cut_as_one_character_at_a_time_in_few_tokenizations(tokenizer):
    """Equal to removing one character at a time (token counts are not monotone in the cut, e.g. half a word can
    take more tokens than the whole word), at a few dozen tokenizations for a post of thousands of characters."""
    rng = random.Random(7)
    posts = [" ".join(synthetic.make_post(rng)["post"].split()) for _ in range(16)]  # newlines, runs of spaces gone
    long_post = " ".join(posts)
    cases = [(post, None) for post in posts[:4] + ["naïve café, 日本語のテキスト 😀 and more text " * 12, "x" * 900]]
    cases += [(long_post, 3), (long_post, 400)]  # cut by a few tokens, and to 40 tokens: the case that was slow
    assert len(long_post) > 4000
    for post, excess in cases:
        fields = {"subreddit": "tifu", "title": "a title", "post": post}
        full = len(tokenizer.encode(prepare.TLDR_FORMAT.format(**fields)))
        limits = [full - excess] if excess else sorted({full - 1, full - 3, full // 2, 40, 24})
        for limit in limits:
            if not 20 <= limit < full:
                continue
            counting = CountingTokenizer(tokenizer)
            query, tokens, truncated = prepare.build_query(counting, fields, prepare.TLDR_FORMAT, "post", limit,
                                                           "paragraph", "t3_long")
            assert truncated and query == one_character_at_a_time(tokenizer, fields, limit) and len(tokens) <= limit
            # the one-at-a-time cut tokenizes once per removed character: up to ~4000 times here
            assert counting.calls <= 60, (len(post), full - limit, counting.calls)


def test_untruncatable_query_names_the_row(tokenizer):
    fields = {"subreddit": "tifu", "title": "a very long title " * 40, "post": "short post"}
    with pytest.raises(ValueError, match="t3_toolong"):
        prepare.build_query(tokenizer, fields, prepare.TLDR_FORMAT, "post", 64, "paragraph", "row 0 (id t3_toolong)")


# ---------------------------------------------------------------- Details 3 and 5: padding and EOS
def test_padding_and_eos(synthetic_task):
    tok = AutoTokenizer.from_pretrained(synthetic_task["base_model"])
    pad, eos = tok.pad_token_id, tok.eos_token_id
    assert pad != eos
    space = tok.encode(" my")[0]
    ds = load_from_disk(synthetic_task["sft"])["train"]
    q_len = synthetic_task["task"]["query_length"]
    for row in ds.select(range(50)):
        q = row["query_token"]
        n = row["query_token_len"]
        assert len(q) == q_len and q[q_len - n:] == tok.encode(row["query"]) and set(q[: q_len - n]) <= {pad}
        qr = row["query_reference_response_token"]
        length = row["query_reference_response_token_len"]
        assert set(qr[length:]) <= {pad} and pad not in qr[:length], "query+response is right-padded"
        response = qr[n:length]
        assert response.count(eos) == 1 and response[-1] == eos, "exactly one EOS, at the end"
        assert tok.decode(response[:1]).startswith(" "), "responses start with a space"
        label = row["query_reference_response_token_response_label"]
        assert set(label[:n]) == {pad} and label[n:length] == response
    del space


def test_pad_token_eos_ablation(tmp_path, synthetic_task):
    out = run_prepare(tmp_path, synthetic_task["base_model"], sft_data=os.path.join(FIXTURES, "tldr_sft"),
                      preference_data=os.path.join(FIXTURES, "tldr_comparisons"), pad_token="eos",
                      query_length=128, sft_response_length=24, rm_response_length=32, cnndm_query_length=128,
                      cnndm_response_length=32)
    summary = json.load(open(os.path.join(out, "prep_summary.json")))
    assert summary["pad_token_id"] == summary["eos_token_id"]
    row = load_from_disk(os.path.join(out, "sft"))["train"][0]
    assert (row["query_reference_response_token"][row["query_reference_response_token_len"] - 1]
            == summary["eos_token_id"])


# ---------------------------------------------------------------- schemas (Detail 1, 6) and bad rows
def test_fixtures_in_hub_schema_load_through_the_same_path(tmp_path, synthetic_task):
    out = run_prepare(tmp_path, synthetic_task["base_model"], sft_data=os.path.join(FIXTURES, "tldr_sft"),
                      preference_data=os.path.join(FIXTURES, "tldr_comparisons"), query_length=128,
                      sft_response_length=24, rm_response_length=32, cnndm_query_length=128, cnndm_response_length=32)
    sft = load_from_disk(os.path.join(out, "sft"))
    pref = load_from_disk(os.path.join(out, "preference"))
    assert sft["train"].num_rows == 2 and sft["validation"].num_rows == 1
    assert set(pref.keys()) == {"train", "validation", "validation_cnndm"}
    cnn = pref["validation_cnndm"][0]
    assert cnn["query"].startswith("Article:\n") and cnn["query"].endswith("TL;DR:\n")
    assert cnn["batch"] == "cnndm0"
    train = pref["train"]
    assert train[1]["chosen"] == " my brother crashed my bike." and train[1]["chosen_policy"] == "sup2"
    assert train[0]["confidence"] == -1 and train[1]["confidence"] == 7  # Detail 1: confidence kept when present
    for col in ("batch", "split", "chosen_policy", "rejected_policy", "query_chosen_token", "query_rejected_token",
                "query_chosen_token_response_label"):
        assert col in train.column_names


def _write(tmp_path, name, rows):
    d = tmp_path / name
    d.mkdir()
    with open(d / "train.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(d)


@pytest.mark.parametrize("bad, message", [
    ({"post": None}, "missing field 'post'"),
    ({"post": "   "}, "field 'post' is empty"),
    ({"summary": 5}, "field 'summary' must be"),
])
def test_bad_sft_rows_name_row_and_field(tmp_path, synthetic_task, bad, message):
    good = json.loads(open(os.path.join(FIXTURES, "tldr_sft", "train.jsonl")).readline())
    rows = [good, {**good, "id": "t3_broken", **bad}]
    sft_dir = _write(tmp_path, "sft", rows)
    with pytest.raises(ValueError, match=message) as err:
        run_prepare(tmp_path, synthetic_task["base_model"], sft_data=sft_dir,
                    preference_data=os.path.join(FIXTURES, "tldr_comparisons"))
    assert "t3_broken" in str(err.value)


def test_long_responses_are_counted_not_silently_cut(tmp_path, synthetic_task):
    good = json.loads(open(os.path.join(FIXTURES, "tldr_sft", "train.jsonl")).readline())
    rows = [good, {**good, "id": "t3_long", "summary": "sister lost tickets " * 20}]
    sft_dir = _write(tmp_path, "sft", rows)
    out = run_prepare(tmp_path, synthetic_task["base_model"], sft_data=sft_dir,
                      preference_data=os.path.join(FIXTURES, "tldr_comparisons"), sft_response_length=24,
                      query_length=128, rm_response_length=32, cnndm_query_length=128, cnndm_response_length=32)
    summary = json.load(open(os.path.join(out, "prep_summary.json")))
    assert summary["report"]["sft/train_dropped_long_response"] == 1
    assert summary["rows"]["sft/train"] == 1
    with pytest.raises(ValueError, match="t3_long"):
        run_prepare(tmp_path / "e", synthetic_task["base_model"], sft_data=sft_dir,
                    preference_data=os.path.join(FIXTURES, "tldr_comparisons"), sft_response_length=24,
                    long_response_policy="error")


# ---------------------------------------------------------------- HH
def test_hh_split_query_and_responses():
    chosen = "\n\nHuman: Hi.\n\nAssistant: Hello!\n\nHuman: Name a fruit.\n\nAssistant: An apple."
    rejected = "\n\nHuman: Hi.\n\nAssistant: Hello!\n\nHuman: Name a fruit.\n\nAssistant: A chair."
    query, c, r = prepare.split_hh(chosen, rejected, "row 0")
    assert query == "\n\nHuman: Hi.\n\nAssistant: Hello!\n\nHuman: Name a fruit.\n\nAssistant:"
    assert c == " An apple." and r == " A chair."
    with pytest.raises(ValueError, match="row 7"):
        prepare.split_hh(chosen, "\n\nHuman: Other.\n\nAssistant: x", "row 7")


def test_hh_drops_oldest_turns_first(tokenizer):
    query = "\n\nHuman: first question here.\n\nAssistant: first answer here.\n\nHuman: last question.\n\nAssistant:"
    full = len(tokenizer.encode(query))
    short, tokens, truncated = prepare.truncate_hh_query(tokenizer, query, full - 1, "row 0")
    assert truncated and short == "\n\nHuman: last question.\n\nAssistant:" and len(tokens) <= full - 1
    with pytest.raises(ValueError, match="row 3"):
        prepare.truncate_hh_query(tokenizer, query, 3, "row 3")


def hh_rows_with_a_mismatched_pair() -> list:
    rows = [json.loads(line) for line in open(os.path.join(FIXTURES, "hh", "train.jsonl"))]
    broken = {"chosen": rows[1]["chosen"], "rejected": rows[1]["rejected"].replace("Hi there.", "Hello there.")}
    return [rows[0], rows[1], broken, rows[0]]  # row 2: the dialogues differ in the first human turn


def test_hh_pairs_that_share_no_query_are_dropped_and_named(tmp_path, synthetic_task, capsys):
    hh = _write(tmp_path, "hh", hh_rows_with_a_mismatched_pair())
    out = run_prepare(tmp_path, synthetic_task["base_model"], task="hh", hh_data=hh, query_length=96,
                      sft_response_length=64, rm_response_length=64)
    summary = json.load(open(os.path.join(out, "prep_summary.json")))
    assert summary["report"]["hh/train_dropped_mismatched_pairs"] == 1
    assert summary["report"]["hh/train_mismatched_pair_rows"] == [2]
    assert summary["rows"]["preference/train"] == summary["rows"]["sft/train"] == 3
    log = capsys.readouterr().out
    assert ("[prepare] hh/train: dropped 1 of 4 pairs that share no query, e.g. row 2 (chosen and rejected dialogues "
            "differ before their last assistant turn) (--hh_mismatch_policy drop)") in log
    assert "hh/train_mismatched_pair_rows" in log  # the printed summary names the rows too
    pref = load_from_disk(os.path.join(out, "preference"))["train"]
    assert [r["chosen"] for r in pref] == [" Put it in boiling water for about nine minutes.", " An apple.",
                                           " Put it in boiling water for about nine minutes."]
    with pytest.raises(ValueError, match=re.escape(
            "hh/train row 2: chosen and rejected dialogues differ before their last assistant turn (rows of hh/train "
            "that share no query: 1 of 4); fix or remove them in the source, or leave them out with "
            "--hh_mismatch_policy drop")):
        run_prepare(tmp_path / "strict", synthetic_task["base_model"], task="hh", hh_data=hh, query_length=96,
                    sft_response_length=64, rm_response_length=64, hh_mismatch_policy="error")


def test_hh_fixture_end_to_end(tmp_path, synthetic_task):
    out = run_prepare(tmp_path, synthetic_task["base_model"], task="hh", hh_data=os.path.join(FIXTURES, "hh"),
                      query_length=96, sft_response_length=64, rm_response_length=64)
    sft = load_from_disk(os.path.join(out, "sft"))
    pref = load_from_disk(os.path.join(out, "preference"))
    assert set(sft.keys()) == {"train", "validation"} and pref["train"].num_rows == 2
    assert pref["train"][1]["chosen"] == " An apple." and pref["train"][1]["query"].endswith("\n\nAssistant:")
    assert sft["train"][0]["reference_response"] == " Put it in boiling water for about nine minutes."


# ---------------------------------------------------------------- issue 33: user text is text
SPELLED = "quoted code: print('<|endoftext|>') and a [PAD] in a copied log"


def assert_only_code_puts_special_ids(row: dict, pad: int, eos: int, query_length: int) -> None:
    """The query's real tokens hold neither EOS nor [PAD]; every response ends with one EOS and holds no [PAD]."""
    n = row["query_token_len"]
    real_query = row["query_token"][query_length - n:]
    assert eos not in real_query and pad not in real_query, real_query
    for response in [c for c in ("reference_response", "chosen", "rejected") if c + "_token" in row]:
        tokens = row[response + "_token"][: row[response + "_token_len"]]
        assert tokens.count(eos) == 1 and tokens[-1] == eos and pad not in tokens, (response, tokens)
        both = row[f"query_{response}_token"]
        length = row[f"query_{response}_token_len"]
        assert both[:length] == real_query + tokens and set(both[length:]) <= {pad}


def test_special_token_spellings_in_posts_and_summaries_are_plain_text(tmp_path, synthetic_task, capsys):
    tok = AutoTokenizer.from_pretrained(synthetic_task["base_model"])
    pad, eos = tok.pad_token_id, tok.eos_token_id
    good = json.loads(open(os.path.join(FIXTURES, "tldr_sft", "train.jsonl")).readline())
    rows = [good, {**good, "id": "t3_spelled", "post": good["post"] + "\n\n" + SPELLED,
                   "summary": "my roommate [PAD] sold the couch.<|endoftext|>"}]
    sft_dir = _write(tmp_path, "sft", rows)
    comparisons = [json.loads(line) for line in open(os.path.join(FIXTURES, "tldr_comparisons", "train.jsonl"))]
    spelled = {**comparisons[0], "info": {**comparisons[0]["info"], "post": SPELLED},
               "summaries": [{"text": " a [PAD] summary<|endoftext|>", "policy": "ref"},
                             {"text": " <|endoftext|> other [PAD]", "policy": "sup2"}]}
    pref_dir = _write(tmp_path, "comparisons", comparisons + [spelled])
    out = run_prepare(tmp_path, synthetic_task["base_model"], sft_data=sft_dir, preference_data=pref_dir,
                      query_length=128, sft_response_length=32, rm_response_length=32, cnndm_query_length=128,
                      cnndm_response_length=32)
    sft = load_from_disk(os.path.join(out, "sft"))["train"]
    pref = load_from_disk(os.path.join(out, "preference"))["train"]
    assert len(sft) == 2 and len(pref) == len(comparisons) + 1
    for row in list(sft) + list(pref):
        assert_only_code_puts_special_ids(row, pad, eos, 128)
    row = sft[1]
    assert tok.decode(row["reference_response_token"][: row["reference_response_token_len"] - 1]) == \
        " my roommate [PAD] sold the couch.<|endoftext|>", "the spelling is kept, as text"
    assert SPELLED in tok.decode(row["query_token"][128 - row["query_token_len"]:])
    summary = json.load(open(os.path.join(out, "prep_summary.json")))
    assert summary["report"]["sft/train_rows_with_special_token_text"] == 1
    assert summary["report"]["preference/train_rows_with_special_token_text"] == 1
    assert "sft/train: 1 rows hold the spelling of a special token" in capsys.readouterr().out


def test_special_token_spellings_in_hh_dialogues_are_plain_text(tmp_path, synthetic_task):
    tok = AutoTokenizer.from_pretrained(synthetic_task["base_model"])
    rows = [json.loads(line) for line in open(os.path.join(FIXTURES, "hh", "train.jsonl"))]
    turn = "\n\nHuman: " + SPELLED + "\n\nAssistant:"
    rows.append({"chosen": turn + " Here: <|endoftext|> is a [PAD] token.", "rejected": turn + " [PAD]<|endoftext|>"})
    hh = _write(tmp_path, "hh", rows)
    out = run_prepare(tmp_path, synthetic_task["base_model"], task="hh", hh_data=hh, query_length=96,
                      sft_response_length=64, rm_response_length=64)
    for name in ("sft", "preference"):
        data = load_from_disk(os.path.join(out, name))["train"]
        assert len(data) == len(rows)
        for row in data:
            assert_only_code_puts_special_ids(row, tok.pad_token_id, tok.eos_token_id, 96)
    summary = json.load(open(os.path.join(out, "prep_summary.json")))
    assert summary["report"]["hh/train_rows_with_special_token_text"] == 1


def test_encode_text_splits_the_special_tokens_of_a_gpt_neox_style_tokenizer():
    """Pythia's tokenizer: byte-level BPE, `<|endoftext|>` and `<|padding|>` as special added tokens, runs of
    spaces as ordinary (non-special) added tokens, and data/prepare.py's [PAD] added on top."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["some text of a post", "a summary"], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|padding|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                  unk_token="<|endoftext|>")
    tok.add_tokens(["    "])  # an ordinary added token, as Pythia's whitespace runs
    tok.add_special_tokens({"pad_token": "[PAD]"})
    special = {tok.eos_token_id, tok.pad_token_id, tok.convert_tokens_to_ids("<|padding|>")}
    text = "a <|endoftext|> b <|padding|> c [PAD]    d"
    assert special & set(tok.encode(text)), "without split_special_tokens the spellings become special ids"
    ids = prepare.encode_text(tok, text)
    assert not special & set(ids) and tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("    ") in ids, "ordinary added tokens are still used"
    assert prepare.special_spellings(tok) == sorted(["<|endoftext|>", "<|padding|>", "[PAD]"])


# ---------------------------------------------------------------- issue 33: a split that ends empty
def test_hh_prep_where_every_row_is_dropped_is_one_error_before_anything_is_saved(tmp_path, synthetic_task):
    rows = [json.loads(line) for line in open(os.path.join(FIXTURES, "hh", "train.jsonl"))]
    broken = [{"chosen": r["chosen"], "rejected": "\n\nHuman: another question.\n\nAssistant: no."} for r in rows]
    hh = _write(tmp_path, "hh", broken)
    with pytest.raises(ValueError, match=re.escape(
            f"hh/train: no row is left of the {len(rows)} rows read ({len(rows)} dropped: chosen and rejected share "
            "no query (--hh_mismatch_policy drop)); nothing was saved")):
        run_prepare(tmp_path, synthetic_task["base_model"], task="hh", hh_data=hh, query_length=96,
                    sft_response_length=64, rm_response_length=64)
    assert not os.path.exists(tmp_path / "out" / "sft") and not os.path.exists(tmp_path / "out" / "preference")


def test_tldr_split_whose_every_response_is_too_long_is_one_error_naming_the_counts(tmp_path, synthetic_task):
    good = [json.loads(line) for line in open(os.path.join(FIXTURES, "tldr_sft", "train.jsonl"))]
    sft_dir = _write(tmp_path, "sft", [{**r, "summary": "sister lost tickets " * 20} for r in good])
    with pytest.raises(ValueError, match=re.escape(
            f"sft/train: no row is left of the {len(good)} rows read ({len(good)} dropped: response longer than "
            "--sft_response_length")):
        run_prepare(tmp_path, synthetic_task["base_model"], sft_data=sft_dir,
                    preference_data=os.path.join(FIXTURES, "tldr_comparisons"), query_length=128,
                    sft_response_length=24, rm_response_length=32, cnndm_query_length=128, cnndm_response_length=32)
    assert not os.path.exists(tmp_path / "out" / "sft")


def test_local_split_with_no_rows_is_one_error(tmp_path, synthetic_task):
    hh = tmp_path / "hh"
    hh.mkdir()
    (hh / "train.jsonl").write_text(open(os.path.join(FIXTURES, "hh", "train.jsonl")).read())
    import pandas as pd

    pd.DataFrame({"chosen": pd.Series([], dtype=str),
                  "rejected": pd.Series([], dtype=str)}).to_parquet(hh / "test.parquet")
    with pytest.raises(ValueError, match=re.escape(f"test ({hh / 'test.parquet'}): the source split holds no rows; "
                                                   "nothing was saved")):
        run_prepare(tmp_path, synthetic_task["base_model"], task="hh", hh_data=str(hh), query_length=96,
                    sft_response_length=64, rm_response_length=64)


# ---------------------------------------------------------------- gold judge
def gold_judgements() -> list:
    """The built-in task's posts, a good summary and five worse ones of each, with every gold score and verdict."""
    rng, out = random.Random(3), []
    for _ in range(50):
        post = synthetic.make_post(rng)
        good = synthetic.policy_summary("good", post, rng)
        for bad in ("filler", "invent", "runon", "drop", "title"):
            worse = synthetic.policy_summary(bad, post, rng)
            out.append([bad, post["post"], good, worse, synthetic.gold_score(post["post"], good),
                        synthetic.gold_score(post["post"], worse), synthetic.gold_prefer(post["post"], good, worse),
                        synthetic.gold_prefer(post["post"], worse, good)])
    return out


def test_gold_judge_prefers_the_good_summary_in_either_order():
    for bad, post, good, worse, _, _, good_first, worse_first in gold_judgements():
        assert good_first == "A", (bad, good, worse)
        assert worse_first == "B", (bad, good, worse)


def test_gold_scores_are_the_documented_weights_by_hand():
    """gold_score = 3 x coverage - 1.5 x invented facts - 0.5 x repeated - 1 x filler words - 2 if unfinished - 0.02
    x words (data/synthetic.py); the post holds one fact, "sister lost tickets"."""
    post = "so yesterday sister lost tickets and i do not know what to do.\n\nsorry for the long post."
    by_hand = {
        "sister lost tickets.": 3.0 - 0.02 * 3,  # every fact, one finished sentence of 3 words
        "honestly so yeah lol.": -3 * 1.0 - 0.02 * 4,  # no fact, 3 filler words
        "sister lost tickets and boss sold cash.": 3.0 - 1.5 - 0.02 * 7,  # one fact invented
        "sister lost tickets. sister": 3.0 - 2.0 - 0.02 * 4,  # runs on past its period: unfinished
        "sister lost tickets, sister lost tickets.": 3.0 - 0.5 - 0.02 * 6,  # the fact repeated
    }
    for summary, score in by_hand.items():
        assert synthetic.gold_score(post, summary) == pytest.approx(score, abs=1e-12), summary


def test_gold_judge_is_deterministic_across_processes_and_hash_seeds():
    """Two Python processes with other string hash seeds (PYTHONHASHSEED: the order of sets and of str-keyed hashing)
    build the same posts and summaries and give them the same gold scores and verdicts, bit for bit, as this one."""
    import inspect
    import subprocess
    import sys

    # this function's text alone, run beside data/synthetic.py (no test module, no torch to import)
    code = f"import json, random\nfrom data import synthetic\n{inspect.getsource(gold_judgements)}\n" \
           "print(json.dumps(gold_judgements()))"
    here = json.loads(json.dumps(gold_judgements()))
    for hash_seed in ("0", "4242"):
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT,
                             env={**os.environ, "PYTHONHASHSEED": hash_seed},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads(out.stdout) == here, f"PYTHONHASHSEED={hash_seed} judges otherwise"


def test_reference_beats_filler_only_and_invented():
    post = "so yesterday sister lost tickets and i do not know what to do.\n\nsorry for the long post."
    ref = "sister lost tickets."
    assert synthetic.gold_prefer(post, ref, "honestly so yeah lol.") == "A"
    assert synthetic.gold_prefer(post, ref, "sister lost tickets and boss sold cash.") == "A"
    # a summary that never ends (no EOS: it runs on past its period) loses to the same facts ended properly
    assert synthetic.gold_prefer(post, "sister lost tickets. sister", ref) == "B"
    # formatted queries work as the post: only the POST part is read
    query = f"SUBREDDIT: r/tifu\n\nTITLE: boss sold cash\n\nPOST: {post}\n\nTL;DR:"
    assert synthetic.extract_facts(synthetic._post_part(query)) == ["sister lost tickets"]


def test_ceiling_is_known_and_matches_labels(tmp_path):
    info = synthetic.generate_raw(str(tmp_path), seed=1, num_sft_train=50, num_sft_eval=20, num_pref_train=50,
                                  num_pref_valid=800, num_cnndm=0)
    c = info["ceiling"]
    assert 0.6 < c["validation"] < 0.95
    assert abs(c["validation"] - c["validation_realised"]) < 0.05  # the noise model is what we say it is


def test_references_carry_a_habit_the_gold_judge_penalises():
    """The built-in task's headroom for RLHF: most references open with the writers' habit word, which the
    gold judge counts as filler, and every compared policy but `good` and `title` picks it up as often (so a
    reward model cannot take it for a mark of the usually-winning `ref` policy)."""
    rng = random.Random(5)
    posts = [synthetic.make_post(rng) for _ in range(2000)]
    opener = synthetic.REFERENCE_OPENER + " "
    share = {p: np.mean([synthetic.policy_summary(p, post, rng).startswith(opener) for post in posts])
             for p in ("ref", "drop", "short", "runon", "invent", "good", "title")}
    for p in ("ref", "drop", "short", "runon", "invent"):
        assert abs(share[p] - synthetic.P_REFERENCE_OPENER) < 0.04, (p, share[p])
    assert share["good"] == 0.0 and share["title"] == 0.0
    post = posts[0]["post"]
    clean = synthetic._join_facts(posts[0]["facts"]) + "."
    assert synthetic.gold_breakdown(post, opener + clean).filler == 1
    assert synthetic.gold_prefer(post, clean, opener + clean) == "A"
    assert synthetic.gold_prefer(post, opener + clean, clean) == "B"


# ----------------------------------------------------------- issue 40: what a resume compares, what every script checks
def test_a_byte_identical_re_prepare_is_the_same_input_and_other_lengths_are_not(tmp_path, synthetic_task):
    """The training runs save a content hash of each prepared folder they read in their checkpoints (rlhf_utils.run's
    content_digest): preparing again with the same flags writes the same bytes, so a resume on it goes on; another
    --query_length is other data, which a resume refuses. The prepared splits also pass the shared check that every
    response starts where its query ends (check_query_response)."""
    from rlhf_utils import checks
    from rlhf_utils import run as run_module

    kw = dict(sft_data=os.path.join(FIXTURES, "tldr_sft"), preference_data=os.path.join(FIXTURES, "tldr_comparisons"),
              sft_response_length=24, rm_response_length=32, cnndm_query_length=128, cnndm_response_length=32)
    base = synthetic_task["base_model"]
    folders = [run_prepare(tmp_path / name, base, query_length=length, **kw)
               for name, length in (("first", 128), ("again", 128), ("longer", 136))]
    for data in ("sft", "preference"):
        first, again, longer = (run_module.content_digest(os.path.join(folder, data)) for folder in folders)
        assert first == again != longer, data
    pad = AutoTokenizer.from_pretrained(base).pad_token_id
    for root in (folders[0], synthetic_task["root"]):
        for data in ("sft", "preference"):
            for split, dataset in load_from_disk(os.path.join(root, data)).items():
                checks.check_query_response(dataset, pad, f"{root}/{data} split {split!r}")  # no false alarm


# ---------------------------------------------------------------- damaged local source files: path:line, nothing saved
@pytest.mark.parametrize("case", ["cut_line", "no_summary", "hh_not_json", "empty"])
def test_a_damaged_local_jsonl_names_file_and_line_and_saves_nothing(tmp_path, synthetic_task, case):
    good = open(os.path.join(FIXTURES, "tldr_sft", "train.jsonl")).read().splitlines()
    source = tmp_path / "source"
    source.mkdir()
    kw = dict(sft_data=str(source), preference_data=os.path.join(FIXTURES, "tldr_comparisons"))
    if case == "cut_line":
        (source / "train.jsonl").write_text("\n".join([good[0], good[1][: len(good[1]) // 2], *good[2:]]) + "\n")
        message = (f"{source / 'train.jsonl'}:2: not valid JSON: ", "(the line ends early: cut in the middle?)",
                   "each line must be one JSON object with the fields ['id', 'post', 'subreddit', 'summary', 'title']",
                   "nothing was saved")
    elif case == "no_summary":
        row = json.loads(good[0])
        del row["summary"]
        (source / "train.jsonl").write_text("\n".join([good[0], json.dumps(row)]) + "\n")
        message = (f"{source / 'train.jsonl'}:2 (id {row['id']}): missing field 'summary'; every row needs "
                   "['id', 'post', 'subreddit', 'summary', 'title']", "nothing was saved")
    elif case == "hh_not_json":
        hh = open(os.path.join(FIXTURES, "hh", "train.jsonl")).read().splitlines()
        (source / "train.jsonl").write_text("\n".join([hh[0], "Human: hi Assistant: hello", *hh[1:]]) + "\n")
        kw = dict(task="hh", hh_data=str(source), query_length=96, sft_response_length=64, rm_response_length=64)
        message = (f"{source / 'train.jsonl'}:2: not valid JSON", "['chosen', 'rejected']", "nothing was saved")
    else:
        (source / "train.jsonl").write_text("")
        message = (f"train ({source / 'train.jsonl'}): the source split holds no rows; nothing was saved",)
    with pytest.raises(ValueError) as error:
        run_prepare(tmp_path, synthetic_task["base_model"], **kw)
    for part in message:
        assert part in str(error.value)
    out = tmp_path / "out"
    assert not out.exists() or not os.listdir(out)  # nothing written to the output folder


@pytest.mark.parametrize("damage", ["truncated", "zeroed"])
def test_a_damaged_prepared_split_is_one_error_naming_its_folder_and_the_fix(tmp_path, synthetic_task, damage):
    import shutil

    from rlhf_utils.checks import RunError, load_split  # every script's one load_split

    data = tmp_path / "sft"
    shutil.copytree(synthetic_task["sft"], data)
    arrow = data / "train" / "data-00000-of-00001.arrow"
    size = arrow.stat().st_size
    if damage == "truncated":
        os.truncate(arrow, size // 2)
    else:
        arrow.write_bytes(bytes(size))
    assert len(load_split(synthetic_task["sft"], "train")) > 0  # the intact task loads
    with pytest.raises(RunError) as error:
        load_split(str(data), "train")
    message = str(error.value)
    assert message.startswith(f"the prepared data in {data / 'train'} cannot be read: ")
    assert "prepare it again with data/prepare.py" in message and "\n" not in message
    assert ("OSError: Expected to be able to read" if damage == "truncated" else "ArrowInvalid") in message
    with pytest.raises(RunError, match=re.escape(f"the prepared data in {data / 'train'} cannot be read")):
        load_split(str(data), "validation")  # another split of the folder: the damaged one is named
