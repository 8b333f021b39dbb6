"""Serving benchmark: sagelmi against vLLM's own OpenAI server, same model, same run.

    make bench          (or: python benchmarks/bench.py [--model DIR] [--levels 1,8,32,64,128] [--trials 5]
                                                        [--requests N] [--control])

Both servers are started one after the other (each one's start-up time to /ping 200 is measured
while the other is idle or not yet running), then both stay up. Before them an unmeasured vLLM
server is started and stopped, so that the caches every engine on the machine shares are warm for
both alike (``prime``). For each route and concurrency
level, trials of the two servers alternate A B B A A B ... so that whatever else the machine is
doing hits both alike; each trial is a fixed number of streamed requests, all asking for the same
number of tokens (``ignore_eos``) from the same prompt. The routes compared:

- ``/v1/completions`` on both servers (vLLM's serving code answers it in both, so the difference
  is what sits in front of the engine);
- ``/v1/chat/completions`` on both;
- LMI's ``/invocations`` (streamed) on sagelmi against ``/v1/completions`` on vLLM.

Per trial: output tokens/s, time to first token, gaps between streamed chunks, errors and the CPU
seconds of the server's whole process tree. Per route and level: the median over trials for each
server, and the ratio sagelmi / vLLM of the medians with a bootstrap 90% interval.

Writes docs/benchmarks/results.md (tables), results.json (with every trial) and results.png.

``--control`` runs the same method with vLLM's own server on both sides (an A/A run, on
``/v1/completions``), so the ratios should be 1.0: how far they and their intervals stray from 1.0
is what this benchmark can resolve on this machine. Writes control.md, control.json and control.png.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import http.client
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from bench_stats import bootstrap_ratio, median_or_none, percentile, trial_order

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "docs" / "benchmarks"
PROMPT = "The quick brown fox jumps over the lazy dog. Tell me a long story about the sea and the sky."
MAX_TOKENS = 64
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
ENGINE = {"max_num_seqs": "256", "gpu_memory_utilization": "0.5"}
# the same settings as sagelmi's environment, and the model name the bodies ask for
SAGELMI_OPTIONS = {**{f"OPTION_{k.upper()}": v for k, v in ENGINE.items()}, "OPTION_SERVED_MODEL_NAME": "bench"}
RESAMPLES, CONFIDENCE, SEED = 2000, 0.9, 0
# vLLM's engine worker busy-waits on its shared-memory queue for 1 s after its last step (the
# MessageQueue reader's busy_loop_s), at a whole core, and both servers' workers are bound to the
# same core: a trial started at once shared that core with the other server's idle spin for its
# first second (a fifth of a 1-stream trial). Each trial starts this long after the last one.
SETTLE_S = 1.5
# the per-server medians in the table; the ratio of the first three gets a bootstrap interval
METRICS = ("tokens_per_s", "ttft_p50_ms", "cpu_s_per_1k_tokens", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
           "engine_tokens_per_step")
RATIOS = METRICS[:3]

COMPLETION = {"model": "bench", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
              "stream": True, "stream_options": {"include_usage": True}}
CHAT = {"model": "bench", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
        "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
LMI = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": MAX_TOKENS, "ignore_eos": True}}
# LMI's stream gives each token's log-probability, so the engine computes it at every step; vLLM's
# side of that comparison asks for the same (the sampled token's, logprobs 0).
COMPLETION_WITH_LOGPROBS = {**COMPLETION, "logprobs": 0}


@dataclass(frozen=True)
class Comparison:
    """What a run compares: servers A and B of the trial order (ratios are A / B), and per route
    the (path, body, kind of stream) each is asked; ``stem`` names the files written."""
    servers: tuple[str, str]
    routes: dict[str, tuple[tuple[str, dict, str], tuple[str, dict, str]]]
    stem: str


MAIN = Comparison(("sagelmi", "vLLM"), {
    "/v1/completions": (("/v1/completions", COMPLETION, "completion"), ("/v1/completions", COMPLETION, "completion")),
    "/v1/chat/completions": (("/v1/chat/completions", CHAT, "chat"), ("/v1/chat/completions", CHAT, "chat")),
    "/invocations (LMI)": (("/invocations", LMI, "lmi"), ("/v1/completions", COMPLETION_WITH_LOGPROBS, "completion")),
}, "results")
# the A/A run: vLLM's own server against another of itself
CONTROL = Comparison(("vLLM A", "vLLM B"), {"/v1/completions": MAIN.routes["/v1/completions"]}, "control")


@dataclass
class Sample:
    ttft: float
    tokens: int
    gaps: list[float] = field(default_factory=list)


@dataclass
class Server:
    name: str
    port: int
    pid: int  # the server's first process: the CPU of its process tree is what a trial counts
    log: str
    process: subprocess.Popen | None = None  # None: a server the run attached to (--attach), not its own
    startup_s: float | None = None  # seconds to /ping 200 (None: attached)


def attach_servers(spec: str, names: tuple[str, ...] | list[str]) -> dict[str, Server]:
    """Servers already running, from ``--attach PORT:PID,PORT:PID`` (PID: the server's first process),
    named ``names`` in that order."""
    items = spec.split(",")
    if len(items) != len(names):
        raise SystemExit(f"--attach gives {len(items)} server(s); this run compares {len(names)}: {', '.join(names)}")
    servers = {}
    for name, item in zip(names, items):
        port, _, pid = item.partition(":")
        if not (port.isdigit() and pid.isdigit()):
            raise SystemExit(f"--attach: {item!r} is not PORT:PID")
        servers[name] = Server(name, int(port), int(pid), "")
    return servers


@dataclass
class Trial:
    server: str
    position: int  # place in the level's trial order, from 0
    requests: int
    errors: int
    seconds: float
    output_tokens: int
    tokens_per_s: float
    cpu_s: float
    cpu_s_per_1k_tokens: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    cpu_s_by_role: dict[str, float] = field(default_factory=dict)  # the CPU seconds by part (ROLES)
    engine_tokens_per_step: float | None = None  # how well the engine batched during the trial


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Each server in a process group of its own (stopped as one), in this session: where Linux shares CPU
# time between sessions (autogroup), a client in a session of its own waited, runnable, for the whole
# of a 64-token answer while the server's session spun (both servers alike, in some trials and not
# others), and time to first token measured the scheduler. One session is how a container runs.
OWN_GROUP: dict = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


def start_server(name: str, command: list[str], env: dict, port: int, timeout: float = 300,
                 cwd: Path = REPO) -> Server:
    """Start a server (in ``cwd``, by default this checkout) and wait for GET /ping to answer 200; the time
    that took is its start-up."""
    print(f"starting {name} ...", flush=True)
    log = tempfile.NamedTemporaryFile(prefix=f"bench-{name}-", suffix=".log", delete=False)
    started = time.monotonic()
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, **OWN_GROUP)
    server = Server(name, port, process.pid, log.name, process)
    while time.monotonic() - started < timeout:
        if process.poll() is not None:
            tail = "".join(Path(log.name).read_text(errors="replace").splitlines(keepends=True)[-20:])
            raise SystemExit(f"{name} exited with {process.returncode}; its log ends:\n{tail}")
        with contextlib.suppress(OSError):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/ping")
            if conn.getresponse().status == 200:
                server.startup_s = round(time.monotonic() - started, 2)
                print(f"  /ping 200 after {server.startup_s:.1f}s (log: {log.name})", flush=True)
                return server
        time.sleep(0.1)
    stop_server(server)
    raise SystemExit(f"{name} not ready after {timeout}s (log: {log.name})")


def stop_server(server: Server) -> None:
    if server.process is None:
        return  # attached: whoever started it stops it
    with contextlib.suppress(ProcessLookupError):  # a server that failed to start is gone already
        os.killpg(server.process.pid, signal.SIGTERM)
    try:
        server.process.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(server.process.pid, signal.SIGKILL)


# Which part of a server a process is, by its command line (first match), for the CPU split.
ROLES = (("engine worker", "VLLM::Worker"), ("engine core", "VLLM::EngineCore"), ("frontend", "gunicorn"),
         ("model worker", "container.worker"), ("API server", "api_server"))


def role_of(process: psutil.Process) -> str:
    command = " ".join(process.cmdline()) or process.name()
    return next((role for role, mark in ROLES if mark in command), "other")


def tree_cpu_by_role(pid: int) -> dict[str, float]:
    """User + system CPU seconds so far of a process and all its descendants, by role.

    Each live process counts its own time plus that of the children it has reaped
    (``children_user``/``children_system``), so a process that exits between two readings is
    still counted (in its parent's figures) and one that appears is counted from its start."""
    root = psutil.Process(pid)
    totals: dict[str, float] = {}
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):  # exited since listed: its parent reaps and counts it
            times = process.cpu_times()
            role = role_of(process)
            totals[role] = totals.get(role, 0.0) + times.user + times.system + times.children_user \
                + times.children_system
    return totals


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds so far of a process and all its descendants."""
    return sum(tree_cpu_by_role(pid).values())


def stream_request(port: int, path: str, body: dict, kind: str) -> Sample:
    """One streaming request; token arrival times come from the stream's lines."""
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    arrivals, usage_tokens = [], None
    for raw in response:
        line = raw.strip()
        if not line:
            continue
        if kind == "lmi":  # jsonlines, one token a line
            if b'"token"' in line:
                arrivals.append(time.perf_counter())
            continue
        if line == b"data: [DONE]":
            break
        event = json.loads(line[len(b"data: "):])
        if event.get("usage"):
            usage_tokens = event["usage"]["completion_tokens"]
        if event.get("choices"):
            choice = event["choices"][0]
            if choice.get("delta", {}).get("content") if kind == "chat" else choice.get("text"):
                arrivals.append(time.perf_counter())
    conn.close()
    tokens = usage_tokens or len(arrivals)
    if not arrivals or tokens != MAX_TOKENS:  # ignore_eos: anything else is a broken answer
        raise RuntimeError(f"{tokens} tokens received, {MAX_TOKENS} asked")
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return Sample(arrivals[0] - started, tokens, gaps)


def run_requests(port: int, path: str, body: dict, kind: str, concurrency: int,
                 count: int) -> tuple[list[Sample], float, int]:
    """``count`` requests, ``concurrency`` at a time: (answers, seconds, errors)."""
    errors = 0
    samples = []
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(stream_request, port, path, body, kind) for _ in range(count)]
        for future in futures:
            try:
                samples.append(future.result())
            except Exception as exc:  # counted and reported, never hidden
                print(f"  request failed: {exc}", file=sys.stderr)
                errors += 1
    return samples, time.perf_counter() - started, errors


def ms_percentile(values: list[float], q: float) -> float | None:
    return round(percentile(values, q) * 1000, 2) if values else None


# vLLM's histogram of tokens per engine step (prompt and output), on both servers' GET /metrics
STEP_TOKENS = "vllm:iteration_tokens_total"


def engine_steps(port: int) -> tuple[float, float]:
    """(steps, tokens) the engine has run so far, summed over its label sets."""
    return histogram(port, STEP_TOKENS)


def histogram(port: int, metric: str) -> tuple[float, float]:
    """(count, sum) of one of vLLM's histograms on a server's GET /metrics, over its label sets."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    totals = {"_count": 0.0, "_sum": 0.0}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        for suffix in totals:
            if name.startswith(metric + suffix):
                totals[suffix] += float(value)
    return totals["_count"], totals["_sum"]


def run_trial(server: Server, position: int, path: str, body: dict, kind: str, concurrency: int,
              count: int) -> Trial:
    steps_before = engine_steps(server.port)
    cpu_before = tree_cpu_by_role(server.pid)
    samples, seconds, errors = run_requests(server.port, path, body, kind, concurrency, count)
    cpu_after = tree_cpu_by_role(server.pid)
    steps, step_tokens = (after - before for after, before in zip(engine_steps(server.port), steps_before))
    cpu_roles = {role: round(cpu_after[role] - cpu_before.get(role, 0.0), 3) for role in cpu_after}
    cpu_s = sum(cpu_roles.values())
    tokens = sum(s.tokens for s in samples)
    ttfts = [s.ttft for s in samples]
    gaps = [g for s in samples for g in s.gaps]
    return Trial(server.name, position, count, errors, round(seconds, 3), tokens, round(tokens / seconds, 1),
                 round(cpu_s, 3), round(cpu_s / tokens * 1000, 4) if tokens else None,
                 ms_percentile(ttfts, 0.5), ms_percentile(ttfts, 0.99), ms_percentile(gaps, 0.5),
                 ms_percentile(gaps, 0.99), cpu_roles, round(step_tokens / steps, 1) if steps else None)


def cpu_split(trials: list[dict]) -> dict[str, float | None]:
    """Median over trials of each role's CPU seconds per 1,000 output tokens."""
    roles = sorted({role for t in trials for role in t["cpu_s_by_role"]})
    return {role: median_or_none([round(t["cpu_s_by_role"].get(role, 0.0) / t["output_tokens"] * 1000, 4)
                                  for t in trials if t["output_tokens"]]) for role in roles}


def summarise(names: tuple[str, str], route: str, concurrency: int, trials: list[Trial]) -> dict:
    """Medians over each server's trials and the A / B ratios with their intervals."""
    by_server = {name: [asdict(t) for t in trials if t.server == name] for name in names}
    servers = {name: {**{m: median_or_none([t[m] for t in ts]) for m in METRICS},
                      "trials": len(ts), "requests": sum(t["requests"] for t in ts),
                      "errors": sum(t["errors"] for t in ts), "cpu_s_per_1k_tokens_by_role": cpu_split(ts)}
               for name, ts in by_server.items()}
    ratios = {}
    for metric in RATIOS:
        a, b = ([t[metric] for t in by_server[name] if t[metric]] for name in names)
        ratios[metric] = [round(x, 4) for x in bootstrap_ratio(a, b, RESAMPLES, CONFIDENCE, SEED)] if a and b else None
    return {"route": route, "concurrency": concurrency, "servers": servers, "ratios": ratios,
            "trials": [asdict(t) for t in trials]}


def requests_per_trial(concurrency: int, requests: int | None = None) -> int:
    """``requests`` if given (``--requests``: a shorter, noisier run), else the default below."""
    if requests:
        return requests
    # Long enough (seconds, thousands of tokens) that a trial averages over the engine's swings
    # between steps that batch every stream and steps that run a few: shorter trials (2 x
    # streams, under a second) moved 2-5x between repeats on both servers.
    return max(8 * concurrency, 64)


def bench_level(run: Comparison, servers: dict[str, Server], route: str, concurrency: int, trials: int,
                requests: int | None) -> dict:
    asks = dict(zip(run.servers, run.routes[route]))
    for name in run.servers:  # warm-up, not measured: the engine compiles once per new batch shape
        path, body, kind = asks[name]
        run_requests(servers[name].port, path, body, kind, concurrency, concurrency)
    order = [run.servers[0] if x == "A" else run.servers[1] for x in trial_order(trials)]
    results = []
    for position, name in enumerate(order):
        time.sleep(SETTLE_S)
        results.append(run_trial(servers[name], position, *asks[name], concurrency,
                                 requests_per_trial(concurrency, requests)))
    level = summarise(run.servers, route, concurrency, results)
    s, v = (level["servers"][name] for name in run.servers)
    ratio = level["ratios"]["tokens_per_s"]
    print(f"  {route:22} c={concurrency:<3} tok/s {s['tokens_per_s']} / {v['tokens_per_s']}  "
          f"ratio {fmt_ratio(ratio)}  TTFT p50 {s['ttft_p50_ms']} / {v['ttft_p50_ms']} ms  "
          f"errors {s['errors']} / {v['errors']}", flush=True)
    return level


def fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def fmt_ratio(ratio: list[float] | None) -> str:
    return "–" if ratio is None else f"{ratio[0]:.2f} [{ratio[1]:.2f}, {ratio[2]:.2f}]"


def pair(level: dict, metric: str, digits: int = 1) -> str:
    return " / ".join(fmt(server[metric], digits) for server in level["servers"].values())


def targets(data: dict) -> list[str]:
    """The issue's targets, each reported as met or not (the benchmark asserts nothing)."""
    throughput = [lv["ratios"]["tokens_per_s"] for lv in data["results"]]
    ttft = [lv["ratios"]["ttft_p50_ms"] for lv in data["results"] if lv["concurrency"] in (1, 32)]
    startup = data["startup_s"]

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**not met**"

    return [
        f"- Throughput ratio >= 1.0 at every route and level: "
        f"{verdict(all(r and r[0] >= 1.0 for r in throughput))}",
        f"- Lower end of its 90% interval >= 0.95 at every route and level: "
        f"{verdict(all(r and r[1] >= 0.95 for r in throughput))}",
        "- TTFT p50 ratio <= 1.0 at 1 and 32 streams: "
        + (verdict(all(r and r[0] <= 1.0 for r in ttft)) if ttft else "not measured (levels 1 and 32 not run)"),
        "- Start-up to /ping 200 <= vLLM + 2 s: "
        + (f"{verdict(startup['sagelmi'] <= startup['vLLM'] + 2)} (sagelmi {startup['sagelmi']:.1f} s, "
           f"vLLM {startup['vLLM']:.1f} s)" if None not in startup.values() else "not measured (attached servers)"),
    ]


def route_tables(run: Comparison, data: dict) -> tuple[str, str]:
    """The markdown of the per-route tables, and of the CPU split by part of each server."""
    header = ("| streams | output tok/s | tok/s ratio [90% CI] | TTFT p50 ms | TTFT p50 ratio [90% CI] | TTFT p99 ms "
              "| inter-token p50 ms | inter-token p99 ms | CPU s / 1k tokens | CPU ratio [90% CI] | tokens / engine step "
              "| errors |")
    tables = []
    for route, (ask_a, ask_b) in run.routes.items():
        rows = [header, "|" + "---|" * 12]
        for lv in (lv for lv in data["results"] if lv["route"] == route):
            errors = " / ".join(str(server["errors"]) for server in lv["servers"].values())
            rows.append(f"| {lv['concurrency']} | {pair(lv, 'tokens_per_s', 0)} "
                        f"| {fmt_ratio(lv['ratios']['tokens_per_s'])} | {pair(lv, 'ttft_p50_ms')} | {fmt_ratio(lv['ratios']['ttft_p50_ms'])} "
                        f"| {pair(lv, 'ttft_p99_ms')} | {pair(lv, 'itl_p50_ms', 2)} | {pair(lv, 'itl_p99_ms', 2)} "
                        f"| {pair(lv, 'cpu_s_per_1k_tokens', 2)} | {fmt_ratio(lv['ratios']['cpu_s_per_1k_tokens'])} "
                        f"| {pair(lv, 'engine_tokens_per_step')} | {errors} |")
        title = f"`{route}`" + ("" if ask_b[0] == ask_a[0] else f" ({run.servers[1]}: `{ask_b[0]}` with `logprobs: 0`, "
                                                                "as LMI's stream gives each token's)")
        tables.append(f"### {title}\n\n" + "\n".join(rows))
    split_rows = ["| route | streams | server | " + " | ".join(role for role, _ in ROLES) + " | other |",
                  "|" + "---|" * (len(ROLES) + 4)]
    for lv in data["results"]:
        for name, server in lv["servers"].items():
            split = server.get("cpu_s_per_1k_tokens_by_role", {})
            split_rows.append(f"| `{lv['route']}` | {lv['concurrency']} | {name} | "
                              + " | ".join(fmt(split.get(role), 3) for role, _ in ROLES)
                              + f" | {fmt(split.get('other'), 3)} |")
    return (chr(10) * 2).join(tables), chr(10).join(split_rows)


def resolution(data: dict) -> list[str]:
    """Of an A/A run: how far the ratios of two identical servers strayed from 1.0."""
    lines = []
    for metric, label in (("tokens_per_s", "Throughput"), ("ttft_p50_ms", "TTFT p50"),
                          ("cpu_s_per_1k_tokens", "CPU per 1k tokens")):
        ratios = [lv["ratios"][metric] for lv in data["results"] if lv["ratios"][metric]]
        if not ratios:
            continue
        medians = [r[0] for r in ratios]
        lines.append(f"- {label} ratio: medians {min(medians):.2f}-{max(medians):.2f} over the levels; "
                     f"90% intervals from {min(r[1] for r in ratios):.2f} to {max(r[2] for r in ratios):.2f}; "
                     f"{sum(r[1] <= 1.0 <= r[2] for r in ratios)} of {len(ratios)} intervals hold 1.0")
    return lines


def per_trial(meta: dict) -> str:
    """How many requests a trial sent, in the words of the results' text."""
    return str(meta["requests_per_trial"]) if meta.get("requests_per_trial") else "max(64, 8 x streams)"


def write_results(run: Comparison, data: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{run.stem}.json").write_text(json.dumps(data, indent=2))
    meta = data["meta"]
    tables, split = route_tables(run, data)
    startup = data["startup_s"]
    if run is CONTROL:
        write_control(run, data, out, tables, split)
        return
    text = f"""# Serving benchmark

Generated by `make bench` (`benchmarks/bench.py`) on {meta['date']}: {meta['machine']}.
Model: the built-in tiny model (`sagelmi tiny-model`), vLLM {meta['vllm']} CPU build, engine settings
{meta['engine']} on both servers. Both servers run at once; for each route and level, {meta['trials']}
trials per server alternate (A B B A A B ...), each {per_trial(meta)} requests streaming {MAX_TOKENS}
tokens (`ignore_eos`, greedy, same prompt), after an unmeasured warm-up. Every cell with two numbers
is **sagelmi / vLLM**, each the median over that server's trials (percentiles are taken within a
trial). Ratios are sagelmi / vLLM of those medians, with a bootstrap 90% interval ({RESAMPLES} resamples
of each server's trials). CPU is user + system seconds of each server's whole process tree during its
trials (psutil), per 1,000 output tokens. Tokens per engine step (prompt and output tokens over
steps, from vLLM's `vllm:iteration_tokens_total` on each server's `GET /metrics`) tells how well the
engine batched: near the number of streams when every stream is in each step, a few when the engine
ran many small steps (requests reaching it one by one). The load generator (Python threads) runs on
the same machine, in the same session as both servers (one autogroup, as in a container).

- **vLLM** is vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`).
- **sagelmi** is `sagelmi serve` with the built-in vLLM handler: gunicorn + Flask frontend, a model
  worker process holding the engine, the worker protocol between them.

Start-up to `GET /ping` 200: sagelmi {fmt(startup['sagelmi'])} s, vLLM {fmt(startup['vLLM'])} s (started
one after the other, so neither loads while the other does, each from its own copy of the model, so
both compile the model's kernels cold: vLLM keys its compile cache by the model's path; an unmeasured
vLLM server started and stopped first ({fmt(meta.get('priming_s'))} s) warms what all engines share, the
page cache and inductor's precompiled headers, for both alike).

![sagelmi / vLLM throughput and TTFT ratios with 90% intervals](results.png)

{tables}

## Where the CPU goes

CPU seconds per 1,000 output tokens by part of each server (medians over trials): vLLM's engine
worker (`VLLM::Worker`, the model runner) and engine core (`VLLM::EngineCore`, the scheduler) in
both; vLLM's API server (HTTP, OpenAI serving, detokenising) against sagelmi's frontend (gunicorn +
Flask) and model worker (the handler with vLLM's OpenAI serving and `AsyncLLM`); "other" is
sagelmi's supervisor. The engine's processes wait for each other by spinning (`sched_yield`) for up
to a second, so their figures grow with the time a trial takes, not only with the work done.

{split}

## Targets (issue 11; reported, not asserted)

{chr(10).join(targets(data))}

The same method with vLLM on both sides (an A/A run) is in [control.md](control.md): the spread of
its ratios is what this benchmark can resolve on this machine. What we learned from these runs is
in [README.md](README.md).
"""
    (out / "results.md").write_text(text)
    plot(run, data, out)


def write_control(run: Comparison, data: dict, out: Path, tables: str, split: str) -> None:
    meta, (a, b) = data["meta"], run.servers
    text = f"""# A/A control: vLLM against vLLM

Generated by `make bench` (`benchmarks/bench.py --control`) on {meta['date']}: {meta['machine']}.
The method of [results.md](results.md) with vLLM's own server on both sides: two of them up at
once, each from its own copy of the tiny model, same engine settings ({meta['engine']}), vLLM
{meta['vllm']} CPU build; {meta['trials']} trials per server and level alternating A B B A ...,
each {per_trial(meta)} requests streaming {MAX_TOKENS} tokens on `/v1/completions`. Cells with
two numbers are **{a} / {b}**, medians over trials; ratios are {a} / {b} with a bootstrap 90%
interval. Both servers are the same program, so every ratio should be 1.0: how far the medians
and their intervals stray from it is what this benchmark can resolve here. A sagelmi / vLLM ratio
in results.md within that spread is not a difference this machine can show.

Start-up to `GET /ping` 200: {a} {fmt(data['startup_s'][a])} s, {b} {fmt(data['startup_s'][b])} s (after an
unmeasured server warmed the machine's shared caches, {fmt(meta.get('priming_s'))} s).

![{a} / {b} throughput and TTFT ratios with 90% intervals]({run.stem}.png)

## Resolution

{chr(10).join(resolution(data))}

{tables}

## Where the CPU goes

{split}
"""
    (out / f"{run.stem}.md").write_text(text)
    plot(run, data, out)


def plot(run: Comparison, data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({lv["concurrency"] for lv in data["results"]})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    a_b = " / ".join(run.servers)
    for axis, metric, title in ((axes[0], "tokens_per_s", f"Output tokens/s, {a_b}"),
                                (axes[1], "ttft_p50_ms", f"TTFT p50, {a_b} (lower is better)")):
        for offset, route in zip((0.94, 1.0, 1.06), run.routes):  # side by side, so the bars don't hide each other
            points = [(lv["concurrency"], lv["ratios"][metric]) for lv in data["results"]
                      if lv["route"] == route and lv["ratios"][metric]]
            if not points:
                continue
            x = [c * offset for c, _ in points]
            y = [r[0] for _, r in points]
            spread = [[r[0] - r[1] for _, r in points], [r[2] - r[0] for _, r in points]]
            axis.errorbar(x, y, yerr=spread, marker="o", capsize=3, label=route)
        axis.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [str(c) for c in levels])
        axis.set_xlabel("concurrent streams")
        axis.set_ylabel("ratio (median; bars: 90% interval)")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{run.stem}.png", dpi=110)


def model_dirs(names: list[str], model: str | None, workdir: Path) -> dict[str, Path]:
    """The model directory of each server: ``model`` for all (``--model``), else a copy of the tiny
    model each, written under ``workdir``. vLLM keys its compile cache by the model's path: with one
    directory, whichever server started first compiled the model's kernels and the others reused
    them (8-10 s faster to /ping 200); with a copy each, every server starts cold, as a container
    does."""
    if model:
        return dict.fromkeys(names, Path(model))
    dirs = {name: workdir / f"model-{index}" for index, name in enumerate(names)}
    first, *others = dirs.values()
    subprocess.run([sys.executable, "-m", "container", "tiny-model", str(first)], check=True, cwd=REPO,
                   capture_output=True)
    for other in others:
        shutil.copytree(first, other)
    return dirs


def start_vllm(name: str, model: Path, env: dict) -> Server:
    port = free_port()
    return start_server(
        name, [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "bench", "--port", str(port), "--max-num-seqs", ENGINE["max_num_seqs"],
               "--gpu-memory-utilization", ENGINE["gpu_memory_utilization"], "--disable-uvicorn-access-log"],
        env, port)


def prime(model: Path, env: dict) -> float:
    """Start and stop one unmeasured vLLM server, so that both measured start-ups find the machine's
    shared caches alike: the page cache holding torch's and vLLM's libraries, and inductor's
    precompiled C++ headers (/tmp/torchinductor_root), which the first engine on a fresh machine
    builds and every later one reuses. Without it the server started first on a fresh machine took
    10 s longer (69.1 against 58.5 s). The model's own compiled kernels stay cold for both: this
    server has a third copy of the model."""
    server = start_vllm("priming", model, env)
    stop_server(server)
    return server.startup_s


def start_sagelmi(name: str, model: Path, env: dict) -> Server:
    port = free_port()
    return start_server(
        name, [sys.executable, "-m", "container", "serve", "--model-dir", str(model), "--port", str(port)],
        {**env, **SAGELMI_OPTIONS}, port)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: write the tiny model to a temp dir)")
    parser.add_argument("--levels", default="1,8,32,64,128", help="concurrency levels (default 1,8,32,64,128)")
    parser.add_argument("--trials", type=int, default=5, help="trials per server per route and level (default 5)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where to write results (default docs/benchmarks)")
    parser.add_argument("--requests", type=int,
                        help="requests per trial (default max(64, 8 x concurrency); fewer: a shorter, noisier run)")
    parser.add_argument("--control", action="store_true",
                        help="vLLM against vLLM on /v1/completions (an A/A run): writes control.md/.json/.png")
    parser.add_argument("--replot", action="store_true", help="only rewrite the tables and plot from the .json")
    parser.add_argument("--attach", metavar="PORT:PID,PORT:PID",
                        help="measure two servers already running instead of starting them (sagelmi's then vLLM's; "
                        "with --control, the two vLLM servers); their start-up is not measured")
    args = parser.parse_args()
    out = Path(args.out)
    run = CONTROL if args.control else MAIN
    if args.replot:
        write_results(run, json.loads((out / f"{run.stem}.json").read_text()), out)
        return 0
    levels = [int(x) for x in args.levels.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="sagelmi-bench-"))
    servers: dict[str, Server] = attach_servers(args.attach, run.servers) if args.attach else {}
    priming_s = None
    try:
        if not servers:
            models = model_dirs([*run.servers, "priming"], args.model, workdir)
            env = {**os.environ, **ENGINE_ENV}
            priming_s = prime(models.pop("priming"), env)
            for name in run.servers:  # one after the other: neither loads while the other does
                start = start_sagelmi if name == "sagelmi" else start_vllm
                servers[name] = start(name, models[name], env)
        results = [bench_level(run, servers, route, concurrency, args.trials, args.requests)
                   for route in run.routes for concurrency in levels]
    finally:
        for server in servers.values():
            stop_server(server)
        shutil.rmtree(workdir, ignore_errors=True)
    import vllm

    meta = {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "vllm": vllm.__version__,
            "engine": "attached servers' own" if args.attach else ", ".join(f"{k}={v}" for k, v in ENGINE.items()),
            "max_tokens": MAX_TOKENS, "trials": args.trials,
            "requests_per_trial": args.requests, "resamples": RESAMPLES, "confidence": CONFIDENCE,
            "seed": SEED, "servers": list(run.servers), "priming_s": priming_s}
    data = {"meta": meta, "startup_s": {name: s.startup_s for name, s in servers.items()}, "results": results}
    write_results(run, data, out)
    print(f"wrote {out / run.stem}.md, {run.stem}.json and {run.stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
