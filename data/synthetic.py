"""The built-in synthetic TL;DR task: a world of posts, a gold judge, a tokenizer and a tiny base model.

Nothing here is part of an algorithm. It exists so that the whole pipeline (prep -> SFT -> RM ->
PPO / DPO / ... -> judge) runs on 2 CPU cores in minutes, with a *known* right answer:

* Every post carries 2-3 key facts. A fact is a triple written as one contiguous phrase,
  "{subject} {verb} {object}" (e.g. "landlord sold furniture"), buried in a sentence of the
  post. Everything else in the post is filler that holds no fact.
* A good summary states every key fact once, invents none, carries no filler words, and ends
  with a period. `gold_score` turns that into a number; `gold_prefer` compares two summaries.
* Raw rows are written in exactly the schemas of the two hub datasets the paper uses
  (`vwxyzjn/summarize_from_feedback_tldr_3_filtered` and `openai/summarize_from_feedback`,
  config `comparisons`), so `data/prepare.py` runs the real TL;DR code path on them.
* Preference labels are the gold verdict flipped with a known, confidence-dependent
  probability, so the best accuracy any reward model can reach (the ceiling) is known.
* Thumbs up / down for KTO (`generate_feedback`, opt-in: `data/prepare.py --unpaired`): every compared summary
  gets a thumb of its own from the same raters, up when its gold score clears a bar, with the same
  confidence-dependent noise, written in the layout of the hub's KTO data sets (prompt, completion, label).
* The human references are good but beatable: most open with a chatty habit word that the gold judge
  counts as filler. SFT imitates the habit; the preference pairs show raters disliking it, so RLHF has
  something to fix, as in the paper, where PPO's summaries beat the human references more often than SFT's.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
from dataclasses import dataclass

# --------------------------------------------------------------------------------------------
# 1. The world: subjects, verbs and objects that make up facts; filler that holds none.
# --------------------------------------------------------------------------------------------
# Each content word is a single BPE token that appears nowhere but inside facts, and the world is small
# (8 x 8 x 8 facts), so that a ~1M parameter model learns to copy facts from the post within a few CPU
# minutes: copying a one-token word needs a one-token lookback, where a phrase behind a shared word ("my mom",
# "the car") needs two (the comparison: docs/results.md).
SUBJECTS = ["mom", "dad", "boss", "sister", "brother", "roommate", "landlord", "neighbor"]
VERBS = ["lost", "broke", "sold", "stole", "hid", "found", "burned", "cleaned"]
OBJECTS = ["cash", "furniture", "cookies", "plants", "tickets", "jewelry", "shoes", "paintings"]
SUBREDDITS = ["relationships", "personalfinance", "tifu", "AskReddit", "legaladvice", "roommates", "dating_advice"]

# A fact sentence wraps the fact phrase; the wrappers use no subject/verb/object words.
FACT_SENTENCES = [
    "so yesterday {fact} and i do not know what to do.",
    "last week {fact} without telling me.",
    "it turns out {fact} a few days ago.",
    "on top of that {fact}.",
    "then on friday {fact} while i was at work.",
    "i just found out that {fact}.",
    "a month ago {fact} and nobody said anything.",
]
# Filler sentences: chatter that carries no fact (never a subject followed by a verb).
FILLER_SENTENCES = [
    "i have been reading this sub for a long time.",
    "sorry for the long post.",
    "english is not my first language so bear with me.",
    "we have known each other for almost six years.",
    "the weather here has been awful lately.",
    "i work night shifts at a warehouse downtown.",
    "we live in a small apartment near the river.",
    "some background first.",
    "i am not sure if this is the right place to ask.",
    "money has been tight for both of us this year.",
    "we usually get along really well.",
    "i try to stay calm about these things.",
    "my therapist says i should write things down.",
    "honestly i am just tired of all the drama.",
    "we had a big dinner with the whole family on sunday.",
    "i have a job interview coming up next month.",
]
TAIL_PARAGRAPHS = [  # long trailing paragraphs: the natural target of paragraph truncation (Detail 2)
    "edit: a few people asked for more context so here it is. {a} {b} {c}",
    "update: nothing has changed since i posted this. {a} {b}",
    "extra details for anyone who cares. {a} {b} {c} {d}",
    "edit 2: thanks for all the comments, i read every one of them. {a} {b}",
]
TITLES = [
    "need advice about my family", "am i overreacting here", "what do i do now",
    "not sure how to handle this", "how do i bring this up", "is this normal",
]
# Filler that a summary must not carry; the gold judge penalises each occurrence.
SUMMARY_FILLER = ["lol", "tbh", "idk", "honestly", "so yeah", "anyway", "basically"]

_FACT_RE = re.compile(
    r"\b(" + "|".join(map(re.escape, SUBJECTS)) + r") (" + "|".join(VERBS) + r") ("
    + "|".join(map(re.escape, sorted(OBJECTS, key=len, reverse=True))) + r")\b"
)
_FILLER_RE = re.compile(r"\b(" + "|".join(map(re.escape, SUMMARY_FILLER)) + r")\b")
EOS_TEXT = "<|endoftext|>"


# --------------------------------------------------------------------------------------------
# 2. The gold judge.
# --------------------------------------------------------------------------------------------
def extract_facts(text: str) -> list[str]:
    """Every fact phrase (subject verb object) in the text, in order of appearance."""
    return [" ".join(m.groups()) for m in _FACT_RE.finditer(text.lower())]


def _post_part(text: str) -> str:
    """The post of a formatted query (`... POST: {post}\\n\\nTL;DR:`); the text itself otherwise."""
    if "POST:" in text:
        text = text.split("POST:", 1)[1]
    if "Article:" in text:
        text = text.split("Article:", 1)[1]
    return text.split("TL;DR:", 1)[0]


@dataclass
class GoldBreakdown:
    covered: int
    num_facts: int
    invented: int
    repeated: int
    filler: int
    finished: bool
    num_words: int
    score: float


# Weights of the gold score. Coverage dominates; each defect costs about one fact.
W_COVERAGE, W_INVENTED, W_REPEATED, W_FILLER, W_UNFINISHED, W_WORD = 3.0, 1.5, 0.5, 1.0, 2.0, 0.02


def gold_breakdown(post: str, summary: str) -> GoldBreakdown:
    facts = set(extract_facts(_post_part(post)))
    text = summary.replace(EOS_TEXT, "").strip().lower()
    said = extract_facts(text)
    covered = len(facts & set(said))
    invented = len(set(said) - facts)
    repeated = len(said) - len(set(said))
    filler = len(_FILLER_RE.findall(text))
    finished = text.endswith(".") and text.count(".") == 1  # one sentence, properly ended
    num_words = len(text.split())
    coverage = covered / len(facts) if facts else 0.0
    score = (
        W_COVERAGE * coverage
        - W_INVENTED * invented
        - W_REPEATED * repeated
        - W_FILLER * filler
        - W_UNFINISHED * (not finished)
        - W_WORD * num_words
    )
    return GoldBreakdown(covered, len(facts), invented, repeated, filler, finished, num_words, score)


def gold_score(post: str, summary: str) -> float:
    """Deterministic quality of `summary` for `post` (higher is better). `post` may be the whole
    formatted query; only the text after `POST:` (or `Article:`) and before `TL;DR:` counts."""
    return gold_breakdown(post, summary).score


def gold_prefer(post: str, summary_a: str, summary_b: str) -> str:
    """"A" or "B": the summary with the higher gold score. Exact ties go to the shorter text, then
    to the lexicographically smaller one, so the verdict never depends on the order of A and B."""
    sa, sb = gold_score(post, summary_a), gold_score(post, summary_b)
    if sa != sb:
        return "A" if sa > sb else "B"
    ka = (len(summary_a.strip()), summary_a.strip())
    kb = (len(summary_b.strip()), summary_b.strip())
    return "A" if ka <= kb else "B"


def key_fact_share(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """A verifiable reward from code, for --reward_fn data/synthetic.py:key_fact_share (ppo.py, rloo.py, grpo.py,
    reinforce_pp.py, online_dpo.py), written as TRL's GRPOTrainer calls one (by keyword; the other keywords, the
    completion ids, the trainer state and the prompt rows' columns, are not needed): the share of the post's key facts
    that the summary states, the rule a user would write first. The facts are read from the query's post, as the gold
    judge reads them.
    It is not the gold judge, which also takes off for invented and repeated facts, filler words, a summary that is not
    one sentence ending with a period, and length: a policy trained on this rule alone is free to pile those up."""
    shares = []
    for query, response in zip(prompts, completions):
        facts = set(extract_facts(_post_part(query)))
        shares.append(len(facts & set(extract_facts(response))) / len(facts) if facts else 0.0)
    return shares


# --------------------------------------------------------------------------------------------
# 3. Posts, reference summaries and the "policies" that wrote the compared summaries.
# --------------------------------------------------------------------------------------------
def _join_facts(facts: list[str]) -> str:
    if len(facts) == 1:
        return facts[0]
    return ", ".join(facts[:-1]) + " and " + facts[-1]


def make_post(rng: random.Random) -> dict:
    """A multi-paragraph post with 2-3 key facts. About a third carry long trailing paragraphs,
    which push the formatted query past the built-in query length and force truncation."""
    num_facts = rng.choice([2, 2, 3])
    facts: list[str] = []
    while len(facts) < num_facts:
        fact = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
        if fact.split(" ")[:2] not in [f.split(" ")[:2] for f in facts]:
            facts.append(fact)
    paragraphs = []
    for i, fact in enumerate(facts):
        sentences = rng.sample(FILLER_SENTENCES, rng.randint(0, 2))
        sentences.insert(rng.randint(0, len(sentences)), rng.choice(FACT_SENTENCES).format(fact=fact))
        if i == 0:
            sentences.insert(0, rng.choice(FILLER_SENTENCES))
        paragraphs.append(" ".join(sentences))
    if rng.random() < 0.35:
        for _ in range(rng.randint(1, 3)):
            a, b, c, d = rng.sample(FILLER_SENTENCES, 4)
            paragraphs.append(rng.choice(TAIL_PARAGRAPHS).format(a=a, b=b, c=c, d=d))
    title = rng.choice(TITLES)
    return {
        "subreddit": rng.choice(SUBREDDITS),
        "title": title,
        "post": "\n\n".join(paragraphs),
        "facts": facts,
    }


# The human writers' habit. Most references open with the same chatty word, which the gold judge counts
# as filler. It is the *typical* reference, so SFT (which imitates the typical reference and is evaluated
# near-greedily) opens with it too; the preference pairs show raters disliking filler, so a reward model
# learns the habit is bad and RLHF can unlearn it. This is the headroom the paper's setting has too: human
# TL;DR references are beatable, and PPO's summaries beat them more often than SFT's do. With flawless
# references there is nothing above SFT to reach (docs/results.md).
REFERENCE_OPENER = "basically"
P_REFERENCE_OPENER = 0.6


def reference_summary(facts: list[str], rng: random.Random) -> str:
    """A human-like reference: right facts, usually opened by the writers' habit word, and now and then
    flawed otherwise (drops a fact or trails off into filler), so SFT learns a decent but beatable policy."""
    chosen = list(facts)
    u = rng.random()
    if u < 0.15 and len(chosen) > 1:
        chosen.pop(rng.randrange(len(chosen)))
    text = _join_facts(chosen)
    if 0.15 <= u < 0.27:
        text = f"{text} {rng.choice(SUMMARY_FILLER)}"
    return with_habit(text, rng) + "."


def with_habit(text: str, rng: random.Random) -> str:
    """The writers' opener in front of `text`, with probability P_REFERENCE_OPENER."""
    return f"{REFERENCE_OPENER} {text}" if rng.random() < P_REFERENCE_OPENER else text


def policy_summary(policy: str, post: dict, rng: random.Random) -> str:
    """A summary in the style of one named sampling policy. The policies that wrote the compared summaries
    were trained on human references, so all but `good` (a flawless writer) and `title` pick up the writers'
    opener as often as the references do. Were it only in the `ref` policy's summaries, which usually win
    their comparisons, the opener would look like a mark of quality to a reward model (docs/results.md)."""
    facts = post["facts"]
    if policy == "good":
        return _join_facts(facts) + "."
    if policy == "ref":
        return reference_summary(facts, rng)
    if policy == "drop":  # loses one key fact
        kept = list(facts)
        kept.pop(rng.randrange(len(kept)))
        return with_habit(_join_facts(kept), rng) + "."
    if policy == "short":  # only the first fact
        return with_habit(facts[0], rng) + "."
    if policy == "filler":  # right facts, chatty
        return f"{rng.choice(SUMMARY_FILLER)} {_join_facts(facts)} {rng.choice(SUMMARY_FILLER)}."
    if policy == "runon":  # never ends: no period, trails off
        return with_habit(_join_facts(facts), rng) + " and then " + rng.choice(["i", "we", "so i", "and"])
    if policy == "invent":  # adds a fact that is not in the post
        while True:
            fake = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
            if fake not in facts:
                break
        return with_habit(_join_facts(facts + [fake]), rng) + "."
    if policy == "title":  # copies the title
        return post["title"] + "."
    raise ValueError(f"unknown policy {policy!r}")


# Train pairs cover every kind of flaw, including invented facts (which a reward model can only catch by
# checking the summary against the post) and a copied title (no fact at all: an RM that never saw one in
# training misjudges it in validation, docs/results.md). Validation adds pairs of policies that are never
# compared with each other in train (Detail 6).
TRAIN_POLICY_PAIRS = [("good", "drop"), ("good", "filler"), ("ref", "short"), ("ref", "runon"),
                      ("drop", "filler"), ("good", "ref"), ("short", "runon"), ("drop", "short"), ("good", "invent"),
                      ("ref", "invent"), ("short", "title")]
OOD_POLICY_PAIRS = [("ref", "title"), ("good", "short"), ("invent", "drop"), ("filler", "title")]
POLICY_NAMES = {  # names in the style of the real dataset's policy column
    "good": "sup_good_t.7", "ref": "ref", "drop": "sup_drop_t.7", "short": "sup_short_t.7",
    "filler": "sup_filler_t.7", "runon": "sup_runon_t1", "invent": "ppo_invent_t.7", "title": "title",
}


def flip_probability(confidence: int) -> float:
    """Label noise: a rater with confidence c (1-9) contradicts the gold judge with this probability."""
    return 0.30 * (9 - confidence) / 8 + 0.03


def confidence_of(gap: float) -> int:
    """Confidence grows with the gold-score gap between the two summaries."""
    return max(1, min(9, 1 + int(gap * 2.5)))


def make_comparison(post: dict, post_id: str, pair: tuple[str, str], split: str, batch: str,
                    rng: random.Random) -> tuple[dict, float]:
    """One row in the `comparisons` schema, and the probability that its label matches gold."""
    a, b = list(pair)
    if rng.random() < 0.5:
        a, b = b, a
    texts = [policy_summary(a, post, rng), policy_summary(b, post, rng)]
    while texts[0] == texts[1]:  # identical texts carry no preference (a scalar RM can only tie on them)
        b = rng.choice(["drop", "short", "filler", "runon"])
        texts[1] = policy_summary(b, post, rng)
    full_post = post["post"]
    gold = 0 if gold_prefer(full_post, texts[0], texts[1]) == "A" else 1
    gap = abs(gold_score(full_post, texts[0]) - gold_score(full_post, texts[1]))
    confidence = confidence_of(gap)
    p_flip = flip_probability(confidence)
    choice = 1 - gold if rng.random() < p_flip else gold
    row = {
        "info": {"id": post_id, "post": full_post, "title": post["title"], "subreddit": post["subreddit"],
                 "site": None, "article": None},
        "summaries": [{"text": " " + t, "policy": POLICY_NAMES[p], "note": None} for t, p in zip(texts, (a, b))],
        "choice": choice,
        "worker": f"worker{rng.randrange(12)}",
        "batch": batch,
        "split": split,
        "extra": {"confidence": confidence},
    }
    return row, 1.0 - p_flip


def make_cnndm_comparison(post: dict, post_id: str, rng: random.Random) -> tuple[dict, float]:
    """A CNN/DM-style validation row: an `article` instead of a post (Detail 6's `validation_cnndm`)."""
    row, p_correct = make_comparison(post, post_id, rng.choice(TRAIN_POLICY_PAIRS), "valid2",
                                     rng.choice(["batch0_cnndm", "cnndm0", "cnndm2"]), rng)
    row["info"] = {"id": post_id, "post": None, "title": post["title"], "subreddit": None,
                   "site": "dailymail", "article": post["post"]}
    return row, p_correct


def generate_raw(out_dir: str, seed: int = 0, num_sft_train: int = 4000, num_sft_eval: int = 400,
                 num_pref_train: int = 6000, num_pref_valid: int = 1000, num_cnndm: int = 60,
                 num_sft_test: int = 600) -> dict:
    """Write the raw hub-schema JSONL files (`sft/{train,validation,test}.jsonl` and
    `comparisons/{train,validation}.jsonl`); return the row counts and the RM-accuracy ceiling. The test split
    (`num_sft_test` posts, make_test_split) draws on a random stream of its own; everything else on the main one."""
    rng = random.Random(seed)
    os.makedirs(out_dir, exist_ok=True)
    counts: dict[str, int] = {}

    def dump(name: str, rows: list[dict]) -> None:
        path = os.path.join(out_dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        counts[name] = len(rows)

    posts = {}
    for split, n in [("train", num_sft_train), ("valid", num_sft_eval), ("test", num_sft_eval)]:
        rows = []
        for i in range(n):
            post = make_post(rng)
            pid = f"t3_{split}{i:05d}"
            posts[pid] = post
            rows.append({"id": pid, "subreddit": post["subreddit"], "title": post["title"],
                         "post": post["post"], "summary": reference_summary(post["facts"], rng)})
        if split == "test":
            # These num_sft_eval posts of the main stream were the test split before it had a stream of its own
            # (issue 54). They are still drawn, and dropped, so that every later draw of the main stream (the
            # comparisons) and with it every train and validation file stays byte for byte what it was.
            rows = make_test_split(seed, num_sft_test, [posts[k] for k in posts if not k.startswith("t3_test")])
        dump(f"sft/{'validation' if split == 'valid' else split}.jsonl", rows)

    ceiling = {}
    train_ids = [k for k in posts if k.startswith("t3_train")]
    valid_ids = [k for k in posts if k.startswith("t3_valid")]
    train_rows, p_train = [], []
    for i in range(num_pref_train):
        pid = rng.choice(train_ids)
        row, p = make_comparison(posts[pid], pid, rng.choice(TRAIN_POLICY_PAIRS), "train",
                                 f"batch{3 + i * 8 // max(1, num_pref_train)}", rng)
        train_rows.append(row)
        p_train.append(p)
    dump("comparisons/train.jsonl", train_rows)
    valid_rows, p_valid = [], []
    for i in range(num_pref_valid):
        pid = rng.choice(valid_ids)
        ood = rng.random() < 0.3
        pair = rng.choice(OOD_POLICY_PAIRS if ood else TRAIN_POLICY_PAIRS)
        row, p = make_comparison(posts[pid], pid, pair, "valid1", "batch11" if ood else "batch10", rng)
        valid_rows.append(row)
        p_valid.append(p)
    for i in range(num_cnndm):
        post = make_post(rng)
        row, p = make_cnndm_comparison(post, f"cnndm_{i:05d}", rng)
        valid_rows.append(row)
        p_valid.append(p)
    dump("comparisons/validation.jsonl", valid_rows)
    # The ceiling: a reward model that knows the gold judge perfectly agrees with a label with
    # probability 1 - flip_probability; averaged over a split that is its expected accuracy.
    ceiling["train"] = sum(p_train) / len(p_train)
    # "validation" is the TL;DR part that reward.py's `validation` split holds; CNN/DM rows are its own split
    in_tldr = [p for p, r in zip(p_valid, valid_rows) if r["split"] == "valid1"]
    ceiling["validation"] = sum(in_tldr) / max(1, len(in_tldr))
    if num_cnndm:
        ceiling["validation_cnndm"] = sum(p_valid[-num_cnndm:]) / num_cnndm
    for name, batch in (("validation_in_distribution", "batch10"), ("validation_ood", "batch11")):
        ps = [p for p, r in zip(p_valid, valid_rows) if r["batch"] == batch]
        if ps:
            ceiling[name] = sum(ps) / len(ps)
    # the realised agreement of labels with gold on validation (noise drawn, so it differs a little)
    agree = 0
    tldr_rows = [r for r in valid_rows if r["split"] == "valid1"]
    for r in tldr_rows:
        g = 0 if gold_prefer(r["info"]["post"], r["summaries"][0]["text"], r["summaries"][1]["text"]) == "A" else 1
        agree += int(g == r["choice"])
    ceiling["validation_realised"] = agree / max(1, len(tldr_rows))
    return {"counts": counts, "ceiling": ceiling}


# The test split's stream: the seed plus the 10,000th prime, as the warm-up text (7919) and the thumbs (15485863)
# have streams of their own, so that adding or resizing the test split moves no other file.
TEST_STREAM = 104729


def prompt_key(post: dict) -> tuple[str, str, str]:
    """What makes two posts one prompt: subreddit, title and opening paragraph. Truncation (Detail 2) cuts a post
    from its end and a built-in opening paragraph always fits the query, so posts whose keys differ keep different
    queries."""
    return post["subreddit"], post["title"], post["post"].split("\n\n", 1)[0]


def make_test_split(seed: int, num: int, other_posts: list[dict]) -> list[dict]:
    """The test split: `num` posts with their human references, drawn from a stream of their own (TEST_STREAM), each
    a prompt of its own (prompt_key) that no post of `other_posts` (the train and validation posts) shares: a post
    that would is drawn again. No setting of the project is chosen on it (docs/results.md): the leaderboard reports
    it, tuning reads the validation split."""
    rng = random.Random(seed + TEST_STREAM)
    taken = {prompt_key(post) for post in other_posts}
    rows = []
    while len(rows) < num:
        post = make_post(rng)
        if prompt_key(post) in taken:
            continue
        taken.add(prompt_key(post))
        rows.append({"id": f"t3_test{len(rows):05d}", "subreddit": post["subreddit"], "title": post["title"],
                     "post": post["post"], "summary": reference_summary(post["facts"], rng)})
    return rows


# --------------------------------------------------------------------------------------------
# Unpaired binary feedback (KTO): the raters' thumbs up or down on every summary they compared.
# --------------------------------------------------------------------------------------------
# A thumbs up needs a summary the gold judge finds flawless or nearly so: every key fact, nothing invented, no
# filler word and one finished sentence score 3 minus 0.02 a word; any one of those defects costs a whole point or
# more, and so does a missing fact of three. A rater's verdict on one summary is noisy as a comparison is: the
# nearer its gold score lies to this bar, the lower the rater's confidence and the likelier a wrong thumb
# (confidence_of and flip_probability, with the distance to the bar in place of the gap between two summaries).
DESIRABLE_SCORE = 2.0


def thumbs_up(post: str, summary: str, rng: random.Random) -> tuple[bool, bool]:
    """A rater's thumb on one summary of `post`: (the thumb, whether it agrees with the gold judge's)."""
    score = gold_score(post, summary)
    gold = score >= DESIRABLE_SCORE
    flipped = rng.random() < flip_probability(confidence_of(abs(score - DESIRABLE_SCORE)))
    return gold != flipped, not flipped


def generate_feedback(comparisons_dir: str, out_dir: str, prompt_format: str, seed: int = 0) -> dict:
    """Unpaired feedback in the layout of the hub's KTO data sets (one JSON object a line: `prompt`, the formatted
    query; `completion`, the summary; `label`, true for a thumbs up): every summary of the TL;DR comparisons in
    `comparisons_dir/{train,validation}.jsonl` (generate_raw's) gets a thumb of its own, written to
    `out_dir/{train,validation}.jsonl`. The CNN/DM validation rows are left out (their queries have another format).
    The thumbs draw on their own random stream, so the comparisons and every other file stay as they were. Returns
    the rows written, the desirable share and the thumbs' agreement with the gold judge per split."""
    rng = random.Random(seed + 15485863)
    os.makedirs(out_dir, exist_ok=True)
    info: dict = {}
    for split in ("train", "validation"):
        rows, agree = [], 0
        with open(os.path.join(comparisons_dir, f"{split}.jsonl")) as f:
            comparisons = [json.loads(line) for line in f if line.strip()]
        for comparison in comparisons:
            post = comparison["info"]
            if post.get("post") is None:  # a CNN/DM article
                continue
            prompt = prompt_format.format(subreddit=post["subreddit"], title=post["title"], post=post["post"])
            for summary in comparison["summaries"]:
                label, agrees = thumbs_up(post["post"], summary["text"], rng)
                rows.append({"prompt": prompt, "completion": summary["text"].strip(), "label": label})
                agree += agrees
        with open(os.path.join(out_dir, f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        info[split] = {"rows": len(rows), "desirable_share": sum(r["label"] for r in rows) / max(1, len(rows)),
                       "agreement_with_gold": agree / max(1, len(rows))}
    return info


def pretraining_documents(num: int, seed: int, min_chars: int = 600) -> list[str]:
    """Text for the base model's warm-up, the tiny stand-in for pre-training. Each document packs several
    short fresh posts (not the SFT split) up to `min_chars` characters, each ending with the author's own
    recap ("in short: ..."), the way forum threads in a pre-training corpus often do. Copying a phrase from
    earlier in the document is the skill SFT builds on, so the warm-up text is dense in it: short posts put
    about one token in five inside a recap, where a full-length post would put one in twenty.

    Shorter documents make the warm-up cheaper but the base model worse for this task: SFT from it copies
    fewer facts and invents more, and PPO over-optimises against the weaker reward model (docs/results.md)."""
    rng = random.Random(seed + 7919)
    docs = []
    for _ in range(num):
        parts: list[str] = []
        while sum(len(p) for p in parts) < min_chars:
            facts = make_post(rng)["facts"]
            sentences = [rng.choice(FACT_SENTENCES).format(fact=f) for f in facts]
            for _ in range(rng.randint(0, 2)):
                sentences.insert(rng.randint(0, len(sentences)), rng.choice(FILLER_SENTENCES))
            parts.append(" ".join(sentences) + " in short: " + _join_facts(facts) + ".")
        docs.append("\n\n".join(parts))
    return docs


# --------------------------------------------------------------------------------------------
# 4. Tokenizer and tiny base model.
# --------------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int = 1024):
    """A byte-level BPE tokenizer (GPT-NeoX style) with distinct `<|endoftext|>` and `[PAD]`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TEXT, "[PAD]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TEXT, bos_token=EOS_TEXT, unk_token=EOS_TEXT, pad_token="[PAD]",
        model_max_length=2048, padding_side="right",
    )


def build_base_model(vocab_size: int, hidden_size: int = 128, num_layers: int = 4, num_heads: int = 4,
                     max_positions: int = 512, seed: int = 0):
    """A tiny GPT-NeoX with Pythia's architecture (parallel residual, partial rotary embeddings).
    Like Pythia, the embedding matrix is padded to a multiple of 64 rows beyond the tokenizer's size."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    config = GPTNeoXConfig(
        vocab_size=int(math.ceil(vocab_size / 64) * 64),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=4 * hidden_size,
        max_position_embeddings=max_positions,
        # Pythia rotates 25% of each head's dimensions (64 of 256 in Pythia-1B). Our heads have 32
        # dimensions, so 25% would leave 8 rotary dimensions: too little position signal for the
        # "previous token" heads that copying is built from. We rotate all of them (a deliberate
        # difference from Pythia; the comparison: docs/results.md).
        rotary_pct=1.0,
        use_parallel_residual=True,
        tie_word_embeddings=False,
        hidden_dropout=0.1,  # dropout is on in the base model, as in many hub models, so Detail 7 matters
        attention_dropout=0.0,  # GPT-NeoX applies attention dropout as a float, not an nn.Dropout module
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPTNeoXForCausalLM(config)
