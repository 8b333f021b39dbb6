"""Pooling models on the vLLM engine (vLLM's pooling runner: ``option.task=text-embedding``,
``classify`` ..., or ``option.runner=pooling``): embeddings, classification, scores, reranking and
vLLM's pooling API through vLLM's own serving classes (``ServingEmbedding``,
``ServingClassification``, ``ServingScores``, ``ServingPooling``, each where vLLM's server has it
for the model) around the same engine, so their semantics are vLLM's server's, plus LMI's
embedding form on ``/invocations``.

Routes (``PoolingFront.answer``; which form a body on ``/invocations`` is:
``handlers.engines.invocation_forms``):

- ``/v1/embeddings``, or ``/invocations`` with ``input`` or ``messages`` on a model pooling for
  embed: OpenAI's embeddings (vLLM's form: ``encoding_format`` float / base64 / bytes,
  ``dimensions`` on a Matryoshka model, ``use_activation``);
- ``/invocations`` with ``input`` or ``messages`` on a model pooling for classify: vLLM's classification;
- ``/v1/score``, or ``/invocations`` with ``queries`` / ``data_1`` / ``text_1``: vLLM's scores;
- ``/v1/rerank``, or ``/invocations`` with ``query``: vLLM's (Jina's) rerank;
- ``/invocations`` with ``input``, ``messages`` or ``data`` that none of those take: vLLM's pooling API;
- ``/invocations`` with ``inputs``: LMI's embedding form (djl_python's vLLM handler): a string or a
  list of strings in, one vector per string out (``[[...], ...]``), L2-normalised unless
  ``option.normalize=false``.

``option.normalize``, when set, is the ``use_activation`` of every embedding request that does not
give one; unset, LMI's form normalises (LMI's default) and ``/v1/embeddings`` follows the model's
pooler (vLLM's default: normalised for embedding models).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from pydantic import TypeAdapter, ValidationError
from vllm.entrypoints.pooling.classify.protocol import ClassificationRequest
from vllm.entrypoints.pooling.classify.serving import ServingClassification
from vllm.entrypoints.pooling.embed.protocol import EmbeddingCompletionRequest, EmbeddingRequest
from vllm.entrypoints.pooling.embed.serving import ServingEmbedding
from vllm.entrypoints.pooling.pooling.protocol import PoolingRequest
from vllm.entrypoints.pooling.pooling.serving import ServingPooling
from vllm.entrypoints.pooling.scoring.protocol import RerankRequest, ScoreRequest
from vllm.entrypoints.pooling.scoring.serving import ServingScores
from vllm.entrypoints.pooling.utils import enable_scoring_api
from vllm.entrypoints.serve import create_error_response
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.exceptions import VLLMClientError
from vllm.renderers.chat_utils import ChatTemplateConfig
from vllm.tasks import POOLING_TASKS

from container.core.errors import InputError
from handlers.api import Output
from handlers.engines.vllm_openai import _MALFORMED, _malformed, _openai_error, priority_refusal, with_priority

log = logging.getLogger("sagelmi.vllm")

# The paths pooling models answer, and what each serves; generation paths are refused on them.
POOLING_PATHS = {"/v1/embeddings": "embeddings", "/v1/score": "score", "/v1/rerank": "rerank"}
_REQUESTS: dict[str, TypeAdapter] = {
    "embeddings": TypeAdapter(EmbeddingRequest),
    "classification": TypeAdapter(ClassificationRequest),
    "score": TypeAdapter(ScoreRequest),
    "rerank": TypeAdapter(RerankRequest),
    "pooling": TypeAdapter(PoolingRequest),
}
# The API each form is answered by, for messages
_APIS = {
    "lmi": "embeddings API (LMI's 'inputs' form)",
    "classification": "classification API",
    "pooling": "pooling API",
}


def _texts(inputs: Any) -> list[str]:
    texts = [inputs] if isinstance(inputs, str) else inputs
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise InputError("'inputs' must be a string or a non-empty list of strings")
    return texts


def _detail(exc: ValidationError) -> str:
    """Pydantic's errors for a body validated against one of several request forms, once each,
    without the validators' own names in the field paths."""
    lines = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"] if not str(p).startswith("function-"))
        line = f"{where}: {error['msg']}"
        if line not in lines:
            lines.append(line)
    return "; ".join(lines)


class PoolingFront:
    """vLLM's pooling serving classes around one engine whose runner is ``pooling``; built at the
    first request (the engine's supported tasks are only known asynchronously)."""

    def __init__(
        self,
        engine: Any,
        models: Any,
        task: str,
        normalize: bool | None,
        trust_request_mm_kwargs: bool = False,
        priority_scheduling: bool = False,
    ) -> None:
        self.engine = engine
        self.priority_scheduling = priority_scheduling  # option.scheduling_policy=priority
        self.models = models
        self.task = task  # how the model is served, for messages: option.task=text-embedding ...
        self.normalize = normalize
        self.trust_request_mm_kwargs = trust_request_mm_kwargs  # vLLM's flag: a request's media_io_kwargs taken
        self.pooling_task: str | None = None
        self.serving: dict[str, Any] = {}
        self._lock = asyncio.Lock()

    async def served(self) -> frozenset[str]:
        """The forms this model answers (``handlers.engines.invocation_forms``): LMI's and those of
        vLLM's APIs it has."""
        await self._ready()
        return frozenset({"lmi", *self.serving})

    async def _ready(self) -> None:
        """The serving classes vLLM's server builds for this model (its ``init_pooling_state``)."""
        async with self._lock:
            if self.pooling_task is not None:
                return
            tasks = tuple(await self.engine.get_supported_tasks())
            model_config = self.engine.model_config
            config = ChatTemplateConfig(trust_request_mm_kwargs=self.trust_request_mm_kwargs)
            pooling_task = model_config.get_pooling_task(tasks)
            common: dict[str, Any] = {"request_logger": None, "chat_template_config": config}
            if pooling_task == "embed":
                self.serving["embeddings"] = ServingEmbedding(self.engine, self.models, **common)
            if pooling_task == "classify":
                self.serving["classification"] = ServingClassification(self.engine, self.models, **common)
            if enable_scoring_api(tasks, model_config):
                scores = ServingScores(self.engine, self.models, supported_tasks=tasks, **common)
                self.serving["score"] = self.serving["rerank"] = scores
            if any(task in POOLING_TASKS for task in tasks):
                self.serving["pooling"] = ServingPooling(self.engine, self.models, supported_tasks=tasks, **common)
            self.pooling_task = str(pooling_task)
            log.info("pooling model (%s): vLLM pools for %s; serves %s", self.task, tasks, sorted(self.serving))

    async def answer(self, kind: str, body: dict, path: str, priority: int | None = None) -> Output:
        """Answer ``kind`` (``embeddings``, ``classification``, ``score``, ``rerank``, ``pooling`` or
        ``lmi``), as vLLM's server does (LMI's form as djl_python's vLLM handler does); ``body``'s
        model already resolved. ``priority``: the request's ``X-Priority``, which wins over the
        body's ``priority``."""
        await self._ready()
        serving = self.serving.get("embeddings" if kind == "lmi" else kind)
        if serving is None:
            served = [p for p, k in POOLING_PATHS.items() if k in self.serving]
            served += [f"/invocations ({_APIS[k]})" for k in ("classification", "pooling") if k in self.serving]
            api = _APIS.get(kind, f"{kind} API")
            message = f"this model ({self.task}, vLLM pooling task {self.pooling_task}) has no {api}"
            return _openai_error(path, 400, f"{message}; it serves {', '.join(served) or 'nothing'}")
        if kind == "lmi":
            normalize = True if self.normalize is None else self.normalize
            request: Any = EmbeddingCompletionRequest(
                input=_texts(body["inputs"]), model=body.get("model"), use_activation=normalize, priority=priority or 0
            )
        else:
            body = with_priority(body, priority)
            if kind == "embeddings" and self.normalize is not None:
                body = {"use_activation": self.normalize, **body}
            try:
                request = _REQUESTS[kind].validate_python(body)
            except ValidationError as exc:
                return _openai_error(path, 400, _detail(exc))
            except VLLMClientError as exc:
                return _openai_error(path, 400, str(exc), param=getattr(exc, "parameter", None))
        refused = priority_refusal(request, priority, self.priority_scheduling)
        if refused is not None:
            return _openai_error(path, 400, refused, param="priority")
        try:
            response = await serving(request, None)
        except (VLLMClientError, ValueError) as exc:  # vLLM's request checks (dimensions, length ...)
            response = create_error_response(exc)
        except _MALFORMED as exc:
            return _openai_error(path, 400, _malformed(exc))
        if isinstance(response, ErrorResponse):
            error = response.error
            return _openai_error(path, error.code, error.message, error.type, error.param)
        return await _output(response, kind)


async def _output(response: Any, kind: str) -> Output:
    """A Starlette response of vLLM's serving classes as an ``Output`` (LMI's form: the vectors)."""
    if hasattr(response, "body_iterator"):  # encoding_format bytes: the vectors' bytes, metadata in a header
        chunks = [chunk async for chunk in response.body_iterator]
        body = b"".join(c if isinstance(c, bytes) else c.encode() for c in chunks)
    else:
        body = bytes(response.body)
    output = Output(code=response.status_code)
    if kind == "lmi":
        vectors = [item["embedding"] for item in json.loads(body)["data"]]
        return output.add_property("content-type", "application/json").add(json.dumps(vectors))
    for name in ("metadata",):
        if name in response.headers:
            output.add_property(name, response.headers[name])
    return output.add_property("content-type", response.media_type or "application/json").add(body)
