"""One real start with every LMI option name sagelmi ignores set at once (container/core/lmi_options.json),
plus the chat front's names and LMI's spellings that sagelmi maps: the server becomes ready, answers, and
logs each ignored name once (tests/unit/test_lmi_options.py checks each name alone at `sagelmi config`)."""

import shutil
from pathlib import Path

import pytest

from container.core.lmi_options import lmi_options
from tests.e2e.conftest import EAGER, ENGINE_READY_TIMEOUT, EXACT, VLLM_CPU_ENV
from tests.server import Server

pytestmark = pytest.mark.slow

# Values that ask for what sagelmi does anyway are silent (option.async_mode=true): ask for the other.
LOUD_VALUES = {"option.async_mode": "false", "option.enable_stateful_sessions": "true"}
# The chat front's names, with values valid for the tiny model: files in its directory, parsers the installed
# vLLM registers (vllm/tool_parsers: hermes; vllm/reasoning: granite). The reasoning parser is an engine argument
# too, and vLLM's engine refuses deepseek_r1 and qwen3 on a tokenizer without <think> tokens, as the tiny one is.
FRONT_VALUES = {
    "option.enable_auto_tool_choice": "true",
    "option.tool_call_parser": "hermes",
    "option.tool_parser_plugin": "tool_parsers.py",
    "option.chat_template": "template.jinja",
    "option.chat_template_content_format": "string",
    "option.enable_reasoning": "true",
    "option.reasoning_parser": "granite",
}
# LMI's spellings sagelmi maps, that work on a CPU tiny model. Not set: the other vLLM names of the list (their
# examples ask for GPUs, fp8, a draft model or LMCache's connector); their mapping is unit-tested.
MAPPED_VALUES = {"minWorkers": "1", "maxWorkers": "1", "option.lmcache_config_file": "lmcache.yaml"}


def test_every_ignored_lmi_name_at_once_starts_and_serves(tiny_model, tmp_path):
    model_dir = Path(shutil.copytree(tiny_model, tmp_path / "model"))
    (model_dir / "tool_parsers.py").write_text("# no parsers of its own\n")
    (model_dir / "template.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    (model_dir / "lmcache.yaml").write_text("chunk_size: 256\n")
    ignored = [e for e in lmi_options() if e.handling == "warn"]
    assert {e.name for e in lmi_options() if e.handling == "front"} == set(FRONT_VALUES)
    properties = {e.name: LOUD_VALUES.get(e.name, e.example) for e in ignored} | FRONT_VALUES | MAPPED_VALUES
    (model_dir / "serving.properties").write_text("".join(f"{k}={v}\n" for k, v in properties.items()))

    with Server(model_dir, env={**VLLM_CPU_ENV, **EXACT, **EAGER}, ready_timeout=ENGINE_READY_TIMEOUT) as server:
        answer = server.invoke({"inputs": "one two", "parameters": {"max_new_tokens": 4}}, timeout=300)  # a loaded run
        assert answer.status_code == 200, answer.text
        assert "generated_text" in answer.json()
        environ = Path(f"/proc/{server.worker_pids()[0]}/environ").read_bytes().split(b"\0")
        assert f"LMCACHE_CONFIG_FILE={model_dir / 'lmcache.yaml'}".encode() in environ
        log = server.log()

    lines = log.splitlines()
    for entry in ignored:
        said = [line for line in lines if f" {entry.name} is ignored: {entry.text}" in line]
        assert len(said) == 1, (entry.name, said)
    assert "is not a sagelmi setting" not in log  # minWorkers and maxWorkers are min_workers and max_workers
