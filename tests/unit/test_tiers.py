"""The tiers mean what they say: a test that starts a built-in engine without the ``slow`` marker
fails (``make test-fast``, ``-m "not slow"``, starts none), and a run leaves the checkout as it was."""

import pytest

from tests import conftest
from tests.server import MODEL_DIRS, Server


class _Item:
    """What the tier check reads of a test item."""

    def __init__(self, slow: bool) -> None:
        self.nodeid = "tests/integration/test_x.py::test_y"
        self.stash = pytest.Stash()
        self._slow = slow

    def get_closest_marker(self, name):
        return pytest.mark.slow.mark if name == "slow" and self._slow else None


def _server_that_logged(line: str) -> Server:
    server = Server(MODEL_DIRS / "lmi_echo")
    with open(server.log_file.name, "w") as log:
        log.write(f"2026-11-28 12:00:00 INFO [sagelmi.loader] {line}\n")
    return server


@pytest.mark.parametrize("line", ["handler built-in loaded (engine VllmEngine)",
                                  'starting vLLM with {"model": "/tmp/tiny"}'])
def test_an_engine_started_by_a_test_without_slow_fails_it(line):
    item = _Item(slow=False)
    conftest.pytest_runtest_setup(item)
    Server.started.append(_server_that_logged(line))
    try:
        with pytest.raises(AssertionError, match="without the slow marker"):
            conftest.pytest_runtest_teardown(item)
        slow = _Item(slow=True)
        slow.stash[conftest._SERVERS_BEFORE] = item.stash[conftest._SERVERS_BEFORE]
        conftest.pytest_runtest_teardown(slow)  # the same server under a slow test: fine
    finally:
        Server.started.pop()


def test_a_model_py_server_is_not_an_engine():
    item = _Item(slow=False)
    conftest.pytest_runtest_setup(item)
    Server.started.append(_server_that_logged("handler model.py loaded (sync handle)"))
    try:
        conftest.pytest_runtest_teardown(item)
    finally:
        Server.started.pop()
