"""A real ``sagelmi serve`` process for tests: free port, captured log, always cleaned up."""

from __future__ import annotations

import http.client
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
MODEL_DIRS = Path(__file__).resolve().parent / "model_dirs"

# Variables from the developer's shell that would change settings under test.
_SETTING_PREFIXES = ("OPTION_", "SERVING_", "SAGEMAKER_", "HF_", "SM_")
_SETTING_NAMES = {"TENSOR_PARALLEL_DEGREE", "MAX_CONCURRENT_REQUESTS", "MAX_BATCH_SIZE",
                  "MAX_BATCH_PREFILL_TOKENS", "CUDA_VISIBLE_DEVICES"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, timeout: float) -> None:
    """Wait until something on ``port`` answers /ping with 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/ping", timeout=2).status_code == 200:
                return
        except (requests.ConnectionError, requests.Timeout):  # not listening yet; or a busy machine: ask again
            pass
        time.sleep(0.2)
    raise AssertionError(f"nothing healthy on port {port} after {timeout}s")


class NoDescriptorsLeft:
    """While in use, this process can open no more files or sockets (its limit lowered, then every
    descriptor left taken; ``take()`` again takes those other threads freed since): an ``accept``
    fails with EMFILE. A socket made before still connects. Gives everything back after."""

    def __enter__(self) -> "NoDescriptorsLeft":
        self.soft, self.hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 64, self.hard))
        self.held: list[int] = []
        self.take()
        return self

    def take(self) -> None:
        try:
            while True:
                self.held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass

    def __exit__(self, *exc) -> None:
        for fd in self.held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.soft, self.hard))


def installed_venv() -> Path:
    """This test run's virtualenv, which must come from `make install` (make targets reuse it)."""
    venv = Path(sys.prefix)
    if not (venv / ".sagelmi-installed").exists():
        raise AssertionError(f"{venv} was not installed by `make install`; run the tests through `make test`")
    return venv


def tests_cache_root() -> Path:
    """Where tests keep what later runs on this machine reuse (offline answers, tiny models), outside the
    checkout: ``~/.cache/sagelmi-tests``, or ``SAGELMI_TEST_CACHE``."""
    return Path(os.environ.get("SAGELMI_TEST_CACHE", Path.home() / ".cache" / "sagelmi-tests"))


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_SETTING_PREFIXES) and k not in _SETTING_NAMES}
    env.update(extra or {})
    return env


class Server:
    """A real ``sagelmi serve`` on a free port. However a test ends, its server is
    stopped: ``start`` stops it when it never gets ready, the context manager on
    exit, and ``stop_leftovers`` (at the end of the session) whatever is left."""

    live: set["Server"] = set()
    started: list["Server"] = []  # every server of the run, in the order they started

    def __init__(self, model_dir: str | Path, env: dict[str, str] | None = None, ready_timeout: float = 180,
                 wrapper: list[str] | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.wrapper = wrapper or []  # a command that runs the server's command line given as its arguments
        self.ready_timeout = ready_timeout
        self.port = free_port()
        self.env = clean_env(env)
        self.log_file = tempfile.NamedTemporaryFile(prefix="sagelmi-test-", suffix=".log", delete=False)
        self.process: subprocess.Popen | None = None
        self.ready_seconds: float | None = None  # from start to the first 200 of /ping
        self.started_by = ""  # the node id of the test (or the first test of the fixture) that started it

    # -- lifecycle
    def start(self, wait_ready: bool = True, timeout: float | None = None) -> "Server":
        self.process = subprocess.Popen(
            [*self.wrapper, sys.executable, "-m", "container", "serve", "--model-dir", str(self.model_dir),
             "--port", str(self.port)],
            env=self.env, stdout=self.log_file, stderr=subprocess.STDOUT, cwd=REPO)
        Server.live.add(self)
        Server.started.append(self)
        if wait_ready:
            began = time.monotonic()
            try:
                self.wait_until(lambda r: r.status_code == 200, timeout or self.ready_timeout)
                self.ready_seconds = time.monotonic() - began
            except BaseException:
                self.stop()  # SIGTERM: the supervisor stops its worker groups (SIGKILL would orphan them)
                raise
        return self

    def wait_until(self, condition, timeout: float) -> requests.Response:
        """Poll /ping until ``condition(response)`` holds."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                last = requests.get(self.url("/ping"), timeout=2)
                if condition(last):
                    return last
            except (requests.ConnectionError, requests.Timeout):
                pass  # not up yet, or stopping (the supervisor holds the port until it exits)
            time.sleep(0.05)
        raise AssertionError(f"/ping never matched within {timeout}s (last: "
                             f"{last.status_code if last is not None else 'no answer'}):\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.process is None:
            return 0
        Server.live.discard(self)
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise AssertionError(f"server did not stop within {timeout}s:\n{self.log()}")
        return self.process.returncode

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"server still running after {timeout}s:\n{self.log()}") from None

    @classmethod
    def stop_leftovers(cls, servers: "list[Server] | None" = None) -> list[str]:
        """Stop every server a test started and did not stop (or those of ``servers``
        still live); say which they were."""
        servers = [s for s in (cls.live if servers is None else servers) if s in cls.live]
        left = [f"{server.model_dir} on port {server.port}" for server in servers
                if server.process is not None and server.process.poll() is None]
        for server in servers:
            try:
                server.stop(timeout=30)
            except AssertionError:
                pass  # killed after the timeout
        return left

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- helpers
    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def invoke(self, body=None, **kwargs) -> requests.Response:
        kwargs.setdefault("timeout", 60)
        return requests.post(self.url("/invocations"), json=body, **kwargs)

    def log(self) -> str:
        return Path(self.log_file.name).read_text(errors="replace")

    def ran_an_engine(self) -> bool:
        """Whether a built-in engine (vLLM, Accelerate) started in this server, by its log."""
        log = self.log()
        return "loaded (engine " in log or "starting vLLM" in log

    def compiles(self) -> int:
        """How many times vLLM compiled the model in this server, by its log (it saves each compile). vLLM 0.32's
        CPU build cannot load what it saved ("'function' object has no attribute 'finalize_loading'"), so every
        compiled start compiles; the inductor cache kept under the same model path and settings makes it faster."""
        return self.log().count("saved AOT compiled function")

    def worker_pids(self) -> list[int]:
        """PIDs of the model worker processes (children of the server)."""
        out = subprocess.run(["pgrep", "-P", str(self.process.pid), "-f", "container.worker"],
                             capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def group_pids(self) -> list[int]:
        """The first process of each worker group (a worker, or mpirun in MPI mode):
        everything the group starts stays below it (container.core.proc.adopt_orphans)."""
        from container.core.proc import parents

        children = sorted(pid for pid, parent in parents().items() if parent == self.process.pid)  # no zombie
        return [pid for pid in children if not re.search("gunicorn|frontend", _command_line(pid))]

    def one_group(self, timeout: float = 30) -> int:
        """The first process of the server's only worker group, once there is one (a group that
        ended may still be there for a moment, being replaced)."""
        deadline = time.monotonic() + timeout
        while len(pids := self.group_pids()) != 1:
            assert time.monotonic() < deadline, {pid: processes(pid).get(pid) for pid in pids}
            time.sleep(0.2)
        return pids[0]


SHARED: dict[str, Server] = {}  # session fixture name -> the server it shares (tests/conftest.py stops it)


def shared(fixture: str, server: Server) -> Server:
    """``server``, started by the session fixture ``fixture`` and shared by every test that asks for it:
    the run stops it once the last of those tests has run (tests/conftest.py), not at the run's end.
    A test that would stop it, or leave it serving otherwise than it started, gets a Server of its own."""
    SHARED[fixture] = server
    return server


def processes(group: int) -> dict[int, str]:
    """The live processes of the group whose first process is ``group``, itself
    included: pid -> command line."""
    from container.core.proc import descendants

    found = {pid: _command_line(pid) for pid in [group, *descendants([group])]}
    return {pid: cmd for pid, cmd in found.items() if cmd}  # a zombie has no command line


def _command_line(pid: int) -> str:
    """The command line of ``pid`` ("" once it ended, or a zombie)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def mpi_rank(pid: int) -> int | None:
    """The MPI rank of a process (from its environment), if it is one."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"OMPI_COMM_WORLD_RANK="):
            return int(entry.split(b"=", 1)[1])
    return None


def nice_of_threads(pid: int) -> set[int]:
    """The nice values of a process's threads (Linux keeps one per thread)."""
    return {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


class RawStream:
    """A streaming POST whose connection the test can really close (``requests``
    keeps the socket open until garbage collection, which hides disconnects)."""

    def __init__(self, port: int, path: str, body: dict, timeout: float = 30, headers: dict | None = None) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        self.conn.request("POST", path, body=json.dumps(body),
                          headers={"Content-Type": "application/json", **(headers or {})})
        self.response = self.conn.getresponse()
        self._buffer = b""

    def read_lines(self, count: int) -> list[bytes]:
        """The first ``count`` non-empty lines (SSE events are separated by empty ones)."""
        while True:
            complete = [line for line in self._buffer.split(b"\n")[:-1] if line.strip()]
            if len(complete) >= count:
                return complete[:count]
            chunk = self.response.read1(65536)
            if not chunk:
                return complete
            self._buffer += chunk

    def complete(self) -> bool:
        """Whether the end of the answer has arrived already (LMI's last line, SSE's [DONE], or the
        last event of a Responses or Messages stream)."""
        return any(end in self._buffer for end in (b'"generated_text"', b"data: [DONE]",
                                                   b"event: response.completed", b"event: message_stop"))

    def close(self) -> None:
        """Drop the connection, as a client that goes away does."""
        self.conn.sock.close()
        self.conn.close()


def send_and_leave_open(port: int, path: str, body: dict) -> socket.socket:
    """Send a POST and return its socket without reading the answer: closing it is a
    client that leaves before its (non-streamed) answer came."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def kill_mid_stream(server: Server, pid: int, streams: int, tokens: int) -> tuple[float, list[dict]]:
    """Open ``streams`` LMI streams of ``tokens`` tokens, SIGKILL ``pid`` once each
    has its first token, read every stream to its end. Returns the seconds from
    the kill until the last stream ended, and the last line of each stream that
    was still in flight at the kill (one whose whole answer had come is left out)."""
    body = {"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": tokens, "ignore_eos": True}}
    opened = [RawStream(server.port, "/invocations", body) for _ in range(streams)]
    for stream in opened:
        assert len(stream.read_lines(1)) == 1
    in_flight = [stream for stream in opened if not stream.complete()]
    assert in_flight, "every answer had come whole before the kill"
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    endings = [json.loads(stream.read_lines(1_000_000)[-1]) for stream in in_flight]
    return time.monotonic() - killed, endings


def metric(server: Server, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` on ``/metrics`` whose labels include ``labels``.
    (On 2 cores vLLM's busy engine processes can delay an answer by seconds: wait long.)"""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(server.url("/metrics"), timeout=60).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def drop_stream_and_wait_until_idle(server: Server, path: str, body: dict, tokens: int, within: float = 2,
                                    attempts: int = 5) -> tuple[float, float]:
    """Start a stream of ``tokens`` tokens, read its first lines, drop the connection,
    and wait until ``sagelmi_engine_unfinished_requests`` is 0 (on every rank).
    Returns the seconds that took and how many tokens vLLM generated meanwhile,
    from an attempt where the engine was idle ``within`` seconds and had generated
    fewer than ``tokens`` (the request was aborted, not run to its end).

    On this 2-core machine vLLM's CPU engine, once decoding, can keep every other
    process off the cores for seconds (seen with strace: the frontend made no
    system call for 7 s while the engine finished an 8000-token answer; nice and
    OMP_WAIT_POLICY did not help); the drop is then only seen when the answer is
    complete, and some answers arrive whole before the test can drop them. Such an
    attempt says nothing about sagelmi, so another is made; if none of them shows
    a prompt abort, the test fails with what each attempt saw."""
    seen = []
    for _ in range(attempts):
        wait_idle(server)  # what earlier tests left in the engine would count as this stream's
        before = metric(server, "vllm:generation_tokens_total")
        sent = time.monotonic()
        stream = RawStream(server.port, path, body)
        assert len(stream.read_lines(3)) == 3
        first_lines = time.monotonic() - sent
        whole = stream.complete()
        stream.close()
        dropped = time.monotonic()
        wait_idle(server)
        seconds = time.monotonic() - dropped
        generated = metric(server, "vllm:generation_tokens_total") - before
        if not whole and generated < tokens and seconds < within:
            return seconds, generated
        seen.append({"whole": whole, "first_lines_s": round(first_lines, 2), "idle_after_drop_s": round(seconds, 2),
                     "tokens": generated})
    busiest = subprocess.run(["ps", "-eo", "pid,pcpu,psr,etime,args", "--sort=-pcpu"], capture_output=True,
                             text=True).stdout.splitlines()[:12]
    raise AssertionError(f"no attempt dropped a stream that was still running: {seen}; test process on cores "
                         f"{sorted(os.sched_getaffinity(0))}; busiest processes:\n" + "\n".join(busiest))


def wait_idle(server: Server, timeout: float = 120) -> None:
    """Wait until no request is in the engine (``sagelmi_engine_unfinished_requests`` is 0 on every rank)."""
    deadline = time.monotonic() + timeout
    while metric(server, "sagelmi_engine_unfinished_requests") != 0:
        assert time.monotonic() < deadline, f"requests still in the engine after {timeout}s"
        time.sleep(0.05)
