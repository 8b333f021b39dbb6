"""The tests' own servers never outlive a test: one that does not get ready in time is
stopped by ``start``, and whatever a test leaves running is stopped at the session's end."""

import os
import threading
import time

import pytest

from tests.server import MODEL_DIRS, Server


def test_a_server_that_is_not_ready_in_time_is_stopped():
    server = Server(MODEL_DIRS / "slow_init", ready_timeout=0.5)  # it takes seconds to load
    with pytest.raises(AssertionError, match="never matched within 0.5s"):
        server.start()
    assert server.process.poll() is not None
    assert server not in Server.live


def test_servers_left_running_are_stopped_at_the_end():
    server = Server(MODEL_DIRS / "lmi_echo").start()
    assert server in Server.live
    left = Server.stop_leftovers([server])  # what the session's end does with every live server
    assert left == [f"{server.model_dir} on port {server.port}"]
    assert server.process.poll() == 0 and server not in Server.live


def test_stopping_a_server_that_is_not_ready_leaves_no_worker_behind():
    # not ready within 10 s (its load takes a minute), time enough for its worker to start on a busy machine
    server = Server(MODEL_DIRS / "slow_init", env={"OPTION_INIT_SECONDS": "60"}, ready_timeout=10)
    seen: set[int] = set()
    done = threading.Event()

    def watch():  # the worker pids while start() waits
        while not done.is_set():
            if server.process is not None and server.process.poll() is None:
                seen.update(server.worker_pids())
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with pytest.raises(AssertionError):
            server.start()
    finally:
        done.set()
        watcher.join()
    assert seen, "the worker never started"
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in seen):
        assert time.monotonic() < deadline, f"workers left running: {seen}"
        time.sleep(0.1)
