"""What the e2e tests share: the settings vLLM's CPU build needs here, the tiny model with the reasoning
and tool tokens, the lmi-dist server. The tiny model and the one vLLM server on it are in
tests/conftest.py (the container tests compare with it too)."""

import shutil
import subprocess
import sys

import pytest

from tests import models
from tests.readme import run_shell, section, serve_settings, shell_commands
from tests.server import REPO, Server, clean_env, shared

# What vLLM's CPU build needs on a small machine (see docs/troubleshooting.md).
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
# Servers in float32 whose point is not vLLM's compiled model run it eager: a start without torch.compile
# costs about 35 s of CPU less per engine process (docs/testing.md). Not in bfloat16: there vLLM's CPU
# build lost its model runner process on the first request of some eager servers on a loaded machine, with
# no message. The shared ``vllm_server``, the references compared with it and the shared lmi-dist server
# (its option-matrix cell is lmi-dist + eager) are among them. vLLM's default, the compiled model, is what
# the pipeline-parallel and LoRA servers, ``make run``, ``make bench``, the SDK's README snippet and the
# image's servers (its lmi-dist cluster included) run.
EAGER = {"OPTION_ENFORCE_EAGER": "true"}
# Tests that compare greedy tokens across servers whose sums run in a different order (tensor and
# pipeline shards, other batch shapes) serve in float32: in bfloat16, vLLM's CPU default, near-ties flip.
EXACT = {"OPTION_DTYPE": "float32"}
# A Hub token in the reference server's settings: vLLM gets it, a local model never sends it anywhere,
# and the log shows it as ***.
HUB_TOKEN = "hf_e2eTokenThatMustNeverBeLogged0123"
TINY_CONTEXT = 8192
# An engine start imports vLLM in three processes and may compile the model; at a run's start, three lanes
# start engines at once beside the image's build: 4 minutes were too few for an eager start then. (Below
# pytest's own timeout of a test, 600 s, which counts its fixtures' set-up too.)
ENGINE_READY_TIMEOUT = 480


@pytest.fixture(scope="session")
def tiny_think_model():
    """The tiny model with the special tokens vLLM's reasoning and tool parsers look for (kept: tests/models.py)."""
    return models.tiny_model("tiny-think-model",
                             *(f"--special-token={t}" for t in ("<think>", "</think>", "<tool_call>", "</tool_call>")))


# The lmi-dist try-out (docs/large_models.md): write the tiny model, serve it split over two ranks.
LMI_DIST_README = shell_commands(section("lmi-dist configurations"))
LMI_DIST_README_ENV = {"OPTION_ROLLING_BATCH": "lmi-dist", "TENSOR_PARALLEL_DEGREE": "2", **VLLM_CPU_ENV}
# What the option matrix's lmi-dist cell adds (eager; prefix caching is vLLM's default on x86; the README's
# model has a context of 1024 already): the cell is served by the same server.
LMI_DIST_CELL = {**EAGER, "OPTION_ENABLE_PREFIX_CACHING": "true", "OPTION_MAX_MODEL_LEN": "1024"}


@pytest.fixture(scope="session")
def lmi_dist_server(tmp_path_factory):
    """The README's lmi-dist try-out, in float32 (its tokens are compared with ``vllm_server``'s), eager."""
    directory = str(tmp_path_factory.mktemp("readme-tiny"))
    write, serve = (command.replace("/tmp/tiny-model", directory) for command in LMI_DIST_README)
    written = run_shell(write, 0, timeout=300)
    assert written.returncode == 0, written.stderr
    env, model_dir = serve_settings(serve)
    assert env == LMI_DIST_README_ENV
    with Server(model_dir, env={**env, **EXACT, **LMI_DIST_CELL}, ready_timeout=ENGINE_READY_TIMEOUT) as server:
        yield shared("lmi_dist_server", server)


def make_adapter(base, directory, seed: int, rank: int = 8):
    """A peft LoRA adapter of the tiny model ``base``, random but fixed by ``seed``, in ``directory``."""
    subprocess.run([sys.executable, "-m", "container.tools.tiny_adapter", str(base), str(directory), "--seed", str(seed),
                    "--rank", str(rank)], check=True, cwd=REPO, env=clean_env(), capture_output=True, timeout=300)
    return directory


@pytest.fixture(scope="session")
def lora_model(tiny_model, tmp_path_factory):
    """The tiny model with adapter a1 under adapters/ (found at start-up) and more beside it, written anew
    each run at a path that stays the same (the LoRA server serves it compiled: tests/models.py)."""
    with models.stable_folder("lora-model", tmp_path_factory.mktemp("lora-model")) as folder:
        directory = folder / "tiny"
        shutil.copytree(tiny_model, directory)
        make_adapter(directory, directory / "adapters" / "a1", seed=1)
        make_adapter(directory, directory / "extra" / "a2", seed=2)
        make_adapter(directory, directory / "extra" / "wide", seed=3, rank=16)
        yield directory


LORA = {"OPTION_ENABLE_LORA": "true", "OPTION_MAX_LORA_RANK": "8", "OPTION_MAX_LORAS": "2",
        "OPTION_MAX_CPU_LORAS": "4", "OPTION_MAX_ROLLING_BATCH_SIZE": "16"}
# What the option matrix's LoRA cell adds (chunked prefill is vLLM's default on x86): the cell is served by
# the same server.
LORA_CELL = {"OPTION_ENABLE_CHUNKED_PREFILL": "true"}
AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="session")
def lora_s3():
    """moto's S3 server, for adapters registered from s3:// (the LoRA server is given its endpoint)."""
    import boto3
    from moto.server import ThreadedMotoServer

    from tests.server import free_port

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    moto.start()
    endpoint = "http://{}:{}".format(*moto.get_host_and_port())
    client = boto3.client("s3", endpoint_url=endpoint, **{k.lower(): v for k, v in AWS.items()
                                                           if k != "AWS_DEFAULT_REGION"}, region_name="us-east-1")
    client.create_bucket(Bucket="adapters")
    yield endpoint, client
    moto.stop()


@pytest.fixture(scope="session")
def lora_server(lora_model, lora_s3):
    """vLLM with LoRA on the tiny model (float32), its adapters found at start-up or registered from S3."""
    env = {**VLLM_CPU_ENV, **EXACT, **LORA, **LORA_CELL, **AWS, "AWS_ENDPOINT_URL_S3": lora_s3[0]}
    with Server(lora_model, env=env, ready_timeout=ENGINE_READY_TIMEOUT) as server:
        yield shared("lora_server", server)
