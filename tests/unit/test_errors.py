import json

from container.core.errors import (
    GatewayTimeout,
    PayloadTooLarge,
    ServiceUnavailable,
    describe,
    envelope,
    envelope_for,
    is_openai_path,
    one_line,
    scrub,
)


def test_status_table():
    assert describe(PayloadTooLarge("big"))[:2] == (413, "payload too large")
    assert describe(ServiceUnavailable("full"))[0] == 503
    assert describe(GatewayTimeout())[0] == 504
    assert describe(RuntimeError("boom")) == (424, "invoke handler failure", "boom")
    assert describe(json.JSONDecodeError("bad", "{", 0))[0] == 400
    assert describe(KeyError())[2] == "KeyError"


def test_a_key_error_says_which_key_is_missing():
    """A KeyError's message is the key alone: the client is told the type and that the key is missing."""
    assert describe(KeyError("inputs")) == (424, "invoke handler failure", "KeyError: 'inputs' is missing (the "
                                            "handler looked up a key that is not there: a field the request does "
                                            "not have?)")
    assert describe(KeyError("requested data for key:x is not found!"))[2] == (
        "KeyError: requested data for key:x is not found!")
    assert "<path>" in describe(KeyError("/root/secret/file"))[2]


def test_paths_are_scrubbed_but_urls_are_not():
    text = ("No such file: '/tmp/ml/model/weights.bin' see https://example.com/a/b and /usr/lib/python3/x.py "
            "on route /v1/chat/completions")
    assert scrub(text) == "No such file: '<path>' see https://example.com/a/b and <path> on route /v1/chat/completions"
    assert describe(FileNotFoundError(2, "No such file", "/root/secret/file"))[2].count("<path>") == 1


def test_envelope_shape():
    assert envelope(424, "invoke handler failure", "x") == {"code": 424, "message": "invoke handler failure", "error": "x"}


def test_the_envelope_follows_the_route():
    assert envelope_for("/invocations", 413, "payload too large", "big") == envelope(413, "payload too large", "big")
    assert envelope_for("/v1/completions", 400, "invalid input", "bad JSON") == {
        "error": {"message": "bad JSON", "type": "BadRequestError", "param": None, "code": 400}}
    assert envelope_for("/v1/models", 404, "not found", "no")["error"]["type"] == "NotFoundError"
    assert envelope_for("/v1/chat/completions", 503, "service unavailable", "full")["error"]["type"] == \
        "InternalServerError"


def test_anthropics_routes_answer_in_anthropics_envelope():
    """vLLM's server answers /v1/messages errors as Anthropic's API does: {"type": "error", "error": {"type",
    "message"}}, the type named as Anthropic names it for the status."""
    assert envelope_for("/v1/messages", 400, "invalid input", "max_tokens: Field required") == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"}}
    kinds = {status: envelope_for("/v1/messages/count_tokens", status, "m", "d")["error"]["type"]
             for status in (404, 413, 424, 429, 503, 504, 507)}
    assert kinds == {404: "not_found_error", 413: "request_too_large", 424: "api_error",
                     429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error", 507: "api_error"}
    assert not is_openai_path("/v1/messages") and not is_openai_path("/v1/messages/count_tokens")
    assert is_openai_path("/v1/responses") and "code" in envelope_for("/v1/responses", 400, "m", "d")["error"]
    assert envelope_for("/v1/messagesx", 400, "m", "d")["error"]["type"] == "BadRequestError"  # not Anthropic's


def test_one_line_gives_a_validation_errors_messages():
    import pydantic

    class Config(pydantic.BaseModel):
        size: int

        @pydantic.field_validator("size")
        @classmethod
        def small(cls, value):
            raise ValueError(f"size {value} is too large\nsecond line")

    try:
        Config(size=5)
    except pydantic.ValidationError as exc:
        text = one_line(exc)
    assert text == "ValidationError in Config: size 5 is too large second line"
    assert one_line(RuntimeError("a\n  b\n")) == "RuntimeError: a b"
    assert one_line(KeyError()) == "KeyError"
