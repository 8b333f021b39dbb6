"""LMI custom handlers on the real vLLM engine: a model.py with only formatters, and one
wrapping djl_python.huggingface. Both must answer as the built-in handler does."""

import json
import shutil

import pytest

from tests.e2e.conftest import EAGER, ENGINE_READY_TIMEOUT, EXACT, VLLM_CPU_ENV
from tests.server import MODEL_DIRS, Server

pytestmark = pytest.mark.slow


def _model_py_dir(tmp_path, handler_dir):
    """A model directory holding only the handler's model.py: the weights are the session's tiny
    model, named by ``option.model_id`` (a local path, as LMI takes it)."""
    model_dir = tmp_path / handler_dir
    model_dir.mkdir()
    shutil.copy(MODEL_DIRS / handler_dir / "model.py", model_dir / "model.py")
    return model_dir


def _serve(tiny_model, tmp_path, handler_dir):
    env = {**VLLM_CPU_ENV, **EXACT, **EAGER, "OPTION_MODEL_ID": str(tiny_model)}
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


def test_djl_demo_customized_processing_model_py_runs_unchanged(tiny_model, vllm_server, tmp_path):
    """djl-demo's vLLM customized-processing model.py, unchanged: its @input_formatter (a method's
    leftover ``self``, the request's Input in, a TextInput out) and its rolling-batch
    @output_formatter (a TextGenerationOutput per token in, one JSON line out)."""
    prompt, greedy = "Large model inference is", {"max_new_tokens": 6, "ignore_eos": True}
    reference = vllm_server.invoke({"inputs": prompt, "stream": True, "parameters": greedy})
    tokens = [json.loads(line)["token"] for line in reference.text.splitlines()]
    expected = [{"token_id": t["id"], "token_text": t["text"], "token_log_prob": pytest.approx(t["log_prob"], abs=1e-3)}
                for t in tokens]
    expected[-1]["finish_reason"] = "length"
    with _serve(tiny_model, tmp_path, "lmi_customized_processing") as server:
        whole = server.invoke({"prompt": prompt, "parameters": greedy})
        assert whole.status_code == 200, whole.text
        assert [json.loads(line) for line in whole.text.splitlines()] == expected
        with server.invoke({"prompt": prompt, "parameters": {**greedy, "stream": True}}, stream=True) as s:
            assert s.status_code == 200
            streamed = [json.loads(line) for line in s.iter_lines() if line]
        assert streamed == expected
        notebook = server.invoke({"prompt": prompt, "parameters": {}})  # the notebook's own call
        lines = [json.loads(line) for line in notebook.text.splitlines()]
        assert notebook.status_code == 200 and lines and "finish_reason" in lines[-1]
        assert all("finish_reason" not in line for line in lines[:-1])
        old_schema = server.invoke({"inputs": prompt, "parameters": {}})  # "will no longer work", says the notebook
        assert old_schema.status_code == 400 and "'inputs' must be a non-empty string" in old_schema.text
        log = server.log()
        assert "custom_output_formatter takes LMI's rolling-batch TextGenerationOutput" in log
        assert "custom_input_formatter takes 'self' first, as a method: it is called with self=None" in log


def test_model_py_handle_wins_over_lmi_vllm_service(tiny_model, tmp_path):
    """djl-serving's custom-handler test: model.py's handle serves in place of the entry point's service."""
    env = {**VLLM_CPU_ENV, **EAGER, "OPTION_ENTRYPOINT": "djl_python.lmi_vllm.vllm_async_service",
           "OPTION_MODEL_ID": str(tiny_model)}
    with Server(_model_py_dir(tmp_path, "lmi_custom_handle"), env=env, ready_timeout=ENGINE_READY_TIMEOUT) as server:
        r = server.invoke({"inputs": "The future of AI is", "parameters": {"max_new_tokens": 8}})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["custom_handler_used"] is True and isinstance(body["generated_text"], str)
        assert ("loading handler from model.py's handle, in place of option.entryPoint="
                "djl_python.lmi_vllm.vllm_async_service (as LMI's custom handler)") in server.log()
