"""report.py's "KL from SFT" column (the report's and the leaderboard's): KL(pi || pi_SFT) of the two models' own
distributions at temperature 1. The policy samples one response per evaluation prompt at temperature 1; at every
response position up to and including the first EOS the KL of the two next-token distributions is summed over
the whole vocabulary ([PAD] never an action), summed over the response and averaged over the prompts.

Checked on tiny GPT-NeoX models with a 4-token vocabulary ([PAD], EOS, a, b) and responses of 3 tokens, where every
response can be enumerated: the per-position KL against the exact value of every prefix, the sampled column
against the exact KL of the distribution over whole responses, and the real path (kl_from_sft reading saved
models, the run's args.json and its eval split) for SFT against itself (0), another policy, and the stage kinds
that get n/a."""

import itertools
import json
import math
import shutil
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import report
from conftest import tiny_causal_lm

WORDS = ["[PAD]", "<|endoftext|>", "a", "b"]
PAD, EOS, A, B = 0, 1, 2, 3
ACTIONS = [EOS, A, B]  # every token but [PAD]
RESPONSE_LENGTH = 3
# queries of several lengths, so that a batch of them is left-padded
QUERIES = [[A], [B, A], [A, A, B], [B, B, A, B]]


def word_tokenizer() -> PreTrainedTokenizerFast:
    """One id per whitespace-separated word of WORDS, with a [PAD] and an EOS of its own."""
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[PAD]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token="<|endoftext|>")


def sharp_lm(seed: int, scale: float = 25.0):
    """A tiny GPT-NeoX whose output layer is scaled up, so that its next-token distributions are far from uniform
    and two such models differ by a KL of the order of 1 nat over a response."""
    model = tiny_causal_lm(seed=seed, vocab_size=len(WORDS), pad_token_id=PAD, eos_token_id=EOS)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    return model


def left_padded(rows: list[list[int]]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([[PAD] * (width - len(r)) + r for r in rows])


def exact_next(model, ids: list[int]) -> dict[int, float]:
    """The model's next-token distribution after `ids` (one unpadded row, no mask) over the tokens but [PAD]:
    the softmax of their logits alone, in float64."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
    probs = torch.softmax(logits[ACTIONS], -1)
    return {token: probs[i].item() for i, token in enumerate(ACTIONS)}


def exact_step_kl(policy, reference, ids: list[int]) -> float:
    p, q = exact_next(policy, ids), exact_next(reference, ids)
    return sum(p[t] * math.log(p[t] / q[t]) for t in ACTIONS)


def exact_response_kl(policy, reference, query: list[int], length: int = RESPONSE_LENGTH) -> float:
    """KL(pi || pi_ref) of the distribution over whole responses (ended by the first EOS, or cut at `length`
    tokens), by enumerating every such response: sum of pi(y) log(pi(y) / pi_ref(y))."""
    total = 0.0

    def walk(prefix: list[int], log_p: float, log_q: float):
        nonlocal total
        if len(prefix) == length or (prefix and prefix[-1] == EOS):
            total += math.exp(log_p) * (log_p - log_q)
            return
        p, q = exact_next(policy, query + prefix), exact_next(reference, query + prefix)
        for token in ACTIONS:
            walk(prefix + [token], log_p + math.log(p[token]), log_q + math.log(q[token]))

    walk([], 0.0, 0.0)
    return total


@pytest.fixture(scope="module")
def pair():
    return sharp_lm(seed=1), sharp_lm(seed=0)  # (policy, SFT)


def test_the_per_position_kl_equals_the_exact_kl_of_every_prefix(pair):
    """Every response of 3 tokens after every query, in one left-padded batch: the KL at each response position
    (masked_logprobs + position_kl, summed over the vocabulary with [PAD]'s logit at -inf) equals the KL of the
    two models' distributions over the non-pad tokens after that unpadded prefix. Rows cut after an EOS (pads
    after it, as the real path feeds them) give the same values up to the EOS."""
    policy, reference = pair
    rows, prefixes = [], []
    for query in QUERIES:
        for response in itertools.product(ACTIONS, repeat=RESPONSE_LENGTH):
            rows.append(query + list(response))
            prefixes.append([query + list(response[:t]) for t in range(RESPONSE_LENGTH)])
    width = max(len(q) for q in QUERIES)
    batch = left_padded(rows)
    columns = (width - 1, width - 1 + RESPONSE_LENGTH)
    with torch.no_grad():
        ours = report.position_kl(report.masked_logprobs(policy, batch, PAD, *columns),
                                  report.masked_logprobs(reference, batch, PAD, *columns))
    exact = torch.tensor([[exact_step_kl(policy, reference, prefix) for prefix in row] for row in prefixes],
                         dtype=torch.float64)
    assert ours.shape == exact.shape == (len(rows), RESPONSE_LENGTH)
    torch.testing.assert_close(ours, exact, rtol=0, atol=1e-5)
    # 4 x 13 distinct prefixes (of 0, 1 and 2 response tokens), nearly all with KLs of their own: no position can hide
    assert exact.min() > 1e-3 and len(set(np.round(exact.flatten().tolist(), 4))) > 40

    # the same rows cut after their first EOS: [PAD] after it changes nothing before it
    response = batch[:, width:]
    after_eos = ((response == EOS).long().cumsum(1) - (response == EOS).long()) > 0
    cut = torch.cat([batch[:, :width], response.masked_fill(after_eos, PAD)], 1)
    with torch.no_grad():
        again = report.position_kl(report.masked_logprobs(policy, cut, PAD, *columns),
                                   report.masked_logprobs(reference, cut, PAD, *columns))
    torch.testing.assert_close(again[~after_eos], exact[~after_eos], rtol=0, atol=1e-5)


def test_the_sampled_kl_lands_within_3_standard_errors_of_the_enumerated_kl(pair):
    """1,200 prompts (the 4 queries, 300 times each), one response each sampled from the policy at temperature 1:
    the mean of the per-prompt sums is within 3 standard errors of the exact KL of the response distributions
    (every response enumerated), averaged over the same prompts. The sampling is reproducible from its seed."""
    policy, reference = pair
    copies = 300
    queries = left_padded(QUERIES * copies)
    sums, responses = report.response_kl(policy, reference, queries, PAD, EOS, RESPONSE_LENGTH,
                                         torch.Generator().manual_seed(0))
    exact = np.mean([exact_response_kl(policy, reference, q) for q in QUERIES])
    se = sums.std(ddof=1) / np.sqrt(len(sums))
    assert len(sums) == len(QUERIES) * copies and responses.shape == (len(sums), RESPONSE_LENGTH)
    assert exact > 0.1 and se < 0.1 * exact  # a KL far from 0, measured to a few percent
    assert abs(sums.mean() - exact) < 3 * se, (sums.mean(), exact, se)
    # responses: [PAD] only after an EOS; the policy's own draws (not greedy: several responses per query)
    after_eos = ((responses == EOS).long().cumsum(1) - (responses == EOS).long()) > 0
    assert torch.equal(responses == PAD, after_eos)
    assert len({tuple(r) for r in responses[:: len(QUERIES)].tolist()}) > 3
    again, _ = report.response_kl(policy, reference, queries, PAD, EOS, RESPONSE_LENGTH,
                                  torch.Generator().manual_seed(0))
    other, _ = report.response_kl(policy, reference, queries, PAD, EOS, RESPONSE_LENGTH,
                                  torch.Generator().manual_seed(1))
    assert np.array_equal(sums, again) and not np.array_equal(sums, other)


# ---------------------------------------------------------------- the real path: saved models, args.json, eval split
EVAL_QUERIES = [[A], [B, A], [A, A, B], [B, B, A, B], [A, B], [B], [B, A, A, B], [A, B, B]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, pair):
    """What the report reads, laid out as pipeline.py does: models/<stage> (sft; ppo other weights; dpo a copy of
    sft), the task's processed queries (data/sft, split validation, left-padded query_token) and per stage
    runs/<stage>/args.json and samples.csv (6 evaluation samples: the first 6 validation queries)."""
    from datasets import Dataset, DatasetDict

    root = tmp_path_factory.mktemp("kl")
    policy, reference = pair
    reference.save_pretrained(root / "models" / "sft")
    policy.save_pretrained(root / "models" / "ppo")
    shutil.copytree(root / "models" / "sft", root / "models" / "dpo")
    queries = left_padded(EVAL_QUERIES).tolist()
    DatasetDict({"validation": Dataset.from_dict({"query_token": queries,
                                                  "reference_response": ["a"] * len(queries)})}).save_to_disk(
        str(root / "data" / "sft"))
    tokenizer = word_tokenizer()
    texts = [tokenizer.decode(q, skip_special_tokens=True) for q in EVAL_QUERIES[:6]]
    for stage in ("sft", "ppo", "dpo"):
        (root / "runs" / stage).mkdir(parents=True)
        (root / "runs" / stage / "args.json").write_text(json.dumps(
            {"query_dataset": str(root / "data" / "sft"), "eval_split": "validation", "response_length": 3}))
        pd.DataFrame({"query": texts, "response": ["a"] * 6}).to_csv(root / "runs" / stage / "samples.csv", index=False)
    return root


def kl_of(p, label):
    return report.kl_from_sft(p, label,
                              str(p.runs_path / ("ilql" if label.startswith("ilql") else label) / "samples.csv"),
                              word_tokenizer())


def fake_pipeline(root, kinds: dict | None = None, seed: int = 1):
    kinds = kinds or {}
    return SimpleNamespace(models=str(root / "models"), runs=str(root / "runs"), runs_path=root / "runs",
                           args=SimpleNamespace(seed=seed), kind=lambda stage: kinds.get(stage, stage))


def test_kl_from_sft_through_the_saved_models(saved, pair):
    p = fake_pipeline(saved)
    sft = kl_of(p, "sft")  # SFT's own column: its KL to itself, computed, not assumed
    assert sft == {"kl": 0.0, "kl_se": 0.0, "kl_n": 6, "kl_note": None}
    assert kl_of(p, "dpo")["kl"] == 0.0  # a copy of the SFT weights: exactly 0 as well
    ppo = kl_of(p, "ppo")
    assert ppo["kl_n"] == 6 and ppo["kl"] > 0.1 and ppo["kl_se"] > 0 and ppo["kl_note"] is None
    assert kl_of(p, "ppo") == ppo  # seeded: the same column again
    assert kl_of(fake_pipeline(saved, seed=2), "ppo")["kl"] != ppo["kl"]
    # the same numbers as response_kl on the first 6 validation queries with the pipeline's seed
    policy, reference = pair
    sums, _ = report.response_kl(policy, reference, left_padded(EVAL_QUERIES)[:6], PAD, EOS, 3,
                                 torch.Generator().manual_seed(1))
    assert ppo["kl"] == pytest.approx(sums.mean(), abs=1e-6)


def test_kl_is_na_by_stage_kind_and_the_prompts_must_be_the_samples(saved, tmp_path):
    p = fake_pipeline(saved, kinds={"my_ilql": "ilql", "my_dt": "offline_dt"})
    for label, kind in (("ilql_beta4", "ilql"), ("my_ilql", "ilql"), ("offline_dt", "offline_dt"),
                        ("my_dt", "offline_dt")):
        kl = report.kl_from_sft(p, label, str(saved / "runs" / "sft" / "samples.csv"), word_tokenizer())
        assert kl["kl"] is None and kl["kl_note"] == report.NO_KL[kind], label
    # samples drawn from other prompts than the eval split's: refused, naming both
    other = tmp_path / "samples.csv"
    pd.DataFrame({"query": ["b b", "a"], "response": ["a", "a"]}).to_csv(other, index=False)
    with pytest.raises(ValueError, match=r"row 0 of .*samples.csv is not the query of row 0 of .*split 'validation'"):
        report.kl_from_sft(p, "ppo", str(other), word_tokenizer())


def test_the_report_writes_the_kl_with_its_standard_error_and_the_reason_for_na(saved, tmp_path):
    """write_report on a full-mode pipeline folder with SFT, PPO, DPO and an --extra fork of the Decision
    Transformer: the KL column holds SFT's 0, PPO's KL with its standard error, and n/a for the fork, keyed on its
    stage kind, with the reason below the table."""
    import pipeline

    fork = tmp_path / "my_dt.py"
    fork.write_text("")
    p = pipeline.Pipeline(pipeline.Args(mode="full", out=str(tmp_path / "out"), seed=1, extra=[f"{fork}:offline_dt"]))
    shutil.copytree(saved / "data" / "sft", f"{p.data}/sft")
    word_tokenizer().save_pretrained(f"{p.data}/base_model")
    open(f"{p.data}/task.json", "w").write("{}")
    for stage in ("sft", "ppo", "dpo", "my_dt", "rm"):
        source = saved / "models" / ("sft" if stage in ("my_dt", "rm") else stage)
        shutil.copytree(source, f"{p.models}/{stage}")
        open(f"{p.models}/{stage}/run.json", "w").write(json.dumps({"complete": True}))
        if stage == "rm":
            continue
        shutil.copytree(saved / "runs" / ("sft" if stage == "my_dt" else stage), f"{p.runs}/{stage}")
        args = json.load(open(f"{p.runs}/{stage}/args.json"))
        json.dump({**args, "query_dataset": f"{p.data}/sft"}, open(f"{p.runs}/{stage}/args.json", "w"))
        samples = pd.read_csv(f"{p.runs}/{stage}/samples.csv")
        samples.assign(reference="a", response_token_len=2, has_eos=True, score=0.1).to_csv(
            f"{p.runs}/{stage}/samples.csv", index=False)
    text = report.write_report(p)
    results = {r["policy"]: r for r in json.load(open(f"{p.report_dir}/results.json"))["policies"]}
    assert results["sft"]["kl"] == 0.0 and results["my_dt"]["kl"] is None
    ppo = results["ppo"]
    assert ppo["kl"] > 0.1 and f"| {ppo['kl']:.3f} ({ppo['kl_se']:.3f}) |" in text
    assert "| 0.000 (0.000) |" in text and f"KL from SFT n/a: my_dt: {report.NO_KL['offline_dt']}." in text
    assert "temperature 1" in text
