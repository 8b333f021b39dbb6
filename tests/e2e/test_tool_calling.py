"""Tool calling and structured output through the official openai client and LMI's schema,
against real vLLM on the tiny model.

A random-weight model chooses nothing, so the tests make it: ``tool_choice="required"`` (with
``parallel_tool_calls=False``: one call, or a random model adds calls until ``max_tokens``) or a
named function constrains the output to a tool call; a ``structured_outputs`` regex forces
the hermes format (``<tool_call>{...}</tool_call>``), which the configured parser must then
return as ``tool_calls``. Schemas are small and closed (enums, no extra properties) so that
generation ends well within ``max_tokens``; the server's grammar allows no free whitespace
(``disable_any_whitespace``), which a random model would otherwise emit until ``max_tokens``,
and vLLM's JSON form of required/named tool calls (``VLLM_ENFORCE_STRICT_TOOL_CALLING=0``)
honours that, where its structural tags would not.
"""

import json
import subprocess
import sys

import jsonschema
import openai
import pytest
import requests

from tests.e2e.conftest import EAGER, ENGINE_READY_TIMEOUT, EXACT, VLLM_CPU_ENV
from tests.readme import on_port, python_snippets, run_shell, section, serve_settings, shell_commands
from tests.server import Server

pytestmark = pytest.mark.slow

STRUCTURED = json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "the time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}</tool_call>'


_SECTION = section("Tool calling, reasoning, structured output, chat templates")  # docs/engine.md
README_COMMANDS = shell_commands(_SECTION)
README_SNIPPET = next(p for p in python_snippets(_SECTION) if "tool_choice=" in p)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The README's server: its tiny model, its settings."""
    directory = str(tmp_path_factory.mktemp("readme-tiny-think"))
    write, serve, *_ = (command.replace("/tmp/tiny-think", directory) for command in README_COMMANDS)
    written = run_shell(write, 0, timeout=300)
    assert written.returncode == 0, written.stderr
    env, model_dir = serve_settings(serve)
    assert env == {**VLLM_CPU_ENV, "OPTION_ENABLE_AUTO_TOOL_CHOICE": "true", "OPTION_TOOL_CALL_PARSER": "hermes",
                   "OPTION_STRUCTURED_OUTPUTS_CONFIG": STRUCTURED, "VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}
    # served eager in float32 (EAGER): a parser's work does not depend on vLLM compiling the model
    with Server(model_dir, env={**env, **EXACT, **EAGER}, ready_timeout=ENGINE_READY_TIMEOUT) as server:
        yield server


def test_the_readme_examples(server):
    port = server.port
    tools, schema = (json.loads(run_shell(c, port).stdout) for c in README_COMMANDS[2:])
    assert tools["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(schema["generated_text"]) in ({"ok": True}, {"ok": False})
    printed = subprocess.run([sys.executable, "-c", on_port(README_SNIPPET, port)], capture_output=True,
                             text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    name, arguments = printed.stdout.split(" ", 1)
    assert name == "get_weather" and arguments.strip() in ("{'city': 'Paris'}", "{'city': 'Rome'}")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)


def assert_valid_calls(calls):
    assert calls
    for call in calls:
        assert call.function.name in SCHEMAS
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(stream) -> list[dict]:
    """The tool calls of a streamed chat answer, their deltas joined by index."""
    calls: dict[int, dict] = {}
    for chunk in stream:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    return list(calls.values())


def test_required_tool_choice_returns_calls_matching_a_tools_schema(client):
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=200)
    assert answer.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(answer.choices[0].message.tool_calls)


def test_required_tool_choice_streamed(client):
    calls = streamed_calls(client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                                          tool_choice="required", parallel_tool_calls=False,
                                                          max_tokens=200, stream=True))
    assert calls
    for call in calls:
        assert call["name"] in SCHEMAS
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_a_named_function_is_the_one_called(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                            max_tokens=200)
    calls = answer.choices[0].message.tool_calls
    assert_valid_calls(calls)
    assert {c.function.name for c in calls} == {"get_time"}
    streamed = streamed_calls(client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                                             tool_choice=choice, max_tokens=200, stream=True))
    assert [c["name"] for c in streamed] == ["get_time"]


def test_tool_choice_none_answers_in_text(client):
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                            max_tokens=5)
    assert not answer.choices[0].message.tool_calls
    assert answer.choices[0].message.content


def test_hermes_output_comes_back_as_tool_calls_not_text(client):
    forced = {"structured_outputs": {"regex": HERMES}}
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                            max_tokens=200, extra_body=forced)
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(message.tool_calls)
    assert not message.content or "<tool_call>" not in message.content
    streamed = streamed_calls(client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                                             tool_choice="auto", max_tokens=200, stream=True,
                                                             extra_body=forced))
    assert [c["name"] for c in streamed] == ["get_weather"]
    jsonschema.validate(json.loads(streamed[0]["arguments"]), WEATHER)


def test_tools_and_tool_calls_on_invocations(server):
    """LMI's chat schema on /invocations (a messages body) carries tools and returns tool_calls as LMI does
    (vLLM's chat completion, unchanged)."""
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 200}
    answer = requests.post(server.url("/invocations"), json=body, timeout=120).json()
    calls = answer["choices"][0]["message"]["tool_calls"]
    assert calls and answer["choices"][0]["finish_reason"] == "tool_calls"
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def test_response_format_json_schema_on_chat_and_completions(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60,
                                          response_format=response_format)
    jsonschema.validate(json.loads(chat.choices[0].message.content), ANSWER)
    for extra in ({"response_format": response_format}, {"structured_outputs": {"json": ANSWER}}):
        completion = client.completions.create(model="tiny", prompt="Hello", max_tokens=60, extra_body=extra)
        jsonschema.validate(json.loads(completion.choices[0].text), ANSWER)


@pytest.mark.parametrize("parameters", [
    {"structured_outputs": {"json": ANSWER}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}},
    {"guided_json": ANSWER},
], ids=["structured_outputs", "response_format", "guided_json"])
def test_structured_output_on_the_lmi_schema(server, parameters):
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 60, **parameters}}
    answer = requests.post(server.url("/invocations"), json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    jsonschema.validate(json.loads(answer.json()["generated_text"]), ANSWER)
    streamed = requests.post(server.url("/invocations"), json={**body, "stream": True}, timeout=120)
    last = json.loads(streamed.text.strip().splitlines()[-1])
    jsonschema.validate(json.loads(last["generated_text"]), ANSWER)


def test_regex_and_choice_on_the_lmi_schema(server):
    for parameters, allowed in (({"structured_outputs": {"regex": "(yes|no)!"}}, {"yes!", "no!"}),
                                ({"structured_outputs": {"choice": ["alpha", "beta"]}}, {"alpha", "beta"})):
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": 20, **parameters}}
        assert requests.post(server.url("/invocations"), json=body, timeout=120).json()["generated_text"] in allowed


def test_an_invalid_schema_is_a_400_naming_the_field(server, client):
    bad = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
    for parameters, field in (({"structured_outputs": {"json": bad}}, "parameters.structured_outputs"),
                              ({"structured_outputs": {"jsn": ANSWER}}, "parameters.structured_outputs.jsn"),
                              ({"response_format": {"type": "xml"}}, "parameters.response_format.type")):
        answer = requests.post(server.url("/invocations"), json={"inputs": "Hello", "parameters": parameters},
                               timeout=120)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"].startswith(field), answer.text
        assert "/project/" not in answer.text and ".cc:" not in answer.text
    # a stream's headers go out once the engine has taken the request: one it refuses is still a 400
    streamed = requests.post(server.url("/invocations"), timeout=120, json={
        "inputs": "Hello", "stream": True, "parameters": {"structured_outputs": {"json": bad}}})
    assert streamed.status_code == 400, streamed.text
    assert streamed.json()["error"].startswith("parameters.structured_outputs: "), streamed.text
    with pytest.raises(openai.BadRequestError, match="nonsense"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": bad}})
    assert server.invoke({"inputs": "still serving", "parameters": {"max_new_tokens": 2}}).status_code == 200
