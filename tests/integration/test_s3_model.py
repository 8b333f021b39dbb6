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
