"""One stream, round by round: sagelmi against vLLM's own server with the lightest client.

    python benchmarks/rounds.py [--rounds 8] [--requests 40] [--routes completions,lmi] [--baseline REF]
                                [--model DIR] [--out DIR]

``bench.py`` measures throughput over long trials with ``http.client``; this measures what one
stream's user sees (the time to the first token and to the stream's end) and what it costs
(CPU per request), with a client that costs as little as it can: a socket, and the bytes counted
as they come. The servers, all up at once on the tiny model with bench.py's engine settings:
sagelmi (this checkout), vLLM's OpenAI server, and with ``--baseline REF`` sagelmi of another
commit (``relay.py``'s worktree checkout), for a before and after of a change on the request path.

Each round sends ``--requests`` requests to each server, one after the other, a new connection
each (as bench.py's client makes), the servers' order reversed every round, ``SETTLE_S`` apart.
The routes (bench.py's bodies, 64 tokens): ``completions`` (``/v1/completions`` on both) and
``lmi`` (sagelmi's LMI ``/invocations`` against vLLM's ``/v1/completions`` with ``logprobs: 0``).
Per server and route: TTFT and the stream's end (p50 over all requests), CPU per request by
process (``bench.role_of``), and the mean TTFT at the client beside vLLM's own over the same
requests (``vllm:time_to_first_token_seconds``: from ``AsyncLLM.add_request`` to the first token's
output), whose difference is the request path's part, in and out, free of the engine's pace; per round, each sagelmi's TTFT median over vLLM's, and the median of
those ratios with the number of rounds below 1. Writes rounds.md, rounds.json and rounds.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import (
    COMPLETION,
    COMPLETION_WITH_LOGPROBS,
    DEFAULT_OUT,
    ENGINE_ENV,
    LMI,
    REPO,
    SAGELMI_OPTIONS,
    SETTLE_S,
    Server,
    attach_servers,
    free_port,
    histogram,
    model_dirs,
    start_server,
    start_vllm,
    tree_cpu_by_role,
)
from relay import checkout, sagelmi_command, tear_down, this_commit, tree_env

VLLM = "vLLM"
ENGINE_TTFT = "vllm:time_to_first_token_seconds"  # from AsyncLLM.add_request to the first token's output
END = b"\r\n0\r\n\r\n"  # a chunked body's end
# route -> (sagelmi's path, body, what starts each of its events; vLLM's path, body, the same)
ROUTES = {
    "completions": (("/v1/completions", COMPLETION, b'"text_completion"'),
                    ("/v1/completions", COMPLETION, b'"text_completion"')),
    "lmi": (("/invocations", LMI, b'"token"'), ("/v1/completions", COMPLETION_WITH_LOGPROBS, b'"text_completion"')),
}


def message(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def one(port: int, request: bytes, marker: bytes) -> tuple[float, float]:
    """One streamed request on a new connection: (seconds to its first event, to its end)."""
    started = time.perf_counter()
    first = 0.0
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(request)
        received = b""
        while not received.endswith(END):
            data = sock.recv(1 << 16)
            if not data:
                raise RuntimeError(f"connection closed after {received[:200]!r}")
            if not first and marker in received[-len(marker):] + data:
                first = time.perf_counter()
            received += data
    if not received.startswith(b"HTTP/1.1 200") or not first:
        raise RuntimeError(f"not a stream: {received[:200]!r}")
    return first - started, time.perf_counter() - started


def ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1000, 3)


def run_route(route: str, servers: dict[str, Server], rounds: int, requests: int) -> dict:
    asks = {name: ROUTES[route][1] if name == VLLM else ROUTES[route][0] for name in servers}
    made = {name: message(path, body) for name, (path, body, _) in asks.items()}
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in servers}
    cpu: dict[str, dict[str, float]] = {name: {} for name in servers}
    engine_ttft = {name: [0.0, 0.0] for name in servers}  # vLLM's own count and sum, over the rounds
    ratios: dict[str, list[float]] = {name: [] for name in servers if name != VLLM}
    order = list(servers)
    for name in order:  # warm-up, not measured
        for _ in range(5):
            one(servers[name].port, made[name], asks[name][2])
    for number in range(rounds):
        medians = {}
        for name in order if number % 2 == 0 else order[::-1]:
            time.sleep(SETTLE_S)
            engine_before = histogram(servers[name].port, ENGINE_TTFT)
            before = tree_cpu_by_role(servers[name].pid)
            got = [one(servers[name].port, made[name], asks[name][2]) for _ in range(requests)]
            after = tree_cpu_by_role(servers[name].pid)
            for i, value in enumerate(histogram(servers[name].port, ENGINE_TTFT)):
                engine_ttft[name][i] += value - engine_before[i]
            for role, seconds in after.items():
                cpu[name][role] = cpu[name].get(role, 0.0) + seconds - before.get(role, 0.0)
            samples[name] += got
            medians[name] = statistics.median(t for t, _ in got)
        for name in ratios:
            ratios[name].append(round(medians[name] / medians[VLLM], 4))
        print(f"  {route} round {number + 1}: TTFT p50 ms "
              + " / ".join(f"{name} {medians[name] * 1000:.2f}" for name in order), flush=True)
    result: dict = {"route": route, "servers": {}, "ttft_ratio_per_round": ratios, "ttft_ratio": {}}
    for name, got in samples.items():
        result["servers"][name] = {
            "requests": len(got), "ttft_p50_ms": ms([t for t, _ in got]), "end_p50_ms": ms([e for _, e in got]),
            "cpu_ms_per_request": round(sum(cpu[name].values()) / len(got) * 1000, 2),
            # the part of the time to the first token outside vLLM's own count (from add_request to
            # the first token's output): the request path, in and out, as means over the same requests
            "ttft_mean_ms": round(statistics.fmean(t for t, _ in got) * 1000, 3),
            "engine_ttft_mean_ms": round(engine_ttft[name][1] / engine_ttft[name][0] * 1000, 3)
            if engine_ttft[name][0] else None,
            "cpu_ms_per_request_by_role": {role: round(s / len(got) * 1000, 2) for role, s in sorted(cpu[name].items())},
        }
    for name, per_round in ratios.items():
        result["ttft_ratio"][name] = {"median": round(statistics.median(per_round), 4),
                                      "rounds_below_1": sum(r < 1 for r in per_round), "rounds": len(per_round)}
    return result


def write_results(data: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = data["meta"]
    lines = ["# One stream, round by round", "",
             f"`{meta['command']}` on {meta['date']} ({meta['machine']}, vLLM {meta['vllm']}; sagelmi is {meta['head']}): "
             f"{meta['rounds']} rounds of {meta['requests']} requests per server, a new connection each, the servers' "
             "order reversed every round; bench.py's bodies and engine settings (`benchmarks/rounds.py`).", ""]
    for result in data["results"]:
        lines += [f"## `{result['route']}`", "",
                  "| server | TTFT p50 ms | stream's end p50 ms | CPU per request ms | by process "
                  "| TTFT mean ms: at the client; vLLM's own; the request path's part |",
                  "|---|---|---|---|---|---|"]
        for name, s in result["servers"].items():
            roles = ", ".join(f"{role} {v}" for role, v in s["cpu_ms_per_request_by_role"].items())
            engine = s.get("engine_ttft_mean_ms")
            path = "" if engine is None else f"; {engine}; {round(s['ttft_mean_ms'] - engine, 3)}"
            lines.append(f"| {name} | {s['ttft_p50_ms']} | {s['end_p50_ms']} | {s['cpu_ms_per_request']} | {roles} "
                         f"| {s.get('ttft_mean_ms', '')}{path} |")
        lines.append("")
        for name, r in result["ttft_ratio"].items():
            lines.append(f"- TTFT {name} / {VLLM}, median of the rounds' ratios: {r['median']} "
                         f"(below 1 in {r['rounds_below_1']} of {r['rounds']} rounds)")
        lines.append("")
    (out / "rounds.md").write_text("\n".join(lines))
    (out / "rounds.json").write_text(json.dumps(data, indent=1) + "\n")
    plot(data, out)


def plot(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = data["results"]
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for axis, result in zip(axes[0], results):
        for name, per_round in result["ttft_ratio_per_round"].items():
            axis.plot(range(1, len(per_round) + 1), per_round, marker="o", label=f"{name} / {VLLM}")
        axis.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        axis.set_xlabel("round")
        axis.set_ylabel("TTFT median ratio (lower is better)")
        axis.set_title(f"{result['route']}: time to first token, 1 stream")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "rounds.png", dpi=110)


def start_sagelmi_at(name: str, tree: Path, model: Path, env: dict) -> Server:
    """``sagelmi serve`` of checkout ``tree`` with bench.py's engine settings."""
    port = free_port()
    command = [*sagelmi_command(tree), "serve", "--model-dir", str(model), "--port", str(port)]
    return start_server(name, command, tree_env(tree, {**env, **SAGELMI_OPTIONS}), port, cwd=tree)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="rounds (default 8)")
    parser.add_argument("--requests", type=int, default=40, help="requests per server per round (default 40)")
    parser.add_argument("--routes", default="completions,lmi", help="completions, lmi (default both)")
    parser.add_argument("--baseline", metavar="REF", help="also serve sagelmi of this git commit")
    parser.add_argument("--model", help="model directory, shared by every server (default: the tiny model, a copy each)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where to write results (default docs/benchmarks)")
    parser.add_argument("--attach", metavar="PORT:PID,PORT:PID",
                        help="measure two servers already running (sagelmi's then vLLM's) instead of starting them")
    args = parser.parse_args()
    if args.attach and args.baseline:
        raise SystemExit("--attach and --baseline: a baseline is a server this run starts")
    routes = args.routes.split(",")
    if unknown := set(routes) - set(ROUTES):
        raise SystemExit(f"--routes: {', '.join(sorted(unknown))} is not one of {', '.join(ROUTES)}")
    out = Path(args.out)
    workdir = Path(tempfile.mkdtemp(prefix="sagelmi-rounds-"))
    env = {**os.environ, **ENGINE_ENV}
    head = this_commit()
    trees = {"sagelmi": REPO}
    servers: dict[str, Server] = attach_servers(args.attach, ["sagelmi", VLLM]) if args.attach else {}
    try:
        if args.baseline:
            tree, commit = checkout(args.baseline, workdir)
            trees[f"sagelmi@{commit[:7]}"] = tree
        models = {} if servers else model_dirs([*trees, VLLM], args.model, workdir)
        for name, model in models.items():
            servers[name] = start_vllm(name, model, env) if name == VLLM else start_sagelmi_at(name, trees[name], model, env)
        results = [run_route(route, servers, args.rounds, args.requests) for route in routes]
    finally:
        tear_down(servers, trees, workdir)
    import vllm

    meta = {"date": datetime.date.today().isoformat(), "command": " ".join(["benchmarks/rounds.py", *sys.argv[1:]]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "vllm": vllm.__version__, "head": head, "servers": list(servers), "rounds": args.rounds,
            "requests": args.requests, "settle_s": SETTLE_S}
    write_results({"meta": meta, "results": results}, out)
    print(f"wrote {out / 'rounds.md'}, rounds.json and rounds.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
