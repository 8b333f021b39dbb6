"""Start-up, worker death, shutdown and worker groups, with real processes."""

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import time

import requests

from container.core.launch import FrontendLaunch, GroupAddress, encode_launch
from container.core.proc import descendants, parents
from tests.reliability import record
from tests.server import MODEL_DIRS, Server, nice_of_threads


def test_ping_is_503_while_loading_then_200(tmp_path):
    # The model loads for 20 s: long enough for the server to answer while it loads on a busy machine.
    server = Server(MODEL_DIRS / "slow_init", env={"OPTION_INIT_SECONDS": "20"}).start(wait_ready=False)
    try:
        loading = server.wait_until(lambda r: r.status_code == 503, timeout=18)
        assert loading.json()["status"] == "Loading"
        assert server.invoke({"x": 1}).status_code == 503  # not ready: no worker to take it
        while True:  # /ping answers all along (a ping waiting on the load would time out)
            r = requests.get(server.url("/ping"), timeout=10)
            if r.status_code == 200:
                break
            assert r.status_code == 503
            time.sleep(0.1)
        assert r.json()["status"] == "Healthy"
        assert server.invoke({"x": 1}).json() == {"ready": True}
    finally:
        server.stop()


def test_killed_worker_fails_its_requests_fast_and_is_restarted():
    with Server(MODEL_DIRS / "lmi_echo", env={"OPTION_SYNC_HANDLER_THREADS": "4"}) as server:
        first_pid = server.invoke({"inputs": "before"}).json()["pid"]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            running = [pool.submit(server.invoke, {"sleep": 30}) for _ in range(3)]
            server.wait_until(lambda r: r.json()["workers"][0]["in_flight"] == 3, timeout=5)
            killed_at = time.monotonic()
            os.kill(first_pid, signal.SIGKILL)
            results = [f.result(timeout=10) for f in running]
            failed_after = time.monotonic() - killed_at
            assert failed_after < 5
        for r in results:
            assert r.status_code == 503
            assert "stopped while handling the request" in r.json()["error"]
        down = requests.get(server.url("/ping"), timeout=2)
        assert down.status_code != 200
        assert down.json()["workers"][0]["state"] in ("down", "starting", "loading")
        server.wait_until(lambda r: r.status_code == 200, timeout=30)
        healthy_after = time.monotonic() - killed_at
        after = server.invoke({"inputs": "after"})
        assert after.status_code == 200
        assert after.json()["pid"] != first_pid
        assert "restarting it" in server.log()
    record("killed-worker", "A worker killed with requests in flight", {
        "requests in flight at the kill -9": 3, "their answers": "503 (the group stopped)",
        "seconds until they were answered": f"{failed_after:.2f}",
        "seconds until /ping was 200 again": f"{healthy_after:.2f}", "next request": "200, from a new worker"},
        note="An LMI model.py (tests/model_dirs/lmi_echo); the built-in engine's EngineCore killed is "
             "covered by tests/e2e/test_vllm_engine.py.")


def test_sigterm_lets_a_slow_request_finish_and_exits_0():
    server = Server(MODEL_DIRS / "lmi_echo").start()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            slow = pool.submit(server.invoke, {"sleep": 3})
            server.wait_until(lambda r: r.json()["workers"][0]["in_flight"] == 1, timeout=5)
            server.process.send_signal(signal.SIGTERM)
            # while draining: new requests and /ping get 503
            draining = server.wait_until(lambda r: r.status_code == 503, timeout=5)
            assert draining.json()["status"] == "Draining"
            rejected = server.invoke({"inputs": "late"})
            assert rejected.status_code == 503 and "shutting down" in rejected.json()["error"]
            assert slow.result(timeout=30).status_code == 200
        assert server.wait_exit(30) == 0
    finally:
        server.stop()


def test_handler_import_failure_stops_start_up_with_the_reason():
    server = Server(MODEL_DIRS / "broken_import").start(wait_ready=False)
    assert server.wait_exit(30) == 1
    log = server.log()
    assert "No module named 'a_module_that_does_not_exist'" in log
    assert "start-up failed" in log


def test_handler_without_handle_stops_start_up_with_the_reason():
    server = Server(MODEL_DIRS / "no_handle").start(wait_ready=False)
    assert server.wait_exit(30) == 1
    assert ("model.py defines no function 'handle', no @input_formatter/@output_formatter and no SageMaker "
            "inference toolkit function (model_fn ...) (callables found: predict)") in server.log()


def test_model_directory_without_handler_stops_start_up(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    server = Server(tmp_path).start(wait_ready=False)
    assert server.wait_exit(30) == 1
    assert "nothing to serve: the model directory has neither model.py nor a model (config.json)" in server.log()



def test_hf_model_id_serves_without_a_model_directory(tmp_path):
    """Outside the image nothing is at /opt/ml/model: HF_MODEL_ID alone is enough to serve
    (the handler here is a file named by option.entryPoint, which needs no model directory)."""
    (tmp_path / "model").mkdir()
    env = {"HF_MODEL_ID": str(tmp_path / "model"), "OPTION_ENTRYPOINT": str(MODEL_DIRS / "lmi_echo" / "model.py")}
    with Server(tmp_path / "no-model-directory", env) as server:
        response = server.invoke({"x": 1})
        assert response.status_code == 200, server.log()
        assert response.json()["model_properties"]["model_id"] == str(tmp_path / "model")

def test_a_frontend_stopped_while_its_worker_boots_stops_at_once(tmp_path):
    """When start-up fails, the supervisor stops the frontend it has just started, whose
    gunicorn worker may still be booting. Stopped then, the worker must still drain and
    exit: not lose the signal (gunicorn would wait its graceful timeout, 7 s here, before
    killing it) nor fail on the app it has not loaded yet. Sent as soon as the worker is
    forked, the signal lands in that window in most of these tries."""
    for attempt in range(6):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        launch = FrontendLaunch(listen_fd=listener.fileno(), groups=[GroupAddress(0, str(tmp_path / "g.sock"))],
                                job_queue_size=4, max_payload_bytes=1 << 20, predict_timeout=10, grace_period=2)
        (tmp_path / "frontend.json").write_bytes(encode_launch(launch))
        frontend = subprocess.Popen([sys.executable, "-m", "container.frontend.server", str(tmp_path / "frontend.json")],
                                    pass_fds=[listener.fileno()], stderr=subprocess.PIPE, text=True)
        listener.close()
        deadline = time.monotonic() + 30
        while not descendants([frontend.pid]) and frontend.poll() is None and time.monotonic() < deadline:
            time.sleep(0.0005)
        frontend.send_signal(signal.SIGTERM)
        started = time.monotonic()
        _, log = frontend.communicate(timeout=30)
        took = time.monotonic() - started
        assert (frontend.returncode, took < 5, "Traceback" in log) == (0, True, False), f"try {attempt}: {log}"


def test_two_groups_get_their_device_slices():
    with Server(MODEL_DIRS / "gpu_groups", env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) as server:
        workers = requests.get(server.url("/ping"), timeout=2).json()["workers"]
        assert [w["devices"] for w in workers] == ["0,1", "2,3"]
        seen = {server.invoke({"inputs": i}).json()["cuda_visible_devices"] for i in range(4)}
        assert seen == {"0,1", "2,3"}


def test_frontend_and_groups_share_the_session_each_in_a_process_group_of_its_own():
    """One session: where Linux shares CPU time between sessions (autogroup), a busy
    engine in a session of its own kept the frontend off the CPU for seconds. Own process
    groups: a terminal's Ctrl-C reaches the supervisor alone, which stops the rest."""
    with Server(MODEL_DIRS / "gpu_groups", env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) as server:
        supervisor = server.process.pid
        children = [int(p) for p in subprocess.run(["pgrep", "-P", str(supervisor)],
                                                   capture_output=True, text=True).stdout.split()]
        assert len(children) == 3  # the frontend and two groups
        assert {os.getsid(pid) for pid in children} == {os.getsid(supervisor)}
        assert {os.getpgid(pid) for pid in children} == set(children)
        assert sorted(server.group_pids()) == sorted(server.worker_pids())
        assert server.invoke({"inputs": "x"}).status_code == 200


def test_what_a_group_leaves_behind_goes_with_it():
    """A process the handler orphans stays below the group's worker (which adopts it),
    and is killed with the rest of the group when the worker dies; the worker's next
    start serves again."""
    with Server(MODEL_DIRS / "orphans") as server:
        answer = server.invoke({}).json()
        orphan, worker = answer["orphan"], answer["worker"]
        assert parents()[orphan] == worker
        os.kill(worker, signal.SIGKILL)
        server.wait_until(lambda r: r.status_code != 200, timeout=10)
        server.wait_until(lambda r: r.status_code == 200, timeout=60)
        assert orphan not in parents(zombies=True)  # killed, and reaped
        again = server.invoke({}).json()
        assert again["worker"] != worker and parents()[again["orphan"]] == again["worker"]
    assert again["orphan"] not in parents()  # a stopped server leaves nothing either


ENGINE_LIKE = """
import subprocess, sys, time
from djl_python import Input, Output

engine = None

def handle(inputs: Input):
    global engine
    if inputs.is_empty():  # initialisation: start an engine-like process with a second thread
        engine = subprocess.Popen([sys.executable, "-c", "import threading, time; "
                                   "threading.Thread(target=time.sleep, args=(600,)).start(); time.sleep(600)"])
        return None
    time.sleep(inputs.get_as_json().get("sleep", 0))
    return Output().add_as_json({"engine": engine.pid})
"""


def test_what_the_handler_starts_runs_below_the_request_path_while_it_serves_many(tmp_path):
    """Once the model is loaded, every thread of the processes the handler started (an
    engine's) runs at nice 0 while at most SHARED_UP_TO requests are in flight, and at nice
    10 (ENGINE_NICE) while more are; the worker, the frontend and the supervisor stay at 0."""
    from container.core.proc import ENGINE_NICE
    from container.worker.priority import SHARED_UP_TO

    (tmp_path / "model.py").write_text(ENGINE_LIKE)
    with Server(tmp_path, env={"OPTION_SYNC_HANDLER_THREADS": "8"}) as server:
        engine = server.invoke({"inputs": "x"}).json()["engine"]
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{engine}/task")) < 2:  # its second thread has started
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert nice_of_threads(engine) == {0}
        with concurrent.futures.ThreadPoolExecutor(SHARED_UP_TO + 1) as pool:
            calls = [pool.submit(server.invoke, {"sleep": 2}) for _ in range(SHARED_UP_TO + 1)]
            deadline = time.monotonic() + 1.5
            while nice_of_threads(engine) != {ENGINE_NICE}:
                assert time.monotonic() < deadline, "the engine did not go below the request path"
                time.sleep(0.05)
            assert all(call.result().status_code == 200 for call in calls)
        (worker,) = server.worker_pids()
        frontend = [pid for pid, parent in parents().items() if parent == server.process.pid and pid != worker]
        for pid in (worker, server.process.pid, *frontend):
            assert nice_of_threads(pid) == {0}, pid


def test_requirements_txt_is_installed_before_loading():
    try:
        with Server(MODEL_DIRS / "with_requirements") as server:
            assert server.invoke({}).json() == {"message": "installed from requirements.txt"}
            assert "requirements installed" in server.log()
    finally:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "sagelmi-reqcheck"],
                       capture_output=True)


def test_port_is_bound_before_the_model_loads():
    # The model loads for a minute: the first answer comes while it loads, however busy the machine.
    server = Server(MODEL_DIRS / "slow_init", env={"OPTION_INIT_SECONDS": "60"}).start(wait_ready=False)
    try:
        first = server.wait_until(lambda r: True, timeout=50)
        assert first.status_code == 503
    finally:
        server.stop()
