"""Reasoning parsers and chat template overrides, against real vLLM on the tiny model.

The tiny model does not think by itself: the server (the README's) has a chat template ending
the prompt with ``<think>`` (as DeepSeek R1's does), and a ``structured_outputs`` regex forces
the rest of the reasoning and the answer; the grammar applies from the first token
(``enable_in_reasoning``). vLLM's ``deepseek_r1`` parser must then return the two apart.
"""

import json
import shutil

import openai
import pytest

from tests.e2e.conftest import EAGER, ENGINE_READY_TIMEOUT, EXACT, VLLM_CPU_ENV
from tests.readme import run_shell, section, serve_settings, shell_commands
from tests.server import Server

pytestmark = pytest.mark.slow

README_COMMANDS = shell_commands(section("Reasoning and chat templates"))  # docs/engine.md
FORCED = {"structured_outputs": {"regex": r"(red|blue) sky</think>(yes|no)"}, "temperature": 0}
MESSAGES = [{"role": "user", "content": "Is the sky blue?"}]


@pytest.fixture(scope="module")
def server(tiny_think_model):
    """The README's reasoning server, on the tiny model with <think> tokens."""
    env, _ = serve_settings(README_COMMANDS[0])
    assert env["OPTION_REASONING_PARSER"] == "deepseek_r1" and env["OPTION_CHAT_TEMPLATE"].endswith("<think>")
    # served eager in float32 (EAGER): a parser's work does not depend on vLLM compiling the model
    with Server(tiny_think_model, env={**env, **EXACT, **EAGER}, ready_timeout=ENGINE_READY_TIMEOUT) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def forced(tiny_think_model):
    """The forcing grammar, and a bias towards ``</think>`` as the one special token: the regex
    also lets the random model spell it character by character, which a real reasoning model
    never does and vLLM's streaming parser (which looks for the token) would not see."""
    from transformers import AutoTokenizer

    end = AutoTokenizer.from_pretrained(tiny_think_model).convert_tokens_to_ids("</think>")
    return {**FORCED, "logit_bias": {str(end): 100}}


def test_the_readme_example_comes_back_apart(server):
    """The tiny tokenizer marks </think> special (a real reasoning model's is a plain added token,
    kept in the text the parser reads): the README's request keeps it in the text."""
    answer = json.loads(run_shell(README_COMMANDS[1], server.port).stdout)
    message = answer["choices"][0]["message"]
    assert message["content"] in ("yes", "no")
    assert message["reasoning"] in ("red sky", "blue sky")


def test_reasoning_comes_back_apart_from_the_answer(client, forced):
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40,
                                            extra_body={**forced, "skip_special_tokens": False})
    message = answer.choices[0].message
    assert message.content in ("yes", "no")
    assert message.model_extra["reasoning"] in ("red sky", "blue sky")


def test_reasoning_streamed_apart_from_the_answer(client, forced):
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, stream=True,
                                                extra_body=forced):
        if chunk.choices:
            reasoning += (chunk.choices[0].delta.model_extra or {}).get("reasoning") or ""
            content += chunk.choices[0].delta.content or ""
    assert reasoning in ("red sky", "blue sky")
    assert content in ("yes", "no")


def test_the_template_override_renders_the_prompt(client, tiny_think_model):
    """The prompt is the override's rendering (the contents, then <think>), not the tokenizer's own
    template's (role tags, end-of-message tokens), counted by the same tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_think_model)
    own = len(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True))
    override = len(tokenizer("<s>Is the sky blue?<think>", add_special_tokens=False)["input_ids"])
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    assert answer.usage.prompt_tokens == override != own


@pytest.mark.parametrize(("template", "message"), [
    ("{% for m in messages %}{{ m['content'] }", "option.chat_template (broken.jinja) does not compile"),
    (None, "option.chat_template=missing.jinja: no such file"),
], ids=["broken", "missing"])
def test_a_template_that_cannot_work_stops_start_up_in_one_line(tiny_think_model, tmp_path, template, message):
    """Refused where the settings are resolved: before any worker starts or anything downloads."""
    shutil.copytree(tiny_think_model, tmp_path, dirs_exist_ok=True)
    if template is not None:
        (tmp_path / "broken.jinja").write_text(template)
    name = "broken.jinja" if template is not None else "missing.jinja"
    server = Server(tmp_path, env={**VLLM_CPU_ENV, "OPTION_CHAT_TEMPLATE": name}).start(wait_ready=False)
    assert server.wait_exit(60) == 2
    lines = [line for line in server.log().splitlines() if message in line]
    assert len(lines) == 1, server.log()[-3000:]
    assert "Traceback" not in server.log() and "worker" not in lines[0]
