"""Which form a body on ``/invocations`` is: SageMaker's one inference route takes LMI's schema
and every body vLLM's SageMaker router takes (``vllm/entrypoints/serve/sagemaker``), told apart
by their fields.

vLLM's router tries its request types in one order (chat, completion on a generation model;
embeddings, classification, rerank, score, pooling on a pooling model, each only where the model
serves it) and takes the first whose validation passes. Here the forms go in the same order,
with LMI's ``inputs`` before vLLM's (LMI's own container reads ``messages`` first too), and a form
is chosen by the fields it needs: a body of that form that does not validate gets that form's 400
naming the field, where vLLM's router would try the next type and answer "Cannot find suitable
handler". The table in docs/http_api.md is this one.

How many prompts a body of a form holds, and the limit on them (``max_prompts_per_request``):
each prompt of a list becomes an engine request of its own, all admitted as one request (a 6 MB
body holds about a million). Every built-in engine checks the count on the parsed body, before
it validates the rest or creates any engine request (vLLM's ``CompletionRequest`` has a check of
its own, ``VLLM_MAX_COMPLETION_PROMPTS``, which the supervisor sets to the same limit).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from container.core.errors import InputError

# (form, the fields any one of which makes a body that form), first match wins
GENERATION_FORMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("chat", ("messages",)),  # OpenAI chat (vLLM's ChatCompletionRequest; LMI's container reads it first too)
    ("lmi", ("inputs",)),  # LMI's schema
    ("completion", ("prompt",)),  # OpenAI completion (vLLM's CompletionRequest)
    ("session", ("requestType",)),  # SageMaker's stateful sessions: NEW_SESSION, CLOSE
)
POOLING_FORMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("lmi", ("inputs",)),  # LMI's embedding form
    ("embeddings", ("input", "messages")),  # vLLM's EmbeddingRequest: a model pooling for embed
    ("classification", ("input", "messages")),  # vLLM's ClassificationRequest: a model pooling for classify
    ("rerank", ("query",)),  # vLLM's RerankRequest (query, documents)
    ("score", ("queries", "data_1", "text_1")),  # vLLM's ScoreRequest forms
    ("pooling", ("input", "messages", "data")),  # vLLM's PoolingRequest (data: an IO processor plugin's)
)
GENERATION_KINDS = frozenset(form for form, _ in GENERATION_FORMS)


def invocation_kind(body: dict, served: Collection[str], pooling: bool = False) -> str | None:
    """The form of ``body``: the first of the model's forms (``POOLING_FORMS`` when ``pooling``,
    else ``GENERATION_FORMS``) that the model serves (``served``) and whose fields the body has;
    else the first form of the table whose fields it has, though the model does not serve it (the
    caller says so); ``None`` when it has none of their fields."""
    forms = POOLING_FORMS if pooling else GENERATION_FORMS
    matching = [form for form, fields in forms if any(name in body for name in fields)]
    return next((form for form in matching if form in served), matching[0] if matching else None)


# The fields that hold a request's prompts, by its form (the route's kind): a list in any of them
# is one engine request per item. Score requests pair their two sides 1:N or N:N: the longer one counts.
PROMPT_FIELDS = {
    "lmi": ("inputs",),  # LMI's schema, for generation and LMI's embedding form
    "completion": ("prompt", "prompt_embeds"),
    "embeddings": ("input", "messages"),
    "classification": ("input", "messages"),
    "pooling": ("input", "messages"),
    "score": ("queries", "documents", "items", "data_1", "data_2", "text_1", "text_2"),
    "rerank": ("documents",),
}


def prompt_count(value: Any) -> int:
    """The prompts in one field's value: a list holds one per item, unless it is itself one
    prompt: a list of token ids, or one conversation (a list of chat messages)."""
    if not isinstance(value, list) or not value:
        return 1
    first = value[0]
    if isinstance(first, int) or (isinstance(first, dict) and "role" in first):
        return 1
    return len(value)


def check_prompt_count(body: dict, form: str, limit: int) -> None:
    """Raise ``InputError`` when a prompt field of ``body`` (a request of ``form``, a key of
    ``PROMPT_FIELDS``; other forms hold one prompt) holds more than ``limit`` prompts."""
    for name in PROMPT_FIELDS.get(form, ()):
        count = prompt_count(body.get(name))
        if count > limit:
            raise InputError(
                f"'{name}' holds {count} prompts; a request may hold at most {limit} "
                f"(max_prompts_per_request / SERVING_MAX_PROMPTS_PER_REQUEST)"
            )
