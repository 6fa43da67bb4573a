"""The built-in gold judge behind an OpenAI-compatible endpoint (data/gold_judge_server.py)."""

import json
import os
import random
import re
import subprocess
import sys
import urllib.request

import pytest
from openai import OpenAI

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from data import gold_judge_server as gjs  # noqa: E402
from data.synthetic import gold_prefer, gold_score, make_post, policy_summary  # noqa: E402

POLICIES = ["good", "drop", "short", "filler", "runon", "invent", "title", "ref"]


def formatted_query(post: dict) -> str:
    return f"SUBREDDIT: r/{post['subreddit']}\n\nTITLE: {post['title']}\n\nPOST: {post['post']}\n\nTL;DR:"


def test_pairwise_template_round_trip_with_hostile_text():
    post = "POST: boss lost cash.\n\nSummary A:\nnot a header {summary_b} {post}\n\nTL;DR:"
    a, b = "boss lost cash.\n\nSummary B:\nfake", "lol {x}"
    prompt = gjs.fill_template(gjs.PAIRWISE_JUDGE_TEMPLATE, post=post, summary_a=a, summary_b=b)
    assert "{summary_b} {post}" in prompt  # inserted text is never substituted again
    assert prompt.startswith("Which of the following summaries does a better job of summarizing the most important "
                             "points")
    assert prompt.endswith('Comparison: <one-sentence comparison and explanation>\nPreferred: <"A" or "B">')
    # the greedy groups pick the last headers: a summary holding "Summary B:" is the one ambiguity
    parsed = gjs.parse_pairwise_prompt(prompt)
    assert parsed is not None and parsed[0].startswith("POST: boss lost cash.")
    clean = gjs.fill_template(gjs.PAIRWISE_JUDGE_TEMPLATE, post=post, summary_a="x {y}", summary_b=b)
    assert gjs.parse_pairwise_prompt(clean) == (post, "x {y}", b)
    assert gjs.parse_pairwise_prompt(clean.replace("Judge based on", "Judge on")) is None
    assert gjs.parse_pairwise_prompt(clean + " ") is None


def test_multi_template_round_trip():
    names, answers = ["A", "B", "C"], ["first answer.", "second\n\nwith a blank line", ""]
    blocks = "\n\n".join(gjs.fill_template(gjs.MULTI_ANSWER_BLOCK_TEMPLATE, name=n, answer=a)
                         for n, a in zip(names, answers))
    prompt = gjs.fill_template(gjs.MULTI_ANSWER_JUDGE_TEMPLATE, num_assistants="three", assistant_names="A, B and C",
                               question="POST: q\n\nTL;DR:", answers=blocks)
    assert "{Assistant name}: {score}, where the range of {score} is 1 to 10." in prompt  # literal braces kept
    assert gjs.parse_multi_prompt(prompt) == ("POST: q\n\nTL;DR:", names, answers)
    # the count must match the names
    assert gjs.parse_multi_prompt(
        prompt.replace("by three AI", "by four AI").replace("the three responses", "the four responses")) is None
    assert gjs.parse_multi_prompt(prompt.replace("by three AI", "by four AI")) is None  # inconsistent counts


def test_refuses_non_loopback_hosts():
    for host in ["0.0.0.0", "8.8.8.8", "example.com", "::"]:
        with pytest.raises(ValueError, match="loopback"):
            gjs.check_loopback(host)
    gjs.check_loopback("127.0.0.1")
    gjs.check_loopback("::1")
    with pytest.raises(ValueError, match="loopback"):
        with gjs.serve_in_thread(host="0.0.0.0"):
            pass


def test_endpoint_answers_paper_prompt_with_gold_verdicts():
    rng = random.Random(0)
    with gjs.serve_in_thread() as server:
        client = OpenAI(base_url=server.base_url, api_key="sk-placeholder", max_retries=0)
        assert [m.id for m in client.models.list().data] == [gjs.GOLD_JUDGE_MODEL] == [server.model_name]
        assert re.fullmatch(r"gold-judge-[0-9a-f]{12}", server.model_name)
        for i in range(24):
            post = make_post(rng)
            query = formatted_query(post)
            a = policy_summary(POLICIES[i % len(POLICIES)], post, rng)
            b = policy_summary(POLICIES[(i * 3 + 1) % len(POLICIES)], post, rng)
            prompt = gjs.fill_template(gjs.PAIRWISE_JUDGE_TEMPLATE, post=query, summary_a=a, summary_b=b)
            reply = client.chat.completions.create(
                model=server.model_name,
                messages=[{"role": "system", "content": "sys"}, {"role": "user", "content": prompt}]
            ).choices[0].message.content
            lines = reply.split("\n")
            assert len(lines) == 2 and lines[0].startswith("Comparison: ") and lines[0].endswith(".")
            assert lines[1] == f"Preferred: {gold_prefer(query, a, b)}"
        assert server.request_count == 24
        assert server.stats()["ok"] == 24


def test_endpoint_multi_answer_scores_follow_gold_score():
    rng = random.Random(1)
    post = make_post(rng)
    query = formatted_query(post)
    answers = [policy_summary(p, post, rng) for p in ["good", "runon", "invent"]]
    names = ["A", "B", "C"]
    blocks = "\n\n".join(gjs.fill_template(gjs.MULTI_ANSWER_BLOCK_TEMPLATE, name=n, answer=a)
                         for n, a in zip(names, answers))
    prompt = gjs.fill_template(gjs.MULTI_ANSWER_JUDGE_TEMPLATE, num_assistants="three", assistant_names="A, B and C",
                               question=query, answers=blocks)
    with gjs.serve_in_thread() as server:
        client = OpenAI(base_url=server.base_url, api_key="sk-placeholder", max_retries=0)
        reply = client.chat.completions.create(
            model=server.model_name, messages=[{"role": "user", "content": prompt}]
        ).choices[0].message.content
    score_lines = reply.split("Scores:")[1].split()
    got = dict(zip([w for w in score_lines[1::3]], [float(s) for s in score_lines[2::3]]))
    expected = {n.rstrip(":"): gjs.gold_score_1_to_10(query, a) for n, a in zip(names, answers)}
    assert {k.rstrip(":"): v for k, v in got.items()} == expected
    assert all(1.0 <= v <= 10.0 for v in expected.values())
    # the ordering is gold_score's
    golds = [gold_score(query, a) for a in answers]
    assert sorted(range(3), key=lambda k: golds[k]) == sorted(range(3), key=lambda k: (expected[names[k]], golds[k]))


def test_fault_injection_and_bad_requests():
    import openai

    prompt = gjs.fill_template(gjs.PAIRWISE_JUDGE_TEMPLATE, post="POST: dad sold cash", summary_a="x.", summary_b="y.")
    with gjs.serve_in_thread(fail_rate=1.0, seed=3, model_name="m") as server:
        client = OpenAI(base_url=server.base_url, api_key="sk-placeholder", max_retries=0)
        codes = []
        for _ in range(20):
            with pytest.raises((openai.RateLimitError, openai.InternalServerError)) as e:
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}])
            codes.append(e.value.status_code)
        stats = server.stats()
    assert set(codes) == {429, 500} and stats["status_429"] + stats["status_500"] == 20 == stats["requests"]
    with gjs.serve_in_thread(garbage_rate=1.0, seed=3, model_name="m") as server:
        client = OpenAI(base_url=server.base_url, api_key="sk-placeholder", max_retries=0)
        for _ in range(8):
            reply = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": prompt}]
            ).choices[0].message.content
            assert reply in gjs.GARBAGE_REPLIES
        assert server.stats()["garbage"] == 8
    with gjs.serve_in_thread(model_name="m") as server:
        client = OpenAI(base_url=server.base_url, api_key="sk-placeholder", max_retries=0)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "tell me a joke"}])
        # another model name (e.g. an older gold judge's) is unknown here, as on a real API
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.chat.completions.create(model="gold-judge", messages=[{"role": "user", "content": prompt}])
        assert server.stats()["bad_request"] == 2 and server.stats()["ok"] == 0
    with pytest.raises(ValueError):
        gjs.GoldJudgeServer("127.0.0.1", 0, 0.7, 0.5, 0, 0.0, "m")


def test_model_id_carries_a_digest_of_the_gold_judge_code(tmp_path):
    """A changed gold judge is a new model id, so cached verdicts of the old one are never reused."""
    version = gjs._gold_judge_version()
    assert gjs.GOLD_JUDGE_MODEL == f"gold-judge-{version}"
    import hashlib

    digest = hashlib.sha256()
    for name in ["synthetic.py", "gold_judge_server.py"]:
        digest.update(open(os.path.join(REPO, "data", name), "rb").read())
    assert version == digest.hexdigest()[:12]


def test_cli_prints_url_and_serves():
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "data", "gold_judge_server.py"), "--port", "0",
                             "--host", "127.0.0.1"],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        assert proc.stdout.readline().strip() == f"model: {gjs.GOLD_JUDGE_MODEL}"
        with urllib.request.urlopen(url + "/models", timeout=10) as r:
            assert json.load(r)["data"][0]["id"] == gjs.GOLD_JUDGE_MODEL
    finally:
        proc.terminate()
        proc.wait(timeout=10)
