"""``make test``'s runner: the suite as two pytest processes at once, one per lane.

Most of the suite's time is real engines starting (importing vLLM, loading, compiling), and an
engine start keeps one core busy (user+sys over wall: about 1.0 on the tiny model). Two lanes
keep both cores of a CI machine busy. Lane ``engines`` runs the e2e modules listed in ENGINES:
those that share ``vllm_server``, the lmi-dist and the LoRA servers (tests/conftest.py,
tests/e2e/conftest.py), and two more that balance the lanes' times (docs/testing.md has them);
lane ``rest`` runs everything else, ``tests`` with those modules ignored, so a new test module
can never fall between the lanes. Each lane has its own temporary directory (TMPDIR: its pytest
base directory, its S3 downloads, its MPI session files), so they share no file but the figures
of build/reliability.md (tests/reliability.py locks it) and the caches under the home directory.

Both lanes' output is shown as it comes, each line prefixed with its lane; their summaries are
repeated at the end. The exit status is 0 only when both lanes passed. Arguments are passed to
both pytest processes; ``--fast`` runs ``make test-fast``'s tests (not slow) in two other lanes.
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

from tests import reliability
from tests.server import REPO

ENGINES = [
    "tests/e2e/test_accelerate_engine.py",  # for balance
    "tests/e2e/test_bench.py",
    "tests/e2e/test_fuzz.py",
    "tests/e2e/test_load.py",
    "tests/e2e/test_lmi_dist.py",
    "tests/e2e/test_lmi_options.py",
    "tests/e2e/test_lora.py",
    "tests/e2e/test_observability_vllm.py",
    "tests/e2e/test_option_matrix.py",
    "tests/e2e/test_pipeline_parallel.py",
    "tests/e2e/test_plan.py",
    "tests/e2e/test_readme_run.py",  # for balance
    "tests/e2e/test_vllm_engine.py",
    "tests/e2e/test_vllm_limits.py",
    "tests/e2e/test_vllm_lmi.py",
    "tests/e2e/test_vllm_lmi_custom_handlers.py",
    "tests/e2e/test_vllm_openai.py",
    "tests/e2e/test_vllm_sessions.py",
]
# make test-fast (--fast: the tests not marked slow) starts no engine; most of its time is the
# integration tests' model.py servers, so lane ``integration`` takes the first half of them by name.
FAST_SECOND = "tests/integration/test_[a-l]*.py"
LANE_VARIABLE = "SAGELMI_TEST_LANE"  # set in each lane's environment (tests/conftest.py reads it)


def lanes(args: list[str]) -> dict[str, list[str]]:
    """Each lane's pytest arguments."""
    if "--fast" in args:
        args = [a for a in args if a != "--fast"]
        second = sorted(str(path.relative_to(REPO)) for path in REPO.glob(FAST_SECOND))
        return {"rest": ["tests", f"--ignore-glob={FAST_SECOND}", "-m", "not slow", *args],
                "integration": [*second, "-m", "not slow", *args]}
    missing = [path for path in ENGINES if not (REPO / path).exists()]
    if missing:
        raise SystemExit(f"tests/lanes.py names modules that do not exist: {', '.join(missing)}")
    return {"rest": ["tests", *(f"--ignore={path}" for path in ENGINES), *args], "engines": [*ENGINES, *args]}


def _pump(name: str, process: subprocess.Popen, lines: list[str], ended: dict[str, float]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        sys.stdout.write(f"{name:>11}| {line}")
        sys.stdout.flush()
    ended[name] = time.monotonic()


def _summary(lines: list[str]) -> list[str]:
    """The lane's short test summary and final line (all of its output after the last '====' header
    that starts the summary, else its last line)."""
    for i in range(len(lines) - 1, -1, -1):
        if "short test summary info" in lines[i]:
            return lines[i:]
    return lines[-1:]


def main(args: list[str]) -> int:
    reliability.start_run()  # once for both lanes; they add their figures to the same page
    (REPO / "build" / "engine-servers.tsv").unlink(missing_ok=True)  # both lanes list their engine servers in it
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
    codes = {}
    for name, (process, _, thread, tmp) in running.items():
        codes[name] = process.wait()
        thread.join()
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n==================== both lanes ====================")
    for name, (_, lines, _, _) in running.items():
        print(f"lane {name}: exit {codes[name]} after {ended.get(name, time.monotonic()) - started:.0f} s")
        for line in _summary(lines):
            sys.stdout.write(f"{name:>11}| {line}")
    # Exit 5 (no tests ran) is a failure too: tests/conftest.py makes it 1 in each lane.
    return 0 if all(code == 0 for code in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
