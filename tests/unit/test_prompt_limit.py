"""max_prompts_per_request: the prompts of every request form the built-in engines take, counted on
the parsed body before any engine request is made."""

import json
import time

import pytest

from container.core.errors import InputError, describe
from handlers.engines.invocation_forms import PROMPT_FIELDS, check_prompt_count, prompt_count

LIMIT = 1024
MANY = 5000
CONVERSATION = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("form,body,field", [
    ("lmi", {"inputs": ["hi"] * MANY}, "inputs"),
    ("completion", {"prompt": ["hi"] * MANY}, "prompt"),
    ("completion", {"prompt": [[1, 2]] * MANY}, "prompt"),  # token-id lists
    ("completion", {"prompt_embeds": ["AAAA"] * MANY}, "prompt_embeds"),
    ("embeddings", {"input": ["hi"] * MANY}, "input"),
    ("embeddings", {"input": [[1, 2]] * MANY}, "input"),
    ("embeddings", {"input": [CONVERSATION] * MANY}, "input"),  # batched conversations
    ("embeddings", {"messages": [CONVERSATION] * MANY}, "messages"),
    ("score", {"queries": "q", "documents": ["d"] * MANY}, "documents"),
    ("score", {"queries": ["q"] * MANY, "items": ["d"] * MANY}, "queries"),
    ("score", {"data_1": "q", "data_2": [{"content": []}] * MANY}, "data_2"),
    ("score", {"text_1": ["q"] * MANY, "text_2": "d"}, "text_1"),
    ("rerank", {"query": "q", "documents": ["d"] * MANY}, "documents"),
])
def test_a_list_over_the_limit_is_400_naming_the_field_and_the_setting(form, body, field):
    with pytest.raises(InputError) as caught:
        check_prompt_count(body, form, LIMIT)
    status, _, message = describe(caught.value)
    assert status == 400
    assert f"'{field}' holds {MANY} prompts" in message and f"at most {LIMIT}" in message
    assert "max_prompts_per_request" in message and "SERVING_MAX_PROMPTS_PER_REQUEST" in message


@pytest.mark.parametrize("form,body", [
    ("lmi", {"inputs": ["hi"] * LIMIT}),
    ("lmi", {"inputs": "x" * 100_000}),
    ("completion", {"prompt": list(range(MANY))}),  # one prompt of token ids
    ("completion", {"prompt": "hi"}),
    ("embeddings", {"input": CONVERSATION * MANY}),  # one conversation of many messages
    ("embeddings", {"messages": CONVERSATION * MANY}),
    ("rerank", {"query": "q", "documents": ["d"] * LIMIT}),
    ("chat", {"messages": CONVERSATION * MANY}),  # a chat is one prompt
    ("completion", {"prompt": []}),  # empty or wrong shapes are the schema's to refuse
    ("lmi", {"inputs": 5}),
])
def test_one_prompt_or_up_to_the_limit_passes(form, body):
    check_prompt_count(body, form, LIMIT)


def test_every_form_has_its_fields():
    assert set(PROMPT_FIELDS) == {"lmi", "completion", "embeddings", "classification", "pooling", "score", "rerank"}
    assert prompt_count(None) == prompt_count("x") == prompt_count([]) == 1


def test_the_check_is_cheap_beside_parsing_the_body():
    """5,000 prompts in a body of about 6 MB: the count is a length, not a walk of the prompts."""
    text = json.dumps({"inputs": ["x" * 1200] * MANY})
    body = json.loads(text)
    started = time.perf_counter()
    with pytest.raises(InputError):
        check_prompt_count(body, "lmi", LIMIT)
    assert time.perf_counter() - started < 0.01
