"""The commands of "Sizing a deployment" (docs/sizing.md), run as a user runs them."""

import json

from tests.readme import run_shell, section, shell_commands

README_COMMANDS = shell_commands(section("Sizing a deployment"))


def test_the_readme_plan_commands(tmp_path):
    model = str(tmp_path / "tiny")
    made, table, as_json = (run_shell(c.replace("/tmp/tiny", model), 0, timeout=120) for c in README_COMMANDS)
    assert made.returncode == 0, made.stderr
    assert table.returncode == 0, table.stderr
    assert "on ml.g5.2xlarge (1 x A10G 22 GiB)" in table.stdout
    assert "smallest split that fits: tp=1 pp=1" in table.stdout
    plan = json.loads(as_json.stdout)
    assert as_json.returncode == 0 and plan["kv_dtype"] == "fp8"
    assert {(s["tp"], s["pp"]) for s in plan["splits"]} >= {(1, 1), (8, 1), (2, 4)}
    one = next(s for s in plan["splits"] if (s["tp"], s["pp"]) == (1, 1))
    assert one["kv_bytes_per_token"] == 2 * 2 * 1 * 64 * 1  # 2 layers, 1 KV head of 64, fp8, K and V


def test_a_plan_that_cannot_be_made_says_why(tmp_path):
    result = run_shell(f"sagelmi plan --model-dir {tmp_path} --gpus 2", 0)
    assert result.returncode == 2
    assert "give both --gpus and --gpu-memory (or --instance)" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_hub_model_is_planned_from_its_small_files_only(tmp_path):
    """--model-id reads config.json and the safetensors header (a byte range), never the weights."""
    import os
    import struct

    from tests.fake_hub import FakeHub, Repo

    header = json.dumps({"w": {"dtype": "BF16", "shape": [4_000_000], "data_offsets": [0, 8_000_000]}}).encode()
    config = {"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 128, "torch_dtype": "bfloat16"}
    repo = Repo({"config.json": json.dumps(config).encode(),
                 "model.safetensors": struct.pack("<Q", len(header)) + header + os.urandom(8_000_000)})
    with FakeHub({"acme/model": repo}) as hub:
        result = run_shell(f"HF_ENDPOINT={hub.url} HF_HOME={tmp_path} sagelmi plan --model-id acme/model --gpus 1 "
                           f"--gpu-memory 24 --json", 0)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["weight_bytes"] == 8_000_000
    assert repo.downloads == ["config.json"] and repo.partial == ["model.safetensors"]


def _small_model(directory):
    """config.json and a safetensors file of 8 MB of bf16 weights (plan reads its header alone)."""
    import struct

    directory.mkdir()
    config = {"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 128, "torch_dtype": "bfloat16"}
    (directory / "config.json").write_text(json.dumps(config))
    header = json.dumps({"w": {"dtype": "BF16", "shape": [4_000_000], "data_offsets": [0, 8_000_000]}}).encode()
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8_000_000))


def test_hf_model_id_naming_a_local_directory_is_planned_from_it(tmp_path):
    """HF_MODEL_ID may name a local directory (serve uses it as it is): plan reads it there."""
    _small_model(tmp_path / "model")
    result = run_shell(f"HF_MODEL_ID={tmp_path / 'model'} sagelmi plan --gpus 1 --gpu-memory 24 --json", 0)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["model"] == str(tmp_path / "model") and plan["weight_bytes"] == 8_000_000


def test_an_unreachable_hub_is_one_line(tmp_path):
    """Nothing listens on the Hub's port: plan says so in one line."""
    from tests.server import free_port

    result = run_shell(f"HF_ENDPOINT=http://127.0.0.1:{free_port()} HF_HOME={tmp_path} "
                       f"sagelmi plan --model-id acme/model --gpus 1 --gpu-memory 24", 0)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and errors[0].endswith(
        "Hub model 'acme/model' is not in the cache and the Hub could not be reached "
        "(HF_ENDPOINT, proxy settings, HF_HUB_OFFLINE)"), result.stderr


def test_a_hub_that_drops_connections_is_tried_once(tmp_path):
    """The Hub's address accepts and drops every connection: plan fails in one line without retrying
    (huggingface_hub's retries back off for seconds)."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    attempts = []

    def drop() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            attempts.append(1)
            conn.close()

    threading.Thread(target=drop, daemon=True).start()
    try:
        result = run_shell(f"HF_ENDPOINT=http://127.0.0.1:{listener.getsockname()[1]} HF_HOME={tmp_path} "
                           f"sagelmi plan --model-id acme/model --gpus 1 --gpu-memory 24", 0)
    finally:
        listener.close()
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "cannot download Hub model 'acme/model'" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    # The HTTP client may open a second connection at once when the first is dropped unanswered; a
    # retry loop (huggingface_hub backs off through five or more attempts) would show as more.
    assert len(attempts) <= 2, f"{len(attempts)} connections to the Hub"
