"""LoRA adapters registered from ``s3://`` (S3 is moto's server): a listing with keys that lead out
of the download directory, or over ``max_adapter_size_in_mb``, is refused before anything is
written; each registration downloads its own copy without holding the registry's lock, and
unregistering removes it.

The routes' answers (LMI's and AWS's vLLM container's ``POST /adapters``) are checked on a ``model.py`` server (the registry refuses before any worker
group is asked); what a registration downloads is checked on the registry itself, with no worker
group (tests/e2e/test_lora.py has the engine serving a re-registered adapter)."""

import json
import socket
import threading
import time
from pathlib import Path

import boto3
import pytest
import requests
from moto.server import ThreadedMotoServer

from container.core.artifacts import download_root
from container.core.errors import Conflict
from container.core.launch import ModelInfo
from container.frontend.adapters import AdapterRegistry
from tests.server import MODEL_DIRS, Server, free_port

AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3():
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    moto.start()
    endpoint = "http://{}:{}".format(*moto.get_host_and_port())
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
    client.create_bucket(Bucket="adapters")
    yield endpoint, client
    moto.stop()


def upload_adapter(client, prefix: str, weights: bytes = b"weights", **extra: bytes) -> None:
    files = {"adapter_config.json": json.dumps({"r": 8, "peft_type": "LORA"}).encode(),
             "adapter_model.safetensors": weights}
    for name, body in {**files, **extra}.items():
        client.put_object(Bucket="adapters", Key=f"{prefix}/{name}", Body=body)


def files_under(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file()] if directory.exists() else []


def downloaded(server) -> list[Path]:
    """What the server downloaded: under the download cache or its adapters' directory."""
    tmp = server.tmp / "tmp"
    return files_under(tmp / "sagelmi-models") + [p for d in tmp.glob("sagelmi-*/adapters") for p in files_under(d)]


# -- the route


@pytest.fixture(scope="module")
def server(s3, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapter-route")
    (tmp / "tmp").mkdir()
    env = {**AWS, "AWS_ENDPOINT_URL_S3": s3[0], "TMPDIR": str(tmp / "tmp"), "OPTION_ENABLE_LORA": "true",
           "OPTION_MAX_LORA_RANK": "8", "SERVING_MAX_ADAPTER_SIZE_IN_MB": "1"}
    with Server(MODEL_DIRS / "lmi_echo", env=env) as server:
        server.tmp = tmp
        yield server


def register(server, name: str, src: str, route: str = "lmi") -> requests.Response:
    if route == "sagemaker":  # AWS's vLLM container's route
        return requests.post(server.url("/adapters"), json={"name": name, "src": src}, timeout=60)
    return requests.post(server.url("/models/lmi_echo/adapters"), params={"name": name, "src": src}, timeout=60)


ROUTES = pytest.mark.parametrize("route", ["lmi", "sagemaker"])


@ROUTES
def test_keys_leading_out_of_the_download_are_a_400_writing_nothing(server, s3, route):
    _, client = s3
    outside = server.tmp / f"outside-{route}"
    outside.mkdir()
    prefix = f"bad-{route}"
    absolute = f"{prefix}/{outside}/absolute.pth"  # the prefix, then an absolute path
    dotdot = f"{prefix}/" + "../" * 30 + f"{str(outside).lstrip('/')}/dotdot.pth"
    skip = len(prefix) + 1
    upload_adapter(client, prefix, **{absolute[skip:]: b"import os", dotdot[skip:]: b"import os"})
    response = register(server, "bad", f"s3://adapters/{prefix}", route)
    assert response.status_code == 400, response.text
    body = response.json()
    assert set(body) == {"code", "message", "error"} and body["code"] == 400
    assert repr(absolute) in body["error"] and repr(dotdot) in body["error"]
    assert "would be written outside the download directory" in body["error"]
    assert list(outside.iterdir()) == []
    assert downloaded(server) == []  # not even the adapter's good files
    assert requests.get(server.url("/ping"), timeout=5).status_code == 200
    assert requests.get(server.url("/models/lmi_echo/adapters"), timeout=5).json() == {"adapters": []}


@ROUTES
def test_an_adapter_over_max_adapter_size_in_mb_is_a_413_before_it_downloads(server, s3, route):
    _, client = s3
    upload_adapter(client, "big", weights=b"\0" * (2**20 + 1))  # over the server's 1 MiB
    response = register(server, "big", "s3://adapters/big", route)
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert "max_adapter_size_in_mb=1" in error and "SERVING_MAX_ADAPTER_SIZE_IN_MB" in error, error
    assert downloaded(server) == []


@ROUTES
def test_a_refused_registration_leaves_no_files(server, s3, route):
    """A model.py does not serve LoRA adapters: its worker group refuses the downloaded adapter."""
    _, client = s3
    upload_adapter(client, "good")
    response = register(server, "good", "s3://adapters/good", route)
    assert response.status_code == 400 and "does not serve LoRA adapters" in response.json()["error"], response.text
    assert downloaded(server) == []


# -- the registry


@pytest.fixture
def registry(s3, tmp_path, monkeypatch):
    for name, value in {**AWS, "AWS_ENDPOINT_URL_S3": s3[0], "TMPDIR": str(tmp_path)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("tempfile.tempdir", None)
    model = ModelInfo(name="m", location="", lora=True, max_lora_rank=8)
    return AdapterRegistry(model, [], timeout=30, download_root=str(download_root()))


def test_unregistering_removes_the_files_it_downloaded(registry, s3):
    _, client = s3
    upload_adapter(client, "shared")
    one = registry.register("one", "s3://adapters/shared")
    two = registry.register("two", "s3://adapters/shared")  # the same source: a copy of its own
    assert Path(one.path, "adapter_model.safetensors").is_file() and Path(two.path).is_dir()
    registry.unregister("one")
    assert not Path(one.path).exists()
    assert Path(two.path, "adapter_model.safetensors").read_bytes() == b"weights"  # still served
    registry.unregister("two")
    assert not Path(two.path).exists()


def test_a_registration_after_the_objects_changed_gets_the_new_ones(registry, s3):
    _, client = s3
    upload_adapter(client, "changing", weights=b"first")
    first = registry.register("c", "s3://adapters/changing")
    assert Path(first.path, "adapter_model.safetensors").read_bytes() == b"first"
    registry.unregister("c")
    upload_adapter(client, "changing", weights=b"second")
    again = registry.register("c", "s3://adapters/changing")
    assert Path(again.path, "adapter_model.safetensors").read_bytes() == b"second"


class GatedS3:
    """A TCP relay in front of moto that holds every request for an object under ``/<bucket>/<gated>/``
    until ``open`` is set (``held`` is set once one waits): a download that takes as long as a test
    wants."""

    def __init__(self, upstream: str, gated: str) -> None:
        self.upstream = upstream.removeprefix("http://").split(":")
        self.gated = f"/adapters/{gated}/".encode()
        self.held, self.open = threading.Event(), threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = "http://127.0.0.1:{}".format(self.listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        upstream = socket.create_connection((self.upstream[0], int(self.upstream[1])))
        threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()
        while data := client.recv(65536):
            if self.gated in data.split(b"\r\n", 1)[0]:
                self.held.set()
                self.open.wait()
            upstream.sendall(data)
        upstream.close()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        sink.close()

    def close(self) -> None:
        self.open.set()
        self.listener.close()


def test_a_download_does_not_hold_the_registry(registry, s3, monkeypatch):
    _, client = s3
    upload_adapter(client, "slow")
    upload_adapter(client, "fast")
    gate = GatedS3(s3[0], "slow")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", gate.url)
    outcome: dict[str, object] = {}

    def run(key: str, *args) -> threading.Thread:
        def call() -> None:
            try:
                outcome[key] = registry.register(*args)
            except Exception as exc:  # noqa: BLE001 - kept for the asserts
                outcome[key] = exc
        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        return thread

    try:
        slow = run("slow", "slow", "s3://adapters/slow")
        assert gate.held.wait(30), "the slow adapter's download never started"
        fast = run("fast", "fast", "s3://adapters/fast")
        fast.join(60)  # (the slow download is held until the end: a registration behind it never ends)
        assert "fast" in outcome, "a registration waited for another one's download"
        assert [a.name for a in registry.list()] == ["fast"]
        taken = run("again", "slow", "s3://adapters/fast")
        taken.join(60)
        assert isinstance(outcome.get("again"), Conflict)  # the name is taken while its files download
    finally:
        gate.close()
    slow.join(30)
    assert sorted(a.name for a in registry.list()) == ["fast", "slow"], outcome
