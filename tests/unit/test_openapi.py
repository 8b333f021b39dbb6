"""GET /openapi.json: generated from the types the server validates with, covering every route."""

import re

from container.core import errors
from container.cli import openapi as openapi_build
from container.frontend import openapi
from container.frontend.app import create_app
from container.core.launch import FrontendLaunch, ModelInfo
from handlers.engines.lmi_schema import Formatter, Generation, LmiAnswer, TokenInfo, parse_request


def test_the_packaged_document_is_what_the_types_generate():
    assert openapi.DOCUMENT_FILE.read_text() == openapi_build.render(openapi_build.build()), \
        "regenerate it: python -m container openapi --write"


def _app_routes() -> set[tuple[str, str]]:
    launch = FrontendLaunch(listen_fd=-1, groups=[], job_queue_size=1, max_payload_bytes=1024, predict_timeout=1,
                            grace_period=1, model=ModelInfo(name="m", location="/models/m"))
    app = create_app(launch)
    return {(method.lower(), re.sub(r"<(\w+)>", r"{\1}", rule.rule).replace("{name}", "{model}"))
            for rule in app.url_map.iter_rules() if rule.endpoint != "static"
            for method in rule.methods - {"HEAD", "OPTIONS"}}


def test_every_route_the_server_answers_is_documented_and_nothing_else():
    documented = {(method, path) for path, item in openapi.for_model(True)["paths"].items() for method in item}
    assert documented == _app_routes()


def test_handler_routes_document_every_error_the_server_sends_for_them():
    document = openapi.for_model(True)
    statuses = {cls.status for cls in (errors.InputError, errors.NotFound, errors.PayloadTooLarge,
                                       errors.HandlerError, errors.ServiceUnavailable, errors.GatewayTimeout,
                                       errors.OutOfMemory)}
    envelopes = {"/invocations": "LmiError", "/v1/chat/completions": "OpenAIError", "/v1/completions": "OpenAIError",
                 "/v1/responses": "OpenAIError", "/v1/messages": "AnthropicError",
                 "/v1/messages/count_tokens": "AnthropicError"}
    for path, envelope in envelopes.items():
        responses = document["paths"][path]["post"]["responses"]
        assert statuses <= {int(s) for s in responses if s.isdigit()}, path
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith(envelope)


def test_with_a_model_py_handler_routes_take_any_body_and_keep_their_errors():
    document = openapi.for_model(False)
    invocations = document["paths"]["/invocations"]["post"]
    assert invocations["requestBody"]["content"] == {"*/*": {"schema": {}}}
    assert "default" in invocations["responses"] and "503" in invocations["responses"]
    assert "LmiBody" in openapi.for_model(True)["paths"]["/invocations"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["anyOf"][0]["$ref"]
    assert openapi.for_model(True)["paths"]["/invocations"]["post"]["requestBody"]["required"] is True


def test_the_documented_lmi_answer_is_what_the_formatter_writes():
    request = parse_request({"inputs": ["a", "b"], "parameters": {"details": True, "top_n_tokens": 1,
                                                                 "decoder_input_details": True}}, set())
    token = TokenInfo(1, "x", -0.5, top=[TokenInfo(2, "y", -1.0)])
    generations = [Generation(prompt=p, text="x", tokens=[token], prefill=[TokenInfo(3, "a", None)],
                              finish_reason="length") for p in request.prompts]
    for answer in Formatter("json", tgi=False).body(generations, request):
        assert LmiAnswer.model_validate(answer).model_dump(exclude_unset=True) == answer


def test_error_envelopes_are_built_from_their_documented_types():
    assert errors.LmiError.model_validate(errors.envelope(400, "invalid input", "bad"))
    assert errors.OpenAIError.model_validate(errors.openai_envelope(404, "not found", "no such adapter"))
    assert errors.AnthropicError.model_validate(errors.anthropic_envelope(400, "invalid input", "bad"))


def test_the_handler_routes_are_the_documented_ones():
    from container.frontend.early import ROUTES

    assert openapi.for_model(True)["x-handler-routes"] == list(ROUTES)
