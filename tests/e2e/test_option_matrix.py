"""The LMI options users set most, in the pairs that matter, each served on the tiny model
(``sagelmi serve``, vLLM's CPU build): every cell either serves the greedy tokens of the plain
engine (float32, tests/conftest.py's ``vllm_server``) and reproducible seeded samples, or is
refused at start-up with one line naming what cannot work. No cell may start and then fail its
requests (a crash loop behind a healthy /ping).

Each cell is checked where that is cheapest: one that ``sagelmi config`` refuses (settings checked
before anything starts, as ``serve`` checks them) by ``config``; one that only the engine refuses by
``serve``; one that serves on a server of its own, or on a shared one already serving its settings
(the lmi-dist and LoRA cells: tests/e2e/conftest.py's ``lmi_dist_server`` and ``lora_server``). lmi-dist
is the same engine as the plain configuration: each cell crossed with lmi-dist is checked by its engine
arguments (tests/unit/test_lmi_dist_settings.py)."""

import re
import subprocess
import sys
import time

import pytest
import requests

from tests.e2e.conftest import (
    ENGINE_READY_TIMEOUT,
    EXACT,
    LMI_DIST_CELL,
    LMI_DIST_README_ENV,
    LORA,
    LORA_CELL,
    VLLM_CPU_ENV,
)
from tests.reliability import record
from tests.server import REPO, Server, clean_env

pytestmark = pytest.mark.slow

# Long enough to be prefilled in several chunks of 64 tokens.
PROMPTS = ["The quick brown fox " * 12, "Prompt number 2 about the sea", "Prompt number 3 about the sky " * 6]
SERVES = "serves"
SPEC = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
CELLS = {
    "eager + prefix caching + chunked prefill (64-token prefill budget)": (
        {
            "OPTION_ENFORCE_EAGER": "true",
            "OPTION_ENABLE_PREFIX_CACHING": "true",
            "OPTION_ENABLE_CHUNKED_PREFILL": "true",
            "OPTION_MAX_ROLLING_BATCH_PREFILL_TOKENS": "64",
            "OPTION_MAX_ROLLING_BATCH_SIZE": "32",
        },
        SERVES,
    ),
    "a prefill budget below the batch size": (
        {"OPTION_MAX_ROLLING_BATCH_PREFILL_TOKENS": "64"},
        "is less than option.max_rolling_batch_size=256",
    ),
    "speculative decoding (ngram) + eager": (
        {"OPTION_SPECULATIVE_CONFIG": SPEC, "OPTION_ENFORCE_EAGER": "true"},
        SERVES,
    ),
    "pipeline parallel 2 + eager": (
        {"PIPELINE_PARALLEL_DEGREE": "2", "OPTION_ENFORCE_EAGER": "true"},
        "option.pipeline_parallel_degree=2 with option.enforce_eager=true",
    ),
    "pipeline parallel 2 + no compilation": (
        {"PIPELINE_PARALLEL_DEGREE": "2", "OPTION_COMPILATION_CONFIG": '{"mode": 0}'},
        "option.pipeline_parallel_degree=2 with option.compilation_config={\"mode\": 0}",
    ),
    "lmi-dist + pipeline parallel 2 + eager": (
        {"OPTION_ROLLING_BATCH": "lmi-dist", "PIPELINE_PARALLEL_DEGREE": "2", "OPTION_ENFORCE_EAGER": "true"},
        "option.pipeline_parallel_degree=2 with option.enforce_eager=true",
    ),
    "Ray as the executor": (
        {"OPTION_DISTRIBUTED_EXECUTOR_BACKEND": "ray"},
        "current platform cpu does not support ray",
    ),
    "quantization fp8 in float32": ({"OPTION_QUANTIZATION": "fp8"}, "not supported for quantization method fp8"),
    "max_model_len beyond the model's context": (
        {"OPTION_MAX_MODEL_LEN": "100000"},
        "max_model_len (100000) is greater than the derived max_model_len",
    ),
}
# Served by a shared server: cell -> its settings (what that server runs with, checked below)
SHARED_CELLS = {
    "lmi-dist (tensor parallel 2) + eager + prefix caching + max_model_len": {**LMI_DIST_README_ENV, **LMI_DIST_CELL},
    "LoRA + chunked prefill + max_rolling_batch_size": {**LORA, **LORA_CELL},
}
RESULTS: dict[str, str] = {}


def _ids(server, prompt):
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 12, "ignore_eos": True, "details": True}}
    r = server.invoke(body, timeout=120)
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


def _sampled(server, prompt):
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0.9, "seed": 11, "ignore_eos": True}
    r = requests.post(server.url("/v1/completions"), json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _start_up_failure(server: Server, timeout: float) -> tuple[int, str]:
    """Wait for a server that must not get ready: its exit code and its log."""
    deadline = time.monotonic() + timeout
    while server.process.poll() is None:
        assert time.monotonic() < deadline, f"still running after {timeout}s:\n{server.log()}"
        try:
            assert requests.get(server.url("/ping"), timeout=2).status_code != 200, "it got ready"
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    return server.process.returncode, server.log()


def _serves_exactly(server: Server, vllm_server: Server) -> None:
    """The plain engine's greedy tokens, a seeded sample that repeats, and no traceback in its log since."""
    since = len(server.log())
    for prompt in PROMPTS:
        assert _ids(server, prompt) == _ids(vllm_server, prompt), prompt
    assert _sampled(server, PROMPTS[1]) == _sampled(server, PROMPTS[1])
    assert "Traceback" not in server.log()[since:]


@pytest.mark.parametrize("cell", list(CELLS))
def test_a_cell_serves_exact_tokens_or_is_refused_in_one_line(cell, tiny_model, vllm_server):
    env, expected = CELLS[cell]
    env = {**VLLM_CPU_ENV, **EXACT, **env}
    started = time.monotonic()
    if expected == SERVES:
        with Server(tiny_model, env=env, ready_timeout=ENGINE_READY_TIMEOUT) as server:
            _serves_exactly(server, vllm_server)
        RESULTS[cell] = f"serves the plain engine's greedy tokens ({time.monotonic() - started:.0f} s)"
        return
    config = subprocess.run(
        [sys.executable, "-m", "container", "config", "--model-dir", str(tiny_model)],
        env=clean_env(env),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if config.returncode != 0:  # refused where settings are resolved: serve runs the same check first
        lines = [line for line in config.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and expected in lines[0], config.stderr
        assert "Traceback" not in config.stderr and "/tmp/" not in lines[0]
        RESULTS[cell] = f"refused by sagelmi config and serve: {lines[0].split('sagelmi: ', 1)[-1][:200]}"
        return
    server = Server(tiny_model, env=env).start(wait_ready=False)
    try:
        code, log = _start_up_failure(server, ENGINE_READY_TIMEOUT)
    finally:
        server.stop()
    assert code != 0
    # the one line: the supervisor's (a failed load)
    failures = [line for line in log.splitlines() if re.search(r" ERROR .*start-up failed: ", line)]
    assert len(failures) == 1, log
    assert re.search(re.escape(expected), failures[0]), failures[0]
    assert "Traceback" not in failures[0] and "/tmp/" not in failures[0]
    RESULTS[cell] = f"refused by serve, when the engine loads: {failures[0].split('start-up failed: ', 1)[1][:200]}"


def _shared_cell(cell: str, server: Server, vllm_server: Server, which: str) -> None:
    assert SHARED_CELLS[cell].items() <= server.env.items()
    started = time.monotonic()
    server.wait_until(lambda r: r.status_code == 200, ENGINE_READY_TIMEOUT)
    _serves_exactly(server, vllm_server)
    seconds = time.monotonic() - started
    RESULTS[cell] = f"serves the plain engine's greedy tokens (on the shared {which} server, {seconds:.0f} s)"


def test_the_lmi_dist_cell_serves_exact_tokens(lmi_dist_server, vllm_server):
    _shared_cell("lmi-dist (tensor parallel 2) + eager + prefix caching + max_model_len", lmi_dist_server, vllm_server,
                 "lmi-dist")


def test_the_lora_cell_serves_exact_tokens(lora_server, vllm_server):
    _shared_cell("LoRA + chunked prefill + max_rolling_batch_size", lora_server, vllm_server, "LoRA")


def test_record_the_matrix():
    """Last: the table of the cells above, in docs/reliability.md."""
    if len(RESULTS) < len(CELLS) + len(SHARED_CELLS):
        pytest.skip("not every cell ran")
    record(
        "option-matrix",
        "The option matrix on the tiny model",
        RESULTS,
        note="tests/e2e/test_option_matrix.py; greedy tokens compared with the plain engine (float32), "
        "seeded samples repeated.",
    )
