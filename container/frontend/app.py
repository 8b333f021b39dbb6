"""The Flask app: SageMaker's ``/ping`` and ``/invocations``, relayed to worker
groups through the ``Router``.

Request path: read the body (413 past the limit, without reading it), admit
(503 when the queue is full or the server is draining), pick a worker group,
send, wait for the head (504 after ``predict_timeout``), then either return
the body or stream it chunk by chunk (HTTP/1.1 chunked) as the group produces
it. A client that disconnects mid-stream cancels its request in the group.
"""

from __future__ import annotations

import functools
import json
import logging
import select
import socket
import time
import uuid
from collections.abc import Callable, Iterator

import msgspec
from flask import Flask, Response, g, request
from prometheus_client import CONTENT_TYPE_LATEST
from werkzeug.exceptions import HTTPException

from container.core.artifacts import download_root
from container.core.errors import (
    ClientClosedRequest,
    GatewayTimeout,
    InputError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    QueueFull,
    ServingError,
    describe,
    envelope_for,
    is_openai_path,
)
from container.core.launch import FrontendLaunch, ModelInfo
from container.core.logs import request_id_var
from container.core.protocol import Invoke, WorkerState
from container.core.sessions import SESSION_ID
from container.core.tracing import TRACEPARENT, TRACESTATE, make_tracer
from container.frontend import openapi
from container.frontend.adapters import AdapterRegistry
from container.frontend.body import WSGI_RESPONSE, read_body
from container.frontend.completion import Answer, Completion
from container.frontend.group_client import GroupClient, PendingRequest
from container.frontend.management import add_management_routes
from container.frontend.metrics import FrontendMetrics
from container.frontend.poison import RequestStoppedEngine, fingerprint
from container.frontend.router import Router

log = logging.getLogger("sagelmi.frontend")

INFERENCE_ID = "X-Amzn-SageMaker-Inference-Id"
CLIENT_CHECK_INTERVAL = 0.5  # how often a request waiting on its group checks that its client is still there
CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
GROUP_HEADER = "X-Sagelmi-Group"  # which worker group answered (sticky sessions can be checked with it)
UNLOGGED = ("/ping", "/metrics")  # health checks and scrapes: no completion line, no span


def _error_response(exc: BaseException) -> Response:
    """The error in the envelope of the route the client called."""
    status, message, error = describe(exc)
    return Response(
        json.dumps(envelope_for(request.path, status, message, error)), status=status, mimetype="application/json"
    )


def request_properties(request_id: str, trace_headers: dict[str, str] | None = None) -> dict[str, str]:
    """The handler's ``Input`` properties, as DJL Serving builds them: the
    headers (a repeated one joined with ", "), the ``k=v`` pairs of the custom
    attributes header (in place of the header itself) and ``requestId``. With
    tracing on, ``trace_headers`` (the frontend span's W3C headers) replace the
    client's, as every hop of a trace does."""
    props: dict[str, str] = {}
    for name, value in request.headers.items():
        if trace_headers and name.lower() in (TRACEPARENT, TRACESTATE):
            continue
        if name.lower() == CUSTOM_ATTRIBUTES.lower():
            for pair in value.split(";"):
                key, sep, val = pair.partition("=")
                if sep and key.strip():
                    props[key.strip()] = val.strip()
            continue
        props[name] = f"{props[name]}, {value}" if name in props else value
    props["requestId"] = request_id
    if trace_headers:
        props.update(trace_headers)
    return props


def _in_band_error(exc: ServingError, content_type: str, path: str) -> bytes:
    """An error after a 200 stream began: sent as the stream's last item. A
    server-sent-events stream on an OpenAI route then ends as vLLM's does: the
    error event, then ``data: [DONE]``."""
    status, message, error = describe(exc)
    line = json.dumps(envelope_for(path, status, message, error))
    if not content_type.startswith("text/event-stream"):
        return f"{line}\n".encode()
    event = f"data: {line}\n\n"
    if is_openai_path(path):
        event += "data: [DONE]\n\n"
    return event.encode()


def client_gone(sock: socket.socket | None) -> bool:
    """Whether the client closed its connection (it is readable, and at its end)."""
    if sock is None:
        return False
    try:
        poller = select.poll()  # not select(): descriptors past 1024 are common with many threads
        poller.register(sock, select.POLLIN)
        if not poller.poll(0):
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):
        return True


class ClientSink:
    """The client's socket of a streamed answer whose headers gunicorn has sent,
    for ``PendingRequest.attach``: frames chunks as gunicorn does (HTTP/1.1
    chunked, or raw for an HTTP/1.0 client)."""

    def __init__(self, sock: socket.socket, chunked: bool) -> None:
        self.sock = sock
        self.chunked = chunked

    @classmethod
    def of(cls, environ: dict) -> ClientSink | None:
        """The sink of this request, if it is served by gunicorn over a plain
        blocking socket and its headers are sent; otherwise ``None`` (the request
        thread writes everything)."""
        response = environ.get(WSGI_RESPONSE)
        sock = environ.get("gunicorn.socket")
        if response is None or not getattr(response, "headers_sent", False):
            return None
        if not isinstance(sock, socket.socket) or sock.gettimeout() is not None:
            return None
        return cls(sock, bool(response.chunked))

    def frame(self, data: bytes) -> bytes:
        return b"%X\r\n%s\r\n" % (len(data), data) if self.chunked else data

    def send_nowait(self, frame: bytes) -> int:
        return self.sock.send(frame, socket.MSG_DONTWAIT)

    def send_all(self, frame: bytes) -> None:
        self.sock.sendall(frame)


class Invocation:
    """One request in flight: owns its queue slot until the answer is sent.

    While it waits for its group, it looks every ``CLIENT_CHECK_INTERVAL`` at the
    client's connection: a client that left has its request cancelled then,
    not only when the next piece of a stream fails to reach it (an engine may
    deliver nothing for seconds)."""

    def __init__(
        self,
        router: Router,
        launch: FrontendLaunch,
        request_id: str,
        client: socket.socket | None = None,
        trace_headers: dict[str, str] | None = None,
    ) -> None:
        self.router = router
        self.launch = launch
        self.request_id = request_id
        self.client = client
        self.path = request.path
        self.environ = request.environ  # the stream is written after the request context ended
        self.wire_id = uuid.uuid4().hex
        self.group: GroupClient | None = None
        self.pending: PendingRequest | None = None
        self._released = False
        self.answer = Answer()  # what the completion line says
        self.trace_headers = trace_headers  # the frontend span's: the worker's span is its child

    @property
    def submitted(self) -> PendingRequest:
        """The request in its group: ``run`` submits it before anything waits on it."""
        assert self.pending is not None, "the request is not submitted yet"
        return self.pending

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.router.release()

    def abandon(self) -> None:
        if self.group is not None:
            self.group.cancel(self.wire_id)

    def run(self, body: bytes) -> Response:
        print_ = fingerprint(request.full_path, body)
        self.router.poison.check(print_)
        self.router.admit()
        admitted = time.monotonic()
        streaming = False
        try:
            session_id = request.headers.get(SESSION_ID)
            self.group = self.router.pick_for(session_id)
            incarnation = self.group.incarnation
            self.pending = self.group.submit(
                Invoke(
                    id=self.wire_id,
                    properties=request_properties(self.request_id, self.trace_headers),
                    body=body,
                    path=request.path,
                    query=request.query_string.decode("latin-1"),
                ),
                tag=(print_, self.request_id, request.path),
            )
            try:
                self._await(self.pending.wait_head_for, "no answer from the model")
                head = self.pending.wait_head(0)
                if head.started:  # the same clock in every process of the machine
                    self.answer.queue_wait = head.started - admitted
                headers = self.router.sessions.observe(session_id, self.group, incarnation, head.code, head.headers)
                headers[GROUP_HEADER] = self.group.name
                if head.stream:
                    streaming = self.answer.streamed = True
                    content_type = head.headers.get("content-type", "")
                    return Response(self._relay(content_type), status=head.code, headers=headers)
                body = self._body()
                self._count_tokens()
                return Response(body, status=head.code, headers=headers)
            except ServingError:
                self.abandon()
                raise
        finally:
            if not streaming:
                self.release()

    def _await(self, wait: Callable[[float], bool], what: str) -> None:
        """Wait (``wait(seconds)``, True once ready) up to ``predict_timeout``;
        raises ``GatewayTimeout``, or ``ClientClosedRequest`` as soon as the
        client is seen gone. Time counts from the request's last message: a
        stream the reader thread writes itself moves on without waking this
        thread."""
        deadline = time.monotonic() + self.launch.predict_timeout
        pending = self.submitted
        progress = pending.progress
        while not wait(min(CLIENT_CHECK_INTERVAL, max(deadline - time.monotonic(), 0))):
            if pending.progress != progress:
                progress = pending.progress
                deadline = time.monotonic() + self.launch.predict_timeout
            elif time.monotonic() >= deadline:
                raise GatewayTimeout(f"{what} within {self.launch.predict_timeout:g}s (option.predict_timeout)")
            if client_gone(self.client):
                raise ClientClosedRequest("the client closed the connection before the answer was ready")

    def _next(self) -> bytes | None:
        """The next piece of the answer (``None`` at its end), within ``predict_timeout``."""
        self._await(self.submitted.wait_data_for, "the model sent nothing")
        return self.submitted.next_data(0)

    def _body(self) -> bytes:
        parts = []
        while (data := self._next()) is not None:
            parts.append(data)
        return b"".join(parts)

    def _count_tokens(self) -> None:
        end = self.submitted.end
        if end is not None:
            self.answer.prompt_tokens, self.answer.completion_tokens = end.prompt_tokens, end.completion_tokens

    def _relay(self, content_type: str) -> Iterator[bytes]:
        request_id_var.set(self.request_id)
        finished = False
        in_band = b""
        try:
            first = True
            while (data := self._next()) is not None:
                yield data
                if first:  # the headers are out: the reader thread can write the rest
                    first = False
                    if (sink := ClientSink.of(self.environ)) is not None:
                        self.submitted.attach(sink)
            finished = True
            self.answer.outcome = "completed"
        except ClientClosedRequest:
            pass  # cancelled below, as when a write finds the client gone
        except ServingError as exc:
            finished = True
            self.answer.outcome = "timeout" if isinstance(exc, GatewayTimeout) else "error"
            if isinstance(exc, GatewayTimeout):
                self.abandon()
            log.warning("stream ended with an error: %s", exc)
            try:
                self.submitted.take_over()
            except ClientClosedRequest:
                self.answer.outcome = "client_gone"
                return  # the client is gone too
            in_band = _in_band_error(exc, content_type, self.path)
            yield in_band
        finally:
            if not finished:
                log.info("client went away during the stream; cancelling the request")
                self.answer.outcome = "client_gone"
                self.abandon()
            self.answer.bytes = self.submitted.body_bytes + len(in_band)
            self._count_tokens()
            self.release()


def create_app(launch: FrontendLaunch) -> Flask:
    router = Router(launch)
    model = launch.model or ModelInfo(name="model", location="")
    launch = msgspec.structs.replace(launch, model=model)
    registry = AdapterRegistry(model, router.groups, launch.predict_timeout, str(download_root()))
    router.start()  # after the registry: it replays itself on every connection
    app = Flask("sagelmi")
    app.config["MAX_CONTENT_LENGTH"] = launch.max_payload_bytes
    app.extensions["sagelmi"] = router
    metrics = FrontendMetrics()
    tracer = make_tracer(launch.traces_exporter, "frontend")
    app.extensions["sagelmi.tracer"] = tracer  # shut down (spans flushed) when the frontend drains

    @app.before_request
    def _start() -> None:
        g.request_id = request.headers.get(INFERENCE_ID) or uuid.uuid4().hex
        g.started = time.monotonic()
        request_id_var.set(g.request_id)
        if tracer is not None and request.path not in UNLOGGED:
            route = request.url_rule.rule if request.url_rule else "unmatched"
            attributes = {"http.request.method": request.method, "url.path": request.path, "http.route": route}
            g.span = tracer.start(f"{request.method} {route}", request.headers, attributes, server=True)
            g.span.set_attribute("sagelmi.request_id", g.request_id)

    @app.after_request
    def _finish(resp: Response) -> Response:
        if request.path not in UNLOGGED:
            elapsed = time.monotonic() - g.started
            resp.headers[INFERENCE_ID] = g.request_id
            route = request.url_rule.rule if request.url_rule else "unmatched"
            metrics.observe(route, resp.status_code, elapsed)
            invocation = g.get("invocation")
            completion = Completion(
                metrics,
                g.request_id,
                request.method,
                request.path,
                route,
                resp.status_code,
                g.started,
                elapsed,
                invocation.answer if invocation is not None else None,
                None if resp.is_streamed else resp.calculate_content_length(),  # (a stream would be read whole)
                g.get("span"),
            )
            resp.call_on_close(completion)
        return resp

    @app.teardown_request
    def _forget(_exc) -> None:
        request_id_var.set("-")

    @app.errorhandler(ServingError)
    def _serving_error(exc: ServingError) -> Response:
        if isinstance(exc, RequestStoppedEngine):
            metrics.poison_refused.inc()
        elif isinstance(exc, QueueFull):
            metrics.queue_full.inc()
        return _error_response(exc)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Response:
        by_code: dict[int | None, ServingError] = {
            404: NotFound(
                f"no route {request.method} {request.path}; the server answers GET /ping, "
                f"POST /invocations, POST /v1/chat/completions, POST /v1/completions, GET /v1/models, "
                f"POST /tokenize, POST /detokenize, POST /v1/embeddings, POST /v1/score, POST /v1/rerank, "
                f"GET /models, /models/{{model}}/adapters, GET /openapi.json"
            ),
            405: MethodNotAllowed(f"{request.method} is not allowed on {request.path}"),
            413: PayloadTooLarge(
                f"the request body is {request.content_length or 'more than'} bytes; the limit is "
                f"{launch.max_payload_bytes} bytes (max_payload_in_mb / SAGEMAKER_MAX_PAYLOAD_IN_MB)"
            ),
        }
        mapped = by_code.get(
            exc.code, InputError(exc.description or exc.name) if (exc.code or 500) < 500 else ServingError()
        )
        return _error_response(mapped)

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Response:
        log.exception("unexpected error")
        return _error_response(ServingError())

    @app.get("/ping")
    def ping() -> Response:
        healthy, body = router.health()
        return Response(json.dumps(body), status=200 if healthy else 503, mimetype="application/json")

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        metrics.in_flight.set(router.in_flight)
        texts = {}
        for client, group in zip(router.groups, launch.groups):
            metrics.worker_ready.labels(str(group.index)).set(1 if client.state is WorkerState.READY else 0)
            try:
                texts[str(group.index)] = client.fetch_metrics(timeout=5)
            except ServingError as exc:
                log.warning("no metrics from worker group %s: %s", client.name, exc)
        return Response(metrics.render(texts), mimetype=CONTENT_TYPE_LATEST)

    @functools.cache
    def openapi_text() -> str:  # 125 KB of JSON: rendered at the first request, then reused
        return json.dumps(openapi.for_model(model.builtin_schemas))

    @app.get("/openapi.json")
    def openapi_document() -> Response:
        return Response(openapi_text(), mimetype="application/json")

    @app.get("/execution-parameters")
    def execution_parameters() -> Response:
        body = {
            "MaxConcurrentTransforms": len(router.groups),
            "BatchStrategy": "SINGLE_RECORD",
            "MaxPayloadInMB": max(1, launch.max_payload_bytes // (1024 * 1024)),
        }
        return Response(json.dumps(body), mimetype="application/json")

    # The handler answers these: SageMaker's entry and the OpenAI-compatible routes.
    @app.post("/invocations")
    @app.post("/v1/chat/completions")
    @app.post("/v1/completions")
    @app.get("/v1/models")
    @app.post("/tokenize")
    @app.post("/detokenize")
    @app.post("/v1/embeddings")
    @app.post("/v1/score")
    @app.post("/v1/rerank")
    def invocations() -> Response:
        body = read_body(request.environ, request.content_length, launch.max_payload_bytes, launch.body_read_timeout)
        span = g.get("span")
        trace_headers = tracer.headers_of(span) if tracer is not None and span is not None else None
        g.invocation = Invocation(router, launch, g.request_id, request.environ.get("gunicorn.socket"), trace_headers)
        return g.invocation.run(body)

    add_management_routes(app, router, registry, launch)
    return app
