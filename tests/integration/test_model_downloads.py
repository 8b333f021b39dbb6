"""option.model_id names a Hub model or an s3:// prefix: it is downloaded before the
workers start, with progress in the log, and a download that cannot happen stops
start-up saying why. The Hub is tests/fake_hub.py (these machines cannot reach
the real one), S3 is moto's server; the clients are the real huggingface_hub and boto3."""

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from container.core.artifacts import ArtifactError, Progress, fetch_s3
from tests.fake_hub import FakeHub, Repo
from tests.server import MODEL_DIRS, REPO, Server, clean_env, free_port

WEIGHTS = os.urandom(25 * 2 ** 20)  # bigger than huggingface_hub's 10 MiB write chunk: progress shows mid-file


@pytest.fixture(scope="module")
def hub():
    repos = {
        "acme/tiny": Repo({"config.json": b'{"model_type": "llama"}', "model.safetensors": WEIGHTS,
                           "pytorch_model.bin": b"the same weights, another format", "tokenizer/vocab.txt": b"a b"},
                          seconds_per_file=3.0),
        "acme/private": Repo({"config.json": b"{}"}, token="hf_right"),
        "acme/gated": Repo({"config.json": b"{}"}, gated=True),
    }
    with FakeHub(repos) as fake:
        yield fake


def hub_env(hub, tmp_path, **extra) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_PROGRESS_BARS": "1", **extra}


def test_progress_is_logged_at_most_once_an_interval_with_rate_and_time_left(caplog):
    now = [100.0]
    caplog.set_level(logging.INFO, "sagelmi.artifacts")
    progress = Progress("s3://b/m", total=100 * 2 ** 20, files=3, interval=10, clock=lambda: now[0])
    for _ in range(4):  # 2 MiB a second for 20 s, reported every 10 s
        now[0] += 5
        progress.add(10 * 2 ** 20)
    progress.finish()
    assert [r.getMessage() for r in caplog.records if r.name == "sagelmi.artifacts"] == [
        "downloading s3://b/m: 3 file(s), 100.0 MiB",
        "downloading s3://b/m: 20.0 MiB of 100.0 MiB (20%), 2.0 MiB/s, about 40s left",
        "downloading s3://b/m: 40.0 MiB of 100.0 MiB (40%), 2.0 MiB/s, about 30s left",
        "downloaded s3://b/m: 40.0 MiB in 20.0s (2.0 MiB/s)",
    ]


def test_a_hub_model_is_in_the_cache_before_the_workers_start(hub, tmp_path):
    env = hub_env(hub, tmp_path, HF_MODEL_ID="acme/tiny")
    with Server(MODEL_DIRS / "lmi_echo", env=env) as server:
        # the handler gets the id; the files are in the cache, where vLLM and transformers look
        assert server.invoke({"inputs": "x"}).json()["model_properties"]["model_id"] == "acme/tiny"
        log = server.log()
    snapshot = next((tmp_path / "hf" / "hub" / "models--acme--tiny" / "snapshots").iterdir())
    assert (snapshot / "model.safetensors").read_bytes() == WEIGHTS
    assert sorted(hub.repos["acme/tiny"].downloads) == ["config.json", "model.safetensors", "tokenizer/vocab.txt"]
    assert "downloading acme/tiny from the Hub: 3 file(s), 25.0 MiB" in log
    assert "downloaded acme/tiny from the Hub: 25.0 MiB in " in log
    assert log.index("downloaded acme/tiny") < log.index("loading with")  # before the handler's load_model


def test_hub_progress_shows_bytes_while_a_file_downloads(hub, tmp_path):
    script = textwrap.dedent("""
        import logging
        from container.core.hub_download import fetch_hub
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        fetch_hub("acme/tiny", interval=0.5)
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env=clean_env(hub_env(hub, tmp_path)))
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("downloading acme/tiny")]
    assert any(" MiB of 25.0 MiB (" in line and "MiB/s" in line and not line.startswith("downloading acme/tiny "
               "from the Hub: 0 B") for line in lines), lines


@pytest.mark.parametrize("model_id, env, message", [
    ("acme/nope", {}, "Hub model 'acme/nope' not found (a private model needs HF_TOKEN"),
    ("acme/private", {}, "Hub model 'acme/private' not found (a private model needs HF_TOKEN"),
    ("acme/gated", {}, "Hub model 'acme/gated' is gated: set HF_TOKEN"),
    ("acme/private", {"HF_REVISION": "v2", "HF_TOKEN": "hf_right"}, "Hub model 'acme/private' has no revision 'v2'"),
    ("./not/here", {}, "option.model_id='./not/here' is neither a directory here, an s3:// URI nor a Hub model id"),
], ids=["missing", "private-without-token", "gated", "revision", "bad-path"])
def test_a_model_that_cannot_be_fetched_stops_start_up_saying_why(hub, tmp_path, model_id, env, message):
    server = Server(MODEL_DIRS / "lmi_echo", env=hub_env(hub, tmp_path, HF_MODEL_ID=model_id, **env))
    assert server.start(wait_ready=False).wait_exit(60) == 1
    assert message in server.log()
    assert "Traceback" not in server.log()


def test_a_private_hub_model_is_fetched_with_hf_token(hub, tmp_path):
    env = hub_env(hub, tmp_path, HF_MODEL_ID="acme/private", HF_TOKEN="hf_right")
    with Server(MODEL_DIRS / "lmi_echo", env=env) as server:
        assert server.invoke({"inputs": "x"}).status_code == 200
    assert hub.repos["acme/private"].downloads == ["config.json"]


# -- S3

AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_endpoint():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    s3.create_bucket(Bucket="models")
    s3.put_object(Bucket="models", Key="big/model.safetensors", Body=os.urandom(20 * 2 ** 20))
    s3.put_object(Bucket="models", Key="big/config.json", Body=b"{}")
    yield endpoint
    server.stop()


def test_s3_progress_counts_bytes_as_they_arrive(s3_endpoint, tmp_path, monkeypatch, caplog):
    for name, value in {**AWS, "AWS_ENDPOINT_URL_S3": s3_endpoint, "TMPDIR": str(tmp_path)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("tempfile.tempdir", None)
    caplog.set_level(logging.INFO, "sagelmi.artifacts")
    local = fetch_s3("s3://models/big", interval=0)
    assert local.is_relative_to(tmp_path)
    assert sorted(p.name for p in local.iterdir() if not p.name.startswith(".")) == ["config.json", "model.safetensors"]
    lines = [r.getMessage() for r in caplog.records if r.name == "sagelmi.artifacts"]
    assert lines[0] == "downloading s3://models/big: 2 file(s), 20.0 MiB"
    assert any(" of 20.0 MiB (" in line for line in lines[1:-1]), lines
    assert lines[-1].startswith("downloaded s3://models/big: 20.0 MiB in ")


@pytest.mark.parametrize("uri, env, message", [
    ("s3://no-such-bucket/m", AWS, "cannot download s3://no-such-bucket/m: bucket 'no-such-bucket' does not exist"),
    ("s3://models/nothing/here", AWS, "no objects under the prefix 'nothing/here/' in bucket 'models'"),
    ("s3://models/big", {"AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                         "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent"},
     "cannot download s3://models/big: no AWS credentials found"),
], ids=["bucket", "prefix", "credentials"])
def test_an_s3_model_that_cannot_be_fetched_says_which_part_is_missing(s3_endpoint, tmp_path, monkeypatch, uri, env,
                                                                       message):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**env, "AWS_ENDPOINT_URL_S3": s3_endpoint, "TMPDIR": str(tmp_path)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("tempfile.tempdir", None)
    with pytest.raises(ArtifactError) as caught:
        fetch_s3(uri)
    assert message in str(caught.value)


def test_a_large_s3_object_comes_in_ranged_parts_with_the_same_bytes(s3_endpoint, tmp_path, monkeypatch):
    for name, value in {**AWS, "AWS_ENDPOINT_URL_S3": s3_endpoint, "TMPDIR": str(tmp_path)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("tempfile.tempdir", None)
    monkeypatch.setattr("container.core.artifacts.S3_PART_BYTES", 5 * 2**20)  # 20 MiB: four parts
    ranges = []
    original = boto3.session.Session.client

    def client(self, *args, **kwargs):
        made = original(self, *args, **kwargs)
        made.meta.events.register("provide-client-params.s3.GetObject", lambda params, **_: ranges.append(params.get("Range")))
        return made

    monkeypatch.setattr(boto3.session.Session, "client", client)
    local = fetch_s3("s3://models/big", interval=3600)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    expected = s3.get_object(Bucket="models", Key="big/model.safetensors")["Body"].read()
    assert (local / "model.safetensors").read_bytes() == expected
    starts = sorted(int(r.removeprefix("bytes=").split("-")[0]) for r in ranges if r)
    assert starts == [i * 5 * 2**20 for i in range(4)]  # four parts of 5 MiB (the last one's end left open)


def test_hub_file_names_leading_out_of_the_cache_stop_start_up_and_download_nothing(tmp_path):
    """huggingface_hub (2.x) refuses such names itself, before it writes a file; the dry run that
    sizes the download comes first, so not even the good files are downloaded."""
    outside = tmp_path / "outside"
    outside.mkdir()
    names = ["../" * 30 + f"{str(outside).lstrip('/')}/dotdot.pth", f"{outside}/absolute.pth"]
    for name in names:
        repo = Repo({"config.json": b"{}", name: b"import os"})
        with FakeHub({"acme/escape": repo}) as hub:
            server = Server(MODEL_DIRS / "lmi_echo", env=hub_env(hub, tmp_path, HF_MODEL_ID="acme/escape"))
            assert server.start(wait_ready=False).wait_exit(60) == 1
        log = server.log()
        (line,) = [line for line in log.splitlines() if "start-up failed" in line]
        assert f"cannot download Hub model 'acme/escape': Invalid filename '{name}'" in line, line
        assert "Traceback" not in log
        assert repo.downloads == [] and list(outside.iterdir()) == []
        assert not [p for p in (tmp_path / "hf").rglob("*") if p.is_file() and p.parent.name == "blobs"]
