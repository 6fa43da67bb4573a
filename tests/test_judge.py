"""judge.py against the built-in gold judge, started on loopback by the tests themselves."""

import contextlib
import dataclasses
import inspect
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import numpy as np
import pandas as pd
import pytest

from conftest import load_script

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from data import gold_judge_server as gjs  # noqa: E402
from data.synthetic import gold_prefer, make_post, policy_summary, reference_summary  # noqa: E402

judge = load_script("judge")
# the input checks and expected errors the scripts import, and the judge's HTTP client judge.py imports
from rlhf_utils import checks, judge_client  # noqa: E402

POLICIES = ["good", "drop", "short", "filler", "runon", "invent", "title", "ref"]


def make_samples(path: str, n: int, seed: int, policies=POLICIES, ties: bool = True) -> pd.DataFrame:
    """A sample CSV in the training scripts' format, responses from the synthetic policies."""
    rng, policy_rng = random.Random(seed), random.Random(f"{seed}-{policies}")  # same posts for any policies
    rows = []
    for i in range(n):
        post = make_post(rng)
        query = f"SUBREDDIT: r/{post['subreddit']}\n\nTITLE: {post['title']}\n\nPOST: {post['post']}\n\nTL;DR:"
        rows.append({"query": query, "response": " " + policy_summary(policies[i % len(policies)], post, policy_rng),
                     "reference": " " + reference_summary(post["facts"], rng), "score": "",
                     "response_token_len": 10, "has_eos": True})
    df = pd.DataFrame(rows)
    if not ties:  # a response that is its reference is a tie, never asked; tests that count requests want none
        same = df["response"].str.strip() == df["reference"].str.strip()
        df.loc[same, "reference"] = df.loc[same, "reference"] + " tbh"
    df.to_csv(path, index=False)
    return df


def gold_wins(df: pd.DataFrame, baseline_column: str = "reference") -> list[bool]:
    """The gold verdict, order-free: does the response beat the baseline? (Identical texts are a
    tie that gold_prefer breaks by position, so the test checks those through gold_winners.)"""
    return [gold_prefer(q.strip(), r.strip(), b.strip()) == "A"
            for q, r, b in zip(df["query"], df["response"], df[baseline_column])]


def gold_winners(judged: pd.DataFrame) -> list[str]:
    """The gold verdict on exactly the prompt the judge sent (summary A and B as shown)."""
    out = []
    for q, a, b, s in zip(judged["query"], judged["summary_a"], judged["summary_b"], judged["shuffled_index"]):
        out.append("ours" if (gold_prefer(q.strip(), str(a), str(b)) == "A") == (s == 0) else "baseline")
    return out


def judge_args(tmp_path, server, **kw) -> "judge.Args":
    base = dict(output_dir=str(tmp_path / "out"), base_url=server.base_url, model=server.model_name,
                cache_path=str(tmp_path / "cache.sqlite"), length_unit="chars", backoff_base_s=0.001,
                backoff_max_s=0.01, timeout_s=20.0)
    base.update(kw)
    return judge.Args(**base)


@pytest.fixture(autouse=True)
def _no_real_key(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)


# ----------------------------------------------------------------------------------------------
# prompt templates, parsing, statistics
# ----------------------------------------------------------------------------------------------
def test_templates_identical_to_the_server_copies():
    assert judge.PAIRWISE_JUDGE_TEMPLATE == gjs.PAIRWISE_JUDGE_TEMPLATE
    assert judge.MULTI_ANSWER_JUDGE_TEMPLATE == gjs.MULTI_ANSWER_JUDGE_TEMPLATE
    assert judge.MULTI_ANSWER_BLOCK_TEMPLATE == gjs.MULTI_ANSWER_BLOCK_TEMPLATE
    for name in ["fill_template", "number_word"]:
        assert inspect.getsource(getattr(judge, name)) == inspect.getsource(getattr(gjs, name))
    assert judge._PLACEHOLDER_RE.pattern == gjs._PLACEHOLDER_RE.pattern
    # the paper's wording (Appendix I), with its line continuations joined
    assert ("most important points in the given forum post, without including unimportant or irrelevant details?"
            in judge.PAIRWISE_JUDGE_TEMPLATE)
    assert "explaining which you prefer and why. SECOND, on a new line" in judge.PAIRWISE_JUDGE_TEMPLATE
    prompt = judge.multi_answer_prompt("q?", ["A", "B"], ["x", "y"])
    assert gjs.parse_multi_prompt(prompt) == ("q?", ["A", "B"], ["x", "y"])
    assert "provided by two AI assistants" in prompt and "Assistant A and B," in prompt


@pytest.mark.parametrize("reply,expected", [
    ("Comparison: A is more accurate.\nPreferred: A", ("A", "A is more accurate.")),
    ('Comparison: B covers more.\nPreferred: "B"', ("B", "B covers more.")),
    ("Comparison: fine\n\nPreferred: B.", ("B", "fine")),
    ("**Comparison:** x\n**Preferred:** A", ("A", "x")),
    ("Preferred: A", ("A", "")),
    ("Comparison: neither is great\nPreferred: B\n", ("B", "neither is great")),
])
def test_parser_accepts_paper_format(reply, expected):
    assert judge.parse_verdict(reply) == expected


@pytest.mark.parametrize("reply", [
    "", "I prefer A", "Comparison: both fine.", "Preferred: C", "Preferred: both", "Preferred: A or B",
    "Preferred: A\nPreferred: B", "Preferred: AB", "Comparison: x Preferred: A", "Preferred: <\"A\" or \"B\">",
])
def test_parser_rejects_malformed(reply):
    assert judge.parse_verdict(reply) is None


# issue 33: the answer forms judges write, one test each; anything else stays invalid
@pytest.mark.parametrize("reply,expected", [
    ("Comparison: A is tighter.\nPreferred: A", "A"),
    ("Comparison: B keeps the facts.\nPreferred: Summary B", "B"),
    ("Comparison: b keeps the facts.\npreferred: b", "B"),
    ("Comparison: A is tighter.\nPreferred:\nA", "A"),
], ids=["letter", "summary_letter", "lower_case", "letter_on_the_next_line"])
def test_parser_accepts_common_answer_forms(reply, expected):
    assert judge.parse_verdict(reply)[0] == expected


@pytest.mark.parametrize("reply", [
    "Preferred: Summary C", "Preferred: summary", "Preferred:\nboth", "Preferred: Summary A\nPreferred: summary b",
    "We preferred: A", "Preferred: A and B",
])
def test_parser_still_rejects_what_matches_no_form(reply):
    assert judge.parse_verdict(reply) is None


def test_score_parser():
    reply = "Assistant A is good.\nScores:\nAssistant A: 8.5\n**Assistant B**: 3\nAssistant C: 10/10"
    assert judge.parse_scores(reply, ["A", "B", "C"]) == {"A": 8.5, "B": 3.0, "C": 10.0}
    assert judge.parse_scores(reply, ["A", "B", "C", "D"]) is None  # one missing
    assert judge.parse_scores("Assistant A: 11\nAssistant B: 5", ["A", "B"]) is None  # out of range
    assert judge.parse_scores("Assistant A: 0.5\nAssistant B: 5", ["A", "B"]) is None


def test_wilson_interval_and_rank_normalisation_by_hand():
    z = 1.959963984540054
    p = 0.8  # n = 10; center (p + z^2/2n)/(1 + z^2/n), half z sqrt(p(1-p)/n + z^2/4n^2)/(1 + z^2/n)
    center = (p + z * z / 20) / (1 + z * z / 10)
    half = z * np.sqrt(0.016 + z * z / 400) / (1 + z * z / 10)
    low, high = judge.wilson_interval(8, 10)
    assert abs(low - (center - half)) < 1e-12 and abs(high - (center + half)) < 1e-12
    assert abs(low - 0.4902) < 1e-3 and abs(high - 0.9433) < 1e-3
    assert judge.wilson_interval(0, 5)[0] == 0.0 and judge.wilson_interval(7, 7)[1] == 1.0  # exact at the edges
    assert all(x != x for x in judge.wilson_interval(0, 0))
    # a tie counts half a success (7 wins and a tie of 12): the same formula at p = 7.5 / 12
    p, n = 7.5 / 12, 12
    center, half = (p + z * z / 24) / (1 + z * z / n), z * np.sqrt(p * (1 - p) / n + z * z / 576) / (1 + z * z / n)
    assert judge.wilson_interval(7.5, 12) == pytest.approx((center - half, center + half), abs=1e-12)
    assert judge.rank_normalised([9.0, 7.0, 7.0, 3.0]) == [4.0, 2.5, 2.5, 1.0]
    assert judge.rank_normalised([1.0, 2.0, 3.0, 4.0, 5.0]) == [1.0, 2.0, 3.0, 4.0, 5.0]  # "6 - rank"


def test_order_randomisation_balanced_and_reproducible():
    texts = [(f"post {i}", f"ours {i}", f"ref {i}") for i in range(2000)]
    orders = [judge.pair_order(1, *t) for t in texts]
    assert orders == [judge.pair_order(1, *t) for t in texts]
    # balanced: 2000 fair bits fall within 4.5 standard deviations (~0.1 each side) of 1000
    assert 900 < sum(orders) < 1100
    other_seed = [judge.pair_order(2, *t) for t in texts]
    assert 900 < sum(a != b for a, b in zip(orders, other_seed)) < 1100  # a new seed is a new draw
    # consecutive pairs are not correlated (not an alternating or constant pattern)
    assert 900 < sum(a == b for a, b in zip(orders[:-1], orders[1:])) < 1100


def test_api_key_resolution(monkeypatch):
    assert judge_client.resolve_api_key("http://127.0.0.1:1/v1") == judge_client.LOOPBACK_PLACEHOLDER_KEY
    assert judge_client.resolve_api_key("http://localhost:1/v1") == judge_client.LOOPBACK_PLACEHOLDER_KEY
    with pytest.raises(SystemExit, match="OPENAI_API_KEY"):
        judge_client.resolve_api_key("https://api.example.com/v1")
    with pytest.raises(SystemExit):
        judge_client.resolve_api_key(None)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    assert judge_client.resolve_api_key("https://api.example.com/v1") == "sk-from-env"
    assert judge_client.public_url("http://user:pw@127.0.0.1:8/v1") == "http://127.0.0.1:8/v1"


def test_an_outcome_has_five_fields_made_by_position_and_no_error_by_default():
    """judge_client.Outcome, which the client and judge.py (its ties) make by position: status, parsed, reply, asks
    and error, "" unless a request failed for good."""
    tie = judge_client.Outcome("tie", None, "", 0)
    assert (tie.status, tie.parsed, tie.reply, tie.asks, tie.error) == ("tie", None, "", 0, "")
    failed = judge_client.Outcome("api_error", None, "", 2, "BadRequestError: too long")
    assert (failed.asks, failed.error) == (2, "BadRequestError: too long")
    assert [f.name for f in dataclasses.fields(judge_client.Outcome)] == ["status", "parsed", "reply", "asks", "error"]


def test_length_bins_by_hand():
    d = pd.DataFrame({"log_length_ratio": [-1.0, -0.9, 0.0, 0.1, 1.0, 0.5],
                      "winner": ["baseline", "ours", "ours", "ours", "ours", "invalid"]})
    bins = judge.length_bins({"m": d}, 2)  # edges -1, 0, 1 over the valid rows
    assert list(bins["n"]) == [2, 3]
    assert list(bins["win_rate"]) == [0.5, 1.0]


# ----------------------------------------------------------------------------------------------
# end to end through the real openai client
# ----------------------------------------------------------------------------------------------
def test_end_to_end_win_rates_equal_gold_verdicts(tmp_path):
    df_a = make_samples(tmp_path / "a.csv", 60, seed=0)
    df_b = make_samples(tmp_path / "b.csv", 30, seed=1, policies=["good", "filler", "drop"])
    identical = sum(int((df["response"].str.strip() == df["reference"].str.strip()).sum()) for df in (df_a, df_b))
    assert identical > 0  # the "ref" policy writes the reference itself now and then
    with gjs.serve_in_thread() as server:
        summary = judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv"), str(tmp_path / "b.csv")],
                                        max_parallel_requests=8))
        assert server.request_count == 90 - identical  # identical pairs are ties, never sent
    for label, df in [("a", df_a), ("b", df_b)]:
        judged = pd.read_csv(tmp_path / "out" / f"{label}_judged.csv", keep_default_na=False)
        differ = ~judged["identical"].astype(bool)
        expected = [w if k else "tie" for w, k in zip(gold_winners(judged), differ)]
        assert list(judged["winner"]) == expected
        # where the two texts differ, that is the order-free gold verdict
        assert differ.sum() >= len(df) // 2
        order_free = ["ours" if w else "baseline" for w in gold_wins(df)]
        assert [w for w, k in zip(expected, differ) if k] == [w for w, k in zip(order_free, differ) if k]
        s = summary["per_csv"][label]
        wins, ties = expected.count("ours"), expected.count("tie")
        assert (s["wins"], s["losses"], s["ties"], s["invalid"], s["n"]) == (wins, len(df) - wins - ties, ties, 0,
                                                                             len(df))
        assert s["n_identical"] == ties == int((~differ).sum())
        assert s["win_rate"] == (wins + 0.5 * ties) / len(df)  # a tie is half a win
        assert s["ci_low"] < s["win_rate"] < s["ci_high"]
        # the paper's output columns: explanation, preference, shuffled order
        assert judged.loc[differ, "explanation"].str.startswith("Summary ").all()
        assert (judged.loc[~differ, "status"] == "tie").all() and (judged.loc[~differ, "asks"] == 0).all()
        assert set(judged["preferred"]) <= {"A", "B", ""}
        # the judge saw ours as A exactly when shuffled_index == 0
        ours_is_a = judged["summary_a"] == judged["response"].str.strip()
        assert (ours_is_a == (judged["shuffled_index"] == 0))[differ].all()
        assert 0.25 < judged["shuffled_index"].mean() < 0.75
    on_disk = json.load(open(tmp_path / "out" / "judge_summary.json"))
    assert on_disk["per_csv"]["a"]["win_rate"] == summary["per_csv"]["a"]["win_rate"]
    for f in ["comparison.md", "win_rates.png", "length_controlled_win_rate.png", "length_bins.csv", "args.json"]:
        assert (tmp_path / "out" / f).exists(), f
    table = open(tmp_path / "out" / "comparison.md").read()
    assert "| a |" in table and "| b |" in table


def test_model_vs_model_with_baseline_csv(tmp_path):
    df = make_samples(tmp_path / "ours.csv", 30, seed=4, policies=["good"])
    base = make_samples(tmp_path / "base.csv", 30, seed=4, policies=["runon", "drop", "invent"])
    assert list(df["query"]) == list(base["query"])
    with gjs.serve_in_thread() as server:
        summary = judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "ours.csv")],
                                        baseline_csv=str(tmp_path / "base.csv")))
    expected = [gold_prefer(q.strip(), r.strip(), b.strip()) == "A"
                for q, r, b in zip(df["query"], df["response"], base["response"])]
    assert summary["per_csv"]["ours"]["wins"] == sum(expected) == 30
    judged = pd.read_csv(tmp_path / "out" / "ours_judged.csv", keep_default_na=False)
    assert list(judged["baseline"]) == list(base["response"])
    assert summary["per_csv"]["ours"]["baseline"] == str(tmp_path / "base.csv")


def test_order_in_judged_csv_reproducible_across_runs(tmp_path):
    make_samples(tmp_path / "a.csv", 30, seed=5)
    with gjs.serve_in_thread() as server:
        judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")], output_dir=str(tmp_path / "r1")))
        judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")], output_dir=str(tmp_path / "r2"),
                              cache_path=str(tmp_path / "other_cache.sqlite")))
        judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")], output_dir=str(tmp_path / "r3"), seed=2,
                              cache_path=str(tmp_path / "third_cache.sqlite")))
    r1, r2, r3 = (pd.read_csv(tmp_path / r / "a_judged.csv") for r in ["r1", "r2", "r3"])
    assert list(r1["shuffled_index"]) == list(r2["shuffled_index"])
    assert list(r1["shuffled_index"]) != list(r3["shuffled_index"])
    differ = ~r1["identical"].astype(bool)  # identical texts are a tie that the position breaks
    assert differ.sum() > 15
    assert list(r1["winner"][differ]) == list(r3["winner"][differ])  # the gold judge has no position bias


def test_fault_injection_retries_and_counts_invalid(tmp_path):
    make_samples(tmp_path / "a.csv", 60, seed=6, ties=False)
    with gjs.serve_in_thread(fail_rate=0.3, garbage_rate=0.25, seed=11) as server:
        summary = judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")], max_tries=10,
                                        max_parse_tries=2))
        stats = server.stats()
    s = summary["per_csv"]["a"]
    judged = pd.read_csv(tmp_path / "out" / "a_judged.csv", keep_default_na=False)
    assert len(judged) == 60 and s["n"] == 60  # nothing lost
    assert stats["status_429"] > 0 and stats["status_500"] > 0 and stats["garbage"] > 0
    assert summary["stats"]["retries"] == stats["status_429"] + stats["status_500"]  # every failure was retried
    assert summary["stats"]["requests"] == stats["requests"]
    assert summary["stats"]["reasks"] > 0
    # with 2 asks and a 25% garbage rate some pairs stay unparseable: counted invalid, not lost
    assert s["unparseable"] > 0 and s["api_errors"] == 0
    assert s["invalid"] == s["unparseable"] == int((judged["winner"] == "invalid").sum())
    assert s["wins"] + s["losses"] + s["invalid"] == 60
    ok = judged["status"] == "ok"
    # every valid verdict is still the gold one, and invalid pairs are neither wins nor losses
    assert (judged.loc[ok, "winner"] == [w for w, k in zip(gold_winners(judged), ok) if k]).all()
    assert s["win_rate"] == s["wins"] / (s["wins"] + s["losses"])
    assert (judged.loc[~ok, "asks"] == 2).all()


def answer_then_fail(server, answered: int) -> None:
    """The server answers its first `answered` requests and fails every later one with a 500."""
    draw = server.draw_fault
    server.draw_fault = lambda: "ok" if draw() == "ok" and server.request_count <= answered else "500"


def test_hard_failures_are_invalid_never_losses(tmp_path):
    make_samples(tmp_path / "a.csv", 12, seed=7, ties=False)
    with gjs.serve_in_thread() as server:
        answer_then_fail(server, 4)  # one request at a time: rows 0-3 judged, then the judge breaks down
        summary = judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")], max_tries=3,
                                        max_parallel_requests=1))
        assert server.request_count == 4 + 8 * 3  # bounded: exactly max_tries per failing pair
    s = summary["per_csv"]["a"]
    assert (s["wins"] + s["losses"], s["invalid"], s["api_errors"]) == (4, 8, 8)
    judged = pd.read_csv(tmp_path / "out" / "a_judged.csv", keep_default_na=False)
    assert list(judged["status"]) == ["ok"] * 4 + ["api_error"] * 8
    assert judged["error"][4:].str.contains("gave up after 3 tries; last error InternalServerError").all()
    with gjs.serve_in_thread(garbage_rate=1.0, seed=1) as server:
        summary = judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")], max_parse_tries=3,
                                        cache_path=str(tmp_path / "c2.sqlite")))
        assert server.request_count == 12 * 3  # bounded re-asks
    s = summary["per_csv"]["a"]
    assert (s["wins"], s["losses"], s["unparseable"], s["win_rate"]) == (0, 0, 12, None)


# ----------------------------------------------------------------------------------------------
# a judge that cannot be used at all, and sample files with nothing to judge: one error, no table
# ----------------------------------------------------------------------------------------------
def closed_port() -> int:
    """A loopback port nobody listens on (connection refused)."""
    import socket

    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_endpoint_is_one_error_and_a_failed_exit(tmp_path):
    make_samples(tmp_path / "a.csv", 40, seed=16)
    url = f"http://127.0.0.1:{closed_port()}/v1"
    cmd = [sys.executable, os.path.join(REPO, "judge.py"), "--csv", str(tmp_path / "a.csv"), "--base_url", url,
           "--output_dir", str(tmp_path / "out"), "--cache_path", str(tmp_path / "cache.sqlite"),
           "--length_unit", "chars", "--max_tries", "2", "--backoff_base_s", "0.001", "--backoff_max_s", "0.01"]
    env = {**{k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"judge.py: error: the judge at {url} cannot be reached (gave up after 2 tries; last error "
        "APIConnectionError: Connection error.); check that the server is running and that --base_url points at it")
    assert not (tmp_path / "out" / "judge_summary.json").exists() and not (tmp_path / "out" / "a_judged.csv").exists()


@contextlib.contextmanager
def fault_server(fault: str, answered: int = 0):
    """A loopback chat endpoint that answers its first `answered` requests as the gold judge does and every later one
    with `fault`: "trickle" (a 200, then one byte of the body every 0.5 s), "headers" (a 200 and its headers, then
    nothing), "silent" (nothing at all), "half" (half the body, then the connection closed), "html" (a 200 whose body
    is not JSON) or "json" (JSON that is no chat completion). A handler gives up after 20 s at most, or when the client
    has hung up, so its thread ends by itself; the server stops with the block."""
    import socket
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    stop, count = threading.Event(), [0]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def send(self, body: bytes, length=None):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body) if length is None else length))
            self.send_header("Connection", "close")  # one request per connection: no reuse of a closed one
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            count[0] += 1
            kind = "ok" if count[0] <= answered else fault
            content = gjs.pairwise_reply(*gjs.parse_pairwise_prompt(request["messages"][-1]["content"]))
            completion = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": request["model"],
                                     "choices": [{"index": 0, "finish_reason": "stop",
                                                  "message": {"role": "assistant", "content": content}}]}).encode()
            self.close_connection = True
            try:
                if kind in ("ok", "html", "json"):
                    self.send({"ok": completion, "html": b"<html><body>502 Bad Gateway</body></html>",
                               "json": b'{"error": null, "choices": null}'}[kind])
                elif kind == "half":
                    self.send(completion[: len(completion) // 2], len(completion))
                    self.connection.shutdown(socket.SHUT_RDWR)
                elif kind in ("headers", "trickle"):
                    self.send(b"", len(completion))
                    for i in range(40):  # 20 s at most
                        if stop.wait(0.5):
                            break
                        if kind == "trickle":
                            self.wfile.write(completion[i : i + 1])
                            self.wfile.flush()
                else:  # silent
                    stop.wait(20)
            except OSError:  # the client hung up (its deadline)
                pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    server.base_url, server.model_name, server.requests = f"http://127.0.0.1:{server.server_address[1]}/v1", "m", count
    try:
        yield server
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_a_judge_that_answers_and_then_trickles_stops_within_its_deadlines(tmp_path):
    """issue 40: a 200, then one byte every 0.5 s. --timeout_s bounds the whole request, not each read, so judge.py
    gives up after --max_tries deadlines and stops with one line saying the server stalled (it hung until killed)."""
    make_samples(tmp_path / "a.csv", 8, seed=21, ties=False)
    with fault_server("trickle") as server:
        cmd = [sys.executable, os.path.join(REPO, "judge.py"), "--csv", str(tmp_path / "a.csv"), "--base_url",
               server.base_url, "--model", "m", "--output_dir", str(tmp_path / "out"), "--cache_path",
               str(tmp_path / "cache.sqlite"), "--length_unit", "chars", "--timeout_s", "3", "--max_tries", "2",
               "--backoff_base_s", "0.01", "--backoff_max_s", "0.02"]
        env = {**{k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}, "OMP_NUM_THREADS": "1"}
        started = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        took = time.time() - started
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"judge.py: error: the judge at {server.base_url} answered and stalled (gave up after 2 tries; last error no "
        "complete reply within --timeout_s 3.0 s); check the server's load, or raise --timeout_s")
    stalled = 2 * 3  # two tries of 3 s; the rest is Python starting
    assert took < stalled + 60, f"{took:.0f} s"
    assert not (tmp_path / "out" / "judge_summary.json").exists()


@pytest.mark.parametrize("fault, what, error", [
    ("headers", "answered and stalled", "no complete reply within --timeout_s 1.0 s"),
    ("silent", "did not answer", "no complete reply within --timeout_s 1.0 s"),
    ("half", "answered, but the body was cut", "RemoteProtocolError: peer closed connection without sending complete "
                                                "message body"),
    ("html", "answers no chat completion", "200 with the body '<html><body>502 Bad Gateway</body></html>'"),
    ("json", "answers no chat completion", "200 with the body '{\"error\": null, \"choices\": null}'"),
])
def test_a_judge_that_stalls_cuts_its_body_or_answers_no_chat_completion_is_one_error_saying_so(tmp_path, fault, what,
                                                                                                 error):
    make_samples(tmp_path / "a.csv", 6, seed=22, ties=False)
    started = time.time()
    with fault_server(fault) as server:
        with pytest.raises(judge_client.JudgeUnavailableError) as err:
            judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")], timeout_s=1.0, max_tries=2,
                                  max_parallel_requests=2))
        assert server.requests[0] <= 2 * 2 + 2  # bounded: the tries of the pairs in flight
    message = str(err.value)
    assert message.startswith(f"the judge at {server.base_url} {what} (gave up after 2 tries; last error {error}")
    assert "cannot be reached" not in message
    assert time.time() - started < 30


@pytest.mark.parametrize("fault", ["trickle", "html"])
@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_a_judge_that_breaks_down_after_answering_marks_the_rest_invalid(tmp_path, fault):
    make_samples(tmp_path / "a.csv", 6, seed=23, ties=False)
    with fault_server(fault, answered=2) as server:  # one request at a time: rows 0 and 1 judged, then the fault
        summary = judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")], timeout_s=1.0,
                                        max_tries=2, max_parallel_requests=1))
        assert server.requests[0] == 2 + 4 * 2  # bounded: max_tries per broken pair
    s = summary["per_csv"]["a"]
    assert (s["wins"] + s["losses"], s["invalid"], s["api_errors"]) == (2, 4, 4)
    judged = pd.read_csv(tmp_path / "out" / "a_judged.csv", keep_default_na=False)
    reason = "no complete reply within --timeout_s 1.0 s" if fault == "trickle" else "200 with the body '<html>"
    assert judged["error"][2:].str.contains(reason, regex=False).all()


def test_failing_endpoint_stops_after_one_pair_of_tries(tmp_path):
    make_samples(tmp_path / "a.csv", 40, seed=17)
    with gjs.serve_in_thread(fail_rate=1.0, seed=1) as server:
        server.handle_error = lambda request, client_address: None  # replies to a client that has gone: no traceback
        draw = server.draw_fault  # every request a 500: a 429 is no fault but a wait (tests/test_judge_ratelimit.py)
        server.draw_fault = lambda: draw() and "500"
        with pytest.raises(judge_client.JudgeUnavailableError,
                           match=r"failed before answering any request \(gave up after 3 tries") as err:
            judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")], max_tries=3,
                                  max_parallel_requests=2))
        # not 40 pairs x 3 tries: it stopped once the first pair had used its tries. Bound: the two pairs in flight,
        # 3 tries each, plus the first try of a pair that took a freed slot before the run was stopped
        assert server.request_count <= 2 * 3 + 2
    assert server.base_url in str(err.value) and "last error InternalServerError" in str(err.value)
    assert str(err.value).endswith("try again later, or raise --max_tries")
    assert not (tmp_path / "out" / "judge_summary.json").exists()


def test_unknown_model_is_one_error_without_retries(tmp_path):
    make_samples(tmp_path / "a.csv", 6, seed=14)
    with gjs.serve_in_thread() as server:
        with pytest.raises(judge_client.JudgeUnavailableError, match="NotFoundError") as err:
            judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")], model="gold-judge-stale"))
        assert server.request_count <= 6  # a 404 is final: no retries
    assert "'gold-judge-stale' (--model)" in str(err.value) and server.base_url in str(err.value)


def test_refused_key_or_every_prompt_refused_is_one_error(tmp_path, monkeypatch):
    secret = "sk-test-REFUSED456"
    monkeypatch.setenv("OPENAI_API_KEY", secret)
    make_samples(tmp_path / "a.csv", 40, seed=18, ties=False)
    status = {"code": 401}

    def refuse(handler):  # the server's POST handler, replaced: every request gets `status`
        handler.rfile.read(int(handler.headers.get("Content-Length", "0")))
        handler.server.draw_fault()  # counts the request
        handler._error(status["code"], f"refused; the key was {handler.headers.get('Authorization')}",
                       "invalid_request_error")

    monkeypatch.setattr(gjs._Handler, "do_POST", refuse)
    with gjs.serve_in_thread() as server:
        server.handle_error = lambda request, client_address: None  # replies to a client that has gone: no traceback
        with pytest.raises(judge_client.JudgeUnavailableError, match="refused the API key") as err:
            judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")], max_tries=3,
                                  max_parallel_requests=4))
        # at once, not 40 refusals: no retries; the 4 requests in flight, and at most one more per slot they freed
        assert server.request_count <= 2 * 4
        message = str(err.value)
        assert "AuthenticationError" in message and server.base_url in message and "OPENAI_API_KEY" in message
        assert secret not in message and "[REDACTED]" in message
        status["code"] = 400  # every prompt refused: each pair is invalid, and together they are one error
        with pytest.raises(judge_client.JudgeUnavailableError,
                           match="refused every request \\(all 40 failed; the first: BadRequestError"):
            judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")], max_tries=3))


def offline_args(tmp_path, csv: list, **kw) -> "judge.Args":
    """Arguments for runs that must fail on their input, before any request (no server is started)."""
    return judge.Args(csv=csv, output_dir=str(tmp_path / "out"), base_url="http://127.0.0.1:9/v1",
                      cache_path=str(tmp_path / "c.sqlite"), length_unit="chars", **kw)


def test_empty_sample_csv_is_one_error_naming_it(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(ValueError, match="^" + re.escape(f"{empty} is empty (no header, no rows)")):
        judge.main(offline_args(tmp_path, [str(empty)]))
    make_samples(tmp_path / "a.csv", 4, seed=19)
    with pytest.raises(ValueError, match="^" + re.escape(f"{empty} is empty")):  # a baseline must hold samples too
        judge.main(offline_args(tmp_path, [str(tmp_path / "a.csv")], baseline_csv=str(empty)))


def test_sample_csv_with_a_header_and_no_rows_is_nothing_to_judge(tmp_path):
    header_only = tmp_path / "header_only.csv"
    header_only.write_text("query,response,reference\n")
    with pytest.raises(ValueError, match="^" + re.escape(f"{header_only} has a header but no rows: nothing to judge")):
        judge.main(offline_args(tmp_path, [str(header_only)]))
    assert not (tmp_path / "out" / "judge_summary.json").exists()


def test_cache_rerun_makes_no_requests_and_resumes(tmp_path):
    df = make_samples(tmp_path / "a.csv", 50, seed=8, ties=False)
    with gjs.serve_in_thread() as server:
        # an "interrupted" run that got through the first 20 pairs
        judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")], num_samples=20,
                              output_dir=str(tmp_path / "r0")))
        assert server.request_count == 20
        first = judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")], output_dir=str(tmp_path / "r1")))
        assert server.request_count == 50  # resumed: only the 30 new pairs were paid for
        assert first["stats"]["cache_hits"] == 20
        second = judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")],
                                       output_dir=str(tmp_path / "r2")))
        assert server.request_count == 50  # rerun: zero requests
        assert second["stats"]["requests"] == 0 and second["stats"]["cache_hits"] == 50
    judged = pd.read_csv(tmp_path / "r2" / "a_judged.csv", keep_default_na=False)
    assert first["per_csv"]["a"]["wins"] == second["per_csv"]["a"]["wins"] == gold_winners(judged).count("ours")
    assert len(judged) == len(df)
    # a different model (e.g. a changed gold judge, whose id carries a new digest) is a different cache key
    with gjs.serve_in_thread(model_name="gold-judge-other") as server:
        third = judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")], output_dir=str(tmp_path / "r3")))
        assert server.request_count == 50 and third["stats"]["cache_hits"] == 0


def test_cache_replays_unparseable_sequences(tmp_path):
    make_samples(tmp_path / "a.csv", 30, seed=9)
    with gjs.serve_in_thread(garbage_rate=0.5, seed=2) as server:
        first = judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")], max_parse_tries=2,
                                      output_dir=str(tmp_path / "r1")))
        n = server.request_count
        second = judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")], max_parse_tries=2,
                                       output_dir=str(tmp_path / "r2")))
        assert server.request_count == n
    assert first["per_csv"]["a"] == {**second["per_csv"]["a"], "judged_csv": first["per_csv"]["a"]["judged_csv"]}
    assert first["per_csv"]["a"]["unparseable"] > 0


def cached_reply_count(path) -> int:
    """Rows of judge.py's sqlite reply cache, read through a separate read-only connection (so the
    reader never checkpoints or repairs the writer's WAL); 0 before the file or its table exists."""
    if not os.path.exists(path):
        return 0
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as db:
            return db.execute("SELECT COUNT(*) FROM replies").fetchone()[0]
    except sqlite3.OperationalError:  # the table is still being created
        return 0


class RequestGate:
    """Lets the first `limit` chat requests through to the gold judge and holds every later one
    before the server counts or answers it, until release(); the held ones are then dropped
    unanswered (the client that sent them is dead by then) and new requests pass again.

    Why: a process killed at an arbitrary instant may have replies already paid for but not yet
    written to the cache; those are lost and asked again, whatever the client does. Holding the
    requests lets the test kill the judge while it is waiting on requests (really mid-run) with
    every answered request already committed, so "answered requests == distinct prompts" is an
    exact statement about judge.py and not a race. It wraps the server instance's own hook; the
    server's code is unchanged."""

    def __init__(self, server, limit: int):
        self.limit, self.admitted, self.held = limit, 0, 0
        self.lock, self.opened = threading.Lock(), threading.Event()
        self._draw_fault = server.draw_fault
        server.draw_fault = self._draw  # called by the handler before it counts or answers a request
        server.handle_error = lambda request, client_address: None  # a dropped request is not a traceback

    def _draw(self) -> str:
        with self.lock:
            admit = self.opened.is_set() or self.admitted < self.limit
            self.admitted += admit
            self.held += not admit
        if admit:
            return self._draw_fault()
        self.opened.wait()
        raise ConnectionAbortedError("held request dropped unanswered")

    def release(self) -> None:
        self.opened.set()


@pytest.mark.slow  # judge_client's cache, which a fork of a training script does not change: full suite only
def test_sigkill_mid_run_then_rerun_pays_for_nothing_twice(tmp_path):
    """judge.py killed by SIGKILL mid-run and run again with the same arguments and cache: the
    rerun's verdicts and win rate equal an uninterrupted run's, and no prompt was answered twice."""
    n, limit, parallel, seed = 96, 40, 4, 3
    csv_path = str(tmp_path / "a.csv")
    make_samples(csv_path, n, seed=15, ties=False)

    # the uninterrupted run: fresh cache, same seed and arguments
    with gjs.serve_in_thread() as server:
        reference = judge.main(judge_args(tmp_path, server, csv=[csv_path], seed=seed, max_parallel_requests=parallel,
                                          output_dir=str(tmp_path / "reference"),
                                          cache_path=str(tmp_path / "ref_cache.sqlite")))
        reference_requests = server.request_count
    ref_judged = pd.read_csv(tmp_path / "reference" / "a_judged.csv", keep_default_na=False)
    distinct_prompts = {judge.pairwise_prompt(q.strip(), a, b)
                        for q, a, b in zip(ref_judged["query"], ref_judged["summary_a"], ref_judged["summary_b"])}
    assert reference_requests == reference["stats"]["requests"] == len(distinct_prompts) == n
    assert reference["per_csv"]["a"]["invalid"] == 0 and list(ref_judged["winner"]) == gold_winners(ref_judged)

    cache_path, out_dir = tmp_path / "cache.sqlite", tmp_path / "out"
    cmd = [sys.executable, os.path.join(REPO, "judge.py"), "--csv", csv_path, "--seed", str(seed),
           "--output_dir", str(out_dir), "--cache_path", str(cache_path), "--length_unit", "chars",
           "--max_parallel_requests", str(parallel), "--backoff_base_s", "0.001", "--backoff_max_s", "0.01",
           "--timeout_s", "60"]  # no client timeout (and retry) while requests are held
    env = {**{k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}, "OMP_NUM_THREADS": "1"}
    # latency: a full run would take n / parallel * 0.1 s = 2.4 s of judging after ~5 s of imports
    with gjs.serve_in_thread(latency_s=0.1) as server:
        cmd += ["--base_url", server.base_url, "--model", server.model_name]
        gate = RequestGate(server, limit)
        with open(tmp_path / "killed.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                # kill once `limit` verdicts are in the cache and the judge waits on `parallel` more
                deadline = time.time() + 60
                while not (cached_reply_count(cache_path) == limit and gate.held == parallel):
                    assert proc.poll() is None, (
                        f"judge.py ended before the kill:\n{open(tmp_path / 'killed.log').read()[-3000:]}")
                    assert time.time() < deadline, (f"no kill point: {cached_reply_count(cache_path)} cached, "
                                                    f"{server.request_count} answered, {gate.held} held")
                    time.sleep(0.05)
                os.kill(proc.pid, signal.SIGKILL)
                returncode = proc.wait(timeout=30)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        cached_at_kill, answered_by_killed_run, in_flight_at_kill = (cached_reply_count(cache_path),
                                                                     server.request_count, gate.held)
        gate.release()  # the held requests are dropped unanswered; the rerun's pass straight through
        # (a) it really was killed mid-way: before the summary, with some but not all verdicts cached
        assert returncode == -signal.SIGKILL
        assert 0 < cached_at_kill == answered_by_killed_run == limit < n
        assert in_flight_at_kill == parallel  # it died waiting on requests, not idle
        assert not (out_dir / "judge_summary.json").exists() and not (out_dir / "a_judged.csv").exists()

        rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        total_answered = server.request_count
    summary = json.load(open(out_dir / "judge_summary.json"))
    judged = pd.read_csv(out_dir / "a_judged.csv", keep_default_na=False)
    # (b) the same verdicts, row by row, and the same win rate as the uninterrupted run
    pd.testing.assert_frame_equal(judged, ref_judged)
    drop_path = lambda s: {k: v for k, v in s.items() if k != "judged_csv"}  # noqa: E731
    assert drop_path(summary["per_csv"]["a"]) == drop_path(reference["per_csv"]["a"])
    assert summary["per_csv"]["a"]["win_rate"] == reference["per_csv"]["a"]["win_rate"]
    # (c) nothing asked twice: the rerun asked only what the killed run had not cached, and the
    # server answered exactly one request per distinct prompt over both runs, as the uninterrupted run
    assert summary["stats"]["cache_hits"] == cached_at_kill
    assert summary["stats"]["requests"] == total_answered - answered_by_killed_run == n - cached_at_kill
    assert total_answered == len(distinct_prompts) == reference_requests
    assert cached_reply_count(cache_path) == n
    print(f"killed at {cached_at_kill}/{n} cached ({in_flight_at_kill} in flight); answered: killed run "
          f"{answered_by_killed_run} + rerun {total_answered - answered_by_killed_run} = {total_answered} "
          f"(uninterrupted {reference_requests}); win rate {summary['per_csv']['a']['win_rate']:.4f} "
          f"(uninterrupted {reference['per_csv']['a']['win_rate']:.4f})")


def test_api_key_never_in_outputs(tmp_path, monkeypatch, capfd):
    secret = "sk-test-SECRET123"
    monkeypatch.setenv("OPENAI_API_KEY", secret)
    make_samples(tmp_path / "a.csv", 20, seed=10)
    make_samples(tmp_path / "b.csv", 20, seed=10, policies=["drop", "good"])
    with gjs.serve_in_thread(fail_rate=0.3, garbage_rate=0.2, seed=4) as server:
        j = judge_client.Judge(judge_args(tmp_path, server), judge_client.ReplyCache(str(tmp_path / "probe.sqlite")))
        assert j.client.api_key == secret  # the key from the environment is the one used
        judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")], max_tries=2))
        judge.main(judge_args(tmp_path, server, mode="multi", csv=[str(tmp_path / "a.csv"), str(tmp_path / "b.csv")],
                              output_dir=str(tmp_path / "multi")))
    out, err = capfd.readouterr()
    assert secret not in out and secret not in err
    files = [os.path.join(root, f) for root, _, fs in os.walk(tmp_path) for f in fs]
    assert len(files) > 10
    for path in files:
        if os.path.basename(path) in ("a.csv", "b.csv"):
            continue
        with open(path, "rb") as f:
            assert b"SECRET123" not in f.read(), path


# ----------------------------------------------------------------------------------------------
# issue 33: what the judge reads (EOS spellings, ties), the cache key, unfinished runs
# ----------------------------------------------------------------------------------------------
def test_an_eos_spelling_at_the_end_is_stripped_and_identical_pairs_are_ties_never_asked(tmp_path):
    df = make_samples(tmp_path / "a.csv", 12, seed=21, ties=False)
    eos = "<|endoftext|>"
    # the hub's references end with the EOS spelling as text; rows 0-3 are the reference itself (+ EOS text)
    df["reference"] = df["reference"] + eos
    df.loc[:3, "response"] = df.loc[:3, "reference"].str.replace(eos, "", regex=False) + "  " + eos + eos
    df.to_csv(tmp_path / "a.csv", index=False)
    assert judge.without_eos_text(" a summary.<|endoftext|> <|endoftext|>\n", eos) == "a summary."
    assert judge.without_eos_text(" a <|endoftext|> inside.", eos) == "a <|endoftext|> inside."
    with gjs.serve_in_thread() as server:
        summary = judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")]))
        assert server.request_count == 8  # the 4 ties were never sent
    judged = pd.read_csv(tmp_path / "out" / "a_judged.csv", keep_default_na=False)
    assert not judged["summary_a"].str.contains(eos, regex=False).any()
    assert not judged["summary_b"].str.contains(eos, regex=False).any()
    assert list(judged["winner"][:4]) == ["tie"] * 4 and "tie" not in list(judged["winner"][4:])
    s = summary["per_csv"]["a"]
    assert (s["ties"], s["wins"] + s["losses"], s["n_identical"]) == (4, 8, 4)
    assert s["win_rate"] == (s["wins"] + 2) / 12
    low, high = judge.wilson_interval(s["wins"] + 2, 12)
    assert (s["ci_low"], s["ci_high"]) == (low, high)
    assert "| ties |" in open(tmp_path / "out" / "comparison.md").read()


def test_every_pair_a_tie_asks_nothing_and_wins_half(tmp_path):
    df = make_samples(tmp_path / "a.csv", 6, seed=22, ties=False)
    df["response"] = df["reference"]
    df.to_csv(tmp_path / "a.csv", index=False)
    with gjs.serve_in_thread() as server:
        summary = judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")]))
        assert server.request_count == 0
    s = summary["per_csv"]["a"]
    assert (s["win_rate"], s["ties"], s["invalid"]) == (0.5, 6, 0)


def test_multi_mode_query_with_identical_answers_is_a_tie_never_asked(tmp_path):
    a = make_samples(tmp_path / "a.csv", 10, seed=23, policies=["good"])
    b = make_samples(tmp_path / "b.csv", 10, seed=23, policies=["drop"])
    b.loc[:3, "response"] = a.loc[:3, "response"] + "<|endoftext|>"  # rows 0-3: the same answer from both
    b.to_csv(tmp_path / "b.csv", index=False)
    with gjs.serve_in_thread() as server:
        summary = judge.main(judge_args(tmp_path, server, mode="multi",
                                        csv=[str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]))
        assert server.request_count == 6
    table = pd.read_csv(tmp_path / "out" / "multi_scores.csv")
    assert list(table["status"][:4]) == ["tie"] * 4 and (table["rank_score/a"][:4] == 1.5).all()
    m = summary["multi"]
    assert m["a"]["n"] == 6 and m["a"]["ties"] == 4 and summary["multi_invalid"] == 0
    assert m["a"]["mean_rank_score"] == pytest.approx((4 * 1.5 + table["rank_score/a"][4:].sum()) / 10)


@pytest.mark.slow  # over 5 s in the quick check (Intel Xeon with AVX-512, 2 cores, -n 2)
def test_cache_key_holds_the_endpoint_and_the_seed_of_a_sampling_judge(tmp_path):
    key = judge_client.ReplyCache.key
    args = ("gold", "http://127.0.0.1:8011/v1/", "sys", "prompt")
    assert key(*args, None, 1, 0) != key("gold", "http://127.0.0.1:8012/v1/", "sys", "prompt", None, 1, 0)
    assert key(*args, 0.7, 1, 0) != key(*args, 0.7, 2, 0) and key(*args, None, 1, 0) != key(*args, None, 2, 0)
    assert key(*args, 0.0, 1, 0) == key(*args, 0.0, 2, 0)  # a greedy judge: the seed changes nothing
    make_samples(tmp_path / "a.csv", 20, seed=24, ties=False)
    csv = [str(tmp_path / "a.csv")]
    with gjs.serve_in_thread() as first, gjs.serve_in_thread() as second:  # one model name, two endpoints
        judge.main(judge_args(tmp_path, first, csv=csv, output_dir=str(tmp_path / "r1")))
        other = judge.main(judge_args(tmp_path, second, csv=csv, output_dir=str(tmp_path / "r2")))
        assert first.model_name == second.model_name and second.request_count == 20
        assert other["stats"]["cache_hits"] == 0
        again = judge.main(judge_args(tmp_path, second, csv=csv, output_dir=str(tmp_path / "r3")))
        assert again["stats"]["requests"] == 0  # the same endpoint replays its own replies
        # a sampling judge asked again with another seed asks afresh; a greedy one reuses the prompts it has seen
        judge.main(judge_args(tmp_path, first, csv=csv, temperature=0.7, seed=1, output_dir=str(tmp_path / "t1")))
        sampled = judge.main(judge_args(tmp_path, first, csv=csv, temperature=0.7, seed=2,
                                        output_dir=str(tmp_path / "t2")))
        assert sampled["stats"]["cache_hits"] == 0
        judge.main(judge_args(tmp_path, first, csv=csv, temperature=0.0, seed=1, output_dir=str(tmp_path / "g1")))
        greedy = judge.main(judge_args(tmp_path, first, csv=csv, temperature=0.0, seed=2,
                                       output_dir=str(tmp_path / "g2")))
    same_order = (pd.read_csv(tmp_path / "g1" / "a_judged.csv")["shuffled_index"]
                  == pd.read_csv(tmp_path / "g2" / "a_judged.csv")["shuffled_index"]).sum()
    assert 0 < greedy["stats"]["cache_hits"] == same_order < 20


def fake_training_run(root, name: str, complete: bool) -> tuple:
    """A training run's folders as the scripts leave them: runs/<name>/ (args.json naming --output_dir,
    samples.csv) and the output folder, whose run.json holds "complete": true only once the run has finished."""
    run_dir, out_dir = root / "runs" / name, root / "models" / name
    run_dir.mkdir(parents=True)
    out_dir.mkdir(parents=True)
    (run_dir / "args.json").write_text(json.dumps({"exp_name": name, "run_name": name, "output_dir": str(out_dir)}))
    (out_dir / "run.json").write_text(json.dumps({"run_name": name, **({"complete": True} if complete else {})}))
    make_samples(run_dir / "samples.csv", 8, seed=25, ties=False)
    return run_dir, out_dir


def test_samples_or_reward_model_of_an_unfinished_run_are_refused(tmp_path):
    run_dir, out_dir = fake_training_run(tmp_path, "ppo", complete=False)
    with gjs.serve_in_thread() as server:
        with pytest.raises(ValueError, match=re.escape(
                f"{run_dir / 'samples.csv'} comes from an unfinished run: {out_dir} is incomplete: its run.json lacks "
                "\"complete\": true")) as err:
            judge.main(judge_args(tmp_path, server, csv=[str(run_dir / "samples.csv")]))
        assert "Rerun ppo.py to its end" in str(err.value) and server.request_count == 0
        assert not (tmp_path / "out").exists()
        # samples taken along training (runs/<name>/samples/step_N.csv) name the same run
        (run_dir / "samples").mkdir()
        (run_dir / "samples" / "step_000008.csv").write_text((run_dir / "samples.csv").read_text())
        with pytest.raises(ValueError, match="comes from an unfinished run"):
            judge.main(judge_args(tmp_path, server, csv=[str(run_dir / "samples" / "step_000008.csv")]))
        judge.main(judge_args(tmp_path, server, csv=[str(run_dir / "samples.csv")], check_complete=False))
        (out_dir / "run.json").write_text(json.dumps({"run_name": "ppo", "complete": True}))
        summary = judge.main(judge_args(tmp_path, server, csv=[str(run_dir / "samples.csv")]))
        assert summary["per_csv"]["ppo"]["n"] == 8
    rm_dir = tmp_path / "models" / "rm"
    rm_dir.mkdir()
    (rm_dir / "run.json").write_text(json.dumps({"run_name": "rm"}))
    with pytest.raises(ValueError, match=re.escape(f"--reward_model_path: {rm_dir} is incomplete")):
        judge.main(offline_args(tmp_path, [], mode="agreement", reward_model_path=str(rm_dir)))


# ----------------------------------------------------------------------------------------------
# multi-answer mode (offline-RLHF seed)
# ----------------------------------------------------------------------------------------------
def test_multi_answer_mode(tmp_path):
    good = make_samples(tmp_path / "good.csv", 30, seed=12, policies=["good"])
    make_samples(tmp_path / "drop.csv", 30, seed=12, policies=["drop"])
    runon = make_samples(tmp_path / "runon.csv", 30, seed=12, policies=["runon"])
    with gjs.serve_in_thread() as server:
        summary = judge.main(judge_args(tmp_path, server, mode="multi",
                                        csv=[str(tmp_path / f"{k}.csv") for k in ["good", "drop", "runon"]]))
        assert server.request_count == 30
    m = summary["multi"]
    assert summary["multi_invalid"] == 0 and m["good"]["n"] == 30
    # mean scores are the gold scores mapped to 1-10, whatever order the answers were shown in
    exp_good = np.mean([gjs.gold_score_1_to_10(q.strip(), r.strip()) for q, r in zip(good["query"], good["response"])])
    exp_runon = np.mean([gjs.gold_score_1_to_10(q.strip(), r.strip())
                         for q, r in zip(runon["query"], runon["response"])])
    assert m["good"]["mean_score"] == pytest.approx(exp_good) and m["runon"]["mean_score"] == pytest.approx(exp_runon)
    assert m["good"]["mean_rank_score"] > m["drop"]["mean_rank_score"] > m["runon"]["mean_rank_score"]
    assert sum(v["mean_rank_score"] for v in m.values()) == pytest.approx(6.0)  # 3 + 2 + 1 per query
    table = pd.read_csv(tmp_path / "out" / "multi_scores.csv")
    assert table["order"].nunique() > 1  # presentation order is shuffled


# ----------------------------------------------------------------------------------------------
# agreement mode (Detail 17) and the subprocess smoke run, on the built-in task
# ----------------------------------------------------------------------------------------------
def test_agreement_mode_matches_hand_computation(tmp_path, synthetic_task):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(synthetic_task["base_model"], num_labels=1)
    rm_path = str(tmp_path / "rm")
    rm.save_pretrained(rm_path)
    tokenizer = AutoTokenizer.from_pretrained(synthetic_task["base_model"])
    tokenizer.save_pretrained(rm_path)
    with gjs.serve_in_thread() as server:
        summary = judge.main(judge_args(tmp_path, server, mode="agreement", reward_model_path=rm_path,
                                        preference_dataset=synthetic_task["preference"], num_samples=16,
                                        local_micro_batch_size=5))
        asked = server.request_count
    pairs = pd.read_csv(tmp_path / "out" / "agreement_pairs.csv", keep_default_na=False)
    ds = checks.load_split(synthetic_task["preference"], "validation").select(range(16))
    # by hand: the gold verdict and the RM's scores, one pair at a time, unbatched. A score is the score head's
    # output at the row's last real token (its EOS: rows are query + response + EOS, right-padded), here through the
    # model's own forward on the row without its padding, so no mask, position or index of judge.py's is involved
    rm = AutoModelForSequenceClassification.from_pretrained(rm_path, num_labels=1).eval()

    def score_by_hand(tokens: list) -> float:
        real = tokens[: tokens.index(tokenizer.pad_token_id)] if tokenizer.pad_token_id in tokens else tokens
        assert tokenizer.pad_token_id not in real and real[-1] == tokenizer.eos_token_id
        with torch.no_grad():
            hidden = rm.base_model(input_ids=torch.tensor([real])).last_hidden_state  # (1, n, d), no padding
            return rm.score(hidden[0, -1]).item()

    agree, identical = 0, 0
    for i in range(16):
        rc, rr = score_by_hand(ds[i]["query_chosen_token"]), score_by_hand(ds[i]["query_rejected_token"])
        assert pairs["reward_chosen"][i] == pytest.approx(rc, abs=1e-4)
        assert pairs["reward_rejected"][i] == pytest.approx(rr, abs=1e-4)
        if ds[i]["chosen"].strip() == ds[i]["rejected"].strip():  # no preference to agree on
            identical += 1
            continue
        gold_chosen = gold_prefer(ds[i]["query"].strip(), ds[i]["chosen"].strip(), ds[i]["rejected"].strip()) == "A"
        assert str(pairs["judge_prefers_chosen"][i]) == str(gold_chosen)
        agree += int(gold_chosen == (rc > rr))
    a = summary["agreement"]
    assert a["n"] == 16 and a["invalid"] == 0 and a["n_identical"] == identical
    assert asked == 16 - identical  # identical pairs are ties, never sent to the judge
    assert a["n_valid"] == 16 - identical >= 8
    assert a["agreement_rate"] == agree / (16 - identical)


def test_a_reward_model_with_a_nan_weight_is_refused_before_any_request(tmp_path, synthetic_task):
    """issue 40: every model a script loads is checked finite at load, the judge's reward model too: a NaN in its
    score head is named (file and tensor) before a single request is paid for."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rm = AutoModelForSequenceClassification.from_pretrained(synthetic_task["base_model"], num_labels=1)
    with torch.no_grad():
        rm.score.weight[0, 3] = float("nan")
    rm_path = tmp_path / "nan_rm"
    rm.save_pretrained(rm_path)
    AutoTokenizer.from_pretrained(synthetic_task["base_model"]).save_pretrained(rm_path)
    with gjs.serve_in_thread() as server:
        with pytest.raises(checks.NonFiniteError, match="^" + re.escape(
                f"{rm_path / 'model.safetensors'} holds non-finite weights: score.weight has 1 NaN or inf values")):
            judge.main(judge_args(tmp_path, server, mode="agreement", reward_model_path=str(rm_path),
                                  preference_dataset=synthetic_task["preference"], num_samples=4))
        assert server.request_count == 0


def test_smoke_subprocess(tmp_path, synthetic_task):
    make_samples(tmp_path / "samples.csv", 16, seed=13, ties=False)
    with gjs.serve_in_thread() as server:
        cmd = [sys.executable, os.path.join(REPO, "judge.py"), "--csv", str(tmp_path / "samples.csv"),
               "--base_url", server.base_url, "--model", server.model_name, "--output_dir", str(tmp_path / "out"),
               "--cache_path", str(tmp_path / "cache.sqlite"), "--tokenizer_path", synthetic_task["base_model"],
               "--max_parallel_requests", "4"]
        env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**env, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert server.request_count == 16
    summary = json.load(open(tmp_path / "out" / "judge_summary.json"))
    label = os.path.basename(str(tmp_path))  # samples.csv is labelled by its run directory
    assert summary["per_csv"][label]["n"] == 16 and summary["per_csv"][label]["invalid"] == 0
    judged = pd.read_csv(tmp_path / "out" / f"{label}_judged.csv")
    assert (judged["response_len"] > 0).all()  # token lengths from the built-in tokenizer
    assert "win rate" in proc.stdout
