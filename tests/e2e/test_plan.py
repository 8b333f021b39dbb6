"""sagelmi plan's KV-cache prediction against what vLLM's CPU build reports for the same
VLLM_CPU_KVCACHE_SPACE: the tiny model, and a second model with more layers, more KV heads
and another dtype."""

import json
import re
import time
import shutil
import subprocess
import sys
import textwrap

import pytest

from container.core.plan import make_plan, read_model
from tests.e2e.conftest import EAGER, ENGINE_READY_TIMEOUT, VLLM_CPU_ENV
from tests.server import REPO, Server, clean_env

pytestmark = pytest.mark.slow


def vllm_kv_tokens(log: str) -> int:
    match = re.search(r"CPU KV cache size: ([\d,]+) tokens", log)
    assert match, log[-3000:]
    return int(match.group(1).replace(",", ""))


def predicted_tokens(model_dir, env: dict[str, str]) -> int:
    name, config, weight, download = read_model(model_dir, None)
    plan = make_plan(name, config, weight, download, dtype=env.get("OPTION_DTYPE"), kv_cache_dtype=None,
                     max_model_len=None, gpus=None, gpu_memory_gib=None,
                     cpu_kv_cache_gib=float(env["VLLM_CPU_KVCACHE_SPACE"]))
    return plan.splits[0].kv_tokens


def logged(server, text: str, timeout: float = 30) -> str:
    """The server's log once it has ``text`` (the check runs right after the engine is ready)."""
    deadline = time.monotonic() + timeout
    while text not in server.log():
        assert time.monotonic() < deadline, f"{text!r} never logged:\n{server.log()[-3000:]}"
        time.sleep(0.2)
    return server.log()


def test_the_tiny_models_kv_cache_is_predicted_within_5_percent(vllm_server, tiny_model):
    reported = vllm_kv_tokens(vllm_server.log())  # float32, VLLM_CPU_KVCACHE_SPACE=1
    predicted = predicted_tokens(tiny_model, {**VLLM_CPU_ENV, "OPTION_DTYPE": "float32"})
    print(f"tiny model: predicted {predicted} KV tokens, vLLM reports {reported}")
    assert abs(predicted - reported) <= 0.05 * reported


def test_serve_logs_the_plan_and_checks_it_against_the_engine(vllm_server):
    log = logged(vllm_server, "plan: the KV cache holds 1048576 tokens, as predicted (1048576, 0.0% off)")
    assert "plan: smallest split that fits: tp=1 pp=1" in log
    assert log.index("plan: model ") < log.index("CPU KV cache size")  # planned before the engine started


@pytest.fixture(scope="module")
def wider_model(tiny_model, tmp_path_factory):
    """The tiny model's tokenizer on another shape: 4 layers, 4 heads, 2 KV heads of 64, bfloat16."""
    directory = tmp_path_factory.mktemp("wider-model")
    for item in tiny_model.iterdir():
        if item.name.startswith("tokenizer") or item.name == "special_tokens_map.json":
            shutil.copy(item, directory / item.name)
    script = textwrap.dedent(f"""
        import json, torch
        from transformers import LlamaConfig, LlamaForCausalLM
        base = json.load(open({str(tiny_model / "config.json")!r}))
        config = LlamaConfig(**{{**base, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "hidden_size": 256, "intermediate_size": 512, "head_dim": 64}})
        torch.manual_seed(7)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained({str(directory)!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=REPO, env=clean_env(), capture_output=True,
                   timeout=300)
    assert json.loads((directory / "config.json").read_text())["num_key_value_heads"] == 2
    return directory


def test_a_wider_models_kv_cache_is_predicted_within_5_percent(wider_model):
    env = {**VLLM_CPU_ENV, "VLLM_CPU_KVCACHE_SPACE": "3"}
    # eager in bfloat16 is safe here: the server answers no request (see EAGER); the KV cache is the same
    with Server(wider_model, env={**env, **EAGER}, ready_timeout=ENGINE_READY_TIMEOUT) as server:
        reported = vllm_kv_tokens(server.log())
        logged(server, f"plan: the KV cache holds {reported} tokens, as predicted")
    predicted = predicted_tokens(wider_model, env)
    print(f"wider model: predicted {predicted} KV tokens, vLLM reports {reported}")
    assert abs(predicted - reported) <= 0.05 * reported
