"""The engine's priority follows the worker's load (container/worker/priority.py), on real
processes: a child with several threads stands for vLLM's EngineCore."""

import asyncio
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from container.core.proc import ENGINE_NICE
from container.worker import priority
from container.worker.priority import SHARED_UP_TO, EnginePriority
from tests.server import REPO, nice_of_threads

THREADED = """
import threading, time
for _ in range(3):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
time.sleep(60)
"""


@pytest.fixture
def engine():
    child = subprocess.Popen([sys.executable, "-c", THREADED])
    try:
        while len(os.listdir(f"/proc/{child.pid}/task")) < 4:  # its threads have started
            pass
        yield child.pid
    finally:
        child.kill()
        child.wait()


@pytest.fixture
def quick_restore(monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("giving a priority back needs CAP_SYS_NICE (root)")
    monkeypatch.setattr(priority, "RESTORE_AFTER", 0.05)


def run(coroutine):
    return asyncio.run(coroutine)


def test_the_engine_shares_the_cpu_until_more_than_a_few_requests_are_in_flight(engine, quick_restore):
    async def scenario():
        policy = EnginePriority(asyncio.get_running_loop(), [engine], adaptive=True)
        policy.started(SHARED_UP_TO)
        at_few = nice_of_threads(engine)
        policy.started()
        above = nice_of_threads(engine)
        policy.ended()
        during_hold = nice_of_threads(engine)
        await asyncio.sleep(0.2)
        return at_few, above, during_hold, nice_of_threads(engine)

    assert run(scenario()) == ({0}, {ENGINE_NICE}, {ENGINE_NICE}, {0})


def test_a_request_during_the_hold_keeps_the_engine_below(engine, quick_restore):
    async def scenario():
        policy = EnginePriority(asyncio.get_running_loop(), [engine], adaptive=True)
        policy.started(SHARED_UP_TO + 1)
        policy.ended()  # at SHARED_UP_TO: the hold begins
        policy.started()  # ... and is cut short
        await asyncio.sleep(0.2)
        kept = nice_of_threads(engine)
        policy.ended(SHARED_UP_TO + 1)
        await asyncio.sleep(0.2)
        return kept, nice_of_threads(engine)

    assert run(scenario()) == ({ENGINE_NICE}, {0})


def test_an_mpi_groups_engine_stays_below(engine, quick_restore):
    async def scenario():
        policy = EnginePriority(asyncio.get_running_loop(), [engine], adaptive=False)
        first = nice_of_threads(engine)
        policy.started(SHARED_UP_TO + 1)
        policy.ended(SHARED_UP_TO + 1)
        await asyncio.sleep(0.2)
        return first, nice_of_threads(engine)

    assert run(scenario()) == ({ENGINE_NICE}, {ENGINE_NICE})


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux's setpriv to drop CAP_SYS_NICE")
def test_without_cap_sys_nice_the_engine_stays_below_after_its_first_burst():
    """An unprivileged worker may lower a priority but not raise it back: it says so once and
    leaves the engine at ENGINE_NICE, as it was before the policy."""
    script = textwrap.dedent("""
        import asyncio, logging, os, subprocess, sys
        from container.worker import priority
        from container.worker.priority import SHARED_UP_TO, EnginePriority
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        priority.RESTORE_AFTER = 0.05
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        async def main():
            policy = EnginePriority(asyncio.get_running_loop(), [child.pid], adaptive=True)
            policy.started(SHARED_UP_TO + 1)
            policy.ended(SHARED_UP_TO + 1)
            await asyncio.sleep(0.2)
            policy.started(SHARED_UP_TO + 1)
            policy.ended(SHARED_UP_TO + 1)
            await asyncio.sleep(0.2)
            print("NICE", os.getpriority(os.PRIO_PROCESS, child.pid))
        asyncio.run(main())
        child.kill()
    """)
    drop = ["setpriv", "--bounding-set", "-sys_nice", "--inh-caps", "-sys_nice", "--"]
    result = subprocess.run([*drop, sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert f"NICE {ENGINE_NICE}" in result.stdout, result.stderr
    assert result.stderr.count("may not raise their priority back") == 1, result.stderr
