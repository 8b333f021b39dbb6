"""Serving benchmark: sagelmi against vLLM's own OpenAI server, same model, same run.

    make bench          (or: python benchmarks/bench.py [--model DIR] [--levels 1,8,32,64])

Each server is started alone (the machine's cores are not shared between them), warmed up,
then loaded with streaming requests at several concurrency levels: the same
``/v1/completions`` body on both servers (vLLM's serving code answers it in both, so the
difference is what sits in front of the engine), plus LMI's schema on sagelmi's
``/invocations``. Every request asks for the same number of tokens (``ignore_eos``).

Writes docs/benchmarks/results.md (table), results.json and results.png (plot).
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
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "docs" / "benchmarks"
PROMPT = "The quick brown fox jumps over the lazy dog. Tell me a long story about the sea and the sky."
MAX_TOKENS = 64
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
ENGINE = {"max_num_seqs": "256", "gpu_memory_utilization": "0.5"}
REPEATS = 3  # runs per level; the table shows the median run and the spread


@dataclass
class Sample:
    ttft: float
    latency: float
    tokens: int
    gaps: list[float] = field(default_factory=list)


@dataclass
class Row:
    server: str
    route: str
    concurrency: int
    requests: int
    seconds: float
    output_tokens_per_s: float
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    itl_mean_ms: float
    latency_p50_ms: float
    latency_p95_ms: float
    errors: int
    tokens_per_s_min: float = 0.0
    tokens_per_s_max: float = 0.0

    @property
    def tokens_per_s_range(self) -> str:
        return f"{self.tokens_per_s_min:.0f}-{self.tokens_per_s_max:.0f}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, process: subprocess.Popen, path: str, log: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = "".join(Path(log).read_text(errors="replace").splitlines(keepends=True)[-20:])
            raise SystemExit(f"server on port {port} exited with {process.returncode}; its log ends:\n{tail}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server on port {port} not ready after {timeout}s")


def stream_request(port: int, path: str, body: dict, lmi: bool) -> Sample:
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
        if lmi:
            if b'"token"' in line:
                arrivals.append(time.perf_counter())
            continue
        if line == b"data: [DONE]":
            break
        event = json.loads(line[len(b"data: "):])
        if event.get("usage"):
            usage_tokens = event["usage"]["completion_tokens"]
        if event.get("choices") and event["choices"][0].get("text"):
            arrivals.append(time.perf_counter())
    conn.close()
    if not arrivals:
        raise RuntimeError("no tokens received")
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return Sample(arrivals[0] - started, time.perf_counter() - started, usage_tokens or len(arrivals), gaps)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_level(port: int, path: str, body: dict, lmi: bool, concurrency: int, count: int) -> tuple[list[Sample], float, int]:
    errors = 0
    samples = []
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(stream_request, port, path, body, lmi) for _ in range(count)]
        for future in futures:
            try:
                samples.append(future.result())
            except Exception as exc:  # counted and reported, never hidden
                print(f"  request failed: {exc}", file=sys.stderr)
                errors += 1
    return samples, time.perf_counter() - started, errors


def summarise(server: str, route: str, concurrency: int, samples: list[Sample], seconds: float,
              errors: int) -> Row:
    if not samples:
        raise SystemExit(f"{server} {route}: every request at concurrency {concurrency} failed")
    ttfts = [s.ttft * 1000 for s in samples]
    latencies = [s.latency * 1000 for s in samples]
    gaps = [g * 1000 for s in samples for g in s.gaps]
    return Row(server, route, concurrency, len(samples) + errors, round(seconds, 2),
               round(sum(s.tokens for s in samples) / seconds, 1), round(len(samples) / seconds, 2),
               round(percentile(ttfts, 0.5), 1), round(percentile(ttfts, 0.95), 1),
               round(statistics.mean(gaps), 2) if gaps else 0.0,
               round(percentile(latencies, 0.5), 1), round(percentile(latencies, 0.95), 1), errors)


WORKLOADS = {
    # name: (path, body, lmi?)
    "/v1/completions": ("/v1/completions", {"model": "bench", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                            "temperature": 0, "ignore_eos": True, "stream": True,
                                            "stream_options": {"include_usage": True}}, False),
    "/invocations (LMI)": ("/invocations", {"inputs": PROMPT, "stream": True, "parameters": {
        "max_new_tokens": MAX_TOKENS, "ignore_eos": True}}, True),
}


def bench_server(name: str, command: list[str], env: dict, ready_path: str, workloads: list[str],
                 levels: list[int], port: int) -> list[Row]:
    print(f"starting {name} ...", flush=True)
    log = tempfile.NamedTemporaryFile(prefix=f"bench-{name}-", suffix=".log", delete=False)
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               cwd=REPO)
    rows = []
    try:
        started = time.monotonic()
        wait_ready(port, process, ready_path, log.name)
        print(f"  ready in {time.monotonic() - started:.0f}s (log: {log.name})", flush=True)
        for workload in workloads:
            path, body, lmi = WORKLOADS[workload]
            for concurrency in levels:
                # warm-up at this level: the engine compiles once per new batch shape
                run_level(port, path, body, lmi, concurrency, concurrency)
                count = max(16, concurrency * 4)
                runs = [summarise(name, workload, concurrency, *run_level(port, path, body, lmi, concurrency, count))
                        for _ in range(REPEATS)]
                runs.sort(key=lambda r: r.output_tokens_per_s)
                row = runs[len(runs) // 2]  # the median run
                row.tokens_per_s_min, row.tokens_per_s_max = runs[0].output_tokens_per_s, runs[-1].output_tokens_per_s
                row.errors = sum(r.errors for r in runs)
                rows.append(row)
                print(f"  {workload:22} c={concurrency:<3} {row.output_tokens_per_s:8.1f} tok/s "
                      f"({row.tokens_per_s_range})  TTFT p50 {row.ttft_p50_ms:7.1f} ms  ITL {row.itl_mean_ms:6.2f} ms  "
                      f"errors {row.errors}", flush=True)
    finally:
        with contextlib.suppress(ProcessLookupError):  # a server that failed to start is gone already
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    return rows


def write_results(rows: list[Row], meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))
    meta.setdefault("repeats", REPEATS)
    header = ("| server | route | concurrency | requests | output tok/s | tok/s over 3 runs | req/s | TTFT p50 ms "
              "| TTFT p95 ms | inter-token ms | latency p50 ms | latency p95 ms | errors |")
    lines = [header, "|" + "---|" * 13]
    for r in rows:
        lines.append(f"| {r.server} | `{r.route}` | {r.concurrency} | {r.requests} | {r.output_tokens_per_s} | "
                     f"{r.tokens_per_s_range} | {r.requests_per_s} | {r.ttft_p50_ms} | {r.ttft_p95_ms} | "
                     f"{r.itl_mean_ms} | {r.latency_p50_ms} | {r.latency_p95_ms} | {r.errors} |")
    text = f"""# Serving benchmark

Generated by `make bench` (`benchmarks/bench.py`) on {meta['date']}: {meta['machine']}.
Model: the built-in tiny model (`sagelmi tiny-model`), vLLM {meta['vllm']} CPU build, engine settings
{meta['engine']} on both servers. Every request streams {MAX_TOKENS} tokens (`ignore_eos`), greedy, from
the same prompt. Each concurrency level is warmed up, then run {REPEATS} times with max(16, 4 x concurrency)
requests; the table shows the median run by throughput and the range over the runs. The servers run one
after the other, never together; the load generator (Python threads) runs on the same machine.

- **vLLM** is vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`).
- **sagelmi** is `sagelmi serve` with the built-in vLLM handler: gunicorn + Flask frontend, a model
  worker process holding the engine, the worker protocol between them.

![throughput and time to first token](results.png)

{chr(10).join(lines)}

Reading it: with a model this small the engine's own work is cheap, so the table mostly shows what
each server spends around the engine (HTTP, relaying, formatting) on {meta['cpus']} CPU cores that
also run the engine and the load generator. Runs of the same level vary a lot on both servers (see
the range column); compare ranges, not single numbers. What we learned from these runs is in
[README.md](README.md).
"""
    (out / "results.md").write_text(text)
    plot(rows, out)


def plot(rows: list[Row], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for server, route in sorted({(r.server, r.route) for r in rows}):
        series = sorted((r for r in rows if r.server == server and r.route == route), key=lambda r: r.concurrency)
        label = f"{server} {route}"
        x = [r.concurrency for r in series]
        y = [r.output_tokens_per_s for r in series]
        spread = [[v - r.tokens_per_s_min for v, r in zip(y, series)], [r.tokens_per_s_max - v for v, r in zip(y, series)]]
        left.errorbar(x, y, yerr=spread, marker="o", capsize=3, label=label)
        right.plot([r.concurrency for r in series], [r.ttft_p50_ms for r in series], marker="o", label=label)
    for axis, title, unit in ((left, "Output throughput (median run; bars: range)", "tokens/s"),
                              (right, "Time to first token (p50, median run)", "ms")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent streams")
        axis.set_ylabel(unit)
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "results.png", dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: write the tiny model to a temp dir)")
    parser.add_argument("--levels", default="1,8,32,64", help="concurrency levels (default 1,8,32,64)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where to write results (default docs/benchmarks)")
    parser.add_argument("--replot", action="store_true", help="only rewrite the table and plot from results.json")
    args = parser.parse_args()
    if args.replot:
        saved = json.loads((Path(args.out) / "results.json").read_text())
        write_results([Row(**r) for r in saved["rows"]], saved["meta"], Path(args.out))
        return 0
    levels = [int(x) for x in args.levels.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="sagelmi-bench-"))
    model = Path(args.model) if args.model else workdir / "tiny-model"
    if not args.model:
        subprocess.run([sys.executable, "-m", "container", "tiny-model", str(model)], check=True, cwd=REPO,
                       capture_output=True)
    env = {**os.environ, **ENGINE_ENV}
    rows: list[Row] = []
    try:
        port = free_port()
        sagelmi_env = {**env, **{f"OPTION_{k.upper()}": v for k, v in ENGINE.items()},
                       "OPTION_SERVED_MODEL_NAME": "bench"}
        rows += bench_server("sagelmi", [sys.executable, "-m", "container", "serve", "--model-dir", str(model),
                                         "--port", str(port)], sagelmi_env, "/ping",
                             ["/v1/completions", "/invocations (LMI)"], levels, port)
        port = free_port()
        rows += bench_server("vLLM", [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                      str(model), "--served-model-name", "bench", "--port", str(port),
                                      "--max-num-seqs", ENGINE["max_num_seqs"], "--gpu-memory-utilization",
                                      ENGINE["gpu_memory_utilization"], "--disable-uvicorn-access-log"],
                             env, "/health", ["/v1/completions"], levels, port)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    import vllm

    meta = {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "vllm": vllm.__version__, "engine": ", ".join(f"{k}={v}" for k, v in ENGINE.items()),
            "max_tokens": MAX_TOKENS, "levels": levels}
    write_results(rows, meta, Path(args.out))
    print(f"wrote {Path(args.out) / 'results.md'} and results.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
