"""A text-generation handler for the SDK tests: LMI's schema and OpenAI chat on
/invocations, as the built-in engine answers them, without an engine.

It "generates" the prompt's words back, then a fixed tail of multi-byte text
("größer ☃ 日本語 🙂"), one word a token, up to max_new_tokens (max_tokens for
chat). Streams are LMI JSON lines ({"token": ...}, the last one with
"generated_text"), or server-sent events with option.output_formatter=sse; chat
streams are OpenAI's SSE chunks ending with data: [DONE]. {"fail_after": n}
ends a stream with an error after n tokens. {"echo_request": true} answers with
the request's headers as the handler got them (what reached the endpoint).
"""

import json
import time

from djl_python import Input, Output

TAIL = ["größer", "☃", "日本語", "🙂"]
properties = {}


def _tokens(prompt: str, count: int) -> list[str]:
    words = (prompt.split() + TAIL) * count
    return [(" " if i else "") + w for i, w in enumerate(words[:count])]


def _lmi_stream(tokens, sse: bool, fail_after: int | None):
    for i, text in enumerate(tokens):
        if fail_after is not None and i == fail_after:
            raise RuntimeError("generation failed on purpose")
        item = {"token": {"id": i, "text": text, "log_prob": -0.5}}
        if i == len(tokens) - 1:
            item["generated_text"] = "".join(tokens)
        line = json.dumps(item, ensure_ascii=False)
        yield f"data: {line}\n\n" if sse else f"{line}\n"


def _chat_stream(tokens):
    created = int(time.time())
    for i, text in enumerate(tokens):
        delta = {"role": "assistant", "content": text} if i == 0 else {"content": text}
        chunk = {"id": "chat-1", "object": "chat.completion.chunk", "created": created, "model": "sdk-textgen",
                 "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
        yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"


def handle(inputs: Input):
    global properties
    if inputs.is_empty():
        properties = inputs.get_properties()
        return None
    body = inputs.get_as_json()
    if body.get("echo_request"):
        return Output().add_as_json({name.lower(): value for name, value in inputs.get_properties().items()})
    sse = properties.get("output_formatter") == "sse"
    if "messages" in body:
        tokens = _tokens(body["messages"][-1]["content"], int(body.get("max_tokens", 16)))
        if body.get("stream"):
            return (Output().add_property("content-type", "text/event-stream")
                    .add_stream_content(_chat_stream(tokens), output_formatter=None))
        message = {"role": "assistant", "content": "".join(tokens)}
        return Output().add_as_json({"object": "chat.completion", "model": "sdk-textgen",
                                     "choices": [{"index": 0, "message": message, "finish_reason": "length"}]})
    parameters = body.get("parameters") or {}
    prompts = body["inputs"] if isinstance(body["inputs"], list) else [body["inputs"]]
    answers = [_tokens(p, int(parameters.get("max_new_tokens", 30))) for p in prompts]
    if body.get("stream"):
        content_type = "text/event-stream" if sse else "application/jsonlines"
        return (Output().add_property("content-type", content_type)
                .add_stream_content(_lmi_stream(answers[0], sse, body.get("fail_after")), output_formatter=None))
    out = [{"generated_text": "".join(tokens)} for tokens in answers]
    return Output().add_as_json(out if isinstance(body["inputs"], list) else out[0])
