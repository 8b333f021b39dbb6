"""Relay benchmark: what sagelmi's request path costs with the engine taken away.

    make bench          (runs benchmarks/bench.py, then this)
    python benchmarks/relay.py [--levels 1,64,256] [--trials 5] [--tokens 256] [--baseline REF] [--out DIR]

A handler that streams pre-made token lines as fast as the event loop allows
(``benchmarks/relay_model/model.py``) is served three ways, all up at once:

- **sagelmi**: ``sagelmi serve`` with that ``model.py`` (gunicorn + Flask frontend, the worker
  protocol, the model worker's event loop): the relay as users run it;
- **gunicorn+Flask**: the same items from a Flask route in one gthread gunicorn worker, with as
  many threads as sagelmi's frontend, in-process (no worker hop): the floor of this stack;
- **asyncio**: the same items from a minimal HTTP/1.1 server on one asyncio loop;
- with ``--baseline REF``, **sagelmi@COMMIT**: ``sagelmi serve`` of another commit (checked out with
  ``git worktree add --detach`` into a temporary directory, removed afterwards), run by the same
  interpreter and packages with ``PYTHONPATH`` on that tree: the "before" of a before/after
  comparison of the relay (``make bench`` passes ``RELAY_BASELINE``).

For each level (concurrent streams) the trials rotate through the servers (every round runs each
once, the order shifted and reversed from round to round). A trial is ``max(2, 128 // streams)``
requests per connection (``16 // streams`` until issue 31: at 1 stream that was 4,096 items in tens of
milliseconds, and the kernel's 10 ms CPU clock tick made one trial's CPU per item uncertain by
about 2 µs per process), over ``streams`` keep-alive connections, each request streaming
``--tokens`` items. The client is one asyncio loop in this process that counts items in the raw
bytes. Per trial: items (chunks) per second at the client, and the CPU seconds of each server's
process tree per item, in all and by process (``bench.role_of``: for sagelmi the frontend, gunicorn's
master and worker, against the model worker, ``container.worker``, and the supervisor). Ratios sagelmi / floor (and sagelmi / sagelmi@COMMIT) of the medians come
with a bootstrap 90% interval.

Writes relay.md, relay.json and relay.png (next to results.md of benchmarks/bench.py).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import DEFAULT_OUT, REPO, fmt, fmt_ratio, free_port, start_server, stop_server, tree_cpu_by_role
from bench_stats import bootstrap_ratio, median_or_none, rotation

MODEL_DIR = Path(__file__).resolve().parent / "relay_model"
SERVERS = ("sagelmi", "gunicorn+Flask", "asyncio")  # with --baseline, a fourth: sagelmi@COMMIT
FLOOR = "gunicorn+Flask"
THREADS = 1000 + 32  # sagelmi's frontend threads with the default job_queue_size (container/frontend/server.py)
RESAMPLES, CONFIDENCE, SEED = 2000, 0.9, 0
HIGH_WATER = 1 << 16
ROLE_COLUMNS = ("frontend", "model worker", "other")  # bench.role_of's names; "other" is sagelmi serve itself


def load_model():
    spec = importlib.util.spec_from_file_location("relay_model", MODEL_DIR / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the two minimal servers (run as `relay.py serve-flask|serve-asyncio PORT`)

def serve_flask(port: int) -> None:
    from flask import Flask, Response, request
    from gunicorn.app.base import BaseApplication

    model = load_model()
    app = Flask("relay-floor")

    @app.get("/ping")
    def ping():
        return {"status": "Healthy"}

    @app.post("/invocations")
    def invocations():
        return Response(model.sync_tokens(model.token_count(request.get_data())), mimetype="application/jsonlines")

    class Floor(BaseApplication):
        def load_config(self):
            for key, value in {"bind": [f"127.0.0.1:{port}"], "workers": 1, "worker_class": "gthread",
                               "threads": THREADS, "worker_connections": THREADS + 256, "keepalive": 75,
                               "accesslog": None, "loglevel": "warning"}.items():
                self.cfg.set(key, value)

        def load(self):
            return app

    Floor().run()


def serve_asyncio(port: int) -> None:
    model = load_model()

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                length = next((int(line.split(":", 1)[1]) for line in lines[1:]
                               if line.lower().startswith("content-length:")), 0)
                body = await reader.readexactly(length) if length else b""
                if method == "GET" and path == "/ping":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 21\r\n\r\n"
                                 b'{"status": "Healthy"}')
                    continue
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/jsonlines\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                async for item in model.tokens(model.token_count(body)):
                    writer.write(b"%x\r\n%s\r\n" % (len(item), item))
                    if writer.transport.get_write_buffer_size() > HIGH_WATER:
                        await writer.drain()
                writer.write(b"0\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(connection, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# -- sagelmi from a checkout: this one, or another commit's (--baseline)

def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout.strip()


def checkout(ref: str, parent: Path) -> tuple[Path, str]:
    """A detached git worktree of ``ref`` under ``parent``: (its path, the commit)."""
    try:
        commit = git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except subprocess.CalledProcessError:
        raise SystemExit(f"--baseline {ref}: not a commit of {REPO} (make bench: RELAY_BASELINE= runs none)") from None
    tree = parent / f"sagelmi-{commit[:7]}"
    git("worktree", "add", "--detach", "--quiet", str(tree), commit)
    return tree, commit


def remove_checkout(tree: Path) -> None:
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
    shutil.rmtree(tree, ignore_errors=True)
    subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], capture_output=True)


def this_commit() -> str:
    """Which commit "sagelmi" (this checkout) is, as the results name it."""
    try:
        changed = git("status", "--porcelain", "--untracked-files=no", "--", "container", "handlers", "djl_python")
        return git("rev-parse", "--short", "HEAD") + (" + uncommitted changes" if changed else "")
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"


def tear_down(servers: dict, trees: dict[str, Path], workdir: Path) -> None:
    """Stop every server, remove the checkouts of other commits and the run's temporary directory."""
    for server in servers.values():
        stop_server(server)
    for tree in trees.values():
        if tree != REPO:
            remove_checkout(tree)
    shutil.rmtree(workdir, ignore_errors=True)


def sagelmi_command(tree: Path) -> list[str]:
    """What the ``sagelmi`` console script of ``tree`` runs (its pyproject.toml's [project.scripts]
    entry, module:function; the module moved between commits), run by this interpreter."""
    text = (tree / "pyproject.toml").read_text()
    scripts = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    module, function = re.search(r'^sagelmi\s*=\s*"([\w.]+):(\w+)"', scripts, re.M).groups()
    return [sys.executable, "-c", f"import sys; from {module} import {function}; sys.argv[0] = 'sagelmi'; "
            f"sys.exit({function}())"]


def tree_env(tree: Path, env: dict) -> dict:
    """``env`` with sagelmi's packages imported from ``tree``, checked: the venv's editable install
    points at one checkout, and a server of another commit must not import a module from it."""
    env = {**env, "PYTHONPATH": str(tree)}
    found = subprocess.run([sys.executable, "-c", "import container, djl_python, handlers\n"
                            "for m in (container, djl_python, handlers): print(m.__file__)"],
                           env=env, cwd=tree, check=True, capture_output=True, text=True).stdout.split()
    if not all(Path(f).resolve().is_relative_to(tree.resolve()) for f in found):
        raise SystemExit(f"sagelmi's packages for {tree} were imported from elsewhere: {found}")
    return env


# -- the client

class Broken(Exception):
    pass


async def stream_requests(port: int, requests: int, tokens: int, marker: bytes) -> tuple[int, int]:
    """``requests`` streamed requests, one after the other on one keep-alive connection:
    (items received, errors)."""
    body = json.dumps({"tokens": tokens, "stream": True}).encode()  # as an LMI client asks for a stream
    message = (b"POST /invocations HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    items = errors = 0
    try:
        for _ in range(requests):
            writer.write(message)
            try:
                items += await read_stream(reader, tokens, marker)
            except Broken as exc:
                print(f"  request failed: {exc}", file=sys.stderr)
                errors += 1
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
    finally:
        writer.close()
    return items, errors


async def read_stream(reader: asyncio.StreamReader, tokens: int, marker: bytes) -> int:
    """Read one chunked answer of ``tokens`` items; count them by their marker."""
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise Broken(head.split(b"\r\n", 1)[0].decode("latin-1"))
    seen, tail, keep = 0, b"", len(marker) - 1
    while True:
        data = await reader.read(1 << 16)
        if not data:
            raise Broken(f"connection closed after {seen} of {tokens} items")
        window = tail + data
        seen += window.count(marker)
        tail = window[-max(keep, 5):]
        if seen >= tokens and window.endswith(b"0\r\n\r\n"):
            if seen != tokens:
                raise Broken(f"{seen} items received, {tokens} asked")
            return seen


async def run_load(port: int, streams: int, requests_each: int, tokens: int, marker: bytes) -> tuple[int, int, float]:
    started = time.perf_counter()
    results = await asyncio.gather(*(stream_requests(port, requests_each, tokens, marker) for _ in range(streams)))
    return sum(r[0] for r in results), sum(r[1] for r in results), time.perf_counter() - started


def trial(server, streams: int, tokens: int, marker: bytes) -> dict:
    requests_each = max(2, 128 // streams)
    cpu_before = tree_cpu_by_role(server.process.pid)
    items, errors, seconds = asyncio.run(run_load(server.port, streams, requests_each, tokens, marker))
    cpu_after = tree_cpu_by_role(server.process.pid)
    by_role = {role: cpu_after[role] - cpu_before.get(role, 0.0) for role in cpu_after}
    return {"server": server.name, "streams": streams, "requests": streams * requests_each, "errors": errors,
            "items": items, "seconds": round(seconds, 3), "items_per_s": round(items / seconds, 1),
            "cpu_us_per_item": round(sum(by_role.values()) / items * 1e6, 2) if items else None,
            "cpu_us_per_item_by_role": {role: round(cpu / items * 1e6, 2) for role, cpu in sorted(by_role.items())}
            if items else {}}


def summarise(streams: int, trials: list[dict], names: tuple[str, ...] = SERVERS) -> dict:
    by_server = {name: [t for t in trials if t["server"] == name] for name in names}
    servers = {name: {"items_per_s": median_or_none([t["items_per_s"] for t in ts]),
                      "cpu_us_per_item": median_or_none([t["cpu_us_per_item"] for t in ts]),
                      "cpu_us_per_item_by_role": {role: median_or_none([t.get("cpu_us_per_item_by_role", {}).get(role)
                                                                        for t in ts])
                                                  for role in sorted({r for t in ts
                                                                      for r in t.get("cpu_us_per_item_by_role", {})})},
                      "errors": sum(t["errors"] for t in ts), "trials": len(ts)} for name, ts in by_server.items()}
    ratios = {}
    for other in names[1:]:
        for metric in ("items_per_s", "cpu_us_per_item"):
            a = [t[metric] for t in by_server["sagelmi"] if t[metric]]
            b = [t[metric] for t in by_server[other] if t[metric]]
            ratios[f"{metric} vs {other}"] = ([round(x, 4) for x in bootstrap_ratio(a, b, RESAMPLES, CONFIDENCE, SEED)]
                                              if a and b else None)
    return {"streams": streams, "servers": servers, "ratios": ratios, "trials": trials}


def write_results(data: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "relay.json").write_text(json.dumps(data, indent=2))
    meta = data["meta"]
    names = tuple(meta.get("servers", SERVERS))
    base = meta.get("baseline")
    head = f"HEAD / {base['name']}" if base else ""
    vs_base = f"vs {base['name']}" if base else ""
    rows = ["| streams | items/s: " + " / ".join(names) + " | sagelmi / floor [90% CI] | sagelmi / asyncio [90% CI] "
            + (f"| items/s {head} [90% CI] " if base else "")
            + "| CPU µs per item: " + " / ".join(names) + " | CPU sagelmi / floor [90% CI] "
            + (f"| CPU {head} [90% CI] " if base else "") + "| errors |",
            "|" + "---|" * (9 if base else 7)]
    for lv in data["results"]:
        s, r = lv["servers"], lv["ratios"]
        rows.append(f"| {lv['streams']} | " + " / ".join(fmt(s[n]['items_per_s'], 0) for n in names)
                    + f" | {fmt_ratio(r[f'items_per_s vs {FLOOR}'])} | {fmt_ratio(r['items_per_s vs asyncio'])} | "
                    + (f"{fmt_ratio(r[f'items_per_s {vs_base}'])} | " if base else "")
                    + " / ".join(fmt(s[n]['cpu_us_per_item'], 1) for n in names)
                    + f" | {fmt_ratio(r[f'cpu_us_per_item vs {FLOOR}'])} | "
                    + (f"{fmt_ratio(r[f'cpu_us_per_item {vs_base}'])} | " if base else "")
                    + " / ".join(str(s[n]["errors"]) for n in names) + " |")
    sagelmis = [n for n in names if n.startswith("sagelmi")]
    role_rows = ["| streams | " + " | ".join(f"{n}: frontend / model worker / supervisor" for n in sagelmis) + " |",
                 "|---|" + "---|" * len(sagelmis)]
    for lv in data["results"]:
        cells = []
        for n in sagelmis:
            by_role = lv["servers"][n].get("cpu_us_per_item_by_role") or {}
            cells.append(" / ".join(fmt(by_role.get(role), 2) for role in ROLE_COLUMNS))
        role_rows.append(f"| {lv['streams']} | " + " | ".join(cells) + " |")
    at64 = next((lv for lv in data["results"] if lv["streams"] == 64), None)
    verdict = ("not measured (level 64 not run)" if at64 is None else
               ("**met**" if (at64["ratios"][f"items_per_s vs {FLOOR}"] or [0])[0] >= 0.8 else "**not met**")
               + f" ({fmt_ratio(at64['ratios'][f'items_per_s vs {FLOOR}'])})")
    targets = [f"- Relay capacity >= 0.8x the gunicorn + Flask floor at 64 streams (issue 11): {verdict}"]
    targets += issue31_targets(data["results"])
    fourth = ""
    if base:
        ratios = {lv["streams"]: lv["ratios"][f"items_per_s vs {base['name']}"] for lv in data["results"]}
        met = all(r and r[2] >= 1.0 for r in ratios.values())
        targets.append(f"- Relay at HEAD no slower than before (issue 24, `--baseline {base['ref']}`): the interval of "
                       f"items/s {head} includes or exceeds 1.0 at every level: {'**met**' if met else '**not met**'} ("
                       + "; ".join(f"{n} streams {fmt_ratio(r)}" for n, r in ratios.items()) + ")")
        fourth = (f" The fourth, **{base['name']}**, is `sagelmi serve` of commit {base['commit']} (`--baseline "
                  f"{base['ref']}`), from a temporary git worktree, with the same interpreter and packages and the "
                  f"same `model.py`: the relay before, against HEAD (here {meta['head']}).")
    text = f"""# Relay benchmark

Generated by `make bench` (`benchmarks/relay.py`) on {meta['date']}: {meta['machine']}.
No engine: a handler streams {meta['tokens']} pre-made token lines of {meta['item_bytes']} bytes per request
as fast as the event loop allows (`benchmarks/relay_model/model.py`), served by **sagelmi**
(`sagelmi serve` with that `model.py`: frontend, worker protocol, model worker), by the same
items from a Flask route in one gthread gunicorn worker with sagelmi's thread count
(**gunicorn+Flask**, in-process: the floor of this stack) and by a minimal HTTP/1.1 server on
one **asyncio** loop.{fourth} All {len(names)} are up at once; {meta['trials']} trials per server and level,
in rotating order. Cells list the servers' medians over their trials. Items per second are
counted at the client (one asyncio loop in the benchmark's process, on the same cores); CPU is
user + system time of each server's whole process tree per item. Ratios are of medians, with a
bootstrap 90% interval ({RESAMPLES} resamples).

![items per second by server and level](relay.png)

{chr(10).join(rows)}

CPU µs per item by process (medians over the trials; the supervisor is `sagelmi serve` itself):

{chr(10).join(role_rows)}

## Targets (reported, not asserted)

{chr(10).join(targets)}

What we learned from these runs is in [README.md](README.md).
"""
    (out / "relay.md").write_text(text)
    plot(data, out)


def issue31_targets(results: list[dict]) -> list[str]:
    """Issue 31's targets: items/s >= 1.0x the floor at 1 and 64 streams, CPU per item <= 1.2x at 1 stream."""
    by_level = {lv["streams"]: lv["ratios"] for lv in results}
    lines = []
    for streams in (1, 64):
        ratio = by_level.get(streams, {}).get(f"items_per_s vs {FLOOR}")
        verdict = "not measured" if ratio is None else ("**met**" if ratio[0] >= 1.0 else "**not met**")
        lines.append(f"- Items/s >= 1.0x the floor at {streams} stream(s) (issue 31): {verdict} ({fmt_ratio(ratio)})")
    ratio = by_level.get(1, {}).get(f"cpu_us_per_item vs {FLOOR}")
    verdict = "not measured" if ratio is None else ("**met**" if ratio[0] <= 1.2 else "**not met**")
    lines.append(f"- CPU per item <= 1.2x the floor's at 1 stream (issue 31): {verdict} ({fmt_ratio(ratio)})")
    return lines


def plot(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [lv["streams"] for lv in data["results"]]
    names = data["meta"].get("servers", SERVERS)
    base = data["meta"].get("baseline")
    fig, axes = plt.subplots(1, 3 if base else 2, figsize=(16 if base else 11, 4.2))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        x = [j + (i - (len(names) - 1) / 2) * width for j in range(len(levels))]
        axes[0].bar(x, [lv["servers"][name]["items_per_s"] for lv in data["results"]], width, label=name)
        axes[1].bar(x, [lv["servers"][name]["cpu_us_per_item"] for lv in data["results"]], width, label=name)
    for axis, title in ((axes[0], "Items (chunks) per second, median"),
                        (axes[1], "CPU µs per item, server process tree (lower is better)")):
        axis.set_xticks(range(len(levels)), [str(c) for c in levels])
        axis.set_xlabel("concurrent streams")
        axis.set_title(title)
        axis.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    if base:
        for k, (metric, label) in enumerate((("items_per_s", "items/s"), ("cpu_us_per_item", "CPU µs per item"))):
            ratios = [lv["ratios"][f"{metric} vs {base['name']}"] for lv in data["results"]]
            x = [j + (k - 0.5) * 0.2 for j in range(len(levels))]
            spread = [[r[0] - r[1] for r in ratios], [r[2] - r[0] for r in ratios]]
            axes[2].errorbar(x, [r[0] for r in ratios], yerr=spread, fmt="o", capsize=4, label=label)
        axes[2].axhline(1.0, color="grey", linestyle="--", linewidth=1)
        axes[2].set_xticks(range(len(levels)), [str(c) for c in levels])
        axes[2].set_xlabel("concurrent streams")
        axes[2].set_title(f"sagelmi HEAD / {base['name']}, median [90% CI]")
        axes[2].grid(True, axis="y", alpha=0.3)
        axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "relay.png", dpi=110)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] in ("serve-flask", "serve-asyncio"):
        (serve_flask if sys.argv[1] == "serve-flask" else serve_asyncio)(int(sys.argv[2]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,64,256", help="concurrent streams (default 1,64,256)")
    parser.add_argument("--trials", type=int, default=5, help="trials per server and level (default 5)")
    parser.add_argument("--tokens", type=int, default=256, help="items streamed per request (default 256)")
    parser.add_argument("--baseline", metavar="REF", help="also serve the relay with sagelmi of this git commit "
                        "(the before of a before/after comparison; make bench: RELAY_BASELINE)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where to write results (default docs/benchmarks)")
    parser.add_argument("--replot", action="store_true", help="only rewrite the table and plot from relay.json")
    args = parser.parse_args()
    out = Path(args.out)
    if args.replot:
        write_results(json.loads((out / "relay.json").read_text()), out)
        return 0
    model = load_model()
    workdir = Path(tempfile.mkdtemp(prefix="sagelmi-relay-"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    me = [sys.executable, str(Path(__file__).resolve())]
    names, servers, baseline = SERVERS, {}, None
    head = this_commit()  # relay.md names it when it compares with a baseline
    # each sagelmi's checkout, where its server starts (its own copy of model.py each)
    trees = {"sagelmi": REPO}
    try:
        if args.baseline:
            tree, commit = checkout(args.baseline, workdir)
            baseline = {"ref": args.baseline, "commit": commit, "name": f"sagelmi@{commit[:7]}"}
            names = (*SERVERS, baseline["name"])
            trees[baseline["name"]] = tree
        commands = {FLOOR: [*me, "serve-flask"], "asyncio": [*me, "serve-asyncio"]}
        for name in names:
            port = free_port()
            if name in commands:
                servers[name] = start_server(name, commands[name] + [str(port)], env, port)
                continue
            tree = trees[name]
            model_dir = workdir / f"model-{len(servers)}"
            model_dir.mkdir()
            shutil.copy(MODEL_DIR / "model.py", model_dir / "model.py")
            command = [*sagelmi_command(tree), "serve", "--model-dir", str(model_dir), "--port", str(port)]
            servers[name] = start_server(name, command, tree_env(tree, env), port, cwd=tree)
        results = []
        for streams in (int(x) for x in args.levels.split(",")):
            for name in names:  # warm-up, not measured
                trial(servers[name], streams, args.tokens, model.MARKER)
            trials = [trial(servers[name], streams, args.tokens, model.MARKER) for name in rotation(names, args.trials)]
            level = summarise(streams, trials, names)
            s, r = level["servers"], level["ratios"]
            print(f"  streams={streams:<4} items/s " + " / ".join(fmt(s[n]['items_per_s'], 0) for n in names)
                  + f"  sagelmi/floor {fmt_ratio(r[f'items_per_s vs {FLOOR}'])}"
                  + (f"  HEAD/{names[-1]} {fmt_ratio(r[f'items_per_s vs {names[-1]}'])}" if baseline else "")
                  + "  CPU µs/item " + " / ".join(fmt(s[n]['cpu_us_per_item'], 1) for n in names)
                  + "  sagelmi's by process " + " / ".join(
                      f"{role} {fmt(s['sagelmi']['cpu_us_per_item_by_role'].get(role), 2)}" for role in ROLE_COLUMNS),
                  flush=True)
            results.append(level)
    finally:
        tear_down(servers, trees, workdir)
    meta = {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "command": " ".join(["benchmarks/relay.py", *sys.argv[1:]]), "head": head, "servers": list(names),
            "baseline": baseline, "tokens": args.tokens, "item_bytes": len(model.ITEM), "trials": args.trials,
            "resamples": RESAMPLES, "confidence": CONFIDENCE, "seed": SEED}
    write_results({"meta": meta, "results": results}, out)
    print(f"wrote {out / 'relay.md'}, relay.json and relay.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
