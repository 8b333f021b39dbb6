"""How many prompts a request holds, and the limit on them (``max_prompts_per_request``).

Each prompt of a list becomes an engine request of its own, all admitted as one request: a
6 MB body holds about a million. Every built-in engine checks the count on the parsed body,
before it validates the rest or creates any engine request (vLLM's ``CompletionRequest`` has a
check of its own, ``VLLM_MAX_COMPLETION_PROMPTS``, which the supervisor sets to the same limit).
"""

from __future__ import annotations

from typing import Any

from container.core.errors import InputError

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
