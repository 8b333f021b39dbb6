"""LMI custom handlers on the real vLLM engine: a model.py with only formatters, and one
wrapping djl_python.huggingface. Both must answer as the built-in handler does."""

import json
import shutil

import pytest

from tests.e2e.conftest import ENGINE_READY_TIMEOUT, EXACT, VLLM_CPU_ENV
from tests.server import MODEL_DIRS, Server

pytestmark = pytest.mark.slow


def _model_py_dir(tmp_path, handler_dir):
    """A model directory holding only the handler's model.py: the weights are the session's tiny
    model, named by ``option.model_id`` (a local path, as LMI takes it), so that vLLM reuses the
    kernels it compiled for that path (8-15 s less a start)."""
    model_dir = tmp_path / handler_dir
    model_dir.mkdir()
    shutil.copy(MODEL_DIRS / handler_dir / "model.py", model_dir / "model.py")
    return model_dir


def _serve(tiny_model, tmp_path, handler_dir):
    env = {**VLLM_CPU_ENV, **EXACT, "OPTION_MODEL_ID": str(tiny_model)}
    return Server(_model_py_dir(tmp_path, handler_dir), env=env, ready_timeout=ENGINE_READY_TIMEOUT)


def _reference(vllm_server, prompt):
    r = vllm_server.invoke({"inputs": prompt, "parameters": {"max_new_tokens": 6, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["generated_text"]


def test_formatters_only_model_py_runs_the_builtin_handler(tiny_model, vllm_server, tmp_path):
    expected = _reference(vllm_server, "Q: why? A:")
    with _serve(tiny_model, tmp_path, "lmi_formatters") as server:
        r = server.invoke({"question": "why?"})
        assert r.status_code == 200, r.text
        assert r.json() == {"answer": expected}
        with server.invoke({"question": "why?", "stream": True}, stream=True) as s:
            lines = [json.loads(line) for line in s.iter_lines() if line]
        reference = vllm_server.invoke({"inputs": "Q: why? A:", "stream": True,
                                        "parameters": {"max_new_tokens": 6, "ignore_eos": True}})
        assert [line["t"] for line in lines] == [json.loads(line)["token"]["text"]
                                                 for line in reference.text.splitlines()]
        bad = server.invoke({"prompt_is_missing": True})
        assert bad.status_code == 424 and "Custom formatter failed: ValueError: send a 'question'" in bad.text
        assert "with the @input_formatter and @output_formatter of model.py" in server.log()


def test_model_py_wrapping_the_huggingface_service(tiny_model, vllm_server, tmp_path):
    expected = _reference(vllm_server, "Hello there")
    with _serve(tiny_model, tmp_path, "lmi_hf_service") as server:
        r = server.invoke({"inputs": "Hello there", "parameters": {"max_new_tokens": 6, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        assert r.json()["generated_text"] == expected
        assert r.headers["X-Wrapped-By"] == "model.py"


def test_input_formatter_taking_the_input_item(tiny_model, vllm_server, tmp_path):
    """djl-demo's formatter in LMI's second form (Input in, TextInput out) on the built-in engine."""
    greedy = {"max_new_tokens": 6, "ignore_eos": True}
    expected = _reference(vllm_server, "Large model inference is")
    with _serve(tiny_model, tmp_path, "lmi_input_item_formatter") as server:
        r = server.invoke({"prompt": "Large model inference is", "parameters": greedy})
        assert r.status_code == 200, r.text
        assert r.json()["generated_text"] == expected
        original = server.invoke({"prompt": "Large model inference is", "parameters": {}})  # the notebook's call
        assert original.status_code == 200 and isinstance(original.json()["generated_text"], str)


def test_model_py_handle_wins_over_lmi_vllm_service(tiny_model, tmp_path):
    """djl-serving's custom-handler test: model.py's handle serves in place of the entry point's service."""
    env = {**VLLM_CPU_ENV, "OPTION_ENTRYPOINT": "djl_python.lmi_vllm.vllm_async_service",
           "OPTION_MODEL_ID": str(tiny_model)}
    with Server(_model_py_dir(tmp_path, "lmi_custom_handle"), env=env, ready_timeout=ENGINE_READY_TIMEOUT) as server:
        r = server.invoke({"inputs": "The future of AI is", "parameters": {"max_new_tokens": 8}})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["custom_handler_used"] is True and isinstance(body["generated_text"], str)
        assert ("loading handler from model.py's handle, in place of option.entryPoint="
                "djl_python.lmi_vllm.vllm_async_service (as LMI's custom handler)") in server.log()
