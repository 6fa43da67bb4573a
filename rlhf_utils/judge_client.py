"""The judge's HTTP client: how judge.py and online_dpo.py (--judge endpoint) ask an OpenAI-compatible chat API.

A judge is a remote service that fails, so each question goes through the same policy:

  deadline   --timeout_s bounds every request as a whole, not only the wait for its first byte: a server that
             answers and then stalls, or trickles its body, is cut off like one that never answers
  retries    a 5xx, a connection error, a missed deadline, a cut body and a 200 that is no chat completion are
             asked again, at most --max_tries times in all, after an exponential backoff with jitter
             (asyncio.sleep: no blocking sleep); any other status but 429 (400, 404 ...) fails that prompt alone
  429        a rate limit is no fault: the API is working and says when to come back. Every request waits as long
             as its headers ask (Retry-After, OpenAI's x-ratelimit-reset-*; rate_limit_wait_s), the requests in
             flight are halved and grow back by one at a time after answers (Throttle), and one line says so. Such
             waits use up no --max_tries; --rate_limit_patience bounds how long the limit may last with no answer,
             then the run stops with one paragraph (the answered prompts are in the cache: a rerun asks the rest)
  re-asks    a reply that parse_fn cannot read is asked again, at most --max_parse_tries times, then counted as
             unparseable: the caller marks it invalid, never a loss and never a coin flip
  cache      every reply received is committed to sqlite at once (ReplyCache), so a rerun or an interrupted run
             does not pay again for a reply it already has (one race remains, see ReplyCache); a damaged cache file
             is moved aside, the replies of it that still read carried over (readable_rows); a full disk under it
             is one paragraph naming the folder
  the stop   a judge that cannot be used at all (unreachable, stalling, answering no chat completion, refusing the
             key, not one request answered, every request refused, rate-limiting past --rate_limit_patience) stops
             the run with one JudgeUnavailableError that names the URL, what happened and the fix, instead of
             marking every row invalid
  the key    read from OPENAI_API_KEY in the environment only, never from a flag or a file (a loopback endpoint,
             the built-in gold judge, needs none); it is never printed, logged or saved: every error text kept is
             redacted, and the URL written to summaries loses any user:password part (public_url)

Names: LOOPBACK_PLACEHOLDER_KEY, is_loopback_url, resolve_api_key, public_url (the key and the URL); ReplyCache,
readable_rows (the cache); JudgeAPIError, JudgeUnavailableError, BadReply (failures); Outcome (one job's result);
duration_s, rate_limit_wait_s, Throttle (rate limits); Judge (the async client); run_jobs (the one call the scripts
make).
For online_dpo.py's --judge endpoint: endpoint_client_args (its flags as the client reads them), run_cached_jobs
(run_jobs with the cache file opened and closed around it), on_main_process (the main process asks, every process
gets the answer or the same error).

It decides no number a training script computes. It imports RunError from rlhf_utils/checks.py (JudgeUnavailableError
is an expected stop, printed as one paragraph); rlhf_utils/run.py imports nothing of it, and rlhf_utils/flags.py only
inside check_online_dpo_flags for --judge endpoint, so a training run that asks no judge never loads openai.
"""

import asyncio
import contextlib
import email.utils
import hashlib
import ipaddress
import json
import os
import random
import re
import sqlite3
import sys
import time
import urllib.parse
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Callable, Optional

import openai
from openai import AsyncOpenAI
from tqdm.auto import tqdm

from rlhf_utils.checks import RunError

# the API key sent to a loopback endpoint when OPENAI_API_KEY is unset (the gold judge checks no key)
LOOPBACK_PLACEHOLDER_KEY = "sk-loopback-placeholder"


def is_loopback_url(url: Optional[str]) -> bool:
    """Whether `url` points at this machine (localhost, 127.0.0.0/8, ::1); False for None or ""."""
    if not url:
        return False
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost
        return False


def resolve_api_key(base_url: Optional[str]) -> str:
    """The key comes from the environment only. A loopback endpoint (the built-in gold judge) needs none, so a
    placeholder is used there when the variable is unset; anywhere else an unset key stops the script."""
    key = os.environ.get("OPENAI_API_KEY")
    if key:
        return key
    if is_loopback_url(base_url):
        return LOOPBACK_PLACEHOLDER_KEY
    raise SystemExit("set OPENAI_API_KEY in the environment (the key is never read from flags or files)")


def public_url(url: Optional[str]) -> Optional[str]:
    """The base URL without any user:password part (nor query or fragment), for the summary file and error texts."""
    if url is None:
        return None
    parts = urllib.parse.urlsplit(url)
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class ReplyCache:
    """Every reply the judge paid for, in sqlite. The key is a hash of the model, the endpoint (its URL without
    credentials: two servers that serve one model name never share replies), the system prompt, the prompt, the
    temperature, the seed when the judge samples (a temperature above 0, or none sent, which leaves the API's
    default; a rerun with another --seed asks afresh) and the ask index (0 for the first ask; 1, 2 ... for the re-asks
    after an unparseable reply), so a rerun replays the same sequence of replies without any request.
    Only replies are cached; a request that failed (a 5xx after all its tries, a rate limit past the patience) is
    asked again.

    One race no client can close: a process killed after the server has answered a request but before the reply is
    committed here (the reply still on the wire, or between its arrival and `put`) has paid for that request
    without keeping the reply, and the rerun asks it again. At most the requests in flight at the kill
    (--max_parallel_requests) are paid for twice.

    A damaged file (cut short, a page overwritten, or no database at all at the path) is found as it first opens in a
    process (sqlite's own check of every page, PRAGMA quick_check: once per file, not at each round's reopening),
    moved aside under `<path>.damaged-<time>` (never deleted) and replaced by a new cache holding every reply of it
    that still reads (readable_rows), with one warning; the prompts it lost are asked again. (A write-ahead log cut
    short needs none of this: sqlite drops its unfinished frames.) A full disk, as it opens or takes a reply, stops
    the run with one paragraph naming the folder; sqlite keeps every reply committed before it, so the same command
    reruns once there is space and asks only the others."""

    checked: set = set()  # the files this process has checked whole: online_dpo.py opens its cache every round

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path  # named by the error that stops a rate-limited run: its replies are kept here
        with self.disk_full_named("a new reply"):
            self.db = sqlite3.connect(path)
            first_open = os.path.abspath(path) not in ReplyCache.checked
            ReplyCache.checked.add(os.path.abspath(path))
            if first_open and (damage := self.damage(self.db)) is not None:
                self.db.close()
                self.repair(damage)
                self.db = sqlite3.connect(path)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("CREATE TABLE IF NOT EXISTS replies "
                            "(key TEXT PRIMARY KEY, model TEXT, reply TEXT, created REAL)")
            self.db.commit()

    @contextlib.contextmanager
    def disk_full_named(self, what: str):
        """sqlite's "database or disk is full" (SQLITE_FULL) as one paragraph naming the cache's folder."""
        try:
            yield
        except sqlite3.OperationalError as error:
            if getattr(error, "sqlite_errorname", "") != "SQLITE_FULL":
                raise
            folder = os.path.dirname(os.path.abspath(self.path))
            raise RunError(f"the disk holding {folder} is full: the judge's reply cache {self.path} cannot take "
                           f"{what} (sqlite3: {error}). Every reply it took before is kept in it: free space there "
                           "(or pass --cache_path on another disk, with a copy of this file to keep its replies) and "
                           "run the same command again, which asks the judge only the prompts it lacks") from error

    @staticmethod
    def damage(db) -> Optional[str]:
        """What is wrong with the cache's file, or None: sqlite's check of every page (a new, empty file passes)."""
        try:
            found = [str(row[0]) for row in db.execute("PRAGMA quick_check")]
        except sqlite3.DatabaseError as error:  # SQLITE_CORRUPT, or SQLITE_NOTADB: no database at all
            if getattr(error, "sqlite_errorname", "") not in ("SQLITE_CORRUPT", "SQLITE_NOTADB"):
                raise
            return str(error)
        return None if found == ["ok"] else " ".join(" ".join(found[:3]).split())

    def repair(self, damage: str) -> None:
        """The damaged file (with its write-ahead log and index) moved aside, and a new cache made at the path of the
        replies of it that still read."""
        aside = f"{self.path}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
        while os.path.exists(aside):  # (an earlier damaged copy of this second is kept too)
            aside += "-1"
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(self.path + suffix):
                os.replace(self.path + suffix, aside + suffix)
        rows = readable_rows(aside)
        db = sqlite3.connect(self.path)
        try:
            db.execute("CREATE TABLE replies (key TEXT PRIMARY KEY, model TEXT, reply TEXT, created REAL)")
            db.executemany("INSERT OR IGNORE INTO replies VALUES (?, ?, ?, ?)", rows)
            db.commit()
        finally:
            db.close()
        print(f"warning: the judge's reply cache {self.path} is damaged ({damage}): moved aside to {aside}; the "
              f"{len(rows)} replies of it that still read are carried over into a new cache at {self.path}, and "
              "every other prompt is asked again", file=sys.stderr, flush=True)

    @staticmethod
    def key(model: str, endpoint: str, system_prompt: str, prompt: str, temperature: Optional[float], seed: int,
            ask_index: int) -> str:
        sampled_with = None if temperature == 0 else seed  # a greedy judge answers alike whatever the seed
        fields = [model, endpoint, system_prompt, prompt, temperature, sampled_with, ask_index]
        return hashlib.sha256(json.dumps(fields).encode()).hexdigest()

    def get(self, key: str) -> Optional[str]:
        row = self.db.execute("SELECT reply FROM replies WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def put(self, key: str, model: str, reply: str) -> None:
        # committed at once, so an interrupted run keeps every reply it received
        with self.disk_full_named("another reply"):
            self.db.execute("INSERT OR REPLACE INTO replies VALUES (?, ?, ?, ?)", (key, model, reply, time.time()))
            self.db.commit()

    def close(self) -> None:
        self.db.close()


def readable_rows(path: str) -> list[tuple]:
    """Every row of a damaged cache's table that still reads (Python's sqlite3 has no recover call): a scan in rowid
    order, and past a damaged page each rowid asked alone until one reads again, up to the highest rowid the file can
    hold: every row takes more than 64 bytes of it (its key alone is 64 characters), of the size its header gives
    when it was cut short. Only whole rows are kept. A file that is no sqlite database holds none."""
    with open(path, "rb") as f:
        header = f.read(100)
    if len(header) < 100 or not header.startswith(b"SQLite format 3\x00"):
        return []
    page_size = int.from_bytes(header[16:18], "big")
    size = max(os.path.getsize(path), (65536 if page_size == 1 else page_size) * int.from_bytes(header[28:32], "big"))
    wal = os.path.exists(path + "-wal")  # its write-ahead log, moved aside with it: read through it
    top = (size + (os.path.getsize(path + "-wal") if wal else 0)) // 64
    # read-only; without a log, immutable too, so that sqlite makes no log or lock files beside the damaged copy
    db = sqlite3.connect(f"file:{urllib.parse.quote(os.path.abspath(path))}?{'mode=ro' if wal else 'immutable=1'}",
                         uri=True)
    db.execute("PRAGMA writable_schema=ON")  # (else sqlite refuses to read a file shorter than its header says)
    rows, rowid = [], 0
    try:
        if db.execute("SELECT 1 FROM sqlite_master WHERE name = 'replies'").fetchone() is None:
            return []
        while rowid < top:
            with contextlib.suppress(sqlite3.DatabaseError):
                for rowid, *row in db.execute("SELECT rowid, key, model, reply, created FROM replies WHERE rowid > ? "
                                              "ORDER BY rowid", (rowid,)):
                    rows.append(tuple(row))
                break  # the scan reached the end
            while rowid < top:  # a damaged page: the rowids after the last row read, one at a time
                rowid += 1
                with contextlib.suppress(sqlite3.DatabaseError):
                    if (row := db.execute("SELECT key, model, reply, created FROM replies WHERE rowid = ?",
                                          (rowid,)).fetchone()) is not None:
                        rows.append(row)
                        break
    except sqlite3.DatabaseError:  # the schema itself is damaged: nothing reads
        return []
    finally:
        db.close()
    # a row whose bytes ran past the cut reads with its tail as zero bytes: kept only whole (a hex key, no NUL)
    return [row for row in rows if isinstance(row[0], str) and re.fullmatch("[0-9a-f]{64}", row[0])
            and isinstance(row[1], str) and isinstance(row[2], str) and "\x00" not in row[1] + row[2]]


class JudgeAPIError(Exception):
    """A request that failed for good (a status not worth retrying, or retryable ones past --max_tries)."""


class JudgeUnavailableError(RunError, RuntimeError):
    """The judge cannot be used at all: its endpoint cannot be reached, stalls, answers no chat completion or keeps
    failing before it has answered a single request, it refuses the API key, every request of the run was refused,
    or it kept rate-limiting past --rate_limit_patience. Asking the remaining rows would only mark each one invalid
    (after its own --max_tries), so the run stops. A RunError: printed as one paragraph, without a traceback."""


class BadReply(Exception):
    """An answer that is no chat completion: cut off, or no JSON with a message's text (args: what, the detail)."""


@dataclass
class Outcome:
    """What asking one job came to (Judge.ask); judge.py also makes "tie" ones for the pairs it never asks."""

    status: str  # "ok", "unparseable" or "api_error" ("tie" in judge.py: not asked)
    parsed: object  # parse_fn's result when status == "ok", else None
    reply: str  # the last reply ("" for api_error)
    asks: int  # how many replies were asked for (cached or not)
    error: str = ""  # for api_error: the (redacted) error of the request that failed for good


# OpenAI writes its x-ratelimit-reset-* headers as Go durations: "1s", "6m0s", "20ms", "1h2m3.5s"
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|us|µs|ns|h|m|s)")
_SECONDS_PER = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def duration_s(text: str) -> Optional[float]:
    """The seconds a header value says: a plain number ("10", "0.5") or a Go duration ("6m0s", "20ms"); None for
    anything else (an HTTP-date, a typo)."""
    text = text.strip()
    with contextlib.suppress(ValueError):
        seconds = float(text)
        return None if seconds != seconds else seconds  # "nan" says nothing; "inf" is a wait no patience outlasts
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        return None
    return sum(float(number) * _SECONDS_PER[unit] for number, unit in parts)


def rate_limit_wait_s(headers, now: Optional[float] = None) -> Optional[float]:
    """How long a 429's headers ask the client to wait, in seconds (never below 0), or None when they do not say.
    First retry-after-ms, then Retry-After in seconds or as an HTTP-date: what the openai client honours when its own
    retries are on (ours are off, max_retries=0, so no wait is taken twice). Then OpenAI's x-ratelimit-reset-requests
    and -tokens, the time until that limit refills: of the one spent (its x-ratelimit-remaining-* is 0), else the
    longer. `now` (time.time()) is for the tests."""
    headers = {name.lower(): value for name, value in dict(headers).items()}
    if (value := headers.get("retry-after-ms")) is not None and (ms := duration_s(value)) is not None:
        return max(ms / 1000, 0.0)
    if (value := headers.get("retry-after")) is not None:
        seconds = duration_s(value)
        with contextlib.suppress(TypeError, ValueError, OverflowError):
            if seconds is None and (date := email.utils.parsedate_tz(value)) is not None:
                seconds = email.utils.mktime_tz(date) - (time.time() if now is None else now)
        if seconds is not None:
            return max(seconds, 0.0)
    resets = {kind: duration_s(headers.get(f"x-ratelimit-reset-{kind}", "")) for kind in ("requests", "tokens")}
    resets = {kind: seconds for kind, seconds in resets.items() if seconds is not None}
    spent = [s for kind, s in resets.items() if headers.get(f"x-ratelimit-remaining-{kind}", "").strip() == "0"]
    return max(spent or resets.values(), default=None)


class Throttle:
    """How many requests may be in flight, and from when. At most `limit` at once: a rate limit halves it (down to 1)
    and it grows back by one after `limit` answers, up to --max_parallel_requests (as TCP does: down fast, up slowly).
    And none is sent before `until` (time.monotonic()), the end of the wait the last 429 asked for, so the requests
    wait out a limit together instead of each one meeting it again.

    One semaphore of --max_parallel_requests permits holds the limit, so the requests still queue in order: lowering
    it keeps back the next permits released (`owed`, then `kept`) instead of returning them; raising it returns one.
    Always limit + owed + kept = most."""

    def __init__(self, most: int):
        self.most = self.limit = most
        self.semaphore = asyncio.Semaphore(most)
        self.owed = self.kept = 0
        self.until = 0.0
        self.cut_at = -float("inf")  # when the limit was last halved
        self.answers = 0  # answers since the limit last changed

    async def acquire(self) -> None:
        await self.semaphore.acquire()
        try:
            while (wait := self.until - time.monotonic()) > 0:  # (a later 429 may push `until` on while we sleep)
                await asyncio.sleep(wait)
        except BaseException:  # cancelled while waiting: the permit goes back
            self.release()
            raise

    def release(self) -> None:
        if self.owed:
            self.owed, self.kept = self.owed - 1, self.kept + 1
        else:
            self.semaphore.release()

    def halve(self) -> None:
        cut = self.limit - max(1, self.limit // 2)
        self.limit, self.owed, self.answers, self.cut_at = self.limit - cut, self.owed + cut, 0, time.monotonic()

    def answered(self) -> None:
        self.answers += 1
        if self.limit < self.most and self.answers >= self.limit:
            self.limit, self.answers = self.limit + 1, 0
            if self.owed:
                self.owed -= 1
            else:
                self.kept -= 1
                self.semaphore.release()


class Judge:
    """The async client, its concurrency limit, the retry policy and the cache."""

    RETRYABLE = (openai.InternalServerError, openai.APIConnectionError)  # faults; a 429 is waited out (rate_limited)
    # what the run-stopping error says of a judge that never answered, by the last failure, and the fix
    STOPPED = {"cannot be reached": "check that the server is running and that --base_url points at it",
               "answers no chat completion": "check that --base_url is the /v1 root of an OpenAI-compatible API",
               "answered, but the body was cut": "check the server (and any proxy before it), or try again later",
               **dict.fromkeys(["did not answer", "answered and stalled"],
                               "check the server's load, or raise --timeout_s")}

    def __init__(self, args, cache: ReplyCache):
        self.args, self.cache = args, cache
        self._api_key = resolve_api_key(args.base_url)
        # max_retries=0: the retry policy below is the only one, so tries are bounded and counted
        self.client = AsyncOpenAI(api_key=self._api_key, base_url=args.base_url, max_retries=0, timeout=args.timeout_s)
        self.url = public_url(args.base_url or str(self.client.base_url))  # the URL asked, for the user's eyes
        self.throttle = Throttle(args.max_parallel_requests)
        self.jitter = random.Random(args.seed)
        self.stats = {"requests": 0, "cache_hits": 0, "retries": 0, "reasks": 0, "api_errors": 0, "rate_limited": 0}
        self.answered = 0  # requests the server answered in this run (cache hits not counted)
        self.done, self.total = 0, 0  # jobs with a reply (in the cache), and all jobs (ask_all)
        self.limited_since: Optional[float] = None  # the first 429 that no answer has followed yet (monotonic)
        self.cuts, self.told_at = 0, -float("inf")  # halvings since then; when a line last told of a limit

    def redact(self, text: str) -> str:
        """Belt and braces: no error text we keep may contain the key."""
        return text.replace(self._api_key, "[REDACTED]") if self._api_key else text

    def unavailable(self, what: str, cause: str, fix: str) -> JudgeUnavailableError:
        """The error that stops the run: the URL (without credentials), what went wrong, the cause and the fix."""
        return JudgeUnavailableError(self.redact(f"the judge at {self.url} {what} ({cause}); {fix}"))

    def backoff_s(self, attempt: int) -> float:
        """Exponential backoff with jitter: half the doubled delay fixed, half uniform."""
        cap = min(self.args.backoff_max_s, self.args.backoff_base_s * 2**attempt)
        return cap / 2 + self.jitter.uniform(0, cap / 2)

    def rate_limited(self, error: openai.RateLimitError, sent: float) -> None:
        """A 429 to a request sent at `sent` (monotonic). Every request now waits as long as the headers ask (none
        asked, or 0: the backoff, never a busy loop); the requests in flight are halved, unless this one was sent
        before the last cut (its 429 tells nothing new); one line tells the user when a spell of limits begins (at
        most one a minute). When the spell, from its first 429 to the end of the wait asked now, would pass
        --rate_limit_patience, the run stops instead: one paragraph, the replies so far kept in the cache."""
        now = time.monotonic()
        self.stats["rate_limited"] += 1
        began = self.limited_since is None
        if began:
            self.limited_since, self.cuts = now, 0
        asked = rate_limit_wait_s(error.response.headers)
        until = max(self.throttle.until, now + (asked or self.backoff_s(self.cuts)))
        waited, patience = now - self.limited_since, self.args.rate_limit_patience
        if waited + (until - now) > patience:
            cause = (f"HTTP 429 for {waited:.1f} s with no answer, then a wait of {until - now:.1f} s more asked, "
                     f"over --rate_limit_patience {patience:g} s; last error {type(error).__name__}: {error}")
            fix = (f"the {self.done} of {self.total} prompts answered so far are kept in the reply cache "
                   f"{self.cache.path}, so a rerun asks only the other {self.total - self.done}: rerun once the limit "
                   "has lifted, or raise --rate_limit_patience (or lower --max_parallel_requests)")
            self.throttle.until = float("inf")  # no request leaves after the stop (ask_all cancels them all next)
            raise self.unavailable("kept rate-limiting", cause, fix) from None
        self.throttle.until = until
        if sent >= self.throttle.cut_at:
            self.throttle.halve()
            self.cuts += 1
        if began and now - self.told_at >= 60:
            self.told_at = now
            tqdm.write(f"judge: rate limited by {self.url} (HTTP 429) with {self.done} of {self.total} judged: waiting "
                       f"{until - now:.1f} s{' as it asks' if asked else ''}, and again while it limits, up to "
                       f"--rate_limit_patience {patience:g} s with no answer; meanwhile {self.throttle.limit} in "
                       "flight at most")

    async def ask_once(self, messages: list, extra: dict, phase: list) -> str:
        """One request: the reply's text. phase[0] turns "answered" once the status and headers are in, so that a
        deadline past it reads as a stall after answering."""
        create = self.client.chat.completions.with_streaming_response.create
        async with create(model=self.args.model, messages=messages, **extra) as response:
            phase[0] = "answered"
            try:
                body = await response.read()
            except Exception as error:  # the HTTP library's own (httpx, or httpx2 under newer openai): stalled or cut
                cut = BadReply("answered, but the body was cut", f"{type(error).__name__}: {error}")
                raise (TimeoutError() if "Timeout" in type(error).__name__ else cut) from error
        with contextlib.suppress(ValueError, TypeError, KeyError, IndexError):
            content = json.loads(body)["choices"][0]["message"]["content"]
            if content is None or isinstance(content, str):
                self.answered += 1
                return content or ""
        raise BadReply("answers no chat completion", f"200 with the body {body[:100].decode(errors='replace')!r}")

    async def request(self, prompt: str) -> str:
        """The reply to `prompt`, after at most --max_tries tries at faults (429s are waited out, and count none). A
        failure that holds for every row stops the run (JudgeUnavailableError); one of this prompt alone raises
        JudgeAPIError."""
        messages = [{"role": "system", "content": self.args.system_prompt}, {"role": "user", "content": prompt}]
        extra = {} if self.args.temperature is None else {"temperature": self.args.temperature}
        # the slot is held through a fault's backoff too (a failing server gets fewer requests); a 429 hands it back
        # and queues again behind the wait, so that the halved limit holds at once
        await self.throttle.acquire()
        held, tries = True, 0
        try:
            while True:
                self.stats["requests"] += 1
                phase, sent = ["asked"], time.monotonic()
                try:  # --timeout_s bounds the whole request: a server that trickles its answer is cut off too
                    reply = await asyncio.wait_for(self.ask_once(messages, extra, phase), self.args.timeout_s)
                    self.throttle.answered()
                    if self.limited_since is not None and sent >= self.limited_since:
                        self.limited_since = None  # a request sent during the limit was answered: it has lifted
                    return reply
                except openai.RateLimitError as e:  # (caught before the APIStatusError it is)
                    self.rate_limited(e, sent)  # raises once the limit outlasts --rate_limit_patience
                    self.stats["retries"] += 1
                    held = False
                    self.throttle.release()
                    await self.throttle.acquire()
                    held = True
                    continue
                except (openai.AuthenticationError, openai.PermissionDeniedError) as e:
                    # 401 / 403: a refused key is refused for every row, so the run stops here
                    fix = "check the key in OPENAI_API_KEY (it is read from the environment only)"
                    raise self.unavailable("refused the API key", f"{type(e).__name__}: {e}", fix) from None
                except (TimeoutError, openai.APITimeoutError):  # (caught before the APIConnectionError it is)
                    what = "answered and stalled" if phase[0] == "answered" else "did not answer"
                    last_error = f"no complete reply within --timeout_s {self.args.timeout_s} s"
                except BadReply as e:
                    what, last_error = e.args
                except self.RETRYABLE as e:
                    what = "cannot be reached" if isinstance(e, openai.APIConnectionError) else "failed"
                    last_error = f"{type(e).__name__}: {e}"
                except openai.APIStatusError as e:  # 400, 404 ...: asking again will not help
                    error = f"{type(e).__name__}: {e}"
                    if isinstance(e, openai.NotFoundError) and not self.answered:  # an unknown model or path
                        fix = (f"check that it serves the model {self.args.model!r} (--model) and that --base_url is "
                               "its /v1 root")
                        raise self.unavailable("failed before answering any request", error, fix) from None
                    raise JudgeAPIError(self.redact(error)) from None  # this prompt only (e.g. too long)
                tries += 1
                if tries == self.args.max_tries:
                    break
                self.stats["retries"] += 1
                await asyncio.sleep(self.backoff_s(tries - 1))  # never a blocking sleep in async code
            error = f"gave up after {self.args.max_tries} tries; last error {last_error}"
            if not self.answered:  # unreachable, stalled or failing since the start: no row would be judged
                # the last failure names what happened, when STOPPED knows it; a plain failure ("failed") does not
                stopped = what if what in self.STOPPED else "failed before answering any request"
                raise self.unavailable(stopped, error, self.STOPPED.get(what, "try again later, or raise --max_tries"))
            raise JudgeAPIError(self.redact(error))
        finally:
            if held:
                self.throttle.release()

    async def ask(self, prompt: str, parse_fn: Callable[[str], object]) -> Outcome:
        """Ask until parse_fn accepts the reply, at most --max_parse_tries times."""
        reply = ""
        endpoint = public_url(str(self.client.base_url))  # the URL actually asked (--base_url or the client's default)
        for ask_index in range(self.args.max_parse_tries):
            key = ReplyCache.key(self.args.model, endpoint, self.args.system_prompt, prompt, self.args.temperature,
                                 self.args.seed, ask_index)
            cached = self.cache.get(key)
            if cached is not None:
                self.stats["cache_hits"] += 1
                reply = cached
            else:
                try:
                    reply = await self.request(prompt)
                except JudgeAPIError as e:
                    self.stats["api_errors"] += 1
                    return Outcome("api_error", None, "", ask_index, str(e))
                self.cache.put(key, self.args.model, reply)
            parsed = parse_fn(reply)
            if parsed is not None:
                return Outcome("ok", parsed, reply, ask_index + 1)
            if ask_index + 1 < self.args.max_parse_tries:
                self.stats["reasks"] += 1
        return Outcome("unparseable", None, reply, self.args.max_parse_tries)

    async def ask_all(self, jobs: list[tuple[str, Callable[[str], object]]],
                      on_done: Callable[[int, Outcome], None]) -> list[Outcome]:
        """Run every (prompt, parse_fn) job concurrently; on_done(index, outcome) as each finishes."""

        async def run(i: int, prompt: str, parse_fn) -> tuple[int, Outcome]:
            outcome = await self.ask(prompt, parse_fn)
            self.done += outcome.status != "api_error"  # its replies are in the cache (an api_error is asked again)
            return i, outcome

        self.total = len(jobs)
        outcomes: list[Optional[Outcome]] = [None] * len(jobs)
        tasks = [asyncio.ensure_future(run(i, p, f)) for i, (p, f) in enumerate(jobs)]
        try:
            for next_done in asyncio.as_completed(tasks):
                i, outcome = await next_done
                outcomes[i] = outcome
                on_done(i, outcome)
            failed = [o for o in outcomes if o.status == "api_error"]
            if failed and len(failed) == len(outcomes):  # e.g. every prompt refused with a 400
                cause = f"all {len(failed)} failed; the first: {failed[0].error}"
                fix = "check --model, --temperature and the prompts it refuses"
                raise self.unavailable("refused every request", cause, fix)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # collect the cancelled ones (no "never retrieved")
            await self.client.close()
        return outcomes


def run_jobs(args, jobs: list[tuple[str, Callable[[str], object]]], on_done,
             cache: ReplyCache) -> tuple[list[Outcome], dict]:
    """Ask every (prompt, parse_fn) job with one Judge of `args`: the outcomes in the order of `jobs`, and the
    client's counts (requests, cache hits, retries, re-asks, failed requests, 429s received, and judging_s, the
    seconds spent)."""
    if not jobs:  # e.g. every pair a tie: nothing to ask
        return [], {"requests": 0, "cache_hits": 0, "retries": 0, "reasks": 0, "api_errors": 0, "rate_limited": 0,
                    "judging_s": 0.0}

    async def go():
        judge = Judge(args, cache)
        start = time.monotonic()
        outcomes = await judge.ask_all(jobs, on_done)
        judge.stats["judging_s"] = time.monotonic() - start  # the requests alone, without loading or plotting
        return outcomes, judge.stats

    return asyncio.run(go())


# ----------------------------------------------------------------------------------------------------------------------
# online_dpo.py --judge endpoint: the client's flags, the cache file around run_jobs, the main process's answer
# ----------------------------------------------------------------------------------------------------------------------
def endpoint_client_args(endpoint, seed: int, run_dir: str) -> tuple:
    """online_dpo.py's --endpoint.* flags and its --seed as the client reads them (args.model, args.seed, ...), and
    the reply cache's file: --endpoint.cache_path, or None -> {run_dir}/judge_cache.sqlite, so a resumed run asks
    nothing twice."""
    cache_path = endpoint.cache_path or os.path.join(run_dir, "judge_cache.sqlite")
    return SimpleNamespace(**asdict(endpoint), seed=seed), cache_path


def run_cached_jobs(args, jobs: list[tuple[str, Callable[[str], object]]],
                    cache_path: str) -> tuple[list[Outcome], dict]:
    """run_jobs with the reply cache at cache_path, opened for these jobs and closed after, whatever happens; the
    client's trouble (retries, failed requests) printed in one line (the caller counts the pairs it drops)."""
    cache = ReplyCache(cache_path)
    try:
        outcomes, stats = run_jobs(args, jobs, lambda i, outcome: None, cache)
    finally:
        cache.close()
    if stats["retries"] or stats["api_errors"]:
        print(f"judge: {stats['requests']} requests, {stats['retries']} retries, {stats['api_errors']} failed")
    return outcomes, stats


def on_main_process(accelerator, ask: Callable[[], object]):
    """ask() on the main process alone (one client, one cache file), its answer sent to every process. A judge that
    cannot be used at all (JudgeUnavailableError) stops every process with the same error."""
    from accelerate.utils import broadcast_object_list  # here: judge.py, which never calls this, runs without it

    payload = [(None, None)]  # (the answer, the error's text)
    if accelerator.is_main_process:
        try:
            payload = [(ask(), None)]
        except JudgeUnavailableError as error:
            payload = [(None, str(error))]
    answer, error = broadcast_object_list(payload)[0]
    if error is not None:
        raise JudgeUnavailableError(error)
    return answer
