"""The built-in task's gold judge served as an OpenAI-compatible chat-completions endpoint.

`judge.py` talks to a real LLM judge through the official `openai` client. On the built-in task
there is no LLM to ask, but there is a gold judge (`data/synthetic.py`): this server puts it
behind the same wire protocol, so the judge's whole client path (prompt, order randomisation,
parsing, retries, caching) runs for real, and its verdicts must equal the gold verdicts exactly.

It understands two prompts and nothing else:

* the paper's pairwise prompt (Appendix I of the N+ Implementation Details paper), answered in
  the paper's format `Comparison: <one sentence>` / `Preferred: <"A" or "B">` with `gold_prefer`;
* the offline-RLHF paper's multi-answer scoring prompt (its Appendix A, after the Vicuna
  benchmark), answered with an explanation and one `Assistant X: score` line per answer, the
  score being `gold_score` mapped linearly onto 1-10.

The post and the summaries are parsed back out of the prompt text, so the templates below are
the single source of truth on this side; `judge.py` carries its own readable copy of each (a
test asserts that the copies are identical).

Usage:
    python data/gold_judge_server.py --port 0 --host 127.0.0.1     # prints the base URL, then the model id
    python data/gold_judge_server.py --fail_rate 0.2 --garbage_rate 0.1 --seed 3   # fault injection
In-process (tests, the pipeline):
    with serve_in_thread(fail_rate=0.1) as server:
        ...  # judge.py --base_url server.base_url --model server.model_name; server.request_count

The model id is `gold-judge-<digest of the gold judge's code>` and no other name is answered, so
judge.py's cache (keyed by model + prompt) never replays a verdict of an older gold judge.

Only loopback addresses are accepted: this is a test fixture, not a service.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import os
import random
import re
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# `python data/gold_judge_server.py` puts data/ on sys.path, not the repository root.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import data.synthetic  # noqa: E402
from data.synthetic import gold_prefer, gold_score  # noqa: E402


def _gold_judge_version() -> str:
    """A digest of the gold judge's code (data/synthetic.py and this file). It is part of the
    model id, so a verdict cached by `judge.py` (keyed by model + prompt) can never be replayed
    after the gold judge changes: a new version is a new model, as a new API snapshot would be."""
    digest = hashlib.sha256()
    for path in (data.synthetic.__file__, os.path.abspath(__file__)):
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:12]


GOLD_JUDGE_MODEL = f"gold-judge-{_gold_judge_version()}"

# --------------------------------------------------------------------------------------------
# 1. The prompts. Placeholders are `{name}`; every other brace is literal text of the prompt.
# --------------------------------------------------------------------------------------------
# A backslash that ends a line inside a prompt continues that line: the prompt has no line break
# there (it keeps the source within 120 columns).
# Appendix I of the paper (itself adapted from Rafailov et al., 2023). The seed's backslashes are
# Python line continuations in the original source, so the sentences run on without a break.
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

# Appendix A of the offline-RLHF paper (Hu et al.), with the number of assistants, their names,
# the question and the answers made placeholders (the paper hard-codes five assistants).
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

# One answer inside `{answers}`; answers are joined by a blank line.
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


def _template_regex(template: str, groups: dict[str, str]) -> re.Pattern:
    """A regex that matches exactly the texts `fill_template(template, ...)` produces. Each
    placeholder becomes the named group `groups[placeholder]` (named after the placeholder);
    a placeholder used twice must repeat the same text (a backreference)."""
    pattern = re.escape(template)
    for name, group in groups.items():
        placeholder = re.escape("{" + name + "}")
        pattern = pattern.replace(placeholder, f"(?P<{name}>{group})", 1).replace(placeholder, f"(?P={name})")
    return re.compile(pattern, re.DOTALL)


# greedy groups: when a post happens to contain "Summary A:", the last occurrence is the header
_PAIRWISE_RE = _template_regex(PAIRWISE_JUDGE_TEMPLATE, {"post": ".*", "summary_a": ".*", "summary_b": ".*"})
_MULTI_RE = _template_regex(
    MULTI_ANSWER_JUDGE_TEMPLATE,
    {"num_assistants": r"\w+", "assistant_names": r"[\w, ]+?", "question": ".*?",
     "answers": "The answer of Assistant .*"},
)


def parse_pairwise_prompt(text: str) -> tuple[str, str, str] | None:
    """(post, summary_a, summary_b) of a pairwise prompt; None when `text` is not one."""
    m = _PAIRWISE_RE.fullmatch(text)
    return None if m is None else (m.group("post"), m.group("summary_a"), m.group("summary_b"))


def parse_multi_prompt(text: str) -> tuple[str, list[str], list[str]] | None:
    """(question, assistant names, answers) of a multi-answer prompt; None when it is not one."""
    m = _MULTI_RE.fullmatch(text)
    if m is None:
        return None
    names = re.split(r", | and ", m.group("assistant_names"))
    if m.group("num_assistants") != number_word(len(names)):
        return None
    answers_text = m.group("answers")
    answers = []
    for i, name in enumerate(names):
        header = fill_template(MULTI_ANSWER_BLOCK_TEMPLATE, name=name, answer="")
        if not answers_text.startswith(header):
            return None
        answers_text = answers_text[len(header):]
        if i + 1 < len(names):
            next_header = "\n\n" + fill_template(MULTI_ANSWER_BLOCK_TEMPLATE, name=names[i + 1], answer="")
            cut = answers_text.find(next_header)
            if cut < 0:
                return None
            answers.append(answers_text[:cut])
            answers_text = answers_text[cut + 2:]
        else:
            answers.append(answers_text)
    return m.group("question"), names, answers


# --------------------------------------------------------------------------------------------
# 2. The gold judge's answers.
# --------------------------------------------------------------------------------------------
# gold_score is about 3 for a perfect summary and falls to about -5 for a bad one; this linear
# map puts [-3, 3] onto [1, 10] (clipped), rounded to one decimal as GPT-4 writes scores.
SCORE_LOW, SCORE_HIGH = -3.0, 3.0


def gold_score_1_to_10(post: str, answer: str) -> float:
    s = (gold_score(post, answer) - SCORE_LOW) / (SCORE_HIGH - SCORE_LOW)
    return round(1.0 + 9.0 * min(1.0, max(0.0, s)), 1)


def pairwise_reply(post: str, summary_a: str, summary_b: str) -> str:
    """The paper's answer format, with the gold verdict and a one-sentence reason."""
    preferred = gold_prefer(post, summary_a, summary_b)
    other = "B" if preferred == "A" else "A"
    sa, sb = gold_score(post, summary_a), gold_score(post, summary_b)
    best, worst = (sa, sb) if preferred == "A" else (sb, sa)
    return (
        f"Comparison: Summary {preferred} states the post's key facts more accurately and concisely than "
        f"Summary {other} (gold score {best:.2f} vs {worst:.2f}).\n"
        f"Preferred: {preferred}"
    )


def multi_reply(question: str, names: list[str], answers: list[str]) -> str:
    scores = [gold_score_1_to_10(question, a) for a in answers]
    lines = ["Evaluation:", ""]
    for name, score in zip(names, scores):
        lines.append(f"Assistant {name} covers the key facts of the post to a degree worth {score} out of 10.")
    lines += ["", "Scores:", ""]
    lines += [f"Assistant {name}: {score}" for name, score in zip(names, scores)]
    return "\n".join(lines)


# Replies for --garbage_rate: well-formed HTTP 200 answers that carry no parseable verdict.
GARBAGE_REPLIES = [
    "I am unable to decide between these two summaries.",
    "Comparison: both summaries are fine.\nPreferred: both",
    "Preferred: C",
    "",
]


# --------------------------------------------------------------------------------------------
# 3. The HTTP server.
# --------------------------------------------------------------------------------------------
def check_loopback(host: str) -> None:
    """Refuse anything but a loopback address: the fixture must never listen on a network."""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"the gold judge only listens on loopback addresses (127.0.0.0/8, ::1, localhost), not {host!r}")


class GoldJudgeServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer holding the fault-injection settings and the request counters."""

    daemon_threads = True

    def __init__(self, host: str, port: int, fail_rate: float, garbage_rate: float, seed: int,
                 latency_s: float, model_name: str):
        check_loopback(host)
        if not (0.0 <= fail_rate and 0.0 <= garbage_rate and fail_rate + garbage_rate <= 1.0):
            raise ValueError("need 0 <= fail_rate, garbage_rate and fail_rate + garbage_rate <= 1, "
                             f"got {fail_rate}, {garbage_rate}")
        super().__init__((host, port), _Handler)
        self.fail_rate, self.garbage_rate = fail_rate, garbage_rate
        self.latency_s, self.model_name = latency_s, model_name
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stats = {"requests": 0, "ok": 0, "status_429": 0, "status_500": 0, "garbage": 0, "bad_request": 0}

    @property
    def base_url(self) -> str:
        host, port = self.server_address[:2]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}/v1"

    @property
    def request_count(self) -> int:
        """Chat-completion requests received so far (every outcome counts)."""
        with self._lock:
            return self._stats["requests"]

    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats)

    def draw_fault(self) -> str:
        """'429', '500', 'garbage' or 'ok' for the next request, from the seeded generator."""
        with self._lock:
            self._stats["requests"] += 1
            u = self._rng.random()
            if u < self.fail_rate:
                return "429" if self._rng.random() < 0.5 else "500"
            if u < self.fail_rate + self.garbage_rate:
                return "garbage:" + str(self._rng.randrange(len(GARBAGE_REPLIES)))
            return "ok"

    def count(self, key: str) -> None:
        with self._lock:
            self._stats[key] += 1


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the openai client's httpx pool expects
    server: GoldJudgeServer

    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        """Silence per-request logging (headers, which carry the API key, are never printed)."""

    def _send_json(self, status: int, payload: dict, headers: dict | None = None) -> None:
        body = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client hung up before reading the answer (a timeout or retry on its side): no one to tell

    def _error(self, status: int, message: str, kind: str, headers: dict | None = None) -> None:
        self._send_json(status, {"error": {"message": message, "type": kind, "param": None, "code": None}}, headers)

    def do_GET(self):
        if self.path.rstrip("/") == "/v1/models":
            self._send_json(200, {"object": "list", "data": [
                {"id": self.server.model_name, "object": "model", "created": 0, "owned_by": "gold-judge"}]})
        else:
            self._error(404, f"no route {self.path}", "invalid_request_error")

    def do_POST(self):
        length = int(self.headers.get("Content-Length", "0"))
        raw = self.rfile.read(length)
        if self.path.rstrip("/") != "/v1/chat/completions":
            self._error(404, f"no route {self.path}", "invalid_request_error")
            return
        fault = self.server.draw_fault()
        if self.server.latency_s > 0:
            time.sleep(self.server.latency_s)  # a worker thread of the server, not async code
        if fault == "429":
            self.server.count("status_429")
            self._error(429, "Rate limit reached (injected)", "rate_limit_error", {"Retry-After": "0"})
            return
        if fault == "500":
            self.server.count("status_500")
            self._error(500, "Internal server error (injected)", "server_error")
            return
        try:
            request = json.loads(raw)
            messages = request["messages"]
            prompt = [m for m in messages if m.get("role") == "user"][-1]["content"]
            model = request["model"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            self.server.count("bad_request")
            self._error(400, f"malformed chat-completions request: {type(e).__name__}", "invalid_request_error")
            return
        if model != self.server.model_name:  # as a real API: an unknown model is a 404, not an answer
            self.server.count("bad_request")
            self._error(404, f"The model {model!r} does not exist; this server is {self.server.model_name!r}",
                        "invalid_request_error")
            return
        if fault.startswith("garbage:"):
            self.server.count("garbage")
            content = GARBAGE_REPLIES[int(fault.split(":")[1])]
        elif (pairwise := parse_pairwise_prompt(prompt)) is not None:
            content = pairwise_reply(*pairwise)
        elif (multi := parse_multi_prompt(prompt)) is not None:
            content = multi_reply(*multi)
        else:
            self.server.count("bad_request")
            self._error(400, "the gold judge only answers the pairwise (Appendix I) and multi-answer prompts",
                        "invalid_request_error")
            return
        if not fault.startswith("garbage:"):
            self.server.count("ok")
        self._send_json(200, {
            "id": f"chatcmpl-gold-{self.server.request_count}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": len(content.split()),
                      "total_tokens": len(prompt.split()) + len(content.split())},
        })


@contextlib.contextmanager
def serve_in_thread(host: str = "127.0.0.1", port: int = 0, fail_rate: float = 0.0, garbage_rate: float = 0.0,
                    seed: int = 0, latency_s: float = 0.0, model_name: str = GOLD_JUDGE_MODEL):
    """Run the gold judge in a background thread; yields the server (`.base_url`, `.model_name`
    to pass as judge.py's --model, `.request_count`, `.stats()`), and shuts it down on exit."""
    server = GoldJudgeServer(host, port, fail_rate, garbage_rate, seed, latency_s, model_name)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@dataclass
class ServerArgs:
    host: str = "127.0.0.1"
    """loopback address to bind (anything else is refused)"""
    port: int = 0
    """port to bind; 0 picks a free one (the bound URL is printed)"""
    fail_rate: float = 0.0
    """fault injection: share of requests answered with HTTP 429 or 500 (half each)"""
    garbage_rate: float = 0.0
    """fault injection: share of requests answered 200 with text that has no parseable verdict"""
    seed: int = 0
    """seed of the fault-injection draws"""
    latency_s: float = 0.0
    """seconds every request waits before it is answered (to mimic a remote API's latency)"""
    model_name: str = GOLD_JUDGE_MODEL
    """the only model id served (GET /v1/models lists it); the default carries a digest of the gold judge's code"""


def main(args: ServerArgs) -> None:
    server = GoldJudgeServer(args.host, args.port, args.fail_rate, args.garbage_rate, args.seed,
                             args.latency_s, args.model_name)
    print(server.base_url, flush=True)
    print(f"model: {server.model_name}", flush=True)
    try:
        server.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        print(json.dumps(server.stats()), flush=True)


if __name__ == "__main__":
    import tyro

    main(tyro.cli(ServerArgs, use_underscores=True))
