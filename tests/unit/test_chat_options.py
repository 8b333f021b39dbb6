"""The chat front's options (container/core/chat_options.py) and structured output in LMI's
parameters (handlers/engines/lmi_schema.py), without an engine."""

import pytest

from container.core.chat_options import ChatOptionError, chat_options, chat_template
from container.core.errors import InputError
from container.core.settings import resolve_settings
from handlers.engines.lmi_schema import structured_outputs


def options(tmp_path, **env):
    return chat_options(resolve_settings({f"OPTION_{k.upper()}": v for k, v in env.items()}, tmp_path))


def test_defaults_leave_vllm_as_it_is(tmp_path):
    chosen = options(tmp_path)
    assert (chosen.chat_template, chosen.enable_auto_tool_choice, chosen.tool_call_parser, chosen.reasoning_parser) \
        == (None, False, None, None)
    assert chosen.chat_template_content_format == "auto"


def test_tool_and_reasoning_options_are_read(tmp_path):
    chosen = options(tmp_path, enable_auto_tool_choice="true", tool_call_parser="hermes", reasoning_parser="qwen3",
                     enable_reasoning="true", chat_template_content_format="OpenAI")
    assert chosen.enable_auto_tool_choice and chosen.tool_call_parser == "hermes"
    assert chosen.reasoning_parser == "qwen3" and chosen.chat_template_content_format == "openai"


@pytest.mark.parametrize(("env", "message"), [
    ({"enable_auto_tool_choice": "true"}, "option.enable_auto_tool_choice=true needs option.tool_call_parser"),
    ({"enable_reasoning": "true"}, "option.enable_reasoning=true needs option.reasoning_parser"),
    ({"enable_auto_tool_choice": "maybe", "tool_call_parser": "hermes"}, "is not true or false"),
    ({"chat_template_content_format": "xml"}, "is not one of auto, string, openai"),
])
def test_combinations_that_cannot_work_are_refused(tmp_path, env, message):
    with pytest.raises(ChatOptionError, match=message):
        options(tmp_path, **env)


def test_a_template_is_a_file_in_the_model_directory_a_path_or_the_text(tmp_path):
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    assert chat_template("t.jinja", str(tmp_path)) == "{{ messages[0]['content'] }}"
    assert chat_template(str(tmp_path / "t.jinja"), "/elsewhere") == "{{ messages[0]['content'] }}"
    assert chat_template("{% for m in messages %}{{ m }}{% endfor %}", "/x").startswith("{% for")
    assert chat_template(None, str(tmp_path)) is None
    with pytest.raises(ChatOptionError, match="option.chat_template=nope.jinja: no such file"):
        chat_template("nope.jinja", str(tmp_path))
    with pytest.raises(ChatOptionError, match=r"option.chat_template \(the template given\) does not compile: .*line 1"):
        chat_template("{% for m in messages %}{{ m }}", str(tmp_path))


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}}


@pytest.mark.parametrize(("extra", "fields"), [
    ({}, None),
    ({"structured_outputs": {"regex": "a+"}}, {"regex": "a+"}),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, {"json": SCHEMA}),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}),
    ({"guided_grammar": "root ::= 'a'"}, {"grammar": "root ::= 'a'"}),
])
def test_structured_output_forms_of_lmi_parameters(extra, fields):
    assert structured_outputs(extra) == fields


@pytest.mark.parametrize(("extra", "message"), [
    ({"structured_outputs": {"json": SCHEMA}, "guided_regex": "a"}, "structured_outputs and guided_regex"),
    ({"response_format": "json"}, "parameters.response_format must be an object"),
    ({"response_format": {"type": "xml"}}, "parameters.response_format.type='xml'"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "json_schema.schema must be a JSON schema"),
])
def test_structured_output_that_cannot_work_names_the_field(extra, message):
    with pytest.raises(InputError, match=message):
        structured_outputs(extra)
