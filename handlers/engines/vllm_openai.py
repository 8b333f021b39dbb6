"""The OpenAI schema on the vLLM engine: vLLM's own OpenAI serving classes (chat, completion,
responses, models) and its Anthropic Messages class, run in the worker around the same engine,
so their semantics (chat templates, logprobs, ``n``, usage, SSE ending with ``data: [DONE]``,
the Responses and Messages APIs' named events) are vLLM's."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp
from pydantic import BaseModel, ValidationError
from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses
from vllm.entrypoints.serve import create_error_response
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
from vllm.exceptions import VLLMClientError
from vllm.renderers.online_renderer import OnlineRenderer
from vllm.tokenizers.hf import ThreadSafeHFTokenizerMixin

from container.core.chat_options import ChatOptions, chat_template
from container.core.errors import (
    AnswerError,
    InputError,
    NotFound,
    OpenAIError,
    OpenAIErrorInfo,
    anthropic_envelope,
    is_anthropic_path,
    is_openai_path,
)
from container.core.request_priority import HEADER as PRIORITY_HEADER
from container.core.request_priority import refusal
from handlers.api import Output
from handlers.engines.chat_setup import check_parsers
from handlers.engines.vllm_media import FETCH_FAILED
from handlers.engines.vllm_observe import started

log = logging.getLogger("sagelmi.vllm")

# What vLLM raises on some bodies its schema lets through (fuzzing found `"tool_calls": true`
# and a message parsed as another type): the body's fault, so 400, logged as one line.
_MALFORMED = (TypeError, KeyError, AttributeError, IndexError)


def _malformed(exc: Exception) -> str:
    log.info("vLLM could not take the request: %s: %s", type(exc).__name__, exc)
    return f"the request could not be read ({type(exc).__name__}: {exc}); check the types of its fields"


def _media_error(exc: Exception) -> str | None:
    """What to tell the client when vLLM could not load a message's media (an ``image_url``):
    None for an exception that is not about media. vLLM answers the body's own faults (an
    undecodable image, more images than ``limit_mm_per_prompt``, a 404 from the image's host)
    itself, and sagelmi's media connector (``handlers.engines.vllm_media``) a host it could not
    reach; what vLLM raises instead are its refusals of ``file://`` URLs, worded for its command
    line, and, should any reach here, a fetch's raw failures: answered as the connector answers
    them, without the host, port or reason (those would map the network for the client)."""
    if isinstance(exc, (aiohttp.ClientError, TimeoutError)):  # asyncio's TimeoutError is this one
        log.info("a media URL could not be fetched: %s: %s", type(exc).__name__, exc)
        return FETCH_FAILED
    if isinstance(exc, (RuntimeError, ValueError)) and "allowed-local-media-path" in str(exc):
        # vLLM's text names its CLI flag and, for a file outside the directory, both local paths
        if "Cannot load local files" in str(exc):
            return "file:// media URLs are refused unless option.allowed_local_media_path names a directory to read"
        return "a file:// media URL must name a file inside the directory option.allowed_local_media_path names"
    return None


# A prompt this long or shorter is tokenized on the worker's loop, a longer one on vLLM's renderer
# thread. The hop to that thread and back costs two wake-ups, 100-300 µs on a busy machine; the
# tiny model's fast tokenizer takes ~0.2 µs a character (225 µs for this many), so a loop held
# longer than that would cost the other streams more than the hop costs this one.
INLINE_TOKENIZE_CHARS = 1024


def tokenize_short_prompts_inline(renderer: Any) -> bool:
    """Have ``renderer`` (vLLM's, which the OpenAI serving classes tokenize with) tokenize a
    prompt of up to ``INLINE_TOKENIZE_CHARS`` characters on the calling loop instead of in its
    thread pool: vLLM's server sends every prompt there, so each request's time to first token
    carries a thread's wake-up and the loop's. Only for a tokenizer vLLM made safe to call from
    several threads (its pool of copies, which counts one for the loop: ``engine.generate`` of a
    text prompt tokenizes there already); False, and nothing changed, for any other. Tokens,
    offsets and errors are the renderer's own: the same method runs, on another thread."""
    if not isinstance(renderer.tokenizer, ThreadSafeHFTokenizerMixin):
        return False
    tokenize, offloaded = renderer._tokenize_prompt, renderer._tokenize_prompt_async

    async def tokenize_prompt(prompt: Any, params: Any) -> Any:
        text = prompt.get("prompt")
        if isinstance(text, str) and len(text) <= INLINE_TOKENIZE_CHARS:
            return tokenize(prompt, params)
        return await offloaded(prompt, params)

    renderer._tokenize_prompt_async = tokenize_prompt
    return True


# vLLM's messages name its server's command-line flags; a sagelmi user sets the options of those names
_FLAGS = {
    "`--limit-mm-per-prompt`": "option.limit_mm_per_prompt",
    "--limit-mm-per-prompt": "option.limit_mm_per_prompt",
    "--trust-request-mm-kwargs": "option.trust_request_mm_kwargs=true",
}


# vLLM's refusal of more media than allowed; it names its flag only when the model would take more
# than the flag's value, and not for a model without a limit of its own
_MEDIA_COUNT = re.compile(r"^(At most \d+ \w+\(s\) may be provided in one prompt\.)(?! Set)")


def _options_named(message: str) -> str:
    """``message`` with vLLM's command-line flags replaced by the sagelmi options that set them, and
    a refusal of too many media naming ``option.limit_mm_per_prompt``."""
    for flag, option in _FLAGS.items():
        message = message.replace(flag, option)
    return _MEDIA_COUNT.sub(
        r"\1 Set option.limit_mm_per_prompt to increase this limit, as far as the model takes more.", message
    )


def _openai_error(
    path: str, status: int, message: str, err_type: str = "BadRequestError", param: str | None = None
) -> Output:
    """vLLM's refusal of an OpenAI (or Anthropic) body: in OpenAI's envelope on ``/v1/...`` (vLLM's
    type and param kept), in Anthropic's on ``/v1/messages...`` (its type by the status, as every
    error there: ``container.core.errors.anthropic_envelope``); on ``/invocations`` raised, so that
    it gets LMI's envelope like every error there. vLLM's flags in ``message`` are named as the
    options that set them."""
    message = _options_named(message)
    if is_anthropic_path(path):
        body = anthropic_envelope(status, "", message)
    elif is_openai_path(path):
        body = OpenAIError(error=OpenAIErrorInfo(message=message, type=err_type, param=param, code=status)).model_dump()
    else:
        raise (
            InputError(message)
            if status == 400
            else NotFound(message)
            if status == 404
            else AnswerError(message, status)
        )
    return Output(code=status).add_property("content-type", "application/json").add_as_json(body)


# The answers serialized as vLLM's server writes them (its routes' JSONResponse arguments): with the
# fields' aliases (Responses), without the fields that are None (Messages); the others as they are
_BY_ALIAS = ("responses",)
_WITHOUT_NONE = ("messages", "count_tokens")


def _named_event(event: BaseModel) -> str:
    """One event of a Responses stream as a server-sent event named by its type, as vLLM's server sends it."""
    return f"event: {getattr(event, 'type', 'unknown')}\ndata: {event.model_dump_json(by_alias=True)}\n\n"


def _responses_body(body: dict, path: str) -> dict | Output:
    """A Responses body as the server takes it: ``background`` refused (its answer would be fetched
    later, from a store the server does not keep), and ``store`` off, as vLLM leaves it unless
    ``VLLM_ENABLE_RESPONSES_API_STORE`` is set: a store kept in memory for every response, never
    emptied, that no route reads."""
    if body.get("background"):
        message = (
            "background responses are not served: the server keeps no responses to fetch later; "
            "send the request without 'background'"
        )
        return _openai_error(path, 400, message, param="background")
    return {**body, "store": False}


def with_priority(body: dict, header: int | None) -> dict:
    """``body`` with the ``X-Priority`` header's value as its ``priority`` (the header wins over
    the body, as vLLM's ``X-Vllm-Priority`` does on its server); ``body`` itself without one."""
    return body if header is None else {**body, "priority": header}


def priority_refusal(request: Any, header: int | None, scheduled: bool) -> str | None:
    """Why a validated vLLM request (its ``priority`` set by ``with_priority``) is refused for its
    priority, naming where it came from; None when it is not (``request_priority.refusal``)."""
    return refusal(request.priority, PRIORITY_HEADER if header is not None else "priority", scheduled)


class PrioritizedMessagesRequest(AnthropicMessagesRequest):
    """Anthropic's Messages request with the request's ``X-Priority`` (Anthropic's schema has no
    priority field; vLLM's Messages route reads one from its own header only)."""

    priority: int = 0


class PrioritizedServingMessages(AnthropicServingMessages):
    """vLLM's Messages serving class, the request's priority carried into the chat request it
    makes of a Messages request (and schedules as that)."""

    @classmethod
    def to_chat_completion_request(cls, anthropic_request: Any, **kwargs: Any) -> ChatCompletionRequest:
        chat = super().to_chat_completion_request(anthropic_request, **kwargs)
        chat.priority = getattr(anthropic_request, "priority", 0)
        return chat


class OpenAIFront:
    """vLLM's OpenAI serving classes around one engine, with the chat options (template, tool
    calling, reasoning) as vLLM's server takes them."""

    def __init__(
        self, engine: Any, served_name: str, options: ChatOptions, model_dir: str, priority_scheduling: bool = False
    ) -> None:
        self.engine = engine
        self.priority_scheduling = priority_scheduling  # option.scheduling_policy=priority
        self.models = OpenAIServingModels(engine, [BaseModelPath(name=served_name, model_path=served_name)])
        template = chat_template(options.chat_template, model_dir)
        if template is not None:
            log.info("chat template: option.chat_template=%s", (options.chat_template or "")[:80])
        check_parsers(options, engine.tokenizer, model_dir)
        chat_kwargs: dict[str, Any] = {
            "request_logger": None,
            "chat_template": template,
            "chat_template_content_format": options.chat_template_content_format,
            "enable_auto_tools": options.enable_auto_tool_choice,
            "tool_parser": options.tool_call_parser,
            "reasoning_parser": options.reasoning_parser or "",
        }
        if not tokenize_short_prompts_inline(engine.renderer):
            log.debug("prompts are tokenized on vLLM's renderer thread (%s)", type(engine.renderer.tokenizer).__name__)
        renderer = OnlineRenderer(
            model_config=engine.model_config,
            renderer=engine.renderer,
            trust_request_mm_kwargs=options.trust_request_mm_kwargs,
            **chat_kwargs,
        )
        self.chat = OpenAIServingChat(engine, self.models, "assistant", online_renderer=renderer, **chat_kwargs)
        self.completion = OpenAIServingCompletion(engine, self.models, online_renderer=renderer, request_logger=None)
        self.responses = OpenAIServingResponses(engine, self.models, renderer, **chat_kwargs)
        self.messages = PrioritizedServingMessages(
            engine, self.models, "assistant", online_renderer=renderer, **chat_kwargs
        )
        self.tokenization = ServingTokenization(
            self.models,
            renderer,
            chat_template=template,
            chat_template_content_format=options.chat_template_content_format,
        )

    async def models_listing(self) -> Output:
        """``/v1/models``: the served model and its adapters."""
        listing = await self.models.show_available_models()
        for card in listing.data:  # vLLM's root is a local path (the model's, an adapter's): never shown
            card.root = card.id
        return Output().add_property("content-type", "application/json").add(listing.model_dump_json())

    async def answer(self, kind: str, body: dict, path: str, priority: int | None = None) -> Output:
        """Answer an OpenAI ``chat``, ``completion``, ``responses``, ``tokenize`` or ``detokenize``
        body, or an Anthropic ``messages`` or ``count_tokens`` one (its ``model`` already resolved),
        as vLLM's server does. ``priority``: the request's ``X-Priority``, which wins over the
        body's ``priority`` (``with_priority``); a Messages request takes it from the header alone."""
        if kind in ("chat", "completion", "responses"):
            body = with_priority(body, priority)
        elif kind == "messages":  # Anthropic's schema has no priority: vLLM ignores one in the body
            body = {**body, "priority": priority or 0}
        tokenize: type[BaseModel] = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
        classes: dict[str, type[BaseModel]] = {
            "chat": ChatCompletionRequest,
            "completion": CompletionRequest,
            "responses": ResponsesRequest,
            "messages": PrioritizedMessagesRequest,
            "count_tokens": AnthropicCountTokensRequest,
            "tokenize": tokenize,
            "detokenize": DetokenizeRequest,
        }
        request_cls = classes[kind]
        if kind == "responses":
            taken = _responses_body(body, path)
            if isinstance(taken, Output):
                return taken
            body = taken
        try:
            request = request_cls.model_validate(body)
        except ValidationError as exc:
            detail = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
            return _openai_error(path, 400, detail)
        except VLLMClientError as exc:  # vLLM's own validators raise it, not a ValueError pydantic collects
            return _openai_error(path, 400, str(exc), param=getattr(exc, "parameter", None))
        except _MALFORMED as exc:  # a vLLM validator tripping over a body of the wrong shape
            return _openai_error(path, 400, _malformed(exc))
        if isinstance(request, (ChatCompletionRequest, CompletionRequest, ResponsesRequest)):
            refused = priority_refusal(request, priority, self.priority_scheduling)
            if refused is not None:
                return _openai_error(path, 400, refused, param="priority")
        if isinstance(request, DetokenizeRequest):
            vocabulary = self.engine.model_config.get_vocab_size()
            outside = [t for t in request.tokens if not 0 <= t < vocabulary]
            if outside:
                message = f"tokens: {outside[0]} is not a token id of this model (0 to {vocabulary - 1})"
                return _openai_error(path, 400, message, param="tokens")
        result: BaseModel | AsyncGenerator[Any, None]  # a response (ErrorResponse too), or SSE lines or events
        try:
            if isinstance(request, ChatCompletionRequest):
                result = await self.chat.create_chat_completion(request, None)
            elif isinstance(request, CompletionRequest):
                result = await self.completion.create_completion(request, None)
            elif isinstance(request, ResponsesRequest):
                result = await self.responses.create_responses(request, None)
            elif isinstance(request, AnthropicMessagesRequest):
                result = await self.messages.create_messages(request, None)
            elif isinstance(request, AnthropicCountTokensRequest):
                result = await self.messages.count_tokens(request, None)
            elif isinstance(request, DetokenizeRequest):
                result = await self.tokenization.create_detokenize(request, None)  # type: ignore[arg-type]
            else:  # vLLM's routes pass the Starlette request, which is only read for X-Request-Id
                result = await self.tokenization.create_tokenize(request, None)  # type: ignore[arg-type]
        except (VLLMClientError, ValueError, aiohttp.ClientError, TimeoutError, RuntimeError) as exc:
            media = _media_error(exc)
            if media is not None:
                log.info("%s", media)
                return _openai_error(path, 400, media)
            if not isinstance(exc, (VLLMClientError, ValueError)):
                raise
            result = create_error_response(exc)  # vLLM's request validation
        except _MALFORMED as exc:  # vLLM's chat renderer tripping over a message of a shape it accepted
            return _openai_error(path, 400, _malformed(exc))
        if isinstance(result, ErrorResponse):
            return _openai_error(path, result.error.code, result.error.message, result.error.type, result.error.param)
        if isinstance(result, BaseModel):
            answer = result.model_dump_json(by_alias=kind in _BY_ALIAS, exclude_none=kind in _WITHOUT_NONE)
            return Output().add_property("content-type", "application/json").add(answer)
        stream = await started(result)  # the head goes out once the engine has the request
        events = _named_event if kind == "responses" else None  # the others' items are server-sent events already
        return (
            Output().add_property("content-type", "text/event-stream; charset=utf-8").add_stream_content(stream, events)
        )
