import logging
import os
import subprocess
from collections import defaultdict

import pytest

from tests import models, reliability
from tests.e2e.conftest import EAGER, ENGINE_READY_TIMEOUT, EXACT, HUB_TOKEN, TINY_CONTEXT, VLLM_CPU_ENV
from tests.lanes import LANE_VARIABLE
from tests.server import MODEL_DIRS, REPO, SHARED, Server, shared

_TREE_AT_START: str | None = None
_TIER_SECONDS: dict[str, float] = defaultdict(float)
_LAST_USER: dict[str, str] = {}  # fixture name -> the node id of the last test of the run that uses it
_MODULE_CPU: dict[str, float] = defaultdict(float)  # test module -> CPU seconds of the run's process tree
_CPU_MARK: list = [None, 0.0]  # the module running now, the tree's CPU seconds when it began


@pytest.fixture(autouse=True)
def _root_logger_as_found():
    """A test that runs sagelmi's CLI in this process (``logs.configure``) leaves the root logger a handler
    on the stderr pytest captured for that test and closes after it: a thread of a later test (a relay's
    handshake) logging through it printed "--- Logging error ---". The stream handlers a test added are
    taken out after it, and the root logger's level is restored."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in before and type(handler) is logging.StreamHandler:
            root.removeHandler(handler)
    root.setLevel(level)


def _tree_cpu() -> float:
    """CPU seconds (user+sys) used so far by this process, the children it reaped and its live descendants
    (their own reaped children included): what the engine servers and worker processes a test starts cost.
    Podman's containers run under conmon, outside the tree: only the podman client's part is counted."""
    ticks = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended meanwhile
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = sum(int(value) for value in fields[11:15])  # utime, stime, cutime, cstime
    children: dict[int, list[int]] = defaultdict(list)
    for pid, ppid in parent.items():
        children[ppid].append(pid)
    total, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return total / ticks


def _charge_cpu(module: str | None) -> None:
    """Give the CPU used since the last mark to the module that ran, and start counting for ``module``."""
    now = _tree_cpu()
    if _CPU_MARK[0] is not None:
        _MODULE_CPU[_CPU_MARK[0]] += now - _CPU_MARK[1]
    _CPU_MARK[:] = [module, now]


def _tree_status() -> str | None:
    """``git status --porcelain`` of the checkout (None outside a git checkout)."""
    result = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO,
                            capture_output=True, text=True)
    return result.stdout if result.returncode == 0 else None


def pytest_sessionstart(session):
    global _TREE_AT_START
    _TREE_AT_START = _tree_status()
    if not os.environ.get(LANE_VARIABLE):  # tests/lanes.py starts the run's figures once for both lanes
        reliability.start_run()
        ENGINE_LIST.unlink(missing_ok=True)
        MODULE_CPU_LIST.unlink(missing_ok=True)


# The order of the run by folder: quick feedback first, and the container tests last, so that the image
# they need builds in the background (tests/container/conftest.py) while the others run.
_ORDER = ("unit", "sdk", "integration", "mpi", "e2e", "container")


def _folder_rank(item) -> int:
    parts = item.nodeid.split("/")
    return _ORDER.index(parts[1]) if len(parts) > 2 and parts[1] in _ORDER else len(_ORDER)


def pytest_collection_modifyitems(items):
    items.sort(key=_folder_rank)  # stable: the order within a folder stays pytest's
    for item in items:
        if getattr(item.module, "record", None) is reliability.record:
            item.add_marker(pytest.mark.reliability)  # make reliability-report runs these
        for name in getattr(item, "fixturenames", ()):
            _LAST_USER[name] = item.nodeid


def pytest_runtest_setup(item):
    item.stash[_SERVERS_BEFORE] = len(Server.started)
    module = item.nodeid.split("::")[0]
    if module != _CPU_MARK[0]:
        _charge_cpu(module)


def pytest_runtest_teardown(item):
    """A test that starts an engine must say so with ``slow``: ``make test-fast`` starts none. A shared
    server (tests/server.py: shared) stops after its last test: engines hold gigabytes."""
    for name, server in list(SHARED.items()):
        if _LAST_USER.get(name) == item.nodeid:
            del SHARED[name]
            server.stop()
    started = Server.started[item.stash.get(_SERVERS_BEFORE, 0):]
    for server in started:
        server.started_by = item.nodeid
    if item.get_closest_marker("slow") is None:
        engines = [s for s in started if s.ran_an_engine()]
        assert not engines, (f"{item.nodeid} started an engine ({engines[0].model_dir}) without the slow marker; "
                             f"mark it slow, or serve a model.py")


def pytest_runtest_logreport(report):
    _TIER_SECONDS[report.nodeid.split("/")[1] if report.nodeid.startswith("tests/") else "?"] += report.duration


def pytest_terminal_summary(terminalreporter):
    engines = [s for s in Server.started if s.ran_an_engine()]
    if engines:  # most of a full run's time: each start imports vLLM in three processes, some compile
        waited = sum(s.ready_seconds or 0 for s in engines)
        terminalreporter.section("engine servers")
        compiled = sum(s.compiles() for s in engines)
        terminalreporter.write_line(f"engine servers: {len(engines)} started, {waited:.0f} s until ready in all; vLLM "
                                    f"compiled the model {compiled} times; "
                                    f"each is listed in {ENGINE_LIST.relative_to(REPO)}")
        ENGINE_LIST.parent.mkdir(exist_ok=True)
        with ENGINE_LIST.open("a") as listing:
            for s in engines:
                listing.write(f"{os.environ.get(LANE_VARIABLE, '-')}\t{s.ready_seconds or 0:.1f}\t{s.compiles()}\t"
                              f"{s.started_by}\t{s.model_dir}\n")
    _charge_cpu(None)
    if _MODULE_CPU:  # what a run on two cores is bound by; CI's page shows the closing block's MEASURED lines
        ranked = sorted(_MODULE_CPU.items(), key=lambda kv: -kv[1])
        terminalreporter.section("CPU by test module (user+sys of the run's processes)")
        terminalreporter.write_line("CPU by module: " + ", ".join(
            f"{module.removeprefix('tests/').removesuffix('.py')} {seconds / 60:.1f}" for module, seconds in ranked[:12])
            + f" (minutes; {sum(_MODULE_CPU.values()) / 60:.1f} in all, listed in {MODULE_CPU_LIST.relative_to(REPO)})")
        MODULE_CPU_LIST.parent.mkdir(exist_ok=True)
        with MODULE_CPU_LIST.open("a") as listing:
            for module, seconds in ranked:
                listing.write(f"{os.environ.get(LANE_VARIABLE, '-')}\t{seconds:.1f}\t{module}\n")
    if _TIER_SECONDS:
        terminalreporter.section("time by folder (setup, call and teardown)")
        for tier, seconds in sorted(_TIER_SECONDS.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{tier:>12}: {seconds:7.0f} s")


def pytest_sessionfinish(session, exitstatus):
    left = Server.stop_leftovers()  # a server must never outlive the run, whatever failed
    if left:
        print(f"\nstopped {len(left)} server(s) a test left running: {', '.join(left)}")
    # A run that selects no tests is a broken run, never a green one.
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    # Tests write no file of the checkout (build/ and the other ignored folders are theirs).
    after = _tree_status()
    if _TREE_AT_START is not None and after is not None and after != _TREE_AT_START:
        print(f"\nthe tests changed the checkout (git status --porcelain):\nbefore:\n{_TREE_AT_START}after:\n{after}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_SERVERS_BEFORE = pytest.StashKey[int]()
ENGINE_LIST = REPO / "build" / "engine-servers.tsv"  # lane, seconds until ready, cold compiles, test, model
MODULE_CPU_LIST = REPO / "build" / "module-cpu.tsv"  # lane, CPU seconds, test module


@pytest.fixture(scope="session")
def tiny_model():
    """The tiny model, kept between runs (tests/models.py); a test that changes its files copies it first."""
    # A long context, so that a request can run for seconds: the tiny model decodes thousands of tokens a second.
    return models.tiny_model("tiny-model", "--max-model-len", str(TINY_CONTEXT))


@pytest.fixture(scope="session")
def vllm_server(tiny_model):
    """One real vLLM server (CPU build) on the tiny model, in float32 and eager: the single-process
    reference of the e2e and container tests. It has a Hub token (unused: the model is local)."""
    env = {**VLLM_CPU_ENV, **EXACT, **EAGER, "OPTION_MAX_ROLLING_BATCH_SIZE": "64", "OPTION_HF_TOKEN": HUB_TOKEN}
    with Server(tiny_model, env=env, ready_timeout=ENGINE_READY_TIMEOUT) as server:
        yield shared("vllm_server", server)


@pytest.fixture(scope="session")
def textgen_server():
    """tests/model_dirs/sdk_textgen: a model.py that answers as LMI's text generation does (the SDK's tests)."""
    with Server(MODEL_DIRS / "sdk_textgen") as server:
        yield shared("textgen_server", server)


@pytest.fixture(scope="session")
def textgen_sse_server():
    """The same, its streams as server-sent events (option.output_formatter=sse)."""
    with Server(MODEL_DIRS / "sdk_textgen", env={"OPTION_OUTPUT_FORMATTER": "sse"}) as server:
        yield shared("textgen_sse_server", server)
