"""Issue #12's bounded load test: 64 clients for 3 minutes against real vLLM (the tiny model), of whose
requests ~10% are streams the client drops after a few lines and ~5% malformed bodies. Every
well-formed request must get a complete answer, every malformed one a 4xx in its route's error
envelope; memory may not grow by 10% after warm-up, and the engine must be empty at the end.
The figures go to docs/reliability.md (scenario ``load``).

``SAGELMI_LOAD_SECONDS`` shortens the run for a quick local check; CI runs the full 180 s.
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import statistics
import threading
import time

import psutil
import pytest
import requests

from container.core.errors import is_anthropic_path, is_openai_path
from tests.reliability import record
from tests.server import RawStream, Server, metric, wait_idle

pytestmark = pytest.mark.slow

FULL_DURATION = 180  # seconds, as issue #12 asks; only a full run records its figures
DURATION = float(os.environ.get("SAGELMI_LOAD_SECONDS", FULL_DURATION))
CLIENTS = 64
SEED = 12
DROP_SHARE = 0.10  # streams whose client leaves after a few lines
MALFORMED_SHARE = 0.05
# Memory baseline: the samples of the last third of the warm-up. Under this load vLLM's worker takes
# more memory for a minute or two, then stays there; when depends on what the shared server served
# before. A leak keeps growing after.
WARM_UP = DURATION / 2
MEMORY_SAMPLE_SECONDS = 3
MAX_MEMORY_GROWTH = 0.10
REQUEST_TIMEOUT = 120  # seconds: a 2-core machine under 64 streams answers slowly, but answers
IDLE_TIMEOUT = 120
EXAMPLES_KEPT = 10
LONG_PROMPT_SHARE = 0.03

WORDS = ("the model server request stream token batch engine queue prompt answer quick brown fox jumps over "
         "lazy dog sea sky river mountain city one two three hello world please thank you red green blue "
         "light dark warm cold read write run serve send open close start stop begin end wait").split()

SESSION = "X-Amzn-SageMaker-Session-Id"
TITLE = "64 streams for 3 minutes, with clients that leave and clients that send garbage"


# -- the requests

def _prompt(rng: random.Random) -> str:
    """Mostly short; now and then past the engine's 2048-token step budget, so that its prefill is chunked."""
    words = rng.randint(1500, 3000) if rng.random() < LONG_PROMPT_SHARE else rng.randint(3, 200)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _sampling(rng: random.Random) -> dict:
    return {} if rng.random() < 0.5 else {"temperature": round(rng.uniform(0.3, 1.5), 2), "top_p": 0.9,
                                          "seed": rng.randint(0, 2**31)}


def _lmi(rng: random.Random, stream: bool, tokens: int, batch: int = 1) -> dict:
    sampling = _sampling(rng)
    parameters = {"max_new_tokens": tokens, "ignore_eos": True, "details": True}
    if sampling:
        parameters.update(do_sample=True, **sampling)
    inputs = _prompt(rng) if batch == 1 else [_prompt(rng) for _ in range(batch)]
    return {"inputs": inputs, "stream": stream, "parameters": parameters}


def _openai(rng: random.Random, chat: bool, stream: bool, tokens: int) -> dict:
    body = {"max_tokens": tokens, "ignore_eos": True, "stream": stream, **_sampling(rng)}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": _prompt(rng)}]
    else:
        body["prompt"] = _prompt(rng)
    return body


def _responses(rng: random.Random, stream: bool, tokens: int) -> dict:
    """OpenAI's Responses API (vLLM's extension ignore_eos: exactly the tokens asked)."""
    return {"input": [{"role": "user", "content": _prompt(rng)}], "max_output_tokens": tokens, "ignore_eos": True,
            "stream": stream, **_sampling(rng)}


def _messages(rng: random.Random, stream: bool, tokens: int) -> dict:
    """Anthropic's Messages API: no ignore_eos there, so an answer may end before the tokens asked."""
    sampling = {} if rng.random() < 0.5 else {"temperature": round(rng.uniform(0.3, 1.0), 2), "top_p": 0.9}
    return {"model": "tiny", "messages": [{"role": "user", "content": _prompt(rng)}], "max_tokens": tokens,
            "stream": stream, **sampling}


WELL_FORMED = {  # kind -> (path, make(rng, tokens) -> body, streamed, answers per request)
    "lmi": ("/invocations", lambda rng, n: _lmi(rng, False, n), False, 1),
    "lmi-batch": ("/invocations", lambda rng, n: _lmi(rng, False, n, batch=2), False, 2),
    "lmi-stream": ("/invocations", lambda rng, n: _lmi(rng, True, n), True, 1),
    "completions": ("/v1/completions", lambda rng, n: _openai(rng, False, False, n), False, 1),
    "completions-stream": ("/v1/completions", lambda rng, n: _openai(rng, False, True, n), True, 1),
    "chat": ("/v1/chat/completions", lambda rng, n: _openai(rng, True, False, n), False, 1),
    "chat-stream": ("/v1/chat/completions", lambda rng, n: _openai(rng, True, True, n), True, 1),
    # no tokens generated (0 answers to count): the tokenizer route, and a stateful session's life
    "tokenize": ("/tokenize", lambda rng, n: {"prompt": _prompt(rng)}, False, 0),
    "session": ("/invocations", lambda rng, n: _lmi(rng, False, n), False, 0),
    "responses": ("/v1/responses", lambda rng, n: _responses(rng, False, n), False, 1),
    "responses-stream": ("/v1/responses", lambda rng, n: _responses(rng, True, n), True, 1),
    "messages": ("/v1/messages", lambda rng, n: _messages(rng, False, n), False, 1),
    "messages-stream": ("/v1/messages", lambda rng, n: _messages(rng, True, n), True, 1),
}
# How often each kind is drawn, against 1 for the others: the Responses and Messages APIs are a small share
WEIGHTS = [0.25 if path in ("/v1/responses", "/v1/messages") else 1.0 for path, *_ in WELL_FORMED.values()]

DROPPED = {  # streams long enough to be running when their client leaves
    "lmi": ("/invocations", lambda rng, n: _lmi(rng, True, n)),
    "completions": ("/v1/completions", lambda rng, n: _openai(rng, False, True, n)),
    "chat": ("/v1/chat/completions", lambda rng, n: _openai(rng, True, True, n)),
}

_CHAT = [{"role": "user", "content": "hi"}]
_MULTIPART = "multipart/form-data; boundary=sagelmi"
_PARTS = b"".join(b'--sagelmi\r\nContent-Disposition: form-data; name="f%d"\r\n\r\nx\r\n' % i for i in range(2000))
MALFORMED = {  # kind -> (path, raw body[, content type]): each past a rule or a limit, answered 4xx
    "lmi-invalid-json": ("/invocations", b'{"inputs": "Hello", "parameters": {'),
    "lmi-inputs-number": ("/invocations", {"inputs": 5}),
    "lmi-seed-2^70": ("/invocations", {"inputs": "Hello", "parameters": {"seed": 2**70}}),
    "lmi-negative-tokens-stream": ("/invocations", {"inputs": "Hello", "stream": True,
                                                    "parameters": {"max_new_tokens": -3}}),
    "lmi-temperature-string": ("/invocations", {"inputs": "Hello", "parameters": {"do_sample": True,
                                                                                  "temperature": "hot"}}),
    "lmi-empty-body": ("/invocations", b""),
    "lmi-not-utf8": ("/invocations", b'\xff\xfe{"inputs": "\xc3\x28"}'),
    "lmi-deeply-nested": ("/invocations", b'{"inputs": "Hello", "parameters": {"x": ' + b"[" * 50_000
                          + b"]" * 50_000 + b"}}"),
    "completions-invalid-json": ("/v1/completions", b'{"prompt": "Hello", "max_tokens": 4'),
    "completions-tokens-string": ("/v1/completions", {"prompt": "Hello", "max_tokens": "many"}),
    "completions-tokens-2^70-stream": ("/v1/completions", {"prompt": "Hello", "max_tokens": 2**70, "stream": True}),
    "completions-a-list": ("/v1/completions", [1, 2, 3]),
    "chat-messages-string": ("/v1/chat/completions", {"messages": "hello", "max_tokens": 4}),
    "chat-negative-temperature": ("/v1/chat/completions", {"messages": _CHAT, "max_tokens": 4, "temperature": -1}),
    "chat-top-p-5-stream": ("/v1/chat/completions", {"messages": _CHAT, "max_tokens": 4, "top_p": 5,
                                                     "stream": True}),
    "tokenize-prompt-number": ("/tokenize", {"prompt": 5}),
    "embeddings-on-a-generation-model": ("/v1/embeddings", {"input": "hello"}),
    # past the limits a request may ask for (docs/security.md)
    "lmi-too-many-prompts": ("/invocations", {"inputs": ["Hello"] * 1025, "parameters": {"max_new_tokens": 1}}),
    "completions-too-many-prompts": ("/v1/completions", {"prompt": ["Hello"] * 1025, "max_tokens": 1}),
    "lmi-multipart": ("/invocations", _PARTS + b"--sagelmi--\r\n", _MULTIPART),
    "chat-media-io-kwargs": ("/v1/chat/completions", {"messages": _CHAT, "max_tokens": 4,
                                                      "media_io_kwargs": {"image": {"size": [1, 1]}}}),
    "responses-input-number": ("/v1/responses", {"input": 5}),
    "responses-negative-temperature-stream": ("/v1/responses", {"input": "hi", "temperature": -1, "stream": True}),
    "messages-no-max-tokens": ("/v1/messages", {"model": "tiny", "messages": _CHAT}),
}


class Tally:
    """Every outcome of the run, shared by the client threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: collections.Counter = collections.Counter()
        self.outcomes: collections.Counter = collections.Counter()
        self.unexpected: collections.Counter = collections.Counter()  # by class of request
        self.examples: list[str] = []
        self.kinds_of_error: collections.Counter = collections.Counter()  # (class/kind, start of the error)
        self.latencies: list[float] = []  # well-formed, not streamed
        self.tokens = 0  # delivered to well-formed requests
        self.dropped_asked = 0  # tokens the dropped streams asked for
        self.malformed_status: collections.Counter = collections.Counter()

    def ok(self, outcome: str, **extra) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            self.tokens += extra.get("tokens", 0)
            self.dropped_asked += extra.get("asked", 0)
            if "latency" in extra:
                self.latencies.append(extra["latency"])
            if "status" in extra:
                self.malformed_status[extra["status"]] += 1

    def bad(self, group: str, kind: str, what: str) -> None:
        with self.lock:
            self.unexpected[group] += 1
            self.kinds_of_error[f"{group}/{kind}: {what[:100]}"] += 1
            if len(self.examples) < EXAMPLES_KEPT:
                self.examples.append(f"{group}/{kind}: {what[:400]}")


def _sse_events(text: str) -> list[str]:
    # (split at "\n" only: str.splitlines also splits at U+2028, U+0085..., which JSON strings may hold unescaped)
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


def check_answer(kind: str, response: requests.Response, tokens: int) -> str | None:
    """What is wrong with a well-formed request's answer (None when nothing is)."""
    path, _, streamed, answers = WELL_FORMED[kind]
    if response.status_code != 200:
        return f"status {response.status_code}: {response.text[:300]}"
    if kind == "tokenize":
        body = response.json()
        ok = body.get("count") == len(body.get("tokens", [])) > 0
        return None if ok else f"not a tokenization: {response.text[:300]}"
    text = response.content.decode("utf-8")  # (requests would read a text/event-stream without charset as latin-1)
    if path in ("/v1/responses", "/v1/messages"):
        return _check_named_api(path, streamed, text, tokens)
    if path == "/invocations" and streamed:
        lines = [json.loads(line) for line in text.split("\n") if line.strip()]
        if not lines or "generated_text" not in lines[-1] or any("error" in line for line in lines):
            return f"stream did not end with generated_text: {text[-300:]}"
        got = sum("token" in line for line in lines)
        return None if got == tokens else f"{got} tokens streamed, asked {tokens}"
    if path == "/invocations":
        body = response.json()
        body = body if isinstance(body, list) else [body]
        if len(body) != answers or not all(isinstance(a.get("generated_text"), str) for a in body):
            return f"not {answers} answer(s) with generated_text: {text[:300]}"
        got = [a["details"]["generated_tokens"] for a in body]
        return None if got == [tokens] * answers else f"{got} tokens generated, asked {tokens}"
    if streamed:
        events = _sse_events(text)
        if not events or events[-1] != "[DONE]":
            return f"stream did not end with [DONE]: {text[-300:]}"
        objects = [json.loads(e) for e in events[:-1]]
        if any("error" in o for o in objects):
            return f"error event in the stream: {text[-300:]}"
        usage = [o["usage"] for o in objects if o.get("usage")]
        got = usage[-1]["completion_tokens"] if usage else None
        return None if got == tokens else f"usage says {got} completion tokens, asked {tokens}"
    body = response.json()
    choice = body["choices"][0]
    content = choice["message"]["content"] if path.endswith("chat/completions") else choice["text"]
    if not isinstance(content, str) or choice.get("finish_reason") != "length":
        return f"incomplete answer: {text[:300]}"
    got = body["usage"]["completion_tokens"]
    return None if got == tokens else f"usage says {got} completion tokens, asked {tokens}"


def _named_events(text: str) -> list[tuple[str, dict]]:
    """The (name, data) of each event of a Responses or Messages stream."""
    events = []
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        if "event" in lines:
            events.append((lines["event"], json.loads(lines.get("data", "null"))))
    return events


def _check_named_api(path: str, streamed: bool, text: str, tokens: int) -> str | None:
    """What is wrong with an answer of the Responses API (exactly ``tokens`` generated: ignore_eos) or of
    the Messages API (at most ``tokens``, fewer only when the model ended its turn)."""
    if streamed:
        events = _named_events(text)
        names = [name for name, _ in events]
        last = "response.completed" if path == "/v1/responses" else "message_stop"
        if not names or names[-1] != last or "error" in names:
            return f"stream did not end with {last}: {text[-300:]}"
        if path == "/v1/responses":
            body = events[-1][1]["response"]
        else:
            delta = [data for name, data in events if name == "message_delta"][-1]
            body = {"usage": delta["usage"], "stop_reason": delta["delta"]["stop_reason"]}
    else:
        body = json.loads(text)
    got = body["usage"]["output_tokens"]
    if path == "/v1/responses":
        return None if got == tokens and body.get("status") in ("completed", "incomplete") else \
            f"usage says {got} output tokens, asked {tokens} (status {body.get('status')})"
    ended = body.get("stop_reason")
    # (end_turn at the last token allowed is vLLM's order: an end-of-turn token stops before the length does)
    ok = (ended == "max_tokens" and got == tokens) or (ended == "end_turn" and got <= tokens)
    return None if ok else f"stop_reason {ended} with {got} output tokens, asked {tokens}"


def delivered(kind: str, response: requests.Response, tokens: int) -> int:
    """The tokens a well-formed request's (checked) answer carries: a Messages answer may end early."""
    path, _, streamed, answers = WELL_FORMED[kind]
    if path != "/v1/messages":
        return tokens * answers
    if not streamed:
        return response.json()["usage"]["output_tokens"]
    deltas = [data for name, data in _named_events(response.content.decode("utf-8")) if name == "message_delta"]
    return deltas[-1]["usage"]["output_tokens"]


def check_error(path: str, response: requests.Response) -> str | None:
    """What is wrong with a malformed request's answer: it must be a 4xx in the route's envelope."""
    if not 400 <= response.status_code < 500:
        return f"status {response.status_code}: {response.text[:300]}"
    try:
        body = response.json()
    except ValueError:
        return f"{response.status_code} not JSON: {response.text[:300]}"
    if is_anthropic_path(path):
        error = body.get("error") if isinstance(body, dict) else None
        if body.get("type") != "error" or not isinstance(error, dict) or not isinstance(error.get("message"), str) \
                or not isinstance(error.get("type"), str):
            return f"{response.status_code} not in Anthropic's envelope: {response.text[:300]}"
    elif is_openai_path(path):
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict) or not isinstance(error.get("message"), str) or \
                error.get("code") != response.status_code:
            return f"{response.status_code} not in OpenAI's envelope: {response.text[:300]}"
    elif not isinstance(body, dict) or body.get("code") != response.status_code or \
            not isinstance(body.get("message"), str) or not isinstance(body.get("error"), str):
        return f"{response.status_code} not in LMI's envelope: {response.text[:300]}"
    return None


def well_formed(server: Server, rng: random.Random, tally: Tally) -> None:
    kind = rng.choices(list(WELL_FORMED), WEIGHTS)[0]
    path, make, streamed, answers = WELL_FORMED[kind]
    tokens = rng.randint(16, 128)
    tally.sent[f"well-formed/{kind}"] += 1
    started = time.monotonic()
    got = tokens * answers
    try:
        if kind == "session":
            wrong = _session(server, make(rng, tokens), tokens)
        else:
            response = requests.post(server.url(path), json=make(rng, tokens), timeout=(30, REQUEST_TIMEOUT))
            wrong = check_answer(kind, response, tokens)
            got = delivered(kind, response, tokens) if wrong is None else 0
    except Exception as exc:  # a broken answer (bad JSON, missing field) or a failed connection
        wrong = f"{type(exc).__name__}: {exc}"
    if wrong:
        tally.bad("well-formed", kind, wrong)
        return
    tally.ok("well-formed ok", tokens=got, **({} if streamed else {"latency": time.monotonic() - started}))


def _session(server: Server, body: dict, tokens: int) -> str | None:
    """A stateful session's life: open it, one request in it, close it, a request in the closed one."""
    url, timeout = server.url("/invocations"), (30, REQUEST_TIMEOUT)
    opened = requests.post(url, json={"requestType": "NEW_SESSION"}, headers={SESSION: "NEW_SESSION"}, timeout=timeout)
    session = opened.headers.get("X-Amzn-SageMaker-New-Session-Id", "").split(";")[0].strip()
    if opened.status_code != 200 or not session:
        return f"NEW_SESSION: {opened.status_code} {dict(opened.headers)} {opened.text[:200]}"
    inside = requests.post(url, json=body, headers={SESSION: session}, timeout=timeout)
    wrong = check_answer("lmi", inside, tokens)
    if wrong:
        return f"in the session: {wrong}"
    closed = requests.post(url, json={"requestType": "CLOSE"}, headers={SESSION: session}, timeout=timeout)
    if closed.status_code != 200 or closed.headers.get("X-Amzn-SageMaker-Closed-Session-Id") != session:
        return f"CLOSE: {closed.status_code} {closed.text[:200]}"
    after = requests.post(url, json=body, headers={SESSION: session}, timeout=timeout)
    return None if after.status_code == 400 and session in after.text else f"closed session: {after.status_code}"


def malformed(server: Server, rng: random.Random, tally: Tally) -> None:
    kind = rng.choice(list(MALFORMED))
    path, body, *content_type = MALFORMED[kind]
    tally.sent[f"malformed/{kind}"] += 1
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        response = requests.post(server.url(path), data=data,
                                 headers={"Content-Type": content_type[0] if content_type else "application/json"},
                                 timeout=(30, REQUEST_TIMEOUT))
        wrong = check_error(path, response)
    except Exception as exc:
        wrong = f"{type(exc).__name__}: {exc}"
    if wrong:
        tally.bad("malformed", kind, wrong)
        return
    tally.ok("malformed 4xx", status=response.status_code)


def dropped(server: Server, rng: random.Random, tally: Tally) -> None:
    kind = rng.choice(list(DROPPED))
    path, make = DROPPED[kind]
    tokens = rng.randint(1000, 4000)
    tally.sent[f"dropped/{kind}"] += 1
    stream = None
    try:
        stream = RawStream(server.port, path, make(rng, tokens), timeout=REQUEST_TIMEOUT)  # a first line can take seconds
        lines = stream.read_lines(rng.randint(1, 5))
        if stream.response.status != 200 or not lines or any(b'"error"' in line for line in lines):
            wrong = f"status {stream.response.status}, first lines {lines[:3]}"
        else:
            wrong = None
    except Exception as exc:
        wrong = f"{type(exc).__name__}: {exc}"
    finally:
        if stream is not None:
            stream.close()
    if wrong:
        tally.bad("dropped", kind, wrong)
        return
    tally.ok("dropped stream", asked=tokens)


def client(server: Server, index: int, deadline: float, tally: Tally) -> None:
    rng = random.Random(SEED * 1000 + index)
    while time.monotonic() < deadline:
        draw = rng.random()
        if draw < DROP_SHARE:
            dropped(server, rng, tally)
        elif draw < DROP_SHARE + MALFORMED_SHARE:
            malformed(server, rng, tally)
        else:
            well_formed(server, rng, tally)


# -- memory of the server's process tree

def _label(process: psutil.Process) -> str:
    """A short name for a server process: vLLM titles its own (VLLM::EngineCore...), the rest are Python modules."""
    command = process.cmdline()
    if "-m" in command[:-1]:
        return command[command.index("-m") + 1]
    return process.name()


def tree_memory(root: int) -> dict[int, tuple[str, int, int]]:
    """PSS and RSS (bytes) of ``root`` and of each of its descendants, by pid. PSS shares a page mapped
    by several processes (fork, shared libraries) among them: the sum of PSS counts each page once."""
    parent = psutil.Process(root)
    found = {}
    for process in [parent, *parent.children(recursive=True)]:
        try:
            info = process.memory_full_info()
            found[process.pid] = (_label(process), info.pss, info.rss)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def total(sample: dict[int, tuple[str, int, int]]) -> int:
    return sum(pss for _, pss, _ in sample.values())


class MemorySampler(threading.Thread):
    def __init__(self, root: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.stop = stop
        self.started = time.monotonic()
        self.samples: list[tuple[float, dict[int, tuple[str, int, int]]]] = []  # (seconds, tree_memory)

    def run(self) -> None:
        while not self.stop.is_set():
            self.samples.append((time.monotonic() - self.started, tree_memory(self.root)))
            self.stop.wait(MEMORY_SAMPLE_SECONDS)

    def between(self, start: float, end: float) -> list[dict[int, tuple[str, int, int]]]:
        return [sample for seconds, sample in self.samples if start <= seconds <= end]


def growth_by_process(first: dict, last: dict) -> str:
    """How each process's PSS changed from ``first`` to ``last`` (MiB), largest change first."""
    changes = sorted(((last[pid][1] - first[pid][1], pid) for pid in first.keys() & last.keys()), reverse=True)
    return ", ".join(f"{first[pid][0]} ({pid}) {first[pid][1] >> 20}->{last[pid][1] >> 20}" for _, pid in changes)


def _mib(value: float) -> str:
    return f"{value / 2**20:.0f} MiB"


@pytest.mark.timeout(DURATION + 900)  # the session's server may start first (up to 240 s)
def test_64_streams_with_leaving_and_malformed_clients(vllm_server):
    server = vllm_server
    wait_idle(server)
    log_start = len(server.log())
    tokens_before = metric(server, "vllm:generation_tokens_total")
    pids_before = set(tree_memory(server.process.pid))
    tally = Tally()
    stop = threading.Event()
    sampler = MemorySampler(server.process.pid, stop)
    sampler.start()
    started = time.monotonic()
    deadline = started + DURATION
    threads = [threading.Thread(target=client, args=(server, i, deadline, tally), daemon=True)
               for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    give_up = deadline + REQUEST_TIMEOUT + 60  # a request sent just before the deadline may take its whole timeout
    for thread in threads:
        thread.join(max(give_up - time.monotonic(), 0))
    ended = time.monotonic()
    elapsed = ended - started
    stop.set()
    sampler.join(30)
    hung = sum(thread.is_alive() for thread in threads)
    wait_idle(server, IDLE_TIMEOUT)
    idle_after = time.monotonic() - ended
    unfinished = metric(server, "sagelmi_engine_unfinished_requests")
    generated = metric(server, "vllm:generation_tokens_total") - tokens_before
    ping = requests.get(server.url("/ping"), timeout=60).status_code
    idle = tree_memory(server.process.pid)
    pss_after, pids_after = total(idle), set(idle)
    log = server.log()[log_start:]

    # memory: the baseline is the end of the warm-up, the end the last tenth of the run
    warm = sampler.between(WARM_UP * 2 / 3, WARM_UP) or sampler.between(0, WARM_UP)[-1:]
    last = sampler.between(DURATION * 0.9, elapsed) or sampler.between(0, elapsed)[-3:]
    baseline = statistics.median(total(sample) for sample in warm) if warm else 0
    end = statistics.median(total(sample) for sample in last) if last else 0
    peak = max((total(sample) for sample in sampler.between(WARM_UP, elapsed)), default=0)
    by_process = growth_by_process(warm[-1], last[-1]) if warm and last else "no samples"
    growth = end / baseline - 1 if baseline else float("nan")
    server_statuses = collections.Counter(re.findall(r"(?:POST|GET) \S+ -> (\d{3})", log))
    server_errors = {status: count for status, count in server_statuses.items() if status.startswith("5")}

    requests_total = sum(tally.sent.values())
    by_group = collections.Counter()
    for key, count in tally.sent.items():
        by_group[key.split("/")[0]] += count
    latencies = sorted(tally.latencies)
    p50 = statistics.median(latencies) if latencies else float("nan")
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else float("nan")
    figures = {
        "duration": f"{elapsed:.0f} s ({DURATION:.0f} s of new requests)",
        "clients": CLIENTS,
        "requests": f"{requests_total} ({requests_total / elapsed:.1f}/s)",
        "well-formed": f"{by_group['well-formed']}: {tally.outcomes['well-formed ok']} complete, "
                       f"{tally.unexpected['well-formed']} unexpected errors",
        "malformed": f"{by_group['malformed']}: {tally.outcomes['malformed 4xx']} answered 4xx in the route's "
                     f"envelope ({', '.join(f'{s}: {c}' for s, c in sorted(tally.malformed_status.items()))}), "
                     f"{tally.unexpected['malformed']} unexpected",
        "dropped streams": f"{by_group['dropped']}: {tally.outcomes['dropped stream']} dropped after 1-5 lines, "
                           f"{tally.unexpected['dropped']} unexpected",
        "tokens delivered (well-formed)": f"{tally.tokens} ({tally.tokens / elapsed:.0f}/s)",
        "tokens generated (engine)": f"{generated:.0f} ({generated / elapsed:.0f}/s); for the dropped streams "
                                     f"{generated - tally.tokens:.0f} of the {tally.dropped_asked} they asked for",
        "latency, well-formed not streamed": f"p50 {p50:.2f} s, p99 {p99:.2f} s ({len(latencies)} requests)",
        "memory (PSS of the server's processes)": f"{_mib(baseline)} after {WARM_UP:.0f} s of warm-up, {_mib(end)} "
                                                  f"at the end ({100 * growth:+.1f}%), peak {_mib(peak)}, "
                                                  f"{_mib(pss_after)} idle after",
        "engine idle after the last client returned": f"{idle_after:.1f} s",
        "server 5xx, tracebacks, restarted processes": f"{sum(server_errors.values())}, "
                                                       f"{log.count('Traceback')}, {len(pids_before - pids_after)}",
    }
    summary = "\n".join(f"  {key}: {value}" for key, value in figures.items())
    print(f"\nload test:\n{summary}\n  requests by kind: {dict(sorted(tally.sent.items()))}\n"
          f"  memory samples (s, PSS MiB): {[(round(s), total(sample) >> 20) for s, sample in sampler.samples]}\n"
          f"  PSS MiB by process, end of warm-up -> end: {by_process}")
    if tally.examples:
        print("  examples of unexpected outcomes:\n    " + "\n    ".join(tally.examples))

    assert hung == 0, f"{hung} client threads still waiting {REQUEST_TIMEOUT + 60}s after the end"
    deaths = [line for line in log.splitlines() if "died" in line or "can no longer serve" in line][:4]
    commonest = tally.kinds_of_error.most_common(1)[0][0].replace("\n", " ") if tally.kinds_of_error else ""
    assert sum(tally.unexpected.values()) == 0, f"unexpected outcomes {dict(tally.unexpected)}, e.g. {commonest}; " \
        "the commonest:\n" + \
        "\n".join(f"{count} x {what}" for what, count in tally.kinds_of_error.most_common(12)) + \
        "\nexamples:\n" + "\n".join(tally.examples) + "\nthe server log says:\n" + "\n".join(deaths) + f"\n{summary}"
    assert by_group["well-formed"] and by_group["malformed"] and by_group["dropped"], summary
    assert unfinished == 0
    assert ping == 200
    assert not server_errors, f"5xx answers in the server log: {server_errors}"
    assert "Traceback" not in log, log[max(log.index("Traceback") - 2000, 0):][:6000]
    assert pids_after == pids_before, f"server processes changed: {pids_before} -> {pids_after}"
    assert baseline and growth < MAX_MEMORY_GROWTH, f"memory grew {100 * growth:.1f}% after warm-up; by " \
        f"process (MiB): {by_process}\n{summary}"
    if DURATION < FULL_DURATION:
        print(f"  (a {DURATION:.0f} s run: docs/reliability.md keeps the figures of a full one)")
        return
    record("load", TITLE, figures, note=(
        f"{CLIENTS} client threads, each looping over requests drawn by a seeded random generator: "
        f"{DROP_SHARE:.0%} streams (LMI, /v1/completions, /v1/chat/completions) asking 1000-4000 tokens whose "
        f"client closes the connection after 1-5 lines, {MALFORMED_SHARE:.0%} malformed bodies "
        f"({len(MALFORMED)} kinds: invalid JSON, wrong types, out-of-range numbers, an empty, a non-UTF-8 and a "
        f"deeply nested body; past the limits: 1,025 prompts, a multipart body, per-request media options), the rest well-formed requests of 16-128 tokens (ignore_eos) on the three routes, "
        f"and a small share on the Responses and Messages APIs (the Messages API has no ignore_eos), "
        f"streamed and not, greedy or sampled with a seed, {LONG_PROMPT_SHARE:.0%} of their prompts long enough "
        f"(2400-4800 tokens) for a chunked prefill, checked for a complete answer with exactly the tokens asked. "
        f"Memory is sampled every {MEMORY_SAMPLE_SECONDS} s over the server's whole process tree (supervisor, "
        f"frontend, model worker, vLLM's EngineCore and Worker); baseline and end are medians of the samples in the last "
        f"third of the warm-up and the last tenth of the run."))
