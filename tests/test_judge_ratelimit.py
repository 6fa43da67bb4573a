"""A rate-limited judge is waited out, not given up on (issue 50 item 1).

A 429 is no fault: the client waits as the API's headers ask (Retry-After in seconds or as an HTTP-date, OpenAI's
x-ratelimit-reset-*), halves the requests in flight, uses up no --max_tries, prints one line, and stops with one
paragraph only once the limit has lasted --rate_limit_patience with no answer; the replies it got stay in the cache,
so a rerun asks only the rest. The endpoint is the gold judge on loopback with a limit put in front of it."""

import ast
import contextlib
import email.utils
import os
import re
import threading
import time

import pytest

from test_judge import (
    REPO,
    _no_real_key,  # noqa: F401 (autouse)
    cached_reply_count,
    gjs,
    judge,
    judge_args,
    judge_client,
    make_samples,
)


class LimitedHandler(gjs._Handler):
    """The gold judge's handler behind a rate limit: after `answer_first` answered requests, every request is a 429
    with the server's `headers` for `window_s` seconds from the first 429 (or until `lifted`), then the gold judge
    answers again."""

    def do_POST(self):
        server = self.server
        with server.limit_lock:
            server.posts += 1
            now = time.monotonic()
            limited = (not server.lifted and server.posts > server.answer_first
                       and (server.limited_at is None or now - server.limited_at < server.window_s))
            if limited:
                server.limited_at = server.limited_at or now
                server.limited += 1
                server.limited_times.append(now)
        if not limited:
            return super().do_POST()  # the gold judge (it counts request_count: the requests answered)
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self._error(429, "Rate limit reached for requests per min (RPM)", "requests", server.headers)


@contextlib.contextmanager
def limited_server(answer_first: int = 0, window_s: float = 2.5):
    with gjs.serve_in_thread() as server:
        server.handle_error = lambda request, client_address: None  # a client that hung up at the stop: no traceback
        server.limit_lock, server.posts, server.limited, server.limited_at = threading.Lock(), 0, 0, None
        server.limited_times = []
        server.answer_first, server.window_s, server.lifted = answer_first, window_s, False
        server.headers = {"Retry-After": "1"}
        server.RequestHandlerClass = LimitedHandler
        yield server


def test_a_rate_limit_is_waited_out_with_one_line_and_fewer_requests_in_flight(tmp_path, capsys):
    """429 with Retry-After: 1 for 2.5 s: every pair is judged, though --max_tries 2 would not outlast two 429s; one
    line says so; each wave of requests after a 1 s wait was at most half the one before."""
    make_samples(tmp_path / "a.csv", 12, seed=31, ties=False)
    with limited_server() as server:
        started = time.monotonic()
        summary = judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")], max_tries=2,
                                        max_parallel_requests=8))
        took = time.monotonic() - started
        limited, answered, times = server.limited, server.request_count, server.limited_times
    s = summary["per_csv"]["a"]
    assert (s["wins"] + s["losses"], s["invalid"], s["api_errors"]) == (12, 0, 0)
    assert answered == 12 and summary["stats"]["rate_limited"] == limited
    # the 429s in waves 1 s apart: the 8 in flight (or fewer, once the first 429 is in), then 4 at most, then 2 ...
    waves = [[times[0]]]
    for before, now in zip(times, times[1:]):
        if now - before < 0.5:
            waves[-1].append(now)
        else:
            waves.append([now])
    sizes = [len(wave) for wave in waves]
    # (on a loaded machine a wave can arrive split in two: each part is still at most half of the 8 before the limit)
    assert len(sizes) >= 2 and sizes[0] <= 8 and all(size <= 4 for size in sizes[1:]), sizes
    assert 2.0 < took < 30, f"{took:.1f} s"  # it waited as asked (1 s, twice at least), and no longer than needed
    lines = [line for line in capsys.readouterr().out.splitlines() if "rate limited" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"judge: rate limited by {server.base_url} (HTTP 429) with 0 of 12 judged: waiting "
                               "1.0 s as it asks") and "--rate_limit_patience 600 s" in lines[0], lines[0]


def test_a_limit_past_the_patience_stops_with_one_paragraph_and_a_rerun_asks_only_the_rest(tmp_path):
    make_samples(tmp_path / "a.csv", 12, seed=32, ties=False)
    cache_path = str(tmp_path / "cache.sqlite")
    with limited_server(answer_first=4, window_s=30) as server:
        # one request at a time: 4 answered, then a 429; after its 1 s wait another, and 2 s would pass 1.5 s
        with pytest.raises(judge_client.JudgeUnavailableError) as err:
            judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")], max_parallel_requests=1,
                                  rate_limit_patience=1.5))
        assert (server.request_count, server.limited) == (4, 2)
        message = str(err.value)
        assert "\n" not in message and "cannot be reached" not in message and "gave up after" not in message
        assert re.match(re.escape(f"the judge at {server.base_url} kept rate-limiting (HTTP 429 for ") + r"1\.\d s "
                        r"with no answer, then a wait of 1\.0 s more asked, over --rate_limit_patience 1\.5 s; "
                        r"last error RateLimitError: ", message), message
        assert message.endswith(f"the 4 of 12 prompts answered so far are kept in the reply cache {cache_path}, so a "
                                "rerun asks only the other 8: rerun once the limit has lifted, or raise "
                                "--rate_limit_patience (or lower --max_parallel_requests)"), message
        assert cached_reply_count(cache_path) == 4
        server.lifted = True
        summary = judge.main(judge_args(tmp_path, server, csv=[str(tmp_path / "a.csv")]))
        assert server.request_count == 4 + 8  # the rerun asked the 8 the cache did not hold, nothing twice
    assert summary["stats"]["cache_hits"] == 4 and summary["per_csv"]["a"]["invalid"] == 0


NOW = 1_700_000_000.0


@pytest.mark.parametrize("headers, wait", [
    ({"Retry-After": "10"}, 10.0),
    ({"retry-after": "0.5"}, 0.5),
    ({"Retry-After": email.utils.formatdate(NOW + 30, usegmt=True)}, 30.0),  # an HTTP-date
    ({"Retry-After": email.utils.formatdate(NOW - 30, usegmt=True)}, 0.0),  # one past: no wait
    ({"retry-after-ms": "250", "Retry-After": "10"}, 0.25),  # the finer one first, as the openai client reads them
    ({"x-ratelimit-reset-requests": "6m0s", "x-ratelimit-reset-tokens": "20ms", "x-ratelimit-remaining-requests": "59",
      "x-ratelimit-remaining-tokens": "0"}, 0.02),  # the spent limit's reset
    ({"x-ratelimit-reset-requests": "1s", "x-ratelimit-reset-tokens": "1m30.5s"}, 90.5),  # none said spent: the longer
    ({"X-RateLimit-Reset-Requests": "1h2m3s"}, 3723.0),
    ({"Retry-After": "2", "x-ratelimit-reset-tokens": "6m0s"}, 2.0),  # Retry-After first
    ({}, None), ({"Retry-After": "soon"}, None), ({"x-ratelimit-reset-tokens": "6 minutes"}, None),
])
def test_the_wait_a_429_asks_for_is_read_from_its_headers(headers, wait):
    # (a response's own headers object: the first test, whose 1 s wait is read from its Retry-After)
    assert judge_client.rate_limit_wait_s(headers, now=NOW) == wait


@pytest.mark.parametrize("text, seconds", [("20ms", 0.02), ("6m0s", 360.0), ("1s", 1.0), ("1.5s", 1.5), ("10", 10.0),
                                           ("2h", 7200.0), ("", None), ("1x", None), ("s", None), ("nan", None)])
def test_durations_as_openai_writes_them(text, seconds):
    got = judge_client.duration_s(text)
    assert got is None if seconds is None else got == pytest.approx(seconds)


def test_the_throttle_halves_fast_and_grows_back_slowly():
    async def go():
        throttle = judge_client.Throttle(8)
        for _ in range(8):
            await throttle.acquire()
        limits = []
        for _ in range(4):  # 8 -> 4 -> 2 -> 1 -> 1
            throttle.halve()
            limits.append(throttle.limit)
        for _ in range(8):  # the 8 in flight end: 7 permits are kept back, one goes round
            throttle.release()
        assert (throttle.owed, throttle.kept, throttle.semaphore._value) == (0, 7, 1)
        for _ in range(1 + 2 + 3):  # one more after each `limit` answers
            throttle.answered()
            limits.append(throttle.limit)
        assert throttle.limit + throttle.owed + throttle.kept == 8
        return limits

    import asyncio

    assert asyncio.run(go()) == [4, 2, 1, 1, 2, 2, 3, 3, 3, 4]


def field_help(script: str, cls: str, name: str) -> tuple:
    """The default and the help text (the docstring under the field) of a dataclass field in a script."""
    tree = ast.parse(open(os.path.join(REPO, script)).read())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    i = next(i for i, n in enumerate(body) if isinstance(n, ast.AnnAssign) and n.target.id == name)
    return ast.literal_eval(body[i].value), body[i + 1].value.value


def test_the_patience_is_one_flag_with_one_help_in_every_script_that_asks_a_judge():
    ours = field_help("judge.py", "Args", "rate_limit_patience")
    assert field_help("rlhf_utils/flags.py", "EndpointFlags", "rate_limit_patience") == ours  # online_dpo.py's
    assert ours[0] == 600.0 and "429" in ours[1]
