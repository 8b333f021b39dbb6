"""``make test``'s runner: the suite as several pytest processes at once, one per lane.

Most of a full run's time is real engines starting (importing vLLM in three processes, loading,
compiling), and an engine start keeps one core busy; most of the rest is tests that wait (servers
starting and stopping, timeouts). Lanes keep both cores of a CI machine busy. The lanes of FULL
(``make test``) and FAST (``make test-fast``, the tests not marked slow) name their modules; lane
``rest`` runs ``tests`` with those ignored, so a new test module can never fall between the lanes.
Each lane has its own temporary directory (TMPDIR: its pytest base directory, its S3 downloads,
its MPI session files), so they share no file but the figures of build/reliability.md
(tests/reliability.py locks it), build/engine-servers.tsv and the caches under the home directory.

Every lane's output is shown as it comes, each line prefixed with its lane; their summaries are
repeated at the end. The exit status is 0 only when every lane passed. Arguments are passed to
every pytest process; ``--fast`` chooses FAST.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests import reliability
from tests.container import image_build
from tests.server import REPO

# The full run's lanes (make test) besides ``rest``, which runs every test they do not name. A full run
# keeps both cores busy all along: its time is its CPU (the closing block's "CPU by module" lines say
# where it goes) shared by two cores. A lane that needs ``vllm_server`` (tests/conftest.py) would start
# its own: only ``engines`` does. Two lanes that start engines (each engine process uses both cores) and
# ``rest``, whose tests mostly wait, keep the cores full; more lanes only add contention, and CPU with
# it (docs/testing.md has the measured runs).
FULL = {
    # The users of the shared servers (tests/conftest.py's vllm_server, tests/e2e/conftest.py's lmi-dist
    # and LoRA servers): each shared server starts once in the run. The two-container cluster compares
    # its answers with vllm_server's; container tests run last in a lane (tests/conftest.py), once the
    # image is built (tests/container/image_build.py).
    "engines": [
        "tests/container/test_cluster.py",
        "tests/e2e/test_bench.py",
        "tests/e2e/test_fuzz.py",
        "tests/e2e/test_load.py",
        "tests/e2e/test_lmi_dist.py",
        "tests/e2e/test_lora.py",
        "tests/e2e/test_option_matrix.py",
        "tests/e2e/test_plan.py",
        "tests/e2e/test_vllm_engine.py",
        "tests/e2e/test_vllm_limits.py",
        "tests/e2e/test_vllm_lmi.py",
        "tests/e2e/test_vllm_lmi_custom_handlers.py",
        "tests/e2e/test_vllm_openai.py",
        "tests/e2e/test_vllm_sessions.py",
    ],
    # e2e modules that start servers of their own (the two-node cluster on one machine among them), and last
    # the image's other tests. make run's test is in lane rest.
    "e2e": [
        "tests/e2e/test_accelerate_engine.py",
        "tests/e2e/test_lmi_options.py",
        "tests/e2e/test_observability_vllm.py",
        "tests/e2e/test_pooling.py",
        "tests/e2e/test_priority.py",
        "tests/e2e/test_reasoning_and_templates.py",
        "tests/e2e/test_tool_calling.py",
        "tests/e2e/test_vision.py",
        "tests/e2e/test_vllm_cluster.py",
        "tests/container/test_image.py",
        "tests/container/test_ray_cluster.py",
    ],
}
# make test-fast (--fast: the tests not marked slow) starts no engine, and its tests mostly wait
# (model.py servers starting and stopping, timeouts, back-offs: one process keeps about half a core
# busy), so it runs in four lanes: three take the integration modules (one the MPI tests too), the
# fourth the rest.
FAST = {
    "int-a": ["tests/integration/test_[a-h]*.py", "tests/integration/test_lifecycle.py"],
    # Hugging Face pipelines in every server; and the MPI tests (this lane ended about 100 s before int-a)
    "toolkit+mpi": ["tests/integration/test_inference_toolkit*.py", "tests/mpi"],
    "int-j": ["tests/integration/test_[j-z]*.py"],
}
LANE_VARIABLE = "SAGELMI_TEST_LANE"  # set in each lane's environment (tests/conftest.py reads it)


def lanes(args: list[str]) -> dict[str, list[str]]:
    """Each lane's pytest arguments: the named lanes' modules (paths or globs), and lane ``rest``
    everything else."""
    fast = "--fast" in args
    args = [a for a in args if a != "--fast"]
    named = FAST if fast else FULL
    missing = [path for paths in named.values() for path in paths if "*" not in path and not (REPO / path).exists()]
    if missing:
        raise SystemExit(f"tests/lanes.py names modules that do not exist: {', '.join(missing)}")
    selection = ["-m", "not slow"] if fast else []
    ignored = [f"--ignore-glob={p}" if "*" in p else f"--ignore={p}" for paths in named.values() for p in paths]
    chosen: dict[str, list[str]] = {}
    claimed: set[str] = set()  # a module named by an earlier lane is not run by a later one's glob
    for name, paths in named.items():
        found = sorted({str(p.relative_to(REPO)) for pattern in paths for p in REPO.glob(pattern)} - claimed)
        chosen[name] = found
        claimed.update(found)
    return {"rest": ["tests", *ignored, *selection, *args],
            **{name: [*paths, *selection, *args] for name, paths in chosen.items()}}


def _pump(name: str, process: subprocess.Popen, lines: list[str], ended: dict[str, float]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        sys.stdout.write(f"{name:>9}| {line}")
        sys.stdout.flush()
    ended[name] = time.monotonic()


# The lines of a lane's end that the closing block repeats: its engine servers, the image's build, the CPU of
# its test modules.
MEASURED = ("engine servers: ", "image: ", "CPU by module: ")


def _summary(lines: list[str]) -> list[str]:
    """The lane's measured lines (MEASURED), its failures (the FAILED and ERROR lines of its short
    test summary) and its final line: short, since a CI page may show only the end of the output,
    and servers' logs printed while pytest ends can land among the summary's lines."""
    measured = [line for line in lines if line.startswith(MEASURED)]
    for i in range(len(lines) - 1, -1, -1):
        if "short test summary info" in lines[i]:
            return measured + [line for line in lines[i + 1:] if line.startswith(("FAILED ", "ERROR "))] + lines[-1:]
    return measured + lines[-1:]


def kept_caches() -> str:
    """What earlier runs on this machine left for this one (whether a CI machine keeps its home between
    runs decides what caching can save there): vLLM's offline answers, the tiny models, the SDK's
    environments, vLLM's compiled models."""
    from tests.models import models_root
    from tests.references import cache_dir
    from tests.sdk.venvs import venvs_root

    places = {
        "offline vLLM answers": cache_dir(),
        "tiny models": models_root(),
        "SDK environments": venvs_root(),
        "vLLM compiled models": Path.home() / ".cache" / "vllm" / "torch_compile_cache" / "torch_aot_compile",
    }
    found = []
    for name, place in places.items():
        entries = [e for e in place.iterdir() if not e.name.endswith((".lock", ".tmp"))] if place.is_dir() else []
        oldest = min((e.stat().st_mtime for e in entries), default=None)
        since = f", the oldest from {time.strftime('%Y-%m-%d %H:%M', time.gmtime(oldest))} UTC" if oldest else ""
        found.append(f"{name} {len(entries)}{since}")
    return "caches kept from earlier runs: " + "; ".join(found)


def main(args: list[str]) -> int:
    reliability.start_run()  # once for all lanes; they add their figures to the same page
    (REPO / "build" / "engine-servers.tsv").unlink(missing_ok=True)  # every lane lists its engine servers in it
    (REPO / "build" / "module-cpu.tsv").unlink(missing_ok=True)  # and the CPU of its test modules
    if "--fast" not in args and not os.environ.get(image_build.ENV) and shutil.which("podman"):
        image_build.start()  # two lanes run container tests: one build for both (make test starts it earlier)
        os.environ[image_build.ENV] = str(image_build.RECORD)
    caches = kept_caches()
    print(caches, flush=True)
    started = time.monotonic()
    running: dict[str, tuple[subprocess.Popen, list[str], threading.Thread, str]] = {}
    ended: dict[str, float] = {}
    for name, lane_args in lanes(args).items():
        tmp = tempfile.mkdtemp(prefix=f"sagelmi-{name}-")  # short: Unix sockets live under it
        env = {**os.environ, "TMPDIR": tmp, LANE_VARIABLE: name, "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen([sys.executable, "-m", "pytest", *lane_args], cwd=REPO, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                   start_new_session=True)  # a ^C reaches it once, from forward() below
        lines: list[str] = []
        thread = threading.Thread(target=_pump, args=(name, process, lines, ended), daemon=True)
        thread.start()
        running[name] = (process, lines, thread, tmp)

    def forward(signum, _frame):  # pytest stops its servers on SIGINT
        for process, *_ in running.values():
            process.send_signal(signal.SIGINT)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes, cpu = {}, {}
    for name, (process, _, thread, tmp) in running.items():
        # os.wait4 rather than process.wait(): the lane's CPU (its processes and every child they waited for)
        _, status, usage = os.wait4(process.pid, 0)
        codes[name] = process.returncode = os.waitstatus_to_exitcode(status)
        cpu[name] = usage.ru_utime + usage.ru_stime
        thread.join()
        shutil.rmtree(tmp, ignore_errors=True)
    named = os.environ.get(image_build.ENV)
    if named and Path(named).exists():  # make's build, if no lane waited for it to the end
        image_build.stop(image_build.read(named))
    print("\n==================== every lane ====================")
    print(f"{sum(cpu.values()) / 60:.1f} CPU-minutes (user+sys) in all lanes, {time.monotonic() - started:.0f} s")
    print(caches)
    for name, (_, lines, _, _) in sorted(running.items(), key=lambda item: codes[item[0]] != 0):  # failures last
        print(f"lane {name}: exit {codes[name]} after {ended.get(name, time.monotonic()) - started:.0f} s, "
              f"{cpu[name] / 60:.1f} CPU-minutes")
        for line in _summary(lines):
            sys.stdout.write(f"{name:>9}| {line}")
    # Exit 5 (no tests ran) is a failure too: tests/conftest.py makes it 1 in each lane.
    return 0 if all(code == 0 for code in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
