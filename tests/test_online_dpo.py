"""Tests of online_dpo.py: the per-prompt seeded sampler (the same samples however the prompts are split, and the
frequencies of softmax(logits / T)), the labels from reward-model scores and from the gold judge's endpoint, the
reference switch, a tiny end-to-end run on the built-in task, and (slow) a resume after SIGKILL. Its runs on 2
processes (torchrun, ZeRO-2, ZeRO-3) against 1, pair counts included, are tests/test_multiprocess.py's."""

import json
import math
import os
import random
import shutil
import subprocess
import sys
from dataclasses import asdict
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from datasets import Dataset
from transformers import AutoModelForCausalLM, GPTNeoXConfig, GPTNeoXForSequenceClassification

from conftest import (
    ENV,
    assert_same_safetensors,
    kill_after_checkpoint,
    load_script,
    run_ok,
    tiny_causal_lm,
    without_timing,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from data import gold_judge_server as gjs  # noqa: E402
from data.synthetic import gold_prefer, make_post, policy_summary, reference_summary  # noqa: E402

online = load_script("online_dpo")
PAD, EOS = 1, 2
TOKENIZER = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)  # what sample_pairs reads of a tokenizer


def chi2_critical(dof: int, z: float = 3.090232) -> float:
    """The 0.999 quantile of the chi-square distribution (Wilson-Hilferty; z is the normal 0.999 quantile)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi2_statistic(counts: torch.Tensor, probs: torch.Tensor) -> tuple:
    """Pearson's statistic of `counts` against `probs` (bins with an expected count under 5 merged into one), and
    its degrees of freedom."""
    expected = probs * counts.sum()
    small = expected < 5
    observed = torch.cat((counts[~small].double(), counts[small].sum().double().view(1)))
    expected = torch.cat((expected[~small].double(), expected[small].sum().double().view(1)))
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    return float(((observed - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


def left_padded(queries: list, width: int) -> torch.Tensor:
    return torch.tensor([[PAD] * (width - len(q)) + q for q in queries])


QUERIES = [[5, 6, 7], [8, 9], [3, 4, 5, 6, 7, 8], [10], [11, 12, 13, 14], [6, 6]]


# ------------------------------------------------------------------------------------------------
# the per-prompt sampler
# ------------------------------------------------------------------------------------------------
def test_gumbel_sampler_draws_from_softmax_at_the_temperature():
    """argmax(logits / T + Gumbel noise) on a toy distribution: 20,000 rows, each with its own seeded generator, give
    the frequencies of softmax(logits / T) (Pearson's chi-square under its 0.999 quantile), a banned token never, and
    frequencies that the same test tells apart from softmax(logits) at T = 1."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")])  # the last one banned, as [PAD] is
    temperature, n = 0.7, 20000
    generators = [torch.Generator().manual_seed(online.sample_seed(7, 1, row, 0)) for row in range(n)]
    scores = online.GumbelSampler(generators, temperature)(None, logits.expand(n, -1).clone())
    counts = torch.bincount(scores.argmax(1), minlength=len(logits))
    assert counts[-1] == 0
    statistic, dof = chi2_statistic(counts[:-1], F.softmax(logits[:-1] / temperature, 0))
    assert dof == 4 and statistic < chi2_critical(dof), statistic
    wrong, _ = chi2_statistic(counts[:-1], F.softmax(logits[:-1], 0))  # the distribution at T = 1
    assert wrong > chi2_critical(dof), wrong


def test_sampled_first_tokens_follow_the_model_at_the_temperature():
    """Through generate: the first response token of 3,000 rows of one query (each row its own prompt index, so its
    own seed) is distributed as the tiny model's softmax(logits / T) with [PAD] banned, and not as softmax(logits)
    (the tiny model's logits are within +-0.3, so a low T is what tells the two apart)."""
    model = tiny_causal_lm(pad_token_id=PAD, eos_token_id=EOS)
    temperature, n = 0.3, 3000
    args = SimpleNamespace(seed=3, temperature=temperature, response_length=1)
    queries = torch.tensor([[5, 6, 7]] * n)
    responses = online.sample_pairs(args, model, queries, torch.arange(n), 1, TOKENIZER)  # (n, 2, 1)
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7]])).logits[0, -1]
    logits[PAD] = float("-inf")
    counts = torch.bincount(responses[:, 0, 0], minlength=logits.numel())
    assert counts[PAD] == 0
    statistic, dof = chi2_statistic(counts, F.softmax(logits / temperature, 0))
    assert dof >= 5 and statistic < chi2_critical(dof), (statistic, dof)
    wrong, _ = chi2_statistic(counts, F.softmax(logits, 0))
    assert wrong > chi2_critical(dof), wrong


def test_a_batch_split_across_two_processes_samples_what_one_process_samples():
    """Each response's noise comes from (seed, draw, prompt index, k): two calls on the two halves of the prompts
    (what two processes do) give the very tokens of one call on all of them, in any order of the rows, with other
    padding widths; another draw or another seed gives other samples; the two responses to a prompt differ."""
    model = tiny_causal_lm(pad_token_id=PAD, eos_token_id=EOS)
    seed1, seed2 = (SimpleNamespace(seed=seed, temperature=1.0, response_length=8) for seed in (1, 2))
    queries, rows = left_padded(QUERIES, 6), torch.tensor([40, 3, 17, 8, 25, 11])  # rows: prompt indices in the split
    both = online.sample_pairs(seed1, model, queries, rows, 1, TOKENIZER)  # (6, 2, 8)
    halves = [online.sample_pairs(seed1, model, queries[part], rows[part], 1, TOKENIZER)
              for part in (slice(0, 3), slice(3, 6))]
    assert both.shape == (6, 2, 8)
    assert torch.equal(torch.cat(halves), both)
    order = torch.tensor([5, 2, 0, 4, 1, 3])
    assert torch.equal(online.sample_pairs(seed1, model, queries[order], rows[order], 1, TOKENIZER), both[order])
    assert not torch.equal(online.sample_pairs(seed1, model, queries, rows, 2, TOKENIZER), both)  # draw 2
    assert not torch.equal(online.sample_pairs(seed2, model, queries, rows, 1, TOKENIZER), both)  # seed 2
    assert not torch.equal(both[:, 0], both[:, 1])
    # Detail 23: [PAD] is never sampled; after the first EOS there is only [PAD]
    for response in both.flatten(0, 1).tolist():
        end = response.index(EOS) + 1 if EOS in response else len(response)
        assert PAD not in response[:end] and all(t == PAD for t in response[end:])


def test_gumbel_noise_is_drawn_by_generators_on_the_queries_device(monkeypatch):
    """Each row's generator lives on the device of the queries (the scores' device), so the B x V noise of a decode
    step is drawn there rather than on the CPU and copied over (issue 52); for a fixed seed on one device type the
    tokens are those of the draw written out here with per-row CPU generators: argmax(logits / T + G) per step."""
    model = tiny_causal_lm(pad_token_id=PAD, eos_token_id=EOS)
    args = SimpleNamespace(seed=3, temperature=0.9, response_length=5)
    queries, rows = torch.tensor([[3, 5, 6, 7], [8, 9, 10, 11]]), torch.tensor([4, 9])  # (no padding to cut)
    expected = []
    for row, query in zip(rows.tolist(), queries):
        for k in (0, 1):
            g = torch.Generator().manual_seed(online.sample_seed(args.seed, 1, row, k))
            tokens = query.tolist()
            for _ in range(args.response_length):
                with torch.no_grad():
                    logits = model(torch.tensor([tokens])).logits[0, -1].float()
                logits[PAD] = float("-inf")
                u = torch.rand(logits.numel(), generator=g).clamp_(min=torch.finfo(torch.float32).tiny)
                tokens.append(int((logits / args.temperature - torch.log(-torch.log(u))).argmax()))
            response = tokens[-args.response_length:]
            end = response.index(EOS) + 1 if EOS in response else len(response)
            expected.append(response[:end] + [PAD] * (len(response) - end))  # truncated after the first EOS
    made = []

    class Recorded(torch.Generator):
        def __new__(cls, *args, **kwargs):
            made.append(args + tuple(kwargs.values()))
            return super().__new__(cls, *args, **kwargs)

    monkeypatch.setattr(torch, "Generator", Recorded)
    responses = online.sample_pairs(args, model, queries, rows, 1, TOKENIZER)  # (2, 2, 5)
    assert made == [(queries.device,)] * 4, made
    assert responses.flatten(0, 1).tolist() == expected


# ------------------------------------------------------------------------------------------------
# labels: reward model, the EOS rule, the gold judge's endpoint
# ------------------------------------------------------------------------------------------------
def test_reward_model_labels_from_hand_built_scores():
    scores = torch.tensor([[1.0, 0.5], [0.2, 0.9], [0.3, 0.3], [2.0, -1.0], [0.0, 1.0], [0.7, 0.1]])
    has_eos = torch.tensor([[True, True], [True, True], [True, True], [False, True], [False, False], [True, True]])
    identical = torch.tensor([False, False, False, False, False, True])
    verdicts = online.rm_verdicts(scores)
    assert verdicts.tolist() == [0, 1, online.TIE, 0, 1, 0]
    chosen, keep, counts = online.label_pairs(verdicts, has_eos, identical, non_eos_penalty=True)
    # pair 3: the RM prefers the first, but only the second ends with EOS (Detail 23); pair 4: neither ends
    assert keep.tolist() == [True, True, False, True, False, False]
    assert chosen[keep].tolist() == [0, 1, 1]
    assert counts == {"pairs": 6, "pairs_kept": 3, "decided_by_eos": 1, "dropped_ties": 2, "dropped_invalid": 0,
                      "dropped_no_eos": 1}
    # without the EOS rule the reward model decides pairs 3 and 4 as well
    chosen, keep, counts = online.label_pairs(verdicts, has_eos, identical, non_eos_penalty=False)
    assert keep.tolist() == [True, True, False, True, True, False]
    assert chosen[keep].tolist() == [0, 1, 0, 1]
    assert counts["decided_by_eos"] == 0 and counts["dropped_no_eos"] == 0 and counts["dropped_ties"] == 2
    # the pairs in dpo.py's schema: chosen and rejected after the left-padded query, labels without the query
    queries = left_padded([[5, 6], [7]], 3)
    responses = torch.tensor([[[8, EOS, PAD], [9, 9, EOS]], [[10, EOS, PAD], [11, EOS, PAD]]])
    columns = online.pair_columns(queries, responses, torch.tensor([1, 0]), PAD)
    assert columns["query_chosen_token"].tolist() == [[PAD, 5, 6, 9, 9, EOS], [PAD, PAD, 7, 10, EOS, PAD]]
    assert columns["query_rejected_token"].tolist() == [[PAD, 5, 6, 8, EOS, PAD], [PAD, PAD, 7, 11, EOS, PAD]]
    assert columns["query_chosen_token_response_label"].tolist() == [[PAD] * 3 + [9, 9, EOS],
                                                                     [PAD] * 3 + [10, EOS, PAD]]


def gold_pairs(n: int, seed: int):
    """Posts of the built-in task and two summaries of each by different synthetic policies (never identical)."""
    rng, policies = random.Random(seed), ["good", "drop", "filler", "short", "invent", "title"]
    posts, firsts, seconds = [], [], []
    for i in range(n):
        post = make_post(rng)
        posts.append(f"SUBREDDIT: r/{post['subreddit']}\n\nTITLE: {post['title']}\n\nPOST: {post['post']}\n\nTL;DR:")
        first = " " + policy_summary(policies[i % len(policies)], post, rng)
        second = " " + reference_summary(post["facts"], rng)
        firsts.append(first)
        seconds.append(second if second.strip() != first.strip() else second + " tbh")
    return posts, firsts, seconds


def endpoint_args(server, **overrides):
    fields = {**asdict(online.EndpointArgs(base_url=server.base_url, model=server.model_name,
                                           backoff_base_s=0.001, backoff_max_s=0.01, timeout_s=20.0)),
              "seed": 1, **overrides}
    return SimpleNamespace(**fields)


def test_endpoint_labels_equal_the_gold_verdicts(tmp_path, monkeypatch):
    """--judge endpoint against the built-in gold judge on loopback: every asked pair gets the gold verdict, whichever
    order pair_order showed the two summaries in (both orders occur); pairs not asked, and two texts that read the
    same, send no request; asking again is answered by the cache; a judge that never answers in the format gives
    INVALID, which drops and counts the pair."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    posts, firsts, seconds = gold_pairs(12, seed=5)
    firsts[4] = seconds[4] + "<|endoftext|>"  # reads the same as the second once the EOS spelling is stripped
    asked = torch.ones(12, dtype=torch.bool)
    asked[7] = False  # decided before the judge (e.g. by the EOS rule)
    with gjs.serve_in_thread() as server:
        args = endpoint_args(server)
        verdicts, stats = online.endpoint_verdicts(args, str(tmp_path / "cache.sqlite"), posts, firsts, seconds, asked)
        assert server.request_count == 10 == stats["requests"]
        # the same pairs again (a resumed run): every reply comes from the cache
        again, stats = online.endpoint_verdicts(args, str(tmp_path / "cache.sqlite"), posts, firsts, seconds, asked)
        assert server.request_count == 10 and stats["cache_hits"] == 10 and torch.equal(again, verdicts)
    truth = [0 if gold_prefer(p.strip(), a.strip(), b.strip()) == "A" else 1 for p, a, b in zip(posts, firsts, seconds)]
    judged = [i for i in range(12) if i not in (4, 7)]
    assert [int(verdicts[i]) for i in judged] == [truth[i] for i in judged]
    assert set(truth[i] for i in judged) == {0, 1}
    assert int(verdicts[4]) == online.TIE and int(verdicts[7]) == online.TIE
    orders = {online.pair_order(1, posts[i].strip(), firsts[i].strip(), seconds[i].strip()) for i in judged}
    assert orders == {0, 1}
    # a judge that only answers garbage: invalid, dropped and counted, never a coin flip
    with gjs.serve_in_thread(garbage_rate=1.0, seed=3) as server:
        garbage, stats = online.endpoint_verdicts(endpoint_args(server, max_parse_tries=2),
                                                  str(tmp_path / "garbage.sqlite"), posts, firsts, seconds, asked)
        assert server.request_count == 20  # two asks per pair
    assert [int(garbage[i]) for i in judged] == [online.INVALID] * 10
    has_eos = torch.ones(12, 2, dtype=torch.bool)
    _, keep, counts = online.label_pairs(garbage, has_eos, torch.zeros(12, dtype=torch.bool), non_eos_penalty=True)
    assert not keep.any() and counts["dropped_invalid"] == 10 and counts["dropped_ties"] == 2


def test_the_api_key_comes_from_the_environment_only(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    args = online.Args(judge="endpoint", endpoint=online.EndpointArgs(base_url="https://judge.invalid/v1"))
    with pytest.raises(SystemExit, match="OPENAI_API_KEY"):
        online.check_online_flags(args)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-secret-123")
    online.check_online_flags(args)
    assert "sk-test-secret-123" not in json.dumps(asdict(args))  # what args.json would hold
    loopback = online.Args(judge="endpoint", endpoint=online.EndpointArgs(base_url="http://127.0.0.1:1/v1"))
    monkeypatch.delenv("OPENAI_API_KEY")
    online.check_online_flags(loopback)  # the built-in gold judge needs no key
    assert loopback.pairs_per_round == loopback.total_batch_size


def test_the_last_round_as_reference_needs_rounds_of_several_updates():
    """--reference last_round with rounds of one update (the default --pairs_per_round) would make the reference the
    policy of that very update: every loss log 2, no KL anchor. Refused at the flag check, naming both flags."""
    for pairs_per_round in (None, 8):
        with pytest.raises(online.RunError, match=r"--reference last_round.*--pairs_per_round 8.*several updates"):
            online.check_online_flags(online.Args(reference="last_round", total_batch_size=8,
                                                  pairs_per_round=pairs_per_round))
    online.check_online_flags(online.Args(reference="last_round", total_batch_size=8, pairs_per_round=16))
    online.check_online_flags(online.Args(reference="sft", total_batch_size=8))  # online DPO against SFT: fine


# ------------------------------------------------------------------------------------------------
# the reference: the SFT model or the policy at the end of the last round
# ------------------------------------------------------------------------------------------------
def tiny_reward_model(seed: int) -> GPTNeoXForSequenceClassification:
    torch.manual_seed(seed)
    config = GPTNeoXConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=64, eos_token_id=EOS, bos_token_id=EOS,
                           pad_token_id=PAD, num_labels=1)
    return GPTNeoXForSequenceClassification(config).eval()


def test_reference_is_the_sft_model_or_the_policy_at_the_start_of_the_round(tmp_path):
    """One round through online_round (sampling, reward-model labels, refills, reference log-probs): the same pairs
    with either flag, and their reference log-probs are those of the SFT model (--reference sft) or of the policy as
    it is when the round starts, i.e. at the end of the last round (--reference last_round)."""
    policy, sft = (tiny_causal_lm(seed=0, pad_token_id=PAD, eos_token_id=EOS),
                   tiny_causal_lm(seed=1, pad_token_id=PAD, eos_token_id=EOS))
    prompts = online.with_row_index(Dataset.from_dict({"query_token": left_padded(QUERIES * 4, 6).tolist()}),
                                    ["query_token"])
    logged = []
    run = SimpleNamespace(guard=lambda update, **quantities: None, log=lambda step, metrics: logged.append(metrics),
                          dir=str(tmp_path))
    tables, held = {}, {}
    for reference in ("sft", "last_round"):
        args = online.Args(reference=reference, pairs_per_round=8, total_batch_size=8, response_length=6,
                           local_eval_batch_size=3, local_rollout_forward_batch_size=5, max_draws_per_round=4)
        rounds = online.OnlineRounds()
        online.online_round(args, Accelerator(cpu=True), run, rounds, policy, sft, tiny_reward_model(2), None, prompts,
                            TOKENIZER, round_index=1, update=1)  # (None: no --reward_fn)
        tables[reference], held[reference] = rounds.ref_table, rounds
        assert rounds.index == 1 and rounds.keep.shape == (8,) and rounds.ref_table.shape == (8, 2)
        assert rounds.totals["pairs_trained"] == int(rounds.keep.sum()) and rounds.totals["draws"] == rounds.draws >= 1
    for name in online.PAIR_COLUMNS:
        assert torch.equal(held["sft"].pairs[name], held["last_round"].pairs[name])  # sampled from the same policy
    with torch.no_grad():
        by_model = {name: torch.stack(online.concatenated_logprobs(model, held["sft"].pairs, PAD), 1)
                    for name, model in (("sft", sft), ("policy", policy))}
    assert torch.allclose(tables["sft"], by_model["sft"], atol=1e-5)
    assert torch.allclose(tables["last_round"], by_model["policy"], atol=1e-5)
    assert (by_model["sft"] - by_model["policy"]).abs().max() > 1e-2  # the two references differ
    assert logged[0]["online/round"] == 1 and logged[0]["online/pairs_trained"] == int(held["sft"].keep.sum())
    # every prompt batch drawn counts against the budget, a redrawn one too (--max_draws_per_round 4)
    assert logged[0]["budget/responses_sampled"] == 2 * held["sft"].totals["pairs"] == 16 * held["sft"].draws


# ------------------------------------------------------------------------------------------------
# runs on the built-in task
# ------------------------------------------------------------------------------------------------
def online_flags(task: dict) -> list:
    return ["--sft_model_path", task["base_model"], "--preference_dataset", task["preference"],
            "--query_dataset", task["sft"], "--response_length", str(task["task"]["sft_response_length"]),
            "--total_batch_size", "16", "--local_micro_batch_size", "8", "--lr", "1e-3", "--beta", "0.1",
            "--num_eval_samples", "8", "--local_eval_batch_size", "8"]


def online_command(task: dict, tmp_path, output_dir, *extra: str) -> list:
    return [sys.executable, os.path.join(REPO_ROOT, "online_dpo.py"), *online_flags(task),
            "--output_dir", str(output_dir), "--run_dir_root", str(tmp_path / "runs"), *extra]


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_end_to_end_with_the_gold_judge_and_the_last_round_as_reference(synthetic_task, tmp_path, monkeypatch):
    """A tiny run labelled by the gold judge's endpoint (started here, on loopback), rounds of two updates and the
    policy at the end of the last round as the reference: each round's first update starts with the policy equal to
    its reference, so its rewards are 0 and its loss is log 2, while the policy moves away from the SFT model. The
    judge's replies are cached in the run folder; the round counts are logged and summed in the summary."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    output_dir, runs = tmp_path / "model", tmp_path / "runs"
    with gjs.serve_in_thread() as server:
        run_ok(online_command(synthetic_task, tmp_path, output_dir, "--run_name", "e2e", "--total_episodes", "64",
                              "--judge", "endpoint", "--endpoint.base_url", server.base_url, "--endpoint.model",
                              server.model_name, "--reference", "last_round", "--pairs_per_round", "32",
                              "--log_every", "1", "--eval_every", "0"),
               cwd=REPO_ROOT, env=ENV)
        requests = server.request_count
    run_dir = runs / "e2e"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if "train/pairs" in m]
    rounds = [m for m in metrics if "online/round" in m]
    assert [m["step"] for m in train] == [1, 2, 3, 4] and [m["online/round"] for m in rounds] == [1, 2]
    # each update's wall time (issue 51), a round's sampling in its first update
    assert all(m["time/update_s"] > 0 for m in train) and train[0]["time/update_s"] >= rounds[0]["online/round_s"]
    for first, second, r in zip(train[::2], train[1::2], rounds):
        assert first["train/pairs"] > 0  # a round's kept pairs fill its first update first
        assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-5)
        assert first["train/rewards/chosen"] == pytest.approx(0.0, abs=1e-6)
        if second["train/pairs"] > 0:
            assert second["train/loss"] != pytest.approx(math.log(2), abs=1e-5)  # the policy has left its reference
        else:  # every pair left for it was a tie: no means are logged for it, never NaN
            assert "train/loss" not in second
            assert not any(isinstance(value, float) and math.isnan(value) for value in second.values())
        assert first["train/pairs"] + second["train/pairs"] == r["online/pairs_trained"] > 0  # the round's kept pairs
        assert r["online/pairs_trained"] == min(32, r["online/pairs_kept"]) and r["online/draws"] == 1
    asked = sum(m["online/pairs"] - m["online/decided_by_eos"] - m["online/dropped_no_eos"] - m["online/dropped_ties"]
                for m in rounds)
    assert 0 < requests and asked <= requests  # every pair the EOS rule left open was asked (plus any re-asks)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["num_updates"] == 4
            and summary["online/pairs_trained_total"] == sum(m["online/pairs_trained"] for m in rounds))
    assert summary["online/pairs_total"] == sum(m["online/pairs"] for m in rounds) == 64
    # the budget it claims (--total_episodes 64 prompts, a pair of responses each) is what it sampled: each prompt once,
    # a pair the judge cannot separate weighs 0 instead of being redrawn (ppo.py's, rloo.py's and grpo.py's rule)
    assert [m["budget/responses_sampled"] for m in rounds] == [64, 128]
    assert summary["budget/responses_sampled"] == 128 and summary["budget/prompts"] == 64
    assert summary["budget/updates"] == 4
    assert (run_dir / "judge_cache.sqlite").exists()
    assert json.loads((run_dir / "args.json").read_text())["endpoint"]["base_url"] == server.base_url
    samples = pd.read_csv(run_dir / "samples.csv")
    assert len(samples) == 8 and samples["response_token_len"].between(
        1, synthetic_task["task"]["sft_response_length"]).all()
    trained = AutoModelForCausalLM.from_pretrained(output_dir).state_dict()
    start = AutoModelForCausalLM.from_pretrained(synthetic_task["base_model"]).state_dict()
    assert any(not torch.equal(trained[name], start[name]) for name in start)


def reward_model_for(task: dict) -> str:
    """A reward model for the built-in task's tiny base model: its trunk with a seeded scalar head."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = os.path.join(task["root"], "online_dpo_reward_model")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        torch.manual_seed(0)
        AutoModelForSequenceClassification.from_pretrained(task["base_model"], num_labels=1).save_pretrained(path)
        AutoTokenizer.from_pretrained(task["base_model"]).save_pretrained(path)
    return path


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_weights_and_metrics(synthetic_task, tmp_path):
    """Rounds of 2 updates labelled by a reward model; SIGKILL after the update-3 checkpoint, which falls inside round
    2, then --resume: the round's pairs and reference log-probs come from the checkpoint (the policy that sampled
    them is gone), and the policy, metrics.jsonl, summary.json and samples equal an uninterrupted run's."""
    # 4 updates in rounds of 2 (rounds start at updates 1 and 3); logs at 2 and 4, an evaluation at 2
    flags = ["--reward_model_path", reward_model_for(synthetic_task), "--total_episodes", "64",
             "--pairs_per_round", "32",
             "--checkpoint_every", "3", "--eval_every", "2", "--log_every", "2", "--eval_temperature", "1.0"]
    runs = tmp_path / "runs"
    run_ok(online_command(synthetic_task, tmp_path, tmp_path / "full", "--run_name", "full", *flags), cwd=REPO_ROOT,
           env=ENV)
    command = online_command(synthetic_task, tmp_path, tmp_path / "cut", "--run_name", "cut", *flags)
    kill_after_checkpoint(command, runs / "cut" / "checkpoints" / "update_000003", cwd=REPO_ROOT, env=ENV, timeout=240)
    assert not (tmp_path / "cut" / "model.safetensors").exists()
    resumed = run_ok(command + ["--resume"], cwd=REPO_ROOT, env=ENV)
    assert "cut/checkpoints/update_000003 (update 3)" in resumed.stdout + resumed.stderr
    assert_same_safetensors(tmp_path / "full" / "model.safetensors", tmp_path / "cut" / "model.safetensors")
    rows = {name: [without_timing(json.loads(line)) for line in open(runs / name / "metrics.jsonl")]
            for name in ("full", "cut")}
    assert [r["step"] for r in rows["full"] if "online/round" in r] == [1, 3]
    assert rows["cut"] == rows["full"]
    summaries = {name: without_timing(json.load(open(runs / name / "summary.json"))) for name in ("full", "cut")}
    assert summaries["cut"] == summaries["full"]
    assert (runs / "cut" / "samples.csv").read_text() == (runs / "full" / "samples.csv").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("memory, reference", [(["--lora_rank", "8", "--load_in_4bit"], "sft"),
                                               (["--lora_rank", "8", "--pairs_per_round", "32"], "last_round")],
                         ids=["qlora", "lora"])
def test_lora_run_saves_a_plain_float32_model(memory, reference, synthetic_task, tmp_path):
    """LoRA and QLoRA as dpo.py runs them (tests/test_qlora.py): the reference is the policy with its adapters off
    (QLoRA: the 4-bit base itself), or the policy of the round's start, so the first update's rewards are exactly 0 and
    its loss log 2; the saved model has the adapters merged in float32 and loads with a plain from_pretrained, its
    frozen parts the start's bit for bit and its adapted layers near the start."""
    from safetensors.torch import load_file

    command = online_command(synthetic_task, tmp_path, tmp_path / "model", "--run_name", "lora", "--reward_model_path",
                             reward_model_for(synthetic_task), "--total_episodes", "32", "--log_every", "1",
                             "--eval_every", "1", "--reference", reference, *memory,
                             # redraws keep update 1 from losing every pair to a tie (its rewards are then NaN)
                             "--max_draws_per_round", "4")
    run_ok(command, cwd=REPO_ROOT, env=ENV, timeout=600)
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")  # a plain from_pretrained, as judge.py loads it
    assert all(p.dtype == torch.float32 for p in model.parameters())
    saved = load_file(tmp_path / "model" / "model.safetensors")
    start = load_file(os.path.join(synthetic_task["base_model"], "model.safetensors"))
    assert saved.keys() == start.keys()
    # the frozen parts are the start's, bit for bit; the blocks' linear layers are the base plus the adapters
    adapted = [name for name in saved if ".layers." in name and name.endswith(".weight") and saved[name].dim() == 2]
    assert len(adapted) == 4 * model.config.num_hidden_layers
    assert all(torch.equal(saved[name], start[name]) for name in saved if name not in adapted)
    assert all(not torch.equal(saved[name], start[name]) for name in adapted)
    assert max((saved[name] - start[name]).abs().max() for name in adapted) < 0.5  # near the start, not noise
    first = next(json.loads(line) for line in open(tmp_path / "runs" / "lora" / "metrics.jsonl")
                 if "train/loss" in line)
    assert first["train/rewards/chosen"] == first["train/rewards/rejected"] == 0.0
    assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-7)


NAN_IN_LOSS = """
import runpy, sys, torch; from rlhf_utils import run as run_module
guard, calls = run_module.Run.guard, []
def planted(self, update, **quantities):
    calls.append(update) if "train/loss" in quantities else None
    if "train/loss" in quantities and update == {update} and calls.count(update) == {call}:
        quantities = {{name: torch.full_like(value, float("nan")) for name, value in quantities.items()}}
    guard(self, update, **quantities)
run_module.Run.guard = planted
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_resuming_from_the_non_finite_fallback_equals_resuming_from_the_ordinary_checkpoint(synthetic_task, tmp_path):
    """A NaN loss in the second micro batch of update 3, the first update of round 2: the round's pairs have been
    sampled, judged and given their reference log-probs, and the first micro batch has gone backward. The run stops
    and saves the state after update 2 (round 1's pairs and counts, the RNG states, accelerate's micro-step count) as
    its checkpoint, byte for byte the ordinary checkpoint of update 2 of the same run without the NaN. Resumed from
    either, the run ends with the same weights and metrics."""
    flags = ["--reward_model_path", reward_model_for(synthetic_task), "--total_episodes", "64",
             "--pairs_per_round", "32",
             "--checkpoint_every", "1", "--checkpoint_keep", "0", "--eval_every", "2", "--log_every", "1"]
    runs = tmp_path / "runs"
    command = {run: online_command(synthetic_task, tmp_path, tmp_path / run, "--run_name", run, *flags)
               for run in ("poisoned", "ordinary")}
    planted = [sys.executable, "-c", NAN_IN_LOSS.format(update=3, call=2), *command["poisoned"][1:]]
    poisoned = subprocess.run(planted, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert poisoned.returncode != 0 and "online_dpo.py: error: update 3: train/loss" in poisoned.stderr
    assert sorted(os.listdir(runs / "poisoned" / "checkpoints")) == ["update_000001", "update_000002"]
    run_ok(command["ordinary"], cwd=REPO_ROOT, env=ENV)
    fallback, ordinary = (runs / run / "checkpoints" / "update_000002" for run in ("poisoned", "ordinary"))
    assert sorted(os.listdir(fallback)) == sorted(os.listdir(ordinary))
    for name in sorted(os.listdir(ordinary)):
        if name == "trainer_state.json":  # the same but for the clock
            states = [json.loads((d / name).read_text()) for d in (fallback, ordinary)]
            for state in states:
                state.pop("interval_time")
                state["last_train_metrics"] = without_timing(state["last_train_metrics"])
            assert states[0] == states[1]
        elif name != "manifest.json":  # its sizes include the trainer state's, whose seconds differ
            assert (fallback / name).read_bytes() == (ordinary / name).read_bytes(), name
    # both resumed from update 2: the ordinary run without its newer checkpoint
    shutil.rmtree(runs / "ordinary" / "checkpoints" / "update_000003")
    for run in ("poisoned", "ordinary"):
        resumed = run_ok(command[run] + ["--resume"], cwd=REPO_ROOT, env=ENV)
        assert "update_000002 (update 2)" in resumed.stdout + resumed.stderr
    assert_same_safetensors(tmp_path / "ordinary" / "model.safetensors", tmp_path / "poisoned" / "model.safetensors")
    lines = {run: [without_timing(json.loads(line)) for line in open(runs / run / "metrics.jsonl")]
             for run in ("poisoned", "ordinary")}
    assert lines["poisoned"] == lines["ordinary"]


def test_an_update_whose_pairs_were_all_ties_leaves_the_logged_means_finite():
    """With one draw per prompt (the default) an update can train on no pair: its row of means is NaN (0 / 0). The
    interval averages each quantity over the updates that trained, and leaves out one that none did; the pair count
    (0 for such an update) is averaged over every update."""
    interval = online.LoggingInterval({"interval": [], "interval_tokens": 0, "interval_time": 0.0,
                                       "last_train_metrics": {}})
    width = len(online.TRAIN_STATS) - 1
    interval.add([math.nan] * width + [0.0], 0)
    interval.add([1.0] * width + [4.0], 10)
    means = interval.close(1e-3, 0.5)
    assert means["train/loss"] == 1.0 and means["train/pairs"] == 2.0
    interval.add([math.nan] * width + [0.0], 0)
    means = interval.close(1e-3, 0.5)
    assert "train/loss" not in means and means["train/pairs"] == 0.0
    assert all(not math.isnan(value) for value in means.values())
