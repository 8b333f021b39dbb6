"""Which form a body on /invocations is (handlers.engines.invocation_forms), in the order of vLLM's
SageMaker router with LMI's schema beside it; the table in docs/http_api.md is checked against it."""

from pathlib import Path

import pytest

from handlers.engines.invocation_forms import GENERATION_FORMS, GENERATION_KINDS, POOLING_FORMS, invocation_kind

DOCS = Path(__file__).parents[2] / "docs" / "http_api.md"
EMBED = frozenset({"lmi", "embeddings", "rerank", "score", "pooling"})  # what vLLM serves for a model pooling for embed
CLASSIFY = frozenset({"lmi", "classification", "pooling"})  # a classifier with several labels: no scoring API
TOKEN_EMBED = frozenset({"lmi", "rerank", "score", "pooling"})  # token_embed: scoring and pooling, no embeddings
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, kind", [
    ({"inputs": "hi"}, "lmi"),
    ({"inputs": "hi", "parameters": {"max_new_tokens": 4}, "adapters": "a1"}, "lmi"),
    ({"messages": MESSAGES}, "chat"),
    ({"messages": MESSAGES, "inputs": "hi"}, "chat"),  # as LMI's container and vLLM's: messages first
    ({"prompt": "hi"}, "completion"),
    ({"prompt": "hi", "inputs": "hi"}, "lmi"),  # LMI's schema before vLLM's completion: LMI clients keep working
    ({"prompt": "hi", "messages": MESSAGES}, "chat"),  # vLLM's order: chat before completion
    ({"requestType": "NEW_SESSION"}, "session"),
    ({"input": "hi"}, None),  # pooling forms on a generation model: none of its forms
    ({"query": "q", "documents": ["d"]}, None),
    ({}, None),
])
def test_a_generation_model(body, kind):
    assert invocation_kind(body, GENERATION_KINDS) == kind


@pytest.mark.parametrize("body, kind", [
    ({"inputs": ["a", "b"]}, "lmi"),  # LMI's embedding form
    ({"inputs": "a", "input": "b"}, "lmi"),
    ({"input": "hi"}, "embeddings"),
    ({"input": "hi", "encoding_format": "base64", "dimensions": 32}, "embeddings"),
    ({"messages": MESSAGES}, "embeddings"),  # vLLM's EmbeddingChatRequest
    ({"input": "hi", "query": "q", "documents": ["d"]}, "embeddings"),  # embeddings before rerank
    ({"query": "q", "documents": ["d"], "top_n": 1}, "rerank"),
    ({"query": "q", "queries": "q", "documents": ["d"]}, "rerank"),  # rerank before score
    ({"queries": "q", "documents": ["d"]}, "score"),
    ({"queries": "q", "items": ["d"]}, "score"),
    ({"data_1": "a", "data_2": "b"}, "score"),
    ({"text_1": "a", "text_2": ["b", "c"]}, "score"),
    ({"data": {"x": 1}}, "pooling"),  # an IO processor plugin's form
    ({"prompt": "hi"}, None),  # generation forms on a pooling model
    ({"requestType": "NEW_SESSION"}, None),
])
def test_a_model_pooling_for_embed(body, kind):
    assert invocation_kind(body, EMBED, pooling=True) == kind


@pytest.mark.parametrize("body, kind", [
    ({"input": "hi"}, "classification"),
    ({"messages": MESSAGES}, "classification"),
    ({"inputs": "hi"}, "lmi"),  # answered with a 400: the model has no embeddings API
    ({"query": "q", "documents": ["d"]}, "rerank"),  # not served: the caller answers that the model has no rerank API
    ({"data": 1}, "pooling"),
])
def test_a_classifier(body, kind):
    assert invocation_kind(body, CLASSIFY, pooling=True) == kind


def test_a_model_without_embeddings_pools_its_inputs():
    assert invocation_kind({"input": "hi"}, TOKEN_EMBED, pooling=True) == "pooling"
    assert invocation_kind({"messages": MESSAGES}, TOKEN_EMBED, pooling=True) == "pooling"
    assert invocation_kind({"query": "q", "documents": ["d"]}, TOKEN_EMBED, pooling=True) == "rerank"


def test_the_docs_table_lists_the_forms_in_this_order():
    """docs/http_api.md's table of /invocations bodies: the same forms, in the same order."""
    text = DOCS.read_text()
    lines = text[text.index("| model | form | the body has"):].splitlines()[2:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines[: lines.index("")]]
    for forms, model in ((GENERATION_FORMS, "generation"), (POOLING_FORMS, "pooling")):
        documented = [(row[1], row[2]) for row in rows if row[0] == model]
        assert documented == [(f"`{form}`", ", ".join(f"`{f}`" for f in fields)) for form, fields in forms], model
