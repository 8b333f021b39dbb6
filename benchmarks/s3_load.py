"""S3 loading benchmark: a sharded model downloaded the way ``sagelmi serve`` does it
(``container.core.artifacts.fetch_s3``: many requests at once, large objects in ranged parts)
against one object after another, from the same local S3 server in the same run.

    make bench          (runs this after the serving and relay benchmarks)
    python benchmarks/s3_load.py [--shards 16] [--shard-mib 8] [--mib-per-s 16] [--trials 3] [--out DIR]

The server is moto's S3 (``ThreadedMotoServer``) behind a proxy that gives each TCP connection
at most ``--mib-per-s`` MiB/s, as S3 gives each connection a fraction of what an instance's
network carries (tens of MB/s per connection against GB/s per instance): with no such limit, a
local server measures its own CPU, not the download strategy. ``--mib-per-s 0`` removes the
limit. The two strategies alternate, ``--trials`` times each; each download goes to a fresh
directory and every file is compared with what was uploaded (SHA-256).

Writes s3_load.md, s3_load.json and s3_load.png under ``--out`` (docs/benchmarks/).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
DEFAULT_OUT = REPO / "docs" / "benchmarks"
AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class ThrottlingProxy:
    """A TCP proxy on 127.0.0.1 that sends the server's bytes to each client connection at most
    ``bytes_per_s`` a second (0: as fast as they come), and samples how many connections are
    sending at once: bytes within the last ``RECENT`` seconds, not counting a connection that
    went quiet before another one began sending (one download handed to the next pooled
    connection is one at a time, however quick the hand-over); the most since ``most_active``
    was last cleared."""

    RECENT = 0.05

    def __init__(self, target_port: int, bytes_per_s: float) -> None:
        self.target_port = target_port
        self.rate = bytes_per_s
        self.last_sent: dict[int, float] = {}
        self.began: dict[int, float] = {}  # when each connection's current run of bytes began
        self.most_active = 0
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self.loop.create_task(self._sample())
        ready.set()
        self.loop.run_forever()

    async def _sample(self) -> None:
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            recent = {name: t for name, t in self.last_sent.items() if now - t < self.RECENT}
            latest_start = max((self.began[name] for name in recent), default=now)
            sending = sum(1 for t in recent.values() if t >= latest_start)
            self.most_active = max(self.most_active, sending)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            await asyncio.gather(self._pipe(reader, up_writer, 0), self._pipe(up_reader, writer, self.rate, id(writer)))
        except OSError:
            pass
        finally:
            writer.close()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rate: float, name: int = 0
    ) -> None:
        started, sent = time.monotonic(), 0
        try:
            while data := await reader.read(1 << 16):
                if name:
                    now = time.monotonic()
                    if now - self.last_sent.get(name, 0.0) >= self.RECENT:
                        self.began[name] = now
                    self.last_sent[name] = now
                writer.write(data)
                await writer.drain()
                sent += len(data)
                if rate:
                    ahead = sent / rate - (time.monotonic() - started)
                    if ahead > 0:
                        await asyncio.sleep(ahead)
        except OSError:
            pass
        finally:
            self.last_sent.pop(name, None)
            self.began.pop(name, None)
            try:
                writer.write_eof()
            except OSError:
                pass

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def _tree_digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


def one_after_another(s3, bucket: str, files: list, progress) -> None:
    """The baseline: boto3's ``download_file`` for each listed object in turn."""
    for obj, destination in files:
        destination.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(bucket, obj.key, str(destination), Callback=progress.add)


def run(shards: int, shard_mib: float, mib_per_s: float, trials: int) -> dict:
    import boto3
    from moto.server import ThreadedMotoServer

    from container.core import artifacts

    for name, value in AWS.items():
        os.environ.setdefault(name, value)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    proxy = ThrottlingProxy(moto.get_host_and_port()[1], mib_per_s * 2**20)
    endpoint = f"http://127.0.0.1:{proxy.port}"
    os.environ["AWS_ENDPOINT_URL_S3"] = endpoint
    work = Path(tempfile.mkdtemp(prefix="sagelmi-s3-bench-"))
    os.environ["TMPDIR"] = str(work)
    tempfile.tempdir = None
    try:
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{moto.get_host_and_port()[1]}")
        s3.create_bucket(Bucket="models")
        uploaded = {}
        size = int(shard_mib * 2**20)
        for i in range(shards):
            body = os.urandom(size)
            name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            s3.put_object(Bucket="models", Key=f"m/{name}", Body=body)
            uploaded[name] = hashlib.sha256(body).hexdigest()
        s3.put_object(Bucket="models", Key="m/config.json", Body=b"{}")
        uploaded["config.json"] = hashlib.sha256(b"{}").hexdigest()
        seconds: dict[str, list[float]] = {"one after another": [], "sagelmi": []}
        connections: dict[str, int] = {}
        concurrency, parallel = artifacts.S3_CONCURRENCY, artifacts._download_all
        for trial in range(trials):
            order = list(seconds) if trial % 2 == 0 else list(reversed(seconds))
            for strategy in order:
                artifacts._download_all = one_after_another if strategy == "one after another" else parallel
                shutil.rmtree(artifacts.download_root(), ignore_errors=True)
                proxy.most_active = 0
                started = time.monotonic()
                local = artifacts.fetch_s3("s3://models/m", interval=3600)
                seconds[strategy].append(time.monotonic() - started)
                connections[strategy] = max(connections.get(strategy, 0), proxy.most_active)
                if _tree_digests(local) != uploaded:
                    raise SystemExit(f"{strategy}: the files on disk differ from the uploaded ones")
        artifacts._download_all = parallel
    finally:
        proxy.stop()
        moto.stop()
        shutil.rmtree(work, ignore_errors=True)
    total = shards * size
    medians = {k: statistics.median(v) for k, v in seconds.items()}
    return {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
            ).stdout.strip(),
            "cores": len(os.sched_getaffinity(0)),
            "machine": platform.machine(),
            "shards": shards,
            "shard_mib": shard_mib,
            "mib_per_s_per_connection": mib_per_s,
            "trials": trials,
            "s3_concurrency": concurrency,
        },
        "results": [
            {
                "strategy": strategy,
                "seconds": [round(s, 3) for s in values],
                "median_seconds": round(medians[strategy], 3),
                "mib_per_s": round(total / 2**20 / medians[strategy], 1),
                "most_connections_sending": connections[strategy],
                "same_bytes_on_disk": True,
            }
            for strategy, values in seconds.items()
        ],
        "speedup": round(medians["one after another"] / medians["sagelmi"], 2),
    }


def write_results(data: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "s3_load.json").write_text(json.dumps(data, indent=2) + "\n")
    meta = data["meta"]
    lines = [
        "# Loading a sharded model from S3",
        "",
        f"{meta['shards']} shards of {meta['shard_mib']:g} MiB (and config.json) from moto's S3 server behind a proxy "
        f"giving each connection {meta['mib_per_s_per_connection']:g} MiB/s, as S3 limits a connection, not an "
        f"instance. Measured {meta['date']} at commit {meta['commit']}, {meta['cores']} cores ({meta['machine']}), "
        f"{meta['trials']} trials each, alternating. Command: `python benchmarks/s3_load.py` (`make bench`).",
        "",
        "| strategy | median s | MiB/s | connections sending at once (most) | same bytes on disk | trials (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in data["results"]:
        lines.append(
            f"| {r['strategy']} | {r['median_seconds']:.2f} | {r['mib_per_s']:.1f} | {r['most_connections_sending']} "
            f"| {'yes' if r['same_bytes_on_disk'] else 'no'} | {', '.join(f'{s:.2f}' for s in r['seconds'])} |"
        )
    lines += [
        "",
        f"sagelmi (`fetch_s3`: up to {meta['s3_concurrency']} requests at once, ranged parts for objects over "
        f"64 MiB) took 1/{data['speedup']:g} of the time of one object after another.",
        "",
        "![seconds by strategy](s3_load.png)",
        "",
    ]
    (out / "s3_load.md").write_text("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    names = [r["strategy"] for r in data["results"]]
    ax.bar(names, [r["median_seconds"] for r in data["results"]], color=["#999999", "#2b6cb0"])
    for i, r in enumerate(data["results"]):
        ax.plot([i] * len(r["seconds"]), r["seconds"], "k.", markersize=4)
    ax.set_ylabel("seconds (median, trials as dots)")
    ax.set_title(f"{meta['shards']} x {meta['shard_mib']:g} MiB from S3")
    fig.tight_layout()
    fig.savefig(out / "s3_load.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--shard-mib", type=float, default=8)
    parser.add_argument("--mib-per-s", type=float, default=16, help="per connection; 0: no limit")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    data = run(args.shards, args.shard_mib, args.mib_per_s, args.trials)
    write_results(data, args.out)
    for r in data["results"]:
        print(
            f"{r['strategy']:>18}: {r['median_seconds']:.2f} s, {r['mib_per_s']:.1f} MiB/s, "
            f"{r['most_connections_sending']} connections sending at once at most"
        )
    print(f"speed-up {data['speedup']}x; wrote {args.out / 's3_load.md'}, s3_load.json and s3_load.png")


if __name__ == "__main__":
    main()
