"""``sagelmi openapi [--write]``: build the document ``GET /openapi.json`` serves from the
installed types (LMI's schema, vLLM's OpenAI requests, the error envelopes) into
``container/frontend/openapi.json``, which the frontend reads (``container.frontend.openapi``)."""

from __future__ import annotations

import json
from typing import Any

SCHEMAS = "#/components/schemas/"

# Which errors each kind of route can answer (the error table, container/core/errors.py).
_HANDLER_ERRORS = {
    "400": "the body or a parameter is not acceptable (the message names the field)",
    "404": "an adapter named in the request is not registered",
    "408": "the request's head or body did not arrive within header_read_timeout / body_read_timeout",
    "413": "the body is over max_payload_in_mb",
    "415": "a multipart/form-data body (the built-in engines read JSON)",
    "424": "the handler failed",
    "429": "a new stateful session past option.max_sessions",
    "503": "the server is full (job_queue_size), draining, still loading, or the worker group stopped",
    "504": "no answer within predict_timeout",
    "507": "the handler ran out of (device) memory",
}
_MANAGEMENT_ERRORS = {
    "400": "a bad name or source",
    "404": "no such model or adapter",
    "409": "an adapter of that name is registered already",
    "413": "an s3:// adapter's objects add up to more than max_adapter_size_in_mb",
    "503": "no worker group is ready",
    "504": "a worker group did not answer within predict_timeout",
}
_STREAM_TYPES = ("application/jsonlines", "text/event-stream")


def _errors(table: dict[str, str], envelope: str) -> dict[str, Any]:
    body = {"application/json": {"schema": {"$ref": SCHEMAS + envelope}}}
    return {status: {"description": text, "content": body} for status, text in table.items()}


def _json(schema: dict, description: str = "OK") -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _answers(schema: dict) -> dict:
    """A 200 that is JSON (``schema``) or, when the request asked to stream, a stream."""
    content = {"application/json": {"schema": schema}}
    content.update({kind: {"schema": {"type": "string"}} for kind in _STREAM_TYPES})
    return {"description": 'the answer, or a stream of it ("stream": true)', "content": content}


def _embeddings_answer(schema: dict) -> dict:
    """The vectors as JSON, or their raw bytes (``encoding_format`` bytes / bytes_only: vLLM's form, the
    layout in a ``metadata`` header for bytes)."""
    return {
        "description": "the vectors as JSON, or as bytes (encoding_format bytes, bytes_only)",
        "content": {
            "application/json": {"schema": schema},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    }


def _ref(name: str) -> dict:
    return {"$ref": SCHEMAS + name}


def build() -> dict[str, Any]:
    """The document for the built-in vLLM engine, from the installed types (imports vLLM)."""
    from pydantic import BaseModel
    from pydantic.json_schema import JsonSchemaMode, models_json_schema
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionResponse
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest, CompletionResponse
    from vllm.entrypoints.pooling.embed.protocol import (
        EmbeddingChatRequest,
        EmbeddingCompletionRequest,
        EmbeddingResponse,
    )
    from vllm.entrypoints.pooling.scoring.protocol import (
        RerankRequest,
        RerankResponse,
        ScoreDataRequest,
        ScoreQueriesDocumentsRequest,
        ScoreQueriesItemsRequest,
        ScoreResponse,
        ScoreTextRequest,
    )
    from vllm.entrypoints.serve.engine.protocol import ModelList
    from vllm.entrypoints.serve.tokenize.protocol import (
        DetokenizeRequest,
        DetokenizeResponse,
        TokenizeChatRequest,
        TokenizeCompletionRequest,
        TokenizeResponse,
    )

    from container.core.errors import LmiError, OpenAIError
    from container.core.request_priority import PRIORITY_MAX, PRIORITY_MIN
    from handlers.engines.lmi_schema import LmiAnswer, LmiBody

    models: list[tuple[type[BaseModel], JsonSchemaMode]] = [
        (LmiBody, "validation"),
        (LmiAnswer, "serialization"),
        (ChatCompletionRequest, "validation"),
        (CompletionRequest, "validation"),
        (ChatCompletionResponse, "serialization"),
        (CompletionResponse, "serialization"),
        (ModelList, "serialization"),
        (TokenizeCompletionRequest, "validation"),
        (TokenizeChatRequest, "validation"),
        (DetokenizeRequest, "validation"),
        (TokenizeResponse, "serialization"),
        (DetokenizeResponse, "serialization"),
        (EmbeddingCompletionRequest, "validation"),
        (EmbeddingChatRequest, "validation"),
        (EmbeddingResponse, "serialization"),
        (ScoreQueriesDocumentsRequest, "validation"),
        (ScoreQueriesItemsRequest, "validation"),
        (ScoreDataRequest, "validation"),
        (ScoreTextRequest, "validation"),
        (ScoreResponse, "serialization"),
        (RerankRequest, "validation"),
        (RerankResponse, "serialization"),
        (LmiError, "serialization"),
        (OpenAIError, "serialization"),
    ]
    keys, schemas = models_json_schema(models, ref_template=SCHEMAS + "{model}")
    names = {model: keys[(model, mode)]["$ref"].removeprefix(SCHEMAS) for model, mode in models}
    lmi, answer, chat, completion = (names[m] for m in (LmiBody, LmiAnswer, ChatCompletionRequest, CompletionRequest))
    chat_answer, completion_answer = names[ChatCompletionResponse], names[CompletionResponse]
    lmi_error, openai_error = names[LmiError], names[OpenAIError]
    lmi_errors, openai_errors = _errors(_HANDLER_ERRORS, lmi_error), _errors(_HANDLER_ERRORS, openai_error)
    management_errors = _errors(_MANAGEMENT_ERRORS, lmi_error)

    def body(*names: str) -> dict:
        refs = [_ref(n) for n in names]
        return {
            "required": True,
            "content": {"application/json": {"schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}},
        }

    health = {
        "type": "object",
        "required": ["status", "workers"],
        "properties": {
            "status": {"type": "string", "enum": ["Healthy", "Loading", "Unhealthy", "Draining"]},
            "workers": {"type": "array", "items": {"type": "object"}},
        },
    }
    model_name = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    adapter_name = {"name": "adapter", "in": "path", "required": True, "schema": {"type": "string"}}
    status = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
    priority = [
        {
            "name": "X-Priority",
            "in": "header",
            "required": False,
            "description": "the request's scheduling priority (LMI's header; vLLM's meaning: lower values are served "
            "first, default 0), over the body's priority; needs option.scheduling_policy=priority (else a 400)",
            "schema": {"type": "integer", "minimum": PRIORITY_MIN, "maximum": PRIORITY_MAX},
        }
    ]
    embeddings, scores = names[EmbeddingResponse], names[ScoreResponse]
    score_bodies = [names[m] for m in (ScoreQueriesDocumentsRequest, ScoreQueriesItemsRequest)]
    score_bodies += [names[m] for m in (ScoreDataRequest, ScoreTextRequest)]
    embedding_bodies = [names[EmbeddingCompletionRequest], names[EmbeddingChatRequest]]
    vectors = {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}
    lmi_answer = {
        "anyOf": [_ref(answer), {"type": "array", "items": _ref(answer)}, _ref(chat_answer), _ref(completion_answer)]
        + [vectors, _ref(embeddings), _ref(scores), _ref(names[RerankResponse])]
    }
    lmi_embedding = {
        "type": "object",
        "required": ["inputs"],
        "properties": {"inputs": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}},
    }
    paths = {
        "/ping": {
            "get": {
                "summary": "SageMaker's health check: 200 once every worker group is ready",
                "responses": {"200": _json(health), "503": _json(health, "loading, unhealthy or draining")},
            }
        },
        "/invocations": {
            "post": {
                "parameters": priority,
                "summary": "SageMaker's inference route: LMI's schema (inputs), or an OpenAI chat (messages) or "
                "completion (prompt) body; on a pooling model (option.task=text-embedding ...) LMI's embedding form "
                "(inputs: vectors out), or the bodies of /v1/embeddings, /v1/score, /v1/rerank",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "anyOf": [_ref(n) for n in (lmi, chat, completion)]
                                + [lmi_embedding]
                                + [_ref(n) for n in (*embedding_bodies, names[RerankRequest], *score_bodies)]
                            }
                        }
                    },
                },
                "responses": {"200": _answers(lmi_answer), **lmi_errors},
            }
        },
        "/v1/chat/completions": {
            "post": {
                "parameters": priority,
                "summary": "OpenAI chat completions (vLLM's semantics)",
                "requestBody": body(chat),
                "responses": {"200": _answers(_ref(chat_answer)), **openai_errors},
            }
        },
        "/v1/completions": {
            "post": {
                "parameters": priority,
                "summary": "OpenAI completions (vLLM's semantics)",
                "requestBody": body(completion),
                "responses": {"200": _answers(_ref(completion_answer)), **openai_errors},
            }
        },
        "/v1/embeddings": {
            "post": {
                "parameters": priority,
                "summary": "OpenAI embeddings on a pooling model (vLLM's semantics; a 400 on a generation model)",
                "requestBody": body(*embedding_bodies),
                "responses": {"200": _embeddings_answer(_ref(embeddings)), **openai_errors},
            }
        },
        "/v1/score": {
            "post": {
                "parameters": priority,
                "summary": "vLLM's scores of text pairs on a pooling model (a 400 on a generation model)",
                "requestBody": body(*score_bodies),
                "responses": {"200": _json(_ref(scores)), **openai_errors},
            }
        },
        "/v1/rerank": {
            "post": {
                "parameters": priority,
                "summary": "vLLM's (Jina's) rerank of documents for a query on a pooling model",
                "requestBody": body(names[RerankRequest]),
                "responses": {"200": _json(_ref(names[RerankResponse])), **openai_errors},
            }
        },
        "/tokenize": {
            "post": {
                "summary": "the prompt's token ids (a prompt, or chat messages rendered by the chat template)",
                "requestBody": body(names[TokenizeCompletionRequest], names[TokenizeChatRequest]),
                "responses": {"200": _json(_ref(names[TokenizeResponse])), **openai_errors},
            }
        },
        "/detokenize": {
            "post": {
                "summary": "the text of token ids",
                "requestBody": body(names[DetokenizeRequest]),
                "responses": {"200": _json(_ref(names[DetokenizeResponse])), **openai_errors},
            }
        },
        "/v1/models": {
            "get": {
                "summary": "the served model and its LoRA adapters",
                "responses": {
                    "200": _json(_ref(names[ModelList])),
                    **{k: v for k, v in openai_errors.items() if k in ("503", "504")},
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics: the frontend's and every worker group's",
                "responses": {
                    "200": {
                        "description": "Prometheus text format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/execution-parameters": {
            "get": {
                "summary": "SageMaker batch transform's parameters",
                "responses": {
                    "200": _json(
                        {"type": "object", "required": ["MaxConcurrentTransforms", "BatchStrategy", "MaxPayloadInMB"]}
                    )
                },
            }
        },
        "/models": {
            "get": {
                "summary": "the served model, its worker groups and adapters (LMI management)",
                "responses": {"200": _json({"type": "object", "required": ["models"]})},
            }
        },
        "/models/{model}/adapters": {
            "get": {
                "summary": "the registered LoRA adapters",
                "parameters": [model_name],
                "responses": {
                    "200": _json({"type": "object", "required": ["adapters"]}),
                    "404": management_errors["404"],
                },
            },
            "post": {
                "summary": "register a LoRA adapter (option.enable_lora)",
                "parameters": [
                    model_name,
                    {"name": "name", "in": "query", "required": True, "schema": {"type": "string"}},
                    {
                        "name": "src",
                        "in": "query",
                        "required": True,
                        "schema": {"type": "string"},
                        "description": "a directory inside option.adapter_roots, or an s3:// prefix",
                    },
                ],
                "responses": {"200": _json(status), **management_errors},
            },
        },
        "/models/{model}/adapters/{adapter}": {
            "get": {
                "summary": "one adapter",
                "parameters": [model_name, adapter_name],
                "responses": {"200": _json({"type": "array"}), "404": management_errors["404"]},
            },
            "delete": {
                "summary": "unregister an adapter",
                "parameters": [model_name, adapter_name],
                "responses": {
                    "200": _json(status),
                    **{k: v for k, v in management_errors.items() if k in ("404", "503", "504")},
                },
            },
        },
        "/openapi.json": {"get": {"summary": "this document", "responses": {"200": _json({"type": "object"})}}},
    }
    from importlib.metadata import version

    return {
        "openapi": "3.1.0",
        "info": {
            "title": "sagelmi",
            "version": version("sagelmi"),
            "description": "SageMaker-compatible LLM serving: LMI's and OpenAI's schemas. Errors are "
            f"{lmi_error} on LMI's routes and {openai_error} on /v1 routes, /tokenize and /detokenize.",
        },
        "paths": paths,
        "components": {"schemas": schemas["$defs"]},
        "x-handler-routes": [
            "/invocations",
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/models",
            "/tokenize",
            "/detokenize",
            "/v1/embeddings",
            "/v1/score",
            "/v1/rerank",
        ],
    }


def render(document: dict) -> str:
    return json.dumps(document, indent=1, sort_keys=True) + "\n"
