"""A model.py's @output_formatter written for LMI's rolling batch, without an engine: what it
is handed (LMI's TextGenerationOutput, Sequence and Token, as djl_python names them), once per
generated token and in which state, and how its texts make the answer. The same model.py on the
real engine: tests/e2e/test_vllm_lmi_custom_handlers.py."""

import importlib.util
import json
import sys

import pytest

from container.core.errors import HandlerError
from djl_python import Input
from djl_python.output_formatter import _json_output_formatter, _jsonlines_output_formatter
from djl_python.request_io import Sequence, TextGenerationOutput, TextInput, Token
from handlers.engines.formatters import format_request, unbound
from handlers.engines.lmi_schema import TokenInfo
from handlers.engines.rolling_formatter import RollingBatchFormatter, next_token_fields, takes_request_output
from tests.server import MODEL_DIRS

NOTEBOOK = MODEL_DIRS / "lmi_customized_processing" / "model.py"


def _module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def notebook():
    """The model.py in djl-demo's customized-processing shape, imported as the loader does."""
    yield _module(NOTEBOOK, "customized_processing_model")
    sys.modules.pop("customized_processing_model", None)


def _tokens(*texts, start=10):
    return [TokenInfo(start + i, text, -0.5 * (i + 1)) for i, text in enumerate(texts)]


def test_the_notebooks_formatter_answers_one_json_line_per_token_the_last_with_finish_reason(notebook):
    assert takes_request_output(notebook.custom_output_formatter)
    formatter = RollingBatchFormatter(notebook.custom_output_formatter, tgi=False, tokenizer=None)
    assert formatter.fields == 3  # it unpacks get_next_token() into (token, first, last)
    request = formatter.start("Large model inference is", {}, "req-1")
    # the engine hands over one token, then two at once (deltas merge when the client is slow)
    first = _tokens(" a")
    rest = _tokens(" b", " c", start=11)
    lines = list(request.tokens(first, None, False, [])) + list(request.tokens(rest, "length", True, []))
    assert [json.loads(line) for line in lines] == [
        {"token_id": 10, "token_text": " a", "token_log_prob": -0.5},
        {"token_id": 11, "token_text": " b", "token_log_prob": -0.5},
        {"token_id": 12, "token_text": " c", "token_log_prob": -1.0, "finish_reason": "length"},
    ]
    assert all(line.endswith(b"\n") and line.count(b"\n") == 1 for line in lines)


def test_the_formatter_sees_lmis_objects_once_per_token_in_order():
    seen = []

    def recording(request_output: TextGenerationOutput) -> str:
        best = request_output.sequences[request_output.best_sequence_index]
        token, index, first, last = best.get_next_token()
        seen.append(
            {
                "types": (type(request_output), type(best), type(token), type(request_output.input)),
                "token": (token.id, token.text, token.log_prob, index, first, last),
                "tokens_so_far": len(best.tokens),
                "finish_reason": best.finish_reason,
                "finished": request_output.finished,
                "input": (request_output.input.input_text, request_output.input.parameters),
                "client_request_id": request_output.input.client_request_id,
                "top": best.get_next_top_tokens(),
            }
        )
        return token.text

    formatter = RollingBatchFormatter(recording, tgi=False, tokenizer=None)
    assert formatter.fields == 4  # djl_python's current (token, index, first, last)
    request = formatter.start("Hi", {"max_new_tokens": 3}, "req-2")
    texts = list(request.tokens(_tokens("x"), None, False, []))
    texts += list(request.tokens(_tokens("y", "z", start=11), "eos_token", True, []))
    assert texts == [b"x", b"y", b"z"]
    assert [s["types"] for s in seen] == [(TextGenerationOutput, Sequence, Token, TextInput)] * 3
    assert [s["token"] for s in seen] == [
        (10, "x", -0.5, 0, True, False),
        (11, "y", -0.5, 1, False, False),
        (12, "z", -1.0, 2, False, True),
    ]
    assert [s["tokens_so_far"] for s in seen] == [1, 2, 3]  # each call: its token appended, no later one
    assert [(s["finish_reason"], s["finished"]) for s in seen] == [(None, False), (None, False), ("eos_token", True)]
    assert {s["input"] == ("Hi", {"max_new_tokens": 3}) and s["client_request_id"] == "req-2" for s in seen} == {True}
    assert [s["top"] for s in seen] == [[], [], []]


def test_an_end_without_a_new_token_is_an_empty_last_token_as_lmi_adds():
    calls = []

    def fmt(request_output: TextGenerationOutput) -> str:
        token, _, _, last = request_output.sequences[0].get_next_token()
        calls.append((token.id, token.text, last, request_output.sequences[0].finish_reason))
        return ""

    request = RollingBatchFormatter(fmt, tgi=False, tokenizer=None).start("Hi", {}, None)
    assert list(request.tokens(_tokens("x"), None, False, [])) == [b""]
    assert list(request.tokens([], "stop_sequence", True, [])) == [b""]
    assert calls == [(10, "x", False, None), (-1, "", True, "stop_sequence")]


def test_lmis_own_rolling_batch_formatters_read_the_output():
    """djl_python's built-in formats take the same object: its details and text as LMI builds them."""
    lines = RollingBatchFormatter(_jsonlines_output_formatter, tgi=False, tokenizer=None).start(
        "Hi", {"details": True}, None
    )
    out = [json.loads(line) for line in lines.tokens(_tokens("a", "b"), "length", True, _tokens("H", start=1))]
    assert out[0] == {"token": {"id": 10, "text": "a", "log_prob": -0.5}}
    assert out[1]["generated_text"] == "ab" and out[1]["details"]["finish_reason"] == "length"
    assert out[1]["details"]["generated_tokens"] == 2 and out[1]["details"]["inputs"] == "Hi"
    whole = RollingBatchFormatter(_json_output_formatter, tgi=False, tokenizer=None).start("Hi", {}, None)
    assert list(whole.tokens(_tokens("a", "b"), "length", True, [])) == [b"", b'{"generated_text": "ab"}']


def test_which_output_formatters_take_the_rolling_batch_output():
    def annotated(request_output: TextGenerationOutput) -> str: ...

    def by_name(request_output: "djl_python.request_io.RequestOutput") -> str: ...  # noqa: F821

    def as_dict(response_data: dict) -> dict: ...

    def bare(output): ...

    assert takes_request_output(annotated) and takes_request_output(by_name)
    assert takes_request_output(_jsonlines_output_formatter)  # a string annotation (postponed evaluation)
    assert not takes_request_output(as_dict) and not takes_request_output(bare)  # sagelmi's dict form


@pytest.mark.parametrize(
    "source, fields",
    [
        ("def f(o):\n    t, first, last = o.sequences[0].get_next_token()\n", 3),
        ("def f(o):\n    t, i, first, last = o.sequences[0].get_next_token()\n", 4),
        ("def f(o):\n    a, b, c = o.x.get_next_token()\n\ndef g(o):\n    a, b, c, d = o.x.get_next_token()\n", 4),
        ("def f(o):\n    t, *rest = o.sequences[0].get_next_token()\n", 4),
        ("def f(o):\n    return o.sequences[0].get_next_token()[0]\n", 4),
    ],
)
def test_get_next_token_answers_as_many_values_as_model_py_unpacks(tmp_path, source, fields):
    path = tmp_path / f"unpacks_{fields}_{abs(hash(source))}.py"
    path.write_text(source)
    module = _module(path, path.stem)
    try:
        assert next_token_fields(module.f) == fields
    finally:
        sys.modules.pop(path.stem, None)


def test_a_failing_formatter_is_named_in_the_424_message():
    def broken(request_output: TextGenerationOutput) -> str:
        return request_output.nothing_here

    request = RollingBatchFormatter(broken, tgi=False, tokenizer=None).start("Hi", {}, None)
    with pytest.raises(HandlerError, match="Custom formatter failed: AttributeError: .*nothing_here"):
        list(request.tokens(_tokens("x"), None, False, []))


def test_returned_values_other_than_text_are_json_lines():
    def returns_dict(request_output: TextGenerationOutput):
        return {"n": len(request_output.sequences[0].tokens)}

    request = RollingBatchFormatter(returns_dict, tgi=False, tokenizer=None).start("Hi", {}, None)
    assert list(request.tokens(_tokens("x"), None, True, [])) == [b'{"n": 1}\n']


def test_the_notebooks_input_formatter_written_as_a_method_gets_self_none(notebook):
    inputs = Input({"Content-Type": "application/json"}, b'{"prompt": "Large model inference is", "parameters": {}}')
    payload = format_request(unbound(notebook.custom_input_formatter), inputs, tokenizer=None)
    assert payload == {"inputs": "Large model inference is", "parameters": {}, "stream": False}
    with pytest.raises(HandlerError, match="missing 1 required positional argument: 'input_item'"):
        format_request(notebook.custom_input_formatter, inputs, tokenizer=None)  # called as LMI calls it
