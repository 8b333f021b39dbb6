"""option.model_id=s3://... is downloaded before the workers start (S3 is moto's server)."""

from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from tests.server import MODEL_DIRS, Server, free_port


@pytest.fixture
def s3_endpoint():
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def test_s3_prefix_is_downloaded_and_handed_to_the_handler(s3_endpoint, tmp_path):
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    s3.create_bucket(Bucket="models")
    s3.put_object(Bucket="models", Key="llama/v1/config.json", Body=b'{"model_type": "llama"}')
    s3.put_object(Bucket="models", Key="llama/v1/tokenizer/vocab.txt", Body=b"a b c")
    s3.put_object(Bucket="models", Key="llama/v10/other.bin", Body=b"not this one")
    env = {**AWS, "AWS_ENDPOINT_URL_S3": s3_endpoint, "HF_MODEL_ID": "s3://models/llama/v1",
           "TMPDIR": str(tmp_path)}
    with Server(MODEL_DIRS / "lmi_echo", env=env) as server:
        local = server.invoke({"inputs": "x"}).json()["model_properties"]["model_id"]
        assert local.startswith(str(tmp_path))
        files = sorted(p.relative_to(local).as_posix() for p in Path(local).rglob("*")
                       if p.is_file() and not p.name.startswith(".sagelmi"))
        assert files == ["config.json", "tokenizer/vocab.txt"]
        assert "downloading s3://models/llama/v1: 2 file(s), 28 B" in server.log()


def test_missing_s3_prefix_stops_start_up(s3_endpoint, tmp_path):
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket="empty")
    env = {**AWS, "AWS_ENDPOINT_URL_S3": s3_endpoint, "HF_MODEL_ID": "s3://empty/nothing", "TMPDIR": str(tmp_path)}
    server = Server(MODEL_DIRS / "lmi_echo", env=env).start(wait_ready=False)
    assert server.wait_exit(30) == 1
    assert "cannot download s3://empty/nothing: no objects under the prefix 'nothing/' in bucket 'empty'" in server.log()


def test_keys_leading_out_of_the_download_stop_start_up_and_write_nothing(s3_endpoint, tmp_path):
    """'prefix//<abs>' and 'prefix/../../..<abs>' would write files anywhere (the server runs as root
    in the image): start-up stops in one line naming them, before any object is downloaded."""
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    s3.create_bucket(Bucket="hostile")
    outside = tmp_path / "outside"
    outside.mkdir()
    absolute = f"m/{outside}/absolute.pth"  # the key's remainder after 'm/' is an absolute path
    dotdot = "m/" + "../" * 30 + f"{str(outside).lstrip('/')}/dotdot.pth"  # '..' past / stays at /
    for key in ("m/config.json", absolute, dotdot):
        s3.put_object(Bucket="hostile", Key=key, Body=b"import os")
    env = {**AWS, "AWS_ENDPOINT_URL_S3": s3_endpoint, "HF_MODEL_ID": "s3://hostile/m", "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    server = Server(MODEL_DIRS / "lmi_echo", env=env).start(wait_ready=False)
    assert server.wait_exit(60) == 1
    log = server.log()
    assert list(outside.iterdir()) == []
    assert not [p for p in (tmp_path / "tmp").rglob("*") if p.is_file()]  # not even config.json
    (line,) = [line for line in log.splitlines() if "start-up failed" in line]
    assert "cannot download s3://hostile/m:" in line and repr(absolute) in line and repr(dotdot) in line
    assert "would be written outside the download directory" in line and "Traceback" not in log


def test_a_later_start_downloads_again_when_the_objects_changed(s3_endpoint, tmp_path, monkeypatch):
    from container.core.artifacts import fetch_s3

    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    s3.create_bucket(Bucket="changing")
    s3.put_object(Bucket="changing", Key="m/config.json", Body=b'{"v": 1}')
    for name, value in {**AWS, "AWS_ENDPOINT_URL_S3": s3_endpoint, "TMPDIR": str(tmp_path)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("tempfile.tempdir", None)
    first = fetch_s3("s3://changing/m")
    assert (first / "config.json").read_bytes() == b'{"v": 1}'
    assert fetch_s3("s3://changing/m") == first  # unchanged: the same copy
    s3.put_object(Bucket="changing", Key="m/config.json", Body=b'{"v": 2}')
    s3.put_object(Bucket="changing", Key="m/extra.txt", Body=b"new")
    again = fetch_s3("s3://changing/m")
    assert (again / "config.json").read_bytes() == b'{"v": 2}' and (again / "extra.txt").read_bytes() == b"new"
